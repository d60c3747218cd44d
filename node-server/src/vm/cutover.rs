//! The cutover of a live migration: the migration targets waiting on this
//! node, the listener that sees a migrated VM announce itself, and the
//! compare-and-swap that makes the target active.

use super::notices::{CutoverNotice, NOTICE_TTL};
use super::placement::join;
use super::promotion::promote;
use super::records::{Trigger, VmRecord, VmView};
use super::signals::pod_event;
use super::{CutoverTiming, FoundTarget, NodeSide, PendingTarget, Placement, Role, Vms};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tether_base::error::{Error, Result};
use tether_base::keys::VmKey;
use tether_base::mac::Mac;
use tether_base::pod_event::PodEvent;
use tether_base::sync::lock;
use tether_base::time::UnixNanos;
use tether_cni::VmPod;
use tether_kernel::{AnnounceKind, Announcements};
use tether_store::store::{Attachment, AttachmentKey};

/// The first wait before a cutover's unanswered write is tried again; it
/// doubles on each try, up to [`COMMIT_RETRY_MAX`].
const COMMIT_RETRY_FIRST: Duration = Duration::from_millis(50);
/// The longest wait between two tries of a cutover's write.
const COMMIT_RETRY_MAX: Duration = Duration::from_secs(2);

/// Takes back the promotion this node announced, if any: the record
/// refused it, or this node could not route the VM to its pod.
fn retract<N: NodeSide>(side: &N, announced: Option<CutoverNotice>) {
    if let Some(CutoverNotice::Promote {
        vm, generation, to, ..
    }) = announced
    {
        tracing::info!(%vm, generation, "the cutover this node announced did not happen: retracting it");
        side.send_notice(&CutoverNotice::Retract { vm, generation, to });
    }
}

impl Vms {
    /// After a VM pod's ADD: a migration target starts listening for its
    /// VM's announcement, or is promoted at once when its pod says the VM
    /// runs there already.
    pub(crate) async fn after_add<N: NodeSide>(
        &self,
        side: &N,
        pod: &VmPod,
        a: &Attachment,
        p: &Placement,
    ) {
        if p.role != Role::Alternate {
            return;
        }
        let generation = p.rec.generation;
        if pod.ready {
            self.ready_annotation(side, pod, a).await;
            return;
        }
        match self.kernel.link_index(&a.host_ifname).await {
            Ok(Some(ifindex)) => self.add_pending(
                a.mac,
                PendingTarget {
                    vm: pod.key.clone(),
                    attachment: a.key.clone(),
                    ifindex,
                    generation,
                },
            ),
            Ok(None) | Err(_) => {
                tracing::warn!(veth = %a.host_ifname, "cannot find a migration target's veth to listen on")
            }
        }
    }

    /// The target pod carries `kubevirt.io/migration-target-ready-timestamp`
    /// (on ADD or CHECK): cut over if it is still the alternate.
    pub(crate) async fn ready_annotation<N: NodeSide>(
        &self,
        side: &N,
        pod: &VmPod,
        a: &Attachment,
    ) {
        if !pod.ready || !pod.target {
            return;
        }
        let seen = (Instant::now(), UnixNanos::now());
        if let Err(e) = self
            .cutover(side, &pod.key, Some(a), Trigger::Annotation, seen)
            .await
        {
            tracing::warn!(vm = %pod.key, error = %e, "cutover on the target-ready annotation failed");
        }
    }

    pub(crate) fn add_pending(&self, mac: Mac, p: PendingTarget) {
        let mut pending = lock(&self.pending);
        let list = pending.entry(mac).or_default();
        if !list.contains(&p) {
            list.push(p);
        }
    }

    /// Promotes the alternate of `vm` to active by compare-and-swap. With
    /// `only` (a local trigger), only if that local attachment is the
    /// alternate. A trigger that proves the VM runs here (its announcement)
    /// installs the local route first, before the write; one that may be
    /// stale (the ready marker, which stays on a pod after its VM left it)
    /// first asks the record, and touches the kernel only when the record
    /// would accept the cutover. `seen` is when the trigger was seen
    /// (Instant and ns since the epoch).
    pub async fn cutover<N: NodeSide>(
        &self,
        side: &N,
        vm: &VmKey,
        only: Option<&Attachment>,
        trigger: Trigger,
        seen: (Instant, UnixNanos),
    ) -> Result<VmRecord> {
        let me = self.node.clone();
        let want = only.map(|a| (&a.key, me.as_str()));
        let mut local_route = None;
        // How long the handover's steps before the local route took (part
        // of `local_route`).
        let mut handover = None;
        let mut announced = None;
        if let Some(a) = only {
            let mut known = None;
            if !trigger.proves_the_vm_runs_here() {
                let current = self.records.read(vm).await?;
                let Some((rec, _)) = current else {
                    return Err(Error::UnknownVm(vm.to_string()));
                };
                if !promote(&mut rec.clone(), want, trigger, seen.1)? {
                    tracing::debug!(%vm, trigger = trigger.name(), "the record refuses this cutover: nothing touched");
                    return Ok(rec);
                }
                known = Some(rec);
            }
            // The other nodes repoint on the notice while this node routes
            // the VM here and writes the record; the record as this node
            // saw it decides what they are told. Sent first: it travels
            // while the local route goes in.
            let seen_rec = known.or_else(|| self.records.cached(vm).map(|(r, _)| r));
            if let Some(rec) = seen_rec {
                announced = self.announce(side, &rec, a, trigger, seen.1);
            }
            let started = Instant::now();
            side.before_local_route(vm, a).await;
            handover = Some(started.elapsed());
            if let Err(e) = self.kernel.ensure_host_routes(&a.host_ifname, &a.ips).await {
                retract(side, announced);
                return Err(e.into());
            }
            local_route = Some(seen.0.elapsed());
            tracing::debug!(%vm, handover_ms = handover.map(|d| d.as_secs_f64() * 1e3), "routed to its pod here; writing the record");
            if trigger.proves_the_vm_runs_here() {
                side.arrived(vm, a);
            }
        }
        // A write the store did not answer is tried again for as long as
        // the VM provably runs here (its announcement was seen on this
        // pod's interface) and the pod is still here: no later trigger
        // may come (QEMU's announcements last about a second), and until
        // the record says so the other nodes route the VM to the node it
        // left. The notice is renewed meanwhile, so that the nodes that
        // follow it keep doing so. The record still decides: every try
        // reads it again, and one that refuses ends the retries.
        let proven = only.is_some() && trigger.proves_the_vm_runs_here();
        let mut tries = 0u32;
        let mut backoff = COMMIT_RETRY_FIRST;
        let mut renewed = Instant::now();
        let outcome = loop {
            let outcome = self
                .records
                .update(vm, |r| promote(r, want, trigger, seen.1))
                .await;
            let here = only.is_some_and(|a| side.attachment(&a.key).is_some());
            match outcome {
                Err(Error::TryAgain(why)) if proven && here => {
                    tries += 1;
                    tracing::warn!(
                        %vm,
                        tries,
                        error = %why,
                        retry_in_ms = backoff.as_millis() as u64,
                        "the cutover's write got no answer; the VM runs here, so it is tried again"
                    );
                    if renewed.elapsed() >= NOTICE_TTL / 2 {
                        if let Some(n) = &announced {
                            side.send_notice(n);
                        }
                        renewed = Instant::now();
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(COMMIT_RETRY_MAX);
                }
                other => break other,
            }
        };
        let (rec, committed) = match outcome {
            Ok(done) => done,
            Err(e) => {
                // The VM runs here, so the local route stays; the next
                // announcement (QEMU sends several) tries the write again.
                if let Some(a) = only {
                    let generation = self.records.cached(vm).map_or(0, |(r, _)| r.generation);
                    if let Some(ifindex) =
                        self.kernel.link_index(&a.host_ifname).await.ok().flatten()
                    {
                        self.add_pending(
                            a.mac,
                            PendingTarget {
                                generation,
                                vm: vm.clone(),
                                attachment: a.key.clone(),
                                ifindex,
                            },
                        );
                    }
                }
                return Err(e);
            }
        };
        let active_here = rec.active.as_ref().is_some_and(|x| {
            only.is_some_and(|a| x.is(&me, &a.key.network, &a.key.container_id, &a.key.ifname))
        });
        if committed.is_none() && !(active_here && tries > 0) {
            // Not the alternate (any more): an earlier announcement won, or
            // the record moved on. Let the routes follow the record, and
            // the other nodes too, if they were told otherwise. A record
            // that names this pod active already confirms the notice.
            if !active_here {
                tracing::debug!(%vm, generation = rec.generation, "the record does not take this cutover (another won, or the record moved on)");
                retract(side, announced);
                if only.is_some() {
                    side.resync_routes(vm);
                }
            }
            return Ok(rec);
        }
        if committed.is_none() {
            tracing::info!(%vm, tries, "the cutover's write had landed, although the store's answer was lost");
        }
        let committed_after = seen.0.elapsed();
        if let Some(a) = only {
            side.welcome_guest(a);
            // An announcement said so before the write; the marker only
            // once the record agrees.
            if !trigger.proves_the_vm_runs_here() {
                side.arrived(vm, a);
            }
        }
        // An admin cutover to a pod of this node: route it now rather than
        // when the watch reports the change.
        if only.is_none() {
            if let Some(act) = rec.active.as_ref().filter(|x| x.node == me) {
                let key = AttachmentKey {
                    network: act.network.clone(),
                    container_id: act.container_id.clone(),
                    ifname: act.ifname.clone(),
                };
                let local = side.attachment(&key);
                if let Some(a) = local {
                    side.before_local_route(vm, &a).await;
                    self.kernel
                        .ensure_host_routes(&a.host_ifname, &a.ips)
                        .await?;
                    local_route = Some(seen.0.elapsed());
                    side.welcome_guest(&a);
                    side.arrived(vm, &a);
                }
            }
        }
        tracing::info!(
            vm = %vm,
            trigger = trigger.name(),
            generation = rec.generation,
            local_route_ms = local_route.map(|d| d.as_secs_f64() * 1e3),
            handover_ms = handover.map(|d| d.as_secs_f64() * 1e3),
            committed_ms = committed_after.as_secs_f64() * 1e3,
            "VM cut over"
        );
        crate::metrics::get().cutover(trigger.name(), local_route.unwrap_or(committed_after));
        if let Some(act) = rec.active.as_ref() {
            let took = local_route.unwrap_or(committed_after);
            pod_event(
                side,
                &vm.namespace,
                act,
                PodEvent::CutoverDone(format!(
                    "VM {vm} ({}) now runs in this pod on node {}: cut over on {} in {:.1} ms",
                    join(&rec.ips),
                    act.node,
                    trigger.name(),
                    took.as_secs_f64() * 1e3
                )),
            );
        }
        let mut stats = lock(&self.stats);
        stats.cutovers += 1;
        let timing = CutoverTiming {
            vm: vm.clone(),
            trigger,
            generation: rec.generation,
            seen_unix_nanos: seen.1,
            local_route,
            committed: committed_after,
        };
        super::push_recent(&mut stats.recent_cutovers, timing.clone());
        stats.last_cutover = Some(timing);
        Ok(rec)
    }

    /// Replaces the table of pending migration targets, looking up veth
    /// indexes only for targets not known before.
    pub(crate) async fn refresh_pending<N: NodeSide>(
        &self,
        side: &N,
        found: HashMap<Mac, Vec<FoundTarget>>,
        view: &VmView,
    ) {
        let old: Vec<(Mac, PendingTarget)> = lock(&self.pending)
            .iter()
            .flat_map(|(mac, list)| list.iter().map(|p| (*mac, p.clone())))
            .collect();
        let known: HashMap<AttachmentKey, u32> = old
            .iter()
            .map(|(_, p)| (p.attachment.clone(), p.ifindex))
            .collect();
        let was: HashSet<(Mac, PendingTarget)> = old.iter().cloned().collect();
        let mut table: HashMap<Mac, Vec<PendingTarget>> = HashMap::new();
        // A target placed after this view was taken stays.
        for (mac, p) in old {
            let newer = view
                .records
                .get(&p.vm)
                .is_none_or(|(r, _)| r.generation < p.generation);
            if newer && side.attachment(&p.attachment).is_some() {
                table.entry(mac).or_default().push(p);
            }
        }
        for (mac, list) in found {
            for (vm, attachment, host, generation) in list {
                let ifindex = match known.get(&attachment) {
                    Some(i) => *i,
                    None => match self.kernel.link_index(&host).await {
                        Ok(Some(i)) => i,
                        _ => continue,
                    },
                };
                let entry = table.entry(mac).or_default();
                if !entry.iter().any(|p| p.attachment == attachment) {
                    entry.push(PendingTarget {
                        vm,
                        attachment,
                        ifindex,
                        generation,
                    });
                }
            }
        }
        let mut pending = lock(&self.pending);
        // Meanwhile (other threads serve ADDs and announcements), an ADD
        // may have placed a target (which stays), and an announcement may
        // have taken one for its cutover (which is not put back).
        for (mac, list) in pending.iter() {
            for p in list {
                let entry = table.entry(*mac).or_default();
                let listed = entry.iter().any(|q| q.attachment == p.attachment);
                if !was.contains(&(*mac, p.clone())) && !listed {
                    entry.push(p.clone());
                }
            }
        }
        for (mac, p) in &was {
            let taken = pending.get(mac).is_none_or(|list| !list.contains(p));
            if taken {
                if let Some(list) = table.get_mut(mac) {
                    list.retain(|q| q != p);
                }
            }
        }
        table.retain(|_, list| !list.is_empty());
        *pending = table;
    }

    /// Starts the listener for migrated VMs' announcements on `side`,
    /// this node: an announcement on a waiting target's veth cuts over.
    pub fn spawn_announce_loop<N: NodeSide + 'static>(
        self: &Arc<Self>,
        side: Arc<N>,
        listener: Box<dyn Announcements>,
    ) {
        let vms = self.clone();
        tokio::spawn(async move {
            let mut warned = HashSet::new();
            loop {
                let ann = match listener.next().await {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(error = %e, "reading VM announcements failed");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                };
                tracing::debug!(
                    ifindex = ann.ifindex,
                    mac = %Mac::from(ann.mac),
                    kind = ?ann.kind,
                    "an announcement"
                );
                let seen_unix = UnixNanos::now().saturating_sub(ann.seen.elapsed());
                // The target waiting on this interface for this MAC, taken
                // from the table; else the interfaces that wait for it.
                let target = {
                    let mut table = lock(&vms.pending);
                    match table.get_mut(&Mac::from(ann.mac)) {
                        Some(list) => match list.iter().position(|p| p.ifindex == ann.ifindex) {
                            Some(i) => Ok(list.remove(i)),
                            None => Err(list.iter().map(|p| p.ifindex).collect::<Vec<_>>()),
                        },
                        None => Err(Vec::new()),
                    }
                };
                let target = match target {
                    Ok(t) => t,
                    Err(waiting) => {
                        tracing::debug!(
                            ifindex = ann.ifindex,
                            mac = %Mac::from(ann.mac),
                            ?waiting,
                            "an announcement on no waiting migration target's interface"
                        );
                        vms.foreign_announcement(&ann, &mut warned);
                        continue;
                    }
                };
                let local = side.attachment(&target.attachment);
                let Some(a) = local else {
                    tracing::debug!(vm = %target.vm, "a waiting migration target's pod is gone: its announcement is ignored");
                    continue;
                };
                let trigger = match ann.kind {
                    AnnounceKind::Rarp => Trigger::Rarp,
                    AnnounceKind::Garp => Trigger::Garp,
                };
                tracing::debug!(vm = %target.vm, "an announcement on a waiting migration target's interface: cutting over");
                let (vms, side) = (vms.clone(), side.clone());
                tokio::spawn(async move {
                    if let Err(e) = vms
                        .cutover(
                            side.as_ref(),
                            &target.vm,
                            Some(&a),
                            trigger,
                            (ann.seen, seen_unix),
                        )
                        .await
                    {
                        tracing::warn!(vm = %target.vm, error = %e, "cutover on the VM's announcement failed");
                    }
                });
            }
        });
    }
}

impl Vms {
    /// An announcement on a waiting target's interface from a MAC that is
    /// not its VM's: the guest runs with a MAC the record does not know (a
    /// VMI `macAddress` on the primary network never reaches the CNI), so
    /// no cutover can follow it. Said loudly, once per interface and MAC.
    fn foreign_announcement(
        &self,
        ann: &tether_kernel::Announcement,
        warned: &mut HashSet<(u32, [u8; 6])>,
    ) {
        let expected = lock(&self.pending).iter().find_map(|(mac, list)| {
            list.iter()
                .find(|p| p.ifindex == ann.ifindex)
                .map(|p| (*mac, p.vm.clone()))
        });
        if let Some((mac, vm)) = expected {
            if warned.insert((ann.ifindex, ann.mac)) {
                tracing::warn!(
                    %vm,
                    seen = %Mac::from(ann.mac),
                    expected = %mac,
                    "a migration target's guest announced itself with a MAC its record does not \
                     have: remove the VMI's macAddress or set it to the record's; the cutover waits \
                     for the annotation or the admin call"
                );
            }
        }
    }
}
