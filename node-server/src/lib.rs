//! tetherd: tether's node daemon.
//!
//! One module per concern: `cni` (the CNI wire format and validation),
//! `ipam` (address pools), `mac` (the MAC type), `dataplane` (all
//! netlink), `store` (durable state), `node` (the attachment lifecycle that
//! ties them together),
//! `pending_del` (the shim's DEL queue), `service` and `admin` (the gRPC
//! faces), `server` (the socket), `authority` (lets clients that send a
//! socket path as HTTP/2 `:authority`, like grpcurl 1.8.6, be served).

pub mod admin;
pub mod authority;
pub mod cluster;
pub mod cni;
pub mod control;
pub mod dataplane;
pub mod error;
pub mod ipam;
pub mod mac;
pub mod node;
pub mod pending_del;
pub mod server;
pub mod service;
pub mod store;
pub mod vm;
