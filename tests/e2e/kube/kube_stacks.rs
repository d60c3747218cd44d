//! tether on dual-stack and IPv6-only kubelet clusters (tests/src/stack.rs:
//! the API server with a Service range per family, the kubelets'
//! `--node-ip` with an address per family, kube-proxy and the controller
//! manager with a cluster CIDR per family), installed by its chart in each
//! of its cluster modes that the conformance runs do not use: node CIDRs
//! (the controller manager's `spec.podCIDRs`, one per family, per Node)
//! over VXLAN, and an etcd of tether's own (reached over the cluster's
//! first family) over host routes (host-gw). The
//! Kubernetes store on host routes is what `make conformance` and the
//! conformance slice run, on every stack.
//!
//! In each: a pod on each node gets one address per family of the
//! cluster, inside the node's pod CIDR of that family (node CIDRs) or the
//! cluster CIDR; the pods reach each other across the nodes in every
//! family, the way the overlay says (the VXLAN device, or a route via
//! the other node's address of the family); a node and the control plane
//! reach the pods; and a pod reaches a host outside the cluster, which
//! has no route to any pod, in every family: outbound NAT for both.

use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;
use serde_json::json;
use tether_e2e::cluster::EtcdCluster;
use tether_e2e::kube_cluster::{KubeCluster, KubeNode, KubePod};
use tether_e2e::paths::Outside;
use tether_e2e::stack::Stack;
use tether_e2e::topology::Topology;
use tether_e2e::{assert_ping_within, require_root};

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
}

/// Starts a `stack` cluster of two kubelet nodes with tether in `mode`
/// over `overlay`, then checks what the module doc says.
fn wired(stack: Stack, mode: Mode, overlay: Overlay) {
    require_root();
    let what = format!("{} cluster, mode {mode:?}, {overlay:?}", stack.title());
    let mut topology = Topology::kubelet(2).stack(stack);
    if mode == Mode::NodeCidrs {
        topology = topology.node_cidrs();
    }
    let mut c = topology.start();
    // tether's own etcd (one member, plain HTTP) beside the control plane.
    let etcd = (mode == Mode::Etcd).then(|| EtcdCluster::start(c.fabric(), 1));
    let mut values = json!({"overlay": overlay.value()});
    match &etcd {
        Some(etcd) => {
            // Reached at its address of the cluster's first family.
            let endpoint = if stack.has_v4() {
                etcd.endpoint(0)
            } else {
                etcd.endpoint_v6(0)
            };
            values["mode"] = json!("etcd");
            values["etcd"] = json!({"endpoints": [endpoint], "tlsSecret": ""});
        }
        None => values["mode"] = json!("nodeCidrs"),
    }
    c.set_chart_values(values);
    let outside = Outside::on(c.fabric());
    let image = c.build_tether_image("1");
    c.install_tether(&image);

    let pods: Vec<KubePod> = (0..2)
        .map(|i| c.run_pod(&format!("p{i}"), c.nodes()[i].name()))
        .collect();
    for pod in &pods {
        let ranges = ranges_of(&c, mode, &pod.node);
        assert_eq!(
            pod.ips.len(),
            ranges.len(),
            "{what}: pod {} has {:?}, one address per family of {ranges:?}",
            pod.name,
            pod.ips
        );
        for (ip, range) in pod.ips.iter().zip(&ranges) {
            assert!(
                range.contains(ip),
                "{what}: pod {}'s {ip} is not in {range}",
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
        let out = outside_address(&outside, pods[0].ips[family]);
        for pod in &pods {
            assert_ping_within(pod.netns(), out, CONVERGE);
        }
    }
    eprintln!(
        "{what}: pods {:?} and {:?} reach each other, the nodes, the control plane and the outside in every family",
        pods[0].ips, pods[1].ips
    );
    drop(pods);
    drop(c);
    drop(etcd);
}

/// Where pods on `node` take their addresses, one range per family of
/// the cluster, in its order: the Node's `spec.podCIDRs` in mode node
/// CIDRs, the cluster CIDRs otherwise.
fn ranges_of(c: &KubeCluster, mode: Mode, node: &str) -> Vec<IpNet> {
    let cidrs: Vec<String> = match mode {
        Mode::NodeCidrs => {
            let n = c.api.get(&["node", node]).expect("the node");
            let cidrs: Vec<String> = n["spec"]["podCIDRs"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|c| c.as_str().map(str::to_string))
                .collect();
            assert_eq!(
                cidrs.len(),
                c.stack().pod_cidrs().len(),
                "node {node}'s podCIDRs {cidrs:?}: one per family of the cluster"
            );
            cidrs
        }
        Mode::Etcd => c
            .stack()
            .pod_cidrs()
            .iter()
            .map(|s| s.to_string())
            .collect(),
    };
    cidrs.iter().map(|s| s.parse().expect("a CIDR")).collect()
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
fn dual_stack_pods_on_node_cidrs_over_vxlan_reach_every_family() {
    wired(Stack::Dual, Mode::NodeCidrs, Overlay::Vxlan);
}

#[cfg_attr(
    not(feature = "kubelet-tests"),
    ignore = "kubelet tier: root and kubelet nodes built from Kubernetes' source; `make test` runs it"
)]
#[test]
fn dual_stack_pods_on_tethers_own_etcd_over_host_routes_reach_every_family() {
    wired(Stack::Dual, Mode::Etcd, Overlay::HostGw);
}

#[cfg_attr(
    not(feature = "kubelet-tests"),
    ignore = "kubelet tier: root and kubelet nodes built from Kubernetes' source; `make test` runs it"
)]
#[test]
fn ipv6_only_pods_on_node_cidrs_over_vxlan_reach_every_family() {
    wired(Stack::V6, Mode::NodeCidrs, Overlay::Vxlan);
}

#[cfg_attr(
    not(feature = "kubelet-tests"),
    ignore = "kubelet tier: root and kubelet nodes built from Kubernetes' source; `make test` runs it"
)]
#[test]
fn ipv6_only_pods_on_tethers_own_etcd_over_host_routes_reach_every_family() {
    wired(Stack::V6, Mode::Etcd, Overlay::HostGw);
}
