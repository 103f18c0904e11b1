#!/usr/bin/env bash
# The GPU check: one command for a machine with one GPU (about 8 minutes on an H200).
#
#   bash benchmarks/gpu_check.sh OUT_DIR            the GPU tests, then the MFU benchmark
#   bash benchmarks/gpu_check.sh OUT_DIR --dry-run  any machine: imports, collects the GPU tests,
#                                                   builds the benchmark model on the meta device
#
# Installs the small dependencies the GPU image lacks from gpu-wheels/ when it is there
# (benchmarks/gpu_wheels.sh makes it). Every collective runs through NCCL even at world size 1
# (RAYDEEP_COLLECTIVES_AT_WORLD_1=1). Writes OUT_DIR/summary.json (and the pytest and benchmark
# outputs beside it); exits non-zero when a GPU test fails.
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR [--dry-run]}
mode=${2:-}
cd "$(dirname "$0")/.."
mkdir -p "$out"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" RAYDEEP_COLLECTIVES_AT_WORLD_1=1
if [ -d gpu-wheels ] && [ "$mode" != --dry-run ]; then
    "$PY" -m pip install --quiet --no-index --find-links gpu-wheels pydantic hjson pytest-timeout || exit 2
fi
"$PY" -c "import raydeep, raydeep.engine, raydeep.zero, raydeep.tier, raydeep.checkpoint" || exit 2
if [ "$mode" = --dry-run ]; then
    "$PY" -m pytest -q -p no:cacheprovider -m gpu --collect-only tests/gpu > "$out/pytest.txt" 2>&1
    tests=$?
    "$PY" -m benchmarks.mfu --dry-run --json "$out/mfu.json" > "$out/mfu.txt" 2>&1
    bench=$?
else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
    timeout 360 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu --junitxml "$out/junit.xml" \
        > "$out/pytest.txt" 2>&1
    tests=$?
    timeout 240 "$PY" -m benchmarks.mfu --json "$out/mfu.json" > "$out/mfu.txt" 2>&1
    bench=$?
fi
"$PY" - "$out" "$mode" "$tests" "$bench" <<'PYEOF'
import json, sys
out, mode, tests, bench = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
lines = open(f"{out}/pytest.txt").read().strip().splitlines()
summary = {"mode": mode or "run", "pytest_exit": tests, "pytest_last_line": lines[-1] if lines else "",
           "benchmark_exit": bench}
try:
    summary["mfu"] = json.load(open(f"{out}/mfu.json"))
except (OSError, ValueError):
    summary["mfu"] = None
json.dump(summary, open(f"{out}/summary.json", "w"), indent=2)
print(json.dumps({k: v for k, v in summary.items() if k != "mfu"}))
PYEOF
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
