//! What every kubelet node of [`crate::kube_cluster`] runs and what its suites
//! use beside it: the kubelet's and containerd's configs, the harness's
//! images (pause and busybox, and tether's own, built from this build's
//! binaries the way install/Containerfile lays it out), pod manifests,
//! a pod watch, and an inotify watch on a node's files.
//!
//! What differs from a production node, and why:
//! - The kubelet, containerd and every container share this machine's
//!   cgroups (v1 here): the kubelet runs with `cgroupsPerQOS: false` and
//!   `failCgroupV1: false`, and containerd with `restrict_oom_score_adj`,
//!   because this machine does not give root `CAP_SYS_RESOURCE` (runc
//!   cannot lower a sandbox's `oom_score_adj` to -998 without it).
//! - No image registry: the images are OCI archives built here
//!   ([`crate::oci`]) and imported with `ctr images import`; pods use
//!   `imagePullPolicy: Never`, and containerd's sandbox image is ours.
//! - In a chroot (`../shared/fresh-machine`), `runc exec` (exec probes,
//!   `kubectl exec`) joins the container's namespaces but lands in the
//!   mount namespace's real root, outside the chroot, not in the
//!   container's root: runc's `pivot_root` from a chroot does not move the
//!   namespace's root. So the suites exec only what behaves the same from
//!   either root (`ip`, `ping`, busybox, in the pod's netns), and tether's
//!   DaemonSet probes readiness over HTTP.
//! - The kubelet sets a few sysctls that are the whole machine's
//!   (`kernel.panic`, `vm.overcommit_memory`, ...): `SavedSysctls` puts
//!   their values from before back.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::kube::{k8s_bin_dir, KubeApi};
use crate::oci::Rootfs;
use crate::workspace_dir;

/// The sandbox (pause) image, built here.
pub const PAUSE_IMAGE: &str = "localhost/tether-test/pause:1";
/// The image of the test pods: busybox, built here.
pub const BUSYBOX_IMAGE: &str = "localhost/tether-test/busybox:1";
/// tether's image, without its tag (`:1`, `:2`, ...).
pub const TETHER_IMAGE: &str = "localhost/tether-test/tether";
/// The label selector of tether's DaemonSet pods (the chart's).
pub const TETHER_SELECTOR: &str = "app.kubernetes.io/name=tether";
/// The one Debian containerd is started from.
pub const CONTAINERD_BIN: &str = "/usr/bin/containerd";
/// The sysctls that are not per netns which the kubelet sets at start
/// (its container manager's kernel tunables: `kernel.panic` 10,
/// `kernel.panic_on_oops` 1, `vm.overcommit_memory` 1, ...); they are
/// put back when the cluster is dropped.
const KUBELET_SYSCTLS: &[&str] = &[
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
];

fn sysctl_path(key: &str) -> PathBuf {
    Path::new("/proc/sys").join(key.replace('.', "/"))
}

/// Builds tether's image `TETHER_IMAGE:<tag>` as an OCI archive in `dir`
/// (see [`crate::kube_cluster::KubeCluster::build_tether_image`]): its files as
/// install/Containerfile lays them out (the plugin, Debian's portmap and
/// the conflist in `/tether`, the installer, the uninstaller and tetherd
/// in `/usr/local/bin`, nft and curl), from the binaries in
/// [`crate::bin_dir`] and the files of install/, on busybox (the
/// installer's shell, the readiness probe's `test`). `marker` is written
/// to `/etc/tether-image`, so that two tags differ. Its name and the
/// archive.
pub(crate) fn tether_image(dir: &Path, tag: &str, marker: &str) -> (String, PathBuf) {
    let name = format!("{TETHER_IMAGE}:{tag}");
    let root = Rootfs::busybox(&dir.join(format!("tether-{tag}")));
    let install = workspace_dir().join("install");
    root.copy(crate::tether_bin(), "tether/tether", 0o755);
    root.copy("/usr/lib/cni/portmap", "tether/portmap", 0o755);
    root.copy(
        install.join("10-tether.conflist"),
        "tether/10-tether.conflist",
        0o644,
    );
    root.copy(
        install.join("install.sh"),
        "usr/local/bin/tether-install",
        0o755,
    );
    root.copy(
        install.join("uninstall.sh"),
        "usr/local/bin/tether-uninstall",
        0o755,
    );
    // The image's curl package: the uninstall container asks the API
    // for the DaemonSet with it.
    root.copy_program("/usr/bin/curl", "bin/curl");
    root.copy_program(crate::tetherd_bin(), "usr/local/bin/tetherd");
    // The image's nftables package: tetherd writes its outbound NAT
    // table with nft (on the image's PATH here).
    root.copy_program("/usr/sbin/nft", "bin/nft");
    let tmp = dir.join(format!("marker-{tag}"));
    std::fs::write(&tmp, marker).expect("writing the image marker");
    root.copy(&tmp, "etc/tether-image", 0o644);
    let archive = dir.join(format!("tether-{tag}.tar"));
    root.pack(&name, &["/usr/local/bin/tetherd"], &archive);
    (name, archive)
}

/// Where a node's containerd keeps its state and finds the CNI plugins.
#[derive(Debug)]
pub(crate) struct ContainerdPaths {
    pub root: PathBuf,
    pub state: PathBuf,
    pub socket: PathBuf,
    pub cni_bin: PathBuf,
    pub cni_conf: PathBuf,
    pub runc_root: PathBuf,
}

/// containerd's config for a test node: its CRI plugin with our sandbox
/// image, the CNI dirs, and runc (see the module doc for
/// `restrict_oom_score_adj`).
pub(crate) fn containerd_config(p: &ContainerdPaths) -> String {
    format!(
        r#"version = 2
root = "{root}"
state = "{state}"
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # This machine does not give root CAP_SYS_RESOURCE: runc cannot set a
  # sandbox's oom_score_adj below containerd's own.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{bin}"
    conf_dir = "{conf}"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
    Root = "{runc}"
"#,
        root = p.root.display(),
        state = p.state.display(),
        sock = p.socket.display(),
        bin = p.cni_bin.display(),
        conf = p.cni_conf.display(),
        runc = p.runc_root.display(),
    )
}

/// The kubelet's config on this machine (cgroup v1 by hand, no systemd),
/// talking to the containerd at `socket`.
pub(crate) fn kubelet_config(socket: &Path) -> Value {
    json!({
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "containerRuntimeEndpoint": format!("unix://{}", socket.display()),
        // This machine: cgroup v1 mounted by hand, no systemd, swap
        // possibly on.
        "failCgroupV1": false,
        "cgroupDriver": "cgroupfs",
        "cgroupsPerQOS": false,
        "enforceNodeAllocatable": ["none"],
        "failSwapOn": false,
        // The API server reaches the kubelet (exec, logs) as an
        // anonymous client: a test cluster.
        "authentication": {"anonymous": {"enabled": true}, "webhook": {"enabled": false}},
        "authorization": {"mode": "AlwaysAllow"},
        "readOnlyPort": 0,
        // The imported images have no registry to come back from.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                         "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
        "nodeStatusUpdateFrequency": "2s",
    })
}

/// The machine-wide sysctls the kubelet sets at start, as they were
/// before: put back by [`SavedSysctls::restore`].
#[derive(Debug)]
pub(crate) struct SavedSysctls(Vec<(&'static str, String)>);

impl SavedSysctls {
    pub(crate) fn save() -> SavedSysctls {
        SavedSysctls(
            KUBELET_SYSCTLS
                .iter()
                .filter_map(|k| Some((*k, std::fs::read_to_string(sysctl_path(k)).ok()?)))
                .collect(),
        )
    }

    pub(crate) fn restore(&self) {
        for (key, value) in &self.0 {
            let path = sysctl_path(key);
            if std::fs::read_to_string(&path).ok().as_deref() != Some(value.as_str()) {
                if let Err(e) = std::fs::write(&path, value.trim()) {
                    eprintln!("harness: cannot restore {key} to {}: {e}", value.trim());
                }
            }
        }
    }
}

/// SIGTERM, then up to 20 s for it to exit, then SIGKILL.
pub(crate) fn terminate(mut c: Child) {
    // SAFETY: kill has no memory preconditions; the PID is our child's.
    unsafe {
        libc::kill(c.id() as i32, libc::SIGTERM);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = c.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = c.kill();
    let _ = c.wait();
}

/// A running `kubectl get pods --watch` ([`PodWatch::start`]).
#[derive(Debug)]
pub struct PodWatch {
    child: Child,
    rx: mpsc::Receiver<(Instant, String)>,
}

impl PodWatch {
    /// A watch on the pods of `default` through `api`'s admin kubeconfig
    /// (`kubectl get pods --watch`, run in the API server's netns): lines
    /// "name phase podIP", each with when it arrived.
    pub fn start(api: &KubeApi) -> PodWatch {
        let mut child = Command::new("ip")
            .args(["netns", "exec", api.netns().name()])
            .arg(k8s_bin_dir().join("kubectl"))
            .arg(format!("--kubeconfig={}", api.admin_kubeconfig().display()))
            .args([
                "-n",
                "default",
                "get",
                "pods",
                "--watch",
                "-o",
                "jsonpath={.metadata.name} {.status.phase} {.status.podIP}{\"\\n\"}",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawning kubectl get --watch");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send((Instant::now(), line)).is_err() {
                    break;
                }
            }
        });
        PodWatch { child, rx }
    }

    /// Waits up to `limit` for a line about pod `name` that `pred` accepts
    /// (its phase and IP); when it arrived.
    pub fn wait_for(
        &self,
        name: &str,
        limit: Duration,
        pred: impl Fn(&str, &str) -> bool,
    ) -> Option<Instant> {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            let (at, line) = self.rx.recv_timeout(left).ok()?;
            let mut f = line.split(' ');
            let (n, phase, ip) = (
                f.next().unwrap_or(""),
                f.next().unwrap_or(""),
                f.next().unwrap_or(""),
            );
            if n == name && pred(phase, ip) {
                return Some(at);
            }
        }
    }
}

impl Drop for PodWatch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Removals of given files, as inotify reports them from the moment the
/// watch is made: a file deleted, or renamed away. (Replacing a file by
/// renaming another over it, as the installer does, is neither.)
#[derive(Debug)]
pub struct Removals {
    fd: std::os::fd::OwnedFd,
    dirs: std::collections::HashMap<i32, PathBuf>,
    files: Vec<PathBuf>,
}

impl Removals {
    /// Starts watching `files` (through their directories).
    pub fn watch(files: &[PathBuf]) -> Removals {
        let mut dirs: Vec<PathBuf> = files
            .iter()
            .map(|f| f.parent().expect("a file in a dir").to_path_buf())
            .collect();
        dirs.sort();
        dirs.dedup();
        use std::os::fd::FromRawFd;
        use std::os::unix::ffi::OsStrExt;
        // SAFETY: inotify_init1 has no memory preconditions.
        let raw = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        assert!(
            raw >= 0,
            "inotify_init1: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: raw is a new descriptor that nothing else owns.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
        let mut map = std::collections::HashMap::new();
        for dir in &dirs {
            let mut c = dir.as_os_str().as_bytes().to_vec();
            c.push(0);
            // SAFETY: c is a NUL-terminated path that outlives the call.
            let wd = unsafe {
                libc::inotify_add_watch(
                    raw,
                    c.as_ptr().cast(),
                    libc::IN_DELETE | libc::IN_MOVED_FROM,
                )
            };
            assert!(
                wd >= 0,
                "inotify_add_watch {}: {}",
                dir.display(),
                std::io::Error::last_os_error()
            );
            map.insert(wd, dir.clone());
        }
        Removals {
            fd,
            dirs: map,
            files: files.to_vec(),
        }
    }

    /// The watched files removed since the last call (or the watch's
    /// start), in order.
    pub fn take(&self) -> Vec<PathBuf> {
        use std::os::fd::AsRawFd;
        let mut removed = Vec::new();
        let mut buf = [0u8; 16384];
        loop {
            // SAFETY: buf is writable for its whole length.
            let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                break;
            }
            let mut off = 0usize;
            let head = std::mem::size_of::<libc::inotify_event>();
            while off + head <= n as usize {
                // SAFETY: the kernel wrote a whole event at off; read_unaligned
                // copes with the byte buffer's alignment.
                let ev: libc::inotify_event =
                    unsafe { std::ptr::read_unaligned(buf[off..].as_ptr().cast()) };
                let name_bytes = &buf[off + head..off + head + ev.len as usize];
                let name = name_bytes.split(|b| *b == 0).next().unwrap_or_default();
                if let Some(dir) = self.dirs.get(&ev.wd) {
                    let path = dir.join(String::from_utf8_lossy(name).as_ref());
                    if self.files.contains(&path) {
                        removed.push(path);
                    }
                }
                off += head + ev.len as usize;
            }
        }
        removed
    }
}

/// A busybox pod `default/name` on node `node` (`spec.nodeName`, no
/// scheduler), that sleeps and exits at once on SIGTERM: the one pod
/// manifest of the harness's suites and benchmarks. A caller that wants
/// labels, annotations or the host's network sets them in the value.
pub fn busybox_pod(name: &str, node: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeName": node,
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 2,
            "containers": [{
                "name": "main",
                "image": BUSYBOX_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", "trap 'exit 0' TERM; sleep 1000000 & wait"],
            }],
        },
    })
}

/// The harness's own pause and busybox images ([`PAUSE_IMAGE`],
/// [`BUSYBOX_IMAGE`]), both made of busybox, packed as image archives in
/// `dir` for a node's containerd to import.
pub fn busybox_images(dir: &Path) -> Vec<PathBuf> {
    [
        (PAUSE_IMAGE, vec!["/bin/sleep", "infinity"], "pause"),
        (BUSYBOX_IMAGE, vec!["/bin/sh"], "busybox"),
    ]
    .into_iter()
    .map(|(name, entry, path)| {
        let root = Rootfs::busybox(&dir.join(path));
        let archive = dir.join(format!("{path}.tar"));
        root.pack(name, &entry, &archive);
        archive
    })
    .collect()
}
