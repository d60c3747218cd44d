//! Kubernetes NetworkPolicy, enforced on each node in its own nftables
//! table (see [`tether_kernel::policy`] for the table, [`model`] for what
//! the API's objects mean, and [`enforcer`] for when the table is
//! written).
//!
//! Done so far: the model, the enforcer (fed by the watches of
//! `crate::kube::policy_watch` and by ADD and teardown, an ADD returning
//! only once its pod's isolation is in the kernel), `--network-policy`.
//! Still to come (issue 39): the drop counters in `/metrics`, the admin
//! API's view, the VM cases (a migration's target, a launcher's identity)
//! and upstream's NetworkPolicy suite (`make netpol`).

pub mod enforcer;
pub mod model;
