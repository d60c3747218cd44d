//! Network namespaces: validating CNI_NETNS, and running work inside a pod
//! netns on a thread of its own.
//!
//! setns(CLONE_NEWNET) changes only the calling thread, so it is done on a
//! fresh std::thread that exits afterwards: a tokio worker that entered a pod
//! netns would carry every later task on it into that pod.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::future::Future;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use nix::sched::{setns, CloneFlags};
use nix::sys::statfs::{fstatfs, NSFS_MAGIC};
use rtnetlink::Handle;

use crate::error::{KernelError, Result};

fn invalid_netns(reason: String) -> KernelError {
    KernelError::BadEnv {
        var: "CNI_NETNS",
        reason,
    }
}

/// Opens and validates a netns path: it must be absolute, exist, and be a
/// network namespace file (nsfs). Any failure is CNI error 4 on CNI_NETNS.
pub fn open_netns(path: &Path) -> Result<File> {
    if !path.is_absolute() {
        return Err(invalid_netns(format!(
            "{} is not an absolute path",
            path.display()
        )));
    }
    // O_NONBLOCK: a FIFO planted at the path must not hang the daemon.
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                invalid_netns(format!("{} does not exist", path.display()))
            }
            _ => invalid_netns(format!("cannot open {}: {e}", path.display())),
        })?;
    let fs = fstatfs(&file)
        .map_err(|e| invalid_netns(format!("cannot statfs {}: {e}", path.display())))?;
    if fs.filesystem_type() != NSFS_MAGIC {
        return Err(invalid_netns(format!(
            "{} is not a namespace file",
            path.display()
        )));
    }
    // nsfs also holds mount, pid, user... namespaces; only a network one will do.
    // SAFETY: NS_GET_NSTYPE takes no argument and only reads the fd we own.
    let nstype = unsafe { libc::ioctl(file.as_raw_fd(), libc::NS_GET_NSTYPE) };
    if nstype >= 0 && nstype != libc::CLONE_NEWNET {
        return Err(invalid_netns(format!(
            "{} is a namespace but not a network namespace",
            path.display()
        )));
    }
    Ok(file)
}

/// True if an interface of that name exists in the given netns.
pub async fn pod_interface_exists(netns: &File, ifname: &str) -> Result<bool> {
    let name = CString::new(ifname).map_err(|_| KernelError::BadEnv {
        var: "CNI_IFNAME",
        reason: "contains a NUL byte".into(),
    })?;
    on_netns_thread(netns, move || {
        // if_nametoindex resolves on a socket it opens in this thread's netns:
        // far cheaper than a netlink connection for a yes/no answer.
        // SAFETY: `name` is a valid NUL-terminated string that outlives the call.
        let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
        if index != 0 {
            return Ok(true);
        }
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::ENODEV) => Ok(false),
            _ => Err(KernelError::refused("looking up the pod interface", err)),
        }
    })
    .await
}

/// Runs `work` on a new thread that has entered `netns`, and awaits its answer
/// without blocking the caller's runtime.
pub(super) async fn on_netns_thread<T, F>(netns: &File, work: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T> + Send + 'static,
{
    spawn_in_netns(netns, work)?.await
}

/// Starts `work` on a new thread that enters `netns` at once, and returns
/// the future of its answer. Starting before awaiting lets the caller overlap
/// the thread's start-up with its own work.
pub(super) fn spawn_in_netns<T, F>(
    netns: &File,
    work: F,
) -> Result<impl Future<Output = Result<T>> + Send + 'static>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T> + Send + 'static,
{
    // The thread needs its own fd: the caller's borrow cannot cross threads.
    let fd = netns
        .try_clone()
        .map_err(|e| KernelError::refused("duplicating the pod netns fd", e))?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("tether-netns".into())
        .spawn(move || {
            let result = setns(&fd, CloneFlags::CLONE_NEWNET)
                .map_err(|e| KernelError::refused("entering the pod netns", e))
                .and_then(|()| {
                    drop(fd);
                    work()
                });
            // The receiver is gone only if the request was abandoned.
            let _ = tx.send(result);
        })
        .map_err(|e| KernelError::refused("starting a netns thread", e))?;
    Ok(async move {
        rx.await
            .map_err(|_| KernelError::Internal("netns thread ended without an answer".into()))?
    })
}

/// Runs `work` inside `netns` with an rtnetlink connection opened there, on a
/// current-thread runtime owned by the netns thread.
pub(super) async fn with_netns_handle<T, F, Fut>(netns: &File, work: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce(Handle) -> Fut + Send + 'static,
    Fut: Future<Output = Result<T>>,
{
    spawn_with_handle(netns, work)?.await
}

/// Like [`with_netns_handle`], but the thread starts now and the returned
/// future only collects its answer.
pub(super) fn spawn_with_handle<T, F, Fut>(
    netns: &File,
    work: F,
) -> Result<impl Future<Output = Result<T>> + Send + 'static>
where
    T: Send + 'static,
    F: FnOnce(Handle) -> Fut + Send + 'static,
    Fut: Future<Output = Result<T>>,
{
    spawn_in_netns(netns, move || with_handle_here(work))
}

/// Runs `work` with an rtnetlink connection opened in this thread's netns,
/// on a current-thread runtime of this thread (a netns thread, which has
/// none).
pub(super) fn with_handle_here<T, F, Fut>(work: F) -> Result<T>
where
    F: FnOnce(Handle) -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(|e| KernelError::refused("starting the pod netns runtime", e))?;
    runtime.block_on(async move {
        let (connection, handle, _) = rtnetlink::new_connection_with_strict_check()
            .map_err(|e| KernelError::refused("opening rtnetlink in the pod netns", e))?;
        tokio::spawn(connection);
        work(handle).await
    })
}
