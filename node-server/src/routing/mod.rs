//! This node's routes to VM addresses and other nodes' blocks: planned from
//! the control plane's views, applied to the kernel by one manager.

pub mod manager;
pub mod plan;
