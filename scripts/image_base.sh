#!/usr/bin/env bash
# A Debian 12 (bookworm) base image made on this machine, for building the image where no container registry
# is reachable: debootstrap (minbase) from a Debian mirror, slimmed as the official debian:bookworm-slim is
# (no documentation, man pages or locales; apt keeps no .debs, lists or caches), imported into buildah's local
# storage. The root filesystem is kept as a tar in the cache folder (for 30 days), so a later run only imports
# it.
#
#   scripts/image_base.sh [--fresh]     prints the image's name; --fresh: debootstrap again
#   scripts/image_base.sh --remove      removes the image and the cached tar
#
# Then: buildah build --build-arg DEVICE=cpu --build-arg BASE_CPU=localhost/cosystream-base:bookworm ...
# Needs root, buildah and debootstrap. Environment: IMAGE_CACHE (default .cache/image), DEBIAN_MIRROR
# (default http://deb.debian.org/debian), DEBIAN_SECURITY_MIRROR (default: the mirror's debian-security),
# IMAGE_BASE (default localhost/cosystream-base:bookworm).
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${IMAGE_CACHE:-.cache/image}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY=${DEBIAN_SECURITY_MIRROR:-${MIRROR%/debian}/debian-security}
NAME=${IMAGE_BASE:-localhost/cosystream-base:bookworm}
TAR=$CACHE/bookworm-rootfs.tar
mkdir -p "$CACHE"

remove() {
  rm -f "$TAR"
  if buildah inspect --type image "$NAME" >/dev/null 2>&1; then
    buildah rmi --force "$NAME" >/dev/null  # with the containers made from it
  fi
}
case "${1:-}" in
  --remove) remove; exit 0 ;;
  --fresh) remove ;;
  "") ;;
  *) echo "usage: $0 [--fresh | --remove]" >&2; exit 2 ;;
esac

# Made again once a month, for Debian's point releases and security updates.
if [ -n "$(find "$TAR" -mtime +30 2>/dev/null)" ]; then remove; fi
if buildah inspect --type image "$NAME" >/dev/null 2>&1; then
  echo "$NAME"
  exit 0
fi

root=""
ctr=""
cleanup() {
  if [ -n "$ctr" ]; then buildah rm "$ctr" >/dev/null 2>&1 || true; fi
  if [ -n "$root" ] && [ -d "$root" ]; then
    # debootstrap mounts /proc and /sys inside the target; never delete through a mount.
    awk -v r="$root/" 'index($2, r) == 1 {print $2}' /proc/mounts | sort -r | xargs -r -n1 umount -l
    rm -rf --one-file-system "$root"
  fi
}
trap cleanup EXIT

if [ ! -s "$TAR" ]; then
  root=$(mktemp -d "$(realpath "$CACHE")/rootfs.XXXXXX")
  echo "image base: debootstrap bookworm from $MIRROR (log: $CACHE/debootstrap.log)" >&2
  if ! debootstrap --variant=minbase bookworm "$root" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1; then
    tail -n 20 "$CACHE/debootstrap.log" >&2
    exit 1
  fi
  cat >"$root/etc/apt/sources.list" <<EOF
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb $SECURITY bookworm-security main
EOF
  # What debian:bookworm-slim does: dpkg leaves out documentation, man pages and locales, apt keeps no cache.
  cat >"$root/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/lintian/*
EOF
  cat >"$root/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
Acquire::Languages "none";
EOF
  find "$root/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete
  rm -rf "$root"/usr/share/{info,locale,man,groff,lintian}/* "$root"/var/cache/apt/* "$root"/var/lib/apt/lists/* \
    "$root"/var/log/*.log "$root"/var/log/apt/* "$root"/var/cache/debconf/*-old
  : >"$root/etc/resolv.conf"
  : >"$root/etc/hostname"
  tar --numeric-owner --xattrs -C "$root" -cf "$TAR.tmp" .
  mv "$TAR.tmp" "$TAR"
fi

ctr=$(buildah from scratch)
buildah add --quiet "$ctr" "$TAR" / >/dev/null
buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd bash \
  --label org.opencontainers.image.description="Debian 12 minbase, made with debootstrap (scripts/image_base.sh)" \
  "$ctr"
buildah commit --quiet --rm "$ctr" "$NAME" >/dev/null
ctr=""
echo "$NAME"
