#!/usr/bin/env bash
# End-to-end steps/s of the example MLP trained through a standalone zerod
# with 2 ranks and 2 worker processes, against the same training (same model,
# data, batch and optimizer) in one process without zerod
# (zerod-mlp-reference --world 2), measured in the same run. Prints one JSON
# line.
#
#   scripts/bench_e2e.sh [BUILD_DIR] [STEPS]
set -euo pipefail
build=${1:-build/release}
steps=${2:-60}
state=$(mktemp -d "${TMPDIR:-/tmp}/zerod-bench.XXXXXX")
trap 'kill -TERM $daemon_pid 2>/dev/null || true; wait $daemon_pid 2>/dev/null || true; rm -rf "$state"' EXIT
"$build/bin/zerod" standalone --ranks 2 --dir "$state" --threads-per-rank 1 --log-level warn &
daemon_pid=$!
for _ in $(seq 1 100); do [ -S "$state/zerod.sock" ] && break; sleep 0.1; done

rate() { sed -n 's/.* \([0-9.]*\) steps\/s.*/\1/p' | tail -1; }
pids=()
"$build/bin/zerod-mlp-train" --socket "$state/zerod.sock" --job bench --local-rank 1 \
  --steps "$steps" --log-every 1000 >/dev/null &
pids+=($!)
zerod_rate=$("$build/bin/zerod-mlp-train" --socket "$state/zerod.sock" --job bench \
  --local-rank 0 --steps "$steps" --log-every 1000 | rate)
wait "${pids[@]}"
ref_rate=$("$build/bin/zerod-mlp-reference" --world 2 --steps "$steps" --log-every 1000 | rate)
python3 -c "import sys; z, r = float(sys.argv[1]), float(sys.argv[2]); print('{\"bench\":\"e2e_mlp_2ranks\",\"params\":2378768,\"batch\":64,\"metric\":\"steps/s\",\"value\":%.2f,\"baseline\":\"one_process_no_zerod\",\"baseline_value\":%.2f,\"ratio\":%.3f}' % (z, r, z / r))" "$zerod_rate" "$ref_rate"
