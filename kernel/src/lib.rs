//! The kernel seam: everything tetherd asks of the node's kernel, as traits,
//! so that the attachment lifecycle, VM placement and route management can
//! run on a fake kernel in unit tests.
//!
//! - [`Veths`]: pod wiring (veth pairs, the pod side, host routes) and the
//!   reads that reconciliation needs.
//! - [`NodeRoutes`]: routes to other nodes' blocks and to VMs that run
//!   elsewhere, and the VXLAN device.
//! - [`Host`]: the rest of the node: forwarding sysctls, the boot id, the
//!   packet sockets that see a migrated VM announce itself, and outbound
//!   NAT ([`nat`]).
//!
//! [`netlink::Netlink`] and [`LinuxHost`] are the real implementations;
//! [`fake`] holds the in-memory ones. This module also fixes what tether
//! makes in the kernel (names, MACs, gateways, route protocols), which both
//! sides must agree on.

pub mod error;
pub mod fake;
pub mod flow_watch;
pub mod handover;
pub mod host;
pub mod nat;
pub mod netlink;
pub mod packet;
pub mod policy;
pub mod replay;

use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use ipnet::IpNet;

use crate::error::Result;
pub use error::{Cause, KernelError};
pub use handover::{Flow, FlowCreated, FlowEnds, Handover, Held, TapCounters};
pub use host::LinuxHost;
pub use nat::NatPlan;
pub use packet::{AnnounceKind, Announcement};
use tether_base::guest::{DhcpOptions, TapSpec};
use tether_base::mac::Mac;

/// The IPv4 gateway every pod routes through; answered by the node's veth.
pub const GATEWAY_V4: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);
/// The IPv6 gateway every pod routes through; fe80::1 on every node veth.
pub const GATEWAY_V6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);
/// The MAC of every node-side veth, so that a guest's gateway MAC stays valid
/// when it moves to another node.
pub const GATEWAY_MAC: Mac = Mac::new([0x0a, 0x58, 0xa9, 0xfe, 0x01, 0x01]);
/// Route protocol number that marks tether's routes (so they can be found
/// and reconciled). Not one of the RTPROT_* numbers iproute2 or the kernel
/// reserve; netlink-packet-route carries it as `RouteProtocol::Other(201)`.
pub const ROUTE_PROTOCOL: u8 = 201;
/// Route protocol number that marks routes to other nodes' blocks, distinct
/// from the pod host routes' [`ROUTE_PROTOCOL`] so that each set can be
/// reconciled without touching the other.
pub const CLUSTER_ROUTE_PROTOCOL: u8 = 202;
/// Route protocol number of the /32 and /128 routes that send a VM's
/// address to the node it runs on when that is not the node holding the
/// address's block (a VM that migrated or restarted elsewhere). Its own
/// number, so that the VM routes and the block routes are each synced to
/// exactly their wanted set without touching the other.
pub const VM_ROUTE_PROTOCOL: u8 = 203;
/// Prefix of every node-side veth tether creates.
pub const HOST_IFNAME_PREFIX: &str = "tth";
/// Name of the VXLAN device in vxlan mode. Outside the `tth` prefix, so that
/// the veth reconciliation never takes it for a pod's.
pub const VXLAN_IFNAME: &str = "tether.vxlan";

/// Stable node-side name: "tth" + the first 12 lowercase hex digits of
/// FNV-1a-64 over "network\0container_id\0ifname" (15 characters, the kernel's
/// limit).
pub fn host_ifname(network: &str, container_id: &str, ifname: &str) -> String {
    const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = OFFSET_BASIS;
    let parts: [&[u8]; 5] = [
        network.as_bytes(),
        b"\0",
        container_id.as_bytes(),
        b"\0",
        ifname.as_bytes(),
    ];
    for byte in parts.iter().flat_map(|p| p.iter()) {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(PRIME);
    }
    // The high 48 bits: the first 12 digits of the 16-digit hex form.
    format!("{HOST_IFNAME_PREFIX}{:012x}", hash >> 16)
}

/// Locally administered unicast MAC for a pod: 0a:58 followed by the 4 bytes
/// of its IPv4 address if it has one, else the last 4 bytes of its first IPv6
/// address (0a:58:00:00:00:00 for no address at all).
pub fn pod_mac(ips: &[IpAddr]) -> Mac {
    let v4 = ips.iter().find_map(|ip| match ip {
        IpAddr::V4(v4) => Some(v4.octets()),
        IpAddr::V6(_) => None,
    });
    let tail = v4
        .or_else(|| {
            ips.iter().find_map(|ip| match ip {
                IpAddr::V6(v6) => {
                    let o = v6.octets();
                    Some([o[12], o[13], o[14], o[15]])
                }
                IpAddr::V4(_) => None,
            })
        })
        .unwrap_or([0; 4]);
    Mac::new([0x0a, 0x58, tail[0], tail[1], tail[2], tail[3]])
}

/// A pod's network namespace, opened (and validated) by
/// [`Veths::open_netns`]. The real kernel holds the namespace file; the fake
/// only the path.
#[derive(Debug)]
pub struct PodNetns {
    path: PathBuf,
    file: Option<File>,
}

impl PodNetns {
    /// A namespace the real kernel opened.
    pub fn opened(path: &Path, file: File) -> Self {
        Self {
            path: path.to_owned(),
            file: Some(file),
        }
    }

    /// A namespace known by its path only (the fake kernel's).
    pub fn by_path(path: &Path) -> Self {
        Self {
            path: path.to_owned(),
            file: None,
        }
    }

    /// The path CNI_NETNS gave.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The open namespace file.
    pub fn file(&self) -> Result<&File> {
        self.file.as_ref().ok_or_else(|| {
            KernelError::Internal(format!("netns {} was not opened", self.path.display()))
        })
    }
}

/// Everything needed to wire (or check) one attachment.
#[derive(Debug, Clone, Copy)]
pub struct PodWiring<'a> {
    /// The pod netns, as opened by [`Veths::open_netns`].
    pub netns: &'a PodNetns,
    /// The interface name inside the pod (CNI_IFNAME).
    pub pod_ifname: &'a str,
    /// The node-side veth name, from [`host_ifname`].
    pub host_ifname: &'a str,
    /// The pod interface's MAC, from [`pod_mac`] or kept across migrations.
    pub pod_mac: Mac,
    /// The pod's addresses; each becomes a /32 or /128.
    pub ips: &'a [IpAddr],
    /// MTU of both veth ends.
    pub mtu: u32,
    /// Whether the node routes the pod's addresses to it (host routes).
    /// False for a VM migration's target until the cutover: it is wired,
    /// but the VM's traffic still goes to the source.
    pub routed: bool,
    /// The `tap` binding's tap. With one, the pod interface carries no
    /// addresses or routes: they are the guest's, and every frame passes
    /// between the pod interface and the tap unchanged.
    pub tap: Option<&'a TapSpec>,
    /// KubeVirt's `managedTap` binding may rewrite the pod side after ADD
    /// (the veth renamed into an in-pod bridge, a dummy in its place):
    /// CHECK accepts that layout too.
    pub managed_tap: bool,
}

/// One of tether's routes as found in the kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostRoute {
    /// Destination address.
    pub dst: IpAddr,
    /// Destination prefix length (32 or 128 for the routes tether makes).
    pub prefix_len: u8,
    /// Name of the output device, if it still resolves.
    pub oif: Option<String>,
}

/// One route to a block another node owns, or to a VM that runs on another
/// node.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClusterRoute {
    /// The remote block. Host bits are ignored (the kernel keeps only the
    /// network).
    pub dst: IpNet,
    /// The next hop: the remote node's address (host-gw) or its overlay
    /// gateway (vxlan). Same family as `dst`.
    pub via: IpAddr,
    /// None: `dst via <via>`, the kernel finds the device through the route
    /// to `via` (host-gw: the node address is on a connected subnet).
    /// Some(dev): `dst via <via> dev <dev> onlink`, for gateways no subnet
    /// covers (the vxlan gateways).
    pub onlink_dev: Option<String>,
}

/// The VXLAN device's identity. Any difference in VNI, port, local address
/// or MAC is fixed by recreating the device; the MTU is changed in place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VxlanConfig {
    /// The VXLAN network identifier, the same on every node.
    pub vni: u32,
    /// UDP destination port, the same on every node.
    pub port: u16,
    /// This node's underlay address, the source of encapsulated packets.
    pub local: IpAddr,
    /// The device's MAC, which other nodes put in their neighbour and FDB
    /// entries for this node.
    pub mac: [u8; 6],
    /// The device's MTU: the underlay's minus the encapsulation.
    pub mtu: u32,
}

/// Another node as seen by this node's VXLAN device.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VxlanPeer {
    /// The peer's underlay address: the FDB destination for its MAC.
    pub node_ip: IpAddr,
    /// The peer's VXLAN device MAC.
    pub mac: [u8; 6],
    /// The overlay gateways that stand for the peer (one per family), each
    /// given a permanent neighbour entry with the peer's MAC.
    pub gateways: Vec<IpAddr>,
}

/// What a sync changed: entries added or replaced, and entries deleted.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Synced {
    /// Entries added, or replaced because they differed.
    pub added: usize,
    /// Entries deleted because they were no longer wanted.
    pub removed: usize,
}

/// Pod wiring: veth pairs, the pod side, and the node's host routes to pods.
/// Every call is idempotent where the text says so; failures are
/// [`KernelError::Refused`] unless stated otherwise.
#[async_trait]
pub trait Veths: Send + Sync {
    /// Opens and validates CNI_NETNS: absolute, existing, a network
    /// namespace. Any failure is [`KernelError::BadEnv`] on CNI_NETNS.
    fn open_netns(&self, path: &Path) -> Result<PodNetns>;

    /// ADD wiring: the veth pair, the node side (proxy ARP, fe80::1, host
    /// routes when `routed`) and the pod side (addresses, gateway
    /// neighbours, default routes). On any error nothing is left behind.
    /// An interface of the pod's name already in the pod is
    /// [`KernelError::Exists`].
    async fn wire(&self, w: &PodWiring<'_>) -> Result<()>;

    /// CHECK: the first difference between the kernel and `w`, pod side
    /// before node side, as an [`KernelError::Mismatch`].
    async fn check(&self, w: &PodWiring<'_>) -> Result<()>;

    /// Deletes a node-side veth (both ends go). No such device is success;
    /// a name without our prefix is refused.
    async fn delete_link(&self, host_ifname: &str) -> Result<()>;

    /// Deletes the `tap` binding's tap `tap` from a pod netns if the
    /// attachment of `host_ifname` made it. No such tap is success; a tap
    /// of that name that is not this attachment's is
    /// [`KernelError::Exists`].
    async fn remove_tap(&self, netns: &PodNetns, tap: &str, host_ifname: &str) -> Result<()>;

    /// Deletes many node-side veths in one batch; names that no longer
    /// exist are skipped.
    async fn delete_links(&self, host_ifnames: &[String]) -> Result<()>;

    /// Removes tether's host routes to these addresses. A route that is
    /// not there is success.
    async fn remove_host_routes(&self, ips: &[IpAddr]) -> Result<()>;

    /// Adds the missing host routes to `ips` through `host_ifname`; returns
    /// how many it added.
    async fn ensure_host_routes(&self, host_ifname: &str, ips: &[IpAddr]) -> Result<usize>;

    /// Every route of [`ROUTE_PROTOCOL`] in the main table.
    async fn our_routes(&self) -> Result<Vec<HostRoute>>;

    /// Names of every link with [`HOST_IFNAME_PREFIX`], sorted.
    async fn our_links(&self) -> Result<Vec<String>>;

    /// The index of the node link named `name`, if it exists.
    async fn link_index(&self, name: &str) -> Result<Option<u32>>;
}

/// Routes to other nodes: their blocks ([`CLUSTER_ROUTE_PROTOCOL`]), VMs
/// that run on them ([`VM_ROUTE_PROTOCOL`]), and the VXLAN device.
#[async_trait]
pub trait NodeRoutes: Send + Sync {
    /// Makes the proto-202 routes exactly `desired`.
    async fn sync_cluster_routes(&self, desired: &[ClusterRoute]) -> Result<Synced>;

    /// Adds or replaces the proto-202 routes `put` and deletes `gone`, as
    /// [`NodeRoutes::change_vm_routes`] does for VM routes: the pass after
    /// a block claimed or freed, without reading the table.
    async fn change_cluster_routes(
        &self,
        put: &[ClusterRoute],
        gone: &[ClusterRoute],
    ) -> Result<Synced>;

    /// Makes the proto-203 routes exactly `desired`. A VM route replaces a
    /// host route to the same address in one change.
    async fn sync_vm_routes(&self, desired: &[ClusterRoute]) -> Result<Synced>;

    /// Adds or replaces the proto-203 routes `put`, and deletes the
    /// proto-203 routes `gone` (each as it was programmed: destination,
    /// gateway and device, so that a route put in its place survives), in
    /// one batch and without reading the table: the pass over the VMs whose
    /// records changed. A route of `gone` that is not there is success.
    async fn change_vm_routes(&self, put: &[ClusterRoute], gone: &[ClusterRoute])
        -> Result<Synced>;

    /// Creates the VXLAN device, or makes the existing one match `cfg`.
    async fn ensure_vxlan(&self, cfg: &VxlanConfig) -> Result<()>;

    /// Makes the device's FDB and permanent neighbours exactly `peers`.
    async fn sync_vxlan_peers(&self, peers: &[VxlanPeer]) -> Result<Synced>;

    /// Deletes the VXLAN device if it exists (host-gw mode).
    async fn delete_vxlan(&self) -> Result<()>;

    /// The MTU of the underlay at `ip`: of the link that holds it, for an
    /// address of this node; else of the path the kernel routes it on.
    async fn underlay_mtu(&self, ip: IpAddr) -> Result<Option<u32>>;
}

/// The whole kernel seam for networking objects.
pub trait Kernel: Veths + NodeRoutes {
    /// Another handle on the same kernel with a socket of its own, for
    /// background work (batched veth deletion) that must not hold up the
    /// requests behind it.
    fn second_socket(&self) -> Result<Arc<dyn Kernel>>;

    /// The handover of migrating VMs' connections ([`handover`]).
    fn handover(&self) -> Arc<dyn Handover>;
}

/// The node outside its network objects.
pub trait Host: Send + Sync {
    /// Turns on IPv4 and IPv6 forwarding in the daemon's netns. A node
    /// without IPv6 is logged and accepted.
    fn enable_forwarding(&self) -> Result<()>;

    /// The kernel's boot id: it changes when the node reboots, and with it
    /// every pod netns is gone.
    fn boot_id(&self) -> Result<String>;

    /// Starts seeing VM announcements (RARP and gratuitous ARP) on every
    /// node interface.
    fn announcements(&self) -> Result<Box<dyn Announcements>>;

    /// The node's DHCP and router-advertisement service for guests.
    fn guest_dhcp(&self) -> Arc<dyn GuestDhcp>;

    /// Makes tether's nftables table exactly `plan` (outbound NAT), in one
    /// transaction: the same plan again changes nothing.
    fn ensure_outbound_nat(&self, plan: &NatPlan) -> Result<()>;

    /// Removes tether's nftables table; no table is success.
    fn remove_outbound_nat(&self) -> Result<()>;

    /// Writes the migration handover's nftables table anew
    /// ([`handover::handover_script`]).
    fn ensure_handover_table(&self) -> Result<()>;

    /// Makes the NetworkPolicy table exactly `plan`, in one transaction
    /// ([`policy::PolicyPlan::script`]).
    fn ensure_policy(&self, plan: &policy::PolicyPlan) -> Result<()>;

    /// Removes the NetworkPolicy table; no table is success.
    fn remove_policy(&self) -> Result<()>;

    /// The NetworkPolicy table's drop counters as the kernel has them:
    /// (counter name, packets, bytes); none without the table.
    fn policy_counters(&self) -> Result<Vec<(String, u64, u64)>>;
}

/// Counters of the guest DHCP service since the daemon started.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DhcpStats {
    /// DHCPv4 answers sent.
    pub dhcp4: u64,
    /// DHCPv6 answers sent.
    pub dhcp6: u64,
    /// Router advertisements sent, solicited or not.
    pub router_adverts: u64,
    /// ARP answers for the gateway sent.
    pub arp: u64,
    /// Frames dropped as malformed.
    pub malformed: u64,
    /// Requests dropped because they came from a MAC that is not the VM's.
    pub foreign_mac: u64,
    /// Well-formed requests not answered (another server's, RELEASE, ...).
    pub unanswered: u64,
    /// Answers the kernel refused to send.
    pub send_errors: u64,
}

/// What a guest behind one node-side veth is told: its addresses and MAC
/// from the VM's record, its name, MTU and the network's options. The same
/// on every node, so that a renewal after a migration or a restart gets the
/// same lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestLease {
    /// The only MAC answered: the VM's.
    pub mac: Mac,
    /// At most one per family.
    pub ips: Vec<IpAddr>,
    /// The VM's name.
    pub hostname: String,
    /// The pod interface's MTU.
    pub mtu: u32,
    /// Lease time, DNS servers and search domains.
    pub options: DhcpOptions,
}

/// DHCPv4, DHCPv6 and router advertisements for the guests of the `tap`
/// and `managedTap` bindings, answered on the node-side veths, where the
/// guest's frames arrive. The daemon serves them itself: no process per
/// pod.
pub trait GuestDhcp: Send + Sync {
    /// Starts answering the guest behind node-side veth `ifname`, or
    /// replaces its lease.
    fn serve(&self, ifname: &str, lease: GuestLease) -> Result<()>;
    /// Stops answering on `ifname`. Not serving it is success.
    fn stop(&self, ifname: &str);
    /// Sends one unsolicited router advertisement on `ifname` now: the
    /// guest has just arrived on this node.
    fn announce_router(&self, ifname: &str);
    /// The counters since start, and how many veths are served now.
    fn stats(&self) -> (DhcpStats, usize);
}

/// A source of VM announcements.
#[async_trait]
pub trait Announcements: Send + Sync {
    /// The next announcement on any interface.
    async fn next(&self) -> Result<Announcement>;
}
