//! `--pod-cidr-from-node`: the other nodes and their pod CIDRs, from a
//! watch on every Node object, so that pods on different nodes reach each
//! other without a control store of tether's own (as flannel's Kubernetes
//! subnet manager and kube-router do).
//!
//! Each Node gives its pod CIDRs (`spec.podCIDRs`) and its underlay
//! address (the `InternalIP` the kubelet reports). The route manager plans
//! from this view exactly as from the cluster view of cluster mode:
//! host-gw routes `podCIDR via InternalIP` when the nodes share an L2
//! segment, or the VXLAN device with one static peer per node.
//!
//! No control plane hands out node IDs here, yet VXLAN needs one per node
//! (its gateway address and its device's MAC are numbered by it). Every
//! node derives each node's ID from that node's pod CIDR ([`node_id`]), so
//! all agree without talking. Two pod CIDRs that fold onto one ID are
//! possible only in clusters with more than 32,767 node CIDRs; in vxlan
//! mode the later one by name is then left out of the view, with an error
//! in the log, rather than routed to the wrong node.
//!
//! While the watch is broken the view is marked stale: routes stay as they
//! are (a stale view never withdraws one) until the relist.

use super::node_cidrs::{from_spec, internal_ips};
use crate::cluster::{vtep_mac, BlockRecord, ClusterView, NodeRecord, Overlay, Peers, MAX_NODE_ID};
use futures::StreamExt;
use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node as KubeNode;
use kube::runtime::watcher::{self, watcher, Event};
use kube::runtime::WatchStreamExt;
use kube::Api;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;
use tether_base::mac::Mac;
use tether_base::time::UnixMillis;
use tokio::sync::watch;

/// A node's ID where no control plane hands IDs out: the network number of
/// its pod CIDR (IPv4 first; the address shifted right past the host
/// bits), folded into `1..=MAX_NODE_ID`. Node CIDRs cut from one cluster
/// CIDR have consecutive network numbers, so they get distinct IDs as long
/// as there are at most [`MAX_NODE_ID`] of them. None without a pod CIDR.
pub fn node_id(cidrs: &[IpNet]) -> Option<u32> {
    let cidr = cidrs
        .iter()
        .find(|c| matches!(c, IpNet::V4(_)))
        .or_else(|| cidrs.first())?;
    let number: u128 = match cidr {
        IpNet::V4(n) => u128::from(u32::from(n.network()))
            .checked_shr(32 - u32::from(n.prefix_len()))
            .unwrap_or(0),
        IpNet::V6(n) => u128::from(n.network())
            .checked_shr(128 - u32::from(n.prefix_len()))
            .unwrap_or(0),
    };
    let folded = number % u128::from(MAX_NODE_ID);
    // Below MAX_NODE_ID, so it fits; the +1 keeps 0 out (IDs start at 1).
    Some(u32::try_from(folded).unwrap_or(0) + 1)
}

/// This node's record in this mode, with its ID from its pod CIDRs (1 if
/// it has none, which cannot happen: the daemon waits for them).
pub fn my_record(name: &str, pod_cidrs: &[IpNet], node_ips: Vec<IpAddr>) -> NodeRecord {
    let id = node_id(pod_cidrs).unwrap_or(1);
    NodeRecord {
        name: name.to_owned(),
        id,
        node_ips,
        vtep_mac: Some(Mac::from(vtep_mac(id)).to_string()),
    }
}

/// What the view keeps of one Node object.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Seen {
    /// Its pod CIDRs; empty while it has none, or when they are malformed.
    pub cidrs: Vec<IpNet>,
    /// Its `InternalIP`s.
    pub ips: Vec<IpAddr>,
}

/// The name and [`Seen`] of a Node; None without a name. A malformed pod
/// CIDR leaves the node without routes, with a warning.
pub fn seen(node: &KubeNode) -> Option<(String, Seen)> {
    let name = node.metadata.name.clone()?;
    let cidrs = from_spec(node).unwrap_or_else(|e| {
        tracing::warn!(node = %name, error = %e, "not routing to a node whose pod CIDRs do not parse");
        Vec::new()
    });
    Some((
        name,
        Seen {
            cidrs,
            ips: internal_ips(node),
        },
    ))
}

/// The view this node routes by: every node with its pod CIDRs as its
/// blocks, `me` as given (its own addresses may come from `--node-ip`).
/// In vxlan mode, a node whose ID another one (or this node) already has
/// is left out; the names left out are returned.
pub fn view_of(
    me: &NodeRecord,
    overlay: &Overlay,
    nodes: &BTreeMap<String, Seen>,
    revision: i64,
) -> (ClusterView, Vec<String>) {
    let mut view = ClusterView {
        revision,
        synced: true,
        ..ClusterView::default()
    };
    let mut ids = BTreeSet::from([me.id]);
    let mut left_out = Vec::new();
    for (name, seen) in nodes {
        let record = if *name == me.name {
            me.clone()
        } else {
            let id = node_id(&seen.cidrs).unwrap_or(0);
            if matches!(overlay, Overlay::Vxlan { .. }) && !seen.cidrs.is_empty() && !ids.insert(id)
            {
                left_out.push(name.clone());
                continue;
            }
            NodeRecord {
                name: name.clone(),
                id,
                node_ips: seen.ips.clone(),
                vtep_mac: Some(Mac::from(vtep_mac(id)).to_string()),
            }
        };
        for cidr in &seen.cidrs {
            let block = BlockRecord {
                cidr: *cidr,
                node: name.clone(),
                node_id: record.id,
                claimed_unix_ms: UnixMillis::EPOCH,
            };
            view.blocks.insert(*cidr, (block, 0));
        }
        view.alive.insert(name.clone());
        view.nodes.insert(name.clone(), (record, 0));
    }
    (view, left_out)
}

/// The other nodes as the Node objects show them: a [`Peers`] for the
/// route manager.
pub struct NodePeers {
    me: NodeRecord,
    overlay: Overlay,
    view: watch::Sender<Arc<ClusterView>>,
}

impl Peers for NodePeers {
    fn me(&self) -> NodeRecord {
        self.me.clone()
    }
    fn overlay(&self) -> Overlay {
        self.overlay
    }
    fn view(&self) -> Arc<ClusterView> {
        self.view.borrow().clone()
    }
    fn subscribe(&self) -> watch::Receiver<Arc<ClusterView>> {
        self.view.subscribe()
    }
}

impl NodePeers {
    /// Starts the watch on every Node; it runs as long as the daemon. The
    /// view is empty and stale until the first listing arrives.
    pub fn start(client: kube::Client, me: NodeRecord, overlay: Overlay) -> Arc<NodePeers> {
        let (view, _) = watch::channel(Arc::new(ClusterView::default()));
        let peers = Arc::new(NodePeers { me, overlay, view });
        tokio::spawn(peers.clone().follow(client));
        peers
    }

    /// Waits at most `timeout` for the first listing; whether it came.
    pub async fn wait_synced(&self, timeout: Duration) -> bool {
        let mut rx = self.view.subscribe();
        let synced = tokio::time::timeout(timeout, rx.wait_for(|v| v.synced))
            .await
            .is_ok_and(|r| r.is_ok());
        synced
    }

    async fn follow(self: Arc<Self>, client: kube::Client) {
        let api: Api<KubeNode> = Api::all(client);
        let mut stream = watcher(api, watcher::Config::default())
            .backoff(super::WatchBackoff::default())
            .boxed();
        let mut nodes: BTreeMap<String, Seen> = BTreeMap::new();
        // A listing in progress: it replaces `nodes` when complete.
        let mut listing: Option<BTreeMap<String, Seen>> = None;
        let mut failing = false;
        let mut revision = 0;
        while let Some(item) = stream.next().await {
            match item {
                Ok(Event::Init) => {
                    listing = Some(BTreeMap::new());
                    continue;
                }
                Ok(Event::InitApply(node)) => {
                    if let (Some(l), Some((name, seen))) = (listing.as_mut(), seen(&node)) {
                        l.insert(name, seen);
                    }
                    continue;
                }
                Ok(Event::InitDone) => {
                    nodes = listing.take().unwrap_or(nodes);
                    if failing {
                        tracing::info!("the watch on Node objects is back");
                    }
                    failing = false;
                }
                Ok(Event::Apply(node)) => {
                    if let Some((name, seen)) = seen(&node) {
                        nodes.insert(name, seen);
                    }
                }
                Ok(Event::Delete(node)) => {
                    if let Some(name) = &node.metadata.name {
                        nodes.remove(name);
                    }
                }
                Err(e) => {
                    super::note_gone("Node objects", &e);
                    if !failing {
                        tracing::warn!(error = %e, "the watch on Node objects failed; routes to other nodes stay as they are until it is back (retrying with backoff)");
                    }
                    failing = true;
                    self.view.send_if_modified(|v| {
                        v.synced && !std::mem::replace(&mut Arc::make_mut(v).synced, false)
                    });
                    continue;
                }
            }
            revision += 1;
            let (view, left_out) = view_of(&self.me, &self.overlay, &nodes, revision);
            self.view.send_if_modified(|v| {
                let changed = !v.synced || v.nodes != view.nodes || v.blocks != view.blocks;
                if changed {
                    for name in &left_out {
                        tracing::error!(node = %name, "not routing to a node whose pod CIDR gives the same VXLAN ID as another node's");
                    }
                    tracing::debug!(nodes = view.nodes.len(), "Node objects changed");
                    *v = Arc::new(view);
                }
                changed
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nets(list: &[&str]) -> Vec<IpNet> {
        list.iter().map(|n| n.parse().unwrap()).collect()
    }

    fn seen_of(cidrs: &[&str], ips: &[&str]) -> Seen {
        Seen {
            cidrs: nets(cidrs),
            ips: ips.iter().map(|i| i.parse().unwrap()).collect(),
        }
    }

    #[test]
    fn ids_follow_the_pod_cidr_and_differ_across_a_cluster_cidr() {
        // kube-controller-manager's defaults: /24s out of a /16.
        let ids: BTreeSet<u32> = (0..=255)
            .map(|i| node_id(&nets(&[&format!("10.244.{i}.0/24")])).unwrap())
            .collect();
        assert_eq!(ids.len(), 256);
        assert!(ids.iter().all(|&id| (1..=MAX_NODE_ID).contains(&id)));
        // IPv4 decides in dual stack, in either order; IPv6 alone works.
        let v4 = node_id(&nets(&["10.244.7.0/24"]));
        assert_eq!(node_id(&nets(&["fd00:10:244:7::/64", "10.244.7.0/24"])), v4);
        let a = node_id(&nets(&["fd00:10:244:7::/64"])).unwrap();
        let b = node_id(&nets(&["fd00:10:244:8::/64"])).unwrap();
        assert_ne!(a, b);
        assert_eq!(node_id(&[]), None);
        assert!(node_id(&nets(&["0.0.0.0/0"])).is_some());
    }

    #[test]
    fn every_node_becomes_a_peer_with_its_pod_cidrs_as_blocks() {
        let me = my_record(
            "a",
            &nets(&["10.244.1.0/24"]),
            vec!["10.0.0.1".parse().unwrap()],
        );
        let nodes = BTreeMap::from([
            ("a".to_owned(), seen_of(&["10.244.1.0/24"], &["10.0.0.99"])),
            (
                "b".to_owned(),
                seen_of(&["10.244.2.0/24", "fd00:2::/64"], &["10.0.0.2", "fd00::2"]),
            ),
            ("c".to_owned(), seen_of(&[], &["10.0.0.3"])),
        ]);
        let (view, left_out) = view_of(&me, &Overlay::HostGw, &nodes, 7);
        assert!(left_out.is_empty());
        assert!(view.synced);
        assert_eq!(view.revision, 7);
        // This node's own addresses are its own, not the Node's.
        assert_eq!(view.nodes["a"].0, me);
        assert_eq!(view.blocks_of("b"), nets(&["10.244.2.0/24", "fd00:2::/64"]));
        assert_eq!(view.nodes["b"].0.node_ips.len(), 2);
        assert!(view.blocks_of("c").is_empty());
        assert_eq!(view.alive.len(), 3);
    }

    #[test]
    fn vxlan_leaves_out_a_node_whose_id_is_taken() {
        let me = my_record(
            "a",
            &nets(&["10.244.1.0/24"]),
            vec!["10.0.0.1".parse().unwrap()],
        );
        // 10.244.1.0/24 and 10.244.1.0/24 + 32767 /24s fold onto one ID.
        let twin = u32::from("10.244.1.0".parse::<std::net::Ipv4Addr>().unwrap()) + (32767 << 8);
        let twin = format!("{}/24", std::net::Ipv4Addr::from(twin));
        let nodes = BTreeMap::from([
            ("a".to_owned(), seen_of(&["10.244.1.0/24"], &["10.0.0.1"])),
            ("b".to_owned(), seen_of(&[&twin], &["10.0.0.2"])),
            ("c".to_owned(), seen_of(&["10.244.3.0/24"], &["10.0.0.3"])),
        ]);
        let vxlan = Overlay::Vxlan { vni: 1, port: 4789 };
        let (view, left_out) = view_of(&me, &vxlan, &nodes, 1);
        assert_eq!(left_out, vec!["b".to_owned()]);
        assert!(!view.nodes.contains_key("b"));
        assert!(view.nodes.contains_key("c"));
        // Host-gw needs no IDs: everyone is routed.
        let (view, left_out) = view_of(&me, &Overlay::HostGw, &nodes, 1);
        assert!(left_out.is_empty());
        assert_eq!(view.nodes.len(), 3);
    }
}
