#!/bin/sh
# tether's installer, run by the DaemonSet's init container.
#
# Copies the plugin binary into the host's CNI bin dir and the conflist into
# the host's CNI config dir. Each file is written under a temporary name in
# the destination directory and renamed into place, so a runtime never sees
# a half-written binary or config.
#
# Environment (defaults in brackets):
#   SRC_DIR       where the image holds the files   [/tether]
#   CNI_BIN_DIR   host CNI bin dir, mounted          [/host/opt/cni/bin]
#   CNI_CONF_DIR  host CNI config dir, mounted       [/host/etc/cni/net.d]
#   CONFLIST_NAME name of the installed conflist     [10-tether.conflist]
#   TETHER_CONFLIST the whole conflist to install, as JSON, instead of the
#                 image's $SRC_DIR/$CONFLIST_NAME: what the Helm chart
#                 renders from its `netconf` values (with its socket in
#                 it). It must be a JSON object with a plugin of type
#                 tether; tetherd checks every field at each CNI call.
#   TETHER_SOCKET the daemon's socket as the host sees it, written into the
#                 image's conflist's "socket"        [the conflist's own]
#                 Set it when the DaemonSet moves the socket's hostPath away
#                 from /run/tether; the daemon's --socket must then be the
#                 same path (mount the directory at the same path inside).
#                 Not with TETHER_CONFLIST, which names its socket itself.
set -eu

SRC_DIR=${SRC_DIR:-/tether}
CNI_BIN_DIR=${CNI_BIN_DIR:-/host/opt/cni/bin}
CNI_CONF_DIR=${CNI_CONF_DIR:-/host/etc/cni/net.d}
CONFLIST_NAME=${CONFLIST_NAME:-10-tether.conflist}

atomic_copy() { # atomic_copy SRC DEST_DIR NAME MODE
  tmp="$2/.$3.tmp.$$"
  cp "$1" "$tmp"
  chmod "$4" "$tmp"
  sync "$tmp" 2>/dev/null || sync
  mv -f "$tmp" "$2/$3"
}

# Everything that can fail on bad input is checked before anything is installed.
conflist="$SRC_DIR/$CONFLIST_NAME"
if [ -n "${TETHER_CONFLIST:-}" ]; then
  if [ -n "${TETHER_SOCKET:-}" ]; then
    echo "TETHER_CONFLIST and TETHER_SOCKET are both set: TETHER_CONFLIST names its socket itself" >&2; exit 1
  fi
  # No JSON parser in the image: check its shape as far as sh can, and
  # leave the fields to tetherd (which names a bad one at the first ADD).
  case "$TETHER_CONFLIST" in
  "{"*"}") ;;
  *) echo "TETHER_CONFLIST is not a JSON object: $TETHER_CONFLIST" >&2; exit 1 ;;
  esac
  case "$TETHER_CONFLIST" in
  *'"plugins":'*'"type":"tether"'* | *'"plugins": '*'"type": "tether"'*) ;;
  *) echo "TETHER_CONFLIST has no plugin of type tether: $TETHER_CONFLIST" >&2; exit 1 ;;
  esac
  conflist=$(mktemp)
  trap 'rm -f "$conflist"' EXIT
  printf '%s\n' "$TETHER_CONFLIST" > "$conflist"
elif [ -n "${TETHER_SOCKET:-}" ]; then
  case "$TETHER_SOCKET" in
  /*) ;;
  *) echo "TETHER_SOCKET must be an absolute path: $TETHER_SOCKET" >&2; exit 1 ;;
  esac
  case "$TETHER_SOCKET" in
  *[\"\\#]*) echo "TETHER_SOCKET may not hold '\"', '\\' or '#': $TETHER_SOCKET" >&2; exit 1 ;;
  esac
  conflist=$(mktemp)
  trap 'rm -f "$conflist"' EXIT
  sed 's#"socket": *"[^"]*"#"socket": "'"$TETHER_SOCKET"'"#' "$SRC_DIR/$CONFLIST_NAME" > "$conflist"
  grep -q "\"socket\": \"$TETHER_SOCKET\"" "$conflist" || {
    echo "no \"socket\" in $SRC_DIR/$CONFLIST_NAME to set to $TETHER_SOCKET" >&2; exit 1; }
fi

mkdir -p "$CNI_BIN_DIR" "$CNI_CONF_DIR"
for plugin in tether portmap; do
  if [ -f "$SRC_DIR/$plugin" ]; then
    atomic_copy "$SRC_DIR/$plugin" "$CNI_BIN_DIR" "$plugin" 0755
    echo "installed $CNI_BIN_DIR/$plugin"
  fi
done
atomic_copy "$conflist" "$CNI_CONF_DIR" "$CONFLIST_NAME" 0644
echo "installed $CNI_CONF_DIR/$CONFLIST_NAME"
