//! The handover on the fake kernel: a VM moving from node-a to node-b, its
//! flows sent and recreated as they land, the translations toward it
//! pinned before the source reroutes it, and the packets its guest missed
//! sent again. The root suites prove the kernel side; this proves the
//! decisions and their order.

use super::*;
use crate::vm::Origin;
use tether_base::time::{UnixMillis, UnixNanos};
use tether_kernel::fake::FakeHandover;
use tether_kernel::handover::{anchor_mark, TCP, TCP_ESTABLISHED, UDP};

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn ends(src: &str, dst: &str) -> FlowEnds {
    FlowEnds {
        src: src.parse().unwrap(),
        dst: dst.parse().unwrap(),
    }
}

fn flow(proto: u8, orig: FlowEnds, reply: FlowEnds) -> Flow {
    Flow {
        proto,
        orig,
        reply,
        mark: 0,
        timeout_secs: 300,
        tcp_state: (proto == TCP).then_some(TCP_ESTABLISHED),
    }
}

const VM: &str = "10.244.0.5";

fn node(name: &str, id: u32, addr: &str) -> NodeRecord {
    NodeRecord {
        name: name.into(),
        id,
        node_ips: vec![ip(addr)],
        vtep_mac: None,
    }
}

fn cluster() -> ClusterView {
    let mut view = ClusterView {
        synced: true,
        ..ClusterView::default()
    };
    for n in [
        node("node-a", 1, "10.77.0.21"),
        node("node-b", 2, "10.77.0.22"),
    ] {
        view.nodes.insert(n.name.clone(), (n, 1));
    }
    view
}

fn pod(node: &str, cid: &str, since_ms: u64) -> VmAttachment {
    VmAttachment {
        node: node.into(),
        network: "net".into(),
        container_id: cid.into(),
        ifname: "eth0".into(),
        pod_name: None,
        pod_uid: None,
        since_unix_ms: UnixMillis::from_millis(since_ms),
    }
}

fn attachment(cid: &str) -> Attachment {
    Attachment {
        key: AttachmentKey {
            network: "net".into(),
            container_id: cid.into(),
            ifname: "eth0".into(),
        },
        netns: format!("/run/netns/{cid}"),
        ips: vec![ip(VM)],
        mac: "0a:58:0a:f4:00:05".parse().unwrap(),
        host_ifname: format!("tth-{cid}"),
        mtu: 1500,
        created_unix_nanos: UnixNanos::EPOCH,
        pod_namespace: None,
        pod_name: None,
        pod_uid: None,
        vm: Some(vm_key()),
        guest: None,
        pools: Vec::new(),
        ipam_only: false,
    }
}

fn vm_key() -> VmKey {
    VmKey::new("ns", "vm1", "eth0").unwrap()
}

/// The record of VM `key` (address `vm`) with its source pod `src` active
/// on node-a and, when `moved`, its target `dst` on node-b active after a
/// cutover.
fn record(key: VmKey, vm: IpAddr, src: &str, dst: &str, moved: bool) -> VmRecord {
    let (src, dst) = (pod("node-a", src, 1_000), pod("node-b", dst, 2_000));
    let (active, alternate) = if moved { (dst, src) } else { (src, dst) };
    VmRecord {
        key,
        ips: vec![vm],
        mac: "0a:58:0a:f4:00:05".parse().unwrap(),
        origin: Origin::Allocated,
        active: Some(active),
        alternate: Some(alternate),
        generation: 3,
        created_unix_ms: UnixMillis::EPOCH,
        last_cutover: None,
    }
}

/// The view of [`record`] for the test's one VM.
fn view(moved: bool) -> VmView {
    let rec = record(vm_key(), ip(VM), "src", "dst", moved);
    VmView {
        records: [(vm_key(), (Arc::new(rec), 1))].into_iter().collect(),
        revision: 1,
        synced: true,
    }
}

/// One node's side: its attachments, its record, and the datagrams it
/// sent, by destination.
struct Side {
    me: NodeRecord,
    local: Vec<Attachment>,
    sent: Mutex<Vec<(String, Vec<u8>)>>,
}

impl HandoverSide for Side {
    fn local_attachment(&self, key: &AttachmentKey) -> Option<Attachment> {
        self.local.iter().find(|a| &a.key == key).cloned()
    }
    fn cluster(&self) -> Option<(NodeRecord, Overlay, Arc<ClusterView>)> {
        Some((self.me.clone(), Overlay::HostGw, Arc::new(cluster())))
    }
    fn send_to_node(&self, node: &str, bytes: &[u8]) {
        lock(&self.sent).push((node.to_owned(), bytes.to_vec()));
    }
    fn is_local_pod(&self, ip: IpAddr) -> bool {
        self.local.iter().any(|a| a.ips.contains(&ip))
    }
}

/// Waits (on the runtime) until `done`.
async fn eventually(mut done: impl FnMut() -> bool) {
    for _ in 0..500 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    panic!("not within a second");
}

#[test]
fn unread_is_what_went_down_the_veth_less_what_the_guest_read() {
    let start = TapCounters {
        sent: 100,
        read: 90,
    };
    assert_eq!(
        unread_since(
            start,
            TapCounters {
                sent: 130,
                read: 110
            }
        ),
        10
    );
    assert_eq!(
        unread_since(
            start,
            TapCounters {
                sent: 130,
                read: 120
            }
        ),
        0
    );
    // A counter that went back (a new tap) counts nothing.
    assert_eq!(unread_since(start, TapCounters { sent: 10, read: 5 }), 0);
}

#[test]
fn flows_travel_in_datagrams_of_a_few_flows_each_and_come_back_the_same() {
    let flows: Vec<Flow> = (40000..40013)
        .map(|port| {
            flow(
                TCP,
                ends(&format!("10.244.0.5:{port}"), "10.77.0.200:8000"),
                ends("10.77.0.200:8000", &format!("10.77.0.21:{port}")),
            )
        })
        .collect();
    let grams = FlowsDatagram::encode(&vm_key(), "node-a", &flows);
    assert_eq!(grams.len(), 3);
    assert!(
        grams.iter().all(|g| g.len() < 1400),
        "{:?}",
        grams.iter().map(Vec::len).collect::<Vec<_>>()
    );
    let back: Vec<Flow> = grams
        .iter()
        .flat_map(|g| FlowsDatagram::decode(g).unwrap().flows)
        .collect();
    assert_eq!(back, flows);
    assert!(FlowsDatagram::decode(b"{\"tether_cutover\":1}").is_none());
}

#[tokio::test]
async fn a_moving_vms_flows_land_on_the_target_its_translations_are_pinned_and_its_missed_packets_sent_again(
) {
    let (ka, kb) = (
        Arc::new(FakeHandover::default()),
        Arc::new(FakeHandover::default()),
    );
    let a = Arc::new(Handovers::new("node-a", ka.clone()));
    let b = Arc::new(Handovers::new("node-b", kb.clone()));
    let side_a = Arc::new(Side {
        me: node("node-a", 1, "10.77.0.21"),
        local: vec![attachment("src")],
        sent: Mutex::default(),
    });
    let side_b = Side {
        me: node("node-b", 2, "10.77.0.22"),
        local: vec![attachment("dst")],
        sent: Mutex::default(),
    };
    let src = attachment("src");
    let masqueraded = flow(
        UDP,
        ends("10.244.0.5:40000", "10.77.0.200:8000"),
        ends("10.77.0.200:8000", "10.77.0.21:40000"),
    );
    let service = flow(
        TCP,
        ends("10.244.0.5:40001", "10.96.0.10:9100"),
        ends("10.244.1.9:9100", "10.244.0.5:40001"),
    );
    let nodeport = flow(
        TCP,
        ends("10.77.0.200:50000", "10.77.0.21:31000"),
        ends("10.244.0.5:7000", "10.77.0.21:61000"),
    );
    let pod_to_vm = flow(
        TCP,
        ends("10.244.1.9:41000", "10.244.0.5:7000"),
        ends("10.244.0.5:7000", "10.244.1.9:41000"),
    );
    let unrelated = flow(
        TCP,
        ends("10.244.0.6:1", "10.244.1.9:2"),
        ends("10.244.1.9:2", "10.244.0.6:1"),
    );
    let packets: Vec<Vec<u8>> = (0..10u8).map(|i| vec![0x45, i]).collect();
    ka.with(|s| {
        s.flows = vec![
            masqueraded.clone(),
            service.clone(),
            nodeport.clone(),
            pod_to_vm.clone(),
            unrelated,
        ];
        s.taps.insert(
            (
                src.netns.clone().into(),
                "tap0".into(),
                src.host_ifname.clone(),
            ),
            TapCounters {
                sent: 100,
                read: 100,
            },
        );
        s.captured.insert(src.host_ifname.clone(), Vec::new());
    });

    // The target is placed: the source starts holding and sending.
    a.sync(&side_a, &view(false)).await;
    eventually(|| !lock(&side_a.sent).is_empty()).await;
    let sent = std::mem::take(&mut *lock(&side_a.sent));
    assert!(sent.iter().all(|(to, _)| to == "node-b"));
    for (_, bytes) in &sent {
        let d = FlowsDatagram::decode(bytes).expect("a flows datagram");
        b.on_flows(&side_b, &view(false), d, "10.77.0.21:9655".parse().unwrap())
            .await;
    }
    let on_b = kb.state();
    let landed: Vec<&Flow> = on_b.flows.iter().collect();
    assert_eq!(
        landed.len(),
        4,
        "every flow of the VM's, and no other: {landed:#?}"
    );
    let masq_here = landed
        .iter()
        .find(|f| f.orig == masqueraded.orig)
        .expect("the masqueraded flow");
    assert_eq!(
        (masq_here.reply, masq_here.mark),
        (masqueraded.orig.inverse(), anchor_mark(1))
    );
    assert!(landed
        .iter()
        .any(|f| f.orig == service.orig && f.reply == service.reply && f.mark == 0));
    // Its answers, translated back at node-a, pass node-b untracked.
    assert!(on_b
        .translated_back
        .contains(&(TCP, service.orig.inverse())));
    assert!(landed
        .iter()
        .any(|f| f.orig == nodeport.reply.inverse() && f.reply == nodeport.reply));
    assert!(landed.iter().any(|f| **f == pod_to_vm));
    assert_eq!(
        on_b.anchors.get(&1).map(|h| h[0].via),
        Some(ip("10.77.0.21")),
        "routed back to node-a"
    );
    // The same datagram again creates nothing twice: it refreshes.
    let created = b.stats().flows_created;
    for (_, bytes) in &sent {
        let d = FlowsDatagram::decode(bytes).unwrap();
        b.on_flows(&side_b, &view(false), d, "10.77.0.21:9655".parse().unwrap())
            .await;
    }
    assert_eq!(kb.state().flows.len(), 4);
    assert_eq!(b.stats().flows_created, created);
    assert!(kb
        .state()
        .created
        .iter()
        .any(|(_, o)| *o == FlowCreated::Refreshed));
    // From an address that is not node-a's: refused.
    let d = FlowsDatagram::decode(&sent[0].1).unwrap();
    let refused_before = b.stats().flows_refused;
    b.on_flows(&side_b, &view(false), d, "10.77.0.99:9655".parse().unwrap())
        .await;
    assert_eq!(
        b.stats().flows_refused,
        refused_before,
        "not even counted: dropped on its address"
    );

    // Meanwhile the guest paused: 10 packets went down the veth, 3 read.
    ka.with(|s| {
        s.captured.insert(src.host_ifname.clone(), packets.clone());
        s.taps.insert(
            (
                src.netns.clone().into(),
                "tap0".into(),
                src.host_ifname.clone(),
            ),
            TapCounters {
                sent: 110,
                read: 103,
            },
        );
    });
    // The cutover reaches node-a: it pins before it reroutes, then sends
    // the seven packets the guest never read again.
    a.before_reroute(&view(true)).await;
    assert_eq!(
        ka.state().pinned,
        vec![nodeport.clone()],
        "only the masqueraded flow toward the VM"
    );
    // The records lag behind the notice: the move does not start again.
    a.sync(&side_a, &view(false)).await;
    assert!(lock(&a.state).leaving.is_empty());
    eventually(|| ka.state().replayed.len() == 7).await;
    assert_eq!(ka.state().replayed, packets[3..].to_vec());
    assert_eq!(a.stats().replayed, 7);
    // Nothing more is held or sent for it once the records settle.
    a.sync(&side_a, &view(true)).await;
    assert!(lock(&a.state).leaving.is_empty());

    // node-b's cutover: the VM's addresses are guarded.
    b.arrived(side_b.cluster(), &vm_key(), &[ip(VM)]).await;
    assert!(kb.state().moved.contains(&ip(VM)));
}

#[tokio::test]
async fn a_service_flow_to_a_backend_on_the_source_stays_anchored_there() {
    let ka = Arc::new(FakeHandover::default());
    let a = Arc::new(Handovers::new("node-a", ka.clone()));
    let mut backend = attachment("backend");
    backend.ips = vec![ip("10.244.0.9")];
    backend.vm = None;
    let side_a = Arc::new(Side {
        me: node("node-a", 1, "10.77.0.21"),
        local: vec![attachment("src"), backend],
        sent: Mutex::default(),
    });
    let local = flow(
        TCP,
        ends("10.244.0.5:40001", "10.96.0.10:9100"),
        ends("10.244.0.9:9100", "10.244.0.5:40001"),
    );
    ka.with(|s| s.flows = vec![local.clone()]);
    a.sync(&side_a, &view(false)).await;
    eventually(|| !lock(&side_a.sent).is_empty()).await;
    let d = FlowsDatagram::decode(&lock(&side_a.sent)[0].1).unwrap();
    assert_eq!(d.flows[0].anchor(), Some(1), "anchored at node-a");
    let landed = d.flows[0].landed(ip(VM), 1).unwrap();
    assert_eq!(
        (landed.reply, landed.anchor()),
        (local.orig.inverse(), Some(1))
    );
}

#[tokio::test]
async fn a_flow_that_collides_with_one_of_the_targets_waits_for_the_cutover() {
    let kb = Arc::new(FakeHandover::default());
    let b = Handovers::new("node-b", kb.clone());
    let side_b = Side {
        me: node("node-b", 2, "10.77.0.22"),
        local: vec![attachment("dst")],
        sent: Mutex::default(),
    };
    // The VM talks to a backend on node-b through a Service: node-b already
    // tracks the backend's side of that flow.
    let service = flow(
        TCP,
        ends("10.244.0.5:40001", "10.96.0.10:9100"),
        ends("10.244.2.9:9100", "10.244.0.5:40001"),
    );
    let backend_side = flow(
        TCP,
        ends("10.244.0.5:40001", "10.244.2.9:9100"),
        ends("10.244.2.9:9100", "10.244.0.5:40001"),
    );
    kb.with(|s| s.flows.push(backend_side.clone()));
    let d = FlowsDatagram {
        tether_flows: FLOWS_VERSION,
        vm: vm_key(),
        from: "node-a".into(),
        flows: vec![service.clone()],
    };
    b.on_flows(&side_b, &view(false), d, "10.77.0.21:9655".parse().unwrap())
        .await;
    assert_eq!(
        kb.state().flows,
        vec![backend_side],
        "left alone before the cutover"
    );
    // Meanwhile the VM's own packets of the flow are held back: arriving
    // before the flow replaced the backend's side, one would start a flow
    // of its own (to any backend, with another port).
    assert_eq!(kb.state().held_back, vec![(TCP, service.orig)]);
    // Before the cutover routes the VM here: from then on, the backend's
    // answers through the forwarding entry would reach the guest
    // untranslated.
    b.settle_flows(side_b.cluster(), &vm_key()).await;
    assert_eq!(
        kb.state().flows,
        vec![service.clone()],
        "replaced once the VM runs here"
    );
    assert_eq!(b.stats().flows_replaced, 1);
    assert!(
        kb.state().held_back.is_empty(),
        "let go once it is in place"
    );
    b.arrived(side_b.cluster(), &vm_key(), &[ip(VM)]).await;
    assert_eq!(kb.state().flows, vec![service.clone()]);
    assert_eq!(b.stats().flows_replaced, 1, "once");
}

/// The cutover waits for the flows that waited for the VM: they are made
/// in one round of kernel calls, however many (through KubeVirt, made one
/// by one, they held a VM's local route back 0.8 to 1.7 s).
#[tokio::test]
async fn the_flows_that_waited_for_the_cutover_are_made_in_one_round() {
    let kb = Arc::new(FakeHandover::default());
    let b = Handovers::new("node-b", kb.clone());
    let side_b = Side {
        me: node("node-b", 2, "10.77.0.22"),
        local: vec![attachment("dst")],
        sent: Mutex::default(),
    };
    let n: u16 = 50;
    let mut services = Vec::new();
    for i in 0..n {
        let port = 40_000 + i;
        services.push(flow(
            TCP,
            ends(&format!("10.244.0.5:{port}"), "10.96.0.10:9100"),
            ends("10.244.2.9:9100", &format!("10.244.0.5:{port}")),
        ));
        let backend_side = flow(
            TCP,
            ends(&format!("10.244.0.5:{port}"), "10.244.2.9:9100"),
            ends("10.244.2.9:9100", &format!("10.244.0.5:{port}")),
        );
        kb.with(|s| s.flows.push(backend_side));
    }
    let d = FlowsDatagram {
        tether_flows: FLOWS_VERSION,
        vm: vm_key(),
        from: "node-a".into(),
        flows: services.clone(),
    };
    b.on_flows(&side_b, &view(false), d, "10.77.0.21:9655".parse().unwrap())
        .await;
    assert_eq!(kb.state().held_back.len(), n as usize, "all wait");
    kb.with(|s| s.calls.clear());

    b.settle_flows(side_b.cluster(), &vm_key()).await;
    let st = kb.state();
    assert_eq!(st.flows, services, "every one replaced its backend's side");
    assert_eq!(b.stats().flows_replaced, u64::from(n));
    assert!(st.held_back.is_empty(), "all let go");
    assert_eq!(
        st.calls,
        [
            ("create_flows", 1),
            ("hold_back", 1),
            ("pass_translated_back", 1)
        ]
        .into_iter()
        .collect(),
        "one call of each kind for {n} flows"
    );
}

#[tokio::test]
async fn a_held_back_flow_that_lands_only_after_the_cutover_is_let_go() {
    let kb = Arc::new(FakeHandover::default());
    let b = Handovers::new("node-b", kb.clone());
    let side_b = Side {
        me: node("node-b", 2, "10.77.0.22"),
        local: vec![attachment("dst")],
        sent: Mutex::default(),
    };
    let service = flow(
        UDP,
        ends("10.244.0.5:40001", "10.96.0.10:9100"),
        ends("10.244.2.9:9100", "10.244.0.5:40001"),
    );
    let backend_side = flow(
        UDP,
        ends("10.244.0.5:40001", "10.244.2.9:9100"),
        ends("10.244.2.9:9100", "10.244.0.5:40001"),
    );
    kb.with(|s| s.flows.push(backend_side.clone()));
    let d = || FlowsDatagram {
        tether_flows: FLOWS_VERSION,
        vm: vm_key(),
        from: "node-a".into(),
        flows: vec![service.clone()],
    };
    b.on_flows(
        &side_b,
        &view(false),
        d(),
        "10.77.0.21:9655".parse().unwrap(),
    )
    .await;
    assert_eq!(kb.state().held_back, vec![(UDP, service.orig)]);
    // The cutover ran between this install's look at it and its hold (a
    // race with the datagram): the hold outlived it. The source's send
    // after the cutover puts the flow in place, and the hold goes.
    {
        let mut st = lock(&b.state);
        let a = st.arriving.get_mut(&vm_key()).unwrap();
        a.arrived = true;
        a.deferred.clear();
    }
    b.on_flows(
        &side_b,
        &view(false),
        d(),
        "10.77.0.21:9655".parse().unwrap(),
    )
    .await;
    assert_eq!(kb.state().flows, vec![service.clone()]);
    assert!(kb.state().held_back.is_empty());
}

#[tokio::test]
async fn a_pods_flow_to_the_vm_through_the_targets_own_service_translation_stays_and_its_sent_again_packets_pass(
) {
    let kb = Arc::new(FakeHandover::default());
    let b = Handovers::new("node-b", kb.clone());
    let mut client = attachment("client");
    client.ips = vec![ip("10.244.2.7")];
    client.vm = None;
    let side_b = Side {
        me: node("node-b", 2, "10.77.0.22"),
        local: vec![attachment("dst"), client],
        sent: Mutex::default(),
    };
    // A pod of node-b reaches the VM (on node-a) through a ClusterIP:
    // node-b made the translation; node-a forwards the flow untranslated.
    let own = flow(
        UDP,
        ends("10.244.2.7:50170", "10.96.0.20:7001"),
        ends("10.244.0.5:7001", "10.244.2.7:50170"),
    );
    let as_node_a_sees_it = flow(
        UDP,
        ends("10.244.2.7:50170", "10.244.0.5:7001"),
        ends("10.244.0.5:7001", "10.244.2.7:50170"),
    );
    kb.with(|s| s.flows.push(own.clone()));
    let d = FlowsDatagram {
        tether_flows: FLOWS_VERSION,
        vm: vm_key(),
        from: "node-a".into(),
        flows: vec![as_node_a_sees_it.clone()],
    };
    b.on_flows(&side_b, &view(false), d, "10.77.0.21:9655".parse().unwrap())
        .await;
    // The packets node-a sends again after the cutover are the flow as
    // node-a saw it, translated already: they pass node-b untracked
    // instead of starting a flow whose ports clash with node-b's own.
    assert!(kb
        .state()
        .translated_back
        .contains(&(UDP, as_node_a_sees_it.orig)));
    assert!(kb.state().held_back.is_empty(), "the pod's, not the VM's");
    b.arrived(side_b.cluster(), &vm_key(), &[ip(VM)]).await;
    assert_eq!(
        kb.state().flows,
        vec![own],
        "node-b's own translation stays"
    );
}

#[tokio::test]
async fn a_move_undone_before_the_source_rerouted_sends_nothing_again() {
    let ka = Arc::new(FakeHandover::default());
    let a = Arc::new(Handovers::new("node-a", ka.clone()));
    let side_a = Arc::new(Side {
        me: node("node-a", 1, "10.77.0.21"),
        local: vec![attachment("src")],
        sent: Mutex::default(),
    });
    let src = attachment("src");
    let tap = (
        src.netns.clone().into(),
        "tap0".to_owned(),
        src.host_ifname.clone(),
    );
    ka.with(|s| {
        s.taps.insert(
            tap.clone(),
            TapCounters {
                sent: 100,
                read: 100,
            },
        );
        s.captured.insert(src.host_ifname.clone(), Vec::new());
        // The VM stays routed to the source pod throughout.
        s.routed.insert(ip(VM), src.host_ifname.clone());
    });
    a.sync(&side_a, &view(false)).await;
    ka.with(|s| {
        s.captured.insert(
            src.host_ifname.clone(),
            (0..5u8).map(|i| vec![0x45, i]).collect(),
        );
        s.taps.insert(
            tap.clone(),
            TapCounters {
                sent: 105,
                read: 100,
            },
        );
    });
    // A cutover the source began to follow, then undone (a retraction):
    // the route never left the source pod, where the guest may run still.
    a.before_reroute(&view(true)).await;
    tokio::time::sleep(REROUTE_WAIT + Duration::from_millis(300)).await;
    assert!(
        ka.state().replayed.is_empty(),
        "nothing sent again to a guest that may run here"
    );
    assert_eq!(a.stats().replayed, 0);
}

#[tokio::test]
async fn a_vm_that_leaves_the_node_it_came_to_arrives_anew_when_it_comes_back() {
    let kb = Arc::new(FakeHandover::default());
    let b = Arc::new(Handovers::new("node-b", kb.clone()));
    let side_b = Arc::new(Side {
        me: node("node-b", 2, "10.77.0.22"),
        local: vec![attachment("dst")],
        sent: Mutex::default(),
    });
    b.arrived(side_b.cluster(), &vm_key(), &[ip(VM)]).await;
    assert!(lock(&b.state).arriving[&vm_key()].arrived);
    // It moves on, to a new pod on node-a placed after its cutover here.
    let mut back = view(true);
    if let Some((rec, _)) = back.records.get_mut(&vm_key()) {
        let rec = Arc::make_mut(rec);
        rec.alternate = Some(pod("node-a", "again", 3_000));
        rec.last_cutover = Some(crate::vm::CutoverInfo {
            trigger: crate::vm::Trigger::Rarp,
            from_node: Some("node-a".into()),
            to_node: "node-b".into(),
            seen_unix_nanos: UnixNanos::from(UnixMillis::from_millis(2_500)),
        });
    }
    b.sync(&side_b, &back).await;
    let st = lock(&b.state);
    assert!(st.leaving.contains_key(&vm_key()), "it leaves node-b");
    assert!(
        !st.arriving.contains_key(&vm_key()),
        "what it found on arriving is forgotten"
    );
}

/// VM `i` of [`many`]: its key, address and the source pod's attachment.
fn many_vm(i: u8) -> (VmKey, IpAddr, Attachment) {
    let key = VmKey::new("ns", &format!("vm{i}"), "eth0").unwrap();
    let ip = ip(&format!("10.244.0.{}", 10 + i));
    let mut a = attachment(&format!("src{i}"));
    a.ips = vec![ip];
    a.vm = Some(key.clone());
    (key, ip, a)
}

/// `n` VMs whose source pods are on node-a and targets on node-b; after
/// the cutover when `moved`.
fn many(n: u8, moved: bool) -> VmView {
    let records = (0..n)
        .map(|i| {
            let (key, ip, _) = many_vm(i);
            let rec = record(
                key.clone(),
                ip,
                &format!("src{i}"),
                &format!("dst{i}"),
                moved,
            );
            (key, (Arc::new(rec), 1))
        })
        .collect();
    VmView {
        records,
        revision: 1,
        synced: true,
    }
}

/// A node that many VMs leave at once (a drain) reads its flow table once
/// for all of them when they start leaving, not once per VM, and then
/// follows its changes instead of reading it every round: a read walks
/// the kernel's whole flow table. Their pins before the reroute are one
/// read, and the last send one more; so are the targets' pins asked for
/// while one runs.
#[tokio::test(start_paused = true)]
async fn many_leaving_vms_share_each_read_of_the_flow_table() {
    const N: u8 = 8;
    let ka = Arc::new(FakeHandover::default());
    let a = Arc::new(Handovers::new("node-a", ka.clone()));
    let side_a = Arc::new(Side {
        me: node("node-a", 1, "10.77.0.21"),
        local: (0..N).map(|i| many_vm(i).2).collect(),
        sent: Mutex::default(),
    });
    ka.with(|s| {
        s.flows = (0..N)
            .map(|i| {
                let vm = many_vm(i).1;
                flow(
                    TCP,
                    FlowEnds {
                        src: SocketAddr::new(vm, 40000),
                        dst: "10.77.0.200:80".parse().unwrap(),
                    },
                    FlowEnds {
                        src: "10.77.0.200:80".parse().unwrap(),
                        dst: SocketAddr::new(vm, 40000),
                    },
                )
            })
            .collect()
    });
    let reads = || ka.state().calls.get("read_flows").copied().unwrap_or(0);
    let vms_sent = |sent: &[(String, Vec<u8>)]| {
        sent.iter()
            .map(|(_, b)| FlowsDatagram::decode(b).expect("a flows datagram").vm)
            .collect::<HashSet<_>>()
            .len()
    };

    a.sync(&side_a, &many(N, false)).await;
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(
        vms_sent(&lock(&side_a.sent)),
        N as usize,
        "every VM's flows went at once"
    );
    let first = reads();
    assert!(first <= 2, "{first} reads for the start of {N} moves");

    // Four rounds of RESEND, each sending every VM's flows: the table is
    // not read again, its changes are followed. A flow made meanwhile
    // goes in the next round.
    lock(&side_a.sent).clear();
    tokio::time::sleep(RESEND * 2).await;
    let vm0 = many_vm(0).1;
    let new_flow = flow(
        UDP,
        FlowEnds {
            src: SocketAddr::new(vm0, 5353),
            dst: "10.77.0.200:53".parse().unwrap(),
        },
        FlowEnds {
            src: "10.77.0.200:53".parse().unwrap(),
            dst: SocketAddr::new(vm0, 5353),
        },
    );
    ka.with(|s| s.flows.push(new_flow.clone()));
    tokio::time::sleep(RESEND * 2).await;
    assert_eq!(reads() - first, 0, "no read per round: the feed");
    assert_eq!(lock(&side_a.sent).len(), 4 * N as usize);
    let last_of_vm0 = lock(&side_a.sent)
        .iter()
        .rev()
        .map(|(_, b)| FlowsDatagram::decode(b).expect("a flows datagram"))
        .find(|d| d.vm == many_vm(0).0)
        .expect("vm0's flows");
    assert!(last_of_vm0.flows.contains(&new_flow), "{last_of_vm0:?}");

    // The cutover: one pin for all of them, then one read (exact: the
    // feed does not tell the end of flows made before it opened) to send
    // their flows once more.
    lock(&side_a.sent).clear();
    let before = reads();
    a.before_reroute(&many(N, true)).await;
    assert_eq!(ka.state().calls.get("pin_translations"), Some(&1));
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(
        vms_sent(&lock(&side_a.sent)),
        N as usize,
        "every VM's last flows"
    );
    assert_eq!(reads() - before, 1);
    // No VM leaves any more: no more reads.
    a.sync(&side_a, &many(N, true)).await;
    tokio::time::sleep(RESEND * 4).await;
    assert_eq!(reads() - before, 1, "nothing read with no VM leaving");

    // A target asked for N pins at once, while the first runs: the first
    // round makes its own, the next all the others.
    let kb = Arc::new(FakeHandover::default());
    kb.with(|s| s.pin_delay = Some(Duration::from_millis(5)));
    let b = Arc::new(Handovers::new("node-b", kb.clone()));
    let pins = (0..N).map(|i| {
        let b = b.clone();
        async move {
            let (key, ip, _) = many_vm(i);
            b.pin(&key, &[ip]).await
        }
    });
    futures::future::join_all(pins).await;
    assert_eq!(kb.state().calls.get("pin_translations"), Some(&2));
}

/// Without a feed of the flow table's changes (conntrack's events off),
/// the sender reads the table every round, once for all its leaving VMs.
#[tokio::test(start_paused = true)]
async fn without_a_feed_the_sender_reads_the_table_each_round() {
    const N: u8 = 4;
    let ka = Arc::new(FakeHandover::default());
    ka.with(|s| s.no_feed = true);
    let a = Arc::new(Handovers::new("node-a", ka.clone()));
    let side_a = Arc::new(Side {
        me: node("node-a", 1, "10.77.0.21"),
        local: (0..N).map(|i| many_vm(i).2).collect(),
        sent: Mutex::default(),
    });
    let reads = || ka.state().calls.get("read_flows").copied().unwrap_or(0);
    a.sync(&side_a, &many(N, false)).await;
    tokio::time::sleep(Duration::from_millis(10)).await;
    let first = reads();
    tokio::time::sleep(RESEND * 4).await;
    assert_eq!(reads() - first, 4, "one read per round, not per VM");
    assert_eq!(ka.state().calls.get("watch_flows"), None);
}
