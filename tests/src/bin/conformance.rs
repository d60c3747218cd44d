//! `make conformance`: Kubernetes' sig-network Conformance tests (the
//! upstream `e2e.test` of k8s.io/kubernetes v1.37.2) on a cluster of
//! kubelet nodes wired by tether (tests/src/kube_cluster.rs), and the results as
//! `CONFORMANCE.md`.
//!
//! Usage: `conformance [--nodes 2] [--focus REGEX] [--faults] [--write CONFORMANCE.md]`
//!
//! It starts the cluster with the tests' images imported into every node,
//! installs tether with its chart, deploys CoreDNS, runs `e2e.test` with
//! the focus (default: every `[sig-network] ... [Conformance]` test), and
//! writes the report (or prints it). It exits non-zero if a test failed.
//!
//! With `--faults` (as `make conformance` runs it), the run also takes two
//! faults while the tests run, and the report lists them: the last node's
//! tetherd is killed with SIGKILL 90 s into `e2e.test` (the kubelet
//! restarts its container, as after a crash), and the first node's kubelet
//! is stopped and started again at 180 s. No test's result may change; a
//! fault that could not be injected, or a node that did not recover from
//! it, fails the run.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use tether_e2e::conformance::{self, Context, Faults, FOCUS_ALL};
use tether_e2e::conformance_images::{conformance_images, e2e_dir, COREDNS, PAUSE};
use tether_e2e::kube_cluster::{CLUSTER_DNS, POD_CIDR, SERVICE_CIDR};
use tether_e2e::machine::{stdout_of, Machine};
use tether_e2e::topology::Topology;
use tether_e2e::{require_root, workspace_dir, TempDir};

const USAGE: &str = "usage: conformance [--nodes N] [--focus REGEX] [--faults] [--write FILE]";
/// When `--faults` kills the last node's tetherd, after `e2e.test`'s start.
const KILL_TETHERD_AT: Duration = Duration::from_secs(90);
/// When `--faults` restarts the first node's kubelet.
const RESTART_KUBELET_AT: Duration = Duration::from_secs(180);

/// Tests that cannot pass on this machine, each with its reason and what
/// would make it pass. Empty: every test is expected to pass.
const KNOWN: &[(&str, &str)] = &[];

struct Args {
    nodes: usize,
    focus: String,
    faults: bool,
    write: Option<PathBuf>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        nodes: 2,
        focus: FOCUS_ALL.to_string(),
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
            "--focus" => args.focus = value()?,
            "--faults" => args.faults = true,
            "--write" => args.write = Some(PathBuf::from(value()?)),
            _ => return Err(format!("unknown argument {flag}\n{USAGE}")),
        }
    }
    if args.nodes < 2 {
        return Err(format!("the tests need at least 2 nodes\n{USAGE}"));
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
    eprintln!("conformance: starting {} nodes", args.nodes);
    let mut cluster = Topology::kubelet(args.nodes)
        .images(archives)
        .sandbox_image(PAUSE)
        .start();
    let tether = cluster.build_tether_image("1");
    cluster.install_tether(&tether);
    cluster.deploy_coredns(COREDNS);
    eprintln!(
        "conformance: cluster ready; running e2e.test --ginkgo.focus='{}'",
        args.focus
    );
    let out = TempDir::new("conf");
    let mut faults = if args.faults {
        Faults::at(KILL_TETHERD_AT, RESTART_KUBELET_AT)
    } else {
        Faults::none()
    };
    let run = conformance::run(&mut cluster, &e2e, &args.focus, out.path(), &mut faults);
    if conformance::stopped() {
        eprintln!("conformance: stopped; nothing written");
        return ExitCode::FAILURE;
    }
    let ctx = Context {
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
                "tether installed by its Helm chart in its default mode (the Kubernetes \
                 store: its CRDs on the same API server, no etcd of its own), cluster CIDR \
                 {POD_CIDR}, Services {SERVICE_CIDR}, hostPort through the chained portmap"
            ),
            format!("CoreDNS as kubeadm deploys it, kube-dns at {CLUSTER_DNS}"),
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
        faults: faults
            .log
            .iter()
            .cloned()
            .chain(faults.problems.iter().map(|p| format!("**Problem:** {p}")))
            .collect(),
    };
    let mut md = conformance::markdown(&run, &ctx);
    md.push_str(&format!(
        "\nThe whole run (the cluster's start, tether's install, CoreDNS, then e2e.test) took {:.0} s.\n",
        started.elapsed().as_secs_f64()
    ));
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
