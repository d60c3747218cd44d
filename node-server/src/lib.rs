//! tetherd: tether's node daemon.
//!
//! One module per concern: `cni` (the CNI wire format), `ipam` (address
//! pools), `dataplane` (netlink), `store` (durable state), `node` (the
//! attachment lifecycle that ties them together), `service` and `admin`
//! (the gRPC faces), `server` (the socket).

pub mod error;
