//! The shim's own failures, the one place they are mapped to CNI error
//! codes, and the spec's error object that carries them to the runtime.
//!
//! The shim only reports what it can see itself: a bad environment or stdin,
//! and a daemon it cannot reach. Every other error comes from tetherd
//! already coded and is passed through untouched.

use crate::transport::TransportFailure;
use crate::verb::Verb;
use serde::Serialize;
use std::fmt;
use std::path::PathBuf;

/// CNI code 4: invalid or missing environment variable.
pub const CODE_INVALID_ENV: u32 = 4;
/// CNI code 5: I/O failure.
pub const CODE_IO: u32 = 5;
/// CNI code 6: failed to decode content.
pub const CODE_DECODE: u32 = 6;
/// CNI code 7: invalid network configuration.
pub const CODE_INVALID_CONFIG: u32 = 7;
/// CNI code 11: try again later.
pub const CODE_TRY_AGAIN: u32 = 11;
/// CNI code 50: STATUS, the plugin is not available.
pub const CODE_NOT_AVAILABLE: u32 = 50;

/// The verbs CNI_COMMAND may name, for error details.
const VERBS: &str = "expected one of ADD, DEL, CHECK, STATUS, GC, VERSION";

/// A failure the shim reports itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShimError {
    /// CNI_COMMAND names no verb the shim knows.
    UnknownCommand(String),
    /// A CNI_* variable is not UTF-8 and cannot travel in the proto.
    EnvNotUtf8(&'static str),
    /// stdin could not be read.
    ReadStdin(String),
    /// stdin holds more than 1 MiB.
    ConfigTooLarge,
    /// stdin is not a JSON object; without it the socket is unknown.
    ConfigNotObject(String),
    /// A configuration field the shim reads is of the wrong type or value.
    InvalidField {
        /// The field, as spelled in the configuration.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The call to tetherd failed below the CNI level.
    Daemon {
        /// The verb being forwarded.
        verb: Verb,
        /// The socket the shim tried.
        socket: PathBuf,
        /// What went wrong.
        failure: TransportFailure,
    },
    /// DEL: tetherd was unreachable and the request could not be queued.
    DelNotQueued {
        /// The socket the shim tried.
        socket: PathBuf,
        /// Why the daemon could not take the DEL.
        failure: TransportFailure,
        /// The queue directory the shim tried to write.
        queue_dir: PathBuf,
        /// Why queueing failed.
        error: String,
    },
}

impl ShimError {
    /// The CNI error code of this failure. The one place the shim picks codes.
    pub fn code(&self) -> u32 {
        match self {
            ShimError::UnknownCommand(_) | ShimError::EnvNotUtf8(_) => CODE_INVALID_ENV,
            ShimError::ReadStdin(_) => CODE_IO,
            ShimError::ConfigNotObject(_) => CODE_DECODE,
            ShimError::ConfigTooLarge | ShimError::InvalidField { .. } => CODE_INVALID_CONFIG,
            // STATUS has its own codes: 50 says "not ready for ADD", which
            // is exactly what an unreachable daemon means.
            ShimError::Daemon {
                verb: Verb::Status, ..
            } => CODE_NOT_AVAILABLE,
            ShimError::Daemon { .. } | ShimError::DelNotQueued { .. } => CODE_TRY_AGAIN,
        }
    }

    /// The error's `msg`: what happened, with the socket or variable named.
    pub fn msg(&self) -> String {
        match self {
            ShimError::UnknownCommand(c) => format!("unknown CNI_COMMAND {c:?}"),
            ShimError::EnvNotUtf8(var) => format!("{var} is not valid UTF-8"),
            ShimError::ReadStdin(e) => {
                format!("cannot read the network configuration from stdin: {e}")
            }
            ShimError::ConfigTooLarge => "network configuration larger than 1 MiB".to_owned(),
            ShimError::ConfigNotObject(_) => {
                "network configuration is not a JSON object".to_owned()
            }
            ShimError::InvalidField { field, reason } => {
                format!("invalid network configuration: field {field:?}: {reason}")
            }
            ShimError::Daemon {
                verb,
                socket,
                failure,
            } => failure.describe(*verb, socket),
            ShimError::DelNotQueued {
                socket,
                failure,
                queue_dir,
                error,
            } => format!(
                "{}; and the DEL could not be queued in {}: {error}",
                failure.describe(Verb::Del, socket),
                queue_dir.display()
            ),
        }
    }

    /// The error's `details`: background that helps the operator, or "".
    pub fn details(&self) -> String {
        match self {
            ShimError::UnknownCommand(_) => VERBS.to_owned(),
            ShimError::ConfigNotObject(e) => e.clone(),
            ShimError::Daemon { failure, .. } => failure.details(),
            ShimError::DelNotQueued { .. } => {
                "the runtime will retry the DEL; tetherd drains the queue when it starts".to_owned()
            }
            ShimError::EnvNotUtf8(_)
            | ShimError::ReadStdin(_)
            | ShimError::ConfigTooLarge
            | ShimError::InvalidField { .. } => String::new(),
        }
    }

    /// The spec's error object for this failure.
    pub fn to_object(&self, cni_version: &str) -> ErrorObject {
        ErrorObject {
            cni_version: cni_version.to_owned(),
            code: self.code(),
            msg: self.msg(),
            details: self.details(),
        }
    }
}

impl fmt::Display for ShimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.msg())
    }
}

/// The CNI spec's error object, as printed on stdout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ErrorObject {
    /// The cniVersion the error is written for.
    #[serde(rename = "cniVersion")]
    pub cni_version: String,
    /// The CNI error code.
    pub code: u32,
    /// A short message.
    pub msg: String,
    /// Longer details; left out of the JSON when empty, as the spec allows.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub details: String,
}

impl ErrorObject {
    /// The object as one line of JSON, newline-terminated.
    pub fn to_json_line(&self) -> Vec<u8> {
        // Serialising a struct of strings and an integer cannot fail; the
        // fallback keeps the shim from ever printing nothing on an error.
        let mut line = serde_json::to_vec(self).unwrap_or_else(|_| {
            format!(r#"{{"cniVersion":"1.1.0","code":{}}}"#, self.code).into_bytes()
        });
        line.push(b'\n');
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn parsed(obj: &ErrorObject) -> Value {
        serde_json::from_slice(&obj.to_json_line()).unwrap()
    }

    #[test]
    fn error_object_has_the_spec_shape() {
        let obj = ErrorObject {
            cni_version: "0.4.0".into(),
            code: 7,
            msg: "bad \"config\"".into(),
            details: "line 1".into(),
        };
        let line = obj.to_json_line();
        assert_eq!(
            std::str::from_utf8(&line).unwrap(),
            "{\"cniVersion\":\"0.4.0\",\"code\":7,\"msg\":\"bad \\\"config\\\"\",\"details\":\"line 1\"}\n"
        );
    }

    #[test]
    fn empty_details_are_left_out() {
        let obj = ShimError::ConfigTooLarge.to_object("1.0.0");
        assert_eq!(
            parsed(&obj),
            json!({"cniVersion": "1.0.0", "code": 7, "msg": "network configuration larger than 1 MiB"})
        );
    }

    #[test]
    fn local_failures_have_distinct_codes() {
        assert_eq!(ShimError::UnknownCommand("FOO".into()).code(), 4);
        assert_eq!(ShimError::EnvNotUtf8("CNI_ARGS").code(), 4);
        assert_eq!(ShimError::ReadStdin("EIO".into()).code(), 5);
        assert_eq!(ShimError::ConfigNotObject("x".into()).code(), 6);
        assert_eq!(ShimError::ConfigTooLarge.code(), 7);
        let unknown = ShimError::UnknownCommand("FOO".into()).to_object("1.1.0");
        assert_eq!(
            parsed(&unknown),
            json!({
                "cniVersion": "1.1.0",
                "code": 4,
                "msg": "unknown CNI_COMMAND \"FOO\"",
                "details": "expected one of ADD, DEL, CHECK, STATUS, GC, VERSION",
            })
        );
    }

    #[test]
    fn unreachable_daemon_codes_per_verb() {
        let unreachable = || TransportFailure::Unreachable {
            cause: "No such file or directory (os error 2)".into(),
            waited: None,
        };
        let daemon = |verb| ShimError::Daemon {
            verb,
            socket: "/run/t.sock".into(),
            failure: unreachable(),
        };
        assert_eq!(daemon(Verb::Add).code(), 11);
        assert_eq!(daemon(Verb::Check).code(), 11);
        assert_eq!(daemon(Verb::Gc).code(), 11);
        assert_eq!(daemon(Verb::Status).code(), 50);
        assert_eq!(
            daemon(Verb::Status).msg(),
            "tetherd is not reachable on /run/t.sock: No such file or directory (os error 2)"
        );

        let refused = |verb| ShimError::Daemon {
            verb,
            socket: "/run/t.sock".into(),
            failure: TransportFailure::Refused {
                cause: "PermissionDenied: uid 1000 not allowed".into(),
            },
        };
        assert_eq!(refused(Verb::Del).code(), 11);
        assert_eq!(refused(Verb::Status).code(), 50);

        let not_queued = ShimError::DelNotQueued {
            socket: "/run/t.sock".into(),
            failure: unreachable(),
            queue_dir: "/var/lib/tether/pending-del".into(),
            error: "Permission denied (os error 13)".into(),
        };
        assert_eq!(not_queued.code(), 11);
        let msg = not_queued.msg();
        assert!(msg.contains("No such file or directory"), "{msg}");
        assert!(msg.contains("/var/lib/tether/pending-del"), "{msg}");
        assert!(msg.contains("Permission denied"), "{msg}");
    }
}
