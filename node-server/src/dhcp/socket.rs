//! One `AF_PACKET` socket per served node-side veth, bound to that
//! interface, with a classic BPF filter that lets through only what the
//! responder answers: ARP, IPv4 UDP to port 67 (unfragmented), IPv6 UDP to
//! port 547 and ICMPv6 router solicitations. A busy guest's data traffic
//! never reaches the daemon; the filter is attached before the socket is
//! bound, so not even one frame slips past it.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use tokio::io::unix::AsyncFd;

use tether_kernel::error::Result;
use tether_kernel::packet::recv_frame;
use tether_kernel::KernelError;

/// `ETH_P_ALL`, in the byte order the socket calls want.
const ETH_P_ALL_BE: u16 = 0x0003u16.to_be();
/// The largest frame read: an Ethernet frame at the largest MTU tether
/// allows. Anything longer is truncated, and the responder then drops it.
const MAX_FRAME: usize = 65_535 + 14;

/// Builds one BPF instruction.
const fn op(code: u16, jt: u8, jf: u8, k: u32) -> libc::sock_filter {
    libc::sock_filter { code, jt, jf, k }
}

// Classic BPF opcodes (linux/bpf_common.h).
const LDH_ABS: u16 = 0x28;
const LDB_ABS: u16 = 0x30;
const LDH_IND: u16 = 0x48;
const LDXB_MSH: u16 = 0xb1;
const JEQ_K: u16 = 0x15;
const JSET_K: u16 = 0x45;
const RET_K: u16 = 0x06;

/// The filter. Offsets are into the Ethernet frame (no VLAN tags: a
/// node-side veth carries none). Jumps are relative to the next
/// instruction; 18 is "accept", 19 "drop".
const FILTER: [libc::sock_filter; 20] = [
    op(LDH_ABS, 0, 0, 12),             // 0: A = ethertype
    op(JEQ_K, 16, 0, 0x0806),          // 1: ARP -> accept
    op(JEQ_K, 0, 7, 0x0800),           // 2: IPv4 ? 3 : 10
    op(LDB_ABS, 0, 0, 23),             // 3: A = IPv4 protocol
    op(JEQ_K, 0, 14, 17),              // 4: UDP ? 5 : drop
    op(LDH_ABS, 0, 0, 20),             // 5: A = flags and fragment offset
    op(JSET_K, 12, 0, 0x1fff),         // 6: a later fragment -> drop
    op(LDXB_MSH, 0, 0, 14),            // 7: X = IPv4 header length
    op(LDH_IND, 0, 0, 16),             // 8: A = UDP destination port
    op(JEQ_K, 8, 9, 67),               // 9: 67 ? accept : drop
    op(JEQ_K, 0, 8, 0x86dd),           // 10: IPv6 ? 11 : drop
    op(LDB_ABS, 0, 0, 20),             // 11: A = next header
    op(JEQ_K, 0, 2, 17),               // 12: UDP ? 13 : 15
    op(LDH_ABS, 0, 0, 56),             // 13: A = UDP destination port
    op(JEQ_K, 3, 4, 547),              // 14: 547 ? accept : drop
    op(JEQ_K, 0, 3, 58),               // 15: ICMPv6 ? 16 : drop
    op(LDB_ABS, 0, 0, 54),             // 16: A = ICMPv6 type
    op(JEQ_K, 0, 1, 133),              // 17: router solicitation ? accept : drop
    op(RET_K, 0, 0, MAX_FRAME as u32), // 18: accept
    op(RET_K, 0, 0, 0),                // 19: drop
];

/// A packet socket on one interface.
pub(super) struct GuestSocket {
    fd: AsyncFd<OwnedFd>,
}

impl GuestSocket {
    /// Opens the socket on interface `ifindex` of the calling thread's
    /// netns (the daemon's).
    pub(super) fn open(ifindex: u32) -> Result<GuestSocket> {
        let context = |what: &str| format!("{what} for the guest on link #{ifindex}");
        // Protocol 0: the socket receives nothing until it is bound, after
        // the filter is in place.
        // SAFETY: plain socket(2); the result is checked and owned at once.
        let raw = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
            )
        };
        if raw < 0 {
            return Err(KernelError::refused(
                context("opening a packet socket"),
                io::Error::last_os_error(),
            ));
        }
        // SAFETY: raw is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let program = libc::sock_fprog {
            len: FILTER.len() as u16,
            filter: FILTER.as_ptr().cast_mut(),
        };
        // SAFETY: program points at FILTER, which is 'static; the kernel
        // copies it during the call.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_ATTACH_FILTER,
                std::ptr::addr_of!(program).cast(),
                std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(KernelError::refused(
                context("attaching the DHCP filter"),
                io::Error::last_os_error(),
            ));
        }
        // SAFETY: sockaddr_ll is plain data; zeroed is a valid value.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_protocol = ETH_P_ALL_BE;
        addr.sll_ifindex = ifindex as i32;
        // SAFETY: addr is a valid sockaddr_ll of the size given.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                std::ptr::addr_of!(addr).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(KernelError::refused(
                context("binding the packet socket"),
                io::Error::last_os_error(),
            ));
        }
        // SAFETY: the OwnedFd moves into the AsyncFd, which keeps it open.
        let fd = unsafe { AsyncFd::register(fd) }.map_err(|e| {
            KernelError::refused(context("watching the packet socket"), io::Error::from(e))
        })?;
        Ok(GuestSocket { fd })
    }

    /// The next frame that arrived on the interface (frames this host sent
    /// are skipped).
    pub(super) async fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        recv_frame(&self.fd, buf).await.map(|(_, n)| n)
    }

    /// Sends one whole Ethernet frame out of the bound interface.
    pub(super) fn send(&self, frame: &[u8]) -> io::Result<()> {
        // SAFETY: frame is valid for its length.
        let n = unsafe {
            libc::send(
                self.fd.get_ref().as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// The buffer size for [`GuestSocket::recv`].
pub(super) const BUFFER: usize = MAX_FRAME;
