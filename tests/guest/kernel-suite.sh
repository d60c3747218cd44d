#!/bin/sh
# Runs test binaries as root on Debian 12's stock cloud kernel (6.1, the
# package tests/guest/build.sh boots for the VM suites), in a QEMU guest
# (TCG) with no network device: whatever the tests do to the network, they
# do it to the guest's kernel.
#
#   kernel-suite.sh [-o LOG] NAME=BINARY[,FILTER...]...
#
# Each NAME=BINARY is a libtest binary (a crate's `cargo test --no-run`
# output), run in the guest as `BINARY --test-threads=N FILTER...`. The
# initramfs holds busybox, the binaries (debug info stripped), the tools
# they call (iproute2's ip, bridge and tc, util-linux's nsenter, nft,
# conntrack) with their shared libraries from this host, and the kernel
# modules of $MODULES with everything they depend on, from the kernel
# package itself.
#
# The guest's serial console goes to stderr (and to LOG with -o). On
# stdout, one line per suite:
#   KSUITE-SUMMARY <name> passed=<n> failed=<n> ignored=<n> rc=<rc> seconds=<s>
# then "KSUITE-RESULT ok" or "KSUITE-RESULT FAILED: <why>". The exit status
# is 0 only when the guest ran every suite to its end, every suite exited
# 0 with no test failed, and every module loaded.
#
# Environment: TETHER_GUEST_DIR (cache, default /var/tmp/tether-guest),
# TETHER_KSUITE_THREADS (--test-threads in the guest, default 1),
# TETHER_KSUITE_CPUS (guest vCPUs, default 2), TETHER_KSUITE_DEADLINE
# (seconds before a guest that has not powered off is stopped and the run
# fails, default 1200: a hung test, not a slow one). Run as root.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
base=${TETHER_GUEST_DIR:-/var/tmp/tether-guest}
threads=${TETHER_KSUITE_THREADS:-1}
cpus=${TETHER_KSUITE_CPUS:-2}
deadline=${TETHER_KSUITE_DEADLINE:-1200}

# What the suites make the kernel do, by module:
#   veth                        every pod's veth pair
#   vxlan                       the overlay (--overlay vxlan)
#   tun                         the KubeVirt tap binding's tap
#   dummy, bridge               what KubeVirt's bridge binding leaves in a
#                               pod (managedTap's dummy, k6t-eth0), which
#                               the tap tests build
#   sch_ingress, cls_u32,       the tap binding's redirect between the
#   act_mirred                  pod's eth0 and the tap
#   nf_tables, nft_chain_nat,   outbound NAT: masquerade in an inet table
#   nft_masq, nf_nat
#   nft_ct                      the handover table's ct expressions and
#                               notrack (a VM's flows through a migration)
#   nft_nat                     the dnat of the kube-proxy stand-in the
#                               handover tests write
#   nf_conntrack_netlink        conntrack entries read and written
#                               (the flows a VM takes to its target node)
#   nft_objref                  the NetworkPolicy table's named drop
#                               counters (its kernel test; tetherd does not
#                               apply the table yet)
MODULES="veth vxlan tun dummy bridge sch_ingress cls_u32 act_mirred \
nf_tables nft_chain_nat nft_masq nf_nat nft_ct nft_nat nf_conntrack_netlink nft_objref"

log=
if [ "${1:-}" = -o ]; then
    log=$2
    shift 2
fi
[ $# -gt 0 ] || { echo "usage: $0 [-o LOG] NAME=BINARY[,FILTER...]..." >&2; exit 2; }

# ---- The kernel package, unpacked once: vmlinuz, and its modules
# decompressed with a modules.dep made by busybox's depmod.
who=kernel-suite.sh
. "$here/kernel.sh"
kdir="$base/kernel-$pkg-$kver"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ ! -f "$kdir/done" ]; then
    (
        cd "$work"
        if ! apt-get download "$pkg" >&2; then
            apt-get update >&2
            apt-get download "$pkg" >&2
        fi
        dpkg-deb -x "$pkg"_*.deb unpacked
        # Debian 12's modules are plain .ko files under /lib; a later
        # package may compress them or move them to /usr/lib.
        moddir=$(ls -d unpacked/lib/modules unpacked/usr/lib/modules 2>/dev/null | head -n1)
        [ -n "$moddir" ] || { echo "kernel-suite.sh: no modules in $pkg" >&2; exit 1; }
        find "$moddir" -name '*.ko.xz' | while read -r ko; do
            busybox unxz "$ko"
        done
        rm -rf "$kdir.tmp"
        mkdir -p "$kdir.tmp/lib"
        mv "$moddir" "$kdir.tmp/lib/modules"
        rel=$(ls "$kdir.tmp/lib/modules")
        busybox depmod -b "$kdir.tmp" "$rel"
        cp unpacked/boot/vmlinuz-* "$kdir.tmp/vmlinuz"
        rm -rf "$kdir" unpacked
        mv "$kdir.tmp" "$kdir"
        touch "$kdir/done"
    )
fi
rel=$(ls "$kdir/lib/modules")
mods="$kdir/lib/modules/$rel"

# ---- The initramfs.
root=$work/root
mkdir -p "$root/bin" "$root/sbin" "$root/usr/bin" "$root/usr/sbin" "$root/etc/ksuite" \
    "$root/proc" "$root/sys" "$root/dev" "$root/run" "$root/tmp" "$root/suites" \
    "$root/lib/modules/$rel"
cp /bin/busybox "$root/bin/busybox"
ln -s busybox "$root/bin/sh"

# Copies a host binary and the shared libraries it loads to the same paths.
with_libs() {
    mkdir -p "$root$(dirname "$2")"
    cp -L "$1" "$root$2"
    for lib in $(ldd "$1" | awk '/=> \// { print $3 } /^\t\/lib/ { print $1 }'); do
        [ -e "$root$lib" ] && continue
        mkdir -p "$root$(dirname "$lib")"
        cp -L "$lib" "$root$lib"
    done
}
for tool in ip bridge tc nft conntrack; do
    path=$(command -v "$tool") || { echo "kernel-suite.sh: no $tool (tests/setup.sh installs it)" >&2; exit 1; }
    with_libs "$path" "/usr/sbin/$tool"
done
path=$(command -v nsenter) || { echo "kernel-suite.sh: no nsenter" >&2; exit 1; }
with_libs "$path" /usr/bin/nsenter
[ -d /etc/iproute2 ] && cp -a /etc/iproute2 "$root/etc/iproute2"
echo "root:x:0:0:root:/:/bin/sh" > "$root/etc/passwd"
echo "root:x:0:" > "$root/etc/group"
echo ksuite > "$root/etc/hostname"

names=
: > "$root/etc/ksuite/suites"
for spec in "$@"; do
    name=${spec%%=*}
    rest=${spec#*=}
    binary=${rest%%,*}
    filters=
    [ "$rest" != "$binary" ] && filters=$(echo "${rest#*,}" | tr ',' ' ')
    case "$name" in
    '' | *[!A-Za-z0-9_.-]*) echo "kernel-suite.sh: bad suite name in $spec" >&2; exit 2 ;;
    esac
    [ -x "$binary" ] || { echo "kernel-suite.sh: $binary is not an executable" >&2; exit 2; }
    with_libs "$binary" "/suites/$name"
    objcopy --strip-debug "$root/suites/$name"
    echo "$name /suites/$name $filters" >> "$root/etc/ksuite/suites"
    names="$names $name"
done

# The modules and, transitively, what they depend on (modules.dep lists a
# module's whole closure on its own line). One built into the kernel has
# nothing to load.
: > "$root/etc/ksuite/modules"
for m in $MODULES; do
    if grep -qE "(^|/)$m\.ko\$" "$mods/modules.builtin"; then
        echo "kernel-suite.sh: $m is built into $rel" >&2
        continue
    fi
    echo "$m" >> "$root/etc/ksuite/modules"
    line=$(grep -E "(^|/)$m\.ko:" "$mods/modules.dep") ||
        { echo "kernel-suite.sh: module $m not in $pkg" >&2; exit 1; }
    for ko in $(echo "$line" | tr -d ':'); do
        mkdir -p "$root/lib/modules/$rel/$(dirname "$ko")"
        cp "$mods/$ko" "$root/lib/modules/$rel/$ko"
    done
done
cp "$mods/modules.builtin" "$mods/modules.order" "$root/lib/modules/$rel/"
busybox depmod -b "$root" "$rel"
echo "$threads" > "$root/etc/ksuite/threads"
install -m 0755 "$here/suite-init" "$root/init"

# Uncompressed: nothing for the emulated guest to inflate at boot.
(cd "$root" && find . | busybox cpio -o -H newc 2>/dev/null) > "$work/initramfs.cpio"

# ---- The run. No network device (-nodefaults, -nic none); the console on
# stdout, carriage returns dropped.
console=$work/console.log
set +e
timeout --kill-after=10 "$deadline" qemu-system-x86_64 \
    -nodefaults -no-user-config -display none -nic none \
    -serial stdio -no-reboot -accel tcg -m 1024 -smp "$cpus" \
    -kernel "$kdir/vmlinuz" -initrd "$work/initramfs.cpio" \
    -append "console=ttyS0 quiet loglevel=1 panic=-1" < /dev/null |
    tr -d '\r' | tee "$console" >&2
set -e
[ -n "$log" ] && cp "$console" "$log"

# ---- The verdict.
why=
grep -q '^KSUITE-DONE' "$console" ||
    why="the guest did not finish (no KSUITE-DONE within ${deadline}s)"
grep -q "^KSUITE-KERNEL $rel\$" "$console" ||
    why="${why:+$why; }the guest did not report kernel $rel"
failed_mods=$(awk '/^KSUITE-MODULE / && $3 != "ok" { printf "%s ", $2 }' "$console")
[ -z "$failed_mods" ] || why="${why:+$why; }modules not loaded: $failed_mods"
for name in $names; do
    summary=$(awk -v name="$name" '
        $0 == "KSUITE-BEGIN " name { on = 1; next }
        on && /^test result: / {
            for (i = 1; i <= NF; i++) {
                if ($(i + 1) ~ /^passed/) passed += $i
                if ($(i + 1) ~ /^failed/) failed += $i
                if ($(i + 1) ~ /^ignored/) ignored += $i
            }
            results++
        }
        on && $1 == "KSUITE-END" && $2 == name {
            printf "passed=%d failed=%d ignored=%d %s %s results=%d", passed, failed, ignored, $3, $4, results
            found = 1
            exit
        }
        END { if (!found) print "missing" }' "$console")
    if [ "$summary" = missing ]; then
        echo "KSUITE-SUMMARY $name missing"
        why="${why:+$why; }suite $name did not end"
        continue
    fi
    echo "KSUITE-SUMMARY $name ${summary% results=*}"
    case "$summary" in
    *" rc=0 "*"results=0") why="${why:+$why; }suite $name printed no test result" ;;
    *" failed=0 "*" rc=0 "*) ;;
    *) why="${why:+$why; }suite $name failed: $(awk -v name="$name" '
            $0 == "KSUITE-BEGIN " name { on = 1; next }
            on && /^test .* \.\.\. FAILED$/ { printf "%s ", $2 }
            on && $1 == "KSUITE-END" { exit }' "$console")" ;;
    esac
done
if [ -n "$why" ]; then
    echo "KSUITE-RESULT FAILED: $why"
    exit 1
fi
echo "KSUITE-RESULT ok (kernel $rel)"
