//! Placing a VM pod in its VM's record by compare-and-swap (first pod,
//! restart, migration target), undoing that when its wiring fails, and
//! taking it out again on DEL. Control-store writes only: no kernel calls.

use super::leaving::Leave;
use super::records::{CreateRefused, Origin, VmAttachment, VmRecord};
use super::{same, NodeSide, Placement, Role, Vms};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;
use tether_base::error::{Error, Result};
use tether_base::keys::VmKey;
use tether_base::time::UnixMillis;
use tether_cni::{Invocation, Requested, VmAddressPolicy, VmPod};
use tether_store::store::{Attachment, AttachmentKey};
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
        // A pod of this VM that left here while the store was away leaves
        // the record first, so that the record this pod meets is true.
        self.make_waiting_leaves(Some(&pod.key)).await?;
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
    ///
    /// When the control store does not answer, the change waits in the
    /// node's list of leaves ([`super::leaving`]) and the DEL goes on: the
    /// answer is then read from the record as this node last saw it.
    pub(crate) async fn leave_vm_record(
        &self,
        a: &AttachmentKey,
        vm: &VmKey,
        policy: VmAddressPolicy,
    ) -> Result<bool> {
        let ephemeral = policy == VmAddressPolicy::Ephemeral;
        let why = match self.leave_now(a, vm, ephemeral, None).await {
            Err(Error::TryAgain(why)) => why,
            other => return other,
        };
        let runs_nowhere = match self.records.cached(vm) {
            None => true,
            Some((r, _)) => r
                .active
                .as_ref()
                .is_none_or(|x| x.is(&self.node, &a.network, &a.container_id, &a.ifname)),
        };
        let leave = Leave {
            vm: vm.clone(),
            attachment: a.clone(),
            ephemeral,
            queued_unix_ms: UnixMillis::now(),
        };
        self.leaves.push(leave).map_err(|e| {
            Error::TryAgain(format!(
                "{why}; and the change could not wait for the store either: {e}"
            ))
        })?;
        tracing::warn!(vm = %vm, attachment = %a, reason = %why, "the control store did not answer: the VM pod's DEL goes on, and its leave of the record waits for the store");
        Ok(runs_nowhere)
    }

    /// The leave itself. `queued`: when a DEL queued it, if it waited; an
    /// ephemeral VM's record created after that is another VM's, and is
    /// not deleted.
    async fn leave_now(
        &self,
        a: &AttachmentKey,
        vm: &VmKey,
        ephemeral: bool,
        queued: Option<UnixMillis>,
    ) -> Result<bool> {
        let me = self.node.clone();
        let this = VmAttachment {
            node: me,
            network: a.network.clone(),
            container_id: a.container_id.clone(),
            ifname: a.ifname.clone(),
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
            tracing::info!(vm = %vm, attachment = %a, generation = rec.generation, "VM pod left its record");
        }
        // A claim's addresses go with the claim only.
        if ephemeral
            && vm.claim_name().is_none()
            && rec.attachments().next().is_none()
            && queued.is_none_or(|q| rec.created_unix_ms <= q)
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

    /// Makes the leaves that wait for the store (of `vm` only, if given),
    /// oldest first. Stops at the first failure and returns it: the store
    /// is still away, or refuses.
    pub(crate) async fn make_waiting_leaves(&self, vm: Option<&VmKey>) -> Result<()> {
        let waiting = match vm {
            Some(vm) => self.leaves.of(vm),
            None => self.leaves.all(),
        };
        for l in waiting {
            self.leave_now(&l.attachment, &l.vm, l.ephemeral, Some(l.queued_unix_ms))
                .await?;
            let waited_ms = UnixMillis::now()
                .as_millis()
                .saturating_sub(l.queued_unix_ms.as_millis());
            tracing::info!(vm = %l.vm, attachment = %l.attachment, waited_ms, "a VM pod's leave that waited for the control store is made");
            self.leaves.done(&l);
        }
        Ok(())
    }

    /// Makes the waiting leaves as soon as the store takes them: tried a
    /// second after one is queued (and at once after a start that found
    /// some), then every 1, 2, 4... up to 30 s while the store fails.
    pub async fn make_waiting_leaves_forever(self: Arc<Self>) {
        const FIRST: Duration = Duration::from_secs(1);
        const MOST: Duration = Duration::from_secs(30);
        let mut wait = Duration::ZERO;
        let mut failing = false;
        loop {
            if self.leaves.all().is_empty() {
                self.leaves.pushed().await;
                wait = FIRST;
            }
            tokio::time::sleep(wait).await;
            match self.make_waiting_leaves(None).await {
                Ok(()) => {
                    failing = false;
                    wait = FIRST;
                }
                Err(e) => {
                    if !failing {
                        tracing::warn!(error = %e, waiting = self.leaves.all().len(), "VM pods' leaves still wait for the control store");
                    }
                    failing = true;
                    wait = (wait * 2).clamp(FIRST, MOST);
                }
            }
        }
    }
}
