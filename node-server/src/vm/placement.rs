//! Placing a VM pod in its VM's record by compare-and-swap (first pod,
//! restart, migration target), undoing that when its wiring fails, and
//! taking it out again on DEL. Control-store writes only: no kernel calls.

use super::records::{CreateRefused, Origin, VmAttachment, VmRecord};
use super::{same, NodeSide, Placement, Role, Vms};
use std::net::IpAddr;
use tether_base::error::{Error, Result};
use tether_base::keys::VmKey;
use tether_base::time::UnixMillis;
use tether_cni::{Invocation, Requested, VmAddressPolicy, VmPod};
use tether_store::store::Attachment;
/// Removes `this` from the record's attachments; true if it was there.
pub(super) fn remove_attachment(r: &mut VmRecord, this: &VmAttachment) -> bool {
    let mut changed = false;
    if r.active.as_ref().is_some_and(|a| same(a, this)) {
        r.active = None;
        changed = true;
    }
    if r.alternate.as_ref().is_some_and(|a| same(a, this)) {
        r.alternate = None;
        changed = true;
    }
    changed
}

/// A request for a VM that has a record must ask for what it holds.
pub(super) fn check_request_matches(rec: &VmRecord, req: &Requested) -> Result<()> {
    for ip in &req.ips {
        if !rec.ips.contains(ip) {
            return Err(Error::AddressInUse(format!(
                "VM {} holds {}; it cannot be given {ip} (release it first with ReleaseVm)",
                rec.key,
                join(&rec.ips)
            )));
        }
    }
    if let Some(mac) = req.mac {
        if rec.mac != mac {
            return Err(Error::AddressInUse(format!(
                "VM {} holds MAC {}; it cannot be given {mac} (release it first with ReleaseVm)",
                rec.key, rec.mac
            )));
        }
    }
    Ok(())
}

pub(super) fn join(ips: &[IpAddr]) -> String {
    ips.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

impl Vms {
    /// True when the node should route the attachment's addresses to it:
    /// every plain pod, and a VM pod that its record names active.
    pub(crate) fn routed_here(&self, a: &Attachment) -> bool {
        if a.ipam_only {
            // The main plugin made the interface; nothing to route.
            return false;
        }
        let Some(key) = &a.vm else {
            return true;
        };
        let view = self.records.view();
        view.records
            .get(key)
            .and_then(|(r, _)| r.active.as_ref())
            .is_some_and(|x| {
                x.is(
                    &self.node,
                    &a.key.network,
                    &a.key.container_id,
                    &a.key.ifname,
                )
            })
    }

    pub(crate) fn this_attachment(&self, inv: &Invocation) -> VmAttachment {
        VmAttachment {
            node: self.node.clone(),
            network: inv.conf.name.clone(),
            container_id: inv.container_id.clone(),
            ifname: inv.ifname.clone(),
            pod_name: inv.args.pod_name.clone(),
            pod_uid: inv.args.pod_uid.clone(),
            since_unix_ms: UnixMillis::now(),
        }
    }

    /// Puts a VM pod (`this`, made by [`Vms::this_attachment`]) into its
    /// VM's record, by compare-and-swap:
    /// - no record: the VM's first pod; addresses are allocated (or the
    ///   requested ones taken) and the record created with it active;
    /// - a record without an active pod: the VM starts again here;
    /// - a migration target: it becomes the alternate;
    /// - otherwise the pod replaces the active one (the VM was restarted
    ///   before its old pod was deleted).
    pub(crate) async fn place<N: NodeSide>(
        &self,
        side: &N,
        this: VmAttachment,
        pod: &VmPod,
        req: &Requested,
    ) -> Result<Placement> {
        for _attempt in 0..8 {
            let Some((mut rec, rev)) = self.records.read(&pod.key).await? else {
                match self.create_record(side, pod, req, &this).await? {
                    Some(p) => return Ok(p),
                    None => continue,
                }
            };
            check_request_matches(&rec, req)?;
            let role = if rec.active.as_ref().is_some_and(|a| same(a, &this)) {
                Role::Active
            } else if rec.alternate.as_ref().is_some_and(|a| same(a, &this)) {
                Role::Alternate
            } else if rec.active.is_none() {
                rec.active = Some(this.clone());
                Role::Active
            } else if pod.target {
                if let Some(old) = rec.alternate.replace(this.clone()) {
                    tracing::warn!(vm = %pod.key, old = %old.describe(), "a new migration target replaces one that was never deleted");
                }
                Role::Alternate
            } else {
                if let Some(old) = rec.active.replace(this.clone()) {
                    tracing::warn!(vm = %pod.key, old = %old.describe(), "a new pod of the VM takes over from one still recorded active");
                }
                Role::Active
            };
            rec.generation += 1;
            if self.records.replace(&rec, rev).await?.is_some() {
                tracing::info!(vm = %pod.key, role = ?role, generation = rec.generation, "VM pod placed");
                return Ok(Placement {
                    rec,
                    role,
                    created: false,
                    this,
                });
            }
        }
        Err(Error::TryAgain(format!(
            "the record of VM {} kept changing while this pod was added",
            pod.key
        )))
    }

    /// Creates the record of a VM's first pod. `None` when another node
    /// created it first (the caller reads it again).
    async fn create_record<N: NodeSide>(
        &self,
        side: &N,
        pod: &VmPod,
        req: &Requested,
        this: &VmAttachment,
    ) -> Result<Option<Placement>> {
        // A claim that already holds addresses (written before, by tether
        // or another CNI) gives them to its first record.
        let seeded = side.claim_addresses(pod)?.filter(|_| req.ips.is_empty());
        let from_claim;
        let req = match seeded {
            Some(ips) => {
                tracing::info!(vm = %pod.key, ?ips, "the IPAMClaim's status gives the VM's addresses");
                from_claim = Requested { ips, mac: req.mac };
                &from_claim
            }
            None => req,
        };
        let ips = side.addresses_for(req).await?;
        let mac = req.mac.unwrap_or_else(|| tether_kernel::pod_mac(&ips));
        if let Err(e) = side.check_mac_free(mac, Some(&pod.key)) {
            self.free_ips(side, &ips);
            return Err(e);
        }
        let rec = VmRecord {
            key: pod.key.clone(),
            ips: ips.clone(),
            mac,
            origin: if *req == Requested::default() {
                Origin::Allocated
            } else {
                Origin::Requested
            },
            active: Some(this.clone()),
            alternate: None,
            generation: 1,
            created_unix_ms: UnixMillis::now(),
            last_cutover: None,
        };
        let placed = |rec: VmRecord| Placement {
            rec,
            role: Role::Active,
            created: true,
            this: this.clone(),
        };
        match self.records.create(&rec).await {
            Ok(Ok(rev)) => {
                self.mark_held(side, &ips, rev);
                tracing::info!(vm = %pod.key, ips = ?ips, mac = %rec.mac, "VM address record created");
                Ok(Some(placed(rec)))
            }
            Ok(Err(CreateRefused::Exists)) => {
                self.free_ips(side, &ips);
                Ok(None)
            }
            Ok(Err(CreateRefused::Taken { what, holder })) => {
                self.free_ips(side, &ips);
                Err(Error::AddressInUse(format!(
                    "{what} is held by VM {holder}"
                )))
            }
            Err(e) => {
                // The outcome is unknown: the record tells.
                match self.records.read(&pod.key).await {
                    Ok(Some((found, rev))) if found.active.as_ref() == Some(this) => {
                        self.mark_held(side, &ips, rev);
                        Ok(Some(placed(found)))
                    }
                    Ok(_) => {
                        self.free_ips(side, &ips);
                        Err(e)
                    }
                    Err(_) => {
                        // Cannot tell: keep the addresses out of the pools
                        // until a restart finds out from the store.
                        self.mark_held(side, &ips, i64::MAX);
                        tracing::warn!(vm = %pod.key, ?ips, "cannot tell whether a VM record was created; its addresses stay reserved");
                        Err(e)
                    }
                }
            }
        }
    }

    /// Undoes a placement whose wiring failed.
    pub(crate) async fn undo_placement(&self, p: &Placement) -> Result<()> {
        let key = p.rec.key.clone();
        let outcome = if p.created {
            match self.records.read(&key).await {
                Ok(Some((rec, rev)))
                    if rec.active.as_ref() == Some(&p.this) && rec.alternate.is_none() =>
                {
                    match self.records.delete(&rec, rev).await {
                        // The record no longer holds its addresses: the
                        // caller frees them now, so that the runtime's
                        // immediate retry can have them, rather than when
                        // the watch reports the deletion.
                        Ok(Some(deleted)) => {
                            self.unmark_held(&rec.ips, deleted);
                            Ok(())
                        }
                        Ok(None) => Ok(()),
                        Err(e) => Err(e),
                    }
                }
                Ok(_) => Ok(()),
                Err(e) => Err(e),
            }
        } else {
            self.records
                .update(&key, |r| Ok(remove_attachment(r, &p.this)))
                .await
                .map(|_| ())
        };
        outcome.map_err(|e| {
            Error::Store(format!(
                "cannot undo the change of VM {key}'s record by a failed ADD: {e}"
            ))
        })
    }

    /// Takes a VM pod out of its record before its local teardown: the
    /// record stays (the VM keeps its address) unless the network's policy
    /// is `ephemeral` and it was the VM's last pod. Returns whether the
    /// node should withdraw the pod's host routes (the VM now runs
    /// nowhere; otherwise the routes follow the record).
    pub(crate) async fn leave_vm_record(
        &self,
        a: &Attachment,
        vm: &VmKey,
        policy: VmAddressPolicy,
    ) -> Result<bool> {
        let me = self.node.clone();
        let this = VmAttachment {
            node: me,
            network: a.key.network.clone(),
            container_id: a.key.container_id.clone(),
            ifname: a.key.ifname.clone(),
            pod_name: None,
            pod_uid: None,
            since_unix_ms: UnixMillis::EPOCH,
        };
        let (rec, rev) = match self
            .records
            .update(vm, |r| Ok(remove_attachment(r, &this)))
            .await
        {
            Ok((rec, Some(rev))) => (rec, Some(rev)),
            Ok((rec, None)) => (rec, None),
            // Released meanwhile: nothing to leave.
            Err(Error::UnknownVm(_)) => return Ok(true),
            Err(e) => return Err(e),
        };
        if rev.is_some() {
            tracing::info!(vm = %vm, attachment = %a.key, generation = rec.generation, "VM pod left its record");
        }
        // A claim's addresses go with the claim only.
        if policy == VmAddressPolicy::Ephemeral
            && vm.claim_name().is_none()
            && rec.attachments().next().is_none()
        {
            let rev = match rev {
                Some(r) => Some(r),
                None => self.records.read(vm).await?.map(|(_, r)| r),
            };
            if let Some(rev) = rev {
                if self.records.delete(&rec, rev).await?.is_some() {
                    tracing::info!(vm = %vm, ips = ?rec.ips, "released the address of an ephemeral VM with its last pod");
                }
            }
        }
        Ok(rec.active.is_none())
    }
}
