//! The one decision of a cutover ([`promote`]): whether a VM record takes
//! its alternate as active. Pure: it reads and changes a record and
//! nothing else, so the target's pre-check, its compare-and-swap, the
//! other nodes' reading of a notice and the KubeVirt signals all ask it,
//! and none of them can disagree.

use tether_base::error::{Error, Result};
use tether_base::time::UnixNanos;
use tether_store::store::AttachmentKey;

use super::{CutoverInfo, Trigger, VmAttachment, VmRecord};

/// True when `alt` was placed before the record's last cutover, i.e. it
/// is the pod the VM left, not a new migration's target.
pub(crate) fn placed_before_last_cutover(alt: &VmAttachment, r: &VmRecord) -> bool {
    r.last_cutover
        .as_ref()
        .is_some_and(|c| UnixNanos::from(alt.since_unix_ms) < c.seen_unix_nanos)
}

/// The one decision of a cutover, applied to `r` as it is in the control
/// store: promotes the alternate to active and records the cutover, or
/// returns false when the record refuses. `want` is the local attachment
/// (and this node's name) a local trigger requires to be the alternate.
/// The pre-check before the kernel is touched and the compare-and-swap
/// both call it, so the two cannot disagree.
pub(crate) fn promote(
    r: &mut VmRecord,
    want: Option<(&AttachmentKey, &str)>,
    trigger: Trigger,
    seen: UnixNanos,
) -> Result<bool> {
    let Some(alt) = &r.alternate else {
        return match want {
            Some(_) => Ok(false),
            None => Err(Error::VmState(format!(
                "VM {} has no alternate pod to cut over to",
                r.key
            ))),
        };
    };
    if let Some((k, node)) = want {
        if !alt.is(node, &k.network, &k.container_id, &k.ifname) {
            return Ok(false);
        }
    }
    if trigger == Trigger::Annotation && placed_before_last_cutover(alt, r) {
        // The alternate was placed before the last cutover: it is the
        // demoted source, whose ready marker is left from the migration
        // that made it active once. A stale marker never steals the VM
        // back.
        return Ok(false);
    }
    let to_node = alt.node.clone();
    let from_node = r.active.as_ref().map(|a| a.node.clone());
    std::mem::swap(&mut r.active, &mut r.alternate);
    r.last_cutover = Some(CutoverInfo {
        trigger,
        from_node,
        to_node,
        seen_unix_nanos: seen,
    });
    Ok(true)
}
