//! tetherd's command line: its flags (clap), the values they take, and
//! the checks of their combinations that clap's attributes cannot say.
//! Every check that needs no I/O is here, so that a unit test shows each
//! combination's answer; what only the running node can tell (whether a
//! Kubernetes API is there) is checked by [`super::run`] with the words
//! [`Options::needs_kube`] gives.

use std::net::IpAddr;
use std::path::PathBuf;

use clap::Parser;
use ipnet::IpNet;

use tether_base::error::Error;

/// tether's node daemon: IPAM, pod wiring and routes for the tether CNI plugin.
///
/// Run it in the node's network namespace (it creates the node-side veths and
/// routes there). The `tether` plugin binary forwards CNI calls to it over a
/// unix socket.
#[derive(Debug, Parser)]
#[command(name = "tetherd", version)]
pub struct Options {
    /// This node's name (defaults to the hostname).
    #[arg(long, env = "TETHER_NODE_NAME")]
    pub node_name: Option<String>,

    /// A fixed pod CIDR for this node (single node, or CIDRs handed out by
    /// hand): give it once per family (one IPv4 and/or one IPv6), e.g.
    /// --pod-cidr 10.244.1.0/24 --pod-cidr fd00:10:244:1::/64. Give one of
    /// --pod-cidr, --pod-cidr-from-node or --cluster-cidr.
    #[arg(
        long = "pod-cidr",
        value_name = "CIDR",
        value_parser = network,
        required_unless_present_any = ["cluster_cidrs", "pod_cidr_from_node"],
        conflicts_with_all = ["cluster_cidrs", "pod_cidr_from_node"]
    )]
    pub pod_cidrs: Vec<IpNet>,

    /// Take this node's pod CIDRs from its Node object's spec.podCIDRs
    /// (needs the Kubernetes API: --kubeconfig, or the in-cluster service
    /// account), instead of --pod-cidr: one DaemonSet for every node. The
    /// daemon waits for them at start-up; a later change applies at the
    /// next restart, and never re-addresses a running pod. Every other
    /// node's pod CIDRs are routed as their Node objects show them (watched;
    /// through each node's InternalIP, per --overlay), and are never NATed
    /// to.
    #[arg(long, conflicts_with = "cluster_cidrs")]
    pub pod_cidr_from_node: bool,

    /// A kubeconfig for the Kubernetes API: the migration-target watch on
    /// this node's pods, IPAMClaims, KubeVirt's VirtualMachines (a deleted
    /// one's addresses are freed), --pod-cidr-from-node, and events on
    /// pods. Without it, the in-cluster service account is used when the
    /// daemon runs in a pod; with neither, the daemon runs without the API
    /// (cutovers then follow the VM's RARP and the admin call only).
    #[arg(long, value_name = "FILE", env = "TETHER_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// Cluster mode: the CIDR every node claims address blocks from, once
    /// per family, e.g. --cluster-cidr 10.244.0.0/16 --cluster-cidr
    /// fd00:10:244::/56. Every node of a cluster must be given the same.
    #[arg(long = "cluster-cidr", value_name = "CIDR", value_parser = network)]
    pub cluster_cidrs: Vec<IpNet>,

    /// Named pools: a JSON file of subnets with ranges, exclusions, a
    /// gateway and routes, which networks select by name (`pool` in the
    /// netconf, `ipam.pool` when tether is another plugin's IPAM, or the
    /// pod annotation tether.dev/pool). Read again on SIGHUP and when its
    /// content changes (looked at every 10 s).
    #[arg(long = "pools", value_name = "FILE")]
    pub pools_file: Option<PathBuf>,

    /// Serve Prometheus metrics over HTTP at /metrics on this address
    /// (IP:PORT, e.g. 10.0.0.5:9654 or [fd00::5]:9654, or :PORT for every
    /// address of the node). Off when unset.
    #[arg(long = "metrics-address", value_name = "ADDR", value_parser = listen_address)]
    pub metrics_address: Option<std::net::SocketAddr>,

    /// Prefix length of the IPv4 blocks claimed from the cluster CIDR.
    #[arg(long, default_value_t = 26, value_parser = clap::value_parser!(u8).range(8..=30))]
    pub block_size: u8,

    /// Prefix length of the IPv6 blocks claimed from the cluster CIDR.
    #[arg(long, default_value_t = 122, value_parser = clap::value_parser!(u8).range(64..=126))]
    pub block_size_v6: u8,

    /// Where the control plane (node records, blocks, VM address records)
    /// lives: "embedded" (alias "local": in the state dir, for one node),
    /// "etcd", or "kubernetes" (objects of tether's CRDs through the
    /// Kubernetes API: --kubeconfig, or the in-cluster service account;
    /// the CRDs must be installed). Pod attachment records always stay in
    /// the node's local journal.
    #[arg(long, value_enum, default_value_t = StoreKind::Local)]
    pub store: StoreKind,

    /// etcd client URLs, comma-separated, e.g.
    /// https://10.0.0.1:2379,https://10.0.0.2:2379.
    #[arg(long, value_delimiter = ',', value_name = "URL")]
    pub etcd_endpoints: Vec<String>,

    /// CA bundle that signed the etcd members' certificates.
    #[arg(long, value_name = "FILE")]
    pub etcd_ca: Option<PathBuf>,

    /// Client certificate for etcd (mutual TLS); needs --etcd-key.
    #[arg(long, value_name = "FILE", requires = "etcd_key")]
    pub etcd_cert: Option<PathBuf>,

    /// The client certificate's private key.
    #[arg(long, value_name = "FILE", requires = "etcd_cert")]
    pub etcd_key: Option<PathBuf>,

    /// Key prefix of tether's records in etcd.
    #[arg(long, default_value = "/tether")]
    pub etcd_prefix: String,

    /// Bound on every control-plane request (etcd's, or the Kubernetes
    /// API's with --store kubernetes), in ms. A block claim while the store
    /// does not answer fails after this with CNI code 11.
    #[arg(long, alias = "store-timeout-ms", default_value_t = 2000)]
    pub etcd_timeout_ms: u64,

    /// --store kubernetes: the namespace of the nodes' Leases (liveness,
    /// `tether-<node>`). Default: the client's namespace (the pod's, in a
    /// cluster).
    #[arg(long, value_name = "NAMESPACE")]
    pub lease_namespace: Option<String>,

    /// This node's underlay address that other nodes route its pods
    /// through (once per family). Default: with --pod-cidr-from-node the
    /// Node's InternalIP, else (and without one) the address of the
    /// interface the default route uses.
    #[arg(long = "node-ip", value_name = "IP")]
    pub node_ips: Vec<IpAddr>,

    /// How pods reach other nodes' pods (cluster mode and
    /// --pod-cidr-from-node): "none" (host-gw: a route per block or pod
    /// CIDR via the node's IP; the nodes share an L2 segment) or "vxlan"
    /// (one VXLAN device with static entries per node, for any IP
    /// underlay).
    #[arg(long, value_enum, default_value_t = OverlayKind::None)]
    pub overlay: OverlayKind,

    /// VXLAN network identifier (--overlay vxlan).
    #[arg(long, default_value_t = 4097)]
    pub vxlan_vni: u32,

    /// VXLAN UDP port (--overlay vxlan).
    #[arg(long, default_value_t = 4789)]
    pub vxlan_port: u16,

    /// Time to live of the node's liveness lease, in seconds.
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..))]
    pub lease_ttl: u64,

    /// How often, in seconds, the routes to other nodes and to VMs are read
    /// back from the kernel and repaired (a route deleted by hand). Between
    /// these passes, a change of the cluster or of a VM record changes only
    /// its own routes, without reading the kernel.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub route_repair_interval: u64,

    /// How long, in seconds, a node's lease must have been gone before the
    /// other nodes delete its record and blocks and withdraw its routes.
    /// Keep it well above a daemon restart.
    #[arg(long, default_value_t = 600)]
    pub node_grace: u64,

    /// The unix socket to serve the CNI and admin services on. The plugin
    /// finds it through the netconf's "socket" field (same default).
    #[arg(long, default_value = "/run/tether/tether.sock")]
    pub socket: PathBuf,

    /// Where durable state lives: the store and the pending-DEL queue. The
    /// only knob for it: at start-up the daemon points the path the plugin
    /// queues through, `<socket>.pending-del`, at `<state-dir>/pending-del`.
    #[arg(long, default_value = "/var/lib/tether")]
    pub state_dir: PathBuf,

    /// MTU of pod interfaces (both ends of the veth); a netconf "mtu"
    /// overrides it per network. Default: 1500, or with `--overlay vxlan`
    /// the VXLAN device's (the underlay's MTU less 50 bytes over IPv4, 70
    /// over IPv6), so that a pod's full-size packet fits the overlay.
    /// Set it to the node uplink's MTU (less the overlay's overhead).
    #[arg(long, value_parser = clap::value_parser!(u32).range(576..=65535))]
    pub mtu: Option<u32>,

    /// When a state change is flushed to the device. "always": flushed
    /// (fdatasync of the journal) before the reply. "background": written to
    /// the journal before the reply, which is enough to survive a daemon
    /// crash, and flushed within milliseconds by a thread that groups
    /// concurrent changes into one flush; for disks whose flushes are slow.
    #[arg(long, value_enum, default_value_t = FsyncKind::Always)]
    pub fsync: FsyncKind,

    /// A uid, besides root, allowed to use the socket (repeatable). The
    /// socket is mode 0600 and owned by root; peers are checked with
    /// SO_PEERCRED.
    #[arg(long = "allow-uid", value_name = "UID")]
    pub allowed_uids: Vec<u32>,

    /// UDP port of cutover notices between nodes (on the node addresses):
    /// a migration's target tells the other nodes that its VM runs there
    /// while it writes the record, and they repoint at once instead of on
    /// the record's watch. The same port carries a migrating VM's
    /// connections (its conntrack flows) from its source node to its
    /// target. 0 turns both off: the other nodes then repoint on the watch
    /// alone, and the VM's connections through outbound NAT, or to a
    /// Service backend on the node it left, break at the migration.
    #[arg(long, value_name = "PORT", default_value_t = 9655)]
    pub cutover_port: u16,

    /// When a VM leaves this node by live migration, hold the packets sent
    /// to its guest and, after the cutover, send again those the guest
    /// never read while QEMU paused it: they reach it late instead of
    /// never. --migration-replay=false turns it off (the flows of the VM's
    /// connections go to the target either way).
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    pub migration_replay: bool,

    /// Outbound NAT: traffic from pod addresses to anywhere outside the pod
    /// ranges, the named pools and --no-nat-to leaves with the node's
    /// address (nft table inet tether). --outbound-nat=false turns it off
    /// and removes the table.
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    pub outbound_nat: bool,

    /// Kubernetes NetworkPolicy, enforced for this node's pods (nft table
    /// inet tether_policy), from the API's NetworkPolicies, namespaces and
    /// pods; an ADD returns only once its pod's isolation is in the kernel.
    /// Needs the Kubernetes API (--kubeconfig, or in a pod). The chart turns
    /// it on; false (the default, for clusters whose policy engine is
    /// another) removes the table.
    #[arg(long, value_name = "BOOL", default_value_t = false, action = clap::ArgAction::Set)]
    pub network_policy: bool,

    /// KubeVirt VM pods: before a pod takes a VM's addresses or becomes
    /// its migration's target, check through the Kubernetes API that it
    /// is the VM's launcher (controlled by the VirtualMachineInstance its
    /// kubevirt.io/domain names), and refuse it (code 120) if not: a pod
    /// that copies a VM's annotations gets neither. Without the API there
    /// is nothing to check against, and a VM pod is taken on its
    /// annotations' word. false: no check (VM pods that KubeVirt does not
    /// make).
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    pub check_vm_launchers: bool,

    /// A destination range never NATed to, besides the pod ranges and the
    /// named pools: the service CIDR, or in --pod-cidr mode the whole
    /// cluster's pod range. Repeatable, or comma-separated.
    #[arg(long = "no-nat-to", value_name = "CIDR", value_delimiter = ',')]
    pub no_nat_to: Vec<IpNet>,

    /// Log filter, e.g. "info" or "tetherd=debug".
    #[arg(long, default_value = "info", env = "TETHER_LOG")]
    pub log_level: String,

    /// Log format: "text", one line per event (coloured only when stderr
    /// is a terminal and NO_COLOR is unset), or "json", one object per
    /// line, for a log collector.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, env = "TETHER_LOG_FORMAT")]
    pub log_format: LogFormat,
}

/// The --log-format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Plain lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Whether text logs carry ANSI colours: only for a person at a terminal,
/// never into a file or `kubectl logs`, and never under NO_COLOR
/// (no-color.org: set and not empty).
pub fn colour(stderr_is_terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    stderr_is_terminal && no_color.is_none_or(|v| v.is_empty())
}

/// A `--pod-cidr` or `--cluster-cidr`: a network, refused with host bits
/// set as the pools file refuses it.
fn network(s: &str) -> Result<IpNet, String> {
    let cidr: IpNet = s
        .parse()
        .map_err(|_| format!("{s:?} is not a CIDR (e.g. 10.244.1.0/24)"))?;
    crate::pools::def::check_network(&cidr)?;
    Ok(cidr)
}

/// A listen address: `IP:PORT`, `[IPv6]:PORT`, or `:PORT` for every
/// address (`[::]`, which takes IPv4 too, or `0.0.0.0` where the node has
/// no IPv6: see [`crate::api::scrape::bind`]).
fn listen_address(s: &str) -> Result<std::net::SocketAddr, String> {
    let bad = || format!("{s:?} is not IP:PORT, [IPv6]:PORT or :PORT");
    match s.strip_prefix(':') {
        Some(port) => {
            let port: u16 = port.parse().map_err(|_| bad())?;
            Ok((std::net::Ipv6Addr::UNSPECIFIED, port).into())
        }
        None => s.parse().map_err(|_| bad()),
    }
}

/// The --store backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StoreKind {
    /// In the state dir (one node).
    #[value(alias = "embedded")]
    Local,
    /// An etcd cluster.
    Etcd,
    /// The Kubernetes API (tether's CRDs and Leases).
    Kubernetes,
}

/// The --overlay mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OverlayKind {
    /// host-gw routes.
    None,
    /// VXLAN.
    Vxlan,
}

/// The --fsync policy.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum FsyncKind {
    /// Flush before every reply.
    Always,
    /// Write before the reply, flush in the background.
    Background,
}

impl Options {
    /// The combinations clap's attributes cannot refuse: a control store
    /// other than the embedded one is for cluster mode.
    pub fn check(&self) -> Result<(), Error> {
        if self.cluster_cidrs.is_empty() && self.store != StoreKind::Local {
            return Err(Error::InvalidConfig(format!(
                "--store {} is for cluster mode: give --cluster-cidr instead of --pod-cidr",
                if self.store == StoreKind::Etcd {
                    "etcd"
                } else {
                    "kubernetes"
                }
            )));
        }
        Ok(())
    }

    /// What is allowed but does nothing, for the log.
    pub fn warnings(&self) -> Vec<&'static str> {
        let mut said = Vec::new();
        if self.overlay == OverlayKind::Vxlan
            && self.cluster_cidrs.is_empty()
            && !self.pod_cidr_from_node
        {
            said.push("--overlay vxlan has no effect with --pod-cidr: this node routes to no other node (use --pod-cidr-from-node or --cluster-cidr)");
        }
        said
    }

    /// Why these options cannot run without the Kubernetes API, if they
    /// cannot: the refusal's words when no API is found.
    pub fn needs_kube(&self) -> Option<&'static str> {
        if self.pod_cidr_from_node {
            Some("--pod-cidr-from-node needs the Kubernetes API: give --kubeconfig, or run in a pod with a service account")
        } else if self.store == StoreKind::Kubernetes {
            Some("--store kubernetes needs the Kubernetes API: give --kubeconfig, or run in a pod with a service account")
        } else {
            None
        }
    }

    /// The ranges of this node's pod addresses, which outbound NAT
    /// masquerades: the cluster CIDRs in cluster mode (every node's
    /// blocks), else the pod CIDRs.
    pub fn pod_ranges(&self) -> Vec<IpNet> {
        if self.cluster_cidrs.is_empty() {
            self.pod_cidrs.clone()
        } else {
            self.cluster_cidrs.clone()
        }
    }

    /// `--overlay` and its VXLAN settings.
    pub fn overlay(&self) -> crate::cluster::Overlay {
        match self.overlay {
            OverlayKind::None => crate::cluster::Overlay::HostGw,
            OverlayKind::Vxlan => crate::cluster::Overlay::Vxlan {
                vni: self.vxlan_vni,
                port: self.vxlan_port,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listen_address_may_be_a_bare_port_for_every_address() {
        let ok = |s: &str| {
            listen_address(s)
                .unwrap_or_else(|e| panic!("{e}"))
                .to_string()
        };
        assert_eq!(ok(":9654"), "[::]:9654");
        assert_eq!(ok("10.0.0.5:9654"), "10.0.0.5:9654");
        assert_eq!(ok("[fd00::5]:9654"), "[fd00::5]:9654");
        assert_eq!(ok("0.0.0.0:9654"), "0.0.0.0:9654");
        for bad in [":", ":http", ":70000", "9654", "10.0.0.5", "host:9654"] {
            let e = listen_address(bad).expect_err(bad);
            assert!(e.contains("is not IP:PORT, [IPv6]:PORT or :PORT"), "{e}");
        }
        let args = Options::try_parse_from([
            "tetherd",
            "--pod-cidr",
            "10.0.0.0/24",
            "--metrics-address",
            ":9654",
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(args.metrics_address.map(|a| a.port()), Some(9654));
    }

    #[test]
    fn a_pod_cidr_with_host_bits_is_refused_as_the_pools_file_refuses_it() {
        let said = Options::try_parse_from(["tetherd", "--pod-cidr", "10.0.0.5/24"])
            .expect_err("host bits")
            .to_string();
        assert!(
            said.contains("10.0.0.5/24 has host bits set; did you mean 10.0.0.0/24?"),
            "{said}"
        );
        let said = Options::try_parse_from(["tetherd", "--cluster-cidr", "fd00::1/56"])
            .expect_err("host bits")
            .to_string();
        assert!(said.contains("did you mean fd00::/56?"), "{said}");
        let said = Options::try_parse_from(["tetherd", "--pod-cidr", "10.0.0.0"])
            .expect_err("no prefix")
            .to_string();
        assert!(said.contains("is not a CIDR"), "{said}");
        let args = Options::try_parse_from([
            "tetherd",
            "--pod-cidr",
            "10.0.0.0/24",
            "--pod-cidr",
            "fd00::/64",
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(args.pod_cidrs.len(), 2);
    }

    #[test]
    fn logs_are_coloured_only_for_a_terminal_without_no_color() {
        use std::ffi::OsStr;
        assert!(colour(true, None));
        assert!(colour(true, Some(OsStr::new(""))));
        assert!(!colour(true, Some(OsStr::new("1"))));
        assert!(!colour(false, None));
        let args = Options::try_parse_from(["tetherd", "--pod-cidr", "10.0.0.0/24"])
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(args.log_format, LogFormat::Text);
        let args = Options::try_parse_from([
            "tetherd",
            "--pod-cidr",
            "10.0.0.0/24",
            "--log-format",
            "json",
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(args.log_format, LogFormat::Json);
        assert!(Options::try_parse_from([
            "tetherd",
            "--pod-cidr",
            "10.0.0.0/24",
            "--log-format",
            "xml"
        ])
        .is_err());
    }

    fn parse(flags: &[&str]) -> Result<Options, String> {
        Options::try_parse_from(std::iter::once("tetherd").chain(flags.iter().copied()))
            .map_err(|e| e.to_string())
    }

    #[test]
    fn a_node_has_exactly_one_way_to_its_pod_addresses() {
        let refused = |flags: &[&str], said: &str| {
            let e = parse(flags).expect_err("refused");
            assert!(e.contains(said), "{flags:?}: {e}");
        };
        refused(&[], "--pod-cidr <CIDR>");
        refused(
            &[
                "--pod-cidr",
                "10.0.0.0/24",
                "--cluster-cidr",
                "10.244.0.0/16",
            ],
            "cannot be used with",
        );
        refused(
            &["--pod-cidr", "10.0.0.0/24", "--pod-cidr-from-node"],
            "cannot be used with",
        );
        refused(
            &["--pod-cidr-from-node", "--cluster-cidr", "10.244.0.0/16"],
            "cannot be used with",
        );
        for ok in [
            &["--pod-cidr", "10.0.0.0/24"][..],
            &["--pod-cidr-from-node"][..],
            &["--cluster-cidr", "10.244.0.0/16"][..],
        ] {
            let o = parse(ok).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
            o.check().unwrap_or_else(|e| panic!("{ok:?}: {e}"));
        }
    }

    #[test]
    fn a_shared_control_store_is_for_cluster_mode_only() {
        for store in ["etcd", "kubernetes"] {
            let o = parse(&["--pod-cidr", "10.0.0.0/24", "--store", store]).expect("parsed");
            let e = o.check().expect_err("refused").to_string();
            assert!(
                e.contains(&format!("--store {store} is for cluster mode")),
                "{e}"
            );
            let o = parse(&["--cluster-cidr", "10.244.0.0/16", "--store", store]).expect("parsed");
            o.check().unwrap_or_else(|e| panic!("{store}: {e}"));
        }
        for store in ["local", "embedded"] {
            let o = parse(&["--pod-cidr", "10.0.0.0/24", "--store", store]).expect("parsed");
            assert_eq!(o.store, StoreKind::Local);
            o.check().expect("the embedded store serves one node");
        }
    }

    #[test]
    fn the_kubernetes_api_is_needed_by_the_node_cidrs_and_the_kubernetes_store() {
        let needs = |flags: &[&str]| parse(flags).expect("parsed").needs_kube();
        assert!(needs(&["--pod-cidr-from-node"])
            .is_some_and(|s| s.starts_with("--pod-cidr-from-node needs the Kubernetes API")));
        assert!(
            needs(&["--cluster-cidr", "10.244.0.0/16", "--store", "kubernetes"])
                .is_some_and(|s| s.starts_with("--store kubernetes needs the Kubernetes API"))
        );
        assert_eq!(
            needs(&["--cluster-cidr", "10.244.0.0/16", "--store", "etcd"]),
            None
        );
        assert_eq!(needs(&["--pod-cidr", "10.0.0.0/24"]), None);
    }

    #[test]
    fn vxlan_without_other_nodes_is_allowed_and_said_to_do_nothing() {
        let warned = |flags: &[&str]| parse(flags).expect("parsed").warnings().len();
        assert_eq!(
            warned(&["--pod-cidr", "10.0.0.0/24", "--overlay", "vxlan"]),
            1
        );
        assert_eq!(warned(&["--pod-cidr-from-node", "--overlay", "vxlan"]), 0);
        assert_eq!(
            warned(&["--cluster-cidr", "10.244.0.0/16", "--overlay", "vxlan"]),
            0
        );
        assert_eq!(warned(&["--pod-cidr", "10.0.0.0/24"]), 0);
    }

    #[test]
    fn a_client_certificate_comes_with_its_key() {
        let base = ["--cluster-cidr", "10.244.0.0/16", "--store", "etcd"];
        let with = |more: &[&str]| {
            let flags: Vec<&str> = base.iter().chain(more).copied().collect();
            parse(&flags)
        };
        assert!(with(&["--etcd-cert", "c.pem"]).is_err());
        assert!(with(&["--etcd-key", "k.pem"]).is_err());
        assert!(with(&["--etcd-cert", "c.pem", "--etcd-key", "k.pem"]).is_ok());
    }

    #[test]
    fn nat_covers_the_cluster_in_cluster_mode_and_the_pod_cidrs_otherwise() {
        let ranges = |flags: &[&str]| -> Vec<String> {
            let o = parse(flags).expect("parsed");
            o.pod_ranges().iter().map(|n| n.to_string()).collect()
        };
        assert_eq!(
            ranges(&[
                "--cluster-cidr",
                "10.244.0.0/16",
                "--cluster-cidr",
                "fd00:10:244::/56"
            ]),
            ["10.244.0.0/16", "fd00:10:244::/56"]
        );
        assert_eq!(ranges(&["--pod-cidr", "10.0.1.0/24"]), ["10.0.1.0/24"]);
    }

    #[test]
    fn the_hidden_test_hooks_are_gone() {
        for flag in ["--test-delete-delay-ms", "--test-cutover-commit-delay-ms"] {
            assert!(
                parse(&["--pod-cidr", "10.0.0.0/24", flag, "300"]).is_err(),
                "{flag}"
            );
        }
    }
}
