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
#                      nc (netcat-openbsd), ip and ss (iproute2), iperf,
#                      bash and socat; wget, which Alpine's busybox gives it
#                      and two Services tests run ("wget -q -O -"); and the
#                      user and group its SupplementalGroups test expects
#                      (test/images/agnhost/Dockerfile)
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
# Cached by tests/k8s/lib.sh as debian-roots-<inputs>, keyed by this script and
# lib.sh. Prints the directory holding one directory per root, named as
# above; the build's time goes to stderr.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
k8s=$here
who=k8s/images.sh
. "$k8s/lib.sh"
debian_roots_prepare
cache_begin debian-roots "$(inputs)"

# root NAME PACKAGES [mmdebstrap options...]: a root in $tmp/NAME.
root() {
    name=$1
    shift
    debian_root "$tmp/$name" "$@"
}

root agnhost dnsutils,curl,wget,netcat-openbsd,iproute2,iperf,bash,socat \
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

cache_end debian-roots
