//! One CNI plugin invocation, the way a runtime makes it: `CNI_*`
//! environment, the netconf on stdin, the result or error on stdout.

use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::Netns;

/// Where Debian's `containernetworking-plugins` installs the reference
/// plugins (`ptp`, `bridge`, `host-local`, `portmap`, ...).
pub const REF_PLUGIN_DIR: &str = "/usr/lib/cni";

/// How long [`cni()`] lets a plugin run before killing it. Above the shim's
/// own deadlines (ADD about 45 s), so it only fires on a real hang.
pub const CNI_TIMEOUT: Duration = Duration::from_secs(60);

/// The path of reference plugin `name` in [`REF_PLUGIN_DIR`].
pub fn ref_plugin(name: &str) -> PathBuf {
    Path::new(REF_PLUGIN_DIR).join(name)
}

/// The environment of one invocation. `None` leaves the variable unset, so
/// tests can check how a plugin handles a missing one; `Some("")` sets it
/// empty (what `ctr` does with `CNI_NETNS` on DEL).
#[derive(Clone, Debug, Default)]
pub struct CniEnv {
    /// `CNI_COMMAND`: ADD, DEL, CHECK, GC, STATUS or VERSION.
    pub command: Option<String>,
    /// `CNI_CONTAINERID`.
    pub container_id: Option<String>,
    /// `CNI_NETNS`: the pod netns path.
    pub netns: Option<String>,
    /// `CNI_IFNAME`: the interface name inside the pod.
    pub ifname: Option<String>,
    /// `CNI_ARGS`: `K=V;K=V`.
    pub args: Option<String>,
    /// `CNI_PATH`: where chained and IPAM plugins are looked up.
    pub path: Option<String>,
    /// Any other variables to set.
    pub extra: Vec<(String, String)>,
}

impl CniEnv {
    /// The common case: `command` for `container_id` in `netns`, ifname
    /// `eth0`, `CNI_PATH` the reference plugin dir, no `CNI_ARGS`.
    pub fn new(command: &str, container_id: &str, netns: &Netns) -> CniEnv {
        CniEnv {
            command: Some(command.to_owned()),
            container_id: Some(container_id.to_owned()),
            netns: Some(netns.path().display().to_string()),
            ifname: Some("eth0".to_owned()),
            args: None,
            path: Some(REF_PLUGIN_DIR.to_owned()),
            extra: Vec::new(),
        }
    }

    fn apply(&self, cmd: &mut Command) {
        let vars = [
            ("CNI_COMMAND", &self.command),
            ("CNI_CONTAINERID", &self.container_id),
            ("CNI_NETNS", &self.netns),
            ("CNI_IFNAME", &self.ifname),
            ("CNI_ARGS", &self.args),
            ("CNI_PATH", &self.path),
        ];
        for (key, value) in vars {
            if let Some(value) = value {
                cmd.env(key, value);
            }
        }
        cmd.envs(self.extra.iter().map(|(k, v)| (k, v)));
    }
}

/// What one invocation returned.
#[derive(Clone, Debug)]
pub struct CniOutput {
    /// The exit code; 128 + signal if the plugin was killed (137 when the
    /// harness killed it on timeout).
    pub status: i32,
    /// Standard output, lossily decoded.
    pub stdout: String,
    /// `stdout` parsed as JSON, when it is JSON: the result on success, the
    /// `{code, msg, details}` error otherwise.
    pub json: Option<Value>,
    /// Standard error, lossily decoded (with a harness note on timeout).
    pub stderr: String,
    /// From just before the spawn to the reaping of the process.
    pub elapsed: Duration,
}

impl CniOutput {
    /// Exit status 0.
    pub fn success(&self) -> bool {
        self.status == 0
    }

    /// Panics with stdout and stderr unless the call succeeded.
    pub fn assert_success(&self) -> &CniOutput {
        if !self.success() {
            panic!("CNI call failed: {self}");
        }
        self
    }

    /// The JSON result of a successful call; panics otherwise.
    pub fn result(&self) -> &Value {
        self.assert_success();
        match &self.json {
            Some(json) => json,
            None => panic!("CNI call succeeded without a JSON result: {self}"),
        }
    }

    /// The CNI error code (`code` of the JSON error), if the call failed
    /// with one.
    pub fn error_code(&self) -> Option<u64> {
        if self.success() {
            return None;
        }
        self.json.as_ref()?.get("code")?.as_u64()
    }
}

impl std::fmt::Display for CniOutput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "status {} after {:?}\nstdout: {}\nstderr: {}",
            self.status,
            self.elapsed,
            self.stdout.trim(),
            self.stderr.trim()
        )
    }
}

/// Runs plugin `bin` once with `env` and `stdin`, in the calling thread's
/// netns (see [`Netns::run`]), killing it after [`CNI_TIMEOUT`].
///
/// The child gets only `PATH` from our environment plus the `CNI_*`
/// variables, as a runtime would give it.
pub fn cni(bin: &Path, env: &CniEnv, stdin: &[u8]) -> CniOutput {
    cni_with_timeout(bin, env, stdin, CNI_TIMEOUT)
}

/// Spawns `cmd`, retrying for up to a second while exec says ETXTBSY. A
/// plugin file a test has just written can still be open for writing in a
/// child that another test thread forked at that moment (the descriptor is
/// close-on-exec, but open until that child execs); it goes at once.
fn spawn_retrying_busy(cmd: &mut Command) -> std::io::Result<std::process::Child> {
    let mut tries = 0;
    loop {
        match cmd.spawn() {
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && tries < 100 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
            other => return other,
        }
    }
}

/// [`cni()`] with a timeout of your choice.
pub fn cni_with_timeout(bin: &Path, env: &CniEnv, stdin: &[u8], timeout: Duration) -> CniOutput {
    let mut cmd = Command::new(bin);
    cmd.env_clear()
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(path) = std::env::var_os("PATH") {
        cmd.env("PATH", path);
    }
    env.apply(&mut cmd);

    let start = Instant::now();
    let mut child = spawn_retrying_busy(&mut cmd)
        .unwrap_or_else(|e| panic!("spawning CNI plugin {}: {e}", bin.display()));
    if let Some(mut pipe) = child.stdin.take() {
        // A plugin may exit without reading its stdin (VERSION, a bad env):
        // a broken pipe here is its answer, not our failure.
        if let Err(e) = pipe.write_all(stdin) {
            if e.kind() != ErrorKind::BrokenPipe {
                panic!("writing the netconf to {}: {e}", bin.display());
            }
        }
    }
    let (stdout, mut stderr, timed_out) = read_until_eof(&mut child, start + timeout);
    if timed_out {
        // The child is not reaped yet, so its PID is still ours to signal.
        let _ = child.kill();
        stderr.extend_from_slice(
            format!("\n[harness: killed after {timeout:?} without exiting]").as_bytes(),
        );
    }
    let status = child
        .wait()
        .unwrap_or_else(|e| panic!("waiting for {}: {e}", bin.display()));
    let elapsed = start.elapsed();

    let stdout = String::from_utf8_lossy(&stdout).into_owned();
    let json = serde_json::from_str(&stdout).ok();
    CniOutput {
        status: exit_code(status),
        stdout,
        json,
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
        elapsed,
    }
}

fn exit_code(status: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

/// One of the child's output pipes while it is being drained.
struct Pipe {
    file: File,
    data: Vec<u8>,
    open: bool,
}

/// Reads the child's stdout and stderr until both are closed or `deadline`
/// passes. Returns (stdout, stderr, timed out). One thread, poll(2): no
/// helper thread whose start-up would land in the timed region.
fn read_until_eof(child: &mut Child, deadline: Instant) -> (Vec<u8>, Vec<u8>, bool) {
    let mut pipes = [
        child.stdout.take().map(|p| File::from(OwnedFd::from(p))),
        child.stderr.take().map(|p| File::from(OwnedFd::from(p))),
    ]
    .map(|file| {
        let open = file.is_some();
        let file = file.unwrap_or_else(|| File::open("/dev/null").expect("/dev/null opens"));
        Pipe {
            file,
            data: Vec::new(),
            open,
        }
    });
    let mut buf = [0u8; 16 * 1024];
    while pipes.iter().any(|p| p.open) {
        let now = Instant::now();
        if now >= deadline {
            let [out, err] = pipes.map(|p| p.data);
            return (out, err, true);
        }
        let wait_ms = (deadline - now).as_millis().clamp(1, i32::MAX as u128) as i32;
        let mut fds = pipes.each_ref().map(|p| libc::pollfd {
            // A negative fd is ignored by poll(2).
            fd: if p.open { p.file.as_raw_fd() } else { -1 },
            events: libc::POLLIN,
            revents: 0,
        });
        // SAFETY: fds is a valid array of pollfd of the given length.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait_ms) };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == ErrorKind::Interrupted {
                continue;
            }
            panic!("poll on plugin pipes: {e}");
        }
        for (pipe, pfd) in pipes.iter_mut().zip(&fds) {
            if pfd.revents == 0 {
                continue;
            }
            // Readable or hung up: this read does not block.
            match pipe.file.read(&mut buf) {
                Ok(0) => pipe.open = false,
                Ok(n) => pipe.data.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => panic!("reading plugin output: {e}"),
            }
        }
    }
    let [out, err] = pipes.map(|p| p.data);
    (out, err, false)
}

fn call_bin(
    bin: &Path,
    command: &str,
    netconf: &Value,
    container_id: &str,
    netns: &Netns,
) -> CniOutput {
    let stdin = serde_json::to_vec(netconf).expect("a JSON value serializes");
    cni(bin, &CniEnv::new(command, container_id, netns), &stdin)
}

/// ADD of `container_id` in `netns` as `eth0` with `netconf` (see
/// [`CniEnv::new`] for the rest of the environment).
pub fn add(bin: &Path, netconf: &Value, container_id: &str, netns: &Netns) -> CniOutput {
    call_bin(bin, "ADD", netconf, container_id, netns)
}

/// DEL of `container_id` in `netns` as `eth0` with `netconf`.
pub fn del(bin: &Path, netconf: &Value, container_id: &str, netns: &Netns) -> CniOutput {
    call_bin(bin, "DEL", netconf, container_id, netns)
}

/// CHECK of `container_id` in `netns` as `eth0` with `netconf`, which must
/// carry the ADD's result as `prevResult`.
pub fn check(bin: &Path, netconf: &Value, container_id: &str, netns: &Netns) -> CniOutput {
    call_bin(bin, "CHECK", netconf, container_id, netns)
}

/// One call of tether, the plugin, as a runtime makes it: `verb` for
/// container `cid` on interface eth0 of `netns`, `conf` on stdin.
pub fn call(verb: &str, conf: &Value, cid: &str, netns: Option<&Netns>) -> CniOutput {
    let env = CniEnv {
        command: Some(verb.to_owned()),
        container_id: Some(cid.to_owned()),
        netns: netns.map(|n| n.path().display().to_string()),
        ifname: Some("eth0".to_owned()),
        ..CniEnv::default()
    };
    let stdin = serde_json::to_vec(conf).expect("JSON serializes");
    cni(&crate::tether_bin(), &env, &stdin)
}

/// `conf` with `prevResult` set to `prev`, as a runtime sends CHECK and DEL.
pub fn with_prev(conf: &Value, prev: &Value) -> Value {
    let mut conf = conf.clone();
    conf["prevResult"] = prev.clone();
    conf
}
