//! Kubernetes' own network conformance tests on a [`KubeCluster`]: the
//! upstream `e2e.test` (built from k8s.io/kubernetes by
//! `tests/k8s/build.sh e2e`) with a ginkgo focus, its JSON report read
//! back, and the results written as `CONFORMANCE.md`.
//!
//! `e2e.test` runs in the API server's netns (it reaches the server, and
//! the nodes' addresses for the tests that call them, over the fabric),
//! with `--provider=skeleton`: no cloud, the cluster as it is.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::nodes::KubeCluster;

/// The focus of the whole sig-network Conformance set.
pub const FOCUS_ALL: &str = r"\[sig-network\].*\[Conformance\]";

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// Makes SIGINT and SIGTERM end a [`run`] early (`e2e.test` is killed and
/// its partial report read), so that the caller's cluster is dropped and
/// cleaned up instead of left running.
pub fn stop_on_signals() {
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
}

/// Whether a signal asked the run to stop (see [`stop_on_signals`]).
pub fn stopped() -> bool {
    STOP.load(Ordering::SeqCst)
}

/// The outcome of one spec.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The spec's full text (its containers' texts and its own).
    pub name: String,
    /// ginkgo's state: `passed`, `failed`, `skipped`, `panicked`, ...
    pub state: String,
    /// How long it ran.
    pub seconds: f64,
    /// The failure's message and location, when it failed.
    pub failure: Option<String>,
    /// What the spec wrote while it ran (its steps, the commands it ran
    /// and their output), when it failed.
    pub output: Option<String>,
}

impl Outcome {
    /// Whether it passed.
    pub fn passed(&self) -> bool {
        self.state == "passed"
    }
}

/// A run of `e2e.test`: every spec's outcome and the run's wall time.
#[derive(Debug)]
pub struct Run {
    /// The specs that ran (or were skipped by the focus' match), in order.
    pub outcomes: Vec<Outcome>,
    /// The whole run, start to exit.
    pub elapsed: Duration,
    /// `e2e.test`'s exit status.
    pub success: bool,
    /// Where its log and report are.
    pub log: PathBuf,
}

/// Runs `e2e.test` with `focus` against `cluster`, `e2e.test` and its
/// report under `dir`; panics only if it cannot be started or leaves no
/// report.
pub fn run(cluster: &KubeCluster, e2e: &Path, focus: &str, dir: &Path) -> Run {
    std::fs::create_dir_all(dir).expect("creating the report dir");
    let report = dir.join("report.json");
    let log = dir.join("e2e.log");
    let (out, err) = crate::log_outputs(&log);
    let kubeconfig = cluster.api.admin_kubeconfig();
    let started = Instant::now();
    let mut child = Command::new("ip")
        .args(["netns", "exec", cluster.api.netns().name()])
        .arg(e2e)
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .arg("--provider=skeleton")
        // The specs that run `kubectl exec` (the Services' reachability
        // checks, among others) run this one, the cluster's own version;
        // without the flag they take whatever `kubectl` is on the PATH, and
        // on a machine without one they fail on every try.
        .arg(format!(
            "--kubectl-path={}",
            crate::kube::k8s_bin_dir().join("kubectl").display()
        ))
        .arg(format!("--ginkgo.focus={focus}"))
        .arg(format!("--ginkgo.json-report={}", report.display()))
        .arg("--ginkgo.timeout=3h")
        .arg("--ginkgo.v")
        .arg(format!("--report-dir={}", dir.display()))
        // Every node is schedulable and Ready before the suite starts.
        .arg("--allowed-not-ready-nodes=0")
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .unwrap_or_else(|e| panic!("running {}: {e}", e2e.display()));
    let status = loop {
        if let Ok(Some(status)) = child.try_wait() {
            break status;
        }
        if stopped() {
            eprintln!("conformance: stopped by a signal; ending e2e.test");
            let _ = child.kill();
            break child.wait().expect("waiting for e2e.test");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let elapsed = started.elapsed();
    let text = std::fs::read_to_string(&report).unwrap_or_else(|e| {
        if stopped() {
            return "[]".to_string();
        }
        panic!(
            "e2e.test left no report at {} ({e}); its log:\n{}",
            report.display(),
            crate::log_tail(&log, 60)
        )
    });
    let value: Value = serde_json::from_str(&text).expect("e2e.test's JSON report");
    Run {
        outcomes: outcomes(&value),
        elapsed,
        success: status.success(),
        log,
    }
}

/// The specs of a ginkgo v2 JSON report (an array of suite reports) that
/// are tests (`It`), not the suite's setup and teardown nodes.
pub fn outcomes(report: &Value) -> Vec<Outcome> {
    let mut all = Vec::new();
    for suite in report.as_array().into_iter().flatten() {
        for spec in suite["SpecReports"].as_array().into_iter().flatten() {
            if spec["LeafNodeType"] != "It" {
                continue;
            }
            let mut parts: Vec<String> = spec["ContainerHierarchyTexts"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| t.as_str().map(str::to_string))
                .collect();
            parts.push(
                spec["LeafNodeText"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            );
            let state = spec["State"].as_str().unwrap_or("unknown").to_string();
            let failure = (state != "passed" && state != "skipped").then(|| {
                let f = &spec["Failure"];
                format!(
                    "{} ({}:{})",
                    f["Message"].as_str().unwrap_or_default().trim(),
                    f["Location"]["FileName"].as_str().unwrap_or_default(),
                    f["Location"]["LineNumber"]
                )
            });
            let output = failure.as_ref().and_then(|_| {
                spec["CapturedGinkgoWriterOutput"]
                    .as_str()
                    .map(str::to_string)
            });
            all.push(Outcome {
                name: parts.join(" "),
                state,
                seconds: spec["RunTime"].as_f64().unwrap_or(0.0) / 1e9,
                failure,
                output,
            });
        }
    }
    all
}

/// What `CONFORMANCE.md` says about where and with what the run was made.
#[derive(Debug)]
pub struct Context {
    /// The machine (`/work/.library/env`'s words, or `uname`).
    pub machine: String,
    /// The date of the run (UTC).
    pub date: String,
    /// Component versions, in order (`Kubernetes` → `v1.37.2`, ...).
    pub versions: Vec<(String, String)>,
    /// How the cluster was set up, one line per fact.
    pub setup: Vec<String>,
    /// The specs known not to pass here, each with its reason (a spec's
    /// name → why it cannot pass on this machine and what would make it).
    pub known: Vec<(String, String)>,
}

/// `CONFORMANCE.md`: the context, the total, every spec with its result and
/// time, and every failure's message.
pub fn markdown(run: &Run, ctx: &Context) -> String {
    let ran: Vec<&Outcome> = run
        .outcomes
        .iter()
        .filter(|o| o.state != "skipped")
        .collect();
    let passed = ran.iter().filter(|o| o.passed()).count();
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# Kubernetes network conformance (sig-network, Conformance)\n"
    );
    let _ = writeln!(
        md,
        "Written by `make conformance` (`tests/src/bin/conformance.rs`); do not edit by hand.\n"
    );
    let _ = writeln!(
        md,
        "**{passed} of {} passed** in {:.0} s ({:.1} min), on {} ({}).\n",
        ran.len(),
        run.elapsed.as_secs_f64(),
        run.elapsed.as_secs_f64() / 60.0,
        ctx.machine,
        ctx.date
    );
    let _ = writeln!(md, "## Versions\n");
    for (what, v) in &ctx.versions {
        let _ = writeln!(md, "- {what}: {v}");
    }
    let _ = writeln!(md, "\n## The cluster\n");
    for line in &ctx.setup {
        let _ = writeln!(md, "- {line}");
    }
    let _ = writeln!(md, "\n## Results\n");
    let _ = writeln!(md, "| # | Test | Result | Time (s) |");
    let _ = writeln!(md, "|---|---|---|---|");
    for (i, o) in ran.iter().enumerate() {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.1} |",
            i + 1,
            o.name.replace('|', "\\|"),
            o.state,
            o.seconds
        );
    }
    let failed: Vec<&&Outcome> = ran.iter().filter(|o| !o.passed()).collect();
    if !failed.is_empty() {
        let _ = writeln!(md, "\n## Failures\n");
        for o in failed {
            let _ = writeln!(md, "### {}\n", o.name);
            if let Some((_, why)) = ctx.known.iter().find(|(n, _)| o.name.contains(n.as_str())) {
                let _ = writeln!(md, "Why it cannot pass here: {why}\n");
            }
            let _ = writeln!(
                md,
                "```\n{}\n```\n",
                o.failure.as_deref().unwrap_or("(no message)")
            );
        }
    }
    md
}
