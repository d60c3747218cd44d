#!/bin/sh
# Builds helm from its Go module (helm.sh/helm/v4, the version pinned in
# go.mod beside this script), for the tests only: `helm lint` and
# `helm template` of install/helm/tether in the install suite, the plain
# manifests it generates (install/generate.sh), and `helm install`,
# `upgrade` and `uninstall` against the real kube-apiserver of the kubelet
# suite. Helm 4 rather than 3: Helm 3's bug fixes ended with its last
# feature release (September 2026) and it gets security fixes only, until
# February 2027; the chart (apiVersion v2) is one both render.
#
# Cached by tests/k8s/lib.sh as helm-<inputs>-<go version>, keyed by
# go.mod, go.sum, this script, lib.sh and the Go version. Prints the
# directory holding `helm`; the build's own time goes to stderr.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
k8s=$(dirname "$here")
who=k8s/helm/build.sh
. "$k8s/lib.sh"

# helm v4.3 wants Go 1.26 (its go.mod).
GO=$(pick_go 26)
goversion=$("$GO" env GOVERSION)
cache_begin helm "$(inputs "$here/go.mod" "$here/go.sum")-$goversion"
cd "$here"
# Stamped with its version as helm's own Makefile does; otherwise
# `helm version` says "v4.3" and the chart's kubeVersion checks see no
# patch level.
v=$(awk '$1 == "helm.sh/helm/v4" && $2 ~ /^v/ { print $2; exit }' go.mod)
[ -n "$v" ] || { echo "k8s/helm/build.sh: no helm.sh/helm/v4 version in go.mod" >&2; exit 1; }
# -mod=mod: go.sum is committed, but the module cache starts empty on a
# new machine; downloads are checked against go.sum. CGO off, as helm's
# release build.
CGO_ENABLED=0 "$GO" build -mod=mod -trimpath \
    -ldflags="-s -w -X helm.sh/helm/v4/internal/version.version=$v -X helm.sh/helm/v4/internal/version.gitTreeState=clean" \
    -o "$tmp/helm" helm.sh/helm/v4/cmd/helm >&2
"$tmp/helm" version >&2
cache_end helm
