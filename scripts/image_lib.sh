# Sourced by scripts/image.sh and scripts/image_torch.sh: what both images'
# root file systems are made with.

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
