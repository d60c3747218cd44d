//! VM pods that left their record while the control store did not answer.
//!
//! A VM pod's DEL takes the pod out of its VM's record. When the store does
//! not answer (etcd down, the API server away), the DEL does not wait for
//! it: it tears down what is local and succeeds, and the record's change
//! waits here, in a file of the state dir written before the DEL answers,
//! until the store takes it (a background retry, every start of the
//! daemon, and the VM's next placement on this node, which goes first).
//!
//! Why deferring is safe: leaving a record never gives an address to
//! anyone. Until the change lands the record still holds the VM's
//! addresses and MAC (so no other VM, and no pod of this node's pools, can
//! get them), and other nodes keep the VM's routes as they were: to this
//! node, which no longer has the pod, exactly as if the VM had stopped
//! here. What waits is only the freeing: an ephemeral VM's addresses, and
//! the record's slot for the pod.
//!
//! What cannot be deferred, and answers "try again later" while the store
//! is away: placing a VM pod (a VM's first pod or a migration's target
//! must hold the record, or two nodes could give one address), a cutover
//! (every node routes the VM by the record), and an address reservation.

use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use tether_base::error::{Error, Result};
use tether_base::sync::lock;
use tether_base::time::UnixMillis;
use tether_store::store::AttachmentKey;
use tokio::sync::Notify;

use super::VmKey;

/// The file of waiting leaves in the state dir.
pub const FILE: &str = "vm-leaves.json";

/// One VM pod's leave of its record, waiting for the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Leave {
    /// The VM interface whose record holds the pod.
    pub vm: VmKey,
    /// The pod's attachment on this node.
    pub attachment: AttachmentKey,
    /// Whether the VM's record goes with its last pod (the network's
    /// `vmAddressPolicy: ephemeral`).
    pub ephemeral: bool,
    /// When the DEL queued it.
    pub queued_unix_ms: UnixMillis,
}

/// The waiting leaves: in memory, and in [`FILE`] when the node has a
/// state dir.
#[derive(Debug)]
pub struct Leaves {
    path: Option<PathBuf>,
    list: Mutex<Vec<Leave>>,
    wake: Notify,
}

impl Leaves {
    /// The leaves a former run left in `dir` (none when there is no file),
    /// kept there from now on; in memory only without a dir (unit tests).
    pub fn open(dir: Option<&Path>) -> Result<Leaves> {
        let path = dir.map(|d| d.join(FILE));
        let list = match &path {
            Some(p) => match std::fs::read(p) {
                Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
                    Error::Store(format!("{} is not a list of VM leaves: {e}", p.display()))
                })?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
                Err(e) => return Err(Error::Io(format!("reading {}: {e}", p.display()))),
            },
            None => Vec::new(),
        };
        Ok(Leaves {
            path,
            list: Mutex::new(list),
            wake: Notify::new(),
        })
    }

    /// Adds `leave` (once), durably before it returns, and wakes the retry.
    pub fn push(&self, leave: Leave) -> Result<()> {
        let mut list = lock(&self.list);
        if list
            .iter()
            .any(|l| l.vm == leave.vm && l.attachment == leave.attachment)
        {
            return Ok(());
        }
        let mut next = list.clone();
        next.push(leave);
        self.persist(&next)?;
        *list = next;
        drop(list);
        self.wake.notify_one();
        Ok(())
    }

    /// Drops `leave` once the store took it. A failure to write the file
    /// is logged: the leave is then tried again after a restart, which
    /// changes nothing (the pod is no longer in the record).
    pub fn done(&self, leave: &Leave) {
        let mut list = lock(&self.list);
        let next: Vec<Leave> = list.iter().filter(|l| *l != leave).cloned().collect();
        if let Err(e) = self.persist(&next) {
            tracing::error!(error = %e, "cannot write the list of VM leaves");
        }
        *list = next;
    }

    /// Every waiting leave, oldest first.
    pub fn all(&self) -> Vec<Leave> {
        lock(&self.list).clone()
    }

    /// The waiting leaves of `vm`'s record.
    pub fn of(&self, vm: &VmKey) -> Vec<Leave> {
        lock(&self.list)
            .iter()
            .filter(|l| l.vm == *vm)
            .cloned()
            .collect()
    }

    /// Waits until a leave is pushed.
    pub async fn pushed(&self) {
        self.wake.notified().await;
    }

    fn persist(&self, list: &[Leave]) -> Result<()> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let io = |e: std::io::Error| Error::Io(format!("writing {}: {e}", path.display()));
        let dir = path.parent().unwrap_or(Path::new("."));
        if list.is_empty() {
            return match std::fs::remove_file(path) {
                Ok(()) => tether_store::store::sync_dir(dir).map_err(io),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(io(e)),
            };
        }
        let bytes = serde_json::to_vec_pretty(list)
            .map_err(|e| Error::Internal(format!("encoding the VM leaves: {e}")))?;
        let tmp = dir.join(format!(".{FILE}.tmp"));
        let mut f = std::fs::File::create(&tmp).map_err(io)?;
        f.write_all(&bytes).map_err(io)?;
        f.sync_all().map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)?;
        tether_store::store::sync_dir(dir).map_err(io)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leave(vm: &str, cid: &str) -> Leave {
        Leave {
            vm: VmKey::new("default", vm, "default").expect("a key"),
            attachment: AttachmentKey {
                network: "tether".into(),
                container_id: cid.into(),
                ifname: "eth0".into(),
            },
            ephemeral: false,
            queued_unix_ms: UnixMillis::now(),
        }
    }

    #[test]
    fn leaves_outlive_the_daemon_and_go_once_done() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let leaves = Leaves::open(Some(dir.path())).expect("no file yet");
        assert!(leaves.all().is_empty());
        let (a, b) = (leave("vm1", "c1"), leave("vm2", "c2"));
        leaves.push(a.clone()).expect("written");
        leaves.push(b.clone()).expect("written");
        leaves
            .push(a.clone())
            .expect("a second push of one leave is none");
        // A restart finds both, in order.
        let again = Leaves::open(Some(dir.path())).expect("the file reads back");
        assert_eq!(again.all(), [a.clone(), b.clone()]);
        assert_eq!(again.of(&a.vm), std::slice::from_ref(&a));
        again.done(&a);
        assert_eq!(
            Leaves::open(Some(dir.path())).expect("reads").all(),
            std::slice::from_ref(&b)
        );
        again.done(&b);
        assert!(
            !dir.path().join(FILE).exists(),
            "no file once nothing waits"
        );
    }

    #[test]
    fn a_file_that_is_no_list_stops_the_start_with_its_path() {
        let dir = tempfile::tempdir().expect("a temp dir");
        std::fs::write(dir.path().join(FILE), b"{").expect("written");
        let e = Leaves::open(Some(dir.path())).expect_err("refused");
        assert!(e.to_string().contains(FILE), "{e}");
    }
}
