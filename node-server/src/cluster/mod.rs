//! Cluster mode: this node's membership in the control plane, its address
//! blocks, and the routes to every other node's blocks.
//!
//! Everything here goes through [`ControlStore`], so it runs the same on
//! the embedded backend (one node) and on etcd. Every change is a
//! compare-and-swap transaction; two nodes racing for a node ID or a block
//! cannot both win.
//!
//! Keys, under the configured prefix (default `/tether`), each class
//! followed by a watch of its own:
//! - `v1/nodeids/<id>`: the node name holding the ID. Permanent.
//! - `v1/nodes/<name>`: the node record ([`NodeRecord`], JSON). Permanent.
//! - `v1/alive/<name>`: attached to the node's lease; present while the
//!   node's daemon renews it.
//! - `v1/blocks/<v4|v6>/<network>-<prefix length>`: the block's holder
//!   ([`BlockRecord`], JSON). Permanent until the holder is reaped.
//!
//! Liveness: each node watches one other node's alive key, and one node,
//! the reaper, watches them all (`liveness`). A node whose alive key has
//! been missing for longer than the grace period is dead; the reaper
//! deletes its blocks, its ID and its record (`reaper`: one key at a time,
//! the record last), and every node withdraws the routes to those blocks.

mod blocks;
pub mod liveness;
mod membership;
mod peers;
mod reaper;
mod view;

use membership::register;
pub use peers::Peers;
pub use view::ClusterView;
use view::{apply, put_kv, Keys};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tether_base::error::{Error, Result};
use tether_base::mac::Mac;
use tether_base::time::UnixMillis;
use tether_ipam::Family;
use tether_store::control::{self, BoxFut, ControlStore, Event, Follower};
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
    /// Shared: a reader's copy is the `Arc` (a route pass holds one), and
    /// a change copies the view only while a reader holds the current one.
    view: watch::Sender<Arc<ClusterView>>,
    /// One block claim at a time per node: concurrent ADDs that ran out of
    /// room share the claim instead of each taking a block.
    claiming: tokio::sync::Mutex<()>,
    health: Mutex<Health>,
    /// When this node first saw each other node without its alive key.
    dead_since: Mutex<HashMap<String, Instant>>,
    /// Block claims made since start: (count, last duration).
    claims: Mutex<(u64, Duration)>,
    /// The parts of the view whose watch is broken (the view is synced
    /// when none is).
    stale: Mutex<BTreeSet<Part>>,
    /// What this node watches of the others' liveness.
    role: Mutex<liveness::Role>,
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
        let me = control::until_answered("the registration", || register(&*store, &keys, &config))
            .await?;
        tracing::info!(node = %me.name, id = me.id, ips = ?me.node_ips, "registered in the control plane");
        let (view, _) = watch::channel(Arc::new(ClusterView::default()));
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
            stale: Mutex::new(Part::ALL.into_iter().collect()),
            role: Mutex::new(liveness::Role::Choosing),
            held: Mutex::new(BTreeSet::new()),
        });
        // The first listings before anything else: startup reconciles the
        // kernel against them. Each key class has its own watch: the
        // Kubernetes store keeps each as a kind, and a watch follows one.
        let mut revisions = Vec::new();
        for part in Part::ALL {
            let listed = control::until_answered("the first listing", || cluster.relist(part));
            revisions.push((part, listed.await?));
        }
        let mine = cluster.view().blocks_of(&cluster.me().name);
        lock(&cluster.held).extend(mine);
        // The alive keys are followed by the liveness task, as this node's
        // role says: one key, or all of them on the reaper.
        for (part, revision) in revisions.into_iter().filter(|(p, _)| *p != Part::Alive) {
            tokio::spawn(control::follow(
                cluster.store.clone(),
                part.prefix(&cluster.keys),
                revision,
                Arc::new(PartFollower {
                    cluster: cluster.clone(),
                    part,
                }),
            ));
        }
        tokio::spawn(cluster.clone().lease_loop());
        tokio::spawn(cluster.clone().liveness_loop());
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
    pub fn view(&self) -> Arc<ClusterView> {
        self.view.borrow().clone()
    }

    /// Notified on every view change.
    pub fn subscribe(&self) -> watch::Receiver<Arc<ClusterView>> {
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

    /// Lists one part of the view again and replaces it. Returns the
    /// revision it was read at.
    async fn relist(&self, part: Part) -> Result<i64> {
        let listed = self.store.list(&part.prefix(&self.keys)).await;
        let (kvs, revision) = match listed {
            Ok(l) => l,
            Err(e) => {
                let r = Err(Error::from(e));
                self.set_health(&r);
                return r.map(|()| 0);
            }
        };
        self.set_health(&Ok(()));
        let mut fresh = ClusterView::default();
        for kv in &kvs {
            put_kv(&mut fresh, &self.keys, kv);
        }
        let mut stale = lock(&self.stale);
        stale.remove(&part);
        self.view.send_modify(|v| {
            let v = Arc::make_mut(v);
            match part {
                Part::Nodes => v.nodes = fresh.nodes,
                Part::Alive => v.alive = fresh.alive,
                Part::Blocks => v.blocks = fresh.blocks,
            }
            v.revision = v.revision.max(revision).max(fresh.revision);
            v.synced = stale.is_empty();
        });
        Ok(revision)
    }
}

/// A part of the cluster view: one key class, with a watch of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Part {
    /// `nodes/`: the node records.
    Nodes,
    /// `alive/`: the nodes whose lease lives.
    Alive,
    /// `blocks/`: the blocks and their holders.
    Blocks,
}

impl Part {
    const ALL: [Part; 3] = [Part::Nodes, Part::Alive, Part::Blocks];

    fn prefix(self, keys: &Keys) -> String {
        match self {
            Part::Nodes => keys.nodes(),
            Part::Alive => keys.alives(),
            Part::Blocks => keys.all_blocks(),
        }
    }
}

/// Follows one part of the view.
struct PartFollower {
    cluster: Arc<Cluster>,
    part: Part,
}

impl Follower for PartFollower {
    fn apply(&self, events: &[Event]) {
        let keys = &self.cluster.keys;
        self.cluster.view.send_if_modified(|v| {
            let v = Arc::make_mut(v);
            let mut changed = false;
            for e in events {
                changed |= apply(v, keys, e);
            }
            changed
        });
    }

    fn mark_stale(&self) {
        lock(&self.cluster.stale).insert(self.part);
        self.cluster
            .view
            .send_modify(|v| Arc::make_mut(v).synced = false);
    }

    fn list_again(&self) -> BoxFut<'_, i64, Error> {
        Box::pin(self.cluster.relist(self.part))
    }

    fn watch_failed(&self, e: &Error) {
        self.cluster.set_unhealthy(e);
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use tether_store::control::embedded::EmbeddedStore;
    use tether_store::control::Op;

    pub(crate) fn config(name: &str) -> ClusterConfig {
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
    pub(crate) fn embedded() -> (tempfile::TempDir, Arc<dyn ControlStore>) {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let store = EmbeddedStore::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        (dir, Arc::new(store))
    }

    pub(crate) async fn join(store: &Arc<dyn ControlStore>, config: ClusterConfig) -> Arc<Cluster> {
        Cluster::join(store.clone(), config)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
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
}
