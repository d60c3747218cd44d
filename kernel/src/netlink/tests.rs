//! Netlink tests. The pure ones run anywhere; the kernel ones need root
//! and run on a thread that first unshares its own "node" netns, with pod
//! netns made the same way and held only by an fd. When a test ends, even by
//! panic, the thread exits, the fds close, and the kernel destroys the
//! namespaces with everything in them: nothing is ever made in the machine's
//! own netns.

use std::fs::File;
use std::future::Future;
use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use nix::sched::{unshare, CloneFlags};
use serde_json::Value;

use super::*;
use crate::host::enable_forwarding;
use crate::{host_ifname, pod_mac, PodNetns};

// ---------------------------------------------------------------- pure

#[test]
fn host_ifname_is_short_stable_and_distinct() {
    let a = host_ifname("tether", "0123456789abcdef0123456789abcdef", "eth0");
    assert_eq!(a.len(), 15);
    assert!(a.starts_with(HOST_IFNAME_PREFIX));
    assert!(a[3..]
        .chars()
        .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)));
    assert_eq!(
        a,
        host_ifname("tether", "0123456789abcdef0123456789abcdef", "eth0")
    );
    assert_ne!(
        a,
        host_ifname("tether", "0123456789abcdef0123456789abcdef", "net1")
    );
    assert_ne!(
        a,
        host_ifname("other", "0123456789abcdef0123456789abcdef", "eth0")
    );
    // The separators matter: ("ab", "c") and ("a", "bc") are different keys.
    assert_ne!(
        host_ifname("ab", "c", "eth0"),
        host_ifname("a", "bc", "eth0")
    );
    // Pinned: a change of algorithm would orphan every existing veth.
    assert_eq!(host_ifname("", "", ""), "tth08328807b4eb");
    assert_eq!(host_ifname("tether", "abc", "eth0"), "tthf772216ec608");
}

#[test]
fn pod_mac_embeds_the_address() {
    let v4: IpAddr = "10.1.0.5".parse().unwrap();
    let v6: IpAddr = "2001:db8::a:b0c:d0e".parse().unwrap();
    assert_eq!(pod_mac(&[v4]).octets(), [0x0a, 0x58, 10, 1, 0, 5]);
    assert_eq!(pod_mac(&[v6, v4]).octets(), [0x0a, 0x58, 10, 1, 0, 5]);
    assert_eq!(
        pod_mac(&[v6]).octets(),
        [0x0a, 0x58, 0x0b, 0x0c, 0x0d, 0x0e]
    );
    assert_eq!(pod_mac(&[]).octets(), [0x0a, 0x58, 0, 0, 0, 0]);
    // Locally administered, unicast.
    assert_eq!(pod_mac(&[v4]).octets()[0] & 0b11, 0b10);
    assert_eq!(pod_mac(&[v4]).to_string(), "0a:58:0a:01:00:05");
    assert_eq!(GATEWAY_MAC.to_string(), "0a:58:a9:fe:01:01");
}

#[test]
fn open_netns_refuses_what_is_not_a_netns() {
    for (path, why) in [
        ("var/run/netns/x", "not an absolute path"),
        ("/nonexistent/tether-test-netns", "does not exist"),
        ("/etc/hostname", "not a namespace file"),
    ] {
        let err = open_netns(Path::new(path)).expect_err(path);
        assert_eq!(err.code(), 4, "{path}: {err}");
        assert!(err.to_string().contains("CNI_NETNS"), "{err}");
        assert!(err.to_string().contains(why), "{path}: {err}");
    }
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn open_netns_accepts_a_netns_and_refuses_other_namespaces() {
    require_root!();
    open_netns(Path::new("/proc/self/ns/net")).expect("own netns");
    let err = open_netns(Path::new("/proc/self/ns/mnt")).expect_err("mount ns");
    assert_eq!(err.code(), 4);
    assert!(err.to_string().contains("not a network namespace"), "{err}");
}

mod handover_tests;
mod policy_tests;
mod tap_tests;

// ---------------------------------------------------------------- harness

pub(super) fn is_root() -> bool {
    nix::unistd::Uid::effective().is_root()
}

/// Fails the test, loudly, unless it runs as root. These tests need real
/// network namespaces; a test that skipped itself would pass in a run that
/// proved nothing (CI runs as root, so there they always run).
macro_rules! require_root {
    () => {
        assert!(
            is_root(),
            "this dataplane test needs root: it creates network namespaces, veths and \
             routes. Run `make test` (as root); it never skips."
        );
    };
}
pub(super) use require_root;

/// The running kernel's (major, minor), for the few tests whose answer
/// depends on it.
fn kernel_release() -> (u32, u32) {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("osrelease");
    let mut parts = release
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(|n| n.parse().expect("a kernel release starts major.minor"));
    (parts.next().expect("major"), parts.next().expect("minor"))
}

pub(super) fn netns_inode(path: &str) -> u64 {
    std::fs::metadata(path).expect(path).ino()
}

/// Runs `body` on a new thread inside a new netns (the "node"), on a
/// current-thread runtime, so that the dataplane's connection, its sysctl
/// writes and every command run from the body all land in the test's netns.
fn in_node_netns<F, Fut>(body: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()>,
{
    let outcome = std::thread::spawn(move || {
        let root = netns_inode("/proc/thread-self/ns/net");
        unshare(CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET)");
        assert_ne!(
            netns_inode("/proc/thread-self/ns/net"),
            root,
            "the test thread is still in the root netns"
        );
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(body());
    })
    .join();
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// The node netns as a path other processes can enter (valid while the
/// node thread lives).
fn node_ns_path() -> String {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    format!("/proc/{}/task/{tid}/ns/net", std::process::id())
}

/// A fresh netns, alive as long as the returned fd.
pub(super) struct Netns {
    pub(super) file: File,
    pub(super) path: PathBuf,
    /// The same namespace as the kernel seam holds it.
    pub(super) pod: PodNetns,
}

pub(super) fn new_netns() -> Netns {
    let file = std::thread::spawn(|| {
        unshare(CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET)");
        File::open("/proc/thread-self/ns/net").expect("open own netns")
    })
    .join()
    .expect("netns thread");
    let path = PathBuf::from(format!(
        "/proc/{}/fd/{}",
        std::process::id(),
        file.as_raw_fd()
    ));
    let pod = PodNetns::opened(&path, file.try_clone().expect("dup netns fd"));
    Netns { file, path, pod }
}

/// Runs a command inside a netns given by path; panics with its stderr if it
/// fails.
pub(super) fn run_in(ns: &str, args: &[&str]) -> String {
    let out = Command::new("nsenter")
        .arg(format!("--net={ns}"))
        .args(args)
        .output()
        .expect("nsenter");
    assert!(
        out.status.success(),
        "{args:?} in {ns}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn ip_json(ns: &str, args: &[&str]) -> Vec<Value> {
    let mut full = vec!["ip", "-j"];
    full.extend_from_slice(args);
    let text = run_in(ns, &full);
    if text.trim().is_empty() {
        return Vec::new();
    }
    match serde_json::from_str(&text).expect("ip -j output") {
        Value::Array(v) => v,
        other => panic!("unexpected ip output {other}"),
    }
}

/// A link's operational state as `ip` shows it, read again while the
/// kernel has not yet settled it. On 6.1 a veth whose peer, in another
/// netns, has the same ifindex (eth0 and its peer are both index 2 in
/// these fresh netns) shows UNKNOWN or DOWN for up to a second after both
/// ends are up: linkwatch takes such a link for a local one and applies
/// the delay of a non-urgent event (tests/guest/kernel-suite.sh runs this
/// on 6.1). On 6.18 it is UP at once. The limit is a guard against a state
/// that never comes, not a measure.
fn operstate_once_settled(ns: &str, ifname: &str) -> String {
    let limit = Instant::now() + Duration::from_secs(10);
    loop {
        let state = ip_json(ns, &["link", "show", "dev", ifname])[0]["operstate"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        if !matches!(state.as_str(), "UNKNOWN" | "DOWN") || Instant::now() > limit {
            return state;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One echo from `ns` to `target` answered within 5 s: generous, for the
/// TCG guest of the min-kernel run on a loaded machine (where neighbour
/// resolution alone can take a second); an answer ends the wait at once.
pub(super) fn pings(ns: &str, target: &str) -> bool {
    let family = if target.contains(':') { "-6" } else { "-4" };
    Command::new("nsenter")
        .arg(format!("--net={ns}"))
        .args(["busybox", "ping", family, "-c1", "-W5", target])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// One test pod: its netns and what wiring it should get.
struct TestPod {
    ns: Netns,
    ifname: String,
    host: String,
    ips: Vec<IpAddr>,
    mac: Mac,
    mtu: u32,
}

impl TestPod {
    fn new(id: &str, ips: &[&str]) -> Self {
        let ips: Vec<IpAddr> = ips.iter().map(|s| s.parse().expect("ip")).collect();
        Self {
            ns: new_netns(),
            ifname: "eth0".into(),
            host: host_ifname("test", id, "eth0"),
            mac: pod_mac(&ips),
            ips,
            mtu: 1450,
        }
    }

    fn wiring(&self) -> PodWiring<'_> {
        PodWiring {
            netns: &self.ns.pod,
            pod_ifname: &self.ifname,
            host_ifname: &self.host,
            pod_mac: self.mac,
            ips: &self.ips,
            mtu: self.mtu,
            routed: true,
            tap: None,
            managed_tap: false,
        }
    }

    fn path(&self) -> &str {
        self.ns.path.to_str().expect("utf-8 path")
    }
}

/// `nft -f -` with `script` in the calling thread's netns.
pub(super) fn nft(script: &str) {
    use std::io::Write;
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("nft");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(script.as_bytes())
        .expect("script");
    assert!(
        child.wait().expect("nft").success(),
        "nft refused:\n{script}"
    );
}

fn connect() -> Netlink {
    let dp = Netlink::connect().expect("connect");
    enable_forwarding().expect("enable forwarding");
    dp
}

async fn rewire(dp: &Netlink, w: &PodWiring<'_>) {
    dp.delete_link(w.host_ifname).await.expect("delete");
    dp.wire(w).await.expect("wire again");
    dp.check(w).await.expect("check after wiring again");
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

fn code_of(r: Result<()>) -> u32 {
    r.expect_err("expected an error").code()
}

// ---------------------------------------------------------------- kernel

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn wired_pods_have_their_addresses_routes_and_reach_each_other() {
    require_root!();
    in_node_netns(|| async {
        let dp = connect();
        let node = node_ns_path();
        let a = TestPod::new("a", &["10.1.0.5", "2001:db8::5"]);
        let b = TestPod::new("b", &["10.1.0.6", "2001:db8::6"]);
        let c = TestPod::new("c", &["2001:db8::7"]);
        for p in [&a, &b, &c] {
            dp.wire(&p.wiring()).await.expect("wire");
        }

        // Forwarding is on in the node netns (and only there).
        assert_eq!(
            std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward")
                .unwrap()
                .trim(),
            "1"
        );

        // Pod side, as `ip` sees it.
        let link = &ip_json(a.path(), &["addr", "show", "dev", "eth0"])[0];
        // Up, and with carrier: both ends are up.
        let flags = strings(&link["flags"]);
        assert!(
            flags.contains(&"UP".to_string()) && flags.contains(&"LOWER_UP".to_string()),
            "{link}"
        );
        assert_eq!(operstate_once_settled(a.path(), "eth0"), "UP", "{link}");
        assert_eq!(link["address"], a.mac.to_string());
        assert_eq!(link["mtu"], 1450);
        let addrs: Vec<(String, u64)> = link["addr_info"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| {
                (
                    i["local"].as_str().unwrap().to_owned(),
                    i["prefixlen"].as_u64().unwrap(),
                )
            })
            .collect();
        assert!(addrs.contains(&("10.1.0.5".into(), 32)), "{addrs:?}");
        assert!(addrs.contains(&("2001:db8::5".into(), 128)), "{addrs:?}");
        // No DAD: the address is usable at once.
        let v6 = link["addr_info"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["local"] == "2001:db8::5")
            .unwrap();
        assert!(v6.get("tentative").is_none(), "{v6}");

        let neigh = ip_json(a.path(), &["neigh", "show", "dev", "eth0"]);
        for gw in ["169.254.1.1", "fe80::1"] {
            let entry = neigh
                .iter()
                .find(|n| n["dst"] == gw)
                .unwrap_or_else(|| panic!("{gw}: {neigh:?}"));
            assert_eq!(entry["lladdr"], "0a:58:a9:fe:01:01");
            assert_eq!(strings(&entry["state"]), vec!["PERMANENT"]);
        }
        let r4 = ip_json(a.path(), &["-4", "route", "show", "default"]);
        assert_eq!(r4.len(), 1, "{r4:?}");
        assert_eq!(r4[0]["gateway"], "169.254.1.1");
        assert_eq!(r4[0]["dev"], "eth0");
        assert!(
            strings(&r4[0]["flags"]).contains(&"onlink".to_string()),
            "{r4:?}"
        );
        let r6 = ip_json(a.path(), &["-6", "route", "show", "default"]);
        assert_eq!(r6.len(), 1, "{r6:?}");
        assert_eq!(r6[0]["gateway"], "fe80::1");
        assert_eq!(r6[0]["dev"], "eth0");

        // Node side.
        let host = &ip_json(&node, &["addr", "show", "dev", &a.host])[0];
        assert_eq!(host["address"], "0a:58:a9:fe:01:01");
        assert!(strings(&host["flags"]).contains(&"UP".to_string()));
        assert!(
            host["addr_info"]
                .as_array()
                .unwrap()
                .iter()
                .any(|i| i["local"] == "fe80::1" && i["prefixlen"] == 64),
            "{host}"
        );
        let proxy = format!("/proc/sys/net/ipv4/conf/{}/proxy_arp", a.host);
        assert_eq!(std::fs::read_to_string(proxy).unwrap().trim(), "1");
        let delay = format!("/proc/sys/net/ipv4/neigh/{}/proxy_delay", a.host);
        assert_eq!(std::fs::read_to_string(delay).unwrap().trim(), "0");
        let routes4 = ip_json(&node, &["-4", "route", "show", "proto", "201"]);
        let routes6 = ip_json(&node, &["-6", "route", "show", "proto", "201"]);
        for (dst, dev, routes) in [
            ("10.1.0.5", &a.host, &routes4),
            ("10.1.0.6", &b.host, &routes4),
            ("2001:db8::5", &a.host, &routes6),
            ("2001:db8::7", &c.host, &routes6),
        ] {
            let route = routes
                .iter()
                .find(|r| r["dst"] == dst)
                .unwrap_or_else(|| panic!("{dst}: {routes:?}"));
            assert_eq!(route["dev"], dev.as_str());
        }
        assert_eq!(
            routes4.iter().find(|r| r["dst"] == "10.1.0.5").unwrap()["scope"],
            "link"
        );
        // The IPv6-only pod got no IPv4 route and no proxy ARP.
        assert_eq!(routes4.len(), 2, "{routes4:?}");
        let proxy_c = format!("/proc/sys/net/ipv4/conf/{}/proxy_arp", c.host);
        assert_eq!(std::fs::read_to_string(proxy_c).unwrap().trim(), "0");

        // The dataplane reads back the same.
        let ours = dp.our_routes().await.expect("our_routes");
        assert_eq!(ours.len(), 5, "{ours:?}");
        assert!(ours.contains(&HostRoute {
            dst: "2001:db8::6".parse().unwrap(),
            prefix_len: 128,
            oif: Some(b.host.clone())
        }));
        let mut links = vec![a.host.clone(), b.host.clone(), c.host.clone()];
        links.sort();
        assert_eq!(dp.our_links().await.expect("our_links"), links);

        // Traffic goes through, both families, both ways.
        assert!(pings(a.path(), "10.1.0.6"), "a -> b over IPv4");
        assert!(pings(b.path(), "10.1.0.5"), "b -> a over IPv4");
        assert!(pings(a.path(), "2001:db8::6"), "a -> b over IPv6");
        assert!(pings(c.path(), "2001:db8::5"), "c -> a over IPv6");

        for p in [&a, &b, &c] {
            dp.check(&p.wiring()).await.expect("check after wire");
        }
    });
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn veth_creation_answers_both_indexes() {
    require_root!();
    in_node_netns(|| async {
        let dp = connect();
        let p = TestPod::new("echo", &["10.1.0.5"]);
        let created = dp
            .try_create_veth(&p.wiring(), &p.ns.file)
            .await
            .expect("create");
        // From 6.3 the kernel echoes the new link, and the echo saves a
        // lookup on each side; before, the host end is looked up by name
        // and the pod end is left to the pod side.
        let host = &ip_json(&node_ns_path(), &["link", "show", &p.host])[0];
        assert_eq!(
            u64::from(created.host_index),
            host["ifindex"].as_u64().unwrap()
        );
        let pod = &ip_json(p.path(), &["link", "show", "eth0"])[0];
        let echoed = kernel_release() >= (6, 3);
        assert_eq!(
            created.peer_index.map(u64::from),
            pod["ifindex"].as_u64().filter(|_| echoed),
            "kernel {:?}",
            kernel_release()
        );
        assert_eq!(pod["address"], p.mac.to_string());
    });
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn check_names_each_difference() {
    require_root!();
    in_node_netns(|| async {
        let dp = connect();
        let node = node_ns_path();
        let p = TestPod::new("check", &["10.1.0.5", "2001:db8::5"]);
        let w = p.wiring();
        let ns = p.path();
        dp.wire(&w).await.expect("wire");
        dp.check(&w).await.expect("clean check");

        run_in(ns, &["ip", "addr", "del", "10.1.0.5/32", "dev", "eth0"]);
        assert_eq!(code_of(dp.check(&w).await), 112, "pod address removed");
        run_in(ns, &["ip", "addr", "add", "10.1.0.5/24", "dev", "eth0"]);
        assert_eq!(
            code_of(dp.check(&w).await),
            112,
            "pod address with a wrong prefix"
        );
        // Losing its last IPv4 address, the kernel also flushed the pod's
        // IPv4 routes and neighbours: wire afresh.
        rewire(&dp, &w).await;

        run_in(ns, &["ip", "route", "del", "default", "via", "169.254.1.1"]);
        assert_eq!(code_of(dp.check(&w).await), 113, "v4 default route removed");
        run_in(
            ns,
            &[
                "ip",
                "route",
                "add",
                "default",
                "via",
                "169.254.1.1",
                "dev",
                "eth0",
                "onlink",
            ],
        );
        run_in(
            ns,
            &["ip", "-6", "route", "del", "default", "via", "fe80::1"],
        );
        assert_eq!(code_of(dp.check(&w).await), 113, "v6 default route removed");
        run_in(
            ns,
            &[
                "ip", "-6", "route", "add", "default", "via", "fe80::1", "dev", "eth0",
            ],
        );
        run_in(ns, &["ip", "neigh", "del", "169.254.1.1", "dev", "eth0"]);
        assert_eq!(
            code_of(dp.check(&w).await),
            113,
            "gateway neighbour removed"
        );
        run_in(
            ns,
            &[
                "ip",
                "neigh",
                "replace",
                "169.254.1.1",
                "lladdr",
                "0a:58:a9:fe:01:01",
                "dev",
                "eth0",
                "nud",
                "permanent",
            ],
        );
        dp.check(&w).await.expect("pod routes restored");

        run_in(ns, &["ip", "link", "set", "eth0", "mtu", "1400"]);
        assert_eq!(code_of(dp.check(&w).await), 111, "pod MTU changed");
        run_in(ns, &["ip", "link", "set", "eth0", "mtu", "1450"]);
        dp.check(&w).await.expect("pod MTU restored");
        run_in(
            ns,
            &["ip", "link", "set", "eth0", "address", "0a:58:00:00:00:01"],
        );
        assert_eq!(code_of(dp.check(&w).await), 111, "pod MAC changed");
        // A new MAC flushes the interface's neighbours, permanent ones too.
        rewire(&dp, &w).await;

        run_in(
            &node,
            &["ip", "route", "del", "10.1.0.5/32", "dev", &p.host],
        );
        let err = dp.check(&w).await.expect_err("host route removed");
        assert_eq!(err.code(), 115, "{err}");
        assert!(err.to_string().contains("10.1.0.5/32"), "{err}");
        assert_eq!(
            dp.ensure_host_routes(&p.host, &p.ips)
                .await
                .expect("ensure"),
            1
        );
        assert_eq!(
            dp.ensure_host_routes(&p.host, &p.ips)
                .await
                .expect("ensure again"),
            0
        );
        dp.check(&w).await.expect("host route restored");
        // A route to the address with another protocol is not ours.
        run_in(
            &node,
            &[
                "ip",
                "-6",
                "route",
                "replace",
                "2001:db8::5/128",
                "dev",
                &p.host,
                "proto",
                "static",
            ],
        );
        assert_eq!(code_of(dp.check(&w).await), 115, "host route taken over");
        assert_eq!(
            dp.ensure_host_routes(&p.host, &p.ips)
                .await
                .expect("ensure"),
            1
        );
        dp.check(&w).await.expect("host route reclaimed");

        run_in(
            &node,
            &["ip", "link", "set", &p.host, "address", "0a:58:00:00:00:02"],
        );
        assert_eq!(code_of(dp.check(&w).await), 114, "host MAC changed");
        run_in(
            &node,
            &["ip", "link", "set", &p.host, "address", "0a:58:a9:fe:01:01"],
        );
        dp.check(&w).await.expect("host MAC restored");

        // Down last: the kernel flushes the routes of a downed link.
        run_in(&node, &["ip", "link", "set", &p.host, "down"]);
        assert_eq!(code_of(dp.check(&w).await), 114, "host veth down");
        run_in(&node, &["ip", "link", "set", &p.host, "up"]);
        run_in(ns, &["ip", "link", "set", "eth0", "down"]);
        assert_eq!(code_of(dp.check(&w).await), 111, "pod interface down");

        // Both ends go with the host veth; the pod side is checked first.
        dp.delete_link(&p.host).await.expect("delete");
        assert_eq!(code_of(dp.check(&w).await), 111, "pod interface gone");
    });
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn existing_pod_interface_is_refused_and_left_alone() {
    require_root!();
    in_node_netns(|| async {
        let dp = connect();
        let p = TestPod::new("taken", &["10.1.0.5"]);
        run_in(
            p.path(),
            &[
                "ip", "link", "add", "eth0", "type", "veth", "peer", "name", "peer0",
            ],
        );
        assert!(pod_interface_exists(&p.ns.file, "eth0")
            .await
            .expect("exists"));
        assert!(!pod_interface_exists(&p.ns.file, "eth1")
            .await
            .expect("exists"));

        let err = dp.wire(&p.wiring()).await.expect_err("eth0 is taken");
        assert_eq!(err.code(), 102, "{err}");
        assert!(
            matches!(&err, KernelError::Exists(n) if n == "eth0"),
            "{err}"
        );
        assert!(dp.our_links().await.expect("links").is_empty());
        assert!(dp.our_routes().await.expect("routes").is_empty());
        let eth0 = &ip_json(p.path(), &["-d", "link", "show", "eth0"])[0];
        assert_eq!(eth0["linkinfo"]["info_kind"], "veth", "{eth0}");
        assert_eq!(ip_json(p.path(), &["link", "show", "peer0"]).len(), 1);
    });
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn stale_host_veth_is_replaced() {
    require_root!();
    in_node_netns(|| async {
        let dp = connect();
        let node = node_ns_path();
        let p = TestPod::new("stale", &["10.1.0.5"]);
        run_in(
            &node,
            &[
                "ip",
                "link",
                "add",
                &p.host,
                "type",
                "veth",
                "peer",
                "name",
                "stalepeer",
            ],
        );
        dp.wire(&p.wiring()).await.expect("wire over a stale veth");
        dp.check(&p.wiring()).await.expect("check");
        let stale_peer = Command::new("nsenter")
            .args([
                format!("--net={node}"),
                "ip".into(),
                "link".into(),
                "show".into(),
                "stalepeer".into(),
            ])
            .output()
            .expect("ip");
        assert!(!stale_peer.status.success(), "the stale pair is gone");
    });
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn failed_wire_leaves_nothing_behind() {
    require_root!();
    in_node_netns(|| async {
        let dp = connect();
        let p = TestPod::new("fail", &["10.1.0.5"]);
        // Someone else's default route makes the pod side fail after the veth
        // and the host route exist.
        run_in(
            p.path(),
            &[
                "ip", "link", "add", "other0", "type", "veth", "peer", "name", "other1",
            ],
        );
        run_in(p.path(), &["ip", "link", "set", "other0", "up"]);
        run_in(
            p.path(),
            &["ip", "route", "add", "default", "dev", "other0"],
        );
        let err = dp
            .wire(&p.wiring())
            .await
            .expect_err("default route exists");
        assert_eq!(err.code(), 101, "{err}");
        assert!(
            err.to_string().contains("default route via 169.254.1.1"),
            "{err}"
        );
        assert!(dp.our_links().await.expect("links").is_empty());
        assert!(dp.our_routes().await.expect("routes").is_empty());
        assert!(!pod_interface_exists(&p.ns.file, "eth0")
            .await
            .expect("exists"));
    });
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn batch_deletion_removes_exactly_the_named_veths() {
    require_root!();
    in_node_netns(|| async {
        let dp = connect();
        let node = node_ns_path();
        let pods: Vec<TestPod> = (0..4)
            .map(|i| TestPod::new(&format!("batch{i}"), &[&format!("10.2.0.{}", i + 1)]))
            .collect();
        for p in &pods {
            dp.wire(&p.wiring()).await.expect("wire");
        }
        // A veth that is not ours, and one of ours not in the batch.
        run_in(
            &node,
            &[
                "ip", "link", "add", "keep0", "type", "veth", "peer", "name", "keep1",
            ],
        );
        let batch = vec![
            pods[0].host.clone(),
            pods[1].host.clone(),
            pods[2].host.clone(),
            host_ifname("test", "never-wired", "eth0"),
            "keep0".to_string(),
        ];
        dp.delete_links(&batch).await.expect("batch delete");
        assert_eq!(
            dp.our_links().await.expect("links"),
            vec![pods[3].host.clone()]
        );
        for p in &pods[..3] {
            assert!(!pod_interface_exists(&p.ns.file, "eth0")
                .await
                .expect("exists"));
        }
        dp.check(&pods[3].wiring())
            .await
            .expect("the veth left out is intact");
        assert_eq!(
            ip_json(&node, &["link", "show", "keep0"]).len(),
            1,
            "not ours: kept"
        );
        // Nothing is left in the reserved group, and a batch of names that
        // are all gone is a no-op.
        let group = DOOMED_GROUP.to_string();
        // (iproute2 prints an empty object for each link the filter drops.)
        let in_group = ip_json(&node, &["link", "show", "group", &group])
            .iter()
            .filter(|l| l.get("ifname").is_some())
            .count();
        assert_eq!(in_group, 0, "links left in the reserved group");
        dp.delete_links(&batch[..3])
            .await
            .expect("batch delete again");
        dp.delete_links(&[]).await.expect("empty batch");
    });
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn teardown_removes_everything_and_is_idempotent() {
    require_root!();
    in_node_netns(|| async {
        let dp = connect();
        let node = node_ns_path();
        let p = TestPod::new("down", &["10.1.0.5", "2001:db8::5"]);
        dp.wire(&p.wiring()).await.expect("wire");
        // A route to a pod address with another protocol is not ours to remove.
        run_in(
            &node,
            &[
                "ip", "link", "add", "keep0", "type", "veth", "peer", "name", "keep1",
            ],
        );
        run_in(&node, &["ip", "link", "set", "keep0", "up"]);
        run_in(
            &node,
            &[
                "ip",
                "route",
                "add",
                "10.1.0.99/32",
                "dev",
                "keep0",
                "proto",
                "static",
            ],
        );
        let keep: IpAddr = "10.1.0.99".parse().unwrap();

        let mut ips = p.ips.clone();
        ips.push(keep);
        dp.remove_host_routes(&ips).await.expect("remove routes");
        assert!(dp.our_routes().await.expect("routes").is_empty());
        assert_eq!(
            ip_json(&node, &["-4", "route", "show", "10.1.0.99/32"]).len(),
            1
        );
        dp.remove_host_routes(&ips)
            .await
            .expect("remove routes again");

        dp.delete_link(&p.host).await.expect("delete");
        assert!(dp.our_links().await.expect("links").is_empty());
        assert!(!pod_interface_exists(&p.ns.file, "eth0")
            .await
            .expect("exists"));
        dp.delete_link(&p.host).await.expect("delete again");
        let err = dp.delete_link("keep0").await.expect_err("not ours");
        assert_eq!(err.code(), 199);
        assert_eq!(ip_json(&node, &["link", "show", "keep0"]).len(), 1);

        // The same attachment can be wired again at once.
        dp.wire(&p.wiring()).await.expect("rewire");
        dp.check(&p.wiring()).await.expect("check");
    });
}

#[test]
#[ignore = "micro-benchmark: cargo test -p tether-kernel --features root-tests netlink::tests::bench -- --ignored --nocapture"]
fn bench_wire_200_pods() {
    require_root!();
    in_node_netns(|| async {
        let dp = connect();
        let dual: Vec<TestPod> = (0..200u32)
            .map(|i| {
                let v4 = format!("10.2.{}.{}", i / 250, i % 250 + 1);
                let v6 = format!("2001:db8::2:{i:x}");
                TestPod::new(&format!("dual{i}"), &[&v4, &v6])
            })
            .collect();
        let single: Vec<TestPod> = (0..200u32)
            .map(|i| {
                let v4 = format!("10.3.{}.{}", i / 250, i % 250 + 1);
                TestPod::new(&format!("single{i}"), &[&v4])
            })
            .collect();
        let mut probe = Vec::with_capacity(dual.len());
        let mut wire_dual = Vec::with_capacity(dual.len());
        let mut wire_v4 = Vec::with_capacity(single.len());
        let mut check = Vec::with_capacity(dual.len());
        for (d, s) in dual.iter().zip(&single) {
            let t = Instant::now();
            assert!(!pod_interface_exists(&d.ns.file, "eth0")
                .await
                .expect("probe"));
            probe.push(t.elapsed());
            let t = Instant::now();
            dp.wire(&d.wiring()).await.expect("wire");
            wire_dual.push(t.elapsed());
            let t = Instant::now();
            dp.wire(&s.wiring()).await.expect("wire");
            wire_v4.push(t.elapsed());
            let t = Instant::now();
            dp.check(&d.wiring()).await.expect("check");
            check.push(t.elapsed());
        }
        let mut routes = Vec::with_capacity(dual.len());
        let mut links = Vec::with_capacity(dual.len());
        for p in dual.iter().chain(&single) {
            let t = Instant::now();
            dp.remove_host_routes(&p.ips).await.expect("routes");
            routes.push(t.elapsed());
            let t = Instant::now();
            dp.delete_link(&p.host).await.expect("delete");
            links.push(t.elapsed());
        }
        for (name, samples) in [
            ("pod_interface_exists", probe),
            ("wire (dual-stack)", wire_dual),
            ("wire (IPv4 only)", wire_v4),
            ("check (dual-stack)", check),
            ("remove_host_routes", routes),
            ("delete_link", links),
        ] {
            let (p50, p90) = percentiles(samples);
            println!(
                "{name:>22}: p50 {:>6} us, p90 {:>6} us",
                p50.as_micros(),
                p90.as_micros()
            );
        }
    });
}

fn percentiles(mut samples: Vec<Duration>) -> (Duration, Duration) {
    samples.sort();
    let at = |q: usize| samples[(samples.len() * q / 100).min(samples.len() - 1)];
    (at(50), at(90))
}
