#!/usr/bin/env bash
# The C example (through `make demo-mlp`): a standalone zerod daemon
# with 2 CPU ranks, and 2 worker processes of the C example training a
# small MLP (2.4M parameters) through it with data parallelism. Rank 0's
# worker prints the loss and throughput; everything is shut down at the end.
#
#   scripts/demo.sh [BUILD_DIR] [STEPS]
set -euo pipefail
build=${1:-build/release}
steps=${2:-${ZEROD_DEMO_STEPS:-150}}
ranks=2

state=$(mktemp -d "${TMPDIR:-/tmp}/zerod-demo.XXXXXX")
socket="$state/zerod.sock"
daemon_pid=
workers=()
cleanup() {
  for pid in "${workers[@]}"; do kill "$pid" 2>/dev/null || true; done
  if [ -n "$daemon_pid" ]; then
    kill -TERM "$daemon_pid" 2>/dev/null || true
    wait "$daemon_pid" 2>/dev/null || true
  fi
  rm -rf "$state"
}
trap cleanup EXIT

echo "== starting zerod (standalone, $ranks CPU ranks, state in $state)"
"$build/bin/zerod" standalone --ranks "$ranks" --dir "$state" --socket "$socket" \
  --threads-per-rank 1 2> >(sed 's/^/[zerod] /' >&2) &
daemon_pid=$!
for _ in $(seq 1 100); do
  [ -S "$socket" ] && break
  kill -0 "$daemon_pid" 2>/dev/null || { echo "zerod exited early" >&2; exit 1; }
  sleep 0.1
done
[ -S "$socket" ] || { echo "zerod did not create $socket" >&2; exit 1; }

echo "== training: $ranks workers, $steps steps, global batch 64 (32 per rank)"
for rank in $(seq 0 $((ranks - 1))); do
  "$build/bin/zerod-mlp-train" --socket "$socket" --job demo --local-rank "$rank" \
    --steps "$steps" --batch 64 --log-every 10 &
  workers+=($!)
done
status=0
for pid in "${workers[@]}"; do
  wait "$pid" || status=1
done
workers=()

echo "== stopping zerod"
kill -TERM "$daemon_pid"
wait "$daemon_pid" || status=1
daemon_pid=
exit $status
