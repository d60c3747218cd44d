//! A multi-node topology built from network namespaces, for cluster mode.
//!
//! - [`Fabric`]: a fabric netns holding a Linux bridge, the "switch" every
//!   node and the etcd control netns hang off (underlay [`UNDERLAY_V4`] and
//!   [`UNDERLAY_V6`], the bridge itself holds the gateways);
//! - [`EtcdCluster`]: Debian's etcd 3.4, several members in one control
//!   netns on the fabric, each on an address of its own; members can be
//!   killed, stopped and started again on the same data dir;
//! - [`ClusterNode`]: a node netns on the fabric (default routes via the
//!   fabric gateway, so tetherd's node-IP detection has something to find)
//!   with a [`Daemon`] in it, started with the cluster flags of [`NodeOpts`];
//! - [`Cluster`]: all of the above at once, plus pods ([`Pod`]) added
//!   through the real `tether` plugin and [`ping`] between them.
//!
//! The safety rules of the crate hold here too: every netns, link and temp
//! dir is named with [`crate::run_prefix`]; every address and route lives in
//! a netns this module created (the machine's own netns is never touched);
//! the only processes signalled are etcd members and daemons spawned here,
//! through their `Child` handle; every guard cleans up in `Drop`, also when
//! a test panics.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

pub use crate::netns::{assert_ping_within, ping, ping_output};
use crate::{
    cni, tether_bin, unique_name, wait_until, CniEnv, CniOutput, Daemon, DaemonOpts, Netns, TempDir,
};

/// The underlay's IPv4 subnet, inside the fabric only.
pub const UNDERLAY_V4: &str = "10.77.0.0/24";
/// The underlay's IPv6 subnet, inside the fabric only.
pub const UNDERLAY_V6: &str = "fd00:77:ff::/64";
/// The fabric's IPv4 gateway (on the bridge): every node's default route.
pub const GATEWAY_V4: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
/// The fabric's IPv6 gateway (on the bridge): every node's default route.
pub const GATEWAY_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x77, 0xff, 0, 0, 0, 0, 1);
/// The cluster CIDRs [`NodeOpts::default`] hands to `--cluster-cidr`.
pub const CLUSTER_CIDRS: [&str; 2] = ["10.244.0.0/16", "fd00:10:244::/64"];
/// The route protocol of tetherd's routes to other nodes' blocks.
pub const CLUSTER_ROUTE_PROTOCOL: u8 = 202;
/// The `name` of the netconf [`ClusterNode`] adds pods with.
pub const CLUSTER_NETWORK: &str = "tether-cluster";
/// The etcd server binary (Debian's `etcd-server`).
pub const ETCD_BIN: &str = "/usr/bin/etcd";
/// The etcd client binary (Debian's `etcd-client`).
pub const ETCDCTL_BIN: &str = "/usr/bin/etcdctl";
/// The port every etcd member serves clients on (each on its own address).
pub const ETCD_CLIENT_PORT: u16 = 2379;
/// The port every etcd member talks to its peers on.
pub const ETCD_PEER_PORT: u16 = 2380;

/// Underlay host numbers: etcd members from 11, nodes from 21.
const ETCD_HOST_BASE: u8 = 11;
const NODE_HOST_BASE: u8 = 21;
/// Underlay prefix lengths (of [`UNDERLAY_V4`] and [`UNDERLAY_V6`]).
const UNDERLAY_V4_LEN: u8 = 24;
const UNDERLAY_V6_LEN: u8 = 64;

/// Raft timing: small, so that losing the leader costs well under a second
/// (tetherd's default per-request timeout is 2 s), yet large enough that a
/// busy 2-core CI machine does not trigger spurious elections.
const ETCD_HEARTBEAT_MS: u32 = 50;
const ETCD_ELECTION_MS: u32 = 500;
/// The backend quota: tiny data, so 64 MiB is plenty.
const ETCD_QUOTA_BYTES: u64 = 64 << 20;
/// How long a start or restart may take to become healthy.
const ETCD_READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long [`EtcdCluster::stop_member`] waits after SIGTERM before SIGKILL.
const ETCD_STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long [`EtcdCluster::start_all`] waits for one member's peer port to
/// answer before it starts the next anyway.
const PEER_SERVE_TIMEOUT: Duration = Duration::from_secs(3);
/// How much of each log a panic message quotes.
const LOG_TAIL_LINES: usize = 30;

// ---------------------------------------------------------------------------
// Fabric

/// The fabric: a netns holding one Linux bridge with the underlay gateways
/// ([`GATEWAY_V4`], [`GATEWAY_V6`]) on it. [`Fabric::attach`] plugs another
/// netns in with a veth.
///
/// Dropping it deletes the netns, the bridge and the fabric ends of every
/// veth (which takes their other ends with them).
#[derive(Debug)]
pub struct Fabric {
    bridge: String,
    netns: Netns,
}

/// One netns's place on the fabric: its interface there and its addresses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Underlay {
    /// The interface inside the attached netns.
    pub ifname: String,
    /// Its IPv4 address in [`UNDERLAY_V4`].
    pub v4: Ipv4Addr,
    /// Its IPv6 address in [`UNDERLAY_V6`].
    pub v6: Ipv6Addr,
}

impl Fabric {
    /// Creates the fabric netns, its bridge (no STP, no multicast snooping,
    /// so ports forward at once) and the gateway addresses.
    pub fn new() -> Fabric {
        let fabric = Fabric {
            bridge: unique_name("br"),
            netns: Netns::new("fab"),
        };
        let (ns, br) = (fabric.netns.name(), fabric.bridge.as_str());
        ip(&[
            "-n",
            ns,
            "link",
            "add",
            br,
            "type",
            "bridge",
            "stp_state",
            "0",
            "mcast_snooping",
            "0",
        ]);
        ip(&["-n", ns, "link", "set", br, "up"]);
        add_addr(ns, br, &format!("{GATEWAY_V4}/{UNDERLAY_V4_LEN}"));
        add_addr(ns, br, &format!("{GATEWAY_V6}/{UNDERLAY_V6_LEN}"));
        fabric
    }

    /// The fabric netns.
    pub fn netns(&self) -> &Netns {
        &self.netns
    }

    /// The bridge's name (inside [`Fabric::netns`]).
    pub fn bridge(&self) -> &str {
        &self.bridge
    }

    /// Plugs `ns` into the bridge with a new veth, puts `addrs` (each
    /// `ip/prefixlen`, either family; IPv6 without DAD, so usable at once)
    /// on its end inside `ns`, brings both ends up, and returns the name of
    /// that end.
    pub fn attach(&self, ns: &Netns, addrs: &[&str]) -> String {
        let inner = unique_name("u");
        let outer = format!("{inner}f");
        // The peer is created straight in `ns`: it never exists anywhere else.
        ip(&[
            "-n",
            self.netns.name(),
            "link",
            "add",
            &outer,
            "type",
            "veth",
            "peer",
            "name",
            &inner,
            "netns",
            ns.name(),
        ]);
        ip(&[
            "-n",
            self.netns.name(),
            "link",
            "set",
            &outer,
            "master",
            &self.bridge,
            "up",
        ]);
        for addr in addrs {
            add_addr(ns.name(), &inner, addr);
        }
        ip(&["-n", ns.name(), "link", "set", &inner, "up"]);
        inner
    }

    /// [`Fabric::attach`] with the underlay addresses of host number `host`
    /// (`10.77.0.<host>/24` and `fd00:77:ff::<host>/64`, the same digits in
    /// both: host 21 is `::21`), plus default routes of both families via
    /// the gateways: what a node needs.
    pub fn attach_host(&self, ns: &Netns, host: u8) -> Underlay {
        assert!(
            (2..=254).contains(&host),
            "underlay host number {host} out of range"
        );
        let underlay = Underlay::of_host(String::new(), host);
        let ifname = self.attach(
            ns,
            &[
                &format!("{}/{UNDERLAY_V4_LEN}", underlay.v4),
                &format!("{}/{UNDERLAY_V6_LEN}", underlay.v6),
            ],
        );
        let (gw4, gw6) = (GATEWAY_V4.to_string(), GATEWAY_V6.to_string());
        ip(&[
            "-n",
            ns.name(),
            "-4",
            "route",
            "add",
            "default",
            "via",
            &gw4,
            "dev",
            &ifname,
        ]);
        ip(&[
            "-n",
            ns.name(),
            "-6",
            "route",
            "add",
            "default",
            "via",
            &gw6,
            "dev",
            &ifname,
        ]);
        Underlay { ifname, ..underlay }
    }
}

impl Default for Fabric {
    fn default() -> Fabric {
        Fabric::new()
    }
}

impl Underlay {
    fn of_host(ifname: String, host: u8) -> Underlay {
        let [a, b, c, _] = GATEWAY_V4.octets();
        let mut v6 = GATEWAY_V6.segments();
        // The decimal digits read as hex: host 21 is ::21, as in the v4.
        v6[7] = u16::from_str_radix(&host.to_string(), 16).expect("decimal digits are hex");
        Underlay {
            ifname,
            v4: Ipv4Addr::new(a, b, c, host),
            v6: Ipv6Addr::from(v6),
        }
    }
}

// ---------------------------------------------------------------------------
// etcd

/// A real etcd cluster (Debian's `/usr/bin/etcd`, 3.4): its members run in
/// one control netns on the fabric, member `i` on its own address
/// `10.77.0.<11+i>` (client port [`ETCD_CLIENT_PORT`], peer port
/// [`ETCD_PEER_PORT`]), with data dirs and logs in a temp dir.
///
/// A killed or stopped member keeps its address, so clients get a refused
/// connection from it at once, and its data dir, so
/// [`EtcdCluster::start_member`] brings the same member back.
///
/// Dropping it SIGKILLs the members still running (the children spawned
/// here, by their handles), deletes the control netns and removes the temp
/// dir; if the thread is panicking, each member's log tail is printed first.
#[derive(Debug)]
pub struct EtcdCluster {
    members: Vec<EtcdMember>,
    // Dropped after the members are dead: the netns, then the dir.
    control: Netns,
    dir: TempDir,
}

#[derive(Debug)]
struct EtcdMember {
    name: String,
    ip: Ipv4Addr,
    args: Vec<String>,
    log_path: PathBuf,
    child: Option<Child>,
}

impl EtcdMember {
    fn client_url(&self) -> String {
        format!("http://{}:{ETCD_CLIENT_PORT}", self.ip)
    }

    fn peer_url(&self) -> String {
        format!("http://{}:{ETCD_PEER_PORT}", self.ip)
    }

    fn log_tail(&self) -> String {
        crate::log_tail(&self.log_path, LOG_TAIL_LINES)
    }
}

impl EtcdCluster {
    /// Starts a `members`-member cluster in a new control netns attached to
    /// `fabric`, and waits until every member reports healthy; panics with
    /// the members' logs if that takes over 30 s.
    pub fn start(fabric: &Fabric, members: usize) -> EtcdCluster {
        assert!(
            (1..=9).contains(&members),
            "an etcd cluster of {members} members"
        );
        let control = Netns::new("etcd");
        let dir = TempDir::new("etcd");
        let ips: Vec<Ipv4Addr> = (0..members)
            .map(|i| Underlay::of_host(String::new(), ETCD_HOST_BASE + i as u8).v4)
            .collect();
        let addrs: Vec<String> = ips
            .iter()
            .map(|ip| format!("{ip}/{UNDERLAY_V4_LEN}"))
            .collect();
        let addrs: Vec<&str> = addrs.iter().map(String::as_str).collect();
        fabric.attach(&control, &addrs);

        let token = unique_name("etcd");
        let mut etcd = EtcdCluster {
            members: Vec::new(),
            control,
            dir,
        };
        etcd.members = ips
            .iter()
            .enumerate()
            .map(|(i, &ip)| EtcdMember {
                name: format!("m{i}"),
                ip,
                args: Vec::new(),
                log_path: etcd.dir.path().join(format!("m{i}.log")),
                child: None,
            })
            .collect();
        let initial_cluster = etcd
            .members
            .iter()
            .map(|m| format!("{}={}", m.name, m.peer_url()))
            .collect::<Vec<_>>()
            .join(",");
        for member in &mut etcd.members {
            let data_dir = etcd.dir.path().join(format!("{}.etcd", member.name));
            let (client, peer) = (member.client_url(), member.peer_url());
            // With a data dir that already holds the member, etcd ignores
            // the --initial-* flags: restarts use the same command line.
            member.args = [
                "--name",
                &member.name,
                "--data-dir",
                &data_dir.display().to_string(),
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
                "--initial-cluster",
                &initial_cluster,
                "--initial-cluster-token",
                &token,
                "--initial-cluster-state",
                "new",
                "--heartbeat-interval",
                &ETCD_HEARTBEAT_MS.to_string(),
                "--election-timeout",
                &ETCD_ELECTION_MS.to_string(),
                "--quota-backend-bytes",
                &ETCD_QUOTA_BYTES.to_string(),
                "--snapshot-count",
                "10000",
                "--logger",
                "zap",
                "--log-outputs",
                "stderr",
            ]
            .map(str::to_owned)
            .to_vec();
        }
        etcd.start_all();
        etcd
    }

    /// How many members the cluster has (running or not).
    pub fn member_count(&self) -> usize {
        self.members.len()
    }

    /// The control netns the members run in.
    pub fn control(&self) -> &Netns {
        &self.control
    }

    /// The temp dir holding the members' data dirs and logs.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Every member's client URL, comma-separated, as reachable from any
    /// netns on the fabric: the value for `--etcd-endpoints`.
    pub fn endpoints(&self) -> String {
        self.members
            .iter()
            .map(EtcdMember::client_url)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Member `i`'s client URL.
    pub fn endpoint(&self, i: usize) -> String {
        self.members[i].client_url()
    }

    /// Member `i`'s underlay address.
    pub fn member_ip(&self, i: usize) -> Ipv4Addr {
        self.members[i].ip
    }

    /// True while member `i`'s process is alive.
    pub fn is_running(&mut self, i: usize) -> bool {
        match &mut self.members[i].child {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Member `i`'s PID while it runs (the harness has not reaped it).
    pub fn member_pid(&self, i: usize) -> Option<u32> {
        self.members[i].child.as_ref().map(Child::id)
    }

    /// Member `i`'s whole log (every run so far).
    pub fn log(&self, i: usize) -> String {
        std::fs::read_to_string(&self.members[i].log_path).unwrap_or_default()
    }

    /// Kills member `i` with SIGKILL (a crash) and reaps it; its data dir
    /// stays. Returns at once: if it was the leader, the others need about
    /// an election timeout (0.5 to 1 s) to elect a new one (see
    /// [`EtcdCluster::wait_healthy`]). Panics if it is not running.
    pub fn kill_member(&mut self, i: usize) {
        let mut child = self.members[i]
            .child
            .take()
            .unwrap_or_else(|| panic!("kill_member: etcd member {i} is not running"));
        // Not reaped yet, so the PID is still our child's.
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Stops member `i` with SIGTERM (a clean shutdown) and waits for it to
    /// exit, SIGKILLing it after 10 s. Panics if it is not running.
    pub fn stop_member(&mut self, i: usize) {
        let child = self.members[i]
            .child
            .take()
            .unwrap_or_else(|| panic!("stop_member: etcd member {i} is not running"));
        stop_children(vec![child]);
    }

    /// Stops every running member with SIGTERM and waits for them to exit
    /// (SIGKILL after 10 s); data dirs stay. The followers go first, all at
    /// once, then the leader: a leader stopped while its followers live
    /// tries to hand over leadership, and with them stopping too it waits
    /// out a 6 s timeout; alone, it skips the handover and exits at once.
    pub fn stop_all(&mut self) {
        let leader = self.leader();
        let followers: Vec<Child> = self
            .members
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| Some(*i) != leader)
            .filter_map(|(_, m)| m.child.take())
            .collect();
        stop_children(followers);
        let rest: Vec<Child> = self
            .members
            .iter_mut()
            .filter_map(|m| m.child.take())
            .collect();
        stop_children(rest);
    }

    /// Kills every running member with SIGKILL and reaps them. Data dirs
    /// stay.
    pub fn kill_all(&mut self) {
        let mut children: Vec<Child> = self
            .members
            .iter_mut()
            .filter_map(|m| m.child.take())
            .collect();
        for child in &mut children {
            let _ = child.kill();
        }
        for child in &mut children {
            let _ = child.wait();
        }
    }

    /// Starts member `i` again on its data dir and waits until it reports
    /// healthy (which needs a quorum of running members). Panics if it is
    /// already running.
    pub fn start_member(&mut self, i: usize) {
        assert!(
            self.members[i].child.is_none(),
            "start_member: etcd member {i} is already running"
        );
        self.spawn(i);
        self.wait_members_healthy(&[i]);
    }

    /// Starts every member that is not running, all at once, and waits
    /// until every member reports healthy.
    pub fn start_all(&mut self) {
        for i in 0..self.members.len() {
            if self.members[i].child.is_none() {
                self.spawn(i);
                // A new member asks its peers whether it already belongs to
                // the cluster, waiting 1 s on each peer that has bound its
                // port but does not answer yet: start them one by one, each
                // once its peer port answers (tens of ms), so none waits.
                self.wait_peer_serves(i);
            }
        }
        let all: Vec<usize> = (0..self.members.len()).collect();
        self.wait_members_healthy(&all);
    }

    /// Waits until every running member reports healthy, as after a start;
    /// panics with the members' logs if that takes over 30 s or none runs.
    ///
    /// Call it after [`EtcdCluster::kill_member`] before a write that must
    /// succeed: etcd 3.4 loses a write sent while the followers still
    /// believe in a leader that just died (they forward it into the void),
    /// and the client only sees its own timeout.
    pub fn wait_healthy(&mut self) {
        let running: Vec<usize> = (0..self.members.len())
            .filter(|&i| self.is_running(i))
            .collect();
        assert!(!running.is_empty(), "wait_healthy: no etcd member runs");
        self.wait_members_healthy(&running);
    }

    /// True if every running member answers `etcdctl endpoint health`
    /// (a quorum read); false if none runs.
    pub fn is_healthy(&mut self) -> bool {
        let running: Vec<usize> = (0..self.members.len())
            .filter(|&i| self.is_running(i))
            .collect();
        !running.is_empty() && self.members_healthy(&running)
    }

    /// The index of the member that is the raft leader now, if a running
    /// member knows one.
    pub fn leader(&self) -> Option<usize> {
        // Only members we run: a dead endpoint costs the dial timeout.
        let endpoints = self
            .members
            .iter()
            .filter(|m| m.child.is_some())
            .map(EtcdMember::client_url)
            .collect::<Vec<_>>()
            .join(",");
        if endpoints.is_empty() {
            return None;
        }
        let endpoints = format!("--endpoints={endpoints}");
        let argv = [
            ETCDCTL_BIN,
            &endpoints,
            "--dial-timeout=1s",
            "--command-timeout=2s",
            "endpoint",
            "status",
            "--write-out",
            "json",
        ];
        let out = etcdctl_command(&self.control, &argv);
        // With a member unreachable the exit status is non-zero, yet the
        // others' statuses are printed.
        let statuses: Vec<Value> = serde_json::from_slice(&out.stdout).ok()?;
        statuses.iter().find_map(|s| {
            let status = &s["Status"];
            let leader = status["leader"].as_u64()?;
            if status["header"]["member_id"].as_u64()? != leader {
                return None;
            }
            let endpoint = s["Endpoint"].as_str()?;
            self.members.iter().position(|m| m.client_url() == endpoint)
        })
    }

    /// Runs `etcdctl` (API v3) with `args` in the control netns against
    /// every member's endpoint, and returns its output whatever its status.
    /// Dial timeout 2 s, command timeout 5 s (enough to ride out an
    /// election); `args` may override them.
    pub fn etcdctl(&self, args: &[&str]) -> Output {
        self.etcdctl_in(&self.control, args)
    }

    /// [`EtcdCluster::etcdctl`] run in `ns` instead (any netns on the
    /// fabric, e.g. a node's, to prove it reaches the members).
    pub fn etcdctl_in(&self, ns: &Netns, args: &[&str]) -> Output {
        let endpoints = format!("--endpoints={}", self.endpoints());
        let mut argv = vec![
            ETCDCTL_BIN,
            &endpoints,
            "--dial-timeout=2s",
            "--command-timeout=5s",
        ];
        argv.extend_from_slice(args);
        etcdctl_command(ns, &argv)
    }

    /// [`EtcdCluster::etcdctl`], panicking with its stderr unless it
    /// succeeds; returns its stdout.
    pub fn etcdctl_ok(&self, args: &[&str]) -> String {
        let out = self.etcdctl(args);
        assert!(
            out.status.success(),
            "etcdctl {args:?} failed ({}):\nstderr: {}\nstdout: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            String::from_utf8_lossy(&out.stdout).trim()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Puts `key` = `value`; panics unless it succeeds.
    pub fn put(&self, key: &str, value: &str) {
        // `--` so that a value starting with '-' is not read as a flag.
        self.etcdctl_ok(&["put", "--", key, value]);
    }

    /// The value of `key`, if it exists; panics if the read fails.
    pub fn get(&self, key: &str) -> Option<String> {
        self.get_prefix_opts(key, false).remove(key)
    }

    /// Every key starting with `prefix`, with its value (for example
    /// `get_prefix("/tether/")`); panics if the read fails.
    pub fn get_prefix(&self, prefix: &str) -> BTreeMap<String, String> {
        self.get_prefix_opts(prefix, true)
    }

    fn get_prefix_opts(&self, key: &str, prefix: bool) -> BTreeMap<String, String> {
        let mut args = vec!["get", "--write-out", "json"];
        if prefix {
            args.push("--prefix");
        }
        args.extend(["--", key]);
        let out = self.etcdctl_ok(&args);
        let json: Value = serde_json::from_str(&out)
            .unwrap_or_else(|e| panic!("etcdctl get {key}: bad JSON ({e}): {out}"));
        let kvs = json["kvs"].as_array().cloned().unwrap_or_default();
        kvs.iter()
            .map(|kv| {
                let field = |name: &str| {
                    let b64 = kv[name].as_str().unwrap_or_default();
                    let bytes = base64_decode(b64)
                        .unwrap_or_else(|| panic!("etcdctl get: bad base64 {name} {b64:?}"));
                    String::from_utf8_lossy(&bytes).into_owned()
                };
                (field("key"), field("value"))
            })
            .collect()
    }

    fn spawn(&mut self, i: usize) {
        let member = &mut self.members[i];
        let log = File::options()
            .create(true)
            .append(true)
            .open(&member.log_path)
            .unwrap_or_else(|e| panic!("opening {}: {e}", member.log_path.display()));
        let log_err = log.try_clone().expect("duplicating the log fd");
        // `ip netns exec` execs etcd, so the child's PID is etcd's.
        let child = Command::new("ip")
            .args(["netns", "exec", self.control.name(), ETCD_BIN])
            .args(&member.args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err))
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {ETCD_BIN}: {e}"));
        member.child = Some(child);
    }

    /// Waits until members `which` all report healthy; panics with every
    /// member's log tail if one exits or the timeout passes.
    fn wait_members_healthy(&mut self, which: &[usize]) {
        let deadline = Instant::now() + ETCD_READY_TIMEOUT;
        loop {
            for &i in which {
                if !self.is_running(i) {
                    panic!(
                        "etcd member {i} is not running (exited or never started)\n{}",
                        self.log_tails()
                    );
                }
            }
            if self.members_healthy(which) {
                return;
            }
            if Instant::now() >= deadline {
                let out = self.etcdctl(&["endpoint", "health"]);
                panic!(
                    "etcd members {which:?} not healthy within {ETCD_READY_TIMEOUT:?}:\n{}{}\n{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr),
                    self.log_tails()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits up to [`PEER_SERVE_TIMEOUT`] until member `i` answers HTTP on
    /// its peer port; a member that is slower only costs its peers a wait.
    fn wait_peer_serves(&self, i: usize) {
        let addr = SocketAddr::new(IpAddr::V4(self.members[i].ip), ETCD_PEER_PORT);
        self.control.run(|| {
            wait_until(PEER_SERVE_TIMEOUT, || http_answers(addr, "/version"));
        });
    }

    fn members_healthy(&self, which: &[usize]) -> bool {
        // etcdctl spends its whole dial timeout on a port nobody listens on
        // yet: connect first, which is refused at once.
        let listening = self.control.run(|| {
            which.iter().all(|&i| {
                let addr = SocketAddr::new(IpAddr::V4(self.members[i].ip), ETCD_CLIENT_PORT);
                TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok()
            })
        });
        if !listening {
            return false;
        }
        let endpoints = which
            .iter()
            .map(|&i| self.members[i].client_url())
            .collect::<Vec<_>>()
            .join(",");
        let endpoints = format!("--endpoints={endpoints}");
        let argv = [
            ETCDCTL_BIN,
            &endpoints,
            "--dial-timeout=1s",
            // Short: a read sent before the first election blocks until it.
            "--command-timeout=500ms",
            "endpoint",
            "health",
        ];
        etcdctl_command(&self.control, &argv).status.success()
    }

    fn log_tails(&self) -> String {
        self.members
            .iter()
            .map(EtcdMember::log_tail)
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "harness: etcd in {}:\n{}",
                self.control.name(),
                self.log_tails()
            );
        }
        self.kill_all();
        // The fields drop next: the control netns, then the temp dir.
    }
}

/// SIGTERM to each child (ours, unreaped), then waits for all, SIGKILLing
/// those still alive after [`ETCD_STOP_TIMEOUT`].
fn stop_children(mut children: Vec<Child>) {
    for child in &children {
        // SAFETY: kill(2) on the PID of our own unreaped child.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    }
    let deadline = Instant::now() + ETCD_STOP_TIMEOUT;
    while !children.is_empty() {
        children.retain_mut(|c| matches!(c.try_wait(), Ok(None)));
        if Instant::now() >= deadline {
            for child in &mut children {
                eprintln!("harness: etcd (pid {}) ignored SIGTERM", child.id());
                let _ = child.kill();
                let _ = child.wait();
            }
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// True if an HTTP GET of `path` on `addr` gets any response within 200 ms
/// (from the calling thread's netns).
fn http_answers(addr: SocketAddr, path: &str) -> bool {
    let limit = Duration::from_millis(200);
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, limit) else {
        return false;
    };
    let request = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    let mut head = [0u8; 12];
    stream.set_read_timeout(Some(limit)).is_ok()
        && stream.write_all(request.as_bytes()).is_ok()
        && stream.read_exact(&mut head).is_ok()
        && head.starts_with(b"HTTP/")
}

fn etcdctl_command(ns: &Netns, argv: &[&str]) -> Output {
    Command::new("ip")
        .args(["netns", "exec", ns.name()])
        .args(argv)
        .env("ETCDCTL_API", "3")
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("spawning {ETCDCTL_BIN} in {}: {e}", ns.name()))
}

// ---------------------------------------------------------------------------
// Nodes

/// How a node routes to other nodes' blocks (`--overlay`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Overlay {
    /// `--overlay none`: host-gw, `block via nodeIP`.
    #[default]
    HostGw,
    /// `--overlay vxlan`: one VXLAN device, static FDB and neighbours.
    Vxlan,
}

impl Overlay {
    /// The value of `--overlay`.
    pub fn flag(self) -> &'static str {
        match self {
            Overlay::HostGw => "none",
            Overlay::Vxlan => "vxlan",
        }
    }
}

/// How to start a [`ClusterNode`]'s tetherd.
#[derive(Clone, Debug)]
pub struct NodeOpts {
    /// `--overlay`.
    pub overlay: Overlay,
    /// One `--cluster-cidr` each; [`CLUSTER_CIDRS`] by default.
    pub cluster_cidrs: Vec<String>,
    /// `--block-size`, if set (the daemon's default is 26).
    pub block_size: Option<u8>,
    /// `--block-size-v6`, if set (the daemon's default is 122).
    pub block_size_v6: Option<u8>,
    /// `--lease-ttl` in seconds (2 by default, for quick tests).
    pub lease_ttl_secs: u32,
    /// `--node-grace` in seconds (3 by default, for quick tests).
    pub node_grace_secs: u32,
    /// `--etcd-timeout-ms`, if set.
    pub etcd_timeout_ms: Option<u32>,
    /// Pass `--node-ip <underlay v4>`; by default the daemon detects it
    /// from the default route, which the fabric provides.
    pub explicit_node_ip: bool,
    /// If non-empty: the single-node mode instead, `--pod-cidr` each and no
    /// store or cluster flags at all (for a daemon without cluster mode).
    pub pod_cidrs: Vec<String>,
    /// `--log-level`; the crate's default when unset.
    pub log_level: Option<String>,
    /// The binary; [`crate::tetherd_bin`] when unset.
    pub bin: Option<PathBuf>,
    /// Appended to the command line as they are.
    pub extra_args: Vec<String>,
}

impl Default for NodeOpts {
    fn default() -> NodeOpts {
        NodeOpts {
            overlay: Overlay::HostGw,
            cluster_cidrs: CLUSTER_CIDRS.map(str::to_owned).to_vec(),
            block_size: None,
            block_size_v6: None,
            lease_ttl_secs: 2,
            node_grace_secs: 3,
            etcd_timeout_ms: None,
            explicit_node_ip: false,
            pod_cidrs: Vec::new(),
            log_level: None,
            bin: None,
            extra_args: Vec::new(),
        }
    }
}

impl NodeOpts {
    /// The tetherd arguments these options stand for, for a node at
    /// `underlay` talking to `etcd_endpoints`.
    pub fn daemon_args(&self, etcd_endpoints: &str, underlay: &Underlay) -> Vec<String> {
        let mut args: Vec<String> = Vec::new();
        let mut flag = |name: &str, value: String| args.extend([name.to_owned(), value]);
        if self.pod_cidrs.is_empty() {
            flag("--store", "etcd".into());
            flag("--etcd-endpoints", etcd_endpoints.into());
            for cidr in &self.cluster_cidrs {
                flag("--cluster-cidr", cidr.clone());
            }
            if let Some(size) = self.block_size {
                flag("--block-size", size.to_string());
            }
            if let Some(size) = self.block_size_v6 {
                flag("--block-size-v6", size.to_string());
            }
            flag("--overlay", self.overlay.flag().into());
            flag("--lease-ttl", self.lease_ttl_secs.to_string());
            flag("--node-grace", self.node_grace_secs.to_string());
            if let Some(ms) = self.etcd_timeout_ms {
                flag("--etcd-timeout-ms", ms.to_string());
            }
            if self.explicit_node_ip {
                flag("--node-ip", underlay.v4.to_string());
            }
        }
        args.extend(self.extra_args.iter().cloned());
        args
    }
}

/// A node: a netns on the fabric at its own underlay addresses, with a
/// `tetherd` running in it. Dropping it kills the daemon and deletes the
/// netns (with its veth to the fabric, pod veths and routes).
#[derive(Debug)]
pub struct ClusterNode {
    daemon: Daemon,
    underlay: Underlay,
}

impl ClusterNode {
    /// Creates a node netns, attaches it to `fabric` as host number `host`
    /// ([`Fabric::attach_host`]) and starts tetherd in it with `opts`
    /// against `etcd_endpoints`; panics with the daemon's log if it does
    /// not serve.
    pub fn start(fabric: &Fabric, etcd_endpoints: &str, host: u8, opts: &NodeOpts) -> ClusterNode {
        let netns = Netns::new("node");
        let underlay = fabric.attach_host(&netns, host);
        let daemon = Daemon::start_in(
            netns,
            DaemonOpts {
                pod_cidrs: opts.pod_cidrs.clone(),
                mtu: None,
                log_level: opts.log_level.clone(),
                bin: opts.bin.clone(),
                extra_args: opts.daemon_args(etcd_endpoints, &underlay),
            },
        );
        ClusterNode { daemon, underlay }
    }

    /// The node's name (`--node-name`, also its netns's name).
    pub fn name(&self) -> &str {
        self.daemon.node_name()
    }

    /// The node netns.
    pub fn netns(&self) -> &Netns {
        self.daemon.node()
    }

    /// The node's tetherd.
    pub fn daemon(&self) -> &Daemon {
        &self.daemon
    }

    /// The node's tetherd, to kill, stop or restart it.
    pub fn daemon_mut(&mut self) -> &mut Daemon {
        &mut self.daemon
    }

    /// The node's interface and addresses on the fabric.
    pub fn underlay(&self) -> &Underlay {
        &self.underlay
    }

    /// The 1.0.0 netconf pods are added with ([`CLUSTER_NETWORK`]).
    pub fn netconf(&self) -> Value {
        self.daemon.netconf("1.0.0", CLUSTER_NETWORK)
    }

    /// One ADD of `id` into `pod` through the real `tether` plugin, the
    /// result (or error) returned as it is.
    pub fn try_add(&self, pod: &Netns, id: &str) -> CniOutput {
        self.call("ADD", pod, id)
    }

    /// A new pod netns added on this node; panics unless the ADD succeeds.
    pub fn add_pod(&self) -> Pod {
        let netns = Netns::new("pod");
        let id = netns.name().to_owned();
        let out = self.try_add(&netns, &id);
        assert!(
            out.success(),
            "ADD of {id} on {} failed: {out}",
            self.name()
        );
        Pod::from_output(netns, id, self.name(), &out)
    }

    /// DEL of `pod` on this node (its netns stays); the output as it is.
    pub fn del(&self, pod: &Pod) -> CniOutput {
        self.call("DEL", &pod.netns, &pod.id)
    }

    /// The routes to other nodes' blocks ([`CLUSTER_ROUTE_PROTOCOL`]), both
    /// families, as `ip -j route` prints them.
    pub fn cluster_routes(&self) -> Vec<Value> {
        self.netns().routes_with_protocol(CLUSTER_ROUTE_PROTOCOL)
    }

    /// The destinations of [`ClusterNode::cluster_routes`], sorted.
    pub fn cluster_route_dsts(&self) -> Vec<String> {
        let mut dsts: Vec<String> = self
            .cluster_routes()
            .iter()
            .filter_map(|r| r["dst"].as_str().map(str::to_owned))
            .collect();
        dsts.sort();
        dsts
    }

    fn call(&self, command: &str, pod: &Netns, id: &str) -> CniOutput {
        self.call_with(command, pod, id, &self.netconf(), None)
    }

    /// One `command` of `id` in `pod` through the real plugin with this
    /// netconf and `CNI_ARGS`, the output as it is.
    pub fn call_with(
        &self,
        command: &str,
        pod: &Netns,
        id: &str,
        netconf: &Value,
        args: Option<&str>,
    ) -> CniOutput {
        let stdin = serde_json::to_vec(netconf).expect("a JSON value serializes");
        let mut env = CniEnv::new(command, id, pod);
        env.args = args.map(str::to_owned);
        cni(&tether_bin(), &env, &stdin)
    }
}

/// A pod added through the plugin: its netns (deleted on drop), container
/// id, node and addresses.
#[derive(Debug)]
pub struct Pod {
    netns: Netns,
    id: String,
    node: String,
    ips: Vec<IpAddr>,
    result: Value,
}

impl Pod {
    /// A pod from a successful ADD's output.
    pub fn from_output(netns: Netns, id: String, node: &str, out: &CniOutput) -> Pod {
        let result = out.result().clone();
        let ips = result["ips"]
            .as_array()
            .unwrap_or_else(|| panic!("ADD result without ips: {result}"))
            .iter()
            .map(|entry| {
                let addr = entry["address"].as_str().unwrap_or_default();
                let ip = addr.split('/').next().unwrap_or_default();
                ip.parse()
                    .unwrap_or_else(|e| panic!("bad address {addr:?} ({e}) in {result}"))
            })
            .collect();
        Pod {
            netns,
            id,
            node: node.to_owned(),
            ips,
            result,
        }
    }

    /// The pod netns.
    pub fn netns(&self) -> &Netns {
        &self.netns
    }

    /// The container id it was added with (the netns's name).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The name of the node it was added on.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Its addresses, in the order of the ADD result.
    pub fn ips(&self) -> &[IpAddr] {
        &self.ips
    }

    /// Its IPv4 address, if it has one.
    pub fn v4(&self) -> Option<IpAddr> {
        self.ips.iter().copied().find(IpAddr::is_ipv4)
    }

    /// Its IPv6 address, if it has one.
    pub fn v6(&self) -> Option<IpAddr> {
        self.ips.iter().copied().find(IpAddr::is_ipv6)
    }

    /// The whole ADD result.
    pub fn result(&self) -> &Value {
        &self.result
    }

    /// [`ping`] from this pod.
    pub fn ping(&self, to: IpAddr) -> bool {
        ping(&self.netns, to)
    }
}

// ---------------------------------------------------------------------------
// The whole topology

/// How to build a [`Cluster`].
#[derive(Clone, Debug)]
pub struct ClusterOpts {
    /// How many nodes (3 by default).
    pub nodes: usize,
    /// How many etcd members (3 by default).
    pub etcd_members: usize,
    /// How every node's tetherd is started.
    pub node: NodeOpts,
}

impl Default for ClusterOpts {
    fn default() -> ClusterOpts {
        ClusterOpts {
            nodes: 3,
            etcd_members: 3,
            node: NodeOpts::default(),
        }
    }
}

/// A fabric, an etcd cluster on it, and nodes running tetherd against it.
///
/// Dropping it drops the nodes (daemons killed, netns deleted), then etcd,
/// then the fabric. Pods are the caller's: drop them when done.
#[derive(Debug)]
pub struct Cluster {
    // Dropped in declaration order: nodes, etcd, fabric.
    nodes: Vec<ClusterNode>,
    etcd: EtcdCluster,
    fabric: Fabric,
    opts: NodeOpts,
    next_host: u8,
}

impl Cluster {
    /// Builds the fabric, starts etcd (healthy) and then the nodes one after
    /// another (so node `i` registers `i`-th).
    pub fn new(opts: ClusterOpts) -> Cluster {
        let fabric = Fabric::new();
        let etcd = EtcdCluster::start(&fabric, opts.etcd_members);
        let mut cluster = Cluster {
            nodes: Vec::new(),
            etcd,
            fabric,
            opts: opts.node,
            next_host: NODE_HOST_BASE,
        };
        for _ in 0..opts.nodes {
            cluster.add_node();
        }
        cluster
    }

    /// Starts one more node with the cluster's options; returns its index.
    pub fn add_node(&mut self) -> usize {
        let opts = self.opts.clone();
        self.add_node_with(&opts)
    }

    /// Starts one more node with `opts`; returns its index. Every node gets
    /// fresh underlay addresses, never those of a removed node.
    pub fn add_node_with(&mut self, opts: &NodeOpts) -> usize {
        let host = self.next_host;
        self.next_host = host
            .checked_add(1)
            .filter(|h| *h < 255)
            .expect("out of underlay addresses");
        let node = ClusterNode::start(&self.fabric, &self.etcd.endpoints(), host, opts);
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    /// Takes node `i` out of the cluster (later nodes move down one index);
    /// dropping the returned node kills its daemon and deletes its netns.
    pub fn remove_node(&mut self, i: usize) -> ClusterNode {
        self.nodes.remove(i)
    }

    /// The nodes.
    pub fn nodes(&self) -> &[ClusterNode] {
        &self.nodes
    }

    /// Node `i`.
    pub fn node(&self, i: usize) -> &ClusterNode {
        &self.nodes[i]
    }

    /// Node `i`, to restart or kill its daemon.
    pub fn node_mut(&mut self, i: usize) -> &mut ClusterNode {
        &mut self.nodes[i]
    }

    /// The etcd cluster.
    pub fn etcd(&self) -> &EtcdCluster {
        &self.etcd
    }

    /// The etcd cluster, to kill, stop or start members.
    pub fn etcd_mut(&mut self) -> &mut EtcdCluster {
        &mut self.etcd
    }

    /// The fabric.
    pub fn fabric(&self) -> &Fabric {
        &self.fabric
    }

    /// A new pod added on node `i` ([`ClusterNode::add_pod`]).
    pub fn add_pod(&self, i: usize) -> Pod {
        self.nodes[i].add_pod()
    }

    /// Every key under `/tether/` in etcd, with its value.
    pub fn etcd_keys(&self) -> BTreeMap<String, String> {
        self.etcd.get_prefix("/tether/")
    }
}

// ---------------------------------------------------------------------------
// Small helpers

/// Runs `ip args`, panicking with its stderr unless it succeeds.
fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("spawning ip {args:?}: {e}"));
    assert!(
        out.status.success(),
        "ip {args:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

/// Adds `addr` (`ip/prefixlen`) to `ifname` in netns `ns`; IPv6 without
/// duplicate address detection, so it is usable at once.
fn add_addr(ns: &str, ifname: &str, addr: &str) {
    if addr.contains(':') {
        ip(&["-n", ns, "addr", "add", addr, "dev", ifname, "nodad"]);
    } else {
        ip(&["-n", ns, "addr", "add", addr, "dev", ifname]);
    }
}

/// Decodes standard base64 with padding (etcdctl's JSON output encodes
/// keys and values so); None if `text` is not base64.
fn base64_decode(text: &str) -> Option<Vec<u8>> {
    fn sextet(c: u8) -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    }
    let bytes = text.trim_end_matches('=').as_bytes();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        if chunk.len() == 1 {
            return None;
        }
        let mut acc = 0u32;
        for &c in chunk {
            acc = (acc << 6) | sextet(c)?;
        }
        acc <<= 6 * (4 - chunk.len() as u32);
        let decoded = acc.to_be_bytes();
        out.extend_from_slice(&decoded[1..chunk.len()]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips_known_values() {
        assert_eq!(base64_decode("").unwrap(), b"");
        assert_eq!(base64_decode("Zg==").unwrap(), b"f");
        assert_eq!(base64_decode("Zm8=").unwrap(), b"fo");
        assert_eq!(base64_decode("Zm9v").unwrap(), b"foo");
        assert_eq!(
            base64_decode("L3RldGhlci92MS9ub2Rlcy9hYg==").unwrap(),
            b"/tether/v1/nodes/ab"
        );
        assert!(base64_decode("Zm9v!").is_none());
    }

    #[test]
    fn the_topology_can_be_shared_by_threads() {
        // Tests fan pod ADDs out with `crate::parallel(n, |i| cluster.add_pod(i))`.
        fn shared<T: Sync>() {}
        shared::<Cluster>();
        shared::<Pod>();
    }

    #[test]
    fn underlay_addresses_of_a_host() {
        let u = Underlay::of_host(String::new(), 21);
        assert_eq!(u.v4, Ipv4Addr::new(10, 77, 0, 21));
        assert_eq!(u.v6, "fd00:77:ff::21".parse::<Ipv6Addr>().unwrap());
    }

    #[test]
    fn cluster_flags_follow_the_spec() {
        let u = Underlay::of_host("x".into(), 21);
        let args = NodeOpts {
            overlay: Overlay::Vxlan,
            explicit_node_ip: true,
            ..NodeOpts::default()
        }
        .daemon_args("http://10.77.0.11:2379", &u)
        .join(" ");
        assert_eq!(
            args,
            "--store etcd --etcd-endpoints http://10.77.0.11:2379 \
             --cluster-cidr 10.244.0.0/16 --cluster-cidr fd00:10:244::/64 \
             --overlay vxlan --lease-ttl 2 --node-grace 3 --node-ip 10.77.0.21"
        );
        let single = NodeOpts {
            pod_cidrs: vec!["10.244.1.0/24".into()],
            ..NodeOpts::default()
        };
        assert!(single.daemon_args("e", &u).is_empty());
    }
}
