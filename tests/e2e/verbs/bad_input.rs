//! Bad input, table-driven: every case runs the real `tether` plugin against
//! a real `tetherd`, asserts the exact CNI error code, and asserts that
//! nothing changed: the daemon's attachments and pools (admin API), the node
//! netns's links and routes, the target pod netns, and the state dir are the
//! same before and after. Every failing case is reported, not only the
//! first. Run as root.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use tether_e2e::{
    cni, require_root, tether_bin, unique_name, CniEnv, CniOutput, Daemon, DaemonOpts, Family,
    Netns, TempDir,
};

use super::paths_under;

/// The network the fixture's attachment and most cases use.
const NET: &str = "badnet";
/// The container id every ADD case tries; never successfully added.
const CID: &str = "bad-input";
/// The container id of the attachment that exists during the whole table.
const KEPT: &str = "keeper";
/// A link the test puts into the target pod netns before the table runs.
const DUMMY: &str = "eth1";
/// Its peer, when it has to be a veth.
const DUMMY_PEER: &str = "eth1peer";

/// One invocation: environment and stdin.
struct Input {
    env: CniEnv,
    stdin: Vec<u8>,
}

/// What every case can build on.
struct Fx {
    daemon: Daemon,
    /// The netns of the attachment `KEPT`.
    kept: Netns,
    kept_result: Value,
    /// The netns ADD cases target; holds `lo` and the dummy `DUMMY`.
    pod: Netns,
    /// Holds `file`, a regular file that is not a netns.
    files: TempDir,
    file: PathBuf,
}

impl Fx {
    fn conf(&self, version: &str) -> Value {
        self.daemon.netconf(version, NET)
    }

    /// ADD of `CID` in the target pod with a 1.1.0 netconf edited by `edit`.
    fn add(&self, edit: impl FnOnce(&mut Value)) -> Input {
        let mut conf = self.conf("1.1.0");
        edit(&mut conf);
        Input {
            env: CniEnv::new("ADD", CID, &self.pod),
            stdin: to_vec(&conf),
        }
    }

    /// ADD of `CID` with these stdin bytes.
    fn add_raw(&self, stdin: &[u8]) -> Input {
        Input {
            env: CniEnv::new("ADD", CID, &self.pod),
            stdin: stdin.to_vec(),
        }
    }

    /// ADD of `CID` with a valid netconf and the environment edited.
    fn add_env(&self, edit: impl FnOnce(&mut CniEnv)) -> Input {
        let mut input = self.add(|_| {});
        edit(&mut input.env);
        input
    }

    /// `verb` on the kept attachment, netconf in `version` with the kept
    /// attachment's ADD result as prevResult, edited by `edit`.
    fn kept(&self, verb: &str, version: &str, edit: impl FnOnce(&mut Value)) -> Input {
        let mut conf = self.conf(version);
        conf["prevResult"] = self.kept_result.clone();
        edit(&mut conf);
        Input {
            env: CniEnv::new(verb, KEPT, &self.kept),
            stdin: to_vec(&conf),
        }
    }

    /// A network-wide verb (GC, STATUS) with a netconf in `version` whose
    /// valid-attachments list the kept attachment (so that a GC that wrongly
    /// runs still changes nothing), edited by `edit`.
    fn network(&self, verb: &str, version: &str, edit: impl FnOnce(&mut Value)) -> Input {
        let mut conf = self.conf(version);
        conf["cni.dev/valid-attachments"] = json!([{"containerID": KEPT, "ifname": "eth0"}]);
        edit(&mut conf);
        let mut env = CniEnv::new(verb, CID, &self.pod);
        env.container_id = None;
        env.netns = None;
        env.ifname = None;
        Input {
            env,
            stdin: to_vec(&conf),
        }
    }

    fn file(&self) -> String {
        self.file.display().to_string()
    }

    fn dir(&self) -> String {
        self.files.path().display().to_string()
    }
}

fn to_vec(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).expect("JSON serializes")
}

fn remove(conf: &mut Value, key: &str) {
    conf.as_object_mut().expect("netconf object").remove(key);
}

/// A netconf over 1 MiB that is otherwise valid.
fn oversized() -> Vec<u8> {
    let mut conf = json!({"cniVersion": "1.1.0", "name": NET, "type": "tether"});
    conf["padding"] = json!("x".repeat((1 << 20) + 16));
    to_vec(&conf)
}

/// One row: a name, the exact code, and how to build the input; for a field
/// of the wrong type or value, also the field its message must name.
struct Case {
    name: &'static str,
    code: u64,
    field: Option<&'static str>,
    build: fn(&Fx) -> Input,
}

const fn case(name: &'static str, code: u64, build: fn(&Fx) -> Input) -> Case {
    Case {
        name,
        code,
        field: None,
        build,
    }
}

/// A configuration field that decoded but is invalid: code 7, and the error
/// names `field` (never a quiet fallback to a default).
const fn field(name: &'static str, field: &'static str, build: fn(&Fx) -> Input) -> Case {
    Case {
        name,
        code: 7,
        field: Some(field),
        build,
    }
}

#[rustfmt::skip]
const CASES: &[Case] = &[
    // stdin
    case("empty stdin", 6, |fx| fx.add_raw(b"")),
    case("whitespace-only stdin", 6, |fx| fx.add_raw(b" \n\t")),
    case("malformed JSON", 6, |fx| fx.add_raw(br#"{"cniVersion": "1.1.0", "name": "#)),
    case("trailing garbage after JSON", 6, |fx| fx.add_raw(br#"{"cniVersion":"1.1.0","name":"badnet","type":"tether"} x"#)),
    case("stdin not UTF-8", 6, |fx| fx.add_raw(b"{\"cniVersion\":\"1.1.0\",\"name\":\"\xff\xfe\",\"type\":\"tether\"}")),
    case("stdin over 1 MiB", 7, |fx| fx.add_raw(&oversized())),
    case("JSON array", 6, |fx| fx.add_raw(b"[1, 2]")),
    case("JSON string", 6, |fx| fx.add_raw(br#""tether""#)),
    case("JSON null", 6, |fx| fx.add_raw(b"null")),
    case("JSON number", 6, |fx| fx.add_raw(b"42")),
    // cniVersion
    case("missing cniVersion", 7, |fx| fx.add(|c| remove(c, "cniVersion"))),
    case("null cniVersion", 7, |fx| fx.add(|c| c["cniVersion"] = Value::Null)),
    case("unsupported cniVersion 0.2.0", 1, |fx| fx.add(|c| c["cniVersion"] = json!("0.2.0"))),
    case("unsupported cniVersion 1.2.0", 1, |fx| fx.add(|c| c["cniVersion"] = json!("1.2.0"))),
    case("empty cniVersion", 1, |fx| fx.add(|c| c["cniVersion"] = json!(""))),
    field("cniVersion a number", "cniVersion", |fx| fx.add(|c| c["cniVersion"] = json!(1.0))),
    field("cniVersion an object", "cniVersion", |fx| fx.add(|c| c["cniVersion"] = json!({"v": "1.1.0"}))),
    // name and type
    case("missing name", 7, |fx| fx.add(|c| remove(c, "name"))),
    case("name with a space", 7, |fx| fx.add(|c| c["name"] = json!("bad net"))),
    case("name starting with a dash", 7, |fx| fx.add(|c| c["name"] = json!("-badnet"))),
    case("name with a slash", 7, |fx| fx.add(|c| c["name"] = json!("bad/net"))),
    case("empty name", 7, |fx| fx.add(|c| c["name"] = json!(""))),
    field("name a number", "name", |fx| fx.add(|c| c["name"] = json!(5))),
    case("missing type", 7, |fx| fx.add(|c| remove(c, "type"))),
    case("type with a slash", 7, |fx| fx.add(|c| c["type"] = json!("../tether"))),
    // unsupported and mistyped fields
    case("ipam section", 2, |fx| fx.add(|c| c["ipam"] = json!({"type": "host-local", "subnet": "10.9.0.0/24"}))),
    case("empty ipam section", 2, |fx| fx.add(|c| c["ipam"] = json!({}))),
    field("mtu a string", "mtu", |fx| fx.add(|c| c["mtu"] = json!("1500"))),
    field("mtu fractional", "mtu", |fx| fx.add(|c| c["mtu"] = json!(1500.5))),
    field("mtu a boolean", "mtu", |fx| fx.add(|c| c["mtu"] = json!(true))),
    case("mtu below 576", 7, |fx| fx.add(|c| c["mtu"] = json!(575))),
    case("mtu zero", 7, |fx| fx.add(|c| c["mtu"] = json!(0))),
    case("mtu above 65535", 7, |fx| fx.add(|c| c["mtu"] = json!(65536))),
    case("mtu negative", 7, |fx| fx.add(|c| c["mtu"] = json!(-1))),
    field("dns a string", "dns", |fx| fx.add(|c| c["dns"] = json!("10.0.0.10"))),
    field("dns nameservers not strings", "dns", |fx| fx.add(|c| c["dns"] = json!({"nameservers": [1]}))),
    field("runtimeConfig a string", "runtimeConfig", |fx| fx.add(|c| c["runtimeConfig"] = json!("x"))),
    field("runtimeConfig a list", "runtimeConfig", |fx| fx.add(|c| c["runtimeConfig"] = json!([]))),
    field("runtimeConfig ips not a list", "runtimeConfig", |fx| fx.add(|c| c["runtimeConfig"] = json!({"ips": "10.77.0.9/32"}))),
    case("runtimeConfig ips entry not an IP", 7, |fx| fx.add(|c| c["runtimeConfig"] = json!({"ips": ["not-an-ip"]}))),
    case("runtimeConfig mac malformed", 7, |fx| fx.add(|c| c["runtimeConfig"] = json!({"mac": "zz:zz"}))),
    field("prevResult a string on ADD", "prevResult", |fx| fx.add(|c| c["prevResult"] = json!("x"))),
    field("prevResult ips not a list on ADD", "prevResult", |fx| fx.add(|c| c["prevResult"] = json!({"cniVersion": "1.1.0", "ips": "x"}))),
    // every field read, of the wrong type: the shim's own two first
    field("socket a number", "socket", |fx| fx.add(|c| c["socket"] = json!(123))),
    field("socket an object", "socket", |fx| fx.add(|c| c["socket"] = json!({"path": "/run/tether/tether.sock"}))),
    field("socket a relative path", "socket", |fx| fx.add(|c| c["socket"] = json!("tether.sock"))),
    field("socket empty", "socket", |fx| fx.add(|c| c["socket"] = json!(""))),
    field("cniVersion a list", "cniVersion", |fx| fx.add(|c| c["cniVersion"] = json!(["1.1.0"]))),
    field("cniVersion a boolean", "cniVersion", |fx| fx.add(|c| c["cniVersion"] = json!(true))),
    field("type a number", "type", |fx| fx.add(|c| c["type"] = json!(1))),
    field("type a list", "type", |fx| fx.add(|c| c["type"] = json!(["tether"]))),
    field("name a list", "name", |fx| fx.add(|c| c["name"] = json!([NET]))),
    field("mtu a list", "mtu", |fx| fx.add(|c| c["mtu"] = json!([1500]))),
    field("dns domain a number", "dns", |fx| fx.add(|c| c["dns"] = json!({"domain": 3}))),
    field("dns search a string", "dns", |fx| fx.add(|c| c["dns"] = json!({"search": "svc.cluster.local"}))),
    field("runtimeConfig mac a number", "runtimeConfig", |fx| fx.add(|c| c["runtimeConfig"] = json!({"mac": 5}))),
    field("runtimeConfig ips entry a number", "runtimeConfig", |fx| fx.add(|c| c["runtimeConfig"] = json!({"ips": [5]}))),
    field("runtimeConfig pod annotations a list", "runtimeConfig", |fx| fx.add(|c| c["runtimeConfig"] = json!({"io.kubernetes.cri.pod-annotations": []}))),
    field("runtimeConfig pod annotation value a number", "runtimeConfig", |fx| fx.add(|c| c["runtimeConfig"] = json!({"io.kubernetes.cri.pod-annotations": {"kubevirt.io/domain": 1}}))),
    field("vmAddressPolicy a number", "vmAddressPolicy", |fx| fx.add(|c| c["vmAddressPolicy"] = json!(1))),
    field("prevResult interfaces a map on ADD", "prevResult", |fx| fx.add(|c| c["prevResult"] = json!({"cniVersion": "1.1.0", "interfaces": {}}))),
    // CNI_COMMAND
    // (Unset or empty, it is no error: the about text, tested below.)
    case("unknown CNI_COMMAND", 4, |fx| fx.add_env(|e| e.command = Some("FROB".into()))),
    case("lower-case CNI_COMMAND", 4, |fx| fx.add_env(|e| e.command = Some("add".into()))),
    // CNI_CONTAINERID
    case("missing CNI_CONTAINERID", 4, |fx| fx.add_env(|e| e.container_id = None)),
    case("empty CNI_CONTAINERID", 4, |fx| fx.add_env(|e| e.container_id = Some(String::new()))),
    case("CNI_CONTAINERID with a space", 4, |fx| fx.add_env(|e| e.container_id = Some("bad input".into()))),
    case("CNI_CONTAINERID starting with a dash", 4, |fx| fx.add_env(|e| e.container_id = Some("-bad".into()))),
    case("CNI_CONTAINERID with a slash", 4, |fx| fx.add_env(|e| e.container_id = Some("../etc".into()))),
    case("CNI_CONTAINERID over 1024 bytes", 4, |fx| fx.add_env(|e| e.container_id = Some("a".repeat(1025)))),
    // CNI_NETNS
    case("missing CNI_NETNS on ADD", 4, |fx| fx.add_env(|e| e.netns = None)),
    case("empty CNI_NETNS on ADD", 4, |fx| fx.add_env(|e| e.netns = Some(String::new()))),
    case("relative CNI_NETNS", 4, |fx| fx.add_env(|e| e.netns = Some(format!("run/netns/{}", fx.pod.name())))),
    case("nonexistent CNI_NETNS", 4, |fx| fx.add_env(|e| e.netns = Some(format!("{}/absent", fx.dir())))),
    case("CNI_NETNS a regular file", 4, |fx| fx.add_env(|e| e.netns = Some(fx.file()))),
    case("CNI_NETNS a directory", 4, |fx| fx.add_env(|e| e.netns = Some(fx.dir()))),
    case("CNI_NETNS a mount namespace", 4, |fx| fx.add_env(|e| e.netns = Some("/proc/self/ns/mnt".into()))),
    // CNI_IFNAME
    case("missing CNI_IFNAME", 4, |fx| fx.add_env(|e| e.ifname = None)),
    case("empty CNI_IFNAME", 4, |fx| fx.add_env(|e| e.ifname = Some(String::new()))),
    case("CNI_IFNAME of 16 characters", 4, |fx| fx.add_env(|e| e.ifname = Some("abcdefghijklmnop".into()))),
    case("CNI_IFNAME with a slash", 4, |fx| fx.add_env(|e| e.ifname = Some("eth/0".into()))),
    case("CNI_IFNAME with a colon", 4, |fx| fx.add_env(|e| e.ifname = Some("eth0:1".into()))),
    case("CNI_IFNAME with a space", 4, |fx| fx.add_env(|e| e.ifname = Some("eth 0".into()))),
    case("CNI_IFNAME \"..\"", 4, |fx| fx.add_env(|e| e.ifname = Some("..".into()))),
    case("CNI_IFNAME taken by a dummy link", 102, |fx| fx.add_env(|e| e.ifname = Some(DUMMY.into()))),
    // CNI_ARGS
    case("CNI_ARGS without '='", 4, |fx| fx.add_env(|e| e.args = Some("foo".into()))),
    case("CNI_ARGS with an empty key", 4, |fx| fx.add_env(|e| e.args = Some("=bar".into()))),
    case("CNI_ARGS with an empty segment", 4, |fx| fx.add_env(|e| e.args = Some("K8S_POD_NAME=a;;K8S_POD_NAMESPACE=b".into()))),
    case("CNI_ARGS unknown key", 2, |fx| fx.add_env(|e| e.args = Some("FOO=bar".into()))),
    case("CNI_ARGS unknown key, IgnoreUnknown=0", 2, |fx| fx.add_env(|e| e.args = Some("IgnoreUnknown=0;FOO=bar".into()))),
    case("CNI_ARGS bad IgnoreUnknown value", 4, |fx| fx.add_env(|e| e.args = Some("IgnoreUnknown=maybe;FOO=bar".into()))),
    case("CNI_ARGS IP not an address", 4, |fx| fx.add_env(|e| e.args = Some("IgnoreUnknown=1;IP=not-an-ip".into()))),
case("CNI_ARGS IP outside the pod CIDRs", 106, |fx| fx.add_env(|e| e.args = Some("IgnoreUnknown=1;IP=10.88.0.5".into()))),
    case("CNI_ARGS IP two IPv4 addresses", 7, |fx| fx.add_env(|e| e.args = Some("IgnoreUnknown=1;IP=10.81.0.5,10.81.0.6".into()))),
    case("CNI_ARGS IP the pod CIDR's network address", 106, |fx| fx.add_env(|e| e.args = Some("IgnoreUnknown=1;IP=10.81.0.0".into()))),
    case("CNI_ARGS MAC multicast", 7, |fx| fx.add_env(|e| e.args = Some("IgnoreUnknown=1;MAC=01:00:5e:00:00:05".into()))),
    case("runtimeConfig ips outside the pod CIDRs", 106, |fx| fx.add(|c| c["runtimeConfig"] = json!({"ips": ["10.88.0.5/24"]}))),
    case("runtimeConfig mac all zero", 7, |fx| fx.add(|c| c["runtimeConfig"] = json!({"mac": "00:00:00:00:00:00"}))),
    case("KubeVirt pod without K8S_POD_NAMESPACE", 4, |fx| fx.add(|c| c["runtimeConfig"] = json!({"io.kubernetes.cri.pod-annotations": {"kubevirt.io/domain": "vm1"}}))),
    field("vmAddressPolicy unknown", "vmAddressPolicy", |fx| fx.add(|c| c["vmAddressPolicy"] = json!("forever"))),
    case("CNI_ARGS MAC malformed", 4, |fx| fx.add_env(|e| e.args = Some("IgnoreUnknown=1;MAC=0a:58".into()))),
    // version gates
    case("CHECK with cniVersion 0.3.1", 1, |fx| fx.kept("CHECK", "0.3.1", |_| {})),
    case("CHECK with cniVersion 0.3.0", 1, |fx| fx.kept("CHECK", "0.3.0", |_| {})),
    case("GC with cniVersion 1.0.0", 1, |fx| fx.network("GC", "1.0.0", |_| {})),
    case("GC with cniVersion 0.4.0", 1, |fx| fx.network("GC", "0.4.0", |_| {})),
    case("STATUS with cniVersion 1.0.0", 1, |fx| fx.network("STATUS", "1.0.0", |_| {})),
    // verb-specific configuration
    case("CHECK without prevResult", 7, |fx| fx.kept("CHECK", "1.1.0", |c| remove(c, "prevResult"))),
    field("CHECK with prevResult a string", "prevResult", |fx| fx.kept("CHECK", "1.1.0", |c| c["prevResult"] = json!("x"))),
    field("CHECK with prevResult interfaces malformed", "prevResult", |fx| fx.kept("CHECK", "1.1.0", |c| c["prevResult"]["interfaces"] = json!([{"name": 5}]))),
    field("CHECK with prevResult ips address malformed", "prevResult", |fx| fx.kept("CHECK", "1.1.0", |c| c["prevResult"]["ips"] = json!([{"address": "not-a-cidr"}]))),
    field("CHECK with runtimeConfig a string", "runtimeConfig", |fx| fx.kept("CHECK", "1.1.0", |c| c["runtimeConfig"] = json!("x"))),
    case("GC without valid-attachments", 7, |fx| fx.network("GC", "1.1.0", |c| remove(c, "cni.dev/valid-attachments"))),
    field("GC valid-attachments a string", "cni.dev/valid-attachments", |fx| fx.network("GC", "1.1.0", |c| c["cni.dev/valid-attachments"] = json!("keeper"))),
    case("GC valid-attachments entry without ifname", 7, |fx| fx.network("GC", "1.1.0", |c| c["cni.dev/valid-attachments"] = json!([{"containerID": KEPT}]))),
    field("GC with runtimeConfig a number", "runtimeConfig", |fx| fx.network("GC", "1.1.0", |c| c["runtimeConfig"] = json!(3))),
    // DEL validates its environment too (and must not release the kept one)
    case("DEL with CNI_CONTAINERID malformed", 4, |fx| { let mut i = fx.kept("DEL", "1.1.0", |_| {}); i.env.container_id = Some("keeper/..".into()); i }),
    case("DEL with relative CNI_NETNS", 4, |fx| { let mut i = fx.kept("DEL", "1.1.0", |_| {}); i.env.netns = Some("kept".into()); i }),
    case("DEL with unknown CNI_ARGS key", 2, |fx| { let mut i = fx.kept("DEL", "1.1.0", |_| {}); i.env.args = Some("FOO=bar".into()); i }),
    case("DEL with an ipam section", 2, |fx| fx.kept("DEL", "1.1.0", |c| c["ipam"] = json!({"type": "host-local"}))),
    // a DEL with a socket of the wrong type neither reaches the daemon nor
    // queues (the state dir snapshot would show it)
    field("DEL with socket a number", "socket", |fx| fx.kept("DEL", "1.1.0", |c| c["socket"] = json!(123))),
    field("DEL with socket a boolean", "socket", |fx| fx.kept("DEL", "1.1.0", |c| c["socket"] = json!(false))),
    field("STATUS with socket a number", "socket", |fx| fx.network("STATUS", "1.1.0", |c| c["socket"] = json!(123))),
    field("CHECK with cniVersion a number", "cniVersion", |fx| fx.kept("CHECK", "1.1.0", |c| c["cniVersion"] = json!(1.1))),
    field("GC legacy attachments a string", "cni.dev/attachments", |fx| fx.network("GC", "1.1.0", |c| { remove(c, "cni.dev/valid-attachments"); c["cni.dev/attachments"] = json!("keeper") })),
];

// ---------------------------------------------------------------------------
// What must not change

#[derive(Debug, PartialEq)]
struct Snapshot {
    attachments: Vec<String>,
    pools: Vec<String>,
    node_links: Vec<Value>,
    node_routes: Vec<Value>,
    pod_links: Vec<Value>,
    pod_addrs: Vec<Value>,
    state_files: BTreeSet<String>,
}

impl Snapshot {
    fn take(fx: &Fx) -> Snapshot {
        let node = fx.daemon.node_info();
        let mut attachments: Vec<String> = fx
            .daemon
            .attachments()
            .iter()
            .map(|a| format!("{a:?}"))
            .collect();
        attachments.sort();
        let mut node_routes = fx.daemon.node().routes(Family::V4);
        node_routes.extend(fx.daemon.node().routes(Family::V6));
        Snapshot {
            attachments,
            pools: node
                .pools
                .iter()
                .map(|p| format!("{} used {} free {}", p.cidr, p.used, p.free))
                .collect(),
            node_links: fx.daemon.node().links(),
            node_routes,
            pod_links: fx.pod.links(),
            pod_addrs: fx.pod.addrs(),
            state_files: files_under(fx.daemon.state_dir()),
        }
    }

    /// The names of the fields that differ.
    fn diff(&self, after: &Snapshot) -> Vec<String> {
        let mut out = Vec::new();
        let mut field = |name: &str, a: String, b: String| {
            if a != b {
                out.push(format!("{name}:\n    before: {a}\n    after:  {b}"));
            }
        };
        field(
            "attachments",
            format!("{:?}", self.attachments),
            format!("{:?}", after.attachments),
        );
        field(
            "pools",
            format!("{:?}", self.pools),
            format!("{:?}", after.pools),
        );
        field(
            "node links",
            format!("{:?}", self.node_links),
            format!("{:?}", after.node_links),
        );
        field(
            "node routes",
            format!("{:?}", self.node_routes),
            format!("{:?}", after.node_routes),
        );
        field(
            "pod links",
            format!("{:?}", self.pod_links),
            format!("{:?}", after.pod_links),
        );
        field(
            "pod addresses",
            format!("{:?}", self.pod_addrs),
            format!("{:?}", after.pod_addrs),
        );
        field(
            "state dir",
            format!("{:?}", self.state_files),
            format!("{:?}", after.state_files),
        );
        out
    }
}

/// Every path under `dir`, relative to it.
fn files_under(dir: &Path) -> BTreeSet<String> {
    paths_under(dir).into_iter().map(|(rel, _)| rel).collect()
}

// ---------------------------------------------------------------------------

fn fixture() -> Fx {
    let daemon = Daemon::start(DaemonOpts {
        pod_cidrs: vec!["10.81.0.0/24".into(), "fd00:81::/120".into()],
        ..DaemonOpts::default()
    });
    let kept = Netns::new("kept");
    let conf = daemon.netconf("1.1.0", NET);
    let out = cni(
        &tether_bin(),
        &CniEnv::new("ADD", KEPT, &kept),
        &to_vec(&conf),
    );
    let kept_result = out.result().clone();

    let pod = Netns::new("pod");
    // A dummy link when the kernel has the module; this machine's kernel
    // has none, so a veth pair with both ends in the pod does instead.
    let dummy = pod.exec(&["ip", "link", "add", DUMMY, "type", "dummy"]);
    if !dummy.status.success() {
        pod.exec_ok(&[
            "ip", "link", "add", DUMMY, "type", "veth", "peer", "name", DUMMY_PEER,
        ]);
    }
    let files = TempDir::new("bad");
    let file = files.path().join(unique_name("notns"));
    std::fs::write(&file, b"not a network namespace\n").expect("writing a plain file");
    Fx {
        daemon,
        kept,
        kept_result,
        pod,
        files,
        file,
    }
}

fn describe(out: &CniOutput) -> String {
    format!("exit {}, stdout {}", out.status, out.stdout.trim())
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn bad_input_is_refused_with_the_exact_code_and_changes_nothing() {
    require_root();
    let fx = fixture();
    let dummy_before = fx.pod.ip_json(&["link", "show", "dev", DUMMY]);

    let names: BTreeSet<&str> = CASES.iter().map(|c| c.name).collect();
    assert_eq!(names.len(), CASES.len(), "case names are unique");

    let mut failures = Vec::new();
    for case in CASES {
        let input = (case.build)(&fx);
        let before = Snapshot::take(&fx);
        let out = cni(&tether_bin(), &input.env, &input.stdin);
        let after = Snapshot::take(&fx);

        let mut problems = Vec::new();
        match (out.error_code(), &out.json) {
            (Some(code), Some(err)) if code == case.code => {
                if let Some(field) = case.field {
                    let text = format!("{} {}", err["msg"], err["details"]);
                    if !text.contains(field) {
                        problems.push(format!("the error does not name {field:?}: {text}"));
                    }
                }
                if out.status != 1 {
                    problems.push(format!("exit status {} instead of 1", out.status));
                }
                if !err["msg"].is_string() || !err["cniVersion"].is_string() {
                    problems.push(format!("not a CNI error object: {}", out.stdout.trim()));
                }
            }
            (code, _) => problems.push(format!(
                "expected code {}, got {code:?} ({})",
                case.code,
                describe(&out)
            )),
        }
        problems.extend(before.diff(&after));
        eprintln!(
            "case {:<48} want {:>3} got {:?}{}",
            case.name,
            case.code,
            out.error_code(),
            if problems.is_empty() {
                ""
            } else {
                "  <-- FAILED"
            }
        );
        if !problems.is_empty() {
            failures.push(format!("- {}:\n  {}", case.name, problems.join("\n  ")));
        }
    }

    // The dummy link the 102 case collided with is untouched.
    assert_eq!(
        fx.pod.ip_json(&["link", "show", "dev", DUMMY]),
        dummy_before,
        "the dummy {DUMMY} changed"
    );
    // The kept attachment survived the whole table.
    let mut check = fx.conf("1.1.0");
    check["prevResult"] = fx.kept_result.clone();
    let out = cni(
        &tether_bin(),
        &CniEnv::new("CHECK", KEPT, &fx.kept),
        &to_vec(&check),
    );
    assert!(
        out.success(),
        "CHECK of the kept attachment after the table: {out}"
    );

    assert!(
        failures.is_empty(),
        "{} of {} bad-input cases failed:\n{}",
        failures.len(),
        CASES.len(),
        failures.join("\n")
    );
}

/// Without CNI_COMMAND, or with an empty one, `tether` is being run by a
/// person (`tether`, `tether --help`): it prints the reference plugins'
/// about text on stderr, exits 0, reads no stdin, and never reaches the
/// daemon, so nothing changes.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn without_cni_command_tether_says_what_it_is_and_changes_nothing() {
    require_root();
    let fx = fixture();
    let about = format!(
        "CNI tether plugin version {}\nCNI protocol versions supported: 0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0\n",
        env!("CARGO_PKG_VERSION")
    );
    let unset = fx.add_env(|e| e.command = None);
    let empty = fx.add_env(|e| e.command = Some(String::new()));
    for (what, input) in [("unset", unset), ("empty", empty)] {
        let before = Snapshot::take(&fx);
        let out = cni(&tether_bin(), &input.env, &input.stdin);
        let after = Snapshot::take(&fx);
        assert_eq!(out.status, 0, "CNI_COMMAND {what}: {out}");
        assert_eq!(out.stderr, about, "CNI_COMMAND {what}");
        assert_eq!(out.stdout, "", "CNI_COMMAND {what}");
        let changed = before.diff(&after);
        assert!(changed.is_empty(), "CNI_COMMAND {what}: {changed:?}");
    }
    let help = std::process::Command::new(tether_bin())
        .arg("--help")
        .env_clear()
        .output()
        .expect("running tether --help");
    assert!(help.status.success(), "{help:?}");
    assert_eq!(String::from_utf8_lossy(&help.stderr), about);
    assert!(help.stdout.is_empty());
}

/// A typo in a top-level netconf key is no error (the spec lets a plugin
/// ignore what it does not know), but it is not silent either: the daemon
/// warns once per network, naming the key and the one probably meant, and
/// the pod gets what the netconf says without the misspelt key.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn unknown_netconf_keys_are_accepted_and_warned_once_per_network() {
    require_root();
    let daemon = Daemon::start(DaemonOpts {
        pod_cidrs: vec!["10.82.0.0/24".into()],
        ..DaemonOpts::default()
    });
    const WARNING: &str = "netconf keys tether does not know, ignored";
    let typo = |network: &str| {
        let mut conf = daemon.netconf("1.1.0", network);
        conf["mut"] = json!(1400);
        conf["sokcet"] = json!("/run/tether/tether.sock");
        conf
    };
    let pods: Vec<Netns> = (0..3).map(|i| Netns::new(&format!("uk{i}"))).collect();
    // Two ADDs and a CHECK on one network, as a runtime sends them.
    for (i, pod) in pods[..2].iter().enumerate() {
        let out = cni(
            &tether_bin(),
            &CniEnv::new("ADD", &format!("uk-{i}"), pod),
            &to_vec(&typo("typos")),
        );
        out.assert_success();
        // "mut" is not "mtu": the pod has the daemon's MTU.
        let mtu = pod.ip_json(&["link", "show", "dev", "eth0"])[0]["mtu"].clone();
        assert_eq!(mtu, json!(1500), "{}", pod.name());
    }
    let log = daemon.log();
    let warnings: Vec<&str> = log.lines().filter(|l| l.contains(WARNING)).collect();
    assert_eq!(warnings.len(), 1, "{warnings:#?}");
    for needle in [
        "network=typos",
        r#""mut" (did you mean mtu?)"#,
        r#""sokcet" (did you mean socket?)"#,
    ] {
        assert!(warnings[0].contains(needle), "{needle}: {}", warnings[0]);
    }
    // Another network with the same typos is warned about in its turn.
    cni(
        &tether_bin(),
        &CniEnv::new("ADD", "uk-2", &pods[2]),
        &to_vec(&typo("typos2")),
    )
    .assert_success();
    let log = daemon.log();
    let warnings: Vec<&str> = log.lines().filter(|l| l.contains(WARNING)).collect();
    assert_eq!(warnings.len(), 2, "{warnings:#?}");
    assert!(warnings[1].contains("network=typos2"), "{}", warnings[1]);
    // A netconf without unknown keys is never warned about.
    assert!(!log.contains(&format!("network={NET}")));
}
