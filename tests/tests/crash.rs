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

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::future::Future;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tether_e2e::{
    add, check, cni, del, parallel, require_root, tether_bin, unique_name, CniEnv, CniOutput,
    Daemon, DaemonOpts, Family, Netns, REF_PLUGIN_DIR,
};
use tether_proto::admin::v1::admin_client::AdminClient;
use tether_proto::admin::v1::{Attachment, GetNodeRequest, ListAttachmentsRequest};
use tonic::transport::{Channel, Endpoint, Uri};

const NETWORK: &str = "tether-crash";
const POD_CIDR_V4: &str = "10.97.0.0/24";
const POD_CIDR_V6: &str = "fd00:97::/120";
/// Background veth deletion (after DEL or GC replied) is done well within this.
const LINK_SETTLE: Duration = Duration::from_secs(5);

/// A dual-stack daemon in its own node netns.
fn dual_stack_daemon() -> Daemon {
    Daemon::start(DaemonOpts {
        pod_cidrs: vec![POD_CIDR_V4.to_owned(), POD_CIDR_V6.to_owned()],
        ..DaemonOpts::default()
    })
}

// ---------------------------------------------------------------------------
// Private helpers. The harness has no admin client yet, so this file carries
// a minimal one (the shim's unix-socket connector pattern).
// ---------------------------------------------------------------------------

/// Makes one admin RPC on the daemon's socket, on a throwaway runtime.
fn admin<T, Fut>(socket: &Path, call: impl FnOnce(AdminClient<Channel>) -> Fut) -> T
where
    Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("building a tokio runtime");
    runtime.block_on(async {
        let path = socket.to_path_buf();
        // The URI is never resolved: the connector dials the socket.
        let channel = Endpoint::from_static("http://tether.invalid")
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move {
                    let stream = tokio::net::UnixStream::connect(path).await?;
                    Ok::<_, std::io::Error>(TokioIo::new(stream))
                }
            }))
            .await
            .unwrap_or_else(|e| panic!("admin: connecting to {}: {e}", socket.display()));
        call(AdminClient::new(channel))
            .await
            .unwrap_or_else(|status| panic!("admin call failed: {status}"))
            .into_inner()
    })
}

/// Every attachment the daemon holds (ListAttachments).
fn attachments(daemon: &Daemon) -> Vec<Attachment> {
    admin(daemon.socket(), |mut c| async move {
        c.list_attachments(ListAttachmentsRequest::default()).await
    })
    .attachments
}

/// Addresses in use per pool CIDR (GetNode).
fn pools_used(daemon: &Daemon) -> BTreeMap<String, u64> {
    admin(daemon.socket(), |mut c| async move {
        c.get_node(GetNodeRequest::default()).await
    })
    .pools
    .into_iter()
    .map(|p| (p.cidr, p.used))
    .collect()
}

/// What one successful ADD handed back.
#[derive(Clone, Debug)]
struct Added {
    v4: String,
    v6: String,
    /// The node-side veth, `interfaces[0]` of the result.
    host: String,
    result: Value,
}

impl Added {
    fn from_output(out: &CniOutput) -> Added {
        let result = out.result().clone();
        let ips: Vec<&str> = result["ips"]
            .as_array()
            .unwrap_or_else(|| panic!("ADD result without ips: {result}"))
            .iter()
            .filter_map(|ip| ip["address"].as_str())
            .collect();
        let pick = |suffix: &str| -> String {
            let found: Vec<&str> = ips.iter().filter_map(|a| a.strip_suffix(suffix)).collect();
            assert_eq!(found.len(), 1, "one {suffix} address expected in {result}");
            found[0].to_owned()
        };
        let host = result["interfaces"][0]["name"]
            .as_str()
            .unwrap_or_else(|| panic!("ADD result without a host interface: {result}"))
            .to_owned();
        Added {
            v4: pick("/32"),
            v6: pick("/128"),
            host,
            result,
        }
    }

    /// The addresses as the admin API lists them.
    fn admin_ips(&self) -> Vec<String> {
        vec![format!("{}/32", self.v4), format!("{}/128", self.v6)]
    }
}

/// Panics naming the duplicates unless every item is distinct.
fn assert_distinct<'a>(what: &str, items: impl IntoIterator<Item = &'a String>) {
    let mut seen = HashSet::new();
    let dups: BTreeSet<&String> = items.into_iter().filter(|i| !seen.insert(*i)).collect();
    assert!(dups.is_empty(), "duplicate {what}: {dups:?}");
}

/// True for a host veth name tether makes: `tth` and 12 hex digits.
fn is_tether_link(name: &str) -> bool {
    name.len() == 15 && name.starts_with("tth") && name[3..].chars().all(|c| c.is_ascii_hexdigit())
}

/// tether's host veths in `node`.
fn tether_links(node: &Netns) -> BTreeSet<String> {
    node.link_names()
        .into_iter()
        .filter(|n| is_tether_link(n))
        .collect()
}

/// tether's routes (protocol 201) in `node`, both families, as sorted
/// (destination, device) pairs.
fn tether_routes(node: &Netns) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = [Family::V4, Family::V6]
        .into_iter()
        .flat_map(|f| node.routes(f))
        .filter(|r| r["protocol"] == "201" || r["protocol"] == 201)
        .map(|r| {
            let field = |k: &str| r[k].as_str().unwrap_or_default().to_owned();
            (field("dst"), field("dev"))
        })
        .collect();
    out.sort();
    out
}

/// The routes the node must carry for `pods`, in [`tether_routes`] form.
fn expected_routes<'a>(pods: impl IntoIterator<Item = &'a Added>) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = pods
        .into_iter()
        .flat_map(|a| {
            [
                (a.v4.clone(), a.host.clone()),
                (a.v6.clone(), a.host.clone()),
            ]
        })
        .collect();
    out.sort();
    out
}

/// Panics unless `pod`'s eth0 holds both addresses of `added`.
fn assert_pod_holds(pod: &Netns, added: &Added) {
    let addrs = pod.addrs_of("eth0");
    for want in [format!("{}/32", added.v4), format!("{}/128", added.v6)] {
        assert!(
            addrs.contains(&want),
            "netns {} lacks {want} on eth0; it has {addrs:?}",
            pod.name()
        );
    }
}

/// Polls `done` every 50 ms until it holds or `limit` passes.
fn wait_for(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// CHECK of `id` in `pod` with the ADD's result as prevResult; panics unless
/// it passes.
fn assert_check_passes(daemon: &Daemon, id: &str, pod: &Netns, added: &Added) {
    let mut conf = daemon.netconf("1.0.0", NETWORK);
    conf["prevResult"] = added.result.clone();
    let out = check(&tether_bin(), &conf, id, pod);
    assert!(out.success(), "CHECK of {id} failed: {out}");
}

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
fn assert_node_holds_exactly(daemon: &Daemon, live: &BTreeMap<String, (&Netns, Added)>) {
    let listed = attachments(daemon);
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
        let mut want = added.admin_ips();
        want.sort();
        assert_eq!(ips, want, "addresses of {}", a.container_id);
        assert_eq!(a.host_interface, added.host, "veth of {}", a.container_id);
        assert_eq!(a.netns, pod.path().display().to_string());
        assert_pod_holds(pod, added);
        assert_check_passes(daemon, &a.container_id, pod, added);
    }
    let n = live.len() as u64;
    assert_eq!(
        pools_used(daemon),
        BTreeMap::from([(POD_CIDR_V4.to_owned(), n), (POD_CIDR_V6.to_owned(), n)]),
        "pool usage (a leaked or lost address)"
    );
    let node = daemon.node();
    assert_eq!(
        tether_routes(node),
        expected_routes(live.values().map(|(_, a)| a)),
        "proto-201 routes in the node netns (orphan, missing or misdirected)"
    );
    let want_links: BTreeSet<String> = live.values().map(|(_, a)| a.host.clone()).collect();
    let settled = wait_for(LINK_SETTLE, || tether_links(node) == want_links);
    assert!(
        settled,
        "tth links did not settle within {LINK_SETTLE:?}: have {:?}, want {want_links:?}",
        tether_links(node)
    );
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
    Added(Added),
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
                                Verb::Add => Acked::Added(Added::from_output(&out)),
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
    let mut live: BTreeMap<String, (&Netns, Added)> = BTreeMap::new();
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
    let cleaned = wait_for(LINK_SETTLE, || {
        stale
            .iter()
            .all(|p| !p.link_names().iter().any(|n| n == "eth0"))
    });
    assert!(cleaned, "a pod without a valid attachment still has eth0");
}

#[test]
fn kill9_early_in_a_burst_then_restart_and_gc_leave_exactly_the_acked_attachments() {
    crash_mid_burst("kill9_early", (0.05, 0.25));
}

#[test]
fn kill9_midway_through_a_burst_then_restart_and_gc_leave_exactly_the_acked_attachments() {
    crash_mid_burst("kill9_midway", (0.35, 0.65));
}

#[test]
fn kill9_late_in_a_burst_then_restart_and_gc_leave_exactly_the_acked_attachments() {
    crash_mid_burst("kill9_late", (0.75, 0.95));
}

// ---------------------------------------------------------------------------
// Durability and startup reconciliation
// ---------------------------------------------------------------------------

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

    let live: BTreeMap<String, (&Netns, Added)> = outs
        .iter()
        .enumerate()
        .map(|(i, out)| (ids[i].clone(), (&pods[i], Added::from_output(out))))
        .collect();
    assert_node_holds_exactly(&daemon, &live);
}

#[test]
fn startup_reconciliation_removes_planted_orphans_and_keeps_real_attachments() {
    require_root();
    let mut daemon = dual_stack_daemon();
    let conf = daemon.netconf("1.0.0", NETWORK);
    let pod = Netns::new("rp");
    let id = unique_name("rc");
    let keeper = Added::from_output(&add(&tether_bin(), &conf, &id, &pod));
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
    node.exec_ok(&[
        "ip",
        "-4",
        "route",
        "add",
        &format!("{stray_v4}/32"),
        "dev",
        &orphan,
        "proto",
        "201",
    ]);
    node.exec_ok(&[
        "ip",
        "-6",
        "route",
        "add",
        &format!("{stray_v6}/128"),
        "dev",
        &orphan,
        "proto",
        "201",
    ]);
    node.exec_ok(&[
        "ip",
        "-4",
        "route",
        "add",
        &format!("{stray_on_keeper}/32"),
        "dev",
        &keeper.host,
        "proto",
        "201",
    ]);
    let planted = tether_routes(node);
    for stray in [stray_v4, stray_v6, stray_on_keeper] {
        assert!(
            planted.iter().any(|(dst, _)| dst == stray),
            "planting {stray} failed: {planted:?}"
        );
    }
    assert!(tether_links(node).contains(&orphan));

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
