#!/usr/bin/env bash
# The README's run command (through `make demo`): a standalone zerod daemon
# with 2 CPU ranks and 2 PyTorch worker processes that train a small
# byte-level transformer language model (3.3M parameters) on this
# repository's own documentation through it. Rank 0 shows a progress bar,
# the loss and tokens/s, the validation loss and a generated sample; the
# daemon is stopped at the end. examples/python/train_lm.py does the work
# (its --help lists the options); scripts/demo_mlp.sh is the C example.
#
#   scripts/demo.sh [BUILD_DIR] [STEPS]
set -euo pipefail
build=${1:-build/release}
steps=${2:-${ZEROD_DEMO_STEPS:-150}}
cd "$(dirname "$0")/.."
ZEROD_LIBRARY=${ZEROD_LIBRARY:-$PWD/$build/lib/libzerod.so} \
  exec /usr/bin/python3 examples/python/train_lm.py --zerod-bin "$build/bin/zerod" --ranks 2 \
  --steps "$steps" --eval-every 50
