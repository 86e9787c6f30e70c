#!/usr/bin/env bash
# gpu_check.sh - every CUDA path of zerod on a real GPU, in one run.
#
# A lent GPU machine (docs/gpu-validation.md) has CUDA's driver and NCCL
# (PyTorch's wheel) but none of zerod's other dependencies, and no network.
# So the programs are built here and carried there:
#
#   scripts/gpu_check.sh stage      # here: build, then copy into .gpucarry/
#   scripts/gpu_check.sh run        # there, from the repository's root
#
# `stage` builds build/release (CUDA module for sm_80, sm_90 and PTX) and
# copies into .gpucarry/ the GPU tests, the GPU benchmarks, zerod, zerodctl,
# the libraries they load and the shared libraries of their dependencies
# (glibc's and the C++ runtime's aside: the machine there has its own,
# newer ones). The programs name each other by the build tree's absolute
# paths (tests/gpu/CMakeLists.txt), so `run` links that path to the
# carried copy.
#
# `run` runs, each under its own time limit, with its output in $OUT
# (or ./gpu-out): the machine's description; the five GPU tests with
# ZEROD_REQUIRE_GPU=1 (a missing GPU or NCCL fails instead of skipping);
# bench_cuda and bench_offload_gpu (JSON lines in bench.jsonl); and
# compute-sanitizer's memcheck over the element-wise kernels. It ends with
# one summary line per step in summary.txt.
set -u

here=$(cd "$(dirname "$0")/.." && pwd)
carry=.gpucarry
build_rel=build/release

stage() {
  cd "$here" || exit 1
  cmake -S . -B "$build_rel" -G Ninja -DCMAKE_BUILD_TYPE=Release -DZEROD_CUDA=ON >/dev/null || exit 1
  ninja -C "$build_rel" zerodd zerodctl zerod_cuda test_cuda_optim test_cuda_elementwise \
    test_cuda_ipc test_nccl_comm test_daemon_cuda bench_cuda bench_offload_gpu >/dev/null || exit 1
  rm -rf "$carry"
  local files=(bin/zerod bin/zerodctl lib/libzerod_cuda.so
    tests/gpu/test_cuda_optim tests/gpu/test_cuda_elementwise tests/gpu/test_cuda_ipc
    tests/gpu/test_nccl_comm tests/gpu/test_daemon_cuda bench/bench_cuda bench/bench_offload_gpu)
  for f in "${files[@]}"; do
    mkdir -p "$carry/release/$(dirname "$f")"
    cp "$build_rel/$f" "$carry/release/$f"
    strip --strip-debug "$carry/release/$f"
  done
  # The build tree's absolute path, which the programs were built with.
  echo "$here/$build_rel" >"$carry/build-path"
  # Shared libraries of the dependencies, under their sonames.
  mkdir -p "$carry/libs"
  local skip='^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libresolv|libgcc_s|libstdc\+\+|libcuda|libnccl)\.'
  for f in "${files[@]}"; do
    ldd "$build_rel/$f" | awk '$3 ~ /^\// {print $1, $3}'
  done | sort -u | while read -r name path; do
    [[ $name =~ $skip ]] && continue
    cp -L "$path" "$carry/libs/$name"
  done
  grep -qx "/$carry/" .git/info/exclude 2>/dev/null || echo "/$carry/" >>.git/info/exclude
  du -sh "$carry"
}

# One step: its name, its time limit in seconds, the command. Output to
# $OUT/<name>.log; "<name> ok|FAIL rc=N|TIMEOUT <seconds>s" to summary.txt.
step() {
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$? took=$((SECONDS - start)) verdict
  case $rc in
    0) verdict=ok ;;
    124 | 137) verdict=TIMEOUT ;;
    *) verdict="FAIL rc=$rc" ;;
  esac
  echo "$name $verdict ${took}s" | tee -a "$out/summary.txt"
}

run() {
  cd "$here" || exit 1
  out=${OUT:-$here/gpu-out}
  mkdir -p "$out"
  : >"$out/summary.txt"
  local built
  built=$(cat "$carry/build-path")
  if [ ! -e "$built" ]; then
    mkdir -p "$(dirname "$built")"
    ln -s "$here/$carry/release" "$built"
  fi
  export LD_LIBRARY_PATH="$here/$carry/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export ZEROD_CUDA_MODULE="$built/lib/libzerod_cuda.so"
  export ZEROD_REQUIRE_GPU=1
  # NCCL: the system's, else the one in PyTorch's wheels.
  if ! ldconfig -p | grep -q libnccl.so.2; then
    local nccl
    nccl=$(find /opt /usr -name 'libnccl.so.2' 2>/dev/null | head -1)
    [ -n "$nccl" ] && export ZEROD_NCCL_LIBRARY="$nccl"
  fi
  {
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    grep PRETTY_NAME /etc/os-release
    ldd --version | head -1
    echo "ZEROD_NCCL_LIBRARY=${ZEROD_NCCL_LIBRARY:-system}"
    nproc
    for f in "$built"/bin/* "$built"/tests/gpu/test_* "$built"/bench/bench_* "$built"/lib/*.so; do
      ldd "$f" | grep -i "not found" | sed "s|^|$f: |"
    done
  } >"$out/machine.txt" 2>&1

  step test_cuda_optim 90 "$built/tests/gpu/test_cuda_optim"
  step test_cuda_elementwise 90 "$built/tests/gpu/test_cuda_elementwise"
  step test_cuda_ipc 90 "$built/tests/gpu/test_cuda_ipc"
  step test_nccl_comm 90 "$built/tests/gpu/test_nccl_comm"
  step test_daemon_cuda 150 "$built/tests/gpu/test_daemon_cuda"
  step bench_cuda 90 "$built/bench/bench_cuda"
  step bench_offload_gpu 120 "$built/bench/bench_offload_gpu"
  grep -h '^{' "$out/bench_cuda.log" "$out/bench_offload_gpu.log" >"$out/bench.jsonl"
  if command -v compute-sanitizer >/dev/null; then
    step memcheck_elementwise 120 compute-sanitizer --tool memcheck --error-exitcode 9 \
      "$built/tests/gpu/test_cuda_elementwise"
  fi
  cat "$out/summary.txt"
}

case ${1:-} in
  stage) stage ;;
  run) run ;;
  *)
    echo "usage: $0 stage|run" >&2
    exit 2
    ;;
esac
