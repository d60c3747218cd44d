//! ADD: wiring a new attachment (store commit and kernel work side by
//! side, rolled back together), and a repeated ADD.

use super::del::{Made, Teardown};
use super::{blocking, key_of, wired, wiring, Node};
use crate::kube::{PodEvent, PodRef};
use crate::vm;
use std::path::Path;
use tether_base::error::{Error, Result};
use tether_base::keys::ClaimRef;
use tether_base::sync::lock;
use tether_base::time::UnixNanos;
use tether_cni::Invocation;
use tether_cni::VmPod;
use tether_kernel::{KernelError, PodNetns};
use tether_store::store::Attachment;

impl Node {
    /// ADD: wires the attachment, or returns the recorded result when the
    /// same attachment is added again and its kernel state is intact.
    /// With the Kubernetes API, the outcome is also told there (queued,
    /// never waited for): an event on the pod when it failed for want of
    /// an address, and the IPAMClaim's status when the pod has one.
    pub async fn add(&self, inv: &Invocation) -> Result<Vec<u8>> {
        // The pod's annotations are parsed once for the whole call; a
        // malformed one fails the ADD where it always did, after the
        // checks that come first.
        let vm_pod = tether_cni::vm_pod(inv);
        let claim = match &vm_pod {
            Ok(Some(pod)) => pod.claim.clone(),
            _ => None,
        };
        let out = self.add_here(inv, vm_pod).await;
        if self.kube.get().is_some() {
            self.tell_api_of_add(inv, claim, out.as_ref().err());
        }
        out
    }

    /// ADD's outcome, told to the Kubernetes API.
    fn tell_api_of_add(&self, inv: &Invocation, claim: Option<ClaimRef>, failed: Option<&Error>) {
        let Some(k) = self.kube.get() else { return };
        if let Some(e) = failed {
            let event = match e {
                Error::PoolExhausted(m) => Some(PodEvent::PoolExhausted(m.clone())),
                Error::AddressInUse(m) | Error::AddressExcluded(m) => {
                    Some(PodEvent::AddressConflict(m.clone()))
                }
                _ => None,
            };
            if let (Some(event), Some(ns), Some(name)) =
                (event, &inv.args.pod_namespace, &inv.args.pod_name)
            {
                k.events.emit(
                    PodRef {
                        namespace: ns.clone(),
                        name: name.clone(),
                        uid: inv.args.pod_uid.clone(),
                    },
                    event,
                );
            }
        }
        if let Some(claim) = claim {
            match failed {
                None => k.claims.allocated(&claim),
                // Try-again errors (the claims not listed yet, the
                // control plane away) are the runtime's to retry, not the
                // claim's to report.
                Some(Error::TryAgain(_)) => {}
                Some(e) => k.claims.failed(&claim, e, inv.args.pod_name.clone()),
            }
        }
    }

    /// With the API and `--check-vm-launchers`: `pod`, about to take its
    /// VM's addresses or become its migration's target, must be the VM's
    /// launcher ([`crate::kube::launchers`]).
    async fn check_launcher(&self, inv: &Invocation, pod: &VmPod) -> Result<()> {
        let Some(launchers) = self.kube.get().and_then(|k| k.launchers.clone()) else {
            return Ok(());
        };
        let (Some(namespace), Some(name)) = (&inv.args.pod_namespace, &inv.args.pod_name) else {
            return Err(Error::InvalidEnv {
                var: "CNI_ARGS",
                reason: format!(
                    "the pod of KubeVirt VM {} has no K8S_POD_NAME to check it is the VM's launcher by",
                    pod.domain
                ),
            });
        };
        let who = crate::kube::launchers::Claimant {
            namespace,
            pod: name,
            uid: inv.args.pod_uid.as_deref(),
            vm: &pod.domain,
        };
        launchers.verify(&who).await
    }

    async fn add_here(&self, inv: &Invocation, vm_pod: Result<Option<VmPod>>) -> Result<Vec<u8>> {
        if inv.conf.ipam.is_some() {
            return self.add_ipam_only(inv).await;
        }
        let started = UnixNanos::now();
        let key = key_of(inv);
        let netns_path = inv.netns.clone().ok_or_else(|| Error::InvalidEnv {
            var: "CNI_NETNS",
            reason: "required for ADD".into(),
        })?;
        let vm_pod = vm_pod?;
        let requested = tether_cni::requested(inv)?;
        let pools = tether_cni::pools(inv)?;
        if vm_pod.is_some() && !pools.is_empty() {
            return Err(Error::InvalidConfig(format!(
                "named pools ({}) do not serve KubeVirt VM pods yet: a VM's addresses come from the pod CIDRs",
                pools.join(", ")
            )));
        }
        let _sweep = self.sweep.read().await;
        let _key = self.lock_key(&key).await;
        let netns = self.kernel.open_netns(&netns_path)?;

        let existing = lock(&self.attachments).get(&key).cloned();
        if let Some(a) = existing {
            return self.add_again(inv, a, vm_pod.as_ref(), &netns).await;
        }

        let host_ifname = tether_kernel::host_ifname(&key.network, &key.container_id, &key.ifname);
        if let Some(other) = lock(&self.attachments)
            .values()
            .find(|a| a.host_ifname == host_ifname)
        {
            return Err(Error::Internal(format!(
                "host interface name {host_ifname} of {key} collides with {}",
                other.key
            )));
        }
        self.wait_for_deletion(&host_ifname).await;
        let mtu = inv.conf.mtu.unwrap_or_else(|| self.pod_mtu());
        // A VM pod's addresses come from its VM's record (and a migration
        // target is wired without being routed to); a plain pod's from the
        // pools.
        let (ips, mac, placement) = match &vm_pod {
            Some(pod) => {
                self.check_launcher(inv, pod).await?;
                let p = self
                    .vms
                    .place(self, self.vms.this_attachment(inv), pod, &requested)
                    .await?;
                (p.rec.ips.clone(), p.rec.mac, Some(p))
            }
            None => {
                let ips = if pools.is_empty() {
                    self.addresses_for(&requested).await?
                } else {
                    self.named_addresses(&pools, &requested.ips).await?
                };
                match self.mac_for(&requested, &ips) {
                    Ok(mac) => (ips, mac, None),
                    Err(e) => {
                        self.vms.free_ips(self, &ips);
                        self.named.release(&ips);
                        return Err(e);
                    }
                }
            }
        };
        let routed = placement
            .as_ref()
            .is_none_or(|p| p.role == vm::Role::Active);
        let attachment = Attachment {
            key: key.clone(),
            netns: netns_path.display().to_string(),
            ips: ips.clone(),
            mac,
            host_ifname: host_ifname.clone(),
            mtu,
            created_unix_nanos: started,
            pod_namespace: inv.args.pod_namespace.clone(),
            pod_name: inv.args.pod_name.clone(),
            pod_uid: inv.args.pod_uid.clone(),
            vm: vm_pod.as_ref().map(|p| p.key.clone()),
            guest: vm_pod.as_ref().and_then(|p| p.guest.clone()),
            pools,
            ipam_only: false,
        };
        // Isolated before it is wired: no packet reaches or leaves the pod
        // before what its NetworkPolicies allow is in the kernel.
        if let Err(e) = self.admit_to_policy(&attachment).await {
            let made = Made {
                placement: placement.as_ref(),
                stored: false,
                wired: false,
            };
            if let Err(undo) = self
                .teardown(std::slice::from_ref(&attachment), Teardown::FailedAdd(made))
                .await
            {
                tracing::error!(%key, error = %undo, "the rollback of an ADD that NetworkPolicy held back left something behind");
            }
            return Err(e);
        }
        let wiring = wiring(&attachment, mac, &netns, routed);
        let store = self.store.clone();
        let record = attachment.clone();
        // The fsync of the store commit overlaps the netlink work.
        let (stored, wired_ok) = tokio::join!(
            blocking(move || store.insert(&record)),
            self.kernel.wire(&wiring)
        );
        match (stored, wired_ok) {
            (Ok(()), Ok(())) => {}
            (stored, wired_ok) => {
                // Undone by the teardown DEL runs, of the parts that were
                // made; the ADD's own failure is what the runtime hears
                // (the store's first), and what the undoing could not do
                // is logged.
                let made = Made {
                    placement: placement.as_ref(),
                    stored: stored.is_ok(),
                    wired: wired_ok.is_ok(),
                };
                if let Err(e) = self
                    .teardown(std::slice::from_ref(&attachment), Teardown::FailedAdd(made))
                    .await
                {
                    tracing::error!(%key, error = %e, "the rollback of a failed ADD left something behind");
                }
                return Err(match (stored, wired_ok) {
                    (Err(e), _) => e,
                    (Ok(()), Err(e)) => e.into(),
                    (Ok(()), Ok(())) => Error::Internal("a rollback with nothing failed".into()),
                });
            }
        }
        let result = tether_cni::render_add_result(&inv.conf, &wired(&attachment));
        match (&vm_pod, &placement) {
            (Some(pod), Some(p)) => {
                // In the table before the listener can see the VM announce.
                lock(&self.attachments).insert(key, attachment.clone());
                self.serve_guest(&attachment);
                self.vms.after_add(self, pod, &attachment, p).await;
                // The route manager may have planned this VM from its record
                // before the pod was in the table ("not routed here"): a
                // fresh pass sees the pod, so that a later takeover
                // elsewhere withdraws the route the wiring added.
                self.routes.resync_vm(&pod.key);
            }
            _ => {
                lock(&self.attachments).insert(key, attachment);
            }
        }
        result
    }

    /// A repeated ADD: the same result if the wiring is intact; rewired with
    /// the same addresses if not (e.g. the daemon died in the middle of the
    /// first ADD). A different netns is a conflict.
    async fn add_again(
        &self,
        inv: &Invocation,
        a: Attachment,
        vm_pod: Option<&tether_cni::VmPod>,
        netns: &PodNetns,
    ) -> Result<Vec<u8>> {
        let netns_path = netns.path();
        if Path::new(&a.netns) != netns_path {
            return Err(Error::AttachmentConflict(format!(
                "{} is already attached in {}, not {}",
                a.key,
                a.netns,
                netns_path.display()
            )));
        }
        let wiring = wiring(&a, a.mac, netns, self.vms.routed_here(&a));
        match self.kernel.check(&wiring).await {
            Ok(()) => {}
            // Only a real difference is repaired; a failure to look (the
            // kernel busy, a netlink error) must not tear down a healthy pod.
            Err(e @ KernelError::Mismatch { .. }) => {
                tracing::info!(key = %a.key, reason = %e, "repeated ADD found broken wiring; rewiring");
                self.wait_for_deletion(&a.host_ifname).await;
                self.kernel.delete_link(&a.host_ifname).await?;
                self.kernel.wire(&wiring).await?;
            }
            Err(e) => return Err(e.into()),
        }
        self.serve_guest(&a);
        if let Some(pod) = vm_pod {
            self.vms.ready_annotation(self, pod, &a).await;
        }
        tether_cni::render_add_result(&inv.conf, &wired(&a))
    }
}
