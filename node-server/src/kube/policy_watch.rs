//! The watches that feed the NetworkPolicy enforcer
//! ([`crate::policy::enforcer`]): every NetworkPolicy, Namespace and Pod of
//! the cluster (a policy on this node's pods names peers anywhere), and
//! the one-pod read an ADD makes when the watch has not delivered its pod
//! yet.
//!
//! Each object is turned into the model's form as it arrives (the
//! enforcer keeps no API object). Each watch replaces its kind whole when
//! it (re)lists, which it does at
//! start, on `410 Gone` and after the API server was away: a policy
//! changed meanwhile is applied then. Until all three have listed once,
//! the enforcer writes nothing and ADDs wait.

use std::fmt::Debug;
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::runtime::watcher::{self, watcher, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Resource};
use serde::de::DeserializeOwned;
use tether_base::error::{Error, Result};

use crate::policy::enforcer::{Change, Enforcer, Kind, PodSource};
use crate::policy::model::{namespace_labels, PodView, Policy};

/// Reads pods from the API.
pub struct ApiPods(pub kube::Client);

impl PodSource for ApiPods {
    fn pod<'a>(&'a self, namespace: &'a str, name: &'a str) -> BoxFuture<'a, Result<Option<Pod>>> {
        let api: Api<Pod> = Api::namespaced(self.0.clone(), namespace);
        Box::pin(async move {
            super::bounded(api.get_opt(name))
                .await
                .map_err(Error::TryAgain)
        })
    }
}

/// A kind the enforcer follows, in the model's form.
trait Followed: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static {
    /// Which kind it is.
    const KIND: Kind;
    /// The change of this object (`None`: deleted).
    fn change(o: Option<&Self>) -> Change;
}

impl Followed for NetworkPolicy {
    const KIND: Kind = Kind::Policies;
    fn change(o: Option<&Self>) -> Change {
        Change::Policy(o.map(Policy::from_k8s))
    }
}

impl Followed for Namespace {
    const KIND: Kind = Kind::Namespaces;
    fn change(o: Option<&Self>) -> Change {
        Change::Namespace(o.map(|n| namespace_labels(n).1))
    }
}

impl Followed for Pod {
    const KIND: Kind = Kind::Pods;
    fn change(o: Option<&Self>) -> Change {
        Change::Pod(o.map(PodView::from_k8s))
    }
}

/// Starts the three watches. They run as long as the daemon.
pub fn start(client: kube::Client, enforcer: Arc<Enforcer>) {
    follow::<NetworkPolicy>(&client, enforcer.clone(), "NetworkPolicies");
    follow::<Namespace>(&client, enforcer.clone(), "namespaces");
    follow::<Pod>(&client, enforcer, "pods (for NetworkPolicy)");
}

/// `namespace/name`, or the name of a cluster-scoped object.
fn key_of<K: Resource>(o: &K) -> String {
    let meta = o.meta();
    let name = meta.name.clone().unwrap_or_default();
    match &meta.namespace {
        Some(ns) => format!("{ns}/{name}"),
        None => name,
    }
}

fn follow<K>(client: &kube::Client, enforcer: Arc<Enforcer>, what: &'static str)
where
    K: Followed,
    K::DynamicType: Default,
{
    let api: Api<K> = Api::all(client.clone());
    tokio::spawn(async move {
        let mut stream = watcher(api, watcher::Config::default())
            .backoff(super::WatchBackoff::default())
            .boxed();
        let mut failing = false;
        // A relist's objects, in the model's form, until it is done.
        let mut relist: Vec<(String, Change)> = Vec::new();
        while let Some(item) = stream.next().await {
            match item {
                Ok(Event::Init) => relist.clear(),
                Ok(Event::InitApply(o)) => relist.push((key_of(&o), K::change(Some(&o)))),
                Ok(Event::InitDone) => {
                    if failing {
                        tracing::info!("the watch on {what} is back");
                    }
                    failing = false;
                    let all = std::mem::take(&mut relist);
                    tracing::debug!(count = all.len(), "listed {what}");
                    enforcer.relisted(K::KIND, all);
                }
                Ok(Event::Apply(o)) => enforcer.change(&key_of(&o), K::change(Some(&o))),
                Ok(Event::Delete(o)) => enforcer.change(&key_of(&o), K::change(None)),
                Err(e) => {
                    super::note_gone(what, &e);
                    if !failing {
                        tracing::warn!(error = %e, "the watch on {what} failed; retrying with backoff (the NetworkPolicy table stays as it is)");
                    }
                    failing = true;
                }
            }
        }
    });
}
