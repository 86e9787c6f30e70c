#!/usr/bin/env bash
# `make image`: an OCI image of zerod, built without a container daemon.
#
#   scripts/image.sh [BUILD_DIR]      (default build/release, already built)
#
# 1. Stages `cmake --install BUILD_DIR --prefix /usr --strip` under DESTDIR,
#    plus the example worker zerod-mlp-train (deploy/examples/train-job.yaml
#    runs it from the image; cmake --install leaves it out).
# 2. Lists the Debian packages that own the shared libraries those files link
#    (ldd, then dpkg -S on this machine), leaving out the CUDA libraries: the
#    CUDA module is opened with dlopen when a GPU is asked for, and on GPU
#    nodes the driver's libraries come from the host (NVIDIA container
#    toolkit). A library no package owns, or that ldd cannot find, stops the
#    build: the image would not run.
# 3. Makes a Debian bookworm root file system with mmdebstrap (the essential
#    variant, no documentation but the copyright files, no apt lists) holding
#    those packages, directly in a `buildah from scratch` container's mount,
#    copies the staged tree in and adds the user zerod (uid and gid 65532,
#    the manifests' runAsUser).
# 4. Sets the image config (user, entrypoint /usr/bin/zerod, default command
#    `standalone --dir=/run/zerod`, working directory, the manifests' ports,
#    org.opencontainers.image.* labels), commits it as localhost/zerod:VERSION
#    in buildah's storage and writes it to build/image/zerod-VERSION.oci.tar.
#
# Environment: ZEROD_IMAGE_DIR (default build/image), ZEROD_IMAGE_STORAGE
# (buildah's storage, default ZEROD_IMAGE_DIR/storage), ZEROD_IMAGE_DRIVER
# (storage driver, default vfs: overlay needs a kernel and file system that
# allow it, which containers and CI machines often do not), ZEROD_IMAGE_MIRROR
# (Debian mirror for mmdebstrap, default its own: deb.debian.org with
# bookworm-updates and bookworm-security). Runs as root (mmdebstrap and
# buildah create files owned by other users), or under `buildah unshare`.
set -euo pipefail

die() {
  echo "image.sh: $*" >&2
  exit 1
}

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# shellcheck source=scripts/image_lib.sh
. scripts/image_lib.sh
build=${1:-build/release}
out=$(realpath -m "${ZEROD_IMAGE_DIR:-build/image}")
storage=$(realpath -m "${ZEROD_IMAGE_STORAGE:-$out/storage}")
driver=${ZEROD_IMAGE_DRIVER:-vfs}
mirror=${ZEROD_IMAGE_MIRROR:-}
suite=bookworm
user_id=65532
# The image's ports, as deploy/base declares them: the coordinator's gRPC
# (7070) and health (7073) listeners, the node's health listener (7072), and
# 9464, reserved for metrics.
ports=(7070 7072 7073 9464)

[ "$(id -u)" -eq 0 ] ||
  die "make image must run as root or under buildah unshare (the root file system has files owned by other users)"
for tool in mmdebstrap buildah cmake ldd dpkg-query readelf; do
  command -v "$tool" >/dev/null 2>&1 || die "$tool not found: run scripts/deps.sh image"
done
[ -x "$build/bin/zerod" ] || die "$build/bin/zerod not found: build first (make build)"

version=$(sed -n 's/^project(zerod VERSION \([0-9][0-9.]*\)[ )].*/\1/p' CMakeLists.txt)
[ -n "$version" ] || die "no project(zerod VERSION ...) in CMakeLists.txt"
name=localhost/zerod:$version
archive=$out/zerod-$version.oci.tar
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
if [ "$revision" != unknown ] && [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
  revision=$revision-dirty
fi
started=$SECONDS
echo "== zerod $version ($revision) -> $name, $archive"

# ---------------------------------------------------------------------------
# 1. The staged install tree
# ---------------------------------------------------------------------------
stage=$out/stage
rm -rf "$stage"
mkdir -p "$out"
echo "== cmake --install $build --prefix /usr --strip (DESTDIR=$stage)"
DESTDIR=$stage cmake --install "$build" --prefix /usr --strip >"$out/install.log" ||
  { cat "$out/install.log" >&2; die "cmake --install failed"; }
install -D -m 0755 -s "$build/bin/zerod-mlp-train" "$stage/usr/bin/zerod-mlp-train"
(cd "$stage" && find . \( -type f -o -type l \) | sed 's|^\.||' | sort)

# ---------------------------------------------------------------------------
# 2. The runtime packages, from what the staged files link
# ---------------------------------------------------------------------------
# CUDA's libraries: the driver (libcuda) comes from the host on GPU nodes;
# the module links the CUDA runtime statically and opens NCCL itself.
is_cuda_library() {
  case "$1" in
  libcuda.so* | libcudart.so* | libnccl.so* | libnvidia-* | libnvrtc* | libcublas*) return 0 ;;
  *) return 1 ;;
  esac
}

# The package that owns PATH, trying the path ldd printed, the file it links
# to, and each one's twin across the merged /usr (dpkg knows one spelling).
package_of() {
  local path=$1 candidate owner
  local candidates=("$path" "$(readlink -f "$path")")
  for candidate in "${candidates[@]}"; do
    case "$candidate" in
    /usr/*) candidates+=("${candidate#/usr}") ;;
    *) candidates+=("/usr$candidate") ;;
    esac
  done
  for candidate in "${candidates[@]}"; do
    owner=$(dpkg-query -S "$candidate" 2>/dev/null | grep -v '^diversion by' | head -n 1) || true
    if [ -n "$owner" ]; then
      owner=${owner%%: /*}     # "pkg:arch[, pkg2:arch]: /path"
      owner=${owner%%,*}
      echo "${owner%%:*}"
      return 0
    fi
  done
  return 1
}

echo "== runtime libraries (ldd)"
packages=()
unowned=()
while IFS= read -r -d '' file; do
  [ "$(head -c 4 "$file" | od -An -c | tr -d ' ')" = '177ELF' ] || continue
  # Resolve the staged libzerod for any staged file that links it.
  ldd_out=$(LD_LIBRARY_PATH=$stage/usr/lib LC_ALL=C ldd "$file" 2>&1) || continue
  while read -r line; do
    library=
    case "$line" in
    *"=> not found"*)
      soname=${line%% *}
      is_cuda_library "$soname" && continue
      unowned+=("$soname (needed by ${file#"$stage"}: not found)")
      continue
      ;;
    *"=> /"*) library=${line#*=> } ;;
    /*) library=$line ;;
    *) continue ;; # linux-vdso
    esac
    library=${library% (0x*}
    is_cuda_library "$(basename "$library")" && continue
    case "$library" in "$stage"/*) continue ;; esac
    if package=$(package_of "$library"); then
      packages+=("$package")
    else
      unowned+=("$library (needed by ${file#"$stage"}: no package owns it)")
    fi
  done <<<"$ldd_out"
done < <(find "$stage" -type f -print0)
if [ ${#unowned[@]} -gt 0 ]; then
  printf '  %s\n' "${unowned[@]}" | sort -u >&2
  die "the libraries above are not from a Debian package; the image would not run"
fi
mapfile -t packages < <(printf '%s\n' "${packages[@]}" | sort -u)
echo "${packages[*]}"

# ---------------------------------------------------------------------------
# 3. The root file system, in a buildah container
# ---------------------------------------------------------------------------
mkdir -p "$storage"
buildah=(buildah --root "$storage/root" --runroot "$storage/run" --storage-driver "$driver")
container=$("${buildah[@]}" from scratch)
mounted=
cleanup() {
  if [ -n "$container" ]; then
    [ -z "$mounted" ] || "${buildah[@]}" umount "$container" >/dev/null 2>&1 || true
    "${buildah[@]}" rm "$container" >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT
rootfs=$("${buildah[@]}" mount "$container")
mounted=1

echo "== mmdebstrap --variant=essential $suite ($(date -u +%H:%M:%S))"
debstrap_started=$SECONDS
mmdebstrap_root "$suite" "$rootfs" "$out/mmdebstrap.log" "$mirror" "${packages[@]}" ||
  die "mmdebstrap failed (network, or the mirror: set ZEROD_IMAGE_MIRROR); log: $out/mmdebstrap.log"
echo "   $((SECONDS - debstrap_started)) s"

echo "== zerod's files and user"
cp -a "$stage/." "$rootfs/"
# No useradd in the essential set; the entries are what it would write.
grep -q "^zerod:" "$rootfs/etc/passwd" ||
  echo "zerod:x:$user_id:$user_id:zerod:/var/lib/zerod:/usr/sbin/nologin" >>"$rootfs/etc/passwd"
grep -q "^zerod:" "$rootfs/etc/group" || echo "zerod:x:$user_id:" >>"$rootfs/etc/group"
[ ! -f "$rootfs/etc/shadow" ] || grep -q "^zerod:" "$rootfs/etc/shadow" ||
  echo "zerod:!:::::::" >>"$rootfs/etc/shadow"
# The working directory (home) and the default socket directory.
install -d -m 0750 -o "$user_id" -g "$user_id" "$rootfs/var/lib/zerod" "$rootfs/run/zerod"
strip_host_files "$rootfs"
chroot "$rootfs" /sbin/ldconfig
rootfs_bytes=$(du -sb "$rootfs" | cut -f1)
"${buildah[@]}" umount "$container" >/dev/null
mounted=

# ---------------------------------------------------------------------------
# 4. Config, commit, archive
# ---------------------------------------------------------------------------
config=(--user "$user_id:$user_id" --workingdir /var/lib/zerod
  --entrypoint '["/usr/bin/zerod"]' --cmd '["standalone", "--dir=/run/zerod"]'
  --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
  --stop-signal SIGTERM --created-by scripts/image.sh
  --label org.opencontainers.image.title=zerod
  --label "org.opencontainers.image.description=zerod parameter-shard daemon (zerod, zerodctl, libzerod) on Debian $suite"
  --label "org.opencontainers.image.version=$version"
  --label "org.opencontainers.image.revision=$revision"
  --label "org.opencontainers.image.created=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  --label "org.opencontainers.image.base.name=debian:$suite (mmdebstrap --variant=essential)")
for port in "${ports[@]}"; do config+=(--port "$port/tcp"); done
"${buildah[@]}" config "${config[@]}" "$container"

echo "== buildah commit $name"
committing=$container
container= # the commit removes it
commit_and_archive "$committing" "$name" "$archive"

echo "== done in $((SECONDS - started)) s"
echo "image:   $name (buildah --root $storage/root --storage-driver $driver images)"
echo "archive: $archive, $(du -h "$archive" | cut -f1) (compressed layer)"
echo "rootfs:  $((rootfs_bytes / 1024 / 1024)) MiB unpacked, ${#packages[@]} runtime packages over the essential set"
