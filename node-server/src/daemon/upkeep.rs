//! What keeps the daemon going beside its requests: the DEL queue a shim
//! falls back to (taken in and replayed), the pools file (read again on
//! SIGHUP and when it changes), and the stop signals.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;

use crate::api::cni::Stats;
use crate::api::pending_del;
use crate::attach::Node;
use crate::pools::PoolDef;
use tether_base::error::{Error, Result};

use super::options::Options;

/// Runs [`pending_del::adopt`] for this daemon's socket and state dir, and
/// logs what it took in.
pub(super) fn adopt_pending_dels(
    socket: &Path,
    state_dir: &Path,
    allowed_uids: &[u32],
) -> Result<()> {
    let link = pending_del::queue_link(socket);
    match pending_del::adopt(socket, state_dir, allowed_uids) {
        Ok(adopted) => {
            if !adopted.from.is_empty() {
                let from: Vec<String> = adopted
                    .from
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect();
                tracing::warn!(
                    ?from,
                    moved = adopted.moved,
                    link = %link.display(),
                    "took in DELs queued outside this state dir (a former --state-dir, or queued before tetherd started)"
                );
            }
            for left in &adopted.left {
                tracing::warn!(path = %left.path.display(), reason = %left.reason, "queued DEL left where it is");
            }
            Ok(())
        }
        Err(e) => Err(Error::Io(format!(
            "cannot point {} at the DEL queue in {}: {e}",
            link.display(),
            pending_del::queue_dir(state_dir).display()
        ))),
    }
}

/// How often queued DELs are looked for while the daemon serves.
const DRAIN_EVERY: Duration = Duration::from_secs(5);

/// Replays, every [`DRAIN_EVERY`], the DELs a shim queued while the
/// daemon did not answer (one that raced its start-up among them), after
/// pointing the queue's link here again: someone may have removed or
/// replaced it meanwhile.
pub(super) fn drain_pending_dels_every(
    node: Arc<Node>,
    stats: Arc<Stats>,
    socket: PathBuf,
    state_dir: PathBuf,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(DRAIN_EVERY);
        tick.tick().await;
        loop {
            tick.tick().await;
            if let Err(e) = adopt_pending_dels(&socket, &state_dir, &node.config().allowed_uids) {
                tracing::error!("{e}");
            }
            crate::api::cni::drain_pending_dels(&node, &stats).await;
        }
    })
}

/// Reads the pools file and checks that no pool overlaps the pod CIDRs.
pub(super) fn load_pools(path: &Path, opts: &Options) -> Result<Vec<PoolDef>> {
    let defs = crate::pools::def::load(path)?;
    check_pools(&defs, &opts.pod_cidrs, &opts.cluster_cidrs)?;
    tracing::info!(file = %path.display(), pools = ?defs.iter().map(|d| format!("{} {}", d.name, d.cidr)).collect::<Vec<_>>(), "named pools");
    Ok(defs)
}

fn check_pools(defs: &[PoolDef], pod: &[IpNet], cluster: &[IpNet]) -> Result<()> {
    for d in defs {
        if let Some(c) = pod
            .iter()
            .chain(cluster)
            .find(|c| crate::pools::def::overlaps(c, &d.cidr))
        {
            return Err(Error::InvalidConfig(format!(
                "pool {} ({}) overlaps the pod CIDR {c}: an address must have one pool",
                d.name, d.cidr
            )));
        }
    }
    Ok(())
}

/// Without `--pools` there is nothing to reload: SIGHUP, whose default
/// action would end the daemon, is logged and otherwise ignored.
pub(super) fn ignore_sighup() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::hangup()) {
        Ok(mut hup) => {
            tokio::spawn(async move {
                while hup.recv().await.is_some() {
                    tracing::info!("SIGHUP: no --pools file to read again; ignored");
                }
            });
        }
        Err(e) => tracing::warn!(error = %e, "cannot install the SIGHUP handler"),
    }
}

/// How often the pools file is looked at for a changed content: a
/// ConfigMap volume is updated in place, and no one sends a signal then.
const POOLS_POLL: std::time::Duration = std::time::Duration::from_secs(10);

/// Reads the pools file again on every SIGHUP, and when its content
/// changes (looked at every [`POOLS_POLL`]). A file that does not parse
/// changes nothing (the error is logged, once per content).
pub(super) fn reload_pools_on_sighup(
    node: Arc<Node>,
    nat: Arc<crate::nat::OutboundNat>,
    path: PathBuf,
    pod: Vec<IpNet>,
    cluster: Vec<IpNet>,
) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut hup = match signal(SignalKind::hangup()) {
        Ok(hup) => Some(hup),
        Err(e) => {
            tracing::warn!(error = %e, "cannot install the SIGHUP handler: the pools file is reloaded when it changes only");
            None
        }
    };
    tokio::spawn(async move {
        let mut seen = std::fs::read(&path).ok();
        let mut tick = tokio::time::interval(POOLS_POLL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let why = tokio::select! {
                Some(()) = async {
                    match hup.as_mut() {
                        Some(h) => h.recv().await,
                        None => std::future::pending().await,
                    }
                } => "SIGHUP",
                _ = tick.tick() => {
                    let now = std::fs::read(&path).ok();
                    if now == seen || now.is_none() {
                        continue;
                    }
                    "the file changed"
                }
            };
            seen = std::fs::read(&path).ok();
            let loaded = crate::pools::def::load(&path)
                .and_then(|defs| check_pools(&defs, &pod, &cluster).map(|()| defs));
            match loaded {
                Ok(defs) => {
                    tracing::info!(file = %path.display(), count = defs.len(), why, "pools read again");
                    // The pools are never NATed to; a refused table keeps
                    // the former pools there.
                    if let Err(e) = nat.apply(&defs) {
                        tracing::error!("outbound NAT not updated for the new pools: {e}");
                    }
                    node.reload_pools(defs);
                }
                Err(e) => {
                    tracing::error!(file = %path.display(), why, "the pools file is refused, nothing changed: {e}")
                }
            }
        }
    });
}

/// Installs the SIGTERM and SIGINT handlers now; the receiver turns true
/// when one arrives.
pub(super) fn stop_on_signal() -> tokio::sync::watch::Receiver<bool> {
    use tokio::signal::unix::{signal, SignalKind};
    let (tx, rx) = tokio::sync::watch::channel(false);
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        // Without signal handlers, only kill -9 stops the daemon; that is
        // safe (state is durable) but worth a line in the log.
        tracing::warn!("cannot install signal handlers");
        return rx;
    };
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
        let _ = tx.send(true);
    });
    rx
}

/// Resolves once a stop signal has arrived (at once if it already has).
pub(super) async fn stopped(stop: &tokio::sync::watch::Receiver<bool>) {
    let mut stop = stop.clone();
    if stop.wait_for(|s| *s).await.is_err() {
        // The handlers could not be installed: never.
        futures::future::pending::<()>().await;
    }
}
