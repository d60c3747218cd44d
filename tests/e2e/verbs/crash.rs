//! `kill -9` of `tetherd` and what the node looks like afterwards.
//!
//! - In the middle of a burst of ADDs and DELs (three kill points): after a
//!   restart and a GC that names exactly the attachments whose last
//!   acknowledged verb was ADD, the node holds exactly those attachments,
//!   each with its addresses, route and veth, and nothing else: no leaked
//!   address, no orphan route or link, no address held twice.
//! - Right after acknowledged ADDs: they survive the crash.
//! - With no traffic: startup reconciliation removes a veth and routes that
//!   look like ours but that no attachment owns.
//!
//! The kill points are random; the seed is printed and can be fixed with
//! `TETHER_E2E_SEED=<n>` to replay a failure.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::json;
use tether_e2e::{
    add, assert_distinct, assert_pod_holds, assert_tether_links_settle, cni, del, expected_routes,
    parallel, require_root, tether_bin, unique_name, wait_link_gone, AddResult, CniEnv, CniOutput,
    Daemon, DaemonOpts, Netns, LINK_SETTLE, REF_PLUGIN_DIR, ROUTE_PROTOCOL,
};

const NETWORK: &str = "tether-crash";
const POD_CIDR_V4: &str = "10.97.0.0/24";
const POD_CIDR_V6: &str = "fd00:97::/120";

/// A dual-stack daemon in its own node netns.
fn dual_stack_daemon() -> Daemon {
    Daemon::start(DaemonOpts {
        pod_cidrs: vec![POD_CIDR_V4.to_owned(), POD_CIDR_V6.to_owned()],
        ..DaemonOpts::default()
    })
}

// ---------------------------------------------------------------------------
// Private helpers
// ---------------------------------------------------------------------------

/// GC of [`NETWORK`] keeping exactly `valid` (container ids, ifname eth0).
fn gc(daemon: &Daemon, valid: &[&str]) -> CniOutput {
    let mut conf = daemon.netconf("1.1.0", NETWORK);
    conf["cni.dev/valid-attachments"] = valid
        .iter()
        .map(|id| json!({"containerID": id, "ifname": "eth0"}))
        .collect();
    let env = CniEnv {
        command: Some("GC".to_owned()),
        path: Some(REF_PLUGIN_DIR.to_owned()),
        ..CniEnv::default()
    };
    cni(
        &tether_bin(),
        &env,
        &serde_json::to_vec(&conf).expect("a JSON value serializes"),
    )
}

/// Panics unless the daemon and the node hold exactly `live` (container id
/// → its last ADD, with its pod): attachments with the same addresses and
/// veth, one holder per address, CHECK passing, addresses in the pods, the
/// pools' usage, and the node's routes and veths (waiting for background
/// deletions of the others).
fn assert_node_holds_exactly(daemon: &Daemon, live: &BTreeMap<String, (&Netns, AddResult)>) {
    let listed = daemon.attachments();
    assert_distinct(
        "addresses among the daemon's attachments",
        listed.iter().flat_map(|a| &a.ips),
    );
    let listed_ids: BTreeSet<&str> = listed.iter().map(|a| a.container_id.as_str()).collect();
    let want_ids: BTreeSet<&str> = live.keys().map(String::as_str).collect();
    assert_eq!(listed_ids, want_ids, "attachments listed by the daemon");
    for a in &listed {
        let (pod, added) = &live[&a.container_id];
        let mut ips = a.ips.clone();
        ips.sort();
        let mut want = added.prefixed_ips();
        want.sort();
        assert_eq!(ips, want, "addresses of {}", a.container_id);
        assert_eq!(a.host_interface, added.host, "veth of {}", a.container_id);
        assert_eq!(a.netns, pod.path().display().to_string());
        assert_pod_holds(pod, added);
        added.assert_check_passes(daemon, NETWORK, &a.container_id, pod);
    }
    let n = live.len() as u64;
    assert_eq!(
        daemon.pools_used(),
        BTreeMap::from([(POD_CIDR_V4.to_owned(), n), (POD_CIDR_V6.to_owned(), n)]),
        "pool usage (a leaked or lost address)"
    );
    let node = daemon.node();
    assert_eq!(
        node.tether_routes(),
        expected_routes(live.values().map(|(_, a)| a)),
        "proto-201 routes in the node netns (orphan, missing or misdirected)"
    );
    assert_tether_links_settle(node, live.values().map(|(_, a)| a));
}

/// Adds a route of ours (protocol [`ROUTE_PROTOCOL`]) to `dst` via `dev` in
/// `node`, as tetherd would; `family` is `-4` or `-6`.
fn plant_route(node: &Netns, family: &str, dst: &str, dev: &str) {
    let proto = ROUTE_PROTOCOL.to_string();
    node.exec_ok(&[
        "ip", family, "route", "add", dst, "dev", dev, "proto", &proto,
    ]);
}

/// A small deterministic generator (splitmix64): no dependency needed.
struct Rng(u64);

impl Rng {
    /// Seeded from `TETHER_E2E_SEED` or the clock; prints the seed.
    fn from_env_or_clock(test: &str) -> Rng {
        let seed = std::env::var("TETHER_E2E_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(0)
                    ^ u64::from(std::process::id())
            });
        eprintln!("{test}: TETHER_E2E_SEED={seed}");
        Rng(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut x = self.0;
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^ (x >> 31)
    }

    /// Uniform in `lo..hi` (hi > lo).
    fn below(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo)
    }
}

// ---------------------------------------------------------------------------
// kill -9 in the middle of a burst
// ---------------------------------------------------------------------------

const BURST_PODS: usize = 60;
const BURST_WORKERS: usize = 6;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verb {
    Add,
    Del,
}

/// What a pod's runtime was last told about its attachment.
#[derive(Clone, Debug)]
enum Acked {
    Added(AddResult),
    Deleted,
}

/// One pod of the burst: its verbs, and what each returned.
#[derive(Debug, Default)]
struct PodLog {
    /// (verb, exit status, CNI error code) per call made.
    calls: Vec<(String, i32, Option<u64>)>,
    last: Option<Acked>,
}

/// Runs a burst of ADDs and DELs over [`BURST_PODS`] pods from
/// [`BURST_WORKERS`] threads, kills the daemon with SIGKILL once a random
/// fraction in `kill_window` of the calls has completed (plus a few random
/// milliseconds, to land inside a call), restarts it, runs GC with the
/// attachments whose last acknowledged verb was ADD, and checks the node.
fn crash_mid_burst(test: &str, kill_window: (f64, f64)) {
    require_root();
    let mut rng = Rng::from_env_or_clock(test);
    let mut daemon = dual_stack_daemon();
    let conf = daemon.netconf("1.0.0", NETWORK);
    let bin = tether_bin();
    let pods: Vec<Netns> = parallel(BURST_PODS, |_| Netns::new("kp"));
    let ids: Vec<String> = (0..BURST_PODS).map(|_| unique_name("kc")).collect();
    // Per pod: ADD; ADD, DEL; ADD, DEL, ADD; or ADD, ADD (a repeated ADD).
    let plans: Vec<Vec<Verb>> = (0..BURST_PODS)
        .map(|_| match rng.below(0, 4) {
            0 => vec![Verb::Add],
            1 => vec![Verb::Add, Verb::Del],
            2 => vec![Verb::Add, Verb::Del, Verb::Add],
            _ => vec![Verb::Add, Verb::Add],
        })
        .collect();
    let total: usize = plans.iter().map(Vec::len).sum();
    let fraction =
        kill_window.0 + (kill_window.1 - kill_window.0) * (rng.below(0, 1000) as f64 / 1000.0);
    let kill_after = ((total as f64) * fraction) as usize;
    let jitter = Duration::from_millis(rng.below(0, 15));
    eprintln!("{test}: {total} calls; SIGKILL after {kill_after} of them + {jitter:?}");

    let stop = AtomicBool::new(false);
    let completed = AtomicUsize::new(0);
    let logs: Vec<(usize, PodLog)> = std::thread::scope(|s| {
        let burst = s.spawn(|| {
            parallel(BURST_WORKERS, |w| {
                let mut mine = Vec::new();
                for p in (w..BURST_PODS).step_by(BURST_WORKERS) {
                    let mut log = PodLog::default();
                    for verb in &plans[p] {
                        if stop.load(Ordering::SeqCst) {
                            break;
                        }
                        let out = match verb {
                            Verb::Add => add(&bin, &conf, &ids[p], &pods[p]),
                            Verb::Del => del(&bin, &conf, &ids[p], &pods[p]),
                        };
                        log.calls
                            .push((format!("{verb:?}"), out.status, out.error_code()));
                        if out.success() {
                            log.last = Some(match verb {
                                Verb::Add => Acked::Added(AddResult::from_output(&out)),
                                Verb::Del => Acked::Deleted,
                            });
                        }
                        completed.fetch_add(1, Ordering::SeqCst);
                    }
                    mine.push((p, log));
                }
                mine
            })
        });
        while completed.load(Ordering::SeqCst) < kill_after && !burst.is_finished() {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(jitter);
        // Calls already running stay in flight and meet the crash; no new
        // call starts (an ADD would spend the shim's 3 s connect budget).
        stop.store(true, Ordering::SeqCst);
        let status = daemon.kill9();
        eprintln!(
            "{test}: tetherd killed ({status}) after {} completed calls",
            completed.load(Ordering::SeqCst)
        );
        burst
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
            .into_iter()
            .flatten()
            .collect()
    });

    let mut history = String::new();
    let mut live: BTreeMap<String, (&Netns, AddResult)> = BTreeMap::new();
    for (p, log) in &logs {
        history.push_str(&format!("pod {p} {}: {:?}\n", ids[*p], log.calls));
        if let Some(Acked::Added(a)) = &log.last {
            live.insert(ids[*p].clone(), (&pods[*p], a.clone()));
        }
    }
    eprintln!("{test}: calls per pod:\n{history}");
    assert_distinct(
        "addresses among acknowledged ADDs",
        live.values().flat_map(|(_, a)| [&a.v4, &a.v6]),
    );

    let queue = daemon.state_dir().join("pending-del");
    let queued = std::fs::read_dir(&queue).map_or(0, |d| d.count());
    eprintln!(
        "{test}: {queued} entries in {} before the restart",
        queue.display()
    );
    daemon.restart();
    let valid: Vec<&str> = live.keys().map(String::as_str).collect();
    let out = gc(&daemon, &valid);
    assert!(out.success(), "GC after the restart failed: {out}");
    eprintln!("{test}: {} attachments valid after GC", valid.len());
    assert_node_holds_exactly(&daemon, &live);
    // Pods whose attachment is gone keep no eth0 (its veth peer is gone).
    let stale: Vec<&Netns> = logs
        .iter()
        .filter(|(p, _)| !live.contains_key(&ids[*p]))
        .map(|(p, _)| &pods[*p])
        .collect();
    let cleaned = wait_link_gone(stale.iter().copied(), "eth0", LINK_SETTLE);
    assert!(cleaned, "a pod without a valid attachment still has eth0");
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn kill9_early_in_a_burst_then_restart_and_gc_leave_exactly_the_acked_attachments() {
    crash_mid_burst("kill9_early", (0.05, 0.25));
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn kill9_midway_through_a_burst_then_restart_and_gc_leave_exactly_the_acked_attachments() {
    crash_mid_burst("kill9_midway", (0.35, 0.65));
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn kill9_late_in_a_burst_then_restart_and_gc_leave_exactly_the_acked_attachments() {
    crash_mid_burst("kill9_late", (0.75, 0.95));
}

// ---------------------------------------------------------------------------
// Durability and startup reconciliation
// ---------------------------------------------------------------------------

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn acknowledged_adds_survive_kill9() {
    require_root();
    const PODS: usize = 8;
    let mut daemon = dual_stack_daemon();
    let conf = daemon.netconf("1.0.0", NETWORK);
    let bin = tether_bin();
    let pods: Vec<Netns> = parallel(PODS, |_| Netns::new("dp"));
    let ids: Vec<String> = (0..PODS).map(|_| unique_name("dc")).collect();

    let outs = parallel(PODS, |i| add(&bin, &conf, &ids[i], &pods[i]));
    // The crash follows the last reply at once.
    daemon.kill9();
    for (i, out) in outs.iter().enumerate() {
        assert!(out.success(), "ADD #{i} failed: {out}");
    }
    daemon.restart();

    let live: BTreeMap<String, (&Netns, AddResult)> = outs
        .iter()
        .enumerate()
        .map(|(i, out)| (ids[i].clone(), (&pods[i], AddResult::from_output(out))))
        .collect();
    assert_node_holds_exactly(&daemon, &live);
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn startup_reconciliation_removes_planted_orphans_and_keeps_real_attachments() {
    require_root();
    let mut daemon = dual_stack_daemon();
    let conf = daemon.netconf("1.0.0", NETWORK);
    let pod = Netns::new("rp");
    let id = unique_name("rc");
    let keeper = AddResult::from_output(&add(&tether_bin(), &conf, &id, &pod));
    // No traffic from here on.
    daemon.kill9();

    // While the daemon is down, plant what a crash between a kernel change
    // and its store commit could leave: a veth of ours that no record owns,
    // with routes of ours to unused addresses, plus a route of ours to an
    // unused address on the surviving attachment's veth.
    let mut rng = Rng::from_env_or_clock("reconciliation");
    let orphan = format!("tth{:012x}", rng.next() & 0xffff_ffff_ffff);
    assert_ne!(orphan, keeper.host);
    let peer = unique_name("op");
    let (stray_v4, stray_v6, stray_on_keeper) = ("10.97.0.200", "fd00:97::c8", "10.97.0.201");
    assert!(![&keeper.v4, &keeper.v6]
        .iter()
        .any(|ip| [stray_v4, stray_v6, stray_on_keeper].contains(&ip.as_str())));
    let node = daemon.node();
    node.exec_ok(&[
        "ip", "link", "add", &orphan, "type", "veth", "peer", "name", &peer,
    ]);
    node.exec_ok(&["ip", "link", "set", &orphan, "up"]);
    plant_route(node, "-4", &format!("{stray_v4}/32"), &orphan);
    plant_route(node, "-6", &format!("{stray_v6}/128"), &orphan);
    plant_route(node, "-4", &format!("{stray_on_keeper}/32"), &keeper.host);
    let planted = node.tether_routes();
    for stray in [stray_v4, stray_v6, stray_on_keeper] {
        assert!(
            planted.iter().any(|(dst, _)| dst == stray),
            "planting {stray} failed: {planted:?}"
        );
    }
    assert!(node.tether_links().contains(&orphan));

    daemon.restart();

    // Reconciliation runs before the daemon serves: no waiting needed.
    let names = daemon.node().link_names();
    assert!(
        !names.contains(&orphan) && !names.contains(&peer),
        "the orphan veth {orphan} (peer {peer}) survived the restart: {names:?}"
    );
    let live = BTreeMap::from([(id.clone(), (&pod, keeper))]);
    assert_node_holds_exactly(&daemon, &live);
}
