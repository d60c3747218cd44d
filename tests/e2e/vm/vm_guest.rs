//! Real virtual machines on tether's `tap` binding: three nodes on etcd, a
//! QEMU guest (TCG) on the tap tether made in a virt-launcher-like pod,
//! leasing its address from tether's DHCP with real clients (busybox
//! `udhcpc` for IPv4, `dhcpcd` for IPv6), reached from an ordinary pod on
//! another node, live-migrated by QEMU itself (the cutover triggered by
//! QEMU's own RARP, nothing else), restarted elsewhere, migrated and
//! failed, migrated across a daemon restart, and released without a trace.

use std::net::IpAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tether_e2e::cluster::{assert_ping_within, Cluster, ClusterNode, Pod};
use tether_e2e::migration::Prober;
use tether_e2e::qemu::{
    once_more_if_a_guest_kernel_panicked, parse_lease, Client, Guest, GuestOptions, BOOT_TIMEOUT,
};
use tether_e2e::topology::Topology;
use tether_e2e::vm::{
    active_node, add_vm_pod, alternate_node, del_vm_pod, get_vm, release_vm, result_mac, VmPodSpec,
};
use tether_e2e::{require_root, wait_until, ROUTE_PROTOCOL};

/// Routes follow the store through a watch: allow for it.
const CONVERGE: Duration = Duration::from_secs(15);
/// 2000 probes per second from the observer.
const PROBE_INTERVAL: Duration = Duration::from_micros(500);
/// A TCG migration of a 128 MiB guest takes about a second here.
const MIGRATION_LIMIT: Duration = Duration::from_secs(120);

fn socket(node: &ClusterNode) -> &Path {
    node.daemon().socket()
}

/// The VM's pods: the `tap` binding, and DNS for the guest's DHCP.
fn spec(vm: &str, pod: &str) -> VmPodSpec {
    let mut s = VmPodSpec::new("tenant", vm, pod);
    s.extra_conf = vec![
        ("kubevirt".into(), json!({"binding": "tap"})),
        (
            "dns".into(),
            json!({
                "nameservers": ["10.96.0.10", "fd00:96::a"],
                "search": ["tenant.svc.cluster.local", "svc.cluster.local"]
            }),
        ),
    ];
    s
}

/// The MAC KubeVirt would give the domain: the pod interface's.
fn pod_interface_mac(pod: &Pod) -> String {
    let out = pod.netns().exec(&["cat", "/sys/class/net/eth0/address"]);
    assert!(out.status.success(), "no eth0 in the pod");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A guest on `pod`'s tap with the pod interface's MAC.
fn boot(pod: &Pod, incoming: bool) -> Guest {
    let mut opts = GuestOptions::new("tap0", &pod_interface_mac(pod));
    opts.dhcp6 = Client::Dhcpcd;
    if incoming {
        opts.incoming = Some("migration.sock".into());
    }
    Guest::start(pod.netns(), opts)
}

/// Checks a `TETHER-LEASE4` line against the VM's address and the netconf.
fn check_lease4(line: &str, ip: IpAddr) {
    let l = parse_lease(line);
    let want = [
        ("ip", ip.to_string()),
        ("mask", "32".into()),
        ("subnet", "255.255.255.255".into()),
        ("router", "169.254.1.1".into()),
        (
            "staticroutes",
            "169.254.1.1/32 0.0.0.0 0.0.0.0/0 169.254.1.1".into(),
        ),
        ("dns", "10.96.0.10".into()),
        ("domain", "tenant.svc.cluster.local".into()),
        (
            "search",
            "tenant.svc.cluster.local svc.cluster.local".into(),
        ),
        ("hostname", "vm1".into()),
        ("lease", "3600".into()),
        ("serverid", "169.254.1.1".into()),
    ];
    for (k, v) in want {
        assert_eq!(
            l.get(k).map(String::as_str),
            Some(v.as_str()),
            "{k} in {line}"
        );
    }
    let mtu: u32 = l["mtu"].parse().expect("an MTU");
    assert!((1280..=9000).contains(&mtu), "{line}");
}

/// Checks a `TETHER-LEASE6` line.
fn check_lease6(line: &str, ip6: IpAddr) {
    let l = parse_lease(line);
    assert_eq!(
        l.get("ip").map(String::as_str),
        Some(ip6.to_string().as_str()),
        "{line}"
    );
    assert_eq!(
        l.get("dns").map(String::as_str),
        Some("fd00:96::a"),
        "{line}"
    );
    assert!(
        l.get("search")
            .is_some_and(|s| s.contains("tenant.svc.cluster.local")),
        "{line}"
    );
    assert!(
        l.get("router").is_some_and(|r| r.contains("fe80::1")),
        "{line}"
    );
}

/// The guest's lease lines, both families, after `mark`.
fn leases(guest: &Guest, mark: usize, ip: IpAddr, ip6: IpAddr) {
    let (_, v4) = guest.wait_line_after("TETHER-LEASE4", mark, BOOT_TIMEOUT);
    check_lease4(&v4, ip);
    let (_, v6) = guest.wait_line_after("TETHER-LEASE6", mark, BOOT_TIMEOUT);
    check_lease6(&v6, ip6);
}

/// Probes from `observer` to `ip` until a reply comes `after`. Generous:
/// a TCG guest on a loaded 2-core machine may be slow to run again.
fn resumed(prober: &Prober, after: Instant) -> bool {
    wait_until(Duration::from_secs(20), || {
        prober.received_since(after) > 100
    })
}

/// Whether any node still routes `ip` (proto 201 host route or 203 VM
/// route), or still holds a tap for it.
fn routes_to(cluster: &Cluster, ip: IpAddr) -> Vec<String> {
    let mut found = Vec::new();
    for node in cluster.nodes() {
        for proto in [ROUTE_PROTOCOL, 203] {
            for r in node.netns().routes_with_protocol(proto) {
                if r["dst"].as_str() == Some(ip.to_string().as_str()) {
                    found.push(format!("{} proto {proto}: {r}", node.name()));
                }
            }
        }
    }
    found
}

/// Makes the guest's udhcpc renew (SIGUSR1: a unicast REQUEST to the
/// server id) and checks the lease it then prints. On failure it shows what
/// the guest and `node`'s DHCP service saw.
fn renew(guest: &Guest, node: &ClusterNode, ip: IpAddr) {
    let mark = guest.mark();
    guest.run_ok("kill -USR1 $(cat /run/udhcpc.pid)");
    let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        guest.wait_line_after("TETHER-LEASE4", mark, BOOT_TIMEOUT)
    }));
    match got {
        Ok((_, line)) => check_lease4(&line, ip),
        Err(e) => {
            let (_, seen) = guest.run("ip neigh; ip route; ps", Duration::from_secs(10));
            let dhcp: Vec<String> = node
                .daemon()
                .log()
                .lines()
                .filter(|l| l.contains("guest") || l.contains("dhcp"))
                .map(str::to_owned)
                .collect();
            eprintln!(
                "no renewal: the guest has\n{seen}\n{}'s DHCP log:\n{}",
                node.name(),
                dhcp.join("\n")
            );
            std::panic::resume_unwind(e);
        }
    }
}

#[cfg_attr(
    not(feature = "cluster-tests"),
    ignore = "cluster tier: root, etcd and kube-apiserver; `make test` runs it"
)]
#[test]
fn a_real_guest_leases_migrates_by_its_own_rarp_restarts_and_leaves_nothing() {
    require_root();
    once_more_if_a_guest_kernel_panicked(
        "a_real_guest_leases_migrates_by_its_own_rarp_restarts_and_leaves_nothing",
        a_real_guest_leases_migrates_by_its_own_rarp_restarts_and_leaves_nothing_attempt,
    );
}

fn a_real_guest_leases_migrates_by_its_own_rarp_restarts_and_leaves_nothing_attempt() {
    let cluster = Topology::tetherd(3).start();
    let (a, b, c) = (cluster.node(0), cluster.node(1), cluster.node(2));
    let first = spec("vm1", "virt-launcher-vm1-aaaaa");

    // 1. The VM on A: QEMU on tether's tap, a lease with every option.
    let source = add_vm_pod(a, &first);
    let ip = source.v4().expect("IPv4");
    let ip6 = source.v6().expect("IPv6");
    let mac = result_mac(&source);
    assert_eq!(
        pod_interface_mac(&source),
        mac,
        "the domain gets the record's MAC"
    );
    let ifs = source.result()["interfaces"]
        .as_array()
        .expect("interfaces");
    assert!(
        ifs.iter()
            .any(|i| i["name"] == "tap0" && i["sandbox"].is_string()),
        "the result lists the tap: {ifs:?}"
    );
    let started = Instant::now();
    let guest_a = boot(&source, false);
    let booted = guest_a.wait_line("TETHER-BOOTED", BOOT_TIMEOUT);
    assert!(booted.contains(&format!("mac={mac}")), "{booted}");
    leases(&guest_a, 0, ip, ip6);
    eprintln!(
        "guest on A booted and leased both families in {:?}",
        started.elapsed()
    );
    let observer = c.add_pod();
    assert_ping_within(observer.netns(), ip, CONVERGE);
    assert_ping_within(observer.netns(), ip6, CONVERGE);
    let (_, route) = (0, guest_a.run_ok("ip route"));
    assert!(route.contains("default via 169.254.1.1"), "{route}");

    // 2. Live migration A -> B by QEMU. Nothing but QEMU's own RARP may
    // trigger the cutover: no admin call, no annotation.
    let target = add_vm_pod(b, &first.target("virt-launcher-vm1-bbbbb"));
    assert_eq!(target.ips(), source.ips());
    let guest_b = boot(&target, true);
    let prober = Prober::start(observer.netns(), ip, PROBE_INTERVAL);
    assert!(
        resumed(&prober, Instant::now()),
        "no answers before the migration"
    );
    let t0 = Instant::now();
    let m = guest_a.migrate_to(&guest_b, MIGRATION_LIMIT);
    assert_eq!(m.status, "completed", "{m:?}\n{}", guest_b.console_text());
    if !resumed(&prober, m.finished) {
        let route = |n: &ClusterNode| {
            let out = n.netns().exec(&["ip", "route", "get", &ip.to_string()]);
            let neigh = n.netns().exec(&["ip", "neigh"]);
            format!(
                "{}: {} {}",
                n.name(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&neigh.stdout)
            )
        };
        // The nodes' side first: asking the guest panics if QEMU is gone.
        eprintln!(
            "probes never resumed after the migration ({m:?});\n{}\n{}\n{}\ntarget pod: {:?}",
            route(a),
            route(b),
            route(c),
            target
                .netns()
                .exec(&["tc", "-s", "filter", "show", "dev", "eth0", "ingress"])
        );
        let (_, inside) = guest_b.run(
            "ip neigh; ip route; ip -s link show eth0",
            Duration::from_secs(20),
        );
        panic!(
            "probes never resumed after the migration;\nguest:\n{inside}\nconsole:\n{}",
            guest_b.console_text()
        );
    }
    let report = prober.stop();
    let window = report
        .longest_loss_after(t0)
        .map_or(Duration::ZERO, |w| w.duration);
    eprintln!(
        "migration: QEMU total {:?} ms, downtime {:?} ms; observer's loss window {window:?}; {report}",
        m.total_ms, m.downtime_ms
    );
    let rec = get_vm(socket(c), "tenant", "vm1").expect("record");
    assert_eq!(active_node(&rec), b.name(), "{rec:?}");
    assert_eq!(
        rec.last_cutover.as_ref().map(|l| l.trigger.as_str()),
        Some("rarp"),
        "QEMU's announcement cut over: {rec:?}"
    );
    assert!(window < Duration::from_secs(2), "loss window {window:?}");
    assert_eq!(guest_b.run_ok("cat /sys/class/net/eth0/address"), mac);
    assert!(guest_b
        .run_ok("ip -4 addr show eth0")
        .contains(&format!("{ip}/32")));
    assert_ping_within(observer.netns(), ip6, CONVERGE);

    // The source's DEL comes after the switch; then only B can answer a
    // renewal, and it gives the same lease.
    drop(guest_a);
    assert!(del_vm_pod(a, &first, &source).success());
    drop(source);
    renew(&guest_b, b, ip);
    assert!(observer.ping(ip), "the guest answers on B");
    let on_b = tether_e2e::admin::stats(socket(b))
        .guest_dhcp
        .expect("B's DHCP stats");
    assert!(
        on_b.dhcp4 >= 1 && on_b.served == 1 && on_b.malformed == 0 && on_b.foreign_mac == 0,
        "{on_b:?}"
    );
    let on_a = tether_e2e::admin::stats(socket(a))
        .guest_dhcp
        .expect("A's DHCP stats");
    assert!(
        on_a.dhcp4 >= 2 && on_a.served == 0,
        "A served the boot, then stopped: {on_a:?}"
    );

    // 3. The VM stops, and starts again on C in a new pod: the same lease.
    drop(guest_b);
    let target_spec = first.target("virt-launcher-vm1-bbbbb");
    assert!(del_vm_pod(b, &target_spec, &target).success());
    assert!(
        wait_until(Duration::from_secs(5), || !target.netns().has_link("tap0")),
        "DEL removes the tap"
    );
    drop(target);
    let again = spec("vm1", "virt-launcher-vm1-ccccc");
    let on_c = add_vm_pod(c, &again);
    assert_eq!(on_c.ips(), &[ip, ip6][..]);
    assert_eq!(result_mac(&on_c), mac);
    let guest_c = boot(&on_c, false);
    leases(&guest_c, 0, ip, ip6);
    assert_ping_within(observer.netns(), ip, CONVERGE);

    // 6. Released: no tap, no route, no record anywhere.
    drop(guest_c);
    assert!(del_vm_pod(c, &again, &on_c).success());
    assert!(wait_until(Duration::from_secs(5), || !on_c
        .netns()
        .has_link("tap0")));
    release_vm(socket(a), "tenant", "vm1", false).expect("ReleaseVm");
    assert!(
        wait_until(CONVERGE, || routes_to(&cluster, ip).is_empty()
            && routes_to(&cluster, ip6).is_empty()),
        "routes left: {:?} {:?}",
        routes_to(&cluster, ip),
        routes_to(&cluster, ip6)
    );
    for node in cluster.nodes() {
        assert!(
            get_vm(socket(node), "tenant", "vm1").is_err(),
            "record left"
        );
    }
}

/// Slows the source's migration stream so that the test can act while it
/// runs (bytes per second).
fn throttle(guest: &Guest, bytes_per_sec: u64) {
    guest.qmp(|q| {
        q.execute(
            "migrate-set-parameters",
            json!({ "max-bandwidth": bytes_per_sec }),
        )
    });
}

fn migration_status(guest: &Guest) -> Value {
    guest.qmp(|q| q.execute("query-migrate", json!({})))
}

/// The VM `first` on `node`, its guest booted with an IPv4 lease, and a
/// pod on `from` that pings it: (the VM's pod, its IPv4, the guest, the
/// pod that pings).
fn leased_and_reached(
    node: &ClusterNode,
    first: &VmPodSpec,
    from: &ClusterNode,
) -> (Pod, IpAddr, Guest, Pod) {
    let source = add_vm_pod(node, first);
    let ip = source.v4().expect("IPv4");
    let guest = boot(&source, false);
    guest.wait_line("TETHER-LEASE4", BOOT_TIMEOUT);
    let observer = from.add_pod();
    assert_ping_within(observer.netns(), ip, CONVERGE);
    (source, ip, guest, observer)
}

/// Starts the migration of `source` to `target` with its stream slowed to
/// `bytes_per_sec`, and waits up to 20 s for its first MiB copied:
/// whether it was.
fn start_slow_migration(source: &Guest, target: &Guest, bytes_per_sec: u64) -> bool {
    throttle(source, bytes_per_sec);
    source.start_migration(target);
    wait_until(Duration::from_secs(20), || {
        migration_status(source)["ram"]["transferred"]
            .as_u64()
            .unwrap_or(0)
            > 1024 * 1024
    })
}

#[cfg_attr(
    not(feature = "cluster-tests"),
    ignore = "cluster tier: root, etcd and kube-apiserver; `make test` runs it"
)]
#[test]
fn a_failed_migration_leaves_the_vm_on_its_source_and_the_target_del_frees_nothing() {
    require_root();
    once_more_if_a_guest_kernel_panicked(
        "a_failed_migration_leaves_the_vm_on_its_source_and_the_target_del_frees_nothing",
        a_failed_migration_leaves_the_vm_on_its_source_and_the_target_del_frees_nothing_attempt,
    );
}

fn a_failed_migration_leaves_the_vm_on_its_source_and_the_target_del_frees_nothing_attempt() {
    let cluster = Topology::tetherd(3).start();
    let (a, b, c) = (cluster.node(0), cluster.node(1), cluster.node(2));
    let first = spec("vm1", "virt-launcher-vm1-aaaaa");
    let (_source, ip, guest_a, observer) = leased_and_reached(a, &first, c);

    let target_spec = first.target("virt-launcher-vm1-bbbbb");
    let target = add_vm_pod(b, &target_spec);
    let mut guest_b = boot(&target, true);
    // Slow enough that the target can be killed mid-way.
    assert!(
        start_slow_migration(&guest_a, &guest_b, 2 * 1024 * 1024),
        "the migration never started: {}",
        migration_status(&guest_a)
    );
    guest_b.kill();
    let m = guest_a.wait_migration(MIGRATION_LIMIT);
    assert_eq!(m.status, "failed", "{m:?}");
    let status = guest_a.qmp(|q| q.execute("query-status", json!({})));
    assert_eq!(
        status["status"], "running",
        "the source VM runs on: {status}"
    );

    let before = tether_e2e::admin::pools_used(socket(a));
    assert!(del_vm_pod(b, &target_spec, &target).success());
    let rec = get_vm(socket(c), "tenant", "vm1").expect("record");
    assert_eq!(active_node(&rec), a.name(), "{rec:?}");
    assert_eq!(alternate_node(&rec), "", "{rec:?}");
    assert!(rec.last_cutover.is_none(), "{rec:?}");
    assert_eq!(
        tether_e2e::admin::pools_used(socket(a)),
        before,
        "the DEL freed nothing"
    );
    assert_ping_within(observer.netns(), ip, CONVERGE);
    renew(&guest_a, a, ip);
}

#[cfg_attr(
    not(feature = "cluster-tests"),
    ignore = "cluster tier: root, etcd and kube-apiserver; `make test` runs it"
)]
#[test]
fn a_migration_cuts_over_though_the_target_daemon_restarted_in_the_middle() {
    require_root();
    once_more_if_a_guest_kernel_panicked(
        "a_migration_cuts_over_though_the_target_daemon_restarted_in_the_middle",
        a_migration_cuts_over_though_the_target_daemon_restarted_in_the_middle_attempt,
    );
}

fn a_migration_cuts_over_though_the_target_daemon_restarted_in_the_middle_attempt() {
    let mut cluster = Topology::tetherd(3).start();
    let first = spec("vm1", "virt-launcher-vm1-aaaaa");
    let (_source, ip, guest_a, observer) =
        leased_and_reached(cluster.node(0), &first, cluster.node(2));
    let target = add_vm_pod(cluster.node(1), &first.target("virt-launcher-vm1-bbbbb"));
    let guest_b = boot(&target, true);

    assert!(
        start_slow_migration(&guest_a, &guest_b, 4 * 1024 * 1024),
        "the migration never started"
    );
    // tetherd on B restarts while QEMU copies memory.
    cluster.node_mut(1).daemon_mut().restart();
    throttle(&guest_a, 1 << 30);
    let m = guest_a.wait_migration(MIGRATION_LIMIT);
    assert_eq!(m.status, "completed", "{m:?}");
    let b = cluster.node(1);
    assert!(
        wait_until(CONVERGE, || get_vm(socket(b), "tenant", "vm1")
            .map(|r| active_node(&r) == b.name())
            .unwrap_or(false)),
        "no cutover after the restart: {:?}",
        get_vm(socket(b), "tenant", "vm1")
    );
    let rec = get_vm(socket(b), "tenant", "vm1").expect("record");
    assert_eq!(
        rec.last_cutover.as_ref().map(|l| l.trigger.as_str()),
        Some("rarp"),
        "{rec:?}"
    );
    assert_ping_within(observer.netns(), ip, CONVERGE);
    // The restarted daemon answers the guest's renewal with the same lease.
    renew(&guest_b, cluster.node(1), ip);
}

/// CHECK through the plugin, with the ADD's result as prevResult.
fn check_pod(node: &ClusterNode, spec: &VmPodSpec, pod: &Pod) -> tether_e2e::CniOutput {
    let mut conf = spec.netconf(node);
    conf["prevResult"] = pod.result().clone();
    node.call_with(
        "CHECK",
        pod.netns(),
        pod.id(),
        &conf,
        Some(&spec.args(pod.id())),
    )
}

#[cfg_attr(
    not(feature = "cluster-tests"),
    ignore = "cluster tier: root, etcd and kube-apiserver; `make test` runs it"
)]
#[test]
fn a_multi_queue_tap_and_a_managed_tap_pod_both_serve_a_real_guest() {
    require_root();
    once_more_if_a_guest_kernel_panicked(
        "a_multi_queue_tap_and_a_managed_tap_pod_both_serve_a_real_guest",
        a_multi_queue_tap_and_a_managed_tap_pod_both_serve_a_real_guest_attempt,
    );
}

fn a_multi_queue_tap_and_a_managed_tap_pod_both_serve_a_real_guest_attempt() {
    let cluster = Topology::tetherd(1).etcd_members(1).start();
    let a = cluster.node(0);

    // Multi-queue: QEMU opens two queues on tether's tap.
    let mut mq = spec("vm1", "virt-launcher-vm1-aaaaa");
    mq.extra_conf
        .push(("kubevirt".into(), json!({"binding": "tap", "tapQueues": 2})));
    let pod = add_vm_pod(a, &mq);
    let ip = pod.v4().expect("IPv4");
    let mut opts = GuestOptions::new("tap0", &pod_interface_mac(&pod));
    opts.queues = 2;
    let guest = Guest::start(pod.netns(), opts);
    let lease = guest.wait_line("TETHER-LEASE4", BOOT_TIMEOUT);
    check_lease4(&lease, ip);
    let queues = guest.run_ok("ls /sys/class/net/eth0/queues/");
    assert!(
        queues.contains("rx-1") && queues.contains("tx-1"),
        "{queues}"
    );
    assert!(
        check_pod(a, &mq, &pod).success(),
        "CHECK of a healthy tap pod"
    );
    drop(guest);

    // managedTap: tether gives a veth; KubeVirt's virt-handler (a test
    // double: its commands, not its code) bridges it to its own tap in the
    // pod. The guest's DHCP reaches tether on the node side of the veth.
    let mut managed = spec("vm2", "virt-launcher-vm2-aaaaa");
    managed.extra_conf[0] = ("kubevirt".into(), json!({"binding": "managedTap"}));
    let pod2 = add_vm_pod(a, &managed);
    let ip2 = pod2.v4().expect("IPv4");
    let mac2 = pod_interface_mac(&pod2);
    for cmd in [
        &["ip", "link", "set", "eth0", "down"][..],
        &["ip", "addr", "flush", "dev", "eth0"],
        &["ip", "link", "set", "eth0", "name", "eth0-nic"],
        &["ip", "link", "add", "k6t-eth0", "type", "bridge"],
        // KubeVirt's managedTapSpec (pkg/network/setup/netpod) gives the
        // renamed veth the bridge's MAC (CopyMacFrom) and turns learning
        // off: the guest takes the VM's MAC, and a port keeping it would
        // make the bridge drop the guest's frames as its own.
        &[
            "sh",
            "-c",
            "ip link set eth0-nic address $(cat /sys/class/net/k6t-eth0/address)",
        ],
        &["ip", "link", "set", "eth0-nic", "master", "k6t-eth0"],
        &[
            "bridge", "link", "set", "dev", "eth0-nic", "learning", "off",
        ],
        &[
            "ip", "tuntap", "add", "tap0", "mode", "tap", "vnet_hdr", "user", "107", "group", "107",
        ],
        &["ip", "link", "set", "tap0", "master", "k6t-eth0"],
        // KubeVirt makes a dummy here; this kernel has no dummy driver, so
        // an empty bridge stands in for it.
        &["ip", "link", "add", "eth0", "type", "bridge"],
        &["ip", "link", "set", "eth0", "address", &mac2],
        &["ip", "link", "set", "eth0-nic", "up"],
        &["ip", "link", "set", "tap0", "up"],
        &["ip", "link", "set", "k6t-eth0", "up"],
        &["ip", "link", "set", "eth0", "up"],
    ] {
        let out = pod2.netns().exec(cmd);
        assert!(
            out.status.success(),
            "{cmd:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let guest2 = Guest::start(pod2.netns(), GuestOptions::new("tap0", &mac2));
    let lease2 = guest2.wait_line("TETHER-LEASE4", BOOT_TIMEOUT);
    let l = parse_lease(&lease2);
    assert_eq!(l.get("ip"), Some(&ip2.to_string()), "{lease2}");
    assert_eq!(
        l.get("hostname").map(String::as_str),
        Some("vm2"),
        "{lease2}"
    );
    let out = check_pod(a, &managed, &pod2);
    assert!(out.success(), "CHECK accepts KubeVirt's rewrite: {out}");
    // The node reaches the guest through the in-pod bridge.
    let ping = a.netns().exec(&["ping", "-c1", "-W2", &ip2.to_string()]);
    assert!(
        ping.status.success(),
        "the node reaches the managedTap guest"
    );
}
