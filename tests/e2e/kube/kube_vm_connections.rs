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
//!
//! That first test runs on a dual-stack cluster (tests/src/stack.rs): the
//! VM's pods have an IPv4 and an IPv6 address, the guest leases the first
//! by DHCPv4 (udhcpc) and the second by DHCPv6 (dhcpcd, following tether's
//! router advertisements), and every path above whose ends have both
//! families runs in both (the Services stay IPv4). The target pod has
//! both addresses of the source; after the move the guest renews both
//! leases from B's tether and gets the same addresses; each family's loss
//! window (its UDP streams' stalls) is printed.
//!
//! The second test does the same move under a NetworkPolicy that denies
//! the VM every ingress and leaves its egress open: the connections the
//! VM opened keep working on B (B has never seen them; the flows the
//! source hands over let their replies in), and new connections to the VM,
//! tried throughout from a pod on each node and through a NodePort of B,
//! never pass, before, during or after the cutover.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tether_e2e::denied::Denied;
use tether_e2e::kube_cluster::{KubeCluster, KubePaths, KubePod};
use tether_e2e::kubelet::busybox_pod;
use tether_e2e::kubevirt::scenario::tether_record;
use tether_e2e::paths::{dead_or_moved, handover_state, table, PathSet, VM_TCP, VM_UDP};
use tether_e2e::qemu::{
    clear_events, once_more_if_a_guest_kernel_panicked, parse_lease, pause, Client, Guest,
    GuestOptions, Migration, Pause, BOOT_TIMEOUT,
};
use tether_e2e::stack::Stack;
use tether_e2e::streams::{Proto, Stream, StreamReport};
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
/// KubeVirt gives the domain), leasing IPv4 with udhcpc and, if the pod
/// has an IPv6 address (a dual-stack cluster), IPv6 with dhcpcd (which
/// follows tether's router advertisements to DHCPv6); a migration's
/// target listens for the guest's state instead.
fn guest_in(pod: &KubePod, incoming: bool) -> Guest {
    let mut opts = GuestOptions::new("tap0", &pod.eth0_mac());
    opts.dhcp6 = if pod.ip6().is_some() {
        Client::Dhcpcd
    } else {
        Client::None
    };
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

/// A two-kubelet-node cluster of `stack` with tether installed by its
/// chart, and VM `vm1` on its first node: its launcher pod, and a guest on
/// the pod's tap that leased the pod's addresses (both, dual-stack).
fn cluster_with_a_vm(stack: Stack) -> (KubeCluster, VmPodSpec, KubePod, Guest) {
    let c = Topology::kubelet(2).stack(stack).start();
    let image = c.build_tether_image("1");
    c.install_tether(&image);
    let spec = VmPodSpec::new("default", "vm1", "virt-launcher-vm1-aaaaa");
    c.api
        .apply(&vm_pod(&c, &spec, c.nodes()[0].name()).to_string());
    let source = c.adopt_pod(&spec.pod_name);
    let vm = source.ip;
    let guest = guest_in(&source, false);
    let lease = guest.wait_line("TETHER-LEASE4", BOOT_TIMEOUT);
    assert!(
        lease.contains(&format!("ip={vm} ")),
        "the guest did not lease its pod's address {vm}: {lease}"
    );
    if let Some(vm6) = source.ip6() {
        let lease = parse_lease(&guest.wait_line("TETHER-LEASE6", BOOT_TIMEOUT));
        assert_eq!(
            lease.get("ip"),
            Some(&vm6.to_string()),
            "the guest did not lease its pod's IPv6 address {vm6}: {lease:?}"
        );
    }
    (c, spec, source, guest)
}

/// The migration's target pod of `spec`'s VM (at `vms`, one address per
/// family of the cluster) on `node`, with the VM's addresses, and its
/// QEMU waiting for the guest.
fn target_on(c: &KubeCluster, spec: &VmPodSpec, node: &str, vms: &[IpAddr]) -> (KubePod, Guest) {
    let target_spec = spec.target("virt-launcher-vm1-bbbbb");
    c.api.apply(&vm_pod(c, &target_spec, node).to_string());
    let target = c.adopt_pod(&target_spec.pod_name);
    assert_eq!(target.ips, vms, "the target pod has the VM's addresses");
    let incoming = guest_in(&target, true);
    (target, incoming)
}

/// What [`migrate_and_clean_up`] saw.
struct Moved {
    /// QEMU's account of the migration.
    m: Migration,
    /// tether's record names the target's node active.
    moved: bool,
    /// The guest's pause.
    gap: Option<Pause>,
    /// When the migration began.
    t0: Instant,
    /// When the source's cleanup began.
    cleanup: Instant,
    /// Every node's routes and rules for the VM's address just before
    /// the source pod's deletion, and [`AFTER`] after it.
    routes_before: String,
    routes_after: String,
}

/// Every node's routes (all tables) and policy rules that name one of
/// `vms` (the VM's addresses), one node after another: what the VM's
/// paths depend on in each kernel.
fn routes_of(c: &KubeCluster, vms: &[IpAddr]) -> String {
    let mut out = String::new();
    for n in c.nodes() {
        out.push_str(&format!("--- {}\n", n.name()));
        for vm in vms {
            let (family, host) = if vm.is_ipv4() {
                ("-4", format!("{vm}/32"))
            } else {
                ("-6", format!("{vm}/128"))
            };
            let vm = vm.to_string();
            for cmd in [
                &["ip", family, "route", "show", "table", "all"][..],
                &["ip", family, "rule", "show"],
            ] {
                let o = n.netns().exec(cmd);
                for line in String::from_utf8_lossy(&o.stdout).lines() {
                    if line.split_whitespace().any(|w| w == vm || w == host) {
                        out.push_str(line);
                        out.push('\n');
                    }
                }
            }
        }
    }
    out
}

/// Migrates `guest` to `incoming` (its target on node `to`) by QMP, waits
/// until tether's record names `to`, and then does KubeVirt's cleanup of
/// the source: its QEMU ends, then its pod goes (the kubelet's CNI DEL),
/// [`AFTER`] after each step, whatever the streams are doing.
fn migrate_and_clean_up(
    c: &KubeCluster,
    guest: Guest,
    incoming: &Guest,
    spec: &VmPodSpec,
    source: KubePod,
    to: &str,
) -> Moved {
    let vms = source.ips.clone();
    let vm = source.ip;
    clear_events(&guest);
    clear_events(incoming);
    let t0 = Instant::now();
    let m = guest.migrate_to(incoming, MIGRATION_LIMIT);
    assert_eq!(m.status, "completed", "{m:?}\n{}", incoming.console_text());
    let moved = wait_until(Duration::from_secs(30), || active_node(c, vm) == to);
    std::thread::sleep(AFTER);
    let gap = pause(&guest, incoming);
    let routes_before = routes_of(c, &vms);
    let cleanup = Instant::now();
    drop(guest);
    c.api.kubectl_ok(&[
        "-n",
        &spec.namespace,
        "delete",
        "pod",
        &spec.pod_name,
        "--wait=true",
    ]);
    drop(source);
    std::thread::sleep(AFTER);
    Moved {
        m,
        moved,
        gap,
        t0,
        cleanup,
        routes_before,
        routes_after: routes_of(c, &vms),
    }
}

#[cfg_attr(
    not(feature = "kubelet-tests"),
    ignore = "kubelet tier: root and kubelet nodes built from Kubernetes' source; `make test` runs it"
)]
#[test]
fn every_path_of_a_dual_stack_vm_survives_its_live_migration_between_two_kubelet_nodes() {
    require_root();
    once_more_if_a_guest_kernel_panicked(
        "every_path_of_a_dual_stack_vm_survives_its_live_migration_between_two_kubelet_nodes",
        every_path_of_a_dual_stack_vm_survives_its_live_migration_between_two_kubelet_nodes_attempt,
    );
}

fn every_path_of_a_dual_stack_vm_survives_its_live_migration_between_two_kubelet_nodes_attempt() {
    let started = Instant::now();
    let (c, spec, source, guest) = cluster_with_a_vm(Stack::Dual);
    let b = c.nodes()[1].name();
    let vm = source.ip;
    let vms = source.ips.clone();
    assert_eq!(vms.len(), 2, "the VM's pod has an address per family");
    let paths = KubePaths::start(&c, vm);

    // The migration's target on B, its QEMU waiting.
    let (target, incoming) = target_on(&c, &spec, b, &vms);
    assert_eq!(
        target.eth0_mac(),
        source.eth0_mac(),
        "the target pod has the VM's MAC"
    );

    let set = PathSet::start(&guest, &paths.ends(&c, &vms, 0), STREAM_INTERVAL);
    let Moved {
        m,
        moved,
        gap,
        t0,
        cleanup,
        routes_before,
        routes_after,
    } = migrate_and_clean_up(&c, guest, &incoming, &spec, source, b);

    let reports = set.stop();
    // The guest, now on B, renews both leases there: B's tether answers
    // with the same addresses. After the streams stop: dhcpcd's rebind
    // may take the address down for a moment, which is the client's doing.
    let mark = incoming.mark();
    incoming.run_ok("kill -USR1 $(cat /run/udhcpc.pid); dhcpcd -6 -n eth0");
    for (line, ip) in [("TETHER-LEASE4", vms[0]), ("TETHER-LEASE6", vms[1])] {
        let (_, lease) = incoming.wait_line_after(line, mark, BOOT_TIMEOUT);
        assert_eq!(
            parse_lease(&lease).get("ip"),
            Some(&ip.to_string()),
            "the guest's renewal on {b}: {lease}"
        );
    }
    let text = table(&reports, t0, gap);
    eprintln!(
        "live migration of a dual-stack VM between two kubelet nodes (Kubernetes store): QEMU total {:?} ms, downtime {:?} ms; the source pod deleted {:.1} s after the migration began\n{text}\n{}",
        m.total_ms,
        m.downtime_ms,
        cleanup.duration_since(t0).as_secs_f64(),
        loss_windows(&reports, t0)
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
    // The source pod's deletion cost nothing. First in the kernels: it
    // left every node's routes and rules for the VM's address as they
    // were (the source's DEL tears down its pod, not the VM's paths).
    assert!(
        routes_before
            .split("--- ")
            .skip(1)
            .all(|node| node.lines().count() > 1),
        "a node has no route for {vm} before the source pod's deletion:\n{routes_before}"
    );
    eprintln!("routes and rules for {vm} before the deletion:\n{routes_before}");
    assert_eq!(
        routes_after, routes_before,
        "the source pod's deletion changed the routes or rules for {vm}"
    );
    // Then on the wire: no path stopped for as long as a migration's own
    // stall (allowing for a busy machine) once the deletion began. A path's
    // outage is read from its UDP stream, one message every 20 ms: its
    // TCP stream's stall after a loss is stretched by the retransmission
    // backoff (200, 400, 800 ms...), so that a half-second pause of a
    // guest starved of CPU on this 2-core machine reads as 1.5 s, and TCP
    // has already had to survive above. A stall that began before the
    // deletion (the migration's) is the migration's, reported above.
    let ms = |at: Instant| at.saturating_duration_since(t0).as_secs_f64() * 1e3;
    let stalled: Vec<String> = reports
        .iter()
        .filter(|r| r.proto == Proto::Udp)
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
        "paths stalled by the source pod's deletion:\n{}",
        stalled.join("\n")
    );
    eprintln!(
        "kube_vm_connections: {:.0} s in all",
        started.elapsed().as_secs_f64()
    );
}

/// Each family's loss window: the UDP streams' stalls (one message every
/// 20 ms, so a stall is the time without an echo) from the migration's
/// start, of the paths to and from the VM's address of that family
/// (pods to the VM, the VM to the outside host and to a pod): the median
/// and the longest.
fn loss_windows(reports: &[StreamReport], t0: Instant) -> String {
    let mut out = String::new();
    for family in ["v4", "v6"] {
        let mut ms: Vec<f64> = reports
            .iter()
            .filter(|r| r.proto == Proto::Udp && r.name.ends_with(&format!(" {family}")))
            .map(|r| {
                r.stall_within(t0, r.stopped)
                    .map_or(0.0, |(d, _)| d.as_secs_f64() * 1e3)
            })
            .collect();
        ms.sort_by(f64::total_cmp);
        if ms.is_empty() {
            continue;
        }
        out.push_str(&format!(
            "loss window IP{family} (UDP, {} paths): median {:.1} ms, longest {:.1} ms\n",
            ms.len(),
            ms[ms.len() / 2],
            ms[ms.len() - 1]
        ));
    }
    out
}

/// How often each denied flow is tried.
const DENIED_INTERVAL: Duration = Duration::from_millis(100);
/// How long a policy takes to reach both nodes (through their watches).
const CONVERGE: Duration = Duration::from_secs(30);
/// A probe that has not got through for this long is denied.
const QUIET: Duration = Duration::from_secs(2);
/// The port of the VM's streams to the pod on the source node.
const SOURCE_POD_PORT: u16 = 9002;

#[cfg_attr(
    not(feature = "kubelet-tests"),
    ignore = "kubelet tier: root and kubelet nodes built from Kubernetes' source; `make test` runs it"
)]
#[test]
fn a_vms_own_connections_survive_its_migration_under_a_default_deny_ingress_policy() {
    require_root();
    once_more_if_a_guest_kernel_panicked(
        "a_vms_own_connections_survive_its_migration_under_a_default_deny_ingress_policy",
        policy_attempt,
    );
}

fn policy_attempt() {
    let started = Instant::now();
    let (c, spec, source, guest) = cluster_with_a_vm(Stack::V4);
    let (a, b) = (c.nodes()[0].name(), c.nodes()[1].name());
    let vm = source.ip;
    let paths = KubePaths::start(&c, vm);
    // The VM's own connections, opened before any policy.
    let mut set = PathSet::start_opened_by_vm(&guest, &paths.ends(&c, &[vm], 0), STREAM_INTERVAL);
    // And to the pod on A, which B never forwarded a packet of: after the
    // move its far end's messages reach B as strangers, unless B was
    // handed the flows (the paths' peer pod is on B, which saw them).
    let local = &paths.pods[0];
    let mut connectors = Vec::new();
    for proto in [Proto::Tcp, Proto::Udp] {
        let stream = Stream::listen_any(
            &[local.netns()],
            "VM -> pod on the source node",
            proto,
            local.ip,
            SOURCE_POD_PORT,
            STREAM_INTERVAL,
        );
        connectors.push(format!(
            "tether-echo {}-connect {} {SOURCE_POD_PORT} >/dev/console 2>&1 &",
            proto.name(),
            local.ip
        ));
        set.push(stream);
    }
    guest.run_ok(&connectors.join(" "));
    assert!(
        set.wait_echoes(20, Duration::from_secs(30)),
        "the VM's streams to the pod on {a} got no echoes"
    );

    // New connections to the VM, tried from the start: they pass until
    // the policy is in force (so the probes can see a pass).
    let (tcp_np, udp_np) = paths.services.vm_node_ports;
    let node_b = IpAddr::V4(c.nodes()[1].underlay().v4);
    let probes = [
        Denied::start(
            paths.pods[0].netns(),
            &format!("pod on {a} -> VM"),
            SocketAddr::new(vm, VM_TCP),
            SocketAddr::new(vm, VM_UDP),
            DENIED_INTERVAL,
        ),
        Denied::start(
            paths.pods[1].netns(),
            &format!("pod on {b} -> VM"),
            SocketAddr::new(vm, VM_TCP),
            SocketAddr::new(vm, VM_UDP),
            DENIED_INTERVAL,
        ),
        Denied::start(
            paths.outside.netns(),
            &format!("outside -> NodePort of {b} -> VM"),
            SocketAddr::new(node_b, tcp_np),
            SocketAddr::new(node_b, udp_np),
            DENIED_INTERVAL,
        ),
    ];
    let before = Instant::now();
    let open = wait_until(CONVERGE, || {
        probes.iter().all(|p| {
            let (tcp, udp) = p.passed_since(before);
            tcp > 0 && udp > 0
        })
    });
    let seen: Vec<String> = probes
        .iter()
        .map(|p| {
            format!(
                "{}: {:?} (TCP, UDP) of {}",
                p.name(),
                p.passed_since(before),
                p.tries()
            )
        })
        .collect();
    assert!(
        open,
        "before any policy, every probe must reach the VM over TCP and UDP:\n{}",
        seen.join("\n")
    );

    // Deny the VM every ingress; its egress stays open.
    c.api.apply(
        &json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": {"namespace": "default", "name": "vm1-no-ingress"},
                "spec": {"podSelector": {"matchLabels": {"vm.kubevirt.io/name": "vm1"}},
                         "policyTypes": ["Ingress"]}})
        .to_string(),
    );
    let applied = Instant::now();
    let quiet = wait_until(CONVERGE, || {
        let since = Instant::now() - QUIET;
        since > applied && probes.iter().all(|p| p.passed_since(since) == (0, 0))
    });
    assert!(
        quiet,
        "the policy was not in force {CONVERGE:?} after its creation: {:?}",
        probes
            .iter()
            .map(|p| p.passed_since(applied))
            .collect::<Vec<_>>()
    );
    let enforced = Instant::now();

    // The target pod, made while the policy is in force: its ADD returns
    // once B's table holds it.
    let (_target, incoming) = target_on(&c, &spec, b, &[vm]);
    let Moved {
        m, moved, gap, t0, ..
    } = migrate_and_clean_up(&c, guest, &incoming, &spec, source, b);

    let reports = set.stop();
    let denied: Vec<_> = probes.into_iter().map(Denied::stop).collect();
    let text = table(&reports, t0, gap);
    let ms = |at: Instant| at.saturating_duration_since(t0).as_secs_f64() * 1e3;
    let probe_lines: Vec<String> = denied
        .iter()
        .map(|r| {
            let after = r.passed_since(enforced);
            format!(
                "{}: {} rounds, {} passed once the policy was in force{}{}",
                r.name,
                r.tries,
                after.len(),
                after
                    .iter()
                    .map(|p| format!(" ({} at +{:.0} ms)", p.proto.name(), ms(p.at)))
                    .collect::<String>(),
                if r.errors.is_empty() {
                    String::new()
                } else {
                    format!("; errors: {}", r.errors.join("; "))
                }
            )
        })
        .collect();
    eprintln!(
        "live migration under a default-deny ingress policy: QEMU total {:?} ms, downtime {:?} ms\n{text}\ndenied flows (+ms from the migration's start):\n{}",
        m.total_ms,
        m.downtime_ms,
        probe_lines.join("\n")
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
        denied
            .iter()
            .all(|r| r.errors.is_empty() && r.passed_since(enforced).is_empty()),
        "a flow the policy denies passed (or a probe failed):\n{}",
        probe_lines.join("\n")
    );
    assert!(
        bad.is_empty(),
        "{} of {} of the VM's own connections did not survive the migration under the policy:\n{}\n\nall:\n{text}",
        bad.len(),
        reports.len(),
        bad.join("\n")
    );
    eprintln!(
        "kube_vm_connections (policy): {:.0} s in all",
        started.elapsed().as_secs_f64()
    );
}
