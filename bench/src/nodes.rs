//! Pod to pod across two nodes, in one run:
//!
//! 1. **The data path.** TCP throughput (Debian's `iperf3`, one stream)
//!    and TCP request/response latency (Debian's `sockperf ping-pong`,
//!    small messages) from a pod on one node to a pod on another, over
//!    four paths built side by side:
//!    - the ceiling: two network namespaces joined directly by one veth
//!      pair (addresses of [`CEILING_ADDRS`], only inside those two);
//!    - tether host-gw: a 2-node [`Cluster`] (real `tetherd`s, each in its
//!      node netns on a fabric bridge; `--overlay none`), one pod on each
//!      node, added through the real plugin;
//!    - tether host-gw with NetworkPolicy: the same with the API and
//!      `--network-policy`, and [`POLICIES`] policies isolating the
//!      receiver, the sender allowed by the last rule its chain tries
//!      (issue 39: a packet's cost with 1,000 policies against none);
//!    - tether VXLAN: the same with `--overlay vxlan`, whose pods get the
//!      VXLAN device's MTU by default (the bench checks it).
//!
//!    The clusters keep their records in a one-member etcd: the store
//!    decides which routes exist, not how packets travel. Each path must
//!    first answer a ping between its two pods, or it counts as a failure
//!    and gets no numbers. The servers run in the receiving pod's netns and
//!    the clients in the sender's, through `ip netns exec` (the servers
//!    ended by their PID), each side pinned to a CPU of its own
//!    ([`CLIENT_CPU`], [`SERVER_CPU`]). Rounds interleave the four paths, the order
//!    rotating, so that background noise falls on all of them; every
//!    iperf3 sample also checks, from the sending node's counters, that
//!    its bytes left through the device the route names (the veth, the
//!    node's uplink, or the VXLAN device).
//! 2. **Pod-ready latency on two kubelet nodes.** The cluster of
//!    [`KubeCluster`] (two kubelet nodes in their own namespaces, tether
//!    installed by its Helm chart), `--pods` busybox pods created one after
//!    the other, alternating nodes (pods name their node: no scheduler),
//!    timed as `tether-bench kubelet` times them: from the API's first report of
//!    a pod to its report as Running with an IP, through one `kubectl get
//!    pods --watch`.
//!
//! Run (as root): `cargo run --release -p tether-bench -- nodes
//! [--rounds 7] [--seconds 3] [--pods 20] [--parts podnet,ready]
//! [--no-build] [--write BENCHMARKS.md]`.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use ipnet::IpNet;
use serde_json::{json, Value};
use tether_e2e::cluster::{Cluster, NodeOpts, Overlay, Pod, Store};
use tether_e2e::kube_cluster::POD_CIDR;
use tether_e2e::kubelet::{busybox_pod, PodWatch};
use tether_e2e::topology::Topology;
use tether_e2e::{bin_dir, netpol, ping, ping_output, wait_until, Netns};

use crate::kit::{
    cargo_build_release, first_lines, guarded, percentile, release_dir, stdout_of, strip_ansi,
    Benchmark, CommonArgs, Failures, Report, Run, Table,
};

/// The progress log's prefix.
const BENCH: &str = <Args as Benchmark>::NAME;

/// The ceiling's two ends, inside its two netns only.
const CEILING_ADDRS: [&str; 2] = ["10.250.0.1/30", "10.250.0.2/30"];
/// The pods' MTU under VXLAN, tetherd's default there: the fabric's 1500
/// less VXLAN's 50 bytes over IPv4, the VXLAN device's MTU.
const VXLAN_POD_MTU: u32 = 1450;
const IPERF_PORT: u16 = 5201;
const SOCKPERF_PORT: u16 = 11111;
/// sockperf's message: small, as a request or a response is.
const MESSAGE_BYTES: usize = 64;
/// iperf3's first second, TCP's ramp-up, is left out of each sample.
const OMIT_SECONDS: usize = 1;
/// The CPUs the two ends run on (`taskset`): the clients on one, the
/// servers on the other, as on two machines. Left to the scheduler, a
/// ping-pong's round trip on the 2-CPU VM this was written on was 14 µs
/// with both ends on one CPU and 57 µs with one on each, and which one a
/// sample got was chance.
const CLIENT_CPU: &str = "0";
const SERVER_CPU: &str = "1";
/// How long a new path may take to answer a ping (routes appear as the
/// daemons see each other's blocks).
const PATH_WAIT: Duration = Duration::from_secs(30);
/// How long a server may take to listen.
const LISTEN_WAIT: Duration = Duration::from_secs(10);
/// The policies isolating the receiver on the policy path: each allows
/// one address that is no pod's, and the last (by name) the sender, so
/// that a new connection's first packet passes every rule before the one
/// that lets it in. The label of [`PathKind::HostGwPolicies`] says 1,000.
const POLICIES: usize = 1000;
/// The policy path's namespace.
const POLICY_NS: &str = "bench-nodes";
/// How long the receiver's node may take to write its table.
const POLICY_WAIT: Duration = Duration::from_secs(120);
/// How long a pod may take to show up, and then to run.
const POD_LIMIT: Duration = Duration::from_secs(90);

/// The parts of the run (`--parts`).
#[derive(Clone, Copy, Debug)]
struct Parts {
    podnet: bool,
    ready: bool,
}

/// `tether-bench nodes`'s flags.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Rounds of the data path; in each, every path gets one iperf3 and one sockperf sample.
    #[arg(long, default_value_t = 7, value_parser = clap::value_parser!(u64).range(1..))]
    rounds: u64,
    /// Seconds each iperf3 and sockperf sample measures.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    seconds: u64,
    /// Pods created on the two kubelet nodes, alternating nodes.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    pods: u64,
    /// The parts to run, comma-separated: podnet (the data path), ready (pod-ready latency).
    #[arg(long, value_name = "LIST", default_value = "podnet,ready", value_parser = parse_parts)]
    parts: Parts,
    #[command(flatten)]
    common: CommonArgs,
}

fn parse_parts(list: &str) -> Result<Parts, String> {
    let mut parts = Parts {
        podnet: false,
        ready: false,
    };
    for part in list.split(',') {
        match part {
            "podnet" => parts.podnet = true,
            "ready" => parts.ready = true,
            other => return Err(format!("unknown part {other:?} (podnet, ready)")),
        }
    }
    Ok(parts)
}

/// What the parts measured; `None` for a part not run or aborted.
pub struct Measured {
    podnet: Option<Vec<PathResult>>,
    ready: Option<PodsReady>,
}

impl Benchmark for Args {
    const NAME: &'static str = "nodes";
    const SECTION: &'static str = "bench-nodes";
    /// The directory of the release `tether` and `tetherd`.
    type Ready = PathBuf;
    type Measured = Measured;

    fn common(&self) -> &CommonArgs {
        &self.common
    }

    fn prepare(&self) -> Result<PathBuf, String> {
        let dir = release_dir(BENCH, self.common.build())?;
        if self.parts.ready {
            node_init(self.common.build())?;
        }
        Ok(dir)
    }

    fn measure(&self, dir: &PathBuf, failures: &mut Failures) -> Measured {
        let podnet = if self.parts.podnet {
            guarded("podnet", failures, |f| podnet(dir, self, f))
        } else {
            None
        };
        let ready = if self.parts.ready {
            guarded("ready", failures, |f| ready(self, f))
        } else {
            None
        };
        Measured { podnet, ready }
    }

    fn report(&self, run: &Run, _: &PathBuf, measured: &Measured) -> String {
        report(
            run,
            self,
            measured.podnet.as_deref(),
            measured.ready.as_ref(),
        )
    }
}

/// The kubelet nodes' init (`node_init`) beside tether's binaries, where
/// the harness starts it from; built first if `build`.
fn node_init(build: bool) -> Result<(), String> {
    if build {
        cargo_build_release(BENCH, &["-p", "tether-e2e", "--bin", "node_init"])?;
    }
    let path = bin_dir().join("node_init");
    if !path.exists() {
        return Err(format!(
            "{} does not exist (cargo build --release -p tether-e2e --bin node_init)",
            path.display()
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Part 1: the data path

/// One of the four paths.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PathKind {
    Ceiling,
    HostGw,
    /// host-gw with NetworkPolicy on and [`POLICIES`] policies isolating
    /// the receiver.
    HostGwPolicies,
    Vxlan,
}

impl PathKind {
    const ALL: [PathKind; 4] = [
        PathKind::Ceiling,
        PathKind::HostGw,
        PathKind::HostGwPolicies,
        PathKind::Vxlan,
    ];

    fn label(self) -> &'static str {
        match self {
            PathKind::Ceiling => "veth between two netns (ceiling)",
            PathKind::HostGw => "tether host-gw",
            PathKind::HostGwPolicies => "tether host-gw, 1,000 policies on the receiver",
            PathKind::Vxlan => "tether VXLAN",
        }
    }
}

/// What joins a path's two ends; dropping it deletes every netns and link.
enum Carrier {
    Veth { sender: Netns, receiver: Netns },
    Tether(Box<TetherPair>),
}

/// A 2-node tether cluster and a pod on each node.
struct TetherPair {
    // Pods first: dropped before their nodes.
    pods: [Pod; 2],
    cluster: Cluster,
}

impl Carrier {
    /// Two netns and one veth pair, born with its peer in the other netns.
    fn veth() -> Carrier {
        let carrier = Carrier::Veth {
            sender: Netns::new("ceil"),
            receiver: Netns::new("ceil"),
        };
        let (a, b) = (carrier.sender(), carrier.receiver());
        let add = format!(
            "ip link add eth0 type veth peer name eth0 netns {}",
            b.name()
        );
        a.exec_ok(&add.split(' ').collect::<Vec<_>>());
        for (ns, addr) in [(a, CEILING_ADDRS[0]), (b, CEILING_ADDRS[1])] {
            ns.exec_ok(&["ip", "addr", "add", addr, "dev", "eth0"]);
            ns.exec_ok(&["ip", "link", "set", "eth0", "up"]);
        }
        carrier
    }

    /// A 2-node cluster on a one-member etcd with `overlay`, and a pod on
    /// each node.
    fn tether(overlay: Overlay, tetherd: &Path) -> Carrier {
        let cluster = Topology::tetherd(2)
            .store(Store::Etcd)
            .etcd_members(1)
            // The daemon's own lease defaults, as `tether-bench cluster` runs it: a
            // busy machine never reaps a node in the middle of a run.
            .node(NodeOpts {
                overlay,
                lease_ttl_secs: 15,
                node_grace_secs: 600,
                log_level: Some("info".to_owned()),
                bin: Some(tetherd.to_path_buf()),
                extra_args: Vec::new(),
                ..NodeOpts::default()
            })
            .start();
        let pods = [cluster.add_pod(0), cluster.add_pod(1)];
        Carrier::Tether(Box::new(TetherPair { pods, cluster }))
    }

    /// A 2-node host-gw cluster as [`Carrier::tether`]'s, with the API
    /// and `--network-policy`: the two pods are API objects, and `n`
    /// policies isolate the receiver (see [`POLICIES`]). Waits until the
    /// receiver's node has written all of them.
    fn tether_with_policies(tetherd: &Path, n: usize) -> Result<Carrier, String> {
        let cluster = Topology::tetherd(2)
            .store(Store::Etcd)
            .etcd_members(1)
            .with_api(true)
            .node(NodeOpts {
                overlay: Overlay::HostGw,
                lease_ttl_secs: 15,
                node_grace_secs: 600,
                log_level: Some("info".to_owned()),
                bin: Some(tetherd.to_path_buf()),
                extra_args: vec!["--network-policy=true".to_owned()],
                ..NodeOpts::default()
            })
            .start();
        let api = cluster.kube_api();
        netpol::namespace(api, POLICY_NS, json!({}));
        let pods = [
            netpol::api_pod(api, cluster.node(0), POLICY_NS, "sender", "send"),
            netpol::api_pod(api, cluster.node(1), POLICY_NS, "receiver", "recv"),
        ];
        let receiver = json!({"matchLabels": {"app": "recv"}});
        let mut items: Vec<Value> = (0..n)
            .map(|i| {
                let block = format!("10.99.{}.{}/32", i / 250, i % 250 + 1);
                netpol::policy(
                    POLICY_NS,
                    &format!("p{i:05}"),
                    json!({"podSelector": receiver, "policyTypes": ["Ingress"],
                           "ingress": [{"from": [{"ipBlock": {"cidr": block}}]}]}),
                )
            })
            .collect();
        items.push(netpol::policy(
            POLICY_NS,
            "zz-sender",
            json!({"podSelector": receiver, "policyTypes": ["Ingress"],
                   "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "send"}}}]}]}),
        ));
        api.apply(&netpol::list(items).to_string());
        let node = cluster.node(1).netns();
        let rules = || {
            let out = node.exec(&["nft", "list", "table", "inet", "tether_policy"]);
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| l.trim_end().ends_with(" return"))
                .count()
        };
        // One rule per ipBlock, and the sender's (one per family of its
        // addresses).
        let want = n + pods[0].ips().len();
        if !wait_until(POLICY_WAIT, || rules() == want) {
            return Err(format!(
                "the receiver's node wrote {} of the {want} rules of the {} policies in {POLICY_WAIT:?}",
                rules(),
                n + 1
            ));
        }
        Ok(Carrier::Tether(Box::new(TetherPair { pods, cluster })))
    }

    fn sender(&self) -> &Netns {
        match self {
            Carrier::Veth { sender, .. } => sender,
            Carrier::Tether(t) => t.pods[0].netns(),
        }
    }

    fn receiver(&self) -> &Netns {
        match self {
            Carrier::Veth { receiver, .. } => receiver,
            Carrier::Tether(t) => t.pods[1].netns(),
        }
    }

    /// The receiver's address.
    fn target(&self) -> Result<IpAddr, String> {
        match self {
            Carrier::Veth { .. } => CEILING_ADDRS[1]
                .split('/')
                .next()
                .and_then(|a| a.parse().ok())
                .ok_or_else(|| "a bad ceiling address".to_owned()),
            Carrier::Tether(t) => t.pods[1]
                .v4()
                .ok_or_else(|| format!("pod {} has no IPv4 address", t.pods[1].id())),
        }
    }

    /// Where the sender's packets leave its host: the sender itself on the
    /// veth, the sending node under tether.
    fn sending_host(&self) -> &Netns {
        match self {
            Carrier::Veth { sender, .. } => sender,
            Carrier::Tether(t) => t.cluster.node(0).netns(),
        }
    }
}

/// A server spawned in a netns; ended by its PID when dropped.
struct Server {
    child: Child,
}

impl Server {
    /// Starts `argv` in `ns` on [`SERVER_CPU`] and waits until something
    /// listens on TCP `port` there.
    fn start(ns: &Netns, argv: &[&str], port: u16) -> Result<Server, String> {
        let child = Command::new("ip")
            .args(["netns", "exec", ns.name(), "taskset", "-c", SERVER_CPU])
            .args(argv)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("spawning {argv:?} in {}: {e}", ns.name()))?;
        // From here on the guard kills it, also on the error below.
        let server = Server { child };
        let sport = format!(":{port}");
        let listening = wait_until(LISTEN_WAIT, || {
            let out = ns.exec(&["ss", "-Hltn", "sport", "=", &sport]);
            !String::from_utf8_lossy(&out.stdout).trim().is_empty()
        });
        if !listening {
            return Err(format!(
                "{} not listening on {port} in {LISTEN_WAIT:?}",
                argv[0]
            ));
        }
        Ok(server)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // Not reaped yet, so the PID is still our child's.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One path, set up and serving, with its samples.
struct Lane {
    kind: PathKind,
    // Servers first: ended before their netns go.
    _servers: [Server; 2],
    carrier: Carrier,
    target: IpAddr,
    /// The device the sending host's route to the target names.
    via: String,
    shape: Shape,
    samples: PathSamples,
}

/// What a path looks like, for the report.
#[derive(Clone, Debug)]
struct Shape {
    /// The sender's interface MTU.
    mtu: u64,
    /// The sending host's device to the target and its kind (`veth`,
    /// `vxlan`).
    via: String,
}

/// A path's samples, one of each kind a round.
#[derive(Clone, Debug, Default)]
struct PathSamples {
    /// iperf3's received throughput, bit/s.
    bps: Vec<u64>,
    /// iperf3's sender retransmits.
    retransmits: Vec<u64>,
    /// sockperf's round trips: each sample's p50, p99 and average.
    p50: Vec<Duration>,
    p99: Vec<Duration>,
    avg: Vec<Duration>,
}

/// A path's outcome for the report: no samples if it never worked.
struct PathResult {
    kind: PathKind,
    shape: Option<Shape>,
    samples: PathSamples,
}

impl Lane {
    /// Builds the path, checks that a ping crosses it, starts the servers.
    fn open(kind: PathKind, tetherd: &Path) -> Result<Lane, String> {
        let carrier = match kind {
            PathKind::Ceiling => Carrier::veth(),
            PathKind::HostGw => Carrier::tether(Overlay::HostGw, tetherd),
            PathKind::Vxlan => Carrier::tether(Overlay::Vxlan, tetherd),
            PathKind::HostGwPolicies => Carrier::tether_with_policies(tetherd, POLICIES)?,
        };
        let target = carrier.target()?;
        if !wait_until(PATH_WAIT, || ping(carrier.sender(), target)) {
            let out = ping_output(carrier.sender(), target);
            return Err(format!(
                "no ping reply from {target} in {PATH_WAIT:?}: {} {}",
                String::from_utf8_lossy(&out.stdout).trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let ip = target.to_string();
        let servers = [
            Server::start(
                carrier.receiver(),
                &["iperf3", "-s", "-B", &ip, "-p", &IPERF_PORT.to_string()],
                IPERF_PORT,
            )?,
            Server::start(
                carrier.receiver(),
                &[
                    "sockperf",
                    "server",
                    "--tcp",
                    "-i",
                    &ip,
                    "-p",
                    &SOCKPERF_PORT.to_string(),
                ],
                SOCKPERF_PORT,
            )?,
        ];
        let sender_dev = route_dev(carrier.sender(), target)?;
        let via = route_dev(carrier.sending_host(), target)?;
        let shape = Shape {
            mtu: link(carrier.sender(), &sender_dev, &[])?["mtu"]
                .as_u64()
                .unwrap_or(0),
            via: format!("{via} ({})", link_kind(carrier.sending_host(), &via)),
        };
        if kind == PathKind::Vxlan && shape.mtu != u64::from(VXLAN_POD_MTU) {
            return Err(format!(
                "{}: the pod's MTU is {}, not the VXLAN device's {VXLAN_POD_MTU}",
                kind.label(),
                shape.mtu
            ));
        }
        eprintln!(
            "{BENCH}: {}: {ip} answers; the sender's MTU {}, out through {}",
            kind.label(),
            shape.mtu,
            shape.via
        );
        Ok(Lane {
            kind,
            _servers: servers,
            carrier,
            target,
            via,
            shape,
            samples: PathSamples::default(),
        })
    }

    /// One iperf3 sample and one sockperf sample; a failed one is counted.
    fn sample(&mut self, seconds: u64, f: &mut Failures) {
        match self.throughput(seconds) {
            Ok(t) => {
                self.samples.bps.push(t.bps);
                self.samples.retransmits.push(t.retransmits);
            }
            Err(e) => f.fail(format!("{}: iperf3: {e}", self.kind.label())),
        }
        match self.round_trips(seconds) {
            Ok(rtt) => {
                self.samples.p50.push(rtt.p50);
                self.samples.p99.push(rtt.p99);
                self.samples.avg.push(rtt.avg);
            }
            Err(e) => f.fail(format!("{}: sockperf: {e}", self.kind.label())),
        }
    }

    /// Runs `argv` in the sender's netns on [`CLIENT_CPU`].
    fn client(&self, argv: &[&str]) -> std::process::Output {
        let mut pinned = vec!["taskset", "-c", CLIENT_CPU];
        pinned.extend_from_slice(argv);
        self.carrier.sender().exec(&pinned)
    }

    fn throughput(&self, seconds: u64) -> Result<Throughput, String> {
        let host = self.carrier.sending_host();
        let before = tx_bytes(host, &self.via)?;
        let out = self.client(&[
            "iperf3",
            "-c",
            &self.target.to_string(),
            "-p",
            &IPERF_PORT.to_string(),
            "-t",
            &seconds.to_string(),
            "-O",
            &OMIT_SECONDS.to_string(),
            "-J",
        ]);
        let t = parse_iperf3(&String::from_utf8_lossy(&out.stdout))?;
        if !out.status.success() {
            return Err(format!("exit status {}", out.status));
        }
        let carried = tx_bytes(host, &self.via)?.saturating_sub(before);
        if carried < t.bytes {
            return Err(format!(
                "{} bytes left through {} for iperf3's {}: not the path measured",
                carried, self.via, t.bytes
            ));
        }
        Ok(t)
    }

    fn round_trips(&self, seconds: u64) -> Result<RoundTrips, String> {
        let out = self.client(&[
            "sockperf",
            "ping-pong",
            "--tcp",
            "-i",
            &self.target.to_string(),
            "-p",
            &SOCKPERF_PORT.to_string(),
            "-t",
            &seconds.to_string(),
            "-m",
            &MESSAGE_BYTES.to_string(),
            "--full-rtt",
        ]);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if !out.status.success() {
            return Err(format!(
                "exit status {}: {}",
                out.status,
                first_lines(&strip_ansi(&text), 6)
            ));
        }
        parse_sockperf(&text)
    }

    fn result(self) -> PathResult {
        PathResult {
            kind: self.kind,
            shape: Some(self.shape),
            samples: self.samples,
        }
    }
}

/// The device of `ip route get <to>` in `ns`.
fn route_dev(ns: &Netns, to: IpAddr) -> Result<String, String> {
    ns.ip_json(&["route", "get", &to.to_string()])
        .first()
        .and_then(|r| r["dev"].as_str().map(str::to_owned))
        .ok_or_else(|| format!("no route to {to} in {}", ns.name()))
}

/// `ip -j <flags> link show dev <dev>` in `ns`.
fn link(ns: &Netns, dev: &str, flags: &[&str]) -> Result<Value, String> {
    let mut args = flags.to_vec();
    args.extend(["link", "show", "dev", dev]);
    ns.ip_json(&args)
        .into_iter()
        .next()
        .ok_or_else(|| format!("no link {dev} in {}", ns.name()))
}

/// The link's kind (`veth`, `vxlan`, ...), or "?".
fn link_kind(ns: &Netns, dev: &str) -> String {
    link(ns, dev, &["-d"])
        .ok()
        .and_then(|l| l["linkinfo"]["info_kind"].as_str().map(str::to_owned))
        .unwrap_or_else(|| "?".to_owned())
}

/// The bytes `dev` has sent.
fn tx_bytes(ns: &Netns, dev: &str) -> Result<u64, String> {
    link(ns, dev, &["-s"])?["stats64"]["tx"]["bytes"]
        .as_u64()
        .ok_or_else(|| format!("no tx counter on {dev} in {}", ns.name()))
}

/// One iperf3 run's result.
#[derive(Debug, PartialEq)]
struct Throughput {
    /// Received, bit/s.
    bps: u64,
    /// Bytes sent in the measured seconds.
    bytes: u64,
    retransmits: u64,
}

/// Reads `iperf3 -J`'s result: the receiver's rate, the sender's bytes and
/// retransmits; iperf3's own error if it has one.
fn parse_iperf3(json: &str) -> Result<Throughput, String> {
    let v: Value = serde_json::from_str(json)
        .map_err(|e| format!("not iperf3's JSON ({e}): {}", first_lines(json, 3)))?;
    if let Some(e) = v["error"].as_str() {
        return Err(e.to_owned());
    }
    let end = &v["end"];
    let field = |x: &Value, what: &str| {
        x.as_f64()
            .ok_or_else(|| format!("no {what} in iperf3's result"))
    };
    Ok(Throughput {
        bps: field(&end["sum_received"]["bits_per_second"], "received rate")? as u64,
        bytes: field(&end["sum_sent"]["bytes"], "bytes sent")? as u64,
        retransmits: field(&end["sum_sent"]["retransmits"], "retransmits")? as u64,
    })
}

/// One sockperf ping-pong run's round trips.
#[derive(Debug, PartialEq)]
struct RoundTrips {
    p50: Duration,
    p99: Duration,
    avg: Duration,
}

/// Reads `sockperf ping-pong --full-rtt`'s summary (its colour codes
/// removed): the median, the 99th percentile and the average round trip,
/// in µs. A run that lost, duplicated or reordered a message, or counted
/// none, is an error.
fn parse_sockperf(text: &str) -> Result<RoundTrips, String> {
    let text = strip_ansi(text);
    let number = |key: &str| -> Result<f64, String> {
        text.lines()
            .find_map(|l| {
                let rest = l.split_once(key)?.1.trim_start();
                let end = rest
                    .find(|c: char| !(c.is_ascii_digit() || c == '.'))
                    .unwrap_or(rest.len());
                rest[..end].parse::<f64>().ok()
            })
            .ok_or_else(|| {
                format!(
                    "no {key:?} in sockperf's output: {}",
                    first_lines(&text, 20)
                )
            })
    };
    let lost = number("# dropped messages =")?
        + number("# duplicated messages =")?
        + number("# out-of-order messages =")?;
    if lost != 0.0 {
        return Err(format!(
            "messages dropped, duplicated or out of order: {text}"
        ));
    }
    if number("Total ")? == 0.0 {
        return Err("no observations".to_owned());
    }
    let us = |key: &str| number(key).map(|us| Duration::from_nanos((us * 1e3).round() as u64));
    Ok(RoundTrips {
        p50: us("percentile 50.000 =")?,
        p99: us("percentile 99.000 =")?,
        avg: us("avg-rtt=")?,
    })
}

fn podnet(dir: &Path, args: &Args, f: &mut Failures) -> Vec<PathResult> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert!(
        cpus >= 2,
        "the data path's clients and servers run on CPUs {CLIENT_CPU} and {SERVER_CPU}: \
         this machine has {cpus}"
    );
    let tetherd = dir.join("tetherd");
    eprintln!(
        "{BENCH}: part 1: the ceiling, tether host-gw (without and with policies) and tether VXLAN, side by side"
    );
    let mut lanes = Vec::new();
    let mut broken = Vec::new();
    for kind in PathKind::ALL {
        let lane = guarded(kind.label(), f, |f| match Lane::open(kind, &tetherd) {
            Ok(lane) => Some(lane),
            Err(e) => {
                f.fail(format!("{}: {e}", kind.label()));
                None
            }
        });
        match lane.flatten() {
            Some(lane) => lanes.push(lane),
            None => broken.push(kind),
        }
    }
    for round in 0..args.rounds as usize {
        for i in 0..lanes.len() {
            let n = lanes.len();
            let lane = &mut lanes[(round + i) % n];
            lane.sample(args.seconds, f);
        }
        let line: Vec<String> = lanes
            .iter()
            .map(|l| {
                format!(
                    "{} {} Gbit/s, {} µs",
                    l.kind.label(),
                    cell(gbits(l.samples.bps.last().copied()), 2),
                    cell(l.samples.p50.last().map(micros), 1)
                )
            })
            .collect();
        eprintln!("{BENCH}: round {round}: {}", line.join("; "));
    }
    let mut results: Vec<PathResult> = lanes.into_iter().map(Lane::result).collect();
    results.extend(broken.into_iter().map(|kind| PathResult {
        kind,
        shape: None,
        samples: PathSamples::default(),
    }));
    results.sort_by_key(|r| PathKind::ALL.iter().position(|k| *k == r.kind));
    results
}

// ---------------------------------------------------------------------------
// Part 2: pod-ready latency on two kubelet nodes

struct PodsReady {
    nodes: Vec<String>,
    /// (node index, latency), in creation order.
    samples: Vec<(usize, Duration)>,
}

fn ready(args: &Args, f: &mut Failures) -> PodsReady {
    eprintln!("{BENCH}: part 2: pod-ready latency on two kubelet nodes");
    let cluster = Topology::kubelet(2).start();
    let image = cluster.build_tether_image("bench");
    cluster.install_tether(&image);
    let names: Vec<String> = cluster
        .nodes()
        .iter()
        .map(|n| n.name().to_owned())
        .collect();
    let cidr: IpNet = POD_CIDR.parse().expect("a CIDR");
    let watch = PodWatch::start(&cluster.api);
    let mut samples = Vec::new();
    for n in 0..args.pods as usize {
        let node = n % names.len();
        let name = format!("r{n}");
        cluster
            .api
            .apply(&busybox_pod(&name, &names[node]).to_string());
        let seen = watch.wait_for(&name, POD_LIMIT, |_, _| true);
        let running = watch.wait_for(&name, POD_LIMIT, |phase, ip| {
            phase == "Running" && !ip.is_empty()
        });
        let (Some(seen), Some(running)) = (seen, running) else {
            f.fail(format!(
                "pod {name} on {} not Running in {POD_LIMIT:?}",
                names[node]
            ));
            continue;
        };
        let pod = cluster
            .api
            .get(&["-n", "default", "pod", &name])
            .unwrap_or(Value::Null);
        let ip = pod["status"]["podIP"].as_str().unwrap_or_default();
        if !ip.parse::<IpAddr>().is_ok_and(|a| cidr.contains(&a)) {
            f.fail(format!("pod {name} got {ip:?}, not an address of {cidr}"));
            continue;
        }
        samples.push((node, running.duration_since(seen)));
    }
    eprintln!("{BENCH}: {} pods Running", samples.len());
    PodsReady {
        nodes: names,
        samples,
    }
}

// ---------------------------------------------------------------------------
// The report

/// `v` with `decimals` decimals, or "–".
fn cell(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "–".to_owned(), |v| format!("{v:.decimals$}"))
}

fn micros(d: &Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn gbits(bps: Option<u64>) -> Option<f64> {
    bps.map(|b| b as f64 / 1e9)
}

/// The first line of `<tool> <flag>`'s output (either stream), colour
/// codes removed.
fn version(tool: &str, flag: &str) -> String {
    Command::new(tool)
        .arg(flag)
        .output()
        .map(|o| {
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
            strip_ansi(&first_lines(&text, 1)).trim().to_owned()
        })
        .unwrap_or_else(|_| "unknown".to_owned())
}

fn report(
    run: &Run,
    args: &Args,
    podnet: Option<&[PathResult]>,
    ready: Option<&PodsReady>,
) -> String {
    let m = &run.machine;
    let mut r = Report::new("Pod to pod across two nodes", run);
    r.item(format!(
        "Software: tether {} (`--release`); {}; {}; Debian etcd-server {}; kernel {}.",
        m.tether_version,
        version("iperf3", "--version"),
        version("sockperf", "--version").replace("sockperf: ", ""),
        stdout_of("dpkg-query", &["-W", "-f", "${Version}", "etcd-server"]),
        m.kernel
    ))
    .command(run, "");
    if args.parts.podnet {
        podnet_report(&mut r, args, podnet);
    }
    if args.parts.ready {
        ready_report(&mut r, args, ready);
    }
    r.finish(run)
}

fn podnet_report(r: &mut Report, args: &Args, results: Option<&[PathResult]>) {
    r.paragraph("### TCP throughput and request/response latency");
    r.paragraph(format!(
        "From a pod on one node to a pod on the other, IPv4, over four paths built side \
         by side: **the ceiling**, two netns joined directly by one veth pair ({} and {}); \
         **tether host-gw**, a 2-node cluster (real `tetherd`s in their node netns on a \
         fabric bridge, `--overlay none`), a pod added on each node through the real plugin, \
         so a packet crosses the pod's veth, node 0's routes, node 0's uplink veth, the \
         fabric's bridge, node 1's uplink veth and node 1's routes to the other pod's veth; \
         **tether host-gw with 1,000 policies**, the same with the Kubernetes API and \
         `--network-policy`, both pods API objects, and {POLICIES} NetworkPolicies isolating \
         the receiver, each allowing one address that is no pod's and the last the sender, \
         so that the first packet of each connection passes every other rule of the \
         receiver's chain before the one that lets it in (the packets after it are \
         `established`, which the table lets pass before any rule); \
         **tether VXLAN**, the same with `--overlay vxlan`, whose pods get the VXLAN \
         device's MTU ({VXLAN_POD_MTU}) by default. The clusters keep their records in \
         a one-member etcd, which decides which routes exist, not how packets travel. Each \
         path first had to answer a ping between its two pods. Servers run in the receiving \
         pod's netns on CPU {SERVER_CPU}, clients in the sender's on CPU {CLIENT_CPU} (`ip \
         netns exec`, `taskset`: as on two machines, each end has a CPU of its own; left to \
         the scheduler, the two ends sometimes share one, and a round trip on one CPU of \
         this VM is several times shorter than across two). Rounds: {}; in each, every \
         path in turn (the order rotating) gets one iperf3 sample (one TCP stream, {} s \
         measured after {OMIT_SECONDS} s left out) and then one sockperf sample (`sockperf \
         ping-pong --tcp -m {MESSAGE_BYTES} --full-rtt`, {} s: one {MESSAGE_BYTES}-byte \
         message, its echo, the next; round trips in µs). Every iperf3 sample also checked \
         that the sending host's device named by its route to the receiver (the \"out \
         through\" column) sent at least the bytes iperf3 counted. The tables give the \
         median over rounds, and the lowest and highest sample.",
        CEILING_ADDRS[0], CEILING_ADDRS[1], args.rounds, args.seconds, args.seconds
    ));
    let Some(results) = results else {
        r.paragraph("No results: the part failed.");
        return;
    };
    let ceiling = results
        .iter()
        .find(|p| p.kind == PathKind::Ceiling)
        .map(|p| &p.samples);
    let ceiling_bps = ceiling.and_then(|c| percentile(&c.bps, 0.5));
    let mut throughput = Table::new(&[
        "path",
        "sender's MTU",
        "out through",
        "samples",
        "Gbit/s, median",
        "lowest",
        "highest",
        "of the ceiling",
        "retransmits, median",
    ])
    .right_aligned(&[1, 3, 4, 5, 6, 7, 8]);
    for p in results {
        let (s, shape) = (&p.samples, p.shape.as_ref());
        let median = percentile(&s.bps, 0.5);
        let share = match (median, ceiling_bps) {
            (Some(a), Some(c)) if c > 0 => format!("{:.0} %", a as f64 / c as f64 * 100.0),
            _ => "–".to_owned(),
        };
        throughput.row([
            p.kind.label().to_owned(),
            shape.map_or_else(|| "–".to_owned(), |s| s.mtu.to_string()),
            shape.map_or_else(|| "–".to_owned(), |s| s.via.clone()),
            s.bps.len().to_string(),
            cell(gbits(median), 2),
            cell(gbits(s.bps.iter().min().copied()), 2),
            cell(gbits(s.bps.iter().max().copied()), 2),
            share,
            cell(percentile(&s.retransmits, 0.5).map(|n| n as f64), 0),
        ]);
    }
    r.table(&throughput);
    let ceiling_p50 = ceiling.and_then(|c| percentile(&c.p50, 0.5));
    let mut round_trips = Table::new(&[
        "path",
        "samples",
        "round trip p50 µs, median",
        "p50 lowest",
        "p50 highest",
        "p99 µs, median",
        "average µs, median",
        "p50 over the ceiling's, µs",
    ])
    .right_aligned_from(1);
    for p in results {
        let s = &p.samples;
        let p50 = percentile(&s.p50, 0.5);
        let over = match (p50, ceiling_p50) {
            (Some(a), Some(c)) => Some(micros(&a) - micros(&c)),
            _ => None,
        };
        round_trips.row([
            p.kind.label().to_owned(),
            s.p50.len().to_string(),
            cell(p50.as_ref().map(micros), 1),
            cell(s.p50.iter().min().map(micros), 1),
            cell(s.p50.iter().max().map(micros), 1),
            cell(percentile(&s.p99, 0.5).as_ref().map(micros), 1),
            cell(percentile(&s.avg, 0.5).as_ref().map(micros), 1),
            cell(over, 1),
        ]);
    }
    r.table(&round_trips);
}

fn ready_report(r: &mut Report, args: &Args, ready: Option<&PodsReady>) {
    r.paragraph("### Pod-ready latency on two kubelet nodes");
    r.paragraph(format!(
        "Two kubelet nodes, each in its own network, mount and PID namespaces, with Debian's \
         containerd and runc and kube-proxy (tests/src/kube_cluster.rs); tether installed by its \
         Helm chart in its default mode (the Kubernetes store), its image built from the \
         release binaries. {} busybox pods created one after the other, alternating nodes \
         (pods name their node: no scheduler), each waited for until Running, and kept. \
         Latency, as `tether-bench kubelet` measures it: the API's first report of a pod to its \
         report as Running with an IP, both through one `kubectl get pods --watch`; every \
         pod's IP must be in {POD_CIDR}. The one-node figure of the same machine is \
         `tether-bench kubelet`'s, in its section (\"Pod-ready latency through the kubelet\"); it \
         was not run again here.",
        args.pods
    ));
    let Some(ready) = ready else {
        r.paragraph("No results: the part failed.");
        return;
    };
    let mut groups = vec![("both nodes".to_owned(), None)];
    for (i, name) in ready.nodes.iter().enumerate() {
        groups.push((format!("node {i} ({name})"), Some(i)));
    }
    let mut t = Table::new(&[
        "pods on",
        "pods",
        "p50 ms",
        "p90 ms",
        "max ms",
        "mean ms",
        "first pod ms",
    ])
    .right_aligned_from(1);
    for (label, node) in groups {
        let v: Vec<Duration> = ready
            .samples
            .iter()
            .filter(|(n, _)| node.is_none_or(|i| i == *n))
            .map(|(_, d)| *d)
            .collect();
        let mean = (!v.is_empty()).then(|| v.iter().sum::<Duration>() / v.len() as u32);
        let ms = |d: Option<Duration>| cell(d.map(|d| d.as_secs_f64() * 1e3), 0);
        t.row([
            label,
            v.len().to_string(),
            ms(percentile(&v, 0.5)),
            ms(percentile(&v, 0.9)),
            ms(v.iter().max().copied()),
            ms(mean),
            ms(v.first().copied()),
        ]);
    }
    r.table(&t);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sockperf_round_trips_are_read_from_its_coloured_summary() {
        let out = "sockperf: \u{1b}[2;35m== version #3.7-no.git == \u{1b}[0m\n\
            sockperf: [Total Run] RunTime=2.000 sec; Warm up time=400 msec; SentMessages=96780; ReceivedMessages=96779\n\
            sockperf: [Valid Duration] RunTime=1.550 sec; SentMessages=83929; ReceivedMessages=83929\n\
            sockperf: \u{1b}[2;35m====> avg-rtt=18.446 (std-dev=27.114)\u{1b}[0m\n\
            sockperf: # dropped messages = 0; # duplicated messages = 0; # out-of-order messages = 0\n\
            sockperf: Summary: Round trip is 18.446 usec\n\
            sockperf: \u{1b}[2;35mTotal 83929 observations\u{1b}[0m; each percentile contains 839.29 observations\n\
            sockperf: ---> <MAX> observation = 4272.449\n\
            sockperf: ---> percentile 99.000 =   65.416\n\
            sockperf: ---> percentile 90.000 =   19.508\n\
            sockperf: ---> percentile 50.000 =   13.930\n\
            sockperf: ---> <MIN> observation =   13.600\n";
        assert_eq!(
            parse_sockperf(out),
            Ok(RoundTrips {
                p50: Duration::from_nanos(13_930),
                p99: Duration::from_nanos(65_416),
                avg: Duration::from_nanos(18_446),
            })
        );
        let lossy = out.replace("# dropped messages = 0", "# dropped messages = 2");
        assert!(parse_sockperf(&lossy).unwrap_err().contains("dropped"));
        assert!(parse_sockperf("sockperf: connection refused")
            .unwrap_err()
            .contains("no \"# dropped messages =\""));
    }

    #[test]
    fn iperf3_json_gives_the_received_rate_or_its_error() {
        let ok = r#"{"start": {}, "end": {"sum_sent": {"bytes": 5000000000, "retransmits": 12,
            "bits_per_second": 10.1e9}, "sum_received": {"bits_per_second": 1.0e10}}}"#;
        assert_eq!(
            parse_iperf3(ok),
            Ok(Throughput {
                bps: 10_000_000_000,
                bytes: 5_000_000_000,
                retransmits: 12,
            })
        );
        let refused = r#"{"start": {}, "end": {}, "error": "unable to connect to server: Connection refused"}"#;
        assert_eq!(
            parse_iperf3(refused),
            Err("unable to connect to server: Connection refused".to_owned())
        );
        assert!(parse_iperf3("").is_err());
    }

    #[test]
    fn parts_name_what_runs() {
        let p = parse_parts("ready").unwrap();
        assert!(p.ready && !p.podnet);
        let p = parse_parts("podnet,ready").unwrap();
        assert!(p.ready && p.podnet);
        assert!(parse_parts("podnet,nope").is_err());
    }

    #[test]
    fn flags_keep_their_old_defaults() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: Args,
        }
        let a = Cli::try_parse_from(["nodes"]).unwrap().args;
        assert_eq!((a.rounds, a.seconds, a.pods), (7, 3, 20));
        assert!(a.parts.podnet && a.parts.ready && a.common.build());
        let a = Cli::try_parse_from(["nodes", "--parts", "ready", "--pods", "4"])
            .unwrap()
            .args;
        assert!(a.parts.ready && !a.parts.podnet && a.pods == 4);
        assert!(Cli::try_parse_from(["nodes", "--seconds", "0"]).is_err());
    }
}
