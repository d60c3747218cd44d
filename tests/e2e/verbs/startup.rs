//! What `tetherd` says when it cannot start: one plain sentence that says
//! what to do, never a CNI code, and plain text (no colour codes) when its
//! stderr is not a terminal; JSON lines with `--log-format json`. Also the
//! flags that were refused or accepted wrongly: `:PORT` for the metrics
//! address is accepted, a `--pod-cidr` with host bits is refused as the
//! pools file refuses it, a pools file that is a bare list says what it
//! must hold, `--overlay vxlan` with a fixed `--pod-cidr` is said to have
//! no effect. Each case runs in a netns of its own. Run as root.

use std::path::Path;
use std::process::{Command, Output};

use tether_e2e::{require_root, tetherd_bin, Daemon, DaemonOpts, Netns, TempDir};

/// Runs `tetherd args` once in `ns` (as `prefix`, e.g. setpriv, if given),
/// with NO_COLOR unset so that only the terminal check decides colours;
/// bounded by `timeout` in case it wrongly starts serving.
fn tetherd_once(ns: &Netns, prefix: &[&str], args: &[&str]) -> Output {
    Command::new("ip")
        .args(["netns", "exec", ns.name()])
        .args(prefix)
        .args(["timeout", "20"])
        .arg(tetherd_bin())
        .args(args)
        .env_remove("NO_COLOR")
        .env_remove("TETHER_LOG_FORMAT")
        .output()
        .unwrap_or_else(|e| panic!("running tetherd: {e}"))
}

fn said(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout)
}

/// The arguments every case shares: a node name, a pod CIDR, and a socket
/// and state dir under `dir`.
fn base_args(dir: &Path) -> Vec<String> {
    [
        "--node-name",
        "startup",
        "--pod-cidr",
        "10.83.0.0/24",
        "--socket",
        &dir.join("t.sock").display().to_string(),
        "--state-dir",
        &dir.join("state").display().to_string(),
    ]
    .map(str::to_owned)
    .to_vec()
}

fn with(base: &[String], more: &[&str]) -> Vec<String> {
    base.iter()
        .cloned()
        .chain(more.iter().map(|s| s.to_string()))
        .collect()
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// A plain start-up error: exit 1, the sentence, no CNI code, no ANSI.
fn assert_plain_failure(out: &Output, sentence: &str) {
    let text = said(out);
    assert_eq!(out.status.code(), Some(1), "{}: {text}", out.status);
    assert!(text.contains(sentence), "expected {sentence:?} in: {text}");
    assert!(
        !text.contains("code=") && !text.contains("\"code\""),
        "a CNI code in a start-up error: {text}"
    );
    assert!(
        !text.contains('\u{1b}'),
        "colour codes with stderr not a terminal: {text:?}"
    );
}

const SETPRIV_NOBODY: [&str; 4] = [
    "setpriv",
    "--reuid=65534",
    "--regid=65534",
    "--clear-groups",
];

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn without_root_it_says_it_must_run_as_root_and_creates_nothing() {
    require_root();
    let ns = Netns::new("su");
    let dir = TempDir::new("su");
    let args = base_args(dir.path());
    let out = tetherd_once(&ns, &SETPRIV_NOBODY, &strs(&args));
    assert_plain_failure(&out, "tetherd must run as root (CAP_NET_ADMIN)");
    assert!(
        !dir.path().join("state").exists(),
        "the state dir was created"
    );
    assert!(ns.tether_links().is_empty() && ns.tether_routes().is_empty());

    // The same as one JSON object per line.
    let out = tetherd_once(
        &ns,
        &SETPRIV_NOBODY,
        &strs(&with(&args, &["--log-format", "json"])),
    );
    assert_eq!(out.status.code(), Some(1), "{}", said(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<serde_json::Value> = stderr
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let error = lines
        .iter()
        .find(|l| l["level"] == "ERROR")
        .unwrap_or_else(|| panic!("no ERROR line in {stderr}"));
    let message = error["fields"]["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("tetherd must run as root (CAP_NET_ADMIN)"),
        "{error}"
    );
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn a_taken_metrics_port_is_named_in_plain_words() {
    require_root();
    let ns = Netns::new("sp");
    let dir = TempDir::new("sp");
    let taken =
        ns.run(|| std::net::TcpListener::bind("127.0.0.1:9654").expect("bind in the netns"));
    let args = with(
        &base_args(dir.path()),
        &["--metrics-address", "127.0.0.1:9654"],
    );
    let out = tetherd_once(&ns, &[], &strs(&args));
    drop(taken);
    assert_plain_failure(
        &out,
        "--metrics-address 127.0.0.1:9654: port 9654 already in use",
    );
    // It stopped before the store: no snapshot, no journal, no socket.
    let state = dir.path().join("state");
    for f in ["attachments.snapshot", "attachments.journal"] {
        assert!(!state.join(f).exists(), "{f} was created");
    }
    assert!(!dir.path().join("t.sock").exists());
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn a_bare_port_listens_on_every_address() {
    require_root();
    let daemon = Daemon::start(DaemonOpts {
        pod_cidrs: vec!["10.84.0.0/24".into()],
        extra_args: vec!["--metrics-address".into(), ":9654".into()],
        ..DaemonOpts::default()
    });
    for url in ["http://127.0.0.1:9654/metrics", "http://[::1]:9654/metrics"] {
        let body = daemon
            .node()
            .exec_ok(&["curl", "-sS", "--fail", "--max-time", "5", url]);
        assert!(body.contains("tether_build_info"), "{url}: {body}");
    }
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn a_pod_cidr_with_host_bits_is_refused_naming_the_network_meant() {
    require_root();
    let ns = Netns::new("sc");
    let dir = TempDir::new("sc");
    let socket = dir.path().join("t.sock").display().to_string();
    let state = dir.path().join("state").display().to_string();
    let out = tetherd_once(
        &ns,
        &[],
        &[
            "--pod-cidr",
            "10.0.0.5/24",
            "--socket",
            &socket,
            "--state-dir",
            &state,
        ],
    );
    let text = said(&out);
    // A usage error, as clap reports them: exit 2.
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(
        text.contains("10.0.0.5/24 has host bits set; did you mean 10.0.0.0/24?"),
        "{text}"
    );
    assert!(!dir.path().join("state").exists());
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn a_pools_file_that_is_a_bare_list_says_what_it_must_hold() {
    require_root();
    let ns = Netns::new("sl");
    let dir = TempDir::new("sl");
    let pools = dir.path().join("pools.json");
    std::fs::write(&pools, r#"[{"name": "blue", "cidr": "10.50.0.0/24"}]"#).expect("writing");
    let args = with(
        &base_args(dir.path()),
        &["--pools", &pools.display().to_string()],
    );
    let out = tetherd_once(&ns, &[], &strs(&args));
    assert_plain_failure(
        &out,
        r#"pools file: expected an object {"pools": [...]}, found an array; put the list under "pools""#,
    );
    assert!(!said(&out).contains("invalid type"), "{}", said(&out));
    assert!(!dir.path().join("state/attachments.journal").exists());
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn vxlan_without_other_nodes_is_said_to_have_no_effect() {
    require_root();
    let daemon = Daemon::with_cidrs(&["10.0.9.0/24"], &["--overlay", "vxlan"]);
    let log = daemon.log();
    assert!(
        log.contains("--overlay vxlan has no effect with --pod-cidr"),
        "{log}"
    );
    assert!(!daemon.node().has_link("tether.vxlan"), "{log}");
}
