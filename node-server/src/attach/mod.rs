//! The attachment lifecycle on this node: ADD, DEL, CHECK, GC and STATUS,
//! tying the store, the address pools and the kernel together.
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

mod add;
mod addresses;
mod check;
mod del;
mod gc;
mod guest;
mod ipam_only;
mod link_reaper;
mod notices;
mod reconcile;
mod route_loop;
mod status;
#[cfg(test)]
pub(crate) mod tests;
mod vm_side;

use crate::routing::{self, manager::Routes};
use link_reaper::LinkReaper;
use reconcile::rebooted_since_last_run;

pub use crate::vm::{CutoverTiming, RouteUpdateTiming, VmStats};

use crate::cluster::{Cluster, Peers};
use crate::pools::NamedPools;
use crate::vm::{VmRegistry, Vms};
use ipnet::IpNet;
use std::collections::HashMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use tether_base::error::{Error, Result};
use tether_base::mac::Mac;
pub(crate) use tether_base::sync::lock;
use tether_cni::Invocation;
use tether_ipam::Pools;
use tether_kernel::{Host, Kernel, PodNetns, PodWiring};
use tether_store::store::{Attachment, AttachmentKey, Store};
use tokio::sync::{OwnedMutexGuard, RwLock};

/// The node's static settings.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// This node's name.
    pub name: String,
    /// Fixed pod CIDRs, at most one per family (`--pod-cidr` mode); empty
    /// in cluster mode, where addresses come from claimed blocks.
    pub pod_cidrs: Vec<IpNet>,
    /// MTU of pod interfaces unless the netconf overrides it; `None`: the
    /// default, [`DEFAULT_POD_MTU`] or in VXLAN mode the VXLAN device's.
    pub mtu: Option<u32>,
    /// The daemon's state directory.
    pub state_dir: PathBuf,
    /// Non-root uids allowed to use the daemon (on the socket, and as
    /// authors of queued DELs).
    pub allowed_uids: Vec<u32>,
    /// The named pools (`--pools`).
    pub pools: Vec<crate::pools::PoolDef>,
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
    /// Cluster mode: membership and blocks.
    cluster: Option<Arc<Cluster>>,
    /// The other nodes this node routes to: the cluster (cluster mode) or
    /// the Node objects (`--pod-cidr-from-node`); none on a lone node.
    peers: Option<Arc<dyn Peers>>,
    kernel: Arc<dyn Kernel>,
    host: Arc<dyn Host>,
    pools: Mutex<Pools>,
    attachments: Mutex<HashMap<AttachmentKey, Attachment>>,
    /// One async lock per attachment key, present while someone holds or
    /// waits for it, so that different pods proceed in parallel.
    key_locks: Mutex<HashMap<AttachmentKey, Arc<tokio::sync::Mutex<()>>>>,
    /// Held shared by per-attachment verbs and exclusively by GC, whose
    /// orphan sweep must not see an ADD half done.
    sweep: RwLock<()>,
    /// Veths of released attachments, deleted after the reply.
    reaper: LinkReaper,
    /// KubeVirt VMs: the component that owns the records and this node's
    /// VM state; it reaches the node through [`crate::vm::NodeSide`].
    vms: Arc<Vms>,
    /// The route manager's state.
    routes: Routes,
    /// DHCP and router advertisements for the guests of tap bindings.
    dhcp: Arc<dyn tether_kernel::GuestDhcp>,
    /// The named pools, for attachments that select one and for IPAM-only
    /// attachments.
    named: NamedPools,
    /// The Kubernetes API (events, IPAMClaims), once its client is up;
    /// unset when the daemon runs without one.
    kube: std::sync::OnceLock<Arc<crate::kube::KubeLink>>,
    /// The cutover-notice sockets, once opened (cluster peers and a port).
    notice_bus: std::sync::OnceLock<Arc<notices::NoticeBus>>,
    /// The NetworkPolicy enforcer (`--network-policy`, with the API):
    /// every ADD of a pod waits for its isolation to be in the kernel.
    policy: std::sync::OnceLock<Arc<crate::policy::enforcer::Enforcer>>,
    /// The MTU of pod interfaces a netconf does not set: `--mtu`, else
    /// [`DEFAULT_POD_MTU`], or in VXLAN mode the VXLAN device's (known once
    /// the device is made, before the node serves).
    pod_mtu: AtomicU32,
    /// Migrating VMs' connections: what this node does as a migration's
    /// source or target beyond the routes.
    handovers: Arc<crate::handover::Handovers>,
}

/// The pod MTU without `--mtu`, outside VXLAN mode.
pub const DEFAULT_POD_MTU: u32 = 1500;

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

/// Runs a blocking store call off the async workers.
async fn blocking<T: Send + 'static, E: Into<Error> + Send + 'static>(
    f: impl FnOnce() -> Result<T, E> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Internal(format!("store task failed: {e}")))?
        .map_err(Into::into)
}

fn key_of(inv: &Invocation) -> AttachmentKey {
    AttachmentKey {
        network: inv.conf.name.clone(),
        container_id: inv.container_id.clone(),
        ifname: inv.ifname.clone(),
    }
}

/// What the kernel needs to wire `a`, whose MAC is `pod_mac`: ADD
/// passes the one it chose, the other callers [`stored_mac`].
fn wiring<'a>(a: &'a Attachment, pod_mac: Mac, netns: &'a PodNetns, routed: bool) -> PodWiring<'a> {
    PodWiring {
        netns,
        pod_ifname: &a.key.ifname,
        host_ifname: &a.host_ifname,
        pod_mac,
        ips: &a.ips,
        mtu: a.mtu,
        routed,
        tap: a.guest.as_ref().and_then(|g| g.tap.as_ref()),
        managed_tap: a
            .guest
            .as_ref()
            .is_some_and(|g| g.kind() == tether_base::guest::BindingKind::ManagedTap),
    }
}

fn wired(a: &Attachment) -> tether_cni::Wired {
    tether_cni::Wired {
        host_ifname: a.host_ifname.clone(),
        host_mac: tether_kernel::GATEWAY_MAC.to_string(),
        pod_ifname: a.key.ifname.clone(),
        pod_mac: a.mac.to_string(),
        sandbox: a.netns.clone(),
        mtu: a.mtu,
        ips: a.ips.clone(),
        tap: a
            .guest
            .as_ref()
            .and_then(|g| g.tap.as_ref())
            .map(|t| t.name.clone()),
    }
}

impl Node {
    /// Opens the node: loads the store, rebuilds the pools, and reconciles
    /// the kernel against the store. `peers` are the other nodes it routes
    /// to (in cluster mode, `cluster` itself). Call
    /// [`Node::drain_pending_dels`] next, then serve.
    #[allow(clippy::too_many_arguments)]
    pub async fn open(
        config: NodeConfig,
        store: Arc<dyn Store>,
        cluster: Option<Arc<Cluster>>,
        peers: Option<Arc<dyn Peers>>,
        vms: Arc<VmRegistry>,
        kernel: Arc<dyn Kernel>,
        host: Arc<dyn Host>,
    ) -> Result<(Self, Reconciled)> {
        host.enable_forwarding()?;
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
        if rebooted_since_last_run(&config.state_dir, &host.boot_id()?)? && !loaded.is_empty() {
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
        let (control, root) = vms.control();
        let (named, all_ips) =
            NamedPools::open(&config.name, control, &root, config.pools.clone(), &all_ips).await?;
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
        let routes = Routes::new(kernel.clone());
        let config_mtu = config.mtu.unwrap_or(DEFAULT_POD_MTU);
        let leaves = crate::vm::leaving::Leaves::open(Some(&config.state_dir))?;
        let vms = Arc::new(Vms::new(config.name.clone(), vms, kernel.clone(), leaves));
        let handovers = Arc::new(crate::handover::Handovers::new(
            config.name.clone(),
            kernel.handover(),
        ));
        let node = Node {
            config,
            store,
            cluster,
            peers,
            kernel,
            dhcp: host.guest_dhcp(),
            host,
            pools: Mutex::new(pools),
            attachments: Mutex::new(attachments),
            key_locks: Mutex::new(HashMap::new()),
            sweep: RwLock::new(()),
            reaper: LinkReaper::default(),
            vms,
            routes,
            named,
            kube: std::sync::OnceLock::new(),
            notice_bus: std::sync::OnceLock::new(),
            policy: std::sync::OnceLock::new(),
            pod_mtu: AtomicU32::new(config_mtu),
            handovers,
        };
        node.vms.sync_reservations(&node, &vm_view);
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
        }
        if let Some(c) = &node.peers {
            let vxlan_mtu = routing::manager::prepare_overlay(
                c.as_ref(),
                node.kernel.as_ref(),
                node.config.mtu,
            )
            .await?;
            if let (None, Some(mtu)) = (node.config.mtu, vxlan_mtu) {
                // Pods get what fits the overlay, unless the operator chose.
                node.pod_mtu.store(mtu, Ordering::Relaxed);
                tracing::info!(pod_mtu = mtu, "pod MTU: the VXLAN device's");
            }
            // The migration handover's table. Without it VMs still move
            // with their addresses; only connections that need its rules
            // fare worse, which is said.
            if let Err(e) = node.host.ensure_handover_table() {
                tracing::error!(
                    error = %e,
                    "cannot write the migration handover's nftables table: a migrating VM's \
                     connections through a translation may break"
                );
            }
            // A route the kernel refuses now (the underlay not up yet, say)
            // must not stop the node from serving its own pods: the route
            // manager keeps trying.
            let first = node
                .routes
                .program_cluster(c.as_ref(), &c.view(), true)
                .await;
            match &first {
                Ok(p) => {
                    reconciled.cluster_routes_added = p.added;
                    reconciled.cluster_routes_removed = p.removed;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot program the cluster routes yet; retrying")
                }
            }
            node.routes.set_cluster_failed(first.is_err());
        }
        // VMs that moved or stopped while the daemon was away: their routes
        // follow the records before the node serves.
        if let Err(e) = node.sync_vms(&vm_view).await {
            tracing::warn!(error = %e, "cannot program the VM routes yet; retrying");
        }
        Ok((node, reconciled))
    }

    /// The VM component.
    pub fn vms(&self) -> &Arc<Vms> {
        &self.vms
    }

    /// The cluster membership, in cluster mode.
    pub fn cluster(&self) -> Option<&Arc<Cluster>> {
        self.cluster.as_ref()
    }

    /// The other nodes this node routes to, if any: the cluster, or the
    /// Node objects with `--pod-cidr-from-node`.
    pub fn peers(&self) -> Option<&Arc<dyn Peers>> {
        self.peers.as_ref()
    }

    /// The VM migrations' connection handovers of this node.
    pub fn handovers(&self) -> &crate::handover::Handovers {
        &self.handovers
    }

    /// Connects the node to the Kubernetes API (once; later calls are
    /// ignored).
    pub fn set_kube(&self, link: Arc<crate::kube::KubeLink>) {
        let _ = self.kube.set(link);
    }

    /// Starts everything that follows the API: the event writer, the
    /// IPAMClaims watch and status writer, and then, once the node holds
    /// the link, the watch on this node's pods. Returns at once.
    pub fn start_kube(
        self: &Arc<Self>,
        client: ::kube::Client,
        check_launchers: bool,
    ) -> Arc<crate::kube::KubeLink> {
        let link = crate::kube::start(&self.vms, client.clone(), check_launchers);
        self.set_kube(link.clone());
        crate::kube::pods::start(client, self.vms.clone(), self.clone());
        link
    }

    /// Starts enforcing NetworkPolicy (once; later calls are ignored): the
    /// enforcer learns this node's pods as they are (those wired before a
    /// restart too), follows the API's policies, namespaces and pods, and
    /// from then on every ADD of a pod waits for its isolation. Returns at
    /// once; the first table is written when the three lists are in.
    pub fn start_policy(&self, client: ::kube::Client) {
        use crate::policy::enforcer::Enforcer;
        let enforcer = Enforcer::new(
            self.host.clone(),
            Arc::new(crate::kube::policy_watch::ApiPods(client.clone())),
            crate::policy::enforcer::ADMIT_TIMEOUT,
        );
        for a in lock(&self.attachments).values() {
            if let (Some(ns), Some(name), false) = (&a.pod_namespace, &a.pod_name, a.ipam_only) {
                enforcer.remember(&a.key.to_string(), ns, name, &a.ips);
            }
        }
        if self.policy.set(enforcer.clone()).is_ok() {
            enforcer.start();
            crate::kube::policy_watch::start(client, enforcer);
        }
    }

    /// The NetworkPolicy enforcer, once started.
    pub fn policy(&self) -> Option<&Arc<crate::policy::enforcer::Enforcer>> {
        self.policy.get()
    }

    /// ADD: `attachment`'s pod isolated as its policies say before it is
    /// wired; a pod without a name (no Kubernetes pod) or a daemon without
    /// the enforcer passes at once.
    pub(crate) async fn admit_to_policy(&self, attachment: &Attachment) -> Result<()> {
        let (Some(p), Some(ns), Some(name)) = (
            self.policy.get(),
            &attachment.pod_namespace,
            &attachment.pod_name,
        ) else {
            return Ok(());
        };
        p.admit(&attachment.key.to_string(), ns, name, &attachment.ips)
            .await
    }

    /// The Kubernetes API link, if the daemon has one.
    pub fn kube(&self) -> Option<&Arc<crate::kube::KubeLink>> {
        self.kube.get()
    }

    /// Queues an event on a pod, when the daemon has the Kubernetes API.
    pub(crate) fn emit_event(&self, pod: crate::kube::PodRef, event: crate::kube::PodEvent) {
        if let Some(k) = self.kube.get() {
            k.events.emit(pod, event);
        }
    }

    /// The MTU of pod interfaces whose netconf sets none (`--mtu`, else 1500, or in VXLAN
    /// mode the VXLAN device's).
    pub fn pod_mtu(&self) -> u32 {
        self.pod_mtu.load(Ordering::Relaxed)
    }

    /// The node's settings.
    pub fn config(&self) -> &NodeConfig {
        &self.config
    }

    /// When the routes to other nodes' blocks last went in (the admin
    /// API's stats).
    pub fn recent_block_routes(&self) -> Vec<crate::routing::manager::BlockRouteTiming> {
        self.routes.recent_block_routes()
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

    /// The named pools as this node sees them.
    pub fn named_pools(&self) -> &NamedPools {
        &self.named
    }

    /// Takes new pool definitions (SIGHUP). Running pods keep their
    /// addresses.
    pub fn reload_pools(&self, defs: Vec<crate::pools::PoolDef>) {
        self.named.reload(defs);
    }

    /// Pool usage: (cidr, used, free).
    pub fn pool_usage(&self) -> Vec<(IpNet, u128, u128)> {
        lock(&self.pools)
            .pools()
            .iter()
            .map(|p| (p.cidr(), p.used(), p.free()))
            .collect()
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
}
