//! `tetherd`: tether's node daemon.
//!
//! Startup order: open the store, rebuild the pools, reconcile the kernel
//! against the store, replay the shim's pending-DEL queue, and only then
//! create the socket and serve.

use clap::Parser;
use ipnet::IpNet;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;
use tetherd::node::{Node, NodeConfig};
use tetherd::server::{self, ServeOptions};
use tetherd::service::{self, Stats};
use tetherd::store::{Fsync, LocalStore, Store};

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

    /// A pod CIDR to allocate pod addresses from: give it once per family
    /// (one IPv4 and/or one IPv6), e.g. --pod-cidr 10.244.1.0/24
    /// --pod-cidr fd00:10:244:1::/64.
    #[arg(long = "pod-cidr", required = true, value_name = "CIDR")]
    pod_cidrs: Vec<IpNet>,

    /// The unix socket to serve the CNI and admin services on. The plugin
    /// finds it through the netconf's "socket" field (same default).
    #[arg(long, default_value = "/run/tether/tether.sock")]
    socket: PathBuf,

    /// Where durable state lives: the store and the shim's pending-DEL queue.
    /// The netconf's "stateDir" must name the same directory.
    #[arg(long, default_value = "/var/lib/tether")]
    state_dir: PathBuf,

    /// MTU of pod interfaces (both ends of the veth); a netconf "mtu"
    /// overrides it per network. Set it to the node uplink's MTU.
    #[arg(long, default_value_t = 1500, value_parser = clap::value_parser!(u32).range(576..=65535))]
    mtu: u32,

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

    /// Log filter, e.g. "info" or "tetherd=debug".
    #[arg(long, default_value = "info", env = "TETHER_LOG")]
    log_level: String,
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
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&args.log_level)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
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
        Err(e) => {
            tracing::error!(code = e.code(), "{e}");
            ExitCode::FAILURE
        }
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}

async fn run(args: Args) -> tetherd::error::Result<()> {
    let config = NodeConfig {
        name: args.node_name.clone().unwrap_or_else(hostname),
        pod_cidrs: args.pod_cidrs.clone(),
        mtu: args.mtu,
        state_dir: args.state_dir.clone(),
        allowed_uids: args.allowed_uids.clone(),
        test_delete_delay: Duration::from_millis(args.test_delete_delay_ms),
    };
    let store: Arc<dyn Store> = {
        let dir = args.state_dir.clone();
        let fsync = match args.fsync {
            FsyncArg::Always => Fsync::Always,
            FsyncArg::Background => Fsync::Background,
        };
        tokio::task::spawn_blocking(move || LocalStore::open(&dir, fsync))
            .await
            .map_err(|e| tetherd::error::Error::Internal(e.to_string()))??
            .into_arc()
    };
    let (node, reconciled) = Node::open(config, store).await?;
    tracing::info!(?reconciled, "reconciled the kernel against the store");
    let node = Arc::new(node);
    let stats = Arc::new(Stats::default());
    let replayed = service::drain_pending_dels(&node, &stats).await;
    if replayed > 0 {
        tracing::info!(replayed, "replayed queued DELs before serving");
    }
    let listener = server::bind(&args.socket).await?;
    tracing::info!(
        node = %node.config().name,
        socket = %args.socket.display(),
        pools = ?node.config().pod_cidrs,
        "serving"
    );
    // A DEL queued by a shim that raced our startup is picked up here.
    let drainer = {
        let (node, stats) = (node.clone(), stats.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            tick.tick().await;
            loop {
                tick.tick().await;
                service::drain_pending_dels(&node, &stats).await;
            }
        })
    };
    let opts = ServeOptions {
        socket: args.socket.clone(),
        allowed_uids: args.allowed_uids.clone(),
    };
    let served = server::serve(node.clone(), stats, listener, &opts, shutdown_signal()).await;
    drainer.abort();
    node.quiesce(Duration::from_secs(5)).await;
    if let Err(e) = std::fs::remove_file(&args.socket) {
        tracing::warn!(error = %e, "cannot remove the socket");
    }
    tracing::info!("stopped");
    served
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        // Without signal handlers, only kill -9 stops the daemon; that is
        // safe (state is durable) but worth a line in the log.
        tracing::warn!("cannot install signal handlers");
        return futures::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
    }
}
