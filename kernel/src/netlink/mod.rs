//! The real kernel, through rtnetlink: routed point-to-point veth with an anycast gateway.
//!
//! Each pod gets a veth whose node end carries the same MAC on every node
//! (`GATEWAY_MAC`) and whose pod end holds the pod's addresses as /32 and
//! /128 with default routes via 169.254.1.1 and fe80::1. The node routes each
//! pod address to its veth with a protocol number of our own, so that our
//! routes can be found again after a restart. There are no bridges and no
//! subnets on links.
//!
//! Node-side changes go through one long-lived rtnetlink connection opened
//! by [`Netlink::connect`] in the daemon's own netns. Pod-side changes go
//! through a connection opened inside the pod netns by a dedicated thread
//! (see `netns`). This module is the only place that speaks netlink.

mod flow_feed;
mod handover;
mod messages;
mod netns;
mod nf_read;
mod overlay;
mod pod;
mod tap;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::Arc;

use async_trait::async_trait;
use futures::future::join_all;
use futures::TryStreamExt;
use rtnetlink::packet_route::link::{LinkAttribute, LinkMessage};
use rtnetlink::packet_route::route::RouteMessage;
use rtnetlink::packet_route::{AddressFamily, RouteNetlinkMessage};
use rtnetlink::Handle;

use super::{
    HostRoute, Kernel, PodNetns, PodWiring, Veths, GATEWAY_MAC, GATEWAY_V6, HOST_IFNAME_PREFIX,
    ROUTE_PROTOCOL,
};
use crate::error::{KernelError, Result};
pub use handover::LinuxHandover;
use messages::{errno, reason, Step, ACKED, CREATE, CREATE_ECHO, REPLACE};
pub(super) use netns::open_netns;
use netns::pod_interface_exists;
use tether_base::error::Mismatch;
use tether_base::mac::Mac;

/// Link group ("tth" and 1) that marks node-side veths about to be deleted
/// in one batch; nothing else should use it.
pub const DOOMED_GROUP: u32 = 0x7474_6801;

/// A link-layer address as the kernel reported it, for CHECK's messages:
/// a MAC in the usual form, anything else as raw bytes.
fn mac_text(mac: Option<&[u8]>) -> String {
    match mac {
        Some(bytes) => match <[u8; 6]>::try_from(bytes) {
            Ok(m) => Mac::from(m).to_string(),
            Err(_) => format!("{bytes:02x?}"),
        },
        None => "none".into(),
    }
}

/// The pod side of a wiring, as the pod netns thread needs it.
fn pod_side(w: &PodWiring<'_>) -> pod::PodSide {
    pod::PodSide {
        ifname: w.pod_ifname.to_owned(),
        netns: w.netns.path().display().to_string(),
        mac: w.pod_mac,
        ips: w.ips.to_vec(),
        mtu: w.mtu,
        tap: w.tap.map(|t| (t.clone(), tap::alias(w.host_ifname))),
        managed_tap_peer: None,
    }
}

/// What creating the veth told us.
struct Created {
    host_index: u32,
    peer_index: Option<u32>,
}

/// The dataplane: the node-netns rtnetlink connection and every operation
/// that changes or reads the kernel's network objects.
#[derive(Debug, Clone)]
pub struct Netlink {
    handle: Handle,
    /// The kernel runs one dump at a time per netlink socket and answers a
    /// second with EBUSY; every node-side dump takes this lock.
    dumps: std::sync::Arc<tokio::sync::Mutex<()>>,
}

impl Netlink {
    /// Opens the rtnetlink connection in the current (node) netns and spawns
    /// its task on the current tokio runtime.
    pub fn connect() -> Result<Self> {
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| KernelError::Internal("the dataplane needs a tokio runtime".into()))?;
        // Strict checking lets the kernel filter dumps by protocol and device,
        // so reading our routes does not copy the whole table.
        let (connection, handle, _) = rtnetlink::new_connection_with_strict_check()
            .map_err(|e| KernelError::refused("opening the node rtnetlink socket", e))?;
        runtime.spawn(connection);
        Ok(Self {
            handle,
            dumps: Default::default(),
        })
    }

    async fn create_veth(&self, w: &PodWiring<'_>) -> Result<Created> {
        let context = || format!("creating veth {} for {}", w.host_ifname, w.pod_ifname);
        let netns = w.netns.file()?;
        let err = match self.try_create_veth(w, netns).await {
            Ok(created) => return Ok(created),
            Err(e) if errno(&e) == Some(libc::EEXIST) => e,
            Err(e) => return Err(KernelError::refused(context(), reason(&e))),
        };
        // One of the two names is taken; which one decides what to do.
        if pod_interface_exists(netns, w.pod_ifname).await? {
            return Err(KernelError::Exists(w.pod_ifname.to_owned()));
        }
        // The caller guarantees no live attachment owns this name: it is
        // left over from an earlier attachment with the same key.
        let stale = self
            .link_index(w.host_ifname)
            .await?
            .ok_or_else(|| KernelError::refused(context(), reason(&err)))?;
        tracing::info!(veth = w.host_ifname, "deleting a stale veth before ADD");
        self.delete_index(stale).await?;
        self.try_create_veth(w, netns)
            .await
            .map_err(|e| KernelError::refused(context(), reason(&e)))
    }

    async fn try_create_veth(
        &self,
        w: &PodWiring<'_>,
        netns: &std::fs::File,
    ) -> Result<Created, rtnetlink::Error> {
        let message = messages::veth(
            w.host_ifname,
            w.pod_ifname,
            w.pod_mac.octets(),
            w.mtu,
            netns.as_raw_fd(),
        );
        let answers = messages::request(
            &self.handle,
            RouteNetlinkMessage::NewLink(message),
            CREATE_ECHO,
        )
        .await?;
        let echo = answers.iter().find_map(|m| match m {
            RouteNetlinkMessage::NewLink(link) if link.header.index != 0 => Some(link),
            _ => None,
        });
        match echo {
            Some(link) => {
                let (host_index, peer_index) = messages::created_indexes(link);
                Ok(Created {
                    host_index,
                    peer_index,
                })
            }
            // Kernels before 6.3 do not echo RTM_NEWLINK: look both ends up.
            None => {
                let link = messages::link_by_name_get(&self.handle, w.host_ifname)
                    .await?
                    .ok_or(rtnetlink::Error::RequestFailed)?;
                Ok(Created {
                    host_index: link.header.index,
                    peer_index: None,
                })
            }
        }
    }

    async fn configure_host(&self, w: &PodWiring<'_>, index: u32) -> Result<()> {
        if w.ips.iter().any(IpAddr::is_ipv4) {
            // proxy_delay=0: a pod that lost its permanent gateway entry would
            // otherwise wait up to 0.8 s for each proxied ARP answer.
            for (path, value) in [
                (format!("net/ipv4/conf/{}/proxy_arp", w.host_ifname), "1"),
                (format!("net/ipv4/neigh/{}/proxy_delay", w.host_ifname), "0"),
            ] {
                write_sysctl(&path, value)
                    .map_err(|e| KernelError::refused(format!("writing /proc/sys/{path}"), e))?;
            }
        }
        let mut steps = Vec::with_capacity(1 + w.ips.len());
        if w.ips.iter().any(IpAddr::is_ipv6) {
            steps.push(
                Step::new(
                    RouteNetlinkMessage::NewAddress(messages::gateway_v6_address(index)),
                    CREATE,
                    format!("adding {GATEWAY_V6}/64 to {}", w.host_ifname),
                )
                .tolerating(libc::EEXIST),
            );
        }
        if w.routed {
            steps.extend(
                w.ips
                    .iter()
                    .map(|&ip| host_route_step(ip, index, w.host_ifname)),
            );
        }
        if steps.is_empty() {
            return Ok(());
        }
        messages::batch(&self.handle, steps).await
    }

    async fn check_host(&self, w: &PodWiring<'_>) -> Result<()> {
        let host = w.host_ifname;
        let link = messages::link_by_name_get(&self.handle, host)
            .await
            .map_err(|e| KernelError::refused("reading the node's links", reason(&e)))?
            .ok_or_else(|| {
                KernelError::mismatch(
                    Mismatch::HostInterface,
                    format!("{host} not found on the node"),
                )
            })?;
        let facts = messages::link_facts(&link);
        if !facts.up {
            return Err(KernelError::mismatch(
                Mismatch::HostInterface,
                format!("{host} is down"),
            ));
        }
        if facts.mac.as_deref() != Some(&GATEWAY_MAC.octets()[..]) {
            return Err(KernelError::mismatch(
                Mismatch::HostInterface,
                format!(
                    "{host} has MAC {}, want {}",
                    mac_text(facts.mac.as_deref()),
                    GATEWAY_MAC
                ),
            ));
        }
        if facts.mtu != Some(w.mtu) {
            return Err(KernelError::mismatch(
                Mismatch::HostInterface,
                format!("{host} has MTU {}, want {}", facts.mtu.unwrap_or(0), w.mtu),
            ));
        }
        if !w.routed {
            return Ok(());
        }
        let present = self.our_destinations(w.ips, link.header.index).await?;
        for &ip in w.ips {
            let len = messages::host_prefix_len(ip);
            if !present.contains(&(ip, len)) {
                return Err(KernelError::mismatch(
                    Mismatch::HostRoute,
                    format!("no route {ip}/{len} dev {host} proto {ROUTE_PROTOCOL} on the node"),
                ));
            }
        }
        Ok(())
    }

    /// Destinations of our routes through device `index`, for the families
    /// present in `ips`.
    async fn our_destinations(&self, ips: &[IpAddr], index: u32) -> Result<HashSet<(IpAddr, u8)>> {
        let mut families = Vec::with_capacity(2);
        if ips.iter().any(IpAddr::is_ipv4) {
            families.push(AddressFamily::Inet);
        }
        if ips.iter().any(IpAddr::is_ipv6) {
            families.push(AddressFamily::Inet6);
        }
        let mut present = HashSet::new();
        for family in families {
            let routes = self.dump_our_routes(family, Some(index)).await?;
            present.extend(routes.iter().filter_map(messages::route_destination));
        }
        Ok(present)
    }

    /// Our routes of one family, optionally through one device, dumped under
    /// the dump lock.
    async fn dump_our_routes(
        &self,
        family: AddressFamily,
        index: Option<u32>,
    ) -> Result<Vec<RouteMessage>> {
        let _one_dump_at_a_time = self.dumps.lock().await;
        messages::dump_routes(
            &self.handle,
            messages::route_dump(family, Some(ROUTE_PROTOCOL), index),
        )
        .await
        .map_err(|e| KernelError::refused("reading the node's routes", reason(&e)))
    }

    async fn link_names(&self) -> Result<HashMap<u32, String>> {
        let _one_dump_at_a_time = self.dumps.lock().await;
        let links: Vec<LinkMessage> = self
            .handle
            .link()
            .get()
            .execute()
            .try_collect()
            .await
            .map_err(|e| KernelError::refused("reading the node's links", reason(&e)))?;
        Ok(links
            .iter()
            .filter_map(|l| Some((l.header.index, messages::link_facts(l).name?)))
            .collect())
    }

    async fn delete_index(&self, index: u32) -> Result<()> {
        let mut message = LinkMessage::default();
        message.header.index = index;
        match messages::request(&self.handle, RouteNetlinkMessage::DelLink(message), ACKED).await {
            Ok(_) => Ok(()),
            Err(e) if errno(&e) == Some(libc::ENODEV) => Ok(()),
            Err(e) => Err(KernelError::refused(
                format!("deleting link #{index}"),
                reason(&e),
            )),
        }
    }
}

#[async_trait]
impl Veths for Netlink {
    fn open_netns(&self, path: &Path) -> Result<PodNetns> {
        open_netns(path).map(|file| PodNetns::opened(path, file))
    }

    /// ADD wiring: the veth pair, the node side (proxy ARP, fe80::1, host
    /// routes) and the pod side (addresses, gateway neighbours, default
    /// routes). On any error it deletes the veth, which takes both ends and
    /// their routes, and returns the first error.
    async fn wire(&self, w: &PodWiring<'_>) -> Result<()> {
        // The pod thread starts first, so that its start-up overlaps the
        // veth creation; it then waits for the peer's index, and sends the
        // whole pod side in one batch on a socket it opens in the pod netns.
        let (index_tx, index_rx) = tokio::sync::oneshot::channel::<Option<u32>>();
        let side = pod_side(w);
        let pod = netns::spawn_in_netns(w.netns.file()?, move || {
            // The netns thread has no runtime: a blocking wait is its own.
            match index_rx.blocking_recv() {
                Ok(peer_index) => pod::configure_here(side, peer_index),
                // No veth: the caller reports why.
                Err(_) => Ok(()),
            }
        })?;
        let created = self.create_veth(w).await?;
        // A closed channel means the thread already failed; its error is
        // collected below.
        let _ = index_tx.send(created.peer_index);
        let (host, pod) = futures::join!(self.configure_host(w, created.host_index), pod);
        if let Err(e) = host.and(pod) {
            if let Some(tap) = w.tap {
                // The veth's deletion takes its pod end, not the tap.
                if let Err(undo) = self.remove_tap(w.netns, &tap.name, w.host_ifname).await {
                    tracing::warn!(tap = tap.name, error = %undo, "could not delete the tap of a failed ADD");
                }
            }
            if let Err(undo) = self.delete_index(created.host_index).await {
                tracing::warn!(
                    veth = w.host_ifname,
                    error = %undo,
                    "could not delete the veth of a failed ADD"
                );
            }
            return Err(e);
        }
        Ok(())
    }

    /// CHECK: compares the kernel (both netns) with the wiring. The first
    /// difference, pod side before node side, is an `KernelError::Mismatch` whose
    /// detail names the object and both values.
    async fn check(&self, w: &PodWiring<'_>) -> Result<()> {
        let mut side = pod_side(w);
        if w.managed_tap {
            // The veth's pod end is known by its peer, the node side, once
            // KubeVirt has renamed it.
            side.managed_tap_peer = self.link_index(w.host_ifname).await?;
        }
        let pod = netns::with_netns_handle(w.netns.file()?, move |handle| pod::check(handle, side));
        let (pod, host) = futures::join!(pod, self.check_host(w));
        pod.and(host)
    }

    /// Answers once the tap is found to be ours (or absent); the deletion
    /// itself, which costs the kernel about 25 ms here (a tun device's
    /// unregistration waits for an RCU grace period), finishes on the
    /// netns thread after the answer. It deletes by index, so a tap of the
    /// same name made later (a new ADD of the same attachment) is never
    /// the one deleted.
    async fn remove_tap(&self, netns: &PodNetns, tap: &str, host_ifname: &str) -> Result<()> {
        let (name, alias) = (tap.to_owned(), tap::alias(host_ifname));
        let (found_tx, found_rx) = tokio::sync::oneshot::channel::<Result<()>>();
        let done = netns::spawn_with_handle(netns.file()?, move |handle| async move {
            let index = match tap::find(&handle, &name, &alias).await {
                Ok(Some(index)) => index,
                other => {
                    let _ = found_tx.send(other.map(|_| ()));
                    return Ok(());
                }
            };
            let _ = found_tx.send(Ok(()));
            if let Err(e) = tap::delete(&handle, index, &name).await {
                tracing::warn!(tap = name, error = %e, "deleting a released tap failed");
            }
            Ok(())
        })?;
        // The thread's own end is not awaited: it outlives this call.
        drop(done);
        found_rx.await.map_err(|_| {
            KernelError::Internal("the tap's netns thread ended without an answer".into())
        })?
    }

    /// Deletes a node-side veth (both ends go). Idempotent: no such device is
    /// success. Refuses names without our prefix, so that a bug can never
    /// take down a node interface.
    async fn delete_link(&self, host_ifname: &str) -> Result<()> {
        if !host_ifname.starts_with(HOST_IFNAME_PREFIX) {
            return Err(KernelError::Internal(format!(
                "refusing to delete {host_ifname}: not a tether veth"
            )));
        }
        let message = RouteNetlinkMessage::DelLink(messages::link_by_name(host_ifname));
        match messages::request(&self.handle, message, ACKED).await {
            Ok(_) => Ok(()),
            Err(e) if errno(&e) == Some(libc::ENODEV) => Ok(()),
            Err(e) => Err(KernelError::refused(
                format!("deleting veth {host_ifname}"),
                reason(&e),
            )),
        }
    }

    /// Deletes many node-side veths in one kernel batch: each is moved into
    /// [`DOOMED_GROUP`], then the group is deleted with one RTM_DELLINK,
    /// which the kernel tears down with one `unregister_netdevice_many`.
    /// Measured here: 100 veths in 58 ms this way against 1617 ms one by
    /// one, all of it time the RTNL lock is held against every other
    /// request. Names that no longer exist are skipped.
    async fn delete_links(&self, host_ifnames: &[String]) -> Result<()> {
        let steps: Vec<Step> = host_ifnames
            .iter()
            .filter(|n| n.starts_with(HOST_IFNAME_PREFIX))
            .map(|name| {
                let mut msg = messages::link_by_name(name);
                msg.attributes.push(LinkAttribute::Group(DOOMED_GROUP));
                Step::new(
                    RouteNetlinkMessage::SetLink(msg),
                    ACKED,
                    format!("marking veth {name} for deletion"),
                )
                .tolerating(libc::ENODEV)
            })
            .collect();
        if steps.is_empty() {
            return Ok(());
        }
        messages::batch(&self.handle, steps).await?;
        let mut group = LinkMessage::default();
        group.attributes.push(LinkAttribute::Group(DOOMED_GROUP));
        match messages::request(&self.handle, RouteNetlinkMessage::DelLink(group), ACKED).await {
            Ok(_) => Ok(()),
            // Every one of them was already gone.
            Err(e) if errno(&e) == Some(libc::ENODEV) => Ok(()),
            Err(e) => Err(KernelError::refused(
                format!("deleting {} veths", host_ifnames.len()),
                reason(&e),
            )),
        }
    }

    /// Removes tether's host routes to these pod IPs (only routes with our
    /// protocol). Idempotent: a route that is not there is success. Every
    /// route is attempted; the first failure is returned.
    async fn remove_host_routes(&self, ips: &[IpAddr]) -> Result<()> {
        let results = join_all(ips.iter().map(|&ip| async move {
            let selector = messages::host_route_selector(ip);
            match messages::request(&self.handle, RouteNetlinkMessage::DelRoute(selector), ACKED)
                .await
            {
                Ok(_) => Ok(()),
                Err(e) if matches!(errno(&e), Some(libc::ESRCH | libc::ENOENT)) => Ok(()),
                Err(e) => Err(KernelError::refused(
                    format!(
                        "removing the host route to {ip}/{}",
                        messages::host_prefix_len(ip)
                    ),
                    reason(&e),
                )),
            }
        }))
        .await;
        first_error(results)
    }

    /// Adds the host routes for ips via host_ifname if missing (startup
    /// reconcile). Returns how many it added.
    async fn ensure_host_routes(&self, host_ifname: &str, ips: &[IpAddr]) -> Result<usize> {
        let context = || format!("restoring host routes via {host_ifname}");
        let index = self
            .link_index(host_ifname)
            .await?
            .ok_or_else(|| KernelError::refused(context(), "no such device"))?;
        let present = self.our_destinations(ips, index).await?;
        let missing: Vec<IpAddr> = ips
            .iter()
            .copied()
            .filter(|ip| !present.contains(&(*ip, messages::host_prefix_len(*ip))))
            .collect();
        let steps = missing
            .iter()
            .map(|&ip| host_route_step(ip, index, host_ifname))
            .collect();
        messages::batch(&self.handle, steps).await?;
        Ok(missing.len())
    }

    /// Every route with ROUTE_PROTOCOL in the main table (v4 and v6):
    /// destination, prefix length and the output device's name if it
    /// resolves.
    async fn our_routes(&self) -> Result<Vec<HostRoute>> {
        let v4 = self.dump_our_routes(AddressFamily::Inet, None).await?;
        let v6 = self.dump_our_routes(AddressFamily::Inet6, None).await?;
        let names = self.link_names().await?;
        Ok(v4
            .iter()
            .chain(v6.iter())
            .filter_map(|r| {
                let (dst, prefix_len) = messages::route_destination(r)?;
                let oif = messages::route_oif(r).and_then(|i| names.get(&i).cloned());
                Some(HostRoute {
                    dst,
                    prefix_len,
                    oif,
                })
            })
            .collect())
    }

    /// Names of every link whose name starts with HOST_IFNAME_PREFIX.
    async fn our_links(&self) -> Result<Vec<String>> {
        let mut names: Vec<String> = self
            .link_names()
            .await?
            .into_values()
            .filter(|n| n.starts_with(HOST_IFNAME_PREFIX))
            .collect();
        names.sort();
        Ok(names)
    }

    /// The index of the node link named `name`, if it exists.
    async fn link_index(&self, name: &str) -> Result<Option<u32>> {
        messages::link_by_name_get(&self.handle, name)
            .await
            .map(|l| l.map(|l| l.header.index))
            .map_err(|e| KernelError::refused(format!("looking up {name}"), reason(&e)))
    }
}

impl Kernel for Netlink {
    fn second_socket(&self) -> Result<Arc<dyn Kernel>> {
        Ok(Arc::new(Netlink::connect()?))
    }

    fn handover(&self) -> Arc<dyn crate::Handover> {
        Arc::new(LinuxHandover::new(self.handle.clone(), self.dumps.clone()))
    }
}

/// The host route to `ip` through device `index`. REPLACE rather than EXCL:
/// the IPAM is the authority on who owns an address, and a route left behind
/// by a crash must not fail every later ADD of that address.
fn host_route_step(ip: IpAddr, index: u32, host_ifname: &str) -> Step {
    Step::new(
        RouteNetlinkMessage::NewRoute(messages::host_route(ip, index)),
        REPLACE,
        format!(
            "adding host route {ip}/{} dev {host_ifname}",
            messages::host_prefix_len(ip)
        ),
    )
}

pub(super) fn write_sysctl(path: &str, value: &str) -> std::io::Result<()> {
    // /proc/sys/net resolves in the netns of the calling thread: the daemon's.
    std::fs::write(Path::new("/proc/sys").join(path), value)
}

/// Every result examined; the first error returned, the others logged.
fn first_error(results: Vec<Result<()>>) -> Result<()> {
    let mut first = None;
    for e in results.into_iter().filter_map(Result::err) {
        if first.is_none() {
            first = Some(e);
        } else {
            tracing::warn!(error = %e, "further teardown failure");
        }
    }
    first.map_or(Ok(()), Err)
}
