//! What Kubernetes' sig-network Conformance tests need, built here
//! (tether_e2e::conformance_images), checked without a cluster:
//!
//! - `e2e.test`, dry-run with the Conformance focus, lists exactly the
//!   [sig-network] tests of upstream's conformance.yaml (47 in v1.37.2);
//! - each image's archive carries its name, its blobs match their digests,
//!   and its layers, unpacked in order, hold what the tests run: agnhost's
//!   tools, its CoreDNS answering from a hosts block, nginx serving on port
//!   80, a pause that exits at once on SIGTERM and SIGINT, busybox's
//!   applets, CoreDNS with kubeadm's plugins.
//!
//! The servers run chrooted in a netns of their own. Root only.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tether_e2e::conformance_images::{
    conformance_images, coredns_dir, e2e_dir, AGNHOST, BUSYBOX, COREDNS, GLIBC_DNS_TESTING, IMAGES,
    NGINX, PAUSE,
};
use tether_e2e::{require_root, wait_until, Netns, TempDir};

/// The plugins the CoreDNS build links, as `coredns -plugins` names them:
/// kubeadm's Corefile's, hosts and log for the e2e DNS tests' own server,
/// and debug, dnstap, metadata and transfer, which some of those import.
const DNS_PLUGINS: [&str; 16] = [
    "cache",
    "debug",
    "dnstap",
    "errors",
    "forward",
    "health",
    "hosts",
    "kubernetes",
    "loadbalance",
    "log",
    "loop",
    "metadata",
    "prometheus",
    "ready",
    "reload",
    "transfer",
];

fn output(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"))
}

fn run_ok(cmd: &mut Command) -> String {
    let out = output(cmd);
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn e2e_dry_run_lists_every_sig_network_conformance_test() {
    require_root();
    let dir = e2e_dir();
    let listed: Vec<BTreeMap<String, serde_yaml_ng::Value>> = serde_yaml_ng::from_str(
        &std::fs::read_to_string(dir.join("conformance.yaml")).expect("reading conformance.yaml"),
    )
    .expect("parsing conformance.yaml");
    let wanted: BTreeSet<String> = listed
        .iter()
        .filter_map(|t| t.get("codename").and_then(|c| c.as_str()))
        .filter(|c| c.contains("[sig-network]"))
        .map(str::to_string)
        .collect();

    let tmp = TempDir::new("e2edry");
    let report = tmp.path().join("report.json");
    let start = Instant::now();
    run_ok(
        Command::new(dir.join("e2e.test"))
            .current_dir(tmp.path())
            .arg("--provider=skeleton")
            .arg(format!(
                "--kubeconfig={}",
                tmp.path().join("none.kubeconfig").display()
            ))
            .arg(r"--ginkgo.focus=\[sig-network\].*\[Conformance\]")
            .arg("--ginkgo.dry-run")
            .arg("--ginkgo.no-color")
            .arg(format!("--ginkgo.json-report={}", report.display())),
    );
    let report: Value = serde_json::from_str(
        &std::fs::read_to_string(&report).expect("reading the dry run's report"),
    )
    .expect("parsing the dry run's report");
    let mut selected = BTreeSet::new();
    for suite in report.as_array().expect("a list of suites") {
        for spec in suite["SpecReports"].as_array().into_iter().flatten() {
            // A dry run "passes" the specs the focus selects and skips the
            // others.
            if spec["LeafNodeType"] == "It" && spec["State"] == "passed" {
                let mut name: Vec<&str> = spec["ContainerHierarchyTexts"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                    .collect();
                name.push(spec["LeafNodeText"].as_str().unwrap_or_default());
                selected.insert(name.join(" "));
            }
        }
    }
    eprintln!(
        "e2e.test dry run: {} specs selected in {:.1} s",
        selected.len(),
        start.elapsed().as_secs_f64()
    );
    assert_eq!(
        selected,
        wanted,
        "the dry run's selection (left) is not conformance.yaml's [sig-network] tests (right); \
         missing: {:?}, extra: {:?}",
        wanted.difference(&selected).collect::<Vec<_>>(),
        selected.difference(&wanted).collect::<Vec<_>>()
    );
    assert_eq!(selected.len(), 47, "Kubernetes v1.37.2 has 47 of them");
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn coredns_links_kubeadms_plugins() {
    require_root();
    let coredns = coredns_dir().join("coredns");
    let plugins = run_ok(Command::new(&coredns).arg("-plugins"));
    let linked: BTreeSet<&str> = plugins
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    assert_eq!(linked, BTreeSet::from(DNS_PLUGINS), "{plugins}");
    let version = run_ok(Command::new(&coredns).arg("-version"));
    assert!(version.contains("CoreDNS-1.14.6"), "{version}");
}

/// An image archive, opened: its index, manifest and config, and its
/// layers unpacked in order into a root.
struct Unpacked {
    _dir: TempDir,
    root: PathBuf,
    config: Value,
}

fn read_member(archive: &Path, member: &str) -> Vec<u8> {
    let out = output(Command::new("tar").arg("-xOf").arg(archive).arg(member));
    assert!(
        out.status.success(),
        "reading {member} from {}: {}",
        archive.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

fn digest_path(digest: &str) -> String {
    format!(
        "blobs/sha256/{}",
        digest.strip_prefix("sha256:").expect("a sha256 digest")
    )
}

fn unpack(name: &str, archive: &Path) -> Unpacked {
    let dir = TempDir::new("cimg");
    let image = dir.path().join("image");
    std::fs::create_dir(&image).expect("creating the image dir");
    run_ok(
        Command::new("tar")
            .arg("-C")
            .arg(&image)
            .arg("-xf")
            .arg(archive),
    );
    let index: Value = serde_json::from_slice(&read_member(archive, "index.json")).expect("index");
    let manifests = index["manifests"]
        .as_array()
        .expect("the index's manifests");
    assert_eq!(manifests.len(), 1, "{index}");
    assert_eq!(
        manifests[0]["annotations"]["io.containerd.image.name"],
        name,
        "the name ctr imports {} as",
        archive.display()
    );
    // Every blob is named by its digest and has the size its reference says.
    let check = |reference: &Value| -> Vec<u8> {
        let digest = reference["digest"].as_str().expect("a digest");
        let path = image.join(digest_path(digest));
        let sum = run_ok(Command::new("sha256sum").arg(&path));
        assert_eq!(
            Some(digest.trim_start_matches("sha256:")),
            sum.split_whitespace().next(),
            "blob {digest} of {name}"
        );
        let size = std::fs::metadata(&path).expect("a blob").len();
        assert_eq!(reference["size"].as_u64(), Some(size), "size of {digest}");
        if reference["mediaType"]
            .as_str()
            .is_some_and(|t| t.ends_with("+json"))
        {
            std::fs::read(&path).expect("reading a blob")
        } else {
            Vec::new()
        }
    };
    let manifest: Value = serde_json::from_slice(&check(&manifests[0])).expect("manifest");
    let config: Value = serde_json::from_slice(&check(&manifest["config"])).expect("config");
    let layers = manifest["layers"].as_array().expect("the layers");
    assert_eq!(
        config["rootfs"]["diff_ids"].as_array().map(Vec::len),
        Some(layers.len()),
        "one diff_id per layer: {config}"
    );
    let root = dir.path().join("root");
    std::fs::create_dir(&root).expect("creating the root");
    for layer in layers {
        check(layer);
        let blob = image.join(digest_path(layer["digest"].as_str().expect("digest")));
        run_ok(
            Command::new("tar")
                .args(["--numeric-owner", "-p", "-C"])
                .arg(&root)
                .arg("-xf")
                .arg(&blob),
        );
        std::fs::remove_file(&blob).expect("removing an unpacked layer");
    }
    Unpacked {
        _dir: dir,
        root,
        config: config["config"].clone(),
    }
}

impl Unpacked {
    /// `argv` chrooted in the root (in this netns); its output.
    fn chroot(&self, argv: &[&str]) -> Output {
        output(Command::new("chroot").arg(&self.root).args(argv))
    }

    /// `argv` chrooted in the root; its stdout, or a panic with its stderr.
    fn chroot_ok(&self, argv: &[&str]) -> String {
        run_ok(Command::new("chroot").arg(&self.root).args(argv))
    }

    /// The config's `key` (`Entrypoint`, `Cmd`) as strings.
    fn strings(&self, key: &str) -> Vec<String> {
        self.config[key]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect()
    }

    /// What a runtime runs for a container that gives no command:
    /// entrypoint, then command.
    fn default_argv(&self) -> Vec<String> {
        let mut argv = self.strings("Entrypoint");
        argv.extend(self.strings("Cmd"));
        argv
    }

    /// Starts `argv` chrooted in the root, in `ns` if given, in a private
    /// mount namespace with the machine's /dev bound in and a /proc, as a
    /// runtime provides them: nothing mounted there is seen outside. Each
    /// step execs the next, so the child's pid is `argv`'s.
    fn start(&self, ns: Option<&Netns>, argv: &[String]) -> Child {
        let mut cmd = Command::new(if ns.is_some() { "ip" } else { "unshare" });
        if let Some(ns) = ns {
            cmd.args(["netns", "exec", ns.name(), "unshare"]);
        }
        cmd.args(["--mount", "--propagation", "private", "sh", "-c"])
            .arg(concat!(
                r#"mount --bind /dev "$0/dev" && mount -t proc proc "$0/proc" && "#,
                r#"exec chroot "$0" "$@""#
            ))
            .arg(&self.root)
            .args(argv)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {argv:?}: {e}"))
    }
}

/// Stops `child` (by its handle) and reaps it.
fn stop(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
}

fn images() -> BTreeMap<String, PathBuf> {
    let images: BTreeMap<String, PathBuf> = conformance_images().into_iter().collect();
    assert_eq!(
        images.keys().map(String::as_str).collect::<BTreeSet<_>>(),
        BTreeSet::from(IMAGES)
    );
    for (name, archive) in &images {
        let size = std::fs::metadata(archive).map(|m| m.len()).unwrap_or(0);
        eprintln!(
            "{name}: {} ({:.1} MiB)",
            archive.display(),
            size as f64 / 1048576.0
        );
    }
    images
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn agnhost_serves_dns_with_its_coredns_and_has_the_tests_tools() {
    require_root();
    let images = images();
    let agnhost = unpack(AGNHOST, &images[AGNHOST]);
    assert_eq!(agnhost.default_argv(), ["/agnhost", "pause"]);
    let version = agnhost.chroot_ok(&["/agnhost", "--version"]);
    assert!(version.contains("2.66.1"), "{version}");
    // The tools the e2e tests run in agnhost pods, by the names they use
    // (wget: two Services tests outside the Conformance set), and iperf,
    // which upstream's image has too.
    for tool in [
        "dig", "nslookup", "curl", "wget", "nc", "ip", "ss", "bash", "socat", "getent", "seq",
        "timeout", "iperf",
    ] {
        let out = agnhost.chroot(&["sh", "-c", &format!("command -v {tool}")]);
        assert!(out.status.success(), "{tool} is missing in agnhost");
    }
    for file in [
        "localhost.crt",
        "localhost.key",
        "coredns",
        "agnhost-2",
        "uploads",
    ] {
        assert!(
            agnhost.root.join(file).symlink_metadata().is_ok(),
            "/{file} is missing in agnhost"
        );
    }
    let id = agnhost.chroot_ok(&["id", "user-defined-in-image"]);
    assert!(
        id.contains("uid=1000") && id.contains("50000(group-defined-in-image)"),
        "{id}"
    );

    // The DNS tests' own server: agnhost's /coredns with a hosts block and
    // log, queried with dig over UDP and TCP, and the PTR the hosts plugin
    // derives.
    std::fs::write(
        agnhost.root.join("tmp/Corefile"),
        ". {\n    hosts {\n        192.0.2.123 my.test\n    }\n    log\n}\n",
    )
    .expect("writing a Corefile");
    let ns = Netns::new("cimg");
    let server = agnhost.start(
        Some(&ns),
        &["/coredns".into(), "-conf".into(), "/tmp/Corefile".into()],
    );
    let dig = |args: &[&str]| -> String {
        let mut argv = vec!["chroot", agnhost.root.to_str().expect("a UTF-8 path")];
        argv.extend(["dig", "@127.0.0.1", "+short", "+time=1", "+tries=1"]);
        argv.extend(args);
        String::from_utf8_lossy(&ns.exec(&argv).stdout)
            .trim()
            .to_string()
    };
    let answered = wait_until(Duration::from_secs(20), || {
        dig(&["my.test", "A"]) == "192.0.2.123"
    });
    let (tcp, ptr) = (dig(&["+tcp", "my.test", "A"]), dig(&["-x", "192.0.2.123"]));
    stop(server);
    assert!(answered, "agnhost's /coredns did not answer my.test");
    assert_eq!(tcp, "192.0.2.123", "over TCP");
    assert_eq!(ptr, "my.test.", "the PTR of a hosts entry");
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn glibc_dns_testing_has_dig() {
    require_root();
    let images = images();
    let glibc = unpack(GLIBC_DNS_TESTING, &images[GLIBC_DNS_TESTING]);
    let dig = glibc.chroot_ok(&["dig", "-v"]);
    let dig = dig + &String::from_utf8_lossy(&glibc.chroot(&["dig", "-v"]).stderr);
    assert!(dig.contains("DiG"), "{dig}");
    let getent = glibc.chroot(&["sh", "-c", "command -v getent"]);
    assert!(getent.status.success(), "getent is missing");
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn nginx_serves_on_port_80() {
    require_root();
    let images = images();
    let nginx = unpack(NGINX, &images[NGINX]);
    let agnhost = unpack(AGNHOST, &images[AGNHOST]);
    assert_eq!(nginx.default_argv(), ["nginx", "-g", "daemon off;"]);
    let ns = Netns::new("cimg");
    let server = nginx.start(Some(&ns), &nginx.default_argv());
    let curl = || {
        ns.exec(&[
            "chroot",
            agnhost.root.to_str().expect("a UTF-8 path"),
            "curl",
            "-sf",
            "--max-time",
            "2",
            "http://127.0.0.1:80/",
        ])
    };
    let mut page = String::new();
    let served = wait_until(Duration::from_secs(20), || {
        let out = curl();
        page = String::from_utf8_lossy(&out.stdout).into_owned();
        out.status.success()
    });
    stop(server);
    assert!(served, "nginx did not serve on port 80");
    assert!(page.contains("nginx"), "{page}");
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn pause_stops_at_once_on_sigterm_and_sigint() {
    require_root();
    let images = images();
    let pause = unpack(PAUSE, &images[PAUSE]);
    assert_eq!(pause.default_argv(), ["/pause"]);
    // As a run started in the background of a shell has it: SIGINT
    // ignored, until the harness gives it its default action back.
    // SAFETY: setting a signal's action touches no memory of this process's.
    unsafe { libc::signal(libc::SIGINT, libc::SIG_IGN) };
    tether_e2e::default_signal_actions();
    for signal in [libc::SIGTERM, libc::SIGINT] {
        let mut child = pause.start(None, &pause.default_argv());
        std::thread::sleep(Duration::from_millis(500));
        assert!(
            child.try_wait().expect("polling /pause").is_none(),
            "/pause exited by itself"
        );
        // SAFETY: kill has no memory preconditions; the pid is our child's,
        // not yet reaped.
        let rc = unsafe { libc::kill(child.id() as libc::pid_t, signal) };
        assert_eq!(rc, 0, "signalling /pause");
        let sent = Instant::now();
        let mut status = None;
        wait_until(Duration::from_secs(5), || {
            status = child.try_wait().expect("polling /pause");
            status.is_some()
        });
        let Some(status) = status else {
            stop(child);
            panic!("/pause still runs 5 s after signal {signal}");
        };
        assert!(status.success(), "/pause on signal {signal}: {status}");
        eprintln!("/pause stopped {:?} after signal {signal}", sent.elapsed());
    }
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn busybox_has_every_applet() {
    require_root();
    let images = images();
    let busybox = unpack(BUSYBOX, &images[BUSYBOX]);
    assert_eq!(busybox.default_argv(), ["sh"]);
    let applets = run_ok(Command::new("/bin/busybox").arg("--list-full"));
    for applet in applets.lines().filter(|a| !a.is_empty()) {
        assert!(
            busybox.root.join(applet).symlink_metadata().is_ok(),
            "/{applet} is missing"
        );
    }
    let out = busybox.chroot_ok(&["sh", "-c", "echo hello | wc -c; nslookup 2>&1 | head -n 1"]);
    assert!(out.starts_with("6\n"), "{out}");
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn coredns_image_runs_coredns() {
    require_root();
    let images = images();
    let coredns = unpack(COREDNS, &images[COREDNS]);
    assert_eq!(coredns.default_argv(), ["/coredns"]);
    let plugins = coredns.chroot_ok(&["/coredns", "-plugins"]);
    for plugin in DNS_PLUGINS {
        assert!(plugins.lines().any(|l| l.trim() == plugin), "{plugins}");
    }
}
