//! KubeVirt's VirtualMachines (`kubevirt.io/v1`): deleting one frees its
//! VM's addresses through the API, as deleting an IPAMClaim frees those of
//! a VM keyed by its claim ([`super::claims`]). So freeing a deleted VM's
//! addresses needs no admin call on a node; `ReleaseVm` stays for the
//! admin API.
//!
//! A record is freed when [`crate::vm::signals::freed_with_its_vm`] holds
//! (keyed by the VM, no pod in it, not a reservation no pod has used) and
//! its VM has no VirtualMachine. The VM of a record is its key's VM: the
//! pod's `kubevirt.io/domain`, the VirtualMachineInstance's name, which a
//! VirtualMachine gives its instances. So:
//! - a stopped VM keeps its addresses (its VirtualMachine is there);
//! - a VM deleted while a pod of it still runs keeps them until its last
//!   pod's DEL, which changes the record and wakes the pass;
//! - an instance made without a VirtualMachine (a VirtualMachineInstance of
//!   its own, or of a replica set) has none: its addresses go with its
//!   last pod, as the instance itself does.
//!
//! Nothing is freed on the cache's word alone. A VM missing from the cache
//! (a watch of names only) is asked of the API server by a list with a
//! field selector on its name: only an answer that lists no such object
//! frees it. A list of a resource the server does not serve fails (KubeVirt
//! gone: nothing is freed), as does one that gets no answer. The delete is
//! a compare-and-swap on the record's revision, so one node does it and a
//! pod placed in the record meanwhile keeps it.
//!
//! A deletion the watch missed (the daemon down, a 410 Gone) is still
//! found: every relist replaces the cache, and the pass runs at every
//! change of the records and every [`RESYNC`]. Without KubeVirt's API
//! (`kubevirt.io/v1` not served) the watch is not started, and the group
//! is looked for again every [`LOOK_AGAIN`].

use crate::vm::signals::freed_with_its_vm;
use crate::vm::{VmKey, VmRecord, Vms};
use futures::StreamExt;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, ListParams};
use kube::core::PartialObjectMeta;
use kube::runtime::watcher::{self, watcher, Event};
use kube::runtime::WatchStreamExt;
use kube::Api;
use std::collections::{BTreeSet, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tether_base::sync::lock;
use tokio::sync::Notify;

/// KubeVirt's API group.
pub const GROUP: &str = "kubevirt.io";
/// Its version.
pub const VERSION: &str = "v1";
/// The kind.
pub const KIND: &str = "VirtualMachine";
/// Its resource (plural).
pub const PLURAL: &str = "virtualmachines";
/// How often every record is looked at again, besides the changes.
pub const RESYNC: Duration = Duration::from_secs(60);
/// How often a cluster without KubeVirt's API is asked for it again.
pub const LOOK_AGAIN: Duration = Duration::from_secs(60);
/// The most a node waits before it asks the API server about the VMs it
/// would free, by its name: the nodes do not all ask at once, and the
/// first one's delete spares the others the question.
const SPREAD: Duration = Duration::from_secs(2);

/// The API resource of VirtualMachines.
pub fn resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, VERSION, KIND), PLURAL)
}

/// The names of the VirtualMachines, as the watch last saw them.
#[derive(Default)]
pub struct VirtualMachines {
    /// (namespace, name).
    seen: Mutex<HashSet<(String, String)>>,
    /// Listed since the watch last started: a VM missing from `seen` may
    /// be gone (and is then asked for, before anything is freed).
    synced: AtomicBool,
    wake: Notify,
}

impl VirtualMachines {
    /// True once the VirtualMachines have been listed.
    pub fn listed(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    /// Whether the cache holds the VirtualMachine `namespace/name`.
    pub fn has(&self, namespace: &str, name: &str) -> bool {
        lock(&self.seen).contains(&(namespace.to_owned(), name.to_owned()))
    }
}

/// The namespace and name of an object.
fn name_of(meta: &kube::core::ObjectMeta) -> Option<(String, String)> {
    Some((meta.namespace.clone()?, meta.name.clone()?))
}

/// The records whose VM the cache does not hold, and which would be freed
/// with it: (record, its revision).
pub fn candidates(
    records: &[(VmRecord, i64)],
    has_vm: &dyn Fn(&VmKey) -> bool,
) -> Vec<(VmRecord, i64)> {
    records
        .iter()
        .filter(|(rec, _)| freed_with_its_vm(rec) && !has_vm(&rec.key))
        .cloned()
        .collect()
}

/// Starts the VirtualMachines watch (once KubeVirt's API is served) and
/// the pass that frees the records of deleted VMs; returns the cache.
pub fn start(client: kube::Client, vms: Arc<Vms>) -> Arc<VirtualMachines> {
    let cache = Arc::new(VirtualMachines::default());
    {
        let cache = cache.clone();
        let client = client.clone();
        tokio::spawn(async move {
            loop {
                wait_served(&client).await;
                watch(&client, &cache).await;
                cache.synced.store(false, Ordering::Release);
            }
        });
    }
    {
        let cache = cache.clone();
        tokio::spawn(async move {
            let mut records = vms.records().subscribe();
            loop {
                tokio::select! {
                    () = cache.wake.notified() => {}
                    r = records.changed() => if r.is_err() { return },
                    () = tokio::time::sleep(RESYNC) => {}
                }
                // Let a burst of changes settle into one pass.
                tokio::time::sleep(Duration::from_millis(20)).await;
                if cache.listed() {
                    free_pass(&client, &vms, &cache).await;
                }
            }
        });
    }
    cache
}

/// Returns once `kubevirt.io/v1` serves VirtualMachines; asks every
/// [`LOOK_AGAIN`] until then.
async fn wait_served(client: &kube::Client) {
    let mut said = false;
    loop {
        let gv = format!("{GROUP}/{VERSION}");
        match super::bounded(client.list_api_group_resources(&gv)).await {
            Ok(list) if list.resources.iter().any(|r| r.name == PLURAL) => {
                tracing::info!("KubeVirt's VirtualMachines are served: a deleted VM's addresses are freed once no pod of it is left");
                return;
            }
            Ok(_) | Err(_) if !said => {
                tracing::info!("no KubeVirt API ({gv} {PLURAL}) on this cluster: VM addresses are freed by ReleaseVm, IPAMClaims or vmAddressPolicy ephemeral only; asked again every {LOOK_AGAIN:?}");
                said = true;
            }
            Ok(_) | Err(_) => {}
        }
        tokio::time::sleep(LOOK_AGAIN).await;
    }
}

/// Watches the VirtualMachines' names into `cache` until the server says
/// the resource is gone (404: KubeVirt removed).
async fn watch(client: &kube::Client, cache: &VirtualMachines) {
    let api: Api<PartialObjectMeta<DynamicObject>> = Api::all_with(client.clone(), &resource());
    let mut stream = watcher(api, watcher::Config::default())
        .backoff(super::WatchBackoff::default())
        .boxed();
    let mut failing = false;
    // A (re)list in progress: it replaces the cache when it is done, so
    // that a VM deleted while the watch was down (which no Delete event
    // reports) leaves the cache too.
    let mut relist: Option<HashSet<(String, String)>> = None;
    while let Some(item) = stream.next().await {
        match item {
            Ok(Event::Init) => relist = Some(HashSet::new()),
            Ok(Event::InitApply(o)) => {
                if let Some(n) = name_of(&o.metadata) {
                    match relist.as_mut() {
                        Some(r) => {
                            r.insert(n);
                        }
                        None => {
                            lock(&cache.seen).insert(n);
                        }
                    }
                }
            }
            Ok(Event::Apply(o)) => {
                if let Some(n) = name_of(&o.metadata) {
                    lock(&cache.seen).insert(n);
                }
            }
            Ok(Event::Delete(o)) => {
                if let Some(n) = name_of(&o.metadata) {
                    lock(&cache.seen).remove(&n);
                }
            }
            Ok(Event::InitDone) => {
                if let Some(r) = relist.take() {
                    *lock(&cache.seen) = r;
                }
                cache.synced.store(true, Ordering::Release);
                if failing {
                    tracing::info!("the VirtualMachines watch is back");
                }
                failing = false;
            }
            Err(e) => {
                super::note_gone("VirtualMachines", &e);
                if not_served(&e) {
                    tracing::warn!("KubeVirt's VirtualMachines are no longer served: no VM is freed by its deletion until they are again");
                    return;
                }
                if !failing {
                    tracing::warn!(error = %e, "the VirtualMachines watch failed; retrying with backoff (CNI calls are not affected)");
                }
                failing = true;
                continue;
            }
        }
        cache.wake.notify_one();
    }
}

/// Whether a watch error is the server's 404 for the resource.
fn not_served(e: &watcher::Error) -> bool {
    use watcher::Error as W;
    matches!(
        e,
        W::InitialListFailed(kube::Error::Api(s)) | W::WatchStartFailed(kube::Error::Api(s))
            if s.code == 404
    )
}

/// The records of the view, each with its mod revision, as owned values.
fn owned_records(vms: &Vms) -> Vec<(VmRecord, i64)> {
    vms.records()
        .view()
        .records
        .values()
        .map(|(r, rev)| (VmRecord::clone(r), *rev))
        .collect()
}
/// One pass: frees the record of every VM the cache does not hold, once
/// the API server confirms its VirtualMachine is gone.
async fn free_pass(client: &kube::Client, vms: &Vms, cache: &VirtualMachines) {
    let records = owned_records(vms);
    let has = |k: &VmKey| cache.has(&k.namespace, &k.vm);
    if candidates(&records, &has).is_empty() {
        return;
    }
    tokio::time::sleep(spread(vms.node_name())).await;
    // Again, after the wait: another node may have freed them meanwhile.
    let records = owned_records(vms);
    let mut asked: BTreeSet<(String, String)> = BTreeSet::new();
    let mut gone: BTreeSet<(String, String)> = BTreeSet::new();
    for (rec, rev) in candidates(&records, &has) {
        let vm = (rec.key.namespace.clone(), rec.key.vm.clone());
        if asked.insert(vm.clone()) && confirmed_gone(client, &vm.0, &vm.1).await {
            gone.insert(vm.clone());
        }
        if !gone.contains(&vm) {
            continue;
        }
        match vms.release_deleted_vm(&rec, rev).await {
            Ok(true) => {
                tracing::info!(vm = %rec.key, ips = ?rec.ips, mac = %rec.mac, "VirtualMachine deleted: its addresses are freed")
            }
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(vm = %rec.key, error = %e, "cannot free a deleted VirtualMachine's addresses; tried again at the next pass")
            }
        }
    }
}

/// Whether the API server lists no VirtualMachine `namespace/name` (and
/// serves the resource: a 404 is no answer).
async fn confirmed_gone(client: &kube::Client, namespace: &str, name: &str) -> bool {
    let api: Api<PartialObjectMeta<DynamicObject>> =
        Api::namespaced_with(client.clone(), namespace, &resource());
    let params = ListParams::default().fields(&format!("metadata.name={name}"));
    match super::bounded(api.list(&params)).await {
        Ok(list) => list.items.is_empty(),
        Err(e) => {
            tracing::debug!(namespace, vm = name, error = %e, "cannot tell whether a VirtualMachine is gone; nothing freed");
            false
        }
    }
}

/// This node's wait before asking, below [`SPREAD`], from its name.
fn spread(node: &str) -> Duration {
    let h = node.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let ms = u64::try_from(SPREAD.as_millis()).unwrap_or(2000);
    Duration::from_millis(h % ms.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::{Origin, VmAttachment};
    use tether_base::mac::Mac;
    use tether_base::time::UnixMillis;

    fn rec(vm: &str, origin: Origin, generation: u64, with_pod: bool) -> (VmRecord, i64) {
        let active = with_pod.then(|| VmAttachment {
            node: "n1".into(),
            network: "tether".into(),
            container_id: "c1".into(),
            ifname: "eth0".into(),
            pod_name: Some(format!("virt-launcher-{vm}-a")),
            pod_uid: None,
            since_unix_ms: UnixMillis::now(),
        });
        (
            VmRecord {
                key: VmKey::new("ns", vm, "eth0").unwrap(),
                ips: vec!["10.244.1.5".parse().unwrap()],
                mac: "0a:58:0a:f4:01:05".parse::<Mac>().unwrap(),
                origin,
                active,
                alternate: None,
                generation,
                created_unix_ms: UnixMillis::now(),
                last_cutover: None,
            },
            7,
        )
    }

    fn names(c: &[(VmRecord, i64)]) -> Vec<&str> {
        c.iter().map(|(r, _)| r.key.vm.as_str()).collect()
    }

    #[test]
    fn a_vm_whose_virtual_machine_is_gone_and_whose_pods_are_gone_is_a_candidate() {
        let records = vec![rec("gone", Origin::Allocated, 3, false)];
        assert_eq!(names(&candidates(&records, &|_| false)), ["gone"]);
        // Its VirtualMachine is there: a stopped VM keeps its addresses.
        assert!(candidates(&records, &|_| true).is_empty());
    }

    #[test]
    fn a_vm_deleted_while_a_pod_runs_keeps_its_addresses_until_its_last_pod_is_gone() {
        let records = vec![rec("running", Origin::Allocated, 2, true)];
        assert!(candidates(&records, &|_| false).is_empty());
    }

    #[test]
    fn a_reservation_no_pod_has_used_waits_for_its_vm_and_a_used_one_goes_with_it() {
        let unused = rec("imported", Origin::Reserved, 1, false);
        assert!(candidates(&[unused], &|_| false).is_empty());
        let used = rec("imported", Origin::Reserved, 3, false);
        assert_eq!(names(&candidates(&[used], &|_| false)), ["imported"]);
    }

    #[test]
    fn a_record_keyed_by_its_ipamclaim_goes_with_the_claim_not_the_vm() {
        let (mut claimed, rev) = rec("x", Origin::Allocated, 3, false);
        claimed.key = VmKey::claim("ns", "vm1.default").unwrap();
        assert!(candidates(&[(claimed, rev)], &|_| false).is_empty());
    }

    #[test]
    fn the_cache_is_asked_by_the_records_namespace_and_vm() {
        let records = vec![
            rec("a", Origin::Allocated, 3, false),
            rec("b", Origin::Allocated, 3, false),
        ];
        let has = |k: &VmKey| k.namespace == "ns" && k.vm == "a";
        assert_eq!(names(&candidates(&records, &has)), ["b"]);
    }

    #[test]
    fn nodes_wait_different_times_below_the_spread() {
        let waits: BTreeSet<Duration> = ["node-a", "node-b", "node-c", "node-d"]
            .iter()
            .map(|n| spread(n))
            .collect();
        assert!(waits.len() > 1, "{waits:?}");
        assert!(waits.iter().all(|w| *w < SPREAD), "{waits:?}");
        assert_eq!(spread("node-a"), spread("node-a"));
    }
}
