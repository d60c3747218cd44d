//! tetherd: tether's node daemon, the top layer of the workspace.
//!
//! The layers below are crates of their own, used here by their names:
//! `tether_base` (errors, MACs, time), `tether_cni` (the CNI wire format),
//! `tether_ipam` (address pools), `tether_kernel` (the kernel seam: traits,
//! netlink, a fake) and `tether_store` (durable state: the node's journal
//! and the control store).
//!
//! This crate holds what decides and changes state: `attach` (the
//! attachment lifecycle that ties them together), `vm` (KubeVirt VM
//! records and pods), `routing` (route planning and the route manager),
//! `cluster` (membership and blocks), `pools` (named pools), `dhcp` (DHCP
//! and router advertisements for the guests of tap bindings), `instance`
//! (one daemon per state dir, socket and network namespace), `kube` (the
//! optional Kubernetes API: the migration-target watch, IPAMClaims, the
//! node's pod CIDRs, events), `nat` (outbound NAT), `policy`
//! (NetworkPolicy: what the API's objects ask of this node), `metrics`, `api`
//! (everything that faces a caller: the CNI and admin gRPC services, the
//! socket, and the shim's pending-DEL queue), and `daemon` (the whole
//! daemon, built from its command line).

pub mod api;
pub mod attach;
pub mod cluster;
pub mod daemon;
pub mod dhcp;
#[cfg(test)]
pub(crate) mod faulty_control;
pub mod handover;
pub mod instance;
pub mod kube;
pub mod metrics;
pub mod nat;
pub mod policy;
pub mod pools;
pub mod routing;
pub mod vm;
