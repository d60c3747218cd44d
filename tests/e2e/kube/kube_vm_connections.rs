//! A VM's connections through its live migration between two real
//! kubelet nodes (tests/src/kube_cluster.rs: each node its own network, mount and
//! PID namespaces, containerd, kubelet and kube-proxy), with tether
//! installed by its chart in its default mode (the Kubernetes store,
//! outbound NAT on).
//!
//! The VM's pods are virt-launcher-like pods that the kubelets run
//! (busybox, with virt-launcher's labels and annotations, and
//! `tether.dev/binding: tap`, so that tether makes them a tap); a real
//! QEMU guest runs on the tap of the pod on node A, and a second QEMU
//! waits on the tap of the migration's target pod on node B (the same VM,
//! `kubevirt.io/migrationJobName` set). Every path of tests/src/paths.rs
//! that two nodes have (pods on both nodes to the VM, an outside client
//! to a NodePort entering at each node, a pod to a ClusterIP whose
//! endpoint is the VM, the VM to a host outside through outbound NAT, to
//! a pod and to a ClusterIP whose backend is a pod on node B) holds a TCP and a UDP stream
//! through a QMP live migration A → B and the source pod's deletion
//! (its CNI DEL) after it; every stream must survive with the far end
//! seeing one address throughout.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tether_e2e::kube_cluster::{KubeCluster, KubePaths, KubePod};
use tether_e2e::kubelet::busybox_pod;
use tether_e2e::kubevirt::scenario::tether_record;
use tether_e2e::paths::{handover_state, table, PathSet};
use tether_e2e::qemu::{
    clear_events, once_more_if_a_guest_kernel_panicked, pause, Client, Guest, GuestOptions,
    BOOT_TIMEOUT,
};
use tether_e2e::streams::StreamReport;
use tether_e2e::topology::Topology;
use tether_e2e::vm::VmPodSpec;
use tether_e2e::{require_root, wait_until};

/// One message per stream every 20 ms, as vm_connections sends them.
const STREAM_INTERVAL: Duration = Duration::from_millis(20);
/// A TCG migration of a 128 MiB guest takes about a second here.
const MIGRATION_LIMIT: Duration = Duration::from_secs(120);
/// How long the streams go on after each step before the next.
const AFTER: Duration = Duration::from_secs(3);

/// A virt-launcher-like pod of `spec` on `node`, controlled by its
/// VirtualMachineInstance, on tether's `tap` binding (the pod annotation
/// `tether.dev/binding`).
fn vm_pod(c: &KubeCluster, spec: &VmPodSpec, node: &str) -> Value {
    let mut p = spec.launcher(&c.api, busybox_pod(&spec.pod_name, node));
    p["metadata"]["annotations"]["tether.dev/binding"] = json!("tap");
    p
}

/// QEMU on the `tap0` tether made in `pod`, with its `eth0`'s MAC (as
/// KubeVirt gives the domain), leasing IPv4 with udhcpc; a migration's
/// target listens for the guest's state instead.
fn guest_in(pod: &KubePod, incoming: bool) -> Guest {
    let mut opts = GuestOptions::new("tap0", &pod.eth0_mac());
    opts.dhcp6 = Client::None;
    if incoming {
        opts.incoming = Some("migration.sock".into());
    }
    Guest::start(pod.netns(), opts)
}

/// The node tether's record of the VM at `vm` names active (its
/// `VMAddress` object).
fn active_node(c: &KubeCluster, vm: IpAddr) -> String {
    tether_record(c, &vm.to_string())["spec"]["active"]["node"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn dead_or_moved(reports: &[StreamReport]) -> Vec<String> {
    reports
        .iter()
        .filter(|r| !r.survived() || !r.one_address())
        .map(|r| r.line())
        .collect()
}

#[cfg_attr(
    not(feature = "kubelet-tests"),
    ignore = "kubelet tier: root and kubelet nodes built from Kubernetes' source; `make test` runs it"
)]
#[test]
fn every_path_survives_a_vms_live_migration_between_two_kubelet_nodes() {
    require_root();
    once_more_if_a_guest_kernel_panicked(
        "every_path_survives_a_vms_live_migration_between_two_kubelet_nodes",
        every_path_survives_a_vms_live_migration_between_two_kubelet_nodes_attempt,
    );
}

fn every_path_survives_a_vms_live_migration_between_two_kubelet_nodes_attempt() {
    let started = Instant::now();
    let c = Topology::kubelet(2).start();
    let image = c.build_tether_image("1");
    c.install_tether(&image);
    let (a, b) = (c.nodes()[0].name(), c.nodes()[1].name());

    // The VM on A: its pod, and the guest on the pod's tap.
    let spec = VmPodSpec::new("default", "vm1", "virt-launcher-vm1-aaaaa");
    c.api.apply(&vm_pod(&c, &spec, a).to_string());
    let source = c.adopt_pod(&spec.pod_name);
    let vm = source.ip;
    let guest = guest_in(&source, false);
    let lease = guest.wait_line("TETHER-LEASE4", BOOT_TIMEOUT);
    assert!(
        lease.contains(&format!("ip={vm} ")),
        "the guest did not lease its pod's address {vm}: {lease}"
    );
    let paths = KubePaths::start(&c, vm);

    // The migration's target on B, its QEMU waiting.
    let target_spec = spec.target("virt-launcher-vm1-bbbbb");
    c.api.apply(&vm_pod(&c, &target_spec, b).to_string());
    let target = c.adopt_pod(&target_spec.pod_name);
    assert_eq!(target.ip, vm, "the target pod has the VM's address");
    assert_eq!(
        target.eth0_mac(),
        source.eth0_mac(),
        "the target pod has the VM's MAC"
    );
    let incoming = guest_in(&target, true);

    let set = PathSet::start(&guest, &paths.ends(&c, vm, 0), STREAM_INTERVAL);
    clear_events(&guest);
    clear_events(&incoming);
    let t0 = Instant::now();
    let m = guest.migrate_to(&incoming, MIGRATION_LIMIT);
    assert_eq!(m.status, "completed", "{m:?}\n{}", incoming.console_text());
    let moved = wait_until(Duration::from_secs(30), || active_node(&c, vm) == b);
    std::thread::sleep(AFTER);
    let gap = pause(&guest, &incoming);

    // KubeVirt's cleanup of the source: its QEMU ends, then its pod goes
    // (the kubelet's CNI DEL on A), the streams still running.
    let cleanup = Instant::now();
    drop(guest);
    c.api.kubectl_ok(&[
        "-n",
        "default",
        "delete",
        "pod",
        &spec.pod_name,
        "--wait=true",
    ]);
    drop(source);
    std::thread::sleep(AFTER);

    let reports = set.stop();
    let text = table(&reports, t0, gap);
    eprintln!(
        "live migration between two kubelet nodes (Kubernetes store): QEMU total {:?} ms, downtime {:?} ms; the source pod deleted {:.1} s after the migration began\n{text}",
        m.total_ms,
        m.downtime_ms,
        cleanup.duration_since(t0).as_secs_f64()
    );
    let bad = dead_or_moved(&reports);
    if !bad.is_empty() {
        eprintln!(
            "{}\n{}",
            handover_state(c.nodes().iter().map(|n| (n.name(), n.netns()))),
            c.network_view()
        );
    }
    assert!(
        moved,
        "tether's record of vm1 is not active on {b} after the migration: {}",
        active_node(&c, vm)
    );
    assert!(
        bad.is_empty(),
        "{} of {} streams did not survive the migration and the source pod's deletion with their addresses:\n{}\n\nall:\n{text}",
        bad.len(),
        reports.len(),
        bad.join("\n")
    );
    // The source pod's deletion cost nothing: no stream stalled after it
    // began (as long as a migration's own stall, allowing for a busy
    // machine). A stall that began before the deletion (the migration's,
    // drawn out by TCP's backoff) is the migration's, reported above.
    let ms = |at: Instant| at.saturating_duration_since(t0).as_secs_f64() * 1e3;
    let stalled: Vec<String> = reports
        .iter()
        .filter_map(|r| {
            let (d, from) = r.stall_within(cleanup, r.stopped)?;
            (d > Duration::from_secs(1) && from >= cleanup).then(|| {
                format!(
                    "{}\n    stalled {:.0} ms from +{:.0} ms; the deletion began at +{:.0} ms",
                    r.line(),
                    d.as_secs_f64() * 1e3,
                    ms(from),
                    ms(cleanup)
                )
            })
        })
        .collect();
    assert!(
        stalled.is_empty(),
        "streams stalled by the source pod's deletion:\n{}",
        stalled.join("\n")
    );
    eprintln!(
        "kube_vm_connections: {:.0} s in all",
        started.elapsed().as_secs_f64()
    );
}
