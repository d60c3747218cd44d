//! tether as another plugin's IPAM: Debian's real `macvlan` and `bridge`
//! plugins (containernetworking-plugins 1.1.1) exec `tether` as their
//! `ipam.type`, and tether answers with addresses of a named pool
//! (`--pools`) without creating any interface.
//!
//! - one node (embedded store): the interfaces are really addressed with
//!   the pool's prefix, gateway and routes; pods ping each other; CHECK
//!   passes through the main plugin; an excluded address is refused with
//!   109; DEL releases; GC, sent straight to tether (Debian's plugins 1.1.1
//!   predate the GC verb), releases orphans; SIGHUP reloads the pools file
//!   without taking a held address away; the admin API's ListPools and
//!   GetPool show it all;
//! - two nodes on etcd or on the Kubernetes store: each claims its own
//!   blocks of one pool, and their macvlan pods, on the test fabric, ping
//!   each other.
//!
//! This kernel has no ipvlan module, so Debian's `ipvlan` plugin cannot run
//! here; it calls its IPAM exactly as macvlan does.
//!
//! Run as root, after `tests/setup.sh`.

use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use ipnet::IpNet;
use serde_json::{json, Value};
use tether_e2e::cluster::{assert_ping_within, NodeOpts, Store};
use tether_e2e::topology::Topology;
use tether_e2e::{
    admin, cni, pb, ref_plugin, require_root, tether_bin, CniEnv, CniOutput, Daemon, DaemonOpts,
    Netns, TempDir,
};

/// The daemon's own pod CIDR; the pools below must not overlap it.
const POD_CIDR: &str = "10.252.0.0/24";

/// The pools of the tests, inside test netns only.
const POOLS: &str = r#"{"pools": [
  {"name": "mig", "cidr": "10.253.0.0/24", "rangeStart": "10.253.0.10",
   "exclude": ["10.253.0.20/30", "10.253.0.50"], "gateway": "10.253.0.1",
   "routes": [{"dst": "10.254.0.0/16"}], "dns": {"nameservers": ["10.253.0.53"]}},
  {"name": "lan", "cidr": "10.253.1.0/24", "gateway": "10.253.1.1", "blockSize": 28}
]}"#;

/// A plugin dir as a runtime's CNI_PATH: Debian's macvlan and bridge, and
/// the tether shim under the name `tether`, which is how the main plugins
/// find it (`ipam.type`).
fn plugin_dir() -> TempDir {
    let dir = TempDir::new("plg");
    for p in ["macvlan", "bridge"] {
        std::os::unix::fs::symlink(ref_plugin(p), dir.path().join(p))
            .unwrap_or_else(|e| panic!("linking {p}: {e}"));
    }
    std::os::unix::fs::symlink(tether_bin(), dir.path().join("tether"))
        .unwrap_or_else(|e| panic!("linking tether: {e}"));
    dir
}

fn pools_file(dir: &TempDir, text: &str) -> String {
    let path = dir.path().join("pools.json");
    std::fs::write(&path, text).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    path.display().to_string()
}

/// A macvlan network on `master` whose IPAM is tether's pool `pool`.
fn macvlan_conf(daemon: &Daemon, name: &str, master: &str, pool: &str) -> Value {
    json!({
        "cniVersion": "1.0.0", "name": name, "type": "macvlan",
        "master": master, "mode": "bridge",
        "ipam": {"type": "tether", "pool": pool, "socket": daemon.socket()}
    })
}

/// One call of the main plugin `conf.type`, run in the node netns as a
/// runtime runs it, for `pod` (its name the container ID) with ifname
/// net1.
fn call(
    node: &Netns,
    plugins: &Path,
    command: &str,
    conf: &Value,
    pod: &Netns,
    args: Option<&str>,
) -> CniOutput {
    let bin = plugins.join(conf["type"].as_str().expect("a type"));
    call_bin(node, plugins, &bin, command, conf, pod.name(), pod, args)
}

/// One call of `bin`, run in the node netns as a runtime runs it, for
/// `id` with ifname net1.
#[allow(clippy::too_many_arguments)]
fn call_bin(
    node: &Netns,
    plugins: &Path,
    bin: &Path,
    command: &str,
    conf: &Value,
    id: &str,
    pod: &Netns,
    args: Option<&str>,
) -> CniOutput {
    let mut env = CniEnv::new(command, id, pod);
    env.ifname = Some("net1".into());
    env.path = Some(plugins.display().to_string());
    env.args = args.map(str::to_owned);
    let stdin = serde_json::to_vec(conf).expect("JSON");
    node.run(|| cni(bin, &env, &stdin))
}

/// The first address of a result, and its prefix.
fn first(result: &Value) -> IpNet {
    result["ips"][0]["address"]
        .as_str()
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no address in {result}"))
}

/// The addresses on the pod's net1, without the IPv6 link-local one the
/// kernel adds.
fn addrs(pod: &Netns) -> Vec<String> {
    pod.addrs_of("net1")
        .into_iter()
        .filter(|a| !a.starts_with("fe80:"))
        .collect()
}

fn list_pools(daemon: &Daemon) -> Vec<pb::NamedPool> {
    admin(daemon.socket(), |mut c| async move {
        c.list_pools(pb::ListPoolsRequest::default()).await
    })
    .pools
}

fn get_pool(daemon: &Daemon, name: &str) -> pb::NamedPool {
    let name = name.to_owned();
    admin(daemon.socket(), |mut c| async move {
        c.get_pool(pb::GetPoolRequest { name }).await
    })
}

fn used(daemon: &Daemon, pool: &str) -> u64 {
    list_pools(daemon)
        .iter()
        .find(|p| p.name == pool)
        .map_or(0, |p| p.used)
}

/// A veth pair in `node`, both ends up: `<name>` is a macvlan master whose
/// other end keeps its carrier on.
fn master(node: &Netns, name: &str) {
    let peer = format!("{name}p");
    node.exec_ok(&[
        "ip", "link", "add", name, "type", "veth", "peer", "name", &peer,
    ]);
    node.exec_ok(&["ip", "link", "set", name, "up"]);
    node.exec_ok(&["ip", "link", "set", &peer, "up"]);
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn macvlan_and_bridge_take_their_addresses_from_tether() {
    require_root();
    let files = TempDir::new("pools");
    let pools = pools_file(&files, POOLS);
    let mut daemon = Daemon::start(DaemonOpts {
        pod_cidrs: vec![POD_CIDR.into()],
        extra_args: vec!["--pools".into(), pools.clone()],
        ..Default::default()
    });
    let plugins = plugin_dir();
    let m0 = tether_e2e::unique_name("m");
    master(daemon.node(), &m0);
    let mig = macvlan_conf(&daemon, "mig", &m0, "mig");

    // Two macvlan pods: addressed from the pool, with its prefix, gateway
    // and routes, and they reach each other.
    let pods: Vec<Netns> = (0..2).map(|_| Netns::new("pod")).collect();
    let mut results = Vec::new();
    for pod in &pods {
        let out = call(daemon.node(), plugins.path(), "ADD", &mig, pod, None);
        let r = out.result().clone();
        let addr = first(&r);
        assert_eq!(addr.prefix_len(), 24, "{r}");
        assert!(
            addr.addr() >= "10.253.0.10".parse::<IpAddr>().expect("ip"),
            "{r}"
        );
        assert_eq!(r["ips"][0]["gateway"], "10.253.0.1", "{r}");
        // macvlan 1.1.1 replaces the IPAM's dns with its own netconf's
        // (empty here): the pool's dns is checked in the unit tests.
        // macvlan made the interface and put the address on it.
        assert_eq!(addrs(pod), [addr.to_string()], "{r}");
        let routes = pod.routes(tether_e2e::Family::V4);
        assert!(
            routes
                .iter()
                .any(|rt| rt["dst"] == "10.254.0.0/16" && rt["gateway"] == "10.253.0.1"),
            "the pool's route is missing: {routes:?}"
        );
        results.push(r);
    }
    let a = first(&results[0]).addr();
    let b = first(&results[1]).addr();
    assert_ne!(a, b);
    assert_ping_within(&pods[0], b, Duration::from_secs(5));
    assert_ping_within(&pods[1], a, Duration::from_secs(5));
    assert_eq!(used(&daemon, "mig"), 2);
    let held: Vec<pb::Attachment> = daemon
        .attachments()
        .into_iter()
        .filter(|x| x.network == "mig")
        .collect();
    assert_eq!(held.len(), 2);
    assert!(held
        .iter()
        .all(|x| x.ipam_only && x.host_interface.is_empty() && x.pools == ["mig"]));

    // CHECK through macvlan, which passes it to its IPAM.
    let mut with_prev = mig.clone();
    with_prev["prevResult"] = results[0].clone();
    call(
        daemon.node(),
        plugins.path(),
        "CHECK",
        &with_prev,
        &pods[0],
        None,
    )
    .assert_success();

    // An excluded address, asked for through CNI_ARGS, is refused with 109
    // and nothing is held.
    let extra = Netns::new("pod");
    // ADD of `extra` asking for `ip`.
    let add_extra = |ip: &str| {
        let args = format!("IgnoreUnknown=1;IP={ip}");
        call(
            daemon.node(),
            plugins.path(),
            "ADD",
            &mig,
            &extra,
            Some(&args),
        )
    };
    let out = add_extra("10.253.0.21");
    assert_eq!(out.error_code(), Some(109), "{out}");
    assert!(out.stdout.contains("excluded"), "{out}");
    assert_eq!(used(&daemon, "mig"), 2);
    // macvlan 1.1.1 leaves its link behind when its IPAM fails (its
    // cleanup checks a shadowed error); the runtime's DEL, which follows a
    // failed ADD, removes it, and tether's part of that DEL is a no-op.
    call(daemon.node(), plugins.path(), "DEL", &mig, &extra, None).assert_success();
    assert!(!extra.has_link("net1"));
    assert_eq!(used(&daemon, "mig"), 2);
    // An allowed one is given.
    let out = add_extra("10.253.0.77");
    assert_eq!(first(out.result()).addr().to_string(), "10.253.0.77");

    // bridge with tether as IPAM: isGateway puts the pool's gateway on the
    // bridge, the pods reach it and each other.
    let br = tether_e2e::unique_name("b");
    let lan = json!({
        "cniVersion": "1.0.0", "name": "lan", "type": "bridge", "bridge": br,
        "isGateway": true,
        "ipam": {"type": "tether", "pool": "lan", "socket": daemon.socket()}
    });
    let bpods: Vec<Netns> = (0..2).map(|_| Netns::new("bpod")).collect();
    let mut baddrs = Vec::new();
    for pod in &bpods {
        let r = call(daemon.node(), plugins.path(), "ADD", &lan, pod, None)
            .result()
            .clone();
        let addr = first(&r);
        assert_eq!(addrs(pod), [addr.to_string()], "{r}");
        baddrs.push(addr.addr());
    }
    assert!(daemon
        .node()
        .addrs_of(&br)
        .contains(&"10.253.1.1/24".to_owned()));
    assert_ping_within(
        &bpods[0],
        "10.253.1.1".parse().expect("ip"),
        Duration::from_secs(5),
    );
    assert_ping_within(&bpods[0], baddrs[1], Duration::from_secs(5));

    // The admin API: the pools, their usage, their blocks and who holds
    // what.
    let listed = list_pools(&daemon);
    let names: Vec<&str> = listed.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["lan", "mig"]);
    let lan_pool = get_pool(&daemon, "lan");
    assert_eq!((lan_pool.used, lan_pool.block_size), (2, 28));
    assert_eq!(lan_pool.size, 256 - 3);
    let holders: Vec<&String> = lan_pool.blocks.iter().flat_map(|b| &b.holders).collect();
    assert_eq!(holders.len(), 2, "{lan_pool:?}");
    assert!(
        holders.iter().any(|h| h.contains(bpods[1].name())),
        "{holders:?}"
    );
    let missing = admin::with_client(daemon.socket(), |mut c| async move {
        c.get_pool(pb::GetPoolRequest {
            name: "nope".into(),
        })
        .await
    });
    let status = missing.expect_err("an unknown pool");
    assert_eq!(status.code(), tonic::Code::NotFound);
    assert!(status.message().contains("119"), "{status:?}");

    // DEL through the main plugins releases.
    call(daemon.node(), plugins.path(), "DEL", &lan, &bpods[1], None).assert_success();
    assert_eq!(used(&daemon, "lan"), 1);
    assert!(!bpods[1].has_link("net1"));

    // GC, straight to tether (macvlan 1.1.1 knows no GC): only pods[0] is
    // still valid, so pods[1] and extra are orphans of network mig.
    let mut gc = mig.clone();
    gc["cniVersion"] = json!("1.1.0");
    gc["cni.dev/valid-attachments"] = json!([{"containerID": pods[0].name(), "ifname": "net1"}]);
    let shim = plugins.path().join("tether");
    call_bin(
        daemon.node(),
        plugins.path(),
        &shim,
        "GC",
        &gc,
        "",
        &pods[0],
        None,
    )
    .assert_success();
    assert_eq!(used(&daemon, "mig"), 1);
    assert_eq!(used(&daemon, "lan"), 1, "GC of mig touched lan");
    let left: Vec<String> = daemon
        .attachments()
        .into_iter()
        .filter(|x| x.network == "mig")
        .map(|x| x.container_id)
        .collect();
    assert_eq!(left, [pods[0].name()]);

    // SIGHUP: the file now excludes pods[0]'s address and adds a pool. The
    // held address stays held and is reported; it is never given again.
    let changed = POOLS
        .replace(
            r#""exclude": ["10.253.0.20/30", "10.253.0.50"]"#,
            &format!(r#""exclude": ["10.253.0.20/30", "10.253.0.50", "{a}"]"#),
        )
        .replace(
            "\n]}",
            r#", {"name": "extra", "cidr": "10.253.2.0/24"}
]}"#,
        );
    assert_ne!(changed, POOLS);
    pools_file(&files, &changed);
    let pid = daemon.pid().expect("the daemon runs");
    // SAFETY: kill(2) on the daemon this test spawned, by its pid.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGHUP) }, 0);
    let reloaded = tether_e2e::wait_until(Duration::from_secs(5), || {
        list_pools(&daemon).iter().any(|p| p.name == "extra")
    });
    assert!(
        reloaded,
        "SIGHUP did not reload the pools:\n{}",
        daemon.log()
    );
    let mig_pool = get_pool(&daemon, "mig");
    assert_eq!(mig_pool.excluded_in_use, [a.to_string()]);
    assert_eq!(mig_pool.used, 1);
    assert_ping_within(&extra, a, Duration::from_secs(5));
    // A file that does not parse changes nothing.
    pools_file(&files, "{\"pools\": [");
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGHUP) }, 0);
    assert!(tether_e2e::wait_until(Duration::from_secs(5), || daemon
        .log()
        .contains("the pools file is refused")));
    assert_eq!(list_pools(&daemon).len(), 3);
    // The daemon restarts: held addresses and their pools are as they were.
    pools_file(&files, &changed);
    daemon.restart();
    let mig_pool = get_pool(&daemon, "mig");
    assert_eq!((mig_pool.used, mig_pool.excluded_in_use.len()), (1, 1));
    call(daemon.node(), plugins.path(), "DEL", &mig, &pods[0], None).assert_success();
    call(daemon.node(), plugins.path(), "DEL", &lan, &bpods[0], None).assert_success();
    assert_eq!(used(&daemon, "mig") + used(&daemon, "lan"), 0);
}

tether_e2e::on_both_stores!(two_nodes_share_a_pool_and_their_macvlan_pods_ping);

fn two_nodes_share_a_pool_and_their_macvlan_pods_ping(store: Store) {
    require_root();
    let files = TempDir::new("pools");
    let pools = pools_file(&files, POOLS);
    let cluster = Topology::tetherd(2)
        .store(store)
        .etcd_members(1)
        .node(NodeOpts {
            extra_args: vec!["--pools".into(), pools],
            ..Default::default()
        })
        .start();
    let plugins = plugin_dir();
    let mut pods = Vec::new();
    for (i, n) in cluster.nodes().iter().enumerate() {
        // The node's own interface on the fabric is the macvlan master: the
        // pods of both nodes share the fabric's L2.
        let conf = macvlan_conf(n.daemon(), "lan", &n.underlay().ifname, "lan");
        for _ in 0..2 {
            let pod = Netns::new("pod");
            let out = call(n.netns(), plugins.path(), "ADD", &conf, &pod, None);
            let addr = first(out.result());
            assert_eq!(addrs(&pod), [addr.to_string()]);
            pods.push((i, pod, addr.addr(), conf.clone()));
        }
    }
    // Each node holds a /28 of its own; no address twice.
    let block = |ip: IpAddr| IpNet::new(ip, 28).expect("28").trunc();
    assert_eq!(block(pods[0].2), block(pods[1].2));
    assert_eq!(block(pods[2].2), block(pods[3].2));
    assert_ne!(block(pods[0].2), block(pods[2].2));
    let records: Vec<(String, String)> = cluster
        .store_keys()
        .into_iter()
        .filter(|(k, _)| k.contains("/poolblocks/"))
        .collect();
    assert_eq!(records.len(), 2, "{records:?}");
    for n in cluster.nodes() {
        assert!(
            records.iter().any(|(_, v)| v.contains(n.name())),
            "no block of {} in {records:?}",
            n.name()
        );
        let p = get_pool(n.daemon(), "lan");
        assert_eq!(p.used, 2);
        assert_eq!(p.blocks.len(), 2, "GetPool shows both nodes' blocks: {p:?}");
        assert_eq!(p.blocks.iter().filter(|b| b.local).count(), 1);
    }
    // Across nodes, over the fabric.
    assert_ping_within(&pods[0].1, pods[2].2, Duration::from_secs(5));
    assert_ping_within(&pods[3].1, pods[1].2, Duration::from_secs(5));
    for (i, pod, _, conf) in &pods {
        let n = cluster.node(*i);
        call(n.netns(), plugins.path(), "DEL", conf, pod, None).assert_success();
    }
    for n in cluster.nodes() {
        assert_eq!(used(n.daemon(), "lan"), 0);
    }
}
