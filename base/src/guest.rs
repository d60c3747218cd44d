//! How a KubeVirt guest reaches the network when tether, not KubeVirt,
//! connects it: the `tap` binding (tether creates the tap QEMU opens) and
//! `managedTap` (KubeVirt builds the tap on tether's veth). In both, the
//! guest's own frames reach the node-side veth and tether answers its DHCP
//! there.
//!
//! The netconf's `kubevirt` object chooses the binding for a network; the
//! pod annotation [`BINDING_ANNOTATION`] overrides it for one pod, and
//! [`QUEUES_ANNOTATION`] the tap's queue count.

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Pod annotation that selects the binding of one pod's VM interfaces:
/// `tap`, `managedTap` or `veth`.
pub const BINDING_ANNOTATION: &str = "tether.dev/binding";
/// Pod annotation with the tap's queue count (1 to [`MAX_QUEUES`]).
pub const QUEUES_ANNOTATION: &str = "tether.dev/tap-queues";
/// The uid and gid QEMU runs as in KubeVirt's virt-launcher pod.
pub const QEMU_ID: u32 = 107;
/// The kernel's limit on a tap's queues (`MAX_TAP_QUEUES`).
pub const MAX_QUEUES: u16 = 256;
/// The default DHCP lease: long enough that a renewal is rare, short
/// enough that a changed DNS setting reaches guests within the hour.
pub const DEFAULT_LEASE_SECONDS: u32 = 3600;

/// How tether connects a VM pod's interface.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BindingKind {
    /// An ordinary pod veth; KubeVirt's own `bridge` or `masquerade`
    /// binding does the rest (and serves DHCP itself).
    #[default]
    Veth,
    /// KubeVirt's `tap` domain attachment: tether creates the tap in the
    /// pod and serves DHCP.
    Tap,
    /// KubeVirt's `managedTap`: tether creates the veth, KubeVirt the tap
    /// and an in-pod bridge; tether serves DHCP.
    ManagedTap,
}

impl BindingKind {
    /// Parses the netconf's or the annotation's value.
    pub fn parse(s: &str) -> Option<BindingKind> {
        match s {
            "veth" => Some(BindingKind::Veth),
            "tap" => Some(BindingKind::Tap),
            "managedTap" => Some(BindingKind::ManagedTap),
            _ => None,
        }
    }
}

/// The netconf's `kubevirt` object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubevirtConf {
    /// `binding`: `veth` (default), `tap` or `managedTap`.
    pub binding: BindingKind,
    /// `tapQueues`: more than 1 makes a multi-queue tap.
    pub tap_queues: u16,
    /// `tapOwner`: the uid that may open the tap (QEMU's).
    pub tap_owner: u32,
    /// `tapGroup`: the gid that may open the tap.
    pub tap_group: u32,
    /// `leaseSeconds`: the DHCP lease time.
    pub lease_seconds: u32,
}

impl Default for KubevirtConf {
    fn default() -> Self {
        KubevirtConf {
            binding: BindingKind::Veth,
            tap_queues: 1,
            tap_owner: QEMU_ID,
            tap_group: QEMU_ID,
            lease_seconds: DEFAULT_LEASE_SECONDS,
        }
    }
}

/// The tap tether creates in a pod for the `tap` binding.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TapSpec {
    /// `tap0`, `tap<hash>` or `tap<N>`, from the pod interface's name.
    pub name: String,
    /// 1: a single-queue tap; more: `IFF_MULTI_QUEUE`, for QEMU to open
    /// this many queues.
    pub queues: u16,
    /// The uid that may open it.
    pub owner: u32,
    /// The gid that may open it.
    pub group: u32,
}

impl TapSpec {
    /// Whether the tap is created multi-queue.
    pub fn multi_queue(&self) -> bool {
        self.queues > 1
    }
}

/// What tether's DHCP and RA answers carry beyond the VM's addresses.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DhcpOptions {
    /// The lease time.
    pub lease_seconds: u32,
    /// DNS servers (the netconf's `dns.nameservers`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dns: Vec<IpAddr>,
    /// Search domains (`dns.search`, else `dns.domain`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub search: Vec<String>,
    /// The guest's hostname (option 12): the VM's name
    /// (`kubevirt.io/domain`). Unset in records of older versions, whose
    /// VM key names the VM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
}

/// A VM pod interface that tether connects to its guest: recorded with the
/// attachment, so that DEL, CHECK, GC and a restarted daemon know it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestNet {
    /// The tap of the `tap` binding; `None` for `managedTap`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tap: Option<TapSpec>,
    /// The DHCP answers' options.
    pub dhcp: DhcpOptions,
}

impl GuestNet {
    /// The binding this describes.
    pub fn kind(&self) -> BindingKind {
        match self.tap {
            Some(_) => BindingKind::Tap,
            None => BindingKind::ManagedTap,
        }
    }
}

/// The tap name KubeVirt points the domain at for pod interface `ifname`:
/// `tap0` for `eth0`, else `tap` + the name without its `pod` (hashed
/// names) or `net` (ordinal names) prefix.
pub fn tap_name(ifname: &str) -> Result<String> {
    let name = if ifname == "eth0" {
        "tap0".to_owned()
    } else if let Some(rest) = ifname
        .strip_prefix("pod")
        .or_else(|| ifname.strip_prefix("net"))
        .filter(|r| !r.is_empty())
    {
        format!("tap{rest}")
    } else {
        return Err(Error::InvalidConfig(format!(
            "CNI_IFNAME {ifname:?} has no KubeVirt tap name: the tap binding needs eth0, \
             pod<hash> or net<N>"
        )));
    };
    // The kernel's IFNAMSIZ less the NUL.
    if name.len() > 15 {
        return Err(Error::InvalidConfig(format!(
            "tap name {name:?} for CNI_IFNAME {ifname:?} is longer than 15 bytes"
        )));
    }
    Ok(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tap_names_follow_kubevirt() {
        assert_eq!(tap_name("eth0").unwrap(), "tap0");
        assert_eq!(tap_name("pod16477688c0e").unwrap(), "tap16477688c0e");
        assert_eq!(tap_name("net1").unwrap(), "tap1");
        for bad in ["eth1", "pod", "net", "veth0", "pod0123456789abcd"] {
            assert!(tap_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bindings_parse_only_their_names() {
        assert_eq!(BindingKind::parse("tap"), Some(BindingKind::Tap));
        assert_eq!(
            BindingKind::parse("managedTap"),
            Some(BindingKind::ManagedTap)
        );
        assert_eq!(BindingKind::parse("veth"), Some(BindingKind::Veth));
        assert_eq!(BindingKind::parse("Tap"), None);
        assert_eq!(BindingKind::parse(""), None);
    }
}
