#!/usr/bin/env bash
# The ABI check checks something (the test abi.check_catches): check_abi.sh,
# with the repository's suppressions, on stub libraries built by
# tests/abi/CMakeLists.txt from the baseline header with one edit each
# (STUB_DIR/<variant>/{zerod.h,libabistub.so}), compared with the base
# stub's ABI made as the baseline is made (abi_dump.sh). The changes the ABI
# policy allows within a soname must pass; every other one must fail, among
# them the bug class of issue 33: a struct without struct_size that grew.
#
#   check_abi_selftest.sh STUB_DIR SUPPRESSIONS
set -uo pipefail
if [ $# -ne 2 ]; then
  echo "usage: $0 STUB_DIR SUPPRESSIONS" >&2
  exit 2
fi
stubs=$1 suppressions=$2
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$here/abi_dump.sh" "$stubs/base/libabistub.so" "$stubs/base" "$work/base.abi" || exit 1

failed=0
expect() {
  local outcome=$1 variant=$2 why=$3
  "$here/check_abi.sh" "$work/base.abi" "$stubs/$variant/libabistub.so" "$stubs/$variant" \
    "$suppressions" >"$work/$variant.out" 2>&1
  local rc=$?
  if { [ "$outcome" = pass ] && [ $rc -eq 0 ]; } || { [ "$outcome" = fail ] && [ $rc -eq 1 ]; }; then
    echo "ok: $variant ($why): the check says $outcome"
  else
    echo "FAIL: $variant ($why): the check should $outcome, it exited $rc:" >&2
    cat "$work/$variant.out" >&2
    failed=1
  fi
}

expect pass base "no change"
expect pass new_function "a function added"
expect pass sized_grew "a field added at the end of a struct with struct_size"
expect fail removed "a function removed"
expect fail inserted "a field inserted in the middle of a struct with struct_size"
expect fail unsized_grew "a field added to a struct without struct_size (zd_tensor_view)"
expect fail embedded_grew "a field added to a struct embedded in a sized one (zd_collective_counter)"
expect fail enum_changed "an enumerator's value changed"
exit $failed
