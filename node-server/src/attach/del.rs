//! DEL: the route and the record go before the address is freed; the
//! veth goes after the reply (see `link_reaper`).

use super::*;

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
                return Ok(cni::empty_result());
            }
            // Nothing recorded. A link of that name can only be a leftover of
            // a failed rollback: remove it in the background.
            let host = kernel::host_ifname(&key.network, &key.container_id, &key.ifname);
            // So can a tap of an ADD that failed before its record: it is
            // removed only if its alias names this attachment.
            let tap = cni::vm_pod(inv)
                .ok()
                .flatten()
                .and_then(|p| p.guest)
                .and_then(|g| g.tap);
            if let (Some(tap), Some(netns)) = (tap, inv.netns.as_deref()) {
                self.remove_tap(netns, &tap.name, &host).await?;
            }
            self.delete_link_later(host);
            return Ok(cni::empty_result());
        };
        if queued_at.is_some_and(|q| a.created_unix_nanos > q) {
            tracing::info!(key = %a.key, "queued DEL is older than the attachment; skipped");
            return Ok(cni::empty_result());
        }
        self.release(&[a], inv.conf.vm_address_policy).await?;
        Ok(cni::empty_result())
    }

    /// Withdraws routes, removes records, frees addresses, and schedules the
    /// links' deletion. A VM pod first leaves its VM's record (which keeps
    /// the VM's addresses); if the control plane cannot take that change,
    /// nothing is released and the error is returned (the runtime retries
    /// a DEL).
    pub(crate) async fn release(&self, list: &[Attachment], policy: VmAddressPolicy) -> Result<()> {
        // A tap outlives its veth (it is persistent): it goes first, so that
        // a DEL that cannot remove it fails with its record intact.
        for a in list {
            if let Some(tap) = a.guest.as_ref().and_then(|g| g.tap.as_ref()) {
                self.remove_tap(Path::new(&a.netns), &tap.name, &a.host_ifname)
                    .await?;
            }
        }
        let mut ips: Vec<IpAddr> = Vec::new();
        for a in list {
            match &a.vm {
                None if a.ipam_only => {}
                None => ips.extend(a.ips.iter().copied()),
                Some(vm) => {
                    // Its routes follow the record unless the VM now runs
                    // nowhere.
                    if self.leave_vm_record(a, vm, policy).await? {
                        ips.extend(a.ips.iter().copied());
                    }
                }
            }
        }
        let keys: Vec<AttachmentKey> = list.iter().map(|a| a.key.clone()).collect();
        let store = self.store.clone();
        let (routes, stored) = tokio::join!(
            self.kernel.remove_host_routes(&ips),
            blocking(move || store.remove(&keys))
        );
        if let Err(e) = routes {
            // The record must outlive a DEL that failed, so that the
            // runtime's retry (or a restart) still finds the attachment:
            // put back what the concurrent removal took.
            if stored.is_ok() {
                let store = self.store.clone();
                let records = list.to_vec();
                let restored =
                    blocking(move || records.iter().try_for_each(|a| store.insert(a))).await;
                if let Err(undo) = restored {
                    tracing::error!(error = %undo, "cannot restore the records of a failed DEL");
                }
            }
            return Err(e);
        }
        stored?;
        {
            let mut attachments = lock(&self.attachments);
            for a in list {
                attachments.remove(&a.key);
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
            self.free_ips(&vm_ips);
            self.force_vm_resync();
        }
        for a in list.iter().filter(|a| !a.ipam_only) {
            self.stop_guest(a);
            self.delete_link_later(a.host_ifname.clone());
        }
        Ok(())
    }
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
            Err(Error::InterfaceExists(_)) => {
                tracing::warn!(
                    tap,
                    netns = %netns.display(),
                    "a tap of this name in the pod is not this attachment's; left alone"
                );
                Ok(())
            }
            other => other,
        }
    }
}
