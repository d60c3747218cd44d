//! The daemon's socket: a unix socket, mode 0600, with an SO_PEERCRED check
//! on every connection, serving the CNI service, the admin service, gRPC
//! health, and server reflection (v1 and v1alpha, for grpcurl).

use crate::api::admin::AdminService;
use crate::api::cni::{CniService, Stats};
use crate::attach::Node;
use futures::Stream;
use std::collections::HashSet;
use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tether_base::error::{Error, Result};
use tether_proto::admin::v1::admin_server::AdminServer;
use tether_proto::cni::v1::cni_server::CniServer;
use tokio::net::{UnixListener, UnixStream};

/// How the socket is served.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// The socket path.
    pub socket: PathBuf,
    /// Peer uids allowed besides root.
    pub allowed_uids: Vec<u32>,
}

/// Binds the socket so that it appears atomically with mode 0600: bound
/// under a temporary name, chmod'ed, then renamed into place. A live socket
/// at the path (another tetherd) is an error; a stale one is replaced.
pub async fn bind(socket: &Path) -> Result<UnixListener> {
    let io = |what: &str, e: std::io::Error| Error::Io(format!("{what} {}: {e}", socket.display()));
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir).map_err(|e| io("creating the directory of", e))?;
    }
    if socket.exists() {
        if UnixStream::connect(socket).await.is_ok() {
            return Err(Error::Io(format!(
                "{} is served by another process (another tetherd?)",
                socket.display()
            )));
        }
        std::fs::remove_file(socket).map_err(|e| io("removing stale socket", e))?;
    }
    let file_name = socket
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "tether.sock".into());
    let tmp = socket.with_file_name(format!(".{file_name}.{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let listener = UnixListener::bind(&tmp).map_err(|e| io("binding", e))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| io("setting the mode of", e))?;
    std::fs::rename(&tmp, socket).map_err(|e| io("renaming into place", e))?;
    Ok(listener)
}

/// Accepted connections whose peer is allowed. Refused peers are dropped
/// before a byte is read from them; the refusal is logged with their uid.
fn allowed_connections(
    listener: UnixListener,
    allowed: HashSet<u32>,
) -> impl Stream<Item = std::io::Result<UnixStream>> {
    futures::stream::unfold((listener, allowed), |(listener, allowed)| async move {
        loop {
            match listener.accept().await {
                Ok((stream, _)) => match stream.peer_cred() {
                    Ok(cred) if cred.uid() == 0 || allowed.contains(&cred.uid()) => {
                        return Some((Ok(stream), (listener, allowed)));
                    }
                    Ok(cred) => {
                        tracing::warn!(uid = cred.uid(), pid = ?cred.pid(), "refused a peer that is not allowed");
                    }
                    Err(e) => tracing::warn!(error = %e, "cannot read peer credentials; refused"),
                },
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    })
}

/// Serves until `shutdown` resolves.
pub async fn serve(
    node: Arc<Node>,
    stats: Arc<Stats>,
    listener: UnixListener,
    opts: &ServeOptions,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<()> {
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<CniServer<CniService>>().await;
    health.set_serving::<AdminServer<AdminService>>().await;
    // Each reflection version lists only its own service unless told about
    // the other; register both so that either lists everything served.
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(tether_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| Error::Internal(format!("reflection: {e}")))?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(tether_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .map_err(|e| Error::Internal(format!("reflection: {e}")))?;
    let cni = CniService::new(node.clone(), stats.clone());
    let admin = AdminService::new(node, stats, opts.socket.clone());
    let allowed = opts.allowed_uids.iter().copied().collect();
    tonic::transport::Server::builder()
        .add_service(CniServer::new(cni))
        .add_service(AdminServer::new(admin))
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .serve_with_incoming_shutdown(allowed_connections(listener, allowed), shutdown)
        .await
        .map_err(|e| Error::Io(format!("serving {}: {e}", opts.socket.display())))
}
