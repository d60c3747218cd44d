//! The answers, as pure functions of one received frame and the guest's
//! lease: no socket, no clock, no state. A guest is answered the same on
//! every node and after any restart, because nothing but the lease (from the
//! VM's record) goes into an answer.
//!
//! Wire formats: DHCPv4 and DHCPv6 messages through `dhcproto`; Ethernet,
//! IPv4, IPv6, UDP and ICMPv6 headers and their checksums through
//! `etherparse`. The two NDP options of a router advertisement (source
//! link-layer address, MTU) are written here: etherparse parses NDP options
//! but has no builder for them, and each is 8 fixed bytes (RFC 4861 §4.6).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use dhcproto::{v4, v6, Decodable, Decoder, Encodable, Encoder, Name};
use etherparse::icmpv6::RouterAdvertisementHeader;
use etherparse::{
    ArpOperation, ArpPacket, ArpPacketSlice, EtherType, Icmpv6Type, LinkSlice, NetSlice,
    PacketBuilder, SlicedPacket, TransportSlice,
};
use ipnet::Ipv4Net;

use tether_kernel::{GuestLease, GATEWAY_MAC, GATEWAY_V4, GATEWAY_V6};

/// The DHCPv4 server and client ports.
const DHCP4_SERVER: u16 = 67;
const DHCP4_CLIENT: u16 = 68;
/// The DHCPv6 server and client ports.
const DHCP6_SERVER: u16 = 547;
const DHCP6_CLIENT: u16 = 546;
/// How long the guest keeps 169.254.1.1 / fe80::1 as its default router
/// without hearing from it: 30 minutes, renewed by the periodic
/// advertisements.
pub const ROUTER_LIFETIME_SECS: u16 = 1800;
/// The all-nodes multicast group and its MAC.
const ALL_NODES: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
const ALL_NODES_MAC: [u8; 6] = [0x33, 0x33, 0, 0, 0, 1];
const BROADCAST_MAC: [u8; 6] = [0xff; 6];
/// IP TTL and hop limit of answers (RAs must carry 255, RFC 4861 §6.1.2).
const TTL: u8 = 64;
const NDP_HOP_LIMIT: u8 = 255;

/// Why a frame was not answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dropped {
    /// Truncated, undecodable, or not what its headers claim.
    Malformed,
    /// From a MAC other than the VM's: only the guest is answered.
    ForeignMac,
    /// A well-formed request this server does not answer (a DHCPv4
    /// request for another server, a message type servers never get).
    Unanswered,
}

/// What became of one frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Frames to send back on the same interface.
    Reply(Kind, Vec<Vec<u8>>),
    /// Not for us at all (another protocol the filter let through, our own
    /// frames): not counted.
    Ignored,
    /// For us, but not answered.
    Dropped(Dropped),
}

/// Which exchange an answer belongs to, for the counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// DHCPv4.
    Dhcp4,
    /// DHCPv6.
    Dhcp6,
    /// A router advertisement answering a solicitation.
    RouterAdvert,
    /// An ARP reply for the gateway.
    Arp,
}

/// Answers one received frame for the guest of `lease`.
pub fn respond(frame: &[u8], lease: &GuestLease) -> Outcome {
    let Ok(packet) = SlicedPacket::from_ethernet(frame) else {
        return Outcome::Dropped(Dropped::Malformed);
    };
    let Some(LinkSlice::Ethernet2(eth)) = &packet.link else {
        return Outcome::Ignored;
    };
    let src_mac = eth.source();
    if src_mac == GATEWAY_MAC.octets() {
        // Our own answers, looped back by the packet socket.
        return Outcome::Ignored;
    }
    let foreign = src_mac != lease.mac.octets();
    match (&packet.net, &packet.transport) {
        (Some(NetSlice::Arp(arp)), _) => answer_arp(arp, src_mac, foreign, lease),
        (Some(NetSlice::Ipv4(ip)), Some(TransportSlice::Udp(udp))) => {
            if udp.destination_port() != DHCP4_SERVER {
                return Outcome::Ignored;
            }
            if ip.is_payload_fragmented() {
                return Outcome::Dropped(Dropped::Malformed);
            }
            if foreign {
                return Outcome::Dropped(Dropped::ForeignMac);
            }
            answer_dhcp4(udp.payload(), lease)
        }
        (Some(NetSlice::Ipv6(ip)), Some(TransportSlice::Udp(udp))) => {
            if udp.destination_port() != DHCP6_SERVER {
                return Outcome::Ignored;
            }
            if foreign {
                return Outcome::Dropped(Dropped::ForeignMac);
            }
            let src = ip.header().source_addr();
            answer_dhcp6(udp.payload(), src_mac, src, lease)
        }
        (Some(NetSlice::Ipv6(ip)), Some(TransportSlice::Icmpv6(icmp))) => {
            if icmp.icmp_type() != Icmpv6Type::RouterSolicitation {
                return Outcome::Ignored;
            }
            if ip.header().hop_limit() != NDP_HOP_LIMIT {
                // RFC 4861 §6.1.1: not from the link.
                return Outcome::Dropped(Dropped::Malformed);
            }
            if foreign {
                return Outcome::Dropped(Dropped::ForeignMac);
            }
            if lease.ips.iter().all(IpAddr::is_ipv4) {
                return Outcome::Dropped(Dropped::Unanswered);
            }
            let src = ip.header().source_addr();
            // From the unspecified address the answer goes to all nodes.
            let (dst, dst_mac) = if src.is_unspecified() {
                (ALL_NODES, ALL_NODES_MAC)
            } else {
                (src, src_mac)
            };
            match router_advertisement(lease, dst, dst_mac) {
                Some(f) => Outcome::Reply(Kind::RouterAdvert, vec![f]),
                None => Outcome::Dropped(Dropped::Malformed),
            }
        }
        (Some(_), None) => Outcome::Dropped(Dropped::Malformed),
        _ => Outcome::Ignored,
    }
}

/// An unsolicited router advertisement to all nodes, if the guest has an
/// IPv6 address.
pub fn unsolicited_advertisement(lease: &GuestLease) -> Option<Vec<u8>> {
    if lease.ips.iter().all(IpAddr::is_ipv4) {
        return None;
    }
    router_advertisement(lease, ALL_NODES, ALL_NODES_MAC)
}

fn v4_of(lease: &GuestLease) -> Option<Ipv4Addr> {
    lease.ips.iter().find_map(|ip| match ip {
        IpAddr::V4(v4) => Some(*v4),
        IpAddr::V6(_) => None,
    })
}

fn v6_of(lease: &GuestLease) -> Option<Ipv6Addr> {
    lease.ips.iter().find_map(|ip| match ip {
        IpAddr::V6(v6) => Some(*v6),
        IpAddr::V4(_) => None,
    })
}

// ---- ARP ---------------------------------------------------------------

/// The guest asking for its gateway's MAC: answered here, whatever the
/// node's proxy ARP would do (it answers only when the node has a route to
/// 169.254.1.1 through another link).
fn answer_arp(
    arp: &ArpPacketSlice<'_>,
    src_mac: [u8; 6],
    foreign: bool,
    lease: &GuestLease,
) -> Outcome {
    if arp.operation() != ArpOperation::REQUEST || arp.target_protocol_addr() != GATEWAY_V4.octets()
    {
        return Outcome::Ignored;
    }
    if foreign {
        return Outcome::Dropped(Dropped::ForeignMac);
    }
    let (Ok(sha), Ok(spa)) = (
        <[u8; 6]>::try_from(arp.sender_hw_addr()),
        <[u8; 4]>::try_from(arp.sender_protocol_addr()),
    ) else {
        return Outcome::Dropped(Dropped::Malformed);
    };
    if sha != src_mac || v4_of(lease).is_none() {
        return Outcome::Dropped(Dropped::Unanswered);
    }
    let Ok(reply) = ArpPacket::new(
        arp.hw_addr_type(),
        EtherType::IPV4,
        ArpOperation::REPLY,
        &GATEWAY_MAC.octets(),
        &GATEWAY_V4.octets(),
        &sha,
        &spa,
    ) else {
        return Outcome::Dropped(Dropped::Malformed);
    };
    let mut frame = Vec::with_capacity(42);
    frame.extend_from_slice(&sha);
    frame.extend_from_slice(&GATEWAY_MAC.octets());
    frame.extend_from_slice(&EtherType::ARP.0.to_be_bytes());
    if reply.write(&mut frame).is_err() {
        return Outcome::Dropped(Dropped::Malformed);
    }
    Outcome::Reply(Kind::Arp, vec![frame])
}

// ---- DHCPv4 --------------------------------------------------------------

/// Whether the option lengths are what dhcproto's decoder asserts they are.
/// It checks a few fixed-length options with `debug_assert!` (RFC 3396
/// concatenation included), so a hostile guest could stop a debug build's
/// answer task; found by the proptest corpus. Such a packet is malformed
/// anyway.
fn option_lengths_fit(payload: &[u8]) -> bool {
    // op .. file (236 bytes), then the magic cookie.
    let mut rest = payload.get(240..).unwrap_or_default();
    // Per option code: present, and its total length.
    let mut total: [Option<usize>; 256] = [None; 256];
    while let Some((&code, tail)) = rest.split_first() {
        match code {
            0 => rest = tail,
            255 => break,
            _ => {
                let Some((&len, tail)) = tail.split_first() else {
                    return false;
                };
                let Some(tail) = tail.get(usize::from(len)..) else {
                    return false;
                };
                let sum = total[usize::from(code)].get_or_insert(0);
                *sum += usize::from(len);
                rest = tail;
            }
        }
    }
    let is = |code: usize, ok: fn(usize) -> bool| total[code].is_none_or(ok);
    is(80, |n| n == 0)
        && is(94, |n| n == 3)
        && is(81, |n| n >= 3)
        && (152..=155).all(|c| is(c, |n| n == 4))
}

fn answer_dhcp4(payload: &[u8], lease: &GuestLease) -> Outcome {
    if !option_lengths_fit(payload) {
        return Outcome::Dropped(Dropped::Malformed);
    }
    let Ok(msg) = v4::Message::decode(&mut Decoder::new(payload)) else {
        return Outcome::Dropped(Dropped::Malformed);
    };
    // dhcproto's chaddr() slices its 16-byte field by the packet's hlen and
    // panics past 16 (found by the proptest corpus): check hlen first.
    if msg.opcode() != v4::Opcode::BootRequest || msg.htype() != v4::HType::Eth || msg.hlen() != 6 {
        return Outcome::Dropped(Dropped::Malformed);
    }
    if msg.chaddr() != lease.mac.octets() {
        return Outcome::Dropped(Dropped::ForeignMac);
    }
    let Some(ip) = v4_of(lease) else {
        return Outcome::Dropped(Dropped::Unanswered);
    };
    let requested = match msg.opts().get(v4::OptionCode::RequestedIpAddress) {
        Some(v4::DhcpOption::RequestedIpAddress(r)) => Some(*r),
        _ => None,
    };
    let server = match msg.opts().get(v4::OptionCode::ServerIdentifier) {
        Some(v4::DhcpOption::ServerIdentifier(s)) => Some(*s),
        _ => None,
    };
    use v4::MessageType as M;
    let (reply_type, yiaddr) = match msg.opts().msg_type() {
        Some(M::Discover) => (M::Offer, ip),
        Some(M::Request) => {
            if server.is_some_and(|s| s != GATEWAY_V4) {
                // The client chose another server's offer.
                return Outcome::Dropped(Dropped::Unanswered);
            }
            // SELECTING/INIT-REBOOT name the address in option 50;
            // RENEWING/REBINDING in ciaddr.
            let asked = requested.unwrap_or(msg.ciaddr());
            if asked == ip {
                (M::Ack, ip)
            } else {
                (M::Nak, Ipv4Addr::UNSPECIFIED)
            }
        }
        Some(M::Inform) => (M::Ack, Ipv4Addr::UNSPECIFIED),
        // Nothing to answer, nothing to free: the address is the VM's.
        Some(M::Release) | Some(M::Decline) => return Outcome::Dropped(Dropped::Unanswered),
        _ => return Outcome::Dropped(Dropped::Unanswered),
    };
    let mut reply = v4::Message::default();
    reply
        .set_opcode(v4::Opcode::BootReply)
        .set_htype(v4::HType::Eth)
        .set_xid(msg.xid())
        .set_flags(msg.flags())
        .set_ciaddr(msg.ciaddr())
        .set_yiaddr(yiaddr)
        .set_giaddr(msg.giaddr())
        .set_chaddr(msg.chaddr());
    let opts = reply.opts_mut();
    opts.insert(v4::DhcpOption::MessageType(reply_type));
    opts.insert(v4::DhcpOption::ServerIdentifier(GATEWAY_V4));
    if reply_type != M::Nak {
        add_dhcp4_options(opts, lease, reply_type == M::Ack && yiaddr.is_unspecified());
    }
    let mut bytes = Vec::with_capacity(512);
    if reply.encode(&mut Encoder::new(&mut bytes)).is_err() {
        return Outcome::Dropped(Dropped::Malformed);
    }
    // RFC 2131 §4.1: to ciaddr when the client has one, else broadcast when
    // it asks, else to the offered address at the client's MAC (we know
    // it, so no ARP is needed). A NAK is always broadcast.
    let client_mac = lease.mac.octets();
    let (dst_ip, dst_mac) = if reply_type == M::Nak {
        (Ipv4Addr::BROADCAST, BROADCAST_MAC)
    } else if !msg.ciaddr().is_unspecified() {
        (msg.ciaddr(), client_mac)
    } else if msg.flags().broadcast() {
        (Ipv4Addr::BROADCAST, BROADCAST_MAC)
    } else {
        (yiaddr, client_mac)
    };
    let builder = PacketBuilder::ethernet2(GATEWAY_MAC.octets(), dst_mac)
        .ipv4(GATEWAY_V4.octets(), dst_ip.octets(), TTL)
        .udp(DHCP4_SERVER, DHCP4_CLIENT);
    let mut frame = Vec::with_capacity(builder.size(bytes.len()));
    if builder.write(&mut frame, &bytes).is_err() {
        return Outcome::Dropped(Dropped::Malformed);
    }
    Outcome::Reply(Kind::Dhcp4, vec![frame])
}

/// Every option the guest needs, whatever it asked for. An INFORM's answer
/// leaves out the lease times (RFC 2131 §3.4).
fn add_dhcp4_options(opts: &mut v4::DhcpOptions, lease: &GuestLease, inform: bool) {
    use v4::DhcpOption as O;
    opts.insert(O::SubnetMask(Ipv4Addr::BROADCAST));
    opts.insert(O::Router(vec![GATEWAY_V4]));
    // A /32 with an off-link gateway: the gateway's host route first, then
    // the default route through it (RFC 3442; clients that know option 121
    // ignore option 3).
    if let Ok(gw_net) = Ipv4Net::new(GATEWAY_V4, 32) {
        opts.insert(O::ClasslessStaticRoute(vec![
            (gw_net, Ipv4Addr::UNSPECIFIED),
            (Ipv4Net::default(), GATEWAY_V4),
        ]));
    }
    let dns: Vec<Ipv4Addr> = lease
        .options
        .dns
        .iter()
        .filter_map(|ip| match ip {
            IpAddr::V4(v4) => Some(*v4),
            IpAddr::V6(_) => None,
        })
        .collect();
    if !dns.is_empty() {
        opts.insert(O::DomainNameServer(dns));
    }
    let names = domain_names(&lease.options.search);
    if let Some(first) = lease.options.search.first() {
        opts.insert(O::DomainName(first.clone()));
    }
    if !names.is_empty() {
        opts.insert(O::DomainSearch(names));
    }
    if let Ok(mtu) = u16::try_from(lease.mtu) {
        opts.insert(O::InterfaceMtu(mtu));
    }
    if !lease.hostname.is_empty() {
        opts.insert(O::Hostname(lease.hostname.clone()));
    }
    if !inform {
        let secs = lease.options.lease_seconds;
        opts.insert(O::AddressLeaseTime(secs));
        opts.insert(O::Renewal(secs / 2));
        opts.insert(O::Rebinding(secs / 8 * 7));
    }
}

/// The search domains that are valid DNS names.
fn domain_names(search: &[String]) -> Vec<Name> {
    search
        .iter()
        .filter_map(|s| Name::from_utf8(s).ok())
        .collect()
}

// ---- DHCPv6 --------------------------------------------------------------

/// The server's DUID: DUID-LL (RFC 8415 §11.4) of the gateway MAC, the same
/// on every node, so that a client renewing after its VM moved finds its
/// server.
pub fn server_duid() -> Vec<u8> {
    let mut duid = vec![0, 3, 0, 1];
    duid.extend_from_slice(&GATEWAY_MAC.octets());
    duid
}

fn answer_dhcp6(payload: &[u8], src_mac: [u8; 6], src: Ipv6Addr, lease: &GuestLease) -> Outcome {
    let Ok(msg) = v6::Message::decode(&mut Decoder::new(payload)) else {
        return Outcome::Dropped(Dropped::Malformed);
    };
    let client_id = match msg.opts().get(v6::OptionCode::ClientId) {
        Some(v6::DhcpOption::ClientId(id)) => Some(id.clone()),
        _ => None,
    };
    let server_id = match msg.opts().get(v6::OptionCode::ServerId) {
        Some(v6::DhcpOption::ServerId(id)) => Some(id.clone()),
        _ => None,
    };
    use v6::MessageType as M;
    let mine = server_id.as_deref().is_none_or(|id| id == server_duid());
    let rapid = msg.opts().get(v6::OptionCode::RapidCommit).is_some();
    let reply_type = match msg.msg_type() {
        M::Solicit if rapid => M::Reply,
        M::Solicit => M::Advertise,
        M::Request | M::Renew | M::Release | M::Decline if mine => M::Reply,
        M::Rebind | M::Confirm | M::InformationRequest => M::Reply,
        _ => return Outcome::Dropped(Dropped::Unanswered),
    };
    let Some(client_id) = client_id
        .filter(|_| msg.msg_type() != M::InformationRequest)
        .or(
            // An information request may come without a client id.
            if msg.msg_type() == M::InformationRequest {
                Some(Vec::new())
            } else {
                None
            },
        )
    else {
        return Outcome::Dropped(Dropped::Malformed);
    };
    let mut reply = v6::Message::new_with_id(reply_type, msg.xid());
    let opts = reply.opts_mut();
    if !client_id.is_empty() {
        opts.insert(v6::DhcpOption::ClientId(client_id));
    }
    opts.insert(v6::DhcpOption::ServerId(server_duid()));
    if reply_type == M::Reply && rapid && msg.msg_type() == M::Solicit {
        opts.insert(v6::DhcpOption::RapidCommit);
    }
    let ip = v6_of(lease);
    let secs = lease.options.lease_seconds;
    match msg.msg_type() {
        M::Release | M::Decline => {
            opts.insert(v6::DhcpOption::StatusCode(v6::StatusCode {
                status: v6::Status::Success,
                msg: String::new(),
            }));
        }
        M::Confirm => {
            // The address is on-link for the guest only if it is its own.
            let asked: Vec<Ipv6Addr> = ia_addresses(&msg);
            let ok = ip.is_some() && asked.iter().all(|a| Some(*a) == ip);
            opts.insert(v6::DhcpOption::StatusCode(v6::StatusCode {
                status: if ok {
                    v6::Status::Success
                } else {
                    v6::Status::NotOnLink
                },
                msg: String::new(),
            }));
        }
        M::InformationRequest => {}
        _ => {
            // One IA_NA per IA_NA asked for, each with the VM's address.
            let ids = ia_ids(&msg);
            if ids.is_empty() {
                return Outcome::Dropped(Dropped::Unanswered);
            }
            for id in ids {
                let mut ia = v6::IANA {
                    id,
                    t1: secs / 2,
                    t2: secs / 8 * 7,
                    opts: v6::DhcpOptions::new(),
                };
                match ip {
                    Some(addr) => ia.opts.insert(v6::DhcpOption::IAAddr(v6::IAAddr {
                        addr,
                        preferred_life: secs,
                        valid_life: secs,
                        opts: v6::DhcpOptions::new(),
                    })),
                    None => ia.opts.insert(v6::DhcpOption::StatusCode(v6::StatusCode {
                        status: v6::Status::NoAddrsAvail,
                        msg: "this VM has no IPv6 address".into(),
                    })),
                }
                opts.insert(v6::DhcpOption::IANA(ia));
            }
        }
    }
    let dns: Vec<Ipv6Addr> = lease
        .options
        .dns
        .iter()
        .filter_map(|ip| match ip {
            IpAddr::V6(v6) => Some(*v6),
            IpAddr::V4(_) => None,
        })
        .collect();
    if !dns.is_empty() {
        opts.insert(v6::DhcpOption::DomainNameServers(dns));
    }
    let names = domain_names(&lease.options.search);
    if !names.is_empty() {
        opts.insert(v6::DhcpOption::DomainSearchList(names));
    }
    let mut bytes = Vec::with_capacity(256);
    if reply.encode(&mut Encoder::new(&mut bytes)).is_err() {
        return Outcome::Dropped(Dropped::Malformed);
    }
    let builder = PacketBuilder::ethernet2(GATEWAY_MAC.octets(), src_mac)
        .ipv6(GATEWAY_V6.octets(), src.octets(), TTL)
        .udp(DHCP6_SERVER, DHCP6_CLIENT);
    let mut frame = Vec::with_capacity(builder.size(bytes.len()));
    if builder.write(&mut frame, &bytes).is_err() {
        return Outcome::Dropped(Dropped::Malformed);
    }
    Outcome::Reply(Kind::Dhcp6, vec![frame])
}

/// The IAIDs of the message's IA_NA options.
fn ia_ids(msg: &v6::Message) -> Vec<u32> {
    msg.opts()
        .iter()
        .filter_map(|o| match o {
            v6::DhcpOption::IANA(ia) => Some(ia.id),
            _ => None,
        })
        .collect()
}

/// The addresses inside the message's IA_NA options.
fn ia_addresses(msg: &v6::Message) -> Vec<Ipv6Addr> {
    msg.opts()
        .iter()
        .filter_map(|o| match o {
            v6::DhcpOption::IANA(ia) => Some(ia),
            _ => None,
        })
        .flat_map(|ia| {
            ia.opts.iter().filter_map(|o| match o {
                v6::DhcpOption::IAAddr(a) => Some(a.addr),
                _ => None,
            })
        })
        .collect()
}

// ---- Router advertisements -------------------------------------------------

/// NDP option types (RFC 4861 §4.6).
const NDP_SOURCE_LINK_LAYER: u8 = 1;
const NDP_MTU: u8 = 5;

/// An RA from fe80::1: a default router for [`ROUTER_LIFETIME_SECS`], M and
/// O set (the address and DNS come from DHCPv6), no prefix information (no
/// SLAAC: the guest's address is the VM's /128), the gateway MAC and the
/// MTU as options.
fn router_advertisement(lease: &GuestLease, dst: Ipv6Addr, dst_mac: [u8; 6]) -> Option<Vec<u8>> {
    let header = RouterAdvertisementHeader {
        cur_hop_limit: TTL,
        managed_address_config: true,
        other_config: true,
        router_lifetime: ROUTER_LIFETIME_SECS,
    };
    let mut body = Vec::with_capacity(24);
    // Reachable time and retransmission timer: 0, unspecified.
    body.extend_from_slice(&[0u8; 8]);
    body.extend_from_slice(&[NDP_SOURCE_LINK_LAYER, 1]);
    body.extend_from_slice(&GATEWAY_MAC.octets());
    body.extend_from_slice(&[NDP_MTU, 1, 0, 0]);
    body.extend_from_slice(&lease.mtu.to_be_bytes());
    let builder = PacketBuilder::ethernet2(GATEWAY_MAC.octets(), dst_mac)
        .ipv6(GATEWAY_V6.octets(), dst.octets(), NDP_HOP_LIMIT)
        .icmpv6(Icmpv6Type::RouterAdvertisement(header));
    let mut frame = Vec::with_capacity(builder.size(body.len()));
    builder.write(&mut frame, &body).ok()?;
    Some(frame)
}
