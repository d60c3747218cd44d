//! CHECK: the kernel and the prevResult against the record.

use super::{key_of, wired, wiring, Node};
use std::path::Path;
use tether_base::error::{Error, Mismatch, Result};
use tether_base::sync::lock;
use tether_cni::Invocation;
impl Node {
    /// CHECK: compares the kernel and the prevResult with the record.
    pub async fn check(&self, inv: &Invocation) -> Result<Vec<u8>> {
        let key = key_of(inv);
        let _sweep = self.sweep.read().await;
        let _key = self.lock_key(&key).await;
        let a = lock(&self.attachments).get(&key).cloned().ok_or_else(|| {
            Error::check(Mismatch::UnknownAttachment, format!("no attachment {key}"))
        })?;
        let netns_path = inv.netns.clone().unwrap_or_default();
        if Path::new(&a.netns) != netns_path {
            return Err(Error::check(
                Mismatch::PodInterface,
                format!("{key} lives in {}, not {}", a.netns, netns_path.display()),
            ));
        }
        if a.ipam_only {
            // The interface is the main plugin's to check; the addresses
            // are tether's.
            return tether_cni::check_ipam_prev_result(&inv.conf, &a.ips)
                .map(|()| tether_cni::empty_result());
        }
        let netns = self.kernel.open_netns(&netns_path)?;
        let wiring = wiring(&a, a.mac, &netns, self.vms.routed_here(&a));
        self.kernel.check(&wiring).await?;
        tether_cni::check_prev_result(&inv.conf, &wired(&a))?;
        // A migration target whose pod is now marked ready: the runtime's
        // CHECK is one way the annotation reaches the daemon.
        if let Some(pod) = tether_cni::vm_pod(inv)? {
            self.vms.ready_annotation(self, &pod, &a).await;
        }
        Ok(tether_cni::empty_result())
    }
}
