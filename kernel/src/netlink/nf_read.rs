//! Reading what netfilter netlink sends: the messages of one datagram,
//! and a flow from conntrack's attributes. The handover's exchanges and
//! the feed of conntrack's events ([`super::flow_feed`]) share them.

use std::net::SocketAddr;

use netlink_packet_netfilter::conntrack::{
    ConntrackAttribute, IPTuple, ProtoInfo, ProtoInfoTCP, ProtoTuple, Tuple,
};
use netlink_packet_netfilter::NetfilterMessage;
use rtnetlink::packet_core::NetlinkMessage;

use crate::handover::{Flow, FlowEnds, TCP, UDP};

/// The netlink messages of one datagram `buf`, in order; one that does
/// not parse is skipped, and a length that runs past the end ends them.
pub(super) fn messages_in(
    buf: &[u8],
) -> impl Iterator<Item = NetlinkMessage<NetfilterMessage>> + '_ {
    let mut at = 0;
    std::iter::from_fn(move || {
        while at + 16 <= buf.len() {
            let len = u32::from_ne_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]) as usize;
            if len < 16 || at + len > buf.len() {
                return None;
            }
            let bytes = &buf[at..at + len];
            at += (len + 3) & !3;
            if let Ok(msg) = NetlinkMessage::<NetfilterMessage>::deserialize(bytes) {
                return Some(msg);
            }
        }
        None
    })
}

/// The ends of a tuple the kernel reported; None when it is not TCP or UDP
/// over IP.
fn ends_of(parts: &[Tuple]) -> Option<(u8, FlowEnds)> {
    let (mut src, mut dst, mut proto, mut sport, mut dport) = (None, None, None, None, None);
    for part in parts {
        match part {
            Tuple::Ip(ips) => {
                for ip in ips {
                    match ip {
                        IPTuple::SourceAddress(a) => src = Some(*a),
                        IPTuple::DestinationAddress(a) => dst = Some(*a),
                        _ => {}
                    }
                }
            }
            Tuple::Proto(ps) => {
                for p in ps {
                    match p {
                        ProtoTuple::Protocol(n) => proto = Some(u8::from(*n)),
                        ProtoTuple::SourcePort(n) => sport = Some(*n),
                        ProtoTuple::DestinationPort(n) => dport = Some(*n),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    let proto = proto.filter(|p| *p == TCP || *p == UDP)?;
    Some((
        proto,
        FlowEnds {
            src: SocketAddr::new(src?, sport?),
            dst: SocketAddr::new(dst?, dport?),
        },
    ))
}

/// A flow from a conntrack message's attributes.
pub(super) fn flow_of(attrs: &[ConntrackAttribute]) -> Option<Flow> {
    let (mut orig, mut reply, mut mark, mut timeout, mut state) = (None, None, 0, 0, None);
    for a in attrs {
        match a {
            ConntrackAttribute::CtaTupleOrig(t) => orig = ends_of(t),
            ConntrackAttribute::CtaTupleReply(t) => reply = ends_of(t),
            ConntrackAttribute::CtaMark(m) => mark = *m,
            ConntrackAttribute::CtaTimeout(t) => timeout = *t,
            ConntrackAttribute::CtaProtoInfo(infos) => {
                for info in infos {
                    if let ProtoInfo::TCP(tcp) = info {
                        for t in tcp {
                            if let ProtoInfoTCP::State(s) = t {
                                state = Some(*s);
                            }
                        }
                    }
                }
            }
            _ => {}
        }
    }
    let (proto, orig) = orig?;
    let (_, reply) = reply?;
    Some(Flow {
        proto,
        orig,
        reply,
        mark,
        timeout_secs: timeout,
        tcp_state: if proto == TCP { state } else { None },
    })
}
