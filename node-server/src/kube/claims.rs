//! IPAMClaims (`k8s.cni.cncf.io/v1alpha1`): the ecosystem's object for a
//! VM's persistent addresses, which KubeVirt's ipam-extensions creates
//! (`<vm>.<network>`, finalizer `kubevirt.io/persistent-ipam`) and names in
//! the virt-launcher pod's network-selection element
//! (`ipam-claim-reference`).
//!
//! A VM pod that references a claim has its addresses keyed by the claim
//! ([`VmKey::claim`]): its record in the control plane is the claim's. The
//! record is the authority, and the claim's status shows it:
//! - the record decides: it is what the routes of every node follow, it is
//!   changed only by compare-and-swap, and an ADD reads it without the API
//!   server. The claim's status is written from it, after the ADD, by
//!   [`start`]'s task; a status that says otherwise is written over.
//! - the claim seeds a record once: a claim that already has `status.ips`
//!   (filled before, by tether or another CNI) and no record yet gives its
//!   first pod those addresses, or the pod's ADD fails with an address
//!   conflict, which the claim's condition then says.
//! - deleting the claim, and only that, releases the record: once the API
//!   server confirms the claim is gone and no pod of it is left, one node
//!   deletes the record (a compare-and-swap, so exactly one does).
//!
//! Status as OVN-Kubernetes writes it: `ips` as CIDRs (here the addresses
//! as the pod's interface holds them, /32 and /128), `ownerPod.name`, and
//! the `IPsAllocated` condition with reason `SuccessfulAllocation`, or
//! `SubnetExhausted`, `IPAddressConflict`, `MACAddressConflict` or
//! `InternalError`. One difference: tether keeps `ownerPod` on the pod
//! that has the VM's traffic (after a migration, the target), where
//! OVN-Kubernetes leaves the first pod.

use crate::vm::VmRecord;
use crate::vm::Vms;
use futures::StreamExt;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use kube::runtime::watcher::{self, watcher, Event};
use kube::runtime::WatchStreamExt;
use kube::Api;
use serde_json::{json, Value};
use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tether_base::error::Error;
use tether_base::sync::lock;
use tokio::sync::Notify;

/// The claims' API group.
pub const GROUP: &str = "k8s.cni.cncf.io";
/// Their version.
pub const VERSION: &str = "v1alpha1";
/// Their kind.
pub const KIND: &str = "IPAMClaim";
/// Their resource (plural).
pub const PLURAL: &str = "ipamclaims";
/// The condition tether sets.
pub const CONDITION: &str = "IPsAllocated";
pub use tether_base::keys::ClaimRef;
pub use tether_base::kubevirt::NSE_CLAIM_KEY;
/// How often every claim is looked at again, besides the changes.
const RESYNC: Duration = Duration::from_secs(30);

/// The API resource of IPAMClaims.
pub fn resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, VERSION, KIND), PLURAL)
}

/// Why a claim's allocation failed, as the condition's reason says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailReason {
    /// No free address in the pool (CNI code 100).
    SubnetExhausted,
    /// An address is held by another pod or VM, or excluded.
    IpAddressConflict,
    /// The MAC is held by another VM.
    MacAddressConflict,
    /// Anything else.
    InternalError,
}

impl FailReason {
    /// The reason's text.
    pub fn as_str(self) -> &'static str {
        match self {
            FailReason::SubnetExhausted => "SubnetExhausted",
            FailReason::IpAddressConflict => "IPAddressConflict",
            FailReason::MacAddressConflict => "MACAddressConflict",
            FailReason::InternalError => "InternalError",
        }
    }

    /// The reason an ADD's error gives.
    pub fn of(e: &Error) -> FailReason {
        match e {
            Error::PoolExhausted(_) => FailReason::SubnetExhausted,
            Error::AddressInUse(m) if m.starts_with("MAC") => FailReason::MacAddressConflict,
            Error::AddressInUse(_) | Error::AddressExcluded(_) => FailReason::IpAddressConflict,
            _ => FailReason::InternalError,
        }
    }
}

/// What the cache knows of one claim.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimSeen {
    /// `status.ips`, as written.
    pub ips: Vec<String>,
    /// `status.ownerPod.name`.
    pub owner: Option<String>,
    /// `status.conditions`.
    pub conditions: Vec<Value>,
    /// `metadata.generation`.
    pub generation: i64,
}

impl ClaimSeen {
    fn of(obj: &DynamicObject) -> ClaimSeen {
        let status = obj.data.get("status");
        let ips = status
            .and_then(|s| s.get("ips"))
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        ClaimSeen {
            ips,
            owner: status
                .and_then(|s| s.pointer("/ownerPod/name"))
                .and_then(Value::as_str)
                .map(str::to_owned),
            conditions: status
                .and_then(|s| s.get("conditions"))
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default(),
            generation: obj.metadata.generation.unwrap_or(0),
        }
    }

    /// The addresses of `status.ips` (CIDRs or plain addresses).
    pub fn addresses(&self) -> Vec<IpAddr> {
        self.ips.iter().filter_map(|s| parse_ip(s)).collect()
    }

    fn condition(&self) -> Option<(&str, &str)> {
        self.conditions
            .iter()
            .find(|c| c.get("type").and_then(Value::as_str) == Some(CONDITION))
            .map(|c| {
                (
                    c.get("status").and_then(Value::as_str).unwrap_or(""),
                    c.get("reason").and_then(Value::as_str).unwrap_or(""),
                )
            })
    }
}

/// An address of `status.ips`, with or without its prefix length.
pub fn parse_ip(s: &str) -> Option<IpAddr> {
    s.split('/').next().and_then(|a| a.parse().ok())
}

/// The addresses as `status.ips` holds them: as the pod's interface has
/// them (/32, /128).
pub fn status_ips(ips: &[IpAddr]) -> Vec<String> {
    ips.iter()
        .map(|ip| match ip {
            IpAddr::V4(a) => format!("{a}/32"),
            IpAddr::V6(a) => format!("{a}/128"),
        })
        .collect()
}

/// A failed allocation, to be said on the claim.
#[derive(Debug, Clone)]
struct Failure {
    reason: FailReason,
    message: String,
    pod: Option<String>,
}

/// The claims cache, and what the node asks of the status writer.
#[derive(Default)]
pub struct Claims {
    seen: Mutex<HashMap<ClaimRef, ClaimSeen>>,
    /// The first list has completed: a claim missing from `seen` may be
    /// gone (and is then asked for, before anything is released).
    synced: AtomicBool,
    /// Failed allocations to report, by claim.
    failures: Mutex<HashMap<ClaimRef, Failure>>,
    wake: Notify,
}

impl Claims {
    /// True once the claims have been listed from the API server.
    pub fn listed(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    /// The claim as last seen, if it was.
    pub fn get(&self, claim: &ClaimRef) -> Option<ClaimSeen> {
        lock(&self.seen).get(claim).cloned()
    }

    /// After a claim's pod was placed: write its status soon.
    pub fn allocated(&self, claim: &ClaimRef) {
        lock(&self.failures).remove(claim);
        self.wake.notify_one();
    }

    /// After a claim's pod failed to get its addresses: say why on the
    /// claim.
    pub fn failed(&self, claim: &ClaimRef, error: &Error, pod: Option<String>) {
        lock(&self.failures).insert(
            claim.clone(),
            Failure {
                reason: FailReason::of(error),
                message: error.to_string(),
                pod,
            },
        );
        self.wake.notify_one();
    }

    fn apply(&self, obj: &DynamicObject) {
        if let Some(r) = claim_ref(obj) {
            lock(&self.seen).insert(r, ClaimSeen::of(obj));
        }
    }

    fn delete(&self, obj: &DynamicObject) {
        if let Some(r) = claim_ref(obj) {
            lock(&self.seen).remove(&r);
            lock(&self.failures).remove(&r);
        }
    }
}

/// The namespace and name of a claim object.
fn claim_ref(obj: &DynamicObject) -> Option<ClaimRef> {
    Some(ClaimRef {
        namespace: obj.metadata.namespace.clone()?,
        name: obj.metadata.name.clone()?,
    })
}

/// The status a claim should have, given its record: `None` when it has
/// it already. `owner` is the pod that has the VM's traffic, if any.
pub fn desired_status(seen: &ClaimSeen, rec: &VmRecord, owner: Option<&str>) -> Option<Value> {
    let ips = status_ips(&rec.ips);
    let owner = owner.map(str::to_owned).or_else(|| seen.owner.clone());
    let ok = seen.condition() == Some(("True", "SuccessfulAllocation"));
    let same_ips = {
        let a: BTreeSet<Option<IpAddr>> = seen.ips.iter().map(|s| parse_ip(s)).collect();
        let b: BTreeSet<Option<IpAddr>> = rec.ips.iter().map(|ip| Some(*ip)).collect();
        a == b && seen.ips.len() == rec.ips.len()
    };
    if same_ips && ok && seen.owner == owner {
        return None;
    }
    let conditions = with_condition(
        seen,
        "True",
        "SuccessfulAllocation",
        "IP addresses successfully allocated",
    );
    let mut status = json!({ "ips": ips, "conditions": conditions });
    if let Some(o) = owner {
        status["ownerPod"] = json!({ "name": o });
    }
    Some(status)
}

/// The status after a failed allocation: `None` when it says so already.
/// Addresses the claim holds are kept.
pub fn failed_status(
    seen: &ClaimSeen,
    reason: FailReason,
    message: &str,
    pod: Option<&str>,
) -> Option<Value> {
    if seen.condition() == Some(("False", reason.as_str())) {
        return None;
    }
    let conditions = with_condition(seen, "False", reason.as_str(), message);
    let mut status = json!({ "ips": seen.ips, "conditions": conditions });
    if let Some(o) = pod.map(str::to_owned).or_else(|| seen.owner.clone()) {
        status["ownerPod"] = json!({ "name": o });
    }
    Some(status)
}

/// The claim's conditions with `IPsAllocated` set; its transition time
/// changes only when its status does.
fn with_condition(seen: &ClaimSeen, status: &str, reason: &str, message: &str) -> Vec<Value> {
    let now = k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string();
    let mut out: Vec<Value> = seen
        .conditions
        .iter()
        .filter(|c| c.get("type").and_then(Value::as_str) != Some(CONDITION))
        .cloned()
        .collect();
    let since = match seen.condition() {
        Some((s, _)) if s == status => seen
            .conditions
            .iter()
            .find(|c| c.get("type").and_then(Value::as_str) == Some(CONDITION))
            .and_then(|c| c.get("lastTransitionTime").cloned())
            .unwrap_or_else(|| json!(now)),
        _ => json!(now),
    };
    let mut message = message.to_owned();
    message.truncate(32_000);
    out.push(json!({
        "type": CONDITION,
        "status": status,
        "reason": reason,
        "message": message,
        "observedGeneration": seen.generation,
        "lastTransitionTime": since,
    }));
    out
}

/// Starts the claims watch and the status writer; returns the cache.
pub fn start(client: kube::Client, vms: Arc<Vms>) -> Arc<Claims> {
    let claims = Arc::new(Claims::default());
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource());
    {
        let claims = claims.clone();
        tokio::spawn(async move {
            let mut stream = watcher(api, watcher::Config::default())
                .backoff(super::WatchBackoff::default())
                .boxed();
            let mut failing = false;
            // A (re)list in progress: what it has returned so far. It
            // replaces the cache when it is done, so that a claim deleted
            // while the watch was down (which no Delete event reports)
            // leaves the cache too.
            let mut relist: Option<HashMap<ClaimRef, ClaimSeen>> = None;
            while let Some(item) = stream.next().await {
                match item {
                    Ok(Event::Init) => relist = Some(HashMap::new()),
                    Ok(Event::InitApply(o)) => match (relist.as_mut(), claim_ref(&o)) {
                        (Some(r), Some(c)) => {
                            r.insert(c, ClaimSeen::of(&o));
                        }
                        _ => claims.apply(&o),
                    },
                    Ok(Event::Apply(o)) => claims.apply(&o),
                    Ok(Event::Delete(o)) => claims.delete(&o),
                    Ok(Event::InitDone) => {
                        if let Some(r) = relist.take() {
                            *lock(&claims.seen) = r;
                        }
                        // A claim missing now is confirmed gone by the
                        // writer's GET before anything is released.
                        claims.synced.store(true, Ordering::Release);
                        if failing {
                            tracing::info!("the IPAMClaims watch is back");
                        }
                        failing = false;
                    }
                    Err(e) => {
                        super::note_gone("IPAMClaims", &e);
                        if !failing {
                            tracing::warn!(error = %e, "the IPAMClaims watch failed; retrying with backoff (CNI calls are not affected)");
                        }
                        failing = true;
                        continue;
                    }
                }
                claims.wake.notify_one();
            }
        });
    }
    {
        let claims = claims.clone();
        tokio::spawn(async move {
            let mut records = vms.records().subscribe();
            // Passes in a row that left a status unwritten: the next one
            // comes after a backoff, not after the 30 s resync.
            let mut failed_passes = 0;
            loop {
                let next = match failed_passes {
                    0 => RESYNC,
                    n => super::backoff(n - 1),
                };
                tokio::select! {
                    () = claims.wake.notified() => {}
                    r = records.changed() => if r.is_err() { return },
                    () = tokio::time::sleep(next) => {}
                }
                // Let a burst of changes settle into one pass.
                tokio::time::sleep(Duration::from_millis(20)).await;
                if write_pass(&client, &vms, &claims).await {
                    failed_passes = 0;
                } else {
                    failed_passes += 1;
                }
            }
        });
    }
    claims
}

/// One pass over every claim that has a record, a cache entry or a
/// failure to report. False when a status could not be written.
async fn write_pass(client: &kube::Client, vms: &Vms, claims: &Claims) -> bool {
    let mut written = true;
    let me = vms.node_name().to_owned();
    let records: Vec<(ClaimRef, VmRecord, i64)> = vms
        .records()
        .view()
        .records
        .iter()
        .filter_map(|(k, (r, rev))| {
            k.claim_name().map(|name| {
                (
                    ClaimRef {
                        namespace: k.namespace.clone(),
                        name: name.to_owned(),
                    },
                    VmRecord::clone(r),
                    *rev,
                )
            })
        })
        .collect();
    let with_record: BTreeSet<ClaimRef> = records.iter().map(|(c, _, _)| c.clone()).collect();
    for (claim, rec, rev) in records {
        // The active pod's node writes; with no pod, any node may (the
        // same patch twice is harmless).
        let active = rec.active.as_ref();
        if active.is_some_and(|a| a.node != me) {
            continue;
        }
        let has_pods = rec.attachments().next().is_some();
        let seen = match claims.get(&claim) {
            Some(seen) => seen,
            None if !has_pods => {
                if claims.listed() {
                    release_if_gone(client, vms, &claim, &rec, rev).await;
                }
                continue;
            }
            // A pod runs on a claim the watch has not brought: one made
            // just before its pod, or a watch that is behind. The status
            // waits on neither: the claim is read.
            None => match read_claim(client, &claim).await {
                Ok(Some(seen)) => seen,
                Ok(None) => {
                    tracing::debug!(%claim, "claim gone, pods left: released with its last pod");
                    continue;
                }
                Err(e) => {
                    tracing::warn!(%claim, error = %e, "cannot read an IPAMClaim the watch has not brought; retried with backoff");
                    written = false;
                    continue;
                }
            },
        };
        let owner = active.and_then(|a| a.pod_name.as_deref());
        if let Some(status) = desired_status(&seen, &rec, owner) {
            written &= patch_status(client, &claim, status).await;
        }
    }
    let failures: Vec<_> = lock(&claims.failures)
        .iter()
        .map(|(c, f)| (c.clone(), f.clone()))
        .collect();
    for (claim, f) in failures {
        if with_record.contains(&claim) {
            // An allocation stands: the success status wins.
            lock(&claims.failures).remove(&claim);
            continue;
        }
        let Some(seen) = claims.get(&claim) else {
            continue;
        };
        if let Some(status) = failed_status(&seen, f.reason, &f.message, f.pod.as_deref()) {
            if patch_status(client, &claim, status).await {
                lock(&claims.failures).remove(&claim);
            } else {
                written = false;
            }
        }
    }
    written
}

/// Writes a claim's status (a merge patch of the status subresource).
async fn patch_status(client: &kube::Client, claim: &ClaimRef, status: Value) -> bool {
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &claim.namespace, &resource());
    let patch = Patch::Merge(json!({ "status": status }));
    match super::bounded(api.patch_status(&claim.name, &PatchParams::default(), &patch)).await {
        Ok(_) => {
            tracing::info!(%claim, status = %status, "IPAMClaim status written");
            true
        }
        Err(e) => {
            tracing::warn!(%claim, error = %e, "cannot write an IPAMClaim's status; retried with backoff");
            false
        }
    }
}

/// Reads one claim from the API server; `None` when it is gone. The cache
/// is left to the watch: a read put there could land after the watch's
/// Delete of the same claim and bring it back.
async fn read_claim(client: &kube::Client, claim: &ClaimRef) -> Result<Option<ClaimSeen>, String> {
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &claim.namespace, &resource());
    let obj = super::bounded(api.get_opt(&claim.name)).await?;
    Ok(obj.as_ref().map(ClaimSeen::of))
}

/// The claim is not in the cache: if the API server confirms it is gone
/// and no pod of it is left, release its record.
async fn release_if_gone(
    client: &kube::Client,
    vms: &Vms,
    claim: &ClaimRef,
    rec: &VmRecord,
    rev: i64,
) {
    if rec.attachments().next().is_some() {
        return;
    }
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &claim.namespace, &resource());
    match super::bounded(api.get_opt(&claim.name)).await {
        Ok(None) => match vms.release_claimed(rec, rev).await {
            Ok(true) => {
                tracing::info!(%claim, ips = ?rec.ips, mac = %rec.mac, "IPAMClaim deleted: its addresses are released")
            }
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(%claim, error = %e, "cannot release a deleted IPAMClaim's addresses; retried")
            }
        },
        Ok(Some(_)) => {}
        Err(e) => {
            tracing::debug!(%claim, error = %e, "cannot tell whether an IPAMClaim is gone; nothing released")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::{Origin, VmKey};
    use tether_base::mac::Mac;
    use tether_base::time::UnixMillis;

    pub(super) fn rec(ips: &[&str]) -> VmRecord {
        VmRecord {
            key: VmKey::claim("ns", "vm1.default").unwrap(),
            ips: ips.iter().map(|s| s.parse().unwrap()).collect(),
            mac: "0a:58:0a:f4:01:05".parse::<Mac>().unwrap(),
            origin: Origin::Allocated,
            active: None,
            alternate: None,
            generation: 1,
            created_unix_ms: UnixMillis::now(),
            last_cutover: None,
        }
    }

    fn seen(ips: &[&str], cond: Option<(&str, &str)>, owner: Option<&str>) -> ClaimSeen {
        ClaimSeen {
            ips: ips.iter().map(|s| s.to_string()).collect(),
            owner: owner.map(String::from),
            conditions: cond
                .map(|(s, r)| {
                    vec![
                        json!({"type": CONDITION, "status": s, "reason": r, "message": "m",
                                "lastTransitionTime": "2026-01-01T00:00:00Z"}),
                    ]
                })
                .unwrap_or_default(),
            generation: 2,
        }
    }

    #[test]
    fn a_new_claim_gets_the_records_addresses_owner_and_condition() {
        let s = desired_status(
            &seen(&[], None, None),
            &rec(&["10.244.1.5", "fd00::5"]),
            Some("virt-launcher-vm1-a"),
        )
        .unwrap();
        assert_eq!(s["ips"], json!(["10.244.1.5/32", "fd00::5/128"]));
        assert_eq!(s["ownerPod"]["name"], "virt-launcher-vm1-a");
        let c = &s["conditions"][0];
        assert_eq!(c["type"], CONDITION);
        assert_eq!(c["status"], "True");
        assert_eq!(c["reason"], "SuccessfulAllocation");
        assert_eq!(c["observedGeneration"], 2);
    }

    #[test]
    fn a_claim_that_says_it_already_is_left_alone() {
        let r = rec(&["10.244.1.5"]);
        let s = seen(
            &["10.244.1.5/32"],
            Some(("True", "SuccessfulAllocation")),
            Some("p"),
        );
        assert!(desired_status(&s, &r, Some("p")).is_none());
        // A stopped VM (no pod) keeps the owner it had.
        assert!(desired_status(&s, &r, None).is_none());
        // A migration's target now has the traffic.
        let n = desired_status(&s, &r, Some("q")).unwrap();
        assert_eq!(n["ownerPod"]["name"], "q");
        // The transition time stays while the status does.
        assert_eq!(
            n["conditions"][0]["lastTransitionTime"],
            "2026-01-01T00:00:00Z"
        );
    }

    #[test]
    fn the_record_wins_over_a_claim_that_says_otherwise() {
        let r = rec(&["10.244.1.5"]);
        let s = seen(
            &["10.244.9.9/24"],
            Some(("True", "SuccessfulAllocation")),
            Some("p"),
        );
        let n = desired_status(&s, &r, Some("p")).unwrap();
        assert_eq!(n["ips"], json!(["10.244.1.5/32"]));
    }

    #[test]
    fn failures_keep_the_claims_addresses_and_say_why() {
        let s = failed_status(
            &seen(&[], None, None),
            FailReason::SubnetExhausted,
            "no free address",
            Some("p"),
        )
        .unwrap();
        assert_eq!(s["ips"], json!([]));
        assert_eq!(s["conditions"][0]["status"], "False");
        assert_eq!(s["conditions"][0]["reason"], "SubnetExhausted");
        let held = seen(
            &["10.244.1.5/32"],
            Some(("True", "SuccessfulAllocation")),
            None,
        );
        let s = failed_status(&held, FailReason::IpAddressConflict, "taken", None).unwrap();
        assert_eq!(s["ips"], json!(["10.244.1.5/32"]));
        assert_ne!(
            s["conditions"][0]["lastTransitionTime"],
            "2026-01-01T00:00:00Z"
        );
        let said = seen(&[], Some(("False", "IPAddressConflict")), None);
        assert!(failed_status(&said, FailReason::IpAddressConflict, "taken", None).is_none());
    }

    #[test]
    fn errors_map_to_ovn_kubernetes_reasons() {
        assert_eq!(
            FailReason::of(&Error::PoolExhausted("x".into())),
            FailReason::SubnetExhausted
        );
        assert_eq!(
            FailReason::of(&Error::AddressInUse("10.0.0.1 is held by VM a".into())),
            FailReason::IpAddressConflict
        );
        assert_eq!(
            FailReason::of(&Error::AddressInUse(
                "MAC 0a:58:00:00:00:01 is held by VM a".into()
            )),
            FailReason::MacAddressConflict
        );
        assert_eq!(
            FailReason::of(&Error::Internal("x".into())),
            FailReason::InternalError
        );
    }

    #[test]
    fn status_addresses_parse_with_or_without_a_prefix() {
        assert_eq!(parse_ip("10.1.2.3/24"), Some("10.1.2.3".parse().unwrap()));
        assert_eq!(parse_ip("fd00::1"), Some("fd00::1".parse().unwrap()));
        assert_eq!(parse_ip("nonsense"), None);
    }
}

/// The status writer against a test double of the API server (see
/// `test_api`): what it reads and writes when the claims cache lacks a
/// claim whose VM runs here.
#[cfg(test)]
mod writer_tests {
    use super::super::test_api::{self, Seen};
    use super::*;
    use crate::vm::{VmAttachment, VmKey, VmRegistry};
    use tether_base::time::UnixMillis;
    use tether_kernel::fake::FakeKernel;
    use tether_store::control::embedded::EmbeddedStore;
    use tether_store::control::ControlStore;

    const CLAIM_PATH: &str = "/apis/k8s.cni.cncf.io/v1alpha1/namespaces/ns/ipamclaims/vm1.default";

    /// Node "node-a", with vm1's record (claim `ns/vm1.default`) active
    /// here when `running`.
    async fn node_with_vm(running: bool) -> (Arc<Vms>, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let control: Arc<dyn ControlStore> = Arc::new(EmbeddedStore::open(dir.path()).unwrap());
        let records = VmRegistry::open(control, "/tether").await.unwrap();
        let mut rec = tests::rec(&["10.244.1.5"]);
        rec.active = running.then(|| VmAttachment {
            node: "node-a".into(),
            network: "tether".into(),
            container_id: "c1".into(),
            ifname: "eth0".into(),
            pod_name: Some("virt-launcher-vm1-a".into()),
            pod_uid: None,
            since_unix_ms: UnixMillis::now(),
        });
        records.create(&rec).await.unwrap().unwrap();
        // The view follows the store through its watch.
        for _ in 0..200 {
            if records.cached(&rec.key).is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(
            records.cached(&rec.key).is_some(),
            "the record never showed"
        );
        let vms = Arc::new(Vms::new(
            "node-a",
            records,
            Arc::new(FakeKernel::new()),
            crate::vm::leaving::Leaves::open(None).expect("in memory"),
        ));
        (vms, dir)
    }

    fn listed_but_empty() -> Claims {
        let claims = Claims::default();
        claims.synced.store(true, Ordering::Release);
        claims
    }

    fn claim_without_status(req: &Seen) -> (u16, String) {
        let claim = json!({
            "apiVersion": "k8s.cni.cncf.io/v1alpha1", "kind": "IPAMClaim",
            "metadata": {"name": "vm1.default", "namespace": "ns", "generation": 1},
            "spec": {"network": "tether", "interface": ""},
        });
        match req.method.as_str() {
            "GET" | "PATCH" => (200, claim.to_string()),
            _ => (405, "{}".into()),
        }
    }

    fn no_claim(_: &Seen) -> (u16, String) {
        let status = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                            "reason": "NotFound", "code": 404, "message": "not found"});
        (404, status.to_string())
    }

    #[tokio::test]
    async fn a_running_vms_claim_the_watch_has_not_brought_is_read_and_its_status_written() {
        let (_api, source, seen) = test_api::serve(claim_without_status).await;
        let (client, _) = super::super::client(&source).await.unwrap();
        let (vms, _dir) = node_with_vm(true).await;
        assert!(write_pass(&client, &vms, &listed_but_empty()).await);
        let seen = seen.lock().unwrap().clone();
        let calls: Vec<(&str, &str)> = seen
            .iter()
            .map(|r| (r.method.as_str(), r.path.split('?').next().unwrap_or("")))
            .collect();
        let status_path = format!("{CLAIM_PATH}/status");
        assert_eq!(
            calls,
            [("GET", CLAIM_PATH), ("PATCH", status_path.as_str())],
            "{seen:?}"
        );
        let patch: Value = serde_json::from_str(&seen[1].body).unwrap();
        assert_eq!(patch["status"]["ips"], json!(["10.244.1.5/32"]));
        assert_eq!(patch["status"]["ownerPod"]["name"], "virt-launcher-vm1-a");
    }

    #[tokio::test]
    async fn a_running_vms_claim_that_is_gone_is_left_to_its_last_pod() {
        let (_api, source, seen) = test_api::serve(no_claim).await;
        let (client, _) = super::super::client(&source).await.unwrap();
        let (vms, _dir) = node_with_vm(true).await;
        assert!(write_pass(&client, &vms, &listed_but_empty()).await);
        assert!(
            vms.records()
                .cached(&VmKey::claim("ns", "vm1.default").unwrap())
                .is_some(),
            "released while its pod runs"
        );
        let seen = seen.lock().unwrap().clone();
        assert!(seen.iter().all(|r| r.method == "GET"), "{seen:?}");
    }

    #[tokio::test]
    async fn a_stopped_vms_claim_that_is_gone_releases_its_record() {
        let (_api, source, _seen) = test_api::serve(no_claim).await;
        let (client, _) = super::super::client(&source).await.unwrap();
        let (vms, _dir) = node_with_vm(false).await;
        assert!(write_pass(&client, &vms, &listed_but_empty()).await);
        let key = VmKey::claim("ns", "vm1.default").unwrap();
        assert!(vms.records().read(&key).await.unwrap().is_none());
    }
}
