//! What a Prometheus scrape of `--metrics-address` reads: the process's
//! event metrics ([`crate::metrics`]) and the node's state, read from the
//! [`Node`] at every scrape (pool usage, the DEL queue, the guest DHCP
//! counters, NetworkPolicy's drop counters, which `nft` reads from the
//! kernel); and the HTTP endpoint that serves them with `/readyz`.

use std::net::SocketAddr;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use crate::attach::Node;
use crate::metrics::{get, render};
use tether_base::error::{Error, Result};
use tether_ipam::Family as IpFamily;

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
struct EventLabel {
    event: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PolicyLabels {
    policy: String,
    direction: String,
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

/// One counter without labels.
fn counter(encoder: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> std::fmt::Result {
    let one = encoder.encode_descriptor(
        name,
        help,
        None,
        prometheus_client::metrics::MetricType::Counter,
    )?;
    ConstCounter::new(v).encode(one)
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
        counter(
            &mut encoder,
            "tether_control_plane_watch_events",
            "Watch events received from the control plane's server (etcd's events; the API server's ADDED, MODIFIED and DELETED, Lease renewals included).",
            tether_store::control::watch_events_received(),
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
        let h = self.node.handovers().stats();
        let event = |e: &str| EventLabel { event: e.into() };
        counters(
            &mut encoder,
            "tether_vm_handover_flows",
            "Connections (conntrack flows) of migrating VMs, by event: sent (by a source to the target), received, created (here, for a VM that arrives), replaced (one of this node's own, at the cutover), refused (not the VM's, or from a node that is not its source), pinned (translations fixed before a reroute).",
            &[
                (event("sent"), h.flows_sent),
                (event("received"), h.flows_received),
                (event("created"), h.flows_created),
                (event("replaced"), h.flows_replaced),
                (event("refused"), h.flows_refused),
                (event("pinned"), h.pinned),
            ],
        )?;
        counters(
            &mut encoder,
            "tether_vm_replayed_packets",
            "Packets a migrating guest missed while paused, by outcome: sent (again, to its new node) or skipped (no longer held, larger than the MTU, or not IP).",
            &[(event("sent"), h.replayed), (event("skipped"), h.replay_skipped)],
        )?;
        if let Some(p) = self.node.policy() {
            let drops: Vec<(PolicyLabels, u64)> = p
                .drops()
                .into_iter()
                .map(|(policy, ingress, n)| {
                    let direction = if ingress { "ingress" } else { "egress" };
                    (
                        PolicyLabels {
                            policy,
                            direction: direction.into(),
                        },
                        n,
                    )
                })
                .collect();
            counters(
                &mut encoder,
                "tether_network_policy_dropped_packets",
                "Packets NetworkPolicy dropped on this node, by policy (namespace/name) and direction (ingress: to a pod the policy isolates; egress: from one).",
                &drops,
            )?;
        }
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

/// Binds the metrics address: done first thing at start, so that a taken
/// port fails the daemon before it touches any state.
///
/// `[::]` (from `:PORT`) takes IPv4 too; where the node has no IPv6 it
/// falls back to `0.0.0.0`.
pub async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener> {
    let refused = |e: std::io::Error| {
        Error::InvalidConfig(format!("--metrics-address {addr}: {}", why_not(addr, &e)))
    };
    match tokio::net::TcpListener::bind(addr).await {
        Ok(listener) => Ok(listener),
        Err(e) if addr.ip() == std::net::Ipv6Addr::UNSPECIFIED && no_ipv6(&e) => {
            let v4 = SocketAddr::from((std::net::Ipv4Addr::UNSPECIFIED, addr.port()));
            tokio::net::TcpListener::bind(v4).await.map_err(refused)
        }
        Err(e) => Err(refused(e)),
    }
}

/// The errors of an IPv6 bind on a node without IPv6.
fn no_ipv6(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EAFNOSUPPORT | libc::EADDRNOTAVAIL)
    )
}

/// Why `addr` cannot be listened on, in words that say what to do.
fn why_not(addr: SocketAddr, e: &std::io::Error) -> String {
    let port = addr.port();
    match e.kind() {
        std::io::ErrorKind::AddrInUse => format!(
            "port {port} already in use (another tetherd, or another exporter on this node?): \
             choose another port, or stop what listens on it"
        ),
        std::io::ErrorKind::AddrNotAvailable => format!(
            "no interface of this node has the address {}: give one of the node's \
             addresses, or :{port} for all of them",
            addr.ip()
        ),
        std::io::ErrorKind::PermissionDenied => {
            format!("not allowed to listen on port {port} ({e}): choose a port above 1023")
        }
        _ => format!("cannot listen: {e}"),
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attach::tests::pools::{ipam_add, mig, node};

    #[tokio::test]
    async fn a_scrape_shows_the_pools_as_the_admin_api_does() {
        let t = node().await;
        ipam_add(&t, "c1", mig()).await.expect("ADD");
        ipam_add(&t, "c2", mig()).await.expect("ADD");
        t.add("p1", "p1").await.expect("ADD");
        let text = render(&registry(t.node.clone())).expect("render");
        let value = |series: &str| -> Option<f64> {
            text.lines()
                .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
                .and_then(|v| v.trim().parse().ok())
        };
        let mig = |what: &str| {
            value(&format!(
                r#"tether_ipam_pool_{what}_addresses{{pool="mig",family="ipv4"}}"#
            ))
        };
        assert_eq!(mig("used"), Some(2.0), "{text}");
        // mig: .10-.200 less .11 and .16-.19, on every node.
        assert_eq!(mig("size"), Some(191.0 - 5.0), "{text}");
        let pod = |what: &str, fam: &str| {
            value(&format!(
                r#"tether_ipam_pool_{what}_addresses{{pool="pod",family="{fam}"}}"#
            ))
        };
        assert_eq!(pod("used", "ipv4"), Some(1.0));
        assert_eq!(pod("used", "ipv6"), Some(1.0));
        let (size, free) = (pod("size", "ipv4"), pod("free", "ipv4"));
        assert_eq!(size.zip(free).map(|(s, f)| s - f), Some(1.0));
        assert_eq!(value("tether_pending_del_queue_length"), Some(0.0));
        assert_eq!(
            value(r#"tether_dhcp_packets_served_total{kind="dhcpv4"}"#),
            Some(0.0)
        );
        assert_eq!(
            value(r#"tether_dhcp_packets_dropped_total{reason="malformed"}"#),
            Some(0.0)
        );
        assert_eq!(
            value(r#"tether_vm_handover_flows_total{event="created"}"#),
            Some(0.0)
        );
        assert_eq!(
            value(r#"tether_vm_replayed_packets_total{event="sent"}"#),
            Some(0.0)
        );
        assert!(text.contains(&format!(
            r#"tether_build_info{{version="{}"}} 1"#,
            env!("CARGO_PKG_VERSION")
        )));
    }

    #[tokio::test]
    async fn a_taken_port_is_refused_in_plain_words() {
        let taken = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = taken.local_addr().expect("local address");
        let said = bind(addr).await.expect_err("the port is taken").to_string();
        assert!(
            said.contains(&format!(
                "--metrics-address {addr}: port {} already in use",
                addr.port()
            )),
            "{said}"
        );
        // Not an address of this node.
        let foreign: SocketAddr = "192.0.2.77:9654".parse().expect("addr");
        let said = bind(foreign).await.expect_err("not ours").to_string();
        assert!(
            said.contains("no interface of this node has the address 192.0.2.77"),
            "{said}"
        );
    }
}
