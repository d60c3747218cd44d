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
# Cached like the Kubernetes binaries (tests/k8s/build.sh, which this
# script leaves alone so that their cache stays valid): in
# $TETHER_K8S_DIR (default /var/tmp/tether-k8s)/helm-<inputs>-<go version>,
# keyed by go.mod, go.sum, this script and the Go version; a cached build
# is reused at once. Prints the directory holding `helm`; the build's own
# time goes to stderr.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
base=${TETHER_K8S_DIR:-/var/tmp/tether-k8s}

# helm v4.3 wants Go 1.26 (its go.mod): the first Go on the PATH or in the
# usual places that is at least that, as tests/k8s/build.sh picks it
# (Debian's golang-go, 1.19, is too old).
pick_go() {
    for g in "$(command -v go 2>/dev/null || true)" /usr/local/go/bin/go /opt/go/bin/go /usr/lib/go/bin/go; do
        [ -n "$g" ] && [ -x "$g" ] || continue
        v=$("$g" env GOVERSION 2>/dev/null || true)
        minor=$(echo "$v" | sed -n 's/^go1\.\([0-9]*\).*/\1/p')
        if [ -n "$minor" ] && [ "$minor" -ge 26 ]; then
            echo "$g"
            return 0
        fi
    done
    return 1
}
GO=$(pick_go) || {
    echo "k8s/helm/build.sh: no Go 1.26 or newer found (PATH, /usr/local/go, /opt/go); the machine's Go is needed to build helm" >&2
    exit 1
}
goversion=$("$GO" env GOVERSION)
inputs=$(cat "$here/go.mod" "$here/go.sum" "$here/build.sh" | sha256sum | cut -c1-16)
out="$base/helm-$inputs-$goversion"
if [ -f "$out/done" ]; then
    echo "$out"
    exit 0
fi

mkdir -p "$base"
tmp=$(mktemp -d "$base/build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
start=$(date +%s)
echo "k8s/helm/build.sh: building helm with $goversion (once; cached in $out)" >&2
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
echo "k8s/helm/build.sh: built helm $v in $(($(date +%s) - start)) s" >&2
rm -rf "$out"
mv "$tmp" "$out"
trap - EXIT
touch "$out/done"
# Older builds are of no more use.
for old in "$base"/helm-*; do
    [ "$old" = "$out" ] || rm -rf "$old"
done
echo "$out"
