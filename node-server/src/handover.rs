//! A VM's connections across its live migration: what the node the VM
//! leaves (the source) and the node it goes to (the target) do beyond the
//! routes, so that every connection of the VM survives the move
//! (docs/user/vm-connections.md has the design, the measurements and the
//! limits; [`tether_kernel::handover`] and [`tether_kernel::replay`] the
//! kernel side).
//!
//! **The source**, while its VM has a migration target on another node:
//! - holds the packets it sends down the VM's pod veth (the last few
//!   thousand), and reads the guest's tap counters at the start;
//! - sends the target the VM's flows ([`FlowsDatagram`]) every
//!   [`RESEND`]: the node's sender reads the flow table once when VMs
//!   start leaving, then follows its changes (a
//!   [`tether_kernel::flow_watch::FlowWatch`]), so a long migration costs
//!   no more reads than a short one;
//! - at the cutover (the target's notice, or the record), before it
//!   reroutes the VM: pins the translations of the flows toward the VM
//!   ([`Handovers::before_reroute`]); after: sends the packets the guest
//!   never read again (through the routes, to the target, where the guest
//!   has just resumed), and its flows once more.
//!
//! **The target**, for a VM whose migration target pod is here:
//! - recreates the flows it is sent (as [`Flow::landed`] says); one that
//!   collides with one of this node's own waits for the cutover, then
//!   replaces it;
//! - at the cutover, before it routes the VM to its pod, pins the
//!   translations toward the VM that entered here; after, guards the VM's
//!   addresses for [`GUARD_TTL`].
//!
//! Datagrams are not authenticated, as the cutover notices: a node takes
//! flows only from an underlay address of the node that holds the VM's
//! active pod (or, after the cutover, the node it left), only for a VM
//! whose pod is on this node, and only flows of one of the VM's addresses.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot, Notify};

use crate::cluster::{ClusterView, NodeRecord, Overlay};
use crate::routing::plan::{next_hop, ClusterSide};
use crate::vm::promotion::placed_before_last_cutover;
use crate::vm::{VmAttachment, VmKey, VmRecord, VmView};
use tether_base::sync::lock;
use tether_ipam::Family;
use tether_kernel::flow_watch::FlowWatch;
use tether_kernel::handover::{Flow, FlowCreated, FlowEnds, Handover, Held, TapCounters};
use tether_kernel::ClusterRoute;
use tether_store::store::{Attachment, AttachmentKey};

/// How often a source sends its VM's flows to the target while the
/// migration runs (besides at the cutover).
pub const RESEND: Duration = Duration::from_millis(500);

/// The sender's watch of the flow table while VMs leave.
enum Watch {
    /// Not opened since the sender last went idle.
    Untried,
    /// Open: the table read once, then followed by its changes.
    Open(FlowWatch),
    /// The kernel has no feed: the table is read every round.
    Refused,
}

/// How long the target guards a VM's addresses after its cutover.
pub const GUARD_TTL: Duration = Duration::from_secs(60);
/// How long what the target sets up for a waiting VM lasts unless the
/// source sends the VM's flows again (every [`RESEND`]).
pub const WAITING_TTL: Duration = Duration::from_secs(10);
/// How long a source waits for its own route to the VM to leave the
/// source pod before it sends the held packets; after that, it sends
/// none (the move was undone, and the guest may run here still).
pub const REROUTE_WAIT: Duration = Duration::from_secs(2);
/// The version of the flows datagram.
pub const FLOWS_VERSION: u32 = 1;
/// Flows per datagram: each is about 200 bytes of JSON, so a datagram
/// stays under a 1,500-byte MTU.
const FLOWS_PER_DATAGRAM: usize = 6;

/// The VM's flows, from the node it leaves to the node it goes to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlowsDatagram {
    /// The format's version ([`FLOWS_VERSION`]).
    pub tether_flows: u32,
    /// The VM.
    pub vm: VmKey,
    /// The sending node.
    pub from: String,
    /// Flows as the sender's conntrack holds them.
    pub flows: Vec<Flow>,
}

impl FlowsDatagram {
    /// The datagrams that carry `flows`.
    pub fn encode(vm: &VmKey, from: &str, flows: &[Flow]) -> Vec<Vec<u8>> {
        flows
            .chunks(FLOWS_PER_DATAGRAM)
            .filter_map(|chunk| {
                serde_json::to_vec(&FlowsDatagram {
                    tether_flows: FLOWS_VERSION,
                    vm: vm.clone(),
                    from: from.to_owned(),
                    flows: chunk.to_vec(),
                })
                .ok()
            })
            .collect()
    }

    /// Reads a datagram; None for anything else.
    pub fn decode(bytes: &[u8]) -> Option<FlowsDatagram> {
        let d: FlowsDatagram = serde_json::from_slice(bytes).ok()?;
        (d.tether_flows == FLOWS_VERSION).then_some(d)
    }
}

/// How many of the packets held since `start` the guest never read:
/// what went down the veth since, less what its QEMU read since.
pub fn unread_since(start: TapCounters, now: TapCounters) -> u64 {
    now.sent
        .saturating_sub(start.sent)
        .saturating_sub(now.read.saturating_sub(start.read))
}

/// Counters of the handovers since the daemon started.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct HandoverStats {
    /// Flows sent to targets.
    pub flows_sent: u64,
    /// Flows received from sources.
    pub flows_received: u64,
    /// Flows created here.
    pub flows_created: u64,
    /// Flows that replaced one of this node's own at the cutover.
    pub flows_replaced: u64,
    /// Flows refused (not the VM's, or from a node that is not its
    /// source).
    pub flows_refused: u64,
    /// Translations pinned before a VM was rerouted.
    pub pinned: u64,
    /// Packets a guest missed during its pause, sent again after its
    /// cutover.
    pub replayed: u64,
    /// Missed packets not sent again (not held any more, too large, not
    /// IP).
    pub replay_skipped: u64,
}

/// What the handover needs of the node it runs on.
pub trait HandoverSide: Send + Sync + 'static {
    /// The local attachment under `key`.
    fn local_attachment(&self, key: &AttachmentKey) -> Option<Attachment>;
    /// This node's record, the overlay and the cluster view; None on a
    /// node without peers (a VM can only move within it).
    fn cluster(&self) -> Option<(NodeRecord, Overlay, Arc<ClusterView>)>;
    /// Sends one datagram to node `node`'s notice port.
    fn send_to_node(&self, node: &str, bytes: &[u8]);
    /// Whether `ip` is the address of a pod on this node.
    fn is_local_pod(&self, ip: IpAddr) -> bool;
}

/// A VM leaving this node: what the leaving task is told.
struct Leaving {
    to: String,
    /// The target pod (its container id): one move.
    target: String,
    ips: Vec<IpAddr>,
    /// Its translations toward it were pinned for this move.
    pinned: bool,
    events: mpsc::UnboundedSender<()>,
}

/// A VM arriving on this node.
#[derive(Default)]
struct Arriving {
    /// The answers of its Service flows that pass untracked (see
    /// [`Handover::pass_translated_back`]).
    translated_back: HashSet<(u8, FlowEnds)>,
    /// Flows that collided with one of this node's, for the cutover.
    deferred: Vec<Flow>,
    /// The VM's own directions of its deferred Service flows, held back
    /// until they replace this node's (see [`Handover::hold_back`]).
    held_back: HashSet<(u8, FlowEnds)>,
    /// The cutover to this node happened.
    arrived: bool,
}

#[derive(Default)]
struct State {
    leaving: HashMap<VmKey, Leaving>,
    /// Moves that ended here (VM, target pod) while the records still show
    /// them: they are not started again.
    ended: HashSet<(VmKey, String)>,
    arriving: HashMap<VmKey, Arriving>,
    /// Anchors this node has made rules for.
    anchors: HashSet<u16>,
    /// VMs that cut over from here (VM, addresses, target node) whose
    /// flows go to the target once more, in the sender's next round.
    finals: Vec<(VmKey, Vec<IpAddr>, String)>,
}

/// Pins asked for and not yet made: the next round makes them all, with
/// one read of the flow table.
#[derive(Default)]
struct PinQueue {
    vms: Vec<VmKey>,
    ips: Vec<IpAddr>,
    done: Vec<oneshot::Sender<()>>,
}

/// The handovers of one node (see the module doc).
pub struct Handovers {
    me: String,
    kernel: Arc<dyn Handover>,
    /// Whether a source sends again what its guest missed while paused
    /// (`--migration-replay`).
    replay: std::sync::atomic::AtomicBool,
    state: Mutex<State>,
    stats: Mutex<HandoverStats>,
    /// Wakes the sender: a VM started leaving, or cut over.
    kick: Arc<Notify>,
    /// The sender task runs (it starts with the first leaving VM).
    sender: AtomicBool,
    pins: Mutex<PinQueue>,
    /// Held by the task that makes a round of pins.
    pin_round: tokio::sync::Mutex<()>,
}

/// Whether `alt` is a migration's target, rather than the source a cutover
/// demoted.
fn is_target(alt: &VmAttachment, rec: &VmRecord) -> bool {
    !placed_before_last_cutover(alt, rec)
}

fn key_of(a: &VmAttachment) -> AttachmentKey {
    AttachmentKey {
        network: a.network.clone(),
        container_id: a.container_id.clone(),
        ifname: a.ifname.clone(),
    }
}

/// The next hops to node `name`, one per family it can be reached in.
fn hops_to(
    me: &NodeRecord,
    overlay: &Overlay,
    view: &ClusterView,
    name: &str,
) -> Vec<ClusterRoute> {
    let side = ClusterSide { me, overlay, view };
    [Family::V4, Family::V6]
        .into_iter()
        .filter_map(|f| next_hop(&side, name, f))
        .map(|(via, onlink_dev)| ClusterRoute {
            dst: ipnet::IpNet::from(via),
            via,
            onlink_dev,
        })
        .collect()
}

impl Handovers {
    /// The handovers of node `me`.
    pub fn new(me: impl Into<String>, kernel: Arc<dyn Handover>) -> Handovers {
        Handovers {
            me: me.into(),
            kernel,
            replay: std::sync::atomic::AtomicBool::new(true),
            state: Mutex::default(),
            stats: Mutex::default(),
            kick: Arc::new(Notify::new()),
            sender: AtomicBool::new(false),
            pins: Mutex::default(),
            pin_round: tokio::sync::Mutex::new(()),
        }
    }

    /// Whether a source sends again the packets its guest missed while
    /// paused (on by default; moves already under way keep their choice).
    pub fn set_replay(&self, on: bool) {
        self.replay.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// The counters.
    pub fn stats(&self) -> HandoverStats {
        *lock(&self.stats)
    }

    /// Brings the handovers in line with the records: a VM active here
    /// whose migration target is on another node is held and its flows
    /// sent; a leaving VM the records no longer move ends. Called on every
    /// pass of the route loop.
    pub async fn sync<S: HandoverSide>(self: &Arc<Self>, side: &Arc<S>, view: &VmView) {
        if side.cluster().is_none() {
            return;
        }
        let mut wanted: HashMap<VmKey, (VmRecord, String, String)> = HashMap::new();
        for (key, (rec, _)) in &view.records {
            let (Some(act), Some(alt)) = (&rec.active, &rec.alternate) else {
                continue;
            };
            if is_target(alt, rec)
                && act.node == self.me
                && alt.node != self.me
                && side.local_attachment(&key_of(act)).is_some()
            {
                wanted.insert(
                    key.clone(),
                    (
                        VmRecord::clone(rec),
                        alt.node.clone(),
                        alt.container_id.clone(),
                    ),
                );
            }
        }
        let (to_start, to_end) = {
            let mut st = lock(&self.state);
            st.ended
                .retain(|(k, target)| wanted.get(k).is_some_and(|(_, _, t)| t == target));
            let to_start: Vec<(VmKey, VmRecord, String, String)> = wanted
                .iter()
                .filter(|(k, (_, to, target))| {
                    st.leaving.get(*k).is_none_or(|l| &l.to != to)
                        && !st.ended.contains(&((*k).clone(), target.clone()))
                })
                .map(|(k, (r, to, target))| (k.clone(), r.clone(), to.clone(), target.clone()))
                .collect();
            let to_end: Vec<VmKey> = st
                .leaving
                .iter()
                .filter(|(k, l)| wanted.get(*k).is_none_or(|(_, to, _)| to != &l.to))
                .map(|(k, _)| k.clone())
                .collect();
            (to_start, to_end)
        };
        for key in to_end {
            self.leaving_ends(&key);
        }
        for (key, rec, to, target) in to_start {
            self.start_leaving(side, key, rec, to, target).await;
        }
        lock(&self.state)
            .arriving
            .retain(|k, _| view.records.contains_key(k));
    }

    /// Starts holding a leaving VM's packets and sending its flows to
    /// `to`.
    async fn start_leaving<S: HandoverSide>(
        self: &Arc<Self>,
        side: &Arc<S>,
        key: VmKey,
        rec: VmRecord,
        to: String,
        target: String,
    ) {
        let Some(a) = rec
            .active
            .as_ref()
            .and_then(|act| side.local_attachment(&key_of(act)))
        else {
            return;
        };
        // The tap is where KubeVirt puts it for every binding that has one;
        // without it (a binding with no tap) nothing is held, and only the
        // flows go over.
        let replay = self.replay.load(std::sync::atomic::Ordering::Relaxed);
        let held = match tether_base::guest::tap_name(&a.key.ifname) {
            Ok(tap) if replay => {
                let netns = std::path::Path::new(&a.netns);
                match self.kernel.tap_counters(netns, &tap, &a.host_ifname).await {
                    Ok(start) => match self.kernel.capture(&a.host_ifname).await {
                        Ok(capture) => Some((capture, start, tap)),
                        Err(e) => {
                            tracing::warn!(vm = %key, error = %e, "cannot hold a leaving guest's packets");
                            None
                        }
                    },
                    Err(e) => {
                        tracing::info!(vm = %key, error = %e, "no tap to count for a leaving guest: its missed packets are not sent again");
                        None
                    }
                }
            }
            _ => None,
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let mut st = lock(&self.state);
        // Whatever it found when it came here last is over: should it
        // come back, it arrives anew.
        st.arriving.remove(&key);
        st.leaving.insert(
            key.clone(),
            Leaving {
                to: to.clone(),
                target,
                ips: rec.ips.clone(),
                pinned: false,
                events: tx,
            },
        );
        drop(st);
        tracing::info!(vm = %key, %to, holding = held.is_some(), "the VM is moving: its flows go to the target");
        self.start_sender(side);
        self.kick.notify_one();
        let this = self.clone();
        tokio::spawn(async move { this.leave(key, rec.ips, a, to, held, rx).await });
    }

    /// Starts the node's sender, once: every [`RESEND`] while any VM
    /// leaves this node, and at once when one starts leaving or cuts
    /// over, it reads the flow table once and sends each leaving VM's
    /// flows to its target. One read for all of them: a read walks the
    /// kernel's whole flow table, and a node that drains sends many VMs
    /// at once (one read per VM and address every [`RESEND`] took 10
    /// nodes of 10 leaving VMs each to 2.6 cores of system time).
    fn start_sender<S: HandoverSide>(self: &Arc<Self>, side: &Arc<S>) {
        if self.sender.swap(true, Ordering::AcqRel) {
            return;
        }
        let this: Weak<Handovers> = Arc::downgrade(self);
        let kick = self.kick.clone();
        let side = side.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(RESEND);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut busy = true;
            let mut watch = Watch::Untried;
            loop {
                if busy {
                    tokio::select! {
                        _ = tick.tick() => {}
                        () = kick.notified() => {}
                    }
                } else {
                    kick.notified().await;
                    tick.reset();
                }
                let Some(this) = this.upgrade() else {
                    return;
                };
                busy = this.send_round(side.as_ref(), &mut watch).await;
                if !busy {
                    // Nothing leaves: the feed closes (the kernel sends
                    // it every flow change of the node while open).
                    watch = Watch::Untried;
                }
            }
        });
    }

    /// One round of the sender: the flows of every leaving VM, and once
    /// more those of the VMs that cut over since the last round. False
    /// when no VM leaves this node any more. A flow the VM opened to a
    /// Service whose backend is a pod of this node is anchored here (its
    /// translation stays where the backend's answers come back through):
    /// recreated on the target, its translation would meet this node's
    /// own, which the backend's answers still take.
    async fn send_round<S: HandoverSide>(&self, side: &S, watch: &mut Watch) -> bool {
        let (batch, leaving, finals) = {
            let mut st = lock(&self.state);
            let mut batch: Vec<(VmKey, Vec<IpAddr>, String)> = st
                .leaving
                .iter()
                .map(|(k, l)| (k.clone(), l.ips.clone(), l.to.clone()))
                .collect();
            let leaving = !batch.is_empty();
            let finals = !st.finals.is_empty();
            batch.append(&mut st.finals);
            (batch, leaving, finals)
        };
        if batch.is_empty() {
            return leaving;
        }
        let ips: Vec<IpAddr> = batch.iter().flat_map(|(_, ips, _)| ips.clone()).collect();
        let mut each = match self.read_flows(watch, &ips, finals).await {
            Ok(each) => each.into_iter(),
            Err(e) => {
                tracing::warn!(vms = batch.len(), error = %e, "cannot read the leaving VMs' flows");
                return leaving;
            }
        };
        let me = side.cluster().map(|(me, _, _)| me.id as u16);
        for (vm, ips, to) in batch {
            let mut flows = Vec::new();
            for ip in &ips {
                let found = each.next().unwrap_or_default();
                flows.extend(found.into_iter().map(|mut f| {
                    let to_local_backend = f.orig.src.ip() == *ip
                        && f.destination_translated()
                        && !f.source_translated()
                        && side.is_local_pod(f.reply.src.ip());
                    if let (true, Some(me), None) = (to_local_backend, me, f.anchor()) {
                        f.mark = tether_kernel::handover::anchor_mark(me);
                    }
                    f
                }));
            }
            if flows.is_empty() {
                continue;
            }
            for datagram in FlowsDatagram::encode(&vm, &self.me, &flows) {
                side.send_to_node(&to, &datagram);
            }
            lock(&self.stats).flows_sent += flows.len() as u64;
        }
        leaving
    }

    /// The flows of each of `ips`: from the sender's watch, opened on its
    /// first round (one read of the flow table, then the kernel's
    /// changes), or read `exactly` (the last send of VMs that cut over:
    /// the feed does not tell the end of a flow made before it opened);
    /// without a watch (the kernel has no feed), a read of the table each
    /// round.
    async fn read_flows(
        &self,
        watch: &mut Watch,
        ips: &[IpAddr],
        exactly: bool,
    ) -> tether_kernel::error::Result<Vec<Vec<Flow>>> {
        if let Watch::Untried = watch {
            *watch = match FlowWatch::open(self.kernel.as_ref()) {
                Ok(w) => Watch::Open(w),
                Err(e) => {
                    tracing::info!(error = %e, "no feed of the flow table's changes: it is read every round while VMs leave");
                    Watch::Refused
                }
            };
        }
        match watch {
            Watch::Open(w) => {
                if exactly {
                    w.read_again();
                }
                w.flows_of_each(self.kernel.as_ref(), ips).await
            }
            _ => self.kernel.flows_of_each(ips).await,
        }
    }

    /// The leaving task: waits for the cutover, then sends the packets the
    /// guest missed, and has the sender send the VM's flows once more.
    async fn leave(
        self: Arc<Self>,
        vm: VmKey,
        ips: Vec<IpAddr>,
        pod: Attachment,
        to: String,
        held: Option<(Box<dyn Held>, TapCounters, String)>,
        mut rx: mpsc::UnboundedReceiver<()>,
    ) {
        // The cutover: rx gets its one message (or its sender goes).
        let _ = rx.recv().await;
        if let Some((capture, start, tap)) = held {
            self.replay_missed(&vm, &ips, &pod, capture.as_ref(), start, &tap)
                .await;
            // Stopping a capture waits for its reader thread: not on a
            // worker of the runtime.
            let _ = tokio::task::spawn_blocking(move || drop(capture)).await;
        }
        lock(&self.state).finals.push((vm, ips, to));
        self.kick.notify_one();
    }

    /// Sends again the packets the guest never read, once this node no
    /// longer routes the VM to the pod it left.
    async fn replay_missed(
        &self,
        vm: &VmKey,
        ips: &[IpAddr],
        pod: &Attachment,
        held: &dyn Held,
        start: TapCounters,
        tap: &str,
    ) {
        let since = Instant::now();
        loop {
            let mut local = false;
            for ip in ips {
                local |= self
                    .kernel
                    .routes_to_link(*ip, &pod.host_ifname)
                    .await
                    .unwrap_or(false);
            }
            if !local {
                break;
            }
            if since.elapsed() >= REROUTE_WAIT {
                // Still routed to the pod it left: the move did not happen
                // after all (a retracted cutover), and the guest may run
                // here still; what it missed must not reach it twice.
                tracing::warn!(%vm, "the VM is still routed to the pod it left: its missed packets are not sent again");
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let now = match self
            .kernel
            .tap_counters(std::path::Path::new(&pod.netns), tap, &pod.host_ifname)
            .await
        {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(%vm, error = %e, "cannot read the guest's tap after its cutover: its missed packets are not sent again");
                return;
            }
        };
        let unread = unread_since(start, now);
        let seen = held.seen();
        let packets = held.last(unread.min(seen) as usize);
        let lost = unread.saturating_sub(seen);
        let n = packets.len();
        match self.kernel.replay(packets).await {
            Ok(r) => {
                let mut st = lock(&self.stats);
                st.replayed += u64::from(r.sent);
                st.replay_skipped += u64::from(r.skipped) + lost;
                tracing::info!(%vm, unread, held = n, sent = r.sent, skipped = r.skipped, "sent again the packets the guest missed while it paused");
            }
            Err(e) => tracing::warn!(%vm, error = %e, "cannot send a guest's missed packets again"),
        }
    }

    /// The VM `vm` is no longer moving from here (its cutover, or the
    /// records gave it up): the leaving task ends with a last send.
    pub fn leaving_ends(&self, vm: &VmKey) {
        let leaving = {
            let mut st = lock(&self.state);
            let l = st.leaving.remove(vm);
            if let Some(l) = &l {
                st.ended.insert((vm.clone(), l.target.clone()));
            }
            l
        };
        if let Some(l) = leaving {
            let _ = l.events.send(());
        }
    }

    /// Before the route loop applies routes planned from `view` (the
    /// records, and the cutover notices it follows): pins the translations
    /// toward every VM that leaves this node in it, so that its rerouting
    /// keeps them.
    pub async fn before_reroute(&self, view: &VmView) {
        let moving: Vec<(VmKey, Vec<IpAddr>)> = lock(&self.state)
            .leaving
            .iter()
            .filter(|(k, l)| {
                !l.pinned
                    && view
                        .records
                        .get(*k)
                        .and_then(|(r, _)| r.active.as_ref())
                        .is_some_and(|a| a.node != self.me)
            })
            .map(|(k, l)| (k.clone(), l.ips.clone()))
            .collect();
        if moving.is_empty() {
            return;
        }
        let (vms, ips): (Vec<VmKey>, Vec<Vec<IpAddr>>) = moving.into_iter().unzip();
        self.pin_all(vms.clone(), ips.concat()).await;
        for vm in &vms {
            if let Some(l) = lock(&self.state).leaving.get_mut(vm) {
                l.pinned = true;
            }
            self.leaving_ends(vm);
        }
    }

    /// Pins the translations toward `vm` (see the module doc).
    pub async fn pin(&self, vm: &VmKey, ips: &[IpAddr]) {
        self.pin_all(vec![vm.clone()], ips.to_vec()).await;
    }

    /// Pins the translations toward `vms` (addresses `ips`). Pins asked
    /// for while a round runs are made together in the next one: each
    /// reads the whole flow table, and a burst of cutovers asks for many
    /// at once.
    async fn pin_all(&self, vms: Vec<VmKey>, ips: Vec<IpAddr>) {
        let (tx, rx) = oneshot::channel();
        {
            let mut q = lock(&self.pins);
            q.vms.extend(vms);
            q.ips.extend(ips);
            q.done.push(tx);
        }
        {
            let _round = self.pin_round.lock().await;
            // Whoever takes the round makes every pin queued by now, its
            // own among them unless an earlier round took it.
            let batch = std::mem::take(&mut *lock(&self.pins));
            if !batch.done.is_empty() {
                let vms = batch.vms;
                match self.kernel.pin_translations(&batch.ips).await {
                    Ok(0) => {}
                    Ok(n) => {
                        lock(&self.stats).pinned += u64::from(n);
                        tracing::info!(vms = ?vms.iter().map(ToString::to_string).collect::<Vec<_>>(), flows = n, "pinned the translations toward moving VMs");
                    }
                    Err(e) => {
                        tracing::warn!(vms = ?vms.iter().map(ToString::to_string).collect::<Vec<_>>(), error = %e, "cannot pin the translations toward moving VMs: connections that entered here may break")
                    }
                }
                for done in batch.done {
                    let _ = done.send(());
                }
            }
        }
        // Made in this round or an earlier one; or that round's task was
        // dropped half way, and there is nothing to wait for.
        let _ = rx.await;
    }

    /// Flows arrived from `from` (the datagram's source address).
    pub async fn on_flows<S: HandoverSide>(
        &self,
        side: &S,
        view: &VmView,
        d: FlowsDatagram,
        from: SocketAddr,
    ) {
        let Some((me_rec, overlay, cview)) = side.cluster() else {
            return;
        };
        let Some((sender, _)) = cview.nodes.get(&d.from) else {
            return;
        };
        if !sender.node_ips.contains(&from.ip().to_canonical()) {
            tracing::warn!(%from, node = %d.from, "flows from an address that is not that node's: ignored");
            return;
        }
        let Some((rec, _)) = view.records.get(&d.vm) else {
            return;
        };
        // The VM's pod is here, and the sender is where it runs (before the
        // cutover) or where it came from (after).
        let here = [&rec.active, &rec.alternate]
            .into_iter()
            .flatten()
            .any(|a| a.node == self.me && side.local_attachment(&key_of(a)).is_some());
        let from_source = rec.active.as_ref().is_some_and(|a| a.node == d.from)
            || rec.last_cutover.as_ref().is_some_and(|c| {
                c.from_node.as_deref() == Some(d.from.as_str()) && c.to_node == self.me
            });
        let n = d.flows.len() as u64;
        lock(&self.stats).flows_received += n;
        if !here || !from_source {
            lock(&self.stats).flows_refused += n;
            tracing::debug!(vm = %d.vm, from = %d.from, "flows for a VM this node does not take from that node");
            return;
        }
        let from_id = sender.id as u16;
        let landed: Vec<Flow> = d
            .flows
            .iter()
            .filter_map(|f| rec.ips.iter().find_map(|ip| f.landed(*ip, from_id)))
            .collect();
        lock(&self.stats).flows_refused += n - landed.len() as u64;
        for f in landed {
            let from_local_pod =
                !rec.ips.contains(&f.orig.src.ip()) && side.is_local_pod(f.orig.src.ip());
            self.install(&me_rec, &overlay, &cview, &d.vm, f, from_local_pod)
                .await;
        }
    }

    /// Creates a flow here, or sets its timeout anew when it is here (the
    /// source sends them every [`RESEND`]: a flow idle here until the
    /// cutover must not expire first; see the module doc).
    /// `from_local_pod`: a flow toward the VM that a pod of this node
    /// opened.
    async fn install(
        &self,
        me: &NodeRecord,
        overlay: &Overlay,
        cview: &ClusterView,
        vm: &VmKey,
        f: Flow,
        from_local_pod: bool,
    ) {
        let arrived = lock(&self.state)
            .arriving
            .entry(vm.clone())
            .or_default()
            .arrived;
        if let Some(anchor) = f.anchor() {
            if u32::from(anchor) == me.id {
                // Its translation is on this node: the flow is here as it was.
                return;
            }
            if !self.ensure_anchor(me, overlay, cview, anchor).await {
                return;
            }
        }
        if f.destination_translated() && f.anchor().is_none() {
            // Until every node reroutes the VM, the backend's answers may
            // still reach the node the VM left, which translates them back
            // and sends them here. Until the cutover, as long as the source
            // sends the flow again; after it, for the guard's while.
            let back = (f.proto, f.orig.inverse());
            let ttl = if arrived { GUARD_TTL } else { WAITING_TTL };
            if let Err(e) = self.kernel.pass_translated_back(&[back], ttl).await {
                tracing::warn!(%vm, error = %e, "cannot let a Service flow's translated answers pass");
            }
            if let Some(a) = lock(&self.state).arriving.get_mut(vm) {
                a.translated_back.insert(back);
            }
        }
        let created = self.kernel.create_flow(&f, arrived).await;
        let own = (f.proto, f.orig);
        match &created {
            Ok(FlowCreated::Refreshed) => {}
            Ok(FlowCreated::Created) => lock(&self.stats).flows_created += 1,
            Ok(FlowCreated::Replaced) => lock(&self.stats).flows_replaced += 1,
            Ok(FlowCreated::Exists) => {
                if let Some(a) = lock(&self.state).arriving.get_mut(vm) {
                    if !a.deferred.contains(&f) {
                        a.deferred.push(f.clone());
                    }
                }
                if !arrived && f.destination_translated() && f.anchor().is_none() {
                    // The VM's Service flow to a backend pod of this node,
                    // which forwards it until the cutover: once the VM runs
                    // here, a packet of its that came before the flow
                    // replaced that forwarding would start a flow of its own,
                    // to any backend, its port changed to clear the
                    // forwarding's answers. Held back until then.
                    if let Err(e) = self.kernel.hold_back(&[own], Some(WAITING_TTL)).await {
                        tracing::warn!(%vm, error = %e, "cannot hold back a migrated VM's Service flow");
                    }
                    if let Some(a) = lock(&self.state).arriving.get_mut(vm) {
                        a.held_back.insert(own);
                    }
                }
                if from_local_pod && !f.destination_translated() && !f.source_translated() {
                    // A pod of this node reaches the VM through this node's
                    // own translation (a ClusterIP's DNAT), which stays; the
                    // source saw the flow translated already, and the packets
                    // of the guest's pause it sends again come back so: they
                    // pass untracked rather than start a flow whose ports
                    // clash with this node's.
                    let ttl = if arrived { GUARD_TTL } else { WAITING_TTL };
                    if let Err(e) = self.kernel.pass_translated_back(&[own], ttl).await {
                        tracing::warn!(%vm, error = %e, "cannot let a pod's translated packets to a VM pass");
                    }
                    if let Some(a) = lock(&self.state).arriving.get_mut(vm) {
                        a.translated_back.insert(own);
                    }
                }
            }
            Err(e) => tracing::warn!(%vm, error = %e, "cannot create a migrated VM's flow"),
        }
        if arrived && !matches!(created, Ok(FlowCreated::Exists)) {
            self.release(vm, own).await;
        }
    }

    /// [`Handovers::install`] for the flows that waited for `vm`, which has
    /// arrived: in one round of kernel calls, not a few per flow, since
    /// the VM's local route waits for them (through KubeVirt, made one by
    /// one on a loaded node, they held it back 0.8 to 1.7 s). The caller
    /// lets their packets through after: nothing is released here.
    async fn install_arrived(
        &self,
        me: &NodeRecord,
        overlay: &Overlay,
        cview: &ClusterView,
        vm: &VmKey,
        flows: Vec<Flow>,
    ) {
        let mut here = Vec::with_capacity(flows.len());
        for f in flows {
            match f.anchor() {
                // Its translation is on this node: the flow is here as it was.
                Some(anchor) if u32::from(anchor) == me.id => {}
                Some(anchor) => {
                    if self.ensure_anchor(me, overlay, cview, anchor).await {
                        here.push(f);
                    }
                }
                None => here.push(f),
            }
        }
        if here.is_empty() {
            return;
        }
        // As in `install`: the backend's answers translated back by the
        // node the VM left pass, for the guard's while.
        let back: Vec<(u8, FlowEnds)> = here
            .iter()
            .filter(|f| f.destination_translated() && f.anchor().is_none())
            .map(|f| (f.proto, f.orig.inverse()))
            .collect();
        if !back.is_empty() {
            if let Err(e) = self.kernel.pass_translated_back(&back, GUARD_TTL).await {
                tracing::warn!(%vm, error = %e, "cannot let a Service flow's translated answers pass");
            }
            if let Some(a) = lock(&self.state).arriving.get_mut(vm) {
                a.translated_back.extend(back);
            }
        }
        let started = Instant::now();
        let made = self.kernel.create_flows(&here, true).await;
        tracing::info!(
            %vm,
            flows = here.len(),
            took_ms = started.elapsed().as_secs_f64() * 1e3,
            "made the flows that waited for the VM"
        );
        for (f, created) in here.into_iter().zip(made) {
            match created {
                Ok(FlowCreated::Refreshed) => {}
                Ok(FlowCreated::Created) => lock(&self.stats).flows_created += 1,
                Ok(FlowCreated::Replaced) => lock(&self.stats).flows_replaced += 1,
                Ok(FlowCreated::Exists) => {
                    if let Some(a) = lock(&self.state).arriving.get_mut(vm) {
                        if !a.deferred.contains(&f) {
                            a.deferred.push(f);
                        }
                    }
                }
                Err(e) => tracing::warn!(%vm, error = %e, "cannot create a migrated VM's flow"),
            }
        }
    }

    /// The VM's packets of direction `own` are no longer held back here:
    /// its flow is in place (or was never held).
    async fn release(&self, vm: &VmKey, own: (u8, FlowEnds)) {
        let held = lock(&self.state)
            .arriving
            .get_mut(vm)
            .is_some_and(|a| a.held_back.remove(&own));
        if held {
            if let Err(e) = self.kernel.hold_back(&[own], None).await {
                tracing::warn!(%vm, error = %e, "cannot stop holding back a migrated VM's Service flow");
            }
        }
    }

    /// Makes the rules that route flows anchored at node `id` there.
    async fn ensure_anchor(
        &self,
        me: &NodeRecord,
        overlay: &Overlay,
        cview: &ClusterView,
        id: u16,
    ) -> bool {
        if lock(&self.state).anchors.contains(&id) {
            return true;
        }
        let Some(name) = cview
            .nodes
            .values()
            .find(|(n, _)| n.id == u32::from(id))
            .map(|(n, _)| n.name.clone())
        else {
            tracing::warn!(
                node_id = id,
                "flows anchored at a node this node does not know"
            );
            return false;
        };
        let hops = hops_to(me, overlay, cview, &name);
        match self.kernel.ensure_anchor(id, &hops).await {
            Ok(()) => {
                lock(&self.state).anchors.insert(id);
                true
            }
            Err(e) => {
                tracing::warn!(node = %name, error = %e, "cannot route flows anchored at a node");
                false
            }
        }
    }

    /// The VM `vm` (addresses `ips`) has just cut over to this node: its
    /// addresses are guarded, and the flows that waited for it replace
    /// this node's (if [`Handovers::settle_flows`] has not yet).
    pub async fn arrived(
        &self,
        cluster: Option<(NodeRecord, Overlay, Arc<ClusterView>)>,
        vm: &VmKey,
        ips: &[IpAddr],
    ) {
        let back: Vec<(u8, FlowEnds)> = {
            let mut st = lock(&self.state);
            let a = st.arriving.entry(vm.clone()).or_default();
            a.translated_back.iter().copied().collect()
        };
        if let Err(e) = self.kernel.guard_moved(ips, GUARD_TTL).await {
            tracing::warn!(%vm, error = %e, "cannot guard a moved VM's connections");
        }
        if let Err(e) = self.kernel.pass_translated_back(&back, GUARD_TTL).await {
            tracing::warn!(%vm, error = %e, "cannot let a Service flow's translated answers pass");
        }
        self.settle_flows(cluster, vm).await;
    }

    /// This node is about to route VM `vm` to its pod here (its cutover):
    /// from now on the VM's flows are its own here, so those that collided
    /// with this node's wait no more. They replace what this node tracked
    /// of them before the route changes: a backend pod of this node answers
    /// the VM through the forwarding entry it had, which, once the VM is
    /// routed here, would hand the answers to the guest untranslated (and
    /// the guest would reset the connection). Then nothing of the VM's is
    /// held back any more.
    pub async fn settle_flows(
        &self,
        cluster: Option<(NodeRecord, Overlay, Arc<ClusterView>)>,
        vm: &VmKey,
    ) {
        let deferred = {
            let mut st = lock(&self.state);
            let a = st.arriving.entry(vm.clone()).or_default();
            a.arrived = true;
            std::mem::take(&mut a.deferred)
        };
        let Some((me, overlay, cview)) = cluster else {
            return;
        };
        self.install_arrived(&me, &overlay, &cview, vm, deferred)
            .await;
        // What is still held back waits for nothing any more: the flows
        // just made, and a flow another translation of this node's kept
        // out.
        let held: Vec<(u8, FlowEnds)> = lock(&self.state)
            .arriving
            .get_mut(vm)
            .map(|a| a.held_back.drain().collect())
            .unwrap_or_default();
        if !held.is_empty() {
            if let Err(e) = self.kernel.hold_back(&held, None).await {
                tracing::warn!(%vm, error = %e, "cannot stop holding back a migrated VM's Service flow");
            }
        }
    }

    /// Removes anchors no flow uses any more, and those (with their flows)
    /// of nodes that left the cluster (whose translations died with the
    /// node). Run periodically.
    pub async fn prune_anchors(&self, cview: &ClusterView) {
        let ids = match self.kernel.anchors().await {
            Ok(ids) => ids,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the anchor rules");
                return;
            }
        };
        for id in ids {
            let known = cview.nodes.values().any(|(n, _)| n.id == u32::from(id));
            let gone = if known {
                matches!(self.kernel.count_anchored(id).await, Ok(0))
            } else {
                match self.kernel.delete_anchored(id).await {
                    Ok(n) => {
                        if n > 0 {
                            tracing::warn!(node_id = id, flows = n, "a node that anchored migrated VMs' flows is gone: those connections end");
                        }
                        true
                    }
                    Err(e) => {
                        tracing::warn!(node_id = id, error = %e, "cannot delete a gone node's anchored flows");
                        false
                    }
                }
            };
            if gone {
                match self.kernel.remove_anchor(id).await {
                    Ok(()) => {
                        lock(&self.state).anchors.remove(&id);
                    }
                    Err(e) => tracing::warn!(node_id = id, error = %e, "cannot remove an anchor"),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
