//! tether under KubeVirt: live migrations of a VirtualMachine driven
//! through KubeVirt's API, beside the `vm` benchmark's QMP-driven ones
//! from the same sitting.
//!
//! 1. `tether-bench vm --stores kubernetes` runs first, as a child process
//!    of this binary (its own fresh 3-node cluster, QEMU migrated by QMP,
//!    notices off and on), and its Kubernetes-store rows are taken into
//!    this report.
//! 2. Then the KubeVirt cluster of the KubeVirt suite
//!    (`tether_e2e::kubevirt::scenario::Setup`): two kubelet nodes with
//!    tether installed by its chart (the Kubernetes store), KubeVirt 1.7
//!    deployed by its operator; a VirtualMachine on tether's `tap` binding
//!    boots the test guest (with qemu-guest-agent), which leases its
//!    address from tether. It migrates between the nodes by
//!    VirtualMachineInstanceMigration objects, `--migrations` times after
//!    `--warmup` untimed ones, with an observer (the API server's host)
//!    pinging it every millisecond, and a TCP and a UDP stream on every
//!    path a user has to or from the VM (tests/src/paths.rs, through
//!    kube-proxy where a Service is on the path; the guest's ends run
//!    through its agent) held through each. Per migration: the observer's
//!    loss window and probes lost, the downtime libvirt reports (`virsh
//!    domjobinfo --completed` on the target, the guest's pause as libvirt
//!    counts it), their difference, the time from the migration object's
//!    creation to its `Succeeded`; per migration and path: survived or
//!    not, and the stall from the migration's start.
//!
//! Run (as root): `cargo run --release -p tether-bench -- kubevirt
//! [--migrations 10] [--warmup 1] [--no-bench-vm] [--no-build] [--write
//! BENCHMARKS.md]`. KubeVirt is built from source the first time (tens of
//! minutes; cached after).

use std::time::Duration;

use tether_e2e::kube_cluster::KubePaths;
use tether_e2e::kubevirt::agent::AgentShell;
use tether_e2e::kubevirt::scenario::{migrate_with_paths, Measured, Medians, Setup};
use tether_e2e::kubevirt::VERSION as KUBEVIRT_VERSION;
use tether_e2e::paths::GuestShell;
use tether_e2e::qemu::KERNEL_PANIC;
use tether_e2e::streams::Proto;

use crate::kit::{
    guarded, release_dir, stdout_of, Benchmark, CommonArgs, Failures, Report, Run, Table,
};
// The paths' streams and their rows as tether-bench vm's, so that the
// two compare.
use crate::vm::{stall_ms, PathRow, AFTER, PATH_INTERVAL};

/// The target: the loss window exceeds libvirt's downtime by at
/// most this much at the median.
const TARGET_EXCESS_MS: f64 = 10.0;

/// `tether-bench kubevirt`'s flags.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Timed KubeVirt migrations (and the `vm` benchmark's, per configuration).
    #[arg(long, default_value_t = 10)]
    migrations: usize,
    /// Untimed migrations before the timed ones.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Skip the `vm` benchmark's QMP migrations on the Kubernetes store.
    #[arg(long)]
    no_bench_vm: bool,
    #[command(flatten)]
    common: CommonArgs,
}

/// One Markdown table of a report: the paragraph line before it, its
/// header's cells and its rows' cells.
struct Parsed {
    intro: String,
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Parsed {
    /// Row `row`'s cell under the header `column`, or "-".
    fn cell<'a>(&self, row: &'a [String], column: &str) -> &'a str {
        self.header
            .iter()
            .position(|h| h == column)
            .and_then(|i| row.get(i))
            .map_or("-", String::as_str)
    }
}

/// The Markdown tables of `report`, in order.
fn tables(report: &str) -> Vec<Parsed> {
    let cells = |l: &str| -> Vec<String> {
        l.trim()
            .trim_matches('|')
            .split('|')
            .map(|c| c.trim().to_string())
            .collect()
    };
    let mut out: Vec<Parsed> = Vec::new();
    let mut intro = String::new();
    let mut in_table = false;
    for line in report.lines() {
        let l = line.trim();
        if !l.starts_with('|') {
            in_table = false;
            if !l.is_empty() {
                intro = l.to_string();
            }
            continue;
        }
        if l.starts_with("|---") {
            continue;
        }
        if in_table {
            if let Some(t) = out.last_mut() {
                t.rows.push(cells(l));
            }
        } else {
            in_table = true;
            out.push(Parsed {
                intro: intro.clone(),
                header: cells(l),
                rows: Vec::new(),
            });
        }
    }
    out
}

/// What `tether-bench vm` said for the Kubernetes store: its tables (the
/// streams' and probes', the routes', every path's), or why none.
struct BenchVm {
    tables: Vec<Parsed>,
    note: String,
}

impl BenchVm {
    /// The first table whose header's first cell starts with `first`
    /// (and whose intro starts with `intro`), with only its Kubernetes
    /// store's rows (all rows for the paths' table, which is the store's).
    fn table(&self, first: &str, intro: &str) -> Option<&Parsed> {
        self.tables.iter().find(|t| {
            t.header.first().is_some_and(|h| h.starts_with(first)) && t.intro.starts_with(intro)
        })
    }
}

/// Runs the `vm` benchmark (`tether-bench vm`: this binary, as a child
/// process, on the release binaries found by [`release_dir`]) on the
/// Kubernetes store with as many migrations, and keeps its tables.
fn run_bench_vm(args: &Args, failures: &mut Failures) -> BenchVm {
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => {
            failures.fail(format!("finding tether-bench for its vm benchmark: {e}"));
            return BenchVm {
                tables: Vec::new(),
                note: format!("tether-bench vm did not run: {e}"),
            };
        }
    };
    let migrations = args.migrations.to_string();
    let warmup = args.warmup.to_string();
    let argv = [
        "vm",
        "--no-build",
        "--stores",
        "kubernetes",
        "--migrations",
        &migrations,
        "--warmup",
        &warmup,
        "--adds",
        "1",
    ];
    eprintln!(
        "{}: running {} {}",
        Args::NAME,
        exe.display(),
        argv.join(" ")
    );
    let out = std::process::Command::new(&exe)
        .args(argv)
        .stderr(std::process::Stdio::inherit())
        .output();
    let out = match out {
        Ok(out) => out,
        Err(e) => {
            failures.fail(format!("running tether-bench vm: {e}"));
            return BenchVm {
                tables: Vec::new(),
                note: format!("tether-bench vm did not run: {e}"),
            };
        }
    };
    let report = String::from_utf8_lossy(&out.stdout);
    let tables = tables(&report);
    let rows = tables
        .iter()
        .flat_map(|t| &t.rows)
        .filter(|r| r.first().is_some_and(|c| c.starts_with("Kubernetes store")))
        .count();
    if !out.status.success() || rows == 0 {
        failures.fail(format!(
            "tether-bench vm: {} with {rows} rows of the Kubernetes store",
            out.status,
        ));
    }
    BenchVm {
        tables,
        note: format!(
            "`tether-bench vm --stores kubernetes --migrations {migrations} --warmup {warmup}`: {}",
            out.status
        ),
    }
}

/// One timed migration: KubeVirt's and the observer's measures, and the
/// streams'.
struct Timed {
    m: Measured,
    /// The longest stall of the TCP streams from the migration's start
    /// (ms).
    tcp_stall: Option<f64>,
    /// The UDP streams' (ms).
    udp_stall: Option<f64>,
    /// Streams that survived with one address, of `streams`.
    alive: usize,
    streams: usize,
}

/// The KubeVirt migrations: the untimed ones, then the timed ones.
struct Runs {
    untimed: usize,
    timed: Vec<Timed>,
    paths: Vec<PathRow>,
    boot: String,
}

impl Runs {
    /// One figure of every timed migration that has it, in order.
    fn col(&self, f: impl Fn(&Timed) -> Option<f64>) -> Vec<f64> {
        self.timed.iter().filter_map(f).collect()
    }

    /// The medians of the timed migrations' measures.
    fn medians(&self) -> Medians {
        let measured: Vec<Measured> = self.timed.iter().map(|t| t.m.clone()).collect();
        Medians::of(&measured)
    }
}

fn run_kubevirt(args: &Args, failures: &mut Failures) -> Runs {
    let kv = Setup::start();
    let c = &kv.cluster;
    let (node, ip, _mac) = kv.boot_vm("vm1", "tether", "tap");
    let other = kv.other_than(&node);
    let boot = format!("vm1 booted on {node} with {ip}");
    let guest = AgentShell::new(c, "vm1");
    let paths = KubePaths::start(c, ip.parse().expect("vm1's IP"));
    let mut timed = Vec::new();
    let mut rows: Vec<PathRow> = Vec::new();
    for n in 0..args.warmup + args.migrations {
        let to = if n % 2 == 0 { &other } else { &node };
        let p = migrate_with_paths(
            c,
            &paths,
            &guest,
            "vm1",
            &ip,
            to,
            n + 1,
            PATH_INTERVAL,
            AFTER,
        );
        eprintln!("{}: {}", Args::NAME, p.table);
        let m = p.measured;
        if m.loss.is_none() || m.downtime_ms.is_none() {
            failures.fail(format!(
                "migration {}: no loss window ({:?}) or no libvirt downtime ({:?})",
                n + 1,
                m.loss,
                m.downtime_ms
            ));
        }
        // A guest that dies on the target resets every stream: say that it
        // died rather than only that they did.
        let console = guest.console_text();
        if let Some(at) = console.find(KERNEL_PANIC) {
            let oops = console[..at]
                .rfind("PANIC:")
                .or_else(|| console[..at].rfind("BUG:"));
            failures.fail(format!(
                "migration {}: the guest's kernel panicked on {to} (QEMU, TCG): {}",
                n + 1,
                console[oops.unwrap_or(at)..]
                    .lines()
                    .take(3)
                    .collect::<Vec<_>>()
                    .join(" / ")
            ));
        }
        let mut alive = 0;
        for r in &p.reports {
            if r.survived() && r.one_address() {
                alive += 1;
            } else {
                failures.fail(format!("migration {}: {r}", n + 1));
            }
        }
        if n < args.warmup {
            continue;
        }
        let longest = |proto: Proto| {
            p.reports
                .iter()
                .filter(|r| r.proto == proto)
                .map(|r| stall_ms(r, p.started))
                .reduce(f64::max)
        };
        // The pause is libvirt's downtime; a stream that died was counted
        // as a failure above.
        for r in &p.reports {
            PathRow::count(&mut rows, r, p.started, m.downtime_ms);
        }
        timed.push(Timed {
            tcp_stall: longest(Proto::Tcp),
            udp_stall: longest(Proto::Udp),
            alive,
            streams: p.reports.len(),
            m,
        });
    }
    Runs {
        untimed: args.warmup,
        timed,
        paths: rows,
        boot,
    }
}

/// The median of `v`.
fn median_of(v: &[f64]) -> Option<f64> {
    let mut v = v.to_vec();
    tether_e2e::kubevirt::scenario::median(&mut v)
}

fn max_of(v: &[f64]) -> Option<f64> {
    v.iter().copied().reduce(f64::max)
}

fn secs(v: Option<Duration>) -> String {
    v.map_or("-".to_string(), |d| format!("{:.1}", d.as_secs_f64()))
}

fn ms(v: Option<f64>) -> String {
    v.map_or("-".to_string(), |v| format!("{v:.1}"))
}

fn report(run: &Run, args: &Args, vm: Option<&BenchVm>, runs: Option<&Runs>) -> String {
    let mut r = Report::new("KubeVirt migrations over tether", run);
    r.item(format!(
        "Software: tether {} (git {}); KubeVirt {KUBEVIRT_VERSION} built from its Go module, its launcher on Debian's libvirt 9.0 and qemu-system-x86 7.2 (TCG); the guest's qemu-guest-agent {}; Kubernetes v1.37.2 (kube-apiserver, kubelet, kube-proxy) on two kubelet nodes, tether installed by its chart (the Kubernetes store).",
        env!("CARGO_PKG_VERSION"),
        stdout_of("git", &["rev-parse", "--short", "HEAD"]).trim(),
        stdout_of(
            "sh",
            &["-c", "apt-cache policy qemu-guest-agent | awk '/Candidate:/ { print $2 }'"]
        )
        .trim()
    ))
    .command(run, "");
    r.paragraph(format!(
        "Method: a VirtualMachine on tether's `tap` binding (the test guest, 128 MiB, booted from a shared host disk, running qemu-guest-agent) leases its address by DHCP from tether; it migrates between the two nodes by a VirtualMachineInstanceMigration each, {} timed after {} untimed, while an observer on the API server's host (a third place on the fabric) pings it every millisecond, and a TCP and a UDP stream on every path a user has to or from the VM (tests/src/paths.rs: pods on both nodes to the VM, an outside host through a NodePort entering at each node, a pod through a ClusterIP whose endpoint is the VM, the VM to the outside host through outbound NAT, to a pod and to a ClusterIP whose one backend is a pod on the second node (on the target of one migration, the source of the next); kube-proxy in iptables mode; a message every {} ms each, the guest's ends started through its agent's guest-exec) is held through each migration. The guest's pause: what libvirt reports as the migration job's downtime on the target (`virsh domjobinfo --completed`); KubeVirt gives no QEMU events to time it from STOP to RESUME as tether-bench vm does. Loss window: the observer's longest run of unanswered pings. Probes lost: the pings sent from the migration object's creation to its `Succeeded` that were never answered, in ms of probing. TCP stall: the longest of the TCP streams' stalls (time without an echo) from the migration's start on; a path's stall: its own. Streams survived: migrations in which every stream lived to the end with one address. First lost ping → announcement read: from the send of the first ping the loss window lost to the target tetherd's read of the guest's announcement (QEMU's RARP, or the guest's GARP), both on this machine's clock (tetherd's admin `Stats`): the guest's pause as the network sees it, KubeVirt's, libvirt's and QEMU's share. Read → first answered ping: from there to the send of the first ping answered after the loss, tether's share on the observer's path plus up to one ping interval. Read → every node repointed: to the last route change on the other node (`Stats`). To the domain running on the target: from the migration object's creation to the VMI's status saying so (`targetNodeDomainReadyTimestamp`, polled every 50 ms). To Succeeded: from the creation to the `Succeeded` phase. When KubeVirt has not ended a migration 30 s after its domain runs on the target (its virt-handler there missed the domain's end and would ack it only at its 5-minute resync, a KubeVirt 1.7 race seen on this machine), that handler is restarted, and the migration is marked *. Beside it, in the same sitting, `tether-bench vm`'s QMP-driven QEMU migrations on 3-node tether clusters on the Kubernetes store (no KubeVirt, no libvirt: the pause from QEMU's STOP and RESUME events, one observer pod on a third node with its own TCP and UDP stream at 5 ms, and its paths on a cluster running kube-proxy in iptables mode).",
        args.migrations,
        args.warmup,
        PATH_INTERVAL.as_millis(),
    ));

    // What the VM's connections saw, beside tether-bench vm's.
    let mut t = Table::new(&[
        "per migration, p50 (ms)",
        "guest's pause",
        "loss window",
        "probes lost",
        "lost ÷ pause",
        "TCP stall",
        "TCP stall − pause",
        "streams survived",
    ])
    .right_aligned_from(1);
    if let Some(runs) = runs {
        t.row([
            format!(
                "KubeVirt, {} migrations (pause: libvirt's downtime)",
                runs.timed.len()
            ),
            ms(median_of(&runs.col(|t| t.m.downtime_ms))),
            ms(median_of(&runs.col(|t| t.m.loss_ms()))),
            ms(median_of(&runs.col(|t| t.m.lost_ms))),
            ratio(median_of(
                &runs.col(|t| Some(t.m.lost_ms? / t.m.downtime_ms?)),
            )),
            ms(median_of(&runs.col(|t| t.tcp_stall))),
            ms(median_of(
                &runs.col(|t| Some(t.tcp_stall? - t.m.downtime_ms?)),
            )),
            format!(
                "{}/{}",
                runs.timed.iter().filter(|t| t.alive == t.streams).count(),
                runs.timed.len()
            ),
        ]);
    }
    if let Some(vt) = vm.and_then(|vm| vm.table("per migration, p50", "")) {
        for row in vt
            .rows
            .iter()
            .filter(|r| r[0].starts_with("Kubernetes store"))
        {
            t.row([
                format!("tether-bench vm, QMP: {}", row[0]),
                vt.cell(row, "pause").to_owned(),
                vt.cell(row, "loss window").to_owned(),
                vt.cell(row, "probes lost").to_owned(),
                vt.cell(row, "lost ÷ pause").to_owned(),
                vt.cell(row, "TCP stall").to_owned(),
                vt.cell(row, "TCP stall − pause").to_owned(),
                vt.cell(row, "streams survived").to_owned(),
            ]);
        }
    }
    r.table(&t);

    // The routes and KubeVirt's own timing.
    let mut t = Table::new(&[
        "per migration (ms)",
        "downtime p50",
        "loss p50",
        "loss − downtime p50",
        "first lost ping → announcement read p50",
        "read → first answered ping p50",
        "read → every node repointed p50",
        "to the domain running on the target p50 (s)",
        "to Succeeded p50 (s)",
    ])
    .right_aligned_from(1);
    if let Some(runs) = runs {
        let m = runs.medians();
        t.row([
            format!(
                "KubeVirt (libvirt's downtime), {} migrations",
                runs.timed.len()
            ),
            ms(m.downtime_ms),
            ms(m.loss_ms),
            ms(m.excess_ms),
            ms(m.stop_to_rarp_ms),
            ms(m.rarp_to_answer_ms),
            ms(m.rarp_to_all_ms),
            secs(m.running),
            secs(m.took),
        ]);
    }
    if let Some(vt) = vm.and_then(|vm| vm.table("per migration (ms)", "")) {
        for row in vt
            .rows
            .iter()
            .filter(|r| r[0].starts_with("Kubernetes store"))
        {
            t.row([
                format!("tether-bench vm, QMP (QEMU's downtime): {}", row[0]),
                vt.cell(row, "downtime p50").to_owned(),
                "-".to_owned(),
                vt.cell(row, "loss − downtime p50").to_owned(),
                "-".to_owned(),
                "-".to_owned(),
                vt.cell(row, "first RARP → every node p50").to_owned(),
                "-".to_owned(),
                "-".to_owned(),
            ]);
        }
    }
    r.table(&t);
    if let Some(runs) = runs {
        let m = runs.medians();
        let verdict = match m.excess_ms {
            Some(e) if e <= TARGET_EXCESS_MS => format!("met: median excess {e:.1} ms"),
            Some(e) => format!("missed: median excess {e:.1} ms"),
            None => "not measured".to_string(),
        };
        r.paragraph(format!(
            "Target (the loss window exceeds libvirt's downtime by at most {TARGET_EXCESS_MS} ms at the median): {verdict}."
        ));
        r.paragraph(format!(
            "Against issue 36's goals for the guest's pause (set for tether-bench vm's QEMU pause on the etcd store; here with libvirt's downtime as the pause): probes lost {} of the pause at the median (goal: at most half); TCP stall − pause {} ms at the median (goal: at most 50 ms); {} of {} migrations with a TCP retransmission timeout's worth of stall (over 200 ms beyond the pause).",
            median_of(&runs.col(|t| Some(t.m.lost_ms? / t.m.downtime_ms?)))
                .map_or("-".to_string(), |x| format!("{:.0}%", x * 100.0)),
            ms(median_of(&runs.col(|t| Some(t.tcp_stall? - t.m.downtime_ms?)))),
            runs.timed
                .iter()
                .filter(|t| t
                    .tcp_stall
                    .zip(t.m.downtime_ms)
                    .is_some_and(|(s, d)| s - d > 200.0))
                .count(),
            runs.timed.len(),
        ));
    }

    // Every path, beside tether-bench vm's on the Kubernetes store.
    let bench_paths = vm.and_then(|vm| vm.table("path", "Every path, Kubernetes store"));
    if runs.is_some() || bench_paths.is_some() {
        r.paragraph(
            "Every path through the timed migrations (KubeVirt: two nodes, so no third node's paths; stall − pause: against libvirt's downtime), beside tether-bench vm's paths on the Kubernetes store (QMP migrations on 3 nodes; against QEMU's pause):",
        );
        let mut t = Table::new(&[
            "path",
            "KubeVirt: survived",
            "stall p50 (ms)",
            "stall max",
            "stall − pause p50",
            "tether-bench vm, QMP: survived",
            "stall p50",
            "stall max",
            "stall − pause p50",
        ])
        .right_aligned_from(1);
        let mut names: Vec<String> = runs
            .map(|runs| runs.paths.iter().map(|p| p.name.clone()).collect())
            .unwrap_or_default();
        if let Some(vt) = bench_paths {
            for row in &vt.rows {
                if !names.contains(&row[0]) {
                    names.push(row[0].clone());
                }
            }
        }
        for name in names {
            let kv = runs.and_then(|runs| runs.paths.iter().find(|p| p.name == name));
            let kv_cells = kv.map_or_else(
                || vec!["-".to_owned(); 4],
                |p| {
                    vec![
                        format!("{}/{}", p.survived, p.runs),
                        ms(median_of(&p.stalls)),
                        ms(max_of(&p.stalls)),
                        ms(median_of(&p.over_pause)),
                    ]
                },
            );
            let vm_cells = bench_paths
                .and_then(|vt| {
                    let row = vt.rows.iter().find(|row| row[0] == name)?;
                    Some(
                        ["survived", "stall p50", "stall max", "stall − pause p50"]
                            .map(|column| vt.cell(row, column).to_owned())
                            .to_vec(),
                    )
                })
                .unwrap_or_else(|| vec!["-".to_owned(); 4]);
            t.row(std::iter::once(name).chain(kv_cells).chain(vm_cells));
        }
        r.table(&t);
    }

    if let Some(runs) = runs {
        let list: Vec<String> = runs
            .timed
            .iter()
            .map(|t| {
                let m = &t.m;
                format!(
                    "{}/{}/{}/{}/{}/{}/{}/{}/{}/{}/{:.1}{}/{}of{}",
                    ms(m.downtime_ms),
                    ms(m.loss_ms()),
                    ms(m.excess_ms()),
                    ms(m.lost_ms),
                    ms(t.tcp_stall),
                    ms(t.udp_stall),
                    ms(m.stop_to_rarp_ms),
                    ms(m.rarp_to_answer_ms),
                    ms(m.rarp_to_all_ms),
                    secs(m.running),
                    m.took.as_secs_f64(),
                    if m.healed { "*" } else { "" },
                    t.alive,
                    t.streams,
                )
            })
            .collect();
        r.paragraph(format!(
            "Every timed migration, in order: downtime / loss / loss − downtime / probes lost / TCP stall / UDP stall / first lost ping → announcement read / read → first answered ping / read → every node (ms) / to the domain running on the target / to Succeeded (s) / streams survived, * where the target's virt-handler was restarted ({}; {} untimed before):\n\n- {}",
            runs.boot,
            runs.untimed,
            list.join(", ")
        ));
    }
    if let Some(vm) = vm {
        r.paragraph(format!("tether-bench vm in this sitting: {}.", vm.note));
    }
    r.finish(run)
}

fn ratio(v: Option<f64>) -> String {
    v.map_or("-".to_string(), |v| format!("{v:.2}"))
}

/// What the run found: the `vm` benchmark's tables (unless
/// `--no-bench-vm`) and the KubeVirt migrations, each `None` when its
/// phase failed.
pub struct Found {
    vm: Option<BenchVm>,
    runs: Option<Runs>,
}

impl Benchmark for Args {
    const NAME: &'static str = "kubevirt";
    const SECTION: &'static str = "bench_kubevirt";
    type Ready = ();
    type Measured = Found;

    fn common(&self) -> &CommonArgs {
        &self.common
    }

    fn prepare(&self) -> Result<(), String> {
        release_dir(Self::NAME, self.common.build()).map(|_| ())
    }

    fn measure(&self, _: &(), failures: &mut Failures) -> Found {
        let vm = if self.no_bench_vm {
            None
        } else {
            guarded("vm", failures, |f| run_bench_vm(self, f))
        };
        let runs = guarded("kubevirt", failures, |f| run_kubevirt(self, f));
        Found { vm, runs }
    }

    fn report(&self, run: &Run, _: &(), found: &Found) -> String {
        report(run, self, found.vm.as_ref(), found.runs.as_ref())
    }
}
