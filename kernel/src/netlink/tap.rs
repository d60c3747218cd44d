//! The `tap` binding inside a pod: the persistent tap QEMU opens, and the
//! two tc redirects that join it to the pod's veth.
//!
//! Why redirects and not an in-pod bridge or in-pod routing:
//! - the pod interface keeps the VM's MAC, which KubeVirt copies into the
//!   domain. Enslaved to a bridge, that MAC would be one of the bridge's own
//!   (local) addresses, and frames to the guest would stop at the bridge;
//! - routing in the pod would hide the guest's MAC from the node, and with
//!   it QEMU's post-migration RARP, which is tether's cutover signal, and
//!   the guest's DHCP, which the daemon answers on the node side.
//!
//! With an ingress `mirred` redirect each way, every frame crosses the pod
//! unchanged: the guest is, to the node, exactly where a pod would be.
//!
//! Everything here runs on a thread inside the pod netns.

use std::os::fd::AsRawFd;

use futures::TryStreamExt;
use rtnetlink::packet_route::link::{InfoData, InfoKind, LinkAttribute, LinkInfo, LinkMessage};
use rtnetlink::packet_route::tc::{
    TcAction, TcActionAttribute, TcActionMirrorOption, TcActionOption, TcFilterU32Option,
    TcMirrorActionType, TcOption,
};
use rtnetlink::packet_route::RouteNetlinkMessage;
use rtnetlink::{Handle, LinkUnspec};

use super::messages::{self, errno, reason, ACKED};
use crate::error::{KernelError, Result};
use tether_base::error::Mismatch;
use tether_base::guest::TapSpec;

/// `ETH_P_ALL`: the redirects take every frame.
const ETH_P_ALL: u16 = 0x0003;
/// The ingress qdisc's handle, `ffff:`.
const INGRESS_PARENT: u32 = 0xffff_0000;

/// `IFLA_TUN_*` attributes of a tun link's info data (linux/if_link.h).
const IFLA_TUN_OWNER: u16 = 1;
const IFLA_TUN_GROUP: u16 = 2;
const IFLA_TUN_TYPE: u16 = 3;
const IFLA_TUN_VNET_HDR: u16 = 5;
const IFLA_TUN_PERSIST: u16 = 6;
const IFLA_TUN_MULTI_QUEUE: u16 = 7;

nix::ioctl_write_ptr_bad!(
    tun_set_iff,
    nix::request_code_write!(b'T', 202, std::mem::size_of::<libc::c_int>()),
    libc::ifreq
);
nix::ioctl_write_int_bad!(
    tun_set_persist,
    nix::request_code_write!(b'T', 203, std::mem::size_of::<libc::c_int>())
);
nix::ioctl_write_int_bad!(
    tun_set_owner,
    nix::request_code_write!(b'T', 204, std::mem::size_of::<libc::c_int>())
);
nix::ioctl_write_int_bad!(
    tun_set_group,
    nix::request_code_write!(b'T', 206, std::mem::size_of::<libc::c_int>())
);

/// Where a tap goes: its spec, the pod interface it is joined to, the MTU
/// and the alias that marks it ours.
pub(super) struct TapSite<'a> {
    pub spec: &'a TapSpec,
    /// The pod interface (CNI_IFNAME) and its index.
    pub eth: &'a str,
    pub eth_index: u32,
    pub mtu: u32,
    pub alias: &'a str,
}

/// The link named `name`, if there is one.
async fn link_named(handle: &Handle, name: &str) -> Result<Option<LinkMessage>> {
    messages::link_by_name_get(handle, name)
        .await
        .map_err(|e| KernelError::refused(format!("looking up tap {name}"), reason(&e)))
}

/// The alias that marks a tap as tether's, for the attachment whose
/// node-side veth is `host_ifname`: DEL and a retried ADD remove only a
/// tap that carries it.
pub(super) fn alias(host_ifname: &str) -> String {
    format!("tether:{host_ifname}")
}

/// The flags QEMU opens the tap with; a persistent tap must have been
/// created with the same ones or QEMU's TUNSETIFF fails.
fn tun_flags(spec: &TapSpec) -> libc::c_short {
    let mut flags = libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR;
    if spec.multi_queue() {
        flags |= libc::IFF_MULTI_QUEUE;
    }
    // The IFF_* values all fit the ifreq's 16-bit field.
    flags as libc::c_short
}

/// Creates the persistent tap in the calling thread's netns: the kernel
/// offers no netlink request for it (RTM_NEWLINK answers EOPNOTSUPP for
/// kind "tun").
fn create_persistent(spec: &TapSpec) -> Result<()> {
    let context = || format!("creating tap {}", spec.name);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .map_err(|e| KernelError::refused(format!("{}: opening /dev/net/tun", context()), e))?;
    // SAFETY: ifreq is plain old data; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(spec.name.bytes()) {
        *dst = src as libc::c_char;
    }
    req.ifr_ifru.ifru_flags = tun_flags(spec);
    let fd = file.as_raw_fd();
    // SAFETY: fd is an open tun control file, req a valid ifreq that lives
    // through each call; the int ioctls take their argument by value.
    unsafe {
        tun_set_iff(fd, &req).map_err(|e| KernelError::refused(context(), e))?;
        tun_set_owner(fd, spec.owner as libc::c_int)
            .map_err(|e| KernelError::refused(format!("{}: owner {}", context(), spec.owner), e))?;
        tun_set_group(fd, spec.group as libc::c_int)
            .map_err(|e| KernelError::refused(format!("{}: group {}", context(), spec.group), e))?;
        tun_set_persist(fd, 1).map_err(|e| KernelError::refused(context(), e))?;
    }
    // Closing the control file leaves the persistent device for QEMU.
    Ok(())
}

/// Opens one queue of an existing tap as QEMU does (same flags), in the
/// calling thread's netns: the tests' stand-in for the hypervisor.
#[cfg(test)]
pub(super) fn open_queue(spec: &TapSpec) -> Result<std::fs::File> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .map_err(|e| KernelError::refused("opening /dev/net/tun", e))?;
    // SAFETY: as in create_persistent.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(spec.name.bytes()) {
        *dst = src as libc::c_char;
    }
    req.ifr_ifru.ifru_flags = tun_flags(spec);
    // SAFETY: as in create_persistent.
    unsafe { tun_set_iff(file.as_raw_fd(), &req) }
        .map_err(|e| KernelError::refused("attaching to the tap", e))?;
    Ok(file)
}

/// The tap's alias, if the link has one.
fn link_alias(link: &LinkMessage) -> Option<&str> {
    link.attributes.iter().find_map(|a| match a {
        LinkAttribute::IfAlias(s) => Some(s.as_str()),
        _ => None,
    })
}

/// The index of the tap named `name` if it carries `alias`; `None` if
/// there is no such link. A link of that name that is not ours is
/// [`KernelError::Exists`].
pub(super) async fn find(handle: &Handle, name: &str, alias: &str) -> Result<Option<u32>> {
    let Some(link) = link_named(handle, name).await? else {
        return Ok(None);
    };
    if link_alias(&link) != Some(alias) {
        return Err(KernelError::Exists(name.to_owned()));
    }
    Ok(Some(link.header.index))
}

/// Deletes the link `index` (a tap [`find`] found); gone already is
/// success.
pub(super) async fn delete(handle: &Handle, index: u32, name: &str) -> Result<()> {
    let mut message = LinkMessage::default();
    message.header.index = index;
    match messages::request(handle, RouteNetlinkMessage::DelLink(message), ACKED).await {
        Ok(_) => Ok(()),
        Err(e) if errno(&e) == Some(libc::ENODEV) => Ok(()),
        Err(e) => Err(KernelError::refused(
            format!("deleting tap {name}"),
            reason(&e),
        )),
    }
}

/// Deletes the tap named `name` if it carries `alias`. True if one was
/// deleted; a tap that is not ours is left alone and reported.
pub(super) async fn remove(handle: &Handle, name: &str, alias: &str) -> Result<bool> {
    match find(handle, name, alias).await? {
        Some(index) => delete(handle, index, name).await.map(|()| true),
        None => Ok(false),
    }
}

/// Wires the tap binding next to the pod interface `eth` (index
/// `eth_index`): creates the tap (replacing one of ours left by an earlier
/// attempt), sets its MTU and alias, raises both, turns IPv6 off on the pod
/// interface (the addresses are the guest's: the pod must not send from
/// the guest's MAC) and redirects every frame each way. On failure the tap
/// is deleted again.
pub(super) async fn configure(handle: &Handle, site: &TapSite<'_>) -> Result<()> {
    let (spec, alias) = (site.spec, site.alias);
    remove(handle, &spec.name, alias).await?;
    create_persistent(spec)?;
    let done = join(handle, site).await;
    if done.is_err() {
        if let Err(e) = remove(handle, &spec.name, alias).await {
            tracing::warn!(tap = spec.name, error = %e, "could not delete the tap of a failed ADD");
        }
    }
    done
}

async fn join(handle: &Handle, site: &TapSite<'_>) -> Result<()> {
    let TapSite {
        spec,
        eth,
        eth_index,
        mtu,
        alias,
    } = *site;
    let tap = &spec.name;
    let tap_index = link_named(handle, tap)
        .await?
        .map(|l| l.header.index)
        .ok_or_else(|| KernelError::refused(format!("configuring tap {tap}"), "it vanished"))?;
    // Neither end may speak for itself: the guest's frames are the only
    // ones that should cross. Off before either is up, so that
    // not even a first router solicitation leaves.
    for link in [eth, tap.as_str()] {
        let path = format!("net/ipv6/conf/{link}/disable_ipv6");
        match super::write_sysctl(&path, "1") {
            Ok(()) => {}
            // A kernel without IPv6 sends nothing from it either.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(KernelError::refused(format!("writing /proc/sys/{path}"), e)),
        }
    }
    // The redirects are in place before either link is up, so that no
    // frame meets a pod stack.
    for (from, from_name, to) in [
        (eth_index, eth, tap_index),
        (tap_index, tap.as_str(), eth_index),
    ] {
        redirect(handle, from, from_name, to).await?;
    }
    let tap_link = LinkUnspec::new_with_index(tap_index)
        .mtu(mtu)
        .up()
        .append_extra_attribute(LinkAttribute::IfAlias(alias.to_owned()))
        .build();
    messages::request(handle, RouteNetlinkMessage::SetLink(tap_link), ACKED)
        .await
        .map_err(|e| {
            KernelError::refused(format!("setting tap {tap} up, MTU {mtu}"), reason(&e))
        })?;
    messages::request(
        handle,
        RouteNetlinkMessage::SetLink(messages::link_up(eth_index)),
        ACKED,
    )
    .await
    .map_err(|e| KernelError::refused(format!("setting {eth} up"), reason(&e)))?;
    Ok(())
}

/// An ingress qdisc on `from` and a filter that redirects every frame to
/// the egress of `to`.
async fn redirect(handle: &Handle, from: u32, from_name: &str, to: u32) -> Result<()> {
    let index = i32::try_from(from)
        .map_err(|_| KernelError::Internal(format!("link index {from} out of range")))?;
    match handle.qdisc().add(index).ingress().execute().await {
        Ok(()) => {}
        Err(e) if errno(&e) == Some(libc::EEXIST) => {}
        Err(e) => {
            return Err(KernelError::refused(
                format!("adding an ingress qdisc to {from_name}"),
                reason(&e),
            ))
        }
    }
    let context = || format!("redirecting {from_name}'s frames to link #{to}");
    handle
        .traffic_filter(index)
        .add()
        .parent(INGRESS_PARENT)
        // The kernel reads the protocol in network byte order.
        .protocol(ETH_P_ALL.to_be())
        .redirect(to)
        .map_err(|e| KernelError::refused(context(), reason(&e)))?
        .execute()
        .await
        .map_err(|e| KernelError::refused(context(), reason(&e)))
}

/// What a tun link's info data says.
#[derive(Debug, Default)]
struct TunFacts {
    owner: Option<u32>,
    group: Option<u32>,
    tap: bool,
    vnet_hdr: bool,
    persist: bool,
    multi_queue: bool,
}

fn tun_facts(link: &LinkMessage) -> Option<TunFacts> {
    let infos = link.attributes.iter().find_map(|a| match a {
        LinkAttribute::LinkInfo(i) => Some(i),
        _ => None,
    })?;
    if !infos
        .iter()
        .any(|i| matches!(i, LinkInfo::Kind(InfoKind::Tun)))
    {
        return None;
    }
    let mut facts = TunFacts::default();
    for info in infos {
        let LinkInfo::Data(InfoData::Tun(nlas)) = info else {
            continue;
        };
        for nla in nlas {
            let rtnetlink::packet_route::link::InfoTun::Other(nla) = nla else {
                continue;
            };
            use rtnetlink::packet_core::Nla;
            let mut v = vec![0u8; nla.value_len()];
            nla.emit_value(&mut v);
            let u32_of = || {
                v.get(..4)
                    .and_then(|b| b.try_into().ok())
                    .map(u32::from_ne_bytes)
            };
            let flag = v.first().is_some_and(|b| *b != 0);
            match nla.kind() {
                IFLA_TUN_OWNER => facts.owner = u32_of(),
                IFLA_TUN_GROUP => facts.group = u32_of(),
                // The type is the IFF_TUN/IFF_TAP flag value.
                IFLA_TUN_TYPE => facts.tap = v.first() == Some(&(libc::IFF_TAP as u8)),
                IFLA_TUN_VNET_HDR => facts.vnet_hdr = flag,
                IFLA_TUN_PERSIST => facts.persist = flag,
                IFLA_TUN_MULTI_QUEUE => facts.multi_queue = flag,
                _ => {}
            }
        }
    }
    Some(facts)
}

/// CHECK of the tap binding: the tap as [`configure`] made it, then both
/// redirects.
pub(super) async fn check(handle: &Handle, site: &TapSite<'_>) -> Result<()> {
    let TapSite {
        spec,
        eth,
        eth_index,
        mtu,
        alias,
    } = *site;
    let tap = &spec.name;
    let wrong = |what: String| KernelError::mismatch(Mismatch::Tap, format!("tap {tap}: {what}"));
    let link = link_named(handle, tap)
        .await?
        .ok_or_else(|| wrong("not found in the pod".into()))?;
    let facts = tun_facts(&link).ok_or_else(|| wrong("is not a tun device".into()))?;
    let link_facts = messages::link_facts(&link);
    let want_owner = Some(spec.owner);
    let want_group = Some(spec.group);
    let problem = if !facts.tap {
        Some("is a tun, not a tap".to_owned())
    } else if link_alias(&link) != Some(alias) {
        Some(format!(
            "has alias {:?}, want {alias:?}",
            link_alias(&link).unwrap_or("")
        ))
    } else if facts.owner != want_owner || facts.group != want_group {
        Some(format!(
            "is owned by {:?}:{:?}, want {}:{}",
            facts.owner, facts.group, spec.owner, spec.group
        ))
    } else if !facts.persist || !facts.vnet_hdr {
        Some("is not persistent with vnet headers".to_owned())
    } else if facts.multi_queue != spec.multi_queue() {
        Some(format!(
            "multi-queue is {}, want {}",
            facts.multi_queue,
            spec.multi_queue()
        ))
    } else if link_facts.mtu != Some(mtu) {
        Some(format!(
            "has MTU {}, want {mtu}",
            link_facts.mtu.unwrap_or(0)
        ))
    } else if !link_facts.up {
        Some("is down".to_owned())
    } else {
        None
    };
    if let Some(what) = problem {
        return Err(wrong(what));
    }
    let tap_index = link.header.index;
    for (from, from_name, to, to_name) in [
        (eth_index, eth, tap_index, tap.as_str()),
        (tap_index, tap.as_str(), eth_index, eth),
    ] {
        if !redirects(handle, from, to).await? {
            return Err(KernelError::mismatch(
                Mismatch::TapRedirect,
                format!("no ingress redirect from {from_name} to {to_name}"),
            ));
        }
    }
    Ok(())
}

/// Whether an ingress filter of `from` redirects to the egress of `to`.
async fn redirects(handle: &Handle, from: u32, to: u32) -> Result<bool> {
    let index = i32::try_from(from)
        .map_err(|_| KernelError::Internal(format!("link index {from} out of range")))?;
    let filters: Vec<_> = handle
        .traffic_filter(index)
        .get()
        .ingress()
        .execute()
        .try_collect()
        .await
        .map_err(|e| KernelError::refused("reading the pod's tc filters", reason(&e)))?;
    let to_target = |action: &TcAction| {
        action.attributes.iter().any(|a| match a {
            TcActionAttribute::Options(opts) => opts.iter().any(|o| {
                matches!(o, TcActionOption::Mirror(TcActionMirrorOption::Parms(m))
                    if m.ifindex == to && m.eaction == TcMirrorActionType::EgressRedir)
            }),
            _ => false,
        })
    };
    Ok(filters.iter().any(|f| {
        f.attributes.iter().any(|a| match a {
            rtnetlink::packet_route::tc::TcAttribute::Options(opts) => {
                opts.iter().any(|o| match o {
                    TcOption::U32(TcFilterU32Option::Action(actions)) => {
                        actions.iter().any(to_target)
                    }
                    _ => false,
                })
            }
            _ => false,
        })
    }))
}
