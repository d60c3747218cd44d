//! Kubernetes' own sig-network tests: the Conformance tests' images, and
//! the slices of the Conformance and the NetworkPolicy tests that `make
//! test` runs.

mod conformance_images;
mod conformance_slice;
mod netpol_slice;
