//! KubeVirt VM address records: one per VM interface, in the control plane,
//! so that a VM keeps its IP and MAC when it live-migrates to another node
//! and when it is stopped and started again anywhere.
//!
//! A pod is a VM pod when its annotations (CNI `runtimeConfig`, capability
//! `io.kubernetes.cri.pod-annotations`) carry `kubevirt.io/domain`. The VM
//! key is (pod namespace, domain, interface). `vm.kubevirt.io/name` is
//! never used: it holds the guest's hostname, which need not be unique.
//!
//! Keys, under the configured prefix (default `/tether`):
//! - `v1/vms/<namespace>/<vm>/<interface>`: the record ([`VmRecord`], JSON).
//!   Every change is a compare-and-swap on the key's mod revision.
//! - `v1/vmaddrs/<ip>` and `v1/vmmacs/<mac>`: the VM key holding the
//!   address ([`AddressOwner`], JSON), so that two VMs can never be given
//!   one address even when two nodes create their records at the same
//!   moment.
//!
//! No store offers a transaction over several keys (the Kubernetes API
//! changes one object at a time), so a record and its index keys are
//! written in an order that keeps the one rule, an address has one VM,
//! whatever stops half way:
//! - create: each index key first, created only if absent (one that names
//!   another VM refuses the create, and the keys made so far are taken
//!   back), then the record, created only if absent;
//! - delete: the record first, by compare-and-swap, then each index key
//!   that still names the VM.
//!
//! So an index key may outlive its record (a crash between the steps, a
//! store that stopped answering), never the other way round. Such an
//! orphan names a VM with no record, or a record that does not hold the
//! address; a create that meets one older than [`ORPHAN_AGE`] deletes it
//! by compare-and-swap and goes on. Younger ones may belong to a create
//! under way, which gives up before it would write its record later than
//! [`CREATE_DEADLINE`] after its first index key.
//!
//! A record's addresses never change after it is created; its attachments
//! (the active pod and, during a migration, the alternate) do.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tether_base::error::{Error, Result};
use tether_base::mac::Mac;
use tether_base::time::{UnixMillis, UnixNanos};
use tether_store::control::{self, BoxFut, Cmp, ControlStore, Event, Follower, Kv, Op};
use tokio::sync::watch;

pub use tether_base::keys::{VmKey, CLAIM_INTERFACE};
pub use tether_base::kubevirt::{
    DOMAIN_ANNOTATION, MIGRATION_JOB_ANNOTATION, TARGET_READY_ANNOTATION,
};

/// One pod of a VM: where it is wired.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmAttachment {
    /// The node whose daemon wired it.
    pub node: String,
    /// The CNI network name.
    pub network: String,
    /// CNI_CONTAINERID.
    pub container_id: String,
    /// CNI_IFNAME.
    pub ifname: String,
    /// K8S_POD_NAME, when the runtime sent it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_name: Option<String>,
    /// K8S_POD_UID, when the runtime sent it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    /// When it was recorded (stored as ms since the epoch).
    pub since_unix_ms: UnixMillis,
}

impl VmAttachment {
    /// True when this is the attachment (network, container, ifname) on
    /// `node`.
    pub fn is(&self, node: &str, network: &str, container_id: &str, ifname: &str) -> bool {
        self.node == node
            && self.network == network
            && self.container_id == container_id
            && self.ifname == ifname
    }

    /// "pod ns/name (container c) on node n", for messages.
    pub fn describe(&self) -> String {
        let pod = self.pod_name.as_deref().unwrap_or("?");
        format!(
            "pod {pod} (container {}) on node {}",
            self.container_id, self.node
        )
    }
}

/// How a record's addresses were chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Origin {
    /// From a node's pool at the VM's first ADD.
    Allocated,
    /// Asked for at the first ADD (CNI_ARGS or runtimeConfig).
    Requested,
    /// Reserved ahead of time by the admin call `ReserveVmAddress`.
    Reserved,
}

impl Origin {
    /// The name shown to operators.
    pub fn name(self) -> &'static str {
        match self {
            Origin::Allocated => "allocated",
            Origin::Requested => "requested",
            Origin::Reserved => "reserved",
        }
    }
}

/// What made a node promote a migration's target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Trigger {
    /// A RARP from the VM's MAC on the target's host interface (QEMU's
    /// announcement after the VM resumed).
    Rarp,
    /// A gratuitous ARP from the VM's MAC on the target's host interface.
    Garp,
    /// The target pod's `kubevirt.io/migration-target-ready-timestamp`.
    Annotation,
    /// The admin call `Cutover`.
    Admin,
    /// The promoted target pod went away (deleted or failed) while its
    /// source still ran: a migration that failed after its cutover, seen
    /// through the Kubernetes API. The VM went back to its source.
    TargetFailed,
    /// A trigger this version does not know (written by a newer one).
    #[serde(other)]
    Other,
}

impl Trigger {
    /// Whether the trigger is the VM itself, seen on this node's veth (its
    /// announcement): then the VM runs here and its route goes in before
    /// the record is asked. Any other local trigger may be stale, and the
    /// record is asked first.
    pub fn proves_the_vm_runs_here(self) -> bool {
        matches!(self, Trigger::Rarp | Trigger::Garp)
    }

    /// The name shown to operators.
    pub fn name(self) -> &'static str {
        match self {
            Trigger::Rarp => "rarp",
            Trigger::Garp => "garp",
            Trigger::Annotation => "annotation",
            Trigger::Admin => "admin",
            Trigger::TargetFailed => "target-failed",
            Trigger::Other => "other",
        }
    }
}

/// The last cutover of a VM, as recorded with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CutoverInfo {
    /// What triggered it.
    pub trigger: Trigger,
    /// The node of the attachment that was active before, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_node: Option<String>,
    /// The node of the attachment made active.
    pub to_node: String,
    /// When the trigger was seen, ns since the epoch (the promoting node's
    /// clock). Every node times its route change from this.
    pub seen_unix_nanos: UnixNanos,
}

/// A VM interface's addresses and where its pods are.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmRecord {
    /// Which VM interface.
    pub key: VmKey,
    /// One address per family.
    pub ips: Vec<IpAddr>,
    /// The pod interface MAC, "0a:58:..", kept across pods.
    pub mac: Mac,
    /// How the addresses were chosen.
    pub origin: Origin,
    /// The pod that receives the VM's traffic, if any pod runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active: Option<VmAttachment>,
    /// A migration's target (before the cutover) or its source (after it,
    /// until the source pod is deleted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alternate: Option<VmAttachment>,
    /// Increases with every change.
    pub generation: u64,
    /// When the record was created (stored as ms since the epoch).
    pub created_unix_ms: UnixMillis,
    /// The last cutover.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_cutover: Option<CutoverInfo>,
}

impl VmRecord {
    /// The attachments that exist, active first.
    pub fn attachments(&self) -> impl Iterator<Item = &VmAttachment> {
        self.active.iter().chain(self.alternate.iter())
    }
}

/// The VM records as the watch last saw them.
#[derive(Debug, Clone, Default)]
pub struct VmView {
    /// Records and their mod revisions. Each record is shared: a copy of
    /// the view (a route pass takes one, an ADD another) copies the map,
    /// not every record's strings.
    pub records: BTreeMap<VmKey, (Arc<VmRecord>, i64)>,
    /// The store revision the view is current at.
    pub revision: i64,
    /// False until the first listing, and while the watch is broken.
    pub synced: bool,
}

impl VmView {
    /// The VM holding `ip`, if any.
    pub fn holder_of_ip(&self, ip: IpAddr) -> Option<&VmRecord> {
        self.records
            .values()
            .map(|(r, _)| r.as_ref())
            .find(|r| r.ips.contains(&ip))
    }

    /// The VM holding `mac`, if any.
    pub fn holder_of_mac(&self, mac: Mac) -> Option<&VmRecord> {
        self.records
            .values()
            .map(|(r, _)| r.as_ref())
            .find(|r| r.mac == mac)
    }
}

/// Why creating a record failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CreateRefused {
    /// A record of that key exists already.
    Exists,
    /// Another VM holds one of the addresses or the MAC.
    Taken {
        /// The address or MAC.
        what: String,
        /// The VM holding it.
        holder: String,
    },
}

/// What an index key (`vmaddrs/<ip>`, `vmmacs/<mac>`) holds: the VM the
/// address or MAC belongs to, and when the key was written. An index key
/// written before this format holds the VM key alone, and reads as
/// written at the epoch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AddressOwner {
    /// The VM key, `namespace/vm/interface`.
    pub vm: String,
    /// When the key was written (ms since the epoch).
    pub since_unix_ms: UnixMillis,
}

impl AddressOwner {
    fn parse(value: &[u8]) -> AddressOwner {
        serde_json::from_slice(value).unwrap_or_else(|_| AddressOwner {
            vm: String::from_utf8_lossy(value).into_owned(),
            since_unix_ms: UnixMillis::EPOCH,
        })
    }
}

/// How old an index key whose VM has no record (or a record without its
/// address) must be before a create may take it over: well above
/// [`CREATE_DEADLINE`] plus one request's timeout.
pub const ORPHAN_AGE: Duration = Duration::from_secs(120);

/// The latest a create writes its record after its first index key; later,
/// it takes its index keys back and fails (code 11), so that an index key
/// [`ORPHAN_AGE`] old is never one a create still needs.
pub const CREATE_DEADLINE: Duration = Duration::from_secs(30);

/// Key layout of the VM records.
#[derive(Debug, Clone)]
struct Keys {
    root: String,
}

impl Keys {
    fn new(prefix: &str) -> Keys {
        Keys {
            root: control::v1_root(prefix),
        }
    }
    fn records(&self) -> String {
        format!("{}vms/", self.root)
    }
    fn record(&self, key: &VmKey) -> String {
        format!(
            "{}{}/{}/{}",
            self.records(),
            key.namespace,
            key.vm,
            key.interface
        )
    }
    fn addr(&self, ip: IpAddr) -> String {
        format!("{}vmaddrs/{ip}", self.root)
    }
    fn mac(&self, mac: Mac) -> String {
        format!("{}vmmacs/{mac}", self.root)
    }
    fn parse(&self, key: &str) -> Option<VmKey> {
        let rest = key.strip_prefix(&self.records())?;
        let mut parts = rest.split('/');
        let (ns, vm, iface) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() {
            return None;
        }
        VmKey::new(ns, vm, iface).ok()
    }
}

/// What [`VmRegistry::hold`] found.
enum Held {
    /// The index key names this VM, as of this revision.
    Made(i64),
    /// Another VM holds it.
    By(String),
}

/// A VM key from its text form, `namespace/vm/interface` (the interface
/// may be [`CLAIM_INTERFACE`]).
fn parse_vm_key(text: &str) -> Option<VmKey> {
    let mut parts = text.splitn(3, '/');
    let (ns, vm, iface) = (parts.next()?, parts.next()?, parts.next()?);
    let mut key = VmKey::new(
        ns,
        vm,
        if iface == CLAIM_INTERFACE {
            "claim"
        } else {
            iface
        },
    )
    .ok()?;
    key.interface = iface.to_owned();
    Some(key)
}

fn to_json<T: Serialize>(v: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(v).map_err(|e| Error::Internal(e.to_string()))
}

/// The VM records of the control plane, and a view of them kept current by
/// a watch.
pub struct VmRegistry {
    store: Arc<dyn ControlStore>,
    keys: Keys,
    view: watch::Sender<VmView>,
}

impl VmRegistry {
    /// Lists the records and starts following them; waits while the
    /// control plane does not answer the first listing.
    pub async fn open(store: Arc<dyn ControlStore>, prefix: &str) -> Result<Arc<VmRegistry>> {
        let (view, _) = watch::channel(VmView::default());
        let registry = Arc::new(VmRegistry {
            store,
            keys: Keys::new(prefix),
            view,
        });
        let revision =
            control::until_answered("the first listing of VM records", || registry.relist())
                .await?;
        tokio::spawn(control::follow(
            registry.store.clone(),
            registry.keys.records(),
            revision,
            registry.clone(),
        ));
        Ok(registry)
    }

    /// The control plane the records live in, and the root of tether's
    /// keys there (named pools keep their blocks beside the records).
    pub fn control(&self) -> (Arc<dyn ControlStore>, String) {
        (self.store.clone(), self.keys.root.clone())
    }

    /// The latest view.
    pub fn view(&self) -> watch::Ref<'_, VmView> {
        self.view.borrow()
    }

    /// Notified on every change of the view.
    pub fn subscribe(&self) -> watch::Receiver<VmView> {
        self.view.subscribe()
    }

    async fn relist(&self) -> Result<i64> {
        let (kvs, revision) = self.store.list(&self.keys.records()).await?;
        let mut view = VmView {
            revision,
            synced: true,
            ..Default::default()
        };
        for kv in &kvs {
            self.put(&mut view, kv);
        }
        view.revision = revision;
        self.view.send_replace(view);
        Ok(revision)
    }

    fn put(&self, view: &mut VmView, kv: &Kv) {
        view.revision = view.revision.max(kv.mod_revision);
        let Some(key) = self.keys.parse(&kv.key) else {
            tracing::warn!(key = %kv.key, "ignoring a VM record under a malformed key");
            return;
        };
        match serde_json::from_slice::<VmRecord>(&kv.value) {
            Ok(rec) if rec.key == key => {
                view.records.insert(key, (Arc::new(rec), kv.mod_revision));
            }
            Ok(_) | Err(_) => tracing::warn!(key = %kv.key, "ignoring a malformed VM record"),
        }
    }

    /// Reads one record from the control plane (not the view): the base of
    /// a compare-and-swap.
    pub async fn read(&self, key: &VmKey) -> Result<Option<(VmRecord, i64)>> {
        let path = self.keys.record(key);
        let (kvs, _) = self.store.list(&path).await?;
        let Some(kv) = kvs.into_iter().find(|kv| kv.key == path) else {
            return Ok(None);
        };
        let rec: VmRecord = serde_json::from_slice(&kv.value)
            .map_err(|e| Error::Store(format!("malformed VM record {path}: {e}")))?;
        Ok(Some((rec, kv.mod_revision)))
    }

    /// The record in the view, with its mod revision.
    pub fn cached(&self, key: &VmKey) -> Option<(VmRecord, i64)> {
        self.view
            .borrow()
            .records
            .get(key)
            .map(|(r, rev)| (VmRecord::clone(r), *rev))
    }

    /// Creates a record and its address and MAC index keys: the index keys
    /// first, then the record (see the module's doc). Returns the record's
    /// revision.
    pub async fn create(&self, rec: &VmRecord) -> Result<std::result::Result<i64, CreateRefused>> {
        let started = Instant::now();
        let mut index = Vec::with_capacity(rec.ips.len() + 1);
        for ip in &rec.ips {
            index.push((ip.to_string(), self.keys.addr(*ip)));
        }
        index.push((rec.mac.to_string(), self.keys.mac(rec.mac)));
        let mut made: Vec<(String, i64)> = Vec::new();
        for (what, key) in &index {
            match self.hold(rec, key).await {
                Ok(Held::Made(rev)) => made.push((key.clone(), rev)),
                Ok(Held::By(holder)) => {
                    self.unhold(&made).await;
                    return Ok(Err(CreateRefused::Taken {
                        what: what.clone(),
                        holder,
                    }));
                }
                Err(e) => {
                    self.unhold(&made).await;
                    return Err(e);
                }
            }
        }
        if started.elapsed() > CREATE_DEADLINE {
            self.unhold(&made).await;
            return Err(Error::TryAgain(format!(
                "creating VM {}'s record took longer than {CREATE_DEADLINE:?}; try again",
                rec.key
            )));
        }
        let path = self.keys.record(&rec.key);
        let put = Op::Put {
            key: path.clone(),
            value: to_json(rec)?,
            lease: None,
        };
        match self
            .store
            .commit(vec![Cmp::Absent(path)], vec![put])
            .await?
        {
            Some(rev) => Ok(Ok(rev)),
            None => {
                // The VM has a record: the index keys it holds stay (a
                // node creating the same VM's record may have taken over
                // ours), the others go. If it cannot be read, all stay.
                if let Ok(Some((existing, _))) = self.read(&rec.key).await {
                    let theirs = self.index_keys(&existing);
                    made.retain(|(k, _)| !theirs.contains(k));
                    self.unhold(&made).await;
                }
                Ok(Err(CreateRefused::Exists))
            }
        }
    }

    /// The index keys of a record: one per address, and the MAC's.
    fn index_keys(&self, rec: &VmRecord) -> Vec<String> {
        let mut keys: Vec<String> = rec.ips.iter().map(|ip| self.keys.addr(*ip)).collect();
        keys.push(self.keys.mac(rec.mac));
        keys
    }

    /// Makes index key `key` name `rec`'s VM, if no other VM holds it, and
    /// returns its revision. A key that names this VM already (left by an
    /// earlier attempt, or written by a node creating the same VM's record
    /// at this moment) is written again, so that the other creator cannot
    /// take it back from under this one. An orphan ([`ORPHAN_AGE`] old,
    /// its VM without a record that holds the address) is taken over.
    async fn hold(&self, rec: &VmRecord, key: &str) -> Result<Held> {
        let mine = rec.key.to_string();
        let value = to_json(&AddressOwner {
            vm: mine.clone(),
            since_unix_ms: UnixMillis::now(),
        })?;
        let put = || Op::Put {
            key: key.to_owned(),
            value: value.clone(),
            lease: None,
        };
        for _attempt in 0..4 {
            if let Some(rev) = self
                .store
                .commit(vec![Cmp::Absent(key.to_owned())], vec![put()])
                .await?
            {
                return Ok(Held::Made(rev));
            }
            let (kvs, _) = self.store.list(key).await?;
            let Some(kv) = kvs.into_iter().find(|kv| kv.key == key) else {
                // Deleted meanwhile: try again.
                continue;
            };
            let owner = AddressOwner::parse(&kv.value);
            let guard = vec![Cmp::Unchanged(key.to_owned(), kv.mod_revision)];
            if owner.vm == mine {
                if let Some(rev) = self.store.commit(guard, vec![put()]).await? {
                    return Ok(Held::Made(rev));
                }
                continue;
            }
            if !self.is_orphan(key, &owner).await? {
                return Ok(Held::By(owner.vm));
            }
            tracing::warn!(%key, vm = %owner.vm, "taking over an index key whose VM has no record holding it");
            self.store
                .commit(guard, vec![Op::Delete(key.to_owned())])
                .await?;
        }
        Err(Error::TryAgain(format!(
            "index key {key} kept changing; try again"
        )))
    }

    /// Whether index key `key`, held by `owner`, is an orphan: old enough,
    /// and its VM has no record, or one that does not hold the address.
    async fn is_orphan(&self, key: &str, owner: &AddressOwner) -> Result<bool> {
        let age = UnixMillis::now()
            .as_millis()
            .saturating_sub(owner.since_unix_ms.as_millis());
        if u128::from(age) < ORPHAN_AGE.as_millis() {
            return Ok(false);
        }
        let Some(vm) = parse_vm_key(&owner.vm) else {
            return Ok(true);
        };
        Ok(match self.read(&vm).await? {
            None => true,
            Some((rec, _)) => {
                !(rec.ips.iter().any(|ip| self.keys.addr(*ip) == key)
                    || self.keys.mac(rec.mac) == key)
            }
        })
    }

    /// Deletes the index keys a create made before it was refused, each
    /// only if unchanged. What cannot be deleted now is an orphan, for a
    /// later create to take over.
    async fn unhold(&self, made: &[(String, i64)]) {
        for (key, rev) in made {
            let undo = self
                .store
                .commit(
                    vec![Cmp::Unchanged(key.clone(), *rev)],
                    vec![Op::Delete(key.clone())],
                )
                .await;
            if let Err(e) = undo {
                tracing::warn!(%key, error = %e, "cannot take back an index key of a refused VM record; a later create takes it over");
            }
        }
    }

    /// Replaces a record if it is unchanged since `rev`. Returns the commit's
    /// revision, `None` if it changed.
    pub async fn replace(&self, rec: &VmRecord, rev: i64) -> Result<Option<i64>> {
        let path = self.keys.record(&rec.key);
        self.store
            .commit(
                vec![Cmp::Unchanged(path.clone(), rev)],
                vec![Op::Put {
                    key: path,
                    value: to_json(rec)?,
                    lease: None,
                }],
            )
            .await
            .map_err(Error::from)
    }

    /// Deletes a record if it is unchanged since `rev`, then the index keys
    /// that still name it. Returns the record's deletion revision.
    pub async fn delete(&self, rec: &VmRecord, rev: i64) -> Result<Option<i64>> {
        let path = self.keys.record(&rec.key);
        let Some(deleted) = self
            .store
            .commit(
                vec![Cmp::Unchanged(path.clone(), rev)],
                vec![Op::Delete(path)],
            )
            .await?
        else {
            return Ok(None);
        };
        // Each index key that still names the VM and is older than the
        // deletion: a younger one is a new record's of the same VM.
        let mine = rec.key.to_string();
        for key in self.index_keys(rec) {
            let released: Result<()> = async {
                let (kvs, _) = self.store.list(&key).await?;
                if let Some(kv) = kvs.into_iter().find(|kv| kv.key == key) {
                    if AddressOwner::parse(&kv.value).vm == mine && kv.mod_revision < deleted {
                        self.store
                            .commit(
                                vec![Cmp::Unchanged(key.clone(), kv.mod_revision)],
                                vec![Op::Delete(key.clone())],
                            )
                            .await?;
                    }
                }
                Ok(())
            }
            .await;
            if let Err(e) = released {
                tracing::warn!(%key, error = %e, "cannot delete the index key of a deleted VM record; a later create takes it over");
            }
        }
        Ok(Some(deleted))
    }

    /// Changes a record by compare-and-swap: reads it (from the view first,
    /// then from the store after a lost race), lets `change` edit it, and
    /// writes it back with the generation increased. `change` returns
    /// `Ok(false)` to leave the record as it is. Returns the record as
    /// written (or found) and the commit's revision (None if unchanged).
    pub async fn update<F>(&self, key: &VmKey, mut change: F) -> Result<(VmRecord, Option<i64>)>
    where
        F: FnMut(&mut VmRecord) -> Result<bool>,
    {
        let mut base = self.cached(key);
        for _attempt in 0..16 {
            let (mut rec, rev, fresh) = match base.take() {
                Some((r, v)) => (r, v, false),
                None => {
                    let (r, v) = self
                        .read(key)
                        .await?
                        .ok_or_else(|| Error::UnknownVm(key.to_string()))?;
                    (r, v, true)
                }
            };
            // The view may lag behind the store (a change this node just
            // wrote): only a fresh read may decide that nothing is to do.
            match change(&mut rec) {
                Ok(true) => {}
                Ok(false) if fresh => return Ok((rec, None)),
                Err(e) if fresh => return Err(e),
                Ok(false) | Err(_) => continue,
            }
            rec.generation += 1;
            if let Some(committed) = self.replace(&rec, rev).await? {
                return Ok((rec, Some(committed)));
            }
        }
        Err(Error::TryAgain(format!(
            "VM record {key} kept changing under 16 attempts to update it"
        )))
    }
}

/// The view of VM records follows `v1/vms/`.
impl Follower for VmRegistry {
    fn apply(&self, events: &[Event]) {
        self.view.send_modify(|v| {
            for e in events {
                match e {
                    Event::Put(kv) => self.put(v, kv),
                    Event::Delete { key, mod_revision } => {
                        v.revision = v.revision.max(*mod_revision);
                        if let Some(k) = self.keys.parse(key) {
                            v.records.remove(&k);
                        }
                    }
                }
            }
        });
    }

    fn mark_stale(&self) {
        self.view.send_modify(|v| v.synced = false);
    }

    fn list_again(&self) -> BoxFut<'_, i64, Error> {
        Box::pin(self.relist())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tether_store::control::embedded::EmbeddedStore;

    fn record(name: &str, ip: &str, mac: &str) -> VmRecord {
        VmRecord {
            key: VmKey::new("ns", name, "eth0").unwrap(),
            ips: vec![ip.parse().unwrap()],
            mac: mac.parse().expect("test MAC"),
            origin: Origin::Allocated,
            active: None,
            alternate: None,
            generation: 1,
            created_unix_ms: UnixMillis::from_millis(1),
            last_cutover: None,
        }
    }

    async fn registry() -> (tempfile::TempDir, Arc<VmRegistry>) {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn ControlStore> = Arc::new(EmbeddedStore::open(dir.path()).unwrap());
        let reg = VmRegistry::open(store, "/tether").await.unwrap();
        (dir, reg)
    }

    async fn until(reg: &VmRegistry, f: impl Fn(&VmView) -> bool) {
        for _ in 0..200 {
            if f(&reg.view()) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("the view never caught up");
    }

    #[test]
    fn keys_are_checked_and_parse_back() {
        assert!(VmKey::new("", "vm", "eth0").is_err());
        assert!(VmKey::new("ns", "a/b", "eth0").is_err());
        assert!(VmKey::new("ns", "vm", &"x".repeat(254)).is_err());
        let k = VmKey::new("ns", "vm", "eth0").unwrap();
        let keys = Keys::new("/tether/");
        assert_eq!(keys.record(&k), "/tether/v1/vms/ns/vm/eth0");
        assert_eq!(keys.parse(&keys.record(&k)), Some(k));
        assert_eq!(keys.parse("/tether/v1/vms/ns/vm"), None);
        assert_eq!(keys.parse("/tether/v1/vms/ns/vm/eth0/x"), None);
        assert_eq!(
            keys.mac("0A:58:00:00:00:01".parse().expect("test MAC")),
            "/tether/v1/vmmacs/0a:58:00:00:00:01"
        );
    }

    #[tokio::test]
    async fn create_refuses_taken_keys_addresses_and_macs_naming_the_holder() {
        let (_dir, reg) = registry().await;
        let a = record("a", "10.0.0.5", "0a:58:0a:00:00:05");
        assert!(reg.create(&a).await.unwrap().is_ok());
        assert_eq!(reg.create(&a).await.unwrap(), Err(CreateRefused::Exists));
        let same_ip = record("b", "10.0.0.5", "0a:58:0a:00:00:99");
        assert_eq!(
            reg.create(&same_ip).await.unwrap(),
            Err(CreateRefused::Taken {
                what: "10.0.0.5".into(),
                holder: "ns/a/eth0".into()
            })
        );
        let same_mac = record("c", "10.0.0.6", "0A:58:0A:00:00:05");
        assert_eq!(
            reg.create(&same_mac).await.unwrap(),
            Err(CreateRefused::Taken {
                what: "0a:58:0a:00:00:05".into(),
                holder: "ns/a/eth0".into()
            })
        );
        // Deleting frees the key, the address and the MAC.
        until(&reg, |v| v.records.len() == 1).await;
        let (rec, rev) = reg.cached(&a.key).unwrap();
        assert!(reg.delete(&rec, rev).await.unwrap().is_some());
        assert!(reg.create(&same_ip).await.unwrap().is_ok());
        assert!(reg.create(&same_mac).await.is_ok());
    }

    #[tokio::test]
    async fn updates_are_compare_and_swap_and_bump_the_generation() {
        let (_dir, reg) = registry().await;
        let a = record("a", "10.0.0.5", "0a:58:0a:00:00:05");
        reg.create(&a).await.unwrap().unwrap();
        until(&reg, |v| v.records.contains_key(&a.key)).await;
        // A write behind the view's back makes the cached revision stale:
        // the update must lose that race, read again, and still apply.
        let (mut sneaky, rev) = reg.read(&a.key).await.unwrap().unwrap();
        sneaky.mac = "0a:58:0a:00:00:05".parse().expect("test MAC");
        sneaky.generation = 7;
        assert!(reg.replace(&sneaky, rev).await.unwrap().is_some());
        assert!(
            reg.replace(&sneaky, rev).await.unwrap().is_none(),
            "stale rev"
        );
        let (rec, committed) = reg
            .update(&a.key, |r| {
                r.active = Some(VmAttachment {
                    node: "n1".into(),
                    network: "net".into(),
                    container_id: "c1".into(),
                    ifname: "eth0".into(),
                    pod_name: None,
                    pod_uid: None,
                    since_unix_ms: UnixMillis::EPOCH,
                });
                Ok(true)
            })
            .await
            .unwrap();
        assert!(committed.is_some());
        assert_eq!(rec.generation, 8);
        until(&reg, |v| {
            v.records
                .get(&a.key)
                .is_some_and(|(r, _)| r.generation == 8 && r.active.is_some())
        })
        .await;
        // No change, no write.
        let (_, none) = reg.update(&a.key, |_| Ok(false)).await.unwrap();
        assert_eq!(none, None);
        let missing = VmKey::new("ns", "nope", "eth0").unwrap();
        assert!(matches!(
            reg.update(&missing, |_| Ok(true)).await,
            Err(Error::UnknownVm(_))
        ));
    }

    /// The index key of `what` (an address or a MAC) as the store has it.
    async fn index(reg: &VmRegistry, key: &str) -> Option<AddressOwner> {
        let (kvs, _) = reg.store.list(key).await.unwrap();
        kvs.iter()
            .find(|kv| kv.key == key)
            .map(|kv| AddressOwner::parse(&kv.value))
    }

    #[tokio::test]
    async fn a_refused_create_takes_back_the_index_keys_it_made_and_only_those() {
        let (_dir, reg) = registry().await;
        let a = record("a", "10.0.0.5", "0a:58:0a:00:00:05");
        reg.create(&a).await.unwrap().unwrap();
        // b's address is free, its MAC is a's: refused at the MAC, after
        // its address key was made; that key goes again.
        let b = record("b", "10.0.0.6", "0a:58:0a:00:00:05");
        assert!(matches!(
            reg.create(&b).await.unwrap(),
            Err(CreateRefused::Taken { .. })
        ));
        let keys = Keys::new("/tether");
        let ip6: IpAddr = "10.0.0.6".parse().unwrap();
        assert_eq!(index(&reg, &keys.addr(ip6)).await, None);
        // a's record exists: a second create of a is refused, and a's
        // index keys stay, naming a.
        assert_eq!(reg.create(&a).await.unwrap(), Err(CreateRefused::Exists));
        for key in reg.index_keys(&a) {
            assert_eq!(
                index(&reg, &key).await.map(|o| o.vm),
                Some("ns/a/eth0".to_owned()),
                "{key}"
            );
        }
        // A create of a with another address (a second pod that allocated
        // elsewhere) takes back its new key, not a's.
        let a_elsewhere = record("a", "10.0.0.7", "0a:58:0a:00:00:07");
        assert_eq!(
            reg.create(&a_elsewhere).await.unwrap(),
            Err(CreateRefused::Exists)
        );
        let ip7: IpAddr = "10.0.0.7".parse().unwrap();
        assert_eq!(index(&reg, &keys.addr(ip7)).await, None);
        assert!(index(&reg, &keys.addr("10.0.0.5".parse().unwrap()))
            .await
            .is_some());
    }

    #[tokio::test]
    async fn an_orphaned_index_key_is_taken_over_once_old_and_never_while_young() {
        let (_dir, reg) = registry().await;
        let keys = Keys::new("/tether");
        let ip: IpAddr = "10.0.0.5".parse().unwrap();
        let orphan = |since: UnixMillis| Op::Put {
            key: keys.addr(ip),
            value: to_json(&AddressOwner {
                vm: "ns/gone/eth0".into(),
                since_unix_ms: since,
            })
            .unwrap(),
            lease: None,
        };
        // Young: it may be a create under way on another node.
        assert!(reg
            .store
            .txn(vec![], vec![orphan(UnixMillis::now())])
            .await
            .unwrap());
        let b = record("b", "10.0.0.5", "0a:58:0a:00:00:05");
        assert_eq!(
            reg.create(&b).await.unwrap(),
            Err(CreateRefused::Taken {
                what: "10.0.0.5".into(),
                holder: "ns/gone/eth0".into()
            })
        );
        // Old, and its VM has no record: taken over.
        let old = UnixMillis::from_millis(
            UnixMillis::now().as_millis() - ORPHAN_AGE.as_millis() as u64 - 1000,
        );
        assert!(reg.store.txn(vec![], vec![orphan(old)]).await.unwrap());
        assert!(reg.create(&b).await.unwrap().is_ok());
        assert_eq!(
            index(&reg, &keys.addr(ip)).await.map(|o| o.vm),
            Some("ns/b/eth0".to_owned())
        );
        // A key written before this format holds the VM key alone and reads
        // as old: b's record does not hold this MAC, so it is an orphan.
        let mac: Mac = "0a:58:0a:00:00:09".parse().expect("test MAC");
        let legacy = Op::Put {
            key: keys.mac(mac),
            value: b"ns/b/eth0".to_vec(),
            lease: None,
        };
        assert!(reg.store.txn(vec![], vec![legacy]).await.unwrap());
        let c = record("c", "10.0.0.9", "0a:58:0a:00:00:09");
        assert!(reg.create(&c).await.unwrap().is_ok());
        assert_eq!(
            index(&reg, &keys.mac(mac)).await.map(|o| o.vm),
            Some("ns/c/eth0".to_owned())
        );
        // One that b's record does hold is no orphan, however old.
        let held = Op::Put {
            key: keys.mac(b.mac),
            value: b"ns/b/eth0".to_vec(),
            lease: None,
        };
        assert!(reg.store.txn(vec![], vec![held]).await.unwrap());
        let d = record("d", "10.0.0.10", "0a:58:0a:00:00:05");
        assert!(matches!(
            reg.create(&d).await.unwrap(),
            Err(CreateRefused::Taken { .. })
        ));
    }
}
