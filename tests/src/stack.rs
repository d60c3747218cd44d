//! The IP families of a kubelet cluster ([`Stack`]): what its API server,
//! controller manager, kubelets, kube-proxy, CoreDNS and tether's chart
//! are given for IPv4 alone, dual-stack (IPv4 first), or IPv6 alone.
//!
//! The addresses are those of tether's chart defaults and of a kubeadm
//! cluster: pods `10.244.0.0/16` and `fd00:10:244::/56` (a /24 and a /64
//! per node when the controller manager hands them out), Services
//! `10.96.0.0/16` and `fd00:10:96::/112`, cluster DNS at the tenth address
//! of the first Service range.

use std::net::IpAddr;

use crate::cluster::Underlay;

/// The IPv4 pod network (tether's cluster CIDR).
pub const POD_CIDR_V4: &str = "10.244.0.0/16";
/// The IPv6 pod network (the chart's default second cluster CIDR).
pub const POD_CIDR_V6: &str = "fd00:10:244::/56";
/// The IPv4 Service range.
pub const SERVICE_CIDR_V4: &str = "10.96.0.0/16";
/// The IPv6 Service range (the chart's default `noNatTo`); a /112 is well
/// inside what the API server's allocator takes.
pub const SERVICE_CIDR_V6: &str = "fd00:10:96::/112";
/// The `kubernetes` Service's IPv4 address (the first of its range).
pub const API_SERVICE_V4: &str = "10.96.0.1";
/// The `kubernetes` Service's IPv6 address.
pub const API_SERVICE_V6: &str = "fd00:10:96::1";
/// `kube-dns`' IPv4 ClusterIP.
pub const CLUSTER_DNS_V4: &str = "10.96.0.10";
/// `kube-dns`' IPv6 ClusterIP.
pub const CLUSTER_DNS_V6: &str = "fd00:10:96::a";
/// The size of each node's pod CIDR, per family, when the controller
/// manager hands them out (`--node-cidr-mask-size-ipv4`, `-ipv6`).
pub const NODE_CIDR_SIZES: (u8, u8) = (24, 64);

/// A cluster's IP families.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Stack {
    /// IPv4 alone (every cluster before issue 41, and the default).
    #[default]
    V4,
    /// Both families, IPv4 first (the primary family of the Services,
    /// the nodes' first address, `status.podIP`).
    Dual,
    /// IPv6 alone.
    V6,
}

impl Stack {
    /// Every stack, in the order reports list them.
    pub const ALL: [Stack; 3] = [Stack::V4, Stack::Dual, Stack::V6];

    /// `v4`, `dual` or `v6` (`make conformance STACK=...`).
    pub fn parse(s: &str) -> Result<Stack, String> {
        match s {
            "v4" => Ok(Stack::V4),
            "dual" => Ok(Stack::Dual),
            "v6" => Ok(Stack::V6),
            other => Err(format!("no stack {other}: v4, dual or v6")),
        }
    }

    /// The name [`Stack::parse`] takes.
    pub fn name(self) -> &'static str {
        match self {
            Stack::V4 => "v4",
            Stack::Dual => "dual",
            Stack::V6 => "v6",
        }
    }

    /// A heading for reports: "IPv4", "dual-stack (IPv4, IPv6)", "IPv6".
    pub fn title(self) -> &'static str {
        match self {
            Stack::V4 => "IPv4",
            Stack::Dual => "dual-stack (IPv4 first, IPv6)",
            Stack::V6 => "IPv6 only",
        }
    }

    /// Whether the cluster has IPv4.
    pub fn has_v4(self) -> bool {
        self != Stack::V6
    }

    /// Whether the cluster has IPv6.
    pub fn has_v6(self) -> bool {
        self != Stack::V4
    }

    /// One value per family the cluster has, the primary first.
    fn pick<T>(self, v4: T, v6: T) -> Vec<T> {
        match self {
            Stack::V4 => vec![v4],
            Stack::Dual => vec![v4, v6],
            Stack::V6 => vec![v6],
        }
    }

    /// The pod networks (tether's cluster CIDRs, the controller manager's
    /// and kube-proxy's `--cluster-cidr`).
    pub fn pod_cidrs(self) -> Vec<&'static str> {
        self.pick(POD_CIDR_V4, POD_CIDR_V6)
    }

    /// The Service ranges (`--service-cluster-ip-range`).
    pub fn service_cidrs(self) -> Vec<&'static str> {
        self.pick(SERVICE_CIDR_V4, SERVICE_CIDR_V6)
    }

    /// `kube-dns`' ClusterIPs; the first is the kubelets' `clusterDNS`.
    pub fn cluster_dns(self) -> Vec<&'static str> {
        self.pick(CLUSTER_DNS_V4, CLUSTER_DNS_V6)
    }

    /// The `kubernetes` Service's addresses (the API server certificate's
    /// names).
    pub fn api_service_ips(self) -> Vec<&'static str> {
        self.pick(API_SERVICE_V4, API_SERVICE_V6)
    }

    /// A host's addresses on the fabric that the cluster uses (the
    /// kubelet's `--node-ip`, the API server's address first).
    pub fn addresses(self, underlay: &Underlay) -> Vec<IpAddr> {
        self.pick(IpAddr::V4(underlay.v4), IpAddr::V6(underlay.v6))
    }

    /// The cluster's values joined by commas, as Kubernetes' dual-stack
    /// flags take them.
    pub fn joined<T: ToString>(values: &[T]) -> String {
        values
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// `ip` as a URL's host: in brackets if IPv6.
pub fn url_host(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(a) => a.to_string(),
        IpAddr::V6(a) => format!("[{a}]"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_stack_lists_its_families_primary_first() {
        assert_eq!(Stack::Dual.pod_cidrs(), [POD_CIDR_V4, POD_CIDR_V6]);
        assert_eq!(Stack::V6.service_cidrs(), [SERVICE_CIDR_V6]);
        assert_eq!(Stack::V4.cluster_dns(), [CLUSTER_DNS_V4]);
        for s in Stack::ALL {
            assert_eq!(Stack::parse(s.name()), Ok(s));
        }
        assert!(Stack::parse("v5").is_err());
        assert_eq!(
            Stack::joined(&Stack::Dual.service_cidrs()),
            "10.96.0.0/16,fd00:10:96::/112"
        );
    }

    #[test]
    fn the_dns_and_api_addresses_are_inside_the_service_ranges() {
        for s in Stack::ALL {
            let ranges: Vec<ipnet::IpNet> = s
                .service_cidrs()
                .iter()
                .map(|c| c.parse().unwrap())
                .collect();
            for ip in s.cluster_dns().iter().chain(&s.api_service_ips()) {
                let ip: IpAddr = ip.parse().unwrap();
                assert!(ranges.iter().any(|r| r.contains(&ip)), "{ip} in {ranges:?}");
            }
        }
    }
}
