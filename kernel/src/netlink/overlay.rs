//! Routing between nodes: the kernel objects that carry pod traffic to the
//! blocks other nodes own.
//!
//! Two modes share one route table. In host-gw mode each remote block is a
//! plain `block via <node ip>` route and the underlay does the rest; it needs
//! every node on one L2 segment. In vxlan mode every remote block is routed
//! `via <gateway> dev tether.vxlan onlink`, where the gateway is a made-up
//! per-node address with a permanent neighbour entry (gateway -> that node's
//! VTEP MAC) and a permanent FDB entry (VTEP MAC -> node ip). Nothing is
//! learned or flooded: the control plane knows every node, so the kernel is
//! told everything up front and never has to ask.
//!
//! Every route is marked with [`CLUSTER_ROUTE_PROTOCOL`], so that a restarted
//! daemon (or one switching modes) finds exactly the routes it made and
//! nothing else. The device, its FDB and its permanent neighbours belong to
//! tether entirely.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use rtnetlink::packet_core::{NLM_F_DUMP, NLM_F_REQUEST};
use rtnetlink::packet_route::address::{
    AddressAttribute, AddressFlags, AddressHeaderFlags, AddressMessage, AddressScope,
};
use rtnetlink::packet_route::link::{InfoData, InfoVxlan, LinkAttribute, LinkInfo, LinkMessage};
use rtnetlink::packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourMessage, NeighbourState,
};
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteFlags, RouteHeader, RouteMessage, RouteMetric,
    RouteProtocol, RouteScope, RouteType,
};
use rtnetlink::packet_route::{AddressFamily, RouteNetlinkMessage};
use rtnetlink::{LinkMessageBuilder, LinkUnspec, LinkVxlan};

use super::messages::{self, errno, reason, Step, ACKED, CREATE, REPLACE};
use super::{write_sysctl, Netlink};
use crate::error::{KernelError, Result};
use crate::{
    ClusterRoute, NodeRoutes, Synced, Veths, VxlanConfig, VxlanPeer, CLUSTER_ROUTE_PROTOCOL,
    VM_ROUTE_PROTOCOL, VXLAN_IFNAME,
};
use async_trait::async_trait;
use tether_base::mac::Mac;

#[cfg(test)]
mod tests;

/// Header flags of a dump request.
const DUMP: u16 = NLM_F_REQUEST | NLM_F_DUMP;

/// One proto-202 route as dumped: the selector that deletes it, and the
/// route itself when it has a shape tether makes (a multipath or
/// gateway-less route does not, and is only ever deleted).
struct FoundRoute {
    dst: IpNet,
    route: Option<ClusterRoute>,
    selector: RouteMessage,
}

impl Netlink {
    /// Every proto-202 route in the main table, v4 and v6, sorted. Routes of
    /// that protocol that tether would never make (no gateway, multipath)
    /// are left out here, and deleted by [`Self::sync_cluster_routes`].
    pub async fn cluster_routes(&self) -> Result<Vec<ClusterRoute>> {
        let mut routes: Vec<ClusterRoute> = self
            .found_routes(CLUSTER_ROUTE_PROTOCOL)
            .await?
            .into_iter()
            .filter_map(|f| f.route)
            .collect();
        routes.sort();
        Ok(routes)
    }

    /// Adds or replaces the routes `put` of `protocol` and deletes those
    /// of `gone` (see [`NodeRoutes::change_vm_routes`]); `kind` names them
    /// in errors.
    async fn change_routes(
        &self,
        protocol: u8,
        kind: &str,
        put: &[ClusterRoute],
        gone: &[ClusterRoute],
    ) -> Result<Synced> {
        let put = normalized_routes(put)?;
        let gone = normalized_routes(gone)?;
        if put.is_empty() && gone.is_empty() {
            return Ok(Synced::default());
        }
        let devices: BTreeSet<&str> = put
            .iter()
            .chain(&gone)
            .filter_map(|r| r.onlink_dev.as_deref())
            .collect();
        let mut indexes = HashMap::with_capacity(devices.len());
        for dev in devices {
            match self.link_index(dev).await? {
                Some(index) => {
                    indexes.insert(dev, index);
                }
                // A route to delete through a device that is gone went
                // with it; one to add cannot be.
                None if put.iter().all(|r| r.onlink_dev.as_deref() != Some(dev)) => {}
                None => {
                    return Err(KernelError::refused(
                        format!("adding {kind} routes via {dev}"),
                        "no such device",
                    ))
                }
            }
        }
        let oif = |r: &ClusterRoute| {
            r.onlink_dev
                .as_deref()
                .and_then(|d| indexes.get(d).copied())
        };
        let mut steps = Vec::with_capacity(put.len() + gone.len());
        for r in gone
            .iter()
            .filter(|r| r.onlink_dev.is_none() || oif(r).is_some())
        {
            steps.push(
                Step::new(
                    RouteNetlinkMessage::DelRoute(route_selector(r, oif(r), protocol)),
                    ACKED,
                    format!("deleting {kind} route {}", route_text(r)),
                )
                .tolerating(libc::ESRCH),
            );
        }
        for r in &put {
            steps.push(Step::new(
                RouteNetlinkMessage::NewRoute(cluster_route(r, oif(r), protocol)),
                REPLACE,
                format!("adding {kind} route {}", route_text(r)),
            ));
        }
        messages::batch(&self.handle, steps).await?;
        Ok(Synced {
            added: put.len(),
            removed: gone.len(),
        })
    }

    async fn sync_routes(&self, protocol: u8, desired: &[ClusterRoute]) -> Result<Synced> {
        let desired = normalized_routes(desired)?;
        let found = self.found_routes(protocol).await?;
        let present: HashSet<&ClusterRoute> =
            found.iter().filter_map(|f| f.route.as_ref()).collect();
        let wanted: HashSet<IpNet> = desired.iter().map(|r| r.dst).collect();
        let missing: Vec<&ClusterRoute> = desired.iter().filter(|r| !present.contains(r)).collect();
        let stale: Vec<&FoundRoute> = found.iter().filter(|f| !wanted.contains(&f.dst)).collect();
        if missing.is_empty() && stale.is_empty() {
            return Ok(Synced::default());
        }

        let devices: BTreeSet<&str> = missing
            .iter()
            .filter_map(|r| r.onlink_dev.as_deref())
            .collect();
        let mut indexes = HashMap::with_capacity(devices.len());
        for dev in devices {
            let index = self.link_index(dev).await?.ok_or_else(|| {
                KernelError::refused(format!("adding cluster routes via {dev}"), "no such device")
            })?;
            indexes.insert(dev, index);
        }

        let mut steps = Vec::with_capacity(missing.len() + stale.len());
        for route in &missing {
            let oif = route
                .onlink_dev
                .as_deref()
                .and_then(|d| indexes.get(d).copied());
            steps.push(Step::new(
                RouteNetlinkMessage::NewRoute(cluster_route(route, oif, protocol)),
                REPLACE,
                format!("adding cluster route {}", route_text(route)),
            ));
        }
        for f in &stale {
            steps.push(
                Step::new(
                    RouteNetlinkMessage::DelRoute(f.selector.clone()),
                    ACKED,
                    format!("deleting cluster route to {}", f.dst),
                )
                // Gone already: someone else deleted it, or its device went.
                .tolerating(libc::ESRCH),
            );
        }
        messages::batch(&self.handle, steps).await?;
        Ok(Synced {
            added: missing.len(),
            removed: stale.len(),
        })
    }

    /// The address the node would use toward its default route, the
    /// natural underlay address when none is configured: the default
    /// route's preferred source if it has one, else the first global
    /// address on its output device. IPv4 first, then IPv6; among several
    /// default routes the lowest metric wins. None without a usable default
    /// route.
    pub async fn default_route_address(&self) -> Result<Option<IpAddr>> {
        Ok(self.default_route_addresses().await?.into_iter().next())
    }

    /// Like [`Netlink::default_route_address`], once per family: the
    /// IPv4 address (if IPv4 has a default route), then the IPv6 one.
    pub async fn default_route_addresses(&self) -> Result<Vec<IpAddr>> {
        let mut found = Vec::new();
        for family in [AddressFamily::Inet, AddressFamily::Inet6] {
            let routes = self.dump_main_routes(family, None).await?;
            let default = routes
                .iter()
                .filter(|r| r.header.destination_prefix_length == 0)
                .filter(|r| r.header.kind == RouteType::Unicast)
                .min_by_key(|r| route_priority(r));
            let Some(route) = default else { continue };
            if let Some(src) = route_prefsrc(route) {
                found.push(src);
            } else if let Some(oif) = route_first_oif(route) {
                if let Some(ip) = self.first_global_address(family, oif).await? {
                    found.push(ip);
                }
            }
        }
        Ok(found)
    }

    /// Every proto-202 route, with the device names its onlink routes need.
    async fn found_routes(&self, protocol: u8) -> Result<Vec<FoundRoute>> {
        let mut routes = self
            .dump_main_routes(AddressFamily::Inet, Some(protocol))
            .await?;
        routes.extend(
            self.dump_main_routes(AddressFamily::Inet6, Some(protocol))
                .await?,
        );
        // Only onlink routes name their device; skip the link dump without.
        let names = if routes.iter().any(is_onlink) {
            self.link_names().await?
        } else {
            HashMap::new()
        };
        Ok(routes
            .iter()
            .filter_map(|r| {
                let (ip, len) = messages::route_destination(r)?;
                let dst = IpNet::new(ip, len).ok()?;
                Some(FoundRoute {
                    dst,
                    route: cluster_route_of(r, dst, &names),
                    selector: cluster_route_selector(r, dst, protocol),
                })
            })
            .collect())
    }

    /// The main table's routes of one family, optionally of one protocol,
    /// dumped under the dump lock.
    async fn dump_main_routes(
        &self,
        family: AddressFamily,
        protocol: Option<u8>,
    ) -> Result<Vec<RouteMessage>> {
        let _one_dump_at_a_time = self.dumps.lock().await;
        messages::dump_routes(&self.handle, messages::route_dump(family, protocol, None))
            .await
            .map_err(|e| KernelError::refused("reading the node's routes", reason(&e)))
    }

    async fn create_vxlan(&self, cfg: &VxlanConfig) -> Result<()> {
        messages::request(
            &self.handle,
            RouteNetlinkMessage::NewLink(vxlan_link(cfg)),
            CREATE,
        )
        .await
        .map(|_| ())
        .map_err(|e| {
            KernelError::refused(
                format!(
                    "creating {VXLAN_IFNAME} (vni {}, port {}, local {})",
                    cfg.vni, cfg.port, cfg.local
                ),
                reason(&e),
            )
        })
    }

    async fn fix_vxlan_in_place(&self, link: &LinkMessage, cfg: &VxlanConfig) -> Result<()> {
        let facts = messages::link_facts(link);
        if facts.up && facts.mtu == Some(cfg.mtu) {
            return Ok(());
        }
        let message = LinkUnspec::new_with_index(link.header.index)
            .mtu(cfg.mtu)
            .up()
            .build();
        messages::request(&self.handle, RouteNetlinkMessage::SetLink(message), ACKED)
            .await
            .map(|_| ())
            .map_err(|e| {
                KernelError::refused(
                    format!("setting {VXLAN_IFNAME} up with MTU {}", cfg.mtu),
                    reason(&e),
                )
            })
    }

    /// The FDB of the vxlan device: each MAC with its destinations, None
    /// standing for one that is not permanent (so that it gets replaced).
    async fn vxlan_fdb(&self, index: u32) -> Result<BTreeMap<[u8; 6], Vec<Option<IpAddr>>>> {
        let answers = {
            let _one_dump_at_a_time = self.dumps.lock().await;
            messages::request(
                &self.handle,
                RouteNetlinkMessage::GetNeighbour(neighbour_dump(AddressFamily::Bridge, index)),
                DUMP,
            )
            .await
            .map_err(|e| {
                KernelError::refused(format!("reading the FDB of {VXLAN_IFNAME}"), reason(&e))
            })?
        };
        let mut fdb: BTreeMap<[u8; 6], Vec<Option<IpAddr>>> = BTreeMap::new();
        for entry in neighbours_on(&answers, index) {
            if entry.header.family != AddressFamily::Bridge {
                continue;
            }
            if let Some(mac) = neighbour_mac(entry) {
                let permanent = entry.header.state == NeighbourState::Permanent;
                fdb.entry(mac)
                    .or_default()
                    .push(fdb_destination(entry).filter(|_| permanent));
            }
        }
        Ok(fdb)
    }

    /// The IPv4 and IPv6 neighbours of the vxlan device: the MAC of each
    /// permanent one, None for the others.
    async fn vxlan_neighbours(&self, index: u32) -> Result<HashMap<IpAddr, Option<[u8; 6]>>> {
        let answers = {
            let _one_dump_at_a_time = self.dumps.lock().await;
            // AF_UNSPEC: the ARP and the NDP tables in one dump.
            messages::request(
                &self.handle,
                RouteNetlinkMessage::GetNeighbour(neighbour_dump(AddressFamily::Unspec, index)),
                DUMP,
            )
            .await
            .map_err(|e| {
                KernelError::refused(
                    format!("reading the neighbours on {VXLAN_IFNAME}"),
                    reason(&e),
                )
            })?
        };
        Ok(neighbours_on(&answers, index)
            .filter_map(|n| {
                let ip = neighbour_ip(n)?;
                let mac = if n.header.state == NeighbourState::Permanent {
                    neighbour_mac(n)
                } else {
                    None
                };
                Some((ip, mac))
            })
            .collect())
    }

    /// The first global, usable address of one family on a device.
    async fn first_global_address(
        &self,
        family: AddressFamily,
        index: u32,
    ) -> Result<Option<IpAddr>> {
        let answers = self.address_dump(family, index).await?;
        Ok(answers.iter().find_map(|m| match m {
            RouteNetlinkMessage::NewAddress(a)
                if a.header.family == family
                    && a.header.index == index
                    && a.header.scope == AddressScope::Universe
                    && usable_address(a) =>
            {
                messages::address_of(a)
            }
            _ => None,
        }))
    }

    /// The index of the device that holds address `ip`, if one does.
    async fn index_holding(&self, ip: IpAddr) -> Result<Option<u32>> {
        let family = match ip {
            IpAddr::V4(_) => AddressFamily::Inet,
            IpAddr::V6(_) => AddressFamily::Inet6,
        };
        let answers = self.address_dump(family, 0).await?;
        Ok(answers.iter().find_map(|m| match m {
            RouteNetlinkMessage::NewAddress(a) if messages::address_of(a) == Some(ip) => {
                Some(a.header.index)
            }
            _ => None,
        }))
    }

    /// The addresses of one family (of device `index`, or of every device
    /// for 0), dumped under the dump lock.
    async fn address_dump(
        &self,
        family: AddressFamily,
        index: u32,
    ) -> Result<Vec<RouteNetlinkMessage>> {
        let mut request = AddressMessage::default();
        request.header.family = family;
        request.header.index = index;
        let _one_dump_at_a_time = self.dumps.lock().await;
        messages::request(&self.handle, RouteNetlinkMessage::GetAddress(request), DUMP)
            .await
            .map_err(|e| KernelError::refused("reading the node's addresses", reason(&e)))
    }

    async fn link_by_index(&self, index: u32) -> Result<Option<LinkMessage>> {
        use futures::TryStreamExt;
        let mut links = self.handle.link().get().match_index(index).execute();
        match links.try_next().await {
            Ok(link) => Ok(link),
            Err(e) if errno(&e) == Some(libc::ENODEV) => Ok(None),
            Err(e) => Err(KernelError::refused(
                format!("looking up device #{index}"),
                reason(&e),
            )),
        }
    }
}

#[async_trait]
impl NodeRoutes for Netlink {
    /// Makes the proto-202 routes exactly `desired`: adds or replaces the
    /// missing or different ones, then deletes those to blocks no longer
    /// wanted. Replacing in place, rather than deleting first, means a block
    /// that changes next hop is never unrouted. Idempotent; when nothing
    /// differs it costs only the dumps. A route of another protocol to one
    /// of the blocks is replaced too: the control plane is the authority on
    /// who owns a block. Routes are keyed by block: a second proto-202
    /// route to a wanted block with another metric (tether sets none) is
    /// not looked for. Every change is attempted even when one is
    /// refused (a gateway not yet reachable must not keep a dead node's
    /// routes in place); the first refusal is then the error.
    async fn sync_cluster_routes(&self, desired: &[ClusterRoute]) -> Result<Synced> {
        self.sync_routes(CLUSTER_ROUTE_PROTOCOL, desired).await
    }

    /// Makes the proto-203 routes (a VM's address to the node it runs on)
    /// exactly `desired`, as [`Self::sync_cluster_routes`] does for blocks.
    /// A wanted route replaces whatever route to that address exists, so a
    /// migration's source node goes from its pod's host route to the route
    /// to the target in one kernel change, never unrouted in between.
    async fn sync_vm_routes(&self, desired: &[ClusterRoute]) -> Result<Synced> {
        self.sync_routes(VM_ROUTE_PROTOCOL, desired).await
    }

    async fn change_vm_routes(
        &self,
        put: &[ClusterRoute],
        gone: &[ClusterRoute],
    ) -> Result<Synced> {
        self.change_routes(VM_ROUTE_PROTOCOL, "VM", put, gone).await
    }

    async fn change_cluster_routes(
        &self,
        put: &[ClusterRoute],
        gone: &[ClusterRoute],
    ) -> Result<Synced> {
        self.change_routes(CLUSTER_ROUTE_PROTOCOL, "block", put, gone)
            .await
    }

    /// Creates tether.vxlan, or fixes it: a VNI, port, local address, MAC or
    /// learning setting that differs means deleting and recreating it
    /// (which drops its FDB, neighbours and routes: callers sync peers and
    /// routes after this), an MTU or admin state that differs is changed in
    /// place. Learning is off because every peer is programmed. IPv6 is
    /// enabled on it even where the node's default disables it, because the
    /// IPv6 gateways' neighbour entries and forwarded IPv6 packets need it.
    async fn ensure_vxlan(&self, cfg: &VxlanConfig) -> Result<()> {
        let existing = messages::link_by_name_get(&self.handle, VXLAN_IFNAME)
            .await
            .map_err(|e| KernelError::refused(format!("looking up {VXLAN_IFNAME}"), reason(&e)))?;
        match existing {
            Some(link) => match vxlan_difference(&link, cfg) {
                None => self.fix_vxlan_in_place(&link, cfg).await?,
                Some(why) => {
                    tracing::info!(device = VXLAN_IFNAME, %why, "recreating the vxlan device");
                    self.delete_index(link.header.index).await?;
                    self.create_vxlan(cfg).await?;
                }
            },
            None => self.create_vxlan(cfg).await?,
        }
        let path = format!("net/ipv6/conf/{VXLAN_IFNAME}/disable_ipv6");
        match write_sysctl(&path, "0") {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                tracing::warn!("IPv6 is disabled on this node: no IPv6 over {VXLAN_IFNAME}");
                Ok(())
            }
            Err(e) => Err(KernelError::refused(format!("writing /proc/sys/{path}"), e)),
        }
    }

    /// Makes the permanent FDB entries (peer MAC -> peer node ip) and the
    /// permanent neighbour entries (each gateway -> peer MAC) on
    /// tether.vxlan exactly `peers`: adds or replaces what is missing or
    /// different, deletes entries of peers no longer listed. Non-permanent
    /// neighbour entries are the kernel's and are left alone unless they
    /// stand in the way of a gateway. Counts are of entries (one FDB entry
    /// and one neighbour per gateway for each peer). As with routes, every
    /// change is attempted and the first refusal returned. Without the
    /// device, an empty list is success and anything else an error.
    async fn sync_vxlan_peers(&self, peers: &[VxlanPeer]) -> Result<Synced> {
        let (fdb_want, neigh_want) = peer_tables(peers)?;
        let Some(index) = self.link_index(VXLAN_IFNAME).await? else {
            if peers.is_empty() {
                return Ok(Synced::default());
            }
            return Err(KernelError::refused(
                "programming vxlan peers",
                format!("{VXLAN_IFNAME} does not exist"),
            ));
        };
        let fdb_have = self.vxlan_fdb(index).await?;
        let neigh_have = self.vxlan_neighbours(index).await?;

        let mut steps = Vec::new();
        let mut synced = Synced::default();
        for (mac, &dst) in &fdb_want {
            let have = fdb_have.get(mac).map(Vec::as_slice).unwrap_or_default();
            if have == [Some(dst)] {
                continue;
            }
            // REPLACE only rewrites a MAC's first destination: one with
            // several goes first.
            if have.len() > 1 {
                steps.push(fdb_delete_step(index, mac));
            }
            steps.push(Step::new(
                RouteNetlinkMessage::NewNeighbour(fdb_entry(index, mac, Some(dst))),
                REPLACE,
                format!("adding FDB entry {} dst {dst}", Mac::from(*mac)),
            ));
            synced.added += 1;
        }
        for (&gateway, mac) in &neigh_want {
            if neigh_have.get(&gateway) == Some(&Some(*mac)) {
                continue;
            }
            steps.push(Step::new(
                RouteNetlinkMessage::NewNeighbour(vxlan_neighbour(index, gateway, Some(mac))),
                REPLACE,
                format!("adding neighbour {gateway} lladdr {}", Mac::from(*mac)),
            ));
            synced.added += 1;
        }
        for (&gateway, mac) in &neigh_have {
            if mac.is_some() && !neigh_want.contains_key(&gateway) {
                steps.push(
                    Step::new(
                        RouteNetlinkMessage::DelNeighbour(vxlan_neighbour(index, gateway, None)),
                        ACKED,
                        format!("deleting neighbour {gateway} on {VXLAN_IFNAME}"),
                    )
                    .tolerating(libc::ENOENT),
                );
                synced.removed += 1;
            }
        }
        for mac in fdb_have.keys() {
            if !fdb_want.contains_key(mac) {
                steps.push(fdb_delete_step(index, mac));
                synced.removed += 1;
            }
        }
        messages::batch(&self.handle, steps).await?;
        Ok(synced)
    }

    /// Deletes tether.vxlan if present, with its FDB, neighbours and the
    /// routes through it (switching back to host-gw). Idempotent.
    async fn delete_vxlan(&self) -> Result<()> {
        let message = RouteNetlinkMessage::DelLink(messages::link_by_name(VXLAN_IFNAME));
        match messages::request(&self.handle, message, ACKED).await {
            Ok(_) => Ok(()),
            Err(e) if errno(&e) == Some(libc::ENODEV) => Ok(()),
            Err(e) => Err(KernelError::refused(
                format!("deleting {VXLAN_IFNAME}"),
                reason(&e),
            )),
        }
    }

    /// The MTU of the underlay at `ip`. For an address of this node (the
    /// VXLAN device's local address, its packets' source), the MTU of the
    /// device that holds it: the kernel's route to an own address goes
    /// through `lo` (the local table), whose 65536 would size the VXLAN
    /// device far above what the wire carries. For another address, the
    /// MTU packets to it get: the device the kernel's route to it uses, or
    /// the route's own MTU when that is lower (a route or a learned path
    /// MTU can be). None when there is no route.
    async fn underlay_mtu(&self, ip: IpAddr) -> Result<Option<u32>> {
        if let Some(index) = self.index_holding(ip).await? {
            let link = self.link_by_index(index).await?;
            return Ok(link.and_then(|l| messages::link_facts(&l).mtu));
        }
        let context = || format!("looking up the route to {ip}");
        let answers = match messages::request(
            &self.handle,
            RouteNetlinkMessage::GetRoute(route_get(ip)),
            ACKED,
        )
        .await
        {
            Ok(answers) => answers,
            Err(e) if matches!(errno(&e), Some(libc::ENETUNREACH | libc::EHOSTUNREACH)) => {
                return Ok(None)
            }
            Err(e) => return Err(KernelError::refused(context(), reason(&e))),
        };
        let Some(route) = answers.iter().find_map(|m| match m {
            RouteNetlinkMessage::NewRoute(r) => Some(r),
            _ => None,
        }) else {
            return Ok(None);
        };
        let Some(oif) = messages::route_oif(route) else {
            return Ok(None);
        };
        let link = self
            .link_by_index(oif)
            .await?
            .ok_or_else(|| KernelError::refused(context(), format!("device #{oif} vanished")))?;
        let device = messages::link_facts(&link).mtu;
        Ok(match (device, route_mtu(route)) {
            (Some(d), Some(r)) => Some(d.min(r)),
            (d, r) => d.or(r),
        })
    }
}

// ------------------------------------------------------------ plans

/// The desired routes with host bits cleared (the kernel stores only the
/// network, and a comparison with anything else would never settle),
/// refusing what the kernel cannot hold or would flap between: a next hop
/// of the other family, or two routes to one block.
fn normalized_routes(desired: &[ClusterRoute]) -> Result<Vec<ClusterRoute>> {
    let mut by_dst: BTreeMap<IpNet, ClusterRoute> = BTreeMap::new();
    for route in desired {
        if route.dst.addr().is_ipv4() != route.via.is_ipv4() {
            return Err(KernelError::Internal(format!(
                "cluster route {} mixes address families",
                route_text(route)
            )));
        }
        let route = ClusterRoute {
            dst: route.dst.trunc(),
            ..route.clone()
        };
        if let Some(other) = by_dst.get(&route.dst) {
            if *other != route {
                return Err(KernelError::Internal(format!(
                    "two cluster routes to {}: {} and {}",
                    route.dst,
                    route_text(other),
                    route_text(&route)
                )));
            }
        }
        by_dst.insert(route.dst, route);
    }
    Ok(by_dst.into_values().collect())
}

/// The FDB (MAC -> node ip) and neighbour (gateway -> MAC) tables the
/// peers call for. Two peers with one MAC, or one gateway with two MACs,
/// would make the tables flap between syncs: refused.
#[allow(clippy::type_complexity)]
fn peer_tables(
    peers: &[VxlanPeer],
) -> Result<(BTreeMap<[u8; 6], IpAddr>, BTreeMap<IpAddr, [u8; 6]>)> {
    let mut fdb = BTreeMap::new();
    let mut neighbours = BTreeMap::new();
    for peer in peers {
        if let Some(other) = fdb.insert(peer.mac, peer.node_ip) {
            if other != peer.node_ip {
                return Err(KernelError::Internal(format!(
                    "vxlan peers {other} and {} share MAC {}",
                    peer.node_ip,
                    Mac::from(peer.mac)
                )));
            }
        }
        for &gateway in &peer.gateways {
            if let Some(other) = neighbours.insert(gateway, peer.mac) {
                if other != peer.mac {
                    return Err(KernelError::Internal(format!(
                        "vxlan gateway {gateway} claimed by MACs {} and {}",
                        Mac::from(other),
                        Mac::from(peer.mac)
                    )));
                }
            }
        }
    }
    Ok((fdb, neighbours))
}

/// Why an existing tether.vxlan cannot be kept, if it cannot.
fn vxlan_difference(link: &LinkMessage, cfg: &VxlanConfig) -> Option<String> {
    let Some(info) = vxlan_info(link) else {
        return Some(format!("{VXLAN_IFNAME} exists but is not a vxlan device"));
    };
    let mut vni = None;
    let mut port = None;
    let mut local = None;
    let mut learning = None;
    for attribute in info {
        match attribute {
            InfoVxlan::Id(v) => vni = Some(*v),
            InfoVxlan::Port(p) => port = Some(*p),
            InfoVxlan::Local(ip) => local = Some(IpAddr::V4(*ip)),
            InfoVxlan::Local6(ip) => local = Some(IpAddr::V6(*ip)),
            InfoVxlan::Learning(l) => learning = Some(*l),
            _ => {}
        }
    }
    let mac = messages::link_facts(link).mac;
    if vni != Some(cfg.vni) {
        return Some(format!("vni {vni:?}, want {}", cfg.vni));
    }
    if port != Some(cfg.port) {
        return Some(format!("port {port:?}, want {}", cfg.port));
    }
    if local != Some(cfg.local) {
        return Some(format!("local {local:?}, want {}", cfg.local));
    }
    if learning != Some(false) {
        return Some("learning is on".into());
    }
    if mac.as_deref() != Some(&cfg.mac[..]) {
        return Some(format!("MAC {mac:02x?}, want {}", Mac::from(cfg.mac)));
    }
    None
}

fn vxlan_info(link: &LinkMessage) -> Option<&[InfoVxlan]> {
    link.attributes.iter().find_map(|a| match a {
        LinkAttribute::LinkInfo(infos) => infos.iter().find_map(|i| match i {
            LinkInfo::Data(InfoData::Vxlan(data)) => Some(data.as_slice()),
            _ => None,
        }),
        _ => None,
    })
}

fn route_text(route: &ClusterRoute) -> String {
    match &route.onlink_dev {
        Some(dev) => format!("{} via {} dev {dev} onlink", route.dst, route.via),
        None => format!("{} via {}", route.dst, route.via),
    }
}

// ------------------------------------------------------------ messages

/// `dst via <via> [dev <oif>] proto <protocol>` in the main table, with
/// `scope` and `kind` left for the caller.
fn route_message(route: &ClusterRoute, oif: Option<u32>, protocol: u8) -> RouteMessage {
    let mut msg = RouteMessage::default();
    msg.header.address_family = family_of(route.dst.addr());
    msg.header.destination_prefix_length = route.dst.prefix_len();
    msg.header.table = RouteHeader::RT_TABLE_MAIN;
    msg.header.protocol = RouteProtocol::Other(protocol);
    msg.attributes
        .push(RouteAttribute::Destination(RouteAddress::from(
            route.dst.addr(),
        )));
    msg.attributes
        .push(RouteAttribute::Gateway(RouteAddress::from(route.via)));
    if let Some(oif) = oif {
        msg.attributes.push(RouteAttribute::Oif(oif));
    }
    msg
}

/// `dst via <via> [dev <oif> onlink] proto 202` in the main table.
fn cluster_route(route: &ClusterRoute, onlink_oif: Option<u32>, protocol: u8) -> RouteMessage {
    let mut msg = route_message(route, onlink_oif, protocol);
    msg.header.scope = RouteScope::Universe;
    msg.header.kind = RouteType::Unicast;
    if onlink_oif.is_some() {
        msg.header.flags |= RouteFlags::Onlink;
    }
    msg
}

/// Deletes exactly `route` as it was programmed (destination, gateway and
/// device, of `protocol`), so that another route to its destination
/// survives.
fn route_selector(route: &ClusterRoute, oif: Option<u32>, protocol: u8) -> RouteMessage {
    let mut msg = route_message(route, oif, protocol);
    // RT_SCOPE_NOWHERE is the kernel's "any scope" for deletions.
    msg.header.scope = RouteScope::NoWhere;
    msg.header.kind = RouteType::Unspec;
    msg
}

/// Deletes exactly one dumped proto-202 route: its destination, gateway
/// and device, so that a route the sync just put in its place survives.
fn cluster_route_selector(found: &RouteMessage, dst: IpNet, protocol: u8) -> RouteMessage {
    let mut msg = RouteMessage::default();
    msg.header.address_family = found.header.address_family;
    msg.header.destination_prefix_length = dst.prefix_len();
    msg.header.table = RouteHeader::RT_TABLE_MAIN;
    msg.header.protocol = RouteProtocol::Other(protocol);
    // RT_SCOPE_NOWHERE is the kernel's "any scope" for deletions.
    msg.header.scope = RouteScope::NoWhere;
    msg.header.kind = RouteType::Unspec;
    msg.attributes
        .push(RouteAttribute::Destination(RouteAddress::from(dst.addr())));
    if let Some(gw) = messages::route_gateway(found) {
        msg.attributes
            .push(RouteAttribute::Gateway(RouteAddress::from(gw)));
    }
    if let Some(oif) = messages::route_oif(found) {
        msg.attributes.push(RouteAttribute::Oif(oif));
    }
    msg
}

/// A dumped route as a [`ClusterRoute`], if it has that shape.
fn cluster_route_of(
    msg: &RouteMessage,
    dst: IpNet,
    names: &HashMap<u32, String>,
) -> Option<ClusterRoute> {
    let via = messages::route_gateway(msg)?;
    let onlink_dev = if is_onlink(msg) {
        Some(names.get(&messages::route_oif(msg)?)?.clone())
    } else {
        None
    };
    Some(ClusterRoute {
        dst,
        via,
        onlink_dev,
    })
}

fn is_onlink(msg: &RouteMessage) -> bool {
    msg.header.flags.contains(RouteFlags::Onlink)
}

/// RTM_GETROUTE for one address: the kernel answers with the route it
/// would use.
pub(super) fn route_get(ip: IpAddr) -> RouteMessage {
    let mut msg = RouteMessage::default();
    msg.header.address_family = family_of(ip);
    msg.header.destination_prefix_length = messages::host_prefix_len(ip);
    msg.attributes
        .push(RouteAttribute::Destination(RouteAddress::from(ip)));
    msg
}

fn route_prefsrc(msg: &RouteMessage) -> Option<IpAddr> {
    msg.attributes.iter().find_map(|a| match a {
        RouteAttribute::PrefSource(RouteAddress::Inet(v4)) => Some(IpAddr::V4(*v4)),
        RouteAttribute::PrefSource(RouteAddress::Inet6(v6)) => Some(IpAddr::V6(*v6)),
        _ => None,
    })
}

/// RTA_PRIORITY, the metric; absent means 0.
fn route_priority(msg: &RouteMessage) -> u32 {
    msg.attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Priority(p) => Some(*p),
            _ => None,
        })
        .unwrap_or(0)
}

/// The output device, or the first next hop's for a multipath route.
fn route_first_oif(msg: &RouteMessage) -> Option<u32> {
    messages::route_oif(msg).or_else(|| {
        msg.attributes.iter().find_map(|a| match a {
            RouteAttribute::MultiPath(hops) => hops.first().map(|h| h.interface_index),
            _ => None,
        })
    })
}

/// The MTU metric of a route (a configured `mtu` or a learned path MTU).
fn route_mtu(msg: &RouteMessage) -> Option<u32> {
    msg.attributes.iter().find_map(|a| match a {
        RouteAttribute::Metrics(metrics) => metrics.iter().find_map(|m| match m {
            RouteMetric::Mtu(mtu) if *mtu > 0 => Some(*mtu),
            _ => None,
        }),
        _ => None,
    })
}

/// Not a temporary (privacy) address, one that failed DAD, or one being
/// retired: none of those should identify a node.
fn usable_address(msg: &AddressMessage) -> bool {
    let flags = msg.attributes.iter().find_map(|a| match a {
        AddressAttribute::Flags(f) => Some(*f),
        _ => None,
    });
    match flags {
        Some(f) => !f.intersects(
            AddressFlags::Secondary | AddressFlags::Dadfailed | AddressFlags::Deprecated,
        ),
        None => !msg.header.flags.intersects(
            AddressHeaderFlags::Secondary
                | AddressHeaderFlags::Dadfailed
                | AddressHeaderFlags::Deprecated,
        ),
    }
}

/// The vxlan device: no learning (every peer is programmed), created up.
fn vxlan_link(cfg: &VxlanConfig) -> LinkMessage {
    let builder = LinkVxlan::new(VXLAN_IFNAME, cfg.vni)
        .port(cfg.port)
        .learning(false);
    let builder: LinkMessageBuilder<LinkVxlan> = match cfg.local {
        IpAddr::V4(v4) => builder.local(v4),
        IpAddr::V6(v6) => builder.local6(v6),
    };
    builder.address(cfg.mac.to_vec()).mtu(cfg.mtu).up().build()
}

/// A permanent FDB entry on the vxlan device (NTF_SELF: the device's own
/// table, not a bridge's), or with no destination the selector that deletes
/// the MAC with all its destinations.
fn fdb_entry(index: u32, mac: &[u8; 6], dst: Option<IpAddr>) -> NeighbourMessage {
    let mut msg = NeighbourMessage::default();
    msg.header.family = AddressFamily::Bridge;
    msg.header.ifindex = index;
    msg.header.state = NeighbourState::Permanent;
    msg.header.flags = NeighbourFlags::Own;
    msg.attributes
        .push(NeighbourAttribute::LinkLayerAddress(mac.to_vec()));
    if let Some(dst) = dst {
        msg.attributes
            .push(NeighbourAttribute::Destination(neighbour_address(dst)));
    }
    msg
}

fn fdb_delete_step(index: u32, mac: &[u8; 6]) -> Step {
    Step::new(
        RouteNetlinkMessage::DelNeighbour(fdb_entry(index, mac, None)),
        ACKED,
        format!("deleting FDB entry {}", Mac::from(*mac)),
    )
    .tolerating(libc::ENOENT)
}

/// A permanent neighbour on the vxlan device, or without a MAC the selector
/// that deletes it.
fn vxlan_neighbour(index: u32, ip: IpAddr, mac: Option<&[u8; 6]>) -> NeighbourMessage {
    let mut msg = NeighbourMessage::default();
    msg.header.family = family_of(ip);
    msg.header.ifindex = index;
    msg.header.state = NeighbourState::Permanent;
    msg.attributes
        .push(NeighbourAttribute::Destination(neighbour_address(ip)));
    if let Some(mac) = mac {
        msg.attributes
            .push(NeighbourAttribute::LinkLayerAddress(mac.to_vec()));
    }
    msg
}

/// A neighbour or FDB dump of one family on one device. The device goes in
/// NDA_IFINDEX: strict checking takes it as a filter there for both kinds.
fn neighbour_dump(family: AddressFamily, index: u32) -> NeighbourMessage {
    let mut msg = NeighbourMessage::default();
    msg.header.family = family;
    msg.attributes.push(NeighbourAttribute::IfIndex(index));
    msg
}

/// The dumped neighbour messages of one device (filtered again here: a
/// kernel without strict dumps ignores the filter).
fn neighbours_on(
    answers: &[RouteNetlinkMessage],
    index: u32,
) -> impl Iterator<Item = &NeighbourMessage> {
    answers.iter().filter_map(move |m| match m {
        RouteNetlinkMessage::NewNeighbour(n) if n.header.ifindex == index => Some(n),
        _ => None,
    })
}

fn neighbour_mac(msg: &NeighbourMessage) -> Option<[u8; 6]> {
    msg.attributes.iter().find_map(|a| match a {
        NeighbourAttribute::LinkLayerAddress(bytes) => <[u8; 6]>::try_from(bytes.as_slice()).ok(),
        _ => None,
    })
}

fn neighbour_ip(msg: &NeighbourMessage) -> Option<IpAddr> {
    msg.attributes.iter().find_map(|a| match a {
        NeighbourAttribute::Destination(NeighbourAddress::Inet(v4)) => Some(IpAddr::V4(*v4)),
        NeighbourAttribute::Destination(NeighbourAddress::Inet6(v6)) => Some(IpAddr::V6(*v6)),
        _ => None,
    })
}

/// The destination of an FDB entry. The message's family is AF_BRIDGE, so
/// the address comes back as raw bytes whose length tells the family.
fn fdb_destination(msg: &NeighbourMessage) -> Option<IpAddr> {
    msg.attributes.iter().find_map(|a| match a {
        NeighbourAttribute::Destination(NeighbourAddress::Inet(v4)) => Some(IpAddr::V4(*v4)),
        NeighbourAttribute::Destination(NeighbourAddress::Inet6(v6)) => Some(IpAddr::V6(*v6)),
        NeighbourAttribute::Destination(NeighbourAddress::Other(bytes)) => {
            if let Ok(v4) = <[u8; 4]>::try_from(bytes.as_slice()) {
                Some(IpAddr::V4(Ipv4Addr::from(v4)))
            } else {
                <[u8; 16]>::try_from(bytes.as_slice())
                    .ok()
                    .map(|v6| IpAddr::V6(Ipv6Addr::from(v6)))
            }
        }
        _ => None,
    })
}

fn neighbour_address(ip: IpAddr) -> NeighbourAddress {
    match ip {
        IpAddr::V4(v4) => NeighbourAddress::Inet(v4),
        IpAddr::V6(v6) => NeighbourAddress::Inet6(v6),
    }
}

fn family_of(ip: IpAddr) -> AddressFamily {
    match ip {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
    }
}
