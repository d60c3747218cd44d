//! The route manager: applies the routes the plan wants.

use super::plan::{self, ClusterSide, Want};
use crate::cluster::{vtep_mac, vtep_underlay, ClusterView, Overlay, Peers};
use crate::vm::{RouteUpdateTiming, VmKey, VmView};
use ipnet::IpNet;
use std::collections::{HashMap, HashSet, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tether_base::error::{Error, Result};
use tether_base::sync::lock;
use tether_base::time::UnixNanos;
use tether_kernel::{ClusterRoute, Kernel, NodeRoutes, Synced, VxlanConfig, VxlanPeer};
use tether_store::store::{Attachment, AttachmentKey};
use tokio::sync::Notify;

/// Route management: the VM routes it programmed last, whether the next
/// pass must program them again, and the wake-up of the loop that runs it.
/// It owns its state and the kernel handle; what a pass needs of the VM
/// records and of the local pods is handed to it.
pub struct Routes {
    kernel: Arc<dyn Kernel>,
    /// The VM routes as last programmed, per VM; `None` after a failed
    /// pass. A pass that wants the same skips the kernel.
    vm_applied: Mutex<Option<HashMap<VmKey, Want>>>,
    /// The next pass must be a full one: read the kernel's VM routes back
    /// and make them exactly what it wants (a route may have been removed
    /// under it). Kept apart from `vm_applied`, so that the pass still
    /// knows which VMs' routes it changes, for the route-update timings.
    vm_forced: AtomicBool,
    /// VMs whose routes the next pass programs again even if it wants
    /// the same for them (a local pod of theirs came or went).
    vm_dirty: Mutex<HashSet<VmKey>>,
    /// The next pass reads the routes to other nodes' blocks back too.
    cluster_forced: AtomicBool,
    /// Wakes the loop for a pass.
    resync: Notify,
    /// The first pass over the cluster routes, at start-up, failed: the
    /// loop starts by retrying it.
    cluster_failed: AtomicBool,
    /// The routes to other nodes' blocks in place, and when each came.
    block_routes: Mutex<BlockRoutes>,
    /// The routes to other nodes' blocks and the VXLAN peers as last
    /// programmed; `None` before the first pass and after a failed one.
    /// A pass that has them changes only what differs.
    cluster_applied: Mutex<Option<ClusterApplied>>,
}

impl Routes {
    /// Route management on `kernel`, nothing programmed yet.
    pub fn new(kernel: Arc<dyn Kernel>) -> Routes {
        Routes {
            kernel,
            vm_applied: Mutex::new(None),
            vm_forced: AtomicBool::new(false),
            vm_dirty: Mutex::default(),
            cluster_forced: AtomicBool::new(false),
            resync: Notify::new(),
            cluster_failed: AtomicBool::new(false),
            block_routes: Mutex::default(),
            cluster_applied: Mutex::new(None),
        }
    }

    /// Programs the routes to other nodes' blocks (and the VXLAN peers)
    /// that the plan wants for `view`: a full pass if `full` or if the
    /// last one failed or none ran, else only the changes since the last
    /// pass. A pass that succeeds notes its routes
    /// ([`Routes::note_cluster_routes`]).
    pub async fn program_cluster(
        &self,
        c: &dyn Peers,
        view: &ClusterView,
        full: bool,
    ) -> Result<ProgrammedCluster> {
        // Taken: a pass that fails leaves none, and the next is full.
        let previous = lock(&self.cluster_applied).take().filter(|_| !full);
        let (programmed, applied) =
            program_cluster(c, self.kernel.as_ref(), view, previous.as_ref()).await?;
        *lock(&self.cluster_applied) = Some(applied);
        self.note_cluster_routes(&programmed.dsts);
        Ok(programmed)
    }

    /// Makes the next VM pass a full one, which reads the kernel's VM
    /// routes back and repairs them (a route may have been removed under
    /// it), and wakes the loop.
    pub fn force_vm_resync(&self) {
        self.vm_forced.store(true, Ordering::SeqCst);
        self.resync.notify_one();
    }

    /// Makes the next pass a full one for every route, to other nodes'
    /// blocks and to VMs: the periodic repair of what was changed under
    /// tether (a route deleted by hand).
    pub fn force_repair(&self) {
        self.cluster_forced.store(true, Ordering::SeqCst);
        self.force_vm_resync();
    }

    /// Whether a repair of the routes to other nodes' blocks was asked
    /// since the last call; clears it.
    pub fn take_cluster_forced(&self) -> bool {
        self.cluster_forced.swap(false, Ordering::SeqCst)
    }

    /// Makes the next VM pass program `vm`'s routes even if the records
    /// did not change (a local pod of the VM came or went), and wakes the
    /// loop.
    pub fn resync_vm(&self, vm: &VmKey) {
        lock(&self.vm_dirty).insert(vm.clone());
        self.resync.notify_one();
    }

    /// Wakes the loop for a pass, which touches the kernel only if the
    /// routes it wants changed.
    pub fn wake(&self) {
        self.resync.notify_one();
    }

    /// What was forced since the last call (a full pass, VMs to program
    /// again); clears it.
    pub fn take_forced(&self) -> Forced {
        Forced {
            full: self.vm_forced.swap(false, Ordering::SeqCst),
            vms: std::mem::take(&mut *lock(&self.vm_dirty)),
        }
    }

    /// Waits for [`Routes::force_vm_resync`].
    pub async fn resync_asked(&self) {
        self.resync.notified().await;
    }

    /// Records whether the first cluster pass failed.
    pub fn set_cluster_failed(&self, failed: bool) {
        self.cluster_failed.store(failed, Ordering::Relaxed);
    }

    /// Whether the first cluster pass failed.
    pub fn cluster_failed(&self) -> bool {
        self.cluster_failed.load(Ordering::Relaxed)
    }

    /// Forgets what was programmed (after a failed pass): the next pass
    /// programs everything it wants.
    pub fn forget_vm_routes(&self) {
        *lock(&self.vm_applied) = None;
    }

    /// Programs the VM routes the plan `wants` for the records of `view`,
    /// given the local VM pods `local`. A full pass (the first, one after a
    /// failure, or one `forced`) reads the kernel's VM routes back and makes
    /// them exactly what is wanted; any other pass changes only the routes
    /// of the VMs whose wants differ from the last pass's (or that were
    /// forced), without reading the kernel, and does nothing when none
    /// does. Returns the timings of the route updates of the VMs whose
    /// routes changed here, the most recently cut-over one last.
    pub async fn apply_vm_routes(
        &self,
        view: &VmView,
        local: &HashMap<AttachmentKey, Attachment>,
        wants: HashMap<VmKey, Want>,
        forced: Forced,
    ) -> Result<Vec<RouteUpdateTiming>> {
        // Taken, not copied: a pass that fails leaves none (the next one
        // is full, as after `forget_vm_routes`), one that succeeds puts
        // its wants back.
        let previous = lock(&self.vm_applied).take();
        match previous.as_ref().filter(|_| !forced.full) {
            Some(prev) => {
                let changed: HashSet<&VmKey> = wants
                    .keys()
                    .chain(prev.keys())
                    .chain(forced.vms.iter())
                    .filter(|k| prev.get(*k) != wants.get(*k) || forced.vms.contains(*k))
                    .collect();
                if changed.is_empty() {
                    // The same wants as the last pass's: kept as they are.
                    *lock(&self.vm_applied) = Some(wants);
                    return Ok(Vec::new());
                }
                self.apply_changed(view, local, prev, &wants, &changed)
                    .await?;
            }
            None => self.apply_all(view, local, &wants).await?,
        }

        // Timings, for the records whose routes changed here.
        let done = UnixNanos::now();
        let changed = view.records.values().map(|(r, _)| r).filter(|r| {
            previous
                .as_ref()
                .is_some_and(|p| p.get(&r.key) != wants.get(&r.key))
        });
        let mut updates: Vec<RouteUpdateTiming> = changed
            .map(|r| RouteUpdateTiming {
                vm: r.key.clone(),
                generation: r.generation,
                done_unix_nanos: done,
                since_trigger: r
                    .last_cutover
                    .as_ref()
                    .map(|c| done.saturating_duration_since(c.seen_unix_nanos)),
            })
            .collect();
        let trigger = |u: &RouteUpdateTiming| {
            view.records
                .get(&u.vm)
                .and_then(|(r, _)| r.last_cutover.as_ref())
                .map_or(UnixNanos::EPOCH, |c| c.seen_unix_nanos)
        };
        updates.sort_by_key(trigger);
        *lock(&self.vm_applied) = Some(wants);
        Ok(updates)
    }

    /// The full pass: every VM's routes, the kernel's read back.
    async fn apply_all(
        &self,
        view: &VmView,
        local: &HashMap<AttachmentKey, Attachment>,
        wants: &HashMap<VmKey, Want>,
    ) -> Result<()> {
        let mut via: Vec<ClusterRoute> = wants.values().flat_map(|w| w.via.clone()).collect();
        via.sort();
        // First the routes to other nodes: on a migration's source they
        // replace the pod's host route in one change.
        count_vm_routes(self.kernel.sync_vm_routes(&via).await?);
        let mut here_ips = HashSet::new();
        for rec in view.records.values().map(|(r, _)| r) {
            if let Some(host) = wants.get(&rec.key).and_then(|w| w.here.as_ref()) {
                let put_back = self.kernel.ensure_host_routes(host, &rec.ips).await?;
                crate::metrics::get().routes_changed("vm", put_back);
                here_ips.extend(rec.ips.iter().copied());
            }
        }
        // Then the host routes of local VM pods that must not receive the
        // VM's traffic (a target before the cutover has none; a source
        // after it had its route replaced above).
        self.withdraw(local.values(), &here_ips, &via).await
    }

    /// The pass over the VMs `changed` since the last pass (`prev`): their
    /// wanted routes to other nodes put in place (replacing a host route in
    /// one change, as in the full pass), those no longer wanted deleted,
    /// their host routes here ensured, and their local pods' host routes
    /// withdrawn where they must not receive the VM's traffic.
    async fn apply_changed(
        &self,
        view: &VmView,
        local: &HashMap<AttachmentKey, Attachment>,
        prev: &HashMap<VmKey, Want>,
        wants: &HashMap<VmKey, Want>,
        changed: &HashSet<&VmKey>,
    ) -> Result<()> {
        let via_of = |m: &HashMap<VmKey, Want>, k: &VmKey| -> Vec<ClusterRoute> {
            m.get(k).map(|w| w.via.clone()).unwrap_or_default()
        };
        let mut put = Vec::new();
        let mut gone = Vec::new();
        for k in changed {
            let now = via_of(wants, k);
            gone.extend(
                via_of(prev, k)
                    .into_iter()
                    .filter(|r| !now.iter().any(|n| n.dst == r.dst)),
            );
            put.extend(now);
        }
        put.sort();
        gone.sort();
        count_vm_routes(self.kernel.change_vm_routes(&put, &gone).await?);
        let mut here_ips = HashSet::new();
        for k in changed {
            let host = wants.get(*k).and_then(|w| w.here.as_ref());
            if let (Some(host), Some((rec, _))) = (host, view.records.get(*k)) {
                let put_back = self.kernel.ensure_host_routes(host, &rec.ips).await?;
                crate::metrics::get().routes_changed("vm", put_back);
                here_ips.extend(rec.ips.iter().copied());
            }
        }
        let theirs = local
            .values()
            .filter(|a| a.vm.as_ref().is_some_and(|v| changed.contains(v)));
        self.withdraw(theirs, &here_ips, &put).await
    }

    /// Removes the host routes of the local VM pods `pods` whose addresses
    /// are neither routed here nor to another node by `via`.
    async fn withdraw<'a>(
        &self,
        pods: impl Iterator<Item = &'a Attachment>,
        here_ips: &HashSet<IpAddr>,
        via: &[ClusterRoute],
    ) -> Result<()> {
        let via_dsts: HashSet<IpAddr> = via.iter().map(|r| r.dst.addr()).collect();
        let withdraw: Vec<IpAddr> = pods
            .flat_map(|a| a.ips.iter().copied())
            .filter(|ip| !here_ips.contains(ip) && !via_dsts.contains(ip))
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        if !withdraw.is_empty() {
            self.kernel.remove_host_routes(&withdraw).await?;
        }
        Ok(())
    }

    /// Notes the routes to other nodes' blocks a successful pass left in
    /// place: each destination not in place after the previous pass is
    /// timed now.
    pub fn note_cluster_routes(&self, dsts: &[IpNet]) {
        let done = UnixNanos::now();
        let mut h = lock(&self.block_routes);
        let now: HashSet<IpNet> = dsts.iter().copied().collect();
        for dst in dsts {
            if !h.programmed.contains(dst) {
                crate::vm::push_recent(
                    &mut h.added,
                    BlockRouteTiming {
                        dst: *dst,
                        done_unix_nanos: done,
                    },
                );
            }
        }
        h.programmed = now;
    }

    /// The last [`crate::vm::RECENT`] routes to other nodes' blocks added,
    /// oldest first.
    pub fn recent_block_routes(&self) -> Vec<BlockRouteTiming> {
        lock(&self.block_routes).added.iter().cloned().collect()
    }
}

/// What the next VM pass must do even if the records did not change.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Forced {
    /// A full pass: read the kernel's VM routes back and repair them.
    pub full: bool,
    /// VMs whose routes are programmed again.
    pub vms: HashSet<VmKey>,
}

/// When a route to another node's block was first in place here.
#[derive(Debug, Clone)]
pub struct BlockRouteTiming {
    /// The block.
    pub dst: IpNet,
    /// When the pass that added it ended, ns since the epoch.
    pub done_unix_nanos: UnixNanos,
}

/// The routes to other nodes' blocks: those in place after the last
/// successful pass, and when each was added.
#[derive(Debug, Default)]
struct BlockRoutes {
    programmed: HashSet<IpNet>,
    added: VecDeque<BlockRouteTiming>,
}

/// Logs when one kind of route starts or stops failing (once each way),
/// and records whether it fails now.
pub(crate) fn note(failing: &mut bool, what: &str, outcome: &Result<()>) {
    match outcome {
        Ok(()) if *failing => tracing::info!("{what} routes programmed again"),
        Err(e) if !*failing => {
            tracing::warn!(error = %e, "programming {what} routes failed; retrying every 500 ms")
        }
        _ => {}
    }
    *failing = outcome.is_err();
}

/// What one pass over the routes to other nodes' blocks did.
#[derive(Debug)]
pub struct ProgrammedCluster {
    /// Routes added and removed.
    pub added: usize,
    pub removed: usize,
    /// Every block routed to another node now.
    pub dsts: Vec<IpNet>,
}

/// The routes to other nodes' blocks and the VXLAN peers as a pass left
/// them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct ClusterApplied {
    /// Sorted.
    pub routes: Vec<ClusterRoute>,
    /// Sorted.
    pub peers: Vec<VxlanPeer>,
}

/// Programs the routes to other nodes' blocks (and the VXLAN peers) that
/// the plan wants for `view`, as `c` sees the cluster. Without `previous`
/// (a full pass: the first, one after a failure, a repair) it reads the
/// kernel's routes and peers back and makes them exactly what is wanted;
/// with it, it changes only the routes that differ from `previous`, and
/// the peers only if they differ, without reading the kernel: a block
/// claimed elsewhere costs one route added. Returns how many routes it
/// added and removed and the destinations now in place, and what it
/// left.
async fn program_cluster(
    c: &dyn Peers,
    kernel: &dyn NodeRoutes,
    view: &ClusterView,
    previous: Option<&ClusterApplied>,
) -> Result<(ProgrammedCluster, ClusterApplied)> {
    let me = c.me();
    let overlay = c.overlay();
    let side = ClusterSide {
        me: &me,
        overlay: &overlay,
        view,
    };
    let (routes, peers) = plan::cluster_routes(&side);
    let costs = crate::metrics::get();
    if let Overlay::Vxlan { .. } = overlay {
        if previous.is_none_or(|p| p.peers != peers) {
            let synced = kernel.sync_vxlan_peers(&peers).await?;
            costs.routes_changed("block", synced.added + synced.removed);
        }
    }
    let synced = match previous {
        None => kernel.sync_cluster_routes(&routes).await?,
        Some(p) => {
            let (put, gone) = route_changes(&p.routes, &routes);
            if put.is_empty() && gone.is_empty() {
                Synced::default()
            } else {
                kernel.change_cluster_routes(&put, &gone).await?
            }
        }
    };
    costs.routes_changed("block", synced.added + synced.removed);
    let programmed = ProgrammedCluster {
        added: synced.added,
        removed: synced.removed,
        dsts: routes.iter().map(|r| r.dst).collect(),
    };
    Ok((programmed, ClusterApplied { routes, peers }))
}

/// What turns the routes `was` into `now`: those to add or replace (new,
/// or with another next hop), and those to delete (their destination no
/// longer wanted; one with another next hop is replaced, never deleted
/// first).
fn route_changes(
    was: &[ClusterRoute],
    now: &[ClusterRoute],
) -> (Vec<ClusterRoute>, Vec<ClusterRoute>) {
    let was_set: HashSet<&ClusterRoute> = was.iter().collect();
    let now_dsts: HashSet<IpNet> = now.iter().map(|r| r.dst).collect();
    let put = now
        .iter()
        .filter(|r| !was_set.contains(r))
        .cloned()
        .collect();
    let gone = was
        .iter()
        .filter(|r| !now_dsts.contains(&r.dst))
        .cloned()
        .collect();
    (put, gone)
}

/// Creates (or checks) the VXLAN device in vxlan mode, and removes a
/// leftover one in host-gw mode. Returns the VXLAN device's MTU (the
/// underlay's less the encapsulation), or `None` in host-gw mode.
/// `pod_mtu` is the operator's `--mtu`, if given: one larger than the
/// device's is warned about.
pub async fn prepare_overlay(
    c: &dyn Peers,
    kernel: &dyn NodeRoutes,
    pod_mtu: Option<u32>,
) -> Result<Option<u32>> {
    match c.overlay() {
        Overlay::HostGw => {
            kernel.delete_vxlan().await?;
            Ok(None)
        }
        Overlay::Vxlan { vni, port } => {
            let me = c.me();
            let local = vtep_underlay(&me.node_ips, &me.node_ips)
                .copied()
                .ok_or_else(|| Error::InvalidConfig("vxlan needs a node IP".into()))?;
            let underlay = kernel.underlay_mtu(local).await?.unwrap_or(1500);
            let overhead = if local.is_ipv4() { 50 } else { 70 };
            let mtu = underlay.saturating_sub(overhead);
            if let Some(pod_mtu) = pod_mtu.filter(|&m| m > mtu) {
                tracing::warn!(
                    pod_mtu,
                    vxlan_mtu = mtu,
                    "the pod MTU is larger than the VXLAN device's; set --mtu {mtu}"
                );
            }
            kernel
                .ensure_vxlan(&VxlanConfig {
                    vni,
                    port,
                    local,
                    mac: vtep_mac(me.id),
                    mtu,
                })
                .await?;
            Ok(Some(mtu))
        }
    }
}

/// Counts a VM pass's changes to routes toward other nodes.
fn count_vm_routes(synced: tether_kernel::Synced) {
    crate::metrics::get().routes_changed("vm", synced.added + synced.removed);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::{push_recent, RECENT};

    #[test]
    fn a_block_route_is_timed_once_when_it_first_is_in_place() {
        let routes = Routes::new(Arc::new(tether_kernel::fake::FakeKernel::new()));
        let net = |s: &str| s.parse::<IpNet>().expect("a CIDR");
        routes.note_cluster_routes(&[net("10.244.0.4/30")]);
        routes.note_cluster_routes(&[net("10.244.0.4/30"), net("10.244.0.8/30")]);
        routes.note_cluster_routes(&[net("10.244.0.8/30")]);
        let added: Vec<IpNet> = routes.recent_block_routes().iter().map(|b| b.dst).collect();
        assert_eq!(added, [net("10.244.0.4/30"), net("10.244.0.8/30")]);
        // Withdrawn and back: in place again, timed again.
        routes.note_cluster_routes(&[net("10.244.0.4/30"), net("10.244.0.8/30")]);
        assert_eq!(routes.recent_block_routes().len(), 3);
    }

    #[tokio::test]
    async fn a_pass_changes_only_the_vms_that_changed_and_a_repair_reads_the_kernel_back() {
        use tether_kernel::fake::{Call, FakeKernel};
        let kernel = FakeKernel::new();
        let routes = Routes::new(Arc::new(kernel.clone()));
        let vm = |i: usize| VmKey::new("ns", &format!("vm{i}"), "eth0").expect("a key");
        let ip = |i: usize| -> IpAddr { format!("10.1.0.{i}").parse().expect("an address") };
        let via = |i: usize, node: u8| ClusterRoute {
            dst: IpNet::from(ip(i)),
            via: IpAddr::from([192, 168, 0, node]),
            onlink_dev: None,
        };
        let want = |r: ClusterRoute| Want {
            here: None,
            via: vec![r],
        };
        let (view, local) = (VmView::default(), HashMap::new());
        let mut wants: HashMap<VmKey, Want> = (0..100).map(|i| (vm(i), want(via(i, 2)))).collect();
        let pass = |wants: &HashMap<VmKey, Want>, forced: Forced| {
            routes.apply_vm_routes(&view, &local, wants.clone(), forced)
        };

        // The first pass is full: it reads the kernel's VM routes back.
        let costs = || crate::metrics::get().costs().routes_changed;
        let before = costs();
        pass(&wants, Forced::default()).await.expect("applied");
        assert_eq!(kernel.calls(Call::SyncVmRoutes), 1);
        assert_eq!(kernel.routes().len(), 100);
        // Counted (other tests feed the same counter: at least these).
        assert!(costs() >= before + 100);

        // vm3 moves to another node and vm5's record goes; meanwhile
        // someone deletes vm7's route by hand. The pass changes vm3's and
        // vm5's routes alone, without reading the kernel.
        kernel.clear_log();
        kernel.drop_route(ip(7));
        wants.insert(vm(3), want(via(3, 3)));
        wants.remove(&vm(5));
        let before = costs();
        pass(&wants, Forced::default()).await.expect("applied");
        assert_eq!(
            kernel.log(),
            [(Call::ChangeVmRoutes, "10.1.0.3/32,10.1.0.5/32".to_string())]
        );
        assert!(costs() >= before + 2);
        let via_of = |i: usize| kernel.route_to(ip(i)).and_then(|r| r.via);
        assert_eq!(via_of(3), Some(IpAddr::from([192, 168, 0, 3])));
        assert_eq!(via_of(5), None);
        assert_eq!(via_of(7), None, "not read back: not repaired yet");
        assert_eq!(via_of(8), Some(IpAddr::from([192, 168, 0, 2])));

        // Nothing changed: nothing touches the kernel.
        kernel.clear_log();
        pass(&wants, Forced::default()).await.expect("applied");
        assert!(kernel.log().is_empty(), "{:?}", kernel.log());

        // A VM forced (a local pod of it came) has its routes put again,
        // alone.
        routes.resync_vm(&vm(9));
        pass(&wants, routes.take_forced()).await.expect("applied");
        assert_eq!(
            kernel.log(),
            [(Call::ChangeVmRoutes, "10.1.0.9/32".to_string())]
        );

        // The repair is a full pass: vm7's route is back.
        kernel.clear_log();
        routes.force_repair();
        assert!(routes.take_cluster_forced());
        let forced = routes.take_forced();
        assert!(forced.full);
        pass(&wants, forced).await.expect("applied");
        assert_eq!(kernel.calls(Call::SyncVmRoutes), 1);
        assert_eq!(via_of(7), Some(IpAddr::from([192, 168, 0, 2])));
        assert_eq!(kernel.routes().len(), 99);
    }

    #[test]
    fn the_recent_lists_keep_the_newest() {
        let mut list = VecDeque::new();
        for i in 0..RECENT + 10 {
            push_recent(&mut list, i);
        }
        assert_eq!(list.len(), RECENT);
        assert_eq!(list.front(), Some(&10));
        assert_eq!(list.back(), Some(&(RECENT + 9)));
    }
}
