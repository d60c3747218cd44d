//! `--pod-cidr-from-node`: the node's pod CIDRs from its Node object
//! (`spec.podCIDRs`, which kube-controller-manager's node IPAM or the
//! cluster's installer fills), so that one DaemonSet serves every node
//! without a per-node flag. The other nodes' pod CIDRs, which this node
//! routes to, come from their Node objects too ([`super::node_peers`]).

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node as KubeNode;
use kube::Api;
use std::net::IpAddr;
use std::time::Duration;
use tether_base::error::{Error, Result};

/// How often the Node is read again while it has no pod CIDR yet.
const RETRY: Duration = Duration::from_secs(2);

/// The pod CIDRs of `spec` (`podCIDRs`, or the older single `podCIDR`):
/// at most one per family, as `--pod-cidr` takes them.
pub fn from_spec(node: &KubeNode) -> Result<Vec<IpNet>> {
    let spec = node.spec.as_ref();
    let mut list: Vec<String> = spec.and_then(|s| s.pod_cidrs.clone()).unwrap_or_default();
    if list.is_empty() {
        list.extend(spec.and_then(|s| s.pod_cidr.clone()));
    }
    let mut cidrs: Vec<IpNet> = Vec::new();
    for s in &list {
        let net: IpNet = s.parse().map_err(|_| {
            Error::InvalidConfig(format!("the Node's spec.podCIDRs holds {s:?}, not a CIDR"))
        })?;
        if cidrs.iter().any(|c| {
            matches!(
                (c, &net),
                (IpNet::V4(_), IpNet::V4(_)) | (IpNet::V6(_), IpNet::V6(_))
            )
        }) {
            return Err(Error::InvalidConfig(format!(
                "the Node's spec.podCIDRs has two CIDRs of one family ({list:?})"
            )));
        }
        cidrs.push(net.trunc());
    }
    Ok(cidrs)
}

/// The node's `InternalIP` addresses (`status.addresses`), at most one
/// per family, the first of each: the underlay address other nodes route
/// its pods through, as the kubelet reports it (its `--node-ip`, or the
/// address of its default route).
pub fn internal_ips(node: &KubeNode) -> Vec<IpAddr> {
    let mut ips: Vec<IpAddr> = Vec::new();
    let addresses = node.status.as_ref().and_then(|s| s.addresses.as_ref());
    for a in addresses.into_iter().flatten() {
        if a.type_ != "InternalIP" {
            continue;
        }
        if let Ok(ip) = a.address.parse::<IpAddr>() {
            if !ips.iter().any(|i| i.is_ipv4() == ip.is_ipv4()) {
                ips.push(ip);
            }
        }
    }
    ips
}

/// What this node's Node object says: its pod CIDRs and its `InternalIP`s.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeFacts {
    /// `spec.podCIDRs`, at most one per family.
    pub pod_cidrs: Vec<IpNet>,
    /// [`internal_ips`].
    pub internal_ips: Vec<IpAddr>,
}

/// Reads this node's pod CIDRs, waiting (and saying so every 30 s) while
/// the Node does not exist yet or has none, or the API server does not
/// answer. A Node with a malformed CIDR is an error at once.
pub async fn wait_for(client: kube::Client, node_name: &str) -> Result<NodeFacts> {
    let api: Api<KubeNode> = Api::all(client);
    let started = std::time::Instant::now();
    let mut said = std::time::Instant::now() - Duration::from_secs(3600);
    loop {
        let why = match super::bounded(api.get_opt(node_name)).await {
            Ok(Some(node)) => {
                let cidrs = from_spec(&node)?;
                if !cidrs.is_empty() {
                    let ips = internal_ips(&node);
                    tracing::info!(node = node_name, ?cidrs, internal_ips = ?ips, "pod CIDRs from the Node object");
                    return Ok(NodeFacts {
                        pod_cidrs: cidrs,
                        internal_ips: ips,
                    });
                }
                "its spec.podCIDRs is empty".to_owned()
            }
            Ok(None) => "no such Node yet".to_owned(),
            Err(e) => format!("the API server: {e}"),
        };
        if said.elapsed() >= Duration::from_secs(30) {
            tracing::warn!(
                node = node_name,
                waited_s = started.elapsed().as_secs(),
                "waiting for the Node's pod CIDRs: {why}"
            );
            said = std::time::Instant::now();
        }
        tokio::time::sleep(RETRY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::NodeSpec;

    fn node(cidrs: Option<Vec<&str>>, single: Option<&str>) -> KubeNode {
        KubeNode {
            spec: Some(NodeSpec {
                pod_cidrs: cidrs.map(|l| l.into_iter().map(String::from).collect()),
                pod_cidr: single.map(String::from),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn pod_cidrs_come_from_the_list_or_the_single_field() {
        let got = from_spec(&node(
            Some(vec!["10.244.1.0/24", "fd00:10:244:1::/64"]),
            None,
        ))
        .unwrap();
        assert_eq!(
            got,
            vec![
                "10.244.1.0/24".parse::<IpNet>().unwrap(),
                "fd00:10:244:1::/64".parse().unwrap()
            ]
        );
        let got = from_spec(&node(None, Some("10.244.2.0/24"))).unwrap();
        assert_eq!(got, vec!["10.244.2.0/24".parse::<IpNet>().unwrap()]);
        assert!(from_spec(&node(None, None)).unwrap().is_empty());
        assert!(from_spec(&KubeNode::default()).unwrap().is_empty());
    }

    #[test]
    fn malformed_or_doubled_families_are_refused() {
        let e = from_spec(&node(Some(vec!["10.244.1.0/33"]), None)).unwrap_err();
        assert_eq!(e.code(), 7);
        let e = from_spec(&node(Some(vec!["10.244.1.0/24", "10.244.2.0/24"]), None)).unwrap_err();
        assert!(e.to_string().contains("two CIDRs of one family"), "{e}");
    }
}
