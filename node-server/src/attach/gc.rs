//! GC: releasing attachments the runtime no longer lists, then sweeping
//! orphans.

use super::Node;
use std::collections::HashSet;
use tether_base::error::{Error, Result};
use tether_base::sync::lock;
use tether_cni::Invocation;
use tether_store::store::Attachment;
impl Node {
    /// GC: releases every attachment of the network not listed as valid, then
    /// sweeps our links and routes that no attachment owns.
    pub async fn gc(&self, inv: &Invocation) -> Result<Vec<u8>> {
        let valid = inv
            .conf
            .valid_attachments
            .as_ref()
            .ok_or_else(|| Error::InvalidConfig("GC needs cni.dev/valid-attachments".into()))?;
        let valid: HashSet<(&str, &str)> = valid
            .iter()
            .map(|v| (v.container_id.as_str(), v.ifname.as_str()))
            .collect();
        let _sweep = self.sweep.write().await;
        let doomed: Vec<Attachment> = lock(&self.attachments)
            .values()
            .filter(|a| {
                a.key.network == inv.conf.name
                    && !valid.contains(&(a.key.container_id.as_str(), a.key.ifname.as_str()))
            })
            .cloned()
            .collect();
        if !doomed.is_empty() {
            tracing::info!(network = %inv.conf.name, count = doomed.len(), "GC releases attachments");
            let (vms, plain): (Vec<Attachment>, Vec<Attachment>) =
                doomed.into_iter().partition(|a| a.vm.is_some());
            self.release(&plain, inv.conf.vm_address_policy).await?;
            // A VM pod whose record cannot be changed now is kept for the
            // next GC rather than failing the others.
            for a in vms {
                if let Err(e) = self
                    .release(std::slice::from_ref(&a), inv.conf.vm_address_policy)
                    .await
                {
                    tracing::warn!(key = %a.key, error = %e, "GC could not release a VM pod yet");
                }
            }
        }
        drop(_sweep);
        let swept = self.reconcile().await?;
        if swept.links_removed + swept.routes_removed > 0 {
            tracing::info!(?swept, "GC swept orphans");
        }
        Ok(tether_cni::empty_result())
    }
}
