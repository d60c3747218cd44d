//! The route manager: applies the routes the plan wants.

use super::plan::{self, ClusterSide, VmPlan, Want};
use crate::attach::Node;
use crate::cluster::{vtep_mac, vtep_underlay, Cluster, ClusterView, Overlay};
use crate::error::{Error, Result};
use crate::kernel::{ClusterRoute, NodeRoutes, VxlanConfig};
use crate::store::{Attachment, AttachmentKey};
use crate::time::UnixNanos;
use crate::vm::{RouteUpdateTiming, VmKey, VmView};
use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tether_base::sync::lock;
use tokio::sync::Notify;

/// What the route manager keeps between passes.
#[derive(Default)]
pub(crate) struct RouteState {
    /// The VM routes as last programmed, per VM; `None` after a failed
    /// pass. A pass that wants the same skips the kernel.
    pub(crate) vm_applied: Mutex<Option<HashMap<VmKey, Want>>>,
    /// The next pass must touch the kernel even if it wants the same (a
    /// route may have been removed under it). Kept apart from
    /// `vm_applied`, so that the pass still knows which VMs' routes it
    /// changes, for the route-update timings.
    pub(crate) vm_forced: AtomicBool,
    /// Wakes the manager for a pass.
    pub(crate) resync: Notify,
    /// The first pass over the cluster routes, at start-up, failed: the
    /// manager starts by retrying it.
    pub(crate) cluster_failed: AtomicBool,
}

impl Node {
    /// Makes the next VM sync touch the kernel even if the records did not
    /// change (a route may have been removed under it).
    pub(crate) fn force_vm_resync(&self) {
        self.routes.vm_forced.store(true, Ordering::SeqCst);
        self.routes.resync.notify_one();
    }

    /// Brings this node in line with the VM records: pool reservations,
    /// the pending migration targets, and routes.
    pub(crate) async fn sync_vms(&self, view: &VmView) -> Result<()> {
        if !view.synced {
            return Ok(());
        }
        // Taken before the local pods are read, so that a force that comes
        // in after that (a pod added meanwhile) makes another pass.
        let forced = self.routes.vm_forced.swap(false, Ordering::SeqCst);
        self.sync_reservations(view);
        let me = self.config.name.as_str();
        let local: HashMap<AttachmentKey, Attachment> = lock(&self.attachments)
            .iter()
            .filter(|(_, a)| a.vm.is_some())
            .map(|(k, a)| (k.clone(), a.clone()))
            .collect();
        let cluster = self.cluster.as_ref().map(|c| (c.me(), c.view()));
        let side = match (&self.cluster, &cluster) {
            (Some(c), Some((me, view))) => Some(ClusterSide {
                me,
                overlay: &c.config().overlay,
                view,
            }),
            _ => None,
        };
        let VmPlan {
            wants,
            targets: pending,
        } = plan::vm_routes(me, view, &local, side.as_ref());
        self.refresh_pending(pending, view).await;

        let previous = lock(&self.routes.vm_applied).clone();
        if !forced && previous.as_ref() == Some(&wants) {
            return Ok(());
        }
        let mut via: Vec<ClusterRoute> = wants.values().flat_map(|w| w.via.clone()).collect();
        via.sort();
        // First the routes to other nodes: on a migration's source they
        // replace the pod's host route in one change.
        self.kernel.sync_vm_routes(&via).await?;
        let mut here_ips = HashSet::new();
        for rec in view.records.values().map(|(r, _)| r) {
            if let Some(host) = wants.get(&rec.key).and_then(|w| w.here.as_ref()) {
                self.kernel.ensure_host_routes(host, &rec.ips).await?;
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
        self.kernel.remove_host_routes(&withdraw).await?;

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
            let mut stats = lock(&self.vm.stats);
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
        *lock(&self.routes.vm_applied) = Some(wants);
        Ok(())
    }

    /// Starts the route manager: one task that keeps this node's routes in
    /// step with the cluster view (routes to other nodes' blocks, VXLAN
    /// peers) and the VM records (routes to VM addresses), re-planning on
    /// every change and retrying every 500 ms while the kernel refuses.
    /// `cluster_failing` says the first cluster pass, at start-up, failed.
    pub(crate) fn spawn_route_manager(self: &Arc<Self>, cluster_failing: bool) {
        let node = self.clone();
        tokio::spawn(async move {
            let mut rx = node.vm.records.subscribe();
            let mut cluster_rx = node.cluster.as_ref().map(|c| c.subscribe());
            let mut cluster_failing = cluster_failing;
            let mut cluster_dirty = cluster_failing;
            let mut vm_failing = false;
            loop {
                let cluster_changed = async {
                    match cluster_rx.as_mut() {
                        Some(c) => c.changed().await.is_ok(),
                        None => std::future::pending().await,
                    }
                };
                let retry = async {
                    if cluster_failing || vm_failing {
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    } else {
                        std::future::pending::<()>().await;
                    }
                };
                tokio::select! {
                    r = rx.changed() => if r.is_err() { return },
                    changed = cluster_changed => cluster_dirty |= changed,
                    () = node.routes.resync.notified() => {},
                    () = retry => cluster_dirty |= cluster_failing,
                }
                if let (Some(c), Some(crx), true) =
                    (&node.cluster, cluster_rx.as_mut(), cluster_dirty)
                {
                    let view = crx.borrow_and_update().clone();
                    cluster_dirty = false;
                    // A stale view must not withdraw routes; the relisting
                    // that makes it current again is a change too.
                    if view.synced {
                        let outcome = program_cluster(c, node.kernel.as_ref(), &view).await.map(
                            |(added, removed)| {
                                if added + removed > 0 {
                                    tracing::info!(
                                        added,
                                        removed,
                                        revision = view.revision,
                                        "cluster routes updated"
                                    );
                                }
                            },
                        );
                        note(&mut cluster_failing, "cluster", &outcome);
                    } else {
                        cluster_failing = false;
                    }
                }
                let view = rx.borrow_and_update().clone();
                let outcome = node.sync_vms(&view).await;
                if outcome.is_err() {
                    *lock(&node.routes.vm_applied) = None;
                }
                note(&mut vm_failing, "VM", &outcome);
            }
        });
    }
}

/// Logs when one kind of route starts or stops failing (once each way),
/// and records whether it fails now.
fn note(failing: &mut bool, what: &str, outcome: &Result<()>) {
    match outcome {
        Ok(()) if *failing => tracing::info!("{what} routes programmed again"),
        Err(e) if !*failing => {
            tracing::warn!(error = %e, "programming {what} routes failed; retrying every 500 ms")
        }
        _ => {}
    }
    *failing = outcome.is_err();
}

/// Programs the routes to other nodes' blocks (and the VXLAN peers) that
/// the plan wants for `view`. Returns (added, removed) routes.
pub async fn program_cluster(
    c: &Cluster,
    kernel: &dyn NodeRoutes,
    view: &ClusterView,
) -> Result<(usize, usize)> {
    let me = c.me();
    let side = ClusterSide {
        me: &me,
        overlay: &c.config().overlay,
        view,
    };
    let (routes, peers) = plan::cluster_routes(&side);
    if let Overlay::Vxlan { .. } = c.config().overlay {
        kernel.sync_vxlan_peers(&peers).await?;
    }
    let synced = kernel.sync_cluster_routes(&routes).await?;
    Ok((synced.added, synced.removed))
}

/// Creates (or checks) the VXLAN device in vxlan mode, and removes a
/// leftover one in host-gw mode.
pub async fn prepare_overlay(c: &Cluster, kernel: &dyn NodeRoutes, pod_mtu: u32) -> Result<()> {
    match c.config().overlay {
        Overlay::HostGw => Ok(kernel.delete_vxlan().await?),
        Overlay::Vxlan { vni, port } => {
            let me = c.me();
            let local = vtep_underlay(&me.node_ips, &me.node_ips)
                .copied()
                .ok_or_else(|| Error::InvalidConfig("vxlan needs a node IP".into()))?;
            let underlay = kernel.underlay_mtu(local).await?.unwrap_or(1500);
            let overhead = if local.is_ipv4() { 50 } else { 70 };
            let mtu = underlay.saturating_sub(overhead);
            if pod_mtu > mtu {
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
            Ok(())
        }
    }
}
