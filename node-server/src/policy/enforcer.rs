//! The node's NetworkPolicy enforcer: what the API says (policies,
//! namespaces, pods), what this node wired (its pods and the addresses it
//! gave them), and the one loop that turns both into the node's policy
//! table ([`tether_kernel::policy`]).
//!
//! - The API's objects come from watches (`crate::kube::policy_watch`),
//!   through [`Enforcer::update`]. Nothing is written before all three
//!   kinds have been listed whole: a table made from half the pods would
//!   open or close the wrong ones.
//! - This node's pods come from the daemon's ADD ([`Enforcer::admit`]) and
//!   teardown ([`Enforcer::forget`]), with the addresses tether gave them:
//!   the API has a pod's addresses only after its ADD returned, and the
//!   pod must be isolated before that (an ADD returns only once the table
//!   that holds its pod is in the kernel). A pod the watch has not seen
//!   yet is read from the API at once ([`PodSource`]).
//! - Every change bumps a generation; the loop writes the table from the
//!   newest state, so a burst of changes is one write, and tells every
//!   waiting ADD the generation it wrote (or why it could not).
//!
//! The table stays in the kernel when the daemon stops: a restarted daemon
//! keeps enforcing the last table until its own first write, which is made
//! from a full listing (so a policy changed while the daemon or the API
//! server was away is applied then).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use tether_base::error::{Error, Result};
use tether_base::sync::lock;
use tether_kernel::policy::{PodPolicy, PolicyPlan};
use tether_kernel::Host;
use tokio::sync::{watch, Notify};

use super::model::World;

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

/// The API's objects, as the watches last saw them, by `namespace/name`
/// (a namespace by its name).
#[derive(Debug, Default)]
pub struct Inputs {
    /// The NetworkPolicies.
    pub policies: BTreeMap<String, NetworkPolicy>,
    /// The namespaces.
    pub namespaces: BTreeMap<String, Namespace>,
    /// The pods, of every node.
    pub pods: BTreeMap<String, Pod>,
    /// Whether each kind was listed whole: policies, namespaces, pods.
    pub listed: [bool; 3],
}

impl Inputs {
    fn complete(&self) -> bool {
        self.listed.iter().all(|l| *l)
    }
}

/// One of this node's attachments, as the enforcer knows it.
#[derive(Debug, Clone)]
struct Local {
    pod: String,
    ips: Vec<IpAddr>,
}

#[derive(Debug, Default)]
struct State {
    inputs: Inputs,
    /// This node's attachments of pods, by attachment key.
    local: BTreeMap<String, Local>,
    /// Bumped by every change.
    generation: u64,
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

    /// Changes the API's objects as a watch saw them.
    pub fn update(&self, change: impl FnOnce(&mut Inputs)) {
        {
            let mut s = lock(&self.state);
            change(&mut s.inputs);
            s.generation += 1;
        }
        self.wake.notify_one();
    }

    /// Whether the three kinds have been listed whole.
    pub fn listed(&self) -> bool {
        lock(&self.state).inputs.complete()
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
        let known = lock(&self.state).inputs.pods.contains_key(&key);
        if !known {
            let pod = self.pods.pod(namespace, name).await.map_err(|e| {
                Error::TryAgain(format!(
                    "reading pod {key} from the API, for the NetworkPolicies that select it: {e}"
                ))
            })?;
            if let Some(pod) = pod {
                // The watch's copy, should it come meanwhile, is as new.
                lock(&self.state)
                    .inputs
                    .pods
                    .entry(key.clone())
                    .or_insert(pod);
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
            s.generation += 1;
            s.generation
        };
        self.wake.notify_one();
        self.wait_for(generation, &key).await
    }

    /// An attachment wired before the enforcer started (a restart): as
    /// [`Enforcer::admit`], without reading the API or waiting.
    pub fn remember(&self, attachment: &str, namespace: &str, name: &str, ips: &[IpAddr]) {
        let mut s = lock(&self.state);
        s.local.insert(
            attachment.to_owned(),
            Local {
                pod: pod_key(namespace, name),
                ips: ips.to_vec(),
            },
        );
        s.generation += 1;
    }

    /// Teardown: attachment `attachment` is gone. Its pod leaves the table
    /// with the next write (nothing waits for it).
    pub fn forget(&self, attachment: &str) {
        let removed = {
            let mut s = lock(&self.state);
            let removed = s.local.remove(attachment).is_some();
            if removed {
                s.generation += 1;
            }
            removed
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
        if !s.inputs.complete() {
            return Err(
                "the NetworkPolicies, namespaces and pods have not all been listed yet".into(),
            );
        }
        let key = pod_key(namespace, name);
        let (world, ips) = Self::world(&s);
        let local = ips.contains_key(key.as_str());
        Ok(world
            .pods
            .iter()
            .find(|p| p.key() == key)
            .map(|p| (world.pod_policy(p), local)))
    }

    /// The world of the current state, this node's pods with the addresses
    /// tether gave them (the API has them only after their ADD), and those
    /// addresses by pod.
    fn world(s: &State) -> (World, BTreeMap<&str, Vec<IpAddr>>) {
        let i = &s.inputs;
        let mut world =
            World::from_k8s(i.policies.values(), i.namespaces.values(), i.pods.values());
        let mut ips: BTreeMap<&str, Vec<IpAddr>> = BTreeMap::new();
        for l in s.local.values() {
            ips.entry(l.pod.as_str()).or_default().extend(&l.ips);
        }
        for p in &mut world.pods {
            if let Some(mine) = ips.get(p.key().as_str()) {
                p.ips = mine.clone();
            }
        }
        (world, ips)
    }

    /// The table for the current state, and the generation it is of;
    /// `None` until the lists are complete.
    fn plan(&self) -> Option<(u64, PolicyPlan)> {
        let s = lock(&self.state);
        if !s.inputs.complete() {
            return None;
        }
        let (world, ips) = Self::world(&s);
        Some((
            s.generation,
            world.plan(|p| ips.contains_key(p.key().as_str())),
        ))
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
        let mut last: Option<PolicyPlan> = None;
        loop {
            self.wake.notified().await;
            let Some((generation, plan)) = self.plan() else {
                continue;
            };
            let error = if last.as_ref() == Some(&plan) {
                None
            } else {
                let me = self.clone();
                let table = plan.clone();
                let wrote = tokio::task::spawn_blocking(move || me.write(&table))
                    .await
                    .map_err(|e| e.to_string())
                    .and_then(|r| r);
                match wrote {
                    Ok(()) => {
                        tracing::debug!(
                            generation,
                            pods = plan.pods().len(),
                            "NetworkPolicy table written"
                        );
                        last = Some(plan);
                        None
                    }
                    Err(e) => {
                        tracing::warn!(generation, error = %e, "the NetworkPolicy table could not be written; trying again");
                        last = None;
                        let me = self.clone();
                        tokio::spawn(async move {
                            tokio::time::sleep(RETRY).await;
                            me.wake.notify_one();
                        });
                        Some(e)
                    }
                }
            };
            self.written.send_replace(Written { generation, error });
        }
    }
}

#[cfg(test)]
mod tests;
