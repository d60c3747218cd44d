//! The CNI verbs and spec versions tether speaks.
//!
//! Sources: SPEC.md 1.0.0 (Debian's golang-github-appc-cni-dev 1.1.2,
//! `/usr/share/doc/golang-github-appc-cni-dev/SPEC.md.gz`) for ADD, DEL,
//! CHECK; the 1.1.0 release notes and libcni's `pkg/skel` for STATUS and GC,
//! which exist only from 1.1.0 on, and CHECK, which exists from 0.4.0 on.

use std::fmt;

use tether_base::error::{Error, Result};

pub use tether_proto::cni::SUPPORTED_VERSIONS;

/// A CNI verb as set in `CNI_COMMAND`. VERSION is answered by the shim and
/// never reaches the daemon, so it is not one of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Command {
    /// Attach a container to the network.
    Add,
    /// Detach a container; idempotent.
    Del,
    /// Verify an attachment against its prevResult.
    Check,
    /// Is the plugin ready to serve ADD?
    Status,
    /// Release every attachment not listed as valid.
    Gc,
}

impl Command {
    /// Parses `CNI_COMMAND`. The spec spells verbs in capitals and libcni's
    /// skel compares them case-sensitively, so tether does too.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "ADD" => Ok(Command::Add),
            "DEL" => Ok(Command::Del),
            "CHECK" => Ok(Command::Check),
            "STATUS" => Ok(Command::Status),
            "GC" => Ok(Command::Gc),
            "" => Err(Error::InvalidEnv {
                var: "CNI_COMMAND",
                reason: "missing".into(),
            }),
            other => Err(Error::InvalidEnv {
                var: "CNI_COMMAND",
                reason: format!("unknown command {other:?}"),
            }),
        }
    }

    /// The verb as the runtime spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Command::Add => "ADD",
            Command::Del => "DEL",
            Command::Check => "CHECK",
            Command::Status => "STATUS",
            Command::Gc => "GC",
        }
    }

    /// The oldest cniVersion in which this verb exists.
    pub fn min_version(self) -> CniVersion {
        match self {
            Command::Add | Command::Del => CniVersion::V0_3_0,
            Command::Check => CniVersion::V0_4_0,
            Command::Status | Command::Gc => CniVersion::V1_1_0,
        }
    }

    /// Whether the verb acts on one attachment, and so needs
    /// CNI_CONTAINERID and CNI_IFNAME. STATUS and GC act on the network.
    pub fn is_per_attachment(self) -> bool {
        matches!(self, Command::Add | Command::Del | Command::Check)
    }
}

impl fmt::Display for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A CNI spec version tether supports. The derived order is the spec's
/// release order, so `v >= CniVersion::V0_4_0` reads as it should.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CniVersion {
    /// 0.3.0: the first rich result (interfaces, ips with "version").
    V0_3_0,
    /// 0.3.1: a typo fix over 0.3.0; same result shape.
    V0_3_1,
    /// 0.4.0: adds CHECK and prevResult on DEL; same result shape.
    V0_4_0,
    /// 1.0.0: drops "version" from ips.
    V1_0_0,
    /// 1.1.0: adds STATUS, GC, and "mtu" (and more) on interfaces.
    V1_1_0,
}

impl CniVersion {
    /// Every supported version, oldest first.
    pub const ALL: [CniVersion; 5] = [
        CniVersion::V0_3_0,
        CniVersion::V0_3_1,
        CniVersion::V0_4_0,
        CniVersion::V1_0_0,
        CniVersion::V1_1_0,
    ];

    /// The newest version; used to echo errors when the input had none.
    pub const LATEST: CniVersion = CniVersion::V1_1_0;

    /// Parses a cniVersion string. Only the exact spellings of
    /// [`SUPPORTED_VERSIONS`] are accepted: anything else, including "",
    /// "0.2.0" and "1.2.0", is an incompatible version (code 1).
    pub fn parse(s: &str) -> Result<Self> {
        CniVersion::ALL
            .into_iter()
            .find(|v| v.as_str() == s)
            .ok_or_else(|| {
                Error::IncompatibleVersion(format!(
                    "cniVersion {s:?} is not supported; supported: {}",
                    SUPPORTED_VERSIONS.join(", ")
                ))
            })
    }

    /// The version as written in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            CniVersion::V0_3_0 => "0.3.0",
            CniVersion::V0_3_1 => "0.3.1",
            CniVersion::V0_4_0 => "0.4.0",
            CniVersion::V1_0_0 => "1.0.0",
            CniVersion::V1_1_0 => "1.1.0",
        }
    }

    /// Whether result `ips` entries carry `"version": "4"|"6"` (0.3.x and
    /// 0.4.0; 1.0.0 removed the field as redundant).
    pub fn ips_carry_version(self) -> bool {
        self < CniVersion::V1_0_0
    }

    /// Whether result `interfaces` entries may carry `"mtu"` (added in
    /// 1.1.0, containernetworking/cni#1060).
    pub fn interfaces_carry_mtu(self) -> bool {
        self >= CniVersion::V1_1_0
    }
}

impl fmt::Display for CniVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_supported_version_parses_and_round_trips() {
        for s in SUPPORTED_VERSIONS {
            let v = CniVersion::parse(s).unwrap();
            assert_eq!(v.as_str(), s);
            assert_eq!(v.to_string(), s);
        }
    }

    #[test]
    fn unsupported_versions_are_code_1() {
        for s in [
            "", "0.1.0", "0.2.0", "1.2.0", "1.0", "v1.0.0", "1.0.0 ", "2.0.0",
        ] {
            let err = CniVersion::parse(s).unwrap_err();
            assert_eq!(err.code(), 1, "{s:?}");
            assert!(err.to_string().contains("not supported"), "{err}");
        }
    }

    #[test]
    fn versions_are_ordered_by_release() {
        assert!(CniVersion::V0_3_0 < CniVersion::V0_3_1);
        assert!(CniVersion::V0_3_1 < CniVersion::V0_4_0);
        assert!(CniVersion::V0_4_0 < CniVersion::V1_0_0);
        assert!(CniVersion::V1_0_0 < CniVersion::V1_1_0);
        assert_eq!(CniVersion::ALL.iter().max(), Some(&CniVersion::LATEST));
    }

    #[test]
    fn result_shape_switches() {
        assert!(CniVersion::V0_4_0.ips_carry_version());
        assert!(!CniVersion::V1_0_0.ips_carry_version());
        assert!(!CniVersion::V1_0_0.interfaces_carry_mtu());
        assert!(CniVersion::V1_1_0.interfaces_carry_mtu());
    }

    #[test]
    fn commands_parse_case_sensitively() {
        assert_eq!(Command::parse("ADD").unwrap(), Command::Add);
        assert_eq!(Command::parse("DEL").unwrap(), Command::Del);
        assert_eq!(Command::parse("CHECK").unwrap(), Command::Check);
        assert_eq!(Command::parse("STATUS").unwrap(), Command::Status);
        assert_eq!(Command::parse("GC").unwrap(), Command::Gc);
        for bad in ["", "add", "VERSION", "DELETE", " ADD"] {
            let err = Command::parse(bad).unwrap_err();
            assert_eq!(err.code(), 4, "{bad:?}");
            assert!(err.to_string().contains("CNI_COMMAND"), "{err}");
        }
    }

    #[test]
    fn verb_floors() {
        assert_eq!(Command::Add.min_version(), CniVersion::V0_3_0);
        assert_eq!(Command::Check.min_version(), CniVersion::V0_4_0);
        assert_eq!(Command::Status.min_version(), CniVersion::V1_1_0);
        assert_eq!(Command::Gc.min_version(), CniVersion::V1_1_0);
    }
}
