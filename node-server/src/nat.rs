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
//! carries them), multicast, and the `--no-nat-to` ranges (the service
//! CIDR, or in `--pod-cidr` mode the other nodes' pod CIDRs).

use std::sync::Arc;

use ipnet::IpNet;

use crate::error::Result;
use crate::kernel::{Host, NatPlan};
use crate::pools::PoolDef;

/// The node's outbound NAT: what was asked on the command line, and the
/// host it is programmed on. Applied at start (which also puts back a
/// table someone changed) and again when the named pools change.
pub struct OutboundNat {
    host: Arc<dyn Host>,
    enabled: bool,
    pod_ranges: Vec<IpNet>,
    no_nat_to: Vec<IpNet>,
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
        }
    }

    /// The table this node wants with these named pools; None when
    /// outbound NAT is off.
    pub fn plan(&self, pools: &[PoolDef]) -> Option<NatPlan> {
        if !self.enabled {
            return None;
        }
        let exempt: Vec<IpNet> = self
            .no_nat_to
            .iter()
            .copied()
            .chain(pools.iter().map(|p| p.cidr))
            .collect();
        Some(NatPlan::new(&self.pod_ranges, &exempt))
    }

    /// Makes tether's table what [`OutboundNat::plan`] says. On: a table
    /// the host refuses is an error (the daemon does not start without
    /// the NAT it was asked for). Off: the table is removed, and a
    /// failure to remove it is logged, since nothing the daemon serves
    /// depends on it.
    pub fn apply(&self, pools: &[PoolDef]) -> Result<()> {
        match self.plan(pools) {
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
    use crate::kernel::fake::FakeHost;

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
