//! The daemon's edge: a raw [`CniRequest`] in, a validated [`Invocation`]
//! out, or the exact CNI error for the first rule it breaks.
//!
//! Rules are checked in the order of this table, so that when a request
//! breaks several, the code is predictable. The order follows libcni's skel
//! (environment first, then the configuration, then the version gates),
//! which is what runtimes and plugin test suites expect.
//!
//! | #  | Verb            | Input                         | Rule broken                                              | Code |
//! |----|-----------------|-------------------------------|----------------------------------------------------------|------|
//! | 1  | all             | CNI_COMMAND                   | empty, unknown (incl. VERSION), or lower case            | 4    |
//! | 2  | ADD, DEL, CHECK | CNI_CONTAINERID               | unset or empty                                           | 4    |
//! | 3  | ADD, DEL, CHECK | CNI_CONTAINERID               | not `^[a-zA-Z0-9][a-zA-Z0-9_.\-]*$`, or > 1024 bytes     | 4    |
//! | 4  | ADD, CHECK      | CNI_NETNS                     | unset or empty                                           | 4    |
//! | 5  | ADD, DEL, CHECK | CNI_NETNS (when non-empty)    | not absolute, contains NUL, or > 4096 bytes              | 4    |
//! | 6  | ADD, DEL, CHECK | CNI_IFNAME                    | unset or empty                                           | 4    |
//! | 7  | ADD, DEL, CHECK | CNI_IFNAME                    | > 15 bytes, "." or "..", or has '/', ':', whitespace, NUL | 4    |
//! | 8  | ADD, DEL, CHECK | CNI_ARGS                      | > 64 KiB                                                 | 4    |
//! | 9  | ADD, DEL, CHECK | CNI_ARGS                      | pair without '=', empty key, empty segment               | 4    |
//! | 10 | ADD, DEL, CHECK | CNI_ARGS                      | IgnoreUnknown not 1/0/true/false (any case)              | 4    |
//! | 11 | ADD, DEL, CHECK | CNI_ARGS                      | IP not a comma list of IPs, MAC not six hex octets       | 4    |
//! | 12 | ADD, DEL, CHECK | CNI_ARGS                      | unknown key without IgnoreUnknown (names key and value)  | 2    |
//! | 13 | all             | stdin                         | larger than [`MAX_STDIN`] (1 MiB)                        | 7    |
//! | 14 | all             | stdin                         | empty                                                    | 6    |
//! | 15 | all             | stdin                         | not UTF-8                                                | 6    |
//! | 16 | all             | stdin                         | not JSON                                                 | 6    |
//! | 17 | all             | stdin                         | JSON, but not an object                                  | 6    |
//! | 18 | all             | cniVersion                    | missing (or null)                                        | 7    |
//! | 19 | all             | cniVersion                    | not a string                                             | 7    |
//! | 20 | all             | cniVersion                    | not one of [`SUPPORTED_VERSIONS`](super::SUPPORTED_VERSIONS) ("", 0.2.0, 1.2.0…) | 1    |
//! | 21 | CHECK           | cniVersion                    | below 0.4.0                                              | 1    |
//! | 22 | STATUS, GC      | cniVersion                    | below 1.1.0                                              | 1    |
//! | 23 | all             | name                          | missing (or null)                                        | 7    |
//! | 24 | all             | name                          | not a string                                             | 7    |
//! | 25 | all             | name                          | not `^[a-zA-Z0-9][a-zA-Z0-9_.\-]*$`                      | 7    |
//! | 26 | all             | type                          | missing (or null), or not a string                       | 7    |
//! | 27 | all             | type                          | empty, or contains '/', '\\' or NUL                      | 7    |
//! | 28 | all             | ipam                          | present, whatever its value                              | 2    |
//! | 29 | all             | mtu                           | not an integer                                           | 7    |
//! | 30 | all             | mtu                           | integer outside 576..=65535                              | 7    |
//! | 31 | all             | dns                           | not an object; nameservers/search/options not string lists; domain not a string | 7 |
//! | 32 | all             | prevResult                    | not an object, or any field malformed for the cniVersion | 7    |
//! | 33 | all             | runtimeConfig                 | not an object; ips/mac/pod-annotations of wrong type     | 7    |
//! | 34 | all             | runtimeConfig                 | ips entry not an IP/CIDR; mac not six hex octets         | 7    |
//! | 35 | all             | cni.dev/valid-attachments     | not an array (null = empty list), entry not an object, field not a string | 7 |
//! | 36 | all             | cni.dev/valid-attachments     | entry without (or with empty) containerID or ifname      | 7    |
//! | 37 | CHECK           | prevResult                    | missing (the spec says the runtime must pass it)         | 7    |
//! | 38 | GC              | cni.dev/valid-attachments     | missing (also under the legacy `cni.dev/attachments`)    | 7    |
//! | 39 | all             | vmAddressPolicy               | not "persistent" or "ephemeral" (any other type too)     | 7    |
//!
//! Code 6 is for a stdin that does not decode as a whole (rows 14-17); a
//! field that decoded but holds the wrong type or shape is code 7, and the
//! message names the field (`field "mtu": expected an integer, got "1500"`).
//! No field of the wrong type is ever replaced by its default. The shim
//! judges the two fields it reads itself (`socket`, `cniVersion`) the same
//! way, before the daemon sees them.
//!
//! STATUS and GC act on the network, not on an attachment: their
//! CNI_CONTAINERID, CNI_NETNS, CNI_IFNAME and CNI_ARGS are ignored, whatever
//! they hold. On DEL an empty or unset CNI_NETNS is `None` (containerd's
//! `ctr` sends it so). Unknown configuration keys are allowed, as the spec
//! says, except `ipam`. Whether CNI_NETNS exists is the kernel seam's check (`Veths::open_netns`).
//!
//! Rule 38 is tether's choice: a GC without the list cannot tell valid from
//! stale, and reading it as "nothing is valid" would tear down every pod.
//! An explicit `null` or `[]` does mean "nothing is valid" and is accepted.

use std::path::PathBuf;

use serde_json::Value;
use tether_proto::cni::v1::CniRequest;

use super::args::CniArgs;
use super::config::{is_cni_name, NetConf};
use super::version::{CniVersion, Command};
use tether_base::error::{Error, Result};

/// The largest stdin accepted (1 MiB). Real configurations are a few KiB;
/// the bound keeps a runaway caller from making the daemon parse megabytes.
pub const MAX_STDIN: usize = 1 << 20;
/// The longest CNI_CONTAINERID accepted. The spec sets no bound; 1024 is far
/// above the 64-byte hex IDs and `<namespace>-<id>` forms runtimes send.
pub const MAX_CONTAINER_ID: usize = 1024;
/// The longest CNI_NETNS accepted: PATH_MAX on Linux.
pub const MAX_NETNS: usize = 4096;
/// The longest interface name Linux accepts (IFNAMSIZ - 1).
pub const MAX_IFNAME: usize = 15;

/// A validated invocation.
#[derive(Debug, Clone, PartialEq)]
pub struct Invocation {
    /// The verb.
    pub command: Command,
    /// CNI_CONTAINERID; empty for STATUS and GC.
    pub container_id: String,
    /// CNI_NETNS; `None` on DEL without one, and for STATUS and GC.
    pub netns: Option<PathBuf>,
    /// CNI_IFNAME; empty for STATUS and GC.
    pub ifname: String,
    /// The parsed CNI_ARGS; default for STATUS and GC.
    pub args: CniArgs,
    /// The parsed network configuration.
    pub conf: NetConf,
}

/// Validates everything that can be validated without touching the
/// kernel, per verb, with the codes of the table in this module's docs.
pub fn parse_request(req: &CniRequest) -> Result<Invocation> {
    let command = Command::parse(&req.command)?;
    let is_set = |var: &str| req.present.iter().any(|p| p == var);

    let (container_id, netns, ifname, args) = if command.is_per_attachment() {
        let container_id = env_value(is_set("CNI_CONTAINERID"), &req.container_id);
        let container_id = container_id.ok_or_else(|| missing("CNI_CONTAINERID"))?;
        check_container_id(container_id)?;

        let netns = env_value(is_set("CNI_NETNS"), &req.netns);
        if netns.is_none() && command != Command::Del {
            return Err(missing("CNI_NETNS"));
        }
        if let Some(netns) = netns {
            check_netns(netns)?;
        }

        let ifname = env_value(is_set("CNI_IFNAME"), &req.ifname);
        let ifname = ifname.ok_or_else(|| missing("CNI_IFNAME"))?;
        check_ifname(ifname)?;

        let args = CniArgs::parse(env_value(is_set("CNI_ARGS"), &req.args).unwrap_or(""))?;
        (
            container_id.to_string(),
            netns.map(PathBuf::from),
            ifname.to_string(),
            args,
        )
    } else {
        (String::new(), None, String::new(), CniArgs::default())
    };

    let obj = decode_stdin(&req.stdin)?;
    let version = match obj.get("cniVersion").filter(|v| !v.is_null()) {
        None => {
            return Err(Error::InvalidConfig(
                "missing required field \"cniVersion\"".into(),
            ))
        }
        Some(Value::String(s)) => CniVersion::parse(s)?,
        Some(other) => {
            return Err(Error::InvalidConfig(format!(
                "field \"cniVersion\": expected a string, got {}",
                super::config::json_type(other)
            )))
        }
    };
    if version < command.min_version() {
        return Err(Error::IncompatibleVersion(format!(
            "{command} needs cniVersion {} or later, the configuration has {version}",
            command.min_version()
        )));
    }

    let plugin_name = match req.plugin_name.as_str() {
        "" => super::config::DEFAULT_PLUGIN_NAME,
        name => name,
    };
    let conf = NetConf::parse_as(&obj, version, plugin_name)?;
    match command {
        Command::Check if conf.prev_result.is_none() => {
            return Err(Error::InvalidConfig(
                "CHECK needs prevResult, the result of the attachment's ADD".into(),
            ));
        }
        Command::Gc if conf.valid_attachments.is_none() => {
            return Err(Error::InvalidConfig(format!(
                "GC needs {:?}, the list of still-valid attachments",
                super::config::VALID_ATTACHMENTS_KEY
            )));
        }
        _ => {}
    }

    Ok(Invocation {
        command,
        container_id,
        netns,
        ifname,
        args,
        conf,
    })
}

/// The value of a CNI_* variable, `None` when unset or empty. An empty
/// variable counts as missing, as in libcni's skel; `present` is what tells
/// the two apart, since the proto's strings default to empty.
fn env_value(is_set: bool, value: &str) -> Option<&str> {
    (is_set && !value.is_empty()).then_some(value)
}

fn missing(var: &'static str) -> Error {
    Error::InvalidEnv {
        var,
        reason: "missing".into(),
    }
}

fn check_container_id(id: &str) -> Result<()> {
    if id.len() > MAX_CONTAINER_ID {
        return Err(Error::InvalidEnv {
            var: "CNI_CONTAINERID",
            reason: format!("{} bytes, more than {MAX_CONTAINER_ID}", id.len()),
        });
    }
    if !is_cni_name(id) {
        return Err(Error::InvalidEnv {
            var: "CNI_CONTAINERID",
            reason: format!("{id:?} must match ^[a-zA-Z0-9][a-zA-Z0-9_.\\-]*$"),
        });
    }
    Ok(())
}

fn check_netns(netns: &str) -> Result<()> {
    let reason = if netns.len() > MAX_NETNS {
        format!("{} bytes, more than {MAX_NETNS}", netns.len())
    } else if netns.contains('\0') {
        "contains a NUL byte".to_string()
    } else if !netns.starts_with('/') {
        format!("{netns:?} is not an absolute path")
    } else {
        return Ok(());
    };
    Err(Error::InvalidEnv {
        var: "CNI_NETNS",
        reason,
    })
}

/// Linux's `dev_valid_name` plus the spec's words: 1..=15 bytes, not "." or
/// "..", no '/', ':', whitespace or NUL.
fn check_ifname(name: &str) -> Result<()> {
    let reason = if name.len() > MAX_IFNAME {
        format!("{name:?} is {} bytes, more than {MAX_IFNAME}", name.len())
    } else if name == "." || name == ".." {
        format!("{name:?} is not a valid interface name")
    } else if name
        .chars()
        .any(|c| c == '/' || c == ':' || c == '\0' || c.is_whitespace())
    {
        format!("{name:?} contains '/', ':', whitespace or NUL")
    } else {
        return Ok(());
    };
    Err(Error::InvalidEnv {
        var: "CNI_IFNAME",
        reason,
    })
}

/// Rules 13-17: the bytes must be a JSON object of bounded size.
fn decode_stdin(stdin: &[u8]) -> Result<serde_json::Map<String, Value>> {
    if stdin.len() > MAX_STDIN {
        return Err(Error::InvalidConfig(format!(
            "stdin is {} bytes, more than the limit of {MAX_STDIN}",
            stdin.len()
        )));
    }
    let decode = |reason: String| Error::Decode {
        what: "network configuration",
        reason,
    };
    if stdin.is_empty() {
        return Err(decode("stdin is empty".into()));
    }
    let text = std::str::from_utf8(stdin).map_err(|e| decode(format!("not UTF-8: {e}")))?;
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(obj)) => Ok(obj),
        Ok(_) => Err(decode("not a JSON object".into())),
        Err(e) => Err(decode(format!("not JSON: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::version::SUPPORTED_VERSIONS;
    use serde_json::json;

    use tether_proto::cni::FORWARDED_VARIABLES as ALL_VARS;

    fn conf_json(version: &str) -> Value {
        json!({"cniVersion": version, "name": "tether", "type": "tether"})
    }

    fn prev() -> Value {
        json!({
            "cniVersion": "1.1.0",
            "interfaces": [
                {"name": "tth0a1b2c3d4e5", "mac": "0a:58:a9:fe:01:01"},
                {"name": "eth0", "mac": "0a:58:0a:f4:01:07", "sandbox": "/run/netns/p1"}
            ],
            "ips": [{"address": "10.244.1.7/32", "gateway": "169.254.1.1", "interface": 1}],
            "routes": [{"dst": "0.0.0.0/0", "gw": "169.254.1.1"}]
        })
    }

    /// A request as a well-behaved runtime would send it.
    fn req(command: &str, stdin: Value) -> CniRequest {
        CniRequest {
            command: command.into(),
            container_id: "c0ffee".into(),
            netns: "/run/netns/p1".into(),
            ifname: "eth0".into(),
            args: "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web".into(),
            path: "/opt/cni/bin".into(),
            stdin: stdin.to_string().into_bytes(),
            present: ALL_VARS.iter().map(|s| s.to_string()).collect(),
            plugin_name: String::new(),
        }
    }

    fn add() -> CniRequest {
        req("ADD", conf_json("1.1.0"))
    }

    fn check() -> CniRequest {
        let mut c = conf_json("1.1.0");
        c["prevResult"] = prev();
        req("CHECK", c)
    }

    fn unset(mut r: CniRequest, var: &str) -> CniRequest {
        r.present.retain(|p| p != var);
        r
    }

    fn code(r: &CniRequest) -> u32 {
        match parse_request(r) {
            Ok(inv) => panic!("expected an error, got {inv:?}"),
            Err(e) => e.code(),
        }
    }

    fn err_text(r: &CniRequest) -> String {
        parse_request(r).map(|_| ()).unwrap_err().to_string()
    }

    #[test]
    fn valid_add() {
        let inv = parse_request(&add()).unwrap();
        assert_eq!(inv.command, Command::Add);
        assert_eq!(inv.container_id, "c0ffee");
        assert_eq!(inv.netns, Some(PathBuf::from("/run/netns/p1")));
        assert_eq!(inv.ifname, "eth0");
        assert_eq!(inv.args.pod_name.as_deref(), Some("web"));
        assert_eq!(inv.conf.cni_version, CniVersion::V1_1_0);
        assert_eq!(inv.conf.name, "tether");
    }

    #[test]
    fn every_version_is_accepted_for_add_and_del() {
        for v in SUPPORTED_VERSIONS {
            for verb in ["ADD", "DEL"] {
                let inv = parse_request(&req(verb, conf_json(v))).unwrap();
                assert_eq!(inv.conf.cni_version.as_str(), v);
            }
        }
    }

    // Rule 1.
    #[test]
    fn bad_command_is_4() {
        for c in ["", "VERSION", "add", "FOO"] {
            let r = req(c, conf_json("1.1.0"));
            assert_eq!(code(&r), 4, "{c:?}");
            assert!(err_text(&r).contains("CNI_COMMAND"));
        }
    }

    // Rules 2-3.
    #[test]
    fn container_id_rules() {
        for verb in ["ADD", "DEL", "CHECK"] {
            let mut base = check();
            base.command = verb.into();
            let r = unset(base.clone(), "CNI_CONTAINERID");
            assert_eq!(code(&r), 4, "{verb} unset");
            assert!(err_text(&r).contains("CNI_CONTAINERID"));
            let mut r = base.clone();
            r.container_id.clear();
            assert_eq!(code(&r), 4, "{verb} empty");
            for bad in ["-abc", "a b", "a/b", "a:b", "é"] {
                let mut r = base.clone();
                r.container_id = bad.into();
                assert_eq!(code(&r), 4, "{verb} {bad:?}");
                assert!(err_text(&r).contains("CNI_CONTAINERID"));
            }
            let mut r = base.clone();
            r.container_id = "a".repeat(MAX_CONTAINER_ID + 1);
            assert_eq!(code(&r), 4);
            let mut r = base;
            r.container_id = "a".repeat(MAX_CONTAINER_ID);
            assert!(parse_request(&r).is_ok());
        }
        // containerd's `<namespace>-<id>` form is fine.
        let mut r = add();
        r.container_id = "default-9f86d081884c7d65".into();
        assert!(parse_request(&r).is_ok());
    }

    // Unset vs. empty: the value is ignored when the variable is not listed.
    #[test]
    fn present_decides_unset() {
        let mut r = unset(add(), "CNI_CONTAINERID");
        r.container_id = "c0ffee".into();
        assert_eq!(code(&r), 4);
    }

    // Rules 4-5.
    #[test]
    fn netns_rules() {
        assert_eq!(code(&unset(add(), "CNI_NETNS")), 4);
        assert_eq!(code(&unset(check(), "CNI_NETNS")), 4);
        let mut r = add();
        r.netns.clear();
        assert_eq!(code(&r), 4);
        assert!(err_text(&r).contains("CNI_NETNS"));
        for bad in [
            "run/netns/p1".to_string(),
            "dummy".into(),
            "/run/\0x".into(),
            format!("/{}", "a".repeat(MAX_NETNS)),
        ] {
            for mut r in [add(), check(), req("DEL", conf_json("1.1.0"))] {
                r.netns = bad.clone();
                assert_eq!(code(&r), 4, "{bad:?}");
                assert!(err_text(&r).contains("CNI_NETNS"));
            }
        }
        let mut r = add();
        r.netns = format!("/{}", "a".repeat(MAX_NETNS - 1));
        assert!(parse_request(&r).is_ok());
    }

    #[test]
    fn del_without_netns_is_none() {
        let r = unset(req("DEL", conf_json("1.1.0")), "CNI_NETNS");
        assert_eq!(parse_request(&r).unwrap().netns, None);
        let mut r = req("DEL", conf_json("0.4.0"));
        r.netns.clear();
        assert_eq!(parse_request(&r).unwrap().netns, None);
    }

    // Rules 6-7.
    #[test]
    fn ifname_rules() {
        for verb in ["ADD", "DEL", "CHECK"] {
            let mut base = check();
            base.command = verb.into();
            assert_eq!(code(&unset(base.clone(), "CNI_IFNAME")), 4);
            for bad in [
                "",
                ".",
                "..",
                "eth/0",
                "eth:0",
                "eth 0",
                "eth\t0",
                "eth\0",
                "abcdefghijklmnop",
            ] {
                let mut r = base.clone();
                r.ifname = bad.into();
                assert_eq!(code(&r), 4, "{verb} {bad:?}");
                assert!(err_text(&r).contains("CNI_IFNAME"));
            }
            let mut r = base;
            r.ifname = "abcdefghijklmno".into();
            assert!(parse_request(&r).is_ok());
        }
    }

    // Rules 8-12.
    #[test]
    fn args_rules() {
        let mut r = add();
        r.args = "K8S_POD_NAME".into();
        assert_eq!(code(&r), 4);
        r.args = "IgnoreUnknown=maybe".into();
        assert_eq!(code(&r), 4);
        r.args = format!("IgnoreUnknown=1;X={}", "a".repeat(64 * 1024));
        assert_eq!(code(&r), 4);
        r.args = "FOO=bar".into();
        assert_eq!(code(&r), 2);
        assert!(err_text(&r).contains("FOO=bar"));
        // Unset CNI_ARGS is fine, whatever the field holds.
        let mut r = unset(add(), "CNI_ARGS");
        r.args = "FOO=bar".into();
        assert_eq!(parse_request(&r).unwrap().args, CniArgs::default());
    }

    // Rules 13-17.
    #[test]
    fn stdin_rules() {
        let mut r = add();
        r.stdin = Vec::new();
        assert_eq!(code(&r), 6);
        r.stdin = vec![0xff, 0xfe, b'{', b'}'];
        assert_eq!(code(&r), 6);
        r.stdin = b"{\"cniVersion\":".to_vec();
        assert_eq!(code(&r), 6);
        for not_obj in ["[]", "\"x\"", "1", "null", "true"] {
            r.stdin = not_obj.as_bytes().to_vec();
            assert_eq!(code(&r), 6, "{not_obj}");
        }
        let mut big = conf_json("1.1.0");
        big["pad"] = json!("x".repeat(MAX_STDIN));
        r.stdin = big.to_string().into_bytes();
        assert_eq!(code(&r), 7);
        assert!(err_text(&r).contains("limit"));
    }

    #[test]
    fn stdin_at_the_limit_is_accepted() {
        let mut c = conf_json("1.1.0");
        c["pad"] = json!("");
        let overhead = c.to_string().len();
        c["pad"] = json!("x".repeat(MAX_STDIN - overhead));
        let mut r = add();
        r.stdin = c.to_string().into_bytes();
        assert_eq!(r.stdin.len(), MAX_STDIN);
        assert!(parse_request(&r).is_ok());
    }

    // Rules 18-20.
    #[test]
    fn cni_version_rules() {
        let mut c = conf_json("1.1.0");
        c.as_object_mut().unwrap().remove("cniVersion");
        assert_eq!(code(&req("ADD", c.clone())), 7);
        c["cniVersion"] = json!(null);
        assert_eq!(code(&req("ADD", c.clone())), 7);
        c["cniVersion"] = json!(1.0);
        let r = req("ADD", c.clone());
        assert_eq!(code(&r), 7);
        assert!(err_text(&r).contains("\"cniVersion\""), "{}", err_text(&r));
        for v in ["", "0.1.0", "0.2.0", "1.2.0", "1.0"] {
            let r = req("ADD", conf_json(v));
            assert_eq!(code(&r), 1, "{v:?}");
        }
    }

    // Rules 21-22.
    #[test]
    fn verb_version_floors() {
        for v in ["0.3.0", "0.3.1"] {
            let mut c = conf_json(v);
            c["prevResult"] = prev();
            assert_eq!(code(&req("CHECK", c)), 1, "CHECK {v}");
        }
        let mut c = conf_json("0.4.0");
        c["prevResult"] = prev();
        assert!(parse_request(&req("CHECK", c)).is_ok());
        for v in ["0.3.0", "0.3.1", "0.4.0", "1.0.0"] {
            assert_eq!(code(&req("STATUS", conf_json(v))), 1, "STATUS {v}");
            let mut c = conf_json(v);
            c["cni.dev/valid-attachments"] = json!([]);
            assert_eq!(code(&req("GC", c)), 1, "GC {v}");
        }
    }

    // Rules 23-36 go through NetConf::parse; spot-check that they surface.
    #[test]
    fn config_rules_surface() {
        let mut c = conf_json("1.1.0");
        c.as_object_mut().unwrap().remove("name");
        assert_eq!(code(&req("ADD", c)), 7);
        let mut c = conf_json("1.1.0");
        c["name"] = json!("bad name");
        assert_eq!(code(&req("ADD", c)), 7);
        let mut c = conf_json("1.1.0");
        c.as_object_mut().unwrap().remove("type");
        assert_eq!(code(&req("ADD", c)), 7);
        let mut c = conf_json("1.1.0");
        c["ipam"] = json!({"type": "host-local", "subnet": "10.0.0.0/24"});
        let r = req("ADD", c);
        assert_eq!(code(&r), 2);
        assert!(err_text(&r).contains("ipam="), "{}", err_text(&r));
        let mut c = conf_json("1.1.0");
        c["mtu"] = json!(100);
        assert_eq!(code(&req("ADD", c)), 7);
        let mut c = conf_json("1.1.0");
        c["mtu"] = json!("1500");
        assert_eq!(code(&req("ADD", c)), 7);
        let mut c = conf_json("1.1.0");
        c["prevResult"] = json!({"ips": [{"address": "nope"}]});
        assert_eq!(code(&req("DEL", c)), 7);
        let mut c = conf_json("1.1.0");
        c["runtimeConfig"] = json!({"ips": "10.0.0.1"});
        assert_eq!(code(&req("ADD", c)), 7);
    }

    #[test]
    fn unknown_config_keys_are_allowed() {
        let mut c = conf_json("1.0.0");
        c["someVendorKey"] = json!({"x": 1});
        c["ipMasq"] = json!(true);
        assert!(parse_request(&req("ADD", c)).is_ok());
    }

    // Rule 37.
    #[test]
    fn check_needs_prev_result() {
        let r = req("CHECK", conf_json("1.1.0"));
        assert_eq!(code(&r), 7);
        assert!(err_text(&r).contains("prevResult"));
        let inv = parse_request(&check()).unwrap();
        assert_eq!(inv.conf.prev_result.map(|p| p.ips.len()), Some(1));
    }

    // Rule 38.
    #[test]
    fn gc_needs_valid_attachments() {
        let r = req("GC", conf_json("1.1.0"));
        assert_eq!(code(&r), 7);
        assert!(err_text(&r).contains("valid-attachments"));
        let mut c = conf_json("1.1.0");
        c["cni.dev/valid-attachments"] = json!(null);
        assert_eq!(
            parse_request(&req("GC", c)).unwrap().conf.valid_attachments,
            Some(vec![])
        );
    }

    #[test]
    fn status_and_gc_ignore_the_attachment_env() {
        let mut c = conf_json("1.1.0");
        c["cni.dev/valid-attachments"] = json!([{"containerID": "c1", "ifname": "eth0"}]);
        for (verb, stdin) in [("STATUS", conf_json("1.1.0")), ("GC", c)] {
            let mut r = req(verb, stdin);
            r.present = vec!["CNI_COMMAND".into(), "CNI_PATH".into()];
            r.container_id = "bad id".into();
            r.ifname = "way-too-long-interface".into();
            r.netns = "relative".into();
            r.args = "FOO".into();
            let inv = parse_request(&r).unwrap();
            assert_eq!(inv.command.as_str(), verb);
            assert_eq!(inv.container_id, "");
            assert_eq!(inv.ifname, "");
            assert_eq!(inv.netns, None);
            assert_eq!(inv.args, CniArgs::default());
        }
    }

    // Precedence: environment errors come before configuration errors.
    #[test]
    fn env_is_checked_before_stdin() {
        let mut r = unset(add(), "CNI_IFNAME");
        r.stdin = b"not json".to_vec();
        assert_eq!(code(&r), 4);
        let mut c = conf_json("0.3.1");
        c["prevResult"] = prev();
        let mut r = req("CHECK", c);
        r.netns.clear();
        assert_eq!(code(&r), 4);
    }
}
