//! The floor under a tether ADD: the smallest in-process program that does
//! the same kernel work tetherd does to wire one pod, and nothing else (no
//! IPAM, no store, no gRPC, no shim).
//!
//! The bench spawns it the way it spawns a CNI plugin, so its latency is
//! the process spawn plus the netlink and sysctl work a pod's wiring
//! cannot avoid. The requests mirror `node-server/src/kernel/netlink`:
//!
//! - node netns: one RTM_NEWLINK creating the veth (host end up, named,
//!   gateway MAC; peer born in the pod netns as its final name, pod MAC),
//!   echoed for both ifindexes; `proxy_arp=1` and `proxy_delay=0` on the
//!   host end (IPv4); `fe80::1/64` nodad on it (IPv6); one host route per
//!   address, `ip/32|128 dev <host> scope link proto 201` (REPLACE);
//! - pod netns: one batch of RTM_SETLINK up, the /32 and /128 addresses
//!   (IPv6 nodad), the permanent gateway neighbours, and the default routes
//!   (via 169.254.1.1 onlink, via fe80::1).
//!
//! Input, in the environment so that the bench times it through the same
//! path as the plugins: `CNI_NETNS` (pod netns path), `CNI_IFNAME` (pod
//! interface, default eth0), `FLOOR_HOST_IFNAME`, `FLOOR_IPS` (comma
//! separated) and `FLOOR_MTU` (default 1500). It prints a minimal CNI-like
//! result, `{"ips":[{"address":..}]}`, and exits 0, or prints the error and
//! exits 1. There is no DEL: the bench deletes the veth itself, untimed.
//! It must be started in the node netns: the host end, its sysctls and
//! routes are made where it runs.

use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::AsRawFd;
use std::process::ExitCode;

use futures::StreamExt;
use rtnetlink::packet_core::{
    NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_CREATE, NLM_F_ECHO, NLM_F_EXCL, NLM_F_REPLACE,
    NLM_F_REQUEST,
};
use rtnetlink::packet_route::address::{AddressAttribute, AddressFlags, AddressHeaderFlags};
use rtnetlink::packet_route::link::{InfoData, InfoKind, InfoVeth, LinkAttribute};
use rtnetlink::packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourMessage, NeighbourState,
};
use rtnetlink::packet_route::route::{RouteAttribute, RouteProtocol, RouteScope};
use rtnetlink::packet_route::{AddressFamily, RouteNetlinkMessage};
use rtnetlink::{
    AddressMessageBuilder, Handle, LinkMessageBuilder, LinkUnspec, LinkVeth, RouteMessageBuilder,
};

// The same values as node-server/src/kernel/mod.rs: the floor must ask
// the kernel for exactly what tetherd asks for.
const GATEWAY_V4: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);
const GATEWAY_V6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);
const GATEWAY_MAC: [u8; 6] = [0x0a, 0x58, 0xa9, 0xfe, 0x01, 0x01];
const ROUTE_PROTOCOL: u8 = 201;

const CREATE: u16 = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL;
const REPLACE: u16 = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE;
const ACKED: u16 = NLM_F_REQUEST | NLM_F_ACK;

struct Input {
    netns: String,
    pod_ifname: String,
    host_ifname: String,
    ips: Vec<IpAddr>,
    mtu: u32,
}

fn input() -> Result<Input, String> {
    let var = |k: &str| std::env::var(k).map_err(|_| format!("{k} is not set"));
    let ips = var("FLOOR_IPS")?
        .split(',')
        .map(|s| {
            s.parse::<IpAddr>()
                .map_err(|e| format!("FLOOR_IPS: {s:?}: {e}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Input {
        netns: var("CNI_NETNS")?,
        pod_ifname: var("CNI_IFNAME").unwrap_or_else(|_| "eth0".to_owned()),
        host_ifname: var("FLOOR_HOST_IFNAME")?,
        ips,
        mtu: match std::env::var("FLOOR_MTU") {
            Ok(m) => m.parse().map_err(|e| format!("FLOOR_MTU: {e}"))?,
            Err(_) => 1500,
        },
    })
}

fn main() -> ExitCode {
    let result = input().and_then(|inp| {
        tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .map_err(|e| format!("runtime: {e}"))?
            .block_on(wire(&inp))?;
        Ok(inp)
    });
    match result {
        Ok(inp) => {
            let ips: Vec<String> = inp
                .ips
                .iter()
                .map(|ip| format!(r#"{{"address":"{ip}/{}"}}"#, prefix_len(*ip)))
                .collect();
            println!(r#"{{"ips":[{}]}}"#, ips.join(","));
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!(r#"{{"code":999,"msg":{:?}}}"#, e);
            ExitCode::FAILURE
        }
    }
}

fn prefix_len(ip: IpAddr) -> u8 {
    if ip.is_ipv4() {
        32
    } else {
        128
    }
}

/// The whole wiring, node side then pod side, on one thread. tetherd runs
/// the two sides concurrently; on one thread they are sequential, which can
/// only make the floor slower, never faster than the kernel work.
async fn wire(inp: &Input) -> Result<(), String> {
    let netns = File::open(&inp.netns).map_err(|e| format!("opening {}: {e}", inp.netns))?;
    let node = connect()?;
    let has_v4 = inp.ips.iter().any(IpAddr::is_ipv4);
    let has_v6 = inp.ips.iter().any(IpAddr::is_ipv6);

    // The veth, echoed so that the answer carries both ifindexes.
    let v4 = inp.ips.iter().find_map(|ip| match ip {
        IpAddr::V4(v4) => Some(v4.octets()),
        IpAddr::V6(_) => None,
    });
    let [a, b, c, d] = v4.unwrap_or([0; 4]);
    let peer = LinkUnspec::new_with_name(&inp.pod_ifname)
        .address(vec![0x0a, 0x58, a, b, c, d])
        .mtu(inp.mtu)
        .setns_by_fd(netns.as_raw_fd())
        .build();
    let veth = LinkMessageBuilder::<LinkVeth>::new_with_info_kind(InfoKind::Veth)
        .name(&inp.host_ifname)
        .address(GATEWAY_MAC.to_vec())
        .mtu(inp.mtu)
        .up()
        .set_info_data(InfoData::Veth(InfoVeth::Peer(peer)))
        .build();
    let answers = send(
        &node,
        vec![(
            RouteNetlinkMessage::NewLink(veth),
            CREATE | NLM_F_ECHO,
            "creating the veth",
        )],
    )
    .await?;
    let echo = answers.iter().find_map(|m| match m {
        RouteNetlinkMessage::NewLink(l) if l.header.index != 0 => Some(l),
        _ => None,
    });
    let Some(echo) = echo else {
        return Err("the kernel did not echo the new veth (before 6.3?)".to_owned());
    };
    let host_index = echo.header.index;
    let peer_index = echo
        .attributes
        .iter()
        .find_map(|a| match a {
            LinkAttribute::Link(i) if *i != 0 => Some(*i),
            _ => None,
        })
        .ok_or("the echo carries no peer ifindex")?;

    // /proc/sys/net resolves in this thread's netns: still the node's.
    if has_v4 {
        for (path, value) in [
            (format!("net/ipv4/conf/{}/proxy_arp", inp.host_ifname), "1"),
            (
                format!("net/ipv4/neigh/{}/proxy_delay", inp.host_ifname),
                "0",
            ),
        ] {
            std::fs::write(format!("/proc/sys/{path}"), value)
                .map_err(|e| format!("writing {path}: {e}"))?;
        }
    }
    let mut host = Vec::new();
    if has_v6 {
        host.push((
            RouteNetlinkMessage::NewAddress(nodad(
                AddressMessageBuilder::<Ipv6Addr>::new()
                    .index(host_index)
                    .address(GATEWAY_V6, 64)
                    .build(),
            )),
            CREATE,
            "adding fe80::1/64 to the host veth",
        ));
    }
    for &ip in &inp.ips {
        let mut route = match ip {
            IpAddr::V4(v4) => RouteMessageBuilder::<Ipv4Addr>::new()
                .destination_prefix(v4, 32)
                .build(),
            IpAddr::V6(v6) => RouteMessageBuilder::<Ipv6Addr>::new()
                .destination_prefix(v6, 128)
                .build(),
        };
        route.header.protocol = RouteProtocol::Other(ROUTE_PROTOCOL);
        route.header.scope = RouteScope::Link;
        route.attributes.push(RouteAttribute::Oif(host_index));
        host.push((
            RouteNetlinkMessage::NewRoute(route),
            REPLACE,
            "adding a host route",
        ));
    }
    send(&node, host).await?;

    // The pod side, on a socket opened inside the pod netns. Entering it
    // last keeps the sysctl writes above in the node netns.
    // SAFETY: a valid open fd of a network namespace; setns only changes
    // this (the only) thread's netns.
    if unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(format!(
            "entering {}: {}",
            inp.netns,
            std::io::Error::last_os_error()
        ));
    }
    let pod = connect()?;
    let mut steps = vec![(
        RouteNetlinkMessage::SetLink(LinkUnspec::new_with_index(peer_index).up().build()),
        ACKED,
        "setting the pod interface up",
    )];
    for &ip in &inp.ips {
        let msg = match ip {
            IpAddr::V4(v4) => AddressMessageBuilder::<Ipv4Addr>::new()
                .index(peer_index)
                .address(v4, 32)
                .build(),
            IpAddr::V6(v6) => nodad(
                AddressMessageBuilder::<Ipv6Addr>::new()
                    .index(peer_index)
                    .address(v6, 128)
                    .build(),
            ),
        };
        steps.push((
            RouteNetlinkMessage::NewAddress(msg),
            CREATE,
            "adding a pod address",
        ));
    }
    let mut gateways = Vec::new();
    if has_v4 {
        gateways.push(IpAddr::V4(GATEWAY_V4));
    }
    if has_v6 {
        gateways.push(IpAddr::V6(GATEWAY_V6));
    }
    for &gw in &gateways {
        let mut n = NeighbourMessage::default();
        n.header.family = family(gw);
        n.header.ifindex = peer_index;
        n.header.state = NeighbourState::Permanent;
        n.attributes.push(NeighbourAttribute::Destination(match gw {
            IpAddr::V4(v4) => NeighbourAddress::Inet(v4),
            IpAddr::V6(v6) => NeighbourAddress::Inet6(v6),
        }));
        n.attributes
            .push(NeighbourAttribute::LinkLayerAddress(GATEWAY_MAC.to_vec()));
        steps.push((
            RouteNetlinkMessage::NewNeighbour(n),
            REPLACE,
            "adding a gateway neighbour",
        ));
    }
    for &gw in &gateways {
        let mut route = match gw {
            IpAddr::V4(v4) => RouteMessageBuilder::<Ipv4Addr>::new()
                .gateway(v4)
                .onlink()
                .build(),
            IpAddr::V6(v6) => RouteMessageBuilder::<Ipv6Addr>::new().gateway(v6).build(),
        };
        route.header.protocol = RouteProtocol::Other(ROUTE_PROTOCOL);
        route.attributes.push(RouteAttribute::Oif(peer_index));
        steps.push((
            RouteNetlinkMessage::NewRoute(route),
            CREATE,
            "adding a default route",
        ));
    }
    send(&pod, steps).await?;
    Ok(())
}

fn family(ip: IpAddr) -> AddressFamily {
    match ip {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
    }
}

fn nodad(
    mut msg: rtnetlink::packet_route::address::AddressMessage,
) -> rtnetlink::packet_route::address::AddressMessage {
    msg.header.flags |= AddressHeaderFlags::Nodad;
    msg.attributes
        .push(AddressAttribute::Flags(AddressFlags::Nodad));
    msg
}

/// An rtnetlink connection in the calling thread's netns, driven by the
/// current runtime.
fn connect() -> Result<Handle, String> {
    let (connection, handle, _) =
        rtnetlink::new_connection().map_err(|e| format!("opening rtnetlink: {e}"))?;
    tokio::spawn(connection);
    Ok(handle)
}

/// Writes every request before reading any answer (one wake-up for the
/// batch, as tetherd does); returns the non-ACK answers, or the first
/// refusal.
async fn send(
    handle: &Handle,
    steps: Vec<(RouteNetlinkMessage, u16, &str)>,
) -> Result<Vec<RouteNetlinkMessage>, String> {
    let mut handle = handle.clone();
    let mut pending = Vec::with_capacity(steps.len());
    for (message, flags, what) in steps {
        let mut req = NetlinkMessage::from(message);
        req.header.flags = flags;
        let answers = handle.request(req).map_err(|e| format!("{what}: {e}"))?;
        pending.push((answers, what));
    }
    let mut out = Vec::new();
    let mut first = None;
    for (mut answers, what) in pending {
        while let Some(msg) = answers.next().await {
            match msg.payload {
                NetlinkPayload::InnerMessage(inner) => out.push(inner),
                NetlinkPayload::Error(e) if e.raw_code() != 0 && first.is_none() => {
                    first = Some(format!("{what}: {}", e.to_io()));
                }
                _ => {}
            }
        }
    }
    first.map_or(Ok(out), Err)
}
