//! The responder against requests built with the same wire-format crates a
//! client would use, every answer parsed back; a proptest corpus of random
//! and mutated frames; and, as root, busybox's real `udhcpc` against the
//! real server across a veth between two network namespaces.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use dhcproto::{v4, v6, Decodable, Decoder, Encodable, Encoder};
use etherparse::{Icmpv6Type, LinkSlice, NetSlice, PacketBuilder, SlicedPacket, TransportSlice};
use proptest::prelude::*;

use super::responder::{respond, server_duid, unsolicited_advertisement, Dropped, Kind, Outcome};
use tether_base::guest::DhcpOptions;
use tether_base::mac::Mac;
use tether_kernel::{GuestLease, GATEWAY_MAC, GATEWAY_V4, GATEWAY_V6};

const GUEST: [u8; 6] = [0x0a, 0x58, 0x0a, 0x01, 0x00, 0x07];
const OTHER: [u8; 6] = [0x52, 0x54, 0x00, 0xaa, 0xbb, 0xcc];

fn lease() -> GuestLease {
    GuestLease {
        mac: Mac::new(GUEST),
        ips: vec!["10.1.0.7".parse().unwrap(), "fd00:1::7".parse().unwrap()],
        hostname: "vm1".into(),
        mtu: 1450,
        options: DhcpOptions {
            lease_seconds: 3600,
            dns: vec!["10.96.0.10".parse().unwrap(), "fd00:96::a".parse().unwrap()],
            search: vec!["default.svc.cluster.local".into(), "cluster.local".into()],
            hostname: None,
        },
    }
}

// ---- Building requests ------------------------------------------------------

fn dhcp4_frame(src_mac: [u8; 6], msg: &v4::Message, src: Ipv4Addr, dst: Ipv4Addr) -> Vec<u8> {
    let mut payload = Vec::new();
    msg.encode(&mut Encoder::new(&mut payload)).unwrap();
    let builder = PacketBuilder::ethernet2(src_mac, [0xff; 6])
        .ipv4(src.octets(), dst.octets(), 64)
        .udp(68, 67);
    let mut frame = Vec::new();
    builder.write(&mut frame, &payload).unwrap();
    frame
}

fn dhcp4(kind: v4::MessageType, chaddr: [u8; 6]) -> v4::Message {
    let mut m = v4::Message::default();
    m.set_opcode(v4::Opcode::BootRequest)
        .set_htype(v4::HType::Eth)
        .set_xid(0x1234_5678)
        .set_chaddr(&chaddr);
    m.opts_mut().insert(v4::DhcpOption::MessageType(kind));
    m
}

fn discover(mac: [u8; 6]) -> Vec<u8> {
    dhcp4_frame(
        mac,
        &dhcp4(v4::MessageType::Discover, mac),
        Ipv4Addr::UNSPECIFIED,
        Ipv4Addr::BROADCAST,
    )
}

fn request(requested: Ipv4Addr, server: Ipv4Addr) -> Vec<u8> {
    let mut m = dhcp4(v4::MessageType::Request, GUEST);
    m.opts_mut()
        .insert(v4::DhcpOption::RequestedIpAddress(requested));
    m.opts_mut()
        .insert(v4::DhcpOption::ServerIdentifier(server));
    dhcp4_frame(GUEST, &m, Ipv4Addr::UNSPECIFIED, Ipv4Addr::BROADCAST)
}

fn renew(ciaddr: Ipv4Addr) -> Vec<u8> {
    let mut m = dhcp4(v4::MessageType::Request, GUEST);
    m.set_ciaddr(ciaddr);
    dhcp4_frame(GUEST, &m, ciaddr, GATEWAY_V4)
}

fn dhcp6_frame(src_mac: [u8; 6], msg: &v6::Message) -> Vec<u8> {
    let mut payload = Vec::new();
    msg.encode(&mut Encoder::new(&mut payload)).unwrap();
    let src: Ipv6Addr = "fe80::858:aff:fe01:7".parse().unwrap();
    let dst: Ipv6Addr = "ff02::1:2".parse().unwrap();
    let builder = PacketBuilder::ethernet2(src_mac, [0x33, 0x33, 0, 1, 0, 2])
        .ipv6(src.octets(), dst.octets(), 1)
        .udp(546, 547);
    let mut frame = Vec::new();
    builder.write(&mut frame, &payload).unwrap();
    frame
}

fn dhcp6(kind: v6::MessageType, server: Option<Vec<u8>>) -> v6::Message {
    let mut m = v6::Message::new_with_id(kind, [1, 2, 3]);
    m.opts_mut()
        .insert(v6::DhcpOption::ClientId(vec![0, 3, 0, 1, 1, 2, 3, 4, 5, 6]));
    if let Some(id) = server {
        m.opts_mut().insert(v6::DhcpOption::ServerId(id));
    }
    m.opts_mut().insert(v6::DhcpOption::IANA(v6::IANA {
        id: 77,
        t1: 0,
        t2: 0,
        opts: v6::DhcpOptions::new(),
    }));
    m
}

fn solicitation(src_mac: [u8; 6], hop_limit: u8) -> Vec<u8> {
    let src: Ipv6Addr = "fe80::858:aff:fe01:7".parse().unwrap();
    let dst: Ipv6Addr = "ff02::2".parse().unwrap();
    let builder = PacketBuilder::ethernet2(src_mac, [0x33, 0x33, 0, 0, 0, 2])
        .ipv6(src.octets(), dst.octets(), hop_limit)
        .icmpv6(Icmpv6Type::RouterSolicitation);
    let mut frame = Vec::new();
    builder.write(&mut frame, &[0u8; 4]).unwrap();
    frame
}

fn arp_request(src_mac: [u8; 6], target: [u8; 4]) -> Vec<u8> {
    let mut f = vec![0xff; 6];
    f.extend_from_slice(&src_mac);
    f.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0, 6, 4, 0, 1]);
    f.extend_from_slice(&src_mac);
    f.extend_from_slice(&[10, 1, 0, 7]);
    f.extend_from_slice(&[0; 6]);
    f.extend_from_slice(&target);
    f
}

// ---- Reading answers ----------------------------------------------------------

fn one(outcome: Outcome, want: Kind) -> Vec<u8> {
    match outcome {
        Outcome::Reply(kind, mut frames) if kind == want && frames.len() == 1 => {
            frames.pop().unwrap()
        }
        other => panic!("expected one {want:?} answer, got {other:?}"),
    }
}

/// (dst MAC, src IP, dst IP, UDP payload) of an answer.
fn udp_of(frame: &[u8]) -> ([u8; 6], IpAddr, IpAddr, (u16, u16), Vec<u8>) {
    let p = SlicedPacket::from_ethernet(frame).expect("the answer parses");
    let Some(LinkSlice::Ethernet2(eth)) = p.link else {
        panic!("not Ethernet")
    };
    assert_eq!(eth.source(), GATEWAY_MAC.octets());
    let (src, dst) = match p.net {
        Some(NetSlice::Ipv4(ip)) => (
            IpAddr::V4(ip.header().source_addr()),
            IpAddr::V4(ip.header().destination_addr()),
        ),
        Some(NetSlice::Ipv6(ip)) => (
            IpAddr::V6(ip.header().source_addr()),
            IpAddr::V6(ip.header().destination_addr()),
        ),
        _ => panic!("not IP"),
    };
    let Some(TransportSlice::Udp(udp)) = p.transport else {
        panic!("not UDP")
    };
    (
        eth.destination(),
        src,
        dst,
        (udp.source_port(), udp.destination_port()),
        udp.payload().to_vec(),
    )
}

fn v4_answer(frame: &[u8]) -> v4::Message {
    let (_, src, _, ports, payload) = udp_of(frame);
    assert_eq!(src, IpAddr::V4(GATEWAY_V4));
    assert_eq!(ports, (67, 68));
    v4::Message::decode(&mut Decoder::new(&payload)).expect("DHCPv4")
}

fn v6_answer(frame: &[u8]) -> v6::Message {
    let (_, src, _, ports, payload) = udp_of(frame);
    assert_eq!(src, IpAddr::V6(GATEWAY_V6));
    assert_eq!(ports, (547, 546));
    v6::Message::decode(&mut Decoder::new(&payload)).expect("DHCPv6")
}

fn opt4(m: &v4::Message, code: v4::OptionCode) -> v4::DhcpOption {
    m.opts()
        .get(code)
        .unwrap_or_else(|| panic!("option {code:?} missing"))
        .clone()
}

// ---- DHCPv4 ------------------------------------------------------------------

#[test]
fn a_discover_gets_an_offer_with_every_option() {
    let f = one(respond(&discover(GUEST), &lease()), Kind::Dhcp4);
    let (dst_mac, _, dst, _, _) = udp_of(&f);
    // No broadcast flag, no ciaddr: to the offered address at the guest.
    assert_eq!(dst_mac, GUEST);
    assert_eq!(dst, IpAddr::V4("10.1.0.7".parse().unwrap()));
    let m = v4_answer(&f);
    use v4::{DhcpOption as O, OptionCode as C};
    assert_eq!(m.opcode(), v4::Opcode::BootReply);
    assert_eq!(m.xid(), 0x1234_5678);
    assert_eq!(m.yiaddr(), "10.1.0.7".parse::<Ipv4Addr>().unwrap());
    assert_eq!(&m.chaddr()[..6], &GUEST);
    assert_eq!(m.opts().msg_type(), Some(v4::MessageType::Offer));
    assert_eq!(
        opt4(&m, C::ServerIdentifier),
        O::ServerIdentifier(GATEWAY_V4)
    );
    assert_eq!(opt4(&m, C::SubnetMask), O::SubnetMask(Ipv4Addr::BROADCAST));
    assert_eq!(opt4(&m, C::Router), O::Router(vec![GATEWAY_V4]));
    assert_eq!(
        opt4(&m, C::ClasslessStaticRoute),
        O::ClasslessStaticRoute(vec![
            ("169.254.1.1/32".parse().unwrap(), Ipv4Addr::UNSPECIFIED),
            ("0.0.0.0/0".parse().unwrap(), GATEWAY_V4),
        ])
    );
    assert_eq!(
        opt4(&m, C::DomainNameServer),
        O::DomainNameServer(vec!["10.96.0.10".parse().unwrap()])
    );
    assert_eq!(
        opt4(&m, C::DomainName),
        O::DomainName("default.svc.cluster.local".into())
    );
    match opt4(&m, C::DomainSearch) {
        O::DomainSearch(names) => {
            let names: Vec<String> = names.iter().map(|n| n.to_utf8()).collect();
            assert_eq!(
                names,
                ["default.svc.cluster.local.", "cluster.local."],
                "{names:?}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(opt4(&m, C::InterfaceMtu), O::InterfaceMtu(1450));
    assert_eq!(opt4(&m, C::Hostname), O::Hostname("vm1".into()));
    assert_eq!(opt4(&m, C::AddressLeaseTime), O::AddressLeaseTime(3600));
    assert_eq!(opt4(&m, C::Renewal), O::Renewal(1800));
    assert_eq!(opt4(&m, C::Rebinding), O::Rebinding(3150));
}

#[test]
fn requests_are_acked_for_the_vms_address_and_nakked_for_any_other() {
    let ack = v4_answer(&one(
        respond(&request("10.1.0.7".parse().unwrap(), GATEWAY_V4), &lease()),
        Kind::Dhcp4,
    ));
    assert_eq!(ack.opts().msg_type(), Some(v4::MessageType::Ack));
    assert_eq!(ack.yiaddr(), "10.1.0.7".parse::<Ipv4Addr>().unwrap());

    let nak_frame = one(
        respond(&request("10.1.0.8".parse().unwrap(), GATEWAY_V4), &lease()),
        Kind::Dhcp4,
    );
    let (dst_mac, _, dst, _, _) = udp_of(&nak_frame);
    assert_eq!((dst_mac, dst), ([0xff; 6], IpAddr::V4(Ipv4Addr::BROADCAST)));
    let nak = v4_answer(&nak_frame);
    assert_eq!(nak.opts().msg_type(), Some(v4::MessageType::Nak));
    assert!(nak.opts().get(v4::OptionCode::AddressLeaseTime).is_none());

    // The guest chose another server's offer: not ours to answer.
    assert_eq!(
        respond(
            &request("10.1.0.7".parse().unwrap(), "10.0.0.1".parse().unwrap()),
            &lease()
        ),
        Outcome::Dropped(Dropped::Unanswered)
    );
}

#[test]
fn a_renewal_is_answered_unicast_and_the_same_on_every_node() {
    let ip: Ipv4Addr = "10.1.0.7".parse().unwrap();
    let a = one(respond(&renew(ip), &lease()), Kind::Dhcp4);
    let (dst_mac, _, dst, _, _) = udp_of(&a);
    assert_eq!((dst_mac, dst), (GUEST, IpAddr::V4(ip)));
    assert_eq!(v4_answer(&a).opts().msg_type(), Some(v4::MessageType::Ack));
    // Stateless: another "node" (a fresh call) answers byte for byte alike.
    assert_eq!(respond(&renew(ip), &lease()), respond(&renew(ip), &lease()));
}

#[test]
fn an_inform_gets_options_without_a_lease() {
    let mut m = dhcp4(v4::MessageType::Inform, GUEST);
    m.set_ciaddr("10.1.0.7".parse::<Ipv4Addr>().unwrap());
    let f = dhcp4_frame(GUEST, &m, "10.1.0.7".parse().unwrap(), GATEWAY_V4);
    let a = v4_answer(&one(respond(&f, &lease()), Kind::Dhcp4));
    assert_eq!(a.opts().msg_type(), Some(v4::MessageType::Ack));
    assert_eq!(a.yiaddr(), Ipv4Addr::UNSPECIFIED);
    assert!(a.opts().get(v4::OptionCode::AddressLeaseTime).is_none());
    assert!(a.opts().get(v4::OptionCode::DomainNameServer).is_some());
}

#[test]
fn only_the_vms_mac_is_answered() {
    assert_eq!(
        respond(&discover(OTHER), &lease()),
        Outcome::Dropped(Dropped::ForeignMac)
    );
    // The right source MAC, another client hardware address: not the VM.
    let m = dhcp4(v4::MessageType::Discover, OTHER);
    let f = dhcp4_frame(GUEST, &m, Ipv4Addr::UNSPECIFIED, Ipv4Addr::BROADCAST);
    assert_eq!(respond(&f, &lease()), Outcome::Dropped(Dropped::ForeignMac));
    assert_eq!(
        respond(&solicitation(OTHER, 255), &lease()),
        Outcome::Dropped(Dropped::ForeignMac)
    );
    assert_eq!(
        respond(&arp_request(OTHER, [169, 254, 1, 1]), &lease()),
        Outcome::Dropped(Dropped::ForeignMac)
    );
}

#[test]
fn release_and_decline_are_counted_not_answered() {
    for kind in [v4::MessageType::Release, v4::MessageType::Decline] {
        let f = dhcp4_frame(
            GUEST,
            &dhcp4(kind, GUEST),
            Ipv4Addr::UNSPECIFIED,
            Ipv4Addr::BROADCAST,
        );
        assert_eq!(respond(&f, &lease()), Outcome::Dropped(Dropped::Unanswered));
    }
}

// ---- ARP and router advertisements -------------------------------------------

#[test]
fn the_guest_learns_the_gateway_mac_by_arp() {
    let f = one(
        respond(&arp_request(GUEST, [169, 254, 1, 1]), &lease()),
        Kind::Arp,
    );
    assert_eq!(&f[0..6], &GUEST);
    assert_eq!(&f[6..12], &GATEWAY_MAC.octets());
    assert_eq!(&f[12..14], &[0x08, 0x06]);
    assert_eq!(&f[20..22], &[0, 2], "a reply");
    assert_eq!(&f[22..28], &GATEWAY_MAC.octets());
    assert_eq!(&f[28..32], &[169, 254, 1, 1]);
    assert_eq!(&f[32..38], &GUEST);
    assert_eq!(&f[38..42], &[10, 1, 0, 7]);
    // Asking for anyone else is not ours to answer.
    assert_eq!(
        respond(&arp_request(GUEST, [10, 1, 0, 1]), &lease()),
        Outcome::Ignored
    );
}

fn check_ra(frame: &[u8], dst: Ipv6Addr) {
    let p = SlicedPacket::from_ethernet(frame).expect("RA parses");
    let Some(NetSlice::Ipv6(ip)) = &p.net else {
        panic!("not IPv6")
    };
    assert_eq!(ip.header().source_addr(), GATEWAY_V6);
    assert_eq!(ip.header().destination_addr(), dst);
    assert_eq!(ip.header().hop_limit(), 255);
    let Some(TransportSlice::Icmpv6(icmp)) = &p.transport else {
        panic!("not ICMPv6")
    };
    let Icmpv6Type::RouterAdvertisement(h) = icmp.icmp_type() else {
        panic!("not an RA: {:?}", icmp.icmp_type())
    };
    assert!(h.managed_address_config && h.other_config);
    assert_eq!(h.router_lifetime, 1800);
    let body = icmp.payload();
    // Reachable time, retransmit timer, then the two options.
    assert_eq!(body.len(), 8 + 8 + 8);
    assert_eq!(&body[8..10], &[1, 1]);
    assert_eq!(&body[10..16], &GATEWAY_MAC.octets());
    assert_eq!(&body[16..18], &[5, 1]);
    assert_eq!(u32::from_be_bytes(body[20..24].try_into().unwrap()), 1450);
}

#[test]
fn a_router_solicitation_gets_an_advertisement_from_fe80_1() {
    let f = one(
        respond(&solicitation(GUEST, 255), &lease()),
        Kind::RouterAdvert,
    );
    assert_eq!(&f[0..6], &GUEST);
    check_ra(&f, "fe80::858:aff:fe01:7".parse().unwrap());
    let u = unsolicited_advertisement(&lease()).expect("an IPv6 guest");
    assert_eq!(&u[0..6], &[0x33, 0x33, 0, 0, 0, 1]);
    check_ra(&u, "ff02::1".parse().unwrap());
    // Not from the link (hop limit below 255): dropped, per RFC 4861.
    assert_eq!(
        respond(&solicitation(GUEST, 64), &lease()),
        Outcome::Dropped(Dropped::Malformed)
    );
    // An IPv4-only guest has no IPv6 router.
    let mut v4_only = lease();
    v4_only.ips.retain(IpAddr::is_ipv4);
    assert!(unsolicited_advertisement(&v4_only).is_none());
}

// ---- DHCPv6 ------------------------------------------------------------------

fn ia_addr(m: &v6::Message) -> (u32, v6::IAAddr) {
    let ia = m
        .opts()
        .iter()
        .find_map(|o| match o {
            v6::DhcpOption::IANA(ia) => Some(ia.clone()),
            _ => None,
        })
        .expect("an IA_NA");
    let addr = ia
        .opts
        .iter()
        .find_map(|o| match o {
            v6::DhcpOption::IAAddr(a) => Some(a.clone()),
            _ => None,
        })
        .expect("an IA address");
    (ia.id, addr)
}

#[test]
fn dhcpv6_gives_the_vms_address_and_dns_from_the_same_server_everywhere() {
    let adv = v6_answer(&one(
        respond(
            &dhcp6_frame(GUEST, &dhcp6(v6::MessageType::Solicit, None)),
            &lease(),
        ),
        Kind::Dhcp6,
    ));
    assert_eq!(adv.msg_type(), v6::MessageType::Advertise);
    assert_eq!(adv.xid(), [1, 2, 3]);
    let (id, addr) = ia_addr(&adv);
    assert_eq!(id, 77);
    assert_eq!(addr.addr, "fd00:1::7".parse::<Ipv6Addr>().unwrap());
    assert_eq!((addr.preferred_life, addr.valid_life), (3600, 3600));
    assert_eq!(
        adv.opts().get(v6::OptionCode::ServerId),
        Some(&v6::DhcpOption::ServerId(server_duid()))
    );
    assert_eq!(
        adv.opts().get(v6::OptionCode::DomainNameServers),
        Some(&v6::DhcpOption::DomainNameServers(vec!["fd00:96::a"
            .parse()
            .unwrap()]))
    );
    assert!(adv.opts().get(v6::OptionCode::DomainSearchList).is_some());

    for kind in [
        v6::MessageType::Request,
        v6::MessageType::Renew,
        v6::MessageType::Rebind,
    ] {
        let m = dhcp6(kind, Some(server_duid()));
        let reply = v6_answer(&one(
            respond(&dhcp6_frame(GUEST, &m), &lease()),
            Kind::Dhcp6,
        ));
        assert_eq!(reply.msg_type(), v6::MessageType::Reply, "{kind:?}");
        assert_eq!(
            ia_addr(&reply).1.addr,
            "fd00:1::7".parse::<Ipv6Addr>().unwrap()
        );
    }
    // A renewal meant for another server is not ours.
    let m = dhcp6(
        v6::MessageType::Renew,
        Some(vec![0, 3, 0, 1, 9, 9, 9, 9, 9, 9]),
    );
    assert_eq!(
        respond(&dhcp6_frame(GUEST, &m), &lease()),
        Outcome::Dropped(Dropped::Unanswered)
    );
    // Rapid commit: a reply at once.
    let mut m = dhcp6(v6::MessageType::Solicit, None);
    m.opts_mut().insert(v6::DhcpOption::RapidCommit);
    let reply = v6_answer(&one(
        respond(&dhcp6_frame(GUEST, &m), &lease()),
        Kind::Dhcp6,
    ));
    assert_eq!(reply.msg_type(), v6::MessageType::Reply);
    assert!(reply.opts().get(v6::OptionCode::RapidCommit).is_some());
}

#[test]
fn an_information_request_gets_dns_only() {
    let mut m = v6::Message::new_with_id(v6::MessageType::InformationRequest, [9, 9, 9]);
    m.opts_mut().insert(v6::DhcpOption::ElapsedTime(0));
    let reply = v6_answer(&one(
        respond(&dhcp6_frame(GUEST, &m), &lease()),
        Kind::Dhcp6,
    ));
    assert_eq!(reply.msg_type(), v6::MessageType::Reply);
    assert!(reply.opts().get(v6::OptionCode::IANA).is_none());
    assert!(reply
        .opts()
        .get(v6::OptionCode::DomainNameServers)
        .is_some());
}

// ---- Fuzzing -------------------------------------------------------------------

/// Valid requests of every kind the responder answers, to mutate.
fn seeds() -> Vec<Vec<u8>> {
    vec![
        discover(GUEST),
        request("10.1.0.7".parse().unwrap(), GATEWAY_V4),
        renew("10.1.0.7".parse().unwrap()),
        dhcp6_frame(GUEST, &dhcp6(v6::MessageType::Solicit, None)),
        dhcp6_frame(GUEST, &dhcp6(v6::MessageType::Renew, Some(server_duid()))),
        solicitation(GUEST, 255),
        arp_request(GUEST, [169, 254, 1, 1]),
    ]
}

/// Every answer the responder produces must itself parse.
fn answers_parse(outcome: &Outcome) {
    if let Outcome::Reply(kind, frames) = outcome {
        for f in frames {
            match kind {
                Kind::Dhcp4 => {
                    v4_answer(f);
                }
                Kind::Dhcp6 => {
                    v6_answer(f);
                }
                Kind::RouterAdvert | Kind::Arp => {
                    SlicedPacket::from_ethernet(f).expect("answer parses");
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn random_frames_never_panic(frame in proptest::collection::vec(any::<u8>(), 0..600)) {
        answers_parse(&respond(&frame, &lease()));
    }

    #[test]
    fn mutated_requests_never_panic(
        seed in 0usize..7,
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..12),
        cut in any::<usize>(),
        extend in proptest::collection::vec(any::<u8>(), 0..40),
    ) {
        let mut frame = seeds()[seed].clone();
        for (at, value) in flips {
            let i = at % frame.len();
            frame[i] = value;
        }
        frame.truncate(cut % (frame.len() + 1));
        frame.extend_from_slice(&extend);
        answers_parse(&respond(&frame, &lease()));
    }
}

#[test]
fn what_would_trip_the_dhcp_decoder_is_dropped_as_malformed() {
    // hlen past chaddr's 16 bytes (dhcproto slices by it).
    let mut f = discover(GUEST);
    let hlen_at = 14 + 20 + 8 + 2;
    f[hlen_at] = 200;
    assert_eq!(respond(&f, &lease()), Outcome::Dropped(Dropped::Malformed));
    // A fixed-length option of the wrong length (dhcproto debug-asserts
    // its length): option 153 with one byte, and 81 with none.
    for (code, len) in [(153u8, 1u8), (81, 0), (80, 2), (94, 1)] {
        let mut payload = Vec::new();
        dhcp4(v4::MessageType::Discover, GUEST)
            .encode(&mut Encoder::new(&mut payload))
            .unwrap();
        // Right after the magic cookie, as the first option.
        let mut option = vec![code, len];
        option.resize(2 + usize::from(len), 0);
        payload.splice(240..240, option);
        let builder = PacketBuilder::ethernet2(GUEST, [0xff; 6])
            .ipv4([0; 4], [255; 4], 64)
            .udp(68, 67);
        let mut f = Vec::new();
        builder.write(&mut f, &payload).unwrap();
        assert_eq!(
            respond(&f, &lease()),
            Outcome::Dropped(Dropped::Malformed),
            "option {code} of length {len}"
        );
    }
}

// ---- The real server against busybox's udhcpc (root) ------------------------

mod real_client {
    use std::process::Command;
    use std::time::Duration;

    use super::*;
    use crate::dhcp::DhcpServer;
    use tether_kernel::GuestDhcp;

    /// Two named network namespaces, deleted on drop even when the test
    /// fails: "node" (the server's) and "guest", joined by a veth.
    struct Pair {
        node: String,
        guest: String,
    }

    fn ip(args: &[&str]) {
        let out = Command::new("ip").args(args).output().expect("ip");
        assert!(
            out.status.success(),
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    impl Pair {
        fn new() -> Pair {
            let tag = format!("tdhcp-{}", std::process::id());
            let pair = Pair {
                node: format!("{tag}-n"),
                guest: format!("{tag}-g"),
            };
            ip(&["netns", "add", &pair.node]);
            ip(&["netns", "add", &pair.guest]);
            ip(&[
                "-n",
                &pair.node,
                "link",
                "add",
                "tthdhcp0",
                "address",
                "0a:58:a9:fe:01:01",
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                &pair.guest,
            ]);
            ip(&["-n", &pair.node, "link", "set", "tthdhcp0", "up"]);
            ip(&[
                "-n",
                &pair.guest,
                "link",
                "set",
                "eth0",
                "address",
                "0a:58:0a:01:00:07",
            ]);
            ip(&["-n", &pair.guest, "link", "set", "eth0", "up"]);
            ip(&["-n", &pair.guest, "link", "set", "lo", "up"]);
            pair
        }
    }

    impl Drop for Pair {
        fn drop(&mut self) {
            for ns in [&self.node, &self.guest] {
                let _ = Command::new("ip").args(["netns", "del", ns]).status();
            }
        }
    }

    /// Runs busybox udhcpc once in the guest netns; its script prints one
    /// line per event with every option it got.
    fn udhcpc(pair: &Pair, dir: &std::path::Path, tries: &str) -> String {
        let script = dir.join("script");
        std::fs::write(
            &script,
            "#!/bin/sh\necho \"EVENT $1 ip=$ip subnet=$subnet router=$router dns=$dns \
             domain=$domain search=$search mtu=$mtu hostname=$hostname lease=$lease \
             staticroutes=$staticroutes serverid=$serverid\"\n",
        )
        .expect("script");
        Command::new("chmod")
            .args(["755", script.to_str().expect("utf-8")])
            .status()
            .expect("chmod");
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &pair.guest,
                "busybox",
                "udhcpc",
                "-f",
                "-q",
                "-n",
            ])
            .args(["-t", tries, "-T", "1", "-i", "eth0"])
            .args([
                "-O",
                "staticroutes",
                "-O",
                "search",
                "-O",
                "mtu",
                "-O",
                "hostname",
            ])
            .arg("-s")
            .arg(&script)
            .output()
            .expect("udhcpc");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    #[test]
    #[cfg_attr(
        not(feature = "root-tests"),
        ignore = "needs root: `make test` runs it"
    )]
    fn busybox_udhcpc_gets_the_vms_lease_and_a_stranger_gets_nothing() {
        assert!(
            nix::unistd::Uid::effective().is_root(),
            "this DHCP test needs root: it creates network namespaces and a veth. Run \
             `make test` (as root); it never skips."
        );
        let pair = Pair::new();
        let dir = tempfile::tempdir().expect("tempdir");
        let node_ns = std::fs::File::open(format!("/run/netns/{}", pair.node)).expect("netns");
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (stats_tx, stats_rx) = std::sync::mpsc::channel();
        // The server runs on a thread inside the node netns.
        let server = std::thread::spawn(move || {
            nix::sched::setns(&node_ns, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let server = DhcpServer::new();
                server.serve("tthdhcp0", lease()).expect("serve");
                assert_eq!(server.serving(), ["tthdhcp0"]);
                // Serve until the test is done.
                while rx.try_recv().is_err() {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                stats_tx.send(server.stats()).expect("stats");
            });
        });
        let got = udhcpc(&pair, dir.path(), "5");
        let line = got
            .lines()
            .find(|l| l.starts_with("EVENT bound"))
            .unwrap_or_else(|| panic!("udhcpc got no lease: {got}"));
        for want in [
            "ip=10.1.0.7 ",
            "subnet=255.255.255.255 ",
            "router=169.254.1.1 ",
            "dns=10.96.0.10 ",
            "domain=default.svc.cluster.local ",
            "search=default.svc.cluster.local cluster.local ",
            "mtu=1450 ",
            "hostname=vm1 ",
            "lease=3600 ",
            "staticroutes=169.254.1.1/32 0.0.0.0 0.0.0.0/0 169.254.1.1 ",
            "serverid=169.254.1.1",
        ] {
            assert!(line.contains(want), "{want:?} missing from: {line}");
        }

        // Another MAC on the same veth: no answer, and counted.
        ip(&[
            "-n",
            &pair.guest,
            "link",
            "set",
            "eth0",
            "address",
            "52:54:00:aa:bb:cc",
        ]);
        let stranger = udhcpc(&pair, dir.path(), "2");
        assert!(!stranger.contains("EVENT bound"), "{stranger}");
        tx.send(()).expect("stop");
        let stats = stats_rx.recv().expect("stats");
        server.join().expect("server thread");
        assert!(stats.dhcp4 >= 2, "an offer and an ack: {stats:?}");
        assert!(stats.foreign_mac >= 1, "{stats:?}");
        assert_eq!(stats.malformed, 0, "{stats:?}");
    }
}
