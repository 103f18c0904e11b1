#!/usr/bin/env bash
# The whole suite as `make test` (and so CI) runs it: two pytest processes at once, tests/ray
# beside everything else. One process alone leaves the cores idle about a third of the time
# (waiting on Ray's controllers, process start-ups, gloo), and tests/ray is half the suite, so
# running it beside the rest takes the wall time from about 16-19 minutes to about 12 on 2 cores.
#
# Each process gets its own RAY_TMPDIR (Ray's sessions, sockets and the address file a plain
# `ray.init()` reads), so a cluster one of them starts is never found by the other. Within each
# process the tests run in the usual order, one at a time. Exit status: the first failure's.
#
#   tests/run_suite.sh PYTHON [pytest options...]
set -u
python=$1
shift
scratch=$(mktemp -d)
mkdir -p "$scratch/ray-tests" "$scratch/other-tests"

# Ray modules that bring their own cluster (no shared one to start twice) run with the other
# tests, so that the two processes take about as long.
beside=(tests/ray/test_job_submit.py)
ray_args=(tests/ray) other_args=()
for module in tests/ray/test_*.py; do
    if [[ " ${beside[*]} " == *" $module "* ]]; then
        ray_args+=(--ignore="$module")
    else
        other_args+=(--ignore="$module")
    fi
done

RAY_TMPDIR="$scratch/ray-tests" "$python" -m pytest -q "${ray_args[@]}" "$@" > "$scratch/ray.log" 2>&1 &
ray_pid=$!
trap 'kill "$ray_pid" 2>/dev/null; rm -rf "$scratch"' EXIT
trap 'exit 130' INT TERM

RAY_TMPDIR="$scratch/other-tests" "$python" -m pytest -q "${other_args[@]}" "$@"
other=$?
wait "$ray_pid"
ray=$?

echo
echo "=================== tests/ray but ${beside[*]} (ran beside the tests above) ==================="
cat "$scratch/ray.log"
echo
echo "the other tests: exit $other; tests/ray: exit $ray"
if [ "$other" -ne 0 ]; then exit "$other"; fi
exit "$ray"
