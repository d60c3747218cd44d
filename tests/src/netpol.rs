//! NetworkPolicy on the harness's clusters, where no kubelet runs: the
//! API objects a policy suite or benchmark needs (namespaces with their
//! default service account, pods that are API objects wired through the
//! real plugin, pods that are only API objects with addresses, policies),
//! made as a kubelet and a user would make them.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::cluster::{ClusterNode, Pod};
use crate::kube::KubeApi;
use crate::Netns;

/// Creates namespace `ns` with `labels`, and the default service account
/// pods need (no controller manager runs to make it).
pub fn namespace(api: &KubeApi, ns: &str, labels: Value) {
    api.apply(
        &json!({"apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": ns, "labels": labels}})
        .to_string(),
    );
    api.kubectl_ok(&["-n", ns, "create", "serviceaccount", "default"]);
}

/// The manifest of pod `ns/name` on node `node` with `labels`.
pub fn pod_manifest(ns: &str, name: &str, node: &str, labels: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"namespace": ns, "name": name, "labels": labels},
           "spec": {"nodeName": node, "automountServiceAccountToken": false,
                    "containers": [{"name": "c", "image": "busybox"}]}})
}

/// ADD of pod `ns/name` on `node` through the plugin, with its name in
/// CNI_ARGS (the pod must be in the API already), and how long the plugin
/// took; panics if it fails.
pub fn wire(node: &ClusterNode, ns: &str, name: &str) -> (Pod, Duration) {
    let netns = Netns::new("pod");
    let id = netns.name().to_owned();
    let args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE={ns};K8S_POD_NAME={name}");
    let conf = node.netconf();
    let started = Instant::now();
    let out = node.call_with("ADD", &netns, &id, &conf, Some(&args));
    let took = started.elapsed();
    assert!(
        out.success(),
        "ADD of {ns}/{name} on {}: {out}",
        node.name()
    );
    (Pod::from_output(netns, id, node.name(), &out), took)
}

/// The status a kubelet writes for a running pod with `ips`.
pub fn running_status(ips: &[String]) -> Value {
    let ips: Vec<Value> = ips.iter().map(|ip| json!({ "ip": ip })).collect();
    json!({"phase": "Running", "podIP": ips[0]["ip"], "podIPs": ips})
}

/// Writes `pod`'s addresses to the status of `ns/name`, as its kubelet
/// would.
pub fn report_running(api: &KubeApi, ns: &str, name: &str, pod: &Pod) {
    let ips: Vec<String> = pod.ips().iter().map(ToString::to_string).collect();
    let status = json!({ "status": running_status(&ips) });
    api.kubectl_ok(&[
        "-n",
        ns,
        "patch",
        "pod",
        name,
        "--subresource=status",
        "--type=merge",
        "-p",
        &status.to_string(),
    ]);
}

/// A pod `ns/name` labelled `app=<app>` in the API, on `node`, wired there
/// through the plugin, and its addresses then written to its status.
pub fn api_pod(api: &KubeApi, node: &ClusterNode, ns: &str, name: &str, app: &str) -> Pod {
    api.apply(&pod_manifest(ns, name, node.name(), json!({ "app": app })).to_string());
    let (pod, _) = wire(node, ns, name);
    report_running(api, ns, name, &pod);
    pod
}

/// Creates or replaces NetworkPolicy `ns/name` with `spec`.
pub fn apply_policy(api: &KubeApi, ns: &str, name: &str, spec: Value) {
    api.apply(&policy(ns, name, spec).to_string());
}

/// The manifest of NetworkPolicy `ns/name` with `spec`.
pub fn policy(ns: &str, name: &str, spec: Value) -> Value {
    json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
           "metadata": {"namespace": ns, "name": name}, "spec": spec})
}

/// A `v1` List of `items`, for one `kubectl apply` or `create`.
pub fn list(items: Vec<Value>) -> Value {
    json!({"apiVersion": "v1", "kind": "List", "items": items})
}
