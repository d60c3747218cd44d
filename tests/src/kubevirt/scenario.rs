//! KubeVirt's scenarios on a running cluster, shared by the KubeVirt
//! suite (tests/e2e/kube/kubevirt.rs) and its benchmark (tether-bench kubevirt):
//! the cluster brought up as a user deploys KubeVirt ([`Setup::start`]),
//! VMIs followed through KubeVirt's API, and a migration measured from an
//! observer that pings the guest every millisecond ([`migrate_observed`]).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::kube_cluster::{KubeCluster, KubePaths};
use crate::migration::Prober;
use crate::paths::{GuestShell, PathSet};
use crate::streams::StreamReport;
use crate::topology::Topology;
use crate::{wait_until, TempDir};

use super::{kubevirt_cr, vm_manifest, LogFollower};

/// A two-node cluster with tether installed by its chart and KubeVirt
/// deployed on it (tether's `tap` binding as `tether`, the `managedTap`
/// binding as `tether-managed`), every KubeVirt container's log followed.
pub struct Setup {
    /// The cluster, KubeVirt deployed on it.
    pub cluster: KubeCluster,
    /// The nodes' names.
    pub names: Vec<String>,
    /// The guest's boot volume: the test guest on a shared host disk.
    pub boot: Value,
    _logs: LogFollower,
    _images: TempDir,
}

impl Setup {
    /// Builds (or takes from the cache) the images, starts the cluster,
    /// installs tether and deploys KubeVirt; says how long each step took.
    pub fn start() -> Setup {
        let images = TempDir::new("kvimg");
        let t0 = Instant::now();
        let disk = super::guest_disk(images.path());
        let boot = json!({"name": "boot", "hostDisk": {
            "path": disk.display().to_string(), "type": "Disk", "shared": true,
        }});
        let topology = Topology::kubelet(2).kubevirt();
        eprintln!("kubevirt: images ready in {:?}", t0.elapsed());

        let t = Instant::now();
        let cluster = topology.start();
        let tether = cluster.build_tether_image("1");
        cluster.install_tether(&tether);
        let names = cluster
            .nodes()
            .iter()
            .map(|n| n.name().to_string())
            .collect();
        eprintln!("kubevirt: cluster with tether in {:?}", t.elapsed());
        // Every KubeVirt container's log, kept past its pod (a failed
        // migration's target launcher is deleted with its libvirt and
        // QEMU log).
        let logs = LogFollower::start(&cluster, &std::env::temp_dir().join("tether-kubevirt-logs"));
        let _ = LOGS.set(logs.dir().to_path_buf());
        eprintln!(
            "kubevirt: KubeVirt's logs follow in {}",
            logs.dir().display()
        );

        let cr = kubevirt_cr(json!({
            "tether": {"domainAttachmentType": "tap", "migration": {}},
            "tether-managed": {"domainAttachmentType": "managedTap", "migration": {}},
        }));
        let took = super::deploy(&cluster, &cr, Duration::from_secs(600));
        eprintln!("kubevirt: KubeVirt Available in {took:?}");
        Setup {
            cluster,
            names,
            boot,
            _logs: logs,
            _images: images,
        }
    }

    /// Boots VM `name` on binding `binding` (the domain attachment
    /// `attachment`), waits until it runs and its guest leased its
    /// address from tether: (node, IP, MAC).
    pub fn boot_vm(&self, name: &str, binding: &str, attachment: &str) -> (String, String, String) {
        self.boot(vm_manifest(name, self.boot.clone(), binding, attachment))
    }

    /// Boots the VirtualMachine `vm` (from [`vm_manifest`], perhaps
    /// changed), as [`Setup::boot_vm`].
    pub fn boot(&self, vm: Value) -> (String, String, String) {
        let c = &self.cluster;
        let name = vm["metadata"]["name"].as_str().expect("the VM's name");
        let t = Instant::now();
        c.api.apply(&vm.to_string());
        let (node, ip) = wait_vmi_running(c, name, Duration::from_secs(300));
        eprintln!(
            "kubevirt: {name} running on {node} with {ip} in {:?}",
            t.elapsed()
        );
        wait_lease(c, name, &node, &ip);
        let mac = vmi_mac(c, name);
        eprintln!(
            "kubevirt: {name}'s guest leased {ip} (MAC {mac}) from tether; the VMI status's IP: {:?}",
            vmi_status_ip(c, name)
        );
        (node, ip, mac)
    }

    /// The node that is not `node`.
    pub fn other_than(&self, node: &str) -> String {
        self.names
            .iter()
            .find(|n| *n != node)
            .expect("two nodes")
            .clone()
    }
}

/// The VMI `name` once it runs: (node, IP). The IP is the VMI status's
/// when KubeVirt reports one; KubeVirt 1.7 reports none for a network
/// binding plugin (`tap`, `managedTap`) without a guest agent in the guest
/// (its interface's `infoSource` is `domain` only), so then it is the
/// launcher pod's IP, tether's, which the guest must have leased
/// ([`wait_lease`] checks that).
pub fn wait_vmi_running(c: &KubeCluster, name: &str, limit: Duration) -> (String, String) {
    let mut last = Value::Null;
    let ok = wait_until(limit, || {
        last = c
            .api
            .get(&["-n", "default", "vmi", name])
            .unwrap_or(Value::Null);
        last["status"]["phase"] == "Running"
            && last["status"]["migrationState"]["completed"] != false
    });
    assert!(
        ok,
        "VMI {name} not running in {limit:?}: {}\n{}",
        serde_json::to_string_pretty(&last["status"]).unwrap_or_default(),
        super::describe(c)
    );
    let node = last["status"]["nodeName"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let ip = match last["status"]["interfaces"][0]["ipAddress"].as_str() {
        Some(ip) => ip.to_string(),
        None => {
            let pod = launcher_pod(c, name, &node).expect("the VMI's launcher pod");
            c.api
                .get(&["-n", "default", "pod", &pod])
                .unwrap_or(Value::Null)["status"]["podIP"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        }
    };
    (node, ip)
}

/// Whether VMI `name`'s status shows an IP of its own.
pub fn vmi_status_ip(c: &KubeCluster, name: &str) -> Option<String> {
    c.api
        .get(&["-n", "default", "vmi", name])
        .unwrap_or(Value::Null)["status"]["interfaces"][0]["ipAddress"]
        .as_str()
        .map(str::to_string)
}

/// The MAC of VMI `name`'s interface, as its status shows it.
pub fn vmi_mac(c: &KubeCluster, name: &str) -> String {
    c.api
        .get(&["-n", "default", "vmi", name])
        .unwrap_or(Value::Null)["status"]["interfaces"][0]["mac"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// Waits until the guest on `node` printed its lease of `ip` (udhcpc's
/// `bound` event) on its serial console.
pub fn wait_lease(c: &KubeCluster, vmi: &str, node: &str, ip: &str) {
    let pod =
        launcher_pod(c, vmi, node).unwrap_or_else(|| panic!("{vmi}'s launcher pod on {node}"));
    let mut text = String::new();
    let leased = wait_until(Duration::from_secs(120), || {
        text = console(c, &pod);
        text.contains(&format!("TETHER-LEASE4 event=bound ip={ip} "))
    });
    assert!(
        leased,
        "{vmi}'s guest did not lease {ip} from tether:\n{text}"
    );
}

/// One migration's figures: the time from the migration object's
/// creation to its `Succeeded`, the observer's longest loss window, and
/// the downtime libvirt reports (ms).
#[derive(Debug, Clone)]
pub struct Measured {
    /// From the migration object's creation to its `Succeeded`.
    pub took: Duration,
    /// From its creation to the domain running on the target.
    pub running: Option<Duration>,
    /// Whether the target's virt-handler had to be restarted.
    pub healed: bool,
    /// From the first lost ping to the target tetherd's read of the
    /// guest's announcement (ms): the guest's pause as the network saw it.
    pub stop_to_rarp_ms: Option<f64>,
    /// From that read to the send of the first answered ping after the
    /// loss (ms): tether's repointing on the observer's path, plus up to
    /// one ping interval.
    pub rarp_to_answer_ms: Option<f64>,
    /// From that read to the last node's route change (ms).
    pub rarp_to_all_ms: Option<f64>,
    /// The observer's longest loss window.
    pub loss: Option<Duration>,
    /// The observer's probes never answered (within 1 s), sent from the
    /// migration object's creation to its end (`Succeeded`), in ms of
    /// probing (one probe a millisecond).
    pub lost_ms: Option<f64>,
    /// The downtime libvirt reports, in ms.
    pub downtime_ms: Option<f64>,
}

/// Migrates `vmi` to `to` with an observer (the API server's netns, a
/// host on the fabric that is neither node) pinging `ip` every
/// millisecond; prints the observer's loss window beside KubeVirt's own
/// timing and libvirt's downtime, and checks the VMI's node and IP
/// afterwards.
pub fn migrate_observed(c: &KubeCluster, vmi: &str, ip: &str, to: &str, n: usize) -> Measured {
    let target: std::net::IpAddr = ip.parse().expect("the VMI's IP");
    // One moment on both clocks: the probes are timed by the monotonic
    // one, tetherd's Stats by the wall clock.
    let (mono0, wall0) = (Instant::now(), unix_nanos_now());
    let prober = Prober::start(c.api.netns(), target, Duration::from_millis(1));
    let warm = wait_until(Duration::from_secs(30), || {
        prober.received_since(Instant::now() - Duration::from_millis(500)) > 100
    });
    assert!(
        warm,
        "the observer does not reach {vmi} at {ip} before migration {n}"
    );
    let begun = Instant::now();
    let Migration {
        took,
        running,
        healed,
        state,
    } = migrate(c, vmi, to, n);
    let after = Instant::now();
    let back = wait_until(Duration::from_secs(30), || {
        prober.received_since(after) > 100
    });
    let report = prober.stop();
    let lost_ms = report.lost_in(begun, after) as f64 * report.interval.as_secs_f64() * 1e3;
    let windows = report.loss_windows();
    let worst_window = windows.iter().max_by_key(|w| w.duration);
    let worst = worst_window.map(|w| w.duration);
    let wall = |t: Instant| wall0 + t.saturating_duration_since(mono0).as_nanos() as i128;
    let path = cutover_path(c, vmi, to);
    let stop_to_rarp = worst_window
        .zip(path.as_ref())
        .map(|(w, p)| (p.seen - wall(w.start)) as f64 / 1e6);
    let rarp_to_answer = worst_window
        .zip(path.as_ref())
        .map(|(w, p)| (wall(w.resumed) - p.seen) as f64 / 1e6);
    let job = launcher_pod(c, vmi, to)
        .map(|pod| super::completed_job(c, &pod, vmi))
        .unwrap_or_default();
    let field = |key: &str| {
        job.iter()
            .find(|(k, _)| k == key)
            .map_or("?", |(_, v)| v.as_str())
            .to_string()
    };
    eprintln!(
        "kubevirt: {vmi} migration {n} to {to}: domain running on the target {running:?} and Succeeded {took:?} after its creation{}; observer: {} sent, {} answered, longest loss window {worst:?} ({} windows): from its first lost ping to tetherd's read of the {} {stop_to_rarp:?} ms, from there to the first answered ping {rarp_to_answer:?} ms, every node repointed {:?} ms after the read; libvirt: downtime {}, time elapsed {}, data processed {}; migrationState: start {} end {} mode {}",
        if healed {
            " (its target's virt-handler restarted)"
        } else {
            ""
        },
        report.sent,
        report.received,
        windows.len(),
        path.as_ref().map_or("announcement", |p| p.trigger.as_str()),
        path.as_ref().map(|p| p.to_all_ms),
        field("Total downtime"),
        field("Time elapsed"),
        field("Data processed"),
        state["startTimestamp"],
        state["endTimestamp"],
        state["mode"],
    );
    assert!(
        back,
        "the observer does not reach {vmi} at {ip} after migration {n}"
    );
    let (now_on, ip_after) = wait_vmi_running(c, vmi, Duration::from_secs(60));
    assert_eq!(now_on, to, "{vmi} is not on the migration's target");
    assert_eq!(ip_after, ip, "{vmi}'s IP changed with migration {n}");
    Measured {
        took,
        running,
        healed,
        stop_to_rarp_ms: stop_to_rarp,
        rarp_to_answer_ms: rarp_to_answer,
        rarp_to_all_ms: path.map(|p| p.to_all_ms),
        loss: worst,
        lost_ms: Some(lost_ms),
        downtime_ms: field("Total downtime")
            .strip_suffix(" ms")
            .and_then(|v| v.parse().ok()),
    }
}

/// A cutover as tetherd's Stats tell it.
struct CutoverPath {
    /// What triggered it (`rarp`, `garp`, ...).
    trigger: String,
    /// When the target's tetherd read the trigger (ns since the epoch).
    seen: i128,
    /// From that read to the last node's route change (ms).
    to_all_ms: f64,
}

fn unix_nanos_now() -> i128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i128)
}

/// VMI `vmi`'s last cutover, made by tetherd on node `to`, and the other
/// node's route change that followed it (their admin `Stats`).
fn cutover_path(c: &KubeCluster, vmi: &str, to: &str) -> Option<CutoverPath> {
    let socket = |n: &crate::kube_cluster::KubeNode| n.host_path("/run/tether").join("tether.sock");
    let target = c.nodes().iter().find(|n| n.name() == to)?;
    let cut = crate::admin::stats(&socket(target))
        .last_cutover
        .filter(|k| k.vm.starts_with(&format!("default/{vmi}/")))?;
    let mut to_all_ms = cut.local_route_ms;
    for other in c.nodes().iter().filter(|n| n.name() != to) {
        let done = wait_until(Duration::from_secs(10), || {
            crate::admin::stats(&socket(other))
                .last_vm_route_update
                .is_some_and(|u| u.generation >= cut.generation)
        });
        if !done {
            return None;
        }
        let update = crate::admin::stats(&socket(other)).last_vm_route_update?;
        to_all_ms =
            to_all_ms.max((update.done_unix_nanos as f64 - cut.seen_unix_nanos as f64) / 1e6);
    }
    Some(CutoverPath {
        trigger: cut.trigger,
        seen: cut.seen_unix_nanos as i128,
        to_all_ms,
    })
}

/// The median of `values` (sorted here), if any.
pub fn median<T: PartialOrd + Copy>(values: &mut [T]) -> Option<T> {
    values.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    values.get(values.len() / 2).copied()
}

/// tether's record (a `VMAddress` object of the Kubernetes store) of the
/// VM holding `ip`, or `Null`.
pub fn tether_record(c: &KubeCluster, ip: &str) -> Value {
    let all = c.api.get(&["vmaddresses"]).unwrap_or(Value::Null);
    all["items"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|r| {
            r["spec"]["ips"].as_array().is_some_and(|ips| {
                ips.iter()
                    .any(|a| a.as_str().is_some_and(|a| a.split('/').next() == Some(ip)))
            })
        })
        .cloned()
        .unwrap_or(Value::Null)
}

/// The launcher pod of VMI `name` on `node`, running.
pub fn launcher_pod(c: &KubeCluster, vmi: &str, node: &str) -> Option<String> {
    let pods = c
        .api
        .get(&["-n", "default", "pods", "-l", "kubevirt.io=virt-launcher"])
        .unwrap_or(Value::Null);
    pods["items"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| {
            p["metadata"]["annotations"]["kubevirt.io/domain"] == vmi
                && p["spec"]["nodeName"] == node
                && p["status"]["phase"] == "Running"
        })
        .and_then(|p| p["metadata"]["name"].as_str().map(str::to_string))
}

/// The guest's serial console so far (the launcher's `guest-console-log`
/// container).
pub fn console(c: &KubeCluster, pod: &str) -> String {
    let out = c
        .api
        .kubectl(&["-n", "default", "logs", pod, "-c", "guest-console-log"]);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// With `TETHER_KV_HOLD` set, keeps the cluster up after a failure until
/// the file it names is removed, for a look with kubectl (the command
/// printed).
pub fn hold(c: &KubeCluster) {
    let Some(file) = std::env::var_os("TETHER_KV_HOLD") else {
        return;
    };
    let file = PathBuf::from(file);
    std::fs::write(&file, "").expect("creating the hold file");
    eprintln!(
        "kubevirt: holding the cluster until {} is removed; kubectl: ip netns exec {} {} --kubeconfig={}",
        file.display(),
        c.api.netns().name(),
        crate::kube::k8s_bin_dir().join("kubectl").display(),
        c.api.admin_kubeconfig().display()
    );
    while file.exists() {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// Where [`super::LogFollower`] keeps the containers' logs.
pub(crate) static LOGS: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// The running virt-handler pod on `node`.
pub fn handler_pod(c: &KubeCluster, node: &str) -> Option<String> {
    let pods = c
        .api
        .get(&["-n", "kubevirt", "pods", "-l", "kubevirt.io=virt-handler"])
        .unwrap_or(Value::Null);
    pods["items"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| {
            p["spec"]["nodeName"] == node
                && p["metadata"]["deletionTimestamp"].is_null()
                && p["status"]["containerStatuses"]
                    .as_array()
                    .is_some_and(|cs| !cs.is_empty() && cs.iter().all(|c| c["ready"] == true))
        })
        .and_then(|p| p["metadata"]["name"].as_str().map(str::to_string))
}

/// How many times virt-handler pod `pod` logged its final cleanup of the
/// VMI with UID `uid` (from the followed log).
pub fn final_cleanups(pod: &str, uid: &str) -> usize {
    let Some(dir) = LOGS.get() else { return 0 };
    let text =
        std::fs::read_to_string(dir.join(format!("{pod}_virt-handler.log"))).unwrap_or_default();
    let needle = format!("Performing final local cleanup for vmi with uid {uid}");
    text.lines().filter(|l| l.contains(&needle)).count()
}

/// After a migration away from `source`: waits for its virt-handler's
/// final cleanup of the VMI (`before` of them logged before), and when it
/// does not come, restarts that handler, which then cleans up from its
/// ghost record. KubeVirt 1.7 races there: the source launcher exits as
/// soon as its domain is migrated, the handler's Delete to it fails with
/// gRPC `Unavailable` ("error reading from server: EOF"), which is not
/// taken for a disconnect, so the cleanup waits for a retry; if the
/// domain's deletion reaches the handler first, the retry finds nothing
/// it owns and the cleanup never comes. The handler then keeps the old
/// launcher's client, and the next migration of that VMI to the node
/// stays in `PreparingTarget` for good ("Can not update a
/// VirtualMachineInstance with unresponsive command server"). Seen under
/// load on this machine, in about one migration in three.
pub fn settle_source(
    c: &KubeCluster,
    vmi: &str,
    uid: &str,
    source: &str,
    pod: &str,
    before: usize,
) {
    if wait_until(Duration::from_secs(20), || {
        final_cleanups(pod, uid) > before
    }) {
        return;
    }
    eprintln!(
        "kubevirt: virt-handler {pod} on {source} did not clean up {vmi} after migrating it away (KubeVirt's Delete race): restarting it"
    );
    let new = restart_handler(c, source, pod);
    let cleaned = wait_until(Duration::from_secs(60), || final_cleanups(&new, uid) > 0);
    eprintln!(
        "kubevirt: virt-handler {new} on {source} {} {vmi}",
        if cleaned {
            "cleaned up"
        } else {
            "logged no cleanup of"
        }
    );
}

/// Deletes virt-handler pod `pod` on `node` and waits for its
/// DaemonSet's next one there to run: its name.
pub fn restart_handler(c: &KubeCluster, node: &str, pod: &str) -> String {
    c.api
        .kubectl_ok(&["-n", "kubevirt", "delete", "pod", pod, "--wait=false"]);
    let mut new = None;
    let back = wait_until(Duration::from_secs(240), || {
        new = handler_pod(c, node).filter(|p| p != pod);
        new.is_some()
    });
    assert!(
        back,
        "virt-handler on {node} not back after its restart\n{}",
        super::describe(c)
    );
    new.expect("the new handler pod")
}

/// One migration through KubeVirt, timed.
pub struct Migration {
    /// From the object's creation to its `Succeeded`.
    pub took: Duration,
    /// From the object's creation to the VMI's status saying the domain
    /// runs on the target (`targetNodeDomainReadyTimestamp`, seen by
    /// polling every 50 ms).
    pub running: Option<Duration>,
    /// Whether the target's virt-handler had to be restarted for the
    /// migration to end (see [`migrate`]).
    pub healed: bool,
    /// The VMI's `migrationState` afterwards.
    pub state: Value,
}

/// Migrates VMI `vmi` to `node` with a VirtualMachineInstanceMigration
/// (`addedNodeSelector`) and waits for `Succeeded`, restarting the
/// target's virt-handler when KubeVirt has not ended the migration 30 s
/// after the domain runs there; then [`settle_source`].
pub fn migrate(c: &KubeCluster, vmi: &str, node: &str, n: usize) -> Migration {
    let name = format!("{vmi}-mig{n}");
    let now = c
        .api
        .get(&["-n", "default", "vmi", vmi])
        .unwrap_or(Value::Null);
    let uid = now["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let source = now["status"]["nodeName"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let source_handler = handler_pod(c, &source).unwrap_or_default();
    let cleanups_before = final_cleanups(&source_handler, &uid);
    let start = Instant::now();
    c.api.apply(
        &json!({
            "apiVersion": "kubevirt.io/v1",
            "kind": "VirtualMachineInstanceMigration",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "vmiName": vmi,
                "addedNodeSelector": {"kubernetes.io/hostname": node},
            },
        })
        .to_string(),
    );
    let mut last = Value::Null;
    let mut running = None;
    let ended = |last: &mut Value, running: &mut Option<Duration>| {
        *last = c
            .api
            .get(&["-n", "default", "vmim", &name])
            .unwrap_or(Value::Null);
        if running.is_none() {
            let vmi_now = c
                .api
                .get(&["-n", "default", "vmi", vmi])
                .unwrap_or(Value::Null);
            let state = &vmi_now["status"]["migrationState"];
            if state["migrationUid"] == last["metadata"]["uid"]
                && state["targetNodeDomainReadyTimestamp"].is_string()
            {
                *running = Some(start.elapsed());
            }
        }
        last["status"]["phase"] == "Succeeded" || last["status"]["phase"] == "Failed"
    };
    // Until it ends, or until 30 s after the domain runs on the target.
    let mut done = wait_until(Duration::from_secs(300), || {
        ended(&mut last, &mut running)
            || running.is_some_and(|r| start.elapsed() > r + Duration::from_secs(30))
    });
    let mut healed = false;
    if done && !ended(&mut last, &mut running) {
        // KubeVirt 1.7 on this machine, now and then: the target's
        // virt-handler never hears from its launcher that the migration
        // ended (the domain's migration EndTimestamp), so it acks it only
        // at its next resync of the launchers' domains, every 5 minutes.
        // A restarted handler resyncs at once.
        let target = handler_pod(c, node).unwrap_or_default();
        eprintln!(
            "kubevirt: migration {name}: the domain runs on {node}, but KubeVirt has not ended the migration 30 s later (virt-handler {target} missed the domain's end): restarting that handler"
        );
        restart_handler(c, node, &target);
        healed = true;
        done = wait_until(Duration::from_secs(300), || ended(&mut last, &mut running));
    }
    let took = start.elapsed();
    let state = c
        .api
        .get(&["-n", "default", "vmi", vmi])
        .unwrap_or(Value::Null)["status"]["migrationState"]
        .clone();
    if !(done && last["status"]["phase"] == "Succeeded") {
        hold(c);
    }
    assert!(
        done && last["status"]["phase"] == "Succeeded",
        "migration {name} to {node}: {}\nVMI migrationState: {}\n{}",
        serde_json::to_string_pretty(&last["status"]).unwrap_or_default(),
        serde_json::to_string_pretty(&state).unwrap_or_default(),
        super::describe(c)
    );
    settle_source(c, vmi, &uid, &source, &source_handler, cleanups_before);
    Migration {
        took,
        running,
        healed,
        state,
    }
}

/// The medians of `runs`: the time to `Succeeded`, the loss window, the
/// downtime libvirt reports and the loss window's excess over it (ms).
pub struct Medians {
    /// To `Succeeded`.
    pub took: Option<Duration>,
    /// To the domain running on the target.
    pub running: Option<Duration>,
    /// The loss window (ms).
    pub loss_ms: Option<f64>,
    /// libvirt's downtime (ms).
    pub downtime_ms: Option<f64>,
    /// The loss window minus libvirt's downtime (ms).
    pub excess_ms: Option<f64>,
    /// First lost ping → tetherd's read of the announcement (ms).
    pub stop_to_rarp_ms: Option<f64>,
    /// That read → the first answered ping (ms).
    pub rarp_to_answer_ms: Option<f64>,
    /// That read → every node repointed (ms).
    pub rarp_to_all_ms: Option<f64>,
}

impl Medians {
    /// The medians of `runs`.
    pub fn of(runs: &[Measured]) -> Medians {
        let mut took: Vec<Duration> = runs.iter().map(|m| m.took).collect();
        let mut running: Vec<Duration> = runs.iter().filter_map(|m| m.running).collect();
        let mut loss: Vec<f64> = runs.iter().filter_map(Measured::loss_ms).collect();
        let mut down: Vec<f64> = runs.iter().filter_map(|m| m.downtime_ms).collect();
        let mut excess: Vec<f64> = runs.iter().filter_map(Measured::excess_ms).collect();
        let mut stop_rarp: Vec<f64> = runs.iter().filter_map(|m| m.stop_to_rarp_ms).collect();
        let mut rarp_answer: Vec<f64> = runs.iter().filter_map(|m| m.rarp_to_answer_ms).collect();
        let mut rarp_all: Vec<f64> = runs.iter().filter_map(|m| m.rarp_to_all_ms).collect();
        Medians {
            took: median(&mut took),
            running: median(&mut running),
            loss_ms: median(&mut loss),
            downtime_ms: median(&mut down),
            excess_ms: median(&mut excess),
            stop_to_rarp_ms: median(&mut stop_rarp),
            rarp_to_answer_ms: median(&mut rarp_answer),
            rarp_to_all_ms: median(&mut rarp_all),
        }
    }
}

impl Measured {
    /// The observer's longest loss window, in ms.
    pub fn loss_ms(&self) -> Option<f64> {
        self.loss.map(|d| d.as_secs_f64() * 1e3)
    }

    /// How much longer the loss window was than libvirt's downtime (ms).
    pub fn excess_ms(&self) -> Option<f64> {
        Some(self.loss_ms()? - self.downtime_ms?)
    }
}

/// How long KubeVirt may take to show the guest agent's addresses (its
/// agent poller asks for the interfaces every few seconds).
const AGENT_REPORT: Duration = Duration::from_secs(120);

/// Waits until VMI `vmi`'s status shows, for its primary interface, the
/// address tether gave its launcher pod on `node` (the pod's IP, which is
/// also in tether's `VMAddress` record of the VM), reported by the guest
/// agent (`infoSource` has `guest-agent`, condition `AgentConnected`
/// True): `ipAddress` is that address and `ipAddresses` has it. The
/// interface's status. `when` names the moment in a failure.
pub fn assert_vmi_shows_tethers_ip(c: &KubeCluster, vmi: &str, node: &str, when: &str) -> Value {
    let pod = launcher_pod(c, vmi, node)
        .unwrap_or_else(|| panic!("{when}: no running launcher pod of {vmi} on {node}"));
    let pod_ip = c
        .api
        .get(&["-n", "default", "pod", &pod])
        .unwrap_or(Value::Null)["status"]["podIP"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let record = tether_record(c, &pod_ip);
    assert!(
        !pod_ip.is_empty() && !record.is_null(),
        "{when}: launcher {pod} has IP {pod_ip:?}, which no VMAddress of tether holds"
    );
    let mut last = Value::Null;
    let shown = wait_until(AGENT_REPORT, || {
        last = c
            .api
            .get(&["-n", "default", "vmi", vmi])
            .unwrap_or(Value::Null);
        let iface = &last["status"]["interfaces"][0];
        let agent_connected = last["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "AgentConnected" && c["status"] == "True");
        agent_connected
            && iface["infoSource"]
                .as_str()
                .is_some_and(|s| s.split(',').any(|s| s.trim() == "guest-agent"))
            && iface["ipAddress"] == pod_ip.as_str()
            && iface["ipAddresses"]
                .as_array()
                .is_some_and(|ips| ips.iter().any(|a| a == pod_ip.as_str()))
    });
    assert!(
        shown,
        "{when}: VMI {vmi} does not show tether's address {pod_ip} from its guest agent in {AGENT_REPORT:?}: interfaces {}, conditions {}",
        last["status"]["interfaces"], last["status"]["conditions"]
    );
    last["status"]["interfaces"][0].clone()
}

/// One migration with every path's streams held through it
/// ([`migrate_with_paths`]).
pub struct PathsMigration {
    /// The migration as [`migrate_observed`] measured it.
    pub measured: Measured,
    /// What each stream saw.
    pub reports: Vec<StreamReport>,
    /// When the migration object was made.
    pub started: Instant,
    /// [`crate::paths::table`] of the streams, under a line with the
    /// migration's downtime and loss window.
    pub table: String,
}

impl PathsMigration {
    /// The streams that did not survive, or whose far end saw this end's
    /// address change, one line each.
    pub fn failed(&self) -> Vec<String> {
        crate::paths::dead_or_moved(&self.reports)
    }
}

/// Migrates `vmi` (at `ip`, its guest `guest`) to `to` as
/// [`migrate_observed`] does, with a stream on every path of `paths` (each
/// sending every `interval`) started before and read `after` the
/// migration ended.
#[allow(clippy::too_many_arguments)]
pub fn migrate_with_paths(
    c: &KubeCluster,
    paths: &KubePaths,
    guest: &dyn GuestShell,
    vmi: &str,
    ip: &str,
    to: &str,
    n: usize,
    interval: Duration,
    after: Duration,
) -> PathsMigration {
    let vm: std::net::IpAddr = ip.parse().expect("the VMI's IP");
    let from = c
        .api
        .get(&["-n", "default", "vmi", vmi])
        .unwrap_or(Value::Null)["status"]["nodeName"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let source = c
        .nodes()
        .iter()
        .position(|node| node.name() == from)
        .unwrap_or_else(|| panic!("{vmi} runs on {from:?}, no node of the cluster"));
    let set = PathSet::start(guest, &paths.ends(c, &[vm], source), interval);
    let started = Instant::now();
    let measured = migrate_observed(c, vmi, ip, to, n);
    std::thread::sleep(after);
    let reports = set.stop();
    let table = format!(
        "{vmi} migration {n} {from} → {to}: libvirt's downtime {} ms, the observer's longest loss window {} ms (stalls counted from the migration's start)\n{}",
        measured
            .downtime_ms
            .map_or("?".to_string(), |d| format!("{d:.0}")),
        measured
            .loss_ms()
            .map_or("?".to_string(), |d| format!("{d:.1}")),
        crate::paths::table(&reports, started, None)
    );
    PathsMigration {
        measured,
        reports,
        started,
        table,
    }
}
