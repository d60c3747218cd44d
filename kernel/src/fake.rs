//! An in-memory kernel and host, for unit tests of everything above the
//! kernel seam. A test double: it keeps the objects tether makes (veths,
//! one main route table, the VXLAN device and its peers), records every
//! call, and can be told to fail any call. It cannot prove that the real
//! kernel accepts the requests: the netlink suites (root) do that.
//!
//! The route table is one map keyed by destination, like the kernel's main
//! table for tether's routes: a route of another protocol to the same
//! destination replaces the one there (a VM route taking over a pod's host
//! route), and a deleted veth takes its routes with it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use ipnet::IpNet;
use tokio::sync::mpsc;

use super::handover::{
    all_flows_at, touches, Flow, FlowChange, FlowChanges, FlowCreated, FlowEnds, FlowFeed,
    Handover, Held, TapCounters,
};
use super::policy::PolicyPlan;
use super::replay::Replayed;
use super::{
    Announcement, Announcements, ClusterRoute, GuestDhcp, GuestLease, Host, HostRoute, Kernel,
    NatPlan, NodeRoutes, PodNetns, PodWiring, Synced, Veths, VxlanConfig, VxlanPeer,
    CLUSTER_ROUTE_PROTOCOL, HOST_IFNAME_PREFIX, ROUTE_PROTOCOL, VM_ROUTE_PROTOCOL,
};
use crate::error::{KernelError, Result};
use tether_base::error::Mismatch;
use tether_base::guest::TapSpec;
use tether_base::mac::Mac;
use tether_base::sync::lock;

/// Every call of the kernel traits, for failure injection and the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Call {
    OpenNetns,
    Wire,
    Check,
    DeleteLink,
    DeleteLinks,
    RemoveTap,
    RemoveHostRoutes,
    EnsureHostRoutes,
    OurRoutes,
    OurLinks,
    LinkIndex,
    SyncClusterRoutes,
    SyncVmRoutes,
    ChangeVmRoutes,
    ChangeClusterRoutes,
    EnsureVxlan,
    SyncVxlanPeers,
    DeleteVxlan,
    UnderlayMtu,
}

/// One node-side veth and its pod end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeLink {
    /// The node-side interface index.
    pub index: u32,
    /// The pod netns path.
    pub netns: PathBuf,
    /// The pod-side name.
    pub pod_ifname: String,
    /// The pod-side MAC.
    pub pod_mac: Mac,
    /// The pod-side addresses.
    pub ips: Vec<IpAddr>,
    /// Both ends' MTU.
    pub mtu: u32,
}

/// One route of the main table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeRoute {
    /// tether's protocol number of it (201, 202 or 203).
    pub protocol: u8,
    /// Output device, for host routes and onlink routes.
    pub dev: Option<String>,
    /// Next hop, for routes to other nodes.
    pub via: Option<IpAddr>,
}

/// A tap of the `tap` binding in a pod netns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeTap {
    /// As created.
    pub spec: TapSpec,
    /// The node-side veth of the attachment that made it (its alias).
    pub host_ifname: String,
}

#[derive(Debug, Default)]
struct State {
    netns: BTreeSet<PathBuf>,
    links: BTreeMap<String, FakeLink>,
    /// By (netns, tap name).
    taps: BTreeMap<(PathBuf, String), FakeTap>,
    routes: BTreeMap<IpNet, FakeRoute>,
    vxlan: Option<VxlanConfig>,
    peers: Vec<VxlanPeer>,
    mtus: HashMap<IpAddr, u32>,
    next_index: u32,
    log: Vec<(Call, String)>,
    /// Per call: how many more calls succeed before the next failure, and
    /// whether every later call fails too.
    failures: HashMap<Call, (usize, bool)>,
    /// A daemon's kernel ([`FakeKernel::for_daemon`]): any netns path that
    /// exists on disk is a netns, and no call is logged.
    daemon: bool,
}

/// The fake kernel. Clones share one state, like two sockets on one kernel.
#[derive(Debug, Clone, Default)]
pub struct FakeKernel {
    state: Arc<Mutex<State>>,
    handover: Arc<FakeHandover>,
}

fn host_net(ip: IpAddr) -> IpNet {
    IpNet::from(ip)
}

impl FakeKernel {
    /// Adds or replaces the routes `put` of `protocol` and deletes those
    /// of `gone` that are there as given.
    fn change_routes(&self, protocol: u8, put: &[ClusterRoute], gone: &[ClusterRoute]) -> Synced {
        let mut s = self.state();
        let route = |r: &ClusterRoute| FakeRoute {
            protocol,
            dev: r.onlink_dev.clone(),
            via: Some(r.via),
        };
        let mut done = Synced::default();
        for r in gone {
            if s.routes.get(&r.dst.trunc()) == Some(&route(r)) {
                s.routes.remove(&r.dst.trunc());
                done.removed += 1;
            }
        }
        for r in put {
            if s.routes.insert(r.dst.trunc(), route(r)) != Some(route(r)) {
                done.added += 1;
            }
        }
        done
    }

    /// An empty kernel with no namespaces.
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// The kernel of a daemon that touches no real kernel (scale runs of
    /// the control plane alone): a netns is any absolute path that exists
    /// on disk, as the plugin's caller made it, and calls are not logged,
    /// so that it runs for hours in bounded memory.
    pub fn for_daemon() -> Self {
        let k = Self::default();
        k.state().daemon = true;
        k
    }

    /// Makes a pod netns exist at `path`.
    pub fn add_netns(&self, path: &Path) {
        self.state().netns.insert(path.to_owned());
    }

    /// Makes the netns at `path` disappear (its links stay until deleted,
    /// as a veth outlives nothing in a real kernel only because the netns
    /// takes the pod end; tests use this for "the pod is gone").
    pub fn remove_netns(&self, path: &Path) {
        let mut s = self.state();
        s.netns.remove(path);
        // A persistent tap lives exactly as long as its netns.
        s.taps.retain(|(netns, _), _| netns != path);
    }

    /// The taps of every pod netns, by (netns, name).
    pub fn taps(&self) -> BTreeMap<(PathBuf, String), FakeTap> {
        self.state().taps.clone()
    }

    /// Deletes a tap behind tether's back.
    pub fn drop_tap(&self, netns: &Path, name: &str) {
        self.state()
            .taps
            .remove(&(netns.to_owned(), name.to_owned()));
    }

    /// The `n`-th next call of `call` (0 = the very next) fails, once.
    pub fn fail_nth(&self, call: Call, n: usize) {
        self.state().failures.insert(call, (n, false));
    }

    /// Every call of `call` fails from now on.
    pub fn fail_always(&self, call: Call) {
        self.state().failures.insert(call, (0, true));
    }

    /// No more injected failures.
    pub fn heal(&self) {
        self.state().failures.clear();
    }

    /// The MTU `underlay_mtu` reports for `ip`.
    pub fn set_underlay_mtu(&self, ip: IpAddr, mtu: u32) {
        self.state().mtus.insert(ip, mtu);
    }

    /// The node-side veths.
    pub fn links(&self) -> BTreeMap<String, FakeLink> {
        self.state().links.clone()
    }

    /// The main table's routes of tether's protocols.
    pub fn routes(&self) -> BTreeMap<IpNet, FakeRoute> {
        self.state().routes.clone()
    }

    /// The route to one address, if any.
    pub fn route_to(&self, ip: IpAddr) -> Option<FakeRoute> {
        self.state().routes.get(&host_net(ip)).cloned()
    }

    /// The VXLAN device, if it exists.
    pub fn vxlan(&self) -> Option<VxlanConfig> {
        self.state().vxlan.clone()
    }

    /// The VXLAN peers.
    pub fn peers(&self) -> Vec<VxlanPeer> {
        self.state().peers.clone()
    }

    /// Every call so far, with a short description, in order.
    pub fn log(&self) -> Vec<(Call, String)> {
        self.state().log.clone()
    }

    /// Forgets the log.
    pub fn clear_log(&self) {
        self.state().log.clear();
    }

    /// Creates a veth directly, as a crash between the kernel change and
    /// the store commit would leave it.
    pub fn plant_link(&self, host_ifname: &str, link: FakeLink) {
        self.state().links.insert(host_ifname.to_owned(), link);
    }

    /// Adds a host route directly (a stale route of an earlier life).
    pub fn plant_host_route(&self, ip: IpAddr, dev: &str) {
        self.state().routes.insert(
            host_net(ip),
            FakeRoute {
                protocol: ROUTE_PROTOCOL,
                dev: Some(dev.to_owned()),
                via: None,
            },
        );
    }

    /// Removes a route directly (an operator's `ip route del`).
    pub fn drop_route(&self, ip: IpAddr) {
        self.state().routes.remove(&host_net(ip));
    }

    /// Removes the route to `dst` directly, whatever its length.
    pub fn drop_route_to(&self, dst: IpNet) {
        self.state().routes.remove(&dst);
    }

    /// Logs the call and answers whether it must fail.
    fn enter(&self, call: Call, what: String) -> Result<()> {
        let mut s = self.state();
        if !s.daemon {
            s.log.push((call, what.clone()));
        }
        let fail = match s.failures.get_mut(&call) {
            Some((0, always)) => {
                let always = *always;
                if !always {
                    s.failures.remove(&call);
                }
                true
            }
            Some((n, _)) => {
                *n -= 1;
                false
            }
            None => false,
        };
        if fail {
            return Err(KernelError::refused(what, "injected failure"));
        }
        Ok(())
    }

    /// Deletes a veth directly, with the routes through it, as the kernel
    /// does when someone else removes it (`ip link del`, a pod netns torn
    /// down behind the daemon's back). Not logged.
    pub fn drop_link(&self, host_ifname: &str) {
        self.state().remove_link(host_ifname);
    }

    /// How many times `call` was made so far (failed calls included).
    pub fn calls(&self, call: Call) -> usize {
        self.state().log.iter().filter(|(c, _)| *c == call).count()
    }
}

impl State {
    fn remove_link(&mut self, name: &str) {
        if self.links.remove(name).is_some() {
            self.routes
                .retain(|_, r| r.dev.as_deref() != Some(name) || r.via.is_some());
        }
    }

    fn sync_protocol(&mut self, protocol: u8, desired: &[ClusterRoute]) -> Synced {
        let wanted: BTreeMap<IpNet, FakeRoute> = desired
            .iter()
            .map(|r| {
                (
                    r.dst.trunc(),
                    FakeRoute {
                        protocol,
                        dev: r.onlink_dev.clone(),
                        via: Some(r.via),
                    },
                )
            })
            .collect();
        let stale: Vec<IpNet> = self
            .routes
            .iter()
            .filter(|(dst, r)| r.protocol == protocol && !wanted.contains_key(dst))
            .map(|(dst, _)| *dst)
            .collect();
        let mut done = Synced {
            removed: stale.len(),
            ..Synced::default()
        };
        for dst in stale {
            self.routes.remove(&dst);
        }
        for (dst, route) in wanted {
            if self.routes.get(&dst) != Some(&route) {
                self.routes.insert(dst, route);
                done.added += 1;
            }
        }
        done
    }
}

fn join<T: std::fmt::Display>(items: &[T]) -> String {
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

#[async_trait]
impl Veths for FakeKernel {
    fn open_netns(&self, path: &Path) -> Result<PodNetns> {
        self.enter(Call::OpenNetns, path.display().to_string())?;
        if self.state().daemon && path.is_absolute() && path.exists() {
            self.add_netns(path);
        }
        if !path.is_absolute() || !self.state().netns.contains(path) {
            return Err(KernelError::BadEnv {
                var: "CNI_NETNS",
                reason: format!("{} does not exist", path.display()),
            });
        }
        Ok(PodNetns::by_path(path))
    }

    async fn wire(&self, w: &PodWiring<'_>) -> Result<()> {
        self.enter(Call::Wire, w.host_ifname.to_owned())?;
        let mut s = self.state();
        let netns = w.netns.path().to_owned();
        if !s.netns.contains(&netns) {
            return Err(KernelError::refused(
                format!("creating veth {}", w.host_ifname),
                "the pod netns is gone",
            ));
        }
        let taken = s.links.iter().any(|(name, l)| {
            name != w.host_ifname && l.netns == netns && l.pod_ifname == w.pod_ifname
        });
        if taken {
            return Err(KernelError::Exists(w.pod_ifname.to_owned()));
        }
        if let Some(tap) = w.tap {
            let key = (netns.clone(), tap.name.clone());
            if s.taps
                .get(&key)
                .is_some_and(|t| t.host_ifname != w.host_ifname)
            {
                return Err(KernelError::Exists(tap.name.clone()));
            }
            s.taps.insert(
                key,
                FakeTap {
                    spec: tap.clone(),
                    host_ifname: w.host_ifname.to_owned(),
                },
            );
        }
        // A stale veth of the same name is replaced, as the real kernel's
        // wiring does.
        s.remove_link(w.host_ifname);
        s.next_index += 1;
        let index = s.next_index + 100;
        s.links.insert(
            w.host_ifname.to_owned(),
            FakeLink {
                index,
                netns,
                pod_ifname: w.pod_ifname.to_owned(),
                pod_mac: w.pod_mac,
                ips: w.ips.to_vec(),
                mtu: w.mtu,
            },
        );
        if w.routed {
            for &ip in w.ips {
                s.routes.insert(
                    host_net(ip),
                    FakeRoute {
                        protocol: ROUTE_PROTOCOL,
                        dev: Some(w.host_ifname.to_owned()),
                        via: None,
                    },
                );
            }
        }
        Ok(())
    }

    async fn check(&self, w: &PodWiring<'_>) -> Result<()> {
        self.enter(Call::Check, w.host_ifname.to_owned())?;
        let s = self.state();
        let link = s.links.get(w.host_ifname).ok_or_else(|| {
            KernelError::mismatch(
                Mismatch::HostInterface,
                format!("{} not found on the node", w.host_ifname),
            )
        })?;
        if link.netns != w.netns.path() || link.pod_ifname != w.pod_ifname {
            return Err(KernelError::mismatch(
                Mismatch::PodInterface,
                format!("{} not found in the pod", w.pod_ifname),
            ));
        }
        if link.pod_mac != w.pod_mac || link.mtu != w.mtu {
            return Err(KernelError::mismatch(
                Mismatch::PodInterface,
                format!("{} has MAC {} MTU {}", w.pod_ifname, link.pod_mac, link.mtu),
            ));
        }
        if let Some(tap) = w.tap {
            let found = s.taps.get(&(link.netns.clone(), tap.name.clone()));
            if found.is_none_or(|t| t.spec != *tap || t.host_ifname != w.host_ifname) {
                return Err(KernelError::mismatch(
                    Mismatch::Tap,
                    format!("tap {} is missing or differs", tap.name),
                ));
            }
        } else if link.ips != w.ips {
            return Err(KernelError::mismatch(
                Mismatch::PodAddress,
                format!("{} has {}", w.pod_ifname, join(&link.ips)),
            ));
        }
        if w.routed {
            for &ip in w.ips {
                let ours = s.routes.get(&host_net(ip)).is_some_and(|r| {
                    r.protocol == ROUTE_PROTOCOL && r.dev.as_deref() == Some(w.host_ifname)
                });
                if !ours {
                    return Err(KernelError::mismatch(
                        Mismatch::HostRoute,
                        format!("no route {ip} dev {}", w.host_ifname),
                    ));
                }
            }
        }
        Ok(())
    }

    async fn delete_link(&self, host_ifname: &str) -> Result<()> {
        self.enter(Call::DeleteLink, host_ifname.to_owned())?;
        if !host_ifname.starts_with(HOST_IFNAME_PREFIX) {
            return Err(KernelError::Internal(format!(
                "refusing to delete {host_ifname}: not a tether veth"
            )));
        }
        self.state().remove_link(host_ifname);
        Ok(())
    }

    async fn delete_links(&self, host_ifnames: &[String]) -> Result<()> {
        self.enter(Call::DeleteLinks, host_ifnames.join(","))?;
        let mut s = self.state();
        for name in host_ifnames
            .iter()
            .filter(|n| n.starts_with(HOST_IFNAME_PREFIX))
        {
            s.remove_link(name);
        }
        Ok(())
    }

    async fn remove_tap(&self, netns: &PodNetns, tap: &str, host_ifname: &str) -> Result<()> {
        self.enter(Call::RemoveTap, format!("{tap} of {host_ifname}"))?;
        let key = (netns.path().to_owned(), tap.to_owned());
        let mut s = self.state();
        match s.taps.get(&key) {
            None => Ok(()),
            Some(t) if t.host_ifname == host_ifname => {
                s.taps.remove(&key);
                Ok(())
            }
            Some(_) => Err(KernelError::Exists(tap.to_owned())),
        }
    }

    async fn remove_host_routes(&self, ips: &[IpAddr]) -> Result<()> {
        self.enter(Call::RemoveHostRoutes, join(ips))?;
        let mut s = self.state();
        for &ip in ips {
            let dst = host_net(ip);
            if s.routes
                .get(&dst)
                .is_some_and(|r| r.protocol == ROUTE_PROTOCOL)
            {
                s.routes.remove(&dst);
            }
        }
        Ok(())
    }

    async fn ensure_host_routes(&self, host_ifname: &str, ips: &[IpAddr]) -> Result<usize> {
        self.enter(
            Call::EnsureHostRoutes,
            format!("{host_ifname} {}", join(ips)),
        )?;
        let mut s = self.state();
        if !s.links.contains_key(host_ifname) {
            return Err(KernelError::refused(
                format!("restoring host routes via {host_ifname}"),
                "no such device",
            ));
        }
        let want = FakeRoute {
            protocol: ROUTE_PROTOCOL,
            dev: Some(host_ifname.to_owned()),
            via: None,
        };
        let mut added = 0;
        for &ip in ips {
            if s.routes.get(&host_net(ip)) != Some(&want) {
                s.routes.insert(host_net(ip), want.clone());
                added += 1;
            }
        }
        Ok(added)
    }

    async fn our_routes(&self) -> Result<Vec<HostRoute>> {
        self.enter(Call::OurRoutes, String::new())?;
        let s = self.state();
        Ok(s.routes
            .iter()
            .filter(|(_, r)| r.protocol == ROUTE_PROTOCOL)
            .map(|(dst, r)| HostRoute {
                dst: dst.addr(),
                prefix_len: dst.prefix_len(),
                oif: r.dev.clone().filter(|d| s.links.contains_key(d)),
            })
            .collect())
    }

    async fn our_links(&self) -> Result<Vec<String>> {
        self.enter(Call::OurLinks, String::new())?;
        Ok(self.state().links.keys().cloned().collect())
    }

    async fn link_index(&self, name: &str) -> Result<Option<u32>> {
        self.enter(Call::LinkIndex, name.to_owned())?;
        Ok(self.state().links.get(name).map(|l| l.index))
    }
}

#[async_trait]
impl NodeRoutes for FakeKernel {
    async fn sync_cluster_routes(&self, desired: &[ClusterRoute]) -> Result<Synced> {
        self.enter(Call::SyncClusterRoutes, format!("{} routes", desired.len()))?;
        Ok(self.state().sync_protocol(CLUSTER_ROUTE_PROTOCOL, desired))
    }

    async fn sync_vm_routes(&self, desired: &[ClusterRoute]) -> Result<Synced> {
        let dsts: Vec<IpNet> = desired.iter().map(|r| r.dst).collect();
        self.enter(Call::SyncVmRoutes, join(&dsts))?;
        Ok(self.state().sync_protocol(VM_ROUTE_PROTOCOL, desired))
    }

    async fn change_vm_routes(
        &self,
        put: &[ClusterRoute],
        gone: &[ClusterRoute],
    ) -> Result<Synced> {
        let dsts: Vec<IpNet> = put.iter().chain(gone).map(|r| r.dst).collect();
        self.enter(Call::ChangeVmRoutes, join(&dsts))?;
        Ok(self.change_routes(VM_ROUTE_PROTOCOL, put, gone))
    }

    async fn change_cluster_routes(
        &self,
        put: &[ClusterRoute],
        gone: &[ClusterRoute],
    ) -> Result<Synced> {
        let dsts: Vec<IpNet> = put.iter().chain(gone).map(|r| r.dst).collect();
        self.enter(Call::ChangeClusterRoutes, join(&dsts))?;
        Ok(self.change_routes(CLUSTER_ROUTE_PROTOCOL, put, gone))
    }

    async fn ensure_vxlan(&self, cfg: &VxlanConfig) -> Result<()> {
        self.enter(Call::EnsureVxlan, format!("vni {}", cfg.vni))?;
        self.state().vxlan = Some(cfg.clone());
        Ok(())
    }

    async fn sync_vxlan_peers(&self, peers: &[VxlanPeer]) -> Result<Synced> {
        self.enter(Call::SyncVxlanPeers, format!("{} peers", peers.len()))?;
        let mut s = self.state();
        let mut wanted = peers.to_vec();
        wanted.sort();
        let added = wanted.iter().filter(|p| !s.peers.contains(p)).count();
        let removed = s.peers.iter().filter(|p| !wanted.contains(p)).count();
        s.peers = wanted;
        Ok(Synced { added, removed })
    }

    async fn delete_vxlan(&self) -> Result<()> {
        self.enter(Call::DeleteVxlan, String::new())?;
        let mut s = self.state();
        s.vxlan = None;
        s.peers.clear();
        Ok(())
    }

    async fn underlay_mtu(&self, ip: IpAddr) -> Result<Option<u32>> {
        self.enter(Call::UnderlayMtu, ip.to_string())?;
        Ok(self.state().mtus.get(&ip).copied())
    }
}

impl Kernel for FakeKernel {
    fn second_socket(&self) -> Result<Arc<dyn Kernel>> {
        Ok(Arc::new(self.clone()))
    }

    fn handover(&self) -> Arc<dyn Handover> {
        self.handover.clone()
    }
}

impl FakeKernel {
    /// The fake handover every handle of this kernel shares.
    pub fn fake_handover(&self) -> Arc<FakeHandover> {
        self.handover.clone()
    }
}

/// The handover's kernel side as a test double (see the module doc): a
/// conntrack table the test plants flows in and reads created ones from,
/// the guarded addresses and the anchors as plain values, taps whose
/// counters and captures the test sets, and the packets sent again. It
/// cannot show that the kernel takes the messages or that a packet is
/// forwarded: the root suites of `netlink::handover` and the VM suites do.
#[derive(Debug, Default)]
pub struct FakeHandover {
    state: Arc<Mutex<FakeHandoverState>>,
}

/// What the fake handover holds.
#[derive(Debug, Default, Clone)]
pub struct FakeHandoverState {
    /// The conntrack table.
    pub flows: Vec<Flow>,
    /// Guarded addresses.
    pub moved: BTreeSet<IpAddr>,
    /// Anchors and their next hops.
    pub anchors: BTreeMap<u16, Vec<ClusterRoute>>,
    /// Flows made again by pinning.
    pub pinned: Vec<Flow>,
    /// Directions passed untracked.
    pub translated_back: Vec<(u8, FlowEnds)>,
    /// Directions held back (dropped before conntrack), now.
    pub held_back: Vec<(u8, FlowEnds)>,
    /// Tap counters by (netns, tap, veth).
    pub taps: BTreeMap<(PathBuf, String, String), TapCounters>,
    /// What a capture on a veth holds, oldest first.
    pub captured: BTreeMap<String, Vec<Vec<u8>>>,
    /// Veths some address is routed to.
    pub routed: BTreeMap<IpAddr, String>,
    /// Packets sent again, in order.
    pub replayed: Vec<Vec<u8>>,
    /// Creations by outcome, in order.
    pub created: Vec<(Flow, FlowCreated)>,
    /// Calls that read or change the conntrack table or the nftables
    /// sets, by method (`read_flows` for the reads of the flow table):
    /// each is at least one exchange with the real kernel, whose cost does
    /// not depend on how much it carries.
    pub calls: BTreeMap<&'static str, usize>,
    /// How long a pin takes, as the real kernel's read of a large flow
    /// table does (none by default).
    pub pin_delay: Option<Duration>,
    /// The next take of a feed reports changes lost (as a socket that
    /// overran); cleared by it.
    pub feed_lost: bool,
    /// No feed opens (as a kernel whose conntrack events are off).
    pub no_feed: bool,
}

impl FakeHandover {
    /// What it holds now.
    pub fn state(&self) -> FakeHandoverState {
        lock(&self.state).clone()
    }

    /// Changes what it holds.
    pub fn with<R>(&self, f: impl FnOnce(&mut FakeHandoverState) -> R) -> R {
        f(&mut lock(&self.state))
    }
}

fn holds(f: &Flow, ends: &FlowEnds) -> bool {
    f.orig == *ends || f.reply == *ends
}

/// What the kernel does with a flow made over netlink (see
/// [`Handover::create_flow`]).
fn create_in(st: &mut FakeHandoverState, flow: &Flow, replace: bool) -> FlowCreated {
    let made = flow.clone();
    let clash = |f: &Flow| holds(f, &made.orig) || holds(f, &made.reply);
    let translated = |f: &Flow| f.source_translated() || f.destination_translated();
    let same = |f: &Flow| f.orig == made.orig && f.reply == made.reply && f.mark == made.mark;
    let outcome = if let Some(f) = st.flows.iter_mut().find(|f| same(f)) {
        // As the kernel's: the timeout set anew, and an opening TCP
        // state brought forward, never back.
        f.timeout_secs = made.timeout_secs;
        if let (Some(was), Some(now)) = (f.tcp_state, made.tcp_state) {
            if was < super::handover::TCP_ESTABLISHED && now > was {
                f.tcp_state = Some(now);
            }
        }
        FlowCreated::Refreshed
    } else if st.flows.iter().any(clash) {
        if !replace || st.flows.iter().any(|f| clash(f) && translated(f)) {
            FlowCreated::Exists
        } else {
            st.flows.retain(|f| !clash(f));
            st.flows.push(made.clone());
            FlowCreated::Replaced
        }
    } else {
        st.flows.push(made.clone());
        FlowCreated::Created
    };
    st.created.push((made, outcome));
    outcome
}

/// The fake's feed of the flow table's changes: at each take, what
/// differs in the table since the last one (made or changed, gone), so a
/// test changes the table as it likes. A test double: it cannot show the
/// order of changes between two takes, nor that the kernel sends them;
/// the root suite of `netlink::handover` does.
struct FakeFeed {
    state: Arc<Mutex<FakeHandoverState>>,
    last: HashMap<(u8, FlowEnds), Flow>,
    tracked: BTreeSet<IpAddr>,
}

impl FlowFeed for FakeFeed {
    fn track(&mut self, ips: &BTreeSet<IpAddr>) {
        self.tracked = ips.clone();
    }

    fn take(&mut self) -> FlowChanges {
        let mut st = lock(&self.state);
        let now: HashMap<(u8, FlowEnds), Flow> = st
            .flows
            .iter()
            .map(|f| ((f.proto, f.orig), f.clone()))
            .collect();
        let mut changes: Vec<FlowChange> = now
            .iter()
            .filter(|(k, f)| self.last.get(k) != Some(f))
            .map(|(_, f)| FlowChange::Made(f.clone()))
            .collect();
        changes.extend(
            self.last
                .iter()
                .filter(|(k, _)| !now.contains_key(k))
                .map(|(_, f)| FlowChange::Gone(f.clone())),
        );
        changes.retain(|c| touches(c.flow(), &self.tracked));
        self.last = now;
        FlowChanges {
            changes,
            lost: std::mem::take(&mut st.feed_lost),
        }
    }
}

#[async_trait]
impl Handover for FakeHandover {
    async fn flows_of(&self, ip: IpAddr) -> Result<Vec<Flow>> {
        let mut st = lock(&self.state);
        *st.calls.entry("read_flows").or_default() += 1;
        Ok(all_flows_at(&st.flows, ip))
    }

    async fn flows_of_each(&self, ips: &[IpAddr]) -> Result<Vec<Vec<Flow>>> {
        let mut st = lock(&self.state);
        *st.calls.entry("read_flows").or_default() += 1;
        Ok(ips.iter().map(|ip| all_flows_at(&st.flows, *ip)).collect())
    }

    fn watch_flows(&self) -> Result<Box<dyn FlowFeed>> {
        let mut st = lock(&self.state);
        if st.no_feed {
            return Err(KernelError::Internal("no feed in this fake".into()));
        }
        *st.calls.entry("watch_flows").or_default() += 1;
        let last = st
            .flows
            .iter()
            .map(|f| ((f.proto, f.orig), f.clone()))
            .collect();
        Ok(Box::new(FakeFeed {
            state: self.state.clone(),
            last,
            tracked: BTreeSet::new(),
        }))
    }

    async fn create_flow(&self, flow: &Flow, replace: bool) -> Result<FlowCreated> {
        let mut st = lock(&self.state);
        *st.calls.entry("create_flow").or_default() += 1;
        Ok(create_in(&mut st, flow, replace))
    }

    async fn create_flows(&self, flows: &[Flow], replace: bool) -> Vec<Result<FlowCreated>> {
        let mut st = lock(&self.state);
        *st.calls.entry("create_flows").or_default() += 1;
        flows
            .iter()
            .map(|f| Ok(create_in(&mut st, f, replace)))
            .collect()
    }

    async fn pin_translations(&self, vm: &[IpAddr]) -> Result<u32> {
        let delay = {
            let mut st = lock(&self.state);
            *st.calls.entry("pin_translations").or_default() += 1;
            st.pin_delay
        };
        if let Some(d) = delay {
            tokio::time::sleep(d).await;
        }
        let mut st = lock(&self.state);
        let pinned: Vec<Flow> = st
            .flows
            .iter()
            .filter(|f| {
                vm.contains(&f.reply.src.ip())
                    && !vm.contains(&f.orig.src.ip())
                    && f.source_translated()
            })
            .cloned()
            .collect();
        let n = pinned.len() as u32;
        st.pinned.extend(pinned);
        Ok(n)
    }

    async fn count_anchored(&self, id: u16) -> Result<u32> {
        Ok(lock(&self.state)
            .flows
            .iter()
            .filter(|f| f.anchor() == Some(id))
            .count() as u32)
    }

    async fn delete_anchored(&self, id: u16) -> Result<u32> {
        let mut st = lock(&self.state);
        let before = st.flows.len();
        st.flows.retain(|f| f.anchor() != Some(id));
        Ok((before - st.flows.len()) as u32)
    }

    async fn ensure_anchor(&self, id: u16, via: &[ClusterRoute]) -> Result<()> {
        lock(&self.state).anchors.insert(id, via.to_vec());
        Ok(())
    }

    async fn remove_anchor(&self, id: u16) -> Result<()> {
        lock(&self.state).anchors.remove(&id);
        Ok(())
    }

    async fn anchors(&self) -> Result<Vec<u16>> {
        Ok(lock(&self.state).anchors.keys().copied().collect())
    }

    async fn guard_moved(&self, vm: &[IpAddr], _ttl: std::time::Duration) -> Result<()> {
        lock(&self.state).moved.extend(vm.iter().copied());
        Ok(())
    }

    async fn pass_translated_back(
        &self,
        directions: &[(u8, FlowEnds)],
        _ttl: std::time::Duration,
    ) -> Result<()> {
        let mut st = lock(&self.state);
        *st.calls.entry("pass_translated_back").or_default() += 1;
        for d in directions {
            if !st.translated_back.contains(d) {
                st.translated_back.push(*d);
            }
        }
        Ok(())
    }

    async fn hold_back(
        &self,
        directions: &[(u8, FlowEnds)],
        ttl: Option<std::time::Duration>,
    ) -> Result<()> {
        let mut st = lock(&self.state);
        *st.calls.entry("hold_back").or_default() += 1;
        for d in directions {
            st.held_back.retain(|h| h != d);
            if ttl.is_some() {
                st.held_back.push(*d);
            }
        }
        Ok(())
    }

    async fn capture(&self, host_ifname: &str) -> Result<Box<dyn Held>> {
        Ok(Box::new(FakeCapture {
            state: self.state.clone(),
            veth: host_ifname.to_owned(),
        }))
    }

    async fn tap_counters(
        &self,
        netns: &Path,
        tap: &str,
        host_ifname: &str,
    ) -> Result<TapCounters> {
        let key = (netns.to_owned(), tap.to_owned(), host_ifname.to_owned());
        lock(&self.state).taps.get(&key).copied().ok_or_else(|| {
            KernelError::refused(
                format!("reading {tap}'s counters"),
                "no such tap".to_string(),
            )
        })
    }

    async fn routes_to_link(&self, ip: IpAddr, host_ifname: &str) -> Result<bool> {
        Ok(lock(&self.state)
            .routed
            .get(&ip)
            .is_some_and(|v| v == host_ifname))
    }

    async fn replay(&self, packets: Vec<Vec<u8>>) -> Result<Replayed> {
        let n = packets.len() as u32;
        lock(&self.state).replayed.extend(packets);
        Ok(Replayed {
            sent: n,
            skipped: 0,
        })
    }
}

/// A capture as the test fills it ([`FakeHandoverState::captured`]).
struct FakeCapture {
    state: Arc<Mutex<FakeHandoverState>>,
    veth: String,
}

impl Held for FakeCapture {
    fn seen(&self) -> u64 {
        lock(&self.state)
            .captured
            .get(&self.veth)
            .map_or(0, |c| c.len() as u64)
    }

    fn last(&self, n: usize) -> Vec<Vec<u8>> {
        let st = lock(&self.state);
        let all = st.captured.get(&self.veth).cloned().unwrap_or_default();
        all[all.len().saturating_sub(n)..].to_vec()
    }
}

/// The fake node: a boot id the test sets, forwarding as a flag,
/// announcements the test sends, and the outbound NAT table as a plan.
#[derive(Debug)]
pub struct FakeHost {
    boot_id: Mutex<String>,
    forwarding: Mutex<bool>,
    /// tether's nftables table: None when there is none.
    nat: Mutex<Option<NatPlan>>,
    /// How many times the table was written or removed.
    nat_writes: Mutex<usize>,
    /// Whether programming the NAT table fails (no nft).
    no_nat: Mutex<bool>,
    tx: mpsc::UnboundedSender<Announcement>,
    rx: Mutex<Option<mpsc::UnboundedReceiver<Announcement>>>,
    /// Whether opening the packet sockets fails (no CAP_NET_RAW).
    no_packet_sockets: Mutex<bool>,
    /// The guest DHCP service, shared with every node opened on this host.
    dhcp: Arc<FakeDhcp>,
    /// How many times the handover table was written.
    handover_tables: Mutex<usize>,
    /// The NetworkPolicy table: None when there is none.
    policy: Mutex<Option<PolicyPlan>>,
    /// How many times the NetworkPolicy table was written or removed.
    policy_writes: Mutex<usize>,
    /// Whether programming the NetworkPolicy table fails.
    no_policy: Mutex<bool>,
    /// The NetworkPolicy table's counters: name -> (packets, bytes).
    policy_counters: Mutex<BTreeMap<String, (u64, u64)>>,
}

/// The fake guest DHCP service: what is served where, and the router
/// advertisements asked for.
#[derive(Debug, Default)]
pub struct FakeDhcp {
    served: Mutex<BTreeMap<String, GuestLease>>,
    announced: Mutex<Vec<String>>,
}

impl FakeDhcp {
    /// The lease served on each node-side veth.
    pub fn served(&self) -> BTreeMap<String, GuestLease> {
        lock(&self.served).clone()
    }

    /// The veths an unsolicited router advertisement was sent on, in order.
    pub fn announced(&self) -> Vec<String> {
        lock(&self.announced).clone()
    }

    /// Forgets everything, as a daemon restart does.
    pub fn reset(&self) {
        lock(&self.served).clear();
        lock(&self.announced).clear();
    }
}

impl GuestDhcp for FakeDhcp {
    fn serve(&self, ifname: &str, lease: GuestLease) -> Result<()> {
        lock(&self.served).insert(ifname.to_owned(), lease);
        Ok(())
    }

    fn stop(&self, ifname: &str) {
        lock(&self.served).remove(ifname);
    }

    fn announce_router(&self, ifname: &str) {
        lock(&self.announced).push(ifname.to_owned());
    }

    fn stats(&self) -> (crate::DhcpStats, usize) {
        (Default::default(), lock(&self.served).len())
    }
}

impl Default for FakeHost {
    fn default() -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        Self {
            boot_id: Mutex::new("boot-1".into()),
            forwarding: Mutex::new(false),
            nat: Mutex::new(None),
            nat_writes: Mutex::new(0),
            no_nat: Mutex::new(false),
            tx,
            rx: Mutex::new(Some(rx)),
            no_packet_sockets: Mutex::new(false),
            dhcp: Arc::default(),
            handover_tables: Mutex::new(0),
            policy: Mutex::new(None),
            policy_writes: Mutex::new(0),
            no_policy: Mutex::new(false),
            policy_counters: Mutex::new(BTreeMap::new()),
        }
    }
}

impl FakeHost {
    /// A host on boot "boot-1".
    pub fn new() -> Self {
        Self::default()
    }

    /// The guest DHCP service.
    pub fn dhcp(&self) -> Arc<FakeDhcp> {
        self.dhcp.clone()
    }

    /// Reboots the fake node: a new boot id.
    pub fn reboot(&self, boot_id: &str) {
        *lock(&self.boot_id) = boot_id.to_owned();
    }

    /// Whether forwarding was turned on.
    pub fn forwarding(&self) -> bool {
        *lock(&self.forwarding)
    }

    /// tether's NAT table as last programmed; None if there is none.
    pub fn outbound_nat(&self) -> Option<NatPlan> {
        lock(&self.nat).clone()
    }

    /// How many times the NAT table was written or removed.
    pub fn nat_writes(&self) -> usize {
        *lock(&self.nat_writes)
    }

    /// Leaves a NAT table behind, as a former daemon would have.
    pub fn set_outbound_nat(&self, plan: Option<NatPlan>) {
        *lock(&self.nat) = plan;
    }

    /// Makes programming and removing the NAT table fail.
    pub fn refuse_nat(&self) {
        *lock(&self.no_nat) = true;
    }

    /// Makes opening the packet sockets fail.
    pub fn refuse_packet_sockets(&self) {
        *lock(&self.no_packet_sockets) = true;
    }

    /// How many times the handover table was written.
    pub fn handover_table_writes(&self) -> usize {
        *lock(&self.handover_tables)
    }

    /// The NetworkPolicy table as last programmed; None if there is none.
    pub fn policy(&self) -> Option<PolicyPlan> {
        lock(&self.policy).clone()
    }

    /// How many times the NetworkPolicy table was written or removed.
    pub fn policy_writes(&self) -> usize {
        *lock(&self.policy_writes)
    }

    /// Leaves a NetworkPolicy table behind, as a former daemon would have.
    pub fn set_policy(&self, plan: Option<PolicyPlan>) {
        *lock(&self.policy) = plan;
    }

    /// Counts `packets` dropped on the NetworkPolicy table's counter
    /// `name`, as the kernel would.
    pub fn count_policy_drop(&self, name: &str, packets: u64) {
        let mut c = lock(&self.policy_counters);
        let e = c.entry(name.to_owned()).or_default();
        e.0 += packets;
        e.1 += packets * 100;
    }

    /// Makes programming and removing the NetworkPolicy table fail, or
    /// work again.
    pub fn refuse_policy(&self, refuse: bool) {
        *lock(&self.no_policy) = refuse;
    }

    /// Delivers an announcement to the daemon's listener.
    pub fn announce(&self, a: Announcement) {
        // The receiver is gone only when no listener runs any more.
        let _ = self.tx.send(a);
    }
}

impl Host for FakeHost {
    fn enable_forwarding(&self) -> Result<()> {
        *lock(&self.forwarding) = true;
        Ok(())
    }

    fn boot_id(&self) -> Result<String> {
        Ok(lock(&self.boot_id).clone())
    }

    fn announcements(&self) -> Result<Box<dyn Announcements>> {
        if *lock(&self.no_packet_sockets) {
            return Err(KernelError::refused(
                "opening a packet socket",
                "injected failure",
            ));
        }
        let rx = lock(&self.rx)
            .take()
            .ok_or_else(|| KernelError::Internal("the fake host's listener is taken".into()))?;
        Ok(Box::new(FakeAnnouncements {
            rx: tokio::sync::Mutex::new(rx),
        }))
    }

    fn guest_dhcp(&self) -> Arc<dyn GuestDhcp> {
        self.dhcp.clone()
    }

    fn ensure_outbound_nat(&self, plan: &NatPlan) -> Result<()> {
        self.write_nat(Some(plan.clone()))
    }

    fn remove_outbound_nat(&self) -> Result<()> {
        self.write_nat(None)
    }

    fn ensure_handover_table(&self) -> Result<()> {
        *lock(&self.handover_tables) += 1;
        Ok(())
    }

    fn ensure_policy(&self, plan: &PolicyPlan) -> Result<()> {
        self.write_policy(Some(plan.clone()))
    }

    fn remove_policy(&self) -> Result<()> {
        self.write_policy(None)
    }

    fn policy_counters(&self) -> Result<Vec<(String, u64, u64)>> {
        Ok(lock(&self.policy_counters)
            .iter()
            .map(|(n, (p, b))| (n.clone(), *p, *b))
            .collect())
    }
}

impl FakeHost {
    fn write_nat(&self, plan: Option<NatPlan>) -> Result<()> {
        if *lock(&self.no_nat) {
            return Err(KernelError::refused(
                "programming outbound NAT",
                "injected failure",
            ));
        }
        *lock(&self.nat_writes) += 1;
        *lock(&self.nat) = plan;
        Ok(())
    }

    fn write_policy(&self, plan: Option<PolicyPlan>) -> Result<()> {
        if *lock(&self.no_policy) {
            return Err(KernelError::refused(
                "programming NetworkPolicy",
                "injected failure",
            ));
        }
        *lock(&self.policy_writes) += 1;
        // A new table's counters start from zero, as the script's do.
        *lock(&self.policy_counters) = plan
            .iter()
            .flat_map(PolicyPlan::counters)
            .map(|(_, _, name)| (name, (0, 0)))
            .collect();
        *lock(&self.policy) = plan;
        Ok(())
    }
}

struct FakeAnnouncements {
    rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<Announcement>>,
}

#[async_trait]
impl Announcements for FakeAnnouncements {
    async fn next(&self) -> Result<Announcement> {
        match self.rx.lock().await.recv().await {
            Some(a) => Ok(a),
            // Nobody can announce any more: wait forever, as a quiet
            // network would.
            None => std::future::pending().await,
        }
    }
}
