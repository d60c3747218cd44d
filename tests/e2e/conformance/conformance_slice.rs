//! The fast slice of Kubernetes' sig-network Conformance and dual-stack
//! tests that `make test` runs (the whole sets are `make conformance
//! STACK=v4|dual|v6`, CONFORMANCE.md): the upstream `e2e.test` on two
//! kubelet nodes of a dual-stack cluster (IPv4 first; tests/src/stack.rs)
//! wired by tether installed with its chart (tests/src/kube_cluster.rs),
//! CoreDNS and kube-proxy, focused on the tests that touch the data path:
//! - the four granular pod-network checks (pod ↔ pod and node → pod,
//!   HTTP and UDP, across the nodes);
//! - hostPort (the same port on 127.0.0.1 and the node's address, TCP and
//!   UDP, through the chained portmap);
//! - one ClusterIP test, one NodePort test and one cluster-DNS test;
//! - of the `[Feature:IPv6DualStack]` tests: a pod with both addresses,
//!   a pod reached on both, a Service of each family, and pods reaching
//!   a Service of the second family (IPv6) over HTTP and UDP.
//!
//! While they run, the second node's tetherd is killed with SIGKILL (its
//! container restarted by the kubelet, as after a crash) and the first
//! node's kubelet is restarted (`conformance::Faults`). Every test must
//! still pass, and both faults must have happened and been recovered
//! from; the report names each failure with its message.

use std::time::Duration;

use tether_e2e::conformance::{judge_slice, Slice};
use tether_e2e::require_root;
use tether_e2e::stack::Stack;

/// The slice: the granular checks, hostPort, one ClusterIP, one NodePort
/// and one DNS test; and six dual-stack tests.
const FOCUS: &str = concat!(
    r"\[sig-network\] (Networking Granular Checks: Pods should function for|HostPort validates|Services should serve a basic endpoint from pods|Services should be able to create a functioning NodePort service|DNS should provide DNS for services ).*\[Conformance\]",
    r"|\[Feature:IPv6DualStack\] (should create pod, add ipv6 and ipv4 ip to pod ips|should be able to reach pod on ipv4 and ipv6 ip|should create service with ipv(4|6) cluster ip|Granular Checks: Services Secondary IP Family \[LinuxOnly\] should function for pod-Service: (http|udp))",
);

#[cfg_attr(
    not(feature = "kubelet-tests"),
    ignore = "kubelet tier: root and kubelet nodes built from Kubernetes' source; `make test` runs it"
)]
#[test]
fn the_data_path_conformance_slice_passes_on_two_dual_stack_kubelet_nodes() {
    require_root();
    judge_slice(Slice {
        name: "conformance slice",
        focus: FOCUS,
        skip: None,
        tests: 14,
        // The slice's tests run for about 2 minutes: tetherd dies early,
        // while the granular checks' pods are being made; the kubelet
        // restarts in the middle of the run.
        faults: (Duration::from_secs(20), Duration::from_secs(50)),
        stack: Stack::Dual,
    });
}
