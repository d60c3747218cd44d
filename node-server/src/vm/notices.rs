//! Cutover notices: a migration's target tells the other nodes at once
//! that its VM runs there, in parallel with the record's compare-and-swap,
//! so that they need not wait for the commit and the watch to repoint.
//!
//! The record stays the one authority. A notice is only a forecast of the
//! change the target is writing, and a node follows it only while the
//! record agrees that the change can still happen:
//! - it applies to one generation of the record: the one the target
//!   promoted from. Once the view shows a later generation (the commit
//!   landed, or anything else changed the record), the notice is dropped
//!   and routes follow the record alone;
//! - the record at that generation must accept the same promotion
//!   ([`promote`], the one decision of a cutover), of the very attachment
//!   the notice names;
//! - it lapses after [`NOTICE_TTL`] if the record never moves;
//! - a target whose write the record refused sends a retraction at once.
//!
//! So a peer that routed on a notice the record then refuses returns to
//! the record's route on the first of: the retraction, the refusing
//! change in its view, the notice's lapse.

use super::promotion::promote;
use super::records::{Trigger, VmRecord, VmView};
use super::{NodeSide, Vms};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tether_base::keys::VmKey;
use tether_base::sync::lock;
use tether_base::time::UnixNanos;
use tether_store::store::{Attachment, AttachmentKey};

/// How long a notice holds without the record confirming it.
pub const NOTICE_TTL: Duration = Duration::from_secs(5);

/// The version of the datagram's format.
pub const NOTICE_VERSION: u32 = 1;

/// The attachment a notice promotes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NoticeTarget {
    /// Its node, which sends the notice.
    pub node: String,
    /// The CNI network name.
    pub network: String,
    /// CNI_CONTAINERID.
    pub container_id: String,
    /// CNI_IFNAME.
    pub ifname: String,
}

impl NoticeTarget {
    fn key(&self) -> AttachmentKey {
        AttachmentKey {
            network: self.network.clone(),
            container_id: self.container_id.clone(),
            ifname: self.ifname.clone(),
        }
    }
}

/// What a migration's target tells the other nodes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum CutoverNotice {
    /// The VM runs on `to` now; the record's generation `generation` is
    /// being promoted.
    Promote {
        vm: VmKey,
        generation: u64,
        to: NoticeTarget,
        trigger: Trigger,
        seen_unix_nanos: UnixNanos,
    },
    /// The record refused the promotion announced for `generation`.
    Retract {
        vm: VmKey,
        generation: u64,
        to: NoticeTarget,
    },
}

/// A notice on the wire: the format's version, then the notice.
#[derive(Debug, Serialize, Deserialize)]
struct Datagram {
    tether_cutover: u32,
    #[serde(flatten)]
    notice: CutoverNotice,
}

impl CutoverNotice {
    /// The node that sent it (the target's).
    pub fn sender(&self) -> &str {
        match self {
            CutoverNotice::Promote { to, .. } | CutoverNotice::Retract { to, .. } => &to.node,
        }
    }

    /// The datagram.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(&Datagram {
            tether_cutover: NOTICE_VERSION,
            notice: self.clone(),
        })
        .unwrap_or_default()
    }

    /// Reads a datagram; `None` for anything else (another version, noise).
    pub fn decode(bytes: &[u8]) -> Option<CutoverNotice> {
        let d: Datagram = serde_json::from_slice(bytes).ok()?;
        (d.tether_cutover == NOTICE_VERSION).then_some(d.notice)
    }
}

/// A promotion this node was told of and has not seen the record settle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Noted {
    generation: u64,
    to: NoticeTarget,
    trigger: Trigger,
    seen: UnixNanos,
    expires: Instant,
}

/// The notices this node follows, by VM.
pub(crate) type NoticeTable = HashMap<VmKey, Noted>;

/// Takes `notice` into `table`. Returns whether the table changed.
pub(crate) fn note(table: &mut NoticeTable, notice: CutoverNotice, now: Instant) -> bool {
    match notice {
        CutoverNotice::Promote {
            vm,
            generation,
            to,
            trigger,
            seen_unix_nanos,
        } => {
            if table.get(&vm).is_some_and(|n| n.generation > generation) {
                return false;
            }
            if let Some(n) = table.get_mut(&vm).filter(|n| {
                n.generation == generation
                    && n.to == to
                    && n.trigger == trigger
                    && n.seen == seen_unix_nanos
            }) {
                // The same notice again (a target renewing it while its
                // write is retried): it holds longer; nothing to re-plan.
                n.expires = now + NOTICE_TTL;
                return false;
            }
            let noted = Noted {
                generation,
                to,
                trigger,
                seen: seen_unix_nanos,
                expires: now + NOTICE_TTL,
            };
            table.insert(vm, noted);
            true
        }
        CutoverNotice::Retract { vm, generation, to } => {
            let matches = table
                .get(&vm)
                .is_some_and(|n| n.generation == generation && n.to == to);
            if matches {
                table.remove(&vm);
            }
            matches
        }
    }
}

/// `view` as the notices in `table` forecast it: each record a notice
/// still applies to, promoted as its target is writing it (generation
/// one higher, the notice's trigger and time as its last cutover). Drops
/// the notices that no longer apply. `None` when no notice applies: the
/// view is the record's.
pub(crate) fn forecast(view: &VmView, table: &mut NoticeTable, now: Instant) -> Option<VmView> {
    let mut out: Option<VmView> = None;
    table.retain(|vm, n| {
        if n.expires <= now {
            tracing::info!(%vm, to = %n.to.node, "a cutover notice lapsed without the record confirming it: routes follow the record");
            return false;
        }
        let Some((rec, rev)) = view.records.get(vm) else {
            return false;
        };
        if rec.generation > n.generation {
            return false;
        }
        if rec.generation < n.generation {
            // This view has not caught up with the record the target
            // promoted from: wait for it.
            return true;
        }
        let mut promoted = VmRecord::clone(rec);
        let key = n.to.key();
        match promote(
            &mut promoted,
            Some((&key, n.to.node.as_str())),
            n.trigger,
            n.seen,
        ) {
            Ok(true) => {
                promoted.generation += 1;
                out.get_or_insert_with(|| view.clone())
                    .records
                    .insert(vm.clone(), (std::sync::Arc::new(promoted), *rev));
                true
            }
            Ok(false) | Err(_) => {
                tracing::warn!(%vm, to = %n.to.node, "a cutover notice the record refuses: ignored");
                false
            }
        }
    });
    out
}

impl Vms {
    /// Takes a notice from another node. Returns whether routes must be
    /// planned again.
    pub fn take_notice(&self, notice: CutoverNotice) -> bool {
        if notice.sender() == self.node {
            return false;
        }
        note(&mut lock(&self.notices), notice, Instant::now())
    }

    /// The records as this node routes them: the view, with the promotions
    /// that other nodes' notices forecast.
    pub fn routed_view(&self, view: &VmView) -> Option<VmView> {
        let mut table = lock(&self.notices);
        if table.is_empty() {
            return None;
        }
        forecast(view, &mut table, Instant::now())
    }

    /// The promotion of `rec` (as this node last saw it) to local
    /// attachment `a`, announced to the other nodes if the record, as seen,
    /// accepts it. Returns the notice sent.
    pub(crate) fn announce<N: NodeSide>(
        &self,
        side: &N,
        rec: &VmRecord,
        a: &Attachment,
        trigger: Trigger,
        seen: UnixNanos,
    ) -> Option<CutoverNotice> {
        let mut probe = rec.clone();
        let accepted = promote(
            &mut probe,
            Some((&a.key, self.node.as_str())),
            trigger,
            seen,
        );
        if !matches!(accepted, Ok(true)) {
            return None;
        }
        let notice = CutoverNotice::Promote {
            vm: rec.key.clone(),
            generation: rec.generation,
            to: NoticeTarget {
                node: self.node.clone(),
                network: a.key.network.clone(),
                container_id: a.key.container_id.clone(),
                ifname: a.key.ifname.clone(),
            },
            trigger,
            seen_unix_nanos: seen,
        };
        side.send_notice(&notice);
        Some(notice)
    }
}
