//! Addresses of new pods: from the pools (claiming a block in cluster mode
//! when a family runs out), or the ones the runtime requested.

use super::Node;
use crate::cluster::Cluster;
use crate::vm::VmKey;
use ipnet::IpNet;
use std::net::IpAddr;
use tether_base::error::{Error, Result};
use tether_base::mac::Mac;
use tether_base::sync::lock;
use tether_cni::Requested;
use tether_ipam::Family;
use tether_ipam::Take;

impl Node {
    /// Claims a block of `family` (or finds one that a concurrent claim
    /// got) and adds every block this node holds to the pools.
    pub(crate) async fn grow(&self, cluster: &Cluster, family: Family) -> Result<()> {
        let held: Vec<IpNet> = lock(&self.pools).pools().iter().map(|p| p.cidr()).collect();
        cluster.claim_block(family, &held).await?;
        {
            let mut pools = lock(&self.pools);
            for block in cluster.my_blocks() {
                pools.add_block(block)?;
            }
        }
        // A block taken back may hold VM addresses: mark them before any
        // allocation from it.
        let view = self.vms.records().view().clone();
        self.vms.sync_reservations(self, &view);
        Ok(())
    }

    /// One address of each family. Never waits on the control plane while
    /// the node's blocks have room; when a family's blocks are full (cluster
    /// mode), claims a new block and tries again.
    pub(crate) async fn allocate(&self, only: Option<&[Family]>) -> Result<Vec<IpAddr>> {
        let families: Vec<Family> = match only {
            Some(f) => f.to_vec(),
            None => lock(&self.pools).families().to_vec(),
        };
        // Each round either allocates or adds a block; a handful of rounds
        // covers concurrent ADDs filling a new block before we get to it.
        for _round in 0..8 {
            let shortage = match lock(&self.pools).allocate_families(&families) {
                Ok(ips) => return Ok(ips),
                Err(s) => s,
            };
            let Some(cluster) = &self.cluster else {
                return Err(shortage.into());
            };
            for &family in &shortage.families {
                match self.grow(cluster, family).await {
                    Ok(()) => {}
                    Err(Error::TryAgain(why)) => {
                        return Err(Error::TryAgain(format!(
                            "{}, and a new {} block cannot be claimed: {why}",
                            shortage.detail,
                            family.name()
                        )))
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        Err(Error::TryAgain(
            "new blocks filled up faster than they could be claimed".into(),
        ))
    }
}

impl Node {
    /// Who holds `ip` on this node, for an error message.
    pub(crate) fn holder_of(&self, ip: IpAddr) -> String {
        if let Some(a) = lock(&self.attachments)
            .values()
            .find(|a| a.ips.contains(&ip))
        {
            let pod = match (&a.pod_namespace, &a.pod_name) {
                (Some(ns), Some(n)) => format!(" (pod {ns}/{n})"),
                _ => String::new(),
            };
            return match &a.vm {
                Some(vm) => format!("{ip} is held by VM {vm}{pod}"),
                None => format!("{ip} is held by attachment {}{pod}", a.key),
            };
        }
        if let Some(r) = self.vms.records().view().holder_of_ip(ip) {
            return format!("{ip} is held by VM {}", r.key);
        }
        format!("{ip} is being given to another pod at this moment")
    }

    /// Fails if `mac` belongs to a local pod or a VM other than `vm`.
    pub(crate) fn check_mac_free(&self, mac: Mac, vm: Option<&VmKey>) -> Result<()> {
        if let Some(a) = lock(&self.attachments)
            .values()
            .find(|a| !a.ipam_only && a.mac == mac && (a.vm.is_none() || a.vm.as_ref() != vm))
        {
            return Err(Error::AddressInUse(match &a.vm {
                Some(holder) => format!("MAC {mac} is held by VM {holder} (attachment {})", a.key),
                None => format!("MAC {mac} is held by attachment {}", a.key),
            }));
        }
        if let Some(r) = self.vms.records().view().holder_of_mac(mac) {
            if Some(&r.key) != vm {
                return Err(Error::AddressInUse(format!(
                    "MAC {mac} is held by VM {}",
                    r.key
                )));
            }
        }
        Ok(())
    }

    /// Takes requested addresses from this node's pools; in cluster mode a
    /// block nobody holds is claimed first. All or nothing.
    pub(crate) async fn take_requested(&self, ips: &[IpAddr]) -> Result<()> {
        let mut taken = Vec::with_capacity(ips.len());
        for &ip in ips {
            if let Err(e) = self.take_one(ip).await {
                self.vms.free_ips(self, &taken);
                return Err(e);
            }
            taken.push(ip);
        }
        Ok(())
    }

    pub(crate) async fn take_one(&self, ip: IpAddr) -> Result<()> {
        for _ in 0..2 {
            let took = lock(&self.pools).take(ip);
            match took {
                Take::Taken => return Ok(()),
                Take::InUse => return Err(Error::AddressInUse(self.holder_of(ip))),
                Take::Excluded => {
                    return Err(Error::AddressExcluded(format!(
                        "{ip} is excluded from this node's pod CIDRs"
                    )))
                }
                Take::NotInPool => {}
            }
            let pools: Vec<String> = lock(&self.pools)
                .pools()
                .iter()
                .map(|p| p.cidr().to_string())
                .collect();
            let Some(cluster) = &self.cluster else {
                return Err(Error::AddressNotInPool(format!(
                    "{ip} is not an address of this node's pod CIDRs ({})",
                    pools.join(", ")
                )));
            };
            let cidrs = &cluster.config().cluster_cidrs;
            if !cidrs.iter().any(|c| c.contains(&ip)) {
                let cidrs: Vec<String> = cidrs.iter().map(|c| c.to_string()).collect();
                return Err(Error::AddressNotInPool(format!(
                    "{ip} is outside the cluster CIDRs ({})",
                    cidrs.join(", ")
                )));
            }
            let view = cluster.view();
            if let Some(holder) = crate::routing::plan::block_holder(&view, ip) {
                if holder != self.config.name {
                    return Err(Error::AddressNotInPool(format!(
                        "{ip} lies in a block held by node {holder}; a node gives out addresses of its own blocks only"
                    )));
                }
            }
            // Nobody's block yet (or ours, not yet in the pools): claim it.
            let block = cluster.reclaim_block_of(ip).await?;
            lock(&self.pools).add_block(block)?;
            let view = self.vms.records().view().clone();
            self.vms.sync_reservations(self, &view);
        }
        Err(Error::AddressNotInPool(format!(
            "{ip} is not a usable address of its block (network or broadcast address)"
        )))
    }

    /// The addresses of a new pod (or a VM's first pod): the requested
    /// ones, and one of every other family from the pools.
    pub(crate) async fn addresses_for(&self, req: &Requested) -> Result<Vec<IpAddr>> {
        if req.ips.is_empty() {
            return self.allocate(None).await;
        }
        self.take_requested(&req.ips).await?;
        let missing: Vec<Family> = lock(&self.pools)
            .families()
            .iter()
            .copied()
            .filter(|f| !req.ips.iter().any(|ip| Family::of_ip(*ip) == *f))
            .collect();
        if missing.is_empty() {
            return Ok(req.ips.clone());
        }
        match self.allocate(Some(&missing)).await {
            Ok(more) => Ok(req.ips.iter().copied().chain(more).collect()),
            Err(e) => {
                self.vms.free_ips(self, &req.ips);
                Err(e)
            }
        }
    }

    /// The MAC of a new plain pod: the requested one (checked to be free)
    /// or one derived from its addresses.
    pub(crate) fn mac_for(&self, req: &Requested, ips: &[IpAddr]) -> Result<Mac> {
        match req.mac {
            Some(m) => {
                self.check_mac_free(m, None)?;
                Ok(m)
            }
            None => Ok(tether_kernel::pod_mac(ips)),
        }
    }
}
