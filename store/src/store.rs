//! Durable state: the attachments this node has wired and the addresses they
//! hold.
//!
//! The store is the source of truth. The daemon's in-memory indexes are
//! rebuilt from it at startup and changed only after a store write.
//! Backends sit behind [`Store`]; the embedded `local` backend (a snapshot
//! plus a checksummed append-only journal) is the default.

use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use tether_base::error::{chain, Error};
use tether_base::mac::Mac;
use tether_base::time::UnixNanos;

pub use tether_base::keys::AttachmentKey;

/// One container interface wired by tether, as recorded durably.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attachment {
    /// Which attachment this is.
    pub key: AttachmentKey,
    /// The pod netns path given at ADD.
    pub netns: String,
    /// Pod addresses (one per family), routed as /32 and /128.
    pub ips: Vec<IpAddr>,
    /// The pod interface's MAC, "0a:58:..".
    pub mac: Mac,
    /// The node-side veth name.
    pub host_ifname: String,
    /// The MTU of both ends.
    pub mtu: u32,
    /// When the ADD that created it started, in nanoseconds since the epoch.
    pub created_unix_nanos: UnixNanos,
    /// K8S_POD_NAMESPACE, when the runtime sent it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_namespace: Option<String>,
    /// K8S_POD_NAME, when the runtime sent it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_name: Option<String>,
    /// K8S_POD_UID, when the runtime sent it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    /// The KubeVirt VM interface this pod carries, for a VM pod. Its
    /// addresses belong to the VM's record in the control plane; two pods
    /// of one VM (a migration's source and target) may hold them at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm: Option<tether_base::keys::VmKey>,
    /// For a VM pod of the `tap` or `managedTap` binding: its tap, if
    /// tether made one, and what its guest's DHCP answers carry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest: Option<tether_base::guest::GuestNet>,
    /// The named pools its addresses came from; empty for the node's pod
    /// CIDRs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pools: Vec<String>,
    /// Addresses only: tether ran as another plugin's IPAM, and that plugin
    /// made the interface. Nothing of it is in the kernel for tether to
    /// route, check or remove.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ipam_only: bool,
}

/// What went wrong in the attachment store. It says what happened; which
/// CNI code that is, is decided once, by `From<StoreError>` for
/// [`Error`].
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A file operation failed.
    #[error("{context}")]
    Io {
        /// What was being done, e.g. "reading /var/lib/tether/x".
        context: Cow<'static, str>,
        /// The system's answer.
        #[source]
        cause: io::Error,
    },
    /// The snapshot does not decode.
    #[error("decoding {}", path.display())]
    Corrupt {
        /// The snapshot file.
        path: PathBuf,
        /// The decoder's complaint.
        #[source]
        cause: serde_json::Error,
    },
    /// The snapshot has a format version this tetherd does not know.
    #[error("{} has unsupported version {version}", path.display())]
    UnsupportedVersion {
        /// The snapshot file.
        path: PathBuf,
        /// The version it states.
        version: u32,
    },
    /// A flush of the journal failed, now or earlier: what was acknowledged
    /// since may be lost, so the store takes no more changes.
    #[error("{context}")]
    FlushFailed {
        /// What was refused, e.g. "flushing the journal".
        context: &'static str,
        /// The failed flush's error.
        #[source]
        cause: Arc<io::Error>,
    },
    /// A record or the snapshot could not be encoded.
    #[error("encoding the {what}")]
    Encode {
        /// "journal record" or "snapshot".
        what: &'static str,
        /// The encoder's complaint.
        #[source]
        cause: serde_json::Error,
    },
    /// A journal record is longer than its length field can say.
    #[error("record too large ({len} bytes)")]
    TooLarge {
        /// Its encoded length.
        len: usize,
    },
    /// The attachment is recorded already.
    #[error("attachment {0} exists")]
    Exists(AttachmentKey),
    /// An address of the attachment is held by another attachment.
    #[error("address {ip} is already held by {holder}")]
    AddressHeld {
        /// The address.
        ip: IpAddr,
        /// The attachment holding it.
        holder: AttachmentKey,
    },
}

type Result<T, E = StoreError> = std::result::Result<T, E>;

/// A durable home for attachments. Every method is blocking; call it from a
/// blocking context (`spawn_blocking`), never directly on a tokio worker.
pub trait Store: Send + Sync + 'static {
    /// The backend's name as shown to operators ("local", "etcd").
    fn backend(&self) -> &'static str;
    /// Where the data lives (a path or endpoints), for operators.
    fn location(&self) -> String;
    /// Every attachment recorded.
    fn load(&self) -> Result<Vec<Attachment>>;
    /// Records a new attachment and claims its addresses, atomically and
    /// durably. Fails if the key exists ([`StoreError::Exists`]) or any
    /// address is already held ([`StoreError::AddressHeld`]).
    fn insert(&self, attachment: &Attachment) -> Result<()>;
    /// Removes attachments and frees their addresses, atomically and durably.
    /// Keys that are not recorded are skipped.
    fn remove(&self, keys: &[AttachmentKey]) -> Result<()>;
    /// Cheap liveness probe for STATUS.
    fn probe(&self) -> Result<()>;
}

/// When the local store makes an appended record durable against power loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fsync {
    /// `fdatasync` before the call returns: every acknowledged change
    /// survives a machine crash. Concurrent changes share flushes (group
    /// commit), so the cost is at most one device flush per change.
    Always,
    /// The record is written to the file (so it survives a daemon crash)
    /// before the call returns; a background thread flushes it to the device
    /// shortly after, grouping concurrent changes into one flush.
    Background,
}

/// The embedded single-node store: a snapshot plus an append-only journal
/// under the state dir.
///
/// - `attachments.snapshot`: every attachment as of the last compaction,
///   written to a temporary file, flushed, and renamed into place.
/// - `attachments.journal`: one framed record per change since then,
///   `[u32 length][u32 crc32][JSON]`. A torn or corrupt tail (a crash in
///   the middle of an append) is detected by the checksum and cut off.
///
/// Replay is idempotent (a record sets or removes whole attachments), so a
/// crash between writing a new snapshot and truncating the journal is
/// harmless. The store keeps an index in memory to enforce its invariants
/// (one record per key, one holder per address) before anything is written.
pub struct LocalStore {
    dir: PathBuf,
    fsync: Fsync,
    inner: Mutex<Journal>,
    /// How much of the journal is known to be on the device; shared with
    /// the flush thread of `Fsync::Background`.
    durable: Arc<Durable>,
}

/// Group-commit state. Journal positions are counted in bytes appended
/// since the store was opened (they never go back, unlike the file's
/// length, which compaction resets).
struct Durable {
    /// The journal, for flushing without holding the store's lock (the
    /// inode never changes: compaction truncates it in place).
    file: File,
    /// Bytes appended so far; written under the store's lock.
    appended: AtomicU64,
    state: Mutex<DurableState>,
    /// A flush finished.
    flushed: Condvar,
    /// Something was appended (wakes the `Fsync::Background` thread).
    appended_more: Condvar,
}

struct DurableState {
    /// Every byte before this position is on the device.
    synced: u64,
    /// A flush is running; others wait for it rather than start their own.
    syncing: bool,
    /// A failed flush poisons the store: what was acknowledged may be lost.
    error: Option<Arc<io::Error>>,
    /// The store is closing: the flush thread does a last flush and ends.
    stop: bool,
}

struct Journal {
    file: File,
    len: u64,
    attachments: BTreeMap<AttachmentKey, Attachment>,
    holders: HashMap<IpAddr, AttachmentKey>,
}

#[derive(Serialize, Deserialize)]
enum Record {
    #[serde(rename = "put")]
    Put(Box<Attachment>),
    #[serde(rename = "remove")]
    Remove(Vec<AttachmentKey>),
}

#[derive(Serialize, Deserialize)]
struct Snapshot {
    version: u32,
    attachments: Vec<Attachment>,
}

/// Compact once the journal grows past this.
const COMPACT_AT: u64 = 8 << 20;
const SNAPSHOT: &str = "attachments.snapshot";
const JOURNAL: &str = "attachments.journal";

/// Makes an io::Error a [`StoreError::Io`] with its context.
fn io_err(context: impl Into<Cow<'static, str>>) -> impl FnOnce(io::Error) -> StoreError {
    let context = context.into();
    move |cause| StoreError::Io { context, cause }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn frame(record: &Record) -> Result<Vec<u8>> {
    let body = serde_json::to_vec(record).map_err(|cause| StoreError::Encode {
        what: "journal record",
        cause,
    })?;
    let len = u32::try_from(body.len()).map_err(|_| StoreError::TooLarge { len: body.len() })?;
    let mut out = Vec::with_capacity(body.len() + 8);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Decodes records from the journal's bytes; returns them with the length
/// of the valid prefix (everything after it is a torn or corrupt tail).
fn unframe(bytes: &[u8]) -> (Vec<Record>, usize) {
    let mut records = Vec::new();
    let mut at = 0;
    while bytes.len() - at >= 8 {
        let len =
            u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]) as usize;
        let crc = u32::from_le_bytes([bytes[at + 4], bytes[at + 5], bytes[at + 6], bytes[at + 7]]);
        let Some(body) = bytes.get(at + 8..at + 8 + len) else {
            break;
        };
        if crc32fast::hash(body) != crc {
            break;
        }
        let Ok(record) = serde_json::from_slice::<Record>(body) else {
            break;
        };
        records.push(record);
        at += 8 + len;
    }
    (records, at)
}

pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

impl Journal {
    fn apply(&mut self, record: Record) {
        match record {
            Record::Put(a) => {
                let a = *a;
                if let Some(old) = self.attachments.remove(&a.key) {
                    self.release_holders(&old);
                }
                // A VM pod's addresses are the VM record's, which the
                // daemon guards; only plain pods hold addresses here.
                if a.vm.is_none() {
                    for ip in &a.ips {
                        self.holders.insert(*ip, a.key.clone());
                    }
                }
                self.attachments.insert(a.key.clone(), a);
            }
            Record::Remove(keys) => {
                for key in keys {
                    if let Some(old) = self.attachments.remove(&key) {
                        self.release_holders(&old);
                    }
                }
            }
        }
    }

    fn release_holders(&mut self, old: &Attachment) {
        for ip in &old.ips {
            if self.holders.get(ip) == Some(&old.key) {
                self.holders.remove(ip);
            }
        }
    }
}

impl LocalStore {
    /// Opens (or creates) the store in `state_dir`: loads the snapshot,
    /// replays the journal, cuts off a torn tail, and compacts.
    pub fn open(state_dir: &Path, fsync: Fsync) -> Result<Self> {
        std::fs::create_dir_all(state_dir)
            .map_err(io_err(format!("creating {}", state_dir.display())))?;
        let snapshot_path = state_dir.join(SNAPSHOT);
        let snapshot: Snapshot = match std::fs::read(&snapshot_path) {
            Ok(bytes) => match serde_json::from_slice(&bytes) {
                Ok(snapshot) => snapshot,
                Err(cause) => {
                    return Err(StoreError::Corrupt {
                        path: snapshot_path,
                        cause,
                    })
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Snapshot {
                version: 1,
                attachments: Vec::new(),
            },
            Err(e) => return Err(io_err(format!("reading {}", snapshot_path.display()))(e)),
        };
        if snapshot.version != 1 {
            return Err(StoreError::UnsupportedVersion {
                path: snapshot_path,
                version: snapshot.version,
            });
        }
        let journal_path = state_dir.join(JOURNAL);
        let file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(&journal_path)
            .map_err(io_err(format!("opening {}", journal_path.display())))?;
        let bytes = std::fs::read(&journal_path)
            .map_err(io_err(format!("reading {}", journal_path.display())))?;
        let (records, valid) = unframe(&bytes);
        if valid < bytes.len() {
            tracing::warn!(
                path = %journal_path.display(),
                dropped_bytes = bytes.len() - valid,
                "journal ends in a torn or corrupt record (a crash mid-append); cut off"
            );
        }
        let mut journal = Journal {
            file,
            len: 0,
            attachments: BTreeMap::new(),
            holders: HashMap::new(),
        };
        for a in snapshot.attachments {
            journal.apply(Record::Put(Box::new(a)));
        }
        for r in records {
            journal.apply(r);
        }
        let durable = Arc::new(Durable {
            file: journal.file.try_clone().map_err(io_err("journal handle"))?,
            appended: AtomicU64::new(0),
            state: Mutex::new(DurableState {
                synced: 0,
                syncing: false,
                error: None,
                stop: false,
            }),
            flushed: Condvar::new(),
            appended_more: Condvar::new(),
        });
        let store = LocalStore {
            dir: state_dir.to_path_buf(),
            fsync,
            inner: Mutex::new(journal),
            durable,
        };
        {
            let mut j = lock(&store.inner);
            store.compact(&mut j)?;
        }
        if fsync == Fsync::Background {
            let durable = store.durable.clone();
            std::thread::Builder::new()
                .name("tetherd-fsync".into())
                .spawn(move || durable.flush_in_background())
                .map_err(io_err("starting the flush thread"))?;
        }
        Ok(store)
    }

    /// The store as a shared trait object.
    pub fn into_arc(self) -> std::sync::Arc<dyn Store> {
        std::sync::Arc::new(self)
    }

    /// Writes a snapshot of the current state and empties the journal.
    fn compact(&self, j: &mut Journal) -> Result<()> {
        let snapshot = Snapshot {
            version: 1,
            attachments: j.attachments.values().cloned().collect(),
        };
        let bytes = serde_json::to_vec(&snapshot).map_err(|cause| StoreError::Encode {
            what: "snapshot",
            cause,
        })?;
        let path = self.dir.join(SNAPSHOT);
        let tmp = self.dir.join(format!(".{SNAPSHOT}.tmp"));
        let write = || -> std::io::Result<()> {
            let mut f = File::create(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)?;
            sync_dir(&self.dir)?;
            // Only now is the journal redundant; replaying it onto the new
            // snapshot would be harmless anyway (replay is idempotent).
            j.file.set_len(0)?;
            j.file.sync_all()
        };
        write().map_err(io_err("compacting the journal"))?;
        j.len = 0;
        // The snapshot holds everything appended so far, flushed.
        let appended = self.durable.appended.load(Ordering::Acquire);
        let mut d = lock(&self.durable.state);
        d.synced = d.synced.max(appended);
        drop(d);
        Ok(())
    }

    /// Appends a record under the store's lock; it is in the file (safe
    /// from a daemon crash) when this returns. Returns the journal position
    /// after it, for [`LocalStore::make_durable`].
    fn append(&self, j: &mut Journal, record: &Record) -> Result<u64> {
        if let Some(e) = &lock(&self.durable.state).error {
            return Err(StoreError::FlushFailed {
                context: "flushing the journal",
                cause: e.clone(),
            });
        }
        let bytes = frame(record)?;
        if let Err(e) = j.file.write_all(&bytes) {
            // A partial append is cut off at the next open by its checksum;
            // truncate now so that later appends stay readable.
            let _ = j.file.set_len(j.len);
            return Err(io_err("appending to the journal")(e));
        }
        j.len += bytes.len() as u64;
        let end = self.durable.appended.load(Ordering::Acquire) + bytes.len() as u64;
        self.durable.appended.store(end, Ordering::Release);
        if self.fsync == Fsync::Background {
            // Notified under the lock, so the flush thread cannot miss it
            // between its check and its wait.
            let _st = lock(&self.durable.state);
            self.durable.appended_more.notify_one();
        }
        Ok(end)
    }

    /// With `Fsync::Always`, waits until the journal is on the device up to
    /// `end`; called without the store's lock.
    fn make_durable(&self, end: u64) -> Result<()> {
        match self.fsync {
            Fsync::Always => self.durable.flush_to(end),
            Fsync::Background => Ok(()),
        }
    }
}

impl Durable {
    /// Returns once the journal is on the device up to `end`. One flush
    /// covers everything appended before it started, so concurrent callers
    /// share flushes (group commit).
    fn flush_to(&self, end: u64) -> Result<()> {
        let mut st = lock(&self.state);
        loop {
            if let Some(e) = &st.error {
                return Err(StoreError::FlushFailed {
                    context: "flushing the journal",
                    cause: e.clone(),
                });
            }
            if st.synced >= end {
                return Ok(());
            }
            if st.syncing {
                st = self.flushed.wait(st).unwrap_or_else(|p| p.into_inner());
                continue;
            }
            st.syncing = true;
            drop(st);
            let target = self.appended.load(Ordering::Acquire);
            let outcome = self.file.sync_data();
            st = lock(&self.state);
            st.syncing = false;
            match outcome {
                Ok(()) => st.synced = st.synced.max(target),
                Err(e) => {
                    tracing::error!(error = %e, "journal flush failed");
                    st.error = Some(Arc::new(e));
                }
            }
            self.flushed.notify_all();
        }
    }

    /// The `Fsync::Background` thread: flushes whenever something was
    /// appended, until the store closes or a flush fails.
    fn flush_in_background(&self) {
        loop {
            let mut st = lock(&self.state);
            while !st.stop
                && st.error.is_none()
                && st.synced >= self.appended.load(Ordering::Acquire)
            {
                st = self
                    .appended_more
                    .wait(st)
                    .unwrap_or_else(|p| p.into_inner());
            }
            if st.error.is_some() {
                return;
            }
            let stop = st.stop;
            drop(st);
            // Errors are recorded in the state, where every later write and
            // STATUS see them.
            let _ = self.flush_to(self.appended.load(Ordering::Acquire));
            if stop {
                return;
            }
        }
    }
}

impl Drop for LocalStore {
    fn drop(&mut self) {
        lock(&self.durable.state).stop = true;
        self.durable.appended_more.notify_one();
        let _ = self
            .durable
            .flush_to(self.durable.appended.load(Ordering::Acquire));
    }
}

impl Store for LocalStore {
    fn backend(&self) -> &'static str {
        "local"
    }

    fn location(&self) -> String {
        self.dir.display().to_string()
    }

    fn load(&self) -> Result<Vec<Attachment>> {
        Ok(lock(&self.inner).attachments.values().cloned().collect())
    }

    fn insert(&self, a: &Attachment) -> Result<()> {
        let mut j = lock(&self.inner);
        if j.attachments.contains_key(&a.key) {
            return Err(StoreError::Exists(a.key.clone()));
        }
        if let Some((ip, holder)) = a
            .ips
            .iter()
            .find_map(|ip| j.holders.get(ip).map(|h| (ip, h)))
        {
            return Err(StoreError::AddressHeld {
                ip: *ip,
                holder: holder.clone(),
            });
        }
        let record = Record::Put(Box::new(a.clone()));
        let end = self.append(&mut j, &record)?;
        j.apply(record);
        if j.len > COMPACT_AT {
            self.compact(&mut j)?;
        }
        drop(j);
        self.make_durable(end)
    }

    fn remove(&self, keys: &[AttachmentKey]) -> Result<()> {
        let mut j = lock(&self.inner);
        let present: Vec<AttachmentKey> = keys
            .iter()
            .filter(|k| j.attachments.contains_key(k))
            .cloned()
            .collect();
        if present.is_empty() {
            return Ok(());
        }
        let record = Record::Remove(present);
        let end = self.append(&mut j, &record)?;
        j.apply(record);
        if j.len > COMPACT_AT {
            self.compact(&mut j)?;
        }
        drop(j);
        self.make_durable(end)
    }

    fn probe(&self) -> Result<()> {
        if let Some(e) = lock(&self.durable.state).error.clone() {
            return Err(StoreError::FlushFailed {
                context: "a journal flush failed",
                cause: e,
            });
        }
        let j = lock(&self.inner);
        j.file.metadata().map(|_| ()).map_err(io_err("journal"))
    }
}

/// Which error, and so which CNI code, each attachment-store failure is.
impl From<StoreError> for Error {
    fn from(e: StoreError) -> Self {
        let text = chain(&e);
        match e {
            // The files, or a flush the device refused (104).
            StoreError::Io { .. }
            | StoreError::Corrupt { .. }
            | StoreError::UnsupportedVersion { .. }
            | StoreError::FlushFailed { .. } => Error::Store(text),
            // What tetherd asked of the store makes no sense: the daemon
            // checks keys and addresses before it writes (199).
            StoreError::Encode { .. }
            | StoreError::TooLarge { .. }
            | StoreError::Exists(_)
            | StoreError::AddressHeld { .. } => Error::Internal(text),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attachment(cid: &str, ips: &[&str]) -> Attachment {
        Attachment {
            key: AttachmentKey {
                network: "net".into(),
                container_id: cid.into(),
                ifname: "eth0".into(),
            },
            netns: "/run/netns/x".into(),
            ips: ips.iter().map(|s| s.parse().unwrap()).collect(),
            mac: "0a:58:0a:00:00:02".parse().expect("test MAC"),
            host_ifname: "tth000000000000".into(),
            mtu: 1500,
            created_unix_nanos: UnixNanos::from_nanos(1),
            pod_namespace: Some("default".into()),
            pod_name: None,
            pod_uid: None,
            vm: None,
            guest: None,
            pools: Vec::new(),
            ipam_only: false,
        }
    }

    fn sorted(s: &LocalStore) -> Vec<Attachment> {
        let mut all = s.load().unwrap();
        all.sort_by(|x, y| x.key.cmp(&y.key));
        all
    }

    #[test]
    fn insert_load_remove_survive_reopen() {
        for fsync in [Fsync::Always, Fsync::Background] {
            let dir = tempfile::tempdir().unwrap();
            {
                let s = LocalStore::open(dir.path(), fsync).unwrap();
                s.insert(&attachment("a", &["10.0.0.2", "fd00::2"]))
                    .unwrap();
                s.insert(&attachment("b", &["10.0.0.3"])).unwrap();
            }
            let s = LocalStore::open(dir.path(), fsync).unwrap();
            let all = sorted(&s);
            assert_eq!(all.len(), 2);
            assert_eq!(all[0], attachment("a", &["10.0.0.2", "fd00::2"]));
            s.remove(std::slice::from_ref(&all[0].key)).unwrap();
            drop(s);
            let s = LocalStore::open(dir.path(), fsync).unwrap();
            let all = sorted(&s);
            assert_eq!(all.len(), 1);
            assert_eq!(all[0].key.container_id, "b");
            // The freed address can be claimed again.
            s.insert(&attachment("c", &["10.0.0.2"])).unwrap();
        }
    }

    #[test]
    fn changes_are_in_the_file_before_the_call_returns() {
        // What a kill -9 leaves: the files as they are, with no flush and no
        // compaction. Copy them aside while the store is still open.
        let dir = tempfile::tempdir().unwrap();
        let s = LocalStore::open(dir.path(), Fsync::Background).unwrap();
        s.insert(&attachment("a", &["10.0.0.2"])).unwrap();
        s.insert(&attachment("b", &["10.0.0.3"])).unwrap();
        s.remove(&[attachment("a", &[]).key]).unwrap();
        let copy = tempfile::tempdir().unwrap();
        for name in [SNAPSHOT, JOURNAL] {
            std::fs::copy(dir.path().join(name), copy.path().join(name)).unwrap();
        }
        let recovered = LocalStore::open(copy.path(), Fsync::Background).unwrap();
        let all = sorted(&recovered);
        assert_eq!(all, vec![attachment("b", &["10.0.0.3"])]);
        drop(s);
    }

    #[test]
    fn refuses_second_holder_of_an_address_and_duplicate_keys() {
        let dir = tempfile::tempdir().unwrap();
        let s = LocalStore::open(dir.path(), Fsync::Background).unwrap();
        s.insert(&attachment("a", &["10.0.0.2"])).unwrap();
        let e = s.insert(&attachment("b", &["10.0.0.2"])).unwrap_err();
        assert!(matches!(e, StoreError::AddressHeld { .. }), "{e:?}");
        assert!(e.to_string().contains("already held by net/a/eth0"), "{e}");
        let e = s.insert(&attachment("a", &["10.0.0.9"])).unwrap_err();
        assert!(
            matches!(&e, StoreError::Exists(k) if k.container_id == "a"),
            "{e:?}"
        );
        drop(s);
        // Nothing of the refused inserts was written.
        let s = LocalStore::open(dir.path(), Fsync::Background).unwrap();
        assert_eq!(s.load().unwrap().len(), 1);
        s.insert(&attachment("c", &["10.0.0.9"])).unwrap();
    }

    #[test]
    fn a_torn_or_corrupt_tail_is_cut_off() {
        let dir = tempfile::tempdir().unwrap();
        let journal = dir.path().join(JOURNAL);
        let good = frame(&Record::Put(Box::new(attachment("a", &["10.0.0.2"])))).unwrap();
        let second = frame(&Record::Put(Box::new(attachment("b", &["10.0.0.3"])))).unwrap();
        // A record cut in the middle, as a crash mid-append leaves it.
        let mut bytes = good.clone();
        bytes.extend_from_slice(&second[..second.len() / 2]);
        std::fs::write(&journal, &bytes).unwrap();
        let s = LocalStore::open(dir.path(), Fsync::Background).unwrap();
        assert_eq!(sorted(&s), vec![attachment("a", &["10.0.0.2"])]);
        s.insert(&attachment("c", &["10.0.0.4"])).unwrap();
        drop(s);
        let s = LocalStore::open(dir.path(), Fsync::Background).unwrap();
        assert_eq!(s.load().unwrap().len(), 2);
        drop(s);

        // A flipped byte inside a record: the checksum refuses it and
        // everything after it.
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = good.clone();
        bytes.extend_from_slice(&second);
        let last = bytes.len() - 3;
        bytes[last] ^= 0xff;
        std::fs::write(dir.path().join(JOURNAL), &bytes).unwrap();
        let s = LocalStore::open(dir.path(), Fsync::Background).unwrap();
        assert_eq!(sorted(&s), vec![attachment("a", &["10.0.0.2"])]);
    }

    #[test]
    fn replaying_a_journal_onto_a_newer_snapshot_is_harmless() {
        // A crash after the new snapshot was renamed into place but before
        // the journal was truncated.
        let dir = tempfile::tempdir().unwrap();
        let records = [
            Record::Put(Box::new(attachment("a", &["10.0.0.2"]))),
            Record::Put(Box::new(attachment("b", &["10.0.0.3"]))),
            Record::Remove(vec![attachment("a", &[]).key]),
        ];
        let mut bytes = Vec::new();
        for r in &records {
            bytes.extend(frame(r).unwrap());
        }
        std::fs::write(dir.path().join(JOURNAL), &bytes).unwrap();
        drop(LocalStore::open(dir.path(), Fsync::Background).unwrap());
        // Put the old journal back next to the compacted snapshot.
        std::fs::write(dir.path().join(JOURNAL), &bytes).unwrap();
        let s = LocalStore::open(dir.path(), Fsync::Background).unwrap();
        assert_eq!(sorted(&s), vec![attachment("b", &["10.0.0.3"])]);
    }

    #[test]
    fn compaction_keeps_everything_and_empties_the_journal() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = LocalStore::open(dir.path(), Fsync::Background).unwrap();
            for i in 0..50u32 {
                s.insert(&attachment(
                    &format!("c{i}"),
                    &[&format!("10.0.1.{}", i + 1)],
                ))
                .unwrap();
            }
            let j = lock(&s.inner);
            assert!(j.len > 0);
        }
        let s = LocalStore::open(dir.path(), Fsync::Background).unwrap();
        assert_eq!(s.load().unwrap().len(), 50);
        assert_eq!(
            std::fs::metadata(dir.path().join(JOURNAL)).unwrap().len(),
            0,
            "open compacts the journal into the snapshot"
        );
    }

    #[test]
    fn unreadable_snapshots_are_refused_with_their_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(SNAPSHOT);
        std::fs::write(&path, b"{not json").unwrap();
        let e = LocalStore::open(dir.path(), Fsync::Background)
            .err()
            .unwrap();
        assert!(
            matches!(&e, StoreError::Corrupt { path: p, .. } if *p == path),
            "{e:?}"
        );
        std::fs::write(&path, br#"{"version":2,"attachments":[]}"#).unwrap();
        let e = LocalStore::open(dir.path(), Fsync::Background)
            .err()
            .unwrap();
        assert!(
            matches!(e, StoreError::UnsupportedVersion { version: 2, .. }),
            "{e:?}"
        );
    }

    #[test]
    fn removing_unknown_keys_is_a_no_op() {
        let dir = tempfile::tempdir().unwrap();
        let s = LocalStore::open(dir.path(), Fsync::Background).unwrap();
        s.remove(&[attachment("zz", &[]).key]).unwrap();
        s.probe().unwrap();
        assert!(s.load().unwrap().is_empty());
        assert_eq!(
            std::fs::metadata(dir.path().join(JOURNAL)).unwrap().len(),
            0
        );
    }

    #[test]
    fn background_policy_flushes_what_was_appended() {
        let dir = tempfile::tempdir().unwrap();
        let s = LocalStore::open(dir.path(), Fsync::Background).unwrap();
        s.insert(&attachment("a", &["10.0.0.2"])).unwrap();
        s.remove(&[attachment("a", &[]).key]).unwrap();
        let appended = s.durable.appended.load(Ordering::Acquire);
        assert!(appended > 0);
        // The flush thread catches up on its own; nobody waits for it.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while lock(&s.durable.state).synced < appended {
            assert!(std::time::Instant::now() < deadline, "never flushed");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// Group commit's correctness: concurrent writers, every change flushed
    /// and kept. (That flushes are shared is a matter of timing, shown by
    /// `write_latency`, not asserted here.)
    #[test]
    fn concurrent_writers_lose_nothing_and_end_fully_flushed() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = Arc::new(LocalStore::open(dir.path(), Fsync::Always).unwrap());
            let threads: Vec<_> = (0..8u32)
                .map(|t| {
                    let s = s.clone();
                    std::thread::spawn(move || {
                        for i in 0..40u32 {
                            let ip = format!("10.{t}.{}.{}", i / 200, i % 200 + 1);
                            let a = attachment(&format!("t{t}c{i}"), &[&ip]);
                            s.insert(&a).unwrap();
                            if i % 2 == 0 {
                                s.remove(std::slice::from_ref(&a.key)).unwrap();
                            }
                        }
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            let d = lock(&s.durable.state);
            assert_eq!(d.synced, s.durable.appended.load(Ordering::Acquire));
        }
        let s = LocalStore::open(dir.path(), Fsync::Always).unwrap();
        assert_eq!(s.load().unwrap().len(), 8 * 20);
    }

    /// Prints the cost of one insert and one remove on this disk, for both
    /// fsync policies (information for the benchmark notes, no assertion).
    #[test]
    #[ignore]
    fn write_latency() {
        for fsync in [Fsync::Always, Fsync::Background] {
            let dir = tempfile::Builder::new().tempdir_in("/var/tmp").unwrap();
            let s = LocalStore::open(dir.path(), fsync).unwrap();
            let (mut ins, mut del) = (Vec::new(), Vec::new());
            for i in 0..200u32 {
                let ip = format!("10.0.{}.{}", i / 250, i % 250 + 1);
                let a = attachment(&format!("c{i}"), &[&ip]);
                let t = std::time::Instant::now();
                s.insert(&a).unwrap();
                ins.push(t.elapsed());
                let t = std::time::Instant::now();
                s.remove(std::slice::from_ref(&a.key)).unwrap();
                del.push(t.elapsed());
            }
            ins.sort();
            del.sort();
            println!(
                "{fsync:?}: insert p50 {:?} p99 {:?}; remove p50 {:?} p99 {:?}",
                ins[100], ins[197], del[100], del[197]
            );
            drop(s);
            // 8 writers at once, 100 inserts each: group commit at work.
            let dir = tempfile::Builder::new().tempdir_in("/var/tmp").unwrap();
            let s = Arc::new(LocalStore::open(dir.path(), fsync).unwrap());
            let t = std::time::Instant::now();
            let threads: Vec<_> = (0..8u32)
                .map(|w| {
                    let s = s.clone();
                    std::thread::spawn(move || {
                        for i in 0..100u32 {
                            let ip = format!("10.{w}.{}.{}", i / 200, i % 200 + 1);
                            s.insert(&attachment(&format!("w{w}c{i}"), &[&ip])).unwrap();
                        }
                    })
                })
                .collect();
            for th in threads {
                th.join().unwrap();
            }
            println!("{fsync:?}: 800 inserts from 8 threads in {:?}", t.elapsed());
        }
    }
}
