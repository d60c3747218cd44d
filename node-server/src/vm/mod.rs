//! KubeVirt VMs on this node, as one component ([`Vms`]): the address
//! records in the control plane ([`records`]), placing a VM pod in its
//! record ([`placement`]), the pools' reservations of VM addresses
//! ([`reservations`]), the cutover of a live migration ([`cutover`]), what
//! the Kubernetes API reports about VM pods ([`signals`]) and the admin
//! calls ([`admin`]). The routes that follow the records are planned in
//! the routing module.
//!
//! The component owns its state (the records, the addresses they hold in
//! this node's pools, the migration targets waiting here, the cutover
//! counters) and talks to the kernel itself. What it needs of the node it
//! runs on (the local attachments, the pools, addresses for a new record,
//! the guest's welcome, a route resync, events on pods) it asks through
//! [`NodeSide`], which the attachment lifecycle implements and a test can
//! implement alone.
//!
//! The record in the control plane ([`records`]) is the authority on
//! where a VM's traffic goes. Every node derives its routes from it:
//! - the node of the active pod routes the VM's addresses to that pod's
//!   veth (protocol 201, like any pod);
//! - every other node routes them `via` that node (protocol 203), unless
//!   that node holds the addresses' block, whose route already goes there.
//!
//! A cutover therefore costs one compare-and-swap and one route change per
//! node, and the target node changes its own route before it writes the
//! record, the moment it sees the VM announce itself.

pub mod admin;
pub mod cutover;
pub mod leaving;
pub mod notices;
pub mod placement;
pub mod promotion;
pub mod records;
pub mod reservations;
pub mod signals;
#[cfg(test)]
mod tests;

pub use records::*;

use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tether_base::error::Result;
use tether_base::mac::Mac;
use tether_base::pod_event::{PodEvent, PodRef};
use tether_base::sync::lock;
use tether_base::time::UnixNanos;
use tether_cni::{Requested, VmPod};
use tether_ipam::Pools;
use tether_kernel::Kernel;
use tether_store::store::{Attachment, AttachmentKey};

/// The part a pod plays in its VM's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// It receives the VM's traffic.
    Active,
    /// A migration's target, wired but not routed to.
    Alternate,
}

/// Where a VM pod's ADD put it.
#[derive(Debug, Clone)]
pub(crate) struct Placement {
    /// The record as written.
    pub rec: VmRecord,
    /// This pod's part.
    pub role: Role,
    /// This ADD created the record (an undo deletes it).
    pub created: bool,
    /// This pod's entry in the record.
    pub this: VmAttachment,
}

/// A migration target on this node, waiting for its VM to announce itself.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct PendingTarget {
    pub vm: VmKey,
    pub attachment: AttachmentKey,
    pub ifindex: u32,
    /// The record's generation that made it the alternate: a view older
    /// than that must not drop it.
    pub generation: u64,
}

/// A migration target found in the records: VM, attachment, host veth, and
/// the record's generation.
pub type FoundTarget = (VmKey, AttachmentKey, String, u64);

/// What the VM component needs of the node it runs on. The attachment
/// lifecycle implements it; unit tests implement it alone, so that the
/// component is tested without a node.
pub trait NodeSide: Send + Sync {
    /// The local attachment under `key`.
    fn attachment(&self, key: &AttachmentKey) -> Option<Attachment>;

    /// The local attachments for which `keep` is true.
    fn attachments_where(&self, keep: &dyn Fn(&Attachment) -> bool) -> Vec<Attachment>;

    /// Runs `f` with the pools and the local attachments, both locked (in
    /// that order: attachments, then pools).
    fn with_pools<R>(
        &self,
        f: impl FnOnce(&mut Pools, &HashMap<AttachmentKey, Attachment>) -> R,
    ) -> R;

    /// The addresses of a VM's first record: the requested ones, and one
    /// of every other family from the pools.
    fn addresses_for(&self, req: &Requested) -> impl Future<Output = Result<Vec<IpAddr>>> + Send;

    /// Takes requested addresses from the pools, all or nothing.
    fn take_requested(&self, ips: &[IpAddr]) -> impl Future<Output = Result<()>> + Send;

    /// Fails if `mac` belongs to a local pod or a VM other than `vm`.
    fn check_mac_free(&self, mac: Mac, vm: Option<&VmKey>) -> Result<()>;

    /// The addresses in the status of the pod's IPAMClaim, when the daemon
    /// has the Kubernetes API and the claim holds some.
    fn claim_addresses(&self, pod: &VmPod) -> Result<Option<Vec<IpAddr>>>;

    /// The guest of `a` has just arrived here: tell it its router now.
    fn welcome_guest(&self, a: &Attachment);

    /// The next route pass programs `vm`'s routes even if the records did
    /// not change.
    fn resync_routes(&self, vm: &VmKey);

    /// Queues an event on a pod.
    fn pod_event(&self, pod: PodRef, event: PodEvent);

    /// Sends a cutover notice to every other node.
    fn send_notice(&self, notice: &notices::CutoverNotice);

    /// `vm`'s guest is about to be routed to its pod `a` on this node by
    /// a cutover: the translations toward it are pinned first, and its
    /// flows that waited for it take the place of this node's.
    fn before_local_route(&self, vm: &VmKey, a: &Attachment) -> impl Future<Output = ()> + Send;

    /// `vm`'s guest has just been routed to its pod `a` on this node by a
    /// cutover (its connections' handover takes over from here).
    fn arrived(&self, vm: &VmKey, a: &Attachment);
}

/// The VM component of one node: the records, and what the node keeps
/// beside them.
pub struct Vms {
    /// This node's name, as the records name it.
    node: String,
    kernel: Arc<dyn Kernel>,
    /// KubeVirt VM address records.
    records: Arc<VmRegistry>,
    /// Addresses of this node's pools that VM records hold, with the store
    /// revision they were known held at: they stay in use while no local
    /// pod has them, and are freed once a view at least that recent no
    /// longer shows them.
    held: Mutex<HashMap<IpAddr, i64>>,
    /// Migration targets on this node waiting for their VM's announcement,
    /// by the VM's MAC.
    pending: Mutex<HashMap<Mac, Vec<PendingTarget>>>,
    /// Cutover counters and timings.
    stats: Mutex<VmStats>,
    /// Promotions other nodes announced whose records have not settled.
    notices: Mutex<notices::NoticeTable>,
    /// Pods' leaves of their records that wait for the control store.
    leaves: leaving::Leaves,
}

impl Vms {
    /// The component of node `node`, which has seen no VM yet but may
    /// have `leaves` waiting from a former run.
    pub fn new(
        node: impl Into<String>,
        records: Arc<VmRegistry>,
        kernel: Arc<dyn Kernel>,
        leaves: leaving::Leaves,
    ) -> Self {
        Self {
            node: node.into(),
            kernel,
            records,
            held: Mutex::default(),
            pending: Mutex::default(),
            stats: Mutex::default(),
            notices: Mutex::default(),
            leaves,
        }
    }

    /// The pods' leaves of their records that wait for the control store.
    pub fn waiting_leaves(&self) -> Vec<leaving::Leave> {
        self.leaves.all()
    }

    /// This node's name.
    pub fn node_name(&self) -> &str {
        &self.node
    }

    /// The VM records.
    pub fn records(&self) -> &Arc<VmRegistry> {
        &self.records
    }

    /// Cutover counters and timings.
    pub fn stats(&self) -> VmStats {
        lock(&self.stats).clone()
    }

    /// Counts a pass whose route changes followed VMs: `updates` holds one
    /// timing per VM whose routes changed, the most recently cut-over one
    /// last.
    pub(crate) fn note_route_updates(&self, updates: Vec<RouteUpdateTiming>) {
        let Some(last) = updates.last().cloned() else {
            return;
        };
        let mut stats = lock(&self.stats);
        stats.route_updates += 1;
        stats.last_route_update = Some(last);
        for u in updates {
            push_recent(&mut stats.recent_route_updates, u);
        }
    }
}

/// How many route updates and cutovers [`VmStats`] keeps, most recent
/// last: enough for every VM of a mass migration at once.
pub const RECENT: usize = 4096;

/// Appends `item` to `list`, dropping the oldest beyond [`RECENT`].
pub(crate) fn push_recent<T>(list: &mut std::collections::VecDeque<T>, item: T) {
    if list.len() == RECENT {
        list.pop_front();
    }
    list.push_back(item);
}

/// Counters and timings of VM cutovers and route changes on this node.
#[derive(Debug, Clone, Default)]
pub struct VmStats {
    /// Cutovers this node made (it wrote the promotion).
    pub cutovers: u64,
    /// The last one.
    pub last_cutover: Option<CutoverTiming>,
    /// Passes in which this node changed routes because VMs moved.
    pub route_updates: u64,
    /// The last one's most recently cut-over VM.
    pub last_route_update: Option<RouteUpdateTiming>,
    /// The last [`RECENT`] cutovers made here, oldest first.
    pub recent_cutovers: std::collections::VecDeque<CutoverTiming>,
    /// The last [`RECENT`] route changes, one per VM and pass, oldest
    /// first (a pass that repointed many VMs at once gives each the same
    /// time).
    pub recent_route_updates: std::collections::VecDeque<RouteUpdateTiming>,
}

/// Timings of a cutover made here.
#[derive(Debug, Clone)]
pub struct CutoverTiming {
    /// The VM.
    pub vm: VmKey,
    /// What triggered it.
    pub trigger: Trigger,
    /// The record's generation after it.
    pub generation: u64,
    /// When the trigger was seen, ns since the epoch.
    pub seen_unix_nanos: UnixNanos,
    /// Trigger to the VM's route on this node, when the new active pod is
    /// local.
    pub local_route: Option<Duration>,
    /// Trigger to the record committed.
    pub committed: Duration,
}

/// Timing of a route change that followed a VM.
#[derive(Debug, Clone)]
pub struct RouteUpdateTiming {
    /// The VM.
    pub vm: VmKey,
    /// The record's generation the routes now follow.
    pub generation: u64,
    /// When the routes were in place, ns since the epoch.
    pub done_unix_nanos: UnixNanos,
    /// From the record's last cutover trigger (another node's clock, if
    /// another node promoted) to the routes in place here.
    pub since_trigger: Option<Duration>,
}

pub(crate) fn same(a: &VmAttachment, b: &VmAttachment) -> bool {
    a.is(&b.node, &b.network, &b.container_id, &b.ifname)
}
