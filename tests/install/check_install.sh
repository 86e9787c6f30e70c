#!/usr/bin/env bash
# The test install.layout (tests/CMakeLists.txt): installs the build tree
# into a scratch prefix with `cmake --install`, checks that exactly the
# expected files are there (nothing test-only), runs the installed zerod and
# zerodctl, builds smoke.c against the installed libzerod through
# pkg-config and runs it, loads the installed libzerod from the Python
# package, and checks that the installed zerod finds the installed CUDA
# module rather than the build tree's.
#
#   check_install.sh BUILD_DIR WORK_DIR LIBDIR CUDA VERSION LIBRARY_VERSION PYTHON CC [CFLAG...]
#
# LIBDIR is CMAKE_INSTALL_LIBDIR (relative), CUDA is ON when the CUDA module
# was built, VERSION is zerod's release and LIBRARY_VERSION libzerod's
# own (ABI.MINOR: the SONAME is libzerod.so.ABI, client/CMakeLists.txt), PYTHON is empty where the Python package cannot load the
# library (the sanitizer build), CFLAGs are the sanitizer flags the library
# was built with (a program linked against an instrumented libzerod must be
# instrumented too).
set -euo pipefail
if [ $# -lt 8 ]; then
  echo "usage: $0 BUILD_DIR WORK_DIR LIBDIR CUDA VERSION LIBRARY_VERSION PYTHON CC [CFLAG...]" >&2
  exit 2
fi
build=$1 work=$2 libdir=$3 cuda=$4 version=$5 library_version=$6 python=$7 cc=$8
shift 8
source_dir=$(cd "$(dirname "$0")/../.." && pwd)

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

rm -rf "$work"
mkdir -p "$work"
prefix=$work/prefix

echo "== cmake --install $build --prefix $prefix"
cmake --install "$build" --prefix "$prefix" >"$work/install.log" ||
  { cat "$work/install.log" >&2; fail "cmake --install failed"; }

echo "== installed files"
expected=(
  bin/zerod
  bin/zerodctl
  include/zerod.h
  "$libdir/libzerod.so"
  "$libdir/libzerod.so.${library_version%%.*}"
  "$libdir/libzerod.so.$library_version"
  "$libdir/pkgconfig/zerod.pc"
)
if [ "$cuda" = ON ]; then
  expected+=("$libdir/libzerod_cuda.so")
fi
printf '%s\n' "${expected[@]}" | sort >"$work/expected.txt"
(cd "$prefix" && find . \( -type f -o -type l \) | sed 's|^\./||' | sort) >"$work/installed.txt"
cat "$work/installed.txt"
diff -u "$work/expected.txt" "$work/installed.txt" ||
  fail "the installed files differ from the expected ones (- expected, + installed)"

soname=$(LC_ALL=C readelf -d "$prefix/$libdir/libzerod.so.$library_version" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[ "$soname" = "libzerod.so.${library_version%%.*}" ] || fail "libzerod's SONAME is '$soname'"
echo "SONAME $soname"

echo "== --version"
out=$("$prefix/bin/zerod" --version)
echo "$out"
[ "$out" = "zerod $version" ] || fail "zerod --version printed '$out'"
out=$("$prefix/bin/zerodctl" --version)
echo "$out"
[ "$out" = "zerodctl $version" ] || fail "zerodctl --version printed '$out'"

echo "== pkg-config"
export PKG_CONFIG_PATH=$prefix/$libdir/pkgconfig
pc_version=$(pkg-config --modversion zerod)
[ "$pc_version" = "$version" ] || fail "pkg-config --modversion zerod: '$pc_version'"
cflags=$(pkg-config --cflags zerod)
libs=$(pkg-config --libs zerod)
echo "cflags: $cflags"
echo "libs:   $libs"
case "$cflags" in *"$prefix/include"*) ;; *) fail "--cflags does not name $prefix/include" ;; esac
case "$libs" in *"$prefix/$libdir"*) ;; *) fail "--libs does not name $prefix/$libdir" ;; esac

echo "== smoke.c against the installed libzerod ($cc $*)"
# shellcheck disable=SC2086 # pkg-config's output is a list of flags
"$cc" -Wall -Wextra -Werror "$@" -o "$work/smoke" "$source_dir/tests/install/smoke.c" \
  $cflags $libs -ldl
LD_LIBRARY_PATH=$prefix/$libdir "$work/smoke" "$prefix/$libdir/"

if [ -n "$python" ]; then
  echo "== the Python package with ZEROD_LIBRARY"
  ZEROD_LIBRARY=$prefix/$libdir/libzerod.so PYTHONPATH=$source_dir/client/python \
    PYTHONDONTWRITEBYTECODE=1 "$python" - "$prefix/$libdir/" <<'PY'
import sys
from zerod import _lib
_lib.load()
with open("/proc/self/maps") as maps:
    paths = {line.split()[-1] for line in maps if "/libzerod.so" in line}
if not paths or any(not p.startswith(sys.argv[1]) for p in paths):
    sys.exit("the Python package loaded %s, not the installed libzerod" % sorted(paths))
print("zerod (Python) loaded", *sorted(paths))
PY
else
  echo "== the Python package: skipped (an instrumented libzerod cannot be loaded into Python)"
fi

if [ "$cuda" = ON ]; then
  echo "== the installed zerod finds the installed CUDA module"
  # ZEROD_THREADS_PER_RANK=0 is refused right after the device is settled,
  # so zerod never starts even where a GPU is present. Without a GPU,
  # --device cuda fails first and names the module it loaded.
  set +e
  out=$(env -u ZEROD_CUDA_MODULE ZEROD_THREADS_PER_RANK=0 "$prefix/bin/zerod" standalone \
    --device cuda --dir "$work/state" --socket "$work/zerod.sock" 2>&1)
  rc=$?
  set -e
  echo "$out"
  [ $rc -ne 0 ] || fail "zerod started"
  case "$out" in
    *"--device cuda: $prefix/bin/"*"/libzerod_cuda.so: "*) ;;
    *"--device cuda:"*) fail "the installed zerod did not load $prefix/$libdir/libzerod_cuda.so" ;;
    *) echo "a GPU is present: the module loaded, but zerod does not say from where" ;;
  esac
fi
echo "== ok"
