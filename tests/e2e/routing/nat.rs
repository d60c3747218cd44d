//! Outbound NAT: pods reach a server "outside" the cluster, in a netns of
//! its own that has no route back to pod addresses, with the node's
//! address as their source; pod to pod keeps its source; a `--no-nat-to`
//! range is reached un-NATed; restarts leave one identical table (and put
//! back one someone changed); `--outbound-nat=false` removes it.
//!
//! The topology is the test's own: a node netns joined by a veth pair to
//! an outside netns (documentation addresses, 198.51.100.0/24 and
//! 2001:db8:91::/64), whose default routes point outside. tetherd, and so
//! its nft table, lives in the node netns; nothing touches the machine's.

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tether_e2e::{
    add, assert_ping_within, ping, require_root, tether_bin, AddResult, Daemon, DaemonOpts, Netns,
};

const POD_CIDRS: [&str; 2] = ["10.91.0.0/24", "fd00:91::/64"];
/// The node's uplink, and so the source of every NATed packet.
const NODE_V4: &str = "198.51.100.1";
const NODE_V6: &str = "2001:db8:91::1";
/// The outside server.
const OUT_V4: &str = "198.51.100.2";
const OUT_V6: &str = "2001:db8:91::2";
/// How long a reachable server may take to answer (the first packets wait
/// for neighbour resolution).
const REACH: Duration = Duration::from_secs(5);
/// How long a connection that must fail is given.
const NO_REACH: Duration = Duration::from_secs(2);

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
}

/// A node netns wired to a fresh outside netns, and tetherd started in it
/// with `extra` arguments. The outside knows only its own subnet.
fn node_with_outside(extra: &[&str]) -> (Daemon, Netns) {
    let node = Netns::new("natnode");
    let outside = Netns::new("natout");
    let n = |args: &[&str]| node.exec_ok(&[&["ip"][..], args].concat());
    let o = |args: &[&str]| outside.exec_ok(&[&["ip"][..], args].concat());
    // Made inside the node netns with its peer born in the outside one:
    // the machine's own netns never holds either end.
    n(&[
        "link",
        "add",
        "up0",
        "type",
        "veth",
        "peer",
        "name",
        "out0",
        "netns",
        outside.name(),
    ]);
    n(&["addr", "add", &format!("{NODE_V4}/24"), "dev", "up0"]);
    n(&[
        "addr",
        "add",
        &format!("{NODE_V6}/64"),
        "dev",
        "up0",
        "nodad",
    ]);
    n(&["link", "set", "up0", "up"]);
    o(&["addr", "add", &format!("{OUT_V4}/24"), "dev", "out0"]);
    o(&[
        "addr",
        "add",
        &format!("{OUT_V6}/64"),
        "dev",
        "out0",
        "nodad",
    ]);
    o(&["link", "set", "out0", "up"]);
    n(&["route", "add", "default", "via", OUT_V4]);
    n(&["-6", "route", "add", "default", "via", OUT_V6]);
    let d = Daemon::start_in(
        node,
        DaemonOpts {
            pod_cidrs: POD_CIDRS.iter().map(|c| c.to_string()).collect(),
            extra_args: extra.iter().map(|a| a.to_string()).collect(),
            ..DaemonOpts::default()
        },
    );
    (d, outside)
}

fn add_pod(d: &Daemon, id: &str, pod: &Netns) -> AddResult {
    AddResult::from_output(&add(&tether_bin(), &d.netconf("1.1.0", "nat"), id, pod))
}

/// `nft list table inet tether` in the node netns; None if there is none.
fn nat_table(d: &Daemon) -> Option<String> {
    let out = d.node().exec(&["nft", "list", "table", "inet", "tether"]);
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A TCP server on `at` in `server_ns`, a client in `client_ns`: one line
/// each way. Ok with the client address the server saw, or Err with why
/// the exchange failed within `limit`.
fn source_seen(
    server_ns: &Netns,
    at: IpAddr,
    client_ns: &Netns,
    limit: Duration,
) -> Result<IpAddr, String> {
    let done = AtomicBool::new(false);
    let (port_tx, port_rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        let server = s.spawn(|| {
            server_ns.run(|| {
                let listener = TcpListener::bind(SocketAddr::new(at, 0))
                    .unwrap_or_else(|e| panic!("bind {at}: {e}"));
                let _ = port_tx.send(listener.local_addr().map(|a| a.port()));
                listener.set_nonblocking(true).expect("nonblocking");
                let deadline = Instant::now() + limit + Duration::from_secs(1);
                while Instant::now() < deadline && !done.load(Ordering::SeqCst) {
                    match listener.accept() {
                        Ok((conn, peer)) => {
                            conn.set_nonblocking(false).expect("blocking");
                            conn.set_read_timeout(Some(limit)).expect("timeout");
                            let mut line = String::new();
                            let mut reader = BufReader::new(&conn);
                            reader.read_line(&mut line).expect("reading the client");
                            (&conn)
                                .write_all(format!("seen {}\n", peer.ip()).as_bytes())
                                .expect("answering");
                            return Some(peer.ip());
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            std::thread::sleep(Duration::from_millis(10))
                        }
                        Err(e) => panic!("accept: {e}"),
                    }
                }
                None
            })
        });
        let port = port_rx
            .recv()
            .expect("the server thread")
            .expect("the server's port");
        let client = client_ns.run(|| -> Result<String, String> {
            let to = SocketAddr::new(at, port);
            let conn = TcpStream::connect_timeout(&to, limit)
                .map_err(|e| format!("connecting to {to}: {e}"))?;
            conn.set_read_timeout(Some(limit))
                .map_err(|e| e.to_string())?;
            (&conn)
                .write_all(b"hello\n")
                .map_err(|e| format!("writing to {to}: {e}"))?;
            let mut line = String::new();
            BufReader::new(&conn)
                .read_line(&mut line)
                .map_err(|e| format!("reading from {to}: {e}"))?;
            Ok(line)
        });
        done.store(true, Ordering::SeqCst);
        let seen = server
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p));
        let line = client?;
        let seen =
            seen.ok_or_else(|| format!("the server saw no client but the client read {line:?}"))?;
        assert_eq!(line.trim(), format!("seen {seen}"), "the server's answer");
        Ok(seen)
    })
}

/// Asserts the outside is reached from `pod` with the node's addresses.
fn assert_natted_to_outside(pod: &Netns, outside: &Netns) {
    for (server, node) in [(OUT_V4, NODE_V4), (OUT_V6, NODE_V6)] {
        assert_ping_within(pod, ip(server), REACH);
        assert_eq!(
            source_seen(outside, ip(server), pod, REACH),
            Ok(ip(node)),
            "the outside server {server} sees the node's address"
        );
    }
}

/// Asserts nothing from `pod` reaches the outside (it has no route back).
fn assert_outside_unreachable(pod: &Netns, outside: &Netns) {
    for server in [OUT_V4, OUT_V6] {
        assert!(!ping(pod, ip(server)), "{server} answered a ping");
        let got = source_seen(outside, ip(server), pod, NO_REACH);
        assert!(got.is_err(), "{server} was reached: {got:?}");
    }
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn pods_reach_the_outside_with_the_nodes_address_and_each_other_with_their_own() {
    require_root();
    let (d, outside) = node_with_outside(&[]);
    let (pod_a, pod_b) = (Netns::new("nata"), Netns::new("natb"));
    let a = add_pod(&d, "nat-a", &pod_a);
    let b = add_pod(&d, "nat-b", &pod_b);

    assert_natted_to_outside(&pod_a, &outside);
    // Pod to pod on the node: no translation.
    for (server, client) in [(&b.v4, &a.v4), (&b.v6, &a.v6)] {
        assert_eq!(
            source_seen(&pod_b, ip(server), &pod_a, REACH),
            Ok(ip(client)),
            "pod b sees pod a's own address"
        );
    }
    let table = nat_table(&d).expect("tether's table in the node netns");
    assert!(
        table.contains("10.91.0.0/24") && table.contains("fd00:91::/64"),
        "{table}"
    );
    assert_eq!(table.matches("masquerade").count(), 2, "{table}");
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn a_no_nat_to_range_is_reached_with_the_pods_own_address() {
    require_root();
    let (d, outside) = node_with_outside(&["--no-nat-to", "198.51.100.0/24,2001:db8:91::/64"]);
    // This outside routes the pods back through the node.
    outside.exec_ok(&["ip", "route", "add", POD_CIDRS[0], "via", NODE_V4]);
    outside.exec_ok(&["ip", "-6", "route", "add", POD_CIDRS[1], "via", NODE_V6]);
    let pod = Netns::new("natx");
    let a = add_pod(&d, "nat-x", &pod);
    for (server, own) in [(OUT_V4, &a.v4), (OUT_V6, &a.v6)] {
        assert_ping_within(&pod, ip(server), REACH);
        assert_eq!(
            source_seen(&outside, ip(server), &pod, REACH),
            Ok(ip(own)),
            "{server} is in --no-nat-to: it sees the pod's address"
        );
    }
    let table = nat_table(&d).expect("tether's table");
    assert!(
        table.contains("198.51.100.0/24") && table.contains("2001:db8:91::/64"),
        "{table}"
    );
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn restarts_leave_one_identical_table_and_outbound_nat_off_removes_it() {
    require_root();
    let (mut d, outside) = node_with_outside(&[]);
    let pod = Netns::new("natr");
    let pod_peer = Netns::new("natp");
    add_pod(&d, "nat-r", &pod);
    let peer = add_pod(&d, "nat-p", &pod_peer);
    let first = nat_table(&d).expect("tether's table");

    d.restart();
    assert_eq!(
        nat_table(&d).as_deref(),
        Some(first.as_str()),
        "a restart changed the table"
    );
    assert_natted_to_outside(&pod, &outside);

    // Someone empties the chain: the outside is lost until the next start
    // puts the table back as it was.
    d.node()
        .exec_ok(&["nft", "flush", "chain", "inet", "tether", "postrouting"]);
    assert_outside_unreachable(&pod, &outside);
    d.restart();
    assert_eq!(
        nat_table(&d).as_deref(),
        Some(first.as_str()),
        "not put back"
    );
    assert_natted_to_outside(&pod, &outside);

    d.stop();
    d.set_arg("--outbound-nat", "false");
    d.restart();
    assert_eq!(nat_table(&d), None, "--outbound-nat=false left the table");
    assert!(d.log().contains("outbound NAT: off"), "{}", d.log());
    assert_outside_unreachable(&pod, &outside);
    // Pods still reach each other.
    assert_ping_within(&pod, ip(&peer.v4), REACH);
    assert_ping_within(&pod, ip(&peer.v6), REACH);
}
