//! Pod-ready latency through the kubelet: tether beside Debian's `ptp`
//! (with `host-local`), in the same one-node cluster, in one run
//! (`Topology::kubelet(1)`: kube-apiserver, kube-controller-manager,
//! kube-scheduler, a kubelet v1.37.2 node with Debian's containerd 1.6 and
//! runc, and kube-proxy; tether in its `nodeCidrs` mode).
//!
//! tether is installed the real way, by the Helm chart's DaemonSet (its image
//! built from the release binaries). The two sides take turns in rounds:
//! a round switches containerd's CNI config to one side (ptp's conflist
//! written, or tether's put back; containerd 1.6 uses the first conflist
//! of its config dir and reloads it on change), then creates `--pods`
//! busybox pods one after the other, each waited for until Running, then
//! deletes them all and waits until they are gone. Every pod's IP must
//! come from its side's range, so a round cannot be credited to the wrong
//! plugin.
//!
//! A pod's latency is from the API's first report of the pod to its
//! report as Running with an IP, both seen by one `kubectl get pods
//! --watch`: the scheduler is skipped (pods name their node), so it is the
//! kubelet's sandbox (CNI ADD included), the container's start, and the
//! status update.
//!
//! Run (as root): `cargo run --release -p tether-bench -- kubelet
//! [--pods 15] [--rounds 3] [--no-build] [--write BENCHMARKS.md]`.

use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;
use serde_json::json;
use tether_e2e::kubelet::busybox_pod;
use tether_e2e::topology::Topology;
use tether_e2e::wait_until;

use crate::kit::{
    guarded, percentile, release_dir, stdout_of, Benchmark, CommonArgs, Failures, Report, Run,
    Table,
};

/// ptp's range (host-local); tether's is the node's pod CIDR.
const PTP_SUBNET: &str = "10.245.0.0/24";
const TETHER_CONFLIST: &str = "10-tether.conflist";
const PTP_CONFLIST: &str = "20-ptp.conflist";
/// How long containerd is given to notice a changed CNI config dir.
const RELOAD: Duration = Duration::from_secs(3);
const LIMIT: Duration = Duration::from_secs(90);

/// `tether-bench kubelet`'s flags.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Pods per side in each round, created one after the other.
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..))]
    pods: u64,
    /// Rounds; the sides' order alternates.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    rounds: u64,
    #[command(flatten)]
    common: CommonArgs,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Side {
    Tether,
    Ptp,
}

impl Side {
    fn label(self) -> &'static str {
        match self {
            Side::Tether => "tether (DaemonSet)",
            Side::Ptp => "ptp + host-local",
        }
    }
}

#[derive(Default)]
pub struct Samples {
    tether: Vec<Duration>,
    ptp: Vec<Duration>,
}

impl Benchmark for Args {
    const NAME: &'static str = "kubelet";
    const SECTION: &'static str = "bench-kubelet";
    type Ready = ();
    type Measured = Option<Samples>;

    fn common(&self) -> &CommonArgs {
        &self.common
    }

    fn prepare(&self) -> Result<(), String> {
        release_dir(Self::NAME, self.common.build()).map(|_| ())
    }

    fn measure(&self, _: &(), failures: &mut Failures) -> Option<Samples> {
        guarded("pods", failures, |f| run(self, f))
    }

    fn report(&self, run: &Run, _: &(), samples: &Option<Samples>) -> String {
        report(run, self, samples.as_ref())
    }
}

fn run(args: &Args, failures: &mut Failures) -> Samples {
    let mut k = Topology::kubelet(1).node_cidrs().start();
    k.set_chart_values(json!({"mode": "nodeCidrs"}));
    let image = k.build_tether_image("bench");
    k.install_tether(&image);
    k.wait_tether_ready(&image);
    let node = &k.nodes()[0];
    let conf_dir = node.host_path("/etc/cni/net.d");
    let bin_dir = node.host_path("/opt/cni/bin");
    let tether_conf = std::fs::read(conf_dir.join(TETHER_CONFLIST)).expect("tether's conflist");
    std::fs::copy("/usr/lib/cni/ptp", bin_dir.join("ptp")).expect("installing ptp");
    std::fs::copy("/usr/lib/cni/host-local", bin_dir.join("host-local"))
        .expect("installing host-local");
    let ptp_conf = json!({
        "cniVersion": "1.0.0",
        "name": "ptp-bench",
        "plugins": [{
            "type": "ptp",
            "ipam": {"type": "host-local", "ranges": [[{"subnet": PTP_SUBNET}]],
                     // A dir of the node's own (its kubelet's), as host-local
                     // sees it inside the node.
                     "dataDir": "/var/lib/kubelet/host-local-bench"},
        }],
    });
    let tether_cidr: IpNet = k
        .api
        .get(&["node", node.name()])
        .and_then(|n| n["spec"]["podCIDR"].as_str().and_then(|c| c.parse().ok()))
        .expect("the node's pod CIDR");
    let ptp_cidr: IpNet = PTP_SUBNET.parse().expect("a CIDR");
    let watch = k.watch_pods();
    let mut samples = Samples::default();
    let mut n = 0;
    for round in 0..args.rounds {
        // Alternate which side goes first.
        let order = if round % 2 == 0 {
            [Side::Ptp, Side::Tether]
        } else {
            [Side::Tether, Side::Ptp]
        };
        for side in order {
            match side {
                Side::Tether => {
                    let _ = std::fs::remove_file(conf_dir.join(PTP_CONFLIST));
                    std::fs::write(conf_dir.join(TETHER_CONFLIST), &tether_conf)
                        .expect("putting tether's conflist back");
                }
                Side::Ptp => {
                    let _ = std::fs::remove_file(conf_dir.join(TETHER_CONFLIST));
                    std::fs::write(conf_dir.join(PTP_CONFLIST), ptp_conf.to_string())
                        .expect("writing ptp's conflist");
                }
            }
            std::thread::sleep(RELOAD);
            let cidr = if side == Side::Tether {
                &tether_cidr
            } else {
                &ptp_cidr
            };
            let mut names = Vec::new();
            for _ in 0..args.pods {
                n += 1;
                let name = format!("p{n}");
                k.create_pod(&busybox_pod(&name, node.name()));
                let seen = watch.wait_for(&name, LIMIT, |_, _| true);
                let running = watch.wait_for(&name, LIMIT, |phase, ip| {
                    phase == "Running" && !ip.is_empty()
                });
                names.push(name.clone());
                let (Some(seen), Some(running)) = (seen, running) else {
                    failures.fail(format!(
                        "{}: pod {name} not Running in {LIMIT:?}",
                        side.label()
                    ));
                    continue;
                };
                let ip = k.wait_pod_ip(&name);
                let in_range = ip.parse::<IpAddr>().is_ok_and(|a| cidr.contains(&a));
                if !in_range {
                    failures.fail(format!(
                        "{}: pod {name} got {ip}, not from {cidr}: the wrong plugin served it",
                        side.label()
                    ));
                    continue;
                }
                let took = running.duration_since(seen);
                match side {
                    Side::Tether => samples.tether.push(took),
                    Side::Ptp => samples.ptp.push(took),
                }
            }
            for name in &names {
                let _ = k
                    .api
                    .kubectl(&["-n", "default", "delete", "pod", name, "--wait=false"]);
            }
            let gone = wait_until(LIMIT, || names.iter().all(|n| k.pod(n).is_none()));
            if !gone {
                failures.fail(format!("{}: round {round}'s pods not gone", side.label()));
            }
            eprintln!(
                "kubelet: round {round}, {}: {} pods",
                side.label(),
                names.len()
            );
        }
    }
    // Back to tether, so that the teardown's DELs reach the plugin that
    // made the pods (there are none left, but the node ends as installed).
    let _ = std::fs::remove_file(conf_dir.join(PTP_CONFLIST));
    let _ = std::fs::write(conf_dir.join(TETHER_CONFLIST), &tether_conf);
    samples
}

fn ms(d: Option<Duration>) -> String {
    d.map_or_else(
        || "–".to_owned(),
        |d| format!("{:.0}", d.as_secs_f64() * 1000.0),
    )
}

fn report(run: &Run, args: &Args, samples: Option<&Samples>) -> String {
    let mut r = Report::new("Pod-ready latency through the kubelet", run);
    r.item(format!(
        "tether {} (installed by the Helm chart's DaemonSet, release binaries); Debian's ptp and host-local (containernetworking-plugins {}); kubelet, kube-apiserver, kube-controller-manager, kube-scheduler v1.37.2 (built from k8s.io/kubernetes); Debian's containerd {} and runc.",
        run.machine.tether_version,
        stdout_of(
            "dpkg-query",
            &["-W", "-f=${Version}", "containernetworking-plugins"]
        ),
        stdout_of("dpkg-query", &["-W", "-f=${Version}", "containerd"])
    ))
    .command(run, "")
    .item(format!(
        "{} rounds; in each, {} pods per side created one after the other, the sides' order alternating. Latency: the API's first report of a pod to its report as Running with an IP, both through one `kubectl get pods --watch` (no scheduler: pods name their node).",
        args.rounds, args.pods
    ));
    if let Some(s) = samples {
        let mut t = Table::new(&["CNI", "pods", "p50 ms", "p90 ms", "max ms", "mean ms"]);
        for (side, v) in [(Side::Tether, &s.tether), (Side::Ptp, &s.ptp)] {
            let mean = (!v.is_empty()).then(|| v.iter().sum::<Duration>() / v.len() as u32);
            t.row([
                side.label().to_owned(),
                v.len().to_string(),
                ms(percentile(v, 0.5)),
                ms(percentile(v, 0.9)),
                ms(v.iter().max().copied()),
                ms(mean),
            ]);
        }
        r.table(&t);
    }
    r.finish(run)
}
