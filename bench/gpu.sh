#!/usr/bin/env bash
# One command for a GPU machine (issue 19): the gpu-marked tests, then bench/gpu.py. ≤ 10 minutes on
# one H200. mopd need not be installed: its folders are put on the path as the `mopd` namespace, the
# way setup.py maps them. Extra wheels (the store's dependencies, liger-kernel) may be given as
# MOPD_WHEELS=DIR; they go to a private folder, never into the system's packages.
# Results: bench/results/gpu.json and, when OUT is set, copies of the logs and the JSON under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
site=$(mktemp -d)
mkdir -p "$site/mopd"
for init in "$root"/*/__init__.py; do  # every top-level package folder, as setup.py maps them
    layer=$(basename "$(dirname "$init")")
    [[ $layer == tests || $layer == bench ]] || ln -s "$root/$layer" "$site/mopd/$layer"
done
if [[ -n "${MOPD_WHEELS:-}" ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
        "$MOPD_WHEELS"/*.whl || echo "gpu.sh: the wheels in $MOPD_WHEELS did not install; going on without them"
fi
export PYTHONPATH="$site:$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=${OUT:-$root/bench/results}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null

# Only the files that hold gpu-marked tests: the rest of the suite needs packages a GPU image lacks.
mapfile -t gpu_tests < <(grep -rl --include='test_*.py' 'pytest.mark.gpu' tests)
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu "${gpu_tests[@]}" 2>&1 | tee "$out/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}
timeout 420 python3 bench/gpu.py --out "$out/gpu.json" "$@" 2>&1 | tee "$out/gpu-bench.log"
bench_rc=${PIPESTATUS[0]}
echo "gpu tests exit $tests_rc, bench exit $bench_rc"
[[ $tests_rc == 0 && $bench_rc == 0 ]]
