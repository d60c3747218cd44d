//! KubeVirt VM pods: placement in the VM's address record, the cutover of a
//! live migration, the source pod's DEL, and the rollback of a failed ADD.
//!
//! Two nodes of one cluster share a control store (and so the records);
//! each has its own fake kernel, as two machines have. Node B's pod CIDRs
//! differ from node A's, as `--pod-cidr` mode gives every node its own.

use super::*;
use crate::faulty_control::{Failure, FaultyControl};
use crate::vm::{Trigger, VmAttachment, VmKey, VmRecord, TARGET_READY_ANNOTATION};
use std::time::Instant;
use tether_base::mac::Mac;
use tether_base::time::UnixNanos;
use tether_kernel::fake::Call as K;
use tether_kernel::{AnnounceKind, Announcement, ROUTE_PROTOCOL};

/// Node A, with the default options and a fresh control store.
async fn node_a() -> TestNode {
    TestNode::new().await
}

/// Node B of node A's cluster: the same control store, its own CIDRs.
async fn node_b(a: &TestNode) -> TestNode {
    TestNode::with(Options {
        name: "node-b".into(),
        cidrs: vec![net("10.2.0.0/24"), net("fd00:2::/120")],
        control: Some(a.control.clone()),
        ..Default::default()
    })
    .await
}

/// The key of VM `vm`'s eth0 (every test pod is in namespace default).
fn key(vm: &str) -> VmKey {
    VmKey::new("default", vm, "eth0").expect("VM key")
}

/// The node-side veth of container `cid`'s eth0 on network "tether".
fn host(cid: &str) -> String {
    tether_kernel::host_ifname("tether", cid, "eth0")
}

/// ADD of container `cid` (netns named after it) as a pod of VM `vm`.
fn vm_call(t: &TestNode, cid: &str, vm: &str) -> Call {
    Call::new("ADD", cid).netns(&t.netns(cid)).vm(vm)
}

async fn add(t: &TestNode, call: Call) -> Result<Value> {
    let inv = t.inv(call);
    t.node.add(&inv).await.map(|b| parse_json(&b))
}

async fn del(t: &TestNode, call: Call) -> Result<()> {
    let inv = t.inv(call);
    t.node.del(&inv, None).await.map(|_| ())
}

async fn check(t: &TestNode, call: Call) -> Result<()> {
    let inv = t.inv(call);
    t.node.check(&inv).await.map(|_| ())
}

/// The record of `vm` as the control store has it (not the view).
async fn record(t: &TestNode, vm: &str) -> Option<VmRecord> {
    t.node
        .vms()
        .records()
        .read(&key(vm))
        .await
        .expect("read the VM record")
        .map(|(r, _)| r)
}

/// The record of `vm` in this node's view.
fn cached(t: &TestNode, vm: &str) -> Option<VmRecord> {
    t.node.vms().records().cached(&key(vm)).map(|(r, _)| r)
}

/// Whether `x` is container `cid`'s eth0 on network "tether" on `node`.
fn is(x: &Option<VmAttachment>, node: &str, cid: &str) -> bool {
    x.as_ref()
        .is_some_and(|a| a.is(node, "tether", cid, "eth0"))
}

/// The addresses of an ADD result.
fn result_ips(result: &Value) -> Vec<IpAddr> {
    result["ips"]
        .as_array()
        .expect("ips")
        .iter()
        .map(|i| {
            i["address"]
                .as_str()
                .and_then(|a| a.parse::<IpNet>().ok())
                .expect("an address")
                .addr()
        })
        .collect()
}

/// The pod interface's MAC of an ADD result.
fn result_mac(result: &Value) -> String {
    result["interfaces"]
        .as_array()
        .expect("interfaces")
        .iter()
        .find(|i| i.get("sandbox").is_some())
        .and_then(|i| i["mac"].as_str())
        .expect("a pod interface with a MAC")
        .to_string()
}

/// Addresses in use in the node's pools.
fn used(t: &TestNode) -> u128 {
    t.node.pool_usage().iter().map(|(_, used, _)| used).sum()
}

/// The device of the node's host route (protocol 201) to `ip`, if any.
fn routed_to(t: &TestNode, ip: IpAddr) -> Option<String> {
    t.kernel
        .route_to(ip)
        .filter(|r| r.protocol == ROUTE_PROTOCOL)
        .and_then(|r| r.dev)
}

/// Whether every one of `ips` is routed to `cid`'s veth on `t`.
fn routes_to(t: &TestNode, ips: &[IpAddr], cid: &str) -> bool {
    ips.iter()
        .all(|ip| routed_to(t, *ip).as_deref() == Some(host(cid).as_str()))
}

/// The VM's announcement of its MAC on interface `ifindex`.
fn announcement(ifindex: u32, mac: &str, kind: AnnounceKind) -> Announcement {
    Announcement {
        ifindex,
        mac: mac.parse::<Mac>().expect("a MAC").octets(),
        kind,
        seen: Instant::now(),
    }
}

/// The index of container `cid`'s veth on `t`.
fn ifindex(t: &TestNode, cid: &str) -> u32 {
    t.kernel.links()[&host(cid)].index
}

/// The admin call `Cutover` of vm1, asked on `t`'s node.
async fn admin_cutover(t: &TestNode) -> Result<VmRecord> {
    t.node
        .vms()
        .cutover(
            t.node.as_ref(),
            &key("vm1"),
            None,
            Trigger::Admin,
            (Instant::now(), UnixNanos::now()),
        )
        .await
}

/// VM vm1 active on A (container c1) and its migration target on B
/// (container c2): the two nodes and the record after the target's ADD.
async fn migrating() -> (TestNode, TestNode, VmRecord) {
    let a = node_a().await;
    add(&a, vm_call(&a, "c1", "vm1")).await.expect("source ADD");
    let b = node_b(&a).await;
    add(&b, vm_call(&b, "c2", "vm1").target())
        .await
        .expect("target ADD");
    let rec = record(&a, "vm1").await.expect("a record");
    (a, b, rec)
}

// ---- Placement -----------------------------------------------------------

#[tokio::test]
async fn a_vms_first_pod_creates_its_record_with_the_pods_addresses() {
    let a = node_a().await;
    let result = add(&a, vm_call(&a, "c1", "vm1")).await.expect("ADD");
    let rec = record(&a, "vm1").await.expect("the record is created");
    let link = &a.kernel.links()[&host("c1")];
    assert_eq!(rec.ips, result_ips(&result));
    assert_eq!(rec.ips, link.ips);
    assert_eq!(rec.ips.len(), 2, "one address per family: {rec:?}");
    assert_eq!(rec.mac.to_string(), result_mac(&result));
    assert_eq!(rec.mac, link.pod_mac);
    assert!(is(&rec.active, "node-a", "c1"), "{rec:?}");
    assert!(rec.alternate.is_none());
    assert_eq!(rec.generation, 1);
    assert_eq!(rec.origin, crate::vm::Origin::Allocated);
    assert!(routes_to(&a, &rec.ips, "c1"), "{:?}", a.kernel.routes());
    assert_eq!(used(&a), 2);
    let attachments = a.node.attachments();
    assert_eq!(attachments.len(), 1);
    assert_eq!(attachments[0].vm, Some(key("vm1")));
    assert_eq!(a.node.vms().stats().cutovers, 0);
    a.eventually("the view has the record", |t| cached(t, "vm1").is_some())
        .await;
}

#[tokio::test]
async fn a_migration_target_is_the_alternate_wired_alike_and_not_routed() {
    let (a, b, rec) = migrating().await;
    assert!(is(&rec.active, "node-a", "c1"), "{rec:?}");
    assert!(is(&rec.alternate, "node-b", "c2"), "{rec:?}");
    assert_eq!(rec.generation, 2);
    let source = &a.kernel.links()[&host("c1")];
    let target = &b.kernel.links()[&host("c2")];
    assert_eq!(target.ips, rec.ips);
    assert_eq!(target.ips, source.ips);
    assert_eq!(target.pod_mac, rec.mac);
    assert_eq!(target.pod_mac, source.pod_mac);
    // Once B's view has the alternate, B still has no route to the VM.
    b.eventually("B's view has the alternate", |t| {
        cached(t, "vm1").is_some_and(|r| is(&r.alternate, "node-b", "c2"))
    })
    .await;
    for ip in &rec.ips {
        assert_eq!(b.kernel.route_to(*ip), None, "{ip} is routed on B");
    }
    assert!(b.kernel.routes().is_empty(), "{:?}", b.kernel.routes());
    assert!(routes_to(&a, &rec.ips, "c1"));
    // The VM's addresses are A's; B's pools lend none.
    assert_eq!(used(&b), 0);
    assert_eq!(used(&a), 2);
    assert_eq!(b.node.vms().stats().cutovers, 0);
    assert_eq!(a.node.vms().stats().cutovers, 0);
}

#[tokio::test]
async fn a_vm_restarted_on_another_node_keeps_its_address() {
    let a = node_a().await;
    add(&a, vm_call(&a, "c1", "vm1")).await.expect("ADD on A");
    let first = record(&a, "vm1").await.expect("a record");
    a.del("c1").await.expect("DEL on A");
    let stopped = record(&a, "vm1").await.expect("the record stays");
    assert_eq!(stopped.ips, first.ips);
    assert_eq!(stopped.mac, first.mac);
    assert!(stopped.active.is_none() && stopped.alternate.is_none());
    for ip in &first.ips {
        assert_eq!(a.kernel.route_to(*ip), None);
    }
    // A keeps the address out of its pools while the record holds it.
    assert_eq!(used(&a), 2);

    let b = node_b(&a).await;
    let result = add(&b, vm_call(&b, "c2", "vm1")).await.expect("ADD on B");
    assert_eq!(result_ips(&result), first.ips);
    assert_eq!(result_mac(&result), first.mac.to_string());
    let rec = record(&b, "vm1").await.expect("a record");
    assert!(is(&rec.active, "node-b", "c2"), "{rec:?}");
    assert!(rec.alternate.is_none());
    assert_eq!(rec.ips, first.ips);
    assert_eq!(rec.mac, first.mac);
    assert_eq!(rec.generation, first.generation + 2);
    let link = &b.kernel.links()[&host("c2")];
    assert_eq!(link.ips, first.ips);
    assert_eq!(link.pod_mac, first.mac);
    assert!(routes_to(&b, &first.ips, "c2"), "{:?}", b.kernel.routes());
    assert_eq!(used(&a), 2);
}

#[tokio::test]
async fn a_second_pod_of_a_running_vm_takes_over() {
    let a = node_a().await;
    add(&a, vm_call(&a, "c1", "vm1")).await.expect("ADD on A");
    let b = node_b(&a).await;
    // Not a migration target: the VM was restarted before its old pod's
    // DEL.
    add(&b, vm_call(&b, "c2", "vm1")).await.expect("ADD on B");
    let rec = record(&a, "vm1").await.expect("a record");
    assert!(is(&rec.active, "node-b", "c2"), "{rec:?}");
    assert!(rec.alternate.is_none(), "{rec:?}");
    assert!(routes_to(&b, &rec.ips, "c2"));
    // The old pod still exists on A, but the VM's traffic is B's now: A
    // withdraws its route before the old pod's DEL.
    a.eventually("A's view has the takeover", |t| {
        cached(t, "vm1").is_some_and(|r| is(&r.active, "node-b", "c2"))
    })
    .await;
    a.eventually("A withdraws its route", |t| {
        rec.ips.iter().all(|ip| t.kernel.route_to(*ip).is_none())
    })
    .await;
    // The old pod's DEL leaves the new one alone.
    a.del("c1").await.expect("DEL of the old pod");
    let after = record(&a, "vm1").await.expect("a record");
    assert_eq!(after, rec, "the old pod's DEL changed the record");
    assert!(routes_to(&b, &rec.ips, "c2"));
    assert!(rec.ips.iter().all(|ip| a.kernel.route_to(*ip).is_none()));
    assert_eq!(used(&a), 2);
}

#[tokio::test]
async fn a_second_pod_on_the_same_node_takes_over_the_route() {
    let a = node_a().await;
    add(&a, vm_call(&a, "c1", "vm1")).await.expect("first ADD");
    add(&a, vm_call(&a, "c2", "vm1")).await.expect("second ADD");
    let rec = record(&a, "vm1").await.expect("a record");
    assert!(is(&rec.active, "node-a", "c2"), "{rec:?}");
    assert!(rec.alternate.is_none());
    // A pass of the route manager that planned before the second pod was
    // in the table may withdraw its route; the pass the ADD forces puts it
    // back.
    a.eventually("the route goes to the new pod", |t| {
        routes_to(t, &rec.ips, "c2")
    })
    .await;
    a.del("c1").await.expect("DEL of the old pod");
    a.eventually("the old veth is deleted", |t| {
        !t.kernel.links().contains_key(&host("c1"))
    })
    .await;
    assert!(routes_to(&a, &rec.ips, "c2"), "{:?}", a.kernel.routes());
    assert_eq!(record(&a, "vm1").await, Some(rec));
    assert_eq!(used(&a), 2);
}

/// Nothing of a refused ADD of container `cid` is left on `t`.
async fn nothing_left(t: &TestNode, cid: &str, vm: Option<&str>) {
    assert!(!t.kernel.links().contains_key(&host(cid)), "a veth is left");
    assert!(
        t.node
            .attachments()
            .iter()
            .all(|a| a.key.container_id != cid),
        "an attachment is left"
    );
    assert!(
        t.store
            .load()
            .expect("load")
            .iter()
            .all(|a| a.key.container_id != cid),
        "a stored attachment is left"
    );
    if let Some(vm) = vm {
        assert_eq!(record(t, vm).await, None, "a record of {vm} is left");
    }
}

#[tokio::test]
async fn a_vm_cannot_take_an_address_another_vm_holds() {
    let a = node_a().await;
    let held = add(&a, vm_call(&a, "c1", "vm1")).await.expect("ADD");
    let v4 = result_ips(&held)[0];
    // CNI_ARGS IP=.
    let err = add(&a, vm_call(&a, "c2", "vm2").arg("IP", &v4.to_string()))
        .await
        .expect_err("the address is vm1's");
    assert_eq!(err.code(), 105, "{err}");
    assert!(err.to_string().contains("vm1"), "names the holder: {err}");
    nothing_left(&a, "c2", Some("vm2")).await;
    // runtimeConfig.ips (set before the annotations, which live in
    // runtimeConfig too).
    let call = Call::new("ADD", "c3")
        .netns(&a.netns("c3"))
        .conf("runtimeConfig", json!({"ips": [format!("{v4}/24")]}))
        .vm("vm3");
    let err = add(&a, call).await.expect_err("the address is vm1's");
    assert_eq!(err.code(), 105, "{err}");
    nothing_left(&a, "c3", Some("vm3")).await;
    // Nothing was taken from the pools by the refused ADDs.
    assert_eq!(used(&a), 2);
    // The address is still refused once vm1 runs nowhere: the record
    // holds it.
    a.del("c1").await.expect("DEL");
    let err = add(&a, vm_call(&a, "c4", "vm4").arg("IP", &v4.to_string()))
        .await
        .expect_err("the address is still vm1's");
    assert_eq!(err.code(), 105, "{err}");
    nothing_left(&a, "c4", Some("vm4")).await;
    assert_eq!(used(&a), 2);
}

#[tokio::test]
async fn a_pod_of_a_vm_with_a_record_must_ask_for_what_the_record_holds() {
    let a = node_a().await;
    add(&a, vm_call(&a, "c1", "vm1")).await.expect("ADD");
    a.del("c1").await.expect("DEL");
    let rec = record(&a, "vm1").await.expect("the record stays");
    // Another address.
    let err = add(&a, vm_call(&a, "c2", "vm1").arg("IP", "10.1.0.200"))
        .await
        .expect_err("the VM holds another address");
    assert_eq!(err.code(), 105, "{err}");
    nothing_left(&a, "c2", None).await;
    // Another MAC.
    let err = add(&a, vm_call(&a, "c3", "vm1").arg("MAC", "0a:58:0a:01:00:c8"))
        .await
        .expect_err("the VM holds another MAC");
    assert_eq!(err.code(), 105, "{err}");
    nothing_left(&a, "c3", None).await;
    assert_eq!(record(&a, "vm1").await, Some(rec.clone()), "record changed");
    assert_eq!(used(&a), 2);
    // Asking for exactly what it holds is fine.
    let ips: Vec<String> = rec.ips.iter().map(ToString::to_string).collect();
    let result = add(
        &a,
        vm_call(&a, "c4", "vm1")
            .arg("IP", &ips.join(","))
            .arg("MAC", &rec.mac.to_string()),
    )
    .await
    .expect("the VM's own address");
    assert_eq!(result_ips(&result), rec.ips);
}

#[tokio::test]
async fn a_vm_cannot_take_a_mac_another_vm_holds() {
    let a = node_a().await;
    let held = add(&a, vm_call(&a, "c1", "vm1")).await.expect("ADD");
    let mac = result_mac(&held);
    let err = add(&a, vm_call(&a, "c2", "vm2").arg("MAC", &mac))
        .await
        .expect_err("the MAC is vm1's");
    assert_eq!(err.code(), 105, "{err}");
    nothing_left(&a, "c2", Some("vm2")).await;
    // The addresses taken for vm2 went back.
    assert_eq!(used(&a), 2);
    // On another node, where no local pod has it: the record refuses it.
    let b = node_b(&a).await;
    let err = add(&b, vm_call(&b, "c3", "vm3").arg("MAC", &mac.to_uppercase()))
        .await
        .expect_err("the MAC is vm1's");
    assert_eq!(err.code(), 105, "{err}");
    nothing_left(&b, "c3", Some("vm3")).await;
    b.eventually("B's addresses went back", |t| used(t) == 0)
        .await;
}

#[tokio::test]
async fn a_plain_pod_cannot_take_an_address_or_mac_a_vm_holds() {
    let a = node_a().await;
    let held = add(&a, vm_call(&a, "c1", "vm1")).await.expect("ADD");
    let (v4, mac) = (result_ips(&held)[0], result_mac(&held));
    let plain = |cid: &str| Call::new("ADD", cid).netns(&a.netns(cid));
    let err = add(&a, plain("p1").arg("IP", &v4.to_string()))
        .await
        .expect_err("the address is vm1's");
    assert_eq!(err.code(), 105, "{err}");
    nothing_left(&a, "p1", None).await;
    let err = add(&a, plain("p2").arg("MAC", &mac))
        .await
        .expect_err("the MAC is vm1's");
    assert_eq!(err.code(), 105, "{err}");
    nothing_left(&a, "p2", None).await;
    // While the VM runs nowhere, its record still holds both.
    a.del("c1").await.expect("DEL");
    let err = add(
        &a,
        plain("p3").conf("runtimeConfig", json!({"ips": [v4.to_string()]})),
    )
    .await
    .expect_err("the address is still vm1's");
    assert_eq!(err.code(), 105, "{err}");
    nothing_left(&a, "p3", None).await;
    a.eventually("A's view has vm1", |t| cached(t, "vm1").is_some())
        .await;
    let err = add(&a, plain("p4").arg("MAC", &mac))
        .await
        .expect_err("the MAC is still vm1's");
    assert_eq!(err.code(), 105, "{err}");
    nothing_left(&a, "p4", None).await;
    assert_eq!(used(&a), 2);
    // A plain pod without a request gets other addresses.
    let other = a.add("p5", "p5").await.expect("plain ADD");
    let vm_ips = result_ips(&held);
    assert!(
        result_ips(&other).iter().all(|ip| !vm_ips.contains(ip)),
        "{other}"
    );
}

// ---- Cutover --------------------------------------------------------------

#[tokio::test]
async fn the_vms_announcement_on_the_target_cuts_over() {
    let (a, b, rec) = migrating().await;
    let target_index = ifindex(&b, "c2");
    // The VM's MAC on another veth of B, and another MAC on the target's
    // veth: neither is the VM arriving. (GARPs, so that the RARP below
    // is known to be what cut over.)
    b.add("p9", "p9").await.expect("a plain pod on B");
    b.host.announce(announcement(
        ifindex(&b, "p9"),
        &rec.mac.to_string(),
        AnnounceKind::Garp,
    ));
    b.host.announce(announcement(
        target_index,
        "0a:58:0a:63:63:63",
        AnnounceKind::Garp,
    ));
    b.host.announce(announcement(
        target_index,
        &rec.mac.to_string(),
        AnnounceKind::Rarp,
    ));
    b.eventually("the target is active", |t| {
        cached(t, "vm1").is_some_and(|r| is(&r.active, "node-b", "c2"))
    })
    .await;
    let after = record(&b, "vm1").await.expect("a record");
    assert!(is(&after.active, "node-b", "c2"), "{after:?}");
    assert!(is(&after.alternate, "node-a", "c1"), "{after:?}");
    assert_eq!(after.generation, rec.generation + 1);
    assert_eq!(after.ips, rec.ips);
    assert_eq!(after.mac, rec.mac);
    let info = after.last_cutover.expect("the cutover is recorded");
    assert_eq!(info.trigger, Trigger::Rarp, "an earlier GARP cut over");
    assert_eq!(info.from_node.as_deref(), Some("node-a"));
    assert_eq!(info.to_node, "node-b");
    assert!(routes_to(&b, &rec.ips, "c2"), "{:?}", b.kernel.routes());
    let stats = b.node.vms().stats();
    assert_eq!(stats.cutovers, 1);
    let last = stats.last_cutover.expect("timings");
    assert_eq!(last.trigger, Trigger::Rarp);
    assert!(last.local_route.is_some());
    assert_eq!(a.node.vms().stats().cutovers, 0);
    a.eventually("A withdraws its route", |t| {
        rec.ips.iter().all(|ip| t.kernel.route_to(*ip).is_none())
    })
    .await;
    // The plain pod's route is untouched.
    let plain_ips = b.kernel.links()[&host("p9")].ips.clone();
    assert!(routes_to(&b, &plain_ips, "p9"));
}

#[tokio::test]
async fn the_target_ready_annotation_on_check_cuts_over() {
    let a = node_a().await;
    add(&a, vm_call(&a, "c1", "vm1")).await.expect("source ADD");
    let b = node_b(&a).await;
    let result = add(&b, vm_call(&b, "c2", "vm1").target())
        .await
        .expect("target ADD");
    let check_call = |ready: bool| {
        let c = Call::new("CHECK", "c2")
            .netns(&b.netns("c2"))
            .conf("prevResult", result.clone())
            .vm("vm1")
            .target();
        if ready {
            c.annotation(TARGET_READY_ANNOTATION, "2024-01-01T00:00:00Z")
        } else {
            c
        }
    };
    // Not ready yet: CHECK passes and changes nothing.
    check(&b, check_call(false)).await.expect("CHECK");
    let rec = record(&b, "vm1").await.expect("a record");
    assert!(is(&rec.alternate, "node-b", "c2"), "{rec:?}");
    assert_eq!(b.node.vms().stats().cutovers, 0);
    // Ready: the CHECK cuts over before it replies.
    check(&b, check_call(true)).await.expect("CHECK");
    let after = record(&b, "vm1").await.expect("a record");
    assert!(is(&after.active, "node-b", "c2"), "{after:?}");
    assert!(is(&after.alternate, "node-a", "c1"), "{after:?}");
    assert_eq!(
        after.last_cutover.as_ref().map(|c| c.trigger),
        Some(Trigger::Annotation)
    );
    assert!(routes_to(&b, &after.ips, "c2"));
    assert_eq!(b.node.vms().stats().cutovers, 1);
    // Another CHECK (now routed) passes and does not cut over again.
    check(&b, check_call(true)).await.expect("CHECK after");
    assert_eq!(b.node.vms().stats().cutovers, 1);
    assert_eq!(
        record(&b, "vm1").await.map(|r| r.generation),
        Some(after.generation)
    );
}

#[tokio::test]
async fn a_target_added_ready_is_active_at_once() {
    let a = node_a().await;
    add(&a, vm_call(&a, "c1", "vm1")).await.expect("source ADD");
    let b = node_b(&a).await;
    add(
        &b,
        vm_call(&b, "c2", "vm1")
            .target()
            .annotation(TARGET_READY_ANNOTATION, "2024-01-01T00:00:00Z"),
    )
    .await
    .expect("target ADD");
    let rec = record(&b, "vm1").await.expect("a record");
    assert!(is(&rec.active, "node-b", "c2"), "{rec:?}");
    assert!(is(&rec.alternate, "node-a", "c1"), "{rec:?}");
    assert_eq!(
        rec.last_cutover.as_ref().map(|c| c.trigger),
        Some(Trigger::Annotation)
    );
    assert!(routes_to(&b, &rec.ips, "c2"), "{:?}", b.kernel.routes());
    assert_eq!(b.node.vms().stats().cutovers, 1);
}

#[tokio::test]
async fn the_admin_cutover_moves_the_routes_by_the_record() {
    let (a, b, rec) = migrating().await;
    // Asked on the source's node: the record changes there, and each
    // node's routes follow it.
    let after = admin_cutover(&a).await.expect("admin cutover");
    assert!(is(&after.active, "node-b", "c2"), "{after:?}");
    assert!(is(&after.alternate, "node-a", "c1"), "{after:?}");
    assert_eq!(record(&a, "vm1").await, Some(after.clone()));
    let stats = a.node.vms().stats();
    assert_eq!(stats.cutovers, 1);
    let last = stats.last_cutover.expect("timings");
    assert_eq!(last.trigger, Trigger::Admin);
    assert_eq!(last.local_route, None, "the new active pod is not on A");
    b.eventually("B routes to the target", |t| routes_to(t, &rec.ips, "c2"))
        .await;
    a.eventually("A withdraws its route", |t| {
        rec.ips.iter().all(|ip| t.kernel.route_to(*ip).is_none())
    })
    .await;
    assert_eq!(b.node.vms().stats().cutovers, 0);
    assert!(b.node.vms().stats().route_updates >= 1);
}

#[tokio::test]
async fn the_admin_cutover_on_the_targets_node_routes_at_once() {
    let (_a, b, rec) = migrating().await;
    admin_cutover(&b).await.expect("admin cutover");
    // No waiting for the watch: routed before the call returned.
    assert!(routes_to(&b, &rec.ips, "c2"), "{:?}", b.kernel.routes());
    let last = b.node.vms().stats().last_cutover.expect("timings");
    assert!(last.local_route.is_some());
}

#[tokio::test]
async fn an_admin_cutover_without_an_alternate_is_refused() {
    let a = node_a().await;
    add(&a, vm_call(&a, "c1", "vm1")).await.expect("ADD");
    let rec = record(&a, "vm1").await.expect("a record");
    let seen = (Instant::now(), UnixNanos::now());
    let err = a
        .node
        .vms()
        .cutover(a.node.as_ref(), &key("vm1"), None, Trigger::Admin, seen)
        .await
        .expect_err("no alternate");
    assert_eq!(err.code(), 108, "{err}");
    let err = a
        .node
        .vms()
        .cutover(a.node.as_ref(), &key("nope"), None, Trigger::Admin, seen)
        .await
        .expect_err("no such VM");
    assert_eq!(err.code(), 107, "{err}");
    assert_eq!(record(&a, "vm1").await, Some(rec.clone()));
    assert!(routes_to(&a, &rec.ips, "c1"));
    assert_eq!(a.node.vms().stats().cutovers, 0);
}

#[tokio::test]
async fn a_cutover_the_control_store_fails_keeps_the_route_and_completes_later() {
    let flaky = FaultyControl::new();
    let a = TestNode::with(Options {
        control: Some(flaky.clone()),
        ..Default::default()
    })
    .await;
    add(&a, vm_call(&a, "c1", "vm1")).await.expect("source ADD");
    let b = node_b(&a).await;
    add(&b, vm_call(&b, "c2", "vm1").target())
        .await
        .expect("target ADD");
    let rec = record(&b, "vm1").await.expect("a record");
    let target = b
        .node
        .attachments()
        .into_iter()
        .find(|x| x.key.container_id == "c2")
        .expect("the target's attachment");

    flaky.fail_next(usize::MAX, Failure::LocalIo);
    // The trigger on the target's node: the route goes in first, then the
    // write fails and is reported.
    let err = b
        .node
        .vms()
        .cutover(
            b.node.as_ref(),
            &key("vm1"),
            Some(&target),
            Trigger::Rarp,
            (Instant::now(), UnixNanos::now()),
        )
        .await
        .expect_err("the control store fails");
    assert!(flaky.failed() >= 1);
    assert_ne!(err.code(), 108, "{err}");
    assert_eq!(record(&b, "vm1").await, Some(rec.clone()), "record changed");
    assert!(
        routes_to(&b, &rec.ips, "c2"),
        "the VM runs on B: its route stays: {:?}",
        b.kernel.routes()
    );
    assert_eq!(b.node.vms().stats().cutovers, 0);
    // The VM announces itself while the store still fails: no cutover.
    let mac = rec.mac;
    let index = ifindex(&b, "c2");
    let before = flaky.failed();
    b.host
        .announce(announcement(index, &mac.to_string(), AnnounceKind::Rarp));
    b.eventually("the announcement's cutover fails too", |_| {
        flaky.failed() > before
    })
    .await;
    assert_eq!(record(&b, "vm1").await, Some(rec.clone()), "record changed");
    assert!(routes_to(&b, &rec.ips, "c2"));

    // The store is back: a later announcement (QEMU sends several)
    // completes the cutover.
    flaky.fail_next(0, Failure::LocalIo);
    b.eventually("a later announcement cuts over", |t| {
        t.host
            .announce(announcement(index, &mac.to_string(), AnnounceKind::Rarp));
        cached(t, "vm1").is_some_and(|r| is(&r.active, "node-b", "c2"))
    })
    .await;
    let after = record(&b, "vm1").await.expect("a record");
    assert!(is(&after.active, "node-b", "c2"), "{after:?}");
    assert!(is(&after.alternate, "node-a", "c1"), "{after:?}");
    assert_eq!(after.generation, rec.generation + 1);
    assert!(routes_to(&b, &rec.ips, "c2"));
    assert_eq!(b.node.vms().stats().cutovers, 1);
    a.eventually("A withdraws its route", |t| {
        rec.ips.iter().all(|ip| t.kernel.route_to(*ip).is_none())
    })
    .await;
}

#[tokio::test]
async fn an_aborted_migrations_target_del_leaves_the_source_as_it_was() {
    let (a, b, rec) = migrating().await;
    b.del("c2").await.expect("DEL of the target");
    let after = record(&a, "vm1").await.expect("a record");
    assert!(is(&after.active, "node-a", "c1"), "{after:?}");
    assert!(after.alternate.is_none(), "{after:?}");
    assert_eq!(after.generation, rec.generation + 1);
    assert!(routes_to(&a, &rec.ips, "c1"));
    b.eventually("the target's veth is deleted", |t| {
        t.kernel.links().is_empty()
    })
    .await;
    assert!(b.kernel.routes().is_empty());
    assert_eq!(used(&a), 2);
    assert_eq!(b.node.vms().stats().cutovers, 0);
}

// ---- The source's DEL -------------------------------------------------------

/// A migration of vm1 from A (c1) to B (c2), cut over by the admin call
/// on B.
async fn migrated() -> (TestNode, TestNode, VmRecord) {
    let (a, b, _) = migrating().await;
    admin_cutover(&b).await.expect("cutover");
    let rec = record(&a, "vm1").await.expect("a record");
    assert!(is(&rec.active, "node-b", "c2"), "{rec:?}");
    (a, b, rec)
}

#[tokio::test]
async fn the_sources_del_after_a_cutover_keeps_the_vms_address() {
    let (a, b, rec) = migrated().await;
    a.del("c1").await.expect("DEL of the source");
    let after = record(&a, "vm1").await.expect("the record stays");
    assert_eq!(after.ips, rec.ips);
    assert_eq!(after.mac, rec.mac);
    assert!(is(&after.active, "node-b", "c2"), "{after:?}");
    assert!(after.alternate.is_none(), "{after:?}");
    a.eventually("the source's veth is deleted", |t| {
        t.kernel.links().is_empty()
    })
    .await;
    // A does not give the VM's address to a new plain pod.
    assert_eq!(used(&a), 2);
    let plain = a.add("p1", "p1").await.expect("plain ADD");
    assert!(
        result_ips(&plain).iter().all(|ip| !rec.ips.contains(ip)),
        "{plain}"
    );
    let err = add(
        &a,
        Call::new("ADD", "p2")
            .netns(&a.netns("p2"))
            .arg("IP", &rec.ips[0].to_string()),
    )
    .await
    .expect_err("the address is the VM's");
    assert_eq!(err.code(), 105, "{err}");
    // The target keeps its route once B has seen the change.
    b.eventually("B's view has the source gone", |t| {
        cached(t, "vm1").is_some_and(|r| r.alternate.is_none())
    })
    .await;
    assert!(routes_to(&b, &rec.ips, "c2"), "{:?}", b.kernel.routes());
    assert_eq!(b.node.attachments().len(), 1);
}

#[tokio::test]
async fn the_sources_del_on_the_same_node_leaves_the_targets_route() {
    // A migration within one node: source and target share the route
    // table.
    let a = node_a().await;
    add(&a, vm_call(&a, "c1", "vm1")).await.expect("source ADD");
    add(&a, vm_call(&a, "c2", "vm1").target())
        .await
        .expect("target ADD");
    let rec = record(&a, "vm1").await.expect("a record");
    assert!(is(&rec.alternate, "node-a", "c2"), "{rec:?}");
    assert!(routes_to(&a, &rec.ips, "c1"), "the source is routed");
    a.host.announce(announcement(
        ifindex(&a, "c2"),
        &rec.mac.to_string(),
        AnnounceKind::Rarp,
    ));
    a.eventually("the target is active", |t| {
        cached(t, "vm1").is_some_and(|r| is(&r.active, "node-a", "c2"))
    })
    .await;
    assert!(routes_to(&a, &rec.ips, "c2"), "{:?}", a.kernel.routes());
    a.del("c1").await.expect("DEL of the source");
    a.eventually("the source's veth is deleted", |t| {
        !t.kernel.links().contains_key(&host("c1"))
    })
    .await;
    assert!(routes_to(&a, &rec.ips, "c2"), "{:?}", a.kernel.routes());
    let after = record(&a, "vm1").await.expect("a record");
    assert!(is(&after.active, "node-a", "c2"), "{after:?}");
    assert!(after.alternate.is_none());
    assert_eq!(used(&a), 2);
    assert_eq!(a.node.vms().stats().cutovers, 1);
}

#[tokio::test]
async fn an_ephemeral_vms_last_pod_takes_its_address_with_it() {
    let a = node_a().await;
    let ephemeral = |c: Call| c.conf("vmAddressPolicy", json!("ephemeral"));
    let result = add(&a, ephemeral(vm_call(&a, "c1", "vm1")))
        .await
        .expect("ADD");
    let ips = result_ips(&result);
    assert_eq!(used(&a), 2);
    del(&a, ephemeral(Call::new("DEL", "c1")))
        .await
        .expect("DEL");
    assert_eq!(record(&a, "vm1").await, None, "the record is deleted");
    for ip in &ips {
        assert_eq!(a.kernel.route_to(*ip), None);
    }
    a.eventually("the address goes back to the pool", |t| used(t) == 0)
        .await;
    // Free for anyone, the MAC too.
    let again = add(
        &a,
        vm_call(&a, "c2", "vm2")
            .arg("IP", &ips[0].to_string())
            .arg("MAC", &result_mac(&result)),
    )
    .await
    .expect("another VM gets the address");
    assert_eq!(result_ips(&again)[0], ips[0]);
}

#[tokio::test]
async fn an_ephemeral_vm_keeps_its_address_until_its_last_pod_is_gone() {
    let (a, b, rec) = migrated().await;
    let ephemeral = |c: Call| c.conf("vmAddressPolicy", json!("ephemeral"));
    // The source's DEL: the target still runs the VM.
    del(&a, ephemeral(Call::new("DEL", "c1")))
        .await
        .expect("DEL of the source");
    let after = record(&a, "vm1").await.expect("the record stays");
    assert!(is(&after.active, "node-b", "c2"), "{after:?}");
    assert_eq!(after.ips, rec.ips);
    assert_eq!(used(&a), 2);
    // The target's DEL: the last pod.
    del(&b, ephemeral(Call::new("DEL", "c2")))
        .await
        .expect("DEL of the target");
    assert_eq!(record(&a, "vm1").await, None, "the record is deleted");
    for ip in &rec.ips {
        assert_eq!(b.kernel.route_to(*ip), None);
    }
    a.eventually("A's pool frees the address", |t| used(t) == 0)
        .await;
    let plain = add(
        &a,
        Call::new("ADD", "p1")
            .netns(&a.netns("p1"))
            .arg("IP", &rec.ips[0].to_string()),
    )
    .await
    .expect("a plain pod gets the address");
    assert_eq!(result_ips(&plain)[0], rec.ips[0]);
}

// ---- Rollback -------------------------------------------------------------

#[tokio::test]
async fn a_failed_first_pod_deletes_the_record_it_created() {
    let a = node_a().await;
    a.kernel.fail_nth(K::Wire, 0);
    let err = add(&a, vm_call(&a, "c1", "vm1").arg("IP", "10.1.0.10"))
        .await
        .expect_err("the wiring fails");
    assert_eq!(err.code(), 101, "{err}");
    nothing_left(&a, "c1", Some("vm1")).await;
    assert!(a.kernel.routes().is_empty());
    a.eventually("the addresses go back to the pools", |t| used(t) == 0)
        .await;
    // The address and its MAC are free for another VM once this node's
    // view of the records has seen the deletion.
    a.eventually("the view drops the record", |t| cached(t, "vm1").is_none())
        .await;
    let result = add(&a, vm_call(&a, "c2", "vm2").arg("IP", "10.1.0.10"))
        .await
        .expect("another VM gets the address");
    assert_eq!(result_ips(&result)[0], ip("10.1.0.10"));
    // And the VM itself starts afresh.
    let result = add(&a, vm_call(&a, "c3", "vm1")).await.expect("ADD again");
    let rec = record(&a, "vm1").await.expect("a record");
    assert_eq!(rec.generation, 1);
    assert_eq!(rec.ips, result_ips(&result));
}

#[tokio::test]
async fn a_failed_target_leaves_the_record_as_it_was() {
    let a = node_a().await;
    add(&a, vm_call(&a, "c1", "vm1")).await.expect("source ADD");
    let b = node_b(&a).await;
    b.kernel.fail_nth(K::Wire, 0);
    let err = add(&b, vm_call(&b, "c2", "vm1").target())
        .await
        .expect_err("the wiring fails");
    assert_eq!(err.code(), 101, "{err}");
    nothing_left(&b, "c2", None).await;
    let rec = record(&a, "vm1").await.expect("a record");
    assert!(is(&rec.active, "node-a", "c1"), "{rec:?}");
    assert!(rec.alternate.is_none(), "{rec:?}");
    assert!(routes_to(&a, &rec.ips, "c1"));
    assert_eq!(used(&a), 2);
    assert_eq!(used(&b), 0);
    // The runtime's retry places it.
    add(&b, vm_call(&b, "c2", "vm1").target())
        .await
        .expect("target ADD again");
    let rec = record(&a, "vm1").await.expect("a record");
    assert!(is(&rec.alternate, "node-b", "c2"), "{rec:?}");
}

#[tokio::test]
async fn a_retry_right_after_a_failed_first_pod_gets_its_address() {
    let a = node_a().await;
    a.kernel.fail_nth(K::Wire, 0);
    let call = vm_call(&a, "c1", "vm1").arg("IP", "10.1.0.10");
    add(&a, call.clone()).await.expect_err("the wiring fails");
    let result = add(&a, call).await.expect("the retry");
    assert_eq!(result_ips(&result)[0], ip("10.1.0.10"));
}

// ---- Signals from the Kubernetes API -------------------------------------

/// What the pod watch reports of container `cid`'s pod, a migration's
/// target unless it is `c1` (the VM's first pod).
fn seen(cid: &str, ready: bool, gone: bool) -> crate::vm::signals::VmPodSeen {
    crate::vm::signals::VmPodSeen {
        namespace: "default".into(),
        name: format!("web-{cid}"),
        uid: format!("uid-{cid}"),
        target: cid != "c1",
        ready,
        gone,
    }
}

#[tokio::test]
async fn the_ready_marker_seen_through_the_api_cuts_over() {
    let (_a, b, _) = migrating().await;
    assert!(b
        .node
        .vms()
        .vm_pod_seen(b.node.as_ref(), &seen("c2", false, false))
        .await
        .is_empty());
    assert_eq!(
        b.node.vms().stats().cutovers,
        0,
        "cut over before the marker"
    );
    let reverts = b
        .node
        .vms()
        .vm_pod_seen(b.node.as_ref(), &seen("c2", true, false))
        .await;
    assert!(reverts.is_empty());
    let rec = record(&b, "vm1").await.expect("a record");
    assert!(is(&rec.active, "node-b", "c2"), "{rec:?}");
    assert_eq!(
        rec.last_cutover.as_ref().map(|c| c.trigger),
        Some(Trigger::Annotation)
    );
    assert!(routes_to(&b, &rec.ips, "c2"));
    // Seen again (a relist): nothing more happens.
    b.node
        .vms()
        .vm_pod_seen(b.node.as_ref(), &seen("c2", true, false))
        .await;
    assert_eq!(b.node.vms().stats().cutovers, 1);
    assert_eq!(
        record(&b, "vm1").await.map(|r| r.generation),
        Some(rec.generation)
    );
}

#[tokio::test]
async fn a_stale_ready_marker_on_the_demoted_source_never_steals_the_vm_back() {
    // c1 on A was itself a migration's target once (its marker stays on
    // its pod); the VM then moved on to c2 on B, and c1 is the alternate.
    let (a, _b, before) = migrated().await;
    assert!(is(&before.alternate, "node-a", "c1"), "{before:?}");
    let stale = crate::vm::signals::VmPodSeen {
        target: true,
        ..seen("c1", true, false)
    };
    let reverts = a.node.vms().vm_pod_seen(a.node.as_ref(), &stale).await;
    assert!(reverts.is_empty());
    let c1 = a
        .node
        .attachments()
        .into_iter()
        .find(|x| x.key.container_id == "c1")
        .expect("c1's attachment");
    let rec = a
        .node
        .vms()
        .cutover(
            a.node.as_ref(),
            &key("vm1"),
            Some(&c1),
            Trigger::Annotation,
            (Instant::now(), UnixNanos::now()),
        )
        .await
        .expect("no error: nothing to do");
    assert!(
        is(&rec.active, "node-b", "c2"),
        "the VM was stolen back: {rec:?}"
    );
    assert_eq!(rec.generation, before.generation);
    assert_eq!(a.node.vms().stats().cutovers, 0);
}

/// The calls of `t`'s kernel that add or remove a pod's host routes.
fn host_route_calls(t: &TestNode) -> Vec<(K, String)> {
    t.kernel
        .log()
        .into_iter()
        .filter(|(c, _)| matches!(c, K::EnsureHostRoutes | K::RemoveHostRoutes))
        .collect()
}

#[tokio::test]
async fn updates_of_the_demoted_target_after_a_round_trip_never_touch_its_routes() {
    // vm1 goes A (c1) -> B (c2) and back B -> A: c2 on B is the demoted
    // alternate, and its pod keeps the ready marker of the first move.
    let (a, b, _) = migrated().await;
    admin_cutover(&a).await.expect("the cutover back to A");
    let back = record(&a, "vm1").await.expect("a record");
    let b_cutovers = b.node.vms().stats().cutovers;
    assert!(is(&back.active, "node-a", "c1"), "{back:?}");
    assert!(is(&back.alternate, "node-b", "c2"), "{back:?}");
    b.eventually("B withdraws its routes to the demoted pod", |t| {
        back.ips.iter().all(|ip| routed_to(t, *ip).is_none())
    })
    .await;
    b.kernel.clear_log();
    for _ in 0..20 {
        // The pod watch reports each update of c2's pod (a new marker, a
        // label): the marker is stale.
        assert!(b
            .node
            .vms()
            .vm_pod_seen(b.node.as_ref(), &seen("c2", true, false))
            .await
            .is_empty());
    }
    // A repeated ADD and a CHECK carrying the stale marker go the same way.
    let marked = |c: Call| c.annotation(TARGET_READY_ANNOTATION, "2024-01-01T00:00:00Z");
    let result = add(&b, marked(vm_call(&b, "c2", "vm1").target()))
        .await
        .expect("the repeated ADD answers as before");
    check(
        &b,
        marked(
            Call::new("CHECK", "c2")
                .netns(&b.netns("c2"))
                .conf("prevResult", result)
                .vm("vm1")
                .target(),
        ),
    )
    .await
    .expect("CHECK of the demoted pod");
    assert_eq!(
        host_route_calls(&b),
        vec![],
        "a stale marker touched B's routes"
    );
    for ip in &back.ips {
        assert_eq!(routed_to(&b, *ip), None, "B routes {ip} to the demoted pod");
    }
    let after = record(&a, "vm1").await.expect("a record");
    assert_eq!(after.generation, back.generation, "{after:?}");
    assert!(is(&after.active, "node-a", "c1"), "{after:?}");
    assert_eq!(b.node.vms().stats().cutovers, b_cutovers);
}

#[tokio::test]
async fn a_promoted_target_that_goes_away_gives_the_vm_back_to_its_source() {
    let (a, b, before) = migrated().await;
    // The source pod (alternate) is not a target: its going away is the
    // end of a successful migration, not a failure.
    assert!(a
        .node
        .vms()
        .vm_pod_seen(a.node.as_ref(), &seen("c1", false, true))
        .await
        .is_empty());
    let reverts = b
        .node
        .vms()
        .vm_pod_seen(b.node.as_ref(), &seen("c2", true, true))
        .await;
    assert_eq!(
        reverts,
        vec![crate::vm::signals::Revert {
            vm: key("vm1"),
            target: AttachmentKey {
                network: "tether".into(),
                container_id: "c2".into(),
                ifname: "eth0".into(),
            },
            source_pod: "web-c1".into(),
        }]
    );
    assert!(b
        .node
        .vms()
        .revert_cutover(b.node.as_ref(), &reverts[0])
        .await
        .expect("revert"));
    let rec = record(&a, "vm1").await.expect("a record");
    assert!(is(&rec.active, "node-a", "c1"), "{rec:?}");
    assert!(is(&rec.alternate, "node-b", "c2"), "{rec:?}");
    assert_eq!(rec.generation, before.generation + 1);
    let last = rec.last_cutover.expect("the revert is recorded");
    assert_eq!(last.trigger, Trigger::TargetFailed);
    assert_eq!(last.to_node, "node-a");
    // Done once: asked again, nothing changes.
    assert!(!b
        .node
        .vms()
        .revert_cutover(b.node.as_ref(), &reverts[0])
        .await
        .expect("revert"));
    // The failed target's ready marker cannot promote it again.
    b.node
        .vms()
        .vm_pod_seen(b.node.as_ref(), &seen("c2", true, false))
        .await;
    let again = record(&a, "vm1").await.expect("a record");
    assert!(is(&again.active, "node-a", "c1"), "{again:?}");
}

// ---- DEL while the control store does not answer ------------------------------

/// Node A on a store that fails on command, with vm1's pod c1 added under
/// `conf`'s network (its `vmAddressPolicy`).
async fn a_vm_on_a_flaky_store(conf: fn(Call) -> Call) -> (TestNode, Arc<FaultyControl>, VmRecord) {
    let flaky = FaultyControl::new();
    let a = TestNode::with(Options {
        control: Some(flaky.clone()),
        ..Default::default()
    })
    .await;
    add(&a, conf(vm_call(&a, "c1", "vm1"))).await.expect("ADD");
    let rec = record(&a, "vm1").await.expect("a record");
    (a, flaky, rec)
}

#[tokio::test]
async fn a_vm_pods_del_while_the_store_does_not_answer_succeeds_and_the_record_follows_later() {
    let (a, flaky, rec) = a_vm_on_a_flaky_store(|c| c).await;
    flaky.fail_next(usize::MAX, Failure::Unanswered);
    del(&a, Call::new("DEL", "c1"))
        .await
        .expect("the DEL goes on without the store");
    assert!(flaky.failed() >= 1, "the DEL did try the store");
    a.eventually("the veth is deleted", |t| {
        !t.kernel.links().contains_key(&host("c1"))
    })
    .await;
    nothing_left(&a, "c1", None).await;
    for ip in &rec.ips {
        assert_eq!(a.kernel.route_to(*ip), None, "the VM ran here only");
    }
    // The record still holds the pod, and the VM's addresses: no pod of
    // this node's pools may have them meanwhile.
    assert_eq!(record(&a, "vm1").await, Some(rec.clone()));
    assert_eq!(used(&a), 2, "the record's addresses stay taken");
    let waiting = a.node.vms().waiting_leaves();
    assert_eq!(waiting.len(), 1, "{waiting:?}");
    assert_eq!(waiting[0].attachment.container_id, "c1");
    // A DEL again (the runtime may repeat it) changes nothing.
    del(&a, Call::new("DEL", "c1")).await.expect("DEL again");
    assert_eq!(a.node.vms().waiting_leaves().len(), 1);

    // Placing the VM needs the store: its next pod waits for it, and so
    // does the leave.
    let err = add(&a, vm_call(&a, "c2", "vm1"))
        .await
        .expect_err("no placement without the store");
    assert_eq!(err.code(), 11, "{err}");
    assert!(a.node.vms().make_waiting_leaves(None).await.is_err());
    assert_eq!(record(&a, "vm1").await, Some(rec.clone()));

    // The store answers: the leave is made, once.
    flaky.fail_next(0, Failure::Unanswered);
    a.node
        .vms()
        .make_waiting_leaves(None)
        .await
        .expect("the store takes it");
    let after = record(&a, "vm1")
        .await
        .expect("a persistent VM keeps its record");
    assert!(
        after.active.is_none() && after.alternate.is_none(),
        "{after:?}"
    );
    assert_eq!(after.ips, rec.ips);
    assert_eq!(after.generation, rec.generation + 1);
    assert!(a.node.vms().waiting_leaves().is_empty());
}

#[tokio::test]
async fn a_waiting_leave_outlives_a_restart_and_goes_before_the_vms_next_pod() {
    let ephemeral = |c: Call| c.conf("vmAddressPolicy", json!("ephemeral"));
    let (a, flaky, rec) = a_vm_on_a_flaky_store(ephemeral).await;
    flaky.fail_next(usize::MAX, Failure::Unanswered);
    del(&a, ephemeral(Call::new("DEL", "c1")))
        .await
        .expect("the DEL goes on without the store");
    assert_eq!(record(&a, "vm1").await, Some(rec.clone()), "not freed yet");

    // The daemon restarts while the store is still away: the leave is read
    // back from the state dir.
    let (a, _) = a.restart(|_| {}).await.expect("restarted");
    let waiting = a.node.vms().waiting_leaves();
    assert_eq!(waiting.len(), 1, "{waiting:?}");
    assert!(waiting[0].ephemeral);

    // The store is back and the VM starts again here: its old pod's leave
    // goes first, which frees the ephemeral VM's record; the new pod then
    // makes a new one, active, with nothing of the old pod left in it.
    flaky.fail_next(0, Failure::Unanswered);
    add(&a, ephemeral(vm_call(&a, "c2", "vm1")))
        .await
        .expect("ADD once the store answers");
    assert!(a.node.vms().waiting_leaves().is_empty());
    let now = record(&a, "vm1").await.expect("a record");
    assert!(is(&now.active, "node-a", "c2"), "{now:?}");
    assert!(now.alternate.is_none(), "{now:?}");
    assert!(
        now.created_unix_ms >= rec.created_unix_ms,
        "a new record: {now:?}"
    );
}
