//! The CNI verbs the shim forwards to tetherd.
//!
//! The bottom of the shim's modules: it uses none of them, so that
//! `invocation`, `error` and `transport` can all name a verb without
//! importing each other in a circle.

use std::time::Duration;

/// A CNI verb the daemon serves (VERSION is answered by the shim).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    /// ADD: attach a container.
    Add,
    /// DEL: detach a container.
    Del,
    /// CHECK: verify an attachment.
    Check,
    /// STATUS: readiness for ADD.
    Status,
    /// GC: release attachments not listed as valid.
    Gc,
}

impl Verb {
    /// The verb named by CNI_COMMAND; `None` for anything else, VERSION
    /// included.
    pub fn parse(command: &str) -> Option<Verb> {
        match command {
            "ADD" => Some(Verb::Add),
            "DEL" => Some(Verb::Del),
            "CHECK" => Some(Verb::Check),
            "STATUS" => Some(Verb::Status),
            "GC" => Some(Verb::Gc),
            _ => None,
        }
    }

    /// The verb as CNI_COMMAND spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Verb::Add => "ADD",
            Verb::Del => "DEL",
            Verb::Check => "CHECK",
            Verb::Status => "STATUS",
            Verb::Gc => "GC",
        }
    }

    /// How long the whole call to the daemon may take. Kept below the
    /// runtimes' own limits (CRI-O allows 60 s), so that the runtime sees our
    /// error rather than killing us.
    pub fn deadline(self) -> Duration {
        match self {
            Verb::Add => Duration::from_secs(45),
            Verb::Del | Verb::Check | Verb::Status | Verb::Gc => Duration::from_secs(20),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verbs_round_trip_and_version_is_not_a_daemon_verb() {
        for verb in [Verb::Add, Verb::Del, Verb::Check, Verb::Status, Verb::Gc] {
            assert_eq!(Verb::parse(verb.as_str()), Some(verb));
        }
        assert_eq!(Verb::parse("VERSION"), None);
        assert_eq!(Verb::parse("add"), None);
        assert_eq!(Verb::parse(""), None);
        assert_eq!(Verb::Add.deadline(), Duration::from_secs(45));
        assert_eq!(Verb::Del.deadline(), Duration::from_secs(20));
    }
}
