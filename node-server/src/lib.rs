//! tetherd: tether's node daemon, the top layer of the workspace.
//!
//! The layers below are crates of their own, kept here under the module
//! names the daemon has always used: `error`, `mac`, `time` (tether-base),
//! `cni` (the CNI wire format), `ipam` (address pools), `kernel` (the
//! kernel seam: traits, netlink, a fake), `store` and `control` (durable
//! state). This crate holds what decides and changes state: `attach` (the
//! attachment lifecycle that ties them together), `vm` (KubeVirt VM
//! records and pods), `routing` (route planning and the route manager),
//! `cluster` (membership and blocks), `pools` (named pools), `dhcp` (DHCP
//! and router advertisements for the guests of tap bindings), `instance`
//! (one daemon per state dir, socket and network namespace), `kube` (the
//! optional Kubernetes API: the migration-target watch, IPAMClaims, the
//! node's pod CIDRs, events), `nat` (outbound NAT), `metrics`, and `api`,
//! everything that faces
//! a caller: the CNI and admin gRPC services, the socket, and the shim's
//! pending-DEL queue.

pub mod api;
pub mod attach;
pub mod cluster;
pub mod dhcp;
#[cfg(test)]
pub(crate) mod faulty_control;
pub mod handover;
pub mod instance;
pub mod kube;
pub mod metrics;
pub mod nat;
pub mod pools;
pub mod routing;
pub mod vm;

// The layers below, under the names the daemon's modules have always
// used for them.
pub use tether_base::{error, mac, time};
pub use tether_cni as cni;
pub use tether_ipam as ipam;
pub use tether_kernel as kernel;
pub use tether_store::{control, store};
