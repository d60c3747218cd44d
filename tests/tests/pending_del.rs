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
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tether_e2e::{
    add, check, del, require_root, tether_bin, unique_name, CniOutput, Daemon, DaemonOpts, Family,
    Netns, REF_PLUGIN_DIR,
};
use tether_proto::admin::v1::admin_client::AdminClient;
use tether_proto::admin::v1::{
    Attachment, GetNodeRequest, ListAttachmentsRequest, StatsRequest, StatsResponse,
};
use tonic::transport::{Channel, Endpoint, Uri};

const NETWORK: &str = "tether-pdel";
const POD_CIDR_V4: &str = "10.98.0.0/24";
const POD_CIDR_V6: &str = "fd00:98::/120";
/// Background veth deletion (after a DEL) is done well within this.
const LINK_SETTLE: Duration = Duration::from_secs(5);
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

/// The container ids of [`attachments`].
fn attached_ids(daemon: &Daemon) -> BTreeSet<String> {
    attachments(daemon)
        .into_iter()
        .map(|a| a.container_id)
        .collect()
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

/// The daemon's counters (Stats).
fn stats(daemon: &Daemon) -> StatsResponse {
    admin(daemon.socket(), |mut c| async move {
        c.stats(StatsRequest::default()).await
    })
}

/// Pool usage when `n` attachments hold one address of each family.
fn used_by(n: u64) -> BTreeMap<String, u64> {
    BTreeMap::from([(POD_CIDR_V4.to_owned(), n), (POD_CIDR_V6.to_owned(), n)])
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

/// CHECK of `id` in `pod` with the ADD's result as prevResult; panics unless
/// it passes.
fn assert_check_passes(daemon: &Daemon, id: &str, pod: &Netns, added: &Added) {
    let mut conf = daemon.netconf("1.0.0", NETWORK);
    conf["prevResult"] = added.result.clone();
    let out = check(&tether_bin(), &conf, id, pod);
    assert!(out.success(), "CHECK of {id} failed: {out}");
}

/// Panics unless the daemon holds exactly `live` (id → its last ADD) with
/// their addresses, and the node exactly their routes and veths (waiting
/// for background deletions of the others).
fn assert_node_holds_exactly(daemon: &Daemon, live: &BTreeMap<&str, &Added>) {
    let listed = attachments(daemon);
    let ids: BTreeSet<&str> = listed.iter().map(|a| a.container_id.as_str()).collect();
    assert_eq!(ids, live.keys().copied().collect(), "attachments listed");
    for a in &listed {
        let added = live[a.container_id.as_str()];
        let mut ips = a.ips.clone();
        ips.sort();
        assert_eq!(
            ips,
            [format!("{}/32", added.v4), format!("{}/128", added.v6)],
            "addresses of {}",
            a.container_id
        );
    }
    assert_eq!(pools_used(daemon), used_by(live.len() as u64), "pool usage");
    let node = daemon.node();
    assert_eq!(
        tether_routes(node),
        expected_routes(live.values().copied()),
        "proto-201 routes in the node netns"
    );
    let want: BTreeSet<String> = live.values().map(|a| a.host.clone()).collect();
    let settled = wait_for(LINK_SETTLE, || tether_links(node) == want);
    assert!(
        settled,
        "tth links did not settle within {LINK_SETTLE:?}: have {:?}, want {want:?}",
        tether_links(node)
    );
}

/// Waits until `pod` has no eth0 (its veth's node side was deleted).
fn assert_eth0_goes(pod: &Netns) {
    let gone = wait_for(LINK_SETTLE, || {
        !pod.link_names().iter().any(|n| n == "eth0")
    });
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
    let kept = Added::from_output(&add(&bin, &conf, &kept_id, &kept_pod));
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
        attached_ids(&daemon),
        BTreeSet::from([kept_id.clone()]),
        "attachments at the first admin call after the restart"
    );
    assert_eq!(
        tether_routes(daemon.node()),
        expected_routes([&kept]),
        "routes at the first call after the restart"
    );
    assert_eq!(queued(&daemon), Vec::<String>::new(), "queue after replay");
    let counters = stats(&daemon);
    assert_eq!(counters.pending_del_processed, 1, "{counters:?}");
    assert_eq!(counters.pending_del_queue, 0, "{counters:?}");
    assert_node_holds_exactly(&daemon, &BTreeMap::from([(kept_id.as_str(), &kept)]));
    assert_eth0_goes(&gone_pod);
    assert_check_passes(&daemon, &kept_id, &kept_pod, &kept);
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
    let reborn = Added::from_output(&add(&bin, &conf, &id, &pod));
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
    assert_check_passes(&daemon, &id, &pod, &reborn);
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

    assert_eq!(attached_ids(&daemon), BTreeSet::new(), "attachments");
    assert_eq!(queued(&daemon), Vec::<String>::new(), "queue after replay");
    let bad = queue_dir(&daemon).join("bad");
    for (name, body) in [("1-1.json", garbage), ("2-1.json", unknown.as_bytes())] {
        let kept = std::fs::read(bad.join(name))
            .unwrap_or_else(|e| panic!("{name} was not set aside in {}: {e}", bad.display()));
        assert_eq!(kept, body, "{name} changed when set aside");
    }
    let counters = stats(&daemon);
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
    let kept = Added::from_output(&add(&bin, &conf, &kept_id, &kept_pod));

    let drained = wait_for(DRAIN_LIMIT, || {
        queued(&daemon).is_empty() && stats(&daemon).pending_del_processed == 2
    });
    assert!(
        drained,
        "queue not drained within {DRAIN_LIMIT:?}: {:?}, {:?}",
        queued(&daemon),
        stats(&daemon)
    );
    assert_node_holds_exactly(&daemon, &BTreeMap::from([(kept_id.as_str(), &kept)]));
    assert_check_passes(&daemon, &kept_id, &kept_pod, &kept);
    assert_eth0_goes(&gone_pod);
}
