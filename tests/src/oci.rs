//! Container images without a registry: a root filesystem assembled from
//! files of this machine, packed as an OCI image layout archive (what
//! `ctr images import` reads), with the image's name in the index's
//! `io.containerd.image.name` annotation.
//!
//! One uncompressed layer, a config with the entrypoint and `PATH`, a
//! manifest and an index, each blob named by its SHA-256 (`sha256sum`).
//! The layer is packed by GNU tar with numeric owner 0, so the files in
//! the image belong to root whatever they belong to here.

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

    /// Packs the root as image `name` (fully qualified, e.g.
    /// `registry.k8s.io/pause:3.6`) into the OCI archive `out`, with
    /// `entrypoint`.
    pub fn pack(&self, name: &str, entrypoint: &[&str], out: &Path) {
        let work = out.with_extension("oci");
        let blobs = work.join("blobs/sha256");
        std::fs::create_dir_all(&blobs).expect("creating the blobs dir");
        let layer = work.join("layer.tar");
        run(Command::new("tar")
            .args(["--numeric-owner", "--owner=0", "--group=0", "--sort=name"])
            .arg("-C")
            .arg(&self.dir)
            .arg("-cf")
            .arg(&layer)
            .arg("."));
        let (layer_digest, layer_size) = blob(&blobs, &std::fs::read(&layer).expect("layer"));
        std::fs::remove_file(&layer).expect("removing the packed layer");
        let config = json!({
            "architecture": "amd64",
            "os": "linux",
            "config": {"Entrypoint": entrypoint, "Env": ["PATH=/usr/local/bin:/bin"]},
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        });
        let (config_digest, config_size) = blob(&blobs, config.to_string().as_bytes());
        let manifest = json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": config_digest, "size": config_size},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                        "digest": layer_digest, "size": layer_size}],
        });
        let (manifest_digest, manifest_size) = blob(&blobs, manifest.to_string().as_bytes());
        let tag = name.rsplit(':').next().unwrap_or("latest");
        let index = json!({
            "schemaVersion": 2,
            "manifests": [{
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest, "size": manifest_size,
                "annotations": {"io.containerd.image.name": name,
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

/// Writes `data` as a blob; its digest (`sha256:<hex>`) and size.
fn blob(blobs: &Path, data: &[u8]) -> (String, usize) {
    let tmp = blobs.join("incoming");
    std::fs::write(&tmp, data).expect("writing a blob");
    let out = run(Command::new("sha256sum").arg(&tmp));
    let hex = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .expect("sha256sum prints the digest")
        .to_string();
    std::fs::rename(&tmp, blobs.join(&hex)).expect("naming a blob by its digest");
    (format!("sha256:{hex}"), data.len())
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
