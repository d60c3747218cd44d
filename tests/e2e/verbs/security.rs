//! Who may talk to tetherd: the socket is root's (mode 0600), and the
//! daemon checks each peer's uid (SO_PEERCRED) on top of that. A non-root
//! caller is run as uid/gid 65534 through util-linux's `setpriv`, with and
//! without CAP_DAC_OVERRIDE (which gets it past the file mode, so that only
//! the daemon's own check stands in its way). Run as root.

use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;
use tether_e2e::{
    cni, require_root, tether_bin, with_prev, CniEnv, CniOutput, Daemon, Netns, TempDir,
};

/// The unprivileged uid and gid (nobody/nogroup).
const NOBODY: u32 = 65534;
const CIDR: &str = "10.82.0.0/24";

/// Panics (the test fails, it does not skip) unless `setpriv` is there.
fn require_setpriv() {
    let found = Command::new("sh")
        .args(["-c", "command -v setpriv"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "setpriv (util-linux) is required to run the plugin as a non-root user; \
         run tests/setup.sh"
    );
}

/// How the plugin is run as uid 65534.
#[derive(Clone, Copy, Debug)]
enum Caller {
    /// No capabilities at all.
    Plain,
    /// With CAP_DAC_OVERRIDE (inheritable and ambient), which passes the
    /// socket's file mode but not the daemon's SO_PEERCRED check.
    DacOverride,
}

/// A wrapper script that execs `tether` as uid/gid 65534 through setpriv,
/// so that the harness's [`cni`] can run it like any plugin.
struct AsNobody {
    _dir: TempDir,
    script: PathBuf,
}

impl AsNobody {
    fn new(caller: Caller) -> AsNobody {
        require_setpriv();
        let dir = TempDir::new("sec");
        let script = dir.path().join("tether-as-nobody");
        let caps = match caller {
            Caller::Plain => "",
            Caller::DacOverride => "--inh-caps=+dac_override --ambient-caps=+dac_override ",
        };
        let body = format!(
            "#!/bin/sh\nexec setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups {caps}'{}'\n",
            tether_bin().display()
        );
        std::fs::write(&script, body).expect("writing the wrapper");
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755))
            .expect("chmod of the wrapper");
        AsNobody { _dir: dir, script }
    }

    fn run(&self, env: &CniEnv, conf: &Value) -> CniOutput {
        cni(&self.script, env, &serde_json::to_vec(conf).expect("JSON"))
    }
}

fn as_root(env: &CniEnv, conf: &Value) -> CniOutput {
    cni(&tether_bin(), env, &serde_json::to_vec(conf).expect("JSON"))
}

/// Asserts the daemon holds no attachment and no address, and `pod` got
/// no interface.
fn assert_nothing_allocated(daemon: &Daemon, pod: &Netns) {
    assert!(daemon.attachments().is_empty());
    let node = daemon.node_info();
    assert!(node.pools.iter().all(|p| p.used == 0), "{node:?}");
    assert_eq!(pod.link_names(), ["lo"]);
    assert_eq!(daemon.node().link_names(), ["lo"]);
}

fn queue_entries(daemon: &Daemon) -> Vec<String> {
    match std::fs::read_dir(daemon.state_dir().join("pending-del")) {
        Ok(entries) => entries
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect(),
        Err(_) => Vec::new(),
    }
}

// ---------------------------------------------------------------------------

/// The socket is a socket, owned by root:root, mode 0600.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn socket_is_root_only() {
    require_root();
    let daemon = Daemon::with_cidrs(&[CIDR], &[]);
    let meta = std::fs::metadata(daemon.socket()).expect("stat of the socket");
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.mode() & 0o7777, 0o600, "mode {:o}", meta.mode());
    assert_eq!((meta.uid(), meta.gid()), (0, 0));
}

/// Without capabilities, uid 65534 cannot even connect (EACCES from the
/// file mode): ADD fails with 11 naming the cause, and nothing is allocated.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn non_root_without_capabilities_cannot_connect() {
    require_root();
    let daemon = Daemon::with_cidrs(&[CIDR], &[]);
    let nobody = AsNobody::new(Caller::Plain);
    let pod = Netns::new("pod");
    let conf = daemon.netconf("1.1.0", "sec");

    let out = nobody.run(&CniEnv::new("ADD", "sec-plain", &pod), &conf);
    assert_eq!(out.error_code(), Some(11), "{out}");
    assert!(
        out.stdout.contains("Permission denied") || out.stdout.contains("os error 13"),
        "the error names EACCES: {out}"
    );
    assert!(
        !daemon.log().contains("refused a peer"),
        "the connection never reached the daemon"
    );
    assert_nothing_allocated(&daemon, &pod);
}

/// With CAP_DAC_OVERRIDE the connect succeeds, but the daemon's SO_PEERCRED
/// check drops the peer: ADD fails with 11, the daemon logs the refusal,
/// and nothing is allocated.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn peer_credentials_refuse_a_capable_non_root_caller() {
    require_root();
    let daemon = Daemon::with_cidrs(&[CIDR], &[]);
    let nobody = AsNobody::new(Caller::DacOverride);
    let pod = Netns::new("pod");
    let conf = daemon.netconf("1.1.0", "sec");

    let out = nobody.run(&CniEnv::new("ADD", "sec-cap", &pod), &conf);
    assert_eq!(out.error_code(), Some(11), "{out}");
    assert!(
        !out.stdout.contains("Permission denied"),
        "the connect itself succeeded: {out}"
    );
    let log = daemon.log();
    let refusals: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("refused a peer"))
        .collect();
    assert!(!refusals.is_empty(), "no refusal in the log:\n{log}");
    assert!(
        refusals.iter().any(|l| l.contains(&NOBODY.to_string())),
        "the refusal names uid {NOBODY}: {refusals:?}"
    );
    assert_nothing_allocated(&daemon, &pod);

    // The other verbs are refused too (11 for CHECK, 50 for STATUS).
    let out = nobody.run(&CniEnv::new("CHECK", "sec-cap", &pod), &conf);
    assert_eq!(out.error_code(), Some(11), "CHECK: {out}");
    let out = nobody.run(&CniEnv::new("STATUS", "sec-cap", &pod), &conf);
    assert_eq!(out.error_code(), Some(50), "STATUS: {out}");
    assert_nothing_allocated(&daemon, &pod);
}

/// With `--allow-uid 65534` the same caller is served: ADD, CHECK and DEL
/// work, and the daemon logs no refusal.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn allowed_uid_is_served() {
    require_root();
    let uid = NOBODY.to_string();
    let daemon = Daemon::with_cidrs(&[CIDR], &["--allow-uid", &uid]);
    let nobody = AsNobody::new(Caller::DacOverride);
    let pod = Netns::new("pod");
    let conf = daemon.netconf("1.1.0", "sec");

    let out = nobody.run(&CniEnv::new("ADD", "sec-allowed", &pod), &conf);
    let result = out.result().clone();
    let listed = daemon.attachments();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].container_id, "sec-allowed");
    assert!(pod.link_names().contains(&"eth0".to_owned()));
    assert_eq!(
        pod.addrs_of("eth0")
            .iter()
            .filter(|a| a.starts_with("10.82.0."))
            .count(),
        1,
        "{:?}",
        pod.addrs_of("eth0")
    );

    let check = nobody.run(
        &CniEnv::new("CHECK", "sec-allowed", &pod),
        &with_prev(&conf, &result),
    );
    assert!(check.success(), "CHECK: {check}");
    let del = nobody.run(&CniEnv::new("DEL", "sec-allowed", &pod), &conf);
    assert!(del.success(), "DEL: {del}");
    assert!(daemon.attachments().is_empty());
    assert!(
        !daemon.log().contains("refused a peer"),
        "an allowed uid was refused"
    );
}

/// A DEL from a non-root caller the daemon would not serve must not end up
/// in the daemon's pending-DEL queue: the shim falls back to the queue when
/// it cannot connect, and the queue dir is root's. The DEL fails with 11,
/// nothing is queued, and the attachment survives a restart (which replays
/// the queue before serving). A `stateDir` of the caller's choosing in the
/// netconf changes nothing: the shim no longer reads it.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn refused_non_root_del_is_not_queued() {
    require_root();
    let mut daemon = Daemon::with_cidrs(&[CIDR], &[]);
    let nobody = AsNobody::new(Caller::Plain);
    let pod = Netns::new("pod");
    let conf = daemon.netconf("1.1.0", "sec");
    let env = CniEnv::new("ADD", "sec-del", &pod);
    let result = as_root(&env, &conf).result().clone();
    let del_env = CniEnv::new("DEL", "sec-del", &pod);

    // The daemon made the queue root-only and linked it beside the socket.
    let queue = daemon.state_dir().join("pending-del");
    let mode = std::fs::metadata(&queue)
        .expect("queue dir")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700, "{}", queue.display());
    let out = nobody.run(&del_env, &conf);
    assert_eq!(
        out.error_code(),
        Some(11),
        "DEL with a 0700 queue dir: {out}"
    );
    assert!(
        queue_entries(&daemon).is_empty(),
        "{:?}",
        queue_entries(&daemon)
    );

    let own = TempDir::new("own");
    std::os::unix::fs::chown(own.path(), Some(NOBODY), Some(NOBODY)).expect("chown");
    let mut elsewhere = conf.clone();
    elsewhere["stateDir"] = own.path().display().to_string().into();
    let out = nobody.run(&del_env, &elsewhere);
    assert_eq!(out.error_code(), Some(11), "DEL naming a stateDir: {out}");
    let written: Vec<_> = std::fs::read_dir(own.path())
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    assert!(written.is_empty(), "the shim wrote {written:?}");
    assert!(
        queue_entries(&daemon).is_empty(),
        "{:?}",
        queue_entries(&daemon)
    );

    daemon.restart();
    let listed = daemon.attachments();
    assert_eq!(listed.len(), 1, "the attachment survived: {listed:?}");
    let check = as_root(
        &CniEnv::new("CHECK", "sec-del", &pod),
        &with_prev(&conf, &result),
    );
    assert!(check.success(), "CHECK after the refused DELs: {check}");
}

/// The same for a caller with CAP_DAC_OVERRIDE, the one kind of non-root
/// caller the daemon's SO_PEERCRED check exists for (without the capability
/// it cannot connect at all). The daemon drops its connection, so the shim
/// counts the daemon as unreachable and queues the DEL; the capability lets
/// it write the root-only queue dir. That entry must not be trusted: after
/// a restart (which replays the queue) the attachment is still there.
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn refused_capable_peer_cannot_del_through_the_queue() {
    require_root();
    let mut daemon = Daemon::with_cidrs(&[CIDR], &[]);
    let nobody = AsNobody::new(Caller::DacOverride);
    let pod = Netns::new("pod");
    let conf = daemon.netconf("1.1.0", "sec");
    let result = as_root(&CniEnv::new("ADD", "sec-cap-del", &pod), &conf)
        .result()
        .clone();

    let out = nobody.run(&CniEnv::new("DEL", "sec-cap-del", &pod), &conf);
    let queued: Vec<String> = queue_entries(&daemon)
        .iter()
        .map(|name| {
            let path = daemon.state_dir().join("pending-del").join(name);
            let uid = std::fs::metadata(&path)
                .map(|m| m.uid())
                .unwrap_or(u32::MAX);
            format!("{name} (owner uid {uid})")
        })
        .collect();

    daemon.restart();
    let listed = daemon.attachments();
    assert_eq!(
        listed.len(),
        1,
        "a DEL from uid {NOBODY}, which the daemon refuses, was executed from the \
         pending-DEL queue.\nshim: {out}\nqueued: {queued:?}"
    );
    let check = as_root(
        &CniEnv::new("CHECK", "sec-cap-del", &pod),
        &with_prev(&conf, &result),
    );
    assert!(check.success(), "CHECK after the refused DEL: {check}");
}
