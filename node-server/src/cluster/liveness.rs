//! Liveness at a cost that does not grow with the cluster: which of the
//! other nodes' alive keys this node watches.
//!
//! Nodes are ordered by ID. Each node watches one alive key, its
//! predecessor's: that of the live node with the next lower ID. The live
//! node with the lowest ID has none; it is the reaper, and it alone watches
//! every alive key and reaps the dead (`reaper`). On the Kubernetes store,
//! where every renewal of a node's Lease is a watch event for every
//! watcher, that makes the cluster's idle watch events 2 per renewal
//! (the predecessor's successor and the reaper) instead of one per node;
//! on etcd a renewal is no event at all, and the roles only keep the two
//! stores alike.
//!
//! How the roles change:
//! - a node chooses by one listing of the alive keys: the highest lower ID
//!   among the live ones is its predecessor; with none it is the reaper;
//! - a node whose predecessor's alive key goes (it died, or was reaped)
//!   chooses again: the next live one down, or the reaper's role;
//! - a node registered since between the predecessor and this one makes
//!   it choose again (the chain closes over the newcomer); a known node
//!   that comes back alive between them changes nothing (it watches the
//!   same predecessor): the chain only decides who becomes the reaper, and
//!   the reaper watches everyone;
//! - a reaper that sees a lower ID's alive key appear (that node came
//!   back, or started) steps down and chooses again.
//!
//! What can go wrong, and why it is safe:
//! - **the reaper dies**: its successor sees its alive key go after the
//!   lease's TTL and becomes the reaper. Its grace for every dead node
//!   starts then, so a node is reaped at most one TTL later than it would
//!   have been; a node that starts (or takes over) on the Kubernetes store
//!   counts a Lease it sees for the first time as renewed then, which can
//!   add one more TTL;
//! - **two reapers at once** (a partition heals, a role changes while a
//!   reap runs): every step of a reap is a compare-and-swap, the first
//!   guarded by "the alive key is still absent" (on the Kubernetes store,
//!   "the Lease is unrenewed since it was seen"), so a second reaper's
//!   steps fail harmlessly, exactly as when every node reaped, before this;
//! - **a partition**: a node cut off from the store cannot renew its own
//!   alive key nor write a reap; the nodes on the store's side go on as if
//!   it had died (and it comes back as a reaped node does, `lease_loop`);
//!   a reaper cut off reaps nothing, and its successor, seeing its key go,
//!   takes its role;
//! - **a watch breaks**: the single key is listed again; the reaper's
//!   whole watch lists every alive key again, as before.

use super::view::ClusterView;
use super::{lock, Cluster, Part, PartFollower};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;
use tether_base::error::{Error, Result};
use tether_store::control::{self, BoxFut, Event, Follower};

/// What this node watches of the others' liveness.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// Not chosen yet (start-up, or the store did not answer).
    Choosing,
    /// Watching the alive key of this node, its predecessor.
    Watching(String),
    /// The reaper: watching every alive key.
    Reaper,
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Role::Choosing => f.write_str("choosing"),
            Role::Watching(n) => write!(f, "watching {n}"),
            Role::Reaper => f.write_str("reaper"),
        }
    }
}

/// A role as chosen, and what it was chosen from.
struct Chosen {
    role: Role,
    /// The revision of the listing it was chosen from.
    revision: i64,
    /// Every node the view held then: a node registered since, with an ID
    /// between the predecessor's and this node's, calls for a new choice.
    known: BTreeSet<String>,
}

impl Cluster {
    /// What this node watches of the others' liveness now.
    pub fn role(&self) -> Role {
        lock(&self.role).clone()
    }

    /// The nodes whose alive key exists, as the store says now (a listing;
    /// the view holds them all only on the reaper).
    pub async fn alive_now(&self) -> Result<BTreeSet<String>> {
        if self.role() == Role::Reaper {
            return Ok(self.view().alive.clone());
        }
        let prefix = self.keys.alives();
        let (kvs, _) = self.store.list(&prefix).await?;
        Ok(kvs
            .iter()
            .filter_map(|kv| kv.key.strip_prefix(&prefix).map(str::to_owned))
            .collect())
    }

    /// Keeps this node in its role (see the module doc), choosing again
    /// whenever the view says the role no longer holds.
    pub(super) async fn liveness_loop(self: Arc<Self>) {
        let mut rx = self.subscribe();
        let mut backoff = Duration::from_millis(200);
        loop {
            let chosen = match self.choose().await {
                Ok(c) => c,
                Err(e) => {
                    tracing::debug!(error = %e, "cannot list the alive keys to choose what to watch");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
            };
            backoff = Duration::from_millis(200);
            let task = match &chosen.role {
                Role::Watching(node) => tokio::spawn(control::follow(
                    self.store.clone(),
                    self.keys.alive(node),
                    chosen.revision,
                    Arc::new(OneAlive {
                        cluster: self.clone(),
                        node: node.clone(),
                    }),
                )),
                _ => {
                    // The grace of every dead node starts now: this node has
                    // not been watching them.
                    lock(&self.dead_since).clear();
                    tokio::spawn(control::follow(
                        self.store.clone(),
                        self.keys.alives(),
                        chosen.revision,
                        Arc::new(PartFollower {
                            cluster: self.clone(),
                            part: Part::Alive,
                        }),
                    ))
                }
            };
            if *lock(&self.role) != chosen.role {
                tracing::info!(role = %chosen.role, "liveness: what this node watches");
            }
            *lock(&self.role) = chosen.role.clone();
            loop {
                if rx.changed().await.is_err() {
                    task.abort();
                    return;
                }
                let view = rx.borrow_and_update().clone();
                if !self.holds(&chosen, &view) {
                    break;
                }
            }
            *lock(&self.role) = Role::Choosing;
            task.abort();
            // A broken whole watch may have marked the part stale; nobody
            // follows it now, and the view is as synced as the other parts.
            let mut stale = lock(&self.stale);
            if stale.remove(&Part::Alive) {
                self.view
                    .send_modify(|v| Arc::make_mut(v).synced = stale.is_empty());
            }
            drop(stale);
        }
    }

    /// Chooses a role from one listing of the alive keys, and puts what it
    /// found in the view: every live node for the reaper, the predecessor
    /// alone otherwise.
    async fn choose(&self) -> Result<Chosen> {
        let prefix = self.keys.alives();
        let (kvs, revision) = self.store.list(&prefix).await.map_err(Error::from)?;
        let alive: BTreeSet<String> = kvs
            .iter()
            .filter_map(|kv| kv.key.strip_prefix(&prefix).map(str::to_owned))
            .collect();
        let view = self.view();
        let me = self.me();
        let predecessor = view
            .nodes
            .values()
            .map(|(r, _)| r)
            .filter(|r| r.id < me.id && alive.contains(&r.name))
            .max_by_key(|r| r.id)
            .map(|r| r.name.clone());
        let role = match predecessor {
            Some(p) => Role::Watching(p),
            None => Role::Reaper,
        };
        let seen = match &role {
            Role::Watching(p) => BTreeSet::from([p.clone()]),
            _ => alive,
        };
        self.view.send_if_modified(|v| {
            let v = Arc::make_mut(v);
            let changed = v.alive != seen;
            v.alive = seen;
            v.revision = v.revision.max(revision);
            changed
        });
        Ok(Chosen {
            role,
            revision,
            known: view.nodes.keys().cloned().collect(),
        })
    }

    /// Whether the role `chosen` still holds in `view`.
    fn holds(&self, chosen: &Chosen, view: &ClusterView) -> bool {
        let me = self.me();
        match &chosen.role {
            Role::Watching(p) => {
                let Some((pred, _)) = view.nodes.get(p) else {
                    return false;
                };
                view.alive.contains(p)
                    && !view.nodes.values().any(|(r, _)| {
                        r.id > pred.id && r.id < me.id && !chosen.known.contains(&r.name)
                    })
            }
            Role::Reaper => !view
                .alive
                .iter()
                .any(|n| *n != me.name && view.nodes.get(n).is_some_and(|(r, _)| r.id < me.id)),
            Role::Choosing => false,
        }
    }
}

/// Follows one node's alive key (the predecessor's) into the view.
struct OneAlive {
    cluster: Arc<Cluster>,
    node: String,
}

impl OneAlive {
    fn set(&self, alive: bool) {
        self.cluster.view.send_if_modified(|v| {
            // Most events are renewals that change nothing: no copy then.
            if v.alive.contains(&self.node) == alive {
                return false;
            }
            let v = Arc::make_mut(v);
            if alive {
                v.alive.insert(self.node.clone())
            } else {
                v.alive.remove(&self.node)
            }
        });
    }
}

impl Follower for OneAlive {
    fn apply(&self, events: &[Event]) {
        let key = self.cluster.keys.alive(&self.node);
        let mut alive = None;
        for e in events {
            match e {
                Event::Put(kv) if kv.key == key => alive = Some(true),
                Event::Delete { key: k, .. } if *k == key => alive = Some(false),
                _ => {}
            }
        }
        if let Some(alive) = alive {
            self.set(alive);
        }
    }

    /// The single key is listed again next; liveness does not make the
    /// view stale for routes.
    fn mark_stale(&self) {}

    fn list_again(&self) -> BoxFut<'_, i64, Error> {
        Box::pin(async move {
            let key = self.cluster.keys.alive(&self.node);
            let (kvs, revision) = self.cluster.store.list(&key).await.map_err(Error::from)?;
            self.set(kvs.iter().any(|kv| kv.key == key));
            Ok(revision)
        })
    }

    fn watch_failed(&self, e: &Error) {
        self.cluster.set_unhealthy(e);
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{config, embedded, join};
    use super::super::view::Keys;
    use super::super::{to_json, NodeRecord};
    use super::*;
    use tether_store::control::{ControlStore, Op};

    async fn put(store: &Arc<dyn ControlStore>, key: String, value: Vec<u8>) {
        let op = Op::Put {
            key,
            value,
            lease: None,
        };
        assert!(matches!(store.txn(vec![], vec![op]).await, Ok(true)));
    }

    async fn delete(store: &Arc<dyn ControlStore>, key: String) {
        assert!(matches!(
            store.txn(vec![], vec![Op::Delete(key)]).await,
            Ok(true)
        ));
    }

    /// Node `name`, registered with `id`, alive.
    async fn registered(store: &Arc<dyn ControlStore>, keys: &Keys, name: &str, id: u32) {
        let rec = NodeRecord {
            name: name.into(),
            id,
            node_ips: vec![],
            vtep_mac: None,
        };
        put(store, keys.node_id(id), name.as_bytes().to_vec()).await;
        put(store, keys.node(name), to_json(&rec).unwrap_or_default()).await;
        put(store, keys.alive(name), b"1".to_vec()).await;
    }

    /// Waits (up to 5 s) until `c`'s role is `want`.
    async fn becomes(c: &Cluster, want: Role) {
        for _ in 0..1000 {
            if c.role() == want {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("the role is {}, not {want}", c.role());
    }

    #[tokio::test]
    async fn a_node_watches_the_next_live_id_below_it_and_without_one_reaps() {
        let (_dir, store) = embedded();
        let keys = Keys::new("/tether");
        registered(&store, &keys, "n1", 1).await;
        registered(&store, &keys, "n2", 2).await;
        let me = join(&store, config("me")).await;
        assert_eq!(me.me().id, 3);
        becomes(&me, Role::Watching("n2".into())).await;
        assert_eq!(me.view().alive, BTreeSet::from(["n2".to_owned()]));
        // Only the reaper reaps: n1 and n2 are not in this node's care.

        // n2 dies: the next live one down.
        delete(&store, keys.alive("n2")).await;
        becomes(&me, Role::Watching("n1".into())).await;
        // n1 dies: none is left below; this node watches every alive key.
        delete(&store, keys.alive("n1")).await;
        becomes(&me, Role::Reaper).await;
        assert_eq!(me.view().alive, BTreeSet::from(["me".to_owned()]));
        assert_eq!(
            me.alive_now().await.unwrap_or_default(),
            BTreeSet::from(["me".to_owned()])
        );

        // n2 comes back: the reaper sees it (it watches every key) and
        // steps down to watch it.
        put(&store, keys.alive("n2"), b"1".to_vec()).await;
        becomes(&me, Role::Watching("n2".into())).await;
        // A node registered below the predecessor changes nothing (a new
        // "n0" takes n1's ID once n1 is gone).
        delete(&store, keys.node("n1")).await;
        delete(&store, keys.node_id(1)).await;
        registered(&store, &keys, "n0", 1).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(me.role(), Role::Watching("n2".into()));
        assert_eq!(
            me.alive_now().await.unwrap_or_default(),
            BTreeSet::from(["me".to_owned(), "n0".to_owned(), "n2".to_owned()]),
            "a node that is not the reaper lists the alive keys for the admin API"
        );
    }

    #[tokio::test]
    async fn two_nodes_make_one_reaper_and_a_newcomer_between_is_watched() {
        let (_dir, store) = embedded();
        let keys = Keys::new("/tether");
        let a = join(&store, config("a")).await;
        // "b" takes ID 3, leaving 2 free for a newcomer between.
        put(&store, keys.node_id(2), b"held".to_vec()).await;
        let b = join(&store, config("b")).await;
        assert_eq!((a.me().id, b.me().id), (1, 3));
        becomes(&a, Role::Reaper).await;
        becomes(&b, Role::Watching("a".into())).await;
        // The reaper's view holds every live node; b's only a.
        for _ in 0..1000 {
            if a.view().alive.len() == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(
            a.view().alive,
            BTreeSet::from(["a".to_owned(), "b".to_owned()])
        );
        assert_eq!(b.view().alive, BTreeSet::from(["a".to_owned()]));

        // A newcomer with ID 2, between a and b: b watches it.
        delete(&store, keys.node_id(2)).await;
        registered(&store, &keys, "c", 2).await;
        becomes(&b, Role::Watching("c".into())).await;
        assert_eq!(a.role(), Role::Reaper);
    }
}
