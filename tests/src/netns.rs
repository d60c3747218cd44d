//! Named network namespaces (`ip netns`), owned by a guard.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

use crate::{unique_name, wait_until};
use std::net::IpAddr;
use std::time::Duration;

/// An address family, for [`Netns::routes`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// IPv4 (`ip -4`).
    V4,
    /// IPv6 (`ip -6`).
    V6,
}

/// A network namespace at `/run/netns/<name>`, created by [`Netns::new`] and
/// deleted (`ip netns del`) when dropped.
///
/// Deleting it also deletes everything inside: its veths (and their peers,
/// wherever they are), addresses and routes. Processes still running inside
/// keep it alive in the kernel but are not touched.
#[derive(Debug)]
pub struct Netns {
    name: String,
    path: PathBuf,
}

impl Netns {
    /// Creates the netns `<run_prefix><tag><n>` with `lo` up; panics if it
    /// cannot.
    pub fn new(tag: &str) -> Netns {
        let name = unique_name(tag);
        run_ok(Command::new("ip").args(["netns", "add", &name]));
        // From here on the guard exists, so a failure below still cleans up.
        let ns = Netns {
            path: Path::new("/run/netns").join(&name),
            name,
        };
        run_ok(Command::new("ip").args(["-n", &ns.name, "link", "set", "lo", "up"]));
        ns
    }

    /// Names the netns process `pid` is in `<run_prefix><tag><n>`
    /// (`ip netns attach`): a netns someone else made (a pod's, made by
    /// containerd in a node's own mount namespace) becomes one that
    /// [`Netns::exec`], [`Netns::run`] and the harness's QEMU guests can
    /// enter. Dropping it (`ip netns del`) only takes the name away: the
    /// netns lives on as long as its processes do.
    pub fn attach(tag: &str, pid: i32) -> Netns {
        let name = unique_name(tag);
        run_ok(Command::new("ip").args(["netns", "attach", &name, &pid.to_string()]));
        Netns {
            path: Path::new("/run/netns").join(&name),
            name,
        }
    }

    /// The name, as `ip netns list` shows it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `/run/netns/<name>`, the value for `CNI_NETNS`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `argv` inside the netns (`ip netns exec`) and returns its output,
    /// whatever its exit status.
    pub fn exec(&self, argv: &[&str]) -> Output {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name]).args(argv);
        cmd.output()
            .unwrap_or_else(|e| panic!("spawning `ip netns exec {} {argv:?}`: {e}", self.name))
    }

    /// Like [`Netns::exec`], but panics with the command's stderr unless it
    /// succeeds; returns its stdout.
    pub fn exec_ok(&self, argv: &[&str]) -> String {
        let out = self.exec(argv);
        check_output(&format!("in netns {}: {argv:?}", self.name), &out);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `ip -n <name> -j <args>`, parsed; panics on failure.
    pub fn ip_json(&self, args: &[&str]) -> Vec<Value> {
        let out = run_ok(Command::new("ip").args(["-n", &self.name, "-j"]).args(args));
        let text = String::from_utf8_lossy(&out.stdout);
        if text.trim().is_empty() {
            return Vec::new();
        }
        match serde_json::from_str(&text) {
            Ok(Value::Array(items)) => items,
            Ok(other) => panic!("ip {args:?} in {}: not a JSON array: {other}", self.name),
            Err(e) => panic!("ip {args:?} in {}: bad JSON ({e}): {text}", self.name),
        }
    }

    /// The links (`ip -j link show`).
    pub fn links(&self) -> Vec<Value> {
        self.ip_json(&["link", "show"])
    }

    /// The names of the links (`ifname` of [`Netns::links`]).
    pub fn link_names(&self) -> Vec<String> {
        self.links()
            .iter()
            .filter_map(|l| l["ifname"].as_str().map(str::to_owned))
            .collect()
    }

    /// True if a link named `ifname` is here.
    pub fn has_link(&self, ifname: &str) -> bool {
        self.link_names().iter().any(|n| n == ifname)
    }

    /// The links with their addresses (`ip -j addr show`).
    pub fn addrs(&self) -> Vec<Value> {
        self.ip_json(&["addr", "show"])
    }

    /// The addresses on `ifname` as `"ip/prefixlen"` strings, both families,
    /// link-local ones included.
    pub fn addrs_of(&self, ifname: &str) -> Vec<String> {
        self.ip_json(&["addr", "show", "dev", ifname])
            .iter()
            .flat_map(|l| l["addr_info"].as_array().cloned().unwrap_or_default())
            .filter_map(|a| Some(format!("{}/{}", a["local"].as_str()?, a["prefixlen"])))
            .collect()
    }

    /// The routes of the main table (`ip -j -4|-6 route show`).
    pub fn routes(&self, family: Family) -> Vec<Value> {
        let fam = match family {
            Family::V4 => "-4",
            Family::V6 => "-6",
        };
        self.ip_json(&[fam, "route", "show"])
    }

    /// The routes of the main table marked with `protocol` (`proto N`),
    /// IPv4 then IPv6. `ip -j` prints a protocol without a name as a
    /// string, so both forms match.
    pub fn routes_with_protocol(&self, protocol: u8) -> Vec<Value> {
        let name = protocol.to_string();
        [Family::V4, Family::V6]
            .into_iter()
            .flat_map(|f| self.routes(f))
            .filter(|r| r["protocol"] == name.as_str() || r["protocol"] == protocol)
            .collect()
    }

    /// The neighbour table, both families (`ip -j neigh show`).
    pub fn neighbours(&self) -> Vec<Value> {
        self.ip_json(&["neigh", "show"])
    }

    /// Moves the calling thread into this netns (setns); panics on failure.
    ///
    /// The thread stays there: call it only on a thread spawned for the
    /// purpose (see [`Netns::run`]). Processes spawned from the thread start
    /// in this netns, which is how the reference plugins are made to create
    /// their host-side objects in a node netns rather than the machine's.
    pub fn enter_current_thread(&self) {
        enter_at(&self.path).unwrap_or_else(|e| panic!("entering netns {}: {e}", self.name));
    }

    /// Runs `f` on a fresh thread that first entered this netns, and returns
    /// its result (re-raising its panic). The caller's thread is untouched.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        std::thread::scope(|s| {
            s.spawn(|| {
                self.enter_current_thread();
                f()
            })
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
        })
    }
}

/// Moves the calling thread into the netns at `path` (a
/// [`Netns::path`]), as [`Netns::enter_current_thread`] does: for a thread
/// that outlives the borrow of its [`Netns`].
pub fn enter_at(path: &Path) -> std::io::Result<()> {
    let file = File::open(path)?;
    // SAFETY: a valid open fd and a namespace type; setns only changes
    // this thread's network namespace.
    match unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Never panic in drop: a second panic during unwinding aborts and
        // would skip the other guards.
        // What still runs in the namespace was started here, by this test
        // (it made the namespace): a daemon's orphaned workers (nginx's,
        // once its master was killed) would outlive the test.
        if let Ok(out) = Command::new("ip")
            .args(["netns", "pids", &self.name])
            .output()
        {
            for pid in String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .filter_map(|p| p.parse::<libc::pid_t>().ok())
                .filter(|&p| p > 1 && p != std::process::id() as libc::pid_t)
            {
                // SAFETY: kill has no memory effects; the pid is a process
                // in this test's own namespace.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        match Command::new("ip")
            .args(["netns", "del", &self.name])
            .output()
        {
            Ok(out) if out.status.success() => {}
            Ok(out) => eprintln!(
                "harness: ip netns del {}: {}",
                self.name,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
            Err(e) => eprintln!("harness: ip netns del {}: {e}", self.name),
        }
    }
}

/// Runs `cmd`, panicking with its stderr unless it succeeds.
fn run_ok(cmd: &mut Command) -> Output {
    let what = format!("{cmd:?}");
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("spawning {what}: {e}"));
    check_output(&what, &out);
    out
}

fn check_output(what: &str, out: &Output) {
    if !out.status.success() {
        panic!(
            "{what} failed ({}):\nstderr: {}\nstdout: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            String::from_utf8_lossy(&out.stdout).trim()
        );
    }
}

/// One ping (`ping -c1 -W1`) from inside `from` to `to`, either family;
/// true if a reply came back.
pub fn ping(from: &Netns, to: IpAddr) -> bool {
    ping_output(from, to).status.success()
}

/// [`ping`], returning ping's output.
pub fn ping_output(from: &Netns, to: IpAddr) -> Output {
    let fam = if to.is_ipv4() { "-4" } else { "-6" };
    from.exec(&["ping", fam, "-n", "-c", "1", "-W", "1", &to.to_string()])
}

/// Pings from `from` to `to` until a reply comes or `limit` passes (routes
/// appear asynchronously); panics with the last ping's output and the
/// netns's routes if none came.
pub fn assert_ping_within(from: &Netns, to: IpAddr, limit: Duration) {
    let mut last = None;
    if wait_until(limit, || {
        let out = ping_output(from, to);
        let ok = out.status.success();
        last = Some(out);
        ok
    }) {
        return;
    }
    let fam = if to.is_ipv4() { Family::V4 } else { Family::V6 };
    let out = last.expect("pinged at least once");
    panic!(
        "no ping reply from {to} to {} within {limit:?}:\n{}\nroutes there: {:?}",
        from.name(),
        crate::output_text(&out),
        from.routes(fam)
    );
}
