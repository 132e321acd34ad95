#!/usr/bin/env bash
# One command for a GPU machine (issue 19): the gpu-marked tests, then bench/gpu.py. ≤ 10 minutes on
# one H200. mopd is installed from its wheel, with --no-deps, into a private folder (bench/gpu-install.sh:
# the package users install, served by the machine's own torch and the rest); wheels the machine lacks
# (the store's dependencies, liger-kernel) may be given as MOPD_WHEELS=DIR and go to the same folder,
# never into the system's packages.
# Results: bench/results/gpu.json and, when OUT is set, copies of the logs and the JSON under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
site=$(mktemp -d)
bench/gpu-install.sh "$site" || exit 1
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
