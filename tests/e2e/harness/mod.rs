//! Self-tests of the harness: mostly against Debian's reference plugins, so
//! that they hold whatever state tetherd is in, plus one of the `Daemon`
//! guard with the real tetherd. And, in `shared`, the helpers that the
//! suites of more than one area use.

mod cluster_harness;
mod migration_tools;
pub(crate) mod shared;

use std::process::Command;

use serde_json::Value;
use tether_e2e::reference::{host_local_leases, ptp_netconf};
use tether_e2e::{
    add, check, cni, cni_with_timeout, del, parallel, ref_plugin, require_root, run_prefix,
    unique_name, CniEnv, Daemon, DaemonOpts, Family, Netns, TempDir,
};

fn netns_list() -> String {
    let out = Command::new("ip").args(["netns", "list"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn listed(name: &str) -> bool {
    netns_list()
        .lines()
        .any(|l| l.split_whitespace().next() == Some(name))
}

#[test]
fn run_prefix_is_short_and_stable() {
    let prefix = run_prefix();
    assert_eq!(prefix.len(), 7, "{prefix}");
    assert!(prefix.starts_with("tt"), "{prefix}");
    assert!(
        prefix[2..].chars().all(|c| c.is_ascii_hexdigit()),
        "{prefix}"
    );
    assert_eq!(prefix, run_prefix());
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn netns_is_listed_while_alive_and_gone_after_drop() {
    require_root();
    let ns = Netns::new("self");
    let name = ns.name().to_owned();
    assert!(name.starts_with(run_prefix()), "{name}");
    assert!(listed(&name), "{name} not in:\n{}", netns_list());
    assert!(ns.path().exists());
    // lo is up, and it is the only link.
    let links = ns.links();
    assert_eq!(ns.link_names(), ["lo"]);
    let flags = links[0]["flags"].as_array().unwrap();
    assert!(flags.iter().any(|f| f == "UP"), "{links:?}");
    drop(ns);
    assert!(!listed(&name), "{name} still in:\n{}", netns_list());
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn netns_is_deleted_when_the_test_panics() {
    require_root();
    let (tx, rx) = std::sync::mpsc::channel();
    let result = std::thread::spawn(move || {
        let ns = Netns::new("boom");
        tx.send(ns.name().to_owned()).unwrap();
        panic!("a failing test");
    })
    .join();
    assert!(result.is_err());
    let name = rx.recv().unwrap();
    assert!(!listed(&name), "{name} survived a panic:\n{}", netns_list());
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn exec_runs_inside_the_netns() {
    require_root();
    let ns = Netns::new("exec");
    let dummy = unique_name("ve");
    let peer = format!("{dummy}p");
    ns.exec_ok(&[
        "ip", "link", "add", &dummy, "type", "veth", "peer", "name", &peer,
    ]);
    assert!(ns.link_names().contains(&dummy), "{:?}", ns.links());
    // The machine's own netns did not get it.
    let root = Command::new("ip")
        .args(["link", "show", &dummy])
        .output()
        .unwrap();
    assert!(
        !root.status.success(),
        "{dummy} appeared in the machine's netns"
    );
    let out = ns.exec(&["false"]);
    assert!(!out.status.success());
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn run_moves_only_the_helper_thread() {
    require_root();
    let ns = Netns::new("run");
    let own = std::fs::read_link("/proc/thread-self/ns/net").unwrap();
    let inside = ns.run(|| std::fs::read_link("/proc/thread-self/ns/net").unwrap());
    assert_ne!(own, inside);
    assert_eq!(own, std::fs::read_link("/proc/thread-self/ns/net").unwrap());
    // A process spawned from that thread starts in the netns.
    let out = ns.run(|| {
        Command::new("ip")
            .args(["-j", "link", "show"])
            .output()
            .unwrap()
    });
    let links: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(links.len(), 1, "{links:?}");
}

#[test]
fn parallel_runs_all_at_once_and_keeps_order() {
    // With a barrier, all 16 must be alive together, or this deadlocks.
    let out = parallel(16, |i| i * 2);
    assert_eq!(out, (0..16).map(|i| i * 2).collect::<Vec<_>>());
}

#[test]
fn temp_dir_is_removed_on_drop() {
    let dir = TempDir::new("tmp");
    std::fs::write(dir.path().join("f"), "x").unwrap();
    let path = dir.path().to_path_buf();
    drop(dir);
    assert!(!path.exists());
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn cni_leaves_unset_variables_unset() {
    require_root();
    let pod = Netns::new("pod");
    let data = TempDir::new("hl");
    let conf = ptp_netconf("selftest", "10.250.0.0/24", data.path());
    let mut env = CniEnv::new("ADD", "c1", &pod);
    env.container_id = None;
    let out = cni(&ref_plugin("ptp"), &env, conf.to_string().as_bytes());
    // The spec's code for a missing or invalid environment variable.
    assert_eq!(out.error_code(), Some(4), "{out}");
    assert!(out.stdout.contains("CNI_CONTAINERID"), "{out}");
}

#[test]
fn cni_kills_a_plugin_that_hangs() {
    let dir = TempDir::new("hang");
    let plugin = dir.path().join("hang");
    std::fs::write(&plugin, "#!/bin/sh\nexec sleep 30\n").unwrap();
    let mut perms = std::fs::metadata(&plugin).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(&plugin, perms).unwrap();

    let env = CniEnv {
        command: Some("VERSION".into()),
        ..CniEnv::default()
    };
    let out = cni_with_timeout(&plugin, &env, b"{}", std::time::Duration::from_millis(300));
    assert_eq!(out.status, 128 + 9, "{out}");
    assert!(out.stderr.contains("killed after"), "{out}");
}

#[cfg_attr(
    not(feature = "tools-tests"),
    ignore = "tools tier: helm and the reference plugins of `tests/setup.sh`; `make test` runs it"
)]
#[test]
fn cni_version_of_a_reference_plugin() {
    let env = CniEnv {
        command: Some("VERSION".into()),
        ..CniEnv::default()
    };
    let out = cni(&ref_plugin("ptp"), &env, br#"{"cniVersion":"1.0.0"}"#);
    let versions = out.result()["supportedVersions"].as_array().unwrap();
    assert!(versions.iter().any(|v| v == "1.0.0"), "{out}");
}

/// The reference path the benchmark compares tether with, driven through
/// the harness: ptp + host-local run from a node netns.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn ptp_add_check_del_in_a_node_netns() {
    require_root();
    let node = Netns::new("node");
    let pod = Netns::new("pod");
    let data = TempDir::new("hl");
    let ptp = ref_plugin("ptp");
    let conf = ptp_netconf("selftest", "10.251.0.0/24", data.path());
    let id = format!("{}-ptp", run_prefix());

    let out = node.run(|| add(&ptp, &conf, &id, &pod));
    let result = out.result().clone();
    let ip = result["ips"][0]["address"].as_str().unwrap().to_owned();
    let pod_ip = ip.split('/').next().unwrap().to_owned();
    assert!(pod_ip.starts_with("10.251.0."), "{result}");

    // The pod got eth0 with the address.
    assert!(pod.addrs_of("eth0").contains(&ip), "{:?}", pod.addrs());
    // The node (not the machine) got the host veth and a /32 route.
    let host_routes = node.routes(Family::V4);
    let host_route = host_routes
        .iter()
        .find(|r| r["dst"] == pod_ip.as_str())
        .unwrap_or_else(|| panic!("no route to {pod_ip} in the node: {host_routes:?}"));
    let host_dev = host_route["dev"].as_str().unwrap();
    assert!(node.link_names().iter().any(|l| l == host_dev));
    let root = Command::new("ip")
        .args(["link", "show", host_dev])
        .output()
        .unwrap();
    assert!(
        !root.status.success(),
        "{host_dev} leaked into the machine's netns"
    );
    // Traffic flows node -> pod, inside our namespaces only.
    node.exec_ok(&["ping", "-c", "1", "-W", "2", &pod_ip]);
    assert_eq!(
        host_local_leases(data.path(), "selftest"),
        [pod_ip.as_str()]
    );

    let mut check_conf = conf.clone();
    check_conf["prevResult"] = result;
    node.run(|| check(&ptp, &check_conf, &id, &pod))
        .assert_success();

    node.run(|| del(&ptp, &conf, &id, &pod)).assert_success();
    assert_eq!(pod.link_names(), ["lo"]);
    assert_eq!(node.link_names(), ["lo"]);
    assert!(node
        .routes(Family::V4)
        .iter()
        .all(|r| r["dst"] != pod_ip.as_str()));
    assert!(host_local_leases(data.path(), "selftest").is_empty());
    // A repeated DEL succeeds, as the spec asks.
    node.run(|| del(&ptp, &conf, &id, &pod)).assert_success();
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn many_reference_adds_at_once() {
    require_root();
    let node = Netns::new("node");
    let data = TempDir::new("hl");
    let ptp = ref_plugin("ptp");
    let conf = ptp_netconf("selfpar", "10.252.0.0/24", data.path());
    let pods: Vec<Netns> = (0..8).map(|_| Netns::new("pod")).collect();
    let outs = parallel(pods.len(), |i| {
        node.run(|| add(&ptp, &conf, &format!("par{i}"), &pods[i]))
    });
    let mut ips: Vec<String> = outs
        .iter()
        .map(|o| o.result()["ips"][0]["address"].as_str().unwrap().to_owned())
        .collect();
    ips.sort();
    ips.dedup();
    assert_eq!(ips.len(), pods.len(), "duplicate addresses: {ips:?}");
    assert_eq!(host_local_leases(data.path(), "selfpar").len(), pods.len());
    let outs = parallel(pods.len(), |i| {
        node.run(|| del(&ptp, &conf, &format!("par{i}"), &pods[i]))
    });
    outs.iter().for_each(|o| {
        o.assert_success();
    });
    assert!(host_local_leases(data.path(), "selfpar").is_empty());
    assert_eq!(node.link_names(), ["lo"]);
}

/// The daemon guard: serves, survives kill -9 and restart with the same
/// socket and state dir, stops on SIGTERM, and leaves nothing behind.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn daemon_starts_restarts_and_cleans_up() {
    require_root();
    let mut daemon = Daemon::start(DaemonOpts {
        pod_cidrs: vec!["10.253.0.0/24".into()],
        ..DaemonOpts::default()
    });
    let node = daemon.node().name().to_owned();
    let dir = daemon.dir().to_path_buf();
    let socket = daemon.socket().to_path_buf();
    assert!(listed(&node));
    assert!(socket.starts_with(&dir) && daemon.state_dir().starts_with(&dir));
    // tetherd runs in the node netns, not in ours.
    let pid = daemon.pid().unwrap();
    let theirs = std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap();
    let node_ns = daemon
        .node()
        .run(|| std::fs::read_link("/proc/thread-self/ns/net").unwrap());
    assert_eq!(theirs, node_ns);

    let conf = daemon.netconf("1.0.0", "selfd");
    assert_eq!(conf["type"], "tether");
    assert_eq!(conf["socket"], socket.display().to_string());
    assert!(
        conf.get("stateDir").is_none(),
        "the daemon's --state-dir is the one knob: {conf}"
    );

    daemon.kill9();
    assert!(!daemon.is_running());
    daemon.restart();
    assert_ne!(daemon.pid(), Some(pid));
    let status = daemon.stop();
    assert!(
        status.success(),
        "tetherd exited with {status}\n{}",
        daemon.log()
    );
    daemon.restart();
    assert!(daemon.log().matches("=== harness:").count() == 3);

    drop(daemon);
    assert!(!listed(&node), "{node} still in:\n{}", netns_list());
    assert!(!dir.exists());
}

/// The tests that need root (or tools, etcd, kubelets) are compiled in
/// only with their crate's `*-tests` features; without them they are
/// ignored. CI runs `make test` as root, so `make test` must turn on every
/// such feature of every crate, or those tests would be skipped there
/// unseen.
#[test]
fn make_test_compiles_in_every_crates_root_unit_tests() {
    let dir = tether_e2e::workspace_dir();
    let makefile = std::fs::read_to_string(dir.join("Makefile")).expect("the Makefile");
    let root_tests = makefile
        .lines()
        .find_map(|l| l.strip_prefix("ROOT_TESTS := "))
        .expect("ROOT_TESTS in the Makefile");
    // The recipe runs its suites through TEST_RUN: read it in its place.
    let test_run = makefile
        .split("\nTEST_RUN = ")
        .nth(1)
        .expect("TEST_RUN in the Makefile")
        .split_inclusive('\n')
        .scan(true, |more, l| {
            let this = (*more).then_some(l);
            *more = l.trim_end().ends_with('\\');
            this
        })
        .collect::<String>()
        .replace("\\\n", " ");
    let recipe = makefile
        .split("\ntest:")
        .nth(1)
        .expect("a test target")
        .replace("$(TEST_RUN)", &test_run);
    let test_recipe: Vec<&str> = recipe
        .lines()
        .take_while(|l| l.starts_with('\t') || l.is_empty() || !l.contains(':'))
        .filter(|l| l.contains("cargo") || l.contains("$(CARGO)"))
        .collect();
    assert!(
        test_recipe
            .iter()
            .any(|l| l.contains(" test ") && l.contains("--features $(ROOT_TESTS)")),
        "make test does not pass --features $(ROOT_TESTS): {test_recipe:?}"
    );
    // Every test feature of every crate is in the list.
    let mut with_feature = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("the workspace") {
        let manifest = entry.expect("an entry").path().join("Cargo.toml");
        let Ok(text) = std::fs::read_to_string(&manifest) else {
            continue;
        };
        let name = text
            .lines()
            .find_map(|l| l.strip_prefix("name = \""))
            .and_then(|n| n.strip_suffix('"'))
            .expect("a package name");
        for feature in text
            .lines()
            .filter_map(|l| l.strip_suffix(" = []"))
            .filter(|f| f.ends_with("-tests"))
        {
            let wanted = format!("{name}/{feature}");
            assert!(
                root_tests.split(',').any(|f| f == wanted),
                "{wanted} is a test feature that ROOT_TESTS leaves out"
            );
            with_feature.push(wanted);
        }
    }
    with_feature.sort();
    assert_eq!(
        with_feature,
        [
            "tether-e2e/cluster-tests",
            "tether-e2e/kubelet-tests",
            "tether-e2e/root-tests",
            "tether-e2e/tools-tests",
            "tether-kernel/root-tests",
            "tether-node-server/root-tests",
        ]
    );
}

/// A process left in a test's namespace (an orphan: its parent is gone,
/// as nginx's workers once their master is killed) ends with it.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn a_process_left_in_a_netns_ends_with_it() {
    require_root();
    let ns = Netns::new("orph");
    let out = ns.exec(&["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"]);
    let pid: i32 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("the orphan's pid");
    assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());
    drop(ns);
    assert!(
        tether_e2e::wait_until(std::time::Duration::from_secs(5), || {
            // Gone, or a zombie of init's, which reaps it.
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map_or(true, |s| s.contains(") Z "))
        }),
        "sleep {pid} outlived its netns"
    );
}
