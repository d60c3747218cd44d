//! `tether`, the CNI plugin binary.
//!
//! It answers VERSION itself and forwards every other verb, unparsed, to
//! tetherd over gRPC on a unix socket (see [`transport`] for the client). It is dumb transport: it ships the
//! environment and stdin as they came, prints what the daemon answers, and
//! turns only its own transport failures into CNI error codes. When the
//! daemon is unreachable, a DEL is queued on disk and succeeds (see
//! [`queue`]), because a failing DEL hangs pod termination.
//!
//! It is started once per CNI call, so its start-up is on every call's
//! path: it has a C `main` and skips the Rust runtime's own start-up (the
//! main thread's stack guard, which glibc finds by reading
//! `/proc/self/maps`, and the stack-overflow handler): 0.08 ms of a
//! 0.79 ms spawn of VERSION here, over 3,000 alternating spawns. What of that start-up the
//! shim needs, it does itself: SIGPIPE is ignored, as the runtime's
//! start-up would have, so that writing the answer to a runtime that went
//! away is an error and not a death by signal (writes to the daemon's
//! socket never raise it: std sends with `MSG_NOSIGNAL`).
//! `std::env::args_os` still works: std takes the arguments from glibc's
//! `.init_array` on Linux, not from its own start-up.
#![cfg_attr(not(test), no_main)]

mod error;
mod invocation;
mod queue;
mod transport;
mod verb;

use error::{ErrorObject, ShimError};
use invocation::{ShimConfig, DEFAULT_CNI_VERSION};
use std::ffi::OsString;
use std::io::{self, Read};
use tether_proto::cni::v1::cni_response::Outcome;
use tether_proto::cni::v1::{CniRequest, CniResponse};
use transport::TransportFailure;
use verb::Verb;

/// What the shim hands back to the runtime.
#[derive(Debug, PartialEq, Eq)]
enum Reply {
    /// Print these bytes (if any) and exit 0.
    Success(Vec<u8>),
    /// Print this error object and exit 1.
    Failure(ErrorObject),
    /// No CNI_COMMAND: a person ran the binary. Print this on stderr and
    /// exit 0.
    About(String),
}

/// What the binary is, for a person who runs it without CNI_COMMAND
/// (`tether`, `tether --help`): the reference plugins' two lines (their
/// skel's "about" text), with tether's own version.
fn about() -> String {
    format!(
        "CNI tether plugin version {}\nCNI protocol versions supported: {}\n",
        env!("CARGO_PKG_VERSION"),
        tether_proto::cni::SUPPORTED_VERSIONS.join(", ")
    )
}

/// The process entry point (see the module's docs).
#[cfg(not(test))]
#[unsafe(no_mangle)]
pub extern "C" fn main(_argc: libc::c_int, _argv: *const *const libc::c_char) -> libc::c_int {
    // SAFETY: setting a signal's disposition to SIG_IGN before any other
    // thread exists touches no memory of ours.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
    match shim_main() {
        Exit::Success => 0,
        Exit::Failure => 1,
    }
}

/// How the process exits: the CNI spec knows 0 and 1 only.
#[cfg(not(test))]
#[derive(Debug, PartialEq, Eq)]
enum Exit {
    Success,
    Failure,
}

/// Runs the invocation of this process and prints the answer.
#[cfg(not(test))]
fn shim_main() -> Exit {
    use std::io::Write as _;
    let env = |name: &str| std::env::var_os(name);
    let name = invocation::plugin_name(std::env::args_os().next());
    let reply = run(&env, &name, &mut io::stdin().lock());
    let (bytes, status) = match reply {
        Reply::Success(bytes) => (bytes, Exit::Success),
        Reply::Failure(error) => (error.to_json_line(), Exit::Failure),
        Reply::About(text) => {
            // stdout stays a runtime's: the text goes to stderr, as skel's.
            let mut err = io::stderr().lock();
            let _ = err.write_all(text.as_bytes());
            return Exit::Success;
        }
    };
    if !bytes.is_empty() {
        let mut out = io::stdout().lock();
        // A runtime that cannot read our answer did not get a success.
        if out.write_all(&bytes).and_then(|()| out.flush()).is_err() {
            return Exit::Failure;
        }
    }
    status
}

/// Handles one invocation: `env` looks up environment variables, `stdin`
/// is the network configuration, `name` the file name the binary ran as.
fn run(env: &dyn Fn(&str) -> Option<OsString>, name: &str, stdin: &mut dyn Read) -> Reply {
    // The verb comes first and stdin is not read before it is known: VERSION
    // must succeed whatever else is there (podman sends dummy values), and a
    // bad CNI_COMMAND is reported at once instead of waiting on a stdin that
    // a person at a terminal never closes. Such errors cannot know the
    // configuration's cniVersion and use the shim's own. Without a verb
    // (unset or empty, as skel reads it), a person ran the binary, maybe
    // with --help: arguments are never a runtime's, so they are ignored.
    let command = match invocation::command(env) {
        Ok(Some(command)) if !command.is_empty() => command,
        Ok(_) => return Reply::About(about()),
        Err(e) => return fail(e, DEFAULT_CNI_VERSION),
    };
    if command == "VERSION" {
        return Reply::Success(tether_proto::cni::version_reply().into_bytes());
    }
    let Some(verb) = Verb::parse(&command) else {
        return fail(ShimError::UnknownCommand(command), DEFAULT_CNI_VERSION);
    };

    let text = match invocation::read_config(stdin) {
        Ok(text) => text,
        Err(e) => return fail(e, DEFAULT_CNI_VERSION),
    };
    let config = match ShimConfig::parse(&text, name) {
        Ok(config) => config,
        Err(e) => return fail(e, DEFAULT_CNI_VERSION),
    };
    let request = match invocation::request(env, text.as_bytes().to_vec(), name) {
        Ok(request) => request,
        Err(e) => return fail(e, &config.cni_version),
    };
    forward(verb, &config, request, &text)
}

/// Sends the request to tetherd and turns the outcome into the reply.
fn forward(verb: Verb, config: &ShimConfig, request: CniRequest, stdin: &str) -> Reply {
    match transport::call(verb, &config.socket, &request) {
        Ok(response) => from_response(response, &config.cni_version),
        Err(failure) if verb == Verb::Del && failure.queues_del() => {
            queue_del(config, &request, stdin, failure)
        }
        Err(failure) => fail(
            ShimError::Daemon {
                verb,
                socket: config.socket.clone(),
                failure,
            },
            &config.cni_version,
        ),
    }
}

/// Passes the daemon's answer through: its result bytes, or its error with
/// the configuration's cniVersion when the daemon named none.
fn from_response(response: CniResponse, cni_version: &str) -> Reply {
    match response.outcome {
        Some(Outcome::Result(bytes)) => Reply::Success(bytes),
        Some(Outcome::Error(error)) => Reply::Failure(ErrorObject {
            cni_version: if error.cni_version.is_empty() {
                cni_version.to_owned()
            } else {
                error.cni_version
            },
            code: error.code,
            msg: error.msg,
            details: error.details,
        }),
        // proto3 cannot tell an unset oneof from a default response; the
        // daemon sending `CniResponse::default()` means "nothing to print".
        None => Reply::Success(Vec::new()),
    }
}

/// Queues a DEL the daemon could not take and reports success, or code 11
/// naming both failures when even the queue is out of reach.
fn queue_del(
    config: &ShimConfig,
    request: &CniRequest,
    stdin: &str,
    failure: TransportFailure,
) -> Reply {
    let entry = queue::PendingDel::new(request, stdin, queue::unix_nanos_now());
    let dir = queue::queue_link(&config.socket);
    match queue::enqueue(&dir, &entry, std::process::id()) {
        Ok(path) => {
            // stdout must stay empty on a DEL success; stderr reaches the
            // runtime's log, where an operator looks for why.
            eprintln!(
                "tether: {}; DEL queued in {}",
                failure.describe(Verb::Del, &config.socket),
                path.display()
            );
            Reply::Success(Vec::new())
        }
        Err(e) => fail(
            ShimError::DelNotQueued {
                socket: config.socket.clone(),
                failure,
                queue_dir: dir,
                error: e.to_string(),
            },
            &config.cni_version,
        ),
    }
}

/// The reply for a failure the shim found itself.
fn fail(error: ShimError, cni_version: &str) -> Reply {
    Reply::Failure(error.to_object(cni_version))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_proto::cni::v1::CniError;

    fn no_env(_: &str) -> Option<OsString> {
        None
    }

    #[test]
    fn version_ignores_everything_else() {
        let env = |name: &str| match name {
            "CNI_COMMAND" => Some("VERSION".into()),
            "CNI_NETNS" | "CNI_PATH" => Some("dummy".into()),
            _ => None,
        };
        // A reader that fails proves stdin is not even read.
        struct Broken;
        impl Read for Broken {
            fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
                Err(io::Error::other("must not be read"))
            }
        }
        let reply = run(&env, "tether", &mut Broken);
        assert_eq!(
            reply,
            Reply::Success(tether_proto::cni::version_reply().into_bytes())
        );
    }

    #[test]
    fn without_a_command_the_binary_says_what_it_is_without_reading_stdin() {
        struct Broken;
        impl Read for Broken {
            fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
                Err(io::Error::other("must not be read"))
            }
        }
        let empty = |name: &str| (name == "CNI_COMMAND").then(OsString::new);
        for env in [&no_env as &dyn Fn(&str) -> Option<OsString>, &empty] {
            let Reply::About(text) = run(env, "tether", &mut Broken) else {
                panic!("expected the about text");
            };
            assert_eq!(
                text,
                format!(
                    "CNI tether plugin version {}\nCNI protocol versions supported: \
                     0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0\n",
                    env!("CARGO_PKG_VERSION")
                )
            );
        }
    }

    #[test]
    fn daemon_error_is_passed_through_with_version_fallback() {
        let response = |cni_version: &str| CniResponse {
            outcome: Some(Outcome::Error(CniError {
                code: 100,
                msg: "address pool exhausted".into(),
                details: "pool 10.0.0.0/24".into(),
                cni_version: cni_version.into(),
            })),
        };
        assert_eq!(
            from_response(response(""), "0.4.0"),
            Reply::Failure(ErrorObject {
                cni_version: "0.4.0".into(),
                code: 100,
                msg: "address pool exhausted".into(),
                details: "pool 10.0.0.0/24".into(),
            })
        );
        let Reply::Failure(error) = from_response(response("1.0.0"), "0.4.0") else {
            panic!("expected a failure");
        };
        assert_eq!(error.cni_version, "1.0.0");
    }

    #[test]
    fn result_bytes_are_passed_through_untouched() {
        let bytes = b"{\"cniVersion\":\"1.0.0\",\"ips\":[]}  \n".to_vec();
        let response = CniResponse {
            outcome: Some(Outcome::Result(bytes.clone())),
        };
        assert_eq!(from_response(response, "1.1.0"), Reply::Success(bytes));
        assert_eq!(
            from_response(CniResponse::default(), "1.1.0"),
            Reply::Success(Vec::new())
        );
    }
}
