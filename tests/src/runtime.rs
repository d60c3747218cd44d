//! What the runtime suites (`runtimes.rs`, `chaining.rs`) share on top of the
//! rest of the harness: plugins that record how a runtime called them, a
//! busybox rootfs, bounded commands, and the "nothing left behind" checks.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::{wait_until, Daemon, Netns, ROUTE_PROTOCOL};
use serde_json::Value;

/// Where `tests/setup.sh` installs grpcurl (built by `tests/k8s/build.sh grpcurl`).
pub const GRPCURL: &str = "/usr/local/bin/grpcurl";

/// Writes an executable `sh` script at `path`.
pub fn write_script(path: &Path, body: &str) {
    std::fs::write(path, body).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", path.display()));
}

/// Installs at `path` a plugin that records each call (environment, stdin,
/// stdout, exit code) under `capture_dir`, then runs `real` with the same
/// environment and stdin and passes its stdout, stderr and exit code on.
///
/// With `netns`, `real` runs inside that netns (`nsenter --net=`): how the
/// reference plugins that change the host side (portmap, ptp) are kept in
/// the test's node netns instead of the machine's.
pub fn install_recording_plugin(
    path: &Path,
    real: &Path,
    netns: Option<&Path>,
    capture_dir: &Path,
) {
    let enter = match netns {
        Some(ns) => format!("nsenter --net={} ", ns.display()),
        None => String::new(),
    };
    let script = format!(
        r#"#!/bin/sh
# Written by tether's runtime tests: record the call, then run the plugin.
c={capture}/$(date +%s%N)-$$-${{CNI_COMMAND:-none}}
env > "$c.env"
cat > "$c.stdin"
{enter}{real} < "$c.stdin" > "$c.stdout"
rc=$?
echo "$rc" > "$c.rc"
cat "$c.stdout"
exit "$rc"
"#,
        capture = capture_dir.display(),
        real = real.display(),
    );
    write_script(path, &script);
}

/// One recorded plugin call (see [`install_recording_plugin`]).
#[derive(Clone, Debug)]
pub struct Call {
    /// Every environment variable the plugin saw.
    pub env: BTreeMap<String, String>,
    /// The netconf on stdin, raw.
    pub stdin: String,
    /// What the plugin printed on stdout.
    pub stdout: String,
    /// The plugin's exit code; `None` if it had not finished.
    pub rc: Option<i32>,
}

impl Call {
    /// `CNI_COMMAND`.
    pub fn command(&self) -> &str {
        self.var("CNI_COMMAND")
    }

    /// An environment variable, `""` when unset.
    pub fn var(&self, key: &str) -> &str {
        self.env.get(key).map(String::as_str).unwrap_or("")
    }

    /// The netconf parsed; panics if it is not JSON.
    pub fn netconf(&self) -> Value {
        serde_json::from_str(&self.stdin).unwrap_or_else(|e| {
            panic!(
                "stdin of {} is not JSON ({e}): {}",
                self.command(),
                self.stdin
            )
        })
    }

    /// The stdout parsed, when it is JSON.
    pub fn output(&self) -> Option<Value> {
        serde_json::from_str(&self.stdout).ok()
    }

    /// The `CNI_*` variables and the stdin, for a report.
    pub fn describe(&self) -> String {
        let vars: Vec<String> = self
            .env
            .iter()
            .filter(|(k, _)| k.starts_with("CNI_"))
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        format!(
            "{} (rc {:?})\n  env: {}\n  stdin: {}\n  stdout: {}",
            self.command(),
            self.rc,
            vars.join(" "),
            self.stdin.trim(),
            self.stdout.trim()
        )
    }
}

/// The calls recorded in `capture_dir`, oldest first.
pub fn recorded_calls(capture_dir: &Path) -> Vec<Call> {
    let mut stems: Vec<String> = std::fs::read_dir(capture_dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", capture_dir.display()))
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|f| f.strip_suffix(".env").map(str::to_owned))
        .collect();
    // date +%s%N has a fixed width for the next few centuries: names sort
    // by time.
    stems.sort();
    stems
        .iter()
        .map(|stem| {
            let read = |ext: &str| {
                std::fs::read_to_string(capture_dir.join(format!("{stem}.{ext}")))
                    .unwrap_or_default()
            };
            let env = read("env")
                .lines()
                .filter_map(|l| l.split_once('='))
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect();
            Call {
                env,
                stdin: read("stdin"),
                stdout: read("stdout"),
                rc: read("rc").trim().parse().ok(),
            }
        })
        .collect()
}

/// Prints every recorded call (shown with `--nocapture`, and on failure).
pub fn print_calls(who: &str, calls: &[Call]) {
    for (i, call) in calls.iter().enumerate() {
        eprintln!("[{who} call {i}] {}", call.describe());
    }
}

/// Runs `cmd` with stdin closed, killing it after `timeout`; returns its
/// output whatever its exit status (a killed command has no exit code).
pub fn run_bounded(cmd: &mut Command, timeout: Duration) -> Output {
    let what = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawning {what}: {e}"));
    let mut out_pipe = child.stdout.take().expect("piped stdout");
    let mut err_pipe = child.stderr.take().expect("piped stderr");
    let out_reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = out_pipe.read_to_end(&mut buf);
        buf
    });
    let err_reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = err_pipe.read_to_end(&mut buf);
        buf
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                // Not reaped yet: the PID is still our child's.
                let _ = child.kill();
                let status = child
                    .wait()
                    .unwrap_or_else(|e| panic!("reaping {what}: {e}"));
                eprintln!("killed after {timeout:?}: {what}");
                break status;
            }
            Err(e) => panic!("waiting for {what}: {e}"),
        }
    };
    // A grandchild that inherited the pipes could keep them open: the
    // readers are detached rather than joined if they are not done soon.
    let join = |h: std::thread::JoinHandle<Vec<u8>>| {
        let until = Instant::now() + Duration::from_secs(5);
        while !h.is_finished() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        if h.is_finished() {
            h.join().unwrap_or_default()
        } else {
            Vec::new()
        }
    };
    Output {
        status,
        stdout: join(out_reader),
        stderr: join(err_reader),
    }
}

/// [`run_bounded`], panicking with stdout and stderr unless it succeeds;
/// returns stdout.
pub fn run_ok(cmd: &mut Command, timeout: Duration) -> String {
    let what = format!("{cmd:?}");
    let out = run_bounded(cmd, timeout);
    if !out.status.success() {
        panic!(
            "{what} failed ({}):\nstdout: {}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Polls `probe` every 50 ms until it returns `Some`, or panics with `what`
/// after `timeout`.
pub fn wait_for<T>(what: &str, timeout: Duration, mut probe: impl FnMut() -> Option<T>) -> T {
    // wait_until stops at the first `Some`; `None` means time ran out.
    let mut found = None;
    wait_until(timeout, || {
        found = probe();
        found.is_some()
    });
    found.unwrap_or_else(|| panic!("timed out after {timeout:?} waiting for {what}"))
}

/// Fills `root` with a minimal busybox-static system: `/bin/busybox`, one
/// symlink per applet (`ip`, `ping`, `sleep`, `sh`, ...), and the empty
/// mount points a runtime expects.
pub fn busybox_rootfs(root: &Path) {
    let bin = root.join("bin");
    for dir in ["bin", "dev", "proc", "sys", "etc", "tmp", "run"] {
        std::fs::create_dir_all(root.join(dir))
            .unwrap_or_else(|e| panic!("creating {}/{dir}: {e}", root.display()));
    }
    // busybox-static's binary, not a dynamically linked busybox the machine
    // might also have: the rootfs has no libc.
    let source = Path::new("/bin/busybox");
    std::fs::copy(source, bin.join("busybox")).unwrap_or_else(|e| {
        panic!(
            "copying {} (apt-get install busybox-static): {e}",
            source.display()
        )
    });
    let list = run_ok(Command::new(source).arg("--list"), Duration::from_secs(10));
    for applet in list
        .lines()
        .map(str::trim)
        .filter(|a| !a.is_empty() && *a != "busybox")
    {
        let link = bin.join(applet);
        if !link.exists() {
            symlink("busybox", &link).unwrap_or_else(|e| panic!("linking {}: {e}", link.display()));
        }
    }
    std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/:/bin/sh\n")
        .unwrap_or_else(|e| panic!("writing etc/passwd: {e}"));
    std::fs::write(root.join("etc/group"), "root:x:0:\n")
        .unwrap_or_else(|e| panic!("writing etc/group: {e}"));
}

/// The first pod address of a CNI result (`ips[0].address` without its
/// prefix length).
pub fn result_ip(result: &Value) -> String {
    let address = result["ips"][0]["address"]
        .as_str()
        .unwrap_or_else(|| panic!("CNI result without ips[0].address: {result}"));
    address.split('/').next().unwrap_or(address).to_owned()
}

/// The host-side interface of a CNI result: the one without a sandbox.
pub fn result_host_ifname(result: &Value) -> Option<String> {
    result["interfaces"]
        .as_array()?
        .iter()
        .find(|i| {
            i.get("sandbox")
                .and_then(Value::as_str)
                .unwrap_or("")
                .is_empty()
        })
        .and_then(|i| i["name"].as_str().map(str::to_owned))
}

/// What tether still holds in `node`: its host veths (prefix `tth`) and its
/// routes (protocol 201), as readable strings. Empty means clean.
pub fn node_leftovers(node: &Netns) -> Vec<String> {
    let mut left: Vec<String> = node
        .link_names()
        .into_iter()
        .filter(|name| name.starts_with("tth"))
        .map(|name| format!("link {name}"))
        .collect();
    for route in node.routes_with_protocol(ROUTE_PROTOCOL) {
        left.push(format!("route {route}"));
    }
    left
}

/// The daemon's attachments of CNI network `network`, read through its admin
/// API with grpcurl (reflection), as JSON objects.
pub fn attachments(daemon: &Daemon, network: &str) -> Vec<Value> {
    assert!(
        Path::new(GRPCURL).exists(),
        "{GRPCURL} is missing: run tests/setup.sh (as root) first"
    );
    let request = serde_json::json!({ "network": network }).to_string();
    let out = run_ok(
        Command::new(GRPCURL).args([
            "-plaintext",
            "-unix",
            "-max-time",
            "10",
            "-d",
            &request,
            &daemon.socket().display().to_string(),
            "tether.admin.v1.Admin/ListAttachments",
        ]),
        Duration::from_secs(15),
    );
    let reply: Value = serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("grpcurl reply is not JSON ({e}): {out}"));
    reply["attachments"].as_array().cloned().unwrap_or_default()
}

/// The argv that pings `ip` with `ping` (a path, or a name on PATH) and
/// succeeds on the first reply within 5 s.
pub fn ping_argv(ping: &str, ip: &str) -> Vec<String> {
    [ping, "-c", "1", "-w", "5", ip]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

/// Files of libcni's result cache (`/var/lib/cni/results`) that belong to
/// network `network`.
pub fn libcni_cache_files(cache_dir: &Path, network: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(cache_dir.join("results")) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|f| f.to_str())
                .is_some_and(|f| f.starts_with(&format!("{network}-")))
        })
        .collect()
}

/// The machine-wide paths the runtimes write to whatever their configuration
/// says, claimed by one test at a time: containerd's shim sockets
/// (`/run/containerd/s`), runc's state root as podman runs it (`/run/runc`),
/// libcni's default result cache (`/var/lib/cni/results`), the
/// containers/image blob-info cache that `podman import` updates, and the
/// CNI dirs `ctr` reads.
///
/// Holds an exclusive `flock` so that no two runtime tests (threads or
/// processes) share them, and on drop removes what did not exist when it
/// was claimed: files, then directories if they are empty by then.
pub struct MachinePaths {
    created: Vec<PathBuf>,
    _lock: std::fs::File,
}

impl MachinePaths {
    /// Waits for the lock, then notes which of `paths` (and their parents)
    /// are missing.
    pub fn claim(paths: &[&str]) -> MachinePaths {
        use std::os::fd::AsRawFd;
        let lock_path = Path::new("/run/lock/tether-e2e-runtimes.lock");
        let lock = std::fs::File::create(lock_path)
            .unwrap_or_else(|e| panic!("creating {}: {e}", lock_path.display()));
        // SAFETY: flock on an fd we own; blocks until no other runtime test
        // holds the machine paths.
        let rc = unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) };
        assert_eq!(
            rc,
            0,
            "flock {}: {}",
            lock_path.display(),
            std::io::Error::last_os_error()
        );
        let mut created = Vec::new();
        for path in paths {
            // Deepest first, so that drop can remove in order.
            let mut p = Some(Path::new(path));
            while let Some(missing) = p.filter(|p| !p.exists()) {
                if !created.iter().any(|c: &PathBuf| c == missing) {
                    created.push(missing.to_owned());
                }
                p = missing.parent();
            }
        }
        created.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        MachinePaths {
            created,
            _lock: lock,
        }
    }
}

impl Drop for MachinePaths {
    fn drop(&mut self) {
        for path in &self.created {
            let result = if path.is_dir() {
                std::fs::remove_dir(path)
            } else {
                std::fs::remove_file(path)
            };
            match result {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => eprintln!("cleanup: removing {}: {e}", path.display()),
            }
        }
    }
}
