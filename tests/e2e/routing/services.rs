//! Kubernetes Services through kube-proxy on tether's routed veths: two
//! nodes (`--pod-cidr-from-node`, routed to each other by tether from their
//! Node objects), each with kube-proxy v1.37 in iptables mode (built from
//! the k8s.io/kubernetes module with the other binaries) against a real
//! kube-apiserver, and a NodePort Service whose one endpoint is a tether
//! pod on node A. What Kubernetes' network conformance tests ask of a
//! pod network, checked here without the rest of a cluster:
//!
//! - a pod on node B reaches the ClusterIP (the endpoint is on node A),
//!   over TCP (HTTP) and UDP;
//! - the endpoint reaches itself through its own Service (hairpin): a
//!   routed veth needs no hairpin mode, kube-proxy masquerades it;
//! - the NodePort on either node's address, from a pod, from the other
//!   node, and from outside the nodes (the fabric);
//! - the node itself (a hostNetwork client) reaches the ClusterIP.
//!
//! No kubelet runs: the pods are wired through the real plugin and the
//! Service's EndpointSlice is written as the EndpointSlice controller
//! would.

use std::net::IpAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::json;
use tether_e2e::cluster::{Fabric, Underlay};
use tether_e2e::kube::{k8s_bin_dir, KubeApi, TETHER_SA};
use tether_e2e::{cni, require_root, tether_bin, wait_until, CniEnv, Daemon, Netns, TempDir};

use crate::harness::shared::node_cidr_daemon;

const CONVERGE: Duration = Duration::from_secs(30);
/// The Service's ports.
const PORT: u16 = 8080;
const UDP_PORT: u16 = 5353;
const NODE_PORT: u16 = 30080;

/// A child process of this test, killed and reaped on drop.
struct Owned(Child);

impl Drop for Owned {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `argv` in `ns` in the background, its output in `log`.
fn spawn_in(ns: &Netns, argv: &[&str], log: &std::path::Path) -> Owned {
    let out = std::fs::File::create(log).expect("creating a log");
    let child = Command::new("ip")
        .args(["netns", "exec", ns.name()])
        .args(argv)
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("a log handle"))
        .stderr(out)
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {argv:?}: {e}"));
    Owned(child)
}

struct Node {
    daemon: Daemon,
    underlay: Underlay,
    _proxy: Owned,
}

/// A pod on `node` wired through the real plugin; its IPv4 address.
fn add_pod(node: &Node, pod: &Netns) -> IpAddr {
    let conf = node.daemon.netconf("1.0.0", "tether-services");
    let out = cni(
        &tether_bin(),
        &CniEnv::new("ADD", pod.name(), pod),
        &serde_json::to_vec(&conf).expect("JSON"),
    );
    assert!(out.success(), "ADD: {out}");
    let addr = out.result()["ips"][0]["address"]
        .as_str()
        .expect("an address");
    addr.split('/')
        .next()
        .and_then(|a| a.parse().ok())
        .expect("an IP")
}

/// HTTP status of GET `url` from `ns` ("000" when nothing answered).
fn http(ns: &Netns, url: &str) -> String {
    let out = ns.exec(&[
        "curl",
        "-s",
        "-m",
        "3",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        url,
    ]);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn assert_http(ns: &Netns, url: &str, what: &str) {
    let mut last = String::new();
    assert!(
        wait_until(CONVERGE, || {
            last = http(ns, url);
            last == "200"
        }),
        "{what}: GET {url} answered {last:?}"
    );
}

/// A UDP datagram to `ip:port` from `ns` comes back (the endpoint echoes).
fn udp_echoes(ns: &Netns, ip: &str, port: u16) -> bool {
    let client = format!(
        "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\ns.settimeout(1)\n\
         s.sendto(b'ping', ('{ip}', {port}))\nprint(s.recvfrom(100)[0].decode())"
    );
    let out = ns.exec(&["python3", "-c", &client]);
    String::from_utf8_lossy(&out.stdout).trim() == "ping"
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn services_through_kube_proxy_reach_tether_pods_across_nodes_and_back_to_themselves() {
    require_root();
    let fabric = Fabric::new();
    let api = KubeApi::start(&fabric);
    api.install_tether();
    let tether_kc = api.token_kubeconfig(TETHER_SA.0, TETHER_SA.1);
    let admin_kc = api.admin_kubeconfig();
    let dir = TempDir::new("svc");
    let kube_proxy = k8s_bin_dir().join("kube-proxy");

    let mut nodes = Vec::new();
    for (i, host) in [(1u8, 51u8), (2, 52)] {
        let ns = Netns::new("node");
        let underlay = fabric.attach_host(&ns, host.into());
        // The Node as the kubelet and the node IPAM controller leave it.
        api.apply(
            &json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": ns.name()},
                    "spec": {"podCIDR": format!("10.254.{i}.0/24"),
                             "podCIDRs": [format!("10.254.{i}.0/24")]}})
            .to_string(),
        );
        api.kubectl_ok(&[
            "patch",
            "node",
            ns.name(),
            "--subresource=status",
            "--type=merge",
            "-p",
            &json!({"status": {"addresses": [{"type": "InternalIP", "address": underlay.v4.to_string()}]}})
                .to_string(),
        ]);
        // The service CIDR is not NATed to by tether.
        let daemon = node_cidr_daemon(ns, &tether_kc, &["--no-nat-to", "10.96.0.0/16"]);
        let name = daemon.node_name().to_owned();
        // kube-proxy as a kubeadm node runs it, in iptables mode; it leaves
        // nf_conntrack_max alone (read-only in a netns).
        let proxy = spawn_in(
            daemon.node(),
            &[
                &kube_proxy.display().to_string(),
                "--kubeconfig",
                &admin_kc.display().to_string(),
                "--hostname-override",
                &name,
                "--proxy-mode=iptables",
                "--cluster-cidr=10.254.0.0/16",
                "--conntrack-max-per-core=0",
                "--metrics-bind-address=127.0.0.1:10249",
                "--healthz-bind-address=127.0.0.1:10256",
            ],
            &dir.path().join(format!("kube-proxy-{i}.log")),
        );
        nodes.push(Node {
            daemon,
            underlay,
            _proxy: proxy,
        });
    }
    let (a, b) = (&nodes[0], &nodes[1]);

    // The endpoint on node A: HTTP on 80, a UDP echo on 53.
    let server_ns = Netns::new("pod");
    let server_ip = add_pod(a, &server_ns);
    let _http = spawn_in(
        &server_ns,
        &["python3", "-m", "http.server", "80", "--bind", "0.0.0.0"],
        &dir.path().join("http.log"),
    );
    let echo = "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
                s.bind(('0.0.0.0', 53))\nwhile True:\n    d, peer = s.recvfrom(100)\n    s.sendto(d, peer)";
    let _udp = spawn_in(
        &server_ns,
        &["python3", "-c", echo],
        &dir.path().join("udp.log"),
    );
    let client_ns = Netns::new("pod");
    add_pod(b, &client_ns);

    api.apply(
        &json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "default"},
                "spec": {"type": "NodePort", "ports": [
                    {"name": "http", "port": PORT, "targetPort": 80, "nodePort": NODE_PORT, "protocol": "TCP"},
                    {"name": "dns", "port": UDP_PORT, "targetPort": 53, "protocol": "UDP"}]}})
        .to_string(),
    );
    api.apply(
        &json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": "web-1", "namespace": "default",
                             "labels": {"kubernetes.io/service-name": "web"}},
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": 80, "protocol": "TCP"},
                          {"name": "dns", "port": 53, "protocol": "UDP"}],
                "endpoints": [{"addresses": [server_ip.to_string()], "conditions": {"ready": true},
                               "nodeName": a.daemon.node_name()}]})
        .to_string(),
    );
    let svc = api.get(&["service", "web"]).expect("the Service");
    let cluster_ip = svc["spec"]["clusterIP"]
        .as_str()
        .expect("a ClusterIP")
        .to_owned();
    eprintln!(
        "ClusterIP {cluster_ip}, endpoint {server_ip} on node A ({}), client on node B ({})",
        a.underlay.v4, b.underlay.v4
    );

    let service = format!("http://{cluster_ip}:{PORT}/");
    assert_http(&client_ns, &service, "a pod on B to the ClusterIP");
    assert!(
        wait_until(CONVERGE, || udp_echoes(&client_ns, &cluster_ip, UDP_PORT)),
        "a pod on B to the ClusterIP over UDP: no echo"
    );
    assert_http(&server_ns, &service, "the endpoint to its own Service");
    for node in &nodes {
        let url = format!("http://{}:{NODE_PORT}/", node.underlay.v4);
        assert_http(&client_ns, &url, "a pod on B to a NodePort");
        assert_http(&server_ns, &url, "the endpoint to a NodePort");
        assert_http(fabric.netns(), &url, "outside the nodes to a NodePort");
    }
    assert_http(b.daemon.node(), &service, "node B itself to the ClusterIP");
    let from_a = format!("http://{}:{NODE_PORT}/", b.underlay.v4);
    assert_http(a.daemon.node(), &from_a, "node A to B's NodePort");
}
