//! DHCPv4, DHCPv6 and router advertisements for the guests of the `tap`
//! and `managedTap` bindings, served by the daemon on the node-side veth of
//! each such VM pod (the guest's frames reach it unchanged through the
//! pod): no process per pod, and no state beyond each guest's lease, which
//! comes from the VM's record. So a guest is answered identically on every
//! node and after a daemon restart, and a renewal after a live migration
//! gets the same lease from the new node.
//!
//! - [`responder`]: the answers, pure functions of a frame and a lease;
//! - `socket`: the filtered per-interface packet sockets;
//! - [`DhcpServer`]: a task per served interface, the periodic router
//!   advertisements, and the counters.

pub mod responder;
mod socket;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::ffi::CString;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use responder::{Dropped, Kind, Outcome};
use socket::GuestSocket;
use tether_base::sync::lock;
use tether_kernel::error::Result;
use tether_kernel::KernelError;
use tether_kernel::{GuestDhcp, GuestLease};

/// How often an unsolicited router advertisement refreshes the guest's
/// default router: three times per router lifetime.
const ADVERTISE_EVERY: Duration = Duration::from_secs(responder::ROUTER_LIFETIME_SECS as u64 / 3);

pub use tether_kernel::DhcpStats;

#[derive(Debug, Default)]
struct Counters {
    dhcp4: AtomicU64,
    dhcp6: AtomicU64,
    router_adverts: AtomicU64,
    arp: AtomicU64,
    malformed: AtomicU64,
    foreign_mac: AtomicU64,
    unanswered: AtomicU64,
    send_errors: AtomicU64,
}

impl Counters {
    fn add(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> DhcpStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        DhcpStats {
            dhcp4: get(&self.dhcp4),
            dhcp6: get(&self.dhcp6),
            router_adverts: get(&self.router_adverts),
            arp: get(&self.arp),
            malformed: get(&self.malformed),
            foreign_mac: get(&self.foreign_mac),
            unanswered: get(&self.unanswered),
            send_errors: get(&self.send_errors),
        }
    }
}

/// One served interface.
struct Served {
    ifindex: u32,
    lease: watch::Sender<GuestLease>,
    socket: Arc<GuestSocket>,
    task: tokio::task::JoinHandle<()>,
}

/// The daemon's guest DHCP service (the real [`GuestDhcp`]).
#[derive(Default)]
pub struct DhcpServer {
    served: Mutex<HashMap<String, Served>>,
    counters: Arc<Counters>,
}

impl DhcpServer {
    /// A service answering nobody yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The counters so far.
    pub fn stats(&self) -> DhcpStats {
        self.counters.snapshot()
    }

    /// The names of the interfaces served.
    pub fn serving(&self) -> Vec<String> {
        let mut names: Vec<String> = lock(&self.served).keys().cloned().collect();
        names.sort();
        names
    }
}

impl Drop for DhcpServer {
    fn drop(&mut self) {
        for (_, s) in lock(&self.served).drain() {
            s.task.abort();
        }
    }
}

/// The index of node interface `ifname`, in the daemon's netns.
fn ifindex(ifname: &str) -> Result<u32> {
    let name = CString::new(ifname)
        .map_err(|_| KernelError::Internal(format!("interface name {ifname:?} has a NUL byte")))?;
    // SAFETY: name is a valid NUL-terminated string for the call's length.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if index == 0 {
        return Err(KernelError::refused(
            format!("looking up {ifname} to answer its guest's DHCP"),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(index)
}

impl GuestDhcp for DhcpServer {
    fn serve(&self, ifname: &str, lease: GuestLease) -> Result<()> {
        let index = ifindex(ifname)?;
        let mut served = lock(&self.served);
        if let Some(s) = served.get(ifname) {
            if s.ifindex == index && !s.task.is_finished() {
                s.lease.send_replace(lease);
                return Ok(());
            }
        }
        // New, or the veth was made again (a repaired pod): a new socket.
        if let Some(old) = served.remove(ifname) {
            old.task.abort();
        }
        let socket = Arc::new(GuestSocket::open(index)?);
        let (tx, rx) = watch::channel(lease);
        let task = tokio::runtime::Handle::try_current()
            .map_err(|_| KernelError::Internal("guest DHCP needs a tokio runtime".into()))?
            .spawn(answer_loop(
                ifname.to_owned(),
                socket.clone(),
                rx,
                self.counters.clone(),
            ));
        served.insert(
            ifname.to_owned(),
            Served {
                ifindex: index,
                lease: tx,
                socket,
                task,
            },
        );
        Ok(())
    }

    fn stop(&self, ifname: &str) {
        if let Some(s) = lock(&self.served).remove(ifname) {
            s.task.abort();
        }
    }

    fn stats(&self) -> (DhcpStats, usize) {
        (self.counters.snapshot(), lock(&self.served).len())
    }

    fn announce_router(&self, ifname: &str) {
        let served = lock(&self.served);
        let Some(s) = served.get(ifname) else {
            return;
        };
        let lease = s.lease.borrow().clone();
        advertise(ifname, &s.socket, &lease, &self.counters);
    }
}

/// Sends one unsolicited router advertisement, if the guest has IPv6.
fn advertise(ifname: &str, socket: &GuestSocket, lease: &GuestLease, counters: &Counters) {
    let Some(frame) = responder::unsolicited_advertisement(lease) else {
        return;
    };
    match socket.send(&frame) {
        Ok(()) => Counters::add(&counters.router_adverts),
        Err(e) => {
            Counters::add(&counters.send_errors);
            tracing::debug!(veth = ifname, error = %e, "sending a router advertisement failed");
        }
    }
}

/// Answers one interface's guest until stopped.
async fn answer_loop(
    ifname: String,
    socket: Arc<GuestSocket>,
    lease: watch::Receiver<GuestLease>,
    counters: Arc<Counters>,
) {
    let mut buf = vec![0u8; socket::BUFFER];
    let mut ticker = tokio::time::interval(ADVERTISE_EVERY);
    // Guests that learned another MAC: warned about once each.
    let mut warned = std::collections::HashSet::new();
    loop {
        let n = tokio::select! {
            got = socket.recv(&mut buf) => match got {
                Ok(n) => n,
                Err(e) => {
                    // The veth is gone (its pod was deleted): the DEL stops
                    // this task; until then, do not spin.
                    tracing::debug!(veth = ifname, error = %e, "reading guest frames failed");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            },
            _ = ticker.tick() => {
                let current = lease.borrow().clone();
                advertise(&ifname, &socket, &current, &counters);
                continue;
            }
        };
        let Some(frame) = buf.get(..n) else {
            continue;
        };
        let current = lease.borrow().clone();
        match responder::respond(frame, &current) {
            Outcome::Reply(kind, frames) => {
                tracing::debug!(veth = ifname, ?kind, "answering the guest");
                for f in frames {
                    match socket.send(&f) {
                        Ok(()) => Counters::add(match kind {
                            Kind::Dhcp4 => &counters.dhcp4,
                            Kind::Dhcp6 => &counters.dhcp6,
                            Kind::RouterAdvert => &counters.router_adverts,
                            Kind::Arp => &counters.arp,
                        }),
                        Err(e) => {
                            Counters::add(&counters.send_errors);
                            tracing::debug!(veth = ifname, error = %e, "sending an answer failed");
                        }
                    }
                }
            }
            Outcome::Ignored => {}
            Outcome::Dropped(why) => {
                tracing::debug!(veth = ifname, ?why, "not answering a guest frame");
                Counters::add(match why {
                    Dropped::Malformed => &counters.malformed,
                    Dropped::ForeignMac => &counters.foreign_mac,
                    Dropped::Unanswered => &counters.unanswered,
                });
                if why == Dropped::ForeignMac {
                    let src: [u8; 6] = frame
                        .get(6..12)
                        .and_then(|s| s.try_into().ok())
                        .unwrap_or_default();
                    if warned.insert(src) {
                        tracing::warn!(
                            veth = ifname,
                            guest_mac = %tether_base::mac::Mac::from(src),
                            vm_mac = %current.mac,
                            "a guest asks for an address with a MAC that is not its VM's: it gets no \
                             answer. Remove the VMI's macAddress, or set it to the VM's MAC"
                        );
                    }
                }
            }
        }
    }
}
