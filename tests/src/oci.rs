//! Container images without a registry: a root filesystem assembled from
//! files of this machine, packed as an OCI image layout archive (what
//! `ctr images import` reads), with the image's name in the index's
//! `io.containerd.image.name` annotation.
//!
//! [`Rootfs::pack`]: one uncompressed layer (file capabilities kept), a config with the entrypoint
//! and `PATH`, a manifest and an index, each blob named by its SHA-256
//! (`sha256sum`). The layer is packed by GNU tar with numeric owner 0, so
//! the files in the image belong to root whatever they belong to here.
//! [`Image`] packs several layers (directories, bottom first), with an
//! entrypoint, a command and an environment: the Conformance tests'
//! images (tests/src/conformance_images.rs), a Debian root with files
//! built here on top.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::json;

/// The busybox applets the test images link to `/bin/busybox`.
pub const BUSYBOX_APPLETS: &[&str] = &[
    "sh", "sleep", "ip", "ping", "cat", "ls", "test", "cp", "mv", "chmod", "mkdir", "rm", "sync",
    "echo", "hostname", "sed", "grep", "wc", "true", "false", "ps", "[", "mktemp",
];

/// A root filesystem being assembled in a directory.
#[derive(Debug)]
pub struct Rootfs {
    dir: PathBuf,
}

impl Rootfs {
    /// An empty root with the usual top directories, `/var/run` linking to
    /// `/run` (as on Debian) and Debian's static busybox as `/bin/busybox`
    /// with [`BUSYBOX_APPLETS`].
    pub fn busybox(dir: &Path) -> Rootfs {
        let root = Rootfs {
            dir: dir.to_path_buf(),
        };
        for d in [
            "bin",
            "dev",
            "etc",
            "proc",
            "sys",
            "tmp",
            "run",
            "var",
            "usr/local/bin",
        ] {
            std::fs::create_dir_all(dir.join(d))
                .unwrap_or_else(|e| panic!("creating {}: {e}", dir.join(d).display()));
        }
        std::os::unix::fs::symlink("../run", dir.join("var/run")).expect("linking /var/run");
        root.copy("/bin/busybox", "bin/busybox", 0o755);
        for applet in BUSYBOX_APPLETS {
            std::os::unix::fs::symlink("busybox", dir.join("bin").join(applet))
                .expect("linking a busybox applet");
        }
        root
    }

    /// Copies `src` (a file of this machine) to `dest` (relative to the
    /// root) with `mode`, creating the parent directories.
    pub fn copy(&self, src: impl AsRef<Path>, dest: &str, mode: u32) {
        use std::os::unix::fs::PermissionsExt;
        let (src, to) = (src.as_ref(), self.dir.join(dest));
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent).expect("creating an image directory");
        }
        std::fs::copy(src, &to)
            .unwrap_or_else(|e| panic!("copying {} into the image: {e}", src.display()));
        std::fs::set_permissions(&to, std::fs::Permissions::from_mode(mode))
            .expect("setting an image file's mode");
    }

    /// Copies a dynamically linked program and the shared libraries `ldd`
    /// lists for it (at the same paths, so that its interpreter finds them).
    pub fn copy_program(&self, src: impl AsRef<Path>, dest: &str) {
        let src = src.as_ref();
        self.copy(src, dest, 0o755);
        let out = Command::new("ldd").arg(src).output().expect("running ldd");
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or
            // "/lib64/ld-linux-x86-64.so.2 (0x...)".
            let path = line
                .split("=>")
                .last()
                .and_then(|s| s.split_whitespace().next())
                .filter(|p| p.starts_with('/'));
            if let Some(lib) = path {
                let rel = lib.trim_start_matches('/');
                if !self.dir.join(rel).exists() {
                    // Follow symlinks: copy the file's content under the
                    // name the loader asks for.
                    self.copy(lib, rel, 0o755);
                }
            }
        }
    }

    /// An existing directory (created if missing) as a root, to add files
    /// to with [`Rootfs::copy`] and [`Rootfs::copy_program`]: a layer of an
    /// [`Image`] over another root, say.
    pub fn from_dir(dir: &Path) -> Rootfs {
        std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        Rootfs {
            dir: dir.to_path_buf(),
        }
    }

    /// The directory the root is assembled in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Links every applet of the static busybox (`busybox --list-full`,
    /// e.g. `usr/bin/wget`) to `/bin/busybox`, as `busybox --install -s`
    /// would inside the root; those already present are left alone.
    pub fn link_all_busybox_applets(&self) {
        let out = run(Command::new("/bin/busybox").arg("--list-full"));
        for applet in String::from_utf8_lossy(&out.stdout).lines() {
            let link = self.dir.join(applet);
            if applet.is_empty() || link.symlink_metadata().is_ok() {
                continue;
            }
            if let Some(parent) = link.parent() {
                std::fs::create_dir_all(parent).expect("creating an applet's directory");
            }
            std::os::unix::fs::symlink("/bin/busybox", &link)
                .unwrap_or_else(|e| panic!("linking {}: {e}", link.display()));
        }
    }

    /// Writes `content` as `dest` (relative to the root) with `mode`,
    /// creating the parent directories.
    pub fn write(&self, dest: &str, content: &str, mode: u32) {
        use std::os::unix::fs::PermissionsExt;
        let to = self.dir.join(dest);
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent).expect("creating an image directory");
        }
        std::fs::write(&to, content)
            .unwrap_or_else(|e| panic!("writing {} into the image: {e}", to.display()));
        std::fs::set_permissions(&to, std::fs::Permissions::from_mode(mode))
            .expect("setting an image file's mode");
    }

    /// Packs the root as image `name` (fully qualified, e.g.
    /// `registry.k8s.io/pause:3.6`) into the OCI archive `out`, with
    /// `entrypoint`: one layer, every file owned by root.
    pub fn pack(&self, name: &str, entrypoint: &[&str], out: &Path) {
        Image::new(name)
            .layer(&self.dir, Owners::Root)
            .entrypoint(entrypoint)
            .env(&["PATH=/usr/local/bin:/bin"])
            .pack(out);
    }
}

/// Who owns the files of a layer in the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owners {
    /// Root (uid and gid 0), whoever owns them here: for roots assembled
    /// from this machine's files.
    Root,
    /// The owners they have here, by number: for a root an installer made
    /// (Debian's packages own some files by system users and groups).
    AsTheyAre,
}

/// An image being described: its layers (directories, bottom first) and
/// what its config says to run. [`Image::pack`] writes it as an OCI
/// archive.
#[derive(Debug, Clone)]
pub struct Image {
    name: String,
    layers: Vec<(PathBuf, Owners)>,
    entrypoint: Vec<String>,
    cmd: Vec<String>,
    env: Vec<String>,
    user: Option<String>,
}

impl Image {
    /// An image named `name` (fully qualified, with its tag), without
    /// layers, entrypoint, command or environment yet.
    pub fn new(name: &str) -> Image {
        Image {
            name: name.to_string(),
            layers: Vec::new(),
            entrypoint: Vec::new(),
            cmd: Vec::new(),
            env: Vec::new(),
            user: None,
        }
    }

    /// Adds the content of `dir` as the next layer, above those added
    /// before. A file of a higher layer replaces the same path below; an
    /// upper layer must not hold a directory where a lower one has a
    /// symbolic link (Debian's `/bin` links to `usr/bin`).
    pub fn layer(mut self, dir: &Path, owners: Owners) -> Image {
        self.layers.push((dir.to_path_buf(), owners));
        self
    }

    /// The config's `Entrypoint`.
    pub fn entrypoint(mut self, args: &[&str]) -> Image {
        self.entrypoint = args.iter().map(|a| a.to_string()).collect();
        self
    }

    /// The config's `Cmd`: the arguments to the entrypoint (or the
    /// command, without one) unless the container gives its own.
    pub fn cmd(mut self, args: &[&str]) -> Image {
        self.cmd = args.iter().map(|a| a.to_string()).collect();
        self
    }

    /// The config's `Env` (`NAME=value` each).
    pub fn env(mut self, vars: &[&str]) -> Image {
        self.env = vars.iter().map(|v| v.to_string()).collect();
        self
    }

    /// The config's `User` (`uid` or `uid:gid`, by number): a pod that
    /// must run as non-root (`runAsNonRoot`) without naming its user needs
    /// a numeric one in the image.
    pub fn user(mut self, user: &str) -> Image {
        self.user = Some(user.to_string());
        self
    }

    /// Writes the image into the OCI archive `out`: one uncompressed layer
    /// per [`Image::layer`], the config, the manifest and the index, whose
    /// `io.containerd.image.name` annotation is the image's name.
    pub fn pack(&self, out: &Path) {
        assert!(!self.layers.is_empty(), "image {} has no layer", self.name);
        let work = out.with_extension("oci");
        if work.exists() {
            // A pack that was interrupted.
            std::fs::remove_dir_all(&work).expect("removing an old work dir");
        }
        let blobs = work.join("blobs/sha256");
        std::fs::create_dir_all(&blobs).expect("creating the blobs dir");
        let (mut diff_ids, mut layers) = (Vec::new(), Vec::new());
        for (dir, owners) in &self.layers {
            let (digest, size) = tar_layer(&blobs, dir, *owners);
            diff_ids.push(digest.clone());
            layers.push(
                json!({"mediaType": "application/vnd.oci.image.layer.v1.tar",
                               "digest": digest, "size": size}),
            );
        }
        let mut config = serde_json::Map::new();
        for (key, value) in [
            ("Entrypoint", &self.entrypoint),
            ("Cmd", &self.cmd),
            ("Env", &self.env),
        ] {
            if !value.is_empty() {
                config.insert(key.to_string(), json!(value));
            }
        }
        if let Some(user) = &self.user {
            config.insert("User".to_string(), json!(user));
        }
        let config = json!({
            "architecture": "amd64",
            "os": "linux",
            "config": config,
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        });
        let (config_digest, config_size) = blob(&blobs, config.to_string().as_bytes());
        let manifest = json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": config_digest, "size": config_size},
            "layers": layers,
        });
        let (manifest_digest, manifest_size) = blob(&blobs, manifest.to_string().as_bytes());
        let tag = self.name.rsplit(':').next().unwrap_or("latest");
        let index = json!({
            "schemaVersion": 2,
            "manifests": [{
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest, "size": manifest_size,
                "annotations": {"io.containerd.image.name": self.name,
                                "org.opencontainers.image.ref.name": tag},
            }],
        });
        std::fs::write(work.join("index.json"), index.to_string()).expect("writing index.json");
        std::fs::write(work.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#)
            .expect("writing oci-layout");
        run(Command::new("tar")
            .arg("-C")
            .arg(&work)
            .arg("-cf")
            .arg(out)
            .args(["oci-layout", "index.json", "blobs"]));
        std::fs::remove_dir_all(&work).expect("removing the image's work dir");
    }
}

/// Packs `dir` as a layer blob with GNU tar (names sorted, owners by
/// number); its digest and size.
fn tar_layer(blobs: &Path, dir: &Path, owners: Owners) -> (String, usize) {
    let layer = blobs.join("layer.tar");
    let mut tar = Command::new("tar");
    // File capabilities are kept (`security.capability`, which containerd
    // sets again when it unpacks the layer): a program that must hold one
    // as a non-root user (KubeVirt's virt-launcher-monitor) has it in the
    // image too.
    tar.args([
        "--numeric-owner",
        "--sort=name",
        "--xattrs",
        "--xattrs-include=security.capability",
    ]);
    if owners == Owners::Root {
        tar.args(["--owner=0", "--group=0"]);
    }
    run(tar.arg("-C").arg(dir).arg("-cf").arg(&layer).arg("."));
    let digest = file_blob(blobs, &layer);
    let size = std::fs::metadata(blobs.join(digest.trim_start_matches("sha256:")))
        .expect("the layer blob")
        .len();
    (digest, size as usize)
}

/// Writes `data` as a blob; its digest (`sha256:<hex>`) and size.
fn blob(blobs: &Path, data: &[u8]) -> (String, usize) {
    let tmp = blobs.join("incoming");
    std::fs::write(&tmp, data).expect("writing a blob");
    (file_blob(blobs, &tmp), data.len())
}

/// Renames the file `path` (in `blobs`) to its digest; the digest
/// (`sha256:<hex>`). Layers are not read into memory: a Debian root is
/// a hundred megabytes and more.
fn file_blob(blobs: &Path, path: &Path) -> String {
    let out = run(Command::new("sha256sum").arg(path));
    let hex = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .expect("sha256sum prints the digest")
        .to_string();
    std::fs::rename(path, blobs.join(&hex)).expect("naming a blob by its digest");
    format!("sha256:{hex}")
}

fn run(cmd: &mut Command) -> std::process::Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}
