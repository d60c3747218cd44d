//! Kubernetes NetworkPolicy, enforced on each node in its own nftables
//! table (see [`tether_kernel::policy`] for the table, and
//! [`model`] for what the API's objects mean).
//!
//! This is its first part: the model, pure and tested on objects written
//! as the API serves them. The watches that feed it, the writing of the
//! table on every change and before an ADD returns, and the VM cases
//! (a migration's target, a launcher's identity) are still to come
//! (issue 39).

pub mod model;
