//! Two real kubelet nodes, each in its own network, mount and PID
//! namespaces (tests/src/nodes.rs), with kube-proxy, and tether installed
//! by its chart in etcd cluster mode: the ground of the conformance suite.
//!
//! Checked here with the harness's own busybox images: every node's
//! `/proc/1` is its own init and its `/var/lib/kubelet` its own; both
//! nodes go Ready once tether is installed; pods on the two nodes ping
//! each other; a hostNetwork pod on each node reaches a pod on the other
//! and on its own node; the API server reaches a pod IP (pod proxy).

use serde_json::{json, Value};
use std::time::Duration;
use tether_e2e::kubelet::{BUSYBOX_IMAGE, PAUSE_IMAGE};
use tether_e2e::nodes::{ClusterOpts, KubeCluster};
use tether_e2e::oci::Rootfs;
use tether_e2e::{require_root, wait_until, TempDir};

fn busybox_images(dir: &TempDir) -> Vec<std::path::PathBuf> {
    [
        (PAUSE_IMAGE, vec!["/bin/sleep", "infinity"], "pause"),
        (BUSYBOX_IMAGE, vec!["/bin/sh"], "busybox"),
    ]
    .into_iter()
    .map(|(name, entry, path)| {
        let root = Rootfs::busybox(&dir.path().join(path));
        let archive = dir.path().join(format!("{path}.tar"));
        root.pack(name, &entry, &archive);
        archive
    })
    .collect()
}

fn pod(name: &str, node: &str, host_network: bool) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeName": node,
            "hostNetwork": host_network,
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 0,
            "containers": [{
                "name": "c", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", "sleep 100000"],
            }],
        },
    })
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

#[test]
fn two_kubelet_nodes_with_their_own_namespaces_wire_pods_through_the_installed_chart() {
    require_root();
    let images = TempDir::new("kimg");
    let mut c = KubeCluster::start(&ClusterOpts {
        nodes: 2,
        images: busybox_images(&images),
        sandbox_image: PAUSE_IMAGE.to_string(),
    });
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
    for (from, to) in [
        ("p0", &ips[1]),
        ("p1", &ips[0]),
        ("h0", &ips[1]),
        ("h1", &ips[0]),
        ("h0", &ips[0]),
    ] {
        let out = exec(&c, from, &["ping", "-c", "2", "-W", "2", to]);
        assert!(
            out.status.success(),
            "{from} → {to}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The API server reaches both pods' IPs: its route via node 0.
    for ip in &ips {
        let out = c.api.netns().exec(&["ping", "-c", "1", "-W", "2", ip]);
        assert!(
            out.status.success(),
            "API server → {ip}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    // A kubelet restart keeps its pods wired.
    c.restart_kubelet(1);
    assert!(wait_until(Duration::from_secs(60), || c.node_ready(&names[1])));
    let out = exec(&c, "p0", &["ping", "-c", "2", "-W", "2", &ips[1]]);
    assert!(
        out.status.success(),
        "p0 → p1 after node 1's kubelet restart"
    );
}
