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

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;
use tether_e2e::{
    add, assert_distinct, assert_pod_holds, assert_tether_links_settle, del, expected_routes,
    parallel, require_root, tether_bin, unique_name, wait_link_gone, AddResult, CniOutput, Daemon,
    DaemonOpts, Netns, LINK_SETTLE,
};

const NETWORK: &str = "tether-conc";
const POD_CIDR_V4: &str = "10.96.0.0/24";
const POD_CIDR_V6: &str = "fd00:96::/120";

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

/// The ifindex of link `name` in `ns`: it changes when the link is
/// recreated.
fn ifindex(ns: &Netns, name: &str) -> u64 {
    ns.links()
        .iter()
        .find(|l| l["ifname"] == name)
        .and_then(|l| l["ifindex"].as_u64())
        .unwrap_or_else(|| panic!("no link {name} in {}", ns.name()))
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
fn assert_node_holds_exactly(daemon: &Daemon, live: &BTreeMap<String, AddResult>) {
    let node = daemon.node();
    assert_eq!(
        node.tether_routes(),
        expected_routes(live.values()),
        "proto-201 routes in the node netns"
    );
    assert_tether_links_settle(node, live.values());
    let want_ids: BTreeSet<String> = live.keys().cloned().collect();
    assert_eq!(
        daemon.attachment_ids(),
        want_ids,
        "attachments listed by the daemon"
    );
    let used = daemon.pools_used();
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

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
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
    let added: Vec<AddResult> = adds.iter().map(AddResult::from_output).collect();

    assert_distinct("IPv4 addresses", added.iter().map(|a| &a.v4));
    assert_distinct("IPv6 addresses", added.iter().map(|a| &a.v6));
    assert_distinct("host interfaces", added.iter().map(|a| &a.host));
    for (pod, a) in pods.iter().zip(&added) {
        assert_pod_holds(pod, a);
    }
    let node = daemon.node();
    let routes = node.tether_routes();
    assert_eq!(routes.len(), 2 * PODS, "proto-201 routes: {routes:?}");
    assert_eq!(routes, expected_routes(&added));
    assert_eq!(node.tether_links().len(), PODS);
    let live: BTreeMap<String, AddResult> =
        ids.iter().cloned().zip(added.iter().cloned()).collect();
    assert_node_holds_exactly(&daemon, &live);
    // CHECK of every pod at once: the node's state is read concurrently.
    let checks = parallel(PODS, |i| {
        added[i].check(&daemon, NETWORK, &ids[i], &pods[i])
    });
    assert_all_succeeded("CHECK", &checks);

    let dels = parallel(PODS, |i| del(&bin, &conf, &ids[i], &pods[i]));
    assert_all_succeeded("DEL", &dels);
    // Routes go before DEL replies; only the veth teardown runs after it.
    assert_eq!(node.tether_routes(), Vec::new(), "routes left after DEL");
    assert_node_holds_exactly(&daemon, &BTreeMap::new());
    let eth0_gone = wait_link_gone(&pods, "eth0", LINK_SETTLE);
    assert!(eth0_gone, "some pod still has eth0 after DEL");
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
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
    let same = AddResult::from_output(&same_adds[0]);
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

    let new_added: Vec<AddResult> = new_adds.iter().map(AddResult::from_output).collect();
    let mut live: BTreeMap<String, AddResult> = new_ids
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
            new_added[k].check(&daemon, NETWORK, &new_ids[k], &new_pods[k])
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
