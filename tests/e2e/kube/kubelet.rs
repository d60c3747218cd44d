//! The kubelet calls tether: a one-node Kubernetes on this machine
//! (`Topology::kubelet(1)`: kube-apiserver, kube-controller-manager,
//! kube-scheduler, and a node with kubelet and kube-proxy v1.37.2,
//! Debian's containerd 1.6 and runc, its own mount and PID namespaces),
//! where the Helm chart (install/helm/tether, `helm install` against the
//! API server) installs tether through its DaemonSet and the kubelet wires
//! pods through containerd's CRI plugin and the plugin binary the init
//! container put in the node's CNI bin dir.
//!
//! tether is installed in its `nodeCidrs` mode (the node CIDR that
//! kube-controller-manager gives the node) with a netconf that is not the
//! chart's default ([`netconf`]: an MTU, DNS, the `managedTap` binding and
//! a shorter lease), so that what a chart user sets is seen to reach the
//! node.
//!
//! One test, in steps on one cluster (it takes about 40 s to start):
//! 1. the node is NotReady until the init container has written tether's
//!    conflist (the kubelet's NetworkReady; containerd 1.6 does not call
//!    CNI STATUS), then Ready; the conflist holds the chart's `netconf`;
//! 2. pods get addresses of the node's CIDR from tether, `eth0` inside
//!    (seen by `kubectl exec`) is what tether says it built, they ping each
//!    other, and deleting a pod releases its address;
//! 3. restarting the kubelet, then containerd, loses nothing;
//! 4. `kubectl delete` of the DaemonSet's pod while pods run loses nothing,
//!    and a DEL made while no tetherd runs is queued and replayed; the
//!    DaemonSet stays, so its pods' uninstall containers leave the files;
//! 5. VM pods (KubeVirt's virt-launcher labels and annotations, passed by
//!    containerd as `io.kubernetes.cri.pod-annotations`) get the VM's
//!    address and MAC, keep them across pods, and a simulated migration on
//!    this node (a target pod, then the ready annotation through the API)
//!    moves the VM's route; a DHCP client in the VM pod, standing in for
//!    the `managedTap` guest, is answered with the netconf's DNS servers,
//!    search list, MTU and lease;
//! 6. `helm upgrade` to a new image keeps pods reachable, loses no DEL,
//!    and never removes the conflist or the plugin (inotify says so);
//! 7. `helm uninstall` takes the conflist, then the plugin, and the nft
//!    tables (outbound NAT's, the migration handover's) off the node; the node goes NotReady, and a new pod waits
//!    with NetworkNotReady ("cni plugin not initialized") instead of
//!    failing in tether.
//!
//! KubeVirt itself does not run here (`make kubevirt` runs it): the VM
//! pods are busybox pods that carry what virt-launcher pods carry, and
//! the DHCP client of step 5 is busybox's `udhcpc` on the VM pod's `eth0`
//! (where KubeVirt's `managedTap` bridge would take the guest's frames),
//! not a guest in QEMU: it proves the chart's netconf reaches tetherd's
//! answers on the node, not what a guest's own client makes of them
//! (tests/e2e/vm/vm_guest.rs runs real guests, without the chart).

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;
use serde_json::{json, Value};
use tether_e2e::kube_cluster::{KubeCluster, KubeNode};
use tether_e2e::kubelet::{busybox_pod, Removals};
use tether_e2e::topology::Topology;
use tether_e2e::vm::VmPodSpec;
use tether_e2e::{admin, require_root, wait_until};

const CONVERGE: Duration = Duration::from_secs(30);

/// The chart's `netconf` values of this suite: none is the default.
fn netconf() -> Value {
    json!({
        "mtu": 1400,
        "dns": {"nameservers": ["10.96.0.10"],
                "search": ["default.svc.cluster.local", "svc.cluster.local"]},
        "kubevirt": {"binding": "managedTap", "leaseSeconds": 600},
    })
}

/// Runs busybox's `udhcpc` once on pod `name`'s `eth0` (in the
/// foreground, until it has a lease) with a script that prints what the
/// server gave, and returns those lines: `key=value`.
fn dhcp_lease(k: &KubeCluster, name: &str) -> Vec<String> {
    let script = "#!/bin/sh\n[ \"$1\" = bound ] || exit 0\nfor v in ip mask router dns domain search mtu lease hostname; do eval echo \"lease: $v=\\$$v\"; done\n";
    k.exec_ok(
        name,
        &[
            "sh",
            "-c",
            r#"printf '%s' "$1" > /run/lease.sh && chmod 0755 /run/lease.sh"#,
            "sh",
            script,
        ],
    );
    let out = k.exec_ok(
        name,
        &[
            "busybox",
            "udhcpc",
            "-i",
            "eth0",
            "-f",
            "-q",
            "-n",
            "-t",
            "5",
            "-T",
            "2",
            "-s",
            "/run/lease.sh",
        ],
    );
    out.lines()
        .filter_map(|l| l.strip_prefix("lease: "))
        .map(str::to_owned)
        .collect()
}

/// The cluster's one node.
fn node(k: &KubeCluster) -> &KubeNode {
    &k.nodes()[0]
}

/// A busybox pod `default/name` on the node.
fn pod(k: &KubeCluster, name: &str, labels: Value, annotations: Value) -> Value {
    let mut p = busybox_pod(name, node(k).name());
    p["metadata"]["labels"] = labels;
    p["metadata"]["annotations"] = annotations;
    p
}

/// The node's CNI config dir (`/etc/cni/net.d`), as this machine sees it.
fn conf_dir(k: &KubeCluster) -> std::path::PathBuf {
    node(k).host_path("/etc/cni/net.d")
}

/// The node's CNI bin dir (`/opt/cni/bin`), as this machine sees it.
fn bin_dir(k: &KubeCluster) -> std::path::PathBuf {
    node(k).host_path("/opt/cni/bin")
}

/// The tether attachments of pod `default/name`.
fn attachments_of(k: &KubeCluster, name: &str) -> Vec<tether_e2e::pb::Attachment> {
    admin::attachments(&node(k).tether_socket())
        .into_iter()
        .filter(|a| a.pod_namespace == "default" && a.pod_name == name)
        .collect()
}

/// The one attachment of a running pod, checked against the API's pod IP.
fn attachment(k: &KubeCluster, name: &str, pod_ip: &str) -> tether_e2e::pb::Attachment {
    let mut list = attachments_of(k, name);
    assert_eq!(list.len(), 1, "pod {name}: {list:?}");
    let a = list.remove(0);
    assert!(
        a.ips.iter().any(|ip| ip.split('/').next() == Some(pod_ip)),
        "the API says {name} has {pod_ip}, tether says {:?}",
        a.ips
    );
    a
}

/// Every attachment's (pod, container id, ips): what must survive restarts.
fn attachment_set(k: &KubeCluster) -> BTreeSet<(String, String, Vec<String>)> {
    admin::attachments(&node(k).tether_socket())
        .into_iter()
        .map(|a| (a.pod_name, a.container_id, a.ips))
        .collect()
}

fn ping(k: &KubeCluster, from: &str, to: &str) {
    k.exec_ok(from, &["ping", "-c", "1", "-W", "3", to]);
}

/// `eth0` of pod `name` as the pod sees it: its addresses and its MAC.
fn eth0(k: &KubeCluster, name: &str) -> (String, String) {
    let addrs = k.exec_ok(name, &["ip", "-o", "addr", "show", "dev", "eth0"]);
    // Through netlink, not /sys: sysfs shows the netns of whoever mounted it.
    let link = k.exec_ok(name, &["ip", "-o", "link", "show", "dev", "eth0"]);
    let mac = link
        .split_whitespace()
        .skip_while(|w| *w != "link/ether")
        .nth(1)
        .unwrap_or_else(|| panic!("no MAC in {name}'s eth0: {link}"))
        .to_string();
    (addrs, mac)
}

/// The node's route to `ip`: its device.
fn route_dev(k: &KubeCluster, ip: &str) -> String {
    let out = node(k).netns().exec_ok(&["ip", "-j", "route", "get", ip]);
    let v: Value = serde_json::from_str(&out).expect("ip -j route get");
    v[0]["dev"].as_str().unwrap_or_default().to_string()
}

/// A counter of tetherd's metrics endpoint (the DaemonSet's
/// `--metrics-address=$(HOST_IP):9654`, on the node).
fn metric(k: &KubeCluster, name: &str) -> f64 {
    let url = format!("http://{}:9654/metrics", node(k).underlay().v4);
    let out = node(k)
        .netns()
        .exec_ok(&["curl", "-sf", "--max-time", "5", &url]);
    out.lines()
        .find_map(|l| {
            l.strip_prefix(name)
                .filter(|rest| rest.starts_with(' ') || rest.starts_with('{'))
                .and_then(|rest| rest.rsplit(' ').next())
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0.0)
}

/// What tether installs on the node and its removal takes away: the
/// conflist and the plugin.
fn tether_files(k: &KubeCluster) -> [std::path::PathBuf; 2] {
    [
        conf_dir(k).join("10-tether.conflist"),
        bin_dir(k).join("tether"),
    ]
}

/// The names in `dir`, sorted.
fn names_in(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| {
            e.expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    names.sort();
    names
}

fn pod_cidr(k: &KubeCluster) -> IpNet {
    let node = k.api.get(&["node", node(k).name()]).expect("the node");
    node["spec"]["podCIDR"]
        .as_str()
        .unwrap_or_else(|| panic!("no podCIDR: {}", node["spec"]))
        .parse()
        .expect("a CIDR")
}

fn assert_in(cidr: &IpNet, ip: &str) {
    let addr: IpAddr = ip.parse().expect("an IP");
    assert!(cidr.contains(&addr), "{ip} is not in the node's {cidr}");
}

#[cfg_attr(
    not(feature = "kubelet-tests"),
    ignore = "kubelet tier: root and kubelet nodes built from Kubernetes' source; `make test` runs it"
)]
#[test]
fn the_kubelet_wires_pods_and_vm_pods_through_tether() {
    require_root();
    let mut k = Topology::kubelet(1).node_cidrs().start();
    k.set_chart_values(json!({"mode": "nodeCidrs", "netconf": netconf()}));
    let name = node(&k).name().to_string();

    // 1. NotReady without a CNI config; Ready once the init container has
    //    written tether's.
    let reported = wait_until(CONVERGE, || !k.ready_condition(&name).0.is_empty());
    assert!(reported, "the kubelet reports no Ready condition");
    let (status, message) = k.ready_condition(&name);
    assert_ne!(status, "True", "Ready before any CNI config: {message}");
    assert!(
        message.contains("cni") || message.contains("network"),
        "NotReady for another reason than the network: {message}"
    );
    let v1 = k.build_tether_image("1");
    let v2 = k.build_tether_image("2");
    k.install_tether(&v1);
    let first_ds_pod = k.wait_tether_ready(&v1).remove(0);
    k.wait_node_ready(&name);
    let conf = names_in(&conf_dir(&k));
    assert_eq!(
        conf,
        ["10-tether.conflist"],
        "exactly the conflist, no temp file"
    );
    let conflist: Value = serde_json::from_slice(
        &std::fs::read(conf_dir(&k).join("10-tether.conflist")).expect("the conflist"),
    )
    .expect("JSON");
    assert_eq!(
        conflist["plugins"][0]["socket"], "/run/tether/tether.sock",
        "the installer wrote the daemon's socket into the conflist"
    );
    let want = netconf();
    for field in ["mtu", "dns", "kubevirt"] {
        assert_eq!(
            conflist["plugins"][0][field], want[field],
            "the chart's netconf.{field} in the node's conflist: {conflist}"
        );
    }
    let bins = names_in(&bin_dir(&k));
    assert_eq!(bins, ["loopback", "portmap", "tether"], "no temp files");
    let cidr = pod_cidr(&k);
    eprintln!("step 1: node Ready with tether's conflist; its pod CIDR {cidr}");

    // 2. Pods through the kubelet.
    for name in ["a", "b", "c"] {
        k.create_pod(&pod(&k, name, json!({"app": "web"}), json!({})));
    }
    let ip_a = k.wait_pod_ip("a");
    let ip_b = k.wait_pod_ip("b");
    let ip_c = k.wait_pod_ip("c");
    tether_e2e::assert_distinct("pod IPs", [&ip_a, &ip_b, &ip_c]);
    for (name, ip) in [("a", &ip_a), ("b", &ip_b), ("c", &ip_c)] {
        assert_in(&cidr, ip);
        let att = attachment(&k, name, ip);
        let (addrs, mac) = eth0(&k, name);
        assert!(addrs.contains(&format!("{ip}/")), "{name}'s eth0: {addrs}");
        assert_eq!(mac, att.mac, "{name}'s eth0 MAC is the one tether gave");
        let link = k.exec_ok(name, &["ip", "-o", "link", "show", "dev", "eth0"]);
        assert!(
            link.contains(" mtu 1400 "),
            "{name}'s eth0 has not the netconf's MTU: {link}"
        );
        assert_eq!(att.ifname, "eth0");
    }
    let netns_a = attachment(&k, "a", &ip_a).netns;
    ping(&k, "a", &ip_b);
    ping(&k, "b", &ip_c);
    ping(&k, "c", &ip_a);
    k.delete_pod("c");
    assert!(
        attachments_of(&k, "c").is_empty(),
        "c's attachment released"
    );
    let used: u64 = admin::pools_used(&node(&k).tether_socket()).values().sum();
    assert_eq!(used, 2, "a and b hold the only addresses");
    eprintln!("step 2: pods a {ip_a}, b {ip_b}, c {ip_c} (deleted, released)");

    // 3. Restarting the kubelet, then containerd, loses nothing.
    let before = attachment_set(&k);
    k.restart_kubelet(0);
    k.wait_node_ready(&name);
    assert_eq!(k.wait_pod_ip("a"), ip_a);
    assert_eq!(k.wait_pod_ip("b"), ip_b);
    k.wait_exec("a");
    ping(&k, "a", &ip_b);
    assert_eq!(
        attachment_set(&k),
        before,
        "the kubelet's restart changed tether's state"
    );
    k.node_mut(0).stop_containerd();
    ping_from_netns(node(&k), &netns_a, &ip_b);
    k.node_mut(0).start_containerd();
    k.wait_node_ready(&name);
    k.wait_exec("b");
    ping(&k, "b", &ip_a);
    assert_eq!(
        attachment_set(&k),
        before,
        "containerd's restart changed tether's state"
    );
    for name in ["a", "b"] {
        let pod = k.pod(name).expect("the pod");
        assert_eq!(
            pod["status"]["containerStatuses"][0]["restartCount"], 0,
            "{name} restarted"
        );
    }
    eprintln!("step 3: the kubelet and containerd restarted; nothing changed");

    // 4. Deleting the DaemonSet's pod while pods run, and a DEL with no
    //    tetherd running.
    k.create_pod(&pod(&k, "d", json!({}), json!({})));
    let ip_d = k.wait_pod_ip("d");
    let before = attachment_set(&k);
    let kept = Removals::watch(&tether_files(&k));
    k.api.kubectl_ok(&[
        "-n",
        "kube-system",
        "delete",
        "pod",
        &first_ds_pod,
        "--wait=false",
    ]);
    let second = wait_until(CONVERGE, || {
        k.tether_pods()
            .iter()
            .any(|(n, phase, ready)| *n != first_ds_pod && phase == "Running" && *ready)
    });
    assert!(second, "no new tether pod: {:?}", k.tether_pods());
    let ds_pod = k.wait_tether_ready(&v1).remove(0);
    assert_ne!(ds_pod, first_ds_pod);
    assert_eq!(
        attachment_set(&k),
        before,
        "the DaemonSet pod's restart changed tether's state"
    );
    ping(&k, "d", &ip_a);
    ping(&k, "a", &ip_d);
    // No tetherd at all: the DaemonSet selects no node for a while.
    patch_daemonset(
        &k,
        "--type=merge",
        r#"{"spec":{"template":{"spec":{"nodeSelector":{"tether.dev/test-no-node":"true"}}}}}"#,
    );
    let none = wait_until(CONVERGE, || k.tether_pods().is_empty());
    assert!(none, "the tether pod did not go: {:?}", k.tether_pods());
    k.delete_pod("d");
    let queued = std::fs::read_dir(node(&k).host_path("/var/lib/tether").join("pending-del"))
        .map(|d| d.count())
        .unwrap_or(0);
    assert!(
        queued >= 1,
        "d's DEL, made while no tetherd ran, is not queued"
    );
    ping_from_netns(node(&k), &netns_a, &ip_b);
    patch_daemonset(
        &k,
        "--type=json",
        r#"[{"op":"remove","path":"/spec/template/spec/nodeSelector"}]"#,
    );
    k.wait_tether_ready(&v1);
    let replayed = wait_until(CONVERGE, || attachments_of(&k, "d").is_empty());
    assert!(
        replayed,
        "d's queued DEL was not replayed: {:?}",
        attachments_of(&k, "d")
    );
    assert!(metric(&k, "tether_pending_del_replayed_total") >= 1.0);
    ping(&k, "a", &ip_b);
    // The DaemonSet stayed: each pod's uninstall container left the files.
    assert_eq!(
        kept.take(),
        Vec::<std::path::PathBuf>::new(),
        "a pod of a DaemonSet still there removed files"
    );
    eprintln!("step 4: the DaemonSet's pod deleted and gone; d's DEL queued and replayed");

    // 5. VM pods.
    let vm = VmPodSpec::new("default", "vm1", "virt-launcher-vm1-aaaaa");
    // Each a launcher its VirtualMachineInstance controls, as tether checks.
    let launcher =
        |spec: &VmPodSpec| spec.launcher(&k.api, busybox_pod(&spec.pod_name, node(&k).name()));
    k.create_pod(&launcher(&vm));
    let vm_ip = k.wait_pod_ip(&vm.pod_name);
    assert_in(&cidr, &vm_ip);
    let src = attachment(&k, &vm.pod_name, &vm_ip);
    let (_, vm_mac) = eth0(&k, &vm.pod_name);
    assert_eq!(vm_mac, src.mac);
    assert_eq!(route_dev(&k, &vm_ip), src.host_interface);
    ping(&k, "a", &vm_ip);
    // The guest's DHCP (managedTap, from the chart's netconf), asked from
    // the VM pod's eth0, which has the VM's MAC.
    let lease = dhcp_lease(&k, &vm.pod_name);
    for want in [
        format!("ip={vm_ip}"),
        "mask=32".into(),
        "router=169.254.1.1".into(),
        "dns=10.96.0.10".into(),
        "domain=default.svc.cluster.local".into(),
        "search=default.svc.cluster.local svc.cluster.local".into(),
        "mtu=1400".into(),
        "lease=600".into(),
        "hostname=vm1".into(),
    ] {
        assert!(
            lease.contains(&want),
            "the VM's DHCP lease lacks {want}: {lease:?}"
        );
    }
    ping(&k, "a", &vm_ip);
    // The migration's target, on this node: same address and MAC; the
    // route stays with the source until the target is ready.
    let target = vm.target("virt-launcher-vm1-bbbbb");
    k.create_pod(&launcher(&target));
    assert_eq!(
        k.wait_pod_ip(&target.pod_name),
        vm_ip,
        "the target has the VM's address"
    );
    let tgt = attachment(&k, &target.pod_name, &vm_ip);
    assert_eq!(
        eth0(&k, &target.pod_name).1,
        vm_mac,
        "the target has the VM's MAC"
    );
    assert_eq!(
        route_dev(&k, &vm_ip),
        src.host_interface,
        "cut over before ready"
    );
    k.api.kubectl_ok(&[
        "-n",
        "default",
        "annotate",
        "pod",
        &target.pod_name,
        "kubevirt.io/migration-target-ready-timestamp=2026-11-25T12:00:00Z",
    ]);
    let moved = wait_until(CONVERGE, || route_dev(&k, &vm_ip) == tgt.host_interface);
    assert!(
        moved,
        "the ready annotation did not move the VM's route to the target ({}): via {}",
        tgt.host_interface,
        route_dev(&k, &vm_ip)
    );
    k.delete_pod(&vm.pod_name);
    assert_eq!(
        route_dev(&k, &vm_ip),
        tgt.host_interface,
        "the source's DEL took the route"
    );
    ping(&k, "a", &vm_ip);
    // The VM stops and starts again in a new pod: same address and MAC.
    k.delete_pod(&target.pod_name);
    let again = VmPodSpec::new("default", "vm1", "virt-launcher-vm1-ccccc");
    k.create_pod(&launcher(&again));
    assert_eq!(
        k.wait_pod_ip(&again.pod_name),
        vm_ip,
        "the VM's address is kept"
    );
    assert_eq!(eth0(&k, &again.pod_name).1, vm_mac, "the VM's MAC is kept");
    eprintln!("step 5: VM vm1 at {vm_ip} {vm_mac}: DHCP {lease:?}; migrated on the node, restarted, kept both");

    // 6. Rolling the DaemonSet to a new image, with pings across it and a
    //    DEL during it.
    k.create_pod(&pod(&k, "e", json!({}), json!({})));
    k.wait_pod_ip("e");
    let before: BTreeSet<_> = attachment_set(&k)
        .into_iter()
        .filter(|(pod, _, _)| pod != "e")
        .collect();
    // 120 pings, 4 a second, from a to b while the DaemonSet rolls.
    let mut pings = std::process::Command::new("ip");
    pings
        .args(["netns", "exec", k.api.netns().name()])
        .arg(tether_e2e::kube::k8s_bin_dir().join("kubectl"))
        .arg(format!(
            "--kubeconfig={}",
            k.api.admin_kubeconfig().display()
        ))
        .args(["-n", "default", "exec", "a", "--"])
        .args(["ping", "-c", "120", "-i", "0.25", "-W", "1", &ip_b]);
    let pinger = std::thread::spawn(move || pings.output());
    let removals = Removals::watch(&tether_files(&k));
    k.upgrade_tether(&v2, &[]);
    k.api
        .kubectl_ok(&["-n", "default", "delete", "pod", "e", "--wait=false"]);
    k.wait_tether_ready(&v2);
    k.api.kubectl_ok(&[
        "-n",
        "kube-system",
        "rollout",
        "status",
        "daemonset/tether",
        "--timeout=60s",
    ]);
    let released = wait_until(CONVERGE, || {
        k.pod("e").is_none() && attachments_of(&k, "e").is_empty()
    });
    assert!(
        released,
        "e's DEL during the upgrade was lost: {:?}",
        attachments_of(&k, "e")
    );
    let pinged = pinger
        .join()
        .expect("the pinger")
        .expect("running kubectl exec ping");
    let summary = String::from_utf8_lossy(&pinged.stdout).into_owned();
    // "120 packets transmitted, 120 [packets] received, ..." (busybox's
    // or iputils' words).
    let counts: Vec<u64> = summary
        .lines()
        .find(|l| l.contains("packets transmitted"))
        .map(|l| {
            l.split(", ")
                .take(2)
                .filter_map(|part| part.split_whitespace().next()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(
        counts,
        [120, 120],
        "pings from a to b were lost while the DaemonSet rolled: {summary}"
    );
    let after: BTreeSet<_> = attachment_set(&k);
    assert_eq!(
        after, before,
        "the upgrade changed the running pods' attachments"
    );
    ping(&k, "a", &ip_b);
    ping(&k, "b", &vm_ip);
    // The old pod's uninstall container found the DaemonSet there: the
    // node kept its conflist and plugin across the restart.
    assert_eq!(
        removals.take(),
        Vec::<std::path::PathBuf>::new(),
        "the upgrade removed the conflist or the plugin"
    );
    assert_eq!(names_in(&conf_dir(&k)), ["10-tether.conflist"]);
    assert_eq!(names_in(&bin_dir(&k)), ["loopback", "portmap", "tether"]);
    eprintln!("step 6: helm upgrade to {v2}; pods kept, e's DEL not lost, files kept");

    // 7. Uninstall: the pods go first (as docs/user/upgrade.md says), then
    //    `helm uninstall`; the DaemonSet's removal takes the conflist, the
    //    plugin and the nft tables off the node, which goes NotReady, and a
    //    new pod waits for a network instead of failing in tether.
    for name in ["a", "b", &again.pod_name] {
        k.delete_pod(name);
    }
    assert!(
        attachment_set(&k).is_empty(),
        "attachments left: {:?}",
        attachment_set(&k)
    );
    // tetherd's two tables: outbound NAT, and a migrating VM's
    // connections (written in every mode with peers, nodeCidrs here).
    const TABLES: [&str; 2] = ["tether", "tether_vm"];
    for table in TABLES {
        assert!(
            node(&k)
                .netns()
                .exec(&["nft", "list", "table", "inet", table])
                .status
                .success(),
            "no table inet {table} before the uninstall"
        );
    }
    k.uninstall_tether();
    let gone = wait_until(CONVERGE, || k.tether_pods().is_empty());
    assert!(gone, "tether's pods did not go: {:?}", k.tether_pods());
    assert_eq!(
        removals.take(),
        tether_files(&k),
        "the conflist, then the plugin, removed"
    );
    assert!(names_in(&conf_dir(&k)).is_empty());
    assert_eq!(
        names_in(&bin_dir(&k)),
        ["loopback", "portmap"],
        "portmap, which other networks may use, stays"
    );
    for table in TABLES {
        let left = node(&k)
            .netns()
            .exec(&["nft", "list", "table", "inet", table]);
        assert!(
            !left.status.success(),
            "the table inet {table} is still there:\n{}",
            String::from_utf8_lossy(&left.stdout)
        );
    }
    let not_ready = wait_until(CONVERGE, || k.ready_condition(&name).0 == "False");
    let (status, message) = k.ready_condition(&name);
    assert!(not_ready, "the node stayed {status}: {message}");
    assert!(
        message.contains("cni") && !message.contains("tether"),
        "NotReady for another reason than a missing CNI config: {message}"
    );
    k.create_pod(&pod(&k, "f", json!({}), json!({})));
    let mut why = String::new();
    let waits = wait_until(CONVERGE, || {
        why = k.api.kubectl_ok(&[
            "-n",
            "default",
            "get",
            "events",
            "--field-selector",
            "involvedObject.name=f",
            "-o",
            "jsonpath={range .items[*]}{.reason}: {.message}{\"\\n\"}{end}",
        ]);
        why.contains("NetworkNotReady")
    });
    assert!(
        waits,
        "pod f has no NetworkNotReady event: {why}\n{}",
        k.kubelet_logs()
    );
    assert!(
        why.contains("cni plugin not initialized") && !why.contains("tether"),
        "pod f failed for another reason than a missing CNI config: {why}"
    );
    let f = k.pod("f").expect("pod f");
    assert_eq!(f["status"]["phase"], "Pending", "{}", f["status"]);
    assert!(f["status"]["podIP"].is_null(), "{}", f["status"]);
    eprintln!("step 7: helm uninstall; conflist, plugin and nft tables gone; node NotReady: {message}; f: {}", why.trim());
}

/// Patches tether's DaemonSet with `patch`, of the kind `kind`
/// (`--type=merge`, `--type=json`).
fn patch_daemonset(k: &KubeCluster, kind: &str, patch: &str) {
    k.api.kubectl_ok(&[
        "-n",
        "kube-system",
        "patch",
        "daemonset",
        "tether",
        kind,
        "-p",
        patch,
    ]);
}

/// Pings `to` from the pod netns `netns` (a pin of containerd's, as
/// tether's attachment names it on the node), without the kubelet,
/// containerd or tetherd: for when one of them is down.
fn ping_from_netns(node: &KubeNode, netns: &str, to: &str) {
    let net = format!("--net={netns}");
    let out = node.run(&["nsenter", &net, "ping", "-c", "1", "-W", "3", to]);
    assert!(
        out.status.success(),
        "ping {to} from {netns}: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}
