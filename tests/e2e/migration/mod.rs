//! KubeVirt live migration end to end: three nodes on etcd or on the
//! Kubernetes store (the tests in `etcd::` and `kubernetes::`), a "VM" that is
//! a pod netns on node A, an observer pod on node C probing it at 2000
//! packets per second, and a migration to node B: the target pod gets the
//! same IP and MAC, the VM stops answering on A and announces itself from
//! B with a RARP, as QEMU does, and the probes' loss window is measured.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use tether_e2e::cluster::{assert_ping_within, ClusterNode, NodeOpts, Pod, Store};
use tether_e2e::migration::{pause_icmp, send_garp, send_rarp, Prober};
use tether_e2e::topology::Topology;
use tether_e2e::vm::{
    active_node, add_vm_pod, alternate_node, cutover, del_vm_pod, get_vm, mac_bytes, release_vm,
    reserve_vm, result_mac, try_add_vm_pod, VmPodSpec,
};
use tether_e2e::{require_root, wait_until};

tether_e2e::on_both_stores!(
    a_vm_keeps_its_address_across_migrations_restarts_and_failures,
    requested_addresses_are_honoured_and_conflicts_name_the_holder,
    a_daemon_restart_in_the_middle_of_a_migration_recovers_it_from_the_store,
    an_ephemeral_vm_address_is_freed_with_its_last_pod,
    the_targets_notice_repoints_the_others_before_the_commit_and_a_refusal_brings_them_back,
);

/// Routes follow the store through a watch: allow for it.
const CONVERGE: Duration = Duration::from_secs(15);
/// The probe interval: 2000 packets per second.
const PROBE_INTERVAL: Duration = Duration::from_micros(500);

fn socket(node: &ClusterNode) -> &std::path::Path {
    node.daemon().socket()
}

/// Pauses the VM on `from` and announces it from `to`'s pod, with probes
/// running from `observer` to `ip`; returns the loss window.
fn migrate(prober: &Prober, from: &Pod, to: &Pod, ip: IpAddr, mac: &str) -> Duration {
    let before = Instant::now();
    // Let the stream settle, then pause the source and announce the target.
    assert!(
        wait_until(Duration::from_secs(5), || prober.received_since(before)
            > 200),
        "probes to {ip} do not get answers before the migration"
    );
    let paused_at = Instant::now();
    pause_icmp(from.netns(), true);
    send_rarp(to.netns(), "eth0", mac_bytes(mac));
    assert!(
        wait_until(Duration::from_secs(5), || prober.received_since(paused_at)
            > 200),
        "probes to {ip} never resumed after the cutover"
    );
    paused_at.elapsed()
}

/// `node`'s next hop for `ip`: "dev" or "dev via gateway".
fn hop(node: &ClusterNode, ip: IpAddr) -> String {
    let out = node
        .netns()
        .exec_ok(&["ip", "-j", "route", "get", &ip.to_string()]);
    let v: serde_json::Value = serde_json::from_str(&out).expect("ip -j route get");
    let dev = v[0]["dev"].as_str().unwrap_or_default();
    match v[0]["gateway"].as_str() {
        Some(gw) => format!("{dev} via {gw}"),
        None => dev.to_string(),
    }
}

/// [`hop`] on `from` toward node `to` (host-gw).
fn toward(from: &ClusterNode, to: &ClusterNode) -> String {
    format!("{} via {}", from.underlay().ifname, to.underlay().v4)
}

fn loss_after(prober: Prober, t: Instant) -> Duration {
    let report = prober.stop();
    let window = report
        .longest_loss_after(t)
        .map_or(Duration::ZERO, |w| w.duration);
    eprintln!("probe report: {report}; loss window after the pause {window:?}");
    window
}

fn a_vm_keeps_its_address_across_migrations_restarts_and_failures(store: Store) {
    require_root();
    let cluster = Topology::tetherd(3).store(store).start();
    let (a, b, c) = (cluster.node(0), cluster.node(1), cluster.node(2));
    let spec = VmPodSpec::new("tenant", "vm1", "virt-launcher-vm1-aaaaa");

    // 1. The VM's first pod, on A.
    let source = add_vm_pod(a, &spec);
    let ip = source.v4().expect("an IPv4 address");
    let ip6 = source.v6().expect("an IPv6 address");
    let mac = result_mac(&source);
    let rec = get_vm(socket(c), "tenant", "vm1").expect("the record is visible from every node");
    assert_eq!(active_node(&rec), a.name());
    assert_eq!(rec.mac, mac);
    assert_eq!(rec.generation, 1);

    // 2. An observer on C, probing the VM.
    let observer = c.add_pod();
    assert_ping_within(observer.netns(), ip, CONVERGE);
    assert_ping_within(observer.netns(), ip6, CONVERGE);

    // 3. The migration target on B: the same IP and MAC, not yet active.
    let target = add_vm_pod(b, &spec.target("virt-launcher-vm1-bbbbb"));
    assert_eq!(
        target.ips(),
        source.ips(),
        "the target gets the VM's addresses"
    );
    assert_eq!(result_mac(&target), mac, "the target gets the VM's MAC");
    let rec = get_vm(socket(a), "tenant", "vm1").unwrap();
    assert_eq!(active_node(&rec), a.name());
    assert_eq!(alternate_node(&rec), b.name());

    // 4-5. The VM stops on A and announces itself on B.
    let prober = Prober::start(observer.netns(), ip, PROBE_INTERVAL);
    let t0 = Instant::now();
    migrate(&prober, &source, &target, ip, &mac);
    let window = loss_after(prober, t0);
    assert!(
        window > Duration::ZERO,
        "no loss at all: the pause did not work"
    );
    assert!(
        window < Duration::from_secs(1),
        "loss window {window:?}: the cutover did not happen promptly"
    );
    let rec = get_vm(socket(c), "tenant", "vm1").unwrap();
    assert_eq!(active_node(&rec), b.name(), "{rec:?}");
    assert_eq!(
        alternate_node(&rec),
        a.name(),
        "the source stays as alternate"
    );
    assert_eq!(rec.last_cutover.as_ref().unwrap().trigger, "rarp");
    let stats = tether_e2e::admin::stats(socket(b));
    assert_eq!(stats.vm_cutovers, 1);
    let last = stats.last_cutover.unwrap();
    assert!(last.local_route_ms > 0.0 && last.committed_ms >= last.local_route_ms);
    // IPv6 follows too.
    assert_ping_within(observer.netns(), ip6, CONVERGE);

    // The source's DEL removes its wiring only; the VM keeps its address.
    assert!(del_vm_pod(a, &spec, &source).success());
    drop(source);
    let rec = get_vm(socket(a), "tenant", "vm1").unwrap();
    assert_eq!(active_node(&rec), b.name());
    assert_eq!(alternate_node(&rec), "");
    assert!(
        observer.ping(ip),
        "the VM answers on B after the source's DEL"
    );
    // A's pool still counts the VM's two addresses as used, though no pod
    // of the VM runs on A: the DEL did not free them.
    assert_eq!(
        tether_e2e::admin::pools_used(socket(a))
            .values()
            .sum::<u64>(),
        2,
        "the source's DEL must not free the VM's addresses"
    );
    // A plain pod on A never gets the VM's address, though it is in A's block.
    let others: Vec<Pod> = (0..4).map(|_| a.add_pod()).collect();
    assert!(others.iter().all(|p| !p.ips().contains(&ip)));

    // Back to A: a new target there, announced with a gratuitous ARP.
    let back = add_vm_pod(a, &spec.target("virt-launcher-vm1-ccccc"));
    assert_eq!(back.ips(), target.ips());
    let prober = Prober::start(observer.netns(), ip, PROBE_INTERVAL);
    let t1 = Instant::now();
    assert!(wait_until(Duration::from_secs(5), || prober
        .received_since(t1)
        > 200));
    pause_icmp(target.netns(), true);
    let IpAddr::V4(ip4) = ip else {
        unreachable!("v4() is IPv4")
    };
    send_garp(back.netns(), "eth0", mac_bytes(&mac), ip4);
    assert!(
        wait_until(Duration::from_secs(5), || {
            get_vm(socket(c), "tenant", "vm1").is_ok_and(|r| active_node(&r) == a.name())
        }),
        "the garp did not move the VM back to A"
    );
    let resumed = Instant::now();
    assert!(wait_until(Duration::from_secs(5), || prober
        .received_since(resumed)
        > 200));
    let window = loss_after(prober, t1);
    assert!(
        window < Duration::from_secs(1),
        "loss window back to A {window:?}"
    );
    assert!(del_vm_pod(b, &spec, &target).success());
    drop(target);

    // A migration whose target is deleted before the cutover leaves the VM
    // on its source.
    let doomed = add_vm_pod(c, &spec.target("virt-launcher-vm1-ddddd"));
    assert_eq!(
        alternate_node(&get_vm(socket(a), "tenant", "vm1").unwrap()),
        c.name()
    );
    assert!(del_vm_pod(c, &spec, &doomed).success());
    drop(doomed);
    let rec = get_vm(socket(a), "tenant", "vm1").unwrap();
    assert_eq!(active_node(&rec), a.name());
    assert_eq!(alternate_node(&rec), "");
    assert!(observer.ping(ip), "the VM still answers on A");

    // A migration that fails after the cutover goes back by an admin call.
    let failed = add_vm_pod(b, &spec.target("virt-launcher-vm1-eeeee"));
    let rec = cutover(socket(c), "tenant", "vm1").expect("admin cutover to B");
    assert_eq!(active_node(&rec), b.name());
    // The "VM" never ran on B: its pod there answers pings for it, so
    // check the record and the routes rather than pings.
    let rec = cutover(socket(c), "tenant", "vm1").expect("admin cutover back to A");
    assert_eq!(active_node(&rec), a.name());
    assert_eq!(rec.last_cutover.as_ref().unwrap().trigger, "admin");
    pause_icmp(failed.netns(), true);
    assert_ping_within(observer.netns(), ip, CONVERGE);
    assert!(del_vm_pod(b, &spec, &failed).success());
    drop(failed);

    // The VM stops (its pod is deleted) and starts again on C: same IP
    // and MAC.
    assert!(del_vm_pod(a, &spec, &back).success());
    drop(back);
    let rec = get_vm(socket(b), "tenant", "vm1").unwrap();
    assert_eq!(active_node(&rec), "", "a stopped VM keeps its record");
    let restarted = add_vm_pod(
        c,
        &VmPodSpec::new("tenant", "vm1", "virt-launcher-vm1-fffff"),
    );
    assert_eq!(restarted.v4(), Some(ip));
    assert_eq!(restarted.v6(), Some(ip6));
    assert_eq!(result_mac(&restarted), mac);
    let pinger = b.add_pod();
    assert_ping_within(pinger.netns(), ip, CONVERGE);
    assert_ping_within(observer.netns(), ip, CONVERGE);

    // ReleaseVm is refused while a pod runs, then frees the address.
    let refused = release_vm(socket(a), "tenant", "vm1", false).unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused}");
    assert!(del_vm_pod(c, &spec, &restarted).success());
    drop(restarted);
    release_vm(socket(a), "tenant", "vm1", false).expect("release");
    assert_eq!(
        get_vm(socket(b), "tenant", "vm1").unwrap_err().code(),
        tonic::Code::NotFound
    );
    // The freed address goes back to A's pool: it can be asked for again.
    assert!(wait_until(CONVERGE, || {
        tether_e2e::admin::pools_used(socket(a))
            .values()
            .sum::<u64>()
            == 2 * 4
    }));
    let again =
        reserve_vm(socket(a), "tenant", "vm2", &[ip], "").expect("the address is free again");
    assert_eq!(again.ips, vec![format!("{ip}/32")]);
    drop(others);
}

/// The blocks a node holds, from GetNode.
fn blocks_of(node: &ClusterNode) -> Vec<ipnet::IpNet> {
    tether_e2e::admin::node(socket(node))
        .blocks
        .iter()
        .map(|b| b.parse().expect("a block"))
        .collect()
}

/// The `n`th address of `node`'s first IPv4 block.
fn nth_v4_of(node: &ClusterNode, n: u32) -> IpAddr {
    let block = blocks_of(node)
        .into_iter()
        .find(|b| b.addr().is_ipv4())
        .expect("an IPv4 block");
    let std::net::IpAddr::V4(base) = block.network() else {
        unreachable!()
    };
    IpAddr::V4((u32::from(base) + n).into())
}

/// ADD of a plain pod on `node` with these CNI_ARGS and netconf changes.
fn try_add_plain(
    node: &ClusterNode,
    args: &str,
    conf: impl FnOnce(&mut serde_json::Value),
) -> (tether_e2e::CniOutput, tether_e2e::Netns) {
    let ns = tether_e2e::Netns::new("req");
    let id = ns.name().to_owned();
    let mut netconf = node.netconf();
    conf(&mut netconf);
    let out = node.call_with("ADD", &ns, &id, &netconf, Some(args));
    (out, ns)
}

fn assert_refused(out: &tether_e2e::CniOutput, code: u64, mentions: &str) {
    assert_eq!(out.error_code(), Some(code), "{out}");
    assert!(
        out.to_string().contains(mentions),
        "the error must name {mentions:?}: {out}"
    );
}

fn requested_addresses_are_honoured_and_conflicts_name_the_holder(store: Store) {
    require_root();
    let cluster = Topology::tetherd(3).store(store).start();
    let (a, b, c) = (cluster.node(0), cluster.node(1), cluster.node(2));

    // A plain pod asking for an address of its node's block (podman's
    // CNI_ARGS IP=/MAC=) gets it.
    let wanted = nth_v4_of(a, 10);
    let (out, _p1) = try_add_plain(
        a,
        &format!("IgnoreUnknown=1;IP={wanted};MAC=0a:00:00:00:00:11"),
        |_| {},
    );
    assert!(out.success(), "{out}");
    let result = out.result();
    assert!(
        result.to_string().contains(&format!("\"{wanted}/32\"")),
        "{result}"
    );
    assert!(result.to_string().contains("0a:00:00:00:00:11"), "{result}");
    // runtimeConfig ips/mac work the same way.
    let wanted2 = nth_v4_of(a, 11);
    let (out, _p2) = try_add_plain(a, "", |c| {
        c["runtimeConfig"] =
            serde_json::json!({"ips": [format!("{wanted2}/26")], "mac": "0a:00:00:00:00:12"});
    });
    assert!(out.success(), "{out}");
    assert!(out
        .result()
        .to_string()
        .contains(&format!("\"{wanted2}/32\"")));

    // The same address again: refused, naming the pod that holds it.
    let (out, _) = try_add_plain(a, &format!("IgnoreUnknown=1;IP={wanted}"), |_| {});
    assert_refused(&out, 105, "is held by attachment");
    // The same MAC again.
    let (out, _) = try_add_plain(a, "IgnoreUnknown=1;MAC=0a:00:00:00:00:11", |_| {});
    assert_refused(&out, 105, "MAC 0a:00:00:00:00:11 is held by attachment");
    // An address of another node's block: refused, naming that node.
    let (out, _) = try_add_plain(
        b,
        &format!("IgnoreUnknown=1;IP={}", nth_v4_of(a, 20)),
        |_| {},
    );
    assert_refused(&out, 106, a.name());
    // Outside the cluster CIDR.
    let (out, _) = try_add_plain(b, "IgnoreUnknown=1;IP=192.0.2.7", |_| {});
    assert_refused(&out, 106, "outside the cluster CIDRs");
    // An address of a block nobody holds: the node claims that block.
    let free_block_ip: IpAddr = "10.244.255.200".parse().unwrap();
    assert!(!blocks_of(a)
        .iter()
        .chain(&blocks_of(b))
        .chain(&blocks_of(c))
        .any(|bl| bl.contains(&free_block_ip)));
    let (out, _p3) = try_add_plain(b, &format!("IgnoreUnknown=1;IP={free_block_ip}"), |_| {});
    assert!(out.success(), "{out}");
    assert!(
        blocks_of(b).iter().any(|bl| bl.contains(&free_block_ip)),
        "B claimed the block"
    );

    // A VM's addresses are refused to anyone else.
    let spec = VmPodSpec::new("tenant", "vm1", "virt-launcher-vm1-aaaaa");
    let vm = add_vm_pod(a, &spec);
    let vm_ip = vm.v4().unwrap();
    let vm_mac = result_mac(&vm);
    let (out, _) = try_add_plain(a, &format!("IgnoreUnknown=1;IP={vm_ip}"), |_| {});
    assert_refused(&out, 105, "tenant/vm1/eth0");
    let (out, _) = try_add_plain(a, &format!("IgnoreUnknown=1;MAC={vm_mac}"), |_| {});
    assert_refused(&out, 105, "VM tenant/vm1/eth0");
    let refused = reserve_vm(socket(a), "tenant", "vm2", &[vm_ip], "").unwrap_err();
    assert_eq!(refused.code(), tonic::Code::AlreadyExists, "{refused}");
    assert!(refused.message().contains("tenant/vm1/eth0"), "{refused}");
    let refused = reserve_vm(socket(a), "tenant", "vm2", &[nth_v4_of(a, 30)], &vm_mac).unwrap_err();
    assert!(refused.message().contains("tenant/vm1/eth0"), "{refused}");
    let refused = reserve_vm(socket(b), "tenant", "vm2", &[nth_v4_of(a, 30)], "").unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused}");
    assert!(refused.message().contains(a.name()), "{refused}");
    // A VM pod asking for another address than its record holds.
    let (out, _ns, _) = try_add_vm_pod(
        b,
        &VmPodSpec {
            extra_args: vec![format!("IP={}", nth_v4_of(a, 31))],
            ..spec.target("virt-launcher-vm1-bbbbb")
        },
    );
    assert_refused(&out, 105, "VM tenant/vm1/eth0 holds");
    let again = get_vm(socket(a), "tenant", "vm1").unwrap();
    assert_eq!(
        alternate_node(&again),
        "",
        "a refused target leaves the record alone"
    );

    // An imported VM: its address and MAC are reserved first, and its first
    // pod, on another node, gets them.
    let imported_ip = nth_v4_of(a, 40);
    let reserved = reserve_vm(
        socket(a),
        "import",
        "legacy",
        &[imported_ip],
        "0a:00:00:00:00:42",
    )
    .expect("reserve");
    assert_eq!(reserved.origin, "reserved");
    assert_eq!(active_node(&reserved), "");
    let imported = add_vm_pod(
        c,
        &VmPodSpec::new("import", "legacy", "virt-launcher-legacy-x"),
    );
    assert_eq!(imported.ips(), &[imported_ip], "only the reserved family");
    assert_eq!(result_mac(&imported), "0a:00:00:00:00:42");
    let observer = b.add_pod();
    assert_ping_within(observer.netns(), imported_ip, CONVERGE);
    // A VM whose first pod asks for its address keeps it.
    let asked = nth_v4_of(a, 41);
    let requested = add_vm_pod(
        a,
        &VmPodSpec {
            extra_args: vec![format!("IP={asked}")],
            ..VmPodSpec::new("tenant", "vm3", "virt-launcher-vm3-x")
        },
    );
    assert_eq!(requested.v4(), Some(asked));
    assert_eq!(
        get_vm(socket(b), "tenant", "vm3").unwrap().origin,
        "requested"
    );
}

fn a_daemon_restart_in_the_middle_of_a_migration_recovers_it_from_the_store(store: Store) {
    require_root();
    let mut cluster = Topology::tetherd(3).store(store).start();
    let spec = VmPodSpec::new("tenant", "vm1", "virt-launcher-vm1-aaaaa");
    let source = add_vm_pod(cluster.node(0), &spec);
    let (ip, mac) = (source.v4().unwrap(), result_mac(&source));
    let observer = cluster.node(2).add_pod();
    assert_ping_within(observer.netns(), ip, CONVERGE);
    let target = add_vm_pod(cluster.node(1), &spec.target("virt-launcher-vm1-bbbbb"));

    // The target's daemon restarts before the cutover: it must listen for
    // the announcement again, from the record alone.
    cluster.node_mut(1).daemon_mut().restart();
    let prober = Prober::start(observer.netns(), ip, PROBE_INTERVAL);
    let t0 = Instant::now();
    migrate(&prober, &source, &target, ip, &mac);
    let window = loss_after(prober, t0);
    assert!(window < Duration::from_secs(1), "loss window {window:?}");
    let (a, b) = (
        cluster.node(0).name().to_owned(),
        cluster.node(1).name().to_owned(),
    );
    let rec = get_vm(socket(cluster.node(2)), "tenant", "vm1").unwrap();
    assert_eq!(active_node(&rec), b);
    assert_eq!(alternate_node(&rec), a);

    // The source's daemon restarts after the cutover: it keeps the route to
    // B, not its own pod's, though the pod is still there.
    cluster.node_mut(0).daemon_mut().restart();
    let vm_routes = cluster.node(0).netns().routes_with_protocol(203);
    assert!(
        vm_routes.iter().any(|r| r["dst"] == ip.to_string()),
        "no VM route on A after its restart: {vm_routes:?}"
    );
    let pinger = cluster.node(0).add_pod();
    assert_ping_within(pinger.netns(), ip, CONVERGE);
    assert!(observer.ping(ip));
    // And its DEL of the source still leaves the address with the VM.
    assert!(del_vm_pod(cluster.node(0), &spec, &source).success());
    assert_eq!(
        active_node(&get_vm(socket(cluster.node(0)), "tenant", "vm1").unwrap()),
        b
    );
}

fn an_ephemeral_vm_address_is_freed_with_its_last_pod(store: Store) {
    require_root();
    let cluster = Topology::tetherd(3).store(store).start();
    let (a, b) = (cluster.node(0), cluster.node(1));
    let spec = VmPodSpec {
        extra_conf: vec![("vmAddressPolicy".into(), serde_json::json!("ephemeral"))],
        ..VmPodSpec::new("tenant", "scratch", "virt-launcher-scratch-a")
    };
    let used_before: u64 = tether_e2e::admin::pools_used(socket(a)).values().sum();
    let first = add_vm_pod(a, &spec);
    // A migration keeps it: the source's DEL is not the last pod's.
    let target = add_vm_pod(b, &spec.target("virt-launcher-scratch-b"));
    send_rarp(target.netns(), "eth0", mac_bytes(&result_mac(&first)));
    assert!(wait_until(CONVERGE, || {
        get_vm(socket(a), "tenant", "scratch").is_ok_and(|r| active_node(&r) == b.name())
    }));
    assert!(del_vm_pod(a, &spec, &first).success());
    assert!(
        get_vm(socket(a), "tenant", "scratch").is_ok(),
        "not the last pod"
    );
    // The last pod's DEL frees it, and A's pool gets the addresses back.
    assert!(del_vm_pod(b, &spec, &target).success());
    assert_eq!(
        get_vm(socket(a), "tenant", "scratch").unwrap_err().code(),
        tonic::Code::NotFound
    );
    assert!(wait_until(CONVERGE, || {
        tether_e2e::admin::pools_used(socket(a))
            .values()
            .sum::<u64>()
            == used_before
    }));
}

/// One node with the embedded store (`--pod-cidr`): VM records live in the
/// state dir's control-plane file, and a VM stopped and started again keeps
/// its address, across a daemon restart too.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn a_single_node_keeps_vm_addresses_in_the_embedded_store() {
    require_root();
    let mut daemon = tether_e2e::Daemon::start(tether_e2e::DaemonOpts {
        pod_cidrs: vec!["10.83.0.0/24".into(), "fd00:83::/120".into()],
        ..Default::default()
    });
    let spec = VmPodSpec::new("tenant", "solo", "virt-launcher-solo-a");
    let vm_conf = |d: &tether_e2e::Daemon| {
        let mut conf = d.netconf("1.1.0", "single");
        conf["runtimeConfig"] = serde_json::json!({
            "io.kubernetes.cri.pod-annotations": {"kubevirt.io/domain": "solo"}
        });
        conf
    };
    let run = |d: &tether_e2e::Daemon, verb: &str, ns: &tether_e2e::Netns| {
        let mut env = tether_e2e::CniEnv::new(verb, ns.name(), ns);
        env.args = Some(spec.args(ns.name()));
        let stdin = serde_json::to_vec(&vm_conf(d)).unwrap();
        tether_e2e::cni(&tether_e2e::tether_bin(), &env, &stdin)
    };
    let first = tether_e2e::Netns::new("vm");
    let out = run(&daemon, "ADD", &first);
    assert!(out.success(), "{out}");
    let addresses = out.result()["ips"].clone();
    assert!(run(&daemon, "DEL", &first).success());
    assert!(
        get_vm(daemon.socket(), "tenant", "solo").is_ok(),
        "the record outlives the pod"
    );
    daemon.restart();
    let second = tether_e2e::Netns::new("vm");
    let out = run(&daemon, "ADD", &second);
    assert!(out.success(), "{out}");
    assert_eq!(
        out.result()["ips"],
        addresses,
        "the same addresses after a stop, a restart and a start"
    );
    assert!(run(&daemon, "DEL", &second).success());
    release_vm(daemon.socket(), "tenant", "solo", false).expect("release");
    assert!(daemon.state_dir().join("control-plane.json").exists());
}

/// The target's cutover notice (UDP to the other nodes, sent the moment the
/// VM announces itself) repoints them before the record's write lands; the
/// write is held back here (the nodes run `tetherd_with_delays`, which
/// holds the control store's writes while a file exists) while the
/// target's pod is deleted, so the record refuses the promotion, and the
/// nodes that followed the notice must route back to the source at once,
/// long before the notice would lapse.
fn the_targets_notice_repoints_the_others_before_the_commit_and_a_refusal_brings_them_back(
    store: Store,
) {
    require_root();
    const HOLD_MS: u64 = 3000;
    let hold_dir = tether_e2e::TempDir::new("hold");
    let holding = hold_dir.path().join("hold-writes");
    let cluster = Topology::tetherd(3)
        .store(store)
        .node(NodeOpts {
            bin: Some(env!("CARGO_BIN_EXE_tetherd_with_delays").into()),
            extra_args: vec![
                "--hold-writes-while".into(),
                holding.display().to_string(),
                "--hold-writes-ms".into(),
                HOLD_MS.to_string(),
            ],
            ..NodeOpts::default()
        })
        .start();
    let (a, b, c) = (cluster.node(0), cluster.node(1), cluster.node(2));
    let spec = VmPodSpec::new("tenant", "vm1", "virt-launcher-vm1-aaaaa");
    let source = add_vm_pod(a, &spec);
    let ip = source.v4().expect("an IPv4 address");
    let mac = result_mac(&source);
    let observer = c.add_pod();
    assert_ping_within(observer.netns(), ip, CONVERGE);
    let target = add_vm_pod(b, &spec.target("virt-launcher-vm1-bbbbb"));
    let generation = get_vm(socket(a), "tenant", "vm1").unwrap().generation;
    assert_eq!(hop(c, ip), toward(c, a));

    // The VM announces itself on B: C and A follow B's notice while B's
    // write is held.
    std::fs::write(&holding, b"").expect("the hold's file");
    let t0 = Instant::now();
    send_rarp(target.netns(), "eth0", mac_bytes(&mac));
    assert!(
        wait_until(Duration::from_millis(HOLD_MS / 2), || hop(c, ip)
            == toward(c, b)
            && hop(a, ip) == toward(a, b)),
        "the notice did not repoint C and A: C {}, A {}",
        hop(c, ip),
        hop(a, ip)
    );
    let repointed = t0.elapsed();
    let rec = get_vm(socket(c), "tenant", "vm1").unwrap();
    assert_eq!(
        (active_node(&rec), rec.generation),
        (a.name(), generation),
        "repointed before the record changed: by the notice"
    );
    eprintln!("RARP → C and A repointed by B's notice: {repointed:?} (record unchanged)");

    // The target's pod goes away before B's write: the record refuses it,
    // and C and A come back to A at once. (The writes begun from now on
    // go through at once: the DEL's among them.)
    std::fs::remove_file(&holding).expect("the hold's file");
    assert!(del_vm_pod(b, &spec, &target).success());
    drop(target);
    let t1 = Instant::now();
    assert!(
        wait_until(Duration::from_secs(2), || hop(c, ip) == toward(c, a)
            && hop(a, ip) != toward(a, b)),
        "C and A still route to B after the record refused: C {}, A {}",
        hop(c, ip),
        hop(a, ip)
    );
    eprintln!("the refusal → C and A back to A: {:?}", t1.elapsed());
    // After the held write, too: B's retraction, the record unchanged.
    std::thread::sleep(Duration::from_millis(HOLD_MS));
    let rec = get_vm(socket(c), "tenant", "vm1").unwrap();
    assert_eq!(active_node(&rec), a.name());
    assert_eq!(alternate_node(&rec), "");
    assert_eq!(hop(c, ip), toward(c, a));
    assert!(observer.ping(ip), "the VM answers on A");
    assert_eq!(tether_e2e::admin::stats(socket(b)).vm_cutovers, 0);
}

/// The routes tether programs, one line each (`ip route show proto
/// <proto>`, IPv4 and IPv6), sorted.
fn routes_of(node: &ClusterNode, proto: &str) -> Vec<String> {
    let mut lines: Vec<String> = ["-4", "-6"]
        .iter()
        .flat_map(|family| {
            node.netns()
                .exec_ok(&["ip", family, "route", "show", "proto", proto])
                .lines()
                .map(|l| l.trim().to_owned())
                .filter(|l| !l.is_empty())
                .collect::<Vec<_>>()
        })
        .collect();
    lines.sort();
    lines
}

/// Routes changed under tether come back with the periodic repair
/// (`--route-repair-interval`, 2 s here; 60 s by default): a VM's route to
/// the node it moved to (proto 203) and a route to another node's block
/// (proto 202), deleted by hand on a node where nothing else changes.
/// Between repairs, a pass changes only the routes of the VMs whose
/// records changed, without reading the kernel back (the route manager's
/// unit test shows that).
#[test]
#[cfg_attr(
    not(feature = "cluster-tests"),
    ignore = "cluster tier: root, etcd and kube-apiserver; `make test` runs it"
)]
fn routes_deleted_by_hand_come_back_with_the_periodic_repair() {
    require_root();
    let cluster = Topology::tetherd(2)
        .store(Store::Etcd)
        .node(NodeOpts {
            extra_args: vec!["--route-repair-interval".into(), "2".into()],
            ..NodeOpts::default()
        })
        .start();
    let (a, b) = (cluster.node(0), cluster.node(1));
    // A VM of A's block runs on B: A routes its addresses via B.
    let spec = VmPodSpec::new("tenant", "vm1", "virt-launcher-vm1-aaaaa");
    let source = add_vm_pod(a, &spec);
    let _target = add_vm_pod(b, &spec.target("virt-launcher-vm1-bbbbb"));
    cutover(socket(b), "tenant", "vm1").expect("admin cutover to B");
    let ip = source.v4().expect("an IPv4 address");
    assert!(
        wait_until(CONVERGE, || hop(a, ip) == toward(a, b)),
        "A does not route the VM via B: {}",
        hop(a, ip)
    );
    let vm_routes = routes_of(a, "203");
    let block_routes = routes_of(a, "202");
    assert_eq!(vm_routes.len(), 2, "one per family: {vm_routes:?}");
    assert!(!block_routes.is_empty(), "A routes B's blocks");

    // By hand: every VM route and every block route of A goes.
    for line in vm_routes.iter().chain(&block_routes) {
        let family = if line.contains(':') { "-6" } else { "-4" };
        let dst = line.split_whitespace().next().unwrap_or_default();
        a.netns().exec_ok(&["ip", family, "route", "del", dst]);
    }
    assert!(routes_of(a, "203").is_empty() && routes_of(a, "202").is_empty());

    // The repair puts them back, as they were.
    assert!(
        wait_until(CONVERGE, || routes_of(a, "203") == vm_routes
            && routes_of(a, "202") == block_routes),
        "A's routes did not come back: VM {:?} (was {vm_routes:?}), blocks {:?} (was {block_routes:?})",
        routes_of(a, "203"),
        routes_of(a, "202")
    );
    assert_eq!(hop(a, ip), toward(a, b));
}
