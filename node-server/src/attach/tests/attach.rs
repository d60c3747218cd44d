//! ADD, DEL, CHECK, GC and reconciliation of plain pods.

use super::*;
use crate::kernel::fake::Call as K;

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
                crate::kernel::fake::FakeLink {
                    index: 999,
                    netns: t.netns("orphan"),
                    pod_ifname: "eth0".into(),
                    pod_mac: crate::kernel::pod_mac(&[ip("10.1.0.200")]),
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
