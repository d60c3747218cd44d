//! Runs the built `tether` binary the way a runtime does (environment,
//! stdin, stdout, exit status) against a fake tetherd listening on a unix
//! socket in a temporary directory, or against no daemon at all.

use serde_json::{json, Value};
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener as StdUnixListener;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;
use tempfile::TempDir;
use tether_proto::cni::v1::cni_response::Outcome;
use tether_proto::cni::v1::cni_server::{Cni, CniServer};
use tether_proto::cni::v1::{CniError, CniRequest, CniResponse};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};

const VERSION_REPLY: &str =
    r#"{"cniVersion":"1.1.0","supportedVersions":["0.3.0","0.3.1","0.4.0","1.0.0","1.1.0"]}"#;

/// A fake tetherd. What it answers is chosen by the "fake" key of the
/// network configuration, which the real daemon would see the same way.
struct FakeDaemon;

impl FakeDaemon {
    fn answer(rpc: &str, request: CniRequest) -> Result<Response<CniResponse>, Status> {
        let config: Value = serde_json::from_slice(&request.stdin)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let outcome = match config["fake"].as_str().unwrap_or("echo") {
            // Everything the daemon received, so tests can check the mapping.
            "echo" => Outcome::Result(
                serde_json::to_vec(&json!({
                    "rpc": rpc,
                    "command": request.command,
                    "containerId": request.container_id,
                    "netns": request.netns,
                    "ifname": request.ifname,
                    "args": request.args,
                    "path": request.path,
                    "present": request.present,
                    "stdin": String::from_utf8(request.stdin).unwrap(),
                }))
                .unwrap(),
            ),
            "raw" => Outcome::Result(b"  {\"cniVersion\":\"1.0.0\",\"ips\":[]}\n\n".to_vec()),
            "nothing" => Outcome::Result(Vec::new()),
            "error" => Outcome::Error(CniError {
                code: 100,
                msg: "address pool exhausted".into(),
                details: "pool 10.244.1.0/24 has no free address".into(),
                cni_version: String::new(),
            }),
            "error-versioned" => Outcome::Error(CniError {
                code: 3,
                msg: "unknown container".into(),
                details: String::new(),
                cni_version: "1.0.0".into(),
            }),
            "deny" => return Err(Status::permission_denied("uid 1000 is not allowed")),
            other => return Err(Status::invalid_argument(format!("unknown fake {other}"))),
        };
        Ok(Response::new(CniResponse {
            outcome: Some(outcome),
        }))
    }
}

#[tonic::async_trait]
impl Cni for FakeDaemon {
    async fn add(&self, r: Request<CniRequest>) -> Result<Response<CniResponse>, Status> {
        Self::answer("add", r.into_inner())
    }
    async fn del(&self, r: Request<CniRequest>) -> Result<Response<CniResponse>, Status> {
        Self::answer("del", r.into_inner())
    }
    async fn check(&self, r: Request<CniRequest>) -> Result<Response<CniResponse>, Status> {
        Self::answer("check", r.into_inner())
    }
    async fn status(&self, r: Request<CniRequest>) -> Result<Response<CniResponse>, Status> {
        Self::answer("status", r.into_inner())
    }
    async fn gc(&self, r: Request<CniRequest>) -> Result<Response<CniResponse>, Status> {
        Self::answer("gc", r.into_inner())
    }
}

/// A temporary node: a socket path, with or without a daemon behind it, and
/// a state dir for the tests that play the daemon's part in the DEL queue.
struct Node {
    dir: TempDir,
}

impl Node {
    fn new() -> Node {
        Node {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("tether.sock")
    }

    fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// Where the shim queues: beside the socket. No daemon has made it a
    /// link to its state dir here, so the shim makes it a directory.
    fn queue_dir(&self) -> PathBuf {
        self.dir.path().join("tether.sock.pending-del")
    }

    /// Starts the fake daemon. The socket is bound before this returns, so
    /// the shim never races it.
    fn with_daemon(self) -> Node {
        serve_fake(bind(&self.socket()));
        self
    }

    /// A listener that accepts connections and closes them at once, the way
    /// tetherd drops a peer whose SO_PEERCRED uid is not allowed.
    fn with_slamming_listener(self) -> Node {
        let listener = StdUnixListener::bind(self.socket()).unwrap();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                drop(conn);
            }
        });
        self
    }

    /// A network configuration pointing at this node, plus `extra` keys.
    fn config(&self, extra: Value) -> Vec<u8> {
        let mut config = json!({
            "cniVersion": "0.4.0",
            "name": "tether",
            "type": "tether",
            "socket": self.socket(),
        });
        for (k, v) in extra.as_object().unwrap() {
            config[k] = v.clone();
        }
        serde_json::to_vec(&config).unwrap()
    }

    fn queued(&self) -> Vec<String> {
        match std::fs::read_dir(self.queue_dir()) {
            Ok(entries) => entries
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect(),
            Err(_) => Vec::new(),
        }
    }
}

fn bind(socket: &Path) -> StdUnixListener {
    let listener = StdUnixListener::bind(socket).unwrap();
    listener.set_nonblocking(true).unwrap();
    listener
}

/// Serves the fake daemon on `listener` from a thread of its own.
fn serve_fake(listener: StdUnixListener) {
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let listener = tokio::net::UnixListener::from_std(listener).unwrap();
            tonic::transport::Server::builder()
                .add_service(CniServer::new(FakeDaemon))
                .serve_with_incoming(UnixListenerStream::new(listener))
                .await
                .unwrap();
        });
    });
}

/// Runs the shim with exactly `env` and `stdin`, and SIGPIPE at its
/// default, as a runtime starts it (this test process ignores SIGPIPE,
/// and an ignored signal stays ignored across exec). Returns its output
/// and pid.
fn shim(env: &[(&str, &str)], stdin: &[u8]) -> (Output, u32) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_tether"));
    // SAFETY: between fork and exec only async-signal-safe calls run:
    // signal(2) is one.
    unsafe {
        command.pre_exec(|| {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
            Ok(())
        });
    }
    let mut child = command
        .env_clear()
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut input = child.stdin.take().unwrap();
    let stdin = stdin.to_vec();
    // The shim may rightly stop reading early (VERSION, oversized input), so
    // a broken pipe here is not a failure.
    let writer = std::thread::spawn(move || {
        let _ = input.write_all(&stdin);
    });
    let output = child.wait_with_output().unwrap();
    writer.join().unwrap();
    (output, pid)
}

/// A kubelet-style environment for `command`.
fn cri_env(command: &str) -> Vec<(&str, &str)> {
    vec![
        ("CNI_COMMAND", command),
        ("CNI_CONTAINERID", "3f2a9c"),
        ("CNI_NETNS", "/var/run/netns/cni-77"),
        ("CNI_IFNAME", "eth0"),
        (
            "CNI_ARGS",
            "K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=3f2a9c",
        ),
        ("CNI_PATH", "/opt/cni/bin"),
    ]
}

/// The CNI error object printed on stdout, checking the exit status is 1.
fn cni_error(output: &Output) -> Value {
    assert_eq!(
        output.status.code(),
        Some(1),
        "stdout {:?} stderr {:?}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

fn success(output: &Output) -> &[u8] {
    assert_eq!(
        output.status.code(),
        Some(0),
        "stdout {:?} stderr {:?}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    &output.stdout
}

#[test]
fn version_with_podman_dummy_environment() {
    let (output, _) = shim(
        &[
            ("CNI_COMMAND", "VERSION"),
            ("CNI_NETNS", "dummy"),
            ("CNI_PATH", "dummy"),
        ],
        br#"{"cniVersion":"1.0.0"}"#,
    );
    assert_eq!(success(&output), format!("{VERSION_REPLY}\n").as_bytes());
}

#[test]
fn version_with_empty_stdin() {
    let (output, _) = shim(&[("CNI_COMMAND", "VERSION")], b"");
    assert_eq!(success(&output), format!("{VERSION_REPLY}\n").as_bytes());
}

/// As the reference plugins (skel) do: without CNI_COMMAND, or with an
/// empty one, the binary says what it is on stderr and exits 0; stdout,
/// a runtime's, stays empty, and arguments such as --help are ignored.
#[test]
fn without_a_command_it_says_what_it_is() {
    let node = Node::new().with_daemon();
    let about = format!(
        "CNI tether plugin version {}\nCNI protocol versions supported: 0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0\n",
        env!("CARGO_PKG_VERSION")
    );
    for env in [vec![("CNI_CONTAINERID", "c1")], vec![("CNI_COMMAND", "")]] {
        let (output, _) = shim(&env, &node.config(json!({})));
        assert!(output.status.success(), "{env:?}: {output:?}");
        assert_eq!(String::from_utf8_lossy(&output.stderr), about, "{env:?}");
        assert!(output.stdout.is_empty(), "{env:?}");
    }
    let help = Command::new(env!("CARGO_BIN_EXE_tether"))
        .arg("--help")
        .env_clear()
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(help.status.success());
    assert_eq!(String::from_utf8_lossy(&help.stderr), about);
}

#[test]
fn unknown_command_is_code_4() {
    let node = Node::new().with_daemon();
    for command in ["FOO", "add"] {
        let (output, _) = shim(&[("CNI_COMMAND", command)], &node.config(json!({})));
        let error = cni_error(&output);
        assert_eq!(error["code"], 4, "{command:?}");
        assert_eq!(error["cniVersion"], "1.1.0");
    }
}

#[test]
fn oversized_stdin_is_code_7() {
    let node = Node::new().with_daemon();
    let padding = "x".repeat(1 << 20);
    let (output, _) = shim(&cri_env("ADD"), &node.config(json!({ "pad": padding })));
    let error = cni_error(&output);
    assert_eq!(error["code"], 7);
    assert_eq!(error["msg"], "network configuration larger than 1 MiB");
}

#[test]
fn non_object_stdin_is_code_6() {
    for stdin in [&b"[1,2]"[..], b"not json", b"", b"\"socket\""] {
        let (output, _) = shim(&cri_env("ADD"), stdin);
        let error = cni_error(&output);
        assert_eq!(error["code"], 6, "{:?}", String::from_utf8_lossy(stdin));
    }
}

#[test]
fn add_forwards_environment_and_stdin_untouched() {
    let node = Node::new().with_daemon();
    // Odd spacing and non-ASCII must survive: the daemon gets the bytes.
    let mut stdin = b"{ \"note\": \"caf\xc3\xa9\",\n".to_vec();
    stdin.extend_from_slice(&node.config(json!({}))[1..]);

    let (output, _) = shim(&cri_env("ADD"), &stdin);

    let echoed: Value = serde_json::from_slice(success(&output)).unwrap();
    assert_eq!(
        echoed,
        json!({
            "rpc": "add",
            "command": "ADD",
            "containerId": "3f2a9c",
            "netns": "/var/run/netns/cni-77",
            "ifname": "eth0",
            "args": "K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=3f2a9c",
            "path": "/opt/cni/bin",
            "present": ["CNI_COMMAND", "CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_ARGS", "CNI_PATH"],
            "stdin": String::from_utf8(stdin).unwrap(),
        })
    );
}

#[test]
fn present_lists_only_variables_that_were_set() {
    let node = Node::new().with_daemon();
    // ctr's DEL: CNI_NETNS set but empty; here CNI_PATH is not set at all.
    let env = [
        ("CNI_COMMAND", "DEL"),
        ("CNI_CONTAINERID", "default-c1"),
        ("CNI_NETNS", ""),
        ("CNI_IFNAME", "eth0"),
        ("CNI_ARGS", ""),
    ];
    let (output, _) = shim(&env, &node.config(json!({})));
    let echoed: Value = serde_json::from_slice(success(&output)).unwrap();
    assert_eq!(echoed["rpc"], "del");
    assert_eq!(echoed["netns"], "");
    assert_eq!(echoed["path"], "");
    assert_eq!(
        echoed["present"],
        json!([
            "CNI_COMMAND",
            "CNI_CONTAINERID",
            "CNI_NETNS",
            "CNI_IFNAME",
            "CNI_ARGS"
        ])
    );
}

#[test]
fn each_verb_reaches_its_rpc() {
    let node = Node::new().with_daemon();
    for (command, rpc) in [
        ("ADD", "add"),
        ("DEL", "del"),
        ("CHECK", "check"),
        ("STATUS", "status"),
        ("GC", "gc"),
    ] {
        let (output, _) = shim(&cri_env(command), &node.config(json!({})));
        let echoed: Value = serde_json::from_slice(success(&output)).unwrap();
        assert_eq!(echoed["rpc"], rpc);
        assert_eq!(echoed["command"], command);
    }
}

#[test]
fn a_config_of_almost_1_mib_crosses_the_flow_control_windows() {
    let node = Node::new().with_daemon();
    // Just under the 1 MiB stdin cap: far beyond the 64 KiB windows that
    // HTTP/2 starts with, so the request only gets through if the client
    // waits for the real (tonic/h2) server's WINDOW_UPDATEs.
    let mut stdin = node.config(json!({ "pad": "" }));
    let pad = (1 << 20) - 64 - stdin.len();
    stdin = node.config(json!({ "pad": "p".repeat(pad) }));
    assert!(stdin.len() < 1 << 20 && stdin.len() > 1_000_000);

    let (output, _) = shim(&cri_env("ADD"), &stdin);

    let echoed: Value = serde_json::from_slice(success(&output)).unwrap();
    assert_eq!(echoed["rpc"], "add");
    assert_eq!(echoed["stdin"].as_str().unwrap().as_bytes(), stdin);
}

#[test]
fn result_bytes_are_printed_exactly() {
    let node = Node::new().with_daemon();
    let (output, _) = shim(&cri_env("ADD"), &node.config(json!({"fake": "raw"})));
    assert_eq!(
        success(&output),
        b"  {\"cniVersion\":\"1.0.0\",\"ips\":[]}\n\n"
    );
}

#[test]
fn empty_result_prints_nothing() {
    let node = Node::new().with_daemon();
    let (output, _) = shim(&cri_env("DEL"), &node.config(json!({"fake": "nothing"})));
    assert_eq!(success(&output), b"");
    assert!(node.queued().is_empty());
}

#[test]
fn daemon_error_is_passed_through() {
    let node = Node::new().with_daemon();

    // No cniVersion from the daemon: the configuration's is echoed.
    let (output, _) = shim(&cri_env("ADD"), &node.config(json!({"fake": "error"})));
    assert_eq!(
        cni_error(&output),
        json!({
            "cniVersion": "0.4.0",
            "code": 100,
            "msg": "address pool exhausted",
            "details": "pool 10.244.1.0/24 has no free address",
        })
    );

    // The daemon's own cniVersion wins, and empty details are left out.
    let (output, _) = shim(
        &cri_env("CHECK"),
        &node.config(json!({"fake": "error-versioned"})),
    );
    assert_eq!(
        cni_error(&output),
        json!({"cniVersion": "1.0.0", "code": 3, "msg": "unknown container"})
    );
}

#[test]
fn absent_daemon_add_is_code_11_after_retrying() {
    let node = Node::new();
    let (output, _) = shim(&cri_env("ADD"), &node.config(json!({})));
    let error = cni_error(&output);
    assert_eq!(error["code"], 11);
    assert_eq!(error["cniVersion"], "0.4.0");
    let msg = error["msg"].as_str().unwrap();
    assert!(msg.contains(node.socket().to_str().unwrap()), "{msg}");
    assert!(msg.contains("No such file or directory"), "{msg}");
}

#[test]
fn add_connects_to_a_daemon_that_comes_up_late() {
    let node = Node::new();
    let socket = node.socket();
    let late = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        serve_fake(bind(&socket));
    });
    let (output, _) = shim(&cri_env("ADD"), &node.config(json!({})));
    late.join().unwrap();
    let echoed: Value = serde_json::from_slice(success(&output)).unwrap();
    assert_eq!(echoed["rpc"], "add");
}

#[test]
fn absent_daemon_status_is_code_50() {
    let node = Node::new();
    let (output, _) = shim(&cri_env("STATUS"), &node.config(json!({})));
    let error = cni_error(&output);
    assert_eq!(error["code"], 50);
    let msg = error["msg"].as_str().unwrap();
    assert!(
        msg.starts_with(&format!(
            "tetherd is not reachable on {}: ",
            node.socket().display()
        )),
        "{msg}"
    );
}

#[test]
fn absent_daemon_check_and_gc_are_code_11() {
    let node = Node::new();
    for command in ["CHECK", "GC"] {
        let (output, _) = shim(&cri_env(command), &node.config(json!({})));
        assert_eq!(cni_error(&output)["code"], 11, "{command}");
    }
    assert!(node.queued().is_empty());
}

#[test]
fn absent_daemon_del_is_queued_in_the_documented_format() {
    let node = Node::new();
    let env = [
        ("CNI_COMMAND", "DEL"),
        ("CNI_CONTAINERID", "default-c1"),
        ("CNI_NETNS", ""),
        ("CNI_IFNAME", "eth0"),
        ("CNI_ARGS", "IgnoreUnknown=1;K8S_POD_NAME=web"),
    ];
    let stdin = node.config(json!({"prevResult": {"cniVersion": "0.4.0", "ips": []}}));

    let (output, pid) = shim(&env, &stdin);

    assert_eq!(success(&output), b"");
    let names = node.queued();
    assert_eq!(names.len(), 1, "{names:?}");
    let name = &names[0];
    let (nanos, rest) = name.split_once('-').unwrap();
    assert_eq!(rest, format!("{pid}.json"));
    let nanos: u128 = nanos.parse().unwrap();

    let path = node.queue_dir().join(name);
    let content = std::fs::read_to_string(&path).unwrap();
    let expected = format!(
        concat!(
            r#"{{"version":1,"queuedAtUnixNanos":{},"command":"DEL","containerId":"default-c1","#,
            r#""netns":"","ifname":"eth0","args":"IgnoreUnknown=1;K8S_POD_NAME=web","path":"","#,
            r#""stdin":{},"present":["CNI_COMMAND","CNI_CONTAINERID","CNI_NETNS","CNI_IFNAME","CNI_ARGS"],"#,
            r#""pluginName":"tether"}}"#
        ),
        nanos,
        serde_json::to_string(std::str::from_utf8(&stdin).unwrap()).unwrap()
    );
    assert_eq!(content, expected);

    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&path), 0o600);
    assert_eq!(mode(&node.queue_dir()), 0o700);
}

#[test]
fn del_that_cannot_be_queued_is_code_11_naming_both_failures() {
    let node = Node::new();
    // A file where the queue should be: no queue can be created there.
    std::fs::write(node.queue_dir(), "").unwrap();
    let (output, _) = shim(&cri_env("DEL"), &node.config(json!({})));
    let error = cni_error(&output);
    assert_eq!(error["code"], 11);
    let msg = error["msg"].as_str().unwrap();
    assert!(msg.contains(node.socket().to_str().unwrap()), "{msg}");
    assert!(msg.contains("could not be queued"), "{msg}");
    assert!(msg.contains(node.queue_dir().to_str().unwrap()), "{msg}");
}

#[test]
fn refused_caller_gets_11_or_50_and_no_queued_del() {
    let node = Node::new().with_daemon();
    let denied = node.config(json!({"fake": "deny"}));
    for (command, code) in [
        ("ADD", 11),
        ("DEL", 11),
        ("CHECK", 11),
        ("GC", 11),
        ("STATUS", 50),
    ] {
        let (output, _) = shim(&cri_env(command), &denied);
        let error = cni_error(&output);
        assert_eq!(error["code"], code, "{command}");
        let msg = error["msg"].as_str().unwrap();
        assert!(msg.contains("refused this caller"), "{msg}");
    }
    assert!(node.queued().is_empty());
}

#[test]
fn connection_closed_at_once_counts_as_unreachable() {
    let node = Node::new().with_slamming_listener();
    for (command, code) in [("CHECK", 11), ("STATUS", 50), ("ADD", 11)] {
        let (output, _) = shim(&cri_env(command), &node.config(json!({})));
        assert_eq!(cni_error(&output)["code"], code, "{command}");
    }
    // Indistinguishable from a daemon that died mid-call: DEL is queued.
    let (output, _) = shim(&cri_env("DEL"), &node.config(json!({})));
    assert_eq!(success(&output), b"");
    assert_eq!(node.queued().len(), 1);
}

#[test]
fn an_answer_to_a_runtime_that_went_away_is_an_error_not_a_signal() {
    // The shim's C main ignores SIGPIPE, as the Rust runtime's start-up
    // would have. Its stdout is a pipe whose reading end is already
    // closed, so its answer meets EPIPE: exit 1, not a death by SIGPIPE.
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe(2) writes.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: both descriptors were just made by pipe(2) and are owned
    // here only: the reading end is closed, the writing end handed over.
    let (read, write) = unsafe {
        use std::os::fd::FromRawFd;
        (
            std::os::fd::OwnedFd::from_raw_fd(fds[0]),
            std::os::fd::OwnedFd::from_raw_fd(fds[1]),
        )
    };
    drop(read);
    let mut command = Command::new(env!("CARGO_BIN_EXE_tether"));
    // SAFETY: only signal(2), which is async-signal-safe, runs between
    // fork and exec.
    unsafe {
        command.pre_exec(|| {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
            Ok(())
        });
    }
    let status = command
        .env_clear()
        .env("CNI_COMMAND", "VERSION")
        .stdin(Stdio::null())
        .stdout(Stdio::from(write))
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert_eq!(status.signal(), None, "killed by a signal");
    assert_eq!(status.code(), Some(1));
}

#[test]
fn a_daemon_that_hangs_up_mid_request_is_an_error_not_a_signal() {
    // This daemon shuts its side for reading at once, then opens the
    // flow-control windows, so the shim's next write of a request larger
    // than the first window meets a peer that reads no more (EPIPE). The
    // shim runs with SIGPIPE at its default, as under a runtime: it must
    // report the daemon unreachable (11), not die by a signal.
    let node = Node::new();
    let listener = StdUnixListener::bind(node.socket()).unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let _ = conn.shutdown(std::net::Shutdown::Read);
            let mut frames = vec![0, 0, 0, 4, 0, 0, 0, 0, 0]; // SETTINGS
            for stream in [0u8, 1] {
                // WINDOW_UPDATE of 1 MiB on the connection and stream 1.
                frames.extend_from_slice(&[0, 0, 4, 8, 0, 0, 0, 0, stream, 0, 0x10, 0, 0]);
            }
            let _ = conn.write_all(&frames);
            std::thread::sleep(Duration::from_millis(300));
        }
    });
    let mut stdin = node.config(json!({ "pad": "" }));
    let pad = (1 << 20) - 64 - stdin.len();
    stdin = node.config(json!({ "pad": "p".repeat(pad) }));
    let (output, _) = shim(&cri_env("CHECK"), &stdin);
    assert_eq!(
        output.status.signal(),
        None,
        "killed by a signal; stderr {:?}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(cni_error(&output)["code"], 11);
}

#[test]
fn absent_daemon_del_goes_through_the_daemons_link_to_its_state_dir() {
    let node = Node::new();
    // What tetherd leaves behind when it stops: the path beside its socket
    // is a symlink to the queue in its state dir.
    let queue = node.state_dir().join("pending-del");
    std::fs::create_dir_all(&queue).unwrap();
    std::os::unix::fs::symlink(&queue, node.queue_dir()).unwrap();

    let (output, pid) = shim(&cri_env("DEL"), &node.config(json!({})));

    assert_eq!(success(&output), b"");
    let names: Vec<String> = std::fs::read_dir(&queue)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");
    assert!(names[0].ends_with(&format!("-{pid}.json")), "{names:?}");
}

#[test]
fn a_socket_of_the_wrong_type_is_code_7_for_every_verb_and_no_del_is_queued() {
    // With a daemon listening at the default socket or not, the shim must
    // not fall back to it: the configuration is wrong and says so.
    let node = Node::new().with_daemon();
    let mut config: Value = serde_json::from_slice(&node.config(json!({}))).unwrap();
    config["socket"] = json!(123);
    let stdin = serde_json::to_vec(&config).unwrap();
    for command in ["ADD", "DEL", "CHECK", "STATUS", "GC"] {
        let (output, _) = shim(&cri_env(command), &stdin);
        let error = cni_error(&output);
        assert_eq!(error["code"], 7, "{command}: {error}");
        let msg = error["msg"].as_str().unwrap();
        assert!(
            msg.contains("\"socket\"") && msg.contains("expected a string, got a number"),
            "{command}: {msg}"
        );
    }
    assert!(node.queued().is_empty());
}
