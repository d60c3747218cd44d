//! `tetherd` over an in-memory kernel and node: the control plane alone,
//! for scale runs of hundreds of nodes on one machine (`tether-bench
//! scale --control-only`). Everything else is the daemon's own library
//! (`tetherd::daemon::run`) with `tetherd`'s flags: its store (etcd or the
//! Kubernetes API), its IPAM, liveness, VM records, cutovers, cutover
//! notices and route planning.
//!
//! **A test double** in what stands for the kernel and the node
//! (`tether_kernel::fake`): veths, routes, the handover's conntrack and
//! nftables, and the guest DHCP service are values in memory. It cannot
//! show that a kernel takes the routes or forwards a packet, nor time the
//! kernel's work; the per-node figures it gives are the control plane's.
//!
//! Since no frame reaches it, it takes its orders on a unix socket beside
//! the daemon's (`<--socket>.fake`), one line per connection:
//!
//! - `announce <netns> <mac>`: a RARP for `mac`, seen now on the node-side
//!   veth of the pod whose netns is `<netns>` (as QEMU's after a
//!   migration). Answers `ok <ifindex>`.
//! - `routes`: the in-memory route table, one route a line:
//!   `<dst> <via or -> <dev or -> <protocol>`.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use tether_kernel::fake::{FakeHost, FakeKernel};
use tether_kernel::{AnnounceKind, Announcement, Kernel};
use tetherd::daemon::options::Options;
use tetherd::daemon::{self, Fatal, Seams};

#[derive(Debug, Parser)]
#[command(name = "tetherd_control_only")]
struct Cli {
    #[command(flatten)]
    daemon: Options,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tether_e2e::init_daemon_logs(&cli.daemon.log_level);
    let kernel = FakeKernel::for_daemon();
    let host = Arc::new(FakeHost::new());
    let orders = PathBuf::from(format!("{}.fake", cli.daemon.socket.display()));
    if let Err(e) = listen(&orders, kernel.clone(), host.clone()) {
        eprintln!("cannot listen on {}: {e}", orders.display());
        return ExitCode::FAILURE;
    }
    let seams = Seams {
        kernel: Some(Box::new(move |_real| Arc::new(kernel) as Arc<dyn Kernel>)),
        host: Some(host),
        ..Seams::default()
    };
    // Two worker threads, as `tetherd` has on a 2-core node.
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let out = runtime.block_on(daemon::run(cli.daemon, seams));
    let _ = std::fs::remove_file(&orders);
    match out {
        Ok(()) => ExitCode::SUCCESS,
        Err(Fatal(message)) => {
            tracing::error!("{message}");
            ExitCode::FAILURE
        }
    }
}

/// Serves the orders socket on a thread of its own.
fn listen(path: &Path, kernel: FakeKernel, host: Arc<FakeHost>) -> std::io::Result<()> {
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path)?;
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            if let Err(e) = answer(conn, &kernel, &host) {
                tracing::warn!(error = %e, "an order on the fake socket failed");
            }
        }
    });
    Ok(())
}

fn answer(conn: UnixStream, kernel: &FakeKernel, host: &FakeHost) -> std::io::Result<()> {
    let mut line = String::new();
    BufReader::new(&conn).read_line(&mut line)?;
    let seen = Instant::now();
    let words: Vec<&str> = line.split_whitespace().collect();
    let reply = match words.as_slice() {
        ["announce", netns, mac] => announce(kernel, host, Path::new(netns), mac, seen),
        ["routes"] => Ok(kernel
            .routes()
            .iter()
            .map(|(dst, r)| {
                let via = r.via.map_or("-".to_owned(), |v| v.to_string());
                let dev = r.dev.clone().unwrap_or_else(|| "-".to_owned());
                format!("{dst} {via} {dev} {}\n", r.protocol)
            })
            .collect()),
        _ => Err(format!("unknown order {:?}", line.trim())),
    };
    let mut w = &conn;
    match reply {
        Ok(text) => w.write_all(text.as_bytes()),
        Err(e) => w.write_all(format!("error {e}\n").as_bytes()),
    }
}

/// A RARP for `mac` on the node-side veth of the pod in `netns`.
fn announce(
    kernel: &FakeKernel,
    host: &FakeHost,
    netns: &Path,
    mac: &str,
    seen: Instant,
) -> Result<String, String> {
    let mac = parse_mac(mac).ok_or_else(|| format!("{mac:?} is not a MAC"))?;
    let ifindex = kernel
        .links()
        .values()
        .filter(|l| l.netns == netns)
        .map(|l| l.index)
        .max()
        .ok_or_else(|| format!("no veth of a pod in {}", netns.display()))?;
    host.announce(Announcement {
        ifindex,
        mac,
        kind: AnnounceKind::Rarp,
        seen,
    });
    Ok(format!("ok {ifindex}\n"))
}

fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let bytes: Vec<u8> = text
        .split(':')
        .map(|b| u8::from_str_radix(b, 16).ok())
        .collect::<Option<_>>()?;
    bytes.try_into().ok()
}
