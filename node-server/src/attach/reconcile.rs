//! Reconciliation: the kernel is made to agree with the store at start-up
//! and after GC; a reboot releases the previous boot's attachments.

use super::{Node, Reconciled};
use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::path::Path;
use tether_base::error::{Error, Result};
use tether_store::store::Attachment;
/// Compares the kernel's boot id, `current`, with the one recorded in the state dir at
/// the last start, and records the current one. True when they differ.
pub(super) fn rebooted_since_last_run(state_dir: &Path, current: &str) -> Result<bool> {
    let path = state_dir.join("boot_id");
    let recorded = std::fs::read_to_string(&path).ok();
    let rebooted = recorded.as_deref().is_some_and(|r| r.trim() != current);
    if recorded.as_deref().map(str::trim) != Some(current) {
        let tmp = state_dir.join(".boot_id.tmp");
        std::fs::write(&tmp, current)
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|e| Error::Io(format!("recording the boot id in {}: {e}", path.display())))?;
    }
    Ok(rebooted)
}

impl Node {
    /// Makes the kernel agree with the store: re-adds missing host routes of
    /// recorded attachments and removes our routes and links that no record
    /// owns (left by a crash between a kernel change and its store commit).
    pub(crate) async fn reconcile(&self) -> Result<Reconciled> {
        let _sweep = self.sweep.write().await;
        let snapshot = self.attachments();
        let mut done = Reconciled {
            attachments: snapshot.len(),
            ..Default::default()
        };
        let links: HashSet<String> = self.kernel.our_links().await?.into_iter().collect();
        // A VM pod gets host routes only while its record names it active.
        let routed: Vec<&Attachment> = snapshot
            .iter()
            .filter(|a| self.vms.routed_here(a))
            .collect();
        let mut owner: HashMap<IpAddr, &str> = HashMap::new();
        for a in &routed {
            for ip in &a.ips {
                owner.insert(*ip, &a.host_ifname);
            }
        }
        // One route per destination exists in the main table, so a route of
        // ours that is unowned or points at the wrong link is removed first
        // and the right one re-added below.
        let stale: Vec<IpAddr> = self
            .kernel
            .our_routes()
            .await?
            .into_iter()
            // A route whose device is gone is stale whoever owned it.
            .filter(|r| r.oif.is_none() || owner.get(&r.dst).copied() != r.oif.as_deref())
            .map(|r| r.dst)
            .collect();
        self.kernel.remove_host_routes(&stale).await?;
        done.routes_removed = stale.len();
        for a in routed.iter().filter(|a| links.contains(&a.host_ifname)) {
            done.routes_added += self
                .kernel
                .ensure_host_routes(&a.host_ifname, &a.ips)
                .await?;
        }
        let owned_links: HashSet<&str> = snapshot.iter().map(|a| a.host_ifname.as_str()).collect();
        let orphans: Vec<String> = links
            .iter()
            .filter(|l| !owned_links.contains(l.as_str()))
            .cloned()
            .collect();
        self.kernel.delete_links(&orphans).await?;
        done.links_removed = orphans.len();
        // The guests of tap bindings are answered again (a restarted daemon
        // starts with no sockets).
        for a in snapshot.iter().filter(|a| links.contains(&a.host_ifname)) {
            self.serve_guest(a);
        }
        // The VM routes are checked against the kernel again too.
        self.force_vm_resync();
        Ok(done)
    }
}
