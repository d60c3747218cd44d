//! The pending-DEL queue: where the shim leaves a DEL that tetherd could not
//! take, so that the DEL still succeeds for the runtime and the daemon
//! performs it when it is back.
//!
//! kubelet retries a failing DEL for ever and pod termination hangs meanwhile,
//! so a DEL must not fail just because the daemon is down. The daemon drains
//! this queue before it serves anything else. This module is the one place
//! the on-disk format is defined; the daemon mirrors it.
//!
//! # Format (version 1)
//!
//! - Directory: `<stateDir>/pending-del/`, created with mode 0700 (and its
//!   missing parents likewise) when absent. An existing directory's mode is
//!   left alone: it belongs to the daemon.
//! - One file per request, named `<unix_nanos>-<pid>.json`, mode 0600: the
//!   time the shim queued it, in nanoseconds since the Unix epoch, and the
//!   shim's process id. Sorting names by their numeric prefix gives queue
//!   order. The pid keeps two shims queueing in the same nanosecond apart.
//! - Content, one JSON object, keys in this order:
//!   `{"version":1,"queuedAtUnixNanos":<u128 as a JSON number>,"command":"DEL",
//!   "containerId":"...","netns":"...","ifname":"...","args":"...",
//!   "path":"...","stdin":"<the network configuration as a UTF-8 string>",
//!   "present":["CNI_COMMAND",...]}`. The string fields are the `CniRequest`
//!   fields of the same meaning; `present` lists the CNI_* variables that were
//!   set at all.
//! - Crash safety: the shim writes `.<name>.tmp` in the same directory
//!   (created exclusively, never through an existing file or symlink), fsyncs
//!   it, renames it to `<name>`, then fsyncs the directory. A reader must
//!   therefore ignore names starting with `.`: those are unfinished writes or
//!   leftovers of a crash, never a request.

use serde::{Deserialize, Serialize};
use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};
use tether_proto::cni::v1::CniRequest;

/// The queue's directory name under the daemon's state dir.
pub const QUEUE_DIR: &str = "pending-del";

/// The format version written in every entry's `version` field.
pub const FORMAT_VERSION: u32 = 1;

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
    pub netns: String,
    /// CNI_IFNAME.
    pub ifname: String,
    /// CNI_ARGS, unparsed.
    pub args: String,
    /// CNI_PATH, unparsed.
    pub path: String,
    /// The network configuration as read from stdin.
    pub stdin: String,
    /// The CNI_* variables that were set at all, so that the daemon can tell
    /// "unset" from "empty" as it would for a live request.
    pub present: Vec<String>,
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
        }
    }

    /// The file name of this entry when queued by process `pid`.
    pub fn file_name(&self, pid: u32) -> String {
        format!("{}-{}.json", self.queued_at_unix_nanos, pid)
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

/// The queue directory under `state_dir`.
pub fn queue_dir(state_dir: &Path) -> PathBuf {
    state_dir.join(QUEUE_DIR)
}

/// Writes `entry` into the queue under `state_dir`, crash-safely, and returns
/// the path of the new file.
pub fn enqueue(state_dir: &Path, entry: &PendingDel, pid: u32) -> io::Result<PathBuf> {
    let dir = queue_dir(state_dir);
    DirBuilder::new().recursive(true).mode(0o700).create(&dir)?;

    let name = entry.file_name(pid);
    let tmp = dir.join(format!(".{name}.tmp"));
    let target = dir.join(&name);
    let body = serde_json::to_vec(entry).map_err(io::Error::other)?;

    if let Err(e) = write_synced(&tmp, &body) {
        // A half-written temporary is useless to the daemon; do not leave it.
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    if let Err(e) = fs::rename(&tmp, &target) {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    // The rename is durable only once the directory itself is synced.
    File::open(&dir)?.sync_all()?;
    Ok(target)
}

/// Creates `path` exclusively with mode 0600, writes `body` and fsyncs it.
fn write_synced(path: &Path, body: &[u8]) -> io::Result<()> {
    // create_new: O_EXCL also refuses to follow a planted symlink.
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(body)?;
    file.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn request() -> CniRequest {
        CniRequest {
            command: "DEL".into(),
            container_id: "ctr-1".into(),
            netns: String::new(),
            ifname: "eth0".into(),
            args: "K8S_POD_NAME=web;IgnoreUnknown=1".into(),
            path: "/opt/cni/bin".into(),
            stdin: br#"{"cniVersion":"1.0.0","name":"tether","type":"tether"}"#.to_vec(),
            present: vec![
                "CNI_COMMAND".into(),
                "CNI_CONTAINERID".into(),
                "CNI_IFNAME".into(),
                "CNI_ARGS".into(),
                "CNI_PATH".into(),
            ],
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
                r#""present":["CNI_COMMAND","CNI_CONTAINERID","CNI_IFNAME","CNI_ARGS","CNI_PATH"]}"#
            )
        );
        assert_eq!(
            entry.file_name(42),
            "340282366920938463463374607431-42.json"
        );
    }

    #[test]
    fn enqueue_writes_a_private_file_that_reads_back() {
        let state = tempfile::tempdir().unwrap();
        // The state dir itself may not exist yet: the daemon may never have run.
        let state_dir = state.path().join("var/lib/tether");
        let stdin = std::str::from_utf8(&request().stdin).unwrap().to_owned();
        let entry = PendingDel::new(&request(), &stdin, 1_700_000_000_123_456_789);

        let path = enqueue(&state_dir, &entry, 4242).unwrap();

        assert_eq!(
            path,
            state_dir.join("pending-del/1700000000123456789-4242.json")
        );
        let back: PendingDel = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        assert_eq!(back, entry);
        assert_eq!(back.stdin.as_bytes(), request().stdin.as_slice());

        let file_mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(file_mode, 0o600);
        let dir_mode = fs::metadata(queue_dir(&state_dir))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(dir_mode, 0o700);

        // Atomic write: only the final file is left, no temporary.
        let names: Vec<String> = fs::read_dir(queue_dir(&state_dir))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, vec!["1700000000123456789-4242.json".to_owned()]);
    }

    #[test]
    fn enqueue_refuses_to_write_through_a_planted_temporary() {
        let state = tempfile::tempdir().unwrap();
        let entry = PendingDel::new(&request(), "{}", 7);
        let dir = queue_dir(state.path());
        fs::create_dir_all(&dir).unwrap();
        let victim = state.path().join("victim");
        fs::write(&victim, "untouched").unwrap();
        std::os::unix::fs::symlink(&victim, dir.join(".7-1.json.tmp")).unwrap();

        let err = enqueue(state.path(), &entry, 1).unwrap_err();

        assert_eq!(err.kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(fs::read_to_string(&victim).unwrap(), "untouched");
        assert!(!dir.join("7-1.json").exists());
    }

    #[test]
    fn enqueue_reports_an_unwritable_state_dir() {
        let state = tempfile::tempdir().unwrap();
        // A regular file where the state dir should be: no queue can exist.
        let not_a_dir = state.path().join("file");
        fs::write(&not_a_dir, "").unwrap();
        let entry = PendingDel::new(&request(), "{}", 7);
        assert!(enqueue(&not_a_dir, &entry, 1).is_err());
    }
}
