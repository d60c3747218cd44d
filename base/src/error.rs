//! The daemon's one error type, and the single place where failures are
//! mapped to CNI error codes.
//!
//! Codes 1-99 are the CNI spec's; 100 and up are tether's own and are listed
//! in the book (docs/user/error-codes.md). Never collapse causes into one code: an operator must be
//! able to tell "pool exhausted" from "kernel refused" from "bad input".
//!
//! The storage back-ends return typed errors that say what happened; each
//! back-end's `From` impl picks the variant, and [`Error::code`] alone
//! picks the code. A message keeps the whole cause chain ([`chain`]).

use std::fmt;

/// What a CHECK found different from what ADD left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mismatch {
    /// The daemon has no record of the attachment (code 110).
    UnknownAttachment,
    /// The pod interface is missing, down, or has another MAC or MTU (111).
    PodInterface,
    /// The pod interface's addresses differ from the allocation (112).
    PodAddress,
    /// The pod's default routes or gateway neighbours are missing (113).
    PodRoute,
    /// The node-side veth is missing or changed (114).
    HostInterface,
    /// The node's route to the pod is missing or points elsewhere (115).
    HostRoute,
    /// The prevResult handed to CHECK does not match the attachment (116).
    PrevResult,
    /// The `tap` binding's tap is missing or differs: type, owner, group,
    /// multi-queue, MTU or state (117).
    Tap,
    /// Frames do not pass between the pod interface and its tap: an
    /// ingress redirect is missing (118).
    TapRedirect,
}

impl Mismatch {
    /// The CNI error code of this mismatch.
    pub fn code(self) -> u32 {
        match self {
            Mismatch::UnknownAttachment => 110,
            Mismatch::PodInterface => 111,
            Mismatch::PodAddress => 112,
            Mismatch::PodRoute => 113,
            Mismatch::HostInterface => 114,
            Mismatch::HostRoute => 115,
            Mismatch::PrevResult => 116,
            Mismatch::Tap => 117,
            Mismatch::TapRedirect => 118,
        }
    }
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mismatch::UnknownAttachment => "attachment unknown to tetherd",
            Mismatch::PodInterface => "pod interface mismatch",
            Mismatch::PodAddress => "pod address mismatch",
            Mismatch::PodRoute => "pod route mismatch",
            Mismatch::HostInterface => "host interface mismatch",
            Mismatch::HostRoute => "host route mismatch",
            Mismatch::PrevResult => "prevResult mismatch",
            Mismatch::Tap => "tap mismatch",
            Mismatch::TapRedirect => "tap redirect mismatch",
        })
    }
}

/// Every failure a request can meet.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The cniVersion is not supported, or the verb needs a newer one (1).
    #[error("incompatible CNI version: {0}")]
    IncompatibleVersion(String),
    /// A configuration field or CNI_ARGS key tether does not support (2).
    #[error("unsupported field {key}={value}")]
    UnsupportedField {
        /// The field's name.
        key: String,
        /// Its value as given.
        value: String,
    },
    /// The container is unknown and needs no cleanup (3).
    #[error("unknown container: {0}")]
    UnknownContainer(String),
    /// A CNI_* environment variable is missing or invalid (4).
    #[error("invalid environment variable {var}: {reason}")]
    InvalidEnv {
        /// The variable, e.g. "CNI_IFNAME".
        var: &'static str,
        /// Why it was refused.
        reason: String,
    },
    /// An I/O failure outside the kernel's network objects (5).
    #[error("I/O error: {0}")]
    Io(String),
    /// stdin or a part of it could not be decoded (6).
    #[error("failed to decode {what}: {reason}")]
    Decode {
        /// What was being decoded.
        what: &'static str,
        /// The decoder's complaint.
        reason: String,
    },
    /// The network configuration is well-formed but invalid (7).
    #[error("invalid network configuration: {0}")]
    InvalidConfig(String),
    /// A transient condition; the runtime should retry (11).
    #[error("try again later: {0}")]
    TryAgain(String),
    /// STATUS: the plugin cannot service ADD (50).
    #[error("not ready: {0}")]
    NotReady(String),
    /// No free address is left in a pool (100).
    #[error("address pool exhausted: {0}")]
    PoolExhausted(String),
    /// The kernel refused a change while wiring an interface (101).
    #[error("interface setup failed while {context}: {reason}")]
    InterfaceSetup {
        /// What the daemon was doing, e.g. "creating veth tth1234 for c1".
        context: String,
        /// The kernel's answer.
        reason: String,
    },
    /// CNI_IFNAME already exists in the container's netns (102).
    #[error("interface {0} already exists in the container network namespace")]
    InterfaceExists(String),
    /// The attachment exists with another netns (103).
    #[error("attachment conflict: {0}")]
    AttachmentConflict(String),
    /// The state store failed (104).
    #[error("state store failure: {0}")]
    Store(String),
    /// A requested address or MAC is held by someone else; names the holder.
    #[error("address in use: {0}")]
    AddressInUse(String),
    /// A requested address lies outside every pool of this node.
    #[error("address outside the pools: {0}")]
    AddressNotInPool(String),
    /// A requested address lies in a pool but is excluded from it (its
    /// `exclude`, its gateway, or outside its `rangeStart`..`rangeEnd`).
    #[error("address excluded from its pool: {0}")]
    AddressExcluded(String),
    /// A pool named by the configuration or an annotation does not exist,
    /// or cannot serve this network.
    #[error("unknown pool: {0}")]
    UnknownPool(String),
    /// A pod says it is a VM's (its annotations) but the API does not
    /// show it is that VM's launcher (its VirtualMachineInstance does not
    /// control it) (120).
    #[error("not the VM's launcher: {0}")]
    NotLauncher(String),
    /// No VM record of that key (admin calls).
    #[error("no VM record {0}")]
    UnknownVm(String),
    /// A VM record is not in the state the call needs (admin calls).
    #[error("VM record not ready for this: {0}")]
    VmState(String),
    /// CHECK found a difference (110-116).
    #[error("{kind}: {detail}")]
    Check {
        /// What kind of difference.
        kind: Mismatch,
        /// What exactly differs.
        detail: String,
    },
    /// A bug or an unexpected condition inside tetherd (199).
    #[error("internal error: {0}")]
    Internal(String),
    /// Several failures of one teardown, every one reported; the first
    /// decides the code ([`Error::all`]).
    #[error("{}", join(.0))]
    Several(Vec<Error>),
}

/// The messages of `errors`, joined by "; ".
fn join(errors: &[Error]) -> String {
    errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

impl Error {
    /// The CNI error code this failure maps to. The one place codes are chosen.
    pub fn code(&self) -> u32 {
        match self {
            Error::IncompatibleVersion(_) => 1,
            Error::UnsupportedField { .. } => 2,
            Error::UnknownContainer(_) => 3,
            Error::InvalidEnv { .. } => 4,
            Error::Io(_) => 5,
            Error::Decode { .. } => 6,
            Error::InvalidConfig(_) => 7,
            Error::TryAgain(_) => 11,
            Error::NotReady(_) => 50,
            Error::PoolExhausted(_) => 100,
            Error::InterfaceSetup { .. } => 101,
            Error::InterfaceExists(_) => 102,
            Error::AttachmentConflict(_) => 103,
            Error::Store(_) => 104,
            Error::AddressInUse(_) => 105,
            Error::AddressNotInPool(_) => 106,
            Error::UnknownVm(_) => 107,
            Error::VmState(_) => 108,
            Error::AddressExcluded(_) => 109,
            Error::UnknownPool(_) => 119,
            Error::NotLauncher(_) => 120,
            Error::Check { kind, .. } => kind.code(),
            Error::Internal(_) => 199,
            Error::Several(all) => all.first().map_or(199, Error::code),
        }
    }

    /// The short message of the CNI error object.
    pub fn msg(&self) -> &'static str {
        match self {
            Error::IncompatibleVersion(_) => "incompatible CNI version",
            Error::UnsupportedField { .. } => "unsupported field",
            Error::UnknownContainer(_) => "unknown container",
            Error::InvalidEnv { .. } => "invalid environment variable",
            Error::Io(_) => "I/O error",
            Error::Decode { .. } => "failed to decode content",
            Error::InvalidConfig(_) => "invalid network configuration",
            Error::TryAgain(_) => "try again later",
            Error::NotReady(_) => "plugin not available",
            Error::PoolExhausted(_) => "address pool exhausted",
            Error::InterfaceSetup { .. } => "interface setup failed",
            Error::InterfaceExists(_) => "interface already exists",
            Error::AttachmentConflict(_) => "attachment conflict",
            Error::Store(_) => "state store failure",
            Error::AddressInUse(_) => "address in use",
            Error::AddressNotInPool(_) => "address outside the pools",
            Error::AddressExcluded(_) => "address excluded",
            Error::UnknownPool(_) => "unknown pool",
            Error::NotLauncher(_) => "not the VM's launcher",
            Error::UnknownVm(_) => "unknown VM",
            Error::VmState(_) => "VM record not ready",
            Error::Check { .. } => "check failed",
            Error::Internal(_) => "internal error",
            Error::Several(all) => all.first().map_or("internal error", Error::msg),
        }
    }

    /// Shorthand for a kernel refusal with context.
    pub fn setup(context: impl Into<String>, reason: impl fmt::Display) -> Self {
        Error::InterfaceSetup {
            context: context.into(),
            reason: reason.to_string(),
        }
    }

    /// One error for all of `errors` (at least one): the error itself when
    /// there is one, [`Error::Several`] when there are more.
    pub fn all(mut errors: Vec<Error>) -> Self {
        match errors.len() {
            0 => Error::Internal("a failure with no cause".into()),
            1 => errors.remove(0),
            _ => Error::Several(errors),
        }
    }

    /// Shorthand for a CHECK mismatch.
    pub fn check(kind: Mismatch, detail: impl Into<String>) -> Self {
        Error::Check {
            kind,
            detail: detail.into(),
        }
    }
}

/// The daemon's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An error and each of its causes, outermost first, joined by ": ".
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io;

    fn io_gone() -> io::Error {
        io::Error::new(io::ErrorKind::NotFound, "gone away")
    }

    #[test]
    fn several_failures_keep_every_message_and_the_first_code() {
        let all = Error::all(vec![
            Error::setup("removing tap0", "Device or resource busy"),
            Error::Store("journal: No space left on device".into()),
        ]);
        assert_eq!(all.code(), 101);
        assert_eq!(all.msg(), "interface setup failed");
        assert_eq!(
            all.to_string(),
            "interface setup failed while removing tap0: Device or resource busy; \
             state store failure: journal: No space left on device"
        );
        let one = Error::all(vec![Error::TryAgain("etcd".into())]);
        assert!(matches!(one, Error::TryAgain(_)), "{one:?}");
        assert_eq!(Error::all(Vec::new()).code(), 199);
    }

    #[test]
    fn chain_joins_every_cause() {
        #[derive(Debug, thiserror::Error)]
        #[error("outer")]
        struct Outer(#[source] Middle);
        #[derive(Debug, thiserror::Error)]
        #[error("middle")]
        struct Middle(#[source] io::Error);
        let e = Outer(Middle(io_gone()));
        assert_eq!(chain(&e), "outer: middle: gone away");
        assert_eq!(chain(&io_gone()), "gone away");
    }
}
