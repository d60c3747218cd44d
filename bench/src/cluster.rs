//! tether's cluster-mode benchmark, in one run:
//!
//! 1. **ADD and DEL latency, cluster mode against one node.** A 3-node
//!    cluster (a 3-member etcd, host-gw routing, the default /26 and /122
//!    blocks) and a single `tetherd` in `--pod-cidr` mode with the embedded
//!    store, both dual-stack. Sequential cycles of ADD then DEL, each into a
//!    fresh pod netns, on node 0 and on the single node, interleaved cycle by
//!    cycle (order alternating) so that background noise falls on both. Each
//!    pod is deleted before the next ADD, so node 0's first block always has
//!    room; the block claims node 0 made during the timed cycles (its Stats
//!    counter) are reported, and should be 0. After each DEL the bench
//!    waits, untimed, until the daemon has no link deletion in flight: an
//!    ADD right behind a DEL on the same daemon would otherwise wait for
//!    the DEL's veth teardown, and with two sides alternating who goes
//!    first, every other cycle would.
//! 2. **Block-claim latency.** A second 3-node cluster with tiny blocks
//!    (`--block-size 30 --block-size-v6 126`: two IPv4 and three IPv6 pod
//!    addresses per block), pods kept, so that about every other ADD on node
//!    0 claims a block. After each ADD the bench reads node 0's Stats and the
//!    new lines of its log: each "claimed an address block" line gives the
//!    block, the claim's wall-clock time, and `took_ms`, the daemon's own
//!    measure of the claim (list + CAS transaction against etcd), which
//!    Stats' `last_block_claim_ms` must repeat.
//! 3. **Claim to route.** During part 2, `ip -ts monitor route` runs in
//!    node 1's and node 2's netns (spawned here, killed by PID). For each
//!    claim: the time from node 0's log line to the first `<block> via ...
//!    proto 202` route on each node. Both clocks are the machine's; the
//!    monitor prints local time, so it runs with `TZ=UTC`, and the bench
//!    checks that every difference is a small number.
//!
//! Every plugin process is spawned as `bench` does: the real `tether` shim,
//! from a thread that entered the node netns, timed from spawn to reap.
//!
//! Run (as root): `cargo run --release -p tether-bench -- cluster
//! [--cycles 200] [--warmup 20] [--claim-adds 80] [--no-build] [--write
//! BENCHMARKS.md]`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::builder::RangedU64ValueParser;
use ipnet::IpNet;
use tether_e2e::admin;
use tether_e2e::cluster::{NodeOpts, Overlay, CLUSTER_ROUTE_PROTOCOL};
use tether_e2e::topology::Topology;
use tether_e2e::{
    cni, is_tether_link, run_prefix, CniEnv, CniOutput, Daemon, DaemonOpts, Netns, TempDir,
};

use crate::kit::{
    self, guarded, judge, nearest_rank, parse_utc_micros, poll_until, poll_until_fast, release_dir,
    stdout_of, Benchmark, CommonArgs, Failures, Report, Run, Table, CLAIM_LINE,
};

/// The single node's pod CIDRs (inside its own node netns only).
const SINGLE_CIDRS: [&str; 2] = ["10.246.0.0/24", "fd00:10:246::/120"];
/// The daemons' log level: `info`, as in `bench` (no per-request debug
/// lines), and the level of the "claimed an address block" line.
const LOG_LEVEL: &str = "info";
/// The line tetherd logs after each block claim.
/// How long a DEL may leave the pod's veth behind (tether removes it off
/// the request's critical path).
const SETTLE: Duration = Duration::from_secs(5);
/// How long a claimed block's route may take to show on the other nodes
/// before it counts as missing.
const ROUTE_WAIT: Duration = Duration::from_secs(5);
/// A claim-to-route difference outside this range means the two clocks are
/// read wrongly (a time-zone offset is hours), not a slow route.
const SANE_DIFF_US: std::ops::RangeInclusive<i64> = -1_000_000..=60_000_000;

/// `tether-bench cluster`'s flags.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Timed ADD+DEL cycles per side in phase 1 (cluster mode against one node).
    #[arg(long, default_value_t = 200, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    cycles: usize,
    /// Untimed cycles per side before them.
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// Cycles between two checks that nothing is left behind (0 counts as 1).
    #[arg(long, default_value_t = 50, value_parser = batch_size)]
    batch: usize,
    /// ADDs on node 0 with tiny blocks, pods kept, in phase 2 (block claims).
    #[arg(long, default_value_t = 80, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    claim_adds: usize,
    /// Fewest block claims phase 2 must see; fewer is a failure.
    #[arg(long, default_value_t = 50)]
    min_claims: usize,
    /// Fewest claims whose route must show on both other nodes; fewer is a failure.
    #[arg(long, default_value_t = 20)]
    min_routes: usize,
    #[command(flatten)]
    common: CommonArgs,
}

/// `--batch`: a count, 0 taken as 1.
fn batch_size(text: &str) -> Result<usize, String> {
    text.parse::<usize>()
        .map(|n| n.max(1))
        .map_err(|e| e.to_string())
}

/// The release binaries.
pub struct Bins {
    shim: PathBuf,
    tetherd: PathBuf,
}

/// What the phases measured; `None` for one that aborted.
pub struct Measured {
    latency: Option<Latency>,
    claims: Option<Claims>,
}

impl Benchmark for Args {
    const NAME: &'static str = "cluster";
    const SECTION: &'static str = "bench-cluster";
    type Ready = Bins;
    type Measured = Measured;

    fn common(&self) -> &CommonArgs {
        &self.common
    }

    fn prepare(&self) -> Result<Bins, String> {
        let dir = release_dir(Self::NAME, self.common.build())?;
        Ok(Bins {
            shim: dir.join("tether"),
            tetherd: dir.join("tetherd"),
        })
    }

    fn measure(&self, bins: &Bins, failures: &mut Failures) -> Measured {
        // Each phase builds its own topology and drops it (cleaning up)
        // before the next; a panic in one is a failure, and the other still
        // runs.
        let latency = guarded("latency", failures, |f| latency_phase(bins, self, f));
        let claims = guarded("claims", failures, |f| claim_phase(bins, self, f));
        Measured { latency, claims }
    }

    fn report(&self, run: &Run, _: &Bins, measured: &Measured) -> String {
        report(
            run,
            self,
            measured.latency.as_ref(),
            measured.claims.as_ref(),
        )
    }
}

/// How every cluster node's tetherd runs here: the release binary, `info`
/// logs, and the daemon's own lease defaults (15 s TTL, 600 s grace)
/// rather than the test suites' quick 2 s / 3 s, so that a busy machine
/// never reaps a node in the middle of a run.
fn node_opts(bins: &Bins, tiny_blocks: bool) -> NodeOpts {
    NodeOpts {
        overlay: Overlay::HostGw,
        block_size: tiny_blocks.then_some(30),
        block_size_v6: tiny_blocks.then_some(126),
        lease_ttl_secs: 15,
        node_grace_secs: 600,
        log_level: Some(LOG_LEVEL.to_owned()),
        bin: Some(bins.tetherd.clone()),
        ..NodeOpts::default()
    }
}

/// One ADD or DEL through the real shim, from a thread in `node`.
fn invoke(
    shim: &Path,
    node: &Netns,
    netconf: &[u8],
    command: &str,
    id: &str,
    pod: &Netns,
) -> CniOutput {
    let env = CniEnv::new(command, id, pod);
    node.run(|| cni(shim, &env, netconf))
}

// ---------------------------------------------------------------------------
// Phase 1: ADD and DEL latency, cluster mode against one node

/// One side of the comparison: where it runs, and what it measured.
struct Side<'a> {
    short: &'static str,
    node: &'a Netns,
    socket: PathBuf,
    netconf: Vec<u8>,
    row: LatencyRow,
}

impl<'a> Side<'a> {
    fn new(label: &'static str, short: &'static str, daemon: &'a Daemon, network: &str) -> Self {
        Side {
            short,
            node: daemon.node(),
            socket: daemon.socket().to_path_buf(),
            netconf: serde_json::to_vec(&daemon.netconf("1.0.0", network))
                .expect("a JSON value serializes"),
            row: LatencyRow {
                label,
                ..LatencyRow::default()
            },
        }
    }

    fn timed(
        &mut self,
        shim: &Path,
        command: &str,
        id: &str,
        pod: &Netns,
        f: &mut Failures,
    ) -> Option<Duration> {
        let out = invoke(shim, self.node, &self.netconf, command, id, pod);
        self.row.calls += 1;
        match judge(command, &out) {
            Ok(()) => Some(out.elapsed),
            Err(e) => {
                self.row.failures += 1;
                f.fail(format!("{}: {command} {id}: {e}", self.short));
                None
            }
        }
    }
}

/// What phase 1 measured.
struct Latency {
    rows: Vec<LatencyRow>,
    /// Node 0's block claims during the timed cycles (Stats delta).
    claims_timed: Option<u64>,
    /// Node 0's block claims since it started (its first blocks included).
    claims_total: u64,
    /// Node 0's blocks at the end (GetNode).
    blocks: Vec<String>,
}

/// One side's row of phase 1: its timed calls, and how many calls and
/// failures it had (warm-up included).
#[derive(Default)]
struct LatencyRow {
    label: &'static str,
    add: Vec<Duration>,
    del: Vec<Duration>,
    /// ADDs sent right after a DEL answered, its veth teardown still running.
    add_after_del: Vec<Duration>,
    calls: usize,
    failures: usize,
}

fn latency_phase(bins: &Bins, args: &Args, f: &mut Failures) -> Latency {
    eprintln!("cluster: phase 1: a 3-node cluster (etcd ×3, host-gw) and a single node");
    let cluster = Topology::tetherd(3)
        .etcd_members(3)
        .node(node_opts(bins, false))
        .start();
    let single = Daemon::start(DaemonOpts {
        pod_cidrs: SINGLE_CIDRS.map(str::to_owned).to_vec(),
        log_level: Some(LOG_LEVEL.to_owned()),
        bin: Some(bins.tetherd.clone()),
        ..DaemonOpts::default()
    });
    let node0 = cluster.node(0);
    let mut sides = [
        Side::new(
            "cluster mode (node 0 of 3, etcd ×3)",
            "cluster",
            node0.daemon(),
            tether_e2e::cluster::CLUSTER_NETWORK,
        ),
        Side::new(
            "one node (`--pod-cidr`, embedded store)",
            "single",
            &single,
            "bench-single",
        ),
    ];

    let total = args.warmup + args.cycles;
    let mut claims_start = None;
    let mut start = 0;
    while start < total {
        let end = (start + args.batch).min(total);
        eprintln!("cluster: sequential cycles {start}..{end} of {total}");
        let mut pods: Vec<Netns> = Vec::new();
        for cycle in start..end {
            if cycle == args.warmup {
                claims_start = Some(node0.daemon().stats().block_claims);
            }
            for k in 0..sides.len() {
                // Alternate which side goes first.
                let side = &mut sides[(cycle + k) % 2];
                let pod = Netns::new("p");
                let id = format!("{}-{}-s{cycle}", run_prefix(), side.short);
                let add = side.timed(&bins.shim, "ADD", &id, &pod, f);
                let del = side.timed(&bins.shim, "DEL", &id, &pod, f);
                // A second pod at once, as when a pod is restarted: its ADD
                // meets the first pod's veth teardown.
                let again_pod = Netns::new("q");
                let again_id = format!("{id}-again");
                let again = side.timed(&bins.shim, "ADD", &again_id, &again_pod, f);
                side.timed(&bins.shim, "DEL", &again_id, &again_pod, f);
                // tether removes the veth after answering DEL: wait, untimed,
                // so that the next call does not pay for that work.
                let deadline = Instant::now() + SETTLE;
                poll_until(deadline, || pod.link_names(), |l| *l == ["lo"]);
                // The pod's link vanishes before the kernel has returned
                // from the deletion request (its teardown goes on), and that
                // request holds the daemon's netlink socket: wait until the
                // daemon counts no deletion in flight, so that this side's
                // next ADD does not queue behind it.
                poll_until_fast(deadline, || {
                    admin::stats(&side.socket).link_deletions_in_flight == 0
                });
                poll_until(deadline, || again_pod.link_names(), |l| *l == ["lo"]);
                if cycle >= args.warmup {
                    side.row.add.extend(add);
                    side.row.del.extend(del);
                    side.row.add_after_del.extend(again);
                }
                pods.push(pod);
                pods.push(again_pod);
            }
        }
        verify_clean(&sides, pods, f);
        start = end;
    }
    let stats = node0.daemon().stats();
    let claims_timed = claims_start.map(|s| stats.block_claims.saturating_sub(s));
    if let Some(n) = claims_timed.filter(|n| *n > 0) {
        f.fail(format!(
            "node 0 claimed {n} block(s) during the timed cycles: they were to measure ordinary ADDs"
        ));
    }
    let blocks = node0.daemon().node_info().blocks;
    let rows = sides.into_iter().map(|s| s.row).collect();
    Latency {
        rows,
        claims_timed,
        claims_total: stats.block_claims,
        blocks,
    }
}

/// After a batch: every pod netns holds only `lo`, no tether veth is left
/// in either node netns, and neither daemon holds an attachment; then the
/// pod netns are deleted, and the kernel's deferred netns cleanup gets a
/// second before timing resumes.
fn verify_clean(sides: &[Side], pods: Vec<Netns>, f: &mut Failures) {
    let deadline = Instant::now() + SETTLE;
    for pod in &pods {
        let links = poll_until(deadline, || pod.link_names(), |l| *l == ["lo"]);
        if links != ["lo"] {
            f.fail(format!("pod {} left {links:?}", pod.name()));
        }
    }
    for side in sides {
        let left = poll_until(
            deadline,
            || {
                side.node
                    .link_names()
                    .into_iter()
                    .filter(|n| is_tether_link(n))
                    .collect::<Vec<_>>()
            },
            Vec::is_empty,
        );
        if !left.is_empty() {
            f.fail(format!("{}: node netns left veths {left:?}", side.short));
        }
        let held = admin::attachments(&side.socket);
        if !held.is_empty() {
            f.fail(format!(
                "{}: the daemon still holds {} attachment(s)",
                side.short,
                held.len()
            ));
        }
    }
    drop(pods);
    std::thread::sleep(Duration::from_secs(1));
}

// ---------------------------------------------------------------------------
// Phases 2 and 3: block claims, and claim to route

/// One ADD of phase 2: its latency and how many blocks it claimed.
struct ClaimAdd {
    elapsed: Duration,
    claims: u64,
}

/// One block claim, from node 0's log line.
struct Claim {
    /// When node 0 logged it, µs since the epoch (UTC).
    at_us: i64,
    block: IpNet,
    /// The daemon's own measure of the claim.
    took_ms: f64,
    /// When its route showed on node 1 and node 2 (µs since the epoch).
    route_at_us: [Option<i64>; 2],
}

/// What phases 2 and 3 measured.
struct Claims {
    adds: Vec<ClaimAdd>,
    claims: Vec<Claim>,
    /// Stats' `last_block_claim_ms` after each ADD that claimed.
    stats_claim_ms: Vec<f64>,
    /// The monitor lines parsed, per node.
    route_events: [usize; 2],
    node_names: [String; 2],
}

/// `ip -ts monitor route` in a node netns, its output in a file. Dropping
/// it kills the process (our child, by its handle).
struct Monitor {
    child: Child,
    out: PathBuf,
    err: PathBuf,
}

impl Monitor {
    fn start(ns: &Netns, dir: &Path, tag: &str) -> Monitor {
        let out = dir.join(format!("{tag}.monitor"));
        let err = dir.join(format!("{tag}.monitor.err"));
        let file = |p: &Path| {
            std::fs::File::create(p).unwrap_or_else(|e| panic!("creating {}: {e}", p.display()))
        };
        // `ip -n` switches namespaces itself (no exec): the PID is ip's.
        // `-ts` prints the local time; TZ=UTC makes that UTC, like
        // tracing's timestamps.
        let child = Command::new("ip")
            .args(["-n", ns.name(), "-ts", "monitor", "route"])
            .env("TZ", "UTC")
            .stdin(Stdio::null())
            .stdout(Stdio::from(file(&out)))
            .stderr(Stdio::from(file(&err)))
            .spawn()
            .unwrap_or_else(|e| panic!("spawning ip monitor in {}: {e}", ns.name()));
        Monitor { child, out, err }
    }

    fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Routes added so far: (time, destination), in the monitor's order.
    fn events(&self) -> Vec<(i64, IpNet)> {
        std::fs::read_to_string(&self.out)
            .unwrap_or_default()
            .lines()
            .filter_map(parse_monitor_line)
            .collect()
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        // Not reaped yet, so the PID is still our child's.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn claim_phase(bins: &Bins, args: &Args, f: &mut Failures) -> Claims {
    eprintln!("cluster: phase 2: a 3-node cluster with /30 and /126 blocks");
    let cluster = Topology::tetherd(3)
        .etcd_members(3)
        .node(node_opts(bins, true))
        .start();
    // Declared after the cluster: dropped (killed) before it.
    let dir = TempDir::new("mon");
    let mut monitors = [
        Monitor::start(cluster.node(1).netns(), dir.path(), "node1"),
        Monitor::start(cluster.node(2).netns(), dir.path(), "node2"),
    ];
    // Let both subscribe before the first claim.
    std::thread::sleep(Duration::from_millis(500));
    for (i, m) in monitors.iter_mut().enumerate() {
        assert!(
            m.is_running(),
            "ip monitor in node {} exited: {}",
            i + 1,
            m.stderr()
        );
    }

    let node0 = cluster.node(0);
    let daemon = node0.daemon();
    let netconf = serde_json::to_vec(&node0.netconf()).expect("a JSON value serializes");
    let mut log_offset = daemon.log().len();
    let mut claims_before = daemon.stats().block_claims;
    let mut adds = Vec::new();
    let mut claims: Vec<Claim> = Vec::new();
    let mut stats_claim_ms = Vec::new();
    let mut pods = Vec::new();
    for i in 0..args.claim_adds {
        let pod = Netns::new("k");
        let id = format!("{}-claim{i}", run_prefix());
        let out = invoke(&bins.shim, node0.netns(), &netconf, "ADD", &id, &pod);
        pods.push(pod);
        let ok = judge("ADD", &out)
            .map_err(|e| f.fail(format!("claims: ADD {id}: {e}")))
            .is_ok();
        let stats = daemon.stats();
        let delta = stats.block_claims.saturating_sub(claims_before);
        claims_before = stats.block_claims;

        let log = daemon.log();
        let fresh = log.get(log_offset..).unwrap_or_default();
        // Whole lines only: a line still being written waits for next time.
        let complete = fresh.rfind('\n').map_or(0, |n| n + 1);
        let new: Vec<Claim> = fresh[..complete]
            .lines()
            .filter_map(parse_claim_line)
            .collect();
        log_offset += complete;
        if new.len() as u64 != delta {
            f.fail(format!(
                "claims: ADD {id}: Stats counted {delta} claim(s), the log shows {}",
                new.len()
            ));
        }
        if delta > 0 {
            stats_claim_ms.push(stats.last_block_claim_ms);
            if let Some(last) = new.last() {
                if (last.took_ms - stats.last_block_claim_ms).abs() > 0.01 {
                    f.fail(format!(
                        "claims: ADD {id}: Stats says the last claim took {} ms, the log {} ms",
                        stats.last_block_claim_ms, last.took_ms
                    ));
                }
            }
        }
        if ok {
            adds.push(ClaimAdd {
                elapsed: out.elapsed,
                claims: delta,
            });
        }
        // Untimed: wait until the new blocks' routes show on both nodes, so
        // that the next ADD's work does not overlap their propagation.
        if !new.is_empty() {
            let deadline = Instant::now() + ROUTE_WAIT;
            poll_until_fast(deadline, || {
                monitors.iter().all(|m| {
                    let events = m.events();
                    new.iter()
                        .all(|c| events.iter().any(|(_, dst)| *dst == c.block))
                })
            });
        }
        claims.extend(new);
    }
    // Late routes still count (up to ROUTE_WAIT); then stop the monitors.
    std::thread::sleep(Duration::from_millis(200));
    let events: Vec<Vec<(i64, IpNet)>> = monitors.iter().map(Monitor::events).collect();
    drop(monitors);
    let node_names = [1, 2].map(|i| cluster.node(i).name().to_owned());
    for c in &mut claims {
        for (k, ev) in events.iter().enumerate() {
            c.route_at_us[k] = ev.iter().find(|(_, dst)| *dst == c.block).map(|(t, _)| *t);
            match c.route_at_us[k] {
                None => f.fail(format!(
                    "route: no route to {} on node {} within {ROUTE_WAIT:?}",
                    c.block,
                    k + 1
                )),
                Some(t) if !SANE_DIFF_US.contains(&(t - c.at_us)) => f.fail(format!(
                    "route: {} shows on node {} {} µs after its claim: the clocks are misread \
                     (time zone?)",
                    c.block,
                    k + 1,
                    t - c.at_us
                )),
                Some(_) => {}
            }
        }
    }
    if claims.len() < args.min_claims {
        f.fail(format!(
            "only {} block claims (wanted at least {}): raise --claim-adds",
            claims.len(),
            args.min_claims
        ));
    }
    let routed = claims
        .iter()
        .filter(|c| c.route_at_us.iter().all(Option::is_some))
        .count();
    if routed < args.min_routes {
        f.fail(format!(
            "only {routed} claims with a route on both nodes (wanted at least {})",
            args.min_routes
        ));
    }
    let route_events = [events[0].len(), events[1].len()];
    drop(pods);
    Claims {
        adds,
        claims,
        stats_claim_ms,
        route_events,
        node_names,
    }
}

/// A tetherd log line's block claim, if it reports one.
fn parse_claim_line(line: &str) -> Option<Claim> {
    let b = kit::parse_claim_line(line)?;
    Some(Claim {
        at_us: b.at_us,
        block: b.block,
        took_ms: b.took_ms,
        route_at_us: [None, None],
    })
}

/// An `ip -ts monitor route` line for a route added with tether's cluster
/// protocol: `[<local time>] <dst> via <gw> dev <dev> proto 202 ...`.
/// Deletions (`Deleted ...`) and other routes give None.
fn parse_monitor_line(line: &str) -> Option<(i64, IpNet)> {
    let rest = line.strip_prefix('[')?;
    let (stamp, rest) = rest.split_once(']')?;
    let at = parse_utc_micros(stamp)?;
    let tokens: Vec<&str> = rest.split_whitespace().collect();
    let proto = CLUSTER_ROUTE_PROTOCOL.to_string();
    let ours = tokens.windows(2).any(|w| w[0] == "proto" && w[1] == proto);
    if !ours || tokens.first() == Some(&"Deleted") {
        return None;
    }
    let dst = tokens.first()?.parse::<IpNet>().ok()?;
    Some((at, dst))
}

// ---------------------------------------------------------------------------
// Statistics and the report

fn micros_of(d: &[Duration]) -> Vec<i64> {
    d.iter().map(|d| d.as_micros() as i64).collect()
}

/// `us` microseconds as milliseconds with `decimals` decimals.
fn ms(us: Option<i64>, decimals: usize) -> String {
    match us {
        Some(us) => format!("{:.*} ms", decimals, us as f64 / 1e3),
        None => "n/a".to_owned(),
    }
}

fn ratio(a: Option<i64>, b: Option<i64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b != 0 => format!("{:.2}×", a as f64 / b as f64),
        _ => "n/a".to_owned(),
    }
}

fn report(run: &Run, args: &Args, latency: Option<&Latency>, claims: Option<&Claims>) -> String {
    let mut r = Report::new("Cluster mode", run);
    r.item(format!(
        "Software: tether {} (`--release`); Debian etcd-server {}; {}.",
        run.machine.tether_version,
        stdout_of("dpkg-query", &["-W", "-f", "${Version}", "etcd-server"]),
        stdout_of("ip", &["-V"])
    ))
    .command(run, "")
    .item(
        "Topology: a fabric netns with a bridge; a 3-member etcd in a control netns on it; \
         3 node netns on it, each running `tetherd --store etcd --overlay none` (host-gw), \
         dual-stack cluster CIDRs 10.244.0.0/16 and fd00:10:244::/64, lease TTL 15 s. Every \
         plugin call is the real `tether` shim, spawned from a thread that entered the node \
         netns and timed from spawn to reap, as in `bench`.",
    );

    r.paragraph("### ADD and DEL latency: cluster mode against one node");
    r.paragraph(format!(
        "{} sequential cycles of ADD then DEL after {} untimed warm-up cycles, each into a \
         fresh pod netns, dual-stack on both sides. Cluster mode: ADDs on node 0, default \
         /26 and /122 blocks, each pod deleted before the next ADD, so the node's first \
         blocks always have room. One node: `tetherd --pod-cidr {} --pod-cidr {}` with the \
         embedded store, in a node netns of its own. The two are interleaved cycle by cycle \
         (which goes first alternates). After each DEL the bench waits, untimed, until the \
         pod's interface is gone and the daemon counts no link deletion in flight (Stats \
         `link_deletions_in_flight` = 0): tether answers DEL before the kernel has finished \
         the veth teardown. The \"ADD right after a DEL\" columns measure the case that \
         wait keeps out of the others: in each cycle, right after the DEL answered, a second \
         pod is added (and deleted) at once, as when a pod restarts, while the first pod's \
         veth is still being torn down. p50 and p99 are nearest-rank.",
        args.cycles, args.warmup, SINGLE_CIDRS[0], SINGLE_CIDRS[1]
    ));
    match latency {
        Some(l) => {
            let mut t = Table::new(&[
                "setup",
                "ADD p50",
                "ADD p99",
                "DEL p50",
                "DEL p99",
                "ADD right after a DEL, p50",
                "p99",
                "calls (with warm-up)",
                "failures",
            ])
            .right_aligned_from(1);
            let cells = |row: &LatencyRow| {
                let (add, del) = (micros_of(&row.add), micros_of(&row.del));
                let again = micros_of(&row.add_after_del);
                [
                    nearest_rank(&add, 0.5),
                    nearest_rank(&add, 0.99),
                    nearest_rank(&del, 0.5),
                    nearest_rank(&del, 0.99),
                    nearest_rank(&again, 0.5),
                    nearest_rank(&again, 0.99),
                ]
            };
            for row in &l.rows {
                let c = cells(row);
                t.row(
                    std::iter::once(row.label.to_owned())
                        .chain(c.iter().map(|us| ms(*us, 1)))
                        .chain([row.calls.to_string(), row.failures.to_string()]),
                );
            }
            if let [a, b] = &l.rows[..] {
                let (a, b) = (cells(a), cells(b));
                t.row(
                    std::iter::once("cluster / one node".to_owned())
                        .chain(a.iter().zip(&b).map(|(x, y)| ratio(*x, *y)))
                        .chain([String::new(), String::new()]),
                );
            }
            r.table(&t);
            r.paragraph(format!(
                "Block claims by node 0 during the timed cycles (its Stats `block_claims` \
                 before and after): **{}**; since it started: {} (its first blocks, {}).",
                l.claims_timed.map_or("n/a".to_owned(), |n| n.to_string()),
                l.claims_total,
                l.blocks.join(", ")
            ));
        }
        None => {
            r.paragraph("Not measured (the phase failed; see the problems below).");
        }
    }

    r.paragraph("### Block-claim latency");
    r.paragraph(format!(
        "A second 3-node cluster with `--block-size 30 --block-size-v6 126` (a block holds 2 \
         IPv4 or 3 IPv6 pod addresses), {} ADDs on node 0 with the pods kept, so that about \
         every other ADD needs a new IPv4 block and every third a new IPv6 one. After each \
         ADD the bench reads node 0's Stats and its log: a claim is a \"{CLAIM_LINE}\" line, \
         whose `took_ms` is the daemon's own timing of the claim (list the family's blocks, \
         then the CAS transaction that creates the block's key, against etcd); Stats' \
         `last_block_claim_ms` repeats it and is checked against it. ADD latency is the \
         whole shim call, as above.",
        args.claim_adds
    ));
    match claims {
        Some(c) => {
            let took: Vec<i64> = c
                .claims
                .iter()
                .map(|c| (c.took_ms * 1e3).round() as i64)
                .collect();
            let mut t = Table::new(&["what", "n", "p50", "p99", "max"]).right_aligned_from(1);
            t.row([
                "block claim (daemon's `took_ms`: list + CAS txn)".to_owned(),
                took.len().to_string(),
                ms(nearest_rank(&took, 0.5), 2),
                ms(nearest_rank(&took, 0.99), 2),
                ms(took.iter().copied().max(), 2),
            ]);
            for (n, what) in [
                (0, "ADD that claimed no block"),
                (1, "ADD that claimed one block"),
                (2, "ADD that claimed two blocks (IPv4 and IPv6)"),
            ] {
                let lat: Vec<i64> = c
                    .adds
                    .iter()
                    .filter(|a| a.claims == n)
                    .map(|a| a.elapsed.as_micros() as i64)
                    .collect();
                t.row([
                    what.to_owned(),
                    lat.len().to_string(),
                    ms(nearest_rank(&lat, 0.5), 1),
                    ms(nearest_rank(&lat, 0.99), 1),
                    ms(lat.iter().copied().max(), 1),
                ]);
            }
            r.table(&t);
            let stats_us: Vec<i64> = c
                .stats_claim_ms
                .iter()
                .map(|ms| (ms * 1e3).round() as i64)
                .collect();
            r.paragraph(format!(
                "Stats' `last_block_claim_ms`, read after each of the {} ADDs that claimed: \
                 p50 {}, p99 {}.",
                stats_us.len(),
                ms(nearest_rank(&stats_us, 0.5), 2),
                ms(nearest_rank(&stats_us, 0.99), 2)
            ));
        }
        None => {
            r.paragraph("Not measured (the phase failed; see the problems below).");
        }
    }

    r.paragraph("### Claim to route on the other nodes");
    r.paragraph(format!(
        "During the claims above, `ip -ts monitor route` ran in node 1's and node 2's netns. \
         For each claim: from node 0's log line (tracing's UTC timestamp, written once the \
         claim's transaction has been answered) to the first line of the monitor showing \
         `<block> via <node 0's underlay address> proto {CLUSTER_ROUTE_PROTOCOL}` on that \
         node: etcd's watch event, the daemon's reaction and the kernel's route, with \
         microsecond timestamps from the same clock (the monitor prints local time; it runs \
         with `TZ=UTC`). \"Both nodes\" is the later of the two, per claim: when the whole \
         cluster can reach the block. After each ADD that claimed, the bench waited \
         (untimed) for the routes before the next ADD."
    ));
    match claims {
        Some(c) => {
            let per_node: Vec<Vec<i64>> = (0..2)
                .map(|k| {
                    c.claims
                        .iter()
                        .filter_map(|cl| cl.route_at_us[k].map(|t| t - cl.at_us))
                        .collect()
                })
                .collect();
            let both: Vec<i64> = c
                .claims
                .iter()
                .filter_map(|cl| match cl.route_at_us {
                    [Some(a), Some(b)] => Some(a.max(b) - cl.at_us),
                    _ => None,
                })
                .collect();
            let mut t =
                Table::new(&["route shows on", "claims", "p50", "worst"]).right_aligned_from(1);
            for (k, d) in per_node.iter().enumerate() {
                t.row([
                    format!("node {} ({})", k + 1, c.node_names[k]),
                    d.len().to_string(),
                    ms(nearest_rank(d, 0.5), 2),
                    ms(d.iter().copied().max(), 2),
                ]);
            }
            t.row([
                "both nodes".to_owned(),
                both.len().to_string(),
                ms(nearest_rank(&both, 0.5), 2),
                ms(both.iter().copied().max(), 2),
            ]);
            r.table(&t);
            // The log line comes after the transaction's answer, while the
            // watch event may already be on its way: a route can show a
            // little before it. The claim's start bounds it from the other
            // side.
            let from_start: Vec<i64> = c
                .claims
                .iter()
                .filter_map(|cl| match cl.route_at_us {
                    [Some(a), Some(b)] => {
                        Some(a.max(b) - cl.at_us + (cl.took_ms * 1e3).round() as i64)
                    }
                    _ => None,
                })
                .collect();
            r.paragraph(format!(
                "The log line is written once node 0 has the transaction's answer, and \
                 etcd sends the watch event to the other nodes at about the same time, so a \
                 route can show slightly before the line (a small negative difference). \
                 Counted from the start of the claim instead (log time minus `took_ms`, \
                 before the list and the transaction), both nodes: p50 {}, worst {}.",
                ms(nearest_rank(&from_start, 0.5), 2),
                ms(from_start.iter().copied().max(), 2)
            ));
            let all: Vec<i64> = per_node.iter().flatten().copied().collect();
            r.paragraph(format!(
                "Sanity check of the two timestamps: every difference lies between {} and {} \
                 (monitor lines parsed: {} on node 1, {} on node 2).",
                ms(all.iter().copied().min(), 2),
                ms(all.iter().copied().max(), 2),
                c.route_events[0],
                c.route_events[1]
            ));
        }
        None => {
            r.paragraph("Not measured (the phase failed; see the problems below).");
        }
    }
    r.finish(run)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_timestamps_parse() {
        assert_eq!(parse_utc_micros("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(
            parse_utc_micros("1970-01-02T00:00:00.5"),
            Some(86_400_500_000)
        );
        // `date -u -d 2026-11-21T18:25:31Z +%s`
        assert_eq!(
            parse_utc_micros("2026-11-21T18:25:31.158628Z"),
            Some(1_795_285_531_158_628)
        );
        assert_eq!(
            parse_utc_micros("2024-02-29T00:00:00.000001Z"),
            Some(1_709_164_800_000_001)
        );
        assert_eq!(parse_utc_micros("not a time"), None);
    }

    #[test]
    fn monitor_lines_parse() {
        let add = "[2026-11-21T18:25:31.673178] 10.244.0.8/30 via 10.77.0.21 dev u0 proto 202 ";
        assert_eq!(
            parse_monitor_line(add),
            Some((
                1_795_285_531_673_178,
                "10.244.0.8/30".parse::<IpNet>().unwrap()
            ))
        );
        let v6 = "[2026-11-21T18:25:31.164341] fd00:10:244::4/126 via fd00:77:ff::21 dev u0 \
                  proto 202 metric 1024 pref medium";
        assert!(parse_monitor_line(v6).is_some());
        let del =
            "[2026-11-21T18:25:31.673178] Deleted 10.244.0.8/30 via 10.77.0.21 dev u0 proto 202";
        assert_eq!(parse_monitor_line(del), None);
        let pod = "[2026-11-21T18:25:31.673178] 10.244.0.9 dev tth0123 proto 201 scope link";
        assert_eq!(parse_monitor_line(pod), None);
    }
}
