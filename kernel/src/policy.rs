//! NetworkPolicy in the node's nftables: the plan of what this node
//! enforces for its own pods, and the one script that programs it.
//!
//! tether owns one table for it, `inet tether_policy`. Its `forward` chain
//! sees every packet to or from a pod of this node (pods are routed, so
//! every such packet is forwarded, but the node's own: a kubelet's probe
//! leaves through `output`, and is never filtered):
//! - replies and related packets of a connection already allowed pass at
//!   once (`ct state established,related`);
//! - a packet in from a pod's veth goes through that pod's egress chain,
//!   when a policy isolates the pod for egress: one lookup in a verdict
//!   map keyed by the source address, whatever the number of pods;
//! - then a packet out to a pod's veth goes through that pod's ingress
//!   chain, likewise by the destination address.
//!
//! A pod's chain returns (the packet goes on) when one of its rules allows
//! the packet: a set of peer addresses and a set of ports, each a lookup;
//! what none allows is counted against every policy that isolates the pod
//! in that direction, then dropped. A chain never accepts: an accept would
//! end the hook, and a packet between two pods of this node must pass the
//! sender's egress and then the receiver's ingress.
//!
//! The script replaces the whole table in one nft transaction, as the
//! outbound NAT's does: applying the same plan again changes nothing, and
//! no packet ever sees half a policy.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::IpAddr;

use ipnet::IpNet;

use crate::HOST_IFNAME_PREFIX;

/// The nftables family of the policy table.
pub const POLICY_TABLE_FAMILY: &str = "inet";
/// The name of the policy table (`nft list table inet tether_policy`).
pub const POLICY_TABLE: &str = "tether_policy";
/// The priority of the policy's forward hook: before kube-proxy's filter
/// rules (priority `filter`, 0), so that a denied packet is dropped
/// whatever they accept.
pub const POLICY_PRIORITY: i32 = -10;

/// A transport protocol a policy's port names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Proto {
    /// TCP (the API's default).
    Tcp,
    /// UDP.
    Udp,
    /// SCTP.
    Sctp,
}

impl Proto {
    /// nft's name of the protocol (`meta l4proto tcp`).
    pub fn nft(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
            Proto::Sctp => "sctp",
        }
    }
}

/// A range of ports of one protocol, `first..=last`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortRange {
    /// The protocol.
    pub proto: Proto,
    /// The first port.
    pub first: u16,
    /// The last port (`first` for one port).
    pub last: u16,
}

/// The peers a rule allows.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Peers {
    /// Every address.
    Any,
    /// These ranges (a pod's addresses as /32 and /128; an ipBlock less
    /// its exceptions). Empty: none (a selector that selects no pod yet).
    Nets(Vec<IpNet>),
}

/// The ports a rule allows.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Ports {
    /// Every protocol and port (a rule without `ports`).
    Any,
    /// These. Empty: none (a named port no peer has).
    Ranges(Vec<PortRange>),
}

/// One rule of a direction: traffic from (ingress) or to (egress) one of
/// `peers`, on one of `ports`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Allow {
    /// Who.
    pub peers: Peers,
    /// On what.
    pub ports: Ports,
}

/// A pod's isolation in one direction: the policies that isolate it
/// (namespace/name, for their drop counters) and what they allow, as one
/// list (policies add up).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Direction {
    /// The policies selecting the pod for this direction, `namespace/name`.
    pub policies: BTreeSet<String>,
    /// What any of them allows. Empty: nothing (default deny).
    pub allows: Vec<Allow>,
}

/// What this node enforces for one of its pods.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodPolicy {
    /// The pod, `namespace/name` (the chains' comment, and their names'
    /// source).
    pub pod: String,
    /// Its addresses.
    pub ips: Vec<IpAddr>,
    /// Isolated for ingress, by these policies; `None`: not isolated.
    pub ingress: Option<Direction>,
    /// Isolated for egress; `None`: not isolated.
    pub egress: Option<Direction>,
}

/// What this node enforces: its isolated pods. A pod no policy selects
/// is not in it, and all its traffic passes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PolicyPlan {
    pods: Vec<PodPolicy>,
}

impl PolicyPlan {
    /// The plan for `pods`; pods isolated in neither direction are left
    /// out, the rest sorted by name (so the same pods give the same
    /// script), each one's rules with duplicates dropped.
    pub fn new(pods: impl IntoIterator<Item = PodPolicy>) -> PolicyPlan {
        let mut pods: Vec<PodPolicy> = pods
            .into_iter()
            .filter(|p| p.ingress.is_some() || p.egress.is_some())
            .map(|mut p| {
                p.ips.sort();
                p.ips.dedup();
                for d in [&mut p.ingress, &mut p.egress].into_iter().flatten() {
                    let mut seen = std::collections::HashSet::new();
                    d.allows.retain(|a| seen.insert(a.clone()));
                }
                p
            })
            .collect();
        pods.sort_by(|a, b| a.pod.cmp(&b.pod));
        PolicyPlan { pods }
    }

    /// The isolated pods.
    pub fn pods(&self) -> &[PodPolicy] {
        &self.pods
    }

    /// The name of the drop counter of policy `policy` (`namespace/name`)
    /// in one direction: `in_` or `out_` and a hash of the name (nft's
    /// names are short and plain).
    pub fn counter_name(policy: &str, ingress: bool) -> String {
        format!(
            "{}_{:016x}",
            if ingress { "in" } else { "out" },
            fnv1a(policy)
        )
    }

    /// Every drop counter of the plan: (policy, ingress?, counter name).
    pub fn counters(&self) -> Vec<(String, bool, String)> {
        let mut all = BTreeSet::new();
        for p in &self.pods {
            for (ingress, d) in [(true, &p.ingress), (false, &p.egress)] {
                for policy in d.iter().flat_map(|d| d.policies.iter()) {
                    all.insert((
                        policy.clone(),
                        ingress,
                        PolicyPlan::counter_name(policy, ingress),
                    ));
                }
            }
        }
        all.into_iter().collect()
    }

    /// The `nft -f -` script that makes the policy table exactly this
    /// plan, in one transaction: the table is created if missing (so that
    /// the delete cannot fail), deleted, and written anew. With no
    /// isolated pod the table holds only its empty forward chain.
    ///
    /// Counters are written anew too, from zero: their values must be
    /// read before a change (see the metrics), or are lost.
    pub fn script(&self) -> String {
        let t = format!("{POLICY_TABLE_FAMILY} {POLICY_TABLE}");
        let mut s = format!("table {t}\ndelete table {t}\ntable {t} {{\n");
        for (_, _, name) in self.counters() {
            let _ = writeln!(s, "  counter {name} {{ packets 0 bytes 0 }}");
        }
        // The pods' chains.
        let mut maps: [Vec<(IpAddr, String)>; 2] = [Vec::new(), Vec::new()];
        for (i, p) in self.pods.iter().enumerate() {
            for (k, (ingress, d)) in [(false, &p.egress), (true, &p.ingress)]
                .into_iter()
                .enumerate()
            {
                let Some(d) = d else { continue };
                let chain = format!("{}_{i}", if ingress { "in" } else { "out" });
                let _ = writeln!(s, "  chain {chain} {{");
                let _ = writeln!(s, "    comment \"{}\"", quote(&p.pod));
                for a in &d.allows {
                    for rule in allow_rules(a, ingress) {
                        let sep = if rule.is_empty() { "" } else { " " };
                        let _ = writeln!(s, "    {rule}{sep}return");
                    }
                }
                for policy in &d.policies {
                    let _ = writeln!(
                        s,
                        "    counter name {}",
                        PolicyPlan::counter_name(policy, ingress)
                    );
                }
                s.push_str("    drop\n  }\n");
                maps[k].extend(p.ips.iter().map(|ip| (*ip, chain.clone())));
            }
        }
        let _ = writeln!(
            s,
            "  chain forward {{\n    type filter hook forward priority {POLICY_PRIORITY}; policy accept;"
        );
        s.push_str("    ct state established,related accept\n");
        for (k, (dir, field)) in [("iifname", "saddr"), ("oifname", "daddr")]
            .into_iter()
            .enumerate()
        {
            for (v4, family) in [(true, "ip"), (false, "ip6")] {
                let elements: Vec<String> = maps[k]
                    .iter()
                    .filter(|(ip, _)| ip.is_ipv4() == v4)
                    .map(|(ip, chain)| format!("{ip} : jump {chain}"))
                    .collect();
                if elements.is_empty() {
                    continue;
                }
                let _ = writeln!(
                    s,
                    "    {dir} \"{HOST_IFNAME_PREFIX}*\" {family} {field} vmap {{ {} }}",
                    elements.join(", ")
                );
            }
        }
        s.push_str("  }\n}\n");
        s
    }

    /// The `nft -f -` script that removes the policy table, whether or
    /// not it exists.
    pub fn removal_script() -> String {
        let t = format!("{POLICY_TABLE_FAMILY} {POLICY_TABLE}");
        format!("table {t}\ndelete table {t}\n")
    }
}

/// The named counters of `nft list counters` output: (name, packets,
/// bytes), in the order listed.
pub fn parse_counters(listing: &str) -> Vec<(String, u64, u64)> {
    let mut out = Vec::new();
    let mut name: Option<String> = None;
    for line in listing.lines().map(str::trim) {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["counter", n, "{"] => name = Some((*n).to_owned()),
            ["packets", p, "bytes", b, ..] => {
                if let (Some(n), Ok(p), Ok(b)) = (name.take(), p.parse(), b.parse()) {
                    out.push((n, p, b));
                }
            }
            _ => {}
        }
    }
    out
}

/// The nft rules (without their verdict) of one allow, for a pod's
/// ingress (`peers` are sources) or egress (destinations): one per family
/// and protocol it needs, none when it allows nothing.
fn allow_rules(a: &Allow, ingress: bool) -> Vec<String> {
    let field = if ingress { "saddr" } else { "daddr" };
    // Per family: the peer match, or "" for any peer.
    let families: Vec<String> = match &a.peers {
        Peers::Any => vec![String::new()],
        Peers::Nets(nets) => [(true, "ip"), (false, "ip6")]
            .into_iter()
            .filter_map(|(v4, family)| {
                let of: Vec<String> = nets
                    .iter()
                    .filter(|n| matches!(n, IpNet::V4(_)) == v4)
                    .map(|n| n.trunc().to_string())
                    .collect();
                (!of.is_empty()).then(|| format!("{family} {field} {{ {} }} ", of.join(", ")))
            })
            .collect(),
    };
    // Per protocol: the port match, or "" for any port of any protocol.
    let ports: Vec<String> = match &a.ports {
        Ports::Any => vec![String::new()],
        Ports::Ranges(ranges) => {
            let mut by_proto: Vec<(Proto, Vec<String>)> = Vec::new();
            let mut sorted = ranges.clone();
            sorted.sort();
            sorted.dedup();
            for r in sorted {
                let item = if r.first == r.last {
                    r.first.to_string()
                } else {
                    format!("{}-{}", r.first, r.last)
                };
                match by_proto.iter_mut().find(|(p, _)| *p == r.proto) {
                    Some((_, items)) => items.push(item),
                    None => by_proto.push((r.proto, vec![item])),
                }
            }
            by_proto
                .into_iter()
                .map(|(p, items)| {
                    format!(
                        "meta l4proto {} th dport {{ {} }} ",
                        p.nft(),
                        items.join(", ")
                    )
                })
                .collect()
        }
    };
    let mut rules = Vec::new();
    for f in &families {
        for p in &ports {
            let rule = format!("{f}{p}");
            rules.push(rule.trim_end().to_string());
        }
    }
    rules
}

/// FNV-1a, 64 bits: a stable short name for a policy's counter.
fn fnv1a(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// A string as it may stand between nft's double quotes: Kubernetes names
/// hold none, but a comment must never end the script's quoting.
fn quote(s: &str) -> String {
    s.chars().filter(|c| *c != '"' && *c != '\\').collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    fn tcp(first: u16, last: u16) -> PortRange {
        PortRange {
            proto: Proto::Tcp,
            first,
            last,
        }
    }

    fn deny_all_ingress(pod: &str, ips: &[&str]) -> PodPolicy {
        PodPolicy {
            pod: pod.into(),
            ips: ips.iter().map(|s| ip(s)).collect(),
            ingress: Some(Direction {
                policies: ["x/deny".to_string()].into(),
                allows: Vec::new(),
            }),
            egress: None,
        }
    }

    #[test]
    fn an_empty_plan_writes_a_table_that_passes_everything() {
        let s = PolicyPlan::new([]).script();
        assert!(s.starts_with("table inet tether_policy\ndelete table inet tether_policy\n"));
        assert!(s.contains("type filter hook forward priority -10; policy accept;"));
        assert!(!s.contains("vmap"), "{s}");
        assert!(!s.contains(" drop"), "{s}");
    }

    #[test]
    fn a_default_deny_counts_then_drops_and_the_map_holds_both_families() {
        let plan = PolicyPlan::new([deny_all_ingress("x/a", &["fd00::5", "10.0.0.5"])]);
        let s = plan.script();
        let counter = PolicyPlan::counter_name("x/deny", true);
        assert!(
            s.contains(&format!("  counter {counter} {{ packets 0 bytes 0 }}")),
            "{s}"
        );
        assert!(
            s.contains(&format!(
                "  chain in_0 {{\n    comment \"x/a\"\n    counter name {counter}\n    drop\n  }}"
            )),
            "{s}"
        );
        assert!(s.contains("    oifname \"tth*\" ip daddr vmap { 10.0.0.5 : jump in_0 }\n"));
        assert!(s.contains("    oifname \"tth*\" ip6 daddr vmap { fd00::5 : jump in_0 }\n"));
        assert!(!s.contains("iifname"), "no egress isolation: {s}");
    }

    #[test]
    fn egress_is_checked_before_ingress_and_chains_return_instead_of_accepting() {
        let mut p = deny_all_ingress("x/a", &["10.0.0.5"]);
        p.egress = Some(Direction {
            policies: ["x/out".to_string()].into(),
            allows: vec![Allow {
                peers: Peers::Any,
                ports: Ports::Any,
            }],
        });
        let s = PolicyPlan::new([p]).script();
        let egress = s.find("iifname \"tth*\" ip saddr vmap").unwrap();
        let ingress = s.find("oifname \"tth*\" ip daddr vmap").unwrap();
        assert!(egress < ingress, "{s}");
        assert!(
            s.contains("  chain out_0 {\n    comment \"x/a\"\n    return\n"),
            "{s}"
        );
        assert!(!s.contains(" accept\n    counter"), "{s}");
        let established = s.find("ct state established,related accept").unwrap();
        assert!(established < egress);
    }

    #[test]
    fn peers_and_ports_become_one_rule_per_family_and_protocol() {
        let a = Allow {
            peers: Peers::Nets(vec![
                net("10.1.0.0/16"),
                net("fd00:1::/64"),
                net("10.2.0.7/32"),
            ]),
            ports: Ports::Ranges(vec![
                tcp(80, 80),
                PortRange {
                    proto: Proto::Udp,
                    first: 53,
                    last: 53,
                },
                tcp(8000, 8080),
            ]),
        };
        assert_eq!(
            allow_rules(&a, true),
            [
                "ip saddr { 10.1.0.0/16, 10.2.0.7/32 } meta l4proto tcp th dport { 80, 8000-8080 }",
                "ip saddr { 10.1.0.0/16, 10.2.0.7/32 } meta l4proto udp th dport { 53 }",
                "ip6 saddr { fd00:1::/64 } meta l4proto tcp th dport { 80, 8000-8080 }",
                "ip6 saddr { fd00:1::/64 } meta l4proto udp th dport { 53 }",
            ]
        );
        let egress = Allow {
            peers: Peers::Nets(vec![net("10.1.0.0/16")]),
            ports: Ports::Any,
        };
        assert_eq!(allow_rules(&egress, false), ["ip daddr { 10.1.0.0/16 }"]);
    }

    #[test]
    fn a_rule_that_allows_nothing_writes_nothing() {
        let none = Allow {
            peers: Peers::Nets(Vec::new()),
            ports: Ports::Any,
        };
        assert!(allow_rules(&none, true).is_empty());
        let no_port = Allow {
            peers: Peers::Any,
            ports: Ports::Ranges(Vec::new()),
        };
        assert!(allow_rules(&no_port, true).is_empty());
        let all = Allow {
            peers: Peers::Any,
            ports: Ports::Any,
        };
        assert_eq!(allow_rules(&all, true), [""]);
    }

    #[test]
    fn the_same_pods_in_another_order_give_the_same_script() {
        let a = deny_all_ingress("x/a", &["10.0.0.5"]);
        let b = deny_all_ingress("x/b", &["10.0.0.6", "10.0.0.6"]);
        let one = PolicyPlan::new([a.clone(), b.clone()]);
        let two = PolicyPlan::new([b, a]);
        assert_eq!(one.script(), two.script());
        assert_eq!(one.pods()[1].ips, [ip("10.0.0.6")]);
    }

    #[test]
    fn a_pod_isolated_in_no_direction_is_left_out() {
        let mut p = deny_all_ingress("x/a", &["10.0.0.5"]);
        p.ingress = None;
        assert!(PolicyPlan::new([p]).pods().is_empty());
    }

    #[test]
    fn counters_are_per_policy_and_direction() {
        let mut p = deny_all_ingress("x/a", &["10.0.0.5"]);
        p.egress = Some(Direction {
            policies: ["x/deny".to_string()].into(),
            allows: Vec::new(),
        });
        let q = deny_all_ingress("x/b", &["10.0.0.6"]);
        let counters = PolicyPlan::new([p, q]).counters();
        assert_eq!(counters.len(), 2, "{counters:?}");
        assert_ne!(counters[0].2, counters[1].2);
    }

    #[test]
    fn the_counters_are_read_from_nfts_listing() {
        let listing = "table inet tether_policy {\n\tcounter in_00000000000000aa {\n\t\tpackets 3 bytes 252\n\t}\n\tcounter out_00000000000000bb {\n\t\tpackets 0 bytes 0\n\t}\n}\n";
        assert_eq!(
            parse_counters(listing),
            vec![
                ("in_00000000000000aa".to_string(), 3, 252),
                ("out_00000000000000bb".to_string(), 0, 0)
            ]
        );
        assert!(parse_counters("").is_empty());
    }

    #[test]
    fn names_cannot_break_the_scripts_quoting() {
        assert_eq!(quote("a\"b\\c"), "abc");
    }

    #[test]
    fn the_removal_script_removes_only_the_policy_table() {
        assert_eq!(
            PolicyPlan::removal_script(),
            "table inet tether_policy\ndelete table inet tether_policy\n"
        );
    }
}
