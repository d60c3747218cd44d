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
# Cached by tests/k8s/lib.sh as kubevirt-roots-<inputs>, keyed by this script and
# lib.sh. Prints the directory holding one directory per root, named as
# above; the build's time goes to stderr.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
k8s=$(dirname "$here")
who=k8s/kubevirt/images.sh
. "$k8s/lib.sh"
debian_roots_prepare
cache_begin kubevirt-roots "$(inputs)"

# root NAME PACKAGES [mmdebstrap options...]: a root in $tmp/NAME.
root() {
    name=$1
    shift
    debian_root "$tmp/$name" "$@"
}

root base ca-certificates

root handler qemu-utils,iproute2,nftables,procps,mount,util-linux,findutils,tar

# qemu = 107 (KubeVirt's passwd for its images: cmd/virt-launcher/BUILD.bazel).
root launcher libvirt-daemon,libvirt-daemon-driver-qemu,libvirt-clients,qemu-system-x86,qemu-utils,iproute2,nftables,ethtool,procps,findutils,tar,passwd \
    --customize-hook='chroot "$1" groupadd -g 107 qemu' \
    --customize-hook='chroot "$1" useradd -u 107 -g 107 -M -d / -s /bin/bash qemu'

cache_end kubevirt-roots
