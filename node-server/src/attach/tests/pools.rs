//! Named pools on tether's own network, and tether as another plugin's
//! IPAM (IPAM-only attachments): ADD, DEL, CHECK, GC and a restart.

use super::*;
use tether_cni::config::VALID_ATTACHMENTS_KEY;

const POOLS: &str = r#"{"pools":[
    {"name":"mig","cidr":"10.200.0.0/24","rangeStart":"10.200.0.10","rangeEnd":"10.200.0.200",
     "exclude":["10.200.0.11","10.200.0.16/30"],"gateway":"10.200.0.1",
     "routes":[{"dst":"10.201.0.0/16"}],"dns":{"nameservers":["10.200.0.53"]}},
    {"name":"mig6","cidr":"fd00:200::/64"},
    {"name":"blue","cidr":"10.50.0.0/24","exclude":["10.50.0.1"]}]}"#;

fn defs() -> Vec<crate::pools::PoolDef> {
    crate::pools::def::parse(POOLS).expect("test pools")
}

pub(crate) async fn node() -> TestNode {
    TestNode::with(Options {
        pools: defs(),
        ..Options::default()
    })
    .await
}

/// A macvlan network ("mig") that runs tether as its IPAM.
fn ipam_call(command: &str, cid: &str, ipam: Value) -> Call {
    Call::new(command, cid)
        .conf("name", json!("mig"))
        .conf("type", json!("macvlan"))
        .conf("master", json!("eth1"))
        .conf("ipam", ipam)
        .ifname("net1")
}

pub(crate) fn mig() -> Value {
    json!({"type": "tether", "pool": "mig"})
}

pub(crate) async fn ipam_add(t: &TestNode, cid: &str, ipam: Value) -> Result<Value> {
    let inv = t.inv(ipam_call("ADD", cid, ipam).netns(&t.netns(cid)));
    t.node.add(&inv).await.map(|b| parse_json(&b))
}

fn used_of(t: &TestNode, pool: &str) -> u128 {
    t.node
        .named_pools()
        .usage()
        .iter()
        .find(|u| u.name == pool)
        .map_or(0, |u| u.used)
}

fn first_ip(result: &Value) -> IpAddr {
    let addr = result["ips"][0]["address"].as_str().expect("an address");
    addr.parse::<IpNet>().expect("a CIDR").addr()
}

#[tokio::test]
async fn ipam_only_add_answers_addresses_and_wires_nothing() {
    let t = node().await;
    let r = ipam_add(&t, "c1", mig()).await.expect("ADD");
    // The pool's prefix and gateway, its routes (through its gateway) and
    // DNS; no interfaces: those are the main plugin's.
    assert_eq!(r["cniVersion"], "1.1.0");
    assert!(r.get("interfaces").is_none(), "{r}");
    let ips = r["ips"].as_array().expect("ips");
    assert_eq!(ips.len(), 1, "{r}");
    assert!(
        ips[0]["address"]
            .as_str()
            .is_some_and(|a| a.ends_with("/24")),
        "{r}"
    );
    assert_eq!(ips[0]["gateway"], "10.200.0.1");
    assert!(ips[0].get("interface").is_none(), "{r}");
    assert_eq!(
        r["routes"],
        json!([{"dst": "10.201.0.0/16", "gw": "10.200.0.1"}])
    );
    assert_eq!(r["dns"]["nameservers"], json!(["10.200.0.53"]));
    let got = first_ip(&r);
    assert!(
        got >= ip("10.200.0.10") && got <= ip("10.200.0.200"),
        "{got}"
    );
    assert!(t.kernel.links().is_empty());
    assert!(t.kernel.routes().is_empty());
    // Recorded like any attachment, durably.
    let stored = t.store.load().expect("load");
    assert_eq!(stored.len(), 1);
    assert!(stored[0].ipam_only);
    assert_eq!(stored[0].pools, ["mig"]);
    assert_eq!(used_of(&t, "mig"), 1);
    // A repeated ADD gives the same answer.
    assert_eq!(ipam_add(&t, "c1", mig()).await.expect("ADD again"), r);
    assert_eq!(used_of(&t, "mig"), 1);
    // The section's own routes follow the pool's; its dns replaces it.
    let r2 = ipam_add(
        &t,
        "c2",
        json!({"type": "tether", "pool": ["mig", "mig6"], "routes": [{"dst": "0.0.0.0/0"}],
               "dns": {"nameservers": ["1.2.3.4"]}}),
    )
    .await
    .expect("dual-stack ADD");
    assert_eq!(r2["ips"].as_array().map(Vec::len), Some(2), "{r2}");
    assert!(r2["ips"][1]["address"]
        .as_str()
        .is_some_and(|a| a.starts_with("fd00:200::") && a.ends_with("/64")));
    assert_eq!(r2["routes"][1], json!({"dst": "0.0.0.0/0"}));
    assert_eq!(r2["dns"]["nameservers"], json!(["1.2.3.4"]));
}

#[tokio::test]
async fn ipam_only_del_releases_and_check_compares_the_prev_result() {
    let t = node().await;
    let r = ipam_add(&t, "c1", mig()).await.expect("ADD");
    let mut prev = ipam_call("CHECK", "c1", mig()).netns(&t.netns("c1"));
    prev = prev.conf("prevResult", r.clone());
    t.node.check(&t.inv(prev)).await.expect("CHECK");
    // A prevResult that lost the address fails with 116.
    let mut wrong = r.clone();
    wrong["ips"][0]["address"] = json!("10.200.0.99/24");
    let bad = ipam_call("CHECK", "c1", mig())
        .netns(&t.netns("c1"))
        .conf("prevResult", wrong);
    assert_eq!(
        t.node
            .check(&t.inv(bad))
            .await
            .map(|_| ())
            .map_err(|e| e.code()),
        Err(116)
    );
    let del = t.inv(ipam_call("DEL", "c1", mig()));
    t.node.del(&del, None).await.expect("DEL");
    assert_eq!(used_of(&t, "mig"), 0);
    assert!(t.store.load().expect("load").is_empty());
    // DEL is idempotent.
    t.node.del(&del, None).await.expect("DEL again");
    let gone = ipam_call("CHECK", "c1", mig())
        .netns(&t.netns("c1"))
        .conf("prevResult", r);
    assert_eq!(
        t.node
            .check(&t.inv(gone))
            .await
            .map(|_| ())
            .map_err(|e| e.code()),
        Err(110)
    );
}

#[tokio::test]
async fn gc_releases_ipam_only_orphans_of_its_network_only() {
    let t = node().await;
    for cid in ["c1", "c2", "c3"] {
        ipam_add(&t, cid, mig()).await.expect("ADD");
    }
    t.add("p1", "p1")
        .await
        .expect("ADD on tether's own network");
    let list = json!([{"containerID": "c2", "ifname": "net1"}]);
    let gc = t.inv(ipam_call("GC", "", mig()).conf(VALID_ATTACHMENTS_KEY, list));
    assert!(t.node.gc(&gc).await.expect("GC").is_empty());
    let mut left: Vec<String> = t
        .node
        .attachments()
        .into_iter()
        .map(|a| format!("{}/{}", a.key.network, a.key.container_id))
        .collect();
    left.sort();
    assert_eq!(left, ["mig/c2", "tether/p1"]);
    assert_eq!(used_of(&t, "mig"), 1);
}

#[tokio::test]
async fn pools_are_selected_by_the_netconf_or_the_pod_annotation() {
    let t = node().await;
    // tether's own network, its pool named in the netconf: wired as usual.
    let inv = t.inv(
        Call::new("ADD", "c1")
            .netns(&t.netns("p1"))
            .conf("pool", json!("blue")),
    );
    let r = parse_json(&t.node.add(&inv).await.expect("ADD"));
    let got = first_ip(&r);
    assert!(net("10.50.0.0/24").contains(&got), "{r}");
    assert_ne!(got, ip("10.50.0.1"));
    assert_eq!(t.kernel.links().len(), 1);
    assert!(t.kernel.routes().contains_key(&IpNet::from(got)));
    // The annotation wins over the netconf.
    let inv = t.inv(
        Call::new("ADD", "c2")
            .netns(&t.netns("p2"))
            .conf("pool", json!("blue"))
            .annotation(tether_cni::POOL_ANNOTATION, "mig"),
    );
    let r = parse_json(&t.node.add(&inv).await.expect("ADD"));
    assert!(net("10.200.0.0/24").contains(&first_ip(&r)), "{r}");
    // No pool: the pod CIDRs.
    let r = t.add("c3", "p3").await.expect("ADD");
    assert!(net("10.1.0.0/24").contains(&first_ip(&r)), "{r}");
    // An IPAM-only network takes its own annotation.
    let inv = t.inv(
        ipam_call("ADD", "c4", mig())
            .netns(&t.netns("c4"))
            .annotation("tether.dev/pool.mig", "blue"),
    );
    let r = parse_json(&t.node.add(&inv).await.expect("ADD"));
    assert!(net("10.50.0.0/24").contains(&first_ip(&r)), "{r}");
    // An unknown pool: 119, naming the ones there are.
    let e = ipam_add(&t, "c5", json!({"type": "tether", "pool": "nope"}))
        .await
        .expect_err("unknown pool");
    assert_eq!(e.code(), 119);
    assert!(e.to_string().contains("blue, mig, mig6"), "{e}");
    // No pool at all for an IPAM-only network: 7.
    let e = ipam_add(&t, "c6", json!({"type": "tether"}))
        .await
        .expect_err("no pool");
    assert_eq!(e.code(), 7);
    // A VM pod cannot use named pools yet: 7, and nothing is held.
    let inv = t.inv(
        Call::new("ADD", "c7")
            .netns(&t.netns("p7"))
            .conf("pool", json!("blue"))
            .vm("vm1"),
    );
    assert_eq!(
        t.node.add(&inv).await.map(|_| ()).map_err(|e| e.code()),
        Err(7)
    );
    assert_eq!(used_of(&t, "blue"), 2);
}

#[tokio::test]
async fn a_requested_excluded_address_is_refused_with_109() {
    let t = node().await;
    for (addr, code) in [
        ("10.200.0.11", 109),
        ("10.200.0.17", 109),
        ("10.200.0.1", 109),
        ("10.200.0.5", 109),
        ("10.200.0.250", 109),
        ("10.9.9.9", 106),
    ] {
        let inv = t.inv(
            ipam_call("ADD", "c1", mig())
                .netns(&t.netns("c1"))
                .arg("IP", addr),
        );
        let e = t.node.add(&inv).await.map(|_| ()).expect_err(addr);
        assert_eq!(e.code(), code, "{addr}: {e}");
    }
    assert!(t.store.load().expect("load").is_empty());
    assert_eq!(used_of(&t, "mig"), 0);
    // An allowed one is given.
    let inv = t.inv(
        ipam_call("ADD", "c1", mig())
            .netns(&t.netns("c1"))
            .arg("IP", "10.200.0.12"),
    );
    let r = parse_json(&t.node.add(&inv).await.expect("ADD"));
    assert_eq!(first_ip(&r), ip("10.200.0.12"));
}

#[tokio::test]
async fn named_addresses_survive_a_restart_and_a_new_exclusion() {
    let t = node().await;
    let a = first_ip(&ipam_add(&t, "c1", mig()).await.expect("ADD"));
    let inv = t.inv(
        Call::new("ADD", "p1")
            .netns(&t.netns("p1"))
            .conf("pool", json!("blue")),
    );
    let b = first_ip(&parse_json(&t.node.add(&inv).await.expect("ADD")));
    let (t, _) = t.restart(|_| {}).await.expect("restart");
    assert_eq!(used_of(&t, "mig"), 1);
    assert_eq!(used_of(&t, "blue"), 1);
    assert_eq!(
        t.node.pool_usage().iter().map(|(_, u, _)| u).sum::<u128>(),
        0
    );
    // Neither is given again.
    let c = first_ip(&ipam_add(&t, "c2", mig()).await.expect("ADD"));
    assert_ne!(c, a);
    // The pool's definition changes to exclude the held address: it is
    // reported, not taken away, and a DEL still releases it.
    let text = POOLS.replace(
        r#""exclude":["10.200.0.11","10.200.0.16/30"]"#,
        &format!(r#""exclude":["10.200.0.11","10.200.0.16/30","{a}"]"#),
    );
    t.node
        .reload_pools(crate::pools::def::parse(&text).expect("pools"));
    let u = t
        .node
        .named_pools()
        .usage()
        .into_iter()
        .find(|u| u.name == "mig")
        .expect("mig");
    assert_eq!(u.excluded_in_use, vec![a]);
    assert_eq!(
        ipam_add(&t, "c1", mig()).await.map(|r| first_ip(&r)).ok(),
        Some(a)
    );
    t.node
        .del(&t.inv(ipam_call("DEL", "c1", mig())), None)
        .await
        .expect("DEL");
    assert_eq!(used_of(&t, "mig"), 1);
    assert!(t.kernel.routes().contains_key(&IpNet::from(b)));
}
