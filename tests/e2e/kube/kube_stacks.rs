//! tether on dual-stack and IPv6-only kubelet clusters (tests/src/stack.rs:
//! the API server with a Service range per family, the kubelets'
//! `--node-ip` with an address per family, kube-proxy and the controller
//! manager with a cluster CIDR per family), installed by its chart in
//! each of its cluster modes and overlays that the conformance runs do
//! not use: node CIDRs (the controller manager's `spec.podCIDRs`, one per
//! family, per Node) over VXLAN, an etcd of tether's own (reached over the
//! cluster's first family) over host routes (host-gw), and the Kubernetes
//! store over VXLAN. The Kubernetes store on host routes is what `make
//! conformance` and the conformance slice run, on every stack.
//!
//! In each: a pod on each node gets one address per family of the
//! cluster, inside the cluster CIDR of that family and the node's pod CIDR
//! (node CIDRs) or a block the node holds in the mode's store (the etcd's
//! keys, the API's AddressBlocks); the pods reach each other across the nodes in every
//! family, the way the overlay says (the VXLAN device, or a route via
//! the other node's address of the family); a node and the control plane
//! reach the pods; and a pod reaches a host outside the cluster, which
//! has no route to any pod, in every family: outbound NAT for both.
//!
//! Each stack's cluster takes the three in turn, as an operator changes
//! a cluster's mode (docs/user/choosing-a-mode.md): between two, the pods
//! are deleted and tether uninstalled with `helm uninstall`, then
//! installed with the next values. Going to host routes must remove the
//! VXLAN device, and going back to VXLAN must make it again (the
//! controller manager gives the Nodes pod CIDRs throughout; outside mode
//! node CIDRs tether does not read them).

use std::net::IpAddr;
use std::time::{Duration, Instant};

use ipnet::IpNet;
use serde_json::{json, Value};
use tether_e2e::cluster::EtcdCluster;
use tether_e2e::kube_cluster::{KubeCluster, KubeNode, KubePod};
use tether_e2e::paths::Outside;
use tether_e2e::stack::Stack;
use tether_e2e::topology::Topology;
use tether_e2e::{assert_ping_within, require_root, wait_until};

/// Routes reach the other node through its daemon's watch.
const CONVERGE: Duration = Duration::from_secs(30);
/// tether's VXLAN device (`tether_kernel::VXLAN_IFNAME`).
const VXLAN_DEV: &str = "tether.vxlan";

/// How pods reach the other node's pods (the chart's `overlay`).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Overlay {
    HostGw,
    Vxlan,
}

impl Overlay {
    fn value(self) -> &'static str {
        match self {
            Overlay::HostGw => "none",
            Overlay::Vxlan => "vxlan",
        }
    }
}

/// The chart's mode and where its addresses come from.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// `nodeCidrs`: each Node's `spec.podCIDRs`.
    NodeCidrs,
    /// `etcd`: blocks of the cluster CIDRs, claimed in an etcd of its own.
    Etcd,
    /// `kubernetes`: blocks of the cluster CIDRs, claimed in the
    /// Kubernetes API (the chart's default).
    Kubernetes,
}

impl Mode {
    fn value(self) -> &'static str {
        match self {
            Mode::NodeCidrs => "nodeCidrs",
            Mode::Etcd => "etcd",
            Mode::Kubernetes => "kubernetes",
        }
    }
}

/// Starts a `stack` cluster of two kubelet nodes whose controller
/// manager gives each Node a pod CIDR per family, and an etcd beside it;
/// installs tether in each mode in turn, checks what the module doc says
/// in each, and takes it down between two the way an operator changes
/// modes (the pods deleted, `helm uninstall`).
fn in_turn(stack: Stack) {
    require_root();
    let mut c = Topology::kubelet(2).stack(stack).node_cidrs().start();
    let outside = Outside::on(c.fabric());
    let image = c.build_tether_image("1");
    // tether's own etcd (one member, plain HTTP) beside the control plane,
    // reached at its address of the cluster's first family.
    let etcd = EtcdCluster::start(c.fabric(), 1);
    let endpoint = if stack.has_v4() {
        etcd.endpoint(0)
    } else {
        etcd.endpoint_v6(0)
    };
    let turns = [
        ("a", Mode::NodeCidrs, Overlay::Vxlan),
        ("b", Mode::Etcd, Overlay::HostGw),
        ("c", Mode::Kubernetes, Overlay::Vxlan),
    ];
    for (i, &(prefix, mode, overlay)) in turns.iter().enumerate() {
        if i > 0 {
            take_down(&c, turns[i - 1].0);
        }
        let mut values = json!({"mode": mode.value(), "overlay": overlay.value()});
        if mode == Mode::Etcd {
            values["etcd"] = json!({"endpoints": [endpoint], "tlsSecret": ""});
        }
        c.set_chart_values(values);
        c.install_tether(&image);
        let store = Store {
            mode,
            etcd: (&etcd, &endpoint),
        };
        wired(&c, &outside, prefix, store, overlay);
    }
    drop(c);
    drop(etcd);
}

/// Deletes pods `{prefix}0` and `{prefix}1` and uninstalls tether
/// (`helm uninstall`), as docs/user/choosing-a-mode.md says to before
/// another mode; waits until tether's pods are gone.
fn take_down(c: &KubeCluster, prefix: &str) {
    for i in 0..2 {
        c.delete_pod(&format!("{prefix}{i}"));
    }
    c.uninstall_tether();
    let gone = wait_until(CONVERGE, || c.tether_pods().is_empty());
    assert!(gone, "tether's pods did not go: {:?}", c.tether_pods());
}

/// Where tether, installed in `mode`, takes its addresses from.
#[derive(Clone, Copy)]
struct Store<'a> {
    mode: Mode,
    /// The etcd of mode etcd, and its endpoint.
    etcd: (&'a EtcdCluster, &'a str),
}

/// Checks the VXLAN device is there with the VXLAN overlay and gone
/// (removed by tetherd) with host routes; runs pods `{prefix}0` and
/// `{prefix}1`, one on each node of `c`, where tether is installed in
/// `store.mode` over `overlay`, and checks what the module doc says.
fn wired(c: &KubeCluster, outside: &Outside, prefix: &str, store: Store<'_>, overlay: Overlay) {
    let what = format!(
        "{} cluster, mode {:?}, {overlay:?}",
        c.stack().title(),
        store.mode
    );
    // The install returns once the nodes are Ready, which they are with
    // the conflist in place (or still, if the kubelet has not yet seen
    // the uninstall): possibly before tetherd has set up its overlay.
    let links = |node: &KubeNode| node.netns().exec_ok(&["ip", "-o", "link", "show"]);
    let want = overlay == Overlay::Vxlan;
    let installed = Instant::now();
    for node in c.nodes() {
        let ok = wait_until(CONVERGE, || links(node).contains(VXLAN_DEV) == want);
        assert!(
            ok,
            "{what}: {}: {VXLAN_DEV} is {}:\n{}",
            node.name(),
            if want { "missing" } else { "left" },
            links(node)
        );
    }
    eprintln!(
        "{what}: {VXLAN_DEV} {} on both nodes {:.1} s after the install",
        if want { "there" } else { "gone" },
        installed.elapsed().as_secs_f64()
    );
    let pods: Vec<KubePod> = (0..2)
        .map(|i| c.run_pod(&format!("{prefix}{i}"), c.nodes()[i].name()))
        .collect();
    let cluster_cidrs: Vec<IpNet> = c
        .stack()
        .pod_cidrs()
        .iter()
        .map(|s| s.parse().expect("a CIDR"))
        .collect();
    for pod in &pods {
        assert_eq!(
            pod.ips.len(),
            cluster_cidrs.len(),
            "{what}: pod {} has {:?}, one address per family of {cluster_cidrs:?}",
            pod.name,
            pod.ips
        );
        let ranges = ranges_of(c, store, &pod.node);
        for (ip, cidr) in pod.ips.iter().zip(&cluster_cidrs) {
            assert!(
                cidr.contains(ip) && ranges.iter().any(|r| r.contains(ip)),
                "{what}: pod {}'s {ip} is not in {cidr} and one of {ranges:?}",
                pod.name
            );
        }
    }
    for family in 0..pods[0].ips.len() {
        // Across the nodes, both ways, and the way the overlay says.
        for (from, to) in [(0, 1), (1, 0)] {
            let ip = pods[to].ips[family];
            assert_ping_within(pods[from].netns(), ip, CONVERGE);
            let node = &c.nodes()[from];
            let route = route_to(node, ip);
            let want = match overlay {
                Overlay::Vxlan => format!("dev {VXLAN_DEV}"),
                Overlay::HostGw => format!("via {}", address_like(&c.nodes()[to], ip)),
            };
            assert!(
                route.contains(&want),
                "{what}: {} routes {ip} as `{route}`, not `{want}`",
                node.name()
            );
            // The node itself, and the control plane (its route to the
            // pod network of the family, via the first node).
            assert_ping_within(node.netns(), ip, CONVERGE);
            assert_ping_within(c.api.netns(), ip, CONVERGE);
        }
        // Outbound NAT: the outside host has no route to any pod.
        let out = outside_address(outside, pods[0].ips[family]);
        for pod in &pods {
            assert_ping_within(pod.netns(), out, CONVERGE);
        }
    }
    eprintln!(
        "{what}: pods {:?} and {:?} reach each other, the nodes, the control plane and the outside in every family",
        pods[0].ips, pods[1].ips
    );
}

/// Where pods on `node` take their addresses: in mode node CIDRs the
/// Node's `spec.podCIDRs` (one per family of the cluster); in modes etcd
/// and kubernetes the blocks that `node` holds in that mode's store (the
/// etcd's `/tether/v1/blocks/` keys, or the API's AddressBlocks), so that
/// tether answering from another store fails the check.
fn ranges_of(c: &KubeCluster, store: Store<'_>, node: &str) -> Vec<IpNet> {
    let records: Vec<Value> = match store.mode {
        Mode::NodeCidrs => {
            let n = c.api.get(&["node", node]).expect("the node");
            let cidrs: Vec<IpNet> = n["spec"]["podCIDRs"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|c| c.as_str()?.parse().ok())
                .collect();
            assert_eq!(
                cidrs.len(),
                c.stack().pod_cidrs().len(),
                "node {node}'s podCIDRs {cidrs:?}: one per family of the cluster"
            );
            return cidrs;
        }
        Mode::Etcd => {
            let (etcd, endpoint) = store.etcd;
            let out = etcd.control().exec_ok(&[
                "etcdctl",
                &format!("--endpoints={endpoint}"),
                "get",
                "--prefix",
                "/tether/v1/blocks/",
                "--print-value-only",
            ]);
            out.lines()
                .filter(|l| !l.trim().is_empty())
                .map(|l| serde_json::from_str(l).expect("a block record"))
                .collect()
        }
        Mode::Kubernetes => {
            let list = c.api.get(&["addressblocks"]).expect("the AddressBlocks");
            list["items"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|b| b["spec"].clone())
                .collect()
        }
    };
    records
        .iter()
        .filter(|r| r["node"] == node)
        .filter_map(|r| r["cidr"].as_str()?.parse().ok())
        .collect()
}

/// `node`'s route to `ip` (`ip route get`).
fn route_to(node: &KubeNode, ip: IpAddr) -> String {
    node.netns()
        .exec_ok(&["ip", "route", "get", &ip.to_string()])
        .trim()
        .to_string()
}

/// `node`'s fabric address of `ip`'s family.
fn address_like(node: &KubeNode, ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => IpAddr::V4(node.underlay().v4),
        IpAddr::V6(_) => IpAddr::V6(node.underlay().v6),
    }
}

/// The outside host's address of `ip`'s family.
fn outside_address(outside: &Outside, ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => IpAddr::V4(outside.underlay().v4),
        IpAddr::V6(_) => IpAddr::V6(outside.underlay().v6),
    }
}

#[cfg_attr(
    not(feature = "kubelet-tests"),
    ignore = "kubelet tier: root and kubelet nodes built from Kubernetes' source; `make test` runs it"
)]
#[test]
fn dual_stack_pods_reach_every_family_in_three_modes_installed_in_turn() {
    in_turn(Stack::Dual);
}

#[cfg_attr(
    not(feature = "kubelet-tests"),
    ignore = "kubelet tier: root and kubelet nodes built from Kubernetes' source; `make test` runs it"
)]
#[test]
fn ipv6_only_pods_reach_every_family_in_three_modes_installed_in_turn() {
    in_turn(Stack::V6);
}
