//! DEL: the route and the record go before the address is freed; the
//! veth goes after the reply (see `link_reaper`).

use super::{blocking, key_of, Node};
use crate::vm::Placement;
use std::net::IpAddr;
use std::path::Path;
use tether_base::error::{Error, Result};
use tether_base::sync::lock;
use tether_base::time::UnixNanos;
use tether_cni::{Invocation, VmAddressPolicy};
use tether_kernel::KernelError;
use tether_store::store::{Attachment, AttachmentKey};

impl Node {
    /// DEL: idempotent. `queued_at` is set for DELs replayed from the shim's
    /// queue: such a DEL must not remove an attachment created after it was
    /// queued.
    pub async fn del(&self, inv: &Invocation, queued_at: Option<UnixNanos>) -> Result<Vec<u8>> {
        let key = key_of(inv);
        let _sweep = self.sweep.read().await;
        let _key = self.lock_key(&key).await;
        let existing = lock(&self.attachments).get(&key).cloned();
        let Some(a) = existing else {
            if inv.conf.ipam.is_some() {
                // Addresses only: nothing of it was ever in the kernel.
                return Ok(tether_cni::empty_result());
            }
            // Nothing recorded. A link of that name can only be a leftover of
            // a failed rollback: remove it in the background.
            let host = tether_kernel::host_ifname(&key.network, &key.container_id, &key.ifname);
            // So can a tap of an ADD that failed before its record: it is
            // removed only if its alias names this attachment.
            let tap = tether_cni::vm_pod(inv)
                .ok()
                .flatten()
                .and_then(|p| p.guest)
                .and_then(|g| g.tap);
            if let (Some(tap), Some(netns)) = (tap, inv.netns.as_deref()) {
                self.remove_tap(netns, &tap.name, &host).await?;
            }
            self.delete_link_later(host);
            return Ok(tether_cni::empty_result());
        };
        if queued_at.is_some_and(|q| a.created_unix_nanos > q) {
            tracing::info!(key = %a.key, "queued DEL is older than the attachment; skipped");
            return Ok(tether_cni::empty_result());
        }
        self.release(&[a], inv.conf.vm_address_policy).await?;
        Ok(tether_cni::empty_result())
    }

    /// DEL and GC: [`Node::teardown`] of whole attachments.
    pub(crate) async fn release(&self, list: &[Attachment], policy: VmAddressPolicy) -> Result<()> {
        self.teardown(list, Teardown::Release(policy)).await
    }

    /// The one teardown of attachments, for DEL and GC and for the
    /// rollback of a failed ADD alike: taps, VM records, host routes,
    /// store records, the table, addresses, guests, links, in that order.
    /// Every failure is collected and reported ([`Error::all`]). A release
    /// stops before the records go when a step before them failed, so
    /// that the runtime's retry (or a restart) still finds the attachment;
    /// a failed ADD undoes everything it can, whatever fails.
    pub(crate) async fn teardown(&self, list: &[Attachment], how: Teardown<'_>) -> Result<()> {
        let release = matches!(how, Teardown::Release(_));
        let made = |part: fn(&Made) -> bool| match &how {
            Teardown::Release(_) => true,
            Teardown::FailedAdd(m) => part(m),
        };
        let mut failed = Vec::new();
        // A tap outlives its veth (it is persistent): it goes first.
        if made(|m| m.wired) {
            for a in list {
                if let Some(tap) = a.guest.as_ref().and_then(|g| g.tap.as_ref()) {
                    if let Err(e) = self
                        .remove_tap(Path::new(&a.netns), &tap.name, &a.host_ifname)
                        .await
                    {
                        failed.push(e);
                    }
                }
            }
        }
        if release && !failed.is_empty() {
            return Err(Error::all(failed));
        }
        // A VM pod leaves its VM's record (which keeps the VM's
        // addresses); its routes follow the record unless the VM now runs
        // nowhere. A failed ADD's placement is undone instead. The host
        // routes of a failed ADD go with its veth.
        let mut ips: Vec<IpAddr> = Vec::new();
        for a in list {
            match (&a.vm, &how) {
                (None, _) if a.ipam_only => {}
                (None, Teardown::Release(_)) => ips.extend(a.ips.iter().copied()),
                (Some(vm), Teardown::Release(policy)) => {
                    match self.vms.leave_vm_record(&a.key, vm, *policy).await {
                        Ok(true) => ips.extend(a.ips.iter().copied()),
                        Ok(false) => {}
                        Err(e) => failed.push(e),
                    }
                }
                (Some(_), Teardown::FailedAdd(m)) => {
                    if let Some(p) = m.placement {
                        if let Err(e) = self.vms.undo_placement(p).await {
                            failed.push(e);
                        }
                    }
                }
                (None, Teardown::FailedAdd(_)) => {}
            }
        }
        if release && !failed.is_empty() {
            return Err(Error::all(failed));
        }
        let keys: Vec<AttachmentKey> = list.iter().map(|a| a.key.clone()).collect();
        if release {
            let store = self.store.clone();
            let (routes, stored) = tokio::join!(
                self.kernel.remove_host_routes(&ips),
                blocking(move || store.remove(&keys))
            );
            if let Err(e) = routes {
                // The record must outlive a DEL that failed: put back what
                // the concurrent removal took.
                if stored.is_ok() {
                    let store = self.store.clone();
                    let records = list.to_vec();
                    let restored =
                        blocking(move || records.iter().try_for_each(|a| store.insert(a))).await;
                    if let Err(undo) = restored {
                        tracing::error!(error = %undo, "cannot restore the records of a failed DEL");
                    }
                }
                return Err(e.into());
            }
            stored?;
        } else if made(|m| m.stored) {
            let store = self.store.clone();
            if let Err(e) = blocking(move || store.remove(&keys)).await {
                failed.push(e);
            }
        }
        {
            let mut attachments = lock(&self.attachments);
            for a in list {
                attachments.remove(&a.key);
            }
        }
        if let Some(p) = self.policy.get() {
            for a in list {
                p.forget(&a.key.to_string());
            }
        }
        // A plain pod's addresses are its own; a VM pod's may still be held
        // by its record or by the VM's other pod here.
        let (vm_pods, plain): (Vec<&Attachment>, Vec<&Attachment>) =
            list.iter().partition(|a| a.vm.is_some());
        let plain_ips: Vec<IpAddr> = plain.iter().flat_map(|a| a.ips.clone()).collect();
        lock(&self.pools).release(&plain_ips);
        self.named.release(&plain_ips);
        if !vm_pods.is_empty() {
            let vm_ips: Vec<IpAddr> = vm_pods.iter().flat_map(|a| a.ips.clone()).collect();
            self.vms.free_ips(self, &vm_ips);
            if release {
                for vm in vm_pods.iter().filter_map(|a| a.vm.as_ref()) {
                    self.routes.resync_vm(vm);
                }
            }
        }
        for a in list.iter().filter(|a| !a.ipam_only) {
            if release {
                self.stop_guest(a);
                // The kernel's slow veth teardown runs after the reply.
                self.delete_link_later(a.host_ifname.clone());
            } else if made(|m| m.wired) {
                // A failed ADD leaves nothing behind when it answers.
                if let Err(e) = self.kernel.delete_link(&a.host_ifname).await {
                    failed.push(e.into());
                }
            }
        }
        if failed.is_empty() {
            Ok(())
        } else {
            Err(Error::all(failed))
        }
    }
}

/// Why attachments are torn down: the steps are the same, this decides
/// only what differs.
pub(crate) enum Teardown<'a> {
    /// DEL and GC, of whole attachments; the network's policy decides
    /// whether a VM's record goes with its last pod.
    Release(VmAddressPolicy),
    /// The rollback of a failed ADD, of the parts it made.
    FailedAdd(Made<'a>),
}

/// What a failed ADD made before it failed.
pub(crate) struct Made<'a> {
    /// Its VM placement, undone (a record it created is deleted).
    pub placement: Option<&'a Placement>,
    /// Its store record was written.
    pub stored: bool,
    /// Its veth (and tap) were made.
    pub wired: bool,
}

impl Node {
    /// Removes an attachment's tap from its pod netns. A netns that is
    /// gone took the tap with it. A tap of that name that is not this
    /// attachment's is left alone: a DEL must not fail forever over
    /// something tether did not make.
    async fn remove_tap(&self, netns: &Path, tap: &str, host_ifname: &str) -> Result<()> {
        let Ok(ns) = self.kernel.open_netns(netns) else {
            return Ok(());
        };
        match self.kernel.remove_tap(&ns, tap, host_ifname).await {
            Err(KernelError::Exists(_)) => {
                tracing::warn!(
                    tap,
                    netns = %netns.display(),
                    "a tap of this name in the pod is not this attachment's; left alone"
                );
                Ok(())
            }
            other => Ok(other?),
        }
    }
}
