//! Unit tests of the node on the fake kernel ([`tether_kernel::fake`]), a
//! real local store and a real embedded control store in a temporary
//! directory. No root, no netlink: what these prove is the order and the
//! bookkeeping of the lifecycle; the root suites prove the kernel side.

// Parts of the harness serve only some of the test modules.
#![allow(dead_code)]

mod attach;
mod guest;
pub(crate) mod pools;
mod routes;
mod vm;

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;
use serde_json::{json, Value};
use tether_proto::cni::v1::CniRequest;

use super::{Node, NodeConfig, Reconciled};
use crate::vm::{VmRegistry, DOMAIN_ANNOTATION, MIGRATION_JOB_ANNOTATION};
use tether_base::error::Result;
use tether_cni::{parse_request, Invocation};
use tether_kernel::fake::{FakeHost, FakeKernel};
use tether_store::control::embedded::EmbeddedStore;
use tether_store::control::ControlStore;
use tether_store::store::{Attachment, AttachmentKey, Fsync, LocalStore, Store, StoreError};

// Every CNI_* variable, as set by a well-behaved runtime.
use tether_proto::cni::FORWARDED_VARIABLES as VARS;

/// One node on the fake kernel. The control store may be shared with
/// other nodes (a migration's two nodes).
pub(crate) struct TestNode {
    pub name: String,
    pub kernel: FakeKernel,
    pub host: Arc<FakeHost>,
    pub dir: tempfile::TempDir,
    pub control: Arc<dyn ControlStore>,
    pub store: Arc<dyn Store>,
    pub node: Arc<Node>,
    pub cidrs: Vec<IpNet>,
    pub pools: Vec<crate::pools::PoolDef>,
}

/// What a test may vary about a node.
#[derive(Clone)]
pub(crate) struct Options {
    pub name: String,
    pub cidrs: Vec<IpNet>,
    /// Shared with another node; a fresh embedded store if `None`.
    pub control: Option<Arc<dyn ControlStore>>,
    /// Whether the VM tasks (announcement listener, route sync) run.
    pub vm_tasks: bool,
    /// Failures to inject into the local store ([`FlakyStore`]); a
    /// restarted node's store is reliable again.
    pub store_faults: Option<Arc<StoreFaults>>,
    /// Named pools (`--pools`).
    pub pools: Vec<crate::pools::PoolDef>,
    /// The other nodes, as the route manager learns them.
    pub peers: Option<Arc<dyn crate::cluster::Peers>>,
    /// `--mtu`.
    pub mtu: Option<u32>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            name: "node-a".into(),
            cidrs: vec![net("10.1.0.0/24"), net("fd00:1::/120")],
            control: None,
            vm_tasks: true,
            store_faults: None,
            pools: Vec::new(),
            peers: None,
            mtu: None,
        }
    }
}

pub(crate) fn net(s: &str) -> IpNet {
    s.parse().expect("test CIDR")
}

pub(crate) fn ip(s: &str) -> IpAddr {
    s.parse().expect("test address")
}

impl TestNode {
    /// A node with the default options.
    pub async fn new() -> TestNode {
        Self::with(Options::default()).await
    }

    /// A node with `opts`.
    pub async fn with(opts: Options) -> TestNode {
        let dir = tempfile::tempdir().expect("tempdir");
        let control: Arc<dyn ControlStore> = match opts.control.clone() {
            Some(c) => c,
            None => {
                // The embedded store writes its file into an existing dir.
                let path = dir.path().join("control");
                std::fs::create_dir_all(&path).expect("control dir");
                Arc::new(EmbeddedStore::open(&path).expect("control"))
            }
        };
        let parts = Parts {
            kernel: FakeKernel::new(),
            host: Arc::new(FakeHost::new()),
            dir,
            control,
        };
        let (node, _) = parts.start(opts).await.expect("open the node");
        node
    }

    /// Stops this node and opens it again on the same kernel, host, state
    /// dir and control store, as after a daemon crash; `before` runs while
    /// no daemon is up (to change the kernel or the store under it).
    pub async fn restart(self, before: impl FnOnce(&TestNode)) -> Result<(TestNode, Reconciled)> {
        let opts = Options {
            name: self.name.clone(),
            cidrs: self.cidrs.clone(),
            control: Some(self.control.clone()),
            vm_tasks: true,
            store_faults: None,
            pools: self.pools.clone(),
            peers: None,
            mtu: None,
        };
        before(&self);
        let TestNode {
            kernel,
            host,
            dir,
            control,
            node,
            store,
            ..
        } = self;
        drop(node);
        drop(store);
        Parts {
            kernel,
            host,
            dir,
            control,
        }
        .start(opts)
        .await
    }

    /// A pod netns that exists in the fake kernel.
    pub fn netns(&self, pod: &str) -> PathBuf {
        let path = PathBuf::from(format!("/run/netns/{}-{pod}", self.name));
        self.kernel.add_netns(&path);
        path
    }

    /// ADD of container `cid` (ifname eth0) in netns `pod`.
    pub async fn add(&self, cid: &str, pod: &str) -> Result<Value> {
        let inv = self.inv(Call::new("ADD", cid).netns(&self.netns(pod)));
        self.node.add(&inv).await.map(|b| parse_json(&b))
    }

    /// DEL of container `cid` (ifname eth0).
    pub async fn del(&self, cid: &str) -> Result<()> {
        let inv = self.inv(Call::new("DEL", cid));
        self.node.del(&inv, None).await.map(|_| ())
    }

    /// Parses a call into an invocation, as the CNI service does.
    pub fn inv(&self, call: Call) -> Invocation {
        parse_request(&call.request()).expect("a valid test request")
    }

    /// Waits until `cond` holds (background work: link deletion, the VM
    /// sync), for at most 5 s.
    pub async fn eventually(&self, what: &str, cond: impl Fn(&TestNode) -> bool) {
        for _ in 0..500 {
            if cond(self) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("timed out waiting for: {what}");
    }
}

/// What outlives a node's daemon: its kernel, host, state dir and control
/// store.
struct Parts {
    kernel: FakeKernel,
    host: Arc<FakeHost>,
    dir: tempfile::TempDir,
    control: Arc<dyn ControlStore>,
}

impl Parts {
    /// Opens the store and the node on these parts, as the daemon's start
    /// does, and starts its background tasks if `opts` asks.
    async fn start(self, opts: Options) -> Result<(TestNode, Reconciled)> {
        let store = LocalStore::open(&self.dir.path().join("state"), Fsync::Always)
            .expect("store")
            .into_arc();
        let store = match &opts.store_faults {
            Some(faults) => FlakyStore::wrap(store, faults.clone()),
            None => store,
        };
        let config = NodeConfig {
            name: opts.name.clone(),
            pod_cidrs: opts.cidrs.clone(),
            mtu: opts.mtu,
            state_dir: self.dir.path().join("state"),
            allowed_uids: Vec::new(),
            pools: opts.pools.clone(),
        };
        let vms = VmRegistry::open(self.control.clone(), "/tether").await?;
        let (node, reconciled) = Node::open(
            config,
            store.clone(),
            None,
            opts.peers.clone(),
            vms,
            Arc::new(self.kernel.clone()),
            self.host.clone(),
        )
        .await?;
        let node = Arc::new(node);
        if opts.vm_tasks {
            node.start_vm_tasks();
        }
        let t = TestNode {
            name: opts.name,
            kernel: self.kernel,
            host: self.host,
            dir: self.dir,
            control: self.control,
            store,
            node,
            cidrs: opts.cidrs,
            pools: opts.pools,
        };
        Ok((t, reconciled))
    }
}

fn parse_json(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).expect("the daemon's result is JSON")
}

/// One CNI call, built up by a test.
#[derive(Clone)]
pub(crate) struct Call {
    command: String,
    cid: String,
    netns: String,
    ifname: String,
    args: String,
    conf: Value,
}

impl Call {
    /// `command` for container `cid` on network "tether", eth0, pod
    /// default/web-`cid`.
    pub fn new(command: &str, cid: &str) -> Call {
        Call {
            command: command.into(),
            cid: cid.into(),
            netns: String::new(),
            ifname: "eth0".into(),
            args: format!(
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-{cid};K8S_POD_UID=uid-{cid}"
            ),
            conf: json!({"cniVersion": "1.1.0", "name": "tether", "type": "tether"}),
        }
    }

    /// The same call as another verb.
    pub fn command(mut self, command: &str) -> Call {
        self.command = command.into();
        self
    }

    pub fn netns(mut self, path: &std::path::Path) -> Call {
        self.netns = path.display().to_string();
        self
    }

    pub fn ifname(mut self, ifname: &str) -> Call {
        self.ifname = ifname.into();
        self
    }

    /// Appends `;key=value` to CNI_ARGS.
    pub fn arg(mut self, key: &str, value: &str) -> Call {
        self.args.push_str(&format!(";{key}={value}"));
        self
    }

    /// Sets a top-level netconf field.
    pub fn conf(mut self, key: &str, value: Value) -> Call {
        self.conf[key] = value;
        self
    }

    /// Sets a pod annotation (runtimeConfig).
    pub fn annotation(mut self, key: &str, value: &str) -> Call {
        self.conf["runtimeConfig"][tether_cni::config::POD_ANNOTATIONS_KEY][key] = json!(value);
        self
    }

    /// The pod of KubeVirt VM `vm` in namespace default.
    pub fn vm(self, vm: &str) -> Call {
        self.annotation(DOMAIN_ANNOTATION, vm)
    }

    /// A migration's target pod.
    pub fn target(self) -> Call {
        self.annotation(MIGRATION_JOB_ANNOTATION, "job-1")
    }

    pub fn request(&self) -> CniRequest {
        CniRequest {
            command: self.command.clone(),
            container_id: self.cid.clone(),
            netns: self.netns.clone(),
            ifname: self.ifname.clone(),
            args: self.args.clone(),
            path: "/opt/cni/bin".into(),
            stdin: self.conf.to_string().into_bytes(),
            present: VARS
                .iter()
                .filter(|v| **v != "CNI_NETNS" || !self.netns.is_empty())
                .map(|s| s.to_string())
                .collect(),
            plugin_name: String::new(),
        }
    }
}

/// Which calls of a [`FlakyStore`] fail; shared between a test and its node.
#[derive(Debug, Default)]
pub(crate) struct StoreFaults {
    insert: AtomicBool,
    remove: AtomicBool,
}

impl StoreFaults {
    /// Every `insert` fails while `on`.
    pub fn fail_insert(&self, on: bool) {
        self.insert.store(on, Ordering::SeqCst);
    }

    /// Every `remove` fails while `on`.
    pub fn fail_remove(&self, on: bool) {
        self.remove.store(on, Ordering::SeqCst);
    }
}

/// The real local store, with `insert` and `remove` failing on command
/// (before they change anything, as a full disk or a failed fsync would).
pub(crate) struct FlakyStore {
    inner: Arc<dyn Store>,
    faults: Arc<StoreFaults>,
}

impl FlakyStore {
    pub fn wrap(inner: Arc<dyn Store>, faults: Arc<StoreFaults>) -> Arc<dyn Store> {
        Arc::new(FlakyStore { inner, faults })
    }
}

impl Store for FlakyStore {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn location(&self) -> String {
        self.inner.location()
    }

    fn load(&self) -> Result<Vec<Attachment>, StoreError> {
        self.inner.load()
    }

    fn insert(&self, attachment: &Attachment) -> Result<(), StoreError> {
        if self.faults.insert.load(Ordering::SeqCst) {
            return Err(injected("insert"));
        }
        self.inner.insert(attachment)
    }

    fn remove(&self, keys: &[AttachmentKey]) -> Result<(), StoreError> {
        if self.faults.remove.load(Ordering::SeqCst) {
            return Err(injected("remove"));
        }
        self.inner.remove(keys)
    }

    fn probe(&self) -> Result<(), StoreError> {
        self.inner.probe()
    }
}

/// The error a [`FlakyStore`] returns: a failed write, as a full disk
/// would give.
fn injected(what: &'static str) -> StoreError {
    StoreError::Io {
        context: format!("injected {what} failure").into(),
        cause: std::io::Error::other("injected"),
    }
}
