//! Seeing a migrated VM announce itself: after a live migration QEMU sends
//! RARP frames from the VM's MAC on its new interface (`announce_self`), and
//! a guest may send gratuitous ARP. Either one, seen on a migration target's
//! node-side veth, is the earliest sign that the VM now runs there.
//!
//! Two `AF_PACKET` sockets in the daemon's netns, one bound to the RARP
//! ethertype and one to ARP, see those frames on every node interface; the
//! kernel delivers nothing else to them, so the cost on a busy node is the
//! ARP traffic only. Which frames matter (which MAC on which interface) is
//! the caller's business: the listener reports every announcement.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Instant;

use tokio::io::unix::AsyncFd;

use super::Announcements;
use crate::error::{KernelError, Result};
use async_trait::async_trait;

/// Ethertype of RARP.
const ETH_P_RARP: u16 = 0x8035;
/// Ethertype of ARP.
const ETH_P_ARP: u16 = 0x0806;
/// `sll_pkttype` of a frame this host sent.
const PACKET_OUTGOING: u8 = 4;

/// What kind of announcement a frame was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnnounceKind {
    /// A RARP frame (QEMU's announce_self sends "request reverse").
    Rarp,
    /// A gratuitous ARP: sender and target protocol address equal.
    Garp,
}

/// One announcement seen on a node interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Announcement {
    /// The interface it arrived on.
    pub ifindex: u32,
    /// The announcing MAC (the frame's source, equal to the ARP sender).
    pub mac: [u8; 6],
    /// RARP or gratuitous ARP.
    pub kind: AnnounceKind,
    /// When the daemon read it.
    pub seen: Instant,
}

/// Reads the announcing MAC out of an Ethernet frame, if the frame is a
/// RARP or a gratuitous ARP whose sender hardware address is the frame's
/// source.
pub fn parse_frame(frame: &[u8]) -> Option<(AnnounceKind, [u8; 6])> {
    // Ethernet header (14) + ARP body for Ethernet/IPv4 (28).
    if frame.len() < 42 {
        return None;
    }
    let ethertype = u16::from_be_bytes([frame[12], frame[13]]);
    let src: [u8; 6] = frame[6..12].try_into().ok()?;
    let body = &frame[14..];
    let (htype, ptype, hlen, plen) = (
        u16::from_be_bytes([body[0], body[1]]),
        u16::from_be_bytes([body[2], body[3]]),
        body[4],
        body[5],
    );
    if htype != 1 || ptype != 0x0800 || hlen != 6 || plen != 4 {
        return None;
    }
    let sha: [u8; 6] = body[8..14].try_into().ok()?;
    if sha != src || src[0] & 1 == 1 {
        return None;
    }
    match ethertype {
        ETH_P_RARP => Some((AnnounceKind::Rarp, sha)),
        ETH_P_ARP => {
            let (spa, tpa) = (&body[14..18], &body[24..28]);
            (spa == tpa && spa != [0, 0, 0, 0]).then_some((AnnounceKind::Garp, sha))
        }
        _ => None,
    }
}

/// The two packet sockets.
pub struct AnnounceListener {
    rarp: AsyncFd<OwnedFd>,
    arp: AsyncFd<OwnedFd>,
}

impl AnnounceListener {
    /// Opens the sockets in the calling thread's netns (the daemon's).
    pub fn open() -> Result<AnnounceListener> {
        Ok(AnnounceListener {
            rarp: watched(packet_socket(ETH_P_RARP)?)?,
            arp: watched(packet_socket(ETH_P_ARP)?)?,
        })
    }
}

#[async_trait]
impl Announcements for AnnounceListener {
    async fn next(&self) -> Result<Announcement> {
        loop {
            let got = tokio::select! {
                r = read_one(&self.rarp) => r,
                r = read_one(&self.arp) => r,
            };
            let (ifindex, frame_len, frame) =
                got.map_err(|e| KernelError::refused("reading announcements", e))?;
            if let Some((kind, mac)) = parse_frame(&frame[..frame_len]) {
                return Ok(Announcement {
                    ifindex,
                    mac,
                    kind,
                    seen: Instant::now(),
                });
            }
        }
    }
}

/// An `AF_PACKET` raw socket receiving frames of one ethertype.
fn packet_socket(ethertype: u16) -> Result<OwnedFd> {
    let protocol = ethertype.to_be();
    // SAFETY: plain socket(2); the returned descriptor is checked and owned.
    let fd = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            i32::from(protocol),
        )
    };
    if fd < 0 {
        return Err(KernelError::refused(
            format!("opening a packet socket for ethertype {ethertype:#06x}"),
            io::Error::last_os_error(),
        ));
    }
    // SAFETY: fd is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Registers a socket with the runtime. Panics outside a tokio runtime
/// (the daemon always has one).
fn watched(fd: OwnedFd) -> Result<AsyncFd<OwnedFd>> {
    // SAFETY: the OwnedFd is moved into the AsyncFd, so the descriptor stays
    // open and the same for the AsyncFd's whole life, and as_raw_fd of an
    // OwnedFd always returns that descriptor.
    unsafe { AsyncFd::register(fd) }
        .map_err(|e| KernelError::refused("watching a packet socket", io::Error::from(e)))
}

/// Reads one frame: (ifindex, length, buffer). Frames this host sent are
/// skipped.
async fn read_one(fd: &AsyncFd<OwnedFd>) -> io::Result<(u32, usize, [u8; 64])> {
    let mut buf = [0u8; 64];
    let (ifindex, n) = recv_frame(fd, &mut buf).await?;
    Ok((ifindex, n, buf))
}

/// Reads the next frame into `buf` from a packet socket: (ifindex, length).
/// Frames this host sent (`PACKET_OUTGOING`) are skipped; a frame longer
/// than `buf` is truncated to it.
pub async fn recv_frame(fd: &AsyncFd<OwnedFd>, buf: &mut [u8]) -> io::Result<(u32, usize)> {
    loop {
        let mut guard = fd.readable().await?;
        let got = guard.try_io(|inner| {
            // SAFETY: sockaddr_ll is plain data; zeroed is a valid value.
            let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            let mut from_len = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
            // SAFETY: buf and from are valid for the lengths given; the
            // kernel writes at most those many bytes. MSG_TRUNC is not set,
            // so n is at most buf.len().
            let n = unsafe {
                libc::recvfrom(
                    inner.get_ref().as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    0,
                    std::ptr::addr_of_mut!(from).cast(),
                    &mut from_len,
                )
            };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok((from, n as usize))
        });
        match got {
            Ok(Ok((from, n))) => {
                if from.sll_pkttype == PACKET_OUTGOING {
                    continue;
                }
                return Ok((from.sll_ifindex as u32, n));
            }
            Ok(Err(e)) => return Err(e),
            Err(_would_block) => continue,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(ethertype: u16, src: [u8; 6], sha: [u8; 6], spa: [u8; 4], tpa: [u8; 4]) -> Vec<u8> {
        let mut f = vec![0xff; 6];
        f.extend_from_slice(&src);
        f.extend_from_slice(&ethertype.to_be_bytes());
        f.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 3]);
        f.extend_from_slice(&sha);
        f.extend_from_slice(&spa);
        f.extend_from_slice(&sha);
        f.extend_from_slice(&tpa);
        f.resize(60, 0);
        f
    }

    const MAC: [u8; 6] = [0x0a, 0x58, 0x0a, 0xf4, 0x00, 0x05];

    #[test]
    fn recognises_rarp_and_gratuitous_arp_only() {
        let rarp = frame(ETH_P_RARP, MAC, MAC, [0; 4], [0; 4]);
        assert_eq!(parse_frame(&rarp), Some((AnnounceKind::Rarp, MAC)));
        let garp = frame(ETH_P_ARP, MAC, MAC, [10, 0, 0, 5], [10, 0, 0, 5]);
        assert_eq!(parse_frame(&garp), Some((AnnounceKind::Garp, MAC)));
        // An ordinary ARP request (asking for another address) is not one.
        let ask = frame(ETH_P_ARP, MAC, MAC, [10, 0, 0, 5], [169, 254, 1, 1]);
        assert_eq!(parse_frame(&ask), None);
        // A probe from 0.0.0.0 is not an announcement either.
        let probe = frame(ETH_P_ARP, MAC, MAC, [0; 4], [0; 4]);
        assert_eq!(parse_frame(&probe), None);
        // Sender hardware address must be the frame's source.
        let mut other = MAC;
        other[5] = 9;
        assert_eq!(
            parse_frame(&frame(ETH_P_RARP, other, MAC, [0; 4], [0; 4])),
            None
        );
        // Multicast sources, other ethertypes, short frames: no.
        let mut mcast = MAC;
        mcast[0] |= 1;
        assert_eq!(
            parse_frame(&frame(ETH_P_RARP, mcast, mcast, [0; 4], [0; 4])),
            None
        );
        assert_eq!(parse_frame(&frame(0x0800, MAC, MAC, [0; 4], [0; 4])), None);
        assert_eq!(parse_frame(&rarp[..41]), None);
    }
}
