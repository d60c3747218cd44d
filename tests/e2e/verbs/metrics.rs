//! tetherd's Prometheus endpoint (`--metrics-address`), scraped for real:
//! the daemon listens on the loopback of its own node netns, and `curl`
//! scrapes it from inside that netns. Debian's `promtool check metrics`
//! must accept the scrape; a burst of 40 concurrent ADDs through the real
//! plugin is scraped while it runs and after, and the counts must add up;
//! and every metric the Grafana dashboard of the Helm chart
//! (`install/helm/tether/dashboards/tether.json`) queries must exist.
//!
//! Run as root, after `tests/setup.sh` (which installs curl and promtool).

use std::collections::BTreeSet;
use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tether_e2e::{
    add, del, parallel, require_root, tether_bin, workspace_dir, Daemon, DaemonOpts, Netns,
};

use crate::harness::shared::ticked;

const POD_CIDR: &str = "10.247.0.0/24";
const METRICS: &str = "127.0.0.1:9654";
const BURST: usize = 40;

fn scrape(daemon: &Daemon) -> String {
    let url = format!("http://{METRICS}/metrics");
    let out = daemon
        .node()
        .exec(&["curl", "-sS", "--fail", "--max-time", "5", &url]);
    assert!(
        out.status.success(),
        "curl {url} in {} failed: {}",
        daemon.node().name(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("the exposition format is UTF-8")
}

/// The value of the sample `series` (name and labels as rendered).
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

/// The sum of every sample of `name` whose labels contain `filter`.
fn sum(text: &str, name: &str, filter: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|l| l.contains(filter))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

fn adds_ok(text: &str) -> f64 {
    value(
        text,
        r#"tether_cni_request_duration_seconds_count{verb="ADD",code="0"}"#,
    )
    .unwrap_or(0.0)
}

fn dels_ok(text: &str) -> f64 {
    value(
        text,
        r#"tether_cni_request_duration_seconds_count{verb="DEL",code="0"}"#,
    )
    .unwrap_or(0.0)
}

fn used(text: &str) -> f64 {
    value(
        text,
        r#"tether_ipam_pool_used_addresses{pool="pod",family="ipv4"}"#,
    )
    .unwrap_or_else(|| panic!("no pod pool usage in:\n{text}"))
}

fn in_flight(text: &str, verb: &str) -> f64 {
    value(
        text,
        &format!(r#"tether_cni_requests_in_flight{{verb="{verb}"}}"#),
    )
    .unwrap_or_else(|| panic!("no in-flight gauge for {verb} in:\n{text}"))
}

fn promtool_check(text: &str) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian's prometheus package; tests/setup.sh installs it)");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("feeding promtool");
    let out = child.wait_with_output().expect("promtool");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool check metrics refused the scrape ({}): {said}\n---\n{text}",
        out.status
    );
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn metrics_pass_promtool_and_add_up_during_a_burst() {
    require_root();
    let daemon = Daemon::start(DaemonOpts {
        pod_cidrs: vec![POD_CIDR.into()],
        extra_args: vec!["--metrics-address".into(), METRICS.into()],
        ..Default::default()
    });
    let before = scrape(&daemon);
    promtool_check(&before);
    assert_eq!(in_flight(&before, "ADD"), 0.0);
    assert_eq!(value(&before, "tether_pending_del_queue_length"), Some(0.0));
    let used_before = used(&before);
    let adds_before = adds_ok(&before);

    // The burst: 40 ADDs released together, scraped while they run.
    let conf = daemon.netconf("1.0.0", "metrics");
    let pods: Vec<Netns> = (0..BURST).map(|_| Netns::new("mp")).collect();
    let running = AtomicBool::new(true);
    let mut during = Vec::new();
    std::thread::scope(|s| {
        let scraper = s.spawn(|| {
            let mut seen = Vec::new();
            while running.load(Ordering::SeqCst) {
                seen.push(scrape(&daemon));
                std::thread::sleep(Duration::from_millis(5));
            }
            seen
        });
        let outs = parallel(BURST, |i| {
            add(&tether_bin(), &conf, pods[i].name(), &pods[i])
        });
        running.store(false, Ordering::SeqCst);
        for o in &outs {
            o.assert_success();
        }
        during = scraper.join().expect("the scraper");
    });
    assert!(!during.is_empty());
    let most = during
        .iter()
        .map(|t| in_flight(t, "ADD"))
        .fold(0.0, f64::max);
    eprintln!(
        "{} scrapes during the burst of {BURST} ADDs; at most {most} ADDs in flight in one",
        during.len()
    );
    // Every scrape taken during the burst is consistent: no more requests
    // done or in flight than were sent, and an address is held for every
    // ADD already answered.
    for text in &during {
        let done = adds_ok(text) - adds_before;
        let flying = in_flight(text, "ADD");
        let held = used(text) - used_before;
        assert!(
            (0.0..=BURST as f64).contains(&done) && done + flying <= BURST as f64,
            "done {done}, in flight {flying}"
        );
        assert!(
            held >= done && held <= BURST as f64,
            "held {held}, done {done}"
        );
    }
    let after = scrape(&daemon);
    promtool_check(&after);
    assert_eq!(adds_ok(&after) - adds_before, BURST as f64);
    assert_eq!(used(&after) - used_before, BURST as f64);
    assert_eq!(in_flight(&after, "ADD"), 0.0);
    // The histogram's buckets agree with its count.
    assert_eq!(
        value(
            &after,
            r#"tether_cni_request_duration_seconds_bucket{verb="ADD",code="0",le="+Inf"}"#
        ),
        Some(adds_ok(&after))
    );
    let free = value(
        &after,
        r#"tether_ipam_pool_free_addresses{pool="pod",family="ipv4"}"#,
    );
    let size = value(
        &after,
        r#"tether_ipam_pool_size_addresses{pool="pod",family="ipv4"}"#,
    );
    assert_eq!(size.zip(free).map(|(s, f)| s - f), Some(used(&after)));

    // An ADD that fails is counted under its code.
    let bad = add(&tether_bin(), &conf, pods[0].name(), &Netns::new("mp"));
    let code = bad.error_code().expect("a conflicting ADD fails");
    let failed = scrape(&daemon);
    assert_eq!(
        value(
            &failed,
            &format!(r#"tether_cni_request_duration_seconds_count{{verb="ADD",code="{code}"}}"#)
        ),
        Some(1.0),
        "{failed}"
    );

    // The DELs.
    let dels_before = dels_ok(&failed);
    let outs = parallel(BURST, |i| {
        del(&tether_bin(), &conf, pods[i].name(), &pods[i])
    });
    for o in &outs {
        o.assert_success();
    }
    let done = scrape(&daemon);
    assert_eq!(dels_ok(&done) - dels_before, BURST as f64);
    assert_eq!(used(&done), used_before);
    assert_eq!(in_flight(&done, "DEL"), 0.0);
    promtool_check(&done);

    // Every metric the dashboard queries exists in a real scrape.
    let dashboard =
        std::fs::read_to_string(workspace_dir().join("install/helm/tether/dashboards/tether.json"))
            .expect("install/helm/tether/dashboards/tether.json");
    let json: serde_json::Value = serde_json::from_str(&dashboard).expect("the dashboard is JSON");
    let mut queried = BTreeSet::new();
    for panel in json["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().expect("an expr");
            let mut rest = expr;
            while let Some(i) = rest.find("tether_") {
                let name: String = rest[i..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                rest = &rest[i + name.len()..];
                queried.insert(name);
            }
        }
    }
    assert!(queried.len() >= 10, "{queried:?}");
    let families: BTreeSet<String> = done
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect();
    for name in &queried {
        let base = ["_bucket", "_count", "_sum"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .filter(|b| families.contains(*b))
            .unwrap_or(name);
        assert!(
            families.contains(base),
            "the dashboard queries {name}, which the scrape does not have: {families:?}"
        );
    }
    // And a summed value stays sane: no negative gauges.
    assert!(sum(&done, "tether_ipam_pool_free_addresses", "") >= 0.0);

    // The book's metrics table (docs/user/metrics.md) against the scrape:
    // every family the scrape has is a row, with its type, and each row's
    // labels are those of the family's samples (a family with no sample
    // yet, such as the cutovers here, shows no labels to compare).
    let page = std::fs::read_to_string(workspace_dir().join("docs/user/metrics.md"))
        .expect("docs/user/metrics.md");
    let rows: Vec<(String, String, BTreeSet<String>)> = page
        .lines()
        .filter(|l| l.starts_with("| `tether_"))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let name = ticked(cells[1]).remove(0);
            let labels = ticked(cells[3]).into_iter().collect();
            (name, cells[2].to_string(), labels)
        })
        .collect();
    let types: Vec<(String, String)> = done
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            Some((w.next()?.to_owned(), w.next()?.to_owned()))
        })
        .collect();
    for (family, kind) in &types {
        // A counter's samples end in _total, which its row names.
        let row = rows
            .iter()
            .find(|(n, _, _)| n == family || *n == format!("{family}_total"))
            .unwrap_or_else(|| panic!("docs/user/metrics.md has no row for {family}"));
        assert_eq!(&row.1, kind, "{family}'s type in docs/user/metrics.md");
        let mut seen: BTreeSet<String> = BTreeSet::new();
        for sample in done
            .lines()
            .filter(|l| !l.starts_with('#') && l.starts_with(family.as_str()) && l.contains('{'))
        {
            let labels = sample
                .split_once('{')
                .and_then(|(_, r)| r.split_once('}'))
                .map(|(ls, _)| ls)
                .unwrap_or_default();
            for pair in labels.split(',').filter(|p| !p.is_empty()) {
                let key = pair.split('=').next().unwrap_or_default();
                if key != "le" {
                    seen.insert(key.to_owned());
                }
            }
        }
        if !seen.is_empty() {
            assert_eq!(
                seen, row.2,
                "{family}: the labels of its samples vs docs/user/metrics.md's row"
            );
        }
    }
}

#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn metrics_are_off_by_default_and_a_taken_port_fails_the_start() {
    require_root();
    let daemon = Daemon::start(DaemonOpts {
        pod_cidrs: vec![POD_CIDR.into()],
        ..Default::default()
    });
    let out = daemon.node().exec(&[
        "curl",
        "-sS",
        "--max-time",
        "2",
        &format!("http://{METRICS}/metrics"),
    ]);
    assert!(!out.status.success(), "something answers on {METRICS}");
    assert!(!daemon.log().contains("serving metrics"));
    // A daemon cannot take a metrics port that is in use: it fails at
    // start, saying why. (In a netns of its own: a second daemon in this
    // one is refused before it looks at the port.)
    let other = Netns::new("m");
    let sock = other.run(|| std::net::TcpListener::bind(METRICS).expect("bind in the netns"));
    let dir = tether_e2e::TempDir::new("m");
    let out = other.exec(&[
        &tether_e2e::tetherd_bin().display().to_string(),
        "--node-name",
        "m",
        "--pod-cidr",
        "10.247.1.0/24",
        "--socket",
        &dir.path().join("s.sock").display().to_string(),
        "--state-dir",
        &dir.path().display().to_string(),
        "--metrics-address",
        METRICS,
    ]);
    drop(sock);
    let said =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(
        !out.status.success(),
        "tetherd started on a taken metrics port: {said}"
    );
    assert!(said.contains("--metrics-address"), "{said}");
}

/// `/readyz`, the DaemonSet's readiness probe, answers 200 while the daemon
/// serves, and stays 200 when the node's pool is full (STATUS says so to
/// the runtime; a full node must not hold up a rolling update).
#[cfg_attr(
    not(feature = "root-tests"),
    ignore = "root tier: needs root; `make test` runs it"
)]
#[test]
fn readyz_is_ok_while_serving_even_with_a_full_pool() {
    require_root();
    // A /30: two usable addresses, one taken by the node side.
    let daemon = Daemon::start(DaemonOpts {
        pod_cidrs: vec!["10.247.9.0/30".into()],
        extra_args: vec!["--metrics-address".into(), METRICS.into()],
        ..Default::default()
    });
    let readyz = |daemon: &Daemon| {
        let url = format!("http://{METRICS}/readyz");
        let out = daemon.node().exec(&[
            "curl",
            "-sS",
            "--max-time",
            "5",
            "-o",
            "/dev/stdout",
            "-w",
            " %{http_code}",
            &url,
        ]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert_eq!(readyz(&daemon), "ok\n 200");
    let conf = daemon.netconf("1.0.0", "readyz");
    let mut pods = Vec::new();
    let mut full = false;
    for i in 0..4 {
        let ns = Netns::new("rz");
        let out = add(&tether_bin(), &conf, &format!("rz{i}"), &ns);
        pods.push((format!("rz{i}"), ns));
        if out.status != 0 {
            full = true;
            break;
        }
    }
    assert!(full, "a /30 took four pods");
    assert_eq!(
        readyz(&daemon),
        "ok\n 200",
        "a full pool made the daemon unready"
    );
    for (id, ns) in &pods {
        del(&tether_bin(), &conf, id, ns);
    }
}
