//! Two real kubelet nodes, each in its own network, mount and PID
//! namespaces (tests/src/kube_cluster.rs), with kube-proxy, and tether installed
//! by its chart in its default mode (the Kubernetes store): the ground of
//! the conformance suite.
//!
//! Checked here with the harness's own busybox images: every node's
//! `/proc/1` is its own init and its `/var/lib/kubelet` its own; both
//! nodes go Ready once tether is installed; pods on the two nodes ping
//! each other; a hostNetwork pod on each node reaches a pod on the other
//! and on its own node; the API server reaches a pod IP (pod proxy).
//!
//! And VM pods across the two kubelets (busybox pods with virt-launcher's
//! labels and annotations; KubeVirt itself is another suite): a VM's pod
//! on node A, its migration target on node B with the same IP and MAC, the
//! cutover by the target's ready annotation (tetherd's pod watch), then
//! back to A cut over by a RARP from the target's interface (as QEMU
//! announces a migrated guest), then the VM restarted in a new pod on B:
//! the same IP and MAC throughout, and an observer pod on each node
//! reaching it after every step.

use std::time::Duration;

use serde_json::{json, Value};
use tether_e2e::kube_cluster::{KubeCluster, KubeNode};
use tether_e2e::kubelet::busybox_pod;
use tether_e2e::topology::Topology;
use tether_e2e::vm::VmPodSpec;
use tether_e2e::{admin, require_root, wait_until};

fn pod(name: &str, node: &str, host_network: bool) -> Value {
    let mut p = busybox_pod(name, node);
    p["spec"]["hostNetwork"] = json!(host_network);
    p
}

fn wait_running(c: &KubeCluster, name: &str) -> String {
    let mut ip = String::new();
    let ok = wait_until(Duration::from_secs(120), || {
        let p = c
            .api
            .get(&["-n", "default", "pod", name])
            .unwrap_or(Value::Null);
        ip = p["status"]["podIP"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        p["status"]["phase"] == "Running" && !ip.is_empty()
    });
    assert!(
        ok,
        "pod {name} not running: {}",
        String::from_utf8_lossy(
            &c.api
                .kubectl(&["-n", "default", "describe", "pod", name])
                .stdout
        )
    );
    ip
}

fn exec(c: &KubeCluster, name: &str, argv: &[&str]) -> std::process::Output {
    let mut args = vec!["-n", "default", "exec", name, "--"];
    args.extend_from_slice(argv);
    c.api.kubectl(&args)
}

#[cfg_attr(
    not(feature = "kubelet-tests"),
    ignore = "kubelet tier: root and kubelet nodes built from Kubernetes' source; `make test` runs it"
)]
#[test]
fn two_kubelet_nodes_with_their_own_namespaces_wire_pods_through_the_installed_chart() {
    require_root();
    let mut c = Topology::kubelet(2).start();
    let names: Vec<String> = c.nodes().iter().map(|n| n.name().to_string()).collect();
    for node in c.nodes() {
        // The node's own init, and its own /var/lib/kubelet.
        let out = node.run(&["cat", "/proc/1/comm"]);
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "node_init");
        let sock = node
            .host_path("/var/lib/kubelet")
            .join("device-plugins/kubelet.sock");
        assert!(
            wait_until(Duration::from_secs(30), || sock.exists()),
            "no device-plugin socket of {} in its own /var/lib/kubelet",
            node.name()
        );
    }
    let image = c.build_tether_image("1");
    c.install_tether(&image);

    for (i, node) in names.iter().enumerate() {
        c.api.apply(&pod(&format!("p{i}"), node, false).to_string());
        c.api.apply(&pod(&format!("h{i}"), node, true).to_string());
    }
    let ips: Vec<String> = (0..2).map(|i| wait_running(&c, &format!("p{i}"))).collect();
    for i in 0..2 {
        wait_running(&c, &format!("h{i}"));
    }
    let nodes = c.nodes();
    wait_route(&c, &nodes[0], &ips[1], &toward(&nodes[0], &nodes[1]));
    wait_route(&c, &nodes[1], &ips[0], &toward(&nodes[1], &nodes[0]));
    for (from, to) in [
        ("p0", &ips[1]),
        ("p1", &ips[0]),
        ("h0", &ips[1]),
        ("h1", &ips[0]),
        ("h0", &ips[0]),
    ] {
        ping_ok(&c, from, to);
    }
    // The API server reaches both pods' IPs: its route via node 0.
    for ip in &ips {
        let out = c.api.netns().exec(&ping(ip));
        assert!(
            out.status.success(),
            "API server → {ip}: {}{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            c.network_view()
        );
    }
    // A kubelet restart keeps its pods wired.
    c.restart_kubelet(1);
    assert!(
        wait_until(Duration::from_secs(60), || c.node_ready(&names[1])),
        "{} not Ready after its kubelet's restart",
        names[1]
    );
    ping_ok(&c, "p0", &ips[1]);
}

/// The two-node cluster with tether installed.
fn cluster() -> KubeCluster {
    let c = Topology::kubelet(2).start();
    let image = c.build_tether_image("1");
    c.install_tether(&image);
    c
}

/// A virt-launcher-like pod of `spec` on `node`, controlled by its
/// VirtualMachineInstance.
fn vm_pod(c: &KubeCluster, spec: &VmPodSpec, node: &str) -> Value {
    spec.launcher(&c.api, pod(&spec.pod_name, node, false))
}

/// tether's attachment of pod `default/name` on `node`.
fn attachment(node: &KubeNode, name: &str) -> tether_e2e::pb::Attachment {
    let socket = node.host_path("/run/tether").join("tether.sock");
    let mut list: Vec<_> = admin::attachments(&socket)
        .into_iter()
        .filter(|a| a.pod_namespace == "default" && a.pod_name == name)
        .collect();
    assert_eq!(list.len(), 1, "pod {name} on {}: {list:?}", node.name());
    list.remove(0)
}

/// `node`'s route to `ip`: its device, and its gateway if it has one
/// (`eth0 via 10.77.0.12`).
fn route_dev(node: &KubeNode, ip: &str) -> String {
    let out = node.netns().exec_ok(&["ip", "-j", "route", "get", ip]);
    let v: Value = serde_json::from_str(&out).expect("ip -j route get");
    let dev = v[0]["dev"].as_str().unwrap_or_default();
    match v[0]["gateway"].as_str() {
        Some(gw) => format!("{dev} via {gw}"),
        None => dev.to_string(),
    }
}

/// What [`route_dev`] gives on `from` for an address routed to node `to`
/// (every node also has a default route through the fabric's gateway, so
/// the device alone would not tell).
fn toward(from: &KubeNode, to: &KubeNode) -> String {
    format!("{} via {}", from.underlay().ifname, to.underlay().v4)
}

/// Three echo requests, up to 5 s for each reply: any reply passes (the
/// path is up; a loaded machine may lose one).
fn ping(to: &str) -> [&str; 6] {
    ["ping", "-c", "3", "-W", "5", to]
}

fn ping_ok(c: &KubeCluster, from: &str, to: &str) {
    let out = exec(c, from, &ping(to));
    assert!(
        out.status.success(),
        "{from} → {to}: {}{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        c.network_view()
    );
}

/// Waits until `node` routes `ip` by `dev`: a block claimed on one node
/// reaches the others through the store's watch, after the pod on it is
/// already running.
fn wait_route(c: &KubeCluster, node: &KubeNode, ip: &str, dev: &str) {
    assert!(
        wait_until(Duration::from_secs(30), || route_dev(node, ip) == dev),
        "{} routes {ip} via {}, not {dev}\n{}",
        node.name(),
        route_dev(node, ip),
        c.network_view()
    );
}

/// Sends the RARP QEMU announces a migrated guest with, from `mac`, out of
/// `eth0` of the pod whose netns (as its node sees it) is `netns`.
fn send_rarp(node: &KubeNode, netns: &str, mac: &str) {
    const SEND: &str = "import socket, sys
mac = bytes.fromhex(sys.argv[1].replace(':', ''))
frame = b'\\xff' * 6 + mac + b'\\x80\\x35' + bytes([0, 1, 8, 0, 6, 4, 0, 3]) + mac + bytes(4) + mac + bytes(4)
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(('eth0', 0))
s.send(frame + bytes(60 - len(frame)))
";
    let out = node.run(&[
        "nsenter",
        &format!("--net={netns}"),
        "python3",
        "-c",
        SEND,
        mac,
    ]);
    assert!(
        out.status.success(),
        "sending a RARP from {netns}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Deletes pod `default/name` and waits until it is gone.
fn delete_pod(c: &KubeCluster, name: &str) {
    c.api
        .kubectl_ok(&["-n", "default", "delete", "pod", name, "--wait=true"]);
}

/// Waits until node `a` routes `ip` by `a_dev` and node `b` by `b_dev`;
/// `what` names the cause in the failure.
fn wait_routes(a: &KubeNode, a_dev: &str, b: &KubeNode, b_dev: &str, ip: &str, what: &str) {
    let moved = wait_until(Duration::from_secs(30), || {
        route_dev(a, ip) == a_dev && route_dev(b, ip) == b_dev
    });
    assert!(
        moved,
        "{what} did not move {ip}: A via {} (want {a_dev}), B via {} (want {b_dev})",
        route_dev(a, ip),
        route_dev(b, ip)
    );
}

#[cfg_attr(
    not(feature = "kubelet-tests"),
    ignore = "kubelet tier: root and kubelet nodes built from Kubernetes' source; `make test` runs it"
)]
#[test]
fn a_vm_pod_migrates_between_two_kubelet_nodes_and_restarts_on_the_other_keeping_ip_and_mac() {
    require_root();
    let c = cluster();
    let (a, b) = (&c.nodes()[0], &c.nodes()[1]);
    let converge = Duration::from_secs(30);
    c.api.apply(&pod("obs-a", a.name(), false).to_string());
    c.api.apply(&pod("obs-b", b.name(), false).to_string());
    let obs_a = wait_running(&c, "obs-a");
    let obs_b = wait_running(&c, "obs-b");
    wait_route(&c, a, &obs_b, &toward(a, b));
    wait_route(&c, b, &obs_a, &toward(b, a));

    // The VM on A.
    let vm = VmPodSpec::new("default", "vm1", "virt-launcher-vm1-aaaaa");
    c.api.apply(&vm_pod(&c, &vm, a.name()).to_string());
    let vm_ip = wait_running(&c, &vm.pod_name);
    let src = attachment(a, &vm.pod_name);
    let vm_mac = src.mac.clone();
    assert_eq!(route_dev(a, &vm_ip), src.host_interface);
    assert_eq!(route_dev(b, &vm_ip), toward(b, a), "B routes the VM to A");
    ping_ok(&c, "obs-b", &vm_ip);

    // Its migration target on B: the same IP and MAC; nothing moves until
    // the target is ready.
    let t1 = vm.target("virt-launcher-vm1-bbbbb");
    c.api.apply(&vm_pod(&c, &t1, b.name()).to_string());
    assert_eq!(
        wait_running(&c, &t1.pod_name),
        vm_ip,
        "the target has the VM's IP"
    );
    let tgt = attachment(b, &t1.pod_name);
    assert_eq!(tgt.mac, vm_mac, "the target has the VM's MAC");
    assert_eq!(route_dev(b, &vm_ip), toward(b, a), "cut over before ready");
    assert_eq!(
        route_dev(a, &vm_ip),
        src.host_interface,
        "cut over before ready"
    );
    // Ready (virt-handler's annotation): B routes to its pod, A to B.
    c.api.kubectl_ok(&[
        "-n",
        "default",
        "annotate",
        "pod",
        &t1.pod_name,
        "kubevirt.io/migration-target-ready-timestamp=2026-11-26T12:00:00Z",
    ]);
    wait_routes(
        a,
        &toward(a, b),
        b,
        &tgt.host_interface,
        &vm_ip,
        "the ready annotation",
    );
    delete_pod(&c, &vm.pod_name);
    ping_ok(&c, "obs-a", &vm_ip);
    ping_ok(&c, "obs-b", &vm_ip);
    eprintln!(
        "step: {} {vm_ip} {vm_mac} moved A → B by the ready annotation",
        vm.vm
    );

    // Back to A, cut over by the RARP the target's QEMU would send.
    let t2 = vm.target("virt-launcher-vm1-ccccc");
    c.api.apply(&vm_pod(&c, &t2, a.name()).to_string());
    assert_eq!(wait_running(&c, &t2.pod_name), vm_ip);
    let back = attachment(a, &t2.pod_name);
    assert_eq!(back.mac, vm_mac);
    assert_eq!(
        route_dev(a, &vm_ip),
        toward(a, b),
        "cut over before the RARP"
    );
    send_rarp(a, &back.netns, &vm_mac);
    wait_routes(
        a,
        &back.host_interface,
        b,
        &toward(b, a),
        &vm_ip,
        "the RARP",
    );
    delete_pod(&c, &t1.pod_name);
    ping_ok(&c, "obs-b", &vm_ip);
    ping_ok(&c, "obs-a", &vm_ip);
    eprintln!("step: {vm_ip} moved B → A by a RARP");

    // The VM stops, and starts again in a new pod on B.
    delete_pod(&c, &t2.pod_name);
    let again = VmPodSpec::new("default", "vm1", "virt-launcher-vm1-ddddd");
    c.api.apply(&vm_pod(&c, &again, b.name()).to_string());
    assert_eq!(
        wait_running(&c, &again.pod_name),
        vm_ip,
        "the VM's IP is kept"
    );
    let restarted = attachment(b, &again.pod_name);
    assert_eq!(restarted.mac, vm_mac, "the VM's MAC is kept");
    assert!(
        wait_until(converge, || route_dev(a, &vm_ip) == toward(a, b)),
        "A does not route the restarted VM to B"
    );
    ping_ok(&c, "obs-a", &vm_ip);
    eprintln!("step: {vm_ip} {vm_mac} restarted on B");
}
