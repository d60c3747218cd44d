#!/bin/sh
# Builds KubeVirt's binaries from the kubevirt.io/kubevirt Go module (the
# version pinned in go.mod beside this script), for the KubeVirt suite only
# (tests/e2e/kube/kubevirt.rs, `make kubevirt`): the product stays Rust.
#
# kubevirt.io/kubevirt cannot be required as it is: its go.mod replaces
# kubevirt.io/api and kubevirt.io/client-go with ./staging/src/..., which a
# module download does not have. go.mod here carries its replace block with
# those two mapped to their published modules of the same version.
#
# Built: virt-operator, virt-api, virt-controller, virt-handler, virt-chroot
# (virt-handler's image carries it), virt-launcher, virt-launcher-monitor,
# virt-freezer, virt-probe, virt-tail, in one `go build` so that the
# packages they share are compiled once, and container-disk (C, static,
# cmd/container-disk-v2alpha). cgo is on: virt-handler's node-labeller
# reads <linux/kvm.h> (linux-libc-dev); virt-launcher links libvirt with
# the libvirt_dlopen tag, so no libvirt headers are needed at build time
# and libvirt.so is loaded at run time from the launcher image. Beside the
# binaries: the files the upstream images carry from the module
# (virt-launcher's qemu.conf, virtqemud.conf, hooks/qemu, node-labeller.sh,
# nsswitch.conf) and the operator manifest, rendered for the local images
# (registry localhost/kubevirt, tag the module's version).
#
# Cached by tests/k8s/lib.sh as kubevirt-<inputs>-<go version>, keyed by
# go.mod, go.sum, this script, lib.sh and the Go version. Prints the
# directory; the build's own time goes to stderr.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
k8s=$(dirname "$here")
who=k8s/kubevirt/build.sh
. "$k8s/lib.sh"

# KubeVirt v1.7 wants Go 1.24; the machine's Go for the other modules is
# 1.26.
GO=$(pick_go 24)
goversion=$("$GO" env GOVERSION)
cache_begin kubevirt "$(inputs "$here/go.mod" "$here/go.sum")-$goversion"
cd "$here"
v=$(awk '$1 == "kubevirt.io/kubevirt" && $2 ~ /^v1\./ { print $2; exit }' go.mod)
[ -n "$v" ] || { echo "k8s/kubevirt/build.sh: no kubevirt.io/kubevirt version in go.mod" >&2; exit 1; }
# Stamped as KubeVirt's release build does (hack/version.sh): the
# components report it, and the operator compares it with the KubeVirt CR's
# observed version.
ldflags="-s -w -X kubevirt.io/client-go/version.gitVersion=$v -X kubevirt.io/client-go/version.gitTreeState=clean"
ldflags="$ldflags -X kubevirt.io/client-go/version.buildDate=1970-01-01T00:00:00Z"
cmds=""
for c in virt-operator virt-api virt-controller virt-handler virt-chroot virt-launcher \
    virt-launcher-monitor virt-freezer virt-probe virt-tail; do
    cmds="$cmds kubevirt.io/kubevirt/cmd/$c"
done
# And KubeVirt's manifest templator, which renders the operator manifest
# below as KubeVirt's release does (hack/build-manifests.sh).
cmds="$cmds kubevirt.io/kubevirt/tools/manifest-templator"
# -mod=mod: go.sum is committed, but the module cache starts empty on a new
# machine; downloads are checked against go.sum.
# shellcheck disable=SC2086 # $cmds is a list of packages
"$GO" build -mod=mod -trimpath -tags libvirt_dlopen -ldflags="$ldflags" -o "$tmp/" $cmds >&2
src=$("$GO" list -mod=mod -m -f '{{.Dir}}' kubevirt.io/kubevirt)
# container-disk: the tiny C server of containerDisk images (it keeps the
# disk's container alive and marks it with a socket), static as upstream's.
${CC:-cc} -static -O2 -o "$tmp/container-disk" "$src/cmd/container-disk-v2alpha/main.c"
# The operator manifest a user applies (kubevirt-operator.yaml of a
# release), rendered from the module's template in KubeVirt's two passes,
# for the images tests/src/kubevirt_images.rs makes: registry
# localhost/kubevirt, tag = the module's version, pulled only if absent
# (they are imported into every node, never pulled).
registry=localhost/kubevirt
"$tmp/manifest-templator" --process-files --generated-manifests-dir="$src/manifests/generated/" \
    --input-file="$src/manifests/release/kubevirt-operator.yaml.in" >"$tmp/kubevirt-operator.yaml.in"
"$tmp/manifest-templator" --process-vars --namespace=kubevirt --container-prefix="$registry" \
    --container-tag="$v" --image-pull-policy=IfNotPresent --verbosity=2 \
    --kubevirt-logo-path="$src/assets/kubevirt_logo.png" --input-file="$tmp/kubevirt-operator.yaml.in" >"$tmp/kubevirt-operator.yaml"
rm "$tmp/kubevirt-operator.yaml.in" "$tmp/manifest-templator"
mkdir "$tmp/files"
cp "$src/cmd/virt-launcher/qemu.conf" "$src/cmd/virt-launcher/virtqemud.conf" \
    "$src/cmd/virt-launcher/nsswitch.conf" "$src/cmd/virt-launcher/node-labeller/node-labeller.sh" \
    "$src/cmd/virt-launcher/qemu" "$tmp/files/"
chmod -R u+w "$tmp/files"
cache_end kubevirt
