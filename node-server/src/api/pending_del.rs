//! The shim's pending-DEL queue, read by the daemon.
//!
//! When the shim cannot reach the daemon on DEL it must not fail (the kubelet
//! would retry forever and pod termination would hang), so it persists the
//! request as one JSON file and succeeds. The format and where the shim
//! writes are defined once, in [`tether_proto::pending_del`]. The daemon's
//! side is here:
//!
//! - [`adopt`], at start-up: points the shim's path beside the socket at
//!   `<state-dir>/pending-del/`, after moving in what an earlier target of
//!   that path still held (a former state dir's queue, or the plain
//!   directory a shim made before the daemon first ran since boot). This is
//!   why `--state-dir` is the only knob: no netconf field can disagree.
//! - [`read_queue`]: the entries to replay, oldest first, which the daemon
//!   does before it serves anything, and then periodically.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use tether_proto::pending_del::{is_entry_name, FORMAT_VERSION};
pub use tether_proto::pending_del::{queue_dir, queue_link, PendingDel};

/// An entry that could not be read; it is moved aside for an operator.
#[derive(Debug, PartialEq, Eq)]
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
) -> (Vec<(PathBuf, PendingDel)>, Vec<BadEntry>) {
    let dir = queue_dir(state_dir);
    let mut good = Vec::new();
    let mut bad = Vec::new();
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return (good, bad);
    };
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| is_entry_name(&n.to_string_lossy()))
        })
        .collect();
    paths.sort();
    for path in paths {
        let parsed = std::fs::symlink_metadata(&path)
            .map_err(|e| e.to_string())
            .and_then(|m| writer_allowed(&m, allowed_uids))
            .and_then(|()| std::fs::read(&path).map_err(|e| e.to_string()))
            .and_then(|b| serde_json::from_slice::<PendingDel>(&b).map_err(|e| e.to_string()))
            .and_then(|q| {
                if q.version == FORMAT_VERSION && q.command == "DEL" {
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

/// Whether a queue file may be replayed: a regular file owned by root or by
/// a uid allowed on the socket. The queue is a second way into the daemon,
/// so it gets the socket's authorisation.
fn writer_allowed(m: &fs::Metadata, allowed_uids: &[u32]) -> Result<(), String> {
    let uid = m.uid();
    if !m.file_type().is_file() {
        Err("not a regular file".to_string())
    } else if uid != 0 && !allowed_uids.contains(&uid) {
        Err(format!("written by uid {uid}, which may not use tetherd"))
    } else {
        Ok(())
    }
}

/// The file in the state dir that records where that state dir was when a
/// daemon last used it, so that a copy or a move of it can be recognised.
pub const LOCATION_FILE: &str = "location";

/// What [`adopt`] found and did about it.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Adopted {
    /// Queue directories other than the daemon's own whose entries were
    /// taken in: a former state dir's queue, or the plain directory a shim
    /// made before the daemon ran.
    pub from: Vec<PathBuf>,
    /// Entries moved into the daemon's queue.
    pub moved: u64,
    /// Entries left where they were, with why (kept for an operator).
    pub left: Vec<BadEntry>,
}

/// Points the shim's path beside `socket` at the queue under `state_dir`,
/// moving into that queue whatever a former queue still holds. Call it
/// before the first replay and before serving.
///
/// Former queues are found three ways, so that changing `--state-dir` loses
/// nothing even when the link did not survive (a reboot empties /run):
///
/// - The state dir records where it was last used ([`LOCATION_FILE`]). A
///   state dir that was copied or moved names its former place, whose queue
///   may have taken DELs after the copy.
/// - The path beside the socket:
///   - a symlink to the daemon's own queue: nothing to do;
///   - a symlink elsewhere (the state dir changed): that queue is adopted
///     and the link replaced atomically;
///   - a plain directory (a shim queued before the daemon first ran since
///     boot): it is renamed aside first, so that a shim writing at that
///     moment fails its rename and reports an error (the runtime retries
///     the DEL) instead of writing into a directory nobody reads; then the
///     link is made and the entries are moved in;
///   - nothing: the link is made;
///   - anything else (a regular file, say) is an error: the shim could never
///     queue there, and DELs would fail while the daemon is down.
/// - A directory an earlier run renamed aside and did not finish with.
///
/// Entries written by a uid that may not use the daemon are not moved: a
/// copy across file systems would make them root's.
pub fn adopt(socket: &Path, state_dir: &Path, allowed_uids: &[u32]) -> io::Result<Adopted> {
    // The link must not depend on the daemon's working directory.
    let state_dir = std::path::absolute(state_dir)?;
    let own = queue_dir(&state_dir);
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&own)?;
    let mut sources = Vec::new();
    let location = state_dir.join(LOCATION_FILE);
    let recorded = match fs::read_to_string(&location) {
        Ok(text) => Some(PathBuf::from(text.trim_end_matches('\n'))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(e),
    };
    if let Some(former) = &recorded {
        if !same_dir(former, &state_dir) {
            sources.push(queue_dir(former));
        }
    }
    let link = queue_link(socket);
    // Directories renamed aside by an earlier run that stopped before it
    // had moved their entries (a crash at the wrong moment).
    let mut aside = leftovers_aside(&link)?;
    sources.extend(aside.iter().cloned());
    match fs::symlink_metadata(&link) {
        Ok(m) if m.file_type().is_symlink() => {
            let mut target = fs::read_link(&link)?;
            if target.is_relative() {
                if let Some(parent) = link.parent() {
                    target = parent.join(target);
                }
            }
            if !same_dir(&target, &own) {
                replace_link(&link, &own)?;
                sources.push(target);
            }
        }
        Ok(m) if m.is_dir() => {
            let dir = sibling(&link, &format!(".adopting.{}", std::process::id()));
            fs::rename(&link, &dir)?;
            replace_link(&link, &own)?;
            sources.push(dir.clone());
            aside.push(dir);
        }
        Ok(_) => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!(
                    "{} is neither a directory nor a symlink: the plugin could not queue a DEL there; remove it",
                    link.display()
                ),
            ))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            // The socket's directory, made as `server::bind` makes it: uids
            // allowed on the socket must be able to reach it.
            if let Some(parent) = link.parent() {
                fs::create_dir_all(parent)?;
            }
            replace_link(&link, &own)?;
        }
        Err(e) => return Err(e),
    }
    let mut adopted = Adopted::default();
    for source in sources {
        if adopted.from.iter().any(|seen| same_dir(seen, &source)) {
            continue;
        }
        if move_entries(&source, &own, allowed_uids, &mut adopted)? {
            adopted.from.push(source);
        }
    }
    // The renamed-aside directory is ours to remove once its entries are in:
    // what else it holds are unfinished writes, whose shims fail their rename
    // now that the path is gone (the runtime retries those DELs). Entries we
    // may not take keep it for an operator. A former state dir's queue stays
    // (empty now, and the operator's to delete).
    if adopted.left.is_empty() {
        for dir in aside {
            fs::remove_dir_all(&dir)?;
        }
    }
    if recorded.as_deref() != Some(state_dir.as_path()) {
        write_location(&location, &state_dir)?;
    }
    Ok(adopted)
}

/// The directories `.<link name>.adopting.<pid>` beside `link`.
fn leftovers_aside(link: &Path) -> io::Result<Vec<PathBuf>> {
    let (Some(parent), Some(name)) = (link.parent(), link.file_name()) else {
        return Ok(Vec::new());
    };
    let prefix = format!(".{}.adopting.", name.to_string_lossy());
    let entries = match fs::read_dir(parent) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry?;
        if entry.file_name().to_string_lossy().starts_with(&prefix) && entry.file_type()?.is_dir() {
            found.push(entry.path());
        }
    }
    Ok(found)
}

/// Records `state_dir` in `location`, atomically.
fn write_location(location: &Path, state_dir: &Path) -> io::Result<()> {
    let tmp = sibling(location, ".tmp");
    let mut body = state_dir.as_os_str().to_owned().into_encoded_bytes();
    body.push(b'\n');
    fs::write(&tmp, body)?;
    File::open(&tmp)?.sync_all()?;
    fs::rename(&tmp, location)
}

/// Moves every entry of `from` into `to`: a rename on the same file system,
/// else a durable copy that keeps the writer's ownership, then an unlink.
/// Returns whether `from` held any entry.
fn move_entries(
    from: &Path,
    to: &Path,
    allowed_uids: &[u32],
    out: &mut Adopted,
) -> io::Result<bool> {
    let entries = match fs::read_dir(from) {
        Ok(entries) => entries,
        // A former state dir that is gone (moved away with the store, say)
        // holds nothing to adopt.
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    let mut any = false;
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        if !is_entry_name(&name.to_string_lossy()) {
            continue;
        }
        any = true;
        let path = entry.path();
        let meta = fs::symlink_metadata(&path)?;
        if let Err(reason) = writer_allowed(&meta, allowed_uids) {
            out.left.push(BadEntry { path, reason });
            continue;
        }
        let target = to.join(&name);
        match fs::rename(&path, &target) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
                copy_durably(&path, &meta, to, &name)?;
                fs::remove_file(&path)?;
            }
            Err(e) => return Err(e),
        }
        out.moved += 1;
    }
    File::open(to)?.sync_all()?;
    Ok(any)
}

/// Copies `path` into `dir` as `name` the way the shim writes (temporary,
/// fsync, rename, fsync of the directory), owned as the original was.
fn copy_durably(path: &Path, meta: &fs::Metadata, dir: &Path, name: &OsString) -> io::Result<()> {
    let body = fs::read(path)?;
    let mut tmp_name = OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(".tmp");
    let tmp = dir.join(tmp_name);
    let _ = fs::remove_file(&tmp);
    let written = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        file.write_all(&body)?;
        std::os::unix::fs::fchown(&file, Some(meta.uid()), Some(meta.gid()))?;
        file.sync_all()?;
        fs::rename(&tmp, dir.join(name))
    })();
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written?;
    File::open(dir)?.sync_all()
}

/// Makes `link` a symlink to `target`, atomically replacing a symlink there.
fn replace_link(link: &Path, target: &Path) -> io::Result<()> {
    let tmp = sibling(link, &format!(".new.{}", std::process::id()));
    let _ = fs::remove_file(&tmp);
    std::os::unix::fs::symlink(target, &tmp)?;
    if let Err(e) = fs::rename(&tmp, link) {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    if let Some(parent) = link.parent() {
        File::open(parent)?.sync_all()?;
    }
    Ok(())
}

/// `.<name of path><suffix>` in `path`'s directory: hidden, so that no
/// reader takes it for something else.
fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut name = OsString::from(".");
    name.push(path.file_name().unwrap_or_default());
    name.push(suffix);
    path.with_file_name(name)
}

/// Whether two paths name the same directory, also when one of them is
/// spelled differently (a trailing slash, a symlinked parent).
fn same_dir(a: &Path, b: &Path) -> bool {
    if a == b {
        return true;
    }
    match (fs::metadata(a), fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

/// Number of entries waiting, for Stats.
pub fn queue_len(state_dir: &Path) -> u64 {
    std::fs::read_dir(queue_dir(state_dir))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| is_entry_name(&e.file_name().to_string_lossy()))
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
    #[cfg_attr(
        not(feature = "root-tests"),
        ignore = "needs root: `make test` runs it"
    )]
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

    fn write_entry(dir: &Path, name: &str, cid: &str) {
        std::fs::create_dir_all(dir).unwrap();
        let body = format!(
            r#"{{"version":1,"queuedAtUnixNanos":1,"command":"DEL","containerId":"{cid}","ifname":"eth0","stdin":"{{}}"}}"#
        );
        std::fs::write(dir.join(name), body).unwrap();
    }

    fn ids(state_dir: &Path) -> Vec<String> {
        let (good, bad) = read_queue(state_dir, &[]);
        assert!(bad.is_empty(), "{bad:?}");
        good.into_iter().map(|(_, q)| q.container_id).collect()
    }

    #[test]
    fn adopt_makes_the_link_when_there_is_nothing() {
        let root = tempfile::tempdir().unwrap();
        let socket = root.path().join("run/tether.sock");
        let state = root.path().join("state");
        let adopted = adopt(&socket, &state, &[]).unwrap();
        assert_eq!(adopted, Adopted::default());
        let link = queue_link(&socket);
        assert_eq!(std::fs::read_link(&link).unwrap(), queue_dir(&state));
        assert_eq!(
            std::fs::read_to_string(state.join(LOCATION_FILE)).unwrap(),
            format!("{}\n", state.display())
        );
        // Adopting again changes nothing.
        assert_eq!(adopt(&socket, &state, &[]).unwrap(), Adopted::default());
    }

    #[test]
    #[cfg_attr(
        not(feature = "root-tests"),
        ignore = "needs root: `make test` runs it"
    )]
    fn adopt_takes_in_what_a_shim_queued_before_the_daemon_ran() {
        let root = tempfile::tempdir().unwrap();
        let socket = root.path().join("tether.sock");
        let state = root.path().join("state");
        let link = queue_link(&socket);
        write_entry(&link, "100-1.json", "early");
        write_entry(&link, ".200-1.json.tmp", "unfinished");

        let adopted = adopt(&socket, &state, &[]).unwrap();

        assert_eq!(adopted.moved, 1);
        assert!(adopted.left.is_empty());
        assert_eq!(ids(&state), ["early"]);
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        // The renamed-aside directory (with the unfinished write) is gone.
        let names: Vec<String> = std::fs::read_dir(root.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert!(names.iter().all(|n| !n.contains("adopting")), "{names:?}");
    }

    #[test]
    #[cfg_attr(
        not(feature = "root-tests"),
        ignore = "needs root: `make test` runs it"
    )]
    fn adopt_follows_a_changed_state_dir() {
        let root = tempfile::tempdir().unwrap();
        let socket = root.path().join("tether.sock");
        let old_state = root.path().join("old");
        let new_state = root.path().join("new");
        adopt(&socket, &old_state, &[]).unwrap();
        // The daemon stopped; a shim queued through the link.
        write_entry(&queue_link(&socket), "100-1.json", "queued-while-down");

        let adopted = adopt(&socket, &new_state, &[]).unwrap();

        assert_eq!(adopted.from, [queue_dir(&old_state)]);
        assert_eq!(adopted.moved, 1);
        assert_eq!(ids(&new_state), ["queued-while-down"]);
        assert!(ids(&old_state).is_empty());
        assert_eq!(
            std::fs::read_link(queue_link(&socket)).unwrap(),
            queue_dir(&new_state)
        );
    }

    #[test]
    fn adopt_survives_a_former_state_dir_that_is_gone() {
        let root = tempfile::tempdir().unwrap();
        let socket = root.path().join("tether.sock");
        let old_state = root.path().join("old");
        adopt(&socket, &old_state, &[]).unwrap();
        std::fs::remove_dir_all(&old_state).unwrap();
        let new_state = root.path().join("new");
        let adopted = adopt(&socket, &new_state, &[]).unwrap();
        assert_eq!(adopted.moved, 0);
        assert_eq!(
            std::fs::read_link(queue_link(&socket)).unwrap(),
            queue_dir(&new_state)
        );
    }

    #[test]
    fn adopt_refuses_a_file_in_the_way() {
        let root = tempfile::tempdir().unwrap();
        let socket = root.path().join("tether.sock");
        std::fs::write(queue_link(&socket), "").unwrap();
        let err = adopt(&socket, &root.path().join("state"), &[]).unwrap_err();
        assert!(
            err.to_string()
                .contains("neither a directory nor a symlink"),
            "{err}"
        );
    }

    #[test]
    fn adopt_leaves_entries_of_uids_that_may_not_use_the_daemon() {
        let root = tempfile::tempdir().unwrap();
        let socket = root.path().join("tether.sock");
        let old_state = root.path().join("old");
        adopt(&socket, &old_state, &[]).unwrap();
        let queue = queue_dir(&old_state);
        write_entry(&queue, "100-1.json", "mallory");
        std::os::unix::fs::chown(queue.join("100-1.json"), Some(65534), Some(65534)).unwrap();

        let adopted = adopt(&socket, &root.path().join("new"), &[]).unwrap();

        assert_eq!(adopted.moved, 0);
        assert_eq!(adopted.left.len(), 1);
        assert!(adopted.left[0].reason.contains("uid 65534"));
        assert!(queue.join("100-1.json").exists());
    }

    #[test]
    #[cfg_attr(
        not(feature = "root-tests"),
        ignore = "needs root: `make test` runs it"
    )]
    fn adopt_copies_across_file_systems_keeping_the_owner() {
        // /dev/shm is a file system of its own, as /run/tether and
        // /var/lib/tether are two.
        let shm = tempfile::tempdir_in("/dev/shm").unwrap();
        let disk = tempfile::tempdir().unwrap();
        let dev = |p: &Path| std::fs::metadata(p).unwrap().dev();
        assert_ne!(dev(shm.path()), dev(disk.path()), "need two file systems");
        let socket = shm.path().join("tether.sock");
        write_entry(&queue_link(&socket), "100-1.json", "across");
        let allowed = 4242;
        std::os::unix::fs::chown(
            queue_link(&socket).join("100-1.json"),
            Some(allowed),
            Some(allowed),
        )
        .unwrap();
        let state = disk.path().join("state");

        let adopted = adopt(&socket, &state, &[allowed]).unwrap();

        assert_eq!(adopted.moved, 1);
        let copied = queue_dir(&state).join("100-1.json");
        let meta = std::fs::metadata(&copied).unwrap();
        assert_eq!((meta.uid(), meta.gid()), (allowed, allowed));
        assert_eq!(meta.mode() & 0o777, 0o600);
        let (good, _) = read_queue(&state, &[allowed]);
        assert_eq!(good.len(), 1);
    }

    #[test]
    #[cfg_attr(
        not(feature = "root-tests"),
        ignore = "needs root: `make test` runs it"
    )]
    fn adopt_finds_the_former_queue_of_a_copied_state_dir_without_the_link() {
        let root = tempfile::tempdir().unwrap();
        let socket = root.path().join("tether.sock");
        let old_state = root.path().join("old");
        adopt(&socket, &old_state, &[]).unwrap();
        // Copied while the daemon was down; then a DEL was queued in the old
        // place, and the link went (a reboot).
        let new_state = root.path().join("new");
        std::fs::create_dir_all(&new_state).unwrap();
        std::fs::copy(old_state.join(LOCATION_FILE), new_state.join(LOCATION_FILE)).unwrap();
        write_entry(&queue_dir(&old_state), "100-1.json", "after-the-copy");
        std::fs::remove_file(queue_link(&socket)).unwrap();

        let adopted = adopt(&socket, &new_state, &[]).unwrap();

        assert_eq!(adopted.from, [queue_dir(&old_state)]);
        assert_eq!(ids(&new_state), ["after-the-copy"]);
        assert_eq!(
            std::fs::read_to_string(new_state.join(LOCATION_FILE)).unwrap(),
            format!("{}\n", new_state.display())
        );
        // Once recorded, the old place is no longer looked at.
        write_entry(&queue_dir(&old_state), "200-1.json", "stray");
        assert_eq!(adopt(&socket, &new_state, &[]).unwrap(), Adopted::default());
    }

    #[test]
    #[cfg_attr(
        not(feature = "root-tests"),
        ignore = "needs root: `make test` runs it"
    )]
    fn adopt_finishes_what_a_crashed_run_renamed_aside() {
        let root = tempfile::tempdir().unwrap();
        let socket = root.path().join("tether.sock");
        let state = root.path().join("state");
        // A run renamed the shim's directory aside and made the link, then
        // died before moving the entries.
        let aside = root.path().join(".tether.sock.pending-del.adopting.4242");
        write_entry(&aside, "100-1.json", "orphan");

        let adopted = adopt(&socket, &state, &[]).unwrap();

        assert_eq!(adopted.moved, 1);
        assert_eq!(adopted.from, std::slice::from_ref(&aside));
        assert_eq!(ids(&state), ["orphan"]);
        assert!(!aside.exists());
    }
}
