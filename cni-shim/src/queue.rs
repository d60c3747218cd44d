//! Writing to the pending-DEL queue: where the shim leaves a DEL that
//! tetherd could not take, so that the DEL still succeeds for the runtime and
//! the daemon performs it when it is back.
//!
//! The format, and where the queue is, are defined once, in
//! [`tether_proto::pending_del`]: the shim writes through the path beside
//! the daemon's socket, which the daemon points at its state dir.

use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
pub use tether_proto::pending_del::{queue_link, unix_nanos_now, PendingDel};

/// Writes `entry` into the queue directory `dir` (the daemon's symlink, or a
/// directory made here, mode 0700, when the daemon has not run yet),
/// crash-safely, and returns the path of the new file.
///
/// Missing parents (the socket's directory) are made with the default mode,
/// as the daemon makes them: uids allowed on the socket must be able to
/// reach it, and the socket itself is 0600.
pub fn enqueue(dir: &Path, entry: &PendingDel, pid: u32) -> io::Result<PathBuf> {
    if let Some(parent) = dir.parent() {
        fs::create_dir_all(parent)?;
    }
    match DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        // The daemon's link, or a directory an earlier shim made.
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists && dir.is_dir() => {}
        Err(e) => return Err(e),
    }

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
    File::open(dir)?.sync_all()?;
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
    use tether_proto::cni::v1::CniRequest;

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
    fn enqueue_writes_a_private_file_that_reads_back() {
        let run = tempfile::tempdir().unwrap();
        // The daemon may never have run: neither the socket's directory nor
        // the queue beside it exists yet.
        let dir = queue_link(&run.path().join("run/tether/tether.sock"));
        let stdin = std::str::from_utf8(&request().stdin).unwrap().to_owned();
        let entry = PendingDel::new(&request(), &stdin, 1_700_000_000_123_456_789);

        let path = enqueue(&dir, &entry, 4242).unwrap();

        assert_eq!(
            path,
            run.path()
                .join("run/tether/tether.sock.pending-del/1700000000123456789-4242.json")
        );
        let back: PendingDel = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        assert_eq!(back, entry);
        assert_eq!(back.stdin.as_bytes(), request().stdin.as_slice());

        let file_mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(file_mode, 0o600);
        let mode = |d: &Path| fs::metadata(d).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        // The socket's directory must stay reachable for allowed uids.
        assert_eq!(mode(&run.path().join("run/tether")) & 0o011, 0o011);

        // Atomic write: only the final file is left, no temporary.
        let names: Vec<String> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, vec!["1700000000123456789-4242.json".to_owned()]);
    }

    #[test]
    fn enqueue_writes_through_the_daemons_link() {
        let root = tempfile::tempdir().unwrap();
        let state_queue = root.path().join("state/pending-del");
        fs::create_dir_all(&state_queue).unwrap();
        let link = queue_link(&root.path().join("tether.sock"));
        std::os::unix::fs::symlink(&state_queue, &link).unwrap();
        let entry = PendingDel::new(&request(), "{}", 9);

        enqueue(&link, &entry, 1).unwrap();

        assert!(state_queue.join("9-1.json").is_file());
    }

    #[test]
    fn enqueue_refuses_to_write_through_a_planted_temporary() {
        let state = tempfile::tempdir().unwrap();
        let entry = PendingDel::new(&request(), "{}", 7);
        let dir = state.path().join("q");
        fs::create_dir_all(&dir).unwrap();
        let victim = state.path().join("victim");
        fs::write(&victim, "untouched").unwrap();
        std::os::unix::fs::symlink(&victim, dir.join(".7-1.json.tmp")).unwrap();

        let err = enqueue(&dir, &entry, 1).unwrap_err();

        assert_eq!(err.kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(fs::read_to_string(&victim).unwrap(), "untouched");
        assert!(!dir.join("7-1.json").exists());
    }

    #[test]
    fn enqueue_reports_a_dangling_link() {
        // The daemon's state dir was moved away while the daemon was down:
        // the shim must fail (the runtime retries the DEL), not write
        // somewhere nobody reads.
        let root = tempfile::tempdir().unwrap();
        let link = root.path().join("tether.sock.pending-del");
        std::os::unix::fs::symlink(root.path().join("gone/pending-del"), &link).unwrap();
        let entry = PendingDel::new(&request(), "{}", 7);
        assert!(enqueue(&link, &entry, 1).is_err());
        assert!(!root.path().join("gone").exists());
    }
}
