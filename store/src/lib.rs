//! Durable state: the attachments this node has wired (`store`, a local
//! snapshot and journal) and the control store that nodes share
//! (`control`: the embedded single-node back-end or an etcd cluster). Each
//! back-end's typed failures map to the daemon's error here, beside them.

pub mod control;
pub mod store;

#[cfg(test)]
mod error_codes;
