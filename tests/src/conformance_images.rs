//! What Kubernetes' sig-network Conformance tests need beside a cluster,
//! built here and cached, with no registry:
//!
//! - [`e2e_dir`]: `e2e.test` (the e2e tests of the network packages,
//!   tests/k8s/e2e), `agnhost`, the porter's TLS files and upstream's
//!   `conformance.yaml` (tests/k8s/build.sh e2e);
//! - [`coredns_dir`]: `coredns` with the plugins of kubeadm's Corefile
//!   (tests/k8s/build.sh coredns);
//! - [`conformance_images`]: the images the tests run, as OCI archives for
//!   `ctr -n k8s.io images import`, under the names the tests ask for
//!   (k8s.io/kubernetes test/utils/image/manifest.go, pulled
//!   `IfNotPresent`) and CoreDNS's under the name kubeadm deploys it as.
//!
//! The images are not upstream's: the Debian ones are Debian 12 roots from
//! tests/k8s/images.sh (mmdebstrap) with the Go binaries built here on
//! top, the others a static busybox. Where they differ from upstream's:
//! agnhost's tools are Debian's (glibc), not Alpine's (musl), so the DNS
//! tests' "musl" probe runs glibc too; CoreDNS runs as root, not as
//! upstream's nonroot user with a file capability (kubeadm's Deployment
//! adds NET_BIND_SERVICE, which root keeps); pause is a shell script.
//!
//! Everything is cached under `$TETHER_K8S_DIR` (default
//! `/var/tmp/tether-k8s`), keyed by its inputs, and built at most once per
//! process.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use crate::kube::go_build;
use crate::oci::{Image, Owners, Rootfs};
use crate::workspace_dir;

/// agnhost, the tests' multi-purpose server and client (`/agnhost`), with
/// dig, curl, nc, ip, ss, bash, socat and `/coredns`.
pub const AGNHOST: &str = "registry.k8s.io/e2e-test-images/agnhost:2.66.1";
/// dig on glibc, beside agnhost in the DNS tests.
pub const GLIBC_DNS_TESTING: &str = "registry.k8s.io/e2e-test-images/glibc-dns-testing:2.1.1";
/// nginx, which the Endpoints and EndpointSlice tests only run.
pub const NGINX: &str = "registry.k8s.io/e2e-test-images/nginx:1.27.0-2";
/// pause, the endpoint-latency test's pods (and kubeadm's sandbox image).
pub const PAUSE: &str = "registry.k8s.io/pause:3.10.2";
/// busybox, every applet of Debian's static busybox.
pub const BUSYBOX: &str = "registry.k8s.io/e2e-test-images/busybox:1.37.0-2";
/// CoreDNS, under the name kubeadm 1.37 deploys the cluster DNS as
/// (cmd/kubeadm/app/constants: CoreDNSVersion; app/images: GetDNSImage).
pub const COREDNS: &str = "registry.k8s.io/coredns/coredns:v1.14.6";

/// Every image [`conformance_images`] packs, in that order.
pub const IMAGES: [&str; 6] = [AGNHOST, GLIBC_DNS_TESTING, NGINX, PAUSE, BUSYBOX, COREDNS];

/// `PATH` in the images: the usual one of Debian's containers.
const PATH: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The pause image's `/pause`: sleeps until SIGTERM or SIGINT, then exits
/// at once with status 0, as upstream's pause does (a shell cannot act on
/// a signal while a foreground command runs, hence `sleep &` and `wait`).
const PAUSE_SCRIPT: &str = "#!/bin/sh
# pause: does nothing until told to stop (SIGTERM or SIGINT), then exits 0.
trap 'kill \"$nap\" 2>/dev/null; exit 0' TERM INT
while :; do
    sleep 3600 &
    nap=$!
    wait \"$nap\"
done
";

/// The directory holding `e2e.test`, `agnhost`, `localhost.crt`,
/// `localhost.key` and `conformance.yaml` (tests/k8s/build.sh e2e, cached
/// across runs).
pub fn e2e_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| go_build("e2e"))
}

/// The directory holding `coredns` (tests/k8s/build.sh coredns, cached
/// across runs).
pub fn coredns_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| go_build("coredns"))
}

/// The directory holding the Debian roots `agnhost`, `glibc-dns-testing`
/// and `nginx` (tests/k8s/images.sh, cached across runs). Root only.
pub fn debian_roots_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let script = workspace_dir().join("tests/k8s/images.sh");
        let out = Command::new("sh")
            .arg(&script)
            .stderr(Stdio::inherit())
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
        assert!(out.status.success(), "tests/k8s/images.sh failed");
        PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
    })
}

/// Where the Go builds and the images are cached: `TETHER_K8S_DIR`, or
/// /var/tmp/tether-k8s (as tests/k8s/lib.sh).
pub(crate) fn cache_base() -> PathBuf {
    std::env::var_os("TETHER_K8S_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/tether-k8s"))
}

/// The images of the Conformance tests ([`IMAGES`]): each name with its
/// OCI archive. Built once (a few seconds beyond the Go builds and the
/// Debian roots they need) and cached, keyed by those builds, the static
/// busybox and the packing code. Root only.
pub fn conformance_images() -> Vec<(String, PathBuf)> {
    static IMAGES_DIR: OnceLock<PathBuf> = OnceLock::new();
    let dir = IMAGES_DIR.get_or_init(build_all);
    IMAGES
        .iter()
        .map(|name| (name.to_string(), dir.join(archive_name(name))))
        .collect()
}

/// `registry.k8s.io/e2e-test-images/agnhost:2.66.1` -> `agnhost.tar`.
fn archive_name(image: &str) -> String {
    let repo = image.rsplit_once(':').map_or(image, |(repo, _)| repo);
    format!("{}.tar", repo.rsplit('/').next().unwrap_or(repo))
}

fn build_all() -> PathBuf {
    let (e2e, coredns, roots) = (e2e_dir(), coredns_dir(), debian_roots_dir());
    // The inputs: the builds' directories (named by their own inputs),
    // the busybox the small images copy, and this code.
    let busybox = sha256(Command::new("sha256sum").arg("/bin/busybox"));
    let key = format!(
        "{}\n{}\n{}\n{busybox}\n{}\n{}",
        e2e.display(),
        coredns.display(),
        roots.display(),
        include_str!("conformance_images.rs"),
        include_str!("oci.rs"),
    );
    let key = &sha256_of(key.as_bytes())[..16];
    let what = format!("{} images", IMAGES.len());
    cached_pack("conformance-images", key, &what, |tmp| {
        pack_all(tmp, e2e, coredns, roots)
    })
}

/// The directory `<cache>/<name>-<key>` ([`cache_base`]), packed by
/// `pack` into a work directory (whose `work/` subdirectory it may use
/// for scratch) the first time, then moved into place whole: a pack
/// interrupted midway is never taken for done, and a process that loses
/// the race to another keeps the other's. Older packs of `name` go.
/// `what` names what is packed, for the progress lines on stderr.
pub(crate) fn cached_pack(name: &str, key: &str, what: &str, pack: impl FnOnce(&Path)) -> PathBuf {
    let base = cache_base();
    let out = base.join(format!("{name}-{key}"));
    if out.join("done").exists() {
        return out;
    }
    std::fs::create_dir_all(&base).expect("creating the cache dir");
    let start = std::time::Instant::now();
    let tmp = base.join(format!("{name}.{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).expect("removing an old work dir");
    }
    eprintln!("{name}: packing {what} (once; cached in {})", out.display());
    std::fs::create_dir(&tmp).expect("creating the images' work dir");
    pack(&tmp);
    let work = tmp.join("work");
    if work.exists() {
        std::fs::remove_dir_all(&work).expect("removing the pack's scratch");
    }
    std::fs::write(tmp.join("done"), "").expect("marking the images done");
    if let Err(e) = std::fs::rename(&tmp, &out) {
        // Another process packed them first: theirs will do.
        assert!(
            out.join("done").exists(),
            "moving the images to {}: {e}",
            out.display()
        );
        let _ = std::fs::remove_dir_all(&tmp);
        return out;
    }
    eprintln!("{name}: packed in {:.1} s", start.elapsed().as_secs_f64());
    // Older packs are of no more use.
    let prefix = format!("{name}-");
    if let Ok(entries) = std::fs::read_dir(&base) {
        for entry in entries.flatten() {
            let path = entry.path();
            if path != out && entry.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = std::fs::remove_dir_all(&path);
            }
        }
    }
    out
}

fn pack_all(tmp: &Path, e2e: &Path, coredns: &Path, roots: &Path) {
    let work = tmp.join("work");
    let out = |name: &str| tmp.join(archive_name(name));

    // agnhost: the Debian root, then what upstream's Dockerfile adds at the
    // root: /agnhost (and the /agnhost-2 link the entrypoint tests run),
    // /coredns, and the porter's certificate and key, which it reads
    // from its working directory, /.
    let extra = Rootfs::from_dir(&work.join("agnhost"));
    extra.copy(e2e.join("agnhost"), "agnhost", 0o755);
    std::os::unix::fs::symlink("agnhost", extra.dir().join("agnhost-2"))
        .expect("linking /agnhost-2");
    extra.copy(coredns.join("coredns"), "coredns", 0o755);
    extra.copy(e2e.join("localhost.crt"), "localhost.crt", 0o644);
    extra.copy(e2e.join("localhost.key"), "localhost.key", 0o644);
    Image::new(AGNHOST)
        .layer(&roots.join("agnhost"), Owners::AsTheyAre)
        .layer(extra.dir(), Owners::Root)
        .entrypoint(&["/agnhost"])
        .cmd(&["pause"])
        .env(&[PATH])
        .pack(&out(AGNHOST));

    // glibc-dns-testing: Debian with dig, and /coredns as upstream's.
    let extra = Rootfs::from_dir(&work.join("glibc-dns-testing"));
    extra.copy(coredns.join("coredns"), "coredns", 0o755);
    Image::new(GLIBC_DNS_TESTING)
        .layer(&roots.join("glibc-dns-testing"), Owners::AsTheyAre)
        .layer(extra.dir(), Owners::Root)
        .cmd(&["bash"])
        .env(&[PATH])
        .pack(&out(GLIBC_DNS_TESTING));

    // nginx in the foreground, as upstream's nginx image runs it.
    Image::new(NGINX)
        .layer(&roots.join("nginx"), Owners::AsTheyAre)
        .cmd(&["nginx", "-g", "daemon off;"])
        .env(&[PATH])
        .pack(&out(NGINX));

    let pause = Rootfs::busybox(&work.join("pause"));
    pause.write("pause", PAUSE_SCRIPT, 0o755);
    Image::new(PAUSE)
        .layer(pause.dir(), Owners::Root)
        .entrypoint(&["/pause"])
        .env(&[PATH])
        .pack(&out(PAUSE));

    let busybox = Rootfs::busybox(&work.join("busybox"));
    busybox.link_all_busybox_applets();
    Image::new(BUSYBOX)
        .layer(busybox.dir(), Owners::Root)
        .cmd(&["sh"])
        .env(&[PATH])
        .pack(&out(BUSYBOX));

    // CoreDNS alone (static), as upstream's image on distroless.
    let dns = Rootfs::from_dir(&work.join("coredns"));
    for d in ["etc", "tmp"] {
        std::fs::create_dir_all(dns.dir().join(d)).expect("creating a CoreDNS image dir");
    }
    dns.copy(coredns.join("coredns"), "coredns", 0o755);
    Image::new(COREDNS)
        .layer(dns.dir(), Owners::Root)
        .entrypoint(&["/coredns"])
        .env(&[PATH])
        .pack(&out(COREDNS));
}

/// The hex SHA-256 that `cmd` (a `sha256sum` run) prints first.
fn sha256(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?} failed");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .expect("sha256sum prints the digest")
        .to_string()
}

/// The hex SHA-256 of `data` (by `sha256sum`).
pub(crate) fn sha256_of(data: &[u8]) -> String {
    use std::io::Write;
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("running sha256sum");
    child
        .stdin
        .take()
        .expect("sha256sum's stdin")
        .write_all(data)
        .expect("writing to sha256sum");
    let out = child.wait_with_output().expect("waiting for sha256sum");
    assert!(out.status.success(), "sha256sum failed");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .expect("sha256sum prints the digest")
        .to_string()
}
