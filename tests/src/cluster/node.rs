//! A node: a netns on the fabric with a tetherd started with the cluster
//! flags, and the pods added through the real plugin.

use super::*;

/// How a node routes to other nodes' blocks (`--overlay`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Overlay {
    /// `--overlay none`: host-gw, `block via nodeIP`.
    #[default]
    HostGw,
    /// `--overlay vxlan`: one VXLAN device, static FDB and neighbours.
    Vxlan,
}

impl Overlay {
    /// The value of `--overlay`.
    pub fn flag(self) -> &'static str {
        match self {
            Overlay::HostGw => "none",
            Overlay::Vxlan => "vxlan",
        }
    }
}

/// How to start a [`ClusterNode`]'s tetherd.
#[derive(Clone, Debug)]
pub struct NodeOpts {
    /// `--overlay`.
    pub overlay: Overlay,
    /// One `--cluster-cidr` each; [`CLUSTER_CIDRS`] by default.
    pub cluster_cidrs: Vec<String>,
    /// `--block-size`, if set (the daemon's default is 26).
    pub block_size: Option<u8>,
    /// `--block-size-v6`, if set (the daemon's default is 122).
    pub block_size_v6: Option<u8>,
    /// `--lease-ttl` in seconds (2 by default, for quick tests).
    pub lease_ttl_secs: u32,
    /// `--node-grace` in seconds (3 by default, for quick tests).
    pub node_grace_secs: u32,
    /// `--etcd-timeout-ms`, if set.
    pub etcd_timeout_ms: Option<u32>,
    /// Pass `--node-ip <underlay v4>`; by default the daemon detects it
    /// from the default route, which the fabric provides.
    pub explicit_node_ip: bool,
    /// If non-empty: the single-node mode instead, `--pod-cidr` each and no
    /// store or cluster flags at all (for a daemon without cluster mode).
    pub pod_cidrs: Vec<String>,
    /// `--log-level`; the crate's default when unset.
    pub log_level: Option<String>,
    /// The binary; [`crate::tetherd_bin`] when unset.
    pub bin: Option<PathBuf>,
    /// Appended to the command line as they are.
    pub extra_args: Vec<String>,
    /// `--check-vm-launchers` ([`DaemonOpts::check_vm_launchers`]): off
    /// unless set. The kubelet clusters run the chart's default (on).
    pub check_vm_launchers: bool,
}

impl Default for NodeOpts {
    fn default() -> NodeOpts {
        NodeOpts {
            overlay: Overlay::HostGw,
            cluster_cidrs: CLUSTER_CIDRS.map(str::to_owned).to_vec(),
            block_size: None,
            block_size_v6: None,
            lease_ttl_secs: 2,
            node_grace_secs: 3,
            etcd_timeout_ms: None,
            explicit_node_ip: false,
            pod_cidrs: Vec::new(),
            log_level: None,
            bin: None,
            extra_args: Vec::new(),
            check_vm_launchers: false,
        }
    }
}

/// The control store a node's daemon is started against.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backend {
    /// `--store etcd`, these client URLs (comma-separated).
    Etcd(String),
    /// `--store kubernetes`: this kubeconfig (the chart's service
    /// account's token), the Leases in [`crate::kube::TETHER_SA`]'s
    /// namespace.
    Kubernetes(PathBuf),
}

impl NodeOpts {
    /// The tetherd arguments these options stand for, for a node at
    /// `underlay` on `backend`.
    pub fn daemon_args(&self, backend: &Backend, underlay: &Underlay) -> Vec<String> {
        let mut args: Vec<String> = Vec::new();
        let mut flag = |name: &str, value: String| args.extend([name.to_owned(), value]);
        if self.pod_cidrs.is_empty() {
            match backend {
                Backend::Etcd(endpoints) => {
                    flag("--store", "etcd".into());
                    flag("--etcd-endpoints", endpoints.clone());
                }
                Backend::Kubernetes(kubeconfig) => {
                    flag("--store", "kubernetes".into());
                    flag("--kubeconfig", kubeconfig.display().to_string());
                    flag("--lease-namespace", crate::kube::TETHER_SA.0.into());
                }
            }
            for cidr in &self.cluster_cidrs {
                flag("--cluster-cidr", cidr.clone());
            }
            if let Some(size) = self.block_size {
                flag("--block-size", size.to_string());
            }
            if let Some(size) = self.block_size_v6 {
                flag("--block-size-v6", size.to_string());
            }
            flag("--overlay", self.overlay.flag().into());
            flag("--lease-ttl", self.lease_ttl_secs.to_string());
            flag("--node-grace", self.node_grace_secs.to_string());
            if let Some(ms) = self.etcd_timeout_ms {
                flag("--etcd-timeout-ms", ms.to_string());
            }
            if self.explicit_node_ip {
                flag("--node-ip", underlay.v4.to_string());
            }
        }
        args.extend(self.extra_args.iter().cloned());
        args
    }
}

/// A node: a netns on the fabric at its own underlay addresses, with a
/// `tetherd` running in it. Dropping it kills the daemon and deletes the
/// netns (with its veth to the fabric, pod veths and routes).
#[derive(Debug)]
pub struct ClusterNode {
    daemon: Daemon,
    underlay: Underlay,
    /// kube-proxy, when the cluster runs it
    /// ([`Topology::kube_proxy`](crate::topology::Topology::kube_proxy)).
    proxy: Option<Child>,
}

impl ClusterNode {
    /// Creates a node netns, attaches it to `fabric` as host number `host`
    /// ([`Fabric::attach_host`]) and starts tetherd in it with `opts`
    /// on `backend`; panics with the daemon's log if it does not serve.
    pub fn start(fabric: &Fabric, backend: &Backend, host: u16, opts: &NodeOpts) -> ClusterNode {
        let netns = Netns::new("node");
        let underlay = fabric.attach_host(&netns, host);
        let daemon = Daemon::start_in(
            netns,
            DaemonOpts {
                pod_cidrs: opts.pod_cidrs.clone(),
                mtu: None,
                log_level: opts.log_level.clone(),
                bin: opts.bin.clone(),
                extra_args: opts.daemon_args(backend, &underlay),
                check_vm_launchers: opts.check_vm_launchers,
            },
        );
        ClusterNode {
            daemon,
            underlay,
            proxy: None,
        }
    }

    pub(super) fn has_kube_proxy(&self) -> bool {
        self.proxy.is_some()
    }

    /// The file kube-proxy logs to, beside the daemon's state.
    fn kube_proxy_log_path(&self) -> PathBuf {
        self.daemon.dir().join("kube-proxy.log")
    }

    /// Starts kube-proxy in this node's netns against `api`, as a kubeadm
    /// node runs it (iptables mode; `nf_conntrack_max` left alone, which
    /// is read-only in a netns).
    pub(super) fn start_kube_proxy(&mut self, api: &KubeApi) {
        let kubeconfig =
            api.cert_kubeconfig(&format!("proxy-{}", self.name()), "/CN=system:kube-proxy");
        let (log, err) = crate::log_outputs(&self.kube_proxy_log_path());
        let child = Command::new("ip")
            .args(["netns", "exec", self.netns().name()])
            .arg(crate::kube::k8s_bin_dir().join("kube-proxy"))
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .arg(format!("--hostname-override={}", self.name()))
            .arg(format!("--bind-address={}", self.underlay.v4))
            .arg("--proxy-mode=iptables")
            .arg(format!("--cluster-cidr={}", CLUSTER_CIDRS[0]))
            .args(["--conntrack-max-per-core=0", "--v=2"])
            .args([
                "--metrics-bind-address=127.0.0.1:10249",
                "--healthz-bind-address=127.0.0.1:10256",
            ])
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("spawning kube-proxy on {}: {e}", self.name()));
        self.proxy = Some(child);
    }

    /// Whether kube-proxy wrote its chains in this node's netns.
    pub(super) fn kube_proxy_synced(&self) -> bool {
        self.iptables_nat().contains("KUBE-SERVICES")
    }

    fn iptables_nat(&self) -> String {
        let out = self.netns().exec(&["iptables-save", "-t", "nat"]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The last lines of kube-proxy's log, for a failure's message.
    pub fn kube_proxy_log(&self) -> String {
        let text = std::fs::read_to_string(self.kube_proxy_log_path()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
    }

    /// The node's name (`--node-name`, also its netns's name).
    pub fn name(&self) -> &str {
        self.daemon.node_name()
    }

    /// The node netns.
    pub fn netns(&self) -> &Netns {
        self.daemon.node()
    }

    /// The node's tetherd.
    pub fn daemon(&self) -> &Daemon {
        &self.daemon
    }

    /// The node's tetherd, to kill, stop or restart it.
    pub fn daemon_mut(&mut self) -> &mut Daemon {
        &mut self.daemon
    }

    /// The node's interface and addresses on the fabric.
    pub fn underlay(&self) -> &Underlay {
        &self.underlay
    }

    /// The 1.0.0 netconf pods are added with ([`CLUSTER_NETWORK`]).
    pub fn netconf(&self) -> Value {
        self.daemon.netconf("1.0.0", CLUSTER_NETWORK)
    }

    /// One ADD of `id` into `pod` through the real `tether` plugin, the
    /// result (or error) returned as it is.
    pub fn try_add(&self, pod: &Netns, id: &str) -> CniOutput {
        self.call("ADD", pod, id)
    }

    /// A new pod netns added on this node; panics unless the ADD succeeds.
    pub fn add_pod(&self) -> Pod {
        let netns = Netns::new("pod");
        let id = netns.name().to_owned();
        let out = self.try_add(&netns, &id);
        assert!(
            out.success(),
            "ADD of {id} on {} failed: {out}",
            self.name()
        );
        Pod::from_output(netns, id, self.name(), &out)
    }

    /// DEL of `pod` on this node (its netns stays); the output as it is.
    pub fn del(&self, pod: &Pod) -> CniOutput {
        self.call("DEL", &pod.netns, &pod.id)
    }

    /// The routes to other nodes' blocks ([`CLUSTER_ROUTE_PROTOCOL`]), both
    /// families, as `ip -j route` prints them.
    pub fn cluster_routes(&self) -> Vec<Value> {
        self.netns().routes_with_protocol(CLUSTER_ROUTE_PROTOCOL)
    }

    /// The destinations of [`ClusterNode::cluster_routes`], sorted.
    pub fn cluster_route_dsts(&self) -> Vec<String> {
        let mut dsts: Vec<String> = self
            .cluster_routes()
            .iter()
            .filter_map(|r| r["dst"].as_str().map(str::to_owned))
            .collect();
        dsts.sort();
        dsts
    }

    fn call(&self, command: &str, pod: &Netns, id: &str) -> CniOutput {
        self.call_with(command, pod, id, &self.netconf(), None)
    }

    /// One `command` of `id` in `pod` through the real plugin with this
    /// netconf and `CNI_ARGS`, the output as it is.
    pub fn call_with(
        &self,
        command: &str,
        pod: &Netns,
        id: &str,
        netconf: &Value,
        args: Option<&str>,
    ) -> CniOutput {
        let stdin = serde_json::to_vec(netconf).expect("a JSON value serializes");
        let mut env = CniEnv::new(command, id, pod);
        env.args = args.map(str::to_owned);
        cni(&tether_bin(), &env, &stdin)
    }
}

impl Drop for ClusterNode {
    fn drop(&mut self) {
        // kube-proxy before the daemon and the netns it runs in.
        if let Some(c) = self.proxy.take() {
            crate::kubelet::terminate(c);
        }
    }
}

/// A pod added through the plugin: its netns (deleted on drop), container
/// id, node and addresses.
#[derive(Debug)]
pub struct Pod {
    netns: Netns,
    id: String,
    node: String,
    ips: Vec<IpAddr>,
    result: Value,
}

impl Pod {
    /// A pod from a successful ADD's output.
    pub fn from_output(netns: Netns, id: String, node: &str, out: &CniOutput) -> Pod {
        let result = out.result().clone();
        let ips = result["ips"]
            .as_array()
            .unwrap_or_else(|| panic!("ADD result without ips: {result}"))
            .iter()
            .map(|entry| {
                let addr = entry["address"].as_str().unwrap_or_default();
                let ip = addr.split('/').next().unwrap_or_default();
                ip.parse()
                    .unwrap_or_else(|e| panic!("bad address {addr:?} ({e}) in {result}"))
            })
            .collect();
        Pod {
            netns,
            id,
            node: node.to_owned(),
            ips,
            result,
        }
    }

    /// The pod netns.
    pub fn netns(&self) -> &Netns {
        &self.netns
    }

    /// The container id it was added with (the netns's name).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The name of the node it was added on.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Its addresses, in the order of the ADD result.
    pub fn ips(&self) -> &[IpAddr] {
        &self.ips
    }

    /// Its IPv4 address, if it has one.
    pub fn v4(&self) -> Option<IpAddr> {
        self.ips.iter().copied().find(IpAddr::is_ipv4)
    }

    /// Its IPv6 address, if it has one.
    pub fn v6(&self) -> Option<IpAddr> {
        self.ips.iter().copied().find(IpAddr::is_ipv6)
    }

    /// The whole ADD result.
    pub fn result(&self) -> &Value {
        &self.result
    }

    /// [`ping`] from this pod.
    pub fn ping(&self, to: IpAddr) -> bool {
        ping(&self.netns, to)
    }
}
