//! Every CNI verb and every cniVersion, through the real `tether` plugin
//! against a real `tetherd`, with each answer compared to what is really in
//! the pod netns and the daemon's node netns.
//!
//! Every address and route lives in the namespaces these tests create; the
//! only traffic is ping between two pods of one daemon. Run as root.

mod admin;
mod bad_input;
mod chaining;
mod concurrency;
mod crash;
mod lifecycle;
mod metrics;
mod one_daemon;
mod pending_del;
mod runtimes;
mod security;
mod startup;

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tether_e2e::{
    assert_ping_within, call, cni, is_tether_link, require_root, tether_bin, unique_name,
    with_prev, CniEnv, CniOutput, Daemon, DaemonOpts, Family, Netns,
};

/// Every cniVersion tether renders.
const VERSIONS: [&str; 5] = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];
/// The node-side MAC, the same on every node (the anycast gateway's).
const GATEWAY_MAC: &str = "0a:58:a9:fe:01:01";
const GATEWAY_V4: &str = "169.254.1.1";
const GATEWAY_V6: &str = "fe80::1";
/// The route protocol tether marks its routes with, as `ip -j` prints it.
const ROUTE_PROTO: &str = "201";
/// How long the background veth deletion after DEL may take to show.
const LINK_GONE_WITHIN: Duration = Duration::from_secs(2);

const DUAL: [&str; 2] = ["10.77.0.0/24", "fd00:77::/120"];
const V4_ONLY: [&str; 1] = ["10.78.0.0/24"];
const V6_ONLY: [&str; 1] = ["fd00:78::/120"];
/// One ping reply is awaited this long; nothing is asserted of its speed.
const PING_WITHIN: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------
// Invocation helpers

fn daemon_with(cidrs: &[&str], mtu: Option<u32>) -> Daemon {
    Daemon::start(DaemonOpts {
        pod_cidrs: cidrs.iter().map(|c| c.to_string()).collect(),
        mtu,
        ..DaemonOpts::default()
    })
}

fn call_env(env: &CniEnv, conf: &Value) -> CniOutput {
    let stdin = serde_json::to_vec(conf).expect("JSON serializes");
    cni(&tether_bin(), env, &stdin)
}

/// ADD that must succeed; returns the result.
fn add_ok(conf: &Value, cid: &str, pod: &Netns) -> Value {
    let out = call("ADD", conf, cid, Some(pod));
    out.result().clone()
}

/// Asserts the call succeeded and printed nothing (DEL, CHECK, GC, STATUS).
fn assert_silent_ok(what: &str, out: &CniOutput) {
    assert!(out.success(), "{what} failed: {out}");
    assert!(
        out.stdout.trim().is_empty(),
        "{what} printed on stdout: {out}"
    );
}

fn assert_code(what: &str, out: &CniOutput, want: &[u64]) {
    let code = out.error_code();
    assert!(
        code.is_some_and(|c| want.contains(&c)),
        "{what}: expected code {want:?}, got {code:?}: {out}"
    );
    // The error object the spec asks for.
    let err = out.json.as_ref().expect("an error is JSON");
    assert!(err["msg"].is_string(), "{what}: no msg: {out}");
    assert!(
        err["cniVersion"].is_string(),
        "{what}: no cniVersion: {out}"
    );
}

fn error_text(out: &CniOutput) -> String {
    out.json
        .as_ref()
        .map(|e| format!("{} {}", e["msg"], e["details"]))
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------
// Reading a result

/// What an ADD result says, with the result's own shape checked on the way.
#[derive(Debug, Clone)]
struct Wiring {
    host_if: String,
    pod_if: String,
    pod_mac: String,
    ips: Vec<IpAddr>,
}

fn interfaces(result: &Value) -> &Vec<Value> {
    result["interfaces"]
        .as_array()
        .unwrap_or_else(|| panic!("result without interfaces: {result}"))
}

/// Parses and checks the shape of an ADD result for `version`, `pod` and
/// `mtu` (which only 1.1.0 prints).
fn read_result(result: &Value, version: &str, pod: &Netns, ifname: &str, mtu: u32) -> Wiring {
    assert_eq!(result["cniVersion"], version, "{result}");
    let ifs = interfaces(result);
    assert_eq!(ifs.len(), 2, "one host and one pod interface: {result}");
    let pod_idx = ifs
        .iter()
        .position(|i| i.get("sandbox").is_some())
        .unwrap_or_else(|| panic!("no interface with a sandbox: {result}"));
    let host = &ifs[1 - pod_idx];
    let podif = &ifs[pod_idx];
    assert_eq!(podif["name"], ifname, "{result}");
    assert_eq!(
        podif["sandbox"],
        pod.path().display().to_string(),
        "{result}"
    );
    let host_if = host["name"].as_str().expect("host name").to_owned();
    assert!(
        is_tether_link(&host_if),
        "host interface name {host_if:?} is not tth + 12 hex digits"
    );
    assert_eq!(host["mac"], GATEWAY_MAC, "{result}");
    let pod_mac = podif["mac"].as_str().expect("pod mac").to_owned();
    for i in [host, podif] {
        if version == "1.1.0" {
            assert_eq!(i["mtu"], mtu, "1.1.0 interfaces carry the MTU: {result}");
        } else {
            assert!(i.get("mtu").is_none(), "{version} has no mtu: {result}");
        }
    }

    let mut ips = Vec::new();
    for entry in result["ips"].as_array().expect("ips") {
        let addr = entry["address"].as_str().expect("address");
        let (ip, len) = addr.split_once('/').expect("CIDR address");
        let ip: IpAddr = ip.parse().expect("IP");
        let (want_len, gw, fam) = if ip.is_ipv4() {
            ("32", GATEWAY_V4, "4")
        } else {
            ("128", GATEWAY_V6, "6")
        };
        assert_eq!(len, want_len, "{result}");
        assert_eq!(entry["gateway"], gw, "{result}");
        assert_eq!(
            entry["interface"], pod_idx,
            "ips point at the pod: {result}"
        );
        if version.starts_with("0.") {
            assert_eq!(
                entry["version"], fam,
                "{version} ips carry version: {result}"
            );
        } else {
            assert!(entry.get("version").is_none(), "{version}: {result}");
        }
        ips.push(ip);
    }
    let mut want_routes = Vec::new();
    if ips.iter().any(IpAddr::is_ipv4) {
        want_routes.push(json!({"dst": "0.0.0.0/0", "gw": GATEWAY_V4}));
    }
    if ips.iter().any(IpAddr::is_ipv6) {
        want_routes.push(json!({"dst": "::/0", "gw": GATEWAY_V6}));
    }
    assert_eq!(result["routes"], json!(want_routes), "{result}");
    Wiring {
        host_if,
        pod_if: ifname.to_owned(),
        pod_mac,
        ips,
    }
}

// ---------------------------------------------------------------------------
// Reading the kernel

fn link(ns: &Netns, name: &str) -> Option<Value> {
    ns.links().into_iter().find(|l| l["ifname"] == name)
}

fn has_flag(v: &Value, flag: &str) -> bool {
    v["flags"]
        .as_array()
        .is_some_and(|f| f.iter().any(|x| x == flag))
}

/// Non-link-local addresses of `ifname` as "ip/len".
fn global_addrs(ns: &Netns, ifname: &str) -> BTreeSet<String> {
    ns.ip_json(&["addr", "show", "dev", ifname])
        .iter()
        .flat_map(|l| l["addr_info"].as_array().cloned().unwrap_or_default())
        .filter(|a| a["scope"] != "link")
        .map(|a| format!("{}/{}", a["local"].as_str().unwrap_or(""), a["prefixlen"]))
        .collect()
}

fn default_routes(ns: &Netns, fam: Family) -> Vec<Value> {
    ns.routes(fam)
        .into_iter()
        .filter(|r| r["dst"] == "default")
        .collect()
}

/// The node's routes (both families) to `ip`.
fn node_routes_to(daemon: &Daemon, ip: IpAddr) -> Vec<Value> {
    let fam = if ip.is_ipv4() { Family::V4 } else { Family::V6 };
    daemon
        .node()
        .routes(fam)
        .into_iter()
        .filter(|r| r["dst"] == ip.to_string() || r["dst"] == host_prefix(ip))
        .collect()
}

fn host_prefix(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(_) => format!("{ip}/32"),
        IpAddr::V6(_) => format!("{ip}/128"),
    }
}

fn sysctl(ns: &Netns, key: &str) -> String {
    ns.exec_ok(&["cat", &format!("/proc/sys/{key}")])
        .trim()
        .to_owned()
}

/// Asserts that the kernel holds exactly what `w` says, with `mtu`.
fn assert_wired(daemon: &Daemon, pod: &Netns, w: &Wiring, mtu: u32) {
    let has_v4 = w.ips.iter().any(IpAddr::is_ipv4);
    let has_v6 = w.ips.iter().any(IpAddr::is_ipv6);

    // Pod side: the interface, its MAC and MTU, up.
    let plink = link(pod, &w.pod_if)
        .unwrap_or_else(|| panic!("no {} in pod netns: {:?}", w.pod_if, pod.links()));
    assert_eq!(plink["address"], w.pod_mac.as_str(), "{plink}");
    assert_eq!(plink["mtu"], mtu, "{plink}");
    assert!(has_flag(&plink, "UP"), "{plink}");
    // Exactly the result's addresses, as host prefixes.
    let want: BTreeSet<String> = w.ips.iter().map(|&ip| host_prefix(ip)).collect();
    assert_eq!(global_addrs(pod, &w.pod_if), want, "pod addresses");

    // Pod routes and gateway neighbours.
    let v4 = default_routes(pod, Family::V4);
    let v6 = default_routes(pod, Family::V6);
    if has_v4 {
        assert_eq!(v4.len(), 1, "{v4:?}");
        assert_eq!(v4[0]["gateway"], GATEWAY_V4, "{v4:?}");
        assert_eq!(v4[0]["dev"], w.pod_if.as_str(), "{v4:?}");
        assert!(has_flag(&v4[0], "onlink"), "default via gw onlink: {v4:?}");
    } else {
        assert!(v4.is_empty(), "v6-only pod has an IPv4 default: {v4:?}");
    }
    if has_v6 {
        assert_eq!(v6.len(), 1, "{v6:?}");
        assert_eq!(v6[0]["gateway"], GATEWAY_V6, "{v6:?}");
        assert_eq!(v6[0]["dev"], w.pod_if.as_str(), "{v6:?}");
    } else {
        assert!(v6.is_empty(), "v4-only pod has an IPv6 default: {v6:?}");
    }
    let neigh = pod.neighbours();
    for (present, gw) in [(has_v4, GATEWAY_V4), (has_v6, GATEWAY_V6)] {
        let entry = neigh.iter().find(|n| n["dst"] == gw);
        if present {
            let n = entry.unwrap_or_else(|| panic!("no neighbour {gw}: {neigh:?}"));
            assert_eq!(n["lladdr"], GATEWAY_MAC, "{n}");
            assert_eq!(n["dev"], w.pod_if.as_str(), "{n}");
            let state = n["state"].as_array().cloned().unwrap_or_default();
            assert!(state.iter().any(|s| s == "PERMANENT"), "{n}");
        }
    }

    // Node side: the veth with the gateway MAC, same MTU, proxy ARP,
    // fe80::1 when there is IPv6, and one proto-201 route per address.
    let node = daemon.node();
    let hlink = link(node, &w.host_if)
        .unwrap_or_else(|| panic!("no {} in node netns: {:?}", w.host_if, node.links()));
    assert_eq!(hlink["address"], GATEWAY_MAC, "{hlink}");
    assert_eq!(hlink["mtu"], mtu, "{hlink}");
    assert!(has_flag(&hlink, "UP"), "{hlink}");
    if has_v4 {
        let key = format!("net/ipv4/conf/{}/proxy_arp", w.host_if);
        assert_eq!(sysctl(node, &key), "1", "{key}");
    }
    if has_v6 {
        assert!(
            node.addrs_of(&w.host_if).contains(&"fe80::1/64".to_owned()),
            "fe80::1/64 on {}: {:?}",
            w.host_if,
            node.addrs_of(&w.host_if)
        );
    }
    for &ip in &w.ips {
        let routes = node_routes_to(daemon, ip);
        assert_eq!(routes.len(), 1, "one node route to {ip}: {routes:?}");
        assert_eq!(routes[0]["dev"], w.host_if.as_str(), "{routes:?}");
        assert_eq!(routes[0]["protocol"], ROUTE_PROTO, "{routes:?}");
    }
}

/// Polls `cond` every 20 ms for up to `limit`; panics with `what` if it
/// never holds.
fn eventually(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    loop {
        if cond() {
            return;
        }
        if Instant::now() >= deadline {
            panic!("{what}: still not true after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Asserts that DEL left nothing: routes and record at once, links within
/// [`LINK_GONE_WITHIN`].
fn assert_released(daemon: &Daemon, pod: &Netns, cid: &str, w: &Wiring) {
    for &ip in &w.ips {
        let routes = node_routes_to(daemon, ip);
        assert!(routes.is_empty(), "node route to {ip} survived: {routes:?}");
    }
    let listed = daemon.attachments();
    assert!(
        !listed.iter().any(|a| a.container_id == cid),
        "{cid} still listed: {listed:?}"
    );
    eventually(
        &format!("host veth {} deleted", w.host_if),
        LINK_GONE_WITHIN,
        || link(daemon.node(), &w.host_if).is_none(),
    );
    eventually(
        &format!("{} deleted from the pod", w.pod_if),
        LINK_GONE_WITHIN,
        || link(pod, &w.pod_if).is_none(),
    );
}

// ---------------------------------------------------------------------------
// The admin API

/// (used, free) of the pool whose CIDR is `cidr`.
fn pool_usage(daemon: &Daemon, cidr: &str) -> (u64, u64) {
    let node = daemon.node_info();
    let pool = node
        .pools
        .iter()
        .find(|p| p.cidr == cidr)
        .unwrap_or_else(|| panic!("no pool {cidr}: {node:?}"));
    (pool.used, pool.free)
}

// ---------------------------------------------------------------------------
// Files

/// Every path under `dir` at any depth, directories too, each with its
/// name relative to `dir`.
fn paths_under(dir: &Path) -> Vec<(String, PathBuf)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let rel = path
                .strip_prefix(dir)
                .unwrap_or(&path)
                .display()
                .to_string();
            if path.is_dir() {
                stack.push(path.clone());
            }
            out.push((rel, path));
        }
    }
    out
}

// ---------------------------------------------------------------------------
// Tests

/// ADD, repeated ADD, CHECK, STATUS and DEL in every cniVersion on a
/// dual-stack daemon; every answer compared with the kernel.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn every_version_add_check_del_dual_stack() {
    require_root();
    let daemon = Daemon::with_cidrs(&DUAL, &[]);
    for version in VERSIONS {
        let conf = daemon.netconf(version, "dual");
        let pod = Netns::new("pod");
        let cid = unique_name("c");

        let add = call("ADD", &conf, &cid, Some(&pod));
        let result = add.result().clone();
        let w = read_result(&result, version, &pod, "eth0", 1500);
        assert_eq!(
            w.ips.len(),
            2,
            "{version}: one address per family: {result}"
        );
        assert!(w.ips[0].is_ipv4() && w.ips[1].is_ipv6(), "{result}");
        assert_wired(&daemon, &pod, &w, 1500);

        // The admin API holds the same attachment.
        let listed = daemon.attachments();
        let a = listed
            .iter()
            .find(|a| a.container_id == cid)
            .unwrap_or_else(|| panic!("{cid} not listed: {listed:?}"));
        assert_eq!(a.host_interface, w.host_if);
        assert_eq!(a.mac, w.pod_mac);
        let want: BTreeSet<String> = w.ips.iter().map(|&ip| host_prefix(ip)).collect();
        assert_eq!(a.ips.iter().cloned().collect::<BTreeSet<_>>(), want);

        // A repeated ADD answers the same and changes nothing.
        let again = call("ADD", &conf, &cid, Some(&pod));
        assert_eq!(again.result(), &result, "{version}: repeated ADD differs");
        assert_wired(&daemon, &pod, &w, 1500);

        let check = call("CHECK", &with_prev(&conf, &result), &cid, Some(&pod));
        if version.starts_with("0.3") {
            assert_code(&format!("CHECK {version}"), &check, &[1]);
        } else {
            assert_silent_ok(&format!("CHECK {version}"), &check);
        }
        if version == "1.1.0" {
            let status = call("STATUS", &conf, "", None);
            assert_silent_ok("STATUS 1.1.0", &status);
        }

        let del = call("DEL", &with_prev(&conf, &result), &cid, Some(&pod));
        assert_silent_ok(&format!("DEL {version}"), &del);
        assert_released(&daemon, &pod, &cid, &w);
        let del = call("DEL", &conf, &cid, Some(&pod));
        assert_silent_ok(&format!("second DEL {version}"), &del);
    }
    let (used, _) = pool_usage(&daemon, DUAL[0]);
    assert_eq!(used, 0, "every address is free again");
}

/// Two dual-stack pods reach each other over IPv4 and IPv6.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn dual_stack_pods_ping_each_other() {
    require_root();
    let daemon = Daemon::with_cidrs(&DUAL, &[]);
    let conf = daemon.netconf("1.0.0", "ping");
    let (a, b) = (Netns::new("pa"), Netns::new("pb"));
    let wa = read_result(&add_ok(&conf, "ping-a", &a), "1.0.0", &a, "eth0", 1500);
    let wb = read_result(&add_ok(&conf, "ping-b", &b), "1.0.0", &b, "eth0", 1500);
    assert_wired(&daemon, &a, &wa, 1500);
    assert_wired(&daemon, &b, &wb, 1500);
    assert_ne!(wa.ips, wb.ips);
    assert_ping_within(&a, wb.ips[0], PING_WITHIN);
    assert_ping_within(&b, wa.ips[0], PING_WITHIN);
    assert_ping_within(&a, wb.ips[1], PING_WITHIN);
    assert_ping_within(&b, wa.ips[1], PING_WITHIN);
}

/// A daemon with only an IPv4 pool: one address, no IPv6 default route,
/// and a ping between two pods.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn v4_only_daemon() {
    require_root();
    single_family(&V4_ONLY, true);
}

/// A daemon with only an IPv6 pool: one address, no IPv4 default route,
/// and a ping between two pods.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn v6_only_daemon() {
    require_root();
    single_family(&V6_ONLY, false);
}

fn single_family(cidrs: &[&str], v4: bool) {
    let daemon = Daemon::with_cidrs(cidrs, &[]);
    let conf = daemon.netconf("1.1.0", "single");
    let (a, b) = (Netns::new("pa"), Netns::new("pb"));
    let ra = add_ok(&conf, "one-a", &a);
    let rb = add_ok(&conf, "one-b", &b);
    let wa = read_result(&ra, "1.1.0", &a, "eth0", 1500);
    let wb = read_result(&rb, "1.1.0", &b, "eth0", 1500);
    for w in [&wa, &wb] {
        assert_eq!(w.ips.len(), 1, "{w:?}");
        assert_eq!(w.ips[0].is_ipv4(), v4, "{w:?}");
    }
    assert_wired(&daemon, &a, &wa, 1500);
    assert_wired(&daemon, &b, &wb, 1500);
    assert_ping_within(&a, wb.ips[0], PING_WITHIN);
    assert_ping_within(&b, wa.ips[0], PING_WITHIN);
    assert_silent_ok(
        "CHECK",
        &call("CHECK", &with_prev(&conf, &ra), "one-a", Some(&a)),
    );
    assert_silent_ok("DEL", &call("DEL", &conf, "one-a", Some(&a)));
    assert_released(&daemon, &a, "one-a", &wa);
    assert_silent_ok(
        "CHECK b",
        &call("CHECK", &with_prev(&conf, &rb), "one-b", Some(&b)),
    );
}

/// The same container id and ifname ADDed with another netns is code 103,
/// and neither the first attachment nor the second netns changes.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn add_in_another_netns_conflicts() {
    require_root();
    let daemon = Daemon::with_cidrs(&DUAL, &[]);
    let conf = daemon.netconf("1.1.0", "conflict");
    let (first, second) = (Netns::new("p1"), Netns::new("p2"));
    let result = add_ok(&conf, "conflicting", &first);
    let w = read_result(&result, "1.1.0", &first, "eth0", 1500);
    let node_links = daemon.node().link_names();

    let out = call("ADD", &conf, "conflicting", Some(&second));
    assert_code("ADD in another netns", &out, &[103]);
    assert_eq!(second.link_names(), ["lo"], "the second netns is untouched");
    assert_eq!(daemon.node().link_names(), node_links);
    assert_eq!(daemon.attachments().len(), 1);
    assert_wired(&daemon, &first, &w, 1500);
    let check = call(
        "CHECK",
        &with_prev(&conf, &result),
        "conflicting",
        Some(&first),
    );
    assert_silent_ok("CHECK of the first", &check);
}

/// One kind of damage CHECK must report.
struct Damage {
    name: &'static str,
    codes: &'static [u64],
    /// Breaks the wiring (or builds the CHECK's netconf) and returns the
    /// netconf to CHECK with.
    apply: fn(&Daemon, &Netns, &Wiring, &Value) -> Value,
}

fn v4_of(w: &Wiring) -> String {
    w.ips
        .iter()
        .find(|ip| ip.is_ipv4())
        .expect("an IPv4 address")
        .to_string()
}

fn exec_ok(ns: &Netns, argv: &[&str]) {
    ns.exec_ok(argv);
}

const DAMAGES: &[Damage] = &[
    Damage {
        name: "pod address deleted",
        codes: &[112],
        apply: |_, pod, w, prev| {
            let addr = format!("{}/32", v4_of(w));
            exec_ok(pod, &["ip", "addr", "del", &addr, "dev", &w.pod_if]);
            prev.clone()
        },
    },
    Damage {
        name: "pod IPv4 default route deleted",
        codes: &[113],
        apply: |_, pod, _, prev| {
            exec_ok(pod, &["ip", "-4", "route", "del", "default"]);
            prev.clone()
        },
    },
    Damage {
        name: "pod IPv6 default route deleted",
        codes: &[113],
        apply: |_, pod, _, prev| {
            exec_ok(pod, &["ip", "-6", "route", "del", "default"]);
            prev.clone()
        },
    },
    Damage {
        name: "pod gateway neighbour deleted",
        codes: &[113],
        apply: |_, pod, w, prev| {
            exec_ok(pod, &["ip", "neigh", "del", GATEWAY_V4, "dev", &w.pod_if]);
            prev.clone()
        },
    },
    Damage {
        name: "pod link down",
        codes: &[111],
        apply: |_, pod, w, prev| {
            exec_ok(pod, &["ip", "link", "set", &w.pod_if, "down"]);
            prev.clone()
        },
    },
    Damage {
        name: "pod MTU changed",
        codes: &[111],
        apply: |_, pod, w, prev| {
            exec_ok(pod, &["ip", "link", "set", &w.pod_if, "mtu", "1400"]);
            prev.clone()
        },
    },
    Damage {
        name: "node route deleted",
        codes: &[115],
        apply: |d, _, w, prev| {
            let dst = format!("{}/32", v4_of(w));
            exec_ok(d.node(), &["ip", "route", "del", &dst]);
            prev.clone()
        },
    },
    Damage {
        name: "node veth deleted",
        codes: &[114, 111],
        apply: |d, _, w, prev| {
            exec_ok(d.node(), &["ip", "link", "del", &w.host_if]);
            prev.clone()
        },
    },
    Damage {
        name: "prevResult without our IPv4 address",
        codes: &[116],
        apply: |_, _, w, prev| {
            let mut prev = prev.clone();
            let v4 = format!("{}/32", v4_of(w));
            let ips = prev["prevResult"]["ips"].as_array_mut().expect("ips");
            ips.retain(|e| e["address"] != v4.as_str());
            prev
        },
    },
];

/// CHECK passes on an intact attachment and reports each kind of damage
/// with its documented code; a repeated ADD then rebuilds the wiring with
/// the same addresses, and DEL still cleans up.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn check_reports_each_kind_of_damage() {
    require_root();
    let daemon = Daemon::with_cidrs(&DUAL, &[]);
    let conf = daemon.netconf("1.1.0", "damage");
    let mut failures = Vec::new();
    for damage in DAMAGES {
        let pod = Netns::new("pod");
        let cid = unique_name("dmg");
        let result = add_ok(&conf, &cid, &pod);
        let w = read_result(&result, "1.1.0", &pod, "eth0", 1500);
        let check_conf = with_prev(&conf, &result);
        assert_silent_ok(
            &format!("{}: CHECK before", damage.name),
            &call("CHECK", &check_conf, &cid, Some(&pod)),
        );

        let broken_conf = (damage.apply)(&daemon, &pod, &w, &check_conf);
        let out = call("CHECK", &broken_conf, &cid, Some(&pod));
        let code = out.error_code();
        if !code.is_some_and(|c| damage.codes.contains(&c)) {
            failures.push(format!(
                "{}: expected {:?}, got {code:?}: {out}",
                damage.name, damage.codes
            ));
        }

        // The documented repair: a repeated ADD answers the same result and
        // rebuilds whatever was damaged.
        let again = call("ADD", &conf, &cid, Some(&pod));
        if again.json.as_ref() != Some(&result) || !again.success() {
            failures.push(format!(
                "{}: repeated ADD after damage: {again}",
                damage.name
            ));
        } else {
            let check = call("CHECK", &check_conf, &cid, Some(&pod));
            if !check.success() {
                failures.push(format!("{}: CHECK after re-ADD: {check}", damage.name));
            }
        }

        let del = call("DEL", &conf, &cid, Some(&pod));
        assert_silent_ok(&format!("{}: DEL", damage.name), &del);
        assert_released(&daemon, &pod, &cid, &w);
    }

    // CHECK of an attachment the daemon never saw.
    let pod = Netns::new("pod");
    let result = add_ok(&conf, "known", &pod);
    let out = call(
        "CHECK",
        &with_prev(&conf, &result),
        "never-added",
        Some(&pod),
    );
    if out.error_code() != Some(110) {
        failures.push(format!("unknown attachment: expected 110: {out}"));
    }
    assert!(
        failures.is_empty(),
        "{} CHECK case(s) failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// DEL with an empty CNI_NETNS (what `ctr` sends) cleans up from the record;
/// DEL repeated, without CNI_NETNS, or of a never-seen container succeeds.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn del_is_idempotent_and_needs_no_netns() {
    require_root();
    let daemon = Daemon::with_cidrs(&DUAL, &[]);
    let conf = daemon.netconf("1.0.0", "deletes");
    let pod = Netns::new("pod");
    let result = add_ok(&conf, "to-delete", &pod);
    let w = read_result(&result, "1.0.0", &pod, "eth0", 1500);
    assert_wired(&daemon, &pod, &w, 1500);

    let mut env = CniEnv::new("DEL", "to-delete", &pod);
    env.netns = Some(String::new());
    assert_silent_ok(
        "DEL with empty CNI_NETNS",
        &call_env(&env, &with_prev(&conf, &result)),
    );
    assert_released(&daemon, &pod, "to-delete", &w);

    assert_silent_ok("DEL again", &call_env(&env, &conf));
    env.netns = None;
    assert_silent_ok("DEL without CNI_NETNS", &call_env(&env, &conf));
    assert_silent_ok(
        "DEL with netns",
        &call("DEL", &conf, "to-delete", Some(&pod)),
    );
    assert_silent_ok(
        "DEL of an unknown container",
        &call("DEL", &conf, "never-added", Some(&pod)),
    );
    assert!(daemon.attachments().is_empty());
    let (used, _) = pool_usage(&daemon, DUAL[0]);
    assert_eq!(used, 0);
}

/// A /29 holds six pods: STATUS is ready until it is full, then 50; the
/// seventh ADD is 100 naming the CIDR and leaves nothing; after one DEL the
/// freed address is the one the next ADD gets.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn tiny_pool_exhaustion_status_and_reuse() {
    require_root();
    const CIDR: &str = "10.79.0.0/29";
    let daemon = Daemon::with_cidrs(&[CIDR], &[]);
    let conf = daemon.netconf("1.1.0", "tiny");
    assert_silent_ok("STATUS on an empty pool", &call("STATUS", &conf, "", None));

    let mut pods = Vec::new();
    for i in 0..6 {
        let pod = Netns::new("pod");
        let cid = format!("tiny-{i}");
        let w = read_result(&add_ok(&conf, &cid, &pod), "1.1.0", &pod, "eth0", 1500);
        assert_wired(&daemon, &pod, &w, 1500);
        pods.push((pod, cid, w));
    }
    let all: BTreeSet<IpAddr> = pods.iter().map(|(_, _, w)| w.ips[0]).collect();
    let want: BTreeSet<IpAddr> = (1..=6)
        .map(|n| format!("10.79.0.{n}").parse().unwrap())
        .collect();
    assert_eq!(all, want, "a /29 hands out .1 to .6");
    assert_eq!(pool_usage(&daemon, CIDR), (6, 0));

    let status = call("STATUS", &conf, "", None);
    assert_code("STATUS with the pool exhausted", &status, &[50]);

    let extra = Netns::new("pod");
    let node_links = daemon.node().link_names();
    let out = call("ADD", &conf, "tiny-extra", Some(&extra));
    assert_code("ADD with the pool exhausted", &out, &[100]);
    assert!(
        error_text(&out).contains(CIDR),
        "the error names the CIDR {CIDR}: {out}"
    );
    assert_eq!(extra.link_names(), ["lo"], "a failed ADD leaves no link");
    assert_eq!(daemon.node().link_names(), node_links);
    assert_eq!(daemon.attachments().len(), 6);
    assert_eq!(pool_usage(&daemon, CIDR), (6, 0));

    let (pod, cid, w) = pods.remove(2);
    assert_silent_ok("DEL", &call("DEL", &conf, &cid, Some(&pod)));
    assert_released(&daemon, &pod, &cid, &w);
    assert_eq!(pool_usage(&daemon, CIDR), (5, 1));
    assert_silent_ok("STATUS after a DEL", &call("STATUS", &conf, "", None));

    let reused = read_result(
        &add_ok(&conf, "tiny-extra", &extra),
        "1.1.0",
        &extra,
        "eth0",
        1500,
    );
    assert_eq!(reused.ips, w.ips, "the freed address is handed out again");
    assert_wired(&daemon, &extra, &reused, 1500);
}

/// GC with `cni.dev/valid-attachments` listing one of two attachments
/// releases the other completely and leaves the listed one, and another
/// network's, intact.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn gc_releases_unlisted_attachments() {
    require_root();
    let daemon = Daemon::with_cidrs(&DUAL, &[]);
    let conf = daemon.netconf("1.1.0", "gcnet");
    let other_conf = daemon.netconf("1.1.0", "othernet");
    let (pa, pb, pc) = (Netns::new("pa"), Netns::new("pb"), Netns::new("pc"));
    let ra = add_ok(&conf, "gc-keep", &pa);
    let rb = add_ok(&conf, "gc-drop", &pb);
    let rc = add_ok(&other_conf, "gc-other", &pc);
    let wa = read_result(&ra, "1.1.0", &pa, "eth0", 1500);
    let wb = read_result(&rb, "1.1.0", &pb, "eth0", 1500);
    let wc = read_result(&rc, "1.1.0", &pc, "eth0", 1500);
    assert_eq!(pool_usage(&daemon, DUAL[0]).0, 3);

    let mut gc = conf.clone();
    gc["cni.dev/valid-attachments"] = json!([{"containerID": "gc-keep", "ifname": "eth0"}]);
    assert_silent_ok("GC", &call("GC", &gc, "", None));

    assert_released(&daemon, &pb, "gc-drop", &wb);
    assert_eq!(pool_usage(&daemon, DUAL[0]).0, 2);
    assert_eq!(pool_usage(&daemon, DUAL[1]).0, 2);
    assert_eq!(
        daemon.attachment_ids(),
        BTreeSet::from(["gc-keep".to_owned(), "gc-other".to_owned()])
    );
    assert_wired(&daemon, &pa, &wa, 1500);
    assert_wired(&daemon, &pc, &wc, 1500);
    assert_silent_ok(
        "CHECK of the listed attachment",
        &call("CHECK", &with_prev(&conf, &ra), "gc-keep", Some(&pa)),
    );
    assert_silent_ok(
        "CHECK of the other network's attachment",
        &call("CHECK", &with_prev(&other_conf, &rc), "gc-other", Some(&pc)),
    );
}

/// The MTU from `--mtu`, and from the netconf's `mtu`, is on both ends and
/// in 1.1.0 results.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn mtu_from_flag_and_from_netconf() {
    require_root();
    let daemon = daemon_with(&DUAL, Some(1400));
    assert_eq!(daemon.node_info().mtu, 1400);

    let conf = daemon.netconf("1.1.0", "mtu");
    let pa = Netns::new("pa");
    let ra = add_ok(&conf, "mtu-flag", &pa);
    let wa = read_result(&ra, "1.1.0", &pa, "eth0", 1400);
    assert_wired(&daemon, &pa, &wa, 1400);

    let mut big = conf.clone();
    big["mtu"] = json!(9000);
    let pb = Netns::new("pb");
    let rb = add_ok(&big, "mtu-conf", &pb);
    let wb = read_result(&rb, "1.1.0", &pb, "eth0", 9000);
    assert_wired(&daemon, &pb, &wb, 9000);
    assert_silent_ok(
        "CHECK",
        &call("CHECK", &with_prev(&big, &rb), "mtu-conf", Some(&pb)),
    );

    // An older version prints no mtu, but the kernel has it all the same.
    let mut old = daemon.netconf("1.0.0", "mtu");
    old["mtu"] = json!(1280);
    let pc = Netns::new("pc");
    let rc = add_ok(&old, "mtu-old", &pc);
    let wc = read_result(&rc, "1.0.0", &pc, "eth0", 1280);
    assert_wired(&daemon, &pc, &wc, 1280);
    assert_ping_within(&pa, wb.ips[0], PING_WITHIN);
}

/// When one family's pool is full, ADD fails with 100 naming that pool and
/// gives back the address it took from the other family.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn exhausting_one_family_rolls_back_the_other() {
    require_root();
    const V4: &str = "10.80.0.0/30";
    const V6: &str = "fd00:80::/120";
    let daemon = Daemon::with_cidrs(&[V4, V6], &[]);
    let conf = daemon.netconf("1.1.0", "half");
    let pods: Vec<Netns> = (0..3).map(|_| Netns::new("pod")).collect();
    for (i, pod) in pods.iter().take(2).enumerate() {
        add_ok(&conf, &format!("half-{i}"), pod);
    }
    assert_eq!(pool_usage(&daemon, V4), (2, 0));
    assert_eq!(pool_usage(&daemon, V6), (2, 253));

    let out = call("ADD", &conf, "half-2", Some(&pods[2]));
    assert_code("ADD with the IPv4 pool full", &out, &[100]);
    assert!(error_text(&out).contains(V4), "names {V4}: {out}");
    assert_eq!(pool_usage(&daemon, V6), (2, 253), "IPv6 given back");
    assert_eq!(pods[2].link_names(), ["lo"]);
    assert_eq!(daemon.attachments().len(), 2);
}
