//! The init of one Kubernetes node of the multi-node harness
//! (`tests/src/kube_cluster.rs`): PID 1 of the node's PID namespace, started by
//! `unshare --pid --fork --mount --mount-proc` inside the node's netns.
//!
//! Usage: `node_init <ready-file> <staging-dir> <source>:<target>...`
//!
//! 1. Makes the namespace's root the current root. Under a chroot (the
//!    fresh-machine check) the mount namespace's root is outside the
//!    chroot, and `runc exec` (`kubectl exec`) would land there: the
//!    current root is bound onto `<staging-dir>` (an empty directory of
//!    it) and pivoted to, so
//!    every process of the node sees the same `/` as the one that started
//!    it.
//! 2. Binds each `<source>` (a directory of the test run) onto `<target>`
//!    (a standard path such as `/var/lib/kubelet`, which must exist), so
//!    that the node's containerd, kubelet and pods find their own state
//!    where a real node keeps it.
//! 3. Makes every mount shared inside the namespace (`Bidirectional` and
//!    `HostToContainer` propagation need a shared source), never the
//!    machine's: the namespace was made private by `unshare` first.
//! 4. Writes `ready` to `<ready-file>`, then reaps every process that the
//!    node's daemons orphan (containerd's shims) until SIGTERM; then it
//!    sends SIGTERM to everything in the namespace, SIGKILL after 5 s, and
//!    exits, which ends whatever is left in it.

use std::ffi::CString;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_term(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

fn cstr(s: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("a NUL in {s:?}"))
}

fn mount(
    src: &str,
    target: &str,
    fstype: Option<&str>,
    flags: libc::c_ulong,
) -> Result<(), String> {
    let (s, t) = (cstr(src)?, cstr(target)?);
    let f = fstype.map(cstr).transpose()?;
    let rc = unsafe {
        libc::mount(
            s.as_ptr(),
            t.as_ptr(),
            f.as_ref().map_or(std::ptr::null(), |f| f.as_ptr()),
            flags,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(format!(
            "mount {src} on {target} (flags {flags:#x}): {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

fn open_path(path: &str, flags: libc::c_int) -> Result<libc::c_int, String> {
    let c = cstr(path)?;
    // SAFETY: c is a valid NUL-terminated path.
    let fd = unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(format!("open {path}: {}", std::io::Error::last_os_error()));
    }
    Ok(fd)
}

/// Makes the current root (a chroot's, under the fresh-machine check) the
/// mount namespace's root. `setns` into the namespace, which `nsenter` and
/// `runc exec` do, puts a process at the namespace's root, not at a
/// chroot's: without this, everything entered into the node would see the
/// machine's real root.
fn pivot_to_current_root(staging: &str) -> Result<(), String> {
    let root = open_path("/", libc::O_PATH | libc::O_DIRECTORY)?;
    let stage = open_path(staging, libc::O_PATH | libc::O_DIRECTORY)?;
    // Out of any chroot: to the namespace's own root.
    let ns = open_path("/proc/self/ns/mnt", libc::O_RDONLY)?;
    // SAFETY: ns is a mount-namespace fd of our own namespace.
    if unsafe { libc::setns(ns, libc::CLONE_NEWNS) } != 0 {
        return Err(format!(
            "setns to our own mount namespace: {}",
            std::io::Error::last_os_error()
        ));
    }
    mount("none", "/", None, libc::MS_REC | libc::MS_PRIVATE)?;
    // Their paths as seen from the namespace's root now.
    let real = |fd: libc::c_int| {
        std::fs::read_link(format!("/proc/self/fd/{fd}"))
            .map(|p| p.display().to_string())
            .map_err(|e| format!("readlink of fd {fd}: {e}"))
    };
    let (root, stage) = (real(root)?, real(stage)?);
    mount(&root, &stage, None, libc::MS_BIND | libc::MS_REC)?;
    std::env::set_current_dir(&stage).map_err(|e| format!("chdir {stage}: {e}"))?;
    let dot = cstr(".")?;
    // SAFETY: both arguments are valid NUL-terminated paths.
    let rc = unsafe { libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) };
    if rc != 0 {
        return Err(format!("pivot_root: {}", std::io::Error::last_os_error()));
    }
    // The old root is stacked on the new one: take it away.
    // SAFETY: dot is a valid NUL-terminated path.
    if unsafe { libc::umount2(dot.as_ptr(), libc::MNT_DETACH) } != 0 {
        return Err(format!(
            "detaching the old root: {}",
            std::io::Error::last_os_error()
        ));
    }
    std::env::set_current_dir("/").map_err(|e| format!("chdir /: {e}"))
}

fn setup(args: &[String]) -> Result<(), String> {
    let [ready, staging, binds @ ..] = args else {
        return Err("usage: node_init <ready-file> <staging-dir> <source>:<target>...".into());
    };
    pivot_to_current_root(staging)?;
    for bind in binds {
        let (src, target) = bind
            .split_once(':')
            .ok_or_else(|| format!("{bind:?} is not <source>:<target>"))?;
        mount(src, target, None, libc::MS_BIND | libc::MS_REC)?;
    }
    mount("none", "/", None, libc::MS_REC | libc::MS_SHARED)?;
    std::fs::write(ready, "ready\n").map_err(|e| format!("writing {ready}: {e}"))
}

fn reap() {
    loop {
        let pid = unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) };
        if pid <= 0 {
            return;
        }
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    unsafe {
        libc::signal(libc::SIGTERM, on_term as *const () as libc::sighandler_t);
        libc::signal(libc::SIGINT, on_term as *const () as libc::sighandler_t);
    }
    if let Err(e) = setup(&args) {
        eprintln!("node_init: {e}");
        return ExitCode::FAILURE;
    }
    while !STOP.load(Ordering::SeqCst) {
        reap();
        std::thread::sleep(Duration::from_millis(100));
    }
    // kill(-1) from a namespace's init reaches every other process in it.
    unsafe { libc::kill(-1, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        reap();
        let some_left = unsafe { libc::kill(-1, 0) } == 0;
        if !some_left {
            return ExitCode::SUCCESS;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    unsafe { libc::kill(-1, libc::SIGKILL) };
    reap();
    ExitCode::SUCCESS
}
