//! `CNI_ARGS`: the runtime's `K=V;K=V` extra arguments.
//!
//! The grammar follows libcni's `types.LoadArgs`, which every Go plugin
//! uses: pairs separated by `;`, an unknown key is an error unless
//! `IgnoreUnknown` is true (in any position), `IgnoreUnknown` takes
//! 1/0/true/false in any case, and a repeated key keeps its last value.
//! tether differs in one place on purpose: a value may contain `=` (split at
//! the first one), since nothing is gained by refusing base64-ish values.

use std::net::IpAddr;

use tether_base::error::{Error, Result};
use tether_base::mac::{self, Mac, Separator};

/// The longest `CNI_ARGS` accepted (64 KiB): far above what any runtime
/// sends, low enough that a runaway caller cannot make the daemon work hard.
pub const MAX_ARGS: usize = 64 * 1024;

/// The parsed `CNI_ARGS`. Known keys only; an empty value counts as unset.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CniArgs {
    /// `IgnoreUnknown`: skip keys tether does not know instead of failing.
    pub ignore_unknown: bool,
    /// `K8S_POD_NAMESPACE`.
    pub pod_namespace: Option<String>,
    /// `K8S_POD_NAME`.
    pub pod_name: Option<String>,
    /// `K8S_POD_UID`.
    pub pod_uid: Option<String>,
    /// `K8S_POD_INFRA_CONTAINER_ID`.
    pub infra_container_id: Option<String>,
    /// `IP`: requested address(es), comma-separated as host-local accepts
    /// them, parsed once here.
    pub ip: Vec<IpAddr>,
    /// `MAC`: requested pod MAC, parsed once here.
    pub mac: Option<RequestedMac>,
}

impl CniArgs {
    /// Parses `CNI_ARGS`. Errors: a pair without `=` or with an empty key,
    /// an empty segment (e.g. `A=1;;B=2`), a bad `IgnoreUnknown`, `IP` or
    /// `MAC` value, or more than [`MAX_ARGS`] bytes → 4 on CNI_ARGS; an
    /// unknown key without `IgnoreUnknown` → 2 naming the key and value.
    pub fn parse(raw: &str) -> Result<Self> {
        if raw.len() > MAX_ARGS {
            return Err(invalid(format!(
                "{} bytes, more than the limit of {MAX_ARGS}",
                raw.len()
            )));
        }
        let mut args = CniArgs::default();
        if raw.is_empty() {
            return Ok(args);
        }
        // Unknown keys are judged only once IgnoreUnknown has been seen,
        // wherever it stands in the list; libcni does the same.
        let mut first_unknown: Option<(&str, &str)> = None;
        for pair in raw.split(';') {
            let Some((key, value)) = pair.split_once('=') else {
                return Err(invalid(format!("pair {pair:?} has no '='")));
            };
            if key.is_empty() {
                return Err(invalid(format!("pair {pair:?} has an empty key")));
            }
            let slot = match key {
                "IgnoreUnknown" => {
                    args.ignore_unknown = parse_bool(value)?;
                    continue;
                }
                "K8S_POD_NAMESPACE" => &mut args.pod_namespace,
                "K8S_POD_NAME" => &mut args.pod_name,
                "K8S_POD_UID" => &mut args.pod_uid,
                "K8S_POD_INFRA_CONTAINER_ID" => &mut args.infra_container_id,
                "IP" => {
                    args.ip = parse_ip_list(value)?;
                    continue;
                }
                "MAC" => {
                    args.mac = match value {
                        "" => None,
                        _ => Some(RequestedMac::parse(value).ok_or_else(|| {
                            invalid(format!("MAC {value:?} is not a MAC address"))
                        })?),
                    };
                    continue;
                }
                _ => {
                    first_unknown.get_or_insert((key, value));
                    continue;
                }
            };
            *slot = (!value.is_empty()).then(|| value.to_string());
        }
        if let Some((key, value)) = first_unknown {
            if !args.ignore_unknown {
                return Err(Error::UnsupportedField {
                    key: key.to_string(),
                    value: value.to_string(),
                });
            }
        }
        Ok(args)
    }
}

fn invalid(reason: String) -> Error {
    Error::InvalidEnv {
        var: "CNI_ARGS",
        reason,
    }
}

fn parse_bool(value: &str) -> Result<bool> {
    match value.to_ascii_lowercase().as_str() {
        "1" | "true" => Ok(true),
        "0" | "false" => Ok(false),
        _ => Err(invalid(format!(
            "IgnoreUnknown={value:?}: expected 1, 0, true or false"
        ))),
    }
}

fn parse_ip_list(value: &str) -> Result<Vec<IpAddr>> {
    if value.is_empty() {
        return Ok(Vec::new());
    }
    value
        .split(',')
        .map(|part| {
            part.parse::<IpAddr>()
                .map_err(|_| invalid(format!("IP {part:?} is not an IP address")))
        })
        .collect()
}

/// A MAC a runtime asked for (CNI_ARGS `MAC` or runtimeConfig `mac`),
/// parsed once when the request is. The text is kept as given because the
/// errors name it that way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestedMac {
    mac: Mac,
    separator: Separator,
    text: String,
}

impl RequestedMac {
    /// Six two-digit hex octets separated by ':' or '-', the forms runtimes
    /// (podman `--mac-address`, kubelet annotations) actually send; `None`
    /// for anything else.
    pub fn parse(s: &str) -> Option<Self> {
        Mac::parse_either(s).map(|(mac, separator)| RequestedMac {
            mac,
            separator,
            text: s.to_string(),
        })
    }

    /// The text as the runtime sent it.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The MAC a new pod interface gets from this request (`what` names the
    /// source in errors): only the colon form, unicast and not zero, else
    /// `InvalidConfig`. The dash form passes parsing (and so DEL and CHECK)
    /// but not ADD, as before this type existed.
    pub fn for_pod(&self, what: &str) -> Result<Mac> {
        match self.separator {
            Separator::Colon => self.mac.for_pod(&self.text, what),
            Separator::Dash => Err(mac::not_a_mac(&self.text, what)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_is_default() {
        assert_eq!(CniArgs::parse("").unwrap(), CniArgs::default());
    }

    #[test]
    fn podman_args() {
        let a =
            CniArgs::parse("IgnoreUnknown=1;K8S_POD_NAME=foo;IP=10.88.0.5;MAC=0a:58:0a:58:00:05")
                .unwrap();
        assert!(a.ignore_unknown);
        assert_eq!(a.pod_name.as_deref(), Some("foo"));
        assert_eq!(a.ip, vec!["10.88.0.5".parse::<IpAddr>().unwrap()]);
        assert_eq!(
            a.mac.as_ref().map(RequestedMac::text),
            Some("0a:58:0a:58:00:05")
        );
        assert_eq!(a.pod_namespace, None);
    }

    #[test]
    fn kubelet_args() {
        let a = CniArgs::parse(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;\
             K8S_POD_INFRA_CONTAINER_ID=abc123;K8S_POD_UID=0f6c-11",
        )
        .unwrap();
        assert_eq!(a.pod_namespace.as_deref(), Some("default"));
        assert_eq!(a.pod_name.as_deref(), Some("web-0"));
        assert_eq!(a.infra_container_id.as_deref(), Some("abc123"));
        assert_eq!(a.pod_uid.as_deref(), Some("0f6c-11"));
    }

    #[test]
    fn unknown_key_without_ignore_is_code_2_with_key_and_value() {
        let err = CniArgs::parse("K8S_POD_NAME=foo;FOO=bar").unwrap_err();
        assert_eq!(err.code(), 2);
        assert!(
            matches!(&err, Error::UnsupportedField { key, value } if key == "FOO" && value == "bar")
        );
        assert!(err.to_string().contains("FOO=bar"), "{err}");
    }

    #[test]
    fn ignore_unknown_counts_wherever_it_stands() {
        let a = CniArgs::parse("FOO=bar;IgnoreUnknown=true").unwrap();
        assert!(a.ignore_unknown);
        let err = CniArgs::parse("FOO=bar;IgnoreUnknown=0").unwrap_err();
        assert_eq!(err.code(), 2);
    }

    #[test]
    fn ignore_unknown_values() {
        for (v, want) in [
            ("1", true),
            ("TRUE", true),
            ("True", true),
            ("0", false),
            ("False", false),
        ] {
            assert_eq!(
                CniArgs::parse(&format!("IgnoreUnknown={v}"))
                    .unwrap()
                    .ignore_unknown,
                want
            );
        }
        for v in ["yes", "", "2", "on"] {
            let err = CniArgs::parse(&format!("IgnoreUnknown={v}")).unwrap_err();
            assert_eq!(err.code(), 4, "{v:?}");
            assert!(err.to_string().contains("CNI_ARGS"), "{err}");
        }
    }

    #[test]
    fn malformed_pairs_are_code_4() {
        for raw in [
            "K8S_POD_NAME",
            "=foo",
            "A=1;;B=2",
            "A=1;",
            ";",
            "IgnoreUnknown=1;junk",
        ] {
            let err = CniArgs::parse(raw).unwrap_err();
            assert_eq!(err.code(), 4, "{raw:?}");
            assert!(err.to_string().contains("CNI_ARGS"), "{err}");
        }
    }

    #[test]
    fn values_may_contain_equals_and_be_empty() {
        let a = CniArgs::parse("K8S_POD_NAME=a=b;K8S_POD_UID=").unwrap();
        assert_eq!(a.pod_name.as_deref(), Some("a=b"));
        assert_eq!(a.pod_uid, None);
    }

    #[test]
    fn last_value_wins() {
        let a = CniArgs::parse("K8S_POD_NAME=a;K8S_POD_NAME=b").unwrap();
        assert_eq!(a.pod_name.as_deref(), Some("b"));
    }

    #[test]
    fn ip_and_mac_are_checked() {
        let a = CniArgs::parse("IP=10.0.0.5,fd00::5").unwrap();
        let want: Vec<IpAddr> = vec!["10.0.0.5".parse().unwrap(), "fd00::5".parse().unwrap()];
        assert_eq!(a.ip, want);
        for raw in [
            "IP=10.0.0.256",
            "IP=10.0.0.5/24",
            "IP=10.0.0.5,",
            "MAC=zz:58:0a:58:00:05",
            "MAC=0a:58",
        ] {
            let err = CniArgs::parse(raw).unwrap_err();
            assert_eq!(err.code(), 4, "{raw:?}");
        }
        assert!(CniArgs::parse("MAC=0A-58-0A-58-00-05").is_ok());
    }

    #[test]
    fn a_requested_mac_is_parsed_once_and_judged_for_a_pod_on_add() {
        let colon = RequestedMac::parse("0A:58:0a:58:00:05").unwrap();
        assert_eq!(
            colon.for_pod("CNI_ARGS MAC").unwrap().to_string(),
            "0a:58:0a:58:00:05"
        );
        // The dash form passes parsing (DEL and CHECK go on) but a pod
        // interface is not given it, as before there was a type for it.
        let dash = RequestedMac::parse("0A-58-0A-58-00-05").unwrap();
        assert_eq!(dash.text(), "0A-58-0A-58-00-05");
        let err = dash.for_pod("CNI_ARGS MAC").unwrap_err();
        assert_eq!(err.code(), 7);
        assert!(err.to_string().contains("is not a MAC address"), "{err}");
        let multicast = RequestedMac::parse("01:00:5e:00:00:05").unwrap();
        let err = multicast.for_pod("CNI_ARGS MAC").unwrap_err();
        assert_eq!(err.code(), 7);
        assert!(err.to_string().contains("multicast or zero"), "{err}");
        for bad in ["0a:58", "0a-58:0a:58:00:05", "+a:58:0a:58:00:05", ""] {
            assert_eq!(RequestedMac::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn too_long_is_code_4() {
        let raw = format!("IgnoreUnknown=1;X={}", "a".repeat(MAX_ARGS));
        let err = CniArgs::parse(&raw).unwrap_err();
        assert_eq!(err.code(), 4);
        assert!(err.to_string().contains("limit"), "{err}");
        // Exactly at the limit is fine.
        let at = format!("IgnoreUnknown=1;X={}", "a".repeat(MAX_ARGS - 18));
        assert_eq!(at.len(), MAX_ARGS);
        assert!(CniArgs::parse(&at).is_ok());
    }
}
