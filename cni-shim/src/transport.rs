//! The one gRPC call to tetherd over its unix socket, and what its failures
//! mean.
//!
//! Connecting is separate from calling so that ADD can retry the former: a
//! daemon that is restarting comes back within seconds, and ADD is the verb a
//! user waits on. The call itself is never retried here; the runtime retries
//! a failed ADD, and the daemon may already have acted on the first try.

use crate::invocation::Verb;
use hyper_util::rt::TokioIo;
use std::error::Error as StdError;
use std::io;
use std::path::Path;
use std::time::Duration;
use tether_proto::cni::v1::cni_client::CniClient;
use tether_proto::cni::v1::{CniRequest, CniResponse};
use tokio::net::UnixStream;
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::{Code, Status};

/// How long ADD keeps trying to connect; also the bound on a single connect
/// attempt for the other verbs, so a wedged listener cannot hang the shim.
pub const CONNECT_BUDGET: Duration = Duration::from_secs(3);

/// The pause between ADD's connection attempts.
const RETRY_EVERY: Duration = Duration::from_millis(100);

/// Why a call did not produce a `CniResponse`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransportFailure {
    /// No connection could be made: no socket, nobody listening, no
    /// permission on the socket, or the connection died in the handshake.
    Unreachable {
        /// The underlying error, outermost first.
        cause: String,
        /// How long the shim kept retrying, when it did.
        waited: Option<Duration>,
    },
    /// Connected, but the call ended without a response: the daemon went
    /// away, the deadline passed, or it answered with a gRPC status instead
    /// of a `CniResponse` (its contract is to always send the latter).
    CallFailed {
        /// The gRPC status, with its source.
        cause: String,
    },
    /// The daemon answered PermissionDenied or Unauthenticated: it is up and
    /// does not accept this caller.
    Refused {
        /// The gRPC status, with its source.
        cause: String,
    },
}

impl TransportFailure {
    /// Whether a DEL that met this failure should go to the pending-DEL queue.
    ///
    /// Not after an explicit refusal. The daemon is up and has judged this
    /// caller; a queued entry would be executed at the next drain without
    /// that judgement, so the queue would become a way around the peer
    /// check, and exiting 0 would hide the misconfiguration. The DEL-hangs
    /// worry does not apply: the runtime, which runs as root, is an allowed
    /// peer. A connection that the daemon closes right after accepting it
    /// (how it drops peers by SO_PEERCRED) cannot be told apart from a
    /// daemon that crashed or restarted at that moment, so it counts as
    /// unreachable and the DEL is queued. That is safe: the queue directory
    /// is root-only (0700), so a refused non-root caller fails to queue and
    /// gets code 11, and a root caller could write the directory anyway.
    pub fn queues_del(&self) -> bool {
        !matches!(self, TransportFailure::Refused { .. })
    }

    /// A one-line message naming the socket and the underlying error.
    pub fn describe(&self, verb: Verb, socket: &Path) -> String {
        let socket = socket.display();
        match self {
            TransportFailure::Unreachable { cause, .. } => {
                format!("tetherd is not reachable on {socket}: {cause}")
            }
            TransportFailure::CallFailed { cause } => format!(
                "tetherd is not reachable on {socket}: the {} call failed: {cause}",
                verb.as_str()
            ),
            TransportFailure::Refused { cause } => {
                format!("tetherd on {socket} refused this caller: {cause}")
            }
        }
    }

    /// Background for the error's `details`, or "".
    pub fn details(&self) -> String {
        match self {
            TransportFailure::Unreachable {
                waited: Some(waited),
                ..
            } => format!(
                "gave up after retrying for {:.1} s; is tetherd running?",
                waited.as_secs_f32()
            ),
            TransportFailure::Unreachable { waited: None, .. } => "is tetherd running?".to_owned(),
            TransportFailure::CallFailed { .. } => String::new(),
            TransportFailure::Refused { .. } => {
                "tetherd accepts only callers whose uid it allows (SO_PEERCRED)".to_owned()
            }
        }
    }
}

/// Forwards `request` to tetherd on `socket` as `verb`, within the verb's
/// deadline (connecting included).
pub async fn call(
    verb: Verb,
    socket: &Path,
    request: CniRequest,
) -> Result<CniResponse, TransportFailure> {
    let started = Instant::now();
    let channel = connect(socket, verb == Verb::Add).await?;

    let mut request = tonic::Request::new(request);
    // set_timeout both bounds the call here and tells the daemon (grpc-timeout)
    // when the shim will stop waiting.
    request.set_timeout(verb.deadline().saturating_sub(started.elapsed()));
    let mut client = CniClient::new(channel);
    let response = match verb {
        Verb::Add => client.add(request).await,
        Verb::Del => client.del(request).await,
        Verb::Check => client.check(request).await,
        Verb::Status => client.status(request).await,
        Verb::Gc => client.gc(request).await,
    };
    response.map(tonic::Response::into_inner).map_err(classify)
}

/// Connects to `socket`; with `retry`, keeps trying every 100 ms until
/// [`CONNECT_BUDGET`] is spent.
async fn connect(socket: &Path, retry: bool) -> Result<Channel, TransportFailure> {
    let started = Instant::now();
    let give_up = started + CONNECT_BUDGET;
    loop {
        let attempt = tokio::time::timeout_at(give_up, connect_once(socket)).await;
        let (cause, out_of_time) = match attempt {
            Ok(Ok(channel)) => return Ok(channel),
            Ok(Err(e)) => (error_chain(&e), false),
            Err(_) => (
                format!(
                    "connecting timed out after {} s",
                    CONNECT_BUDGET.as_secs_f32()
                ),
                true,
            ),
        };
        if !retry || out_of_time || Instant::now() + RETRY_EVERY >= give_up {
            return Err(TransportFailure::Unreachable {
                cause,
                waited: retry.then(|| started.elapsed()),
            });
        }
        tokio::time::sleep(RETRY_EVERY).await;
    }
}

/// One connection attempt: a unix stream carrying HTTP/2.
async fn connect_once(socket: &Path) -> Result<Channel, tonic::transport::Error> {
    let socket = socket.to_path_buf();
    // The URI is never resolved: the connector ignores it and dials the
    // socket. ".invalid" makes sure no name lookup could ever succeed.
    Endpoint::from_static("http://tether.invalid")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move { Ok::<_, io::Error>(TokioIo::new(UnixStream::connect(socket).await?)) }
        }))
        .await
}

/// Sorts a failed call's status into refused or failed.
fn classify(status: Status) -> TransportFailure {
    let mut cause = format!("{:?}: {}", status.code(), status.message());
    if let Some(source) = status.source() {
        append_chain(&mut cause, source);
    }
    match status.code() {
        Code::PermissionDenied | Code::Unauthenticated => TransportFailure::Refused { cause },
        _ => TransportFailure::CallFailed { cause },
    }
}

/// An error and its sources as one line; the innermost (often the OS error)
/// is what the operator needs.
fn error_chain(error: &dyn StdError) -> String {
    let mut line = error.to_string();
    if let Some(source) = error.source() {
        append_chain(&mut line, source);
    }
    line
}

/// Appends `error` and its sources to `line`, skipping messages that repeat
/// what is already there (wrappers often quote their source).
fn append_chain(line: &mut String, error: &dyn StdError) {
    let mut next = Some(error);
    while let Some(e) = next {
        let text = e.to_string();
        if !text.is_empty() && !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        next = e.source();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusal_is_told_apart_from_failure() {
        let denied = classify(Status::permission_denied("uid 1000 is not allowed"));
        assert_eq!(
            denied,
            TransportFailure::Refused {
                cause: "PermissionDenied: uid 1000 is not allowed".into()
            }
        );
        assert!(!denied.queues_del());
        assert!(!classify(Status::unauthenticated("who?")).queues_del());

        for status in [
            Status::unavailable("connection closed"),
            Status::unknown("transport error"),
            Status::cancelled("Timeout expired"),
            Status::deadline_exceeded("late"),
            Status::internal("h2 protocol error"),
            Status::unimplemented("no Gc"),
        ] {
            let failure = classify(status);
            assert!(
                matches!(failure, TransportFailure::CallFailed { .. }),
                "{failure:?}"
            );
            assert!(failure.queues_del());
        }
    }

    #[test]
    fn error_chain_keeps_the_os_error_once() {
        // 2 is ENOENT on every Linux architecture.
        let inner = io::Error::from_raw_os_error(2);
        let outer = io::Error::other(Wrapper(inner));
        let line = error_chain(&outer);
        assert_eq!(
            line.matches("No such file or directory").count(),
            1,
            "{line}"
        );
    }

    #[derive(Debug)]
    struct Wrapper(io::Error);

    impl std::fmt::Display for Wrapper {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("dialing")
        }
    }

    impl StdError for Wrapper {
        fn source(&self) -> Option<&(dyn StdError + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn missing_socket_is_unreachable_and_names_the_os_error() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("absent.sock");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let failure = runtime
            .block_on(call(Verb::Check, &socket, CniRequest::default()))
            .unwrap_err();
        match failure {
            TransportFailure::Unreachable { cause, waited } => {
                assert!(cause.contains("No such file or directory"), "{cause}");
                assert_eq!(waited, None);
            }
            other => panic!("expected Unreachable, got {other:?}"),
        }
    }
}
