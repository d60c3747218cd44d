//! Flows a NetworkPolicy must deny, tried again and again: from a netns
//! of the test, every `interval`, a new TCP connection to one address and
//! a UDP message `S <n>` (as `tether-echo` answers them) from a new port
//! to another, each try recorded with whether it got through (the
//! connection opened, an answer came).
//!
//! A test first sees tries get through (the probe works and the far end
//! answers), then makes its policy, waits until they stop, and from then
//! on asserts that none gets through ([`Denied::passed_since`]), through
//! whatever it does meanwhile (a live migration).

use std::io::ErrorKind;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::streams::Proto;
use crate::Netns;

/// One try that got through: when it began, and over what.
#[derive(Debug, Clone, Copy)]
pub struct Passed {
    /// When the try began.
    pub at: Instant,
    /// TCP (a connection opened) or UDP (an answer came).
    pub proto: Proto,
}

#[derive(Default)]
struct Record {
    tries: u64,
    passed: Vec<Passed>,
    errors: Vec<String>,
}

struct Shared {
    record: Mutex<Record>,
    stop: AtomicBool,
}

impl Shared {
    fn record(&self) -> MutexGuard<'_, Record> {
        self.record.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The prober of one source toward one destination (see the module doc).
pub struct Denied {
    name: String,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// What a [`Denied`] saw.
#[derive(Debug, Clone)]
pub struct DeniedReport {
    /// Its name.
    pub name: String,
    /// Rounds of tries (one TCP and one UDP each).
    pub tries: u64,
    /// The tries that got through, in order.
    pub passed: Vec<Passed>,
    /// What failed other than the policy's drop (a UDP socket that could
    /// not be opened), at most a few.
    pub errors: Vec<String>,
}

impl DeniedReport {
    /// The tries that got through at or after `t`.
    pub fn passed_since(&self, t: Instant) -> Vec<Passed> {
        self.passed.iter().filter(|p| p.at >= t).copied().collect()
    }
}

impl Denied {
    /// Starts trying from `ns`: TCP to `tcp`, UDP to `udp`, one of each
    /// every `interval` (a TCP try waits at most `interval` for its
    /// connection).
    pub fn start(
        ns: &Netns,
        name: &str,
        tcp: SocketAddr,
        udp: SocketAddr,
        interval: Duration,
    ) -> Denied {
        assert!(!interval.is_zero(), "a probe needs a non-zero interval");
        let shared = Arc::new(Shared {
            record: Mutex::new(Record::default()),
            stop: AtomicBool::new(false),
        });
        let path = ns.path().to_owned();
        let ns_name = ns.name().to_owned();
        let thread = std::thread::Builder::new()
            .name(format!("denied-{name}"))
            .spawn({
                let shared = shared.clone();
                move || match crate::netns::enter_at(&path) {
                    Ok(()) => tries(tcp, udp, interval, &shared),
                    Err(e) => shared
                        .record()
                        .errors
                        .push(format!("entering netns {ns_name}: {e}")),
                }
            })
            .expect("spawning a probe thread");
        Denied {
            name: name.to_owned(),
            shared,
            thread: Some(thread),
        }
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How many tries of each kind, (TCP, UDP), began at or after `t` and
    /// got through so far.
    pub fn passed_since(&self, t: Instant) -> (usize, usize) {
        let r = self.shared.record();
        let of = |proto| {
            r.passed
                .iter()
                .filter(|p| p.at >= t && p.proto == proto)
                .count()
        };
        (of(Proto::Tcp), of(Proto::Udp))
    }

    /// How many rounds began so far.
    pub fn tries(&self) -> u64 {
        self.shared.record().tries
    }

    /// Stops trying; what it saw.
    pub fn stop(mut self) -> DeniedReport {
        self.halt();
        let r = self.shared.record();
        DeniedReport {
            name: self.name.clone(),
            tries: r.tries,
            passed: r.passed.clone(),
            errors: r.errors.clone(),
        }
    }

    fn halt(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Denied {
    fn drop(&mut self) {
        self.halt();
    }
}

/// The first of the UDP tries' source ports: below the kernel's
/// ephemeral range (32768 and up), so that nothing else in the netns takes
/// them.
const FIRST_UDP_PORT: u16 = 20000;
/// How many source ports the UDP tries go through before they start
/// again (at one try every 100 ms, 16 minutes: longer than conntrack
/// remembers a flow).
const UDP_PORTS: u64 = 10_000;

/// A UDP socket from port `port` connected to `to`.
fn udp_to(port: u16, to: SocketAddr, wait: Duration) -> std::io::Result<UdpSocket> {
    let any = match to.ip() {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    let s = UdpSocket::bind(SocketAddr::new(any, port))?;
    s.connect(to)?;
    s.set_read_timeout(Some(wait))?;
    Ok(s)
}

/// The loop of the probe's thread, in its netns. Every round is a new
/// connection of each kind: once a flow has passed, conntrack lets the
/// rest of it pass whatever the policy says later, as it should. So each
/// UDP try comes from a source port no earlier try used (an ephemeral
/// port may come round again while conntrack still holds an answered
/// flow of it, from before the policy); a TCP try's SYN to a port whose
/// connection was closed starts a new flow whatever conntrack remembers.
fn tries(tcp: SocketAddr, udp: SocketAddr, interval: Duration, shared: &Shared) {
    let start = Instant::now();
    let mut n: u64 = 0;
    while !shared.stop.load(Ordering::Relaxed) {
        let at = Instant::now();
        shared.record().tries += 1;
        let port = FIRST_UDP_PORT + (n % UDP_PORTS) as u16;
        let socket = match udp_to(port, udp, interval / 4) {
            Ok(s) => Some(s),
            Err(e) => {
                let mut r = shared.record();
                if r.errors.len() < 3 {
                    r.errors.push(format!("opening UDP to {udp}: {e}"));
                }
                None
            }
        };
        if let Some(s) = &socket {
            // Sent first, so that its answer has the whole round to come.
            let _ = s.send(format!("S {n}\n").as_bytes());
        }
        if TcpStream::connect_timeout(&tcp, interval / 2).is_ok() {
            shared.record().passed.push(Passed {
                at,
                proto: Proto::Tcp,
            });
        }
        // Until the next round: the UDP try's answer.
        n += 1;
        let next = start + interval * n as u32;
        let mut buf = [0u8; 256];
        while let Some(s) = &socket {
            if Instant::now() >= next || shared.stop.load(Ordering::Relaxed) {
                break;
            }
            match s.recv(&mut buf) {
                Ok(_) => {
                    shared.record().passed.push(Passed {
                        at,
                        proto: Proto::Udp,
                    });
                    break;
                }
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                // A port unreachable: nothing passed.
                Err(_) => break,
            }
        }
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
    }
}
