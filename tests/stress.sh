#!/usr/bin/env bash
# The whole suite N times in a row (default 20), every other run with both CPUs kept busy by
# two CPU hogs: a test that fails one run in N shows here before it lands. Stops at the first
# failing run and says which. `make stress-test` runs it after setting up.
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-20}
hogs=()
stop_hogs() { for pid in "${hogs[@]}"; do kill "$pid" 2>/dev/null; done; hogs=(); }
trap stop_hogs EXIT
for ((run = 1; run <= runs; run++)); do
    load="unloaded"
    if ((run % 2 == 0)); then
        load="loaded"
        for _ in 1 2; do (while :; do :; done) & hogs+=($!); done
    fi
    started=$SECONDS
    if ! .venv/bin/pytest -q -p no:cacheprovider -x "${@:2}" > "/tmp/dynprobe-stress-$run.log" 2>&1; then
        stop_hogs
        echo "run $run of $runs ($load) failed after $((SECONDS - started)) s: /tmp/dynprobe-stress-$run.log"
        grep -E "^(FAILED|ERROR)" "/tmp/dynprobe-stress-$run.log"
        exit 1
    fi
    stop_hogs
    echo "run $run of $runs ($load): $(tail -n 1 "/tmp/dynprobe-stress-$run.log") ($((SECONDS - started)) s)"
done
echo "all $runs runs passed"
