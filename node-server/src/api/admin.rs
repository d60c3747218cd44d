//! The `tether.admin.v1.Admin` gRPC service for operators, meant to be used
//! with grpcurl: read-only views of the node, its attachments and the
//! cluster, and the VM address calls (cutover, release, reservation).

use crate::api::cni::{verb_name, Stats, VERBS};
use crate::api::pending_del;
use crate::attach::Node;
use crate::pools::PoolUsage;
use crate::vm::{Trigger, VmAttachment, VmKey, VmRecord};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tether_base::error::Error;
use tether_base::time::UnixNanos;
use tether_proto::admin::v1 as pb;
use tether_proto::admin::v1::admin_server;
use tether_store::store::Attachment;
use tonic::{Request, Response, Status};

/// The admin service.
pub struct AdminService {
    node: Arc<Node>,
    stats: Arc<Stats>,
    socket: PathBuf,
}

impl AdminService {
    /// A service over the node.
    pub fn new(node: Arc<Node>, stats: Arc<Stats>, socket: PathBuf) -> Self {
        AdminService {
            node,
            stats,
            socket,
        }
    }
}

fn join(ips: &[std::net::IpAddr]) -> String {
    ips.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn tetherd_error(e: tokio::task::JoinError) -> tether_base::error::Error {
    tether_base::error::Error::Internal(format!("store probe task failed: {e}"))
}

fn to_pb(a: &Attachment) -> pb::Attachment {
    pb::Attachment {
        network: a.key.network.clone(),
        container_id: a.key.container_id.clone(),
        ifname: a.key.ifname.clone(),
        netns: a.netns.clone(),
        ips: a
            .ips
            .iter()
            .map(|ip| format!("{ip}/{}", if ip.is_ipv4() { 32 } else { 128 }))
            .collect(),
        mac: a.mac.to_string(),
        host_interface: a.host_ifname.clone(),
        created: a.created_unix_nanos.to_string(),
        pod_namespace: a.pod_namespace.clone().unwrap_or_default(),
        pod_name: a.pod_name.clone().unwrap_or_default(),
        pools: a.pools.clone(),
        ipam_only: a.ipam_only,
    }
}

fn sat(n: u128) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// A named pool as the admin API shows it: its definition, this node's
/// usage and blocks (each with its holders when `holders` lists the
/// node's attachments).
fn pool_pb(u: &PoolUsage, holders: Option<&[Attachment]>) -> pb::NamedPool {
    let text = |ip: Option<std::net::IpAddr>| ip.map(|i| i.to_string()).unwrap_or_default();
    let mut p = pb::NamedPool {
        name: u.name.clone(),
        defined: u.def.is_some(),
        size: sat(u.size),
        used: sat(u.used),
        free: sat(u.free),
        excluded_in_use: u.excluded_in_use.iter().map(|i| i.to_string()).collect(),
        ..Default::default()
    };
    if let Some(d) = &u.def {
        p.cidr = d.cidr.to_string();
        p.range_start = text(d.range_start);
        p.range_end = text(d.range_end);
        p.exclude = d.exclude.iter().map(|e| e.to_string()).collect();
        p.gateway = text(d.gateway);
        p.block_size = u32::from(d.block_len);
    }
    p.blocks = u
        .blocks
        .iter()
        .map(|(cidr, used, free)| pb::PoolBlock {
            cidr: cidr.to_string(),
            local: true,
            used: sat(*used),
            free: sat(*free),
            holders: holders
                .unwrap_or_default()
                .iter()
                .flat_map(|a| {
                    a.ips
                        .iter()
                        .filter(|ip| cidr.contains(*ip))
                        .map(move |ip| format!("{ip} {}", a.key))
                })
                .collect(),
            ..Default::default()
        })
        .collect();
    p
}

/// One direction of a pod's isolation, for the admin API.
fn direction_pb(d: &tether_kernel::policy::Direction) -> pb::PolicyDirection {
    use tether_kernel::policy::{Peers, Ports};
    pb::PolicyDirection {
        policies: d.policies.iter().cloned().collect(),
        allows: d
            .allows
            .iter()
            .map(|a| {
                let (any_peer, peers) = match &a.peers {
                    Peers::Any => (true, Vec::new()),
                    Peers::Nets(nets) => (false, nets.iter().map(|n| n.to_string()).collect()),
                };
                let (any_port, ports) = match &a.ports {
                    Ports::Any => (true, Vec::new()),
                    Ports::Ranges(ranges) => (
                        false,
                        ranges
                            .iter()
                            .map(|r| {
                                let proto = r.proto.nft().to_uppercase();
                                if r.first == r.last {
                                    format!("{proto}/{}", r.first)
                                } else {
                                    format!("{proto}/{}-{}", r.first, r.last)
                                }
                            })
                            .collect(),
                    ),
                };
                pb::PolicyAllow {
                    any_peer,
                    peers,
                    any_port,
                    ports,
                }
            })
            .collect(),
    }
}

fn to_status(e: Error) -> Status {
    let text = format!("{e} (code {})", e.code());
    match e {
        Error::UnknownVm(_) | Error::UnknownPool(_) => Status::not_found(text),
        Error::VmState(_) => Status::failed_precondition(text),
        Error::AddressInUse(_) => Status::already_exists(text),
        Error::AddressNotInPool(_) | Error::InvalidConfig(_) => Status::invalid_argument(text),
        Error::TryAgain(_) | Error::Store(_) => Status::unavailable(text),
        _ => Status::internal(text),
    }
}

fn vm_key(r: Option<pb::VmRef>) -> Result<VmKey, Status> {
    let r = r.ok_or_else(|| Status::invalid_argument("vm is required"))?;
    let interface = if r.interface.is_empty() {
        "eth0"
    } else {
        r.interface.as_str()
    };
    VmKey::new(&r.namespace, &r.vm, interface).map_err(to_status)
}

fn pod_pb(a: &VmAttachment) -> pb::VmPod {
    pb::VmPod {
        node: a.node.clone(),
        network: a.network.clone(),
        container_id: a.container_id.clone(),
        ifname: a.ifname.clone(),
        pod_name: a.pod_name.clone().unwrap_or_default(),
        pod_uid: a.pod_uid.clone().unwrap_or_default(),
        since: a.since_unix_ms.to_string(),
    }
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn cutover_stats(c: &crate::vm::CutoverTiming) -> pb::CutoverStats {
    pb::CutoverStats {
        vm: c.vm.to_string(),
        trigger: c.trigger.name().into(),
        generation: c.generation,
        seen_unix_nanos: c.seen_unix_nanos.as_nanos(),
        local_route_ms: c.local_route.map_or(0.0, ms),
        committed_ms: ms(c.committed),
    }
}

fn route_stats(u: &crate::vm::RouteUpdateTiming) -> pb::VmRouteStats {
    pb::VmRouteStats {
        vm: u.vm.to_string(),
        generation: u.generation,
        done_unix_nanos: u.done_unix_nanos.as_nanos(),
        since_trigger_ms: u.since_trigger.map_or(0.0, ms),
    }
}

fn vm_pb(r: &VmRecord) -> pb::Vm {
    pb::Vm {
        namespace: r.key.namespace.clone(),
        vm: r.key.vm.clone(),
        interface: r.key.interface.clone(),
        ips: r
            .ips
            .iter()
            .map(|ip| format!("{ip}/{}", if ip.is_ipv4() { 32 } else { 128 }))
            .collect(),
        mac: r.mac.to_string(),
        origin: r.origin.name().into(),
        active: r.active.as_ref().map(pod_pb),
        alternate: r.alternate.as_ref().map(pod_pb),
        generation: r.generation,
        created: r.created_unix_ms.to_string(),
        last_cutover: r.last_cutover.as_ref().map(|c| pb::VmCutover {
            trigger: c.trigger.name().into(),
            from_node: c.from_node.clone().unwrap_or_default(),
            to_node: c.to_node.clone(),
            seen_unix_nanos: c.seen_unix_nanos.as_nanos(),
        }),
    }
}

#[tonic::async_trait]
impl admin_server::Admin for AdminService {
    async fn get_node(&self, _: Request<pb::GetNodeRequest>) -> Result<Response<pb::Node>, Status> {
        let cfg = self.node.config();
        let pools = self
            .node
            .pool_usage()
            .into_iter()
            .map(|(cidr, used, free)| pb::Pool {
                cidr: cidr.to_string(),
                used: u64::try_from(used).unwrap_or(u64::MAX),
                free: u64::try_from(free).unwrap_or(u64::MAX),
            })
            .collect();
        let mut node = pb::Node {
            name: cfg.name.clone(),
            pools,
            store_backend: self.node.store().backend().to_string(),
            store_location: self.node.store().location(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            socket: self.socket.display().to_string(),
            mtu: self.node.pod_mtu(),
            ipam_mode: "pod-cidr".into(),
            routing: "none".into(),
            state_dir: cfg.state_dir.display().to_string(),
            pending_del_dir: std::path::absolute(pending_del::queue_dir(&cfg.state_dir))
                .unwrap_or_else(|_| pending_del::queue_dir(&cfg.state_dir))
                .display()
                .to_string(),
            pending_del_link: pending_del::queue_link(&self.socket).display().to_string(),
            pending_del_link_target: std::fs::read_link(pending_del::queue_link(&self.socket))
                .map(|t| t.display().to_string())
                .unwrap_or_default(),
            waiting_leaves: self
                .node
                .vms()
                .waiting_leaves()
                .into_iter()
                .map(|l| pb::WaitingLeave {
                    vm: Some(pb::VmRef {
                        namespace: l.vm.namespace.clone(),
                        vm: l.vm.vm.clone(),
                        interface: l.vm.interface.clone(),
                    }),
                    container_id: l.attachment.container_id,
                    ifname: l.attachment.ifname,
                    since: l.queued_unix_ms.to_string(),
                })
                .collect(),
            ..Default::default()
        };
        let started = std::time::Instant::now();
        let probed = match self.node.cluster() {
            Some(c) => {
                let me = c.me();
                node.node_id = me.id;
                node.blocks = c.my_blocks().iter().map(|b| b.to_string()).collect();
                node.liveness = c.role().to_string();
                node.ipam_mode = "cluster".into();
                node.cluster_cidrs = c
                    .config()
                    .cluster_cidrs
                    .iter()
                    .map(|c| c.to_string())
                    .collect();
                node.routing = c.config().overlay.name().into();
                node.node_ip = join(&me.node_ips);
                // The control plane is the store that can fail in cluster
                // mode; the local journal still holds the attachments.
                node.store_backend = c.store().backend().into();
                node.store_location = c.store().location();
                c.probe().await
            }
            None => {
                if let Some(p) = self.node.peers() {
                    // --pod-cidr-from-node: routes from the Node objects.
                    let me = p.me();
                    node.node_id = me.id;
                    node.ipam_mode = "node-cidr".into();
                    node.routing = p.overlay().name().into();
                    node.node_ip = join(&me.node_ips);
                }
                let store = self.node.store().clone();
                tokio::task::spawn_blocking(move || store.probe().map_err(Error::from))
                    .await
                    .unwrap_or_else(|e| Err(tetherd_error(e)))
            }
        };
        node.store_health = Some(pb::StoreHealth {
            healthy: probed.is_ok(),
            detail: probed.err().map(|e| e.to_string()).unwrap_or_default(),
            probe_ms: started.elapsed().as_secs_f64() * 1000.0,
        });
        Ok(Response::new(node))
    }

    async fn list_nodes(
        &self,
        _: Request<pb::ListNodesRequest>,
    ) -> Result<Response<pb::ListNodesResponse>, Status> {
        let Some(c) = self.node.peers() else {
            return Err(Status::failed_precondition(
                "this node routes to no other node (it runs with --pod-cidr)",
            ));
        };
        let view = c.view();
        let me = c.me();
        // Only the reaper's view holds every node's liveness; any other
        // node lists the alive keys for the answer.
        let alive = match self.node.cluster() {
            Some(cluster) => cluster
                .alive_now()
                .await
                .map_err(|e| Status::unavailable(e.to_string()))?,
            None => view.alive.clone(),
        };
        let nodes = view
            .nodes
            .values()
            .map(|(n, _)| pb::ClusterNode {
                name: n.name.clone(),
                id: n.id,
                node_ip: join(&n.node_ips),
                alive: alive.contains(&n.name),
                blocks: view
                    .blocks_of(&n.name)
                    .iter()
                    .map(|b| b.to_string())
                    .collect(),
                vtep_mac: n.vtep_mac.clone().unwrap_or_default(),
                local: n.name == me.name,
            })
            .collect();
        Ok(Response::new(pb::ListNodesResponse { nodes }))
    }

    async fn list_attachments(
        &self,
        r: Request<pb::ListAttachmentsRequest>,
    ) -> Result<Response<pb::ListAttachmentsResponse>, Status> {
        let network = r.into_inner().network;
        let attachments = self
            .node
            .attachments()
            .iter()
            .filter(|a| network.is_empty() || a.key.network == network)
            .map(to_pb)
            .collect();
        Ok(Response::new(pb::ListAttachmentsResponse { attachments }))
    }

    async fn get_attachment(
        &self,
        r: Request<pb::GetAttachmentRequest>,
    ) -> Result<Response<pb::Attachment>, Status> {
        let q = r.into_inner();
        if q.container_id.is_empty() || q.ifname.is_empty() {
            return Err(Status::invalid_argument(
                "container_id and ifname are required",
            ));
        }
        let matches: Vec<Attachment> = self
            .node
            .attachments()
            .into_iter()
            .filter(|a| {
                a.key.container_id == q.container_id
                    && a.key.ifname == q.ifname
                    && (q.network.is_empty() || a.key.network == q.network)
            })
            .collect();
        match matches.as_slice() {
            [a] => Ok(Response::new(to_pb(a))),
            [] => Err(Status::not_found(format!(
                "no attachment {}/{}",
                q.container_id, q.ifname
            ))),
            _ => Err(Status::failed_precondition(
                "several networks have this attachment; set network",
            )),
        }
    }

    async fn stats(
        &self,
        r: Request<pb::StatsRequest>,
    ) -> Result<Response<pb::StatsResponse>, Status> {
        let brief = r.into_inner().brief;
        let verbs = VERBS
            .iter()
            .map(|&v| {
                let (ok, errors) = self.stats.counts(v);
                pb::VerbCounters {
                    verb: verb_name(v).to_string(),
                    ok,
                    errors,
                }
            })
            .collect();
        let (block_claims, last_block_claim_ms) = self
            .node
            .cluster()
            .map(|c| {
                let (n, last) = c.claim_stats();
                (n, last.as_secs_f64() * 1000.0)
            })
            .unwrap_or((0, 0.0));
        let vm = self.node.vms().stats();
        let costs = crate::metrics::get().costs();
        Ok(Response::new(pb::StatsResponse {
            costs: Some(pb::ProcessCosts {
                control_requests: costs.control_requests,
                watch_events: costs.watch_events,
                routes_changed: costs.routes_changed,
                cpu_user_micros: costs.cpu_user_micros,
                cpu_system_micros: costs.cpu_system_micros,
            }),
            vm_cutovers: vm.cutovers,
            last_cutover: vm.last_cutover.as_ref().map(cutover_stats),
            recent_cutovers: if brief {
                Vec::new()
            } else {
                vm.recent_cutovers.iter().map(cutover_stats).collect()
            },
            vm_route_updates: vm.route_updates,
            last_vm_route_update: vm.last_route_update.as_ref().map(route_stats),
            recent_vm_route_updates: if brief {
                Vec::new()
            } else {
                vm.recent_route_updates.iter().map(route_stats).collect()
            },
            recent_block_routes: if brief {
                Vec::new()
            } else {
                self.node
                    .recent_block_routes()
                    .into_iter()
                    .map(|b| pb::BlockRouteStats {
                        block: b.dst.to_string(),
                        done_unix_nanos: b.done_unix_nanos.as_nanos(),
                    })
                    .collect()
            },
            pending_del_queue: pending_del::queue_len(&self.node.config().state_dir),
            verbs,
            uptime_seconds: self.stats.started.elapsed().as_secs(),
            pending_del_processed: self.stats.pending_del_processed.load(Ordering::Relaxed),
            link_deletions_in_flight: self.node.link_deletions_in_flight(),
            block_claims,
            last_block_claim_ms,
            guest_dhcp: Some({
                let (d, served) = self.node.guest_dhcp_stats();
                pb::GuestDhcpStats {
                    dhcp4: d.dhcp4,
                    dhcp6: d.dhcp6,
                    router_adverts: d.router_adverts,
                    arp: d.arp,
                    malformed: d.malformed,
                    foreign_mac: d.foreign_mac,
                    unanswered: d.unanswered,
                    send_errors: d.send_errors,
                    served: served as u64,
                }
            }),
        }))
    }

    async fn list_vms(
        &self,
        _: Request<pb::ListVmsRequest>,
    ) -> Result<Response<pb::ListVmsResponse>, Status> {
        let vms = self
            .node
            .vms()
            .records()
            .view()
            .records
            .values()
            .map(|(r, _)| vm_pb(r))
            .collect();
        Ok(Response::new(pb::ListVmsResponse { vms }))
    }

    async fn get_vm(&self, r: Request<pb::VmRef>) -> Result<Response<pb::Vm>, Status> {
        let key = vm_key(Some(r.into_inner()))?;
        match self
            .node
            .vms()
            .records()
            .read(&key)
            .await
            .map_err(to_status)?
        {
            Some((rec, _)) => Ok(Response::new(vm_pb(&rec))),
            None => Err(to_status(Error::UnknownVm(key.to_string()))),
        }
    }

    async fn cutover(&self, r: Request<pb::VmRef>) -> Result<Response<pb::Vm>, Status> {
        let key = vm_key(Some(r.into_inner()))?;
        let seen = (Instant::now(), UnixNanos::now());
        let rec = self
            .node
            .vms()
            .cutover(self.node.as_ref(), &key, None, Trigger::Admin, seen)
            .await
            .map_err(to_status)?;
        Ok(Response::new(vm_pb(&rec)))
    }

    async fn release_vm(
        &self,
        r: Request<pb::ReleaseVmRequest>,
    ) -> Result<Response<pb::Vm>, Status> {
        let q = r.into_inner();
        let key = vm_key(q.vm)?;
        let rec = self
            .node
            .vms()
            .release(&key, q.force)
            .await
            .map_err(to_status)?;
        Ok(Response::new(vm_pb(&rec)))
    }

    async fn reserve_vm_address(
        &self,
        r: Request<pb::ReserveVmAddressRequest>,
    ) -> Result<Response<pb::Vm>, Status> {
        let q = r.into_inner();
        let key = vm_key(q.vm)?;
        let mut ips = Vec::with_capacity(q.ips.len());
        for s in &q.ips {
            let ip = s
                .parse::<std::net::IpAddr>()
                .or_else(|_| s.parse::<ipnet::IpNet>().map(|n| n.addr()))
                .map_err(|_| Status::invalid_argument(format!("{s:?} is not an IP address")))?;
            ips.push(ip);
        }
        let mac = (!q.mac.is_empty()).then_some(q.mac);
        let rec = self
            .node
            .vms()
            .reserve(self.node.as_ref(), key, ips, mac)
            .await
            .map_err(to_status)?;
        Ok(Response::new(vm_pb(&rec)))
    }

    async fn list_pools(
        &self,
        _: Request<pb::ListPoolsRequest>,
    ) -> Result<Response<pb::ListPoolsResponse>, Status> {
        let me = &self.node.config().name;
        let pools = self
            .node
            .named_pools()
            .usage()
            .iter()
            .map(|u| {
                let mut p = pool_pb(u, None);
                for b in &mut p.blocks {
                    b.node = me.clone();
                }
                p
            })
            .collect();
        Ok(Response::new(pb::ListPoolsResponse { pools }))
    }

    async fn get_pool(
        &self,
        r: Request<pb::GetPoolRequest>,
    ) -> Result<Response<pb::NamedPool>, Status> {
        let name = r.into_inner().name;
        let named = self.node.named_pools();
        let usage = named
            .usage()
            .into_iter()
            .find(|u| u.name == name)
            .ok_or_else(|| to_status(named.unknown(&name)))?;
        let attachments = self.node.attachments();
        let mut pool = pool_pb(&usage, Some(&attachments));
        let me = self.node.config().name.clone();
        for b in &mut pool.blocks {
            b.node = me.clone();
        }
        // Other nodes' blocks, from the control plane.
        let records = named.blocks(&name).await.map_err(to_status)?;
        for r in records.iter().filter(|r| r.node != me) {
            pool.blocks.push(pb::PoolBlock {
                cidr: r.cidr.to_string(),
                node: r.node.clone(),
                ..Default::default()
            });
        }
        pool.blocks.sort_by(|a, b| a.cidr.cmp(&b.cidr));
        Ok(Response::new(pool))
    }

    async fn get_pod_policy(
        &self,
        r: Request<pb::GetPodPolicyRequest>,
    ) -> Result<Response<pb::PodPolicy>, Status> {
        let r = r.into_inner();
        let Some(enforcer) = self.node.policy() else {
            return Err(Status::failed_precondition(
                "this daemon enforces no NetworkPolicy (--network-policy=false, or no Kubernetes API)",
            ));
        };
        let (policy, local) = enforcer
            .pod_policy(&r.namespace, &r.name)
            .map_err(Status::failed_precondition)?
            .ok_or_else(|| {
                Status::not_found(format!(
                    "no pod {}/{} in the API, as this node's watch sees it",
                    r.namespace, r.name
                ))
            })?;
        Ok(Response::new(pb::PodPolicy {
            pod: policy.pod.clone(),
            ips: policy.ips.iter().map(|ip| ip.to_string()).collect(),
            local,
            ingress: policy.ingress.as_ref().map(direction_pb),
            egress: policy.egress.as_ref().map(direction_pb),
        }))
    }
}
