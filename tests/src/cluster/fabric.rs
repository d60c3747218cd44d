//! The fabric: a netns with one Linux bridge, the "switch" every node and
//! the etcd control netns hang off, and the underlay addresses on it.

use super::*;

/// The fabric: a netns holding one Linux bridge with the underlay gateways
/// ([`GATEWAY_V4`], [`GATEWAY_V6`]) on it. [`Fabric::attach`] plugs another
/// netns in with a veth.
///
/// Dropping it deletes the netns, the bridge and the fabric ends of every
/// veth (which takes their other ends with them).
#[derive(Debug)]
pub struct Fabric {
    bridge: String,
    netns: Netns,
}

/// One netns's place on the fabric: its interface there and its addresses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Underlay {
    /// The interface inside the attached netns.
    pub ifname: String,
    /// Its IPv4 address in [`UNDERLAY_V4`].
    pub v4: Ipv4Addr,
    /// Its IPv6 address in [`UNDERLAY_V6`].
    pub v6: Ipv6Addr,
}

impl Fabric {
    /// Creates the fabric netns, its bridge (no STP, no multicast snooping,
    /// so ports forward at once) and the gateway addresses.
    pub fn new() -> Fabric {
        let fabric = Fabric {
            bridge: unique_name("br"),
            netns: Netns::new("fab"),
        };
        let (ns, br) = (fabric.netns.name(), fabric.bridge.as_str());
        ip(&[
            "-n",
            ns,
            "link",
            "add",
            br,
            "type",
            "bridge",
            "stp_state",
            "0",
            "mcast_snooping",
            "0",
        ]);
        ip(&["-n", ns, "link", "set", br, "up"]);
        add_addr(ns, br, &format!("{GATEWAY_V4}/{UNDERLAY_V4_LEN}"));
        add_addr(ns, br, &format!("{GATEWAY_V6}/{UNDERLAY_V6_LEN}"));
        fabric
    }

    /// The fabric netns.
    pub fn netns(&self) -> &Netns {
        &self.netns
    }

    /// The bridge's name (inside [`Fabric::netns`]).
    pub fn bridge(&self) -> &str {
        &self.bridge
    }

    /// Plugs `ns` into the bridge with a new veth, puts `addrs` (each
    /// `ip/prefixlen`, either family; IPv6 without DAD, so usable at once)
    /// on its end inside `ns`, brings both ends up, and returns the name of
    /// that end.
    pub fn attach(&self, ns: &Netns, addrs: &[&str]) -> String {
        let inner = unique_name("u");
        let outer = format!("{inner}f");
        // The peer is created straight in `ns`: it never exists anywhere else.
        ip(&[
            "-n",
            self.netns.name(),
            "link",
            "add",
            &outer,
            "type",
            "veth",
            "peer",
            "name",
            &inner,
            "netns",
            ns.name(),
        ]);
        ip(&[
            "-n",
            self.netns.name(),
            "link",
            "set",
            &outer,
            "master",
            &self.bridge,
            "up",
        ]);
        for addr in addrs {
            add_addr(ns.name(), &inner, addr);
        }
        ip(&["-n", ns.name(), "link", "set", &inner, "up"]);
        inner
    }

    /// [`Fabric::attach`] with the underlay addresses of host number `host`
    /// (`10.77.<host / 256>.<host % 256>/16` and `fd00:77:ff::<host>/64`,
    /// the same decimal digits in the IPv6 group: host 21 is `10.77.0.21`
    /// and `::21`), plus default routes of both families via the gateways:
    /// what a node needs.
    pub fn attach_host(&self, ns: &Netns, host: u16) -> Underlay {
        assert!(
            (2..=MAX_HOST).contains(&host) && !matches!(host % 256, 0 | 255),
            "underlay host number {host} out of range"
        );
        let underlay = Underlay::of_host(String::new(), host);
        let ifname = self.attach(
            ns,
            &[
                &format!("{}/{UNDERLAY_V4_LEN}", underlay.v4),
                &format!("{}/{UNDERLAY_V6_LEN}", underlay.v6),
            ],
        );
        let (gw4, gw6) = (GATEWAY_V4.to_string(), GATEWAY_V6.to_string());
        ip(&[
            "-n",
            ns.name(),
            "-4",
            "route",
            "add",
            "default",
            "via",
            &gw4,
            "dev",
            &ifname,
        ]);
        ip(&[
            "-n",
            ns.name(),
            "-6",
            "route",
            "add",
            "default",
            "via",
            &gw6,
            "dev",
            &ifname,
        ]);
        Underlay { ifname, ..underlay }
    }
}

impl Default for Fabric {
    fn default() -> Fabric {
        Fabric::new()
    }
}

impl Underlay {
    pub(super) fn of_host(ifname: String, host: u16) -> Underlay {
        let [a, b, _, _] = GATEWAY_V4.octets();
        let [c, d] = host.to_be_bytes();
        let mut v6 = GATEWAY_V6.segments();
        // The decimal digits read as hex: host 21 is ::21, as in the v4.
        v6[7] = u16::from_str_radix(&host.to_string(), 16).expect("decimal digits are hex");
        Underlay {
            ifname,
            v4: Ipv4Addr::new(a, b, c, d),
            v6: Ipv6Addr::from(v6),
        }
    }
}

/// Runs `ip args`, panicking with its stderr unless it succeeds.
pub(super) fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("spawning ip {args:?}: {e}"));
    assert!(
        out.status.success(),
        "ip {args:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

/// Adds `addr` (`ip/prefixlen`) to `ifname` in netns `ns`; IPv6 without
/// duplicate address detection, so it is usable at once.
pub(super) fn add_addr(ns: &str, ifname: &str, addr: &str) {
    if addr.contains(':') {
        ip(&["-n", ns, "addr", "add", addr, "dev", ifname, "nodad"]);
    } else {
        ip(&["-n", ns, "addr", "add", addr, "dev", ifname]);
    }
}
