//! tether as another plugin's IPAM, against Debian's `host-local`, both as
//! the IPAM of Debian's real `macvlan` plugin, side by side in one run:
//!
//! 1. **One node.** One `tetherd` (embedded store, a named pool) in a node
//!    netns with two macvlan masters (veth pairs): "macvlan + tether" on one,
//!    "macvlan + host-local" on the other. Sequential cycles of ADD then DEL,
//!    each into a fresh pod netns, the two sides interleaved cycle by cycle
//!    (order alternating): p50 and p99 of ADD, of DEL and of ADD+DEL. Then
//!    `--concurrency` ADDs at once on each side (wall time until the last
//!    answers), then as many DELs; every address distinct, nothing left
//!    held afterwards.
//! 2. **Cluster-wide, 3 nodes on etcd.** A 3-member etcd, 3 nodes, one
//!    pool with `/28` blocks (16 addresses each), so that nodes claim
//!    blocks by compare-and-swap while the benchmark runs. Each node's
//!    macvlan uses its fabric interface as master. Sequential ADDs on node 0
//!    (pods kept, so a block claim lands every 16): p50 and p99; then
//!    `--concurrency` ADDs spread over the 3 nodes at once: wall time, and
//!    no address twice across the cluster; then every DEL.
//!
//! Every plugin process is the real main plugin (`macvlan`) exec'ing its
//! IPAM, spawned from a thread in the node netns, timed from spawn to reap:
//! what a runtime waits for.
//!
//! Phase 1 has a third side, "macvlan + whereabouts": whereabouts v0.9.2
//! (the IPAM macvlan migration networks usually use), built from its Go
//! module by `tests/k8s/build.sh whereabouts`, against a real
//! kube-apiserver (`tether_e2e::kube`, on a fabric the node is attached
//! to), its CRDs as its module ships them. Its failures are results, shown
//! in its row, not failures of the benchmark; what it still holds after
//! every DEL (IPPool allocations, OverlappingRangeIPReservations) is
//! counted.
//!
//! Run (as root): `cargo run --release -p tether-bench -- ipam
//! [--cycles 200] [--warmup 20] [--concurrency 100] [--cluster-adds 60]
//! [--no-build] [--write BENCHMARKS.md]`.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use clap::builder::RangedU64ValueParser;
use serde_json::{json, Value};
use tether_e2e::cluster::{Fabric, NodeOpts};
use tether_e2e::kube::{whereabouts_dir, KubeApi};
use tether_e2e::reference::host_local_leases;
use tether_e2e::topology::Topology;
use tether_e2e::{
    admin, cni, pb, ref_plugin, unique_name, CniEnv, CniOutput, Daemon, DaemonOpts, Netns, TempDir,
};

use crate::kit::{
    guarded, judge, percentile, release_dir, stdout_of, Benchmark, CommonArgs, Failures, Report,
    Run, Table,
};

/// The node's own pod CIDR (unused by the benchmark, required by tetherd).
const POD_CIDR: &str = "10.229.0.0/24";
/// tether's pool of phase 1; /24 blocks, so claims are rare.
const POOLS_ONE: &str =
    r#"{"pools": [{"name": "bench", "cidr": "10.230.0.0/16", "blockSize": 24}]}"#;
/// host-local's range of phase 1.
const HOST_LOCAL_SUBNET: &str = "10.231.0.0/16";
/// whereabouts' range of phase 1.
const WHEREABOUTS_RANGE: &str = "10.233.0.0/16";
/// The namespace the benchmark's pods claim to be in (CNI_ARGS), where
/// whereabouts keeps its reservations.
const POD_NAMESPACE: &str = "bench";
/// The cluster's pool: /28 blocks.
const POOLS_CLUSTER: &str =
    r#"{"pools": [{"name": "bench", "cidr": "10.232.0.0/16", "blockSize": 28}]}"#;

/// `tether-bench ipam`'s flags.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Timed ADD+DEL cycles per side on one node.
    #[arg(long, default_value_t = 200, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    cycles: usize,
    /// Untimed cycles per side before them.
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// ADDs at once (then as many DELs) on each side, and over the cluster's 3 nodes.
    #[arg(long, default_value_t = 100, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    concurrency: usize,
    /// Sequential ADDs on the cluster's node 0, pods kept.
    #[arg(long, default_value_t = 60, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    cluster_adds: usize,
    #[command(flatten)]
    common: CommonArgs,
}

/// What the two phases found; `None` for one that aborted.
pub struct Measured {
    one: Option<OneNode>,
    cluster: Option<ClusterRun>,
}

impl Benchmark for Args {
    const NAME: &'static str = "ipam";
    const SECTION: &'static str = "bench-ipam";
    /// The directory of the release `tether` and `tetherd`.
    type Ready = PathBuf;
    type Measured = Measured;

    fn common(&self) -> &CommonArgs {
        &self.common
    }

    fn prepare(&self) -> Result<PathBuf, String> {
        release_dir(Self::NAME, self.common.build())
    }

    fn measure(&self, bin_dir: &PathBuf, failures: &mut Failures) -> Measured {
        let one = guarded("one node", failures, |f| one_node(bin_dir, self, f));
        let cluster = guarded("cluster", failures, |f| cluster_phase(bin_dir, self, f));
        Measured { one, cluster }
    }

    fn report(&self, run: &Run, _: &PathBuf, measured: &Measured) -> String {
        report(run, self, measured.one.as_ref(), measured.cluster.as_ref())
    }
}

/// A CNI_PATH: Debian's macvlan and host-local, and the release `tether`.
fn plugin_dir(bin_dir: &Path) -> TempDir {
    let dir = TempDir::new("plg");
    let link = |from: PathBuf, name: &str| {
        std::os::unix::fs::symlink(&from, dir.path().join(name))
            .unwrap_or_else(|e| panic!("linking {}: {e}", from.display()))
    };
    link(ref_plugin("macvlan"), "macvlan");
    link(ref_plugin("host-local"), "host-local");
    link(bin_dir.join("tether"), "tether");
    link(whereabouts_dir().join("whereabouts"), "whereabouts");
    dir
}

/// One side: a macvlan netconf and where its plugin runs.
struct Side<'a> {
    label: &'static str,
    node: &'a Netns,
    plugins: &'a Path,
    netconf: Vec<u8>,
    add: Vec<Duration>,
    del: Vec<Duration>,
    cycle: Vec<Duration>,
    /// Its failures are results (another project's IPAM), not the
    /// benchmark's: kept here for the report.
    tolerant: bool,
    errors: Vec<String>,
}

impl<'a> Side<'a> {
    fn new(label: &'static str, node: &'a Netns, plugins: &'a Path, netconf: Value) -> Self {
        Side {
            label,
            node,
            plugins,
            netconf: serde_json::to_vec(&netconf).expect("JSON"),
            add: Vec::new(),
            del: Vec::new(),
            cycle: Vec::new(),
            tolerant: false,
            errors: Vec::new(),
        }
    }

    /// A failure: the benchmark's, or this side's result if it is
    /// tolerant.
    fn failed(&mut self, f: &mut Failures, what: String) {
        if self.tolerant {
            self.errors.push(what);
        } else {
            f.fail(format!("{}: {what}", self.label));
        }
    }

    fn env(&self, command: &str, pod: &Netns) -> CniEnv {
        let mut env = CniEnv::new(command, pod.name(), pod);
        env.ifname = Some("net1".into());
        // As the CRI sends them; whereabouts records the pod it gave an
        // address to.
        env.args = Some(format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE={POD_NAMESPACE};K8S_POD_NAME={}",
            pod.name()
        ));
        env.path = Some(self.plugins.display().to_string());
        env
    }

    fn call(&self, command: &str, pod: &Netns) -> CniOutput {
        let env = self.env(command, pod);
        let bin = self.plugins.join("macvlan");
        self.node.run(|| cni(&bin, &env, &self.netconf))
    }

    /// One timed ADD then DEL; failures counted, not timed.
    fn cycle(&mut self, f: &mut Failures, keep: bool) {
        let pod = Netns::new("bp");
        let add = self.call("ADD", &pod);
        let del = self.call("DEL", &pod);
        match (judge("ADD", &add), judge("DEL", &del)) {
            (Ok(()), Ok(())) => {
                if keep {
                    self.add.push(add.elapsed);
                    self.del.push(del.elapsed);
                    self.cycle.push(add.elapsed + del.elapsed);
                }
            }
            (Err(e), _) | (_, Err(e)) => self.failed(f, e.to_string()),
        }
    }
}

/// One call of a burst: the netns it runs from, the plugin, its
/// environment and its stdin.
type BurstCall<'a> = (&'a Netns, PathBuf, CniEnv, Vec<u8>);

/// Every call at once, each from its own thread in its netns, released
/// together; the wall time from the release to the last answer.
fn burst(calls: &[BurstCall]) -> (Duration, Vec<CniOutput>) {
    let gate = Barrier::new(calls.len() + 1);
    std::thread::scope(|s| {
        let handles: Vec<_> = calls
            .iter()
            .map(|(node, bin, env, stdin)| {
                let gate = &gate;
                s.spawn(move || {
                    node.enter_current_thread();
                    gate.wait();
                    cni(bin, env, stdin)
                })
            })
            .collect();
        gate.wait();
        let start = Instant::now();
        let outs: Vec<CniOutput> = handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect();
        (start.elapsed(), outs)
    })
}

fn first_ip(out: &CniOutput) -> Option<IpAddr> {
    out.json.as_ref()?["ips"][0]["address"]
        .as_str()?
        .parse::<ipnet::IpNet>()
        .ok()
        .map(|n| n.addr())
}

struct Throughput {
    adds: Duration,
    dels: Duration,
    ok: usize,
}

/// `n` concurrent ADDs on `side`, then their DELs; distinct addresses.
fn throughput(side: &mut Side, n: usize, f: &mut Failures) -> Throughput {
    let pods: Vec<Netns> = (0..n).map(|_| Netns::new("bc")).collect();
    let bin = side.plugins.join("macvlan");
    let calls = |command: &str| -> Vec<BurstCall> {
        pods.iter()
            .map(|p| {
                (
                    side.node,
                    bin.clone(),
                    side.env(command, p),
                    side.netconf.clone(),
                )
            })
            .collect()
    };
    let (adds, add_outs) = burst(&calls("ADD"));
    let (dels, del_outs) = burst(&calls("DEL"));
    let mut ips = BTreeSet::new();
    let mut ok = 0;
    for o in &add_outs {
        match judge("ADD", o) {
            Ok(()) => {
                ok += 1;
                if let Some(ip) = first_ip(o) {
                    if !ips.insert(ip) {
                        side.failed(f, format!("{ip} given twice"));
                    }
                }
            }
            Err(e) => side.failed(f, format!("concurrent ADD: {e}")),
        }
    }
    for o in &del_outs {
        if let Err(e) = judge("DEL", o) {
            side.failed(f, format!("concurrent DEL: {e}"));
        }
    }
    Throughput { adds, dels, ok }
}

/// One side's figures: ADD, DEL and ADD+DEL latencies, and its burst.
struct Row {
    label: &'static str,
    add: Vec<Duration>,
    del: Vec<Duration>,
    cycle: Vec<Duration>,
    burst: Throughput,
}

struct OneNode {
    rows: Vec<Row>,
    /// whereabouts' failures (a count and the first few), and what it
    /// still held after every DEL: IPPool allocations and
    /// OverlappingRangeIPReservations.
    whereabouts: Whereabouts,
}

struct Whereabouts {
    errors: Vec<String>,
    allocations_left: usize,
    reservations_left: usize,
}

/// Counts what whereabouts still holds in the API.
fn whereabouts_left(api: &KubeApi) -> (usize, usize) {
    let items = |kind: &str| -> Vec<Value> {
        api.get(&["-A", kind])
            .and_then(|l| l["items"].as_array().cloned())
            .unwrap_or_default()
    };
    let allocations = items("ippools.whereabouts.cni.cncf.io")
        .iter()
        .map(|p| p["spec"]["allocations"].as_object().map_or(0, |a| a.len()))
        .sum();
    let reservations = items("overlappingrangeipreservations.whereabouts.cni.cncf.io").len();
    (allocations, reservations)
}

fn master(node: &Netns) -> String {
    let name = unique_name("m");
    let peer = format!("{name}p");
    node.exec_ok(&[
        "ip", "link", "add", &name, "type", "veth", "peer", "name", &peer,
    ]);
    node.exec_ok(&["ip", "link", "set", &name, "up"]);
    node.exec_ok(&["ip", "link", "set", &peer, "up"]);
    name
}

fn one_node(bin_dir: &Path, args: &Args, f: &mut Failures) -> OneNode {
    let files = TempDir::new("bi");
    let pools = files.path().join("pools.json");
    std::fs::write(&pools, POOLS_ONE).expect("writing the pools file");
    // The node on a fabric with the API server whereabouts keeps its
    // state in.
    let fabric = Fabric::new();
    eprintln!("ipam: starting kube-apiserver for whereabouts");
    let api = KubeApi::start(&fabric);
    for crd in [
        "whereabouts.cni.cncf.io_ippools.yaml",
        "whereabouts.cni.cncf.io_overlappingrangeipreservations.yaml",
    ] {
        let path = whereabouts_dir().join("crds").join(crd);
        api.kubectl_ok(&["apply", "-f", &path.display().to_string()]);
    }
    api.kubectl_ok(&["create", "namespace", POD_NAMESPACE]);
    let node_ns = Netns::new("node");
    fabric.attach_host(&node_ns, 21);
    let daemon = Daemon::start_in(
        node_ns,
        DaemonOpts {
            pod_cidrs: vec![POD_CIDR.into()],
            log_level: Some("info".into()),
            bin: Some(bin_dir.join("tetherd")),
            extra_args: vec!["--pools".into(), pools.display().to_string()],
            ..Default::default()
        },
    );
    let plugins = plugin_dir(bin_dir);
    let node = daemon.node();
    let host_local_dir = files.path().join("host-local");
    let macvlan = |label: &'static str, name: &str, ipam: Value| {
        Side::new(
            label,
            node,
            plugins.path(),
            json!({"cniVersion": "1.0.0", "name": name, "type": "macvlan",
                   "master": master(node), "mode": "bridge", "ipam": ipam}),
        )
    };
    let tether = macvlan(
        "macvlan + tether",
        "bench-t",
        json!({"type": "tether", "pool": "bench", "socket": daemon.socket()}),
    );
    let host_local = macvlan(
        "macvlan + host-local",
        "bench-h",
        json!({"type": "host-local", "subnet": HOST_LOCAL_SUBNET, "dataDir": host_local_dir}),
    );
    // whereabouts insists on its flat configuration file as well
    // (`configuration_path`, else /etc/cni/net.d/whereabouts.d/): the
    // benchmark's own, in its temp dir.
    let flat = files.path().join("whereabouts.conf");
    std::fs::write(
        &flat,
        json!({"datastore": "kubernetes", "log_level": "error",
               "kubernetes": {"kubeconfig": api.admin_kubeconfig()}})
        .to_string(),
    )
    .expect("writing whereabouts' configuration");
    let mut whereabouts = macvlan(
        "macvlan + whereabouts",
        "bench-w",
        json!({"type": "whereabouts", "range": WHEREABOUTS_RANGE, "configuration_path": flat,
               "kubernetes": {"kubeconfig": api.admin_kubeconfig()}}),
    );
    whereabouts.tolerant = true;
    let mut sides = [tether, host_local, whereabouts];
    eprintln!(
        "ipam: one node: {} warm-up + {} cycles per side",
        args.warmup, args.cycles
    );
    for i in 0..args.warmup + args.cycles {
        let keep = i >= args.warmup;
        // Each side goes first, second and third in turn.
        for k in 0..sides.len() {
            let n = sides.len();
            sides[(i + k) % n].cycle(f, keep);
        }
    }
    let mut rows = Vec::new();
    for side in &mut sides {
        eprintln!(
            "ipam: {} concurrent ADDs on {}",
            args.concurrency, side.label
        );
        let t = throughput(side, args.concurrency, f);
        rows.push(Row {
            label: side.label,
            add: std::mem::take(&mut side.add),
            del: std::mem::take(&mut side.del),
            cycle: std::mem::take(&mut side.cycle),
            burst: t,
        });
    }
    // Nothing left held.
    let used: u64 = admin(daemon.socket(), |mut c| async move {
        c.list_pools(pb::ListPoolsRequest::default()).await
    })
    .pools
    .iter()
    .map(|p| p.used)
    .sum();
    if used != 0 {
        f.fail(format!(
            "tether still holds {used} addresses after every DEL"
        ));
    }
    let leases = host_local_leases(&host_local_dir, "bench-h");
    if !leases.is_empty() {
        f.fail(format!(
            "host-local still holds {} leases after every DEL",
            leases.len()
        ));
    }
    let (allocations_left, reservations_left) = whereabouts_left(&api);
    OneNode {
        rows,
        whereabouts: Whereabouts {
            errors: std::mem::take(&mut sides[2].errors),
            allocations_left,
            reservations_left,
        },
    }
}

struct ClusterRun {
    seq: Vec<Duration>,
    claims: usize,
    burst: Duration,
    burst_n: usize,
    distinct: usize,
}

fn cluster_phase(bin_dir: &Path, args: &Args, f: &mut Failures) -> ClusterRun {
    let files = TempDir::new("bi");
    let pools = files.path().join("pools.json");
    std::fs::write(&pools, POOLS_CLUSTER).expect("writing the pools file");
    eprintln!("ipam: starting a 3-member etcd and 3 nodes");
    let cluster = Topology::tetherd(3)
        .etcd_members(3)
        .node(NodeOpts {
            lease_ttl_secs: 15,
            node_grace_secs: 600,
            log_level: Some("info".into()),
            bin: Some(bin_dir.join("tetherd")),
            extra_args: vec!["--pools".into(), pools.display().to_string()],
            ..NodeOpts::default()
        })
        .start();
    let plugins = plugin_dir(bin_dir);
    let sides: Vec<Side> = cluster
        .nodes()
        .iter()
        .map(|n| {
            Side::new(
                "cluster",
                n.netns(),
                plugins.path(),
                json!({"cniVersion": "1.0.0", "name": "bench-c", "type": "macvlan",
                       "master": n.underlay().ifname, "mode": "bridge",
                       "ipam": {"type": "tether", "pool": "bench",
                                "socket": n.daemon().socket()}}),
            )
        })
        .collect();
    let mut kept: Vec<(usize, Netns)> = Vec::new();
    let mut seq = Vec::new();
    let mut ips = BTreeSet::new();
    eprintln!(
        "ipam: {} sequential ADDs on node 0, pods kept",
        args.cluster_adds
    );
    for _ in 0..args.cluster_adds {
        let pod = Netns::new("bk");
        let out = sides[0].call("ADD", &pod);
        match judge("ADD", &out) {
            Ok(()) => {
                seq.push(out.elapsed);
                ips.extend(first_ip(&out));
            }
            Err(e) => f.fail(format!("cluster ADD: {e}")),
        }
        kept.push((0, pod));
    }
    let blocks = |i: usize| -> usize {
        admin(cluster.node(i).daemon().socket(), |mut c| async move {
            c.get_pool(pb::GetPoolRequest {
                name: "bench".into(),
            })
            .await
        })
        .blocks
        .iter()
        .filter(|b| b.local)
        .count()
    };
    let claims = blocks(0);
    eprintln!("ipam: {} concurrent ADDs over 3 nodes", args.concurrency);
    // The three nodes' calls start together.
    let mut calls: Vec<BurstCall> = Vec::new();
    let mut burst_pods = Vec::new();
    for i in 0..args.concurrency {
        let n = i % 3;
        let pod = Netns::new("bk");
        calls.push((
            sides[n].node,
            plugins.path().join("macvlan"),
            sides[n].env("ADD", &pod),
            sides[n].netconf.clone(),
        ));
        burst_pods.push((n, pod));
    }
    let (burst_time, outs) = burst(&calls);
    let mut burst_ok = 0;
    for o in &outs {
        match judge("ADD", o) {
            Ok(()) => {
                burst_ok += 1;
                if let Some(ip) = first_ip(o) {
                    if !ips.insert(ip) {
                        f.fail(format!("cluster: {ip} given twice"));
                    }
                }
            }
            Err(e) => f.fail(format!("cluster concurrent ADD: {e}")),
        }
    }
    kept.extend(burst_pods);
    for (n, pod) in &kept {
        if let Err(e) = judge("DEL", &sides[*n].call("DEL", pod)) {
            f.fail(format!("cluster DEL: {e}"));
        }
    }
    ClusterRun {
        seq,
        claims,
        burst: burst_time,
        burst_n: burst_ok,
        distinct: ips.len(),
    }
}

fn ms(d: Option<Duration>) -> String {
    d.map_or_else(
        || "–".to_owned(),
        |d| format!("{:.2}", d.as_secs_f64() * 1000.0),
    )
}

fn report(run: &Run, args: &Args, one: Option<&OneNode>, cluster: Option<&ClusterRun>) -> String {
    let mut r = Report::new("tether as IPAM", run);
    r.item(format!(
        "tether {}; Debian's macvlan and host-local (containernetworking-plugins {}); whereabouts v0.9.2 (built from its Go module) against kube-apiserver v1.37.2 (built from k8s.io/kubernetes) on Debian's etcd, in a netns on the node's fabric.",
        run.machine.tether_version,
        stdout_of(
            "dpkg-query",
            &["-W", "-f=${Version}", "containernetworking-plugins"]
        )
    ))
    .command(run, "");
    if let Some(one) = one {
        r.paragraph(format!(
            "### One node: {} ADD+DEL cycles per side (after {} warm-up), then {} concurrent ADDs and DELs",
            args.cycles, args.warmup, args.concurrency
        ));
        let n = args.concurrency;
        let mut t = Table::new(&[
            "IPAM of macvlan".to_owned(),
            "ADD p50 ms".to_owned(),
            "ADD p99 ms".to_owned(),
            "DEL p50 ms".to_owned(),
            "DEL p99 ms".to_owned(),
            "ADD+DEL p50 ms".to_owned(),
            format!("{n} ADDs at once, s"),
            format!("{n} DELs at once, s"),
            "ADDs ok".to_owned(),
        ]);
        for Row {
            label,
            add,
            del,
            cycle,
            burst: b,
        } in &one.rows
        {
            t.row([
                (*label).to_owned(),
                ms(percentile(add, 0.5)),
                ms(percentile(add, 0.99)),
                ms(percentile(del, 0.5)),
                ms(percentile(del, 0.99)),
                ms(percentile(cycle, 0.5)),
                format!("{:.2}", b.adds.as_secs_f64()),
                format!("{:.2}", b.dels.as_secs_f64()),
                format!("{}/{}", b.ok, args.concurrency),
            ]);
        }
        r.table(&t);
        let w = &one.whereabouts;
        r.paragraph(format!(
            "whereabouts: {} failed call(s) (results, not benchmark failures){}; after every DEL it still held {} IPPool allocation(s) and {} OverlappingRangeIPReservation(s). tether and host-local held nothing (checked: a failure otherwise).",
            w.errors.len(),
            match w.errors.first() {
                Some(e) => format!(", the first: `{}`", e.replace('|', "/").replace('\n', " ").chars().take(300).collect::<String>()),
                None => String::new(),
            },
            w.allocations_left,
            w.reservations_left
        ));
    }
    if let Some(c) = cluster {
        r.paragraph("### Cluster-wide: 3 nodes, 3-member etcd, one pool of /28 blocks");
        let mut t = Table::new(&["What", "Result"]);
        t.row([
            format!(
                "{} sequential ADDs on node 0 (pods kept): p50 / p99 ms",
                args.cluster_adds
            ),
            format!(
                "{} / {}",
                ms(percentile(&c.seq, 0.5)),
                ms(percentile(&c.seq, 0.99))
            ),
        ])
        .row([
            "blocks node 0 claimed during them".to_owned(),
            c.claims.to_string(),
        ])
        .row([
            format!(
                "{} ADDs at once over the 3 nodes: wall time s",
                args.concurrency
            ),
            format!("{:.2} ({} ok)", c.burst.as_secs_f64(), c.burst_n),
        ])
        .row([
            "distinct addresses over both steps".to_owned(),
            c.distinct.to_string(),
        ]);
        r.table(&t);
    }
    r.finish(run)
}
