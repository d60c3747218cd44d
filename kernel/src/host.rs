//! The real [`Host`]: sysctls under /proc/sys, the boot id, and the packet
//! sockets of [`super::packet`].

use super::netlink::write_sysctl;
use super::packet::AnnounceListener;
use super::{Announcements, GuestDhcp, Host};
use crate::error::{KernelError, Result};
use std::sync::Arc;

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
}
