//! NetworkPolicy, enforced by tetherd (`--network-policy`) on two nodes of
//! the Kubernetes store, against a real kube-apiserver and the chart's
//! RBAC (tether's service-account token): pods are objects of the API
//! (no kubelet runs, so the test writes their `status.podIPs` as a
//! kubelet would), wired through the real plugin, and reached with ping
//! across the nodes.
//!
//! - a podSelector rule lets the selected pods in and keeps the others
//!   out; a namespaceSelector rule lets another namespace in; deleting
//!   the policy opens the pod again;
//! - a default deny of ingress holds for a pod from the moment its ADD
//!   returns;
//! - an egress policy keeps the pod it selects from reaching others, and
//!   replies to what others start still reach it;
//! - the drops are counted per policy and direction in `/metrics`, and
//!   the admin API's `GetPodPolicy` says which policy isolates a pod and
//!   what it allows;
//! - a killed daemon leaves the table enforcing, and a policy deleted
//!   while it was away is applied when it is back;
//! - a node cut off from the API server (its packets to it dropped in its
//!   netns; its store, etcd, still reachable) keeps enforcing the last
//!   table, and a policy deleted meanwhile is applied once it reaches the
//!   API server again.

use std::net::IpAddr;
use std::time::Duration;

use serde_json::json;
use tether_e2e::admin::{admin, pb};
use tether_e2e::cluster::{ClusterNode, NodeOpts, Pod, Store};
use tether_e2e::kube::{KubeApi, API_PORT};
use tether_e2e::topology::Topology;
use tether_e2e::{netpol, require_root, wait_until};

/// Policy changes reach the nodes through watches: allow for it.
const CONVERGE: Duration = Duration::from_secs(20);
/// Where each daemon serves its metrics, in its node netns.
const METRICS: &str = "127.0.0.1:9654";

/// Creates namespace `ns` labelled `team=<team>`.
fn namespace(api: &KubeApi, ns: &str, team: &str) {
    netpol::namespace(api, ns, json!({ "team": team }));
}

fn v4(p: &Pod) -> IpAddr {
    p.v4().expect("an IPv4 address")
}

/// Waits until `from` reaches `to` (`reach`) or stops reaching it, and
/// then checks that it stays so for three more pings.
fn settles(from: &Pod, to: &Pod, reach: bool, what: &str) {
    assert!(
        wait_until(CONVERGE, || from.ping(v4(to)) == reach),
        "{what}: {} -> {} still {} after {CONVERGE:?}",
        from.id(),
        v4(to),
        if reach { "blocked" } else { "passes" }
    );
    for _ in 0..3 {
        assert_eq!(from.ping(v4(to)), reach, "{what}: it changed again");
    }
}

/// Packets `policy` dropped in `direction` on `node`, as its daemon's
/// `/metrics` says.
fn dropped(node: &ClusterNode, policy: &str, direction: &str) -> f64 {
    let url = format!("http://{METRICS}/metrics");
    let out = node
        .netns()
        .exec(&["curl", "-sS", "--fail", "--max-time", "5", &url]);
    assert!(out.status.success(), "scraping {url} on {}", node.name());
    let text = String::from_utf8_lossy(&out.stdout);
    let series = format!(
        "tether_network_policy_dropped_packets_total{{policy=\"{policy}\",direction=\"{direction}\"}} "
    );
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {series} in the scrape:\n{text}"))
}

#[cfg_attr(
    not(feature = "cluster-tests"),
    ignore = "cluster tier: root, kube-apiserver and helm; `make test` runs it"
)]
#[test]
fn network_policy_isolates_pods_across_nodes_from_their_add_and_through_a_restart() {
    require_root();
    let mut cluster = Topology::tetherd(2)
        .store(Store::Kubernetes)
        .node(NodeOpts {
            extra_args: vec![
                "--network-policy=true".into(),
                format!("--metrics-address={METRICS}"),
            ],
            ..NodeOpts::default()
        })
        .start();
    let api = cluster.kube_api();
    namespace(api, "np-a", "a");
    namespace(api, "np-b", "b");
    let db = netpol::api_pod(api, cluster.node(0), "np-a", "db", "db");
    let web_a = netpol::api_pod(api, cluster.node(1), "np-a", "web", "web");
    let web_b = netpol::api_pod(api, cluster.node(1), "np-b", "web", "web");
    let other_a = netpol::api_pod(api, cluster.node(1), "np-a", "other", "other");
    // No policy: everyone reaches everyone.
    for from in [&web_a, &web_b, &other_a] {
        settles(from, &db, true, "no policy");
    }

    // 1. Only app=web of np-a may reach db.
    netpol::apply_policy(
        api,
        "np-a",
        "db-from-web",
        json!({"podSelector": {"matchLabels": {"app": "db"}},
               "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}]}]}),
    );
    settles(&web_b, &db, false, "another namespace's web");
    settles(&other_a, &db, false, "np-a's other app");
    settles(&web_a, &db, true, "np-a's web");
    // Each refused ping was counted against the policy, on db's node.
    let counted = dropped(cluster.node(0), "np-a/db-from-web", "ingress");
    assert!(
        counted >= 6.0,
        "{counted} drops counted for 6 refused pings or more"
    );
    // The admin API says why, on db's node: the policy, and that only
    // np-a's web may come in.
    let why = admin(cluster.node(0).daemon().socket(), |mut c| async move {
        c.get_pod_policy(pb::GetPodPolicyRequest {
            namespace: "np-a".into(),
            name: "db".into(),
        })
        .await
    });
    assert!(why.local, "{why:?}");
    assert!(
        why.egress.is_none(),
        "db is not isolated for egress: {why:?}"
    );
    let ingress = why.ingress.expect("db is isolated for ingress");
    assert_eq!(ingress.policies, vec!["np-a/db-from-web".to_string()]);
    let mut peers: Vec<String> = ingress
        .allows
        .iter()
        .flat_map(|a| a.peers.clone())
        .collect();
    peers.sort();
    let mut want: Vec<String> = web_a
        .ips()
        .iter()
        .map(|ip| format!("{ip}/{}", if ip.is_ipv4() { 32 } else { 128 }))
        .collect();
    want.sort();
    assert_eq!(
        peers, want,
        "np-a's web alone, by its addresses: {ingress:?}"
    );
    assert!(ingress.allows.iter().all(|a| a.any_port && !a.any_peer));
    // db's own traffic is not isolated (ingress only): it reaches them
    // all, and their replies come back.
    settles(&db, &web_b, true, "db's egress");

    // 2. And namespace team=b too.
    netpol::apply_policy(
        api,
        "np-a",
        "db-from-team-b",
        json!({"podSelector": {"matchLabels": {"app": "db"}},
               "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"team": "b"}}}]}]}),
    );
    settles(&web_b, &db, true, "team b, by its namespace");
    settles(&other_a, &db, false, "np-a's other app, still");

    // 3. The policies deleted: db is open again.
    api.kubectl_ok(&[
        "-n",
        "np-a",
        "delete",
        "networkpolicy",
        "db-from-web",
        "db-from-team-b",
    ]);
    settles(&other_a, &db, true, "no policy again");

    // 4. Egress: web of np-a may start nothing; what db starts still gets
    //    web's replies.
    netpol::apply_policy(
        api,
        "np-a",
        "web-no-egress",
        json!({"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Egress"]}),
    );
    settles(&web_a, &db, false, "web's egress, denied");
    settles(&db, &web_a, true, "replies to what db starts");
    api.kubectl_ok(&["-n", "np-a", "delete", "networkpolicy", "web-no-egress"]);

    // 5. A default deny of ingress in np-a holds for a pod from the moment
    //    its ADD returns: the first ping to it fails.
    netpol::apply_policy(api, "np-a", "deny-all", json!({"podSelector": {}}));
    settles(&web_b, &db, false, "default deny");
    let late = netpol::api_pod(api, cluster.node(0), "np-a", "late", "late");
    assert!(
        !web_b.ping(v4(&late)),
        "a pod added under a default deny was reachable right after its ADD"
    );
    settles(&web_b, &late, false, "default deny, a later pod");

    // 6. node 0's daemon killed: its table stays, db stays isolated; the
    //    deny deleted meanwhile is applied once the daemon is back.
    let status = cluster.node_mut(0).daemon_mut().kill9();
    assert!(!status.success(), "the daemon was killed: {status}");
    let api = cluster.kube_api();
    assert!(!web_b.ping(v4(&db)), "the table went with the daemon");
    api.kubectl_ok(&["-n", "np-a", "delete", "networkpolicy", "deny-all"]);
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        !web_b.ping(v4(&db)),
        "nothing opened db while its daemon was away"
    );
    cluster.node_mut(0).daemon_mut().restart();
    settles(
        &web_b,
        &db,
        true,
        "the deny deleted while the daemon was away",
    );
    settles(&web_b, &late, true, "and the later pod");
}

/// Drops (`on`) or passes again every packet between `node` and the API
/// server's port, both ways (a watch's events come in on a connection the
/// node opened), in the node's own netns: the node is cut off from the API
/// server while the test still reaches it.
fn cut_off_from_the_api(node: &ClusterNode, on: bool) {
    let script = if on {
        format!(
            "add table inet test_api_cut; \
             add chain inet test_api_cut out {{ type filter hook output priority 0; }}; \
             add rule inet test_api_cut out tcp dport {API_PORT} drop; \
             add chain inet test_api_cut in {{ type filter hook input priority 0; }}; \
             add rule inet test_api_cut in tcp sport {API_PORT} drop"
        )
    } else {
        "delete table inet test_api_cut".to_owned()
    };
    let out = node.netns().exec(&["nft", &script]);
    assert!(
        out.status.success(),
        "nft {script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[cfg_attr(
    not(feature = "cluster-tests"),
    ignore = "cluster tier: root, etcd and kube-apiserver; `make test` runs it"
)]
#[test]
fn a_policy_deleted_while_a_node_cannot_reach_the_api_server_is_applied_when_it_can() {
    require_root();
    let cluster = Topology::tetherd(2)
        .store(Store::Etcd)
        .with_api(true)
        .node(NodeOpts {
            extra_args: vec!["--network-policy=true".into()],
            ..NodeOpts::default()
        })
        .start();
    let api = cluster.kube_api();
    namespace(api, "np-a", "a");
    let db = netpol::api_pod(api, cluster.node(0), "np-a", "db", "db");
    let web = netpol::api_pod(api, cluster.node(1), "np-a", "web", "web");
    settles(&web, &db, true, "no policy");
    netpol::apply_policy(
        api,
        "np-a",
        "deny-db",
        json!({"podSelector": {"matchLabels": {"app": "db"}}, "policyTypes": ["Ingress"]}),
    );
    settles(&web, &db, false, "db denied every ingress");

    // Node 0 loses the API server; the deny is deleted meanwhile.
    cut_off_from_the_api(cluster.node(0), true);
    api.kubectl_ok(&["-n", "np-a", "delete", "networkpolicy", "deny-db"]);
    std::thread::sleep(Duration::from_secs(5));
    let still = !web.ping(v4(&db));
    cut_off_from_the_api(cluster.node(0), false);
    assert!(
        still,
        "db opened while its node could not have seen the deletion"
    );
    settles(
        &web,
        &db,
        true,
        "the deny deleted while db's node could not reach the API server",
    );
}
