//! `make conformance` and `make netpol`: Kubernetes' own tests (the
//! upstream `e2e.test` of k8s.io/kubernetes v1.37.2) on a cluster of
//! kubelet nodes wired by tether (tests/src/kube_cluster.rs), and the
//! results as `CONFORMANCE.md` or `NETPOL.md`.
//!
//! Usage: `conformance [--suite conformance|netpol] [--stack v4|dual|v6] [--nodes 2] [--focus REGEX] [--faults] [--write FILE]`
//!
//! It starts the cluster with the tests' images imported into every node,
//! installs tether with its chart, deploys CoreDNS, runs `e2e.test` with
//! the suite's focus and skip, and writes the report (or prints it). It
//! exits non-zero if a test failed. The suites:
//! - `conformance` (the default): every `[sig-network] ... [Conformance]`
//!   test;
//! - `netpol`: every `[sig-network] Netpol` test (the NetworkPolicy tests
//!   and the two API tests) but the three `[Feature:SCTPConnectivity]`
//!   ones, which need SCTP in the kernel; the report lists them with that
//!   reason. Two tests with SCTP in their names run: they probe TCP only.
//!
//! `--stack` picks the cluster's IP families (`tether_e2e::stack`): `v4`
//! (the default), `dual` (IPv4 first, then IPv6: two Service ranges, two
//! cluster CIDRs, every node with an address of each) or `v6` (IPv6
//! alone). On `dual` the conformance suite also runs every
//! `[Feature:IPv6DualStack]` test but the SCTP one, which needs SCTP in
//! the kernel. The conformance report (`CONFORMANCE.md`) has one section
//! per stack: `--write` replaces the run's own and keeps the others.
//!
//! `--focus` replaces the suite's focus (its skip stays).
//!
//! With `--faults` (as `make conformance` runs it), the run also takes two
//! faults while the tests run, and the report lists them: the last node's
//! tetherd is killed with SIGKILL 90 s into `e2e.test` (the kubelet
//! restarts its container, as after a crash), and the first node's kubelet
//! is stopped and started again at 180 s. No test's result may change; a
//! fault that could not be injected, or a node that did not recover from
//! it, fails the run. The dual-stack run keeps the kill and leaves the
//! kubelet's restart out (`conformance::KUBELET_LEFT_OUT` says why); its
//! report says so.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use tether_e2e::conformance::{self, Context, Faults, FOCUS_ALL, FOCUS_DUAL_STACK, SKIP_SCTP};
use tether_e2e::conformance_images::{conformance_images, e2e_dir, COREDNS, PAUSE};
use tether_e2e::machine::{stdout_of, Machine};
use tether_e2e::stack::Stack;
use tether_e2e::topology::Topology;
use tether_e2e::{require_root, workspace_dir, TempDir};

const USAGE: &str = "usage: conformance [--suite conformance|netpol] [--stack v4|dual|v6] \
                     [--nodes N] [--focus REGEX] [--faults] [--write FILE]";
/// When `--faults` kills the last node's tetherd, after `e2e.test`'s start.
const KILL_TETHERD_AT: Duration = Duration::from_secs(90);
/// When `--faults` restarts the first node's kubelet.
const RESTART_KUBELET_AT: Duration = Duration::from_secs(180);
/// What the dual-stack runs with the kubelet's restart lost (after
/// [`conformance::KUBELET_LEFT_OUT`]).
const KUBELET_LOST: &str = "A run with it (18:59 UTC) lost `should be able to reach pod on \
    ipv4 and ipv6 ip` so, and one at 19:27, stopped after 34 tests, had lost `should update \
    endpoints: udp` the same way; nothing else failed. The tetherd kill stays.";

/// Tests that cannot pass on this machine, each with its reason and what
/// would make it pass. Empty: every test is expected to pass.
const KNOWN: &[(&str, &str)] = &[];

/// A set of upstream tests and its report.
struct Suite {
    /// The report's heading.
    title: &'static str,
    /// The make target that writes the report.
    command: &'static str,
    /// The ginkgo focus.
    focus: &'static str,
    /// The ginkgo skip: the suite's tests that cannot run here.
    skip: Option<&'static str>,
    /// What the skipped tests' names contain, all of it, and why they
    /// cannot run here (the report lists them).
    not_run: Option<(&'static [&'static str], &'static str)>,
    /// Whether the report has one section per stack (`--write` replaces
    /// the run's own).
    per_stack: bool,
}

/// Why the SCTP tests cannot run here.
const NO_SCTP: &str = "needs SCTP, which this machine's kernel lacks (`CONFIG_IP_SCTP` is not \
                       set): its probes cannot open an SCTP socket. A kernel with SCTP would run it.";

const CONFORMANCE: Suite = Suite {
    title: "Kubernetes network conformance (sig-network, Conformance)",
    command: "make conformance",
    focus: FOCUS_ALL,
    skip: None,
    not_run: None,
    per_stack: true,
};

/// The conformance suite on a dual-stack cluster: also every
/// `[Feature:IPv6DualStack]` test but the SCTP one.
const CONFORMANCE_DUAL: Suite = Suite {
    focus: FOCUS_DUAL_STACK,
    skip: Some(SKIP_SCTP),
    not_run: Some((
        &["[Feature:IPv6DualStack]", "[Feature:SCTPConnectivity]"],
        NO_SCTP,
    )),
    ..CONFORMANCE
};

const NETPOL: Suite = Suite {
    title: "Kubernetes NetworkPolicy tests (sig-network Netpol)",
    command: "make netpol",
    focus: r"\[sig-network\] Netpol ",
    skip: Some(SKIP_SCTP),
    not_run: Some((
        &["[sig-network] Netpol ", "[Feature:SCTPConnectivity]"],
        NO_SCTP,
    )),
    per_stack: false,
};

struct Args {
    suite: &'static Suite,
    stack: Stack,
    nodes: usize,
    focus: Option<String>,
    faults: bool,
    write: Option<PathBuf>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        suite: &CONFORMANCE,
        stack: Stack::V4,
        nodes: 2,
        focus: None,
        faults: false,
        write: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value\n{USAGE}"));
        match flag.as_str() {
            "--nodes" => {
                args.nodes = value()?
                    .parse()
                    .map_err(|e| format!("--nodes: {e}\n{USAGE}"))?
            }
            "--suite" => {
                args.suite = match value()?.as_str() {
                    "conformance" => &CONFORMANCE,
                    "netpol" => &NETPOL,
                    other => return Err(format!("--suite: no suite {other}\n{USAGE}")),
                }
            }
            "--stack" => {
                args.stack =
                    Stack::parse(&value()?).map_err(|e| format!("--stack: {e}\n{USAGE}"))?
            }
            "--focus" => args.focus = Some(value()?),
            "--faults" => args.faults = true,
            "--write" => args.write = Some(PathBuf::from(value()?)),
            _ => return Err(format!("unknown argument {flag}\n{USAGE}")),
        }
    }
    if args.nodes < 2 {
        return Err(format!("the tests need at least 2 nodes\n{USAGE}"));
    }
    if std::ptr::eq(args.suite, &CONFORMANCE) && args.stack == Stack::Dual {
        args.suite = &CONFORMANCE_DUAL;
    }
    Ok(args)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    require_root();
    // ^C ends e2e.test and drops the cluster (every node, process and
    // namespace) instead of leaving it running.
    conformance::stop_on_signals();
    let started = std::time::Instant::now();
    let machine = Machine::probe();
    let date = stdout_of("date", &["-u", "+%Y-%m-%d %H:%M UTC"]);
    let e2e = e2e_dir().join("e2e.test");
    let images = conformance_images();
    let archives: Vec<_> = images.iter().map(|(_, a)| a.clone()).collect();
    let stack = args.stack;
    eprintln!(
        "conformance: starting {} nodes, {}",
        args.nodes,
        stack.title()
    );
    let mut cluster = Topology::kubelet(args.nodes)
        .images(archives)
        .sandbox_image(PAUSE)
        .stack(stack)
        .start();
    let tether = cluster.build_tether_image("1");
    cluster.install_tether(&tether);
    cluster.deploy_coredns(COREDNS);
    let suite = args.suite;
    let focus = args.focus.as_deref().unwrap_or(suite.focus);
    eprintln!(
        "conformance: cluster ready; running e2e.test --ginkgo.focus='{focus}'{}",
        suite
            .skip
            .map(|s| format!(" --ginkgo.skip='{s}'"))
            .unwrap_or_default()
    );
    let out = TempDir::new("conf");
    let mut faults = if args.faults {
        Faults::at(KILL_TETHERD_AT, RESTART_KUBELET_AT)
    } else {
        Faults::none()
    };
    let mut left_out = Vec::new();
    if args.faults && stack == Stack::Dual && std::ptr::eq(suite, &CONFORMANCE_DUAL) {
        faults.restart_kubelet_at = None;
        left_out.push(format!("{} {KUBELET_LOST}", conformance::KUBELET_LEFT_OUT));
    }
    let run = conformance::run(
        &mut cluster,
        &e2e,
        focus,
        suite.skip,
        out.path(),
        &mut faults,
    );
    if conformance::stopped() {
        eprintln!("conformance: stopped; nothing written");
        return ExitCode::FAILURE;
    }
    // The suite's skipped tests, as e2e.test lists them (every spec it
    // has is in its report, those outside the focus as skipped).
    let not_run = suite
        .not_run
        .map(|(parts, why)| {
            run.outcomes
                .iter()
                .filter(|o| o.state == "skipped" && parts.iter().all(|p| o.name.contains(p)))
                .map(|o| (o.name.clone(), why.to_string()))
                .collect()
        })
        .unwrap_or_default();
    let command = if suite.per_stack {
        format!("{} STACK={}", suite.command, stack.name())
    } else {
        suite.command.to_string()
    };
    let ctx = Context {
        title: if suite.per_stack {
            stack.title().to_string()
        } else {
            suite.title.to_string()
        },
        depth: if suite.per_stack { 2 } else { 1 },
        command,
        machine: machine.one_line(),
        date: date.trim().to_string(),
        versions: versions(),
        setup: vec![
            format!(
                "{} kubelet nodes, each in its own network, mount and PID namespaces \
                 (tests/src/kube_cluster.rs), with containerd, runc, the kubelet and kube-proxy \
                 (iptables mode)",
                args.nodes
            ),
            "the control plane (kube-apiserver, kube-controller-manager, kube-scheduler) \
             in a netns of its own, routing the pod network through the first node"
                .to_string(),
            format!(
                "{}: every node with {} on the fabric (the kubelet's `--node-ip`)",
                stack.title(),
                if stack == Stack::Dual {
                    "an IPv4 and an IPv6 address"
                } else {
                    "one address"
                }
            ),
            format!(
                "tether installed by its Helm chart in its default mode (the Kubernetes \
                 store: its CRDs on the same API server, no etcd of its own), cluster \
                 CIDRs {}, Services {}, hostPort through the chained portmap",
                stack.pod_cidrs().join(" and "),
                stack.service_cidrs().join(" and ")
            ),
            format!(
                "CoreDNS as kubeadm deploys it, kube-dns at {}",
                stack.cluster_dns().join(" and ")
            ),
            format!(
                "images built here and imported into every node: {}",
                images
                    .iter()
                    .map(|(n, _)| format!("`{n}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ],
        known: KNOWN
            .iter()
            .map(|(n, w)| (n.to_string(), w.to_string()))
            .collect(),
        faults: left_out
            .into_iter()
            .chain(faults.log.iter().cloned())
            .chain(faults.problems.iter().map(|p| format!("**Problem:** {p}")))
            .collect(),
        not_run,
    };
    let mut md = conformance::markdown(&run, &ctx);
    md.push_str(&format!(
        "\nThe whole run (the cluster's start, tether's install, CoreDNS, then e2e.test) took {:.0} s.\n",
        started.elapsed().as_secs_f64()
    ));
    if suite.per_stack && args.write.is_some() {
        let old = args
            .write
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default();
        md = conformance::per_stack_report(suite.title, suite.command, &old, stack, &md);
    }
    match &args.write {
        Some(path) => {
            if let Err(e) = std::fs::write(path, &md) {
                eprintln!("conformance: writing {}: {e}", path.display());
                return ExitCode::FAILURE;
            }
            eprintln!("conformance: wrote {}", path.display());
        }
        None => print!("{md}"),
    }
    let ran: Vec<_> = run
        .outcomes
        .iter()
        .filter(|o| o.state != "skipped")
        .collect();
    let passed = ran.iter().filter(|o| o.passed()).count();
    eprintln!(
        "conformance: {passed} of {} passed in {:.0} s (e2e.test {}; log {})",
        ran.len(),
        run.elapsed.as_secs_f64(),
        if run.success { "succeeded" } else { "failed" },
        run.log.display()
    );
    for p in &faults.problems {
        eprintln!("conformance: fault injection: {p}");
    }
    if !run.success || passed != ran.len() || !faults.problems.is_empty() {
        // Keep the log: the temp dir would take it.
        let kept = std::env::temp_dir().join("tether-conformance-e2e.log");
        let _ = std::fs::copy(&run.log, &kept);
        eprintln!("conformance: e2e.test's log kept at {}", kept.display());
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

/// The versions of what the run used.
fn versions() -> Vec<(String, String)> {
    let gomod =
        std::fs::read_to_string(workspace_dir().join("tests/k8s/go.mod")).unwrap_or_default();
    let k8s = gomod
        .lines()
        .map(|l| {
            l.trim()
                .trim_start_matches("require ")
                .split_whitespace()
                .collect::<Vec<_>>()
        })
        .find_map(|w| {
            (w.first() == Some(&"k8s.io/kubernetes")).then(|| w.get(1).map(|v| v.to_string()))
        })
        .flatten()
        .unwrap_or_else(|| "?".into());
    let first = |cmd: &str, args: &[&str]| {
        stdout_of(cmd, args)
            .lines()
            .next()
            .unwrap_or_default()
            .to_string()
    };
    vec![
        (
            "Kubernetes (e2e.test, kube-apiserver, kubelet, kube-proxy, ...)".into(),
            k8s,
        ),
        ("containerd".into(), first("containerd", &["--version"])),
        ("runc".into(), first("runc", &["--version"])),
        (
            "CoreDNS".into(),
            COREDNS.rsplit(':').next().unwrap_or("?").into(),
        ),
        (
            "tether".into(),
            first(
                "git",
                &[
                    "-C",
                    &workspace_dir().display().to_string(),
                    "describe",
                    "--always",
                    "--dirty",
                ],
            ),
        ),
        ("kernel".into(), first("uname", &["-r"])),
    ]
}
