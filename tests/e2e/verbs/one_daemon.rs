//! One daemon per node: a second `tetherd` started beside a live one, on
//! the same state dir, on the same socket, or on neither but in the same
//! network namespace, exits at once with a message naming the first, and
//! changes nothing: the node's routes and links, the
//! bytes of every file in the state dir, the socket, and the pods' traffic
//! (two pods ping each other, both families, throughout). Run as root.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use tether_e2e::{
    add, require_root, tether_bin, tetherd_bin, AddResult, Daemon, DaemonOpts, Netns, TempDir,
};

use super::paths_under;

const CIDRS: [&str; 2] = ["10.86.0.0/24", "fd00:86::/120"];
const NET: &str = "onedaemon";
/// Each ping stream: this many echo requests, one every 20 ms (6 s).
const PINGS: u32 = 300;

/// A `ping` running in a pod netns, killed (if still running) on drop.
struct Pinger {
    child: Option<Child>,
    what: String,
}

impl Pinger {
    fn start(from: &Netns, to: &str) -> Pinger {
        let fam = if to.contains(':') { "-6" } else { "-4" };
        let count = PINGS.to_string();
        let child = Command::new("ip")
            .args(["netns", "exec", from.name(), "ping", fam, "-n", "-q"])
            .args(["-i", "0.02", "-w", "60", "-c", &count, to])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawning ping: {e}"));
        Pinger {
            child: Some(child),
            what: format!("ping {fam} {} -> {to}", from.name()),
        }
    }

    fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Waits for the last reply and returns (sent, received).
    fn finish(mut self) -> (u32, u32) {
        let child = self.child.take().expect("finish once");
        let out = child.wait_with_output().expect("waiting for ping");
        let text = String::from_utf8_lossy(&out.stdout);
        // "300 packets transmitted, 300 received, 0% packet loss, ..."
        let summary = text
            .lines()
            .find(|l| l.contains("packets transmitted"))
            .unwrap_or_else(|| panic!("{}: no summary in {text:?}", self.what));
        let number = |after: &str| -> u32 {
            summary
                .split(", ")
                .find_map(|part| part.strip_suffix(after))
                .and_then(|n| n.trim().parse().ok())
                .unwrap_or_else(|| panic!("{}: cannot read {after:?} in {summary:?}", self.what))
        };
        (number(" packets transmitted"), number(" received"))
    }
}

impl Drop for Pinger {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Our own unreaped child.
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Everything a second daemon must leave as it was.
#[derive(Debug, PartialEq)]
struct NodeState {
    routes: Vec<(String, String)>,
    /// tether's veths with their ifindex: a link deleted and made again
    /// has another.
    links: Vec<(String, u64)>,
    /// Every file under the state dir, with its bytes.
    files: BTreeMap<String, Vec<u8>>,
    /// The socket's inode: a socket bound again has another.
    socket_inode: u64,
    pending_del_link: Option<PathBuf>,
}

impl NodeState {
    fn take(d: &Daemon) -> NodeState {
        let mut links: Vec<(String, u64)> = d
            .node()
            .links()
            .iter()
            .filter_map(|l| {
                let name = l["ifname"].as_str()?;
                tether_e2e::is_tether_link(name)
                    .then(|| (name.to_owned(), l["ifindex"].as_u64().unwrap_or(0)))
            })
            .collect();
        links.sort();
        let mut pending = d.socket().as_os_str().to_owned();
        pending.push(".pending-del");
        NodeState {
            routes: d.node().tether_routes(),
            links,
            files: file_bytes(d.state_dir()),
            socket_inode: std::fs::metadata(d.socket())
                .map(|m| m.ino())
                .unwrap_or_else(|e| panic!("stat {}: {e}", d.socket().display())),
            pending_del_link: std::fs::read_link(PathBuf::from(pending)).ok(),
        }
    }
}

/// Every regular file under `dir`, relative path to bytes.
fn file_bytes(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    paths_under(dir)
        .into_iter()
        .filter(|(_, path)| !path.is_dir())
        .map(|(rel, path)| (rel, std::fs::read(&path).unwrap_or_default()))
        .collect()
}

/// A live daemon with two pods pinging each other.
struct Fixture {
    daemon: Daemon,
    pods: [(Netns, AddResult); 2],
}

fn fixture() -> Fixture {
    let daemon = Daemon::start(DaemonOpts {
        pod_cidrs: CIDRS.iter().map(|c| c.to_string()).collect(),
        ..DaemonOpts::default()
    });
    let conf = daemon.netconf("1.1.0", NET);
    let pod = |tag: &str, id: &str| {
        let ns = Netns::new(tag);
        let added = AddResult::from_output(add(&tether_bin(), &conf, id, &ns).assert_success());
        (ns, added)
    };
    let pods = [pod("odA", "od-a"), pod("odB", "od-b")];
    Fixture { daemon, pods }
}

/// Runs a second tetherd in the live daemon's node netns with these
/// arguments, bounded by `timeout` in case it wrongly starts serving.
fn second_tetherd(d: &Daemon, args: &[&str]) -> Output {
    let bin = tetherd_bin().display().to_string();
    let mut argv = vec!["timeout", "20", &bin, "--node-name", d.node_name()];
    argv.extend_from_slice(&["--pod-cidr", CIDRS[0], "--pod-cidr", CIDRS[1]]);
    argv.extend_from_slice(args);
    d.node().exec(&argv)
}

fn said(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout)
}

/// Starts the pings, runs `attempts` while they run, checks that nothing
/// changed and that no ping was lost; returns what each attempt printed.
fn attempts_change_nothing(
    fx: &mut Fixture,
    attempts: &[&dyn Fn(&Daemon) -> Output],
) -> Vec<String> {
    let [(a, _), (_, b)] = &fx.pods;
    let mut pingers = vec![Pinger::start(a, &b.v4), Pinger::start(a, &b.v6)];
    // Both streams answer before the second daemon comes.
    std::thread::sleep(Duration::from_millis(500));
    let before = NodeState::take(&fx.daemon);
    assert_eq!(before.routes.len(), 4, "{before:?}");
    let mut outputs = Vec::new();
    for attempt in attempts {
        let out = attempt(&fx.daemon);
        let text = said(&out);
        assert_eq!(
            out.status.code(),
            Some(1),
            "the second tetherd did not exit 1 at once: {}\n{text}",
            out.status
        );
        assert!(!text.contains("reconciled"), "it reconciled: {text}");
        outputs.push(text);
    }
    let after = NodeState::take(&fx.daemon);
    assert_eq!(
        before, after,
        "the second tetherd changed the live one's state"
    );
    assert!(
        fx.daemon.is_running(),
        "the live tetherd died:\n{}",
        fx.daemon.log()
    );
    for p in &mut pingers {
        assert!(p.running(), "{}: ended before the attempts did", p.what);
    }
    for p in pingers {
        let what = p.what.clone();
        let (sent, received) = p.finish();
        eprintln!("{what}: {sent} sent, {received} received");
        assert_eq!(
            (sent, received),
            (PINGS, PINGS),
            "{what}: lost {}",
            sent - received
        );
    }
    // And the live daemon still answers for its pods.
    for (i, (ns, added)) in fx.pods.iter().enumerate() {
        added.assert_check_passes(&fx.daemon, NET, ["od-a", "od-b"][i], ns);
    }
    outputs
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn a_second_daemon_on_the_same_state_dir_exits_and_changes_nothing() {
    require_root();
    let mut fx = fixture();
    let pid = fx.daemon.pid().expect("running");
    let other_socket = fx.daemon.dir().join("other.sock");
    let same_everything = |d: &Daemon| {
        second_tetherd(
            d,
            &[
                "--socket",
                &d.socket().display().to_string(),
                "--state-dir",
                &d.state_dir().display().to_string(),
            ],
        )
    };
    let same_state_dir = |d: &Daemon| {
        second_tetherd(
            d,
            &[
                "--socket",
                &other_socket.display().to_string(),
                "--state-dir",
                &d.state_dir().display().to_string(),
            ],
        )
    };
    let outputs = attempts_change_nothing(&mut fx, &[&same_everything, &same_state_dir]);
    for text in &outputs {
        assert!(
            text.contains(&format!(
                "another tetherd (pid {pid}) holds the state dir {}",
                fx.daemon.state_dir().display()
            )),
            "{text}"
        );
        assert!(text.contains("stop it first"), "{text}");
        assert!(
            !text.contains("code"),
            "a start-up error with a CNI code: {text}"
        );
    }
    assert!(
        !other_socket.exists(),
        "the refused daemon bound {}",
        other_socket.display()
    );
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn a_second_daemon_on_the_same_socket_with_another_state_dir_exits_and_changes_nothing() {
    require_root();
    let mut fx = fixture();
    let pid = fx.daemon.pid().expect("running");
    let fresh = TempDir::new("odst");
    let state = fresh.path().join("state");
    let another_state_dir = |d: &Daemon| {
        second_tetherd(
            d,
            &[
                "--socket",
                &d.socket().display().to_string(),
                "--state-dir",
                &state.display().to_string(),
            ],
        )
    };
    let outputs = attempts_change_nothing(&mut fx, &[&another_state_dir]);
    let socket = fx.daemon.socket().display().to_string();
    assert!(
        outputs[0].contains(&format!(
            "another tetherd (pid {pid}) holds the socket {socket}"
        )),
        "{}",
        outputs[0]
    );
    // It opened no store: its own state dir holds its lock file only.
    let files: Vec<String> = file_bytes(&state).into_keys().collect();
    assert_eq!(files, ["tetherd.lock"]);
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn a_second_daemon_with_its_own_paths_in_the_same_netns_exits_and_changes_nothing() {
    require_root();
    let mut fx = fixture();
    let pid = fx.daemon.pid().expect("running");
    let own = TempDir::new("odns");
    let (state, socket) = (own.path().join("state"), own.path().join("t.sock"));
    let its_own_paths = |d: &Daemon| {
        second_tetherd(
            d,
            &[
                "--socket",
                &socket.display().to_string(),
                "--state-dir",
                &state.display().to_string(),
            ],
        )
    };
    let outputs = attempts_change_nothing(&mut fx, &[&its_own_paths]);
    assert!(
        outputs[0].contains(&format!(
            "another tetherd (pid {pid}) runs in this network namespace"
        )),
        "{}",
        outputs[0]
    );
    // It opened no store and served nothing.
    let files: Vec<String> = file_bytes(&state).into_keys().collect();
    assert_eq!(files, ["tetherd.lock"]);
    assert!(!socket.exists());
}
