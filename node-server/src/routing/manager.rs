//! The route manager: applies the routes the plan wants.

use crate::attach::{lock, Node};
use crate::error::Result;
use crate::ipam::Family;
use crate::kernel::ClusterRoute;
use crate::mac::Mac;
use crate::store::{Attachment, AttachmentKey};
use crate::vm::records::{now_nanos, VmAttachment, VmKey, VmView};
use crate::vm::{host_net, FoundTarget, RouteUpdateTiming, Want};
use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

impl Node {
    /// Makes the next VM sync touch the kernel even if the records did not
    /// change (a route may have been removed under it).
    pub(crate) fn force_vm_resync(&self) {
        *lock(&self.vm_wants) = None;
        self.vm_resync.notify_one();
    }

    /// Brings this node in line with the VM records: pool reservations,
    /// the pending migration targets, and routes.
    pub(crate) async fn sync_vms(&self, view: &VmView) -> Result<()> {
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
        let done = now_nanos();
        let changed = view.records.values().map(|(r, _)| r).filter(|r| {
            previous
                .as_ref()
                .is_some_and(|p| p.get(&r.key) != wants.get(&r.key))
        });
        if let Some(latest) =
            changed.max_by_key(|r| r.last_cutover.as_ref().map_or(0, |c| c.seen_unix_nanos))
        {
            let mut stats = lock(&self.vm_stats);
            stats.route_updates += 1;
            stats.last_route_update = Some(RouteUpdateTiming {
                vm: latest.key.clone(),
                generation: latest.generation,
                done_unix_nanos: done,
                since_trigger: latest
                    .last_cutover
                    .as_ref()
                    .map(|c| Duration::from_nanos(done.saturating_sub(c.seen_unix_nanos))),
            });
        }
        *lock(&self.vm_wants) = Some(wants);
        Ok(())
    }

    pub(crate) fn spawn_vm_sync_loop(self: &Arc<Self>) {
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
