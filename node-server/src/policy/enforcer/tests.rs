//! The enforcer against the fake host: what its table holds after the
//! watches' changes and the node's ADDs, and when an ADD may return.

use super::*;
use crate::policy::model::namespace_labels;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use serde_json::{json, Value};
use tether_kernel::fake::FakeHost;

/// The API as a stub: the pods it holds, and whether it answers.
#[derive(Default)]
struct Api {
    pods: Mutex<BTreeMap<String, Pod>>,
    down: Mutex<bool>,
}

impl PodSource for Api {
    fn pod<'a>(&'a self, namespace: &'a str, name: &'a str) -> BoxFuture<'a, Result<Option<Pod>>> {
        let answer = if *lock(&self.down) {
            Err(Error::TryAgain("connection refused".into()))
        } else {
            Ok(lock(&self.pods).get(&pod_key(namespace, name)).cloned())
        };
        Box::pin(async move { answer })
    }
}

fn pod(ns: &str, name: &str, labels: Value) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"namespace": ns, "name": name, "labels": labels},
        "spec": {"containers": [{"name": "c"}], "nodeName": "n1"},
    }))
    .expect("a Pod")
}

fn namespace(name: &str) -> Namespace {
    serde_json::from_value(
        json!({"metadata": {"name": name, "labels": {"kubernetes.io/metadata.name": name}}}),
    )
    .expect("a Namespace")
}

/// Default deny of ingress for the pods labelled app=db of `ns`.
fn deny_db(ns: &str) -> NetworkPolicy {
    serde_json::from_value(json!({
        "metadata": {"namespace": ns, "name": "deny-db"},
        "spec": {"podSelector": {"matchLabels": {"app": "db"}}, "policyTypes": ["Ingress"]},
    }))
    .expect("a NetworkPolicy")
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("an IP")
}

struct Setup {
    host: Arc<FakeHost>,
    api: Arc<Api>,
    enforcer: Arc<Enforcer>,
}

/// An enforcer whose watches have listed namespace `x` with pods `db`
/// (app=db) and `web` (app=web), and `policies`.
fn listed(policies: Vec<NetworkPolicy>) -> Setup {
    let s = unlisted();
    list(
        &s.enforcer,
        vec![
            pod("x", "db", json!({"app": "db"})),
            pod("x", "web", json!({"app": "web"})),
        ],
        policies,
    );
    s
}

/// The watches list namespace `x`, `pods` and `policies`.
fn list(e: &Enforcer, pods: Vec<Pod>, policies: Vec<NetworkPolicy>) {
    e.relisted(
        Kind::Namespaces,
        vec![(
            "x".into(),
            Change::Namespace(Some(namespace_labels(&namespace("x")).1)),
        )],
    );
    e.relisted(
        Kind::Pods,
        pods.iter()
            .map(|p| (pod_key_of(p), Change::Pod(Some(PodView::from_k8s(p)))))
            .collect(),
    );
    e.relisted(
        Kind::Policies,
        policies
            .iter()
            .map(|p| (policy_key(p), Change::Policy(Some(Policy::from_k8s(p)))))
            .collect(),
    );
}

fn pod_key_of(p: &Pod) -> String {
    pod_key(
        p.metadata.namespace.as_deref().unwrap_or_default(),
        p.metadata.name.as_deref().unwrap_or_default(),
    )
}

fn policy_key(p: &NetworkPolicy) -> String {
    pod_key(
        p.metadata.namespace.as_deref().unwrap_or_default(),
        p.metadata.name.as_deref().unwrap_or_default(),
    )
}

/// A watch sees pod `p` (new or changed).
fn set_pod(e: &Enforcer, p: &Pod) {
    e.change(&pod_key_of(p), Change::Pod(Some(PodView::from_k8s(p))));
}

/// A watch sees policy `p` (new or changed).
fn set_policy(e: &Enforcer, p: &NetworkPolicy) {
    e.change(&policy_key(p), Change::Policy(Some(Policy::from_k8s(p))));
}

fn unlisted() -> Setup {
    let host = Arc::new(FakeHost::new());
    let api = Arc::new(Api::default());
    // A shorter wait for the ADDs than the daemon's, so that the test of
    // its end ends soon, long enough for a loaded machine's writes.
    let enforcer = Enforcer::new(host.clone(), api.clone(), Duration::from_secs(2));
    enforcer.start();
    Setup {
        host,
        api,
        enforcer,
    }
}

fn isolated(host: &FakeHost) -> Vec<(String, Vec<IpAddr>)> {
    host.policy()
        .map(|p| {
            p.pods()
                .iter()
                .map(|p| (p.pod.clone(), p.ips.clone()))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn an_add_returns_once_its_pods_isolation_is_in_the_table() {
    let s = listed(vec![deny_db("x")]);
    s.enforcer
        .admit("c1/eth0", "x", "db", &[ip("10.0.0.5")])
        .await
        .expect("admitted");
    // The API has no address for the pod yet: the one the ADD gave it is
    // in the table.
    assert_eq!(
        isolated(&s.host),
        vec![("x/db".to_string(), vec![ip("10.0.0.5")])]
    );
    let plan = s.host.policy().expect("a table");
    let ingress = plan.pods()[0]
        .ingress
        .as_ref()
        .expect("isolated for ingress");
    assert!(ingress.allows.is_empty(), "default deny allows nothing");
    assert!(plan.pods()[0].egress.is_none(), "egress is not isolated");
}

#[tokio::test]
async fn a_pod_no_policy_selects_is_left_open_and_the_table_is_not_rewritten() {
    let s = listed(vec![deny_db("x")]);
    s.enforcer
        .admit("c1/eth0", "x", "db", &[ip("10.0.0.5")])
        .await
        .expect("admitted");
    let writes = s.host.policy_writes();
    s.enforcer
        .admit("c2/eth0", "x", "web", &[ip("10.0.0.6")])
        .await
        .expect("admitted");
    assert_eq!(
        isolated(&s.host),
        vec![("x/db".to_string(), vec![ip("10.0.0.5")])]
    );
    assert_eq!(
        s.host.policy_writes(),
        writes,
        "the same table is not written again"
    );
}

#[tokio::test]
async fn a_policy_added_later_isolates_a_running_pod_and_its_deletion_opens_it() {
    let s = listed(Vec::new());
    s.enforcer
        .admit("c1/eth0", "x", "db", &[ip("10.0.0.5")])
        .await
        .expect("admitted");
    assert!(isolated(&s.host).is_empty());
    set_policy(&s.enforcer, &deny_db("x"));
    let host = s.host.clone();
    wait(|| isolated(&host).len() == 1).await;
    s.enforcer.change("x/deny-db", Change::Policy(None));
    wait(|| isolated(&host).is_empty()).await;
}

#[tokio::test]
async fn a_torn_down_pod_leaves_the_table() {
    let s = listed(vec![deny_db("x")]);
    s.enforcer
        .admit("c1/eth0", "x", "db", &[ip("10.0.0.5")])
        .await
        .expect("admitted");
    s.enforcer.forget("c1/eth0");
    let host = s.host.clone();
    wait(|| isolated(&host).is_empty()).await;
}

#[tokio::test]
async fn a_pod_the_watch_has_not_delivered_is_read_from_the_api() {
    let s = listed(vec![deny_db("x")]);
    lock(&s.api.pods).insert("x/db2".into(), pod("x", "db2", json!({"app": "db"})));
    s.enforcer
        .admit("c3/eth0", "x", "db2", &[ip("10.0.0.7")])
        .await
        .expect("admitted");
    assert_eq!(
        isolated(&s.host),
        vec![("x/db2".to_string(), vec![ip("10.0.0.7")])]
    );
}

#[tokio::test]
async fn an_add_fails_to_try_again_when_its_pod_cannot_be_read() {
    let s = listed(vec![deny_db("x")]);
    *lock(&s.api.down) = true;
    let e = s
        .enforcer
        .admit("c3/eth0", "x", "db2", &[ip("10.0.0.7")])
        .await
        .expect_err("the API is down");
    assert!(
        matches!(&e, Error::TryAgain(m) if m.contains("reading pod x/db2")),
        "{e}"
    );
}

#[tokio::test]
async fn an_add_waits_for_the_lists_and_fails_to_try_again_without_them() {
    let s = unlisted();
    let e = s
        .enforcer
        .admit("c1/eth0", "x", "web", &[ip("10.0.0.6")])
        .await
        .expect_err("nothing listed");
    assert!(
        matches!(&e, Error::TryAgain(m) if m.contains("have not all been listed")),
        "{e}"
    );
    assert_eq!(s.host.policy_writes(), 0, "no table from half a listing");
}

#[tokio::test]
async fn an_add_waiting_for_the_lists_returns_once_they_are_complete() {
    let s = unlisted();
    let enforcer = s.enforcer.clone();
    let add = tokio::spawn(async move {
        enforcer
            .admit("c1/eth0", "x", "db", &[ip("10.0.0.5")])
            .await
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!add.is_finished(), "the ADD waits for the lists");
    list(
        &s.enforcer,
        vec![pod("x", "db", json!({"app": "db"}))],
        vec![deny_db("x")],
    );
    add.await.expect("joined").expect("admitted");
    assert_eq!(
        isolated(&s.host),
        vec![("x/db".to_string(), vec![ip("10.0.0.5")])]
    );
}

#[tokio::test]
async fn a_refused_table_fails_the_add_and_is_written_once_the_kernel_takes_it() {
    let s = listed(vec![deny_db("x")]);
    s.host.refuse_policy(true);
    let e = s
        .enforcer
        .admit("c1/eth0", "x", "db", &[ip("10.0.0.5")])
        .await
        .expect_err("refused");
    assert!(
        matches!(&e, Error::TryAgain(m) if m.contains("the kernel refused")),
        "{e}"
    );
    s.enforcer.forget("c1/eth0");
    s.host.refuse_policy(false);
    // The loop tries again by itself; the retried ADD then succeeds.
    s.enforcer
        .admit("c1/eth0", "x", "db", &[ip("10.0.0.5")])
        .await
        .expect("admitted");
    assert_eq!(isolated(&s.host).len(), 1);
}

#[tokio::test]
async fn drops_are_counted_per_policy_and_direction_across_new_tables() {
    let s = listed(vec![deny_db("x")]);
    s.enforcer
        .admit("c1/eth0", "x", "db", &[ip("10.0.0.5")])
        .await
        .expect("admitted");
    let counter = PolicyPlan::counter_name("x/deny-db", true);
    assert_eq!(s.enforcer.drops(), vec![("x/deny-db".to_string(), true, 0)]);
    s.host.count_policy_drop(&counter, 3);
    assert_eq!(s.enforcer.drops(), vec![("x/deny-db".to_string(), true, 3)]);
    // Another pod the policy selects: a new table, whose counters start
    // from zero; the 3 are carried over.
    set_pod(&s.enforcer, &pod("x", "db2", json!({"app": "db"})));
    let writes = s.host.policy_writes();
    s.enforcer
        .admit("c2/eth0", "x", "db2", &[ip("10.0.0.7")])
        .await
        .expect("admitted");
    assert!(s.host.policy_writes() > writes, "a new table");
    s.host.count_policy_drop(&counter, 2);
    assert_eq!(s.enforcer.drops(), vec![("x/deny-db".to_string(), true, 5)]);
}

async fn wait(mut done: impl FnMut() -> bool) {
    for _ in 0..200 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the table never became what was expected");
}

/// `n` pods of namespace `x` that live on another node, each with an
/// address and label `group=g<i mod 10>`.
fn elsewhere(n: usize) -> Vec<Pod> {
    (0..n)
        .map(|i| {
            let mut p = pod(
                "x",
                &format!("m{i}"),
                json!({"group": format!("g{}", i % 10)}),
            );
            p.status = Some(
                serde_json::from_value(json!({"phase": "Running",
                    "podIPs": [{"ip": format!("10.9.{}.{}", i / 250, i % 250 + 1)}]}))
                .expect("a status"),
            );
            p
        })
        .collect()
}

#[tokio::test]
async fn an_add_plans_its_own_pod_alone_whatever_the_cluster_holds() {
    let s = unlisted();
    // 1,000 pods elsewhere, 100 policies on them, and a deny-all on the
    // node's pods labelled app=db (which names no pods).
    let mut policies: Vec<NetworkPolicy> = (0..100)
        .map(|i| {
            serde_json::from_value(json!({
                "metadata": {"namespace": "x", "name": format!("bg{i}")},
                "spec": {"podSelector": {"matchLabels": {"group": format!("g{}", i % 10)}},
                         "ingress": [{"from": [{"podSelector": {"matchLabels":
                             {"group": format!("g{}", (i + 1) % 10)}}}]}]},
            }))
            .expect("a NetworkPolicy")
        })
        .collect();
    policies.push(deny_db("x"));
    let mut pods = elsewhere(1000);
    pods.extend((0..20).map(|i| pod("x", &format!("db{i}"), json!({"app": "db"}))));
    pods.push(pod("x", "web", json!({"app": "web"})));
    list(&s.enforcer, pods, policies);
    for i in 0..20 {
        s.enforcer
            .admit(
                &format!("c{i}/eth0"),
                "x",
                &format!("db{i}"),
                &[ip(&format!("10.0.0.{}", i + 1))],
            )
            .await
            .expect("admitted");
    }
    assert_eq!(isolated(&s.host).len(), 20);
    let before = s.enforcer.plannings();
    s.enforcer
        .admit("cw/eth0", "x", "web", &[ip("10.0.0.99")])
        .await
        .expect("admitted");
    assert_eq!(
        s.enforcer.plannings() - before,
        1,
        "no pod of the node names others: the ADD plans its own pod alone"
    );
    // A pod elsewhere changes: nothing of the node's depends on it.
    let before = s.enforcer.plannings();
    let mut moved = elsewhere(1).remove(0);
    moved.metadata.labels = Some([("group".to_string(), "g5".to_string())].into());
    set_pod(&s.enforcer, &moved);
    s.enforcer
        .admit("cw/eth0", "x", "web", &[ip("10.0.0.99")])
        .await
        .expect("admitted again");
    assert_eq!(
        s.enforcer.plannings() - before,
        1,
        "the change of a pod elsewhere plans none of the node's"
    );
}

#[tokio::test]
async fn a_pod_whose_rules_name_pods_follows_its_peers_and_their_namespaces() {
    let s = unlisted();
    let web_from_db: NetworkPolicy = serde_json::from_value(json!({
        "metadata": {"namespace": "x", "name": "web"},
        "spec": {"podSelector": {"matchLabels": {"app": "web"}},
                 "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"team": "blue"}},
                                        "podSelector": {"matchLabels": {"app": "db"}}}]}]},
    }))
    .expect("a NetworkPolicy");
    let mut peer = elsewhere(1).remove(0);
    peer.metadata.labels = Some([("app".to_string(), "db".to_string())].into());
    list(
        &s.enforcer,
        vec![pod("x", "web", json!({"app": "web"})), peer.clone()],
        vec![web_from_db],
    );
    s.enforcer
        .admit("c1/eth0", "x", "web", &[ip("10.0.0.5")])
        .await
        .expect("admitted");
    let peers = |host: &FakeHost| -> Vec<String> {
        host.policy()
            .and_then(|p| p.pods().first().cloned())
            .and_then(|p| p.ingress)
            .map(|d| d.allows.iter().map(|a| format!("{:?}", a.peers)).collect())
            .unwrap_or_default()
    };
    assert_eq!(peers(&s.host), ["Nets([])"], "x is not team=blue yet");
    // The namespace gets the label: the peer is in.
    s.enforcer.change(
        "x",
        Change::Namespace(Some(
            [
                ("kubernetes.io/metadata.name".to_string(), "x".to_string()),
                ("team".to_string(), "blue".to_string()),
            ]
            .into(),
        )),
    );
    let host = s.host.clone();
    wait(|| peers(&host) == ["Nets([10.9.0.1/32])"]).await;
    // The peer loses its label: out again.
    peer.metadata.labels = Some([("app".to_string(), "cache".to_string())].into());
    set_pod(&s.enforcer, &peer);
    wait(|| peers(&host) == ["Nets([])"]).await;
}

/// A small deterministic generator (xorshift), for the sequences below.
struct Dice(u64);

impl Dice {
    fn roll(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }

    fn pick<'a>(&mut self, from: &[&'a str]) -> &'a str {
        from[self.roll(from.len())]
    }
}

/// One of a few policies, each exercising a part of the model: selection
/// alone, pod and namespace peers, named ports both ways, ipBlocks.
fn some_policy(d: &mut Dice) -> NetworkPolicy {
    let ns = d.pick(&["x", "y"]);
    let app = d.pick(&["a", "b", "c"]);
    let other = d.pick(&["a", "b", "c"]);
    let spec = match d.roll(6) {
        0 => json!({"podSelector": {}}),
        1 => json!({"podSelector": {"matchLabels": {"app": app}},
                    "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": other}}}]}]}),
        2 => json!({"podSelector": {"matchLabels": {"app": app}},
                    "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"team": "blue"}}}],
                                 "ports": [{"port": "web"}]}]}),
        3 => json!({"podSelector": {"matchExpressions": [{"key": "app", "operator": "In",
                                                          "values": [app, other]}]},
                    "policyTypes": ["Egress"],
                    "egress": [{"to": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.0.1.0/24"]}}],
                                "ports": [{"port": "web"}, {"port": 53, "protocol": "UDP"}]}]}),
        4 => json!({"podSelector": {"matchLabels": {"app": app}},
                    "ingress": [{"from": [{"namespaceSelector": {},
                                           "podSelector": {"matchLabels": {"app": other}}}]}],
                    "egress": [{"to": [{"podSelector": {}}]}]}),
        _ => json!({"podSelector": {"matchLabels": {"app": app}},
                    "ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/16"}}]}]}),
    };
    serde_json::from_value(json!({
        "metadata": {"namespace": ns, "name": format!("p{}", d.roll(5))},
        "spec": spec,
    }))
    .expect("a NetworkPolicy")
}

fn some_pod(d: &mut Dice) -> Pod {
    let ns = d.pick(&["x", "y"]);
    let name = d.pick(&["p0", "p1", "p2", "p3", "p4", "p5"]);
    let mut p = pod(ns, name, json!({"app": d.pick(&["a", "b", "c"])}));
    if d.roll(2) == 0 {
        p = serde_json::from_value(json!({
            "metadata": {"namespace": ns, "name": name,
                         "labels": {"app": d.pick(&["a", "b", "c"])}},
            "spec": {"nodeName": "n1", "hostNetwork": d.roll(8) == 0,
                     "containers": [{"name": "c", "ports": [
                         {"name": "web", "containerPort": 8000 + d.roll(3) as i32}]}]},
            "status": {"phase": d.pick(&["Running", "Running", "Running", "Succeeded"]),
                       "podIPs": [{"ip": format!("10.0.{}.{}", d.roll(3), d.roll(9) + 1)}]},
        }))
        .expect("a Pod");
    }
    p
}

/// Whatever the order of the watches' changes and the node's ADDs and
/// teardowns, the table planned pod by pod is the one planned whole.
#[test]
fn planning_only_the_pods_a_change_marks_gives_the_table_planned_whole() {
    for seed in 1..=20u64 {
        let mut d = Dice(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let mut s = State::default();
        let mut table: Option<PolicyPlan> = None;
        for step in 0..400 {
            match d.roll(10) {
                0 | 1 => {
                    let p = some_pod(&mut d);
                    s.change(&pod_key_of(&p), Change::Pod(Some(PodView::from_k8s(&p))));
                }
                2 => {
                    let key = format!("{}/{}", d.pick(&["x", "y"]), d.pick(&["p0", "p1", "p2"]));
                    s.change(&key, Change::Pod(None));
                }
                3 | 4 => {
                    let p = some_policy(&mut d);
                    s.change(&policy_key(&p), Change::Policy(Some(Policy::from_k8s(&p))));
                }
                5 => {
                    let key = format!("{}/p{}", d.pick(&["x", "y"]), d.roll(5));
                    s.change(&key, Change::Policy(None));
                }
                6 => {
                    let ns = d.pick(&["x", "y"]);
                    let team = d.pick(&["blue", "red"]);
                    s.change(
                        ns,
                        Change::Namespace(Some([("team".to_string(), team.to_string())].into())),
                    );
                }
                7 | 8 => {
                    let pod = format!(
                        "{}/{}",
                        d.pick(&["x", "y"]),
                        d.pick(&["p0", "p1", "p2", "p3"])
                    );
                    let attachment = format!("{pod}/{}", d.pick(&["eth0", "net1"]));
                    let ips = vec![ip(&format!("10.1.{}.{}", d.roll(3), d.roll(9) + 1))];
                    s.local.insert(
                        attachment,
                        Local {
                            pod: pod.clone(),
                            ips,
                        },
                    );
                    s.give(&pod);
                }
                _ => {
                    let keys: Vec<String> = s.local.keys().cloned().collect();
                    if !keys.is_empty() {
                        let gone = s.local.remove(&keys[d.roll(keys.len())]);
                        if let Some(l) = gone {
                            s.give(&l.pod);
                        }
                    }
                }
            }
            if step == 5 {
                for kind in [Kind::Policies, Kind::Namespaces, Kind::Pods] {
                    s.listed[kind as usize] = true;
                }
            }
            if let Some((_, written)) = s.plan() {
                if let Some(t) = written {
                    table = Some(t);
                }
                let whole = s.world.plan(|k, _| s.world.given.contains_key(k));
                assert_eq!(
                    table.as_ref(),
                    Some(&whole),
                    "seed {seed}, step {step}: the table differs from the whole plan"
                );
            }
        }
    }
}
