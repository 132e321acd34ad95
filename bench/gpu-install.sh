#!/usr/bin/env bash
# Installs mopd's wheel, as users install it, into the private folder SITE (bench/gpu.sh's install step):
# dist/mopd-*.whl when the working tree carries one, else a wheel built here; with --no-deps, so the
# machine's own torch, transformers and the rest serve it, plus the wheels in MOPD_WHEELS=DIR that the
# machine lacks. Then imports the trainer, precompute and the CLI from SITE alone: the interpreter runs
# without its site hooks (no editable install's finder), with SITE and its site-packages on the path.
#
#   bench/gpu-install.sh SITE
set -euo pipefail
cd "$(dirname "$0")/.."
site=$1
mkdir -p "$site"
wheel=$(find dist -maxdepth 1 -name 'mopd-*.whl' 2>/dev/null | sort | tail -n 1)
if [[ -z $wheel ]]; then
    built=$(mktemp -d)
    python3 -m pip wheel -q --no-deps --no-build-isolation -w "$built" .
    wheel=$(find "$built" -name 'mopd-*.whl')
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheel"
if [[ -n "${MOPD_WHEELS:-}" ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
        "$MOPD_WHEELS"/*.whl || echo "gpu-install.sh: the wheels in $MOPD_WHEELS did not install; going on without them"
fi
packages=$(python3 -c 'import site; print(":".join(site.getsitepackages()))')
PYTHONPATH="$site:$packages" python3 -S - "$site" <<'PY'
import importlib
import sys
from pathlib import Path

site = Path(sys.argv[1]).resolve()
for name in ("mopd.cli.main", "mopd.precompute.runner", "mopd.train.trainer"):
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as err:
        sys.exit(f"gpu-install.sh: {name} needs {err.name}, which this machine lacks: carry its wheel in MOPD_WHEELS")
    assert Path(module.__file__).resolve().is_relative_to(site), f"{name} from {module.__file__}, not {site}"
print(f"gpu-install.sh: mopd's wheel imports from {site}")
PY
