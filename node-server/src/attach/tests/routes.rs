//! The route manager against a cluster view the test sets.

use tokio::sync::watch;

use super::*;
use crate::cluster::{BlockRecord, ClusterView, NodeRecord, Overlay, Peers};
use tether_base::time::UnixMillis;

/// The other nodes as the test says they are: a test double of the control
/// plane's view (the cluster suites prove the store's watch behind it).
struct SetPeers {
    me: NodeRecord,
    overlay: Overlay,
    tx: watch::Sender<Arc<ClusterView>>,
}

impl SetPeers {
    fn new() -> Arc<SetPeers> {
        SetPeers::on(Overlay::HostGw)
    }

    fn on(overlay: Overlay) -> Arc<SetPeers> {
        let view = ClusterView {
            synced: true,
            ..ClusterView::default()
        };
        Arc::new(SetPeers {
            me: NodeRecord {
                name: "node-a".into(),
                id: 1,
                node_ips: vec![ip("192.0.2.1")],
                vtep_mac: None,
            },
            overlay,
            tx: watch::channel(Arc::new(view)).0,
        })
    }

    /// `name` (ID `id`, underlay `node_ip`) joins, holding `block`.
    fn join(&self, name: &str, id: u32, node_ip: &str, block: &str) {
        self.tx.send_modify(|v| {
            let v = Arc::make_mut(v);
            let revision = v.revision + 1;
            let record = NodeRecord {
                name: name.into(),
                id,
                node_ips: vec![ip(node_ip)],
                vtep_mac: None,
            };
            v.nodes.insert(name.into(), (record, revision));
            let block = BlockRecord {
                cidr: net(block),
                node: name.into(),
                node_id: id,
                claimed_unix_ms: UnixMillis::EPOCH,
            };
            v.blocks.insert(block.cidr, (block, revision));
            v.revision = revision;
        });
    }

    /// `block` is freed.
    fn free(&self, block: &str) {
        self.tx.send_modify(|v| {
            let v = Arc::make_mut(v);
            v.blocks.remove(&net(block));
            v.revision += 1;
        });
    }
}

impl Peers for SetPeers {
    fn me(&self) -> NodeRecord {
        self.me.clone()
    }
    fn overlay(&self) -> Overlay {
        self.overlay
    }
    fn view(&self) -> Arc<ClusterView> {
        self.tx.borrow().clone()
    }
    fn subscribe(&self) -> watch::Receiver<Arc<ClusterView>> {
        self.tx.subscribe()
    }
}

fn routed(t: &TestNode, block: &str) -> bool {
    t.kernel.routes().contains_key(&net(block))
}

/// A node with the test's peers, node-b (holding 10.2.0.0/28) joined
/// before its route manager starts, and that block routed.
async fn started_with_node_b() -> (Arc<SetPeers>, TestNode) {
    let peers = SetPeers::new();
    let t = TestNode::with(Options {
        vm_tasks: false,
        peers: Some(peers.clone()),
        ..Options::default()
    })
    .await;
    assert!(!routed(&t, "10.2.0.0/28"));
    peers.join("node-b", 2, "192.0.2.2", "10.2.0.0/28");
    t.node.start_vm_tasks();
    t.eventually("node-b's block routed", |t| routed(t, "10.2.0.0/28"))
        .await;
    (peers, t)
}

/// A peer's block that arrives after the start-up pass programmed the
/// routes, but before the route manager subscribed to the view, is routed
/// all the same: the route manager's first pass does not wait for a
/// change. (Seen on two kubelet nodes starting together: one node never
/// routed the other's first block, claimed in that window.)
#[tokio::test]
async fn a_block_seen_before_the_route_manager_starts_is_routed() {
    let (peers, t) = started_with_node_b().await;
    // And the manager follows the changes after that.
    peers.join("node-c", 3, "192.0.2.3", "10.3.0.0/28");
    t.eventually("node-c's block routed", |t| routed(t, "10.3.0.0/28"))
        .await;
}

/// A block claimed elsewhere costs this node one route added, without a
/// read of its routes; a block freed, one route deleted. The periodic
/// repair reads the routes back and puts back one deleted by hand.
#[tokio::test]
async fn block_passes_change_only_what_changed_and_a_repair_reads_back() {
    use tether_kernel::fake::Call;
    let (peers, t) = started_with_node_b().await;
    let cluster_calls = |t: &TestNode| -> Vec<(Call, String)> {
        t.kernel
            .log()
            .into_iter()
            .filter(|(c, _)| matches!(c, Call::SyncClusterRoutes | Call::ChangeClusterRoutes))
            .collect()
    };

    t.kernel.clear_log();
    peers.join("node-c", 3, "192.0.2.3", "10.3.0.0/28");
    t.eventually("node-c's block routed", |t| routed(t, "10.3.0.0/28"))
        .await;
    assert_eq!(
        cluster_calls(&t),
        [(Call::ChangeClusterRoutes, "10.3.0.0/28".to_string())]
    );

    t.kernel.clear_log();
    peers.free("10.2.0.0/28");
    t.eventually("node-b's block unrouted", |t| !routed(t, "10.2.0.0/28"))
        .await;
    assert_eq!(
        cluster_calls(&t),
        [(Call::ChangeClusterRoutes, "10.2.0.0/28".to_string())]
    );

    // Deleted by hand: no pass notices until the repair reads back.
    t.kernel.drop_route_to(net("10.3.0.0/28"));
    t.kernel.clear_log();
    t.node.routes.force_repair();
    t.eventually("node-c's block routed again", |t| routed(t, "10.3.0.0/28"))
        .await;
    assert_eq!(
        cluster_calls(&t),
        [(Call::SyncClusterRoutes, "1 routes".to_string())]
    );
}

/// The MTU of the pod ends of this node's veths.
fn pod_mtus(t: &TestNode) -> Vec<u32> {
    t.kernel.links().values().map(|l| l.mtu).collect()
}

/// Without `--mtu`, pods get 1500 in host-gw mode and the VXLAN device's
/// MTU (the underlay's 1500 less 50) in VXLAN mode, so that a pod's
/// full-size packet fits the overlay; `--mtu` wins in either mode.
#[tokio::test]
async fn the_default_pod_mtu_fits_the_overlay_and_mtu_wins() {
    let vxlan = Overlay::Vxlan {
        vni: 4096,
        port: 4789,
    };
    for (overlay, mtu, want) in [
        (Overlay::HostGw, None, 1500),
        (vxlan, None, 1450),
        (vxlan, Some(1400), 1400),
        (Overlay::HostGw, Some(9000), 9000),
    ] {
        let t = TestNode::with(Options {
            vm_tasks: false,
            peers: Some(SetPeers::on(overlay)),
            mtu,
            ..Options::default()
        })
        .await;
        t.add("c1", "p1").await.expect("ADD");
        assert_eq!(pod_mtus(&t), [want], "{overlay:?} with --mtu {mtu:?}");
    }
}
