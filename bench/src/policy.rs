//! NetworkPolicy's costs (issue 39), on a cluster of real `tetherd`s
//! (etcd store, the Kubernetes API for the policies, `--network-policy`):
//!
//! 1. **Creation to enforcement.** With `--counts` policies in the
//!    cluster (1, 100, 1,000: each selecting pods that are only API
//!    objects, so they cost every node its plan, not table rules) and
//!    `--addresses` pod addresses (pods that are only API objects with an
//!    address in their status), a policy is created that isolates one real
//!    pod on each of two nodes and lets in only those addresses: new TCP
//!    connections from a real pod on the other node to each, one every
//!    [`PROBE_INTERVAL`], stop getting through. The time from the start of
//!    `kubectl create` to the first try after the last that got through,
//!    per node; "every node" is the later
//!    of the two. The policy is deleted, and both pods answered again,
//!    before the next trial. A first trial at each count is not counted
//!    (the watches' backlog of the new policies).
//! 2. **ADD latency.** `--adds` pods (API objects first, as a kubelet's
//!    pods are) added through the real plugin on a node with
//!    `--network-policy` and on one without, alternating, in the same
//!    cluster: once with the largest count of policies in the cluster,
//!    once with none.
//!
//! The data path with 1,000 policies against none is `tether-bench
//! nodes`' (its policy path beside host-gw).
//!
//! Run (as root): `cargo run --release -p tether-bench -- policy
//! [--counts 1,100,1000] [--addresses 5000] [--trials 10] [--adds 30]
//! [--no-build] [--write BENCHMARKS.md]`.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tether_e2e::cluster::{Cluster, ClusterNode, NodeOpts, Pod, Store};
use tether_e2e::denied::Denied;
use tether_e2e::kube::{KubeApi, TETHER_SA};
use tether_e2e::streams::Proto;
use tether_e2e::topology::Topology;
use tether_e2e::{netpol, ping, wait_until, TempDir};

use crate::kit::{percentile, release_dir, Benchmark, CommonArgs, Failures, Report, Run, Table};

/// The progress log's prefix.
const BENCH: &str = <Args as Benchmark>::NAME;
/// The benchmark's namespace.
const NS: &str = "bench-policy";
/// One new connection every this, from each client.
const PROBE_INTERVAL: Duration = Duration::from_millis(10);
/// The targets' port the probes connect to.
const PROBE_PORT: u16 = 7100;
/// A probe run this long without an answer: the policy is in force.
const DENIED_FOR: Duration = Duration::from_secs(1);
/// The longest a trial's flip, or its undoing, may take.
const FLIP_LIMIT: Duration = Duration::from_secs(60);
/// How many groups the address-only pods fall in (a background policy
/// selects one group and lets in another).
const GROUPS: usize = 50;
/// The node the address-only pods name (no such node runs).
const GHOST_NODE: &str = "ghost";

/// `tether-bench policy`'s flags.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The counts of policies in the cluster at which creation to
    /// enforcement is measured, comma-separated, ascending.
    #[arg(
        long,
        value_name = "LIST",
        default_value = "1,100,1000",
        value_delimiter = ','
    )]
    counts: Vec<usize>,
    /// Pods that are only API objects with an address.
    #[arg(long, default_value_t = 5000)]
    addresses: usize,
    /// Trials at each count (after one not counted).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    trials: u64,
    /// ADDs on each node, at each of the two counts.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    adds: u64,
    #[command(flatten)]
    common: CommonArgs,
}

/// Creation to enforcement at one count: per trial, each node's time.
struct Flips {
    policies: usize,
    /// (node 0's, node 1's) per trial counted.
    trials: Vec<(Duration, Duration)>,
    /// How long `kubectl create` itself took, per trial.
    kubectl: Vec<Duration>,
}

/// ADD latency at one count of policies.
struct Adds {
    policies: usize,
    on: Vec<Duration>,
    off: Vec<Duration>,
}

/// What the run measured.
pub struct Measured {
    flips: Vec<Flips>,
    adds: Vec<Adds>,
}

impl Benchmark for Args {
    const NAME: &'static str = "policy";
    const SECTION: &'static str = "bench-policy";
    /// The directory of the release `tether` and `tetherd`.
    type Ready = PathBuf;
    type Measured = Measured;

    fn common(&self) -> &CommonArgs {
        &self.common
    }

    fn prepare(&self) -> Result<PathBuf, String> {
        if self.counts.is_empty() || self.counts.windows(2).any(|w| w[0] >= w[1]) {
            return Err(format!(
                "--counts must be ascending and not empty: {:?}",
                self.counts
            ));
        }
        release_dir(BENCH, self.common.build())
    }

    fn measure(&self, dir: &PathBuf, failures: &mut Failures) -> Measured {
        crate::kit::guarded("policy", failures, |f| measure(self, dir, f)).unwrap_or(Measured {
            flips: Vec::new(),
            adds: Vec::new(),
        })
    }

    fn report(&self, run: &Run, _: &PathBuf, measured: &Measured) -> String {
        report(run, self, measured)
    }
}

/// The cluster's node options: release binaries, the daemon's own lease
/// defaults (a busy machine never reaps a node mid-run), `extra`.
fn node_opts(tetherd: &Path, extra: Vec<String>) -> NodeOpts {
    NodeOpts {
        lease_ttl_secs: 15,
        node_grace_secs: 600,
        log_level: Some("info".to_owned()),
        bin: Some(tetherd.to_path_buf()),
        extra_args: extra,
        ..NodeOpts::default()
    }
}

fn measure(args: &Args, dir: &Path, f: &mut Failures) -> Measured {
    let tetherd = dir.join("tetherd");
    let mut cluster = Topology::tetherd(2)
        .store(Store::Etcd)
        .etcd_members(1)
        .with_api(true)
        .node(node_opts(
            &tetherd,
            vec!["--network-policy=true".to_owned()],
        ))
        .start();
    // A third node, without NetworkPolicy, for ADD's latency beside it.
    let (ns, sa) = TETHER_SA;
    let kubeconfig = cluster.kube_api().token_kubeconfig(ns, sa);
    let off = cluster.add_node_with(&node_opts(
        &tetherd,
        vec!["--kubeconfig".to_owned(), kubeconfig.display().to_string()],
    ));
    let api = cluster.kube_api();
    netpol::namespace(api, NS, json!({}));
    eprintln!("{BENCH}: {} address-only pods", args.addresses);
    address_pods(api, args.addresses);
    // A target on each node, and a client on the other.
    let targets = [
        netpol::api_pod(api, cluster.node(0), NS, "target-0", "target"),
        netpol::api_pod(api, cluster.node(1), NS, "target-1", "target"),
    ];
    let clients = [
        netpol::api_pod(api, cluster.node(1), NS, "client-0", "client"),
        netpol::api_pod(api, cluster.node(0), NS, "client-1", "client"),
    ];
    for t in &targets {
        if let Err(e) = listen(t) {
            f.fail(e);
            return Measured {
                flips: Vec::new(),
                adds: Vec::new(),
            };
        }
    }
    let mut flips = Vec::new();
    let mut made = 0;
    for &count in &args.counts {
        background_policies(api, made, count);
        made = count;
        eprintln!("{BENCH}: {count} policies in the cluster");
        let mut at = Flips {
            policies: count,
            trials: Vec::new(),
            kubectl: Vec::new(),
        };
        for trial in 0..=args.trials {
            match flip(api, &targets, &clients) {
                Ok((times, kubectl)) => {
                    eprintln!(
                        "{BENCH}: {count} policies, trial {trial}: {:.0} and {:.0} ms",
                        ms_f(times.0),
                        ms_f(times.1)
                    );
                    if trial > 0 {
                        at.trials.push(times);
                        at.kubectl.push(kubectl);
                    }
                }
                Err(e) => f.fail(format!("{count} policies, trial {trial}: {e}")),
            }
        }
        flips.push(at);
    }
    let mut adds = Vec::new();
    let most = made;
    adds.push(add_latency(&cluster, off, args.adds, most, "many"));
    api.kubectl_ok(&["-n", NS, "delete", "networkpolicy", "--all"]);
    adds.push(add_latency(&cluster, off, args.adds, 0, "none"));
    Measured { flips, adds }
}

/// Creates `n` pods that are only API objects, labelled `role=member` and
/// `group=g<i mod GROUPS>`, each with an address in its status (ports of
/// 10.200.0.0/16 no node routes).
fn address_pods(api: &KubeApi, n: usize) {
    let dir = TempDir::new("pol");
    for (chunk, first) in (0..n).step_by(1000).enumerate() {
        let items: Vec<Value> = (first..n.min(first + 1000))
            .map(|i| {
                let mut p = netpol::pod_manifest(
                    NS,
                    &format!("m{i:05}"),
                    GHOST_NODE,
                    json!({"role": "member", "group": format!("g{}", i % GROUPS)}),
                );
                let ip = format!("10.200.{}.{}", i / 250, i % 250 + 1);
                p["status"] = netpol::running_status(&[ip]);
                p
            })
            .collect();
        let file = dir.path().join(format!("pods{chunk}.json"));
        std::fs::write(&file, netpol::list(items).to_string()).expect("writing the pods");
        let path = file.display().to_string();
        // create ignores the status; the status subresource takes it.
        api.kubectl_ok(&["create", "-f", &path]);
        api.kubectl_ok(&["replace", "--subresource=status", "-f", &path]);
    }
}

/// Makes the background policies `from..to`: policy i selects the
/// address-only pods of one group and lets in those of the next, on its
/// own port (so no two are alike).
fn background_policies(api: &KubeApi, from: usize, to: usize) {
    let items: Vec<Value> = (from..to)
        .map(|i| {
            netpol::policy(
                NS,
                &format!("bg{i:05}"),
                json!({"podSelector": {"matchLabels": {"group": format!("g{}", i % GROUPS)}},
                       "policyTypes": ["Ingress"],
                       "ingress": [{"from": [{"podSelector": {"matchLabels":
                                       {"group": format!("g{}", (i + 1) % GROUPS)}}}],
                                    "ports": [{"port": 1000 + i}]}]}),
            )
        })
        .collect();
    if !items.is_empty() {
        api.apply(&netpol::list(items).to_string());
    }
}

/// A TCP listener in `pod`'s netns on [`PROBE_PORT`] that takes every
/// connection and closes it, for as long as the benchmark runs.
fn listen(pod: &Pod) -> Result<(), String> {
    let path = pod.netns().path().to_owned();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let bound = tether_e2e::enter_netns_at(&path)
            .and_then(|()| std::net::TcpListener::bind(("0.0.0.0", PROBE_PORT)));
        match bound {
            Ok(l) => {
                let _ = tx.send(Ok(()));
                for conn in l.incoming() {
                    drop(conn);
                }
            }
            Err(e) => {
                let _ = tx.send(Err(e.to_string()));
            }
        }
    });
    rx.recv()
        .map_err(|e| e.to_string())
        .and_then(|r| r)
        .map_err(|e| format!("listening in {}: {e}", pod.id()))
}

/// One trial: creates the policy that isolates both targets, times each
/// node's flip, deletes it and waits until both targets answer again.
/// Returns (node 0's, node 1's) times and `kubectl create`'s own.
///
/// The probe is a new TCP connection to the target every
/// [`PROBE_INTERVAL`] ([`Denied`]): a ping, one ICMP flow, would stay
/// `established` through the policy, as any connection open before it.
fn flip(
    api: &KubeApi,
    targets: &[Pod; 2],
    clients: &[Pod; 2],
) -> Result<((Duration, Duration), Duration), String> {
    let ips: Vec<IpAddr> = targets
        .iter()
        .map(|t| {
            t.v4()
                .ok_or_else(|| format!("{} has no IPv4 address", t.id()))
        })
        .collect::<Result<_, _>>()?;
    let probes: Vec<Denied> = clients
        .iter()
        .zip(&ips)
        .map(|(c, ip)| {
            Denied::start(
                c.netns(),
                c.id(),
                SocketAddr::new(*ip, PROBE_PORT),
                // No one answers UDP there: only the TCP tries count.
                SocketAddr::new(*ip, PROBE_PORT),
                PROBE_INTERVAL,
            )
        })
        .collect();
    let open = wait_until(FLIP_LIMIT, || {
        probes.iter().all(|p| {
            p.passed_since(Instant::now() - Duration::from_millis(200))
                .0
                > 0
        })
    });
    if !open {
        return Err("a target did not answer before the policy".into());
    }
    let policy = netpol::policy(
        NS,
        "isolate-targets",
        json!({"podSelector": {"matchLabels": {"app": "target"}}, "policyTypes": ["Ingress"],
               "ingress": [{"from": [{"podSelector": {"matchLabels": {"role": "member"}}}]}]}),
    );
    let created = Instant::now();
    api.apply(&policy.to_string());
    let kubectl = created.elapsed();
    let denied = wait_until(FLIP_LIMIT, || {
        let since = Instant::now() - DENIED_FOR;
        since > created && probes.iter().all(|p| p.passed_since(since).0 == 0)
    });
    let reports: Vec<_> = probes.into_iter().map(Denied::stop).collect();
    api.kubectl_ok(&["-n", NS, "delete", "networkpolicy", "isolate-targets"]);
    if !denied {
        return Err(format!(
            "the policy was not in force on both nodes in {FLIP_LIMIT:?}"
        ));
    }
    // The first try after the last that got through: at most one
    // interval after the last one.
    let times: Vec<Duration> = reports
        .iter()
        .map(|r| {
            r.passed
                .iter()
                .filter(|p| p.proto == Proto::Tcp)
                .map(|p| p.at)
                .max()
                .map_or(Duration::ZERO, |last| {
                    (last + PROBE_INTERVAL).saturating_duration_since(created)
                })
        })
        .collect();
    let back = wait_until(FLIP_LIMIT, || {
        clients.iter().zip(&ips).all(|(c, ip)| ping(c.netns(), *ip))
    });
    if !back {
        return Err("a target still did not answer after the policy's deletion".into());
    }
    Ok(((times[0], times[1]), kubectl))
}

/// `n` ADDs on node 0 (NetworkPolicy on) and on node `off` (off),
/// alternating, of pods made in the API first; each DELeted after.
fn add_latency(cluster: &Cluster, off: usize, n: u64, policies: usize, tag: &str) -> Adds {
    let api = cluster.kube_api();
    let nodes: [&ClusterNode; 2] = [cluster.node(0), cluster.node(off)];
    let names =
        |side: usize| -> Vec<String> { (0..n).map(|i| format!("add-{tag}-{side}-{i}")).collect() };
    let mut items = Vec::new();
    for (side, node) in nodes.iter().enumerate() {
        for name in names(side) {
            items.push(netpol::pod_manifest(
                NS,
                &name,
                node.name(),
                json!({"app": "add"}),
            ));
        }
    }
    api.apply(&netpol::list(items).to_string());
    // As a kubelet's ADD comes after the pod was scheduled: the watch has
    // it.
    std::thread::sleep(Duration::from_secs(3));
    let mut out = Adds {
        policies,
        on: Vec::new(),
        off: Vec::new(),
    };
    let mut wired = Vec::new();
    for i in 0..n as usize {
        for (side, node) in nodes.iter().enumerate() {
            let name = &names(side)[i];
            let (pod, took) = netpol::wire(node, NS, name);
            if side == 0 {
                out.on.push(took);
            } else {
                out.off.push(took);
            }
            wired.push((side, pod, name.clone()));
        }
    }
    for (side, pod, name) in wired {
        let node = nodes[side];
        let args = format!("IgnoreUnknown=1;K8S_POD_NAMESPACE={NS};K8S_POD_NAME={name}");
        let del = node.call_with("DEL", pod.netns(), pod.id(), &node.netconf(), Some(&args));
        if !del.success() {
            eprintln!("{BENCH}: DEL of {name}: {del}");
        }
    }
    api.kubectl_ok(&["-n", NS, "delete", "pods", "-l", "app=add", "--wait=false"]);
    out
}

fn ms_f(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn ms(d: Option<Duration>) -> String {
    d.map_or("-".to_owned(), |d| format!("{:.0}", ms_f(d)))
}

fn ms2(d: Option<Duration>) -> String {
    d.map_or("-".to_owned(), |d| format!("{:.2}", ms_f(d)))
}

fn report(run: &Run, args: &Args, m: &Measured) -> String {
    let mut r = Report::new("NetworkPolicy", run);
    r.item(format!(
        "tether {} (release binaries): two nodes with `--network-policy` and a third without, on a one-member etcd, with a kube-apiserver for the policies (the chart's service account).",
        run.machine.tether_version
    ))
    .command(run, "");
    r.paragraph("### Creation to enforcement");
    r.paragraph(format!(
        "{} pods that are only API objects, each with an address in its status (`role=member`, in {GROUPS} groups); the policies in the cluster each select one group and let in the next, on a port of their own, so they select no pod of these nodes: they cost each node its plan, not rules in its table. The measured policy selects one real pod on each of the two nodes (`app=target`) and lets in only the {} addresses; a real pod on the other node opens a new TCP connection to each target every {} ms (a ping would not do: one ICMP flow stays `established` through a new policy, as any open connection does). The time: from the start of `kubectl create` to the first try after the last that connected (so at most one interval late), per node; \"every node\" is the later of the two. {} trials per count after one not counted; the policy is deleted and both targets answer again between trials. p99 of {} trials is their maximum.",
        args.addresses,
        args.addresses,
        PROBE_INTERVAL.as_millis(),
        args.trials,
        args.trials
    ));
    let mut t = Table::new(&[
        "policies in the cluster",
        "trials",
        "every node p50 ms",
        "every node p99 ms",
        "node 0 p50 ms",
        "node 1 p50 ms",
        "kubectl create p50 ms",
    ])
    .right_aligned_from(1);
    for fl in &m.flips {
        let every: Vec<Duration> = fl.trials.iter().map(|(a, b)| *a.max(b)).collect();
        let n0: Vec<Duration> = fl.trials.iter().map(|t| t.0).collect();
        let n1: Vec<Duration> = fl.trials.iter().map(|t| t.1).collect();
        t.row([
            fl.policies.to_string(),
            fl.trials.len().to_string(),
            ms(percentile(&every, 0.5)),
            ms(every.iter().max().copied()),
            ms(percentile(&n0, 0.5)),
            ms(percentile(&n1, 0.5)),
            ms(percentile(&fl.kubectl, 0.5)),
        ]);
    }
    r.table(&t);
    r.paragraph("### ADD latency, NetworkPolicy on against off");
    r.paragraph(format!(
        "{} pods per node, API objects first (the watch has them before their ADD, as a kubelet's pods), then added through the real plugin (`tether` to `tetherd`, the plugin's process included), alternating between a node with `--network-policy` and one without, in the same cluster; each DELeted after. With NetworkPolicy, an ADD returns once its node's table holds the pod. The {} address-only pods stay in the API throughout, also when no policy is left.",
        args.adds, args.addresses
    ));
    let mut t = Table::new(&[
        "policies in the cluster",
        "NetworkPolicy",
        "ADDs",
        "p50 ms",
        "p90 ms",
        "max ms",
    ])
    .right_aligned_from(2);
    let mut gaps = Vec::new();
    for a in &m.adds {
        for (label, v) in [("on", &a.on), ("off", &a.off)] {
            t.row([
                a.policies.to_string(),
                label.to_owned(),
                v.len().to_string(),
                ms2(percentile(v, 0.5)),
                ms2(percentile(v, 0.9)),
                ms2(v.iter().max().copied()),
            ]);
        }
        if let (Some(on), Some(off)) = (percentile(&a.on, 0.5), percentile(&a.off, 0.5)) {
            gaps.push(format!(
                "{} policies: {:+.2} ms",
                a.policies,
                ms_f(on) - ms_f(off)
            ));
        }
    }
    r.table(&t);
    if !gaps.is_empty() {
        r.paragraph(format!(
            "On against off at p50 (the goal: within 0.5 ms): {}.",
            gaps.join("; ")
        ));
    }
    r.finish(run)
}
