//! The node as the VM component sees it ([`NodeSide`]): its attachments,
//! its pools, addresses for a VM's first record, the guest's welcome, a
//! route resync and events on pods.

use super::Node;
use crate::handover::HandoverSide;
use crate::vm::{NodeSide, VmKey};
use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use tether_base::error::{Error, Result};
use tether_base::mac::Mac;
use tether_base::pod_event::{PodEvent, PodRef};
use tether_base::sync::lock;
use tether_cni::{Requested, VmPod};
use tether_ipam::Pools;
use tether_store::store::{Attachment, AttachmentKey};

impl NodeSide for Node {
    fn attachment(&self, key: &AttachmentKey) -> Option<Attachment> {
        lock(&self.attachments).get(key).cloned()
    }

    fn attachments_where(&self, keep: &dyn Fn(&Attachment) -> bool) -> Vec<Attachment> {
        lock(&self.attachments)
            .values()
            .filter(|a| keep(a))
            .cloned()
            .collect()
    }

    fn with_pools<R>(
        &self,
        f: impl FnOnce(&mut Pools, &HashMap<AttachmentKey, Attachment>) -> R,
    ) -> R {
        let attachments = lock(&self.attachments);
        let mut pools = lock(&self.pools);
        f(&mut pools, &attachments)
    }

    fn addresses_for(&self, req: &Requested) -> impl Future<Output = Result<Vec<IpAddr>>> + Send {
        Node::addresses_for(self, req)
    }

    fn take_requested(&self, ips: &[IpAddr]) -> impl Future<Output = Result<()>> + Send {
        Node::take_requested(self, ips)
    }

    fn check_mac_free(&self, mac: Mac, vm: Option<&VmKey>) -> Result<()> {
        Node::check_mac_free(self, mac, vm)
    }

    /// The addresses in the status of the pod's IPAMClaim, as the claims
    /// cache last saw it; `None` without a claim, the API, or addresses.
    /// Before the claims have been listed once, a claim's status cannot be
    /// known: the ADD fails with code 11 (the runtime retries) rather than
    /// give the VM new addresses and write them over the ones its claim
    /// may hold.
    fn claim_addresses(&self, pod: &VmPod) -> Result<Option<Vec<IpAddr>>> {
        let (Some(claim), Some(k)) = (pod.claim.as_ref(), self.kube.get()) else {
            return Ok(None);
        };
        if !k.claims.listed() {
            return Err(Error::TryAgain(format!(
                "IPAMClaim {claim} of VM {} cannot be read yet (the claims have not been listed from the API server since tetherd started): its addresses are not known",
                pod.key
            )));
        }
        let ips = k
            .claims
            .get(claim)
            .map(|c| c.addresses())
            .unwrap_or_default();
        Ok((!ips.is_empty()).then_some(ips))
    }

    fn welcome_guest(&self, a: &Attachment) {
        Node::welcome_guest(self, a);
    }

    fn resync_routes(&self, vm: &VmKey) {
        self.routes.resync_vm(vm);
    }

    fn pod_event(&self, pod: PodRef, event: PodEvent) {
        self.emit_event(pod, event);
    }

    fn send_notice(&self, notice: &crate::vm::notices::CutoverNotice) {
        Node::send_notice(self, notice);
    }

    fn before_local_route(&self, vm: &VmKey, a: &Attachment) -> impl Future<Output = ()> + Send {
        let (handovers, vm, ips) = (self.handovers.clone(), vm.clone(), a.ips.clone());
        let cluster = HandoverSide::cluster(self);
        async move {
            handovers.pin(&vm, &ips).await;
            handovers.settle_flows(cluster, &vm).await;
        }
    }

    fn arrived(&self, vm: &VmKey, a: &Attachment) {
        let handovers = self.handovers.clone();
        let cluster = HandoverSide::cluster(self);
        let (vm, ips) = (vm.clone(), a.ips.clone());
        tokio::spawn(async move { handovers.arrived(cluster, &vm, &ips).await });
    }
}

impl HandoverSide for Node {
    fn local_attachment(&self, key: &AttachmentKey) -> Option<Attachment> {
        lock(&self.attachments).get(key).cloned()
    }

    fn cluster(
        &self,
    ) -> Option<(
        crate::cluster::NodeRecord,
        crate::cluster::Overlay,
        std::sync::Arc<crate::cluster::ClusterView>,
    )> {
        let p = self.peers.as_ref()?;
        Some((p.me(), p.overlay(), p.view()))
    }

    fn send_to_node(&self, node: &str, bytes: &[u8]) {
        Node::send_to_node(self, node, bytes);
    }

    fn is_local_pod(&self, ip: IpAddr) -> bool {
        lock(&self.attachments)
            .values()
            .any(|a| a.ips.contains(&ip))
    }
}
