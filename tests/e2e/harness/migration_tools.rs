//! Self-tests of the live-migration tools (`tether_e2e::migration`): the
//! ICMP prober's counts and loss windows across a known pause, in both
//! families, and the RARP and gratuitous ARP announcements as they arrive
//! at the other end of a veth.
//!
//! Each test builds two netns joined by a veth pair; nothing touches the
//! machine's own netns. Run as root.

use std::io;
use std::mem;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Command;
use std::time::{Duration, Instant};

use tether_e2e::migration::{
    garp_frame, pause_icmp, rarp_frame, send_garp, send_rarp, LossWindow, Prober, ETH_P_ARP,
    ETH_P_RARP,
};
use tether_e2e::{require_root, unique_name, wait_until, Netns};

/// 2000 probes per second, as the migration test sends them.
const INTERVAL: Duration = Duration::from_micros(500);
/// How long the responder ignores echo requests.
const PAUSE: Duration = Duration::from_millis(100);
/// A QEMU-style guest MAC (locally administered, QEMU's OUI).
const GUEST_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];

const A_V4: &str = "10.99.0.1/24";
const B_V4: &str = "10.99.0.2/24";
const A_V6: &str = "fd00:99::1/64";
const B_V6: &str = "fd00:99::2/64";

/// Two netns, `a` and `b`, joined by a veth pair (`va` in `a`, `vb` in
/// `b`), both ends up with an IPv4 and an IPv6 address. Dropping it
/// deletes both netns, and the veth with them.
struct Pair {
    a: Netns,
    b: Netns,
    va: String,
    vb: String,
}

impl Pair {
    fn new() -> Pair {
        let pair = Pair {
            a: Netns::new("mga"),
            b: Netns::new("mgb"),
            va: unique_name("mv"),
            vb: unique_name("mv"),
        };
        // Created inside a, its peer moved straight into b: the veth is
        // never in the machine's netns.
        pair.a.exec_ok(&[
            "ip",
            "link",
            "add",
            &pair.va,
            "type",
            "veth",
            "peer",
            "name",
            &pair.vb,
            "netns",
            pair.b.name(),
        ]);
        for (ns, link, v4, v6) in [
            (&pair.a, &pair.va, A_V4, A_V6),
            (&pair.b, &pair.vb, B_V4, B_V6),
        ] {
            ns.exec_ok(&["ip", "addr", "add", v4, "dev", link]);
            // nodad: usable at once, no tentative second or two.
            ns.exec_ok(&["ip", "addr", "add", v6, "dev", link, "nodad"]);
            ns.exec_ok(&["ip", "link", "set", link, "up"]);
        }
        // Wait for the carrier on both ends: until then the kernel drops
        // what either side sends, and the first ARP or neighbour
        // solicitation lost is only retried a second later.
        let up = |ns: &Netns, link: &str| {
            ns.ip_json(&["link", "show", "dev", link])
                .first()
                .is_some_and(|l| l["operstate"] == "UP")
        };
        assert!(
            wait_until(Duration::from_secs(5), || up(&pair.a, &pair.va)
                && up(&pair.b, &pair.vb)),
            "the veth pair did not come up within 5 s"
        );
        pair
    }
}

fn host(cidr: &str) -> IpAddr {
    cidr.split('/')
        .next()
        .and_then(|a| a.parse().ok())
        .expect("a test address parses")
}

/// A stream from a to b: steady for a second, then b ignores echo for
/// [`PAUSE`]; exactly one loss window, of about the pause, where the pause
/// was, and the stream resumes.
fn prober_measures_a_pause(target_cidr: &str) {
    require_root();
    let pair = Pair::new();
    let target = host(target_cidr);

    let prober = Prober::start(&pair.a, target, INTERVAL);
    std::thread::sleep(Duration::from_millis(1100));

    let paused_at = Instant::now();
    pause_icmp(&pair.b, true);
    let pause_took = paused_at.elapsed();
    std::thread::sleep(PAUSE.saturating_sub(pause_took));
    pause_icmp(&pair.b, false);
    let resumed_at = Instant::now();
    assert!(
        wait_until(Duration::from_secs(10), || prober
            .received_since(resumed_at)
            >= 200),
        "probes did not resume within 10 s of the end of the pause: {prober:?}"
    );
    let report = prober.stop();
    eprintln!("{report}");
    eprintln!("pause_icmp took {pause_took:?}");

    // The steady second: from the first answered probe on (the first
    // probes wait for ARP or neighbour discovery), before the pause.
    let first = report
        .probes
        .iter()
        .find(|p| p.answered())
        .expect("some probe was answered")
        .sent;
    let steady: Vec<_> = report
        .probes
        .iter()
        .filter(|p| p.sent >= first && p.sent < first + Duration::from_secs(1))
        .collect();
    let steady_sent = steady.len();
    let steady_received = steady.iter().filter(|p| p.answered()).count();
    eprintln!("steady second: sent {steady_sent}, received {steady_received}");
    // The send rate is the machine's: a loaded one sends fewer than the
    // 2000 a second asked for. What is checked is that the prober sends
    // at all and that what it sends is answered; the rate is
    // `tether-bench`'s to report.
    assert!(
        steady_sent >= 100,
        "only {steady_sent} probes sent in the first second at {INTERVAL:?}: {report}"
    );
    assert!(
        steady_received * 100 >= steady_sent * 95,
        "only {steady_received} of {steady_sent} probes answered in the first second: {report}"
    );

    let windows = report.loss_windows();
    assert_eq!(windows.len(), 1, "{windows:#?}\n{report}");
    let w: LossWindow = windows[0];
    eprintln!(
        "loss window: {:?} ({} probes), starting {:?} after the pause, resumed {:?} after \
         its end",
        w.duration,
        w.lost,
        signed(w.start, paused_at),
        signed(w.resumed, resumed_at),
    );
    // The window is checked against when the rule was in force, not
    // against the clock: the rule was in place from `pause_took` after
    // the pause began until `resumed_at` at the latest, so no probe sent
    // in between was answered, and every probe answered around the window
    // was sent outside it. A probe's send and its arrival at the
    // responder are apart by the kernel's own delay: `slack` allows for
    // it.
    let slack = Duration::from_millis(20);
    let in_force = paused_at + pause_took;
    let index_of = |t: Instant| {
        report
            .probes
            .iter()
            .position(|p| p.sent == t)
            .expect("a window's probe is in the record")
    };
    let first_lost = index_of(w.start);
    let resumed = index_of(w.resumed);
    let last_answered = report.probes[first_lost - 1].sent;
    let last_lost = report.probes[resumed - 1].sent;
    assert!(
        last_answered <= in_force + slack,
        "a probe sent {:?} after the pause began was answered",
        signed(last_answered, paused_at)
    );
    assert!(
        w.start + slack >= paused_at,
        "a probe sent {:?} before the pause was lost",
        signed(paused_at, w.start)
    );
    assert!(
        last_lost <= resumed_at + slack,
        "a probe sent {:?} after the pause's end was lost",
        signed(last_lost, resumed_at)
    );
    // The rule came off no earlier than `PAUSE` after the pause began
    // (the sleep between may only be longer).
    assert!(
        w.resumed + slack >= paused_at + PAUSE,
        "a probe sent {:?} after the pause began, while it was in force, was answered",
        signed(w.resumed, paused_at)
    );
    assert!(
        w.duration + slack >= PAUSE.saturating_sub(pause_took),
        "a {PAUSE:?} pause, in force for at least {:?}, measured as {w:?}",
        PAUSE.saturating_sub(pause_took)
    );
    assert_eq!(report.longest_loss_after(paused_at - slack), Some(w));
    assert_eq!(report.trailing_lost, 0, "{report}");
    assert_eq!(report.send_errors, 0, "{report}");
    assert!(report.received * 100 >= report.sent * 85, "{report}");
}

/// `a - b` in milliseconds, signed, for messages.
fn signed(a: Instant, b: Instant) -> String {
    if a >= b {
        format!("{:?}", a - b)
    } else {
        format!("-{:?}", b - a)
    }
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn prober_measures_a_100ms_pause_v4() {
    prober_measures_a_pause(B_V4);
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn prober_measures_a_100ms_pause_v6() {
    prober_measures_a_pause(B_V6);
}

/// An AF_PACKET socket on one link of a netns receiving frames of one
/// ethertype, opened before the send so nothing is missed.
struct Capture {
    sock: OwnedFd,
}

impl Capture {
    fn open(ns: &Netns, ifname: &str, ethertype: u16) -> Capture {
        let (index, sock) = ns.run(|| {
            let index = if_index(ifname).expect("looking up the capture link");
            let proto = libc::c_int::from(ethertype.to_be());
            // SAFETY: socket(2) takes plain integers.
            let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, proto) };
            assert!(fd >= 0, "packet socket: {}", io::Error::last_os_error());
            // SAFETY: fd is a new socket owned by no one else.
            (index, unsafe { OwnedFd::from_raw_fd(fd) })
        });
        let sll = libc::sockaddr_ll {
            sll_family: libc::AF_PACKET as libc::c_ushort,
            sll_protocol: ethertype.to_be(),
            sll_ifindex: index,
            sll_hatype: 0,
            sll_pkttype: 0,
            sll_halen: 0,
            sll_addr: [0; 8],
        };
        // SAFETY: sll is a valid sockaddr_ll of the length given.
        let rc = unsafe {
            libc::bind(
                sock.as_raw_fd(),
                (&sll as *const libc::sockaddr_ll).cast(),
                mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0, "binding the capture: {}", io::Error::last_os_error());
        Capture { sock }
    }

    /// The next frame whose source MAC is `src`, within `limit`.
    fn frame_from(&self, src: [u8; 6], limit: Duration) -> Option<Vec<u8>> {
        let deadline = Instant::now() + limit;
        let mut buf = [0u8; 2048];
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            let mut pfd = libc::pollfd {
                fd: self.sock.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = left.as_millis().clamp(1, 1000) as libc::c_int;
            // SAFETY: one valid pollfd.
            if unsafe { libc::poll(&mut pfd, 1, ms) } <= 0 {
                continue;
            }
            // SAFETY: buf is valid for writes of buf.len() bytes.
            let n = unsafe {
                libc::recv(
                    self.sock.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n >= 12 && buf[6..12] == src {
                return Some(buf[..n as usize].to_vec());
            }
        }
    }
}

fn if_index(ifname: &str) -> io::Result<libc::c_int> {
    let name = std::ffi::CString::new(ifname).map_err(io::Error::other)?;
    // SAFETY: name is NUL-terminated and only read.
    match unsafe { libc::if_nametoindex(name.as_ptr()) } {
        0 => Err(io::Error::last_os_error()),
        i => Ok(i as libc::c_int),
    }
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn send_rarp_sends_qemus_announcement() {
    require_root();
    let pair = Pair::new();
    let capture = Capture::open(&pair.b, &pair.vb, ETH_P_RARP);
    let _sent_at: Instant = send_rarp(&pair.a, &pair.va, GUEST_MAC);
    let frame = capture
        .frame_from(GUEST_MAC, Duration::from_secs(2))
        .expect("the RARP frame arrives at the veth's other end within 2 s");

    assert_eq!(frame.len(), 60, "{frame:02x?}");
    assert_eq!(frame[..6], [0xff; 6], "broadcast destination");
    assert_eq!(frame[6..12], GUEST_MAC, "source MAC");
    assert_eq!(frame[12..14], [0x80, 0x35], "ethertype RARP");
    assert_eq!(frame[14..20], [0, 1, 0x08, 0x00, 6, 4], "Ethernet/IPv4");
    assert_eq!(frame[20..22], [0, 3], "op 3, request reverse");
    assert_eq!(frame[22..28], GUEST_MAC, "sha");
    assert_eq!(frame[28..32], [0; 4], "spa");
    assert_eq!(frame[32..38], GUEST_MAC, "tha");
    assert_eq!(frame[38..42], [0; 4], "tpa");
    assert_eq!(frame[..], rarp_frame(GUEST_MAC)[..], "padding is zero");
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn send_garp_sends_a_gratuitous_arp_request() {
    require_root();
    let pair = Pair::new();
    let ip = Ipv4Addr::new(10, 99, 0, 7);
    let capture = Capture::open(&pair.b, &pair.vb, ETH_P_ARP);
    let _sent_at: Instant = send_garp(&pair.a, &pair.va, GUEST_MAC, ip);
    let frame = capture
        .frame_from(GUEST_MAC, Duration::from_secs(2))
        .expect("the gratuitous ARP arrives at the veth's other end within 2 s");

    assert_eq!(frame.len(), 60, "{frame:02x?}");
    assert_eq!(frame[..6], [0xff; 6], "broadcast destination");
    assert_eq!(frame[6..12], GUEST_MAC, "source MAC");
    assert_eq!(frame[12..14], [0x08, 0x06], "ethertype ARP");
    assert_eq!(frame[14..20], [0, 1, 0x08, 0x00, 6, 4], "Ethernet/IPv4");
    assert_eq!(frame[20..22], [0, 1], "op 1, request");
    assert_eq!(frame[22..28], GUEST_MAC, "sha");
    assert_eq!(frame[28..32], ip.octets(), "spa");
    assert_eq!(frame[32..38], [0; 6], "tha");
    assert_eq!(frame[38..42], ip.octets(), "tpa");
    assert_eq!(frame[..], garp_frame(GUEST_MAC, ip)[..], "padding is zero");
}

fn netns_listed(name: &str) -> bool {
    let out = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("running ip netns list");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|l| l.split_whitespace().next() == Some(name))
}

/// A panic with a prober running still removes both netns (and the veth
/// with them) and stops the prober.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn a_panic_leaves_nothing_behind() {
    require_root();
    let mut names = Vec::new();
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let pair = Pair::new();
        names = vec![pair.a.name().to_owned(), pair.b.name().to_owned()];
        let _prober = Prober::start(&pair.a, host(B_V4), INTERVAL);
        std::thread::sleep(Duration::from_millis(50));
        panic!("deliberate panic with a prober running");
    }));
    assert!(caught.is_err());
    for name in &names {
        assert!(!netns_listed(name), "netns {name} left behind");
    }
}
