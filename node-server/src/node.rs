//! The attachment lifecycle on this node: ADD, DEL, CHECK, GC and STATUS,
//! tying the store, the address pools and the dataplane together.
//!
//! Ordering rules that keep state from being lost:
//! - ADD reserves addresses in memory, then records the attachment in the
//!   store and wires the kernel concurrently; the ADD succeeds only when both
//!   did. If the daemon dies between the two, startup reconciliation removes
//!   kernel objects that have no record, and a record without kernel objects
//!   is released by the runtime's DEL or by GC.
//! - DEL removes the node's route to the pod and the record before it frees
//!   the address in memory, so a reused address never meets a stale route;
//!   the kernel's slow veth teardown runs after the reply.
//! - Every kernel object tether makes is recognisable (the `tth` link prefix,
//!   route protocol 201), so reconciliation can find what is ours.

mod vm;

pub use vm::{CutoverTiming, RouteUpdateTiming, VmStats};

use crate::cluster::Cluster;
use crate::cni::{self, Invocation, VmAddressPolicy};
use crate::dataplane::{self, Dataplane, PodWiring};
use crate::error::{Error, Mismatch, Result};
use crate::ipam::{Family, Pools};
use crate::mac::Mac;
use crate::store::{Attachment, AttachmentKey, Store};
use crate::time::UnixNanos;
use crate::vm::VmRegistry;
use ipnet::IpNet;
use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::{Notify, OwnedMutexGuard, RwLock};

/// The node's static settings.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// This node's name.
    pub name: String,
    /// Fixed pod CIDRs, at most one per family (`--pod-cidr` mode); empty
    /// in cluster mode, where addresses come from claimed blocks.
    pub pod_cidrs: Vec<IpNet>,
    /// MTU of pod interfaces unless the netconf overrides it.
    pub mtu: u32,
    /// The daemon's state directory.
    pub state_dir: PathBuf,
    /// Non-root uids allowed to use the daemon (on the socket, and as
    /// authors of queued DELs).
    pub allowed_uids: Vec<u32>,
    /// Test hook: holds background link deletions back this long, so tests
    /// can prove that nothing depends on their timing. Zero in production.
    pub test_delete_delay: Duration,
}

/// What startup reconciliation did, for the log and for tests.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Reconciled {
    /// Attachments loaded from the store.
    pub attachments: usize,
    /// Host routes re-added for recorded attachments.
    pub routes_added: usize,
    /// Routes to other nodes' blocks added (cluster mode).
    pub cluster_routes_added: usize,
    /// Stale routes to other nodes' blocks removed (cluster mode).
    pub cluster_routes_removed: usize,
    /// Our routes removed because no attachment owns them.
    pub routes_removed: usize,
    /// Our links removed because no attachment owns them.
    pub links_removed: usize,
}

/// This node's pod networking.
pub struct Node {
    config: NodeConfig,
    store: Arc<dyn Store>,
    /// Cluster mode: membership, blocks and routes to other nodes.
    cluster: Option<Arc<Cluster>>,
    dataplane: Dataplane,
    pools: Mutex<Pools>,
    attachments: Mutex<HashMap<AttachmentKey, Attachment>>,
    /// One async lock per attachment key, present while someone holds or
    /// waits for it, so that different pods proceed in parallel.
    key_locks: Mutex<HashMap<AttachmentKey, Arc<tokio::sync::Mutex<()>>>>,
    /// Held shared by per-attachment verbs and exclusively by GC, whose
    /// orphan sweep must not see an ADD half done.
    sweep: RwLock<()>,
    /// Background link deletions by host interface name. An ADD that needs
    /// the same name waits for the deletion, or the late deletion would
    /// remove the new pod's veth.
    deleting: Arc<Mutex<HashMap<String, Arc<Notify>>>>,
    /// Veths waiting for the deletion worker, which deletes everything
    /// queued in one kernel batch.
    doomed: Arc<Mutex<Vec<String>>>,
    /// Wakes the deletion worker.
    doomed_queued: Arc<Notify>,
    /// KubeVirt VM address records.
    vms: Arc<VmRegistry>,
    /// Addresses of this node's pools that VM records hold, with the store
    /// revision they were known held at: they stay in use while no local
    /// pod has them, and are freed once a view at least that recent no
    /// longer shows them.
    vm_held: Mutex<HashMap<IpAddr, i64>>,
    /// Migration targets on this node waiting for their VM's announcement,
    /// by the VM's MAC.
    pending_targets: Mutex<HashMap<Mac, Vec<vm::PendingTarget>>>,
    /// The VM routes as last programmed, per VM; `None` forces the next
    /// sync to touch the kernel.
    vm_wants: Mutex<Option<HashMap<crate::vm::VmKey, vm::Want>>>,
    /// Wakes the VM sync.
    vm_resync: Notify,
    /// Cutover counters and timings.
    vm_stats: Mutex<VmStats>,
}

/// Holds an attachment's lock; frees the table entry when nobody else waits.
struct KeyGuard<'a> {
    guard: Option<OwnedMutexGuard<()>>,
    key: AttachmentKey,
    table: &'a Mutex<HashMap<AttachmentKey, Arc<tokio::sync::Mutex<()>>>>,
}

impl Drop for KeyGuard<'_> {
    fn drop(&mut self) {
        self.guard.take();
        let mut table = lock(self.table);
        if table
            .get(&self.key)
            .is_some_and(|m| Arc::strong_count(m) == 1)
        {
            table.remove(&self.key);
        }
    }
}

/// Locks a std mutex, recovering from poisoning: every critical section in
/// this module leaves the data consistent before anything can panic.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs a blocking store call off the async workers.
async fn blocking<T: Send + 'static, E: Into<Error> + Send + 'static>(
    f: impl FnOnce() -> Result<T, E> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Internal(format!("store task failed: {e}")))?
        .map_err(Into::into)
}

/// Compares the kernel's boot id with the one recorded in the state dir at
/// the last start, and records the current one. True when they differ.
fn rebooted_since_last_run(state_dir: &Path) -> Result<bool> {
    let current = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map_err(|e| Error::Io(format!("reading the boot id: {e}")))?;
    let current = current.trim();
    let path = state_dir.join("boot_id");
    let recorded = std::fs::read_to_string(&path).ok();
    let rebooted = recorded.as_deref().is_some_and(|r| r.trim() != current);
    if recorded.as_deref().map(str::trim) != Some(current) {
        let tmp = state_dir.join(".boot_id.tmp");
        std::fs::write(&tmp, current)
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|e| Error::Io(format!("recording the boot id in {}: {e}", path.display())))?;
    }
    Ok(rebooted)
}

fn key_of(inv: &Invocation) -> AttachmentKey {
    AttachmentKey {
        network: inv.conf.name.clone(),
        container_id: inv.container_id.clone(),
        ifname: inv.ifname.clone(),
    }
}

/// What the dataplane needs to wire `a`, whose MAC is `pod_mac`: ADD
/// passes the one it chose, the other callers [`stored_mac`].
fn wiring<'a>(
    a: &'a Attachment,
    pod_mac: Mac,
    netns: &'a std::fs::File,
    netns_path: &'a Path,
    routed: bool,
) -> PodWiring<'a> {
    PodWiring {
        netns,
        netns_path,
        pod_ifname: &a.key.ifname,
        host_ifname: &a.host_ifname,
        pod_mac,
        ips: &a.ips,
        mtu: a.mtu,
        routed,
    }
}

/// The MAC a stored attachment was wired with.
fn stored_mac(a: &Attachment) -> Result<Mac> {
    a.mac
        .parse::<Mac>()
        .map_err(|_| Error::Internal(format!("bad stored MAC {}", a.mac)))
}

fn wired(a: &Attachment) -> cni::Wired {
    cni::Wired {
        host_ifname: a.host_ifname.clone(),
        host_mac: dataplane::GATEWAY_MAC.to_string(),
        pod_ifname: a.key.ifname.clone(),
        pod_mac: a.mac.clone(),
        sandbox: a.netns.clone(),
        mtu: a.mtu,
        ips: a.ips.clone(),
    }
}

impl Node {
    /// Opens the node: loads the store, rebuilds the pools, and reconciles
    /// the kernel against the store. Call [`Node::drain_pending_dels`] next,
    /// then serve.
    pub async fn open(
        config: NodeConfig,
        store: Arc<dyn Store>,
        cluster: Option<Arc<Cluster>>,
        vms: Arc<VmRegistry>,
    ) -> Result<(Self, Reconciled)> {
        let dataplane = Dataplane::connect()?;
        dataplane.prepare_node()?;
        let mut pools = match &cluster {
            None => Pools::new(&config.pod_cidrs)?,
            Some(c) => {
                let mut pools = Pools::for_blocks(&c.config().families());
                for block in c.my_blocks() {
                    pools.add_block(block)?;
                }
                pools
            }
        };
        let mut loaded = {
            let store = store.clone();
            blocking(move || store.load()).await?
        };
        if rebooted_since_last_run(&config.state_dir)? && !loaded.is_empty() {
            // Network namespaces die with the kernel: every attachment of an
            // earlier boot is gone, whether or not the runtime will DEL it.
            tracing::warn!(
                count = loaded.len(),
                "the node rebooted since the last run: releasing the previous boot's attachments"
            );
            let keys: Vec<AttachmentKey> = loaded.iter().map(|a| a.key.clone()).collect();
            let s = store.clone();
            blocking(move || s.remove(&keys)).await?;
            loaded.clear();
        }
        // A VM pod's addresses are its record's: counted once (a migration's
        // two pods may both be here), and only those of our own blocks.
        let vm_view = vms.view().clone();
        let mut all_ips: Vec<IpAddr> = Vec::new();
        for a in &loaded {
            for &ip in &a.ips {
                let elsewhere = a.vm.is_some()
                    && (all_ips.contains(&ip)
                        || match &cluster {
                            Some(c) => {
                                let held = c.my_blocks();
                                !held.iter().any(|b| b.contains(&ip))
                            }
                            None => !pools.contains(ip),
                        });
                if !elsewhere {
                    all_ips.push(ip);
                }
            }
        }
        let mut strays = pools.restore(&all_ips);
        if let (Some(c), false) = (&cluster, strays.is_empty()) {
            // Recorded addresses outside the blocks the control plane says
            // we hold: our record was reaped while we were away. Take the
            // blocks back unless another node holds them now.
            for &ip in &strays {
                match c.reclaim_block_of(ip).await {
                    Ok(block) => pools.add_block(block)?,
                    Err(e) => {
                        tracing::error!(%ip, error = %e, "cannot reclaim the block of a local pod address")
                    }
                }
            }
            strays = pools.restore(&strays);
        }
        if !strays.is_empty() {
            // Kept in the store (and so never handed out twice), but outside
            // the configured pools or claimed twice: an operator must look.
            tracing::warn!(
                ?strays,
                "stored addresses outside the pod CIDRs or held twice"
            );
        }
        let attachments = loaded.into_iter().map(|a| (a.key.clone(), a)).collect();
        let node = Node {
            config,
            store,
            cluster,
            dataplane,
            pools: Mutex::new(pools),
            attachments: Mutex::new(attachments),
            key_locks: Mutex::new(HashMap::new()),
            sweep: RwLock::new(()),
            deleting: Arc::new(Mutex::new(HashMap::new())),
            doomed: Arc::new(Mutex::new(Vec::new())),
            doomed_queued: Arc::new(Notify::new()),
            vms,
            vm_held: Mutex::new(HashMap::new()),
            pending_targets: Mutex::new(HashMap::new()),
            vm_wants: Mutex::new(None),
            vm_resync: Notify::new(),
            vm_stats: Mutex::new(VmStats::default()),
        };
        node.sync_reservations(&vm_view);
        node.spawn_deletion_worker()?;
        let mut reconciled = node.reconcile().await?;
        if let Some(c) = &node.cluster {
            // The first block of each family is claimed before serving, so
            // that the first ADDs do not wait on the control plane.
            let full = lock(&node.pools).full_families();
            for family in full {
                if let Err(e) = node.grow(c, family).await {
                    tracing::warn!(family = family.name(), error = %e, "cannot claim a first block yet");
                }
            }
            c.prepare_dataplane(&node.dataplane, node.config.mtu)
                .await?;
            // A route the kernel refuses now (the underlay not up yet, say)
            // must not stop the node from serving its own pods: the route
            // manager keeps trying.
            let first = c.program(&node.dataplane, &c.view()).await;
            match &first {
                Ok((added, removed)) => {
                    reconciled.cluster_routes_added = *added;
                    reconciled.cluster_routes_removed = *removed;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot program the cluster routes yet; retrying")
                }
            }
            c.spawn_route_manager(node.dataplane.clone(), first.is_err());
        }
        // VMs that moved or stopped while the daemon was away: their routes
        // follow the records before the node serves.
        if let Err(e) = node.sync_vms(&vm_view).await {
            tracing::warn!(error = %e, "cannot program the VM routes yet; retrying");
        }
        Ok((node, reconciled))
    }

    /// The cluster membership, in cluster mode.
    pub fn cluster(&self) -> Option<&Arc<Cluster>> {
        self.cluster.as_ref()
    }

    /// Claims a block of `family` (or finds one that a concurrent claim
    /// got) and adds every block this node holds to the pools.
    async fn grow(&self, cluster: &Cluster, family: Family) -> Result<()> {
        let held: Vec<IpNet> = lock(&self.pools).pools().iter().map(|p| p.cidr()).collect();
        cluster.claim_block(family, &held).await?;
        {
            let mut pools = lock(&self.pools);
            for block in cluster.my_blocks() {
                pools.add_block(block)?;
            }
        }
        // A block taken back may hold VM addresses: mark them before any
        // allocation from it.
        let view = self.vms.view().clone();
        self.sync_reservations(&view);
        Ok(())
    }

    /// One address of each family. Never waits on the control plane while
    /// the node's blocks have room; when a family's blocks are full (cluster
    /// mode), claims a new block and tries again.
    async fn allocate(&self, only: Option<&[Family]>) -> Result<Vec<IpAddr>> {
        let families: Vec<Family> = match only {
            Some(f) => f.to_vec(),
            None => lock(&self.pools).families().to_vec(),
        };
        // Each round either allocates or adds a block; a handful of rounds
        // covers concurrent ADDs filling a new block before we get to it.
        for _round in 0..8 {
            let shortage = match lock(&self.pools).allocate_families(&families) {
                Ok(ips) => return Ok(ips),
                Err(s) => s,
            };
            let Some(cluster) = &self.cluster else {
                return Err(shortage.into());
            };
            for &family in &shortage.families {
                match self.grow(cluster, family).await {
                    Ok(()) => {}
                    Err(Error::TryAgain(why)) => {
                        return Err(Error::TryAgain(format!(
                            "{}, and a new {} block cannot be claimed: {why}",
                            shortage.detail,
                            family.name()
                        )))
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        Err(Error::TryAgain(
            "new blocks filled up faster than they could be claimed".into(),
        ))
    }

    /// The node's settings.
    pub fn config(&self) -> &NodeConfig {
        &self.config
    }

    /// The store in use.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// A snapshot of every attachment.
    pub fn attachments(&self) -> Vec<Attachment> {
        let mut v: Vec<_> = lock(&self.attachments).values().cloned().collect();
        v.sort_by(|a, b| a.key.cmp(&b.key));
        v
    }

    /// Pool usage: (cidr, used, free).
    pub fn pool_usage(&self) -> Vec<(IpNet, u128, u128)> {
        lock(&self.pools)
            .pools()
            .iter()
            .map(|p| (p.cidr(), p.used(), p.free()))
            .collect()
    }

    /// Kernel link deletions still running after their DEL replied.
    pub fn link_deletions_in_flight(&self) -> u64 {
        lock(&self.deleting).len() as u64
    }

    /// Waits until no background deletion of `host_ifname` is running.
    async fn wait_for_deletion(&self, host_ifname: &str) {
        loop {
            let Some(done) = lock(&self.deleting).get(host_ifname).cloned() else {
                return;
            };
            let notified = done.notified();
            tokio::pin!(notified);
            // Register before re-checking, so a wake-up between the check
            // and the wait is not lost.
            notified.as_mut().enable();
            if !lock(&self.deleting).contains_key(host_ifname) {
                return;
            }
            notified.await;
        }
    }

    async fn lock_key(&self, key: &AttachmentKey) -> KeyGuard<'_> {
        let m = lock(&self.key_locks)
            .entry(key.clone())
            .or_default()
            .clone();
        let guard = m.lock_owned().await;
        KeyGuard {
            guard: Some(guard),
            key: key.clone(),
            table: &self.key_locks,
        }
    }

    /// Makes the kernel agree with the store: re-adds missing host routes of
    /// recorded attachments and removes our routes and links that no record
    /// owns (left by a crash between a kernel change and its store commit).
    async fn reconcile(&self) -> Result<Reconciled> {
        let _sweep = self.sweep.write().await;
        let snapshot = self.attachments();
        let mut done = Reconciled {
            attachments: snapshot.len(),
            ..Default::default()
        };
        let links: HashSet<String> = self.dataplane.our_links().await?.into_iter().collect();
        // A VM pod gets host routes only while its record names it active.
        let routed: Vec<&Attachment> = snapshot.iter().filter(|a| self.routed_here(a)).collect();
        let mut owner: HashMap<IpAddr, &str> = HashMap::new();
        for a in &routed {
            for ip in &a.ips {
                owner.insert(*ip, &a.host_ifname);
            }
        }
        // One route per destination exists in the main table, so a route of
        // ours that is unowned or points at the wrong link is removed first
        // and the right one re-added below.
        let stale: Vec<IpAddr> = self
            .dataplane
            .our_routes()
            .await?
            .into_iter()
            .filter(|r| owner.get(&r.dst).copied() != r.oif.as_deref())
            .map(|r| r.dst)
            .collect();
        self.dataplane.remove_host_routes(&stale).await?;
        done.routes_removed = stale.len();
        for a in routed.iter().filter(|a| links.contains(&a.host_ifname)) {
            done.routes_added += self
                .dataplane
                .ensure_host_routes(&a.host_ifname, &a.ips)
                .await?;
        }
        let owned_links: HashSet<&str> = snapshot.iter().map(|a| a.host_ifname.as_str()).collect();
        let orphans: Vec<String> = links
            .into_iter()
            .filter(|l| !owned_links.contains(l.as_str()))
            .collect();
        self.dataplane.delete_links(&orphans).await?;
        done.links_removed = orphans.len();
        // The VM routes are checked against the kernel again too.
        self.force_vm_resync();
        Ok(done)
    }

    /// ADD: wires the attachment, or returns the recorded result when the
    /// same attachment is added again and its kernel state is intact.
    pub async fn add(&self, inv: &Invocation) -> Result<Vec<u8>> {
        let started = UnixNanos::now();
        let key = key_of(inv);
        let netns_path = inv.netns.clone().ok_or_else(|| Error::InvalidEnv {
            var: "CNI_NETNS",
            reason: "required for ADD".into(),
        })?;
        let vm_pod = vm::vm_pod(inv)?;
        let requested = vm::requested(inv)?;
        let _sweep = self.sweep.read().await;
        let _key = self.lock_key(&key).await;
        let netns = dataplane::open_netns(&netns_path)?;

        let existing = lock(&self.attachments).get(&key).cloned();
        if let Some(a) = existing {
            return self
                .add_again(inv, a, vm_pod.as_ref(), &netns, &netns_path)
                .await;
        }

        let host_ifname = dataplane::host_ifname(&key.network, &key.container_id, &key.ifname);
        if let Some(other) = lock(&self.attachments)
            .values()
            .find(|a| a.host_ifname == host_ifname)
        {
            return Err(Error::Internal(format!(
                "host interface name {host_ifname} of {key} collides with {}",
                other.key
            )));
        }
        self.wait_for_deletion(&host_ifname).await;
        let mtu = inv.conf.mtu.unwrap_or(self.config.mtu);
        // A VM pod's addresses come from its VM's record (and a migration
        // target is wired without being routed to); a plain pod's from the
        // pools.
        let (ips, mac, placement) = match &vm_pod {
            Some(pod) => {
                let p = self.place_vm(inv, pod, &requested).await?;
                let mac = Mac::parse_pod(&p.rec.mac, "the VM record's MAC")?;
                (p.rec.ips.clone(), mac, Some(p))
            }
            None => {
                let ips = self.addresses_for(&requested).await?;
                match self.mac_for(&requested, &ips) {
                    Ok(mac) => (ips, mac, None),
                    Err(e) => {
                        self.free_ips(&ips);
                        return Err(e);
                    }
                }
            }
        };
        let routed = placement
            .as_ref()
            .is_none_or(|p| p.role == vm::Role::Active);
        let attachment = Attachment {
            key: key.clone(),
            netns: netns_path.display().to_string(),
            ips: ips.clone(),
            mac: mac.to_string(),
            host_ifname: host_ifname.clone(),
            mtu,
            created_unix_nanos: started,
            pod_namespace: inv.args.pod_namespace.clone(),
            pod_name: inv.args.pod_name.clone(),
            pod_uid: inv.args.pod_uid.clone(),
            vm: vm_pod.as_ref().map(|p| p.key.clone()),
        };
        let wiring = wiring(&attachment, mac, &netns, &netns_path, routed);
        let store = self.store.clone();
        let record = attachment.clone();
        // The fsync of the store commit overlaps the netlink work.
        let (stored, wired_ok) = tokio::join!(
            blocking(move || store.insert(&record)),
            self.dataplane.wire(&wiring)
        );
        match (stored, wired_ok) {
            (Ok(()), Ok(())) => {}
            (stored, wired_ok) => {
                // Roll back whichever half succeeded; report the first error.
                let mut first = None;
                match stored {
                    Ok(()) => {
                        let store = self.store.clone();
                        let k = key.clone();
                        if let Err(e) = blocking(move || store.remove(&[k])).await {
                            tracing::error!(%key, error = %e, "rollback of the store record failed");
                        }
                    }
                    Err(e) => first = Some(e),
                }
                match wired_ok {
                    Ok(()) => {
                        if let Err(e) = self.dataplane.delete_link(&host_ifname).await {
                            tracing::error!(%key, error = %e, "rollback of the veth failed");
                        }
                    }
                    Err(e) => first = first.or(Some(e)),
                }
                match &placement {
                    Some(p) => {
                        self.undo_placement(p).await;
                        self.free_ips(&ips);
                    }
                    None => lock(&self.pools).release(&ips),
                }
                return Err(first.unwrap_or_else(|| Error::Internal("rollback".into())));
            }
        }
        let result = cni::render_add_result(&inv.conf, &wired(&attachment));
        match (&vm_pod, &placement) {
            (Some(pod), Some(p)) => {
                // In the table before the listener can see the VM announce.
                lock(&self.attachments).insert(key, attachment.clone());
                self.after_vm_add(pod, &attachment, p).await;
            }
            _ => {
                lock(&self.attachments).insert(key, attachment);
            }
        }
        result
    }

    /// A repeated ADD: the same result if the wiring is intact; rewired with
    /// the same addresses if not (e.g. the daemon died in the middle of the
    /// first ADD). A different netns is a conflict.
    async fn add_again(
        &self,
        inv: &Invocation,
        a: Attachment,
        vm_pod: Option<&vm::VmPod>,
        netns: &std::fs::File,
        netns_path: &Path,
    ) -> Result<Vec<u8>> {
        if Path::new(&a.netns) != netns_path {
            return Err(Error::AttachmentConflict(format!(
                "{} is already attached in {}, not {}",
                a.key,
                a.netns,
                netns_path.display()
            )));
        }
        let wiring = wiring(&a, stored_mac(&a)?, netns, netns_path, self.routed_here(&a));
        match self.dataplane.check(&wiring).await {
            Ok(()) => {}
            // Only a real difference is repaired; a failure to look (the
            // kernel busy, a netlink error) must not tear down a healthy pod.
            Err(e @ Error::Check { .. }) => {
                tracing::info!(key = %a.key, reason = %e, "repeated ADD found broken wiring; rewiring");
                self.wait_for_deletion(&a.host_ifname).await;
                self.dataplane.delete_link(&a.host_ifname).await?;
                self.dataplane.wire(&wiring).await?;
            }
            Err(e) => return Err(e),
        }
        if let Some(pod) = vm_pod {
            self.ready_annotation(pod, &a).await;
        }
        cni::render_add_result(&inv.conf, &wired(&a))
    }

    /// DEL: idempotent. `queued_at` is set for DELs replayed from the shim's
    /// queue: such a DEL must not remove an attachment created after it was
    /// queued.
    pub async fn del(&self, inv: &Invocation, queued_at: Option<UnixNanos>) -> Result<Vec<u8>> {
        let key = key_of(inv);
        let _sweep = self.sweep.read().await;
        let _key = self.lock_key(&key).await;
        let existing = lock(&self.attachments).get(&key).cloned();
        let Some(a) = existing else {
            // Nothing recorded. A link of that name can only be a leftover of
            // a failed rollback: remove it in the background.
            let host = dataplane::host_ifname(&key.network, &key.container_id, &key.ifname);
            self.delete_link_later(host);
            return Ok(cni::empty_result());
        };
        if queued_at.is_some_and(|q| a.created_unix_nanos > q) {
            tracing::info!(key = %a.key, "queued DEL is older than the attachment; skipped");
            return Ok(cni::empty_result());
        }
        self.release(&[a], inv.conf.vm_address_policy).await?;
        Ok(cni::empty_result())
    }

    /// Withdraws routes, removes records, frees addresses, and schedules the
    /// links' deletion. A VM pod first leaves its VM's record (which keeps
    /// the VM's addresses); if the control plane cannot take that change,
    /// nothing is released and the error is returned (the runtime retries
    /// a DEL).
    async fn release(&self, list: &[Attachment], policy: VmAddressPolicy) -> Result<()> {
        let mut ips: Vec<IpAddr> = Vec::new();
        for a in list {
            match &a.vm {
                None => ips.extend(a.ips.iter().copied()),
                Some(vm) => {
                    // Its routes follow the record unless the VM now runs
                    // nowhere.
                    if self.leave_vm_record(a, vm, policy).await? {
                        ips.extend(a.ips.iter().copied());
                    }
                }
            }
        }
        let keys: Vec<AttachmentKey> = list.iter().map(|a| a.key.clone()).collect();
        let store = self.store.clone();
        let (routes, stored) = tokio::join!(
            self.dataplane.remove_host_routes(&ips),
            blocking(move || store.remove(&keys))
        );
        routes?;
        stored?;
        {
            let mut attachments = lock(&self.attachments);
            for a in list {
                attachments.remove(&a.key);
            }
        }
        // A plain pod's addresses are its own; a VM pod's may still be held
        // by its record or by the VM's other pod here.
        let (vm_pods, plain): (Vec<&Attachment>, Vec<&Attachment>) =
            list.iter().partition(|a| a.vm.is_some());
        let plain_ips: Vec<IpAddr> = plain.iter().flat_map(|a| a.ips.clone()).collect();
        lock(&self.pools).release(&plain_ips);
        if !vm_pods.is_empty() {
            let vm_ips: Vec<IpAddr> = vm_pods.iter().flat_map(|a| a.ips.clone()).collect();
            self.free_ips(&vm_ips);
            self.force_vm_resync();
        }
        for a in list {
            self.delete_link_later(a.host_ifname.clone());
        }
        Ok(())
    }

    /// Deletes a link after the reply: the kernel's veth teardown is slow and
    /// nothing depends on it once the route and the record are gone. An ADD
    /// that needs the same name waits for it ([`Node::wait_for_deletion`]).
    fn delete_link_later(&self, host_ifname: String) {
        // A name already pending (a repeated DEL) keeps its entry, so that
        // an ADD already waiting on it is woken with the batch.
        lock(&self.deleting)
            .entry(host_ifname.clone())
            .or_insert_with(|| Arc::new(Notify::new()));
        lock(&self.doomed).push(host_ifname);
        self.doomed_queued.notify_one();
    }

    /// The deletion worker: takes everything queued and deletes it in one
    /// kernel batch, so a burst of DELs costs the kernel one teardown (and
    /// holds its RTNL lock once) instead of one per pod.
    ///
    /// The worker has a netlink socket of its own. The kernel handles a
    /// netlink request inside the `sendmsg` that carries it, and tearing
    /// veths down takes milliseconds, so on a shared socket every request
    /// behind the deletion waited for it: an ADD right after a DEL took
    /// 26 ms instead of 14 ms (debug build, measured here).
    fn spawn_deletion_worker(&self) -> Result<()> {
        let dataplane = Dataplane::connect()?;
        let deleting = self.deleting.clone();
        let doomed = self.doomed.clone();
        let queued = self.doomed_queued.clone();
        let delay = self.config.test_delete_delay;
        tokio::spawn(async move {
            loop {
                queued.notified().await;
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                let batch = std::mem::take(&mut *lock(&doomed));
                if batch.is_empty() {
                    continue;
                }
                if let Err(e) = dataplane.delete_links(&batch).await {
                    tracing::warn!(count = batch.len(), error = %e, "background link deletion failed");
                }
                let done: Vec<Arc<Notify>> = {
                    let mut map = lock(&deleting);
                    batch.iter().filter_map(|n| map.remove(n)).collect()
                };
                for n in done {
                    n.notify_waiters();
                }
            }
        });
        Ok(())
    }

    /// Waits (bounded) for background link deletions, for a clean shutdown.
    pub async fn quiesce(&self, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        while self.link_deletions_in_flight() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// CHECK: compares the kernel and the prevResult with the record.
    pub async fn check(&self, inv: &Invocation) -> Result<Vec<u8>> {
        let key = key_of(inv);
        let _sweep = self.sweep.read().await;
        let _key = self.lock_key(&key).await;
        let a = lock(&self.attachments).get(&key).cloned().ok_or_else(|| {
            Error::check(Mismatch::UnknownAttachment, format!("no attachment {key}"))
        })?;
        let netns_path = inv.netns.clone().unwrap_or_default();
        if Path::new(&a.netns) != netns_path {
            return Err(Error::check(
                Mismatch::PodInterface,
                format!("{key} lives in {}, not {}", a.netns, netns_path.display()),
            ));
        }
        let netns = dataplane::open_netns(&netns_path)?;
        let wiring = wiring(
            &a,
            stored_mac(&a)?,
            &netns,
            &netns_path,
            self.routed_here(&a),
        );
        self.dataplane.check(&wiring).await?;
        cni::check_prev_result(&inv.conf, &wired(&a))?;
        // A migration target whose pod is now marked ready: the runtime's
        // CHECK is one way the annotation reaches the daemon.
        if let Some(pod) = vm::vm_pod(inv)? {
            self.ready_annotation(&pod, &a).await;
        }
        Ok(cni::empty_result())
    }

    /// GC: releases every attachment of the network not listed as valid, then
    /// sweeps our links and routes that no attachment owns.
    pub async fn gc(&self, inv: &Invocation) -> Result<Vec<u8>> {
        let valid = inv
            .conf
            .valid_attachments
            .as_ref()
            .ok_or_else(|| Error::InvalidConfig("GC needs cni.dev/valid-attachments".into()))?;
        let valid: HashSet<(&str, &str)> = valid
            .iter()
            .map(|v| (v.container_id.as_str(), v.ifname.as_str()))
            .collect();
        let _sweep = self.sweep.write().await;
        let doomed: Vec<Attachment> = lock(&self.attachments)
            .values()
            .filter(|a| {
                a.key.network == inv.conf.name
                    && !valid.contains(&(a.key.container_id.as_str(), a.key.ifname.as_str()))
            })
            .cloned()
            .collect();
        if !doomed.is_empty() {
            tracing::info!(network = %inv.conf.name, count = doomed.len(), "GC releases attachments");
            let (vms, plain): (Vec<Attachment>, Vec<Attachment>) =
                doomed.into_iter().partition(|a| a.vm.is_some());
            self.release(&plain, inv.conf.vm_address_policy).await?;
            // A VM pod whose record cannot be changed now is kept for the
            // next GC rather than failing the others.
            for a in vms {
                if let Err(e) = self
                    .release(std::slice::from_ref(&a), inv.conf.vm_address_policy)
                    .await
                {
                    tracing::warn!(key = %a.key, error = %e, "GC could not release a VM pod yet");
                }
            }
        }
        drop(_sweep);
        let swept = self.reconcile().await?;
        if swept.links_removed + swept.routes_removed > 0 {
            tracing::info!(?swept, "GC swept orphans");
        }
        Ok(cni::empty_result())
    }

    /// STATUS: ready for ADD when the store answers and every pool has room.
    pub async fn status(&self) -> Result<Vec<u8>> {
        let store = self.store.clone();
        blocking(move || store.probe())
            .await
            .map_err(|e| Error::NotReady(format!("the state store does not answer: {e}")))?;
        let Some(shortage) = lock(&self.pools).shortage() else {
            return Ok(cni::empty_result());
        };
        let (detail, family) = (shortage.detail, shortage.families[0]);
        match &self.cluster {
            // A full block is fine while a new one can be claimed.
            Some(c) => match c.probe().await {
                Ok(()) => Ok(cni::empty_result()),
                Err(e) => Err(Error::NotReady(format!(
                    "{detail}, and no new {} block can be claimed: {e}",
                    family.name()
                ))),
            },
            None => Err(Error::NotReady(format!("pool exhausted: {detail}"))),
        }
    }
}
