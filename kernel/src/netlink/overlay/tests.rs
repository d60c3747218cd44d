//! Tests of the inter-node routing primitives. The pure ones check message
//! shapes and plans anywhere. The kernel ones need root: each runs on a
//! thread that first unshares a throwaway netns, makes its "nodes" and
//! "pods" as further netns held only by fds, and reaches them through
//! setns on short-lived threads or `nsenter --net`. When a test ends, even by
//! panic, the fds close and the kernel destroys the namespaces with every
//! link, address and route in them: nothing is ever made in the machine's
//! own netns.
//!
//! The netns helpers are `netlink::tests`'s.

use std::future::Future;
use std::net::IpAddr;
use std::path::Path;

use nix::sched::{setns, unshare, CloneFlags};
use serde_json::Value;

use super::super::tests::{is_root, netns_inode, new_netns, pings, require_root, run_in, Netns};
use super::*;
use crate::{host_ifname, pod_mac, PodWiring, Veths};
use tether_base::mac::Mac;

const MAC_A: [u8; 6] = [0x0a, 0x58, 0x74, 0x76, 0x00, 0x01];
const MAC_B: [u8; 6] = [0x0a, 0x58, 0x74, 0x76, 0x00, 0x02];

fn ip(s: &str) -> IpAddr {
    s.parse().expect("ip")
}

fn route(dst: &str, via: &str, onlink_dev: Option<&str>) -> ClusterRoute {
    ClusterRoute {
        dst: dst.parse().expect("cidr"),
        via: ip(via),
        onlink_dev: onlink_dev.map(str::to_owned),
    }
}

fn sorted(mut routes: Vec<ClusterRoute>) -> Vec<ClusterRoute> {
    routes.sort();
    routes
}

fn synced(added: usize, removed: usize) -> Synced {
    Synced { added, removed }
}

// ---------------------------------------------------------------- pure

#[test]
fn cluster_route_messages_carry_protocol_gateway_and_onlink() {
    let plain = cluster_route(
        &route("10.244.1.0/26", "192.0.2.2", None),
        None,
        CLUSTER_ROUTE_PROTOCOL,
    );
    assert_eq!(
        plain.header.protocol,
        RouteProtocol::Other(CLUSTER_ROUTE_PROTOCOL)
    );
    assert_eq!(plain.header.table, RouteHeader::RT_TABLE_MAIN);
    assert_eq!(plain.header.scope, RouteScope::Universe);
    assert_eq!(
        messages::route_destination(&plain),
        Some((ip("10.244.1.0"), 26))
    );
    assert_eq!(messages::route_gateway(&plain), Some(ip("192.0.2.2")));
    // No device: the kernel resolves it through the gateway.
    assert_eq!(messages::route_oif(&plain), None);
    assert!(!is_onlink(&plain));

    let onlink = cluster_route(
        &route("fd00:244::40/122", "fe80::7474:2", Some(VXLAN_IFNAME)),
        Some(7),
        VM_ROUTE_PROTOCOL,
    );
    assert_eq!(
        onlink.header.protocol,
        RouteProtocol::Other(VM_ROUTE_PROTOCOL)
    );
    assert_eq!(onlink.header.address_family, AddressFamily::Inet6);
    assert_eq!(messages::route_oif(&onlink), Some(7));
    assert!(is_onlink(&onlink));

    let selector = cluster_route_selector(
        &onlink,
        "fd00:244::40/122".parse().unwrap(),
        VM_ROUTE_PROTOCOL,
    );
    assert_eq!(
        selector.header.protocol,
        RouteProtocol::Other(VM_ROUTE_PROTOCOL)
    );
    assert_eq!(selector.header.scope, RouteScope::NoWhere);
    assert_eq!(messages::route_gateway(&selector), Some(ip("fe80::7474:2")));
    assert_eq!(messages::route_oif(&selector), Some(7));
}

#[test]
fn desired_routes_are_normalized_and_checked() {
    let routes = normalized_routes(&[
        route("10.244.1.5/26", "192.0.2.2", None),
        route("10.244.1.0/26", "192.0.2.2", None),
        route("fd00:244::45/122", "fd00:1::2", None),
    ])
    .expect("valid");
    // Host bits cleared, duplicates merged.
    assert_eq!(
        routes,
        vec![
            route("10.244.1.0/26", "192.0.2.2", None),
            route("fd00:244::40/122", "fd00:1::2", None),
        ]
    );
    let mixed = normalized_routes(&[route("10.244.1.0/26", "fd00:1::2", None)])
        .expect_err("mixed families");
    assert_eq!(mixed.code(), 199, "{mixed}");
    assert!(
        mixed.to_string().contains("mixes address families"),
        "{mixed}"
    );
    let twice = normalized_routes(&[
        route("10.244.1.0/26", "192.0.2.2", None),
        route("10.244.1.0/26", "192.0.2.3", None),
    ])
    .expect_err("two next hops");
    assert!(
        twice
            .to_string()
            .contains("two cluster routes to 10.244.1.0/26"),
        "{twice}"
    );
}

#[test]
fn peer_tables_refuse_what_would_flap() {
    let a = VxlanPeer {
        node_ip: ip("192.0.2.1"),
        mac: MAC_A,
        gateways: vec![ip("169.254.128.1"), ip("fe80::7474:1")],
    };
    let b = VxlanPeer {
        node_ip: ip("192.0.2.2"),
        mac: MAC_B,
        gateways: vec![ip("169.254.128.2")],
    };
    let (fdb, neigh) = peer_tables(&[a.clone(), b.clone()]).expect("valid");
    assert_eq!(fdb.len(), 2);
    assert_eq!(fdb[&MAC_B], ip("192.0.2.2"));
    assert_eq!(neigh.len(), 3);
    assert_eq!(neigh[&ip("fe80::7474:1")], MAC_A);

    let same_mac = VxlanPeer {
        mac: MAC_A,
        ..b.clone()
    };
    let err = peer_tables(&[a.clone(), same_mac]).expect_err("shared MAC");
    assert!(
        err.to_string().contains("share MAC 0a:58:74:76:00:01"),
        "{err}"
    );
    let same_gateway = VxlanPeer {
        gateways: vec![ip("169.254.128.1")],
        ..b
    };
    let err = peer_tables(&[a, same_gateway]).expect_err("shared gateway");
    assert!(err.to_string().contains("169.254.128.1"), "{err}");
}

#[test]
fn vxlan_messages_have_the_right_shape() {
    let cfg = VxlanConfig {
        vni: 4097,
        port: 4789,
        local: ip("192.0.2.1"),
        mac: MAC_A,
        mtu: 1450,
    };
    let link = vxlan_link(&cfg);
    assert!(link
        .attributes
        .contains(&LinkAttribute::IfName(VXLAN_IFNAME.into())));
    assert!(link
        .attributes
        .contains(&LinkAttribute::Address(MAC_A.to_vec())));
    assert!(link.attributes.contains(&LinkAttribute::Mtu(1450)));
    let info = vxlan_info(&link).expect("vxlan info");
    for want in [
        InfoVxlan::Id(4097),
        InfoVxlan::Port(4789),
        InfoVxlan::Local("192.0.2.1".parse().unwrap()),
        InfoVxlan::Learning(false),
    ] {
        assert!(info.contains(&want), "{want:?} in {info:?}");
    }
    // A link carries what it was made from: nothing to fix.
    assert_eq!(vxlan_difference(&link, &cfg), None);
    let other = VxlanConfig {
        vni: 4098,
        ..cfg.clone()
    };
    assert!(vxlan_difference(&link, &other)
        .expect("differs")
        .contains("4098"));
    let v6 = vxlan_link(&VxlanConfig {
        local: ip("fd00:1::1"),
        ..cfg
    });
    assert!(vxlan_info(&v6)
        .expect("info")
        .contains(&InfoVxlan::Local6("fd00:1::1".parse().unwrap())));

    let fdb = fdb_entry(9, &MAC_B, Some(ip("192.0.2.2")));
    assert_eq!(fdb.header.family, AddressFamily::Bridge);
    assert_eq!(fdb.header.flags, NeighbourFlags::Own);
    assert_eq!(fdb.header.state, NeighbourState::Permanent);
    assert_eq!(fdb.header.ifindex, 9);
    assert_eq!(neighbour_mac(&fdb), Some(MAC_B));
    assert_eq!(fdb_destination(&fdb), Some(ip("192.0.2.2")));
    // Parsed back from a dump, AF_BRIDGE addresses are raw bytes.
    let mut dumped = fdb_entry(9, &MAC_B, None);
    dumped
        .attributes
        .push(NeighbourAttribute::Destination(NeighbourAddress::Other(
            "fd00:1::2"
                .parse::<std::net::Ipv6Addr>()
                .unwrap()
                .octets()
                .to_vec(),
        )));
    assert_eq!(fdb_destination(&dumped), Some(ip("fd00:1::2")));
    let mut dumped = fdb_entry(9, &MAC_B, None);
    dumped
        .attributes
        .push(NeighbourAttribute::Destination(NeighbourAddress::Other(
            vec![192, 0, 2, 2],
        )));
    assert_eq!(fdb_destination(&dumped), Some(ip("192.0.2.2")));

    let n = vxlan_neighbour(9, ip("fe80::7474:2"), Some(&MAC_B));
    assert_eq!(n.header.family, AddressFamily::Inet6);
    assert_eq!(n.header.state, NeighbourState::Permanent);
    assert_eq!(neighbour_ip(&n), Some(ip("fe80::7474:2")));
    assert_eq!(neighbour_mac(&n), Some(MAC_B));
}

// ---------------------------------------------------------------- harness

/// Runs `body` on a thread that first moves into a netns of its own, so that
/// even a command that forgot its `--net` lands in a namespace that dies
/// with the test.
fn isolated<F: FnOnce() + Send>(body: F) {
    std::thread::scope(|s| {
        s.spawn(move || {
            let root = netns_inode("/proc/thread-self/ns/net");
            unshare(CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET)");
            assert_ne!(
                netns_inode("/proc/thread-self/ns/net"),
                root,
                "the test thread is still in the root netns"
            );
            body();
        })
        .join()
    })
    .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// A "node": a netns in which a dataplane can be run.
struct Node {
    ns: Netns,
}

impl Node {
    fn new() -> Self {
        let node = Self { ns: new_netns() };
        run_in(node.path(), &["ip", "link", "set", "lo", "up"]);
        node
    }

    fn path(&self) -> &str {
        path_str(&self.ns.path)
    }

    /// Runs `body` with a dataplane connected inside this node (forwarding
    /// on), on a thread that entered the node's netns: the dataplane's
    /// socket and its /proc/sys writes both resolve there.
    fn run<T, F, Fut>(&self, body: F) -> T
    where
        T: Send,
        F: FnOnce(Netlink) -> Fut + Send,
        Fut: Future<Output = T>,
    {
        std::thread::scope(|s| {
            s.spawn(move || {
                setns(&self.ns.file, CloneFlags::CLONE_NEWNET).expect("setns into the node");
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                runtime.block_on(async {
                    let dp = Netlink::connect().expect("connect");
                    crate::host::enable_forwarding().expect("enable forwarding");
                    body(dp).await
                })
            })
            .join()
        })
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    }

    fn ifindex(&self, name: &str) -> u64 {
        ip_json(self.path(), &["link", "show", name])[0]["ifindex"]
            .as_u64()
            .expect("ifindex")
    }
}

/// The underlay: a veth `ul0` between the two nodes with 192.0.2.1/24 and
/// fd00:1::1/64 on `a`, .2 and ::2 on `b` (IPv6 without DAD, usable at once).
fn underlay(a: &Node, b: &Node) {
    run_in(
        a.path(),
        &[
            "ip",
            "link",
            "add",
            "ul0",
            "type",
            "veth",
            "peer",
            "name",
            "ul0",
            "netns",
            b.path(),
        ],
    );
    for (node, v4, v6) in [
        (a, "192.0.2.1/24", "fd00:1::1/64"),
        (b, "192.0.2.2/24", "fd00:1::2/64"),
    ] {
        run_in(node.path(), &["ip", "addr", "add", v4, "dev", "ul0"]);
        run_in(
            node.path(),
            &["ip", "addr", "add", v6, "dev", "ul0", "nodad"],
        );
        run_in(node.path(), &["ip", "link", "set", "ul0", "up"]);
    }
}

/// A pod behind a node, wired by the dataplane itself.
struct TestPod {
    ns: Netns,
    host: String,
    ips: Vec<IpAddr>,
}

impl TestPod {
    fn new(id: &str, ips: &[&str]) -> Self {
        Self {
            ns: new_netns(),
            host: host_ifname("cluster-test", id, "eth0"),
            ips: ips.iter().map(|s| ip(s)).collect(),
        }
    }

    fn wiring(&self) -> PodWiring<'_> {
        PodWiring {
            netns: &self.ns.pod,
            pod_ifname: "eth0",
            host_ifname: &self.host,
            pod_mac: pod_mac(&self.ips),
            ips: &self.ips,
            mtu: 1400,
            routed: true,
            tap: None,
            managed_tap: false,
        }
    }

    fn path(&self) -> &str {
        path_str(&self.ns.path)
    }
}

/// JSON output of `ip -j ...` (or of `bridge -j ...` when args start with
/// "bridge"), as a list.
fn json_in(ns: &str, args: &[&str]) -> Vec<Value> {
    let text = run_in(ns, args);
    if text.trim().is_empty() {
        return Vec::new();
    }
    match serde_json::from_str(&text).expect("json output") {
        Value::Array(v) => v
            .into_iter()
            // iproute2 prints an empty object for each entry a filter drops.
            .filter(|v| v.as_object().is_some_and(|o| !o.is_empty()))
            .collect(),
        other => panic!("unexpected output {other}"),
    }
}

fn ip_json(ns: &str, args: &[&str]) -> Vec<Value> {
    let mut full = vec!["ip", "-j"];
    full.extend_from_slice(args);
    json_in(ns, &full)
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// (dst, gateway, dev, onlink) of each route `ip` shows for these args.
fn route_rows(ns: &str, args: &[&str]) -> Vec<(String, String, String, bool)> {
    let mut rows: Vec<_> = ip_json(ns, args)
        .iter()
        .map(|r| {
            (
                r["dst"].as_str().unwrap_or_default().to_owned(),
                r["gateway"].as_str().unwrap_or_default().to_owned(),
                r["dev"].as_str().unwrap_or_default().to_owned(),
                strings(&r["flags"]).contains(&"onlink".to_string()),
            )
        })
        .collect();
    rows.sort();
    rows
}

fn row(dst: &str, gw: &str, dev: &str, onlink: bool) -> (String, String, String, bool) {
    (dst.into(), gw.into(), dev.into(), onlink)
}

/// The permanent neighbours on a device as (address, MAC).
fn permanent_neighbours(ns: &str, dev: &str) -> Vec<(String, String)> {
    let mut out: Vec<_> = ip_json(ns, &["neigh", "show", "dev", dev])
        .iter()
        .filter(|n| strings(&n["state"]).contains(&"PERMANENT".to_string()))
        .map(|n| {
            (
                n["dst"].as_str().unwrap_or_default().to_owned(),
                n["lladdr"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    out.sort();
    out
}

/// The FDB of a device as (MAC, dst, flags, state).
fn fdb_rows(ns: &str, dev: &str) -> Vec<(String, String, Vec<String>, String)> {
    json_in(ns, &["bridge", "-j", "fdb", "show", "dev", dev])
        .iter()
        .map(|e| {
            (
                e["mac"].as_str().unwrap_or_default().to_owned(),
                e["dst"].as_str().unwrap_or_default().to_owned(),
                strings(&e["flags"]),
                e["state"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

fn link_stat(ns: &str, dev: &str, dir: &str) -> u64 {
    ip_json(ns, &["-s", "link", "show", dev])[0]["stats64"][dir]["packets"]
        .as_u64()
        .expect("packet counter")
}

// ---------------------------------------------------------------- kernel

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn host_gw_routes_are_synced_exactly() {
    require_root!();
    isolated(|| {
        let a = &Node::new();
        let b = &Node::new();
        underlay(a, b);
        // Borrowed, so that the pod (and its netns) outlives the call.
        let pod = &TestPod::new("hostgw", &["10.244.1.5", "fd00:244:1::5"]);
        b.run(|dp| async move { dp.wire(&pod.wiring()).await.expect("wire") });

        let first = vec![
            route("10.244.1.0/26", "192.0.2.2", None),
            route("fd00:244:1::/122", "fd00:1::2", None),
        ];
        a.run(|dp| async move {
            assert_eq!(dp.cluster_routes().await.expect("read"), vec![]);
            assert_eq!(
                dp.sync_cluster_routes(&first).await.expect("sync"),
                synced(2, 0)
            );
            assert_eq!(
                dp.cluster_routes().await.expect("read"),
                sorted(first.clone())
            );
            assert_eq!(
                dp.sync_cluster_routes(&first).await.expect("sync again"),
                synced(0, 0),
                "a second sync changes nothing"
            );
        });
        // The kernel has them with protocol 202, the device resolved.
        assert_eq!(
            route_rows(a.path(), &["-4", "route", "show", "proto", "202"]),
            vec![row("10.244.1.0/26", "192.0.2.2", "ul0", false)]
        );
        assert_eq!(
            route_rows(a.path(), &["-6", "route", "show", "proto", "202"]),
            vec![row("fd00:244:1::/122", "fd00:1::2", "ul0", false)]
        );
        // And they carry traffic: the pod behind B answers node A.
        assert!(pings(a.path(), "10.244.1.5"), "A -> pod on B over IPv4");
        assert!(pings(a.path(), "fd00:244:1::5"), "A -> pod on B over IPv6");

        // Someone else's route, and one of ours to a block no longer wanted
        // (a dead node's, left by an earlier run).
        run_in(
            a.path(),
            &[
                "ip",
                "route",
                "add",
                "10.244.9.0/26",
                "via",
                "192.0.2.2",
                "proto",
                "static",
            ],
        );
        run_in(
            a.path(),
            &[
                "ip",
                "route",
                "add",
                "10.244.7.0/26",
                "via",
                "192.0.2.2",
                "proto",
                "202",
            ],
        );
        let second = vec![
            // Moved to another node.
            route("10.244.1.0/26", "192.0.2.3", None),
            // New.
            route("10.244.2.0/26", "192.0.2.2", None),
            // A gateway no subnet covers.
            route("10.244.3.0/26", "169.254.128.9", Some("ul0")),
        ];
        a.run(|dp| async move {
            assert_eq!(
                dp.sync_cluster_routes(&second).await.expect("sync"),
                synced(3, 2),
                "one moved and two added; the v6 block and the leftover removed"
            );
            assert_eq!(
                dp.cluster_routes().await.expect("read"),
                sorted(second.clone())
            );
            assert_eq!(
                dp.sync_cluster_routes(&second).await.expect("sync again"),
                synced(0, 0)
            );
        });
        assert_eq!(
            route_rows(a.path(), &["-4", "route", "show", "proto", "202"]),
            vec![
                row("10.244.1.0/26", "192.0.2.3", "ul0", false),
                row("10.244.2.0/26", "192.0.2.2", "ul0", false),
                row("10.244.3.0/26", "169.254.128.9", "ul0", true),
            ]
        );
        assert!(route_rows(a.path(), &["-6", "route", "show", "proto", "202"]).is_empty());
        let not_ours = ip_json(a.path(), &["route", "show", "10.244.9.0/26"]);
        assert_eq!(not_ours.len(), 1, "{not_ours:?}");
        assert_eq!(not_ours[0]["protocol"], "static", "{not_ours:?}");

        a.run(|dp| async move {
            // Host bits do not make a route different.
            assert_eq!(
                dp.sync_cluster_routes(&[route("10.244.2.7/26", "192.0.2.2", None)])
                    .await
                    .expect("sync"),
                synced(0, 2)
            );
            // Refusals change nothing.
            let err = dp
                .sync_cluster_routes(&[route("10.244.4.0/26", "169.254.128.9", Some("nosuch0"))])
                .await
                .expect_err("no such device");
            assert_eq!(err.code(), 101, "{err}");
            assert!(err.to_string().contains("nosuch0"), "{err}");
            let err = dp
                .sync_cluster_routes(&[route("10.244.4.0/26", "fd00:1::2", None)])
                .await
                .expect_err("mixed families");
            assert_eq!(err.code(), 199, "{err}");
            assert_eq!(
                dp.cluster_routes().await.expect("read"),
                vec![route("10.244.2.0/26", "192.0.2.2", None)]
            );
            // A route the kernel refuses is an error, but does not hold back
            // the rest of the sync: the good route is added and the leftover
            // removed all the same.
            run_in(
                a.path(),
                &[
                    "ip",
                    "route",
                    "add",
                    "10.244.8.0/26",
                    "via",
                    "192.0.2.2",
                    "proto",
                    "202",
                ],
            );
            let err = dp
                .sync_cluster_routes(&[
                    route("10.244.2.0/26", "192.0.2.2", None),
                    route("10.244.4.0/26", "198.51.100.1", None),
                    route("10.244.5.0/26", "192.0.2.2", None),
                ])
                .await
                .expect_err("unreachable gateway");
            assert_eq!(err.code(), 101, "{err}");
            assert!(
                err.to_string()
                    .contains("adding cluster route 10.244.4.0/26 via 198.51.100.1"),
                "{err}"
            );
            assert_eq!(
                dp.cluster_routes().await.expect("read"),
                vec![
                    route("10.244.2.0/26", "192.0.2.2", None),
                    route("10.244.5.0/26", "192.0.2.2", None),
                ]
            );
            assert_eq!(
                dp.sync_cluster_routes(&[]).await.expect("sync"),
                synced(0, 2)
            );
            assert_eq!(dp.cluster_routes().await.expect("read"), vec![]);
        });
        assert_eq!(
            ip_json(a.path(), &["route", "show", "10.244.9.0/26"]).len(),
            1,
            "a route of another protocol is never removed"
        );
    });
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn vxlan_carries_pod_traffic_between_nodes() {
    require_root!();
    isolated(|| {
        let a = &Node::new();
        let b = &Node::new();
        underlay(a, b);
        let cfg = |local: &str, mac| VxlanConfig {
            vni: 4097,
            port: 4789,
            local: ip(local),
            mac,
            mtu: 1450,
        };
        let peer_a = VxlanPeer {
            node_ip: ip("192.0.2.1"),
            mac: MAC_A,
            gateways: vec![ip("169.254.128.1"), ip("fe80::7474:1")],
        };
        let peer_b = VxlanPeer {
            node_ip: ip("192.0.2.2"),
            mac: MAC_B,
            gateways: vec![ip("169.254.128.2"), ip("fe80::7474:2")],
        };
        let vx = Some(VXLAN_IFNAME);
        let routes_a = vec![
            route("10.244.0.64/26", "169.254.128.2", vx),
            route("fd00:244::40/122", "fe80::7474:2", vx),
        ];
        let routes_b = vec![
            route("10.244.0.0/26", "169.254.128.1", vx),
            route("fd00:244::/122", "fe80::7474:1", vx),
        ];
        let pod_a = TestPod::new("vxlan-a", &["10.244.0.5", "fd00:244::5"]);
        let pod_b = TestPod::new("vxlan-b", &["10.244.0.69", "fd00:244::45"]);

        for (node, cfg, pod, peer, routes) in [
            (a, cfg("192.0.2.1", MAC_A), &pod_a, &peer_b, &routes_a),
            (b, cfg("192.0.2.2", MAC_B), &pod_b, &peer_a, &routes_b),
        ] {
            node.run(|dp| async move {
                dp.ensure_vxlan(&cfg).await.expect("ensure_vxlan");
                dp.wire(&pod.wiring()).await.expect("wire");
                let peers = std::slice::from_ref(peer);
                assert_eq!(
                    dp.sync_vxlan_peers(peers).await.expect("peers"),
                    synced(3, 0),
                    "one FDB entry and two neighbours"
                );
                assert_eq!(
                    dp.sync_vxlan_peers(peers).await.expect("peers again"),
                    synced(0, 0)
                );
                assert_eq!(
                    dp.sync_cluster_routes(routes).await.expect("routes"),
                    synced(2, 0)
                );
                assert_eq!(
                    dp.cluster_routes().await.expect("read"),
                    sorted(routes.clone())
                );
            });
        }

        // The device, as `ip -d link` shows it.
        let link = &ip_json(a.path(), &["-d", "link", "show", VXLAN_IFNAME])[0];
        let info = &link["linkinfo"];
        assert_eq!(info["info_kind"], "vxlan", "{link}");
        assert_eq!(info["info_data"]["id"], 4097, "{link}");
        assert_eq!(info["info_data"]["port"], 4789, "{link}");
        assert_eq!(info["info_data"]["local"], "192.0.2.1", "{link}");
        assert_eq!(info["info_data"]["learning"], false, "{link}");
        assert_eq!(link["address"], Mac::from(MAC_A).to_string(), "{link}");
        assert_eq!(link["mtu"], 1450, "{link}");
        assert!(
            strings(&link["flags"]).contains(&"UP".to_string()),
            "{link}"
        );
        let disable_ipv6 = format!("/proc/sys/net/ipv6/conf/{VXLAN_IFNAME}/disable_ipv6");
        assert_eq!(run_in(a.path(), &["cat", &disable_ipv6]).trim(), "0");

        // The FDB and neighbours on A point at B.
        assert_eq!(
            fdb_rows(a.path(), VXLAN_IFNAME),
            vec![(
                Mac::from(MAC_B).to_string(),
                "192.0.2.2".to_string(),
                vec!["self".to_string()],
                "permanent".to_string()
            )]
        );
        assert_eq!(
            permanent_neighbours(a.path(), VXLAN_IFNAME),
            vec![
                ("169.254.128.2".to_string(), Mac::from(MAC_B).to_string()),
                ("fe80::7474:2".to_string(), Mac::from(MAC_B).to_string()),
            ]
        );
        assert_eq!(
            route_rows(a.path(), &["-4", "route", "show", "proto", "202"]),
            vec![row("10.244.0.64/26", "169.254.128.2", VXLAN_IFNAME, true)]
        );
        assert_eq!(
            route_rows(a.path(), &["-6", "route", "show", "proto", "202"]),
            vec![row("fd00:244::40/122", "fe80::7474:2", VXLAN_IFNAME, true)]
        );

        // Pod to pod, both families, both ways, through the tunnel.
        let sent_a = link_stat(a.path(), VXLAN_IFNAME, "tx");
        let got_b = link_stat(b.path(), VXLAN_IFNAME, "rx");
        assert!(pings(pod_a.path(), "10.244.0.69"), "pod A -> pod B, IPv4");
        assert!(pings(pod_a.path(), "fd00:244::45"), "pod A -> pod B, IPv6");
        assert!(pings(pod_b.path(), "10.244.0.5"), "pod B -> pod A, IPv4");
        assert!(pings(pod_b.path(), "fd00:244::5"), "pod B -> pod A, IPv6");
        // Two requests and two replies left A through tether.vxlan, and B
        // received as many.
        assert!(link_stat(a.path(), VXLAN_IFNAME, "tx") >= sent_a + 4);
        assert!(link_stat(b.path(), VXLAN_IFNAME, "rx") >= got_b + 4);

        // B's underlay address changes: only the FDB entry is rewritten.
        let moved = VxlanPeer {
            node_ip: ip("192.0.2.22"),
            ..peer_b.clone()
        };
        a.run(|dp| async move {
            assert_eq!(
                dp.sync_vxlan_peers(&[moved]).await.expect("peers"),
                synced(1, 0)
            );
        });
        assert_eq!(fdb_rows(a.path(), VXLAN_IFNAME)[0].1, "192.0.2.22");

        // B leaves: its entries go, and so does the path to its pods.
        a.run(|dp| async move {
            assert_eq!(dp.sync_vxlan_peers(&[]).await.expect("peers"), synced(0, 3));
            assert_eq!(dp.sync_vxlan_peers(&[]).await.expect("peers"), synced(0, 0));
        });
        assert!(fdb_rows(a.path(), VXLAN_IFNAME).is_empty());
        assert!(permanent_neighbours(a.path(), VXLAN_IFNAME).is_empty());
        assert!(!pings(pod_a.path(), "10.244.0.69"), "no peer, no path");

        // And comes back.
        a.run(|dp| async move {
            assert_eq!(
                dp.sync_vxlan_peers(std::slice::from_ref(&peer_b))
                    .await
                    .expect("peers"),
                synced(3, 0)
            );
        });
        assert!(pings(pod_a.path(), "10.244.0.69"), "path restored");
    });
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn vxlan_device_is_kept_fixed_or_recreated() {
    require_root!();
    isolated(|| {
        let a = &Node::new();
        let cfg = &VxlanConfig {
            vni: 4097,
            port: 4789,
            local: ip("192.0.2.1"),
            mac: MAC_A,
            mtu: 1450,
        };
        let peer = &VxlanPeer {
            node_ip: ip("192.0.2.2"),
            mac: MAC_B,
            gateways: vec![ip("169.254.128.2"), ip("fe80::7474:2")],
        };
        // A node whose default disables IPv6 on new devices.
        run_in(
            a.path(),
            &["sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1"],
        );
        a.run(|dp| async move {
            // No device: nothing to sync is fine, something to sync is not.
            assert_eq!(dp.sync_vxlan_peers(&[]).await.expect("none"), synced(0, 0));
            let err = dp
                .sync_vxlan_peers(std::slice::from_ref(peer))
                .await
                .expect_err("no device");
            assert_eq!(err.code(), 101, "{err}");
            assert!(err.to_string().contains("does not exist"), "{err}");
            dp.ensure_vxlan(cfg).await.expect("create");
            assert_eq!(
                dp.sync_vxlan_peers(std::slice::from_ref(peer))
                    .await
                    .expect("peers"),
                synced(3, 0)
            );
        });
        let disable_ipv6 = format!("/proc/sys/net/ipv6/conf/{VXLAN_IFNAME}/disable_ipv6");
        assert_eq!(run_in(a.path(), &["cat", &disable_ipv6]).trim(), "0");
        let first = a.ifindex(VXLAN_IFNAME);

        // Entries someone else made on our device: a second destination for
        // the peer's MAC, a flood entry, a stray permanent neighbour. The
        // sync puts the peer back to one destination and removes the rest.
        let bridge = |args: &[&str]| {
            let mut full = vec!["bridge", "fdb"];
            full.extend_from_slice(args);
            full.extend_from_slice(&["dev", VXLAN_IFNAME]);
            run_in(a.path(), &full);
        };
        let mac_b = Mac::from(MAC_B).to_string();
        bridge(&["append", &mac_b, "dst", "192.0.2.3"]);
        bridge(&["append", "00:00:00:00:00:00", "dst", "192.0.2.99"]);
        run_in(
            a.path(),
            &[
                "ip",
                "neigh",
                "add",
                "169.254.128.77",
                "lladdr",
                "0a:58:74:76:00:4d",
                "dev",
                VXLAN_IFNAME,
                "nud",
                "permanent",
            ],
        );
        let expected_fdb = vec![(
            mac_b.clone(),
            "192.0.2.2".to_string(),
            vec!["self".to_string()],
            "permanent".to_string(),
        )];
        a.run(|dp| async move {
            assert_eq!(
                dp.sync_vxlan_peers(std::slice::from_ref(peer))
                    .await
                    .expect("peers"),
                synced(1, 2)
            );
        });
        assert_eq!(fdb_rows(a.path(), VXLAN_IFNAME), expected_fdb);
        assert_eq!(permanent_neighbours(a.path(), VXLAN_IFNAME).len(), 2);
        // A peer's entry that is no longer permanent is made so again.
        bridge(&["replace", &mac_b, "dst", "192.0.2.2", "dynamic"]);
        assert_ne!(fdb_rows(a.path(), VXLAN_IFNAME), expected_fdb);
        a.run(|dp| async move {
            assert_eq!(
                dp.sync_vxlan_peers(std::slice::from_ref(peer))
                    .await
                    .expect("peers"),
                synced(1, 0)
            );
        });
        assert_eq!(fdb_rows(a.path(), VXLAN_IFNAME), expected_fdb);

        // The same config again, a new MTU, or a device someone downed:
        // fixed in place, the peers kept.
        a.run(|dp| async move { dp.ensure_vxlan(cfg).await.expect("again") });
        assert_eq!(a.ifindex(VXLAN_IFNAME), first, "idempotent");
        run_in(a.path(), &["ip", "link", "set", VXLAN_IFNAME, "down"]);
        let smaller = &VxlanConfig {
            mtu: 1400,
            ..cfg.clone()
        };
        a.run(|dp| async move { dp.ensure_vxlan(smaller).await.expect("mtu") });
        let link = &ip_json(a.path(), &["link", "show", VXLAN_IFNAME])[0];
        assert_eq!(link["ifindex"].as_u64(), Some(first));
        assert_eq!(link["mtu"], 1400);
        assert!(
            strings(&link["flags"]).contains(&"UP".to_string()),
            "{link}"
        );
        assert_eq!(fdb_rows(a.path(), VXLAN_IFNAME).len(), 1, "peers kept");

        // A new VNI: a new device, without the old one's peers.
        let vni = &VxlanConfig {
            vni: 4098,
            ..smaller.clone()
        };
        a.run(|dp| async move { dp.ensure_vxlan(vni).await.expect("vni") });
        let link = &ip_json(a.path(), &["-d", "link", "show", VXLAN_IFNAME])[0];
        assert_ne!(link["ifindex"].as_u64(), Some(first), "recreated");
        assert_eq!(link["linkinfo"]["info_data"]["id"], 4098, "{link}");
        assert_eq!(link["mtu"], 1400);
        assert!(fdb_rows(a.path(), VXLAN_IFNAME).is_empty());
        assert!(permanent_neighbours(a.path(), VXLAN_IFNAME).is_empty());
        assert_eq!(run_in(a.path(), &["cat", &disable_ipv6]).trim(), "0");

        // A new port, MAC, or local address (here IPv6) each recreate it.
        let mut last = a.ifindex(VXLAN_IFNAME);
        for changed in [
            VxlanConfig {
                port: 8472,
                ..vni.clone()
            },
            VxlanConfig {
                mac: MAC_B,
                ..vni.clone()
            },
            VxlanConfig {
                local: ip("fd00:1::1"),
                ..vni.clone()
            },
        ] {
            let changed = &changed;
            a.run(|dp| async move { dp.ensure_vxlan(changed).await.expect("recreate") });
            let link = &ip_json(a.path(), &["-d", "link", "show", VXLAN_IFNAME])[0];
            let index = link["ifindex"].as_u64().expect("ifindex");
            assert_ne!(index, last, "recreated for {changed:?}");
            last = index;
            let data = &link["linkinfo"]["info_data"];
            assert_eq!(data["port"], u64::from(changed.port), "{link}");
            let local = if changed.local.is_ipv4() {
                "local"
            } else {
                "local6"
            };
            assert_eq!(data[local], changed.local.to_string(), "{link}");
            assert_eq!(
                link["address"],
                Mac::from(changed.mac).to_string(),
                "{link}"
            );
        }

        // Its name taken by something that is not a vxlan device.
        a.run(|dp| async move { dp.delete_vxlan().await.expect("delete") });
        run_in(
            a.path(),
            &[
                "ip",
                "link",
                "add",
                VXLAN_IFNAME,
                "type",
                "veth",
                "peer",
                "name",
                "imposter1",
            ],
        );
        a.run(|dp| async move { dp.ensure_vxlan(cfg).await.expect("replace the veth") });
        let link = &ip_json(a.path(), &["-d", "link", "show", VXLAN_IFNAME])[0];
        assert_eq!(link["linkinfo"]["info_kind"], "vxlan", "{link}");
        assert!(ip_json(a.path(), &["link", "show"])
            .iter()
            .all(|l| l["ifname"] != "imposter1"));

        // Deleted, and deleting again is fine.
        a.run(|dp| async move {
            dp.delete_vxlan().await.expect("delete");
            dp.delete_vxlan().await.expect("delete again");
        });
        assert!(ip_json(a.path(), &["link", "show"])
            .iter()
            .all(|l| l["ifname"] != VXLAN_IFNAME));
    });
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn default_route_address_follows_the_default_route() {
    require_root!();
    isolated(|| {
        let a = &Node::new();
        let b = &Node::new();
        underlay(a, b);
        let address = || a.run(|dp| async move { dp.default_route_address().await.expect("read") });

        assert_eq!(address(), None, "connected routes only");
        run_in(
            a.path(),
            &["ip", "route", "add", "default", "via", "192.0.2.2"],
        );
        assert_eq!(address(), Some(ip("192.0.2.1")));
        // A second address on the device does not change the answer...
        run_in(
            a.path(),
            &["ip", "addr", "add", "192.0.2.10/24", "dev", "ul0"],
        );
        assert_eq!(address(), Some(ip("192.0.2.1")));
        // ...but the route's preferred source does.
        run_in(
            a.path(),
            &[
                "ip",
                "route",
                "replace",
                "default",
                "via",
                "192.0.2.2",
                "src",
                "192.0.2.10",
            ],
        );
        assert_eq!(address(), Some(ip("192.0.2.10")));

        // IPv6 only when there is no IPv4 default.
        run_in(
            a.path(),
            &["ip", "-6", "route", "add", "default", "via", "fd00:1::2"],
        );
        assert_eq!(address(), Some(ip("192.0.2.10")), "IPv4 first");
        let both = a.run(|dp| async move { dp.default_route_addresses().await.expect("read") });
        assert_eq!(
            both,
            vec![ip("192.0.2.10"), ip("fd00:1::1")],
            "one per family"
        );
        run_in(a.path(), &["ip", "route", "del", "default"]);
        assert_eq!(address(), Some(ip("fd00:1::1")));
        run_in(a.path(), &["ip", "-6", "route", "del", "default"]);
        assert_eq!(address(), None);
    });
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn underlay_mtu_follows_the_route() {
    require_root!();
    isolated(|| {
        let a = &Node::new();
        let b = &Node::new();
        underlay(a, b);
        let mtu = |to: &str| {
            let to = ip(to);
            a.run(|dp| async move { dp.underlay_mtu(to).await.expect("mtu") })
        };
        assert_eq!(mtu("192.0.2.2"), Some(1500));
        assert_eq!(mtu("fd00:1::2"), Some(1500));
        run_in(a.path(), &["ip", "link", "set", "ul0", "mtu", "9000"]);
        assert_eq!(mtu("192.0.2.2"), Some(9000));
        assert_eq!(mtu("fd00:1::2"), Some(9000));
        // An address of the node itself (the VXLAN device's local one):
        // the device that holds it, not `lo`, through which the kernel
        // routes an own address (65536).
        assert_eq!(mtu("192.0.2.1"), Some(9000));
        assert_eq!(mtu("fd00:1::1"), Some(9000));
        // No route at all.
        assert_eq!(mtu("203.0.113.1"), None);
        assert_eq!(mtu("2001:db8::1"), None);
        // A route with a smaller MTU than its device wins.
        run_in(
            a.path(),
            &[
                "ip",
                "route",
                "add",
                "203.0.113.0/24",
                "via",
                "192.0.2.2",
                "mtu",
                "1400",
            ],
        );
        assert_eq!(mtu("203.0.113.1"), Some(1400));
        assert_eq!(mtu("198.51.100.1"), None);
    });
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn vm_routes_change_one_by_one_without_touching_the_others() {
    require_root!();
    isolated(|| {
        let a = &Node::new();
        let b = &Node::new();
        underlay(a, b);
        let vm = |i: u8, node: &str| route(&format!("10.244.5.{i}/32"), node, None);
        let rows = || route_rows(a.path(), &["-4", "route", "show", "proto", "203"]);
        // Ten VMs on B, in place by a full sync, and the host route of a
        // local VM pod (proto 201).
        let all: Vec<ClusterRoute> = (1..=10).map(|i| vm(i, "192.0.2.2")).collect();
        a.run(|dp| async move {
            dp.sync_vm_routes(&all).await.expect("sync");
        });
        assert_eq!(rows().len(), 10);
        run_in(
            a.path(),
            &[
                "ip", "link", "add", "pod0", "type", "veth", "peer", "name", "pod1",
            ],
        );
        run_in(a.path(), &["ip", "link", "set", "pod0", "up"]);
        run_in(
            a.path(),
            &[
                "ip",
                "route",
                "add",
                "10.244.5.20/32",
                "dev",
                "pod0",
                "proto",
                "201",
            ],
        );

        a.run(|dp| async move {
            // VM 3 leaves for another node, VM 4's record goes, VM 20 (the
            // local pod's, after its migration away) is routed to B in
            // place of its host route, and the deletion of a route that is
            // not there (VM 11) is no error.
            let put = vec![vm(3, "192.0.2.3"), vm(20, "192.0.2.2")];
            let gone = vec![vm(4, "192.0.2.2"), vm(11, "192.0.2.2")];
            dp.change_vm_routes(&put, &gone).await.expect("change");
            // A deletion names the route as it was programmed: VM 3's old
            // route is not VM 3's route now, which stays.
            dp.change_vm_routes(&[], &[vm(3, "192.0.2.2")])
                .await
                .expect("change");
        });
        let now = rows();
        assert!(
            now.contains(&row("10.244.5.3", "192.0.2.3", "ul0", false)),
            "{now:?}"
        );
        assert!(
            now.contains(&row("10.244.5.20", "192.0.2.2", "ul0", false)),
            "{now:?}"
        );
        assert!(!now.iter().any(|r| r.0 == "10.244.5.4"), "{now:?}");
        assert_eq!(now.len(), 10, "{now:?}");
        let host = route_rows(a.path(), &["-4", "route", "show", "proto", "201"]);
        assert!(host.is_empty(), "the host route was replaced: {host:?}");
        for i in [1, 2, 5, 6, 7, 8, 9, 10] {
            assert!(
                now.contains(&row(&format!("10.244.5.{i}"), "192.0.2.2", "ul0", false)),
                "VM {i}'s route was touched: {now:?}"
            );
        }
    });
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn block_routes_change_one_by_one_with_their_own_protocol() {
    require_root!();
    isolated(|| {
        let a = &Node::new();
        let b = &Node::new();
        underlay(a, b);
        let block = |i: u8, node: &str| route(&format!("10.244.{i}.0/26"), node, None);
        let rows = |proto: &str| route_rows(a.path(), &["-4", "route", "show", "proto", proto]);
        let all: Vec<ClusterRoute> = (1..=4).map(|i| block(i, "192.0.2.2")).collect();
        a.run(|dp| async move {
            dp.sync_cluster_routes(&all).await.expect("sync");
            // Block 5 claimed, block 2 freed, block 3 now held by another
            // node; block 9, never routed, freed too (no error).
            let put = vec![block(5, "192.0.2.2"), block(3, "192.0.2.3")];
            let gone = vec![block(2, "192.0.2.2"), block(9, "192.0.2.2")];
            assert_eq!(
                dp.change_cluster_routes(&put, &gone).await.expect("change"),
                synced(2, 2)
            );
        });
        let now = rows("202");
        assert_eq!(
            now,
            [
                row("10.244.1.0/26", "192.0.2.2", "ul0", false),
                row("10.244.3.0/26", "192.0.2.3", "ul0", false),
                row("10.244.4.0/26", "192.0.2.2", "ul0", false),
                row("10.244.5.0/26", "192.0.2.2", "ul0", false),
            ]
        );
        assert!(
            rows("203").is_empty(),
            "no VM route made: {:?}",
            rows("203")
        );
    });
}
