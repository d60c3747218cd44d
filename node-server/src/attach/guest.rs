//! The guests of the `tap` and `managedTap` bindings: this node answers
//! their DHCP and router solicitations on their pods' node-side veths for
//! as long as the attachment lives, from the attachment's record (the VM's
//! addresses and MAC) alone.

use super::Node;
use tether_kernel::GuestLease;
use tether_store::store::Attachment;

impl Node {
    /// What the guest of `a` is told, if `a` has a guest.
    pub(crate) fn guest_lease(a: &Attachment) -> Option<GuestLease> {
        let guest = a.guest.as_ref()?;
        Some(GuestLease {
            mac: a.mac,
            ips: a.ips.clone(),
            // The VM's name, as KubeVirt's own DHCP gives it; a VM pod
            // always has one.
            hostname: guest
                .dhcp
                .hostname
                .clone()
                .or_else(|| a.vm.as_ref().map(|v| v.vm.clone()))
                .unwrap_or_default(),
            mtu: a.mtu,
            options: guest.dhcp.clone(),
        })
    }

    /// Starts (or refreshes) answering the guest of `a`. A failure leaves
    /// the pod wired and is logged: the guest then keeps the lease it has,
    /// and the next ADD, CHECK or restart tries again.
    pub(crate) fn serve_guest(&self, a: &Attachment) {
        let Some(lease) = Self::guest_lease(a) else {
            return;
        };
        if let Err(e) = self.dhcp.serve(&a.host_ifname, lease) {
            tracing::error!(key = %a.key, error = %e, "cannot answer the guest's DHCP");
        }
    }

    /// Stops answering the guest of `a`.
    pub(crate) fn stop_guest(&self, a: &Attachment) {
        if a.guest.is_some() {
            self.dhcp.stop(&a.host_ifname);
        }
    }

    /// The guest DHCP service's counters, and the veths it serves now.
    pub fn guest_dhcp_stats(&self) -> (tether_kernel::DhcpStats, usize) {
        self.dhcp.stats()
    }

    /// The guest of `a` has just arrived on this node (a cutover): tell it
    /// its router at once rather than at the next periodic advertisement.
    pub(crate) fn welcome_guest(&self, a: &Attachment) {
        if a.guest.is_some() {
            self.dhcp.announce_router(&a.host_ifname);
        }
    }
}
