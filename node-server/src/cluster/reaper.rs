//! The reaper of dead nodes: a node whose alive key has been gone for
//! `--node-grace` loses its record, ID and blocks. Only the node whose
//! role is the reaper's reaps (`liveness`); were two to reap at once,
//! every step below is a compare-and-swap that the second fails.
//!
//! One key at a time (no store has to offer more), in an order that a
//! crash or a returning node can interrupt anywhere:
//! 1. the alive key, deleted only while absent: on the Kubernetes store
//!    the node's Lease, deleted only if unrenewed since it expired. A node
//!    that renewed meanwhile makes this fail, and nothing is reaped;
//! 2. each block, deleted only if unchanged since the view showed it;
//! 3. the ID, if it still names the node;
//! 4. the record, last, only if unchanged: while it exists, a later pass
//!    (of any node) finishes the job, and a node that came back after
//!    step 1 sees its record go and registers again, claiming back the
//!    blocks it still uses (`lease_loop`).

use super::view::ClusterView;
use super::{lock, Cluster, NodeRecord};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tether_base::error::Result;
use tether_store::control::{Cmp, Op};
impl Cluster {
    /// Reaps nodes whose lease has been gone longer than the grace period.
    pub(super) async fn reaper_loop(self: Arc<Self>) {
        let tick =
            (self.config.node_grace / 4).clamp(Duration::from_millis(250), Duration::from_secs(10));
        loop {
            tokio::time::sleep(tick).await;
            let view = self.view();
            // Only the reaper sees every alive key (`liveness`).
            if !view.synced || self.role() != super::liveness::Role::Reaper {
                continue;
            }
            let me = self.me().name;
            let now = Instant::now();
            let mut due = Vec::new();
            {
                let mut dead = lock(&self.dead_since);
                dead.retain(|n, _| view.nodes.contains_key(n) && !view.alive.contains(n));
                for (name, (rec, rev)) in &view.nodes {
                    if *name == me || view.alive.contains(name) {
                        continue;
                    }
                    let since = *dead.entry(name.clone()).or_insert(now);
                    if now.duration_since(since) >= self.config.node_grace {
                        due.push((rec.clone(), *rev));
                    }
                }
            }
            for (rec, rev) in due {
                match self.reap(&view, &rec, rev).await {
                    Ok(true) => {
                        tracing::info!(node = %rec.name, id = rec.id, "reaped a dead node and its blocks")
                    }
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(node = %rec.name, error = %e, "reaping a dead node failed")
                    }
                }
            }
        }
    }

    async fn reap(&self, view: &ClusterView, rec: &NodeRecord, rev: i64) -> Result<bool> {
        let alive = self.keys.alive(&rec.name);
        if !self
            .store
            .txn(vec![Cmp::Absent(alive.clone())], vec![Op::Delete(alive)])
            .await?
        {
            return Ok(false);
        }
        for (b, brev) in view.blocks.values().filter(|(b, _)| b.node == rec.name) {
            let key = self.keys.block(&b.cidr);
            self.store
                .txn(
                    vec![Cmp::Unchanged(key.clone(), *brev)],
                    vec![Op::Delete(key)],
                )
                .await?;
        }
        let id_key = self.keys.node_id(rec.id);
        let (ids, _) = self.store.list(&id_key).await?;
        if let Some(kv) = ids
            .iter()
            .find(|kv| kv.key == id_key && kv.value == rec.name.as_bytes())
        {
            self.store
                .txn(
                    vec![Cmp::Unchanged(id_key.clone(), kv.mod_revision)],
                    vec![Op::Delete(id_key)],
                )
                .await?;
        }
        let node = self.keys.node(&rec.name);
        Ok(self
            .store
            .txn(
                vec![Cmp::Unchanged(node.clone(), rev)],
                vec![Op::Delete(node)],
            )
            .await?)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{config, embedded, join};
    use super::super::view::Keys;
    use super::super::{to_json, BlockRecord};
    use super::*;
    use ipnet::IpNet;
    use tether_base::time::UnixMillis;
    use tether_store::control::ControlStore;

    /// Writes `key` = `value` without a condition.
    async fn put(store: &Arc<dyn ControlStore>, key: String, value: Vec<u8>, lease: Option<i64>) {
        let op = Op::Put { key, value, lease };
        assert!(matches!(store.txn(vec![], vec![op]).await, Ok(true)));
    }

    async fn keys_under(store: &Arc<dyn ControlStore>, prefix: &str) -> Vec<String> {
        let (kvs, _) = store.list(prefix).await.unwrap_or_else(|e| panic!("{e}"));
        kvs.into_iter().map(|kv| kv.key).collect()
    }

    #[tokio::test]
    async fn a_dead_node_loses_blocks_id_and_record_and_a_live_one_nothing() {
        let (_dir, store) = embedded();
        let a = join(&store, config("a")).await;
        let keys = Keys::new("/tether");
        // Node b, as a node that registered, claimed a block and died.
        let b = NodeRecord {
            name: "b".into(),
            id: 7,
            node_ips: vec![],
            vtep_mac: None,
        };
        let block: IpNet = "10.244.0.64/26".parse().unwrap_or_else(|e| panic!("{e}"));
        put(&store, keys.node_id(7), b"b".to_vec(), None).await;
        put(
            &store,
            keys.node("b"),
            to_json(&b).unwrap_or_default(),
            None,
        )
        .await;
        let rec = BlockRecord {
            cidr: block,
            node: "b".into(),
            node_id: 7,
            claimed_unix_ms: UnixMillis::EPOCH,
        };
        put(
            &store,
            keys.block(&block),
            to_json(&rec).unwrap_or_default(),
            None,
        )
        .await;
        let seen = |a: &Cluster| {
            let v = a.view();
            v.blocks
                .contains_key(&block)
                .then(|| v.nodes.get("b").cloned())
                .flatten()
        };
        let mut rev = None;
        for _ in 0..200 {
            if let Some((_, r)) = seen(&a) {
                rev = Some(r);
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let rev = rev.unwrap_or_else(|| panic!("the view never showed b"));

        // b renews: its alive key exists, and nothing is reaped.
        let lease = store.grant_lease(5).await.unwrap_or_else(|e| panic!("{e}"));
        put(&store, keys.alive("b"), b"1".to_vec(), Some(lease)).await;
        let view = a.view();
        assert!(!a
            .reap(&view, &b, rev)
            .await
            .unwrap_or_else(|e| panic!("{e}")));
        assert_eq!(keys_under(&store, &keys.node_ids()).await.len(), 2);

        // b's alive key goes (its lease expired): reaped, record last.
        assert!(matches!(
            store.txn(vec![], vec![Op::Delete(keys.alive("b"))]).await,
            Ok(true)
        ));
        assert!(a
            .reap(&view, &b, rev)
            .await
            .unwrap_or_else(|e| panic!("{e}")));
        assert_eq!(
            keys_under(&store, &keys.node("b")).await,
            Vec::<String>::new()
        );
        assert_eq!(
            keys_under(&store, &keys.node_ids()).await,
            vec![keys.node_id(1)]
        );
        assert_eq!(
            keys_under(&store, &keys.all_blocks()).await,
            Vec::<String>::new()
        );
        // A second pass finds nothing to do.
        assert!(!a
            .reap(&view, &b, rev)
            .await
            .unwrap_or_else(|e| panic!("{e}")));
    }

    #[tokio::test]
    async fn a_registration_that_stopped_before_its_record_keeps_its_id() {
        let (_dir, store) = embedded();
        let keys = Keys::new("/tether");
        // "b" took ID 1 and stopped before writing its record.
        put(&store, keys.node_id(1), b"b".to_vec(), None).await;
        let a = join(&store, config("a")).await;
        let b = join(&store, config("b")).await;
        assert_eq!((a.me().id, b.me().id), (2, 1));
        assert_eq!(keys_under(&store, &keys.node_ids()).await.len(), 2);
    }
}
