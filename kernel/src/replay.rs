//! The packets a paused guest missed: held on the node the VM leaves, and
//! sent again once it runs on the node it went to (docs/user/vm-connections.md).
//!
//! While a migration runs, the source node keeps the last packets it sent
//! down the source pod's veth ([`Capture`]: an `AF_PACKET` socket that sees
//! only outgoing frames, into a bounded ring). At the cutover the guest's
//! tap says how many of the packets that went down the veth since the
//! capture began its QEMU never read (the guest was paused, or already
//! gone): those are the last ones in the ring, in order. They are sent
//! again ([`Replayer`]) through the node's routing, which by then leads to
//! the target, with a mark that conntrack and NAT leave alone: the packet
//! leaves as it was first sent (its translations made already), and the
//! target delivers it to the guest that has just resumed.
//!
//! Why not copy the packets to the target while the guest is paused: the
//! source cannot tell the pause from the moment: under migration load a
//! running guest's QEMU left its tap unread for up to 78 ms here (TCG, 2
//! cores), longer than the pause itself, and packets copied into the
//! target's tap wait in a ring of 500 that the target's QEMU does not read
//! until it resumes, so early copies crowd out the pause's. Counting at the
//! cutover needs no guess: the guest has left by then.

use std::collections::VecDeque;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::error::{KernelError, Result};
use crate::nat::NO_TRANSLATION_MARK;
use tether_base::sync::lock;

/// How many packets a capture holds at most: the newest are kept.
pub const HELD_PACKETS: usize = 4096;
/// How many bytes a capture holds at most.
pub const HELD_BYTES: usize = 8 << 20;
/// The largest packet sent again: what a 1500-byte Ethernet carries. A
/// larger one is a segmentation-offload aggregate, which the sender's TCP
/// sends again itself.
pub const REPLAY_MAX: usize = 1500;

const ETH_P_ALL: u16 = 0x0003;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
/// `sll_pkttype` of a frame this host sent.
const PACKET_OUTGOING: u8 = 4;

/// Builds one BPF instruction.
const fn op(code: u16, jt: u8, jf: u8, k: u32) -> libc::sock_filter {
    libc::sock_filter { code, jt, jf, k }
}

/// Only frames this host sends: `A = pkttype; A == OUTGOING ? all : drop`
/// (the ancillary load of the packet type, `SKF_AD_OFF + SKF_AD_PKTTYPE`).
const OUTGOING_ONLY: [libc::sock_filter; 4] = [
    op(0x30, 0, 0, 0xffff_f004), // ldb [pkttype]
    op(0x15, 0, 1, PACKET_OUTGOING as u32),
    op(0x06, 0, 0, 0x0004_0000), // accept, up to 256 KiB
    op(0x06, 0, 0, 0),           // drop
];

/// What a capture holds.
#[derive(Default)]
struct Ring {
    packets: VecDeque<Vec<u8>>,
    bytes: usize,
}

/// The packets the node sends down one interface, the newest kept (see
/// the module doc). The capture stops when dropped.
pub struct Capture {
    fd: Arc<OwnedFd>,
    ring: Arc<Mutex<Ring>>,
    seen: Arc<AtomicU64>,
    /// The count of [`Capture::seen`] from which every packet sent was
    /// captured, in order: [`NOTHING_WHOLE`] from when the socket was
    /// found to have dropped some (its queue full) until its queue was
    /// read empty, then the count at that moment.
    whole_from: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Capture {
    /// Starts capturing what the node sends down interface `ifindex` of the
    /// calling thread's netns.
    pub fn start(ifindex: u32) -> Result<Capture> {
        Capture::start_with_buffer(ifindex, CAPTURE_RCVBUF)
    }

    /// [`Capture::start`] with a socket receive buffer of `rcvbuf` bytes
    /// (the tests make one small enough to drop).
    pub(crate) fn start_with_buffer(ifindex: u32, rcvbuf: libc::c_int) -> Result<Capture> {
        let doing = || format!("capturing the packets sent to interface {ifindex}");
        let fd = packet_socket().map_err(|e| KernelError::refused(doing(), e))?;
        attach_filter(&fd, &OUTGOING_ONLY).map_err(|e| KernelError::refused(doing(), e))?;
        bind(&fd, ifindex).map_err(|e| KernelError::refused(doing(), e))?;
        // A read wakes at least this often to see the stop flag.
        let timeout = libc::timeval {
            tv_sec: 0,
            tv_usec: 100_000,
        };
        // SAFETY: a valid descriptor and a timeval of the size given.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                std::ptr::addr_of!(timeout).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(KernelError::refused(doing(), io::Error::last_os_error()));
        }
        let fd = Arc::new(fd);
        let ring = Arc::new(Mutex::new(Ring::default()));
        let seen = Arc::new(AtomicU64::new(0));
        let whole_from = Arc::new(AtomicU64::new(0));
        // Room for a burst while the reader is descheduled: a drop costs
        // the replay what came before it.
        let _ = set_rcvbuf(&fd, rcvbuf);
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::Builder::new()
            .name("tether-capture".into())
            .spawn({
                let (fd, ring, seen, whole_from, stop) = (
                    fd.clone(),
                    ring.clone(),
                    seen.clone(),
                    whole_from.clone(),
                    stop.clone(),
                );
                move || capture_loop(&fd, &ring, &seen, &whole_from, &stop)
            })
            .map_err(|e| KernelError::refused(doing(), e))?;
        Ok(Capture {
            fd,
            ring,
            seen,
            whole_from,
            stop,
            thread: Some(thread),
        })
    }

    /// How many packets were captured since the start.
    pub fn seen(&self) -> u64 {
        self.seen.load(Ordering::Relaxed)
    }

    /// The last `n` packets held, oldest first: fewer if it holds fewer,
    /// or if the socket dropped some of the last `n` (its queue full): a
    /// packet missing from the run would make an older one, which the
    /// guest did read, take its place.
    pub fn last(&self, n: usize) -> Vec<Vec<u8>> {
        let ring = lock(&self.ring);
        note_drops(&self.fd, &self.whole_from);
        let whole = match self.whole_from.load(Ordering::Relaxed) {
            NOTHING_WHOLE => 0,
            from => self.seen.load(Ordering::Relaxed).saturating_sub(from),
        };
        let n = n.min(usize::try_from(whole).unwrap_or(usize::MAX));
        let skip = ring.packets.len().saturating_sub(n);
        ring.packets.iter().skip(skip).cloned().collect()
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// How many packets a capture reads between two looks at its socket's
/// drops.
const DROPS_EVERY: u64 = 64;
/// The capture socket's receive buffer asked for.
const CAPTURE_RCVBUF: libc::c_int = 4 << 20;

fn set_rcvbuf(fd: &OwnedFd, bytes: libc::c_int) -> io::Result<()> {
    // SAFETY: a valid descriptor and an int of the size given.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            std::ptr::addr_of!(bytes).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// [`Capture`]'s `whole_from` while no run of packets is known whole.
const NOTHING_WHOLE: u64 = u64::MAX;

/// Whether the socket dropped packets since the last look (the kernel
/// resets its counters on each read); if so, nothing held is known whole
/// until the socket's queue has been read empty: the packets still queued
/// came before the gap.
fn note_drops(fd: &OwnedFd, whole_from: &AtomicU64) {
    let mut stats = libc::tpacket_stats {
        tp_packets: 0,
        tp_drops: 0,
    };
    let mut len = std::mem::size_of::<libc::tpacket_stats>() as libc::socklen_t;
    // SAFETY: a valid descriptor, and a tpacket_stats of the length given.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_PACKET,
            libc::PACKET_STATISTICS,
            std::ptr::addr_of_mut!(stats).cast(),
            &mut len,
        )
    };
    // Unreadable counters count as drops: nothing before is vouched for.
    if rc != 0 || stats.tp_drops > 0 {
        whole_from.store(NOTHING_WHOLE, Ordering::Relaxed);
    }
}

/// Whether the socket has nothing queued (`SIOCINQ`: the length of the
/// next packet, 0 when there is none).
fn queue_empty(fd: &OwnedFd) -> bool {
    let mut next: libc::c_int = 0;
    // SAFETY: a valid descriptor and an int for the answer.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), libc::FIONREAD, &mut next) };
    rc == 0 && next == 0
}

fn capture_loop(
    fd: &OwnedFd,
    ring: &Mutex<Ring>,
    seen: &AtomicU64,
    whole_from: &AtomicU64,
    stop: &AtomicBool,
) {
    let mut buf = vec![0u8; 1 << 16];
    while !stop.load(Ordering::Relaxed) {
        // SAFETY: sockaddr_ll is plain data; zeroed is a valid value.
        let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        let mut from_len = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
        // SAFETY: buf and from are valid for the lengths given.
        let n = unsafe {
            libc::recvfrom(
                fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                0,
                std::ptr::addr_of_mut!(from).cast(),
                &mut from_len,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                    // Idle, the queue read empty: the drops so far are
                    // behind what comes next.
                    note_drops(fd, whole_from);
                    if whole_from.load(Ordering::Relaxed) == NOTHING_WHOLE {
                        whole_from.store(seen.load(Ordering::Relaxed), Ordering::Relaxed);
                    }
                    continue;
                }
                io::ErrorKind::Interrupted => continue,
                // The interface went (its pod's DEL): nothing more to hold.
                _ => return,
            }
        }
        if from.sll_pkttype != PACKET_OUTGOING {
            continue;
        }
        let count = seen.fetch_add(1, Ordering::Relaxed) + 1;
        if count.is_multiple_of(DROPS_EVERY) {
            note_drops(fd, whole_from);
        }
        if whole_from.load(Ordering::Relaxed) == NOTHING_WHOLE && queue_empty(fd) {
            // Read up to the present: what comes next follows the gap.
            whole_from.store(count, Ordering::Relaxed);
        }
        let protocol = u16::from_be(from.sll_protocol);
        // Only IP packets are held; the rest (ARP, ...) counts as sent.
        if protocol != ETH_P_IP && protocol != ETH_P_IPV6 {
            let mut r = lock(ring);
            r.packets.push_back(Vec::new());
            trim(&mut r);
            continue;
        }
        let packet = buf[..n as usize].to_vec();
        let mut r = lock(ring);
        r.bytes += packet.len();
        r.packets.push_back(packet);
        trim(&mut r);
    }
}

fn trim(r: &mut Ring) {
    while r.packets.len() > HELD_PACKETS || r.bytes > HELD_BYTES {
        match r.packets.pop_front() {
            Some(p) => r.bytes -= p.len(),
            None => break,
        }
    }
}

/// An `AF_PACKET` datagram socket (the link header stripped) for every
/// protocol.
fn packet_socket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the descriptor is checked and owned.
    let fd = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            i32::from(ETH_P_ALL.to_be()),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is fresh and owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn attach_filter(fd: &OwnedFd, filter: &[libc::sock_filter]) -> io::Result<()> {
    let prog = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: prog points at `filter`, which outlives the call; the kernel
    // copies it.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ATTACH_FILTER,
            std::ptr::addr_of!(prog).cast(),
            std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn bind(fd: &OwnedFd, ifindex: u32) -> io::Result<()> {
    // SAFETY: sockaddr_ll is plain data; zeroed is a valid value.
    let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    addr.sll_family = libc::AF_PACKET as u16;
    addr.sll_protocol = ETH_P_ALL.to_be();
    addr.sll_ifindex = ifindex as i32;
    // SAFETY: addr is a valid sockaddr_ll of the size given.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            std::ptr::addr_of!(addr).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// What sending again did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Replayed {
    /// Packets sent again.
    pub sent: u32,
    /// Packets not sent: larger than [`REPLAY_MAX`], not IP, or refused.
    pub skipped: u32,
}

/// Sends packets again as they were (see the module doc): raw IP sockets
/// of the calling thread's netns, marked [`NO_TRANSLATION_MARK`] so that
/// the handover's rules leave them untracked and untranslated.
pub struct Replayer {
    v4: OwnedFd,
    v6: Option<OwnedFd>,
}

impl Replayer {
    /// Opens the sockets.
    pub fn open() -> Result<Replayer> {
        let v4 = raw_socket(libc::AF_INET)
            .map_err(|e| KernelError::refused("opening a raw IPv4 socket", e))?;
        // A node without IPv6 has no IPv6 packets to send again.
        let v6 = raw_socket(libc::AF_INET6).ok();
        Ok(Replayer { v4, v6 })
    }

    /// Sends `packets` (IP packets, as captured) again, in order.
    pub fn send(&self, packets: &[Vec<u8>]) -> Replayed {
        let mut out = Replayed::default();
        for p in packets {
            let mut p = p.clone();
            let sent = match fix_checksums(&mut p) {
                Some(dst) if p.len() <= REPLAY_MAX => self.send_one(&p, dst).is_ok(),
                _ => false,
            };
            if sent {
                out.sent += 1;
            } else {
                out.skipped += 1;
            }
        }
        out
    }

    fn send_one(&self, packet: &[u8], dst: IpAddr) -> io::Result<()> {
        let (fd, addr) = match dst {
            IpAddr::V4(v4) => (&self.v4, SocketAddr::V4(SocketAddrV4::new(v4, 0))),
            IpAddr::V6(v6) => match &self.v6 {
                Some(fd) => (fd, SocketAddr::V6(SocketAddrV6::new(v6, 0, 0, 0))),
                None => return Err(io::ErrorKind::Unsupported.into()),
            },
        };
        let (storage, len) = sockaddr(addr);
        // SAFETY: packet and storage are valid for the lengths given.
        let n = unsafe {
            libc::sendto(
                fd.as_raw_fd(),
                packet.as_ptr().cast(),
                packet.len(),
                0,
                std::ptr::addr_of!(storage).cast(),
                len,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

fn raw_socket(family: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the descriptor is checked and owned.
    let fd = unsafe {
        libc::socket(
            family,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::IPPROTO_RAW,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is fresh and owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mark = NO_TRANSLATION_MARK;
    // SAFETY: a valid descriptor and a u32 of the size given.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_MARK,
            std::ptr::addr_of!(mark).cast(),
            std::mem::size_of::<u32>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

fn sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain data; zeroed is a valid value.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            // SAFETY: storage is large and aligned enough for a sockaddr_in.
            let sin: &mut libc::sockaddr_in =
                unsafe { &mut *std::ptr::addr_of_mut!(storage).cast() };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_addr.s_addr = u32::from_ne_bytes(a.ip().octets());
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            // SAFETY: as above, for a sockaddr_in6.
            let sin6: &mut libc::sockaddr_in6 =
                unsafe { &mut *std::ptr::addr_of_mut!(storage).cast() };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_addr.s6_addr = a.ip().octets();
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, len as libc::socklen_t)
}

/// The one's-complement sum of `data`, folded into `acc`.
fn sum(mut acc: u32, data: &[u8]) -> u32 {
    let mut chunks = data.chunks_exact(2);
    for c in &mut chunks {
        acc += u32::from(u16::from_be_bytes([c[0], c[1]]));
    }
    if let [last] = chunks.remainder() {
        acc += u32::from(*last) << 8;
    }
    acc
}

fn fold(mut acc: u32) -> u16 {
    while acc >> 16 != 0 {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    !(acc as u16)
}

/// Makes the transport checksum of IP packet `p` whole (a packet captured
/// on its way down a veth may carry only the part a NIC would complete),
/// and returns its destination; None when it is not a packet this can
/// send (not IPv4 or IPv6, a fragment, truncated).
pub fn fix_checksums(p: &mut [u8]) -> Option<IpAddr> {
    let version = p.first()? >> 4;
    let (proto, l4, pseudo, dst) = match version {
        4 => {
            let ihl = usize::from(p[0] & 0x0f) * 4;
            if p.len() < 20 || ihl < 20 || p.len() < ihl {
                return None;
            }
            // A fragment's transport header is not all here.
            if u16::from_be_bytes([p[6], p[7]]) & 0x3fff != 0 {
                return Some(IpAddr::V4(Ipv4Addr::new(p[16], p[17], p[18], p[19])));
            }
            let total = usize::from(u16::from_be_bytes([p[2], p[3]])).min(p.len());
            let proto = p[9];
            let mut pseudo = sum(0, &p[12..20]);
            pseudo += u32::from(proto);
            pseudo += (total - ihl) as u32;
            // The IPv4 header's own checksum.
            p[10] = 0;
            p[11] = 0;
            let h = fold(sum(0, &p[..ihl]));
            p[10..12].copy_from_slice(&h.to_be_bytes());
            let dst = IpAddr::V4(Ipv4Addr::new(p[16], p[17], p[18], p[19]));
            (proto, ihl..total, Some(pseudo).filter(|_| proto != 1), dst)
        }
        6 => {
            if p.len() < 40 {
                return None;
            }
            let payload = usize::from(u16::from_be_bytes([p[4], p[5]]));
            let total = (40 + payload).min(p.len());
            let proto = p[6];
            let mut pseudo = sum(0, &p[8..40]);
            pseudo += u32::from(proto);
            pseudo += (total - 40) as u32;
            let mut dst = [0u8; 16];
            dst.copy_from_slice(&p[24..40]);
            (
                proto,
                40..total,
                Some(pseudo),
                IpAddr::V6(Ipv6Addr::from(dst)),
            )
        }
        _ => return None,
    };
    // Where the checksum field sits: TCP 16, UDP 6, ICMP and ICMPv6 2.
    let field = match proto {
        6 => 16,
        17 => 6,
        1 | 58 => 2,
        _ => return Some(dst),
    };
    let seg = &mut p[l4];
    if seg.len() < field + 2 {
        return None;
    }
    if proto == 17 && dst.is_ipv4() && seg[6] == 0 && seg[7] == 0 {
        // An IPv4 UDP datagram without a checksum stays so.
        return Some(dst);
    }
    seg[field] = 0;
    seg[field + 1] = 0;
    let mut c = fold(sum(pseudo.unwrap_or(0), seg));
    if proto == 17 && c == 0 {
        c = 0xffff;
    }
    seg[field..field + 2].copy_from_slice(&c.to_be_bytes());
    Some(dst)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A UDP/IPv4 packet from 10.0.0.1:1000 to 10.0.0.2:2000 with "hi!" and
    /// correct checksums, as a peer would have computed them.
    fn udp4() -> Vec<u8> {
        vec![
            0x45, 0, 0, 31, 0, 1, 0x40, 0, 64, 17, 0x26, 0xcb, 10, 0, 0, 1, 10, 0, 0, 2, //
            0x03, 0xe8, 0x07, 0xd0, 0, 11, 0x56, 0xb4, b'h', b'i', b'!',
        ]
    }

    #[test]
    fn a_whole_checksum_is_kept_and_a_partial_one_made_whole() {
        let good = udp4();
        let mut p = good.clone();
        assert_eq!(fix_checksums(&mut p), Some("10.0.0.2".parse().unwrap()));
        assert_eq!(p, good, "correct checksums are recomputed to the same");
        // As a veth hands it over with checksum offload: only the
        // pseudo-header's part in the field, and a wrong IP checksum.
        let mut partial = good.clone();
        partial[26] = 0x12;
        partial[27] = 0x34;
        partial[10] = 0;
        partial[11] = 0;
        fix_checksums(&mut partial);
        assert_eq!(partial, good);
    }

    #[test]
    fn the_sums_are_the_internet_checksum() {
        // RFC 1071's example: 0001 f203 f4f5 f6f7 sums to ddf2, complement 220d.
        assert_eq!(
            fold(sum(0, &[0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7])),
            0x220d
        );
        // An odd byte counts as the high half of a last word.
        assert_eq!(fold(sum(0, &[0xff])), !0xff00);
    }

    #[test]
    fn what_is_not_ip_or_is_cut_short_is_not_sent() {
        assert_eq!(fix_checksums(&mut []), None);
        assert_eq!(fix_checksums(&mut [0x45, 0, 0]), None);
        assert_eq!(fix_checksums(&mut [0x20; 40]), None);
    }

    #[test]
    fn a_ring_keeps_the_newest_packets_within_its_bounds() {
        let mut r = Ring::default();
        for i in 0..(HELD_PACKETS + 10) {
            r.bytes += 1;
            r.packets.push_back(vec![(i % 251) as u8]);
            trim(&mut r);
        }
        assert_eq!(r.packets.len(), HELD_PACKETS);
        assert_eq!(r.packets.front(), Some(&vec![10u8]));
    }
}
