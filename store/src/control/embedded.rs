//! The `embedded` control-plane backend: one node, no server to run.
//!
//! The keys live in memory and in `control-plane.json` under the state dir,
//! rewritten (temporary file, fsync, rename) on every committed transaction.
//! Control-plane writes are rare (registration, a block claim), so a whole
//! rewrite is cheap and keeps the format trivially inspectable.
//!
//! Leases only live as long as the process: keys attached to a lease are
//! not written to the file, just as etcd drops them when the lease that
//! held them expires.

use super::{BoxFut, Cmp, ControlError, ControlStore, Event, Kv, Op, WatchMessage};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use tokio::sync::mpsc;

const FILE: &str = "control-plane.json";

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Entry {
    value: String,
    mod_revision: i64,
    #[serde(skip)]
    lease: i64,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct State {
    revision: i64,
    keys: BTreeMap<String, Entry>,
    #[serde(skip)]
    next_lease: i64,
    #[serde(skip)]
    watchers: Vec<(String, mpsc::Sender<WatchMessage>)>,
}

/// The embedded backend.
pub struct EmbeddedStore {
    dir: PathBuf,
    state: Mutex<State>,
}

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl EmbeddedStore {
    /// Opens (or creates) the control-plane file under `dir`.
    pub fn open(dir: &Path) -> Result<Self, ControlError> {
        let path = dir.join(FILE);
        let state = match std::fs::read(&path) {
            Ok(bytes) => match serde_json::from_slice::<State>(&bytes) {
                Ok(state) => state,
                Err(cause) => return Err(ControlError::Corrupt { path, cause }),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => State::default(),
            Err(cause) => {
                return Err(ControlError::Io {
                    context: "reading",
                    path,
                    cause,
                })
            }
        };
        Ok(EmbeddedStore {
            dir: dir.to_owned(),
            state: Mutex::new(state),
        })
    }

    fn persist(&self, state: &State) -> Result<(), ControlError> {
        let durable = State {
            revision: state.revision,
            keys: state
                .keys
                .iter()
                .filter(|(_, e)| e.lease == 0)
                .map(|(k, e)| (k.clone(), e.clone()))
                .collect(),
            ..Default::default()
        };
        let bytes = serde_json::to_vec_pretty(&durable).map_err(ControlError::Encode)?;
        let path = self.dir.join(FILE);
        let tmp = self.dir.join(format!(".{FILE}.tmp"));
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)?;
            crate::store::sync_dir(&self.dir)
        };
        write().map_err(|cause| ControlError::Io {
            context: "writing",
            path,
            cause,
        })
    }

    fn apply(&self, when: Vec<Cmp>, ops: Vec<Op>) -> Result<Option<i64>, ControlError> {
        super::one_key(&when, &ops)?;
        let mut state = lock(&self.state);
        let holds = when.iter().all(|c| match c {
            Cmp::Absent(k) => !state.keys.contains_key(k),
            Cmp::Unchanged(k, r) => state.keys.get(k).is_some_and(|e| e.mod_revision == *r),
        });
        if !holds {
            return Ok(None);
        }
        let before = (state.revision, state.keys.clone());
        state.revision += 1;
        let revision = state.revision;
        let mut events = Vec::new();
        for op in ops {
            match op {
                Op::Put { key, value, lease } => {
                    let value = match String::from_utf8(value) {
                        Ok(v) => v,
                        Err(cause) => return Err(ControlError::NotUtf8 { key, cause }),
                    };
                    let lease = lease.unwrap_or(0);
                    events.push(Event::Put(Kv {
                        key: key.clone(),
                        value: value.clone().into_bytes(),
                        mod_revision: revision,
                        lease,
                    }));
                    state.keys.insert(
                        key,
                        Entry {
                            value,
                            mod_revision: revision,
                            lease,
                        },
                    );
                }
                Op::Delete(key) => {
                    if state.keys.remove(&key).is_some() {
                        events.push(Event::Delete {
                            key,
                            mod_revision: revision,
                        });
                    }
                }
            }
        }
        if let Err(e) = self.persist(&state) {
            // Nothing was acknowledged: undo in memory too.
            (state.revision, state.keys) = before;
            return Err(e);
        }
        state.watchers.retain(|(prefix, tx)| {
            let mine: Vec<Event> = events
                .iter()
                .filter(|e| match e {
                    Event::Put(kv) => kv.key.starts_with(prefix.as_str()),
                    Event::Delete { key, .. } => key.starts_with(prefix.as_str()),
                })
                .cloned()
                .collect();
            // A watcher that cannot keep up is told to list again rather
            // than silently missing a change.
            let n = mine.len();
            mine.is_empty()
                || match tx.try_send(WatchMessage::Events(mine)) {
                    Ok(()) => {
                        super::received(n);
                        true
                    }
                    Err(mpsc::error::TrySendError::Full(_)) => {
                        let _ = tx.try_send(WatchMessage::Broken("watcher fell behind".into()));
                        false
                    }
                    Err(mpsc::error::TrySendError::Closed(_)) => false,
                }
        });
        Ok(Some(revision))
    }
}

impl ControlStore for EmbeddedStore {
    fn backend(&self) -> &'static str {
        "embedded"
    }

    fn location(&self) -> String {
        self.dir.join(FILE).display().to_string()
    }

    fn list(&self, prefix: &str) -> BoxFut<'_, (Vec<Kv>, i64)> {
        let state = lock(&self.state);
        let kvs = state
            .keys
            .range(prefix.to_owned()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, e)| Kv {
                key: k.clone(),
                value: e.value.clone().into_bytes(),
                mod_revision: e.mod_revision,
                lease: e.lease,
            })
            .collect();
        let revision = state.revision;
        Box::pin(async move { Ok((kvs, revision)) })
    }

    fn commit(&self, when: Vec<Cmp>, ops: Vec<Op>) -> BoxFut<'_, Option<i64>> {
        Box::pin(async move { self.apply(when, ops) })
    }

    fn watch(&self, prefix: &str, after: i64) -> BoxFut<'_, mpsc::Receiver<WatchMessage>> {
        let (tx, rx) = mpsc::channel(1024);
        let mut state = lock(&self.state);
        if after < state.revision {
            // No history is kept: a watcher that is behind lists again.
            let _ = tx.try_send(WatchMessage::Broken(format!(
                "revision {after} is older than the current {}",
                state.revision
            )));
        } else {
            state.watchers.push((prefix.to_owned(), tx));
        }
        Box::pin(async move { Ok(rx) })
    }

    fn grant_lease(&self, _ttl_secs: i64) -> BoxFut<'_, i64> {
        let mut state = lock(&self.state);
        state.next_lease += 1;
        let id = state.next_lease;
        Box::pin(async move { Ok(id) })
    }

    fn keep_alive(&self, lease: i64) -> BoxFut<'_, bool> {
        let alive = lease > 0 && lease <= lock(&self.state).next_lease;
        Box::pin(async move { Ok(alive) })
    }

    fn probe(&self) -> BoxFut<'_, ()> {
        Box::pin(async move { Ok(()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(key: &str, value: &str) -> Op {
        Op::Put {
            key: key.into(),
            value: value.as_bytes().to_vec(),
            lease: None,
        }
    }

    #[tokio::test]
    async fn cas_watch_and_durability() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let store = EmbeddedStore::open(dir.path()).unwrap_or_else(|e| panic!("open: {e}"));
        let (_, rev0) = store.list("/t/").await.unwrap_or_else(|e| panic!("{e}"));
        let mut watch = store
            .watch("/t/", rev0)
            .await
            .unwrap_or_else(|e| panic!("{e}"));

        let created = store
            .txn(vec![Cmp::Absent("/t/a".into())], vec![put("/t/a", "1")])
            .await;
        assert!(matches!(created, Ok(true)));
        let again = store
            .txn(vec![Cmp::Absent("/t/a".into())], vec![put("/t/a", "2")])
            .await;
        assert!(matches!(again, Ok(false)), "a second create must lose");

        let (kvs, rev) = store.list("/t/").await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(kvs.len(), 1);
        assert_eq!(kvs[0].value, b"1");
        let stale = store
            .txn(
                vec![Cmp::Unchanged("/t/a".into(), rev - 1)],
                vec![Op::Delete("/t/a".into())],
            )
            .await;
        assert!(matches!(stale, Ok(false)), "a stale revision must lose");
        let leased = Op::Put {
            key: "/t/alive".into(),
            value: b"x".to_vec(),
            lease: Some(store.grant_lease(5).await.unwrap_or_else(|e| panic!("{e}"))),
        };
        assert!(matches!(store.txn(vec![], vec![leased]).await, Ok(true)));

        match watch.recv().await {
            Some(WatchMessage::Events(ev)) => {
                assert!(matches!(&ev[..], [Event::Put(kv)] if kv.key == "/t/a" && kv.value == b"1"))
            }
            other => panic!("unexpected {other:?}"),
        }
        drop(store);

        // Reopened: the plain key survived, the leased one went with its lease.
        let store = EmbeddedStore::open(dir.path()).unwrap_or_else(|e| panic!("reopen: {e}"));
        let (kvs, rev_after) = store.list("/t/").await.unwrap_or_else(|e| panic!("{e}"));
        let keys: Vec<&str> = kvs.iter().map(|k| k.key.as_str()).collect();
        assert_eq!(keys, ["/t/a"]);
        assert!(rev_after > rev);
        // A watch from before the restart must relist.
        let mut old = store
            .watch("/t/", rev0)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(old.recv().await, Some(WatchMessage::Broken(_))));
    }

    #[tokio::test]
    async fn a_transaction_over_two_keys_is_refused_and_changes_nothing() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let store = EmbeddedStore::open(dir.path()).unwrap_or_else(|e| panic!("open: {e}"));
        let two = store
            .txn(vec![Cmp::Absent("/t/a".into())], vec![put("/t/b", "1")])
            .await;
        assert!(matches!(two, Err(ControlError::NotOneKey(_))), "{two:?}");
        let twice = store
            .txn(vec![], vec![put("/t/a", "1"), Op::Delete("/t/a".into())])
            .await;
        assert!(
            matches!(twice, Err(ControlError::NotOneKey(_))),
            "{twice:?}"
        );
        let none = store.txn(vec![], vec![]).await;
        assert!(matches!(none, Err(ControlError::NotOneKey(_))), "{none:?}");
        let (kvs, _) = store.list("/t/").await.unwrap_or_else(|e| panic!("{e}"));
        assert!(kvs.is_empty(), "{kvs:?}");
        // A condition on the key it changes is the one form there is.
        let one = store
            .txn(vec![Cmp::Absent("/t/a".into())], vec![put("/t/a", "1")])
            .await;
        assert!(matches!(one, Ok(true)), "{one:?}");
    }
}
