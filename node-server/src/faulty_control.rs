//! A test double of a control store for the unit tests: the embedded
//! store in a temporary directory, whose next commits fail on command in
//! one of the ways a real store's can, or are held back (a slow answer).
//! It cannot show how long a real store takes, nor a watch that stalls
//! with it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tether_base::sync::lock;
use tether_store::control::embedded::EmbeddedStore;
use tether_store::control::{BoxFut, Cmp, ControlError, ControlStore, Kv, Op, WatchMessage};
use tokio::sync::mpsc;

/// How a failing commit fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The embedded store's own write fails (a local I/O error: not
    /// transient), and nothing is applied.
    LocalIo,
    /// Nobody answers (transient, as an etcd or API server that times
    /// out), and nothing is applied.
    Unanswered,
    /// The commit is applied, but its answer is lost (transient).
    AnswerLost,
}

/// See the module doc.
pub(crate) struct FaultyControl {
    inner: EmbeddedStore,
    /// Commits still to fail.
    failing: AtomicUsize,
    failure: Mutex<Failure>,
    /// Every commit tried.
    commits: AtomicUsize,
    /// Commits that failed.
    failed: AtomicUsize,
    /// Commits still to hold back, and for how long.
    holding: AtomicUsize,
    hold: Mutex<Duration>,
    _dir: tempfile::TempDir,
}

impl FaultyControl {
    /// A store that fails nothing yet.
    pub(crate) fn new() -> Arc<FaultyControl> {
        let dir = tempfile::tempdir().expect("tempdir");
        Arc::new(FaultyControl {
            inner: EmbeddedStore::open(dir.path()).expect("the control store"),
            failing: AtomicUsize::new(0),
            failure: Mutex::new(Failure::LocalIo),
            commits: AtomicUsize::new(0),
            failed: AtomicUsize::new(0),
            holding: AtomicUsize::new(0),
            hold: Mutex::new(Duration::ZERO),
            _dir: dir,
        })
    }

    /// The next `n` commits fail as `how` says (`usize::MAX`: until told
    /// otherwise; 0: none).
    pub(crate) fn fail_next(&self, n: usize, how: Failure) {
        *lock(&self.failure) = how;
        self.failing.store(n, Ordering::SeqCst);
    }

    /// The next `n` commits wait `hold` before they are applied (read
    /// against the store as it is then); the ones after them do not.
    pub(crate) fn hold_next(&self, n: usize, hold: Duration) {
        *lock(&self.hold) = hold;
        self.holding.store(n, Ordering::SeqCst);
    }

    /// Commits tried so far.
    pub(crate) fn commits(&self) -> usize {
        self.commits.load(Ordering::SeqCst)
    }

    /// Commits failed so far.
    pub(crate) fn failed(&self) -> usize {
        self.failed.load(Ordering::SeqCst)
    }
}

impl ControlStore for FaultyControl {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn location(&self) -> String {
        self.inner.location()
    }
    fn list(&self, prefix: &str) -> BoxFut<'_, (Vec<Kv>, i64)> {
        self.inner.list(prefix)
    }
    fn commit(&self, when: Vec<Cmp>, ops: Vec<Op>) -> BoxFut<'_, Option<i64>> {
        Box::pin(async move {
            self.commits.fetch_add(1, Ordering::SeqCst);
            if self
                .holding
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                let hold = *lock(&self.hold);
                tokio::time::sleep(hold).await;
            }
            let fail = self
                .failing
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
            if !fail {
                return self.inner.commit(when, ops).await;
            }
            self.failed.fetch_add(1, Ordering::SeqCst);
            let how = *lock(&self.failure);
            if how == Failure::AnswerLost {
                self.inner.commit(when, ops).await?;
            }
            Err(match how {
                Failure::LocalIo => ControlError::Io {
                    context: "writing (injected failure)",
                    path: "control-plane.json".into(),
                    cause: std::io::Error::other("injected commit failure"),
                },
                Failure::Unanswered | Failure::AnswerLost => ControlError::ApiUnavailable {
                    doing: "replace a VM record".into(),
                    server: "test double".into(),
                    cause: "no answer within 2000 ms".into(),
                },
            })
        })
    }
    fn watch(&self, prefix: &str, after: i64) -> BoxFut<'_, mpsc::Receiver<WatchMessage>> {
        self.inner.watch(prefix, after)
    }
    fn grant_lease(&self, ttl_secs: i64) -> BoxFut<'_, i64> {
        self.inner.grant_lease(ttl_secs)
    }
    fn keep_alive(&self, lease: i64) -> BoxFut<'_, bool> {
        self.inner.keep_alive(lease)
    }
    fn probe(&self) -> BoxFut<'_, ()> {
        self.inner.probe()
    }
}
