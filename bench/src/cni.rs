//! tether's benchmark: tether against Debian's reference `ptp` and
//! `bridge` (both with `host-local`), side by side in one run.
//!
//! For each plugin: ADD and DEL latency (p50, p99) over sequential cycles,
//! each into a fresh pod netns, and the wall time of N concurrent ADDs, then
//! N concurrent DELs. Every plugin process is spawned the same way: from a
//! thread that entered the plugin's node netns (tetherd's for tether), so no
//! `ip netns exec` lands in the timed region, and none pays what another
//! does not. Only the plugin invocation is timed, from spawn to reap.
//!
//! Beside them, the *floor*: `floor_add` (tests/src/bin/floor_add.rs), the
//! smallest program doing tetherd's kernel work for one ADD, spawned the same
//! way; tether's ADD is reported as a ratio to it. Then the same ADD/DEL
//! cycles again while the node already holds `--pods` attached pods.
//!
//! Run (as root): `cargo run --release -p tether-bench -- cni [--cycles 200]
//! [--concurrency 100] [--plugins tether,tether-host,floor,ptp,bridge] [--pods 0,50,500]
//! [--pods-cycles 30] [--write BENCHMARKS.md]`.

use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use clap::builder::RangedU64ValueParser;
use serde_json::Value;
use tether_e2e::admin;
use tether_e2e::reference::{bridge_netconf, host_local_leases, ptp_netconf};
use tether_e2e::{
    cni, ref_plugin, run_prefix, target_dir, CniEnv, CniOutput, Daemon, DaemonOpts, Family, Netns,
    TempDir,
};

use crate::kit::{
    build_release, cargo_build_release, first_lines, judge, nearest_rank, panic_text, poll_until,
    poll_until_fast, stdout_of, Benchmark, CommonArgs, Failures, Report, Run, Table,
};

/// How long a DEL may leave objects behind before the check calls it a
/// leak (tether removes the veth off the request's critical path).
const SETTLE: Duration = Duration::from_secs(5);

/// `tether-bench cni`'s flags.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Timed sequential ADD+DEL cycles per plugin.
    #[arg(long, default_value_t = 200, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    cycles: usize,
    /// Concurrent ADDs (then DELs) released together in a round.
    #[arg(long, default_value_t = 100, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    concurrency: usize,
    /// Concurrent rounds per plugin; the median is reported.
    #[arg(long, default_value_t = 3, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    rounds: usize,
    /// Untimed sequential cycles first.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Pods kept before a leak check (0 counts as 1).
    #[arg(long, default_value_t = 50, value_parser = at_least_one)]
    batch: usize,
    /// The plugins, comma-separated: tether, tether-host, floor, ptp, bridge.
    #[arg(long, value_name = "LIST", default_value = "tether,floor,ptp,bridge", value_parser = kinds)]
    plugins: ::std::vec::Vec<Kind>,
    /// Pods kept attached on the node while timing, comma-separated, one
    /// level each (`none` skips the phase).
    #[arg(long, value_name = "LIST", default_value = "0,50,500", value_parser = pod_levels)]
    pods: ::std::vec::Vec<usize>,
    /// Timed ADD+DEL cycles per level of `--pods` (0 counts as 1).
    #[arg(long, default_value_t = 30, value_parser = at_least_one)]
    pods_cycles: usize,
    /// The plugins timed with pods on the node, comma-separated (among
    /// `--plugins`).
    #[arg(long, value_name = "LIST", default_value = "tether,floor,ptp", value_parser = kinds)]
    pods_plugins: ::std::vec::Vec<Kind>,
    #[command(flatten)]
    common: CommonArgs,
}

/// A count where 0 means 1.
fn at_least_one(text: &str) -> Result<usize, String> {
    text.parse::<usize>()
        .map(|n| n.max(1))
        .map_err(|e| e.to_string())
}

/// `--pods`: counts, comma-separated, ascending without repeats (levels
/// are filled cumulatively: each one adds pods to the last); empty or
/// `none` for none.
fn pod_levels(text: &str) -> Result<Vec<usize>, String> {
    let mut levels = if text.is_empty() || text == "none" {
        Vec::new()
    } else {
        text.split(',')
            .map(|n| n.parse::<usize>().map_err(|e| format!("{n:?}: {e}")))
            .collect::<Result<Vec<_>, _>>()?
    };
    levels.sort_unstable();
    levels.dedup();
    Ok(levels)
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Tether,
    /// tether again, with its own daemon, but the plugin spawned from the
    /// bench's own netns (the host's), as a runtime there starts it: the
    /// view of a harness outside the node netns.
    TetherHost,
    /// `floor_add`: tetherd's kernel work for one ADD, nothing else.
    Floor,
    Ptp,
    Bridge,
}

impl Kind {
    fn parse(s: &str) -> Result<Kind, String> {
        match s {
            "tether" => Ok(Kind::Tether),
            "tether-host" => Ok(Kind::TetherHost),
            "floor" => Ok(Kind::Floor),
            "ptp" => Ok(Kind::Ptp),
            "bridge" => Ok(Kind::Bridge),
            _ => Err(format!(
                "unknown plugin {s:?} (tether, tether-host, floor, ptp, bridge)"
            )),
        }
    }

    fn label(self) -> &'static str {
        match self {
            Kind::Tether => "tether",
            Kind::TetherHost => "tether, spawned from the host netns",
            Kind::Floor => "floor (floor_add)",
            Kind::Ptp => "ptp + host-local",
            Kind::Bridge => "bridge + host-local",
        }
    }

    fn short(self) -> &'static str {
        match self {
            Kind::Tether => "tether",
            Kind::TetherHost => "tether-host",
            Kind::Floor => "floor",
            Kind::Ptp => "ptp",
            Kind::Bridge => "bridge",
        }
    }
}

fn kinds(list: &str) -> Result<Vec<Kind>, String> {
    list.split(',').map(Kind::parse).collect()
}

/// The netns a plugin's processes are spawned in: tetherd's node netns, or
/// a plain one for the reference plugins.
enum Node {
    Daemon(Box<Daemon>),
    Plain(Netns),
}

impl Node {
    fn netns(&self) -> &Netns {
        match self {
            Node::Daemon(d) => d.node(),
            Node::Plain(ns) => ns,
        }
    }
}

/// One plugin under test, with what it measured and what went wrong.
struct Subject {
    kind: Kind,
    bin: PathBuf,
    netconf: Vec<u8>,
    /// The network name (host-local's subdirectory of `data_dir`).
    network: String,
    node: Node,
    /// host-local's leases (reference plugins only).
    data_dir: Option<TempDir>,
    /// Links that may stay in the node netns: `lo`, and the bridge.
    node_links: Vec<String>,
    version_p50: Option<Duration>,
    add: Vec<Duration>,
    del: Vec<Duration>,
    /// Wall time of each successful concurrent round.
    add_walls: Vec<Duration>,
    del_walls: Vec<Duration>,
    /// ADD/DEL latency at each level of `--pods`.
    levels: Vec<Level>,
    /// The floor's next pod address (10.200.0.0/16, in the floor's own
    /// namespaces only).
    floor_next: u32,
    calls: usize,
    failures: usize,
    problems: Vec<String>,
}

/// Latencies measured while the node held `pods` other attached pods.
struct Level {
    pods: usize,
    add: Vec<Duration>,
    del: Vec<Duration>,
}

impl Subject {
    fn new(
        kind: Kind,
        bin: PathBuf,
        netconf: Value,
        node: Node,
        data_dir: Option<TempDir>,
    ) -> Self {
        let network = netconf["name"].as_str().unwrap_or_default().to_owned();
        let mut node_links = vec!["lo".to_owned()];
        if let Some(bridge) = netconf["bridge"].as_str() {
            node_links.push(bridge.to_owned());
        }
        Subject {
            kind,
            bin,
            netconf: serde_json::to_vec(&netconf).expect("a JSON value serializes"),
            network,
            node,
            data_dir,
            node_links,
            version_p50: None,
            add: Vec::new(),
            del: Vec::new(),
            add_walls: Vec::new(),
            del_walls: Vec::new(),
            levels: Vec::new(),
            floor_next: 1,
            calls: 0,
            failures: 0,
            problems: Vec::new(),
        }
    }

    fn fail(&mut self, what: String) {
        self.failures += 1;
        eprintln!("cni: {}: FAILED: {what}", self.kind.short());
        if self.problems.len() < 10 {
            self.problems.push(what);
        }
    }

    fn env(&self, command: &str, id: &str, pod: &Netns) -> CniEnv {
        CniEnv::new(command, id, pod)
    }

    /// One invocation from a thread in the node netns (the caller's thread
    /// stays where it is), or, for `tether-host`, from the caller's own.
    fn invoke(&self, env: &CniEnv) -> CniOutput {
        if self.kind == Kind::TetherHost {
            return cni(&self.bin, env, &self.netconf);
        }
        self.node.netns().run(|| cni(&self.bin, env, &self.netconf))
    }

    /// One timed call; records a failure and returns None unless it
    /// succeeded (an ADD must also return an address).
    fn timed(&mut self, command: &str, id: &str, pod: &Netns) -> Option<Duration> {
        let mut env = self.env(command, id, pod);
        if self.kind == Kind::Floor {
            // The floor has no IPAM: the bench hands it the next address.
            let n = self.floor_next;
            self.floor_next += 1;
            let ip = std::net::Ipv4Addr::new(10, 200, (n >> 8) as u8, n as u8);
            env.extra = vec![
                ("FLOOR_HOST_IFNAME".to_owned(), floor_host(pod)),
                ("FLOOR_IPS".to_owned(), ip.to_string()),
            ];
        }
        let out = self.invoke(&env);
        self.calls += 1;
        match judge(command, &out) {
            Ok(()) => Some(out.elapsed),
            Err(e) => {
                self.fail(format!("{command} {id}: {e}"));
                None
            }
        }
    }
}

/// The floor's host veth for a pod: the run prefix, `f`, then the rest of
/// the pod netns name, so that it is unique and ours (at most 15 bytes for
/// names of up to 6 characters after the prefix).
fn floor_host(pod: &Netns) -> String {
    let rest = pod.name().strip_prefix(run_prefix()).unwrap_or(pod.name());
    format!("{}f{rest}", run_prefix())
}

/// One ADD then DEL into `pod`, both timed. The floor has no DEL: its veth
/// is deleted untimed (which takes the host route with it). Then waits,
/// untimed, until the pod holds only `lo`.
fn add_del(s: &mut Subject, id: &str, pod: &Netns) -> (Option<Duration>, Option<Duration>) {
    let add = s.timed("ADD", id, pod);
    let del = if s.kind == Kind::Floor {
        if add.is_some() {
            unwire_floor(s, std::iter::once(pod));
        }
        None
    } else {
        s.timed("DEL", id, pod)
    };
    // tether removes the veth after answering DEL (by design); wait,
    // untimed, until it is gone, so that the next call, another plugin's
    // maybe, does not pay for that work.
    let deadline = Instant::now() + SETTLE;
    poll_until(deadline, || pod.link_names(), |l| *l == ["lo"]);
    // The pod's link vanishes before the kernel has finished the veth's
    // teardown, which holds the kernel's RTNL lock that the next ADD's
    // veth creation needs: wait until tetherd counts no deletion in flight
    // (as `tether-bench cluster` does), as the floor's veth is deleted, untimed, to
    // the end. `tether-bench cluster`'s "ADD right after a DEL" measures the case
    // this wait keeps out.
    if let Node::Daemon(d) = &s.node {
        poll_until_fast(deadline, || {
            admin::stats(d.socket()).link_deletions_in_flight == 0
        });
    }
    (add, del)
}

/// Where the binaries are: `tether` and `tetherd`, and `floor_add`.
pub struct Ready {
    /// `TETHER_BIN_DIR`, else target/release.
    bins: PathBuf,
    /// `floor_add`, next to this binary.
    floor_add: PathBuf,
}

/// What the run measured: the plugins set up, each with its figures and
/// problems, and the spawn path's cost (none if nothing could be set up).
pub struct Measured {
    subjects: Vec<Subject>,
    baseline: Option<Baseline>,
}

impl Benchmark for Args {
    const NAME: &'static str = "cni";
    const SECTION: &'static str = "bench";
    type Ready = Ready;
    type Measured = Measured;

    fn common(&self) -> &CommonArgs {
        &self.common
    }

    /// Builds what `--plugins` needs, unless `--no-build`: the release
    /// shim and daemon for tether (unless `TETHER_BIN_DIR` names them),
    /// `floor_add` for the floor.
    fn prepare(&self) -> Result<Ready, String> {
        let wants = |kinds: &[Kind]| self.plugins.iter().any(|k| kinds.contains(k));
        let from_env = std::env::var_os("TETHER_BIN_DIR");
        let bins = match &from_env {
            Some(dir) => PathBuf::from(dir),
            None => target_dir().join("release"),
        };
        if self.common.build() && from_env.is_none() && wants(&[Kind::Tether, Kind::TetherHost]) {
            build_release(Self::NAME)?;
        }
        // Built into the workspace's target directory, like this binary
        // (`cargo run --release -p tether-bench`): next to it.
        let floor_add = std::env::current_exe()
            .map_err(|e| format!("locating the bench binary: {e}"))?
            .with_file_name("floor_add");
        if self.common.build() && wants(&[Kind::Floor]) {
            cargo_build_release(Self::NAME, &["-p", "tether-e2e", "--bin", "floor_add"])?;
        }
        Ok(Ready { bins, floor_add })
    }

    fn measure(&self, ready: &Ready, failures: &mut Failures) -> Measured {
        let mut subjects = Vec::new();
        for (i, kind) in self.plugins.iter().copied().enumerate() {
            // One /16 per plugin, only ever inside our namespaces.
            let subnet = format!("10.{}.0.0/16", 201 + i);
            match setup(kind, &subnet, ready) {
                Ok(s) => subjects.push(s),
                Err(e) => {
                    eprintln!("cni: {}: cannot set up: {e}", kind.short());
                    record(
                        failures,
                        format!(
                            "{} not measured: {}",
                            kind.short(),
                            first_lines(&e, 8).replace('\n', " / ")
                        ),
                    );
                }
            }
        }
        if subjects.is_empty() {
            eprintln!("cni: nothing to measure");
            return Measured {
                subjects,
                baseline: None,
            };
        }

        let baseline = spawn_baseline(subjects[0].node.netns(), 300);
        for s in subjects.iter_mut().filter(|s| s.kind != Kind::Floor) {
            s.version_p50 = version_p50(s, 50);
        }

        latency_phase(&mut subjects, self);
        // Rounds of each plugin in turn, order rotated: one round is one
        // sample, too exposed to a burst of load on a shared machine. The
        // floor has no DEL, so no rounds.
        let n = subjects.len();
        for round in 0..self.rounds {
            for k in 0..n {
                let s = &mut subjects[(round + k) % n];
                if s.kind != Kind::Floor {
                    throughput_phase(s, self.concurrency);
                }
            }
        }
        pods_phase(&mut subjects, self);
        // Every plugin must still be alive at the end.
        for s in &mut subjects {
            if let Node::Daemon(d) = &mut s.node {
                if !d.is_running() {
                    s.fail("tetherd is no longer running".to_owned());
                }
            }
        }
        // The plugins' own failures count for the run (their first ones
        // are listed in the report).
        for s in &subjects {
            for p in &s.problems {
                let p = first_lines(p, 4).replace('\n', " / ");
                record(failures, format!("{}: {p}", s.kind.label()));
            }
            failures.count += s.failures - s.problems.len();
        }
        Measured {
            subjects,
            baseline: Some(baseline),
        }
    }

    fn report(&self, run: &Run, _: &Ready, measured: &Measured) -> String {
        report(run, self, measured)
    }
}

/// Counts a failure already logged (by [`Subject::fail`] or the setup) in
/// `failures`, kept for the report if there is room, as
/// [`Failures::fail`] does but without logging it again.
fn record(failures: &mut Failures, what: String) {
    failures.count += 1;
    if failures.problems.len() < 12 {
        failures.problems.push(what);
    }
}

fn setup(kind: Kind, subnet: &str, ready: &Ready) -> Result<Subject, String> {
    let name = format!("bench{}", kind.short());
    match kind {
        Kind::Ptp | Kind::Bridge => {
            let data = TempDir::new("hl");
            let conf = if kind == Kind::Ptp {
                ptp_netconf(&name, subnet, data.path())
            } else {
                let bridge = format!("{}br", run_prefix());
                bridge_netconf(&name, &bridge, subnet, data.path())
            };
            let bin = ref_plugin(kind.short());
            if !bin.exists() {
                return Err(format!("{} is not installed", bin.display()));
            }
            let node = Node::Plain(Netns::new("n"));
            Ok(Subject::new(kind, bin, conf, node, Some(data)))
        }
        Kind::Floor => {
            // Built by `prepare`.
            let bin = ready.floor_add.clone();
            if !bin.exists() {
                return Err(format!(
                    "{} is not built (cargo build --release -p tether-e2e --bin floor_add)",
                    bin.display()
                ));
            }
            let node = Node::Plain(Netns::new("n"));
            let mut s = Subject::new(kind, bin, serde_json::json!({}), node, None);
            // It reads nothing on stdin.
            s.netconf = Vec::new();
            Ok(s)
        }
        Kind::Tether | Kind::TetherHost => {
            // Built by `prepare`.
            let bins = &ready.bins;
            let opts = DaemonOpts {
                pod_cidrs: vec![subnet.to_owned()],
                log_level: Some("info".to_owned()),
                bin: Some(bins.join("tetherd")),
                ..DaemonOpts::default()
            };
            // The harness panics with the daemon's log when it cannot start.
            let daemon = std::panic::catch_unwind(AssertUnwindSafe(|| Daemon::start(opts)))
                .map_err(|p| panic_text(&p))?;
            let conf = daemon.netconf("1.0.0", &name);
            let bin = bins.join("tether");
            Ok(Subject::new(
                kind,
                bin,
                conf,
                Node::Daemon(Box::new(daemon)),
                None,
            ))
        }
    }
}

/// Sequential ADD then DEL, each cycle into a fresh pod netns, plugins
/// interleaved (and their order rotated) so that background noise falls on
/// all of them alike. After each DEL the pod's links must be gone before
/// the next call. Pods are kept per batch, checked, then deleted outside
/// the timed region.
fn latency_phase(subjects: &mut [Subject], args: &Args) {
    let total = args.warmup + args.cycles;
    let n = subjects.len();
    let mut start = 0;
    while start < total {
        let end = (start + args.batch).min(total);
        eprintln!("cni: sequential cycles {start}..{end} of {total}");
        let mut pods: Vec<Vec<Netns>> = (0..n).map(|_| Vec::new()).collect();
        for cycle in start..end {
            for k in 0..n {
                let idx = (cycle + k) % n;
                let s = &mut subjects[idx];
                let pod = Netns::new("p");
                let id = format!("{}-{}-s{cycle}", run_prefix(), s.kind.short());
                let (add, del) = add_del(s, &id, &pod);
                if cycle >= args.warmup {
                    s.add.extend(add);
                    s.del.extend(del);
                }
                pods[idx].push(pod);
            }
        }
        for (s, pods) in subjects.iter_mut().zip(pods) {
            verify_clean(s, pods, "sequential");
        }
        start = end;
    }
}

/// ADD/DEL latency while the node already holds `level` attached pods, for
/// each level of `--pods` (ascending; each level adds pods to the last, so
/// 500 costs 500 ADDs, not 550). The held pods are ADDed untimed, each
/// into its own netns, and stay attached; the timed cycles are then
/// interleaved across plugins exactly as in `latency_phase`. At the end
/// every held pod is DELeted (the floor's go with their netns) and the
/// node must be clean again. Every pod netns is a [`Netns`] guard, so a
/// panic still deletes them all, and with them the pod ends of the veths.
fn pods_phase(subjects: &mut [Subject], args: &Args) {
    let chosen: Vec<usize> = (0..subjects.len())
        .filter(|&i| args.pods_plugins.contains(&subjects[i].kind))
        .collect();
    if chosen.is_empty() || args.pods.is_empty() {
        return;
    }
    let m = chosen.len();
    let mut held: Vec<Vec<(String, Netns)>> = subjects.iter().map(|_| Vec::new()).collect();
    for &level in &args.pods {
        for &i in &chosen {
            let s = &mut subjects[i];
            let from = held[i].len();
            if from < level {
                eprintln!("cni: {}: attaching pods {from}..{level}", s.kind.short());
            }
            while held[i].len() < level {
                let pod = Netns::new("k");
                let id = format!("{}-{}-k{}", run_prefix(), s.kind.short(), held[i].len());
                // Untimed: only the node's state matters here.
                let _ = s.timed("ADD", &id, &pod);
                held[i].push((id, pod));
            }
            s.levels.push(Level {
                pods: level,
                add: Vec::new(),
                del: Vec::new(),
            });
        }
        eprintln!(
            "cni: {} pods on each node: {} cycles",
            level, args.pods_cycles
        );
        let mut pods: Vec<Vec<Netns>> = subjects.iter().map(|_| Vec::new()).collect();
        for c in 0..args.pods_cycles {
            for k in 0..m {
                let i = chosen[(c + k) % m];
                let s = &mut subjects[i];
                let pod = Netns::new("q");
                let id = format!("{}-{}-q{level}-{c}", run_prefix(), s.kind.short());
                let (add, del) = add_del(s, &id, &pod);
                if let Some(l) = s.levels.last_mut() {
                    l.add.extend(add);
                    l.del.extend(del);
                }
                pods[i].push(pod);
            }
        }
        // The held pods stay, so only the cycled pods are checked here;
        // the whole node is checked after the teardown.
        for (s, pods) in subjects.iter_mut().zip(pods) {
            for pod in &pods {
                let links = pod.link_names();
                if links != ["lo"] {
                    s.fail(format!("{level} pods: pod {} left {links:?}", pod.name()));
                }
            }
        }
    }
    for &i in &chosen {
        let s = &mut subjects[i];
        let pods = std::mem::take(&mut held[i]);
        eprintln!("cni: {}: detaching {} pods", s.kind.short(), pods.len());
        if s.kind == Kind::Floor {
            unwire_floor(s, pods.iter().map(|(_, pod)| pod));
        } else {
            for (id, pod) in &pods {
                let out = s.invoke(&s.env("DEL", id, pod));
                s.calls += 1;
                if let Err(e) = judge("DEL", &out) {
                    s.fail(format!("DEL {id}: {e}"));
                }
            }
        }
        let pods: Vec<Netns> = pods.into_iter().map(|(_, pod)| pod).collect();
        verify_clean(s, pods, "pods on the node");
    }
}

/// The floor's stand-in for DEL, untimed: deletes the host veths of these
/// pods (which takes the pod ends and the host routes with them) with one
/// `ip -batch` in the floor's node netns.
fn unwire_floor<'a>(s: &mut Subject, pods: impl Iterator<Item = &'a Netns>) {
    use std::io::Write as _;
    let script: String = pods
        .map(|p| format!("link del {}\n", floor_host(p)))
        .collect();
    if script.is_empty() {
        return;
    }
    let child = Command::new("ip")
        .args(["-n", s.node.netns().name(), "-force", "-batch", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn();
    let result = child.and_then(|mut c| {
        if let Some(mut stdin) = c.stdin.take() {
            stdin.write_all(script.as_bytes())?;
        }
        c.wait_with_output()
    });
    match result {
        Ok(o) if o.status.success() => {}
        Ok(o) => s.fail(format!(
            "deleting the floor's veths: {}",
            first_lines(&String::from_utf8_lossy(&o.stderr), 4)
        )),
        Err(e) => s.fail(format!("deleting the floor's veths: {e}")),
    }
}

/// One round: `concurrency` ADDs released together, then as many DELs,
/// each into its own pre-created netns; the wall time runs from the release
/// to the last exit.
fn throughput_phase(s: &mut Subject, concurrency: usize) {
    eprintln!(
        "cni: {}: {concurrency} concurrent ADDs, then DELs",
        s.kind.short()
    );
    let pods: Vec<Netns> = (0..concurrency).map(|_| Netns::new("c")).collect();
    let ids: Vec<String> = (0..concurrency)
        .map(|i| format!("{}-{}-c{i}", run_prefix(), s.kind.short()))
        .collect();
    for command in ["ADD", "DEL"] {
        let envs: Vec<CniEnv> = ids
            .iter()
            .zip(&pods)
            .map(|(id, pod)| s.env(command, id, pod))
            .collect();
        let (wall, outs) = concurrent(s, &envs);
        s.calls += outs.len();
        let mut ok = true;
        for (id, out) in ids.iter().zip(&outs) {
            if let Err(e) = judge(command, out) {
                ok = false;
                s.fail(format!("concurrent {command} {id}: {e}"));
            }
        }
        eprintln!(
            "cni: {}: {concurrency}×{command} wall {:.1} ms{}",
            s.kind.short(),
            wall.as_secs_f64() * 1e3,
            if ok { "" } else { " (failed)" }
        );
        if ok {
            let walls = if command == "ADD" {
                &mut s.add_walls
            } else {
                &mut s.del_walls
            };
            walls.push(wall);
        }
    }
    verify_clean(s, pods, "concurrent");
}

fn concurrent(s: &Subject, envs: &[CniEnv]) -> (Duration, Vec<CniOutput>) {
    let barrier = Barrier::new(envs.len() + 1);
    std::thread::scope(|scope| {
        let handles: Vec<_> = envs
            .iter()
            .map(|env| {
                let barrier = &barrier;
                scope.spawn(move || {
                    s.node.netns().enter_current_thread();
                    barrier.wait();
                    let out = cni(&s.bin, env, &s.netconf);
                    (out, Instant::now())
                })
            })
            .collect();
        barrier.wait();
        let t0 = Instant::now();
        let results: Vec<(CniOutput, Instant)> = handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect();
        let last = results.iter().map(|r| r.1).max().unwrap_or(t0);
        (last - t0, results.into_iter().map(|r| r.0).collect())
    })
}

/// After a DEL phase: every pod netns holds only `lo`, the node netns only
/// `lo` (and the bridge) and no route through anything else, host-local
/// holds no lease; then the pod netns are deleted and must be gone.
fn verify_clean(s: &mut Subject, pods: Vec<Netns>, phase: &str) {
    let deadline = Instant::now() + SETTLE;
    for pod in &pods {
        let links = poll_until(deadline, || pod.link_names(), |l| *l == ["lo"]);
        if links != ["lo"] {
            s.fail(format!("{phase}: pod {} left {links:?}", pod.name()));
        }
    }
    let node = s.node.netns();
    let allowed = s.node_links.clone();
    let links = poll_until(
        deadline,
        || node.link_names(),
        |l| l.iter().all(|n| allowed.contains(n)),
    );
    let stray_links: Vec<String> = links.into_iter().filter(|n| !allowed.contains(n)).collect();
    let stray_routes: Vec<String> = [Family::V4, Family::V6]
        .into_iter()
        .flat_map(|f| node.routes(f))
        .filter(|r| {
            !r["dev"]
                .as_str()
                .is_some_and(|d| allowed.iter().any(|a| a == d))
        })
        .map(|r| r.to_string())
        .collect();
    if !stray_links.is_empty() {
        s.fail(format!("{phase}: node netns left links {stray_links:?}"));
    }
    if !stray_routes.is_empty() {
        s.fail(format!("{phase}: node netns left routes {stray_routes:?}"));
    }
    if let Some(data) = &s.data_dir {
        let leases = host_local_leases(data.path(), &s.network);
        if !leases.is_empty() {
            s.fail(format!("{phase}: host-local still holds {leases:?}"));
        }
    }
    let names: Vec<String> = pods.iter().map(|p| p.name().to_owned()).collect();
    drop(pods);
    let listed = String::from_utf8_lossy(
        &Command::new("ip")
            .args(["netns", "list"])
            .output()
            .map(|o| o.stdout)
            .unwrap_or_default(),
    )
    .into_owned();
    let left: Vec<&str> = listed
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| names.iter().any(|m| m == n))
        .collect();
    if !left.is_empty() {
        s.fail(format!("{phase}: pod netns not deleted: {left:?}"));
    }
    // Let the kernel's deferred netns cleanup run before timing again.
    std::thread::sleep(Duration::from_secs(1));
}

/// The cost of the spawn path itself: `/bin/true` through the same `cni()`
/// call, from a fresh thread in a node netns (how every plugin is run) and
/// from a fresh thread in our own netns, interleaved. Equal figures show
/// that entering the node netns adds nothing to what is timed.
struct Baseline {
    in_node: Duration,
    in_root: Duration,
}

fn spawn_baseline(node: &Netns, n: usize) -> Baseline {
    let env = CniEnv::default();
    let truth = Path::new("/bin/true");
    let mut in_node = Vec::with_capacity(n);
    let mut in_root = Vec::with_capacity(n);
    for _ in 0..n {
        in_node.push(node.run(|| cni(truth, &env, b"")).elapsed);
        let out = std::thread::scope(|s| s.spawn(|| cni(truth, &env, b"")).join());
        in_root.push(out.unwrap_or_else(|p| std::panic::resume_unwind(p)).elapsed);
    }
    Baseline {
        in_node: nearest_rank(&in_node, 0.5).unwrap_or_default(),
        in_root: nearest_rank(&in_root, 0.5).unwrap_or_default(),
    }
}

/// The plugin's VERSION: process start-up and exit, no network work.
fn version_p50(s: &mut Subject, n: usize) -> Option<Duration> {
    let env = CniEnv {
        command: Some("VERSION".to_owned()),
        ..CniEnv::default()
    };
    let mut times = Vec::new();
    for _ in 0..n {
        let out = s
            .node
            .netns()
            .run(|| cni(&s.bin, &env, br#"{"cniVersion":"1.0.0"}"#));
        s.calls += 1;
        if out.success() {
            times.push(out.elapsed);
        } else {
            s.fail(format!("VERSION: {out}"));
            return None;
        }
    }
    nearest_rank(&times, 0.5)
}

fn ms(d: Option<Duration>) -> String {
    match d {
        Some(d) => format!("{:.1} ms", d.as_secs_f64() * 1e3),
        None => "n/a".to_owned(),
    }
}

fn ratio(a: Option<Duration>, b: Option<Duration>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if !b.is_zero() => format!("{:.2}×", a.as_secs_f64() / b.as_secs_f64()),
        _ => "n/a".to_owned(),
    }
}

struct Row {
    cells: [Option<Duration>; 7],
}

fn row(s: &Subject) -> Row {
    Row {
        cells: [
            nearest_rank(&s.add, 0.5),
            nearest_rank(&s.add, 0.99),
            nearest_rank(&s.del, 0.5),
            nearest_rank(&s.del, 0.99),
            nearest_rank(&s.add_walls, 0.5),
            nearest_rank(&s.del_walls, 0.5),
            s.version_p50,
        ],
    }
}

fn table(subjects: &[Subject], args: &Args) -> Table {
    let c = args.concurrency;
    let mut t = Table::new(&[
        "plugin".to_owned(),
        "ADD p50".to_owned(),
        "ADD p99".to_owned(),
        "DEL p50".to_owned(),
        "DEL p99".to_owned(),
        format!("{c}×ADD wall"),
        format!("{c}×DEL wall"),
        "VERSION p50".to_owned(),
        "calls".to_owned(),
        "failures".to_owned(),
    ])
    .right_aligned_from(1);
    for s in subjects {
        let r = row(s);
        let mut cells = vec![s.kind.label().to_owned()];
        cells.extend(r.cells.iter().map(|d| ms(*d)));
        cells.push(s.calls.to_string());
        cells.push(s.failures.to_string());
        t.row(cells);
    }
    let find = |k: Kind| subjects.iter().find(|s| s.kind == k).map(row);
    for (mine, other) in [
        (Kind::Tether, Kind::Floor),
        (Kind::TetherHost, Kind::Floor),
        (Kind::Tether, Kind::Ptp),
    ] {
        if let (Some(a), Some(b)) = (find(mine), find(other)) {
            let mut cells = vec![format!("{} / {}", mine.short(), other.short())];
            cells.extend(a.cells.iter().zip(&b.cells).map(|(x, y)| ratio(*x, *y)));
            // No calls or failures for a ratio.
            cells.extend([String::new(), String::new()]);
            t.row(cells);
        }
    }
    t
}

/// "ADD vs pods on the node": ADD p50/p99 per level and plugin, and
/// tether's ratio to the floor at each level; its caption and the table,
/// `None` if no plugin was timed with pods on the node.
fn pods_table(subjects: &[Subject], args: &Args) -> Option<(String, Table)> {
    let chosen: Vec<&Subject> = subjects.iter().filter(|s| !s.levels.is_empty()).collect();
    if chosen.is_empty() {
        return None;
    }
    let caption = format!(
        "ADD vs pods on the node ({} cycles per level):",
        args.pods_cycles
    );
    let mut head = vec!["pods on the node".to_owned()];
    for s in &chosen {
        head.push(format!("{} ADD p50", s.kind.short()));
        head.push(format!("{} ADD p99", s.kind.short()));
    }
    let tether = chosen.iter().find(|s| s.kind == Kind::Tether);
    let floor = chosen.iter().find(|s| s.kind == Kind::Floor);
    let ratios = tether.is_some() && floor.is_some();
    if ratios {
        head.extend(
            ["tether / floor p50", "tether / floor p99", "tether DEL p50"].map(str::to_owned),
        );
    }
    let mut t = Table::new(&head).right_aligned_from(0);
    fn level(s: &Subject, pods: usize) -> Option<&Level> {
        s.levels.iter().find(|l| l.pods == pods)
    }
    for &pods in &args.pods {
        let label = if pods == 0 {
            "0 (idle)".to_owned()
        } else {
            pods.to_string()
        };
        let mut line = vec![label];
        for s in &chosen {
            let add = level(s, pods).map(|l| l.add.clone()).unwrap_or_default();
            line.push(ms(nearest_rank(&add, 0.5)));
            line.push(ms(nearest_rank(&add, 0.99)));
        }
        if let (Some(a), Some(b)) = (tether, floor) {
            let a_add = level(a, pods).map(|l| l.add.clone()).unwrap_or_default();
            let a_del = level(a, pods).map(|l| l.del.clone()).unwrap_or_default();
            let b_add = level(b, pods).map(|l| l.add.clone()).unwrap_or_default();
            line.push(ratio(nearest_rank(&a_add, 0.5), nearest_rank(&b_add, 0.5)));
            line.push(ratio(
                nearest_rank(&a_add, 0.99),
                nearest_rank(&b_add, 0.99),
            ));
            line.push(ms(nearest_rank(&a_del, 0.5)));
        }
        t.row(line);
    }
    Some((caption, t))
}

fn report(run: &Run, args: &Args, measured: &Measured) -> String {
    let subjects = &measured.subjects;
    let m = &run.machine;
    let mut r = Report::new("ADD and DEL against the reference plugins", run);
    r.item(format!(
        "Plugins: tether {}; Debian containernetworking-plugins {} (`/usr/lib/cni`).",
        m.tether_version,
        stdout_of(
            "dpkg-query",
            &["-W", "-f", "${Version}", "containernetworking-plugins"]
        )
    ))
    .command(
        run,
        &format!(
            "{} timed cycles after {} warm-up cycles; {} concurrent calls, median of {} rounds; \
             pods on the node {:?}, {} cycles per level",
            args.cycles, args.warmup, args.concurrency, args.rounds, args.pods, args.pods_cycles
        ),
    );
    if let Some(baseline) = &measured.baseline {
        r.item(format!(
            "Spawn path: `/bin/true` p50 {} from a thread in a node netns, {} from a thread in \
             the bench's own netns (interleaved).",
            ms(Some(baseline.in_node)),
            ms(Some(baseline.in_root))
        ));
        let add = |k: Kind, q: f64| {
            subjects
                .iter()
                .find(|s| s.kind == k)
                .and_then(|s| nearest_rank(&s.add, q))
        };
        if add(Kind::Floor, 0.5).is_some() {
            let tether_version = subjects
                .iter()
                .find(|s| s.kind == Kind::Tether)
                .and_then(|s| s.version_p50);
            r.item(format!(
                "Floor: `floor_add` ADD p50 {}, p99 {} (of which spawning `/bin/true` is p50 {}; \
                 tether's VERSION p50 {}). tether ADD p50 {} = {} the floor, p99 {} = {} the floor. What tetherd does beyond \
                 the floor's kernel work: see Method.",
                ms(add(Kind::Floor, 0.5)),
                ms(add(Kind::Floor, 0.99)),
                ms(Some(baseline.in_node)),
                ms(tether_version),
                ms(add(Kind::Tether, 0.5)),
                ratio(add(Kind::Tether, 0.5), add(Kind::Floor, 0.5)),
                ms(add(Kind::Tether, 0.99)),
                ratio(add(Kind::Tether, 0.99), add(Kind::Floor, 0.99)),
            ));
            if add(Kind::TetherHost, 0.5).is_some() {
                r.item(format!(
                    "The outside view: tether spawned from the bench's own (the host's) netns, \
                     with a daemon of its own, ADD p50 {} = {} the floor, p99 {} = {} the floor.",
                    ms(add(Kind::TetherHost, 0.5)),
                    ratio(add(Kind::TetherHost, 0.5), add(Kind::Floor, 0.5)),
                    ms(add(Kind::TetherHost, 0.99)),
                    ratio(add(Kind::TetherHost, 0.99), add(Kind::Floor, 0.99)),
                ));
            }
        }
    }
    let table = table(subjects, args);
    if !table.is_empty() {
        r.table(&table);
    }
    if let Some((caption, pods_table)) = pods_table(subjects, args) {
        r.paragraph(caption).table(&pods_table);
    }
    r.finish(run)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn parse(line: &[&str]) -> Result<Args, clap::Error> {
        Cli::try_parse_from(std::iter::once("cni").chain(line.iter().copied())).map(|c| c.args)
    }

    #[test]
    fn the_flags_keep_their_defaults() {
        let a = parse(&[]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (a.cycles, a.concurrency, a.rounds, a.warmup, a.batch),
            (200, 100, 3, 5, 50)
        );
        assert_eq!(
            a.plugins,
            [Kind::Tether, Kind::Floor, Kind::Ptp, Kind::Bridge]
        );
        assert_eq!(a.pods, [0, 50, 500]);
        assert_eq!(a.pods_cycles, 30);
        assert_eq!(a.pods_plugins, [Kind::Tether, Kind::Floor, Kind::Ptp]);
        assert!(a.common.build());
    }

    #[test]
    fn lists_and_counts_read_as_before() {
        let a = parse(&[
            "--plugins",
            "tether-host,ptp",
            "--pods",
            "500,0,50,50",
            "--batch",
            "0",
            "--pods-cycles",
            "0",
            "--warmup",
            "0",
            "--no-build",
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(a.plugins, [Kind::TetherHost, Kind::Ptp]);
        assert_eq!(a.pods, [0, 50, 500]);
        assert_eq!((a.batch, a.pods_cycles, a.warmup), (1, 1, 0));
        assert!(!a.common.build());
        for none in ["none", ""] {
            let a = parse(&["--pods", none]).unwrap_or_else(|e| panic!("{e}"));
            assert!(a.pods.is_empty());
        }
        assert!(parse(&["--cycles", "0"]).is_err());
        assert!(parse(&["--rounds", "0"]).is_err());
        assert!(parse(&["--concurrency", "0"]).is_err());
        assert!(parse(&["--plugins", "tether,calico"]).is_err());
        assert!(parse(&["--pods", "1,x"]).is_err());
    }
}
