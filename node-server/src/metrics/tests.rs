use super::*;
use tether_store::control::embedded::EmbeddedStore;

/// A metrics set of its own (the process-wide one is fed by every test).
fn fresh() -> &'static Metrics {
    Box::leak(Box::new(Metrics::new()))
}

fn text_of(m: &Metrics) -> String {
    let mut r = Registry::default();
    m.register(&mut r);
    render(&r).unwrap_or_else(|e| panic!("{e}"))
}

/// The value of the sample line that starts with `series` (name and
/// labels exactly as rendered).
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

#[test]
fn cni_requests_are_counted_by_verb_and_code_and_leave_flight() {
    let m = fresh();
    let a = m.cni_started("ADD");
    let b = m.cni_started("ADD");
    let c = m.cni_started("DEL");
    let text = text_of(m);
    assert_eq!(
        value(&text, r#"tether_cni_requests_in_flight{verb="ADD"}"#),
        Some(2.0)
    );
    assert_eq!(
        value(&text, r#"tether_cni_requests_in_flight{verb="DEL"}"#),
        Some(1.0)
    );
    a.finish(0);
    b.finish(7);
    c.finish(0);
    let text = text_of(m);
    for verb in VERBS {
        let series = format!(r#"tether_cni_requests_in_flight{{verb="{verb}"}}"#);
        assert_eq!(value(&text, &series), Some(0.0), "{verb}\n{text}");
    }
    let count = |verb: &str, code: &str| {
        value(
            &text,
            &format!(r#"tether_cni_request_duration_seconds_count{{verb="{verb}",code="{code}"}}"#),
        )
    };
    assert_eq!(count("ADD", "0"), Some(1.0));
    assert_eq!(count("ADD", "7"), Some(1.0));
    assert_eq!(count("DEL", "0"), Some(1.0));
    // The +Inf bucket holds every observation, and the buckets are
    // cumulative.
    assert_eq!(
        value(
            &text,
            r#"tether_cni_request_duration_seconds_bucket{verb="ADD",code="0",le="+Inf"}"#
        ),
        Some(1.0),
        "{text}"
    );
    assert!(text.contains("# TYPE tether_cni_request_duration_seconds histogram"));
}

#[test]
fn claims_cutovers_and_replays_have_their_series_from_the_start() {
    let m = fresh();
    let text = text_of(m);
    for series in [
        r#"tether_ipam_block_claims_total{kind="pod"}"#,
        r#"tether_ipam_block_claims_total{kind="pool"}"#,
        r#"tether_vm_cutovers_total{trigger="rarp"}"#,
        r#"tether_vm_cutovers_total{trigger="annotation"}"#,
        "tether_pending_del_replayed_total",
    ] {
        assert_eq!(value(&text, series), Some(0.0), "{series}\n{text}");
    }
    m.block_claimed("pool", Duration::from_millis(3));
    m.cutover("rarp", Duration::from_micros(800));
    m.pending_del_replayed();
    let text = text_of(m);
    assert_eq!(
        value(&text, r#"tether_ipam_block_claims_total{kind="pool"}"#),
        Some(1.0)
    );
    assert_eq!(
        value(
            &text,
            r#"tether_ipam_block_claim_duration_seconds_sum{kind="pool"}"#
        ),
        Some(0.003)
    );
    assert_eq!(
        value(
            &text,
            r#"tether_vm_cutover_duration_seconds_bucket{trigger="rarp",le="0.001"}"#
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        value(
            &text,
            r#"tether_vm_cutover_duration_seconds_bucket{trigger="rarp",le="0.0005"}"#
        ),
        Some(0.0)
    );
    assert_eq!(value(&text, "tether_pending_del_replayed_total"), Some(1.0));
}

#[tokio::test]
async fn the_control_plane_wrapper_times_every_operation() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let store = EmbeddedStore::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
    let timed = TimedControl::wrap(Arc::new(store));
    assert_eq!(timed.backend(), "embedded");
    let before = text_of(get());
    let series = r#"tether_control_plane_request_duration_seconds_count{backend="embedded",operation="txn"}"#;
    let was = value(&before, series).unwrap_or(0.0);
    let put = Op::Put {
        key: "/t/a".into(),
        value: b"1".to_vec(),
        lease: None,
    };
    assert!(timed
        .txn(vec![Cmp::Absent("/t/a".into())], vec![put])
        .await
        .unwrap_or_else(|e| panic!("{e}")));
    let (kvs, _) = timed.list("/t/").await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(kvs.len(), 1);
    let after = text_of(get());
    // Other tests feed the same process-wide metrics: at least ours.
    assert!(value(&after, series).unwrap_or(0.0) >= was + 1.0, "{after}");
    assert!(value(
        &after,
        r#"tether_control_plane_request_duration_seconds_count{backend="embedded",operation="list"}"#
    )
    .is_some_and(|n| n >= 1.0));
}

#[tokio::test]
async fn the_costs_count_requests_watch_events_and_cpu_time() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let store = EmbeddedStore::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
    let timed = TimedControl::wrap(Arc::new(store));
    let before = get().costs();
    let mut rx = timed
        .watch("/w/", 0)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for k in ["/w/a", "/w/b", "/w/c"] {
        let put = Op::Put {
            key: k.into(),
            value: b"1".to_vec(),
            lease: None,
        };
        assert!(timed
            .txn(vec![Cmp::Absent(k.into())], vec![put])
            .await
            .unwrap_or_else(|e| panic!("{e}")));
    }
    let mut seen = 0;
    while seen < 3 {
        match tokio::time::timeout(Duration::from_secs(5), rx.recv()).await {
            Ok(Some(WatchMessage::Events(events))) => seen += events.len(),
            other => panic!("the watch gave {other:?} after {seen} changes"),
        }
    }
    // Spin a little, so that the CPU time moves past the clock's grain.
    let spin = Instant::now();
    let mut x = 0u64;
    while spin.elapsed() < Duration::from_millis(30) {
        x = x.wrapping_mul(31).wrapping_add(7);
    }
    std::hint::black_box(x);
    let after = get().costs();
    // Other tests feed the same process-wide counters: at least ours.
    assert!(after.watch_events >= before.watch_events + 3, "{after:?}");
    // The watch and three transactions.
    assert!(
        after.control_requests >= before.control_requests + 4,
        "{after:?}"
    );
    assert!(
        after.cpu_user_micros + after.cpu_system_micros
            >= before.cpu_user_micros + before.cpu_system_micros + 10_000,
        "{before:?} -> {after:?}"
    );
    let text = text_of(get());
    assert!(
        value(&text, r#"tether_routes_changed_total{kind="vm"}"#).is_some(),
        "{text}"
    );
}
