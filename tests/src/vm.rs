//! KubeVirt VM pods for the migration suites: a virt-launcher pod is a pod
//! whose ADD carries the annotations KubeVirt puts on it (through
//! `runtimeConfig`, capability `io.kubernetes.cri.pod-annotations`) and
//! the Kubernetes CNI_ARGS; a migration's target carries
//! `kubevirt.io/migrationJobName` too. Plus the admin calls on VM records.

use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};

use crate::admin::{pb, with_client};
use crate::cluster::{ClusterNode, Pod};
use crate::cni::CniOutput;
use crate::kube::KubeApi;
use crate::netns::Netns;
use crate::qemu::{Client, Guest, GuestOptions};

/// What a virt-launcher pod's ADD says about itself.
#[derive(Debug, Clone)]
pub struct VmPodSpec {
    /// K8S_POD_NAMESPACE.
    pub namespace: String,
    /// The VM (`kubevirt.io/domain`).
    pub vm: String,
    /// K8S_POD_NAME (`virt-launcher-<vm>-<suffix>`).
    pub pod_name: String,
    /// A migration's target (`kubevirt.io/migrationJobName` set).
    pub target: bool,
    /// `kubevirt.io/migration-target-ready-timestamp` set.
    pub ready: bool,
    /// Extra CNI_ARGS pairs (e.g. `IP=...`), `;`-joined after the K8S ones.
    pub extra_args: Vec<String>,
    /// Extra netconf keys (e.g. `vmAddressPolicy`).
    pub extra_conf: Vec<(String, Value)>,
    /// K8S_POD_UID (default `uid-<pod name>`): the API's, when the pod
    /// exists there.
    pub uid: Option<String>,
    /// The IPAMClaim named in the pod's primary network-selection element
    /// (`v1.multus-cni.io/default-network`, `ipam-claim-reference`), as
    /// KubeVirt's ipam-extensions webhook writes it.
    pub claim: Option<String>,
}

impl VmPodSpec {
    /// The VM's first (or a restarted) pod.
    pub fn new(namespace: &str, vm: &str, pod_name: &str) -> VmPodSpec {
        VmPodSpec {
            namespace: namespace.into(),
            vm: vm.into(),
            pod_name: pod_name.into(),
            target: false,
            ready: false,
            extra_args: Vec::new(),
            extra_conf: Vec::new(),
            uid: None,
            claim: None,
        }
    }

    /// A pod of the `tap` binding (`kubevirt.binding: tap` in the netconf),
    /// whose guest runs in QEMU on the tap tether makes ([`boot_guest`]).
    pub fn tap(namespace: &str, vm: &str, pod_name: &str) -> VmPodSpec {
        let mut s = VmPodSpec::new(namespace, vm, pod_name);
        s.extra_conf = vec![("kubevirt".into(), json!({"binding": "tap"}))];
        s
    }

    /// The same VM's migration target pod.
    pub fn target(&self, pod_name: &str) -> VmPodSpec {
        VmPodSpec {
            pod_name: pod_name.into(),
            target: true,
            ..self.clone()
        }
    }

    /// The netconf of `node` with this pod's annotations.
    pub fn netconf(&self, node: &ClusterNode) -> Value {
        let mut conf = node.netconf();
        conf["runtimeConfig"] = json!({ "io.kubernetes.cri.pod-annotations": self.annotations() });
        for (k, v) in &self.extra_conf {
            conf[k.as_str()] = v.clone();
        }
        conf
    }

    /// The pod's annotations as containerd passes them
    /// (`io.kubernetes.cri.pod-annotations`).
    pub fn annotations(&self) -> Value {
        let mut annotations = json!({
            "kubevirt.io/domain": self.vm,
            "kubevirt.io/migrationTransportUnix": "true",
            "vm.kubevirt.io/name": "not-a-key-hostname",
        });
        if self.target {
            annotations["kubevirt.io/migrationJobName"] = json!(format!("{}-migration", self.vm));
        }
        if self.ready {
            annotations["kubevirt.io/migration-target-ready-timestamp"] =
                json!("2026-11-21T12:00:00Z");
        }
        if let Some(claim) = &self.claim {
            annotations["v1.multus-cni.io/default-network"] = json!(json!([{
                "name": crate::cluster::CLUSTER_NETWORK,
                "namespace": "kube-system",
                "ipam-claim-reference": claim,
            }])
            .to_string());
        }
        annotations
    }

    /// The labels virt-launcher gives its pods (a migration's target has
    /// its job's too): NetworkPolicies select VM pods by them.
    pub fn labels(&self) -> Value {
        let mut labels = json!({"kubevirt.io": "virt-launcher", "vm.kubevirt.io/name": self.vm});
        if self.target {
            labels["kubevirt.io/migrationJobUID"] = json!("job-uid-1");
        }
        labels
    }

    /// Makes `pod` (a pod manifest) this VM's launcher as virt-controller
    /// makes one: its labels and annotations, and controlled by the VM's
    /// VirtualMachineInstance, made first if there is none yet
    /// ([`virtual_machine_instance`]). tetherd (`--check-vm-launchers`)
    /// gives the VM's addresses only to such a pod.
    pub fn launcher(&self, api: &KubeApi, mut pod: Value) -> Value {
        let uid = virtual_machine_instance(api, &self.namespace, &self.vm);
        let meta = &mut pod["metadata"];
        meta["namespace"] = json!(self.namespace);
        meta["labels"] = self.labels();
        meta["annotations"] = self.annotations();
        meta["ownerReferences"] = json!([{
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "name": self.vm, "uid": uid, "controller": true, "blockOwnerDeletion": true,
        }]);
        pod
    }

    /// CNI_ARGS as containerd sends them, plus the extras.
    pub fn args(&self, container_id: &str) -> String {
        let uid = self
            .uid
            .clone()
            .unwrap_or_else(|| format!("uid-{}", self.pod_name));
        let mut args = format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={};K8S_POD_INFRA_CONTAINER_ID={container_id};K8S_POD_UID={uid}",
            self.namespace, self.pod_name
        );
        for extra in &self.extra_args {
            args.push(';');
            args.push_str(extra);
        }
        args
    }
}

/// The MAC KubeVirt gives a domain on the primary network: the pod
/// interface's (`eth0`).
pub fn pod_interface_mac(pod: &Pod) -> String {
    let out = pod.netns().exec(&["cat", "/sys/class/net/eth0/address"]);
    assert!(out.status.success(), "no eth0 in the pod");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A QEMU guest on a `tap`-binding pod's `tap0`, with the pod interface's
/// MAC (as KubeVirt gives it), leasing IPv4 with udhcpc and IPv6 with
/// dhcpcd; a migration's target (`incoming`) listens on
/// `migration.sock` instead of booting.
pub fn boot_guest(pod: &Pod, incoming: bool) -> Guest {
    let mut opts = GuestOptions::new("tap0", &pod_interface_mac(pod));
    opts.dhcp6 = Client::Dhcpcd;
    if incoming {
        opts.incoming = Some("migration.sock".into());
    }
    Guest::start(pod.netns(), opts)
}

/// ADD of a VM pod in a new netns on `node`; the output as it is, and the
/// netns (deleted on drop) with its container id.
pub fn try_add_vm_pod(node: &ClusterNode, spec: &VmPodSpec) -> (CniOutput, Netns, String) {
    let netns = Netns::new("vm");
    let id = netns.name().to_owned();
    let out = node.call_with(
        "ADD",
        &netns,
        &id,
        &spec.netconf(node),
        Some(&spec.args(&id)),
    );
    (out, netns, id)
}

/// ADD of a VM pod on `node`; panics unless it succeeds.
pub fn add_vm_pod(node: &ClusterNode, spec: &VmPodSpec) -> Pod {
    let (out, netns, id) = try_add_vm_pod(node, spec);
    assert!(
        out.success(),
        "ADD of VM pod {} on {} failed: {out}",
        spec.pod_name,
        node.name()
    );
    Pod::from_output(netns, id, node.name(), &out)
}

/// DEL of a VM pod on `node` (its netns stays).
pub fn del_vm_pod(node: &ClusterNode, spec: &VmPodSpec, pod: &Pod) -> CniOutput {
    node.call_with(
        "DEL",
        pod.netns(),
        pod.id(),
        &spec.netconf(node),
        Some(&spec.args(pod.id())),
    )
}

/// The MAC of a pod's interface as its ADD result reports it.
pub fn result_mac(pod: &Pod) -> String {
    pod.result()["interfaces"]
        .as_array()
        .and_then(|ifs| ifs.iter().find(|i| i["sandbox"].is_string()))
        .and_then(|i| i["mac"].as_str())
        .unwrap_or_else(|| panic!("no pod interface MAC in {}", pod.result()))
        .to_owned()
}

/// "0a:58:..." as bytes.
pub fn mac_bytes(mac: &str) -> [u8; 6] {
    let mut out = [0u8; 6];
    for (b, part) in out.iter_mut().zip(mac.split(':')) {
        *b = u8::from_str_radix(part, 16).unwrap_or_else(|_| panic!("bad MAC {mac}"));
    }
    out
}

/// A VM interface reference (interface eth0).
pub fn vm_ref(namespace: &str, vm: &str) -> pb::VmRef {
    pb::VmRef {
        namespace: namespace.into(),
        vm: vm.into(),
        interface: "eth0".into(),
    }
}

/// GetVm of the record an IPAMClaim holds (interface `:ipamclaim`).
pub fn get_claimed_vm(
    socket: &Path,
    namespace: &str,
    claim: &str,
) -> Result<pb::Vm, tonic::Status> {
    let r = pb::VmRef {
        namespace: namespace.into(),
        vm: claim.into(),
        interface: ":ipamclaim".into(),
    };
    with_client(socket, |mut c| async move {
        c.get_vm(r).await.map(tonic::Response::into_inner)
    })
}

/// GetVm on the daemon at `socket`: the record, or the status.
pub fn get_vm(socket: &Path, namespace: &str, vm: &str) -> Result<pb::Vm, tonic::Status> {
    let r = vm_ref(namespace, vm);
    with_client(socket, |mut c| async move {
        c.get_vm(r).await.map(tonic::Response::into_inner)
    })
}

/// Cutover on the daemon at `socket`.
pub fn cutover(socket: &Path, namespace: &str, vm: &str) -> Result<pb::Vm, tonic::Status> {
    let r = vm_ref(namespace, vm);
    with_client(socket, |mut c| async move {
        c.cutover(r).await.map(tonic::Response::into_inner)
    })
}

/// ReleaseVm on the daemon at `socket`.
pub fn release_vm(
    socket: &Path,
    namespace: &str,
    vm: &str,
    force: bool,
) -> Result<pb::Vm, tonic::Status> {
    let req = pb::ReleaseVmRequest {
        vm: Some(vm_ref(namespace, vm)),
        force,
    };
    with_client(socket, |mut c| async move {
        c.release_vm(req).await.map(tonic::Response::into_inner)
    })
}

/// ReserveVmAddress on the daemon at `socket`.
pub fn reserve_vm(
    socket: &Path,
    namespace: &str,
    vm: &str,
    ips: &[IpAddr],
    mac: &str,
) -> Result<pb::Vm, tonic::Status> {
    let req = pb::ReserveVmAddressRequest {
        vm: Some(vm_ref(namespace, vm)),
        ips: ips.iter().map(|ip| ip.to_string()).collect(),
        mac: mac.into(),
    };
    with_client(socket, |mut c| async move {
        c.reserve_vm_address(req)
            .await
            .map(tonic::Response::into_inner)
    })
}

/// The node of a record's active pod ("" when none).
pub fn active_node(vm: &pb::Vm) -> &str {
    vm.active.as_ref().map_or("", |p| p.node.as_str())
}

/// The node of a record's alternate pod ("" when none).
pub fn alternate_node(vm: &pb::Vm) -> &str {
    vm.alternate.as_ref().map_or("", |p| p.node.as_str())
}

/// Installs a test double of KubeVirt's CRD of `kind` (`plural`) in
/// `kubevirt.io/v1`, namespaced, with no schema and no controller behind
/// it, and waits until discovery serves it. It proves what tetherd does
/// with such objects (reads them, through the chart's RBAC); not what
/// KubeVirt does with them (`make kubevirt` runs KubeVirt itself).
pub fn install_kubevirt_crd_double(api: &KubeApi, kind: &str, plural: &str) {
    let crd = format!("{plural}.kubevirt.io");
    api.apply(
        &json!({
            "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": crd},
            "spec": {
                "group": "kubevirt.io", "scope": "Namespaced",
                "names": {"kind": kind, "plural": plural,
                          "singular": kind.to_lowercase(), "listKind": format!("{kind}List")},
                "versions": [{"name": "v1", "served": true, "storage": true,
                              "schema": {"openAPIV3Schema": {"type": "object",
                                         "x-kubernetes-preserve-unknown-fields": true}}}],
            },
        })
        .to_string(),
    );
    api.kubectl_ok(&[
        "wait",
        "--for=condition=Established",
        "--timeout=30s",
        &format!("crd/{crd}"),
    ]);
    // Established is not yet served by discovery.
    let discovered = crate::wait_until(Duration::from_secs(30), || {
        let out = api.kubectl(&["get", "--raw", "/apis/kubevirt.io/v1"]);
        String::from_utf8_lossy(&out.stdout).contains(&format!("\"{plural}\""))
    });
    assert!(discovered, "discovery never served kubevirt.io/v1 {plural}");
}

/// The uid of VirtualMachineInstance `namespace/name`, made (with the
/// CRD's test double, [`install_kubevirt_crd_double`], when the cluster
/// has none) if it is not there: the owner of the VM's launcher pods. No
/// controller runs it; it stands for the instance virt-controller makes.
pub fn virtual_machine_instance(api: &KubeApi, namespace: &str, name: &str) -> String {
    let get = || {
        let out = api.kubectl(&[
            "-n",
            namespace,
            "get",
            "virtualmachineinstances.kubevirt.io",
            name,
            "-o",
            "jsonpath={.metadata.uid}",
        ]);
        let uid = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        (out.status.success() && !uid.is_empty()).then_some(uid)
    };
    if let Some(uid) = get() {
        return uid;
    }
    let served = api
        .kubectl(&["get", "--raw", "/apis/kubevirt.io/v1"])
        .stdout;
    if !String::from_utf8_lossy(&served).contains("\"virtualmachineinstances\"") {
        install_kubevirt_crd_double(api, "VirtualMachineInstance", "virtualmachineinstances");
    }
    api.apply(
        &json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"domain": {"devices": {}}},
        })
        .to_string(),
    );
    get().unwrap_or_else(|| panic!("VirtualMachineInstance {namespace}/{name} has no uid"))
}
