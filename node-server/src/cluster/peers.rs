//! Where a node learns the other nodes and their pod ranges, for its
//! routes to them: the control plane's view in cluster mode, or the
//! Kubernetes Node objects with `--pod-cidr-from-node`
//! (`crate::kube::node_peers`). The route manager plans from either alike.

use super::view::ClusterView;
use super::{Cluster, NodeRecord, Overlay};
use std::sync::Arc;
use tokio::sync::watch;
/// The other nodes as one source of them sees them: this node's record,
/// how they are reached, and a view of every node and its address ranges
/// (the blocks of cluster mode, the pod CIDRs of Node objects), with a
/// notification on every change.
pub trait Peers: Send + Sync {
    /// This node's record: its name, ID and underlay addresses.
    fn me(&self) -> NodeRecord;
    /// Host-gw or VXLAN.
    fn overlay(&self) -> Overlay;
    /// The latest view.
    fn view(&self) -> Arc<ClusterView>;
    /// Notified on every view change.
    fn subscribe(&self) -> watch::Receiver<Arc<ClusterView>>;
}

impl Peers for Cluster {
    fn me(&self) -> NodeRecord {
        Cluster::me(self)
    }
    fn overlay(&self) -> Overlay {
        self.config.overlay
    }
    fn view(&self) -> Arc<ClusterView> {
        Cluster::view(self)
    }
    fn subscribe(&self) -> watch::Receiver<Arc<ClusterView>> {
        Cluster::subscribe(self)
    }
}
