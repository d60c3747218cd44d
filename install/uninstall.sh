#!/bin/sh
# tether's uninstaller, run by the DaemonSet pod's "uninstall" container.
#
# When tether's DaemonSet is removed, it takes tether's conflist, then its
# plugin binary, off the node, then tether's nft tables (outbound NAT, and
# a migrating VM's connections) out of the node's network namespace: the
# runtime then has no CNI config, and the kubelet reports the node NotReady
# ("cni plugin not initialized") instead of the node failing every new pod
# with "failed to find plugin tether".
# portmap, which the installer also copies, stays: other networks may use it.
#
# A pod of the DaemonSet stops for other reasons too: a rolling upgrade, a
# `kubectl delete pod`, a node's shutdown. Removing the files then would
# take the node's network away for the restart (and a NotReady node gets
# all its pods marked NotReady by the node lifecycle controller). So it
# asks the API for the DaemonSet first, with the pod's service-account
# token, and removes only when the answer says the install is going away:
#   404           the DaemonSet is gone (helm uninstall, kubectl delete);
#   200 with a deletionTimestamp: it is being deleted (foreground);
#   401           the service account is gone (kubectl delete -f deletes it
#                 before the DaemonSet);
#   403           the Role that allows the read is gone (helm uninstall
#                 deletes it right after the DaemonSet).
# Anything else (the DaemonSet there; no answer, 5xx) leaves everything:
# when in doubt, a node keeps its network. Then, by hand:
#   rm /etc/cni/net.d/10-tether.conflist /opt/cni/bin/tether
#   nft delete table inet tether; nft delete table inet tether_vm
#
# Usage: uninstall.sh --on-sigterm   wait for SIGTERM (the pod's end), then act
#        uninstall.sh                act now
#
# Environment (defaults in brackets):
#   TETHER_DAEMONSET  the DaemonSet's name                  (required)
#   TETHER_NAMESPACE  its namespace                         (required)
#   KUBERNETES_SERVICE_HOST, KUBERNETES_SERVICE_PORT        the API server
#   SA_DIR        the service account's token and ca.crt
#                 [/var/run/secrets/kubernetes.io/serviceaccount]
#   CNI_BIN_DIR   host CNI bin dir, mounted                 [/host/opt/cni/bin]
#   CNI_CONF_DIR  host CNI config dir, mounted              [/host/etc/cni/net.d]
#   CONFLIST_NAME name of the installed conflist            [10-tether.conflist]
set -u

CNI_BIN_DIR=${CNI_BIN_DIR:-/host/opt/cni/bin}
CNI_CONF_DIR=${CNI_CONF_DIR:-/host/etc/cni/net.d}
CONFLIST_NAME=${CONFLIST_NAME:-10-tether.conflist}
SA_DIR=${SA_DIR:-/var/run/secrets/kubernetes.io/serviceaccount}

log() { echo "tether-uninstall: $*"; }

# The HTTP status of GET on the DaemonSet ("000": no answer); its body in $body.
daemonset_status() {
    host=${KUBERNETES_SERVICE_HOST:-}
    port=${KUBERNETES_SERVICE_PORT:-443}
    case "$host" in
    *:*) host="[$host]" ;;
    esac
    url="https://$host:$port/apis/apps/v1/namespaces/$TETHER_NAMESPACE/daemonsets/$TETHER_DAEMONSET"
    token=$(cat "$SA_DIR/token")
    curl -sS -o "$body" -w '%{http_code}' --max-time 5 \
        --cacert "$SA_DIR/ca.crt" -H "Authorization: Bearer $token" "$url" 2>"$body.err" || true
}

remove() {
    log "removing tether from this node: $1"
    # The conflist first: from then on the runtime chooses no tether.
    for f in "$CNI_CONF_DIR/$CONFLIST_NAME" "$CNI_BIN_DIR/tether"; do
        if [ -e "$f" ]; then
            rm -f "$f" && log "removed $f"
        fi
    done
    # inet tether: outbound NAT; inet tether_vm: a migrating VM's
    # connections (docs/user/vm-connections.md).
    for table in tether tether_vm; do
        if command -v nft >/dev/null 2>&1 && nft list table inet "$table" >/dev/null 2>&1; then
            nft delete table inet "$table" && log "removed nft table inet $table"
        fi
    done
}

run() {
    if [ -z "${TETHER_DAEMONSET:-}" ] || [ -z "${TETHER_NAMESPACE:-}" ]; then
        log "TETHER_DAEMONSET and TETHER_NAMESPACE must be set; leaving everything"
        return 1
    fi
    if [ ! -s "$SA_DIR/token" ]; then
        # Without a token, a 401 would say nothing about the install.
        log "no service-account token in $SA_DIR: leaving everything"
        return 1
    fi
    body=$(mktemp)
    code=000
    for try in 1 2 3; do
        code=$(daemonset_status)
        case "$code" in
        000 | 5*) [ "$try" -lt 3 ] && sleep 1 ;;
        *) break ;;
        esac
    done
    ds="daemonset $TETHER_NAMESPACE/$TETHER_DAEMONSET"
    case "$code" in
    200)
        if grep -q '"deletionTimestamp"' "$body"; then
            remove "$ds is being deleted"
        else
            log "$ds is still there (a restart or an upgrade): leaving the conflist and the plugin"
        fi
        ;;
    404) remove "$ds is gone" ;;
    401) remove "the API no longer knows this pod's service account" ;;
    403) remove "this pod's service account may no longer read $ds (its Role is gone)" ;;
    *)
        log "could not tell whether $ds is gone (HTTP $code: $(cat "$body.err" "$body" 2>/dev/null | head -c 300)): leaving everything"
        ;;
    esac
    rm -f "$body" "$body.err"
    return 0
}

case "${1:-}" in
--on-sigterm)
    trap 'run; exit 0' TERM INT
    log "waiting for the pod's end"
    # A shell runs a trap only between commands: wait, not sleep, is
    # interrupted by the signal.
    while :; do
        sleep 2147483647 &
        wait $!
    done
    ;;
"") run ;;
*)
    echo "usage: uninstall.sh [--on-sigterm]" >&2
    exit 2
    ;;
esac
