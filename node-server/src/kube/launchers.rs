//! A VM's launcher pods, checked through the API. A pod's ADD says it is
//! a VM's pod through its annotations (`kubevirt.io/domain`, an IPAMClaim
//! named in its network-selection element), which anyone who may make a
//! pod in the namespace can write. Before a pod takes a VM's addresses or
//! becomes its migration's target (whose cutover moves the VM's routes),
//! tetherd asks the API server whether the pod is that VM's own launcher:
//! - the pod `K8S_POD_NAMESPACE/K8S_POD_NAME` exists, with the
//!   `K8S_POD_UID` of the ADD when it gives one;
//! - its controller (the `ownerReferences` entry with `controller: true`)
//!   is a `kubevirt.io` VirtualMachineInstance named as the domain (owners
//!   are always in their dependent's namespace);
//! - that VirtualMachineInstance exists, with the uid the reference names
//!   (a reference to a deleted instance, or one made up, is no owner).
//!
//! KubeVirt's virt-controller makes every launcher pod so. A pod that
//! fails is refused (code 120) with what it lacks; an API server that does
//! not answer is a try-again (11), since nothing can be judged then. A
//! cluster without KubeVirt serves no VirtualMachineInstances, so no pod
//! there is a launcher: turn the check off (`--check-vm-launchers=false`)
//! where VM pods come from elsewhere.

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::Api;
use tether_base::error::{Error, Result};

use super::vms::{GROUP, VERSION};

/// KubeVirt's instance kind, a launcher pod's controller.
pub const VMI_KIND: &str = "VirtualMachineInstance";
/// Its resource (plural).
pub const VMI_PLURAL: &str = "virtualmachineinstances";

/// Who asks for a VM's addresses: the pod of an ADD.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claimant<'a> {
    /// K8S_POD_NAMESPACE.
    pub namespace: &'a str,
    /// K8S_POD_NAME.
    pub pod: &'a str,
    /// K8S_POD_UID, when the runtime gives it.
    pub uid: Option<&'a str>,
    /// The VM it says it belongs to (`kubevirt.io/domain`: the
    /// VirtualMachineInstance's name).
    pub vm: &'a str,
}

impl Claimant<'_> {
    fn describe(&self) -> String {
        format!(
            "pod {}/{} (kubevirt.io/domain {})",
            self.namespace, self.pod, self.vm
        )
    }
}

/// Says whether a pod is its VM's launcher.
pub trait Launchers: Send + Sync {
    /// `Ok` when `who` is the launcher of its VM, as the API shows it.
    fn verify<'a>(&'a self, who: &'a Claimant<'a>) -> BoxFuture<'a, Result<()>>;
}

/// The check against the API server.
pub struct ApiLaunchers(pub kube::Client);

fn vmi_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, VERSION, VMI_KIND), VMI_PLURAL)
}

impl Launchers for ApiLaunchers {
    fn verify<'a>(&'a self, who: &'a Claimant<'a>) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let pods: Api<Pod> = Api::namespaced(self.0.clone(), who.namespace);
            let pod = super::bounded(pods.get_metadata_opt(who.pod))
                .await
                .map_err(|e| {
                    Error::TryAgain(format!(
                        "cannot read {} to check it is its VM's launcher: {e}",
                        who.describe()
                    ))
                })?;
            let owner = controller_of(who, pod.as_ref().map(|p| &p.metadata))?;
            let vmis: Api<DynamicObject> =
                Api::namespaced_with(self.0.clone(), who.namespace, &vmi_resource());
            let vmi = super::bounded(vmis.get_metadata_opt(&owner.name))
                .await
                .map_err(|e| {
                    Error::TryAgain(format!(
                        "cannot read VirtualMachineInstance {}/{} to check {}: {e}",
                        who.namespace,
                        owner.name,
                        who.describe()
                    ))
                })?;
            owner_exists(who, &owner, vmi.as_ref().map(|v| &v.metadata))
        })
    }
}

fn refused(who: &Claimant<'_>, why: String) -> Error {
    Error::NotLauncher(format!(
        "{} is not the launcher of VM {}/{}: {why}; only a pod that VirtualMachineInstance {}/{} controls (its ownerReferences) gets the VM's addresses or its migration",
        who.describe(),
        who.namespace,
        who.vm,
        who.namespace,
        who.vm
    ))
}

/// The pod's controlling owner, when it is the VirtualMachineInstance the
/// pod names; `pod` is the API's pod (`None`: there is none).
pub fn controller_of(who: &Claimant<'_>, pod: Option<&ObjectMeta>) -> Result<OwnerReference> {
    let Some(pod) = pod else {
        return Err(refused(who, "the API has no such pod".into()));
    };
    if let (Some(want), Some(have)) = (who.uid, pod.uid.as_deref()) {
        if want != have {
            return Err(refused(
                who,
                format!("the API's pod of that name has uid {have}, the ADD's pod {want}"),
            ));
        }
    }
    let owners = pod.owner_references.as_deref().unwrap_or_default();
    let Some(owner) = owners.iter().find(|o| o.controller == Some(true)) else {
        return Err(refused(who, "it has no controlling owner".into()));
    };
    let group = owner.api_version.split('/').next().unwrap_or_default();
    if group != GROUP || owner.kind != VMI_KIND || owner.name != who.vm {
        return Err(refused(
            who,
            format!(
                "its controller is {} {} ({})",
                owner.kind, owner.name, owner.api_version
            ),
        ));
    }
    Ok(owner.clone())
}

/// `Ok` when the instance `owner` names exists with its uid; `vmi` is the
/// API's (`None`: there is none).
pub fn owner_exists(
    who: &Claimant<'_>,
    owner: &OwnerReference,
    vmi: Option<&ObjectMeta>,
) -> Result<()> {
    match vmi.and_then(|m| m.uid.as_deref()) {
        None => Err(refused(
            who,
            format!(
                "its controller VirtualMachineInstance {} does not exist (or the cluster serves no {GROUP}/{VERSION} {VMI_PLURAL})",
                owner.name
            ),
        )),
        Some(uid) if uid != owner.uid => Err(refused(
            who,
            format!(
                "its ownerReference names VirtualMachineInstance {} with uid {}, but that instance's uid is {uid}",
                owner.name, owner.uid
            ),
        )),
        Some(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn who() -> Claimant<'static> {
        Claimant {
            namespace: "ns1",
            pod: "virt-launcher-vm1-abcde",
            uid: Some("pod-uid"),
            vm: "vm1",
        }
    }

    fn owner(kind: &str, name: &str, uid: &str, controller: bool) -> OwnerReference {
        OwnerReference {
            api_version: "kubevirt.io/v1".into(),
            kind: kind.into(),
            name: name.into(),
            uid: uid.into(),
            controller: Some(controller),
            block_owner_deletion: Some(true),
        }
    }

    fn pod(uid: &str, owners: Vec<OwnerReference>) -> ObjectMeta {
        ObjectMeta {
            uid: Some(uid.into()),
            owner_references: Some(owners),
            ..Default::default()
        }
    }

    fn vmi(uid: &str) -> ObjectMeta {
        ObjectMeta {
            uid: Some(uid.into()),
            ..Default::default()
        }
    }

    fn refusal(r: Result<impl std::fmt::Debug>) -> String {
        match r {
            Err(e @ Error::NotLauncher(_)) => e.to_string(),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn the_launcher_its_instance_controls_passes() {
        let p = pod("pod-uid", vec![owner(VMI_KIND, "vm1", "vmi-uid", true)]);
        let o = controller_of(&who(), Some(&p)).expect("its controller");
        assert_eq!(o.uid, "vmi-uid");
        owner_exists(&who(), &o, Some(&vmi("vmi-uid"))).expect("the instance exists");
    }

    #[test]
    fn a_look_alike_is_refused_with_what_it_lacks() {
        let w = who();
        assert!(refusal(controller_of(&w, None)).contains("the API has no such pod"));
        assert!(refusal(controller_of(&w, Some(&pod("pod-uid", vec![]))))
            .contains("it has no controlling owner"));
        // An owner that does not control it.
        let p = pod("pod-uid", vec![owner(VMI_KIND, "vm1", "vmi-uid", false)]);
        assert!(refusal(controller_of(&w, Some(&p))).contains("no controlling owner"));
        // Another VM's launcher, or another kind.
        let p = pod("pod-uid", vec![owner(VMI_KIND, "vm2", "vmi-uid", true)]);
        assert!(refusal(controller_of(&w, Some(&p)))
            .contains("its controller is VirtualMachineInstance vm2"));
        let mut o = owner("ReplicaSet", "vm1", "rs-uid", true);
        o.api_version = "apps/v1".into();
        assert!(refusal(controller_of(&w, Some(&pod("pod-uid", vec![o])))).contains("ReplicaSet"));
        // A pod of the same name made again.
        let p = pod("other-uid", vec![owner(VMI_KIND, "vm1", "vmi-uid", true)]);
        assert!(refusal(controller_of(&w, Some(&p))).contains("uid other-uid"));
    }

    #[test]
    fn an_owner_reference_to_no_instance_is_no_owner() {
        let w = who();
        let o = owner(VMI_KIND, "vm1", "made-up", true);
        let msg = refusal(owner_exists(&w, &o, None));
        assert!(msg.contains("does not exist"), "{msg}");
        let msg = refusal(owner_exists(&w, &o, Some(&vmi("vmi-uid"))));
        assert!(
            msg.contains("uid made-up") && msg.contains("uid is vmi-uid"),
            "{msg}"
        );
        assert!(msg.starts_with(
            "not the VM's launcher: pod ns1/virt-launcher-vm1-abcde (kubevirt.io/domain vm1) is not the launcher of VM ns1/vm1"
        ), "{msg}");
    }
}
