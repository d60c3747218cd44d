//! The policy table (`crate::policy`) loaded into a real kernel: three
//! pods wired on a throwaway node netns, one of them isolated for ingress
//! with only one peer allowed; what passes and what is dropped, the
//! drop counter as `nft` and the real [`crate::Host`] read it, and the
//! removal.

use super::*;
use crate::policy::{
    Allow, Direction, Peers, PodPolicy, PolicyPlan, Ports, POLICY_TABLE, POLICY_TABLE_FAMILY,
};

/// The packets counted by the named counter `name` of the policy table.
fn counted(name: &str) -> u64 {
    let out = Command::new("nft")
        .args(["list", "counter", POLICY_TABLE_FAMILY, POLICY_TABLE, name])
        .output()
        .expect("nft");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.split_whitespace()
        .skip_while(|w| *w != "packets")
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no counter {name} in {text}"))
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "needs root: `make test` runs it"
)]
#[test]
fn an_ingress_policy_passes_its_peer_and_replies_and_drops_the_rest() {
    require_root!();
    in_node_netns(|| async {
        let dp = connect();
        let allowed = TestPod::new("pol-a", &["10.244.0.31"]);
        let isolated = TestPod::new("pol-b", &["10.244.0.32"]);
        let stranger = TestPod::new("pol-c", &["10.244.0.33"]);
        for p in [&allowed, &isolated, &stranger] {
            dp.wire(&p.wiring()).await.expect("wire");
        }
        // Before any policy, every pod reaches every other.
        assert!(pings(stranger.path(), "10.244.0.32"));

        let policy = "default/only-a";
        let plan = PolicyPlan::new([PodPolicy {
            pod: "default/b".into(),
            ips: isolated.ips.clone(),
            ingress: Some(Direction {
                policies: [policy.to_string()].into(),
                allows: vec![Allow {
                    peers: Peers::Nets(vec!["10.244.0.31/32".parse().expect("net")]),
                    ports: Ports::Any,
                }],
            }),
            egress: None,
        }]);
        let host = crate::LinuxHost::new(std::sync::Arc::new(crate::fake::FakeDhcp::default()));
        crate::Host::ensure_policy(&host, &plan).expect("the table");
        let drops = PolicyPlan::counter_name(policy, true);

        // The allowed peer passes; the stranger is dropped and counted.
        assert!(pings(allowed.path(), "10.244.0.32"), "the allowed peer");
        assert_eq!(counted(&drops), 0);
        assert!(
            !pings(stranger.path(), "10.244.0.32"),
            "the stranger passed"
        );
        assert!(counted(&drops) >= 1, "the drop was not counted");
        let listed = crate::Host::policy_counters(&host).expect("the counters");
        assert!(
            listed
                .iter()
                .any(|(n, p, b)| *n == drops && *p >= 1 && *b > 0),
            "the host's reading of the counters: {listed:?}"
        );
        // Egress is not isolated: the isolated pod reaches the stranger,
        // whose reply passes as part of that connection.
        assert!(
            pings(isolated.path(), "10.244.0.33"),
            "the reply to the isolated pod's own echo"
        );

        // Loaded again (a change), then removed: everything passes.
        nft(&plan.script());
        assert!(!pings(stranger.path(), "10.244.0.32"), "after a reload");
        crate::Host::remove_policy(&host).expect("removed");
        assert!(pings(stranger.path(), "10.244.0.32"), "after the removal");
        // Removing what is not there is no error, and it counts nothing.
        crate::Host::remove_policy(&host).expect("removed again");
        assert_eq!(
            crate::Host::policy_counters(&host).expect("no table"),
            Vec::new()
        );
    });
}
