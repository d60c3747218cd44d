#!/bin/sh
# Builds the Kubernetes parts the tests and benchmarks run, and grpcurl, from
# Go modules served by the Go module proxy. The product stays Rust: these Go
# modules exist for the tests only.
#
#   build.sh              kube-apiserver, kubectl, kube-controller-manager,
#                         kube-scheduler, kubelet and kube-proxy, from the
#                         k8s.io/kubernetes module of tests/k8s/go.mod (the
#                         API, kubelet and Services suites). One `go build`
#                         for all six, so that the packages they share are
#                         compiled once.
#   build.sh whereabouts  whereabouts v0.9.2 and its CRDs, from
#                         tests/k8s/whereabouts/go.mod (bench_ipam only)
#   build.sh grpcurl      grpcurl (github.com/fullstorydev/grpcurl/cmd/grpcurl)
#                         at the version of tests/k8s/grpcurl/go.mod, which
#                         tests/setup.sh installs as /usr/local/bin/grpcurl
#                         (the admin suites and the demo)
#   build.sh e2e          e2e.test, the Kubernetes e2e tests of the network
#                         packages only (tests/k8s/e2e, `go test -c`), and
#                         agnhost (k8s.io/kubernetes/test/images/agnhost,
#                         static) with the porter's TLS files, from the same
#                         go.mod as `build.sh`, for sig-network's
#                         Conformance tests; and their conformance.yaml
#   build.sh coredns      CoreDNS with the plugins kubeadm's Corefile uses,
#                         from tests/k8s/coredns/go.mod (the cluster DNS of
#                         the Conformance tests, and agnhost's /coredns)
#
# k8s.io/kubernetes cannot be required as it is: its go.mod points every
# k8s.io/<staging> module at ./staging/src/..., which a module download does
# not have. go.mod therefore replaces each staging module with its published
# v0.X.Y of the same minor (v1.37.2 -> v0.37.2).
#
# The results are cached by tests/k8s/lib.sh as <what>-<inputs>-<go
# version>, keyed by what is built, its go.mod and go.sum, this script,
# lib.sh and the Go version. Prints the directory holding the binaries.
# The build's own time is printed on stderr.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
k8s=$here
who=k8s/build.sh
. "$k8s/lib.sh"
what=${1:-kube}
case "$what" in
kube) mod=$here ;;
whereabouts) mod=$here/whereabouts ;;
grpcurl) mod=$here/grpcurl ;;
e2e) mod=$here ;;
coredns) mod=$here/coredns ;;
*)
    echo "k8s/build.sh: nothing called $what to build (kube, whereabouts, grpcurl, e2e or coredns)" >&2
    exit 2
    ;;
esac

# The modules want Go 1.26 (k8s.io/kubernetes v1.37).
GO=$(pick_go 26)
goversion=$("$GO" env GOVERSION)
# The Go sources of this project's own packages count too: tests/k8s/e2e
# for e2e, tests/k8s/coredns for coredns (none for the others).
case "$what" in
e2e) own=$here/e2e/e2e_test.go ;;
coredns) own=$here/coredns/main.go ;;
*) own= ;;
esac
# shellcheck disable=SC2086 # $own is one path or none
cache_begin "$what" "$(inputs "$mod/go.mod" "$mod/go.sum" $own)-$goversion"
# Sets $ldflags to stamp k8s.io/kubernetes' version (of go.mod) the way the
# Kubernetes release build does: a module build has no git data.
kube_ldflags() {
    v=$(awk '{ for (i = 1; i < NF; i++) if ($i == "k8s.io/kubernetes" && $(i + 1) ~ /^v1\./) { print $(i + 1); exit } }' go.mod)
    [ -n "$v" ] || { echo "k8s/build.sh: no k8s.io/kubernetes version in go.mod" >&2; exit 1; }
    major=$(echo "$v" | cut -d. -f1 | tr -d v)
    minor=$(echo "$v" | cut -d. -f2)
    ldflags="-s -w"
    for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ldflags="$ldflags -X $p.gitVersion=$v -X $p.gitMajor=$major -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
    done
}

# -mod=mod: go.sum is committed, but the module cache starts empty on a new
# machine; downloads are checked against go.sum.
# Every build here is static (CGO_ENABLED=0), as Kubernetes' own release
# build makes its binaries, agnhost's image and CoreDNS's: one setting for
# all, so that the packages kube, e2e.test and agnhost share are compiled
# once, into Go's build cache, not once per setting.
export CGO_ENABLED=0
cd "$mod"
case "$what" in
kube)
    # A module build has no git data: stamp the version the way the
    # Kubernetes release build does, so that `kubectl version` and clients
    # that read /version see the real one.
    kube_ldflags
    "$GO" build -mod=mod -trimpath -ldflags="$ldflags" -o "$tmp/" \
        k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kubectl \
        k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler \
        k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy >&2
    for b in kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy; do
        "$tmp/$b" --version >&2
    done
    ;;
whereabouts)
    "$GO" build -mod=mod -trimpath -ldflags="-s -w" -o "$tmp/whereabouts" \
        github.com/k8snetworkplumbingwg/whereabouts/cmd >&2
    # Its CRDs, as the module ships them (doc/crds), beside the binary.
    src=$("$GO" list -mod=mod -m -f '{{.Dir}}' github.com/k8snetworkplumbingwg/whereabouts)
    mkdir "$tmp/crds"
    cp "$src"/doc/crds/whereabouts.cni.cncf.io_ippools.yaml \
        "$src"/doc/crds/whereabouts.cni.cncf.io_overlappingrangeipreservations.yaml "$tmp/crds/"
    ;;
grpcurl)
    # Stamped with its version as grpcurl's own release build does;
    # otherwise `grpcurl -version` says "dev build <no version set>".
    v=$(awk '$1 == "github.com/fullstorydev/grpcurl" && $2 ~ /^v/ { print $2; exit }' go.mod)
    [ -n "$v" ] || { echo "k8s/build.sh: no github.com/fullstorydev/grpcurl version in go.mod" >&2; exit 1; }
    "$GO" build -mod=mod -trimpath -ldflags="-s -w -X main.version=$v" -o "$tmp/grpcurl" \
        github.com/fullstorydev/grpcurl/cmd/grpcurl >&2
    "$tmp/grpcurl" -version >&2
    ;;
e2e)
    # Stamped like the kube binaries: e2e.test --version prints it, and
    # the e2e framework reports it beside the server's.
    kube_ldflags
    "$GO" test -c -vet=off -mod=mod -trimpath -ldflags="$ldflags" -o "$tmp/e2e.test" ./e2e >&2
    "$tmp/e2e.test" --version >&2
    # agnhost as upstream's image has it: static (its image build's
    # setting) and stamped with the version of its VERSION file,
    # which the image's tag is (test/utils/image/manifest.go).
    src=$("$GO" list -mod=mod -m -f '{{.Dir}}' k8s.io/kubernetes)
    av=$(cat "$src/test/images/agnhost/VERSION")
    "$GO" build -mod=mod -trimpath -ldflags="-s -w -X main.Version=$av" -o "$tmp/agnhost" \
        k8s.io/kubernetes/test/images/agnhost >&2
    "$tmp/agnhost" --version >&2
    # The porter's TLS files, which the image carries at its root, and the
    # list of Conformance tests (their names, to check a run against).
    cp "$src/test/images/agnhost/porter/localhost.crt" "$src/test/images/agnhost/porter/localhost.key" \
        "$src/test/conformance/testdata/conformance.yaml" "$tmp/"
    chmod 0644 "$tmp/localhost.crt" "$tmp/localhost.key" "$tmp/conformance.yaml"
    ;;
coredns)
    # Static, as CoreDNS's release build: its image has
    # nothing beside it, and agnhost's /coredns runs it too. Its version
    # is a constant of the module (coremain.CoreVersion).
    "$GO" build -mod=mod -trimpath -ldflags="-s -w" -o "$tmp/coredns" . >&2
    "$tmp/coredns" -version >&2
    ;;
esac
cache_end "$what"
