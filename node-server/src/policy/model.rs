//! What Kubernetes' NetworkPolicy v1 means, as data, and what it asks of
//! this node: from the cluster's policies, namespaces and pods as the API
//! shows them, the [`PolicyPlan`] of this node's own pods.
//!
//! The rules of the API (`networking.k8s.io/v1`, its types' comments),
//! as written here:
//! - A policy selects the pods of its own namespace that its
//!   `podSelector` matches (empty: all of them), and isolates them in the
//!   directions of its `policyTypes`; without `policyTypes`, for ingress
//!   always, and for egress when it has egress rules.
//! - An isolated pod takes, in that direction, only what one rule of one
//!   of the policies isolating it allows (they add up); replies to
//!   allowed connections pass (the table's `ct state`).
//! - A rule without peers (`from`/`to` absent or empty) allows every
//!   peer; without ports, every protocol and port. A peer is pods (a
//!   `podSelector` in the policy's namespace, a `namespaceSelector`'s
//!   namespaces, or both at once: those pods in those namespaces) or an
//!   `ipBlock` less its `except` ranges.
//! - A port is a protocol (TCP unless said), and a number with an
//!   optional `endPort`, or a name, or nothing (every port of the
//!   protocol). A name is resolved on the pod that receives: for ingress
//!   the isolated pod's own container ports, for egress each peer pod's.
//!
//! Pods on the host's network are never isolated nor peers here (their
//! traffic does not cross a pod veth, and their addresses are the nodes').
//! Pods that have finished (`Succeeded`, `Failed`) are no peers: their
//! addresses may already be another pod's.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::{NetworkPolicy, NetworkPolicyPeer, NetworkPolicyPort};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use tether_kernel::policy::{
    Allow, Direction, Peers, PodPolicy, PolicyPlan, PortRange, Ports, Proto,
};

/// Labels, as the API has them.
pub type Labels = BTreeMap<String, String>;

/// A label selector (`matchLabels` and `matchExpressions`, all of which
/// must hold). The empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selector {
    labels: Labels,
    expressions: Vec<Expression>,
}

/// One `matchExpressions` requirement.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Expression {
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    DoesNotExist(String),
    /// An operator the API does not know (its validation refuses it):
    /// matches nothing.
    Unknown,
}

impl Selector {
    /// The selector of the API's `LabelSelector`.
    pub fn from_k8s(s: &LabelSelector) -> Selector {
        let expressions = s
            .match_expressions
            .iter()
            .flatten()
            .map(|e| {
                let values = e.values.clone().unwrap_or_default();
                match e.operator.as_str() {
                    "In" => Expression::In(e.key.clone(), values),
                    "NotIn" => Expression::NotIn(e.key.clone(), values),
                    "Exists" => Expression::Exists(e.key.clone()),
                    "DoesNotExist" => Expression::DoesNotExist(e.key.clone()),
                    _ => Expression::Unknown,
                }
            })
            .collect();
        Selector {
            labels: s.match_labels.clone().unwrap_or_default(),
            expressions,
        }
    }

    /// Whether `labels` satisfy every requirement.
    pub fn matches(&self, labels: &Labels) -> bool {
        self.labels.iter().all(|(k, v)| labels.get(k) == Some(v))
            && self.expressions.iter().all(|e| match e {
                Expression::In(k, vs) => labels.get(k).is_some_and(|v| vs.contains(v)),
                Expression::NotIn(k, vs) => labels.get(k).is_none_or(|v| !vs.contains(v)),
                Expression::Exists(k) => labels.contains_key(k),
                Expression::DoesNotExist(k) => !labels.contains_key(k),
                Expression::Unknown => false,
            })
    }
}

/// A port of a rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PortSpec {
    /// Every port of the protocol.
    All(Proto),
    /// `first..=last` (one port: `first == last`).
    Range(PortRange),
    /// A container port's name, resolved on the receiving pod.
    Named(Proto, String),
}

/// A peer of a rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    /// Pods: those matching `pods` in the namespaces matching
    /// `namespaces` (`None`: the policy's own namespace).
    Pods {
        /// The namespaces' selector; `None`: the policy's namespace.
        namespaces: Option<Selector>,
        /// The pods' selector.
        pods: Selector,
    },
    /// A range less its exceptions, as ranges.
    Block(Vec<IpNet>),
}

/// One rule: its peers (`None`: every peer) and its ports (`None`: every
/// port).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// Who; `None` for everyone.
    pub peers: Option<Vec<Peer>>,
    /// On what; `None` for everything.
    pub ports: Option<Vec<PortSpec>>,
}

impl Rule {
    /// Whether its peers name pods (whose labels, addresses and
    /// namespaces then decide what it allows).
    fn names_pods(&self) -> bool {
        self.peers
            .iter()
            .flatten()
            .any(|p| matches!(p, Peer::Pods { .. }))
    }

    /// Whether a port of it is named (on egress: each peer pod's own).
    fn names_ports(&self) -> bool {
        self.ports
            .iter()
            .flatten()
            .any(|p| matches!(p, PortSpec::Named(..)))
    }
}

/// A NetworkPolicy, as far as it decides traffic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// The pods of its namespace it selects.
    pub selector: Selector,
    /// Its ingress rules, when it isolates for ingress.
    pub ingress: Option<Vec<Rule>>,
    /// Its egress rules, when it isolates for egress.
    pub egress: Option<Vec<Rule>>,
}

impl Policy {
    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// The policy of the API's object. A part the API's validation would
    /// have refused (a malformed CIDR, a port out of range) allows
    /// nothing, and the policy still isolates: refusing fails closed.
    pub fn from_k8s(np: &NetworkPolicy) -> Policy {
        let spec = np.spec.clone().unwrap_or_default();
        let types = spec.policy_types.clone().unwrap_or_else(|| {
            let mut t = vec!["Ingress".to_string()];
            if spec.egress.as_ref().is_some_and(|e| !e.is_empty()) {
                t.push("Egress".to_string());
            }
            t
        });
        let ingress = types.iter().any(|t| t == "Ingress").then(|| {
            spec.ingress
                .iter()
                .flatten()
                .map(|r| rule(r.from.as_deref(), r.ports.as_deref()))
                .collect()
        });
        let egress = types.iter().any(|t| t == "Egress").then(|| {
            spec.egress
                .iter()
                .flatten()
                .map(|r| rule(r.to.as_deref(), r.ports.as_deref()))
                .collect()
        });
        Policy {
            namespace: np.metadata.namespace.clone().unwrap_or_default(),
            name: np.metadata.name.clone().unwrap_or_default(),
            selector: spec
                .pod_selector
                .as_ref()
                .map(Selector::from_k8s)
                .unwrap_or_default(),
            ingress,
            egress,
        }
    }
}

fn rule(peers: Option<&[NetworkPolicyPeer]>, ports: Option<&[NetworkPolicyPort]>) -> Rule {
    Rule {
        peers: peers
            .filter(|p| !p.is_empty())
            .map(|p| p.iter().map(peer).collect()),
        ports: ports
            .filter(|p| !p.is_empty())
            .map(|p| p.iter().filter_map(port).collect()),
    }
}

fn peer(p: &NetworkPolicyPeer) -> Peer {
    if let Some(block) = &p.ip_block {
        let Ok(cidr) = block.cidr.parse::<IpNet>() else {
            return Peer::Block(Vec::new());
        };
        let except: Vec<IpNet> = block
            .except
            .iter()
            .flatten()
            .filter_map(|e| e.parse().ok())
            .collect();
        return Peer::Block(subtract(cidr.trunc(), &except));
    }
    Peer::Pods {
        namespaces: p.namespace_selector.as_ref().map(Selector::from_k8s),
        pods: p
            .pod_selector
            .as_ref()
            .map(Selector::from_k8s)
            .unwrap_or_default(),
    }
}

/// A rule's port; `None` for one the API refuses (it allows nothing).
fn port(p: &NetworkPolicyPort) -> Option<PortSpec> {
    let proto = match p.protocol.as_deref().unwrap_or("TCP") {
        "TCP" => Proto::Tcp,
        "UDP" => Proto::Udp,
        "SCTP" => Proto::Sctp,
        _ => return None,
    };
    match &p.port {
        None => Some(PortSpec::All(proto)),
        Some(IntOrString::String(name)) => Some(PortSpec::Named(proto, name.clone())),
        Some(IntOrString::Int(first)) => {
            let first = u16::try_from(*first).ok().filter(|f| *f > 0)?;
            let last = match p.end_port {
                None => first,
                Some(end) => u16::try_from(end).ok().filter(|e| *e >= first)?,
            };
            Some(PortSpec::Range(PortRange { proto, first, last }))
        }
    }
}

/// `net` less `except`, as the fewest ranges: each exception splits the
/// ranges it falls in into halves until it stands alone.
pub fn subtract(net: IpNet, except: &[IpNet]) -> Vec<IpNet> {
    let mut out = vec![net];
    for e in except.iter().map(IpNet::trunc) {
        let mut next = Vec::new();
        for n in out {
            next.extend(remove(n, e));
        }
        out = next;
    }
    out.sort();
    out
}

fn remove(n: IpNet, e: IpNet) -> Vec<IpNet> {
    if e.contains(&n) {
        return Vec::new();
    }
    if !n.contains(&e) {
        return vec![n];
    }
    let Ok(halves) = n.subnets(n.prefix_len() + 1) else {
        return vec![n];
    };
    halves.flat_map(|h| remove(h, e)).collect()
}

/// A container port, named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedPort {
    /// Its name.
    pub name: String,
    /// Its protocol.
    pub proto: Proto,
    /// Its number.
    pub port: u16,
}

/// A pod as policy sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodView {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its labels.
    pub labels: Labels,
    /// Its addresses (`status.podIPs`).
    pub ips: Vec<IpAddr>,
    /// Its containers' named ports.
    pub ports: Vec<NamedPort>,
    /// Whether it is on the host's network.
    pub host_network: bool,
    /// Whether it has finished (`Succeeded` or `Failed`).
    pub finished: bool,
    /// The node it runs on.
    pub node: String,
}

impl PodView {
    /// The view of the API's pod.
    pub fn from_k8s(pod: &Pod) -> PodView {
        let spec = pod.spec.as_ref();
        let status = pod.status.as_ref();
        let mut ips: Vec<IpAddr> = status
            .and_then(|s| s.pod_ips.as_ref())
            .into_iter()
            .flatten()
            .filter_map(|p| p.ip.parse().ok())
            .collect();
        if ips.is_empty() {
            ips.extend(
                status
                    .and_then(|s| s.pod_ip.as_deref())
                    .and_then(|ip| ip.parse::<IpAddr>().ok()),
            );
        }
        let ports = spec
            .into_iter()
            .flat_map(|s| s.containers.iter())
            .flat_map(|c| c.ports.iter().flatten())
            .filter_map(|p| {
                Some(NamedPort {
                    name: p.name.clone()?,
                    proto: match p.protocol.as_deref().unwrap_or("TCP") {
                        "UDP" => Proto::Udp,
                        "SCTP" => Proto::Sctp,
                        _ => Proto::Tcp,
                    },
                    port: u16::try_from(p.container_port).ok()?,
                })
            })
            .collect();
        let phase = status.and_then(|s| s.phase.as_deref());
        PodView {
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: pod.metadata.name.clone().unwrap_or_default(),
            labels: pod.metadata.labels.clone().unwrap_or_default(),
            ips,
            ports,
            host_network: spec.and_then(|s| s.host_network).unwrap_or(false),
            finished: matches!(phase, Some("Succeeded") | Some("Failed")),
            node: spec.and_then(|s| s.node_name.clone()).unwrap_or_default(),
        }
    }

    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    fn named(&self, proto: Proto, name: &str) -> Option<u16> {
        self.ports
            .iter()
            .find(|p| p.proto == proto && p.name == name)
            .map(|p| p.port)
    }
}

/// The cluster as policy sees it: every policy, namespace (its labels)
/// and pod, each by its key (`namespace/name`; a namespace by its name),
/// and the addresses this node gave its own pods.
#[derive(Debug, Clone, Default)]
pub struct World {
    /// The policies.
    pub policies: BTreeMap<String, Policy>,
    /// The namespaces' labels.
    pub namespaces: BTreeMap<String, Labels>,
    /// The pods.
    pub pods: BTreeMap<String, PodView>,
    /// The addresses this node gave its pods, by pod: they stand for the
    /// pod's `status.podIPs`, which the API has only after the pod's ADD
    /// returned (and the pod must be isolated before).
    pub given: BTreeMap<String, Vec<IpAddr>>,
}

/// What NetworkPolicy does to one pod, and whether that depends on other
/// pods (a rule that names pods, or an egress port by name, which is each
/// peer pod's own): when another pod or a namespace changes, only the
/// pods that depend on others need planning again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Isolation {
    /// The pod's policy (isolated in neither direction: both `None`).
    pub policy: PodPolicy,
    /// Whether other pods' labels, addresses or ports, or namespaces'
    /// labels, are part of it.
    pub uses_others: bool,
}

impl World {
    /// The world of `policies`, `namespaces` (name, labels) and `pods`,
    /// with no address given.
    pub fn new(
        policies: impl IntoIterator<Item = Policy>,
        namespaces: impl IntoIterator<Item = (String, Labels)>,
        pods: impl IntoIterator<Item = PodView>,
    ) -> World {
        World {
            policies: policies.into_iter().map(|p| (p.key(), p)).collect(),
            namespaces: namespaces.into_iter().collect(),
            pods: pods.into_iter().map(|p| (p.key(), p)).collect(),
            given: BTreeMap::new(),
        }
    }

    /// The addresses of pod `key` as policy takes them: those this node
    /// gave it, else the API's.
    fn ips<'a>(&'a self, key: &str, pod: &'a PodView) -> &'a [IpAddr] {
        self.given.get(key).map_or(&pod.ips, |ips| ips)
    }

    fn is_peer(&self, key: &str, pod: &PodView) -> bool {
        !pod.host_network && !pod.finished && !self.ips(key, pod).is_empty()
    }

    fn nets(&self, key: &str, pod: &PodView) -> Vec<IpNet> {
        self.ips(key, pod)
            .iter()
            .map(|ip| IpNet::from(*ip))
            .collect()
    }

    /// The policies that select `pod` (those of its namespace whose
    /// selector matches its labels).
    pub fn selecting<'a>(&'a self, pod: &'a PodView) -> impl Iterator<Item = &'a Policy> + 'a {
        self.policies
            .values()
            .filter(move |p| p.namespace == pod.namespace && p.selector.matches(&pod.labels))
    }

    /// The pods (key, view) `peer` of a policy of namespace `namespace`
    /// names.
    fn peer_pods<'a>(
        &'a self,
        namespace: &'a str,
        peer: &'a Peer,
    ) -> impl Iterator<Item = (&'a String, &'a PodView)> + 'a {
        let wanted = match peer {
            Peer::Pods { namespaces, pods } => Some((namespaces, pods)),
            Peer::Block(_) => None,
        };
        let empty = Labels::new();
        self.pods.iter().filter(move |(k, p)| {
            let Some((namespaces, pods)) = wanted else {
                return false;
            };
            self.is_peer(k, p)
                && pods.matches(&p.labels)
                && match namespaces {
                    None => p.namespace == namespace,
                    Some(sel) => sel.matches(self.namespaces.get(&p.namespace).unwrap_or(&empty)),
                }
        })
    }

    /// What this node enforces for its pods (those `local` says are its
    /// own), planned whole.
    pub fn plan(&self, local: impl Fn(&str, &PodView) -> bool) -> PolicyPlan {
        PolicyPlan::new(
            self.pods
                .iter()
                .filter(|(k, p)| local(k, p))
                .filter_map(|(k, _)| self.isolation(k))
                .map(|i| i.policy),
        )
    }

    /// What is enforced for pod `key`, if the world has it and it can be
    /// isolated (not on the host's network, not finished, with an
    /// address).
    pub fn isolation(&self, key: &str) -> Option<Isolation> {
        let pod = self.pods.get(key)?;
        if !self.is_peer(key, pod) {
            return None;
        }
        Some(self.isolation_of(key, pod))
    }

    /// What is enforced for pod `key`, whatever its state (for the admin
    /// API); `None` when the world has no such pod.
    pub fn pod_policy(&self, key: &str) -> Option<PodPolicy> {
        let pod = self.pods.get(key)?;
        Some(self.isolation_of(key, pod).policy)
    }

    fn isolation_of(&self, key: &str, pod: &PodView) -> Isolation {
        let mut ingress: Option<Direction> = None;
        let mut egress: Option<Direction> = None;
        let mut uses_others = false;
        for policy in self.selecting(pod) {
            if let Some(rules) = &policy.ingress {
                let d = ingress.get_or_insert_with(Direction::default);
                d.policies.insert(policy.key());
                for r in rules {
                    uses_others |= r.names_pods();
                    d.allows.extend(self.ingress_allows(policy, r, pod));
                }
            }
            if let Some(rules) = &policy.egress {
                let d = egress.get_or_insert_with(Direction::default);
                d.policies.insert(policy.key());
                for r in rules {
                    uses_others |= r.names_pods() || r.names_ports();
                    d.allows.extend(self.egress_allows(policy, r));
                }
            }
        }
        Isolation {
            policy: PodPolicy {
                pod: key.to_owned(),
                ips: self.ips(key, pod).to_vec(),
                ingress,
                egress,
            },
            uses_others,
        }
    }

    /// The peers' addresses of a rule (`Peers::Any` without peers).
    fn peers(&self, policy: &Policy, rule: &Rule) -> Peers {
        let Some(peers) = &rule.peers else {
            return Peers::Any;
        };
        let mut nets = Vec::new();
        for peer in peers {
            match peer {
                Peer::Block(ranges) => nets.extend(ranges.iter().copied()),
                Peer::Pods { .. } => {
                    for (k, p) in self.peer_pods(&policy.namespace, peer) {
                        nets.extend(self.nets(k, p));
                    }
                }
            }
        }
        nets.sort();
        nets.dedup();
        Peers::Nets(nets)
    }

    /// An ingress rule of `policy` for `pod`: named ports are `pod`'s own.
    fn ingress_allows(&self, policy: &Policy, rule: &Rule, pod: &PodView) -> Vec<Allow> {
        let ports = match &rule.ports {
            None => Ports::Any,
            Some(specs) => Ports::Ranges(
                specs
                    .iter()
                    .filter_map(|s| match s {
                        PortSpec::All(proto) => Some(all_ports(*proto)),
                        PortSpec::Range(r) => Some(*r),
                        PortSpec::Named(proto, name) => {
                            pod.named(*proto, name).map(|port| PortRange {
                                proto: *proto,
                                first: port,
                                last: port,
                            })
                        }
                    })
                    .collect(),
            ),
        };
        vec![Allow {
            peers: self.peers(policy, rule),
            ports,
        }]
    }

    /// An egress rule of `policy`: numbered ports for every peer; a named
    /// port for each peer pod that has it, on that pod's addresses.
    fn egress_allows(&self, policy: &Policy, rule: &Rule) -> Vec<Allow> {
        let peers = self.peers(policy, rule);
        let Some(specs) = &rule.ports else {
            return vec![Allow {
                peers,
                ports: Ports::Any,
            }];
        };
        let numbered: Vec<PortRange> = specs
            .iter()
            .filter_map(|s| match s {
                PortSpec::All(proto) => Some(all_ports(*proto)),
                PortSpec::Range(r) => Some(*r),
                PortSpec::Named(..) => None,
            })
            .collect();
        let mut allows = Vec::new();
        if !numbered.is_empty() {
            allows.push(Allow {
                peers: peers.clone(),
                ports: Ports::Ranges(numbered),
            });
        }
        for spec in specs {
            let PortSpec::Named(proto, name) = spec else {
                continue;
            };
            // The pods the rule's peers cover: selected pods, or any pod
            // whose address an ipBlock (or no peer at all) covers.
            for (key, pod) in self.pods.iter().filter(|(k, p)| self.is_peer(k, p)) {
                let Some(port) = pod.named(*proto, name) else {
                    continue;
                };
                let covered = match &peers {
                    Peers::Any => true,
                    Peers::Nets(nets) => self
                        .ips(key, pod)
                        .iter()
                        .any(|ip| nets.iter().any(|n| n.contains(ip))),
                };
                if covered {
                    allows.push(Allow {
                        peers: Peers::Nets(self.nets(key, pod)),
                        ports: Ports::Ranges(vec![PortRange {
                            proto: *proto,
                            first: port,
                            last: port,
                        }]),
                    });
                }
            }
        }
        allows
    }
}

/// A namespace's name and labels.
pub fn namespace_labels(n: &Namespace) -> (String, Labels) {
    (
        n.metadata.name.clone().unwrap_or_default(),
        n.metadata.labels.clone().unwrap_or_default(),
    )
}

fn all_ports(proto: Proto) -> PortRange {
    PortRange {
        proto,
        first: 1,
        last: u16::MAX,
    }
}

#[cfg(test)]
mod tests;
