//! One tetherd per node: before a daemon opens its store, reconciles the
//! kernel, replays a DEL or writes a byte, it takes an exclusive lock on
//! its state dir, on its socket's path and on its network namespace, and
//! checks that nobody serves the socket. A second daemon stops there,
//! names the first, and has changed nothing.
//!
//! The locks are `flock(LOCK_EX | LOCK_NB)` on `<state-dir>/tetherd.lock`
//! and `<socket>.lock`, held for the life of the process: the kernel
//! releases them when it exits, however it exits, so a crash never leaves
//! a stale lock behind. Each file holds the PID of the daemon that last
//! held it, for the message. The socket's lock covers a second daemon with
//! another state dir that starts while the first is still starting (its
//! socket not served yet); the connect probe covers a socket served by a
//! process that takes no lock.
//!
//! A daemon with another state dir and another socket would still undo
//! the first's work in the same network namespace: its reconciliation
//! removes every tether veth and route its own store does not know. So the
//! daemon also binds the abstract unix socket [`NETNS_NAME`], whose name
//! belongs to the network namespace and is freed by the kernel when the
//! daemon exits; a second daemon in the namespace cannot bind it, and
//! learns the first's PID by connecting to it.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

/// The lock file in the state dir.
pub const STATE_DIR_LOCK: &str = "tetherd.lock";

/// The abstract unix socket that stands for "a tetherd runs in this
/// network namespace".
pub const NETNS_NAME: &str = "tether/tetherd";

/// Why this daemon may not run.
#[derive(Debug)]
pub enum Refused {
    /// Another process holds one of the locks.
    Locked {
        /// What the lock guards: "the state dir /var/lib/tether".
        what: String,
        /// The lock file.
        lock: PathBuf,
        /// The PID written in the lock file, if one could be read.
        pid: Option<u32>,
    },
    /// Another daemon runs in this network namespace.
    Netns {
        /// Its PID (SO_PEERCRED), if the kernel told it.
        pid: Option<u32>,
    },
    /// A process accepts connections on the socket.
    Served {
        /// The socket.
        socket: PathBuf,
        /// The peer's PID (SO_PEERCRED), if the kernel told it.
        pid: Option<u32>,
    },
    /// A lock file could not be created, opened or locked.
    Io {
        /// What was being done.
        doing: String,
        /// The error.
        cause: std::io::Error,
    },
}

fn pid_text(pid: Option<u32>) -> String {
    match pid {
        Some(pid) => format!("tetherd (pid {pid})"),
        None => "tetherd".to_owned(),
    }
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::Locked { what, lock, pid } => write!(
                f,
                "another {} holds {what} (lock {}): one tetherd per node; stop it first. \
                 This one exits having changed nothing",
                pid_text(*pid),
                lock.display()
            ),
            Refused::Netns { pid } => write!(
                f,
                "another {} runs in this network namespace: one tetherd per node; stop it \
                 first. This one exits having changed nothing",
                pid_text(*pid)
            ),
            Refused::Served { socket, pid } => write!(
                f,
                "{} is served by another process{} (another tetherd?): one tetherd per node; \
                 stop it first. This one exits having changed nothing",
                socket.display(),
                match pid {
                    Some(pid) => format!(" (pid {pid})"),
                    None => String::new(),
                }
            ),
            Refused::Io { doing, cause } => write!(f, "{doing}: {cause}"),
        }
    }
}

impl std::error::Error for Refused {}

/// The locks this daemon holds; dropping it (at exit) releases them.
#[derive(Debug)]
pub struct InstanceLock {
    _state_dir: Flock<File>,
    _socket: Flock<File>,
    _netns: std::os::unix::net::UnixListener,
}

impl InstanceLock {
    /// Takes both locks, claims the network namespace and probes the
    /// socket, or says who is in the way. Creates the state dir, the
    /// socket's directory and the two lock files if missing, and touches
    /// nothing else.
    pub async fn acquire(state_dir: &Path, socket: &Path) -> Result<InstanceLock, Refused> {
        Self::acquire_as(state_dir, socket, NETNS_NAME).await
    }

    /// [`InstanceLock::acquire`] with another abstract name: the unit
    /// tests run side by side in one namespace, which may hold a tetherd.
    async fn acquire_as(
        state_dir: &Path,
        socket: &Path,
        netns_name: &str,
    ) -> Result<InstanceLock, Refused> {
        let state_lock = take(
            &state_dir.join(STATE_DIR_LOCK),
            format!("the state dir {}", state_dir.display()),
        )?;
        let socket_lock = take(
            &socket_lock_path(socket),
            format!("the socket {}", socket.display()),
        )?;
        let netns = claim_netns(netns_name)?;
        probe(socket).await?;
        Ok(InstanceLock {
            _state_dir: state_lock,
            _socket: socket_lock,
            _netns: netns,
        })
    }
}

/// `<socket>.lock`, beside the socket.
pub fn socket_lock_path(socket: &Path) -> PathBuf {
    let mut name = socket.as_os_str().to_owned();
    name.push(".lock");
    PathBuf::from(name)
}

/// Locks `path` (created with mode 0600 if missing), then writes this
/// process's PID into it.
fn take(path: &Path, what: String) -> Result<Flock<File>, Refused> {
    let io = |doing: String| move |cause| Refused::Io { doing, cause };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
    }
    let file = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .map_err(io(format!("opening the lock file {}", path.display())))?;
    let mut locked = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(locked) => locked,
        Err((mut file, Errno::EWOULDBLOCK)) => {
            return Err(Refused::Locked {
                what,
                lock: path.to_owned(),
                pid: read_pid(&mut file),
            })
        }
        Err((_, errno)) => {
            return Err(Refused::Io {
                doing: format!("locking {}", path.display()),
                cause: errno.into(),
            })
        }
    };
    // The PID is for the message a second daemon prints; failing to write
    // it costs only that detail.
    let pid = format!("{}\n", std::process::id());
    let written = locked
        .set_len(0)
        .and_then(|()| locked.rewind())
        .and_then(|()| locked.write_all(pid.as_bytes()));
    if let Err(e) = written {
        tracing::warn!(lock = %path.display(), error = %e, "cannot write the PID into the lock file");
    }
    Ok(locked)
}

/// Binds the abstract unix socket `name` in this network namespace. The
/// listener is never accepted on: it is only held, until the process ends.
fn claim_netns(name: &str) -> Result<std::os::unix::net::UnixListener, Refused> {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixListener};
    let io = |doing: &str| {
        let doing = format!("{doing} the abstract socket @{name}");
        move |cause| Refused::Io { doing, cause }
    };
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).map_err(io("naming"))?;
    match UnixListener::bind_addr(&addr) {
        Ok(listener) => Ok(listener),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Err(Refused::Netns {
            pid: holder_pid(name),
        }),
        Err(e) => Err(io("binding")(e)),
    }
}

/// The PID of the process listening on the abstract socket `name`,
/// through a connection's SO_PEERCRED. The connect does not block: the
/// holder never accepts, and a backlog filled by earlier attempts must not
/// hang this daemon (it then only cannot name the holder).
fn holder_pid(name: &str) -> Option<u32> {
    use nix::sys::socket::{
        connect, getsockopt, socket, sockopt::PeerCredentials, AddressFamily, SockFlag, SockType,
        UnixAddr,
    };
    use std::os::fd::AsRawFd;
    let addr = UnixAddr::new_abstract(name.as_bytes()).ok()?;
    let fd = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    )
    .ok()?;
    connect(fd.as_raw_fd(), &addr).ok()?;
    let cred = getsockopt(&fd, PeerCredentials).ok()?;
    u32::try_from(cred.pid()).ok().filter(|p| *p != 0)
}

/// The PID of the process at the other end, unless hidden (another PID
/// namespace shows as 0).
fn peer_pid(stream: &tokio::net::UnixStream) -> Option<u32> {
    stream
        .peer_cred()
        .ok()
        .and_then(|c| c.pid())
        .and_then(|p| u32::try_from(p).ok())
        .filter(|p| *p != 0)
}

fn read_pid(file: &mut File) -> Option<u32> {
    let mut text = String::new();
    file.read_to_string(&mut text).ok()?;
    text.trim().parse().ok()
}

/// Refuses a socket that accepts connections; a stale one (left by a
/// daemon that was killed) refuses them, and is the server's to replace.
async fn probe(socket: &Path) -> Result<(), Refused> {
    match tokio::net::UnixStream::connect(socket).await {
        Ok(stream) => Err(Refused::Served {
            socket: socket.to_owned(),
            pid: peer_pid(&stream),
        }),
        Err(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// An abstract name no other test (or tetherd) uses.
    /// Takes the locks of state dir `state` and socket `socket`, both
    /// under `dir`, and the network namespace name `name`.
    fn acquire(
        rt: &tokio::runtime::Runtime,
        dir: &Path,
        state: &str,
        socket: &str,
        name: &str,
    ) -> Result<InstanceLock, Refused> {
        rt.block_on(InstanceLock::acquire_as(
            &dir.join(state),
            &dir.join(socket),
            name,
        ))
    }

    fn netns_name(test: &str) -> String {
        format!("tether-test/{}/{test}", std::process::id())
    }

    #[test]
    fn a_second_claim_on_the_same_state_dir_is_refused_naming_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let (state, sock_a, sock_b) = (
            dir.path().join("state"),
            dir.path().join("a.sock"),
            dir.path().join("b.sock"),
        );
        let rt = runtime();
        let name = netns_name("state-dir");
        let first = rt
            .block_on(InstanceLock::acquire_as(&state, &sock_a, &name))
            .unwrap();
        let pid = std::fs::read_to_string(state.join(STATE_DIR_LOCK)).unwrap();
        assert_eq!(pid, format!("{}\n", std::process::id()));
        let err = rt
            .block_on(InstanceLock::acquire_as(&state, &sock_b, &name))
            .unwrap_err();
        let said = err.to_string();
        assert!(matches!(err, Refused::Locked { .. }), "{said}");
        assert!(
            said.contains(&format!("tetherd (pid {})", std::process::id())),
            "{said}"
        );
        assert!(said.contains("state dir"), "{said}");
        // The refused claim took neither lock: the other socket is free.
        assert!(!sock_b.exists());
        drop(first);
        rt.block_on(InstanceLock::acquire_as(&state, &sock_b, &name))
            .unwrap();
    }

    #[test]
    fn a_second_claim_on_the_same_socket_is_refused_even_with_another_state_dir() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("t.sock");
        let rt = runtime();
        let name = netns_name("socket");
        let _first = rt
            .block_on(InstanceLock::acquire_as(
                &dir.path().join("s1"),
                &sock,
                &name,
            ))
            .unwrap();
        let err = rt
            .block_on(InstanceLock::acquire_as(
                &dir.path().join("s2"),
                &sock,
                &name,
            ))
            .unwrap_err();
        assert!(
            matches!(&err, Refused::Locked { what, .. } if what.contains("t.sock")),
            "{err}"
        );
    }

    #[test]
    fn a_served_socket_is_refused_and_a_stale_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("t.sock");
        let rt = runtime();
        let name = netns_name("served");
        let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let err = rt
            .block_on(InstanceLock::acquire_as(
                &dir.path().join("s"),
                &sock,
                &name,
            ))
            .unwrap_err();
        let said = err.to_string();
        assert!(matches!(err, Refused::Served { .. }), "{said}");
        assert!(
            said.contains(&format!("(pid {})", std::process::id())),
            "{said}"
        );
        // Closed: the file stays, but nobody accepts on it.
        drop(listener);
        assert!(sock.exists());
        rt.block_on(InstanceLock::acquire_as(
            &dir.path().join("s"),
            &sock,
            &name,
        ))
        .unwrap();
    }

    #[test]
    fn a_second_daemon_in_the_same_network_namespace_is_refused_whatever_its_paths() {
        let dir = tempfile::tempdir().unwrap();
        let rt = runtime();
        let name = netns_name("netns");
        let first = acquire(&rt, dir.path(), "s1", "1.sock", &name).unwrap();
        // Many refused attempts: the holder never accepts, and a full
        // backlog must not make a later attempt hang.
        for _ in 0..300 {
            let err = acquire(&rt, dir.path(), "s2", "2.sock", &name).unwrap_err();
            assert!(matches!(err, Refused::Netns { .. }), "{err}");
        }
        let err = acquire(&rt, dir.path(), "s2", "2.sock", &name).unwrap_err();
        // With a full backlog it cannot name the holder, but says why.
        assert!(
            err.to_string().contains("runs in this network namespace"),
            "{err}"
        );
        // Released with the lock, at once.
        drop(first);
        acquire(&rt, dir.path(), "s2", "2.sock", &name).unwrap();
    }

    #[test]
    fn the_holder_of_the_network_namespace_is_named_by_its_pid() {
        let dir = tempfile::tempdir().unwrap();
        let rt = runtime();
        let name = netns_name("pid");
        let _first = acquire(&rt, dir.path(), "a", "a.sock", &name).unwrap();
        let said = acquire(&rt, dir.path(), "b", "b.sock", &name)
            .unwrap_err()
            .to_string();
        assert!(
            said.starts_with(&format!(
                "another tetherd (pid {}) runs in this network namespace",
                std::process::id()
            )),
            "{said}"
        );
    }
}
