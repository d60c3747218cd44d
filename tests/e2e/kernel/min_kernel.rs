//! The netlink suites on the oldest kernel the README claims: Debian 12's
//! stock cloud kernel (6.1), booted under QEMU (TCG) with no network
//! device by `tests/guest/kernel-suite.sh`, which runs the suites' test
//! binaries as root inside it. Whatever they do to the network, they do to
//! the guest's kernel.
//!
//! The suites are the unit tests that drive the real kernel through
//! tether's own code: all of `tether-kernel`'s (its root tests compiled
//! in: veths, addresses, routes and neighbours in throwaway netns, VXLAN
//! and its FDB, the tap binding's tc redirect, the outbound-NAT table
//! through `nft`, the netns and sysctl handling) and node-server's DHCP
//! server answering busybox's `udhcpc` through its packet socket on a
//! veth. node-server's other root tests (the pending-DEL queue's file
//! ownership) ask nothing of the network.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

use tether_e2e::{require_root, target_dir, workspace_dir};

/// A suite: its name in the guest, the test target whose binary runs it,
/// and the test-name filter (libtest's substring match), if any.
struct Suite {
    name: &'static str,
    target: &'static str,
    filter: Option<&'static str>,
}

const SUITES: [Suite; 2] = [
    Suite {
        name: "tether-kernel",
        target: "tether_kernel",
        filter: None,
    },
    Suite {
        name: "node-server-dhcp",
        target: "tetherd",
        filter: Some("dhcp::tests::real_client::"),
    },
];

/// The Makefile's ROOT_TESTS: the features that compile the root unit
/// tests in. Asking cargo with the same features as `make test` finds the
/// binaries it built instead of building others.
fn root_test_features() -> String {
    let makefile = std::fs::read_to_string(workspace_dir().join("Makefile")).expect("the Makefile");
    makefile
        .lines()
        .find_map(|l| l.strip_prefix("ROOT_TESTS := "))
        .expect("ROOT_TESTS in the Makefile")
        .trim()
        .to_owned()
}

/// The unit-test binaries of every library in the workspace, by target
/// name, with the root tests compiled in. Under `make test` they are built
/// already and cargo only says where they are.
fn unit_test_binaries() -> HashMap<String, PathBuf> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    // What cargo set for this test's own process (CARGO_MANIFEST_DIR,
    // CARGO_PKG_NAME, OUT_DIR...) is not passed on: build scripts rerun
    // when such a variable changes (ring's does), and cargo would rebuild
    // their crates and all above them, here and again in the next build.
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        if ["CARGO_PKG_", "CARGO_BIN_", "CARGO_MANIFEST_"]
            .iter()
            .any(|p| key.starts_with(p))
            || [
                "CARGO_CRATE_NAME",
                "CARGO_PRIMARY_PACKAGE",
                "CARGO_TARGET_TMPDIR",
                "CARGO_RUSTC_CURRENT_DIR",
                "OUT_DIR",
            ]
            .contains(&key.as_ref())
        {
            cmd.env_remove(key.as_ref());
        }
    }
    let out = cmd
        .args(["test", "--workspace", "--lib", "--no-run"])
        .args(["--features", &root_test_features()])
        .arg("--message-format=json")
        .current_dir(workspace_dir())
        .output()
        .expect("running cargo");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "building the unit tests failed:\n{log}"
    );
    let built = log.lines().filter(|l| l.contains("Compiling ")).count();
    eprintln!("cargo compiled {built} crates for the unit-test binaries");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["profile"]["test"] == true)
        .filter_map(|m| {
            let name = m["target"]["name"].as_str()?.to_owned();
            Some((name, PathBuf::from(m["executable"].as_str()?)))
        })
        .collect()
}

/// How many tests `binary` runs with `filter` here, and how many it
/// ignores: what the guest must report.
fn expected(binary: &PathBuf, filter: Option<&str>) -> (usize, usize) {
    let count = |ignored: bool| {
        let mut cmd = Command::new(binary);
        cmd.args(["--list", "--format", "terse"]);
        if ignored {
            cmd.arg("--ignored");
        }
        cmd.args(filter);
        let out = cmd.output().expect("listing the tests");
        assert!(out.status.success(), "{} --list: {out:?}", binary.display());
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.ends_with(": test"))
            .count()
    };
    let (all, ignored) = (count(false), count(true));
    (all - ignored, ignored)
}

/// `key=value` from a summary line.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split(' ')
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn the_netlink_suites_pass_on_debian_12s_stock_kernel() {
    require_root();
    let binaries = unit_test_binaries();
    let mut args = Vec::new();
    let mut want = Vec::new();
    for suite in &SUITES {
        let binary = binaries
            .get(suite.target)
            .unwrap_or_else(|| panic!("cargo built no unit tests for {}", suite.target));
        let mut arg = format!("{}={}", suite.name, binary.display());
        if let Some(filter) = suite.filter {
            arg.push(',');
            arg.push_str(filter);
        }
        args.push(arg);
        let (passed, ignored) = expected(binary, suite.filter);
        assert!(passed > 0, "{}: no test to run", suite.name);
        want.push((suite.name, passed, ignored));
    }

    let log = target_dir().join("min-kernel-console.log");
    let out = Command::new("sh")
        .arg(workspace_dir().join("tests/guest/kernel-suite.sh"))
        .arg("-o")
        .arg(&log)
        .args(&args)
        .output()
        .expect("running tests/guest/kernel-suite.sh");
    let summary = String::from_utf8_lossy(&out.stdout);
    let console = String::from_utf8_lossy(&out.stderr);
    let context = format!("summary:\n{summary}\nguest console and script:\n{console}");
    assert!(out.status.success(), "{}\n{context}", out.status);

    let kernel = console
        .lines()
        .find_map(|l| l.strip_prefix("KSUITE-KERNEL "))
        .unwrap_or_else(|| panic!("the guest named no kernel\n{context}"));
    assert!(kernel.starts_with("6.1."), "{kernel}\n{context}");
    for (name, passed, ignored) in want {
        let line = summary
            .lines()
            .find(|l| l.starts_with(&format!("KSUITE-SUMMARY {name} ")))
            .unwrap_or_else(|| panic!("no summary for {name}\n{context}"));
        // Every test that runs here ran there, and passed.
        assert_eq!(field(line, "failed"), Some("0"), "{line}\n{context}");
        assert_eq!(field(line, "rc"), Some("0"), "{line}\n{context}");
        assert_eq!(
            field(line, "passed"),
            Some(passed.to_string().as_str()),
            "{line}\n{context}"
        );
        assert_eq!(
            field(line, "ignored"),
            Some(ignored.to_string().as_str()),
            "{line}\n{context}"
        );
        eprintln!("{line} (kernel {kernel})");
    }
}
