//! `--pod-cidr-from-node` on three nodes, with no etcd: every node routes
//! to the others' pod CIDRs as their Node objects in a real kube-apiserver
//! show them (`spec.podCIDRs`, the `InternalIP`), watched.
//!
//! - host-gw, the nodes on one L2 segment (the fabric's bridge): routes
//!   `podCIDR via InternalIP`, both families;
//! - VXLAN, each node on its own subnet behind a router (the fabric netns
//!   forwarding between them), where host-gw cannot work;
//! - in both: pods on every pair of nodes ping each other; a pod's packets
//!   reach another node's pod with their own source address (not NATed);
//!   a Node object that appears is routed to and one that goes away is
//!   withdrawn; while the API server is away the routes stay, and the
//!   watch catches up when it is back.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde_json::json;
use tether_e2e::cluster::{Fabric, Pod, CLUSTER_ROUTE_PROTOCOL};
use tether_e2e::kube::{KubeApi, TETHER_SA};
use tether_e2e::{
    admin, assert_ping_within, cni, pb, require_root, tether_bin, wait_until, CniEnv, Daemon, Netns,
};

use crate::harness::shared::node_cidr_daemon;

/// The API's changes reach the daemons through a watch: allow for it.
const CONVERGE: Duration = Duration::from_secs(20);

/// Node `i`'s pod CIDRs: not adjacent to each other, so that the NAT
/// table's exemptions stay one range per node.
fn pod_cidrs(i: usize) -> [String; 2] {
    [
        format!("10.251.{}.0/24", 2 * i + 2),
        format!("fd00:251:{}::/64", 2 * i + 2),
    ]
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Overlay {
    HostGw,
    Vxlan,
}

/// One node: its netns with tetherd, its InternalIPs.
struct Node {
    daemon: Daemon,
    ips: Vec<IpAddr>,
}

/// A Node object named `name` with these pod CIDRs and InternalIPs, as a
/// kubelet and the node IPAM controller would leave it (neither runs
/// here: the status is patched as the kubelet would).
fn put_node(api: &KubeApi, name: &str, cidrs: &[String], ips: &[IpAddr]) {
    api.apply(
        &json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name},
            "spec": {"podCIDR": cidrs[0], "podCIDRs": cidrs},
        })
        .to_string(),
    );
    let addresses: Vec<_> = ips
        .iter()
        .map(|ip| json!({"type": "InternalIP", "address": ip.to_string()}))
        .chain([json!({"type": "Hostname", "address": name})])
        .collect();
    api.kubectl_ok(&[
        "patch",
        "node",
        name,
        "--subresource=status",
        "--type=merge",
        "-p",
        &json!({"status": {"addresses": addresses}}).to_string(),
    ]);
}

/// The fabric, the API server on it, and three nodes running tetherd with
/// `--pod-cidr-from-node` and the install's service account. VXLAN: each
/// node on its own IPv4 subnet, routed by the fabric netns.
fn three_nodes(overlay: Overlay) -> (Fabric, KubeApi, PathBuf, Vec<Node>) {
    let fabric = Fabric::new();
    let api = KubeApi::start(&fabric);
    api.install_tether();
    let kubeconfig = api.token_kubeconfig(TETHER_SA.0, TETHER_SA.1);
    if overlay == Overlay::Vxlan {
        fabric
            .netns()
            .exec_ok(&["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
    }
    let mut nodes = Vec::new();
    for i in 0..3 {
        let ns = Netns::new("node");
        let ips: Vec<IpAddr> = match overlay {
            Overlay::HostGw => {
                let u = fabric.attach_host(&ns, 31 + i as u16);
                vec![u.v4.into(), u.v6.into()]
            }
            Overlay::Vxlan => {
                let (gw, me) = (format!("10.78.{i}.1"), format!("10.78.{i}.2"));
                fabric.netns().exec_ok(&[
                    "ip",
                    "addr",
                    "add",
                    &format!("{gw}/24"),
                    "dev",
                    fabric.bridge(),
                ]);
                fabric.attach(&ns, &[&format!("{me}/24")]);
                ns.exec_ok(&["ip", "route", "add", "default", "via", &gw]);
                vec![me.parse().expect("an address")]
            }
        };
        put_node(&api, ns.name(), &pod_cidrs(i), &ips);
        let flag = match overlay {
            Overlay::HostGw => "none",
            Overlay::Vxlan => "vxlan",
        };
        let daemon = node_cidr_daemon(ns, &kubeconfig, &["--overlay", flag]);
        nodes.push(Node { daemon, ips });
    }
    (fabric, api, kubeconfig, nodes)
}

/// A pod on `node`, added through the real plugin.
fn add_pod(node: &Node) -> Pod {
    let netns = Netns::new("pod");
    let id = netns.name().to_owned();
    let conf = node.daemon.netconf("1.1.0", "tether-nodes");
    let out = cni(
        &tether_bin(),
        &CniEnv::new("ADD", &id, &netns),
        &serde_json::to_vec(&conf).expect("JSON"),
    );
    assert!(out.success(), "ADD on {}: {out}", node.daemon.node_name());
    Pod::from_output(netns, id, node.daemon.node_name(), &out)
}

/// The destinations of `node`'s routes to other nodes, sorted.
fn route_dsts(node: &Node) -> Vec<String> {
    let mut dsts: Vec<String> = node
        .daemon
        .node()
        .routes_with_protocol(CLUSTER_ROUTE_PROTOCOL)
        .iter()
        .filter_map(|r| r["dst"].as_str().map(str::to_owned))
        .collect();
    dsts.sort();
    dsts
}

/// What `node` must route to: every other node's pod CIDRs, and `extra`.
fn wanted(nodes: &[Node], me: usize, extra: &[String]) -> Vec<String> {
    let mut want: Vec<String> = (0..nodes.len())
        .filter(|&i| i != me)
        .flat_map(pod_cidrs)
        .chain(extra.iter().cloned())
        .collect();
    want.sort();
    want
}

fn wait_routes(nodes: &[Node], extra: &[String], what: &str) {
    for (i, node) in nodes.iter().enumerate() {
        let want = wanted(nodes, i, extra);
        let mut got = Vec::new();
        assert!(
            wait_until(CONVERGE, || {
                got = route_dsts(node);
                got == want
            }),
            "{what}: node {i} routes {got:?}, wants {want:?}\n{}",
            node.daemon.log()
        );
    }
}

/// The source address a UDP datagram from `from` to `to` arrives with,
/// as a receiver in `to`'s netns sees it.
fn arriving_source(from: &Pod, to: &Pod) -> String {
    let dst = to.ips()[0];
    let receiver = format!(
        "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); \
         s.bind(('{dst}', 7777)); s.settimeout(10); print(s.recvfrom(100)[1][0])"
    );
    let ns = to.netns().name().to_owned();
    let listener = std::thread::spawn(move || {
        std::process::Command::new("ip")
            .args(["netns", "exec", &ns, "python3", "-c", &receiver])
            .output()
            .expect("running python3")
    });
    // Send until the receiver has bound and got one.
    let sender = format!(
        "import socket, time\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         for _ in range(40):\n    s.sendto(b'hi', ('{dst}', 7777)); time.sleep(0.1)"
    );
    from.netns().exec_ok(&["python3", "-c", &sender]);
    let out = listener.join().expect("the receiver thread");
    assert!(
        out.status.success(),
        "receiver: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn pods_reach_each_other_across_three_nodes(overlay: Overlay) {
    require_root();
    let (_fabric, mut api, _kubeconfig, nodes) = three_nodes(overlay);
    let routing = match overlay {
        Overlay::HostGw => "host-gw",
        Overlay::Vxlan => "vxlan",
    };
    for (i, node) in nodes.iter().enumerate() {
        let info = admin::node(node.daemon.socket());
        assert_eq!(info.ipam_mode, "node-cidr");
        assert_eq!(info.routing, routing);
        let ips: Vec<String> = node.ips.iter().map(IpAddr::to_string).collect();
        assert_eq!(info.node_ip, ips.join(","), "node {i}: {info:?}");
    }
    wait_routes(&nodes, &[], "three nodes");
    let listed = admin::admin(nodes[0].daemon.socket(), |mut c| async move {
        c.list_nodes(pb::ListNodesRequest::default()).await
    })
    .nodes;
    assert_eq!(listed.len(), 3, "{listed:#?}");
    assert_eq!(listed.iter().filter(|n| n.local).count(), 1);
    if overlay == Overlay::Vxlan {
        for node in &nodes {
            assert!(node.daemon.node().has_link("tether.vxlan"));
            // Host-gw could not work here: no node shares a subnet.
            for r in node
                .daemon
                .node()
                .routes_with_protocol(CLUSTER_ROUTE_PROTOCOL)
            {
                assert_eq!(r["dev"].as_str(), Some("tether.vxlan"), "{r}");
            }
        }
    }

    // Pods on every pair of nodes, both families.
    let pods: Vec<Pod> = nodes.iter().map(add_pod).collect();
    for from in &pods {
        for to in pods.iter().filter(|p| p.node() != from.node()) {
            for ip in to.ips() {
                assert_ping_within(from.netns(), *ip, CONVERGE);
            }
        }
    }
    // Outbound NAT leaves pod-to-pod traffic alone: the other node's pod
    // sees this pod's own address.
    let source = arriving_source(&pods[0], &pods[1]);
    assert_eq!(source, pods[0].ips()[0].to_string(), "NATed on the way");

    // A fourth Node (no daemon runs there): routed to, then withdrawn.
    let extra = pod_cidrs(7).to_vec();
    // Host-gw routes a family only through an InternalIP of that family;
    // VXLAN carries both over the IPv4 underlay.
    let fourth_ips: Vec<IpAddr> = match overlay {
        Overlay::HostGw => vec![
            "10.77.0.99".parse().expect("an address"),
            "fd00:77:ff::99".parse().expect("an address"),
        ],
        Overlay::Vxlan => vec!["10.78.9.2".parse().expect("an address")],
    };
    put_node(&api, "fourth", &extra, &fourth_ips);
    wait_routes(&nodes, &extra, "a Node added");
    // The API server goes away: routes stay as they are.
    api.stop_apiserver();
    std::thread::sleep(Duration::from_secs(3));
    for (i, node) in nodes.iter().enumerate() {
        assert_eq!(route_dsts(node), wanted(&nodes, i, &extra), "API down");
    }
    assert_ping_within(pods[2].netns(), pods[0].ips()[0], CONVERGE);
    // It comes back; a Node deleted now reaches the daemons through the
    // resumed watch, which withdraws its routes.
    api.start_apiserver();
    api.kubectl_ok(&["delete", "node", "fourth"]);
    wait_routes(&nodes, &[], "a Node deleted after the API server came back");
    for from in &pods {
        for to in pods.iter().filter(|p| p.node() != from.node()) {
            assert_ping_within(from.netns(), to.ips()[0], CONVERGE);
        }
    }
}

#[cfg_attr(
    not(feature = "cluster-tests"),
    ignore = "cluster tier: root, etcd and kube-apiserver; `make test` runs it"
)]
#[test]
fn host_gw_pods_on_three_nodes_reach_each_other_through_node_objects() {
    pods_reach_each_other_across_three_nodes(Overlay::HostGw);
}

#[cfg_attr(
    not(feature = "cluster-tests"),
    ignore = "cluster tier: root, etcd and kube-apiserver; `make test` runs it"
)]
#[test]
fn vxlan_pods_on_three_routed_subnets_reach_each_other_through_node_objects() {
    pods_reach_each_other_across_three_nodes(Overlay::Vxlan);
}
