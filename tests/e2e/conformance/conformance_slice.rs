//! The fast slice of Kubernetes' sig-network Conformance tests that `make
//! test` runs (the whole set is `make conformance`, CONFORMANCE.md): the
//! upstream `e2e.test` on two kubelet nodes wired by tether installed with
//! its chart (tests/src/kube_cluster.rs), CoreDNS and kube-proxy, focused on the
//! tests that touch the data path:
//! - the four granular pod-network checks (pod ↔ pod and node → pod,
//!   HTTP and UDP, across the nodes);
//! - hostPort (the same port on 127.0.0.1 and the node's address, TCP and
//!   UDP, through the chained portmap);
//! - one ClusterIP test, one NodePort test and one cluster-DNS test.
//!
//! While they run, the second node's tetherd is killed with SIGKILL (its
//! container restarted by the kubelet, as after a crash) and the first
//! node's kubelet is restarted (`conformance::Faults`). Every test must
//! still pass, and both faults must have happened and been recovered
//! from; the report names each failure with its message.

use std::time::Duration;

use tether_e2e::conformance::{self, Faults};
use tether_e2e::conformance_images::{conformance_images, e2e_dir, COREDNS, PAUSE};
use tether_e2e::topology::Topology;
use tether_e2e::{require_root, TempDir};

/// The slice: the granular checks, hostPort, one ClusterIP, one NodePort
/// and one DNS test.
const FOCUS: &str = r"\[sig-network\] (Networking Granular Checks: Pods should function for|HostPort validates|Services should serve a basic endpoint from pods|Services should be able to create a functioning NodePort service|DNS should provide DNS for services ).*\[Conformance\]";
/// How many tests the focus selects.
const SLICE: usize = 8;

#[cfg_attr(
    not(feature = "kubelet-tests"),
    ignore = "kubelet tier: root and kubelet nodes built from Kubernetes' source; `make test` runs it"
)]
#[test]
fn the_data_path_conformance_slice_passes_on_two_kubelet_nodes() {
    require_root();
    let images = conformance_images();
    let mut cluster = Topology::kubelet(2)
        .images(images.iter().map(|(_, a)| a.clone()))
        .sandbox_image(PAUSE)
        .start();
    let tether = cluster.build_tether_image("1");
    cluster.install_tether(&tether);
    cluster.deploy_coredns(COREDNS);
    let out = TempDir::new("conf");
    // The slice's tests run for about 2 minutes: tetherd dies early, while
    // the granular checks' pods are being made; the kubelet restarts
    // in the middle of the run.
    let mut faults = Faults::at(Duration::from_secs(20), Duration::from_secs(50));
    let run = conformance::run(
        &mut cluster,
        &e2e_dir().join("e2e.test"),
        FOCUS,
        out.path(),
        &mut faults,
    );
    for line in &faults.log {
        eprintln!("conformance slice: fault: {line}");
    }
    let ran: Vec<_> = run
        .outcomes
        .iter()
        .filter(|o| o.state != "skipped")
        .collect();
    for o in &ran {
        eprintln!("conformance: {} {} ({:.1} s)", o.state, o.name, o.seconds);
    }
    let failed: Vec<String> = ran
        .iter()
        .filter(|o| !o.passed())
        .map(|o| {
            // The spec's own output: its steps and the commands it ran,
            // with what they printed (the last 120 lines).
            let output = o.output.as_deref().unwrap_or_default();
            let lines: Vec<&str> = output.lines().collect();
            let tail = lines[lines.len().saturating_sub(120)..].join("\n");
            format!(
                "{}: {}\n--- its output ---\n{tail}",
                o.name,
                o.failure.as_deref().unwrap_or("?")
            )
        })
        .collect();
    if !failed.is_empty() {
        // The failed specs' pods are kept (`conformance::run`): how the
        // network looked after the failure.
        eprintln!(
            "conformance slice: the network after the failure:\n{}\ntether's logs:\n{}",
            cluster.network_state(),
            cluster.tether_logs()
        );
    }
    assert!(
        failed.is_empty() && run.success,
        "{} of {} failed:\n{}\ne2e.test's log:\n{}",
        failed.len(),
        ran.len(),
        failed.join("\n"),
        std::fs::read_to_string(&run.log)
            .map(|l| l
                .lines()
                .rev()
                .take(80)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n"))
            .unwrap_or_default()
    );
    assert_eq!(ran.len(), SLICE, "the focus selected {} tests", ran.len());
    assert!(
        faults.problems.is_empty(),
        "the faults were not injected or not recovered from: {:?}\n{:?}",
        faults.problems,
        faults.log
    );
    eprintln!(
        "conformance slice: {} passed in {:.0} s",
        ran.len(),
        run.elapsed.as_secs_f64()
    );
}
