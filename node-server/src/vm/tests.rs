//! The VM component alone: two `Vms` on one embedded control store, each on
//! a fake kernel and a [`Side`] that stands for its node (pools, local
//! attachments, what the component asks of the node). No `Node` is built:
//! these tests show what the component decides and which kernel calls it
//! makes, through its interface only.

use super::signals::VmPodSeen;
use super::*;
use crate::faulty_control::{Failure, FaultyControl};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;
use tether_base::error::Error;
use tether_base::time::{UnixMillis, UnixNanos};
use tether_ipam::Take;
use tether_kernel::fake::{Call, FakeKernel, FakeLink};
use tether_store::control::embedded::EmbeddedStore;
use tether_store::control::ControlStore;

/// The node as the component sees it: pools and local attachments, and a
/// record of what the component asked of it.
#[derive(Default)]
struct Side {
    pools: Mutex<Option<Pools>>,
    attachments: Mutex<HashMap<AttachmentKey, Attachment>>,
    welcomed: Mutex<Vec<String>>,
    resyncs: AtomicUsize,
    events: Mutex<Vec<(PodRef, PodEvent)>>,
    notices: Mutex<Vec<notices::CutoverNotice>>,
    arrived: Mutex<Vec<(VmKey, String)>>,
}

impl Side {
    fn new(cidr: &str) -> Side {
        let cidr = cidr.parse().expect("a CIDR");
        Side {
            pools: Mutex::new(Some(Pools::new(&[cidr]).expect("pools"))),
            ..Side::default()
        }
    }

    /// Takes `ips` from the pools, all or nothing.
    fn take(&self, ips: &[IpAddr]) -> Result<()> {
        self.with_pools(|p, _| {
            for (i, ip) in ips.iter().enumerate() {
                if p.take(*ip) != Take::Taken {
                    p.release(&ips[..i]);
                    return Err(Error::AddressInUse(ip.to_string()));
                }
            }
            Ok(())
        })
    }

    fn used(&self) -> u128 {
        lock(&self.pools)
            .as_ref()
            .map_or(0, |p| p.pools().iter().map(|p| p.used()).sum())
    }
}

impl NodeSide for Side {
    fn attachment(&self, key: &AttachmentKey) -> Option<Attachment> {
        lock(&self.attachments).get(key).cloned()
    }

    fn attachments_where(&self, keep: &dyn Fn(&Attachment) -> bool) -> Vec<Attachment> {
        lock(&self.attachments)
            .values()
            .filter(|a| keep(a))
            .cloned()
            .collect()
    }

    fn with_pools<R>(
        &self,
        f: impl FnOnce(&mut Pools, &HashMap<AttachmentKey, Attachment>) -> R,
    ) -> R {
        let attachments = lock(&self.attachments);
        let mut pools = lock(&self.pools);
        let pools = pools.as_mut().expect("the side's pools");
        f(pools, &attachments)
    }

    fn addresses_for(&self, req: &Requested) -> impl Future<Output = Result<Vec<IpAddr>>> + Send {
        let out = if req.ips.is_empty() {
            self.with_pools(|p, _| p.allocate().map_err(Error::from))
        } else {
            self.take(&req.ips).map(|()| req.ips.clone())
        };
        std::future::ready(out)
    }

    fn take_requested(&self, ips: &[IpAddr]) -> impl Future<Output = Result<()>> + Send {
        std::future::ready(self.take(ips))
    }

    fn check_mac_free(&self, _mac: Mac, _vm: Option<&VmKey>) -> Result<()> {
        Ok(())
    }

    fn claim_addresses(&self, _pod: &VmPod) -> Result<Option<Vec<IpAddr>>> {
        Ok(None)
    }

    fn welcome_guest(&self, a: &Attachment) {
        lock(&self.welcomed).push(a.host_ifname.clone());
    }

    fn resync_routes(&self, _vm: &VmKey) {
        self.resyncs.fetch_add(1, Ordering::SeqCst);
    }

    fn pod_event(&self, pod: PodRef, event: PodEvent) {
        lock(&self.events).push((pod, event));
    }

    fn send_notice(&self, notice: &notices::CutoverNotice) {
        lock(&self.notices).push(notice.clone());
    }

    fn before_local_route(&self, _vm: &VmKey, _a: &Attachment) -> impl Future<Output = ()> + Send {
        std::future::ready(())
    }

    fn arrived(&self, vm: &VmKey, a: &Attachment) {
        lock(&self.arrived).push((vm.clone(), a.host_ifname.clone()));
    }
}

/// One node: the component, its kernel and its side.
struct One {
    vms: Arc<Vms>,
    kernel: FakeKernel,
    side: Side,
}

/// Nodes "node-a" and "node-b" on one control store.
async fn two() -> (One, One, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let control: Arc<dyn ControlStore> =
        Arc::new(EmbeddedStore::open(dir.path()).expect("the control store"));
    let (a, b) = two_on(control).await;
    (a, b, dir)
}

/// Nodes "node-a" and "node-b" on `control`.
async fn two_on(control: Arc<dyn ControlStore>) -> (One, One) {
    let mut nodes = Vec::new();
    for name in ["node-a", "node-b"] {
        let records = VmRegistry::open(control.clone(), "/tether")
            .await
            .expect("the records");
        let kernel = FakeKernel::new();
        nodes.push(One {
            vms: Arc::new(Vms::new(
                name,
                records,
                Arc::new(kernel.clone()),
                crate::vm::leaving::Leaves::open(None).expect("in memory"),
            )),
            kernel,
            side: Side::new("10.9.0.0/24"),
        });
    }
    let b = nodes.pop().expect("b");
    let a = nodes.pop().expect("a");
    (a, b)
}

/// [`migrating`] on a [`FaultyControl`] store.
async fn migrating_on_faults() -> (One, One, Attachment, Arc<FaultyControl>) {
    let store = FaultyControl::new();
    let (a, b) = two_on(store.clone()).await;
    let first = place(&a, "node-a", "c1", false).await;
    attach(&a, "c1", &first.rec);
    let target = place(&b, "node-b", "c2", true).await;
    let c2 = attach(&b, "c2", &target.rec);
    both_see_the_target(&a, &b).await;
    (a, b, c2, store)
}

fn vm_key() -> VmKey {
    VmKey::new("ns", "vm1", "eth0").expect("a key")
}

fn pod(target: bool) -> VmPod {
    VmPod {
        key: vm_key(),
        domain: "vm1".into(),
        target,
        ready: false,
        guest: None,
        claim: None,
    }
}

/// Container `cid`'s eth0 on network "tether", placed now on `node`.
fn this(node: &str, cid: &str) -> VmAttachment {
    VmAttachment {
        node: node.into(),
        network: "tether".into(),
        container_id: cid.into(),
        ifname: "eth0".into(),
        pod_name: Some(format!("virt-launcher-{cid}")),
        pod_uid: None,
        since_unix_ms: UnixMillis::now(),
    }
}

/// The local attachment of container `cid` holding the record's addresses,
/// with its veth on `one`'s kernel.
fn attach(one: &One, cid: &str, rec: &VmRecord) -> Attachment {
    let host_ifname = format!("tth{cid}");
    let a = Attachment {
        key: AttachmentKey {
            network: "tether".into(),
            container_id: cid.into(),
            ifname: "eth0".into(),
        },
        netns: format!("/run/netns/{cid}"),
        ips: rec.ips.clone(),
        mac: rec.mac,
        host_ifname: host_ifname.clone(),
        mtu: 1500,
        created_unix_nanos: UnixNanos::now(),
        pod_namespace: Some("ns".into()),
        pod_name: Some(format!("virt-launcher-{cid}")),
        pod_uid: None,
        vm: Some(rec.key.clone()),
        guest: None,
        pools: Vec::new(),
        ipam_only: false,
    };
    one.kernel.plant_link(
        &host_ifname,
        FakeLink {
            index: 7,
            netns: a.netns.clone().into(),
            pod_ifname: "eth0".into(),
            pod_mac: rec.mac,
            ips: rec.ips.clone(),
            mtu: 1500,
        },
    );
    lock(&one.side.attachments).insert(a.key.clone(), a.clone());
    a
}

/// What the pod watch reports of container `cid`'s pod: a migration
/// target marked ready, going away if `gone`.
fn ready_target(cid: &str, gone: bool) -> VmPodSeen {
    VmPodSeen {
        namespace: "ns".into(),
        name: format!("virt-launcher-{cid}"),
        uid: String::new(),
        target: true,
        ready: true,
        gone,
    }
}

fn now() -> (Instant, UnixNanos) {
    (Instant::now(), UnixNanos::now())
}

/// Places container `cid` of `one` (on node `node`) in vm1's record: a
/// migration's target if `target`.
async fn place(one: &One, node: &str, cid: &str, target: bool) -> Placement {
    one.vms
        .place(
            &one.side,
            this(node, cid),
            &pod(target),
            &Requested::default(),
        )
        .await
        .expect("placed")
}

/// The VM placed active on A (c1) and its migration target on B (c2).
async fn migrating() -> (One, One, Attachment, Attachment, tempfile::TempDir) {
    let (a, b, dir) = two().await;
    let first = place(&a, "node-a", "c1", false).await;
    assert!(first.created);
    assert_eq!(first.role, Role::Active);
    let c1 = attach(&a, "c1", &first.rec);
    let target = place(&b, "node-b", "c2", true).await;
    assert_eq!(target.role, Role::Alternate);
    assert_eq!(
        target.rec.ips, first.rec.ips,
        "the target gets the VM's address"
    );
    let c2 = attach(&b, "c2", &target.rec);
    (a, b, c1, c2, dir)
}

#[tokio::test]
async fn the_first_pod_creates_the_record_from_its_nodes_pools() {
    let (a, _b, _dir) = two().await;
    let p = place(&a, "node-a", "c1", false).await;
    assert!(p.created);
    assert_eq!(p.rec.ips.len(), 1);
    assert!(p.rec.ips[0].to_string().starts_with("10.9.0."));
    assert_eq!(a.side.used(), 1, "the address came from the side's pools");
    let stored = a.vms.records().read(&vm_key()).await.expect("read");
    assert_eq!(stored.map(|(r, _)| r.ips), Some(p.rec.ips.clone()));
    // The record holds the address: freeing it as a VM address keeps it.
    a.vms.free_ips(&a.side, &p.rec.ips);
    assert_eq!(a.side.used(), 1, "a held VM address stays in use");
    // Undone (the wiring failed): the record goes, and so does the mark,
    // so the address can be freed for the runtime's retry.
    a.vms.undo_placement(&p).await.expect("undone");
    a.vms.free_ips(&a.side, &p.rec.ips);
    assert_eq!(a.side.used(), 0);
    assert!(a
        .vms
        .records()
        .read(&vm_key())
        .await
        .expect("read")
        .is_none());
    assert!(a.kernel.log().is_empty(), "placement touches no kernel");
}

#[tokio::test]
async fn the_targets_announcement_routes_it_first_then_commits() {
    let (a, b, _c1, c2, _dir) = migrating().await;
    let rec = b
        .vms
        .cutover(&b.side, &vm_key(), Some(&c2), Trigger::Rarp, now())
        .await
        .expect("cut over");
    assert!(rec.active.as_ref().is_some_and(|x| x.node == "node-b"));
    assert!(rec.alternate.as_ref().is_some_and(|x| x.node == "node-a"));
    assert_eq!(
        b.kernel.log(),
        vec![(
            Call::EnsureHostRoutes,
            format!("{} {}", c2.host_ifname, c2.ips[0])
        )],
        "one kernel call on the target's node: its route"
    );
    assert_eq!(*lock(&b.side.welcomed), vec![c2.host_ifname.clone()]);
    let events = lock(&b.side.events).clone();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].0.name, "virt-launcher-c2");
    assert_eq!(events[0].1.reason(), "CutoverDone");
    let stats = b.vms.stats();
    assert_eq!(stats.cutovers, 1);
    assert_eq!(
        stats
            .last_cutover
            .map(|c| (c.trigger, c.local_route.is_some())),
        Some((Trigger::Rarp, true))
    );
    // The source's node changed nothing itself: its routes follow the
    // record through the route loop.
    assert!(a.kernel.log().is_empty());
    assert_eq!(a.vms.stats().cutovers, 0);
    // QEMU announces several times: the next one finds the target active
    // already, writes nothing and asks for no resync.
    let resyncs = b.side.resyncs.load(Ordering::SeqCst);
    let again = b
        .vms
        .cutover(&b.side, &vm_key(), Some(&c2), Trigger::Rarp, now())
        .await
        .expect("no error");
    assert_eq!(again.generation, rec.generation, "nothing written");
    assert_eq!(b.side.resyncs.load(Ordering::SeqCst), resyncs);
    assert_eq!(b.vms.stats().cutovers, 1);
}

#[tokio::test]
async fn a_stale_marker_on_the_pod_the_vm_left_touches_nothing() {
    let (a, b, c1, c2, _dir) = migrating().await;
    b.vms
        .cutover(&b.side, &vm_key(), Some(&c2), Trigger::Rarp, now())
        .await
        .expect("A to B");
    // c1 on A is now the alternate, placed before the last cutover: its
    // ready marker, if it has one, is the one of an older migration.
    let before = a.vms.records().read(&vm_key()).await.expect("read");
    for _ in 0..5 {
        let rec = a
            .vms
            .cutover(&a.side, &vm_key(), Some(&c1), Trigger::Annotation, now())
            .await
            .expect("refused quietly");
        assert!(rec.active.as_ref().is_some_and(|x| x.node == "node-b"));
    }
    assert!(a
        .vms
        .vm_pod_seen(&a.side, &ready_target("c1", false))
        .await
        .is_empty());
    assert_eq!(
        a.kernel.calls(Call::EnsureHostRoutes) + a.kernel.calls(Call::RemoveHostRoutes),
        0,
        "no route touched for a cutover the record refuses"
    );
    assert_eq!(
        a.vms.records().read(&vm_key()).await.expect("read"),
        before,
        "the record is unchanged"
    );
    assert_eq!(a.vms.stats().cutovers, 0);
}

#[tokio::test]
async fn a_promoted_target_that_goes_away_gives_the_vm_back() {
    let (_a, b, _c1, c2, _dir) = migrating().await;
    b.vms
        .cutover(&b.side, &vm_key(), Some(&c2), Trigger::Annotation, now())
        .await
        .expect("A to B on the marker");
    let gone = ready_target("c2", true);
    let reverts = b.vms.vm_pod_seen(&b.side, &gone).await;
    assert_eq!(reverts.len(), 1);
    assert_eq!(reverts[0].source_pod, "virt-launcher-c1");
    let resyncs = b.side.resyncs.load(Ordering::SeqCst);
    assert!(b
        .vms
        .revert_cutover(&b.side, &reverts[0])
        .await
        .expect("revert"));
    assert_eq!(b.side.resyncs.load(Ordering::SeqCst), resyncs + 1);
    let rec = b.vms.records().read(&vm_key()).await.expect("read");
    let rec = rec.expect("a record").0;
    assert!(rec.active.as_ref().is_some_and(|x| x.node == "node-a"));
    assert_eq!(
        rec.last_cutover.map(|c| c.trigger),
        Some(Trigger::TargetFailed)
    );
    // Once only.
    assert!(!b
        .vms
        .revert_cutover(&b.side, &reverts[0])
        .await
        .expect("revert"));
}

#[tokio::test]
async fn a_reservation_takes_its_address_and_a_release_gives_the_record_up() {
    let (a, _b, _dir) = two().await;
    let ip: IpAddr = "10.9.0.50".parse().expect("an address");
    let rec = a
        .vms
        .reserve(&a.side, vm_key(), vec![ip], None)
        .await
        .expect("reserved");
    assert_eq!(rec.origin, Origin::Reserved);
    assert_eq!(a.side.used(), 1);
    // The same again is the same record; another address is refused.
    assert_eq!(
        a.vms
            .reserve(&a.side, vm_key(), vec![ip], None)
            .await
            .expect("idempotent")
            .ips,
        vec![ip]
    );
    let other: IpAddr = "10.9.0.51".parse().expect("an address");
    assert!(matches!(
        a.vms.reserve(&a.side, vm_key(), vec![other], None).await,
        Err(Error::VmState(_))
    ));
    let released = a.vms.release(&vm_key(), false).await.expect("released");
    assert_eq!(released.ips, vec![ip]);
    assert!(a
        .vms
        .records()
        .read(&vm_key())
        .await
        .expect("read")
        .is_none());
}

/// Waits until `one`'s view shows vm1's record at `generation` or later.
async fn seen_at(one: &One, generation: u64) -> VmView {
    for _ in 0..500 {
        let view = one.vms.records().view().clone();
        if view
            .records
            .get(&vm_key())
            .is_some_and(|(r, _)| r.generation >= generation)
        {
            return view;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    panic!("the view never showed generation {generation}");
}

/// Waits until B's and then A's view show the record as B's target
/// placement wrote it; returns A's view.
async fn both_see_the_target(a: &One, b: &One) -> VmView {
    let placed = b
        .vms
        .records()
        .cached(&vm_key())
        .map_or(0, |(r, _)| r.generation);
    let on_b = seen_at(b, placed).await;
    seen_at(a, active_in(&on_b).1).await
}

fn active_in(view: &VmView) -> (String, u64) {
    let (r, _) = view.records.get(&vm_key()).expect("vm1's record");
    (
        r.active
            .as_ref()
            .map(|x| x.node.clone())
            .unwrap_or_default(),
        r.generation,
    )
}

#[tokio::test]
async fn the_targets_notice_moves_the_other_nodes_until_the_record_settles() {
    let (a, b, _c1, c2, _dir) = migrating().await;
    let before = both_see_the_target(&a, &b).await;
    b.vms
        .cutover(&b.side, &vm_key(), Some(&c2), Trigger::Rarp, now())
        .await
        .expect("cut over");
    let sent = lock(&b.side.notices).clone();
    let [notice @ notices::CutoverNotice::Promote { generation, .. }] = sent.as_slice() else {
        panic!("one promotion announced: {sent:?}");
    };
    assert_eq!(
        *generation,
        active_in(&before).1,
        "the generation it promoted from"
    );

    // On A, before the commit reaches its view, the notice alone routes
    // the VM to B, as the committed record will.
    assert!(a.vms.take_notice(notice.clone()));
    let forecast = a.vms.routed_view(&before).expect("a forecast");
    assert_eq!(active_in(&forecast), ("node-b".to_string(), generation + 1));
    let (r, _) = forecast.records.get(&vm_key()).expect("vm1");
    assert_eq!(
        r.alternate.as_ref().map(|x| x.node.as_str()),
        Some("node-a")
    );
    assert_eq!(
        r.last_cutover.as_ref().map(|c| c.trigger),
        Some(Trigger::Rarp)
    );
    // A node never follows its own notice.
    assert!(!b.vms.take_notice(notice.clone()));

    // Once the commit is in A's view, the record alone decides, and the
    // notice is gone.
    let after = seen_at(&a, generation + 1).await;
    assert_eq!(active_in(&after), ("node-b".to_string(), generation + 1));
    assert!(a.vms.routed_view(&after).is_none());
    assert!(a.vms.routed_view(&before).is_none(), "dropped, not kept");
}

#[tokio::test]
async fn a_notice_the_record_refuses_is_retracted_and_the_others_return() {
    let (a, b, c2, store) = migrating_on_faults().await;
    let before = both_see_the_target(&a, &b).await;
    // B announces, then its write is held back while the target's pod
    // goes away (its DEL clears the alternate): the write is refused.
    store.hold_next(1, Duration::from_millis(300));
    let cut = {
        let vms = b.vms.clone();
        let c2 = c2.clone();
        tokio::spawn(async move {
            let side = Side::new("10.9.0.0/24");
            let out = vms
                .cutover(&side, &vm_key(), Some(&c2), Trigger::Rarp, now())
                .await;
            let sent = lock(&side.notices).clone();
            (out, sent)
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    a.vms
        .records()
        .update(&vm_key(), |r| {
            r.alternate = None;
            Ok(true)
        })
        .await
        .expect("the target's pod gone");
    let (out, sent) = cut.await.expect("the cutover task");
    let rec = out.expect("a refusal is no error");
    assert_eq!(rec.active.as_ref().map(|x| x.node.as_str()), Some("node-a"));
    let [promote @ notices::CutoverNotice::Promote { .. }, retract @ notices::CutoverNotice::Retract { .. }] =
        sent.as_slice()
    else {
        panic!("a promotion, then its retraction: {sent:?}");
    };

    // A followed the promotion; the retraction brings it back at once,
    // though its view has not moved yet.
    assert!(a.vms.take_notice(promote.clone()));
    assert_eq!(
        active_in(&a.vms.routed_view(&before).expect("forecast")).0,
        "node-b"
    );
    assert!(a.vms.take_notice(retract.clone()));
    assert!(a.vms.routed_view(&before).is_none());

    // Without the retraction, the refusing change in the view does it.
    assert!(a.vms.take_notice(promote.clone()));
    let later = seen_at(&a, active_in(&before).1 + 1).await;
    assert!(a.vms.routed_view(&later).is_none());
    assert!(a.vms.routed_view(&before).is_none(), "dropped for good");
}

#[test]
fn notices_apply_only_to_their_generation_and_attachment_and_lapse() {
    let rec = |generation: u64| VmRecord {
        key: vm_key(),
        ips: vec!["10.9.0.5".parse().expect("ip")],
        mac: "0a:58:0a:09:00:05".parse().expect("mac"),
        origin: Origin::Allocated,
        active: Some(this("node-a", "c1")),
        alternate: Some(this("node-b", "c2")),
        generation,
        created_unix_ms: UnixMillis::now(),
        last_cutover: None,
    };
    let view = |generation: u64| VmView {
        records: [(vm_key(), (std::sync::Arc::new(rec(generation)), 10))]
            .into_iter()
            .collect(),
        revision: 10,
        synced: true,
    };
    let promote = |cid: &str, generation: u64| notices::CutoverNotice::Promote {
        vm: vm_key(),
        generation,
        to: notices::NoticeTarget {
            node: "node-b".into(),
            network: "tether".into(),
            container_id: cid.into(),
            ifname: "eth0".into(),
        },
        trigger: Trigger::Rarp,
        seen_unix_nanos: UnixNanos::now(),
    };
    let t0 = Instant::now();
    let mut table = notices::NoticeTable::new();

    // Another attachment than the record's alternate: refused, dropped.
    assert!(notices::note(&mut table, promote("c9", 4), t0));
    assert!(notices::forecast(&view(4), &mut table, t0).is_none());
    assert!(table.is_empty());

    // A view older than the notice: kept, not applied; then applied.
    notices::note(&mut table, promote("c2", 4), t0);
    assert!(notices::forecast(&view(3), &mut table, t0).is_none());
    assert_eq!(table.len(), 1);
    assert!(notices::forecast(&view(4), &mut table, t0).is_some());

    // An older notice does not replace a newer one.
    assert!(!notices::note(&mut table, promote("c2", 3), t0));

    // It lapses.
    let late = t0 + notices::NOTICE_TTL + Duration::from_millis(1);
    assert!(notices::forecast(&view(4), &mut table, late).is_none());
    assert!(table.is_empty());

    // The same notice again (a target renewing it while its write is
    // retried) asks for no new route pass, and holds past the first lapse.
    let n = promote("c2", 4);
    assert!(notices::note(&mut table, n.clone(), t0));
    let renewal = t0 + notices::NOTICE_TTL - Duration::from_secs(1);
    assert!(!notices::note(&mut table, n, renewal));
    assert!(notices::forecast(&view(4), &mut table, late).is_some());
    table.clear();

    // On the wire: its version, and nothing else is taken for a notice.
    let n = promote("c2", 4);
    assert_eq!(notices::CutoverNotice::decode(&n.encode()), Some(n.clone()));
    let other = String::from_utf8(n.encode())
        .expect("json")
        .replace("\"tether_cutover\":1", "\"tether_cutover\":2");
    assert_eq!(notices::CutoverNotice::decode(other.as_bytes()), None);
    assert_eq!(notices::CutoverNotice::decode(b"hello"), None);
}

#[tokio::test]
async fn a_target_that_cannot_route_its_vm_retracts_its_notice() {
    let (a, b, _c1, c2, _dir) = migrating().await;
    both_see_the_target(&a, &b).await;
    b.kernel.fail_always(Call::EnsureHostRoutes);
    let out = b
        .vms
        .cutover(&b.side, &vm_key(), Some(&c2), Trigger::Rarp, now())
        .await;
    assert!(out.is_err(), "the local route failed: {out:?}");
    let sent = lock(&b.side.notices).clone();
    assert!(
        matches!(
            sent.as_slice(),
            [
                notices::CutoverNotice::Promote { .. },
                notices::CutoverNotice::Retract { .. }
            ]
        ),
        "announced, then retracted: {sent:?}"
    );
    let rec = b.vms.records().read(&vm_key()).await.expect("read");
    assert_eq!(
        rec.and_then(|(r, _)| r.active.map(|x| x.node)).as_deref(),
        Some("node-a"),
        "nothing written"
    );
}

#[tokio::test]
async fn an_announced_cutover_whose_write_gets_no_answer_is_tried_until_it_commits() {
    let (_a, b, c2, store) = migrating_on_faults().await;
    store.fail_next(3, Failure::Unanswered);
    let before = store.commits();
    let rec = b
        .vms
        .cutover(&b.side, &vm_key(), Some(&c2), Trigger::Rarp, now())
        .await
        .expect("cut over after the store answered again");
    assert_eq!(rec.active.as_ref().map(|x| x.node.as_str()), Some("node-b"));
    assert_eq!(
        store.commits() - before,
        4,
        "three unanswered writes, then the one that commits"
    );
    let stored = b.vms.records().read(&vm_key()).await.expect("read");
    assert_eq!(
        stored.and_then(|(r, _)| r.active).map(|x| x.node),
        Some("node-b".to_string())
    );
    let sent = lock(&b.side.notices).clone();
    assert!(
        !sent.is_empty()
            && sent
                .iter()
                .all(|n| matches!(n, notices::CutoverNotice::Promote { .. })),
        "promoted, never retracted: {sent:?}"
    );
    assert_eq!(b.vms.stats().cutovers, 1);
}

#[tokio::test]
async fn a_cutover_whose_write_landed_but_lost_its_answer_is_not_retracted() {
    let (_a, b, c2, store) = migrating_on_faults().await;
    store.fail_next(1, Failure::AnswerLost);
    let rec = b
        .vms
        .cutover(&b.side, &vm_key(), Some(&c2), Trigger::Rarp, now())
        .await
        .expect("the write had landed");
    assert_eq!(rec.active.as_ref().map(|x| x.node.as_str()), Some("node-b"));
    let sent = lock(&b.side.notices).clone();
    assert!(
        matches!(sent.as_slice(), [notices::CutoverNotice::Promote { .. }]),
        "the promotion alone, not retracted: {sent:?}"
    );
    assert_eq!(b.vms.stats().cutovers, 1);
    assert_eq!(b.side.resyncs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn an_unanswered_cutover_stops_trying_when_the_target_pod_goes() {
    let (_a, b, c2, store) = migrating_on_faults().await;
    store.fail_next(usize::MAX, Failure::Unanswered);
    let b = Arc::new(b);
    let cut = {
        let b = b.clone();
        let c2 = c2.clone();
        tokio::spawn(async move {
            b.vms
                .cutover(&b.side, &vm_key(), Some(&c2), Trigger::Rarp, now())
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!cut.is_finished(), "still trying while the pod is there");
    lock(&b.side.attachments).remove(&c2.key);
    let out = tokio::time::timeout(Duration::from_secs(5), cut)
        .await
        .expect("the retries end once the pod is gone")
        .expect("the task");
    assert!(matches!(out, Err(Error::TryAgain(_))), "{out:?}");
    store.fail_next(0, Failure::Unanswered);
}
