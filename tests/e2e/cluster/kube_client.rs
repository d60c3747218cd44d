//! tetherd's Kubernetes client against a real kube-apiserver (with its
//! audit log on), beyond what it serves:
//!
//! - every request it makes carries `User-Agent: tetherd/<version>` (the
//!   audit log's `userAgent` of every request by its service account);
//! - after an outage, an IPAMClaim whose status could not be written while
//!   the server was away is filled from the watch's relist, not from the
//!   30 s resync (the time is printed);
//! - the server's etcd is compacted during the outage, so the watches'
//!   resource versions are gone: each (by name) gets 410 Gone, lists
//!   again, and goes on (a claim made after it is filled as before, and
//!   one whose pod comes before the watch brings it is read).

use std::net::IpAddr;
use std::time::{Duration, Instant};

use serde_json::Value;
use tether_e2e::cluster::NodeOpts;
use tether_e2e::kube::{KubeApi, TETHER_SA};
use tether_e2e::topology::Topology;
use tether_e2e::vm::{add_vm_pod, VmPodSpec};
use tether_e2e::{admin, require_root, wait_until};

use super::{claim, claimed_ips, create_claim, status_ips, NS};

const CONVERGE: Duration = Duration::from_secs(20);

/// Waits until the claim's `status.ips` are `ips` (as /32 and /128) and
/// its owner is `owner`; panics with the claim otherwise.
fn wait_claim_filled(api: &KubeApi, name: &str, ips: &[IpAddr], owner: &str) {
    let want: Vec<String> = status_ips(ips);
    let mut last = Value::Null;
    let ok = wait_until(CONVERGE, || {
        last = claim(api, name).unwrap_or(Value::Null);
        let got = claimed_ips(&last);
        got == want && last["status"]["ownerPod"]["name"] == owner
    });
    assert!(
        ok,
        "claim {name} not filled with {want:?} by {owner}: {last:#}"
    );
}

fn claimed_vm(vm: &str) -> VmPodSpec {
    let mut spec = VmPodSpec::new(NS, vm, &format!("virt-launcher-{vm}-aaaaa"));
    spec.claim = Some(format!("{vm}.default"));
    spec
}

#[cfg_attr(
    not(feature = "cluster-tests"),
    ignore = "cluster tier: root, etcd and kube-apiserver; `make test` runs it"
)]
#[test]
fn the_client_names_itself_catches_up_after_an_outage_and_relists_on_410_gone() {
    require_root();
    let mut cluster = Topology::tetherd(0).start();
    let mut api = KubeApi::start(cluster.fabric());
    api.install_tether();
    let kubeconfig = api.token_kubeconfig(TETHER_SA.0, TETHER_SA.1);
    cluster.add_node_with(&NodeOpts {
        extra_args: vec!["--kubeconfig".into(), kubeconfig.display().to_string()],
        ..NodeOpts::default()
    });
    api.kubectl_ok(&["create", "namespace", NS]);
    let node = cluster.node(0);

    // Two claims, vm1's first: once vm0's status is written, the daemon's
    // cache (fed by one watch, in order) has seen vm1's too.
    create_claim(&api, "vm1.default", "vm1");
    create_claim(&api, "vm0.default", "vm0");
    let vm0 = add_vm_pod(node, &claimed_vm("vm0"));
    wait_claim_filled(&api, "vm0.default", vm0.ips(), "virt-launcher-vm0-aaaaa");

    // The API server goes away. vm1's pod is added meanwhile: the ADD
    // answers from the node's own state, and the claim's status cannot be
    // written. The server's etcd is compacted before it comes back.
    api.stop_apiserver();
    let vm1 = add_vm_pod(node, &claimed_vm("vm1"));
    std::thread::sleep(Duration::from_secs(2));
    api.compact_etcd();
    api.start_apiserver();
    let back = Instant::now();
    wait_claim_filled(&api, "vm1.default", vm1.ips(), "virt-launcher-vm1-aaaaa");
    eprintln!(
        "claim status written {:?} after the API server was ready again",
        back.elapsed()
    );

    // A claim made now, its pod at once: the claims watch is usually
    // still listing again, and the status writer reads the claim itself.
    create_claim(&api, "vm2.default", "vm2");
    let vm2 = add_vm_pod(node, &claimed_vm("vm2"));
    wait_claim_filled(&api, "vm2.default", vm2.ips(), "virt-launcher-vm2-aaaaa");

    // Each watch's resource version was compacted away: 410 Gone, a new
    // listing, and the watches go on. Each watch says so by name: one
    // that hung on a request the dying server had taken would say
    // nothing (the daemon's deadline on responses ends such a request
    // within 15 s).
    let log = || node.daemon().log();
    for watch in ["pods of this node", "IPAMClaims"] {
        let line = format!("(410 Gone): listing again watch=\"{watch}\"");
        assert!(
            wait_until(CONVERGE + Duration::from_secs(15), || log().contains(&line)),
            "the {watch} watch did not report 410 Gone:\n{}",
            log()
        );
    }
    create_claim(&api, "vm3.default", "vm3");
    let vm3 = add_vm_pod(node, &claimed_vm("vm3"));
    wait_claim_filled(&api, "vm3.default", vm3.ips(), "virt-launcher-vm3-aaaaa");

    // Every request by tetherd's service account named tetherd.
    let version = admin::node(node.daemon().socket()).version;
    let user = format!("system:serviceaccount:{}:{}", TETHER_SA.0, TETHER_SA.1);
    let mine: Vec<Value> = api
        .audit_events()
        .into_iter()
        .filter(|e| e["user"]["username"] == user.as_str())
        .collect();
    assert!(mine.len() > 5, "{} requests by {user}", mine.len());
    let agents: std::collections::BTreeSet<String> = mine
        .iter()
        .map(|e| e["userAgent"].as_str().unwrap_or("").to_owned())
        .collect();
    assert_eq!(
        agents,
        std::collections::BTreeSet::from([format!("tetherd/{version}")]),
        "user agents of {} requests by {user}",
        mine.len()
    );
    let verbs: std::collections::BTreeSet<&str> =
        mine.iter().filter_map(|e| e["verb"].as_str()).collect();
    eprintln!(
        "{} requests by {user}, verbs {verbs:?}, all as tetherd/{version}",
        mine.len()
    );
    assert!(
        verbs.contains("watch") && verbs.contains("patch"),
        "{verbs:?}"
    );
}
