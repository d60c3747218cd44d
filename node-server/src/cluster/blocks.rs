//! Address blocks: claiming one by compare-and-swap (a start derived from
//! the node ID, then the first free index), adopting a claim whose answer
//! was lost, and taking a block back after the node's record was reaped.

use super::{lock, to_json, BlockRecord, Cluster};
use ipnet::IpNet;
use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::{Duration, Instant};
use tether_base::error::{Error, Result};
use tether_base::time::UnixMillis;
use tether_ipam::Family;
use tether_ipam::{max_len, nth_block, to_u128};
use tether_store::control::{Cmp, ControlError, Op};

/// The index of `block` inside `cidr` for blocks of `len`.
fn block_index(cidr: &IpNet, block: &IpNet, len: u8) -> u128 {
    let shift = u32::from(max_len(cidr) - len);
    (to_u128(block.network()).wrapping_sub(to_u128(cidr.network()))) >> shift
}

/// The first index not in `taken`, scanning from `start` and wrapping.
fn first_free(taken: &BTreeSet<u128>, start: u128, count: u128) -> Option<u128> {
    let gap = |from: u128, to: u128| -> Option<u128> {
        let mut candidate = from;
        for &t in taken.range(from..to) {
            if t != candidate {
                break;
            }
            candidate += 1;
        }
        (candidate < to).then_some(candidate)
    };
    gap(start, count).or_else(|| gap(0, start))
}

impl Cluster {
    /// Every block this node holds: those the view shows, and those this
    /// process holds that the watch has not reported (yet).
    pub fn my_blocks(&self) -> Vec<IpNet> {
        let mut all: BTreeSet<IpNet> = self.view().blocks_of(&self.me().name).into_iter().collect();
        all.extend(lock(&self.held).iter().copied());
        all.into_iter().collect()
    }

    /// Claims a new block of `family` for this node by CAS and returns it.
    /// One claim runs at a time; a caller that waited for another's claim
    /// gets `None` when a block it does not hold yet appeared meanwhile
    /// (there may be room now: take [`Cluster::my_blocks`] and allocate
    /// again).
    pub async fn claim_block(&self, family: Family, held: &[IpNet]) -> Result<Option<IpNet>> {
        let _one = self.claiming.lock().await;
        if self
            .my_blocks()
            .iter()
            .any(|b| Family::of(b) == family && !held.contains(b))
        {
            return Ok(None);
        }
        let started = Instant::now();
        let block = self.claim(family).await?;
        let took = started.elapsed();
        {
            let mut c = lock(&self.claims);
            c.0 += 1;
            c.1 = took;
        }
        crate::metrics::get().block_claimed("pod", took);
        tracing::info!(%block, took_ms = took.as_secs_f64() * 1000.0, "claimed an address block");
        Ok(Some(block))
    }

    /// Claims a block of `family` and records it as held.
    pub(crate) async fn claim(&self, family: Family) -> Result<IpNet> {
        let block = self.claim_unrecorded(family).await?;
        lock(&self.held).insert(block);
        Ok(block)
    }

    async fn claim_unrecorded(&self, family: Family) -> Result<IpNet> {
        let cidr = self
            .config
            .cidr_of(family)
            .ok_or_else(|| Error::Internal(format!("no {} cluster CIDR", family.name())))?;
        let len = self.config.block_len(family);
        let count: u128 = 1u128 << (len - cidr.prefix_len());
        let me = self.me();
        // Nodes start their search at different places, so that nodes
        // claiming at the same moment rarely want the same block.
        let start = (u128::from(me.id).wrapping_mul(0x9e37_79b9)) % count;
        for _attempt in 0..32 {
            let (kvs, _) = self
                .retrying(|| self.store.list(&self.keys.blocks(family)))
                .await?;
            let mut taken = BTreeSet::new();
            for kv in &kvs {
                if let Ok(b) = serde_json::from_slice::<BlockRecord>(&kv.value) {
                    if b.node == me.name && !lock(&self.held).contains(&b.cidr) {
                        // Ours, but unknown to us: a claim whose answer was
                        // lost (the member died after committing it).
                        return Ok(b.cidr);
                    }
                    taken.insert(block_index(&cidr, &b.cidr, len));
                }
            }
            let Some(index) = first_free(&taken, start, count) else {
                return Err(Error::PoolExhausted(format!(
                    "every /{len} block of the cluster CIDR {cidr} is held ({} blocks)",
                    taken.len()
                )));
            };
            let block = nth_block(&cidr, len, index)?;
            let key = self.keys.block(&block);
            let record = BlockRecord {
                cidr: block,
                node: me.name.clone(),
                node_id: me.id,
                claimed_unix_ms: UnixMillis::now(),
            };
            let put = Op::Put {
                key: key.clone(),
                value: to_json(&record)?,
                lease: None,
            };
            match self
                .store
                .txn(vec![Cmp::Absent(key.clone())], vec![put])
                .await
            {
                Ok(true) => return Ok(block),
                Ok(false) => continue,
                Err(e) => {
                    // The outcome is unknown: the block is ours if the store
                    // says so. Otherwise a transient failure is retried (the
                    // create is safe to repeat) and any other error stands.
                    match self.retrying(|| self.holder_of(&block)).await {
                        Ok(Some(holder)) if holder == me.name => return Ok(block),
                        Ok(_) if e.is_transient() => continue,
                        _ => return Err(e.into()),
                    }
                }
            }
        }
        Err(Error::TryAgain(format!(
            "lost every race for a {} block; try again",
            family.name()
        )))
    }

    /// Runs a call up to three times while the store is unavailable:
    /// right after an etcd leader dies, requests fail until a new leader is
    /// elected (well under a second with etcd's defaults). Only for calls
    /// that are safe to repeat.
    async fn retrying<T, F, Fut>(&self, mut call: F) -> Result<T, ControlError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, ControlError>>,
    {
        let mut attempt = 0;
        loop {
            match call().await {
                Err(e) if e.is_transient() && attempt < 2 => {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(150)).await;
                }
                other => return other,
            }
        }
    }

    async fn holder_of(&self, block: &IpNet) -> Result<Option<String>, ControlError> {
        let key = self.keys.block(block);
        let (kvs, _) = self.store.list(&key).await?;
        Ok(kvs
            .iter()
            .find(|kv| kv.key == key)
            .and_then(|kv| serde_json::from_slice::<BlockRecord>(&kv.value).ok())
            .map(|b| b.node))
    }

    /// Claims the block holding `ip`, for addresses recorded locally whose
    /// block this node no longer holds (it was reaped while away). Fails
    /// when another node holds it.
    pub async fn reclaim_block_of(&self, ip: IpAddr) -> Result<IpNet> {
        let family = if ip.is_ipv4() { Family::V4 } else { Family::V6 };
        let block = IpNet::new(ip, self.config.block_len(family))
            .map_err(|e| Error::Internal(e.to_string()))?
            .trunc();
        self.reclaim(block).await?;
        Ok(block)
    }

    /// Makes sure the control plane records `block` as ours: a no-op if it
    /// does, a CAS create if nobody holds it, an error naming the holder if
    /// another node does (two nodes then hand out the same addresses: an
    /// operator must look).
    pub(super) async fn reclaim(&self, block: IpNet) -> Result<()> {
        let me = self.me();
        match self.holder_of(&block).await? {
            Some(n) if n == me.name => {
                lock(&self.held).insert(block);
                return Ok(());
            }
            Some(other) => {
                return Err(Error::Store(format!(
                    "block {block}, which this node still uses, is held by node {other}"
                )))
            }
            None => {}
        }
        let record = BlockRecord {
            cidr: block,
            node: me.name.clone(),
            node_id: me.id,
            claimed_unix_ms: UnixMillis::now(),
        };
        let key = self.keys.block(&block);
        let put = Op::Put {
            key: key.clone(),
            value: to_json(&record)?,
            lease: None,
        };
        if self.store.txn(vec![Cmp::Absent(key)], vec![put]).await? {
            lock(&self.held).insert(block);
            tracing::warn!(%block, "claimed back a block this node still uses");
            Ok(())
        } else {
            Err(Error::Store(format!(
                "lost the race to claim back block {block}"
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_arithmetic() {
        let cidr: IpNet = "10.244.0.0/16".parse().unwrap_or_else(|e| panic!("{e}"));
        let b = nth_block(&cidr, 26, 5).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(b.to_string(), "10.244.1.64/26");
        assert_eq!(block_index(&cidr, &b, 26), 5);
        let taken: BTreeSet<u128> = [0, 1, 2, 5].into_iter().collect();
        assert_eq!(first_free(&taken, 0, 8), Some(3));
        assert_eq!(first_free(&taken, 5, 8), Some(6));
        assert_eq!(first_free(&taken, 2, 4), Some(3));
        let all: BTreeSet<u128> = (0..4).collect();
        assert_eq!(first_free(&all, 2, 4), None);
        let v6: IpNet = "fd00::/56".parse().unwrap_or_else(|e| panic!("{e}"));
        let b6 = nth_block(&v6, 122, (1 << 66) - 1).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(b6.to_string(), "fd00::ff:ffff:ffff:ffff:ffc0/122");
    }
}
