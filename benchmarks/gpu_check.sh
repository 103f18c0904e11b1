#!/usr/bin/env bash
# The GPU check: one command for a machine with one GPU, within 8 minutes including the
# install (each stage has its own time limit; together 7 min 45 s).
#
#   bash benchmarks/gpu_check.sh OUT_DIR            install, the GPU tests, then the MFU benchmark
#   bash benchmarks/gpu_check.sh OUT_DIR --dry-run  any machine: imports, collects the GPU tests,
#                                                   builds the benchmark model on the meta device
#
# Whatever happens -- a missing wheel, a failing or hung test, a benchmark contender that raises,
# a stage killed by its time limit -- OUT_DIR/summary.json is written on exit (an EXIT trap runs
# benchmarks/gpu_summary.py): the stage that failed, each stage's exit and seconds, each test's
# result from the junit report, the MFU results as far as they got, the peak TFLOPS used and the
# matmul rate measured. Each stage's output is OUT_DIR/<stage>.txt.
#
# The GPU image lacks pydantic, hjson and pytest-timeout: they are installed from $GPU_WHEELS
# (default gpu-wheels/, made by benchmarks/gpu_wheels.sh; carry it to the GPU machine). Every
# collective runs through NCCL even at world size 1 (RAYDEEP_COLLECTIVES_AT_WORLD_1=1).
# $GPU_CHECK_TESTS (default tests/gpu) and $GPU_CHECK_MFU_ARGS choose what runs (how the check's
# own handling of failures is tested on a CPU).
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR [--dry-run]}
mode=${2:-}
cd "$(dirname "$0")/.."
mkdir -p "$out"
out=$(cd "$out" && pwd)
PY=${PYTHON:-python3}
WHEELS=${GPU_WHEELS:-gpu-wheels}
TESTS=${GPU_CHECK_TESTS:-tests/gpu}
eval "MFU_ARGS=(${GPU_CHECK_MFU_ARGS:---steps 12 --warmup 4})"  # shell words: a contender's name has spaces
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" RAYDEEP_COLLECTIVES_AT_WORLD_1=1
: > "$out/stages.tsv"
rm -f "$out/summary.json" "$out/junit.xml" "$out/mfu.json"
current=start
failed=0

summarise() {
    local code=$?
    [ "$failed" -ne 0 ] && [ "$code" -eq 0 ] && code=1
    "$PY" benchmarks/gpu_summary.py "$out" "$mode" "$current" "$code" \
        || printf '{"mode": "%s", "exit": %d, "failed_stage": "%s", "failure": "the summary writer failed"}\n' \
            "${mode:-run}" "$code" "$current" > "$out/summary.json"
    exit "$code"
}
trap summarise EXIT
trap 'exit 143' TERM INT  # a stop from outside still writes the summary

# stage NAME SECONDS COMMAND...: run COMMAND with a time limit, its output in NAME.txt, and
# record its exit code and seconds for the summary.
stage() {
    current=$1
    local limit=$2 began=$SECONDS code
    shift 2
    timeout --kill-after=10 "$limit" "$@" > "$out/$current.txt" 2>&1
    code=$?
    printf '%s\t%d\t%d\n' "$current" "$code" $((SECONDS - began)) >> "$out/stages.tsv"
    [ "$code" -ne 0 ] && failed=1
    return "$code"
}

if [ "$mode" != --dry-run ]; then
    if [ ! -d "$WHEELS" ]; then
        current=install
        echo "no $WHEELS/ here: the GPU image lacks pydantic, hjson and pytest-timeout. Fix: on a machine with a" \
             "package index run 'bash benchmarks/gpu_wheels.sh', then bring gpu-wheels/ with the checkout" \
             "(the device tool: carry [\"gpu-wheels\"])" > "$out/install.txt"
        printf 'install\t2\t0\n' >> "$out/stages.tsv"
        exit 2
    fi
    stage install 60 "$PY" -m pip install --no-index --find-links "$WHEELS" pydantic hjson pytest-timeout || exit 2
fi
stage import 30 "$PY" -c "import raydeep, raydeep.engine, raydeep.zero, raydeep.tier, raydeep.checkpoint" || exit 2

if [ "$mode" = --dry-run ]; then
    stage tests 120 "$PY" -m pytest -q -p no:cacheprovider -m gpu --collect-only "$TESTS"
    stage mfu 120 "$PY" -m benchmarks.mfu --dry-run --json "$out/mfu.json"
else
    # What the machine is, for the summary; not a stage: its absence fails nothing of raydeep's.
    timeout 15 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
    stage tests 240 "$PY" -m pytest -q -p no:cacheprovider -m gpu --timeout 90 "$TESTS" --junitxml "$out/junit.xml"
    stage mfu 120 "$PY" -m benchmarks.mfu --json "$out/mfu.json" "${MFU_ARGS[@]}"
fi
current=done
exit "$failed"
