//! The shim's pending-DEL queue, read by the daemon.
//!
//! When the shim cannot reach the daemon on DEL it must not fail (the kubelet
//! would retry forever and pod termination would hang), so it persists the
//! request as one JSON file in `<state-dir>/pending-del/` and succeeds. The
//! daemon replays the queue before it serves anything, and then
//! periodically. The format is defined by the shim (`cni-shim/src/queue.rs`)
//! and mirrored here:
//!
//! ```json
//! {"version":1,"queuedAtUnixNanos":1700000000000000000,"command":"DEL",
//!  "containerId":"...","netns":"...","ifname":"...","args":"...","path":"...",
//!  "stdin":"<the netconf>","present":["CNI_COMMAND","CNI_CONTAINERID",...]}
//! ```

use serde::Deserialize;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use tether_proto::cni::v1::CniRequest;

/// The queue's directory under the state dir.
pub fn queue_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("pending-del")
}

/// One queued DEL, as the shim wrote it.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct QueuedDel {
    /// Format version; only 1 exists.
    pub version: u32,
    /// When the shim queued it.
    pub queued_at_unix_nanos: u128,
    /// Always "DEL".
    pub command: String,
    /// CNI_CONTAINERID.
    pub container_id: String,
    /// CNI_NETNS.
    #[serde(default)]
    pub netns: String,
    /// CNI_IFNAME.
    pub ifname: String,
    /// CNI_ARGS.
    #[serde(default)]
    pub args: String,
    /// CNI_PATH.
    #[serde(default)]
    pub path: String,
    /// The netconf the runtime sent.
    pub stdin: String,
    /// Which CNI_* variables were set.
    #[serde(default)]
    pub present: Vec<String>,
}

impl QueuedDel {
    /// The request as the shim would have sent it.
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
        }
    }
}

/// An entry that could not be read; it is moved aside for an operator.
#[derive(Debug)]
pub struct BadEntry {
    /// The file.
    pub path: PathBuf,
    /// Why.
    pub reason: String,
}

/// The queue's entries, oldest first (file names start with the time they
/// were queued), plus those that could not be read or were written by a
/// uid that may not use the daemon. The queue is a second way into the
/// daemon, so it gets the socket's authorisation: an entry counts only if
/// its file is owned by root or by one of `allowed_uids`.
pub fn read_queue(
    state_dir: &Path,
    allowed_uids: &[u32],
) -> (Vec<(PathBuf, QueuedDel)>, Vec<BadEntry>) {
    let dir = queue_dir(state_dir);
    let mut good = Vec::new();
    let mut bad = Vec::new();
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return (good, bad);
    };
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension().is_some_and(|x| x == "json")
                && !p
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        })
        .collect();
    paths.sort();
    for path in paths {
        let parsed = std::fs::symlink_metadata(&path)
            .map_err(|e| e.to_string())
            .and_then(|m| {
                let uid = m.uid();
                if !m.file_type().is_file() {
                    Err("not a regular file".to_string())
                } else if uid != 0 && !allowed_uids.contains(&uid) {
                    Err(format!("written by uid {uid}, which may not use tetherd"))
                } else {
                    Ok(())
                }
            })
            .and_then(|()| std::fs::read(&path).map_err(|e| e.to_string()))
            .and_then(|b| serde_json::from_slice::<QueuedDel>(&b).map_err(|e| e.to_string()))
            .and_then(|q| {
                if q.version == 1 && q.command == "DEL" {
                    Ok(q)
                } else {
                    Err(format!(
                        "unsupported entry: version {} command {}",
                        q.version, q.command
                    ))
                }
            });
        match parsed {
            Ok(q) => good.push((path, q)),
            Err(reason) => bad.push(BadEntry { path, reason }),
        }
    }
    (good, bad)
}

/// Number of entries waiting, for Stats.
pub fn queue_len(state_dir: &Path) -> u64 {
    std::fs::read_dir(queue_dir(state_dir))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| {
                    let n = e.file_name();
                    let n = n.to_string_lossy();
                    n.ends_with(".json") && !n.starts_with('.')
                })
                .count() as u64
        })
        .unwrap_or(0)
}

/// Moves an unreadable entry into `pending-del/bad/`, keeping it for an
/// operator instead of replaying garbage or deleting evidence.
pub fn quarantine(entry: &BadEntry) -> std::io::Result<()> {
    let Some(parent) = entry.path.parent() else {
        return Ok(());
    };
    let bad_dir = parent.join("bad");
    std::fs::create_dir_all(&bad_dir)?;
    let name = entry.path.file_name().unwrap_or_default();
    std::fs::rename(&entry.path, bad_dir.join(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_entries_in_order_and_sets_bad_ones_aside() {
        let dir = tempfile::tempdir().unwrap();
        let q = queue_dir(dir.path());
        std::fs::create_dir_all(&q).unwrap();
        let entry = |t: u128, cid: &str| {
            format!(
                r#"{{"version":1,"queuedAtUnixNanos":{t},"command":"DEL","containerId":"{cid}","netns":"","ifname":"eth0","args":"","path":"","stdin":"{{}}","present":["CNI_COMMAND"]}}"#
            )
        };
        std::fs::write(q.join("200-1.json"), entry(200, "b")).unwrap();
        std::fs::write(q.join("100-1.json"), entry(100, "a")).unwrap();
        std::fs::write(q.join("150-1.json"), "not json").unwrap();
        std::fs::write(q.join(".300-1.json.tmp"), entry(300, "c")).unwrap();
        assert_eq!(queue_len(dir.path()), 3);
        let (good, bad) = read_queue(dir.path(), &[]);
        let ids: Vec<_> = good.iter().map(|(_, q)| q.container_id.as_str()).collect();
        assert_eq!(ids, ["a", "b"]);
        assert_eq!(good[0].1.queued_at_unix_nanos, 100);
        assert_eq!(good[0].1.to_request().stdin, b"{}");
        assert_eq!(bad.len(), 1);
        quarantine(&bad[0]).unwrap();
        assert!(q.join("bad/150-1.json").exists());
        assert_eq!(queue_len(dir.path()), 2);
    }

    #[test]
    fn missing_queue_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        let (good, bad) = read_queue(dir.path(), &[]);
        assert!(good.is_empty() && bad.is_empty());
        assert_eq!(queue_len(dir.path()), 0);
    }

    #[test]
    fn entries_of_a_uid_that_may_not_use_the_daemon_are_set_aside() {
        let dir = tempfile::tempdir().unwrap();
        let q = queue_dir(dir.path());
        std::fs::create_dir_all(&q).unwrap();
        let body = r#"{"version":1,"queuedAtUnixNanos":1,"command":"DEL","containerId":"a","ifname":"eth0","stdin":"{}"}"#;
        let path = q.join("100-1.json");
        std::fs::write(&path, body).unwrap();
        std::os::unix::fs::chown(&path, Some(65534), Some(65534)).unwrap();
        let (good, bad) = read_queue(dir.path(), &[]);
        assert!(good.is_empty());
        assert_eq!(bad.len(), 1);
        assert!(bad[0].reason.contains("uid 65534"), "{}", bad[0].reason);
        // The same entry counts when that uid is allowed on the socket.
        let (good, bad) = read_queue(dir.path(), &[65534]);
        assert_eq!((good.len(), bad.len()), (1, 0));
    }
}
