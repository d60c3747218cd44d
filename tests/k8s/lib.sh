#!/bin/sh
# Shared by the builders of tests/k8s (sourced, not run): the steps every
# one of them takes around its own build.
#
#   pick_go MINOR          the first Go at least 1.MINOR on the PATH or in
#                          the usual places (Debian's golang-go, 1.19, is
#                          installed for tests/runtimes/cnitool and too old)
#   cache_begin NAME KEY   $out is $TETHER_K8S_DIR (default
#                          /var/tmp/tether-k8s)/NAME-KEY; a finished build
#                          there is marked in use, printed, and the script
#                          exits; otherwise $tmp is a fresh directory beside
#                          it, removed on failure
#   cache_end NAME         moves $tmp to $out, marks it done, removes other
#                          NAME builds not used for two days (one used
#                          lately may be another checkout's), prints $out
#   inputs FILE...         the cache key of FILEs, this file and the script
#                          that sources it
#   debian_root DIR PACKAGES [mmdebstrap options...]
#                          a Debian 12 minbase root in DIR with PACKAGES
#                          (comma separated), as an image wants it
#
# The script sets $who (its name, for messages) and $k8s (the tests/k8s
# directory) before it sources this file. Messages go to stderr; stdout
# carries only the directory each builder prints.

base=${TETHER_K8S_DIR:-/var/tmp/tether-k8s}

# Every Go build here links with -s -w, which leaves the debug information
# out of the binary; compiled without it in the first place, each package
# costs less: 6 % less CPU for grpcurl's build (189 s instead of 201 s,
# measured 2026-11-29 on the 2-core machine), on builds whose CPU sets how
# long `make test` takes on a new machine. One setting for every builder,
# so that the packages they share are compiled once, into Go's build cache.
export GOFLAGS="${GOFLAGS:+$GOFLAGS }-gcflags=all=-dwarf=false"

pick_go() {
    for g in "$(command -v go 2>/dev/null || true)" /usr/local/go/bin/go /opt/go/bin/go /usr/lib/go/bin/go; do
        [ -n "$g" ] && [ -x "$g" ] || continue
        v=$("$g" env GOVERSION 2>/dev/null || true)
        minor=$(echo "$v" | sed -n 's/^go1\.\([0-9]*\).*/\1/p')
        if [ -n "$minor" ] && [ "$minor" -ge "$1" ]; then
            echo "$g"
            return 0
        fi
    done
    echo "$who: no Go 1.$1 or newer found (PATH, /usr/local/go, /opt/go); the machine's own Go is needed (Debian's golang-go is too old)" >&2
    return 1
}

inputs() {
    cat "$@" "$k8s/lib.sh" "$0" | sha256sum | cut -c1-16
}

cache_begin() {
    out="$base/$1-$2"
    if [ -f "$out/done" ]; then
        touch "$out/done"
        echo "$out"
        exit 0
    fi
    mkdir -p "$base"
    tmp=$(mktemp -d "$base/build.XXXXXX")
    # apt downloads as the user _apt, which must reach a root's directory.
    chmod 0755 "$tmp"
    # --one-file-system: should a failed mmdebstrap leave /dev, /proc or
    # /sys mounted in a root, the machine's own are not removed with it.
    trap 'rm -rf --one-file-system "$tmp"' EXIT
    start=$(date +%s)
    echo "$who: building $1 (once; cached in $out)" >&2
}

cache_end() {
    echo "$who: built $1 in $(($(date +%s) - start)) s ($(du -sh "$tmp" | cut -f1))" >&2
    rm -rf --one-file-system "$out"
    mv "$tmp" "$out"
    trap - EXIT
    touch "$out/done"
    # NAME-<16 hex digits of the key>...: not NAME-roots-... of another.
    for old in "$base/$1"-[0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f]*; do
        [ -e "$old" ] || continue
        [ "$old" = "$out" ] && continue
        [ -n "$(find "$old/done" -mtime -2 2>/dev/null)" ] || rm -rf --one-file-system "$old"
    done
    echo "$out"
}

debian_root() {
    dir=$1
    packages=$2
    shift 2
    # /usr is merged by mmdebstrap's own hook (the debootstrap way: the
    # links, then the usr-is-merged package), which spares the root the
    # usrmerge package and the Perl it needs.
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
        bookworm "$dir" \
        "deb http://deb.debian.org/debian bookworm main" \
        "deb http://deb.debian.org/debian bookworm-updates main" \
        "deb http://deb.debian.org/debian-security bookworm-security main" >&2
    # The runtime mounts /dev, and the kubelet provides /etc/resolv.conf,
    # /etc/hosts and /etc/hostname: nothing of the build machine's stays.
    find "$dir/dev" -xdev -mindepth 1 -delete
    rm -f "$dir/etc/resolv.conf" "$dir/etc/hostname"
    # apt's lists and downloaded packages are of no use in an image.
    rm -rf "$dir/var/lib/apt/lists/"* "$dir/var/cache/apt/"*.bin
}

# debian_roots_prepare: what a script of debian_root calls first: root,
# and mmdebstrap.
debian_roots_prepare() {
    if [ "$(id -u)" -ne 0 ]; then
        echo "$who: must run as root (mmdebstrap builds the roots as root)" >&2
        exit 1
    fi
    command -v mmdebstrap >/dev/null 2>&1 || {
        echo "$who: mmdebstrap is missing (tests/setup.sh installs it)" >&2
        exit 1
    }
}
