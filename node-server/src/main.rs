//! `tetherd`: tether's node daemon.
//!
//! Startup order: lock the state dir, the socket's path and the network
//! namespace and check that nobody serves the socket (a second daemon
//! stops here, having changed nothing), open the store, program outbound
//! NAT, rebuild the pools, reconcile the kernel against the store, replay
//! the shim's pending-DEL queue, and only then create the socket and serve.

use clap::Parser;
use ipnet::IpNet;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;
use tetherd::api::cni::{self as cni_api, Stats};
use tetherd::api::pending_del;
use tetherd::api::server::{self, ServeOptions};
use tetherd::attach::{Node, NodeConfig};
use tetherd::cluster::{Cluster, ClusterConfig, Overlay, Peers};
use tetherd::control::etcd::{EtcdOptions, EtcdStore};
use tetherd::control::kubernetes::{KubeOptions, KubeStore};
use tetherd::control::{embedded::EmbeddedStore, ControlStore};
use tetherd::error::Error;
use tetherd::pools::PoolDef;
use tetherd::store::{Fsync, LocalStore, Store};
use tetherd::vm::VmRegistry;

/// tether's node daemon: IPAM, pod wiring and routes for the tether CNI plugin.
///
/// Run it in the node's network namespace (it creates the node-side veths and
/// routes there). The `tether` plugin binary forwards CNI calls to it over a
/// unix socket.
#[derive(Debug, Parser)]
#[command(name = "tetherd", version)]
struct Args {
    /// This node's name (defaults to the hostname).
    #[arg(long, env = "TETHER_NODE_NAME")]
    node_name: Option<String>,

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
    pod_cidrs: Vec<IpNet>,

    /// Take this node's pod CIDRs from its Node object's spec.podCIDRs
    /// (needs the Kubernetes API: --kubeconfig, or the in-cluster service
    /// account), instead of --pod-cidr: one DaemonSet for every node. The
    /// daemon waits for them at start-up; a later change applies at the
    /// next restart, and never re-addresses a running pod. Every other
    /// node's pod CIDRs are routed as their Node objects show them (watched;
    /// through each node's InternalIP, per --overlay), and are never NATed
    /// to.
    #[arg(long, conflicts_with = "cluster_cidrs")]
    pod_cidr_from_node: bool,

    /// A kubeconfig for the Kubernetes API: the migration-target watch on
    /// this node's pods, IPAMClaims, KubeVirt's VirtualMachines (a deleted
    /// one's addresses are freed), --pod-cidr-from-node, and events on
    /// pods. Without it, the in-cluster service account is used when the
    /// daemon runs in a pod; with neither, the daemon runs without the API
    /// (cutovers then follow the VM's RARP and the admin call only).
    #[arg(long, value_name = "FILE", env = "TETHER_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,

    /// Cluster mode: the CIDR every node claims address blocks from, once
    /// per family, e.g. --cluster-cidr 10.244.0.0/16 --cluster-cidr
    /// fd00:10:244::/56. Every node of a cluster must be given the same.
    #[arg(long = "cluster-cidr", value_name = "CIDR", value_parser = network)]
    cluster_cidrs: Vec<IpNet>,

    /// Named pools: a JSON file of subnets with ranges, exclusions, a
    /// gateway and routes, which networks select by name (`pool` in the
    /// netconf, `ipam.pool` when tether is another plugin's IPAM, or the
    /// pod annotation tether.dev/pool). Read again on SIGHUP and when its
    /// content changes (looked at every 10 s).
    #[arg(long = "pools", value_name = "FILE")]
    pools_file: Option<PathBuf>,

    /// Serve Prometheus metrics over HTTP at /metrics on this address
    /// (IP:PORT, e.g. 10.0.0.5:9654 or [fd00::5]:9654, or :PORT for every
    /// address of the node). Off when unset.
    #[arg(long = "metrics-address", value_name = "ADDR", value_parser = listen_address)]
    metrics_address: Option<std::net::SocketAddr>,

    /// Prefix length of the IPv4 blocks claimed from the cluster CIDR.
    #[arg(long, default_value_t = 26, value_parser = clap::value_parser!(u8).range(8..=30))]
    block_size: u8,

    /// Prefix length of the IPv6 blocks claimed from the cluster CIDR.
    #[arg(long, default_value_t = 122, value_parser = clap::value_parser!(u8).range(64..=126))]
    block_size_v6: u8,

    /// Where the control plane (node records, blocks, VM address records)
    /// lives: "embedded" (alias "local": in the state dir, for one node),
    /// "etcd", or "kubernetes" (objects of tether's CRDs through the
    /// Kubernetes API: --kubeconfig, or the in-cluster service account;
    /// the CRDs must be installed). Pod attachment records always stay in
    /// the node's local journal.
    #[arg(long, value_enum, default_value_t = StoreArg::Local)]
    store: StoreArg,

    /// etcd client URLs, comma-separated, e.g.
    /// https://10.0.0.1:2379,https://10.0.0.2:2379.
    #[arg(long, value_delimiter = ',', value_name = "URL")]
    etcd_endpoints: Vec<String>,

    /// CA bundle that signed the etcd members' certificates.
    #[arg(long, value_name = "FILE")]
    etcd_ca: Option<PathBuf>,

    /// Client certificate for etcd (mutual TLS); needs --etcd-key.
    #[arg(long, value_name = "FILE", requires = "etcd_key")]
    etcd_cert: Option<PathBuf>,

    /// The client certificate's private key.
    #[arg(long, value_name = "FILE", requires = "etcd_cert")]
    etcd_key: Option<PathBuf>,

    /// Key prefix of tether's records in etcd.
    #[arg(long, default_value = "/tether")]
    etcd_prefix: String,

    /// Bound on every control-plane request (etcd's, or the Kubernetes
    /// API's with --store kubernetes), in ms. A block claim while the store
    /// does not answer fails after this with CNI code 11.
    #[arg(long, alias = "store-timeout-ms", default_value_t = 2000)]
    etcd_timeout_ms: u64,

    /// --store kubernetes: the namespace of the nodes' Leases (liveness,
    /// `tether-<node>`). Default: the client's namespace (the pod's, in a
    /// cluster).
    #[arg(long, value_name = "NAMESPACE")]
    lease_namespace: Option<String>,

    /// This node's underlay address that other nodes route its pods
    /// through (once per family). Default: with --pod-cidr-from-node the
    /// Node's InternalIP, else (and without one) the address of the
    /// interface the default route uses.
    #[arg(long = "node-ip", value_name = "IP")]
    node_ips: Vec<IpAddr>,

    /// How pods reach other nodes' pods (cluster mode and
    /// --pod-cidr-from-node): "none" (host-gw: a route per block or pod
    /// CIDR via the node's IP; the nodes share an L2 segment) or "vxlan"
    /// (one VXLAN device with static entries per node, for any IP
    /// underlay).
    #[arg(long, value_enum, default_value_t = OverlayArg::None)]
    overlay: OverlayArg,

    /// VXLAN network identifier (--overlay vxlan).
    #[arg(long, default_value_t = 4097)]
    vxlan_vni: u32,

    /// VXLAN UDP port (--overlay vxlan).
    #[arg(long, default_value_t = 4789)]
    vxlan_port: u16,

    /// Time to live of the node's liveness lease, in seconds.
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..))]
    lease_ttl: u64,

    /// How long, in seconds, a node's lease must have been gone before the
    /// other nodes delete its record and blocks and withdraw its routes.
    /// Keep it well above a daemon restart.
    #[arg(long, default_value_t = 600)]
    node_grace: u64,

    /// The unix socket to serve the CNI and admin services on. The plugin
    /// finds it through the netconf's "socket" field (same default).
    #[arg(long, default_value = "/run/tether/tether.sock")]
    socket: PathBuf,

    /// Where durable state lives: the store and the pending-DEL queue. The
    /// only knob for it: at start-up the daemon points the path the plugin
    /// queues through, `<socket>.pending-del`, at `<state-dir>/pending-del`.
    #[arg(long, default_value = "/var/lib/tether")]
    state_dir: PathBuf,

    /// MTU of pod interfaces (both ends of the veth); a netconf "mtu"
    /// overrides it per network. Default: 1500, or with `--overlay vxlan`
    /// the VXLAN device's (the underlay's MTU less 50 bytes over IPv4, 70
    /// over IPv6), so that a pod's full-size packet fits the overlay.
    /// Set it to the node uplink's MTU (less the overlay's overhead).
    #[arg(long, value_parser = clap::value_parser!(u32).range(576..=65535))]
    mtu: Option<u32>,

    /// When a state change is flushed to the device. "always": flushed
    /// (fdatasync of the journal) before the reply. "background": written to
    /// the journal before the reply, which is enough to survive a daemon
    /// crash, and flushed within milliseconds by a thread that groups
    /// concurrent changes into one flush; for disks whose flushes are slow.
    #[arg(long, value_enum, default_value_t = FsyncArg::Always)]
    fsync: FsyncArg,

    /// A uid, besides root, allowed to use the socket (repeatable). The
    /// socket is mode 0600 and owned by root; peers are checked with
    /// SO_PEERCRED.
    #[arg(long = "allow-uid", value_name = "UID")]
    allowed_uids: Vec<u32>,

    /// Test hook (hidden): delay background veth deletions by this many ms.
    #[arg(long, hide = true, default_value_t = 0)]
    test_delete_delay_ms: u64,

    /// UDP port of cutover notices between nodes (on the node addresses):
    /// a migration's target tells the other nodes that its VM runs there
    /// while it writes the record, and they repoint at once instead of on
    /// the record's watch. The same port carries a migrating VM's
    /// connections (its conntrack flows) from its source node to its
    /// target. 0 turns both off: the other nodes then repoint on the watch
    /// alone, and the VM's connections through outbound NAT, or to a
    /// Service backend on the node it left, break at the migration.
    #[arg(long, value_name = "PORT", default_value_t = 9655)]
    cutover_port: u16,

    /// When a VM leaves this node by live migration, hold the packets sent
    /// to its guest and, after the cutover, send again those the guest
    /// never read while QEMU paused it: they reach it late instead of
    /// never. --migration-replay=false turns it off (the flows of the VM's
    /// connections go to the target either way).
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    migration_replay: bool,

    /// Test hook (hidden): hold every cutover's write of the record back
    /// by this many ms after its notice went out.
    #[arg(long, hide = true, default_value_t = 0)]
    test_cutover_commit_delay_ms: u64,

    /// Outbound NAT: traffic from pod addresses to anywhere outside the pod
    /// ranges, the named pools and --no-nat-to leaves with the node's
    /// address (nft table inet tether). --outbound-nat=false turns it off
    /// and removes the table.
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    outbound_nat: bool,

    /// A destination range never NATed to, besides the pod ranges and the
    /// named pools: the service CIDR, or in --pod-cidr mode the whole
    /// cluster's pod range. Repeatable, or comma-separated.
    #[arg(long = "no-nat-to", value_name = "CIDR", value_delimiter = ',')]
    no_nat_to: Vec<IpNet>,

    /// Log filter, e.g. "info" or "tetherd=debug".
    #[arg(long, default_value = "info", env = "TETHER_LOG")]
    log_level: String,

    /// Log format: "text", one line per event (coloured only when stderr
    /// is a terminal and NO_COLOR is unset), or "json", one object per
    /// line, for a log collector.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, env = "TETHER_LOG_FORMAT")]
    log_format: LogFormat,
}

/// The --log-format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    /// Plain lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Whether text logs carry ANSI colours: only for a person at a terminal,
/// never into a file or `kubectl logs`, and never under NO_COLOR
/// (no-color.org: set and not empty).
fn colour(stderr_is_terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    stderr_is_terminal && no_color.is_none_or(|v| v.is_empty())
}

/// A `--pod-cidr` or `--cluster-cidr`: a network, refused with host bits
/// set as the pools file refuses it.
fn network(s: &str) -> Result<IpNet, String> {
    let cidr: IpNet = s
        .parse()
        .map_err(|_| format!("{s:?} is not a CIDR (e.g. 10.244.1.0/24)"))?;
    tetherd::pools::def::check_network(&cidr)?;
    Ok(cidr)
}

/// A listen address: `IP:PORT`, `[IPv6]:PORT`, or `:PORT` for every
/// address (`[::]`, which takes IPv4 too, or `0.0.0.0` where the node has
/// no IPv6: see [`tetherd::api::scrape::bind`]).
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
enum StoreArg {
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
enum OverlayArg {
    /// host-gw routes.
    None,
    /// VXLAN.
    Vxlan,
}

/// The --fsync policy.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum FsyncArg {
    /// Flush before every reply.
    Always,
    /// Write before the reply, flush in the background.
    Background,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let logs = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&args.log_level)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr);
    match args.log_format {
        LogFormat::Text => {
            use std::io::IsTerminal;
            let no_color = std::env::var_os("NO_COLOR");
            logs.with_ansi(colour(std::io::stderr().is_terminal(), no_color.as_deref()))
                .init()
        }
        LogFormat::Json => logs.json().init(),
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("tetherd")
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "cannot start the runtime");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Fatal(message)) => {
            tracing::error!("{message}");
            ExitCode::FAILURE
        }
    }
}

/// Why tetherd did not start, or stopped serving: a sentence for the
/// operator. It carries no CNI code: codes are for a runtime reading a
/// plugin's answer, and no runtime reads this.
#[derive(Debug)]
struct Fatal(String);

impl From<Error> for Fatal {
    fn from(e: Error) -> Self {
        Fatal(match e {
            // At start-up an invalid configuration is the daemon's own
            // (flags, the pools file), not a network's.
            Error::InvalidConfig(message) => message,
            other => other.to_string(),
        })
    }
}

/// CAP_NET_ADMIN's bit in the capability sets (linux/capability.h).
const CAP_NET_ADMIN: u32 = 12;

/// True when `/proc/self/status` says the effective capabilities lack
/// CAP_NET_ADMIN; false when they hold it or cannot be read (the kernel
/// then says what is missing on the first change).
fn lacks_net_admin(proc_status: &str) -> bool {
    proc_status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << CAP_NET_ADMIN) == 0)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}

async fn run(args: Args) -> Result<(), Fatal> {
    // Without it the first netlink change fails with a bare EPERM, after
    // the state dir was created; say what to do instead.
    if lacks_net_admin(&std::fs::read_to_string("/proc/self/status").unwrap_or_default()) {
        return Err(Fatal(
            "tetherd must run as root (CAP_NET_ADMIN): it creates the pods' veths and routes \
             in the node's network namespace. Run it as root, or in a privileged container"
                .into(),
        ));
    }
    // Signal handlers first: a SIGTERM that arrives while the daemon starts
    // (the socket already accepts before the server loop runs) must stop it
    // cleanly, not kill it by the default action.
    let stop = stop_on_signal();
    // Before anything is read or written: a second daemon on this state
    // dir, socket or netns must leave the first's routes, links and files
    // alone.
    let _instance = tetherd::instance::InstanceLock::acquire(&args.state_dir, &args.socket)
        .await
        .map_err(|e| Fatal(e.to_string()))?;
    let metrics_listener = match args.metrics_address {
        Some(addr) => Some(tetherd::api::scrape::bind(addr).await?),
        None => None,
    };
    let node_name = args.node_name.clone().unwrap_or_else(hostname);
    if args.overlay == OverlayArg::Vxlan
        && args.cluster_cidrs.is_empty()
        && !args.pod_cidr_from_node
    {
        tracing::warn!("--overlay vxlan has no effect with --pod-cidr: this node routes to no other node (use --pod-cidr-from-node or --cluster-cidr)");
    }
    let kube = match tetherd::kube::Source::find(args.kubeconfig.as_deref()) {
        Some(source) => {
            tracing::info!(?source, "Kubernetes API: on");
            Some(tetherd::kube::client(&source).await?)
        }
        None if args.pod_cidr_from_node => {
            return Err(Fatal(
                "--pod-cidr-from-node needs the Kubernetes API: give --kubeconfig, or run in a pod with a service account".into(),
            ))
        }
        None if args.store == StoreArg::Kubernetes => {
            return Err(Fatal(
                "--store kubernetes needs the Kubernetes API: give --kubeconfig, or run in a pod with a service account".into(),
            ))
        }
        None => {
            tracing::info!("Kubernetes API: off (no --kubeconfig, not in a pod)");
            None
        }
    };
    let mut args = args;
    // --pod-cidr-from-node: the other nodes, from their Node objects.
    let mut node_peers = None;
    if let (true, Some((client, _))) = (args.pod_cidr_from_node, &kube) {
        tokio::select! {
            facts = tetherd::kube::node_cidrs::wait_for(client.clone(), &node_name) => {
                let facts = facts?;
                args.pod_cidrs = facts.pod_cidrs.clone();
                node_peers = Some(start_node_peers(&args, client, &node_name, facts).await?);
            }
            () = stopped(&stop) => {
                tracing::info!("stopped while waiting for the Node's pod CIDRs");
                return Ok(());
            }
        }
    }
    let pools = match &args.pools_file {
        Some(path) => load_pools(path, &args)?,
        None => Vec::new(),
    };
    let config = NodeConfig {
        name: node_name.clone(),
        pod_cidrs: args.pod_cidrs.clone(),
        mtu: args.mtu,
        state_dir: args.state_dir.clone(),
        allowed_uids: args.allowed_uids.clone(),
        test_delete_delay: Duration::from_millis(args.test_delete_delay_ms),
        pools,
    };
    let store: Arc<dyn Store> = {
        let dir = args.state_dir.clone();
        let fsync = match args.fsync {
            FsyncArg::Always => Fsync::Always,
            FsyncArg::Background => Fsync::Background,
        };
        tokio::task::spawn_blocking(move || LocalStore::open(&dir, fsync))
            .await
            .map_err(|e| Error::Internal(e.to_string()))?
            .map_err(Error::from)?
            .into_arc()
    };
    let control =
        tetherd::metrics::TimedControl::wrap(open_control_store(&args, kube.as_ref()).await?);
    // Joining can wait a long time for etcd; a signal ends the wait.
    let joined = tokio::select! {
        joined = async {
            let cluster = join_cluster(&args, control.clone()).await?;
            let vms = VmRegistry::open(control.clone(), &args.etcd_prefix).await?;
            Ok::<_, Error>((cluster, vms))
        } => joined?,
        () = stopped(&stop) => {
            tracing::info!("stopped before joining the cluster");
            return Ok(());
        }
    };
    let (cluster, vms) = joined;
    let kernel = Arc::new(tetherd::kernel::netlink::Netlink::connect().map_err(Error::from)?);
    let host = Arc::new(tetherd::kernel::LinuxHost::new(Arc::new(
        tetherd::dhcp::DhcpServer::new(),
    )));
    let nat = Arc::new(tetherd::nat::OutboundNat::new(
        host.clone(),
        args.outbound_nat,
        pod_ranges(&args),
        args.no_nat_to.clone(),
    ));
    nat.apply(&config.pools)?;
    if let (Some(peers), true) = (&node_peers, args.outbound_nat) {
        nat.clone().follow_peers(peers.clone());
    }
    let peers: Option<Arc<dyn Peers>> = match (&cluster, node_peers) {
        (Some(c), _) => Some(c.clone()),
        (None, Some(p)) => Some(p),
        (None, None) => None,
    };
    let (node, reconciled) = Node::open(config, store, cluster, peers, vms, kernel, host).await?;
    tracing::info!(?reconciled, "reconciled the kernel against the store");
    let node = Arc::new(node);
    node.set_test_cutover_commit_delay(Duration::from_millis(args.test_cutover_commit_delay_ms));
    node.handovers().set_replay(args.migration_replay);
    node.start_vm_tasks();
    node.start_notices(args.cutover_port);
    if let Some((client, _)) = kube {
        node.start_kube(client);
    }
    match args.pools_file.clone() {
        Some(path) => reload_pools_on_sighup(
            node.clone(),
            nat,
            path,
            args.pod_cidrs.clone(),
            args.cluster_cidrs.clone(),
        ),
        None => ignore_sighup(),
    }
    if let Some(listener) = metrics_listener {
        tetherd::api::scrape::serve(listener, node.clone());
    }
    let stats = Arc::new(Stats::default());
    // The plugin queues DELs through a path beside the socket; point it at
    // this daemon's state dir before the first replay, taking in what a
    // former state dir or a pre-start shim left there.
    adopt_pending_dels(&args.socket, &args.state_dir, &node.config().allowed_uids)?;
    let replayed = cni_api::drain_pending_dels(&node, &stats).await;
    if replayed > 0 {
        tracing::info!(replayed, "replayed queued DELs before serving");
    }
    let listener = server::bind(&args.socket).await?;
    tracing::info!(
        node = %node.config().name,
        socket = %args.socket.display(),
        pools = ?node.pool_usage().iter().map(|p| p.0.to_string()).collect::<Vec<_>>(),
        "serving"
    );
    // A DEL queued by a shim that raced our startup is picked up here.
    let drainer = {
        let (node, stats) = (node.clone(), stats.clone());
        let (socket, state_dir) = (args.socket.clone(), args.state_dir.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            tick.tick().await;
            loop {
                tick.tick().await;
                // Someone may have removed or replaced the link meanwhile.
                if let Err(e) = adopt_pending_dels(&socket, &state_dir, &node.config().allowed_uids)
                {
                    tracing::error!("{e}");
                }
                cni_api::drain_pending_dels(&node, &stats).await;
            }
        })
    };
    let opts = ServeOptions {
        socket: args.socket.clone(),
        allowed_uids: args.allowed_uids.clone(),
    };
    let served = server::serve(node.clone(), stats, listener, &opts, stopped(&stop)).await;
    drainer.abort();
    node.quiesce(Duration::from_secs(5)).await;
    if let Err(e) = std::fs::remove_file(&args.socket) {
        tracing::warn!(error = %e, "cannot remove the socket");
    }
    tracing::info!("stopped");
    Ok(served?)
}

/// Runs [`pending_del::adopt`] for this daemon's socket and state dir, and
/// logs what it took in.
fn adopt_pending_dels(
    socket: &Path,
    state_dir: &Path,
    allowed_uids: &[u32],
) -> tetherd::error::Result<()> {
    let link = pending_del::queue_link(socket);
    match pending_del::adopt(socket, state_dir, allowed_uids) {
        Ok(adopted) => {
            if !adopted.from.is_empty() {
                let from: Vec<String> = adopted
                    .from
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect();
                tracing::warn!(
                    ?from,
                    moved = adopted.moved,
                    link = %link.display(),
                    "took in DELs queued outside this state dir (a former --state-dir, or queued before tetherd started)"
                );
            }
            for left in &adopted.left {
                tracing::warn!(path = %left.path.display(), reason = %left.reason, "queued DEL left where it is");
            }
            Ok(())
        }
        Err(e) => Err(Error::Io(format!(
            "cannot point {} at the DEL queue in {}: {e}",
            link.display(),
            pending_del::queue_dir(state_dir).display()
        ))),
    }
}

/// Opens the control plane: node records and blocks in cluster mode, and
/// the VM address records in both modes.
async fn open_control_store(
    args: &Args,
    kube: Option<&(kube::Client, String)>,
) -> tetherd::error::Result<Arc<dyn ControlStore>> {
    if args.cluster_cidrs.is_empty() && args.store != StoreArg::Local {
        return Err(Error::InvalidConfig(format!(
            "--store {} is for cluster mode: give --cluster-cidr instead of --pod-cidr",
            if args.store == StoreArg::Etcd {
                "etcd"
            } else {
                "kubernetes"
            }
        )));
    }
    Ok(match args.store {
        StoreArg::Local => {
            let dir = args.state_dir.clone();
            Arc::new(
                tokio::task::spawn_blocking(move || EmbeddedStore::open(&dir))
                    .await
                    .map_err(|e| Error::Internal(e.to_string()))??,
            )
        }
        StoreArg::Etcd => EtcdStore::connect(&EtcdOptions {
            endpoints: args.etcd_endpoints.clone(),
            ca: args.etcd_ca.clone(),
            cert: args.etcd_cert.clone(),
            key: args.etcd_key.clone(),
            timeout: Duration::from_millis(args.etcd_timeout_ms),
        })
        .await?
        .into(),
        StoreArg::Kubernetes => {
            let Some((client, server)) = kube else {
                return Err(Error::InvalidConfig(
                    "--store kubernetes needs the Kubernetes API".into(),
                ));
            };
            let lease_namespace = args
                .lease_namespace
                .clone()
                .unwrap_or_else(|| client.default_namespace().to_owned());
            let opts = KubeOptions {
                root: tetherd::control::v1_root(&args.etcd_prefix),
                server: server.clone(),
                lease_namespace,
                timeout: Duration::from_millis(args.etcd_timeout_ms),
            };
            tracing::info!(server = %opts.server, lease_namespace = %opts.lease_namespace, "control plane: the Kubernetes API");
            KubeStore::connect(client.clone(), opts).await?.into()
        }
    })
}

/// With --pod-cidr-from-node: starts the watch on the Node objects that
/// this node routes to the other nodes by, and waits (a while) for its
/// first listing, so that the routes are in place before the node serves.
/// This node's underlay address: --node-ip, else the Node's InternalIP,
/// else the default route's.
async fn start_node_peers(
    args: &Args,
    client: &kube::Client,
    node_name: &str,
    facts: tetherd::kube::node_cidrs::NodeFacts,
) -> tetherd::error::Result<Arc<dyn Peers>> {
    use tetherd::kube::node_peers::{my_record, NodePeers};
    let node_ips = if !args.node_ips.is_empty() {
        args.node_ips.clone()
    } else if !facts.internal_ips.is_empty() {
        facts.internal_ips
    } else {
        default_route_addresses().await?
    };
    let me = my_record(node_name, &facts.pod_cidrs, node_ips);
    tracing::info!(node = %me.name, id = me.id, ips = ?me.node_ips, overlay = overlay(args).name(), "routing to the other nodes' pod CIDRs from their Node objects");
    let peers = NodePeers::start(client.clone(), me, overlay(args));
    if !peers.wait_synced(Duration::from_secs(10)).await {
        tracing::warn!("no listing of the Node objects within 10 s: serving now; routes to other nodes follow when it comes");
    }
    Ok(peers)
}

/// The addresses of the interface the default route uses, for a node given
/// no --node-ip; an error when there is no default route.
async fn default_route_addresses() -> tetherd::error::Result<Vec<IpAddr>> {
    let netlink = tetherd::kernel::netlink::Netlink::connect()?;
    let node_ips = netlink.default_route_addresses().await?;
    if node_ips.is_empty() {
        return Err(Error::InvalidConfig(
            "no default route to find the node's address by: give --node-ip".into(),
        ));
    }
    tracing::info!(?node_ips, "node address found through the default route");
    Ok(node_ips)
}

/// `--overlay` and its VXLAN settings.
fn overlay(args: &Args) -> Overlay {
    match args.overlay {
        OverlayArg::None => Overlay::HostGw,
        OverlayArg::Vxlan => Overlay::Vxlan {
            vni: args.vxlan_vni,
            port: args.vxlan_port,
        },
    }
}

/// In cluster mode: joins the cluster through the control plane.
async fn join_cluster(
    args: &Args,
    store: Arc<dyn ControlStore>,
) -> tetherd::error::Result<Option<Arc<Cluster>>> {
    if args.cluster_cidrs.is_empty() {
        return Ok(None);
    }
    let mut node_ips = args.node_ips.clone();
    if node_ips.is_empty() {
        node_ips = default_route_addresses().await?;
    }
    let overlay = overlay(args);
    let config = ClusterConfig {
        node_name: args.node_name.clone().unwrap_or_else(hostname),
        node_ips,
        cluster_cidrs: args.cluster_cidrs.clone(),
        block_v4: args.block_size,
        block_v6: args.block_size_v6,
        prefix: args.etcd_prefix.clone(),
        lease_ttl: Duration::from_secs(args.lease_ttl),
        node_grace: Duration::from_secs(args.node_grace),
        overlay,
    };
    Ok(Some(Cluster::join(store, config).await?))
}

/// The ranges of this node's pod addresses, which outbound NAT masquerades:
/// the cluster CIDRs in cluster mode (every node's blocks), else the pod
/// CIDRs.
fn pod_ranges(args: &Args) -> Vec<IpNet> {
    if args.cluster_cidrs.is_empty() {
        args.pod_cidrs.clone()
    } else {
        args.cluster_cidrs.clone()
    }
}

/// Reads the pools file and checks that no pool overlaps the pod CIDRs.
fn load_pools(path: &Path, args: &Args) -> tetherd::error::Result<Vec<PoolDef>> {
    let defs = tetherd::pools::def::load(path)?;
    check_pools(&defs, &args.pod_cidrs, &args.cluster_cidrs)?;
    tracing::info!(file = %path.display(), pools = ?defs.iter().map(|d| format!("{} {}", d.name, d.cidr)).collect::<Vec<_>>(), "named pools");
    Ok(defs)
}

fn check_pools(defs: &[PoolDef], pod: &[IpNet], cluster: &[IpNet]) -> tetherd::error::Result<()> {
    for d in defs {
        if let Some(c) = pod
            .iter()
            .chain(cluster)
            .find(|c| tetherd::pools::def::overlaps(c, &d.cidr))
        {
            return Err(Error::InvalidConfig(format!(
                "pool {} ({}) overlaps the pod CIDR {c}: an address must have one pool",
                d.name, d.cidr
            )));
        }
    }
    Ok(())
}

/// Without `--pools` there is nothing to reload: SIGHUP, whose default
/// action would end the daemon, is logged and otherwise ignored.
fn ignore_sighup() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::hangup()) {
        Ok(mut hup) => {
            tokio::spawn(async move {
                while hup.recv().await.is_some() {
                    tracing::info!("SIGHUP: no --pools file to read again; ignored");
                }
            });
        }
        Err(e) => tracing::warn!(error = %e, "cannot install the SIGHUP handler"),
    }
}

/// How often the pools file is looked at for a changed content: a
/// ConfigMap volume is updated in place, and no one sends a signal then.
const POOLS_POLL: std::time::Duration = std::time::Duration::from_secs(10);

/// Reads the pools file again on every SIGHUP, and when its content
/// changes (looked at every [`POOLS_POLL`]). A file that does not parse
/// changes nothing (the error is logged, once per content).
fn reload_pools_on_sighup(
    node: Arc<Node>,
    nat: Arc<tetherd::nat::OutboundNat>,
    path: PathBuf,
    pod: Vec<IpNet>,
    cluster: Vec<IpNet>,
) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut hup = match signal(SignalKind::hangup()) {
        Ok(hup) => Some(hup),
        Err(e) => {
            tracing::warn!(error = %e, "cannot install the SIGHUP handler: the pools file is reloaded when it changes only");
            None
        }
    };
    tokio::spawn(async move {
        let mut seen = std::fs::read(&path).ok();
        let mut tick = tokio::time::interval(POOLS_POLL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let why = tokio::select! {
                Some(()) = async {
                    match hup.as_mut() {
                        Some(h) => h.recv().await,
                        None => std::future::pending().await,
                    }
                } => "SIGHUP",
                _ = tick.tick() => {
                    let now = std::fs::read(&path).ok();
                    if now == seen || now.is_none() {
                        continue;
                    }
                    "the file changed"
                }
            };
            seen = std::fs::read(&path).ok();
            let loaded = tetherd::pools::def::load(&path)
                .and_then(|defs| check_pools(&defs, &pod, &cluster).map(|()| defs));
            match loaded {
                Ok(defs) => {
                    tracing::info!(file = %path.display(), count = defs.len(), why, "pools read again");
                    // The pools are never NATed to; a refused table keeps
                    // the former pools there.
                    if let Err(e) = nat.apply(&defs) {
                        tracing::error!("outbound NAT not updated for the new pools: {e}");
                    }
                    node.reload_pools(defs);
                }
                Err(e) => {
                    tracing::error!(file = %path.display(), why, "the pools file is refused, nothing changed: {e}")
                }
            }
        }
    });
}

/// Installs the SIGTERM and SIGINT handlers now; the receiver turns true
/// when one arrives.
fn stop_on_signal() -> tokio::sync::watch::Receiver<bool> {
    use tokio::signal::unix::{signal, SignalKind};
    let (tx, rx) = tokio::sync::watch::channel(false);
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        // Without signal handlers, only kill -9 stops the daemon; that is
        // safe (state is durable) but worth a line in the log.
        tracing::warn!("cannot install signal handlers");
        return rx;
    };
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
        let _ = tx.send(true);
    });
    rx
}

/// Resolves once a stop signal has arrived (at once if it already has).
async fn stopped(stop: &tokio::sync::watch::Receiver<bool>) {
    let mut stop = stop.clone();
    if stop.wait_for(|s| *s).await.is_err() {
        // The handlers could not be installed: never.
        futures::future::pending::<()>().await;
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
        let args = Args::try_parse_from([
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
        let said = Args::try_parse_from(["tetherd", "--pod-cidr", "10.0.0.5/24"])
            .expect_err("host bits")
            .to_string();
        assert!(
            said.contains("10.0.0.5/24 has host bits set; did you mean 10.0.0.0/24?"),
            "{said}"
        );
        let said = Args::try_parse_from(["tetherd", "--cluster-cidr", "fd00::1/56"])
            .expect_err("host bits")
            .to_string();
        assert!(said.contains("did you mean fd00::/56?"), "{said}");
        let said = Args::try_parse_from(["tetherd", "--pod-cidr", "10.0.0.0"])
            .expect_err("no prefix")
            .to_string();
        assert!(said.contains("is not a CIDR"), "{said}");
        let args = Args::try_parse_from([
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
        let args = Args::try_parse_from(["tetherd", "--pod-cidr", "10.0.0.0/24"])
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(args.log_format, LogFormat::Text);
        let args = Args::try_parse_from([
            "tetherd",
            "--pod-cidr",
            "10.0.0.0/24",
            "--log-format",
            "json",
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(args.log_format, LogFormat::Json);
        assert!(Args::try_parse_from([
            "tetherd",
            "--pod-cidr",
            "10.0.0.0/24",
            "--log-format",
            "xml"
        ])
        .is_err());
    }

    #[test]
    fn a_process_without_cap_net_admin_is_told_to_run_as_root() {
        let root = "Name:\ttetherd\nCapInh:\t0000000000000000\nCapEff:\t000001ffffffffff\n";
        let nobody = "Name:\ttetherd\nCapEff:\t0000000000000000\n";
        let net_admin_only = "CapEff:\t0000000000001000\n";
        assert!(!lacks_net_admin(root));
        assert!(lacks_net_admin(nobody));
        assert!(!lacks_net_admin(net_admin_only));
        // Unreadable: the kernel will say what is missing.
        assert!(!lacks_net_admin(""));
        assert!(!lacks_net_admin("CapEff:\tzz\n"));
    }

    #[test]
    fn a_fatal_error_is_a_sentence_without_a_cni_code() {
        let Fatal(said) =
            Error::InvalidConfig("--metrics-address 0.0.0.0:9654: port 9654 already in use".into())
                .into();
        assert_eq!(
            said,
            "--metrics-address 0.0.0.0:9654: port 9654 already in use"
        );
        let Fatal(said) = Error::Store("reading /x: denied".into()).into();
        assert_eq!(said, "state store failure: reading /x: denied");
        assert!(!said.contains("code"));
    }
}
