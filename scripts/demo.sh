#!/usr/bin/env bash
# The README's run command (through `make demo`). The node daemon does not
# exist yet (issue 3), so this runs what does: the kernel library training a
# small model through its real code paths, then the kernel benchmark on a
# 64 MiB state, printing throughput against the machine's memory bandwidth.
set -euo pipefail
build=${1:-build/release}
echo "== zerod kernel demo: training a small model with the CPU kernels"
"$build/bench/demo_kernels"
echo
echo "== kernel throughput (64 MiB of optimizer state; 'make bench' runs the full 256 MiB)"
"$build/bench/bench_kernels" --state-mib 64 --reps 5
