//! The workspace's crates form layers, and a crate may depend only on
//! crates of a lower layer: a back-up import is a compile error, and this
//! test keeps the Cargo manifests from adding one. It reads the manifests
//! through `cargo metadata` (no build, no root, no network).
//!
//! The table is the one docs/ARCHITECTURE.md draws; a new crate must be
//! placed in it before it can be used.
//!
//! Inside a crate, the top-level modules must not import each other in a
//! cycle either, nor the modules of one folder (through their `super::`
//! paths).

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
    // The harness and the suites, which run everything.
    ("tether-e2e", 4),
    // The benchmarks, on the harness.
    ("tether-bench", 5),
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
        "crates with no layer in tests/e2e/house/layers.rs (and docs/ARCHITECTURE.md): {unplaced:?}"
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

/// The crate directories whose modules are checked.
const CRATE_DIRS: &[&str] = &[
    "base",
    "cni",
    "ipam",
    "kernel",
    "store",
    "node-server",
    "cni-shim",
    "proto",
];

/// Every `.rs` file under `dir`.
fn rust_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The imports between the top-level modules of the crate in `src`, read
/// from its `crate::<module>` paths (comments left out, test code in).
fn module_edges(src: &std::path::Path) -> BTreeMap<String, std::collections::BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let top = |path: &std::path::Path| -> Option<String> {
        let rel = path.strip_prefix(src).ok()?;
        let first = rel.components().next()?.as_os_str().to_str()?;
        let name = first.strip_suffix(".rs").unwrap_or(first);
        (name != "lib" && name != "main").then(|| name.to_owned())
    };
    let modules: std::collections::BTreeSet<String> = files.iter().filter_map(|f| top(f)).collect();
    let mut edges: BTreeMap<String, std::collections::BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let Some(from) = top(file) else { continue };
        let text = std::fs::read_to_string(file).expect("a source file");
        for line in text.lines().filter(|l| !l.trim_start().starts_with("//")) {
            for (i, _) in line.match_indices("crate::") {
                let rest = &line[i + "crate::".len()..];
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                // `tether_base::x` and the like are other crates.
                let other_crate = line[..i].ends_with('_')
                    || line[..i].ends_with(|c: char| c.is_ascii_alphanumeric());
                if !other_crate && name != from && modules.contains(&name) {
                    edges.entry(from.clone()).or_default().insert(name);
                }
            }
        }
    }
    edges
}

/// The strongly connected components with more than one module.
fn cycles(edges: &BTreeMap<String, std::collections::BTreeSet<String>>) -> Vec<Vec<String>> {
    let nodes: Vec<&String> = edges.keys().chain(edges.values().flatten()).collect();
    let reaches = |a: &String, b: &String| -> bool {
        let mut seen = std::collections::BTreeSet::new();
        let mut todo = vec![a];
        while let Some(n) = todo.pop() {
            if n == b {
                return true;
            }
            if seen.insert(n) {
                todo.extend(edges.get(n).into_iter().flatten());
            }
        }
        false
    };
    let mut out: Vec<Vec<String>> = Vec::new();
    for n in &nodes {
        if out.iter().any(|c| c.contains(n)) {
            continue;
        }
        let mut component: Vec<String> = nodes
            .iter()
            .filter(|m| reaches(n, m) && reaches(m, n))
            .map(|m| (*m).clone())
            .collect();
        component.sort();
        component.dedup();
        if component.len() > 1 {
            out.push(component);
        }
    }
    out
}

#[test]
fn no_cycle_between_the_modules_of_a_crate() {
    let root = tether_e2e::workspace_dir();
    let mut report = Vec::new();
    for dir in CRATE_DIRS {
        let edges = module_edges(&root.join(dir).join("src"));
        for cycle in cycles(&edges) {
            report.push(format!("{dir}: {}", cycle.join(" -> ")));
        }
    }
    assert!(
        report.is_empty(),
        "cycles between modules:\n{}",
        report.join("\n")
    );
}

#[test]
fn a_cycle_between_modules_is_found() {
    let mut edges: BTreeMap<String, std::collections::BTreeSet<String>> = BTreeMap::new();
    for (a, b) in [
        ("api", "attach"),
        ("attach", "vm"),
        ("vm", "attach"),
        ("vm", "kernel"),
    ] {
        edges.entry(a.into()).or_default().insert(b.into());
    }
    assert_eq!(
        cycles(&edges),
        vec![vec!["attach".to_owned(), "vm".to_owned()]]
    );
}

/// The imports between the modules of one folder (`dir/*.rs`, each file a
/// module, `mod.rs` left out: it is their parent), read from their
/// `super::<sibling>` paths (comments left out).
fn sibling_edges(dir: &std::path::Path) -> BTreeMap<String, std::collections::BTreeSet<String>> {
    let mut edges: BTreeMap<String, std::collections::BTreeSet<String>> = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return edges;
    };
    let files: Vec<(String, std::path::PathBuf)> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|p| {
            let name = p.file_stem()?.to_str()?.to_owned();
            (p.extension()? == "rs" && name != "mod" && name != "tests").then_some((name, p))
        })
        .collect();
    let names: std::collections::BTreeSet<&String> = files.iter().map(|(n, _)| n).collect();
    for (from, path) in &files {
        let text = std::fs::read_to_string(path).expect("a source file");
        for line in text.lines().filter(|l| !l.trim_start().starts_with("//")) {
            for (i, _) in line.match_indices("super::") {
                let name: String = line[i + "super::".len()..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if name != *from && names.contains(&name) {
                    edges.entry(from.clone()).or_default().insert(name);
                }
            }
        }
    }
    edges
}

#[test]
fn no_cycle_between_the_modules_of_a_folder() {
    let root = tether_e2e::workspace_dir();
    let mut report = Vec::new();
    for dir in CRATE_DIRS {
        let mut folders = vec![root.join(dir).join("src")];
        while let Some(folder) = folders.pop() {
            for e in std::fs::read_dir(&folder)
                .expect("a source folder")
                .flatten()
            {
                if e.path().is_dir() {
                    folders.push(e.path());
                }
            }
            for cycle in cycles(&sibling_edges(&folder)) {
                report.push(format!("{}: {}", folder.display(), cycle.join(" -> ")));
            }
        }
    }
    assert!(
        report.is_empty(),
        "cycles between the modules of a folder:\n{}",
        report.join("\n")
    );
}
