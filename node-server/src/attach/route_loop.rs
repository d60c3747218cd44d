//! The route loop: one task that keeps this node's routes in step with the
//! cluster view and the VM records. It composes the parts: the plan
//! (`routing::plan`), the VM side (reservations, waiting targets, stats)
//! and route management (`routing::manager::Routes`), which owns what was
//! programmed.

use super::Node;
use crate::routing::manager::note;
use crate::routing::plan::{self, ClusterSide, VmPlan};
use crate::vm::VmView;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tether_base::error::Result;
use tether_base::sync::lock;
use tether_store::store::{Attachment, AttachmentKey};

/// How often unused anchors are removed.
const ANCHOR_PRUNE: Duration = Duration::from_secs(30);

impl Node {
    /// Makes the next VM pass touch the kernel even if the records did not
    /// change (a route may have been removed under it).
    pub(crate) fn force_vm_resync(&self) {
        self.routes.force_vm_resync();
    }

    /// Brings this node in line with the VM records: pool reservations,
    /// the pending migration targets, and routes.
    pub(crate) async fn sync_vms(&self, view: &VmView) -> Result<()> {
        if !view.synced {
            return Ok(());
        }
        // Taken before the local pods are read, so that a force that comes
        // in after that (a pod added meanwhile) makes another pass.
        let forced = self.routes.take_forced();
        self.vms.sync_reservations(self, view);
        // Other nodes' cutover notices forecast records being written.
        let forecast = self.vms.routed_view(view);
        let view = forecast.as_ref().unwrap_or(view);
        let me = self.config.name.as_str();
        let local: HashMap<AttachmentKey, Attachment> = lock(&self.attachments)
            .iter()
            .filter(|(_, a)| a.vm.is_some())
            .map(|(k, a)| (k.clone(), a.clone()))
            .collect();
        let peers = self.peers.as_ref().map(|c| (c.me(), c.overlay(), c.view()));
        let side = peers
            .as_ref()
            .map(|(me, overlay, view)| ClusterSide { me, overlay, view });
        let VmPlan {
            wants,
            targets: pending,
        } = plan::vm_routes(me, view, &local, side.as_ref());
        self.vms.refresh_pending(self, pending, view).await;
        // A VM that leaves this node in these routes keeps the translations
        // of the connections that entered here toward it.
        self.handovers.before_reroute(view).await;
        let updates = self
            .routes
            .apply_vm_routes(view, &local, wants, forced)
            .await?;
        self.vms.note_route_updates(updates);
        Ok(())
    }

    /// Every `every`, makes the next route pass a full one (the kernel's
    /// routes read back and repaired); between them, passes change only
    /// what the views changed.
    pub fn spawn_route_repair(self: &Arc<Self>, every: Duration) -> tokio::task::JoinHandle<()> {
        let node = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                node.routes.force_repair();
            }
        })
    }

    /// Starts the background tasks of the VMs: the listener for migrated
    /// VMs' announcements and the loop that keeps routes and reservations
    /// in step with the records. Without the listener (no CAP_NET_RAW),
    /// cutovers still happen on the target-ready annotation and the admin
    /// call; that is logged.
    pub fn start_vm_tasks(self: &Arc<Self>) {
        match self.host.announcements() {
            Ok(listener) => self.vms.spawn_announce_loop(self.clone(), listener),
            Err(e) => tracing::error!(
                error = %e,
                "cannot listen for migrated VMs' announcements: cutovers only on the annotation or the admin call"
            ),
        }
        self.spawn_route_manager(self.routes.cluster_failed());
        self.spawn_anchor_pruner();
    }

    /// Every [`ANCHOR_PRUNE`], removes the handover's anchors that no flow
    /// uses any more, and those (with their flows) of nodes gone from the
    /// cluster.
    fn spawn_anchor_pruner(self: &Arc<Self>) {
        let Some(peers) = self.peers.clone() else {
            return;
        };
        let handovers = self.handovers.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(ANCHOR_PRUNE);
            loop {
                tick.tick().await;
                let view = peers.view();
                if view.synced {
                    handovers.prune_anchors(&view).await;
                }
            }
        });
    }

    /// Starts the route manager: one task that keeps this node's routes in
    /// step with the cluster view (routes to other nodes' blocks, VXLAN
    /// peers) and the VM records (routes to VM addresses), re-planning on
    /// every change and retrying every 500 ms while the kernel refuses.
    /// `cluster_failing` says the first cluster pass, at start-up, failed.
    ///
    /// Its first pass runs at once, before it waits for a change: the
    /// views it subscribes to count as seen from the moment it subscribes,
    /// so a block or a VM record that arrived after the start-up pass (a
    /// node that claimed its first block while this one was starting)
    /// would otherwise wait for the next change, which in a quiet cluster
    /// may never come.
    pub(crate) fn spawn_route_manager(self: &Arc<Self>, cluster_failing: bool) {
        let node = self.clone();
        tokio::spawn(async move {
            let mut rx = node.vms.records().subscribe();
            let mut cluster_rx = node.peers.as_ref().map(|c| c.subscribe());
            let mut cluster_failing = cluster_failing;
            let mut cluster_dirty = true;
            // The next cluster pass reads the kernel back (a repair).
            let mut cluster_full = false;
            let mut vm_failing = false;
            let mut first = true;
            loop {
                if !std::mem::take(&mut first) {
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
                        () = node.routes.resync_asked() => {
                            let forced = node.routes.take_cluster_forced();
                            cluster_dirty |= forced;
                            cluster_full |= forced;
                        },
                        () = retry => cluster_dirty |= cluster_failing,
                    }
                }
                if let (Some(c), Some(crx), true) =
                    (&node.peers, cluster_rx.as_mut(), cluster_dirty)
                {
                    let view = crx.borrow_and_update().clone();
                    cluster_dirty = false;
                    // A stale view must not withdraw routes; the relisting
                    // that makes it current again is a change too.
                    if view.synced {
                        let full = std::mem::take(&mut cluster_full);
                        let outcome = node
                            .routes
                            .program_cluster(c.as_ref(), &view, full)
                            .await
                            .map(|p| {
                                let (added, removed) = (p.added, p.removed);
                                if added + removed > 0 {
                                    tracing::info!(
                                        added,
                                        removed,
                                        revision = view.revision,
                                        "cluster routes updated"
                                    );
                                }
                            });
                        note(&mut cluster_failing, "cluster", &outcome);
                    } else {
                        cluster_failing = false;
                    }
                }
                let view = rx.borrow_and_update().clone();
                let outcome = node.sync_vms(&view).await;
                if outcome.is_err() {
                    node.routes.forget_vm_routes();
                }
                note(&mut vm_failing, "VM", &outcome);
                if view.synced {
                    node.handovers.sync(&node, &view).await;
                }
            }
        });
    }
}
