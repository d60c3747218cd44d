//! The real [`Host`]: sysctls under /proc/sys, the boot id, and the packet
//! sockets of [`super::packet`].

use super::netlink::write_sysctl;
use super::packet::AnnounceListener;
use super::{Announcements, GuestDhcp, Host};
use crate::dhcp::DhcpServer;
use crate::error::{Error, Result};
use std::sync::Arc;

/// The node this daemon runs on, in the daemon's own netns.
#[derive(Debug, Default, Clone, Copy)]
pub struct LinuxHost;

impl Host for LinuxHost {
    fn enable_forwarding(&self) -> Result<()> {
        write_sysctl("net/ipv4/ip_forward", "1")
            .map_err(|e| Error::setup("enabling IPv4 forwarding", e))?;
        match write_sysctl("net/ipv6/conf/all/forwarding", "1") {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                tracing::warn!(
                    "IPv6 is disabled on this node: IPv6 pod addresses will not be routed"
                );
                Ok(())
            }
            Err(e) => Err(Error::setup("enabling IPv6 forwarding", e)),
        }
    }

    fn boot_id(&self) -> Result<String> {
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_owned())
            .map_err(|e| Error::Io(format!("reading the boot id: {e}")))
    }

    fn announcements(&self) -> Result<Box<dyn Announcements>> {
        Ok(Box::new(AnnounceListener::open()?))
    }

    fn guest_dhcp(&self) -> Arc<dyn GuestDhcp> {
        Arc::new(DhcpServer::new())
    }
}
