//! Cutover notices between nodes (`crate::vm::notices`): UDP datagrams on
//! `--cutover-port` (default 9655) of the nodes' underlay addresses. A
//! migration's target sends one to every other node the moment its VM
//! announces itself; each node repoints as soon as it reads it, while the
//! record's compare-and-swap and the watch follow.
//!
//! Datagrams are not authenticated. What a node accepts is bounded instead:
//! it must come from an underlay address of the node it names as the
//! target, name an attachment the record holds as that VM's alternate at
//! the generation it names, and the record must accept the promotion; it
//! holds at most `NOTICE_TTL` unless the record confirms it. A datagram
//! lost costs only the time the watch takes, as without notices.

use super::Node;
use crate::vm::notices::{CutoverNotice, NOTICE_TTL};
use std::net::IpAddr;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::UdpSocket;

/// The node's notice sockets: IPv4 on every address, IPv6 on the node's
/// own IPv6 underlay address (a wildcard IPv6 socket would take the IPv4
/// port too).
pub struct NoticeBus {
    port: u16,
    v4: Option<Arc<UdpSocket>>,
    v6: Option<Arc<UdpSocket>>,
}

impl NoticeBus {
    /// Sends `notice` to every node in `view` but `me`.
    fn send(&self, notice: &CutoverNotice, me: &str, view: &crate::cluster::ClusterView) {
        let bytes = notice.encode();
        for (name, (rec, _)) in &view.nodes {
            if name != me {
                self.send_one(name, rec, &bytes);
            }
        }
    }

    /// Sends `bytes` to node `name` (record `rec`), at its first underlay
    /// address of a family this bus has a socket for.
    fn send_one(&self, name: &str, rec: &crate::cluster::NodeRecord, bytes: &[u8]) {
        let dest = rec.node_ips.iter().find_map(|ip| {
            let socket = match ip {
                IpAddr::V4(_) => self.v4.as_ref(),
                IpAddr::V6(_) => self.v6.as_ref(),
            }?;
            Some((socket, SocketAddr::new(*ip, self.port)))
        });
        let Some((socket, to)) = dest else {
            return;
        };
        if let Err(e) = socket.try_send_to(bytes, to) {
            tracing::debug!(node = %name, %to, error = %e, "a datagram to another node was not sent");
        }
    }
}

impl Node {
    /// Opens the notice sockets on `port` and starts reading them; a port
    /// of 0, no cluster peers, or a port already taken leaves notices off
    /// (the watch alone repoints, as before), which is logged.
    pub fn start_notices(self: &Arc<Self>, port: u16) {
        let Some(peers) = self.peers.clone() else {
            return;
        };
        if port == 0 {
            tracing::info!(
                "cutover notices off (--cutover-port 0): other nodes repoint on the record's watch"
            );
            return;
        }
        let v4 = match std::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, port)) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(port, error = %e, "cannot open the IPv4 cutover-notice socket");
                None
            }
        };
        let v6 = peers
            .me()
            .node_ips
            .iter()
            .find(|ip| ip.is_ipv6())
            .and_then(|ip| match std::net::UdpSocket::bind((*ip, port)) {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::warn!(%ip, port, error = %e, "cannot open the IPv6 cutover-notice socket");
                    None
                }
            });
        let open = |s: Option<std::net::UdpSocket>| {
            s.and_then(|s| {
                s.set_nonblocking(true).ok()?;
                UdpSocket::from_std(s).ok().map(Arc::new)
            })
        };
        let bus = Arc::new(NoticeBus {
            port,
            v4: open(v4),
            v6: open(v6),
        });
        for socket in bus.v4.iter().chain(bus.v6.iter()) {
            let (node, socket) = (self.clone(), socket.clone());
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                loop {
                    match socket.recv_from(&mut buf).await {
                        Ok((n, from)) => node.on_notice(&buf[..n], from),
                        Err(e) => {
                            tracing::warn!(error = %e, "reading cutover notices failed");
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                    }
                }
            });
        }
        if bus.v4.is_some() || bus.v6.is_some() {
            tracing::info!(port, "cutover notices on");
            let _ = self.notice_bus.set(bus);
        }
    }

    /// Sends `notice` to every other node, if notices are on.
    pub(crate) fn send_notice(&self, notice: &CutoverNotice) {
        let (Some(bus), Some(peers)) = (self.notice_bus.get(), self.peers.as_ref()) else {
            return;
        };
        bus.send(notice, &self.config.name, &peers.view());
    }

    /// Sends one datagram to node `node`, if notices are on and the node is
    /// known.
    pub(crate) fn send_to_node(&self, node: &str, bytes: &[u8]) {
        let (Some(bus), Some(peers)) = (self.notice_bus.get(), self.peers.as_ref()) else {
            return;
        };
        if let Some((rec, _)) = peers.view().nodes.get(node) {
            bus.send_one(node, rec, bytes);
        }
    }

    /// A datagram from `from`: a notice is taken only from an underlay
    /// address of the node it names as the target; a migrating VM's flows
    /// go to the handover, which checks them likewise.
    fn on_notice(self: &Arc<Self>, bytes: &[u8], from: SocketAddr) {
        if let Some(flows) = crate::handover::FlowsDatagram::decode(bytes) {
            let node = self.clone();
            tokio::spawn(async move {
                let view = node.vms.records().view().clone();
                node.handovers
                    .on_flows(node.as_ref(), &view, flows, from)
                    .await;
            });
            return;
        }
        let Some(notice) = CutoverNotice::decode(bytes) else {
            tracing::debug!(%from, "a datagram on the cutover port that is no notice");
            return;
        };
        let Some(peers) = self.peers.as_ref() else {
            return;
        };
        let sender = notice.sender();
        let genuine = peers
            .view()
            .nodes
            .get(sender)
            .is_some_and(|(rec, _)| rec.node_ips.contains(&from.ip().to_canonical()));
        if !genuine {
            tracing::warn!(%from, node = %sender, "a cutover notice from an address that is not that node's: ignored");
            return;
        }
        let lapse = matches!(notice, CutoverNotice::Promote { .. });
        if self.vms.take_notice(notice) {
            self.routes.wake();
            if lapse {
                // Plan again when it lapses, should the record never move.
                let node = self.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(NOTICE_TTL).await;
                    node.routes.wake();
                });
            }
        }
    }
}
