//! The real feed of the flow table's changes (see
//! [`crate::flow_watch`]): a netfilter netlink socket subscribed to
//! conntrack's event groups (flows made, changed, ended) in the caller's
//! network namespace, read by a thread of its own that keeps the changes
//! of the flows being tracked until they are taken.
//!
//! The kernel sends an event to the socket for every flow of the
//! namespace that changes, tracked or not; the thread drops the others
//! at once. If the socket's buffer overruns (`ENOBUFS`), or the kept
//! changes pass [`KEEP_LIMIT`], the feed says it lost changes, and the
//! watch reads the table again.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use netlink_packet_netfilter::conntrack::ConntrackMessage;
use netlink_packet_netfilter::{NetfilterMessage, NetfilterMessageInner};
use rtnetlink::packet_core::NetlinkPayload;
use rtnetlink::sys::{protocols, Socket};

use super::nf_read::{flow_of, messages_in};
use crate::error::{KernelError, Result};
use crate::handover::{touches, FlowChange, FlowChanges, FlowFeed};
use tether_base::sync::lock;

/// `NFNLGRP_CONNTRACK_NEW`, `_UPDATE` and `_DESTROY`.
const GROUPS: [u32; 3] = [1, 2, 3];
/// The socket's receive buffer: room for a burst of events between two
/// reads of the thread (about 200 bytes each).
const RECV_BUFFER: usize = 4 << 20;
/// How long the thread waits for an event before it looks whether the
/// feed was dropped.
const POLL: Duration = Duration::from_millis(500);
/// The most changes kept between two takes; past it they are dropped and
/// the feed says so (nobody takes them: a watch takes them every round).
const KEEP_LIMIT: usize = 100_000;

/// What the thread and the feed share.
#[derive(Default)]
struct Kept {
    tracked: BTreeSet<IpAddr>,
    changes: Vec<FlowChange>,
    lost: bool,
    /// The thread ended (its socket failed): every take says changes
    /// were lost, so the table is read each time, as without a feed.
    dead: bool,
}

/// The real feed (see the module doc).
pub struct LinuxFlowFeed {
    kept: Arc<Mutex<Kept>>,
    stop: Arc<AtomicBool>,
}

impl Drop for LinuxFlowFeed {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl FlowFeed for LinuxFlowFeed {
    fn track(&mut self, ips: &BTreeSet<IpAddr>) {
        lock(&self.kept).tracked = ips.clone();
    }

    fn take(&mut self) -> FlowChanges {
        let mut kept = lock(&self.kept);
        FlowChanges {
            changes: std::mem::take(&mut kept.changes),
            lost: std::mem::take(&mut kept.lost) || kept.dead,
        }
    }
}

/// Whether this namespace's conntrack sends events: `nf_conntrack_events`
/// 0 turns them off (1 on, 2, the default of recent kernels, on while a
/// socket listens). Unreadable (no conntrack module loaded yet) counts as
/// on: loading it gives the default.
fn events_on() -> bool {
    std::fs::read_to_string("/proc/sys/net/netfilter/nf_conntrack_events")
        .map(|v| v.trim() != "0")
        .unwrap_or(true)
}

/// Opens the feed in the calling thread's network namespace.
pub(super) fn open() -> Result<LinuxFlowFeed> {
    if !events_on() {
        return Err(KernelError::Internal(
            "conntrack events are off (net.netfilter.nf_conntrack_events = 0)".into(),
        ));
    }
    let refused = |e| KernelError::refused("opening the feed of conntrack's events", e);
    let mut socket = Socket::new(protocols::NETLINK_NETFILTER).map_err(refused)?;
    socket.bind_auto().map_err(refused)?;
    for g in GROUPS {
        socket.add_membership(g).map_err(refused)?;
    }
    // Past net.core.rmem_max needs CAP_NET_ADMIN, which the daemon has;
    // without it, the plain size (capped at rmem_max).
    if nix::sys::socket::setsockopt(
        &socket,
        nix::sys::socket::sockopt::RcvBufForce,
        &RECV_BUFFER,
    )
    .is_err()
    {
        let _ = socket.set_rx_buf_sz(RECV_BUFFER);
    }
    let timeout = nix::sys::time::TimeVal::new(0, POLL.as_micros() as _);
    nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::ReceiveTimeout, &timeout)
        .map_err(|e| refused(std::io::Error::from(e)))?;
    let kept = Arc::new(Mutex::new(Kept::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let (k, s) = (kept.clone(), stop.clone());
    std::thread::Builder::new()
        .name("tether-flow-feed".into())
        .spawn(move || read_events(socket, &k, &s))
        .map_err(refused)?;
    Ok(LinuxFlowFeed { kept, stop })
}

/// The thread: reads events until the feed is dropped, keeping those of
/// tracked flows.
fn read_events(socket: Socket, kept: &Mutex<Kept>, stop: &AtomicBool) {
    let mut buf: Vec<u8> = Vec::with_capacity(1 << 16);
    while !stop.load(Ordering::Relaxed) {
        buf.clear();
        let n = match socket.recv(&mut buf, 0) {
            Ok(n) => n,
            Err(e) => match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::EINTR) => continue,
                Some(libc::ENOBUFS) => {
                    lock(kept).lost = true;
                    continue;
                }
                _ => {
                    tracing::warn!(error = %e, "the feed of conntrack's events failed: the table is read instead");
                    lock(kept).dead = true;
                    return;
                }
            },
        };
        let mut changes = Vec::new();
        for msg in messages_in(&buf[..n]) {
            let NetlinkPayload::InnerMessage(NetfilterMessage {
                inner: NetfilterMessageInner::Conntrack(ct),
                ..
            }) = msg.payload
            else {
                continue;
            };
            match ct {
                ConntrackMessage::New(attrs) => {
                    changes.extend(flow_of(&attrs).map(FlowChange::Made))
                }
                ConntrackMessage::Delete(attrs) => {
                    changes.extend(flow_of(&attrs).map(FlowChange::Gone))
                }
                _ => {}
            }
        }
        if changes.is_empty() {
            continue;
        }
        let mut k = lock(kept);
        let tracked = std::mem::take(&mut k.tracked);
        k.changes
            .extend(changes.into_iter().filter(|c| touches(c.flow(), &tracked)));
        k.tracked = tracked;
        if k.changes.len() > KEEP_LIMIT {
            k.changes.clear();
            k.lost = true;
        }
    }
}
