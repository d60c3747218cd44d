//! The watch on this node's pods (field selector `spec.nodeName`), for two
//! KubeVirt signals that no CNI call carries:
//! - `kubevirt.io/migration-target-ready-timestamp` appearing on a
//!   migration's target pod, after its ADD: the VM runs there, cut over.
//!   This runs beside the RARP listener; whichever comes first wins the
//!   compare-and-swap, and the other finds nothing left to do.
//! - a promoted target pod going away (deleted, or failed) while its
//!   source pod still runs: the migration failed late, after the cutover,
//!   and no RARP will say so. The VM's traffic goes back to the source.
//!
//! kube's watcher relists on `410 Gone`, asks for bookmarks, and backs off
//! (exponentially, with jitter) while the API server is away; a relist
//! replays every pod, which is harmless, since every action here is a
//! compare-and-swap that checks the record first.

pub use crate::vm::signals::VmPodSeen;
use crate::vm::{
    NodeSide, Vms, DOMAIN_ANNOTATION, MIGRATION_JOB_ANNOTATION, TARGET_READY_ANNOTATION,
};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, watcher, Event};
use kube::runtime::WatchStreamExt;
use kube::Api;
use std::sync::Arc;

/// The label KubeVirt puts on a migration's target pod from its creation.
pub const MIGRATION_JOB_UID_LABEL: &str = "kubevirt.io/migrationJobUID";

/// The VM-pod view of a pod; `None` for a pod that is not a virt-launcher
/// pod (no `kubevirt.io/domain`).
pub fn vm_pod_seen(pod: &Pod, deleted: bool) -> Option<VmPodSeen> {
    let meta = &pod.metadata;
    let ann = meta.annotations.as_ref();
    let set = |k: &str| ann.and_then(|a| a.get(k)).is_some_and(|v| !v.is_empty());
    if !set(DOMAIN_ANNOTATION) {
        return None;
    }
    let label = meta
        .labels
        .as_ref()
        .and_then(|l| l.get(MIGRATION_JOB_UID_LABEL))
        .is_some_and(|v| !v.is_empty());
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    Some(VmPodSeen {
        namespace: meta.namespace.clone().unwrap_or_default(),
        name: meta.name.clone().unwrap_or_default(),
        uid: meta.uid.clone().unwrap_or_default(),
        target: label || set(MIGRATION_JOB_ANNOTATION),
        ready: set(TARGET_READY_ANNOTATION),
        gone: deleted
            || meta.deletion_timestamp.is_some()
            || matches!(phase, Some("Failed") | Some("Succeeded")),
    })
}

/// True when the pod runs and is not going away: a migration's source
/// that can take its VM's traffic back.
pub fn still_running(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none()
        && pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
}

/// Starts the watch. It runs as long as the daemon.
/// `vms` decides what a report means, on `side`, this node.
pub fn start<N: NodeSide + 'static>(client: kube::Client, vms: Arc<Vms>, side: Arc<N>) {
    let name = vms.node_name().to_owned();
    let api: Api<Pod> = Api::all(client.clone());
    let config = watcher::Config::default().fields(&format!("spec.nodeName={name}"));
    tokio::spawn(async move {
        let mut stream = watcher(api, config)
            .backoff(super::WatchBackoff::default())
            .boxed();
        let mut failing = false;
        while let Some(item) = stream.next().await {
            let (pod, deleted) = match item {
                Ok(Event::Apply(p)) | Ok(Event::InitApply(p)) => (p, false),
                Ok(Event::Delete(p)) => (p, true),
                Ok(Event::Init) => continue,
                Ok(Event::InitDone) => {
                    if failing {
                        tracing::info!("the watch on this node's pods is back");
                    }
                    failing = false;
                    tracing::debug!(node = %name, "listed this node's pods");
                    continue;
                }
                Err(e) => {
                    super::note_gone("pods of this node", &e);
                    if !failing {
                        tracing::warn!(error = %e, "the watch on this node's pods failed; retrying with backoff (CNI calls are not affected)");
                    }
                    failing = true;
                    continue;
                }
            };
            let Some(seen) = vm_pod_seen(&pod, deleted) else {
                continue;
            };
            handle(&client, &vms, side.as_ref(), &seen).await;
        }
    });
}

async fn handle<N: NodeSide>(client: &kube::Client, vms: &Vms, side: &N, seen: &VmPodSeen) {
    for revert in vms.vm_pod_seen(side, seen).await {
        // The source must still run to take the traffic back; the API
        // says whether it does (it may be on another node).
        let api: Api<Pod> = Api::namespaced(client.clone(), &seen.namespace);
        let alive = match super::bounded(api.get_opt(&revert.source_pod)).await {
            Ok(Some(p)) => still_running(&p),
            Ok(None) => false,
            Err(e) => {
                tracing::warn!(vm = %revert.vm, source = %revert.source_pod, error = %e, "cannot tell whether a failed migration's source still runs; the cutover stays");
                continue;
            }
        };
        if !alive {
            tracing::info!(vm = %revert.vm, target = %seen.name, source = %revert.source_pod, "a promoted target went away and its source does not run: nothing to revert");
            continue;
        }
        if let Err(e) = vms.revert_cutover(side, &revert).await {
            tracing::warn!(vm = %revert.vm, error = %e, "cannot give a failed migration's VM back to its source");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::PodStatus;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
    use std::collections::BTreeMap;

    fn pod(ann: &[(&str, &str)], labels: &[(&str, &str)], phase: &str) -> Pod {
        let map = |l: &[(&str, &str)]| {
            Some(
                l.iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect::<BTreeMap<_, _>>(),
            )
        };
        Pod {
            metadata: ObjectMeta {
                namespace: Some("ns".into()),
                name: Some("virt-launcher-vm1-abc".into()),
                uid: Some("u1".into()),
                annotations: map(ann),
                labels: map(labels),
                ..Default::default()
            },
            status: Some(PodStatus {
                phase: Some(phase.into()),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn only_virt_launcher_pods_are_seen() {
        assert!(vm_pod_seen(&pod(&[], &[], "Running"), false).is_none());
        let s = vm_pod_seen(&pod(&[(DOMAIN_ANNOTATION, "vm1")], &[], "Running"), false).unwrap();
        assert_eq!(
            s,
            VmPodSeen {
                namespace: "ns".into(),
                name: "virt-launcher-vm1-abc".into(),
                uid: "u1".into(),
                target: false,
                ready: false,
                gone: false
            }
        );
    }

    #[test]
    fn targets_by_label_or_annotation_and_readiness() {
        let t = vm_pod_seen(
            &pod(
                &[(DOMAIN_ANNOTATION, "vm1")],
                &[(MIGRATION_JOB_UID_LABEL, "m1")],
                "Running",
            ),
            false,
        )
        .unwrap();
        assert!(t.target && !t.ready);
        let t = vm_pod_seen(
            &pod(
                &[
                    (DOMAIN_ANNOTATION, "vm1"),
                    (MIGRATION_JOB_ANNOTATION, "job"),
                    (TARGET_READY_ANNOTATION, "2026-11-25T08:00:00Z"),
                ],
                &[],
                "Running",
            ),
            false,
        )
        .unwrap();
        assert!(t.target && t.ready && !t.gone);
    }

    #[test]
    fn terminating_failed_finished_or_deleted_pods_are_gone() {
        let ann = [(DOMAIN_ANNOTATION, "vm1")];
        assert!(vm_pod_seen(&pod(&ann, &[], "Failed"), false).unwrap().gone);
        assert!(
            vm_pod_seen(&pod(&ann, &[], "Succeeded"), false)
                .unwrap()
                .gone
        );
        assert!(vm_pod_seen(&pod(&ann, &[], "Running"), true).unwrap().gone);
        let mut p = pod(&ann, &[], "Running");
        assert!(still_running(&p));
        p.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::now()));
        assert!(vm_pod_seen(&p, false).unwrap().gone);
        assert!(!still_running(&p));
        assert!(!still_running(&pod(&ann, &[], "Pending")));
    }
}
