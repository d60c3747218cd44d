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

use tether_e2e::conformance::{judge_slice, Slice};
use tether_e2e::require_root;

/// The slice: the granular checks, hostPort, one ClusterIP, one NodePort
/// and one DNS test.
const FOCUS: &str = r"\[sig-network\] (Networking Granular Checks: Pods should function for|HostPort validates|Services should serve a basic endpoint from pods|Services should be able to create a functioning NodePort service|DNS should provide DNS for services ).*\[Conformance\]";

#[cfg_attr(
    not(feature = "kubelet-tests"),
    ignore = "kubelet tier: root and kubelet nodes built from Kubernetes' source; `make test` runs it"
)]
#[test]
fn the_data_path_conformance_slice_passes_on_two_kubelet_nodes() {
    require_root();
    judge_slice(Slice {
        name: "conformance slice",
        focus: FOCUS,
        skip: None,
        tests: 8,
        // The slice's tests run for about 2 minutes: tetherd dies early,
        // while the granular checks' pods are being made; the kubelet
        // restarts in the middle of the run.
        faults: (Duration::from_secs(20), Duration::from_secs(50)),
    });
}
