//! The real [`Host`]: sysctls under /proc/sys, the boot id, the packet
//! sockets of [`super::packet`], and outbound NAT, the migration handover
//! and NetworkPolicy through the system's `nft` command.

use super::netlink::write_sysctl;
use super::packet::AnnounceListener;
use super::{Announcements, GuestDhcp, Host, NatPlan};
use crate::error::{KernelError, Result};
use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::Arc;

/// The nftables command (Debian package `nftables`): looked up on `PATH`,
/// then where Debian installs it, for a daemon started with a `PATH`
/// without the sbin directories.
const NFT: [&str; 3] = ["nft", "/usr/sbin/nft", "/sbin/nft"];

/// The node this daemon runs on, in the daemon's own netns, with the
/// guest DHCP service the daemon runs there (a layer above this one, so
/// it is handed in).
#[derive(Clone)]
pub struct LinuxHost {
    dhcp: Arc<dyn GuestDhcp>,
}

impl LinuxHost {
    /// The node, serving its guests with `dhcp`.
    pub fn new(dhcp: Arc<dyn GuestDhcp>) -> LinuxHost {
        LinuxHost { dhcp }
    }
}

/// Turns on IPv4 and IPv6 forwarding in the current netns (IPv6 only
/// where the kernel has it).
pub fn enable_forwarding() -> Result<()> {
    write_sysctl("net/ipv4/ip_forward", "1")
        .map_err(|e| KernelError::refused("enabling IPv4 forwarding", e))?;
    match write_sysctl("net/ipv6/conf/all/forwarding", "1") {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            tracing::warn!("IPv6 is disabled on this node: IPv6 pod addresses will not be routed");
            Ok(())
        }
        Err(e) => Err(KernelError::refused("enabling IPv6 forwarding", e)),
    }
}

impl Host for LinuxHost {
    fn enable_forwarding(&self) -> Result<()> {
        enable_forwarding()
    }

    fn boot_id(&self) -> Result<String> {
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_owned())
            .map_err(|e| KernelError::Io(format!("reading the boot id: {e}")))
    }

    fn announcements(&self) -> Result<Box<dyn Announcements>> {
        Ok(Box::new(AnnounceListener::open()?))
    }

    fn guest_dhcp(&self) -> Arc<dyn GuestDhcp> {
        self.dhcp.clone()
    }

    fn ensure_outbound_nat(&self, plan: &NatPlan) -> Result<()> {
        run_nft(
            &plan.script(),
            "programming outbound NAT (nft table inet tether)",
        )
    }

    fn remove_outbound_nat(&self) -> Result<()> {
        run_nft(
            &NatPlan::removal_script(),
            "removing outbound NAT (nft table inet tether)",
        )
    }

    fn ensure_handover_table(&self) -> Result<()> {
        run_nft(
            &super::handover::handover_script(),
            "programming the migration handover (nft table inet tether_vm)",
        )
    }

    fn ensure_policy(&self, plan: &super::policy::PolicyPlan) -> Result<()> {
        run_nft(
            &plan.script(),
            "programming NetworkPolicy (nft table inet tether_policy)",
        )
    }

    fn remove_policy(&self) -> Result<()> {
        run_nft(
            &super::policy::PolicyPlan::removal_script(),
            "removing NetworkPolicy (nft table inet tether_policy)",
        )
    }

    fn policy_counters(&self) -> Result<Vec<(String, u64, u64)>> {
        let doing = "reading the NetworkPolicy counters (nft table inet tether_policy)";
        let mut out = Err(std::io::ErrorKind::NotFound.into());
        for nft in NFT {
            out = Command::new(nft)
                .args([
                    "list",
                    "counters",
                    "table",
                    super::policy::POLICY_TABLE_FAMILY,
                    super::policy::POLICY_TABLE,
                ])
                .stdin(Stdio::null())
                .output();
            if !matches!(&out, Err(e) if e.kind() == std::io::ErrorKind::NotFound) {
                break;
            }
        }
        let out = out.map_err(|e| KernelError::refused(doing, e))?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            // No table: nothing counted.
            if stderr.contains("No such file or directory") {
                return Ok(Vec::new());
            }
            return Err(KernelError::refused(
                doing,
                format!("nft failed ({}): {}", out.status, stderr.trim()),
            ));
        }
        Ok(super::policy::parse_counters(&String::from_utf8_lossy(
            &out.stdout,
        )))
    }
}

/// Runs `nft -f -` with `script` on stdin, in the daemon's netns (a child
/// process starts in the netns of the thread that spawns it, and tetherd's
/// own threads never leave the node's). nft applies a file as one
/// transaction: all of it or nothing.
fn run_nft(script: &str, doing: &str) -> Result<()> {
    let mut spawned = Err(std::io::ErrorKind::NotFound.into());
    for nft in NFT {
        spawned = Command::new(nft)
            .args(["-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn();
        if !matches!(&spawned, Err(e) if e.kind() == std::io::ErrorKind::NotFound) {
            break;
        }
    }
    let mut child = spawned.map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => KernelError::refused(
            doing,
            "no nft command, on PATH or in /usr/sbin (Debian package nftables); \
             install it, or turn outbound NAT off with --outbound-nat=false",
        ),
        _ => KernelError::refused(doing, e),
    })?;
    // Written whole and closed before the wait, so nft sees end of file.
    let written = match child.stdin.take() {
        Some(mut stdin) => stdin.write_all(script.as_bytes()),
        None => Ok(()),
    };
    let out = child
        .wait_with_output()
        .map_err(|e| KernelError::refused(doing, e))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        return Err(KernelError::refused(
            doing,
            format!("nft -f - failed ({}): {}", out.status, stderr.trim()),
        ));
    }
    written.map_err(|e| KernelError::refused(doing, e))
}
