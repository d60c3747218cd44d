//! Kubernetes' own sig-network Conformance tests: their images and the slice `make test` runs.

mod conformance_images;
mod conformance_slice;
