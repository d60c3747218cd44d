//! The `tap` and `managedTap` bindings in the lifecycle: what the netconf
//! and the pod annotations choose, the tap in the result, and the tap's
//! removal by DEL, by the rollback of a failed ADD, and by the DEL of an
//! ADD that left no record.

use super::*;
use tether_base::guest::{BindingKind, BINDING_ANNOTATION, QUEUES_ANNOTATION};
use tether_kernel::fake::Call as K;
use tether_kernel::host_ifname;

/// A VM pod ADD of container `cid` on a network whose netconf selects
/// `binding`.
fn vm_add(t: &TestNode, cid: &str, binding: &str) -> Call {
    Call::new("ADD", cid)
        .netns(&t.netns(cid))
        .vm("vm1")
        .conf("kubevirt", json!({"binding": binding, "tapQueues": 4}))
        .conf(
            "dns",
            json!({"nameservers": ["10.96.0.10"], "search": ["default.svc.cluster.local"]}),
        )
}

fn the_record(t: &TestNode, cid: &str) -> Attachment {
    t.node
        .attachments()
        .into_iter()
        .find(|a| a.key.container_id == cid)
        .expect("the attachment")
}

#[tokio::test]
async fn a_tap_bound_vm_pod_gets_its_tap_listed_in_the_result_and_recorded() {
    let t = TestNode::new().await;
    let inv = t.inv(vm_add(&t, "c1", "tap"));
    let result = parse_json(&t.node.add(&inv).await.expect("ADD"));
    let ifs = result["interfaces"].as_array().expect("interfaces");
    assert_eq!(ifs.len(), 3, "{result}");
    assert_eq!(ifs[2]["name"], "tap0");
    assert_eq!(ifs[2]["sandbox"], ifs[1]["sandbox"]);
    // The addresses stay on the pod interface's entry, where runtimes look.
    for ip in result["ips"].as_array().expect("ips") {
        assert_eq!(ip["interface"], 1, "{result}");
    }
    let taps = t.kernel.taps();
    let tap = taps
        .get(&(t.netns("c1"), "tap0".to_owned()))
        .expect("a tap in the pod");
    assert_eq!(tap.spec.queues, 4);
    assert!(tap.spec.multi_queue());
    assert_eq!((tap.spec.owner, tap.spec.group), (107, 107));
    let a = the_record(&t, "c1");
    let guest = a.guest.expect("the binding is recorded");
    assert_eq!(guest.kind(), BindingKind::Tap);
    assert_eq!(guest.dhcp.dns, vec![ip("10.96.0.10")]);
    assert_eq!(guest.dhcp.search, vec!["default.svc.cluster.local"]);
    assert_eq!(guest.dhcp.lease_seconds, 3600);
}

#[tokio::test]
async fn check_reports_a_lost_tap_and_del_removes_the_tap() {
    let t = TestNode::new().await;
    let inv = t.inv(vm_add(&t, "c1", "tap"));
    let result = parse_json(&t.node.add(&inv).await.expect("ADD"));
    let check = t.inv(
        vm_add(&t, "c1", "tap")
            .command("CHECK")
            .conf("prevResult", result),
    );
    t.node.check(&check).await.expect("CHECK of a healthy pod");
    t.kernel.drop_tap(&t.netns("c1"), "tap0");
    let err = t.node.check(&check).await.expect_err("the tap is gone");
    assert_eq!(err.code(), 117, "{err}");
    // A repeated ADD repairs it.
    t.node.add(&inv).await.expect("ADD again");
    t.node.check(&check).await.expect("CHECK after the repair");
    let del = t.inv(vm_add(&t, "c1", "tap").command("DEL"));
    t.node.del(&del, None).await.expect("DEL");
    assert!(t.kernel.taps().is_empty(), "{:?}", t.kernel.taps());
}

#[tokio::test]
async fn a_failed_add_takes_its_tap_back_and_a_del_without_record_removes_an_orphan() {
    let faults = Arc::new(StoreFaults::default());
    let t = TestNode::with(Options {
        store_faults: Some(faults.clone()),
        ..Default::default()
    })
    .await;
    faults.fail_insert(true);
    let inv = t.inv(vm_add(&t, "c1", "tap"));
    t.node
        .add(&inv)
        .await
        .expect_err("the store refuses the record");
    faults.fail_insert(false);
    assert!(
        t.kernel.taps().is_empty(),
        "rolled back: {:?}",
        t.kernel.taps()
    );

    // An orphan of ours (a daemon that died between wiring and its record)
    // goes with the runtime's DEL; someone else's tap stays.
    t.node.add(&inv).await.expect("ADD");
    // Forget the record only: the kernel keeps the tap.
    let store = t.store.clone();
    let key = the_record(&t, "c1").key;
    store.remove(&[key]).expect("forget");
    let (t, _) = t.restart(|_| {}).await.expect("restart");
    assert_eq!(t.kernel.taps().len(), 1, "an orphan tap");
    let del = t.inv(vm_add(&t, "c1", "tap").command("DEL"));
    t.kernel.clear_log();
    t.node.del(&del, None).await.expect("DEL without a record");
    assert!(t.kernel.taps().is_empty(), "{:?}", t.kernel.taps());
    assert_eq!(
        t.kernel
            .log()
            .iter()
            .filter(|(c, what)| *c == K::RemoveTap
                && what.contains(&host_ifname("tether", "c1", "eth0")))
            .count(),
        1
    );
}

#[tokio::test]
async fn the_teardown_of_a_failed_add_goes_on_past_failures_and_reports_them_all() {
    use crate::attach::del::{Made, Teardown};
    let t = TestNode::new().await;
    let inv = t.inv(vm_add(&t, "c1", "tap"));
    t.node.add(&inv).await.expect("ADD");
    let a = the_record(&t, "c1");
    t.kernel.fail_always(K::RemoveTap);
    t.kernel.fail_always(K::DeleteLink);
    let made = Made {
        placement: None,
        stored: true,
        wired: true,
    };
    let err = t
        .node
        .teardown(std::slice::from_ref(&a), Teardown::FailedAdd(made))
        .await
        .expect_err("the tap and the veth cannot be removed");
    let tether_base::error::Error::Several(all) = &err else {
        panic!("one failure reported of two: {err:?}")
    };
    assert_eq!(all.len(), 2, "{err}");
    assert_eq!(err.code(), 101, "{err}");
    // The steps between and after the failures ran all the same.
    assert!(t.store.load().expect("load").is_empty());
    assert!(t.node.attachments().is_empty());
    assert_eq!(t.kernel.calls(K::DeleteLink), 1);
}

#[tokio::test]
async fn managed_tap_and_veth_make_no_tap_and_annotations_override_the_netconf() {
    let t = TestNode::new().await;
    let inv = t.inv(vm_add(&t, "c1", "managedTap"));
    let result = parse_json(&t.node.add(&inv).await.expect("ADD"));
    assert_eq!(result["interfaces"].as_array().map(Vec::len), Some(2));
    assert!(t.kernel.taps().is_empty());
    assert_eq!(
        the_record(&t, "c1").guest.map(|g| g.kind()),
        Some(BindingKind::ManagedTap)
    );

    let inv = t.inv(
        vm_add(&t, "c2", "veth")
            .vm("vm2")
            .annotation(BINDING_ANNOTATION, "tap")
            .annotation(QUEUES_ANNOTATION, "2"),
    );
    t.node.add(&inv).await.expect("ADD");
    let taps = t.kernel.taps();
    let tap = taps.get(&(t.netns("c2"), "tap0".to_owned())).expect("tap");
    assert_eq!(tap.spec.queues, 2);

    let inv = t.inv(
        vm_add(&t, "c3", "tap")
            .vm("vm3")
            .conf("kubevirt", json!({})),
    );
    t.node.add(&inv).await.expect("ADD");
    assert_eq!(the_record(&t, "c3").guest, None, "veth by default");

    for (key, value) in [(BINDING_ANNOTATION, "Tap"), (QUEUES_ANNOTATION, "0")] {
        let call = vm_add(&t, "c4", "tap").vm("vm4").annotation(key, value);
        let err = t.node.add(&t.inv(call)).await.expect_err(value);
        assert_eq!(err.code(), 7, "{err}");
    }
    // A secondary interface gets KubeVirt's tap name.
    let inv = t.inv(vm_add(&t, "c5", "tap").vm("vm5").ifname("pod16477688c0e"));
    t.node.add(&inv).await.expect("ADD");
    assert!(t
        .kernel
        .taps()
        .contains_key(&(t.netns("c5"), "tap16477688c0e".to_owned())));
}

#[tokio::test]
async fn the_kubevirt_object_refuses_what_it_does_not_know() {
    let t = TestNode::new().await;
    for bad in [
        json!({"binding": "bridge"}),
        json!({"tapQueues": 0}),
        json!({"tapQueues": 1000}),
        json!({"leaseSeconds": 5}),
        json!({"tapOwner": -1}),
        json!({"queues": 2}),
        json!("tap"),
    ] {
        let call = Call::new("ADD", "c1")
            .netns(&t.netns("c1"))
            .vm("vm1")
            .conf("kubevirt", bad.clone());
        let request = call.request();
        let err = parse_request(&request).expect_err(&bad.to_string());
        assert_eq!(err.code(), 7, "{bad}: {err}");
    }
}

// ---- The guest's DHCP ------------------------------------------------------

#[tokio::test]
async fn the_guest_is_answered_from_the_record_until_its_pod_goes() {
    let t = TestNode::new().await;
    let inv = t.inv(vm_add(&t, "c1", "tap"));
    let result = parse_json(&t.node.add(&inv).await.expect("ADD"));
    let host = host_ifname("tether", "c1", "eth0");
    let served = t.host.dhcp().served();
    let lease = served
        .get(&host)
        .expect("the guest is answered on its veth");
    let a = the_record(&t, "c1");
    assert_eq!(lease.mac, a.mac);
    assert_eq!(lease.ips, a.ips);
    assert_eq!(lease.hostname, "vm1");
    assert_eq!(lease.mtu, a.mtu);
    assert_eq!(lease.options.dns, vec![ip("10.96.0.10")]);
    assert_eq!(
        result["interfaces"][1]["mac"],
        a.mac.to_string(),
        "the pod interface carries the MAC the guest is answered for"
    );

    // A restarted daemon answers again, with the same lease.
    t.host.dhcp().reset();
    let (t, _) = t.restart(|_| {}).await.expect("restart");
    assert_eq!(t.host.dhcp().served().get(&host), Some(lease));

    let del = t.inv(vm_add(&t, "c1", "tap").command("DEL"));
    t.node.del(&del, None).await.expect("DEL");
    assert!(t.host.dhcp().served().is_empty());
}

#[tokio::test]
async fn a_plain_vm_pod_gets_no_dhcp_and_managed_tap_does() {
    let t = TestNode::new().await;
    let plain = Call::new("ADD", "c1").netns(&t.netns("c1")).vm("vm1");
    t.node.add(&t.inv(plain)).await.expect("ADD");
    assert!(
        t.host.dhcp().served().is_empty(),
        "KubeVirt's own binding serves DHCP"
    );
    let inv = t.inv(vm_add(&t, "c2", "managedTap").vm("vm2"));
    t.node.add(&inv).await.expect("ADD");
    assert!(t
        .host
        .dhcp()
        .served()
        .contains_key(&host_ifname("tether", "c2", "eth0")));
}

#[tokio::test]
async fn a_migrated_guest_is_told_its_router_on_the_new_node() {
    use tether_kernel::{AnnounceKind, Announcement};
    let a = TestNode::new().await;
    let b = TestNode::with(Options {
        name: "node-b".into(),
        cidrs: vec![net("10.2.0.0/24"), net("fd00:2::/120")],
        control: Some(a.control.clone()),
        ..Default::default()
    })
    .await;
    a.node
        .add(&a.inv(vm_add(&a, "c1", "tap")))
        .await
        .expect("source ADD");
    b.node
        .add(&b.inv(vm_add(&b, "c2", "tap").target()))
        .await
        .expect("target ADD");
    let host_b = host_ifname("tether", "c2", "eth0");
    let lease_a = a.host.dhcp().served()[&host_ifname("tether", "c1", "eth0")].clone();
    assert_eq!(
        b.host.dhcp().served().get(&host_b),
        Some(&lease_a),
        "the target answers the guest exactly as the source does"
    );
    let ifindex = b.kernel.links()[&host_b].index;
    b.host.announce(Announcement {
        ifindex,
        mac: lease_a.mac.octets(),
        kind: AnnounceKind::Rarp,
        seen: std::time::Instant::now(),
    });
    b.eventually("the router advertisement on B", |b| {
        b.host.dhcp().announced() == vec![host_b.clone()]
    })
    .await;
    assert!(a.host.dhcp().announced().is_empty());
}

#[tokio::test]
async fn a_del_leaves_a_tap_it_did_not_make_and_succeeds() {
    let t = TestNode::new().await;
    let other = t.inv(vm_add(&t, "c2", "tap"));
    t.node.add(&other).await.expect("ADD c2");
    let taps = t.kernel.taps();
    let c2 = taps
        .get(&(t.netns("c2"), "tap0".to_owned()))
        .expect("c2's tap")
        .clone();
    // c3's DEL points at c2's netns: the tap there is c2's, not c3's.
    let del = t.inv(vm_add(&t, "c3", "tap").command("DEL").netns(&t.netns("c2")));
    t.node
        .del(&del, None)
        .await
        .expect("DEL of an unknown attachment");
    assert_eq!(
        t.kernel.taps().get(&(t.netns("c2"), "tap0".to_owned())),
        Some(&c2)
    );
}
