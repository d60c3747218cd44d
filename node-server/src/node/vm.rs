//! KubeVirt VM pods on this node: placing a pod in its VM's address record,
//! the cutover of a live migration, routes that follow the record, and the
//! requested-address checks that plain pods share.
//!
//! The record in the control plane ([`crate::vm`]) is the authority on
//! where a VM's traffic goes. Every node derives its routes from it:
//! - the node of the active pod routes the VM's addresses to that pod's
//!   veth (protocol 201, like any pod);
//! - every other node routes them `via` that node (protocol 203), unless
//!   that node holds the addresses' block, whose route already goes there.
//!
//! A cutover therefore costs one compare-and-swap and one route change per
//! node, and the target node changes its own route before it writes the
//! record, the moment it sees the VM announce itself.

use super::{lock, Node};
use crate::cni::{Invocation, VmAddressPolicy};
use crate::dataplane::{self, AnnounceKind, AnnounceListener, ClusterRoute};
use crate::error::{Error, Result};
use crate::ipam::{Family, Take};
use crate::mac::Mac;
use crate::store::{Attachment, AttachmentKey};
use crate::time::{UnixMillis, UnixNanos};
use crate::vm::{
    CreateRefused, CutoverInfo, Origin, Trigger, VmAttachment, VmKey, VmRecord, VmView,
    DOMAIN_ANNOTATION, MIGRATION_JOB_ANNOTATION, TARGET_READY_ANNOTATION,
};
use ipnet::IpNet;
use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A VM pod as its ADD describes it.
#[derive(Debug, Clone)]
pub(super) struct VmPod {
    /// (namespace, VM, interface).
    pub key: VmKey,
    /// The pod is a migration's target (`kubevirt.io/migrationJobName`).
    pub target: bool,
    /// The target pod is marked ready
    /// (`kubevirt.io/migration-target-ready-timestamp`).
    pub ready: bool,
}

/// Reads the VM identity from the pod annotations of `runtimeConfig`.
/// `None` for a pod that is not a KubeVirt VM pod.
pub(super) fn vm_pod(inv: &Invocation) -> Result<Option<VmPod>> {
    let ann = &inv.conf.runtime_config.pod_annotations;
    let Some(domain) = ann.get(DOMAIN_ANNOTATION).filter(|d| !d.is_empty()) else {
        return Ok(None);
    };
    let namespace = inv
        .args
        .pod_namespace
        .as_deref()
        .ok_or_else(|| Error::InvalidEnv {
            var: "CNI_ARGS",
            reason: format!(
                "the pod of KubeVirt VM {domain:?} ({DOMAIN_ANNOTATION}) has no K8S_POD_NAMESPACE, \
                 which keys the VM's address record"
            ),
        })?;
    let set = |name: &str| ann.get(name).is_some_and(|v| !v.is_empty());
    Ok(Some(VmPod {
        key: VmKey::new(namespace, domain, &inv.ifname)?,
        target: set(MIGRATION_JOB_ANNOTATION),
        ready: set(TARGET_READY_ANNOTATION),
    }))
}

/// Addresses and a MAC asked for by the runtime.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Requested {
    /// At most one per family.
    pub ips: Vec<IpAddr>,
    /// The pod interface MAC.
    pub mac: Option<Mac>,
}

/// Parses "10.1.2.3" or "10.1.2.3/24" (the prefix is the pod's business:
/// tether routes /32 and /128).
fn parse_ip(s: &str, what: &str) -> Result<IpAddr> {
    let s = s.trim();
    s.parse::<IpAddr>()
        .or_else(|_| s.parse::<IpNet>().map(|n| n.addr()))
        .map_err(|_| Error::InvalidConfig(format!("{what}: {s:?} is not an IP address")))
}

/// The addresses and MAC of CNI_ARGS `IP=`/`MAC=` and `runtimeConfig`
/// `ips`/`mac`. Both sources may be given if they agree.
pub(super) fn requested(inv: &Invocation) -> Result<Requested> {
    let mut from_args = Vec::new();
    if let Some(list) = &inv.args.ip {
        for part in list.split(',').filter(|p| !p.is_empty()) {
            from_args.push(parse_ip(part, "CNI_ARGS IP")?);
        }
    }
    let rc = &inv.conf.runtime_config;
    let mut from_rc = Vec::new();
    for s in &rc.ips {
        from_rc.push(parse_ip(s, "runtimeConfig.ips")?);
    }
    let ips = match (from_args.is_empty(), from_rc.is_empty()) {
        (true, _) => from_rc,
        (false, true) => from_args,
        (false, false) => {
            let (mut a, mut b) = (from_args.clone(), from_rc.clone());
            a.sort();
            b.sort();
            if a != b {
                return Err(Error::InvalidConfig(format!(
                    "CNI_ARGS IP={} and runtimeConfig.ips {:?} ask for different addresses",
                    inv.args.ip.as_deref().unwrap_or_default(),
                    rc.ips
                )));
            }
            from_rc
        }
    };
    for f in [Family::V4, Family::V6] {
        if ips.iter().filter(|ip| Family::of_ip(**ip) == f).count() > 1 {
            return Err(Error::InvalidConfig(format!(
                "more than one {} address requested: a pod gets one per family",
                f.name()
            )));
        }
    }
    let macs: Vec<Mac> = [
        inv.args.mac.as_ref().map(|m| m.for_pod("CNI_ARGS MAC")),
        rc.mac.as_ref().map(|m| m.for_pod("runtimeConfig.mac")),
    ]
    .into_iter()
    .flatten()
    .collect::<Result<_>>()?;
    if macs.len() == 2 && macs[0] != macs[1] {
        return Err(Error::InvalidConfig(
            "CNI_ARGS MAC and runtimeConfig.mac ask for different MACs".into(),
        ));
    }
    Ok(Requested {
        ips,
        mac: macs.first().copied(),
    })
}

/// The part a pod plays in its VM's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    /// It receives the VM's traffic.
    Active,
    /// A migration's target, wired but not routed to.
    Alternate,
}

/// Where a VM pod's ADD put it.
#[derive(Debug, Clone)]
pub(super) struct Placement {
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
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct PendingTarget {
    pub vm: VmKey,
    pub attachment: AttachmentKey,
    pub ifindex: u32,
    /// The record's generation that made it the alternate: a view older
    /// than that must not drop it.
    pub generation: u64,
}

/// A migration target found in the records: VM, attachment, host veth, and
/// the record's generation.
type FoundTarget = (VmKey, AttachmentKey, String, u64);

/// How this node routes one VM's addresses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Want {
    /// To a local pod's veth.
    here: Option<String>,
    /// To other nodes (proto 203).
    via: Vec<ClusterRoute>,
}

/// Counters and timings of VM cutovers and route changes on this node.
#[derive(Debug, Clone, Default)]
pub struct VmStats {
    /// Cutovers this node made (it wrote the promotion).
    pub cutovers: u64,
    /// The last one.
    pub last_cutover: Option<CutoverTiming>,
    /// Route changes this node made because a VM moved.
    pub route_updates: u64,
    /// The last one.
    pub last_route_update: Option<RouteUpdateTiming>,
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

fn same(a: &VmAttachment, b: &VmAttachment) -> bool {
    a.is(&b.node, &b.network, &b.container_id, &b.ifname)
}

fn host_net(ip: IpAddr) -> IpNet {
    IpNet::from(ip)
}

impl Node {
    /// The VM records.
    pub fn vms(&self) -> &Arc<crate::vm::VmRegistry> {
        &self.vms
    }

    /// Cutover counters and timings.
    pub fn vm_stats(&self) -> VmStats {
        lock(&self.vm_stats).clone()
    }

    /// True when the node should route the attachment's addresses to it:
    /// every plain pod, and a VM pod that its record names active.
    pub(super) fn routed_here(&self, a: &Attachment) -> bool {
        let Some(key) = &a.vm else {
            return true;
        };
        let view = self.vms.view();
        view.records
            .get(key)
            .and_then(|(r, _)| r.active.as_ref())
            .is_some_and(|x| {
                x.is(
                    &self.config.name,
                    &a.key.network,
                    &a.key.container_id,
                    &a.key.ifname,
                )
            })
    }

    fn this_attachment(&self, inv: &Invocation) -> VmAttachment {
        VmAttachment {
            node: self.config.name.clone(),
            network: inv.conf.name.clone(),
            container_id: inv.container_id.clone(),
            ifname: inv.ifname.clone(),
            pod_name: inv.args.pod_name.clone(),
            pod_uid: inv.args.pod_uid.clone(),
            since_unix_ms: UnixMillis::now(),
        }
    }

    /// Who holds `ip` on this node, for an error message.
    fn holder_of(&self, ip: IpAddr) -> String {
        if let Some(a) = lock(&self.attachments)
            .values()
            .find(|a| a.ips.contains(&ip))
        {
            let pod = match (&a.pod_namespace, &a.pod_name) {
                (Some(ns), Some(n)) => format!(" (pod {ns}/{n})"),
                _ => String::new(),
            };
            return match &a.vm {
                Some(vm) => format!("{ip} is held by VM {vm}{pod}"),
                None => format!("{ip} is held by attachment {}{pod}", a.key),
            };
        }
        if let Some(r) = self.vms.view().holder_of_ip(ip) {
            return format!("{ip} is held by VM {}", r.key);
        }
        format!("{ip} is being given to another pod at this moment")
    }

    /// Fails if `mac` belongs to a local pod or a VM other than `vm`.
    fn check_mac_free(&self, mac: &str, vm: Option<&VmKey>) -> Result<()> {
        if let Some(a) = lock(&self.attachments)
            .values()
            .find(|a| a.mac.eq_ignore_ascii_case(mac) && (a.vm.is_none() || a.vm.as_ref() != vm))
        {
            return Err(Error::AddressInUse(match &a.vm {
                Some(holder) => format!("MAC {mac} is held by VM {holder} (attachment {})", a.key),
                None => format!("MAC {mac} is held by attachment {}", a.key),
            }));
        }
        if let Some(r) = self.vms.view().holder_of_mac(mac) {
            if Some(&r.key) != vm {
                return Err(Error::AddressInUse(format!(
                    "MAC {mac} is held by VM {}",
                    r.key
                )));
            }
        }
        Ok(())
    }

    /// Returns VM addresses (or addresses taken for a VM or a request) to
    /// the pools unless a VM record or another local pod of a VM still
    /// holds them. A plain pod's DEL frees its addresses directly.
    pub(super) fn free_ips(&self, ips: &[IpAddr]) {
        let attachments = lock(&self.attachments);
        let mut pools = lock(&self.pools);
        let held = lock(&self.vm_held);
        let free: Vec<IpAddr> = ips
            .iter()
            .copied()
            .filter(|ip| {
                !held.contains_key(ip)
                    && !attachments
                        .values()
                        .any(|a| a.vm.is_some() && a.ips.contains(ip))
            })
            .collect();
        pools.release(&free);
    }

    /// Records that a VM record written at `revision` holds these of our
    /// pool addresses (before the watch reports it).
    fn mark_vm_held(&self, ips: &[IpAddr], revision: i64) {
        let pools = lock(&self.pools);
        let mut held = lock(&self.vm_held);
        for &ip in ips.iter().filter(|ip| pools.contains(**ip)) {
            let e = held.entry(ip).or_insert(revision);
            *e = (*e).max(revision);
        }
    }

    /// Keeps the pools in step with the VM records: an address of our blocks
    /// that a record holds is in use even when no local pod has it (the VM
    /// runs elsewhere, or nowhere); it is freed once the record is gone.
    pub(super) fn sync_reservations(&self, view: &VmView) {
        if !view.synced {
            return;
        }
        let attachments = lock(&self.attachments);
        let mut pools = lock(&self.pools);
        let mut held = lock(&self.vm_held);
        let want: HashSet<IpAddr> = view
            .records
            .values()
            .flat_map(|(r, _)| r.ips.iter().copied())
            .filter(|ip| pools.contains(*ip))
            .collect();
        for &ip in &want {
            if pools.take(ip) == Take::InUse && !held.contains_key(&ip) {
                if let Some(a) = attachments
                    .values()
                    .find(|a| a.vm.is_none() && a.ips.contains(&ip))
                {
                    tracing::error!(%ip, attachment = %a.key, "a VM record holds the address of a local pod");
                }
            }
            let e = held.entry(ip).or_insert(view.revision);
            *e = (*e).max(view.revision);
        }
        let gone: Vec<IpAddr> = held
            .iter()
            .filter(|(ip, rev)| !want.contains(ip) && view.revision >= **rev)
            .map(|(ip, _)| *ip)
            .collect();
        for ip in gone {
            held.remove(&ip);
            if !attachments.values().any(|a| a.ips.contains(&ip)) {
                pools.release(&[ip]);
                tracing::info!(%ip, "a VM address was released");
            }
        }
    }

    /// Takes requested addresses from this node's pools; in cluster mode a
    /// block nobody holds is claimed first. All or nothing.
    async fn take_requested(&self, ips: &[IpAddr]) -> Result<()> {
        let mut taken = Vec::with_capacity(ips.len());
        for &ip in ips {
            if let Err(e) = self.take_one(ip).await {
                self.free_ips(&taken);
                return Err(e);
            }
            taken.push(ip);
        }
        Ok(())
    }

    async fn take_one(&self, ip: IpAddr) -> Result<()> {
        for _ in 0..2 {
            let took = lock(&self.pools).take(ip);
            match took {
                Take::Taken => return Ok(()),
                Take::InUse => return Err(Error::AddressInUse(self.holder_of(ip))),
                Take::NotInPool => {}
            }
            let pools: Vec<String> = lock(&self.pools)
                .pools()
                .iter()
                .map(|p| p.cidr().to_string())
                .collect();
            let Some(cluster) = &self.cluster else {
                return Err(Error::AddressNotInPool(format!(
                    "{ip} is not an address of this node's pod CIDRs ({})",
                    pools.join(", ")
                )));
            };
            let cidrs = &cluster.config().cluster_cidrs;
            if !cidrs.iter().any(|c| c.contains(&ip)) {
                let cidrs: Vec<String> = cidrs.iter().map(|c| c.to_string()).collect();
                return Err(Error::AddressNotInPool(format!(
                    "{ip} is outside the cluster CIDRs ({})",
                    cidrs.join(", ")
                )));
            }
            let view = cluster.view();
            if let Some(holder) = cluster.block_holder(&view, ip) {
                if holder != self.config.name {
                    return Err(Error::AddressNotInPool(format!(
                        "{ip} lies in a block held by node {holder}; a node gives out addresses of its own blocks only"
                    )));
                }
            }
            // Nobody's block yet (or ours, not yet in the pools): claim it.
            let block = cluster.reclaim_block_of(ip).await?;
            lock(&self.pools).add_block(block)?;
            let view = self.vms.view().clone();
            self.sync_reservations(&view);
        }
        Err(Error::AddressNotInPool(format!(
            "{ip} is not a usable address of its block (network or broadcast address)"
        )))
    }

    /// The addresses of a new pod (or a VM's first pod): the requested
    /// ones, and one of every other family from the pools.
    pub(super) async fn addresses_for(&self, req: &Requested) -> Result<Vec<IpAddr>> {
        if req.ips.is_empty() {
            return self.allocate(None).await;
        }
        self.take_requested(&req.ips).await?;
        let missing: Vec<Family> = lock(&self.pools)
            .families()
            .iter()
            .copied()
            .filter(|f| !req.ips.iter().any(|ip| Family::of_ip(*ip) == *f))
            .collect();
        if missing.is_empty() {
            return Ok(req.ips.clone());
        }
        match self.allocate(Some(&missing)).await {
            Ok(more) => Ok(req.ips.iter().copied().chain(more).collect()),
            Err(e) => {
                self.free_ips(&req.ips);
                Err(e)
            }
        }
    }

    /// The MAC of a new plain pod: the requested one (checked to be free)
    /// or one derived from its addresses.
    pub(super) fn mac_for(&self, req: &Requested, ips: &[IpAddr]) -> Result<Mac> {
        match req.mac {
            Some(m) => {
                self.check_mac_free(&m.to_string(), None)?;
                Ok(m)
            }
            None => Ok(dataplane::pod_mac(ips)),
        }
    }

    /// Puts a VM pod into its VM's record, by compare-and-swap:
    /// - no record: the VM's first pod; addresses are allocated (or the
    ///   requested ones taken) and the record created with it active;
    /// - a record without an active pod: the VM starts again here;
    /// - a migration target: it becomes the alternate;
    /// - otherwise the pod replaces the active one (the VM was restarted
    ///   before its old pod was deleted).
    pub(super) async fn place_vm(
        &self,
        inv: &Invocation,
        pod: &VmPod,
        req: &Requested,
    ) -> Result<Placement> {
        let this = self.this_attachment(inv);
        for _attempt in 0..8 {
            let Some((mut rec, rev)) = self.vms.read(&pod.key).await? else {
                match self.create_vm_record(pod, req, &this).await? {
                    Some(p) => return Ok(p),
                    None => continue,
                }
            };
            check_request_matches(&rec, req)?;
            let role = if rec.active.as_ref().is_some_and(|a| same(a, &this)) {
                Role::Active
            } else if rec.alternate.as_ref().is_some_and(|a| same(a, &this)) {
                Role::Alternate
            } else if rec.active.is_none() {
                rec.active = Some(this.clone());
                Role::Active
            } else if pod.target {
                if let Some(old) = rec.alternate.replace(this.clone()) {
                    tracing::warn!(vm = %pod.key, old = %old.describe(), "a new migration target replaces one that was never deleted");
                }
                Role::Alternate
            } else {
                if let Some(old) = rec.active.replace(this.clone()) {
                    tracing::warn!(vm = %pod.key, old = %old.describe(), "a new pod of the VM takes over from one still recorded active");
                }
                Role::Active
            };
            rec.generation += 1;
            if self.vms.replace(&rec, rev).await?.is_some() {
                tracing::info!(vm = %pod.key, role = ?role, generation = rec.generation, "VM pod placed");
                return Ok(Placement {
                    rec,
                    role,
                    created: false,
                    this,
                });
            }
        }
        Err(Error::TryAgain(format!(
            "the record of VM {} kept changing while this pod was added",
            pod.key
        )))
    }

    /// Creates the record of a VM's first pod. `None` when another node
    /// created it first (the caller reads it again).
    async fn create_vm_record(
        &self,
        pod: &VmPod,
        req: &Requested,
        this: &VmAttachment,
    ) -> Result<Option<Placement>> {
        let ips = self.addresses_for(req).await?;
        let mac = req
            .mac
            .unwrap_or_else(|| dataplane::pod_mac(&ips))
            .to_string();
        if let Err(e) = self.check_mac_free(&mac, Some(&pod.key)) {
            self.free_ips(&ips);
            return Err(e);
        }
        let rec = VmRecord {
            key: pod.key.clone(),
            ips: ips.clone(),
            mac,
            origin: if *req == Requested::default() {
                Origin::Allocated
            } else {
                Origin::Requested
            },
            active: Some(this.clone()),
            alternate: None,
            generation: 1,
            created_unix_ms: UnixMillis::now(),
            last_cutover: None,
        };
        let placed = |rec: VmRecord| Placement {
            rec,
            role: Role::Active,
            created: true,
            this: this.clone(),
        };
        match self.vms.create(&rec).await {
            Ok(Ok(rev)) => {
                self.mark_vm_held(&ips, rev);
                tracing::info!(vm = %pod.key, ips = ?ips, mac = %rec.mac, "VM address record created");
                Ok(Some(placed(rec)))
            }
            Ok(Err(CreateRefused::Exists)) => {
                self.free_ips(&ips);
                Ok(None)
            }
            Ok(Err(CreateRefused::Taken { what, holder })) => {
                self.free_ips(&ips);
                Err(Error::AddressInUse(format!(
                    "{what} is held by VM {holder}"
                )))
            }
            Err(e) => {
                // The outcome is unknown: the record tells.
                match self.vms.read(&pod.key).await {
                    Ok(Some((found, rev))) if found.active.as_ref() == Some(this) => {
                        self.mark_vm_held(&ips, rev);
                        Ok(Some(placed(found)))
                    }
                    Ok(_) => {
                        self.free_ips(&ips);
                        Err(e)
                    }
                    Err(_) => {
                        // Cannot tell: keep the addresses out of the pools
                        // until a restart finds out from the store.
                        self.mark_vm_held(&ips, i64::MAX);
                        tracing::warn!(vm = %pod.key, ?ips, "cannot tell whether a VM record was created; its addresses stay reserved");
                        Err(e)
                    }
                }
            }
        }
    }

    /// Undoes a placement whose wiring failed.
    pub(super) async fn undo_placement(&self, p: &Placement) {
        let key = p.rec.key.clone();
        let outcome = if p.created {
            match self.vms.read(&key).await {
                Ok(Some((rec, rev)))
                    if rec.active.as_ref() == Some(&p.this) && rec.alternate.is_none() =>
                {
                    self.vms.delete(&rec, rev).await.map(|_| ())
                }
                Ok(_) => Ok(()),
                Err(e) => Err(e),
            }
        } else {
            self.vms
                .update(&key, |r| Ok(remove_attachment(r, &p.this)))
                .await
                .map(|_| ())
        };
        if let Err(e) = outcome {
            tracing::error!(vm = %key, error = %e, "cannot undo the VM record change of a failed ADD");
        }
    }

    /// After a VM pod's ADD: a migration target starts listening for its
    /// VM's announcement, or is promoted at once when its pod says the VM
    /// runs there already.
    pub(super) async fn after_vm_add(&self, pod: &VmPod, a: &Attachment, p: &Placement) {
        if p.role != Role::Alternate {
            return;
        }
        let generation = p.rec.generation;
        if pod.ready {
            self.ready_annotation(pod, a).await;
            return;
        }
        match self.dataplane.link_index(&a.host_ifname).await {
            Ok(Some(ifindex)) => self.add_pending(
                &a.mac,
                PendingTarget {
                    vm: pod.key.clone(),
                    attachment: a.key.clone(),
                    ifindex,
                    generation,
                },
            ),
            Ok(None) | Err(_) => {
                tracing::warn!(veth = %a.host_ifname, "cannot find a migration target's veth to listen on")
            }
        }
    }

    /// The target pod carries `kubevirt.io/migration-target-ready-timestamp`
    /// (on ADD or CHECK): cut over if it is still the alternate.
    pub(super) async fn ready_annotation(&self, pod: &VmPod, a: &Attachment) {
        if !pod.ready || !pod.target {
            return;
        }
        let seen = (Instant::now(), UnixNanos::now());
        if let Err(e) = self
            .cutover(&pod.key, Some(a), Trigger::Annotation, seen)
            .await
        {
            tracing::warn!(vm = %pod.key, error = %e, "cutover on the target-ready annotation failed");
        }
    }

    fn add_pending(&self, mac: &str, p: PendingTarget) {
        let Ok(mac) = Mac::parse_pod(mac, "pod MAC") else {
            return;
        };
        let mut pending = lock(&self.pending_targets);
        let list = pending.entry(mac).or_default();
        if !list.contains(&p) {
            list.push(p);
        }
    }

    /// Promotes the alternate of `vm` to active by compare-and-swap. With
    /// `only` (a local trigger), only if that local attachment is the
    /// alternate, and its route is installed first, before the write: the
    /// VM runs here now. `seen` is when the trigger was seen (Instant and
    /// ns since the epoch).
    pub async fn cutover(
        &self,
        vm: &VmKey,
        only: Option<&Attachment>,
        trigger: Trigger,
        seen: (Instant, UnixNanos),
    ) -> Result<VmRecord> {
        let me = self.config.name.clone();
        let mut local_route = None;
        if let Some(a) = only {
            self.dataplane
                .ensure_host_routes(&a.host_ifname, &a.ips)
                .await?;
            local_route = Some(seen.0.elapsed());
        }
        let want = only.map(|a| (a.key.clone(), me.clone()));
        let outcome = self
            .vms
            .update(vm, |r| {
                let Some(alt) = &r.alternate else {
                    return match &want {
                        Some(_) => Ok(false),
                        None => Err(Error::VmState(format!(
                            "VM {vm} has no alternate pod to cut over to"
                        ))),
                    };
                };
                if let Some((k, node)) = &want {
                    if !alt.is(node, &k.network, &k.container_id, &k.ifname) {
                        return Ok(false);
                    }
                }
                let to_node = alt.node.clone();
                let from_node = r.active.as_ref().map(|a| a.node.clone());
                std::mem::swap(&mut r.active, &mut r.alternate);
                r.last_cutover = Some(CutoverInfo {
                    trigger,
                    from_node,
                    to_node,
                    seen_unix_nanos: seen.1,
                });
                Ok(true)
            })
            .await;
        let (rec, committed) = match outcome {
            Ok(done) => done,
            Err(e) => {
                // The VM runs here, so the local route stays; the next
                // announcement (QEMU sends several) tries the write again.
                if let Some(a) = only {
                    let generation = self.vms.cached(vm).map_or(0, |(r, _)| r.generation);
                    if let Some(ifindex) = self
                        .dataplane
                        .link_index(&a.host_ifname)
                        .await
                        .ok()
                        .flatten()
                    {
                        self.add_pending(
                            &a.mac,
                            PendingTarget {
                                generation,
                                vm: vm.clone(),
                                attachment: a.key.clone(),
                                ifindex,
                            },
                        );
                    }
                }
                return Err(e);
            }
        };
        if committed.is_none() {
            // Not the alternate (any more): an earlier announcement won, or
            // the record moved on. Let the routes follow the record.
            let active_here = rec.active.as_ref().is_some_and(|x| {
                only.is_some_and(|a| x.is(&me, &a.key.network, &a.key.container_id, &a.key.ifname))
            });
            if !active_here && only.is_some() {
                self.force_vm_resync();
            }
            return Ok(rec);
        }
        let committed_after = seen.0.elapsed();
        // An admin cutover to a pod of this node: route it now rather than
        // when the watch reports the change.
        if only.is_none() {
            if let Some(act) = rec.active.as_ref().filter(|x| x.node == me) {
                let key = AttachmentKey {
                    network: act.network.clone(),
                    container_id: act.container_id.clone(),
                    ifname: act.ifname.clone(),
                };
                let local = lock(&self.attachments).get(&key).cloned();
                if let Some(a) = local {
                    self.dataplane
                        .ensure_host_routes(&a.host_ifname, &a.ips)
                        .await?;
                    local_route = Some(seen.0.elapsed());
                }
            }
        }
        tracing::info!(
            vm = %vm,
            trigger = trigger.name(),
            generation = rec.generation,
            local_route_ms = local_route.map(|d| d.as_secs_f64() * 1e3),
            committed_ms = committed_after.as_secs_f64() * 1e3,
            "VM cut over"
        );
        let mut stats = lock(&self.vm_stats);
        stats.cutovers += 1;
        stats.last_cutover = Some(CutoverTiming {
            vm: vm.clone(),
            trigger,
            generation: rec.generation,
            seen_unix_nanos: seen.1,
            local_route,
            committed: committed_after,
        });
        Ok(rec)
    }

    /// Takes a VM pod out of its record before its local teardown: the
    /// record stays (the VM keeps its address) unless the network's policy
    /// is `ephemeral` and it was the VM's last pod. Returns whether the
    /// node should withdraw the pod's host routes (the VM now runs
    /// nowhere; otherwise the routes follow the record).
    pub(super) async fn leave_vm_record(
        &self,
        a: &Attachment,
        vm: &VmKey,
        policy: VmAddressPolicy,
    ) -> Result<bool> {
        let me = self.config.name.clone();
        let this = VmAttachment {
            node: me,
            network: a.key.network.clone(),
            container_id: a.key.container_id.clone(),
            ifname: a.key.ifname.clone(),
            pod_name: None,
            pod_uid: None,
            since_unix_ms: UnixMillis::EPOCH,
        };
        let (rec, rev) = match self
            .vms
            .update(vm, |r| Ok(remove_attachment(r, &this)))
            .await
        {
            Ok((rec, Some(rev))) => (rec, Some(rev)),
            Ok((rec, None)) => (rec, None),
            // Released meanwhile: nothing to leave.
            Err(Error::UnknownVm(_)) => return Ok(true),
            Err(e) => return Err(e),
        };
        if rev.is_some() {
            tracing::info!(vm = %vm, attachment = %a.key, generation = rec.generation, "VM pod left its record");
        }
        if policy == VmAddressPolicy::Ephemeral && rec.attachments().next().is_none() {
            let rev = match rev {
                Some(r) => Some(r),
                None => self.vms.read(vm).await?.map(|(_, r)| r),
            };
            if let Some(rev) = rev {
                if self.vms.delete(&rec, rev).await?.is_some() {
                    tracing::info!(vm = %vm, ips = ?rec.ips, "released the address of an ephemeral VM with its last pod");
                }
            }
        }
        Ok(rec.active.is_none())
    }

    /// Admin: reserves addresses (and a MAC) for a VM before its first pod,
    /// e.g. for a VM imported from another platform that must keep them.
    pub async fn reserve_vm(
        &self,
        key: VmKey,
        ips: Vec<IpAddr>,
        mac: Option<String>,
    ) -> Result<VmRecord> {
        if ips.is_empty() {
            return Err(Error::InvalidConfig(
                "a reservation needs at least one address".into(),
            ));
        }
        for f in [Family::V4, Family::V6] {
            if ips.iter().filter(|ip| Family::of_ip(**ip) == f).count() > 1 {
                return Err(Error::InvalidConfig(format!(
                    "more than one {} address: a VM interface gets one per family",
                    f.name()
                )));
            }
        }
        let mac = match mac.as_deref().filter(|m| !m.is_empty()) {
            Some(m) => Mac::parse_pod(m, "mac")?,
            None => dataplane::pod_mac(&ips),
        }
        .to_string();
        if let Some((rec, _)) = self.vms.read(&key).await? {
            let (mut want, mut have) = (ips.clone(), rec.ips.clone());
            want.sort();
            have.sort();
            if want == have && rec.mac.eq_ignore_ascii_case(&mac) {
                return Ok(rec);
            }
            return Err(Error::VmState(format!(
                "VM {key} already holds {} ({}); release it first",
                join(&rec.ips),
                rec.mac
            )));
        }
        self.check_mac_free(&mac, Some(&key))?;
        self.take_requested(&ips).await?;
        let rec = VmRecord {
            key: key.clone(),
            ips: ips.clone(),
            mac,
            origin: Origin::Reserved,
            active: None,
            alternate: None,
            generation: 1,
            created_unix_ms: UnixMillis::now(),
            last_cutover: None,
        };
        match self.vms.create(&rec).await {
            Ok(Ok(rev)) => {
                self.mark_vm_held(&ips, rev);
                tracing::info!(vm = %key, ?ips, mac = %rec.mac, "reserved a VM address");
                Ok(rec)
            }
            Ok(Err(CreateRefused::Exists)) => {
                self.free_ips(&ips);
                Err(Error::VmState(format!(
                    "VM {key} got a record meanwhile; look at it and try again"
                )))
            }
            Ok(Err(CreateRefused::Taken { what, holder })) => {
                self.free_ips(&ips);
                Err(Error::AddressInUse(format!(
                    "{what} is held by VM {holder}"
                )))
            }
            Err(e) => {
                self.free_ips(&ips);
                Err(e)
            }
        }
    }

    /// Admin: frees a VM's addresses. Refused while the record names pods,
    /// unless `force`.
    pub async fn release_vm(&self, key: &VmKey, force: bool) -> Result<VmRecord> {
        let (rec, rev) = self
            .vms
            .read(key)
            .await?
            .ok_or_else(|| Error::UnknownVm(key.to_string()))?;
        let pods: Vec<String> = rec.attachments().map(VmAttachment::describe).collect();
        if !pods.is_empty() && !force {
            return Err(Error::VmState(format!(
                "VM {key} still has {}; delete its pods first, or force",
                pods.join(" and ")
            )));
        }
        match self.vms.delete(&rec, rev).await? {
            Some(_) => {
                tracing::info!(vm = %key, ips = ?rec.ips, force, "released a VM's address");
                Ok(rec)
            }
            None => Err(Error::TryAgain(format!(
                "the record of VM {key} changed meanwhile; look at it and try again"
            ))),
        }
    }

    /// Makes the next VM sync touch the kernel even if the records did not
    /// change (a route may have been removed under it).
    pub(super) fn force_vm_resync(&self) {
        *lock(&self.vm_wants) = None;
        self.vm_resync.notify_one();
    }

    /// Brings this node in line with the VM records: pool reservations,
    /// the pending migration targets, and routes.
    pub(super) async fn sync_vms(&self, view: &VmView) -> Result<()> {
        if !view.synced {
            return Ok(());
        }
        self.sync_reservations(view);
        let me = self.config.name.as_str();
        let local: HashMap<AttachmentKey, Attachment> = lock(&self.attachments)
            .iter()
            .filter(|(_, a)| a.vm.is_some())
            .map(|(k, a)| (k.clone(), a.clone()))
            .collect();
        let cluster_view = self.cluster.as_ref().map(|c| c.view());
        let key_of = |x: &VmAttachment| AttachmentKey {
            network: x.network.clone(),
            container_id: x.container_id.clone(),
            ifname: x.ifname.clone(),
        };
        let mut wants: HashMap<VmKey, Want> = HashMap::new();
        let mut pending: HashMap<Mac, Vec<FoundTarget>> = HashMap::new();
        for (rec, _) in view.records.values() {
            let mut want = Want::default();
            match &rec.active {
                Some(act) if act.node == me => {
                    want.here = local.get(&key_of(act)).map(|a| a.host_ifname.clone());
                }
                Some(act) => {
                    if let (Some(c), Some(cv)) = (&self.cluster, &cluster_view) {
                        for &ip in &rec.ips {
                            if c.block_holder(cv, ip) == Some(act.node.as_str()) {
                                continue;
                            }
                            if let Some((via, onlink_dev)) =
                                c.next_hop(cv, &act.node, Family::of_ip(ip))
                            {
                                want.via.push(ClusterRoute {
                                    dst: host_net(ip),
                                    via,
                                    onlink_dev,
                                });
                            }
                        }
                    }
                }
                None => {}
            }
            if let Some(alt) = rec.alternate.as_ref().filter(|x| x.node == me) {
                if let (Some(a), Ok(mac)) =
                    (local.get(&key_of(alt)), Mac::parse_pod(&rec.mac, "mac"))
                {
                    pending.entry(mac).or_default().push((
                        rec.key.clone(),
                        a.key.clone(),
                        a.host_ifname.clone(),
                        rec.generation,
                    ));
                }
            }
            wants.insert(rec.key.clone(), want);
        }
        self.refresh_pending(pending, view).await;

        let previous = lock(&self.vm_wants).clone();
        if previous.as_ref() == Some(&wants) {
            return Ok(());
        }
        let mut via: Vec<ClusterRoute> = wants.values().flat_map(|w| w.via.clone()).collect();
        via.sort();
        // First the routes to other nodes: on a migration's source they
        // replace the pod's host route in one change.
        self.dataplane.sync_vm_routes(&via).await?;
        let mut here_ips = HashSet::new();
        for rec in view.records.values().map(|(r, _)| r) {
            if let Some(host) = wants.get(&rec.key).and_then(|w| w.here.as_ref()) {
                self.dataplane.ensure_host_routes(host, &rec.ips).await?;
                here_ips.extend(rec.ips.iter().copied());
            }
        }
        // Then the host routes of local VM pods that must not receive the
        // VM's traffic (a target before the cutover has none; a source
        // after it had its route replaced above).
        let via_dsts: HashSet<IpAddr> = via.iter().map(|r| r.dst.addr()).collect();
        let withdraw: Vec<IpAddr> = local
            .values()
            .flat_map(|a| a.ips.iter().copied())
            .filter(|ip| !here_ips.contains(ip) && !via_dsts.contains(ip))
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        self.dataplane.remove_host_routes(&withdraw).await?;

        // Timings, for the records whose routes changed here.
        let done = UnixNanos::now();
        let changed = view.records.values().map(|(r, _)| r).filter(|r| {
            previous
                .as_ref()
                .is_some_and(|p| p.get(&r.key) != wants.get(&r.key))
        });
        if let Some(latest) = changed.max_by_key(|r| {
            r.last_cutover
                .as_ref()
                .map_or(UnixNanos::EPOCH, |c| c.seen_unix_nanos)
        }) {
            let mut stats = lock(&self.vm_stats);
            stats.route_updates += 1;
            stats.last_route_update = Some(RouteUpdateTiming {
                vm: latest.key.clone(),
                generation: latest.generation,
                done_unix_nanos: done,
                since_trigger: latest
                    .last_cutover
                    .as_ref()
                    .map(|c| done.saturating_duration_since(c.seen_unix_nanos)),
            });
        }
        *lock(&self.vm_wants) = Some(wants);
        Ok(())
    }

    /// Replaces the table of pending migration targets, looking up veth
    /// indexes only for targets not known before.
    async fn refresh_pending(&self, found: HashMap<Mac, Vec<FoundTarget>>, view: &VmView) {
        let old: Vec<(Mac, PendingTarget)> = lock(&self.pending_targets)
            .iter()
            .flat_map(|(mac, list)| list.iter().map(|p| (*mac, p.clone())))
            .collect();
        let known: HashMap<AttachmentKey, u32> = old
            .iter()
            .map(|(_, p)| (p.attachment.clone(), p.ifindex))
            .collect();
        let mut table: HashMap<Mac, Vec<PendingTarget>> = HashMap::new();
        // A target placed after this view was taken stays.
        for (mac, p) in old {
            let newer = view
                .records
                .get(&p.vm)
                .is_none_or(|(r, _)| r.generation < p.generation);
            if newer && lock(&self.attachments).contains_key(&p.attachment) {
                table.entry(mac).or_default().push(p);
            }
        }
        for (mac, list) in found {
            for (vm, attachment, host, generation) in list {
                let ifindex = match known.get(&attachment) {
                    Some(i) => *i,
                    None => match self.dataplane.link_index(&host).await {
                        Ok(Some(i)) => i,
                        _ => continue,
                    },
                };
                let entry = table.entry(mac).or_default();
                if !entry.iter().any(|p| p.attachment == attachment) {
                    entry.push(PendingTarget {
                        vm,
                        attachment,
                        ifindex,
                        generation,
                    });
                }
            }
        }
        *lock(&self.pending_targets) = table;
    }

    /// Starts the VM tasks: the listener for migrated VMs' announcements and
    /// the loop that keeps routes and reservations in step with the records.
    /// Without the listener (no CAP_NET_RAW), cutovers still happen on the
    /// target-ready annotation and the admin call; that is logged.
    pub fn start_vm_tasks(self: &Arc<Self>) {
        match AnnounceListener::open() {
            Ok(listener) => self.spawn_announce_loop(listener),
            Err(e) => tracing::error!(
                error = %e,
                "cannot listen for migrated VMs' announcements: cutovers only on the annotation or the admin call"
            ),
        }
        self.spawn_vm_sync_loop();
    }

    fn spawn_announce_loop(self: &Arc<Self>, listener: AnnounceListener) {
        let node = self.clone();
        tokio::spawn(async move {
            loop {
                let ann = match listener.next().await {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(error = %e, "reading VM announcements failed");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                };
                let seen_unix = UnixNanos::now().saturating_sub(ann.seen.elapsed());
                let target = {
                    let mut table = lock(&node.pending_targets);
                    let hit = table.get_mut(&Mac::from(ann.mac)).and_then(|list| {
                        let i = list.iter().position(|p| p.ifindex == ann.ifindex)?;
                        Some(list.remove(i))
                    });
                    hit
                };
                let Some(target) = target else {
                    continue;
                };
                let local = lock(&node.attachments).get(&target.attachment).cloned();
                let Some(a) = local else {
                    continue;
                };
                let trigger = match ann.kind {
                    AnnounceKind::Rarp => Trigger::Rarp,
                    AnnounceKind::Garp => Trigger::Garp,
                };
                let node = node.clone();
                tokio::spawn(async move {
                    if let Err(e) = node
                        .cutover(&target.vm, Some(&a), trigger, (ann.seen, seen_unix))
                        .await
                    {
                        tracing::warn!(vm = %target.vm, error = %e, "cutover on the VM's announcement failed");
                    }
                });
            }
        });
    }

    fn spawn_vm_sync_loop(self: &Arc<Self>) {
        let node = self.clone();
        tokio::spawn(async move {
            let mut rx = node.vms.subscribe();
            let mut cluster_rx = node.cluster.as_ref().map(|c| c.subscribe());
            let mut failing = false;
            loop {
                let cluster_changed = async {
                    match cluster_rx.as_mut() {
                        Some(c) => c.changed().await.is_ok(),
                        None => std::future::pending().await,
                    }
                };
                let retry = async {
                    if failing {
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    } else {
                        std::future::pending::<()>().await;
                    }
                };
                tokio::select! {
                    r = rx.changed() => if r.is_err() { return },
                    _ = cluster_changed => {},
                    () = node.vm_resync.notified() => {},
                    () = retry => {},
                }
                let view = rx.borrow_and_update().clone();
                match node.sync_vms(&view).await {
                    Ok(()) => {
                        if failing {
                            tracing::info!("VM routes programmed again");
                        }
                        failing = false;
                    }
                    Err(e) => {
                        if !failing {
                            tracing::warn!(error = %e, "programming VM routes failed; retrying every 500 ms");
                        }
                        *lock(&node.vm_wants) = None;
                        failing = true;
                    }
                }
            }
        });
    }
}

/// Removes `this` from the record's attachments; true if it was there.
fn remove_attachment(r: &mut VmRecord, this: &VmAttachment) -> bool {
    let mut changed = false;
    if r.active.as_ref().is_some_and(|a| same(a, this)) {
        r.active = None;
        changed = true;
    }
    if r.alternate.as_ref().is_some_and(|a| same(a, this)) {
        r.alternate = None;
        changed = true;
    }
    changed
}

fn join(ips: &[IpAddr]) -> String {
    ips.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A request for a VM that has a record must ask for what it holds.
fn check_request_matches(rec: &VmRecord, req: &Requested) -> Result<()> {
    for ip in &req.ips {
        if !rec.ips.contains(ip) {
            return Err(Error::AddressInUse(format!(
                "VM {} holds {}; it cannot be given {ip} (release it first with ReleaseVm)",
                rec.key,
                join(&rec.ips)
            )));
        }
    }
    if let Some(mac) = req.mac {
        let mac = mac.to_string();
        if !rec.mac.eq_ignore_ascii_case(&mac) {
            return Err(Error::AddressInUse(format!(
                "VM {} holds MAC {}; it cannot be given {mac} (release it first with ReleaseVm)",
                rec.key, rec.mac
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_with_or_without_a_prefix() {
        assert_eq!(
            parse_ip("10.1.2.3", "x").unwrap(),
            "10.1.2.3".parse::<IpAddr>().unwrap()
        );
        assert_eq!(
            parse_ip("10.1.2.3/24", "x").unwrap(),
            "10.1.2.3".parse::<IpAddr>().unwrap()
        );
        assert_eq!(
            parse_ip("fd00::7/64", "x").unwrap(),
            "fd00::7".parse::<IpAddr>().unwrap()
        );
        assert!(parse_ip("10.1.2", "x").is_err());
    }
}
