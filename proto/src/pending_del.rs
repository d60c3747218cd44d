//! The pending-DEL queue's on-disk format, shared by its writer (the shim)
//! and its reader (the daemon).
//!
//! kubelet retries a failing DEL for ever and pod termination hangs
//! meanwhile, so the shim must not fail a DEL just because tetherd is down:
//! it leaves the request in this queue and succeeds, and the daemon performs
//! it when it is back, before it serves anything else.
//!
//! # Where the queue is
//!
//! The queue belongs to the daemon's state dir, `<state-dir>/pending-del/`,
//! and the daemon's `--state-dir` is the one knob for it. The shim does not
//! know the state dir; it knows the socket, so it writes through
//! [`queue_link`]: the path `<socket>.pending-del`, beside the socket. At
//! start-up, before it serves, the daemon makes that path a symlink to its
//! own queue directory, after taking in whatever an earlier link target or a
//! plain directory there still held. So:
//!
//! - a state dir that changed between two runs of the daemon loses nothing:
//!   the old link still names the old queue, and the new daemon adopts it;
//! - before the daemon first ran since boot (the socket's directory is
//!   usually a tmpfs), the shim creates `<socket>.pending-del` as a plain
//!   directory, and the daemon adopts its entries when it starts.
//!
//! # Format (version 1)
//!
//! - One file per request, named `<unix_nanos>-<pid>.json`, mode 0600: the
//!   time the shim queued it, in nanoseconds since the Unix epoch, and the
//!   shim's process id. Sorting names by their numeric prefix gives queue
//!   order. The pid keeps two shims queueing in the same nanosecond apart.
//! - Content, one JSON object, keys in this order:
//!   `{"version":1,"queuedAtUnixNanos":<u128 as a JSON number>,"command":"DEL",
//!   "containerId":"...","netns":"...","ifname":"...","args":"...",
//!   "path":"...","stdin":"<the network configuration as a UTF-8 string>",
//!   "present":["CNI_COMMAND",...],"pluginName":"tether"}`. The string
//!   fields are the `CniRequest` fields of the same meaning; `present` lists
//!   the CNI_* variables that were set at all; `pluginName`, the name the
//!   shim ran as, is left out when empty, and an entry without it (an older
//!   shim's) is read as "tether".
//! - Crash safety: the writer writes `.<name>.tmp` in the same directory
//!   (created exclusively, never through an existing file or symlink),
//!   fsyncs it, renames it to `<name>`, then fsyncs the directory. A reader
//!   therefore ignores names starting with `.` ([`is_entry_name`]): those are
//!   unfinished writes or leftovers of a crash, never a request.

use crate::cni::v1::CniRequest;
use serde::{Deserialize, Serialize};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// The queue's directory name under the daemon's state dir.
pub const QUEUE_DIR: &str = "pending-del";

/// What [`queue_link`] appends to the socket's file name.
pub const LINK_SUFFIX: &str = ".pending-del";

/// The format version written in every entry's `version` field.
pub const FORMAT_VERSION: u32 = 1;

/// The queue directory under `state_dir`: where the daemon reads.
pub fn queue_dir(state_dir: &Path) -> PathBuf {
    state_dir.join(QUEUE_DIR)
}

/// The path beside `socket` through which the shim writes: the daemon's
/// symlink to its queue, or a plain directory it adopts at start-up.
pub fn queue_link(socket: &Path) -> PathBuf {
    let mut name: OsString = socket
        .file_name()
        .map(ToOwned::to_owned)
        .unwrap_or_else(|| "tether.sock".into());
    name.push(LINK_SUFFIX);
    socket.with_file_name(name)
}

/// Whether a directory entry named `name` is a queued request, rather than
/// an unfinished write, a leftover of a crash, or the daemon's `bad/`.
pub fn is_entry_name(name: &str) -> bool {
    name.ends_with(".json") && !name.starts_with('.')
}

/// One queued DEL request, exactly as stored in its file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PendingDel {
    /// Format version, [`FORMAT_VERSION`].
    pub version: u32,
    /// When the shim queued the request, in nanoseconds since the Unix epoch.
    pub queued_at_unix_nanos: u128,
    /// CNI_COMMAND; always "DEL".
    pub command: String,
    /// CNI_CONTAINERID.
    pub container_id: String,
    /// CNI_NETNS; may be empty.
    #[serde(default)]
    pub netns: String,
    /// CNI_IFNAME.
    pub ifname: String,
    /// CNI_ARGS, unparsed.
    #[serde(default)]
    pub args: String,
    /// CNI_PATH, unparsed.
    #[serde(default)]
    pub path: String,
    /// The network configuration as read from stdin.
    pub stdin: String,
    /// The CNI_* variables that were set at all, so that the daemon can tell
    /// "unset" from "empty" as it would for a live request.
    #[serde(default)]
    pub present: Vec<String>,
    /// The name the shim ran as; absent in entries of older shims, which
    /// the daemon reads as "tether".
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub plugin_name: String,
}

impl PendingDel {
    /// The entry for `request`, queued at `queued_at_unix_nanos`.
    ///
    /// `stdin` is passed as text: the shim has already checked that the
    /// configuration is a JSON object, hence UTF-8.
    pub fn new(request: &CniRequest, stdin: &str, queued_at_unix_nanos: u128) -> Self {
        PendingDel {
            version: FORMAT_VERSION,
            queued_at_unix_nanos,
            command: request.command.clone(),
            container_id: request.container_id.clone(),
            netns: request.netns.clone(),
            ifname: request.ifname.clone(),
            args: request.args.clone(),
            path: request.path.clone(),
            stdin: stdin.to_owned(),
            present: request.present.clone(),
            plugin_name: request.plugin_name.clone(),
        }
    }

    /// The file name of this entry when queued by process `pid`.
    pub fn file_name(&self, pid: u32) -> String {
        format!("{}-{}.json", self.queued_at_unix_nanos, pid)
    }

    /// The request as the shim would have sent it live.
    pub fn to_request(&self) -> CniRequest {
        CniRequest {
            command: self.command.clone(),
            container_id: self.container_id.clone(),
            netns: self.netns.clone(),
            ifname: self.ifname.clone(),
            args: self.args.clone(),
            path: self.path.clone(),
            stdin: self.stdin.clone().into_bytes(),
            present: self.present.clone(),
            plugin_name: self.plugin_name.clone(),
        }
    }
}

/// Nanoseconds since the Unix epoch; 0 if the clock is before it, which only
/// costs queue order, never the request.
pub fn unix_nanos_now() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> CniRequest {
        CniRequest {
            command: "DEL".into(),
            container_id: "ctr-1".into(),
            netns: String::new(),
            ifname: "eth0".into(),
            args: "K8S_POD_NAME=web;IgnoreUnknown=1".into(),
            path: "/opt/cni/bin".into(),
            stdin: br#"{"cniVersion":"1.0.0","name":"tether","type":"tether"}"#.to_vec(),
            present: vec!["CNI_COMMAND".into(), "CNI_CONTAINERID".into()],
            plugin_name: String::new(),
        }
    }

    #[test]
    fn serialises_in_the_documented_shape() {
        let stdin = r#"{"cniVersion":"1.0.0","name":"n\"q"}"#;
        let entry = PendingDel::new(&request(), stdin, 340_282_366_920_938_463_463_374_607_431);
        let json = serde_json::to_string(&entry).unwrap();
        assert_eq!(
            json,
            concat!(
                r#"{"version":1,"queuedAtUnixNanos":340282366920938463463374607431,"#,
                r#""command":"DEL","containerId":"ctr-1","netns":"","ifname":"eth0","#,
                r#""args":"K8S_POD_NAME=web;IgnoreUnknown=1","path":"/opt/cni/bin","#,
                r#""stdin":"{\"cniVersion\":\"1.0.0\",\"name\":\"n\\\"q\"}","#,
                r#""present":["CNI_COMMAND","CNI_CONTAINERID"]}"#
            )
        );
        assert_eq!(
            entry.file_name(42),
            "340282366920938463463374607431-42.json"
        );
        let back: PendingDel = serde_json::from_str(&json).unwrap();
        assert_eq!(back, entry);
        assert_eq!(back.to_request().stdin, stdin.as_bytes());
    }

    #[test]
    fn optional_fields_may_be_absent() {
        let body = r#"{"version":1,"queuedAtUnixNanos":1,"command":"DEL","containerId":"a","ifname":"eth0","stdin":"{}"}"#;
        let entry: PendingDel = serde_json::from_str(body).unwrap();
        assert_eq!(entry.netns, "");
        assert!(entry.present.is_empty());
    }

    #[test]
    fn the_link_sits_beside_the_socket() {
        assert_eq!(
            queue_link(Path::new("/run/tether/tether.sock")),
            Path::new("/run/tether/tether.sock.pending-del")
        );
        assert_eq!(
            queue_dir(Path::new("/var/lib/tether")),
            Path::new("/var/lib/tether/pending-del")
        );
    }

    #[test]
    fn only_finished_json_files_are_entries() {
        assert!(is_entry_name("100-1.json"));
        assert!(!is_entry_name(".100-1.json.tmp"));
        assert!(!is_entry_name(".100-1.json"));
        assert!(!is_entry_name("bad"));
    }
}
