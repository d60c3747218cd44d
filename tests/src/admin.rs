//! The daemon's operator API (`tether.admin.v1.Admin`) from Rust: the
//! generated `tether_proto` client over the daemon's unix socket, connected
//! the way the shim connects, one throwaway runtime per call.
//!
//! [`admin`] makes any one RPC; [`attachments`], [`node`], [`pools_used`]
//! and [`stats`] are the calls the suites make most, also available as
//! methods of [`Daemon`]. [`with_client`] hands out the client itself, for
//! several calls on one connection.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::path::Path;

use hyper_util::rt::TokioIo;
use tonic::transport::{Endpoint, Uri};

use crate::Daemon;

/// The generated admin API: requests, responses and the client.
pub use tether_proto::admin::v1 as pb;
pub use tether_proto::admin::v1::admin_client::AdminClient;
pub use tether_proto::admin::v1::{Attachment, Node, StatsResponse};
pub use tonic::transport::Channel;

/// Connects a client to the admin API on `socket`; panics if it cannot.
pub async fn connect(socket: &Path) -> AdminClient<Channel> {
    let path = socket.to_path_buf();
    // The URI is never resolved: the connector dials the socket.
    let channel = Endpoint::from_static("http://tether.invalid")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(TokioIo::new(stream))
            }
        }))
        .await
        .unwrap_or_else(|e| panic!("admin: connecting to {}: {e}", socket.display()));
    AdminClient::new(channel)
}

/// Runs `session` with a client connected to `socket`, on a throwaway
/// current-thread runtime, and returns what it returns: several calls on
/// one connection, their results left to the caller.
pub fn with_client<R, Fut>(socket: &Path, session: impl FnOnce(AdminClient<Channel>) -> Fut) -> R
where
    Fut: Future<Output = R>,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("building a tokio runtime");
    runtime.block_on(async { session(connect(socket).await).await })
}

/// Makes one admin RPC on the daemon's socket and returns its response
/// message; panics with the status if the call fails. For example
/// `admin(socket, |mut c| async move { c.get_node(request).await })`.
pub fn admin<T, Fut>(socket: &Path, call: impl FnOnce(AdminClient<Channel>) -> Fut) -> T
where
    Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    with_client(socket, |client| async move {
        call(client)
            .await
            .unwrap_or_else(|status| panic!("admin call failed: {status}"))
            .into_inner()
    })
}

/// Every attachment the daemon holds, of every network (ListAttachments).
pub fn attachments(socket: &Path) -> Vec<Attachment> {
    admin(socket, |mut c| async move {
        c.list_attachments(pb::ListAttachmentsRequest::default())
            .await
    })
    .attachments
}

/// The daemon's node: name, version, MTU, store and pools (GetNode).
pub fn node(socket: &Path) -> Node {
    admin(socket, |mut c| async move {
        c.get_node(pb::GetNodeRequest::default()).await
    })
}

/// Addresses in use per pool CIDR (the pools of [`node`]).
pub fn pools_used(socket: &Path) -> BTreeMap<String, u64> {
    node(socket)
        .pools
        .into_iter()
        .map(|p| (p.cidr, p.used))
        .collect()
}

/// The daemon's counters (Stats).
pub fn stats(socket: &Path) -> StatsResponse {
    admin(socket, |mut c| async move {
        c.stats(pb::StatsRequest::default()).await
    })
}

/// The daemon's counters and costs alone ([`stats`] without the recent
/// lists).
pub fn brief_stats(socket: &Path) -> StatsResponse {
    admin(socket, |mut c| async move {
        c.stats(pb::StatsRequest { brief: true }).await
    })
}

/// The admin calls above, on this daemon's socket.
impl Daemon {
    /// [`attachments`] of this daemon.
    pub fn attachments(&self) -> Vec<Attachment> {
        attachments(self.socket())
    }

    /// The container ids of [`Daemon::attachments`].
    pub fn attachment_ids(&self) -> BTreeSet<String> {
        self.attachments()
            .into_iter()
            .map(|a| a.container_id)
            .collect()
    }

    /// [`node`] of this daemon (its GetNode answer; [`Daemon::node`] is its
    /// netns).
    pub fn node_info(&self) -> Node {
        node(self.socket())
    }

    /// [`pools_used`] of this daemon.
    pub fn pools_used(&self) -> BTreeMap<String, u64> {
        pools_used(self.socket())
    }

    /// [`stats`] of this daemon.
    pub fn stats(&self) -> StatsResponse {
        stats(self.socket())
    }
}
