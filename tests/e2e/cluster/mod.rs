//! Cluster mode end to end: three node netns on a fabric bridge, each with
//! its own tetherd, against a 3-member etcd cluster in a control netns, or
//! against a real kube-apiserver (`--store kubernetes`): the tests in
//! `etcd::` and `kubernetes::` are the same checks on each store. Pods are
//! added through the real `tether` plugin.

mod kube_api;
mod kube_client;
mod network_policy;

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;
use serde_json::{json, Value};
use tether_e2e::admin::{self, pb};
use tether_e2e::cluster::{
    assert_ping_within, Cluster, ClusterNode, NodeOpts, Overlay, Pod, Store, CLUSTER_NETWORK,
};
use tether_e2e::kube::KubeApi;
use tether_e2e::topology::Topology;
use tether_e2e::vm::{add_vm_pod, del_vm_pod, get_vm, reserve_vm, try_add_vm_pod, VmPodSpec};
use tether_e2e::{
    assert_distinct, cni, parallel, require_root, tether_bin, wait_until, CniEnv, CniOutput, Netns,
};

/// Routes and blocks follow the store through a watch: allow for it.
const CONVERGE: Duration = Duration::from_secs(15);

fn list_nodes(node: &ClusterNode) -> Vec<pb::ClusterNode> {
    admin::admin(node.daemon().socket(), |mut c| async move {
        c.list_nodes(pb::ListNodesRequest::default()).await
    })
    .nodes
}

fn get_node(node: &ClusterNode) -> pb::Node {
    admin::node(node.daemon().socket())
}

/// The namespace of the VM pods and IPAMClaims of the API server suites.
const NS: &str = "vms";

/// An IPAMClaim as KubeVirt's ipam-extensions creates it: `<vm>.<network>`,
/// the VM label, its finalizer, and only `spec.network` (its Go client
/// sends `interface` empty).
fn create_claim(api: &KubeApi, name: &str, vm: &str) {
    let claim = json!({
        "apiVersion": "k8s.cni.cncf.io/v1alpha1", "kind": "IPAMClaim",
        "metadata": {"name": name, "namespace": NS, "labels": {"kubevirt.io/vm": vm},
                     "finalizers": ["kubevirt.io/persistent-ipam"]},
        "spec": {"network": CLUSTER_NETWORK, "interface": ""},
    });
    api.apply(&claim.to_string());
}

/// The IPAMClaim `name`, if there is one.
fn claim(api: &KubeApi, name: &str) -> Option<Value> {
    api.get(&["-n", NS, "ipamclaims.k8s.cni.cncf.io", name])
}

/// `ips` as a claim's `status.ips` lists them: /32 and /128.
fn status_ips(ips: &[IpAddr]) -> Vec<String> {
    ips.iter()
        .map(|ip| match ip {
            IpAddr::V4(a) => format!("{a}/32"),
            IpAddr::V6(a) => format!("{a}/128"),
        })
        .collect()
}

/// The `status.ips` of a claim (none where it has no status).
fn claimed_ips(claim: &Value) -> Vec<String> {
    claim["status"]["ips"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

tether_e2e::on_both_stores!(
    host_gw_pods_on_every_pair_of_nodes_reach_each_other,
    vxlan_pods_on_every_pair_of_nodes_reach_each_other,
    daemon_restart_keeps_blocks_and_pods_reachable_and_drops_stale_routes,
    a_store_outage_stops_only_block_claims_and_vm_placements_until_it_ends,
    a_node_that_goes_away_is_reaped_and_its_routes_withdrawn,
    the_reaper_that_goes_away_is_reaped_by_the_next_node,
    a_daemon_paused_past_its_lease_is_alive_again_when_it_resumes,
    a_node_reaped_while_away_returns_and_claims_its_blocks_back,
    a_killed_daemon_queues_dels_and_returns_with_its_id_and_blocks,
    three_nodes_times_a_hundred_concurrent_adds,
);

/// Every block in the store, with its holder.
fn store_blocks(cluster: &Cluster) -> BTreeMap<IpNet, String> {
    cluster
        .store_keys()
        .iter()
        .filter(|(k, _)| k.starts_with("/tether/v1/blocks/"))
        .map(|(k, v)| {
            let rec: Value = serde_json::from_str(v).unwrap_or_else(|e| panic!("{k}: {e}: {v}"));
            let cidr: IpNet = rec["cidr"]
                .as_str()
                .unwrap_or_default()
                .parse()
                .unwrap_or_else(|e| panic!("{k}: {e}"));
            (cidr, rec["node"].as_str().unwrap_or_default().to_owned())
        })
        .collect()
}

/// Blocks never overlap; each route destination of a node is another
/// node's block.
fn assert_no_overlap(blocks: &BTreeMap<IpNet, String>) {
    let list: Vec<&IpNet> = blocks.keys().collect();
    for (i, a) in list.iter().enumerate() {
        for b in &list[i + 1..] {
            assert!(
                !a.contains(&b.network()) && !b.contains(&a.network()),
                "blocks {a} and {b} overlap: {blocks:?}"
            );
        }
    }
}

/// The cluster routes of `node` are exactly the blocks of the other nodes.
fn routes_match_blocks(cluster: &Cluster, i: usize) -> bool {
    let me = cluster.node(i).name().to_owned();
    let want: Vec<String> = store_blocks(cluster)
        .into_iter()
        .filter(|(_, n)| *n != me)
        .map(|(b, _)| b.to_string())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let have: BTreeSet<String> = cluster.node(i).cluster_route_dsts().into_iter().collect();
    have.into_iter().collect::<Vec<_>>() == want
}

fn wait_routes_converge(cluster: &Cluster) {
    for i in 0..cluster.nodes().len() {
        assert!(
            wait_until(CONVERGE, || routes_match_blocks(cluster, i)),
            "node {i} routes {:?} do not match the blocks {:?}",
            cluster.node(i).cluster_route_dsts(),
            store_blocks(cluster)
        );
    }
}

fn ping_every_pair(pods: &[&Pod]) {
    for from in pods {
        for to in pods.iter().filter(|p| p.node() != from.node()) {
            for ip in to.ips() {
                assert_ping_within(from.netns(), *ip, CONVERGE);
            }
        }
    }
}

/// After an outage: every node lists the three nodes alive, the routes
/// match the blocks, no two blocks overlap, and every pair of `pods`
/// pings.
fn assert_all_back(cluster: &Cluster, pods: &[Pod]) {
    for node in cluster.nodes() {
        assert!(
            wait_until(CONVERGE, || {
                let l = list_nodes(node);
                l.len() == 3 && l.iter().all(|n| n.alive)
            }),
            "{:?}",
            list_nodes(node)
        );
    }
    wait_routes_converge(cluster);
    assert_no_overlap(&store_blocks(cluster));
    ping_every_pair(&pods.iter().collect::<Vec<_>>());
}

/// Asserts that `pod`'s IPv4 address is in one of `blocks`.
fn assert_in_blocks(pod: &Pod, blocks: &[String]) {
    let v4 = pod.v4().unwrap_or_else(|| panic!("no IPv4"));
    assert!(
        blocks
            .iter()
            .any(|b| b.parse::<IpNet>().is_ok_and(|b| b.contains(&v4))),
        "{v4} not in {:?}",
        blocks
    );
}

/// Whether `node` routes to any of `blocks`.
fn routes_to_any(node: &ClusterNode, blocks: &[String]) -> bool {
    node.cluster_route_dsts().iter().any(|d| blocks.contains(d))
}

fn pods_on_every_pair_ping(overlay: Overlay, store: Store) -> Cluster {
    let cluster = Topology::tetherd(3)
        .store(store)
        .node(NodeOpts {
            overlay,
            ..NodeOpts::default()
        })
        .start();
    let pods: Vec<Pod> = (0..3).map(|i| cluster.add_pod(i)).collect();
    for p in &pods {
        assert!(
            p.v4().is_some() && p.v6().is_some(),
            "dual-stack: {:?}",
            p.ips()
        );
    }
    wait_routes_converge(&cluster);
    ping_every_pair(&pods.iter().collect::<Vec<_>>());
    cluster
}

fn host_gw_pods_on_every_pair_of_nodes_reach_each_other(store: Store) {
    require_root();
    let cluster = pods_on_every_pair_ping(Overlay::HostGw, store);

    // Routes go straight to the other node's underlay address.
    for (i, node) in cluster.nodes().iter().enumerate() {
        for r in node.cluster_routes() {
            let gw = r["gateway"].as_str().unwrap_or_default();
            let others: Vec<String> = cluster
                .nodes()
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .flat_map(|(_, n)| [n.underlay().v4.to_string(), n.underlay().v6.to_string()])
                .collect();
            assert!(
                others.contains(&gw.to_owned()),
                "route {r} of node {i} is not via a node IP"
            );
        }
    }

    // The admin API: every node sees the same three live nodes with
    // distinct IDs; GetNode shows this node's ID, blocks and store health.
    let blocks = store_blocks(&cluster);
    assert_no_overlap(&blocks);
    for node in cluster.nodes() {
        let listed = list_nodes(node);
        assert_eq!(listed.len(), 3, "{listed:?}");
        assert!(listed.iter().all(|n| n.alive), "{listed:?}");
        assert_distinct("node IDs", listed.iter().map(|n| n.id));
        assert_eq!(listed.iter().filter(|n| n.local).count(), 1);
        let me = get_node(node);
        assert_eq!(me.ipam_mode, "cluster");
        assert_eq!(me.routing, "host-gw");
        assert_eq!(me.store_backend, store.name());
        assert!(
            me.store_health.as_ref().is_some_and(|h| h.healthy),
            "{me:?}"
        );
        assert!(me.node_id >= 1);
        assert!(
            me.node_ip.contains(&node.underlay().v4.to_string()),
            "{}",
            me.node_ip
        );
        let mine: BTreeSet<String> = blocks
            .iter()
            .filter(|(_, n)| *n == node.name())
            .map(|(b, _)| b.to_string())
            .collect();
        assert_eq!(me.blocks.iter().cloned().collect::<BTreeSet<_>>(), mine);
        assert_eq!(mine.len(), 2, "one block per family: {mine:?}");
    }

    // The same through grpcurl (server reflection), as operators read it.
    let sock = cluster.node(0).daemon().socket().display().to_string();
    let grpcurl = |method: &str| -> Value {
        let out = std::process::Command::new("/usr/local/bin/grpcurl")
            .args(["-plaintext", "-unix", &sock, method])
            .output()
            .unwrap_or_else(|e| panic!("grpcurl (installed by tests/setup.sh): {e}"));
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}"))
    };
    let listed = grpcurl("tether.admin.v1.Admin/ListNodes");
    assert_eq!(
        listed["nodes"].as_array().map(Vec::len),
        Some(3),
        "{listed}"
    );
    let got = grpcurl("tether.admin.v1.Admin/GetNode");
    assert_eq!(got["ipamMode"], "cluster", "{got}");
    assert_eq!(got["storeHealth"]["healthy"], true, "{got}");
    assert_eq!(got["blocks"].as_array().map(Vec::len), Some(2), "{got}");
    assert!(got["nodeId"].as_u64().is_some_and(|id| id >= 1), "{got}");

    // The key layout in etcd, and the Kubernetes store's objects read as
    // the same keys.
    let keys = cluster.store_keys();
    for node in cluster.nodes() {
        let name = node.name();
        assert!(
            keys.contains_key(&format!("/tether/v1/nodes/{name}")),
            "{keys:?}"
        );
        assert!(
            keys.contains_key(&format!("/tether/v1/alive/{name}")),
            "{keys:?}"
        );
        let rec: Value = serde_json::from_str(&keys[&format!("/tether/v1/nodes/{name}")])
            .unwrap_or_else(|e| panic!("{e}"));
        let id = rec["id"].as_u64().unwrap_or_default();
        assert_eq!(
            keys.get(&format!("/tether/v1/nodeids/{id}"))
                .map(String::as_str),
            Some(name)
        );
    }
}

fn vxlan_pods_on_every_pair_of_nodes_reach_each_other(store: Store) {
    require_root();
    let cluster = pods_on_every_pair_ping(Overlay::Vxlan, store);
    for node in cluster.nodes() {
        assert!(node.netns().has_link("tether.vxlan"));
        let routes = node.cluster_routes();
        assert_eq!(
            routes.len(),
            4,
            "two blocks of each of two nodes: {routes:?}"
        );
        for r in routes {
            assert_eq!(r["dev"].as_str(), Some("tether.vxlan"), "{r}");
        }
        let me = get_node(node);
        assert_eq!(me.routing, "vxlan");
        // Without --mtu, pods get the VXLAN device's MTU: the fabric's
        // 1500 less 50 bytes of encapsulation over IPv4.
        let vxlan = node
            .netns()
            .ip_json(&["link", "show", "dev", "tether.vxlan"]);
        assert_eq!(vxlan[0]["mtu"], 1450, "{vxlan:?}");
        assert_eq!(me.mtu, 1450, "the pod MTU GetNode reports");
        // One static FDB entry per remote node.
        let fdb = node
            .netns()
            .exec_ok(&["bridge", "fdb", "show", "dev", "tether.vxlan"]);
        let permanent = fdb
            .lines()
            .filter(|l| l.contains("dst") && l.contains("permanent"))
            .count();
        assert_eq!(permanent, 2, "{fdb}");
    }
}

fn daemon_restart_keeps_blocks_and_pods_reachable_and_drops_stale_routes(store: Store) {
    require_root();
    let mut cluster = Topology::tetherd(3).store(store).start();
    let pods: Vec<Pod> = (0..3).map(|i| cluster.add_pod(i)).collect();
    wait_routes_converge(&cluster);
    let before = get_node(cluster.node(0));
    // A route of ours that no block explains: startup must remove it.
    let node0 = cluster.node(0).netns().name().to_owned();
    let gw = cluster.node(1).underlay().v4.to_string();
    cluster.node(0).netns().exec_ok(&[
        "ip",
        "route",
        "add",
        "10.250.0.0/26",
        "via",
        &gw,
        "proto",
        "202",
    ]);
    assert!(cluster
        .node(0)
        .cluster_route_dsts()
        .contains(&"10.250.0.0/26".to_owned()));

    cluster.node_mut(0).daemon_mut().restart();

    let after = get_node(cluster.node(0));
    assert_eq!(
        after.node_id, before.node_id,
        "the node ID survives a restart"
    );
    assert_eq!(after.blocks, before.blocks, "the blocks survive a restart");
    assert!(
        !cluster
            .node(0)
            .cluster_route_dsts()
            .contains(&"10.250.0.0/26".to_owned()),
        "stale route survived startup on {node0}"
    );
    wait_routes_converge(&cluster);
    ping_every_pair(&pods.iter().collect::<Vec<_>>());
    // A new pod after the restart comes from the same blocks.
    assert_in_blocks(&cluster.add_pod(0), &after.blocks);
}

/// Small blocks, so that a few ADDs need a new one: /30 holds two pod
/// addresses, /126 three.
fn small_blocks() -> NodeOpts {
    NodeOpts {
        block_size: Some(30),
        block_size_v6: Some(126),
        // Long enough that an etcd outage does not reap anyone.
        node_grace_secs: 60,
        etcd_timeout_ms: Some(1000),
        ..NodeOpts::default()
    }
}

fn add(node: &ClusterNode) -> (Netns, CniOutput) {
    let ns = Netns::new("pod");
    let id = ns.name().to_owned();
    let out = node.try_add(&ns, &id);
    (ns, out)
}

/// The store goes away (on etcd, first one member, the leader, with no
/// effect at all; then every member; on the Kubernetes store, the API
/// server): ADDs from the blocks held go on, a claim fails with 11 saying
/// why, STATUS says the node cannot serve, traffic is untouched; a VM
/// pod's DEL succeeds, its record's change waiting for the store, and the
/// VM's next pod is refused with 11; and when the store is back, claims
/// and placements work again without a restart, and the record follows.
fn a_store_outage_stops_only_block_claims_and_vm_placements_until_it_ends(store: Store) {
    require_root();
    let mut cluster = Topology::tetherd(3)
        .store(store)
        .node(small_blocks())
        .start();
    let mut pods: Vec<Pod> = Vec::new();

    // On etcd, one member down, the leader: everything keeps working,
    // block claims included.
    let leader = (store == Store::Etcd).then(|| {
        let leader = cluster
            .etcd()
            .leader()
            .unwrap_or_else(|| panic!("no etcd leader"));
        cluster.etcd_mut().kill_member(leader);
        leader
    });
    for _ in 0..3 {
        for i in 0..3 {
            pods.push(cluster.add_pod(i));
        }
    }
    wait_routes_converge(&cluster);
    ping_every_pair(&pods.iter().collect::<Vec<_>>());
    assert_no_overlap(&store_blocks(&cluster));
    if let Some(leader) = leader {
        cluster.etcd_mut().start_member(leader);
    }

    // A VM's pod on node 0, whose DEL comes while the store is away.
    let vm = VmPodSpec::new("default", "vm-outage", "virt-launcher-vm-outage-a");
    let vm_pod = add_vm_pod(cluster.node(0), &vm);
    let vm_ips = get_vm(cluster.node(0).daemon().socket(), "default", "vm-outage")
        .unwrap_or_else(|e| panic!("no record of vm-outage: {e}"))
        .ips;

    // The whole store down, with one address of each family free on node
    // 0 (its first pod deleted). That ADD succeeds...
    let first = pods.remove(0);
    assert!(cluster.node(0).del(&first).success());
    drop(first);
    let claims_before = admin::stats(cluster.node(0).daemon().socket()).block_claims;
    match store {
        Store::Etcd => cluster.etcd_mut().stop_all(),
        Store::Kubernetes => cluster.kube_api_mut().stop_apiserver(),
    }
    // What the messages name the store by.
    let named = match store {
        Store::Etcd => "etcd",
        Store::Kubernetes => "Kubernetes API",
    };
    let mut ok = 0;
    let failure = loop {
        let (ns, out) = add(cluster.node(0));
        if out.success() {
            ok += 1;
            drop(ns);
            assert!(ok < 10, "ADDs kept succeeding with the store down");
            continue;
        }
        break out;
    };
    assert!(
        ok >= 1,
        "no ADD succeeded from free block space with the store down"
    );
    // ...and the one that needs a new block fails with 11, saying why.
    assert_eq!(failure.error_code(), Some(11), "{failure}");
    let msg = failure.to_string();
    assert!(msg.contains("block"), "{msg}");
    assert!(msg.contains(named), "{msg}");
    assert_eq!(
        admin::stats(cluster.node(0).daemon().socket()).block_claims,
        claims_before,
        "no claim can have succeeded"
    );
    // STATUS says the node cannot serve ADDs, and the admin API says why.
    let status = {
        let conf = cluster.node(0).daemon().netconf("1.1.0", CLUSTER_NETWORK);
        let env = CniEnv {
            command: Some("STATUS".into()),
            ..CniEnv::default()
        };
        cni(
            &tether_bin(),
            &env,
            &serde_json::to_vec(&conf).unwrap_or_default(),
        )
    };
    assert_eq!(status.error_code(), Some(50), "{status}");
    assert!(status.to_string().contains("block"), "{status}");
    let health = get_node(cluster.node(0)).store_health.unwrap_or_default();
    assert!(!health.healthy, "{health:?}");
    assert!(health.detail.contains(named), "{health:?}");
    // Traffic between existing pods is untouched.
    ping_every_pair(&pods.iter().collect::<Vec<_>>());

    // A VM pod's DEL tears down what is local and succeeds; its leave of
    // the VM's record waits for the store, and the record keeps the VM's
    // addresses meanwhile (nobody can be given them).
    let deleted = del_vm_pod(cluster.node(0), &vm, &vm_pod);
    assert!(
        deleted.success(),
        "the DEL of a VM pod failed with the store down: {deleted}"
    );
    let waiting = get_node(cluster.node(0)).waiting_leaves;
    assert_eq!(waiting.len(), 1, "{waiting:?}");
    assert_eq!(waiting[0].container_id, vm_pod.id());
    assert!(
        wait_until(CONVERGE, || !vm_pod
            .netns()
            .exec(&["ip", "link", "show", "eth0"])
            .status
            .success()),
        "the VM pod's eth0 is still there after its DEL"
    );
    // Placing a VM pod needs the store (its record must hold its addresses
    // cluster-wide): the VM's next pod is refused with 11, naming it.
    let next = VmPodSpec::new("default", "vm-outage", "virt-launcher-vm-outage-b");
    let (refused, _next_netns, _) = try_add_vm_pod(cluster.node(0), &next);
    assert_eq!(refused.error_code(), Some(11), "{refused}");
    assert!(refused.to_string().contains(named), "{refused}");

    // The store returns: claims work again without restarting anything.
    match store {
        Store::Etcd => cluster.etcd_mut().start_all(),
        Store::Kubernetes => cluster.kube_api_mut().start_apiserver(),
    }
    let mut recovered = None;
    assert!(
        wait_until(CONVERGE, || {
            let (ns, out) = add(cluster.node(0));
            if out.success() {
                recovered = Some((ns, out));
                true
            } else {
                false
            }
        }),
        "ADD needing a block still fails after the store returned"
    );
    let (_pod, added) = recovered.unwrap_or_else(|| panic!("no ADD recorded"));
    assert!(added.success());
    assert!(admin::stats(cluster.node(0).daemon().socket()).block_claims > claims_before);
    assert!(wait_until(CONVERGE, || get_node(cluster.node(0))
        .store_health
        .is_some_and(|h| h.healthy)));
    // ...and the VM pod's leave reaches the record: the VM runs nowhere,
    // and keeps its addresses.
    let socket = cluster.node(0).daemon().socket().to_owned();
    let left = || get_vm(&socket, "default", "vm-outage");
    assert!(
        wait_until(CONVERGE, || left().is_ok_and(|v| v.active.is_none())
            && get_node(cluster.node(0)).waiting_leaves.is_empty()),
        "the VM pod's leave did not reach the record after the store returned: {:?}",
        left()
    );
    assert_eq!(left().map(|v| v.ips).ok(), Some(vm_ips));
    assert_all_back(&cluster, &pods);
}

/// Every node of `cluster` (the ones left) withdraws its routes to the
/// blocks of node `gone` (`blocks`), and lists it no more: its record goes
/// last, after the blocks and the ID.
fn assert_reaped(cluster: &Cluster, gone: &str, blocks: &[String]) {
    for (i, node) in cluster.nodes().iter().enumerate() {
        assert!(
            wait_until(Duration::from_secs(30), || !routes_to_any(node, blocks)),
            "node {i} still routes to {gone}'s blocks: {:?}",
            node.cluster_route_dsts()
        );
        assert!(
            wait_until(CONVERGE, || list_nodes(node).iter().all(|n| n.name != gone)),
            "node {i} still lists {gone}"
        );
    }
}

fn a_node_that_goes_away_is_reaped_and_its_routes_withdrawn(store: Store) {
    require_root();
    let mut cluster = Topology::tetherd(3).store(store).start();
    let pods: Vec<Pod> = (0..2).map(|i| cluster.add_pod(i)).collect();
    wait_routes_converge(&cluster);
    let gone = cluster.node(2).name().to_owned();
    let gone_blocks: Vec<String> = get_node(cluster.node(2)).blocks;
    assert!(routes_to_any(cluster.node(0), &gone_blocks));

    // The node disappears (daemon killed, netns gone): its lease expires
    // (2 s), the grace passes (3 s), a live node reaps it.
    drop(cluster.remove_node(2));
    assert_reaped(&cluster, &gone, &gone_blocks);
    let keys = cluster.store_keys();
    assert!(
        !keys.keys().any(|k| k.ends_with(&format!("/{gone}"))),
        "{keys:?}"
    );
    assert!(!store_blocks(&cluster).values().any(|n| *n == gone));
    wait_routes_converge(&cluster);
    ping_every_pair(&pods.iter().collect::<Vec<_>>());
}

/// Liveness costs each node one other node's heartbeat: node IDs order the
/// nodes, each watches the next live ID below its own, and the lowest, the
/// reaper, watches them all and reaps. When the reaper goes away, the node
/// that watched it takes its role and reaps it.
fn the_reaper_that_goes_away_is_reaped_by_the_next_node(store: Store) {
    require_root();
    let mut cluster = Topology::tetherd(3).store(store).start();
    let pods: Vec<Pod> = (1..3).map(|i| cluster.add_pod(i)).collect();
    wait_routes_converge(&cluster);
    let mut by_id: Vec<(u32, String, usize)> = (0..3)
        .map(|i| {
            let n = get_node(cluster.node(i));
            (n.node_id, n.name, i)
        })
        .collect();
    by_id.sort();
    let roles = |cluster: &Cluster| -> Vec<String> {
        by_id
            .iter()
            .map(|(_, name, _)| {
                cluster
                    .nodes()
                    .iter()
                    .find(|n| n.name() == name)
                    .map_or_else(|| "gone".to_owned(), |n| get_node(n).liveness)
            })
            .collect()
    };
    let want = vec![
        "reaper".to_owned(),
        format!("watching {}", by_id[0].1),
        format!("watching {}", by_id[1].1),
    ];
    assert!(
        wait_until(CONVERGE, || roles(&cluster) == want),
        "roles {:?}, not {want:?}",
        roles(&cluster)
    );

    // The reaper disappears (daemon killed, netns gone).
    let (_, gone, index) = by_id[0].clone();
    let gone_blocks: Vec<String> = get_node(cluster.node(index)).blocks;
    drop(cluster.remove_node(index));
    let want = vec![
        "gone".to_owned(),
        "reaper".to_owned(),
        format!("watching {}", by_id[1].1),
    ];
    assert!(
        wait_until(Duration::from_secs(30), || roles(&cluster) == want),
        "roles {:?}, not {want:?}",
        roles(&cluster)
    );
    assert_reaped(&cluster, &gone, &gone_blocks);
    assert!(
        wait_until(CONVERGE, || (0..2)
            .all(|i| list_nodes(cluster.node(i)).iter().all(|n| n.alive))),
        "a node listed not alive: {:?}",
        list_nodes(cluster.node(0))
    );
    wait_routes_converge(&cluster);
    ping_every_pair(&pods.iter().collect::<Vec<_>>());
}

/// A daemon that stops answering for longer than its lease's TTL (here
/// SIGSTOP for 3 s: the TTL is 2 s, the grace 3 s) loses its lease, and
/// must take a new one when it resumes, before the grace runs out: it is
/// alive again and never reaped. On etcd, the renewal of an expired lease
/// used to fail for ever ("lease not found"), and the node was reaped, and
/// reaped again after every registration.
fn a_daemon_paused_past_its_lease_is_alive_again_when_it_resumes(store: Store) {
    require_root();
    let cluster = Topology::tetherd(2).store(store).start();
    let paused = cluster.node(1);
    let name = paused.name().to_owned();
    let id = get_node(paused).node_id;
    let pid = paused
        .daemon()
        .pid()
        .unwrap_or_else(|| panic!("no pid of {name}'s daemon"))
        .to_string();
    let alive = |n: &ClusterNode| {
        list_nodes(n)
            .iter()
            .find(|x| x.name == name)
            .is_some_and(|x| x.alive)
    };
    assert!(wait_until(CONVERGE, || alive(cluster.node(0))));
    let status = std::process::Command::new("kill")
        .args(["-STOP", &pid])
        .status();
    assert!(status.is_ok_and(|s| s.success()), "cannot stop {pid}");
    assert!(
        wait_until(Duration::from_secs(3), || !alive(cluster.node(0))),
        "{name}'s lease did not expire while it was stopped"
    );
    std::thread::sleep(Duration::from_secs(1));
    let status = std::process::Command::new("kill")
        .args(["-CONT", &pid])
        .status();
    assert!(status.is_ok_and(|s| s.success()), "cannot resume {pid}");
    assert!(
        wait_until(Duration::from_secs(2), || alive(cluster.node(0))),
        "{name} is not alive again within 2 s of resuming:\n{}",
        paused.daemon().log()
    );
    // Past the grace: still alive, never reaped.
    std::thread::sleep(Duration::from_secs(5));
    assert!(alive(cluster.node(0)), "{name} died again");
    assert_eq!(get_node(paused).node_id, id);
    let log = paused.daemon().log();
    assert!(
        !log.contains("reaped while it was away"),
        "{name} was reaped:\n{log}"
    );
}

/// A node whose daemon died (kill -9) is reaped while its pods still run
/// in its kernel; when its daemon comes back it registers again, claims
/// back the blocks its pods' addresses are in, and every node routes to
/// them again.
fn a_node_reaped_while_away_returns_and_claims_its_blocks_back(store: Store) {
    require_root();
    let mut cluster = Topology::tetherd(3).store(store).start();
    let pods: Vec<Pod> = (0..3).map(|i| cluster.add_pod(i)).collect();
    wait_routes_converge(&cluster);
    let name = cluster.node(0).name().to_owned();
    let mut blocks = get_node(cluster.node(0)).blocks;
    blocks.sort();
    assert_eq!(blocks.len(), 2, "{blocks:?}");

    // Dead: its lease expires (2 s), the grace passes (3 s), it is reaped.
    cluster.node_mut(0).daemon_mut().kill9();
    for i in 1..3 {
        assert!(
            wait_until(Duration::from_secs(30), || !routes_to_any(
                cluster.node(i),
                &blocks
            )),
            "node {i} still routes to {name}'s blocks"
        );
    }
    assert!(
        wait_until(CONVERGE, || !cluster
            .store_keys()
            .contains_key(&format!("/tether/v1/nodes/{name}"))),
        "{name} was not reaped"
    );

    // Back: the same blocks, taken back by compare-and-swap.
    cluster.node_mut(0).daemon_mut().restart();
    let mut again = get_node(cluster.node(0)).blocks;
    again.sort();
    assert_eq!(again, blocks);
    let log = cluster.node(0).daemon().log();
    assert!(
        log.contains("claimed back a block this node still uses"),
        "{log}"
    );
    assert_all_back(&cluster, &pods);
}

/// The files in a DEL queue (not its `bad/` directory).
fn queued(node: &ClusterNode) -> usize {
    let dir = node.daemon().state_dir().join("pending-del");
    std::fs::read_dir(&dir)
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
                .count()
        })
        .unwrap_or(0)
}

/// A daemon killed (kill -9): the runtime's DEL meanwhile is queued by the
/// plugin and succeeds; the pods it wired keep their traffic across nodes;
/// back, it replays the DEL before it serves, with the same ID and blocks,
/// and the other nodes route to it as before.
fn a_killed_daemon_queues_dels_and_returns_with_its_id_and_blocks(store: Store) {
    require_root();
    let mut cluster = Topology::tetherd(3)
        .store(store)
        .node(NodeOpts {
            // The outage must not reap it.
            node_grace_secs: 60,
            ..NodeOpts::default()
        })
        .start();
    let gone = cluster.add_pod(0);
    let kept = cluster.add_pod(0);
    let peer = cluster.add_pod(1);
    wait_routes_converge(&cluster);
    let before = get_node(cluster.node(0));

    assert!(!cluster.node_mut(0).daemon_mut().kill9().success());
    let del = cluster.node(0).del(&gone);
    assert!(del.success(), "a DEL while the daemon is down: {del}");
    assert_eq!(queued(cluster.node(0)), 1);
    // The dataplane needs no daemon.
    ping_every_pair(&[&kept, &peer]);

    cluster.node_mut(0).daemon_mut().restart();
    let log = cluster.node(0).daemon().log();
    assert!(log.contains("replayed queued DELs before serving"), "{log}");
    assert_eq!(queued(cluster.node(0)), 0);
    // The veth goes after the DEL's answer (the link reaper), as for any
    // DEL: its pod side with it, soon after.
    assert!(
        wait_until(Duration::from_secs(10), || !gone.netns().has_link("eth0")),
        "the queued DEL left eth0"
    );
    for ip in gone.ips() {
        let route = cluster.node(0).netns().exec_ok(&[
            "ip",
            "route",
            "show",
            "proto",
            "201",
            &ip.to_string(),
        ]);
        assert!(route.trim().is_empty(), "{ip}: {route}");
    }
    let after = get_node(cluster.node(0));
    assert_eq!(after.node_id, before.node_id);
    assert_eq!(after.blocks, before.blocks);
    for node in cluster.nodes() {
        assert!(
            wait_until(CONVERGE, || list_nodes(node).iter().all(|n| n.alive)),
            "{:?}",
            list_nodes(node)
        );
    }
    wait_routes_converge(&cluster);
    ping_every_pair(&[&kept, &peer]);
    // A new pod on the node comes from its blocks.
    assert_in_blocks(&cluster.add_pod(0), &after.blocks);
}

fn three_nodes_times_a_hundred_concurrent_adds(store: Store) {
    require_root();
    let cluster = Topology::tetherd(3).store(store).start();
    let pods: Vec<Pod> = parallel(300, |i| cluster.add_pod(i % 3));
    let ips: Vec<IpAddr> = pods.iter().flat_map(|p| p.ips().to_vec()).collect();
    assert_eq!(ips.len(), 600);
    assert_distinct("pod addresses", ips.iter().copied());

    let blocks = store_blocks(&cluster);
    assert_no_overlap(&blocks);
    // Every address lies in a block held by the node that handed it out.
    for p in &pods {
        for ip in p.ips() {
            let holder = blocks
                .iter()
                .find(|(b, _)| b.contains(ip))
                .map(|(_, n)| n.as_str());
            assert_eq!(
                holder,
                Some(p.node()),
                "{ip} of a pod on {}: {blocks:?}",
                p.node()
            );
        }
    }
    // 100 pods need two /26 (62 each) and two /122 (63 each) per node; a
    // concurrent burst must not grab more than it needs.
    for node in cluster.nodes() {
        let n = blocks.values().filter(|h| *h == node.name()).count();
        assert_eq!(n, 4, "{} holds {n} blocks: {blocks:?}", node.name());
    }
    wait_routes_converge(&cluster);
    let one_per_node: Vec<&Pod> = pods.iter().take(3).collect();
    ping_every_pair(&one_per_node);
    let dels = parallel(300, |i| cluster.node(i % 3).del(&pods[i]));
    for d in &dels {
        assert!(d.success(), "{d}");
    }
}

/// The Kubernetes store's objects can be written by hand: the CRDs' schemas
/// refuse what is no record (a CIDR that is none, a node ID out of range, a
/// missing field), and what passes them but is still no record (a block
/// under a name that is not its CIDR's, a VM record under another VM's
/// name) is left out by every daemon, with a warning, while the rest is
/// served and routed as before.
#[cfg_attr(
    not(feature = "cluster-tests"),
    ignore = "cluster tier: root, etcd and kube-apiserver; `make test` runs it"
)]
#[test]
fn kubernetes_store_objects_edited_by_hand_are_refused_or_left_out() {
    require_root();
    let cluster = Topology::tetherd(2).store(Store::Kubernetes).start();
    let pods: Vec<Pod> = (0..2).map(|i| cluster.add_pod(i)).collect();
    wait_routes_converge(&cluster);
    let api = cluster.kube_api();
    let object = |kind: &str, name: &str, spec: Value| {
        serde_json::json!({
            "apiVersion": "tether.dev/v1alpha1",
            "kind": kind,
            "metadata": {"name": name},
            "spec": spec,
        })
        .to_string()
    };
    let apply = |manifest: String| {
        let file = api
            .dir()
            .join(format!("{}.json", tether_e2e::unique_name("bad")));
        std::fs::write(&file, manifest).unwrap_or_else(|e| panic!("{e}"));
        api.kubectl(&["apply", "-f", &file.display().to_string()])
    };
    for (kind, name, spec, says) in [
        (
            "AddressBlock",
            "10.244.99.0-26",
            serde_json::json!({"cidr": "not a cidr", "node": "x", "node_id": 1, "claimed_unix_ms": 0}),
            "spec.cidr",
        ),
        (
            "TetherNode",
            "n",
            serde_json::json!({"name": "n", "id": 40000, "node_ips": []}),
            "spec.id",
        ),
        (
            "VMAddress",
            "ns.vm.eth0",
            serde_json::json!({"ips": ["10.244.99.1"], "mac": "0a:58:0a:f4:63:01"}),
            "spec.key",
        ),
    ] {
        let out = apply(object(kind, name, spec));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{kind} {name} was accepted");
        assert!(err.contains(says), "{kind}: {err}");
    }
    // Valid to the schema, no record to tetherd: a block named for another
    // CIDR (with a route it must not get), a VM record under another name.
    let out = apply(object(
        "AddressBlock",
        "garbage",
        serde_json::json!({"cidr": "10.244.99.0/26", "node": "nobody", "node_id": 7, "claimed_unix_ms": 0}),
    ));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = apply(object(
        "VMAddress",
        "ns.other.eth0",
        serde_json::json!({
            "key": {"namespace": "ns", "vm": "vm", "interface": "eth0"},
            "ips": ["10.244.99.1"], "mac": "0a:58:0a:f4:63:01", "origin": "reserved",
            "generation": 1, "created_unix_ms": 0,
        }),
    ));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for node in cluster.nodes() {
        assert!(
            wait_until(CONVERGE, || node
                .daemon()
                .log()
                .contains("ignoring an object that is no tether record")),
            "{} said nothing of the garbage",
            node.name()
        );
        assert!(
            !node
                .cluster_route_dsts()
                .contains(&"10.244.99.0/26".to_owned()),
            "{} routes a block that is no record",
            node.name()
        );
    }
    // The rest goes on: a new pod, pings across the nodes, and a restart,
    // which lists everything again.
    let mut pods = pods;
    pods.push(cluster.add_pod(1));
    ping_every_pair(&pods.iter().collect::<Vec<_>>());
    let mut cluster = cluster;
    cluster.node_mut(0).daemon_mut().restart();
    assert!(!cluster
        .node(0)
        .cluster_route_dsts()
        .contains(&"10.244.99.0/26".to_owned()));
    ping_every_pair(&pods.iter().collect::<Vec<_>>());
    // Gone again, the blocks the harness reads are tetherd's alone.
    cluster
        .kube_api()
        .kubectl_ok(&["delete", "addressblock/garbage", "vmaddress/ns.other.eth0"]);
    wait_routes_converge(&cluster);
}

/// A child process killed (SIGKILL, by our own handle) and reaped on drop.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs openssl with `args` in `dir`; panics with its stderr on failure.
fn openssl(dir: &std::path::Path, args: &[&str]) {
    let out = std::process::Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("spawning openssl: {e}"));
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA, a server certificate for `ip` and a client certificate, in `dir`.
fn make_certs(dir: &std::path::Path, ip: &str) {
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    let req = |name: &str, cn: &str| {
        let key = format!("{name}-key.pem");
        let csr = format!("{name}.csr");
        let subj = format!("/CN={cn}");
        let mut a = vec!["req"];
        a.extend(ec);
        a.extend(["-keyout", &key, "-out", &csr, "-subj", &subj]);
        openssl(dir, &a);
    };
    let mut ca = vec!["req", "-x509"];
    ca.extend(ec);
    ca.extend([
        "-keyout",
        "ca-key.pem",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=tether-test-ca",
    ]);
    openssl(dir, &ca);
    req("server", "etcd");
    req("client", "tetherd");
    let ext = |name: &str, text: String| {
        std::fs::write(dir.join(name), text).unwrap_or_else(|e| panic!("{name}: {e}"));
    };
    ext(
        "server.ext",
        format!("subjectAltName=IP:{ip}\nextendedKeyUsage=serverAuth\n"),
    );
    ext("client.ext", "extendedKeyUsage=clientAuth\n".to_owned());
    for name in ["server", "client"] {
        let (csr, pem, extfile) = (
            format!("{name}.csr"),
            format!("{name}.pem"),
            format!("{name}.ext"),
        );
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca-key.pem",
                "-CAcreateserial",
                "-out",
                &pem,
                "-days",
                "2",
                "-extfile",
                &extfile,
            ],
        );
    }
}

/// The TLS flags work: tetherd joins an etcd that serves HTTPS only and
/// requires client certificates (mutual TLS), with a CA of the test's own.
#[cfg_attr(
    not(feature = "cluster-tests"),
    ignore = "cluster tier: root, etcd and kube-apiserver; `make test` runs it"
)]
#[test]
fn etcd_with_mutual_tls() {
    require_root();
    let dir = tether_e2e::TempDir::new("tls");
    let d = dir.path();
    make_certs(d, "127.0.0.1");
    let node_ns = Netns::new("node");
    node_ns.exec_ok(&["ip", "link", "set", "lo", "up"]);
    let p = |f: &str| d.join(f).display().to_string();
    let etcd = Reaped(
        std::process::Command::new("ip")
            .args(["netns", "exec", node_ns.name(), "etcd", "--name", "e1"])
            .args(["--data-dir", &p("etcd")])
            .args(["--listen-client-urls", "https://127.0.0.1:2379"])
            .args(["--advertise-client-urls", "https://127.0.0.1:2379"])
            .args(["--listen-peer-urls", "http://127.0.0.1:2380"])
            .args(["--initial-advertise-peer-urls", "http://127.0.0.1:2380"])
            .args(["--initial-cluster", "e1=http://127.0.0.1:2380"])
            .args([
                "--cert-file",
                &p("server.pem"),
                "--key-file",
                &p("server-key.pem"),
            ])
            .args(["--trusted-ca-file", &p("ca.pem"), "--client-cert-auth"])
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(d.join("etcd.log")).unwrap_or_else(|e| panic!("{e}")))
            .spawn()
            .unwrap_or_else(|e| panic!("spawning etcd: {e}")),
    );
    let health = || {
        node_ns
            .exec(&[
                "env",
                "ETCDCTL_API=3",
                "etcdctl",
                "--endpoints",
                "https://127.0.0.1:2379",
                "--cacert",
                &p("ca.pem"),
                "--cert",
                &p("client.pem"),
                "--key",
                &p("client-key.pem"),
                "endpoint",
                "health",
            ])
            .status
            .success()
    };
    assert!(
        wait_until(Duration::from_secs(20), health),
        "etcd with TLS did not come up"
    );

    let daemon = tether_e2e::Daemon::start_in(
        node_ns,
        tether_e2e::DaemonOpts {
            extra_args: [
                "--store",
                "etcd",
                "--etcd-endpoints",
                "https://127.0.0.1:2379",
                "--etcd-ca",
                &p("ca.pem"),
                "--etcd-cert",
                &p("client.pem"),
                "--etcd-key",
                &p("client-key.pem"),
                "--cluster-cidr",
                "10.244.0.0/24",
                "--node-ip",
                "192.0.2.1",
            ]
            .map(str::to_owned)
            .to_vec(),
            ..Default::default()
        },
    );
    let node = admin::node(daemon.socket());
    assert_eq!(node.store_backend, "etcd");
    assert!(node.store_health.is_some_and(|h| h.healthy));
    assert_eq!(node.blocks.len(), 1, "{:?}", node.blocks);
    drop(daemon);
    drop(etcd);
}

/// A daemon waiting for an etcd that does not answer has not served yet;
/// SIGTERM still stops it cleanly (exit 0), and it says where it was.
#[cfg_attr(
    not(feature = "cluster-tests"),
    ignore = "cluster tier: root, etcd and kube-apiserver; `make test` runs it"
)]
#[test]
fn sigterm_while_waiting_for_etcd_exits_cleanly() {
    require_root();
    let ns = Netns::new("node");
    ns.exec_ok(&["ip", "link", "set", "lo", "up"]);
    let dir = tether_e2e::TempDir::new("wait");
    let log_path = dir.path().join("tetherd.log");
    let log = std::fs::File::create(&log_path).unwrap_or_else(|e| panic!("{e}"));
    let socket = dir.path().join("s.sock").display().to_string();
    let state = dir.path().display().to_string();
    let bin = tether_e2e::tetherd_bin().display().to_string();
    // Port 1 of the netns's own loopback: refused at once, nothing leaves.
    let args = [
        "netns",
        "exec",
        ns.name(),
        &bin,
        "--node-name",
        "w",
        "--socket",
        &socket,
        "--state-dir",
        &state,
        "--store",
        "etcd",
        "--etcd-endpoints",
        "http://127.0.0.1:1",
        "--cluster-cidr",
        "10.244.0.0/24",
        "--node-ip",
        "192.0.2.1",
    ];
    let mut child = Reaped(
        std::process::Command::new("ip")
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("spawning tetherd: {e}")),
    );
    let read_log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(
        wait_until(CONVERGE, || read_log()
            .contains("did not answer the registration; retrying")),
        "{}",
        read_log()
    );
    assert!(
        !std::path::Path::new(&socket).exists(),
        "served without etcd"
    );
    // SAFETY: kill(2) on the PID of our own unreaped child (`ip netns exec`
    // execs tetherd, so it is tetherd's).
    unsafe { libc::kill(child.0.id() as libc::pid_t, libc::SIGTERM) };
    let status = child.0.wait().unwrap_or_else(|e| panic!("{e}"));
    assert!(status.success(), "{status}: {}", read_log());
    assert!(
        read_log().contains("stopped before joining the cluster"),
        "{}",
        read_log()
    );
}

/// ADD on `node`, again while it fails with 11 (as a runtime retries), up
/// to `limit`; the pod, or the last failure.
fn add_retrying(node: &ClusterNode, limit: Duration) -> Result<Pod, CniOutput> {
    let deadline = std::time::Instant::now() + limit;
    loop {
        let (ns, out) = add(node);
        if out.success() {
            let id = ns.name().to_owned();
            return Ok(Pod::from_output(ns, id, node.name(), &out));
        }
        if out.error_code() != Some(11) || std::time::Instant::now() >= deadline {
            return Err(out);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The API server's answers to tetherd (its user agent) whose status code
/// `pick` accepts, from the server's audit log.
fn answered_tetherd(cluster: &Cluster, pick: impl Fn(u64) -> bool) -> usize {
    cluster
        .kube_api()
        .audit_events()
        .iter()
        .filter(|e| e["stage"] == "ResponseComplete")
        .filter(|e| {
            e["userAgent"]
                .as_str()
                .is_some_and(|ua| ua.starts_with("tetherd/"))
        })
        .filter(|e| e["responseStatus"]["code"].as_u64().is_some_and(&pick))
        .count()
}

/// The Kubernetes store under a real API server that answers 429 and
/// 5xx, as one under load or whose etcd stalls does:
/// - throttled (`--max-requests-inflight 1` and
///   `--max-mutating-requests-inflight 1`, priority and fairness off, so
///   that a second request in flight is answered 429) while 3 nodes race
///   for tiny blocks (409s between them): every ADD succeeds (retried on
///   11, as runtimes do), no address is handed out twice, no block is held
///   twice, and VM records reserved meanwhile are all there after;
/// - its etcd frozen (SIGSTOP) behind a 1 s `--request-timeout`, so that
///   every write is answered 504 before tetherd's own timeout: an ADD from
///   the blocks held works, one that needs a block fails with 11, and
///   when etcd resumes claims work again, still with no block held twice
///   and every VM record in place.
///
/// The test fails if the server answered no 429 (or no 5xx): then it
/// proved nothing.
#[cfg_attr(
    not(feature = "cluster-tests"),
    ignore = "cluster tier: root, etcd and kube-apiserver; `make test` runs it"
)]
#[test]
fn kubernetes_store_answers_429_and_5xx_lose_nothing_and_hold_no_block_twice() {
    require_root();
    let mut cluster = Topology::tetherd(3)
        .store(Store::Kubernetes)
        .node(NodeOpts {
            // Longer than the API server's 1 s request timeout below, so
            // that its 504 comes first.
            etcd_timeout_ms: Some(3000),
            ..small_blocks()
        })
        .start();
    cluster.kube_api_mut().restart_apiserver_with(&[
        "--enable-priority-and-fairness=false",
        "--max-requests-inflight=1",
        "--max-mutating-requests-inflight=1",
        "--request-timeout=1s",
    ]);
    let pods: Vec<Pod> = parallel(30, |i| {
        add_retrying(cluster.node(i % 3), Duration::from_secs(120))
            .unwrap_or_else(|out| panic!("ADD on node {} under 429s: {out}", i % 3))
    });
    let throttled = answered_tetherd(&cluster, |c| c == 429);
    assert!(
        throttled > 0,
        "the API server answered tetherd no 429: the test proved nothing"
    );
    eprintln!("the API server answered tetherd 429 {throttled} times");
    assert_distinct("pod addresses", pods.iter().flat_map(|p| p.ips().to_vec()));
    assert_no_overlap(&store_blocks(&cluster));

    // VM records reserved under the same throttling, from the addresses
    // of pods deleted for them.
    let mut vms = Vec::new();
    let mut kept = Vec::new();
    for (i, pod) in pods.into_iter().enumerate() {
        if i >= 3 {
            kept.push(pod);
            continue;
        }
        let node = cluster
            .nodes()
            .iter()
            .find(|n| n.name() == pod.node())
            .unwrap_or_else(|| panic!("the node of {}", pod.id()));
        assert!(node.del(&pod).success());
        let name = format!("vm{i}");
        let ips = pod.ips().to_vec();
        let reserved = wait_until(Duration::from_secs(60), || {
            reserve_vm(node.daemon().socket(), "tenant", &name, &ips, "").is_ok()
        });
        assert!(reserved, "{name} not reserved under 429s");
        vms.push((name, ips));
    }
    let all_there = |cluster: &Cluster| {
        vms.iter().all(|(name, ips)| {
            get_vm(cluster.node(0).daemon().socket(), "tenant", name).is_ok_and(|v| {
                let held: Vec<IpAddr> = v
                    .ips
                    .iter()
                    .filter_map(|ip| ip.split('/').next()?.parse().ok())
                    .collect();
                held == *ips
            })
        })
    };
    let records = |cluster: &Cluster| -> Vec<String> {
        vms.iter()
            .map(|(name, _)| {
                format!(
                    "{name}: {:?}",
                    get_vm(cluster.node(0).daemon().socket(), "tenant", name)
                )
            })
            .collect()
    };
    assert!(
        wait_until(CONVERGE, || all_there(&cluster)),
        "a VM record went missing: {:?} against {vms:?}",
        records(&cluster)
    );

    // The API server's etcd stalls: every write is answered 504.
    let failed_before = answered_tetherd(&cluster, |c| c >= 500);
    // One address of each family free on node 0.
    let first = kept
        .iter()
        .position(|p| p.node() == cluster.node(0).name())
        .unwrap_or_else(|| panic!("no pod on node 0"));
    let freed = kept.remove(first);
    assert!(cluster.node(0).del(&freed).success());
    drop(freed);
    cluster.kube_api().freeze_etcd(true);
    let (from_held, out) = add(cluster.node(0));
    assert!(out.success(), "an ADD from a held block: {out}");
    let needs_block = loop {
        let (ns, out) = add(cluster.node(0));
        if !out.success() {
            break out;
        }
        let id = ns.name().to_owned();
        kept.push(Pod::from_output(ns, id, cluster.node(0).name(), &out));
        assert!(kept.len() < 60, "ADDs kept succeeding with etcd frozen");
    };
    assert_eq!(needs_block.error_code(), Some(11), "{needs_block}");
    eprintln!("with etcd frozen, an ADD that needs a block: {needs_block}");
    cluster.kube_api().freeze_etcd(false);
    let failed = answered_tetherd(&cluster, |c| c >= 500) - failed_before;
    assert!(
        failed > 0,
        "the API server answered tetherd no 5xx while its etcd was frozen: the test proved nothing"
    );
    eprintln!("the API server answered tetherd 5xx {failed} times");
    drop(from_held);

    // etcd is back: claims work again; nothing is held twice or lost.
    let pod = add_retrying(cluster.node(0), Duration::from_secs(60))
        .unwrap_or_else(|out| panic!("an ADD needing a block after etcd resumed: {out}"));
    kept.push(pod);
    assert_distinct("pod addresses", kept.iter().flat_map(|p| p.ips().to_vec()));
    assert_no_overlap(&store_blocks(&cluster));
    assert!(
        wait_until(CONVERGE, || all_there(&cluster)),
        "a VM record went missing after the 5xx answers: {:?} against {vms:?}",
        records(&cluster)
    );
}
