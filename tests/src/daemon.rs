//! A `tetherd` under test, in a node netns of its own.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::{tetherd_bin, Netns, TempDir};

/// The daemon's own debug logs, without h2's and tonic's frame dumps.
pub const DEFAULT_LOG_LEVEL: &str = "info,tetherd=debug";
/// How long [`Daemon::start`] waits for the socket to accept.
const READY_TIMEOUT: Duration = Duration::from_secs(15);
/// How long [`Daemon::stop`] waits after SIGTERM before SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// How much of the log a panic message quotes.
const LOG_TAIL_LINES: usize = 40;

/// How to start a [`Daemon`].
#[derive(Clone, Debug, Default)]
pub struct DaemonOpts {
    /// One `--pod-cidr` each (one IPv4 and/or one IPv6).
    pub pod_cidrs: Vec<String>,
    /// `--mtu`, if set.
    pub mtu: Option<u32>,
    /// `--log-level`; [`DEFAULT_LOG_LEVEL`] when unset.
    pub log_level: Option<String>,
    /// The binary; [`tetherd_bin`] when unset.
    pub bin: Option<PathBuf>,
    /// Appended to the command line as they are.
    pub extra_args: Vec<String>,
    /// `--check-vm-launchers`: off unless set, since the suites' VM pods
    /// are CNI calls with no pod or VirtualMachineInstance in the API (the
    /// test double of a launcher); a suite that makes both turns it on.
    /// Without `--kubeconfig` it changes nothing.
    pub check_vm_launchers: bool,
}

/// A running `tetherd`: its node netns, and a temp dir holding its socket
/// (`tetherd.sock`), state dir (`state/`) and log (`tetherd.log`).
///
/// Dropping it kills the daemon (SIGKILL to the child we spawned, then
/// reap), deletes the node netns with every host veth and route in it, and
/// removes the temp dir. If the thread is panicking, the log's tail is
/// printed first.
#[derive(Debug)]
pub struct Daemon {
    child: Option<Child>,
    args: Vec<String>,
    bin: PathBuf,
    socket: PathBuf,
    state_dir: PathBuf,
    log_path: PathBuf,
    // Dropped in this order, after the child is dead: netns, then dir.
    node: Netns,
    dir: TempDir,
}

impl Daemon {
    /// A daemon with these `--pod-cidr`s and extra arguments, the rest as
    /// [`DaemonOpts::default`] has it.
    pub fn with_cidrs(cidrs: &[&str], extra_args: &[&str]) -> Daemon {
        Daemon::start(DaemonOpts {
            pod_cidrs: cidrs.iter().map(|c| c.to_string()).collect(),
            extra_args: extra_args.iter().map(|a| a.to_string()).collect(),
            ..DaemonOpts::default()
        })
    }

    /// Starts `tetherd` in a new node netns and waits until its socket
    /// accepts; panics with the log's tail if it does not within 15 s.
    pub fn start(opts: DaemonOpts) -> Daemon {
        Daemon::start_in(Netns::new("node"), opts)
    }

    /// Like [`Daemon::start`], in a node netns the test prepared (for
    /// example one already wired to a fabric). The daemon takes it over and
    /// deletes it on drop.
    pub fn start_in(node: Netns, opts: DaemonOpts) -> Daemon {
        let dir = TempDir::new("d");
        let socket = dir.path().join("tetherd.sock");
        let state_dir = dir.path().join("state");
        std::fs::create_dir(&state_dir)
            .unwrap_or_else(|e| panic!("creating {}: {e}", state_dir.display()));
        let log_path = dir.path().join("tetherd.log");

        let mut args = vec![
            "--node-name".to_owned(),
            node.name().to_owned(),
            "--socket".to_owned(),
            socket.display().to_string(),
            "--state-dir".to_owned(),
            state_dir.display().to_string(),
            "--log-level".to_owned(),
            opts.log_level
                .unwrap_or_else(|| DEFAULT_LOG_LEVEL.to_owned()),
        ];
        for cidr in &opts.pod_cidrs {
            args.extend(["--pod-cidr".to_owned(), cidr.clone()]);
        }
        if let Some(mtu) = opts.mtu {
            args.extend(["--mtu".to_owned(), mtu.to_string()]);
        }
        if !opts.check_vm_launchers {
            args.extend(["--check-vm-launchers".to_owned(), "false".to_owned()]);
        }
        args.extend(opts.extra_args);

        let mut daemon = Daemon {
            child: None,
            args,
            bin: opts.bin.unwrap_or_else(tetherd_bin),
            socket,
            state_dir,
            log_path,
            node,
            dir,
        };
        daemon.spawn_and_wait();
        daemon
    }

    /// The node netns the daemon runs in.
    pub fn node(&self) -> &Netns {
        &self.node
    }

    /// The daemon's `--node-name` (the node netns's name).
    pub fn node_name(&self) -> &str {
        self.node.name()
    }

    /// The unix socket the shim talks to.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The daemon's `--state-dir`.
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// Gives the daemon another `--state-dir` from its next start on, as an
    /// operator who moves the state would. The daemon must be stopped.
    pub fn set_state_dir(&mut self, dir: PathBuf) {
        assert!(self.child.is_none(), "set_state_dir: stop the daemon first");
        let at = self
            .args
            .iter()
            .position(|a| a == "--state-dir")
            .expect("--state-dir is always given");
        self.args[at + 1] = dir.display().to_string();
        self.state_dir = dir;
    }

    /// Gives `flag` the value `value` from the daemon's next start on: the
    /// value after the flag's last occurrence is replaced, or both are
    /// appended. The daemon must be stopped.
    pub fn set_arg(&mut self, flag: &str, value: &str) {
        assert!(self.child.is_none(), "set_arg: stop the daemon first");
        match self.args.iter().rposition(|a| a == flag) {
            Some(at) if at + 1 < self.args.len() => self.args[at + 1] = value.to_owned(),
            _ => self.args.extend([flag.to_owned(), value.to_owned()]),
        }
    }

    /// The temp dir holding socket, state dir and log.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The daemon's PID while the harness has not reaped it.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// True while the daemon process is alive.
    pub fn is_running(&mut self) -> bool {
        match &mut self.child {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// The whole log: stdout and stderr of every run so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// A netconf for this daemon: `cniVersion`, `name`, `type: tether`,
    /// and `socket`. Add fields (`mtu`, ...) as the test needs.
    pub fn netconf(&self, cni_version: &str, name: &str) -> Value {
        json!({
            "cniVersion": cni_version,
            "name": name,
            "type": "tether",
            "socket": self.socket.display().to_string(),
        })
    }

    /// Kills the daemon with SIGKILL (a crash) and reaps it.
    pub fn kill9(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("kill9: the daemon is not running");
        // Not reaped yet, so the PID is still our child's.
        let _ = child.kill();
        child.wait().expect("waiting for tetherd")
    }

    /// Stops the daemon with SIGTERM and waits for it to exit; panics (after
    /// a SIGKILL) if it has not within 10 s.
    pub fn stop(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("stop: the daemon is not running");
        if let Ok(Some(status)) = child.try_wait() {
            return status;
        }
        // SAFETY: kill(2) on the PID of our own unreaped child.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + STOP_TIMEOUT;
        loop {
            match child.try_wait() {
                Ok(Some(status)) => return status,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!(
                        "tetherd did not exit within {STOP_TIMEOUT:?} of SIGTERM\n{}",
                        self.log_tail()
                    );
                }
            }
        }
    }

    /// Starts the daemon again with the same arguments, socket and state
    /// dir (stopping it first with SIGTERM if it still runs), and waits
    /// until it serves.
    pub fn restart(&mut self) {
        if self.child.is_some() {
            self.stop();
        }
        self.spawn_and_wait();
    }

    fn spawn_and_wait(&mut self) {
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .unwrap_or_else(|e| panic!("opening {}: {e}", self.log_path.display()));
        let _ = writeln!(
            log,
            "=== harness: ip netns exec {} {} {}",
            self.node.name(),
            self.bin.display(),
            self.args.join(" ")
        );
        let log_err = log.try_clone().expect("duplicating the log fd");
        // `ip netns exec` execs the program, so the child's PID is tetherd's.
        let child = Command::new("ip")
            .args(["netns", "exec", self.node.name()])
            .arg(&self.bin)
            .args(&self.args)
            // Plain text in the log file, not colour codes.
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err))
            .spawn()
            .unwrap_or_else(|e| panic!("spawning tetherd ({}): {e}", self.bin.display()));
        self.child = Some(child);
        self.wait_ready();
    }

    /// Waits until the socket accepts a connection. tetherd creates it only
    /// once it serves; a stale file left by a killed daemon refuses.
    fn wait_ready(&mut self) {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                self.child = None;
                panic!(
                    "tetherd exited ({status}) before serving\n{}",
                    self.log_tail()
                );
            }
            if UnixStream::connect(&self.socket).is_ok() {
                return;
            }
            if Instant::now() >= deadline {
                panic!(
                    "tetherd did not accept on {} within {READY_TIMEOUT:?}\n{}",
                    self.socket.display(),
                    self.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn log_tail(&self) -> String {
        crate::log_tail(&self.log_path, LOG_TAIL_LINES)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "harness: tetherd in {}:\n{}",
                self.node.name(),
                self.log_tail()
            );
        }
        if let Some(mut child) = self.child.take() {
            // Not reaped yet, so the PID is still our child's.
            let _ = child.kill();
            let _ = child.wait();
        }
        // The fields drop next: the node netns (and with it every host veth
        // and route tetherd made), then the temp dir.
    }
}
