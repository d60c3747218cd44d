//! tether under real container runtimes: containerd's `ctr run --cni` and
//! podman 4.3 with its CNI backend, both from Debian's packages.
//!
//! Each test runs its own `tetherd` in a node netns (the harness's
//! [`Daemon`]); the runtime creates the container's netns itself and tether
//! wires it to that node netns, so the machine's root netns is never
//! touched. The tether plugin the runtime executes is a small recording
//! wrapper that execs the real binary: the tests can then assert what the
//! runtime sent as well as what the user sees.
//!
//! Run as root, after `tests/setup.sh`.

use std::fs::File;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tether_e2e::{
    add, del, require_root, tether_bin, unique_name, Daemon, DaemonOpts, Netns, TempDir,
};

use tether_e2e::runtime::{
    attachments, busybox_rootfs, install_recording_plugin, libcni_cache_files, node_leftovers,
    ping_argv, print_calls, recorded_calls, result_host_ifname, result_ip, run_bounded, run_ok,
    wait_for, Call, MachinePaths,
};

/// Pod CIDR of the containerd test's daemon (inside its node netns only).
const CTR_POD_CIDR: &str = "10.251.1.0/24";
/// Pod CIDR of the podman test's daemon (inside its node netns only).
const PODMAN_POD_CIDR: &str = "10.251.2.0/24";

/// Bound for one runtime command (start, exec, kill, rm).
const RUNTIME_TIMEOUT: Duration = Duration::from_secs(120);
/// Bound for containerd to serve, and for a container to start or stop.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// Where containerd's `ctr` looks for plugins and for the network: its
/// go-cni defaults, which no flag or variable changes.
const SYSTEM_CNI_BIN: &str = "/opt/cni/bin";
const SYSTEM_CNI_CONF: &str = "/etc/cni/net.d";
/// libcni's default result cache, used by both runtimes.
const LIBCNI_CACHE: &str = "/var/lib/cni";

/// A conflist holding one tether plugin for `daemon`, named `network`.
fn tether_conflist(daemon: &Daemon, network: &str) -> Value {
    let mut plugin = daemon.netconf("1.0.0", network);
    if let Some(obj) = plugin.as_object_mut() {
        // A conflist carries these at the top; libcni puts them back.
        obj.remove("cniVersion");
        obj.remove("name");
    }
    json!({ "cniVersion": "1.0.0", "name": network, "plugins": [plugin] })
}

/// True if `ip` lies in IPv4 `cidr`.
fn in_v4_cidr(ip: &str, cidr: &str) -> bool {
    let (net, len) = cidr.split_once('/').expect("cidr has a prefix length");
    let (Ok(ip), Ok(net), Ok(len)) = (
        ip.parse::<Ipv4Addr>(),
        net.parse::<Ipv4Addr>(),
        len.parse::<u32>(),
    ) else {
        return false;
    };
    let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
    u32::from(ip) & mask == u32::from(net) & mask
}

/// The calls of `command` among `calls`.
fn calls_of<'a>(calls: &'a [Call], command: &str) -> Vec<&'a Call> {
    calls.iter().filter(|c| c.command() == command).collect()
}

/// A second pod, a plain netns attached through tether by the harness, for
/// the container to ping. DEL'd (then its netns deleted) on drop.
struct NetnsPod<'a> {
    netconf: Value,
    id: String,
    netns: Netns,
    ip: String,
    deleted: bool,
    _daemon: &'a Daemon,
}

impl<'a> NetnsPod<'a> {
    fn add(daemon: &'a Daemon, network: &str) -> NetnsPod<'a> {
        let netconf = daemon.netconf("1.0.0", network);
        let netns = Netns::new("pod");
        let id = unique_name("pod");
        let out = add(&tether_bin(), &netconf, &id, &netns);
        let ip = result_ip(out.result());
        NetnsPod {
            netconf,
            id,
            netns,
            ip,
            deleted: false,
            _daemon: daemon,
        }
    }

    fn del(&mut self) {
        self.deleted = true;
        del(&tether_bin(), &self.netconf, &self.id, &self.netns).assert_success();
    }
}

impl Drop for NetnsPod<'_> {
    fn drop(&mut self) {
        if !self.deleted {
            let out = del(&tether_bin(), &self.netconf, &self.id, &self.netns);
            if !out.success() {
                eprintln!("cleanup: DEL of {} failed: {out}", self.id);
            }
        }
    }
}

/// Panics if the daemon still lists `container_id` in `network` (after its
/// DEL).
fn assert_not_held(daemon: &Daemon, network: &str, container_id: &str) {
    let held = attachments(daemon, network);
    assert!(
        !held.iter().any(|a| a["containerId"] == container_id),
        "the attachment survived DEL: {held:?}"
    );
}

/// After `runtime`'s DEL of a container that held `ip` on node veth
/// `host_if`: the veth goes, no route to `ip` stays, libcni caches nothing
/// of `network`; then, once `other` is DEL'd too, the node holds nothing of
/// tether and the daemon no attachment.
fn assert_cleaned_up(
    runtime: &str,
    daemon: &Daemon,
    network: &str,
    host_if: Option<&str>,
    ip: &str,
    mut other: NetnsPod<'_>,
) {
    let node = daemon.node();
    if let Some(host_if) = host_if {
        wait_for(
            "the container's host veth to go",
            Duration::from_secs(10),
            || (!node.has_link(host_if)).then_some(()),
        );
    }
    let routes = node.exec_ok(&["ip", "-4", "route", "show", &format!("{ip}/32")]);
    assert!(
        routes.trim().is_empty(),
        "a route to {ip} survived DEL: {routes}"
    );
    assert!(
        libcni_cache_files(Path::new(LIBCNI_CACHE), network).is_empty(),
        "{runtime} left libcni cache files for {network}"
    );

    // And once the other pod is gone too, the node holds nothing of tether.
    other.del();
    wait_for("the node to be clean", Duration::from_secs(10), || {
        node_leftovers(node).is_empty().then_some(())
    });
    assert!(attachments(daemon, network).is_empty(), "attachments left");
}

// ---------------------------------------------------------------------------
// containerd: `ctr run --cni --rootfs`

/// The machine-wide CNI files `ctr run --cni` needs, installed for one test
/// and removed again on drop: the plugin as `/opt/cni/bin/tether` and the
/// conflist as the first file of `/etc/cni/net.d` (go-cni loads the first
/// `.conf`/`.conflist`/`.json` in sorted order; ctr has no flag or variable
/// to point it elsewhere). A `tether` that was there before is put back.
/// Create it under a [`MachinePaths`] claim on both dirs: that serializes
/// the tests and removes the dirs if the test created them.
struct SystemCniFiles {
    plugin: PathBuf,
    plugin_backup: Option<PathBuf>,
    conflist: PathBuf,
}

impl SystemCniFiles {
    fn install(conflist: &Value, capture_dir: &Path) -> SystemCniFiles {
        for dir in [SYSTEM_CNI_BIN, SYSTEM_CNI_CONF] {
            std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("creating {dir}: {e}"));
        }
        let mut files = SystemCniFiles {
            plugin: Path::new(SYSTEM_CNI_BIN).join("tether"),
            plugin_backup: None,
            conflist: Path::new(SYSTEM_CNI_CONF)
                .join(format!("00-{}.conflist", tether_e2e::run_prefix())),
        };
        if files.plugin.exists() {
            // Same dir, so that the rename cannot cross filesystems.
            let backup = Path::new(SYSTEM_CNI_BIN)
                .join(format!(".tether.{}.before-test", tether_e2e::run_prefix()));
            std::fs::rename(&files.plugin, &backup).unwrap_or_else(|e| {
                panic!("moving the existing {} aside: {e}", files.plugin.display())
            });
            files.plugin_backup = Some(backup);
        }
        install_recording_plugin(&files.plugin, &tether_bin(), None, capture_dir);
        std::fs::write(&files.conflist, conflist.to_string())
            .unwrap_or_else(|e| panic!("writing {}: {e}", files.conflist.display()));

        let first = first_network_file(Path::new(SYSTEM_CNI_CONF));
        assert_eq!(
            first.as_deref(),
            Some(files.conflist.as_path()),
            "ctr would not load our conflist: another network file sorts before it in {SYSTEM_CNI_CONF}"
        );
        files
    }
}

/// The file go-cni's `WithDefaultConf` picks in `dir`.
fn first_network_file(dir: &Path) -> Option<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            matches!(
                p.extension().and_then(|e| e.to_str()),
                Some("conf" | "conflist" | "json")
            )
        })
        .collect();
    files.sort();
    files.into_iter().next()
}

impl Drop for SystemCniFiles {
    fn drop(&mut self) {
        for file in [&self.conflist, &self.plugin] {
            if let Err(e) = std::fs::remove_file(file) {
                eprintln!("cleanup: removing {}: {e}", file.display());
            }
        }
        if let Some(backup) = &self.plugin_backup {
            if let Err(e) = std::fs::rename(backup, &self.plugin) {
                eprintln!(
                    "cleanup: restoring {} from {}: {e}",
                    self.plugin.display(),
                    backup.display()
                );
            }
        }
    }
}

/// A containerd of the test's own: config, root, state and sockets in a
/// temp dir, CRI disabled. Killed on drop (containers first: see
/// [`CtrContainer`]).
struct Containerd {
    child: Child,
    dir: PathBuf,
    socket: PathBuf,
}

impl Containerd {
    fn start(dir: &Path) -> Containerd {
        std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        let socket = dir.join("containerd.sock");
        let config = format!(
            r#"version = 2
root = "{dir}/root"
state = "{dir}/state"
disabled_plugins = [
  "io.containerd.grpc.v1.cri",
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs",
]
[grpc]
  address = "{socket}"
[ttrpc]
  address = "{dir}/containerd-ttrpc.sock"
"#,
            dir = dir.display(),
            socket = socket.display()
        );
        let config_path = dir.join("config.toml");
        std::fs::write(&config_path, config)
            .unwrap_or_else(|e| panic!("writing {}: {e}", config_path.display()));
        let log = File::create(dir.join("containerd.log")).expect("creating containerd.log");
        let child = Command::new("containerd")
            .arg("--config")
            .arg(&config_path)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup log fd"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("spawning containerd (apt-get install containerd): {e}"));
        let mut containerd = Containerd {
            child,
            dir: dir.to_owned(),
            socket,
        };
        wait_for("containerd to serve", START_TIMEOUT, || {
            if let Ok(Some(status)) = containerd.child.try_wait() {
                panic!("containerd exited ({status}):\n{}", containerd.log());
            }
            let out = run_bounded(
                containerd.ctr("default").arg("version"),
                Duration::from_secs(10),
            );
            out.status.success().then_some(())
        });
        containerd
    }

    /// `ctr` against this containerd, in containerd namespace `namespace`.
    fn ctr(&self, namespace: &str) -> Command {
        let mut cmd = Command::new("ctr");
        cmd.arg("--address")
            .arg(&self.socket)
            .args(["--namespace", namespace]);
        cmd
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default()
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = self.log();
            let lines: Vec<&str> = log.lines().collect();
            eprintln!(
                "containerd log (tail):\n{}",
                lines[lines.len().saturating_sub(30)..].join("\n")
            );
        }
        // Our own child, not reaped yet.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A container started by `ctr run --cni --rootfs` in the foreground, the
/// way ctr does networking: ctr itself runs ADD before starting the task,
/// and runs DEL (with an empty `CNI_NETNS`) when the task has exited. Drop
/// kills the task, waits for ctr, and removes the container.
struct CtrContainer<'a> {
    containerd: &'a Containerd,
    namespace: String,
    id: String,
    run: Option<Child>,
    dir: PathBuf,
    removed: bool,
}

impl<'a> CtrContainer<'a> {
    fn run(
        containerd: &'a Containerd,
        namespace: &str,
        id: &str,
        rootfs: &Path,
        dir: &Path,
    ) -> CtrContainer<'a> {
        std::fs::create_dir_all(dir.join("fifo")).expect("creating the fifo dir");
        let stdout = File::create(dir.join("ctr-run.out")).expect("creating ctr-run.out");
        let stderr = File::create(dir.join("ctr-run.err")).expect("creating ctr-run.err");
        let child = containerd
            .ctr(namespace)
            .args(["run", "--cni", "--rootfs", "--null-io"])
            // FIFOs and runc's state in the temp dir, not under /run/containerd.
            .arg("--fifo-dir")
            .arg(dir.join("fifo"))
            .arg("--runc-root")
            .arg(dir.join("runc"))
            // With --rootfs there is no image config, hence no PATH.
            .args(["--env", "PATH=/bin"])
            .arg(rootfs)
            .arg(id)
            .args(["/bin/sleep", "600"])
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("spawning ctr: {e}"));
        CtrContainer {
            containerd,
            namespace: namespace.to_owned(),
            id: id.to_owned(),
            run: Some(child),
            dir: dir.to_owned(),
            removed: false,
        }
    }

    /// The id tether sees: ctr sends `<namespace>-<id>`.
    fn cni_container_id(&self) -> String {
        format!("{}-{}", self.namespace, self.id)
    }

    fn ctr(&self) -> Command {
        self.containerd.ctr(&self.namespace)
    }

    fn run_output(&self) -> String {
        let read = |f: &str| std::fs::read_to_string(self.dir.join(f)).unwrap_or_default();
        format!(
            "ctr run stdout: {}\nctr run stderr: {}",
            read("ctr-run.out"),
            read("ctr-run.err")
        )
    }

    /// Waits until the task runs, which for `ctr run --cni` means the CNI
    /// ADD is done; panics with ctr's output if ctr gives up first.
    fn wait_running(&mut self) {
        let id = self.id.clone();
        wait_for("the ctr task to run", START_TIMEOUT, || {
            if let Some(Ok(Some(status))) = self.run.as_mut().map(Child::try_wait) {
                panic!(
                    "ctr run exited ({status}) before the task ran\n{}",
                    self.run_output()
                );
            }
            let tasks = run_ok(self.ctr().args(["task", "ls"]), RUNTIME_TIMEOUT);
            tasks
                .lines()
                .any(|l| {
                    let cols: Vec<&str> = l.split_whitespace().collect();
                    cols.first() == Some(&id.as_str()) && cols.get(2) == Some(&"RUNNING")
                })
                .then_some(())
        });
    }

    /// `ctr task exec` of `argv` in the container; returns the output.
    fn exec(&self, argv: &[&str]) -> std::process::Output {
        let exec_id = unique_name("exec");
        run_bounded(
            self.ctr()
                .args(["task", "exec", "--exec-id", &exec_id, "--fifo-dir"])
                .arg(self.dir.join("fifo"))
                .arg(&self.id)
                .args(argv),
            RUNTIME_TIMEOUT,
        )
    }

    fn exec_ok(&self, argv: &[&str]) -> String {
        let out = self.exec(argv);
        assert!(
            out.status.success(),
            "ctr task exec {argv:?} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `ctr task kill -s KILL`, then waits for the foreground `ctr run` to
    /// finish (it runs the CNI DEL on its way out) and returns its status.
    fn kill(&mut self) -> Option<ExitStatus> {
        let mut child = self.run.take()?;
        let _ = run_bounded(
            self.ctr()
                .args(["task", "kill", "--signal", "SIGKILL", &self.id]),
            RUNTIME_TIMEOUT,
        );
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            match child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                _ => {
                    eprintln!("ctr run did not exit after the task was killed; killing ctr");
                    // Our own child, not reaped yet.
                    let _ = child.kill();
                    let _ = child.wait();
                    return None;
                }
            }
        }
    }

    /// `ctr task rm` (if a task is left) and `ctr container rm`.
    fn remove(&mut self) -> std::process::Output {
        self.removed = true;
        let _ = run_bounded(
            self.ctr().args(["task", "rm", "--force", &self.id]),
            RUNTIME_TIMEOUT,
        );
        run_bounded(
            self.ctr().args(["container", "rm", &self.id]),
            RUNTIME_TIMEOUT,
        )
    }
}

impl Drop for CtrContainer<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}", self.run_output());
        }
        self.kill();
        if !self.removed {
            let out = self.remove();
            if !out.status.success() {
                eprintln!(
                    "cleanup: ctr container rm {}: {}",
                    self.id,
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
    }
}

/// `ctr run --cni --rootfs` puts a container on tether: it gets its address
/// (seen from inside), reaches another pod and is reached by it, and when
/// the task is killed ctr's DEL, which comes with an empty `CNI_NETNS`,
/// removes everything tether made for it.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn ctr_run_cni_wires_the_container_and_cleans_up_after_it() {
    require_root();
    let _machine = MachinePaths::claim(&[
        "/run/containerd/s",
        "/var/lib/cni/results",
        SYSTEM_CNI_BIN,
        SYSTEM_CNI_CONF,
    ]);
    let started = Instant::now();
    let daemon = Daemon::start(DaemonOpts {
        pod_cidrs: vec![CTR_POD_CIDR.to_owned()],
        ..Default::default()
    });
    let tmp = TempDir::new("ctr");
    let calls_dir = tmp.path().join("calls");
    std::fs::create_dir(&calls_dir).expect("creating the calls dir");
    let network = unique_name("ctrnet");
    let _system_files = SystemCniFiles::install(&tether_conflist(&daemon, &network), &calls_dir);
    let rootfs = tmp.path().join("rootfs");
    busybox_rootfs(&rootfs);
    let containerd = Containerd::start(&tmp.path().join("containerd"));
    let namespace = unique_name("ns");
    let mut container = CtrContainer::run(
        &containerd,
        &namespace,
        &unique_name("c"),
        &rootfs,
        tmp.path(),
    );
    container.wait_running();

    // What ctr sent with ADD, and what tether answered.
    let calls = recorded_calls(&calls_dir);
    print_calls("ctr", &calls);
    let adds = calls_of(&calls, "ADD");
    assert_eq!(adds.len(), 1, "ctr should have called ADD once");
    let add_call = adds[0];
    assert_eq!(add_call.rc, Some(0), "ADD failed: {}", add_call.describe());
    assert_eq!(
        add_call.var("CNI_CONTAINERID"),
        container.cni_container_id()
    );
    assert!(
        add_call.var("CNI_NETNS").starts_with("/proc/")
            && add_call.var("CNI_NETNS").ends_with("/ns/net"),
        "ctr's CNI_NETNS: {}",
        add_call.var("CNI_NETNS")
    );
    assert_eq!(add_call.var("CNI_IFNAME"), "eth0");
    let result = add_call
        .output()
        .unwrap_or_else(|| panic!("ADD printed no JSON: {}", add_call.describe()));
    let ip = result_ip(&result);
    assert!(
        in_v4_cidr(&ip, CTR_POD_CIDR),
        "pod IP {ip} is not in {CTR_POD_CIDR}"
    );
    let host_if = result_host_ifname(&result);

    // The container sees its address on eth0.
    let inside = container.exec_ok(&["/bin/ip", "-4", "addr", "show", "dev", "eth0"]);
    assert!(
        inside.contains(&format!("inet {ip}/")),
        "eth0 in the container does not hold {ip}:\n{inside}"
    );
    // The daemon knows the attachment under ctr's container id.
    let held = attachments(&daemon, &network);
    assert!(
        held.iter()
            .any(|a| a["containerId"] == container.cni_container_id().as_str()),
        "the admin API does not list {}: {held:?}",
        container.cni_container_id()
    );

    // Pod to pod, both ways.
    let other = NetnsPod::add(&daemon, &network);
    let ping = ping_argv("/bin/ping", &other.ip);
    let ping: Vec<&str> = ping.iter().map(String::as_str).collect();
    let out = container.exec(&ping);
    assert!(
        out.status.success(),
        "the container cannot ping pod {}: {}{}",
        other.ip,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let back = ping_argv("ping", &ip);
    let back: Vec<&str> = back.iter().map(String::as_str).collect();
    other.netns.exec_ok(&back);

    // Kill the task: ctr runs DEL on its way out, then the container goes.
    let status = container.kill().expect("ctr run was running");
    eprintln!("ctr run exited with {status} after the kill");
    let removed = container.remove();
    assert!(
        removed.status.success(),
        "ctr container rm: {}",
        String::from_utf8_lossy(&removed.stderr)
    );

    let calls = recorded_calls(&calls_dir);
    let dels = calls_of(&calls, "DEL");
    assert_eq!(
        dels.len(),
        1,
        "ctr should have called DEL once:\n{calls:#?}"
    );
    let del_call = dels[0];
    eprintln!("[ctr DEL] {}", del_call.describe());
    assert_eq!(
        del_call.var("CNI_NETNS"),
        "",
        "ctr's DEL comes with an empty CNI_NETNS"
    );
    assert_eq!(
        del_call.var("CNI_CONTAINERID"),
        container.cni_container_id()
    );
    assert_eq!(del_call.rc, Some(0), "DEL failed: {}", del_call.describe());
    assert_eq!(
        result_ip(&del_call.netconf()["prevResult"]),
        ip,
        "ctr's DEL carries the ADD result as prevResult"
    );

    // Nothing of the container is left: no attachment, no host veth, no
    // route, no libcni cache entry.
    assert_not_held(&daemon, &network, &container.cni_container_id());
    assert_cleaned_up("ctr", &daemon, &network, host_if.as_deref(), &ip, other);
    eprintln!("ctr test took {:?}", started.elapsed());
}

// ---------------------------------------------------------------------------
// podman with network_backend = "cni"

/// A podman whose whole world is a temp dir: containers.conf (CNI backend,
/// runc, cgroupfs, file locks, the plugin and network dirs) and
/// storage.conf (vfs graphroot and runroot), given through
/// `CONTAINERS_CONF` and `CONTAINERS_STORAGE_CONF`. Drop removes every
/// container of that storage and unmounts anything left under the dir.
struct Podman {
    dir: PathBuf,
}

impl Podman {
    fn new(dir: &Path, network: &str) -> Podman {
        for sub in ["cni-bin", "net.d", "graph", "run", "tmp", "volumes"] {
            std::fs::create_dir_all(dir.join(sub))
                .unwrap_or_else(|e| panic!("creating {sub}: {e}"));
        }
        // podman's defaults for root (nofile and nproc 1048576) are above
        // the hard limits runc inherits here (nproc is even lowered to
        // 32768 on the way), and runc cannot raise a hard limit without
        // CAP_SYS_RESOURCE, which this sandbox lacks. Lowering is always
        // allowed: give the container small limits of its own.
        let (nofile, nproc) = ("1024:1024", "1024:1024");
        let d = dir.display();
        let containers_conf = format!(
            r#"[containers]
log_driver = "k8s-file"
default_ulimits = ["nofile={nofile}", "nproc={nproc}"]

[network]
network_backend = "cni"
cni_plugin_dirs = ["{d}/cni-bin"]
network_config_dir = "{d}/net.d"
default_network = "{network}"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "{d}/events.log"
lock_type = "file"
tmp_dir = "{d}/tmp"
volume_path = "{d}/volumes"
static_dir = "{d}/graph/libpod"
"#
        );
        let storage_conf = format!(
            r#"[storage]
driver = "vfs"
graphroot = "{d}/graph"
runroot = "{d}/run"
"#
        );
        std::fs::write(dir.join("containers.conf"), containers_conf)
            .expect("writing containers.conf");
        std::fs::write(dir.join("storage.conf"), storage_conf).expect("writing storage.conf");
        Podman {
            dir: dir.to_owned(),
        }
    }

    fn cni_bin(&self) -> PathBuf {
        self.dir.join("cni-bin")
    }

    fn net_d(&self) -> PathBuf {
        self.dir.join("net.d")
    }

    fn cmd(&self) -> Command {
        let mut cmd = Command::new("podman");
        cmd.env("CONTAINERS_CONF", self.dir.join("containers.conf"))
            .env("CONTAINERS_STORAGE_CONF", self.dir.join("storage.conf"));
        cmd
    }

    fn run_ok(&self, args: &[&str]) -> String {
        run_ok(self.cmd().args(args), RUNTIME_TIMEOUT)
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        // Every container of *this* storage; nothing else is visible to it.
        let out = run_bounded(
            self.cmd().args(["rm", "--all", "--force", "--time", "0"]),
            RUNTIME_TIMEOUT,
        );
        if !out.status.success() {
            eprintln!(
                "cleanup: podman rm --all: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        // Anything podman left mounted under our dir would stop the temp
        // dir's removal.
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
        let prefix = format!("{}/", self.dir.display());
        let mut ours: Vec<&str> = mounts
            .lines()
            .filter_map(|l| l.split_whitespace().nth(1))
            .filter(|m| m.starts_with(&prefix))
            .collect();
        ours.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for mount in ours {
            let _ = run_bounded(
                Command::new("umount").args(["-l", mount]),
                Duration::from_secs(10),
            );
        }
    }
}

/// podman 4.3 with the CNI backend puts a container on a tether network:
/// podman's VERSION probe with dummy values works, the container gets its
/// address (podman inspect and inside), reaches another pod, and after
/// `podman rm -f` nothing of it is left.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn podman_cni_backend_wires_the_container_and_cleans_up_after_it() {
    require_root();
    let _machine = MachinePaths::claim(&[
        "/run/runc",
        "/var/lib/cni/results",
        "/var/lib/containers/cache/blob-info-cache-v1.boltdb",
    ]);
    let started = Instant::now();
    let daemon = Daemon::start(DaemonOpts {
        pod_cidrs: vec![PODMAN_POD_CIDR.to_owned()],
        ..Default::default()
    });
    let tmp = TempDir::new("podman");
    let calls_dir = tmp.path().join("calls");
    std::fs::create_dir(&calls_dir).expect("creating the calls dir");
    let network = unique_name("pmnet");
    let podman = Podman::new(&tmp.path().join("podman"), &network);
    install_recording_plugin(
        &podman.cni_bin().join("tether"),
        &tether_bin(),
        None,
        &calls_dir,
    );
    std::fs::write(
        podman.net_d().join(format!("{network}.conflist")),
        tether_conflist(&daemon, &network).to_string(),
    )
    .expect("writing the conflist");

    // The network is visible to podman with tether as its driver.
    let networks = podman.run_ok(&["network", "ls", "--format", "{{.Name}} {{.Driver}}"]);
    assert!(
        networks
            .lines()
            .any(|l| l.trim() == format!("{network} tether")),
        "podman network ls does not show {network} on tether:\n{networks}"
    );

    // A busybox image imported from a tar of the rootfs.
    let rootfs = tmp.path().join("rootfs");
    busybox_rootfs(&rootfs);
    let tar = tmp.path().join("rootfs.tar");
    run_ok(
        Command::new("tar")
            .arg("-C")
            .arg(&rootfs)
            .arg("-cf")
            .arg(&tar)
            .arg("."),
        RUNTIME_TIMEOUT,
    );
    let image = format!("localhost/{}-busybox:latest", tether_e2e::run_prefix());
    podman.run_ok(&["import", &tar.display().to_string(), &image]);

    let name = unique_name("pm");
    let container_id = podman
        .run_ok(&[
            "run",
            "--detach",
            "--name",
            &name,
            "--network",
            &network,
            &image,
            "/bin/sleep",
            "600",
        ])
        .trim()
        .to_owned();

    let calls = recorded_calls(&calls_dir);
    print_calls("podman", &calls);
    // podman probes VERSION first, with dummy values that must not be
    // validated.
    let first = calls.first().expect("podman called tether");
    assert_eq!(first.command(), "VERSION", "podman's first call");
    assert_eq!(first.var("CNI_NETNS"), "dummy");
    assert_eq!(first.var("CNI_PATH"), "dummy");
    assert_eq!(first.rc, Some(0), "VERSION failed: {}", first.describe());
    let versions = first.output().expect("VERSION printed JSON");
    assert!(
        versions["supportedVersions"]
            .as_array()
            .is_some_and(|v| v.iter().any(|x| x == "1.0.0")),
        "VERSION does not list 1.0.0: {versions}"
    );
    let adds = calls_of(&calls, "ADD");
    assert_eq!(adds.len(), 1, "podman should have called ADD once");
    let add_call = adds[0];
    assert_eq!(add_call.rc, Some(0), "ADD failed: {}", add_call.describe());
    assert_eq!(add_call.var("CNI_CONTAINERID"), container_id);
    assert!(
        add_call
            .var("CNI_ARGS")
            .contains(&format!("K8S_POD_NAME={name}")),
        "podman's CNI_ARGS: {}",
        add_call.var("CNI_ARGS")
    );
    let sandbox = add_call.var("CNI_NETNS").to_owned();
    assert!(
        sandbox.starts_with("/run/netns/netns-"),
        "podman's CNI_NETNS: {sandbox}"
    );
    let result = add_call
        .output()
        .unwrap_or_else(|| panic!("ADD printed no JSON: {}", add_call.describe()));
    let ip = result_ip(&result);
    assert!(
        in_v4_cidr(&ip, PODMAN_POD_CIDR),
        "pod IP {ip} is not in {PODMAN_POD_CIDR}"
    );
    let host_if = result_host_ifname(&result);

    // podman's view of the container's network.
    let inspect: Value =
        serde_json::from_str(&podman.run_ok(&["inspect", &name])).expect("podman inspect JSON");
    let settings = &inspect[0]["NetworkSettings"];
    assert_eq!(
        settings["Networks"][&network]["IPAddress"].as_str(),
        Some(ip.as_str()),
        "podman inspect: {settings}"
    );
    assert_eq!(
        settings["SandboxKey"].as_str(),
        Some(sandbox.as_str()),
        "podman inspect: {settings}"
    );

    // The container sees its address on eth0, from inside and through the
    // netns podman made (nsenter, not `ip netns exec`).
    let inside = podman.run_ok(&[
        "exec", &name, "/bin/ip", "-4", "addr", "show", "dev", "eth0",
    ]);
    assert!(
        inside.contains(&format!("inet {ip}/")),
        "eth0 in the container:\n{inside}"
    );
    let through_netns = run_ok(
        Command::new("nsenter")
            .arg(format!("--net={sandbox}"))
            .args(["ip", "-4", "-o", "addr", "show", "dev", "eth0"]),
        RUNTIME_TIMEOUT,
    );
    assert!(
        through_netns.contains(&format!("inet {ip}/")),
        "eth0 via nsenter:\n{through_netns}"
    );
    let held = attachments(&daemon, &network);
    assert!(
        held.iter()
            .any(|a| a["containerId"] == container_id.as_str()),
        "the admin API does not list {container_id}: {held:?}"
    );

    // Pod to pod, both ways.
    let other = NetnsPod::add(&daemon, &network);
    let mut exec = vec!["exec".to_owned(), name.clone()];
    exec.extend(ping_argv("/bin/ping", &other.ip));
    let exec: Vec<&str> = exec.iter().map(String::as_str).collect();
    podman.run_ok(&exec);
    let back = ping_argv("ping", &ip);
    let back: Vec<&str> = back.iter().map(String::as_str).collect();
    other.netns.exec_ok(&back);

    // Remove the container: podman runs DEL with the netns still there.
    podman.run_ok(&["rm", "--force", "--time", "0", &name]);
    let calls = recorded_calls(&calls_dir);
    let dels = calls_of(&calls, "DEL");
    assert_eq!(
        dels.len(),
        1,
        "podman should have called DEL once:\n{calls:#?}"
    );
    let del_call = dels[0];
    eprintln!("[podman DEL] {}", del_call.describe());
    assert_eq!(del_call.rc, Some(0), "DEL failed: {}", del_call.describe());
    assert_eq!(del_call.var("CNI_NETNS"), sandbox);
    assert_eq!(
        result_ip(&del_call.netconf()["prevResult"]),
        ip,
        "DEL's prevResult"
    );

    assert_not_held(&daemon, &network, &container_id);
    assert!(
        !Path::new(&sandbox).exists(),
        "podman left its netns {sandbox}"
    );
    assert_cleaned_up("podman", &daemon, &network, host_if.as_deref(), &ip, other);
    eprintln!("podman test took {:?}", started.elapsed());
}
