//! Builds (or finds in the cache) the images Kubernetes' sig-network
//! Conformance tests run, and prints one line per image: its name, a tab,
//! and its OCI archive, for `ctr -n k8s.io images import`
//! (tether_e2e::conformance_images). Root only: the Debian roots are made
//! with mmdebstrap.
//!
//! Run: `cargo run -p tether-e2e --bin conformance_images` (`make
//! conformance-images`).

use tether_e2e::conformance_images::conformance_images;
use tether_e2e::require_root;

fn main() {
    require_root();
    for (name, archive) in conformance_images() {
        println!("{name}\t{}", archive.display());
    }
}
