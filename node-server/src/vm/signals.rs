//! What the Kubernetes API tells about VM pods, acted on: a target pod
//! marked ready (cut over), a promoted target that went away while its
//! source runs (give the VM back), a deleted IPAMClaim and a deleted
//! VirtualMachine (release its record). The API side ([`crate::kube`])
//! decides nothing: it reports what it saw, and the record, changed by
//! compare-and-swap, decides here.

use super::promotion::promote;
use super::records::{CutoverInfo, Origin, Trigger, VmAttachment, VmRecord};
use super::{NodeSide, Vms};
use std::time::Instant;
use tether_base::error::Result;
use tether_base::keys::VmKey;
use tether_base::pod_event::{PodEvent, PodRef};
use tether_base::time::UnixNanos;
use tether_store::store::{Attachment, AttachmentKey};

/// What the watch needs of a VM pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmPodSeen {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its UID.
    pub uid: String,
    /// A migration's target (the label or the annotation).
    pub target: bool,
    /// The target-ready annotation is set.
    pub ready: bool,
    /// Going or gone: a deletion timestamp, phase Failed or Succeeded, or
    /// deleted.
    pub gone: bool,
}

/// A migration that failed after its cutover, to be given back to its
/// source if that still runs (which the API side checks).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Revert {
    /// The VM.
    pub vm: VmKey,
    /// The promoted target's attachment on this node.
    pub target: AttachmentKey,
    /// The source pod's name (in the VM's namespace).
    pub source_pod: String,
}

/// The local VM attachments of the pod the API reported.
fn attachments_of_pod<N: NodeSide>(side: &N, seen: &VmPodSeen) -> Vec<Attachment> {
    side.attachments_where(&|a| {
        a.vm.is_some()
            && match (&a.pod_uid, &a.pod_name, &a.pod_namespace) {
                (Some(uid), _, _) if !seen.uid.is_empty() => *uid == seen.uid,
                (_, Some(name), Some(ns)) => *name == seen.name && *ns == seen.namespace,
                _ => false,
            }
    })
}

impl Vms {
    /// The API reported a VM pod of this node. A ready target that is its
    /// record's alternate is cut over at once; a promoted target that is
    /// going away while its record keeps the source as alternate is
    /// returned, for the caller to check that the source still runs and
    /// then call [`Vms::revert_cutover`].
    pub async fn vm_pod_seen<N: NodeSide>(&self, side: &N, seen: &VmPodSeen) -> Vec<Revert> {
        let mut reverts = Vec::new();
        if !seen.target {
            return reverts;
        }
        for a in attachments_of_pod(side, seen) {
            let Some(vm) = a.vm.clone() else { continue };
            // The record as the control plane has it now, not this node's
            // view of it, which may not have caught up with a cutover made
            // a moment ago.
            let rec = match self.records.read(&vm).await {
                Ok(Some((rec, _))) => rec,
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!(%vm, error = %e, "cannot read a VM record for a pod the API reported");
                    continue;
                }
            };
            let me = &self.node;
            let is =
                |x: &VmAttachment| x.is(me, &a.key.network, &a.key.container_id, &a.key.ifname);
            if seen.ready && !seen.gone {
                let at = (Instant::now(), UnixNanos::now());
                // Asked of a copy: the record decides whether the marker
                // is the one of this migration or a stale one left on a
                // demoted pod, before anything is touched.
                let want = Some((&a.key, me.as_str()));
                if matches!(
                    promote(&mut rec.clone(), want, Trigger::Annotation, at.1),
                    Ok(true)
                ) {
                    if let Err(e) = self
                        .cutover(side, &vm, Some(&a), Trigger::Annotation, at)
                        .await
                    {
                        tracing::warn!(%vm, error = %e, "cutover on the target-ready annotation failed");
                    }
                }
            } else if seen.gone && rec.active.as_ref().is_some_and(is) {
                if let Some(source) = rec.alternate.as_ref().and_then(|s| s.pod_name.clone()) {
                    reverts.push(Revert {
                        vm,
                        target: a.key.clone(),
                        source_pod: source,
                    });
                }
            }
        }
        reverts
    }

    /// Gives the VM of a migration that failed after its cutover back to
    /// its source (the alternate), by compare-and-swap, if the failed
    /// target is still the active pod. The routes follow the record.
    pub async fn revert_cutover<N: NodeSide>(&self, side: &N, r: &Revert) -> Result<bool> {
        let me = self.node.clone();
        let (started, seen) = (Instant::now(), UnixNanos::now());
        let t = &r.target;
        let (rec, rev) = self
            .records
            .update(&r.vm, |rec| {
                let target_active = rec
                    .active
                    .as_ref()
                    .is_some_and(|x| x.is(&me, &t.network, &t.container_id, &t.ifname));
                let Some(source) = rec.alternate.as_ref().filter(|_| target_active) else {
                    return Ok(false);
                };
                let to_node = source.node.clone();
                std::mem::swap(&mut rec.active, &mut rec.alternate);
                rec.last_cutover = Some(CutoverInfo {
                    trigger: Trigger::TargetFailed,
                    from_node: Some(me.clone()),
                    to_node,
                    seen_unix_nanos: seen,
                });
                Ok(true)
            })
            .await?;
        if rev.is_none() {
            return Ok(false);
        }
        tracing::warn!(vm = %r.vm, generation = rec.generation, source = %r.source_pod, "a migration failed after its cutover: the VM's traffic goes back to its source");
        // Timed from the decision to the record committed: the source's
        // node routes it when its watch sees the record.
        crate::metrics::get().cutover(Trigger::TargetFailed.name(), started.elapsed());
        side.resync_routes(&r.vm);
        if let Some(act) = rec.active.as_ref() {
            pod_event(
                side,
                &r.vm.namespace,
                act,
                PodEvent::CutoverReverted(format!(
                    "the migration of VM {} failed after its cutover (its target pod went away): its traffic comes back to this pod on node {}",
                    r.vm, act.node
                )),
            );
        }
        Ok(true)
    }

    /// Deletes the record of a claim the API server says is gone, if it is
    /// still the record seen (`rev`) and no pod is in it. True if this
    /// call deleted it.
    pub async fn release_claimed(&self, rec: &VmRecord, rev: i64) -> Result<bool> {
        if rec.key.claim_name().is_none() || rec.attachments().next().is_some() {
            return Ok(false);
        }
        Ok(self.records.delete(rec, rev).await?.is_some())
    }

    /// Deletes the record of a VM whose VirtualMachine the API server says
    /// is gone, if it is still the record seen (`rev`) and
    /// [`freed_with_its_vm`] holds. True if this call deleted it.
    pub async fn release_deleted_vm(&self, rec: &VmRecord, rev: i64) -> Result<bool> {
        if !freed_with_its_vm(rec) {
            return Ok(false);
        }
        Ok(self.records.delete(rec, rev).await?.is_some())
    }
}

/// Whether a record goes when its VM's VirtualMachine is gone: keyed by
/// the VM (a record keyed by an IPAMClaim goes with its claim), no pod in
/// it (a VM deleted while a pod still runs keeps its addresses until its
/// last pod's DEL), and not a reservation that no pod has used yet
/// (`ReserveVmAddress` for a VM that may not exist yet: generation 1).
pub fn freed_with_its_vm(rec: &VmRecord) -> bool {
    let unused_reservation = rec.origin == Origin::Reserved && rec.generation <= 1;
    rec.key.claim_name().is_none() && rec.attachments().next().is_none() && !unused_reservation
}

/// Queues an event on the pod of `a` (in `namespace`), when the pod's name
/// is known.
pub(crate) fn pod_event<N: NodeSide>(side: &N, namespace: &str, a: &VmAttachment, event: PodEvent) {
    let Some(name) = a.pod_name.clone() else {
        return;
    };
    side.pod_event(
        PodRef {
            namespace: namespace.to_owned(),
            name,
            uid: a.pod_uid.clone(),
        },
        event,
    );
}
