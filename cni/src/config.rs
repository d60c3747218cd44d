//! The network configuration a plugin receives on stdin, parsed field by
//! field so that each failure gets its exact code.
//!
//! The code rule, used everywhere in this file: a required field that is
//! absent is an invalid configuration (7); a field of the wrong JSON type, or
//! one that cannot be decoded, is a decoding failure (6); a field of the
//! right type whose value is out of bounds is again invalid (7). An explicit
//! `null` counts as absent for optional fields, as Go's decoder treats it.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use serde_json::{Map, Value};

use super::args::RequestedMac;
use super::version::CniVersion;
use tether_base::error::{Error, Result};
use tether_base::guest::{BindingKind, KubevirtConf, MAX_QUEUES};

/// The smallest MTU accepted: the IPv4 minimum datagram every host must
/// reassemble (RFC 791). IPv6's 1280 is the caller's check.
pub const MIN_MTU: u32 = 576;
/// The largest MTU accepted: what the kernel's veth allows.
pub const MAX_MTU: u32 = 65535;

/// The GC key for still-valid attachments (SPEC 1.1.0, as fixed in libcni
/// 1.2.3).
pub const VALID_ATTACHMENTS_KEY: &str = "cni.dev/valid-attachments";
/// The name the 1.1.0 SPEC text first used; libcni 1.2.3 and later send
/// both (containernetworking/cni#1101), so tether reads either.
pub const LEGACY_ATTACHMENTS_KEY: &str = "cni.dev/attachments";

/// The CRI capability that carries the pod's annotations.
pub const POD_ANNOTATIONS_KEY: &str = "io.kubernetes.cri.pod-annotations";

/// The parsed network configuration (stdin).
#[derive(Debug, Clone, PartialEq)]
pub struct NetConf {
    /// `cniVersion`: the version of both input and output.
    pub cni_version: CniVersion,
    /// `name`: the network's name; part of every attachment's identity.
    pub name: String,
    /// `type`: the plugin binary's name.
    pub plugin_type: String,
    /// `mtu`: an override of the pod MTU, 576..=65535.
    pub mtu: Option<u32>,
    /// `dns`: copied into ADD results, as the reference ptp plugin does.
    pub dns: Option<Value>,
    /// `prevResult`: the previous plugin's result (chaining, DEL, CHECK).
    pub prev_result: Option<PrevResult>,
    /// `runtimeConfig`: the capability arguments the runtime filled in.
    pub runtime_config: RuntimeConfig,
    /// `cni.dev/valid-attachments` (GC only). `Some(vec![])` when the
    /// runtime listed none (Go marshals a nil slice as `null`).
    pub valid_attachments: Option<Vec<AttachmentId>>,
    /// `vmAddressPolicy`: when a VM's address is freed.
    pub vm_address_policy: VmAddressPolicy,
    /// `kubevirt`: how VM pods on this network reach their guest.
    pub kubevirt: KubevirtConf,
    /// `pool` (or `ipam.pool`): the named pools the addresses come from,
    /// at most one per family; empty for the node's pod CIDRs.
    pub pools: Vec<String>,
    /// Set when tether runs as another plugin's IPAM: the `ipam` section.
    pub ipam: Option<IpamConf>,
    /// Top-level keys neither tether nor the runtime defines, in key order:
    /// accepted, as the spec lets a plugin ignore them, for the daemon to
    /// warn about (a typo such as `"mut": 1400` would otherwise go unseen).
    /// Empty when tether is another plugin's IPAM: the top level is then
    /// that plugin's.
    pub unknown_keys: Vec<UnknownKey>,
}

/// A top-level netconf key tether does not know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownKey {
    /// The key as given.
    pub key: String,
    /// What it probably meant: a known key within a typo or two (case
    /// ignored), or the flag that replaced a key earlier versions read.
    pub hint: Option<&'static str>,
}

impl std::fmt::Display for UnknownKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.hint {
            Some(hint) => write!(f, "{:?} (did you mean {hint}?)", self.key),
            None => write!(f, "{:?}", self.key),
        }
    }
}

/// The top-level keys of tether's own netconf: tether's settings.
const TETHER_KEYS: [&str; 10] = [
    "cniVersion",
    "name",
    "type",
    "socket",
    "mtu",
    "dns",
    "pool",
    "ipam",
    "vmAddressPolicy",
    "kubevirt",
];

/// The top-level keys the runtime and the spec's conventions put in any
/// plugin's netconf.
const RUNTIME_KEYS: [&str; 6] = [
    "prevResult",
    "runtimeConfig",
    "capabilities",
    "args",
    VALID_ATTACHMENTS_KEY,
    LEGACY_ATTACHMENTS_KEY,
];

/// Keys that earlier versions read, with what replaced them.
const RETIRED_KEYS: [(&str, &str); 1] = [("stateDir", "tetherd's --state-dir")];

/// The keys of `obj` that tether does not know, each with its likely
/// meaning when there is one.
fn unknown_keys(obj: &Map<String, Value>) -> Vec<UnknownKey> {
    let known = TETHER_KEYS.iter().chain(&RUNTIME_KEYS);
    obj.keys()
        .filter(|k| !known.clone().any(|known| known == k))
        .map(|key| UnknownKey {
            hint: RETIRED_KEYS
                .iter()
                .find(|(old, _)| old == key)
                .map(|(_, new)| *new)
                .or_else(|| closest_key(key)),
            key: key.clone(),
        })
        .collect()
}

/// The known key `key` is most likely a typo of: within one edit for keys
/// of up to four letters, two for longer ones (a swap of neighbours counts
/// as one, case is ignored), and the nearest of those.
fn closest_key(key: &str) -> Option<&'static str> {
    let key = key.to_ascii_lowercase();
    let limit = if key.chars().count() <= 4 { 1 } else { 2 };
    TETHER_KEYS
        .iter()
        .chain(&RUNTIME_KEYS)
        .map(|k| (edit_distance(&key, &k.to_ascii_lowercase()), *k))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

/// The optimal string alignment distance: insertions, deletions,
/// substitutions and swaps of neighbours, each costing one.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let width = b.len() + 1;
    let mut d = vec![0usize; (a.len() + 1) * width];
    for i in 0..=a.len() {
        for j in 0..=b.len() {
            d[i * width + j] = if i == 0 || j == 0 {
                i + j
            } else {
                let cost = usize::from(a[i - 1] != b[j - 1]);
                let mut best = (d[(i - 1) * width + j] + 1)
                    .min(d[i * width + j - 1] + 1)
                    .min(d[(i - 1) * width + j - 1] + cost);
                if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                    best = best.min(d[(i - 2) * width + j - 2] + 1);
                }
                best
            };
        }
    }
    d[a.len() * width + b.len()]
}

/// The `ipam` section of another plugin's configuration, when that plugin
/// runs tether as its IPAM (`"ipam": {"type": "tether", ...}`). tether then
/// creates no interface: it answers with addresses, routes and DNS.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct IpamConf {
    /// `routes`: added after the pool's own routes.
    pub routes: Vec<ResultRoute>,
    /// `dns`: replaces the pool's.
    pub dns: Option<Value>,
}

/// The name tether's binary is installed as; a request that carries no
/// `plugin_name` (an older shim, grpcurl) was run as this.
pub const DEFAULT_PLUGIN_NAME: &str = "tether";

/// True when `obj` is another plugin's configuration that runs tether as
/// its IPAM: its `ipam.type` is `name`, the file name the shim ran as, and
/// its `type` is not. The runtime ran the main plugin (`type`), and that
/// plugin ran its IPAM's `type`, which is this binary. tether as the main
/// plugin with another IPAM (`ipam.type` is not `name`) is refused (2).
/// The shim applies the same rule to find the socket.
pub fn ipam_only(obj: &Map<String, Value>, name: &str) -> bool {
    let ipam_type = obj
        .get("ipam")
        .and_then(Value::as_object)
        .and_then(|i| i.get("type"))
        .and_then(Value::as_str);
    ipam_type == Some(name) && obj.get("type").and_then(Value::as_str) != Some(name)
}

/// `vmAddressPolicy` of a network: when a KubeVirt VM's address record is
/// freed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum VmAddressPolicy {
    /// `persistent` (the default): kept after the VM's pods are gone, so a
    /// VM started again anywhere gets the same IP and MAC; freed only by
    /// the admin call `ReleaseVm`.
    #[default]
    Persistent,
    /// `ephemeral`: freed when the VM's last pod is deleted.
    Ephemeral,
}

/// One entry of GC's `cni.dev/valid-attachments`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AttachmentId {
    /// `containerID`: the CNI_CONTAINERID of the attachment's ADD.
    pub container_id: String,
    /// `ifname`: the CNI_IFNAME of the attachment's ADD.
    pub ifname: String,
}

/// The capability arguments tether declares. Others (`portMappings`,
/// `bandwidth`, podman's `aliases`) are accepted and ignored: a runtime
/// sends only what the conflist declares, and tether's conflist may declare
/// them for plugins chained after it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RuntimeConfig {
    /// `ips`: requested addresses, each given as an IP or an IP/prefix (the
    /// prefix is the pod's business: tether routes /32 and /128), parsed
    /// once here.
    pub ips: Vec<IpAddr>,
    /// `mac`: the requested pod MAC, parsed once here.
    pub mac: Option<RequestedMac>,
    /// `io.kubernetes.cri.pod-annotations`: the pod's annotations.
    pub pod_annotations: BTreeMap<String, String>,
}

/// A prevResult, in the shape of the configuration's cniVersion. The typed
/// fields are what tether reads; the whole object is kept as given so that
/// chaining passes on every field tether does not know.
#[derive(Debug, Clone, PartialEq)]
pub struct PrevResult {
    /// `interfaces`.
    pub interfaces: Vec<ResultInterface>,
    /// `ips`.
    pub ips: Vec<ResultIp>,
    /// `routes`.
    pub routes: Vec<ResultRoute>,
    raw: Map<String, Value>,
}

/// An entry of a result's `interfaces`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResultInterface {
    /// `name`.
    pub name: String,
    /// `mac`, if given.
    pub mac: Option<String>,
    /// `sandbox`: the netns path; empty or absent for host interfaces.
    pub sandbox: Option<String>,
}

/// An entry of a result's `ips`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResultIp {
    /// `address`, in CIDR notation (host bits kept).
    pub address: IpNet,
    /// `gateway`, if given.
    pub gateway: Option<IpAddr>,
    /// `interface`: an index into `interfaces`.
    pub interface: Option<usize>,
}

/// An entry of a result's `routes`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResultRoute {
    /// `dst`, in CIDR notation.
    pub dst: IpNet,
    /// `gw`, if given.
    pub gw: Option<IpAddr>,
}

impl PrevResult {
    /// The prevResult object exactly as the runtime sent it.
    pub fn raw(&self) -> &Map<String, Value> {
        &self.raw
    }

    /// Parses a prevResult as the configuration's `version` shapes it.
    /// libcni hands a plugin its prevResult already converted to the
    /// configuration's version, so a mismatch of shape is malformed (6).
    pub fn parse(value: &Value, version: CniVersion) -> Result<Self> {
        let obj = value
            .as_object()
            .ok_or_else(|| decode("prevResult", "not a JSON object"))?;
        if let Some(v) = present(obj, "cniVersion") {
            v.as_str()
                .ok_or_else(|| decode("prevResult", "cniVersion is not a string"))?;
        }
        let interfaces = array_of(obj, "interfaces")?
            .iter()
            .enumerate()
            .map(|(i, v)| parse_interface(i, v, version))
            .collect::<Result<Vec<_>>>()?;
        let ips = array_of(obj, "ips")?
            .iter()
            .enumerate()
            .map(|(i, v)| parse_ip(i, v, version, interfaces.len()))
            .collect::<Result<Vec<_>>>()?;
        let routes = array_of(obj, "routes")?
            .iter()
            .enumerate()
            .map(|(i, v)| parse_route(i, v))
            .collect::<Result<Vec<_>>>()?;
        if let Some(dns) = present(obj, "dns") {
            check_dns(dns, "prevResult")?;
        }
        Ok(PrevResult {
            interfaces,
            ips,
            routes,
            raw: obj.clone(),
        })
    }
}

impl NetConf {
    /// Parses a configuration object whose `cniVersion` is already known to
    /// be `version`. Unknown keys are allowed (the spec says runtimes pass
    /// them through and plugins may ignore them) and listed in
    /// [`NetConf::unknown_keys`], except `ipam`: tether does its own IPAM
    /// and must not silently ignore a delegated one (2).
    pub fn parse(obj: &Map<String, Value>, version: CniVersion) -> Result<Self> {
        Self::parse_as(obj, version, DEFAULT_PLUGIN_NAME)
    }

    /// [`NetConf::parse`] for a binary that ran as `plugin_name`, which
    /// decides whether tether is the main plugin or another's IPAM.
    pub fn parse_as(
        obj: &Map<String, Value>,
        version: CniVersion,
        plugin_name: &str,
    ) -> Result<Self> {
        let name = required_string(obj, "name")?;
        if !is_cni_name(&name) {
            return Err(Error::InvalidConfig(format!(
                "name {name:?} must match ^[a-zA-Z0-9][a-zA-Z0-9_.\\-]*$"
            )));
        }
        let plugin_type = required_string(obj, "type")?;
        if plugin_type.is_empty() || plugin_type.contains(['/', '\\', '\0']) {
            return Err(Error::InvalidConfig(format!(
                "type {plugin_type:?} must be a non-empty file name"
            )));
        }
        if ipam_only(obj, plugin_name) {
            return Self::parse_ipam_only(obj, version, name, plugin_type);
        }
        if let Some(ipam) = obj.get("ipam") {
            return Err(Error::UnsupportedField {
                key: "ipam".into(),
                value: ipam.to_string(),
            });
        }
        let pools = match present(obj, "pool") {
            Some(v) => parse_pools("pool", v)?,
            None => Vec::new(),
        };
        let mtu = present(obj, "mtu").map(parse_mtu).transpose()?;
        let dns = match present(obj, "dns") {
            Some(dns) => {
                check_dns(dns, "dns")?;
                Some(dns.clone())
            }
            None => None,
        };
        let Shared {
            prev_result,
            runtime_config,
            valid_attachments,
        } = Shared::parse(obj, version)?;
        let vm_address_policy = match present(obj, "vmAddressPolicy") {
            None => VmAddressPolicy::default(),
            Some(Value::String(p)) if p == "persistent" => VmAddressPolicy::Persistent,
            Some(Value::String(p)) if p == "ephemeral" => VmAddressPolicy::Ephemeral,
            Some(other) => {
                return Err(Error::InvalidConfig(format!(
                    "vmAddressPolicy {other} must be \"persistent\" or \"ephemeral\""
                )))
            }
        };
        let kubevirt = match present(obj, "kubevirt") {
            Some(v) => parse_kubevirt(v)?,
            None => KubevirtConf::default(),
        };
        Ok(NetConf {
            cni_version: version,
            name,
            plugin_type,
            mtu,
            dns,
            prev_result,
            runtime_config,
            valid_attachments,
            vm_address_policy,
            kubevirt,
            pools,
            ipam: None,
            unknown_keys: unknown_keys(obj),
        })
    }

    /// The configuration of another plugin that runs tether as its IPAM.
    /// Of the top level only what every plugin shares is read (the rest is
    /// the main plugin's: a macvlan `mtu` is not tether's); tether's
    /// settings are in `ipam`, whose unknown keys are refused so that a
    /// misspelt one is not silently ignored.
    fn parse_ipam_only(
        obj: &Map<String, Value>,
        version: CniVersion,
        name: String,
        plugin_type: String,
    ) -> Result<Self> {
        const WHAT: &str = "ipam";
        let ipam = obj
            .get("ipam")
            .and_then(Value::as_object)
            .ok_or_else(|| decode(WHAT, "expected an object"))?;
        let mut conf = IpamConf::default();
        let mut pools = Vec::new();
        for (key, value) in ipam.iter().filter(|(_, v)| !v.is_null()) {
            match key.as_str() {
                // `socket` is the shim's.
                "type" | "socket" => {}
                "pool" => pools = parse_pools("ipam.pool", value)?,
                "routes" => {
                    conf.routes = value
                        .as_array()
                        .ok_or_else(|| decode(WHAT, "routes: expected an array"))?
                        .iter()
                        .enumerate()
                        .map(|(i, v)| parse_route(i, v))
                        .collect::<Result<_>>()?;
                }
                "dns" => {
                    check_dns(value, "ipam.dns")?;
                    conf.dns = Some(value.clone());
                }
                other => {
                    return Err(Error::InvalidConfig(format!(
                    "ipam.{other} is not a setting tether knows (type, socket, pool, routes, dns)"
                )))
                }
            }
        }
        let Shared {
            prev_result,
            runtime_config,
            valid_attachments,
        } = Shared::parse(obj, version)?;
        Ok(NetConf {
            cni_version: version,
            name,
            plugin_type,
            mtu: None,
            dns: None,
            prev_result,
            runtime_config,
            valid_attachments,
            vm_address_policy: VmAddressPolicy::default(),
            kubevirt: KubevirtConf::default(),
            pools,
            ipam: Some(conf),
            unknown_keys: Vec::new(),
        })
    }
}

/// The keys tether reads in both of its roles (main plugin and IPAM):
/// the runtime's, not a plugin's.
struct Shared {
    prev_result: Option<PrevResult>,
    runtime_config: RuntimeConfig,
    valid_attachments: Option<Vec<AttachmentId>>,
}

impl Shared {
    fn parse(obj: &Map<String, Value>, version: CniVersion) -> Result<Shared> {
        let prev_result = present(obj, "prevResult")
            .map(|v| PrevResult::parse(v, version))
            .transpose()?;
        let runtime_config = match present(obj, "runtimeConfig") {
            Some(v) => parse_runtime_config(v)?,
            None => RuntimeConfig::default(),
        };
        let valid_attachments = match obj.get(VALID_ATTACHMENTS_KEY) {
            Some(v) => Some(parse_attachments(VALID_ATTACHMENTS_KEY, v)?),
            None => match obj.get(LEGACY_ATTACHMENTS_KEY) {
                Some(v) => Some(parse_attachments(LEGACY_ATTACHMENTS_KEY, v)?),
                None => None,
            },
        };
        Ok(Shared {
            prev_result,
            runtime_config,
            valid_attachments,
        })
    }
}

/// A pool selection: one name, or a list of names (one per family).
pub fn parse_pools(what: &str, v: &Value) -> Result<Vec<String>> {
    let names: Vec<String> = match v {
        Value::String(s) => vec![s.clone()],
        Value::Array(items) => items
            .iter()
            .map(|i| {
                i.as_str().map(str::to_owned).ok_or_else(|| {
                    Error::InvalidConfig(format!("{what}: expected pool names, got {i}"))
                })
            })
            .collect::<Result<_>>()?,
        other => {
            return Err(Error::InvalidConfig(format!(
                "{what}: expected a pool name or a list of them, got {}",
                json_type(other)
            )))
        }
    };
    if names.is_empty() || names.len() > 2 {
        return Err(Error::InvalidConfig(format!(
            "{what}: name one pool, or two (one IPv4 and one IPv6)"
        )));
    }
    if let Some(bad) = names.iter().find(|n| !is_cni_name(n)) {
        return Err(Error::InvalidConfig(format!(
            "{what}: {bad:?} is not a pool name"
        )));
    }
    if names.len() == 2 && names[0] == names[1] {
        return Err(Error::InvalidConfig(format!("{what}: {} twice", names[0])));
    }
    Ok(names)
}

/// `^[a-zA-Z0-9][a-zA-Z0-9_.\-]*$`, the spec's rule for network names and
/// container IDs.
pub fn is_cni_name(s: &str) -> bool {
    let mut bytes = s.bytes();
    match bytes.next() {
        Some(first) if first.is_ascii_alphanumeric() => {
            bytes.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
        }
        _ => false,
    }
}

/// A field of the wrong type or shape: code 7, naming the field. The stdin
/// as a whole did decode (that failure is code 6, in `request`); a field
/// that holds the wrong thing is an invalid configuration, and is never
/// replaced by a default.
fn decode(field: &'static str, reason: impl Into<String>) -> Error {
    Error::InvalidConfig(format!("field {field:?}: {}", reason.into()))
}

/// The value of `key` unless it is absent or `null`.
fn present<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

fn required_string(obj: &Map<String, Value>, key: &'static str) -> Result<String> {
    match present(obj, key) {
        None => Err(Error::InvalidConfig(format!(
            "missing required field {key:?}"
        ))),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(decode(
            key,
            format!("expected a string, got {}", json_type(other)),
        )),
    }
}

pub fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn parse_mtu(v: &Value) -> Result<u32> {
    let Value::Number(n) = v else {
        return Err(decode(
            "mtu",
            format!("expected an integer, got {}", json_type(v)),
        ));
    };
    // An integer out of range is a bad value (7); a fraction is not an
    // integer at all (6), as Go's decoder into an int sees it.
    let out_of_range =
        || Error::InvalidConfig(format!("mtu {n} is out of range {MIN_MTU}..={MAX_MTU}"));
    if let Some(u) = n.as_u64() {
        let mtu = u32::try_from(u).map_err(|_| out_of_range())?;
        if (MIN_MTU..=MAX_MTU).contains(&mtu) {
            return Ok(mtu);
        }
        return Err(out_of_range());
    }
    if n.is_i64() {
        return Err(out_of_range());
    }
    Err(decode("mtu", format!("expected an integer, got {n}")))
}

/// Checks the spec's DNS object: `nameservers`, `search`, `options` are
/// lists of strings and `domain` a string; other keys pass through.
fn check_dns(v: &Value, what: &'static str) -> Result<()> {
    let obj = v.as_object().ok_or_else(|| {
        decode(
            what,
            format!("dns: expected an object, got {}", json_type(v)),
        )
    })?;
    for key in ["nameservers", "search", "options"] {
        if let Some(list) = present(obj, key) {
            let ok = list
                .as_array()
                .is_some_and(|a| a.iter().all(Value::is_string));
            if !ok {
                return Err(decode(
                    what,
                    format!("dns.{key}: expected a list of strings"),
                ));
            }
        }
    }
    if let Some(domain) = present(obj, "domain") {
        if !domain.is_string() {
            return Err(decode(what, "dns.domain: expected a string"));
        }
    }
    Ok(())
}

/// The `kubevirt` object: `binding`, `tapQueues`, `tapOwner`, `tapGroup`,
/// `leaseSeconds`, each optional. Unknown keys are refused: a misspelt
/// binding setting would otherwise wire a VM in a way nobody asked for.
fn parse_kubevirt(v: &Value) -> Result<KubevirtConf> {
    const WHAT: &str = "kubevirt";
    let obj = v
        .as_object()
        .ok_or_else(|| decode(WHAT, format!("expected an object, got {}", json_type(v))))?;
    let mut conf = KubevirtConf::default();
    for (key, value) in obj.iter().filter(|(_, v)| !v.is_null()) {
        match key.as_str() {
            "binding" => {
                let s = value
                    .as_str()
                    .ok_or_else(|| decode(WHAT, "binding: expected a string"))?;
                conf.binding = BindingKind::parse(s).ok_or_else(|| {
                    Error::InvalidConfig(format!(
                        "kubevirt.binding {s:?} must be \"veth\", \"tap\" or \"managedTap\""
                    ))
                })?;
            }
            "tapQueues" => {
                let n = bounded(value, "tapQueues", 1, u64::from(MAX_QUEUES))?;
                conf.tap_queues = u16::try_from(n).unwrap_or(MAX_QUEUES);
            }
            "tapOwner" => conf.tap_owner = id(value, "tapOwner")?,
            "tapGroup" => conf.tap_group = id(value, "tapGroup")?,
            "leaseSeconds" => {
                // At least a minute, so that renewals cannot flood the
                // daemon; at most a year, well inside DHCP's 32 bits.
                let n = bounded(value, "leaseSeconds", 60, 365 * 24 * 3600)?;
                conf.lease_seconds = u32::try_from(n).unwrap_or(u32::MAX);
            }
            other => {
                return Err(Error::InvalidConfig(format!(
                    "kubevirt.{other} is not a setting tether knows (binding, tapQueues, \
                     tapOwner, tapGroup, leaseSeconds)"
                )))
            }
        }
    }
    Ok(conf)
}

/// An integer of the `kubevirt` object within `min..=max`.
fn bounded(v: &Value, key: &str, min: u64, max: u64) -> Result<u64> {
    let n = v.as_u64().ok_or_else(|| {
        decode(
            "kubevirt",
            format!("{key}: expected a non-negative integer"),
        )
    })?;
    if !(min..=max).contains(&n) {
        return Err(Error::InvalidConfig(format!(
            "kubevirt.{key} {n} is out of range {min}..={max}"
        )));
    }
    Ok(n)
}

/// A uid or gid: any 32-bit value but -1 (which the kernel reads as "none").
fn id(v: &Value, key: &str) -> Result<u32> {
    let n = bounded(v, key, 0, u64::from(u32::MAX - 1))?;
    u32::try_from(n).map_err(|_| Error::InvalidConfig(format!("kubevirt.{key} {n} is too big")))
}

fn parse_runtime_config(v: &Value) -> Result<RuntimeConfig> {
    const WHAT: &str = "runtimeConfig";
    let obj = v
        .as_object()
        .ok_or_else(|| decode(WHAT, format!("expected an object, got {}", json_type(v))))?;
    let mut rc = RuntimeConfig::default();
    if let Some(ips) = present(obj, "ips") {
        let list = ips
            .as_array()
            .ok_or_else(|| decode(WHAT, "ips: expected a list of strings"))?;
        for ip in list {
            let s = ip
                .as_str()
                .ok_or_else(|| decode(WHAT, "ips: expected a list of strings"))?;
            let ip = s
                .parse::<IpAddr>()
                .or_else(|_| s.parse::<IpNet>().map(|n| n.addr()))
                .map_err(|_| {
                    Error::InvalidConfig(format!(
                        "runtimeConfig.ips: {s:?} is not an IP address or CIDR"
                    ))
                })?;
            rc.ips.push(ip);
        }
    }
    if let Some(mac) = present(obj, "mac") {
        let s = mac
            .as_str()
            .ok_or_else(|| decode(WHAT, "mac: expected a string"))?;
        if !s.is_empty() {
            rc.mac = Some(RequestedMac::parse(s).ok_or_else(|| {
                Error::InvalidConfig(format!("runtimeConfig.mac: {s:?} is not a MAC address"))
            })?);
        }
    }
    if let Some(ann) = present(obj, POD_ANNOTATIONS_KEY) {
        let map = ann
            .as_object()
            .ok_or_else(|| decode(WHAT, format!("{POD_ANNOTATIONS_KEY}: expected an object")))?;
        for (k, v) in map {
            let s = v.as_str().ok_or_else(|| {
                decode(
                    WHAT,
                    format!("{POD_ANNOTATIONS_KEY}: value of {k:?} is not a string"),
                )
            })?;
            rc.pod_annotations.insert(k.clone(), s.to_string());
        }
    }
    Ok(rc)
}

fn parse_attachments(key: &'static str, v: &Value) -> Result<Vec<AttachmentId>> {
    let list = match v {
        // Go marshals a nil slice as null: "no attachment is valid".
        Value::Null => return Ok(Vec::new()),
        Value::Array(list) => list,
        other => {
            return Err(decode(
                key,
                format!("expected an array, got {}", json_type(other)),
            ))
        }
    };
    list.iter()
        .enumerate()
        .map(|(i, entry)| {
            let obj = entry
                .as_object()
                .ok_or_else(|| decode(key, format!("entry {i} is not an object")))?;
            let field = |name: &str| -> Result<String> {
                match present(obj, name) {
                    None => Err(Error::InvalidConfig(format!(
                        "{key}: entry {i} has no {name:?}"
                    ))),
                    Some(Value::String(s)) if s.is_empty() => Err(Error::InvalidConfig(format!(
                        "{key}: entry {i} has an empty {name:?}"
                    ))),
                    Some(Value::String(s)) => Ok(s.clone()),
                    Some(_) => Err(decode(key, format!("entry {i}: {name} is not a string"))),
                }
            };
            Ok(AttachmentId {
                container_id: field("containerID")?,
                ifname: field("ifname")?,
            })
        })
        .collect()
}

fn array_of<'a>(obj: &'a Map<String, Value>, key: &str) -> Result<&'a [Value]> {
    match present(obj, key) {
        None => Ok(&[]),
        Some(Value::Array(a)) => Ok(a),
        Some(other) => Err(decode(
            "prevResult",
            format!("{key}: expected an array, got {}", json_type(other)),
        )),
    }
}

fn opt_str<'a>(obj: &'a Map<String, Value>, key: &str, at: &str) -> Result<Option<&'a str>> {
    match present(obj, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(decode(
            "prevResult",
            format!("{at}.{key}: expected a string"),
        )),
    }
}

fn parse_interface(i: usize, v: &Value, version: CniVersion) -> Result<ResultInterface> {
    let at = format!("interfaces[{i}]");
    let obj = v
        .as_object()
        .ok_or_else(|| decode("prevResult", format!("{at}: not an object")))?;
    let name = opt_str(obj, "name", &at)?
        .ok_or_else(|| decode("prevResult", format!("{at}: missing name")))?;
    if version >= CniVersion::V1_0_0 {
        // Fields of the 1.x interface type (mtu from 1.1.0; socketPath and
        // pciID too). Go's 0.x type does not know them and ignores them.
        if let Some(mtu) = present(obj, "mtu") {
            if !mtu.is_u64() {
                return Err(decode(
                    "prevResult",
                    format!("{at}.mtu: expected an unsigned integer"),
                ));
            }
        }
        opt_str(obj, "socketPath", &at)?;
        opt_str(obj, "pciID", &at)?;
    }
    Ok(ResultInterface {
        name: name.to_string(),
        mac: opt_str(obj, "mac", &at)?.map(str::to_string),
        sandbox: opt_str(obj, "sandbox", &at)?.map(str::to_string),
    })
}

fn parse_ip(i: usize, v: &Value, version: CniVersion, n_interfaces: usize) -> Result<ResultIp> {
    let at = format!("ips[{i}]");
    let obj = v
        .as_object()
        .ok_or_else(|| decode("prevResult", format!("{at}: not an object")))?;
    let address = opt_str(obj, "address", &at)?
        .ok_or_else(|| decode("prevResult", format!("{at}: missing address")))?;
    let address: IpNet = address.parse().map_err(|_| {
        decode(
            "prevResult",
            format!("{at}.address {address:?} is not a CIDR"),
        )
    })?;
    let gateway = opt_str(obj, "gateway", &at)?
        .map(|g| {
            g.parse::<IpAddr>()
                .map_err(|_| decode("prevResult", format!("{at}.gateway {g:?} is not an IP")))
        })
        .transpose()?;
    let interface = match present(obj, "interface") {
        None => None,
        Some(idx) => {
            let idx = idx
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| {
                    decode("prevResult", format!("{at}.interface: expected an index"))
                })?;
            if idx >= n_interfaces {
                return Err(decode(
                    "prevResult",
                    format!("{at}.interface {idx} is beyond the {n_interfaces} interfaces"),
                ));
            }
            Some(idx)
        }
    };
    // 0.x results name the family in "version"; when given it must agree
    // with the address. 1.x dropped the field and Go ignores it there.
    if version.ips_carry_version() {
        if let Some(fam) = opt_str(obj, "version", &at)? {
            let want = if address.addr().is_ipv4() { "4" } else { "6" };
            if fam != want {
                return Err(decode(
                    "prevResult",
                    format!("{at}.version {fam:?} does not match address {address}"),
                ));
            }
        }
    }
    Ok(ResultIp {
        address,
        gateway,
        interface,
    })
}

fn parse_route(i: usize, v: &Value) -> Result<ResultRoute> {
    let at = format!("routes[{i}]");
    let obj = v
        .as_object()
        .ok_or_else(|| decode("prevResult", format!("{at}: not an object")))?;
    let dst = opt_str(obj, "dst", &at)?
        .ok_or_else(|| decode("prevResult", format!("{at}: missing dst")))?;
    let dst: IpNet = dst
        .parse()
        .map_err(|_| decode("prevResult", format!("{at}.dst {dst:?} is not a CIDR")))?;
    let gw = opt_str(obj, "gw", &at)?
        .map(|g| {
            g.parse::<IpAddr>()
                .map_err(|_| decode("prevResult", format!("{at}.gw {g:?} is not an IP")))
        })
        .transpose()?;
    Ok(ResultRoute { dst, gw })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn conf(v: Value) -> Result<NetConf> {
        let Value::Object(obj) = v else {
            panic!("test config must be an object")
        };
        NetConf::parse(&obj, CniVersion::V1_1_0)
    }

    fn base() -> Value {
        json!({"cniVersion": "1.1.0", "name": "tether", "type": "tether"})
    }

    fn with(key: &str, value: Value) -> Value {
        let mut v = base();
        v[key] = value;
        v
    }

    #[test]
    fn minimal_config() {
        let c = conf(base()).unwrap();
        assert_eq!(c.name, "tether");
        assert_eq!(c.plugin_type, "tether");
        assert_eq!(c.mtu, None);
        assert_eq!(c.dns, None);
        assert_eq!(c.prev_result, None);
        assert_eq!(c.runtime_config, RuntimeConfig::default());
        assert_eq!(c.valid_attachments, None);
    }

    #[test]
    fn unknown_fields_are_allowed() {
        let mut v = base();
        v["bridge"] = json!("cni0");
        v["args"] = json!({"cni": {"labels": []}});
        v["capabilities"] = json!({"portMappings": true});
        let c = conf(v).unwrap();
        assert_eq!(
            c.unknown_keys,
            [UnknownKey {
                key: "bridge".into(),
                hint: None
            }]
        );
    }

    #[test]
    fn unknown_keys_are_listed_with_the_key_they_probably_meant() {
        let mut v = base();
        v["mut"] = json!(1400);
        v["sokcet"] = json!("/run/tether/tether.sock");
        v["MTU"] = json!(1400);
        v["vmAdressPolicy"] = json!("ephemeral");
        v["runtimeconfig"] = json!({});
        v["stateDir"] = json!("/var/lib/tether");
        v["labels"] = json!({});
        v["mtu"] = json!(1450);
        v["socket"] = json!("/run/tether/tether.sock");
        v["prevResult"] = json!({"cniVersion": "1.1.0"});
        v[VALID_ATTACHMENTS_KEY] = json!([]);
        let c = conf(v).unwrap();
        // Accepted: the known keys still apply, the unknown are ignored.
        assert_eq!(c.mtu, Some(1450));
        let found: Vec<String> = c.unknown_keys.iter().map(|k| k.to_string()).collect();
        assert_eq!(
            found,
            [
                r#""MTU" (did you mean mtu?)"#,
                r#""labels""#,
                r#""mut" (did you mean mtu?)"#,
                r#""runtimeconfig" (did you mean runtimeConfig?)"#,
                r#""sokcet" (did you mean socket?)"#,
                r#""stateDir" (did you mean tetherd's --state-dir?)"#,
                r#""vmAdressPolicy" (did you mean vmAddressPolicy?)"#,
            ]
        );
    }

    #[test]
    fn an_unrelated_key_gets_no_hint() {
        for key in [
            "bridge",
            "isGateway",
            "ipMasq",
            "hairpinMode",
            "foo",
            "ips",
            "xyz",
        ] {
            assert_eq!(closest_key(key), None, "{key}");
        }
        assert_eq!(edit_distance("mut", "mtu"), 1);
        assert_eq!(edit_distance("sokcet", "socket"), 1);
        assert_eq!(edit_distance("", "mtu"), 3);
        assert_eq!(edit_distance("kubevrit", "kubevirt"), 1);
    }

    #[test]
    fn another_plugins_top_level_keys_are_not_tethers_to_warn_about() {
        let Value::Object(obj) = json!({
            "cniVersion": "1.1.0", "name": "n", "type": "macvlan", "master": "eth0",
            "ipam": {"type": "tether"}
        }) else {
            unreachable!()
        };
        let c = NetConf::parse(&obj, CniVersion::V1_1_0).unwrap();
        assert!(c.ipam.is_some());
        assert_eq!(c.unknown_keys, []);
    }

    #[test]
    fn name_rules() {
        let mut v = base();
        v.as_object_mut().unwrap().remove("name");
        assert_eq!(conf(v).unwrap_err().code(), 7);
        assert_eq!(conf(with("name", json!(""))).unwrap_err().code(), 7);
        assert_eq!(conf(with("name", json!("-net"))).unwrap_err().code(), 7);
        assert_eq!(conf(with("name", json!("my net"))).unwrap_err().code(), 7);
        assert_eq!(conf(with("name", json!("net/1"))).unwrap_err().code(), 7);
        assert_eq!(conf(with("name", json!(12))).unwrap_err().code(), 7);
        assert_eq!(conf(with("name", json!(null))).unwrap_err().code(), 7);
        assert!(conf(with("name", json!("k8s-pod_network.v1"))).is_ok());
    }

    #[test]
    fn type_rules() {
        let mut v = base();
        v.as_object_mut().unwrap().remove("type");
        assert_eq!(conf(v).unwrap_err().code(), 7);
        assert_eq!(conf(with("type", json!(""))).unwrap_err().code(), 7);
        assert_eq!(
            conf(with("type", json!("../tether"))).unwrap_err().code(),
            7
        );
        assert_eq!(conf(with("type", json!(["tether"]))).unwrap_err().code(), 7);
    }

    #[test]
    fn ipam_is_unsupported_with_its_value() {
        let err = conf(with("ipam", json!({"type": "host-local"}))).unwrap_err();
        assert_eq!(err.code(), 2);
        match &err {
            Error::UnsupportedField { key, value } => {
                assert_eq!(key, "ipam");
                assert_eq!(value, r#"{"type":"host-local"}"#);
            }
            other => panic!("unexpected {other:?}"),
        }
        // Even an empty or null ipam is refused: the admin wrote the key.
        assert_eq!(conf(with("ipam", json!({}))).unwrap_err().code(), 2);
        assert_eq!(conf(with("ipam", json!(null))).unwrap_err().code(), 2);
    }

    #[test]
    fn tether_as_another_plugins_ipam() {
        let macvlan = json!({"cniVersion": "1.1.0", "name": "migration", "type": "macvlan",
            "master": "eth1", "mode": "bridge", "mtu": 9000,
            "ipam": {"type": "tether", "pool": "migration", "socket": "/run/t.sock",
                     "routes": [{"dst": "10.9.0.0/16"}],
                     "dns": {"nameservers": ["10.0.0.53"]}}});
        let c = conf(macvlan.clone()).unwrap();
        assert_eq!(c.plugin_type, "macvlan");
        assert_eq!(c.pools, vec!["migration".to_owned()]);
        // macvlan's mtu is macvlan's.
        assert_eq!(c.mtu, None);
        let ipam = c.ipam.unwrap();
        assert_eq!(ipam.routes.len(), 1);
        assert_eq!(ipam.routes[0].dst, "10.9.0.0/16".parse::<IpNet>().unwrap());
        assert!(ipam.dns.is_some());
        // Two pools, one per family.
        let mut two = macvlan.clone();
        two["ipam"]["pool"] = json!(["m4", "m6"]);
        assert_eq!(conf(two).unwrap().pools.len(), 2);
        // A misspelt key of tether's section is refused, not ignored.
        let mut typo = macvlan.clone();
        typo["ipam"]["pools"] = json!("migration");
        let err = conf(typo).unwrap_err();
        assert_eq!(err.code(), 7);
        assert!(err.to_string().contains("ipam.pools"), "{err}");
        for bad in [
            json!(""),
            json!([]),
            json!(["a", "b", "c"]),
            json!(["a", "a"]),
            json!(3),
        ] {
            let mut b = macvlan.clone();
            b["ipam"]["pool"] = bad.clone();
            assert_eq!(conf(b).unwrap_err().code(), 7, "{bad}");
        }
        // Installed under another name, the rule follows the name the
        // shim ran as.
        let Value::Object(obj) = macvlan else {
            unreachable!()
        };
        assert!(ipam_only(&obj, "tether"));
        assert!(!ipam_only(&obj, "tether-ipam"));
        let err = NetConf::parse_as(&obj, CniVersion::V1_1_0, "macvlan").unwrap_err();
        assert_eq!(err.code(), 2);
    }

    #[test]
    fn pool_of_tether_as_main_plugin() {
        assert_eq!(
            conf(with("pool", json!("blue"))).unwrap().pools,
            vec!["blue".to_owned()]
        );
        assert_eq!(conf(with("pool", json!("bad name"))).unwrap_err().code(), 7);
        assert!(conf(base()).unwrap().pools.is_empty());
    }

    #[test]
    fn mtu_rules() {
        assert_eq!(conf(with("mtu", json!(1500))).unwrap().mtu, Some(1500));
        assert_eq!(conf(with("mtu", json!(576))).unwrap().mtu, Some(576));
        assert_eq!(conf(with("mtu", json!(65535))).unwrap().mtu, Some(65535));
        assert_eq!(conf(with("mtu", json!(null))).unwrap().mtu, None);
        for bad in [
            json!(575),
            json!(65536),
            json!(0),
            json!(-1),
            json!(u64::MAX),
        ] {
            assert_eq!(
                conf(with("mtu", bad.clone())).unwrap_err().code(),
                7,
                "{bad}"
            );
        }
        for bad in [json!("1500"), json!(1500.5), json!(true), json!([1500])] {
            assert_eq!(
                conf(with("mtu", bad.clone())).unwrap_err().code(),
                7,
                "{bad}"
            );
        }
    }

    #[test]
    fn dns_rules() {
        let dns = json!({"nameservers": ["10.96.0.10"], "search": ["svc.cluster.local"], "options": ["ndots:5"], "domain": "cluster.local"});
        assert_eq!(conf(with("dns", dns.clone())).unwrap().dns, Some(dns));
        assert_eq!(conf(with("dns", json!(null))).unwrap().dns, None);
        assert_eq!(conf(with("dns", json!("10.0.0.1"))).unwrap_err().code(), 7);
        assert_eq!(
            conf(with("dns", json!({"nameservers": "10.0.0.1"})))
                .unwrap_err()
                .code(),
            7
        );
        assert_eq!(
            conf(with("dns", json!({"domain": 1}))).unwrap_err().code(),
            7
        );
    }

    #[test]
    fn runtime_config_known_keys() {
        let rc = json!({
            "portMappings": [{"hostPort": 8080, "containerPort": 80, "protocol": "tcp"}],
            "bandwidth": {"ingressRate": 1},
            "aliases": {"net": ["web"]},
            "ips": ["10.244.1.7", "fd00::7/64"],
            "mac": "0a:58:0a:f4:01:07",
            POD_ANNOTATIONS_KEY: {"kubevirt.io/domain": "vm1"}
        });
        let c = conf(with("runtimeConfig", rc)).unwrap();
        let want: Vec<IpAddr> = vec!["10.244.1.7".parse().unwrap(), "fd00::7".parse().unwrap()];
        assert_eq!(c.runtime_config.ips, want);
        assert_eq!(
            c.runtime_config.mac.as_ref().map(RequestedMac::text),
            Some("0a:58:0a:f4:01:07")
        );
        assert_eq!(
            c.runtime_config
                .pod_annotations
                .get("kubevirt.io/domain")
                .map(String::as_str),
            Some("vm1")
        );
    }

    #[test]
    fn runtime_config_wrong_types_are_code_7() {
        for rc in [
            json!([]),
            json!({"ips": "10.0.0.1"}),
            json!({"ips": [1]}),
            json!({"mac": 5}),
            json!({POD_ANNOTATIONS_KEY: []}),
            json!({POD_ANNOTATIONS_KEY: {"a": 1}}),
        ] {
            assert_eq!(
                conf(with("runtimeConfig", rc.clone())).unwrap_err().code(),
                7,
                "{rc}"
            );
        }
        for rc in [json!({"ips": ["nope"]}), json!({"mac": "0a:58"})] {
            assert_eq!(
                conf(with("runtimeConfig", rc.clone())).unwrap_err().code(),
                7,
                "{rc}"
            );
        }
    }

    #[test]
    fn valid_attachments() {
        let list = json!([{"containerID": "c1", "ifname": "eth0"}, {"containerID": "c2", "ifname": "net1"}]);
        let c = conf(with(VALID_ATTACHMENTS_KEY, list.clone())).unwrap();
        assert_eq!(
            c.valid_attachments,
            Some(vec![
                AttachmentId {
                    container_id: "c1".into(),
                    ifname: "eth0".into()
                },
                AttachmentId {
                    container_id: "c2".into(),
                    ifname: "net1".into()
                },
            ])
        );
        // The legacy key is read when the new one is absent.
        let c = conf(with(LEGACY_ATTACHMENTS_KEY, list)).unwrap();
        assert_eq!(c.valid_attachments.map(|v| v.len()), Some(2));
        // null: the runtime has no valid attachment.
        let c = conf(with(VALID_ATTACHMENTS_KEY, json!(null))).unwrap();
        assert_eq!(c.valid_attachments, Some(vec![]));
    }

    #[test]
    fn bad_valid_attachments() {
        for bad in [
            json!({}),
            json!("c1"),
            json!([1]),
            json!([{"containerID": 1, "ifname": "eth0"}]),
        ] {
            assert_eq!(
                conf(with(VALID_ATTACHMENTS_KEY, bad.clone()))
                    .unwrap_err()
                    .code(),
                7,
                "{bad}"
            );
        }
        for bad in [
            json!([{"ifname": "eth0"}]),
            json!([{"containerID": "c1"}]),
            json!([{"containerID": "", "ifname": "eth0"}]),
        ] {
            assert_eq!(
                conf(with(VALID_ATTACHMENTS_KEY, bad.clone()))
                    .unwrap_err()
                    .code(),
                7,
                "{bad}"
            );
        }
    }

    fn prev_100() -> Value {
        json!({
            "cniVersion": "1.0.0",
            "interfaces": [
                {"name": "cni0", "mac": "00:11:22:33:44:55"},
                {"name": "eth0", "mac": "99:88:77:66:55:44", "sandbox": "/var/run/netns/blue"}
            ],
            "ips": [{"address": "10.1.0.5/16", "gateway": "10.1.0.1", "interface": 1}],
            "routes": [{"dst": "0.0.0.0/0"}],
            "dns": {"nameservers": ["10.1.0.1"]}
        })
    }

    #[test]
    fn prev_result_is_typed_and_kept_raw() {
        let p = PrevResult::parse(&prev_100(), CniVersion::V1_0_0).unwrap();
        assert_eq!(p.interfaces.len(), 2);
        assert_eq!(
            p.interfaces[1].sandbox.as_deref(),
            Some("/var/run/netns/blue")
        );
        assert_eq!(p.ips[0].address.to_string(), "10.1.0.5/16");
        assert_eq!(p.ips[0].interface, Some(1));
        assert_eq!(p.routes[0].dst.to_string(), "0.0.0.0/0");
        assert_eq!(Value::Object(p.raw().clone()), prev_100());
    }

    #[test]
    fn prev_result_0x_version_field() {
        let mut v = prev_100();
        v["cniVersion"] = json!("0.4.0");
        v["ips"][0]["version"] = json!("4");
        assert!(PrevResult::parse(&v, CniVersion::V0_4_0).is_ok());
        v["ips"][0]["version"] = json!("6");
        assert_eq!(
            PrevResult::parse(&v, CniVersion::V0_4_0)
                .unwrap_err()
                .code(),
            7
        );
        // 1.x ignores a stray "version", as Go's decoder does.
        assert!(PrevResult::parse(&v, CniVersion::V1_0_0).is_ok());
    }

    type Mutation = Box<dyn Fn(&mut Value)>;

    #[test]
    fn malformed_prev_results_are_code_7() {
        let cases: Vec<Mutation> = vec![
            Box::new(|v| *v = json!([])),
            Box::new(|v| v["cniVersion"] = json!(1)),
            Box::new(|v| v["interfaces"] = json!({})),
            Box::new(|v| v["interfaces"][0] = json!("cni0")),
            Box::new(|v| v["interfaces"][0] = json!({"mac": "00:11:22:33:44:55"})),
            Box::new(|v| v["interfaces"][0]["sandbox"] = json!(3)),
            Box::new(|v| v["interfaces"][0]["mtu"] = json!("1500")),
            Box::new(|v| v["ips"][0]["address"] = json!("10.1.0.5")),
            Box::new(|v| v["ips"][0]["gateway"] = json!("gw")),
            Box::new(|v| v["ips"][0]["interface"] = json!(-1)),
            Box::new(|v| v["ips"][0]["interface"] = json!(2)),
            Box::new(|v| v["routes"][0] = json!({"gw": "10.1.0.1"})),
            Box::new(|v| v["routes"][0]["dst"] = json!("default")),
            Box::new(|v| v["dns"] = json!([])),
        ];
        for (i, mutate) in cases.iter().enumerate() {
            let mut v = prev_100();
            mutate(&mut v);
            let err = PrevResult::parse(&v, CniVersion::V1_1_0).unwrap_err();
            assert_eq!(err.code(), 7, "case {i}: {v}");
            assert!(
                err.to_string().contains("field \"prevResult\""),
                "case {i}: {err}"
            );
        }
    }

    #[test]
    fn prev_result_in_conf_and_null() {
        let c = conf(with("prevResult", prev_100())).unwrap();
        assert_eq!(c.prev_result.map(|p| p.interfaces.len()), Some(2));
        let c = conf(with("prevResult", json!(null))).unwrap();
        assert_eq!(c.prev_result, None);
        assert_eq!(conf(with("prevResult", json!("x"))).unwrap_err().code(), 7);
    }

    #[test]
    fn cni_name_rule() {
        for ok in ["a", "0", "abc-DEF_1.2", "k8s-pod-network"] {
            assert!(is_cni_name(ok), "{ok}");
        }
        for bad in ["", "-a", "_a", ".a", "a b", "a/b", "a:b", "é"] {
            assert!(!is_cni_name(bad), "{bad}");
        }
    }

    /// Every field the daemon reads, given a value of the wrong type: code
    /// 7, and the message names the field (never a silent default).
    #[test]
    fn a_field_of_the_wrong_type_is_code_7_naming_it() {
        for (field, value) in [
            ("name", json!(12)),
            ("type", json!(["tether"])),
            ("mtu", json!("1500")),
            ("mtu", json!(true)),
            ("dns", json!("10.0.0.1")),
            ("dns", json!({"nameservers": "10.0.0.1"})),
            ("dns", json!({"domain": 3})),
            ("prevResult", json!("x")),
            ("runtimeConfig", json!([])),
            ("runtimeConfig", json!({"ips": "10.0.0.1"})),
            ("runtimeConfig", json!({"mac": 5})),
            ("runtimeConfig", json!({POD_ANNOTATIONS_KEY: []})),
            ("vmAddressPolicy", json!(1)),
            (VALID_ATTACHMENTS_KEY, json!("c1")),
            (LEGACY_ATTACHMENTS_KEY, json!({})),
        ] {
            let err = conf(with(field, value.clone())).unwrap_err();
            assert_eq!(err.code(), 7, "{field}={value}: {err}");
            assert!(err.to_string().contains(field), "{field}={value}: {err}");
        }
    }
}
