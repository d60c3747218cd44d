//! The docs name only what exists: the README and every page of the book
//! (docs/) are read, and a test fails when they name
//! - a `--flag` that `tetherd --help` does not list and that is not one of
//!   the other programs' flags this file knows ([`OTHER_FLAGS`]);
//! - a chart value (a dotted name whose first part is a top-level value,
//!   or a `--set` key) that the chart's values.schema.json does not accept;
//! - a `tether_...` metric that tetherd does not register, or a metrics
//!   table without one it registers, or a control store (`backend` label)
//!   it leaves out;
//! - a path of the repository (`install/...`, `tests/...`, ...) that does
//!   not exist;
//! - a ```yaml block that is not YAML.
//!
//! And the reference pages generated from the code (docs/reference.py:
//! tetherd's flags from `tetherd --help`, the chart's values from
//! values.yaml) must be what the generator writes now.
//!
//! The metrics' labels are checked against a real scrape in
//! tests/e2e/verbs/metrics.rs. BENCHMARKS.md and CONFORMANCE.md, which the
//! book includes, are records written by their tools, and are not read.

use std::collections::BTreeSet;
use std::process::Command;

use serde_json::Value;
use tether_e2e::{doc_files, tetherd_bin, workspace_dir, TempDir};

/// Flags of other programs the docs name, with the program: a flag not in
/// `tetherd --help` must be one of these.
const OTHER_FLAGS: &[(&str, &[&str])] = &[
    // The upstream NetworkPolicy suite's probe (docs/developer/netpol-suite.md).
    ("agnhost connect", &["timeout", "protocol"]),
    (
        "helm",
        &[
            "namespace",
            "set",
            "values",
            "reuse-values",
            "reset-then-reuse-values",
            "reset-values",
            "dry-run",
            "strict",
        ],
    ),
    (
        "kubectl",
        &[
            "type",
            "subresource",
            "field-selector",
            "for",
            "timeout",
            "image",
            "restart",
            "from-file",
            "server-side",
            "force-conflicts",
            "ignore-daemonsets",
            "delete-emptydir-data",
            "cascade",
            "wait",
            "all",
            "as",
            "overwrite",
            "ignore-not-found",
        ],
    ),
    (
        "cargo",
        &[
            "release",
            "locked",
            "version",
            "workspace",
            "all-targets",
            "features",
            "no-default-features",
            "root",
            "check",
            "open",
            "lib",
            "bins",
            "test",
            "bin",
            "no-fail-fast",
            "test-threads",
            "nocapture",
            "ignored",
            "write",
            "no-build",
            "faults",
            "verbose",
        ],
    ),
    ("podman, docker", &["network-backend"]),
    ("grpcurl", &["plaintext", "unix", "authority"]),
    ("kubeadm", &["pod-network-cidr"]),
    (
        "kube-controller-manager",
        &["allocate-node-cidrs", "cluster-cidr"],
    ),
    ("kube-proxy", &["detect-local-mode", "cluster-cidr"]),
    ("kubelet", &["node-ip"]),
    ("apt-get", &["no-install-recommends"]),
    ("busybox, tests/demo.sh", &["list-full", "install"]),
    (
        "the kernel suite (tests/guest/kernel-suite.sh), QEMU",
        &["cni"],
    ),
    ("mdbook", &["dest-dir"]),
    ("tether-bench scale", &["control-only"]),
    (
        "the suites' tetherd_with_delays (tests/src/bin)",
        &[
            "hold-deletions-ms",
            "hold-wiring-ms",
            "hold-writes-while",
            "hold-writes-ms",
        ],
    ),
];

fn read(file: &str) -> String {
    std::fs::read_to_string(workspace_dir().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
}

/// The flags of `tetherd --help`, without their dashes, and those it
/// hides from its help (aliases, hidden flags), from its source.
fn tetherd_flags() -> BTreeSet<String> {
    let out = Command::new(tetherd_bin())
        .arg("--help")
        .output()
        .expect("running tetherd --help");
    let mut flags: BTreeSet<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let l = l.trim_start();
            let l = l.strip_prefix("-h, ").unwrap_or(l);
            let name = l.strip_prefix("--")?;
            Some(name.split([' ', '=']).next()?.to_string())
        })
        .collect();
    let main = read("node-server/src/daemon/options.rs");
    let lines: Vec<&str> = main.lines().collect();
    for (n, line) in lines.iter().enumerate() {
        let line = line.trim();
        if !line.starts_with("#[arg(") {
            continue;
        }
        if let Some((_, rest)) = line.split_once("alias = \"") {
            flags.insert(rest.split('"').next().unwrap_or_default().to_string());
        }
        if line.starts_with("#[arg(long,") && line.contains("hide = true") {
            let field = lines.get(n + 1).map(|l| l.trim()).unwrap_or_default();
            let field = field.strip_prefix("pub ").unwrap_or(field);
            let name = field.split(':').next().unwrap_or_default();
            flags.insert(name.replace('_', "-"));
        }
    }
    flags
}

/// Every `--name` in `text`: two dashes after anything but a word
/// character or a dash, then a lower-case word.
fn flags_in(text: &str) -> Vec<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(at) = text[i..].find("--") {
        let start = i + at;
        i = start + 2;
        let before = start.checked_sub(1).map(|b| bytes[b]);
        if before.is_some_and(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
            continue;
        }
        let name: String = text[start + 2..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-')
            .collect();
        let name = name.trim_end_matches('-').to_string();
        if name.chars().next().is_some_and(|c| c.is_ascii_lowercase()) {
            out.push(name);
        }
    }
    out
}

#[test]
fn the_docs_name_only_flags_tetherd_or_the_other_programs_have() {
    let tetherd = tetherd_flags();
    assert!(
        tetherd.contains("store") && tetherd.contains("cluster-cidr"),
        "{tetherd:?}"
    );
    let other: BTreeSet<&str> = OTHER_FLAGS
        .iter()
        .flat_map(|(_, flags)| flags.iter().copied())
        .collect();
    let mut unknown = Vec::new();
    for file in doc_files() {
        for flag in flags_in(&read(&file)) {
            if !tetherd.contains(&flag) && !other.contains(flag.as_str()) {
                unknown.push(format!("{file}: --{flag}"));
            }
        }
    }
    unknown.dedup();
    assert!(
        unknown.is_empty(),
        "flags that tetherd --help does not list, nor OTHER_FLAGS (a renamed or removed flag?):\n{}",
        unknown.join("\n")
    );
}

/// The text of every `code span` of `text` outside fenced blocks.
fn code_spans(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut parts = line.split('`');
        parts.next();
        while let (Some(inside), Some(_)) = (parts.next(), parts.next()) {
            out.push(inside.to_string());
        }
    }
    out
}

/// The key of every `--set KEY=...` of `text`, but in ```text blocks
/// (what a program printed: a refused value, say).
fn set_keys(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut printed = false;
    for line in text.lines() {
        let fence = line.trim_start();
        if fence.starts_with("```") {
            printed = fence == "```text";
            continue;
        }
        if printed {
            continue;
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        for pair in words.windows(2).filter(|w| w[0] == "--set") {
            let arg = pair[1].trim_matches(|c| c == '\'' || c == '"');
            if let Some((key, _)) = arg.split_once('=') {
                out.push(key.to_string());
            }
        }
    }
    out
}

/// Whether values.schema.json accepts the value path `path` (dots, and
/// `[N]` for a list's items).
fn schema_accepts(schema: &Value, path: &str) -> bool {
    let resolve = |node: &Value| -> Value {
        match node.get("$ref").and_then(Value::as_str) {
            Some(r) => {
                let name = r.trim_start_matches("#/definitions/");
                schema["definitions"][name].clone()
            }
            None => node.clone(),
        }
    };
    let mut node = resolve(schema);
    for segment in path.split('.') {
        let (name, indexed) = match segment.split_once('[') {
            Some((name, _)) => (name, true),
            None => (segment, false),
        };
        if let Some(props) = node.get("properties").and_then(Value::as_object) {
            match props.get(name) {
                Some(p) => node = resolve(p),
                None => return false,
            }
        } else if node
            .get("additionalProperties")
            .is_some_and(Value::is_object)
            || node["type"] == "object"
        {
            // A map of any keys (labels, resources): the rest is free.
            return true;
        } else {
            return false;
        }
        if indexed {
            node = resolve(&node["items"]);
        }
    }
    true
}

#[test]
fn the_docs_name_only_chart_values_the_schema_accepts() {
    let schema: Value = serde_json::from_str(&read("install/helm/tether/values.schema.json"))
        .expect("values.schema.json is JSON");
    let top: BTreeSet<String> = schema["properties"]
        .as_object()
        .expect("the schema's properties")
        .keys()
        .cloned()
        .collect();
    let mut checked = 0;
    let mut unknown = Vec::new();
    for file in doc_files() {
        let text = read(&file);
        let dotted = code_spans(&text).into_iter().filter(|s| {
            let first = s.split(['.', '[']).next().unwrap_or_default();
            let file = [".json", ".yaml", ".md", ".rs", ".sh", ".toml"]
                .iter()
                .any(|x| s.ends_with(x));
            s.contains('.')
                && !file
                && !s.contains(char::is_whitespace)
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "._[]".contains(c))
                && top.contains(first)
        });
        for path in dotted.chain(set_keys(&text)) {
            checked += 1;
            if !schema_accepts(&schema, &path) {
                unknown.push(format!("{file}: {path}"));
            }
        }
    }
    assert!(
        checked > 30,
        "only {checked} chart values found in the docs"
    );
    assert!(
        unknown.is_empty(),
        "chart values the schema does not accept:\n{}",
        unknown.join("\n")
    );
}

/// The names of the metrics tetherd registers, without the `_total` a
/// counter gets in a scrape.
fn registered_metrics() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for file in [
        "node-server/src/metrics.rs",
        "node-server/src/api/scrape.rs",
    ] {
        for piece in read(file).split('"').skip(1).step_by(2) {
            if piece.starts_with("tether_")
                && piece.chars().all(|c| c.is_ascii_lowercase() || c == '_')
            {
                names.insert(piece.trim_end_matches("_total").to_string());
            }
        }
    }
    names
}

/// Every word of `text` (letters, digits, `_`) that starts with `prefix`
/// at a word's start.
fn words_starting(text: &str, prefix: &str) -> Vec<String> {
    let is_word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = Vec::new();
    for (i, _) in text.match_indices(prefix) {
        if text[..i]
            .chars()
            .last()
            .is_some_and(|c| is_word(c) || c == '-')
        {
            continue;
        }
        out.push(text[i..].chars().take_while(|c| is_word(*c)).collect());
    }
    out
}

/// A metric name as the code registers it: without a sample suffix.
fn family(name: &str) -> &str {
    ["_total", "_bucket", "_sum", "_count"]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name)
}

/// The names with tether's metric prefix that are not metrics: the
/// nftables tables of a migrating VM's connections (`inet tether_vm`) and
/// of NetworkPolicy (`inet tether_policy`), as the kernel crate names
/// them.
fn not_metrics() -> BTreeSet<String> {
    [
        ("kernel/src/handover.rs", "HANDOVER_TABLE"),
        ("kernel/src/policy.rs", "POLICY_TABLE"),
    ]
    .into_iter()
    .map(|(file, constant)| {
        read(file)
            .split_once(&format!("pub const {constant}: &str = \""))
            .and_then(|(_, rest)| rest.split_once('"'))
            .map(|(name, _)| name.to_string())
            .unwrap_or_else(|| panic!("{file} names {constant}"))
    })
    .collect()
}

#[test]
fn the_docs_name_only_metrics_tetherd_has_and_the_table_has_them_all() {
    let registered = registered_metrics();
    assert!(registered.len() >= 14, "{registered:?}");
    let others = not_metrics();
    let mut unknown = Vec::new();
    for file in doc_files() {
        for word in words_starting(&read(&file), "tether_") {
            if word == "tether_" || others.contains(&word) {
                continue; // the prefix itself, or not a metric
            }
            let name = family(word.trim_end_matches('_')).to_string();
            if !registered.contains(&name) {
                unknown.push(format!("{file}: {word}"));
            }
        }
    }
    unknown.dedup();
    assert!(
        unknown.is_empty(),
        "metrics tetherd does not register:\n{}",
        unknown.join("\n")
    );

    // The metrics page's table lists every one.
    let page = read("docs/user/metrics.md");
    let listed: BTreeSet<String> = page
        .lines()
        .filter_map(|l| l.strip_prefix("| `tether_"))
        .filter_map(|l| l.split('`').next())
        .map(|n| family(&format!("tether_{n}")).to_string())
        .collect();
    let missing: Vec<&String> = registered.difference(&listed).collect();
    assert!(
        missing.is_empty(),
        "docs/user/metrics.md's table leaves out {missing:?}"
    );

    // The control-plane histogram's `backend` label: every control store.
    let mut backends = BTreeSet::new();
    for file in [
        "store/src/control/embedded.rs",
        "store/src/control/etcd.rs",
        "store/src/control/kubernetes/mod.rs",
    ] {
        let code = read(file);
        let after = code
            .split_once("fn backend(&self) -> &'static str {")
            .map(|(_, rest)| rest)
            .unwrap_or_else(|| panic!("{file} has no fn backend"));
        let name = after.split('"').nth(1).expect("a backend name");
        backends.insert(name.to_string());
    }
    let row = page
        .lines()
        .find(|l| l.starts_with("| `tether_control_plane_request_duration_seconds`"))
        .expect("the control-plane row of the metrics table");
    for b in &backends {
        assert!(
            row.contains(&format!("`{b}`")),
            "the metrics table's backend label leaves out {b} (the stores: {backends:?}): {row}"
        );
    }
}

/// Every repository path in `text`: a word starting with one of the
/// repository's top directories and a slash.
fn repo_paths(text: &str) -> Vec<String> {
    const TOP: [&str; 11] = [
        "install/",
        "tests/",
        "docs/",
        "node-server/",
        "cni-shim/",
        "base/",
        "cni/",
        "ipam/",
        "kernel/",
        "store/",
        "proto/",
    ];
    let mut out = Vec::new();
    for (i, _) in text.char_indices() {
        let before = text[..i].chars().last();
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || "/._-~$".contains(c)) {
            continue;
        }
        let Some(top) = TOP.iter().find(|t| text[i..].starts_with(**t)) else {
            continue;
        };
        let path: String = text[i..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || "/._-<>*".contains(*c))
            .collect();
        let path = path.trim_end_matches(['.', ',', ':']).to_string();
        if path.len() > top.len() {
            out.push(path);
        }
    }
    out
}

/// Whether `path` names something in the repository; `<...>` and `*`
/// stand for any part of a name.
fn exists(path: &str) -> bool {
    let root = workspace_dir();
    if !path.contains(['<', '*']) {
        return root.join(path).exists();
    }
    let mut dirs = vec![root.clone()];
    for part in path.trim_end_matches('/').split('/') {
        let mut next = Vec::new();
        for dir in &dirs {
            if !part.contains(['<', '*']) {
                if dir.join(part).exists() {
                    next.push(dir.join(part));
                }
                continue;
            }
            let Ok(entries) = std::fs::read_dir(dir) else {
                continue;
            };
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if matches_pattern(part, &name) {
                    next.push(e.path());
                }
            }
        }
        dirs = next;
    }
    !dirs.is_empty()
}

/// `pattern` against `name`, where `<...>` and `*` match any text.
fn matches_pattern(pattern: &str, name: &str) -> bool {
    let mut pieces = Vec::new();
    let mut rest = pattern;
    while let Some(at) = rest.find(['<', '*']) {
        pieces.push(&rest[..at]);
        rest = match rest[at..].chars().next() {
            Some('<') => rest[at..].split_once('>').map_or("", |(_, r)| r),
            _ => &rest[at + 1..],
        };
    }
    pieces.push(rest);
    let mut at = 0;
    for (n, piece) in pieces.iter().enumerate() {
        if n == 0 {
            if !name.starts_with(piece) {
                return false;
            }
            at = piece.len();
        } else if n == pieces.len() - 1 {
            return name.len() >= at + piece.len() && name[at..].ends_with(piece);
        } else {
            match name[at..].find(piece) {
                Some(i) => at += i + piece.len(),
                None => return false,
            }
        }
    }
    at == name.len() || pieces.len() > 1
}

/// Paths the docs name as gone, on purpose.
const GONE: &[(&str, &str)] = &[(
    "install/daemonset.yaml",
    "the hand-written DaemonSet of before the chart, which an upgrade from it must delete",
)];

#[test]
fn the_docs_name_only_files_the_repository_has() {
    let mut missing = Vec::new();
    let mut checked = 0;
    for file in doc_files() {
        for path in repo_paths(&read(&file)) {
            checked += 1;
            if GONE.iter().any(|(gone, _)| *gone == path) {
                assert!(!exists(&path), "{path} is back: take it off GONE");
                continue;
            }
            if !exists(&path) {
                missing.push(format!("{file}: {path}"));
            }
        }
    }
    assert!(checked > 50, "only {checked} paths found in the docs");
    missing.dedup();
    assert!(
        missing.is_empty(),
        "paths the repository does not have:\n{}",
        missing.join("\n")
    );
}

#[test]
fn every_yaml_block_of_the_docs_is_yaml() {
    let mut blocks = 0;
    for file in doc_files() {
        let text = read(&file);
        let mut lines = text.lines().enumerate();
        while let Some((n, line)) = lines.next() {
            if line.trim() != "```yaml" {
                continue;
            }
            let body: Vec<&str> = lines
                .by_ref()
                .map(|(_, l)| l)
                .take_while(|l| l.trim() != "```")
                .collect();
            blocks += 1;
            let yaml = body.join("\n");
            for doc in serde_yaml_ng::Deserializer::from_str(&yaml) {
                if let Err(e) = <Value as serde::Deserialize>::deserialize(doc) {
                    panic!(
                        "{file}:{}: a ```yaml block that is not YAML: {e}\n{yaml}",
                        n + 1
                    );
                }
            }
        }
    }
    assert!(blocks >= 5, "only {blocks} yaml blocks");
}

#[test]
fn the_generated_reference_pages_are_what_the_generator_writes() {
    let dir = TempDir::new("ref");
    let out = Command::new("python3")
        .arg(workspace_dir().join("docs/reference.py"))
        .arg(tetherd_bin())
        .arg(dir.path())
        .output()
        .expect("running docs/reference.py");
    assert!(
        out.status.success(),
        "docs/reference.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for page in ["tetherd-flags.md", "chart-values.md"] {
        let generated = std::fs::read_to_string(dir.path().join(page)).expect("a generated page");
        let committed = read(&format!("docs/reference/{page}"));
        assert!(
            generated == committed,
            "docs/reference/{page} differs from what docs/reference.py writes now: run `make reference` and commit it"
        );
    }
}
