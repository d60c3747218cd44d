//! The cluster view: every node and block, kept by applying the control
//! store's events, and the keys they live under.

use super::{BlockRecord, NodeRecord};
use ipnet::IpNet;
use std::collections::{BTreeMap, BTreeSet};
use tether_ipam::Family;
use tether_store::control::{self, Event, Kv};
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

pub(super) struct Keys {
    pub(super) root: String,
}

/// The kind of a key, parsed from its path.
pub(super) enum KeyKind {
    Node(String),
    Alive(String),
    Block,
    NodeId,
}

pub(super) fn family_tag(f: Family) -> &'static str {
    match f {
        Family::V4 => "v4",
        Family::V6 => "v6",
    }
}

/// Applies one listing or event to a view. Returns false for keys the view
/// does not follow (VM records have their own watch), so that their
/// changes do not wake the route manager.
pub(super) fn apply(view: &mut ClusterView, keys: &Keys, event: &Event) -> bool {
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

pub(super) fn put_kv(view: &mut ClusterView, keys: &Keys, kv: &Kv) {
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

impl Keys {
    pub(super) fn new(prefix: &str) -> Keys {
        Keys {
            root: control::v1_root(prefix),
        }
    }
    pub(super) fn node(&self, name: &str) -> String {
        format!("{}{name}", self.nodes())
    }
    pub(super) fn node_id(&self, id: u32) -> String {
        format!("{}{id}", self.node_ids())
    }
    pub(super) fn node_ids(&self) -> String {
        format!("{}nodeids/", self.root)
    }
    pub(super) fn nodes(&self) -> String {
        format!("{}nodes/", self.root)
    }
    pub(super) fn alives(&self) -> String {
        format!("{}alive/", self.root)
    }
    pub(super) fn all_blocks(&self) -> String {
        format!("{}blocks/", self.root)
    }
    pub(super) fn alive(&self, name: &str) -> String {
        format!("{}{name}", self.alives())
    }
    pub(super) fn blocks(&self, family: Family) -> String {
        format!("{}blocks/{}/", self.root, family_tag(family))
    }
    pub(super) fn block(&self, cidr: &IpNet) -> String {
        format!(
            "{}{}-{}",
            self.blocks(Family::of(cidr)),
            cidr.network(),
            cidr.prefix_len()
        )
    }
    pub(super) fn kind(&self, key: &str) -> Option<KeyKind> {
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
