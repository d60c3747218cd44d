//! Cluster mode: this node's membership in the control plane, its address
//! blocks, and the routes to every other node's blocks.
//!
//! Everything here goes through [`ControlStore`], so it runs the same on
//! the embedded backend (one node) and on etcd. Every change is a
//! compare-and-swap transaction; two nodes racing for a node ID or a block
//! cannot both win.
//!
//! Keys, under the configured prefix (default `/tether`):
//! - `v1/nodeids/<id>`: the node name holding the ID. Permanent.
//! - `v1/nodes/<name>`: the node record ([`NodeRecord`], JSON). Permanent.
//! - `v1/alive/<name>`: attached to the node's lease; present while the
//!   node's daemon renews it.
//! - `v1/blocks/<v4|v6>/<network>-<prefix length>`: the block's holder
//!   ([`BlockRecord`], JSON). Permanent until the holder is reaped.
//!
//! Liveness: a node whose alive key has been missing for longer than the
//! grace period is dead; the first live node to notice deletes its record,
//! its ID and its blocks in one transaction, and every node withdraws the
//! routes to those blocks.

use crate::control::{self, BoxFut, Cmp, ControlError, ControlStore, Event, Follower, Kv, Op};
use crate::error::{Error, Result};
use crate::ipam::Family;
use crate::mac::Mac;
use crate::time::UnixMillis;
use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// The highest node ID: IDs number the VXLAN gateway addresses, which live
/// in 169.254.128.0/17.
pub const MAX_NODE_ID: u32 = 32767;

/// How nodes reach each other's blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overlay {
    /// Routes `block via nodeIP`: the nodes share an L2 segment.
    HostGw,
    /// One VXLAN device with static FDB and neighbour entries per node.
    Vxlan {
        /// The VXLAN network identifier.
        vni: u32,
        /// The UDP port.
        port: u16,
    },
}

impl Overlay {
    /// "host-gw" or "vxlan".
    pub fn name(&self) -> &'static str {
        match self {
            Overlay::HostGw => "host-gw",
            Overlay::Vxlan { .. } => "vxlan",
        }
    }
}

/// Cluster-mode settings.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// This node's name, its key in the control plane.
    pub node_name: String,
    /// Underlay addresses (at most one per family) that other nodes route
    /// this node's blocks through.
    pub node_ips: Vec<IpAddr>,
    /// Cluster CIDRs, at most one per family.
    pub cluster_cidrs: Vec<IpNet>,
    /// IPv4 block prefix length.
    pub block_v4: u8,
    /// IPv6 block prefix length.
    pub block_v6: u8,
    /// Key prefix, e.g. "/tether".
    pub prefix: String,
    /// The node lease's time to live.
    pub lease_ttl: Duration,
    /// How long a node's lease must have been gone before it is reaped.
    pub node_grace: Duration,
    /// Host-gw or VXLAN.
    pub overlay: Overlay,
}

impl ClusterConfig {
    /// Checks the CIDRs and block sizes.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidConfig(m));
        let mut seen = BTreeSet::new();
        for c in &self.cluster_cidrs {
            let family = Family::of(c);
            if !seen.insert(family) {
                return bad("at most one IPv4 and one IPv6 --cluster-cidr".into());
            }
            let block = self.block_len(family);
            let max = if family == Family::V4 { 30 } else { 126 };
            if block < c.prefix_len() || block > max {
                return bad(format!(
                    "block size /{block} does not fit {family:?} cluster CIDR {c} (between /{} and /{max})",
                    c.prefix_len()
                ));
            }
        }
        if self.cluster_cidrs.is_empty() {
            return bad("cluster mode needs a --cluster-cidr".into());
        }
        Ok(())
    }

    fn block_len(&self, family: Family) -> u8 {
        match family {
            Family::V4 => self.block_v4,
            Family::V6 => self.block_v6,
        }
    }

    fn cidr_of(&self, family: Family) -> Option<IpNet> {
        self.cluster_cidrs
            .iter()
            .copied()
            .find(|c| Family::of(c) == family)
    }

    /// The families every pod gets an address of.
    pub fn families(&self) -> Vec<Family> {
        self.cluster_cidrs.iter().map(Family::of).collect()
    }
}

/// A node as recorded in the control plane.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    /// The node's name.
    pub name: String,
    /// Its small unique ID.
    pub id: u32,
    /// Underlay addresses.
    pub node_ips: Vec<IpAddr>,
    /// The VXLAN device's MAC, in vxlan mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vtep_mac: Option<String>,
}

impl NodeRecord {
    /// The VXLAN device's MAC, if recorded and well formed; a node with a
    /// bad one is not peered with rather than failing the whole view.
    pub(crate) fn vtep_mac_octets(&self) -> Option<[u8; 6]> {
        self.vtep_mac
            .as_deref()?
            .parse::<Mac>()
            .ok()
            .map(Mac::octets)
    }
}

/// A block's holder.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockRecord {
    /// The block.
    pub cidr: IpNet,
    /// The holding node's name.
    pub node: String,
    /// The holding node's ID.
    pub node_id: u32,
    /// When it was claimed (stored as ms since the epoch).
    pub claimed_unix_ms: UnixMillis,
}

/// The cluster as the watch last saw it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterView {
    /// Node records and their mod revisions, by name.
    pub nodes: BTreeMap<String, (NodeRecord, i64)>,
    /// Names whose alive key exists.
    pub alive: BTreeSet<String>,
    /// Blocks and their mod revisions.
    pub blocks: BTreeMap<IpNet, (BlockRecord, i64)>,
    /// The store revision the view is current at.
    pub revision: i64,
    /// False until the first complete listing arrived, and while the watch
    /// is broken (the view may be stale).
    pub synced: bool,
}

impl ClusterView {
    /// Blocks held by `node`, in address order.
    pub fn blocks_of(&self, node: &str) -> Vec<IpNet> {
        self.blocks
            .values()
            .filter(|(b, _)| b.node == node)
            .map(|(b, _)| b.cidr)
            .collect()
    }
}

/// The kind of a key, parsed from its path.
enum KeyKind {
    Node(String),
    Alive(String),
    Block,
    NodeId,
}

struct Keys {
    root: String,
}

impl Keys {
    fn new(prefix: &str) -> Keys {
        Keys {
            root: control::v1_root(prefix),
        }
    }
    fn node(&self, name: &str) -> String {
        format!("{}nodes/{name}", self.root)
    }
    fn node_id(&self, id: u32) -> String {
        format!("{}nodeids/{id}", self.root)
    }
    fn alive(&self, name: &str) -> String {
        format!("{}alive/{name}", self.root)
    }
    fn blocks(&self, family: Family) -> String {
        format!("{}blocks/{}/", self.root, family_tag(family))
    }
    fn block(&self, cidr: &IpNet) -> String {
        format!(
            "{}{}-{}",
            self.blocks(Family::of(cidr)),
            cidr.network(),
            cidr.prefix_len()
        )
    }
    fn kind(&self, key: &str) -> Option<KeyKind> {
        let rest = key.strip_prefix(&self.root)?;
        let (kind, name) = rest.split_once('/')?;
        Some(match kind {
            "nodes" => KeyKind::Node(name.to_owned()),
            "alive" => KeyKind::Alive(name.to_owned()),
            "blocks" => KeyKind::Block,
            "nodeids" => KeyKind::NodeId,
            _ => return None,
        })
    }
}

fn family_tag(f: Family) -> &'static str {
    match f {
        Family::V4 => "v4",
        Family::V6 => "v6",
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn to_json<T: Serialize>(v: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(v).map_err(|e| Error::Internal(e.to_string()))
}

/// The MAC of a node's VXLAN device: locally administered, from its ID.
pub fn vtep_mac(id: u32) -> [u8; 6] {
    [0x0e, 0x74, 0x68, 0x00, (id >> 8) as u8, id as u8]
}

/// The addresses that stand for node `id` on the VXLAN device: the next hop
/// of routes to its blocks, resolved by a permanent neighbour entry.
pub fn vxlan_gateways(id: u32) -> (Ipv4Addr, Ipv6Addr) {
    let v4 = Ipv4Addr::from(u32::from(Ipv4Addr::new(169, 254, 128, 0)) + id);
    let v6 = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0x7474, id as u16);
    (v4, v6)
}

/// Applies one listing or event to a view. Returns false for keys the view
/// does not follow (VM records have their own watch), so that their
/// changes do not wake the route manager.
fn apply(view: &mut ClusterView, keys: &Keys, event: &Event) -> bool {
    let key = match event {
        Event::Put(kv) => &kv.key,
        Event::Delete { key, .. } => key,
    };
    if !matches!(
        keys.kind(key),
        Some(KeyKind::Node(_) | KeyKind::Alive(_) | KeyKind::Block)
    ) {
        return false;
    }
    match event {
        Event::Put(kv) => put_kv(view, keys, kv),
        Event::Delete { key, mod_revision } => {
            view.revision = view.revision.max(*mod_revision);
            match keys.kind(key) {
                Some(KeyKind::Node(name)) => {
                    view.nodes.remove(&name);
                }
                Some(KeyKind::Alive(name)) => {
                    view.alive.remove(&name);
                }
                Some(KeyKind::Block) => view.blocks.retain(|c, _| keys.block(c) != *key),
                Some(KeyKind::NodeId) | None => {}
            }
        }
    }
    true
}

fn put_kv(view: &mut ClusterView, keys: &Keys, kv: &Kv) {
    view.revision = view.revision.max(kv.mod_revision);
    match keys.kind(&kv.key) {
        Some(KeyKind::Node(name)) => match serde_json::from_slice::<NodeRecord>(&kv.value) {
            Ok(rec) => {
                view.nodes.insert(name, (rec, kv.mod_revision));
            }
            Err(e) => tracing::warn!(key = %kv.key, error = %e, "ignoring a malformed node record"),
        },
        Some(KeyKind::Alive(name)) => {
            view.alive.insert(name);
        }
        Some(KeyKind::Block) => match serde_json::from_slice::<BlockRecord>(&kv.value) {
            Ok(rec) if keys.block(&rec.cidr) == kv.key => {
                view.blocks.insert(rec.cidr, (rec, kv.mod_revision));
            }
            Ok(_) | Err(_) => tracing::warn!(key = %kv.key, "ignoring a malformed block record"),
        },
        Some(KeyKind::NodeId) | None => {}
    }
}

/// Health of the control plane as this node last saw it.
#[derive(Debug, Clone, Default)]
pub struct Health {
    /// The last call succeeded.
    pub healthy: bool,
    /// What failed, if anything.
    pub detail: String,
}

/// This node's membership in the cluster.
pub struct Cluster {
    store: Arc<dyn ControlStore>,
    config: ClusterConfig,
    keys: Keys,
    me: Mutex<NodeRecord>,
    view: watch::Sender<ClusterView>,
    /// One block claim at a time per node: concurrent ADDs that ran out of
    /// room share the claim instead of each taking a block.
    claiming: tokio::sync::Mutex<()>,
    health: Mutex<Health>,
    /// When this node first saw each other node without its alive key.
    dead_since: Mutex<HashMap<String, Instant>>,
    /// Block claims made since start: (count, last duration).
    claims: Mutex<(u64, Duration)>,
    /// The blocks this node holds as far as this process knows: those the
    /// control plane showed at join, and every claim since (known before
    /// the watch reports it). If the node is reaped while it cannot reach
    /// the control plane, it claims these back when it returns.
    held: Mutex<BTreeSet<IpNet>>,
}

impl Cluster {
    /// Joins the cluster: finds or creates this node's record and ID,
    /// reads the cluster, and starts the lease, the watch and the reaper.
    /// Waits (retrying) until the control plane answers: a node cannot
    /// know its blocks without it.
    pub async fn join(store: Arc<dyn ControlStore>, config: ClusterConfig) -> Result<Arc<Self>> {
        config.validate()?;
        let keys = Keys::new(&config.prefix);
        let mut delay = Duration::from_millis(200);
        let me = loop {
            match register(&*store, &keys, &config).await {
                Ok(me) => break me,
                Err(e @ Error::TryAgain(_)) => {
                    tracing::warn!(error = %e, "control plane unreachable; retrying registration");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
                Err(e) => return Err(e),
            }
        };
        tracing::info!(node = %me.name, id = me.id, ips = ?me.node_ips, "registered in the control plane");
        let (view, _) = watch::channel(ClusterView::default());
        let cluster = Arc::new(Cluster {
            store,
            config,
            keys,
            me: Mutex::new(me),
            view,
            claiming: tokio::sync::Mutex::new(()),
            health: Mutex::new(Health {
                healthy: true,
                detail: String::new(),
            }),
            dead_since: Mutex::new(HashMap::new()),
            claims: Mutex::new((0, Duration::ZERO)),
            held: Mutex::new(BTreeSet::new()),
        });
        // The first listing before anything else: startup reconciles the
        // kernel against it.
        let revision = cluster.relist().await?;
        let mine = cluster.view().blocks_of(&cluster.me().name);
        lock(&cluster.held).extend(mine);
        tokio::spawn(control::follow(
            cluster.store.clone(),
            cluster.keys.root.clone(),
            revision,
            cluster.clone(),
        ));
        tokio::spawn(cluster.clone().lease_loop());
        tokio::spawn(cluster.clone().reaper_loop());
        Ok(cluster)
    }

    /// The settings.
    pub fn config(&self) -> &ClusterConfig {
        &self.config
    }

    /// This node's record.
    pub fn me(&self) -> NodeRecord {
        lock(&self.me).clone()
    }

    /// The control plane's backend name and location.
    pub fn store(&self) -> &Arc<dyn ControlStore> {
        &self.store
    }

    /// The latest view.
    pub fn view(&self) -> ClusterView {
        self.view.borrow().clone()
    }

    /// Notified on every view change.
    pub fn subscribe(&self) -> watch::Receiver<ClusterView> {
        self.view.subscribe()
    }

    /// The control plane's health as last seen.
    pub fn health(&self) -> Health {
        lock(&self.health).clone()
    }

    /// Block claims since start and the last one's duration.
    pub fn claim_stats(&self) -> (u64, Duration) {
        *lock(&self.claims)
    }

    fn set_health(&self, r: &Result<()>) {
        let mut h = lock(&self.health);
        match r {
            Ok(()) => {
                if !h.healthy {
                    tracing::info!("control plane reachable again");
                }
                *h = Health {
                    healthy: true,
                    detail: String::new(),
                };
            }
            Err(e) => {
                drop(h);
                self.set_unhealthy(e);
            }
        }
    }

    fn set_unhealthy(&self, e: &Error) {
        let mut h = lock(&self.health);
        if h.healthy {
            tracing::warn!(error = %e, "control plane unhealthy");
        }
        *h = Health {
            healthy: false,
            detail: e.to_string(),
        };
    }

    /// Probes the control plane now; records and returns the outcome.
    pub async fn probe(&self) -> Result<()> {
        let r = self.store.probe().await.map_err(Error::from);
        self.set_health(&r);
        r
    }

    /// Lists everything and replaces the view. Returns the revision.
    async fn relist(&self) -> Result<i64> {
        let listed = self.store.list(&self.keys.root).await;
        let (kvs, revision) = match listed {
            Ok(l) => l,
            Err(e) => {
                let r = Err(Error::from(e));
                self.set_health(&r);
                return r.map(|()| 0);
            }
        };
        self.set_health(&Ok(()));
        let mut view = ClusterView {
            revision,
            synced: true,
            ..Default::default()
        };
        for kv in &kvs {
            put_kv(&mut view, &self.keys, kv);
        }
        view.revision = revision;
        self.view.send_replace(view);
        Ok(revision)
    }

    /// Keeps this node's alive key attached to a live lease; re-creates
    /// the lease (and the node record, if it was reaped while this node
    /// could not reach the store) after an outage.
    async fn lease_loop(self: Arc<Self>) {
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

    /// Reaps nodes whose lease has been gone longer than the grace period.
    async fn reaper_loop(self: Arc<Self>) {
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
        tracing::info!(%block, took_ms = took.as_secs_f64() * 1000.0, "claimed an address block");
        Ok(Some(block))
    }

    /// Claims a block of `family` and records it as held.
    async fn claim(&self, family: Family) -> Result<IpNet> {
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
                        Ok(_) if matches!(e, ControlError::Unavailable { .. }) => continue,
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
                Err(ControlError::Unavailable { .. }) if attempt < 2 => {
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
    async fn reclaim(&self, block: IpNet) -> Result<()> {
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

/// The view of nodes, alive keys and blocks follows the whole prefix.
impl Follower for Cluster {
    fn apply(&self, events: &[Event]) {
        self.view.send_if_modified(|v| {
            let mut changed = false;
            for e in events {
                changed |= apply(v, &self.keys, e);
            }
            changed
        });
    }

    fn mark_stale(&self) {
        self.view.send_modify(|v| v.synced = false);
    }

    fn list_again(&self) -> BoxFut<'_, i64, Error> {
        Box::pin(self.relist())
    }

    fn watch_failed(&self, e: &Error) {
        self.set_unhealthy(e);
    }
}

/// The underlay address to use toward a peer: the same family as one of
/// ours, IPv4 first.
pub(crate) fn vtep_underlay<'a>(theirs: &'a [IpAddr], ours: &[IpAddr]) -> Option<&'a IpAddr> {
    theirs
        .iter()
        .filter(|t| ours.iter().any(|o| o.is_ipv4() == t.is_ipv4()))
        .min_by_key(|t| !t.is_ipv4())
}

/// Finds or creates this node's record and ID.
async fn register(
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

/// The index of `block` inside `cidr` for blocks of `len`.
fn block_index(cidr: &IpNet, block: &IpNet, len: u8) -> u128 {
    let shift = u32::from(max_len(cidr) - len);
    (to_u128(block.network()).wrapping_sub(to_u128(cidr.network()))) >> shift
}

fn max_len(net: &IpNet) -> u8 {
    match net {
        IpNet::V4(_) => 32,
        IpNet::V6(_) => 128,
    }
}

fn to_u128(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

/// Block number `index` of `len` inside `cidr`.
fn nth_block(cidr: &IpNet, len: u8, index: u128) -> Result<IpNet> {
    let shift = u32::from(max_len(cidr) - len);
    let base = to_u128(cidr.network()) + (index << shift);
    let ip = match cidr {
        IpNet::V4(_) => IpAddr::V4(Ipv4Addr::from(base as u32)),
        IpNet::V6(_) => IpAddr::V6(Ipv6Addr::from(base)),
    };
    IpNet::new(ip, len).map_err(|e| Error::Internal(e.to_string()))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::embedded::EmbeddedStore;

    fn config(name: &str) -> ClusterConfig {
        ClusterConfig {
            node_name: name.into(),
            node_ips: vec!["192.0.2.1".parse().unwrap_or_else(|e| panic!("{e}"))],
            cluster_cidrs: vec![
                "10.244.0.0/24".parse().unwrap_or_else(|e| panic!("{e}")),
                "fd00:10::/120".parse().unwrap_or_else(|e| panic!("{e}")),
            ],
            block_v4: 26,
            block_v6: 122,
            prefix: "/tether".into(),
            lease_ttl: Duration::from_secs(5),
            node_grace: Duration::from_secs(60),
            overlay: Overlay::HostGw,
        }
    }

    /// An embedded control plane in a temp dir (kept alive by the guard).
    fn embedded() -> (tempfile::TempDir, Arc<dyn ControlStore>) {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let store = EmbeddedStore::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        (dir, Arc::new(store))
    }

    async fn join(store: &Arc<dyn ControlStore>, config: ClusterConfig) -> Arc<Cluster> {
        Cluster::join(store.clone(), config)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

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

    #[test]
    fn validation() {
        let mut c = config("a");
        assert!(c.validate().is_ok());
        c.block_v4 = 20;
        assert!(c.validate().is_err(), "a block larger than the CIDR");
        c.block_v4 = 31;
        assert!(c.validate().is_err(), "a block too small for a pod");
        let mut c = config("a");
        c.cluster_cidrs
            .push("10.9.0.0/16".parse().unwrap_or_else(|e| panic!("{e}")));
        assert!(c.validate().is_err(), "two IPv4 cluster CIDRs");
    }

    #[tokio::test]
    async fn ids_and_blocks_are_unique_and_survive_a_restart() {
        let (_dir, store) = embedded();
        let a = join(&store, config("a")).await;
        let b = join(&store, config("b")).await;
        assert_eq!((a.me().id, b.me().id), (1, 2));
        // Two nodes claim concurrently until the /24 (four /26) is gone.
        let claim = |c: Arc<Cluster>| async move {
            let mut got = Vec::new();
            // Four blocks exist: more rounds than that is a claim repeating
            // itself, which must fail here rather than hang the suite.
            for _ in 0..8 {
                match c.claim(Family::V4).await {
                    Ok(b) => got.push(b),
                    Err(Error::PoolExhausted(m)) => return (got, m),
                    Err(e) => panic!("{e}"),
                }
            }
            panic!("claimed {got:?} and kept going");
        };
        let ((ga, ma), (gb, _)) = tokio::join!(claim(a.clone()), claim(b.clone()));
        let mut all: Vec<IpNet> = ga.iter().chain(gb.iter()).copied().collect();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 4, "{ga:?} {gb:?}");
        assert_eq!(ga.len() + gb.len(), 4, "no block handed out twice");
        assert!(ma.contains("10.244.0.0/24"), "{ma}");
        // The same name gets the same ID again.
        let a2 = join(&store, config("a")).await;
        assert_eq!(a2.me().id, 1);
        assert_eq!(a2.view().blocks_of("a"), {
            let mut v = ga.clone();
            v.sort();
            v
        });
    }

    #[tokio::test]
    async fn a_claim_whose_answer_was_lost_is_adopted_not_repeated() {
        let (_dir, store) = embedded();
        let a = join(&store, config("a")).await;
        // The block key exists for us, but this process never heard back.
        let lost: IpNet = "10.244.0.192/26".parse().unwrap_or_else(|e| panic!("{e}"));
        let record = BlockRecord {
            cidr: lost,
            node: "a".into(),
            node_id: a.me().id,
            claimed_unix_ms: UnixMillis::EPOCH,
        };
        let key = Keys::new("/tether").block(&lost);
        let put = Op::Put {
            key,
            value: to_json(&record).unwrap_or_else(|e| panic!("{e}")),
            lease: None,
        };
        assert!(matches!(store.txn(vec![], vec![put]).await, Ok(true)));
        let got = a
            .claim_block(Family::V4, &[])
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            got,
            Some(lost),
            "the lost claim is taken, not a second block"
        );
        let (blocks, _) = store
            .list("/tether/v1/blocks/v4/")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(blocks.len(), 1);
        assert_eq!(a.my_blocks(), vec![lost]);
    }

    #[tokio::test]
    async fn routes_follow_the_view() {
        let (_dir, store) = embedded();
        let a = join(&store, config("a")).await;
        let mut cb = config("b");
        cb.node_ips = vec![
            "192.0.2.2".parse().unwrap_or_else(|e| panic!("{e}")),
            "2001:db8::2".parse().unwrap_or_else(|e| panic!("{e}")),
        ];
        let b = join(&store, cb).await;
        let b4 = b.claim(Family::V4).await.unwrap_or_else(|e| panic!("{e}"));
        let b6 = b.claim(Family::V6).await.unwrap_or_else(|e| panic!("{e}"));
        let a4 = a.claim(Family::V4).await.unwrap_or_else(|e| panic!("{e}"));
        let mut rx = a.subscribe();
        let view = loop {
            let v = rx.borrow_and_update().clone();
            if v.blocks.len() == 3 {
                break v;
            }
            let _ = rx.changed().await;
        };
        let me = a.me();
        let (routes, peers) =
            crate::routing::plan::cluster_routes(&crate::routing::plan::ClusterSide {
                me: &me,
                overlay: &a.config().overlay,
                view: &view,
            });
        assert!(peers.is_empty());
        let want: Vec<(String, String)> = routes
            .iter()
            .map(|r| (r.dst.to_string(), r.via.to_string()))
            .collect();
        assert_eq!(
            want,
            vec![
                (b4.to_string(), "192.0.2.2".into()),
                (b6.to_string(), "2001:db8::2".into())
            ]
        );
        assert!(routes.iter().all(|r| r.dst != a4 && r.onlink_dev.is_none()));
    }
}
