//! The daemon as a whole: from checked [`options::Options`] to a node that
//! serves, and back down on a signal. `main` parses the flags, starts the
//! logs and the runtime, and calls [`run`]; everything else is here, in
//! the library, so that a test program can run the same daemon with a
//! test double put in one of its seams ([`Seams`]) instead of the
//! shipped daemon carrying test flags.
//!
//! The order [`run`] keeps, and why:
//! 1. refuse early what cannot work (no CAP_NET_ADMIN; a flag combination
//!    [`options::Options::check`] refuses), before anything is written;
//! 2. the stop signals, then the instance lock (one daemon per state dir,
//!    socket and netns), then the metrics listener (a taken port fails
//!    the start, not a scrape later);
//! 3. the Kubernetes API if there is one, the Node's pod CIDRs if asked
//!    to wait for them, the pools file;
//! 4. the local journal, the control store, the cluster (which can wait a
//!    long time for etcd: a signal ends the wait), the kernel and NAT;
//! 5. the node, reconciled against the journal, with its background
//!    tasks; queued DELs replayed; then the socket serves until a signal.

pub mod options;

mod joining;
mod upkeep;

use std::sync::Arc;
use std::time::Duration;

use crate::api::cni::{drain_pending_dels, Stats};
use crate::api::server::{self, ServeOptions};
use crate::attach::{Node, NodeConfig};
use crate::cluster::Peers;
use crate::vm::VmRegistry;
use tether_base::error::Error;
use tether_kernel::Kernel;
use tether_store::control::ControlStore;
use tether_store::store::{Fsync, LocalStore, Store};

use options::{FsyncKind, Options};

/// Why tetherd did not start, or stopped serving: a sentence for the
/// operator. It carries no CNI code: codes are for a runtime reading a
/// plugin's answer, and no runtime reads this.
#[derive(Debug)]
pub struct Fatal(pub String);

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

impl std::fmt::Display for Fatal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A wrapper put around one of the daemon's seams.
pub type Wrap<T> = Box<dyn FnOnce(Arc<T>) -> Arc<T> + Send>;

/// What a caller may put between the daemon and the world: a wrapper
/// around the control store (after it is opened, before anything uses
/// it) and around the kernel, and a node in place of this machine's.
/// `tetherd` puts nothing there; the end-to-end tests' daemon puts its
/// delays there (a held-back write of the record, a held-back veth
/// deletion), and the scale runs' control-plane-only daemon an in-memory
/// kernel and node. The shipped daemon cannot be asked for either.
#[derive(Default)]
pub struct Seams {
    /// Wraps the control store.
    pub control: Option<Wrap<dyn ControlStore>>,
    /// Wraps the kernel (veths, routes, the handover).
    pub kernel: Option<Wrap<dyn Kernel>>,
    /// Stands for the node (forwarding, announcements, guest DHCP, the
    /// nftables tables) instead of this machine's.
    pub host: Option<Arc<dyn tether_kernel::Host>>,
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

/// The Kubernetes API client, if there is an API: `--kubeconfig`, or the
/// in-cluster service account. None where there is none and the options
/// can do without (see [`Options::needs_kube`]).
async fn kube_client(opts: &Options) -> Result<Option<(kube::Client, String)>, Fatal> {
    match crate::kube::Source::find(opts.kubeconfig.as_deref()) {
        Some(source) => {
            tracing::info!(?source, "Kubernetes API: on");
            Ok(Some(crate::kube::client(&source).await?))
        }
        None => match opts.needs_kube() {
            Some(why) => Err(Fatal(why.into())),
            None => {
                tracing::info!("Kubernetes API: off (no --kubeconfig, not in a pod)");
                Ok(None)
            }
        },
    }
}

/// The node's local journal of attachments (`--state-dir`, `--fsync`).
async fn open_journal(opts: &Options) -> Result<Arc<dyn Store>, Error> {
    let dir = opts.state_dir.clone();
    let fsync = match opts.fsync {
        FsyncKind::Always => Fsync::Always,
        FsyncKind::Background => Fsync::Background,
    };
    Ok(
        tokio::task::spawn_blocking(move || LocalStore::open(&dir, fsync))
            .await
            .map_err(|e| Error::Internal(e.to_string()))?
            .map_err(Error::from)?
            .into_arc(),
    )
}

/// Runs the daemon until a stop signal (see the module doc for the
/// order). `seams` is empty for `tetherd`.
pub async fn run(opts: Options, seams: Seams) -> Result<(), Fatal> {
    // Without it the first netlink change fails with a bare EPERM, after
    // the state dir was created; say what to do instead.
    if lacks_net_admin(&std::fs::read_to_string("/proc/self/status").unwrap_or_default()) {
        return Err(Fatal(
            "tetherd must run as root (CAP_NET_ADMIN): it creates the pods' veths and routes \
             in the node's network namespace. Run it as root, or in a privileged container"
                .into(),
        ));
    }
    opts.check()?;
    // Signal handlers first: a SIGTERM that arrives while the daemon starts
    // (the socket already accepts before the server loop runs) must stop it
    // cleanly, not kill it by the default action.
    let stop = upkeep::stop_on_signal();
    // Before anything is read or written: a second daemon on this state
    // dir, socket or netns must leave the first's routes, links and files
    // alone.
    let _instance = crate::instance::InstanceLock::acquire(&opts.state_dir, &opts.socket)
        .await
        .map_err(|e| Fatal(e.to_string()))?;
    let metrics_listener = match opts.metrics_address {
        Some(addr) => Some(crate::api::scrape::bind(addr).await?),
        None => None,
    };
    let node_name = opts.node_name.clone().unwrap_or_else(hostname);
    for said in opts.warnings() {
        tracing::warn!("{said}");
    }
    let kube = kube_client(&opts).await?;
    let mut opts = opts;
    // --pod-cidr-from-node: the other nodes, from their Node objects.
    let mut node_peers = None;
    if let (true, Some((client, _))) = (opts.pod_cidr_from_node, &kube) {
        tokio::select! {
            facts = crate::kube::node_cidrs::wait_for(client.clone(), &node_name) => {
                let facts = facts?;
                opts.pod_cidrs = facts.pod_cidrs.clone();
                node_peers = Some(joining::start_node_peers(&opts, client, &node_name, facts).await?);
            }
            () = upkeep::stopped(&stop) => {
                tracing::info!("stopped while waiting for the Node's pod CIDRs");
                return Ok(());
            }
        }
    }
    let pools = match &opts.pools_file {
        Some(path) => upkeep::load_pools(path, &opts)?,
        None => Vec::new(),
    };
    let config = NodeConfig {
        name: node_name.clone(),
        pod_cidrs: opts.pod_cidrs.clone(),
        mtu: opts.mtu,
        state_dir: opts.state_dir.clone(),
        allowed_uids: opts.allowed_uids.clone(),
        pools,
    };
    let journal = open_journal(&opts).await?;
    let mut control = joining::open_control_store(&opts, kube.as_ref()).await?;
    if let Some(wrap) = seams.control {
        control = wrap(control);
    }
    let control = crate::metrics::TimedControl::wrap(control);
    // Joining can wait a long time for etcd; a signal ends the wait.
    let joined = tokio::select! {
        joined = async {
            let cluster = joining::join_cluster(&opts, &node_name, control.clone()).await?;
            let vms = VmRegistry::open(control.clone(), &opts.etcd_prefix).await?;
            Ok::<_, Error>((cluster, vms))
        } => joined?,
        () = upkeep::stopped(&stop) => {
            tracing::info!("stopped before joining the cluster");
            return Ok(());
        }
    };
    let (cluster, vms) = joined;
    let mut kernel: Arc<dyn Kernel> =
        Arc::new(tether_kernel::netlink::Netlink::connect().map_err(Error::from)?);
    if let Some(wrap) = seams.kernel {
        kernel = wrap(kernel);
    }
    let host: Arc<dyn tether_kernel::Host> = match seams.host {
        Some(host) => host,
        None => Arc::new(tether_kernel::LinuxHost::new(Arc::new(
            crate::dhcp::DhcpServer::new(),
        ))),
    };
    let nat = Arc::new(crate::nat::OutboundNat::new(
        host.clone(),
        opts.outbound_nat,
        opts.pod_ranges(),
        opts.no_nat_to.clone(),
    ));
    nat.apply(&config.pools)?;
    if !opts.network_policy {
        // A table left by an earlier run with the flag on goes.
        if let Err(e) = tether_kernel::Host::remove_policy(host.as_ref()) {
            tracing::warn!(error = %e, "cannot remove the NetworkPolicy table of an earlier run");
        }
    }
    if let (Some(peers), true) = (&node_peers, opts.outbound_nat) {
        nat.clone().follow_peers(peers.clone());
    }
    let peers: Option<Arc<dyn Peers>> = match (&cluster, node_peers) {
        (Some(c), _) => Some(c.clone()),
        (None, Some(p)) => Some(p),
        (None, None) => None,
    };
    let (node, reconciled) = Node::open(config, journal, cluster, peers, vms, kernel, host).await?;
    tracing::info!(?reconciled, "reconciled the kernel against the store");
    let node = Arc::new(node);
    node.handovers().set_replay(opts.migration_replay);
    node.start_vm_tasks();
    node.start_notices(opts.cutover_port);
    match (&kube, opts.network_policy) {
        (Some((client, _)), true) => node.start_policy(client.clone()),
        (None, true) => tracing::warn!(
            "--network-policy needs the Kubernetes API (--kubeconfig, or in a pod): no NetworkPolicy is enforced"
        ),
        (_, false) => {}
    }
    match kube {
        Some((client, _)) => {
            node.start_kube(client, opts.check_vm_launchers);
        }
        None if opts.check_vm_launchers => tracing::info!(
            "without the Kubernetes API a VM pod is taken on its annotations' word: --check-vm-launchers needs the API"
        ),
        None => {}
    }
    match opts.pools_file.clone() {
        Some(path) => upkeep::reload_pools_on_sighup(
            node.clone(),
            nat,
            path,
            opts.pod_cidrs.clone(),
            opts.cluster_cidrs.clone(),
        ),
        None => upkeep::ignore_sighup(),
    }
    if let Some(listener) = metrics_listener {
        crate::api::scrape::serve(listener, node.clone());
    }
    serve(node, &opts, &stop).await
}

/// Serves the socket until a stop signal: queued DELs first (the plugin
/// queues them through a path beside the socket, pointed at this state
/// dir before the first replay), then requests, with the queue looked at
/// again every few seconds; then a quiet stop.
async fn serve(
    node: Arc<Node>,
    opts: &Options,
    stop: &tokio::sync::watch::Receiver<bool>,
) -> Result<(), Fatal> {
    let stats = Arc::new(Stats::default());
    upkeep::adopt_pending_dels(&opts.socket, &opts.state_dir, &node.config().allowed_uids)?;
    let replayed = drain_pending_dels(&node, &stats).await;
    if replayed > 0 {
        tracing::info!(replayed, "replayed queued DELs before serving");
    }
    let listener = server::bind(&opts.socket).await?;
    tracing::info!(
        node = %node.config().name,
        socket = %opts.socket.display(),
        pools = ?node.pool_usage().iter().map(|p| p.0.to_string()).collect::<Vec<_>>(),
        "serving"
    );
    let leaves = tokio::spawn(node.vms().clone().make_waiting_leaves_forever());
    let repair = node.spawn_route_repair(Duration::from_secs(opts.route_repair_interval));
    let drainer = upkeep::drain_pending_dels_every(
        node.clone(),
        stats.clone(),
        opts.socket.clone(),
        opts.state_dir.clone(),
    );
    let serve_opts = ServeOptions {
        socket: opts.socket.clone(),
        allowed_uids: opts.allowed_uids.clone(),
    };
    let served = server::serve(
        node.clone(),
        stats,
        listener,
        &serve_opts,
        upkeep::stopped(stop),
    )
    .await;
    drainer.abort();
    leaves.abort();
    repair.abort();
    node.quiesce(Duration::from_secs(5)).await;
    if let Err(e) = std::fs::remove_file(&opts.socket) {
        tracing::warn!(error = %e, "cannot remove the socket");
    }
    tracing::info!("stopped");
    Ok(served?)
}

#[cfg(test)]
mod tests {
    use super::*;

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
