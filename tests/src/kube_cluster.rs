//! A Kubernetes cluster of kubelet nodes on this machine, one or several
//! (built by [`Topology::kubelet`](crate::topology::Topology::kubelet)),
//! for the suites that need what a real cluster has: the kubelet calling
//! tether, pods on two nodes talking to each other, Services through
//! kube-proxy, cluster DNS, and tether installed by its own chart.
//!
//! - **The control plane**: the API server of [`crate::kube`] in a netns of
//!   its own on the test fabric, kube-controller-manager (every default
//!   controller) and kube-scheduler beside it. The server reaches pod IPs
//!   (its pod proxy, the conformance tests' proxy checks) by one route,
//!   the cluster CIDR via the first node, which forwards by tether's
//!   routes: a control-plane host that is not itself a tether node. The
//!   replies of pods on other nodes come back directly; over IPv6 the
//!   first node forwards the server's packets to them untracked (see
//!   `KubeCluster::route_v6_control_plane_untracked`).
//! - **The stack** ([`Stack`], `Topology::stack`): IPv4 (the default),
//!   dual-stack or IPv6 only: the API server's Service ranges, the nodes'
//!   addresses (`--node-ip`), the cluster CIDRs of the controller
//!   manager, kube-proxy and tether's chart, and `kube-dns`' ClusterIPs.
//! - **Each node** ([`KubeNode`]) is its own network namespace on the
//!   fabric, its own mount namespace, and its own PID namespace, whose
//!   init is `node_init` (`tests/src/bin/node_init.rs`): `/proc/1` inside a
//!   node is the node's own init, and the node's standard paths
//!   ([`NODE_PATHS`]: `/var/lib/kubelet`, containerd's root and state, the
//!   CNI dirs, `/run/tether`, `/var/lib/tether`, `/run/netns`, the pod
//!   logs) are directories of this run bound in, so that two kubelets
//!   never share the device-plugin socket and a tether DaemonSet installed
//!   with the chart's default hostPaths finds its node's own dirs. The
//!   node's mounts are shared inside its namespace (the DaemonSet's
//!   `HostToContainer` mounts need it), never the machine's.
//! - Per node: Debian's containerd (1.6, CRI plugin) with runc, the
//!   kubelet, and kube-proxy (iptables mode), all started inside the node's
//!   namespaces with `nsenter`. kube-proxy runs as a node process, not as
//!   kubeadm's DaemonSet: the same binary and flags, started before the
//!   pod network exists.
//! - **tether**, installed with its Helm chart in its default mode, the
//!   Kubernetes store (`--store kubernetes`: its records as objects of its
//!   CRDs on this API server, no etcd of its own), with the chart's default
//!   hostPaths.
//! - **Cluster DNS**: CoreDNS deployed as kubeadm deploys it
//!   (`tests/k8s/coredns.yaml`), the kubelets' `clusterDNS` pointing at the
//!   `kube-dns` Service; the nodes' own resolver (what `dnsPolicy: Default`
//!   pods and CoreDNS's `forward` get) is the fabric's gateway, where
//!   nothing answers: no query leaves the test's namespaces.
//!
//! What differs from a production cluster: the cgroups are the machine's
//! (cgroup v1, `cgroupsPerQOS: false`, see [`crate::kubelet`]); `/sys` is
//! the machine's (a node's `/sys/class/net` shows the machine's links); no
//! registry (images are imported into every node's containerd).
//!
//! Dropping the cluster ends each node's init, which ends every process in
//! the node's PID namespace (kubelet, containerd, shims, containers); the
//! node's mount namespace and its netns pins go with it. Then the control
//! plane and the fabric go, and the mount points created on the machine
//! (directories that did not exist) are removed by the last cluster of
//! any process to go (see `MountPoints`).

use std::io::{Read, Seek, SeekFrom, Write};
use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::chart::{self, Helm};
use crate::cluster::{Fabric, Underlay, GATEWAY_V4, GATEWAY_V6};
use crate::kube::{k8s_bin_dir, KubeApi, ServiceSpec};
use crate::kubelet::{
    containerd_config, kubelet_config, terminate, tether_image, ContainerdPaths, PodWatch,
    SavedSysctls, TETHER_SELECTOR,
};
use crate::paths::{Ends, Outside, Place, Services};
use crate::stack::Stack;
use crate::topology::Kubelet;
use crate::{bin_dir, wait_until, Netns, TempDir};

/// The IPv4 pod network (tether's cluster CIDR); every family's:
/// [`Stack::pod_cidrs`].
pub const POD_CIDR: &str = crate::stack::POD_CIDR_V4;
/// The cluster's DNS domain.
pub const CLUSTER_DOMAIN: &str = "cluster.local";
/// The first node's host number on the fabric; node `i` is this plus `i`.
pub const FIRST_NODE_HOST: u8 = 31;
const READY: Duration = Duration::from_secs(120);

/// A node's standard paths, each bound from a directory of this run
/// (`<node dir>/<name>`) onto the path a real node keeps it at.
pub const NODE_PATHS: &[(&str, &str)] = &[
    ("kubelet", "/var/lib/kubelet"),
    ("containerd", "/var/lib/containerd"),
    ("run-containerd", "/run/containerd"),
    ("cni-bin", "/opt/cni/bin"),
    ("cni-conf", "/etc/cni/net.d"),
    ("run-tether", "/run/tether"),
    ("tether", "/var/lib/tether"),
    ("netns", "/run/netns"),
    ("pod-logs", "/var/log/pods"),
    ("container-logs", "/var/log/containers"),
    ("etc-kubernetes", "/etc/kubernetes"),
];

/// Where the clusters of every process on this machine keep track of the
/// mount points they created (see [`MountPoints`]).
const MOUNT_POINTS_FILE: &str = "tether-test-node-mount-points";
/// The file in every mount point a cluster created (see [`MountPoints`]);
/// inside a node, the bound directory hides it.
const MOUNT_POINT_MARKER: &str = ".tether-test-mount-point";

/// A cluster's hold on the node paths' mount points on the machine (those
/// that did not exist are created, each with a [`MOUNT_POINT_MARKER`] file
/// in it). Every cluster, in any process, holds a shared `flock` on
/// [`MOUNT_POINTS_FILE`] (in the temp dir), which lists the directories
/// created; the last one to let go (it gets the lock exclusively) removes
/// the markers and the directories. Removing one while another cluster
/// runs would take the mounts on it away from that cluster's nodes: the
/// marker keeps anything that removes only empty directories (an older
/// harness, the one-node cluster's clean-up) from doing so.
#[derive(Debug)]
struct MountPoints {
    lock: std::fs::File,
}

impl MountPoints {
    fn hold() -> MountPoints {
        let path = std::env::temp_dir().join(MOUNT_POINTS_FILE);
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .read(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
        // SAFETY: flock on a file we own; no memory is involved.
        let rc = unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_SH) };
        assert_eq!(
            rc,
            0,
            "flock {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        );
        MountPoints { lock }
    }

    fn ensure(&self, path: &Path) {
        let mut missing = Vec::new();
        let mut p = Some(path);
        while let Some(d) = p {
            if d.exists() {
                break;
            }
            missing.push(d.display().to_string());
            p = d.parent();
        }
        std::fs::create_dir_all(path)
            .unwrap_or_else(|e| panic!("creating the mount point {}: {e}", path.display()));
        if !missing.is_empty() {
            std::fs::write(path.join(MOUNT_POINT_MARKER), "")
                .unwrap_or_else(|e| panic!("marking the mount point {}: {e}", path.display()));
        }
        // Shallowest first, so that removal in reverse order goes deepest
        // first; one append each, whole lines.
        for d in missing.iter().rev() {
            let _ = (&self.lock).write_all(format!("{d}\n").as_bytes());
        }
    }
}

impl Drop for MountPoints {
    fn drop(&mut self) {
        let fd = self.lock.as_raw_fd();
        // SAFETY: as in hold().
        let last = unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } == 0;
        if !last {
            return;
        }
        let mut listed = String::new();
        let _ = (&self.lock).seek(SeekFrom::Start(0));
        let _ = (&self.lock).read_to_string(&mut listed);
        for d in listed.lines().rev() {
            let _ = std::fs::remove_file(Path::new(d).join(MOUNT_POINT_MARKER));
            let _ = std::fs::remove_dir(d);
        }
        let _ = self.lock.set_len(0);
    }
}

/// One kubelet node (see the module doc).
#[derive(Debug)]
pub struct KubeNode {
    name: String,
    underlay: Underlay,
    /// The cluster's families.
    stack: Stack,
    /// `unshare`, whose one child is `node_init`.
    init: Option<Child>,
    /// `node_init`'s PID as this machine sees it.
    init_pid: i32,
    containerd: Option<Child>,
    /// containerd's sandbox (pause) image
    /// ([`Topology::sandbox_image`](crate::topology::Topology::sandbox_image)).
    sandbox_image: String,
    kubelet: Option<Child>,
    proxy: Option<Child>,
    // Dropped after the processes: the netns, then the dir.
    netns: Netns,
    /// The node's own paths beyond [`NODE_PATHS`]
    /// ([`Topology::kubevirt`](crate::topology::Topology::kubevirt)).
    extra_paths: Vec<(String, String)>,
    dir: TempDir,
}

impl KubeNode {
    /// Creates the node's namespaces and its directories, and starts its
    /// init; nothing else runs yet.
    fn create(
        fabric: &Fabric,
        host: u8,
        mount_points: &MountPoints,
        extra_paths: &[(String, String)],
        sandbox_image: &str,
        stack: Stack,
    ) -> KubeNode {
        let netns = Netns::new("kn");
        let underlay = fabric.attach_host(&netns, host.into());
        let dir = TempDir::new("kn");
        let name = netns.name().to_string();
        let mut binds = Vec::new();
        let paths = NODE_PATHS
            .iter()
            .map(|(s, t)| (*s, *t))
            .chain(extra_paths.iter().map(|(s, t)| (s.as_str(), t.as_str())));
        for (src, target) in paths {
            let src = dir.path().join(src);
            std::fs::create_dir_all(&src).expect("creating a node dir");
            mount_points.ensure(Path::new(target));
            binds.push(format!("{}:{target}", src.display()));
        }
        let staging = dir.path().join("root");
        std::fs::create_dir_all(&staging).expect("creating the node's staging dir");
        let ready = dir.path().join("init.ready");
        let (log, err) = crate::log_outputs(&dir.path().join("init.log"));
        let mut init = Command::new("nsenter")
            .arg(format!("--net={}", netns.path().display()))
            .args([
                "unshare",
                "--mount",
                "--pid",
                "--fork",
                "--mount-proc",
                "--propagation",
                "private",
            ])
            .arg(bin_dir().join("node_init"))
            .arg(&ready)
            .arg(&staging)
            .args(&binds)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .expect("spawning the node's init");
        let up = wait_until(Duration::from_secs(10), || ready.exists());
        if !up {
            let _ = init.kill();
            let _ = init.wait();
            panic!(
                "node {name}'s init did not come up\n{}",
                crate::log_tail(&dir.path().join("init.log"), 20)
            );
        }
        let init_pid = child_of(init.id() as i32).expect("node_init's PID (unshare's child)");
        let node = KubeNode {
            name,
            underlay,
            stack,
            init: Some(init),
            init_pid,
            containerd: None,
            sandbox_image: sandbox_image.to_string(),
            kubelet: None,
            proxy: None,
            netns,
            extra_paths: extra_paths.to_vec(),
            dir,
        };
        // The loopback plugin: containerd's CRI sets up every sandbox's lo.
        std::fs::copy("/usr/lib/cni/loopback", node.path("cni-bin/loopback"))
            .expect("installing the loopback plugin");
        // The node's resolver: the fabric's gateway, where no DNS server
        // answers (see the module doc).
        let gateway = if stack.has_v4() {
            IpAddr::V4(GATEWAY_V4)
        } else {
            IpAddr::V6(GATEWAY_V6)
        };
        std::fs::write(node.path("resolv.conf"), format!("nameserver {gateway}\n"))
            .expect("writing the node's resolv.conf");
        node
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    /// The node's name (the kubelet's `--hostname-override`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The node's netns (containerd, the kubelet, host-network pods).
    pub fn netns(&self) -> &Netns {
        &self.netns
    }

    /// The node's address on the fabric (its InternalIP).
    pub fn underlay(&self) -> &Underlay {
        &self.underlay
    }

    /// Where the node's own `<standard path>` is, as this machine sees it
    /// (`/var/lib/tether` → `<node dir>/tether`).
    pub fn host_path(&self, standard: &str) -> PathBuf {
        let src = NODE_PATHS
            .iter()
            .map(|(s, t)| (*s, *t))
            .chain(
                self.extra_paths
                    .iter()
                    .map(|(s, t)| (s.as_str(), t.as_str())),
            )
            .find(|(_, t)| *t == standard)
            .map(|(s, _)| s.to_string())
            .unwrap_or_else(|| panic!("{standard} is not one of the node's own paths"));
        self.path(&src)
    }

    /// A command run inside all the node's namespaces (net, mount, PID).
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("nsenter");
        c.arg("-t")
            .arg(self.init_pid.to_string())
            .args(["--net", "--mount", "--pid", "--"])
            .arg(program);
        c
    }

    /// Runs `argv` on the node and returns its output.
    pub fn run(&self, argv: &[&str]) -> Output {
        self.command(argv[0])
            .args(&argv[1..])
            .output()
            .unwrap_or_else(|e| panic!("running {argv:?} on {}: {e}", self.name))
    }

    /// Spawns `program` on the node, logging to `<name>.log`.
    fn spawn(&self, name: &str, program: &Path, args: &[String]) -> Child {
        let (log, err) = crate::log_outputs(&self.path(&format!("{name}.log")));
        self.command(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {} on {}: {e}", program.display(), self.name))
    }

    /// The processes named `comm` whose PID namespace is this node's (so
    /// also those of `hostPID` pods, tetherd's among them), by their PIDs
    /// as this machine sees them.
    pub fn pids_named(&self, comm: &str) -> Vec<i32> {
        let ns_of = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok();
        let Some(own) = ns_of(&self.init_pid.to_string()) else {
            return Vec::new();
        };
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        let mut pids: Vec<i32> = entries
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                let pid: i32 = name.parse().ok()?;
                let c = std::fs::read_to_string(format!("/proc/{name}/comm")).ok()?;
                (c.trim_end() == comm && ns_of(&name).as_ref() == Some(&own)).then_some(pid)
            })
            .collect();
        pids.sort_unstable();
        pids
    }

    /// The netns of the container `container_id` (a pod's, as the API's
    /// `containerStatuses[].containerID` names it without its
    /// `containerd://`), named on this machine ([`Netns::attach`]): the
    /// node's containerd made it inside the node's mount namespace, where
    /// this machine's `ip netns` cannot see it. Found by the task's PID in
    /// the node (`ctr task ls`), that PID's netns as the node's `/proc`
    /// shows it, and a process of this machine's `/proc` in that netns.
    pub fn container_netns(&self, container_id: &str) -> Netns {
        let out = self.ctr(&["task", "ls"]);
        let tasks = String::from_utf8_lossy(&out.stdout).into_owned();
        let inner: i32 = tasks
            .lines()
            .find_map(|l| {
                let mut f = l.split_whitespace();
                (f.next() == Some(container_id)).then(|| f.next()?.parse().ok())?
            })
            .unwrap_or_else(|| {
                panic!(
                    "no task {container_id} in {}'s containerd:\n{tasks}",
                    self.name
                )
            });
        let link = format!("/proc/{}/root/proc/{inner}/ns/net", self.init_pid);
        let ino = std::fs::metadata(&link)
            .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
            .unwrap_or_else(|e| panic!("{link} (task {container_id} on {}): {e}", self.name));
        let pid = std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .find(|pid| {
                std::fs::metadata(format!("/proc/{pid}/ns/net"))
                    .is_ok_and(|m| std::os::unix::fs::MetadataExt::ino(&m) == ino)
            })
            .unwrap_or_else(|| panic!("no process in the netns of task {container_id}"));
        Netns::attach("pod", pid)
    }

    /// The last lines of `<name>.log` (containerd, kubelet, kube-proxy).
    pub fn log_tail(&self, name: &str) -> String {
        crate::log_tail(&self.path(&format!("{name}.log")), 40)
    }

    /// `ctr -n k8s.io` against the node's containerd.
    pub fn ctr(&self, args: &[&str]) -> Output {
        self.command("ctr")
            .args(["-n", "k8s.io"])
            .args(args)
            .output()
            .expect("running ctr")
    }

    /// Starts containerd and waits until it answers.
    pub fn start_containerd(&mut self) {
        assert!(self.containerd.is_none(), "containerd already runs");
        let config = containerd_config(&ContainerdPaths {
            root: "/var/lib/containerd".into(),
            state: "/run/containerd".into(),
            socket: "/run/containerd/containerd.sock".into(),
            cni_bin: "/opt/cni/bin".into(),
            cni_conf: "/etc/cni/net.d".into(),
            runc_root: "/run/containerd/runc".into(),
        })
        .replace(crate::kubelet::PAUSE_IMAGE, &self.sandbox_image);
        std::fs::write(self.path("containerd.toml"), config).expect("writing containerd's config");
        let args = vec![
            "--config".to_string(),
            self.path("containerd.toml").display().to_string(),
        ];
        self.containerd = Some(self.spawn(
            "containerd",
            Path::new(crate::kubelet::CONTAINERD_BIN),
            &args,
        ));
        let up = wait_until(Duration::from_secs(30), || {
            self.ctr(&["version"]).status.success()
        });
        assert!(
            up,
            "containerd on {} did not answer in 30 s\n{}",
            self.name,
            self.log_tail("containerd")
        );
    }

    /// Stops containerd (SIGTERM, then waits): its containers' shims and
    /// tasks keep running, as on a real node.
    pub fn stop_containerd(&mut self) {
        if let Some(c) = self.containerd.take() {
            stop_entered(c);
        }
    }

    /// tetherd's socket as this machine sees it (the chart's default,
    /// `/run/tether/tether.sock`, on the node).
    pub fn tether_socket(&self) -> PathBuf {
        self.host_path("/run/tether").join("tether.sock")
    }

    /// Imports an OCI archive into the node's containerd (CRI namespace).
    pub fn import(&self, archive: &Path) {
        let out = self.ctr(&["images", "import", &archive.display().to_string()]);
        assert!(
            out.status.success(),
            "ctr images import {} on {}: {}",
            archive.display(),
            self.name,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Starts the kubelet with a client certificate of `system:node:<name>`.
    pub fn start_kubelet(&mut self, api: &KubeApi) {
        assert!(self.kubelet.is_none(), "the kubelet already runs");
        let mut config = kubelet_config(Path::new("/run/containerd/containerd.sock"));
        // The primary family's: a kubelet gives pods one (as kubeadm's
        // dual-stack clusters do).
        config["clusterDNS"] = json!([self.stack.cluster_dns()[0]]);
        config["clusterDomain"] = json!(CLUSTER_DOMAIN);
        config["resolvConf"] = json!(self.path("resolv.conf").display().to_string());
        std::fs::write(self.path("kubelet.json"), config.to_string())
            .expect("writing the kubelet's config");
        let kubeconfig = api.cert_kubeconfig(
            &format!("node-{}", self.name),
            &format!("/O=system:nodes/CN=system:node:{}", self.name),
        );
        let args = vec![
            format!("--config={}", self.path("kubelet.json").display()),
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--hostname-override={}", self.name),
            format!(
                "--node-ip={}",
                Stack::joined(&self.stack.addresses(&self.underlay))
            ),
            "--v=2".into(),
        ];
        self.kubelet = Some(self.spawn("kubelet", &k8s_bin_dir().join("kubelet"), &args));
    }

    /// Stops the kubelet (SIGTERM, then waits); pods keep running.
    pub fn stop_kubelet(&mut self) {
        if let Some(c) = self.kubelet.take() {
            stop_entered(c);
        }
    }

    /// Starts kube-proxy in iptables mode, as a kubeadm node runs it (it
    /// leaves `nf_conntrack_max` alone: read-only in a netns).
    fn start_proxy(&mut self, api: &KubeApi) {
        let kubeconfig =
            api.cert_kubeconfig(&format!("proxy-{}", self.name), "/CN=system:kube-proxy");
        let args = vec![
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--hostname-override={}", self.name),
            "--proxy-mode=iptables".into(),
            format!("--cluster-cidr={}", Stack::joined(&self.stack.pod_cidrs())),
            "--conntrack-max-per-core=0".into(),
            "--metrics-bind-address=127.0.0.1:10249".into(),
            "--healthz-bind-address=127.0.0.1:10256".into(),
        ];
        self.proxy = Some(self.spawn("kube-proxy", &k8s_bin_dir().join("kube-proxy"), &args));
    }

    fn teardown(&mut self) {
        for c in [
            self.proxy.take(),
            self.kubelet.take(),
            self.containerd.take(),
        ]
        .into_iter()
        .flatten()
        {
            stop_entered(c);
        }
        if let Some(mut init) = self.init.take() {
            // SAFETY: kill has no memory preconditions; the PID is this
            // node's init (our child's child).
            unsafe {
                libc::kill(self.init_pid, libc::SIGTERM);
            }
            let deadline = Instant::now() + Duration::from_secs(15);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = init.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            // SAFETY: as above.
            unsafe {
                libc::kill(self.init_pid, libc::SIGKILL);
            }
            let _ = init.wait();
        }
    }
}

impl Drop for KubeNode {
    fn drop(&mut self) {
        self.teardown();
    }
}

/// The first child of `pid` (`/proc/<pid>/task/<pid>/children`).
fn child_of(pid: i32) -> Option<i32> {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        let children =
            std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
        if let Some(c) = children
            .split_whitespace()
            .next()
            .and_then(|c| c.parse().ok())
        {
            return Some(c);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

/// Stops a process started through `nsenter --pid` (which forks it and
/// waits): SIGTERM to the process itself, then `nsenter` exits with it.
fn stop_entered(c: Child) {
    if let Some(inner) = child_of(c.id() as i32) {
        // SAFETY: kill has no memory preconditions; the PID is our child's
        // child, which it waits for (so it cannot be reused before).
        unsafe {
            libc::kill(inner, libc::SIGTERM);
        }
    }
    terminate(c);
}

/// The cluster (see the module doc).
#[derive(Debug)]
pub struct KubeCluster {
    sysctls: SavedSysctls,
    controller_manager: Option<Child>,
    scheduler: Option<Child>,
    nodes: Vec<KubeNode>,
    /// The API server (and its etcd), with kubectl.
    pub api: KubeApi,
    helm: Helm,
    fabric: Fabric,
    mount_points: MountPoints,
    dir: TempDir,
    /// Chart values over [`KubeCluster::tether_values`]' own, for every
    /// install and upgrade ([`KubeCluster::set_chart_values`]).
    chart_values: Value,
    /// The cluster's families.
    stack: Stack,
}

impl KubeCluster {
    /// Starts the control plane and `nodes` nodes (containerd with the
    /// images, kubelet, kube-proxy), and waits until every node is
    /// registered (NotReady until tether is installed). Through
    /// [`Topology::kubelet`](crate::topology::Topology::kubelet).
    pub(crate) fn start(nodes: usize, opts: Kubelet) -> KubeCluster {
        let bins = k8s_bin_dir();
        let fabric = Fabric::new();
        let stack = opts.stack;
        let api = KubeApi::start_with(&fabric, opts.aggregating, stack);
        let helm = Helm::against(&api);
        let mut cluster = KubeCluster {
            sysctls: SavedSysctls::save(),
            controller_manager: None,
            scheduler: None,
            nodes: Vec::new(),
            api,
            helm,
            fabric,
            mount_points: MountPoints::hold(),
            dir: TempDir::new("kc"),
            chart_values: Value::Null,
            stack,
        };
        let admin = cluster.api.admin_kubeconfig().display().to_string();
        let d = cluster.api.dir().to_path_buf();
        let mut kcm = vec![
            format!("--kubeconfig={admin}"),
            // Every default controller (Deployments, EndpointSlices,
            // namespaces, garbage collection, service accounts, ...).
            "--controllers=*".to_string(),
            format!(
                "--service-cluster-ip-range={}",
                Stack::joined(&stack.service_cidrs())
            ),
            format!(
                "--service-account-private-key-file={}",
                d.join("sa.key").display()
            ),
            "--use-service-account-credentials=true".to_string(),
            "--leader-elect=false".to_string(),
            format!("--cert-dir={}", d.join("kcm-certs").display()),
            format!("--root-ca-file={}", cluster.api.ca_cert().display()),
            // The API server's node-status grace: nodes that stop
            // reporting become NotReady.
            "--node-monitor-grace-period=20s".to_string(),
        ];
        if opts.node_cidrs {
            kcm.extend([
                "--allocate-node-cidrs=true".to_string(),
                format!("--cluster-cidr={}", Stack::joined(&stack.pod_cidrs())),
            ]);
            // A family's mask-size flag is refused on a cluster without
            // that family (the controller manager exits).
            let (v4, v6) = crate::stack::NODE_CIDR_SIZES;
            if stack.has_v4() {
                kcm.push(format!("--node-cidr-mask-size-ipv4={v4}"));
            }
            if stack.has_v6() {
                kcm.push(format!("--node-cidr-mask-size-ipv6={v6}"));
            }
        }
        let kcm: Vec<&str> = kcm.iter().map(String::as_str).collect();
        cluster.controller_manager = Some(cluster.api.spawn(
            "kube-controller-manager",
            &bins.join("kube-controller-manager"),
            &kcm,
        ));
        cluster.scheduler = Some(cluster.api.spawn(
            "kube-scheduler",
            &bins.join("kube-scheduler"),
            &[
                &format!("--kubeconfig={admin}"),
                "--leader-elect=false",
                &format!("--cert-dir={}", d.join("sched-certs").display()),
            ],
        ));
        let images_dir = cluster.dir.path().join("images");
        std::fs::create_dir_all(&images_dir).expect("creating the images dir");
        let mut images = crate::kubelet::busybox_images(&images_dir);
        images.extend(opts.images.iter().cloned());
        for i in 0..nodes {
            let host = FIRST_NODE_HOST + i as u8;
            let mut node = KubeNode::create(
                &cluster.fabric,
                host,
                &cluster.mount_points,
                &opts.node_paths,
                &opts.sandbox_image,
                stack,
            );
            node.start_containerd();
            for image in &images {
                node.import(image);
            }
            if opts.kubevirt {
                crate::kubevirt::open_tun(&node);
                crate::kubevirt::add_repo_digests(&node);
            }
            node.start_proxy(&cluster.api);
            node.start_kubelet(&cluster.api);
            cluster.nodes.push(node);
        }
        for node in &cluster.nodes {
            let registered =
                wait_until(READY, || cluster.api.get(&["node", node.name()]).is_some());
            assert!(
                registered,
                "the kubelet did not register node {} in {READY:?}\n{}",
                node.name(),
                node.log_tail("kubelet")
            );
        }
        // A controller manager that refused its flags has exited by now;
        // without it no DaemonSet pod is ever made.
        if let Some(Ok(Some(status))) = cluster.controller_manager.as_mut().map(Child::try_wait) {
            panic!(
                "kube-controller-manager exited ({status})\n{}",
                crate::log_tail(&cluster.api.dir().join("kube-controller-manager.log"), 20)
            );
        }
        // The API server reaches pod IPs through the first node.
        let vias = stack.addresses(cluster.nodes[0].underlay());
        for (cidr, via) in stack.pod_cidrs().iter().zip(vias) {
            cluster
                .api
                .netns()
                .exec_ok(&["ip", "route", "add", cidr, "via", &via.to_string()]);
        }
        if stack.has_v6() {
            cluster.route_v6_control_plane_untracked();
        }
        cluster
    }

    /// The API server's IPv6 packets to pods on the other nodes cross the
    /// first node, their replies do not (the other node has the server
    /// on its link): the first node's conntrack sees one direction, so
    /// the server's ACKs after the handshake are INVALID there, and
    /// kube-proxy's `KUBE-FORWARD` drops INVALID packets. Over IPv4 the
    /// first node's ICMP redirect sends the server straight to the other
    /// node after one packet; IPv6 redirects name a link-local target,
    /// and tether routes the other nodes' pods via their global
    /// addresses, so none is sent. The first node therefore forwards the
    /// server's packets that leave it again onto the fabric untracked
    /// (an nft table of the test's own in the node's netns), as a
    /// router between the two would; its own pods' traffic with the
    /// server stays tracked.
    fn route_v6_control_plane_untracked(&self) {
        let node = &self.nodes[0];
        let Some(api) = self.api.addresses().iter().find(|a| a.is_ipv6()) else {
            return;
        };
        let rules = format!(
            "table ip6 tether_test_control_plane {{\n\
             \tchain prerouting {{\n\
             \t\ttype filter hook prerouting priority raw; policy accept;\n\
             \t\tip6 saddr {api} fib daddr oif \"{}\" notrack\n\
             \t}}\n\
             }}\n",
            node.underlay().ifname
        );
        let mut nft = node
            .command("nft")
            .args(["-f", "-"])
            .stdin(Stdio::piped())
            .spawn()
            .expect("running nft in the first node");
        nft.stdin
            .take()
            .expect("nft's stdin")
            .write_all(rules.as_bytes())
            .expect("writing nft's rules");
        let status = nft.wait().expect("waiting for nft");
        assert!(
            status.success(),
            "nft -f in the first node failed:\n{rules}"
        );
    }

    /// The cluster's families ([`Topology::stack`](crate::topology::Topology::stack)).
    pub fn stack(&self) -> Stack {
        self.stack
    }

    /// The nodes.
    pub fn nodes(&self) -> &[KubeNode] {
        &self.nodes
    }

    /// The fabric the nodes and the control plane are on.
    pub fn fabric(&self) -> &Fabric {
        &self.fabric
    }

    /// The cluster's scratch directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Builds tether's image from this build's binaries (tag `tag`) and
    /// imports it into every node.
    pub fn build_tether_image(&self, tag: &str) -> String {
        let images = self.dir.path().join("images");
        std::fs::create_dir_all(&images).expect("creating the images dir");
        let (name, archive) = tether_image(&images, tag, tag);
        for node in &self.nodes {
            node.import(&archive);
        }
        name
    }

    /// The chart's values: its default mode (the Kubernetes store), the
    /// cluster CIDRs of the stack ([`Stack::pod_cidrs`]), the chart's
    /// default hostPaths (the nodes' own), `image` with `pullPolicy:
    /// Never`, and the Service ranges left out of outbound NAT (on an
    /// IPv6-only cluster, the metrics address in brackets, as the chart
    /// asks); then, over them, those of [`KubeCluster::set_chart_values`].
    pub fn tether_values(&self, image: &str) -> Value {
        let (repository, tag) = image
            .rsplit_once(':')
            .unwrap_or_else(|| panic!("{image} has no tag"));
        let mut values = json!({
            "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
            "cluster": {"cidrs": self.stack.pod_cidrs()},
            "outboundNat": {"enabled": true, "noNatTo": self.stack.service_cidrs()},
        });
        if !self.stack.has_v4() {
            values["metrics"] = json!({"address": "[$(HOST_IP)]"});
        }
        merge_values(&mut values, &self.chart_values);
        values
    }

    /// Chart values for the installs and upgrades that follow, over the
    /// harness's own (objects merged key by key, anything else replaced):
    /// a suite's `mode` or `netconf`, say.
    pub fn set_chart_values(&mut self, values: Value) {
        self.chart_values = values;
    }

    /// `helm install` of the chart with [`KubeCluster::tether_values`],
    /// then waits until every node is Ready (its conflist is in place).
    pub fn install_tether(&self, image: &str) {
        let values = self.helm.values_file("install", &self.tether_values(image));
        self.helm.run_ok(&[
            "install",
            chart::RELEASE,
            chart::CHART,
            "--namespace",
            chart::NAMESPACE,
            "--values",
            &values.display().to_string(),
        ]);
        for node in &self.nodes {
            let ready = wait_until(READY, || self.node_ready(node.name()));
            assert!(
                ready,
                "node {} not Ready in {READY:?} after tether's install\n{}\n{}",
                node.name(),
                self.api
                    .kubectl(&["-n", "kube-system", "get", "pods", "-o", "wide"])
                    .stdout
                    .iter()
                    .map(|b| *b as char)
                    .collect::<String>(),
                node.log_tail("kubelet")
            );
        }
    }

    /// `helm upgrade` of the release to `image` (the same values
    /// otherwise) plus `sets` (`--set`).
    pub fn upgrade_tether(&self, image: &str, sets: &[&str]) {
        let values = self.helm.values_file("upgrade", &self.tether_values(image));
        let values = values.display().to_string();
        let mut args = vec![
            "upgrade",
            chart::RELEASE,
            chart::CHART,
            "--namespace",
            chart::NAMESPACE,
            "--values",
            &values,
        ];
        for s in sets {
            args.extend(["--set", s]);
        }
        self.helm.run_ok(&args);
    }

    /// `helm uninstall` of the release (it does not wait for the pods).
    pub fn uninstall_tether(&self) {
        self.helm
            .run_ok(&["uninstall", chart::RELEASE, "--namespace", chart::NAMESPACE]);
    }

    /// Whether node `name`'s Ready condition is True.
    pub fn node_ready(&self, name: &str) -> bool {
        self.ready_condition(name).0 == "True"
    }

    /// Node `name`'s Ready condition: its status ("True", "False",
    /// "Unknown"; empty before the kubelet reports one) and message.
    pub fn ready_condition(&self, name: &str) -> (String, String) {
        let node = self.api.get(&["node", name]).unwrap_or(Value::Null);
        node["status"]["conditions"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["type"] == "Ready"))
            .map(|c| {
                (
                    c["status"].as_str().unwrap_or("").to_string(),
                    c["message"].as_str().unwrap_or("").to_string(),
                )
            })
            .unwrap_or_default()
    }

    /// Waits until node `name` is Ready; panics with its condition and
    /// its kubelet's log otherwise.
    pub fn wait_node_ready(&self, name: &str) {
        let ok = wait_until(READY, || self.node_ready(name));
        assert!(
            ok,
            "node {name} not Ready in {READY:?}: {:?}\n{}",
            self.ready_condition(name),
            self.node_named(name).log_tail("kubelet")
        );
    }

    /// Every node's routes and tether's pods' latest log lines, for a
    /// failure's message.
    pub fn network_view(&self) -> String {
        let mut text = String::new();
        let mut section = |title: &str, out: Output| {
            text.push_str(&format!("--- {title} ---\n{}", crate::output_text(&out)));
        };
        for node in &self.nodes {
            let routes = node.netns().exec(&["ip", "route", "show"]);
            section(&format!("routes of {}", node.name()), routes);
        }
        let logs = self.api.kubectl(&[
            "-n",
            "kube-system",
            "logs",
            "-l",
            "app.kubernetes.io/name=tether",
            "-c",
            "tetherd",
            "--prefix",
            "--tail=80",
        ]);
        section("tetherd logs", logs);
        let objects = self.api.kubectl(&[
            "get",
            "addressblocks,tethernodes,leases",
            "-A",
            "-o",
            "wide",
        ]);
        section("tether's objects", objects);
        text
    }

    /// Deploys CoreDNS as kubeadm does (`tests/k8s/coredns.yaml`, with
    /// `image`) and waits until its Deployment is available.
    pub fn deploy_coredns(&self, image: &str) {
        let manifest =
            std::fs::read_to_string(crate::workspace_dir().join("tests/k8s/coredns.yaml"))
                .expect("reading tests/k8s/coredns.yaml")
                .replace("@IMAGE@", image)
                .replace("@CLUSTER_DNS@", self.stack.cluster_dns()[0])
                .replace("@CLUSTER_DNS_ALL@", &self.stack.cluster_dns().join(", "))
                .replace(
                    "@DNS_FAMILY_POLICY@",
                    if self.stack == Stack::Dual {
                        "RequireDualStack"
                    } else {
                        "SingleStack"
                    },
                )
                .replace("@CLUSTER_DOMAIN@", CLUSTER_DOMAIN);
        self.api.apply(&manifest);
        let out = self.api.kubectl(&[
            "-n",
            "kube-system",
            "rollout",
            "status",
            "deployment/coredns",
            "--timeout=180s",
        ]);
        assert!(
            out.status.success(),
            "CoreDNS not available: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(
                &self
                    .api
                    .kubectl(&["-n", "kube-system", "get", "pods", "-o", "wide"])
                    .stdout
            )
        );
    }

    fn teardown(&mut self) {
        // No pod is deleted first: ending a node ends its pods, their
        // netns and links with its namespaces, and tether's records live
        // in this run's API server.
        for node in self.nodes.iter_mut() {
            node.stop_kubelet();
        }
        self.nodes.clear();
        for c in [self.controller_manager.take(), self.scheduler.take()]
            .into_iter()
            .flatten()
        {
            terminate(c);
        }
        self.sysctls.restore();
    }
}

impl Drop for KubeCluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for node in &self.nodes {
                eprintln!(
                    "harness: node {}:\n{}\n{}",
                    node.name(),
                    node.log_tail("kubelet"),
                    node.log_tail("containerd")
                );
            }
        }
        self.teardown();
    }
}

/// A running pod of a [`KubeCluster`] whose netns this machine can enter
/// (the streams of [`crate::paths`] run there; a QEMU guest can run on
/// its tap).
#[derive(Debug)]
pub struct KubePod {
    /// Its name, in namespace `default`.
    pub name: String,
    /// The node it runs on.
    pub node: String,
    /// Its address (the pod's `status.podIP`: of the cluster's first
    /// family).
    pub ip: IpAddr,
    /// Every address it has, one per family of the cluster, `ip` first
    /// (`status.podIPs`).
    pub ips: Vec<IpAddr>,
    netns: Netns,
}

impl KubePod {
    /// Its netns, named on this machine (the name goes on drop, the
    /// netns with the pod).
    pub fn netns(&self) -> &Netns {
        &self.netns
    }

    /// Its IPv6 address on a dual-stack cluster (the second of
    /// `status.podIPs`).
    pub fn ip6(&self) -> Option<IpAddr> {
        self.ips.get(1).copied()
    }

    /// The pod as a place streams run from (IPv4, and IPv6 on a
    /// dual-stack cluster).
    pub fn place(&self) -> Place<'_> {
        Place {
            netns: &self.netns,
            v4: self.ip,
            v6: self.ip6(),
        }
    }

    /// The MAC of the pod's `eth0` (what KubeVirt gives a `tap` binding's
    /// domain).
    pub fn eth0_mac(&self) -> String {
        self.netns
            .exec_ok(&["cat", "/sys/class/net/eth0/address"])
            .trim()
            .to_string()
    }
}

/// How long a pod may take to run.
const POD_RUNNING: Duration = Duration::from_secs(120);

impl KubeCluster {
    /// The node named `name`.
    pub fn node_named(&self, name: &str) -> &KubeNode {
        self.nodes
            .iter()
            .find(|n| n.name() == name)
            .unwrap_or_else(|| panic!("no node {name}"))
    }

    /// Waits until pod `default/name` runs with an IP; the pod.
    pub fn wait_running(&self, name: &str) -> Value {
        let mut pod = Value::Null;
        let ok = wait_until(POD_RUNNING, || {
            pod = self
                .api
                .get(&["-n", "default", "pod", name])
                .unwrap_or(Value::Null);
            pod["status"]["phase"] == "Running"
                && pod["status"]["podIP"]
                    .as_str()
                    .is_some_and(|ip| !ip.is_empty())
        });
        assert!(
            ok,
            "pod {name} not running in {POD_RUNNING:?}: {}",
            String::from_utf8_lossy(
                &self
                    .api
                    .kubectl(&["-n", "default", "describe", "pod", name])
                    .stdout
            )
        );
        pod
    }

    /// What the nodes' and the running pods' networks look like, for a
    /// failure's report: each node's routes and neighbours (of the
    /// cluster's families), tether's nft tables and its UDP flows in
    /// conntrack; each running pod's (not kube-system's, not
    /// host-network) addresses, routes, neighbours and UDP sockets. Best
    /// effort: what cannot be read says why.
    pub fn network_state(&self) -> String {
        let run = |ns: &Netns, argv: &[&str]| {
            let out = ns.exec(argv);
            let text = crate::output_text(&out);
            let lines: Vec<&str> = text.lines().collect();
            let shown = lines.len().min(60);
            let mut s = format!("$ {}\n{}\n", argv.join(" "), lines[..shown].join("\n"));
            if lines.len() > shown {
                s += &format!("({} more lines)\n", lines.len() - shown);
            }
            s
        };
        let families: Vec<&str> = [(self.stack.has_v4(), "-4"), (self.stack.has_v6(), "-6")]
            .into_iter()
            .filter_map(|(has, flag)| has.then_some(flag))
            .collect();
        let mut out = String::new();
        for node in self.nodes() {
            out += &format!("=== node {}\n", node.name());
            for f in &families {
                for what in ["route", "neigh"] {
                    out += &run(node.netns(), &["ip", f, what]);
                }
            }
            for argv in [
                &["nft", "list", "table", "inet", "tether"][..],
                &["conntrack", "-L", "-p", "udp"],
            ] {
                out += &run(node.netns(), argv);
            }
        }
        let pods = self.api.get(&["pods", "-A"]).unwrap_or_default();
        for pod in pods["items"].as_array().into_iter().flatten() {
            let ns = pod["metadata"]["namespace"].as_str().unwrap_or_default();
            let name = pod["metadata"]["name"].as_str().unwrap_or_default();
            let node = pod["spec"]["nodeName"].as_str().unwrap_or_default();
            let id = pod["status"]["containerStatuses"][0]["containerID"]
                .as_str()
                .and_then(|id| id.split_once("://"))
                .map(|(_, id)| id.to_string());
            if ns == "kube-system" || pod["spec"]["hostNetwork"] == true {
                continue;
            }
            let Some(id) = id else { continue };
            let Some(node) = self.nodes().iter().find(|n| n.name() == node) else {
                continue;
            };
            out += &format!(
                "=== pod {ns}/{name} on {} ({})\n",
                node.name(),
                pod["status"]["podIPs"]
            );
            let netns = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                node.container_netns(&id)
            })) {
                Ok(netns) => netns,
                Err(_) => {
                    out += "(its netns could not be found)\n";
                    continue;
                }
            };
            for f in &families {
                for what in ["addr", "route", "neigh"] {
                    out += &run(&netns, &["ip", f, what]);
                }
            }
            out += &run(&netns, &["ss", "-uan"]);
        }
        out
    }

    /// Pod `default/name` once it runs, its netns adopted
    /// ([`KubeNode::container_netns`] of its first container).
    pub fn adopt_pod(&self, name: &str) -> KubePod {
        let pod = self.wait_running(name);
        let node = pod["spec"]["nodeName"].as_str().unwrap_or_default();
        let ip = pod["status"]["podIP"]
            .as_str()
            .and_then(|ip| ip.parse().ok())
            .unwrap_or_else(|| panic!("pod {name} has no IP: {}", pod["status"]));
        let ips = pod["status"]["podIPs"]
            .as_array()
            .map(|ips| {
                ips.iter()
                    .filter_map(|i| i["ip"].as_str()?.parse().ok())
                    .collect()
            })
            .unwrap_or_else(|| vec![ip]);
        let id = pod["status"]["containerStatuses"][0]["containerID"]
            .as_str()
            .and_then(|id| id.split_once("://"))
            .map(|(_, id)| id.to_string())
            .unwrap_or_else(|| panic!("pod {name} has no container: {}", pod["status"]));
        KubePod {
            name: name.to_string(),
            node: node.to_string(),
            ip,
            ips,
            netns: self.node_named(node).container_netns(&id),
        }
    }

    /// Runs a [`crate::kubelet::busybox_pod`] `name` on `node` and adopts it.
    pub fn run_pod(&self, name: &str, node: &str) -> KubePod {
        self.api
            .apply(&crate::kubelet::busybox_pod(name, node).to_string());
        self.adopt_pod(name)
    }

    /// The Service of `spec` ([`KubeApi::expose_through`]), its
    /// endpoints written by hand; waits until every node's kube-proxy has
    /// programmed it and its endpoints. The Service.
    pub fn expose(&self, spec: &ServiceSpec<'_>) -> Value {
        let proxies: Vec<(&str, &Netns)> =
            self.nodes.iter().map(|n| (n.name(), n.netns())).collect();
        self.api
            .expose_through(spec, &proxies, &|i| self.nodes[i].log_tail("kube-proxy"))
    }
}

// ---------------------------------------------------------------------------
// Pods, and tether's DaemonSet, through the API

impl KubeCluster {
    /// Node `i`, to stop or start its containerd or kubelet.
    pub fn node_mut(&mut self, i: usize) -> &mut KubeNode {
        &mut self.nodes[i]
    }

    /// Stops node `i`'s kubelet and starts it again (its pods keep
    /// running meanwhile).
    pub fn restart_kubelet(&mut self, i: usize) {
        let node = &mut self.nodes[i];
        node.stop_kubelet();
        node.start_kubelet(&self.api);
    }

    /// Creates the pod of `manifest` ([`crate::kubelet::busybox_pod`]).
    pub fn create_pod(&self, manifest: &Value) {
        self.api.apply(&manifest.to_string());
    }

    /// The pod `default/name` as JSON, if it exists.
    pub fn pod(&self, name: &str) -> Option<Value> {
        self.api.get(&["-n", "default", "pod", name])
    }

    /// Waits until pod `default/name` runs with an IP; that IP.
    pub fn wait_pod_ip(&self, name: &str) -> String {
        self.wait_running(name)["status"]["podIP"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// Deletes pod `default/name` and waits until it is gone from the API
    /// (its kubelet has stopped it and torn its sandbox down).
    pub fn delete_pod(&self, name: &str) {
        self.api
            .kubectl_ok(&["-n", "default", "delete", "pod", name, "--wait=false"]);
        let gone = wait_until(POD_RUNNING, || self.pod(name).is_none());
        assert!(
            gone,
            "pod {name} not gone in {POD_RUNNING:?}\n{}",
            self.kubelet_logs()
        );
    }

    /// `kubectl exec` in pod `default/name` (through the API server, the
    /// kubelet and containerd's streaming server).
    pub fn exec(&self, name: &str, argv: &[&str]) -> Output {
        let mut args = vec!["-n", "default", "exec", name, "--"];
        args.extend_from_slice(argv);
        self.api.kubectl(&args)
    }

    /// Like [`KubeCluster::exec`]; panics unless it succeeds; its stdout.
    pub fn exec_ok(&self, name: &str, argv: &[&str]) -> String {
        crate::stdout_ok(
            &self.exec(name, argv),
            format_args!("kubectl exec {name} -- {argv:?}"),
        )
    }

    /// Waits until `kubectl exec` into pod `name` works (after a restart of
    /// a kubelet or containerd, the kubelet must first resync the pod).
    pub fn wait_exec(&self, name: &str) {
        let mut last = None;
        let ok = wait_until(POD_RUNNING, || {
            let out = self.exec(name, &["true"]);
            let ok = out.status.success();
            last = Some(out);
            ok
        });
        assert!(
            ok,
            "kubectl exec into {name} does not work: {:?}\n{}",
            last.map(|o| String::from_utf8_lossy(&o.stderr).into_owned()),
            self.kubelet_logs()
        );
    }

    /// A watch on the pods of `default` ([`PodWatch::start`]).
    pub fn watch_pods(&self) -> PodWatch {
        PodWatch::start(&self.api)
    }

    /// Every node's kubelet log's last lines, for a failure's message.
    pub fn kubelet_logs(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("--- kubelet of {} ---\n{}", n.name(), n.log_tail("kubelet")))
            .collect()
    }

    /// tether's DaemonSet pods: (name, phase, ready and not being deleted).
    pub fn tether_pods(&self) -> Vec<(String, String, bool)> {
        let list = self
            .api
            .get(&["-n", "kube-system", "pods", "-l", TETHER_SELECTOR])
            .unwrap_or(Value::Null);
        let items = list["items"].as_array().cloned().unwrap_or_default();
        items
            .iter()
            .map(|p| {
                let ready = p["status"]["conditions"].as_array().is_some_and(|cs| {
                    cs.iter()
                        .any(|c| c["type"] == "Ready" && c["status"] == "True")
                });
                (
                    p["metadata"]["name"].as_str().unwrap_or("").to_string(),
                    p["status"]["phase"].as_str().unwrap_or("").to_string(),
                    ready && p["metadata"]["deletionTimestamp"].is_null(),
                )
            })
            .collect()
    }

    /// Waits until every node runs exactly one tether pod, Ready, with
    /// image `image`; their names, in the nodes' order.
    pub fn wait_tether_ready(&self, image: &str) -> Vec<String> {
        let mut names = Vec::new();
        let ok = wait_until(READY, || {
            let list = self
                .api
                .get(&["-n", "kube-system", "pods", "-l", TETHER_SELECTOR])
                .unwrap_or(Value::Null);
            let items = list["items"].as_array().cloned().unwrap_or_default();
            let ready: Vec<(String, String)> = items
                .iter()
                .filter(|p| {
                    p["status"]["phase"] == "Running"
                        && p["metadata"]["deletionTimestamp"].is_null()
                        && p["spec"]["containers"][0]["image"] == image
                        && p["status"]["conditions"].as_array().is_some_and(|cs| {
                            cs.iter()
                                .any(|c| c["type"] == "Ready" && c["status"] == "True")
                        })
                })
                .map(|p| {
                    (
                        p["spec"]["nodeName"].as_str().unwrap_or("").to_string(),
                        p["metadata"]["name"].as_str().unwrap_or("").to_string(),
                    )
                })
                .collect();
            names = self
                .nodes
                .iter()
                .filter_map(|n| {
                    let mine: Vec<&(String, String)> =
                        ready.iter().filter(|(node, _)| node == n.name()).collect();
                    (mine.len() == 1).then(|| mine[0].1.clone())
                })
                .collect();
            items.len() == self.nodes.len() && names.len() == self.nodes.len()
        });
        assert!(
            ok,
            "tether's DaemonSet pods not Ready with {image} in {READY:?}: {:?}\n{}\n{}\n{}",
            self.tether_pods(),
            self.tether_logs(),
            self.tetherd_view(),
            self.kubelet_logs()
        );
        names
    }

    /// The logs of tether's pods' containers on every node, every run of
    /// each (the files the kubelets keep in their pod logs dirs), for a
    /// failure's message.
    pub fn tether_logs(&self) -> String {
        let mut text = String::new();
        for node in &self.nodes {
            let pods = std::fs::read_dir(node.host_path("/var/log/pods"))
                .into_iter()
                .flatten()
                .flatten()
                .filter(|p| {
                    p.file_name()
                        .to_string_lossy()
                        .starts_with("kube-system_tether-")
                });
            for pod in pods {
                for log in std::fs::read_dir(pod.path())
                    .into_iter()
                    .flatten()
                    .flatten()
                    .flat_map(|c| std::fs::read_dir(c.path()).into_iter().flatten().flatten())
                {
                    text.push_str(&format!("--- {} ---\n", log.path().display()));
                    text.push_str(&crate::log_tail(&log.path(), 40));
                    text.push('\n');
                }
            }
        }
        text
    }

    /// Each node's socket directory as the node sees it and as each
    /// running `tetherd` container sees it (`ctr tasks exec`), and the
    /// readiness probe run by hand in the container, for a failure's
    /// message.
    pub fn tetherd_view(&self) -> String {
        let mut text = String::new();
        for node in &self.nodes {
            let ls = node.run(&["ls", "-la", "/run/tether"]);
            text.push_str(&format!(
                "--- ls -la /run/tether on {} ---\n{}",
                node.name(),
                String::from_utf8_lossy(&ls.stdout)
            ));
            let ids = node.ctr(&[
                "containers",
                "ls",
                "-q",
                "labels.\"io.kubernetes.container.name\"==tetherd",
            ]);
            let probe = "echo '{\"cniVersion\":\"1.1.0\",\"name\":\"diag\",\"type\":\"tether\",\"socket\":\"/run/tether/tether.sock\"}' | CNI_COMMAND=STATUS /tether/tether; echo rc=$?";
            for (n, id) in String::from_utf8_lossy(&ids.stdout)
                .split_whitespace()
                .enumerate()
            {
                for (k, argv) in [
                    vec!["/bin/ls", "-la", "/run/tether"],
                    vec!["/bin/sh", "-c", probe],
                ]
                .into_iter()
                .enumerate()
                {
                    let exec_id = format!("diag{n}x{k}");
                    let mut args = vec!["tasks", "exec", "--exec-id", exec_id.as_str(), id];
                    args.extend(argv.iter().copied());
                    let out = node.ctr(&args);
                    text.push_str(&format!(
                        "--- in tetherd container {id} on {}: {argv:?} ---\n{}",
                        node.name(),
                        crate::output_text(&out)
                    ));
                }
            }
        }
        text
    }
}

/// Merges chart values `over` into `base`: objects key by key, anything
/// else replaced (as helm merges values files).
fn merge_values(base: &mut Value, over: &Value) {
    match (base, over) {
        (_, Value::Null) => {}
        (Value::Object(b), Value::Object(o)) => {
            for (k, v) in o {
                merge_values(b.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (b, o) => *b = o.clone(),
    }
}

/// The ends of the connection paths of [`crate::paths`] on a
/// [`KubeCluster`] of two nodes, around a VM: a host outside the cluster
/// on the fabric, an observer pod on each node, a backend pod on the
/// second node behind a ClusterIP Service, and a NodePort Service whose
/// endpoint is the VM. kube-proxy on the nodes does the Services.
///
/// One backend, not one per node: kube-proxy would pick either at random,
/// and which node the VM's Service flow is translated toward decides what
/// tether does with it (anchored at a source that holds the backend;
/// recreated on a target that does, replacing its forwarding of the
/// flow). With the backend on the second node, a move to it always has
/// the backend on the target, and a move back on the source.
#[derive(Debug)]
pub struct KubePaths {
    /// The host outside the cluster.
    pub outside: Outside,
    /// An observer pod on each node, in the nodes' order.
    pub pods: Vec<KubePod>,
    /// The backends of the ClusterIP the VM streams to.
    pub backends: Vec<KubePod>,
    /// The Services.
    pub services: Services,
}

impl KubePaths {
    /// Starts the pods and the host and makes the Services for the VM at
    /// `vm` (its IPv4 address).
    pub fn start(c: &KubeCluster, vm: IpAddr) -> KubePaths {
        let outside = Outside::on(c.fabric());
        let names: Vec<String> = c.nodes().iter().map(|n| n.name().to_string()).collect();
        for (i, node) in names.iter().enumerate() {
            c.api
                .apply(&crate::kubelet::busybox_pod(&format!("paths-obs{i}"), node).to_string());
        }
        c.api
            .apply(&crate::kubelet::busybox_pod("paths-back1", &names[1]).to_string());
        let pods: Vec<KubePod> = (0..names.len())
            .map(|i| c.adopt_pod(&format!("paths-obs{i}")))
            .collect();
        let backends = vec![c.adopt_pod("paths-back1")];
        let backend_ips: Vec<IpAddr> = backends.iter().map(|b| b.ip).collect();
        let services = Services::create_with(
            &|spec| c.expose(spec),
            ("paths-vm", "paths-backends"),
            vm,
            &backend_ips,
        );
        KubePaths {
            outside,
            pods,
            backends,
            services,
        }
    }

    /// The ends of every path for the VM at `vms` (its addresses, IPv4
    /// first; two on a dual-stack cluster, whose paths then run in both
    /// families where both ends have them) running on node `source` (an
    /// index of the two): the pods on the source and the other node,
    /// NodePorts entering at both, the VM's own connections to the
    /// outside host, to the other node's pod and to the ClusterIP.
    pub fn ends<'a>(&'a self, c: &KubeCluster, vms: &[IpAddr], source: usize) -> Ends<'a> {
        assert_eq!(c.nodes().len(), 2, "the paths here are for two nodes");
        let target = 1 - source;
        let node = |i: usize| Some(IpAddr::V4(c.nodes()[i].underlay().v4));
        Ends {
            vm: (vms[0], vms.get(1).copied()),
            pods: [
                Some(self.pods[source].place()),
                Some(self.pods[target].place()),
                None,
            ],
            nodes: [node(source), node(target), None],
            outside: self.outside.place(),
            peer: self.pods[target].place(),
            services: Some((
                &self.services,
                self.backends.iter().map(|b| b.netns()).collect(),
            )),
        }
    }
}
