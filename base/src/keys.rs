//! The keys that name what tether keeps: an attachment (the CNI spec's
//! network, container and interface), a VM interface's address record,
//! and a pod's reference to its IPAMClaim.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Identifies one attachment: the CNI spec's (network, container, ifname).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct AttachmentKey {
    /// The CNI network name (the netconf's "name").
    pub network: String,
    /// CNI_CONTAINERID.
    pub container_id: String,
    /// CNI_IFNAME.
    pub ifname: String,
}

impl fmt::Display for AttachmentKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.network, self.container_id, self.ifname)
    }
}

/// The longest namespace, VM or interface name accepted in a key.
const MAX_NAME: usize = 253;

/// The interface part of a key that an IPAMClaim holds ([`VmKey::claim`]).
/// No network interface can have this name: the kernel refuses ':'.
pub const CLAIM_INTERFACE: &str = ":ipamclaim";

/// Identifies one VM interface across its pods: (namespace, VM, interface).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct VmKey {
    /// The pod namespace (K8S_POD_NAMESPACE).
    pub namespace: String,
    /// The VM's name, from the `kubevirt.io/domain` annotation.
    pub vm: String,
    /// The pod interface (CNI_IFNAME), e.g. "eth0".
    pub interface: String,
}

impl VmKey {
    /// A checked key: each part non-empty, without '/', at most 253 bytes.
    pub fn new(namespace: &str, vm: &str, interface: &str) -> Result<VmKey> {
        for (what, v) in [
            ("namespace", namespace),
            ("VM name", vm),
            ("interface", interface),
        ] {
            if v.is_empty() || v.len() > MAX_NAME || v.contains('/') || v.contains('\0') {
                return Err(Error::InvalidConfig(format!(
                    "{what} {v:?} cannot name a VM: it must be 1 to {MAX_NAME} bytes without '/'"
                )));
            }
        }
        Ok(VmKey {
            namespace: namespace.to_owned(),
            vm: vm.to_owned(),
            interface: interface.to_owned(),
        })
    }
}

impl VmKey {
    /// The key of the addresses an IPAMClaim holds: (namespace, claim
    /// name, [`CLAIM_INTERFACE`]). A VM pod whose network-selection
    /// element references a claim is keyed by it, not by its VM and
    /// interface.
    pub fn claim(namespace: &str, claim: &str) -> Result<VmKey> {
        let mut key = VmKey::new(namespace, claim, "claim")?;
        key.interface = CLAIM_INTERFACE.to_owned();
        Ok(key)
    }

    /// The claim's name, for a key an IPAMClaim holds.
    pub fn claim_name(&self) -> Option<&str> {
        (self.interface == CLAIM_INTERFACE).then_some(self.vm.as_str())
    }
}

impl fmt::Display for VmKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.namespace, self.vm, self.interface)
    }
}

/// A pod's reference to its claim (the claim lives in the pod's namespace).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClaimRef {
    /// The namespace.
    pub namespace: String,
    /// The claim's name.
    pub name: String,
}

impl ClaimRef {
    /// The key of the VM record the claim holds.
    pub fn key(&self) -> Result<VmKey> {
        VmKey::claim(&self.namespace, &self.name)
    }
}

impl std::fmt::Display for ClaimRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}
