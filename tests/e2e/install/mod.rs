//! `install/install.sh`, the init container's installer, run against
//! directories in a temp dir: the right files with the right modes, no
//! temporary files left, a valid conflist with tether first, idempotent
//! reruns. Run as root (like the init container).
//!
//! The Helm chart (install/helm/tether), with helm built from its Go
//! module: `helm lint`, `helm template` of every mode (tetherd's flags,
//! the images, the RBAC, the optional objects behind their values, the
//! conflist its `netconf` values make, what it refuses: misspelt keys and
//! wrong shapes through values.schema.json), its NOTES, and the plain
//! manifests of install/manifests/ compared with the chart's output.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::{json, Value};
use tether_e2e::chart::{self, Helm};
use tether_e2e::{doc_files, ref_plugin, require_root, tether_bin, workspace_dir, TempDir};

use crate::harness::shared::ticked;

const CONFLIST: &str = "10-tether.conflist";

fn installer() -> PathBuf {
    workspace_dir().join("install/install.sh")
}

/// SRC_DIR as the image has it: the plugin, optionally portmap, and the
/// conflist from the repository.
struct Layout {
    root: TempDir,
}

impl Layout {
    fn new(with_portmap: bool) -> Layout {
        let root = TempDir::new("inst");
        let src = root.path().join("src");
        std::fs::create_dir(&src).expect("mkdir src");
        std::fs::copy(tether_bin(), src.join("tether")).expect("copying tether");
        if with_portmap {
            let portmap = ref_plugin("portmap");
            assert!(
                portmap.exists(),
                "{} is missing: run tests/setup.sh (containernetworking-plugins)",
                portmap.display()
            );
            std::fs::copy(&portmap, src.join("portmap")).expect("copying portmap");
        }
        std::fs::copy(
            workspace_dir().join("install").join(CONFLIST),
            src.join(CONFLIST),
        )
        .expect("copying the conflist");
        Layout { root }
    }

    fn src(&self) -> PathBuf {
        self.root.path().join("src")
    }

    /// Nested and not yet existing: the installer creates them.
    fn bin(&self) -> PathBuf {
        self.root.path().join("host/opt/cni/bin")
    }

    fn conf(&self) -> PathBuf {
        self.root.path().join("host/etc/cni/net.d")
    }

    fn run(&self, extra_env: &[(&str, &str)]) -> Output {
        Command::new("sh")
            .arg(installer())
            .env("SRC_DIR", self.src())
            .env("CNI_BIN_DIR", self.bin())
            .env("CNI_CONF_DIR", self.conf())
            .envs(extra_env.iter().copied())
            .output()
            .expect("running install.sh")
    }

    fn run_ok(&self, extra_env: &[(&str, &str)]) -> String {
        let out = self.run(extra_env);
        assert!(
            out.status.success(),
            "install.sh failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

/// Every entry of `dir` (hidden ones included): name -> (mode, content).
fn listing(dir: &Path) -> BTreeMap<String, (u32, Vec<u8>)> {
    std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| {
            let e = e.expect("dir entry");
            let meta = e.metadata().expect("metadata");
            assert!(meta.is_file(), "{:?} is not a regular file", e.path());
            (
                e.file_name().to_string_lossy().into_owned(),
                (
                    meta.permissions().mode() & 0o7777,
                    std::fs::read(e.path()).expect("reading"),
                ),
            )
        })
        .collect()
}

fn names(l: &BTreeMap<String, (u32, Vec<u8>)>) -> Vec<&str> {
    l.keys().map(String::as_str).collect()
}

/// Asserts the installed state: exactly these files, modes, and contents.
fn assert_installed(layout: &Layout, plugins: &[&str]) {
    let bin = listing(&layout.bin());
    assert_eq!(names(&bin), plugins, "no temp files, nothing else");
    for plugin in plugins {
        let (mode, content) = &bin[*plugin];
        assert_eq!(*mode, 0o755, "{plugin} mode {mode:o}");
        let source = std::fs::read(layout.src().join(plugin)).expect("source");
        assert!(*content == source, "{plugin} differs from its source");
    }
    let conf = listing(&layout.conf());
    assert_eq!(names(&conf), [CONFLIST], "no temp files, nothing else");
    let (mode, content) = &conf[CONFLIST];
    assert_eq!(*mode, 0o644, "conflist mode {mode:o}");
    let source = std::fs::read(layout.src().join(CONFLIST)).expect("source");
    assert!(*content == source, "the conflist differs from its source");
    assert_conflist(content);
}

fn assert_conflist(bytes: &[u8]) {
    let conf: Value = serde_json::from_slice(bytes).expect("the conflist is JSON");
    let version = conf["cniVersion"].as_str().expect("cniVersion");
    assert!(
        ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"].contains(&version),
        "{version}"
    );
    assert!(
        conf["name"].as_str().is_some_and(|n| !n.is_empty()),
        "{conf}"
    );
    let first = &conf["plugins"][0];
    assert_eq!(first["type"], "tether", "tether comes first: {conf}");
    let socket = first["socket"]
        .as_str()
        .unwrap_or_else(|| panic!("no socket: {conf}"));
    assert!(socket.starts_with('/'), "socket is absolute: {socket}");
    // The DEL queue follows the daemon's --state-dir; a stateDir here would
    // suggest a second knob that does nothing.
    assert!(first.get("stateDir").is_none(), "{conf}");
    assert!(
        first.get("ipam").is_none(),
        "tether refuses an ipam section: {conf}"
    );
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn installs_files_with_their_modes_and_nothing_else() {
    require_root();
    let layout = Layout::new(true);
    let stdout = layout.run_ok(&[]);
    assert_installed(&layout, &["portmap", "tether"]);
    for path in [
        layout.bin().join("tether"),
        layout.bin().join("portmap"),
        layout.conf().join(CONFLIST),
    ] {
        assert!(
            stdout.contains(&path.display().to_string()),
            "the installer reports {}:\n{stdout}",
            path.display()
        );
    }

    // The installed plugin runs.
    let out = Command::new(layout.bin().join("tether"))
        .env_clear()
        .env("CNI_COMMAND", "VERSION")
        .output()
        .expect("running the installed tether");
    assert!(out.status.success());
    let version: Value = serde_json::from_slice(&out.stdout).expect("VERSION is JSON");
    assert!(version["supportedVersions"].is_array(), "{version}");
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn rerunning_is_idempotent_and_repairs() {
    require_root();
    let layout = Layout::new(true);
    layout.run_ok(&[]);
    let first = (listing(&layout.bin()), listing(&layout.conf()));
    layout.run_ok(&[]);
    assert_eq!(
        (listing(&layout.bin()), listing(&layout.conf())),
        first,
        "a second run changes nothing"
    );

    // A stale binary with a wrong mode, and an edited conflist, are
    // replaced by the next run.
    let tether = layout.bin().join("tether");
    std::fs::write(&tether, b"#!/bin/sh\nexit 1\n").expect("writing a stale binary");
    std::fs::set_permissions(&tether, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    std::fs::write(layout.conf().join(CONFLIST), b"{}").expect("editing the conflist");
    layout.run_ok(&[]);
    assert_installed(&layout, &["portmap", "tether"]);
    assert_eq!(
        (listing(&layout.bin()), listing(&layout.conf())),
        first,
        "the repair restores the first install"
    );
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn installs_without_portmap_and_under_another_name() {
    require_root();
    let layout = Layout::new(false);
    std::fs::rename(
        layout.src().join(CONFLIST),
        layout.src().join("05-custom.conflist"),
    )
    .expect("renaming the source conflist");
    layout.run_ok(&[("CONFLIST_NAME", "05-custom.conflist")]);
    let bin = listing(&layout.bin());
    assert_eq!(names(&bin), ["tether"]);
    assert_eq!(bin["tether"].0, 0o755);
    let conf = listing(&layout.conf());
    assert_eq!(names(&conf), ["05-custom.conflist"]);
    assert_eq!(conf["05-custom.conflist"].0, 0o644);
    assert_conflist(&conf["05-custom.conflist"].1);
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn tether_socket_is_written_into_the_conflist_and_a_bad_one_installs_nothing() {
    require_root();
    let layout = Layout::new(true);
    layout.run_ok(&[("TETHER_SOCKET", "/var/run/tether-test/node.sock")]);
    let conf = listing(&layout.conf());
    assert_conflist(&conf[CONFLIST].1);
    let installed: Value = serde_json::from_slice(&conf[CONFLIST].1).expect("JSON");
    let source: Value =
        serde_json::from_slice(&std::fs::read(layout.src().join(CONFLIST)).expect("source"))
            .expect("JSON");
    assert_eq!(
        installed["plugins"][0]["socket"],
        "/var/run/tether-test/node.sock"
    );
    // Nothing else changed.
    let mut expected = source.clone();
    expected["plugins"][0]["socket"] = installed["plugins"][0]["socket"].clone();
    assert_eq!(installed, expected);

    for bad in ["relative/tether.sock", "/run/a\"b.sock", "/run/a#b.sock"] {
        let layout = Layout::new(true);
        let out = layout.run(&[("TETHER_SOCKET", bad)]);
        assert!(!out.status.success(), "TETHER_SOCKET={bad} was taken");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("TETHER_SOCKET"),
            "the error names TETHER_SOCKET: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        for dir in [layout.bin(), layout.conf()] {
            assert!(
                !dir.exists() || listing(&dir).is_empty(),
                "{bad}: something was installed in {}",
                dir.display()
            );
        }
    }
}

/// containerd 1.6 and 1.7 (libcni 1.1) read only `cniVersion` and cannot
/// parse a 1.1.0 result; libcni 1.2 (containerd 2, CRI-O 1.31) picks the
/// highest of `cniVersions` it knows, and only then calls GC and STATUS.
#[cfg_attr(
    not(feature = "tools-tests"),
    ignore = "tools tier: helm and the reference plugins of `tests/setup.sh`; `make test` runs it"
)]
#[test]
fn the_conflist_serves_old_and_new_runtimes() {
    let conf: Value = serde_json::from_slice(
        &std::fs::read(tether_e2e::workspace_dir().join("install").join(CONFLIST))
            .expect("install's conflist"),
    )
    .expect("JSON");
    assert_eq!(conf["cniVersion"], "1.0.0", "{conf}");
    assert_eq!(
        conf["cniVersions"],
        serde_json::json!(["1.0.0", "1.1.0"]),
        "{conf}"
    );
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn a_missing_conflist_fails_without_leaving_temp_files() {
    require_root();
    let layout = Layout::new(false);
    std::fs::remove_file(layout.src().join(CONFLIST)).expect("removing the conflist");
    let out = layout.run(&[]);
    assert!(
        !out.status.success(),
        "install.sh succeeded without a conflist"
    );
    assert!(
        listing(&layout.conf()).is_empty(),
        "{:?}",
        names(&listing(&layout.conf()))
    );
    // The plugin copied before the failure is complete, under its name.
    let bin = listing(&layout.bin());
    assert_eq!(names(&bin), ["tether"]);
}

/// `helm lint` of the chart passes, with no warning (`--strict`), in
/// every mode.
#[cfg_attr(
    not(feature = "tools-tests"),
    ignore = "tools tier: helm and the reference plugins of `tests/setup.sh`; `make test` runs it"
)]
#[test]
fn helm_lint_passes_in_every_mode() {
    let helm = Helm::new();
    for (mode, _) in chart::MODES {
        let out = helm.run_ok(&[
            "lint",
            "--strict",
            chart::CHART,
            "--set",
            &format!("mode={mode}"),
            "--set",
            "etcd.endpoints={https://10.0.0.1:2379}",
        ]);
        assert!(
            out.contains("1 chart(s) linted, 0 chart(s) failed"),
            "{mode}: {out}"
        );
    }
}

/// What each mode passes to tetherd: its flags, exactly, and only flags
/// tetherd knows (a renamed flag would otherwise only show in a
/// crash-looping pod).
#[cfg_attr(
    not(feature = "tools-tests"),
    ignore = "tools tier: helm and the reference plugins of `tests/setup.sh`; `make test` runs it"
)]
#[test]
fn each_mode_renders_its_flags_and_only_flags_tetherd_knows() {
    let help = std::process::Command::new(tether_e2e::tetherd_bin())
        .arg("--help")
        .output()
        .expect("running tetherd --help");
    let help = String::from_utf8_lossy(&help.stdout);
    let common = [
        "--node-name=$(NODE_NAME)",
        "--socket=/run/tether/tether.sock",
        "--state-dir=/var/lib/tether",
    ];
    let nat_pools = [
        "--no-nat-to=10.96.0.0/12,fd00:10:96::/112",
        "--network-policy=true",
        "--check-vm-launchers=true",
        "--pools=/etc/tether/pools/pools.json",
    ];
    // Cutover notices need other nodes: every mode but singleNode.
    let cutover = ["--cutover-port=9655"];
    let metrics = ["--metrics-address=$(HOST_IP):9654"];
    let modes: [(&str, &[&str]); 4] = [
        (
            "kubernetes",
            &[
                "--store=kubernetes",
                "--lease-namespace=kube-system",
                "--cluster-cidr=10.244.0.0/16",
                "--cluster-cidr=fd00:10:244::/56",
                "--overlay=none",
            ],
        ),
        ("singleNode", &["--pod-cidr=10.244.0.0/24"]),
        ("nodeCidrs", &["--pod-cidr-from-node", "--overlay=none"]),
        (
            "etcd",
            &[
                "--store=etcd",
                "--etcd-endpoints=https://10.0.0.1:2379,https://10.0.0.2:2379",
                "--etcd-ca=/etc/tether/etcd/ca.pem",
                "--etcd-cert=/etc/tether/etcd/cert.pem",
                "--etcd-key=/etc/tether/etcd/key.pem",
                "--cluster-cidr=10.244.0.0/16",
                "--cluster-cidr=fd00:10:244::/56",
                "--overlay=none",
            ],
        ),
    ];
    for (mode, own) in modes {
        let objects = chart::objects(&chart::template(&[
            &format!("mode={mode}"),
            "etcd.endpoints={https://10.0.0.1:2379,https://10.0.0.2:2379}",
        ]));
        let args = chart::tetherd_args(&objects);
        let notices: &[&str] = if mode == "singleNode" { &[] } else { &cutover };
        let want: Vec<&str> = common
            .iter()
            .chain(own)
            .chain(&nat_pools)
            .chain(notices)
            .chain(&metrics)
            .copied()
            .collect();
        assert_eq!(args, want, "mode {mode}");
        for arg in &args {
            let flag = arg.split('=').next().unwrap_or(arg);
            assert!(
                help.contains(&format!("{flag} ")) || help.contains(&format!("{flag}\n")),
                "mode {mode} passes {flag}, which tetherd --help does not list"
            );
        }
        // The etcd client certificate is mounted in mode etcd only.
        let ds = chart::find(&objects, "DaemonSet", chart::RELEASE);
        let volumes = ds["spec"]["template"]["spec"]["volumes"].to_string();
        assert_eq!(
            volumes.contains("tether-etcd"),
            mode == "etcd",
            "{mode}: {volumes}"
        );
    }
    // Values that change the flags.
    let objects = chart::objects(&chart::template(&[
        "mode=singleNode",
        "podCidrs={10.1.0.0/24,fd00:1::/64}",
        "outboundNat.enabled=false",
        "networkPolicy.enabled=false",
        "checkVmLaunchers=false",
        "metrics.address=",
        "metrics.port=9700",
        "hostPaths.runDir=/var/run/t",
        "extraArgs={--mtu=1450}",
    ]));
    let args = chart::tetherd_args(&objects);
    for want in [
        "--pod-cidr=10.1.0.0/24",
        "--pod-cidr=fd00:1::/64",
        "--outbound-nat=false",
        "--network-policy=false",
        "--check-vm-launchers=false",
        "--metrics-address=:9700",
        "--socket=/var/run/t/tether.sock",
        "--mtu=1450",
    ] {
        assert!(args.iter().any(|a| a == want), "no {want} in {args:?}");
    }
    assert!(
        !args.iter().any(|a| a.starts_with("--no-nat-to")),
        "{args:?}"
    );
    assert_eq!(
        conflist_of(&objects)["plugins"][0]["socket"],
        "/var/run/t/tether.sock",
        "the installer writes the daemon's socket into the conflist"
    );
}

/// The conflist the chart has the init container write
/// (`TETHER_CONFLIST`), parsed.
fn conflist_of(objects: &[Value]) -> Value {
    let ds = chart::find(objects, "DaemonSet", chart::RELEASE);
    let init = &ds["spec"]["template"]["spec"]["initContainers"][0];
    let env = init["env"].as_array().expect("the init container's env");
    assert_eq!(env.len(), 1, "{env:?}");
    assert_eq!(env[0]["name"], "TETHER_CONFLIST");
    serde_json::from_str(env[0]["value"].as_str().expect("a string"))
        .unwrap_or_else(|e| panic!("TETHER_CONFLIST is not JSON ({e}): {}", env[0]["value"]))
}

/// The netconf comes from the chart's values: by default it is the
/// image's conflist (install/10-tether.conflist) with the chart's socket;
/// each `netconf` value lands in tether's entry of it; and install.sh,
/// given it as TETHER_CONFLIST, installs exactly that file.
#[cfg_attr(
    not(feature = "tools-tests"),
    ignore = "tools tier: helm and the reference plugins of `tests/setup.sh`; `make test` runs it"
)]
#[test]
fn the_conflist_comes_from_the_netconf_values() {
    let image: Value = serde_json::from_slice(
        &std::fs::read(workspace_dir().join("install").join(CONFLIST)).expect("the conflist"),
    )
    .expect("JSON");
    let defaults = conflist_of(&chart::objects(&chart::template(&[])));
    assert_eq!(
        defaults, image,
        "the chart's default conflist is the image's"
    );
    assert_conflist(defaults.to_string().as_bytes());

    let objects = chart::objects(&chart::template(&[
        "netconf.name=vms",
        "netconf.mtu=1400",
        "netconf.dns.nameservers={10.96.0.10}",
        "netconf.dns.search={default.svc.cluster.local,cluster.local}",
        "netconf.vmAddressPolicy=ephemeral",
        "netconf.kubevirt.binding=managedTap",
        "netconf.kubevirt.leaseSeconds=600",
        "netconf.portmap=false",
    ]));
    let conf = conflist_of(&objects);
    assert_eq!(conf["name"], "vms");
    let plugins = conf["plugins"].as_array().expect("plugins");
    assert_eq!(plugins.len(), 1, "no portmap: {conf}");
    let tether = &plugins[0];
    assert_eq!(tether["type"], "tether");
    assert_eq!(tether["mtu"], 1400);
    assert_eq!(
        tether["dns"],
        json!({"nameservers": ["10.96.0.10"], "search": ["default.svc.cluster.local", "cluster.local"]})
    );
    assert_eq!(tether["vmAddressPolicy"], "ephemeral");
    assert_eq!(
        tether["kubevirt"],
        json!({"binding": "managedTap", "leaseSeconds": 600})
    );
    assert_eq!(tether["socket"], "/run/tether/tether.sock");
    assert_conflist(conf.to_string().as_bytes());
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn install_sh_writes_tether_conflist_as_given_and_refuses_what_is_no_conflist() {
    require_root();
    let conf = conflist_of(&chart::objects(&chart::template(&[
        "netconf.dns.nameservers={10.96.0.10}",
        "netconf.kubevirt.binding=tap",
    ])));
    let text = conf.to_string();
    let layout = Layout::new(true);
    layout.run_ok(&[("TETHER_CONFLIST", &text)]);
    let installed = listing(&layout.conf());
    assert_eq!(names(&installed), [CONFLIST], "no temp files, nothing else");
    assert_eq!(installed[CONFLIST].0, 0o644);
    assert_eq!(
        String::from_utf8_lossy(&installed[CONFLIST].1),
        format!("{text}\n"),
        "TETHER_CONFLIST installed as given"
    );
    assert_eq!(names(&listing(&layout.bin())), ["portmap", "tether"]);

    for (env, says) in [
        (vec![("TETHER_CONFLIST", "not json")], "not a JSON object"),
        (
            vec![(
                "TETHER_CONFLIST",
                r#"{"name":"x","plugins":[{"type":"bridge"}]}"#,
            )],
            "no plugin of type tether",
        ),
        (
            vec![
                ("TETHER_CONFLIST", text.as_str()),
                ("TETHER_SOCKET", "/run/x.sock"),
            ],
            "both set",
        ),
    ] {
        let layout = Layout::new(true);
        let out = layout.run(&env);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{env:?} was taken");
        assert!(err.contains(says), "{env:?}: {err}");
        for dir in [layout.bin(), layout.conf()] {
            assert!(
                !dir.exists() || listing(&dir).is_empty(),
                "{env:?}: something was installed in {}",
                dir.display()
            );
        }
    }
}

/// Modes and values the chart cannot render fail `helm template` with a
/// message that says what to do: a key it does not know, or a value of
/// the wrong shape, is refused by values.schema.json naming the key; what
/// one value needs of another, by the templates.
#[cfg_attr(
    not(feature = "tools-tests"),
    ignore = "tools tier: helm and the reference plugins of `tests/setup.sh`; `make test` runs it"
)]
#[test]
fn the_chart_refuses_what_it_cannot_render() {
    let helm = Helm::new();
    for (set, says) in [
        // A misspelt key: the schema names it, instead of its being ignored.
        (
            "clusterCidr=10.42.0.0/16",
            "additional properties 'clusterCidr' not allowed",
        ),
        (
            "netconf.kubevirt.bindng=tap",
            "additional properties 'bindng' not allowed",
        ),
        // A wrong shape: one CIDR where a list is wanted.
        (
            "cluster.cidrs=10.42.0.0/16",
            "at '/cluster/cidrs': got string, want array",
        ),
        ("netconf.mtu=9", "at '/netconf/mtu'"),
        (
            "mode=etcdd",
            "at '/mode': value must be one of 'kubernetes', 'singleNode', 'nodeCidrs', 'etcd'",
        ),
        (
            "overlay=geneve",
            "at '/overlay': value must be one of 'none', 'vxlan'",
        ),
        (
            "netconf.kubevirt.binding=bridge",
            "at '/netconf/kubevirt/binding'",
        ),
        // What the templates check.
        ("cluster.cidrs=null", "mode kubernetes needs cluster.cidrs"),
        ("image.tag=latest", "never \"latest\""),
        (
            "migrationNetwork.enabled=true",
            "is not one of pools' names",
        ),
        (
            "metrics.serviceMonitor.enabled=true,metrics.service.enabled=false",
            "needs metrics.service.enabled",
        ),
    ] {
        let out = helm.run(&["template", chart::RELEASE, chart::CHART, "--set", set]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{set} rendered");
        assert!(err.contains(says), "{set}: {err}");
    }
    // etcd.endpoints has no default (no example address stands in for
    // the cluster's own): mode etcd without them is refused.
    let out = helm.run(&[
        "template",
        chart::RELEASE,
        chart::CHART,
        "--set",
        "mode=etcd",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("mode etcd needs etcd.endpoints"));
}

/// What `helm install` prints after the install (NOTES.txt): the checks
/// to run, and the upgrade without a pinned tag, CRDs first.
#[cfg_attr(
    not(feature = "tools-tests"),
    ignore = "tools tier: helm and the reference plugins of `tests/setup.sh`; `make test` runs it"
)]
#[test]
fn the_notes_say_how_to_check_the_install_and_how_to_upgrade() {
    let helm = Helm::new();
    for mode in ["kubernetes", "nodeCidrs", "singleNode"] {
        let out = helm.run_ok(&[
            "install",
            chart::RELEASE,
            chart::CHART,
            "--namespace",
            chart::NAMESPACE,
            "--dry-run=client",
            "--set",
            &format!("mode={mode}"),
        ]);
        let notes = out
            .split_once("NOTES:")
            .map(|(_, n)| n)
            .unwrap_or_else(|| panic!("no NOTES in:\n{out}"));
        for want in [
            format!("mode {mode}"),
            "kubectl -n kube-system rollout status ds/tether".into(),
            "kubectl get pod tether-check -o wide".into(),
            "kubectl apply --server-side -f install/helm/tether/crds/".into(),
            "helm upgrade tether install/helm/tether -n kube-system --reset-then-reuse-values"
                .into(),
        ] {
            assert!(notes.contains(&want), "{mode}: no {want:?} in:\n{notes}");
        }
        assert!(
            !notes.contains("image.tag"),
            "the upgrade pins no tag:\n{notes}"
        );
        assert_eq!(
            notes.contains("kubectl get tether"),
            mode == "kubernetes",
            "{mode}:\n{notes}"
        );
        assert_eq!(
            notes.contains("UDP 9655"),
            mode != "singleNode",
            "{mode}: the cutover port between nodes:\n{notes}"
        );
    }
}

/// The chart's defaults: the versioned image used if present, what is
/// rendered and what is not (the ServiceMonitor, the dashboard and the
/// Multus network only behind their values), the least-privilege RBAC;
/// and the build context leaves `target/` out.
#[cfg_attr(
    not(feature = "tools-tests"),
    ignore = "tools tier: helm and the reference plugins of `tests/setup.sh`; `make test` runs it"
)]
#[test]
fn the_defaults_render_a_versioned_image_and_nothing_optional() {
    let objects = chart::objects(&chart::template(&[]));
    let kinds: Vec<String> = objects
        .iter()
        .map(|o| {
            format!(
                "{}/{}",
                o["kind"].as_str().unwrap_or(""),
                o["metadata"]["name"].as_str().unwrap_or("")
            )
        })
        .collect();
    assert_eq!(
        kinds,
        [
            "ServiceAccount/tether",
            "ConfigMap/tether-pools",
            "ClusterRole/tether",
            "ClusterRoleBinding/tether",
            "Role/tether-leases",
            "Role/tether-uninstall",
            "RoleBinding/tether-leases",
            "RoleBinding/tether-uninstall",
            "Service/tether-metrics",
            "DaemonSet/tether",
        ],
        "the default objects, in helm's install order"
    );
    let ds = chart::find(&objects, "DaemonSet", chart::RELEASE);
    let pod = &ds["spec"]["template"]["spec"];
    let want = format!("tether:{}", env!("CARGO_PKG_VERSION"));
    let containers: Vec<&Value> = pod["initContainers"]
        .as_array()
        .into_iter()
        .chain(pod["containers"].as_array())
        .flatten()
        .collect();
    let names: Vec<&str> = containers
        .iter()
        .map(|c| c["name"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(names, ["install", "tetherd", "uninstall"]);
    for c in &containers {
        assert_eq!(c["image"], want.as_str(), "{}", c["name"]);
        assert_eq!(c["imagePullPolicy"], "IfNotPresent", "{}", c["name"]);
    }
    // tetherd asks for CPU (a cutover must not wait behind QEMU for the
    // CPU: with no request its weight is the kernel's minimum) and has no
    // limit (which would throttle it at the busiest moment).
    assert_eq!(
        containers[1]["resources"],
        json!({"requests": {"cpu": "100m", "memory": "64Mi"}}),
        "tetherd's resources"
    );
    assert_eq!(
        chart::find(&objects, "ConfigMap", "tether-pools")["data"]["pools.json"],
        r#"{"pools":[]}"#
    );
    // tetherd's ClusterRole, rule by rule (the kube_api suite proves it is
    // enough, with the service account's token), and the uninstall
    // container's one read.
    assert_eq!(
        chart::find(&objects, "ClusterRole", "tether")["rules"],
        json!([
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["k8s.cni.cncf.io"], "resources": ["ipamclaims"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["k8s.cni.cncf.io"], "resources": ["ipamclaims/status"], "verbs": ["patch"]},
            // Names only: a deleted VirtualMachine frees its VM's addresses.
            {"apiGroups": ["kubevirt.io"], "resources": ["virtualmachines"], "verbs": ["list", "watch"]},
            // One by name: is a VM pod its instance's launcher?
            {"apiGroups": ["kubevirt.io"], "resources": ["virtualmachineinstances"], "verbs": ["get"]},
            // NetworkPolicy (on by default): read, never written.
            {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["list", "watch"]},
            {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
            {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
            // Mode kubernetes (the default): tether's own records.
            {"apiGroups": ["tether.dev"], "resources": ["tethernodes"], "verbs": ["get", "list", "watch", "create", "update", "delete"]},
            {"apiGroups": ["tether.dev"], "resources": ["tethernodeids"], "verbs": ["get", "list", "create", "update", "delete"]},
            {"apiGroups": ["tether.dev"], "resources": ["addressblocks"], "verbs": ["get", "list", "watch", "create", "delete"]},
            {"apiGroups": ["tether.dev"], "resources": ["poolblocks"], "verbs": ["get", "list", "create"]},
            {"apiGroups": ["tether.dev"], "resources": ["vmaddresses"], "verbs": ["get", "list", "watch", "create", "update", "delete"]},
            {"apiGroups": ["tether.dev"], "resources": ["vmaddressowners"], "verbs": ["get", "list", "create", "update", "delete"]},
        ])
    );
    // ... and the nodes' Leases, in the release's namespace only.
    assert_eq!(
        chart::find(&objects, "Role", "tether-leases")["rules"],
        json!([{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]}])
    );
    // The other modes write none of it.
    let etcd = chart::objects(&chart::template(&[
        "mode=etcd",
        "etcd.endpoints={https://10.0.0.1:2379}",
    ]));
    let rules = chart::find(&etcd, "ClusterRole", "tether")["rules"].to_string();
    assert!(!rules.contains("tether.dev"), "{rules}");
    // Without NetworkPolicy, neither its policies nor the namespaces.
    let off = chart::objects(&chart::template(&["networkPolicy.enabled=false"]));
    let rules = chart::find(&off, "ClusterRole", "tether")["rules"].to_string();
    assert!(
        !rules.contains("networkpolicies") && !rules.contains("namespaces"),
        "{rules}"
    );
    // Without the launcher check, no VirtualMachineInstance.
    let off = chart::objects(&chart::template(&["checkVmLaunchers=false"]));
    let rules = chart::find(&off, "ClusterRole", "tether")["rules"].to_string();
    assert!(!rules.contains("virtualmachineinstances"), "{rules}");
    assert!(!etcd
        .iter()
        .any(|o| o["metadata"]["name"] == "tether-leases"));
    assert_eq!(
        chart::find(&objects, "Role", "tether-uninstall")["rules"],
        json!([{"apiGroups": ["apps"], "resources": ["daemonsets"],
                "resourceNames": ["tether"], "verbs": ["get"]}])
    );
    // The optional objects, behind their values.
    let objects = chart::objects(&chart::template(&[
        "metrics.serviceMonitor.enabled=true",
        "metrics.dashboard.enabled=true",
        "migrationNetwork.enabled=true",
        "pools[0].name=migration",
        "pools[0].cidr=192.168.100.0/24",
        "uninstall.enabled=false",
    ]));
    let sm = chart::find(&objects, "ServiceMonitor", "tether");
    assert_eq!(sm["spec"]["endpoints"][0]["port"], "metrics");
    let dashboard = chart::find(&objects, "ConfigMap", "tether-dashboard");
    let json: Value = serde_json::from_str(
        dashboard["data"]["tether.json"]
            .as_str()
            .expect("the dashboard's JSON"),
    )
    .expect("the dashboard is JSON");
    assert!(json["panels"].is_array(), "a Grafana dashboard");
    let nad = chart::find(&objects, "NetworkAttachmentDefinition", "migration-network");
    let conf: Value =
        serde_json::from_str(nad["spec"]["config"].as_str().expect("its config")).expect("JSON");
    assert_eq!(
        conf["ipam"],
        json!({"type": "tether", "pool": "migration", "socket": "/run/tether/tether.sock"})
    );
    assert_eq!(
        chart::find(&objects, "ConfigMap", "tether-pools")["data"]["pools.json"],
        r#"{"pools":[{"cidr":"192.168.100.0/24","name":"migration"}]}"#
    );
    assert!(
        !objects
            .iter()
            .any(|o| o["kind"] == "Role" && o["metadata"]["name"] == "tether-uninstall"),
        "uninstall.enabled=false keeps its Role"
    );
    let ds = chart::find(&objects, "DaemonSet", chart::RELEASE);
    assert_eq!(
        ds["spec"]["template"]["spec"]["containers"]
            .as_array()
            .map(Vec::len),
        Some(1)
    );

    let root = workspace_dir();
    for ignore in [".containerignore", ".dockerignore"] {
        let text = std::fs::read_to_string(root.join(ignore)).expect(ignore);
        assert!(text.lines().any(|l| l.trim() == "target/"), "{ignore}");
    }
}

/// The plain manifests are the chart's output: install/generate.sh, run
/// into a temp dir, writes exactly the committed files of
/// install/manifests/, byte for byte; none of them needs the Prometheus
/// Operator or Multus, and `kubectl apply -f install/` finds nothing to
/// choke on (no JSON or YAML lies directly in install/).
#[cfg_attr(
    not(feature = "tools-tests"),
    ignore = "tools tier: helm and the reference plugins of `tests/setup.sh`; `make test` runs it"
)]
#[test]
fn the_committed_manifests_are_the_charts_output() {
    let dir = TempDir::new("manifests");
    let out = Command::new("sh")
        .arg(workspace_dir().join("install/generate.sh"))
        .arg(dir.path())
        .env("HELM", chart::helm_bin())
        .output()
        .expect("running install/generate.sh");
    assert!(
        out.status.success(),
        "install/generate.sh failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let committed = workspace_dir().join("install/manifests");
    let generated = listing(dir.path());
    let files = listing(&committed);
    assert_eq!(
        names(&files),
        names(&generated),
        "install/manifests/ has other files than generate.sh writes"
    );
    let mut expected = vec!["ipamclaims-crd.yaml", "tether-crds.yaml"];
    expected.extend(chart::MODES.iter().map(|(_, f)| *f));
    expected.sort();
    assert_eq!(names(&files), expected);
    for (name, (_, content)) in &generated {
        assert!(
            files[name].1 == *content,
            "install/manifests/{name} differs from the chart's output: run `make manifests` and commit it"
        );
    }
    for (_, file) in chart::MODES {
        let text = String::from_utf8_lossy(&files[file].1).into_owned();
        for kind in [
            "ServiceMonitor",
            "NetworkAttachmentDefinition",
            "CustomResourceDefinition",
        ] {
            assert!(
                !text.contains(&format!("kind: {kind}")),
                "{file} has a {kind}"
            );
        }
    }
    for entry in std::fs::read_dir(workspace_dir().join("install")).expect("install/") {
        let name = entry
            .expect("an entry")
            .file_name()
            .to_string_lossy()
            .into_owned();
        assert!(
            !(name.ends_with(".yaml") || name.ends_with(".yml") || name.ends_with(".json")),
            "install/{name} would be read by `kubectl apply -f install/`"
        );
    }
}

/// The chart reference's RBAC table (docs/reference/chart.md, "What the
/// RBAC allows") is the RBAC the chart renders in its default mode:
/// tetherd's ClusterRole and its Leases Role, one row per resource
/// (`resource.group`, the core group's and a subresource's without a
/// group), with exactly the rendered verbs.
#[cfg_attr(
    not(feature = "tools-tests"),
    ignore = "tools tier: helm and the reference plugins of `tests/setup.sh`; `make test` runs it"
)]
#[test]
fn the_chart_references_rbac_table_is_the_charts_rbac() {
    let objects = chart::objects(&chart::template(&[]));
    let mut rendered: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (kind, name) in [("ClusterRole", "tether"), ("Role", "tether-leases")] {
        let rules = chart::find(&objects, kind, name)["rules"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        for rule in rules {
            let strings = |key: &str| -> Vec<String> {
                rule[key]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|v| v.as_str().map(str::to_owned))
                    .collect()
            };
            let verbs = strings("verbs");
            for group in strings("apiGroups") {
                for resource in strings("resources") {
                    let key = if group.is_empty() || resource.contains('/') {
                        resource
                    } else {
                        format!("{resource}.{group}")
                    };
                    rendered.insert(key, verbs.clone());
                }
            }
        }
    }
    assert!(rendered.len() >= 12, "{rendered:?}");

    let page = std::fs::read_to_string(workspace_dir().join("docs/reference/chart.md"))
        .expect("docs/reference/chart.md");
    let section = page
        .split_once("## What the RBAC allows")
        .and_then(|(_, rest)| rest.split("\n## ").next())
        .expect("chart.md has a section \"What the RBAC allows\"");
    let mut documented: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in section.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let resource = ticked(cells[1]).remove(0);
        documented.insert(resource, ticked(cells[2]));
    }
    assert_eq!(
        documented, rendered,
        "docs/reference/chart.md's RBAC table against the chart's rendered rules"
    );
}

/// A shell command line's words: whitespace splits, '...' and "..." quote.
fn shell_words(line: &str) -> Vec<String> {
    let (mut words, mut word, mut quote, mut any) = (Vec::new(), String::new(), None, false);
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                any = true;
            }
            (None, c) if c.is_whitespace() => {
                if any || !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
                any = false;
            }
            (None, c) => word.push(c),
        }
    }
    if any || !word.is_empty() {
        words.push(word);
    }
    words
}

/// The mode tetherd's args say: its one distinctive flag.
fn mode_of(args: &[String]) -> Vec<&'static str> {
    let mut modes = Vec::new();
    for (mode, flag) in [
        ("kubernetes", "--store=kubernetes"),
        ("etcd", "--store=etcd"),
        ("nodeCidrs", "--pod-cidr-from-node"),
        ("singleNode", "--pod-cidr="),
    ] {
        if args.iter().any(|a| a.starts_with(flag)) {
            modes.push(mode);
        }
    }
    modes
}

/// Every `helm install` of the README and the book (the ```sh block after
/// `<!-- helm-install: MODE -->`) installs the chart in the mode it
/// claims: rendered with its own `--set` values, tetherd gets that mode's
/// flags and no other's. The README carries one for each of kubernetes,
/// nodeCidrs and etcd, the install page one for every mode.
#[cfg_attr(
    not(feature = "tools-tests"),
    ignore = "tools tier: helm and the reference plugins of `tests/setup.sh`; `make test` runs it"
)]
#[test]
fn every_helm_install_command_of_the_docs_renders_the_mode_it_claims() {
    let tag = "<!-- helm-install:";
    let mut seen: Vec<(String, String)> = Vec::new();
    for file in doc_files() {
        let text = std::fs::read_to_string(workspace_dir().join(&file)).expect("a doc");
        let lines: Vec<&str> = text.lines().collect();
        for (n, line) in lines.iter().enumerate() {
            let Some(rest) = line.trim().strip_prefix(tag) else {
                continue;
            };
            let mode = rest.trim_end_matches("-->").trim().to_string();
            let at = format!("{file}:{}", n + 1);
            assert_eq!(lines.get(n + 1).map(|l| l.trim()), Some("```sh"), "{at}");
            let block: Vec<&str> = lines[n + 2..]
                .iter()
                .copied()
                .take_while(|l| l.trim() != "```")
                .collect();
            let joined = block.join("\n").replace("\\\n", " ");
            let commands: Vec<&str> = joined
                .lines()
                .map(str::trim)
                .filter(|l| l.starts_with("helm install "))
                .collect();
            assert_eq!(
                commands.len(),
                1,
                "{at}: one `helm install` wanted: {block:?}"
            );
            let words = shell_words(commands[0]);
            assert_eq!(
                words[..4],
                ["helm", "install", chart::RELEASE, chart::CHART],
                "{at}: {words:?}"
            );
            let mut sets = Vec::new();
            let mut namespace = None;
            let mut rest = words[4..].iter();
            while let Some(w) = rest.next() {
                match w.as_str() {
                    "--set" => sets.push(rest.next().expect("a --set value").clone()),
                    "--namespace" | "-n" => namespace = rest.next().cloned(),
                    other => panic!("{at}: a word the test does not know: {other}"),
                }
            }
            assert_eq!(namespace.as_deref(), Some(chart::NAMESPACE), "{at}");
            let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
            let objects = chart::objects(&chart::template(&sets));
            let args = chart::tetherd_args(&objects);
            assert_eq!(
                mode_of(&args),
                [mode.as_str()],
                "{at}: the command claims mode {mode}; tetherd gets {args:?}"
            );
            seen.push((file.clone(), mode));
        }
    }
    for (file, modes) in [
        ("README.md", &["kubernetes", "nodeCidrs", "etcd"][..]),
        (
            "docs/user/install.md",
            &["kubernetes", "nodeCidrs", "etcd", "singleNode"][..],
        ),
    ] {
        for mode in modes {
            assert!(
                seen.iter().any(|(f, m)| f == file && m == mode),
                "{file} has no `helm install` for mode {mode}: {seen:?}"
            );
        }
    }
}
