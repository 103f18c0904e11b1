#!/usr/bin/env bash
# The whole suite as `make test` (and so CI) runs it: two pytest processes at once, tests/ray
# beside everything else. One process alone leaves the cores idle about a third of the time
# (waiting on Ray's controllers, process start-ups, gloo); the other tests fill those gaps.
#
# tests/ray runs at normal priority and the rest at `nice 19`, so the Ray tests, whose kills and
# node losses must land while a short run is still going, keep the CPU as when they run alone,
# and the other tests take what they leave. Each process gets its own RAY_TMPDIR (Ray's sessions,
# sockets and the address file a plain `ray.init()` reads), so a cluster one of them starts is
# never found by the other. Within each process the tests run in the usual order, one at a time.
# Exit status: the first failure's.
#
#   tests/run_suite.sh PYTHON [pytest options...]
set -u
python=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")  # absolute, the venv's link kept
shift
cd "$(dirname "$0")/.."
scratch=$(mktemp -d)
mkdir -p "$scratch/ray-tests" "$scratch/other-tests"

RAY_TMPDIR="$scratch/other-tests" nice -n 19 "$python" -m pytest -q --ignore=tests/ray "$@" \
    > "$scratch/other.log" 2>&1 &
other_pid=$!
trap 'kill "$other_pid" 2>/dev/null; rm -rf "$scratch"' EXIT
trap 'exit 130' INT TERM

RAY_TMPDIR="$scratch/ray-tests" "$python" -m pytest -q tests/ray "$@"
ray=$?
wait "$other_pid"
other=$?

echo
echo "=================== every test but tests/ray (ran beside tests/ray, at nice 19) ==================="
cat "$scratch/other.log"
echo
echo "tests/ray: exit $ray; the other tests: exit $other"
if [ "$ray" -ne 0 ]; then exit "$ray"; fi
exit "$other"
