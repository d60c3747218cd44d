//! The reaper of dead nodes: a node whose alive key has been gone for
//! `--node-grace` loses its record, ID and blocks in one guarded
//! transaction.

use super::*;

impl Cluster {
    /// Reaps nodes whose lease has been gone longer than the grace period.
    pub(super) async fn reaper_loop(self: Arc<Self>) {
        let tick =
            (self.config.node_grace / 4).clamp(Duration::from_millis(250), Duration::from_secs(10));
        loop {
            tokio::time::sleep(tick).await;
            let view = self.view();
            if !view.synced {
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
        let mut when = vec![
            Cmp::Absent(self.keys.alive(&rec.name)),
            Cmp::Unchanged(self.keys.node(&rec.name), rev),
        ];
        let mut ops = vec![
            Op::Delete(self.keys.node(&rec.name)),
            Op::Delete(self.keys.node_id(rec.id)),
        ];
        for (b, brev) in view.blocks.values().filter(|(b, _)| b.node == rec.name) {
            when.push(Cmp::Unchanged(self.keys.block(&b.cidr), *brev));
            ops.push(Op::Delete(self.keys.block(&b.cidr)));
        }
        Ok(self.store.txn(when, ops).await?)
    }
}
