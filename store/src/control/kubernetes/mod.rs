//! The `kubernetes` control-plane backend: tether's records as objects of
//! its own CRDs, through the cluster's API server, so that a cluster needs
//! no etcd of tether's own.
//!
//! - Keys map to objects one to one ([`objects`]): each key class is a
//!   cluster-scoped kind of the group `tether.dev`, the object's name is
//!   the key's last part, its `spec` the record's JSON.
//! - Revisions are `resourceVersion`s, read as integers. On an API server
//!   backed by etcd (every one in practice) they are etcd's revisions: one
//!   counter for every resource, so a revision read from one kind orders
//!   against a change of another, as the callers need (a VM address held
//!   "since revision r"). A resourceVersion that is not an integer fails
//!   the call.
//! - Compare-and-swap is the API's optimistic concurrency: "absent" is a
//!   create (409 when the name exists), "unchanged since r" a replace or a
//!   delete with `resourceVersion` r as its precondition (409 when it
//!   moved on). One object per call: see the trait's rule.
//! - A lease is a `coordination.k8s.io` Lease per node (`tether-<node>`,
//!   in the namespace given), renewed by a patch of `renewTime`. The API
//!   server never expires a Lease; every node judges it. A node's alive
//!   key exists while this process saw its Lease change (a new
//!   `resourceVersion`) within the Lease's `leaseDurationSeconds`: the
//!   watcher's own clock, never the writer's, so clock skew between nodes
//!   does not matter (the way the node lifecycle controller reads kubelet
//!   Leases). A Lease first seen counts as renewed then: a node that
//!   starts waits at most one TTL more before it sees a dead node dead.
//! - A watch of one node's alive key (a whole key) asks for that Lease
//!   alone, by a field selector on its name: the other nodes' renewals are
//!   not sent to it.
//! - Watches are the API's watches, one per kind, with bookmarks, resumed
//!   from the last resourceVersion seen when the server ends one (every
//!   few minutes); a 410 Gone or a failure ends the watch with
//!   [`WatchMessage::Broken`], and the follower lists again.
//! - Every request is bounded by the timeout given; no answer, a failed
//!   connection, 429 and 5xx are [`ControlError::ApiUnavailable`] (the
//!   callers retry); other refusals are [`ControlError::ApiRefused`].
//! - An object edited by hand into something that is no record of its
//!   class (a name that maps to no key, a spec that is no JSON object) is
//!   left out of listings and watches with a warning: never a panic, and
//!   the other records are served.

pub mod objects;

use super::{one_key, BoxFut, Cmp, ControlError, ControlStore, Event, Kv, Op, WatchMessage};
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
    Preconditions, WatchEvent, WatchParams,
};
use kube::core::Status;
use objects::{Class, Keyspace, Kind, GROUP, KINDS, LEASE_SELECTOR, VERSION};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::pin::pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// How to reach the API, and where tether's objects are.
#[derive(Debug, Clone)]
pub struct KubeOptions {
    /// The root of tether's keys ("/tether/v1/").
    pub root: String,
    /// The API server's URL, for messages.
    pub server: String,
    /// The namespace of the nodes' Leases.
    pub lease_namespace: String,
    /// Bound on every request (not on watches).
    pub timeout: Duration,
}

/// A page of a listing: large enough that a listing of 100,000 records
/// is 200 requests, small enough that one page is a few hundred kB.
const PAGE: u32 = 500;

/// How often a Lease watch looks for Leases that expired.
const EXPIRY_TICK: Duration = Duration::from_millis(250);

/// The TTL of a Lease without `leaseDurationSeconds` (tetherd always sets
/// it): tetherd's default `--lease-ttl`.
const DEFAULT_TTL: Duration = Duration::from_secs(15);

/// The Kubernetes backend (cheap to clone: its watches hold it).
#[derive(Clone)]
pub struct KubeStore(Arc<Inner>);

impl std::ops::Deref for KubeStore {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

/// The backend's state, shared with its watches.
pub struct Inner {
    client: kube::Client,
    opts: KubeOptions,
    keys: Keyspace,
    granted: Mutex<Granted>,
    liveness: Arc<Mutex<Liveness>>,
}

/// The leases this process granted.
#[derive(Default)]
struct Granted {
    next: i64,
    leases: HashMap<i64, GrantedLease>,
}

struct GrantedLease {
    ttl: Duration,
    /// The last renewal that succeeded (or the grant).
    renewed: Instant,
    /// The nodes whose Lease it renews.
    nodes: BTreeSet<String>,
}

/// When this process saw each node's Lease change, by node name.
#[derive(Debug, Default)]
struct Liveness {
    seen: HashMap<String, Seen>,
}

#[derive(Debug)]
struct Seen {
    rv: String,
    at: Instant,
    ttl: Duration,
}

impl Liveness {
    /// Notes the Lease of `node` at `rv`: a new resourceVersion is a
    /// renewal seen `now`.
    fn observe(&mut self, node: &str, rv: &str, ttl: Duration, now: Instant) {
        match self.seen.get_mut(node) {
            Some(s) if s.rv == rv => s.ttl = ttl,
            _ => {
                self.seen.insert(
                    node.to_owned(),
                    Seen {
                        rv: rv.to_owned(),
                        at: now,
                        ttl,
                    },
                );
            }
        }
    }

    /// Whether the Lease of `node` was renewed within its TTL of `now`.
    fn alive(&self, node: &str, now: Instant) -> bool {
        self.seen
            .get(node)
            .is_some_and(|s| now.saturating_duration_since(s.at) < s.ttl)
    }

    fn forget(&mut self, node: &str) {
        self.seen.remove(node);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn resource(kind: Kind) -> ApiResource {
    ApiResource {
        group: GROUP.into(),
        version: VERSION.into(),
        api_version: format!("{GROUP}/{VERSION}"),
        kind: kind.kind.into(),
        plural: kind.plural.into(),
    }
}

fn revision(rv: Option<&str>) -> Result<i64, ControlError> {
    let rv = rv.unwrap_or_default();
    rv.parse().map_err(|_| {
        ControlError::Unmapped(format!(
            "the API server's resourceVersion {rv:?} is not an integer; --store kubernetes needs an API server on etcd"
        ))
    })
}

fn lease_ttl(lease: &Lease) -> Duration {
    lease
        .spec
        .as_ref()
        .and_then(|s| s.lease_duration_seconds)
        .and_then(|s| u64::try_from(s).ok())
        .filter(|s| *s > 0)
        .map_or(DEFAULT_TTL, Duration::from_secs)
}

/// What a request came to: its value, a status the caller decides on (404
/// or 409), or a failure of the store.
enum Answer<T> {
    Ok(T),
    Status(Box<Status>),
}

impl KubeStore {
    /// A store on `client`. Checks that every kind is served and readable
    /// (its CRD installed, RBAC granting it): a refusal is an error now,
    /// not at the first claim; a server that does not answer is not (the
    /// daemon waits for it, as for etcd).
    pub async fn connect(client: kube::Client, opts: KubeOptions) -> Result<Self, ControlError> {
        let store = KubeStore(Arc::new(Inner {
            client,
            keys: Keyspace::new(&opts.root),
            opts,
            granted: Mutex::new(Granted::default()),
            liveness: Arc::new(Mutex::new(Liveness::default())),
        }));
        match store.check_kinds().await {
            Err(e @ ControlError::ApiRefused { .. }) => Err(e),
            Err(e) => {
                tracing::warn!(error = %e, "the Kubernetes API does not answer yet");
                Ok(store)
            }
            Ok(()) => Ok(store),
        }
    }
}

impl Inner {
    async fn check_kinds(&self) -> Result<(), ControlError> {
        let one = ListParams::default().limit(1);
        for kind in KINDS {
            let doing = format!("list {}.{GROUP}", kind.plural);
            self.must(&doing, self.api(kind).list(&one)).await?;
        }
        let doing = format!("list leases in namespace {}", self.opts.lease_namespace);
        self.must(&doing, self.leases().list(&one)).await?;
        Ok(())
    }

    fn api(&self, kind: Kind) -> Api<DynamicObject> {
        Api::all_with(self.client.clone(), &resource(kind))
    }

    fn leases(&self) -> Api<Lease> {
        Api::namespaced(self.client.clone(), &self.opts.lease_namespace)
    }

    /// Runs one request within the timeout. 404 and 409 come back as
    /// [`Answer::Status`] for the caller; every other failure is the
    /// store's.
    async fn ask<T>(
        &self,
        doing: &str,
        request: impl Future<Output = kube::Result<T>>,
    ) -> Result<Answer<T>, ControlError> {
        match tokio::time::timeout(self.opts.timeout, request).await {
            Ok(Ok(v)) => Ok(Answer::Ok(v)),
            Ok(Err(kube::Error::Api(s))) if s.code == 404 || s.code == 409 => Ok(Answer::Status(s)),
            Ok(Err(e)) => Err(self.failed(doing, e)),
            Err(_) => Err(ControlError::ApiUnavailable {
                doing: doing.to_owned(),
                server: self.opts.server.clone(),
                cause: format!("no answer within {} ms", self.opts.timeout.as_millis()),
            }),
        }
    }

    /// [`Inner::ask`] where 404 and 409 are failures too.
    async fn must<T>(
        &self,
        doing: &str,
        request: impl Future<Output = kube::Result<T>>,
    ) -> Result<T, ControlError> {
        match self.ask(doing, request).await? {
            Answer::Ok(v) => Ok(v),
            Answer::Status(s) => Err(refused(doing, &s)),
        }
    }

    fn failed(&self, doing: &str, e: kube::Error) -> ControlError {
        match e {
            kube::Error::Api(s) if s.code == 429 || s.code >= 500 => ControlError::ApiUnavailable {
                doing: doing.to_owned(),
                server: self.opts.server.clone(),
                cause: format!("{} {}: {}", s.code, s.reason, s.message),
            },
            kube::Error::Api(s) => refused(doing, &s),
            other => ControlError::ApiUnavailable {
                doing: doing.to_owned(),
                server: self.opts.server.clone(),
                cause: innermost(&other),
            },
        }
    }

    /// The key and value of an object of `class`; `None` (with a warning)
    /// for one that is no record of it.
    fn to_kv(&self, class: Class, obj: &DynamicObject) -> Option<Kv> {
        let name = obj.metadata.name.as_deref().unwrap_or_default();
        let spec = &obj.data["spec"];
        let kv = (|| {
            let suffix = class.suffix_of(name, spec)?;
            let value = class.value_of(spec)?;
            let mod_revision = revision(obj.metadata.resource_version.as_deref()).ok()?;
            Some(Kv {
                key: self.keys.key(class, &suffix),
                value,
                mod_revision,
                lease: 0,
            })
        })();
        if kv.is_none() {
            tracing::warn!(
                kind = class.kind().map_or("Lease", |k| k.kind),
                name,
                "ignoring an object that is no tether record (edited by hand?)"
            );
        }
        kv
    }

    /// A node's alive key from its Lease, if the Lease is alive.
    fn lease_kv(&self, lease: &Lease, now: Instant) -> Option<Kv> {
        let name = lease.metadata.name.as_deref()?;
        let node = Class::Alive.suffix_of(name, &Value::Null)?;
        let rv = lease.metadata.resource_version.as_deref()?;
        let mut liveness = lock(&self.liveness);
        liveness.observe(&node, rv, lease_ttl(lease), now);
        if !liveness.alive(&node, now) {
            return None;
        }
        let renewed = lease
            .spec
            .as_ref()
            .and_then(|s| s.renew_time.as_ref())
            .map_or(0, |t| t.0.as_millisecond());
        Some(Kv {
            key: self.keys.key(Class::Alive, &node),
            value: renewed.to_string().into_bytes(),
            mod_revision: revision(Some(rv)).ok()?,
            lease: 0,
        })
    }

    async fn list_kind(&self, class: Class, prefix: &str) -> Result<(Vec<Kv>, i64), ControlError> {
        let kind = kind_of(class)?;
        let api = self.api(kind);
        let doing = format!("list {}.{GROUP}", kind.plural);
        let mut kvs = Vec::new();
        let mut params = ListParams::default().limit(PAGE);
        let mut rev = None;
        loop {
            let page = self.must(&doing, api.list(&params)).await?;
            if rev.is_none() {
                rev = Some(revision(page.metadata.resource_version.as_deref())?);
            }
            kvs.extend(
                page.items
                    .iter()
                    .filter(|o| class.owns(o.metadata.name.as_deref().unwrap_or_default()))
                    .filter_map(|o| self.to_kv(class, o))
                    .filter(|kv| kv.key.starts_with(prefix)),
            );
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(token) => params = params.continue_token(&token),
                None => break,
            }
        }
        Ok((kvs, rev.unwrap_or(0)))
    }

    async fn list_leases(&self, prefix: &str) -> Result<(Vec<Kv>, i64), ControlError> {
        let doing = format!("list leases in namespace {}", self.opts.lease_namespace);
        let list = self
            .must(
                &doing,
                self.leases()
                    .list(&ListParams::default().labels(LEASE_SELECTOR)),
            )
            .await?;
        let rev = revision(list.metadata.resource_version.as_deref())?;
        let now = Instant::now();
        let kvs = list
            .items
            .iter()
            .filter_map(|l| self.lease_kv(l, now))
            .filter(|kv| kv.key.starts_with(prefix))
            .collect();
        Ok((kvs, rev))
    }

    /// One object by name, consistently (a GET reads the store, not a
    /// cache): the base of a compare-and-swap.
    async fn get(&self, class: Class, name: &str) -> Result<(Vec<Kv>, i64), ControlError> {
        if class == Class::Alive {
            let doing = format!("get lease {name}");
            return Ok(match self.ask(&doing, self.leases().get(name)).await? {
                Answer::Ok(l) => {
                    let rev = revision(l.metadata.resource_version.as_deref())?;
                    (self.lease_kv(&l, Instant::now()).into_iter().collect(), rev)
                }
                Answer::Status(s) if s.code == 404 => (Vec::new(), 0),
                Answer::Status(s) => return Err(refused(&doing, &s)),
            });
        }
        let kind = kind_of(class)?;
        let doing = format!("get {}/{name}", kind.plural);
        match self.ask(&doing, self.api(kind).get(name)).await? {
            Answer::Ok(o) => {
                let rev = revision(o.metadata.resource_version.as_deref())?;
                Ok((self.to_kv(class, &o).into_iter().collect(), rev))
            }
            Answer::Status(s) if s.code == 404 => Ok((Vec::new(), 0)),
            Answer::Status(s) => Err(refused(&doing, &s)),
        }
    }

    async fn commit_object(
        &self,
        class: Class,
        suffix: &str,
        when: Option<&Cmp>,
        op: &Op,
    ) -> Result<Option<i64>, ControlError> {
        let kind = kind_of(class)?;
        let name = class.name_of(suffix).map_err(ControlError::Unmapped)?;
        let api = self.api(kind);
        let object = |value: &[u8], rv: Option<String>| -> Result<DynamicObject, ControlError> {
            let spec = class.spec_of(value).map_err(|e| {
                ControlError::Unmapped(format!("the value for {}/{name}: {e}", kind.plural))
            })?;
            let mut obj = DynamicObject::new(&name, &resource(kind)).data(json!({ "spec": spec }));
            obj.metadata.resource_version = rv;
            Ok(obj)
        };
        let pp = PostParams::default();
        match (when, op) {
            (_, Op::Put { lease: Some(_), .. }) => Err(ControlError::Unmapped(format!(
                "{}/{name}: only a node's alive key is attached to a lease",
                kind.plural
            ))),
            (Some(Cmp::Absent(_)), Op::Put { value, .. }) => {
                let doing = format!("create {}/{name}", kind.plural);
                match self
                    .ask(&doing, api.create(&pp, &object(value, None)?))
                    .await?
                {
                    Answer::Ok(o) => Ok(Some(revision(o.metadata.resource_version.as_deref())?)),
                    Answer::Status(s) if s.code == 409 => Ok(None),
                    Answer::Status(s) => Err(refused(&doing, &s)),
                }
            }
            (Some(Cmp::Unchanged(_, rev)), Op::Put { value, .. }) => {
                let doing = format!("replace {}/{name}", kind.plural);
                let obj = object(value, Some(rev.to_string()))?;
                match self.ask(&doing, api.replace(&name, &pp, &obj)).await? {
                    Answer::Ok(o) => Ok(Some(revision(o.metadata.resource_version.as_deref())?)),
                    // Changed (409) or gone (404): the condition failed.
                    Answer::Status(_) => Ok(None),
                }
            }
            (None, Op::Put { value, .. }) => {
                let doing = format!("write {}/{name}", kind.plural);
                for _attempt in 0..4 {
                    let current = match self.ask(&doing, api.get(&name)).await? {
                        Answer::Ok(o) => Some(o.metadata.resource_version),
                        Answer::Status(s) if s.code == 404 => None,
                        Answer::Status(s) => return Err(refused(&doing, &s)),
                    };
                    let written = match current {
                        Some(rv) => {
                            let obj = object(value, rv)?;
                            self.ask(&doing, api.replace(&name, &pp, &obj)).await?
                        }
                        None => {
                            self.ask(&doing, api.create(&pp, &object(value, None)?))
                                .await?
                        }
                    };
                    match written {
                        Answer::Ok(o) => {
                            return Ok(Some(revision(o.metadata.resource_version.as_deref())?))
                        }
                        // Raced with another writer: read again.
                        Answer::Status(_) => continue,
                    }
                }
                Err(ControlError::ApiUnavailable {
                    doing,
                    server: self.opts.server.clone(),
                    cause: "it kept changing under four attempts".into(),
                })
            }
            (Some(Cmp::Unchanged(_, rev)), Op::Delete(_)) => {
                let doing = format!("delete {}/{name}", kind.plural);
                let dp = DeleteParams::default().preconditions(Preconditions {
                    resource_version: Some(rev.to_string()),
                    uid: None,
                });
                match self.ask(&doing, api.delete(&name, &dp)).await? {
                    // The object as it was: its last revision, at most the
                    // deletion's, which is what callers may rely on.
                    Answer::Ok(deleted) => Ok(Some(
                        deleted
                            .left()
                            .and_then(|o| revision(o.metadata.resource_version.as_deref()).ok())
                            .unwrap_or(*rev),
                    )),
                    Answer::Status(_) => Ok(None),
                }
            }
            (None, Op::Delete(_)) => {
                let doing = format!("delete {}/{name}", kind.plural);
                match self
                    .ask(&doing, api.delete(&name, &DeleteParams::default()))
                    .await?
                {
                    Answer::Ok(_) => Ok(Some(0)),
                    Answer::Status(s) if s.code == 404 => Ok(Some(0)),
                    Answer::Status(s) => Err(refused(&doing, &s)),
                }
            }
            (Some(Cmp::Absent(_)), Op::Delete(_)) => {
                let (found, _) = self.get(class, &name).await?;
                Ok(found.is_empty().then_some(0))
            }
        }
    }

    async fn commit_alive(
        &self,
        node: &str,
        when: Option<&Cmp>,
        op: &Op,
    ) -> Result<Option<i64>, ControlError> {
        let name = Class::Alive.name_of(node).map_err(ControlError::Unmapped)?;
        let leases = self.leases();
        match (when, op) {
            (
                None,
                Op::Put {
                    lease: Some(id), ..
                },
            ) => {
                let ttl = {
                    let granted = lock(&self.granted);
                    let Some(l) = granted.leases.get(id) else {
                        return Err(ControlError::Unmapped(format!(
                            "lease {id} was not granted by this process"
                        )));
                    };
                    l.ttl
                };
                let rev = self.write_lease(&leases, &name, node, ttl).await?;
                let mut granted = lock(&self.granted);
                if let Some(l) = granted.leases.get_mut(id) {
                    l.nodes.insert(node.to_owned());
                    l.renewed = Instant::now();
                }
                Ok(Some(rev))
            }
            (Some(Cmp::Absent(_)), Op::Delete(_)) => {
                // What is left of an expired Lease goes, unless it was
                // renewed since this process last saw it.
                let doing = format!("get lease {name}");
                let lease = match self.ask(&doing, leases.get(&name)).await? {
                    Answer::Ok(l) => l,
                    Answer::Status(s) if s.code == 404 => return Ok(Some(0)),
                    Answer::Status(s) => return Err(refused(&doing, &s)),
                };
                let rv = lease.metadata.resource_version.clone().unwrap_or_default();
                let now = Instant::now();
                {
                    let mut liveness = lock(&self.liveness);
                    liveness.observe(node, &rv, lease_ttl(&lease), now);
                    if liveness.alive(node, now) {
                        return Ok(None);
                    }
                }
                let doing = format!("delete lease {name}");
                let dp = DeleteParams::default().preconditions(Preconditions {
                    resource_version: Some(rv.clone()),
                    uid: None,
                });
                match self.ask(&doing, leases.delete(&name, &dp)).await? {
                    Answer::Ok(_) => {
                        lock(&self.liveness).forget(node);
                        Ok(Some(revision(Some(&rv))?))
                    }
                    Answer::Status(s) if s.code == 404 => Ok(Some(0)),
                    Answer::Status(_) => Ok(None),
                }
            }
            _ => Err(ControlError::Unmapped(format!(
                "a node's alive key ({name}) is only put with a lease, or deleted once absent"
            ))),
        }
    }

    /// Creates or replaces the Lease `name` of `node`, renewed now.
    async fn write_lease(
        &self,
        leases: &Api<Lease>,
        name: &str,
        node: &str,
        ttl: Duration,
    ) -> Result<i64, ControlError> {
        let doing = format!("write lease {name}");
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        let spec = |acquired: Option<MicroTime>| LeaseSpec {
            holder_identity: Some(node.to_owned()),
            lease_duration_seconds: Some(i32::try_from(ttl.as_secs()).unwrap_or(i32::MAX)),
            acquire_time: acquired.or_else(|| Some(now.clone())),
            renew_time: Some(now.clone()),
            ..LeaseSpec::default()
        };
        let labels: BTreeMap<String, String> = LEASE_SELECTOR
            .split(',')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        let pp = PostParams::default();
        for _attempt in 0..4 {
            let current = match self.ask(&doing, leases.get(name)).await? {
                Answer::Ok(l) => Some(l),
                Answer::Status(s) if s.code == 404 => None,
                Answer::Status(s) => return Err(refused(&doing, &s)),
            };
            let written = match current {
                Some(l) => {
                    let acquired = l.spec.as_ref().and_then(|s| s.acquire_time.clone());
                    let lease = Lease {
                        metadata: ObjectMeta {
                            labels: Some(labels.clone()),
                            ..l.metadata
                        },
                        spec: Some(spec(acquired)),
                    };
                    self.ask(&doing, leases.replace(name, &pp, &lease)).await?
                }
                None => {
                    let lease = Lease {
                        metadata: ObjectMeta {
                            name: Some(name.to_owned()),
                            labels: Some(labels.clone()),
                            ..ObjectMeta::default()
                        },
                        spec: Some(spec(None)),
                    };
                    self.ask(&doing, leases.create(&pp, &lease)).await?
                }
            };
            match written {
                Answer::Ok(l) => return revision(l.metadata.resource_version.as_deref()),
                Answer::Status(_) => continue,
            }
        }
        Err(ControlError::ApiUnavailable {
            doing,
            server: self.opts.server.clone(),
            cause: "it kept changing under four attempts".into(),
        })
    }

    /// Follows one kind of tether's from `after`, until `tx` closes.
    async fn watch_kind(
        self: Arc<Self>,
        class: Class,
        prefix: String,
        after: i64,
        tx: mpsc::Sender<WatchMessage>,
    ) {
        let Ok(kind) = kind_of(class) else { return };
        let api = self.api(kind);
        let mut rv = after.to_string();
        let params = WatchParams::default();
        loop {
            let stream = tokio::select! {
                () = tx.closed() => return,
                s = tokio::time::timeout(self.opts.timeout, api.watch(&params, &rv)) => s,
            };
            let stream = match stream {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    let why = format!("watching {}: {}", kind.plural, innermost(&e));
                    let _ = tx.send(WatchMessage::Broken(why)).await;
                    return;
                }
                Err(_) => {
                    let why = format!("watching {}: no answer", kind.plural);
                    let _ = tx.send(WatchMessage::Broken(why)).await;
                    return;
                }
            };
            let mut stream = pin!(stream);
            loop {
                let item = tokio::select! {
                    () = tx.closed() => return,
                    item = stream.next() => item,
                };
                let message = match item {
                    // The server ended the watch (its timeout): resume.
                    None => break,
                    Some(Ok(WatchEvent::Bookmark(b))) => {
                        rv = b.metadata.resource_version;
                        continue;
                    }
                    Some(Ok(WatchEvent::Added(o) | WatchEvent::Modified(o))) => {
                        super::received(1);
                        rv = o.metadata.resource_version.clone().unwrap_or(rv);
                        let name = o.metadata.name.as_deref().unwrap_or_default();
                        if !class.owns(name) {
                            continue;
                        }
                        match self.to_kv(class, &o) {
                            Some(kv) if kv.key.starts_with(&prefix) => {
                                WatchMessage::Events(vec![Event::Put(kv)])
                            }
                            _ => continue,
                        }
                    }
                    Some(Ok(WatchEvent::Deleted(o))) => {
                        super::received(1);
                        rv = o.metadata.resource_version.clone().unwrap_or(rv);
                        let name = o.metadata.name.as_deref().unwrap_or_default();
                        if !class.owns(name) {
                            continue;
                        }
                        match self.to_kv(class, &o) {
                            Some(kv) if kv.key.starts_with(&prefix) => {
                                WatchMessage::Events(vec![Event::Delete {
                                    key: kv.key,
                                    mod_revision: kv.mod_revision,
                                }])
                            }
                            _ => continue,
                        }
                    }
                    Some(Ok(WatchEvent::Error(s))) => WatchMessage::Broken(format!(
                        "watching {}: {} {}: {}",
                        kind.plural, s.code, s.reason, s.message
                    )),
                    Some(Err(e)) => {
                        WatchMessage::Broken(format!("watching {}: {}", kind.plural, innermost(&e)))
                    }
                };
                let broken = matches!(message, WatchMessage::Broken(_));
                if tx.send(message).await.is_err() || broken {
                    return;
                }
            }
        }
    }

    /// Follows the nodes' Leases from `after`: a Lease seen renewed is a
    /// node's alive key put (once, until it expires), one that expires or
    /// is deleted its deletion.
    /// With `only` (a Lease's name), that Lease alone, and the key it
    /// stands for (`prefix`, a whole key) exactly.
    async fn watch_leases(
        self: Arc<Self>,
        prefix: String,
        only: Option<String>,
        after: i64,
        tx: mpsc::Sender<WatchMessage>,
    ) {
        let leases = self.leases();
        let mut rv = after.to_string();
        let mut params = WatchParams::default().labels(LEASE_SELECTOR);
        if let Some(name) = &only {
            params = params.fields(&format!("metadata.name={name}"));
        }
        let wanted = |key: &str| {
            if only.is_some() {
                key == prefix
            } else {
                key.starts_with(&prefix)
            }
        };
        // The nodes the follower holds alive: those the listing just gave.
        let mut alive: BTreeMap<String, i64> = {
            let now = Instant::now();
            let liveness = lock(&self.liveness);
            liveness
                .seen
                .iter()
                .filter(|(n, _)| liveness.alive(n, now))
                .filter(|(n, _)| wanted(&self.keys.key(Class::Alive, n)))
                .map(|(n, s)| (n.clone(), s.rv.parse().unwrap_or(0)))
                .collect()
        };
        let mut tick = tokio::time::interval(EXPIRY_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let stream = tokio::select! {
                () = tx.closed() => return,
                s = tokio::time::timeout(self.opts.timeout, leases.watch(&params, &rv)) => s,
            };
            let stream = match stream {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    let why = format!("watching leases: {}", innermost(&e));
                    let _ = tx.send(WatchMessage::Broken(why)).await;
                    return;
                }
                Err(_) => {
                    let _ = tx
                        .send(WatchMessage::Broken("watching leases: no answer".into()))
                        .await;
                    return;
                }
            };
            let mut stream = pin!(stream);
            loop {
                let mut events = Vec::new();
                tokio::select! {
                    () = tx.closed() => return,
                    _ = tick.tick() => {
                        let now = Instant::now();
                        let liveness = lock(&self.liveness);
                        alive.retain(|node, rev| {
                            let keep = liveness.alive(node, now);
                            if !keep {
                                events.push(Event::Delete {
                                    key: self.keys.key(Class::Alive, node),
                                    mod_revision: *rev,
                                });
                            }
                            keep
                        });
                    }
                    item = stream.next() => match item {
                        None => break,
                        Some(Ok(WatchEvent::Bookmark(b))) => rv = b.metadata.resource_version,
                        Some(Ok(WatchEvent::Added(l) | WatchEvent::Modified(l))) => {
                            super::received(1);
                            rv = l.metadata.resource_version.clone().unwrap_or(rv);
                            if let Some(kv) = self.lease_kv(&l, Instant::now()) {
                                if let Some((_, node)) = self.keys.split(&kv.key) {
                                    if alive.insert(node.to_owned(), kv.mod_revision).is_none()
                                        && wanted(&kv.key)
                                    {
                                        events.push(Event::Put(kv));
                                    }
                                }
                            }
                        }
                        Some(Ok(WatchEvent::Deleted(l))) => {
                            super::received(1);
                            rv = l.metadata.resource_version.clone().unwrap_or(rv);
                            let node = l
                                .metadata
                                .name
                                .as_deref()
                                .and_then(|n| Class::Alive.suffix_of(n, &Value::Null));
                            if let Some(node) = node {
                                lock(&self.liveness).forget(&node);
                                if alive.remove(&node).is_some() {
                                    events.push(Event::Delete {
                                        key: self.keys.key(Class::Alive, &node),
                                        mod_revision: rv.parse().unwrap_or(0),
                                    });
                                }
                            }
                        }
                        Some(Ok(WatchEvent::Error(s))) => {
                            let why = format!("watching leases: {} {}: {}", s.code, s.reason, s.message);
                            let _ = tx.send(WatchMessage::Broken(why)).await;
                            return;
                        }
                        Some(Err(e)) => {
                            let why = format!("watching leases: {}", innermost(&e));
                            let _ = tx.send(WatchMessage::Broken(why)).await;
                            return;
                        }
                    }
                }
                events.retain(|e| match e {
                    Event::Put(kv) => wanted(&kv.key),
                    Event::Delete { key, .. } => wanted(key),
                });
                if !events.is_empty() && tx.send(WatchMessage::Events(events)).await.is_err() {
                    return;
                }
            }
        }
    }
}

fn kind_of(class: Class) -> Result<Kind, ControlError> {
    class.kind().ok_or_else(|| {
        ControlError::Unmapped(format!(
            "{} keys are not objects of tether's kinds",
            class.segment()
        ))
    })
}

fn refused(doing: &str, s: &Status) -> ControlError {
    ControlError::ApiRefused {
        doing: doing.to_owned(),
        code: s.code,
        reason: s.reason.clone(),
        message: s.message.clone(),
    }
}

/// The innermost cause of a client error ("Connection refused (os error
/// 111)"), which hyper and tower nest several levels deep.
fn innermost(e: &kube::Error) -> String {
    let mut source = std::error::Error::source(e);
    let mut root = None;
    while let Some(s) = source {
        root = Some(s.to_string());
        source = s.source();
    }
    root.unwrap_or_else(|| e.to_string())
}

impl ControlStore for KubeStore {
    fn backend(&self) -> &'static str {
        "kubernetes"
    }

    fn location(&self) -> String {
        self.opts.server.clone()
    }

    fn list(&self, prefix: &str) -> BoxFut<'_, (Vec<Kv>, i64)> {
        let prefix = prefix.to_owned();
        Box::pin(async move {
            let Some((class, suffix)) = self.keys.split(&prefix) else {
                return Err(ControlError::Unmapped(format!(
                    "{prefix} spans several kinds: list each key class"
                )));
            };
            if !suffix.is_empty() {
                // A whole key: that object only (callers that pass one want
                // exactly it), read consistently.
                if let Ok(name) = class.name_of(suffix) {
                    return self.get(class, &name).await;
                }
            }
            if class == Class::Alive {
                self.list_leases(&prefix).await
            } else {
                self.list_kind(class, &prefix).await
            }
        })
    }

    fn commit(&self, when: Vec<Cmp>, ops: Vec<Op>) -> BoxFut<'_, Option<i64>> {
        Box::pin(async move {
            let key = one_key(&when, &ops)?.to_owned();
            let (Some(op), true) = (ops.first(), when.len() <= 1) else {
                return Err(ControlError::NotOneKey(format!(
                    "the Kubernetes store takes one condition and one change of {key}"
                )));
            };
            let Some((class, suffix)) = self.keys.split(&key) else {
                return Err(ControlError::Unmapped(format!(
                    "{key} is not a key of tether's"
                )));
            };
            if class == Class::Alive {
                self.commit_alive(suffix, when.first(), op).await
            } else {
                self.commit_object(class, suffix, when.first(), op).await
            }
        })
    }

    fn watch(&self, prefix: &str, after: i64) -> BoxFut<'_, mpsc::Receiver<WatchMessage>> {
        let prefix = prefix.to_owned();
        Box::pin(async move {
            let Some((class, _)) = self.keys.split(&prefix) else {
                return Err(ControlError::Unmapped(format!(
                    "{prefix} spans several kinds: watch each key class"
                )));
            };
            let (tx, rx) = mpsc::channel(256);
            let store = Arc::clone(&self.0);
            if class == Class::Alive {
                // A whole key: that node's Lease alone, narrowed by the API
                // server (a field selector), so that the other nodes'
                // renewals are not sent here.
                let only = match self.keys.split(&prefix) {
                    Some((_, suffix)) if !suffix.is_empty() => class.name_of(suffix).ok(),
                    _ => None,
                };
                tokio::spawn(store.watch_leases(prefix, only, after, tx));
            } else {
                tokio::spawn(store.watch_kind(class, prefix, after, tx));
            }
            Ok(rx)
        })
    }

    fn grant_lease(&self, ttl_secs: i64) -> BoxFut<'_, i64> {
        Box::pin(async move {
            let ttl = Duration::from_secs(u64::try_from(ttl_secs).unwrap_or(1).max(1));
            let mut granted = lock(&self.granted);
            // Leases left behind (their renewals stopped) are forgotten.
            granted
                .leases
                .retain(|_, l| l.renewed.elapsed() < l.ttl.saturating_mul(2));
            granted.next += 1;
            let id = granted.next;
            granted.leases.insert(
                id,
                GrantedLease {
                    ttl,
                    renewed: Instant::now(),
                    nodes: BTreeSet::new(),
                },
            );
            Ok(id)
        })
    }

    fn keep_alive(&self, id: i64) -> BoxFut<'_, bool> {
        Box::pin(async move {
            let (ttl, nodes) = {
                let granted = lock(&self.granted);
                let Some(l) = granted.leases.get(&id) else {
                    return Ok(false);
                };
                // Unrenewed for a TTL: every other node has seen it expire.
                if l.renewed.elapsed() >= l.ttl {
                    return Ok(false);
                }
                (l.ttl, l.nodes.clone())
            };
            let leases = self.leases();
            for node in nodes {
                let name = Class::Alive
                    .name_of(&node)
                    .map_err(ControlError::Unmapped)?;
                let doing = format!("renew lease {name}");
                let patch = json!({"spec": {
                    "renewTime": MicroTime(k8s_openapi::jiff::Timestamp::now()),
                    "leaseDurationSeconds": ttl.as_secs(),
                }});
                let renewed = self
                    .ask(
                        &doing,
                        leases.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)),
                    )
                    .await?;
                if let Answer::Status(_) = renewed {
                    // Deleted: a reaper saw it expire.
                    return Ok(false);
                }
            }
            if let Some(l) = lock(&self.granted).leases.get_mut(&id) {
                l.renewed = Instant::now();
            }
            Ok(true)
        })
    }

    fn probe(&self) -> BoxFut<'_, ()> {
        Box::pin(async move {
            let doing = format!("list {}.{GROUP}", KINDS[0].plural);
            self.must(
                &doing,
                self.api(KINDS[0]).list(&ListParams::default().limit(1)),
            )
            .await?;
            Ok(())
        })
    }
}

impl From<KubeStore> for Arc<dyn ControlStore> {
    fn from(s: KubeStore) -> Self {
        Arc::new(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_is_alive_for_its_ttl_after_each_change_seen() {
        let mut l = Liveness::default();
        let t0 = Instant::now();
        let ttl = Duration::from_secs(2);
        assert!(!l.alive("a", t0), "never seen");
        l.observe("a", "10", ttl, t0);
        assert!(l.alive("a", t0 + Duration::from_millis(1999)));
        assert!(!l.alive("a", t0 + ttl));
        // The same resourceVersion again (a relist) renews nothing.
        l.observe("a", "10", ttl, t0 + Duration::from_secs(3));
        assert!(!l.alive("a", t0 + Duration::from_secs(3)));
        // A new one does, whatever the writer's clock said.
        l.observe("a", "11", ttl, t0 + Duration::from_secs(3));
        assert!(l.alive("a", t0 + Duration::from_secs(4)));
        l.forget("a");
        assert!(!l.alive("a", t0 + Duration::from_secs(4)));
    }
}
