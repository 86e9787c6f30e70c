#!/usr/bin/env bash
# The ABI of a shared library as libabigail's XML, the one way this
# repository makes it: for the baseline kept in client/abi/ (`make
# abi-baseline`) and for the stub libraries of tests/abi's self-test. Only
# what the headers in HEADERS_DIR declare counts; paths, the needed
# libraries and undefined symbols are left out, so that the file does not
# depend on the machine or the build directory.
#
#   abi_dump.sh LIBRARY HEADERS_DIR OUT
set -euo pipefail
if [ $# -ne 3 ]; then
  echo "usage: $0 LIBRARY HEADERS_DIR OUT" >&2
  exit 2
fi
command -v abidw >/dev/null 2>&1 ||
  { echo "abi_dump.sh: abidw not found: install abigail-tools (scripts/deps.sh test)" >&2; exit 1; }
abidw --headers-dir "$2" --drop-private-types --no-corpus-path --no-comp-dir-path --short-locs --no-elf-needed \
  --drop-undefined-syms --type-id-style hash --out-file "$3" "$1"
