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
//!   tether-echo udp-listen PORT        answer every datagram on PORT
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

fn udp_listen(port: u16) -> Result<(), String> {
    let socket = UdpSocket::bind(("::", port))
        .or_else(|_| UdpSocket::bind(("0.0.0.0", port)))
        .map_err(|e| format!("binding UDP port {port}: {e}"))?;
    println!("ECHO listening udp {port}");
    let mut buf = [0u8; 512];
    loop {
        let (n, from) = socket
            .recv_from(&mut buf)
            .map_err(|e| format!("UDP port {port}: {e}"))?;
        let message = String::from_utf8_lossy(&buf[..n]);
        if let Some(reply) = answer(&message, &show(from)) {
            // A full socket buffer or an unreachable peer loses one answer,
            // which the driver counts; the stream goes on.
            let _ = socket.send_to(reply.as_bytes(), from);
        }
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
