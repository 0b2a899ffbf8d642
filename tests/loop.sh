#!/usr/bin/env bash
# Flake hunt: run the process-level suites (real gateways, workers and sockets) N times
# in a row and stop at the first failure. BUSY=1 keeps every core busy with another
# process meanwhile, the way a loaded CI machine would.
#   bash tests/loop.sh [N] [BUSY]      (make loop LOOPS=10 BUSY=1)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-10}
busy=${2:-0}
if [ "$busy" = 1 ]; then
  for _ in $(seq "$(nproc)"); do (while :; do :; done) & done
  trap 'kill $(jobs -p) 2>/dev/null' EXIT
fi
for i in $(seq "$runs"); do
  echo "loop: run $i of $runs (busy=$busy)"
  .venv/bin/python -m pytest -q -p no:cacheprovider tests/e2e tests/observability tests/multihost \
    || { echo "loop: run $i of $runs failed"; exit 1; }
done
echo "loop: $runs of $runs runs passed (busy=$busy)"
