//! Prometheus metrics, served on `--metrics-address` (off by default) in
//! the Prometheus text format (0.0.4) at `/metrics`.
//!
//! Names follow the conventions Cilium and Antrea use: a `tether_` prefix,
//! base units in the name (`_seconds`, `_addresses`), `_total` on counters,
//! histograms for latencies. Two kinds of metric:
//!
//! - **Event metrics** (latencies, counts of things that happened) live in
//!   one process-wide [`Metrics`] ([`get`]), fed where the event happens:
//!   the CNI service, block claims, the control-plane wrapper
//!   ([`TimedControl`]), the DEL queue replay, cutovers. They are atomics,
//!   so feeding them costs nanoseconds whether or not anyone scrapes.
//! - **State metrics** (pool usage, the DEL queue's length, the guest DHCP
//!   service's counters, the build) are read from the node at scrape time
//!   by [`NodeCollector`], so they can never drift from what the admin API
//!   shows.

use std::net::SocketAddr;
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::attach::Node;
use crate::control::{BoxFut, Cmp, ControlStore, Op, WatchMessage};
use crate::error::{Error, Result};
use crate::ipam::Family as IpFamily;

/// The port the install manifests serve metrics on.
pub const DEFAULT_PORT: u16 = 9654;

/// Buckets of CNI request latencies: 1 ms to 30 s (ADD's deadline is 45 s).
const CNI_BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
/// Buckets of control-plane requests and block claims: 0.5 ms to 5 s (the
/// default per-request timeout is 2 s).
const CONTROL_BUCKETS: [f64; 13] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];
/// Buckets of cutovers, announcement to route: 0.1 ms to 5 s.
const CUTOVER_BUCKETS: [f64; 14] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

/// The CNI verbs, as labelled.
pub const VERBS: [&str; 5] = ["ADD", "DEL", "CHECK", "STATUS", "GC"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VerbCode {
    verb: String,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Verb {
    verb: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Kind {
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BackendOp {
    backend: String,
    operation: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Trigger {
    trigger: String,
}

fn cni_histogram() -> Histogram {
    Histogram::new(CNI_BUCKETS)
}

fn control_histogram() -> Histogram {
    Histogram::new(CONTROL_BUCKETS)
}

fn cutover_histogram() -> Histogram {
    Histogram::new(CUTOVER_BUCKETS)
}

type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

/// The event metrics of this process.
pub struct Metrics {
    cni_duration: Histograms<VerbCode>,
    cni_in_flight: Family<Verb, Gauge>,
    block_claims: Family<Kind, Counter>,
    block_claim_duration: Histograms<Kind>,
    control_duration: Histograms<BackendOp>,
    pending_del_replayed: Counter,
    cutovers: Family<Trigger, Counter>,
    cutover_duration: Histograms<Trigger>,
}

static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::new);

/// The process's metrics.
pub fn get() -> &'static Metrics {
    &METRICS
}

impl Metrics {
    fn new() -> Metrics {
        let m = Metrics {
            cni_duration: Family::new_with_constructor(cni_histogram),
            cni_in_flight: Family::default(),
            block_claims: Family::default(),
            block_claim_duration: Family::new_with_constructor(control_histogram),
            control_duration: Family::new_with_constructor(control_histogram),
            pending_del_replayed: Counter::default(),
            cutovers: Family::default(),
            cutover_duration: Family::new_with_constructor(cutover_histogram),
        };
        // Series that exist from the start, so that a dashboard shows 0
        // rather than nothing before the first event.
        for verb in VERBS {
            drop(m.cni_in_flight.get_or_create(&Verb { verb: verb.into() }));
        }
        for kind in ["pod", "pool"] {
            let k = Kind { kind: kind.into() };
            drop(m.block_claims.get_or_create(&k));
            drop(m.block_claim_duration.get_or_create(&k));
        }
        for trigger in ["rarp", "garp", "annotation", "admin", "target-failed"] {
            let t = Trigger {
                trigger: trigger.into(),
            };
            drop(m.cutovers.get_or_create(&t));
            drop(m.cutover_duration.get_or_create(&t));
        }
        m
    }

    /// A CNI request of `verb` starts; the returned guard counts it in
    /// flight until it is dropped.
    pub fn cni_started(&'static self, verb: &'static str) -> InFlight {
        self.cni_in_flight
            .get_or_create(&Verb { verb: verb.into() })
            .inc();
        InFlight {
            verb,
            started: Instant::now(),
            metrics: self,
        }
    }

    /// A block was claimed: `kind` is "pod" (cluster mode's blocks) or
    /// "pool" (named pools' blocks).
    pub fn block_claimed(&self, kind: &'static str, took: Duration) {
        let k = Kind { kind: kind.into() };
        self.block_claims.get_or_create(&k).inc();
        self.block_claim_duration
            .get_or_create(&k)
            .observe(took.as_secs_f64());
    }

    /// A queued DEL was replayed.
    pub fn pending_del_replayed(&self) {
        self.pending_del_replayed.inc();
    }

    /// This node cut a VM over: `took` from the announcement (or call) to
    /// the route on this node, or to the record's commit when the VM's new
    /// pod is on another node.
    pub fn cutover(&self, trigger: &'static str, took: Duration) {
        let t = Trigger {
            trigger: trigger.into(),
        };
        self.cutovers.get_or_create(&t).inc();
        self.cutover_duration
            .get_or_create(&t)
            .observe(took.as_secs_f64());
    }

    fn control_request(&self, backend: &'static str, operation: &'static str, took: Duration) {
        self.control_duration
            .get_or_create(&BackendOp {
                backend: backend.into(),
                operation: operation.into(),
            })
            .observe(took.as_secs_f64());
    }

    fn register(&self, r: &mut Registry) {
        r.register(
            "tether_cni_request_duration_seconds",
            "Time to answer a CNI request, by verb and result code (0: success)",
            self.cni_duration.clone(),
        );
        r.register(
            "tether_cni_requests_in_flight",
            "CNI requests being answered now, by verb",
            self.cni_in_flight.clone(),
        );
        r.register(
            "tether_ipam_block_claims",
            "Address blocks this node claimed in the control plane, by kind (pod: cluster CIDR blocks; pool: named pools' blocks)",
            self.block_claims.clone(),
        );
        r.register(
            "tether_ipam_block_claim_duration_seconds",
            "Time to claim an address block (list and compare-and-swap), by kind",
            self.block_claim_duration.clone(),
        );
        r.register(
            "tether_control_plane_request_duration_seconds",
            "Time of a control-plane request, by backend and operation",
            self.control_duration.clone(),
        );
        r.register(
            "tether_pending_del_replayed",
            "DELs the plugin queued while the daemon was unreachable, replayed since start",
            self.pending_del_replayed.clone(),
        );
        r.register(
            "tether_vm_cutovers",
            "VM cutovers this node made, by trigger",
            self.cutovers.clone(),
        );
        r.register(
            "tether_vm_cutover_duration_seconds",
            "Time from a cutover's trigger to the VM's route on this node (or to the record's commit when the VM's new pod is elsewhere), by trigger",
            self.cutover_duration.clone(),
        );
    }
}

/// A CNI request in flight; dropping it ends it. [`InFlight::finish`]
/// records its latency with its result code.
pub struct InFlight {
    verb: &'static str,
    started: Instant,
    metrics: &'static Metrics,
}

impl InFlight {
    /// The request ended with CNI code `code` (0: success).
    pub fn finish(self, code: u32) {
        self.metrics
            .cni_duration
            .get_or_create(&VerbCode {
                verb: self.verb.into(),
                code: code.to_string(),
            })
            .observe(self.started.elapsed().as_secs_f64());
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.metrics
            .cni_in_flight
            .get_or_create(&Verb {
                verb: self.verb.into(),
            })
            .dec();
    }
}

/// The state metrics, read from the node at every scrape.
pub struct NodeCollector {
    node: Arc<Node>,
}

impl std::fmt::Debug for NodeCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeCollector")
            .field("node", &self.node.config().name)
            .finish()
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    pool: String,
    family: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: String,
}

fn sat(n: u128) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn family_name(f: IpFamily) -> &'static str {
    match f {
        IpFamily::V4 => "ipv4",
        IpFamily::V6 => "ipv6",
    }
}

/// One gauge family of several label sets.
fn gauges<L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    values: &[(L, i64)],
) -> std::fmt::Result {
    let mut family = encoder.encode_descriptor(
        name,
        help,
        None,
        prometheus_client::metrics::MetricType::Gauge,
    )?;
    for (labels, v) in values {
        ConstGauge::new(*v).encode(family.encode_family(labels)?)?;
    }
    Ok(())
}

/// One gauge without labels.
fn gauge(encoder: &mut DescriptorEncoder, name: &str, help: &str, v: i64) -> std::fmt::Result {
    let one = encoder.encode_descriptor(
        name,
        help,
        None,
        prometheus_client::metrics::MetricType::Gauge,
    )?;
    ConstGauge::new(v).encode(one)
}

/// One counter family of several label sets.
fn counters<L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    values: &[(L, u64)],
) -> std::fmt::Result {
    let mut family = encoder.encode_descriptor(
        name,
        help,
        None,
        prometheus_client::metrics::MetricType::Counter,
    )?;
    for (labels, v) in values {
        ConstCounter::new(*v).encode(family.encode_family(labels)?)?;
    }
    Ok(())
}

impl NodeCollector {
    /// The pools: the node's pod CIDRs (or blocks, in cluster mode) per
    /// family as pool "pod", and each named pool. (labels, size, used,
    /// free).
    fn pools(&self) -> Vec<(PoolLabels, i64, i64, i64)> {
        let mut out: Vec<(PoolLabels, i64, i64, i64)> = Vec::new();
        for family in [IpFamily::V4, IpFamily::V6] {
            let of: Vec<(u128, u128)> = self
                .node
                .pool_usage()
                .iter()
                .filter(|(cidr, _, _)| IpFamily::of(cidr) == family)
                .map(|(_, used, free)| (*used, *free))
                .collect();
            if of.is_empty() {
                continue;
            }
            let used: u128 = of.iter().map(|u| u.0).sum();
            let free: u128 = of.iter().map(|u| u.1).sum();
            out.push((
                PoolLabels {
                    pool: "pod".into(),
                    family: family_name(family).into(),
                },
                sat(used.saturating_add(free)),
                sat(used),
                sat(free),
            ));
        }
        for u in self.node.named_pools().usage() {
            let family = match (&u.def, u.blocks.first()) {
                (Some(d), _) => d.family(),
                (None, Some(b)) => IpFamily::of(&b.0),
                (None, None) => continue,
            };
            out.push((
                PoolLabels {
                    pool: u.name.clone(),
                    family: family_name(family).into(),
                },
                sat(u.size),
                sat(u.used),
                sat(u.free),
            ));
        }
        out
    }
}

impl Collector for NodeCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let pools = self.pools();
        let pick = |i: usize| -> Vec<(PoolLabels, i64)> {
            pools
                .iter()
                .map(|p| (p.0.clone(), [p.1, p.2, p.3][i]))
                .collect()
        };
        gauges(
            &mut encoder,
            "tether_ipam_pool_size_addresses",
            "Addresses a pool may hand out: for pool=\"pod\", this node's pod CIDRs or blocks; for a named pool, the whole pool on every node.",
            &pick(0),
        )?;
        gauges(
            &mut encoder,
            "tether_ipam_pool_used_addresses",
            "Addresses of a pool held by attachments on this node.",
            &pick(1),
        )?;
        gauges(
            &mut encoder,
            "tether_ipam_pool_free_addresses",
            "Addresses free in this node's part of a pool (its pod CIDRs or blocks).",
            &pick(2),
        )?;
        let queue = crate::api::pending_del::queue_len(&self.node.config().state_dir);
        gauge(
            &mut encoder,
            "tether_pending_del_queue_length",
            "DELs queued on disk by the plugin and not replayed yet.",
            i64::try_from(queue).unwrap_or(i64::MAX),
        )?;
        let (d, served) = self.node.guest_dhcp_stats();
        let kind = |k: &str| KindLabel { kind: k.into() };
        counters(
            &mut encoder,
            "tether_dhcp_packets_served",
            "Answers the guest DHCP service sent to VM guests, by kind.",
            &[
                (kind("dhcpv4"), d.dhcp4),
                (kind("dhcpv6"), d.dhcp6),
                (kind("router_advert"), d.router_adverts),
                (kind("arp"), d.arp),
            ],
        )?;
        let reason = |r: &str| ReasonLabel { reason: r.into() };
        counters(
            &mut encoder,
            "tether_dhcp_packets_dropped",
            "Frames the guest DHCP service did not answer, by reason.",
            &[
                (reason("malformed"), d.malformed),
                (reason("foreign_mac"), d.foreign_mac),
                (reason("unanswered"), d.unanswered),
                (reason("send_error"), d.send_errors),
            ],
        )?;
        gauge(
            &mut encoder,
            "tether_dhcp_served_interfaces",
            "Node-side interfaces the guest DHCP service answers on.",
            i64::try_from(served).unwrap_or(i64::MAX),
        )?;
        gauges(
            &mut encoder,
            "tether_build_info",
            "tetherd's version; always 1.",
            &[(
                BuildLabels {
                    version: env!("CARGO_PKG_VERSION").into(),
                },
                1,
            )],
        )?;
        Ok(())
    }
}

/// Every metric, event and state, in one registry for `node`.
pub fn registry(node: Arc<Node>) -> Registry {
    let mut r = Registry::default();
    get().register(&mut r);
    r.register_collector(Box::new(NodeCollector { node }));
    r
}

/// The text a scrape returns.
pub fn render(registry: &Registry) -> Result<String> {
    let mut out = String::with_capacity(16 * 1024);
    prometheus_client::encoding::prometheus_text::encode(&mut out, registry)
        .map_err(|e| Error::Internal(format!("encoding the metrics: {e}")))?;
    Ok(out)
}

/// Binds the metrics address: done first thing at start, so that a taken
/// port fails the daemon before it touches any state.
pub async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| Error::InvalidConfig(format!("--metrics-address {addr}: cannot listen: {e}")))
}

/// Serves `/metrics` of `node` on `listener` from a task, and `/readyz`:
/// 200 while the daemon's state store answers ([`Node::ready`]), 503 with
/// the reason otherwise; the DaemonSet's readiness probe (an HTTP GET, so
/// no process is started in the container every few seconds).
pub fn serve(listener: tokio::net::TcpListener, node: Arc<Node>) {
    use axum::http::{header, StatusCode};
    use axum::response::IntoResponse;
    let addr = listener
        .local_addr()
        .map_or_else(|e| e.to_string(), |a| a.to_string());
    let ready_node = node.clone();
    let registry = Arc::new(registry(node));
    let app = axum::Router::new()
        .route(
            "/readyz",
            axum::routing::get(move || {
                let node = ready_node.clone();
                async move {
                    match node.ready().await {
                        Ok(()) => (StatusCode::OK, "ok\n".to_owned()).into_response(),
                        Err(e) => {
                            (StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n")).into_response()
                        }
                    }
                }
            }),
        )
        .route(
            "/metrics",
            axum::routing::get(move || {
                let registry = registry.clone();
                async move {
                    match render(&registry) {
                        Ok(text) => (
                            StatusCode::OK,
                            [(
                                header::CONTENT_TYPE,
                                prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
                            )],
                            text,
                        )
                            .into_response(),
                        Err(e) => {
                            (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response()
                        }
                    }
                }
            }),
        );
    tracing::info!(%addr, "serving metrics at /metrics, readiness at /readyz");
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(%addr, error = %e, "the metrics server stopped");
        }
    });
}

/// A control store that times every request into
/// `tether_control_plane_request_duration_seconds`.
pub struct TimedControl {
    inner: Arc<dyn ControlStore>,
}

impl TimedControl {
    /// Wraps `inner`.
    pub fn wrap(inner: Arc<dyn ControlStore>) -> Arc<dyn ControlStore> {
        Arc::new(TimedControl { inner })
    }
}

fn timed<'a, T: Send + 'a>(
    backend: &'static str,
    operation: &'static str,
    fut: BoxFut<'a, T>,
) -> BoxFut<'a, T> {
    Box::pin(async move {
        let started = Instant::now();
        let out = fut.await;
        get().control_request(backend, operation, started.elapsed());
        out
    })
}

impl ControlStore for TimedControl {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn location(&self) -> String {
        self.inner.location()
    }
    fn list(&self, prefix: &str) -> BoxFut<'_, (Vec<crate::control::Kv>, i64)> {
        timed(self.inner.backend(), "list", self.inner.list(prefix))
    }
    fn commit(&self, when: Vec<Cmp>, ops: Vec<Op>) -> BoxFut<'_, Option<i64>> {
        timed(self.inner.backend(), "commit", self.inner.commit(when, ops))
    }
    fn txn(&self, when: Vec<Cmp>, ops: Vec<Op>) -> BoxFut<'_, bool> {
        timed(self.inner.backend(), "txn", self.inner.txn(when, ops))
    }
    fn watch(
        &self,
        prefix: &str,
        after: i64,
    ) -> BoxFut<'_, tokio::sync::mpsc::Receiver<WatchMessage>> {
        timed(
            self.inner.backend(),
            "watch",
            self.inner.watch(prefix, after),
        )
    }
    fn grant_lease(&self, ttl_secs: i64) -> BoxFut<'_, i64> {
        timed(
            self.inner.backend(),
            "grant_lease",
            self.inner.grant_lease(ttl_secs),
        )
    }
    fn keep_alive(&self, lease: i64) -> BoxFut<'_, bool> {
        timed(
            self.inner.backend(),
            "keep_alive",
            self.inner.keep_alive(lease),
        )
    }
    fn probe(&self) -> BoxFut<'_, ()> {
        timed(self.inner.backend(), "probe", self.inner.probe())
    }
}

/// The metric names of a scrape (`# TYPE` lines), for tests and checks.
pub fn names(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests;
