//! Outbound NAT: traffic from this node's pod ranges to anywhere outside
//! the cluster's ranges leaves with the node's address, as Calico's
//! `natOutgoing` does. On by default; `--outbound-nat=false` turns it off
//! and removes tether's table.
//!
//! Which ranges, and why (Calico's choice): the sources are the pod ranges
//! tether allocates pod addresses from on this node's own network (the
//! `--pod-cidr`s, or in cluster mode the `--cluster-cidr`s, which hold
//! every node's blocks); the destinations left alone are those, every
//! named pool (cluster addresses too, but routed by the network that
//! carries them), multicast, the `--no-nat-to` ranges (the service CIDR,
//! or in `--pod-cidr` mode the other nodes' pod CIDRs), and with
//! `--pod-cidr-from-node` every node's pod CIDRs, as the Node objects
//! show them while the daemon runs.

use std::sync::{Arc, Mutex};

use ipnet::IpNet;
use tether_base::sync::lock;

use crate::cluster::Peers;
use crate::pools::PoolDef;
use tether_base::error::Result;
use tether_kernel::{Host, NatPlan};

/// The node's outbound NAT: what was asked on the command line, and the
/// host it is programmed on. Applied at start (which also puts back a
/// table someone changed), again when the named pools change, and, with
/// `--pod-cidr-from-node`, when another node's pod CIDRs do.
pub struct OutboundNat {
    host: Arc<dyn Host>,
    enabled: bool,
    pod_ranges: Vec<IpNet>,
    no_nat_to: Vec<IpNet>,
    /// What the table was last written from: the named pools' CIDRs and
    /// the other nodes' pod CIDRs. Held while the table is written, so
    /// that two writers cannot leave the older of their tables.
    last: Mutex<Exempt>,
}

/// The ranges that change while the daemon runs, and that the table
/// leaves alone.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Exempt {
    pools: Vec<IpNet>,
    peers: Vec<IpNet>,
}

impl OutboundNat {
    /// Outbound NAT from `pod_ranges` when `enabled`, never to
    /// `no_nat_to`, programmed on `host`.
    pub fn new(
        host: Arc<dyn Host>,
        enabled: bool,
        pod_ranges: Vec<IpNet>,
        no_nat_to: Vec<IpNet>,
    ) -> OutboundNat {
        OutboundNat {
            host,
            enabled,
            pod_ranges,
            no_nat_to,
            last: Mutex::new(Exempt::default()),
        }
    }

    /// The table this node wants with these named pools (and the other
    /// nodes' pod CIDRs last given); None when outbound NAT is off.
    pub fn plan(&self, pools: &[PoolDef]) -> Option<NatPlan> {
        let exempt = Exempt {
            pools: pools.iter().map(|p| p.cidr).collect(),
            peers: lock(&self.last).peers.clone(),
        };
        self.plan_for(&exempt)
    }

    fn plan_for(&self, exempt: &Exempt) -> Option<NatPlan> {
        if !self.enabled {
            return None;
        }
        let ranges: Vec<IpNet> = self
            .no_nat_to
            .iter()
            .chain(&exempt.pools)
            .chain(&exempt.peers)
            .copied()
            .collect();
        Some(NatPlan::new(&self.pod_ranges, &ranges))
    }

    /// Makes tether's table what [`OutboundNat::plan`] says. On: a table
    /// the host refuses is an error (the daemon does not start without
    /// the NAT it was asked for). Off: the table is removed, and a
    /// failure to remove it is logged, since nothing the daemon serves
    /// depends on it.
    pub fn apply(&self, pools: &[PoolDef]) -> Result<()> {
        let mut last = lock(&self.last);
        let exempt = Exempt {
            pools: pools.iter().map(|p| p.cidr).collect(),
            peers: last.peers.clone(),
        };
        self.write(&exempt)?;
        *last = exempt;
        Ok(())
    }

    /// With `--pod-cidr-from-node`: the other nodes' pod CIDRs, which pod
    /// traffic reaches unchanged. The table is written again only when
    /// they differ from the last ones.
    pub fn set_peer_ranges(&self, mut peers: Vec<IpNet>) -> Result<()> {
        peers.sort();
        peers.dedup();
        let mut last = lock(&self.last);
        if !self.enabled || last.peers == peers {
            return Ok(());
        }
        let exempt = Exempt {
            pools: last.pools.clone(),
            peers,
        };
        self.write(&exempt)?;
        *last = exempt;
        Ok(())
    }

    /// Follows `peers`' view for as long as the daemon runs: every node's
    /// pod CIDRs are left alone by the table. A table the host refuses is
    /// logged and tried again on the next change.
    pub fn follow_peers(self: Arc<Self>, peers: Arc<dyn Peers>) {
        let mut rx = peers.subscribe();
        tokio::spawn(async move {
            loop {
                // A stale view is no reason to NAT what was exempt.
                let ranges = {
                    let view = rx.borrow_and_update();
                    view.synced
                        .then(|| view.blocks.keys().copied().collect::<Vec<_>>())
                };
                if let Some(ranges) = ranges {
                    if let Err(e) = self.set_peer_ranges(ranges) {
                        tracing::error!(
                            "outbound NAT: cannot exempt the other nodes' pod CIDRs: {e}"
                        );
                    }
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        });
    }

    fn write(&self, exempt: &Exempt) -> Result<()> {
        match self.plan_for(exempt) {
            Some(plan) => {
                self.host.ensure_outbound_nat(&plan)?;
                tracing::info!(
                    sources = ?plan.sources().iter().map(IpNet::to_string).collect::<Vec<_>>(),
                    not_to = ?plan.exempt().iter().map(IpNet::to_string).collect::<Vec<_>>(),
                    "outbound NAT: on (nft table inet tether)"
                );
            }
            None => match self.host.remove_outbound_nat() {
                Ok(()) => tracing::info!("outbound NAT: off (no nft table inet tether)"),
                Err(e) => tracing::warn!(
                    "outbound NAT: off, but tether's nft table could not be removed: {e}"
                ),
            },
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_kernel::fake::FakeHost;

    fn nets(list: &[&str]) -> Vec<IpNet> {
        list.iter().map(|n| n.parse().unwrap()).collect()
    }

    fn pool(name: &str, cidr: &str) -> PoolDef {
        let file = format!(r#"{{"pools": [{{"name": "{name}", "cidr": "{cidr}"}}]}}"#);
        crate::pools::def::parse(&file).unwrap().remove(0)
    }

    #[test]
    fn on_by_default_the_pod_ranges_are_masqueraded_except_to_pools_and_no_nat_ranges() {
        let host = Arc::new(FakeHost::new());
        let nat = OutboundNat::new(
            host.clone(),
            true,
            nets(&["10.244.0.0/16", "fd00:10:244::/56"]),
            nets(&["10.96.0.0/12"]),
        );
        nat.apply(&[pool("migration", "192.168.100.0/24")]).unwrap();
        let plan = host.outbound_nat().expect("a table");
        assert_eq!(plan.sources(), nets(&["10.244.0.0/16", "fd00:10:244::/56"]));
        assert_eq!(
            plan.exempt(),
            nets(&[
                "10.96.0.0/12",
                "10.244.0.0/16",
                "192.168.100.0/24",
                "224.0.0.0/4",
                "fd00:10:244::/56",
                "ff00::/8"
            ])
        );
    }

    #[test]
    fn a_pools_reload_rewrites_the_table_with_the_new_pools() {
        let host = Arc::new(FakeHost::new());
        let nat = OutboundNat::new(host.clone(), true, nets(&["10.1.0.0/24"]), vec![]);
        nat.apply(&[]).unwrap();
        nat.apply(&[pool("blue", "10.50.0.0/24")]).unwrap();
        assert_eq!(host.nat_writes(), 2);
        let exempt = host.outbound_nat().unwrap().exempt().to_vec();
        assert!(
            exempt.contains(&"10.50.0.0/24".parse().unwrap()),
            "{exempt:?}"
        );
    }

    #[test]
    fn off_removes_a_table_a_former_daemon_left() {
        let host = Arc::new(FakeHost::new());
        host.set_outbound_nat(Some(NatPlan::new(&nets(&["10.1.0.0/24"]), &[])));
        let nat = OutboundNat::new(host.clone(), false, nets(&["10.1.0.0/24"]), vec![]);
        assert_eq!(nat.plan(&[]), None);
        nat.apply(&[]).unwrap();
        assert_eq!(host.outbound_nat(), None);
    }

    #[test]
    fn the_other_nodes_pod_cidrs_are_exempt_as_they_come_and_go() {
        let host = Arc::new(FakeHost::new());
        let nat = OutboundNat::new(host.clone(), true, nets(&["10.244.1.0/24"]), vec![]);
        nat.apply(&[pool("blue", "10.50.0.0/24")]).unwrap();
        nat.set_peer_ranges(nets(&["10.244.5.0/24", "10.244.3.0/24"]))
            .unwrap();
        let exempt = host.outbound_nat().unwrap().exempt().to_vec();
        for n in ["10.244.3.0/24", "10.244.5.0/24", "10.50.0.0/24"] {
            assert!(exempt.contains(&n.parse().unwrap()), "{n}: {exempt:?}");
        }
        // The same set again writes nothing; a pools reload keeps the peers.
        let writes = host.nat_writes();
        nat.set_peer_ranges(nets(&["10.244.3.0/24", "10.244.5.0/24"]))
            .unwrap();
        assert_eq!(host.nat_writes(), writes);
        nat.apply(&[]).unwrap();
        let exempt = host.outbound_nat().unwrap().exempt().to_vec();
        assert!(exempt.contains(&"10.244.5.0/24".parse().unwrap()));
        assert!(!exempt.contains(&"10.50.0.0/24".parse().unwrap()));
        // A node that goes away is NATed to again.
        nat.set_peer_ranges(nets(&["10.244.3.0/24"])).unwrap();
        let exempt = host.outbound_nat().unwrap().exempt().to_vec();
        assert!(!exempt.contains(&"10.244.5.0/24".parse().unwrap()));
    }

    #[test]
    fn a_refused_table_stops_the_start_when_on_and_is_only_logged_when_off() {
        let host = Arc::new(FakeHost::new());
        host.refuse_nat();
        let on = OutboundNat::new(host.clone(), true, nets(&["10.1.0.0/24"]), vec![]);
        let err = on.apply(&[]).unwrap_err();
        assert_eq!(err.code(), 101, "{err}");
        assert!(err.to_string().contains("outbound NAT"), "{err}");
        let off = OutboundNat::new(host.clone(), false, nets(&["10.1.0.0/24"]), vec![]);
        off.apply(&[]).unwrap();
    }
}
