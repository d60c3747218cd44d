//! How the node finds its place: the control store it keeps its cluster
//! state in, the cluster it joins through it (`--cluster-cidr`), or the
//! Node objects it routes by (`--pod-cidr-from-node`), and its own
//! underlay address.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::cluster::{Cluster, ClusterConfig, Peers};
use tether_base::error::{Error, Result};
use tether_store::control::embedded::EmbeddedStore;
use tether_store::control::etcd::{EtcdOptions, EtcdStore};
use tether_store::control::kubernetes::{KubeOptions, KubeStore};
use tether_store::control::ControlStore;

use super::options::{Options, StoreKind};

/// Opens the control plane: node records and blocks in cluster mode, and
/// the VM address records in both modes.
pub(super) async fn open_control_store(
    opts: &Options,
    kube: Option<&(kube::Client, String)>,
) -> Result<Arc<dyn ControlStore>> {
    opts.check()?;
    Ok(match opts.store {
        StoreKind::Local => {
            let dir = opts.state_dir.clone();
            Arc::new(
                tokio::task::spawn_blocking(move || EmbeddedStore::open(&dir))
                    .await
                    .map_err(|e| Error::Internal(e.to_string()))??,
            )
        }
        StoreKind::Etcd => EtcdStore::connect(&EtcdOptions {
            endpoints: opts.etcd_endpoints.clone(),
            ca: opts.etcd_ca.clone(),
            cert: opts.etcd_cert.clone(),
            key: opts.etcd_key.clone(),
            timeout: Duration::from_millis(opts.etcd_timeout_ms),
        })
        .await?
        .into(),
        StoreKind::Kubernetes => {
            let Some((client, server)) = kube else {
                return Err(Error::InvalidConfig(
                    "--store kubernetes needs the Kubernetes API".into(),
                ));
            };
            let lease_namespace = opts
                .lease_namespace
                .clone()
                .unwrap_or_else(|| client.default_namespace().to_owned());
            let kube_opts = KubeOptions {
                root: tether_store::control::v1_root(&opts.etcd_prefix),
                server: server.clone(),
                lease_namespace,
                timeout: Duration::from_millis(opts.etcd_timeout_ms),
            };
            tracing::info!(server = %kube_opts.server, lease_namespace = %kube_opts.lease_namespace, "control plane: the Kubernetes API");
            KubeStore::connect(client.clone(), kube_opts).await?.into()
        }
    })
}

/// With --pod-cidr-from-node: starts the watch on the Node objects that
/// this node routes to the other nodes by, and waits (a while) for its
/// first listing, so that the routes are in place before the node serves.
/// This node's underlay address: --node-ip, else the Node's InternalIP,
/// else the default route's.
pub(super) async fn start_node_peers(
    opts: &Options,
    client: &kube::Client,
    node_name: &str,
    facts: crate::kube::node_cidrs::NodeFacts,
) -> Result<Arc<dyn Peers>> {
    use crate::kube::node_peers::{my_record, NodePeers};
    let node_ips = if !opts.node_ips.is_empty() {
        opts.node_ips.clone()
    } else if !facts.internal_ips.is_empty() {
        facts.internal_ips
    } else {
        default_route_addresses().await?
    };
    let me = my_record(node_name, &facts.pod_cidrs, node_ips);
    tracing::info!(node = %me.name, id = me.id, ips = ?me.node_ips, overlay = opts.overlay().name(), "routing to the other nodes' pod CIDRs from their Node objects");
    let peers = NodePeers::start(client.clone(), me, opts.overlay());
    if !peers.wait_synced(Duration::from_secs(10)).await {
        tracing::warn!("no listing of the Node objects within 10 s: serving now; routes to other nodes follow when it comes");
    }
    Ok(peers)
}

/// The addresses of the interface the default route uses, for a node given
/// no --node-ip; an error when there is no default route.
async fn default_route_addresses() -> Result<Vec<IpAddr>> {
    let netlink = tether_kernel::netlink::Netlink::connect()?;
    let node_ips = netlink.default_route_addresses().await?;
    if node_ips.is_empty() {
        return Err(Error::InvalidConfig(
            "no default route to find the node's address by: give --node-ip".into(),
        ));
    }
    tracing::info!(?node_ips, "node address found through the default route");
    Ok(node_ips)
}

/// In cluster mode: joins the cluster through the control plane.
pub(super) async fn join_cluster(
    opts: &Options,
    node_name: &str,
    store: Arc<dyn ControlStore>,
) -> Result<Option<Arc<Cluster>>> {
    if opts.cluster_cidrs.is_empty() {
        return Ok(None);
    }
    let mut node_ips = opts.node_ips.clone();
    if node_ips.is_empty() {
        node_ips = default_route_addresses().await?;
    }
    let config = ClusterConfig {
        node_name: node_name.to_owned(),
        node_ips,
        cluster_cidrs: opts.cluster_cidrs.clone(),
        block_v4: opts.block_size,
        block_v6: opts.block_size_v6,
        prefix: opts.etcd_prefix.clone(),
        lease_ttl: Duration::from_secs(opts.lease_ttl),
        node_grace: Duration::from_secs(opts.node_grace),
        overlay: opts.overlay(),
    };
    Ok(Some(Cluster::join(store, config).await?))
}
