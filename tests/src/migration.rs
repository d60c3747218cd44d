//! Tools for an end-to-end test of VM live migration between network
//! namespaces.
//!
//! - [`Prober`]: a steady ICMP echo stream (2000 per second in the test)
//!   from inside a netns to one address, either family, recording every
//!   probe; its [`ProbeReport`] turns the record into [`LossWindow`]s, the
//!   intervals during which the path did not work;
//! - [`send_rarp`], [`send_garp`]: one announcement frame, as QEMU sends
//!   after a migration, from a link inside a netns;
//! - [`pause_icmp`]: makes a netns stop (or resume) answering echo
//!   requests, a cheap way to cut a path for a known time.
//!
//! Sockets are opened by a thread that entered the netns (see
//! [`Netns::run`]): a socket stays in the netns it was created in, so the
//! threads using it later need not enter the netns themselves.

use std::ffi::CString;
use std::fmt;
use std::fs::OpenOptions;
use std::io::{self, Write};
use std::mem;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::Netns;

/// A reply that comes later than this after its probe's send counts as
/// lost: a path that takes a second to answer is not working.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(1);

/// How long [`Prober::stop`] keeps listening, after the last send, for the
/// replies still on their way (it stops earlier once all have come).
pub const STOP_DRAIN: Duration = Duration::from_millis(200);

/// The longest the prober thread waits in one poll, so that it sees a stop
/// request quickly even with a long interval.
const POLL_SLICE: Duration = Duration::from_millis(10);

/// The receive buffer asked for: room for seconds of replies at 2000 per
/// second, so a descheduled prober thread loses nothing.
const RCVBUF_BYTES: libc::c_int = 4 << 20;

/// ICMP header (8 bytes), then the prober's token and the probe's full
/// sequence number (8 bytes each, big endian).
const ECHO_LEN: usize = 24;

/// Ethernet broadcast, the destination of every announcement.
pub const BROADCAST_MAC: [u8; 6] = [0xff; 6];
/// The ethertype of RARP, which QEMU's announcements use.
pub const ETH_P_RARP: u16 = 0x8035;
/// The ethertype of ARP.
pub const ETH_P_ARP: u16 = 0x0806;
/// The length of an announcement frame: the Ethernet minimum without FCS,
/// as QEMU pads it.
pub const ANNOUNCE_FRAME_LEN: usize = 60;

// ---------------------------------------------------------------------------
// Prober

/// A steady ICMP echo stream from inside a netns to one address, IPv4 or
/// IPv6 after the address's family.
///
/// One thread sends an echo request every `interval` on a fixed schedule
/// (a late send never shifts the ones after it) and reads replies between
/// sends. Each probe carries the prober's own identifier and token and a
/// 64-bit sequence number, read back from the reply, so 16-bit wrap and
/// other ICMP traffic in the netns do not matter. Stopped by
/// [`Prober::stop`], or on drop.
pub struct Prober {
    target: IpAddr,
    interval: Duration,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<Tally>>,
}

/// What the prober thread and its owner share.
struct Shared {
    /// One record per probe, in send order (so in send-time order).
    probes: Mutex<Vec<ProbeRecord>>,
    stop: AtomicBool,
}

impl Shared {
    fn probes(&self) -> MutexGuard<'_, Vec<ProbeRecord>> {
        // A panic elsewhere cannot leave the records half-written.
        self.probes.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Counters only the prober thread keeps, handed back when it ends.
#[derive(Default)]
struct Tally {
    send_errors: u64,
    skipped_slots: u64,
}

impl Prober {
    /// Starts probing `target` from inside `ns`, one echo request every
    /// `interval`; panics if the raw socket cannot be opened.
    ///
    /// `target` must be reachable without a scope (not IPv6 link-local).
    pub fn start(ns: &Netns, target: IpAddr, interval: Duration) -> Prober {
        assert!(!interval.is_zero(), "a prober needs a non-zero interval");
        let sock = ns
            .run(|| open_icmp_socket(target))
            .unwrap_or_else(|e| panic!("opening a raw ICMP socket in {}: {e}", ns.name()));
        let ident = Ident::next();
        let shared = Arc::new(Shared {
            probes: Mutex::new(Vec::with_capacity(probes_for(interval))),
            stop: AtomicBool::new(false),
        });
        let thread = std::thread::Builder::new()
            .name("prober".into())
            .spawn({
                let shared = Arc::clone(&shared);
                move || probe_loop(&sock, target, interval, ident, &shared)
            })
            .expect("spawning the prober thread");
        Prober {
            target,
            interval,
            shared,
            thread: Some(thread),
        }
    }

    /// How many probes have been sent so far.
    pub fn sent(&self) -> u64 {
        self.shared.probes().len() as u64
    }

    /// How many probes sent at or after `t` have been answered (within
    /// [`REPLY_TIMEOUT`]) so far: lets a test wait until the path works
    /// again without stopping the stream.
    pub fn received_since(&self, t: Instant) -> u64 {
        let probes = self.shared.probes();
        let from = probes.partition_point(|p| p.sent < t);
        probes[from..].iter().filter(|p| p.answered()).count() as u64
    }

    /// Stops sending, waits up to [`STOP_DRAIN`] for the replies still on
    /// their way, and returns the whole record.
    pub fn stop(mut self) -> ProbeReport {
        let tally = self.join();
        let probes = mem::take(&mut *self.shared.probes());
        ProbeReport::from_records(self.target, self.interval, probes, tally)
    }

    fn join(&mut self) -> Tally {
        self.shared.stop.store(true, Ordering::Relaxed);
        match self.thread.take() {
            Some(thread) => thread
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p)),
            None => Tally::default(),
        }
    }
}

impl Drop for Prober {
    fn drop(&mut self) {
        // Never panic in drop; a panic of the thread was already printed.
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl fmt::Debug for Prober {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Prober")
            .field("target", &self.target)
            .field("interval", &self.interval)
            .field("sent", &self.sent())
            .finish_non_exhaustive()
    }
}

/// How many records to reserve for: a minute of probes, at most.
fn probes_for(interval: Duration) -> usize {
    let per_minute = Duration::from_secs(60).as_nanos() / interval.as_nanos();
    per_minute.min(1 << 20) as usize
}

/// The identifier in the ICMP header and the token in the payload that mark
/// one prober's probes.
#[derive(Clone, Copy)]
struct Ident {
    id: u16,
    token: u64,
}

impl Ident {
    /// Distinct for every prober of this process, and unlikely to match
    /// another process's.
    fn next() -> Ident {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = u64::from(NEXT.fetch_add(1, Ordering::Relaxed));
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let pid = u64::from(std::process::id());
        Ident {
            // Consecutive in a process, so two probers never share one.
            id: (pid as u16).wrapping_mul(31).wrapping_add(n as u16),
            token: mix((pid << 32) ^ nanos ^ (n << 48)),
        }
    }
}

/// splitmix64's finaliser: spreads `x` over all 64 bits.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The prober thread: send on the schedule, read replies in between, then
/// drain after a stop request.
fn probe_loop(
    sock: &OwnedFd,
    target: IpAddr,
    interval: Duration,
    ident: Ident,
    shared: &Shared,
) -> Tally {
    let dest = SockAddr::ip(target);
    let v6 = target.is_ipv6();
    let mut tally = Tally::default();
    let mut buf = [0u8; 2048];
    let t0 = Instant::now();
    let mut slot: u64 = 0;
    let mut seq: u64 = 0;
    while !shared.stop.load(Ordering::Relaxed) {
        let deadline = t0 + times(interval, slot);
        let now = Instant::now();
        if now < deadline {
            wait_for_replies(
                sock,
                (deadline - now).min(POLL_SLICE),
                v6,
                ident,
                shared,
                &mut buf,
            );
            continue;
        }
        // Behind by whole intervals (the thread was descheduled): skip
        // those slots rather than send a burst, so probes stay evenly
        // spread and each one still measures its own moment.
        let behind = ((now - deadline).as_nanos() / interval.as_nanos()) as u64;
        tally.skipped_slots += behind;
        slot += behind + 1;

        let packet = echo_request(v6, ident, seq);
        // Recorded before the send, so even an instant reply finds it.
        shared.probes().push(ProbeRecord {
            sent: Instant::now(),
            reply: None,
            duplicates: 0,
        });
        if dest.send_to(sock, &packet).is_err() {
            // The probe stays recorded, unanswered: a path that refuses to
            // send (no route, neighbour failed) is a path that does not
            // work.
            tally.send_errors += 1;
        }
        seq += 1;
    }

    let until = Instant::now() + STOP_DRAIN;
    loop {
        let now = Instant::now();
        if now >= until || all_recent_answered(shared, now) {
            break;
        }
        wait_for_replies(
            sock,
            (until - now).min(POLL_SLICE),
            v6,
            ident,
            shared,
            &mut buf,
        );
    }
    tally
}

/// `interval * n`, for any `n`.
fn times(interval: Duration, n: u64) -> Duration {
    let nanos = interval.as_nanos() * u128::from(n);
    Duration::new(
        (nanos / 1_000_000_000) as u64,
        (nanos % 1_000_000_000) as u32,
    )
}

/// True if every probe sent in the last [`REPLY_TIMEOUT`] has its reply.
fn all_recent_answered(shared: &Shared, now: Instant) -> bool {
    let probes = shared.probes();
    probes
        .iter()
        .rev()
        .take_while(|p| now.duration_since(p.sent) < REPLY_TIMEOUT)
        .all(|p| p.reply.is_some())
}

/// Waits up to `timeout` for the socket to become readable, then reads
/// every packet queued and records the replies among them.
fn wait_for_replies(
    sock: &OwnedFd,
    timeout: Duration,
    v6: bool,
    ident: Ident,
    shared: &Shared,
    buf: &mut [u8],
) {
    let mut pfd = libc::pollfd {
        fd: sock.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: one valid pollfd, a valid timespec, no signal mask; ppoll
    // only writes pfd.revents. ppoll rather than poll for sub-millisecond
    // timeouts.
    let rc = unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
    if rc <= 0 {
        // Timed out, or interrupted by a signal: either way, nothing to read.
        return;
    }
    loop {
        // SAFETY: buf is valid for writes of buf.len() bytes; MSG_DONTWAIT
        // so this never blocks.
        let n = unsafe {
            libc::recv(
                sock.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n < 0 {
            // EAGAIN: all read. Anything else: try again at the next poll.
            return;
        }
        let at = Instant::now();
        let Some(seq) = parse_echo_reply(&buf[..n as usize], v6, ident) else {
            continue;
        };
        let mut probes = shared.probes();
        if let Some(p) = probes.get_mut(seq as usize) {
            // A duplicate reply does not move the first one; it is counted.
            match p.reply {
                Some(_) => p.duplicates += 1,
                None => p.reply = Some(at),
            }
        }
    }
}

/// The echo request for probe `seq`: ICMP header, token, full sequence.
///
/// The IPv4 checksum is computed here; for ICMPv6 the kernel fills it in
/// on raw sockets (RFC 3542), pseudo-header included.
fn echo_request(v6: bool, ident: Ident, seq: u64) -> [u8; ECHO_LEN] {
    let mut p = [0u8; ECHO_LEN];
    p[0] = if v6 { 128 } else { 8 };
    p[4..6].copy_from_slice(&ident.id.to_be_bytes());
    p[6..8].copy_from_slice(&(seq as u16).to_be_bytes());
    p[8..16].copy_from_slice(&ident.token.to_be_bytes());
    p[16..24].copy_from_slice(&seq.to_be_bytes());
    if !v6 {
        let sum = inet_checksum(&p);
        p[2..4].copy_from_slice(&sum.to_be_bytes());
    }
    p
}

/// The sequence number of this prober's echo reply in `packet` (which for
/// IPv4 starts with the IP header), or None for any other packet.
fn parse_echo_reply(packet: &[u8], v6: bool, ident: Ident) -> Option<u64> {
    let icmp = if v6 {
        packet
    } else {
        let first = *packet.first()?;
        if first >> 4 != 4 {
            return None;
        }
        packet.get(usize::from(first & 0x0f) * 4..)?
    };
    let reply_type = if v6 { 129 } else { 0 };
    if icmp.len() < ECHO_LEN || icmp[0] != reply_type || icmp[1] != 0 {
        return None;
    }
    let be64 = |b: &[u8]| u64::from_be_bytes(b.try_into().expect("8 bytes"));
    let id = u16::from_be_bytes([icmp[4], icmp[5]]);
    let seq16 = u16::from_be_bytes([icmp[6], icmp[7]]);
    let seq = be64(&icmp[16..24]);
    if id != ident.id || be64(&icmp[8..16]) != ident.token || seq16 != seq as u16 {
        return None;
    }
    Some(seq)
}

/// The Internet checksum (RFC 1071) of `data`.
fn inet_checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = data
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c.get(1).copied().unwrap_or(0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// A raw ICMP (or ICMPv6) socket in the calling thread's netns, with a
/// large receive buffer.
fn open_icmp_socket(target: IpAddr) -> io::Result<OwnedFd> {
    let (domain, proto) = match target {
        IpAddr::V4(_) => (libc::AF_INET, libc::IPPROTO_ICMP),
        IpAddr::V6(_) => (libc::AF_INET6, libc::IPPROTO_ICMPV6),
    };
    let sock = socket(domain, libc::SOCK_RAW, proto)?;
    // Root may exceed rmem_max with the FORCE variant; fall back if not.
    if set_int_opt(&sock, libc::SO_RCVBUFFORCE, RCVBUF_BYTES).is_err() {
        let _ = set_int_opt(&sock, libc::SO_RCVBUF, RCVBUF_BYTES);
    }
    Ok(sock)
}

/// `socket(2)`, close-on-exec, as an owned fd.
fn socket(domain: libc::c_int, ty: libc::c_int, proto: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: socket(2) takes plain integers and returns a new fd or -1.
    let fd = unsafe { libc::socket(domain, ty | libc::SOCK_CLOEXEC, proto) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just returned by socket(2) and is owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A `SOL_SOCKET` option with an int value.
fn set_int_opt(sock: &OwnedFd, opt: libc::c_int, value: libc::c_int) -> io::Result<()> {
    // SAFETY: value is a valid c_int for the length given; the kernel
    // only reads it.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            (&value as *const libc::c_int).cast(),
            mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A socket address of one of the families used here.
enum SockAddr {
    V4(libc::sockaddr_in),
    V6(libc::sockaddr_in6),
    Packet(libc::sockaddr_ll),
}

impl SockAddr {
    /// `ip`, port 0 (ignored by raw sockets).
    fn ip(ip: IpAddr) -> SockAddr {
        match ip {
            IpAddr::V4(a) => SockAddr::V4(libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: 0,
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.octets()),
                },
                sin_zero: [0; 8],
            }),
            IpAddr::V6(a) => SockAddr::V6(libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: 0,
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr {
                    s6_addr: a.octets(),
                },
                sin6_scope_id: 0,
            }),
        }
    }

    /// Link `ifindex`, frames of `ethertype`, to `dst` (unused by bind).
    fn packet(ifindex: libc::c_int, ethertype: u16, dst: [u8; 6]) -> SockAddr {
        let mut sll_addr = [0u8; 8];
        sll_addr[..6].copy_from_slice(&dst);
        SockAddr::Packet(libc::sockaddr_ll {
            sll_family: libc::AF_PACKET as libc::c_ushort,
            sll_protocol: ethertype.to_be(),
            sll_ifindex: ifindex,
            sll_hatype: 0,
            sll_pkttype: 0,
            sll_halen: 6,
            sll_addr,
        })
    }

    /// The pointer and length the socket calls take.
    fn raw(&self) -> (*const libc::sockaddr, libc::socklen_t) {
        fn cast<T>(a: &T) -> (*const libc::sockaddr, libc::socklen_t) {
            (
                (a as *const T).cast(),
                mem::size_of::<T>() as libc::socklen_t,
            )
        }
        match self {
            SockAddr::V4(a) => cast(a),
            SockAddr::V6(a) => cast(a),
            SockAddr::Packet(a) => cast(a),
        }
    }

    /// `sendto(2)` of `data` to this address; an error unless all of it
    /// went.
    fn send_to(&self, sock: &OwnedFd, data: &[u8]) -> io::Result<()> {
        let (addr, len) = self.raw();
        // SAFETY: data is valid for reads of data.len() bytes and addr for
        // len bytes; the kernel only reads both.
        let n = unsafe {
            libc::sendto(
                sock.as_raw_fd(),
                data.as_ptr().cast(),
                data.len(),
                0,
                addr,
                len,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n as usize != data.len() {
            return Err(io::Error::other(format!(
                "sent {n} of {} bytes",
                data.len()
            )));
        }
        Ok(())
    }

    /// `bind(2)` of `sock` to this address.
    fn bind(&self, sock: &OwnedFd) -> io::Result<()> {
        let (addr, len) = self.raw();
        // SAFETY: addr is valid for len bytes; the kernel only reads it.
        let rc = unsafe { libc::bind(sock.as_raw_fd(), addr, len) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Report

/// One probe: when it was sent and when its reply came, if one did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbeRecord {
    /// Just before the send.
    pub sent: Instant,
    /// When the reply was read, however late.
    pub reply: Option<Instant>,
    /// Replies after the first: the probe (or its reply) was delivered
    /// more than once.
    pub duplicates: u32,
}

impl ProbeRecord {
    /// True if the reply came within [`REPLY_TIMEOUT`] of the send.
    pub fn answered(&self) -> bool {
        self.reply
            .is_some_and(|r| r.duration_since(self.sent) <= REPLY_TIMEOUT)
    }
}

/// The record of a [`Prober`] run, from [`Prober::stop`].
///
/// A probe counts as answered if its reply came within [`REPLY_TIMEOUT`].
/// Unanswered probes before the first answered one (the path was not up
/// yet) are `leading_lost`, those after the last answered one (it never
/// came back) `trailing_lost`; every other run of unanswered probes is a
/// [`LossWindow`]. With no answer at all, every probe is trailing.
#[derive(Clone)]
pub struct ProbeReport {
    /// The address probed.
    pub target: IpAddr,
    /// The send interval asked for.
    pub interval: Duration,
    /// Every probe, in send order.
    pub probes: Vec<ProbeRecord>,
    /// How many probes were sent (failed sends included).
    pub sent: u64,
    /// How many were answered within [`REPLY_TIMEOUT`].
    pub received: u64,
    /// How many were answered, but too late to count.
    pub late: u64,
    /// Unanswered probes before the first answered one.
    pub leading_lost: u64,
    /// Unanswered probes after the last answered one.
    pub trailing_lost: u64,
    /// Probes whose send itself failed (no route, neighbour failed, ...);
    /// they count as sent and lost.
    pub send_errors: u64,
    /// Schedule slots skipped because the prober thread ran late; a
    /// non-zero value means the machine was too busy for the interval.
    pub skipped_slots: u64,
    /// Replies beyond each probe's first.
    pub duplicates: u64,
}

/// A maximal run of unanswered probes between two answered ones: an
/// interval during which the path did not work, at probe resolution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LossWindow {
    /// The send of the first lost probe.
    pub start: Instant,
    /// From the send of the last answered probe before the run to the send
    /// of the first answered probe after it.
    pub duration: Duration,
    /// How many probes the run holds.
    pub lost: u64,
    /// The send of the first answered probe after the run: when the path
    /// was known to work again.
    pub resumed: Instant,
}

impl ProbeReport {
    fn from_records(
        target: IpAddr,
        interval: Duration,
        probes: Vec<ProbeRecord>,
        tally: Tally,
    ) -> ProbeReport {
        let sent = probes.len() as u64;
        let received = probes.iter().filter(|p| p.answered()).count() as u64;
        let duplicates = probes.iter().map(|p| u64::from(p.duplicates)).sum();
        let late = probes
            .iter()
            .filter(|p| p.reply.is_some() && !p.answered())
            .count() as u64;
        let (leading_lost, trailing_lost) = match (
            probes.iter().position(ProbeRecord::answered),
            probes.iter().rposition(ProbeRecord::answered),
        ) {
            (Some(first), Some(last)) => (first as u64, sent - 1 - last as u64),
            _ => (0, sent),
        };
        ProbeReport {
            target,
            interval,
            probes,
            sent,
            received,
            late,
            leading_lost,
            trailing_lost,
            send_errors: tally.send_errors,
            skipped_slots: tally.skipped_slots,
            duplicates,
        }
    }

    /// Probes sent in `from..to` that were never answered (within
    /// [`REPLY_TIMEOUT`]).
    pub fn lost_in(&self, from: Instant, to: Instant) -> u64 {
        self.probes
            .iter()
            .filter(|p| p.sent >= from && p.sent < to && !p.answered())
            .count() as u64
    }

    /// Of the probes sent in `from..to` and answered, the longest wait for
    /// a reply.
    pub fn longest_reply_in(&self, from: Instant, to: Instant) -> Option<Duration> {
        self.probes
            .iter()
            .filter(|p| p.sent >= from && p.sent < to && p.answered())
            .filter_map(|p| Some(p.reply?.duration_since(p.sent)))
            .max()
    }

    /// Every loss window, in time order.
    pub fn loss_windows(&self) -> Vec<LossWindow> {
        let mut windows = Vec::new();
        let mut last_ok: Option<usize> = None;
        for (i, p) in self.probes.iter().enumerate() {
            if !p.answered() {
                continue;
            }
            if let Some(prev) = last_ok.filter(|&prev| i > prev + 1) {
                windows.push(LossWindow {
                    start: self.probes[prev + 1].sent,
                    duration: p.sent.duration_since(self.probes[prev].sent),
                    lost: (i - prev - 1) as u64,
                    resumed: p.sent,
                });
            }
            last_ok = Some(i);
        }
        windows
    }

    /// The longest loss window that ended after `t` (so also one under way
    /// at `t`): the outage caused by an event at `t`. The earliest wins a
    /// tie.
    pub fn longest_loss_after(&self, t: Instant) -> Option<LossWindow> {
        self.loss_windows()
            .into_iter()
            .filter(|w| w.resumed > t)
            .fold(None, |best: Option<LossWindow>, w| match best {
                Some(b) if b.duration >= w.duration => Some(b),
                _ => Some(w),
            })
    }
}

impl fmt::Display for ProbeReport {
    /// One line: the counts, the loss windows and the longest of them.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let windows = self.loss_windows();
        let pct = if self.sent == 0 {
            0.0
        } else {
            100.0 * self.received as f64 / self.sent as f64
        };
        write!(
            f,
            "{}: sent {}, received {} ({pct:.2}%), late {}, duplicates {}, leading lost {}, \
             trailing lost {}, send errors {}, skipped slots {}, {} loss window(s)",
            self.target,
            self.sent,
            self.received,
            self.late,
            self.duplicates,
            self.leading_lost,
            self.trailing_lost,
            self.send_errors,
            self.skipped_slots,
            windows.len()
        )?;
        if let Some(w) = windows.iter().max_by_key(|w| w.duration) {
            write!(f, ", longest {:?} ({} probes)", w.duration, w.lost)?;
        }
        Ok(())
    }
}

impl fmt::Debug for ProbeReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Not the records themselves: a minute of probes is 120k lines.
        write!(f, "ProbeReport({self})")
    }
}

// ---------------------------------------------------------------------------
// Announcements

/// The RARP frame QEMU's `announce_self` broadcasts for a guest NIC with
/// `mac` after a migration, so switches learn where the MAC went.
///
/// Broadcast from `mac`, ethertype RARP; htype 1, ptype IPv4, hlen 6,
/// plen 4, op 3 (request reverse), sha = tha = `mac`, spa = tpa = 0.0.0.0;
/// zero-padded to 60 bytes.
pub fn rarp_frame(mac: [u8; 6]) -> [u8; ANNOUNCE_FRAME_LEN] {
    arp_frame(ETH_P_RARP, 3, mac, Ipv4Addr::UNSPECIFIED, mac)
}

/// A gratuitous ARP request for `ip` at `mac`: broadcast from `mac`, op 1,
/// sha = `mac`, spa = tpa = `ip`, tha = 0; zero-padded to 60 bytes.
pub fn garp_frame(mac: [u8; 6], ip: Ipv4Addr) -> [u8; ANNOUNCE_FRAME_LEN] {
    arp_frame(ETH_P_ARP, 1, mac, ip, [0; 6])
}

/// An (R)ARP frame for Ethernet and IPv4, with the same protocol address
/// as sender and target.
fn arp_frame(
    ethertype: u16,
    op: u16,
    sha: [u8; 6],
    ip: Ipv4Addr,
    tha: [u8; 6],
) -> [u8; ANNOUNCE_FRAME_LEN] {
    let mut f = [0u8; ANNOUNCE_FRAME_LEN];
    f[0..6].copy_from_slice(&BROADCAST_MAC);
    f[6..12].copy_from_slice(&sha);
    f[12..14].copy_from_slice(&ethertype.to_be_bytes());
    f[14..16].copy_from_slice(&1u16.to_be_bytes()); // htype: Ethernet
    f[16..18].copy_from_slice(&0x0800u16.to_be_bytes()); // ptype: IPv4
    f[18] = 6; // hlen
    f[19] = 4; // plen
    f[20..22].copy_from_slice(&op.to_be_bytes());
    f[22..28].copy_from_slice(&sha);
    f[28..32].copy_from_slice(&ip.octets());
    f[32..38].copy_from_slice(&tha);
    f[38..42].copy_from_slice(&ip.octets());
    f
}

/// Sends one [`rarp_frame`] for `mac` out of `ifname` inside `ns`, as QEMU
/// announces a migrated guest; returns the moment just before the send.
/// Panics if it cannot.
pub fn send_rarp(ns: &Netns, ifname: &str, mac: [u8; 6]) -> Instant {
    send_frame(ns, ifname, &rarp_frame(mac))
}

/// Sends one [`garp_frame`] for `ip` at `mac` out of `ifname` inside `ns`;
/// returns the moment just before the send. Panics if it cannot.
pub fn send_garp(ns: &Netns, ifname: &str, mac: [u8; 6], ip: Ipv4Addr) -> Instant {
    send_frame(ns, ifname, &garp_frame(mac, ip))
}

/// Sends `frame`, a whole Ethernet frame (without FCS), out of `ifname`
/// inside `ns` through a packet socket; returns the moment just before the
/// send. Panics if it cannot.
pub fn send_frame(ns: &Netns, ifname: &str, frame: &[u8]) -> Instant {
    assert!(frame.len() >= 14, "an Ethernet frame has a 14-byte header");
    let what = format!("sending a frame out of {ifname} in {}", ns.name());
    let ethertype = u16::from_be_bytes([frame[12], frame[13]]);
    let mut dst = [0u8; 6];
    dst.copy_from_slice(&frame[..6]);
    ns.run(|| -> io::Result<Instant> {
        let ifindex = if_index(ifname)?;
        // Protocol 0: this socket only sends, it receives nothing.
        let sock = socket(libc::AF_PACKET, libc::SOCK_RAW, 0)?;
        SockAddr::packet(ifindex, 0, dst).bind(&sock)?;
        let to = SockAddr::packet(ifindex, ethertype, dst);
        let at = Instant::now();
        to.send_to(&sock, frame)?;
        Ok(at)
    })
    .unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// A packet socket bound to a link inside a netns, holding one frame to
/// send: opened ahead, so that many frames (one per pod, say) can leave
/// at once from threads of any netns, without entering one at send time.
pub struct FrameSender {
    sock: OwnedFd,
    to: SockAddr,
    frame: Vec<u8>,
}

impl FrameSender {
    /// Opens a sender of `frame` (a whole Ethernet frame, without FCS) out
    /// of `ifname` inside `ns`; panics if it cannot.
    pub fn open(ns: &Netns, ifname: &str, frame: &[u8]) -> FrameSender {
        assert!(frame.len() >= 14, "an Ethernet frame has a 14-byte header");
        let what = format!("opening a packet socket on {ifname} in {}", ns.name());
        let ethertype = u16::from_be_bytes([frame[12], frame[13]]);
        let mut dst = [0u8; 6];
        dst.copy_from_slice(&frame[..6]);
        let (sock, to) = ns
            .run(|| -> io::Result<(OwnedFd, SockAddr)> {
                let ifindex = if_index(ifname)?;
                let sock = socket(libc::AF_PACKET, libc::SOCK_RAW, 0)?;
                SockAddr::packet(ifindex, 0, dst).bind(&sock)?;
                Ok((sock, SockAddr::packet(ifindex, ethertype, dst)))
            })
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        FrameSender {
            sock,
            to,
            frame: frame.to_vec(),
        }
    }

    /// A sender of QEMU's RARP announcement for `mac` ([`rarp_frame`]).
    pub fn rarp(ns: &Netns, ifname: &str, mac: [u8; 6]) -> FrameSender {
        FrameSender::open(ns, ifname, &rarp_frame(mac))
    }

    /// Sends the frame; returns the moment just before the send. Panics
    /// if it cannot.
    pub fn send(&self) -> Instant {
        let at = Instant::now();
        self.to
            .send_to(&self.sock, &self.frame)
            .unwrap_or_else(|e| panic!("sending a frame: {e}"));
        at
    }
}

/// The index of link `ifname` in the calling thread's netns.
fn if_index(ifname: &str) -> io::Result<libc::c_int> {
    let name = CString::new(ifname).map_err(io::Error::other)?;
    // SAFETY: name is a valid NUL-terminated string; if_nametoindex only
    // reads it.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if index == 0 {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("no link {ifname}: {}", io::Error::last_os_error()),
        ));
    }
    Ok(index as libc::c_int)
}

// ---------------------------------------------------------------------------
// Pausing echo

/// Makes `ns` stop (`paused`) or resume answering ICMP and ICMPv6 echo
/// requests, through its `icmp_echo_ignore_all` sysctls; panics if it
/// cannot.
///
/// Cuts a path for a known time without touching links or routes. Fast
/// (a thread and two writes, no process), so a loss window measured right
/// after it is the pause's. The IPv6 sysctl is skipped when IPv6 is
/// disabled.
pub fn pause_icmp(ns: &Netns, paused: bool) {
    let value = if paused { "1\n" } else { "0\n" };
    // /proc/sys/net resolves in the netns of the thread that opens it.
    ns.run(|| {
        for (path, optional) in [
            ("/proc/sys/net/ipv4/icmp_echo_ignore_all", false),
            ("/proc/sys/net/ipv6/icmp/echo_ignore_all", true),
        ] {
            let file = OpenOptions::new().write(true).open(path);
            let mut file = match file {
                Err(e) if optional && e.kind() == io::ErrorKind::NotFound => continue,
                other => other.unwrap_or_else(|e| panic!("opening {path} in {}: {e}", ns.name())),
            };
            file.write_all(value.as_bytes())
                .unwrap_or_else(|e| panic!("writing {value:?} to {path} in {}: {e}", ns.name()));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(pattern: &str) -> ProbeReport {
        let t0 = Instant::now();
        let ms = Duration::from_millis(1);
        let probes = pattern
            .chars()
            .enumerate()
            .map(|(i, c)| {
                let sent = t0 + ms * i as u32;
                let reply = match c {
                    '+' => Some(sent + ms / 2),
                    'L' => Some(sent + REPLY_TIMEOUT + ms),
                    _ => None,
                };
                ProbeRecord {
                    sent,
                    reply,
                    duplicates: 0,
                }
            })
            .collect();
        ProbeReport::from_records(
            IpAddr::V4(Ipv4Addr::LOCALHOST),
            ms,
            probes,
            Tally::default(),
        )
    }

    #[test]
    fn loss_windows_are_runs_between_answered_probes() {
        let r = report("--++-+++L--++---");
        assert_eq!((r.sent, r.received, r.late), (16, 7, 1));
        assert_eq!((r.leading_lost, r.trailing_lost), (2, 3));
        let t0 = r.probes[0].sent;
        let ms = Duration::from_millis(1);
        let w = r.loss_windows();
        assert_eq!(w.len(), 2, "{w:?}");
        assert_eq!(w[0].start, t0 + ms * 4);
        assert_eq!(w[0].duration, ms * 2);
        assert_eq!(w[0].lost, 1);
        assert_eq!(w[0].resumed, t0 + ms * 5);
        assert_eq!(w[1].start, t0 + ms * 8);
        assert_eq!(w[1].duration, ms * 4);
        assert_eq!(w[1].lost, 3);
        assert_eq!(r.longest_loss_after(t0), Some(w[1]));
        assert_eq!(r.longest_loss_after(t0 + ms * 4), Some(w[1]));
        assert_eq!(r.longest_loss_after(t0 + ms * 11), None);
        // A window under way at t counts for t.
        let r = report("+-+---+");
        let t0 = r.probes[0].sent;
        assert_eq!(
            r.longest_loss_after(t0 + ms * 4),
            r.loss_windows().get(1).copied()
        );
    }

    #[test]
    fn no_answer_at_all_is_all_trailing() {
        let r = report("----");
        assert_eq!((r.leading_lost, r.trailing_lost), (0, 4));
        assert!(r.loss_windows().is_empty());
    }

    #[test]
    fn echo_requests_round_trip_and_checksum() {
        let ident = Ident {
            id: 0x1234,
            token: 0xdead_beef_0bad_f00d,
        };
        let seq = 70_000; // past the 16-bit wrap
        let req = echo_request(false, ident, seq);
        assert_eq!(inet_checksum(&req), 0, "a valid checksum sums to zero");
        // A v4 reply: a 20-byte IP header, then the request turned around.
        let mut reply = vec![0x45; 1];
        reply.resize(20, 0);
        let mut icmp = req;
        icmp[0] = 0;
        reply.extend_from_slice(&icmp);
        assert_eq!(parse_echo_reply(&reply, false, ident), Some(seq));
        assert_eq!(parse_echo_reply(&reply[..30], false, ident), None);
        let other = Ident {
            id: 0x1235,
            ..ident
        };
        assert_eq!(parse_echo_reply(&reply, false, other), None);
        let mut v6 = echo_request(true, ident, seq);
        assert_eq!(parse_echo_reply(&v6, true, ident), None, "a request");
        v6[0] = 129;
        assert_eq!(parse_echo_reply(&v6, true, ident), Some(seq));
    }

    #[test]
    fn announce_frames_have_qemus_layout() {
        let mac = [0x52, 0x54, 0, 0x12, 0x34, 0x56];
        let f = rarp_frame(mac);
        assert_eq!(&f[..6], &BROADCAST_MAC);
        assert_eq!(&f[6..12], &mac);
        assert_eq!(&f[12..22], &[0x80, 0x35, 0, 1, 8, 0, 6, 4, 0, 3]);
        assert_eq!(&f[22..28], &mac);
        assert_eq!(&f[28..32], &[0; 4]);
        assert_eq!(&f[32..38], &mac);
        assert!(f[38..].iter().all(|&b| b == 0));
        let g = garp_frame(mac, Ipv4Addr::new(10, 1, 2, 3));
        assert_eq!(&g[12..22], &[0x08, 0x06, 0, 1, 8, 0, 6, 4, 0, 1]);
        assert_eq!(&g[28..32], &[10, 1, 2, 3]);
        assert_eq!(&g[32..38], &[0; 6]);
        assert_eq!(&g[38..42], &[10, 1, 2, 3]);
    }
}
