//! The control plane's storage: a small key-value interface with
//! compare-and-swap transactions, leases and watches, and its backends.
//!
//! Cluster state (node records, node IDs, address blocks, pool blocks, VM
//! address records) is written through this trait only, so the logic that
//! keeps it consistent (tetherd's `cluster`, `pools` and `vm`) is written
//! once and runs unchanged on every backend:
//! - `embedded`: one node, in the state dir. The default, with nothing to
//!   run beside the daemon.
//! - `etcd`: a cluster of nodes sharing one etcd.
//! - `kubernetes`: a cluster of nodes sharing the Kubernetes API: each key
//!   class is a kind of tether's CRDs, a lease a `coordination.k8s.io`
//!   Lease.
//!
//! Every transaction concerns one key ([`one_key`]): the Kubernetes API
//! has no transaction across objects, so none of the callers relies on
//! one, on any backend. Where a change spans several keys (a node's ID and
//! record, a VM record and the keys that index its addresses, a dead
//! node's records), the callers write them one at a time, in an order in
//! which every prefix is safe, and recover what a crash in the middle
//! leaves.
//!
//! A pod's attachment record is not here: it stays in the node's local
//! journal ([`crate::store`]), so an ordinary ADD never waits on a network
//! round-trip.

pub mod embedded;
pub mod etcd;
pub mod kubernetes;

use std::fmt;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tether_base::error::{chain, Error};
use tokio::sync::mpsc;

/// A boxed future, so that the trait can be used as `dyn ControlStore`.
pub type BoxFut<'a, T, E = ControlError> = Pin<Box<dyn Future<Output = Result<T, E>> + Send + 'a>>;

/// What went wrong in a control-plane backend. It says what happened;
/// which CNI code that is, is decided once, by `From<ControlError>` for
/// [`Error`].
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// No etcd member answered a call: each refused, failed or did not
    /// answer within the request timeout. Transient: the caller may retry.
    #[error("etcd did not {doing}")]
    Unavailable {
        /// What the call was for, e.g. "commit a transaction".
        doing: String,
        /// What each member answered.
        #[source]
        cause: MemberFailures,
    },
    /// The etcd client could not be set up for the endpoints.
    #[error("cannot reach etcd at {endpoints}")]
    Connect {
        /// The endpoints, comma-separated.
        endpoints: String,
        /// The client's error.
        #[source]
        cause: etcd_client::Error,
    },
    /// The etcd options are incomplete or contradictory.
    #[error("{0}")]
    Misconfigured(&'static str),
    /// A TLS file named by the etcd options cannot be read.
    #[error("reading the etcd {what} {}", path.display())]
    TlsFile {
        /// Which file, e.g. "CA bundle".
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// Why it cannot be read.
        #[source]
        cause: std::io::Error,
    },
    /// Reading or writing the embedded backend's file failed.
    #[error("{context} {}", path.display())]
    Io {
        /// What was being done, e.g. "writing".
        context: &'static str,
        /// The file.
        path: PathBuf,
        /// The system's answer.
        #[source]
        cause: std::io::Error,
    },
    /// The embedded backend's file does not decode.
    #[error("decoding {}", path.display())]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// The decoder's complaint.
        #[source]
        cause: serde_json::Error,
    },
    /// The embedded backend's state could not be encoded.
    #[error("encoding the control-plane state")]
    Encode(#[source] serde_json::Error),
    /// A value to store is not UTF-8 (the embedded backend keeps text).
    #[error("non-UTF-8 value for {key}")]
    NotUtf8 {
        /// The key it was to be stored under.
        key: String,
        /// Where the bytes stop being UTF-8.
        #[source]
        cause: std::string::FromUtf8Error,
    },
    /// A transaction named more than one key (or none): a bug of the
    /// caller, refused by every backend alike.
    #[error("a control-plane transaction must concern one key: {0}")]
    NotOneKey(String),
    /// The Kubernetes API did not answer a call: it timed out, the
    /// connection failed, or the server said it cannot now (429, 5xx).
    /// Transient: the caller may retry.
    #[error("the Kubernetes API at {server} did not {doing}: {cause}")]
    ApiUnavailable {
        /// What the call was for, e.g. "create tethernodes/a".
        doing: String,
        /// The API server's URL.
        server: String,
        /// What went wrong.
        cause: String,
    },
    /// The Kubernetes API refused a call for good (403: RBAC; 404 of a
    /// resource: its CRD is not installed; 422: the object does not pass
    /// the CRD's validation).
    #[error("the Kubernetes API refused to {doing}: {code} {reason}: {message}")]
    ApiRefused {
        /// What the call was for.
        doing: String,
        /// The HTTP status.
        code: u16,
        /// The status reason, e.g. "Forbidden".
        reason: String,
        /// The server's message.
        message: String,
    },
    /// A key that names no object the Kubernetes store keeps, or an
    /// object that does not make a key and a value.
    #[error("{0}")]
    Unmapped(String),
}

impl ControlError {
    /// Whether the store may answer if asked again: nobody answered (etcd
    /// or the API server), as opposed to a refusal or a local failure.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            ControlError::Unavailable { .. } | ControlError::ApiUnavailable { .. }
        )
    }
}

/// What each etcd member answered to one call (or that it did not answer),
/// in the order they were tried: the cause of [`ControlError::Unavailable`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberFailures(pub Vec<(String, String)>);

impl fmt::Display for MemberFailures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (endpoint, why)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{endpoint}: {why}")?;
        }
        Ok(())
    }
}

impl std::error::Error for MemberFailures {}

/// One stored key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kv {
    /// The full key, prefix included.
    pub key: String,
    /// The value (JSON for every record tether writes).
    pub value: Vec<u8>,
    /// The store revision of the key's last change; the token of a
    /// compare-and-swap.
    pub mod_revision: i64,
    /// The lease the key is attached to, 0 for none.
    pub lease: i64,
}

/// A condition of a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cmp {
    /// The key does not exist.
    Absent(String),
    /// The key exists and was last changed at this revision.
    Unchanged(String, i64),
}

/// A change of a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Sets the key; with a lease, the key is deleted when the lease expires.
    Put {
        key: String,
        value: Vec<u8>,
        lease: Option<i64>,
    },
    /// Deletes the key (no error if it is absent).
    Delete(String),
}

/// A change seen by a watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The key was created or changed.
    Put(Kv),
    /// The key was deleted (or its lease expired).
    Delete { key: String, mod_revision: i64 },
}

/// What a watch delivers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchMessage {
    /// Changes at one revision, in order.
    Events(Vec<Event>),
    /// The watch broke (the store went away, or the history it needed was
    /// compacted). The watcher must list again and watch from there.
    Broken(String),
}

/// Watch events this process received, on every watch of every backend.
static WATCH_EVENTS: AtomicU64 = AtomicU64::new(0);

/// The watch events this process has received since it started, as its
/// store's server sent them: etcd's events; the API server's ADDED,
/// MODIFIED and DELETED of tether's objects and of the nodes' Leases (a
/// Lease renewal is one, although it changes no alive key); the embedded
/// store's changes. A scale run's measure of what the cluster's size
/// costs each node.
pub fn watch_events_received() -> u64 {
    WATCH_EVENTS.load(Ordering::Relaxed)
}

/// Counts `n` watch events received.
pub(crate) fn received(n: usize) {
    WATCH_EVENTS.fetch_add(n as u64, Ordering::Relaxed);
}

/// The one key a transaction concerns: every condition and every change
/// must name it (the Kubernetes API changes one object at a time, so no
/// caller may depend on more; every backend refuses more, so that a caller
/// that tried would fail its unit tests on the embedded store already).
pub fn one_key<'a>(when: &'a [Cmp], ops: &'a [Op]) -> Result<&'a str, ControlError> {
    let mut keys = when
        .iter()
        .map(|c| match c {
            Cmp::Absent(k) | Cmp::Unchanged(k, _) => k.as_str(),
        })
        .chain(ops.iter().map(|o| match o {
            Op::Put { key, .. } => key.as_str(),
            Op::Delete(k) => k.as_str(),
        }));
    let Some(first) = keys.next() else {
        return Err(ControlError::NotOneKey("it names none".into()));
    };
    if let Some(other) = keys.find(|k| *k != first) {
        return Err(ControlError::NotOneKey(format!(
            "it names {first} and {other}"
        )));
    }
    if ops.len() > 1 {
        return Err(ControlError::NotOneKey(format!(
            "it changes {first} {} times",
            ops.len()
        )));
    }
    Ok(first)
}

/// The control plane's storage. Every call is bounded by the backend's
/// request timeout, so a store that does not answer fails the call instead
/// of hanging it (with an error for which
/// [`ControlError::is_transient`] holds).
pub trait ControlStore: Send + Sync + 'static {
    /// The backend's name as shown to operators ("embedded", "etcd").
    fn backend(&self) -> &'static str;
    /// Where the data lives (a path, or the endpoints).
    fn location(&self) -> String;
    /// Every key under `prefix`, and the store revision they were read at.
    fn list(&self, prefix: &str) -> BoxFut<'_, (Vec<Kv>, i64)>;
    /// Applies `ops` atomically if every condition holds. Returns the store
    /// revision of the commit when it did, `None` when a condition failed.
    /// The conditions and the change concern one key ([`one_key`]); a key
    /// attached to a lease exists while its lease lives, so `Absent` holds
    /// of it once the lease expired (and a `Delete` then removes what is
    /// left of it).
    /// An error means the outcome is unknown: the caller reads the keys
    /// again to find out. The revision lets a caller tell when a watch has
    /// caught up with its own change.
    fn commit(&self, when: Vec<Cmp>, ops: Vec<Op>) -> BoxFut<'_, Option<i64>>;
    /// [`ControlStore::commit`], when only success matters.
    fn txn(&self, when: Vec<Cmp>, ops: Vec<Op>) -> BoxFut<'_, bool> {
        Box::pin(async move { Ok(self.commit(when, ops).await?.is_some()) })
    }
    /// Changes under `prefix` after revision `after`, in order, until the
    /// receiver is dropped or a [`WatchMessage::Broken`] is sent.
    fn watch(&self, prefix: &str, after: i64) -> BoxFut<'_, mpsc::Receiver<WatchMessage>>;
    /// Grants a lease of `ttl_secs`.
    fn grant_lease(&self, ttl_secs: i64) -> BoxFut<'_, i64>;
    /// Renews a lease once. False when the lease no longer exists (it
    /// expired while we could not reach the store).
    fn keep_alive(&self, lease: i64) -> BoxFut<'_, bool>;
    /// A cheap read that needs the store to be able to commit (for etcd, a
    /// quorum), for health reporting.
    fn probe(&self) -> BoxFut<'_, ()>;
}

/// The root of tether's version-1 keys under the configured prefix:
/// "/tether" → "/tether/v1/".
pub fn v1_root(prefix: &str) -> String {
    format!("{}/v1/", prefix.trim_end_matches('/'))
}

/// Keeps a view of a prefix current: [`follow`] feeds it the watch's
/// changes and has it list again whenever the watch breaks.
pub trait Follower: Send + Sync + 'static {
    /// Applies one batch of changes (one store revision) to the view.
    fn apply(&self, events: &[Event]);
    /// Marks the view stale: the watch broke, a listing comes next.
    fn mark_stale(&self);
    /// Lists the prefix again and replaces the view; returns the revision
    /// it was read at.
    fn list_again(&self) -> BoxFut<'_, i64, Error>;
    /// The watch could not be opened.
    fn watch_failed(&self, e: &Error) {
        tracing::debug!(error = %e, "cannot watch the control plane");
    }
}

/// Runs `call` until the control store answers it: while it fails with
/// [`Error::TryAgain`] (no answer in time, no member reachable), waits
/// 200 ms doubling to 5 s and calls again, saying so; any other error is
/// returned. For what a daemon must have before it serves (its
/// registration, the first listings): a slow or absent store makes it
/// wait, not exit.
pub async fn until_answered<T, F, Fut>(what: &str, mut call: F) -> Result<T, Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Error>>,
{
    let mut delay = Duration::from_millis(200);
    loop {
        match call().await {
            Err(e @ Error::TryAgain(_)) => {
                tracing::warn!(error = %e, "the control plane did not answer {what}; retrying in {delay:?}");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
            done => return done,
        }
    }
}

/// Follows `prefix` from `revision` forever: every change goes to
/// `follower`; when the watch breaks (a member died, history was
/// compacted), the view is marked stale and listed again, with a backoff
/// of 100 ms doubling to 2 s while the store does not answer.
pub async fn follow(
    store: Arc<dyn ControlStore>,
    prefix: String,
    mut revision: i64,
    follower: Arc<impl Follower>,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        match store.watch(&prefix, revision).await {
            Ok(mut rx) => {
                while let Some(message) = rx.recv().await {
                    let (events, broken) = match message {
                        WatchMessage::Events(events) => with_ready(events, &mut rx),
                        WatchMessage::Broken(why) => (Vec::new(), Some(why)),
                    };
                    if !events.is_empty() {
                        backoff = Duration::from_millis(100);
                        follower.apply(&events);
                    }
                    if let Some(why) = broken {
                        tracing::warn!(%prefix, %why, "control-plane watch broke; listing again");
                        break;
                    }
                }
            }
            Err(e) => follower.watch_failed(&e.into()),
        }
        follower.mark_stale();
        loop {
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
            match follower.list_again().await {
                Ok(r) => {
                    revision = r;
                    break;
                }
                Err(e) => tracing::debug!(%prefix, error = %e, "cannot list the control plane"),
            }
        }
    }
}

/// `events`, and after them those of every message already waiting in
/// `rx`, in order, so that the follower applies a burst as one change
/// (one view update, one route pass on each node) instead of one per
/// event: the Kubernetes store's watch sends each object's event alone.
/// Stops at a [`WatchMessage::Broken`], whose reason it returns.
fn with_ready(
    mut events: Vec<Event>,
    rx: &mut mpsc::Receiver<WatchMessage>,
) -> (Vec<Event>, Option<String>) {
    while let Ok(message) = rx.try_recv() {
        match message {
            WatchMessage::Events(more) => events.extend(more),
            WatchMessage::Broken(why) => return (events, Some(why)),
        }
    }
    (events, None)
}

/// Which error, and so which CNI code, each control-plane failure is.
impl From<ControlError> for Error {
    fn from(e: ControlError) -> Self {
        let text = chain(&e);
        match e {
            // etcd or the API server did not answer: the runtime should
            // retry (11).
            ControlError::Unavailable { .. }
            | ControlError::Connect { .. }
            | ControlError::ApiUnavailable { .. } => Error::TryAgain(text),
            // The API server refused: RBAC, a missing CRD, validation (104,
            // the control plane refused).
            ControlError::ApiRefused { .. } => Error::Store(text),
            // The operator's etcd options (7).
            ControlError::Misconfigured(_) | ControlError::TlsFile { .. } => {
                Error::InvalidConfig(text)
            }
            // The embedded backend's file (104).
            ControlError::Io { .. } | ControlError::Corrupt { .. } => Error::Store(text),
            // Values and requests tetherd itself produced (199).
            ControlError::Encode(_)
            | ControlError::NotUtf8 { .. }
            | ControlError::NotOneKey(_)
            | ControlError::Unmapped(_) => Error::Internal(text),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn put(key: &str, rev: i64) -> Event {
        Event::Put(Kv {
            key: key.into(),
            value: Vec::new(),
            mod_revision: rev,
            lease: 0,
        })
    }

    /// A burst already waiting is applied as one change, in order, up to a
    /// broken watch; what comes after the break is left for the relist.
    #[test]
    fn waiting_events_are_applied_together_up_to_a_break() {
        let (tx, mut rx) = mpsc::channel(8);
        for (key, rev) in [("b", 2), ("c", 3)] {
            tx.try_send(WatchMessage::Events(vec![put(key, rev)]))
                .expect("room");
        }
        let (events, broken) = with_ready(vec![put("a", 1)], &mut rx);
        assert_eq!(events, vec![put("a", 1), put("b", 2), put("c", 3)]);
        assert_eq!(broken, None);

        for m in [
            WatchMessage::Events(vec![put("d", 4)]),
            WatchMessage::Broken("gone".into()),
            WatchMessage::Events(vec![put("e", 5)]),
        ] {
            tx.try_send(m).expect("room");
        }
        let (events, broken) = with_ready(Vec::new(), &mut rx);
        assert_eq!(events, vec![put("d", 4)]);
        assert_eq!(broken.as_deref(), Some("gone"));
    }

    #[tokio::test]
    async fn until_answered_waits_out_unanswered_calls_and_returns_other_errors() {
        let calls = AtomicUsize::new(0);
        let answered = until_answered("a listing", || {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            async move {
                match n {
                    0 | 1 => Err(Error::TryAgain("no answer within 2000 ms".into())),
                    _ => Ok(n),
                }
            }
        })
        .await;
        assert_eq!(answered.ok(), Some(2), "answered on the third call");

        let calls = AtomicUsize::new(0);
        let refused: Result<(), Error> = until_answered("a listing", || {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Err(Error::Internal("forbidden".into())) }
        })
        .await;
        assert!(matches!(refused, Err(Error::Internal(_))));
        assert_eq!(calls.load(Ordering::SeqCst), 1, "not retried");
    }
}
