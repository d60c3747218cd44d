//! The workspace's crates form layers, and a crate may depend only on
//! crates of a lower layer: a back-up import is a compile error, and this
//! test keeps the Cargo manifests from adding one. It reads the manifests
//! through `cargo metadata` (no build, no root, no network).
//!
//! The table is the one docs/ARCHITECTURE.md draws; a new crate must be
//! placed in it before it can be used.

use serde_json::Value;
use std::collections::BTreeMap;
use std::process::Command;

/// Each crate of the workspace and its layer, bottom first.
const LAYERS: &[(&str, u8)] = &[
    // Shared values and the gRPC contract.
    ("tether-base", 0),
    ("tether-proto", 0),
    // Pure logic: the CNI wire format, address pools; the plugin binary,
    // which knows only the contract.
    ("tether-cni", 1),
    ("tether-ipam", 1),
    ("tether-cni-shim", 1),
    // The kernel seam, durable state.
    ("tether-kernel", 2),
    ("tether-store", 2),
    // The daemon: features, the attachment lifecycle, the API, the binary.
    ("tether-node-server", 3),
    // The suites and benchmarks, which run everything.
    ("tether-e2e", 4),
];

/// (crate, [(dependency, kind)]) for every workspace member, dependencies
/// restricted to workspace members.
fn workspace_edges() -> BTreeMap<String, Vec<(String, String)>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: Value = serde_json::from_slice(&out.stdout).expect("cargo metadata's JSON");
    let packages = meta["packages"].as_array().expect("packages");
    let members: Vec<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    packages
        .iter()
        .map(|p| {
            let deps = p["dependencies"]
                .as_array()
                .expect("dependencies")
                .iter()
                .filter_map(|d| {
                    let name = d["name"].as_str()?;
                    let kind = d["kind"].as_str().unwrap_or("normal").to_owned();
                    members.contains(&name).then(|| (name.to_owned(), kind))
                })
                .collect();
            (p["name"].as_str().expect("a name").to_owned(), deps)
        })
        .collect()
}

fn layer(name: &str) -> Option<u8> {
    LAYERS.iter().find(|(n, _)| *n == name).map(|(_, l)| *l)
}

#[test]
fn every_crate_has_a_layer() {
    let edges = workspace_edges();
    let unplaced: Vec<&String> = edges.keys().filter(|c| layer(c).is_none()).collect();
    assert!(
        unplaced.is_empty(),
        "crates with no layer in tests/tests/layers.rs (and docs/ARCHITECTURE.md): {unplaced:?}"
    );
    let gone: Vec<&str> = LAYERS
        .iter()
        .map(|(n, _)| *n)
        .filter(|n| !edges.contains_key(*n))
        .collect();
    assert!(
        gone.is_empty(),
        "layers of crates that no longer exist: {gone:?}"
    );
}

/// The edges of `edges` that go to the crate's own layer or above. A test
/// of a crate may use a crate above it (the shim's tests run a fake daemon
/// on the gRPC server stubs): dev-dependencies are not shipped.
fn violations(edges: &BTreeMap<String, Vec<(String, String)>>) -> Vec<String> {
    let mut wrong = Vec::new();
    for (krate, deps) in edges {
        let Some(mine) = layer(krate) else { continue };
        for (dep, kind) in deps {
            let Some(theirs) = layer(dep) else { continue };
            if theirs >= mine && kind != "dev" {
                wrong.push(format!(
                    "{krate} (layer {mine}) depends on {dep} (layer {theirs}) [{kind}]"
                ));
            }
        }
    }
    wrong
}

#[test]
fn no_crate_depends_on_its_own_layer_or_one_above() {
    let edges = workspace_edges();
    // The table describes a real graph: the daemon alone depends on six
    // crates of ours.
    let seen: usize = edges.values().map(Vec::len).sum();
    assert!(seen >= 10, "only {seen} edges between workspace crates");
    let wrong = violations(&edges);
    assert!(
        wrong.is_empty(),
        "edges that go up a layer:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn an_edge_up_or_sideways_is_caught_and_a_test_only_edge_is_not() {
    let mut edges = workspace_edges();
    let edge = |dep: &str, kind: &str| (dep.to_owned(), kind.to_owned());
    edges
        .get_mut("tether-kernel")
        .expect("tether-kernel")
        .push(edge("tether-node-server", "normal"));
    edges
        .get_mut("tether-cni")
        .expect("tether-cni")
        .push(edge("tether-ipam", "build"));
    edges
        .get_mut("tether-base")
        .expect("tether-base")
        .push(edge("tether-store", "dev"));
    assert_eq!(
        violations(&edges),
        vec![
            "tether-cni (layer 1) depends on tether-ipam (layer 1) [build]".to_owned(),
            "tether-kernel (layer 2) depends on tether-node-server (layer 3) [normal]".to_owned(),
        ]
    );
}
