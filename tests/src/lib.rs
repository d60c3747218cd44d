//! tether end-to-end harness.
//!
//! Everything a root integration test or the benchmark needs to drive real
//! kernel objects without touching the machine's own network:
//!
//! - [`Netns`]: a named network namespace, deleted again when dropped;
//! - [`Daemon`]: a `tetherd` running inside a node netns of its own, with a
//!   private socket and state dir, killed and cleaned up when dropped;
//! - [`cni()`], [`add`], [`del`], [`check`]: one runtime-style plugin
//!   invocation (environment plus netconf on stdin), with its result parsed;
//! - [`parallel`]: run `n` closures at once, released together;
//! - [`mod@admin`]: the daemon's admin API from Rust (also as [`Daemon`]
//!   methods: [`Daemon::attachments`], [`Daemon::node_info`], ...);
//! - [`view`]: tether's veths and routes in a node netns, and a dual-stack
//!   ADD result ([`AddResult`]);
//! - [`wait_until`], [`assert_distinct`]: polling and a common assertion;
//! - [`mod@reference`]: netconfs for Debian's reference plugins;
//! - [`mod@topology`]: the one builder of every multi-node topology:
//!   tetherd nodes on etcd or the Kubernetes store ([`mod@cluster`]), or
//!   kubelet nodes, one or several, with KubeVirt's needs as an option
//!   ([`mod@kube_cluster`]);
//! - [`mod@cluster`]: the fabric, etcd, the tetherd nodes and their pods
//!   added through the real plugin, and ping between them;
//! - [`mod@kube`]: a real kube-apiserver (on its own etcd) with kubectl;
//! - [`mod@stack`]: a kubelet cluster's IP families (IPv4, dual-stack,
//!   IPv6) and the ranges each gets;
//! - [`mod@kube_cluster`], [`mod@kubelet`], [`mod@oci`]: kubelet nodes,
//!   each in its own namespaces, with containerd and kube-proxy, beside a
//!   control plane; what every such node runs; the registry-free images
//!   its pods run;
//! - [`mod@chart`]: tether's Helm chart rendered (`helm template`), and
//!   helm against a real API server;
//! - [`mod@conformance_images`]: what Kubernetes' sig-network Conformance
//!   tests run (their `e2e.test`, agnhost, CoreDNS, and their images);
//! - [`mod@kubevirt`]: KubeVirt built from source, its images, and its
//!   deployment on a kubelet topology;
//! - [`mod@vm`], [`mod@qemu`]: VM pods as KubeVirt's launchers make them
//!   (annotations, a migration's target), and real QEMU guests on a pod's
//!   tap, leasing with real DHCP clients, driven over QMP and their serial
//!   console;
//! - [`mod@migration`], [`mod@streams`], [`mod@paths`]: what a migration
//!   is measured with: probe streams and their loss windows, announcement
//!   frames, TCP and UDP streams on every path to and from a VM.
//!
//! Safety rules the harness keeps so that tests need not think about them:
//! every name carries [`run_prefix`], unique per process; every address,
//! link and route lives in a namespace the harness created; the only
//! processes ever signalled are children the harness spawned itself (by
//! their `Child` handle, never by name); and every guard cleans up in `Drop`,
//! so a failing test leaves nothing behind.

#![warn(missing_docs)]

pub mod admin;
pub mod chart;
pub mod cluster;
mod cni;
pub mod conformance;
pub mod conformance_images;
mod daemon;
pub mod denied;
pub mod kube;
pub mod kube_cluster;
pub mod kubelet;
pub mod kubevirt;
pub mod machine;
pub mod migration;
mod netns;
pub mod netpol;
pub mod oci;
pub mod paths;
pub mod qemu;
pub mod reference;
pub mod runtime;
pub mod stack;
pub mod streams;
pub mod topology;
pub mod view;
pub mod vm;

pub use admin::{admin, pb};
pub use cni::{
    add, call, check, cni, cni_with_timeout, del, ref_plugin, with_prev, CniEnv, CniOutput,
};
pub use cni::{CNI_TIMEOUT, REF_PLUGIN_DIR};
pub use daemon::{Daemon, DaemonOpts, DEFAULT_LOG_LEVEL};
pub use netns::{assert_ping_within, enter_at as enter_netns_at, ping, ping_output, Family, Netns};
pub use view::{
    assert_pod_holds, assert_tether_links_settle, expected_routes, is_tether_link, wait_link_gone,
    AddResult, LINK_SETTLE, ROUTE_PROTOCOL,
};

use std::collections::{BTreeSet, HashSet};
use std::fmt::Debug;
use std::hash::Hash;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Barrier, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Starts the logs of the suites' daemons built on tetherd's library
/// (`tetherd_with_delays`, `tetherd_control_only`): plain text on stderr
/// at `level` (tetherd's `--log-level`; `info` if it does not parse).
pub fn init_daemon_logs(level: &str) {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(level)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
}

/// Panics with a clear message unless the process runs as root: a test
/// that calls it is of a tier above fast (its feature is on), needs real
/// namespaces and must fail, not skip, when it cannot.
/// Then gives the process the default actions of SIGINT and SIGQUIT (see
/// [`default_signal_actions`]).
pub fn require_root() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    assert!(
        euid == 0,
        "tether's end-to-end tests must run as root (euid is {euid}): they create network \
         namespaces, veths and routes. Run them with sudo or in CI, or leave their tier's \
         feature off to see them ignored."
    );
    default_signal_actions();
}

/// Gives this process, and so every daemon, runtime and container it
/// starts, the default actions of SIGINT and SIGQUIT, as a service
/// manager gives its services. A shell that runs a command in the
/// background without job control starts it with both ignored, every
/// process below inherits that, and a shell script cannot trap a signal
/// it was started with ignored: the test images' `/pause` (a script) then
/// outlived a SIGINT (a fresh-machine `make test` run from a background
/// job, 2026-11-28).
pub fn default_signal_actions() {
    for signal in [libc::SIGINT, libc::SIGQUIT] {
        // SAFETY: setting a signal's action to the default touches no
        // memory of this process's.
        unsafe { libc::signal(signal, libc::SIG_DFL) };
    }
}

/// A short prefix unique to this process, `tt` and five hex digits, that
/// starts the name of every netns, link and temp dir the harness creates.
///
/// Short because link names are limited to 15 characters.
pub fn run_prefix() -> &'static str {
    static PREFIX: OnceLock<String> = OnceLock::new();
    PREFIX.get_or_init(|| {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let mixed = splitmix64((u64::from(std::process::id()) << 32) ^ nanos);
        format!("tt{:05x}", mixed & 0xf_ffff)
    })
}

/// `run_prefix()`, then `tag`, then a counter unique in this process: a name
/// no other test thread or run will pick.
///
/// Keep `tag` to six characters or fewer when the name is for a link.
pub fn unique_name(tag: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{}{tag}{n}", run_prefix())
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The workspace root (the directory holding the top-level `Cargo.toml`).
pub fn workspace_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent directory")
        .to_path_buf()
}

/// The README and every Markdown file under docs/, relative to the
/// workspace, sorted: the pages the doc suites read.
pub fn doc_files() -> Vec<String> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = e.expect("an entry").path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|x| x == "md") {
                out.push(path);
            }
        }
    }
    let root = workspace_dir();
    let mut files = vec![root.join("README.md")];
    walk(&root.join("docs"), &mut files);
    let mut names: Vec<String> = files
        .iter()
        .map(|p| p.strip_prefix(&root).expect("a doc").display().to_string())
        .collect();
    names.sort();
    names
}

/// Cargo's target directory: `CARGO_TARGET_DIR` if set, else
/// `<workspace>/target`.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        // Cargo reads a relative CARGO_TARGET_DIR against the current dir.
        Some(dir) => std::path::absolute(&dir).unwrap_or_else(|_| PathBuf::from(dir)),
        None => workspace_dir().join("target"),
    }
}

/// Where `tether` and `tetherd` are taken from: `TETHER_BIN_DIR` if set,
/// else the debug build in the target directory.
pub fn bin_dir() -> PathBuf {
    match std::env::var_os("TETHER_BIN_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => target_dir().join("debug"),
    }
}

/// The CNI plugin binary, `tether`, in [`bin_dir`].
pub fn tether_bin() -> PathBuf {
    bin_dir().join("tether")
}

/// The node daemon binary, `tetherd`, in [`bin_dir`].
pub fn tetherd_bin() -> PathBuf {
    bin_dir().join("tetherd")
}

/// Runs `f(0)`..`f(n-1)` on `n` threads released together by a barrier, and
/// returns their results in index order. A panic in any `f` is re-raised.
pub fn parallel<T: Send>(n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let barrier = Barrier::new(n);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|i| {
                let (f, barrier) = (&f, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    f(i)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

/// Polls `done` every 50 ms until it holds or `limit` passes; returns
/// whether it held.
pub fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A command's stdout then stderr, as text: for a failure's message.
pub fn output_text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The stdout of a command that must have succeeded; else panics with
/// `what` (the command as the message names it) and its output.
pub fn stdout_ok(out: &std::process::Output, what: impl std::fmt::Display) -> String {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}",
        out.status,
        output_text(out)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Panics naming the duplicates unless every item is distinct; `what`
/// says what the items are.
pub fn assert_distinct<T>(what: &str, items: impl IntoIterator<Item = T>)
where
    T: Clone + Eq + Hash + Ord + Debug,
{
    let mut seen = HashSet::new();
    let dups: BTreeSet<T> = items
        .into_iter()
        .filter(|i| !seen.insert(i.clone()))
        .collect();
    assert!(dups.is_empty(), "duplicate {what}: {dups:?}");
}

/// A directory under `/tmp`, named with [`run_prefix`], removed with all
/// its content on drop.
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// Creates `/tmp/<unique_name(tag)>`; panics if it cannot.
    pub fn new(tag: &str) -> TempDir {
        let path = std::env::temp_dir().join(unique_name(tag));
        std::fs::create_dir(&path)
            .unwrap_or_else(|e| panic!("creating temp dir {}: {e}", path.display()));
        TempDir { path }
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.path) {
            eprintln!("harness: cannot remove {}: {e}", self.path.display());
        }
    }
}

/// `path` opened for appending, twice: a child's stdout and stderr.
pub(crate) fn log_outputs(path: &Path) -> (std::fs::File, std::fs::File) {
    let log = std::fs::File::options()
        .create(true)
        .append(true)
        .open(path)
        .unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
    let err = log.try_clone().expect("duplicating the log fd");
    (log, err)
}

/// The last `n` lines of a log file, headed by its path, for panic
/// messages ("" if it cannot be read).
pub(crate) fn log_tail(path: &Path, n: usize) -> String {
    let log = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = log.lines().collect();
    let tail = &lines[lines.len().saturating_sub(n)..];
    format!(
        "--- last {} lines of {} ---\n{}",
        tail.len(),
        path.display(),
        tail.join("\n")
    )
}
