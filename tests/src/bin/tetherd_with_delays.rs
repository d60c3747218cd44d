//! `tetherd` with delays put into two of its seams, for the suites that
//! must hold one of its steps back: a veth deletion (an ADD racing the
//! deletion of its own veth name), a pod's wiring (an ADD whose plugin is
//! killed in the middle) and a write of the control store (a cutover's
//! write arriving after the record changed under it). The
//! shipped `tetherd` has no such flags. This is a test double only in the
//! delays it adds: everything else is the daemon's own library
//! (`tetherd::daemon::run`), with `tetherd`'s flags.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use clap::Parser;
use tether_kernel::error::Result;
use tether_kernel::{
    ClusterRoute, Handover, HostRoute, Kernel, NodeRoutes, PodNetns, PodWiring, Synced, Veths,
    VxlanConfig, VxlanPeer,
};
use tether_store::control::{BoxFut, Cmp, ControlStore, Kv, Op, WatchMessage};
use tetherd::daemon::options::Options;
use tetherd::daemon::{self, Fatal, Seams};
use tokio::sync::mpsc;

#[derive(Debug, Parser)]
#[command(name = "tetherd_with_delays")]
struct Cli {
    #[command(flatten)]
    daemon: Options,

    /// Holds each batch of background veth deletions back this many ms
    /// before the kernel is asked.
    #[arg(long, value_name = "MS", default_value_t = 0)]
    hold_deletions_ms: u64,

    /// Holds each pod's wiring back this many ms before the kernel is
    /// asked.
    #[arg(long, value_name = "MS", default_value_t = 0)]
    hold_wiring_ms: u64,

    /// Holds back, by --hold-writes-ms, every write of the control store
    /// begun while this file exists.
    #[arg(long, value_name = "FILE", requires = "hold_writes_ms")]
    hold_writes_while: Option<PathBuf>,

    /// See --hold-writes-while.
    #[arg(long, value_name = "MS", default_value_t = 0)]
    hold_writes_ms: u64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tether_e2e::init_daemon_logs(&cli.daemon.log_level);
    let mut seams = Seams::default();
    let hold = Holds {
        deletions: Duration::from_millis(cli.hold_deletions_ms),
        wiring: Duration::from_millis(cli.hold_wiring_ms),
    };
    if !hold.deletions.is_zero() || !hold.wiring.is_zero() {
        seams.kernel = Some(Box::new(move |inner| {
            Arc::new(Held { inner, hold }) as Arc<dyn Kernel>
        }));
    }
    if let Some(flag) = cli.hold_writes_while.clone() {
        let hold = Duration::from_millis(cli.hold_writes_ms);
        seams.control = Some(Box::new(move |inner| {
            Arc::new(HeldWrites { inner, flag, hold }) as Arc<dyn ControlStore>
        }));
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(daemon::run(cli.daemon, seams)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Fatal(message)) => {
            tracing::error!("{message}");
            ExitCode::FAILURE
        }
    }
}

/// How long [`Held`] holds each kind of call back.
#[derive(Clone, Copy)]
struct Holds {
    /// Background deletions (on the kernel's second socket).
    deletions: Duration,
    /// A pod's wiring.
    wiring: Duration,
}

/// The kernel, whose background deletions and pods' wirings wait first.
struct Held {
    inner: Arc<dyn Kernel>,
    hold: Holds,
}

#[async_trait]
impl Veths for Held {
    fn open_netns(&self, path: &std::path::Path) -> Result<PodNetns> {
        self.inner.open_netns(path)
    }
    async fn wire(&self, w: &PodWiring<'_>) -> Result<()> {
        tokio::time::sleep(self.hold.wiring).await;
        self.inner.wire(w).await
    }
    async fn check(&self, w: &PodWiring<'_>) -> Result<()> {
        self.inner.check(w).await
    }
    async fn delete_link(&self, host_ifname: &str) -> Result<()> {
        self.inner.delete_link(host_ifname).await
    }
    async fn remove_tap(&self, netns: &PodNetns, tap: &str, host_ifname: &str) -> Result<()> {
        self.inner.remove_tap(netns, tap, host_ifname).await
    }
    async fn delete_links(&self, host_ifnames: &[String]) -> Result<()> {
        tokio::time::sleep(self.hold.deletions).await;
        self.inner.delete_links(host_ifnames).await
    }
    async fn remove_host_routes(&self, ips: &[std::net::IpAddr]) -> Result<()> {
        self.inner.remove_host_routes(ips).await
    }
    async fn ensure_host_routes(
        &self,
        host_ifname: &str,
        ips: &[std::net::IpAddr],
    ) -> Result<usize> {
        self.inner.ensure_host_routes(host_ifname, ips).await
    }
    async fn our_routes(&self) -> Result<Vec<HostRoute>> {
        self.inner.our_routes().await
    }
    async fn our_links(&self) -> Result<Vec<String>> {
        self.inner.our_links().await
    }
    async fn link_index(&self, name: &str) -> Result<Option<u32>> {
        self.inner.link_index(name).await
    }
}

#[async_trait]
impl NodeRoutes for Held {
    async fn sync_cluster_routes(&self, desired: &[ClusterRoute]) -> Result<Synced> {
        self.inner.sync_cluster_routes(desired).await
    }
    async fn sync_vm_routes(&self, desired: &[ClusterRoute]) -> Result<Synced> {
        self.inner.sync_vm_routes(desired).await
    }
    async fn change_vm_routes(
        &self,
        put: &[ClusterRoute],
        gone: &[ClusterRoute],
    ) -> Result<Synced> {
        self.inner.change_vm_routes(put, gone).await
    }
    async fn change_cluster_routes(
        &self,
        put: &[ClusterRoute],
        gone: &[ClusterRoute],
    ) -> Result<Synced> {
        self.inner.change_cluster_routes(put, gone).await
    }
    async fn ensure_vxlan(&self, cfg: &VxlanConfig) -> Result<()> {
        self.inner.ensure_vxlan(cfg).await
    }
    async fn sync_vxlan_peers(&self, peers: &[VxlanPeer]) -> Result<Synced> {
        self.inner.sync_vxlan_peers(peers).await
    }
    async fn delete_vxlan(&self) -> Result<()> {
        self.inner.delete_vxlan().await
    }
    async fn underlay_mtu(&self, ip: std::net::IpAddr) -> Result<Option<u32>> {
        self.inner.underlay_mtu(ip).await
    }
}

impl Kernel for Held {
    fn second_socket(&self) -> Result<Arc<dyn Kernel>> {
        Ok(Arc::new(Held {
            inner: self.inner.second_socket()?,
            hold: self.hold,
        }))
    }
    fn handover(&self) -> Arc<dyn Handover> {
        self.inner.handover()
    }
}

/// The control store, whose writes begun while `flag` exists wait `hold`
/// first (and are then made against the store as it is by then).
struct HeldWrites {
    inner: Arc<dyn ControlStore>,
    flag: PathBuf,
    hold: Duration,
}

impl ControlStore for HeldWrites {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn location(&self) -> String {
        self.inner.location()
    }
    fn list(&self, prefix: &str) -> BoxFut<'_, (Vec<Kv>, i64)> {
        self.inner.list(prefix)
    }
    fn commit(&self, when: Vec<Cmp>, ops: Vec<Op>) -> BoxFut<'_, Option<i64>> {
        Box::pin(async move {
            if self.flag.exists() {
                tokio::time::sleep(self.hold).await;
            }
            self.inner.commit(when, ops).await
        })
    }
    fn watch(&self, prefix: &str, after: i64) -> BoxFut<'_, mpsc::Receiver<WatchMessage>> {
        self.inner.watch(prefix, after)
    }
    fn grant_lease(&self, ttl_secs: i64) -> BoxFut<'_, i64> {
        self.inner.grant_lease(ttl_secs)
    }
    fn keep_alive(&self, lease: i64) -> BoxFut<'_, bool> {
        self.inner.keep_alive(lease)
    }
    fn probe(&self) -> BoxFut<'_, ()> {
        self.inner.probe()
    }
}
