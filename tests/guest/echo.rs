//! tether-echo: the guest's end of the connection streams of
//! `tests/src/streams.rs`. It answers every message of a stream with the
//! message's sequence number and the peer address as this end sees it, and
//! it never measures anything: the guest's clock stops while QEMU pauses it,
//! so the timing is done at the other end, on the test machine's clock.
//!
//! Built by `tests/guest/build.sh` with `rustc` alone (std only, statically
//! linked) into the test guest's initramfs.
//!
//!   tether-echo tcp-listen PORT        serve every connection on PORT
//!   tether-echo udp-listen PORT        answer every datagram on PORT (from
//!                                      several sockets, see UDP_SOCKETS)
//!   tether-echo tcp-connect ADDR PORT  open one connection, then answer on it
//!   tether-echo udp-connect ADDR PORT  say hello until the far end speaks
//!
//! Wire format (one line per message on TCP, one datagram each on UDP):
//! the driver sends `S <seq>`, this end answers `E <seq> <peer>`; a UDP
//! connector sends `H` until the first `S` arrives, so that the far end
//! learns its address. Every line it prints for the test starts `ECHO `.

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::time::Duration;

/// How often a connector tries again while the far end is not there yet.
const RETRY: Duration = Duration::from_millis(200);

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    let result = match words.as_slice() {
        ["tcp-listen", port] => port_of(port).and_then(tcp_listen),
        ["udp-listen", port] => port_of(port).and_then(udp_listen),
        ["tcp-connect", addr, port] => target(addr, port).and_then(tcp_connect),
        ["udp-connect", addr, port] => target(addr, port).and_then(udp_connect),
        _ => Err(
            "usage: tether-echo tcp-listen PORT | udp-listen PORT | tcp-connect ADDR PORT | \
             udp-connect ADDR PORT"
                .to_string(),
        ),
    };
    if let Err(e) = result {
        println!("ECHO error {}: {e}", args.join(" "));
        std::process::exit(1);
    }
}

fn port_of(s: &str) -> Result<u16, String> {
    s.parse().map_err(|_| format!("not a port: {s}"))
}

fn target(addr: &str, port: &str) -> Result<SocketAddr, String> {
    let ip: IpAddr = addr.parse().map_err(|_| format!("not an address: {addr}"))?;
    Ok(SocketAddr::new(ip, port_of(port)?))
}

/// An address as the far end of the test reads it: IPv4 without the
/// IPv6-mapped form a dual-stack socket reports.
fn show(peer: SocketAddr) -> String {
    match peer.ip() {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), peer.port()).to_string(),
            None => peer.to_string(),
        },
        IpAddr::V4(_) => peer.to_string(),
    }
}

/// The answer to one message, or None for anything that is not `S <seq>`.
fn answer(message: &str, peer: &str) -> Option<String> {
    let seq = message.trim().strip_prefix("S ")?;
    seq.parse::<u64>().ok()?;
    Some(format!("E {seq} {peer}"))
}

/// Answers every line on `stream` until it ends; says how it ended.
fn serve(stream: TcpStream) -> String {
    let peer = match stream.peer_addr() {
        Ok(p) => show(p),
        Err(e) => return format!("no peer address: {e}"),
    };
    let _ = stream.set_nodelay(true);
    let mut writer = match stream.try_clone() {
        Ok(w) => w,
        Err(e) => return format!("{peer}: {e}"),
    };
    let reader = BufReader::new(stream);
    for line in reader.lines() {
        let line = match line {
            Ok(l) => l,
            Err(e) => return format!("{peer}: read: {e}"),
        };
        if let Some(reply) = answer(&line, &peer) {
            if let Err(e) = writer.write_all(format!("{reply}\n").as_bytes()) {
                return format!("{peer}: write: {e}");
            }
        }
    }
    format!("{peer}: closed by the far end")
}

fn tcp_listen(port: u16) -> Result<(), String> {
    let listener = TcpListener::bind(("::", port))
        .or_else(|_| TcpListener::bind(("0.0.0.0", port)))
        .map_err(|e| format!("binding TCP port {port}: {e}"))?;
    println!("ECHO listening tcp {port}");
    for stream in listener.incoming() {
        match stream {
            Ok(s) => {
                std::thread::spawn(move || {
                    let end = serve(s);
                    println!("ECHO ended tcp {port} {end}");
                });
            }
            Err(e) => println!("ECHO accept tcp {port}: {e}"),
        }
    }
    Ok(())
}

/// How many sockets (each with its own thread) share the UDP port. One
/// thread serving every stream toward the guest fell behind on a busy
/// machine: the guest's one vCPU is shared fairly among its runnable
/// threads (a TCP stream has a thread of its own), so a single UDP thread
/// got one share for ten streams, its receive queue filled and most
/// datagrams were dropped. SO_REUSEPORT spreads the peers over the
/// sockets by their addresses, so each peer stays on one socket.
const UDP_SOCKETS: usize = 8;

/// Each UDP socket's receive buffer (SO_RCVBUF; the kernel doubles it):
/// small, so that a guest that falls behind drops datagrams, which the
/// driver counts as lost, instead of answering each from the back of a
/// long queue. With the default (about 200 KiB, some 250 datagrams)
/// a busy guest answered every datagram tens of seconds late, and a
/// stream that was alive looked dead.
const UDP_RCVBUF: i32 = 16 * 1024;

fn udp_listen(port: u16) -> Result<(), String> {
    let mut sockets = Vec::new();
    for _ in 0..UDP_SOCKETS {
        sockets.push(reuseport_udp6(port).map_err(|e| format!("binding UDP port {port}: {e}"))?);
    }
    println!("ECHO listening udp {port}");
    let threads: Vec<_> = sockets
        .into_iter()
        .map(|socket| std::thread::spawn(move || udp_serve(&socket)))
        .collect();
    for t in threads {
        if let Ok(Err(e)) = t.join() {
            return Err(format!("UDP port {port}: {e}"));
        }
    }
    Ok(())
}

/// Answers every datagram on `socket`; returns only on an error.
fn udp_serve(socket: &UdpSocket) -> Result<(), String> {
    let mut buf = [0u8; 512];
    loop {
        let (n, from) = socket.recv_from(&mut buf).map_err(|e| e.to_string())?;
        let message = String::from_utf8_lossy(&buf[..n]);
        if let Some(reply) = answer(&message, &show(from)) {
            // A full socket buffer or an unreachable peer loses one answer,
            // which the driver counts; the stream goes on.
            let _ = socket.send_to(reply.as_bytes(), from);
        }
    }
}

/// A UDP socket on `[::]:port` (IPv4 too, as IPv4-mapped addresses) with
/// SO_REUSEPORT set before the bind, which std cannot do, and a receive
/// buffer of [`UDP_RCVBUF`].
fn reuseport_udp6(port: u16) -> Result<UdpSocket, String> {
    use std::os::fd::FromRawFd;
    const AF_INET6: i32 = 10;
    const SOCK_DGRAM: i32 = 2;
    const SOCK_CLOEXEC: i32 = 0o2000000;
    const SOL_SOCKET: i32 = 1;
    const SO_REUSEPORT: i32 = 15;
    const SO_RCVBUF: i32 = 8;
    /// struct sockaddr_in6.
    #[repr(C)]
    struct SockaddrIn6 {
        family: u16,
        port: u16,
        flowinfo: u32,
        addr: [u8; 16],
        scope_id: u32,
    }
    extern "C" {
        fn socket(domain: i32, ty: i32, protocol: i32) -> i32;
        fn setsockopt(fd: i32, level: i32, name: i32, value: *const u8, len: u32) -> i32;
        fn bind(fd: i32, addr: *const SockaddrIn6, len: u32) -> i32;
    }
    // SAFETY: plain system calls on a descriptor this function owns, with
    // buffers of the sizes given; the descriptor goes into the UdpSocket,
    // which closes it, before any early return but the first.
    unsafe {
        let fd = socket(AF_INET6, SOCK_DGRAM | SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error().to_string());
        }
        let socket = UdpSocket::from_raw_fd(fd);
        let one: i32 = 1;
        let value = (&one as *const i32).cast::<u8>();
        if setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, value, 4) != 0 {
            return Err(format!("SO_REUSEPORT: {}", std::io::Error::last_os_error()));
        }
        let size = (&UDP_RCVBUF as *const i32).cast::<u8>();
        if setsockopt(fd, SOL_SOCKET, SO_RCVBUF, size, 4) != 0 {
            return Err(format!("SO_RCVBUF: {}", std::io::Error::last_os_error()));
        }
        let addr = SockaddrIn6 {
            family: AF_INET6 as u16,
            port: port.to_be(),
            flowinfo: 0,
            addr: [0; 16],
            scope_id: 0,
        };
        if bind(fd, &addr, std::mem::size_of::<SockaddrIn6>() as u32) != 0 {
            return Err(std::io::Error::last_os_error().to_string());
        }
        Ok(socket)
    }
}

fn tcp_connect(to: SocketAddr) -> Result<(), String> {
    let stream = loop {
        match TcpStream::connect_timeout(&to, Duration::from_secs(2)) {
            Ok(s) => break s,
            Err(_) => std::thread::sleep(RETRY),
        }
    };
    println!("ECHO connected tcp {to}");
    let end = serve(stream);
    println!("ECHO ended tcp {to} {end}");
    Ok(())
}

fn udp_connect(to: SocketAddr) -> Result<(), String> {
    let local = if to.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
    let socket = UdpSocket::bind(local).map_err(|e| format!("binding UDP: {e}"))?;
    socket
        .connect(to)
        .map_err(|e| format!("UDP connect to {to}: {e}"))?;
    socket
        .set_read_timeout(Some(RETRY))
        .map_err(|e| format!("UDP timeout: {e}"))?;
    println!("ECHO connected udp {to}");
    let peer = show(to);
    let mut heard = false;
    let mut buf = [0u8; 512];
    loop {
        if !heard {
            // Errors (an unreachable far end not there yet) are retried.
            let _ = socket.send(b"H");
        }
        match socket.recv(&mut buf) {
            Ok(n) => {
                let message = String::from_utf8_lossy(&buf[..n]);
                if let Some(reply) = answer(&message, &peer) {
                    heard = true;
                    let _ = socket.send(reply.as_bytes());
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            // An ICMP error from an earlier send (connection refused while
            // the far end was not listening yet): go on.
            Err(_) => std::thread::sleep(RETRY),
        }
    }
}
