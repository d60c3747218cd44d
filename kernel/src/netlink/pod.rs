//! The pod side: what is done, or checked, inside the pod netns. Every
//! function here runs on a netns thread: an ADD's plain pod side on a
//! blocking socket opened there, the rest with a connection opened in the
//! pod netns (see `netns::with_netns_handle`).

use std::net::IpAddr;

use futures::TryStreamExt;
use rtnetlink::packet_route::link::{InfoKind, LinkAttribute, LinkInfo, LinkMessage};
use rtnetlink::packet_route::neighbour::{NeighbourAddress, NeighbourAttribute, NeighbourState};
use rtnetlink::packet_route::{AddressFamily, RouteNetlinkMessage};
use rtnetlink::Handle;

use super::messages::{self, reason, Step, ACKED, CREATE, REPLACE};
use super::{mac_text, GATEWAY_MAC};
use crate::error::{KernelError, Result};
use tether_base::error::Mismatch;
use tether_base::guest::TapSpec;
use tether_base::mac::Mac;

/// What the pod side must look like; owned so that it can cross to the netns
/// thread.
pub(super) struct PodSide {
    pub ifname: String,
    pub netns: String,
    pub mac: Mac,
    pub ips: Vec<IpAddr>,
    pub mtu: u32,
    /// The `tap` binding's tap, and the alias that marks it ours.
    pub tap: Option<(TapSpec, String)>,
    /// For `managedTap`: the node-side veth's index, which the pod end's
    /// IFLA_LINK names after KubeVirt renamed it.
    pub managed_tap_peer: Option<u32>,
}

/// The pod side of an ADD, on the netns thread (which has no runtime):
/// `index` is the pod end's ifindex as the veth's creation echoed it. The
/// plain case is one blocking batch on a socket opened here; a tap, or a
/// kernel that did not echo the index (before 6.3), takes the async path
/// on a runtime of this thread.
pub(super) fn configure_here(pod: PodSide, index: Option<u32>) -> Result<()> {
    match index {
        Some(index) if pod.tap.is_none() => messages::batch_blocking(plain_steps(&pod, index)),
        _ => super::netns::with_handle_here(move |handle| configure(handle, pod, index)),
    }
}

/// Raises the pod interface, then adds its addresses, gateway neighbours and
/// default routes, all in one batch: the IPv6 default route needs the link
/// up, and the kernel handles the batch in order.
pub(super) async fn configure(handle: Handle, pod: PodSide, index: Option<u32>) -> Result<()> {
    let index = match index {
        Some(i) => i,
        None => messages::link_by_name_get(&handle, &pod.ifname)
            .await
            .map_err(|e| KernelError::refused(format!("looking up {}", pod.ifname), reason(&e)))?
            .map(|l| l.header.index)
            .ok_or_else(|| {
                KernelError::refused(
                    format!("configuring {} in {}", pod.ifname, pod.netns),
                    "the interface vanished after creation",
                )
            })?,
    };
    if let Some((tap, alias)) = &pod.tap {
        let site = super::tap::TapSite {
            spec: tap,
            eth: &pod.ifname,
            eth_index: index,
            mtu: pod.mtu,
            alias,
        };
        return super::tap::configure(&handle, &site).await;
    }
    messages::batch(&handle, plain_steps(&pod, index)).await
}

/// The requests of a plain pod side, in order: the link up, its
/// addresses, the gateway neighbours, the default routes.
fn plain_steps(pod: &PodSide, index: u32) -> Vec<Step> {
    let name = &pod.ifname;
    let gateways = messages::gateways(&pod.ips);
    let mut steps = Vec::with_capacity(1 + pod.ips.len() + 2 * gateways.len());
    steps.push(Step::new(
        RouteNetlinkMessage::SetLink(messages::link_up(index)),
        ACKED,
        format!("setting {name} up in {}", pod.netns),
    ));
    for &ip in &pod.ips {
        steps.push(Step::new(
            RouteNetlinkMessage::NewAddress(messages::address(ip, index)),
            CREATE,
            format!(
                "adding {ip}/{} to {name} in {}",
                messages::host_prefix_len(ip),
                pod.netns
            ),
        ));
    }
    for &gw in &gateways {
        // REPLACE: a permanent entry with the gateway MAC is already right.
        steps.push(Step::new(
            RouteNetlinkMessage::NewNeighbour(messages::gateway_neighbour(gw, index)),
            REPLACE,
            format!("adding gateway neighbour {gw} on {name}"),
        ));
    }
    for &gw in &gateways {
        // EXCL: a default route we did not make belongs to someone else.
        steps.push(Step::new(
            RouteNetlinkMessage::NewRoute(messages::default_route(gw, index)),
            CREATE,
            format!("adding default route via {gw} dev {name}"),
        ));
    }
    steps
}

/// CHECK of the pod side: interface, then addresses, then gateway neighbours
/// and default routes.
pub(super) async fn check(handle: Handle, pod: PodSide) -> Result<()> {
    let kernel = |what: &str, e: rtnetlink::Error| {
        KernelError::refused(format!("reading {what} in {}", pod.netns), reason(&e))
    };
    let link = messages::link_by_name_get(&handle, &pod.ifname)
        .await
        .map_err(|e| kernel("links", e))?
        .ok_or_else(|| {
            KernelError::mismatch(
                Mismatch::PodInterface,
                format!("{} not found in {}", pod.ifname, pod.netns),
            )
        })?;
    if let Some(peer) = pod.managed_tap_peer {
        // KubeVirt puts a dummy there; any link but tether's veth means the
        // pod was rewritten.
        if link_kind(&link) != Some(&InfoKind::Veth) {
            return check_managed_tap(&handle, &pod, &link, peer).await;
        }
    }
    let index = link.header.index;
    let facts = messages::link_facts(&link);
    if !facts.up {
        return Err(KernelError::mismatch(
            Mismatch::PodInterface,
            format!("{} is down", pod.ifname),
        ));
    }
    if facts.mac.as_deref() != Some(&pod.mac.octets()[..]) {
        return Err(KernelError::mismatch(
            Mismatch::PodInterface,
            format!(
                "{} has MAC {}, want {}",
                pod.ifname,
                mac_text(facts.mac.as_deref()),
                pod.mac
            ),
        ));
    }
    if facts.mtu != Some(pod.mtu) {
        return Err(KernelError::mismatch(
            Mismatch::PodInterface,
            format!(
                "{} has MTU {}, want {}",
                pod.ifname,
                facts.mtu.unwrap_or(0),
                pod.mtu
            ),
        ));
    }

    if let Some((tap, alias)) = &pod.tap {
        let site = super::tap::TapSite {
            spec: tap,
            eth: &pod.ifname,
            eth_index: index,
            mtu: pod.mtu,
            alias,
        };
        return super::tap::check(&handle, &site).await;
    }

    let mut request = handle.address().get().set_link_index_filter(index);
    request.message_mut().header.index = index;
    let present: Vec<(IpAddr, u8)> = request
        .execute()
        .try_filter_map(|a| async move {
            Ok(messages::address_of(&a).map(|ip| (ip, a.header.prefix_len)))
        })
        .try_collect()
        .await
        .map_err(|e| kernel("addresses", e))?;
    for &ip in &pod.ips {
        let want = messages::host_prefix_len(ip);
        match present.iter().find(|(p, _)| *p == ip) {
            Some((_, len)) if *len == want => {}
            Some((_, len)) => {
                return Err(KernelError::mismatch(
                    Mismatch::PodAddress,
                    format!("{} has {ip}/{len}, want /{want}", pod.ifname),
                ))
            }
            None => {
                return Err(KernelError::mismatch(
                    Mismatch::PodAddress,
                    format!("{ip}/{want} is missing from {}", pod.ifname),
                ))
            }
        }
    }

    let gateways = messages::gateways(&pod.ips);
    let neighbours: Vec<_> = handle
        .neighbours()
        .get()
        .execute()
        .try_filter(|n| std::future::ready(n.header.ifindex == index))
        .try_collect()
        .await
        .map_err(|e| kernel("neighbours", e))?;
    for &gw in &gateways {
        let entry = neighbours.iter().find(|n| {
            n.attributes.iter().any(|a| match (a, gw) {
                (NeighbourAttribute::Destination(NeighbourAddress::Inet(d)), IpAddr::V4(g)) => {
                    *d == g
                }
                (NeighbourAttribute::Destination(NeighbourAddress::Inet6(d)), IpAddr::V6(g)) => {
                    *d == g
                }
                _ => false,
            })
        });
        let Some(entry) = entry else {
            return Err(KernelError::mismatch(
                Mismatch::PodRoute,
                format!("no neighbour entry for gateway {gw} on {}", pod.ifname),
            ));
        };
        let lladdr = entry.attributes.iter().find_map(|a| match a {
            NeighbourAttribute::LinkLayerAddress(l) => Some(l.as_slice()),
            _ => None,
        });
        if entry.header.state != NeighbourState::Permanent
            || lladdr != Some(&GATEWAY_MAC.octets()[..])
        {
            return Err(KernelError::mismatch(
                Mismatch::PodRoute,
                format!(
                    "gateway {gw} on {} is {:?} at {}, want permanent at {}",
                    pod.ifname,
                    entry.header.state,
                    mac_text(lladdr),
                    GATEWAY_MAC
                ),
            ));
        }
    }

    for &gw in &gateways {
        let family = match gw {
            IpAddr::V4(_) => AddressFamily::Inet,
            IpAddr::V6(_) => AddressFamily::Inet6,
        };
        let routes =
            messages::dump_routes(&handle, messages::route_dump(family, None, Some(index)))
                .await
                .map_err(|e| kernel("routes", e))?;
        let found = routes.iter().any(|r| {
            matches!(messages::route_destination(r), Some((d, 0)) if d.is_unspecified())
                && messages::route_gateway(r) == Some(gw)
        });
        if !found {
            return Err(KernelError::mismatch(
                Mismatch::PodRoute,
                format!("no default route via {gw} dev {}", pod.ifname),
            ));
        }
    }
    Ok(())
}

/// The kind of a link (veth, dummy, bridge...), if the kernel said.
fn link_kind(link: &LinkMessage) -> Option<&InfoKind> {
    link.attributes.iter().find_map(|a| match a {
        LinkAttribute::LinkInfo(infos) => infos.iter().find_map(|i| match i {
            LinkInfo::Kind(k) => Some(k),
            _ => None,
        }),
        _ => None,
    })
}

/// CHECK of a pod that KubeVirt's `managedTap` rewrote: the pod interface
/// is now a dummy (any link but a veth) with the VM's MAC and MTU (the domain takes both from
/// it), and tether's veth, renamed, is up with its MTU in KubeVirt's
/// in-pod bridge. Addresses and routes are KubeVirt's business there.
async fn check_managed_tap(
    handle: &Handle,
    pod: &PodSide,
    dummy: &LinkMessage,
    peer: u32,
) -> Result<()> {
    let wrong = |what: String| KernelError::mismatch(Mismatch::PodInterface, what);
    let facts = messages::link_facts(dummy);
    if facts.mac.as_deref() != Some(&pod.mac.octets()[..]) || facts.mtu != Some(pod.mtu) {
        return Err(wrong(format!(
            "{} (managedTap's dummy) has MAC {} MTU {}, want {} and {}",
            pod.ifname,
            mac_text(facts.mac.as_deref()),
            facts.mtu.unwrap_or(0),
            pod.mac,
            pod.mtu
        )));
    }
    let links: Vec<LinkMessage> = handle
        .link()
        .get()
        .execute()
        .try_collect()
        .await
        .map_err(|e| KernelError::refused(format!("reading links in {}", pod.netns), reason(&e)))?;
    let veth = links
        .iter()
        .find(|l| {
            link_kind(l) == Some(&InfoKind::Veth)
                && l.attributes
                    .iter()
                    .any(|a| matches!(a, LinkAttribute::Link(i) if *i == peer))
        })
        .ok_or_else(|| {
            wrong(format!(
                "the pod end of tether's veth is gone from {} (managedTap)",
                pod.netns
            ))
        })?;
    let vf = messages::link_facts(veth);
    let name = vf.name.clone().unwrap_or_default();
    let bridged = veth
        .attributes
        .iter()
        .any(|a| matches!(a, LinkAttribute::Controller(_)));
    if !vf.up || vf.mtu != Some(pod.mtu) || !bridged {
        return Err(wrong(format!(
            "{name} (tether's veth, renamed by managedTap) is {}, MTU {}, {}; want up, MTU {}, \
             in KubeVirt's bridge",
            if vf.up { "up" } else { "down" },
            vf.mtu.unwrap_or(0),
            if bridged { "bridged" } else { "not bridged" },
            pod.mtu
        )));
    }
    Ok(())
}
