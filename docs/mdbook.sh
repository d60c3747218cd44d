#!/bin/sh
# Installs mdBook, which builds the docs book (docs/, `make docs`), at the
# version pinned below, from crates.io with cargo (mdBook is no Debian 12
# package): `cargo install --locked`, so that its dependencies are the ones
# its own Cargo.lock pins, without the `serve` and `watch` features (a web
# server and a file watcher the build does not use, and most of the build's
# time), and unoptimized (`--debug`): 147 s of CPU to build instead of 329 s
# (measured 2026-11-29 on the 2-core machine), for a book build of 4.6 s
# instead of 0.9 s, the same files.
#
# Cached like the Go tools of tests/k8s/build.sh: in $TETHER_TOOLS_DIR
# (default /var/tmp/tether-tools)/mdbook-<version>-<inputs>, keyed by this
# script and the Rust version; a cached build is reused at once. Prints the
# directory holding `mdbook`; the build's own output and time go to stderr.
set -eu
version=0.5.4
base=${TETHER_TOOLS_DIR:-/var/tmp/tether-tools}
rust=$(rustc --version | awk '{ print $2 }')
inputs=$(sha256sum < "$0" | cut -c1-16)
out="$base/mdbook-$version-$inputs-rust$rust"
if [ -f "$out/done" ]; then
    echo "$out/bin"
    exit 0
fi

mkdir -p "$base"
# One build at a time: two checkouts' `make docs` on one machine wait here
# for the first one's build instead of building another.
exec 9>"$base/mdbook.lock"
flock 9
if [ -f "$out/done" ]; then
    echo "$out/bin"
    exit 0
fi
tmp=$(mktemp -d "$base/build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
start=$(date +%s)
echo "docs/mdbook.sh: building mdbook $version with rustc $rust (once; cached in $out)" >&2
# Its own target dir: never the workspace's, whatever CARGO_TARGET_DIR says.
CARGO_TARGET_DIR="$tmp/target" cargo install mdbook --locked --version "=$version" \
    --no-default-features --features search --debug --root "$tmp/root" >&2
"$tmp/root/bin/mdbook" --version >&2
echo "docs/mdbook.sh: built mdbook $version in $(($(date +%s) - start)) s" >&2
rm -rf "$out"
mv "$tmp/root" "$out"
touch "$out/done"
# Older builds are of no more use.
for old in "$base"/mdbook-*; do
    [ "$old" = "$out" ] || rm -rf "$old"
done
echo "$out/bin"
