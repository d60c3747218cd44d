//! The shim's pending-DEL queue: a DEL that cannot reach `tetherd` is
//! written through `<socket>.pending-del`, which the daemon points at
//! `<--state-dir>/pending-del/`, and succeeds; the daemon replays the queue
//! before it serves and every few seconds afterwards.
//!
//! - A DEL with the daemon stopped exits 0, leaves one entry, and is done by
//!   the time the restarted daemon answers its first call.
//! - A queued DEL never removes an attachment created after it was queued.
//! - Unreadable entries go to `pending-del/bad/` and do not block the rest.
//! - A DEL queued while the daemon runs (the shim found no socket for a
//!   moment) is picked up by the periodic drain.
//! - The daemon's `--state-dir` is the one knob: when it changes, DELs queued
//!   under the former one, or before the daemon ever ran, are still done.

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
/// proto/src/pending_del.rs), as if a shim had queued a DEL of `id` in `pod`
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

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
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

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
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

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
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

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn del_queued_while_the_daemon_runs_is_drained_periodically() {
    require_root();
    let daemon = dual_stack_daemon();
    let conf = daemon.netconf("1.0.0", NETWORK);
    let bin = tether_bin();
    let (gone_pod, kept_pod) = (Netns::new("dp"), Netns::new("dp"));
    let (gone_id, kept_id) = (unique_name("dg"), unique_name("dk"));
    add(&bin, &conf, &gone_id, &gone_pod).assert_success();
    add(&bin, &conf, &kept_id, &kept_pod).assert_success();

    // The socket is gone for a moment (the daemon still runs): the shim
    // cannot connect and queues.
    let socket = daemon.socket().to_path_buf();
    let aside = daemon.dir().join("socket-aside");
    std::fs::rename(&socket, &aside).expect("moving the socket aside");
    let out = del(&bin, &conf, &gone_id, &gone_pod);
    // Queued for the kept pod too, then deleted and re-added for real before
    // (or after) the drain runs: in every order, the new one must survive.
    let kept_out = del(&bin, &conf, &kept_id, &kept_pod);
    std::fs::rename(&aside, &socket).expect("moving the socket back");
    assert!(out.success(), "DEL that cannot reach the daemon: {out}");
    kept_out.assert_success();
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

/// The trap this replaces: the queue was wherever the netconf's `stateDir`
/// said, and a daemon with another `--state-dir` never read it. Now the shim
/// writes through the daemon's link beside the socket, and a daemon started
/// with a new state dir takes in what the former one's queue holds, and what
/// a shim queued before any daemon ran since boot (the link lives in the
/// socket's directory, a tmpfs on a real node).
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn a_new_state_dir_takes_in_dels_queued_under_the_former_one() {
    require_root();
    let mut daemon = dual_stack_daemon();
    let conf = daemon.netconf("1.0.0", NETWORK);
    let bin = tether_bin();
    let pods: Vec<Netns> = (0..3).map(|_| Netns::new("sp")).collect();
    let ids: Vec<String> = (0..3).map(|_| unique_name("sd")).collect();
    let mut added = Vec::new();
    for (id, pod) in ids.iter().zip(&pods) {
        added.push(AddResult::from_output(&add(&bin, &conf, id, pod)));
    }
    let old_state = daemon.state_dir().to_path_buf();
    let link = daemon.socket().with_file_name("tetherd.sock.pending-del");
    assert_eq!(
        std::fs::read_link(&link).expect("the daemon links its queue beside the socket"),
        old_state.join("pending-del")
    );
    daemon.stop();

    // The operator copies the state to a new place for the next start; a
    // DEL arrives meanwhile and lands in the old queue, through the link.
    let new_state = daemon.dir().join("state-moved");
    let copied = std::process::Command::new("cp")
        .arg("-a")
        .arg(&old_state)
        .arg(&new_state)
        .status()
        .expect("running cp");
    assert!(copied.success(), "cp -a {}", old_state.display());
    del(&bin, &conf, &ids[0], &pods[0]).assert_success();
    assert_eq!(queued(&daemon).len(), 1, "queued under the old state dir");
    // The node rebooted, say: /run is empty, the link is gone. The shim
    // queues in a plain directory beside the socket.
    std::fs::remove_file(&link).expect("removing the link");
    del(&bin, &conf, &ids[1], &pods[1]).assert_success();
    assert!(link.is_dir(), "the shim made {}", link.display());
    daemon.set_state_dir(new_state.clone());

    daemon.restart();

    // Both replayed before the first call; only the third pod is left.
    assert_eq!(
        daemon.attachment_ids(),
        BTreeSet::from([ids[2].clone()]),
        "attachments at the first call after the restart"
    );
    assert_eq!(
        queued(&daemon),
        Vec::<String>::new(),
        "new queue after replay"
    );
    let old_left: Vec<_> = std::fs::read_dir(old_state.join("pending-del"))
        .expect("the old queue dir stays")
        .collect();
    assert!(old_left.is_empty(), "left in the old queue: {old_left:?}");
    assert_eq!(daemon.stats().pending_del_processed, 2);
    let node = daemon.node_info();
    assert_eq!(node.state_dir, new_state.display().to_string());
    assert_eq!(
        node.pending_del_link_target, node.pending_del_dir,
        "{node:?}"
    );
    assert_eq!(node.pending_del_link, link.display().to_string());
    assert!(daemon
        .log()
        .contains("took in DELs queued outside this state dir"));
    assert_node_holds_exactly(&daemon, &BTreeMap::from([(ids[2].as_str(), &added[2])]));
    assert_eth0_goes(&pods[0]);
    assert_eth0_goes(&pods[1]);

    // And the link now leads a DEL into the new state dir.
    daemon.stop();
    del(&bin, &conf, &ids[2], &pods[2]).assert_success();
    assert_eq!(queued(&daemon).len(), 1, "queued under the new state dir");
    daemon.restart();
    assert_eq!(daemon.attachment_ids(), BTreeSet::new());
    assert_eth0_goes(&pods[2]);
}

/// The state dir moved as a whole (`mv`) while the daemon was down: its
/// queue moved with it, the old link dangles, and nothing is lost.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn a_moved_state_dir_keeps_its_queue() {
    require_root();
    let mut daemon = dual_stack_daemon();
    let conf = daemon.netconf("1.0.0", NETWORK);
    let bin = tether_bin();
    let pod = Netns::new("mp");
    let id = unique_name("md");
    add(&bin, &conf, &id, &pod).assert_success();
    daemon.stop();
    del(&bin, &conf, &id, &pod).assert_success();
    assert_eq!(queued(&daemon).len(), 1);

    let new_state = daemon.dir().join("state-mv");
    std::fs::rename(daemon.state_dir(), &new_state).expect("moving the state dir");
    daemon.set_state_dir(new_state);
    daemon.restart();

    assert_eq!(daemon.attachment_ids(), BTreeSet::new());
    assert_eq!(queued(&daemon), Vec::<String>::new());
    assert_eq!(daemon.stats().pending_del_processed, 1);
    assert_eth0_goes(&pod);
}
