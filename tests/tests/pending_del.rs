//! The shim's pending-DEL queue: a DEL that cannot reach `tetherd` is
//! written to `<stateDir>/pending-del/` and succeeds; the daemon replays the
//! queue before it serves and every few seconds afterwards.
//!
//! - A DEL with the daemon stopped exits 0, leaves one entry, and is done by
//!   the time the restarted daemon answers its first call.
//! - A queued DEL never removes an attachment created after it was queued.
//! - Unreadable entries go to `pending-del/bad/` and do not block the rest.
//! - A DEL queued while the daemon runs (the shim had a wrong socket path) is
//!   picked up by the periodic drain.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use tether_e2e::{
    add, assert_tether_links_settle, del, expected_routes, require_root, tether_bin, unique_name,
    wait_link_gone, wait_until, AddResult, Daemon, DaemonOpts, Netns, LINK_SETTLE, REF_PLUGIN_DIR,
};

const NETWORK: &str = "tether-pdel";
const POD_CIDR_V4: &str = "10.98.0.0/24";
const POD_CIDR_V6: &str = "fd00:98::/120";
/// The daemon drains the queue every 5 s; this leaves room for a slow run.
const DRAIN_LIMIT: Duration = Duration::from_secs(20);

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

/// Pool usage when `n` attachments hold one address of each family.
fn used_by(n: u64) -> BTreeMap<String, u64> {
    BTreeMap::from([(POD_CIDR_V4.to_owned(), n), (POD_CIDR_V6.to_owned(), n)])
}

/// The queue's directory under the daemon's state dir (the shim's format).
fn queue_dir(daemon: &Daemon) -> PathBuf {
    daemon.state_dir().join("pending-del")
}

/// The queued requests: `*.json` directly in the queue directory, except
/// names starting with `.` (unfinished writes). Sorted.
fn queued(daemon: &Daemon) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(queue_dir(daemon)) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".json") && !n.starts_with('.'))
        .collect();
    names.sort();
    names
}

fn now_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("the clock is after 1970")
        .as_nanos() as u64
}

/// Writes a queue entry by hand, in the shim's format (version 1, see
/// cni-shim/src/queue.rs), as if a shim had queued a DEL of `id` in `pod`
/// at `queued_at` (ns since the epoch). Returns the file name.
fn write_entry(daemon: &Daemon, conf: &Value, id: &str, pod: &Netns, queued_at: u64) -> String {
    let entry = json!({
        "version": 1,
        "queuedAtUnixNanos": queued_at,
        "command": "DEL",
        "containerId": id,
        "netns": pod.path().display().to_string(),
        "ifname": "eth0",
        "args": "",
        "path": REF_PLUGIN_DIR,
        "stdin": conf.to_string(),
        "present": ["CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_PATH"],
    });
    let name = format!("{queued_at}-{}.json", std::process::id());
    write_raw(daemon, &name, entry.to_string().as_bytes());
    name
}

/// Writes `body` as queue file `name`, creating the directory (0700) if
/// needed.
fn write_raw(daemon: &Daemon, name: &str, body: &[u8]) {
    use std::os::unix::fs::DirBuilderExt;
    let dir = queue_dir(daemon);
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
    let path = dir.join(name);
    std::fs::write(&path, body).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}

/// Panics unless the daemon holds exactly `live` (id → its last ADD) with
/// their addresses, and the node exactly their routes and veths (waiting
/// for background deletions of the others).
fn assert_node_holds_exactly(daemon: &Daemon, live: &BTreeMap<&str, &AddResult>) {
    let listed = daemon.attachments();
    let ids: BTreeSet<&str> = listed.iter().map(|a| a.container_id.as_str()).collect();
    assert_eq!(ids, live.keys().copied().collect(), "attachments listed");
    for a in &listed {
        let added = live[a.container_id.as_str()];
        let mut ips = a.ips.clone();
        ips.sort();
        assert_eq!(ips, added.prefixed_ips(), "addresses of {}", a.container_id);
    }
    assert_eq!(
        daemon.pools_used(),
        used_by(live.len() as u64),
        "pool usage"
    );
    let node = daemon.node();
    assert_eq!(
        node.tether_routes(),
        expected_routes(live.values().copied()),
        "proto-201 routes in the node netns"
    );
    assert_tether_links_settle(node, live.values().copied());
}

/// Waits until `pod` has no eth0 (its veth's node side was deleted).
fn assert_eth0_goes(pod: &Netns) {
    let gone = wait_link_gone([pod], "eth0", LINK_SETTLE);
    assert!(gone, "netns {} still has eth0", pod.name());
}

// ---------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------

#[test]
fn del_while_the_daemon_is_down_is_queued_and_replayed_before_it_serves() {
    require_root();
    let mut daemon = dual_stack_daemon();
    let conf = daemon.netconf("1.0.0", NETWORK);
    let bin = tether_bin();
    let (gone_pod, kept_pod) = (Netns::new("qp"), Netns::new("qp"));
    let (gone_id, kept_id) = (unique_name("qg"), unique_name("qk"));
    add(&bin, &conf, &gone_id, &gone_pod).assert_success();
    let kept = AddResult::from_output(&add(&bin, &conf, &kept_id, &kept_pod));
    daemon.stop();

    let out = del(&bin, &conf, &gone_id, &gone_pod);
    assert!(
        out.success(),
        "DEL with the daemon down must succeed: {out}"
    );
    let files = queued(&daemon);
    assert_eq!(files.len(), 1, "queue after one DEL: {files:?}");
    let entry: Value = serde_json::from_slice(
        &std::fs::read(queue_dir(&daemon).join(&files[0])).expect("reading the queue entry"),
    )
    .expect("the queue entry is JSON");
    assert_eq!(entry["command"], "DEL", "{entry}");
    assert_eq!(entry["containerId"], gone_id.as_str(), "{entry}");
    assert_eq!(entry["ifname"], "eth0", "{entry}");

    daemon.restart();

    // The replay precedes the socket: the first call already sees it done.
    assert_eq!(
        daemon.attachment_ids(),
        BTreeSet::from([kept_id.clone()]),
        "attachments at the first admin call after the restart"
    );
    assert_eq!(
        daemon.node().tether_routes(),
        expected_routes([&kept]),
        "routes at the first call after the restart"
    );
    assert_eq!(queued(&daemon), Vec::<String>::new(), "queue after replay");
    let counters = daemon.stats();
    assert_eq!(counters.pending_del_processed, 1, "{counters:?}");
    assert_eq!(counters.pending_del_queue, 0, "{counters:?}");
    assert_node_holds_exactly(&daemon, &BTreeMap::from([(kept_id.as_str(), &kept)]));
    assert_eth0_goes(&gone_pod);
    kept.assert_check_passes(&daemon, NETWORK, &kept_id, &kept_pod);
}

#[test]
fn queued_del_never_removes_an_attachment_created_after_it_was_queued() {
    require_root();
    let mut daemon = dual_stack_daemon();
    let conf = daemon.netconf("1.0.0", NETWORK);
    let bin = tether_bin();
    let (pod, other_pod) = (Netns::new("rp"), Netns::new("rp"));
    let (id, other_id) = (unique_name("rr"), unique_name("ro"));

    // First life of the attachment, ended by a DEL that reached the daemon.
    add(&bin, &conf, &id, &pod).assert_success();
    del(&bin, &conf, &id, &pod).assert_success();
    // A runtime's DEL queued now reaches the daemon only later...
    let queued_at = now_nanos();
    std::thread::sleep(Duration::from_millis(10));
    // ...after the attachment was created again.
    let reborn = AddResult::from_output(&add(&bin, &conf, &id, &pod));
    add(&bin, &conf, &other_id, &other_pod).assert_success();
    daemon.stop();
    let stale = write_entry(&daemon, &conf, &id, &pod, queued_at);
    // A control: a real DEL queued by the shim now, after its attachment.
    del(&bin, &conf, &other_id, &other_pod).assert_success();
    let files = queued(&daemon);
    assert_eq!(files.len(), 2, "{files:?}");
    assert!(files.contains(&stale), "{files:?}");

    daemon.restart();

    assert_eq!(queued(&daemon), Vec::<String>::new(), "queue after replay");
    assert_node_holds_exactly(&daemon, &BTreeMap::from([(id.as_str(), &reborn)]));
    reborn.assert_check_passes(&daemon, NETWORK, &id, &pod);
    let addrs = pod.addrs_of("eth0");
    assert!(addrs.contains(&format!("{}/32", reborn.v4)), "{addrs:?}");
    assert_eth0_goes(&other_pod);
}

#[test]
fn unreadable_queue_entries_are_set_aside_without_blocking_the_others() {
    require_root();
    let mut daemon = dual_stack_daemon();
    let conf = daemon.netconf("1.0.0", NETWORK);
    let bin = tether_bin();
    let pod = Netns::new("gp");
    let id = unique_name("gc");
    add(&bin, &conf, &id, &pod).assert_success();
    daemon.stop();

    // Both sort before the real entry, so the drain meets them first.
    let garbage: &[u8] = b"{\"version\":1,\"command\":\"DEL\",\"contai";
    let unknown = json!({"version": 99, "command": "DEL", "containerId": id}).to_string();
    write_raw(&daemon, "1-1.json", garbage);
    write_raw(&daemon, "2-1.json", unknown.as_bytes());
    del(&bin, &conf, &id, &pod).assert_success();
    assert_eq!(queued(&daemon).len(), 3, "{:?}", queued(&daemon));

    daemon.restart();

    assert_eq!(daemon.attachment_ids(), BTreeSet::new(), "attachments");
    assert_eq!(queued(&daemon), Vec::<String>::new(), "queue after replay");
    let bad = queue_dir(&daemon).join("bad");
    for (name, body) in [("1-1.json", garbage), ("2-1.json", unknown.as_bytes())] {
        let kept = std::fs::read(bad.join(name))
            .unwrap_or_else(|e| panic!("{name} was not set aside in {}: {e}", bad.display()));
        assert_eq!(kept, body, "{name} changed when set aside");
    }
    let counters = daemon.stats();
    assert_eq!(counters.pending_del_processed, 1, "{counters:?}");
    assert_node_holds_exactly(&daemon, &BTreeMap::new());
    assert_eth0_goes(&pod);
}

#[test]
fn del_queued_while_the_daemon_runs_is_drained_periodically() {
    require_root();
    let daemon = dual_stack_daemon();
    let conf = daemon.netconf("1.0.0", NETWORK);
    // The daemon's state dir, but a socket nobody listens on.
    let mut lost = conf.clone();
    lost["socket"] = json!(daemon.dir().join("nobody.sock").display().to_string());
    let bin = tether_bin();
    let (gone_pod, kept_pod) = (Netns::new("dp"), Netns::new("dp"));
    let (gone_id, kept_id) = (unique_name("dg"), unique_name("dk"));
    add(&bin, &conf, &gone_id, &gone_pod).assert_success();
    add(&bin, &conf, &kept_id, &kept_pod).assert_success();

    let out = del(&bin, &lost, &gone_id, &gone_pod);
    assert!(out.success(), "DEL that cannot reach the daemon: {out}");
    // Queued for the kept pod too, then deleted and re-added for real before
    // (or after) the drain runs: in every order, the new one must survive.
    del(&bin, &lost, &kept_id, &kept_pod).assert_success();
    del(&bin, &conf, &kept_id, &kept_pod).assert_success();
    let kept = AddResult::from_output(&add(&bin, &conf, &kept_id, &kept_pod));

    let drained = wait_until(DRAIN_LIMIT, || {
        queued(&daemon).is_empty() && daemon.stats().pending_del_processed == 2
    });
    assert!(
        drained,
        "queue not drained within {DRAIN_LIMIT:?}: {:?}, {:?}",
        queued(&daemon),
        daemon.stats()
    );
    assert_node_holds_exactly(&daemon, &BTreeMap::from([(kept_id.as_str(), &kept)]));
    kept.assert_check_passes(&daemon, NETWORK, &kept_id, &kept_pod);
    assert_eth0_goes(&gone_pod);
}
