# Sourced by scripts/image.sh and scripts/image_torch.sh (and the wheel
# test, tests/python/test_zerod_wheel.py): how their root file systems are
# made and committed.

# mmdebstrap_root SUITE ROOTFS LOG MIRROR PACKAGE...: Debian SUITE's
# essential set and PACKAGEs, into ROOTFS (a directory, e.g. a buildah
# mount), with no documentation but the copyright files, no man pages or
# locales, /usr merged the way debootstrap does (without the hook,
# init-system-helpers' dependency pulls in the usrmerge package and perl,
# about 50 MB). MIRROR "" is mmdebstrap's own (deb.debian.org). Its output
# goes to LOG; on failure the log's end is printed and it returns 1.
mmdebstrap_root() {
  local suite=$1 rootfs=$2 log=$3 mirror=$4 include
  shift 4
  include=$(
    IFS=,
    echo "$*"
  )
  local mirror_args=()
  [ -z "$mirror" ] || mirror_args=("$mirror")
  mmdebstrap --variant=essential --quiet --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --include="$include" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/lintian/*' \
    "$suite" "$rootfs" "${mirror_args[@]}" >"$log" 2>&1 ||
    {
      tail -n 30 "$log" >&2
      return 1
    }
}

# strip_host_files ROOTFS: what mmdebstrap left of the build machine goes:
# device nodes (the runtime provides /dev; mmdebstrap made them for its
# chroot), and its resolver and name (runtimes mount their own).
strip_host_files() {
  find "$1/dev" -mindepth 1 -delete
  : >"$1/etc/resolv.conf"
  : >"$1/etc/hostname"
}

# commit_and_archive CONTAINER NAME ARCHIVE: commits the working container
# (which goes) as NAME in buildah's storage (through the caller's `buildah`
# command array), removes the image that had the name before unless a
# container still uses it, and writes NAME to the OCI archive ARCHIVE.
commit_and_archive() {
  local container=$1 name=$2 archive=$3 previous
  previous=$("${buildah[@]}" images --quiet --no-trunc "$name" 2>/dev/null || true)
  "${buildah[@]}" commit --quiet --format oci --rm "$container" "$name" >/dev/null
  if [ -n "$previous" ] && [ "$previous" != "$("${buildah[@]}" images --quiet --no-trunc "$name")" ]; then
    "${buildah[@]}" rmi "$previous" >/dev/null 2>&1 || true
  fi
  rm -f "$archive"
  "${buildah[@]}" push --quiet "$name" "oci-archive:$archive:$name"
}
