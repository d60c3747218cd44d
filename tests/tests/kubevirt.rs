//! KubeVirt itself on tether (issue 27): KubeVirt v1.7.0 built from source
//! (tests/k8s/kubevirt), its images assembled here from Debian packages
//! (tests/src/kubevirt.rs), deployed as a user deploys it (the operator
//! manifest, then a KubeVirt CR with `useEmulation` and tether's binding
//! plugins) on two kubelet nodes, each with its own network, mount and PID
//! namespaces (tests/src/nodes.rs), with tether installed by its chart in
//! etcd mode. Everything then goes through KubeVirt's API:
//!
//! - a VirtualMachine boots the test guest (kernel boot from a container
//!   disk) on tether's `tap` binding; the guest leases its address from
//!   tether by DHCP, and the VMI's status shows tether's IP;
//! - a VirtualMachineInstanceMigration moves it to the other node and
//!   back, an observer (the API server's host, a third place) pinging it
//!   every millisecond: its loss window per migration beside the
//!   migration's own timing, and the VMI's IP unchanged.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tether_e2e::kubelet::{BUSYBOX_IMAGE, PAUSE_IMAGE};
use tether_e2e::kubevirt::{self, guest_image, kubevirt_cr, kubevirt_images, vm_manifest};
use tether_e2e::migration::Prober;
use tether_e2e::nodes::{ClusterOpts, KubeCluster};
use tether_e2e::oci::Rootfs;
use tether_e2e::{require_root, wait_until, TempDir};

fn busybox_images(dir: &TempDir) -> Vec<PathBuf> {
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

/// The VMI `name` once it runs with an IP in its status: (node, IP).
fn wait_vmi_running(c: &KubeCluster, name: &str, limit: Duration) -> (String, String) {
    let mut last = Value::Null;
    let ok = wait_until(limit, || {
        last = c
            .api
            .get(&["-n", "default", "vmi", name])
            .unwrap_or(Value::Null);
        last["status"]["phase"] == "Running"
            && last["status"]["interfaces"][0]["ipAddress"].is_string()
    });
    assert!(
        ok,
        "VMI {name} not running with an IP in {limit:?}: {}\n{}",
        serde_json::to_string_pretty(&last["status"]).unwrap_or_default(),
        kubevirt::describe(c)
    );
    (
        last["status"]["nodeName"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        last["status"]["interfaces"][0]["ipAddress"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
    )
}

/// The launcher pod of VMI `name` on `node`, running.
fn launcher_pod(c: &KubeCluster, vmi: &str, node: &str) -> Option<String> {
    let pods = c
        .api
        .get(&["-n", "default", "pods", "-l", "kubevirt.io=virt-launcher"])
        .unwrap_or(Value::Null);
    pods["items"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| {
            p["metadata"]["annotations"]["kubevirt.io/domain"] == vmi
                && p["spec"]["nodeName"] == node
                && p["status"]["phase"] == "Running"
        })
        .and_then(|p| p["metadata"]["name"].as_str().map(str::to_string))
}

/// The guest's serial console so far (the launcher's `guest-console-log`
/// container).
fn console(c: &KubeCluster, pod: &str) -> String {
    let out = c
        .api
        .kubectl(&["-n", "default", "logs", pod, "-c", "guest-console-log"]);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Migrates VMI `vmi` to `node` with a VirtualMachineInstanceMigration
/// (`addedNodeSelector`), waits for `Succeeded`; the time from the
/// object's creation to that, and the migration's state from the VMI.
fn migrate(c: &KubeCluster, vmi: &str, node: &str, n: usize) -> (Duration, Value) {
    let name = format!("{vmi}-mig{n}");
    let start = Instant::now();
    c.api.apply(
        &json!({
            "apiVersion": "kubevirt.io/v1",
            "kind": "VirtualMachineInstanceMigration",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "vmiName": vmi,
                "addedNodeSelector": {"kubernetes.io/hostname": node},
            },
        })
        .to_string(),
    );
    let mut last = Value::Null;
    let done = wait_until(Duration::from_secs(300), || {
        last = c
            .api
            .get(&["-n", "default", "vmim", &name])
            .unwrap_or(Value::Null);
        last["status"]["phase"] == "Succeeded" || last["status"]["phase"] == "Failed"
    });
    let took = start.elapsed();
    let state = c
        .api
        .get(&["-n", "default", "vmi", vmi])
        .unwrap_or(Value::Null)["status"]["migrationState"]
        .clone();
    assert!(
        done && last["status"]["phase"] == "Succeeded",
        "migration {name} to {node}: {}\nVMI migrationState: {}\n{}",
        serde_json::to_string_pretty(&last["status"]).unwrap_or_default(),
        serde_json::to_string_pretty(&state).unwrap_or_default(),
        kubevirt::describe(c)
    );
    (took, state)
}

#[test]
#[ignore = "make kubevirt: builds KubeVirt from source the first time (tens of minutes)"]
fn kubevirt_boots_a_vm_on_tethers_tap_binding_and_live_migrates_it_between_two_kubelets() {
    require_root();
    let images = TempDir::new("kvimg");
    let t0 = Instant::now();
    let mut archives = busybox_images(&images);
    let kv = kubevirt_images();
    archives.extend(kv.iter().map(|(_, a)| a.clone()));
    let (guest, guest_archive) = guest_image(images.path());
    archives.push(guest_archive);
    eprintln!("kubevirt: images ready in {:?}", t0.elapsed());

    let t = Instant::now();
    let c = KubeCluster::start(&ClusterOpts {
        nodes: 2,
        images: archives,
        sandbox_image: PAUSE_IMAGE.to_string(),
        aggregating: true,
        node_paths: kubevirt::NODE_PATHS
            .iter()
            .map(|(s, t)| (s.to_string(), t.to_string()))
            .collect(),
    });
    for node in c.nodes() {
        kubevirt::open_tun(node);
    }
    let tether = c.build_tether_image("1");
    c.install_tether(&tether);
    let names: Vec<String> = c.nodes().iter().map(|n| n.name().to_string()).collect();
    eprintln!("kubevirt: cluster with tether in {:?}", t.elapsed());

    let cr = kubevirt_cr(json!({
        "tether": {"domainAttachmentType": "tap", "migration": {}},
        "tether-managed": {"domainAttachmentType": "managedTap", "migration": {}},
    }));
    let took = kubevirt::deploy(&c, &cr, Duration::from_secs(600));
    eprintln!("kubevirt: KubeVirt Available in {took:?}");

    // The VM boots on the tap binding and leases tether's address.
    let t = Instant::now();
    c.api
        .apply(&vm_manifest("vm1", &guest, "tether", "tap").to_string());
    let (node, ip) = wait_vmi_running(&c, "vm1", Duration::from_secs(300));
    eprintln!(
        "kubevirt: vm1 running on {node} with {ip} in {:?}",
        t.elapsed()
    );
    let pod = launcher_pod(&c, "vm1", &node).expect("vm1's launcher pod");
    let mut text = String::new();
    let leased = wait_until(Duration::from_secs(120), || {
        text = console(&c, &pod);
        text.contains(&format!("TETHER-LEASE4 event=bound ip={ip} "))
    });
    assert!(
        leased,
        "vm1's guest did not lease {ip} from tether:\n{text}"
    );

    // Migrations there and back, an observer pinging the guest.
    let target: std::net::IpAddr = ip.parse().expect("the VMI's IP");
    let other = names
        .iter()
        .find(|n| **n != node)
        .expect("two nodes")
        .clone();
    for (n, to) in [other, node.clone()].into_iter().enumerate() {
        let prober = Prober::start(c.api.netns(), target, Duration::from_millis(1));
        let warm = wait_until(Duration::from_secs(30), || {
            prober.received_since(Instant::now() - Duration::from_millis(500)) > 100
        });
        assert!(
            warm,
            "the observer does not reach vm1 at {ip} before migration {n}"
        );
        let (took, state) = migrate(&c, "vm1", &to, n);
        let after = Instant::now();
        let back = wait_until(Duration::from_secs(30), || {
            prober.received_since(after) > 100
        });
        let report = prober.stop();
        let windows = report.loss_windows();
        let worst = windows.iter().map(|w| w.duration).max();
        eprintln!(
            "kubevirt: migration {n} to {to}: Succeeded {took:?} after its creation; observer: {} sent, {} answered, longest loss window {worst:?} ({} windows); migrationState: start {} end {} mode {}",
            report.sent,
            report.received,
            windows.len(),
            state["startTimestamp"],
            state["endTimestamp"],
            state["mode"],
        );
        assert!(
            back,
            "the observer does not reach vm1 at {ip} after migration {n}"
        );
        let (now_on, ip_after) = wait_vmi_running(&c, "vm1", Duration::from_secs(60));
        assert_eq!(now_on, to, "vm1 is not on the migration's target");
        assert_eq!(ip_after, ip, "vm1's IP changed with migration {n}");
    }
}
