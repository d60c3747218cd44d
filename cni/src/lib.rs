//! The CNI wire format: pure logic, no I/O.
//!
//! A [`CniRequest`](tether_proto::cni::v1::CniRequest) from the shim goes
//! through [`parse_request`] into a typed [`Invocation`] (or the exact CNI
//! error); what the daemon wired comes back as [`Wired`] and leaves through
//! [`render_add_result`] in the cniVersion that was asked for. Raw JSON
//! stays in here: the rest of the daemon sees only typed values.
//!
//! - [`version`][]: verbs and spec versions, and which verb needs which.
//! - [`args`][]: `CNI_ARGS`.
//! - [`config`][]: the network configuration and prevResult.
//! - [`request`][]: the validation table and [`parse_request`].
//! - [`result`][]: ADD results, CHECK's prevResult test, error objects.

pub mod args;
pub mod config;
pub mod pod;
pub mod request;
pub mod result;
pub mod version;

pub use args::{CniArgs, RequestedMac};
pub use config::{
    AttachmentId, IpamConf, NetConf, PrevResult, RuntimeConfig, UnknownKey, VmAddressPolicy,
};
pub use pod::{pools, requested, vm_pod, Requested, VmPod, POOL_ANNOTATION};
pub use request::{parse_request, Invocation, MAX_STDIN};
pub use result::{
    check_ipam_prev_result, check_prev_result, empty_result, error_to_proto, error_version,
    parse_result, render_add_result, render_ipam_result, Leased, Wired,
};
pub use version::{CniVersion, Command, SUPPORTED_VERSIONS};
