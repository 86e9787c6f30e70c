#!/usr/bin/env bash
# `make test-image`: the image `make image` wrote, unpacked and run.
#
#   tests/image/run_image_test.sh ARCHIVE [BUILD_DIR]
#
# ARCHIVE is build/image/zerod-VERSION.oci.tar; BUILD_DIR (default
# build/release) gives the example's model code (the kernels' static library)
# for a worker built here against the image's libzerod. The image is unpacked
# with umoci, and its programs run from its root file system as its user, with
# its environment and working directory (oci_exec.py applies the runtime
# config umoci derived from the image). Checks, in order:
#
#   - the image config: a non-root user that the image's /etc/passwd names,
#     the entrypoint, the manifests' ports, the version label;
#   - the files: zerod, zerodctl, zerod-mlp-train, libzerod, zerod.h,
#     zerod.pc, and the user's directories;
#   - every program and library resolves all its shared libraries inside
#     the image (the image's own dynamic loader, --list), except CUDA's;
#   - zerod --version, zerodctl --version and --help;
#   - training: the image's default command (`zerod standalone
#     --dir=/run/zerod`, with ZEROD_RANKS=2 in its environment) with two
#     workers, both run inside the image: rank 0 the image's zerod-mlp-train,
#     rank 1 examples/mlp_train.c compiled here against the image's zerod.h
#     and libzerod.so (its zerod.pc) and loading the image's libzerod at run
#     time. The loss must fall and every step complete; the image's zerodctl
#     lists the job; SIGTERM stops the daemon cleanly.
#
# Runs as root (chroot, mounts) in a mount namespace of its own, so /proc and
# /dev mounted into the unpacked root go away with it.
set -euo pipefail

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

if [ $# -lt 1 ]; then
  echo "usage: $0 ARCHIVE [BUILD_DIR]" >&2
  exit 2
fi
[ "$(id -u)" -eq 0 ] || fail "make test-image must run as root (chroot into the unpacked image, mounts)"
if [ -z "${ZEROD_IMAGE_TEST_NAMESPACE:-}" ]; then
  exec env ZEROD_IMAGE_TEST_NAMESPACE=1 unshare --mount --propagation private -- "$0" "$@"
fi

root=$(cd "$(dirname "$0")/../.." && pwd)
archive=$(realpath "$1")
build=$(realpath "${2:-$root/build/release}")
here=$root/tests/image
[ -f "$archive" ] || fail "$archive not found: run make image"
for tool in umoci python3 cc pkg-config; do
  command -v "$tool" >/dev/null 2>&1 || fail "$tool not found: run scripts/deps.sh image"
done
[ -f "$build/kernels/libzk_kernels.a" ] || fail "$build/kernels/libzk_kernels.a not found: build first"

work=$(dirname "$archive")/test
rm -rf "$work"
mkdir -p "$work/layout"
bundle=$work/bundle
rootfs=$bundle/rootfs
steps=${ZEROD_IMAGE_TEST_STEPS:-100}
started=$SECONDS

# Runs ARGV in the image, as the image's user: oci_exec.py BUNDLE [--env X=Y]... -- ARGV.
# Started with & it is called as "$oci_exec" directly, so that $! is the
# program's pid (oci_exec.py execs it), not a subshell's.
oci_exec=(python3 "$here/oci_exec.py" "$bundle")
in_image() {
  "${oci_exec[@]}" "$@"
}

echo "== umoci unpack $(basename "$archive")"
tar -xf "$archive" -C "$work/layout"
ref=$(python3 -c 'import json,sys; m=json.load(open(sys.argv[1]))["manifests"]
print(m[0]["annotations"]["org.opencontainers.image.ref.name"])' "$work/layout/index.json")
echo "ref $ref"
umoci unpack --image "$work/layout:$ref" "$bundle" >"$work/umoci.log" 2>&1 ||
  { cat "$work/umoci.log" >&2; fail "umoci unpack failed"; }

echo "== image config"
# The image config itself (index -> manifest -> config), not umoci's
# translation of it.
python3 - "$work/layout" "$rootfs/etc/passwd" "$root/CMakeLists.txt" <<'EOF' || fail "image config"
import json, os, re, sys
layout, passwd, cmakelists = sys.argv[1:]
def blob(digest):
    algorithm, hex_digest = digest.split(":")
    with open(os.path.join(layout, "blobs", algorithm, hex_digest)) as f:
        return json.load(f)
index = json.load(open(os.path.join(layout, "index.json")))
manifest = blob(index["manifests"][0]["digest"])
config = blob(manifest["config"]["digest"])["config"]
print(json.dumps(config, indent=1, sort_keys=True))
problems = []
user = config.get("User", "")
name_or_uid = user.split(":")[0]
uids = {line.split(":")[0]: int(line.split(":")[2]) for line in open(passwd) if line.count(":") >= 6}
uid = int(name_or_uid) if name_or_uid.isdigit() else uids.get(name_or_uid)
if uid is None or uid == 0:
    problems.append(f"User is {user!r}: not a non-root user")
elif uid not in uids.values():
    problems.append(f"User {user!r}: uid {uid} is not in the image's /etc/passwd")
if config.get("Entrypoint") != ["/usr/bin/zerod"]:
    problems.append(f"Entrypoint is {config.get('Entrypoint')}")
for port in ("7070/tcp", "7072/tcp", "7073/tcp", "9464/tcp"):
    if port not in config.get("ExposedPorts", {}):
        problems.append(f"port {port} is not exposed")
version = re.search(r"project\(zerod VERSION ([0-9.]+)", open(cmakelists).read()).group(1)
labels = config.get("Labels", {})
if labels.get("org.opencontainers.image.version") != version:
    problems.append(f"label org.opencontainers.image.version is not {version}")
for problem in problems:
    print("FAIL:", problem, file=sys.stderr)
sys.exit(1 if problems else 0)
EOF
revision=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["annotations"].get("org.opencontainers.image.revision", ""))' "$bundle/config.json")
head=$(git -C "$root" rev-parse HEAD 2>/dev/null || true)
[ "${revision%-dirty}" = "$head" ] ||
  echo "note: the image was built from $revision, the checkout is at $head (make image rebuilds it)"
version=$(sed -n 's/^project(zerod VERSION \([0-9][0-9.]*\)[ )].*/\1/p' "$root/CMakeLists.txt")
# libzerod's own version (its ABI, not the release): libzerod.so.ABI.MINOR.
abi=$(sed -n 's/^set(ZEROD_ABI_VERSION \([0-9]*\))$/\1/p' "$root/client/CMakeLists.txt")
abi_minor=$(sed -n 's/^set(ZEROD_ABI_MINOR \([0-9]*\))$/\1/p' "$root/client/CMakeLists.txt")
[ -n "$abi" ] && [ -n "$abi_minor" ] || fail "no ZEROD_ABI_VERSION / ZEROD_ABI_MINOR in client/CMakeLists.txt"
uid=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["process"]["user"]["uid"])' "$bundle/config.json")
echo "user: uid $uid; version $version"

echo "== files"
for path in usr/bin/zerod usr/bin/zerodctl usr/bin/zerod-mlp-train usr/include/zerod.h \
  usr/lib/libzerod.so "usr/lib/libzerod.so.$abi" "usr/lib/libzerod.so.$abi.$abi_minor" usr/lib/pkgconfig/zerod.pc; do
  [ -e "$rootfs/$path" ] || fail "/$path is not in the image"
  echo "/$path"
done
grep -qx "Version: $version" "$rootfs/usr/lib/pkgconfig/zerod.pc" || fail "zerod.pc does not say Version: $version"
for dir in var/lib/zerod run/zerod; do
  [ "$(stat -c %u "$rootfs/$dir")" = "$uid" ] || fail "/$dir is not owned by uid $uid"
done

# The image's programs need /proc and /dev (shared memory in /dev/shm, the
# host's, as with hostIPC); the namespace is this script's own.
mount -t proc proc "$rootfs/proc"
mount --rbind /dev "$rootfs/dev"

echo "== shared libraries, resolved inside the image"
elves=()
while IFS= read -r -d '' file; do
  [ "$(head -c 4 "$file" | od -An -c | tr -d ' ')" = '177ELF' ] && elves+=("/${file#"$rootfs"/}")
done < <(find "$rootfs/usr/bin" "$rootfs/usr/lib" -maxdepth 1 -name '*zerod*' -type f -print0)
for elf in "${elves[@]}"; do
  out=$(in_image -- /lib64/ld-linux-x86-64.so.2 --list "$elf") || fail "ld.so --list $elf: $out"
  missing=$(grep 'not found' <<<"$out" | grep -v -E 'lib(cuda|cudart|nccl)\.' || true)
  [ -z "$missing" ] || fail "$elf: $missing"
  echo "$elf: $(grep -c '=>' <<<"$out") libraries, all in the image"
done

echo "== versions and help"
out=$(in_image -- zerod --version)
[ "$out" = "zerod $version" ] || fail "zerod --version printed '$out'"
echo "$out"
out=$(in_image -- zerodctl --version)
[ "$out" = "zerodctl $version" ] || fail "zerodctl --version printed '$out'"
echo "$out"
out=$(in_image -- zerodctl --help 2>&1) || fail "zerodctl --help failed: $out"
grep -q "jobs list" <<<"$out" || fail "zerodctl --help does not mention 'jobs list'"
echo "zerodctl --help: $(wc -l <<<"$out") lines"

echo "== a worker built against the image's libzerod (pkg-config zerod from the image)"
pc_flags=$(PKG_CONFIG_SYSROOT_DIR=$rootfs PKG_CONFIG_LIBDIR=$rootfs/usr/lib/pkgconfig \
  pkg-config --cflags --libs zerod)
echo "pkg-config: $pc_flags"
mkdir -p "$rootfs/opt/image-test"
worker=/opt/image-test/mlp-train-libzerod
# shellcheck disable=SC2086 # pc_flags is a list of flags
cc -std=c11 -D_GNU_SOURCE -O3 -I"$root/examples" -I"$root/kernels" \
  "$root/examples/mlp_train.c" "$root/examples/mlp.c" $pc_flags \
  "$build/kernels/libzk_kernels.a" -lm -lpthread -ldl -o "$rootfs$worker" ||
  fail "building examples/mlp_train.c against the image's libzerod"
out=$(in_image --env LD_TRACE_LOADED_OBJECTS=1 -- "$worker")
libzerod=$(grep 'libzerod\.so' <<<"$out" || true)
# /lib is /usr/lib in the image (merged /usr).
grep -q -E "=> (/usr)?/lib/libzerod\\.so\\.$abi " <<<"$libzerod" || fail "$worker does not load the image's libzerod: $out"
echo "$worker: $libzerod"

echo "== training through the image's zerod (its default command, ZEROD_RANKS=2)"
daemon_pid=
workers=()
cleanup() {
  for pid in "${workers[@]}"; do kill "$pid" 2>/dev/null || true; done
  if [ -n "$daemon_pid" ]; then
    kill -TERM "$daemon_pid" 2>/dev/null || true
    wait "$daemon_pid" 2>/dev/null || true
  fi
}
trap cleanup EXIT
"${oci_exec[@]}" --env ZEROD_RANKS=2 --env ZEROD_THREADS_PER_RANK=1 2>"$work/zerod.log" &
daemon_pid=$!
socket=$rootfs/run/zerod/zerod.sock
for _ in $(seq 1 100); do
  [ -S "$socket" ] && break
  kill -0 "$daemon_pid" 2>/dev/null || { cat "$work/zerod.log" >&2; fail "zerod exited early"; }
  sleep 0.1
done
[ -S "$socket" ] || { cat "$work/zerod.log" >&2; fail "zerod did not create /run/zerod/zerod.sock"; }
[ "$(stat -c %u "$socket")" = "$uid" ] || fail "the socket is not owned by uid $uid"
echo "zerod: $(head -n 1 "$work/zerod.log")"

train_args=(--socket /run/zerod/zerod.sock --job image-demo --steps "$steps" --batch 64 --log-every 20)
"${oci_exec[@]}" -- zerod-mlp-train "${train_args[@]}" --local-rank 0 >"$work/rank0.log" 2>&1 &
workers+=($!)
"${oci_exec[@]}" -- "$worker" "${train_args[@]}" --local-rank 1 >"$work/rank1.log" 2>&1 &
workers+=($!)
status=0
for pid in "${workers[@]}"; do wait "$pid" || status=1; done
workers=()
sed 's/^/[rank 0] /' "$work/rank0.log"
sed 's/^/[rank 1] /' "$work/rank1.log"
[ $status -eq 0 ] || { cat "$work/zerod.log" >&2; fail "a worker failed"; }

# "done: 100 steps, loss 1.234567 -> 0.123456 (rank 0's samples), ..."
summary=$(grep '^done: ' "$work/rank0.log") || fail "rank 0 printed no 'done:' line"
read -r done_steps first_loss last_loss < <(sed -n \
  's/^done: \([0-9]*\) steps, loss \([0-9.e+-]*\) -> \([0-9.e+-]*\) .*/\1 \2 \3/p' <<<"$summary")
[ "$done_steps" = "$steps" ] || fail "rank 0 completed $done_steps steps, not $steps"
python3 -c 'import sys; a, b = map(float, sys.argv[1:]); sys.exit(0 if b < 0.5 * a else 1)' \
  "$first_loss" "$last_loss" || fail "the loss went from $first_loss to $last_loss, not below half"
echo "trained: $steps steps, loss $first_loss -> $last_loss"

echo "== the image's zerodctl"
out=$(in_image -- zerodctl -c unix:/run/zerod/control.sock jobs list 2>&1) ||
  fail "zerodctl jobs list: $out"
echo "$out"
# Its STEP is the node's last heartbeat report, which may trail the workers.
grep -q -E '^image-demo +ready ' <<<"$out" || fail "zerodctl jobs list does not list image-demo as ready"

echo "== SIGTERM"
kill -TERM "$daemon_pid"
daemon_status=0
wait "$daemon_pid" || daemon_status=$?
daemon_pid=
[ "$daemon_status" -eq 0 ] || { cat "$work/zerod.log" >&2; fail "zerod exited with $daemon_status"; }
[ ! -e "$socket" ] || fail "zerod left its socket behind"
echo "zerod: $(tail -n 1 "$work/zerod.log")"

echo "PASS: image $ref in $((SECONDS - started)) s"
