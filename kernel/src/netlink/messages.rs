//! The rtnetlink messages the dataplane sends, built as plain values so that
//! their shape can be unit-tested without root, and the small helpers that
//! send them and read the kernel's answer.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::RawFd;

use futures::TryStreamExt;
use rtnetlink::packet_core::{
    NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_CREATE, NLM_F_ECHO, NLM_F_EXCL, NLM_F_REPLACE,
    NLM_F_REQUEST,
};
use rtnetlink::packet_route::address::{
    AddressAttribute, AddressFlags, AddressHeaderFlags, AddressMessage,
};
use rtnetlink::packet_route::link::{
    InfoData, InfoKind, InfoVeth, LinkAttribute, LinkFlags, LinkMessage,
};
use rtnetlink::packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourMessage, NeighbourState,
};
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use rtnetlink::packet_route::{AddressFamily, RouteNetlinkMessage};
use rtnetlink::{
    AddressMessageBuilder, Handle, LinkMessageBuilder, LinkUnspec, LinkVeth, RouteMessageBuilder,
};

use crate::error::{KernelError, Result};
use crate::{GATEWAY_MAC, GATEWAY_V4, GATEWAY_V6, ROUTE_PROTOCOL};

/// The positive errno of a kernel refusal, if that is what `e` is.
pub(super) fn errno(e: &rtnetlink::Error) -> Option<i32> {
    match e {
        rtnetlink::Error::NetlinkError(m) => m.code.map(|c| c.get().abs()),
        _ => None,
    }
}

/// The kernel's errno and words for a failure, without rtnetlink's
/// wrapping.
pub(super) fn reason(e: &rtnetlink::Error) -> crate::Cause {
    crate::Cause {
        errno: errno(e),
        text: match e {
            rtnetlink::Error::NetlinkError(m) => m.to_io().to_string(),
            other => other.to_string(),
        },
    }
}

/// Host prefix length of an address: the pod side and the host routes are
/// always single-address.
pub(super) fn host_prefix_len(ip: IpAddr) -> u8 {
    match ip {
        IpAddr::V4(_) => 32,
        IpAddr::V6(_) => 128,
    }
}

/// The gateways a pod with these addresses needs: one per family present.
pub(super) fn gateways(ips: &[IpAddr]) -> Vec<IpAddr> {
    let mut out = Vec::with_capacity(2);
    if ips.iter().any(IpAddr::is_ipv4) {
        out.push(IpAddr::V4(GATEWAY_V4));
    }
    if ips.iter().any(IpAddr::is_ipv6) {
        out.push(IpAddr::V6(GATEWAY_V6));
    }
    out
}

fn family_of(ip: IpAddr) -> AddressFamily {
    match ip {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
    }
}

/// The veth pair in one message: the host end named and addressed as the
/// gateway and up, the peer born inside the pod netns under its final name.
/// Creating the peer in place saves the move and the rename that `ptp` does.
/// The peer cannot be created up: the kernel opens it before the two ends
/// know each other and veth_open answers ENOTCONN, so the pod side raises it
/// (see `link_up`).
pub(super) fn veth(
    host_ifname: &str,
    pod_ifname: &str,
    pod_mac: [u8; 6],
    mtu: u32,
    pod_netns_fd: RawFd,
) -> LinkMessage {
    let peer = LinkUnspec::new_with_name(pod_ifname)
        .address(pod_mac.to_vec())
        .mtu(mtu)
        .setns_by_fd(pod_netns_fd)
        .build();
    LinkMessageBuilder::<LinkVeth>::new_with_info_kind(InfoKind::Veth)
        .name(host_ifname)
        .address(GATEWAY_MAC.octets().to_vec())
        .mtu(mtu)
        .up()
        .set_info_data(InfoData::Veth(InfoVeth::Peer(peer)))
        .build()
}

/// Header flags: create, failing if it exists.
pub(super) const CREATE: u16 = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL;
/// Header flags: create, or overwrite what has the same key.
pub(super) const REPLACE: u16 = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE;
/// Header flags: a plain acknowledged request (deletions).
pub(super) const ACKED: u16 = NLM_F_REQUEST | NLM_F_ACK;

/// Header flags for creating the veth: exclusive, and echoed so that the
/// answer carries the host ifindex and the peer's ifindex (IFLA_LINK) without
/// any lookup.
pub(super) const CREATE_ECHO: u16 =
    NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL | NLM_F_ECHO;

/// What the echo of a veth creation tells: (host ifindex, peer ifindex).
pub(super) fn created_indexes(echo: &LinkMessage) -> (u32, Option<u32>) {
    let peer = echo.attributes.iter().find_map(|a| match a {
        LinkAttribute::Link(i) if *i != 0 => Some(*i),
        _ => None,
    });
    (echo.header.index, peer)
}

/// Sets a link up (RTM_SETLINK).
pub(super) fn link_up(index: u32) -> LinkMessage {
    LinkUnspec::new_with_index(index).up().build()
}

/// A link selected by name, for RTM_DELLINK without a prior lookup.
pub(super) fn link_by_name(name: &str) -> LinkMessage {
    LinkUnspec::new_with_name(name).build()
}

/// Sends one request and returns every message the kernel answered with
/// before its ACK; a NACK becomes the error.
pub(super) async fn request(
    handle: &Handle,
    message: RouteNetlinkMessage,
    flags: u16,
) -> Result<Vec<RouteNetlinkMessage>, rtnetlink::Error> {
    use futures::StreamExt;
    let mut req = NetlinkMessage::from(message);
    req.header.flags = flags;
    let mut answers = handle.clone().request(req)?;
    let mut out = Vec::new();
    while let Some(msg) = answers.next().await {
        match msg.payload {
            NetlinkPayload::InnerMessage(inner) => out.push(inner),
            NetlinkPayload::Error(e) if e.code.is_some() => {
                return Err(rtnetlink::Error::NetlinkError(e))
            }
            _ => {}
        }
    }
    Ok(out)
}

/// One request of a batch.
pub(super) struct Step {
    message: RouteNetlinkMessage,
    flags: u16,
    /// An errno that means the wanted state is already there.
    tolerate: Option<i32>,
    /// What the request does, for the error.
    context: String,
}

impl Step {
    /// A request whose every refusal is an error.
    pub(super) fn new(message: RouteNetlinkMessage, flags: u16, context: String) -> Self {
        Self {
            message,
            flags,
            tolerate: None,
            context,
        }
    }

    /// Accepts `errno` as success.
    pub(super) fn tolerating(mut self, errno: i32) -> Self {
        self.tolerate = Some(errno);
        self
    }
}

/// Sends every step before awaiting any answer: the kernel handles a
/// socket's requests in the order they were written, so later steps may rely
/// on earlier ones (a route on a link set up just before) while the whole
/// batch costs one wake-up. The first refusal, in order, is the error.
pub(super) async fn batch(handle: &Handle, steps: Vec<Step>) -> Result<()> {
    use futures::StreamExt;
    let mut handle = handle.clone();
    let mut pending = Vec::with_capacity(steps.len());
    for step in steps {
        let mut req = NetlinkMessage::from(step.message);
        req.header.flags = step.flags;
        let answers = handle
            .request(req)
            .map_err(|e| KernelError::refused(step.context.clone(), reason(&e)))?;
        pending.push((answers, step.tolerate, step.context));
    }
    let mut first = None;
    for (mut answers, tolerate, context) in pending {
        while let Some(msg) = answers.next().await {
            if let NetlinkPayload::Error(e) = msg.payload {
                let code = e.raw_code().abs();
                if code != 0 && Some(code) != tolerate && first.is_none() {
                    first = Some(KernelError::refused(context.clone(), e.to_io()));
                }
            }
        }
    }
    first.map_or(Ok(()), Err)
}

/// The same batch as [`batch`], on a blocking netlink socket opened in the
/// calling thread's netns: every step in one `sendmsg` (the kernel handles
/// them in order, as it would one by one), then the answers read. For a
/// thread that entered a pod's netns for these requests alone, where an
/// async runtime and a connection task would cost more than the requests.
pub(super) fn batch_blocking(steps: Vec<Step>) -> Result<()> {
    use rtnetlink::sys::{protocols::NETLINK_ROUTE, Socket};
    let socket_error = |e: std::io::Error| KernelError::refused("opening rtnetlink", e);
    let mut socket = Socket::new(NETLINK_ROUTE).map_err(socket_error)?;
    socket.bind_auto().map_err(socket_error)?;
    let mut out = Vec::new();
    let mut waiting = Vec::with_capacity(steps.len());
    for (seq, step) in (1u32..).zip(steps) {
        let mut req = NetlinkMessage::from(step.message);
        req.header.flags = step.flags;
        req.header.sequence_number = seq;
        req.finalize();
        let start = out.len();
        out.resize(start + req.buffer_len(), 0);
        req.serialize(&mut out[start..]);
        waiting.push((seq, step.tolerate, step.context, false));
    }
    let sent = socket
        .send(&out, 0)
        .map_err(|e| KernelError::refused("sending a netlink batch", e))?;
    if sent != out.len() {
        return Err(KernelError::Internal(format!(
            "the kernel took {sent} of {} bytes of a netlink batch",
            out.len()
        )));
    }
    let mut first = None;
    let mut buf: Vec<u8> = Vec::with_capacity(64 * 1024);
    while waiting.iter().any(|w| !w.3) {
        buf.clear();
        let n = socket
            .recv(&mut buf, 0)
            .map_err(|e| KernelError::refused("reading the answers to a netlink batch", e))?;
        let mut at = 0;
        while at < n {
            let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&buf[at..n])
                .map_err(|e| KernelError::Internal(format!("an unreadable netlink answer: {e}")))?;
            let len = msg.header.length as usize;
            if len == 0 {
                break;
            }
            // Netlink messages are 4-byte aligned.
            at += (len + 3) & !3;
            let NetlinkPayload::Error(e) = msg.payload else {
                continue;
            };
            let Some(w) = waiting
                .iter_mut()
                .find(|w| w.0 == msg.header.sequence_number)
            else {
                continue;
            };
            w.3 = true;
            let code = e.raw_code().abs();
            if code != 0 && Some(code) != w.1 && first.is_none() {
                first = Some(KernelError::refused(w.2.clone(), e.to_io()));
            }
        }
    }
    first.map_or(Ok(()), Err)
}

/// The host route to one pod address: `ip/32 dev <host> scope link proto 201`.
pub(super) fn host_route(ip: IpAddr, oif: u32) -> RouteMessage {
    let builder = match ip {
        IpAddr::V4(v4) => RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(v4, 32)
            .build(),
        IpAddr::V6(v6) => RouteMessageBuilder::<Ipv6Addr>::new()
            .destination_prefix(v6, 128)
            .build(),
    };
    let mut msg = builder;
    msg.header.protocol = RouteProtocol::Other(ROUTE_PROTOCOL);
    msg.header.scope = RouteScope::Link;
    msg.attributes.push(RouteAttribute::Oif(oif));
    msg
}

/// Selects our host route to `ip` for deletion, whatever its device: the
/// protocol keeps us off routes that others own.
pub(super) fn host_route_selector(ip: IpAddr) -> RouteMessage {
    let mut msg = RouteMessage::default();
    msg.header.address_family = family_of(ip);
    msg.header.destination_prefix_length = host_prefix_len(ip);
    msg.header.table = RouteHeader::RT_TABLE_MAIN;
    msg.header.protocol = RouteProtocol::Other(ROUTE_PROTOCOL);
    // RT_SCOPE_NOWHERE is the kernel's "any scope" for deletions.
    msg.header.scope = RouteScope::NoWhere;
    msg.header.kind = RouteType::Unspec;
    msg.attributes
        .push(RouteAttribute::Destination(RouteAddress::from(ip)));
    msg
}

/// A dump request for the main table of one family, narrowed by the kernel
/// (the connection uses strict checking) to a protocol and a device when
/// given. Callers still filter: a kernel without strict dumps ignores these.
pub(super) fn route_dump(
    family: AddressFamily,
    protocol: Option<u8>,
    oif: Option<u32>,
) -> RouteMessage {
    let mut msg = RouteMessage::default();
    msg.header.address_family = family;
    msg.header.table = RouteHeader::RT_TABLE_MAIN;
    if let Some(p) = protocol {
        msg.header.protocol = RouteProtocol::Other(p);
    }
    if let Some(i) = oif {
        msg.attributes.push(RouteAttribute::Oif(i));
    }
    msg
}

/// The pod's default route through the gateway of `gateway`'s family. IPv4
/// needs `onlink` because no subnet covers 169.254.1.1; fe80::1 is on-link by
/// definition.
pub(super) fn default_route(gateway: IpAddr, oif: u32) -> RouteMessage {
    let mut msg = match gateway {
        IpAddr::V4(v4) => RouteMessageBuilder::<Ipv4Addr>::new()
            .gateway(v4)
            .onlink()
            .build(),
        IpAddr::V6(v6) => RouteMessageBuilder::<Ipv6Addr>::new().gateway(v6).build(),
    };
    msg.header.protocol = RouteProtocol::Other(ROUTE_PROTOCOL);
    msg.attributes.push(RouteAttribute::Oif(oif));
    msg
}

/// A single-address assignment. IPv6 skips DAD so the address is usable the
/// moment ADD returns (the IPAM already guarantees uniqueness).
pub(super) fn address(ip: IpAddr, index: u32) -> AddressMessage {
    match ip {
        IpAddr::V4(v4) => AddressMessageBuilder::<Ipv4Addr>::new()
            .index(index)
            .address(v4, 32)
            .build(),
        IpAddr::V6(v6) => nodad(
            AddressMessageBuilder::<Ipv6Addr>::new()
                .index(index)
                .address(v6, 128)
                .build(),
        ),
    }
}

/// fe80::1/64 on the host veth, so that the node answers NDP for the
/// gateway. No DAD: every host veth carries the same address by design.
pub(super) fn gateway_v6_address(index: u32) -> AddressMessage {
    nodad(
        AddressMessageBuilder::<Ipv6Addr>::new()
            .index(index)
            .address(GATEWAY_V6, 64)
            .build(),
    )
}

fn nodad(mut msg: AddressMessage) -> AddressMessage {
    msg.header.flags |= AddressHeaderFlags::Nodad;
    msg.attributes
        .push(AddressAttribute::Flags(AddressFlags::Nodad));
    msg
}

/// The address an RTM_NEWADDR message is about: IFA_LOCAL for IPv4 (it is
/// the interface's own address on point-to-point links), IFA_ADDRESS else.
pub(super) fn address_of(msg: &AddressMessage) -> Option<IpAddr> {
    let local = msg.attributes.iter().find_map(|a| match a {
        AddressAttribute::Local(ip) => Some(*ip),
        _ => None,
    });
    local.or_else(|| {
        msg.attributes.iter().find_map(|a| match a {
            AddressAttribute::Address(ip) => Some(*ip),
            _ => None,
        })
    })
}

/// The permanent gateway neighbour on the pod interface, so that the first
/// packet does not wait for ARP or NDP. The MAC is the same on every node.
pub(super) fn gateway_neighbour(gateway: IpAddr, index: u32) -> NeighbourMessage {
    let mut msg = NeighbourMessage::default();
    msg.header.family = family_of(gateway);
    msg.header.ifindex = index;
    msg.header.state = NeighbourState::Permanent;
    msg.attributes
        .push(NeighbourAttribute::Destination(match gateway {
            IpAddr::V4(v4) => NeighbourAddress::Inet(v4),
            IpAddr::V6(v6) => NeighbourAddress::Inet6(v6),
        }));
    msg.attributes.push(NeighbourAttribute::LinkLayerAddress(
        GATEWAY_MAC.octets().to_vec(),
    ));
    msg
}

/// The destination of a route message as (address, prefix length); the
/// default route has no RTA_DST and comes back as the unspecified address.
pub(super) fn route_destination(msg: &RouteMessage) -> Option<(IpAddr, u8)> {
    let len = msg.header.destination_prefix_length;
    let dst = msg.attributes.iter().find_map(|a| match a {
        RouteAttribute::Destination(RouteAddress::Inet(v4)) => Some(IpAddr::V4(*v4)),
        RouteAttribute::Destination(RouteAddress::Inet6(v6)) => Some(IpAddr::V6(*v6)),
        _ => None,
    });
    match (dst, msg.header.address_family) {
        (Some(ip), _) => Some((ip, len)),
        (None, AddressFamily::Inet) => Some((IpAddr::V4(Ipv4Addr::UNSPECIFIED), len)),
        (None, AddressFamily::Inet6) => Some((IpAddr::V6(Ipv6Addr::UNSPECIFIED), len)),
        _ => None,
    }
}

/// The output device of a route message.
pub(super) fn route_oif(msg: &RouteMessage) -> Option<u32> {
    msg.attributes.iter().find_map(|a| match a {
        RouteAttribute::Oif(i) => Some(*i),
        _ => None,
    })
}

/// The gateway of a route message.
pub(super) fn route_gateway(msg: &RouteMessage) -> Option<IpAddr> {
    msg.attributes.iter().find_map(|a| match a {
        RouteAttribute::Gateway(RouteAddress::Inet(v4)) => Some(IpAddr::V4(*v4)),
        RouteAttribute::Gateway(RouteAddress::Inet6(v6)) => Some(IpAddr::V6(*v6)),
        _ => None,
    })
}

/// Name, MAC, MTU and admin state of a link message.
pub(super) struct LinkFacts {
    pub name: Option<String>,
    pub mac: Option<Vec<u8>>,
    pub mtu: Option<u32>,
    pub up: bool,
}

/// Reads the facts a CHECK compares from a link message.
pub(super) fn link_facts(msg: &LinkMessage) -> LinkFacts {
    let mut facts = LinkFacts {
        name: None,
        mac: None,
        mtu: None,
        up: msg.header.flags.contains(LinkFlags::Up),
    };
    for a in &msg.attributes {
        match a {
            LinkAttribute::IfName(n) => facts.name = Some(n.clone()),
            LinkAttribute::Address(m) => facts.mac = Some(m.clone()),
            LinkAttribute::Mtu(m) => facts.mtu = Some(*m),
            _ => {}
        }
    }
    facts
}

/// Looks a link up by name: Ok(None) when there is no such device.
pub(super) async fn link_by_name_get(
    handle: &Handle,
    name: &str,
) -> Result<Option<LinkMessage>, rtnetlink::Error> {
    let mut links = handle.link().get().match_name(name).execute();
    match links.try_next().await {
        Ok(link) => Ok(link),
        Err(e) if errno(&e) == Some(libc::ENODEV) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Every route of a dump request, filtered again on our side.
pub(super) async fn dump_routes(
    handle: &Handle,
    selector: RouteMessage,
) -> Result<Vec<RouteMessage>, rtnetlink::Error> {
    let family = selector.header.address_family;
    let protocol = selector.header.protocol;
    let oif = route_oif(&selector);
    let routes: Vec<RouteMessage> = handle.route().get(selector).execute().try_collect().await?;
    Ok(routes
        .into_iter()
        .filter(|r| r.header.address_family == family)
        .filter(|r| r.header.table == RouteHeader::RT_TABLE_MAIN)
        .filter(|r| protocol == RouteProtocol::Unspec || r.header.protocol == protocol)
        .filter(|r| oif.is_none() || route_oif(r) == oif)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn veth_message_carries_both_ends() {
        let msg = veth(
            "tth0123456789ab",
            "eth0",
            [0x0a, 0x58, 10, 1, 0, 5],
            1450,
            7,
        );
        assert!(msg.header.flags.contains(LinkFlags::Up));
        assert!(msg
            .attributes
            .contains(&LinkAttribute::IfName("tth0123456789ab".into())));
        assert!(msg
            .attributes
            .contains(&LinkAttribute::Address(GATEWAY_MAC.octets().to_vec())));
        assert!(msg.attributes.contains(&LinkAttribute::Mtu(1450)));
        let infos = msg
            .attributes
            .iter()
            .find_map(|a| match a {
                LinkAttribute::LinkInfo(i) => Some(i),
                _ => None,
            })
            .expect("link info");
        let peer = infos
            .iter()
            .find_map(|i| match i {
                rtnetlink::packet_route::link::LinkInfo::Data(InfoData::Veth(InfoVeth::Peer(
                    p,
                ))) => Some(p),
                _ => None,
            })
            .expect("peer");
        assert!(
            !peer.header.flags.contains(LinkFlags::Up),
            "veth_open would refuse"
        );
        assert!(peer
            .attributes
            .contains(&LinkAttribute::IfName("eth0".into())));
        assert!(peer.attributes.contains(&LinkAttribute::NetNsFd(7)));
        assert!(peer.attributes.contains(&LinkAttribute::Mtu(1450)));
        assert!(peer
            .attributes
            .contains(&LinkAttribute::Address(vec![0x0a, 0x58, 10, 1, 0, 5])));
    }

    #[test]
    fn host_route_is_ours_and_single_address() {
        let v4 = host_route("10.1.0.5".parse().unwrap(), 9);
        assert_eq!(v4.header.protocol, RouteProtocol::Other(201));
        assert_eq!(v4.header.scope, RouteScope::Link);
        assert_eq!(v4.header.table, RouteHeader::RT_TABLE_MAIN);
        assert_eq!(
            route_destination(&v4),
            Some(("10.1.0.5".parse().unwrap(), 32))
        );
        assert_eq!(route_oif(&v4), Some(9));
        let v6 = host_route("2001:db8::5".parse().unwrap(), 9);
        assert_eq!(
            route_destination(&v6),
            Some(("2001:db8::5".parse().unwrap(), 128))
        );
        let del = host_route_selector("2001:db8::5".parse().unwrap());
        assert_eq!(del.header.protocol, RouteProtocol::Other(201));
        assert_eq!(route_oif(&del), None);
    }

    #[test]
    fn pod_routes_and_addresses() {
        let r4 = default_route(IpAddr::V4(GATEWAY_V4), 3);
        assert_eq!(route_gateway(&r4), Some(IpAddr::V4(GATEWAY_V4)));
        assert_eq!(
            route_destination(&r4),
            Some((IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0))
        );
        assert!(r4
            .header
            .flags
            .contains(rtnetlink::packet_route::route::RouteFlags::Onlink));
        let a6 = address("2001:db8::5".parse().unwrap(), 3);
        assert_eq!(a6.header.prefix_len, 128);
        assert!(a6
            .attributes
            .contains(&AddressAttribute::Flags(AddressFlags::Nodad)));
        let a4 = address("10.1.0.5".parse().unwrap(), 3);
        assert_eq!(a4.header.prefix_len, 32);
        assert_eq!(address_of(&a4), Some("10.1.0.5".parse().unwrap()));
        assert_eq!(
            gateways(&["2001:db8::5".parse().unwrap(), "10.0.0.1".parse().unwrap()]),
            vec![IpAddr::V4(GATEWAY_V4), IpAddr::V6(GATEWAY_V6)]
        );
        let n = gateway_neighbour(IpAddr::V6(GATEWAY_V6), 3);
        assert_eq!(n.header.state, NeighbourState::Permanent);
    }
}
