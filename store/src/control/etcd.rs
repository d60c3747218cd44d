//! The `etcd` control-plane backend (etcd v3 API through `etcd-client`).
//!
//! - Transactions map one to one: [`Cmp::Absent`] is `version == 0`,
//!   [`Cmp::Unchanged`] is `mod_revision == r`.
//! - Every unary call is bounded by the request timeout. Without that bound
//!   a call made while etcd has no quorum waits for as long as the
//!   connection lives.
//! - One client per member, used in turn: a call that fails on one member
//!   (refused, timed out, no leader there) is tried on the next, and the
//!   member that answered is used first from then on. The crate's own
//!   balanced channel kept sending requests to a killed member here.
//! - HTTP/2 keep-alives find a dead connection (a killed member) within a
//!   few seconds, so that a watch on it breaks and is re-established on a
//!   live member instead of going silent.

use super::{BoxFut, Cmp, ControlError, ControlStore, Event, Kv, MemberFailures, Op, WatchMessage};
use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, Identity,
    PutOptions, TlsOptions, Txn, TxnOp, WatchOptions,
};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::mpsc;

/// How to reach etcd.
#[derive(Debug, Clone)]
pub struct EtcdOptions {
    /// Client URLs, `http://host:port` or `https://host:port`.
    pub endpoints: Vec<String>,
    /// CA bundle that signed the members' certificates (TLS).
    pub ca: Option<PathBuf>,
    /// Client certificate and key (mutual TLS).
    pub cert: Option<PathBuf>,
    /// The client certificate's key.
    pub key: Option<PathBuf>,
    /// Bound on every unary request.
    pub timeout: Duration,
}

/// The etcd backend.
pub struct EtcdStore {
    /// One client per endpoint, in the order given.
    clients: Vec<Client>,
    /// The client that answered last.
    current: AtomicUsize,
    endpoints: Vec<String>,
    timeout: Duration,
}

fn read(path: &Path, what: &'static str) -> Result<Vec<u8>, ControlError> {
    std::fs::read(path).map_err(|cause| ControlError::TlsFile {
        what,
        path: path.to_owned(),
        cause,
    })
}

impl EtcdStore {
    /// Connects lazily: a member that is down now is tried again per
    /// request, so the daemon can start while part of etcd is down.
    pub async fn connect(opts: &EtcdOptions) -> Result<Self, ControlError> {
        if opts.endpoints.is_empty() {
            return Err(ControlError::Misconfigured(
                "--store etcd needs --etcd-endpoints",
            ));
        }
        let mut connect = ConnectOptions::new()
            .with_connect_timeout(opts.timeout)
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
            .with_keep_alive_while_idle(true)
            // A member cut off from the others answers "no leader" instead
            // of serving a watch that will never see another event.
            .with_require_leader(true);
        let tls = opts.endpoints.iter().any(|e| e.starts_with("https://"));
        if tls || opts.ca.is_some() || opts.cert.is_some() {
            let mut t = TlsOptions::new();
            if let Some(ca) = &opts.ca {
                t = t.ca_certificate(Certificate::from_pem(read(ca, "CA bundle")?));
            }
            match (&opts.cert, &opts.key) {
                (Some(cert), Some(key)) => {
                    t = t.identity(Identity::from_pem(
                        read(cert, "client certificate")?,
                        read(key, "client key")?,
                    ));
                }
                (None, None) => {}
                _ => {
                    return Err(ControlError::Misconfigured(
                        "--etcd-cert and --etcd-key go together",
                    ))
                }
            }
            connect = connect.with_tls(t);
        }
        let mut clients = Vec::with_capacity(opts.endpoints.len());
        for endpoint in &opts.endpoints {
            // Connecting does no I/O: a member that is down now is dialled
            // again per request, so the daemon can start while it is down.
            let client = Client::connect([endpoint], Some(connect.clone()))
                .await
                .map_err(|cause| ControlError::Connect {
                    endpoints: opts.endpoints.join(","),
                    cause,
                })?;
            clients.push(client);
        }
        Ok(EtcdStore {
            clients,
            current: AtomicUsize::new(0),
            endpoints: opts.endpoints.clone(),
            timeout: opts.timeout,
        })
    }

    /// Runs `call` on the member that answered last, then on each other
    /// member in turn until one answers, each attempt bounded by the
    /// timeout. Every caller's request is safe to repeat: reads, leases,
    /// and transactions whose conditions make a repeat a no-op (callers
    /// read back the outcome of a transaction that failed ambiguously).
    async fn call<T, F, Fut>(&self, doing: &str, call: F) -> Result<T, ControlError>
    where
        F: Fn(Client) -> Fut,
        Fut: Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        let n = self.clients.len();
        let first = self.current.load(Ordering::Relaxed) % n;
        let mut failures = Vec::new();
        for k in 0..n {
            let i = (first + k) % n;
            match tokio::time::timeout(self.timeout, call(self.clients[i].clone())).await {
                Ok(Ok(v)) => {
                    self.current.store(i, Ordering::Relaxed);
                    return Ok(v);
                }
                Ok(Err(e)) => failures.push((self.endpoints[i].clone(), brief(&e))),
                Err(_) => failures.push((
                    self.endpoints[i].clone(),
                    format!("no answer within {} ms", self.timeout.as_millis()),
                )),
            }
        }
        Err(ControlError::Unavailable {
            doing: doing.to_owned(),
            cause: MemberFailures(failures),
        })
    }
}

/// The useful part of a client error: the innermost cause (for example
/// "Connection refused (os error 111)") when there is one, which tonic's
/// transport errors nest several levels deep; else the error itself.
fn brief(e: &etcd_client::Error) -> String {
    let mut source = std::error::Error::source(e);
    let mut root = None;
    while let Some(s) = source {
        root = Some(s.to_string());
        source = s.source();
    }
    root.unwrap_or_else(|| e.to_string())
}

fn kv_of(kv: &etcd_client::KeyValue) -> Kv {
    Kv {
        key: String::from_utf8_lossy(kv.key()).into_owned(),
        value: kv.value().to_vec(),
        mod_revision: kv.mod_revision(),
        lease: kv.lease(),
    }
}

impl ControlStore for EtcdStore {
    fn backend(&self) -> &'static str {
        "etcd"
    }

    fn location(&self) -> String {
        self.endpoints.join(",")
    }

    fn list(&self, prefix: &str) -> BoxFut<'_, (Vec<Kv>, i64)> {
        let prefix = prefix.to_owned();
        Box::pin(async move {
            let resp = self
                .call(&format!("list {prefix}"), |c| {
                    let prefix = prefix.clone();
                    async move {
                        c.kv_client()
                            .get(prefix, Some(GetOptions::new().with_prefix()))
                            .await
                    }
                })
                .await?;
            let revision = resp.header().map(|h| h.revision()).unwrap_or(0);
            Ok((resp.kvs().iter().map(kv_of).collect(), revision))
        })
    }

    fn commit(&self, when: Vec<Cmp>, ops: Vec<Op>) -> BoxFut<'_, Option<i64>> {
        Box::pin(async move {
            super::one_key(&when, &ops)?;
            let compares: Vec<Compare> = when
                .into_iter()
                .map(|c| match c {
                    Cmp::Absent(k) => Compare::version(k, CompareOp::Equal, 0),
                    Cmp::Unchanged(k, r) => Compare::mod_revision(k, CompareOp::Equal, r),
                })
                .collect();
            let ops: Vec<TxnOp> = ops
                .into_iter()
                .map(|o| match o {
                    Op::Put { key, value, lease } => {
                        TxnOp::put(key, value, lease.map(|l| PutOptions::new().with_lease(l)))
                    }
                    Op::Delete(key) => TxnOp::delete(key, None),
                })
                .collect();
            let txn = Txn::new().when(compares).and_then(ops);
            let resp = self
                .call("commit a transaction", |c| {
                    let txn = txn.clone();
                    async move { c.kv_client().txn(txn).await }
                })
                .await?;
            Ok(resp
                .succeeded()
                .then(|| resp.header().map_or(0, |h| h.revision())))
        })
    }

    fn watch(&self, prefix: &str, after: i64) -> BoxFut<'_, mpsc::Receiver<WatchMessage>> {
        let prefix = prefix.to_owned();
        Box::pin(async move {
            let options = WatchOptions::new()
                .with_prefix()
                .with_start_revision(after + 1);
            let mut stream = self
                .call(&format!("watch {prefix}"), |c| {
                    let (prefix, options) = (prefix.clone(), options.clone());
                    async move { c.watch_client().watch(prefix, Some(options)).await }
                })
                .await?;
            let (tx, rx) = mpsc::channel(64);
            tokio::spawn(async move {
                loop {
                    let message = match stream.message().await {
                        Ok(Some(resp)) if resp.canceled() => WatchMessage::Broken(format!(
                            "etcd cancelled the watch: {}",
                            resp.cancel_reason()
                        )),
                        Ok(Some(resp)) if resp.compact_revision() > 0 => WatchMessage::Broken(
                            format!("history compacted at {}", resp.compact_revision()),
                        ),
                        Ok(Some(resp)) => {
                            super::received(resp.events().len());
                            let events: Vec<Event> = resp
                                .events()
                                .iter()
                                .filter_map(|e| {
                                    let kv = e.kv()?;
                                    Some(match e.event_type() {
                                        EventType::Put => Event::Put(kv_of(kv)),
                                        EventType::Delete => Event::Delete {
                                            key: String::from_utf8_lossy(kv.key()).into_owned(),
                                            mod_revision: kv.mod_revision(),
                                        },
                                    })
                                })
                                .collect();
                            if events.is_empty() {
                                continue;
                            }
                            WatchMessage::Events(events)
                        }
                        Ok(None) => WatchMessage::Broken("the watch stream ended".into()),
                        Err(e) => WatchMessage::Broken(format!("the watch stream failed: {e}")),
                    };
                    let broken = matches!(message, WatchMessage::Broken(_));
                    if tx.send(message).await.is_err() || broken {
                        return;
                    }
                }
            });
            Ok(rx)
        })
    }

    fn grant_lease(&self, ttl_secs: i64) -> BoxFut<'_, i64> {
        Box::pin(async move {
            let resp = self
                .call("grant a lease", |c| async move {
                    c.lease_client().grant(ttl_secs, None).await
                })
                .await?;
            Ok(resp.id())
        })
    }

    fn keep_alive(&self, id: i64) -> BoxFut<'_, bool> {
        Box::pin(async move {
            let ttl = self
                .call("renew the node lease", |c| async move {
                    // An expired lease: the client says so by an error, which
                    // is no failure to reach etcd; the caller grants a new
                    // lease (as an answer with TTL 0 would have it do).
                    let (mut keeper, mut stream) = match c.lease_client().keep_alive(id).await {
                        Err(etcd_client::Error::LeaseKeepAliveError(why))
                            if why == "lease not found" =>
                        {
                            return Ok(0);
                        }
                        other => other?,
                    };
                    keeper.keep_alive().await?;
                    let resp = stream.message().await?;
                    Ok::<_, etcd_client::Error>(resp.map(|r| r.ttl()).unwrap_or(0))
                })
                .await?;
            Ok(ttl > 0)
        })
    }

    fn probe(&self) -> BoxFut<'_, ()> {
        Box::pin(async move {
            // A linearizable read goes through the leader and needs a quorum,
            // as every write does.
            self.call("answer a health probe", |c| async move {
                c.kv_client()
                    .get("/", Some(GetOptions::new().with_count_only()))
                    .await
            })
            .await?;
            Ok(())
        })
    }
}

impl From<EtcdStore> for std::sync::Arc<dyn ControlStore> {
    fn from(s: EtcdStore) -> Self {
        std::sync::Arc::new(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn refuses_no_endpoints_and_half_a_client_identity() {
        let mut opts = EtcdOptions {
            endpoints: vec![],
            ca: None,
            cert: None,
            key: None,
            timeout: Duration::from_millis(100),
        };
        assert!(matches!(
            EtcdStore::connect(&opts).await,
            Err(ControlError::Misconfigured(_))
        ));
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let cert = dir.path().join("c.pem");
        std::fs::write(&cert, b"x").unwrap_or_else(|e| panic!("write: {e}"));
        opts.endpoints = vec!["https://127.0.0.1:1".into()];
        opts.cert = Some(cert);
        let err = EtcdStore::connect(&opts).await.err();
        assert!(
            matches!(&err, Some(ControlError::Misconfigured(m)) if m.contains("--etcd-key")),
            "{err:?}"
        );
    }

    #[tokio::test]
    async fn an_unreachable_etcd_fails_calls_within_the_timeout() {
        // Port 1 on loopback refuses at once; nothing leaves the machine.
        let opts = EtcdOptions {
            endpoints: vec!["http://127.0.0.1:1".into()],
            ca: None,
            cert: None,
            key: None,
            timeout: Duration::from_millis(300),
        };
        let store = match EtcdStore::connect(&opts).await {
            Ok(s) => s,
            // Also a correct answer: connecting found nobody.
            Err(ControlError::Connect { .. }) => return,
            Err(e) => panic!("unexpected {e:?}"),
        };
        // The outer bound only turns a hang into a failure.
        let err = tokio::time::timeout(Duration::from_secs(60), store.probe())
            .await
            .unwrap_or_else(|_| panic!("the probe hung past its own timeout"))
            .err();
        assert!(
            matches!(&err, Some(ControlError::Unavailable { cause, .. }) if cause.0.len() == 1),
            "{err:?}"
        );
    }
}
