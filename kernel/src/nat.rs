//! Outbound NAT: what tether asks of the node's nftables, as a plan and the
//! one script that programs it.
//!
//! tether owns one table, `inet tether`, for both families. Its only chain
//! masquerades packets from the pod ranges to anywhere outside the no-NAT
//! ranges, unless they leave through a pod veth or the VXLAN device. The
//! script replaces the whole table in one nft transaction, so applying it
//! again changes nothing and a table someone edited is put back exactly.

use ipnet::IpNet;

use crate::{HOST_IFNAME_PREFIX, VXLAN_IFNAME};

/// The nftables family of tether's table.
pub const NAT_TABLE_FAMILY: &str = "inet";
/// The name of tether's table (`nft list table inet tether`).
pub const NAT_TABLE: &str = "tether";

/// The packet mark of a packet tether leaves untranslated: one a migrated
/// VM sends in the middle of a connection whose translation, if any, is
/// elsewhere (the handover's rules set it), and one sent again after a
/// migration (made untracked). Bit 31, in the half of the mark tether
/// owns (kube-proxy uses `0x4000` and `0x8000`).
pub const NO_TRANSLATION_MARK: u32 = 0x8000_0000;

/// Multicast ranges: never masqueraded (a multicast packet has no reply to
/// translate back; the reference ptp plugin leaves it alone too).
const MULTICAST: [&str; 2] = ["224.0.0.0/4", "ff00::/8"];

/// What outbound NAT must do on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatPlan {
    /// Pod ranges whose traffic is masqueraded, aggregated, IPv4 first.
    sources: Vec<IpNet>,
    /// Destinations never masqueraded to: the sources themselves, the
    /// other ranges asked for, and multicast; aggregated, IPv4 first.
    exempt: Vec<IpNet>,
}

impl NatPlan {
    /// Masquerade traffic from `sources` to everything outside `sources`,
    /// `exempt` and multicast. Host bits are dropped and overlapping or
    /// adjacent ranges merged, so the same ranges give the same plan
    /// whatever their order.
    pub fn new(sources: &[IpNet], exempt: &[IpNet]) -> NatPlan {
        let sources = normalize(sources.iter().copied());
        let multicast = MULTICAST.iter().filter_map(|m| m.parse::<IpNet>().ok());
        let exempt = normalize(
            sources
                .iter()
                .copied()
                .chain(exempt.iter().copied())
                .chain(multicast),
        );
        NatPlan { sources, exempt }
    }

    /// The masqueraded source ranges.
    pub fn sources(&self) -> &[IpNet] {
        &self.sources
    }

    /// The destinations never masqueraded to.
    pub fn exempt(&self) -> &[IpNet] {
        &self.exempt
    }

    /// The `nft -f -` script that makes tether's table exactly this plan,
    /// in one transaction: the table is created if missing (so that the
    /// delete cannot fail), deleted, and written anew. A family without
    /// sources gets no set and no rule.
    pub fn script(&self) -> String {
        let mut s = format!(
            "table {NAT_TABLE_FAMILY} {NAT_TABLE}\ndelete table {NAT_TABLE_FAMILY} {NAT_TABLE}\n"
        );
        s.push_str(&format!("table {NAT_TABLE_FAMILY} {NAT_TABLE} {{\n"));
        let mut rules = Vec::new();
        for (v4, family, addr_type) in [(true, "ip", "ipv4_addr"), (false, "ip6", "ipv6_addr")] {
            let of_family = |nets: &[IpNet]| -> Vec<String> {
                nets.iter()
                    .filter(|n| matches!(n, IpNet::V4(_)) == v4)
                    .map(IpNet::to_string)
                    .collect()
            };
            let sources = of_family(&self.sources);
            if sources.is_empty() {
                continue;
            }
            let suffix = if v4 { "v4" } else { "v6" };
            for (name, elements) in [
                (format!("nat_sources_{suffix}"), sources),
                (format!("no_nat_{suffix}"), of_family(&self.exempt)),
            ] {
                s.push_str(&format!(
                    "  set {name} {{\n    type {addr_type}\n    flags interval\n    elements = {{ {} }}\n  }}\n",
                    elements.join(", ")
                ));
            }
            rules.push(format!(
                "    {family} saddr @nat_sources_{suffix} {family} daddr != @no_nat_{suffix} masquerade\n"
            ));
        }
        s.push_str("  chain postrouting {\n    type nat hook postrouting priority srcnat; policy accept;\n");
        // Pod to pod, on this node or through the overlay, keeps its
        // source: the exempt ranges already say so for the pod ranges,
        // and these also cover addresses of no range (a VM's, routed in).
        s.push_str(&format!("    oifname \"{HOST_IFNAME_PREFIX}*\" return\n"));
        s.push_str(&format!("    oifname \"{VXLAN_IFNAME}\" return\n"));
        // A migrated VM's packet in the middle of a connection: its
        // translation, if it has one, is on another node.
        s.push_str(&format!(
            "    meta mark & {NO_TRANSLATION_MARK:#x} == {NO_TRANSLATION_MARK:#x} return\n"
        ));
        for rule in rules {
            s.push_str(&rule);
        }
        s.push_str("  }\n}\n");
        s
    }

    /// The `nft -f -` script that removes tether's table, whether or not
    /// it exists.
    pub fn removal_script() -> String {
        format!(
            "table {NAT_TABLE_FAMILY} {NAT_TABLE}\ndelete table {NAT_TABLE_FAMILY} {NAT_TABLE}\n"
        )
    }
}

/// Truncated, merged, IPv4 before IPv6.
fn normalize(nets: impl Iterator<Item = IpNet>) -> Vec<IpNet> {
    let nets: Vec<IpNet> = nets.map(|n| n.trunc()).collect();
    let mut merged = IpNet::aggregate(&nets);
    merged.sort_by_key(|n| (matches!(n, IpNet::V6(_)), *n));
    merged
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nets(list: &[&str]) -> Vec<IpNet> {
        list.iter().map(|n| n.parse().unwrap()).collect()
    }

    #[test]
    fn the_pod_ranges_and_multicast_are_always_exempt_and_overlaps_merge() {
        let plan = NatPlan::new(
            &nets(&["fd00:10::/64", "10.244.1.7/24"]),
            &nets(&["10.96.0.0/12", "10.244.0.0/16", "fd00:10::/64"]),
        );
        assert_eq!(plan.sources(), nets(&["10.244.1.0/24", "fd00:10::/64"]));
        assert_eq!(
            plan.exempt(),
            nets(&[
                "10.96.0.0/12",
                "10.244.0.0/16",
                "224.0.0.0/4",
                "fd00:10::/64",
                "ff00::/8"
            ])
        );
    }

    #[test]
    fn the_same_ranges_in_another_order_give_the_same_script() {
        let a = NatPlan::new(
            &nets(&["10.1.0.0/24", "fd00::/64"]),
            &nets(&["10.96.0.0/12"]),
        );
        let b = NatPlan::new(
            &nets(&["fd00::/64", "10.1.0.0/24"]),
            &nets(&["10.96.0.0/12", "10.1.0.0/24"]),
        );
        assert_eq!(a.script(), b.script());
    }

    #[test]
    fn the_script_replaces_the_whole_table_in_one_transaction() {
        let script = NatPlan::new(&nets(&["10.1.0.0/24", "fd00::/64"]), &[]).script();
        let lines: Vec<&str> = script.lines().collect();
        assert_eq!(lines[0], "table inet tether");
        assert_eq!(lines[1], "delete table inet tether");
        assert_eq!(lines[2], "table inet tether {");
        assert!(script.contains("elements = { 10.1.0.0/24 }"), "{script}");
        assert!(
            script.contains("elements = { 10.1.0.0/24, 224.0.0.0/4 }"),
            "{script}"
        );
        assert!(
            script.contains("elements = { fd00::/64, ff00::/8 }"),
            "{script}"
        );
        assert!(script.contains("ip saddr @nat_sources_v4 ip daddr != @no_nat_v4 masquerade"));
        assert!(script.contains("ip6 saddr @nat_sources_v6 ip6 daddr != @no_nat_v6 masquerade"));
        // The pod veths, the overlay and what is marked untranslated come
        // before any masquerade.
        let ret = script.find("oifname \"tth*\" return").unwrap();
        let vxlan = script.find("oifname \"tether.vxlan\" return").unwrap();
        let marked = script
            .find("meta mark & 0x80000000 == 0x80000000 return")
            .unwrap();
        let masq = script.find("masquerade").unwrap();
        assert!(ret < masq && vxlan < masq && marked < masq, "{script}");
    }

    #[test]
    fn a_family_without_pod_ranges_gets_no_set_and_no_rule() {
        let script = NatPlan::new(&nets(&["10.1.0.0/24"]), &nets(&["fd00:96::/112"])).script();
        assert!(!script.contains("ip6"), "{script}");
        assert!(!script.contains("_v6"), "{script}");
        assert!(script.contains("ip saddr @nat_sources_v4"), "{script}");
    }

    #[test]
    fn the_removal_cannot_fail_on_a_missing_table() {
        assert_eq!(
            NatPlan::removal_script(),
            "table inet tether\ndelete table inet tether\n"
        );
    }

    /// `nft list table inet tether` in the calling thread's netns: None
    /// when there is no such table.
    fn list_table() -> Option<String> {
        let out = std::process::Command::new("nft")
            .args(["list", "table", NAT_TABLE_FAMILY, NAT_TABLE])
            .output()
            .expect("spawning nft");
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    #[cfg_attr(
        not(feature = "root-tests"),
        ignore = "needs root and nft: `make test` runs it"
    )]
    #[test]
    fn the_real_table_is_written_once_put_back_and_removed_in_a_throwaway_netns() {
        use crate::{Host, LinuxHost};
        use std::os::unix::fs::MetadataExt;
        assert!(
            nix::unistd::Uid::effective().is_root(),
            "this test needs root: it creates a network namespace. Run `make test`."
        );
        let inode = |p: &str| std::fs::metadata(p).expect(p).ino();
        std::thread::spawn(move || {
            let root = inode("/proc/thread-self/ns/net");
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare");
            // nft runs as a child of this thread, so in its netns: never
            // in the machine's.
            assert_ne!(inode("/proc/thread-self/ns/net"), root);
            let host = LinuxHost::new(std::sync::Arc::new(crate::fake::FakeDhcp::default()));
            let plan = NatPlan::new(
                &nets(&["10.1.0.0/24", "fd00:1::/64"]),
                &nets(&["10.96.0.0/12"]),
            );
            host.ensure_outbound_nat(&plan).expect("first apply");
            let first = list_table().expect("the table exists");
            assert!(first.contains("masquerade"), "{first}");
            assert!(first.contains("10.96.0.0/12"), "{first}");
            host.ensure_outbound_nat(&plan).expect("second apply");
            assert_eq!(
                list_table().as_deref(),
                Some(first.as_str()),
                "applied twice"
            );

            // A rule someone added is gone after the next apply.
            let out = std::process::Command::new("nft")
                .args([
                    "add",
                    "rule",
                    "inet",
                    "tether",
                    "postrouting",
                    "counter",
                    "accept",
                ])
                .output()
                .expect("nft add rule");
            assert!(out.status.success(), "{out:?}");
            assert_ne!(list_table().as_deref(), Some(first.as_str()));
            host.ensure_outbound_nat(&plan).expect("third apply");
            assert_eq!(list_table().as_deref(), Some(first.as_str()), "put back");

            host.remove_outbound_nat().expect("removal");
            assert_eq!(list_table(), None);
            host.remove_outbound_nat().expect("removal of no table");
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p));
    }
}
