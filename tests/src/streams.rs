//! Long-lived connections held through a live migration, and what they
//! saw: TCP and UDP streams that a test starts before a migration and
//! reads after it.
//!
//! A [`Stream`] is the measuring end of one connection, in a network
//! namespace of the test (a pod, a host outside the cluster): it sends a
//! counter every `interval`, on a fixed schedule, and times the echo of
//! each. The other end is `tether-echo` (`tests/guest/echo.rs`), in the
//! guest or in a netns, which answers each message with its number and the
//! peer address as that end sees it. The measuring end is never the guest:
//! a guest's clock stops while QEMU pauses it.
//!
//! Either end may open the connection. [`Stream::connect`] opens it from
//! the measuring end (a pod to the VM, a client to a NodePort);
//! [`Stream::listen_any`] waits for the echoing end to open it (the VM to a
//! host outside the cluster, the VM to a pod), which is what a connection
//! the VM opened through outbound NAT looks like.
//!
//! [`Stream::stop`] gives a [`StreamReport`]: whether the connection
//! survived (no reset or close, echoes coming to the end), the longest
//! stall (the longest time without an echo), the addresses the far end was
//! seen at, lost and duplicated messages (UDP), all on this machine's
//! monotonic clock so that they line up with QEMU's pause and the
//! probers'.
//!
//! Sockets are opened by a thread that entered the netns (a socket stays
//! in the netns it was created in), and used from threads of their own.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{
    IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::Netns;

/// How long a blocking read waits before it looks at the stop flag again.
const READ_SLICE: Duration = Duration::from_millis(50);

/// How long [`Stream::stop`] waits for echoes still on their way.
const STOP_DRAIN: Duration = Duration::from_millis(300);

/// A stream whose last echo is older than this when it stops was stalled
/// to the end: it did not survive.
pub const ALIVE_WITHIN: Duration = Duration::from_millis(500);

/// The transport of a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    /// One TCP connection; a reset, a close or a stall to the end kills it.
    Tcp,
    /// One UDP flow (a fixed address and port at each end).
    Udp,
}

impl Proto {
    /// `tcp` or `udp`, as `tether-echo` names it.
    pub fn name(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        }
    }
}

/// One echo received.
#[derive(Debug, Clone)]
struct Echo {
    seq: u64,
    at: Instant,
    /// The address the far end reported seeing this end at (what the
    /// echoing end's socket says), or, when this end listened, the address
    /// this end saw the far end at.
    far: String,
}

/// What the stream's threads record.
#[derive(Default)]
struct Record {
    /// Send time of message `seq` at index `seq`.
    sent: Vec<Instant>,
    echoes: Vec<Echo>,
    /// When the connection was up (TCP connected or accepted; UDP the
    /// first datagram from the far end when listening).
    opened: Option<Instant>,
    /// The first thing that went wrong, with when.
    error: Option<(Instant, String)>,
    /// Slots the sender could not keep (the machine was busy).
    skipped: u64,
    /// What TCP's own counters said (TCP only).
    tcp: TcpSeen,
}

/// TCP's view of the connection at this end, sampled at every send
/// (`TCP_INFO`): the retransmissions, and the longest wait for an
/// acknowledgement while data was outstanding. The far end's kernel sends
/// the acknowledgements: unlike the echoes, they do not wait for a process
/// of a guest that is still warming up after its migration.
#[derive(Debug, Default, Clone, Copy)]
struct TcpSeen {
    first_retrans: Option<u32>,
    last_retrans: u32,
    ack_stall_ms: u32,
    ack_stall_at: Option<Instant>,
}

/// Samples `TCP_INFO` of `s` into `seen`.
fn sample_tcp(s: &TcpStream, seen: &mut TcpSeen) {
    use std::os::fd::AsRawFd;
    // SAFETY: tcp_info is plain data; zeroed is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: a valid descriptor and a buffer of the size given.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            std::ptr::addr_of_mut!(info).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return;
    }
    seen.first_retrans.get_or_insert(info.tcpi_total_retrans);
    seen.last_retrans = info.tcpi_total_retrans;
    if info.tcpi_unacked > 0 && info.tcpi_last_ack_recv > seen.ack_stall_ms {
        seen.ack_stall_ms = info.tcpi_last_ack_recv;
        let back = Duration::from_millis(u64::from(info.tcpi_last_ack_recv));
        seen.ack_stall_at = Instant::now().checked_sub(back);
    }
}

struct Shared {
    record: Mutex<Record>,
    stop: AtomicBool,
}

impl Shared {
    fn record(&self) -> MutexGuard<'_, Record> {
        // A panic elsewhere cannot leave the record half-written.
        self.record.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn fail(&self, what: String) {
        let mut r = self.record();
        if r.error.is_none() {
            r.error = Some((Instant::now(), what));
        }
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }
}

/// The socket a stream talks through, once its connection is up.
enum Conn {
    Tcp(TcpStream),
    /// A UDP socket and the far end's address.
    Udp(UdpSocket, SocketAddr),
}

/// The measuring end of one connection (see the module doc).
pub struct Stream {
    name: String,
    proto: Proto,
    interval: Duration,
    listened: bool,
    shared: Arc<Shared>,
    /// A clone of the socket, to shut a TCP connection down at the stop
    /// (which wakes a blocked writer).
    socket: Arc<Mutex<Option<Conn>>>,
    /// The listeners that did not get the connection, kept open until the
    /// stop (see [`Stream::listen_any`]).
    listeners: Arc<Mutex<Vec<Waiting>>>,
    threads: Vec<JoinHandle<()>>,
}

impl Stream {
    /// Opens a connection from `ns` to `to` and starts streaming on it.
    /// A connection that cannot be opened is recorded as the stream's
    /// error (the report says so), not a panic.
    pub fn connect(
        ns: &Netns,
        name: &str,
        proto: Proto,
        to: SocketAddr,
        interval: Duration,
    ) -> Stream {
        let shared = Stream::shared();
        let opened = ns.run(|| open(proto, to));
        let mut stream = Stream::new(name, proto, interval, false, shared);
        match opened {
            Ok(conn) => stream.start(conn),
            Err(e) => stream
                .shared
                .fail(format!("opening {} to {to}: {e}", proto.name())),
        }
        stream
    }

    /// Waits in each of `nss` at once, on `port` of every address of
    /// `family`'s, for the echoing end to open the connection (a UDP far
    /// end says hello first), then streams on the first connection any of
    /// them gets (one netns: the far end's peer; several: the backends of
    /// a Service, of which the far end reaches one). The others keep
    /// listening (a connection moved to another backend mid-stream meets a
    /// listener there, as it would in a real Service, and is reset).
    pub fn listen_any(
        nss: &[&Netns],
        name: &str,
        proto: Proto,
        family: IpAddr,
        port: u16,
        interval: Duration,
    ) -> Stream {
        let any = match family {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        };
        let at = SocketAddr::new(any, port);
        let mut stream = Stream::new(name, proto, interval, true, Stream::shared());
        let mut waiting = Vec::new();
        for ns in nss {
            match ns.run(|| bind(proto, at)) {
                Ok(w) => waiting.push(w),
                Err(e) => {
                    stream.shared.fail(format!(
                        "binding {} {at} in {}: {e}",
                        proto.name(),
                        ns.name()
                    ));
                    return stream;
                }
            }
        }
        let shared = stream.shared.clone();
        let slot = stream.socket.clone();
        let listeners = stream.listeners.clone();
        let t = std::thread::Builder::new()
            .name(format!("stream-{name}"))
            .spawn(move || {
                if let Some(conn) = accept(waiting, &shared, &listeners) {
                    run(conn, proto, interval, true, shared, slot);
                }
            })
            .expect("spawning a stream thread");
        stream.threads.push(t);
        stream
    }

    fn shared() -> Arc<Shared> {
        Arc::new(Shared {
            record: Mutex::new(Record::default()),
            stop: AtomicBool::new(false),
        })
    }

    fn new(
        name: &str,
        proto: Proto,
        interval: Duration,
        listened: bool,
        shared: Arc<Shared>,
    ) -> Stream {
        assert!(!interval.is_zero(), "a stream needs a non-zero interval");
        Stream {
            name: name.to_owned(),
            proto,
            interval,
            listened,
            shared,
            socket: Arc::new(Mutex::new(None)),
            listeners: Arc::new(Mutex::new(Vec::new())),
            threads: Vec::new(),
        }
    }

    fn start(&mut self, conn: Conn) {
        let (shared, slot) = (self.shared.clone(), self.socket.clone());
        let (interval, proto) = (self.interval, self.proto);
        let t = std::thread::Builder::new()
            .name(format!("stream-{}", self.name))
            .spawn(move || run(conn, proto, interval, false, shared, slot))
            .expect("spawning a stream thread");
        self.threads.push(t);
    }

    /// The stream's name, as its report shows it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How many echoes have come back for messages sent at or after `t`.
    pub fn echoed_since(&self, t: Instant) -> u64 {
        let r = self.shared.record();
        r.echoes
            .iter()
            .filter(|e| r.sent.get(e.seq as usize).is_some_and(|s| *s >= t))
            .count() as u64
    }

    /// Waits until at least `n` echoes came back for messages sent from
    /// now on; false if `limit` passed first or the stream failed.
    pub fn wait_echoes(&self, n: u64, limit: Duration) -> bool {
        let from = Instant::now();
        while from.elapsed() < limit {
            if self.echoed_since(from) >= n {
                return true;
            }
            if self.shared.record().error.is_some() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    /// Where the stream stands, for a failure's message: its transport,
    /// what was sent and echoed, and TCP's own counters (whether the far
    /// end's kernel acknowledges what its process does not answer).
    pub fn state(&self) -> String {
        let r = self.shared.record();
        let mut out = format!(
            "{} [{}]: sent {}, echoed {}, opened {}, skipped {}",
            self.name,
            self.proto.name(),
            r.sent.len(),
            r.echoes.len(),
            if r.opened.is_some() { "yes" } else { "no" },
            r.skipped
        );
        if self.proto == Proto::Tcp {
            out.push_str(&format!(
                ", retransmissions {}, longest wait for an ack {} ms",
                r.tcp.last_retrans - r.tcp.first_retrans.unwrap_or(r.tcp.last_retrans),
                r.tcp.ack_stall_ms
            ));
        }
        if let Some((_, e)) = &r.error {
            out.push_str(&format!(", error: {e}"));
        }
        out
    }

    /// The stream's error so far, if any.
    pub fn error(&self) -> Option<String> {
        self.shared.record().error.as_ref().map(|(_, e)| e.clone())
    }

    /// Stops as [`Stream::stop`] does, once an echo came back for a
    /// message sent at or after `asked` (or `until` passed, or the stream
    /// failed): whether it is alive at the end is then a fact, not a time
    /// (a TCG guest on a busy machine may answer late, a dead connection
    /// never does).
    pub fn stop_once_alive(self, asked: Instant, until: Instant) -> StreamReport {
        while Instant::now() < until && self.echoed_since(asked) == 0 && self.error().is_none() {
            std::thread::sleep(Duration::from_millis(10));
        }
        let alive = self.echoed_since(asked) > 0;
        let mut report = self.stop();
        report.confirmed_alive = alive;
        report
    }

    /// Stops sending, waits briefly for the echoes still on their way, and
    /// returns what the stream saw.
    pub fn stop(mut self) -> StreamReport {
        let stopped = Instant::now();
        // Echoes of the last messages may still be on their way.
        let deadline = stopped + STOP_DRAIN;
        self.shared.stop.store(true, Ordering::Relaxed);
        while Instant::now() < deadline {
            let r = self.shared.record();
            let last = r.sent.len() as u64;
            let done = last == 0 || r.echoes.iter().any(|e| e.seq + 1 == last) || r.error.is_some();
            drop(r);
            if done {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        self.shutdown();
        let record = std::mem::take(&mut *self.shared.record());
        StreamReport::from_record(&self, record, stopped)
    }

    fn shutdown(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        let conn = self.socket.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(Conn::Tcp(s)) = conn {
            let _ = s.shutdown(Shutdown::Both);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        self.listeners
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream")
            .field("name", &self.name)
            .field("proto", &self.proto)
            .finish_non_exhaustive()
    }
}

/// Opens the connection (in the caller's netns).
fn open(proto: Proto, to: SocketAddr) -> io::Result<Conn> {
    match proto {
        Proto::Tcp => {
            let s = TcpStream::connect_timeout(&to, Duration::from_secs(5))?;
            s.set_nodelay(true)?;
            Ok(Conn::Tcp(s))
        }
        Proto::Udp => {
            let local: SocketAddr = match to {
                SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
                SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
            };
            let s = UdpSocket::bind(local)?;
            Ok(Conn::Udp(s, to))
        }
    }
}

/// A bound socket waiting for the far end.
enum Waiting {
    Tcp(TcpListener),
    Udp(UdpSocket),
}

impl Waiting {
    fn is_udp(&self) -> bool {
        matches!(self, Waiting::Udp(_))
    }
}

fn bind(proto: Proto, at: SocketAddr) -> io::Result<Waiting> {
    Ok(match proto {
        Proto::Tcp => Waiting::Tcp(TcpListener::bind(at)?),
        Proto::Udp => Waiting::Udp(UdpSocket::bind(at)?),
    })
}

/// Waits for the far end to open a connection on one of `waiting`; None
/// when stopped first. The others are parked in `rest`.
fn accept(mut waiting: Vec<Waiting>, shared: &Shared, rest: &Mutex<Vec<Waiting>>) -> Option<Conn> {
    for w in &waiting {
        let nonblocking = match w {
            Waiting::Tcp(l) => l.set_nonblocking(true),
            Waiting::Udp(s) => s.set_nonblocking(true),
        };
        if let Err(e) = nonblocking {
            shared.fail(format!("listening: {e}"));
            return None;
        }
    }
    let mut buf = [0u8; 64];
    loop {
        if shared.stopping() {
            shared.fail("the far end never connected".into());
            return None;
        }
        let mut got = None;
        for (i, w) in waiting.iter().enumerate() {
            let result = match w {
                Waiting::Tcp(l) => l.accept().map(|(s, _)| Conn::Tcp(s)),
                Waiting::Udp(s) => s
                    .recv_from(&mut buf)
                    .and_then(|(_, from)| Ok(Conn::Udp(s.try_clone()?, from))),
            };
            match result {
                Ok(conn) => {
                    got = Some((i, conn));
                    break;
                }
                Err(e) if timed_out(&e) => {}
                Err(e) if w.is_udp() => {
                    // An ICMP error for an earlier datagram: not ours.
                    let _ = e;
                }
                Err(e) => {
                    shared.fail(format!("accept: {e}"));
                    return None;
                }
            }
        }
        let Some((i, conn)) = got else {
            std::thread::sleep(Duration::from_millis(5));
            continue;
        };
        let conn = match conn {
            Conn::Tcp(s) => {
                let _ = s.set_nonblocking(false);
                let _ = s.set_nodelay(true);
                Conn::Tcp(s)
            }
            Conn::Udp(s, from) => {
                let _ = s.set_nonblocking(false);
                Conn::Udp(s, from)
            }
        };
        let won = waiting.remove(i);
        let mut parked = rest.lock().unwrap_or_else(|p| p.into_inner());
        parked.extend(waiting);
        // The winner's listening socket stays open too (TCP: a second
        // connection would be refused otherwise, not reset).
        parked.push(won);
        return Some(conn);
    }
}

fn timed_out(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Runs one connection: a reader thread, and the sender on this thread.
fn run(
    conn: Conn,
    proto: Proto,
    interval: Duration,
    listened: bool,
    shared: Arc<Shared>,
    slot: Arc<Mutex<Option<Conn>>>,
) {
    shared.record().opened = Some(Instant::now());
    let (reader, writer) = match split(&conn) {
        Ok(pair) => pair,
        Err(e) => {
            shared.fail(format!("cloning the socket: {e}"));
            return;
        }
    };
    *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(conn);
    let reading = {
        let shared = shared.clone();
        std::thread::spawn(move || read_loop(reader, proto, listened, &shared))
    };
    send_loop(writer, interval, &shared);
    let _ = reading.join();
}

fn split(conn: &Conn) -> io::Result<(Conn, Conn)> {
    Ok(match conn {
        Conn::Tcp(s) => {
            let r = s.try_clone()?;
            r.set_read_timeout(Some(READ_SLICE))?;
            (Conn::Tcp(r), Conn::Tcp(s.try_clone()?))
        }
        Conn::Udp(s, to) => {
            let r = s.try_clone()?;
            r.set_read_timeout(Some(READ_SLICE))?;
            (Conn::Udp(r, *to), Conn::Udp(s.try_clone()?, *to))
        }
    })
}

/// Sends `S <seq>` every `interval` on a fixed schedule: a late send never
/// shifts the ones after it, and slots missed entirely are counted.
fn send_loop(mut conn: Conn, interval: Duration, shared: &Shared) {
    let mut next = Instant::now();
    let mut seq: u64 = 0;
    while !shared.stopping() {
        let now = Instant::now();
        if now < next {
            std::thread::sleep((next - now).min(READ_SLICE));
            continue;
        }
        let message = format!("S {seq}");
        let sent_at = Instant::now();
        shared.record().sent.push(sent_at);
        let result = match &mut conn {
            Conn::Tcp(s) => {
                let written = s.write_all(format!("{message}\n").as_bytes());
                sample_tcp(s, &mut shared.record().tcp);
                written
            }
            Conn::Udp(s, to) => s.send_to(message.as_bytes(), *to).map(|_| ()),
        };
        if let Err(e) = result {
            match conn {
                // A UDP send can fail for a moment (an ICMP error from an
                // earlier datagram, no route during a change): the stream
                // goes on, and the missing echo counts as a loss.
                Conn::Udp(..) => {}
                Conn::Tcp(_) => {
                    if !shared.stopping() {
                        shared.fail(format!("write: {e}"));
                    }
                    return;
                }
            }
        }
        seq += 1;
        next += interval;
        let behind = Instant::now().saturating_duration_since(next);
        if behind > interval {
            let missed = (behind.as_nanos() / interval.as_nanos()) as u32;
            next += interval * missed;
            shared.record().skipped += u64::from(missed);
        }
    }
}

/// Reads echoes until the stop, a close or an error.
fn read_loop(mut conn: Conn, proto: Proto, listened: bool, shared: &Shared) {
    let mut pending = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let got = match &mut conn {
            Conn::Tcp(s) => s.read(&mut buf).map(|n| (n, None)),
            Conn::Udp(s, _) => s.recv_from(&mut buf).map(|(n, from)| (n, Some(from))),
        };
        let (n, from) = match got {
            Ok((0, _)) if proto == Proto::Tcp => {
                if !shared.stopping() {
                    shared.fail("closed by the far end".into());
                }
                return;
            }
            Ok(x) => x,
            Err(e) if timed_out(&e) => {
                if shared.stopping() {
                    return;
                }
                continue;
            }
            Err(e) => {
                if shared.stopping() {
                    return;
                }
                match proto {
                    Proto::Tcp => {
                        shared.fail(format!("read: {e}"));
                        return;
                    }
                    // An ICMP error (port unreachable while the far end
                    // moves) is reported once per datagram: go on.
                    Proto::Udp => continue,
                }
            }
        };
        let at = Instant::now();
        let tcp_peer = match (&conn, listened) {
            (Conn::Tcp(s), true) => s.peer_addr().ok().map(|p| p.to_string()),
            _ => None,
        };
        let mut lines = Vec::new();
        match proto {
            Proto::Tcp => {
                pending.extend_from_slice(&buf[..n]);
                while let Some(i) = pending.iter().position(|b| *b == b'\n') {
                    let line: Vec<u8> = pending.drain(..=i).collect();
                    lines.push(String::from_utf8_lossy(&line).trim().to_owned());
                }
            }
            Proto::Udp => lines.push(String::from_utf8_lossy(&buf[..n]).trim().to_owned()),
        }
        let mut r = shared.record();
        for line in lines {
            let mut words = line.split_whitespace();
            let (Some("E"), Some(seq), Some(far)) = (words.next(), words.next(), words.next())
            else {
                continue;
            };
            let Ok(seq) = seq.parse::<u64>() else {
                continue;
            };
            // Listening, this end saw the far end's address itself; else
            // the far end says what it saw.
            let far = match (listened, from, &tcp_peer) {
                (true, Some(from), _) => from.to_string(),
                (true, None, Some(peer)) => peer.clone(),
                _ => far.to_owned(),
            };
            r.echoes.push(Echo { seq, at, far });
        }
    }
}

/// What one stream saw, on this machine's monotonic clock.
#[derive(Debug, Clone)]
pub struct StreamReport {
    /// The stream's name (the path it stands for).
    pub name: String,
    /// Its transport.
    pub proto: Proto,
    /// Whether the far end opened the connection (toward this end).
    pub listened: bool,
    /// Messages sent.
    pub sent: u64,
    /// Messages echoed (each counted once).
    pub echoed: u64,
    /// Echoes of a message already echoed (UDP: a datagram delivered
    /// twice).
    pub duplicates: u64,
    /// Messages sent more than `STOP_DRAIN` before the stop and never
    /// echoed.
    pub lost: u64,
    /// The longest time without an echo, from the first echo to the last
    /// (or to the stop, when the stream was stalled at the end), and when
    /// it began.
    pub longest_stall: Duration,
    /// When the longest stall began.
    pub stall_from: Option<Instant>,
    /// The last echo.
    pub last_echo: Option<Instant>,
    /// Whether, asked at the end, it echoed again before it stopped (see
    /// [`Stream::stop_once_alive`]).
    pub confirmed_alive: bool,
    /// When the stream stopped.
    pub stopped: Instant,
    /// The first thing that went wrong (a reset, a close, a write error),
    /// with when.
    pub error: Option<(Instant, String)>,
    /// The addresses the far end saw this end at (or, when this end
    /// listened, this end saw the far end at), in the order they first
    /// appeared: more than one means a translation changed mid-stream.
    pub far_addresses: Vec<String>,
    /// Send slots missed because the machine was busy.
    pub skipped: u64,
    /// The longest run of consecutive messages never echoed: when its
    /// first was sent, and how many.
    pub longest_loss: Option<(Instant, u64)>,
    /// TCP: segments this end retransmitted while the stream ran.
    pub retransmits: Option<u32>,
    /// TCP: the longest wait for an acknowledgement while data was
    /// outstanding (to the resolution of the send interval), and when it
    /// began.
    pub ack_stall: Option<(Duration, Option<Instant>)>,
    /// When each message's first echo arrived, in order.
    arrivals: Vec<Instant>,
    /// Whether something sent after the last echo was still unanswered at
    /// the stop.
    outstanding: bool,
}

impl StreamReport {
    fn from_record(stream: &Stream, r: Record, stopped: Instant) -> StreamReport {
        let mut seen = vec![false; r.sent.len()];
        let mut duplicates = 0;
        let mut arrivals = Vec::with_capacity(r.echoes.len());
        let mut far_addresses: Vec<String> = Vec::new();
        for e in &r.echoes {
            match seen.get_mut(e.seq as usize) {
                Some(s) if *s => duplicates += 1,
                Some(s) => {
                    *s = true;
                    arrivals.push(e.at);
                    if !far_addresses.contains(&e.far) {
                        far_addresses.push(e.far.clone());
                    }
                }
                None => {}
            }
        }
        arrivals.sort();
        let (mut longest, mut from) = (Duration::ZERO, None);
        for w in arrivals.windows(2) {
            if w[1] - w[0] > longest {
                longest = w[1] - w[0];
                from = Some(w[0]);
            }
        }
        let last_echo = arrivals.last().copied();
        let echoed = seen.iter().filter(|s| **s).count() as u64;
        let sent = r.sent.len() as u64;
        // Waiting for echoes at the end counts as a stall, when something
        // was sent after the last echo arrived.
        let outstanding = last_echo.is_some_and(|last| r.sent.last().is_some_and(|s| *s > last));
        if let Some(last) = last_echo {
            if outstanding && stopped.saturating_duration_since(last) > longest {
                longest = stopped - last;
                from = Some(last);
            }
        }
        let lost = r
            .sent
            .iter()
            .enumerate()
            .filter(|(i, s)| **s + STOP_DRAIN < stopped && !seen[*i])
            .count() as u64;
        let mut longest_loss: Option<(Instant, u64)> = None;
        let mut run: Option<(Instant, u64)> = None;
        for (i, sent_at) in r.sent.iter().enumerate() {
            if *sent_at + STOP_DRAIN >= stopped {
                break;
            }
            if seen[i] {
                run = None;
                continue;
            }
            let cur = run.get_or_insert((*sent_at, 0));
            cur.1 += 1;
            if longest_loss.is_none_or(|(_, n)| cur.1 > n) {
                longest_loss = Some(*cur);
            }
        }
        StreamReport {
            name: stream.name.clone(),
            proto: stream.proto,
            listened: stream.listened,
            sent,
            echoed,
            duplicates,
            lost,
            longest_stall: longest,
            stall_from: from,
            last_echo,
            confirmed_alive: false,
            stopped,
            error: r.error,
            far_addresses,
            skipped: r.skipped,
            longest_loss,
            retransmits: r
                .tcp
                .first_retrans
                .map(|f| r.tcp.last_retrans.saturating_sub(f)),
            ack_stall: r.tcp.first_retrans.map(|_| {
                (
                    Duration::from_millis(u64::from(r.tcp.ack_stall_ms)),
                    r.tcp.ack_stall_at,
                )
            }),
            arrivals,
            outstanding,
        }
    }

    /// Whether the connection lived through to the stop: no reset, close
    /// or write error, and echoes still coming at the end: within
    /// [`ALIVE_WITHIN`] of the stop, or, for a stream stopped by
    /// [`Stream::stop_once_alive`], for a message sent after it was asked
    /// (nothing stalled to the end).
    pub fn survived(&self) -> bool {
        self.error.is_none()
            && (self.confirmed_alive
                || self
                    .last_echo
                    .is_some_and(|l| self.stopped.saturating_duration_since(l) <= ALIVE_WITHIN))
    }

    /// Whether the far end always saw one and the same address (a
    /// translation that held).
    pub fn one_address(&self) -> bool {
        self.far_addresses.len() == 1
    }

    /// The longest stall that overlapped `from..to` (a gap between two
    /// echoes, or the wait from the last echo to the stop), and when it
    /// began: what an event in that window cost the stream, unlike
    /// [`StreamReport::longest_stall`], which may be the stream's start.
    pub fn stall_within(&self, from: Instant, to: Instant) -> Option<(Duration, Instant)> {
        let tail = self
            .arrivals
            .last()
            .filter(|_| self.outstanding)
            .map(|last| (*last, self.stopped));
        self.arrivals
            .windows(2)
            .map(|w| (w[0], w[1]))
            .chain(tail)
            .filter(|(a, b)| *a < to && *b > from)
            .map(|(a, b)| (b - a, a))
            .max_by_key(|(d, _)| *d)
    }

    /// One line for a test's output or a benchmark's table.
    pub fn line(&self) -> String {
        let tcp = match (self.ack_stall, self.retransmits) {
            (Some((stall, _)), Some(r)) => {
                format!("  ack stall {:>4} ms retrans {r}", stall.as_millis())
            }
            _ => String::new(),
        };
        format!(
            "{:<34} {} {:<8} stall {:>7.1} ms  sent {:>5} echoed {:>5} lost {:>4} dup {:>3}{tcp}  far {}{}",
            self.name,
            self.proto.name(),
            if self.survived() { "survived" } else { "DIED" },
            self.longest_stall.as_secs_f64() * 1e3,
            self.sent,
            self.echoed,
            self.lost,
            self.duplicates,
            self.far_addresses.join(" -> "),
            self.error
                .as_ref()
                .map(|(_, e)| format!("  error: {e}"))
                .unwrap_or_default()
        )
    }
}

impl fmt::Display for StreamReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.line())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(sent: &[u64], echoes: &[(u64, u64)], stop_ms: u64) -> StreamReport {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let stream = Stream::new(
            "s",
            Proto::Tcp,
            Duration::from_millis(5),
            false,
            Stream::shared(),
        );
        let record = Record {
            sent: sent.iter().map(|ms| at(*ms)).collect(),
            echoes: echoes
                .iter()
                .map(|(seq, ms)| Echo {
                    seq: *seq,
                    at: at(*ms),
                    far: "10.0.0.1:7000".into(),
                })
                .collect(),
            ..Record::default()
        };
        StreamReport::from_record(&stream, record, at(stop_ms))
    }

    #[test]
    fn the_longest_stall_is_the_longest_gap_between_echoes() {
        let r = report(&[0, 5, 10, 15], &[(0, 1), (1, 6), (2, 300), (3, 301)], 302);
        assert_eq!(r.longest_stall, Duration::from_millis(294));
        assert!(r.survived());
        assert_eq!((r.sent, r.echoed, r.lost, r.duplicates), (4, 4, 0, 0));
        assert!(r.one_address());
    }

    #[test]
    fn a_stream_that_stops_echoing_did_not_survive_and_stalled_to_the_end() {
        let r = report(&[0, 5, 10, 2000], &[(0, 1), (1, 6)], 3000);
        assert!(!r.survived());
        assert_eq!(r.longest_stall, Duration::from_millis(2994));
        assert_eq!(r.lost, 2);
    }

    #[test]
    fn a_stall_within_a_window_ignores_a_longer_one_before_it() {
        let r = report(
            &[0, 5, 10, 15, 20],
            &[(0, 1), (1, 500), (2, 510), (3, 700), (4, 705)],
            706,
        );
        let t0 = r.stopped - Duration::from_millis(706);
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        assert_eq!(r.longest_stall, Duration::from_millis(499));
        let (d, from) = r.stall_within(at(600), at(706)).expect("a stall");
        assert_eq!((d, from), (Duration::from_millis(190), at(510)));
        assert_eq!(
            r.stall_within(at(501), at(505)).map(|s| s.0),
            Some(Duration::from_millis(10))
        );
    }

    #[test]
    fn a_datagram_echoed_twice_counts_once_and_as_a_duplicate() {
        let r = report(&[0, 5], &[(0, 1), (0, 2), (1, 6)], 7);
        assert_eq!((r.echoed, r.duplicates), (2, 1));
    }

    #[test]
    fn a_dropped_stream_to_nowhere_reports_its_error() {
        let s = Stream::new(
            "s",
            Proto::Tcp,
            Duration::from_millis(5),
            false,
            Stream::shared(),
        );
        s.shared.fail("opening tcp: refused".into());
        let r = s.stop();
        assert!(!r.survived());
        assert!(r.error.is_some_and(|(_, e)| e.contains("refused")));
    }
}
