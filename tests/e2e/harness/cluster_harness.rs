//! Self-tests of the cluster topology harness (`tether_e2e::cluster`): the
//! fabric, a real 3-member etcd cluster with member faults and a full
//! restart, node netns reaching each other and etcd, pods added through the
//! real plugin pinging across the fabric, and cleanup, also on panic.
//!
//! All but the last test hold with a tetherd that has no cluster mode yet.
//! Run as root.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use tether_e2e::cluster::{
    assert_ping_within, ping, EtcdCluster, Fabric, NodeOpts, ETCD_CLIENT_PORT, GATEWAY_V4,
    GATEWAY_V6,
};
use tether_e2e::topology::Topology;
use tether_e2e::{require_root, run_prefix, Netns};

/// Routes between pods may take a moment; a working path answers at once.
const PING_WITHIN: Duration = Duration::from_secs(10);

fn netns_names() -> BTreeSet<String> {
    let out = Command::new("ip").args(["netns", "list"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect()
}

/// Panics naming those of `names` that are still listed.
fn assert_netns_gone(names: &[String]) {
    let listed = netns_names();
    let left: Vec<&String> = names.iter().filter(|n| listed.contains(*n)).collect();
    assert!(left.is_empty(), "netns left behind: {left:?}");
}

fn assert_pids_gone(pids: &[u32]) {
    for pid in pids {
        // Reaped children: /proc has no entry (PIDs are not reused this fast).
        let path = PathBuf::from(format!("/proc/{pid}"));
        assert!(!path.exists(), "process {pid} still exists");
    }
}

/// No link of ours ever appears in the machine's own netns.
fn assert_root_netns_untouched() {
    let out = Command::new("ip")
        .args(["-o", "link", "show"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        !text.contains(run_prefix()),
        "a link named {}* is in the machine's netns:\n{text}",
        run_prefix()
    );
}

fn key(tag: &str) -> String {
    format!("/harness/{}/{tag}", run_prefix())
}

/// etcd: start healthy; put/get; a killed member (the leader) does not stop
/// writes; the member comes back; a full stop and start keeps the data.
#[cfg_attr(
    not(feature = "cluster-tests"),
    ignore = "cluster tier: root, etcd and kube-apiserver; `make test` runs it"
)]
#[test]
fn etcd_cluster_survives_a_member_loss_and_a_full_restart() {
    require_root();
    let fabric = Fabric::new();
    let test_start = Instant::now();
    let started = Instant::now();
    let mut etcd = EtcdCluster::start(&fabric, 3);
    eprintln!("timing: 3-member etcd healthy in {:?}", started.elapsed());
    let names = [
        fabric.netns().name().to_owned(),
        etcd.control().name().to_owned(),
    ];
    let dir = etcd.dir().to_path_buf();

    assert_eq!(etcd.member_count(), 3);
    assert!(etcd.is_healthy());
    let eps = etcd.endpoints();
    assert_eq!(
        eps,
        "http://10.77.0.11:2379,http://10.77.0.12:2379,http://10.77.0.13:2379"
    );
    // Each member runs in the control netns, not in ours.
    let control_ns = etcd
        .control()
        .run(|| std::fs::read_link("/proc/thread-self/ns/net").unwrap());
    for i in 0..3 {
        let pid = etcd.member_pid(i).unwrap();
        let theirs = std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap();
        assert_eq!(theirs, control_ns, "member {i}");
    }
    // All three are one cluster.
    let list = etcd.etcdctl_ok(&["member", "list"]);
    assert_eq!(list.lines().count(), 3, "{list}");

    let t = Instant::now();
    etcd.put(&key("a"), "1");
    eprintln!("timing: one etcdctl put in {:?}", t.elapsed());
    assert_eq!(etcd.get(&key("a")).as_deref(), Some("1"));
    assert_eq!(etcd.get(&key("missing")), None);
    etcd.put(&key("b"), "2");
    let under = etcd.get_prefix(&format!("/harness/{}/", run_prefix()));
    assert_eq!(under.len(), 2, "{under:?}");

    // Lose the leader: a new one is elected and writes go on.
    let leader = etcd.leader().expect("a leader");
    let pids: Vec<u32> = (0..3).map(|i| etcd.member_pid(i).unwrap()).collect();
    let t = Instant::now();
    etcd.kill_member(leader);
    assert!(!etcd.is_running(leader));
    etcd.wait_healthy();
    eprintln!(
        "timing: new leader after killing the leader in {:?}",
        t.elapsed()
    );
    let t = Instant::now();
    etcd.put(&key("c"), "3");
    eprintln!("timing: a put with one member down in {:?}", t.elapsed());
    assert_eq!(etcd.get(&key("c")).as_deref(), Some("3"));
    assert!(etcd.is_healthy(), "the two others are a quorum");
    let new_leader = etcd.leader().expect("a new leader");
    assert_ne!(new_leader, leader);

    let t = Instant::now();
    etcd.start_member(leader);
    eprintln!(
        "timing: killed member back and healthy in {:?}",
        t.elapsed()
    );
    assert!(etcd.is_healthy());
    // It caught up with the write it missed.
    let out = etcd.etcdctl_in(
        etcd.control(),
        &[
            &format!("--endpoints={}", etcd.endpoint(leader)),
            "get",
            "--print-value-only",
            &key("c"),
        ],
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "3");

    // Everything down: no quorum, writes fail quickly.
    let t = Instant::now();
    etcd.stop_all();
    eprintln!("timing: stop_all (SIGTERM) in {:?}", t.elapsed());
    assert!((0..3).all(|i| !etcd.is_running(i)));
    assert!(!etcd.is_healthy());
    let t = Instant::now();
    let out = etcd.etcdctl(&["--command-timeout=1s", "put", &key("d"), "4"]);
    assert!(!out.status.success(), "a put with etcd down succeeded");
    eprintln!("timing: a put with etcd down failed in {:?}", t.elapsed());
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());

    let t = Instant::now();
    etcd.start_all();
    eprintln!("timing: full restart healthy in {:?}", t.elapsed());
    assert!(etcd.is_healthy());
    assert_eq!(etcd.get(&key("a")).as_deref(), Some("1"));
    assert_eq!(etcd.get(&key("c")).as_deref(), Some("3"));
    assert_eq!(etcd.get(&key("d")), None);
    // Same members, same data dirs: still one cluster of three.
    let list = etcd.etcdctl_ok(&["member", "list"]);
    assert_eq!(list.lines().count(), 3, "{list}");
    assert!(etcd.log(0).contains("m0"));

    let pids: Vec<u32> = pids
        .into_iter()
        .chain((0..3).map(|i| etcd.member_pid(i).unwrap()))
        .collect();
    let t = Instant::now();
    drop(etcd);
    drop(fabric);
    eprintln!("timing: teardown in {:?}", t.elapsed());
    assert_netns_gone(&names);
    assert_pids_gone(&pids);
    assert!(!dir.exists(), "{} left behind", dir.display());
    eprintln!("timing: whole etcd test in {:?}", test_start.elapsed());
}

/// Node netns on the fabric: addresses, default routes, ping in both
/// families to each other and to the gateway, and etcd reachable from them.
#[cfg_attr(
    not(feature = "cluster-tests"),
    ignore = "cluster tier: root, etcd and kube-apiserver; `make test` runs it"
)]
#[test]
fn node_netns_reach_each_other_and_etcd_over_the_fabric() {
    require_root();
    let fabric = Fabric::new();
    let etcd = EtcdCluster::start(&fabric, 3);
    let nodes: Vec<Netns> = (0..3).map(|_| Netns::new("node")).collect();
    let underlays: Vec<_> = nodes
        .iter()
        .enumerate()
        // The third past the first 256 hosts: in the /16's second 256, as a
        // scale run's 300th node is.
        .map(|(i, ns)| fabric.attach_host(ns, [21, 22, 300][i]))
        .collect();

    for (ns, u) in nodes.iter().zip(&underlays) {
        let addrs = ns.addrs_of(&u.ifname);
        assert!(addrs.contains(&format!("{}/16", u.v4)), "{addrs:?}");
        assert!(addrs.contains(&format!("{}/64", u.v6)), "{addrs:?}");
        // The default route the daemon's node-IP detection follows.
        let out = ns.exec_ok(&["ip", "-4", "route", "get", "192.0.2.1"]);
        assert!(out.contains(&format!("dev {}", u.ifname)), "{out}");
        assert!(out.contains(&format!("src {}", u.v4)), "{out}");
        let out = ns.exec_ok(&["ip", "-6", "route", "get", "2001:db8::1"]);
        assert!(out.contains(&format!("src {}", u.v6)), "{out}");
        assert!(ping(ns, IpAddr::V4(GATEWAY_V4)));
        assert!(ping(ns, IpAddr::V6(GATEWAY_V6)));
    }
    assert_eq!(underlays[1].v4.to_string(), "10.77.0.22");
    assert_eq!(underlays[1].v6.to_string(), "fd00:77:ff::22");
    assert_eq!(underlays[2].v4.to_string(), "10.77.1.44");
    assert_eq!(underlays[2].v6.to_string(), "fd00:77:ff::300");

    for (i, from) in nodes.iter().enumerate() {
        for (j, to) in underlays.iter().enumerate() {
            if i != j {
                assert!(ping(from, IpAddr::V4(to.v4)), "node {i} -> {}", to.v4);
                assert!(ping(from, IpAddr::V6(to.v6)), "node {i} -> {}", to.v6);
            }
        }
    }

    // etcd from a node: a TCP connect to every member, and etcdctl.
    for i in 0..3 {
        let addr = SocketAddr::new(IpAddr::V4(etcd.member_ip(i)), ETCD_CLIENT_PORT);
        let connected =
            nodes[0].run(|| TcpStream::connect_timeout(&addr, Duration::from_secs(2)).is_ok());
        assert!(connected, "no TCP to {addr} from {}", nodes[0].name());
    }
    let out = etcd.etcdctl_in(&nodes[2], &["endpoint", "health"]);
    assert!(
        out.status.success(),
        "etcd from a node:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stderr)
            .matches("is healthy")
            .count(),
        3,
        "{out:?}"
    );
    // ... and not from the machine's own netns: none of it is there.
    assert_root_netns_untouched();
    let root_route = Command::new("ip")
        .args(["-4", "route", "show", "10.77.0.0/16"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&root_route.stdout)
        .trim()
        .is_empty());

    let mut names: Vec<String> = nodes.iter().map(|n| n.name().to_owned()).collect();
    names.push(fabric.netns().name().to_owned());
    names.push(etcd.control().name().to_owned());
    drop(nodes);
    drop(etcd);
    drop(fabric);
    assert_netns_gone(&names);
}

/// `Cluster` with the daemons in single-node mode (a `--pod-cidr` each),
/// which works with any tetherd: pods added through the real plugin on two
/// nodes ping each other across the fabric once each node routes the
/// other's pod CIDR via its underlay address.
#[cfg_attr(
    not(feature = "cluster-tests"),
    ignore = "cluster tier: root, etcd and kube-apiserver; `make test` runs it"
)]
#[test]
fn pods_on_two_nodes_ping_across_the_fabric() {
    require_root();
    let started = Instant::now();
    let mut cluster = Topology::tetherd(0).etcd_members(1).start();
    let cidrs = [
        ["10.244.1.0/24", "fd00:10:244:1::/120"],
        ["10.244.2.0/24", "fd00:10:244:2::/120"],
    ];
    for pair in &cidrs {
        cluster.add_node_with(&NodeOpts {
            pod_cidrs: pair.map(str::to_owned).to_vec(),
            ..NodeOpts::default()
        });
    }
    eprintln!(
        "timing: fabric + 1-member etcd + 2 nodes in {:?}",
        started.elapsed()
    );
    let [a, b] = [cluster.node(0), cluster.node(1)];
    assert!(a.name().starts_with(run_prefix()));
    assert_eq!(a.underlay().v4.to_string(), "10.77.0.21");
    assert_eq!(b.underlay().v4.to_string(), "10.77.0.22");
    // What a cluster-mode daemon will do, by hand: the other's CIDRs via it.
    for (node, other, [v4, v6]) in [(a, b, cidrs[1]), (b, a, cidrs[0])] {
        let (gw4, gw6) = (
            other.underlay().v4.to_string(),
            other.underlay().v6.to_string(),
        );
        node.netns()
            .exec_ok(&["ip", "route", "add", v4, "via", &gw4]);
        node.netns()
            .exec_ok(&["ip", "-6", "route", "add", v6, "via", &gw6]);
    }

    let t = Instant::now();
    let pa = cluster.add_pod(0);
    let pb = cluster.add_pod(1);
    eprintln!("timing: two pod ADDs in {:?}", t.elapsed());
    assert_eq!(pa.node(), a.name());
    assert_eq!(pa.ips().len(), 2, "{}", pa.result());
    assert!(pa.v4().unwrap().to_string().starts_with("10.244.1."));
    assert!(pb.v6().unwrap().to_string().starts_with("fd00:10:244:2::"));
    assert_eq!(
        a.daemon().attachment_ids(),
        BTreeSet::from([pa.id().to_owned()])
    );

    for (from, to) in [(&pa, &pb), (&pb, &pa)] {
        for ip in to.ips() {
            assert_ping_within(from.netns(), *ip, PING_WITHIN);
        }
    }
    // No cluster routes: these daemons run without cluster mode.
    assert!(a.cluster_routes().is_empty());
    // A pod on a node without a route to it is not reachable.
    let c = cluster.add_node_with(&NodeOpts {
        pod_cidrs: vec!["10.244.3.0/24".into()],
        ..NodeOpts::default()
    });
    let pc = cluster.add_pod(c);
    assert!(!pa.ping(pc.v4().unwrap()));

    let out = cluster.node(0).del(&pa);
    assert!(out.success(), "{out}");
    assert!(cluster.node(0).daemon().attachment_ids().is_empty());

    let removed = cluster.remove_node(1);
    let removed_name = removed.name().to_owned();
    drop(removed);
    assert_netns_gone(std::slice::from_ref(&removed_name));
    assert_eq!(cluster.nodes().len(), 2);

    let mut names: Vec<String> = cluster
        .nodes()
        .iter()
        .map(|n| n.name().to_owned())
        .collect();
    names.push(cluster.fabric().netns().name().to_owned());
    names.push(cluster.etcd().control().name().to_owned());
    names.extend([&pa, &pb, &pc].map(|p| p.netns().name().to_owned()));
    let pids: Vec<u32> = cluster
        .nodes()
        .iter()
        .filter_map(|n| n.daemon().pid())
        .chain(cluster.etcd().member_pid(0))
        .collect();
    drop((pa, pb, pc));
    drop(cluster);
    assert_netns_gone(&names);
    assert_pids_gone(&pids);
}

/// A panic with a fabric and etcd alive leaves no netns, process or dir.
#[cfg_attr(
    not(feature = "cluster-tests"),
    ignore = "cluster tier: root, etcd and kube-apiserver; `make test` runs it"
)]
#[test]
fn everything_is_cleaned_up_when_a_test_panics() {
    require_root();
    let (tx, rx) = std::sync::mpsc::channel();
    let result = std::thread::spawn(move || {
        let fabric = Fabric::new();
        let etcd = EtcdCluster::start(&fabric, 3);
        let node = Netns::new("node");
        fabric.attach_host(&node, 21);
        let names = vec![
            fabric.netns().name().to_owned(),
            etcd.control().name().to_owned(),
            node.name().to_owned(),
        ];
        let pids: Vec<u32> = (0..3).map(|i| etcd.member_pid(i).unwrap()).collect();
        tx.send((names, pids, etcd.dir().to_path_buf())).unwrap();
        panic!("a failing cluster test");
    })
    .join();
    assert!(result.is_err());
    let (names, pids, dir) = rx.recv().unwrap();
    assert_netns_gone(&names);
    assert_pids_gone(&pids);
    assert!(!dir.exists(), "{} left behind", dir.display());
}
