//! The `tether.cni.v1.Cni` gRPC service: the daemon's edge for CNI calls.
//!
//! Each RPC parses the forwarded invocation into a typed [`Invocation`]
//! (all validation lives in [`tether_cni`]), runs it on the [`Node`], and
//! answers with the result bytes or the CNI error object. gRPC-level errors
//! are never used for CNI failures, so the shim can tell "the daemon said no"
//! from "the daemon is unreachable".

use crate::api::pending_del;
use crate::attach::Node;
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tether_base::error::{Error, Result};
use tether_base::time::UnixNanos;
use tether_cni::{Command, Invocation, NetConf, UnknownKey};
use tether_proto::cni::v1::{cni_response::Outcome, cni_server, CniRequest, CniResponse};
use tonic::{Request, Response, Status};

/// The verbs in counter order.
pub const VERBS: [Command; 5] = [
    Command::Add,
    Command::Del,
    Command::Check,
    Command::Status,
    Command::Gc,
];

fn verb_index(c: Command) -> usize {
    match c {
        Command::Add => 0,
        Command::Del => 1,
        Command::Check => 2,
        Command::Status => 3,
        Command::Gc => 4,
    }
}

/// The name of a verb as in CNI_COMMAND.
pub fn verb_name(c: Command) -> &'static str {
    match c {
        Command::Add => "ADD",
        Command::Del => "DEL",
        Command::Check => "CHECK",
        Command::Status => "STATUS",
        Command::Gc => "GC",
    }
}

/// Request counters since start.
#[derive(Debug)]
pub struct Stats {
    ok: [AtomicU64; 5],
    errors: [AtomicU64; 5],
    /// Queued DELs replayed since start.
    pub pending_del_processed: AtomicU64,
    /// When serving started.
    pub started: Instant,
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            ok: Default::default(),
            errors: Default::default(),
            pending_del_processed: AtomicU64::new(0),
            started: Instant::now(),
        }
    }
}

impl Stats {
    fn record(&self, verb: Command, ok: bool) {
        let slot = if ok { &self.ok } else { &self.errors };
        slot[verb_index(verb)].fetch_add(1, Ordering::Relaxed);
    }

    /// (ok, errors) of a verb.
    pub fn counts(&self, verb: Command) -> (u64, u64) {
        let i = verb_index(verb);
        (
            self.ok[i].load(Ordering::Relaxed),
            self.errors[i].load(Ordering::Relaxed),
        )
    }
}

/// How many (network, key) pairs [`KeyWarnings`] remembers: far more than
/// real netconfs hold, few enough that a caller sending ever new keys
/// cannot grow the daemon without end (past it, nothing more is warned).
const MAX_KEY_WARNINGS: usize = 1024;

/// The unknown netconf keys already warned about: each once per network,
/// not on every call of a runtime that sends the same netconf each time.
#[derive(Debug, Default)]
pub struct KeyWarnings(Mutex<HashSet<(String, String)>>);

impl KeyWarnings {
    /// The unknown keys of `conf` not yet warned about for its network,
    /// now remembered as warned.
    pub fn first_seen<'a>(&self, conf: &'a NetConf) -> Vec<&'a UnknownKey> {
        if conf.unknown_keys.is_empty() {
            return Vec::new();
        }
        let mut seen = self.0.lock().unwrap_or_else(|p| p.into_inner());
        conf.unknown_keys
            .iter()
            .filter(|k| {
                seen.len() < MAX_KEY_WARNINGS && seen.insert((conf.name.clone(), k.key.clone()))
            })
            .collect()
    }

    /// Logs the unknown keys of `conf` that were not logged before.
    fn warn(&self, conf: &NetConf) {
        let new = self.first_seen(conf);
        if new.is_empty() {
            return;
        }
        let keys: Vec<String> = new.iter().map(|k| k.to_string()).collect();
        tracing::warn!(
            network = %conf.name,
            "netconf keys tether does not know, ignored: {} (said once per network)",
            keys.join(", ")
        );
    }
}

/// The CNI service.
pub struct CniService {
    node: Arc<Node>,
    stats: Arc<Stats>,
    key_warnings: KeyWarnings,
}

impl CniService {
    /// A service over the node.
    pub fn new(node: Arc<Node>, stats: Arc<Stats>) -> Self {
        CniService {
            node,
            stats,
            key_warnings: KeyWarnings::default(),
        }
    }

    async fn run(&self, rpc: Command, req: CniRequest) -> CniResponse {
        let parsed = tether_cni::parse_request(&req).and_then(|inv| {
            if inv.command == rpc {
                Ok(inv)
            } else {
                Err(Error::InvalidEnv {
                    var: "CNI_COMMAND",
                    reason: format!("{:?} sent to the {} method", req.command, verb_name(rpc)),
                })
            }
        });
        if let Ok(inv) = &parsed {
            self.key_warnings.warn(&inv.conf);
        }
        let version = match &parsed {
            Ok(inv) => inv.conf.cni_version.as_str().to_string(),
            Err(_) => tether_cni::error_version(&req.stdin),
        };
        // The verb runs in a task of its own, which this call only waits
        // for. A runtime that gives up on a call kills the plugin
        // (containerd does when the kubelet's call is cancelled), and the
        // server then drops the call's future: a verb dropped at an await
        // would leave half an attachment (its address taken, its record
        // written, no entry for the runtime's DEL to find). In its task it
        // finishes, or undoes itself as a failed ADD does, and the DEL
        // that follows finds a whole attachment or none.
        let node = Arc::clone(&self.node);
        let stats = Arc::clone(&self.stats);
        let verb = tokio::spawn(async move {
            let in_flight = crate::metrics::get().cni_started(verb_name(rpc));
            let outcome = match parsed {
                Ok(inv) => dispatch(&node, &inv, None).await,
                Err(e) => Err(e),
            };
            in_flight.finish(outcome.as_ref().map_or_else(|e| e.code(), |_| 0));
            stats.record(rpc, outcome.is_ok());
            outcome
        });
        let outcome = verb.await.unwrap_or_else(|e| {
            Err(Error::Internal(format!(
                "the {} task ended without an answer: {e}",
                verb_name(rpc)
            )))
        });
        let outcome = match outcome {
            Ok(bytes) => Outcome::Result(bytes),
            Err(e) => {
                tracing::info!(
                    verb = verb_name(rpc),
                    container = %req.container_id,
                    ifname = %req.ifname,
                    code = e.code(),
                    error = %e,
                    "request failed"
                );
                Outcome::Error(tether_cni::error_to_proto(&version, &e))
            }
        };
        CniResponse {
            outcome: Some(outcome),
        }
    }
}

async fn dispatch(node: &Node, inv: &Invocation, queued_at: Option<UnixNanos>) -> Result<Vec<u8>> {
    match inv.command {
        Command::Add => node.add(inv).await,
        Command::Del => node.del(inv, queued_at).await,
        Command::Check => node.check(inv).await,
        Command::Status => node.status().await,
        Command::Gc => node.gc(inv).await,
    }
}

#[tonic::async_trait]
impl cni_server::Cni for CniService {
    async fn add(&self, r: Request<CniRequest>) -> Result<Response<CniResponse>, Status> {
        Ok(Response::new(self.run(Command::Add, r.into_inner()).await))
    }
    async fn del(&self, r: Request<CniRequest>) -> Result<Response<CniResponse>, Status> {
        Ok(Response::new(self.run(Command::Del, r.into_inner()).await))
    }
    async fn check(&self, r: Request<CniRequest>) -> Result<Response<CniResponse>, Status> {
        Ok(Response::new(
            self.run(Command::Check, r.into_inner()).await,
        ))
    }
    async fn status(&self, r: Request<CniRequest>) -> Result<Response<CniResponse>, Status> {
        Ok(Response::new(
            self.run(Command::Status, r.into_inner()).await,
        ))
    }
    async fn gc(&self, r: Request<CniRequest>) -> Result<Response<CniResponse>, Status> {
        Ok(Response::new(self.run(Command::Gc, r.into_inner()).await))
    }
}

/// Replays the shim's pending-DEL queue through the normal DEL path. An entry
/// is removed once its DEL succeeded; a DEL that fails stays queued for the
/// next pass; an unreadable or invalid entry, or one written by a uid that
/// may not use the daemon, is set aside in `bad/`.
/// Returns the number of entries processed.
pub async fn drain_pending_dels(node: &Node, stats: &Stats) -> u64 {
    let state_dir = node.config().state_dir.clone();
    let (entries, bad) = pending_del::read_queue(&state_dir, &node.config().allowed_uids);
    for b in &bad {
        tracing::warn!(path = %b.path.display(), reason = %b.reason, "unreadable pending DEL set aside");
        if let Err(e) = pending_del::quarantine(b) {
            tracing::error!(path = %b.path.display(), error = %e, "cannot set pending DEL aside");
        }
    }
    let mut processed = 0;
    for (path, queued) in entries {
        let outcome = match tether_cni::parse_request(&queued.to_request()) {
            Ok(inv) => {
                let queued_at = UnixNanos::from_nanos_u128(queued.queued_at_unix_nanos);
                dispatch(node, &inv, Some(queued_at)).await
            }
            Err(e) => {
                // Invalid forever: replaying it again cannot succeed.
                let entry = pending_del::BadEntry {
                    path: path.clone(),
                    reason: e.to_string(),
                };
                tracing::warn!(path = %path.display(), error = %e, "invalid pending DEL set aside");
                if let Err(e) = pending_del::quarantine(&entry) {
                    tracing::error!(path = %path.display(), error = %e, "cannot set pending DEL aside");
                }
                continue;
            }
        };
        match outcome {
            Ok(_) => {
                if let Err(e) = std::fs::remove_file(&path) {
                    tracing::error!(path = %path.display(), error = %e, "cannot remove replayed pending DEL");
                }
                processed += 1;
                stats.pending_del_processed.fetch_add(1, Ordering::Relaxed);
                crate::metrics::get().pending_del_replayed();
                stats.record(Command::Del, true);
                tracing::info!(container = %queued.container_id, ifname = %queued.ifname, "replayed pending DEL");
            }
            Err(e) => {
                stats.record(Command::Del, false);
                tracing::warn!(path = %path.display(), error = %e, "pending DEL failed; kept for the next pass");
            }
        }
    }
    processed
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_cni::CniVersion;

    fn conf(json: serde_json::Value) -> NetConf {
        let serde_json::Value::Object(obj) = json else {
            unreachable!("an object")
        };
        NetConf::parse(&obj, CniVersion::V1_1_0).unwrap_or_else(|e| panic!("{e}"))
    }

    fn keys(found: Vec<&UnknownKey>) -> Vec<String> {
        found.iter().map(|k| k.to_string()).collect()
    }

    #[test]
    fn an_unknown_key_is_warned_once_per_network() {
        let w = KeyWarnings::default();
        let net1 = conf(serde_json::json!({
            "cniVersion": "1.1.0", "name": "net1", "type": "tether", "mut": 1400
        }));
        assert_eq!(keys(w.first_seen(&net1)), [r#""mut" (did you mean mtu?)"#]);
        // The same netconf again, as a runtime sends it on every call.
        assert!(w.first_seen(&net1).is_empty());
        // Another network with the same typo is told too.
        let net2 = conf(serde_json::json!({
            "cniVersion": "1.1.0", "name": "net2", "type": "tether", "mut": 1400, "sokcet": "/x"
        }));
        assert_eq!(
            keys(w.first_seen(&net2)),
            [
                r#""mut" (did you mean mtu?)"#,
                r#""sokcet" (did you mean socket?)"#
            ]
        );
        // A new typo on a network already warned about is told.
        let net1b = conf(serde_json::json!({
            "cniVersion": "1.1.0", "name": "net1", "type": "tether", "mut": 1400, "dsn": {}
        }));
        assert_eq!(keys(w.first_seen(&net1b)), [r#""dsn" (did you mean dns?)"#]);
    }

    #[test]
    fn the_warned_keys_are_bounded() {
        let w = KeyWarnings::default();
        for i in 0..MAX_KEY_WARNINGS + 10 {
            let c = conf(serde_json::json!({
                "cniVersion": "1.1.0", "name": format!("n{i}"), "type": "tether", "k": 1
            }));
            let new = w.first_seen(&c);
            assert_eq!(new.len(), usize::from(i < MAX_KEY_WARNINGS), "{i}");
        }
    }
}
