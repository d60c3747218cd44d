#!/bin/sh
# Builds the Debian root filesystems of KubeVirt's images, for the KubeVirt
# suite only: upstream's images come from a registry and are built on
# CentOS Stream packages; these are made here from Debian packages (Debian
# 12, bookworm, the machine's release) with mmdebstrap, as
# tests/k8s/images.sh makes the Conformance tests' roots (which this script
# leaves alone, so that their cache stays valid).
# tests/src/kubevirt_images.rs packs each root, with the binaries of
# build.sh beside this script on top, into an OCI archive under the name
# KubeVirt's operator derives.
#
#   base      virt-operator, virt-api and virt-controller (Go programs with
#             glibc): the minbase root alone
#   handler   virt-handler and virt-chroot, with what upstream's handler
#             base adds that the node-side code runs: qemu-img
#             (qemu-utils), ip (iproute2), nft, ps, mount and findmnt, tar
#   launcher  virt-launcher and its helpers, with Debian's libvirt daemon
#             and QEMU driver (libvirtd, virtlogd, virsh), QEMU for x86
#             (qemu-system-x86, which runs guests by software emulation
#             here), qemu-img, ip, nft, ethtool, ps, tar; and the user and
#             group qemu = 107, which KubeVirt runs the launcher and QEMU as
#
# Each is a --variant=minbase root (the Essential packages, apt, and what is
# named, without what those only recommend), without documentation, manual
# pages and translations. Run as root; needs the network to reach
# deb.debian.org, as apt on this machine does.
#
# Cached in $TETHER_K8S_DIR (default /var/tmp/tether-k8s), keyed by this
# script: a cached build is reused at once. Prints the directory holding
# one directory per root, named as above; the build's time goes to stderr.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
base=${TETHER_K8S_DIR:-/var/tmp/tether-k8s}

if [ "$(id -u)" -ne 0 ]; then
    echo "k8s/kubevirt/images.sh: must run as root (mmdebstrap builds the roots as root)" >&2
    exit 1
fi
command -v mmdebstrap >/dev/null 2>&1 || {
    echo "k8s/kubevirt/images.sh: mmdebstrap is missing (tests/setup.sh installs it)" >&2
    exit 1
}

inputs=$(sha256sum <"$here/images.sh" | cut -c1-16)
out="$base/kubevirt-roots-$inputs"
if [ -f "$out/done" ]; then
    touch "$out/done"
    echo "$out"
    exit 0
fi

mkdir -p "$base"
tmp=$(mktemp -d "$base/kvroots.XXXXXX")
# apt downloads as the user _apt, which must reach the roots' directories.
chmod 0755 "$tmp"
# --one-file-system: should a failed mmdebstrap leave /dev, /proc or /sys
# mounted in a root, the machine's own are not removed with it.
trap 'rm -rf --one-file-system "$tmp"' EXIT
start=$(date +%s)
echo "k8s/kubevirt/images.sh: building KubeVirt's Debian roots (once; cached in $out)" >&2

mirror=http://deb.debian.org/debian
security=http://deb.debian.org/debian-security

# root NAME PACKAGES [mmdebstrap options...]: as tests/k8s/images.sh.
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
    find "$tmp/$name/dev" -xdev -mindepth 1 -delete
    rm -f "$tmp/$name/etc/resolv.conf" "$tmp/$name/etc/hostname"
    # apt's lists and downloaded packages are of no use in an image.
    rm -rf "$tmp/$name/var/lib/apt/lists/"* "$tmp/$name/var/cache/apt/"*.bin
}

root base ca-certificates

root handler qemu-utils,iproute2,nftables,procps,mount,util-linux,findutils,tar

# qemu = 107 (KubeVirt's passwd for its images: cmd/virt-launcher/BUILD.bazel).
root launcher libvirt-daemon,libvirt-daemon-driver-qemu,libvirt-clients,qemu-system-x86,qemu-utils,iproute2,nftables,ethtool,procps,findutils,tar,passwd \
    --customize-hook='chroot "$1" groupadd -g 107 qemu' \
    --customize-hook='chroot "$1" useradd -u 107 -g 107 -M -d / -s /bin/bash qemu'

echo "k8s/kubevirt/images.sh: built the roots in $(($(date +%s) - start)) s ($(du -sh "$tmp" | cut -f1))" >&2
rm -rf --one-file-system "$out"
mv "$tmp" "$out"
trap - EXIT
touch "$out/done"
# Other builds not used for two days are of no more use.
for old in "$base"/kubevirt-roots-*; do
    [ "$old" = "$out" ] && continue
    [ -n "$(find "$old/done" -mtime -2 2>/dev/null)" ] || rm -rf --one-file-system "$old"
done
echo "$out"
