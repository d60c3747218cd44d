//! The pools' view of VM addresses: an address of this node's blocks that
//! a VM record holds stays in use while no local pod has it. The marks
//! are the component's; the pools are the node's, reached through
//! [`NodeSide::with_pools`].

use super::records::VmView;
use super::{NodeSide, Vms};
use std::collections::HashSet;
use std::net::IpAddr;
use tether_base::sync::lock;
use tether_ipam::Take;
impl Vms {
    /// Returns VM addresses (or addresses taken for a VM or a request) to
    /// the pools unless a VM record or another local pod of a VM still
    /// holds them. A plain pod's DEL frees its addresses directly.
    pub(crate) fn free_ips<N: NodeSide>(&self, side: &N, ips: &[IpAddr]) {
        side.with_pools(|pools, attachments| {
            let held = lock(&self.held);
            let free: Vec<IpAddr> = ips
                .iter()
                .copied()
                .filter(|ip| {
                    !held.contains_key(ip)
                        && !attachments
                            .values()
                            .any(|a| a.vm.is_some() && a.ips.contains(ip))
                })
                .collect();
            pools.release(&free);
        });
    }

    /// Records that a VM record written at `revision` holds these of our
    /// pool addresses (before the watch reports it).
    pub(crate) fn mark_held<N: NodeSide>(&self, side: &N, ips: &[IpAddr], revision: i64) {
        side.with_pools(|pools, _| {
            let mut held = lock(&self.held);
            for &ip in ips.iter().filter(|ip| pools.contains(**ip)) {
                let e = held.entry(ip).or_insert(revision);
                *e = (*e).max(revision);
            }
        });
    }

    /// Keeps the pools in step with the VM records: an address of our blocks
    /// that a record holds is in use even when no local pod has it (the VM
    /// runs elsewhere, or nowhere); it is freed once the record is gone.
    pub(crate) fn sync_reservations<N: NodeSide>(&self, side: &N, view: &VmView) {
        if !view.synced {
            return;
        }
        side.with_pools(|pools, attachments| {
            let mut held = lock(&self.held);
            let want: HashSet<IpAddr> = view
                .records
                .values()
                .flat_map(|(r, _)| r.ips.iter().copied())
                .filter(|ip| pools.contains(*ip))
                .collect();
            for &ip in &want {
                if pools.take(ip) == Take::InUse && !held.contains_key(&ip) {
                    if let Some(a) = attachments
                        .values()
                        .find(|a| a.vm.is_none() && a.ips.contains(&ip))
                    {
                        tracing::error!(%ip, attachment = %a.key, "a VM record holds the address of a local pod");
                    }
                }
                let e = held.entry(ip).or_insert(view.revision);
                *e = (*e).max(view.revision);
            }
            let gone: Vec<IpAddr> = held
                .iter()
                .filter(|(ip, rev)| !want.contains(ip) && view.revision >= **rev)
                .map(|(ip, _)| *ip)
                .collect();
            for ip in gone {
                held.remove(&ip);
                if !attachments.values().any(|a| a.ips.contains(&ip)) {
                    pools.release(&[ip]);
                    tracing::info!(%ip, "a VM address was released");
                }
            }
        });
    }

    /// A record deleted at `revision` no longer holds these addresses:
    /// their marks go unless a later record (or an unknown outcome) made
    /// them.
    pub(crate) fn unmark_held(&self, ips: &[IpAddr], revision: i64) {
        let mut held = lock(&self.held);
        for ip in ips {
            if held.get(ip).is_some_and(|r| *r <= revision) {
                held.remove(ip);
            }
        }
    }
}
