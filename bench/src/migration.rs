//! tether's live-migration benchmark: how long a KubeVirt VM is
//! unreachable while it moves between nodes, and how fast every node's
//! route follows it.
//!
//! A 3-node cluster on a 3-member etcd (host-gw), as in `tether-bench
//! cluster`.
//! The "VM" is a virt-launcher pod added through the real `tether` plugin
//! with KubeVirt's annotations on node A; an observer pod on node C probes
//! its IPv4 address at 2000 echo requests per second. The VM then migrates
//! back and forth between A and B, `--migrations` times (after `--warmup`
//! untimed ones), each time as KubeVirt and QEMU do it:
//!
//! 1. the migration's target pod is added on the other node (same IP and
//!    MAC, wired but not routed to);
//! 2. with the probes flowing, the source pod stops answering (its echo
//!    sysctl, as a paused guest) and the target pod sends QEMU's RARP
//!    announcement for the VM's MAC;
//! 3. tether's daemon on the target sees the RARP, routes the VM's address
//!    to the target pod and commits the cutover to the store; the other two
//!    nodes follow through etcd's watch;
//! 4. once the probes have resumed and the other nodes report the route
//!    change, the source pod is deleted (CNI DEL) and the target becomes
//!    the VM's pod.
//!
//! Per migration it measures the observer's loss window (from the probes'
//! record) and, on this machine's one clock, the times from the RARP's send
//! to the target daemon's read of it, to the target's local route and the
//! record's commit (the daemon's Stats `last_cutover`), and to the route
//! change on each other node (their Stats `last_vm_route_update`).
//!
//! Run (as root): `cargo run --release -p tether-bench -- migration
//! [--migrations 30] [--warmup 2] [--no-build] [--write BENCHMARKS.md]`.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::builder::RangedU64ValueParser;
use tether_e2e::admin;
use tether_e2e::cluster::{assert_ping_within, ClusterNode, NodeOpts, Pod};
use tether_e2e::migration::{pause_icmp, send_rarp, Prober};
use tether_e2e::pb::StatsResponse;
use tether_e2e::topology::Topology;
use tether_e2e::vm::{
    active_node, alternate_node, del_vm_pod, get_vm, mac_bytes, result_mac, try_add_vm_pod,
    VmPodSpec,
};
use tether_e2e::wait_until;

use crate::kit::{
    guarded, judge, nearest_rank, poll_until, release_dir, stdout_of, Benchmark, CommonArgs,
    Failures, Report, Run, Table,
};

/// The issue asks for at least this many timed migrations.
const MIN_MIGRATIONS: usize = 20;
/// The VM's namespace and name.
const NAMESPACE: &str = "bench";
const VM: &str = "vm";
/// The daemons' log level (one line per cutover).
const LOG_LEVEL: &str = "info";
/// The probe interval: 2000 echo requests per second.
const PROBE_INTERVAL: Duration = Duration::from_micros(500);
/// Answers that show the path works: before the pause, and after it.
const ANSWERS: u64 = 200;
/// How long the path may take to work before the migration.
const READY_WAIT: Duration = Duration::from_secs(5);
/// How long the probes and the other nodes may take to follow a cutover
/// before it counts as failed.
const CUTOVER_WAIT: Duration = Duration::from_secs(10);
/// How long the observer may take to reach the VM after its first ADD.
const CONVERGE: Duration = Duration::from_secs(15);
/// How long a DEL's background veth deletion may take.
const SETTLE: Duration = Duration::from_secs(5);

/// The target for the median loss window.
const TARGET_MS: f64 = 50.0;
/// The goal beyond it.
const GOAL_MS: f64 = 10.0;
/// Published cutover figures to beat: Kube-OVN and OVN-Kubernetes, about
/// half a second.
const PUBLISHED_MS: f64 = 500.0;

/// `tether-bench migration`'s flags.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Timed migrations (the issue asks for at least 20).
    #[arg(long, default_value_t = 30, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    migrations: usize,
    /// Untimed migrations first.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    #[command(flatten)]
    common: CommonArgs,
}

/// The release binaries' directory, holding `tether` and `tetherd`.
pub struct Bins {
    dir: PathBuf,
    tetherd: PathBuf,
}

impl Benchmark for Args {
    const NAME: &'static str = "migration";
    const SECTION: &'static str = "bench_migration";
    type Ready = Bins;
    type Measured = Measured;

    fn common(&self) -> &CommonArgs {
        &self.common
    }

    fn prepare(&self) -> Result<Bins, String> {
        let bins = bins(self)?;
        eprintln!("migration: binaries from {}", bins.dir.display());
        Ok(bins)
    }

    fn measure(&self, bins: &Bins, failures: &mut Failures) -> Measured {
        // Filled as the migrations go, so that a panic half-way still
        // leaves what was measured before it.
        let mut run = Measured::default();
        guarded("migration", failures, |f| {
            migration_phase(bins, self, &mut run, f)
        });
        run
    }

    fn report(&self, run: &Run, bins: &Bins, measured: &Measured) -> String {
        report(run, self, &bins.dir, measured)
    }
}

fn bins(args: &Args) -> Result<Bins, String> {
    let dir = release_dir(Args::NAME, args.common.build())?;
    Ok(Bins {
        tetherd: dir.join("tetherd"),
        dir,
    })
}

/// As in `tether-bench cluster`: the chosen tetherd, `info` logs, and the
/// daemon's own lease defaults (15 s TTL, 600 s grace), so that a busy
/// machine never reaps a node in the middle of a run.
fn node_opts(bins: &Bins) -> NodeOpts {
    NodeOpts {
        lease_ttl_secs: 15,
        node_grace_secs: 600,
        log_level: Some(LOG_LEVEL.to_owned()),
        bin: Some(bins.tetherd.clone()),
        ..NodeOpts::default()
    }
}

// ---------------------------------------------------------------------------
// The migrations

/// One migration's measures; `None` where it could not be read (a failure,
/// reported).
#[derive(Default, Clone)]
struct Sample {
    /// From node, to node (indexes).
    from: usize,
    to: usize,
    /// The longest loss window seen after the pause (µs), and the probes it
    /// lost.
    loss_us: Option<i64>,
    lost: Option<u64>,
    /// The source's pause → the RARP's send (µs): the bench's own gap,
    /// inside the loss window.
    pause_to_rarp_us: Option<i64>,
    /// RARP sent → the first answered probe after the loss window was sent
    /// (µs): when the path worked again.
    resumed_us: Option<i64>,
    /// RARP sent → the target daemon read it (µs; both on this machine's
    /// wall clock).
    read_us: Option<i64>,
    /// The target daemon's `local_route_ms` and `committed_ms`, from its
    /// read of the frame (µs).
    local_route_us: Option<i64>,
    committed_us: Option<i64>,
    /// RARP sent → the route change on the source node and on the
    /// observer's node (µs).
    source_route_us: Option<i64>,
    observer_route_us: Option<i64>,
    /// The cutover's generation.
    generation: Option<u64>,
    /// The prober's own troubles during this migration.
    skipped_slots: u64,
    send_errors: u64,
    late: u64,
}

impl Sample {
    fn target_route_us(&self) -> Option<i64> {
        Some(self.read_us? + self.local_route_us?)
    }

    fn committed_from_rarp_us(&self) -> Option<i64> {
        Some(self.read_us? + self.committed_us?)
    }

    /// RARP sent → the last of the three nodes has its route: the target's
    /// local route, the source's and the observer's node's route change.
    fn all_nodes_us(&self) -> Option<i64> {
        Some(
            self.target_route_us()?
                .max(self.source_route_us?)
                .max(self.observer_route_us?),
        )
    }
}

/// What the run measured.
#[derive(Default)]
pub struct Measured {
    node_names: Vec<String>,
    vm_ip: Option<IpAddr>,
    mac: String,
    /// Every migration tried, warm-up included, and its index.
    samples: Vec<(usize, Sample)>,
    /// Migrations whose probes did not resume within [`CUTOVER_WAIT`].
    not_resumed: Vec<usize>,
    /// Migrations tried (warm-up included).
    attempted: usize,
    /// The record at the end: generation, active node, alternate node.
    end_record: Option<(u64, String, String)>,
    /// The node the VM ran on last.
    last_host: Option<String>,
    /// Each node's Stats `vm_cutovers` at the end.
    cutovers: Vec<u64>,
    /// Each node's Stats `vm_route_updates` at the end.
    route_updates: Vec<u64>,
}

impl Measured {
    fn timed(&self, warmup: usize) -> Vec<&Sample> {
        self.samples
            .iter()
            .filter(|(i, _)| *i >= warmup)
            .map(|(_, s)| s)
            .collect()
    }
}

/// The VM's current pod.
struct Current {
    node: usize,
    spec: VmPodSpec,
    pod: Pod,
}

/// What the migration loop needs at hand.
struct Ctx<'a> {
    nodes: [&'a ClusterNode; 3],
    observer: &'a Pod,
    ip: IpAddr,
    mac: String,
}

fn socket(node: &ClusterNode) -> &Path {
    node.daemon().socket()
}

fn unix_nanos(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64)
}

fn migration_phase(bins: &Bins, args: &Args, run: &mut Measured, f: &mut Failures) {
    eprintln!("migration: a 3-node cluster (etcd ×3, host-gw)");
    let cluster = Topology::tetherd(3)
        .etcd_members(3)
        .node(node_opts(bins))
        .start();
    let nodes = [cluster.node(0), cluster.node(1), cluster.node(2)];
    run.node_names = nodes.iter().map(|n| n.name().to_owned()).collect();

    let spec = VmPodSpec::new(NAMESPACE, VM, "virt-launcher-vm-0");
    let (out, netns, id) = try_add_vm_pod(nodes[0], &spec);
    if let Err(e) = judge("ADD", &out) {
        panic!("ADD of the VM's first pod on node A: {e}");
    }
    let first = Pod::from_output(netns, id, nodes[0].name(), &out);
    let ip = first.v4().expect("the VM pod has an IPv4 address");
    let mac = result_mac(&first);
    run.vm_ip = Some(ip);
    run.mac = mac.clone();
    eprintln!("migration: VM {NAMESPACE}/{VM} at {ip} ({mac}) on node A");

    let observer = nodes[2].add_pod();
    assert_ping_within(observer.netns(), ip, CONVERGE);
    let ctx = Ctx {
        nodes,
        observer: &observer,
        ip,
        mac,
    };
    let mut current = Current {
        node: 0,
        spec,
        pod: first,
    };

    let total = args.warmup + args.migrations;
    for i in 0..total {
        run.attempted = i + 1;
        let what = if i < args.warmup {
            format!("warm-up {}/{}", i + 1, args.warmup)
        } else {
            format!("migration {}/{}", i + 1 - args.warmup, args.migrations)
        };
        match migrate(&ctx, i, &mut current, run, f) {
            Ok(s) => {
                eprintln!(
                    "migration: {what} {}→{}: loss {} ({} probes), pause→RARP {}, \
                     RARP→read {}, →target route {}, →committed {}, →all nodes {}, \
                     →path works {}",
                    letter(s.from),
                    letter(s.to),
                    ms(s.loss_us, 1),
                    s.lost.map_or("n/a".to_owned(), |n| n.to_string()),
                    ms(s.pause_to_rarp_us, 2),
                    ms(s.read_us, 2),
                    ms(s.target_route_us(), 2),
                    ms(s.committed_from_rarp_us(), 2),
                    ms(s.all_nodes_us(), 2),
                    ms(s.resumed_us, 2)
                );
                run.samples.push((i, s));
            }
            Err(e) => {
                f.fail(format!("{what}: {e}; stopping the migrations"));
                break;
            }
        }
    }
    run.last_host = Some(nodes[current.node].name().to_owned());

    match get_vm(socket(nodes[2]), NAMESPACE, VM) {
        Ok(rec) => {
            let end = (
                rec.generation,
                active_node(&rec).to_owned(),
                alternate_node(&rec).to_owned(),
            );
            if end.1 != nodes[current.node].name() {
                f.fail(format!(
                    "at the end the record's active node is {:?}, the VM's last host is {}",
                    end.1,
                    nodes[current.node].name()
                ));
            }
            run.end_record = Some(end);
        }
        Err(e) => f.fail(format!("GetVm at the end: {e}")),
    }
    let stats: Vec<StatsResponse> = nodes.iter().map(|n| admin::stats(socket(n))).collect();
    run.cutovers = stats.iter().map(|s| s.vm_cutovers).collect();
    run.route_updates = stats.iter().map(|s| s.vm_route_updates).collect();
    let sum: u64 = run.cutovers.iter().sum();
    if sum != run.attempted as u64 {
        f.fail(format!(
            "the nodes counted {sum} cutover(s) ({:?}) for {} migration(s)",
            run.cutovers, run.attempted
        ));
    }
    // The pods go before the cluster (their netns are deleted on drop).
    drop(current);
    drop(observer);
}

fn letter(node: usize) -> char {
    ['A', 'B', 'C'][node]
}

/// One migration of the VM from `cur`'s node to the other of A and B. An
/// error stops the run (the VM's state is not known any more); smaller
/// problems are counted in `f` and leave a `None` in the sample.
fn migrate(
    ctx: &Ctx,
    i: usize,
    cur: &mut Current,
    run: &mut Measured,
    f: &mut Failures,
) -> Result<Sample, String> {
    let (x, y) = (cur.node, 1 - cur.node);
    let (from, to) = (ctx.nodes[x], ctx.nodes[y]);
    let mut s = Sample {
        from: x,
        to: y,
        ..Sample::default()
    };

    // 1. The target pod: the VM's addresses and MAC, not yet routed to.
    let tspec = cur.spec.target(&format!("virt-launcher-vm-{}", i + 1));
    let (out, netns, id) = try_add_vm_pod(to, &tspec);
    judge("ADD", &out).map_err(|e| format!("ADD of the target on {}: {e}", to.name()))?;
    let target = Pod::from_output(netns, id, to.name(), &out);
    if target.ips() != cur.pod.ips() {
        return Err(format!(
            "the target got {:?}, the VM has {:?}",
            target.ips(),
            cur.pod.ips()
        ));
    }
    let tmac = result_mac(&target);
    if tmac != ctx.mac {
        return Err(format!("the target got MAC {tmac}, the VM has {}", ctx.mac));
    }
    let rec = get_vm(socket(from), NAMESPACE, VM).map_err(|e| format!("GetVm: {e}"))?;
    if active_node(&rec) != from.name() || alternate_node(&rec) != to.name() {
        return Err(format!(
            "before the cutover the record has active {:?}, alternate {:?}",
            active_node(&rec),
            alternate_node(&rec)
        ));
    }
    let before: Vec<u64> = ctx
        .nodes
        .iter()
        .map(|n| admin::stats(socket(n)).vm_cutovers)
        .collect();

    // 2. Probes flowing, then the source pauses and the target announces.
    let prober = Prober::start(ctx.observer.netns(), ctx.ip, PROBE_INTERVAL);
    let started = Instant::now();
    if !wait_until(READY_WAIT, || prober.received_since(started) >= ANSWERS) {
        let report = prober.stop();
        return Err(format!(
            "no answers from the VM before the migration: {report}"
        ));
    }
    let paused_at = Instant::now();
    pause_icmp(cur.pod.netns(), true);
    // The send's wall-clock time: the Instant send_rarp returns, moved onto
    // the wall clock read right before the call.
    let (i0, s0) = (Instant::now(), SystemTime::now());
    let sent_at = send_rarp(target.netns(), "eth0", mac_bytes(&ctx.mac));
    let sent_unix = unix_nanos(s0) + sent_at.saturating_duration_since(i0).as_nanos() as i64;
    let deadline = sent_at + CUTOVER_WAIT;
    s.pause_to_rarp_us = Some(sent_at.saturating_duration_since(paused_at).as_micros() as i64);

    // 3. The probes resume; the target cut over; the others follow. The
    // probes first, so that reading Stats does not load the daemons while
    // the path is being repaired.
    let resumed = poll_until(
        deadline,
        || prober.received_since(paused_at),
        |n| *n >= ANSWERS,
    ) >= ANSWERS;
    let report = prober.stop();
    s.skipped_slots = report.skipped_slots;
    s.send_errors = report.send_errors;
    s.late = report.late;
    if resumed {
        match report.longest_loss_after(paused_at) {
            Some(w) => {
                s.loss_us = Some(w.duration.as_micros() as i64);
                s.lost = Some(w.lost);
                s.resumed_us = Some(if w.resumed >= sent_at {
                    w.resumed.duration_since(sent_at).as_micros() as i64
                } else {
                    -(sent_at.duration_since(w.resumed).as_micros() as i64)
                });
            }
            None => f.fail(format!(
                "migration {}: no loss at all after the pause ({report}): the pause did not work",
                i + 1
            )),
        }
    } else {
        run.not_resumed.push(i);
        f.fail(format!(
            "migration {}: the probes did not resume within {CUTOVER_WAIT:?}: {report}",
            i + 1
        ));
    }

    let stats = poll_until(
        deadline,
        || admin::stats(socket(to)),
        |st| st.vm_cutovers > before[y],
    );
    let mut cut_vm = None;
    match &stats.last_cutover {
        Some(c) if stats.vm_cutovers > before[y] => {
            if c.trigger != "rarp" {
                f.fail(format!(
                    "migration {}: the cutover's trigger is {:?}, not \"rarp\"",
                    i + 1,
                    c.trigger
                ));
            }
            if stats.vm_cutovers != before[y] + 1 {
                f.fail(format!(
                    "migration {}: {} counted {} cutovers for one RARP",
                    i + 1,
                    to.name(),
                    stats.vm_cutovers - before[y]
                ));
            }
            s.generation = Some(c.generation);
            s.read_us = Some((c.seen_unix_nanos as i64 - sent_unix) / 1000);
            if c.local_route_ms > 0.0 {
                s.local_route_us = Some((c.local_route_ms * 1e3).round() as i64);
            } else {
                f.fail(format!(
                    "migration {}: the target's cutover has no local route timing",
                    i + 1
                ));
            }
            s.committed_us = Some((c.committed_ms * 1e3).round() as i64);
            cut_vm = Some((c.vm.clone(), c.generation));
        }
        _ => f.fail(format!(
            "migration {}: {} counted no cutover within {CUTOVER_WAIT:?}",
            i + 1,
            to.name()
        )),
    }
    for (k, n) in ctx.nodes.iter().enumerate() {
        if k != y {
            let now = admin::stats(socket(n)).vm_cutovers;
            if now != before[k] {
                f.fail(format!(
                    "migration {}: {} (not the target) counted {} cutover(s)",
                    i + 1,
                    n.name(),
                    now - before[k]
                ));
            }
        }
    }
    if let Some((vm, generation)) = &cut_vm {
        for (k, slot) in [(x, &mut s.source_route_us), (2, &mut s.observer_route_us)] {
            let st = poll_until(
                deadline,
                || admin::stats(socket(ctx.nodes[k])),
                |st| {
                    st.last_vm_route_update
                        .as_ref()
                        .is_some_and(|u| u.vm == *vm && u.generation >= *generation)
                },
            );
            match st
                .last_vm_route_update
                .filter(|u| u.vm == *vm && u.generation >= *generation)
            {
                Some(u) => *slot = Some((u.done_unix_nanos as i64 - sent_unix) / 1000),
                None => f.fail(format!(
                    "migration {}: {} showed no route change for generation {generation} \
                     within {CUTOVER_WAIT:?}",
                    i + 1,
                    ctx.nodes[k].name()
                )),
            }
        }
    }

    // 4. The record must name the target active; then the source's DEL.
    let rec = get_vm(socket(ctx.nodes[2]), NAMESPACE, VM).map_err(|e| format!("GetVm: {e}"))?;
    if active_node(&rec) != to.name() {
        return Err(format!(
            "after the RARP the record's active node is {:?}, not {}",
            active_node(&rec),
            to.name()
        ));
    }
    let out = del_vm_pod(from, &cur.spec, &cur.pod);
    if let Err(e) = judge("DEL", &out) {
        f.fail(format!(
            "migration {}: DEL of the source on {}: {e}",
            i + 1,
            from.name()
        ));
    }
    let old = std::mem::replace(
        cur,
        Current {
            node: y,
            spec: tspec,
            pod: target,
        },
    );
    drop(old);
    // Untimed: the source's veth teardown runs in the background; let it
    // end before that node's next cutover.
    poll_until(
        Instant::now() + SETTLE,
        || admin::stats(socket(from)).link_deletions_in_flight,
        |n| *n == 0,
    );
    Ok(s)
}

// ---------------------------------------------------------------------------
// The report

/// `us` microseconds as milliseconds with `decimals` decimals.
fn ms(us: Option<i64>, decimals: usize) -> String {
    match us {
        Some(us) => format!("{:.*} ms", decimals, us as f64 / 1e3),
        None => "n/a".to_owned(),
    }
}

fn count(n: Option<i64>) -> String {
    n.map_or("n/a".to_owned(), |n| n.to_string())
}

fn report(run: &Run, args: &Args, bin_dir: &Path, got: &Measured) -> String {
    let mut r = Report::new("Live migration cutover", run);
    r.item(format!(
        "Software: tether {} (`tether` and `tetherd` from `{}`); Debian etcd-server {}.",
        run.machine.tether_version,
        bin_dir
            .strip_prefix(tether_e2e::workspace_dir())
            .unwrap_or(bin_dir)
            .display(),
        stdout_of("dpkg-query", &["-W", "-f", "${Version}", "etcd-server"])
    ))
    .command(run, "");

    let timed = got.timed(args.warmup);
    r.paragraph("Method:").raw("\n");
    r.item(format!(
        "Topology: a 3-member etcd and 3 nodes each running `tetherd --store etcd --overlay \
         none` (host-gw) on a fabric bridge, as in `tether-bench cluster`. The VM is a \
         virt-launcher pod (`{NAMESPACE}/{VM}`, added through the real `tether` plugin with \
         KubeVirt's annotations) on node A; an observer pod on node C probes its IPv4 address \
         with ICMP echo every {} µs (2000 per second).",
        PROBE_INTERVAL.as_micros()
    ));
    r.item(format!(
        "Each migration, between A and B in turn: the target pod is added on the other node \
         (same IP and MAC, wired, not routed to); once {ANSWERS} probes are answered, the \
         source pod stops answering echo (its `icmp_echo_ignore_all`, as a paused guest) and \
         the target pod sends QEMU's RARP announcement for the VM's MAC; the bench waits for \
         {ANSWERS} answers again and for the other nodes' route change, then DELs the source \
         pod. {} timed migrations after {} untimed warm-up migration(s).",
        args.migrations, args.warmup
    ));
    r.item(
        "Loss window: the observer's longest run of unanswered probes after the pause, from \
         the last answered probe's send to the next answered one's (0.5 ms resolution; a reply \
         later than 1 s counts as lost); probes lost: the unanswered probes in it.",
    );
    r.item(
        "RARP → x: from the frame's send (this process, wall clock) to the target daemon's \
         read of it (Stats `last_cutover.seen_unix_nanos`), plus the daemon's own \
         `local_route_ms` (its route to the target pod) or `committed_ms` (the record's \
         compare-and-swap in etcd answered), both measured from that read. The other two \
         nodes (the source and C, the observer's node): Stats `last_vm_route_update` once it \
         names the cutover's generation, `done_unix_nanos` minus the send. All on this \
         machine's one clock.",
    );
    r.item(
        "All nodes repointed: per migration, the last of the target's local route, the \
         source's and C's route changes. Two more rows place the loss window: the gap \
         between the source's pause and the RARP (the bench's pause runs in a thread that \
         enters the pod netns), and from the RARP to the send of the first probe answered \
         again. Median and p90 are nearest-rank over the timed migrations.",
    );

    let col = |f: &dyn Fn(&Sample) -> Option<i64>| -> Vec<i64> {
        timed.iter().filter_map(|s| f(s)).collect()
    };
    let loss = col(&|s| s.loss_us);
    let lost = col(&|s| s.lost.map(|n| n as i64));
    let rows: Vec<(&str, Vec<i64>)> = vec![
        (
            "source paused → RARP sent (the bench's own gap)",
            col(&|s| s.pause_to_rarp_us),
        ),
        (
            "RARP → first answered probe sent (path works again)",
            col(&|s| s.resumed_us),
        ),
        ("RARP sent → target daemon read it", col(&|s| s.read_us)),
        ("RARP → target route", col(&|s| s.target_route_us())),
        (
            "RARP → record committed",
            col(&|s| s.committed_from_rarp_us()),
        ),
        ("RARP → source node's route", col(&|s| s.source_route_us)),
        (
            "RARP → observer node's (C) route",
            col(&|s| s.observer_route_us),
        ),
        ("RARP → all nodes repointed", col(&|s| s.all_nodes_us())),
    ];
    let mut t = Table::new(&["metric", "n", "median", "p90", "worst"]).right_aligned_from(1);
    t.row([
        "loss window (observer on C)".to_owned(),
        loss.len().to_string(),
        ms(nearest_rank(&loss, 0.5), 1),
        ms(nearest_rank(&loss, 0.9), 1),
        ms(loss.iter().copied().max(), 1),
    ]);
    t.row([
        "probes lost".to_owned(),
        lost.len().to_string(),
        count(nearest_rank(&lost, 0.5)),
        count(nearest_rank(&lost, 0.9)),
        count(lost.iter().copied().max()),
    ]);
    for (what, v) in &rows {
        t.row([
            (*what).to_owned(),
            v.len().to_string(),
            ms(nearest_rank(v, 0.5), 2),
            ms(nearest_rank(v, 0.9), 2),
            ms(v.iter().copied().max(), 2),
        ]);
    }
    r.table(&t);
    let best = loss.iter().copied().min();
    r.paragraph(format!(
        "Shortest loss window {}. The daemon's own timings, from its read of the frame: \
         local route median {}, record committed median {}.",
        ms(best, 1),
        ms(nearest_rank(&col(&|s| s.local_route_us), 0.5), 2),
        ms(nearest_rank(&col(&|s| s.committed_us), 0.5), 2)
    ));

    let median = nearest_rank(&loss, 0.5).map(|us| us as f64 / 1e3);
    let judgment = match median {
        Some(med) => {
            let verdict = |limit: f64| if med <= limit { "met" } else { "NOT met" };
            let enough = if timed.len() < MIN_MIGRATIONS {
                format!(
                    " (only {} timed migrations: the issue asks for at least {MIN_MIGRATIONS})",
                    timed.len()
                )
            } else {
                String::new()
            };
            format!(
                "**Judgment**: median loss window {med:.1} ms over {} migrations{enough}: \
                 target ≤ {TARGET_MS:.0} ms {}; goal ≤ {GOAL_MS:.0} ms {}; against the published \
                 ~{:.1} s of Kube-OVN and OVN-Kubernetes, {:.0}× shorter (worst window {}).",
                loss.len(),
                verdict(TARGET_MS),
                verdict(GOAL_MS),
                PUBLISHED_MS / 1e3,
                PUBLISHED_MS / med.max(0.001),
                ms(loss.iter().copied().max(), 1)
            )
        }
        None => "**Judgment**: no loss window was measured; the target (median ≤ 50 ms) \
                 is not shown to be met."
            .to_owned(),
    };
    r.paragraph(judgment);

    r.paragraph("Checks:").raw("\n");
    r.item(format!(
        "VM `{NAMESPACE}/{VM}` at {} ({}); migrations tried {} (with warm-up), probes that \
         never resumed: {}.",
        got.vm_ip.map_or("?".to_owned(), |ip| ip.to_string()),
        got.mac,
        got.attempted,
        if got.not_resumed.is_empty() {
            "none".to_owned()
        } else {
            format!("{:?}", got.not_resumed)
        }
    ));
    match &got.end_record {
        Some((generation, active, alternate)) => {
            r.item(format!(
                "The record at the end: generation {generation}, active on {active}{} \
                 (the VM's last host: {}), alternate {}.",
                if Some(active) == got.last_host.as_ref() {
                    ", as it should"
                } else {
                    ", WRONG"
                },
                got.last_host.as_deref().unwrap_or("?"),
                if alternate.is_empty() {
                    "none"
                } else {
                    alternate
                }
            ));
        }
        None => {
            r.item("The record at the end: not read.");
        }
    }
    if !got.cutovers.is_empty() {
        let per_node: Vec<String> = got
            .node_names
            .iter()
            .zip(&got.cutovers)
            .zip(&got.route_updates)
            .enumerate()
            .map(|(k, ((n, c), u))| format!("{} ({n}) {c} cutovers, {u} route updates", letter(k)))
            .collect();
        r.item(format!(
            "Stats: {}; cutovers in all {} for {} migrations.",
            per_node.join("; "),
            got.cutovers.iter().sum::<u64>(),
            got.attempted
        ));
    }
    let all = got.samples.iter().map(|(_, s)| s);
    let (skipped, errors, late) = all.fold((0, 0, 0), |(a, b, c), s| {
        (a + s.skipped_slots, b + s.send_errors, c + s.late)
    });
    r.item(format!(
        "The prober, over all migrations: {skipped} schedule slots skipped (its thread ran \
         late), {errors} send errors, {late} late replies."
    ));
    let read = col(&|s| s.read_us);
    r.item(format!(
        "Clock sanity: RARP → daemon read lies between {} and {} (negative would mean the \
         times are misread).",
        ms(read.iter().copied().min(), 3),
        ms(read.iter().copied().max(), 3)
    ));
    r.finish(run)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flags_keep_their_defaults_and_limits() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: Args,
        }
        let parse = |line: &[&str]| {
            Cli::try_parse_from(std::iter::once("migration").chain(line.iter().copied()))
                .map(|c| c.args)
        };
        let a = parse(&[]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((a.migrations, a.warmup, a.common.build()), (30, 2, true));
        let a = parse(&["--migrations", "5", "--warmup", "0", "--no-build"])
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((a.migrations, a.warmup, a.common.build()), (5, 0, false));
        assert!(parse(&["--migrations", "0"]).is_err());
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<i64> = (1..=10).collect();
        assert_eq!(nearest_rank(&v, 0.5), Some(5));
        assert_eq!(nearest_rank(&v, 0.9), Some(9));
        assert_eq!(nearest_rank(&v, 1.0), Some(10));
        assert_eq!(nearest_rank::<i64>(&[], 0.5), None);
    }

    #[test]
    fn all_nodes_is_the_last_of_the_three() {
        let s = Sample {
            read_us: Some(100),
            local_route_us: Some(300),
            source_route_us: Some(2_000),
            observer_route_us: Some(1_500),
            ..Sample::default()
        };
        assert_eq!(s.target_route_us(), Some(400));
        assert_eq!(s.all_nodes_us(), Some(2_000));
        let missing = Sample {
            observer_route_us: None,
            ..s
        };
        assert_eq!(missing.all_nodes_us(), None);
    }
}
