//! What a VM's live migration asks of the kernel beyond its routes, so that
//! the VM's connections survive the move (docs/user/vm-connections.md has the
//! design and its limits):
//!
//! - **Flows.** Every connection of the VM lives in the conntrack table of
//!   the node it leaves, some with a translation made there (outbound
//!   NAT's masquerade, kube-proxy's DNAT to a Service's backend, a
//!   NodePort's DNAT and masquerade). They are read there
//!   ([`Handover::flows_of`]) and recreated on the node the VM lands on
//!   ([`Handover::create_flow`], after [`Flow::landed`]), so that no packet
//!   of an existing connection ever starts a new flow (and a new
//!   translation) there: a destination translation is made again as it
//!   was; a source translation stays where it is, and the flow is
//!   recreated untranslated and *anchored* at the node that holds it
//!   ([`anchor_mark`]): its packets are routed back there
//!   ([`Handover::ensure_anchor`]), so that the far end keeps seeing the
//!   address it knows.
//! - **Pinning.** The kernel drops a masqueraded flow whose packets leave
//!   through another device than the one they were first masqueraded out
//!   of, and a migration changes that device on both nodes for every
//!   connection toward the VM that entered there (a NodePort's). Before
//!   either node reroutes the VM, those flows are made again with the
//!   same translation, fixed instead of masqueraded
//!   ([`Handover::pin_translations`]), the VM's packets held off for the
//!   moment it takes.
//! - **The guard.** For a while after a VM arrived, a TCP packet of its
//!   that is no connection's first is never translated afresh: not
//!   masqueraded (it passes untranslated, [`NO_TRANSLATION_MARK`]), and
//!   dropped when it would get a new destination translation (its flow has
//!   not arrived yet; TCP sends it again) ([`Handover::guard_moved`]).
//! - **The packets of the pause** are held and sent again
//!   ([`crate::replay`]).
//!
//! All of it lives in the conntrack table, one nftables table of its own,
//! [`HANDOVER_TABLE`] ([`handover_script`]: its chains and sets, written
//! once at start; the sets' elements change over netlink), and policy
//! rules and routing tables in a range of their own
//! ([`ANCHOR_TABLE_BASE`]).

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::error::Result;
pub use crate::nat::NO_TRANSLATION_MARK;
use crate::replay::Replayed;
use crate::ClusterRoute;

/// tether's nftables tables for migrations (`nft list table inet
/// tether_vm`, and `ip`, `ip6` of the same name).
pub const HANDOVER_TABLE: &str = "tether_vm";

/// The bits of the packet and conntrack marks that name an anchoring node:
/// its cluster node ID (1 to 32767) shifted left by 16. tether owns the
/// marks' upper half, `0xffff0000` (kube-proxy uses `0x4000` and
/// `0x8000`; the top bit is [`NO_TRANSLATION_MARK`]).
pub const ANCHOR_MASK: u32 = 0x7fff_0000;
/// The routing table of anchoring node `id` is this plus `id`.
pub const ANCHOR_TABLE_BASE: u32 = 0x7474_0000;
/// The last routing table of the anchors' range.
pub const ANCHOR_TABLE_LAST: u32 = ANCHOR_TABLE_BASE + 0x7fff;
/// The priority of the anchors' policy rules: after `local`, before
/// `main`.
pub const ANCHOR_RULE_PRIORITY: u32 = 30000;
/// The route protocol of the anchors' routes.
pub const HANDOVER_ROUTE_PROTOCOL: u8 = 204;
/// How long [`Handover::pin_translations`] may hold a VM's packets off
/// at most, should the daemon die in the middle.
pub const FREEZE_LIMIT: Duration = Duration::from_millis(200);

/// TCP's conntrack state for an established connection
/// (`TCP_CONNTRACK_ESTABLISHED`).
pub const TCP_ESTABLISHED: u8 = 3;
/// IANA protocol numbers of the flows handed over.
pub const TCP: u8 = 6;
/// UDP.
pub const UDP: u8 = 17;

/// The conntrack mark of a flow anchored at node `id`.
pub fn anchor_mark(id: u16) -> u32 {
    (u32::from(id) << 16) & ANCHOR_MASK
}

/// The node a conntrack mark anchors at, if any.
pub fn anchor_of_mark(mark: u32) -> Option<u16> {
    let id = ((mark & ANCHOR_MASK) >> 16) as u16;
    (id != 0).then_some(id)
}

/// The routing table of anchoring node `id`.
pub fn anchor_table(id: u16) -> u32 {
    ANCHOR_TABLE_BASE + u32::from(id)
}

/// One direction of a tracked flow: its addresses and ports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FlowEnds {
    /// The source.
    pub src: SocketAddr,
    /// The destination.
    pub dst: SocketAddr,
}

impl FlowEnds {
    /// The other direction of an untranslated flow.
    pub fn inverse(&self) -> FlowEnds {
        FlowEnds {
            src: self.dst,
            dst: self.src,
        }
    }
}

/// A TCP or UDP flow as conntrack holds it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Flow {
    /// [`TCP`] or [`UDP`].
    pub proto: u8,
    /// The direction of the flow's first packet.
    pub orig: FlowEnds,
    /// The direction of its answers, after the translations: a source
    /// translation shows as `reply.dst` differing from `orig.src`, a
    /// destination translation as `reply.src` differing from `orig.dst`.
    pub reply: FlowEnds,
    /// The conntrack mark.
    pub mark: u32,
    /// Seconds left before the flow expires unless a packet renews it.
    pub timeout_secs: u32,
    /// TCP's conntrack state (see [`TCP_ESTABLISHED`]); None for UDP.
    pub tcp_state: Option<u8>,
}

impl Flow {
    /// Whether its source is translated (masquerade or SNAT).
    pub fn source_translated(&self) -> bool {
        self.reply.dst != self.orig.src
    }

    /// Whether its destination is translated (DNAT).
    pub fn destination_translated(&self) -> bool {
        self.reply.src != self.orig.dst
    }

    /// The node the flow is anchored at, if any.
    pub fn anchor(&self) -> Option<u16> {
        anchor_of_mark(self.mark)
    }

    /// The flow as the node VM `vm` (one of its addresses) lands on
    /// creates it, the VM having left node `from`; None for a flow that is
    /// not the VM's. See the module doc:
    /// - one the VM opened: a source translation (or a flow anchored
    ///   already, a VM that moves again) becomes an untranslated flow
    ///   anchored at the node that holds the translation (an earlier
    ///   anchor's, so that a flow never passes through a node that only
    ///   forwarded it); a destination translation alone is recreated as it
    ///   is; an untranslated one as it is;
    /// - one opened toward the VM: as its packets arrive at the VM's node
    ///   once translated (a NodePort's after its DNAT and masquerade),
    ///   untranslated.
    pub fn landed(&self, vm: IpAddr, from: u16) -> Option<Flow> {
        let opened = self.orig.src.ip() == vm;
        let toward = self.reply.src.ip() == vm;
        match (opened, toward) {
            (true, false) if self.source_translated() || self.anchor().is_some() => Some(Flow {
                reply: self.orig.inverse(),
                mark: anchor_mark(self.anchor().unwrap_or(from)),
                ..self.clone()
            }),
            (true, false) => Some(Flow {
                mark: 0,
                ..self.clone()
            }),
            (false, true) => Some(Flow {
                orig: self.reply.inverse(),
                mark: 0,
                ..self.clone()
            }),
            // Not the VM's, or the VM to itself through a Service.
            _ => None,
        }
    }
}

/// What creating a flow did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlowCreated {
    /// It is in the table now.
    Created,
    /// It was there already, as it is: its timeout was set anew.
    Refreshed,
    /// An entry holds one of its directions already, and was left alone.
    Exists,
    /// An entry held one of its directions; it was deleted first.
    Replaced,
}

/// What a source reads of its guest's tap at the cutover (see
/// [`crate::replay`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TapCounters {
    /// Packets the node sent down the pod's veth (its transmit counter).
    pub sent: u64,
    /// Packets the guest's QEMU read from the tap (the tap's transmit
    /// counter counts what its reader takes).
    pub read: u64,
}

/// The `nft -f -` script of the handover table, which replaces it whole
/// (see the module doc).
pub fn handover_script() -> String {
    let t = format!("inet {HANDOVER_TABLE}");
    let m = format!("{NO_TRANSLATION_MARK:#x}");
    let a = format!("{ANCHOR_MASK:#x}");
    let mid_stream = "tcp flags & (syn | ack) != syn";
    let mut s = handover_removal_script();
    s.push_str(&format!(
        "table {t} {{
  set moved_v4 {{ type ipv4_addr; flags timeout; }}
  set moved_v6 {{ type ipv6_addr; flags timeout; }}
  set frozen_v4 {{ type ipv4_addr . ipv4_addr . inet_proto . inet_service; flags timeout; }}
  set frozen_v6 {{ type ipv6_addr . ipv6_addr . inet_proto . inet_service; flags timeout; }}
  set translated_back_v4 {{ type ipv4_addr . ipv4_addr . inet_proto . inet_service . inet_service; flags timeout; }}
  set translated_back_v6 {{ type ipv6_addr . ipv6_addr . inet_proto . inet_service . inet_service; flags timeout; }}
  set held_back_v4 {{ type ipv4_addr . ipv4_addr . inet_proto . inet_service . inet_service; flags timeout; }}
  set held_back_v6 {{ type ipv6_addr . ipv6_addr . inet_proto . inet_service . inet_service; flags timeout; }}
  chain raw_in {{
    type filter hook prerouting priority raw; policy accept;
    ip saddr . ip daddr . meta l4proto . th dport @frozen_v4 drop
    ip6 saddr . ip6 daddr . meta l4proto . th dport @frozen_v6 drop
    ip saddr . ip daddr . meta l4proto . th sport . th dport @translated_back_v4 notrack
    ip6 saddr . ip6 daddr . meta l4proto . th sport . th dport @translated_back_v6 notrack
    ip saddr . ip daddr . meta l4proto . th sport . th dport @held_back_v4 drop
    ip6 saddr . ip6 daddr . meta l4proto . th sport . th dport @held_back_v6 drop
  }}
  chain raw_out {{
    type filter hook output priority raw; policy accept;
    meta mark & {m} == {m} notrack
    ip saddr . ip daddr . meta l4proto . th dport @frozen_v4 drop
    ip6 saddr . ip6 daddr . meta l4proto . th dport @frozen_v6 drop
  }}
  chain anchor {{
    type filter hook prerouting priority mangle; policy accept;
    ct direction original ct mark & {a} != 0 meta mark set ct mark & {a}
  }}
  chain untranslated {{
    type filter hook postrouting priority srcnat - 1; policy accept;
    ct state new ip saddr @moved_v4 {mid_stream} meta mark set meta mark | {m}
    ct state new ip6 saddr @moved_v6 {mid_stream} meta mark set meta mark | {m}
  }}
  chain guard {{
    type filter hook postrouting priority srcnat + 1; policy accept;
    ct state new ct status dnat ip saddr @moved_v4 {mid_stream} counter drop
    ct state new ct status dnat ip6 saddr @moved_v6 {mid_stream} counter drop
  }}
}}
"
    ));
    s
}

/// The script that removes the handover table, whether or not it exists.
pub fn handover_removal_script() -> String {
    let t = format!("inet {HANDOVER_TABLE}");
    format!("table {t}\ndelete table {t}\n")
}

/// Of `all`, the flows `ip` opened (its first direction's source is `ip`)
/// and those toward it (their answers come from `ip`; a mirror of one of
/// its own flows, see [`mirrors_one_of`], is left out).
pub fn flows_at(all: &[Flow], ip: IpAddr) -> (Vec<Flow>, Vec<Flow>) {
    let opened: Vec<Flow> = all
        .iter()
        .filter(|f| f.orig.src.ip() == ip)
        .cloned()
        .collect();
    let toward = all
        .iter()
        .filter(|f| f.reply.src.ip() == ip && f.orig.src.ip() != ip && !mirrors_one_of(f, &opened))
        .cloned()
        .collect();
    (opened, toward)
}

/// Of `all`, every flow of `ip`: those it opened, then those toward it
/// (see [`flows_at`]).
pub fn all_flows_at(all: &[Flow], ip: IpAddr) -> Vec<Flow> {
    let (mut flows, toward) = flows_at(all, ip);
    flows.extend(toward);
    flows
}

/// Whether `toward`, a flow toward a VM, mirrors one of the flows the VM
/// opened (`opened`): its first direction is that flow's own, reversed.
/// One connection is one entry, so such a second one is no connection: it
/// is an answer of the VM's translated flow that reached a node already
/// translated back (by the node that translated it) and that conntrack
/// tracked afresh, changing a port to clear the VM's entry. It is never
/// sent to a target, nor pinned: making it again would delete the VM's
/// own flow, whose direction it holds reversed, and the VM's next packet
/// would be translated afresh.
pub fn mirrors_one_of(toward: &Flow, opened: &[Flow]) -> bool {
    opened
        .iter()
        .any(|o| o.proto == toward.proto && o.orig == toward.orig.inverse())
}

/// One change of the flow table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FlowChange {
    /// A flow was made, or changed (its state, its mark).
    Made(Flow),
    /// A flow ended.
    Gone(Flow),
}

impl FlowChange {
    /// The flow made, changed or ended.
    pub fn flow(&self) -> &Flow {
        match self {
            FlowChange::Made(f) | FlowChange::Gone(f) => f,
        }
    }
}

/// What a feed kept since it was last asked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FlowChanges {
    /// The changes, oldest first.
    pub changes: Vec<FlowChange>,
    /// Whether the feed lost changes meanwhile: the table must be read
    /// again.
    pub lost: bool,
}

/// A feed of the flow table's changes, from the moment it was opened
/// (see [`Handover::watch_flows`] and [`crate::flow_watch`]). It stops when dropped.
pub trait FlowFeed: Send {
    /// Keeps, from now on, only the changes of flows that touch one of
    /// `ips` (see [`touches`]).
    fn track(&mut self, ips: &BTreeSet<IpAddr>);

    /// The changes kept since the last call.
    fn take(&mut self) -> FlowChanges;
}

/// Whether `f` is a flow of one of `ips`: one of them opened it, or it was
/// opened toward one of them (its answers come from it).
pub fn touches(f: &Flow, ips: &BTreeSet<IpAddr>) -> bool {
    ips.contains(&f.orig.src.ip()) || ips.contains(&f.reply.src.ip())
}

/// The kernel side of a VM's handover between nodes (see the module doc).
#[async_trait]
pub trait Handover: Send + Sync {
    /// Every TCP and UDP flow of address `ip`: that it opened (original
    /// source), or that was opened toward it (the reply's source).
    async fn flows_of(&self, ip: IpAddr) -> Result<Vec<Flow>>;

    /// [`Handover::flows_of`] for each of `ips`, in order, from one read of
    /// the flow table. A read costs the kernel a walk of its whole flow
    /// hash table, shared by every network namespace, however few flows
    /// this one holds (6.5 ms of system time for 262,144 buckets and no
    /// flow, on the bench machine): a node that sends many leaving VMs'
    /// flows reads the table once for them all.
    async fn flows_of_each(&self, ips: &[IpAddr]) -> Result<Vec<Vec<Flow>>> {
        let mut each = Vec::with_capacity(ips.len());
        for ip in ips {
            each.push(self.flows_of(*ip).await?);
        }
        Ok(each)
    }

    /// A feed of the flow table's changes (conntrack's events), opened in
    /// the caller's network namespace, for a [`crate::flow_watch::FlowWatch`]
    /// that follows a few addresses' flows without walking the table each
    /// time. An error says why there is none (the watch is then not made,
    /// and its user walks the table as before).
    fn watch_flows(&self) -> Result<Box<dyn FlowFeed>> {
        Err(crate::error::KernelError::Internal(
            "this kernel has no feed of the flow table's changes".into(),
        ))
    }

    /// Creates `flow` as established, with its translations made anew
    /// (fixed, not masqueraded). The same flow there already gets its
    /// timeout set anew. Another entry holding either direction is left
    /// alone; with `replace`, an untranslated one is deleted first (a
    /// translated one is this node's own translation of the flow, and
    /// stays).
    async fn create_flow(&self, flow: &Flow, replace: bool) -> Result<FlowCreated>;

    /// [`Handover::create_flow`] for each of `flows`, in one go: the
    /// outcome of each, in order. A VM's cutover waits for the flows that
    /// waited for it, so a kernel makes them in one round rather than one
    /// call each.
    async fn create_flows(&self, flows: &[Flow], replace: bool) -> Vec<Result<FlowCreated>> {
        let mut made = Vec::with_capacity(flows.len());
        for f in flows {
            made.push(self.create_flow(f, replace).await);
        }
        made
    }

    /// Makes every source-translated flow toward `vm` (its addresses)
    /// again with the same translations, fixed instead of masqueraded,
    /// holding the VM's packets off meanwhile; how many (see the module
    /// doc).
    async fn pin_translations(&self, vm: &[IpAddr]) -> Result<u32>;

    /// How many flows are anchored at node `id`.
    async fn count_anchored(&self, id: u16) -> Result<u32>;

    /// Deletes every flow anchored at node `id` (it is gone); how many.
    async fn delete_anchored(&self, id: u16) -> Result<u32>;

    /// Routes packets of flows anchored at node `id` through `via` (one
    /// route per family, as to the node's blocks): its policy rules and
    /// table, made or replaced.
    async fn ensure_anchor(&self, id: u16, via: &[ClusterRoute]) -> Result<()>;

    /// Removes node `id`'s anchor rules and table; none is success.
    async fn remove_anchor(&self, id: u16) -> Result<()>;

    /// The nodes this node has anchor rules for.
    async fn anchors(&self) -> Result<Vec<u16>>;

    /// Guards `vm`'s addresses for `ttl` (see the module doc).
    async fn guard_moved(&self, vm: &[IpAddr], ttl: Duration) -> Result<()>;

    /// For `ttl` from now (from now again when they are there already),
    /// lets packets of these directions (protocol, ends) pass untracked:
    /// the answers of a Service flow recreated here, translated back
    /// already by the node the VM left (its flow's answers took it until
    /// their sender's node rerouted the VM).
    async fn pass_translated_back(
        &self,
        directions: &[(u8, FlowEnds)],
        ttl: Duration,
    ) -> Result<()>;

    /// For `ttl` from now (from now again when they are there already),
    /// drops packets of these directions (protocol, ends) before conntrack
    /// sees them; with `None`, no longer. For a flow the VM opened whose
    /// recreation here waits for the cutover (this node forwards it
    /// meanwhile, to a backend pod of its own): a packet of the VM's that
    /// came first would start a flow and a translation of its own.
    async fn hold_back(&self, directions: &[(u8, FlowEnds)], ttl: Option<Duration>) -> Result<()>;

    /// Starts holding what the node sends down node-side veth
    /// `host_ifname` ([`crate::replay::Capture`]).
    async fn capture(&self, host_ifname: &str) -> Result<Box<dyn Held>>;

    /// The counters of the guest's tap `tap` in the pod netns at `netns`,
    /// whose node-side veth is `host_ifname`.
    async fn tap_counters(&self, netns: &Path, tap: &str, host_ifname: &str)
        -> Result<TapCounters>;

    /// Whether the node routes `ip` to the link `host_ifname`.
    async fn routes_to_link(&self, ip: IpAddr, host_ifname: &str) -> Result<bool>;

    /// Sends `packets` again ([`crate::replay::Replayer`]).
    async fn replay(&self, packets: Vec<Vec<u8>>) -> Result<Replayed>;
}

/// Packets held by a capture (see [`crate::replay`]).
pub trait Held: Send + Sync {
    /// How many packets were captured since the start.
    fn seen(&self) -> u64;
    /// The last `n` held, oldest first.
    fn last(&self, n: usize) -> Vec<Vec<u8>>;
}

impl Held for crate::replay::Capture {
    fn seen(&self) -> u64 {
        crate::replay::Capture::seen(self)
    }
    fn last(&self, n: usize) -> Vec<Vec<u8>> {
        crate::replay::Capture::last(self, n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ends(src: &str, dst: &str) -> FlowEnds {
        FlowEnds {
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
        }
    }

    fn flow(orig: FlowEnds, reply: FlowEnds, mark: u32) -> Flow {
        Flow {
            proto: TCP,
            orig,
            reply,
            mark,
            timeout_secs: 300,
            tcp_state: Some(TCP_ESTABLISHED),
        }
    }

    #[test]
    fn an_anchor_mark_holds_a_node_id_in_the_upper_half_and_leaves_kube_proxys_bits() {
        assert_eq!(anchor_mark(1), 0x0001_0000);
        assert_eq!(anchor_mark(32767), 0x7fff_0000);
        assert_eq!(anchor_of_mark(anchor_mark(42) | 0x4000), Some(42));
        assert_eq!(anchor_of_mark(0x4000 | 0x8000), None);
        assert_eq!(anchor_of_mark(NO_TRANSLATION_MARK), None);
        assert_eq!(anchor_table(3), 0x7474_0003);
        assert_eq!(anchor_table(32767), ANCHOR_TABLE_LAST);
    }

    #[test]
    fn an_untranslated_flow_lands_as_it_is() {
        let f = flow(
            ends("10.244.0.5:40000", "10.244.2.7:9000"),
            ends("10.244.2.7:9000", "10.244.0.5:40000"),
            0,
        );
        assert_eq!(f.landed("10.244.0.5".parse().unwrap(), 7), Some(f.clone()));
    }

    fn vm() -> IpAddr {
        "10.244.0.5".parse().unwrap()
    }

    #[test]
    fn a_masqueraded_flow_lands_untranslated_and_anchored_at_the_node_it_left() {
        let f = flow(
            ends("10.244.0.5:40000", "10.77.0.200:8000"),
            ends("10.77.0.200:8000", "10.77.0.21:40000"),
            0,
        );
        assert!(f.source_translated() && !f.destination_translated());
        let landed = f.landed(vm(), 7).unwrap();
        assert_eq!(landed.orig, f.orig);
        assert_eq!(landed.reply, f.orig.inverse());
        assert_eq!(landed.anchor(), Some(7));
    }

    #[test]
    fn a_service_flow_lands_with_its_destination_translation_and_no_anchor() {
        let f = flow(
            ends("10.244.0.5:40000", "10.96.0.10:9100"),
            ends("10.244.1.9:9100", "10.244.0.5:40000"),
            0,
        );
        assert!(!f.source_translated() && f.destination_translated());
        let landed = f.landed(vm(), 7).unwrap();
        assert_eq!(landed.reply, f.reply);
        assert_eq!(landed.anchor(), None);
    }

    #[test]
    fn a_flow_anchored_already_keeps_its_anchor_when_the_vm_moves_again() {
        let f = flow(
            ends("10.244.0.5:40000", "10.77.0.200:8000"),
            ends("10.77.0.200:8000", "10.244.0.5:40000"),
            anchor_mark(3),
        );
        assert!(!f.source_translated());
        assert_eq!(f.landed(vm(), 9).unwrap().anchor(), Some(3));
    }

    #[test]
    fn a_nodeport_flow_toward_the_vm_lands_as_its_packets_reach_the_vm() {
        // Entered at 10.77.0.21:31000, DNAT to the VM, masqueraded.
        let f = flow(
            ends("10.77.0.200:50000", "10.77.0.21:31000"),
            ends("10.244.0.5:7000", "10.77.0.21:61000"),
            0,
        );
        let landed = f.landed(vm(), 7).unwrap();
        assert_eq!(landed.orig, ends("10.77.0.21:61000", "10.244.0.5:7000"));
        assert_eq!(landed.reply, f.reply);
        assert!(!landed.source_translated() && !landed.destination_translated());
        assert_eq!(landed.anchor(), None);
    }

    #[test]
    fn flows_not_the_vms_or_to_itself_do_not_land() {
        let other = flow(
            ends("10.244.0.6:40000", "10.244.2.7:9000"),
            ends("10.244.2.7:9000", "10.244.0.6:40000"),
            0,
        );
        assert_eq!(other.landed(vm(), 7), None);
        let hairpin = flow(
            ends("10.244.0.5:40000", "10.96.0.10:7000"),
            ends("10.244.0.5:7000", "10.96.0.1:40000"),
            0,
        );
        assert_eq!(hairpin.landed(vm(), 7), None);
    }

    #[test]
    fn the_script_replaces_the_table_and_marks_what_it_leaves_untranslated() {
        let s = handover_script();
        assert!(
            s.starts_with("table inet tether_vm\ndelete table inet tether_vm\n"),
            "{s}"
        );
        assert!(
            s.contains("meta mark & 0x80000000 == 0x80000000 notrack"),
            "{s}"
        );
        assert!(
            s.contains("ct mark & 0x7fff0000 != 0 meta mark set ct mark & 0x7fff0000"),
            "{s}"
        );
        assert!(s.contains("ct status dnat ip saddr @moved_v4"), "{s}");
        assert!(s.contains("meta mark set meta mark | 0x80000000"), "{s}");
        assert!(s.contains("th sport . th dport @held_back_v4 drop"), "{s}");
    }
}
