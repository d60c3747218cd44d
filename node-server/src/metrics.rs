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
//!   by `api::scrape`'s collector, so they can never drift from what the
//!   admin API shows. That side, and the HTTP endpoint, sit with the API:
//!   this module reads no `Node` and is a leaf below every feature.

use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use tether_base::error::{Error, Result};
use tether_store::control::{BoxFut, Cmp, ControlStore, Op, WatchMessage};

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
    control_requests: Counter,
    routes_changed: Family<RouteKind, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteKind {
    kind: String,
}

/// What this process has cost since it started, in the units that do not
/// depend on the machine: the control plane's requests and watch events,
/// the routes it changed, and its CPU time ([`Metrics::costs`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Costs {
    /// Control-plane requests begun (every operation of [`TimedControl`]).
    pub control_requests: u64,
    /// Watch events received from the control plane's server
    /// ([`tether_store::control::watch_events_received`]).
    pub watch_events: u64,
    /// Routes to other nodes' blocks and to VMs (and VXLAN peers) added,
    /// replaced or removed, and host routes a VM's pass put back.
    pub routes_changed: u64,
    /// The process's CPU time, user and system, in microseconds
    /// (`getrusage(RUSAGE_SELF)`: every thread, ended ones too).
    pub cpu_user_micros: u64,
    pub cpu_system_micros: u64,
}

/// This process's user and system CPU time in microseconds; zeros if the
/// kernel refuses (it does not for `RUSAGE_SELF`).
fn cpu_micros() -> (u64, u64) {
    // SAFETY: `getrusage` writes one `rusage` into the zeroed value it is
    // given, which lives across the call; RUSAGE_SELF is always valid.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    if rc != 0 {
        return (0, 0);
    }
    let micros = |t: libc::timeval| (t.tv_sec.max(0) as u64) * 1_000_000 + t.tv_usec.max(0) as u64;
    (micros(ru.ru_utime), micros(ru.ru_stime))
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
            control_requests: Counter::default(),
            routes_changed: Family::default(),
        };
        for kind in ["block", "vm"] {
            drop(
                m.routes_changed
                    .get_or_create(&RouteKind { kind: kind.into() }),
            );
        }
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

    /// Route passes changed `n` routes: `kind` is "block" (routes to
    /// other nodes' blocks, VXLAN peers) or "vm" (routes that follow VMs).
    pub fn routes_changed(&self, kind: &'static str, n: usize) {
        if n > 0 {
            self.routes_changed
                .get_or_create(&RouteKind { kind: kind.into() })
                .inc_by(n as u64);
        }
    }

    /// What this process has cost since it started.
    pub fn costs(&self) -> Costs {
        let (cpu_user_micros, cpu_system_micros) = cpu_micros();
        Costs {
            control_requests: self.control_requests.get(),
            watch_events: tether_store::control::watch_events_received(),
            routes_changed: ["block", "vm"]
                .iter()
                .filter_map(|k| self.routes_changed.get(&RouteKind { kind: (*k).into() }))
                .map(|c| c.get())
                .sum(),
            cpu_user_micros,
            cpu_system_micros,
        }
    }

    fn control_request(&self, backend: &'static str, operation: &'static str, took: Duration) {
        self.control_requests.inc();
        self.control_duration
            .get_or_create(&BackendOp {
                backend: backend.into(),
                operation: operation.into(),
            })
            .observe(took.as_secs_f64());
    }

    /// Registers every event metric in `r`.
    pub fn register(&self, r: &mut Registry) {
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
            "tether_routes_changed",
            "Routes this node's passes added, replaced or removed, by kind (block: to other nodes' blocks, and VXLAN peers; vm: routes that follow VMs)",
            self.routes_changed.clone(),
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

/// The text a scrape returns.
pub fn render(registry: &Registry) -> Result<String> {
    let mut out = String::with_capacity(16 * 1024);
    prometheus_client::encoding::prometheus_text::encode(&mut out, registry)
        .map_err(|e| Error::Internal(format!("encoding the metrics: {e}")))?;
    Ok(out)
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
    fn list(&self, prefix: &str) -> BoxFut<'_, (Vec<tether_store::control::Kv>, i64)> {
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
