//! The operator API on the daemon's socket: with grpcurl, exactly as the
//! book shows it (docs/user/operations.md: server reflection, no proto
//! files), and from Rust with
//! the generated `tether_proto` client over the unix socket. Run as root,
//! after `tests/setup.sh` (which builds grpcurl from its Go module, pinned in
//! tests/k8s/grpcurl/go.mod, and installs it as /usr/local/bin/grpcurl).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use tether_e2e::admin::{self, pb};
use tether_e2e::runtime::run_bounded;
use tether_e2e::{call, cni, require_root, tether_bin, CniEnv, Daemon, Netns};

const V4_CIDR: &str = "10.83.0.0/28";
const V6_CIDR: &str = "fd00:83::/120";

// ---------------------------------------------------------------------------
// grpcurl

/// The grpcurl executable: the one tests/setup.sh installs, else whatever
/// `grpcurl` is on PATH. Panics (the test fails, it does not skip) when there
/// is none.
fn grpcurl() -> PathBuf {
    let installed = PathBuf::from("/usr/local/bin/grpcurl");
    if is_executable(&installed) {
        return installed;
    }
    let on_path = Command::new("sh")
        .args(["-c", "command -v grpcurl"])
        .output();
    if let Ok(out) = on_path {
        let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if out.status.success() && is_executable(&path) {
            return path;
        }
    }
    panic!(
        "grpcurl not found (not at /usr/local/bin/grpcurl, not on PATH): run tests/setup.sh, \
         which builds it (tests/k8s/build.sh grpcurl)"
    );
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Runs `grpcurl -plaintext -unix <flags> SOCKET <rest>`; returns
/// (success, stdout, stderr).
fn grpcurl_raw(socket: &Path, flags: &[&str], rest: &[&str]) -> (bool, String, String) {
    let out = Command::new(grpcurl())
        .args(["-plaintext", "-max-time", "20", "-unix"])
        .args(flags)
        .arg(socket)
        .args(rest)
        .output()
        .expect("spawning grpcurl");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `grpcurl -plaintext -unix SOCKET <rest>`, which must succeed.
fn grpcurl_ok(socket: &Path, rest: &[&str]) -> String {
    let (ok, stdout, stderr) = grpcurl_raw(socket, &[], rest);
    assert!(ok, "grpcurl {rest:?} failed:\n{stdout}\n{stderr}");
    stdout
}

/// A unary call with `-emit-defaults`, so zero values are printed too.
fn call_json(socket: &Path, method: &str, request: Option<Value>) -> Value {
    let data = request.map(|r| r.to_string());
    let mut flags = vec!["-emit-defaults"];
    if let Some(data) = &data {
        flags.extend(["-d", data.as_str()]);
    }
    let (ok, out, err) = grpcurl_raw(socket, &flags, &[method]);
    assert!(ok, "grpcurl {method} failed:\n{out}\n{err}");
    serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("grpcurl {method}: not JSON ({e}):\n{out}"))
}

/// protojson prints 64-bit integers as strings.
fn as_u64(v: &Value) -> u64 {
    match v {
        Value::String(s) => s.parse().unwrap_or_else(|_| panic!("not a u64: {v}")),
        Value::Number(n) => n.as_u64().unwrap_or_else(|| panic!("not a u64: {v}")),
        _ => panic!("not a u64: {v}"),
    }
}

/// (used, free) per CIDR from a grpcurl GetNode answer.
fn pools_json(node: &Value) -> BTreeMap<String, (u64, u64)> {
    node["pools"]
        .as_array()
        .unwrap_or_else(|| panic!("no pools: {node}"))
        .iter()
        .map(|p| {
            (
                p["cidr"].as_str().expect("cidr").to_owned(),
                (as_u64(&p["used"]), as_u64(&p["free"])),
            )
        })
        .collect()
}

/// (ok, errors) per verb from a grpcurl Stats answer.
fn verbs_json(stats: &Value) -> BTreeMap<String, (u64, u64)> {
    stats["verbs"]
        .as_array()
        .unwrap_or_else(|| panic!("no verbs: {stats}"))
        .iter()
        .map(|v| {
            (
                v["verb"].as_str().expect("verb").to_owned(),
                (as_u64(&v["ok"]), as_u64(&v["errors"])),
            )
        })
        .collect()
}

// ---------------------------------------------------------------------------

/// `grpcurl list` shows tether's two services, health and reflection;
/// health says SERVING; `describe` works without proto files.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn grpcurl_lists_services_through_reflection() {
    require_root();
    let daemon = Daemon::with_cidrs(&[V4_CIDR, V6_CIDR], &[]);
    let socket = daemon.socket();
    let listed = grpcurl_ok(socket, &["list"]);
    let services: Vec<&str> = listed.lines().map(str::trim).collect();
    for want in [
        "tether.cni.v1.Cni",
        "tether.admin.v1.Admin",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    ] {
        assert!(services.contains(&want), "{want} not listed:\n{listed}");
    }

    let admin = grpcurl_ok(socket, &["describe", "tether.admin.v1.Admin"]);
    for rpc in ["GetNode", "ListAttachments", "GetAttachment", "Stats"] {
        assert!(admin.contains(&format!("rpc {rpc}")), "{rpc}:\n{admin}");
    }
    let cni_rpcs = grpcurl_ok(socket, &["describe", "tether.cni.v1.Cni"]);
    for rpc in ["Add", "Del", "Check", "Status", "Gc"] {
        assert!(
            cni_rpcs.contains(&format!("rpc {rpc}")),
            "{rpc}:\n{cni_rpcs}"
        );
    }

    let health = call_json(socket, "grpc.health.v1.Health/Check", None);
    assert_eq!(health["status"], "SERVING", "{health}");
    let health = call_json(
        socket,
        "grpc.health.v1.Health/Check",
        Some(json!({"service": "tether.admin.v1.Admin"})),
    );
    assert_eq!(health["status"], "SERVING", "{health}");
}

/// grpcurl exactly as an operator types it: `-plaintext -unix SOCKET`, no
/// `-authority` or any other flag. On a unix socket grpcurl picks the HTTP/2
/// `:authority` itself, and the daemon's HTTP/2 server (h2) resets every
/// stream whose authority it cannot parse: grpcurl 1.8.6 sent the socket
/// path and got "stream terminated by RST_STREAM with error code:
/// PROTOCOL_ERROR". Later grpcurl sends "localhost", which the daemon serves
/// as it comes, with no rewriting of the headers. Fails if the grpcurl that
/// tests/setup.sh installs or the server stop agreeing on that.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn grpcurl_with_no_authority_flag_is_served() {
    require_root();
    let daemon = Daemon::with_cidrs(&[V4_CIDR, V6_CIDR], &[]);
    let socket = daemon.socket().display().to_string();
    let bin = grpcurl();
    let version = run_bounded(Command::new(&bin).arg("-version"), Duration::from_secs(10));
    let version = format!(
        "{}{}",
        String::from_utf8_lossy(&version.stdout),
        String::from_utf8_lossy(&version.stderr)
    );
    let run = |rest: &[&str]| -> String {
        let out = run_bounded(
            Command::new(&bin)
                .args(["-plaintext", "-unix", &socket])
                .args(rest),
            Duration::from_secs(30),
        );
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{} {rest:?} failed ({}):\n{stdout}\n{}",
            bin.display(),
            version.trim(),
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    };

    let listed = run(&["list"]);
    let services: Vec<&str> = listed.lines().map(str::trim).collect();
    for want in [
        "tether.admin.v1.Admin",
        "tether.cni.v1.Cni",
        "grpc.health.v1.Health",
    ] {
        assert!(services.contains(&want), "{want} not listed:\n{listed}");
    }

    let out = run(&["tether.admin.v1.Admin/GetNode"]);
    let node: Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("GetNode: not JSON ({e}):\n{out}"));
    assert_eq!(node["name"], daemon.node_name(), "{node}");
    assert_eq!(node["socket"], socket, "{node}");
    assert_eq!(node["storeBackend"], "local", "{node}");
}

/// GetNode, ListAttachments, GetAttachment and Stats through grpcurl,
/// before and after real CNI calls.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn grpcurl_shows_node_attachments_and_stats() {
    require_root();
    let daemon = Daemon::with_cidrs(&[V4_CIDR, V6_CIDR], &[]);
    let socket = daemon.socket();

    let node = call_json(socket, "tether.admin.v1.Admin/GetNode", None);
    assert_eq!(node["name"], daemon.node_name(), "{node}");
    assert_eq!(node["storeBackend"], "local", "{node}");
    let version = node["version"].as_str().unwrap_or("");
    assert!(
        !version.is_empty() && version.chars().next().is_some_and(|c| c.is_ascii_digit()),
        "version: {node}"
    );
    assert_eq!(node["socket"], socket.display().to_string(), "{node}");
    assert_eq!(node["mtu"], 1500, "{node}");
    // A /28 has 14 usable addresses; a /120 of IPv6 255 (not the ::0).
    let before = pools_json(&node);
    assert_eq!(before[V4_CIDR], (0, 14), "{node}");
    assert_eq!(before[V6_CIDR], (0, 255), "{node}");
    let stats = call_json(socket, "tether.admin.v1.Admin/Stats", None);
    for (verb, counts) in verbs_json(&stats) {
        assert_eq!(counts, (0, 0), "{verb} before any call: {stats}");
    }

    // Real calls: 2 ADD ok, 1 ADD error, 1 CHECK ok, 1 DEL ok, 1 STATUS
    // ok, 1 GC ok.
    let conf = daemon.netconf("1.1.0", "adm");
    let (pa, pb) = (Netns::new("pa"), Netns::new("pb"));
    let env = CniEnv {
        args: Some("K8S_POD_NAMESPACE=ns1;K8S_POD_NAME=web-0".into()),
        ..CniEnv::new("ADD", "adm-a", &pa)
    };
    let ra = cni(
        &tether_bin(),
        &env,
        &serde_json::to_vec(&conf).expect("JSON"),
    );
    let ra = ra.result().clone();
    let rb = call("ADD", &conf, "adm-b", Some(&pb)).result().clone();
    let mut bad = conf.clone();
    bad["ipam"] = json!({});
    assert_eq!(call("ADD", &bad, "adm-c", Some(&pb)).error_code(), Some(2));

    let node = call_json(socket, "tether.admin.v1.Admin/GetNode", None);
    let after_add = pools_json(&node);
    assert_eq!(after_add[V4_CIDR], (2, 12), "{node}");
    assert_eq!(after_add[V6_CIDR], (2, 253), "{node}");

    // ListAttachments and GetAttachment match the ADD results.
    let list = call_json(socket, "tether.admin.v1.Admin/ListAttachments", None);
    let attachments = list["attachments"].as_array().expect("attachments");
    assert_eq!(attachments.len(), 2, "{list}");
    for (cid, pod, result) in [("adm-a", &pa, &ra), ("adm-b", &pb, &rb)] {
        let listed = attachments
            .iter()
            .find(|a| a["containerId"] == cid)
            .unwrap_or_else(|| panic!("{cid} not listed: {list}"));
        let got = call_json(
            socket,
            "tether.admin.v1.Admin/GetAttachment",
            Some(json!({"container_id": cid, "ifname": "eth0"})),
        );
        assert_eq!(&got, listed, "GetAttachment equals the listed entry");
        assert_eq!(got["network"], "adm", "{got}");
        assert_eq!(got["ifname"], "eth0", "{got}");
        assert_eq!(got["netns"], pod.path().display().to_string(), "{got}");
        let ifs = result["interfaces"].as_array().expect("interfaces");
        assert_eq!(got["hostInterface"], ifs[0]["name"], "{got} vs {result}");
        assert_eq!(got["mac"], ifs[1]["mac"], "{got} vs {result}");
        let want_ips: Vec<Value> = result["ips"]
            .as_array()
            .expect("ips")
            .iter()
            .map(|i| i["address"].clone())
            .collect();
        assert_eq!(got["ips"], json!(want_ips), "{got} vs {result}");
        assert!(!got["created"].as_str().unwrap_or("").is_empty(), "{got}");
    }
    let a = call_json(
        socket,
        "tether.admin.v1.Admin/GetAttachment",
        Some(json!({"container_id": "adm-a", "ifname": "eth0", "network": "adm"})),
    );
    assert_eq!(a["podNamespace"], "ns1", "{a}");
    assert_eq!(a["podName"], "web-0", "{a}");

    // An unknown attachment is an error, not an empty answer.
    let (ok, stdout, stderr) = grpcurl_raw(
        socket,
        &["-d", r#"{"container_id":"nope","ifname":"eth0"}"#],
        &["tether.admin.v1.Admin/GetAttachment"],
    );
    assert!(!ok, "GetAttachment of an unknown one succeeded: {stdout}");
    assert!(stderr.contains("NotFound"), "{stderr}");

    let mut prev = conf.clone();
    prev["prevResult"] = ra.clone();
    assert!(call("CHECK", &prev, "adm-a", Some(&pa)).success());
    assert!(call("DEL", &conf, "adm-b", Some(&pb)).success());
    assert!(call("STATUS", &conf, "", None).success());
    let mut gc = conf.clone();
    gc["cni.dev/valid-attachments"] = json!([{"containerID": "adm-a", "ifname": "eth0"}]);
    assert!(call("GC", &gc, "", None).success());

    let node = call_json(socket, "tether.admin.v1.Admin/GetNode", None);
    let after_del = pools_json(&node);
    assert_eq!(after_del[V4_CIDR], (1, 13), "{node}");
    assert_eq!(after_del[V6_CIDR], (1, 254), "{node}");
    let list = call_json(socket, "tether.admin.v1.Admin/ListAttachments", None);
    assert_eq!(
        list["attachments"].as_array().map(Vec::len),
        Some(1),
        "{list}"
    );

    let stats = call_json(socket, "tether.admin.v1.Admin/Stats", None);
    let verbs = verbs_json(&stats);
    let want: BTreeMap<String, (u64, u64)> = [
        ("ADD", (2, 1)),
        ("DEL", (1, 0)),
        ("CHECK", (1, 0)),
        ("STATUS", (1, 0)),
        ("GC", (1, 0)),
    ]
    .into_iter()
    .map(|(v, c)| (v.to_owned(), c))
    .collect();
    assert_eq!(verbs, want, "{stats}");
    assert_eq!(as_u64(&stats["pendingDelQueue"]), 0, "{stats}");
}

/// The same API from Rust: the generated client over the unix socket (the
/// harness's, several calls on one connection).
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn rust_client_reads_the_admin_api() {
    require_root();
    let daemon = Daemon::with_cidrs(&[V4_CIDR, V6_CIDR], &[]);
    let conf = daemon.netconf("1.0.0", "adm-rs");
    let pod = Netns::new("pod");
    let result = call("ADD", &conf, "rs-a", Some(&pod)).result().clone();

    let (node, list, one, stats) = admin::with_client(daemon.socket(), |mut client| async move {
        let node = client.get_node(pb::GetNodeRequest {}).await;
        let list = client
            .list_attachments(pb::ListAttachmentsRequest {
                network: "adm-rs".into(),
            })
            .await;
        let one = client
            .get_attachment(pb::GetAttachmentRequest {
                container_id: "rs-a".into(),
                ifname: "eth0".into(),
                network: String::new(),
            })
            .await;
        let stats = client.stats(pb::StatsRequest::default()).await;
        (node, list, one, stats)
    });
    let node = node.expect("GetNode").into_inner();
    assert_eq!(node.name, daemon.node_name());
    assert_eq!(node.store_backend, "local");
    assert!(!node.version.is_empty());
    assert_eq!(node.mtu, 1500);
    assert!(
        Path::new(&node.store_location).starts_with(daemon.state_dir()),
        "the store is in the state dir: {node:?}"
    );
    let pools: BTreeMap<String, (u64, u64)> = node
        .pools
        .iter()
        .map(|p| (p.cidr.clone(), (p.used, p.free)))
        .collect();
    assert_eq!(pools[V4_CIDR], (1, 13), "{node:?}");
    assert_eq!(pools[V6_CIDR], (1, 254), "{node:?}");

    let list = list.expect("ListAttachments").into_inner().attachments;
    assert_eq!(list.len(), 1, "{list:?}");
    let one = one.expect("GetAttachment").into_inner();
    assert_eq!(list[0], one);
    assert_eq!(one.container_id, "rs-a");
    assert_eq!(one.netns, pod.path().display().to_string());
    assert_eq!(
        one.mac,
        result["interfaces"][1]["mac"].as_str().unwrap_or("")
    );
    assert_eq!(
        one.host_interface,
        result["interfaces"][0]["name"].as_str().unwrap_or("")
    );
    let stats = stats.expect("Stats").into_inner();
    let add = stats.verbs.iter().find(|v| v.verb == "ADD").expect("ADD");
    assert_eq!((add.ok, add.errors), (1, 0), "{stats:?}");
    // Its costs so far: a daemon that started, opened its journal and
    // wired a pod has spent CPU time; a single node makes no control-plane
    // requests and programs no routes to other nodes.
    let costs = stats.costs.expect("costs");
    assert!(
        costs.cpu_user_micros + costs.cpu_system_micros > 0,
        "{costs:?}"
    );
    assert_eq!(
        (costs.routes_changed, costs.watch_events),
        (0, 0),
        "{costs:?}"
    );
    // Brief: the same counters, no lists.
    let brief = admin::brief_stats(daemon.socket());
    assert_eq!(brief.verbs, stats.verbs);
    assert!(brief
        .costs
        .is_some_and(|c| c.cpu_user_micros >= costs.cpu_user_micros));

    // Filtering by another network finds nothing.
    let other = admin::with_client(daemon.socket(), |mut client| async move {
        client
            .list_attachments(pb::ListAttachmentsRequest {
                network: "not-this-one".into(),
            })
            .await
    });
    assert!(other
        .expect("ListAttachments")
        .into_inner()
        .attachments
        .is_empty());
}
