//! A real etcd cluster (Debian's etcd 3.4) in a control netns on the
//! fabric: members that can be killed, stopped and started again.

use super::*;
use base64::prelude::{Engine as _, BASE64_STANDARD};

/// A real etcd cluster (Debian's `/usr/bin/etcd`, 3.4): its members run in
/// one control netns on the fabric, member `i` on its own address
/// `10.77.0.<11+i>` (client port [`ETCD_CLIENT_PORT`], peer port
/// [`ETCD_PEER_PORT`]), with data dirs and logs in a temp dir. Each member
/// also serves clients on its IPv6 address of the fabric
/// ([`EtcdCluster::endpoint_v6`]), for IPv6-only clients.
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
    ip6: Ipv6Addr,
    args: Vec<String>,
    log_path: PathBuf,
    child: Option<Child>,
}

impl EtcdMember {
    fn client_url(&self) -> String {
        format!("http://{}:{ETCD_CLIENT_PORT}", self.ip)
    }

    fn client_url_v6(&self) -> String {
        format!("http://[{}]:{ETCD_CLIENT_PORT}", self.ip6)
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
        let ips: Vec<Underlay> = (0..members)
            .map(|i| Underlay::of_host(String::new(), ETCD_HOST_BASE + i as u16))
            .collect();
        let addrs: Vec<String> = ips
            .iter()
            .flat_map(|u| {
                [
                    format!("{}/{UNDERLAY_V4_LEN}", u.v4),
                    format!("{}/{UNDERLAY_V6_LEN}", u.v6),
                ]
            })
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
            .map(|(i, u)| EtcdMember {
                name: format!("m{i}"),
                ip: u.v4,
                ip6: u.v6,
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
            let listen = format!("{client},{}", member.client_url_v6());
            // With a data dir that already holds the member, etcd ignores
            // the --initial-* flags: restarts use the same command line.
            member.args = [
                "--name",
                &member.name,
                "--data-dir",
                &data_dir.display().to_string(),
                "--listen-client-urls",
                &listen,
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

    /// Member `i`'s client URL on its IPv6 address.
    pub fn endpoint_v6(&self, i: usize) -> String {
        self.members[i].client_url_v6()
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
                    let bytes = BASE64_STANDARD
                        .decode(b64)
                        .unwrap_or_else(|e| panic!("etcdctl get: bad base64 {name} {b64:?}: {e}"));
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
                    "etcd members {which:?} not healthy within {ETCD_READY_TIMEOUT:?}:\n{}\n{}",
                    crate::output_text(&out),
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
