#!/usr/bin/env bash
# The ABI check: the library against an ABI baseline (abi_dump.sh's XML),
# with libabigail's abidiff. It passes only when abidiff finds nothing
# beyond what the ABI policy allows within a soname (docs/client.md, "ABI
# policy"): functions added (--no-added-syms), fields added at the end of
# the structs named in the suppressions (struct_size structs). Anything else
# (a function removed or changed, a field inserted, moved or retyped, a
# struct without struct_size that grew, a changed enumerator, another
# SONAME) fails, with abidiff's report. --fail-no-debug-info: a library
# without DWARF would compare symbols only, so it fails instead.
#
#   check_abi.sh BASELINE LIBRARY HEADERS_DIR SUPPRESSIONS
set -uo pipefail
if [ $# -ne 4 ]; then
  echo "usage: $0 BASELINE LIBRARY HEADERS_DIR SUPPRESSIONS" >&2
  exit 2
fi
baseline=$1 library=$2 headers=$3 suppressions=$4
command -v abidiff >/dev/null 2>&1 ||
  { echo "FAIL: abidiff not found: install abigail-tools (scripts/deps.sh test)" >&2; exit 1; }
[ -f "$baseline" ] || { echo "FAIL: no ABI baseline $baseline" >&2; exit 1; }
abidiff --leaf-changes-only --no-added-syms --fail-no-debug-info --suppressions "$suppressions" \
  --headers-dir2 "$headers" "$baseline" "$library"
rc=$?
if [ $rc -eq 0 ]; then
  echo "ok: $library has no ABI change against $baseline but those the policy allows"
  exit 0
fi
# abidiff's status is a bit set: 1 error, 2 usage error, 4 a change, 8 an
# incompatible change.
why=()
[ $((rc & 1)) -ne 0 ] && why+=("abidiff failed")
[ $((rc & 2)) -ne 0 ] && why+=("abidiff was misused")
[ $((rc & 4)) -ne 0 ] && why+=("the ABI changed")
[ $((rc & 8)) -ne 0 ] && why+=("incompatibly")
echo "FAIL: ${why[*]} (abidiff status $rc) against $baseline." >&2
echo "A change a worker built against the baseline header cannot survive needs a new soname;" >&2
echo "a compatible one that abidiff still reports needs a deliberate 'make abi-baseline'" >&2
echo "(docs/client.md, \"ABI policy\")." >&2
exit 1
