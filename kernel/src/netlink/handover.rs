//! The real [`Handover`]: conntrack and nftables set elements over
//! netfilter netlink (`NETLINK_NETFILTER`, through netlink-packet-netfilter's
//! messages and a blocking socket of its own), policy rules and routes over
//! the node's rtnetlink connection, and the taps' counters over rtnetlink
//! sockets opened in the pod netns.
//!
//! Why blocking sockets here: an nftables change is a batch (begin, the
//! changes, end) that the kernel takes only in one `sendmsg`, which the
//! request-and-answer connection of netlink-proto does not send; and every
//! call here is a few messages that the kernel answers at once, run on
//! tokio's blocking pool.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::TryStreamExt;
use netlink_packet_netfilter::conntrack::{
    ConntrackAttribute, ConntrackMessage, IPTuple, ProtoInfo, ProtoInfoTCP, ProtoTuple, Protocol,
    Status, TCPFlags, Tuple,
};
use netlink_packet_netfilter::nftables::{
    DataAttribute, ListAttribute, NfTablesMessage, SetElementAttribute, SetElementList,
    SetElementMessage,
};
use netlink_packet_netfilter::none::ControlMessage;
use netlink_packet_netfilter::{
    NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily,
};
use rtnetlink::packet_core::{
    DefaultNla, NetlinkHeader, NetlinkMessage, NetlinkPayload, NLA_F_NESTED, NLM_F_ACK,
    NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REQUEST,
};
use rtnetlink::packet_route::link::{LinkAttribute, LinkMessage};
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteFlags, RouteHeader, RouteMessage, RouteProtocol, RouteScope,
    RouteType,
};
use rtnetlink::packet_route::rule::{RuleAttribute, RuleMessage};
use rtnetlink::packet_route::{AddressFamily, RouteNetlinkMessage};
use rtnetlink::sys::{protocols, Socket, SocketAddr as NetlinkAddr};
use rtnetlink::{Handle, IpVersion};

use super::messages::{self, errno, reason};
use super::netns::{open_netns, spawn_in_netns};
use super::nf_read::{flow_of, messages_in};
use crate::error::{KernelError, Result};
use crate::handover::{
    all_flows_at, anchor_mark, anchor_of_mark, anchor_table, flows_at, Flow, FlowCreated, FlowEnds,
    Handover, Held, TapCounters, ANCHOR_MASK, ANCHOR_RULE_PRIORITY, ANCHOR_TABLE_BASE,
    ANCHOR_TABLE_LAST, FREEZE_LIMIT, HANDOVER_ROUTE_PROTOCOL, HANDOVER_TABLE, TCP,
};
use crate::replay::{Capture, Replayed, Replayer};
use crate::ClusterRoute;

// ctnetlink's attributes the crate has no type for (linux/netfilter/
// nfnetlink_conntrack.h).
const CTA_NAT_SRC: u16 = 6;
const CTA_NAT_DST: u16 = 13;
const CTA_MARK_MASK: u16 = 21;
const CTA_NAT_V4_MINIP: u16 = 1;
const CTA_NAT_V4_MAXIP: u16 = 2;
const CTA_NAT_PROTO: u16 = 3;
const CTA_NAT_V6_MINIP: u16 = 4;
const CTA_NAT_V6_MAXIP: u16 = 5;
const CTA_PROTONAT_PORT_MIN: u16 = 1;
const CTA_PROTONAT_PORT_MAX: u16 = 2;
/// `IP_CT_TCP_FLAG_BE_LIBERAL`: conntrack does not judge the windows of a
/// connection whose start it never saw (as for one it picks up mid-stream).
const TCP_FLAG_BE_LIBERAL: u8 = 0x08;
/// nftables' subsystem id, which a batch's begin and end carry.
const NFNL_SUBSYS_NFTABLES: u16 = 10;
/// How much of a dump one read takes.
const RECV_BUF: usize = 1 << 16;
/// The most set elements one nftables batch carries. A pin of a VM that
/// thousands of NodePort tries reached has an element per try: in one
/// datagram they were too long for the socket (`EMSGSIZE` at 4,000), or
/// their acknowledgements overran its receive buffer (`ENOBUFS` at 1,500).
const ELEMENTS_PER_BATCH: usize = 256;
/// How long one read of the netfilter socket may wait: an answer the
/// kernel dropped must fail the operation, not hold the socket (and every
/// operation after it) for ever.
const RECV_TIMEOUT: Duration = Duration::from_secs(10);

/// A netlink attribute, in the kernel's layout: length and type in host
/// order, the value, padding to 4 bytes.
fn nla(kind: u16, value: &[u8]) -> Vec<u8> {
    let len = 4 + value.len();
    let mut out = Vec::with_capacity((len + 3) & !3);
    out.extend_from_slice(&(len as u16).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(value);
    out.resize((len + 3) & !3, 0);
    out
}

/// Sets `NLA_F_NESTED` on the top-level attributes of kinds `kinds` of one
/// serialized ctnetlink message. The crate's `Other` attributes cannot
/// carry the flag (it is taken from the attribute's own kind); the NAT
/// attributes are nested ones, and are marked so.
fn mark_nested(message: &mut [u8], kinds: &[u16]) {
    // The netlink header (16 bytes), then nfgenmsg (4).
    let mut at = 20;
    while at + 4 <= message.len() {
        let len = u16::from_ne_bytes([message[at], message[at + 1]]) as usize;
        if len < 4 || at + len > message.len() {
            return;
        }
        let kind = u16::from_ne_bytes([message[at + 2], message[at + 3]]);
        if kinds.contains(&(kind & !NLA_F_NESTED)) {
            message[at + 2..at + 4].copy_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
        }
        at += (len + 3) & !3;
    }
}

fn ip_bytes(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    }
}

fn nfproto(ip: IpAddr) -> NetfilterProtoFamily {
    match ip {
        IpAddr::V4(_) => NetfilterProtoFamily::IPv4,
        IpAddr::V6(_) => NetfilterProtoFamily::IPv6,
    }
}

/// `CTA_NAT_DST` (or `CTA_NAT_SRC`, `kind`) translating that end to `to`.
fn nat_to(kind: u16, to: SocketAddr) -> ConntrackAttribute {
    let (min, max) = match to.ip() {
        IpAddr::V4(_) => (CTA_NAT_V4_MINIP, CTA_NAT_V4_MAXIP),
        IpAddr::V6(_) => (CTA_NAT_V6_MINIP, CTA_NAT_V6_MAXIP),
    };
    let port = to.port().to_be_bytes();
    let mut value = nla(min, &ip_bytes(to.ip()));
    value.extend(nla(max, &ip_bytes(to.ip())));
    let mut proto = nla(CTA_PROTONAT_PORT_MIN, &port);
    proto.extend(nla(CTA_PROTONAT_PORT_MAX, &port));
    value.extend(nla(CTA_NAT_PROTO | NLA_F_NESTED, &proto));
    ConntrackAttribute::Other(DefaultNla::new(kind, value))
}

fn tuple(proto: u8, ends: &FlowEnds) -> Vec<Tuple> {
    vec![
        Tuple::Ip(vec![
            IPTuple::SourceAddress(ends.src.ip()),
            IPTuple::DestinationAddress(ends.dst.ip()),
        ]),
        Tuple::Proto(vec![
            ProtoTuple::Protocol(Protocol::from(proto)),
            ProtoTuple::SourcePort(ends.src.port()),
            ProtoTuple::DestinationPort(ends.dst.port()),
        ]),
    ]
}

/// One blocking netfilter netlink socket (see the module doc).
struct NfSocket {
    socket: Socket,
    seq: u32,
    /// Whether a send or a read failed: answers may be missing or left
    /// over, so the socket is not used again.
    broken: bool,
}

/// What one exchange on the socket returned.
struct Answer {
    messages: Vec<NetfilterMessage>,
}

impl NfSocket {
    fn open() -> std::io::Result<NfSocket> {
        let mut socket = Socket::new(protocols::NETLINK_NETFILTER)?;
        socket.bind_auto()?;
        socket.connect(&NetlinkAddr::new(0, 0))?;
        let timeout = nix::sys::time::TimeVal::new(RECV_TIMEOUT.as_secs() as _, 0);
        nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::ReceiveTimeout, &timeout)
            .map_err(std::io::Error::from)?;
        Ok(NfSocket {
            socket,
            seq: 0,
            broken: false,
        })
    }

    /// Sends `messages` in one datagram and reads until every one that asks
    /// for an answer (an acknowledgement, or a dump's end) has it. The first
    /// error the kernel reported is returned (as a positive errno) once
    /// every answer is in.
    fn exchange(
        &mut self,
        messages: Vec<NetlinkMessage<NetfilterMessage>>,
    ) -> std::result::Result<Answer, i32> {
        let mut buf = Vec::new();
        let mut waiting = BTreeSet::new();
        for mut m in messages {
            self.seq = self.seq.wrapping_add(1);
            m.header.sequence_number = self.seq;
            m.finalize();
            if m.header.flags & (NLM_F_ACK | NLM_F_DUMP) != 0 {
                waiting.insert(self.seq);
            }
            let start = buf.len();
            buf.resize(start + m.buffer_len(), 0);
            m.serialize(&mut buf[start..]);
            if matches!(&m.payload, NetlinkPayload::InnerMessage(n) if matches!(n.inner, NetfilterMessageInner::Conntrack(_)))
            {
                mark_nested(&mut buf[start..], &[CTA_NAT_DST, CTA_NAT_SRC]);
            }
        }
        if let Err(e) = self.socket.send(&buf, 0) {
            self.broken = true;
            return Err(e.raw_os_error().unwrap_or(libc::EIO));
        }
        let mut answer = Answer {
            messages: Vec::new(),
        };
        let mut first_error = None;
        let mut rbuf: Vec<u8> = Vec::with_capacity(RECV_BUF);
        while !waiting.is_empty() {
            rbuf.clear();
            let n = match self.socket.recv(&mut rbuf, 0) {
                Ok(n) => n,
                Err(e) => {
                    self.broken = true;
                    return Err(e.raw_os_error().unwrap_or(libc::EIO));
                }
            };
            for msg in messages_in(&rbuf[..n]) {
                let seq = msg.header.sequence_number;
                match msg.payload {
                    NetlinkPayload::Done(_) => {
                        waiting.remove(&seq);
                    }
                    NetlinkPayload::Error(e) => {
                        waiting.remove(&seq);
                        if let Some(code) = e.code {
                            first_error.get_or_insert(-code.get());
                        }
                    }
                    NetlinkPayload::InnerMessage(m) => answer.messages.push(m),
                    _ => {}
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(answer),
        }
    }
}

fn message(
    family: NetfilterProtoFamily,
    res_id: u16,
    inner: impl Into<NetfilterMessageInner>,
    flags: u16,
) -> NetlinkMessage<NetfilterMessage> {
    let mut m = NetlinkMessage::from(NetfilterMessage::new(
        NetfilterHeader::new(family, 0, res_id),
        inner,
    ));
    m.header.flags = NLM_F_REQUEST | flags;
    m
}

/// An nftables batch: begin, `changes`, end.
fn batch(changes: Vec<NetlinkMessage<NetfilterMessage>>) -> Vec<NetlinkMessage<NetfilterMessage>> {
    let mut all = vec![message(
        NetfilterProtoFamily::Unspec,
        NFNL_SUBSYS_NFTABLES,
        ControlMessage::BatchBegin,
        0,
    )];
    all.extend(changes);
    all.push(message(
        NetfilterProtoFamily::Unspec,
        NFNL_SUBSYS_NFTABLES,
        ControlMessage::BatchEnd,
        0,
    ));
    all
}

/// The timeout of an element added only to be removed in the same batch
/// (see [`direction_elements`]): should the removal not happen, it lapses.
const ENSURED_TTL: Duration = Duration::from_secs(1);

/// One element of a set of the handover table, with a timeout when given.
fn element(
    set: &str,
    key: IpAddr,
    timeout: Option<Duration>,
    add: bool,
) -> NetlinkMessage<NetfilterMessage> {
    set_element(set, ip_bytes(key), timeout, add)
}

fn set_element(
    set: &str,
    key: Vec<u8>,
    timeout: Option<Duration>,
    add: bool,
) -> NetlinkMessage<NetfilterMessage> {
    let mut attrs = vec![SetElementAttribute::Key(DataAttribute::Value(key))];
    if let Some(t) = timeout {
        attrs.push(SetElementAttribute::Timeout(t.as_millis() as u64));
    }
    let list = SetElementMessage {
        attributes: vec![
            SetElementList::Table(HANDOVER_TABLE.to_owned()),
            SetElementList::Set(set.to_owned()),
            SetElementList::Elements(vec![ListAttribute::Element(attrs)]),
        ],
    };
    let inet = NetfilterProtoFamily::Inet;
    if add {
        message(
            inet,
            0,
            NfTablesMessage::NewSetElement(list),
            NLM_F_CREATE | NLM_F_ACK,
        )
    } else {
        message(inet, 0, NfTablesMessage::DeleteSetElement(list), NLM_F_ACK)
    }
}

/// One element of a set of flow directions (source and destination
/// address, protocol, destination port), as nftables lays a concatenation
/// out: each part in registers of 4 bytes.
fn flow_element(
    set: &str,
    ends: &FlowEnds,
    proto: u8,
    timeout: Option<Duration>,
    add: bool,
) -> NetlinkMessage<NetfilterMessage> {
    let mut key = ip_bytes(ends.src.ip());
    key.extend(ip_bytes(ends.dst.ip()));
    key.extend([proto, 0, 0, 0]);
    key.extend(ends.dst.port().to_be_bytes());
    key.extend([0, 0]);
    set_element(set, key, timeout, add)
}

/// The changes that put `directions` (protocol, ends) into the 5-tuple
/// sets `sets` (IPv4, IPv6) for `ttl`, or with `None` take them out. An
/// element's timeout is not set anew by adding it again: it goes first.
/// So that the removal of one not there does not fail the whole batch
/// (see [`apply_elements`]), each is first added without `NLM_F_EXCL`
/// (nothing, if there): add, remove, add again, in one transaction.
fn direction_elements(
    directions: &[(u8, FlowEnds)],
    sets: (&'static str, &'static str),
    ttl: Option<Duration>,
) -> Vec<NetlinkMessage<NetfilterMessage>> {
    directions
        .iter()
        .flat_map(|(proto, ends)| {
            let mut key = ip_bytes(ends.src.ip());
            key.extend(ip_bytes(ends.dst.ip()));
            key.extend([*proto, 0, 0, 0]);
            key.extend(ends.src.port().to_be_bytes());
            key.extend([0, 0]);
            key.extend(ends.dst.port().to_be_bytes());
            key.extend([0, 0]);
            let set = set_of(ends.src.ip(), sets.0, sets.1);
            let mut changes = vec![
                set_element(set, key.clone(), Some(ttl.unwrap_or(ENSURED_TTL)), true),
                set_element(set, key.clone(), None, false),
            ];
            if ttl.is_some() {
                changes.push(set_element(set, key, ttl, true));
            }
            changes
        })
        .collect()
}

/// The set of the handover table for `ip`'s family.
fn set_of(ip: IpAddr, v4: &'static str, v6: &'static str) -> &'static str {
    if ip.is_ipv4() {
        v4
    } else {
        v6
    }
}

/// Applies element changes in batches of [`ELEMENTS_PER_BATCH`]: each one
/// nftables transaction, whose commit costs about the same for one element
/// as for hundreds (pinning 250 flows, one transaction per element took
/// 4.2 s here, in one batch 65 to 114 ms in all). A batch is all or
/// nothing, so should one change in it fail for its element alone
/// (ENOENT: a removal of one not there, or that lapsed; EEXIST: one there
/// already), that batch's changes are applied again one batch each, each
/// failing only itself.
fn apply_elements(
    s: &mut NfSocket,
    changes: Vec<NetlinkMessage<NetfilterMessage>>,
) -> std::result::Result<(), i32> {
    for chunk in changes.chunks(ELEMENTS_PER_BATCH) {
        match s.exchange(batch(chunk.to_vec())) {
            Ok(_) => continue,
            Err(libc::ENOENT) | Err(libc::EEXIST) => {}
            Err(e) => return Err(e),
        }
        for change in chunk {
            match s.exchange(batch(vec![change.clone()])) {
                Ok(_) | Err(libc::ENOENT) | Err(libc::EEXIST) => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}

/// Every flow of both families, in one dump. The kernel walks every bucket
/// of its conntrack hash for a dump, whatever the dump's filter lets
/// through: 6.5 ms a walk here with no flow at all (262,144 buckets),
/// 10 to 15 ms with two TCG guests running. So the table is walked once
/// and read here, rather than once per address and direction (a pin's
/// four walks took 42 to 62 ms of the 57 to 82 ms a target needed to
/// route a returning VM to its pod).
fn dump_flows(s: &mut NfSocket) -> std::result::Result<Vec<Flow>, i32> {
    let all = ConntrackMessage::Get(Vec::new());
    let answer = s.exchange(vec![message(
        NetfilterProtoFamily::Unspec,
        0,
        all,
        NLM_F_DUMP,
    )])?;
    Ok(answer
        .messages
        .into_iter()
        .filter_map(|m| match m.inner {
            NetfilterMessageInner::Conntrack(ConntrackMessage::New(attrs)) => flow_of(&attrs),
            _ => None,
        })
        .collect())
}

/// Which entries holding a direction of a new flow it replaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Replace {
    /// None: the flow is not created.
    Nothing,
    /// Untranslated ones (plain forwarding state); a translated one is
    /// this node's own translation of the flow, and wins.
    Untranslated,
    /// Any (pinning replaces the very entry it makes again).
    Anything,
}

/// The entry holding `ends` in either direction, if any.
fn entry_holding(
    s: &mut NfSocket,
    proto: u8,
    ends: &FlowEnds,
) -> std::result::Result<Option<Flow>, i32> {
    let get = ConntrackMessage::Get(vec![ConntrackAttribute::CtaTupleOrig(tuple(proto, ends))]);
    match s.exchange(vec![message(nfproto(ends.src.ip()), 0, get, NLM_F_ACK)]) {
        Ok(a) => Ok(a.messages.into_iter().find_map(|m| match m.inner {
            NetfilterMessageInner::Conntrack(ConntrackMessage::New(attrs)) => flow_of(&attrs),
            _ => None,
        })),
        Err(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

/// A TCP flow's conntrack state (`None`: left as it is), with both
/// directions' window tracking made liberal: a flow made here has seen
/// none of its sequence numbers, and one this node tracked before (the
/// VM ran here, left, and comes back) has seen only old ones.
fn tcp_info(state: Option<u8>) -> std::result::Result<ConntrackAttribute, i32> {
    // The struct is non-exhaustive: built by parsing its two bytes (the
    // flags, and the mask of those to set).
    let liberal =
        TCPFlags::parse(&[TCP_FLAG_BE_LIBERAL, TCP_FLAG_BE_LIBERAL]).map_err(|_| libc::EINVAL)?;
    let mut info = Vec::with_capacity(3);
    if let Some(state) = state {
        info.push(ProtoInfoTCP::State(state));
    }
    info.push(ProtoInfoTCP::OriginalFlags(liberal.clone()));
    info.push(ProtoInfoTCP::ReplyFlags(liberal));
    Ok(ConntrackAttribute::CtaProtoInfo(vec![ProtoInfo::TCP(info)]))
}

/// Both directions' window-tracking flags of the TCP flow whose first
/// direction is `ends` (for the root tests).
#[cfg(test)]
fn tcp_flags(s: &mut NfSocket, ends: &FlowEnds) -> std::result::Result<Option<(u8, u8)>, i32> {
    let get = ConntrackMessage::Get(vec![ConntrackAttribute::CtaTupleOrig(tuple(TCP, ends))]);
    let answer = match s.exchange(vec![message(nfproto(ends.src.ip()), 0, get, NLM_F_ACK)]) {
        Ok(a) => a,
        Err(libc::ENOENT) => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut flags = (0, 0);
    for m in answer.messages {
        if let NetfilterMessageInner::Conntrack(ConntrackMessage::New(attrs)) = m.inner {
            for a in attrs {
                if let ConntrackAttribute::CtaProtoInfo(infos) = a {
                    for info in infos {
                        if let ProtoInfo::TCP(tcp) = info {
                            for t in tcp {
                                match t {
                                    ProtoInfoTCP::OriginalFlags(f) => flags.0 = f.flags,
                                    ProtoInfoTCP::ReplyFlags(f) => flags.1 = f.flags,
                                    _ => {}
                                }
                            }
                        }
                    }
                }
            }
            return Ok(Some(flags));
        }
    }
    Ok(None)
}

/// Whether `f`, sent again, is a TCP connection that has opened since
/// `held` (the same flow, here) was made: `held` is still opening and `f`
/// is further on.
fn opened_since(held: &Flow, f: &Flow) -> bool {
    match (held.tcp_state, f.tcp_state) {
        (Some(was), Some(now)) => was < crate::handover::TCP_ESTABLISHED && now > was,
        _ => false,
    }
}

/// Creates `f` (see [`Handover::create_flow`]).
fn create(s: &mut NfSocket, f: &Flow, replace: Replace) -> std::result::Result<FlowCreated, i32> {
    let family = nfproto(f.orig.src.ip());
    let mut attrs = vec![
        ConntrackAttribute::CtaTupleOrig(tuple(f.proto, &f.orig)),
        ConntrackAttribute::CtaTupleReply(tuple(f.proto, &f.orig.inverse())),
        // The kernel marks a flow made over netlink confirmed before it
        // applies the status asked for, and refuses to change that bit.
        ConntrackAttribute::CtaStatus(Status::SeenReply | Status::Assured | Status::Confirmed),
        ConntrackAttribute::CtaTimeout(f.timeout_secs.max(1)),
        ConntrackAttribute::CtaMark(f.mark),
    ];
    if f.proto == TCP {
        attrs.push(tcp_info(Some(
            f.tcp_state.unwrap_or(crate::handover::TCP_ESTABLISHED),
        ))?);
    }
    // Made anew from the reply the flow had: the kernel computes the reply
    // of a new flow from these.
    if f.destination_translated() {
        attrs.push(nat_to(CTA_NAT_DST, f.reply.src));
    }
    if f.source_translated() {
        attrs.push(nat_to(CTA_NAT_SRC, f.reply.dst));
    }
    let new = || {
        message(
            family,
            0,
            ConntrackMessage::New(attrs.clone()),
            NLM_F_CREATE | NLM_F_EXCL | NLM_F_ACK,
        )
    };
    // The kernel makes a translated flow's tuples unique by itself: one
    // whose answers an entry takes already (this node forwarding the same
    // connection untranslated, to a backend pod of its own) would be made
    // with another port for its answers, silently, and carry the
    // connection nowhere. That is a collision, as EEXIST is for the others.
    let translated = f.destination_translated() || f.source_translated();
    let answers_taken = translated
        && replace != Replace::Anything
        && entry_holding(s, f.proto, &f.reply)?.is_some_and(|h| h.orig != f.orig);
    if !answers_taken {
        match s.exchange(vec![new()]) {
            Ok(_) => return Ok(FlowCreated::Created),
            Err(libc::EEXIST) => {}
            Err(e) => return Err(e),
        }
    }
    // The same flow, made earlier (a source sends a moving VM's flows
    // again and again while it moves): its timeout is set anew, so that a
    // flow idle here until the cutover does not expire first. A TCP state
    // is brought forward only from an opening one (SYN_SENT, SYN_RECV): a
    // connection first sent while it was being opened has opened since,
    // and left at its first state here, every packet of it after the
    // cutover would be invalid. A state this node's own packets moved on
    // (a flow of a pod here) is never set back to the source's older view.
    // Its window tracking is made liberal: a flow this node tracked when
    // the VM ran here before knows only sequence numbers long past, and
    // would take every packet of it now as invalid (kube-proxy drops
    // those).
    let reply = if f.destination_translated() || f.source_translated() {
        f.reply
    } else {
        f.orig.inverse()
    };
    if replace != Replace::Anything {
        if let Some(h) = entry_holding(s, f.proto, &f.orig)? {
            if h.orig == f.orig && h.reply == reply && h.mark == f.mark {
                let mut update = vec![
                    ConntrackAttribute::CtaTupleOrig(tuple(f.proto, &f.orig)),
                    ConntrackAttribute::CtaTimeout(f.timeout_secs.max(1)),
                ];
                if f.proto == TCP {
                    update.push(tcp_info(opened_since(&h, f).then_some(
                        f.tcp_state.unwrap_or(crate::handover::TCP_ESTABLISHED),
                    ))?);
                }
                let update = ConntrackMessage::New(update);
                s.exchange(vec![message(family, 0, update, NLM_F_ACK)])?;
                return Ok(FlowCreated::Refreshed);
            }
        }
    }
    if replace == Replace::Nothing {
        return Ok(FlowCreated::Exists);
    }
    // What holds either direction goes: the direction the flow starts
    // with, and the one its answers come in (after its translation).
    let mut holders = Vec::new();
    for ends in [f.orig, f.reply, f.orig.inverse()] {
        if let Some(h) = entry_holding(s, f.proto, &ends)? {
            if replace == Replace::Untranslated
                && (h.source_translated() || h.destination_translated())
            {
                return Ok(FlowCreated::Exists);
            }
            if !holders.contains(&h) {
                holders.push(h);
            }
        }
    }
    for h in holders {
        let del = ConntrackMessage::Delete(vec![ConntrackAttribute::CtaTupleOrig(tuple(
            h.proto, &h.orig,
        ))]);
        match s.exchange(vec![message(family, 0, del, NLM_F_ACK)]) {
            Ok(_) | Err(libc::ENOENT) => {}
            Err(e) => return Err(e),
        }
    }
    s.exchange(vec![new()]).map(|_| FlowCreated::Replaced)
}

/// The real handover (see the module doc).
#[derive(Clone)]
pub struct LinuxHandover {
    handle: Handle,
    /// The lock the node's connection takes around dumps (the kernel runs
    /// one dump at a time per socket).
    dumps: Arc<tokio::sync::Mutex<()>>,
    nf: Arc<Mutex<Option<NfSocket>>>,
}

impl LinuxHandover {
    /// The handover on the node's rtnetlink connection `handle` (whose
    /// dumps `dumps` serialises); the netfilter socket opens on first use.
    pub fn new(handle: Handle, dumps: Arc<tokio::sync::Mutex<()>>) -> LinuxHandover {
        LinuxHandover {
            handle,
            dumps,
            nf: Arc::new(Mutex::new(None)),
        }
    }

    /// Both directions' window-tracking flags of the TCP flow whose first
    /// direction is `ends`, if it is there (for the root tests).
    #[cfg(test)]
    pub(crate) async fn tcp_flags_of(&self, ends: FlowEnds) -> Result<Option<(u8, u8)>> {
        self.nf("reading a flow's TCP flags".into(), move |s| {
            tcp_flags(s, &ends)
        })
        .await
    }

    /// Runs `work` on the netfilter socket, on the blocking pool.
    async fn nf<T: Send + 'static>(
        &self,
        doing: String,
        work: impl FnOnce(&mut NfSocket) -> std::result::Result<T, i32> + Send + 'static,
    ) -> Result<T> {
        let nf = self.nf.clone();
        let doing2 = doing.clone();
        tokio::task::spawn_blocking(move || {
            let mut slot = nf.lock().unwrap_or_else(|p| p.into_inner());
            if slot.is_none() {
                *slot = Some(
                    NfSocket::open()
                        .map_err(|e| KernelError::refused("opening the netfilter socket", e))?,
                );
            }
            let Some(socket) = slot.as_mut() else {
                return Err(KernelError::Internal("no netfilter socket".into()));
            };
            let done = work(socket);
            if socket.broken {
                // The next operation opens a fresh socket.
                *slot = None;
            }
            done.map_err(|e| {
                KernelError::refused(doing2.clone(), std::io::Error::from_raw_os_error(e))
            })
        })
        .await
        .map_err(|e| KernelError::Internal(format!("{doing}: {e}")))?
    }

    /// The rule of `mark`/`mask` to `table` at `priority`, for `family`.
    fn rule(family: AddressFamily, mark: u32, mask: u32, table: u32, priority: u32) -> RuleMessage {
        let mut r = RuleMessage::default();
        r.header.family = family;
        r.header.table = 0;
        r.header.action = rtnetlink::packet_route::rule::RuleAction::ToTable;
        r.attributes = vec![
            RuleAttribute::FwMark(mark),
            RuleAttribute::FwMask(mask),
            RuleAttribute::Table(table),
            RuleAttribute::Priority(priority),
        ];
        r
    }

    /// Adds a rule; one there already is success.
    async fn add_rule(&self, rule: RuleMessage) -> Result<()> {
        let mut req = self.handle.rule().add();
        *req.message_mut() = rule;
        match req.execute().await {
            Ok(()) => Ok(()),
            Err(e) if errno(&e) == Some(libc::EEXIST) => Ok(()),
            Err(e) => Err(KernelError::refused(
                "adding an anchor's policy rule",
                reason(&e),
            )),
        }
    }

    /// Every rule of tether's anchor tables, both families.
    async fn our_rules(&self) -> Result<Vec<RuleMessage>> {
        let _dump = self.dumps.lock().await;
        let mut out = Vec::new();
        for family in [IpVersion::V4, IpVersion::V6] {
            let rules: Vec<RuleMessage> = self
                .handle
                .rule()
                .get(family)
                .execute()
                .try_collect()
                .await
                .map_err(|e| KernelError::refused("reading the policy rules", reason(&e)))?;
            out.extend(rules.into_iter().filter(|r| {
                r.attributes.iter().any(|a| {
                    matches!(a, RuleAttribute::Table(t) if (ANCHOR_TABLE_BASE..=ANCHOR_TABLE_LAST).contains(t))
                })
            }));
        }
        Ok(out)
    }

    /// Deletes the routes of `table` with the handover protocol.
    async fn flush_table(&self, table: u32) -> Result<()> {
        for family in [AddressFamily::Inet, AddressFamily::Inet6] {
            let mut filter = RouteMessage::default();
            filter.header.address_family = family;
            filter.header.protocol = RouteProtocol::Other(HANDOVER_ROUTE_PROTOCOL);
            filter.attributes.push(RouteAttribute::Table(table));
            let routes: Vec<RouteMessage> = {
                let _dump = self.dumps.lock().await;
                self.handle
                    .route()
                    .get(filter)
                    .execute()
                    .try_collect()
                    .await
                    .map_err(|e| KernelError::refused("reading an anchor's table", reason(&e)))?
            };
            for r in routes {
                let in_table = r
                    .attributes
                    .iter()
                    .any(|a| matches!(a, RouteAttribute::Table(t) if *t == table));
                if !in_table || r.header.protocol != RouteProtocol::Other(HANDOVER_ROUTE_PROTOCOL) {
                    continue;
                }
                match self.handle.route().del(r).execute().await {
                    Ok(()) => {}
                    Err(e) if errno(&e) == Some(libc::ESRCH) => {}
                    Err(e) => {
                        return Err(KernelError::refused(
                            "removing an anchor's route",
                            reason(&e),
                        ))
                    }
                }
            }
        }
        Ok(())
    }

    /// The index of node link `name`, if it exists.
    async fn index_of(&self, name: &str) -> Result<Option<u32>> {
        messages::link_by_name_get(&self.handle, name)
            .await
            .map(|l| l.map(|l| l.header.index))
            .map_err(|e| KernelError::refused(format!("looking up {name}"), reason(&e)))
    }
}

/// The default route of `via`'s family in anchor table `table`: through
/// `via`, onlink on `oif` when given.
fn anchor_route(table: u32, via: IpAddr, oif: Option<u32>) -> RouteMessage {
    let mut msg = RouteMessage::default();
    msg.header.address_family = if via.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    msg.header.table = RouteHeader::RT_TABLE_UNSPEC;
    msg.header.protocol = RouteProtocol::Other(HANDOVER_ROUTE_PROTOCOL);
    msg.header.kind = RouteType::Unicast;
    msg.header.scope = RouteScope::Universe;
    msg.header.destination_prefix_length = 0;
    msg.attributes.push(RouteAttribute::Table(table));
    msg.attributes
        .push(RouteAttribute::Gateway(RouteAddress::from(via)));
    if let Some(i) = oif {
        msg.header.flags |= RouteFlags::Onlink;
        msg.attributes.push(RouteAttribute::Oif(i));
    }
    msg
}

#[async_trait]
impl Handover for LinuxHandover {
    async fn flows_of(&self, ip: IpAddr) -> Result<Vec<Flow>> {
        self.nf(format!("reading the flows of {ip}"), move |s| {
            Ok(all_flows_at(&dump_flows(s)?, ip))
        })
        .await
    }

    async fn flows_of_each(&self, ips: &[IpAddr]) -> Result<Vec<Vec<Flow>>> {
        let ips = ips.to_vec();
        self.nf(format!("reading the flows of {ips:?}"), move |s| {
            let all = dump_flows(s)?;
            Ok(ips.iter().map(|ip| all_flows_at(&all, *ip)).collect())
        })
        .await
    }

    fn watch_flows(&self) -> Result<Box<dyn crate::handover::FlowFeed>> {
        Ok(Box::new(super::flow_feed::open()?))
    }

    async fn create_flow(&self, flow: &Flow, replace: bool) -> Result<FlowCreated> {
        let f = flow.clone();
        let replace = if replace {
            Replace::Untranslated
        } else {
            Replace::Nothing
        };
        self.nf(format!("creating the flow {:?}", flow.orig), move |s| {
            create(s, &f, replace)
        })
        .await
    }

    async fn create_flows(&self, flows: &[Flow], replace: bool) -> Vec<Result<FlowCreated>> {
        let all = flows.to_vec();
        let how = if replace {
            Replace::Untranslated
        } else {
            Replace::Nothing
        };
        // One trip to the netfilter socket's thread for all of them.
        let made = self
            .nf(format!("creating {} flows", all.len()), move |s| {
                Ok(all.iter().map(|f| create(s, f, how)).collect::<Vec<_>>())
            })
            .await;
        match made {
            Ok(made) => made
                .into_iter()
                .zip(flows)
                .map(|(r, f)| {
                    r.map_err(|e| {
                        KernelError::refused(
                            format!("creating the flow {:?}", f.orig),
                            std::io::Error::from_raw_os_error(e),
                        )
                    })
                })
                .collect(),
            Err(e) => {
                let why = e.to_string();
                flows
                    .iter()
                    .map(|_| Err(KernelError::Internal(why.clone())))
                    .collect()
            }
        }
    }

    async fn pin_translations(&self, vm: &[IpAddr]) -> Result<u32> {
        let vm = vm.to_vec();
        self.nf(
            format!("pinning the translations toward {vm:?}"),
            move |s| {
                let all = dump_flows(s)?;
                let mut masqueraded = Vec::new();
                for ip in &vm {
                    let (_, toward) = flows_at(&all, *ip);
                    masqueraded.extend(toward.into_iter().filter(Flow::source_translated));
                }
                if masqueraded.is_empty() {
                    return Ok(0);
                }
                // The flows' packets are held off (dropped before conntrack
                // sees them) while they are made again, so that none starts a
                // new flow in between; the elements lapse by themselves should
                // this stop half way.
                // An element is a direction without its source port: the
                // flows of many clients' ports to one NodePort share one.
                let directions: BTreeSet<(IpAddr, IpAddr, u8, u16)> = masqueraded
                    .iter()
                    .flat_map(|f| [f.orig, f.reply].map(|e| (e, f.proto)))
                    .map(|(e, proto)| (e.src.ip(), e.dst.ip(), proto, e.dst.port()))
                    .collect();
                let freeze = |add: bool| -> Vec<_> {
                    directions
                        .iter()
                        .map(|&(src, dst, proto, port)| {
                            let ends = FlowEnds {
                                src: SocketAddr::new(src, 0),
                                dst: SocketAddr::new(dst, port),
                            };
                            let set = set_of(src, "frozen_v4", "frozen_v6");
                            flow_element(set, &ends, proto, add.then_some(FREEZE_LIMIT), add)
                        })
                        .collect()
                };
                apply_elements(s, freeze(true))?;
                let mut pinned = 0;
                let mut first_error = None;
                for f in &masqueraded {
                    match create(s, f, Replace::Anything) {
                        Ok(_) => pinned += 1,
                        Err(e) => {
                            first_error.get_or_insert(e);
                        }
                    }
                }
                apply_elements(s, freeze(false))?;
                match first_error {
                    Some(e) => Err(e),
                    None => Ok(pinned),
                }
            },
        )
        .await
    }

    async fn count_anchored(&self, id: u16) -> Result<u32> {
        self.nf(format!("counting the flows anchored at node {id}"), move |s| {
            let request = ConntrackMessage::Get(vec![
                ConntrackAttribute::CtaMark(anchor_mark(id)),
                ConntrackAttribute::Other(DefaultNla::new(CTA_MARK_MASK, ANCHOR_MASK.to_be_bytes().to_vec())),
            ]);
            let answer = s.exchange(vec![message(NetfilterProtoFamily::Unspec, 0, request, NLM_F_DUMP)])?;
            Ok(answer
                .messages
                .iter()
                .filter(|m| matches!(&m.inner, NetfilterMessageInner::Conntrack(ConntrackMessage::New(a))
                    if a.iter().any(|x| matches!(x, ConntrackAttribute::CtaMark(mk) if anchor_of_mark(*mk) == Some(id)))))
                .count() as u32)
        })
        .await
    }

    async fn delete_anchored(&self, id: u16) -> Result<u32> {
        let n = self.count_anchored(id).await?;
        self.nf(
            format!("deleting the flows anchored at node {id}"),
            move |s| {
                let request = ConntrackMessage::Delete(vec![
                    ConntrackAttribute::CtaMark(anchor_mark(id)),
                    ConntrackAttribute::Other(DefaultNla::new(
                        CTA_MARK_MASK,
                        ANCHOR_MASK.to_be_bytes().to_vec(),
                    )),
                ]);
                match s.exchange(vec![message(
                    NetfilterProtoFamily::Unspec,
                    0,
                    request,
                    NLM_F_ACK,
                )]) {
                    Ok(_) | Err(libc::ENOENT) => Ok(n),
                    Err(e) => Err(e),
                }
            },
        )
        .await
    }

    async fn ensure_anchor(&self, id: u16, via: &[ClusterRoute]) -> Result<()> {
        let table = anchor_table(id);
        for r in via {
            let oif = match &r.onlink_dev {
                Some(dev) => Some(self.index_of(dev).await?.ok_or_else(|| {
                    KernelError::refused(
                        format!("routing through {dev}"),
                        "no such device".to_string(),
                    )
                })?),
                None => None,
            };
            self.handle
                .route()
                .add(anchor_route(table, r.via, oif))
                .replace()
                .execute()
                .await
                .map_err(|e| KernelError::refused("adding an anchor's route", reason(&e)))?;
            let family = if r.via.is_ipv4() {
                AddressFamily::Inet
            } else {
                AddressFamily::Inet6
            };
            self.add_rule(Self::rule(
                family,
                anchor_mark(id),
                ANCHOR_MASK,
                table,
                ANCHOR_RULE_PRIORITY,
            ))
            .await?;
        }
        Ok(())
    }

    async fn remove_anchor(&self, id: u16) -> Result<()> {
        let table = anchor_table(id);
        for r in self.our_rules().await? {
            if r.attributes
                .iter()
                .any(|a| matches!(a, RuleAttribute::Table(t) if *t == table))
            {
                match self.handle.rule().del(r).execute().await {
                    Ok(()) => {}
                    Err(e) if errno(&e) == Some(libc::ENOENT) => {}
                    Err(e) => {
                        return Err(KernelError::refused(
                            "removing an anchor's rule",
                            reason(&e),
                        ))
                    }
                }
            }
        }
        self.flush_table(table).await
    }

    async fn anchors(&self) -> Result<Vec<u16>> {
        let mut ids: Vec<u16> = self
            .our_rules()
            .await?
            .iter()
            .filter_map(|r| {
                r.attributes.iter().find_map(|a| match a {
                    RuleAttribute::Table(t)
                        if *t > ANCHOR_TABLE_BASE && *t <= ANCHOR_TABLE_LAST =>
                    {
                        Some((*t - ANCHOR_TABLE_BASE) as u16)
                    }
                    _ => None,
                })
            })
            .collect();
        ids.sort_unstable();
        ids.dedup();
        Ok(ids)
    }

    async fn guard_moved(&self, vm: &[IpAddr], ttl: Duration) -> Result<()> {
        let changes: Vec<_> = vm
            .iter()
            .map(|ip| element(set_of(*ip, "moved_v4", "moved_v6"), *ip, Some(ttl), true))
            .collect();
        self.nf("guarding a moved VM's connections".into(), move |s| {
            apply_elements(s, changes)
        })
        .await
    }

    async fn pass_translated_back(
        &self,
        directions: &[(u8, FlowEnds)],
        ttl: Duration,
    ) -> Result<()> {
        let changes = direction_elements(
            directions,
            ("translated_back_v4", "translated_back_v6"),
            Some(ttl),
        );
        self.nf("letting translated-back packets pass".into(), move |s| {
            apply_elements(s, changes)
        })
        .await
    }

    async fn hold_back(&self, directions: &[(u8, FlowEnds)], ttl: Option<Duration>) -> Result<()> {
        let changes = direction_elements(directions, ("held_back_v4", "held_back_v6"), ttl);
        self.nf("holding back a VM's packets".into(), move |s| {
            apply_elements(s, changes)
        })
        .await
    }

    async fn capture(&self, host_ifname: &str) -> Result<Box<dyn Held>> {
        let index = self.index_of(host_ifname).await?.ok_or_else(|| {
            KernelError::refused(
                format!("capturing on {host_ifname}"),
                "no such device".to_string(),
            )
        })?;
        Ok(Box::new(Capture::start(index)?))
    }

    async fn tap_counters(
        &self,
        netns: &Path,
        tap: &str,
        host_ifname: &str,
    ) -> Result<TapCounters> {
        let file = open_netns(netns)?;
        let tap_name = tap.to_owned();
        let read =
            spawn_in_netns(&file, move || LinkCounter::open(&tap_name)?.tx_packets())?.await?;
        let host = host_ifname.to_owned();
        let sent = tokio::task::spawn_blocking(move || LinkCounter::open(&host)?.tx_packets())
            .await
            .map_err(|e| KernelError::Internal(e.to_string()))??;
        Ok(TapCounters { sent, read })
    }

    async fn routes_to_link(&self, ip: IpAddr, host_ifname: &str) -> Result<bool> {
        let Some(index) = self.index_of(host_ifname).await? else {
            return Ok(false);
        };
        let found = match messages::request(
            &self.handle,
            RouteNetlinkMessage::GetRoute(super::overlay::route_get(ip)),
            messages::ACKED,
        )
        .await
        {
            Ok(answers) => answers,
            Err(e) if matches!(errno(&e), Some(libc::ENETUNREACH | libc::EHOSTUNREACH)) => {
                return Ok(false)
            }
            Err(e) => {
                return Err(KernelError::refused(
                    format!("looking up the route to {ip}"),
                    reason(&e),
                ))
            }
        };
        let found: Vec<RouteMessage> = found
            .into_iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewRoute(r) => Some(r),
                _ => None,
            })
            .collect();
        Ok(found.iter().any(|r| messages::route_oif(r) == Some(index)))
    }

    async fn replay(&self, packets: Vec<Vec<u8>>) -> Result<Replayed> {
        tokio::task::spawn_blocking(move || Ok(Replayer::open()?.send(&packets)))
            .await
            .map_err(|e| KernelError::Internal(e.to_string()))?
    }
}

/// A link's transmit counter, read over an rtnetlink socket of the netns
/// it was opened in.
struct LinkCounter {
    socket: Socket,
    name: String,
    seq: u32,
}

impl LinkCounter {
    fn open(name: &str) -> Result<LinkCounter> {
        let mut socket = Socket::new(protocols::NETLINK_ROUTE)
            .map_err(|e| KernelError::refused("opening an rtnetlink socket", e))?;
        socket
            .bind_auto()
            .and_then(|_| socket.connect(&NetlinkAddr::new(0, 0)))
            .map_err(|e| KernelError::refused("binding an rtnetlink socket", e))?;
        let mut c = LinkCounter {
            socket,
            name: name.to_owned(),
            seq: 0,
        };
        c.tx_packets()?;
        Ok(c)
    }

    fn tx_packets(&mut self) -> Result<u64> {
        let doing = || format!("reading {}'s counters", self.name);
        let mut link = LinkMessage::default();
        link.attributes
            .push(LinkAttribute::IfName(self.name.clone()));
        let mut m = NetlinkMessage::new(
            NetlinkHeader::default(),
            NetlinkPayload::InnerMessage(RouteNetlinkMessage::GetLink(link)),
        );
        self.seq = self.seq.wrapping_add(1);
        m.header.flags = NLM_F_REQUEST;
        m.header.sequence_number = self.seq;
        m.finalize();
        let mut buf = vec![0; m.buffer_len()];
        m.serialize(&mut buf);
        self.socket
            .send(&buf, 0)
            .map_err(|e| KernelError::refused(doing(), e))?;
        let mut rbuf: Vec<u8> = Vec::with_capacity(RECV_BUF);
        loop {
            rbuf.clear();
            let n = self
                .socket
                .recv(&mut rbuf, 0)
                .map_err(|e| KernelError::refused(doing(), e))?;
            let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&rbuf[..n])
                .map_err(|e| KernelError::refused(doing(), e.to_string()))?;
            if msg.header.sequence_number != self.seq {
                continue;
            }
            return match msg.payload {
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(l)) => l
                    .attributes
                    .iter()
                    .find_map(|a| match a {
                        LinkAttribute::Stats64(s) => Some(s.tx_packets),
                        _ => None,
                    })
                    .ok_or_else(|| KernelError::refused(doing(), "no counters".to_string())),
                NetlinkPayload::Error(e) => Err(KernelError::refused(
                    doing(),
                    std::io::Error::from_raw_os_error(e.code.map_or(libc::EIO, |c| -c.get())),
                )),
                _ => Err(KernelError::refused(
                    doing(),
                    "an unexpected answer".to_string(),
                )),
            };
        }
    }
}
