//! `install/install.sh`, the init container's installer, run against
//! directories in a temp dir: the right files with the right modes, no
//! temporary files left, a valid conflist with tether first, idempotent
//! reruns. Run as root (like the init container).

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;
use tether_e2e::{ref_plugin, require_root, tether_bin, workspace_dir, TempDir};

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

/// Every flag the DaemonSet passes to tetherd is one tetherd knows: a
/// renamed flag would otherwise only show in a crash-looping pod.
#[test]
fn the_daemonset_passes_only_flags_tetherd_knows() {
    let yaml = std::fs::read_to_string(tether_e2e::workspace_dir().join("install/daemonset.yaml"))
        .expect("reading install/daemonset.yaml");
    let help = std::process::Command::new(tether_e2e::tetherd_bin())
        .arg("--help")
        .output()
        .expect("running tetherd --help");
    let help = String::from_utf8_lossy(&help.stdout);
    let flags: Vec<&str> = yaml
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- --"))
        .map(|f| f.split('=').next().unwrap_or(f))
        .collect();
    assert!(flags.len() >= 8, "{flags:?}");
    for flag in flags {
        assert!(
            help.contains(&format!("--{flag} ")) || help.contains(&format!("--{flag}\n")),
            "install/daemonset.yaml passes --{flag}, which tetherd --help does not list"
        );
    }
}

/// The DaemonSet's images carry the crates' version, never `:latest`, and
/// are pulled only if absent, so that an image imported into containerd
/// (the README's Quick start) is used; the build context leaves `target/`
/// out.
#[test]
fn the_daemonset_names_a_versioned_image_used_if_present() {
    let root = tether_e2e::workspace_dir();
    let yaml = std::fs::read_to_string(root.join("install/daemonset.yaml"))
        .expect("reading install/daemonset.yaml");
    let images: Vec<&str> = yaml
        .lines()
        .filter_map(|l| l.trim().strip_prefix("image: "))
        .collect();
    assert_eq!(
        images.len(),
        2,
        "the init container and tetherd: {images:?}"
    );
    let want = format!("tether:{}", env!("CARGO_PKG_VERSION"));
    for image in &images {
        assert_eq!(*image, want, "install/daemonset.yaml");
    }
    let policies: Vec<&str> = yaml
        .lines()
        .filter_map(|l| l.trim().strip_prefix("imagePullPolicy: "))
        .collect();
    assert_eq!(policies, ["IfNotPresent", "IfNotPresent"]);
    for ignore in [".containerignore", ".dockerignore"] {
        let text = std::fs::read_to_string(root.join(ignore)).expect(ignore);
        assert!(text.lines().any(|l| l.trim() == "target/"), "{ignore}");
    }
}
