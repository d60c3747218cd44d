//! ADD, DEL, CHECK, GC and reconciliation of plain pods.

use super::*;
use std::path::Path;
use tether_cni::config::VALID_ATTACHMENTS_KEY;
use tether_kernel::fake::{Call as K, FakeLink};
use tether_kernel::host_ifname;

/// Addresses in use, over every pool.
/// The fake kernel's veths and routes and the store's records, to show
/// that a refused call changed none of them.
fn state(t: &TestNode) -> impl PartialEq + std::fmt::Debug {
    (
        t.kernel.links(),
        t.kernel.routes(),
        t.store.load().expect("load"),
    )
}

fn used(t: &TestNode) -> u128 {
    t.node.pool_usage().iter().map(|(_, used, _)| used).sum()
}

/// The stored record of container `cid` on network "tether", eth0.
fn record(t: &TestNode, cid: &str) -> Option<Attachment> {
    t.store
        .load()
        .expect("load")
        .into_iter()
        .find(|a| a.key.network == "tether" && a.key.container_id == cid)
}

/// The container ids of the attachments the node knows, sorted.
fn known(t: &TestNode) -> Vec<String> {
    let mut v: Vec<String> = t
        .node
        .attachments()
        .into_iter()
        .map(|a| a.key.container_id)
        .collect();
    v.sort();
    v
}

/// The container ids of the stored attachments, sorted.
fn stored(t: &TestNode) -> Vec<String> {
    let mut v: Vec<String> = t
        .store
        .load()
        .expect("load")
        .into_iter()
        .map(|a| a.key.container_id)
        .collect();
    v.sort();
    v
}

/// Nothing in the kernel, the store, the node's table or the pools.
fn assert_nothing_left(t: &TestNode) {
    assert!(t.kernel.links().is_empty(), "{:?}", t.kernel.links());
    assert!(t.kernel.routes().is_empty(), "{:?}", t.kernel.routes());
    assert!(t.store.load().expect("load").is_empty());
    assert!(t.node.attachments().is_empty());
    assert_eq!(used(t), 0, "{:?}", t.node.pool_usage());
}

/// The host name of container `cid` on network "tether", eth0.
fn host_of(cid: &str) -> String {
    host_ifname("tether", cid, "eth0")
}

/// A CHECK of `cid` in netns `pod`, with `prev` as prevResult.
async fn check(t: &TestNode, cid: &str, pod: &str, prev: &Value) -> Result<Vec<u8>> {
    let inv = t.inv(
        Call::new("CHECK", cid)
            .netns(&t.netns(pod))
            .conf("prevResult", prev.clone()),
    );
    t.node.check(&inv).await
}

/// A GC of network "tether" that lists `valid` (container ids, eth0).
async fn gc(t: &TestNode, valid: &[&str]) -> Result<Vec<u8>> {
    let list: Vec<Value> = valid
        .iter()
        .map(|cid| json!({"containerID": cid, "ifname": "eth0"}))
        .collect();
    let inv = t.inv(Call::new("GC", "").conf(VALID_ATTACHMENTS_KEY, json!(list)));
    t.node.gc(&inv).await
}

/// A node whose only pool, 10.9.0.0/30, holds two addresses.
async fn tiny() -> TestNode {
    TestNode::with(Options {
        cidrs: vec![net("10.9.0.0/30")],
        ..Options::default()
    })
    .await
}

/// A stray veth as a crash or a failed rollback leaves it.
fn stray_link(t: &TestNode, pod: &str, addr: &str) -> FakeLink {
    FakeLink {
        index: 999,
        netns: t.netns(pod),
        pod_ifname: "eth0".into(),
        pod_mac: tether_kernel::pod_mac(&[ip(addr)]),
        ips: vec![ip(addr)],
        mtu: 1500,
    }
}

#[tokio::test]
async fn add_wires_a_veth_with_routes_and_records_it() {
    let t = TestNode::new().await;
    let result = t.add("c1", "p1").await.expect("ADD");
    let ips: Vec<&str> = result["ips"]
        .as_array()
        .expect("ips")
        .iter()
        .filter_map(|i| i["address"].as_str())
        .collect();
    assert_eq!(ips.len(), 2, "{result}");
    let links = t.kernel.links();
    assert_eq!(links.len(), 1);
    let (host, link) = links.iter().next().expect("a link");
    assert_eq!(link.ips.len(), 2);
    for ip in &link.ips {
        let route = t.kernel.route_to(*ip).expect("a host route");
        assert_eq!(route.dev.as_deref(), Some(host.as_str()));
    }
    assert_eq!(t.store.load().expect("load").len(), 1);
    assert!(t.host.forwarding());
}

#[tokio::test]
async fn add_rolls_back_everything_when_the_wiring_fails() {
    let t = TestNode::new().await;
    t.kernel.fail_nth(K::Wire, 0);
    let err = t.add("c1", "p1").await.expect_err("the wiring fails");
    assert_eq!(err.code(), 101, "{err}");
    assert!(t.kernel.links().is_empty());
    assert!(t.kernel.routes().is_empty());
    assert!(t.store.load().expect("load").is_empty());
    assert!(t.node.attachments().is_empty());
    // The addresses went back to the pools: the next pod gets the same.
    t.add("c2", "p2").await.expect("ADD after the failure");
    let used: u128 = t.node.pool_usage().iter().map(|(_, used, _)| used).sum();
    assert_eq!(used, 2);
}

#[tokio::test]
async fn a_restart_after_a_crash_repairs_the_kernel_from_the_store() {
    let t = TestNode::new().await;
    t.add("c1", "p1").await.expect("ADD");
    let (host, link) = t.kernel.links().into_iter().next().expect("a link");
    let pod_ip = link.ips[0];
    let (t, reconciled) = t
        .restart(|t| {
            // What a crash can leave: a veth and a route that no record owns
            // (the daemon died before the store commit), and a recorded
            // pod's route gone.
            t.kernel.plant_link(
                "tth0000000000ff",
                tether_kernel::fake::FakeLink {
                    index: 999,
                    netns: t.netns("orphan"),
                    pod_ifname: "eth0".into(),
                    pod_mac: tether_kernel::pod_mac(&[ip("10.1.0.200")]),
                    ips: vec![ip("10.1.0.200")],
                    mtu: 1500,
                },
            );
            t.kernel
                .plant_host_route(ip("10.1.0.200"), "tth0000000000ff");
            t.kernel.drop_route(pod_ip);
        })
        .await
        .expect("restart");
    assert_eq!(reconciled.attachments, 1);
    assert_eq!(reconciled.routes_added, 1, "{reconciled:?}");
    assert_eq!(reconciled.routes_removed, 1, "{reconciled:?}");
    assert_eq!(reconciled.links_removed, 1, "{reconciled:?}");
    let links = t.kernel.links();
    assert_eq!(links.keys().collect::<Vec<_>>(), vec![&host]);
    assert_eq!(
        t.kernel.route_to(pod_ip).and_then(|r| r.dev),
        Some(host.clone())
    );
    assert!(t.kernel.route_to(ip("10.1.0.200")).is_none());
    // The pod is still known: its DEL releases it.
    t.del("c1").await.expect("DEL");
    t.eventually("the veth is deleted", |t| t.kernel.links().is_empty())
        .await;
    assert!(t.kernel.routes().is_empty());
}

// ---- ADD rollback at each failing step ----

#[tokio::test]
async fn add_into_a_missing_netns_fails_with_4_and_leaves_nothing() {
    let t = TestNode::new().await;
    let inv = t.inv(Call::new("ADD", "c1").netns(Path::new("/run/netns/gone")));
    let err = t.node.add(&inv).await.expect_err("no such netns");
    assert_eq!(err.code(), 4, "{err}");
    assert_eq!(t.kernel.calls(K::Wire), 0);
    assert_nothing_left(&t);
    // A netns that existed and is gone by the ADD: the same.
    let gone = t.netns("p1");
    t.kernel.remove_netns(&gone);
    let inv = t.inv(Call::new("ADD", "c1").netns(&gone));
    let err = t.node.add(&inv).await.expect_err("the netns is gone");
    assert_eq!(err.code(), 4, "{err}");
    assert_nothing_left(&t);
}

#[tokio::test]
async fn add_on_an_exhausted_pool_fails_with_100_until_a_del_frees_an_address() {
    let t = tiny().await;
    t.add("c1", "p1").await.expect("ADD c1");
    t.add("c2", "p2").await.expect("ADD c2");
    let before = state(&t);
    let err = t.add("c3", "p3").await.expect_err("the pool is full");
    assert_eq!(err.code(), 100, "{err}");
    assert_eq!(state(&t), before);
    assert!(t
        .kernel
        .log()
        .iter()
        .all(|(c, what)| *c != K::Wire || *what != host_of("c3")));
    assert_eq!(stored(&t), ["c1", "c2"]);
    assert_eq!(known(&t), ["c1", "c2"]);
    assert_eq!(t.node.pool_usage(), vec![(net("10.9.0.0/30"), 2, 0)]);
    // A DEL frees an address; the next ADD gets it.
    let freed = record(&t, "c1").expect("c1 recorded").ips;
    t.del("c1").await.expect("DEL c1");
    assert_eq!(t.node.pool_usage(), vec![(net("10.9.0.0/30"), 1, 1)]);
    t.add("c3", "p3").await.expect("ADD c3 after the DEL");
    assert_eq!(record(&t, "c3").expect("c3 recorded").ips, freed);
    assert_eq!(
        t.kernel.route_to(freed[0]).and_then(|r| r.dev),
        Some(host_of("c3"))
    );
    assert_eq!(stored(&t), ["c2", "c3"]);
}

#[tokio::test]
async fn add_removes_the_veth_when_the_store_insert_fails() {
    let faults = Arc::new(StoreFaults::default());
    let t = TestNode::with(Options {
        store_faults: Some(faults.clone()),
        ..Options::default()
    })
    .await;
    faults.fail_insert(true);
    let err = t.add("c1", "p1").await.expect_err("the store fails");
    assert_eq!(err.code(), 104, "{err}");
    // The wiring ran alongside the insert and was undone.
    assert_eq!(t.kernel.calls(K::Wire), 1);
    assert!(t.kernel.log().contains(&(K::DeleteLink, host_of("c1"))));
    assert_nothing_left(&t);
    faults.fail_insert(false);
    t.add("c1", "p1").await.expect("ADD once the store works");
    assert_eq!(stored(&t), ["c1"]);
    assert_eq!(used(&t), 2);
}

#[tokio::test]
async fn add_leaves_nothing_when_the_wiring_and_the_store_both_fail() {
    let faults = Arc::new(StoreFaults::default());
    let t = TestNode::with(Options {
        store_faults: Some(faults.clone()),
        ..Options::default()
    })
    .await;
    faults.fail_insert(true);
    t.kernel.fail_nth(K::Wire, 0);
    let err = t.add("c1", "p1").await.expect_err("both halves fail");
    // The store's error is reported first.
    assert_eq!(err.code(), 104, "{err}");
    // Neither half succeeded: nothing to undo.
    assert_eq!(t.kernel.calls(K::DeleteLink), 0);
    assert_nothing_left(&t);
    faults.fail_insert(false);
    t.add("c1", "p1").await.expect("ADD once both work");
    assert_eq!(stored(&t), ["c1"]);
    assert_eq!(t.kernel.links().len(), 1);
}

#[tokio::test]
async fn add_of_an_interface_name_taken_in_the_pod_fails_with_102_and_spares_the_first_pod() {
    let t = TestNode::new().await;
    let first = t.add("c1", "p1").await.expect("ADD c1");
    let before = state(&t);
    // Another container's eth0 in the same netns.
    let err = t.add("c2", "p1").await.expect_err("eth0 is taken");
    assert_eq!(err.code(), 102, "{err}");
    assert_eq!(state(&t), before);
    assert_eq!(known(&t), ["c1"]);
    assert_eq!(used(&t), 2);
    check(&t, "c1", "p1", &first)
        .await
        .expect("the first pod is intact");
}

// ---- DEL order ----

#[tokio::test]
async fn del_withdraws_the_route_before_the_link_goes() {
    let t = TestNode::new().await;
    t.add("c1", "p1").await.expect("ADD");
    let ips = record(&t, "c1").expect("recorded").ips;
    t.kernel.clear_log();
    t.del("c1").await.expect("DEL");
    // When DEL replies, the route and the record are gone.
    for ip in &ips {
        assert!(t.kernel.route_to(*ip).is_none(), "route to {ip}");
    }
    assert!(t.store.load().expect("load").is_empty());
    assert!(t.node.attachments().is_empty());
    assert_eq!(used(&t), 0);
    t.eventually("the veth is deleted", |t| t.kernel.links().is_empty())
        .await;
    let log = t.kernel.log();
    let routes = log
        .iter()
        .position(|(c, _)| *c == K::RemoveHostRoutes)
        .expect("routes removed");
    let link = log
        .iter()
        .position(|(c, what)| {
            matches!(c, K::DeleteLinks | K::DeleteLink) && what.contains(&host_of("c1"))
        })
        .expect("link deleted");
    assert!(routes < link, "{log:?}");
}

#[tokio::test]
async fn del_succeeds_when_the_background_link_deletion_fails() {
    let t = TestNode::new().await;
    t.add("c1", "p1").await.expect("ADD");
    let ips = record(&t, "c1").expect("recorded").ips;
    let host = host_of("c1");
    t.kernel.fail_always(K::DeleteLinks);
    t.del("c1").await.expect("DEL");
    t.eventually("the background deletion was tried", |t| {
        t.node.link_deletions_in_flight() == 0
            && t.kernel
                .log()
                .iter()
                .any(|(c, what)| *c == K::DeleteLinks && what.contains(&host))
    })
    .await;
    // The route and the record went first; only the veth is left.
    assert!(t.kernel.links().contains_key(&host));
    for ip in &ips {
        assert!(t.kernel.route_to(*ip).is_none(), "route to {ip}");
    }
    assert!(t.store.load().expect("load").is_empty());
    assert!(t.node.attachments().is_empty());
    assert_eq!(used(&t), 0);
    // The next sweep removes the leftover veth.
    t.kernel.heal();
    gc(&t, &[]).await.expect("GC");
    assert!(t.kernel.links().is_empty());
}

#[tokio::test]
async fn del_keeps_the_attachment_when_the_route_removal_fails_and_a_retry_finishes_it() {
    let t = TestNode::new().await;
    t.add("c1", "p1").await.expect("ADD");
    let ips = record(&t, "c1").expect("recorded").ips;
    let host = host_of("c1");
    t.kernel.fail_always(K::RemoveHostRoutes);
    let err = t.del("c1").await.expect_err("the routes cannot be removed");
    assert_eq!(err.code(), 101, "{err}");
    assert_eq!(known(&t), ["c1"]);
    assert_eq!(used(&t), 2);
    for ip in &ips {
        assert_eq!(
            t.kernel.route_to(*ip).and_then(|r| r.dev),
            Some(host.clone())
        );
    }
    assert!(t.kernel.links().contains_key(&host));
    assert_eq!(t.node.link_deletions_in_flight(), 0);
    assert!(!t
        .kernel
        .log()
        .iter()
        .any(|(c, what)| *c == K::DeleteLinks && what.contains(&host)));
    // The runtime retries.
    t.kernel.heal();
    t.del("c1").await.expect("the retried DEL");
    assert!(t.kernel.routes().is_empty());
    t.eventually("the veth is deleted", |t| t.kernel.links().is_empty())
        .await;
    assert_nothing_left(&t);
}

#[tokio::test]
async fn del_keeps_the_store_record_when_the_route_removal_fails() {
    let t = TestNode::new().await;
    t.add("c1", "p1").await.expect("ADD");
    t.kernel.fail_always(K::RemoveHostRoutes);
    t.del("c1").await.expect_err("the routes cannot be removed");
    assert_eq!(known(&t), ["c1"]);
    assert_eq!(stored(&t), ["c1"]);
}

#[tokio::test]
async fn del_keeps_the_attachment_when_the_store_removal_fails_and_a_retry_finishes_it() {
    let faults = Arc::new(StoreFaults::default());
    let t = TestNode::with(Options {
        store_faults: Some(faults.clone()),
        ..Options::default()
    })
    .await;
    t.add("c1", "p1").await.expect("ADD");
    let host = host_of("c1");
    faults.fail_remove(true);
    let err = t.del("c1").await.expect_err("the store fails");
    assert_eq!(err.code(), 104, "{err}");
    assert_eq!(stored(&t), ["c1"]);
    assert_eq!(known(&t), ["c1"]);
    assert_eq!(used(&t), 2);
    assert!(t.kernel.links().contains_key(&host));
    assert_eq!(t.node.link_deletions_in_flight(), 0);
    assert!(!t
        .kernel
        .log()
        .iter()
        .any(|(c, what)| *c == K::DeleteLinks && what.contains(&host)));
    faults.fail_remove(false);
    t.del("c1").await.expect("the retried DEL");
    t.eventually("the veth is deleted", |t| t.kernel.links().is_empty())
        .await;
    assert_nothing_left(&t);
}

// ---- repeated ADD ----

#[tokio::test]
async fn a_repeated_add_returns_the_same_result_without_rewiring() {
    let t = TestNode::new().await;
    let first = t.add("c1", "p1").await.expect("ADD");
    let links = t.kernel.links();
    let second = t.add("c1", "p1").await.expect("the repeated ADD");
    assert_eq!(first, second);
    assert_eq!(t.kernel.calls(K::Wire), 1);
    assert_eq!(t.kernel.calls(K::DeleteLink), 0);
    assert_eq!(t.kernel.links(), links);
    assert_eq!(stored(&t), ["c1"]);
    assert_eq!(used(&t), 2);
}

#[tokio::test]
async fn a_repeated_add_rewires_broken_wiring_with_the_same_addresses() {
    let t = TestNode::new().await;
    let first = t.add("c1", "p1").await.expect("ADD");
    let rec = record(&t, "c1").expect("recorded");
    t.kernel.drop_route(rec.ips[0]);
    let second = t.add("c1", "p1").await.expect("the repeated ADD");
    assert_eq!(first, second);
    assert_eq!(t.kernel.calls(K::Wire), 2);
    assert_eq!(t.store.load().expect("load"), vec![rec.clone()]);
    assert_eq!(t.node.attachments(), vec![rec.clone()]);
    assert_eq!(used(&t), 2);
    let link = t.kernel.links().remove(&rec.host_ifname).expect("the veth");
    assert_eq!(link.ips, rec.ips);
    for ip in &rec.ips {
        assert_eq!(
            t.kernel.route_to(*ip).and_then(|r| r.dev),
            Some(rec.host_ifname.clone())
        );
    }
    check(&t, "c1", "p1", &first)
        .await
        .expect("CHECK after the rewiring");
}

#[tokio::test]
async fn a_repeated_add_in_another_netns_is_an_attachment_conflict() {
    let t = TestNode::new().await;
    t.add("c1", "p1").await.expect("ADD");
    let before = state(&t);
    let err = t.add("c1", "p2").await.expect_err("another netns");
    assert_eq!(err.code(), 103, "{err}");
    assert_eq!(t.kernel.calls(K::Wire), 1);
    assert_eq!(state(&t), before);
    assert_eq!(used(&t), 2);
}

// ---- DEL of an unknown attachment ----

#[tokio::test]
async fn del_of_an_unknown_attachment_succeeds_and_deletes_its_leftover_veth() {
    let t = TestNode::new().await;
    t.add("c1", "p1").await.expect("ADD c1");
    // Nothing at all of "nobody".
    let out = t
        .node
        .del(&t.inv(Call::new("DEL", "nobody")), None)
        .await
        .expect("DEL of nothing");
    assert!(out.is_empty());
    // A veth of "ghost"'s name without a record: a failed rollback's.
    let ghost = host_of("ghost");
    t.kernel
        .plant_link(&ghost, stray_link(&t, "ghost", "10.1.0.200"));
    let out = t
        .node
        .del(&t.inv(Call::new("DEL", "ghost")), None)
        .await
        .expect("DEL of ghost");
    assert!(out.is_empty());
    t.eventually("the leftover veth is deleted", |t| {
        !t.kernel.links().contains_key(&ghost)
    })
    .await;
    assert_eq!(
        t.kernel.links().keys().cloned().collect::<Vec<_>>(),
        vec![host_of("c1")]
    );
    assert_eq!(stored(&t), ["c1"]);
    assert_eq!(used(&t), 2);
}

// ---- GC ----

#[tokio::test]
async fn gc_releases_unlisted_attachments_of_its_network_and_sweeps_orphans() {
    let t = TestNode::new().await;
    for (cid, pod) in [("c1", "p1"), ("c2", "p2"), ("c3", "p3")] {
        t.add(cid, pod).await.expect("ADD");
    }
    let other = t.inv(
        Call::new("ADD", "c4")
            .netns(&t.netns("p4"))
            .conf("name", json!("other")),
    );
    t.node.add(&other).await.expect("ADD on network other");
    let keep: Vec<Attachment> = t
        .node
        .attachments()
        .into_iter()
        .filter(|a| a.key.container_id == "c1" || a.key.container_id == "c4")
        .collect();
    assert_eq!(keep.len(), 2);
    // Orphans: a veth with a route through it, and a route of ours to an
    // address no pod holds through a kept pod's veth.
    t.kernel
        .plant_link("tth0000000000ff", stray_link(&t, "orphan", "10.1.0.200"));
    t.kernel
        .plant_host_route(ip("10.1.0.200"), "tth0000000000ff");
    t.kernel
        .plant_host_route(ip("10.1.0.201"), &keep[1].host_ifname);
    let out = gc(&t, &["c1"]).await.expect("GC");
    assert!(out.is_empty());
    assert_eq!(t.node.attachments(), keep);
    let mut records = t.store.load().expect("load");
    records.sort_by(|a, b| a.key.cmp(&b.key));
    assert_eq!(records, keep);
    assert_eq!(used(&t), 4);
    let mut want_links: Vec<String> = keep.iter().map(|a| a.host_ifname.clone()).collect();
    want_links.sort();
    t.eventually("only the kept pods' veths are left", |t| {
        t.kernel.links().keys().cloned().collect::<Vec<_>>() == want_links
    })
    .await;
    let mut want_routes: Vec<IpNet> = keep
        .iter()
        .flat_map(|a| a.ips.iter().map(|ip| IpNet::from(*ip)))
        .collect();
    want_routes.sort();
    assert_eq!(
        t.kernel.routes().keys().copied().collect::<Vec<_>>(),
        want_routes
    );
    // A GC that lists every pod of the network changes nothing.
    t.add("c5", "p5").await.expect("ADD c5");
    gc(&t, &["c1", "c5"]).await.expect("GC");
    assert_eq!(known(&t), ["c1", "c4", "c5"]);
    assert_eq!(used(&t), 6);
}

#[tokio::test]
async fn gc_sweeps_an_unowned_route_whose_device_is_gone() {
    let t = TestNode::new().await;
    t.add("c1", "p1").await.expect("ADD");
    // A route of ours with no device behind it (a blackhole route of
    // protocol 201, or a device gone between the two dumps).
    t.kernel
        .plant_host_route(ip("10.1.0.201"), "tth0000000000fe");
    gc(&t, &["c1"]).await.expect("GC");
    assert!(t.kernel.route_to(ip("10.1.0.201")).is_none());
}

// ---- reconcile after a crash ----

#[tokio::test]
async fn a_reboot_releases_every_attachment_of_the_previous_boot() {
    let t = TestNode::new().await;
    t.add("c1", "p1").await.expect("ADD c1");
    t.add("c2", "p2").await.expect("ADD c2");
    let first_ips = record(&t, "c1").expect("c1 recorded").ips;
    let (t, reconciled) = t
        .restart(|t| t.host.reboot("boot-2"))
        .await
        .expect("restart");
    assert_eq!(reconciled.attachments, 0, "{reconciled:?}");
    assert!(t.store.load().expect("load").is_empty());
    assert!(t.node.attachments().is_empty());
    assert_eq!(used(&t), 0);
    // What the fake kept of the old boot's kernel is swept as orphans.
    assert_eq!(reconciled.links_removed, 2, "{reconciled:?}");
    assert!(t.kernel.links().is_empty());
    assert!(t.kernel.routes().is_empty());
    // The old addresses are handed out again.
    t.add("c3", "p3").await.expect("ADD after the reboot");
    assert_eq!(record(&t, "c3").expect("c3 recorded").ips, first_ips);
}

#[tokio::test]
async fn a_record_whose_veth_is_gone_stays_until_its_del() {
    let t = TestNode::new().await;
    let first = t.add("c1", "p1").await.expect("ADD");
    let rec = record(&t, "c1").expect("recorded");
    let (t, reconciled) = t
        .restart(|t| t.kernel.drop_link(&rec.host_ifname))
        .await
        .expect("restart");
    assert_eq!(reconciled.attachments, 1, "{reconciled:?}");
    assert_eq!(reconciled.routes_added, 0, "{reconciled:?}");
    assert_eq!(t.store.load().expect("load"), vec![rec.clone()]);
    assert_eq!(t.node.attachments(), vec![rec.clone()]);
    assert_eq!(used(&t), 2);
    assert!(t.kernel.links().is_empty());
    assert!(t.kernel.routes().is_empty());
    let err = check(&t, "c1", "p1", &first)
        .await
        .expect_err("the veth is gone");
    assert_eq!(err.code(), 114, "{err}");
    t.del("c1").await.expect("DEL");
    assert_nothing_left(&t);
}

// ---- CHECK ----

#[tokio::test]
async fn check_passes_on_intact_wiring() {
    let t = TestNode::new().await;
    let first = t.add("c1", "p1").await.expect("ADD");
    let out = check(&t, "c1", "p1", &first).await.expect("CHECK");
    assert!(out.is_empty());
    assert_eq!(t.kernel.calls(K::Check), 1);
}

#[tokio::test]
async fn check_of_a_missing_host_route_fails_with_115() {
    let t = TestNode::new().await;
    let first = t.add("c1", "p1").await.expect("ADD");
    let rec = record(&t, "c1").expect("recorded");
    t.kernel.drop_route(rec.ips[1]);
    let err = check(&t, "c1", "p1", &first)
        .await
        .expect_err("a route is missing");
    assert_eq!(err.code(), 115, "{err}");
    // CHECK repairs nothing.
    assert!(t.kernel.route_to(rec.ips[1]).is_none());
    assert_eq!(t.kernel.calls(K::Wire), 1);
}

#[tokio::test]
async fn check_of_an_unknown_attachment_fails_with_110() {
    let t = TestNode::new().await;
    let first = t.add("c1", "p1").await.expect("ADD");
    let err = check(&t, "c9", "p9", &first)
        .await
        .expect_err("no such attachment");
    assert_eq!(err.code(), 110, "{err}");
    assert_eq!(t.kernel.calls(K::Check), 0);
}

// ---- STATUS ----

#[tokio::test]
async fn status_is_ok_with_room_and_fails_with_50_when_a_pool_is_exhausted() {
    let t = tiny().await;
    assert!(t.node.status().await.expect("STATUS").is_empty());
    t.add("c1", "p1").await.expect("ADD c1");
    t.node.status().await.expect("STATUS with one address left");
    t.add("c2", "p2").await.expect("ADD c2");
    let err = t.node.status().await.expect_err("the pool is full");
    assert_eq!(err.code(), 50, "{err}");
    t.del("c2").await.expect("DEL c2");
    t.node.status().await.expect("STATUS after a DEL");
}
