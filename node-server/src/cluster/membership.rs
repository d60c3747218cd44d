//! Membership: registration and the node ID, and the lease that keeps this
//! node's alive key.

use super::view::Keys;
use super::{lock, to_json, vtep_mac, Cluster, ClusterConfig, NodeRecord, Overlay, MAX_NODE_ID};
use ipnet::IpNet;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tether_base::error::{Error, Result};
use tether_base::mac::Mac;
use tether_base::time::UnixMillis;
use tether_store::control::{Cmp, ControlStore, Op};
/// Finds or creates this node's record and ID.
///
/// Two keys, written one at a time: first the ID (`nodeids/<id>` holding
/// the name, created only if absent: the ID is this node's from then on),
/// then the record (`nodes/<name>`, created only if absent). A crash
/// between the two leaves an ID that names this node and no record; the
/// next registration of the name finds it and takes it instead of a new
/// one. (An ID whose node never comes back stays taken: one of 32,767.)
pub(super) async fn register(
    store: &dyn ControlStore,
    keys: &Keys,
    config: &ClusterConfig,
) -> Result<NodeRecord> {
    let name = &config.node_name;
    for _attempt in 0..32 {
        let (kvs, _) = store.list(&keys.node_ids()).await?;
        let mut ids = BTreeMap::new();
        for kv in &kvs {
            if let Some(id) = kv
                .key
                .rsplit('/')
                .next()
                .and_then(|s| s.parse::<u32>().ok())
            {
                ids.insert(id, String::from_utf8_lossy(&kv.value).into_owned());
            }
        }
        let record_key = keys.node(name);
        let (kvs, _) = store.list(&record_key).await?;
        let existing = kvs.iter().find(|kv| kv.key == record_key).and_then(|kv| {
            serde_json::from_slice::<NodeRecord>(&kv.value)
                .ok()
                .map(|r| (r, kv.mod_revision))
        });
        let vtep = |id: u32| match config.overlay {
            Overlay::Vxlan { .. } => Some(Mac::from(vtep_mac(id)).to_string()),
            Overlay::HostGw => None,
        };
        if let Some((rec, rev)) = existing {
            let wanted = NodeRecord {
                node_ips: config.node_ips.clone(),
                vtep_mac: vtep(rec.id),
                ..rec.clone()
            };
            // The same ID; the addresses or the overlay changed.
            if wanted != rec {
                let put = Op::Put {
                    key: record_key.clone(),
                    value: to_json(&wanted)?,
                    lease: None,
                };
                if !store
                    .txn(vec![Cmp::Unchanged(record_key.clone(), rev)], vec![put])
                    .await?
                {
                    continue;
                }
            }
            if ids.get(&rec.id) != Some(&rec.name) {
                // The record's ID key is missing (or, against every rule,
                // names another node): the record is the authority.
                if let Some(other) = ids.get(&rec.id) {
                    tracing::error!(id = rec.id, holder = %other, "this node's ID is recorded for another node; taking it back");
                }
                store
                    .txn(
                        vec![],
                        vec![Op::Put {
                            key: keys.node_id(rec.id),
                            value: rec.name.clone().into_bytes(),
                            lease: None,
                        }],
                    )
                    .await?;
            }
            return Ok(wanted);
        }
        // An ID taken for this name by a registration that stopped before
        // its record, or the lowest free one.
        let id = match ids.iter().find(|(_, n)| *n == name) {
            Some((id, _)) => *id,
            None => {
                let Some(id) = (1..=MAX_NODE_ID).find(|i| !ids.contains_key(i)) else {
                    return Err(Error::InvalidConfig(format!(
                        "every node ID up to {MAX_NODE_ID} is taken"
                    )));
                };
                let taken = store
                    .txn(
                        vec![Cmp::Absent(keys.node_id(id))],
                        vec![Op::Put {
                            key: keys.node_id(id),
                            value: name.clone().into_bytes(),
                            lease: None,
                        }],
                    )
                    .await?;
                if !taken {
                    continue;
                }
                id
            }
        };
        let rec = NodeRecord {
            name: name.clone(),
            id,
            node_ips: config.node_ips.clone(),
            vtep_mac: vtep(id),
        };
        let created = store
            .txn(
                vec![Cmp::Absent(record_key.clone())],
                vec![Op::Put {
                    key: record_key,
                    value: to_json(&rec)?,
                    lease: None,
                }],
            )
            .await?;
        if created {
            return Ok(rec);
        }
    }
    Err(Error::TryAgain("lost every race for a node ID".into()))
}

impl Cluster {
    /// Keeps this node's alive key attached to a live lease; re-creates
    /// the lease after an outage, and the node record (claiming back the
    /// blocks this node holds) whenever a synced view no longer has it: a
    /// live node reaped while it could not reach the store, or while a
    /// reaper that had seen it dead was half way (reaping is several
    /// writes, and the node may come back between two of them).
    pub(super) async fn lease_loop(self: Arc<Self>) {
        let ttl = self.config.lease_ttl.as_secs().max(1) as i64;
        let tick = (self.config.lease_ttl / 3).max(Duration::from_millis(300));
        let mut lease = None;
        loop {
            let step: Result<()> = async {
                let me = self.me();
                let view = self.view();
                if view.synced && !view.nodes.contains_key(&me.name) {
                    tracing::warn!(
                        "this node's record was reaped while it was away; registering again"
                    );
                    let again = register(&*self.store, &self.keys, &self.config).await?;
                    *lock(&self.me) = again;
                    let held: Vec<IpNet> = lock(&self.held).iter().copied().collect();
                    for block in held {
                        if let Err(e) = self.reclaim(block).await {
                            tracing::error!(%block, error = %e, "cannot claim back a block in use");
                        }
                    }
                }
                if let Some(id) = lease {
                    if self.store.keep_alive(id).await? {
                        return Ok(());
                    }
                    tracing::warn!("the node lease expired; granting a new one");
                }
                let id = self.store.grant_lease(ttl).await?;
                self.store
                    .txn(
                        vec![],
                        vec![Op::Put {
                            key: self.keys.alive(&me.name),
                            value: UnixMillis::now().as_millis().to_string().into_bytes(),
                            lease: Some(id),
                        }],
                    )
                    .await?;
                lease = Some(id);
                Ok(())
            }
            .await;
            match step {
                Ok(()) => self.set_health(&Ok(())),
                Err(e) => {
                    tracing::debug!(error = %e, "node lease renewal failed");
                    self.set_health(&Err(e));
                }
            }
            tokio::time::sleep(tick).await;
        }
    }
}
