//! The node's NetworkPolicy enforcer: what the API says (policies,
//! namespaces, pods), what this node wired (its pods and the addresses it
//! gave them), and the one loop that turns both into the node's policy
//! table ([`tether_kernel::policy`]).
//!
//! - The API's objects come from watches (`crate::kube::policy_watch`),
//!   through [`Enforcer::change`] and [`Enforcer::relisted`]. Nothing is written before all three
//!   kinds have been listed whole: a table made from half the pods would
//!   open or close the wrong ones.
//! - This node's pods come from the daemon's ADD ([`Enforcer::admit`]) and
//!   teardown ([`Enforcer::forget`]), with the addresses tether gave them:
//!   the API has a pod's addresses only after its ADD returned, and the
//!   pod must be isolated before that (an ADD returns only once the table
//!   that holds its pod is in the kernel). A pod the watch has not seen
//!   yet is read from the API at once ([`PodSource`]).
//! - The watches' objects are kept in the model's small form
//!   ([`World`]), each converted once, when it arrives.
//! - Every change bumps a generation and marks the node's pods it may
//!   concern, to be planned again:
//!   - a pod's change, or an ADD or teardown giving a pod addresses or
//!     taking them, marks that pod, and the node's pods whose rules name
//!     pods (it may be their peer);
//!   - a policy marks the node's pods it selects, before or after;
//!   - a namespace's labels mark the node's pods whose rules name pods;
//!   - a relist marks every pod of the node.
//!
//!   The loop plans the marked pods (a burst of changes is one pass),
//!   writes the table only when a pod's part of it changed, and tells
//!   every waiting ADD the generation it reached (or why it could not).
//!   So an ADD costs the planning of its own pod (and of the node's pods
//!   whose rules name pods), not of the cluster.
//!
//! The table stays in the kernel when the daemon stops: a restarted daemon
//! keeps enforcing the last table until its own first write, which is made
//! from a full listing (so a policy changed while the daemon or the API
//! server was away is applied then).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::Pod;
use tether_base::error::{Error, Result};
use tether_base::sync::lock;
use tether_kernel::policy::{PodPolicy, PolicyPlan};
use tether_kernel::Host;
use tokio::sync::{watch, Notify};

use super::model::{Isolation, Labels, PodView, Policy, World};

/// How long an ADD waits for its pod's table before it fails with a
/// try-again error (the runtime retries the ADD).
pub const ADMIT_TIMEOUT: Duration = Duration::from_secs(20);

/// How long the loop waits before it tries again a table the kernel
/// refused.
const RETRY: Duration = Duration::from_secs(1);

/// Reads one pod from the API: for an ADD whose pod the watch has not
/// delivered yet. `Ok(None)`: no such pod (a container that is no
/// Kubernetes pod, which no policy can select).
pub trait PodSource: Send + Sync {
    /// The pod `namespace/name`.
    fn pod<'a>(&'a self, namespace: &'a str, name: &'a str) -> BoxFuture<'a, Result<Option<Pod>>>;
}

/// A change a watch saw, in the model's form (`None`: deleted).
#[derive(Debug, Clone)]
pub enum Change {
    /// A NetworkPolicy.
    Policy(Option<Policy>),
    /// A namespace's labels.
    Namespace(Option<Labels>),
    /// A pod.
    Pod(Option<PodView>),
}

/// The kinds of objects the watches list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// NetworkPolicies.
    Policies = 0,
    /// Namespaces.
    Namespaces = 1,
    /// Pods.
    Pods = 2,
}

/// One of this node's attachments, as the enforcer knows it.
#[derive(Debug, Clone)]
struct Local {
    pod: String,
    ips: Vec<IpAddr>,
}

/// What the enforcer knows, and what it planned of it.
#[derive(Debug)]
struct State {
    /// The API's objects as the watches last saw them, and the addresses
    /// this node gave its pods.
    world: World,
    /// Whether each [`Kind`] was listed whole.
    listed: [bool; 3],
    /// This node's attachments of pods, by attachment key.
    local: BTreeMap<String, Local>,
    /// This node's pods as last planned, by pod key (those the world has
    /// and that can be isolated).
    planned: BTreeMap<String, Isolation>,
    /// The node's pods to plan again.
    marked: BTreeSet<String>,
    /// Whether every pod of the node is to be planned again (a relist).
    all_marked: bool,
    /// Whether the next pass writes the table even if no pod's part of it
    /// changed: at start (the kernel may hold an older daemon's table) and
    /// after a write failed.
    rewrite: bool,
    /// Bumped by every change.
    generation: u64,
    /// Pods planned since the start (for the tests of what a change
    /// costs).
    plannings: u64,
}

impl Default for State {
    fn default() -> Self {
        State {
            world: World::default(),
            listed: [false; 3],
            local: BTreeMap::new(),
            planned: BTreeMap::new(),
            marked: BTreeSet::new(),
            all_marked: true,
            rewrite: true,
            generation: 0,
            plannings: 0,
        }
    }
}

impl State {
    fn complete(&self) -> bool {
        self.listed.iter().all(|l| *l)
    }

    /// Marks the planned pods whose rules name other pods.
    fn mark_users_of_others(&mut self) {
        for (key, i) in &self.planned {
            if i.uses_others {
                self.marked.insert(key.clone());
            }
        }
    }

    /// Applies one watched change.
    fn change(&mut self, key: &str, change: Change) {
        match change {
            Change::Policy(new) => {
                let old = match &new {
                    Some(p) => self.world.policies.insert(key.to_owned(), p.clone()),
                    None => self.world.policies.remove(key),
                };
                if old == new {
                    return;
                }
                // The node's pods that either selects.
                for pod in self.world.given.keys() {
                    let Some(view) = self.world.pods.get(pod) else {
                        continue;
                    };
                    let selects = |p: &Option<Policy>| {
                        p.as_ref().is_some_and(|p| {
                            p.namespace == view.namespace && p.selector.matches(&view.labels)
                        })
                    };
                    if selects(&old) || selects(&new) {
                        self.marked.insert(pod.clone());
                    }
                }
            }
            Change::Namespace(new) => {
                let old = match &new {
                    Some(l) => self.world.namespaces.insert(key.to_owned(), l.clone()),
                    None => self.world.namespaces.remove(key),
                };
                if old != new {
                    self.mark_users_of_others();
                }
            }
            Change::Pod(new) => {
                let old = match &new {
                    Some(p) => self.world.pods.insert(key.to_owned(), p.clone()),
                    None => self.world.pods.remove(key),
                };
                if old != new {
                    self.marked.insert(key.to_owned());
                    self.mark_users_of_others();
                }
            }
        }
        self.generation += 1;
    }

    /// Replaces kind `kind` whole with `all`, as a relist does.
    fn relisted(&mut self, kind: Kind, all: Vec<(String, Change)>) {
        let w = &mut self.world;
        match kind {
            Kind::Policies => w.policies.clear(),
            Kind::Namespaces => w.namespaces.clear(),
            Kind::Pods => w.pods.clear(),
        }
        // Every pod is planned again: nothing to mark one by one.
        for (key, change) in all {
            match change {
                Change::Policy(Some(p)) => {
                    w.policies.insert(key, p);
                }
                Change::Namespace(Some(l)) => {
                    w.namespaces.insert(key, l);
                }
                Change::Pod(Some(p)) => {
                    w.pods.insert(key, p);
                }
                Change::Policy(None) | Change::Namespace(None) | Change::Pod(None) => {}
            }
        }
        self.listed[kind as usize] = true;
        self.all_marked = true;
        self.generation += 1;
    }

    /// Makes the addresses of this node's attachments of pod `pod` the
    /// pod's addresses in the world (none left: the API's again), and
    /// marks what that concerns.
    fn give(&mut self, pod: &str) {
        let ips: Vec<IpAddr> = self
            .local
            .values()
            .filter(|l| l.pod == pod)
            .flat_map(|l| l.ips.iter().copied())
            .collect();
        let old = if self.local.values().any(|l| l.pod == pod) {
            self.world.given.insert(pod.to_owned(), ips.clone())
        } else {
            self.world.given.remove(pod)
        };
        self.marked.insert(pod.to_owned());
        if old.as_ref() != Some(&ips) {
            self.mark_users_of_others();
        }
        self.generation += 1;
    }

    /// Plans the marked pods again. The table to write when a pod's part
    /// of it changed (or a rewrite is due), and the generation it is of;
    /// `None` until the lists are complete.
    fn plan(&mut self) -> Option<(u64, Option<PolicyPlan>)> {
        if !self.complete() {
            return None;
        }
        let marked: Vec<String> = if std::mem::take(&mut self.all_marked) {
            self.marked.clear();
            self.planned
                .keys()
                .chain(self.world.given.keys())
                .cloned()
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect()
        } else {
            std::mem::take(&mut self.marked).into_iter().collect()
        };
        let mut changed = std::mem::take(&mut self.rewrite);
        for key in marked {
            let now = if self.world.given.contains_key(&key) {
                self.plannings += 1;
                self.world.isolation(&key)
            } else {
                None
            };
            let old = match now {
                Some(i) => self.planned.insert(key.clone(), i),
                None => self.planned.remove(&key),
            };
            changed |= isolated(old.as_ref()) != isolated(self.planned.get(&key));
        }
        let table =
            changed.then(|| PolicyPlan::new(self.planned.values().map(|i| i.policy.clone())));
        Some((self.generation, table))
    }
}

/// The pod's policy, if it isolates the pod in a direction (the table
/// has only those pods).
fn isolated(i: Option<&Isolation>) -> Option<&PodPolicy> {
    i.map(|i| &i.policy)
        .filter(|p| p.ingress.is_some() || p.egress.is_some())
}

/// What the loop last did: the generation its table was made from, and
/// why it could not be written, if it could not.
#[derive(Debug, Clone, Default)]
struct Written {
    generation: u64,
    error: Option<String>,
}

/// The drop counters: each table starts its own from zero, so what the
/// kernel's counted is carried over before a new table replaces it.
#[derive(Debug, Default)]
struct Counting {
    /// The counters of the table in the kernel: name -> (policy, ingress?).
    names: BTreeMap<String, (String, bool)>,
    /// Packets dropped by the tables before it, per (policy, ingress?).
    carried: BTreeMap<(String, bool), u64>,
}

/// The enforcer of one node.
pub struct Enforcer {
    host: Arc<dyn Host>,
    pods: Arc<dyn PodSource>,
    state: Mutex<State>,
    wake: Notify,
    written: watch::Sender<Written>,
    /// Held while a table is written or its counters are read.
    counting: Mutex<Counting>,
    /// How long an ADD waits ([`ADMIT_TIMEOUT`] in the daemon).
    admit_timeout: Duration,
}

/// `namespace/name` of a pod.
pub fn pod_key(namespace: &str, name: &str) -> String {
    format!("{namespace}/{name}")
}

impl Enforcer {
    /// The enforcer of the node whose table `host` holds; `pods` reads a
    /// pod the watch has not delivered; an ADD waits up to `admit_timeout`
    /// for its table.
    pub fn new(
        host: Arc<dyn Host>,
        pods: Arc<dyn PodSource>,
        admit_timeout: Duration,
    ) -> Arc<Enforcer> {
        Arc::new(Enforcer {
            host,
            pods,
            state: Mutex::new(State::default()),
            wake: Notify::new(),
            written: watch::channel(Written::default()).0,
            counting: Mutex::new(Counting::default()),
            admit_timeout,
        })
    }

    /// Starts the loop that writes the table. It runs as long as the
    /// daemon.
    pub fn start(self: &Arc<Self>) {
        let me = self.clone();
        tokio::spawn(async move { me.run().await });
    }

    /// Applies a change a watch saw to the object `key` (`namespace/name`,
    /// a namespace by its name).
    pub fn change(&self, key: &str, change: Change) {
        lock(&self.state).change(key, change);
        self.wake.notify_one();
    }

    /// Replaces kind `kind` whole with what a (re)list gave, and notes it
    /// listed.
    pub fn relisted(&self, kind: Kind, all: Vec<(String, Change)>) {
        lock(&self.state).relisted(kind, all);
        self.wake.notify_one();
    }

    /// Whether the three kinds have been listed whole.
    pub fn listed(&self) -> bool {
        lock(&self.state).complete()
    }

    /// ADD: attachment `attachment` of pod `namespace/name` has `ips`.
    /// Returns once a table holding it is in the kernel; fails (try again)
    /// when the pod cannot be read from the API, the lists are not
    /// complete, or the kernel refuses the table, within the enforcer's
    /// admit timeout. The caller undoes the ADD on failure, and calls
    /// [`Enforcer::forget`].
    pub async fn admit(
        &self,
        attachment: &str,
        namespace: &str,
        name: &str,
        ips: &[IpAddr],
    ) -> Result<()> {
        let key = pod_key(namespace, name);
        let known = lock(&self.state).world.pods.contains_key(&key);
        if !known {
            let pod = self.pods.pod(namespace, name).await.map_err(|e| {
                Error::TryAgain(format!(
                    "reading pod {key} from the API, for the NetworkPolicies that select it: {e}"
                ))
            })?;
            if let Some(pod) = pod {
                let mut s = lock(&self.state);
                // The watch's copy, should it come meanwhile, is as new.
                if !s.world.pods.contains_key(&key) {
                    s.change(&key, Change::Pod(Some(PodView::from_k8s(&pod))));
                }
            }
        }
        let generation = {
            let mut s = lock(&self.state);
            s.local.insert(
                attachment.to_owned(),
                Local {
                    pod: key.clone(),
                    ips: ips.to_vec(),
                },
            );
            s.give(&key);
            s.generation
        };
        self.wake.notify_one();
        self.wait_for(generation, &key).await
    }

    /// An attachment wired before the enforcer started (a restart): as
    /// [`Enforcer::admit`], without reading the API or waiting.
    pub fn remember(&self, attachment: &str, namespace: &str, name: &str, ips: &[IpAddr]) {
        let key = pod_key(namespace, name);
        let mut s = lock(&self.state);
        s.local.insert(
            attachment.to_owned(),
            Local {
                pod: key.clone(),
                ips: ips.to_vec(),
            },
        );
        s.give(&key);
    }

    /// Teardown: attachment `attachment` is gone. Its pod leaves the table
    /// with the next write (nothing waits for it).
    pub fn forget(&self, attachment: &str) {
        let removed = {
            let mut s = lock(&self.state);
            let removed = s.local.remove(attachment);
            if let Some(l) = &removed {
                s.give(&l.pod);
            }
            removed.is_some()
        };
        if removed {
            self.wake.notify_one();
        }
    }

    async fn wait_for(&self, generation: u64, pod: &str) -> Result<()> {
        let mut rx = self.written.subscribe();
        let waited = tokio::time::timeout(
            self.admit_timeout,
            rx.wait_for(|w| w.generation >= generation),
        )
        .await;
        let why = match waited {
            Ok(Ok(w)) => match &w.error {
                None => return Ok(()),
                Some(e) => format!("the kernel refused the NetworkPolicy table: {e}"),
            },
            Ok(Err(_)) => "the NetworkPolicy loop stopped".to_owned(),
            Err(_) if !self.listed() => format!(
                "the NetworkPolicies, namespaces and pods have not all been listed from the API \
                 within {:?}",
                self.admit_timeout
            ),
            Err(_) => format!(
                "the NetworkPolicy table was not written within {:?}",
                self.admit_timeout
            ),
        };
        Err(Error::TryAgain(format!(
            "pod {pod} cannot be isolated as its NetworkPolicies say: {why}"
        )))
    }

    /// What NetworkPolicy does to pod `namespace/name` now, and whether it
    /// runs on this node: `Err` before the lists are complete, `Ok(None)`
    /// for a pod the enforcer does not know.
    pub fn pod_policy(
        &self,
        namespace: &str,
        name: &str,
    ) -> std::result::Result<Option<(PodPolicy, bool)>, String> {
        let s = lock(&self.state);
        if !s.complete() {
            return Err(
                "the NetworkPolicies, namespaces and pods have not all been listed yet".into(),
            );
        }
        let key = pod_key(namespace, name);
        let local = s.world.given.contains_key(&key);
        Ok(s.world.pod_policy(&key).map(|p| (p, local)))
    }

    /// The table to write, if any, and the generation the enforcer
    /// reached; `None` until the lists are complete.
    fn plan(&self) -> Option<(u64, Option<PolicyPlan>)> {
        lock(&self.state).plan()
    }

    /// Packets dropped since the daemon started, per policy
    /// (`namespace/name`) and direction (true: ingress), for every policy
    /// that isolates a pod of this node now or did. Reads the kernel's
    /// counters (`nft`, a few milliseconds).
    pub fn drops(&self) -> Vec<(String, bool, u64)> {
        let c = lock(&self.counting);
        let mut all = c.carried.clone();
        for k in c.names.values() {
            all.entry(k.clone()).or_default();
        }
        if let Err(e) = self.add_counted(&c, &mut all) {
            tracing::warn!(error = %e, "cannot read the NetworkPolicy drop counters");
        }
        all.into_iter().map(|((p, i), n)| (p, i, n)).collect()
    }

    /// Adds what the table in the kernel counted to `to`.
    fn add_counted(
        &self,
        c: &Counting,
        to: &mut BTreeMap<(String, bool), u64>,
    ) -> std::result::Result<(), tether_kernel::KernelError> {
        for (name, packets, _) in self.host.policy_counters()? {
            if let Some(k) = c.names.get(&name) {
                *to.entry(k.clone()).or_default() += packets;
            }
        }
        Ok(())
    }

    /// Writes `plan` as the table, carrying over what the table it
    /// replaces counted.
    fn write(&self, plan: &PolicyPlan) -> std::result::Result<(), String> {
        let mut c = lock(&self.counting);
        let mut carried = c.carried.clone();
        if let Err(e) = self.add_counted(&c, &mut carried) {
            tracing::warn!(error = %e, "cannot read the NetworkPolicy drop counters before a new table; what they counted since the last one is lost");
        }
        self.host.ensure_policy(plan).map_err(|e| e.to_string())?;
        c.carried = carried;
        c.names = plan
            .counters()
            .into_iter()
            .map(|(policy, ingress, name)| (name, (policy, ingress)))
            .collect();
        Ok(())
    }

    async fn run(self: Arc<Self>) {
        loop {
            self.wake.notified().await;
            let Some((generation, table)) = self.plan() else {
                continue;
            };
            let error = match table {
                None => None,
                Some(plan) => {
                    let me = self.clone();
                    let pods = plan.pods().len();
                    let wrote = tokio::task::spawn_blocking(move || me.write(&plan))
                        .await
                        .map_err(|e| e.to_string())
                        .and_then(|r| r);
                    match wrote {
                        Ok(()) => {
                            tracing::debug!(generation, pods, "NetworkPolicy table written");
                            None
                        }
                        Err(e) => {
                            tracing::warn!(generation, error = %e, "the NetworkPolicy table could not be written; trying again");
                            lock(&self.state).rewrite = true;
                            let me = self.clone();
                            tokio::spawn(async move {
                                tokio::time::sleep(RETRY).await;
                                me.wake.notify_one();
                            });
                            Some(e)
                        }
                    }
                }
            };
            self.written.send_replace(Written { generation, error });
        }
    }

    /// Pods planned since the start.
    #[cfg(test)]
    fn plannings(&self) -> u64 {
        lock(&self.state).plannings
    }
}

#[cfg(test)]
mod tests;
