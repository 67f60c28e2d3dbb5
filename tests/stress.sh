#!/usr/bin/env bash
# Runs a test tier while a CPU-bound process keeps one core busy: the tests must pass on a loaded machine.
#   bash tests/stress.sh -n 2            the quick tier (the README's test command), 3 runs in a row
#   RUNS=2 bash tests/stress.sh -m slow  the matrix tier, 2 runs in a row
# Further arguments go to pytest. Stops at the first failing run; the busy process ends with the script.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${RUNS:-3}
python -c "while True: pass" &
busy=$!
trap 'kill "$busy"' EXIT
for i in $(seq "$runs"); do
    echo "stress run $i of $runs (one core busy: pid $busy)"
    start=$SECONDS
    python -m pytest -q -p no:cacheprovider "$@"
    echo "stress run $i passed in $((SECONDS - start)) s"
done
