//! Events on pods, so that what goes wrong reaches the pod's owner
//! (`kubectl describe pod`, `kubectl get events`) and not only the
//! kubelet's log: an address conflict, an exhausted pool, a VM's cutover.
//!
//! Emitting never waits: an event goes into a bounded queue, which one task
//! drains into the API (`events.k8s.io/v1`, through kube's recorder, which
//! folds repeats of one event into a series). Two limits keep a storm of
//! failing ADDs from flooding the API server: one event per pod and reason
//! per [`PER_POD_INTERVAL`], and at most [`BURST`] events per second in
//! all. What a limit or a full queue drops is counted and logged.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
pub use tether_base::pod_event::{PodEvent, PodRef};
use tether_base::time::UnixMillis;
use tokio::sync::mpsc;

/// One event per pod and reason at most this often.
pub const PER_POD_INTERVAL: Duration = Duration::from_secs(30);
/// At most this many events per second from this node.
pub const BURST: u32 = 10;
/// Events waiting to be written; more are dropped.
const QUEUE: usize = 256;
/// The component the events name (`reportingController`).
pub const REPORTER: &str = "tether.dev/tetherd";

/// The API's reference to `pod`.
fn object_ref(pod: &PodRef) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some(pod.namespace.clone()),
        name: Some(pod.name.clone()),
        uid: pod.uid.clone(),
        ..Default::default()
    }
}

/// The limits: when each (pod, reason) last went out, and the tokens of
/// the per-second bucket.
#[derive(Debug)]
struct Limits {
    last: HashMap<(PodRef, &'static str), Instant>,
    tokens: f64,
    refilled: Instant,
}

impl Limits {
    fn new() -> Self {
        Limits {
            last: HashMap::new(),
            tokens: f64::from(BURST),
            refilled: Instant::now(),
        }
    }

    /// True if an event for `pod` with `reason` may go out now.
    fn admit(&mut self, pod: &PodRef, reason: &'static str, now: Instant) -> bool {
        let key = (pod.clone(), reason);
        if self
            .last
            .get(&key)
            .is_some_and(|t| now.duration_since(*t) < PER_POD_INTERVAL)
        {
            return false;
        }
        let elapsed = now.duration_since(self.refilled).as_secs_f64();
        self.tokens = (self.tokens + elapsed * f64::from(BURST)).min(f64::from(BURST));
        self.refilled = now;
        if self.tokens < 1.0 {
            return false;
        }
        self.tokens -= 1.0;
        self.last
            .retain(|_, t| now.duration_since(*t) < PER_POD_INTERVAL);
        self.last.insert(key, now);
        true
    }
}

/// Where the node's code sends events. Cloning it is cheap.
#[derive(Clone)]
pub struct EventSink {
    tx: mpsc::Sender<(PodRef, PodEvent)>,
    limits: Arc<Mutex<Limits>>,
    dropped: Arc<AtomicU64>,
}

impl EventSink {
    /// A sink and the receiving end of its queue (the writer task, or a
    /// test).
    pub fn channel() -> (EventSink, mpsc::Receiver<(PodRef, PodEvent)>) {
        let (tx, rx) = mpsc::channel(QUEUE);
        (
            EventSink {
                tx,
                limits: Arc::new(Mutex::new(Limits::new())),
                dropped: Arc::default(),
            },
            rx,
        )
    }

    /// Queues an event; never waits. Returns whether it was queued.
    pub fn emit(&self, pod: PodRef, event: PodEvent) -> bool {
        let admitted =
            tether_base::sync::lock(&self.limits).admit(&pod, event.reason(), Instant::now());
        if !admitted {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(pod = %pod.name, reason = event.reason(), "event dropped by the rate limit");
            return false;
        }
        match self.tx.try_send((pod, event)) {
            Ok(()) => true,
            Err(e) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, "event queue full: event dropped");
                false
            }
        }
    }

    /// Events dropped by the limits or a full queue since start.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// Starts the writer task and returns its sink.
pub fn start(client: kube::Client, node: String) -> EventSink {
    let (sink, mut rx) = EventSink::channel();
    let recorder = Recorder::new(
        client,
        Reporter {
            controller: REPORTER.into(),
            instance: Some(node),
        },
    );
    tokio::spawn(async move {
        while let Some((pod, ev)) = rx.recv().await {
            let event = Event {
                type_: if ev.warning() {
                    EventType::Warning
                } else {
                    EventType::Normal
                },
                reason: ev.reason().into(),
                note: Some(truncate(ev.note(), 1000)),
                action: ev.action().into(),
                secondary: None,
            };
            let reference = object_ref(&pod);
            // One retry: an event is worth little once it is late.
            for attempt in 0..2 {
                match super::bounded(recorder.publish(&event, &reference)).await {
                    Ok(()) => {
                        tracing::debug!(pod = %pod.name, reason = ev.reason(), at = %UnixMillis::now(), "event written");
                        break;
                    }
                    Err(e) if attempt == 0 => {
                        tracing::debug!(error = %e, "writing an event failed; once more");
                        tokio::time::sleep(super::backoff(1)).await;
                    }
                    Err(e) => {
                        tracing::warn!(pod = %format!("{}/{}", pod.namespace, pod.name), reason = ev.reason(), error = %e, "cannot write an event")
                    }
                }
            }
        }
    });
    sink
}

/// At most `max` bytes of `s`, cut at a character boundary (the API
/// refuses a note over 1 kB).
fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str) -> PodRef {
        PodRef {
            namespace: "ns".into(),
            name: name.into(),
            uid: None,
        }
    }

    #[test]
    fn one_event_per_pod_and_reason_per_interval() {
        let mut l = Limits::new();
        let t0 = Instant::now();
        assert!(l.admit(&pod("a"), "PoolExhausted", t0));
        assert!(!l.admit(&pod("a"), "PoolExhausted", t0 + Duration::from_secs(1)));
        assert!(l.admit(&pod("a"), "AddressConflict", t0 + Duration::from_secs(1)));
        assert!(l.admit(&pod("b"), "PoolExhausted", t0 + Duration::from_secs(1)));
        assert!(l.admit(
            &pod("a"),
            "PoolExhausted",
            t0 + PER_POD_INTERVAL + Duration::from_secs(1)
        ));
    }

    #[test]
    fn at_most_a_burst_per_second_in_all() {
        let mut l = Limits::new();
        let t0 = Instant::now();
        let admitted = (0..100)
            .filter(|i| l.admit(&pod(&format!("p{i}")), "PoolExhausted", t0))
            .count();
        assert_eq!(admitted, BURST as usize);
        // Refilled a second later.
        let later = t0 + Duration::from_secs(1);
        let admitted = (100..200)
            .filter(|i| l.admit(&pod(&format!("p{i}")), "PoolExhausted", later))
            .count();
        assert_eq!(admitted, BURST as usize);
    }

    #[tokio::test]
    async fn emit_never_waits_and_counts_what_it_drops() {
        let (sink, mut rx) = EventSink::channel();
        assert!(sink.emit(pod("a"), PodEvent::PoolExhausted("no free address".into())));
        assert!(!sink.emit(pod("a"), PodEvent::PoolExhausted("again".into())));
        assert_eq!(sink.dropped(), 1);
        let (p, e) = rx.recv().await.unwrap();
        assert_eq!(p, pod("a"));
        assert_eq!(e.reason(), "PoolExhausted");
    }

    #[test]
    fn notes_are_cut_at_a_character_boundary() {
        let s = "é".repeat(600);
        let t = truncate(&s, 1000);
        assert!(t.len() <= 1000 && s.starts_with(&t));
    }
}
