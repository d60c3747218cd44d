//! Many CNI calls at once against one `tetherd`.
//!
//! - 100 pods ADDed at the same moment, CHECKed at the same moment, then
//!   DELeted at the same moment: every pod gets its own addresses, really
//!   holds them, and the node carries exactly one route and one veth per pod;
//!   afterwards nothing is left.
//! - ADDs and DELs of different pods interleaved, plus the same attachment
//!   ADDed many times at once: one link, one identical result; then, on
//!   settled state, repeated ADDs alongside CHECKs leave the veth in place.
//!
//! Every pod is a netns of its own; the daemon runs in a node netns the
//! harness made, so nothing here touches the machine's own network.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use serde_json::Value;
use tether_e2e::{
    add, check, del, parallel, require_root, tether_bin, unique_name, CniOutput, Daemon,
    DaemonOpts, Family, Netns,
};
use tether_proto::admin::v1::admin_client::AdminClient;
use tether_proto::admin::v1::{Attachment, GetNodeRequest, ListAttachmentsRequest};
use tonic::transport::{Channel, Endpoint, Uri};

const NETWORK: &str = "tether-conc";
const POD_CIDR_V4: &str = "10.96.0.0/24";
const POD_CIDR_V6: &str = "fd00:96::/120";
/// Background veth deletion (after DEL replied) is done well within this.
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

/// CHECK of `id` in `pod` with the ADD's result as prevResult.
fn check_added(daemon: &Daemon, id: &str, pod: &Netns, added: &Added) -> CniOutput {
    let mut conf = daemon.netconf("1.0.0", NETWORK);
    conf["prevResult"] = added.result.clone();
    check(&tether_bin(), &conf, id, pod)
}

/// The ifindex of link `name` in `ns`: it changes when the link is
/// recreated.
fn ifindex(ns: &Netns, name: &str) -> u64 {
    ns.links()
        .iter()
        .find(|l| l["ifname"] == name)
        .and_then(|l| l["ifindex"].as_u64())
        .unwrap_or_else(|| panic!("no link {name} in {}", ns.name()))
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

/// Panics listing every failed call, by index.
fn assert_all_succeeded(verb: &str, outs: &[CniOutput]) {
    let failed: Vec<String> = outs
        .iter()
        .enumerate()
        .filter(|(_, o)| !o.success())
        .map(|(i, o)| format!("#{i}: {o}"))
        .collect();
    assert!(
        failed.is_empty(),
        "{} of {} {verb}s failed:\n{}",
        failed.len(),
        outs.len(),
        failed.join("\n")
    );
}

/// Panics unless the node and the daemon hold exactly `live`: their
/// attachments, routes, veths (waiting for background deletions of others),
/// and pool usage.
fn assert_node_holds_exactly(daemon: &Daemon, live: &BTreeMap<String, Added>) {
    let node = daemon.node();
    assert_eq!(
        tether_routes(node),
        expected_routes(live.values()),
        "proto-201 routes in the node netns"
    );
    let want_links: BTreeSet<String> = live.values().map(|a| a.host.clone()).collect();
    let settled = wait_for(LINK_SETTLE, || tether_links(node) == want_links);
    assert!(
        settled,
        "tth links did not settle within {LINK_SETTLE:?}: have {:?}, want {want_links:?}",
        tether_links(node)
    );
    let listed: BTreeSet<String> = attachments(daemon)
        .into_iter()
        .map(|a| a.container_id)
        .collect();
    let want_ids: BTreeSet<String> = live.keys().cloned().collect();
    assert_eq!(listed, want_ids, "attachments listed by the daemon");
    let used = pools_used(daemon);
    let n = live.len() as u64;
    assert_eq!(
        used,
        BTreeMap::from([(POD_CIDR_V4.to_owned(), n), (POD_CIDR_V6.to_owned(), n)]),
        "pool usage"
    );
}

// ---------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------

const PODS: usize = 100;

#[test]
fn hundred_concurrent_adds_then_hundred_concurrent_dels() {
    require_root();
    let daemon = dual_stack_daemon();
    let conf = daemon.netconf("1.0.0", NETWORK);
    let bin = tether_bin();
    let pods: Vec<Netns> = parallel(PODS, |_| Netns::new("cp"));
    let ids: Vec<String> = (0..PODS).map(|_| unique_name("cc")).collect();

    let adds = parallel(PODS, |i| add(&bin, &conf, &ids[i], &pods[i]));
    assert_all_succeeded("ADD", &adds);
    let added: Vec<Added> = adds.iter().map(Added::from_output).collect();

    assert_distinct("IPv4 addresses", added.iter().map(|a| &a.v4));
    assert_distinct("IPv6 addresses", added.iter().map(|a| &a.v6));
    assert_distinct("host interfaces", added.iter().map(|a| &a.host));
    for (pod, a) in pods.iter().zip(&added) {
        assert_pod_holds(pod, a);
    }
    let node = daemon.node();
    let routes = tether_routes(node);
    assert_eq!(routes.len(), 2 * PODS, "proto-201 routes: {routes:?}");
    assert_eq!(routes, expected_routes(&added));
    assert_eq!(tether_links(node).len(), PODS);
    let live: BTreeMap<String, Added> = ids.iter().cloned().zip(added.iter().cloned()).collect();
    assert_node_holds_exactly(&daemon, &live);
    // CHECK of every pod at once: the node's state is read concurrently.
    let checks = parallel(PODS, |i| check_added(&daemon, &ids[i], &pods[i], &added[i]));
    assert_all_succeeded("CHECK", &checks);

    let dels = parallel(PODS, |i| del(&bin, &conf, &ids[i], &pods[i]));
    assert_all_succeeded("DEL", &dels);
    // Routes go before DEL replies; only the veth teardown runs after it.
    assert_eq!(tether_routes(node), Vec::new(), "routes left after DEL");
    assert_node_holds_exactly(&daemon, &BTreeMap::new());
    let eth0_gone = wait_for(LINK_SETTLE, || {
        pods.iter()
            .all(|p| !p.link_names().iter().any(|n| n == "eth0"))
    });
    assert!(eth0_gone, "some pod still has eth0 after DEL");
}

#[test]
fn interleaved_adds_and_dels_and_repeated_adds_of_one_attachment() {
    require_root();
    const OLD: usize = 20;
    const NEW: usize = 20;
    const SAME: usize = 12;
    let daemon = dual_stack_daemon();
    let conf = daemon.netconf("1.0.0", NETWORK);
    let bin = tether_bin();
    let old_pods: Vec<Netns> = parallel(OLD, |_| Netns::new("co"));
    let old_ids: Vec<String> = (0..OLD).map(|_| unique_name("co")).collect();
    let new_pods: Vec<Netns> = parallel(NEW, |_| Netns::new("cn"));
    let new_ids: Vec<String> = (0..NEW).map(|_| unique_name("cn")).collect();
    let same_pod = Netns::new("cs");
    let same_id = unique_name("cs");

    let olds = parallel(OLD, |i| add(&bin, &conf, &old_ids[i], &old_pods[i]));
    assert_all_succeeded("ADD", &olds);

    // At once: DEL every old pod, ADD every new pod, and ADD one more
    // attachment SAME times. Old and new calls alternate by index so the
    // verbs really interleave.
    let outs = parallel(OLD + NEW + SAME, |i| {
        if i < 2 * OLD.min(NEW) {
            let k = i / 2;
            if i % 2 == 0 {
                ("DEL", del(&bin, &conf, &old_ids[k], &old_pods[k]))
            } else {
                ("ADD", add(&bin, &conf, &new_ids[k], &new_pods[k]))
            }
        } else {
            ("ADD", add(&bin, &conf, &same_id, &same_pod))
        }
    });
    let (dels, adds): (Vec<_>, Vec<_>) = outs.into_iter().partition(|(verb, _)| *verb == "DEL");
    let dels: Vec<CniOutput> = dels.into_iter().map(|(_, o)| o).collect();
    let adds: Vec<CniOutput> = adds.into_iter().map(|(_, o)| o).collect();
    assert_all_succeeded("DEL", &dels);
    assert_all_succeeded("ADD", &adds);
    let (new_adds, same_adds) = adds.split_at(NEW);

    let same_results: Vec<&Value> = same_adds.iter().map(|o| o.result()).collect();
    for (i, r) in same_results.iter().enumerate() {
        assert_eq!(
            *r, same_results[0],
            "repeated ADD #{i} of one attachment returned a different result"
        );
    }
    let same = Added::from_output(&same_adds[0]);
    let same_links: Vec<String> = daemon
        .node()
        .link_names()
        .into_iter()
        .filter(|n| *n == same.host)
        .collect();
    assert_eq!(same_links.len(), 1, "links named {}", same.host);
    let pod_links: Vec<String> = same_pod
        .link_names()
        .into_iter()
        .filter(|n| n != "lo")
        .collect();
    assert_eq!(pod_links, ["eth0"], "links in the repeatedly added pod");
    assert_pod_holds(&same_pod, &same);

    let new_added: Vec<Added> = new_adds.iter().map(Added::from_output).collect();
    let mut live: BTreeMap<String, Added> = new_ids
        .iter()
        .cloned()
        .zip(new_added.iter().cloned())
        .collect();
    live.insert(same_id.clone(), same.clone());
    assert_distinct("IPv4 addresses", live.values().map(|a| &a.v4));
    assert_distinct("IPv6 addresses", live.values().map(|a| &a.v6));
    for (pod, a) in new_pods.iter().zip(&new_added) {
        assert_pod_holds(pod, a);
    }
    // Freed addresses may be reused by the new pods: each route must point
    // at its new owner's link, never at a deleted pod's.
    assert_node_holds_exactly(&daemon, &live);

    // A second wave on settled state: the same attachment ADDed again many
    // times while every new pod is CHECKed. Intact wiring is left alone, so
    // the veth is not recreated under the pod.
    let ifindex_before = ifindex(daemon.node(), &same.host);
    let wave = parallel(SAME + NEW, |i| {
        if i < SAME {
            add(&bin, &conf, &same_id, &same_pod)
        } else {
            let k = i - SAME;
            check_added(&daemon, &new_ids[k], &new_pods[k], &new_added[k])
        }
    });
    let (again, checks) = wave.split_at(SAME);
    assert_all_succeeded("repeated ADD", again);
    assert_all_succeeded("CHECK", checks);
    for (i, out) in again.iter().enumerate() {
        assert_eq!(
            out.result(),
            &same.result,
            "repeated ADD #{i} on settled state returned a different result"
        );
    }
    assert_eq!(
        ifindex(daemon.node(), &same.host),
        ifindex_before,
        "a repeated ADD of intact wiring recreated the veth {}",
        same.host
    );
    assert_node_holds_exactly(&daemon, &live);
}
