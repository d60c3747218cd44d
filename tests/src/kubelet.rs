//! A one-node Kubernetes on this machine, for the suites that let the
//! kubelet call tether: the API server of [`crate::kube`], plus
//! kube-controller-manager and kube-scheduler (all built from the
//! `k8s.io/kubernetes` module by `tests/k8s/build.sh`), and a node: a netns
//! of its own on the test fabric, where Debian's containerd (1.6, with its
//! CRI plugin) and runc, and the kubelet, run.
//!
//! What differs from a production node, and why:
//! - The kubelet, containerd and every container share this machine's
//!   mount namespace and cgroups (v1 here): the kubelet runs with
//!   `cgroupsPerQOS: false` and `failCgroupV1: false`, and containerd with
//!   `restrict_oom_score_adj`, because this machine does not give root
//!   `CAP_SYS_RESOURCE` (runc cannot lower a sandbox's `oom_score_adj` to
//!   -998 without it).
//! - They enter the node netns with `nsenter --net` only: `ip netns exec`
//!   would give them a private mount namespace and a fresh `/sys`, where the
//!   kubelet finds no cgroup mounts and pod netns pins are invisible to
//!   the others.
//! - No image registry: the images are OCI archives built here
//!   ([`crate::oci`]) and imported with `ctr images import`; pods use
//!   `imagePullPolicy: Never`, and containerd's sandbox image is ours.
//! - No kube-proxy: a pod that talks to the API (tetherd) gets
//!   `KUBERNETES_SERVICE_HOST` pointing at the server itself.
//! - In a chroot (`../shared/fresh-machine`), `runc exec` (exec probes,
//!   `kubectl exec`) joins the container's namespaces but lands in the
//!   mount namespace's real root, outside the chroot, not in the
//!   container's root: runc's `pivot_root` from a chroot does not move the
//!   namespace's root. So the suites exec only what behaves the same from
//!   either root (`ip`, `ping`, in the pod's netns), and tether's
//!   DaemonSet probes readiness over HTTP.
//! - Every directory the node would keep in `/etc`, `/opt`, `/run` or
//!   `/var/lib` is under a temp dir of this run, and the DaemonSet's
//!   hostPaths are moved there ([`OneNode::tether_values`]).
//!
//! The kubelet also sets a few sysctls that are the whole machine's
//! (`kernel.panic`, `vm.overcommit_memory`, ...): their values from before
//! are put back.
//!
//! Dropping it deletes the pods it can, stops the kubelet, kills every
//! container task of its containerd and their shims (found by its socket
//! in their command lines), stops containerd and the control plane,
//! deletes the pods' netns pins that containerd left, unmounts what the
//! kubelet and containerd mounted under its directory, and removes it.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::chart::{self, Helm};
use crate::cluster::{Fabric, Underlay};
use crate::kube::{k8s_bin_dir, KubeApi};
use crate::oci::Rootfs;
use crate::{wait_until, workspace_dir, Netns, TempDir};

/// The node's host number on the fabric (10.77.0.21).
pub const NODE_HOST: u8 = 21;
/// The cluster CIDR kube-controller-manager gives node CIDRs from.
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
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
const READY: Duration = Duration::from_secs(90);
/// Where the kubelet always puts its device-plugin socket (not under
/// `--root-dir`); removed again, with its directories if they are empty.
const DEVICE_PLUGIN_DIR: &str = "/var/lib/kubelet/device-plugins";
/// The sysctls that are not per netns which the kubelet sets at start
/// (its container manager's kernel tunables: `kernel.panic` 10,
/// `kernel.panic_on_oops` 1, `vm.overcommit_memory` 1, ...); they are
/// put back when the node is dropped.
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

/// The one-node cluster (see the module doc).
#[derive(Debug)]
pub struct OneNode {
    /// The machine-wide sysctls the kubelet sets, as they were before it.
    sysctls: SavedSysctls,
    kubelet: Option<Child>,
    containerd: Option<Child>,
    controller_manager: Option<Child>,
    scheduler: Option<Child>,
    name: String,
    underlay: Underlay,
    /// The API server (and its etcd), with kubectl.
    pub api: KubeApi,
    /// helm against the API server.
    helm: Helm,
    node: Netns,
    fabric: Fabric,
    dir: TempDir,
    /// The chart's `netconf` values of every install and upgrade (null:
    /// the chart's defaults).
    netconf: Value,
}

impl OneNode {
    /// Starts the control plane and the node, imports the pause and busybox
    /// images, and waits until the kubelet has registered the node (it is
    /// NotReady until a CNI config is in place).
    pub fn start() -> OneNode {
        let bins = k8s_bin_dir();
        let fabric = Fabric::new();
        let api = KubeApi::start(&fabric);
        let helm = Helm::against(&api);
        let node = Netns::new("kn");
        let underlay = fabric.attach_host(&node, NODE_HOST);
        let dir = TempDir::new("kn");
        let name = node.name().to_string();
        let mut one = OneNode {
            sysctls: SavedSysctls::save(),
            kubelet: None,
            containerd: None,
            controller_manager: None,
            scheduler: None,
            name,
            underlay,
            api,
            helm,
            node,
            fabric,
            dir,
            netconf: Value::Null,
        };
        for d in ["cni/bin", "cni/net.d", "ctd", "run", "state", "images"] {
            std::fs::create_dir_all(one.path(d)).expect("creating the node's dirs");
        }
        // The loopback plugin: containerd's CRI sets up every sandbox's lo.
        std::fs::copy("/usr/lib/cni/loopback", one.path("cni/bin/loopback"))
            .expect("installing the loopback plugin");
        let admin = one.api.admin_kubeconfig().display().to_string();
        let certs = one.api.dir().join("kcm-certs").display().to_string();
        one.controller_manager = Some(one.api.spawn(
            "kube-controller-manager",
            &bins.join("kube-controller-manager"),
            &[
                &format!("--kubeconfig={admin}"),
                // The DaemonSet's pods; the namespaces' default service
                // accounts and kube-root-ca.crt (the in-cluster config);
                // node CIDRs (--pod-cidr-from-node); the owner references'
                // cascade (deleting a DaemonSet deletes its pods).
                "--controllers=daemonset,serviceaccount,root-ca-cert-publisher,nodeipam,garbagecollector",
                "--allocate-node-cidrs=true",
                &format!("--cluster-cidr={CLUSTER_CIDR}"),
                "--node-cidr-mask-size=24",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--use-service-account-credentials=false",
                "--leader-elect=false",
                &format!("--cert-dir={certs}"),
                // What root-ca-cert-publisher puts in every namespace's
                // kube-root-ca.crt, the pods' in-cluster ca.crt.
                &format!("--root-ca-file={}", one.api.ca_cert().display()),
            ],
        ));
        let certs = one.api.dir().join("sched-certs").display().to_string();
        one.scheduler = Some(one.api.spawn(
            "kube-scheduler",
            &bins.join("kube-scheduler"),
            &[
                &format!("--kubeconfig={admin}"),
                "--leader-elect=false",
                &format!("--cert-dir={certs}"),
            ],
        ));
        one.write_containerd_config();
        one.start_containerd();
        for archive in busybox_images(&one.path("images")) {
            one.import(&archive);
        }
        one.write_kubelet_config();
        one.start_kubelet();
        let registered = wait_until(READY, || one.api.get(&["node", &one.name]).is_some());
        assert!(
            registered,
            "the kubelet did not register node {} in {READY:?}\n{}",
            one.name,
            one.kubelet_log_tail()
        );
        one
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    /// The node's name (also its netns's).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The node netns (containerd, the kubelet and host-network pods).
    pub fn netns(&self) -> &Netns {
        &self.node
    }

    /// The node's address on the fabric.
    pub fn underlay(&self) -> &Underlay {
        &self.underlay
    }

    /// The fabric the node and the API server are on.
    pub fn fabric(&self) -> &Fabric {
        &self.fabric
    }

    /// The CNI config dir containerd reads (`/etc/cni/net.d` of the node).
    pub fn cni_conf_dir(&self) -> PathBuf {
        self.path("cni/net.d")
    }

    /// The CNI bin dir containerd runs plugins from (`/opt/cni/bin`).
    pub fn cni_bin_dir(&self) -> PathBuf {
        self.path("cni/bin")
    }

    /// The directory of tetherd's socket (the DaemonSet's `/run/tether`).
    pub fn tether_run_dir(&self) -> PathBuf {
        self.path("run")
    }

    /// tetherd's socket, where the DaemonSet's daemon opens it.
    pub fn tether_socket(&self) -> PathBuf {
        self.path("run/tether.sock")
    }

    /// tetherd's state dir (the DaemonSet's `/var/lib/tether`).
    pub fn tether_state_dir(&self) -> PathBuf {
        self.path("state")
    }

    fn containerd_socket(&self) -> PathBuf {
        self.path("ctd/containerd.sock")
    }

    fn write_containerd_config(&self) {
        let d = self.path("ctd");
        let config = containerd_config(&ContainerdPaths {
            root: d.join("root"),
            state: d.join("state"),
            socket: self.containerd_socket(),
            cni_bin: self.cni_bin_dir(),
            cni_conf: self.cni_conf_dir(),
            runc_root: d.join("runc"),
        });
        std::fs::write(d.join("config.toml"), config).expect("writing containerd's config");
    }

    fn write_kubelet_config(&self) {
        let mut config = kubelet_config(&self.containerd_socket());
        config["volumePluginDir"] = json!(self.path("kubelet-plugins").display().to_string());
        config["podLogsDir"] = json!(self.path("pod-logs").display().to_string());
        std::fs::write(self.path("kubelet.json"), config.to_string())
            .expect("writing the kubelet's config");
    }

    /// Spawns `program` in the node netns (`nsenter --net`, see the module
    /// doc), logging to `<name>.log`.
    fn spawn_on_node(&self, name: &str, program: &Path, args: &[String]) -> Child {
        let (log, err) = crate::log_outputs(&self.path(&format!("{name}.log")));
        Command::new("nsenter")
            .arg(format!("--net={}", self.node.path().display()))
            .arg(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {}: {e}", program.display()))
    }

    /// Starts containerd and waits for its socket to answer.
    pub fn start_containerd(&mut self) {
        assert!(self.containerd.is_none(), "containerd already runs");
        let config = self.path("ctd/config.toml").display().to_string();
        let child = self.spawn_on_node(
            "containerd",
            Path::new(CONTAINERD_BIN),
            &["--config".into(), config],
        );
        self.containerd = Some(child);
        let up = wait_until(Duration::from_secs(30), || {
            self.ctr(&["version"]).status.success()
        });
        assert!(
            up,
            "containerd did not answer in 30 s\n{}",
            crate::log_tail(&self.path("containerd.log"), 30)
        );
    }

    /// Stops containerd (SIGTERM, then waits): its containers' shims and
    /// tasks keep running, as on a real node.
    pub fn stop_containerd(&mut self) {
        if let Some(c) = self.containerd.take() {
            terminate(c);
        }
    }

    /// Starts the kubelet (it picks up the pods that already run).
    pub fn start_kubelet(&mut self) {
        assert!(self.kubelet.is_none(), "the kubelet already runs");
        let kubeconfig = self.api.cert_kubeconfig(
            &format!("node-{}", self.name),
            &format!("/O=system:nodes/CN=system:node:{}", self.name),
        );
        let args = vec![
            format!("--config={}", self.path("kubelet.json").display()),
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--root-dir={}", self.path("kubelet").display()),
            // Its serving certificate; the default is not under --root-dir.
            format!("--cert-dir={}", self.path("kubelet-pki").display()),
            format!("--hostname-override={}", self.name),
            format!("--node-ip={}", self.underlay.v4),
            "--v=2".into(),
        ];
        let child = self.spawn_on_node("kubelet", &k8s_bin_dir().join("kubelet"), &args);
        self.kubelet = Some(child);
    }

    /// Stops the kubelet (SIGTERM, then waits); pods keep running.
    pub fn stop_kubelet(&mut self) {
        if let Some(c) = self.kubelet.take() {
            terminate(c);
        }
    }

    /// The last lines of the kubelet's log.
    pub fn kubelet_log_tail(&self) -> String {
        crate::log_tail(&self.path("kubelet.log"), 40)
    }

    /// The last lines of containerd's log.
    pub fn containerd_log_tail(&self) -> String {
        crate::log_tail(&self.path("containerd.log"), 40)
    }

    /// `ctr -n k8s.io` against this node's containerd.
    pub fn ctr(&self, args: &[&str]) -> Output {
        Command::new("ctr")
            .arg("--address")
            .arg(self.containerd_socket())
            .args(["-n", "k8s.io"])
            .args(args)
            .output()
            .expect("running ctr")
    }

    /// Imports an OCI archive into containerd's CRI namespace.
    pub fn import(&self, archive: &Path) {
        let out = self.ctr(&["images", "import", &archive.display().to_string()]);
        assert!(
            out.status.success(),
            "ctr images import {}: {}",
            archive.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Builds tether's image `TETHER_IMAGE:<tag>` the way
    /// install/Containerfile lays it out (the plugin, Debian's portmap and
    /// the conflist in `/tether`, the installer, the uninstaller and
    /// tetherd in `/usr/local/bin`, nft and curl), from the binaries in [`crate::bin_dir`] and the
    /// files of install/, on busybox (the installer's shell, the readiness
    /// probe's `test`), and imports it. `marker` is written to
    /// `/etc/tether-image`, so that two tags differ.
    pub fn build_tether_image(&self, tag: &str, marker: &str) -> String {
        let (name, archive) = tether_image(&self.path("images"), tag, marker);
        self.import(&archive);
        name
    }

    /// The chart's `netconf` values for the installs and upgrades that
    /// follow (see the chart's values.yaml).
    pub fn set_netconf(&mut self, netconf: Value) {
        self.netconf = netconf;
    }

    /// The chart's values for this node (a JSON values file for helm):
    /// - image `image` (`repository:tag`), `pullPolicy: Never`;
    /// - mode `nodeCidrs` (`--pod-cidr-from-node`: the node CIDR that
    ///   kube-controller-manager gave it);
    /// - the hostPaths of the CNI dirs, `/run/tether` and `/var/lib/tether`
    ///   moved under this run's dir (the chart mounts the socket's and the
    ///   state's dirs at their host paths, so that the plugin, on the host,
    ///   finds the socket and its DEL queue where the daemon says, and has
    ///   the installer write that socket into the conflist);
    /// - `KUBERNETES_SERVICE_HOST`/`PORT` set to the API server (no
    ///   kube-proxy here), through `extraEnv`.
    pub fn tether_values(&self, image: &str) -> Value {
        let (repository, tag) = image
            .rsplit_once(':')
            .unwrap_or_else(|| panic!("{image} has no tag"));
        let api = self.api.server();
        let api_host = api
            .trim_start_matches("https://")
            .split(':')
            .next()
            .unwrap_or_default()
            .to_string();
        let mut values = json!({
            "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
            "mode": "nodeCidrs",
            "hostPaths": {
                "cniBinDir": self.cni_bin_dir().display().to_string(),
                "cniConfDir": self.cni_conf_dir().display().to_string(),
                "runDir": self.tether_run_dir().display().to_string(),
                "stateDir": self.tether_state_dir().display().to_string(),
            },
            "extraEnv": [
                {"name": "KUBERNETES_SERVICE_HOST", "value": api_host},
                {"name": "KUBERNETES_SERVICE_PORT", "value": crate::kube::API_PORT.to_string()},
            ],
        });
        // The suite's own netconf, when it set one (set_netconf).
        if !self.netconf.is_null() {
            values["netconf"] = self.netconf.clone();
        }
        values
    }

    /// `helm install` of the chart (release `tether` in kube-system) with
    /// [`OneNode::tether_values`] of `image`, against the API server; the
    /// IPAMClaim CRD comes from the chart's crds/.
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

    /// The node's Ready condition: its status ("True", "False", "Unknown")
    /// and message.
    pub fn ready_condition(&self) -> (String, String) {
        let node = self.api.get(&["node", &self.name]).unwrap_or(Value::Null);
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

    /// Waits until the node is Ready; panics with its condition and the
    /// kubelet's log otherwise.
    pub fn wait_ready(&self) {
        let ok = wait_until(READY, || self.ready_condition().0 == "True");
        assert!(
            ok,
            "node {} not Ready in {READY:?}: {:?}\n{}",
            self.name,
            self.ready_condition(),
            self.kubelet_log_tail()
        );
    }

    /// A busybox pod on this node ([`busybox_pod`]).
    pub fn pod_manifest(&self, name: &str, labels: Value, annotations: Value) -> Value {
        busybox_pod(name, &self.name, labels, annotations)
    }

    /// Creates the pod of `manifest`.
    pub fn create_pod(&self, manifest: &Value) {
        self.api.apply(&manifest.to_string());
    }

    /// The pod `default/name` as JSON, if it exists.
    pub fn pod(&self, name: &str) -> Option<Value> {
        self.api.get(&["-n", "default", "pod", name])
    }

    /// Waits until pod `default/name` is Running; its IP.
    pub fn wait_running(&self, name: &str) -> String {
        let mut last = Value::Null;
        let ok = wait_until(READY, || {
            last = self.pod(name).unwrap_or(Value::Null);
            last["status"]["phase"] == "Running" && last["status"]["podIP"].is_string()
        });
        assert!(
            ok,
            "pod {name} not Running in {READY:?}: {}\n{}\n{}",
            last["status"],
            self.api
                .kubectl(&["-n", "default", "describe", "pod", name])
                .stdout
                .iter()
                .map(|b| *b as char)
                .collect::<String>(),
            self.kubelet_log_tail()
        );
        last["status"]["podIP"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// Deletes pod `default/name` and waits until it is gone from the API
    /// (the kubelet has stopped it and torn its sandbox down).
    pub fn delete_pod(&self, name: &str) {
        self.api
            .kubectl_ok(&["-n", "default", "delete", "pod", name, "--wait=false"]);
        let gone = wait_until(READY, || self.pod(name).is_none());
        assert!(
            gone,
            "pod {name} not gone in {READY:?}\n{}",
            self.kubelet_log_tail()
        );
    }

    /// `kubectl exec` in pod `default/name` (through the API server, the
    /// kubelet and containerd's streaming server).
    pub fn exec(&self, name: &str, argv: &[&str]) -> Output {
        let mut args = vec!["-n", "default", "exec", name, "--"];
        args.extend_from_slice(argv);
        self.api.kubectl(&args)
    }

    /// Waits until `kubectl exec` into pod `name` works (after a restart of
    /// the kubelet or containerd, the kubelet must first resync the pod).
    pub fn wait_exec(&self, name: &str) {
        let mut last = None;
        let ok = wait_until(READY, || {
            let out = self.exec(name, &["true"]);
            let ok = out.status.success();
            last = Some(out);
            ok
        });
        assert!(
            ok,
            "kubectl exec into {name} does not work: {:?}\n{}",
            last.map(|o| String::from_utf8_lossy(&o.stderr).into_owned()),
            self.kubelet_log_tail()
        );
    }

    /// Like [`OneNode::exec`]; panics unless it succeeds; its stdout.
    pub fn exec_ok(&self, name: &str, argv: &[&str]) -> String {
        let out = self.exec(name, argv);
        assert!(
            out.status.success(),
            "kubectl exec {name} -- {argv:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The tether DaemonSet's pods on this node: (name, phase, ready).
    pub fn tether_pods(&self) -> Vec<(String, String, bool)> {
        let list = self
            .api
            .get(&["-n", "kube-system", "pods", "-l", TETHER_SELECTOR])
            .unwrap_or(Value::Null);
        list["items"]
            .as_array()
            .map(|items| {
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
            })
            .unwrap_or_default()
    }

    /// The logs of tether's pods' containers, every run of each (the files
    /// the kubelet keeps in its pod logs dir), for a failure's message.
    pub fn tether_logs(&self) -> String {
        let mut text = String::new();
        let Ok(pods) = std::fs::read_dir(self.path("pod-logs")) else {
            return text;
        };
        for pod in pods.flatten() {
            if !pod
                .file_name()
                .to_string_lossy()
                .starts_with("kube-system_tether-")
            {
                continue;
            }
            for container in std::fs::read_dir(pod.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                for log in std::fs::read_dir(container.path())
                    .into_iter()
                    .flatten()
                    .flatten()
                {
                    text.push_str(&crate::log_tail(&log.path(), 40));
                    text.push('\n');
                }
            }
        }
        text
    }

    /// The socket's directory as the node sees it and as each running
    /// `tetherd` container sees it (`ctr tasks exec`), and the readiness
    /// probe run by hand in the container, for a failure's message.
    pub fn tetherd_view(&self) -> String {
        let run = self.tether_run_dir().display().to_string();
        let mut text = format!(
            "--- ls -la {run} (node) ---\n{}",
            String::from_utf8_lossy(
                &Command::new("ls")
                    .args(["-la", &run])
                    .output()
                    .map(|o| o.stdout)
                    .unwrap_or_default()
            )
        );
        let ids = self.ctr(&[
            "containers",
            "ls",
            "-q",
            "labels.\"io.kubernetes.container.name\"==tetherd",
        ]);
        for (n, id) in String::from_utf8_lossy(&ids.stdout)
            .split_whitespace()
            .enumerate()
        {
            let probe = format!(
                "echo '{{\"cniVersion\":\"1.1.0\",\"name\":\"diag\",\"type\":\"tether\",\"socket\":\"{}\"}}' | CNI_COMMAND=STATUS /tether/tether; echo rc=$?",
                self.tether_socket().display()
            );
            for (k, argv) in [
                vec!["/bin/ls", "-la", run.as_str()],
                vec!["/bin/sh", "-c", probe.as_str()],
            ]
            .into_iter()
            .enumerate()
            {
                let exec_id = format!("diag{n}x{k}");
                let mut args = vec!["tasks", "exec", "--exec-id", exec_id.as_str(), id];
                args.extend(argv.iter().copied());
                let out = self.ctr(&args);
                text.push_str(&format!(
                    "--- in tetherd container {id}: {argv:?} ---\n{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
        }
        text
    }

    /// Waits until exactly one tether pod runs, Ready, with image `image`;
    /// its name.
    pub fn wait_tether_ready(&self, image: &str) -> String {
        let mut name = String::new();
        let ok = wait_until(READY, || {
            let pods = self.tether_pods();
            let list = self
                .api
                .get(&["-n", "kube-system", "pods", "-l", TETHER_SELECTOR])
                .unwrap_or(Value::Null);
            let images_ok = list["items"].as_array().is_some_and(|items| {
                items.len() == 1 && items[0]["spec"]["containers"][0]["image"] == image
            });
            match pods.as_slice() {
                [(n, phase, true)] if phase == "Running" && images_ok => {
                    name = n.clone();
                    true
                }
                _ => false,
            }
        });
        assert!(
            ok,
            "tether's DaemonSet pod not Ready with {image} in {READY:?}: {:?}\n{}\n{}\n{}",
            self.tether_pods(),
            self.tether_logs(),
            self.tetherd_view(),
            self.kubelet_log_tail()
        );
        name
    }

    /// A watch on the pods of `default` ([`PodWatch::start`]).
    pub fn watch_pods(&self) -> PodWatch {
        PodWatch::start(&self.api)
    }

    /// Netns pins of this containerd's pod sandboxes (from their specs).
    fn sandbox_netns(&self) -> BTreeSet<String> {
        let out = self.ctr(&["containers", "ls", "-q"]);
        let mut pins = BTreeSet::new();
        for id in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            let info = self.ctr(&["containers", "info", id]);
            let Ok(v) = serde_json::from_slice::<Value>(&info.stdout) else {
                continue;
            };
            if let Some(nss) = v["Spec"]["linux"]["namespaces"].as_array() {
                for ns in nss {
                    if let Some(p) = ns["path"].as_str() {
                        if ns["type"] == "network" && p.contains("/netns/cni-") {
                            pins.insert(p.to_string());
                        }
                    }
                }
            }
        }
        pins
    }

    fn teardown(&mut self) {
        // Pods first, through the kubelet, while tetherd still runs: their
        // DELs release what they hold.
        if self.kubelet.is_some() {
            let _ = self.api.kubectl(&[
                "-n",
                "default",
                "delete",
                "pods",
                "--all",
                "--grace-period=1",
                "--wait=false",
            ]);
            wait_until(Duration::from_secs(30), || {
                self.api
                    .get(&["-n", "default", "pods"])
                    .and_then(|l| l["items"].as_array().map(Vec::is_empty))
                    .unwrap_or(true)
            });
        }
        self.stop_kubelet();
        for c in [self.controller_manager.take(), self.scheduler.take()]
            .into_iter()
            .flatten()
        {
            let mut c = c;
            let _ = c.kill();
            let _ = c.wait();
        }
        let mut pins = BTreeSet::new();
        if self.containerd.is_some() {
            pins = self.sandbox_netns();
            let out = self.ctr(&["tasks", "ls", "-q"]);
            for id in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = self.ctr(&["tasks", "kill", "-s", "SIGKILL", id]);
            }
            for id in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = self.ctr(&["tasks", "delete", "-f", id]);
            }
        }
        self.kill_shims();
        self.stop_containerd();
        for pin in pins {
            let name = pin.rsplit('/').next().unwrap_or_default().to_string();
            if Path::new(&pin).exists() {
                let _ = Command::new("ip").args(["netns", "delete", &name]).status();
            }
        }
        self.unmount_all();
        // The one path the kubelet always uses, whatever its flags: its
        // device-plugin registration socket.
        let plugins = Path::new(DEVICE_PLUGIN_DIR);
        let _ = std::fs::remove_file(plugins.join("kubelet.sock"));
        let _ = std::fs::remove_dir(plugins);
        let _ = plugins.parent().map(std::fs::remove_dir);
        self.sysctls.restore();
    }

    /// SIGKILLs the containerd shims of this node (their command lines name
    /// its socket), by PID.
    fn kill_shims(&self) {
        let sock = self.containerd_socket().display().to_string();
        let Ok(procs) = std::fs::read_dir("/proc") else {
            return;
        };
        for p in procs.flatten() {
            let Ok(pid) = p.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let cmdline = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
            let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            let is_shim = args
                .first()
                .is_some_and(|a| a.ends_with(b"containerd-shim-runc-v2"))
                && args.contains(&sock.as_bytes());
            if is_shim {
                // SAFETY: kill has no memory preconditions; the PID is a
                // shim of this node's containerd (its socket is in its
                // command line).
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                }
            }
        }
    }

    /// Unmounts everything mounted under this run's dir (deepest first).
    fn unmount_all(&self) {
        let root = self.dir.path().display().to_string();
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mut points: Vec<&str> = mountinfo
            .lines()
            .filter_map(|l| l.split_whitespace().nth(4))
            .filter(|p| p.starts_with(&root))
            .collect();
        points.sort_by_key(|p| std::cmp::Reverse(p.len()));
        for p in points {
            let _ = Command::new("umount").args(["-l", p]).status();
        }
    }
}

/// Builds tether's image `TETHER_IMAGE:<tag>` as an OCI archive in `dir`
/// (see [`OneNode::build_tether_image`]); its name and the archive.
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

impl Drop for OneNode {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "harness: the node:\n{}\n{}\n{}",
                self.tether_logs(),
                self.kubelet_log_tail(),
                self.containerd_log_tail()
            );
        }
        self.teardown();
    }
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
/// scheduler), that sleeps and exits at once on SIGTERM.
pub fn busybox_pod(name: &str, node: &str, labels: Value, annotations: Value) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default",
                     "labels": labels, "annotations": annotations},
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
