//! The Kubernetes API, when the daemon has one (`--kubeconfig`, or the
//! in-cluster service account): the migration-target watch on this node's
//! pods ([`pods`]), IPAMClaims ([`claims`]), KubeVirt's VirtualMachines,
//! whose deletion frees their VMs' addresses ([`vms`]), the node's pod
//! CIDRs ([`node_cidrs`]) and the other nodes' ([`node_peers`]), and
//! events on pods ([`events`]).
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
pub mod vms;

use crate::vm::Vms;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tether_base::error::{Error, Result};

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

/// Builds a client, and says which server it talks to (for messages). It
/// does not talk to the server yet: a server that is down at start-up
/// delays nothing but the watches.
pub async fn client(source: &Source) -> Result<(::kube::Client, String)> {
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
    // Every request says who makes it: the API server's audit log and its
    // request metrics name tetherd and its version, not an empty agent.
    config.headers.push((
        ::http::header::USER_AGENT,
        ::http::HeaderValue::from_static(USER_AGENT),
    ));
    let server = config.cluster_url.to_string();
    let client = ::kube::Client::try_from(config)
        .map_err(|e| Error::InvalidConfig(format!("the Kubernetes client: {e}")))?;
    Ok((client, server.trim_end_matches('/').to_owned()))
}

/// The `User-Agent` of every request to the API server.
pub const USER_AGENT: &str = concat!("tetherd/", env!("CARGO_PKG_VERSION"));

/// The backoff of tether's watches while the API server does not answer:
/// 250 ms doubling to 1.6 s, each delay shortened by up to a quarter so
/// that the nodes do not retry in step; reset once the watch delivers
/// again. client-go's reflectors go up to 30 s; tether's watches are three
/// per node and what they carry (IPAMClaims' status, migration markers,
/// the other nodes' pod CIDRs) must catch up within 2 s of the server's
/// return, so they retry more often while it is away: about one request
/// per watch and node every 1.4 s.
#[derive(Debug, Default)]
pub struct WatchBackoff {
    attempt: u32,
}

/// [`WatchBackoff`]'s first delay and its ceiling.
const WATCH_BACKOFF_MIN: Duration = Duration::from_millis(250);
const WATCH_BACKOFF_MAX: Duration = Duration::from_millis(1600);

impl Iterator for WatchBackoff {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        let full = WATCH_BACKOFF_MIN
            .saturating_mul(1 << self.attempt.min(6))
            .min(WATCH_BACKOFF_MAX);
        self.attempt = self.attempt.saturating_add(1);
        // Jitter from the clock's nanoseconds: no generator needed for it.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let cut = full.mul_f64(f64::from(nanos % 1000) / 4000.0);
        Some(full.saturating_sub(cut))
    }
}

impl ::kube::runtime::utils::Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.attempt = 0;
    }
}

/// The node's link to the API: set on the node once the client is up,
/// absent without one.
pub struct KubeLink {
    /// Events on pods, queued.
    pub events: EventSink,
    /// The IPAMClaims cache and the status writer's queue.
    pub claims: Arc<Claims>,
    /// The names of KubeVirt's VirtualMachines, whose deletion frees their
    /// VMs' addresses.
    pub virtual_machines: Arc<vms::VirtualMachines>,
}

/// Starts the event writer, the IPAMClaims watch and status writer, and
/// the VirtualMachines watch for the records of `vms`. Returns at once.
/// The watch on this node's pods ([`pods::start`]) is started by the
/// caller once the node holds the link, so that what it triggers can be
/// told to the API.
pub fn start(vms: &Arc<Vms>, client: ::kube::Client) -> Arc<KubeLink> {
    let events = events::start(client.clone(), vms.node_name().to_owned());
    let claims = claims::start(client.clone(), vms.clone());
    let virtual_machines = vms::start(client, vms.clone());
    Arc::new(KubeLink {
        events,
        claims,
        virtual_machines,
    })
}

/// Says so when a watch's resource version has expired (410 Gone: the API
/// server no longer has the history since the last event this node saw,
/// as after a compaction of its etcd): kube's watcher then lists anew, and
/// the list replaces what the watch knew. Other failures are the caller's
/// to log.
pub(crate) fn note_gone(watch: &str, e: &::kube::runtime::watcher::Error) {
    use ::kube::runtime::watcher::Error as W;
    let code = match e {
        W::WatchError(status) => Some(status.code),
        W::WatchStartFailed(::kube::Error::Api(status))
        | W::WatchFailed(::kube::Error::Api(status))
        | W::InitialListFailed(::kube::Error::Api(status)) => Some(status.code),
        _ => None,
    };
    if code == Some(410) {
        tracing::info!(watch, "resource version expired (410 Gone): listing again");
    }
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
/// 0.5 s doubling to 30 s. The watches use [`WatchBackoff`]; this is for
/// the writers.
pub(crate) fn backoff(attempt: u32) -> Duration {
    let ms = 500u64.saturating_mul(1u64 << attempt.min(6));
    Duration::from_millis(ms.min(30_000))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watch_backoff_stays_under_its_ceiling_and_starts_again_after_a_reset() {
        use ::kube::runtime::utils::Backoff;
        let mut b = WatchBackoff::default();
        let delays: Vec<Duration> = (&mut b).take(12).collect();
        assert!(delays[0] <= WATCH_BACKOFF_MIN && delays[0] >= WATCH_BACKOFF_MIN * 3 / 4);
        assert!(delays.iter().all(|d| *d <= WATCH_BACKOFF_MAX), "{delays:?}");
        assert!(delays[11] >= WATCH_BACKOFF_MAX * 3 / 4, "{delays:?}");
        b.reset();
        assert!(b.next().is_some_and(|d| d <= WATCH_BACKOFF_MIN));
    }

    #[test]
    fn requests_name_tetherd_and_its_version() {
        assert_eq!(USER_AGENT, format!("tetherd/{}", env!("CARGO_PKG_VERSION")));
    }
}
