//! The model against the API's rules, one rule a test, on objects written
//! as the API serves them.

use super::*;
use serde_json::{json, Value};

fn policy(v: Value) -> Policy {
    Policy::from_k8s(&serde_json::from_value::<NetworkPolicy>(v).expect("a NetworkPolicy"))
}

fn np(ns: &str, name: &str, spec: Value) -> Value {
    json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
           "metadata": {"namespace": ns, "name": name}, "spec": spec})
}

fn pod(ns: &str, name: &str, labels: Value, ips: &[&str]) -> PodView {
    PodView {
        namespace: ns.into(),
        name: name.into(),
        labels: serde_json::from_value(labels).expect("labels"),
        ips: ips.iter().map(|ip| ip.parse().expect("an IP")).collect(),
        ports: Vec::new(),
        host_network: false,
        finished: false,
        node: "n1".into(),
    }
}

fn labels(v: Value) -> Labels {
    serde_json::from_value(v).expect("labels")
}

fn sel(v: Value) -> Selector {
    Selector::from_k8s(&serde_json::from_value::<LabelSelector>(v).expect("a selector"))
}

fn nets(list: &[&str]) -> Vec<IpNet> {
    list.iter().map(|n| n.parse().expect("a CIDR")).collect()
}

/// Namespaces x (team=x) and y (team=y); pods a (app=a) and b (app=b) in
/// each.
fn world(policies: Vec<Policy>) -> World {
    World::new(
        policies,
        [
            ("x".to_string(), labels(json!({"team": "x"}))),
            ("y".to_string(), labels(json!({"team": "y"}))),
        ],
        [
            pod("x", "a", json!({"app": "a"}), &["10.0.1.1", "fd00::1:1"]),
            pod("x", "b", json!({"app": "b"}), &["10.0.1.2"]),
            pod("y", "a", json!({"app": "a"}), &["10.0.2.1"]),
            pod("y", "b", json!({"app": "b"}), &["10.0.2.2"]),
        ],
    )
}

fn pod_mut<'a>(w: &'a mut World, key: &str) -> &'a mut PodView {
    w.pods.get_mut(key).expect("the pod")
}

fn ingress_of(w: &World, ns: &str, name: &str) -> Option<Direction> {
    w.pod_policy(&format!("{ns}/{name}"))
        .expect("the pod")
        .ingress
}

#[test]
fn selectors_match_labels_and_every_kind_of_expression() {
    let l = labels(json!({"app": "web", "tier": "front"}));
    assert!(sel(json!({})).matches(&l), "the empty selector matches all");
    assert!(sel(json!({"matchLabels": {"app": "web"}})).matches(&l));
    assert!(!sel(json!({"matchLabels": {"app": "db"}})).matches(&l));
    let expr = |op: &str, values: Value| {
        sel(json!({"matchExpressions": [{"key": "tier", "operator": op, "values": values}]}))
    };
    assert!(expr("In", json!(["front", "back"])).matches(&l));
    assert!(!expr("In", json!(["back"])).matches(&l));
    assert!(expr("NotIn", json!(["back"])).matches(&l));
    assert!(
        expr("NotIn", json!(["back"])).matches(&labels(json!({}))),
        "NotIn holds where the key is absent"
    );
    assert!(expr("Exists", Value::Null).matches(&l));
    assert!(!expr("DoesNotExist", Value::Null).matches(&l));
    assert!(
        !expr("Sometimes", Value::Null).matches(&l),
        "an unknown operator matches nothing"
    );
    assert!(
        !sel(json!({"matchLabels": {"app": "web"},
                    "matchExpressions": [{"key": "tier", "operator": "In", "values": ["back"]}]}))
        .matches(&l),
        "all requirements must hold"
    );
}

#[test]
fn policy_types_are_inferred_as_the_api_defaults_them() {
    let p = policy(np("x", "p", json!({"podSelector": {}})));
    assert_eq!(p.ingress, Some(Vec::new()), "ingress always");
    assert_eq!(p.egress, None);
    let p = policy(np("x", "p", json!({"podSelector": {}, "egress": [{}]})));
    assert!(p.ingress.is_some() && p.egress.is_some(), "{p:?}");
    let p = policy(np(
        "x",
        "p",
        json!({"podSelector": {}, "policyTypes": ["Egress"], "ingress": [{}]}),
    ));
    assert_eq!(p.ingress, None, "policyTypes rule over the rules");
    assert_eq!(p.egress, Some(Vec::new()), "egress with no rule: deny");
}

#[test]
fn an_ip_block_less_its_exceptions_is_the_fewest_ranges() {
    assert_eq!(
        subtract("10.0.0.0/24".parse().unwrap(), &nets(&["10.0.0.0/26"])),
        nets(&["10.0.0.64/26", "10.0.0.128/25"])
    );
    assert_eq!(
        subtract("10.0.0.0/24".parse().unwrap(), &nets(&["10.0.0.5/32"])).len(),
        8
    );
    assert!(subtract("10.0.0.0/24".parse().unwrap(), &nets(&["10.0.0.0/16"])).is_empty());
    assert_eq!(
        subtract(
            "10.0.0.0/24".parse().unwrap(),
            &nets(&["10.1.0.0/24", "fd00::/64"])
        ),
        nets(&["10.0.0.0/24"])
    );
    let p = policy(np(
        "x",
        "p",
        json!({"podSelector": {}, "ingress": [{"from": [{"ipBlock":
            {"cidr": "192.168.0.0/16", "except": ["192.168.1.0/24"]}}]}]}),
    ));
    let Some(rules) = p.ingress else {
        panic!("no ingress")
    };
    assert_eq!(
        rules[0].peers,
        Some(vec![Peer::Block(subtract(
            "192.168.0.0/16".parse().unwrap(),
            &nets(&["192.168.1.0/24"])
        ))])
    );
}

#[test]
fn a_default_deny_isolates_every_pod_of_its_namespace_and_allows_nothing() {
    let w = world(vec![policy(np("x", "deny", json!({"podSelector": {}})))]);
    for name in ["a", "b"] {
        let d = ingress_of(&w, "x", name).expect("isolated");
        assert!(d.allows.is_empty());
        assert_eq!(d.policies, ["x/deny".to_string()].into());
    }
    assert_eq!(ingress_of(&w, "y", "a"), None, "another namespace is not");
}

#[test]
fn pod_and_namespace_selectors_alone_and_together() {
    let from = |peer: Value| {
        world(vec![policy(np(
            "x",
            "p",
            json!({"podSelector": {"matchLabels": {"app": "a"}}, "ingress": [{"from": [peer]}]}),
        ))])
    };
    let peers = |w: &World| {
        ingress_of(w, "x", "a").expect("isolated").allows[0]
            .peers
            .clone()
    };
    // A podSelector alone: the policy's own namespace.
    let w = from(json!({"podSelector": {"matchLabels": {"app": "b"}}}));
    assert_eq!(peers(&w), Peers::Nets(nets(&["10.0.1.2/32"])));
    assert_eq!(ingress_of(&w, "x", "b"), None, "b is not selected");
    // A namespaceSelector alone: every pod of those namespaces.
    let w = from(json!({"namespaceSelector": {"matchLabels": {"team": "y"}}}));
    assert_eq!(
        peers(&w),
        Peers::Nets(nets(&["10.0.2.1/32", "10.0.2.2/32"]))
    );
    // Both in one peer: those pods in those namespaces.
    let w = from(json!({"namespaceSelector": {"matchLabels": {"team": "y"}},
                        "podSelector": {"matchLabels": {"app": "b"}}}));
    assert_eq!(peers(&w), Peers::Nets(nets(&["10.0.2.2/32"])));
    // An empty namespaceSelector: every namespace.
    let w = from(json!({"namespaceSelector": {}}));
    assert_eq!(
        peers(&w),
        Peers::Nets(nets(&[
            "10.0.1.1/32",
            "10.0.1.2/32",
            "10.0.2.1/32",
            "10.0.2.2/32",
            "fd00::1:1/128"
        ]))
    );
}

#[test]
fn a_rule_without_peers_or_ports_allows_everyone_on_everything() {
    let w = world(vec![policy(np(
        "x",
        "p",
        json!({"podSelector": {}, "ingress": [{}]}),
    ))]);
    let d = ingress_of(&w, "x", "a").expect("isolated");
    assert_eq!(
        d.allows,
        [Allow {
            peers: Peers::Any,
            ports: Ports::Any
        }]
    );
}

#[test]
fn ports_by_number_range_protocol_and_name_on_the_receiving_pod() {
    let mut w = world(vec![policy(np(
        "x",
        "p",
        json!({"podSelector": {}, "ingress": [{"ports": [
            {"port": 80},
            {"protocol": "UDP", "port": 5000, "endPort": 5010},
            {"protocol": "SCTP"},
            {"port": "serve-81"},
            {"port": 0},
        ]}]}),
    ))]);
    pod_mut(&mut w, "x/a").ports = vec![NamedPort {
        name: "serve-81".into(),
        proto: Proto::Tcp,
        port: 81,
    }];
    let range = |proto, first, last| PortRange { proto, first, last };
    let numbered = vec![
        range(Proto::Tcp, 80, 80),
        range(Proto::Udp, 5000, 5010),
        range(Proto::Sctp, 1, 65535),
    ];
    let a = ingress_of(&w, "x", "a").expect("isolated");
    let mut with_name = numbered.clone();
    with_name.push(range(Proto::Tcp, 81, 81));
    assert_eq!(
        a.allows[0].ports,
        Ports::Ranges(with_name),
        "port 0, which the API refuses, allows nothing"
    );
    // b has no port of that name: the name allows it nothing.
    let b = ingress_of(&w, "x", "b").expect("isolated");
    assert_eq!(b.allows[0].ports, Ports::Ranges(numbered));
}

#[test]
fn an_egress_named_port_is_each_peer_pods_own() {
    let mut w = world(vec![policy(np(
        "x",
        "p",
        json!({"podSelector": {"matchLabels": {"app": "a"}}, "policyTypes": ["Egress"],
               "egress": [{"to": [{"namespaceSelector": {}}],
                           "ports": [{"port": "dns", "protocol": "UDP"}, {"port": 443}]}]}),
    ))]);
    pod_mut(&mut w, "y/b").ports = vec![NamedPort {
        name: "dns".into(),
        proto: Proto::Udp,
        port: 5353,
    }];
    let e = w
        .pod_policy("x/a")
        .and_then(|p| p.egress)
        .expect("isolated for egress");
    assert_eq!(e.allows.len(), 2, "{e:?}");
    assert_eq!(
        e.allows[1],
        Allow {
            peers: Peers::Nets(nets(&["10.0.2.2/32"])),
            ports: Ports::Ranges(vec![PortRange {
                proto: Proto::Udp,
                first: 5353,
                last: 5353
            }])
        }
    );
    assert_eq!(
        e.allows[0].ports,
        Ports::Ranges(vec![PortRange {
            proto: Proto::Tcp,
            first: 443,
            last: 443
        }])
    );
}

#[test]
fn policies_add_up_and_each_is_named_for_its_counter() {
    let w = world(vec![
        policy(np("x", "deny", json!({"podSelector": {}}))),
        policy(np(
            "x",
            "web",
            json!({"podSelector": {"matchLabels": {"app": "a"}},
                   "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "b"}}}]}]}),
        )),
    ]);
    let d = ingress_of(&w, "x", "a").expect("isolated");
    assert_eq!(
        d.policies,
        ["x/deny".to_string(), "x/web".to_string()].into()
    );
    assert_eq!(d.allows.len(), 1);
}

#[test]
fn host_network_and_finished_pods_are_neither_isolated_nor_peers() {
    let mut w = world(vec![policy(np(
        "x",
        "p",
        json!({"podSelector": {}, "ingress": [{"from": [{"podSelector": {}}]}]}),
    ))]);
    pod_mut(&mut w, "x/b").host_network = true;
    let mut done = pod("x", "c", json!({}), &["10.0.1.3"]);
    done.finished = true;
    w.pods.insert(done.key(), done);
    let d = ingress_of(&w, "x", "a").expect("isolated");
    assert_eq!(
        d.allows[0].peers,
        Peers::Nets(nets(&["10.0.1.1/32", "fd00::1:1/128"]))
    );
    let plan = w.plan(|_, _| true);
    assert_eq!(
        plan.pods()
            .iter()
            .map(|p| p.pod.as_str())
            .collect::<Vec<_>>(),
        ["x/a"],
        "b is on the host's network, c has finished, y's pods are not selected"
    );
}

#[test]
fn a_node_plans_only_its_own_pods() {
    let mut w = world(vec![policy(np("x", "deny", json!({"podSelector": {}})))]);
    pod_mut(&mut w, "x/b").node = "n2".into();
    let plan = w.plan(|_, p| p.node == "n1");
    assert_eq!(plan.pods().len(), 1);
    assert_eq!(plan.pods()[0].pod, "x/a");
}

#[test]
fn pods_read_from_the_api_keep_their_addresses_ports_and_state() {
    let p: Pod = serde_json::from_value(json!({
        "metadata": {"namespace": "x", "name": "a", "labels": {"app": "a"}},
        "spec": {"nodeName": "n1", "containers": [{"name": "c", "ports": [
            {"name": "http", "containerPort": 8080},
            {"name": "dns", "containerPort": 53, "protocol": "UDP"},
            {"containerPort": 9000}]}]},
        "status": {"phase": "Running", "podIP": "10.0.1.1",
                   "podIPs": [{"ip": "10.0.1.1"}, {"ip": "fd00::1"}]},
    }))
    .expect("a pod");
    let v = PodView::from_k8s(&p);
    assert_eq!(v.ips.len(), 2);
    assert_eq!(v.named(Proto::Tcp, "http"), Some(8080));
    assert_eq!(v.named(Proto::Udp, "dns"), Some(53));
    assert_eq!(v.named(Proto::Tcp, "dns"), None, "a name is per protocol");
    assert!(!v.finished && !v.host_network);
    assert_eq!(v.node, "n1");
}
