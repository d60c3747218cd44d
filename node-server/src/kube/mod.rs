//! The Kubernetes API, when the daemon has one (`--kubeconfig`, or the
//! in-cluster service account): the migration-target watch on this node's
//! pods ([`pods`]), IPAMClaims ([`claims`]), the node's pod CIDRs
//! ([`node_cidrs`]) and the other nodes' ([`node_peers`]), and events on
//! pods ([`events`]).
//!
//! None of it stands between a CNI call and its answer. ADD and DEL answer
//! from the node's own state; what they learn from the API comes from
//! watch caches, and what they tell it (events, claim status) goes through
//! queues that tasks drain in the background. While the API server is
//! down, the watches back off and relist when it is back (also on `410
//! Gone`), and the CNI calls go on as before.

pub mod claims;
pub mod events;
pub mod node_cidrs;
pub mod node_peers;
pub mod pods;

use crate::error::{Error, Result};
use crate::vm::Vms;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub use claims::{ClaimRef, Claims};
pub use events::{EventSink, PodEvent, PodRef};

/// The service account token of a pod, present in-cluster.
const IN_CLUSTER_TOKEN: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";

/// How long connecting to the API server may take before a request fails
/// (and a watch backs off).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Where the client's configuration comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A kubeconfig file (`--kubeconfig`).
    Kubeconfig(PathBuf),
    /// The pod's service account (`KUBERNETES_SERVICE_HOST` and the token).
    InCluster,
}

impl Source {
    /// `--kubeconfig` if given, else the in-cluster service account if this
    /// runs in a pod, else none: the daemon then runs without the API.
    pub fn find(kubeconfig: Option<&Path>) -> Option<Source> {
        if let Some(path) = kubeconfig {
            return Some(Source::Kubeconfig(path.to_path_buf()));
        }
        let in_pod = std::env::var_os("KUBERNETES_SERVICE_HOST").is_some()
            && Path::new(IN_CLUSTER_TOKEN).exists();
        in_pod.then_some(Source::InCluster)
    }
}

/// Builds a client. It does not talk to the server yet: a server that is
/// down at start-up delays nothing but the watches.
pub async fn client(source: &Source) -> Result<::kube::Client> {
    let mut config = match source {
        Source::Kubeconfig(path) => {
            let kc = ::kube::config::Kubeconfig::read_from(path).map_err(|e| {
                Error::InvalidConfig(format!("--kubeconfig {}: {e}", path.display()))
            })?;
            ::kube::Config::from_custom_kubeconfig(kc, &Default::default())
                .await
                .map_err(|e| {
                    Error::InvalidConfig(format!("--kubeconfig {}: {e}", path.display()))
                })?
        }
        Source::InCluster => ::kube::Config::incluster()
            .map_err(|e| Error::InvalidConfig(format!("the in-cluster service account: {e}")))?,
    };
    config.connect_timeout = Some(CONNECT_TIMEOUT);
    ::kube::Client::try_from(config)
        .map_err(|e| Error::InvalidConfig(format!("the Kubernetes client: {e}")))
}

/// The node's link to the API: set on the node once the client is up,
/// absent without one.
pub struct KubeLink {
    /// Events on pods, queued.
    pub events: EventSink,
    /// The IPAMClaims cache and the status writer's queue.
    pub claims: Arc<Claims>,
}

/// Starts the event writer, and the IPAMClaims watch and status writer
/// for the records of `vms`. Returns at once. The watch on this node's
/// pods ([`pods::start`]) is started by the caller once the node holds
/// the link, so that what it triggers can be told to the API.
pub fn start(vms: &Arc<Vms>, client: ::kube::Client) -> Arc<KubeLink> {
    let events = events::start(client.clone(), vms.node_name().to_owned());
    let claims = claims::start(client, vms.clone());
    Arc::new(KubeLink { events, claims })
}

/// How long one request (not a watch) may take before it is given up:
/// the connection may be up while the server does not answer.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs one API request with [`REQUEST_TIMEOUT`]; a timeout is an error
/// like the request's own.
pub(crate) async fn bounded<T, E: std::fmt::Display>(
    request: impl std::future::Future<Output = std::result::Result<T, E>>,
) -> std::result::Result<T, String> {
    match tokio::time::timeout(REQUEST_TIMEOUT, request).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => Err(format!("no answer within {REQUEST_TIMEOUT:?}")),
    }
}

/// The delay before the `attempt`-th retry of a failed API call or watch:
/// 0.5 s doubling to 30 s. The watches use kube's own backoff; this is for
/// the writers.
pub(crate) fn backoff(attempt: u32) -> Duration {
    let ms = 500u64.saturating_mul(1u64 << attempt.min(6));
    Duration::from_millis(ms.min(30_000))
}
