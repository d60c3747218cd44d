//! What faces a caller of tetherd: the gRPC services on the unix socket, the
//! socket itself, and the shim's on-disk queue of DELs it could not hand
//! over (a second way in, authorised like the socket).

pub mod admin;
pub mod cni;
pub mod pending_del;
pub mod scrape;
pub mod server;
