//! Membership: registration and the node ID, and the lease that keeps this
//! node's alive key.

use super::*;

/// Finds or creates this node's record and ID.
pub(super) async fn register(
    store: &dyn ControlStore,
    keys: &Keys,
    config: &ClusterConfig,
) -> Result<NodeRecord> {
    for _attempt in 0..32 {
        let (kvs, _) = store.list(&keys.root).await?;
        let mut ids = BTreeMap::new();
        let mut existing = None;
        for kv in &kvs {
            match keys.kind(&kv.key) {
                Some(KeyKind::NodeId) => {
                    if let Some(id) = kv
                        .key
                        .rsplit('/')
                        .next()
                        .and_then(|s| s.parse::<u32>().ok())
                    {
                        ids.insert(id, String::from_utf8_lossy(&kv.value).into_owned());
                    }
                }
                Some(KeyKind::Node(name)) if name == config.node_name => {
                    existing = serde_json::from_slice::<NodeRecord>(&kv.value)
                        .ok()
                        .map(|r| (r, kv.mod_revision));
                }
                _ => {}
            }
        }
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
            if wanted == rec && ids.get(&rec.id) == Some(&rec.name) {
                return Ok(rec);
            }
            // The same ID; the addresses or the overlay changed.
            let ok = store
                .txn(
                    vec![Cmp::Unchanged(keys.node(&rec.name), rev)],
                    vec![
                        Op::Put {
                            key: keys.node(&rec.name),
                            value: to_json(&wanted)?,
                            lease: None,
                        },
                        Op::Put {
                            key: keys.node_id(rec.id),
                            value: rec.name.clone().into_bytes(),
                            lease: None,
                        },
                    ],
                )
                .await?;
            if ok {
                return Ok(wanted);
            }
            continue;
        }
        let Some(id) = (1..=MAX_NODE_ID).find(|i| !ids.contains_key(i)) else {
            return Err(Error::InvalidConfig(format!(
                "every node ID up to {MAX_NODE_ID} is taken"
            )));
        };
        let rec = NodeRecord {
            name: config.node_name.clone(),
            id,
            node_ips: config.node_ips.clone(),
            vtep_mac: vtep(id),
        };
        let ok = store
            .txn(
                vec![
                    Cmp::Absent(keys.node_id(id)),
                    Cmp::Absent(keys.node(&rec.name)),
                ],
                vec![
                    Op::Put {
                        key: keys.node_id(id),
                        value: rec.name.clone().into_bytes(),
                        lease: None,
                    },
                    Op::Put {
                        key: keys.node(&rec.name),
                        value: to_json(&rec)?,
                        lease: None,
                    },
                ],
            )
            .await?;
        if ok {
            return Ok(rec);
        }
    }
    Err(Error::TryAgain("lost every race for a node ID".into()))
}

impl Cluster {
    /// Keeps this node's alive key attached to a live lease; re-creates
    /// the lease (and the node record, if it was reaped while this node
    /// could not reach the store) after an outage.
    pub(super) async fn lease_loop(self: Arc<Self>) {
        let ttl = self.config.lease_ttl.as_secs().max(1) as i64;
        let tick = (self.config.lease_ttl / 3).max(Duration::from_millis(300));
        let mut lease = None;
        loop {
            let step: Result<()> = async {
                if let Some(id) = lease {
                    if self.store.keep_alive(id).await? {
                        return Ok(());
                    }
                    tracing::warn!("the node lease expired; granting a new one");
                }
                let id = self.store.grant_lease(ttl).await?;
                let me = self.me();
                if !self.view().nodes.contains_key(&me.name) && self.view().synced {
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
