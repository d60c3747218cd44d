//! What the kernel seam fails with: [`KernelError`], typed by what went
//! wrong, with the kernel's errno when it gave one. The daemon's error
//! ([`tether_base::error::Error`]) takes it through the one `From` below,
//! and `Error::code` picks the CNI code, as for the stores' errors.

use std::fmt;
use tether_base::error::{Error, Mismatch};

/// The seam's result type.
pub type Result<T, E = KernelError> = std::result::Result<T, E>;

/// Every failure of the kernel seam.
#[derive(Debug, Clone, thiserror::Error)]
pub enum KernelError {
    /// The kernel refused a change or a read (CNI code 101).
    #[error("interface setup failed while {doing}: {reason}")]
    Refused {
        /// What tether was doing, e.g. "creating veth tth1234 for c1".
        doing: String,
        /// The kernel's errno (positive), when it answered with one.
        errno: Option<i32>,
        /// The kernel's words.
        reason: String,
    },
    /// The pod's interface name is taken in its netns (102).
    #[error("interface {0} already exists in the container network namespace")]
    Exists(String),
    /// What CHECK found different from what ADD left (110-118).
    #[error("{kind}: {detail}")]
    Mismatch {
        /// Which kind of difference.
        kind: Mismatch,
        /// What exactly differs.
        detail: String,
    },
    /// A CNI_* value the kernel cannot use: a netns that is not one, an
    /// interface name it refuses (4).
    #[error("invalid environment variable {var}: {reason}")]
    BadEnv {
        /// The variable, e.g. "CNI_NETNS".
        var: &'static str,
        /// Why.
        reason: String,
    },
    /// A file of the host outside the kernel's network objects (5).
    #[error("I/O error: {0}")]
    Io(String),
    /// A bug or an unexpected condition in the seam (199).
    #[error("internal error: {0}")]
    Internal(String),
}

impl KernelError {
    /// The kernel refused what tether was `doing`, for `cause`.
    pub fn refused(doing: impl Into<String>, cause: impl Into<Cause>) -> Self {
        let cause = cause.into();
        KernelError::Refused {
            doing: doing.into(),
            errno: cause.errno,
            reason: cause.text,
        }
    }

    /// CHECK found a difference of `kind`.
    pub fn mismatch(kind: Mismatch, detail: impl Into<String>) -> Self {
        KernelError::Mismatch {
            kind,
            detail: detail.into(),
        }
    }

    /// The CNI code this failure maps to, as the daemon's error decides it.
    pub fn code(&self) -> u32 {
        Error::from(self.clone()).code()
    }

    /// The kernel's errno, when the failure is a refusal that carried one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            KernelError::Refused { errno, .. } => *errno,
            _ => None,
        }
    }
}

/// Why the kernel refused: its errno when it gave one, and its words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cause {
    /// The errno (positive), if any.
    pub errno: Option<i32>,
    /// The text.
    pub text: String,
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl From<std::io::Error> for Cause {
    fn from(e: std::io::Error) -> Self {
        Cause {
            errno: e.raw_os_error(),
            text: e.to_string(),
        }
    }
}

impl From<nix::errno::Errno> for Cause {
    fn from(e: nix::errno::Errno) -> Self {
        Cause {
            errno: Some(e as i32),
            text: e.to_string(),
        }
    }
}

impl From<String> for Cause {
    fn from(text: String) -> Self {
        Cause { errno: None, text }
    }
}

impl From<&str> for Cause {
    fn from(text: &str) -> Self {
        Cause {
            errno: None,
            text: text.to_owned(),
        }
    }
}

/// Which error, and so which CNI code, each kernel failure is.
impl From<KernelError> for Error {
    fn from(e: KernelError) -> Self {
        match e {
            KernelError::Refused { doing, reason, .. } => Error::InterfaceSetup {
                context: doing,
                reason,
            },
            KernelError::Exists(name) => Error::InterfaceExists(name),
            KernelError::Mismatch { kind, detail } => Error::Check { kind, detail },
            KernelError::BadEnv { var, reason } => Error::InvalidEnv { var, reason },
            KernelError::Io(text) => Error::Io(text),
            KernelError::Internal(text) => Error::Internal(text),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kernel_failure_keeps_its_code_and_text_and_a_refusal_its_errno() {
        let busy = KernelError::refused(
            "removing tap0",
            std::io::Error::from_raw_os_error(libc::EBUSY),
        );
        assert_eq!(busy.errno(), Some(libc::EBUSY));
        let cases: Vec<(KernelError, u32, &str)> = vec![
            (
                busy,
                101,
                "interface setup failed while removing tap0: Device or resource busy (os error 16)",
            ),
            (
                KernelError::refused("creating a veth", nix::errno::Errno::EEXIST),
                101,
                "interface setup failed while creating a veth: EEXIST: File exists",
            ),
            (
                KernelError::Exists("eth0".into()),
                102,
                "interface eth0 already exists in the container network namespace",
            ),
            (
                KernelError::mismatch(Mismatch::HostRoute, "no route to 10.1.0.2"),
                115,
                "host route mismatch: no route to 10.1.0.2",
            ),
            (
                KernelError::BadEnv {
                    var: "CNI_NETNS",
                    reason: "/run/netns/x does not exist".into(),
                },
                4,
                "invalid environment variable CNI_NETNS: /run/netns/x does not exist",
            ),
            (
                KernelError::Io("reading the boot id".into()),
                5,
                "I/O error: reading the boot id",
            ),
            (KernelError::Internal("x".into()), 199, "internal error: x"),
        ];
        for (kernel, code, text) in cases {
            assert_eq!(kernel.to_string(), text);
            let e = Error::from(kernel);
            assert_eq!((e.code(), e.to_string()), (code, text.to_owned()));
        }
    }
}
