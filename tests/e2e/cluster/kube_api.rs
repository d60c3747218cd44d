//! tetherd against a real kube-apiserver (built from the k8s.io/kubernetes
//! module, TLS, RBAC on; see `tether_e2e::kube`), authenticating with a
//! token of the service account that the Helm chart's RBAC binds
//! (install/helm/tether/templates/rbac.yaml): a rule missing from the
//! install's ClusterRole fails these tests.
//!
//! - IPAMClaims: a claim made as KubeVirt's ipam-extensions makes it; its
//!   VM pod gets addresses and the claim's status is filled; the VM
//!   restarts on another node and keeps them; a claim with addresses
//!   seeds a new VM; deleting the claim, and only that, releases them.
//! - The migration-target watch: a cutover triggered only by the ready
//!   annotation arriving through the API (no RARP); a stale marker on the
//!   demoted source never steals the VM back; a migration that fails
//!   after its cutover is given back to its source.
//! - Events on pods; an API server outage (ADD and DEL go on, the watch
//!   resumes, nothing is done twice); `--pod-cidr-from-node`; what the
//!   service account may and may not do.
//! - KubeVirt's VirtualMachines: deleting one frees its VM's address for
//!   another pod, once no pod of it is left, and also when the deletion
//!   happened while the daemon was down (its watch never saw it).
//! - The plain manifests (install/manifests/): `kubectl apply -f` of each
//!   mode's file on this API server, which has neither the Prometheus
//!   Operator's nor Multus's CRDs; and install/uninstall.sh's decision,
//!   asked with a real service-account token: it removes tether's files
//!   when the DaemonSet is gone or being deleted, or the service account
//!   or its Role is, and leaves them when the DaemonSet is there or the
//!   API does not answer.

use std::net::IpAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tether_e2e::cluster::{Cluster, ClusterNode, Fabric, NodeOpts, Store};
use tether_e2e::kube::{KubeApi, API_PORT, TETHER_SA};
use tether_e2e::topology::Topology;
use tether_e2e::vm::{
    active_node, add_vm_pod, alternate_node, del_vm_pod, get_claimed_vm, get_vm,
    install_kubevirt_crd_double, try_add_vm_pod, VmPodSpec,
};
use tether_e2e::{admin, cni, pb, require_root, tether_bin, wait_until, CniEnv, Daemon, Netns};

use super::{claim, claimed_ips, create_claim, status_ips, NS};
use crate::harness::shared::node_cidr_daemon;

/// The API's changes reach the daemons through watches: allow for it.
const CONVERGE: Duration = Duration::from_secs(20);

/// A cluster of `nodes` nodes on `store` whose daemons use the API with
/// the install's service account (on the Kubernetes store, the same API
/// server is the store).
fn cluster_with_api(nodes: usize, store: Store) -> Cluster {
    let cluster = Topology::tetherd(nodes).store(store).with_api(true).start();
    create_namespace(cluster.kube_api());
    cluster
}

/// Creates [`NS`] with its default service account, which pods need (the
/// ServiceAccount admission plugin) and no controller-manager runs here to
/// make.
fn create_namespace(api: &KubeApi) {
    api.kubectl_ok(&["create", "namespace", NS]);
    api.kubectl_ok(&["-n", NS, "create", "serviceaccount", "default"]);
}

/// What `kubectl auth can-i <verb> <rest>` answers for tether's service
/// account: `yes` or `no`.
fn can_i(api: &KubeApi, verb: &str, rest: &[&str]) -> String {
    let sa = format!("--as=system:serviceaccount:{}:{}", TETHER_SA.0, TETHER_SA.1);
    let mut args = vec!["auth", "can-i", verb, &sa];
    args.extend(rest);
    let out = api.kubectl(&args);
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A node netns on `fabric` (host number `host`), its Node object with
/// `cidrs` (the first its `podCIDR`), and tetherd in it that takes them
/// from there with `kubeconfig`.
fn node_from_api(
    fabric: &Fabric,
    api: &KubeApi,
    host: u8,
    cidrs: &[&str],
    kubeconfig: &Path,
) -> Daemon {
    let node_ns = Netns::new("node");
    fabric.attach_host(&node_ns, host.into());
    api.apply(
        &json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": node_ns.name()},
            "spec": {"podCIDR": cidrs[0], "podCIDRs": cidrs},
        })
        .to_string(),
    );
    node_cidr_daemon(node_ns, kubeconfig, &[])
}

/// Creates a virt-launcher pod in the API, on `node`, as KubeVirt would
/// (labels, annotations; a target's markers), marks it Running (no kubelet
/// runs here), and returns the spec for its CNI calls, with the API's UID.
fn api_pod(api: &KubeApi, node: &str, spec: &VmPodSpec) -> VmPodSpec {
    let mut pod = launcher_manifest(node, spec);
    // The same labels and annotations as virt-launcher's and its CNI
    // calls'.
    pod["metadata"]["labels"] = spec.labels();
    pod["metadata"]["annotations"] = spec.annotations();
    running_pod(api, spec, pod)
}

/// A pod manifest of `spec` on `node`, without labels or annotations.
fn launcher_manifest(node: &str, spec: &VmPodSpec) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": spec.pod_name, "namespace": spec.namespace},
        "spec": {"nodeName": node, "automountServiceAccountToken": false,
                 "containers": [{"name": "compute", "image": "virt-launcher"}]},
    })
}

/// Creates `pod` (of `spec`), marks it Running, and returns the spec with
/// the API's UID.
fn running_pod(api: &KubeApi, spec: &VmPodSpec, pod: Value) -> VmPodSpec {
    api.apply(&pod.to_string());
    api.kubectl_ok(&[
        "-n",
        &spec.namespace,
        "patch",
        "pod",
        &spec.pod_name,
        "--subresource=status",
        "--type=merge",
        "-p",
        r#"{"status":{"phase":"Running"}}"#,
    ]);
    let uid = api
        .get(&["-n", &spec.namespace, "pod", &spec.pod_name])
        .expect("the pod just created")["metadata"]["uid"]
        .as_str()
        .expect("a uid")
        .to_owned();
    VmPodSpec {
        uid: Some(uid),
        ..spec.clone()
    }
}

/// Sets the target-ready annotation on a pod, as virt-handler does once
/// the target domain runs.
fn mark_ready(api: &KubeApi, pod: &str) {
    api.kubectl_ok(&[
        "-n",
        NS,
        "annotate",
        "pod",
        pod,
        "--overwrite",
        "kubevirt.io/migration-target-ready-timestamp=2026-11-25T08:00:00Z",
    ]);
}

/// Changes a pod's labels, so that every watch on it sees an update.
fn touch(api: &KubeApi, pod: &str) {
    api.kubectl_ok(&["-n", NS, "label", "pod", pod, "--overwrite", "touched=yes"]);
}

/// Gives a pod's labels the `n`th value, so that every watch on it sees
/// an update.
fn touch_n(api: &KubeApi, pod: &str, n: usize) {
    api.kubectl_ok(&[
        "-n",
        NS,
        "label",
        "pod",
        pod,
        "--overwrite",
        &format!("touched={n}"),
    ]);
}

/// The ICMP echo requests `ns` has received (Icmp InEchos of its
/// /proc/net/snmp, which is per network namespace).
fn in_echos(ns: &Netns) -> u64 {
    let snmp = ns.exec_ok(&["cat", "/proc/net/snmp"]);
    let mut icmp = snmp.lines().filter(|l| l.starts_with("Icmp:"));
    let (names, values) = (icmp.next(), icmp.next());
    let (Some(names), Some(values)) = (names, values) else {
        panic!("no Icmp lines in /proc/net/snmp: {snmp}");
    };
    let at = names
        .split_whitespace()
        .position(|n| n == "InEchos")
        .expect("an InEchos column");
    values
        .split_whitespace()
        .nth(at)
        .and_then(|v| v.parse().ok())
        .expect("an InEchos value")
}

/// iputils ping from `ns` to `ip` every 0.4 ms (2.5 kHz), for at most
/// `limit`, in the background.
fn ping_in_background(ns: &Netns, ip: IpAddr, limit: Duration) -> std::process::Child {
    std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            ns.name(),
            "ping",
            "-q",
            "-n",
            "-i",
            "0.0004",
            "-w",
        ])
        .arg(limit.as_secs().to_string())
        .arg(ip.to_string())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("ping")
}

/// Stops a background ping (SIGINT, so that it prints its summary) and
/// returns how many echo requests it sent and how many replies came.
fn stop_pinger(child: std::process::Child) -> (u64, u64) {
    let _ = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status();
    let out = child.wait_with_output().expect("ping's output");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.contains("packets transmitted"))
        .unwrap_or_else(|| {
            panic!(
                "no summary from ping: {text} {}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    let count = |word: &str| -> u64 {
        line.split(',')
            .find(|p| p.contains(word))
            .and_then(|p| p.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no '{word}' in ping's summary: {line}"))
    };
    (count("transmitted"), count("received"))
}

/// Waits until the claim's status has `ips`, owner `owner` and the True
/// condition; panics with the claim as it is otherwise.
fn wait_claim_filled(api: &KubeApi, name: &str, ips: &[IpAddr], owner: &str) {
    let want: Vec<String> = status_ips(ips);
    let mut last = Value::Null;
    let ok = wait_until(CONVERGE, || {
        last = claim(api, name).unwrap_or(Value::Null);
        let st = &last["status"];
        let got = claimed_ips(&last);
        let cond = st["conditions"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["type"] == "IPsAllocated").cloned())
            .unwrap_or(Value::Null);
        got == want
            && st["ownerPod"]["name"] == owner
            && cond["status"] == "True"
            && cond["reason"] == "SuccessfulAllocation"
            && cond["observedGeneration"].is_i64()
    });
    assert!(
        ok,
        "claim {name} not filled with {want:?} owned by {owner}: {last:#}"
    );
}

/// The events.k8s.io events on pod `pod` with `reason`.
fn events(api: &KubeApi, ns: &str, pod: &str, reason: &str) -> Vec<Value> {
    api.get(&["-n", ns, "events.v1.events.k8s.io"])
        .and_then(|l| l["items"].as_array().cloned())
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e["regarding"]["name"] == pod && e["reason"] == reason)
        .collect()
}

fn wait_event(api: &KubeApi, ns: &str, pod: &str, reason: &str) -> Value {
    let mut found = Vec::new();
    let ok = wait_until(CONVERGE, || {
        found = events(api, ns, pod, reason);
        !found.is_empty()
    });
    assert!(ok, "no {reason} event on pod {ns}/{pod}");
    let e = found.remove(0);
    assert_eq!(e["reportingController"], "tether.dev/tetherd", "{e:#}");
    e
}

fn socket(n: &ClusterNode) -> &Path {
    n.daemon().socket()
}

fn wait_active(n: &ClusterNode, claim: &str, node: &str, trigger: &str) -> pb::Vm {
    let mut last = None;
    let ok = wait_until(CONVERGE, || {
        last = get_claimed_vm(socket(n), NS, claim).ok();
        last.as_ref().is_some_and(|v| {
            active_node(v) == node
                && v.last_cutover
                    .as_ref()
                    .is_some_and(|c| c.trigger == trigger)
        })
    });
    assert!(
        ok,
        "VM {claim} not active on {node} by {trigger}: {last:#?}"
    );
    last.expect("checked")
}

/// Whether `n` routes `ip` to a local pod (protocol 201).
fn routes_locally(n: &ClusterNode, ip: IpAddr) -> bool {
    n.netns()
        .routes_with_protocol(201)
        .iter()
        .any(|r| r["dst"] == ip.to_string() || r["dst"] == format!("{ip}/32"))
}

tether_e2e::on_both_stores!(ipamclaims_and_the_migration_target_watch_against_a_real_api_server);

fn ipamclaims_and_the_migration_target_watch_against_a_real_api_server(store: Store) {
    require_root();
    let cluster = cluster_with_api(2, store);
    let api = cluster.kube_api();
    let (a, b) = (cluster.node(0), cluster.node(1));

    // 1. A claim made as KubeVirt makes it; the VM's first pod on A.
    create_claim(api, "vm1.default", "vm1");
    let mut first = VmPodSpec::new(NS, "vm1", "virt-launcher-vm1-aaaaa");
    first.claim = Some("vm1.default".into());
    let first = api_pod(api, a.name(), &first);
    let source = add_vm_pod(a, &first);
    let ips = source.ips().to_vec();
    let rec = get_claimed_vm(socket(a), NS, "vm1.default").expect("a record keyed by the claim");
    assert_eq!(rec.interface, ":ipamclaim");
    wait_claim_filled(api, "vm1.default", &ips, "virt-launcher-vm1-aaaaa");
    eprintln!("claim filled: {ips:?}");

    // 3. A migration to B cut over by the annotation alone: no RARP is
    // sent, and the target's ADD carries no ready marker.
    let t1 = api_pod(api, b.name(), &first.target("virt-launcher-vm1-bbbbb"));
    let target = add_vm_pod(b, &t1);
    assert_eq!(target.ips(), &ips[..]);
    let rec = get_claimed_vm(socket(b), NS, "vm1.default").expect("record");
    assert_eq!(
        active_node(&rec),
        a.name(),
        "cut over before the annotation"
    );
    let t0 = Instant::now();
    mark_ready(api, "virt-launcher-vm1-bbbbb");
    wait_active(b, "vm1.default", b.name(), "annotation");
    eprintln!("annotation to record on B: {:?}", t0.elapsed());
    assert!(wait_until(CONVERGE, || routes_locally(b, ips[0])
        && !routes_locally(a, ips[0])));
    wait_event(api, NS, "virt-launcher-vm1-bbbbb", "CutoverDone");
    wait_claim_filled(api, "vm1.default", &ips, "virt-launcher-vm1-bbbbb");

    // The source pod leaves (its DEL), as after a successful migration.
    del_vm_pod(a, &first, &source).assert_success();

    // A stale marker: migrate back to A; the old target on B (ready
    // marker and all) becomes the demoted source, and an update of that
    // pod must not steal the VM back.
    let t2 = api_pod(api, a.name(), &first.target("virt-launcher-vm1-ccccc"));
    let back = add_vm_pod(a, &t2);
    mark_ready(api, "virt-launcher-vm1-ccccc");
    wait_active(a, "vm1.default", a.name(), "annotation");
    assert!(wait_until(CONVERGE, || routes_locally(a, ips[0])
        && !routes_locally(b, ips[0])));
    // A pod on B pings the VM (now on A) at 2.5 kHz while the demoted pod
    // on B gets 20 updates; not one echo request may reach the demoted pod.
    let observer = b.add_pod();
    let echoes_before = in_echos(target.netns());
    let pinger = ping_in_background(observer.netns(), ips[0], Duration::from_secs(30));
    let pinging = Instant::now();
    for i in 0..20 {
        if i % 2 == 0 {
            touch_n(api, "virt-launcher-vm1-bbbbb", i);
        } else {
            api.kubectl_ok(&[
                "-n",
                NS,
                "annotate",
                "pod",
                "virt-launcher-vm1-bbbbb",
                "--overwrite",
                &format!("kubevirt.io/migration-target-ready-timestamp=2026-11-25T08:00:{i:02}Z"),
            ]);
        }
    }
    // The watch delivers the last update within a moment; the pinger
    // runs on past it.
    std::thread::sleep(Duration::from_secs(2));
    let (sent, received) = stop_pinger(pinger);
    let took = pinging.elapsed();
    let stolen = in_echos(target.netns()) - echoes_before;
    eprintln!(
        "stale marker: {sent} echo requests in {took:.1?} ({:.0}/s), {received} replies, {stolen} reached the demoted pod",
        sent as f64 / took.as_secs_f64()
    );
    assert!(
        sent as f64 >= 2_000.0 * took.as_secs_f64() * 0.9,
        "the pinger sent only {sent} echo requests in {took:?}"
    );
    assert!(
        received * 10 >= sent * 9,
        "the VM answered {received} of {sent}"
    );
    assert_eq!(stolen, 0, "echo requests reached the demoted pod on B");
    b.del(&observer).assert_success();
    let rec = get_claimed_vm(socket(a), NS, "vm1.default").expect("record");
    assert_eq!(
        active_node(&rec),
        a.name(),
        "a stale marker stole the VM back: {rec:#?}"
    );
    assert_eq!(
        rec.last_cutover.as_ref().map(|c| c.trigger.as_str()),
        Some("annotation")
    );
    del_vm_pod(b, &t1, &target).assert_success();

    // 4. A migration that fails after its cutover: the target on B is
    // promoted, then deleted while the source on A still runs. No RARP
    // and no DEL yet: the API's signal alone gives the VM back.
    let t3 = api_pod(api, b.name(), &first.target("virt-launcher-vm1-ddddd"));
    let late = add_vm_pod(b, &t3);
    mark_ready(api, "virt-launcher-vm1-ddddd");
    wait_active(b, "vm1.default", b.name(), "annotation");
    api.kubectl_ok(&[
        "-n",
        NS,
        "delete",
        "pod",
        "virt-launcher-vm1-ddddd",
        "--wait=false",
    ]);
    let rec = wait_active(a, "vm1.default", a.name(), "target-failed");
    assert_eq!(
        rec.active.as_ref().map(|p| p.pod_name.as_str()),
        Some("virt-launcher-vm1-ccccc")
    );
    assert!(wait_until(CONVERGE, || routes_locally(a, ips[0])
        && !routes_locally(b, ips[0])));
    wait_event(api, NS, "virt-launcher-vm1-ccccc", "CutoverReverted");
    // The failed target's DEL then frees nothing.
    del_vm_pod(b, &t3, &late).assert_success();
    let rec = get_claimed_vm(socket(a), NS, "vm1.default").expect("record");
    assert_eq!(rec.ips.len(), ips.len());

    // 2. The VM stops, and starts again on B: the claim's addresses.
    del_vm_pod(a, &t2, &back).assert_success();
    api.kubectl_ok(&["-n", NS, "delete", "pod", "--all", "--wait=false"]);
    let again = api_pod(api, b.name(), &{
        let mut s = VmPodSpec::new(NS, "vm1", "virt-launcher-vm1-eeeee");
        s.claim = Some("vm1.default".into());
        s
    });
    let restarted = add_vm_pod(b, &again);
    assert_eq!(
        restarted.ips(),
        &ips[..],
        "the restarted VM lost its addresses"
    );
    wait_claim_filled(api, "vm1.default", &ips, "virt-launcher-vm1-eeeee");

    // A claim that already holds addresses gives them to a new VM.
    create_claim(api, "vm2.default", "vm2");
    let seeded: Vec<IpAddr> = vec!["10.244.250.7".parse().unwrap()];
    api.kubectl_ok(&[
        "-n",
        NS,
        "patch",
        "ipamclaims.k8s.cni.cncf.io",
        "vm2.default",
        "--subresource=status",
        "--type=merge",
        "-p",
        &json!({"status": {"ips": status_ips(&seeded)}}).to_string(),
    ]);
    // The cache must have seen it before the pod comes.
    assert!(wait_until(CONVERGE, || claim(api, "vm2.default")
        .is_some_and(|c| c["status"]["ips"][0] == "10.244.250.7/32")));
    std::thread::sleep(Duration::from_secs(1));
    let mut vm2 = VmPodSpec::new(NS, "vm2", "virt-launcher-vm2-aaaaa");
    vm2.claim = Some("vm2.default".into());
    let vm2 = api_pod(api, a.name(), &vm2);
    let pod2 = add_vm_pod(a, &vm2);
    assert!(
        pod2.ips().contains(&seeded[0]),
        "the claim's address was not used: {:?}",
        pod2.ips()
    );
    wait_claim_filled(api, "vm2.default", pod2.ips(), "virt-launcher-vm2-aaaaa");

    // Deleting pods never releases a claim's addresses; deleting the claim
    // does, once no pod is left.
    del_vm_pod(b, &again, &restarted).assert_success();
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        get_claimed_vm(socket(a), NS, "vm1.default").is_ok(),
        "released without the claim's deletion"
    );
    api.kubectl_ok(&[
        "-n",
        NS,
        "patch",
        "ipamclaims.k8s.cni.cncf.io",
        "vm1.default",
        "--type=merge",
        "-p",
        r#"{"metadata":{"finalizers":null}}"#,
    ]);
    api.kubectl_ok(&[
        "-n",
        NS,
        "delete",
        "ipamclaims.k8s.cni.cncf.io",
        "vm1.default",
    ]);
    assert!(
        wait_until(CONVERGE, || get_claimed_vm(socket(a), NS, "vm1.default")
            .is_err_and(|s| s.code() == tonic::Code::NotFound)),
        "the deleted claim's record is still there"
    );
    // vm2's claim stays, and so does its record.
    assert!(get_claimed_vm(socket(b), NS, "vm2.default").is_ok());
    del_vm_pod(a, &vm2, &pod2).assert_success();
}

/// The IPv4 address of a pod's eth0 (without its prefix length).
fn pod_ipv4(pod: &Netns) -> String {
    pod.addrs_of("eth0")
        .into_iter()
        .find(|a| !a.contains(':'))
        .and_then(|a| a.split('/').next().map(str::to_owned))
        .expect("an IPv4 address on eth0")
}

/// The ADD/DEL environment of a pod on a plain daemon.
fn call(
    daemon: &Daemon,
    command: &str,
    pod: &Netns,
    spec: &VmPodSpec,
    vm: bool,
) -> tether_e2e::CniOutput {
    let mut conf = daemon.netconf("1.1.0", "tether-k8s");
    if vm {
        conf["runtimeConfig"] = json!({"io.kubernetes.cri.pod-annotations": spec.annotations()});
    }
    let mut env = CniEnv::new(command, pod.name(), pod);
    env.args = Some(spec.args(pod.name()));
    cni(
        &tether_bin(),
        &env,
        &serde_json::to_vec(&conf).expect("JSON"),
    )
}

#[cfg_attr(
    not(feature = "cluster-tests"),
    ignore = "cluster tier: root, etcd and kube-apiserver; `make test` runs it"
)]
#[test]
fn outage_pod_cidr_from_node_events_and_least_privilege() {
    require_root();
    let fabric = Fabric::new();
    let mut api = KubeApi::start(&fabric);
    api.install_tether();
    let kubeconfig = api.token_kubeconfig(TETHER_SA.0, TETHER_SA.1);
    create_namespace(&api);

    // 6. The node's pod CIDRs come from its Node object: a /29 and a /125.
    let daemon = node_from_api(
        &fabric,
        &api,
        21,
        &["10.250.3.0/29", "fd00:250:3::/125"],
        &kubeconfig,
    );
    let node_name = daemon.node_name().to_owned();
    assert!(
        daemon.log().contains("pod CIDRs from the Node object"),
        "{}",
        daemon.log()
    );
    let mut pods = Vec::new();
    let mut exhausted = None;
    for i in 0..10 {
        let ns = Netns::new("pod");
        let spec = VmPodSpec::new(NS, "none", &format!("web-{i}"));
        let out = call(&daemon, "ADD", &ns, &spec, false);
        if !out.success() {
            exhausted = Some((out, spec.pod_name.clone()));
            break;
        }
        let ip = out.result()["ips"][0]["address"]
            .as_str()
            .expect("an address")
            .to_owned();
        assert!(
            ip.starts_with("10.250.3."),
            "{ip} is not in the Node's pod CIDR"
        );
        pods.push((ns, spec));
    }
    // 7. The /29 runs out: code 100, and a PoolExhausted event on the pod.
    let (out, name) = exhausted.expect("a /29 ran out within 10 pods");
    assert_eq!(out.error_code(), Some(100), "{out}");
    let ev = wait_event(&api, NS, &name, "PoolExhausted");
    assert_eq!(ev["type"], "Warning");
    assert_eq!(ev["regarding"]["kind"], "Pod");
    eprintln!("{} pods fitted the /29; event: {}", pods.len(), ev["note"]);
    // A pod that asks for an address another pod holds: code 105, and an
    // AddressConflict event on it.
    let taken = pod_ipv4(&pods[0].0);
    let mut greedy = VmPodSpec::new(NS, "none", "greedy");
    greedy.extra_args = vec![format!("IP={taken}")];
    let greedy_ns = Netns::new("pod");
    let out = call(&daemon, "ADD", &greedy_ns, &greedy, false);
    assert_eq!(out.error_code(), Some(105), "{out}");
    let ev = wait_event(&api, NS, "greedy", "AddressConflict");
    assert!(
        ev["note"].as_str().is_some_and(|n| n.contains(&taken)),
        "{ev:#}"
    );

    // The service account can do what the code needs, and no more.
    for (verb, what, yes) in [
        ("watch", "pods", true),
        ("get", "nodes", true),
        ("watch", "nodes", true),
        ("patch", "ipamclaims.k8s.cni.cncf.io/status", true),
        ("create", "events.events.k8s.io", true),
        ("delete", "pods", false),
        ("update", "nodes", false),
        ("get", "secrets", false),
        ("update", "ipamclaims.k8s.cni.cncf.io", false),
        // NetworkPolicy (the chart's default): the policies and the
        // namespaces' labels, read, never written.
        ("watch", "networkpolicies.networking.k8s.io", true),
        ("list", "namespaces", true),
        ("create", "networkpolicies.networking.k8s.io", false),
        ("update", "namespaces", false),
        // Mode kubernetes (the chart's default): tether's records, each
        // kind with the verbs --store kubernetes calls and no other.
        ("watch", "tethernodes.tether.dev", true),
        ("update", "tethernodes.tether.dev", true),
        ("patch", "tethernodes.tether.dev", false),
        ("create", "tethernodeids.tether.dev", true),
        ("watch", "tethernodeids.tether.dev", false),
        ("create", "addressblocks.tether.dev", true),
        ("delete", "addressblocks.tether.dev", true),
        ("update", "addressblocks.tether.dev", false),
        ("create", "poolblocks.tether.dev", true),
        ("delete", "poolblocks.tether.dev", false),
        ("update", "vmaddresses.tether.dev", true),
        ("deletecollection", "vmaddresses.tether.dev", false),
        ("update", "vmaddressowners.tether.dev", true),
        ("watch", "vmaddressowners.tether.dev", false),
        (
            "create",
            "customresourcedefinitions.apiextensions.k8s.io",
            false,
        ),
    ] {
        let mut args = vec!["-A"];
        match what.split_once('/') {
            Some((resource, sub)) => {
                args.push(resource);
                args.push(if sub == "status" {
                    "--subresource=status"
                } else {
                    sub
                });
            }
            None => args.push(what),
        }
        let said = can_i(&api, verb, &args);
        assert_eq!(said == "yes", yes, "can-i {verb} {what}: {said}");
    }
    // The nodes' Leases: in tether's namespace only.
    for (verb, ns, yes) in [
        ("create", TETHER_SA.0, true),
        ("patch", TETHER_SA.0, true),
        ("delete", TETHER_SA.0, true),
        ("watch", TETHER_SA.0, true),
        ("create", NS, false),
        ("create", "kube-node-lease", false),
    ] {
        let said = can_i(&api, verb, &["-n", ns, "leases.coordination.k8s.io"]);
        assert_eq!(said == "yes", yes, "can-i {verb} leases in {ns}: {said}");
    }
    // The uninstall container's one read: tether's own DaemonSet, by name.
    for (verb, what, yes) in [
        ("get", "daemonsets.apps/tether", true),
        ("get", "daemonsets.apps/other", false),
        ("list", "daemonsets.apps", false),
        ("watch", "daemonsets.apps", false),
        ("delete", "daemonsets.apps/tether", false),
    ] {
        let said = can_i(&api, verb, &["-n", TETHER_SA.0, what]);
        assert_eq!(
            said == "yes",
            yes,
            "can-i {verb} {what} in {}: {said}",
            TETHER_SA.0
        );
    }
    assert_eq!(
        can_i(&api, "get", &["-n", NS, "daemonsets.apps/tether"]),
        "no",
        "only in its own namespace"
    );

    // 5. The API server goes away: ADD and DEL keep working. The VM's pods
    // exist in the API already (as a kubelet would have them); their CNI
    // calls come while it is away.
    let source = api_pod(
        &api,
        &node_name,
        &VmPodSpec::new(NS, "vm9", "virt-launcher-vm9-aaaaa"),
    );
    let target = api_pod(&api, &node_name, &source.target("virt-launcher-vm9-bbbbb"));
    let (free_ns, free_spec) = pods.pop().expect("at least one pod");
    call(&daemon, "DEL", &free_ns, &free_spec, false).assert_success();
    api.stop_apiserver();
    let source_ns = Netns::new("vm");
    let t = Instant::now();
    call(&daemon, "ADD", &source_ns, &source, true).assert_success();
    eprintln!("VM pod ADD while the API server is down: {:?}", t.elapsed());
    let (del_ns, del_spec) = pods.pop().expect("a second pod");
    let t = Instant::now();
    call(&daemon, "DEL", &del_ns, &del_spec, false).assert_success();
    eprintln!("DEL while the API server is down: {:?}", t.elapsed());
    // The migration's target, on the same node, added while it is away.
    let target_ns = Netns::new("vm");
    call(&daemon, "ADD", &target_ns, &target, true).assert_success();
    std::thread::sleep(Duration::from_secs(2));

    // It comes back; the target's marker arrives, and the resumed watch
    // cuts over, once.
    api.start_apiserver();
    mark_ready(&api, "virt-launcher-vm9-bbbbb");
    let sock = daemon.socket();
    let mut last = None;
    assert!(
        wait_until(CONVERGE, || {
            last = get_vm(sock, NS, "vm9").ok();
            last.as_ref().is_some_and(|v| {
                v.active
                    .as_ref()
                    .is_some_and(|p| p.pod_name == "virt-launcher-vm9-bbbbb")
                    && v.last_cutover
                        .as_ref()
                        .is_some_and(|c| c.trigger == "annotation")
            })
        }),
        "the resumed watch did not cut over: {last:#?}\n{}",
        daemon.log()
    );
    let generation = last.as_ref().map(|v| v.generation).unwrap_or_default();
    // Nothing is done twice: the watch's relists and later updates of the
    // pod leave the record as it is.
    touch(&api, "virt-launcher-vm9-bbbbb");
    std::thread::sleep(Duration::from_secs(3));
    let now = get_vm(sock, NS, "vm9").expect("record");
    assert_eq!(
        now.generation, generation,
        "the record changed again: {now:#?}"
    );
    let stats = admin::stats(sock);
    assert_eq!(stats.vm_cutovers, 1, "cutovers: {stats:#?}");
    let _ = (&source_ns, &target_ns);
}

/// A VirtualMachine object named `name` in [`NS`] (stopped: no controller
/// runs here to start it).
fn create_virtual_machine(api: &KubeApi, name: &str) {
    api.apply(
        &json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"runStrategy": "Halted"},
        })
        .to_string(),
    );
}

/// Whether the daemon at `socket` still has a record of VM `vm` in [`NS`].
fn has_record(socket: &Path, vm: &str) -> bool {
    match get_vm(socket, NS, vm) {
        Ok(_) => true,
        Err(s) if s.code() == tonic::Code::NotFound => false,
        Err(s) => panic!("GetVm {vm}: {s}"),
    }
}

/// A pod that asks for `ip` (CNI_ARGS IP=): its ADD's outcome.
fn ask_for(daemon: &Daemon, ip: &str, pod: &str) -> (tether_e2e::CniOutput, Netns, VmPodSpec) {
    let mut spec = VmPodSpec::new(NS, "none", pod);
    spec.extra_args = vec![format!("IP={ip}")];
    let ns = Netns::new("pod");
    let out = call(daemon, "ADD", &ns, &spec, false);
    (out, ns, spec)
}

#[cfg_attr(
    not(feature = "cluster-tests"),
    ignore = "cluster tier: root, etcd and kube-apiserver; `make test` runs it"
)]
#[test]
fn a_deleted_virtualmachine_frees_its_address_once_no_pod_of_it_is_left() {
    require_root();
    let fabric = Fabric::new();
    let api = KubeApi::start(&fabric);
    api.install_tether();
    install_kubevirt_crd_double(&api, "VirtualMachine", "virtualmachines");
    let kubeconfig = api.token_kubeconfig(TETHER_SA.0, TETHER_SA.1);
    create_namespace(&api);
    // The chart's service account may list and watch VirtualMachines, and
    // no more.
    for (verb, yes) in [
        ("list", true),
        ("watch", true),
        ("get", false),
        ("delete", false),
        ("update", false),
    ] {
        let said = can_i(&api, verb, &["-A", "virtualmachines.kubevirt.io"]);
        assert_eq!(said == "yes", yes, "can-i {verb} virtualmachines: {said}");
    }

    let mut daemon = node_from_api(&fabric, &api, 22, &["10.250.4.0/28"], &kubeconfig);
    let served = wait_until(CONVERGE, || {
        daemon
            .log()
            .contains("KubeVirt's VirtualMachines are served")
    });
    assert!(
        served,
        "tetherd did not find the VirtualMachines:\n{}",
        daemon.log()
    );

    // vm1 runs, and stops: its VirtualMachine is there, so its address
    // stays with it, and a pod that asks for it is refused (code 105).
    create_virtual_machine(&api, "vm1");
    let vm1 = VmPodSpec::new(NS, "vm1", "virt-launcher-vm1-aaaaa");
    let vm1_ns = Netns::new("vm");
    call(&daemon, "ADD", &vm1_ns, &vm1, true).assert_success();
    let ip = pod_ipv4(&vm1_ns);
    call(&daemon, "DEL", &vm1_ns, &vm1, true).assert_success();
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        has_record(daemon.socket(), "vm1"),
        "a stopped VM lost its record"
    );
    let (out, _, _) = ask_for(&daemon, &ip, "greedy-1");
    assert_eq!(out.error_code(), Some(105), "{out}");

    // It starts again (same address), and its VirtualMachine is deleted
    // while its pod runs: the address stays until that pod's DEL.
    let again = VmPodSpec::new(NS, "vm1", "virt-launcher-vm1-bbbbb");
    let again_ns = Netns::new("vm");
    call(&daemon, "ADD", &again_ns, &again, true).assert_success();
    assert_eq!(pod_ipv4(&again_ns), ip, "the restarted VM lost its address");
    api.kubectl_ok(&["-n", NS, "delete", "virtualmachine.kubevirt.io", "vm1"]);
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        has_record(daemon.socket(), "vm1"),
        "freed while a pod of the VM still ran"
    );
    let t = Instant::now();
    call(&daemon, "DEL", &again_ns, &again, true).assert_success();
    assert!(
        wait_until(CONVERGE, || !has_record(daemon.socket(), "vm1")),
        "the deleted VM's record is still there:\n{}",
        daemon.log()
    );
    eprintln!("last pod's DEL to the record freed: {:?}", t.elapsed());
    // The daemon logs the release once it is done, just after the record
    // is gone.
    assert!(
        wait_until(CONVERGE, || daemon
            .log()
            .contains("VirtualMachine deleted: its addresses are freed")),
        "{}",
        daemon.log()
    );
    // The address is free again: a pod that asks for it gets it.
    let (out, reuse_ns, reuse) = ask_for(&daemon, &ip, "reuse");
    out.assert_success();
    assert_eq!(pod_ipv4(&reuse_ns), ip);
    call(&daemon, "DEL", &reuse_ns, &reuse, false).assert_success();

    // A deletion the watch never saw: vm2 stops, the daemon is down while
    // its VirtualMachine is deleted; the restarted daemon's listing finds
    // it gone and frees the address.
    create_virtual_machine(&api, "vm2");
    let vm2 = VmPodSpec::new(NS, "vm2", "virt-launcher-vm2-aaaaa");
    let vm2_ns = Netns::new("vm");
    call(&daemon, "ADD", &vm2_ns, &vm2, true).assert_success();
    let ip2 = pod_ipv4(&vm2_ns);
    call(&daemon, "DEL", &vm2_ns, &vm2, true).assert_success();
    daemon.stop();
    api.kubectl_ok(&["-n", NS, "delete", "virtualmachine.kubevirt.io", "vm2"]);
    daemon.restart();
    assert!(
        wait_until(CONVERGE, || !has_record(daemon.socket(), "vm2")),
        "the VM deleted while the daemon was down kept its record:\n{}",
        daemon.log()
    );
    let (out, ns2, spec2) = ask_for(&daemon, &ip2, "reuse-2");
    out.assert_success();
    call(&daemon, "DEL", &ns2, &spec2, false).assert_success();
}

/// A node's CNI dirs in a temp dir, with tether's files and portmap, and
/// a service-account dir with a token of tether's service account.
struct FakeNode {
    dir: tether_e2e::TempDir,
}

impl FakeNode {
    fn new(api: &KubeApi) -> FakeNode {
        let dir = tether_e2e::TempDir::new("unin");
        let d = dir.path();
        for sub in ["conf", "bin", "sa"] {
            std::fs::create_dir(d.join(sub)).expect("mkdir");
        }
        std::fs::write(d.join("conf/10-tether.conflist"), "{}").expect("conflist");
        std::fs::write(d.join("bin/tether"), "").expect("tether");
        std::fs::write(d.join("bin/portmap"), "").expect("portmap");
        let token = api.kubectl_ok(&["-n", TETHER_SA.0, "create", "token", TETHER_SA.1]);
        std::fs::write(d.join("sa/token"), token.trim()).expect("token");
        std::fs::copy(api.ca_cert(), d.join("sa/ca.crt")).expect("ca.crt");
        FakeNode { dir }
    }

    /// Runs install/uninstall.sh (at once, not on SIGTERM) in the API
    /// server's netns; its output.
    fn uninstall(&self, api: &KubeApi, port: u16) -> String {
        let d = self.dir.path();
        let host = api.server();
        let host = host
            .trim_start_matches("https://")
            .split(':')
            .next()
            .unwrap_or_default()
            .to_string();
        let out = std::process::Command::new("ip")
            .args(["netns", "exec", api.netns().name(), "sh"])
            .arg(tether_e2e::workspace_dir().join("install/uninstall.sh"))
            .env("TETHER_DAEMONSET", "tether")
            .env("TETHER_NAMESPACE", TETHER_SA.0)
            .env("KUBERNETES_SERVICE_HOST", host)
            .env("KUBERNETES_SERVICE_PORT", port.to_string())
            .env("SA_DIR", d.join("sa"))
            .env("CNI_BIN_DIR", d.join("bin"))
            .env("CNI_CONF_DIR", d.join("conf"))
            .output()
            .expect("running install/uninstall.sh");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "uninstall.sh failed: {text}");
        text
    }

    /// Runs install/uninstall.sh ([`FakeNode::uninstall`]) and checks that
    /// it says `says` and leaves `files` ([`FakeNode::files`]).
    fn assert_uninstall(&self, api: &KubeApi, port: u16, says: &str, files: (bool, bool, bool)) {
        let said = self.uninstall(api, port);
        assert!(said.contains(says), "{said}");
        assert_eq!(self.files(), files, "{said}");
    }

    /// (conflist there, plugin there, portmap there).
    fn files(&self) -> (bool, bool, bool) {
        let d = self.dir.path();
        (
            d.join("conf/10-tether.conflist").exists(),
            d.join("bin/tether").exists(),
            d.join("bin/portmap").exists(),
        )
    }
}

/// The DaemonSet's args on the API server.
fn daemonset_args(api: &KubeApi) -> Vec<String> {
    let ds = api
        .get(&["-n", TETHER_SA.0, "daemonset", "tether"])
        .expect("the DaemonSet");
    ds["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().unwrap_or_default().to_string())
        .collect()
}

#[cfg_attr(
    not(feature = "cluster-tests"),
    ignore = "cluster tier: root, etcd and kube-apiserver; `make test` runs it"
)]
#[test]
fn plain_manifests_apply_and_the_uninstaller_removes_only_on_removal() {
    require_root();
    let fabric = Fabric::new();
    let api = KubeApi::start(&fabric);
    let manifest = |file: &str| format!("install/manifests/{file}");

    // Each mode's file is accepted on a cluster without the Prometheus
    // Operator or Multus (which a ServiceMonitor would need: proved here).
    api.apply_file(&manifest("ipamclaims-crd.yaml"));
    for (mode, file, flag) in [
        (
            "singleNode",
            "tether-single-node.yaml",
            "--pod-cidr=10.244.0.0/24",
        ),
        ("etcd", "tether-etcd.yaml", "--store=etcd"),
        (
            "nodeCidrs",
            "tether-node-cidrs.yaml",
            "--pod-cidr-from-node",
        ),
    ] {
        api.apply_file(&manifest(file));
        let args = daemonset_args(&api);
        assert!(args.iter().any(|a| a == flag), "{mode}: {args:?}");
    }
    let with_monitor = tether_e2e::chart::template(&["metrics.serviceMonitor.enabled=true"]);
    let path = tether_e2e::TempDir::new("sm");
    let file = path.path().join("sm.yaml");
    std::fs::write(&file, with_monitor).expect("writing");
    let out = api.kubectl(&["apply", "-f", &file.display().to_string()]);
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("ServiceMonitor"),
        "this API server has no ServiceMonitor kind: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The DaemonSet is there (a restart, an upgrade): everything stays.
    let node = FakeNode::new(&api);
    node.assert_uninstall(&api, API_PORT, "is still there", (true, true, true));
    // No answer from the API: everything stays.
    node.assert_uninstall(&api, 1, "could not tell", (true, true, true));

    // Being deleted (foreground: no garbage collector runs here, so it
    // stays, with its deletionTimestamp).
    api.kubectl_ok(&[
        "-n",
        TETHER_SA.0,
        "delete",
        "daemonset",
        "tether",
        "--cascade=foreground",
        "--wait=false",
    ]);
    let said = node.uninstall(&api, API_PORT);
    assert!(said.contains("is being deleted"), "{said}");
    assert_eq!(node.files(), (false, false, true), "portmap stays: {said}");
    // Gone.
    api.kubectl_ok(&[
        "-n",
        TETHER_SA.0,
        "patch",
        "daemonset",
        "tether",
        "--type=merge",
        "-p",
        r#"{"metadata":{"finalizers":null}}"#,
    ]);
    let gone = wait_until(CONVERGE, || {
        api.get(&["-n", TETHER_SA.0, "daemonset", "tether"])
            .is_none()
    });
    assert!(gone, "the DaemonSet is still there");
    let node = FakeNode::new(&api);
    node.assert_uninstall(&api, API_PORT, "is gone", (false, false, true));

    // The DaemonSet there, but its Role's binding gone (helm uninstall
    // deletes it right after the DaemonSet).
    api.apply_file(&manifest("tether-node-cidrs.yaml"));
    let node = FakeNode::new(&api);
    api.kubectl_ok(&[
        "-n",
        TETHER_SA.0,
        "delete",
        "rolebinding",
        "tether-uninstall",
    ]);
    // The authorizer's cache of bindings follows a watch: wait until it
    // has seen the deletion.
    let denied = wait_until(CONVERGE, || {
        can_i(&api, "get", &["-n", TETHER_SA.0, "daemonsets.apps/tether"]) == "no"
    });
    assert!(
        denied,
        "the RoleBinding's deletion did not reach the authorizer"
    );
    node.assert_uninstall(&api, API_PORT, "may no longer read", (false, false, true));

    // `kubectl delete -f` of a mode's file: the service account goes first
    // (the file's order), so the token no longer authenticates.
    api.apply_file(&manifest("tether-node-cidrs.yaml"));
    let node = FakeNode::new(&api);
    let kubeconfig = api.token_kubeconfig(TETHER_SA.0, TETHER_SA.1);
    api.kubectl_ok(&["-n", TETHER_SA.0, "delete", "serviceaccount", TETHER_SA.1]);
    // The token authenticator's cache of service accounts follows a
    // watch: wait until a token of the deleted account is refused.
    let refused = wait_until(CONVERGE, || {
        !api.kubectl_as(&kubeconfig, &["auth", "whoami"])
            .status
            .success()
    });
    assert!(
        refused,
        "tokens of the deleted service account still authenticate"
    );
    node.assert_uninstall(&api, API_PORT, "no longer knows", (false, false, true));
    // And that delete leaves the CRD (and so the claims).
    let file = tether_e2e::workspace_dir().join(manifest("tether-node-cidrs.yaml"));
    api.kubectl_ok(&[
        "delete",
        "--ignore-not-found",
        "-f",
        &file.display().to_string(),
    ]);
    assert!(api.get(&["crd", "ipamclaims.k8s.cni.cncf.io"]).is_some());
    assert!(api
        .get(&["-n", TETHER_SA.0, "daemonset", "tether"])
        .is_none());
}

#[cfg_attr(
    not(feature = "cluster-tests"),
    ignore = "cluster tier: root and kube-apiserver; `make test` runs it"
)]
#[test]
fn only_a_vms_own_launcher_takes_its_address_or_its_migration() {
    require_root();
    let cluster = Topology::tetherd(2)
        .store(Store::Kubernetes)
        .node(NodeOpts {
            check_vm_launchers: true,
            ..NodeOpts::default()
        })
        .start();
    let api = cluster.kube_api();
    create_namespace(api);
    let (a, b) = (cluster.node(0), cluster.node(1));
    let refused = |node: &ClusterNode, spec: &VmPodSpec, why: &str| {
        let (out, _ns, _id) = try_add_vm_pod(node, spec);
        assert_eq!(out.error_code(), Some(120), "{}: {out}", spec.pod_name);
        let text = out.to_string();
        assert!(
            text.contains(&format!(
                "pod {NS}/{} (kubevirt.io/domain vm1) is not the launcher of VM {NS}/vm1",
                spec.pod_name
            )) && text.contains(why),
            "{}'s refusal does not say {why:?}: {text}",
            spec.pod_name
        );
    };
    let no_record =
        || matches!(get_vm(socket(a), NS, "vm1"), Err(s) if s.code() == tonic::Code::NotFound);

    // Look-alikes before the VM runs: each copies vm1's labels and
    // annotations, and none takes its address (no record is made).
    let bare = api_pod(api, a.name(), &VmPodSpec::new(NS, "vm1", "lookalike-bare"));
    refused(a, &bare, "it has no controlling owner");
    let mut spec = VmPodSpec::new(NS, "vm1", "lookalike-made-up-owner");
    let mut pod = spec.launcher(api, launcher_manifest(a.name(), &spec));
    pod["metadata"]["ownerReferences"][0]["uid"] = json!("made-up-uid");
    spec = running_pod(api, &spec, pod);
    refused(a, &spec, "with uid made-up-uid, but that instance's uid is");
    let mut spec = VmPodSpec::new(NS, "vm1", "lookalike-other-vm");
    let mut other = VmPodSpec::new(NS, "vm2", "lookalike-other-vm");
    other.pod_name = spec.pod_name.clone();
    let pod = other.launcher(api, launcher_manifest(a.name(), &spec));
    // vm2's launcher, which says it is vm1's.
    let mut pod = pod;
    pod["metadata"]["annotations"] = spec.annotations();
    spec = running_pod(api, &spec, pod);
    refused(a, &spec, "its controller is VirtualMachineInstance vm2");
    // Not in the API at all (a container that is no pod).
    refused(
        a,
        &VmPodSpec::new(NS, "vm1", "lookalike-nowhere"),
        "the API has no such pod",
    );
    assert!(no_record(), "a look-alike made vm1's record");

    // The launcher: its instance controls it. It gets the VM's address.
    let real = VmPodSpec::new(NS, "vm1", "virt-launcher-vm1-aaaaa");
    let real = running_pod(
        api,
        &real,
        real.launcher(api, launcher_manifest(a.name(), &real)),
    );
    let source = add_vm_pod(a, &real);
    let vm = get_vm(socket(a), NS, "vm1").expect("vm1's record");
    assert_eq!(active_node(&vm), a.name());

    // A look-alike migration target on B: refused, and the record has no
    // alternate (no cutover can move the VM's routes to it).
    let fake = api_pod(api, b.name(), &real.target("lookalike-target"));
    refused(b, &fake, "it has no controlling owner");
    let vm = get_vm(socket(a), NS, "vm1").expect("vm1's record");
    assert_eq!(
        alternate_node(&vm),
        "",
        "a look-alike became the target: {vm:?}"
    );
    // The real target: accepted, with the VM's address.
    let target = real.target("virt-launcher-vm1-bbbbb");
    let target = running_pod(
        api,
        &target,
        target.launcher(api, launcher_manifest(b.name(), &target)),
    );
    let moved = add_vm_pod(b, &target);
    assert_eq!(
        moved.ips(),
        source.ips(),
        "the target has the VM's addresses"
    );
    let vm = get_vm(socket(a), NS, "vm1").expect("vm1's record");
    assert_eq!(alternate_node(&vm), b.name());
}
