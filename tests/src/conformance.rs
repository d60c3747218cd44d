//! Kubernetes' own sig-network tests on a [`KubeCluster`]: the upstream
//! `e2e.test` (built from k8s.io/kubernetes by `tests/k8s/build.sh e2e`)
//! with a ginkgo focus and skip, its JSON report read back, and the
//! results written as a report (`CONFORMANCE.md`, `NETPOL.md`), or judged
//! as one of `make test`'s slices ([`judge_slice`]).
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

use crate::kube_cluster::KubeCluster;
use crate::stack::Stack;

/// The focus of the whole sig-network Conformance set.
pub const FOCUS_ALL: &str = r"\[sig-network\].*\[Conformance\]";

/// The focus of the Conformance set and of every dual-stack test
/// (`[Feature:IPv6DualStack]`), for a dual-stack cluster.
pub const FOCUS_DUAL_STACK: &str = r"\[sig-network\] (.*\[Conformance\]|\[Feature:IPv6DualStack\])";

/// The skip of the tests that need SCTP in the kernel (this machine's has
/// none): of the suites run here, three NetworkPolicy tests and one
/// dual-stack test carry the label. Two NetworkPolicy tests have SCTP in
/// their names but probe TCP, and run.
pub const SKIP_SCTP: &str = r"\[Feature:SCTPConnectivity\]";

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

/// Runs `e2e.test` with `focus` (less the specs `skip` matches) against
/// `cluster`, `e2e.test` and its report under `dir`, with `faults` injected
/// while it runs; panics only if it cannot be started or leaves no report.
pub fn run(
    cluster: &mut KubeCluster,
    e2e: &Path,
    focus: &str,
    skip: Option<&str>,
    dir: &Path,
    faults: &mut Faults,
) -> Run {
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
        .args(skip.map(|s| format!("--ginkgo.skip={s}")))
        .arg(format!("--ginkgo.json-report={}", report.display()))
        .arg("--ginkgo.timeout=3h")
        .arg("--ginkgo.v")
        .arg(format!("--report-dir={}", dir.display()))
        // Every node is schedulable and Ready before the suite starts.
        .arg("--allowed-not-ready-nodes=0")
        // A failed spec's pods stay, so that the report can show their
        // network ([`KubeCluster::network_state`]).
        .arg("--delete-namespace-on-failure=false")
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
        faults.step(cluster, started.elapsed());
        std::thread::sleep(Duration::from_millis(200));
    };
    faults.finish(cluster);
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

/// Faults injected into the cluster while `e2e.test` runs (see [`run`]):
/// the last node's tetherd killed with SIGKILL (its container is then
/// restarted by the kubelet, as after a crash), and the first node's
/// kubelet stopped and started again. Neither may change a test's result.
#[derive(Debug, Default)]
pub struct Faults {
    /// When, after `e2e.test`'s start, tetherd is killed (none: never).
    pub kill_tetherd_at: Option<Duration>,
    /// When, after `e2e.test`'s start, the kubelet restarts (none: never).
    pub restart_kubelet_at: Option<Duration>,
    killed: Option<Killed>,
    tetherd_done: bool,
    kubelet_done: bool,
    /// What was done and seen, a line each.
    pub log: Vec<String>,
    /// A fault that could not be injected, or a node that did not recover
    /// from one: the run is not a proof then.
    pub problems: Vec<String>,
}

/// The tetherd that [`Faults`] killed.
#[derive(Debug)]
struct Killed {
    node: usize,
    pid: i32,
    at: Duration,
    /// When a new tetherd ran on the node.
    back: Option<Duration>,
    checked: Duration,
}

fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

impl Faults {
    /// No faults.
    pub fn none() -> Faults {
        Faults::default()
    }

    /// tetherd killed at `kill_tetherd`, the kubelet restarted at
    /// `restart_kubelet`.
    pub fn at(kill_tetherd: Duration, restart_kubelet: Duration) -> Faults {
        Faults {
            kill_tetherd_at: Some(kill_tetherd),
            restart_kubelet_at: Some(restart_kubelet),
            ..Faults::default()
        }
    }

    /// Injects what is due at `elapsed`, and watches for tetherd's return.
    fn step(&mut self, cluster: &mut KubeCluster, elapsed: Duration) {
        if !self.tetherd_done && self.kill_tetherd_at.is_some_and(|at| elapsed >= at) {
            self.tetherd_done = true;
            self.kill_tetherd(cluster, elapsed);
        }
        if let Some(k) = self.killed.as_mut() {
            if k.back.is_none() && elapsed >= k.checked + Duration::from_secs(1) {
                k.checked = elapsed;
                let pids = cluster.nodes()[k.node].pids_named("tetherd");
                if pids.iter().any(|&p| p != k.pid) {
                    k.back = Some(elapsed);
                }
            }
        }
        if !self.kubelet_done && self.restart_kubelet_at.is_some_and(|at| elapsed >= at) {
            self.kubelet_done = true;
            let name = cluster.nodes()[0].name().to_string();
            let took = Instant::now();
            cluster.restart_kubelet(0);
            self.log.push(format!(
                "at {}: the kubelet of node {name} stopped (SIGTERM) and started again, in {}",
                secs(elapsed),
                secs(took.elapsed())
            ));
        }
    }

    fn kill_tetherd(&mut self, cluster: &KubeCluster, elapsed: Duration) {
        let node = cluster.nodes().len() - 1;
        let name = cluster.nodes()[node].name().to_string();
        match cluster.nodes()[node].pids_named("tetherd").as_slice() {
            &[pid] => {
                // SAFETY: kill has no memory preconditions; the PID is of a
                // process in this run's node, just read from /proc.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                }
                self.log.push(format!(
                    "at {}: tetherd on node {name} (PID {pid}) killed with SIGKILL",
                    secs(elapsed)
                ));
                self.killed = Some(Killed {
                    node,
                    pid,
                    at: elapsed,
                    back: None,
                    checked: elapsed,
                });
            }
            other => self.problems.push(format!(
                "at {}: not one tetherd on node {name} to kill, but PIDs {other:?}",
                secs(elapsed)
            )),
        }
    }

    /// After the run: whether tetherd came back (a new process, its
    /// container restarted and ready) and every node is Ready.
    fn finish(&mut self, cluster: &KubeCluster) {
        if let Some(at) = self.kill_tetherd_at.filter(|_| !self.tetherd_done) {
            self.problems.push(format!(
                "e2e.test ended before tetherd's kill was due ({})",
                secs(at)
            ));
        }
        if let Some(at) = self.restart_kubelet_at.filter(|_| !self.kubelet_done) {
            self.problems.push(format!(
                "e2e.test ended before the kubelet's restart was due ({})",
                secs(at)
            ));
        }
        if let Some(k) = &self.killed {
            let node = &cluster.nodes()[k.node];
            match k.back {
                Some(back) => self.log.push(format!(
                    "a new tetherd ran on node {} {} after the kill",
                    node.name(),
                    secs(back.saturating_sub(k.at))
                )),
                None if node.pids_named("tetherd").iter().any(|&p| p != k.pid) => {
                    self.log.push(format!(
                        "a new tetherd ran on node {} by the end of the run",
                        node.name()
                    ))
                }
                None => self.problems.push(format!(
                    "no new tetherd ran on node {} after the kill",
                    node.name()
                )),
            }
            let pods = cluster
                .api
                .get(&[
                    "-n",
                    crate::chart::NAMESPACE,
                    "pods",
                    "-l",
                    "app.kubernetes.io/name=tether",
                ])
                .unwrap_or(Value::Null);
            let status = pods["items"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|p| p["spec"]["nodeName"] == node.name())
                .flat_map(|p| p["status"]["containerStatuses"].as_array().cloned())
                .flatten()
                .find(|c| c["name"] == "tetherd");
            match status {
                Some(c) if c["restartCount"].as_u64().unwrap_or(0) >= 1 && c["ready"] == true => {
                    self.log.push(format!(
                        "its container: restartCount {}, ready",
                        c["restartCount"]
                    ))
                }
                other => self.problems.push(format!(
                    "tetherd's container on node {} after the kill: {other:?}",
                    node.name()
                )),
            }
        }
        if self.kubelet_done {
            let name = cluster.nodes()[0].name();
            if cluster.node_ready(name) {
                self.log
                    .push(format!("node {name} Ready at the end of the run"));
            } else {
                self.problems
                    .push(format!("node {name} not Ready at the end of the run"));
            }
        }
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

/// What a report says about where and with what the run was made.
#[derive(Debug)]
pub struct Context {
    /// The report's heading.
    pub title: String,
    /// Its level: 1 for a report of its own, 2 for a section of one
    /// ([`per_stack_report`]).
    pub depth: usize,
    /// The command that writes the report.
    pub command: String,
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
    /// The faults injected during the run and what was seen of them
    /// ([`Faults::log`] and [`Faults::problems`]).
    pub faults: Vec<String>,
    /// The specs of the suite left out of the run (the skip), each with
    /// why it cannot run on this machine.
    pub not_run: Vec<(String, String)>,
}

/// A report (`CONFORMANCE.md`, `NETPOL.md`): the context, the total, every
/// spec with its result and time, the suite's specs not run here and why,
/// and every failure's message.
pub fn markdown(run: &Run, ctx: &Context) -> String {
    let ran: Vec<&Outcome> = run
        .outcomes
        .iter()
        .filter(|o| o.state != "skipped")
        .collect();
    let passed = ran.iter().filter(|o| o.passed()).count();
    let mut md = String::new();
    let (h1, h2, h3) = (
        "#".repeat(ctx.depth),
        "#".repeat(ctx.depth + 1),
        "#".repeat(ctx.depth + 2),
    );
    let _ = writeln!(md, "{h1} {}\n", ctx.title);
    let _ = writeln!(
        md,
        "Written by `{}` (`tests/src/bin/conformance.rs`); do not edit by hand.\n",
        ctx.command
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
    let _ = writeln!(md, "{h2} Versions\n");
    for (what, v) in &ctx.versions {
        let _ = writeln!(md, "- {what}: {v}");
    }
    let _ = writeln!(md, "\n{h2} The cluster\n");
    for line in &ctx.setup {
        let _ = writeln!(md, "- {line}");
    }
    if !ctx.faults.is_empty() {
        let _ = writeln!(md, "\n{h2} Faults injected during the run\n");
        for line in &ctx.faults {
            let _ = writeln!(md, "- {line}");
        }
    }
    let _ = writeln!(md, "\n{h2} Results\n");
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
    if !ctx.not_run.is_empty() {
        let _ = writeln!(md, "\n{h2} Not run on this machine\n");
        let _ = writeln!(md, "| Test | Why |");
        let _ = writeln!(md, "|---|---|");
        for (name, why) in &ctx.not_run {
            let _ = writeln!(md, "| {} | {why} |", name.replace('|', "\\|"));
        }
    }
    let failed: Vec<&&Outcome> = ran.iter().filter(|o| !o.passed()).collect();
    if !failed.is_empty() {
        let _ = writeln!(md, "\n{h2} Failures\n");
        for o in failed {
            let _ = writeln!(md, "{h3} {}\n", o.name);
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

/// The marker lines around a stack's section of a per-stack report.
fn stack_markers(stack: Stack) -> (String, String) {
    (
        format!("<!-- stack {} -->", stack.name()),
        format!("<!-- end of stack {} -->", stack.name()),
    )
}

/// A report with one section per stack (`CONFORMANCE.md`): `section`
/// (a [`markdown`] of depth 2) as `stack`'s, the other stacks' sections
/// kept from `old` (the file as it was; a section missing there says it
/// has not been run), under the report's title and how it is written.
pub fn per_stack_report(
    title: &str,
    command: &str,
    old: &str,
    stack: Stack,
    section: &str,
) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# {title}\n");
    let _ = writeln!(
        md,
        "Written by `{command} STACK=v4|dual|v6` (`tests/src/bin/conformance.rs`), one section \
         per cluster stack, each by its own run; do not edit by hand.\n"
    );
    for s in Stack::ALL {
        let _ = writeln!(
            md,
            "- [{}](#{}): `{command} STACK={}`",
            s.title(),
            anchor(s.title()),
            s.name()
        );
    }
    for s in Stack::ALL {
        let (start, end) = stack_markers(s);
        let _ = writeln!(md, "\n{start}\n");
        if s == stack {
            md.push_str(section.trim_end());
        } else {
            let kept = old
                .split_once(&start)
                .and_then(|(_, rest)| rest.split_once(&end))
                .map(|(inner, _)| inner.trim().to_string());
            match kept {
                Some(inner) => md.push_str(&inner),
                None => {
                    let _ = write!(md, "## {}\n\nNot run yet.", s.title());
                }
            }
        }
        let _ = writeln!(md, "\n\n{end}");
    }
    md
}

/// A heading's anchor as GitHub makes it: lower case, spaces to dashes,
/// anything but letters, digits, dashes and underscores left out.
fn anchor(heading: &str) -> String {
    heading
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// Why a run of upstream's dual-stack tests leaves the kubelet's restart
/// out (`make conformance STACK=dual` and the conformance slice).
pub const KUBELET_LEFT_OUT: &str = "the kubelet's restart is left out of the dual-stack run: the \
    dual-stack tests make their reachability checks with `kubectl exec` in a pod, which the API \
    server passes to that pod's kubelet, and a check in the seconds the kubelet is down fails \
    with `connection refused` on its port 10250 (upstream does not retry it).";

/// A slice of upstream's tests, as `make test` runs it: which tests, and
/// when the faults strike.
#[derive(Debug, Clone, Copy)]
pub struct Slice<'a> {
    /// What the messages call it.
    pub name: &'a str,
    /// The ginkgo focus.
    pub focus: &'a str,
    /// The ginkgo skip, if any.
    pub skip: Option<&'a str>,
    /// How many tests the focus selects (less the skip).
    pub tests: usize,
    /// When, after `e2e.test`'s start, the last node's tetherd is killed.
    pub kill_tetherd_at: Duration,
    /// When the first node's kubelet is restarted; none: never (the
    /// dual-stack tests: [`KUBELET_LEFT_OUT`]).
    pub restart_kubelet_at: Option<Duration>,
    /// The cluster's IP families.
    pub stack: Stack,
}

/// Runs `slice` on two kubelet nodes wired by tether (installed by its
/// chart), with CoreDNS and the conformance images, and panics with every
/// failed test's message and output, and the network after the failure,
/// unless every test passed, the focus selected the slice's count, and
/// its faults were injected and recovered from.
pub fn judge_slice(slice: Slice) {
    use crate::conformance_images::{conformance_images, e2e_dir, COREDNS, PAUSE};
    let images = conformance_images();
    let mut cluster = crate::topology::Topology::kubelet(2)
        .images(images.iter().map(|(_, a)| a.clone()))
        .sandbox_image(PAUSE)
        .stack(slice.stack)
        .start();
    let tether = cluster.build_tether_image("1");
    cluster.install_tether(&tether);
    cluster.deploy_coredns(COREDNS);
    let out = crate::TempDir::new("conf");
    let name = slice.name;
    let mut faults = Faults {
        kill_tetherd_at: Some(slice.kill_tetherd_at),
        restart_kubelet_at: slice.restart_kubelet_at,
        ..Faults::default()
    };
    if slice.restart_kubelet_at.is_none() {
        faults.log.push(KUBELET_LEFT_OUT.to_string());
    }
    let run = run(
        &mut cluster,
        &e2e_dir().join("e2e.test"),
        slice.focus,
        slice.skip,
        out.path(),
        &mut faults,
    );
    for line in &faults.log {
        eprintln!("{name}: fault: {line}");
    }
    let ran: Vec<_> = run
        .outcomes
        .iter()
        .filter(|o| o.state != "skipped")
        .collect();
    for o in &ran {
        eprintln!("{name}: {} {} ({:.1} s)", o.state, o.name, o.seconds);
    }
    let failed: Vec<String> = ran
        .iter()
        .filter(|o| !o.passed())
        .map(|o| {
            // The spec's own output: its steps and the commands it ran,
            // with what they printed (the last 120 lines).
            let output = o.output.as_deref().unwrap_or_default();
            let lines: Vec<&str> = output.lines().collect();
            let tail = lines[lines.len().saturating_sub(120)..].join("\n");
            format!(
                "{}: {}\n--- its output ---\n{tail}",
                o.name,
                o.failure.as_deref().unwrap_or("?")
            )
        })
        .collect();
    if !failed.is_empty() {
        // The failed specs' pods are kept (`run`): how the network looked
        // after the failure.
        eprintln!(
            "{name}: the network after the failure:\n{}\ntether's logs:\n{}",
            cluster.network_state(),
            cluster.tether_logs()
        );
    }
    assert!(
        failed.is_empty() && run.success,
        "{name}: {} of {} failed:\n{}\ne2e.test's log:\n{}",
        failed.len(),
        ran.len(),
        failed.join("\n"),
        crate::log_tail(&run.log, 80)
    );
    assert_eq!(
        ran.len(),
        slice.tests,
        "{name}: the focus selected {} tests",
        ran.len()
    );
    assert!(
        faults.problems.is_empty(),
        "{name}: the faults were not injected or not recovered from: {:?}\n{:?}",
        faults.problems,
        faults.log
    );
    eprintln!(
        "{name}: {} passed in {:.0} s",
        ran.len(),
        run.elapsed.as_secs_f64()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stacks_run_replaces_its_own_section_and_keeps_the_others() {
        let first = per_stack_report("T", "make c", "", Stack::Dual, "## dual-stack\n\nrun 1\n");
        assert!(first.contains("run 1"));
        assert!(first.contains("## IPv4\n\nNot run yet."));
        assert!(first.contains("- [IPv6 only](#ipv6-only): `make c STACK=v6`"));
        let second = per_stack_report("T", "make c", &first, Stack::V6, "## IPv6 only\n\nrun 2\n");
        assert!(second.contains("run 1") && second.contains("run 2"));
        let third = per_stack_report("T", "make c", &second, Stack::Dual, "## dual\n\nrun 3\n");
        assert!(third.contains("run 3") && third.contains("run 2") && !third.contains("run 1"));
        // The sections stay in the stacks' order.
        let at = |s: &str| third.find(s).unwrap();
        assert!(
            at("stack v4 -->") < at("stack dual -->") && at("stack dual -->") < at("stack v6 -->")
        );
    }

    #[test]
    fn anchors_are_githubs() {
        assert_eq!(
            anchor("dual-stack (IPv4 first, IPv6)"),
            "dual-stack-ipv4-first-ipv6"
        );
    }
}
