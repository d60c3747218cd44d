//! The Kubernetes API, when the daemon has one (`--kubeconfig`, or the
//! in-cluster service account): the migration-target watch on this node's
//! pods ([`pods`]), IPAMClaims ([`claims`]), KubeVirt's VirtualMachines,
//! whose deletion frees their VMs' addresses ([`vms`]), the node's pod
//! CIDRs ([`node_cidrs`]) and the other nodes' ([`node_peers`]), events on
//! pods ([`events`]), and what NetworkPolicy reads ([`policy_watch`]).
//!
//! Only NetworkPolicy stands between a CNI call and its answer: an ADD
//! waits until its pod's isolation is in the kernel, which needs the
//! policies listed, and the pod read from the API when the watch has not
//! brought it yet. Otherwise ADD and DEL answer from the node's own state;
//! what they learn from the API comes from watch caches, and what they
//! tell it (events, claim status) goes through queues that tasks drain in
//! the background. While the API server is down, the watches back off and
//! relist when it is back (also on `410 Gone`), and the CNI calls go on as
//! before (an ADD of a pod NetworkPolicy has not seen yet excepted: it
//! fails, to be tried again, rather than leave the pod open).

pub mod claims;
pub mod events;
pub mod launchers;
pub mod node_cidrs;
pub mod node_peers;
pub mod pods;
pub mod policy_watch;
#[cfg(test)]
mod test_api;
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

/// How long any request, a watch's start and a watcher's list included,
/// may wait for the response's headers. kube's client has no read
/// timeout (a watch's body may be quiet for minutes) and its watcher
/// bounds only a started watch's stream, so a request the server took and
/// never answered (a server killed or frozen after it accepted the
/// connection) would hold a watch forever: here it fails, and the watch
/// backs off and starts again. Longer than [`REQUEST_TIMEOUT`], which
/// bounds single requests with its own message; a list served from the
/// API server's watch cache answers in well under this.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(15);

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
    client_with(source, RESPONSE_TIMEOUT).await
}

/// [`client`], with the deadline on responses given.
async fn client_with(
    source: &Source,
    response_timeout: Duration,
) -> Result<(::kube::Client, String)> {
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
    let client = ::kube::client::ClientBuilder::try_from(config)
        .map_err(|e| Error::InvalidConfig(format!("the Kubernetes client: {e}")))?
        .with_layer(&tower::timeout::TimeoutLayer::new(response_timeout))
        .build();
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
    /// Whether a VM pod is its VM's launcher (`--check-vm-launchers`);
    /// `None`: not checked.
    pub launchers: Option<Arc<dyn launchers::Launchers>>,
}

/// Starts the event writer, the IPAMClaims watch and status writer, and
/// the VirtualMachines watch for the records of `vms`. Returns at once.
/// The watch on this node's pods ([`pods::start`]) is started by the
/// caller once the node holds the link, so that what it triggers can be
/// told to the API. With `check_launchers`, VM pods are checked to be
/// their VMs' launchers ([`launchers`]).
pub fn start(vms: &Arc<Vms>, client: ::kube::Client, check_launchers: bool) -> Arc<KubeLink> {
    let events = events::start(client.clone(), vms.node_name().to_owned());
    let claims = claims::start(client.clone(), vms.clone());
    let launchers = check_launchers.then(|| {
        Arc::new(launchers::ApiLaunchers(client.clone())) as Arc<dyn launchers::Launchers>
    });
    let virtual_machines = vms::start(client, vms.clone());
    Arc::new(KubeLink {
        events,
        claims,
        virtual_machines,
        launchers,
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
    use futures::StreamExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A server that reads each request and writes `answer`'s parts (600
    /// ms apart) or, when `None`, nothing; either way it then holds the
    /// connection open. A test double: see [`test_api`].
    async fn server(answer: Option<&'static [&'static [u8]]>) -> (tempfile::TempDir, Source) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    let _ = conn.read(&mut buf).await;
                    for part in answer.unwrap_or(&[]) {
                        if conn.write_all(part).await.is_err() {
                            return;
                        }
                        tokio::time::sleep(Duration::from_millis(600)).await;
                    }
                    tokio::time::sleep(Duration::from_secs(30)).await;
                });
            }
        });
        test_api::kubeconfig(port)
    }

    #[tokio::test]
    async fn a_request_the_server_takes_and_never_answers_fails_at_the_deadline() {
        let (_dir, source) = server(None).await;
        let (client, _) = client_with(&source, Duration::from_millis(300))
            .await
            .unwrap();
        let t = std::time::Instant::now();
        let out = tokio::time::timeout(Duration::from_secs(10), client.apiserver_version()).await;
        let err = out.expect("the request outlived its deadline").unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        assert!(err.to_string().contains("timed out"), "{err}");
        // A watch's start is held the same way, and fails the same way.
        let pods: ::kube::Api<k8s_openapi::api::core::v1::Pod> = ::kube::Api::all(client);
        let watch = tokio::time::timeout(
            Duration::from_secs(10),
            pods.watch(&::kube::api::WatchParams::default(), "0"),
        )
        .await;
        assert!(watch.expect("the watch outlived its deadline").is_err());
    }

    #[tokio::test]
    async fn a_watch_whose_body_is_quiet_past_the_deadline_goes_on() {
        // Headers at once, then the body quiet for twice the deadline.
        let event = br#"{"type":"ADDED","object":{"apiVersion":"v1","kind":"Pod","metadata":{"name":"p","resourceVersion":"7"}}}
"#;
        let chunk: &'static [u8] = Box::leak(
            [format!("{:x}\r\n", event.len()).as_bytes(), event, b"\r\n"]
                .concat()
                .into_boxed_slice(),
        );
        let parts: &'static [&'static [u8]] = Box::leak(Box::new([
            &b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"[..],
            chunk,
        ]));
        let (_dir, source) = server(Some(parts)).await;
        let (client, _) = client_with(&source, Duration::from_millis(300))
            .await
            .unwrap();
        let pods: ::kube::Api<k8s_openapi::api::core::v1::Pod> = ::kube::Api::all(client);
        let mut stream = pods
            .watch(&::kube::api::WatchParams::default(), "0")
            .await
            .unwrap()
            .boxed();
        let first = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .expect("no event");
        match first {
            Some(Ok(::kube::api::WatchEvent::Added(p))) => {
                assert_eq!(p.metadata.name.as_deref(), Some("p"));
            }
            other => panic!("{other:?}"),
        }
    }

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
