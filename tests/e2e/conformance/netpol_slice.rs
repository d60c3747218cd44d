//! The slice of Kubernetes' NetworkPolicy tests that `make test` runs (the
//! whole suite is `make netpol`, NETPOL.md): upstream's `e2e.test` on the
//! cluster of the conformance slice, tether installed by its chart with
//! NetworkPolicy on (its default), focused on one test of each kind of
//! rule:
//! - default deny of ingress, over TCP and over UDP;
//! - ingress allowed by a pod selector, and by a namespace selector;
//! - egress denied by a pod selector;
//! - egress to an ipBlock with an except;
//! - ingress on a named port (resolved on the destination pod);
//! - a policy's deletion, after which everything passes again.
//!
//! Upstream probes every pair of the test's pods through their Services'
//! ClusterIPs (after kube-proxy's DNAT) with `agnhost connect`, and
//! expects each answer within about 10 s of the API change. While the
//! tests run, the second node's tetherd is killed with SIGKILL and the
//! first node's kubelet restarted: the rules stay in the kernel, and
//! every test must still pass.

use std::time::Duration;

use tether_e2e::conformance::{judge_slice, Slice, SKIP_SCTP};
use tether_e2e::require_root;
use tether_e2e::stack::Stack;

const FOCUS: &str = r"\[sig-network\] Netpol .*(should support a 'default-deny-ingress' policy|should enforce policy to allow traffic only from a different namespace, based on NamespaceSelector|should enforce policy to allow traffic from pods within server namespace based on PodSelector|should deny egress from pods based on PodSelector|should enforce except clause while egress access to server in CIDR block|should allow ingress access on one named port|should stop enforcing policies after they are deleted)";

#[cfg_attr(
    not(feature = "kubelet-tests"),
    ignore = "kubelet tier: root and kubelet nodes built from Kubernetes' source; `make test` runs it"
)]
#[test]
fn the_network_policy_slice_passes_on_two_kubelet_nodes() {
    require_root();
    judge_slice(Slice {
        name: "NetworkPolicy slice",
        focus: FOCUS,
        // The SCTP test of the same title needs SCTP in the kernel, which
        // this machine's lacks.
        skip: Some(SKIP_SCTP),
        // The TCP and the UDP default-deny tests share a title.
        tests: 8,
        // The tests run for about 2 minutes: tetherd dies while the first
        // test's pods are made; the kubelet restarts later in the run.
        kill_tetherd_at: Duration::from_secs(20),
        restart_kubelet_at: Some(Duration::from_secs(60)),
        stack: Stack::V4,
    });
}
