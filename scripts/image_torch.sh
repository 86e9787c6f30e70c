#!/usr/bin/env bash
# Builds localhost/zerod-torch:VERSION, the image of the PyTorch example job
# (deploy/examples/train-torch-job.yaml), the way scripts/image.sh builds
# zerod's: no registry but Debian's mirror and no container daemon.
#
#   scripts/image_torch.sh [BUILD]     (make image-torch; root)
#
# 1. The manylinux wheel of the Python package (scripts/wheel.sh, from the
#    build tree BUILD, default build/release), made if missing.
# 2. mmdebstrap --variant=essential of Debian bookworm with python3,
#    Debian's CPU PyTorch (python3-torch 1.13), numpy and OpenBLAS (Debian's
#    torch calls the BLAS the alternatives system selects; the reference one
#    is about 10x slower), straight into a `buildah from scratch` mount.
# 3. The wheel installed into it by the build machine's pip (`--root`; no
#    pip in the image), examples/python, README.md and docs/ (the training
#    text train_lm.py reads) under /opt/zerod, the user zerod (65532, the
#    daemon's uid: its socket is 0600 for it).
# 4. A check inside the root before it is committed: as that user, the
#    package and torch import, and train_lm.py trains a few steps against a
#    daemon of this build running outside (its directory bound in a mount
#    namespace of the check's own), so an image that cannot train is not
#    made.
# 5. Config (user, working directory, command train_lm.py --help), commit
#    as localhost/zerod-torch:VERSION, archive build/image/zerod-torch-VERSION.oci.tar.
#
# deploy/examples/torch/Containerfile builds the same image with an OCI
# builder that can pull debian:bookworm from Docker Hub.
# Environment: ZEROD_IMAGE_DIR, ZEROD_IMAGE_STORAGE, ZEROD_IMAGE_DRIVER,
# ZEROD_IMAGE_MIRROR, as scripts/image.sh reads them.
set -euo pipefail

die() {
  echo "image_torch.sh: $*" >&2
  exit 1
}

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# shellcheck source=scripts/image_lib.sh
. scripts/image_lib.sh
build=$(realpath -m "${1:-build/release}")
out=$(realpath -m "${ZEROD_IMAGE_DIR:-build/image}")
storage=$(realpath -m "${ZEROD_IMAGE_STORAGE:-$out/storage}")
driver=${ZEROD_IMAGE_DRIVER:-vfs}
mirror=${ZEROD_IMAGE_MIRROR:-}
suite=bookworm
user_id=65532
packages=(python3 python3-torch python3-numpy libopenblas0-pthread)

[ "$(id -u)" -eq 0 ] || die "run as root (mmdebstrap, chroot, a mount namespace)"
for tool in mmdebstrap buildah unshare chroot; do
  command -v "$tool" >/dev/null 2>&1 || die "$tool not found: run scripts/deps.sh image"
done
[ -x "$build/bin/zerod" ] || die "$build/bin/zerod not found: build first (make build)"
version=$(sed -n 's/^project(zerod VERSION \([0-9][0-9.]*\)[ )].*/\1/p' CMakeLists.txt)
name=localhost/zerod-torch:$version
archive=$out/zerod-torch-$version.oci.tar
started=$SECONDS
mkdir -p "$out"

wheels=("$root"/build/wheel/zerod-"$version"-py3-none-manylinux_*.whl)
if [ ! -f "${wheels[0]}" ]; then
  scripts/deps.sh wheel >/dev/null
  scripts/wheel.sh "$build" >/dev/null
  wheels=("$root"/build/wheel/zerod-"$version"-py3-none-manylinux_*.whl)
fi
echo "== $name from ${wheels[0]##*/}"

mkdir -p "$storage"
buildah=(buildah --root "$storage/root" --runroot "$storage/run" --storage-driver "$driver")
container=$("${buildah[@]}" from scratch)
mounted=
daemon=
scratch=$(mktemp -d)
cleanup() {
  [ -z "$daemon" ] || kill "$daemon" 2>/dev/null || true
  rm -rf "$scratch"
  if [ -n "$container" ]; then
    [ -z "$mounted" ] || "${buildah[@]}" umount "$container" >/dev/null 2>&1 || true
    "${buildah[@]}" rm "$container" >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT
rootfs=$("${buildah[@]}" mount "$container")
mounted=1

echo "== mmdebstrap --variant=essential $suite ${packages[*]}"
mmdebstrap_root "$suite" "$rootfs" "$out/mmdebstrap-torch.log" "$mirror" "${packages[@]}" ||
  die "mmdebstrap failed (log: $out/mmdebstrap-torch.log)"

echo "== the zerod package, the example, the user"
/usr/bin/python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore \
  --break-system-packages --no-deps --no-index --root "$rootfs" "${wheels[0]}"
install -d "$rootfs/opt/zerod/examples"
cp -a README.md docs "$rootfs/opt/zerod/"
cp -a examples/python "$rootfs/opt/zerod/examples/python"
find "$rootfs/opt/zerod" -name __pycache__ -prune -exec rm -rf {} +
grep -q "^zerod:" "$rootfs/etc/passwd" ||
  echo "zerod:x:$user_id:$user_id:zerod:/home/zerod:/usr/sbin/nologin" >>"$rootfs/etc/passwd"
grep -q "^zerod:" "$rootfs/etc/group" || echo "zerod:x:$user_id:" >>"$rootfs/etc/group"
install -d -m 0750 -o "$user_id" -g "$user_id" "$rootfs/home/zerod" "$rootfs/run/zerod"

echo "== check: train_lm.py in the image against this build's daemon"
chown "$user_id:$user_id" "$scratch"
setpriv --reuid "$user_id" --regid "$user_id" --clear-groups \
  "$build/bin/zerod" standalone --dir "$scratch" --threads-per-rank 1 2>"$out/image-torch-daemon.log" &
daemon=$!
for _ in $(seq 200); do
  [ -S "$scratch/zerod.sock" ] && break
  sleep 0.05
done
[ -S "$scratch/zerod.sock" ] || { cat "$out/image-torch-daemon.log" >&2; die "the check's daemon did not start"; }
check='mount --bind "$1" "$2/run/zerod" && mount -t proc proc "$2/proc" && image=$2 && shift 2 &&
  exec chroot --userspec=65532:65532 "$image" "$@"'
env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/home/zerod LANG=C.UTF-8 ZEROD_QUIET=1 \
  unshare --mount --propagation private sh -c "$check" sh "$scratch" "$rootfs" \
  python3 /opt/zerod/examples/python/train_lm.py --socket /run/zerod/zerod.sock --ranks 1 \
  --steps 6 --log-every 3 --eval-every 0 --d-model 64 --layers 1 --sample-bytes 0 \
  >"$out/image-torch-check.log" 2>&1 ||
  { cat "$out/image-torch-check.log" >&2; die "train_lm.py failed in the image"; }
cat "$out/image-torch-check.log"
kill "$daemon"
wait "$daemon" 2>/dev/null || true
daemon=
strip_host_files "$rootfs"
rootfs_bytes=$(du -sb "$rootfs" | cut -f1)
"${buildah[@]}" umount "$container" >/dev/null
mounted=

echo "== buildah commit $name"
"${buildah[@]}" config --user "$user_id:$user_id" --workingdir /home/zerod --env HOME=/home/zerod \
  --env PATH=/usr/local/bin:/usr/bin:/bin \
  --cmd '["python3", "/opt/zerod/examples/python/train_lm.py", "--help"]' \
  --created-by scripts/image_torch.sh \
  --label org.opencontainers.image.title=zerod-torch \
  --label "org.opencontainers.image.description=the zerod Python package, Debian's PyTorch and examples/python on Debian $suite" \
  --label "org.opencontainers.image.version=$version" "$container"
committing=$container
container= # the commit removes it
commit_and_archive "$committing" "$name" "$archive"
echo "== done in $((SECONDS - started)) s"
echo "archive: $archive, $(du -h "$archive" | cut -f1) (compressed layer)"
echo "rootfs:  $((rootfs_bytes / 1024 / 1024)) MiB unpacked"
