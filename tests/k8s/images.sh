#!/bin/sh
# Builds the Debian root filesystems of the Kubernetes Conformance tests'
# images, for the tests only: upstream's images come from a registry,
# these are made here from Debian packages (Debian 12, bookworm, the
# machine's release) with mmdebstrap, so that no registry is needed.
# tests/src/conformance_images.rs packs each root, with the files built
# from Go modules on top (agnhost, CoreDNS), into an OCI archive under the
# image name the e2e tests use (test/utils/image/manifest.go).
#
#   agnhost            the tools upstream's agnhost image (Alpine) installs
#                      for the tests: dig and nslookup (dnsutils), curl,
#                      nc (netcat-openbsd), ip and ss (iproute2), bash and
#                      socat; and the user and group its SupplementalGroups
#                      test expects (test/images/agnhost/Dockerfile)
#   glibc-dns-testing  dig, as upstream's (Debian plus dnsutils)
#   nginx              Debian's nginx, serving its default site on port
#                      80, logging to the container's stdout and stderr
#
# Each is a --variant=minbase root (the Essential packages, apt, and what is
# named, without what those only recommend), without documentation, manual
# pages and translations. Run as root
# (mmdebstrap's root mode writes the directory as root owns it); needs the
# network to reach deb.debian.org, as apt on this machine does.
#
# Cached in $TETHER_K8S_DIR (default /var/tmp/tether-k8s), keyed by this
# script: a cached build is reused at once. Prints the directory holding
# one directory per root, named as above; the build's time goes to stderr.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
base=${TETHER_K8S_DIR:-/var/tmp/tether-k8s}

if [ "$(id -u)" -ne 0 ]; then
    echo "k8s/images.sh: must run as root (mmdebstrap builds the roots as root)" >&2
    exit 1
fi
command -v mmdebstrap >/dev/null 2>&1 || {
    echo "k8s/images.sh: mmdebstrap is missing (tests/setup.sh installs it)" >&2
    exit 1
}

inputs=$(sha256sum <"$here/images.sh" | cut -c1-16)
out="$base/debian-roots-$inputs"
if [ -f "$out/done" ]; then
    echo "$out"
    exit 0
fi

mkdir -p "$base"
tmp=$(mktemp -d "$base/roots.XXXXXX")
# apt downloads as the user _apt, which must reach the roots' directories.
chmod 0755 "$tmp"
# --one-file-system: should a failed mmdebstrap leave /dev, /proc or /sys
# mounted in a root, the machine's own are not removed with it.
trap 'rm -rf --one-file-system "$tmp"' EXIT
start=$(date +%s)
echo "k8s/images.sh: building the Debian roots (once; cached in $out)" >&2

# The archive and its updates, as the machine's apt has them.
mirror=http://deb.debian.org/debian
security=http://deb.debian.org/debian-security

# root NAME PACKAGES [mmdebstrap options...]: a minbase root with PACKAGES
# (comma separated) in $tmp/NAME. /usr is merged by mmdebstrap's own hook
# (the debootstrap way: the links, then the usr-is-merged package), which
# spares the root the usrmerge package and the Perl it needs.
root() {
    name=$1
    packages=$2
    shift 2
    mmdebstrap --quiet --variant=minbase --mode=root --format=directory \
        --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
        --include="$packages" \
        --aptopt='APT::Install-Recommends "false"' \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        "$@" \
        bookworm "$tmp/$name" \
        "deb $mirror bookworm main" \
        "deb $mirror bookworm-updates main" \
        "deb $security bookworm-security main" >&2
    # The runtime mounts /dev, and the kubelet provides /etc/resolv.conf,
    # /etc/hosts and /etc/hostname: nothing of the build machine's stays.
    find "$tmp/$name/dev" -xdev -mindepth 1 -delete
    rm -f "$tmp/$name/etc/resolv.conf" "$tmp/$name/etc/hostname"
}

root agnhost dnsutils,curl,netcat-openbsd,iproute2,bash,socat \
    --customize-hook='chroot "$1" groupadd -g 50000 group-defined-in-image' \
    --customize-hook='chroot "$1" useradd -u 1000 -G group-defined-in-image -M -s /bin/sh user-defined-in-image' \
    --customize-hook='mkdir -p "$1/uploads"'

root glibc-dns-testing dnsutils

# Debian's nginx runs as a daemon and logs to files; the image's command
# (nginx -g 'daemon off;', as upstream's nginx image) keeps it in the
# foreground, and the log files lead to the container's output.
root nginx nginx \
    --customize-hook='ln -sf /dev/stdout "$1/var/log/nginx/access.log"' \
    --customize-hook='ln -sf /dev/stderr "$1/var/log/nginx/error.log"'

echo "k8s/images.sh: built the Debian roots in $(($(date +%s) - start)) s ($(du -sh "$tmp" | cut -f1))" >&2
rm -rf --one-file-system "$out"
mv "$tmp" "$out"
trap - EXIT
touch "$out/done"
# Older builds are of no more use.
for old in "$base"/debian-roots-*; do
    [ "$old" = "$out" ] || rm -rf --one-file-system "$old"
done
echo "$out"
