#!/bin/sh
# Builds the test guest: a Debian cloud kernel (unpacked, never installed)
# and an initramfs of busybox-static, the virtio-net modules, dhcpcd and
# tether-echo (tests/guest/echo.rs, the guest's end of the connection
# streams, built here with rustc), whose init (tests/guest/init) asks for a
# lease with a real DHCP client.
# Beside it, agent.cpio.gz: an initramfs overlay (a second cpio archive,
# which the kernel unpacks over the first when both are given as one
# initrd) with Debian's qemu-guest-agent, the libraries it links and the
# virtio_console module: the KubeVirt suite's guest runs the agent
# (KubeVirt shows the guest's addresses from it, and the suite runs its
# commands through it); the other suites' guests do without.
# The result is cached in $TETHER_GUEST_DIR (default /var/tmp/tether-guest),
# keyed by the kernel package version and the guest's own files; a cached
# guest is reused at once. Prints the directory holding vmlinuz and
# initramfs.gz. Run as root (apt-get download).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
base=${TETHER_GUEST_DIR:-/var/tmp/tether-guest}

who=build.sh
. "$here/kernel.sh"
dver=$(apt-cache policy dhcpcd-base | awk '/Candidate:/ { print $2 }')
gver=$(apt-cache policy qemu-guest-agent | awk '/Candidate:/ { print $2 }')
command -v rustc >/dev/null || { echo "build.sh: no rustc on PATH (tether-echo is built with it)" >&2; exit 1; }
inputs=$( (cat "$here/build.sh" "$here/kernel.sh" "$here/init" "$here/udhcpc.script" "$here/dhcpcd.script" \
    "$here/echo.rs" /bin/busybox; rustc --version; echo "$gver") | sha256sum | cut -c1-16)
out="$base/$pkg-$kver-$dver-$inputs"
if [ -f "$out/done" ]; then
    echo "$out"
    exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
if ! apt-get download "$pkg" dhcpcd-base qemu-guest-agent >&2; then
    apt-get update >&2
    apt-get download "$pkg" dhcpcd-base qemu-guest-agent >&2
fi
dpkg-deb -x "$pkg"_*.deb kernel
dpkg-deb -x dhcpcd-base_*.deb dhcpcd
dpkg-deb -x qemu-guest-agent_*.deb agent

root=$work/root
mkdir -p "$root/bin" "$root/etc" "$root/proc" "$root/sys" "$root/dev" "$root/run" \
    "$root/tmp" "$root/lib/modules" "$root/var/lib/dhcpcd" "$root/sbin"
cp /bin/busybox "$root/bin/busybox"
ln -s busybox "$root/bin/sh"
for m in virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci \
         failover net_failover virtio_net; do
    ko=$(find kernel/lib/modules -name "$m.ko*" | head -n1)
    [ -n "$ko" ] || { echo "build.sh: module $m not in $pkg" >&2; exit 1; }
    case "$ko" in
    *.xz) busybox unxz -c "$ko" > "$root/lib/modules/$m.ko" ;;
    *.ko) cp "$ko" "$root/lib/modules/$m.ko" ;;
    *) echo "build.sh: cannot unpack $ko" >&2; exit 1 ;;
    esac
done

# dhcpcd and the shared libraries it needs, from this (Debian 12) host.
dhcpcd_bin=$(find dhcpcd -type f -name dhcpcd -perm -u+x | head -n1)
[ -n "$dhcpcd_bin" ] || { echo "build.sh: no dhcpcd binary in dhcpcd-base" >&2; exit 1; }
cp "$dhcpcd_bin" "$root/sbin/dhcpcd"
for lib in $(ldd "$dhcpcd_bin" | awk '/=> \// { print $3 } /^\t\/lib/ { print $1 }'); do
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
done
# dhcpcd drops privileges to this user when it exists.
echo "root:x:0:0:root:/:/bin/sh" > "$root/etc/passwd"
echo "dhcpcd:x:100:65534::/var/lib/dhcpcd:/bin/false" >> "$root/etc/passwd"
echo "root:x:0:" > "$root/etc/group"
printf 'nohook resolv.conf\n' > "$root/etc/dhcpcd.conf"

install -m 0755 "$here/init" "$root/init"
# std only and statically linked (glibc's libc.a, from libc6-dev), so it
# needs nothing in the guest.
rustc --edition 2021 -O -C target-feature=+crt-static -C panic=abort -C strip=symbols \
    "$here/echo.rs" -o "$root/bin/tether-echo" >&2
install -m 0755 "$here/udhcpc.script" "$root/etc/udhcpc.script"
install -m 0755 "$here/dhcpcd.script" "$root/etc/dhcpcd.script"

# The agent overlay: qemu-ga and the shared libraries it needs, from
# this (Debian 12) host as for dhcpcd, and the virtio-serial driver its
# channel needs (init starts it when /sbin/qemu-ga is there).
over=$work/agent-root
mkdir -p "$over/sbin" "$over/lib/modules"
cp agent/usr/sbin/qemu-ga "$over/sbin/qemu-ga"
if ldd agent/usr/sbin/qemu-ga | grep -q 'not found'; then
    echo "build.sh: qemu-ga needs libraries this host lacks:" >&2
    ldd agent/usr/sbin/qemu-ga | grep 'not found' >&2
    exit 1
fi
for lib in $(ldd agent/usr/sbin/qemu-ga | awk '/=> \// { print $3 } /^\t\/lib/ { print $1 }'); do
    mkdir -p "$over$(dirname "$lib")"
    cp -L "$lib" "$over$lib"
done
ko=$(find kernel/lib/modules -name "virtio_console.ko*" | head -n1)
[ -n "$ko" ] || { echo "build.sh: module virtio_console not in $pkg" >&2; exit 1; }
case "$ko" in
*.xz) busybox unxz -c "$ko" > "$over/lib/modules/virtio_console.ko" ;;
*.ko) cp "$ko" "$over/lib/modules/virtio_console.ko" ;;
*) echo "build.sh: cannot unpack $ko" >&2; exit 1 ;;
esac

mkdir -p "$out.tmp"
cp kernel/boot/vmlinuz-* "$out.tmp/vmlinuz"
(cd "$root" && find . | busybox cpio -o -H newc 2>/dev/null) | gzip -9 > "$out.tmp/initramfs.gz"
(cd "$over" && find . | busybox cpio -o -H newc 2>/dev/null) | gzip -9 > "$out.tmp/agent.cpio.gz"
chmod 0644 "$out.tmp/vmlinuz" "$out.tmp/initramfs.gz" "$out.tmp/agent.cpio.gz"
chmod 0755 "$out.tmp"
rm -rf "$out"
mv "$out.tmp" "$out"
touch "$out/done"
echo "$out"
