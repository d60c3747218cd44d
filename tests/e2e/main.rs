//! tether's end-to-end tests: one binary, a module per area. Every test
//! has a tier (fast, root, tools, cluster, kubelet): a test above fast is
//! ignored, with its tier and what it needs as the reason, unless the
//! tier's feature of this crate is on; `make test` turns them all on
//! (docs/CONTRIBUTING.md, "Build, demo, test"). One area or one test:
//! `cargo test -p tether-e2e --features tether-e2e/root-tests --test e2e
//! verbs::`.

mod cluster;
mod conformance;
mod harness;
mod house;
mod install;
mod ipam;
mod kernel;
mod kube;
mod migration;
mod routing;
mod verbs;
mod vm;
