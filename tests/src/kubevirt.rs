//! KubeVirt itself on the multi-node cluster of [`crate::kube_cluster`], for the
//! KubeVirt suite (tests/e2e/kube/kubevirt.rs): built from source, packed
//! into images here, deployed as a user deploys it.
//!
//! - [`kubevirt_dir`]: KubeVirt v1.7.0's binaries, built from the
//!   `kubevirt.io/kubevirt` Go module (tests/k8s/kubevirt/build.sh), with
//!   the files its images carry from the module and the operator manifest
//!   rendered by KubeVirt's own templator.
//! - [`kubevirt_images`]: virt-operator, virt-api, virt-controller,
//!   virt-handler and virt-launcher as OCI archives under the names the
//!   operator derives from its own image (registry [`REGISTRY`], tag
//!   [`VERSION`]), for `ctr images import` on every node. The roots are
//!   Debian 12 (tests/k8s/kubevirt/images.sh), not upstream's CentOS
//!   Stream: the launcher runs Debian's libvirt 9.0 and QEMU 7.2.
//! - [`deploy`]: the operator manifest, then a KubeVirt CR, then KubeVirt
//!   `Available`.
//!
//! What differs from upstream's images, and why:
//! - Debian ships no `virtqemud` (only the monolithic `libvirtd`, with the
//!   same QEMU driver): the launcher's `/usr/sbin/virtqemud` is a shim
//!   ([`VIRTQEMUD_SHIM`]) that starts libvirtd with virtqemud's config and
//!   its socket where KubeVirt connects.
//! - `node-labeller.sh` is this harness's ([`NODE_LABELLER`]): it asks
//!   libvirt about software emulation (`qemu`) only. The stock one picks
//!   `kvm` whenever `/dev/kvm` exists, and this machine's paravirtual
//!   `/dev/kvm` cannot boot a normal guest; the CR sets `useEmulation`.
//! - virt-operator, virt-api and virt-controller run as uid 1001 (their
//!   Deployments ask for a non-root user without naming one).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub mod agent;
pub mod scenario;

use crate::kube_cluster::{KubeCluster, KubeNode};
use crate::oci::{Image, Owners, Rootfs};
use crate::{wait_until, workspace_dir};

/// The registry part of the images' names (none is pulled: every image is
/// imported into every node, and the operator deploys with
/// `IfNotPresent`).
pub const REGISTRY: &str = "localhost/kubevirt";
/// KubeVirt's version, the images' tag (tests/k8s/kubevirt/go.mod).
pub const VERSION: &str = "v1.7.0";
/// The namespace KubeVirt is installed in (the manifest's).
pub const NAMESPACE: &str = "kubevirt";
/// KubeVirt's components with an image of their own.
pub const COMPONENTS: [&str; 5] = [
    "virt-operator",
    "virt-api",
    "virt-controller",
    "virt-handler",
    "virt-launcher",
];
/// The hostPaths of virt-handler's DaemonSet that each node must keep its
/// own (`(dir name, path)`, for [`crate::topology::Topology::kubevirt`]):
/// on the machine they would be shared by the two nodes' handlers.
/// `/var/lib/kubelet` (and its `pods`) is a node path already.
pub const NODE_PATHS: [(&str, &str); 4] = [
    ("kubevirt-run", "/run/kubevirt"),
    ("kubevirt-private", "/run/kubevirt-private"),
    (
        "kubevirt-libvirt-runtimes",
        "/run/kubevirt-libvirt-runtimes",
    ),
    ("kubevirt-node-labeller", "/var/lib/kubevirt-node-labeller"),
];

/// `PATH` in the images.
const PATH: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The launcher's `/usr/sbin/virtqemud`: KubeVirt starts
/// `virtqemud -f /var/run/libvirt/virtqemud.conf` (as the launcher's uid,
/// 107) and connects to `/var/run/libvirt/virtqemud-sock`; node-labeller.sh
/// starts `virtqemud -d` as root. libvirtd takes the same config keys; its
/// socket is `libvirt-sock` in `unix_sock_dir`, linked under virtqemud's
/// name.
pub const VIRTQEMUD_SHIM: &str = r#"#!/bin/sh
# virtqemud for this image: Debian ships libvirtd (the same QEMU driver in
# one daemon) and no virtqemud. Starts libvirtd with the given config plus
# the socket directory KubeVirt uses, and links virtqemud's socket names to
# libvirtd's.
set -eu
conf=
daemon=
while [ $# -gt 0 ]; do
    case "$1" in
    -f | --config) conf=$2; shift 2 ;;
    -d | --daemon) daemon=--daemon; shift ;;
    *) shift ;;
    esac
done
dir=/var/run/libvirt
mkdir -p "$dir"
own="$dir/libvirtd-as-virtqemud.conf"
{
    if [ -n "$conf" ]; then cat "$conf"; fi
    echo "unix_sock_dir = \"$dir\""
} >"$own"
ln -sf libvirt-sock "$dir/virtqemud-sock"
ln -sf libvirt-sock-ro "$dir/virtqemud-sock-ro"
ln -sf libvirt-admin-sock "$dir/virtqemud-admin-sock"
exec /usr/sbin/libvirtd --config "$own" $daemon
"#;

/// The launcher's `/usr/bin/node-labeller.sh`, which virt-handler's init
/// container runs (privileged, as root): what libvirt offers for software
/// emulation on this node, in the files virt-handler's node labeller reads.
pub const NODE_LABELLER: &str = r#"#!/bin/sh
# node-labeller.sh for this image: records libvirt's capabilities for
# software emulation (virttype qemu) only. This machine's /dev/kvm cannot
# boot a normal guest, so KubeVirt runs with useEmulation and the guests
# are emulated (TCG).
set -eu
out=/var/lib/kubevirt-node-labeller
virtqemud -d
i=0
until virsh -c qemu:///system version >/dev/null 2>&1; do
    i=$((i + 1))
    if [ "$i" -gt 100 ]; then
        echo "node-labeller.sh: libvirtd did not answer" >&2
        exit 1
    fi
    sleep 0.1
done
virsh -c qemu:///system domcapabilities --machine q35 --arch x86_64 --virttype qemu \
    >"$out/virsh_domcapabilities.xml"
virsh -c qemu:///system hypervisor-cpu-baseline --features \
    --machine q35 --arch x86_64 --virttype qemu "$out/virsh_domcapabilities.xml" \
    >"$out/supported_features.xml"
virsh -c qemu:///system capabilities >"$out/capabilities.xml"
"#;

/// The directory holding KubeVirt's binaries, `files/` (what its images
/// carry from the module) and `kubevirt-operator.yaml`
/// (tests/k8s/kubevirt/build.sh, cached across runs).
pub fn kubevirt_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| run_script("tests/k8s/kubevirt/build.sh"))
}

/// The directory holding the Debian roots `base`, `handler` and
/// `launcher` (tests/k8s/kubevirt/images.sh, cached across runs). Root
/// only.
pub fn roots_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| run_script("tests/k8s/kubevirt/images.sh"))
}

fn run_script(relative: &str) -> PathBuf {
    let script = workspace_dir().join(relative);
    let out = Command::new("sh")
        .arg(&script)
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
    assert!(out.status.success(), "{relative} failed");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// A component's image name (`localhost/kubevirt/virt-api:v1.7.0`).
pub fn image(component: &str) -> String {
    format!("{REGISTRY}/{component}:{VERSION}")
}

/// KubeVirt's images ([`COMPONENTS`]): each name with its OCI archive.
/// Packed once and cached, keyed by the builds they are made of and this
/// code. Root only.
pub fn kubevirt_images() -> Vec<(String, PathBuf)> {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    let dir = DIR.get_or_init(pack_cached);
    COMPONENTS
        .iter()
        .map(|c| (image(c), dir.join(format!("{c}.tar"))))
        .collect()
}

fn pack_cached() -> PathBuf {
    let (bins, roots) = (kubevirt_dir(), roots_dir());
    let key = format!(
        "{}\n{}\n{}\n{}",
        bins.display(),
        roots.display(),
        include_str!("kubevirt.rs"),
        include_str!("oci.rs"),
    );
    let key = &crate::conformance_images::sha256_of(key.as_bytes())[..16];
    crate::conformance_images::cached_pack("kubevirt-images", key, "KubeVirt's images", |tmp| {
        pack_all(tmp, bins, roots)
    })
}

fn pack_all(tmp: &Path, bins: &Path, roots: &Path) {
    let work = tmp.join("work");
    let files = bins.join("files");
    // The control-plane components: the minbase root and the binary, as a
    // non-root user.
    for c in ["virt-operator", "virt-api", "virt-controller"] {
        let top = Rootfs::from_dir(&work.join(c));
        top.copy(bins.join(c), &format!("usr/bin/{c}"), 0o755);
        Image::new(&image(c))
            .layer(&roots.join("base"), Owners::AsTheyAre)
            .layer(top.dir(), Owners::Root)
            .entrypoint(&[&format!("/usr/bin/{c}")])
            .env(&[PATH])
            .user("1001")
            .pack(&tmp.join(format!("{c}.tar")));
    }

    // virt-handler, with virt-chroot (which it runs for mounts and taps).
    let top = Rootfs::from_dir(&work.join("virt-handler"));
    for b in ["virt-handler", "virt-chroot"] {
        top.copy(bins.join(b), &format!("usr/bin/{b}"), 0o755);
    }
    top.copy(files.join("nsswitch.conf"), "etc/nsswitch.conf", 0o644);
    // virt-handler looks QEMU's user up by name (`qemu`, 107), as
    // upstream's handler image has it.
    add_lines(
        &top,
        &roots.join("handler"),
        &[
            ("etc/passwd", "qemu:x:107:107:qemu:/:/usr/sbin/nologin\n"),
            ("etc/group", "qemu:x:107:\n"),
        ],
    );
    Image::new(&image("virt-handler"))
        .layer(&roots.join("handler"), Owners::AsTheyAre)
        .layer(top.dir(), Owners::Root)
        .entrypoint(&["/usr/bin/virt-handler"])
        .env(&[PATH])
        .pack(&tmp.join("virt-handler.tar"));

    // virt-launcher: its programs, KubeVirt's libvirt and QEMU configs and
    // hook, the virtqemud shim and the node labeller.
    let top = Rootfs::from_dir(&work.join("virt-launcher"));
    for b in [
        "virt-launcher",
        "virt-launcher-monitor",
        "virt-freezer",
        "virt-probe",
        "virt-tail",
        "container-disk",
    ] {
        top.copy(bins.join(b), &format!("usr/bin/{b}"), 0o755);
    }
    top.write("usr/bin/node-labeller.sh", NODE_LABELLER, 0o755);
    // /var/run relative (../run), as on Fedora and CentOS: Debian's is
    // absolute (/run), and virt-handler reaches the launcher's sockets
    // through /proc/<pid>/root/var/run/..., where an absolute link resolves
    // in virt-handler's own root. Its migration proxy socket then lands in
    // its own /run, and the source's libvirt cannot find it ("Failed to
    // connect socket to '/var/run/kubevirt/migrationproxy/<uid>-source.sock'").
    std::fs::create_dir_all(top.dir().join("var")).expect("creating var");
    std::os::unix::fs::symlink("../run", top.dir().join("var/run")).expect("linking /var/run");
    top.write("usr/sbin/virtqemud", VIRTQEMUD_SHIM, 0o755);
    top.copy(files.join("qemu.conf"), "etc/libvirt/qemu.conf", 0o644);
    top.copy(
        files.join("virtqemud.conf"),
        "etc/libvirt/virtqemud.conf",
        0o644,
    );
    top.copy(files.join("qemu"), "etc/libvirt/hooks/qemu", 0o755);
    // KubeVirt starts `virtlogd -f /etc/libvirt/virtlogd.conf`; Debian's
    // libvirt-daemon ships no such file (libvirt-daemon-system does, with
    // systemd units the image has no use for): virtlogd's defaults.
    top.write(
        "etc/libvirt/virtlogd.conf",
        "# virtlogd with its defaults (KubeVirt names this file).\n",
        0o644,
    );
    top.copy(files.join("nsswitch.conf"), "etc/nsswitch.conf", 0o644);
    // Debian's libvirt is built to run QEMU as libvirt-qemu and looks the
    // user up when its QEMU driver starts as root (node-labeller.sh),
    // before qemu.conf names KubeVirt's `qemu`: the user the package's
    // libvirt-daemon-system would have made, beside the root's own.
    add_lines(
        &top,
        &roots.join("launcher"),
        &[
            (
                "etc/passwd",
                "libvirt-qemu:x:64055:64055:Libvirt Qemu:/var/lib/libvirt:/usr/sbin/nologin\n",
            ),
            ("etc/group", "libvirt-qemu:x:64055:\n"),
        ],
    );
    // The root daemon's log (node-labeller.sh): Debian makes the directory
    // in libvirt-daemon-system.
    std::fs::create_dir_all(top.dir().join("var/log/libvirt")).expect("creating /var/log/libvirt");
    // As upstream's image: virt-launcher-monitor may bind low ports and
    // hands that on to virt-launcher and libvirtd (ambient), which it
    // cannot do as uid 107 without the file capability.
    let monitor = top.dir().join("usr/bin/virt-launcher-monitor");
    let out = Command::new("setcap")
        .arg("cap_net_bind_service=+ep")
        .arg(&monitor)
        .output()
        .expect("running setcap");
    assert!(
        out.status.success(),
        "setcap on virt-launcher-monitor: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Image::new(&image("virt-launcher"))
        .layer(&roots.join("launcher"), Owners::AsTheyAre)
        .layer(top.dir(), Owners::Root)
        .entrypoint(&["/usr/bin/virt-launcher"])
        .env(&[PATH])
        .pack(&tmp.join("virt-launcher.tar"));
}

/// Writes into `top` each `(file, line)`'s file as the lower root `lower`
/// has it, with `line` added (a user in `etc/passwd`, say).
fn add_lines(top: &Rootfs, lower: &Path, lines: &[(&str, &str)]) {
    for (file, line) in lines {
        let base = std::fs::read_to_string(lower.join(file))
            .unwrap_or_else(|e| panic!("reading {}: {e}", lower.join(file).display()));
        top.write(file, &format!("{base}{line}"), 0o644);
    }
}

/// Gives every image imported into `node`'s containerd the name
/// `<repository>@<manifest digest>` beside its tag, as a registry pull
/// would. The CRI then reports a pod's `imageID` as that repository
/// digest; without one it reports the config digest (`sha256:...`), and
/// KubeVirt, which pins a migration target's container disk to
/// `<repository>@<the source's imageID>`, asks the target node for an image
/// that exists nowhere (ImagePullBackOff).
pub fn add_repo_digests(node: &KubeNode) {
    let out = node.ctr(&["images", "ls"]);
    assert!(out.status.success(), "ctr images ls on {}", node.name());
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    for line in text.lines().skip(1) {
        let mut fields = line.split_whitespace();
        let (Some(name), Some(_), Some(digest)) = (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        if name.starts_with("sha256:") || name.contains('@') {
            continue;
        }
        let slash = name.rfind('/').map_or(0, |i| i + 1);
        let repo = match name[slash..].rfind(':') {
            Some(i) => &name[..slash + i],
            None => name,
        };
        let with_digest = format!("{repo}@{digest}");
        let out = node.ctr(&["images", "tag", "--force", name, &with_digest]);
        assert!(
            out.status.success(),
            "ctr images tag {name} {with_digest} on {}: {}",
            node.name(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Lets QEMU (uid 107) open `/dev/net/tun` on `node`: on this machine the
/// device is mode 0600, where a distribution has 0666. The node's mount
/// namespace gets a 0666 node of the same device (10, 200) bound over it;
/// containerd then hands that mode to the launcher pods (virt-handler's
/// device plugin provides the device). The machine's `/dev` is unchanged.
pub fn open_tun(node: &KubeNode) {
    let tun = node.host_path("/run/kubevirt").with_file_name("tun");
    let tun = tun.display().to_string();
    let out = node.run(&[
        "sh",
        "-c",
        &format!("mknod -m 0666 {tun} c 10 200 && mount --bind {tun} /dev/net/tun"),
    ]);
    assert!(
        out.status.success(),
        "binding a 0666 /dev/net/tun on {}: {}",
        node.name(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The KubeVirt CR: software emulation, one replica of virt-api and
/// virt-controller, and `bindings` (name → binding plugin, e.g.
/// `{"tether": {"domainAttachmentType": "tap", "migration": {}}}`).
pub fn kubevirt_cr(bindings: Value) -> Value {
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "KubeVirt",
        "metadata": {"name": "kubevirt", "namespace": NAMESPACE},
        "spec": {
            "imagePullPolicy": "IfNotPresent",
            "infra": {"replicas": 1},
            "configuration": {
                "developerConfiguration": {
                    "useEmulation": true,
                    // The guest's disk is a shared hostDisk (see guest_disk).
                    "featureGates": ["HostDisk"],
                },
                "network": {"binding": bindings},
            },
        },
    })
}

/// Deploys KubeVirt on `cluster` as a user does: the operator manifest
/// (`kubevirt-operator.yaml`, rendered by the build), the operator
/// running, then `cr`; waits until the KubeVirt CR is `Available`, at most
/// `limit`. Returns the time it took.
pub fn deploy(cluster: &KubeCluster, cr: &Value, limit: Duration) -> Duration {
    let start = Instant::now();
    let api = &cluster.api;
    // virt-operator must run on a control-plane node (its Deployment's
    // required node affinity), as on kind, where kubevirtci deploys it;
    // this cluster's control plane runs no kubelet: the nodes get the
    // role's label.
    for node in cluster.nodes() {
        api.kubectl_ok(&[
            "label",
            "--overwrite",
            "node",
            node.name(),
            "node-role.kubernetes.io/control-plane=",
        ]);
    }
    let manifest = kubevirt_dir().join("kubevirt-operator.yaml");
    api.kubectl_ok(&["apply", "-f", &manifest.display().to_string()]);
    // One operator, as one replica of every component (the CR's `infra`).
    api.kubectl_ok(&[
        "-n",
        NAMESPACE,
        "scale",
        "deployment/virt-operator",
        "--replicas=1",
    ]);
    let out = api.kubectl(&[
        "-n",
        NAMESPACE,
        "rollout",
        "status",
        "deployment/virt-operator",
        "--timeout=300s",
    ]);
    assert!(
        out.status.success(),
        "virt-operator not available: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        describe(cluster)
    );
    api.apply(&cr.to_string());
    let available = wait_until(limit, || {
        let kv = api
            .get(&["-n", NAMESPACE, "kubevirt", "kubevirt"])
            .unwrap_or(Value::Null);
        kv["status"]["conditions"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["type"] == "Available"))
            .is_some_and(|c| c["status"] == "True")
    });
    assert!(
        available,
        "KubeVirt not Available in {limit:?}\n{}",
        describe(cluster)
    );
    start.elapsed()
}

/// What KubeVirt's namespace holds (the CR's status, pods, recent events,
/// the last lines of every container's log): for failure messages.
pub fn describe(cluster: &KubeCluster) -> String {
    let api = &cluster.api;
    let text = |args: &[&str]| {
        let o = api.kubectl(args);
        format!(
            "$ kubectl {}\n{}{}",
            args.join(" "),
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    };
    let mut s = String::new();
    s += &text(&["-n", NAMESPACE, "get", "kubevirt", "kubevirt", "-o", "yaml"]);
    s += &text(&["get", "pods", "-A", "-o", "wide"]);
    s += &text(&[
        "get",
        "events",
        "-A",
        "--sort-by=.lastTimestamp",
        "-o",
        "custom-columns=NS:.metadata.namespace,OBJ:.involvedObject.name,REASON:.reason,MSG:.message",
    ]);
    let pods = api.get(&["-n", NAMESPACE, "pods"]).unwrap_or(Value::Null);
    for pod in pods["items"].as_array().into_iter().flatten() {
        let name = pod["metadata"]["name"].as_str().unwrap_or_default();
        for kind in ["initContainers", "containers"] {
            for c in pod["spec"][kind].as_array().into_iter().flatten() {
                let c = c["name"].as_str().unwrap_or_default();
                s += &text(&["-n", NAMESPACE, "logs", name, "-c", c, "--tail=30"]);
            }
        }
    }
    s
}

/// The test guest (tests/guest: kernel and initramfs) as a container disk
/// (`/disk/boot.img`): a FAT disk image booted by SYSLINUX, with the
/// kernel, the initramfs and the guest's command line (udhcpc leasing on
/// its one interface). Packed into `dir`; returns the image's name and
/// archive.
///
/// Not `firmware.kernelBoot.container`, which boots the same guest without
/// a disk: KubeVirt 1.7 cannot migrate such a VM. On the migration
/// target, virt-handler mounts the kernel artifacts at every sync, and
/// from the second one on `mkdir` of their directory fails with EEXIST,
/// which it means to ignore but does not recognise
/// (`os.IsExist` on an error wrapped with `%w`,
/// pkg/virt-handler/container-disk/mount.go mountKernelArtifacts and
/// pkg/safepath MkdirAtNoFollow): the migration fails with "error
/// mounting kernel artifacts: failed making the directory ...: file
/// exists". A container disk's file is made with another call, whose
/// error it does recognise.
pub fn guest_image(dir: &Path) -> (String, PathBuf) {
    let name = "localhost/tether/guest-disk:1".to_string();
    let root = Rootfs::from_dir(&dir.join("guest-disk"));
    root.copy(guest_disk(dir), "disk/boot.img", 0o644);
    let archive = dir.join("guest-disk.tar");
    Image::new(&name)
        .layer(root.dir(), Owners::Root)
        .env(&[PATH])
        .pack(&archive);
    (name, archive)
}

/// The guest's boot disk of [`guest_image`] (with the guest agent) as a
/// file in `dir`
/// (`boot.img`, mode 0666 so that QEMU's uid opens it): for a `hostDisk`
/// with `shared: true`, which a migration does not copy. A VM with a
/// container disk migrates with a copy of its disk, and KubeVirt 1.7 then
/// passes libvirt `migrate_disks_detect_zeroes`, which Debian's libvirt 9.0
/// refuses ("argument unsupported: parameter 'migrate_disks_detect_zeroes'
/// not supported", libvirt 10.9 has it).
pub fn guest_disk(dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let guest = crate::qemu::guest_dir();
    let img = dir.join("boot.img");
    let cfg = dir.join("syslinux.cfg");
    std::fs::write(
        &cfg,
        "DEFAULT guest\nSERIAL 0 115200\nPROMPT 0\nTIMEOUT 0\nLABEL guest\n  KERNEL vmlinuz\n  INITRD initrd.gz\n  APPEND console=ttyS0 quiet loglevel=1 panic=-1 tether.dhcp4=udhcpc tether.dhcp6=none\n",
    )
    .expect("writing syslinux.cfg");
    let img_s = img.display().to_string();
    let run = |argv: &[&str]| {
        let out = Command::new(argv[0])
            .args(&argv[1..])
            .output()
            .unwrap_or_else(|e| panic!("running {argv:?}: {e}"));
        assert!(
            out.status.success(),
            "{argv:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&["mkfs.vfat", "-C", &img_s, "32768"]);
    run(&["syslinux", "--install", &img_s]);
    // The initramfs with the guest agent's overlay after it (one initrd
    // of two cpio archives, tests/guest/build.sh): KubeVirt shows the
    // guest's addresses from the agent, and [`agent::AgentShell`] runs
    // the suite's commands through it.
    let initrd = dir.join("initrd.gz");
    let mut both = std::fs::read(guest.join("initramfs.gz")).expect("reading the initramfs");
    both.extend(std::fs::read(guest.join("agent.cpio.gz")).expect("reading the agent's overlay"));
    std::fs::write(&initrd, both).expect("writing the guest's initrd");
    for (src, dest) in [
        (guest.join("vmlinuz"), "::vmlinuz"),
        (initrd, "::initrd.gz"),
        (cfg.clone(), "::syslinux.cfg"),
    ] {
        run(&["mcopy", "-i", &img_s, &src.display().to_string(), dest]);
    }
    // KubeVirt 1.7 writes the container disk's CRC-32 (a uint32) into the
    // VMI's status (`volumeStatus[].containerDiskVolume.checksum`), whose
    // CRD schema says `format: int32`; Kubernetes 1.37 enforces integer
    // formats, so a checksum of 2^31 or more makes every status update of
    // the VMI fail (KubeVirt 1.7 is built against Kubernetes 1.33). Zero
    // sectors after the file system change nothing: pad until it fits.
    pad_to_int32_checksum(&img);
    std::fs::set_permissions(&img, std::fs::Permissions::from_mode(0o666))
        .expect("making the guest disk QEMU's to open");
    img
}

/// CRC-32 (IEEE, as Go's `hash/crc32.ChecksumIEEE`) of `data`.
fn crc32(data: &[u8]) -> u32 {
    let mut table = [0u32; 256];
    for (i, entry) in table.iter_mut().enumerate() {
        let mut c = i as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
        *entry = c;
    }
    let mut crc = !0u32;
    for b in data {
        crc = table[((crc ^ *b as u32) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

/// Appends zero bytes to `path` until its CRC-32 is below 2^31 (see
/// [`guest_image`]).
fn pad_to_int32_checksum(path: &Path) {
    let mut data =
        std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    for _ in 0..256 {
        if crc32(&data) < 1 << 31 {
            std::fs::write(path, &data)
                .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
            return;
        }
        data.extend_from_slice(&[0; 512]);
    }
    panic!("no padding of {} gives a CRC-32 below 2^31", path.display());
}

/// A VirtualMachine `name` in `default` booting the test guest from the
/// volume `boot` (named `boot`: [`guest_image`] as a `containerDisk`, or
/// [`guest_disk`] as a shared `hostDisk`; udhcpc leasing on its one
/// interface), on the network
/// binding plugin `binding` (the CR's name) with tether's side chosen by
/// the annotation `tether.dev/binding: tether_binding`; running at once
/// (`runStrategy: Always`).
pub fn vm_manifest(name: &str, boot: Value, binding: &str, tether_binding: &str) -> Value {
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "runStrategy": "Always",
            "template": {
                "metadata": {
                    "labels": {"tether.dev/test-vm": name},
                    "annotations": {"tether.dev/binding": tether_binding},
                },
                "spec": {
                    "terminationGracePeriodSeconds": 0,
                    "domain": {
                        "cpu": {"cores": 1},
                        "memory": {"guest": "128Mi"},
                        // A CPU limit (the machine's two cores: it throttles
                        // nothing) keeps KubeVirt 1.7 from migrating with
                        // multifd (8 parallel connections), which Debian's
                        // QEMU 7.2 cannot take through KubeVirt's migration
                        // proxy: QEMU before 8.0 takes the first connection
                        // it accepts for the main stream, and the proxy
                        // carries each connection over a TLS connection of
                        // its own, so a multifd channel can arrive first
                        // ("multifd: received packet magic 5145564d
                        // expected 11223344" on the target, "Unable to write
                        // to socket: Broken pipe" on the source). QEMU 8.0+
                        // (upstream's launcher has 9.1) tells the channels
                        // apart by their first bytes. KubeVirt skips multifd
                        // for a VMI with a CPU limit (or post-copy allowed).
                        "resources": {
                            "requests": {"cpu": "100m"},
                            "limits": {"cpu": "2"},
                        },
                        "devices": {
                            // Read-only: the guest runs from its initramfs, and
                            // libvirt refuses to migrate a writable disk that is
                            // not on storage it knows as shared ("Unsafe
                            // migration: Migration without shared storage is
                            // unsafe").
                            "disks": [{"name": "boot", "disk": {"bus": "virtio", "readonly": true}}],
                            "interfaces": [{"name": "default", "binding": {"name": binding}}],
                        },
                    },
                    "volumes": [boot],
                    "networks": [{"name": "default", "pod": {}}],
                },
            },
        },
    })
}

/// Follows the logs of every container of KubeVirt's pods (virt-handler's
/// in [`NAMESPACE`], the launchers' in `default`) and tether's into files of a
/// directory, from the moment each runs until it ends: a migration's
/// target launcher is deleted when the migration fails, and its libvirt
/// and QEMU log (the `compute` container's) with it. One `kubectl logs -f`
/// per container, ended (by its PID) when the follower is dropped.
pub struct LogFollower {
    dir: PathBuf,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LogFollower {
    /// Starts following into `dir` (emptied first).
    pub fn start(cluster: &KubeCluster, dir: &Path) -> LogFollower {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).expect("creating the logs' dir");
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let kubectl = {
            let netns = cluster.api.netns().name().to_string();
            let kubeconfig = cluster.api.admin_kubeconfig();
            move |args: &[&str]| {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &netns])
                    .arg(crate::kube::k8s_bin_dir().join("kubectl"))
                    .arg(format!("--kubeconfig={}", kubeconfig.display()))
                    .args(args);
                c
            }
        };
        let thread = {
            let (dir, stop) = (dir.to_path_buf(), stop.clone());
            std::thread::spawn(move || {
                let mut children: Vec<std::process::Child> = Vec::new();
                let mut seen = std::collections::HashSet::new();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let list = |selector: &str| {
                        let out = kubectl(&[
                            "--request-timeout=10s",
                            "get",
                            "pods",
                            "-A",
                            "-l",
                            selector,
                            "-o",
                            "json",
                        ])
                        .output();
                        let pods = out
                            .ok()
                            .and_then(|o| serde_json::from_slice::<Value>(&o.stdout).ok())
                            .unwrap_or(Value::Null);
                        pods["items"].as_array().cloned().unwrap_or_default()
                    };
                    let mut pods = list("kubevirt.io in (virt-handler,virt-launcher)");
                    pods.extend(list("app.kubernetes.io/name=tether"));
                    for pod in &pods {
                        let ns = pod["metadata"]["namespace"].as_str().unwrap_or_default();
                        let name = pod["metadata"]["name"].as_str().unwrap_or_default();
                        for c in pod["status"]["containerStatuses"]
                            .as_array()
                            .into_iter()
                            .flatten()
                        {
                            let cname = c["name"].as_str().unwrap_or_default();
                            if c["state"]["running"].is_null() {
                                continue;
                            }
                            let key = format!("{name}_{cname}");
                            if !seen.insert(key.clone()) {
                                continue;
                            }
                            let Ok(file) = std::fs::File::create(dir.join(format!("{key}.log")))
                            else {
                                continue;
                            };
                            let child = kubectl(&[
                                "--request-timeout=0",
                                "-n",
                                ns,
                                "logs",
                                "-f",
                                "--timestamps",
                                name,
                                "-c",
                                cname,
                            ])
                            .stdout(file)
                            .stderr(Stdio::null())
                            .spawn();
                            if let Ok(child) = child {
                                children.push(child);
                            }
                        }
                    }
                    children.retain_mut(|c| matches!(c.try_wait(), Ok(None)));
                    std::thread::sleep(Duration::from_millis(500));
                }
                for mut child in children {
                    let _ = child.kill();
                    let _ = child.wait();
                }
            })
        };
        LogFollower {
            dir: dir.to_path_buf(),
            stop,
            thread: Some(thread),
        }
    }

    /// Where the logs are: one file per container, `<pod>_<container>.log`.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for LogFollower {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `virsh args` in launcher pod `pod` (namespace `default`), in its
/// `compute` container, against the non-root launcher's session daemon.
pub fn virsh(cluster: &KubeCluster, pod: &str, args: &[&str]) -> std::process::Output {
    let mut argv = vec![
        "-n",
        "default",
        "exec",
        pod,
        "-c",
        "compute",
        "--",
        "virsh",
        "-c",
        "qemu+unix:///session?socket=/var/run/libvirt/virtqemud-sock",
    ];
    argv.extend_from_slice(args);
    cluster.api.kubectl(&argv)
}

/// libvirt's statistics of the last migration job of VMI `vmi` as its
/// launcher pod `pod` has them (`virsh domjobinfo --completed`, inside the
/// pod's `compute` container, on the non-root launcher's session daemon):
/// each `Key: value` line. On a migration's target they are the source's,
/// sent along at the end of the migration (downtime included).
pub fn completed_job(cluster: &KubeCluster, pod: &str, vmi: &str) -> Vec<(String, String)> {
    let out = virsh(
        cluster,
        pod,
        &["domjobinfo", "--completed", &format!("default_{vmi}")],
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| {
            let v = v.split_whitespace().collect::<Vec<_>>().join(" ");
            (k.trim().to_string(), v)
        })
        .collect()
}

/// Whether this machine's kernel has dummy links, which KubeVirt's
/// `managedTap` binding needs (virt-handler puts a dummy named after the
/// pod interface, with its addresses, where that interface was). Tried in
/// a network namespace made for the purpose. The kernel of these
/// machines (6.18.44-fc) has none, and no modules: virt-handler fails
/// every managedTap VM with "failed to configure vmi network: setup
/// failed, err: Critical network error: LinkAdd: operation not supported".
pub fn kernel_has_dummy_links() -> bool {
    let ns = crate::netns::Netns::new("kvdummy");
    ns.exec(&["ip", "link", "add", "probe0", "type", "dummy"])
        .status
        .success()
}
