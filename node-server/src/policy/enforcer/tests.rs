//! The enforcer against the fake host: what its table holds after the
//! watches' changes and the node's ADDs, and when an ADD may return.

use super::*;
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
    s.enforcer.update(|i| {
        i.namespaces.insert("x".into(), namespace("x"));
        for p in [
            pod("x", "db", json!({"app": "db"})),
            pod("x", "web", json!({"app": "web"})),
        ] {
            i.pods.insert(
                pod_key("x", p.metadata.name.as_deref().unwrap_or_default()),
                p,
            );
        }
        for p in policies {
            let key = pod_key("x", p.metadata.name.as_deref().unwrap_or_default());
            i.policies.insert(key, p);
        }
        i.listed = [true; 3];
    });
    s
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
    s.enforcer.update(|i| {
        i.policies.insert("x/deny-db".into(), deny_db("x"));
    });
    let host = s.host.clone();
    wait(|| isolated(&host).len() == 1).await;
    s.enforcer.update(|i| {
        i.policies.remove("x/deny-db");
    });
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
    s.enforcer.update(|i| {
        i.namespaces.insert("x".into(), namespace("x"));
        i.pods
            .insert("x/db".into(), pod("x", "db", json!({"app": "db"})));
        i.policies.insert("x/deny-db".into(), deny_db("x"));
        i.listed = [true; 3];
    });
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
    s.enforcer.update(|i| {
        i.pods
            .insert("x/db2".into(), pod("x", "db2", json!({"app": "db"})));
    });
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
