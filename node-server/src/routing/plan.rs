//! Route planning, as pure functions of the control plane's views and the
//! local pods: which routes to other nodes' blocks, which VXLAN peers, and
//! where each VM's addresses go. Nothing here reads the kernel or the
//! stores; [`super::manager`] applies the plan.
//!
//! The VM record is the authority on where a VM's traffic goes:
//! - the node of the active pod routes the VM's addresses to that pod's
//!   veth (protocol 201, like any pod);
//! - every other node routes them `via` that node (protocol 203), unless
//!   that node holds the addresses' block, whose route already goes there.

use std::collections::HashMap;
use std::net::IpAddr;

use ipnet::IpNet;

use crate::cluster::{vtep_underlay, vxlan_gateways, ClusterView, NodeRecord, Overlay};
use crate::ipam::Family;
use crate::kernel::{ClusterRoute, VxlanPeer, VXLAN_IFNAME};
use crate::mac::Mac;
use crate::store::{Attachment, AttachmentKey};
use crate::vm::{VmAttachment, VmKey, VmView};

/// What the cluster looks like from this node.
#[derive(Debug, Clone, Copy)]
pub struct ClusterSide<'a> {
    /// This node's record.
    pub me: &'a NodeRecord,
    /// Host-gw or VXLAN.
    pub overlay: &'a Overlay,
    /// Every node and block.
    pub view: &'a ClusterView,
}

/// The node holding the block that contains `ip`, if any.
pub fn block_holder(view: &ClusterView, ip: IpAddr) -> Option<&str> {
    view.blocks
        .values()
        .find(|(b, _)| b.cidr.contains(&ip))
        .map(|(b, _)| b.node.as_str())
}

/// How this node reaches addresses of `family` on node `name`: the next
/// hop, and the device for an onlink route (vxlan mode). None for this node
/// itself, an unknown node, or one without a usable address.
pub fn next_hop(
    c: &ClusterSide<'_>,
    name: &str,
    family: Family,
) -> Option<(IpAddr, Option<String>)> {
    if name == c.me.name {
        return None;
    }
    let (node, _) = c.view.nodes.get(name)?;
    match c.overlay {
        Overlay::HostGw => node
            .node_ips
            .iter()
            .copied()
            .find(|ip| (family == Family::V4) == ip.is_ipv4())
            .map(|via| (via, None)),
        Overlay::Vxlan { .. } => {
            node.vtep_mac_octets()?;
            vtep_underlay(&node.node_ips, &c.me.node_ips)?;
            let (gw4, gw6) = vxlan_gateways(node.id);
            let via = match family {
                Family::V4 => IpAddr::V4(gw4),
                Family::V6 => IpAddr::V6(gw6),
            };
            Some((via, Some(VXLAN_IFNAME.to_owned())))
        }
    }
}

/// The routes this node needs to reach every other node's blocks, and its
/// VXLAN peers (vxlan mode), both sorted.
pub fn cluster_routes(c: &ClusterSide<'_>) -> (Vec<ClusterRoute>, Vec<VxlanPeer>) {
    let mut routes = Vec::new();
    let mut peers = Vec::new();
    for (name, (node, _)) in &c.view.nodes {
        if *name == c.me.name {
            continue;
        }
        for b in c.view.blocks_of(name) {
            if let Some((via, onlink_dev)) = next_hop(c, name, Family::of(&b)) {
                routes.push(ClusterRoute {
                    dst: b,
                    via,
                    onlink_dev,
                });
            }
        }
        if let Overlay::Vxlan { .. } = c.overlay {
            if let (Some(mac), Some(&underlay)) = (
                node.vtep_mac_octets(),
                vtep_underlay(&node.node_ips, &c.me.node_ips),
            ) {
                let (gw4, gw6) = vxlan_gateways(node.id);
                peers.push(VxlanPeer {
                    node_ip: underlay,
                    mac,
                    gateways: vec![IpAddr::V4(gw4), IpAddr::V6(gw6)],
                });
            }
        }
    }
    routes.sort();
    peers.sort();
    (routes, peers)
}

/// How this node routes one VM's addresses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Want {
    /// To a local pod's veth.
    pub here: Option<String>,
    /// To other nodes (proto 203).
    pub via: Vec<ClusterRoute>,
}

/// A migration target found in the records: VM, attachment, host veth, and
/// the record's generation.
pub type FoundTarget = (VmKey, AttachmentKey, String, u64);

/// Where this node sends each VM's addresses, and the local migration
/// targets waiting for their VM (by the VM's MAC).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct VmPlan {
    /// Per VM.
    pub wants: HashMap<VmKey, Want>,
    /// Local alternates, by the VM's MAC.
    pub targets: HashMap<Mac, Vec<FoundTarget>>,
}

/// Plans the VM routes of node `me` from the records, its local VM pods
/// (`local`, by key) and, in cluster mode, the cluster.
pub fn vm_routes(
    me: &str,
    vms: &VmView,
    local: &HashMap<AttachmentKey, Attachment>,
    cluster: Option<&ClusterSide<'_>>,
) -> VmPlan {
    let key_of = |x: &VmAttachment| AttachmentKey {
        network: x.network.clone(),
        container_id: x.container_id.clone(),
        ifname: x.ifname.clone(),
    };
    let mut plan = VmPlan::default();
    for (rec, _) in vms.records.values() {
        let mut want = Want::default();
        match &rec.active {
            Some(act) if act.node == me => {
                want.here = local.get(&key_of(act)).map(|a| a.host_ifname.clone());
            }
            Some(act) => {
                if let Some(c) = cluster {
                    for &ip in &rec.ips {
                        if block_holder(c.view, ip) == Some(act.node.as_str()) {
                            continue;
                        }
                        if let Some((via, onlink_dev)) = next_hop(c, &act.node, Family::of_ip(ip)) {
                            want.via.push(ClusterRoute {
                                dst: IpNet::from(ip),
                                via,
                                onlink_dev,
                            });
                        }
                    }
                }
            }
            None => {}
        }
        if let Some(alt) = rec.alternate.as_ref().filter(|x| x.node == me) {
            if let Some(a) = local.get(&key_of(alt)) {
                plan.targets.entry(rec.mac).or_default().push((
                    rec.key.clone(),
                    a.key.clone(),
                    a.host_ifname.clone(),
                    rec.generation,
                ));
            }
        }
        plan.wants.insert(rec.key.clone(), want);
    }
    plan
}
