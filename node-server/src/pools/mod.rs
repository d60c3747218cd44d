//! Named pools: subnets an operator defines (`--pools`), with a range,
//! exclusions, a gateway and routes, that tether's own network and IPAM-only
//! attachments (tether as another plugin's `ipam`) select by name.
//!
//! A pool is handed out in blocks (`blockSize`, default /28 and /120) that
//! nodes claim in the control plane by compare-and-swap, as cluster mode's
//! pod blocks: `<prefix>/v1/poolblocks/<v4|v6>/<net>-<len>`, holding the
//! pool's name and the node. Keys are addresses, not pool names, so two
//! definitions that overlap can still never give one address twice. On the
//! embedded control plane the blocks are the node's own; on etcd they are
//! shared by every node. Addresses inside a node's blocks are allocated
//! locally and made durable by the attachment store, as pod addresses are:
//! an ADD waits on the control plane only when its node's blocks of the
//! pool are full.
//!
//! A definition can change (the file is read again on SIGHUP). Blocks and
//! addresses already held stay: a newly excluded address that a pod holds
//! is reported by `GetPool` and in the log, never taken away; a pool removed
//! from the file keeps serving the DELs of its addresses.

pub mod def;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

pub use def::{PoolDef, PoolRoute};
use tether_base::error::{Error, Result};
use tether_base::time::UnixMillis;
use tether_ipam::{nth_block, Family, Pool, Pools, Take};
use tether_store::control::{Cmp, ControlStore, Op};

/// A block of a named pool, as the control plane records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolBlockRecord {
    /// The pool it was claimed for.
    pub pool: String,
    /// The block.
    pub cidr: IpNet,
    /// The node holding it.
    pub node: String,
    /// When it was claimed.
    pub claimed_unix_ms: UnixMillis,
}

/// One pool as this node sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolUsage {
    /// The name.
    pub name: String,
    /// The definition; `None` once it left the file while addresses of it
    /// are still held here.
    pub def: Option<PoolDef>,
    /// Addresses the pool may hand out, on every node together.
    pub size: u128,
    /// This node's blocks: (block, used, free).
    pub blocks: Vec<(IpNet, u128, u128)>,
    /// Addresses used on this node.
    pub used: u128,
    /// Addresses free in this node's blocks.
    pub free: u128,
    /// Addresses held here that the definition excludes now.
    pub excluded_in_use: Vec<IpAddr>,
}

struct Entry {
    def: Option<PoolDef>,
    alloc: Pools,
}

/// The named pools of this node.
pub struct NamedPools {
    node: String,
    control: Arc<dyn ControlStore>,
    root: String,
    state: Mutex<BTreeMap<String, Entry>>,
    /// One claim at a time, so that concurrent ADDs of a full pool share a
    /// new block instead of claiming one each.
    claiming: tokio::sync::Mutex<()>,
    claims: AtomicU64,
    last_claim_nanos: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn tag(f: Family) -> &'static str {
    match f {
        Family::V4 => "v4",
        Family::V6 => "v6",
    }
}

/// Where a node starts looking for a free block: spread by its name, so
/// that nodes claiming at the same moment rarely want the same block.
fn start_index(node: &str, count: u128) -> u128 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in node.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    u128::from(h) % count
}

impl Entry {
    fn new(def: Option<PoolDef>, family: Family) -> Entry {
        Entry {
            def,
            alloc: Pools::for_blocks(&[family]),
        }
    }

    fn add_block(&mut self, block: IpNet) -> Result<()> {
        let holes = self.def.as_ref().map(PoolDef::holes).unwrap_or_default();
        self.alloc.add_pool(Pool::block(block, &holes))
    }
}

impl NamedPools {
    /// Loads this node's blocks from the control plane and marks the
    /// addresses the attachment store holds. Of `held`, the addresses of a
    /// named pool (one of this node's blocks holds it, or a definition's
    /// CIDR) are taken; the others are returned, for the pod CIDRs. A held
    /// address whose block this node no longer holds is claimed back unless
    /// another node holds it (then it is logged: an operator must look).
    pub async fn open(
        node: &str,
        control: Arc<dyn ControlStore>,
        root: &str,
        defs: Vec<PoolDef>,
        held: &[IpAddr],
    ) -> Result<(NamedPools, Vec<IpAddr>)> {
        let pools = NamedPools {
            node: node.to_owned(),
            control,
            root: root.to_owned(),
            state: Mutex::new(BTreeMap::new()),
            claiming: tokio::sync::Mutex::new(()),
            claims: AtomicU64::new(0),
            last_claim_nanos: AtomicU64::new(0),
        };
        let mut records = Vec::new();
        for family in [Family::V4, Family::V6] {
            let (kvs, _) = pools.control.list(&pools.prefix(family)).await?;
            records.extend(
                kvs.iter()
                    .filter_map(|kv| serde_json::from_slice::<PoolBlockRecord>(&kv.value).ok())
                    .filter(|r| r.node == pools.node),
            );
        }
        let mut named = Vec::new();
        let mut rest = Vec::new();
        for &ip in held {
            let pool = records
                .iter()
                .find(|r| r.cidr.contains(&ip))
                .map(|r| r.pool.clone())
                .or_else(|| {
                    defs.iter()
                        .find(|d| d.cidr.contains(&ip))
                        .map(|d| d.name.clone())
                });
            match pool {
                Some(name) => named.push((name, ip)),
                None => rest.push(ip),
            }
        }
        {
            let mut state = lock(&pools.state);
            for d in defs {
                let family = d.family();
                state.insert(d.name.clone(), Entry::new(Some(d), family));
            }
            for r in &records {
                let entry = state
                    .entry(r.pool.clone())
                    .or_insert_with(|| Entry::new(None, Family::of(&r.cidr)));
                entry.add_block(r.cidr)?;
            }
        }
        let held = named;
        let mut strays = Vec::new();
        {
            let mut state = lock(&pools.state);
            for (name, ip) in &held {
                let entry = state
                    .entry(name.clone())
                    .or_insert_with(|| Entry::new(None, Family::of_ip(*ip)));
                strays.extend(
                    entry
                        .alloc
                        .restore(&[*ip])
                        .into_iter()
                        .map(|ip| (name.clone(), ip)),
                );
            }
        }
        for (name, ip) in strays {
            match pools.claim(&name, Some(ip)).await {
                Ok(()) => {
                    let again = lock(&pools.state)
                        .get_mut(&name)
                        .map(|e| e.alloc.restore(&[ip]));
                    if again.is_some_and(|bad| !bad.is_empty()) {
                        tracing::error!(pool = %name, %ip, "a stored address of a named pool is held twice");
                    } else {
                        tracing::warn!(pool = %name, %ip, "claimed back the block of a stored address");
                    }
                }
                Err(e) => {
                    tracing::error!(pool = %name, %ip, error = %e, "cannot hold the block of a stored address")
                }
            }
        }
        pools.report_excluded();
        Ok((pools, rest))
    }

    fn prefix(&self, family: Family) -> String {
        format!("{}poolblocks/{}/", self.root, tag(family))
    }

    fn key(&self, block: &IpNet) -> String {
        format!(
            "{}{}-{}",
            self.prefix(Family::of(block)),
            block.network(),
            block.prefix_len()
        )
    }

    /// The definition of `name`, if the file has it.
    pub fn def(&self, name: &str) -> Option<PoolDef> {
        lock(&self.state).get(name).and_then(|e| e.def.clone())
    }

    /// Every definition, by name.
    pub fn defs(&self) -> Vec<PoolDef> {
        lock(&self.state)
            .values()
            .filter_map(|e| e.def.clone())
            .collect()
    }

    /// Block claims since start, and how long the last one took.
    pub fn claims(&self) -> (u64, Duration) {
        (
            self.claims.load(Ordering::Relaxed),
            Duration::from_nanos(self.last_claim_nanos.load(Ordering::Relaxed)),
        )
    }

    /// One address of pool `name`, claiming a block when this node's are
    /// full.
    pub async fn allocate(&self, name: &str) -> Result<IpAddr> {
        for _round in 0..8 {
            // The lock is let go before `unknown`, which takes it again.
            let got = match lock(&self.state).get_mut(name) {
                Some(e) if e.def.is_some() => Some(e.alloc.allocate().ok()),
                _ => None,
            };
            match got {
                None => return Err(self.unknown(name)),
                Some(Some(ips)) => {
                    if let Some(ip) = ips.first() {
                        return Ok(*ip);
                    }
                }
                Some(None) => {}
            }
            self.claim(name, None).await?;
        }
        Err(Error::TryAgain(format!(
            "new blocks of pool {name} filled up faster than they could be claimed"
        )))
    }

    /// Takes a requested address of pool `name`.
    pub async fn take(&self, name: &str, ip: IpAddr) -> Result<()> {
        let def = self.def(name).ok_or_else(|| self.unknown(name))?;
        if !def.cidr.contains(&ip) {
            return Err(Error::AddressNotInPool(format!(
                "{ip} is outside pool {name} ({})",
                def.cidr
            )));
        }
        if def.is_excluded(ip) {
            return Err(Error::AddressExcluded(def.why_excluded(ip)));
        }
        for _ in 0..2 {
            let took = lock(&self.state)
                .get_mut(name)
                .map(|e| e.alloc.take(ip))
                .unwrap_or(Take::NotInPool);
            match took {
                Take::Taken => return Ok(()),
                Take::InUse => {
                    return Err(Error::AddressInUse(format!(
                        "{ip} of pool {name} is held by another attachment on this node"
                    )))
                }
                Take::Excluded => return Err(Error::AddressExcluded(def.why_excluded(ip))),
                Take::NotInPool => self.claim(name, Some(ip)).await?,
            }
        }
        Err(Error::Internal(format!(
            "the block of {ip} was claimed but does not hold it"
        )))
    }

    /// Returns addresses to the pools holding them; others are ignored.
    pub fn release(&self, ips: &[IpAddr]) {
        let mut state = lock(&self.state);
        for e in state.values_mut() {
            e.alloc.release(ips);
        }
    }

    /// The pool whose blocks hold `ip` on this node.
    pub fn pool_of(&self, ip: IpAddr) -> Option<String> {
        lock(&self.state)
            .iter()
            .find(|(_, e)| e.alloc.contains(ip))
            .map(|(n, _)| n.clone())
    }

    /// The error of a request for a pool this node does not define.
    pub fn unknown(&self, name: &str) -> Error {
        let known: Vec<String> = self.defs().into_iter().map(|d| d.name).collect();
        Error::UnknownPool(format!(
            "no pool {name:?} is defined on node {} (pools: {})",
            self.node,
            if known.is_empty() {
                "none; see --pools".to_owned()
            } else {
                known.join(", ")
            }
        ))
    }

    /// Takes new definitions (the file was read again). Blocks and held
    /// addresses stay; exclusions apply to what is handed out from now on.
    pub fn reload(&self, defs: Vec<PoolDef>) {
        {
            let mut state = lock(&self.state);
            let mut fresh: BTreeMap<String, PoolDef> =
                defs.into_iter().map(|d| (d.name.clone(), d)).collect();
            state.retain(|name, e| {
                e.def = fresh.remove(name);
                match &e.def {
                    Some(d) => {
                        e.alloc.set_holes(&d.holes());
                        true
                    }
                    // Gone from the file: kept while addresses are held, so
                    // their DELs find them; never allocated from.
                    None => e.alloc.pools().iter().any(|p| p.used() > 0),
                }
            });
            for (name, d) in fresh {
                let family = d.family();
                state.insert(name, Entry::new(Some(d), family));
            }
        }
        self.report_excluded();
    }

    fn report_excluded(&self) {
        for u in self.usage() {
            if !u.excluded_in_use.is_empty() {
                tracing::warn!(pool = %u.name, held = ?u.excluded_in_use,
                    "addresses held by running pods are excluded by the pool's definition now; they stay until their pods are deleted");
            }
        }
    }

    /// Every pool's usage on this node.
    pub fn usage(&self) -> Vec<PoolUsage> {
        lock(&self.state)
            .iter()
            .map(|(name, e)| {
                let blocks: Vec<(IpNet, u128, u128)> = e
                    .alloc
                    .pools()
                    .iter()
                    .map(|p| (p.cidr(), p.used(), p.free()))
                    .collect();
                PoolUsage {
                    name: name.clone(),
                    def: e.def.clone(),
                    size: e.def.as_ref().map_or(0, PoolDef::size),
                    used: blocks.iter().map(|b| b.1).sum(),
                    free: blocks.iter().map(|b| b.2).sum(),
                    excluded_in_use: e
                        .alloc
                        .pools()
                        .iter()
                        .flat_map(|p| p.excluded_in_use())
                        .collect(),
                    blocks,
                }
            })
            .collect()
    }

    /// Every block of pool `name` on every node, from the control plane.
    pub async fn blocks(&self, name: &str) -> Result<Vec<PoolBlockRecord>> {
        let family = lock(&self.state)
            .get(name)
            .and_then(|e| e.alloc.families().first().copied());
        let family = family.ok_or_else(|| self.unknown(name))?;
        let (kvs, _) = self.control.list(&self.prefix(family)).await?;
        Ok(kvs
            .iter()
            .filter_map(|kv| serde_json::from_slice::<PoolBlockRecord>(&kv.value).ok())
            .filter(|r| r.pool == name)
            .collect())
    }

    /// Claims a block of pool `name` for this node: the block of `want`, or
    /// any free one. A caller that waited for another's claim returns at
    /// once when that claim made room.
    async fn claim(&self, name: &str, want: Option<IpAddr>) -> Result<()> {
        let _one = self.claiming.lock().await;
        let def = self.def(name).ok_or_else(|| self.unknown(name))?;
        let room = |s: &BTreeMap<String, Entry>| {
            s.get(name).is_some_and(|e| match want {
                Some(ip) => e.alloc.contains(ip),
                None => e.alloc.pools().iter().any(|p| p.free() > 0),
            })
        };
        if room(&lock(&self.state)) {
            return Ok(());
        }
        let started = Instant::now();
        for _attempt in 0..32 {
            let (kvs, _) = self.control.list(&self.prefix(def.family())).await?;
            let records: Vec<PoolBlockRecord> = kvs
                .iter()
                .filter_map(|kv| serde_json::from_slice::<PoolBlockRecord>(&kv.value).ok())
                .collect();
            // Ours but unknown here: a claim whose answer was lost.
            {
                let mut state = lock(&self.state);
                if let Some(e) = state.get_mut(name) {
                    for r in records
                        .iter()
                        .filter(|r| r.node == self.node && r.pool == name)
                    {
                        e.add_block(r.cidr)?;
                    }
                }
                if room(&state) {
                    return Ok(());
                }
            }
            let block = match want {
                Some(ip) => {
                    let block = IpNet::new(ip, def.block_len)
                        .map_err(|e| Error::Internal(e.to_string()))?
                        .trunc();
                    if let Some(r) = records.iter().find(|r| def::overlaps(&r.cidr, &block)) {
                        return Err(Error::AddressNotInPool(format!(
                            "{ip} lies in block {} of pool {}, held by node {}; a node gives out addresses of its own blocks only",
                            r.cidr, r.pool, r.node
                        )));
                    }
                    block
                }
                None => self.free_block(&def, &records)?,
            };
            let key = self.key(&block);
            let record = PoolBlockRecord {
                pool: name.to_owned(),
                cidr: block,
                node: self.node.clone(),
                claimed_unix_ms: UnixMillis::now(),
            };
            let value = serde_json::to_vec(&record).map_err(|e| Error::Internal(e.to_string()))?;
            let put = Op::Put {
                key: key.clone(),
                value,
                lease: None,
            };
            let won = match self
                .control
                .txn(vec![Cmp::Absent(key.clone())], vec![put])
                .await
            {
                Ok(won) => won,
                // The outcome is unknown: the block is ours if the store
                // says so; a transient failure is tried again.
                Err(e) => {
                    let (kvs, _) = self.control.list(&key).await?;
                    let ours = kvs.iter().any(|kv| {
                        kv.key == key
                            && serde_json::from_slice::<PoolBlockRecord>(&kv.value)
                                .is_ok_and(|r| r.node == self.node)
                    });
                    if !ours && !e.is_transient() {
                        return Err(e.into());
                    }
                    ours
                }
            };
            if won {
                if let Some(e) = lock(&self.state).get_mut(name) {
                    e.add_block(block)?;
                }
                let took = started.elapsed();
                self.claims.fetch_add(1, Ordering::Relaxed);
                crate::metrics::get().block_claimed("pool", took);
                self.last_claim_nanos
                    .store(took.as_nanos() as u64, Ordering::Relaxed);
                tracing::info!(pool = %name, %block, took_ms = took.as_secs_f64() * 1000.0, "claimed a block of a named pool");
                return Ok(());
            }
        }
        Err(Error::TryAgain(format!(
            "lost every race for a block of pool {name}; try again"
        )))
    }

    /// A block of `def` that overlaps no recorded block and holds at least
    /// one address that may be handed out.
    fn free_block(&self, def: &PoolDef, records: &[PoolBlockRecord]) -> Result<IpNet> {
        let bits = u32::from(def.block_len - def.cidr.prefix_len());
        let count = 1u128.checked_shl(bits).unwrap_or(u128::MAX);
        let start = start_index(&self.node, count);
        let holes = def.holes();
        // Every recorded block rules out at most a few candidates; a cap
        // keeps a pool whose free space is all excluded from scanning 2^56
        // IPv6 blocks.
        let budget = count.min(records.len() as u128 + 65_536);
        for i in 0..budget {
            let block = nth_block(&def.cidr, def.block_len, (start + i) % count)?;
            if records.iter().any(|r| def::overlaps(&r.cidr, &block)) {
                continue;
            }
            if Pool::block(block, &holes).size() > 0 {
                return Ok(block);
            }
        }
        let held = records.iter().filter(|r| r.pool == def.name).count();
        Err(Error::PoolExhausted(format!(
            "pool {} ({}) has no free /{} block: {held} are held by nodes, the rest are excluded",
            def.name, def.cidr, def.block_len
        )))
    }
}

#[cfg(test)]
mod tests;
