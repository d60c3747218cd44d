//! tether first in a conflist, followed by the reference `portmap`, executed
//! by Go's libcni (the library inside containerd, CRI-O and podman) through
//! `tests/runtimes/cnitool`, built here offline from Debian's packages.
//!
//! Both plugins are recording wrappers (see `tether_e2e::runtime`), so the test sees
//! exactly what libcni handed each of them. portmap changes the host side
//! (iptables), so its wrapper runs it inside the daemon's node netns; the
//! tether shim may run anywhere.
//!
//! Run as root, after `tests/setup.sh`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tether_e2e::{
    require_root, target_dir, tether_bin, unique_name, workspace_dir, Daemon, DaemonOpts, Netns,
    TempDir, REF_PLUGIN_DIR,
};

use tether_e2e::runtime::{
    attachments, install_recording_plugin, libcni_cache_files, node_leftovers, print_calls,
    recorded_calls, result_ip, run_bounded, run_ok, wait_for, Call,
};

/// Pod CIDR of this test's daemon (inside its node netns only).
const POD_CIDR: &str = "10.251.3.0/24";
/// The node port portmap forwards to the pod's port 80.
const HOST_PORT: u16 = 18080;
/// An address given to the node netns only, as the node's own address that
/// a hostPort is reached on (TEST-NET-1: routed nowhere).
const NODE_ADDRESS: &str = "192.0.2.10";

/// Bound for one libcni operation and for the Go build.
const CNITOOL_TIMEOUT: Duration = Duration::from_secs(90);
const GO_BUILD_TIMEOUT: Duration = Duration::from_secs(300);

/// Builds `tests/runtimes/cnitool` into `dir`, offline, against Debian's
/// libcni (GOPATH mode); Go's build cache lives in cargo's target dir.
fn build_cnitool(dir: &Path) -> PathBuf {
    let source = workspace_dir().join("tests/runtimes/cnitool");
    let out = dir.join("cnitool");
    run_ok(
        Command::new("go")
            .args(["build", "-o"])
            .arg(&out)
            .arg(".")
            .current_dir(&source)
            .env("GO111MODULE", "off")
            .env("GOPATH", "/usr/share/gocode")
            .env("GOFLAGS", "")
            .env("GOCACHE", target_dir().join("go-build-cache")),
        GO_BUILD_TIMEOUT,
    );
    out
}

/// One attachment made through cnitool: ADD, CHECK and DEL of the same
/// conflist, container id, ifname and capability args. DEL'd on drop if the
/// test has not done it.
struct LibcniAttachment {
    cnitool: PathBuf,
    plugin_dir: PathBuf,
    cache_dir: PathBuf,
    conflist: PathBuf,
    netns: PathBuf,
    id: String,
    capability_args: Value,
    deleted: bool,
}

impl LibcniAttachment {
    fn cnitool(&self, verb: &str) -> std::process::Output {
        run_bounded(
            Command::new(&self.cnitool)
                .arg("-path")
                .arg(&self.plugin_dir)
                .arg("-cache")
                .arg(&self.cache_dir)
                .args(["-id", &self.id, "-ifname", "eth0"])
                .args(["-cap", &self.capability_args.to_string()])
                .args([verb])
                .arg(&self.conflist)
                .arg(&self.netns),
            CNITOOL_TIMEOUT,
        )
    }

    fn del(&mut self) -> std::process::Output {
        self.deleted = true;
        self.cnitool("del")
    }
}

impl Drop for LibcniAttachment {
    fn drop(&mut self) {
        if !self.deleted {
            let out = self.del();
            if !out.status.success() {
                eprintln!(
                    "cleanup: cnitool del: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
    }
}

fn text(out: &std::process::Output) -> String {
    format!(
        "status {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout).trim(),
        String::from_utf8_lossy(&out.stderr).trim()
    )
}

/// The recorded calls of `plugin` (tether or portmap) for `command`: the
/// wrappers share one capture dir, so tell them apart by the netconf type.
fn calls_of<'a>(calls: &'a [Call], plugin: &str, command: &str) -> Vec<&'a Call> {
    calls
        .iter()
        .filter(|c| c.command() == command && c.netconf()["type"] == plugin)
        .collect()
}

/// The DNAT rules of the node's nat table that send to `ip`.
fn dnat_rules_to(node: &Netns, ip: &str) -> Vec<String> {
    node.exec_ok(&["iptables-save", "-t", "nat"])
        .lines()
        .filter(|l| l.contains("DNAT") && l.contains(&format!("--to-destination {ip}:")))
        .map(str::to_owned)
        .collect()
}

/// A one-shot TCP server in the pod (busybox `nc -l`) that sends `greeting`
/// to the first client; killed on drop if no client came.
struct PodListener {
    child: Child,
}

impl PodListener {
    fn start(pod: &Netns, port: u16, greeting: &str) -> PodListener {
        let mut child = Command::new("ip")
            .args([
                "netns",
                "exec",
                pod.name(),
                "busybox",
                "nc",
                "-l",
                "-p",
                &port.to_string(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("spawning nc -l: {e}"));
        let mut stdin = child.stdin.take().expect("piped stdin");
        stdin
            .write_all(greeting.as_bytes())
            .expect("writing the greeting");
        // Closing stdin lets nc close the connection once it has sent it.
        drop(stdin);
        PodListener { child }
    }
}

impl Drop for PodListener {
    fn drop(&mut self) {
        // Our own child, not reaped yet.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// tether then portmap, the way a runtime runs a conflist: portmap gets
/// tether's result as prevResult and installs the hostPort DNAT to the pod
/// tether wired (which answers through it, on the node's address and on a
/// hostPort bound to 127.0.0.1, as Kubernetes' hostPort conformance test
/// asks); CHECK reaches portmap, so
/// tether's CHECK passed; DEL walks the list backwards and leaves neither
/// DNAT rules nor any tether state behind.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn tether_then_portmap_through_libcni() {
    require_root();
    let started = Instant::now();
    let daemon = Daemon::start(DaemonOpts {
        pod_cidrs: vec![POD_CIDR.to_owned()],
        ..Default::default()
    });
    let node = daemon.node();
    let tmp = TempDir::new("chain");
    let cnitool = build_cnitool(tmp.path());
    eprintln!("cnitool built after {:?}", started.elapsed());

    let plugin_dir = tmp.path().join("bin");
    let calls_dir = tmp.path().join("calls");
    let cache_dir = tmp.path().join("cache");
    for dir in [&plugin_dir, &calls_dir, &cache_dir] {
        std::fs::create_dir(dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
    }
    install_recording_plugin(&plugin_dir.join("tether"), &tether_bin(), None, &calls_dir);
    install_recording_plugin(
        &plugin_dir.join("portmap"),
        &Path::new(REF_PLUGIN_DIR).join("portmap"),
        Some(node.path()),
        &calls_dir,
    );

    let network = unique_name("chnet");
    let mut tether_plugin = daemon.netconf("1.0.0", &network);
    if let Some(obj) = tether_plugin.as_object_mut() {
        obj.remove("cniVersion");
        obj.remove("name");
    }
    let conflist = json!({
        "cniVersion": "1.0.0",
        "name": network,
        "plugins": [
            tether_plugin,
            { "type": "portmap", "capabilities": { "portMappings": true } },
        ],
    });
    let conflist_path = tmp.path().join("net.conflist");
    std::fs::write(&conflist_path, conflist.to_string()).expect("writing the conflist");

    let pod = Netns::new("pod");
    let mut attachment = LibcniAttachment {
        cnitool,
        plugin_dir,
        cache_dir: cache_dir.clone(),
        conflist: conflist_path,
        netns: pod.path().to_owned(),
        id: unique_name("chain"),
        capability_args: json!({
            "portMappings": [
                { "hostPort": HOST_PORT, "containerPort": 80, "protocol": "tcp" },
                { "hostPort": HOST_PORT + 1, "containerPort": 80, "protocol": "tcp", "hostIP": "127.0.0.1" },
            ],
        }),
        deleted: false,
    };

    // ADD through the list.
    let out = attachment.cnitool("add");
    let calls = recorded_calls(&calls_dir);
    print_calls("libcni", &calls);
    assert!(out.status.success(), "cnitool add: {}", text(&out));
    let final_result: Value =
        serde_json::from_slice(&out.stdout).expect("cnitool prints the result as JSON");
    let ip = result_ip(&final_result);
    assert!(
        pod.addrs_of("eth0").contains(&format!("{ip}/32")),
        "the pod's eth0 does not hold {ip}/32: {:?}",
        pod.addrs_of("eth0")
    );

    let tether_adds = calls_of(&calls, "tether", "ADD");
    let portmap_adds = calls_of(&calls, "portmap", "ADD");
    assert_eq!(
        (tether_adds.len(), portmap_adds.len()),
        (1, 1),
        "one ADD each:\n{calls:#?}"
    );
    let tether_result = tether_adds[0].output().expect("tether's ADD printed JSON");
    assert_eq!(tether_adds[0].rc, Some(0));
    // portmap received tether's result, untouched, as prevResult, and the
    // runtime's port mappings as runtimeConfig.
    let portmap_conf = portmap_adds[0].netconf();
    assert_eq!(
        portmap_conf["prevResult"], tether_result,
        "portmap's prevResult is tether's result"
    );
    assert_eq!(
        portmap_conf["runtimeConfig"]["portMappings"][0]["hostPort"], HOST_PORT,
        "portmap's runtimeConfig: {portmap_conf}"
    );
    assert_eq!(
        portmap_adds[0].rc,
        Some(0),
        "portmap ADD: {}",
        portmap_adds[0].describe()
    );
    assert_eq!(
        result_ip(&tether_result),
        ip,
        "the list's result keeps tether's address"
    );

    // portmap's DNAT to the pod is in the node netns ...
    let rules = dnat_rules_to(node, &ip);
    assert!(
        rules
            .iter()
            .any(|r| r.contains(&format!("--dport {HOST_PORT}"))),
        "no DNAT from port {HOST_PORT} to {ip}:80 in the node's nat table: {rules:?}"
    );
    // ... and works: a client in the node netns reaches the pod through the
    // hostPort on the node's own address.
    // (This kernel has no dummy links: the address goes on the node's lo.)
    node.exec_ok(&[
        "ip",
        "addr",
        "add",
        &format!("{NODE_ADDRESS}/32"),
        "dev",
        "lo",
    ]);
    let greeting = "hello from the pod";
    let _listener = PodListener::start(&pod, 80, &format!("{greeting}\n"));
    let port = HOST_PORT.to_string();
    let reply = wait_for("the hostPort to answer", Duration::from_secs(20), || {
        let out = node.exec(&["busybox", "nc", "-w", "3", NODE_ADDRESS, &port]);
        let got = String::from_utf8_lossy(&out.stdout).into_owned();
        got.contains(greeting).then_some(got)
    });
    eprintln!(
        "hostPort {NODE_ADDRESS}:{HOST_PORT} answered: {}",
        reply.trim()
    );
    // A hostIP of 127.0.0.1: the connection leaves 127.0.0.1 for the
    // pod's veth, which portmap allows (route_localnet) and masquerades.
    // The listener answers once: a new one.
    drop(_listener);
    let _listener = PodListener::start(&pod, 80, &format!("{greeting}\n"));
    let local_port = (HOST_PORT + 1).to_string();
    let reply = wait_for(
        "the 127.0.0.1 hostPort to answer",
        Duration::from_secs(20),
        || {
            let out = node.exec(&["busybox", "nc", "-w", "3", "127.0.0.1", &local_port]);
            let got = String::from_utf8_lossy(&out.stdout).into_owned();
            got.contains(greeting).then_some(got)
        },
    );
    eprintln!("hostPort 127.0.0.1:{local_port} answered: {}", reply.trim());

    // CHECK: libcni checks tether, then portmap. Debian's portmap 1.1.1
    // fails its own CHECK (it looks for IPv6 chains even for IPv4), so a
    // failure is accepted only if it is portmap's, after tether's CHECK
    // passed.
    let out = attachment.cnitool("check");
    let calls = recorded_calls(&calls_dir);
    let tether_checks = calls_of(&calls, "tether", "CHECK");
    let portmap_checks = calls_of(&calls, "portmap", "CHECK");
    assert_eq!(
        tether_checks.len(),
        1,
        "tether was CHECKed once: {}",
        text(&out)
    );
    assert_eq!(
        tether_checks[0].rc,
        Some(0),
        "tether's CHECK: {}",
        tether_checks[0].describe()
    );
    assert_eq!(
        tether_checks[0].netconf()["prevResult"],
        final_result,
        "CHECK's prevResult is the cached result"
    );
    assert_eq!(
        portmap_checks.len(),
        1,
        "libcni went on to portmap's CHECK: {}",
        text(&out)
    );
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("could not check ipv6 dnat"),
            "CHECK failed, and not with portmap's known IPv6 quirk: {}",
            text(&out)
        );
        eprintln!("CHECK: portmap's known failure: {}", stderr.trim());
    }

    // DEL through the list: portmap first, then tether, both with the
    // cached result.
    let out = attachment.del();
    assert!(out.status.success(), "cnitool del: {}", text(&out));
    let calls = recorded_calls(&calls_dir);
    let tether_dels = calls_of(&calls, "tether", "DEL");
    let portmap_dels = calls_of(&calls, "portmap", "DEL");
    assert_eq!(
        (tether_dels.len(), portmap_dels.len()),
        (1, 1),
        "one DEL each"
    );
    eprintln!("[libcni DEL tether] {}", tether_dels[0].describe());
    eprintln!("[libcni DEL portmap] {}", portmap_dels[0].describe());
    assert_eq!(
        tether_dels[0].rc,
        Some(0),
        "tether's DEL: {}",
        tether_dels[0].describe()
    );
    assert_eq!(
        portmap_dels[0].netconf()["prevResult"],
        final_result,
        "portmap's DEL prevResult"
    );
    assert_eq!(
        tether_dels[0].netconf()["prevResult"],
        final_result,
        "tether's DEL prevResult"
    );

    assert!(
        dnat_rules_to(node, &ip).is_empty(),
        "DNAT rules to {ip} survived DEL"
    );
    assert!(
        !pod.has_link("eth0"),
        "the pod still has eth0: {:?}",
        pod.link_names()
    );
    wait_for("the node to be clean", Duration::from_secs(10), || {
        node_leftovers(node).is_empty().then_some(())
    });
    assert!(
        attachments(&daemon, &network).is_empty(),
        "attachments left after DEL"
    );
    assert!(
        libcni_cache_files(&cache_dir, &network).is_empty(),
        "libcni kept its cached result after DEL"
    );
    eprintln!("chaining test took {:?}", started.elapsed());
}
