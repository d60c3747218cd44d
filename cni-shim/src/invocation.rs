//! What the runtime handed the shim: the verb, the CNI_* environment and the
//! network configuration on stdin, turned into a `CniRequest`.
//!
//! The shim reads only what it needs to reach the daemon (the socket, beside
//! which it also finds the DEL queue) and the cniVersion to echo in its own
//! errors. Everything else travels to the daemon as raw bytes, and the daemon
//! judges it. The two fields the shim reads it judges itself, as strictly as
//! the daemon would: a wrong type is code 7 naming the field, never a quiet
//! fallback to the default.

use crate::error::ShimError;
use serde_json::{Map, Value};
use std::ffi::OsString;
use std::io::Read;
use std::path::PathBuf;
use tether_proto::cni::v1::CniRequest;

/// The largest network configuration the shim accepts on stdin.
pub const MAX_STDIN: usize = 1 << 20;

/// The cniVersion the shim speaks when the configuration names none.
pub const DEFAULT_CNI_VERSION: &str = "1.1.0";

/// Where tetherd listens unless the configuration says otherwise.
pub const DEFAULT_SOCKET: &str = "/run/tether/tether.sock";

/// The CNI_* variables forwarded to the daemon, in `present` order.
pub use tether_proto::cni::FORWARDED_VARIABLES as CNI_VARS;

/// The few configuration fields the shim itself needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShimConfig {
    /// The configuration's cniVersion, echoed in errors the shim makes.
    pub cni_version: String,
    /// tetherd's unix socket; the DEL queue is reached beside it.
    pub socket: PathBuf,
}

impl ShimConfig {
    /// Extracts the shim's fields from the configuration text, which must be
    /// a JSON object. An absent or `null` field takes its default (as in the
    /// daemon); one of the wrong type is refused with code 7.
    /// `name` is the file name the shim ran as ([`plugin_name`]).
    pub fn parse(stdin: &str, name: &str) -> Result<ShimConfig, ShimError> {
        let object: Map<String, Value> =
            serde_json::from_str(stdin).map_err(|e| ShimError::ConfigNotObject(e.to_string()))?;
        let text = |field: &'static str| -> Result<Option<&str>, ShimError> {
            match object.get(field) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s)),
                Some(other) => Err(ShimError::InvalidField {
                    field,
                    reason: format!("expected a string, got {}", json_type(other)),
                }),
            }
        };
        let cni_version = text("cniVersion")?.unwrap_or(DEFAULT_CNI_VERSION);
        // Run as another plugin's IPAM, tether's settings are in `ipam`.
        let socket = match ipam_section(&object, name) {
            Some(ipam) => match ipam.get("socket") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s.as_str()),
                Some(other) => {
                    return Err(ShimError::InvalidField {
                        field: "ipam.socket",
                        reason: format!("expected a string, got {}", json_type(other)),
                    })
                }
            },
            None => text("socket")?,
        };
        let socket = match socket {
            None => PathBuf::from(DEFAULT_SOCKET),
            Some(s) if s.starts_with('/') && !s.contains('\0') => PathBuf::from(s),
            // The runtime's working directory is no one's choice: a relative
            // socket would be found, or not, by accident.
            Some(s) => {
                return Err(ShimError::InvalidField {
                    field: "socket",
                    reason: format!("{s:?} is not an absolute path"),
                })
            }
        };
        Ok(ShimConfig {
            cni_version: cni_version.to_owned(),
            socket,
        })
    }
}

/// The `ipam` object when tether runs as another plugin's IPAM: the
/// configuration is that plugin's, its `ipam.type` is the name this binary
/// ran as (`name`) and its `type` is not. The daemon applies the same rule
/// (`cni::config::ipam_only`) to the name the request carries.
fn ipam_section<'a>(object: &'a Map<String, Value>, name: &str) -> Option<&'a Map<String, Value>> {
    let ipam = object.get("ipam")?.as_object()?;
    let ipam_type = ipam.get("type")?.as_str()?;
    (ipam_type == name && object.get("type").and_then(Value::as_str) != Some(name)).then_some(ipam)
}

/// The file name this binary ran as: the `type` the runtime or a main
/// plugin found it by, since both exec `<CNI_PATH dir>/<type>`. "tether"
/// when argv[0] is missing or not UTF-8.
pub fn plugin_name(argv0: Option<OsString>) -> String {
    argv0
        .as_deref()
        .map(std::path::Path::new)
        .and_then(std::path::Path::file_name)
        .and_then(|n| n.to_str())
        .filter(|n| !n.is_empty())
        .unwrap_or(DEFAULT_PLUGIN_NAME)
        .to_owned()
}

/// The name the binary is installed as, and what the daemon assumes when a
/// request carries none.
pub const DEFAULT_PLUGIN_NAME: &str = "tether";

/// The JSON type of `v`, for messages.
fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Reads the network configuration from `input`, at most [`MAX_STDIN`]
/// bytes, and checks it is text. Returns it as a `String` because the shim
/// needs both its bytes (for the daemon) and its text (for the DEL queue).
pub fn read_config(input: &mut dyn Read) -> Result<String, ShimError> {
    let mut raw = Vec::new();
    // One byte past the limit tells "exactly 1 MiB" from "more".
    input
        .take(MAX_STDIN as u64 + 1)
        .read_to_end(&mut raw)
        .map_err(|e| ShimError::ReadStdin(e.to_string()))?;
    if raw.len() > MAX_STDIN {
        return Err(ShimError::ConfigTooLarge);
    }
    String::from_utf8(raw).map_err(|e| ShimError::ConfigNotObject(e.to_string()))
}

/// The value of CNI_* variable `name`, which must be UTF-8 to travel in the
/// proto's string fields.
fn env_text(
    env: &dyn Fn(&str) -> Option<OsString>,
    name: &'static str,
) -> Result<Option<String>, ShimError> {
    env(name)
        .map(|v| v.into_string().map_err(|_| ShimError::EnvNotUtf8(name)))
        .transpose()
}

/// The CNI_COMMAND as set, `None` when unset.
pub fn command(env: &dyn Fn(&str) -> Option<OsString>) -> Result<Option<String>, ShimError> {
    env_text(env, "CNI_COMMAND")
}

/// Builds the request for the daemon from the environment and the raw
/// configuration. Unset variables become "" and are left out of `present`.
pub fn request(
    env: &dyn Fn(&str) -> Option<OsString>,
    stdin: Vec<u8>,
    name: &str,
) -> Result<CniRequest, ShimError> {
    let mut values: [String; 6] = Default::default();
    let mut present = Vec::with_capacity(CNI_VARS.len());
    for (slot, name) in values.iter_mut().zip(CNI_VARS) {
        if let Some(value) = env_text(env, name)? {
            *slot = value;
            present.push(name.to_owned());
        }
    }
    let [command, container_id, netns, ifname, args, path] = values;
    Ok(CniRequest {
        command,
        container_id,
        netns,
        ifname,
        args,
        path,
        stdin,
        present,
        plugin_name: name.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::os::unix::ffi::OsStringExt;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let map: HashMap<String, OsString> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        move |name| map.get(name).cloned()
    }

    #[test]
    fn maps_a_kubelet_add() {
        let env = env_of(&[
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "0123abcd"),
            ("CNI_NETNS", "/var/run/netns/cni-1234"),
            ("CNI_IFNAME", "eth0"),
            (
                "CNI_ARGS",
                "K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=0123abcd;K8S_POD_UID=u-1",
            ),
            ("CNI_PATH", "/opt/cni/bin:/usr/lib/cni"),
            ("HOME", "/root"),
        ]);
        let stdin = br#"{"cniVersion":"1.0.0","name":"k8s","type":"tether"}"#.to_vec();

        let req = request(&env, stdin.clone(), "tether").unwrap();

        assert_eq!(req.command, "ADD");
        assert_eq!(req.container_id, "0123abcd");
        assert_eq!(req.netns, "/var/run/netns/cni-1234");
        assert_eq!(req.ifname, "eth0");
        assert_eq!(
            req.args,
            "K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=0123abcd;K8S_POD_UID=u-1"
        );
        assert_eq!(req.path, "/opt/cni/bin:/usr/lib/cni");
        assert_eq!(req.stdin, stdin);
        assert_eq!(req.present, CNI_VARS.to_vec());
    }

    #[test]
    fn present_tells_unset_from_empty() {
        // containerd's ctr sends DEL with CNI_NETNS set but empty; here
        // CNI_ARGS is empty and CNI_PATH is not set at all.
        let env = env_of(&[
            ("CNI_COMMAND", "DEL"),
            ("CNI_CONTAINERID", "default-c1"),
            ("CNI_NETNS", ""),
            ("CNI_IFNAME", "eth0"),
            ("CNI_ARGS", ""),
        ]);

        let req = request(&env, Vec::new(), "tether").unwrap();

        assert_eq!(req.netns, "");
        assert_eq!(req.args, "");
        assert_eq!(req.path, "");
        assert_eq!(
            req.present,
            vec![
                "CNI_COMMAND",
                "CNI_CONTAINERID",
                "CNI_NETNS",
                "CNI_IFNAME",
                "CNI_ARGS"
            ]
        );
    }

    #[test]
    fn nothing_set_gives_empty_fields_and_nothing_present() {
        let req = request(&env_of(&[]), Vec::new(), "").unwrap();
        assert_eq!(req, CniRequest::default());
    }

    #[test]
    fn non_utf8_variable_is_an_invalid_environment_variable() {
        let env = |name: &str| {
            (name == "CNI_NETNS").then(|| OsString::from_vec(b"/run/netns/\xff".to_vec()))
        };
        let err = request(&env, Vec::new(), "tether").unwrap_err();
        assert_eq!(err, ShimError::EnvNotUtf8("CNI_NETNS"));
        assert_eq!(err.code(), 4);
    }

    #[test]
    fn as_another_plugins_ipam_the_socket_is_read_from_ipam() {
        let macvlan = r#"{"cniVersion":"1.0.0","type":"macvlan","socket":"/top.sock",
            "ipam":{"type":"tether","socket":"/ipam.sock"}}"#;
        assert_eq!(
            ShimConfig::parse(macvlan, "tether").unwrap().socket,
            PathBuf::from("/ipam.sock")
        );
        // Installed under another name, the rule follows the name.
        assert_eq!(
            ShimConfig::parse(macvlan, "tether-ipam").unwrap().socket,
            PathBuf::from("/top.sock")
        );
        // tether as the main plugin, with someone else's ipam: the top level.
        let main = r#"{"cniVersion":"1.0.0","type":"tether","socket":"/top.sock",
            "ipam":{"type":"host-local","socket":"/other.sock"}}"#;
        assert_eq!(
            ShimConfig::parse(main, "tether").unwrap().socket,
            PathBuf::from("/top.sock")
        );
        let no_socket = r#"{"cniVersion":"1.0.0","type":"bridge","ipam":{"type":"tether"}}"#;
        assert_eq!(
            ShimConfig::parse(no_socket, "tether").unwrap().socket,
            PathBuf::from(DEFAULT_SOCKET)
        );
        let bad = r#"{"cniVersion":"1.0.0","type":"bridge","ipam":{"type":"tether","socket":7}}"#;
        assert_eq!(ShimConfig::parse(bad, "tether").unwrap_err().code(), 7);
    }

    #[test]
    fn plugin_name_is_argv0s_file_name() {
        assert_eq!(plugin_name(Some("/opt/cni/bin/tether".into())), "tether");
        assert_eq!(plugin_name(Some("tether-ipam".into())), "tether-ipam");
        assert_eq!(plugin_name(None), "tether");
        assert_eq!(plugin_name(Some("/".into())), "tether");
        let req = request(&env_of(&[]), Vec::new(), "tether-ipam").unwrap();
        assert_eq!(req.plugin_name, "tether-ipam");
    }

    #[test]
    fn config_fields_and_defaults() {
        let full = ShimConfig::parse(
            r#"{"cniVersion":"0.4.0","socket":"/tmp/t.sock","ipam":{}}"#,
            "tether",
        )
        .unwrap();
        assert_eq!(
            full,
            ShimConfig {
                cni_version: "0.4.0".into(),
                socket: "/tmp/t.sock".into(),
            }
        );
        let defaults = ShimConfig {
            cni_version: DEFAULT_CNI_VERSION.into(),
            socket: DEFAULT_SOCKET.into(),
        };
        assert_eq!(ShimConfig::parse("{}", "tether").unwrap(), defaults);
        // null reads as absent, as in the daemon.
        assert_eq!(
            ShimConfig::parse(r#"{"cniVersion":null,"socket":null}"#, "tether").unwrap(),
            defaults
        );
        // The shim no longer reads stateDir: the queue follows the socket.
        assert_eq!(
            ShimConfig::parse(r#"{"stateDir":42}"#, "tether").unwrap(),
            defaults
        );
    }

    #[test]
    fn a_field_of_the_wrong_type_is_code_7_naming_it() {
        for (config, field, says) in [
            (r#"{"socket":123}"#, "socket", "got a number"),
            (r#"{"socket":true}"#, "socket", "got a boolean"),
            (r#"{"socket":["/run/a.sock"]}"#, "socket", "got an array"),
            (r#"{"socket":{"path":"/a"}}"#, "socket", "got an object"),
            (r#"{"socket":""}"#, "socket", "not an absolute path"),
            (
                r#"{"socket":"tether.sock"}"#,
                "socket",
                "not an absolute path",
            ),
            (r#"{"cniVersion":1}"#, "cniVersion", "got a number"),
            (r#"{"cniVersion":["1.0.0"]}"#, "cniVersion", "got an array"),
        ] {
            let err = ShimConfig::parse(config, "tether").unwrap_err();
            assert_eq!(err.code(), 7, "{config}");
            let msg = err.msg();
            assert!(msg.contains(field) && msg.contains(says), "{config}: {msg}");
        }
    }

    #[test]
    fn config_must_be_an_object() {
        for bad in ["", "[]", "\"x\"", "{", "null", "{} {}"] {
            let err = ShimConfig::parse(bad, "tether").unwrap_err();
            assert!(matches!(err, ShimError::ConfigNotObject(_)), "{bad:?}");
            assert_eq!(err.code(), 6);
        }
    }

    #[test]
    fn stdin_limit_is_one_mebibyte() {
        let exactly = vec![b' '; MAX_STDIN];
        assert_eq!(
            read_config(&mut exactly.as_slice()).unwrap().len(),
            MAX_STDIN
        );

        let over = vec![b' '; MAX_STDIN + 1];
        let err = read_config(&mut over.as_slice()).unwrap_err();
        assert_eq!(err, ShimError::ConfigTooLarge);
        assert_eq!(err.code(), 7);
    }

    #[test]
    fn stdin_must_be_text() {
        let err = read_config(&mut &b"{\"a\":\"\xff\"}"[..]).unwrap_err();
        assert_eq!(err.code(), 6);
    }
}
