//! Real virtual machines for the VM suites: Debian's QEMU (TCG: these
//! machines have no nested KVM) booting the test guest of
//! `tests/guest/build.sh` (a Debian cloud kernel and a busybox initramfs
//! whose init asks for a lease with busybox `udhcpc` or `dhcpcd` and prints
//! it), attached to a tap in a pod netns, driven over QMP and over a command
//! channel on its serial console.
//!
//! QEMU runs as uid/gid 107, as in KubeVirt's virt-launcher, so it opens
//! the tap as a virt-launcher's QEMU would. `/dev/net/tun` is 0600 on these
//! machines; each QEMU gets a private mount namespace in which a 0666 tun
//! device node is bound over it (a device plugin's job in a real cluster),
//! so the host is never changed. Every QEMU is a child of the test, ended by
//! its own handle when the guard drops.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::netns::Netns;
use crate::{unique_name, workspace_dir};

/// How long a guest may take from QEMU's start to its first lease (TCG on
/// a loaded 2-core machine: 3-5 s measured, ten times that allowed).
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(60);

/// The built guest: `vmlinuz` and `initramfs.gz`, built once per process
/// (and cached across runs by the script).
pub fn guest_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let script = workspace_dir().join("tests/guest/build.sh");
        let out = Command::new("sh")
            .arg(&script)
            .output()
            .expect("running tests/guest/build.sh");
        assert!(
            out.status.success(),
            "building the test guest failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        assert!(
            dir.join("vmlinuz").is_file(),
            "no kernel in {}",
            dir.display()
        );
        dir
    })
}

/// How many guests of this process printed a kernel panic on their console.
static GUEST_KERNEL_PANICS: AtomicUsize = AtomicUsize::new(0);

/// What the guest's kernel prints when it dies.
pub const KERNEL_PANIC: &str = "Kernel panic - not syncing";

/// Runs a test that boots real guests, and runs it once more if it failed
/// while a guest's own kernel panicked.
///
/// Debian 12's QEMU (7.2, TCG) crashed a guest once, right after a live
/// migration that QEMU itself reported completed: a double fault in the
/// guest kernel's exception entry, in its idle task (CI, 2026-11-28; none
/// in some 200 other guest migrations on this machine). Nothing a CNI
/// plugin does reaches a guest's CPU state, so such a failure says nothing
/// about tether; a failure without a guest panic fails at once, and a
/// second one fails in any case. Every rerun is printed.
pub fn once_more_if_a_guest_kernel_panicked(test: &str, body: impl Fn()) {
    let before = GUEST_KERNEL_PANICS.load(Ordering::SeqCst);
    let Err(failure) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(&body)) else {
        return;
    };
    if GUEST_KERNEL_PANICS.load(Ordering::SeqCst) == before {
        std::panic::resume_unwind(failure);
    }
    // Straight to the process's stderr: libtest shows a passing test's
    // captured output to no one, and a rerun must be seen.
    let what = failure
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| failure.downcast_ref::<&str>().copied())
        .unwrap_or("(no message)");
    let _ = writeln!(
        std::io::stderr(),
        "RERUN {test}: it failed while a guest's kernel panicked under QEMU's TCG; \
         running it once more. The failure:\n{what}"
    );
    body();
}

/// Which DHCP client the guest runs, per family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Client {
    /// None: the guest stays unaddressed in that family.
    None,
    /// busybox `udhcpc` (IPv4 only), in the foreground.
    Udhcpc,
    /// `dhcpcd` 9 (IPv4 or IPv6; for IPv6 it follows the RA's M flag to
    /// DHCPv6).
    Dhcpcd,
}

impl Client {
    fn arg(self) -> &'static str {
        match self {
            Client::None => "none",
            Client::Udhcpc => "udhcpc",
            Client::Dhcpcd => "dhcpcd",
        }
    }
}

/// How to start a guest.
#[derive(Debug, Clone)]
pub struct GuestOptions {
    /// The tap in the netns (tether's, or the test's).
    pub tap: String,
    /// The NIC's MAC: what KubeVirt copies from the pod interface.
    pub mac: String,
    /// Queues; more than 1 is a multi-queue virtio-net on a multi-queue tap.
    pub queues: u16,
    /// Guest memory in MiB.
    pub memory_mb: u32,
    /// The DHCPv4 client.
    pub dhcp4: Client,
    /// The DHCPv6 client.
    pub dhcp6: Client,
    /// Start as a migration target, listening on this unix socket (a
    /// relative path is placed in the guest's own directory).
    pub incoming: Option<PathBuf>,
}

impl GuestOptions {
    /// A 128 MiB single-queue guest on `tap` with `mac`, leasing IPv4 with
    /// udhcpc.
    pub fn new(tap: &str, mac: &str) -> GuestOptions {
        GuestOptions {
            tap: tap.into(),
            mac: mac.into(),
            queues: 1,
            memory_mb: 128,
            dhcp4: Client::Udhcpc,
            dhcp6: Client::None,
            incoming: None,
        }
    }
}

/// The console's lines so far, shared with the reader thread.
#[derive(Default)]
struct Console {
    lines: Mutex<Vec<String>>,
    grew: Condvar,
}

/// A running QEMU.
pub struct Guest {
    child: Child,
    stdin: Mutex<ChildStdin>,
    console: Arc<Console>,
    dir: PathBuf,
    qmp: Mutex<Option<Qmp>>,
    next_id: Mutex<u32>,
    /// The migration socket this guest listens on, if it is a target.
    incoming: Option<PathBuf>,
}

impl Guest {
    /// Starts QEMU inside `netns` (as uid 107) on `opts.tap`.
    pub fn start(netns: &Netns, opts: GuestOptions) -> Guest {
        let guest = guest_dir();
        let dir = Path::new("/var/tmp").join(unique_name("qemu"));
        std::fs::create_dir_all(&dir).expect("guest dir");
        chmod(&dir, "777");
        let tun = dir.join("tun");
        run_ok(
            Command::new("mknod")
                .args(["-m", "666"])
                .arg(&tun)
                .args(["c", "10", "200"]),
        );
        let qmp = dir.join("qmp.sock");
        let mut netdev = format!(
            "tap,id=n0,ifname={},script=no,downscript=no,vhost=off",
            opts.tap
        );
        let mut device = format!("virtio-net-pci,netdev=n0,mac={},romfile=", opts.mac);
        // The guest's driver uses as many queue pairs as it has vCPUs.
        let cpus = opts.queues.max(1).to_string();
        if opts.queues > 1 {
            netdev.push_str(&format!(",queues={}", opts.queues));
            device.push_str(&format!(",mq=on,vectors={}", 2 * opts.queues + 2));
        }
        let append = format!(
            "console=ttyS0 quiet loglevel=1 panic=-1 tether.dhcp4={} tether.dhcp6={}",
            opts.dhcp4.arg(),
            opts.dhcp6.arg()
        );
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={}", netns.path().display()))
            .args(["unshare", "--mount", "--propagation", "private", "sh", "-c"])
            .arg(
                "mount --bind \"$0\" /dev/net/tun && exec setpriv --reuid 107 --regid 107 \
                 --clear-groups -- \"$@\"",
            )
            .arg(&tun)
            .arg("qemu-system-x86_64")
            .args(["-nodefaults", "-no-user-config", "-display", "none"])
            .args(["-serial", "stdio", "-no-reboot", "-accel", "tcg"])
            .args(["-m", &opts.memory_mb.to_string(), "-smp", &cpus])
            .arg("-kernel")
            .arg(guest.join("vmlinuz"))
            .arg("-initrd")
            .arg(guest.join("initramfs.gz"))
            .args(["-append", &append])
            .args(["-netdev", &netdev, "-device", &device])
            .arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", qmp.display()));
        let incoming = opts.incoming.as_ref().map(|p| dir.join(p));
        if let Some(path) = &incoming {
            cmd.arg("-incoming").arg(format!("unix:{}", path.display()));
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting qemu-system-x86_64");
        let console = Arc::new(Console::default());
        let stdout = child.stdout.take().expect("stdout");
        let stderr = child.stderr.take().expect("stderr");
        for (stream, prefix) in [
            (Box::new(stdout) as Box<dyn Read + Send>, ""),
            (Box::new(stderr), "QEMU-STDERR "),
        ] {
            let console = console.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines() {
                    let Ok(line) = line else { break };
                    let line = format!("{prefix}{}", line.trim_end_matches('\r'));
                    if line.contains(KERNEL_PANIC) {
                        GUEST_KERNEL_PANICS.fetch_add(1, Ordering::SeqCst);
                    }
                    let mut lines = console.lines.lock().unwrap_or_else(|e| e.into_inner());
                    lines.push(line);
                    console.grew.notify_all();
                }
            });
        }
        let stdin = child.stdin.take().expect("stdin");
        let g = Guest {
            child,
            stdin: Mutex::new(stdin),
            console,
            dir,
            qmp: Mutex::new(None),
            next_id: Mutex::new(0),
            incoming,
        };
        g.wait_file(&qmp, Duration::from_secs(20));
        if let Some(path) = &g.incoming {
            // A migration may start as soon as the target listens.
            g.wait_file(path, Duration::from_secs(20));
        }
        g
    }

    fn wait_file(&self, path: &Path, limit: Duration) {
        let start = Instant::now();
        while !path.exists() {
            assert!(
                start.elapsed() < limit,
                "QEMU did not create {}: {}",
                path.display(),
                self.console_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Everything the console and QEMU's stderr printed so far.
    pub fn console_text(&self) -> String {
        self.console
            .lines
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .join("\n")
    }

    /// How many console lines there are so far: a mark for
    /// [`Guest::wait_line_after`].
    pub fn mark(&self) -> usize {
        self.console
            .lines
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// The first console line at or after `mark` that starts with `prefix`,
    /// with its index; panics with the console after `limit`.
    pub fn wait_line_after(&self, prefix: &str, mark: usize, limit: Duration) -> (usize, String) {
        let deadline = Instant::now() + limit;
        let mut lines = self.console.lines.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(found) = line_after(&lines, prefix, mark) {
                return found;
            }
            let now = Instant::now();
            if now >= deadline {
                let text = lines.join("\n");
                panic!("no console line {prefix:?} within {limit:?}; console:\n{text}");
            }
            lines = self
                .console
                .grew
                .wait_timeout(lines, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The first console line starting with `prefix`.
    pub fn wait_line(&self, prefix: &str, limit: Duration) -> String {
        self.wait_line_after(prefix, 0, limit).1
    }

    /// Runs a shell command in the guest; its exit status and output.
    pub fn run(&self, command: &str, limit: Duration) -> (i32, String) {
        let id = {
            let mut n = self.next_id.lock().unwrap_or_else(|e| e.into_inner());
            *n += 1;
            *n
        };
        let mark = self.mark();
        {
            let mut stdin = self.stdin.lock().unwrap_or_else(|e| e.into_inner());
            if let Err(e) = writeln!(stdin, "RUN {id} {command}").and_then(|()| stdin.flush()) {
                // QEMU is gone: say what it printed before it went.
                panic!(
                    "writing {command:?} to the guest console: {e} (QEMU exited?)\nconsole and QEMU's stderr:\n{}",
                    self.console_text()
                );
            }
        }
        let (end, line) = self.wait_line_after(&format!("END {id} "), mark, limit);
        let status = line
            .rsplit(' ')
            .next()
            .and_then(|s| s.parse().ok())
            .unwrap_or(-1);
        let out_prefix = format!("OUT {id} ");
        let output = self.console.lines.lock().unwrap_or_else(|e| e.into_inner())[mark..end]
            .iter()
            .filter_map(|l| l.strip_prefix(&out_prefix))
            .collect::<Vec<_>>()
            .join("\n");
        (status, output)
    }

    /// Runs a command that must succeed; its output.
    pub fn run_ok(&self, command: &str) -> String {
        let (status, out) = self.run(command, Duration::from_secs(30));
        assert_eq!(status, 0, "{command:?} in the guest failed: {out}");
        out
    }

    /// The guest's QMP connection (opened on first use).
    pub fn qmp<T>(&self, f: impl FnOnce(&mut Qmp) -> T) -> T {
        let mut guard = self.qmp.lock().unwrap_or_else(|e| e.into_inner());
        if guard.is_none() {
            *guard = Some(Qmp::connect(&self.dir.join("qmp.sock")));
        }
        f(guard.as_mut().expect("connected"))
    }

    /// The migration socket of a guest started with `incoming`.
    pub fn incoming(&self) -> &Path {
        self.incoming
            .as_deref()
            .expect("not started as a migration target")
    }

    /// A path for a migration socket in this guest's directory.
    pub fn socket_path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Live-migrates this guest to `target` (started with `incoming`) and
    /// waits for the outcome.
    pub fn migrate_to(&self, target: &Guest, limit: Duration) -> Migration {
        self.start_migration(target);
        self.wait_migration(limit)
    }

    /// Starts a live migration to `target` without waiting.
    pub fn start_migration(&self, target: &Guest) {
        let uri = format!("unix:{}", target.incoming().display());
        self.qmp(|q| q.execute("migrate", json!({ "uri": uri })));
    }

    /// Polls `query-migrate` until the migration completes or fails.
    pub fn wait_migration(&self, limit: Duration) -> Migration {
        let deadline = Instant::now() + limit;
        loop {
            let info = self.qmp(|q| q.execute("query-migrate", json!({})));
            let status = info["status"].as_str().unwrap_or("").to_owned();
            if matches!(status.as_str(), "completed" | "failed" | "cancelled") {
                return Migration {
                    status,
                    total_ms: info["total-time"].as_u64(),
                    downtime_ms: info["downtime"].as_u64(),
                    setup_ms: info["setup-time"].as_u64(),
                    finished: Instant::now(),
                };
            }
            assert!(
                Instant::now() < deadline,
                "migration still {status} after {limit:?}: {info}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The QEMU process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Ends QEMU now (SIGKILL to this child only).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What `query-migrate` said at the end.
#[derive(Debug, Clone)]
pub struct Migration {
    /// `completed`, `failed` or `cancelled`.
    pub status: String,
    /// From the start to the end, by QEMU's count.
    pub total_ms: Option<u64>,
    /// The guest's stop-and-copy pause, by QEMU's count.
    pub downtime_ms: Option<u64>,
    /// Setup time.
    pub setup_ms: Option<u64>,
    /// When the test saw the outcome.
    pub finished: Instant,
}

/// The microseconds since the epoch at which `guest`'s QMP sent its first
/// `event` (by then, or after a `query-status`); QMP connections keep the
/// events they read while waiting for answers.
pub fn event_unix_micros(guest: &Guest, event: &str) -> Option<i64> {
    guest.qmp(|q| {
        q.execute("query-status", json!({}));
        q.events.iter().find(|e| e["event"] == event).and_then(|e| {
            let t = &e["timestamp"];
            Some(t["seconds"].as_i64()? * 1_000_000 + t["microseconds"].as_i64()?)
        })
    })
}

/// Forgets the events `guest`'s QMP connection has read so far (after
/// opening it, so that it reads the next ones): call it on both guests
/// before a migration whose [`pause`] is wanted.
pub fn clear_events(guest: &Guest) {
    guest.qmp(|q| {
        q.execute("query-status", json!({}));
        q.events.clear();
    });
}

/// The guest's whole pause in a live migration, as the two QEMUs' events
/// tell it: the source's `STOP` to the target's `RESUME`, both stamped by
/// this machine's clock, as instants of this process.
#[derive(Debug, Clone, Copy)]
pub struct Pause {
    /// The source QEMU stopped the guest.
    pub stop: Instant,
    /// The target QEMU resumed it.
    pub resume: Instant,
}

impl Pause {
    /// How long the guest did not run.
    pub fn duration(&self) -> Duration {
        self.resume.saturating_duration_since(self.stop)
    }
}

/// The pause of the migration from `source` to `target` (see [`Pause`]);
/// None if either event is missing.
pub fn pause(source: &Guest, target: &Guest) -> Option<Pause> {
    let stop = event_unix_micros(source, "STOP")?;
    let resume = event_unix_micros(target, "RESUME")?;
    Some(Pause {
        stop: instant_of_unix_micros(stop),
        resume: instant_of_unix_micros(resume),
    })
}

/// This process's instant for a time given in µs since the epoch.
fn instant_of_unix_micros(us: i64) -> Instant {
    let (now, unix) = (Instant::now(), std::time::SystemTime::now());
    let now_us = unix
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64);
    let back = Duration::from_micros((now_us - us).unsigned_abs());
    if us <= now_us {
        now.checked_sub(back).unwrap_or(now)
    } else {
        now + back
    }
}

/// A QMP connection.
pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    /// Events received while waiting for answers.
    pub events: Vec<Value>,
}

impl Qmp {
    /// Connects and leaves capabilities negotiation mode.
    pub fn connect(path: &Path) -> Qmp {
        let stream = UnixStream::connect(path).expect("connecting to QMP");
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        let writer = stream.try_clone().expect("clone");
        let mut q = Qmp {
            reader: BufReader::new(stream),
            writer,
            events: Vec::new(),
        };
        let greeting = q.read();
        assert!(
            greeting.get("QMP").is_some(),
            "not a QMP greeting: {greeting}"
        );
        q.execute("qmp_capabilities", json!({}));
        q
    }

    fn read(&mut self) -> Value {
        let mut line = String::new();
        self.reader.read_line(&mut line).expect("reading QMP");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("QMP sent {line:?}: {e}"))
    }

    /// Runs a command; its `return` value. Panics on an error answer.
    pub fn execute(&mut self, command: &str, arguments: Value) -> Value {
        let mut msg = json!({ "execute": command });
        if arguments.as_object().is_some_and(|o| !o.is_empty()) {
            msg["arguments"] = arguments;
        }
        writeln!(self.writer, "{msg}").expect("writing QMP");
        loop {
            let answer = self.read();
            if answer.get("event").is_some() {
                self.events.push(answer);
                continue;
            }
            if let Some(r) = answer.get("return") {
                return r.clone();
            }
            panic!("QMP {command} failed: {answer}");
        }
    }
}

/// A `TETHER-LEASE4`/`TETHER-LEASE6` line of the guest, as key → value.
pub fn parse_lease(line: &str) -> HashMap<String, String> {
    let mut out: HashMap<String, String> = HashMap::new();
    let mut current: Option<String> = None;
    for token in line.split_whitespace().skip(1) {
        match token.split_once('=') {
            Some((k, v)) if !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric()) => {
                out.insert(k.to_owned(), v.to_owned());
                current = Some(k.to_owned());
            }
            _ => {
                if let Some(k) = &current {
                    if let Some(v) = out.get_mut(k) {
                        v.push(' ');
                        v.push_str(token);
                    }
                }
            }
        }
    }
    out
}

fn chmod(path: &Path, mode: &str) {
    run_ok(Command::new("chmod").arg(mode).arg(path));
}

/// The first of `lines` at or after index `mark` that starts with
/// `prefix`, with its index.
pub(crate) fn line_after(lines: &[String], prefix: &str, mark: usize) -> Option<(usize, String)> {
    lines
        .iter()
        .enumerate()
        .skip(mark)
        .find(|(_, l)| l.starts_with(prefix))
        .map(|(i, l)| (i, l.clone()))
}

fn run_ok(cmd: &mut Command) {
    let out = cmd.output().expect("spawn");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[test]
    fn only_a_failure_with_a_guest_kernel_panic_runs_once_more() {
        let runs = Cell::new(0);
        once_more_if_a_guest_kernel_panicked("(this unit test's stand-in)", || {
            runs.set(runs.get() + 1);
            if runs.get() == 1 {
                GUEST_KERNEL_PANICS.fetch_add(1, Ordering::SeqCst);
                panic!("first attempt");
            }
        });
        assert_eq!(runs.get(), 2);

        let runs = Cell::new(0);
        let second = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            once_more_if_a_guest_kernel_panicked("(this unit test's stand-in)", || {
                runs.set(runs.get() + 1);
                GUEST_KERNEL_PANICS.fetch_add(1, Ordering::SeqCst);
                panic!("every attempt");
            })
        }));
        assert!(second.is_err());
        assert_eq!(runs.get(), 2, "no third attempt");

        // One test, not two: the count is the process's.
        let runs = Cell::new(0);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            once_more_if_a_guest_kernel_panicked("(this unit test's stand-in)", || {
                runs.set(runs.get() + 1);
                panic!("a tether fault");
            })
        }));
        assert!(result.is_err());
        assert_eq!(runs.get(), 1);
    }
}
