//! A multi-node topology built from network namespaces, for cluster mode.
//!
//! - [`Fabric`]: a fabric netns holding a Linux bridge, the "switch" every
//!   node and the etcd control netns hang off (underlay [`UNDERLAY_V4`] and
//!   [`UNDERLAY_V6`], the bridge itself holds the gateways);
//! - [`EtcdCluster`]: Debian's etcd 3.4, several members in one control
//!   netns on the fabric, each on an address of its own; members can be
//!   killed, stopped and started again on the same data dir;
//! - [`ClusterNode`]: a node netns on the fabric (default routes via the
//!   fabric gateway, so tetherd's node-IP detection has something to find)
//!   with a [`Daemon`] in it, started with the cluster flags of [`NodeOpts`];
//! - [`Cluster`]: all of the above at once (built by
//!   [`Topology::tetherd`](crate::topology::Topology::tetherd)), plus pods
//!   ([`Pod`]) added through the real `tether` plugin and [`ping`] between
//!   them; on etcd,
//!   or ([`Store::Kubernetes`]) on a real kube-apiserver
//!   ([`crate::kube::KubeApi`], its own netns on the fabric) with tether's
//!   CRDs and RBAC installed, every daemon using the chart's service
//!   account's token.
//!
//! The safety rules of the crate hold here too: every netns, link and temp
//! dir is named with [`crate::run_prefix`]; every address and route lives in
//! a netns this module created (the machine's own netns is never touched);
//! the only processes signalled are etcd members and daemons spawned here,
//! through their `Child` handle; every guard cleans up in `Drop`, also when
//! a test panics.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

pub use crate::netns::{assert_ping_within, ping, ping_output};
use crate::{
    cni, tether_bin, unique_name, wait_until, CniEnv, CniOutput, Daemon, DaemonOpts, Netns, TempDir,
};

/// The underlay's IPv4 subnet, inside the fabric only.
pub const UNDERLAY_V4: &str = "10.77.0.0/16";
/// The underlay's IPv6 subnet, inside the fabric only.
pub const UNDERLAY_V6: &str = "fd00:77:ff::/64";
/// The fabric's IPv4 gateway (on the bridge): every node's default route.
pub const GATEWAY_V4: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
/// The fabric's IPv6 gateway (on the bridge): every node's default route.
pub const GATEWAY_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x77, 0xff, 0, 0, 0, 0, 1);
/// The cluster CIDRs [`NodeOpts::default`] hands to `--cluster-cidr`.
pub const CLUSTER_CIDRS: [&str; 2] = ["10.244.0.0/16", "fd00:10:244::/64"];
/// The route protocol of tetherd's routes to other nodes' blocks.
pub const CLUSTER_ROUTE_PROTOCOL: u8 = 202;
/// The `name` of the netconf [`ClusterNode`] adds pods with.
pub const CLUSTER_NETWORK: &str = "tether-cluster";
/// The etcd server binary (Debian's `etcd-server`).
pub const ETCD_BIN: &str = "/usr/bin/etcd";
/// The etcd client binary (Debian's `etcd-client`).
pub const ETCDCTL_BIN: &str = "/usr/bin/etcdctl";
/// The port every etcd member serves clients on (each on its own address).
pub const ETCD_CLIENT_PORT: u16 = 2379;
/// The port every etcd member talks to its peers on.
pub const ETCD_PEER_PORT: u16 = 2380;

/// The largest underlay host number: the digits must read as one IPv6
/// group in hex ([`Underlay::of_host`]), and a scale run's 500 nodes fit.
const MAX_HOST: u16 = 9999;
/// Underlay host numbers: etcd members from 11, nodes from 21.
const ETCD_HOST_BASE: u16 = 11;
const NODE_HOST_BASE: u16 = 21;
/// Underlay prefix lengths (of [`UNDERLAY_V4`] and [`UNDERLAY_V6`]).
const UNDERLAY_V4_LEN: u8 = 16;
const UNDERLAY_V6_LEN: u8 = 64;

/// Raft timing: small, so that losing the leader costs well under a second
/// (tetherd's default per-request timeout is 2 s), yet large enough that a
/// busy 2-core CI machine does not trigger spurious elections.
const ETCD_HEARTBEAT_MS: u32 = 50;
const ETCD_ELECTION_MS: u32 = 500;
/// The backend quota: tiny data, so 64 MiB is plenty.
const ETCD_QUOTA_BYTES: u64 = 64 << 20;
/// How long a start or restart may take to become healthy.
const ETCD_READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long [`EtcdCluster::stop_member`] waits after SIGTERM before SIGKILL.
const ETCD_STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long [`EtcdCluster::start_all`] waits for one member's peer port to
/// answer before it starts the next anyway.
const PEER_SERVE_TIMEOUT: Duration = Duration::from_secs(3);
/// How much of each log a panic message quotes.
const LOG_TAIL_LINES: usize = 30;

mod etcd;
mod fabric;
mod kube_store;
mod node;

pub use etcd::EtcdCluster;
pub use fabric::{Fabric, Underlay};
pub use node::{Backend, ClusterNode, NodeOpts, Overlay, Pod};

use crate::kube::{KubeApi, ServiceSpec};
use crate::topology::Tetherd;

/// Makes each named function `fn(Store)` a test on each store: the
/// tests `etcd::<name>` and `kubernetes::<name>`, so that a suite runs the
/// same checks on both (and one store's can be run alone by that prefix).
#[macro_export]
macro_rules! on_both_stores {
    ($($test:ident),* $(,)?) => {
        mod etcd {
            $(
                #[test]
                #[cfg_attr(
                    not(feature = "cluster-tests"),
                    ignore = "cluster tier: root, etcd and kube-apiserver; `make test` runs it"
                )]
                fn $test() {
                    super::$test($crate::cluster::Store::Etcd)
                }
            )*
        }
        mod kubernetes {
            $(
                #[test]
                #[cfg_attr(
                    not(feature = "cluster-tests"),
                    ignore = "cluster tier: root, etcd and kube-apiserver; `make test` runs it"
                )]
                fn $test() {
                    super::$test($crate::cluster::Store::Kubernetes)
                }
            )*
        }
    };
}

/// Which control store a [`Cluster`]'s nodes share.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Store {
    /// `--store etcd`: an etcd cluster of
    /// [`Topology::etcd_members`](crate::topology::Topology::etcd_members).
    #[default]
    Etcd,
    /// `--store kubernetes`: a kube-apiserver (on an etcd of its own, one
    /// member, that tetherd never sees).
    Kubernetes,
}

impl Store {
    /// Both, for suites that run on each.
    pub const ALL: [Store; 2] = [Store::Etcd, Store::Kubernetes];

    /// The `--store` value, which GetNode reports as `store_backend`.
    pub fn name(self) -> &'static str {
        match self {
            Store::Etcd => "etcd",
            Store::Kubernetes => "kubernetes",
        }
    }
}

// ---------------------------------------------------------------------------
// The whole topology

/// A fabric, a control store on it (etcd, or a kube-apiserver), and nodes
/// running tetherd against it.
///
/// Dropping it drops the nodes (daemons killed, netns deleted), then the
/// store, then the fabric. Pods are the caller's: drop them when done.
#[derive(Debug)]
pub struct Cluster {
    // Dropped in declaration order: nodes, the store, fabric.
    nodes: Vec<ClusterNode>,
    etcd: Option<EtcdCluster>,
    kube: Option<KubeApi>,
    fabric: Fabric,
    backend: Backend,
    opts: NodeOpts,
    next_host: u16,
}

impl Cluster {
    /// Builds the fabric, starts the store (etcd healthy, or the API
    /// server ready with tether's CRDs and RBAC) and then `nodes` nodes one
    /// after another (so node `i` registers `i`-th). Through
    /// [`Topology::tetherd`](crate::topology::Topology::tetherd).
    pub(crate) fn start(nodes: usize, opts: Tetherd) -> Cluster {
        let fabric = Fabric::new();
        let api =
            (opts.with_api || opts.kube_proxy || opts.store == Store::Kubernetes).then(|| {
                let api = KubeApi::start(&fabric);
                api.install_tether();
                let (ns, sa) = crate::kube::TETHER_SA;
                let kubeconfig = api.token_kubeconfig(ns, sa);
                (api, kubeconfig)
            });
        let mut node_opts = opts.node;
        let (etcd, kube, backend) = match (opts.store, api) {
            (Store::Etcd, api) => {
                let etcd = EtcdCluster::start(&fabric, opts.etcd_members);
                let backend = Backend::Etcd(etcd.endpoints());
                let api = api.map(|(api, kubeconfig)| {
                    node_opts
                        .extra_args
                        .extend(["--kubeconfig".to_owned(), kubeconfig.display().to_string()]);
                    api
                });
                (Some(etcd), api, backend)
            }
            (Store::Kubernetes, Some((api, kubeconfig))) => {
                (None, Some(api), Backend::Kubernetes(kubeconfig))
            }
            (Store::Kubernetes, None) => unreachable!("the Kubernetes store starts its API server"),
        };
        let mut cluster = Cluster {
            nodes: Vec::new(),
            etcd,
            kube,
            fabric,
            backend,
            opts: node_opts,
            next_host: NODE_HOST_BASE,
        };
        for _ in 0..nodes {
            cluster.add_node();
        }
        if opts.kube_proxy {
            cluster.start_kube_proxies();
        }
        cluster
    }

    /// Starts kube-proxy on every node that runs none, and waits until
    /// each has written its rules.
    fn start_kube_proxies(&mut self) {
        let Some(api) = self.kube.as_ref() else {
            panic!("kube-proxy needs the cluster's API server");
        };
        for node in &mut self.nodes {
            if !node.has_kube_proxy() {
                node.start_kube_proxy(api);
            }
        }
        for node in &self.nodes {
            assert!(
                wait_until(Duration::from_secs(60), || node.kube_proxy_synced()),
                "kube-proxy on {} wrote no rules: {}",
                node.name(),
                node.kube_proxy_log()
            );
        }
    }

    /// The Service of `spec` ([`KubeApi::expose_through`]): written with
    /// its endpoints by hand (no controller manager runs); returns it as
    /// the API server answers it. Waits until every node's kube-proxy has
    /// its rules.
    pub fn expose(&self, spec: &ServiceSpec<'_>) -> Value {
        let proxies: Vec<(&str, &Netns)> =
            self.nodes.iter().map(|n| (n.name(), n.netns())).collect();
        self.kube_api()
            .expose_through(spec, &proxies, &|i| self.nodes[i].kube_proxy_log())
    }

    /// Starts one more node with the cluster's options; returns its index.
    pub fn add_node(&mut self) -> usize {
        let opts = self.opts.clone();
        self.add_node_with(&opts)
    }

    /// Starts one more node with `opts`; returns its index. Every node gets
    /// fresh underlay addresses, never those of a removed node.
    pub fn add_node_with(&mut self, opts: &NodeOpts) -> usize {
        let host = self.next_host;
        // The next, past the /16's x.255 and x.0 of each 256.
        let mut next = host + 1;
        while matches!(next % 256, 0 | 255) {
            next += 1;
        }
        assert!(next <= MAX_HOST, "out of underlay addresses");
        self.next_host = next;
        let node = ClusterNode::start(&self.fabric, &self.backend, host, opts);
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    /// Takes node `i` out of the cluster (later nodes move down one index);
    /// dropping the returned node kills its daemon and deletes its netns.
    pub fn remove_node(&mut self, i: usize) -> ClusterNode {
        self.nodes.remove(i)
    }

    /// The nodes.
    pub fn nodes(&self) -> &[ClusterNode] {
        &self.nodes
    }

    /// Node `i`.
    pub fn node(&self, i: usize) -> &ClusterNode {
        &self.nodes[i]
    }

    /// Node `i`, to restart or kill its daemon.
    pub fn node_mut(&mut self, i: usize) -> &mut ClusterNode {
        &mut self.nodes[i]
    }

    /// The store the nodes share.
    pub fn store(&self) -> Store {
        match self.backend {
            Backend::Etcd(_) => Store::Etcd,
            Backend::Kubernetes(_) => Store::Kubernetes,
        }
    }

    /// The etcd cluster (panics on the Kubernetes store).
    pub fn etcd(&self) -> &EtcdCluster {
        self.etcd
            .as_ref()
            .expect("this cluster runs on the Kubernetes store")
    }

    /// The etcd cluster, to kill, stop or start members (panics on the
    /// Kubernetes store).
    pub fn etcd_mut(&mut self) -> &mut EtcdCluster {
        self.etcd
            .as_mut()
            .expect("this cluster runs on the Kubernetes store")
    }

    /// The API server (panics on etcd without
    /// [`Topology::with_api`](crate::topology::Topology::with_api)).
    pub fn kube_api(&self) -> &KubeApi {
        self.kube.as_ref().expect("this cluster has no API server")
    }

    /// The API server, to stop and start (panics on etcd without
    /// [`Topology::with_api`](crate::topology::Topology::with_api)).
    pub fn kube_api_mut(&mut self) -> &mut KubeApi {
        self.kube.as_mut().expect("this cluster has no API server")
    }

    /// The fabric.
    pub fn fabric(&self) -> &Fabric {
        &self.fabric
    }

    /// A new pod added on node `i` ([`ClusterNode::add_pod`]).
    pub fn add_pod(&self, i: usize) -> Pod {
        self.nodes[i].add_pod()
    }

    /// Every key under `/tether/` in etcd, with its value (panics on the
    /// Kubernetes store).
    pub fn etcd_keys(&self) -> BTreeMap<String, String> {
        self.etcd().get_prefix("/tether/")
    }

    /// Every record of the store as etcd keys it (`/tether/v1/...`), with
    /// its value: etcd's keys, or the Kubernetes store's objects mapped to
    /// the same keys (a node's Lease is its `alive/` key while it exists).
    pub fn store_keys(&self) -> BTreeMap<String, String> {
        match (&self.backend, &self.kube) {
            (Backend::Kubernetes(_), Some(api)) => kube_store::records(api),
            _ => self.etcd_keys(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_topology_can_be_shared_by_threads() {
        // Tests fan pod ADDs out with `crate::parallel(n, |i| cluster.add_pod(i))`.
        fn shared<T: Sync>() {}
        shared::<Cluster>();
        shared::<Pod>();
    }

    #[test]
    fn underlay_addresses_of_a_host() {
        let u = Underlay::of_host(String::new(), 21);
        assert_eq!(u.v4, Ipv4Addr::new(10, 77, 0, 21));
        assert_eq!(u.v6, "fd00:77:ff::21".parse::<Ipv6Addr>().unwrap());
    }

    #[test]
    fn cluster_flags_follow_the_spec() {
        let u = Underlay::of_host("x".into(), 21);
        let args = NodeOpts {
            overlay: Overlay::Vxlan,
            explicit_node_ip: true,
            ..NodeOpts::default()
        }
        .daemon_args(&Backend::Etcd("http://10.77.0.11:2379".into()), &u)
        .join(" ");
        assert_eq!(
            args,
            "--store etcd --etcd-endpoints http://10.77.0.11:2379 \
             --cluster-cidr 10.244.0.0/16 --cluster-cidr fd00:10:244::/64 \
             --overlay vxlan --lease-ttl 2 --node-grace 3 --node-ip 10.77.0.21"
        );
        let single = NodeOpts {
            pod_cidrs: vec!["10.244.1.0/24".into()],
            ..NodeOpts::default()
        };
        assert!(single
            .daemon_args(&Backend::Etcd("e".into()), &u)
            .is_empty());
        let kube = NodeOpts::default()
            .daemon_args(&Backend::Kubernetes("/k/sa.kubeconfig".into()), &u)
            .join(" ");
        assert_eq!(
            kube,
            "--store kubernetes --kubeconfig /k/sa.kubeconfig --lease-namespace kube-system \
             --cluster-cidr 10.244.0.0/16 --cluster-cidr fd00:10:244::/64 \
             --overlay none --lease-ttl 2 --node-grace 3"
        );
    }
}
