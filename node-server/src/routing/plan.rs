//! Route planning, as pure functions of the control plane's views and the
//! local pods: which routes to other nodes' blocks, which VXLAN peers, and
//! where each VM's addresses go. Nothing here reads the kernel or the
//! stores; [`super::manager`] applies the plan.
//!
//! The VM record is the authority on where a VM's traffic goes:
//! - the node of the active pod routes the VM's addresses to that pod's
//!   veth (protocol 201, like any pod);
//! - every other node routes them `via` that node (protocol 203), unless
//!   that node holds the addresses' block, whose route already goes there.

use std::collections::HashMap;
use std::net::IpAddr;

use ipnet::IpNet;

use crate::cluster::{vtep_underlay, vxlan_gateways, ClusterView, NodeRecord, Overlay};
use crate::vm::{VmAttachment, VmKey, VmView};
use tether_base::mac::Mac;
use tether_ipam::Family;
use tether_kernel::{ClusterRoute, VxlanPeer, VXLAN_IFNAME};
use tether_store::store::{Attachment, AttachmentKey};

/// What the cluster looks like from this node.
#[derive(Debug, Clone, Copy)]
pub struct ClusterSide<'a> {
    /// This node's record.
    pub me: &'a NodeRecord,
    /// Host-gw or VXLAN.
    pub overlay: &'a Overlay,
    /// Every node and block.
    pub view: &'a ClusterView,
}

/// The node holding the block that contains `ip`, if any. Blocks do not
/// overlap, so that block is the last one (in address order) that starts
/// at or before `ip`: one lookup in the ordered map, not a scan of every
/// block (a route pass asks for every VM address). An address that block
/// does not hold is looked for in every block, as before.
pub fn block_holder(view: &ClusterView, ip: IpAddr) -> Option<&str> {
    let holds = |b: &crate::cluster::BlockRecord| b.cidr.contains(&ip);
    match view.blocks.range(..=IpNet::from(ip)).next_back() {
        Some((_, (b, _))) if holds(b) => Some(b.node.as_str()),
        _ => view
            .blocks
            .values()
            .find(|(b, _)| holds(b))
            .map(|(b, _)| b.node.as_str()),
    }
}

/// How this node reaches addresses of `family` on node `name`: the next
/// hop, and the device for an onlink route (vxlan mode). None for this node
/// itself, an unknown node, or one without a usable address.
pub fn next_hop(
    c: &ClusterSide<'_>,
    name: &str,
    family: Family,
) -> Option<(IpAddr, Option<String>)> {
    if name == c.me.name {
        return None;
    }
    let (node, _) = c.view.nodes.get(name)?;
    match c.overlay {
        Overlay::HostGw => node
            .node_ips
            .iter()
            .copied()
            .find(|ip| (family == Family::V4) == ip.is_ipv4())
            .map(|via| (via, None)),
        Overlay::Vxlan { .. } => {
            node.vtep_mac_octets()?;
            vtep_underlay(&node.node_ips, &c.me.node_ips)?;
            let (gw4, gw6) = vxlan_gateways(node.id);
            let via = match family {
                Family::V4 => IpAddr::V4(gw4),
                Family::V6 => IpAddr::V6(gw6),
            };
            Some((via, Some(VXLAN_IFNAME.to_owned())))
        }
    }
}

/// The routes this node needs to reach every other node's blocks, and its
/// VXLAN peers (vxlan mode), both sorted.
pub fn cluster_routes(c: &ClusterSide<'_>) -> (Vec<ClusterRoute>, Vec<VxlanPeer>) {
    let mut routes = Vec::new();
    let mut peers = Vec::new();
    // Every node's blocks, in one pass over the blocks (not one per node).
    let mut blocks: HashMap<&str, Vec<IpNet>> = HashMap::new();
    for (b, _) in c.view.blocks.values() {
        blocks.entry(b.node.as_str()).or_default().push(b.cidr);
    }
    for (name, (node, _)) in &c.view.nodes {
        if *name == c.me.name {
            continue;
        }
        for &b in blocks.get(name.as_str()).into_iter().flatten() {
            if let Some((via, onlink_dev)) = next_hop(c, name, Family::of(&b)) {
                routes.push(ClusterRoute {
                    dst: b,
                    via,
                    onlink_dev,
                });
            }
        }
        if let Overlay::Vxlan { .. } = c.overlay {
            if let (Some(mac), Some(&underlay)) = (
                node.vtep_mac_octets(),
                vtep_underlay(&node.node_ips, &c.me.node_ips),
            ) {
                let (gw4, gw6) = vxlan_gateways(node.id);
                peers.push(VxlanPeer {
                    node_ip: underlay,
                    mac,
                    gateways: vec![IpAddr::V4(gw4), IpAddr::V6(gw6)],
                });
            }
        }
    }
    routes.sort();
    peers.sort();
    (routes, peers)
}

/// How this node routes one VM's addresses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Want {
    /// To a local pod's veth.
    pub here: Option<String>,
    /// To other nodes (proto 203).
    pub via: Vec<ClusterRoute>,
}

pub use crate::vm::FoundTarget;

/// Where this node sends each VM's addresses, and the local migration
/// targets waiting for their VM (by the VM's MAC).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct VmPlan {
    /// Per VM.
    pub wants: HashMap<VmKey, Want>,
    /// Local alternates, by the VM's MAC.
    pub targets: HashMap<Mac, Vec<FoundTarget>>,
}

/// Plans the VM routes of node `me` from the records, its local VM pods
/// (`local`, by key) and, in cluster mode, the cluster.
pub fn vm_routes(
    me: &str,
    vms: &VmView,
    local: &HashMap<AttachmentKey, Attachment>,
    cluster: Option<&ClusterSide<'_>>,
) -> VmPlan {
    let key_of = |x: &VmAttachment| AttachmentKey {
        network: x.network.clone(),
        container_id: x.container_id.clone(),
        ifname: x.ifname.clone(),
    };
    let mut plan = VmPlan::default();
    for (rec, _) in vms.records.values() {
        let mut want = Want::default();
        match &rec.active {
            Some(act) if act.node == me => {
                want.here = local.get(&key_of(act)).map(|a| a.host_ifname.clone());
            }
            Some(act) => {
                if let Some(c) = cluster {
                    for &ip in &rec.ips {
                        if block_holder(c.view, ip) == Some(act.node.as_str()) {
                            continue;
                        }
                        if let Some((via, onlink_dev)) = next_hop(c, &act.node, Family::of_ip(ip)) {
                            want.via.push(ClusterRoute {
                                dst: IpNet::from(ip),
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
            if let Some(a) = local.get(&key_of(alt)) {
                plan.targets.entry(rec.mac).or_default().push((
                    rec.key.clone(),
                    a.key.clone(),
                    a.host_ifname.clone(),
                    rec.generation,
                ));
            }
        }
        plan.wants.insert(rec.key.clone(), want);
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::BlockRecord;
    use crate::vm::{Origin, VmRecord};
    use tether_base::time::{UnixMillis, UnixNanos};

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    fn node(name: &str, id: u32, ips: &[&str], vtep: Option<&str>) -> NodeRecord {
        NodeRecord {
            name: name.into(),
            id,
            node_ips: ips.iter().map(|s| ip(s)).collect(),
            vtep_mac: vtep.map(str::to_owned),
        }
    }

    /// Nodes a (id 1), b (id 2) and c (id 3, no IPv6 underlay); a holds
    /// 10.0.0.0/26, b 10.0.0.64/26 and fd00::/122, c 10.0.0.128/26.
    fn cluster() -> ClusterView {
        let mut view = ClusterView {
            synced: true,
            ..Default::default()
        };
        for n in [
            node(
                "a",
                1,
                &["192.0.2.1", "2001:db8::1"],
                Some("0a:00:00:00:00:01"),
            ),
            node(
                "b",
                2,
                &["192.0.2.2", "2001:db8::2"],
                Some("0a:00:00:00:00:02"),
            ),
            node("c", 3, &["192.0.2.3"], None),
        ] {
            view.nodes.insert(n.name.clone(), (n, 1));
        }
        for (cidr, holder, id) in [
            ("10.0.0.0/26", "a", 1),
            ("10.0.0.64/26", "b", 2),
            ("fd00::/122", "b", 2),
            ("10.0.0.128/26", "c", 3),
        ] {
            let b = BlockRecord {
                cidr: net(cidr),
                node: holder.into(),
                node_id: id,
                claimed_unix_ms: UnixMillis::EPOCH,
            };
            view.blocks.insert(b.cidr, (b, 1));
        }
        view
    }

    fn side<'a>(
        me: &'a NodeRecord,
        overlay: &'a Overlay,
        view: &'a ClusterView,
    ) -> ClusterSide<'a> {
        ClusterSide { me, overlay, view }
    }

    #[test]
    fn host_gw_routes_every_other_nodes_blocks_via_its_address() {
        let view = cluster();
        let me = view.nodes["a"].0.clone();
        let (routes, peers) = cluster_routes(&side(&me, &Overlay::HostGw, &view));
        assert!(peers.is_empty());
        let got: Vec<(String, String, Option<String>)> = routes
            .iter()
            .map(|r| (r.dst.to_string(), r.via.to_string(), r.onlink_dev.clone()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("10.0.0.64/26".into(), "192.0.2.2".into(), None),
                ("10.0.0.128/26".into(), "192.0.2.3".into(), None),
                ("fd00::/122".into(), "2001:db8::2".into(), None),
            ]
        );
    }

    #[test]
    fn vxlan_routes_go_through_the_gateways_of_peers_with_a_vtep() {
        let view = cluster();
        let me = view.nodes["a"].0.clone();
        let overlay = Overlay::Vxlan { vni: 7, port: 4789 };
        let (routes, peers) = cluster_routes(&side(&me, &overlay, &view));
        // c has no VTEP MAC: no routes to it and no peer.
        let (gw4, gw6) = vxlan_gateways(2);
        assert_eq!(
            routes,
            vec![
                ClusterRoute {
                    dst: net("10.0.0.64/26"),
                    via: IpAddr::V4(gw4),
                    onlink_dev: Some(VXLAN_IFNAME.into()),
                },
                ClusterRoute {
                    dst: net("fd00::/122"),
                    via: IpAddr::V6(gw6),
                    onlink_dev: Some(VXLAN_IFNAME.into()),
                },
            ]
        );
        assert_eq!(peers.len(), 1);
        assert_eq!(peers[0].node_ip, ip("192.0.2.2"));
        assert_eq!(peers[0].mac, [0x0a, 0, 0, 0, 0, 2]);
    }

    fn pod(node: &str, cid: &str) -> VmAttachment {
        VmAttachment {
            node: node.into(),
            network: "net".into(),
            container_id: cid.into(),
            ifname: "eth0".into(),
            pod_name: None,
            pod_uid: None,
            since_unix_ms: UnixMillis::EPOCH,
        }
    }

    fn record(
        vm: &str,
        ips: &[&str],
        active: Option<VmAttachment>,
        alternate: Option<VmAttachment>,
    ) -> VmRecord {
        VmRecord {
            key: VmKey::new("ns", vm, "eth0").unwrap(),
            ips: ips.iter().map(|s| ip(s)).collect(),
            mac: "0a:58:0a:00:00:05".parse().unwrap(),
            origin: Origin::Allocated,
            active,
            alternate,
            generation: 3,
            created_unix_ms: UnixMillis::EPOCH,
            last_cutover: None,
        }
    }

    fn vms(records: Vec<VmRecord>) -> VmView {
        VmView {
            records: records
                .into_iter()
                .map(|r| (r.key.clone(), (std::sync::Arc::new(r), 1)))
                .collect(),
            revision: 1,
            synced: true,
        }
    }

    fn local(cids: &[&str]) -> HashMap<AttachmentKey, Attachment> {
        cids.iter()
            .map(|cid| {
                let key = AttachmentKey {
                    network: "net".into(),
                    container_id: (*cid).into(),
                    ifname: "eth0".into(),
                };
                let a = Attachment {
                    key: key.clone(),
                    netns: format!("/run/netns/{cid}"),
                    ips: vec![ip("10.0.0.5")],
                    mac: "0a:58:0a:00:00:05".parse().unwrap(),
                    host_ifname: format!("tth-{cid}"),
                    mtu: 1500,
                    created_unix_nanos: UnixNanos::EPOCH,
                    pod_namespace: None,
                    pod_name: None,
                    pod_uid: None,
                    vm: Some(VmKey::new("ns", "vm1", "eth0").unwrap()),
                    guest: None,
                    pools: Vec::new(),
                    ipam_only: false,
                };
                (key, a)
            })
            .collect()
    }

    #[test]
    fn a_vm_active_here_is_routed_to_its_pod_and_a_local_alternate_waits() {
        let view = vms(vec![record(
            "vm1",
            &["10.0.0.5"],
            Some(pod("a", "src")),
            Some(pod("a", "dst")),
        )]);
        let plan = vm_routes("a", &view, &local(&["src", "dst"]), None);
        let key = VmKey::new("ns", "vm1", "eth0").unwrap();
        assert_eq!(plan.wants[&key].here.as_deref(), Some("tth-src"));
        assert!(plan.wants[&key].via.is_empty());
        let mac: Mac = "0a:58:0a:00:00:05".parse().unwrap();
        assert_eq!(
            plan.targets[&mac],
            vec![(
                key.clone(),
                local(&["dst"]).into_keys().next().unwrap(),
                "tth-dst".into(),
                3
            )]
        );
        // An active pod that is not (yet) in the table gets no route.
        let plan = vm_routes("a", &view, &local(&[]), None);
        assert_eq!(plan.wants[&key], Want::default());
        assert!(plan.targets.is_empty());
    }

    #[test]
    fn a_vm_active_elsewhere_is_routed_via_its_node_unless_that_node_holds_the_block() {
        let view = cluster();
        let me = view.nodes["a"].0.clone();
        let overlay = Overlay::HostGw;
        let side = side(&me, &overlay, &view);
        // On c, outside c's block: a /32 via c. Inside b's block and on b:
        // b's block route carries it already.
        let records = vms(vec![
            record("vm1", &["10.0.0.5"], Some(pod("c", "x")), None),
            record("vm2", &["10.0.0.70", "fd00::5"], Some(pod("b", "y")), None),
        ]);
        let plan = vm_routes("a", &records, &local(&[]), Some(&side));
        let vm1 = VmKey::new("ns", "vm1", "eth0").unwrap();
        let vm2 = VmKey::new("ns", "vm2", "eth0").unwrap();
        assert_eq!(
            plan.wants[&vm1].via,
            vec![ClusterRoute {
                dst: net("10.0.0.5/32"),
                via: ip("192.0.2.3"),
                onlink_dev: None,
            }]
        );
        assert!(plan.wants[&vm1].here.is_none());
        assert_eq!(plan.wants[&vm2], Want::default());
        // Without the cluster (--pod-cidr mode) there is nowhere to route.
        let plan = vm_routes("a", &records, &local(&[]), None);
        assert!(plan.wants.values().all(|w| *w == Want::default()));
        // A VM that runs nowhere is routed nowhere.
        let idle = vms(vec![record("vm1", &["10.0.0.5"], None, None)]);
        let plan = vm_routes("a", &idle, &local(&["src"]), Some(&side));
        assert_eq!(plan.wants[&vm1], Want::default());
    }

    #[test]
    fn block_holder_finds_the_block_of_an_address() {
        let view = cluster();
        assert_eq!(block_holder(&view, ip("10.0.0.70")), Some("b"));
        assert_eq!(block_holder(&view, ip("fd00::3")), Some("b"));
        assert_eq!(block_holder(&view, ip("10.0.0.200")), None);
        // The lookup agrees with a scan of every block on every address
        // around and inside them: first, last, between, both families.
        let scan = |ip: IpAddr| {
            view.blocks
                .values()
                .find(|(b, _)| b.cidr.contains(&ip))
                .map(|(b, _)| b.node.as_str())
        };
        let addrs = (0..=255u8)
            .map(|i| IpAddr::from([10, 0, 0, i]))
            .chain([ip("9.255.255.255"), ip("10.0.1.0"), ip("0.0.0.0")])
            .chain((0..=70u16).map(|i| IpAddr::from([0xfd00, 0, 0, 0, 0, 0, 0, i])))
            .chain([ip("fcff::"), ip("fd00::1:0"), ip("::")]);
        for a in addrs {
            assert_eq!(block_holder(&view, a), scan(a), "{a}");
        }
    }

    /// A pass plans each node's blocks from one pass over the blocks: the
    /// routes are every other node's blocks, each via that node, and none
    /// of this node's.
    #[test]
    fn cluster_routes_cover_every_other_nodes_blocks() {
        let view = cluster();
        let me = view.nodes["a"].0.clone();
        let (routes, _) = cluster_routes(&ClusterSide {
            me: &me,
            overlay: &Overlay::HostGw,
            view: &view,
        });
        let got: Vec<(IpNet, IpAddr)> = routes.iter().map(|r| (r.dst, r.via)).collect();
        assert_eq!(
            got,
            vec![
                (net("10.0.0.64/26"), ip("192.0.2.2")),
                (net("10.0.0.128/26"), ip("192.0.2.3")),
                (net("fd00::/122"), ip("2001:db8::2")),
            ]
        );
    }

    #[tokio::test]
    async fn routes_follow_the_cluster_view() {
        use crate::cluster::tests::{config, embedded, join};
        let (_dir, store) = embedded();
        let a = join(&store, config("a")).await;
        let mut cb = config("b");
        cb.node_ips = vec![
            "192.0.2.2".parse().unwrap_or_else(|e| panic!("{e}")),
            "2001:db8::2".parse().unwrap_or_else(|e| panic!("{e}")),
        ];
        let b = join(&store, cb).await;
        let b4 = b.claim(Family::V4).await.unwrap_or_else(|e| panic!("{e}"));
        let b6 = b.claim(Family::V6).await.unwrap_or_else(|e| panic!("{e}"));
        let a4 = a.claim(Family::V4).await.unwrap_or_else(|e| panic!("{e}"));
        let mut rx = a.subscribe();
        let view = loop {
            let v = rx.borrow_and_update().clone();
            if v.blocks.len() == 3 {
                break v;
            }
            let _ = rx.changed().await;
        };
        let me = a.me();
        let (routes, peers) = cluster_routes(&ClusterSide {
            me: &me,
            overlay: &a.config().overlay,
            view: &view,
        });
        assert!(peers.is_empty());
        let want: Vec<(String, String)> = routes
            .iter()
            .map(|r| (r.dst.to_string(), r.via.to_string()))
            .collect();
        assert_eq!(
            want,
            vec![
                (b4.to_string(), "192.0.2.2".into()),
                (b6.to_string(), "2001:db8::2".into())
            ]
        );
        assert!(routes.iter().all(|r| r.dst != a4 && r.onlink_dev.is_none()));
    }
}
