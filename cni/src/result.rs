//! What the daemon prints back: the ADD result in the requested cniVersion,
//! the CHECK test against prevResult, and the spec's error object.
//!
//! Result shapes, per version (SPEC 0.4.0 and 1.0.0 "Result"; libcni's
//! `types/040` and `types/100`; containernetworking/cni#1060 for 1.1.0):
//!
//! | key                    | 0.3.0 / 0.3.1 / 0.4.0 | 1.0.0 | 1.1.0 |
//! |------------------------|-----------------------|-------|-------|
//! | `ips[].version` "4"/"6" | yes                  | no    | no    |
//! | `interfaces[].mtu`     | no                    | no    | yes   |
//!
//! Everything else is common: `cniVersion`; `interfaces[]` with `name`,
//! `mac` and, for the pod side only, `sandbox`; `ips[]` with `address`
//! (CIDR), `gateway` and `interface` (an index into `interfaces`);
//! `routes[]` with `dst` and `gw`; `dns`. Like libcni, whose DNS struct is
//! never omitted, tether always prints `dns`, `{}` when it has none.
//!
//! DEL, CHECK, STATUS and GC print nothing on success (SPEC 1.0.0: "the
//! plugin must return either nothing or an error" for CHECK; the spec's
//! examples show no output for DEL; 1.1.0's STATUS and GC succeed with a
//! zero exit and no output). See [`empty_result`].

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use serde_json::{json, Map, Value};
use tether_proto::cni::v1::CniError;

use super::config::NetConf;
use super::version::CniVersion;
use tether_base::error::{Error, Mismatch, Result};

/// The pod's IPv4 gateway: a link-local anycast address every node answers.
pub const GATEWAY_V4: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);
/// The pod's IPv6 gateway.
pub const GATEWAY_V6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);

/// What tether wired for one attachment, independent of CNI versions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wired {
    /// The node-side veth's name.
    pub host_ifname: String,
    /// The node-side veth's MAC.
    pub host_mac: String,
    /// The pod-side interface's name (CNI_IFNAME).
    pub pod_ifname: String,
    /// The pod-side interface's MAC.
    pub pod_mac: String,
    /// The pod's netns path, as CNI_NETNS gave it at ADD.
    pub sandbox: String,
    /// The MTU of both ends; 0 leaves it out of 1.1.0 results.
    pub mtu: u32,
    /// The pod's addresses; each is held as /32 or /128.
    pub ips: Vec<IpAddr>,
    /// The `tap` binding's tap, in the pod beside the pod interface. The
    /// addresses stay on the pod interface's entry: runtimes (containerd's
    /// go-cni) take the pod IP from the CNI_IFNAME interface.
    pub tap: Option<String>,
}

/// The gateway of an address's family.
pub fn gateway_for(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => IpAddr::V4(GATEWAY_V4),
        IpAddr::V6(_) => IpAddr::V6(GATEWAY_V6),
    }
}

/// The host prefix (/32 or /128) of an address.
fn host_net(ip: IpAddr) -> IpNet {
    IpNet::from(ip)
}

/// The result JSON for ADD (and the cached result for a repeated ADD), in
/// `conf.cni_version`: the node-side veth then the pod interface, one
/// host-prefix IP per address pointing at the pod interface with the
/// anycast gateway, a default route per family present, and the
/// configuration's `dns`.
///
/// When `conf.prev_result` is set (tether chained after another plugin),
/// tether's interfaces, ips and routes are appended to it, the `interface`
/// indices of tether's ips are shifted past the previous interfaces, and
/// every other key of it is kept. `dns` from tether's configuration, when
/// given, replaces the previous one, as the reference ptp plugin does.
pub fn render_add_result(conf: &NetConf, wired: &Wired) -> Result<Vec<u8>> {
    let version = conf.cni_version;
    let mut out = match &conf.prev_result {
        Some(prev) => prev.raw().clone(),
        None => Map::new(),
    };
    // Typed parsing guarantees the raw arrays match the typed ones.
    let base = conf
        .prev_result
        .as_ref()
        .map_or(0, |prev| prev.interfaces.len());

    let mut host = Map::new();
    host.insert("name".into(), json!(wired.host_ifname));
    host.insert("mac".into(), json!(wired.host_mac));
    let mut pod = Map::new();
    pod.insert("name".into(), json!(wired.pod_ifname));
    pod.insert("mac".into(), json!(wired.pod_mac));
    if version.interfaces_carry_mtu() && wired.mtu > 0 {
        host.insert("mtu".into(), json!(wired.mtu));
        pod.insert("mtu".into(), json!(wired.mtu));
    }
    pod.insert("sandbox".into(), json!(wired.sandbox));
    let pod_index = base + 1;

    let ips = wired.ips.iter().map(|&ip| {
        let mut entry = Map::new();
        if version.ips_carry_version() {
            entry.insert(
                "version".into(),
                json!(if ip.is_ipv4() { "4" } else { "6" }),
            );
        }
        entry.insert("address".into(), json!(host_net(ip).to_string()));
        entry.insert("gateway".into(), json!(gateway_for(ip).to_string()));
        entry.insert("interface".into(), json!(pod_index));
        Value::Object(entry)
    });

    let mut routes = Vec::new();
    if wired.ips.iter().any(IpAddr::is_ipv4) {
        routes.push(json!({"dst": "0.0.0.0/0", "gw": GATEWAY_V4.to_string()}));
    }
    if wired.ips.iter().any(IpAddr::is_ipv6) {
        routes.push(json!({"dst": "::/0", "gw": GATEWAY_V6.to_string()}));
    }

    let tap = wired.tap.as_ref().map(|name| {
        let mut tap = Map::new();
        tap.insert("name".into(), json!(name));
        if version.interfaces_carry_mtu() && wired.mtu > 0 {
            tap.insert("mtu".into(), json!(wired.mtu));
        }
        tap.insert("sandbox".into(), json!(wired.sandbox));
        Value::Object(tap)
    });
    append(
        &mut out,
        "interfaces",
        [Value::Object(host), Value::Object(pod)]
            .into_iter()
            .chain(tap),
    );
    append(&mut out, "ips", ips);
    append(&mut out, "routes", routes);
    match &conf.dns {
        Some(dns) => {
            out.insert("dns".into(), dns.clone());
        }
        None => {
            let keep = out.get("dns").is_some_and(Value::is_object);
            if !keep {
                out.insert("dns".into(), json!({}));
            }
        }
    }
    out.insert("cniVersion".into(), json!(version.as_str()));

    serde_json::to_vec(&Value::Object(out))
        .map_err(|e| Error::Internal(format!("encoding the ADD result: {e}")))
}

/// What an IPAM-only ADD gives the plugin that ran tether as its IPAM.
#[derive(Debug, Clone, PartialEq)]
pub struct Leased {
    /// Each address with its pool's prefix length (the main plugin puts it
    /// on its interface as given), and the pool's gateway.
    pub ips: Vec<(IpNet, Option<IpAddr>)>,
    /// The pools' routes, then the `ipam` section's.
    pub routes: Vec<super::config::ResultRoute>,
    /// The `ipam` section's `dns`, else the pool's.
    pub dns: Option<Value>,
}

/// The result of an IPAM plugin (SPEC "IP Allocation"): `ips` without
/// `interface`, `routes` and `dns`, and no `interfaces`: the main plugin
/// adds its own interface and points the addresses at it.
pub fn render_ipam_result(conf: &NetConf, leased: &Leased) -> Result<Vec<u8>> {
    let version = conf.cni_version;
    let mut out = Map::new();
    out.insert("cniVersion".into(), json!(version.as_str()));
    let ips: Vec<Value> = leased
        .ips
        .iter()
        .map(|(net, gw)| {
            let mut entry = Map::new();
            if version.ips_carry_version() {
                let v = if matches!(net, IpNet::V4(_)) {
                    "4"
                } else {
                    "6"
                };
                entry.insert("version".into(), json!(v));
            }
            entry.insert("address".into(), json!(net.to_string()));
            if let Some(gw) = gw {
                entry.insert("gateway".into(), json!(gw.to_string()));
            }
            Value::Object(entry)
        })
        .collect();
    append(&mut out, "ips", ips);
    let routes = leased.routes.iter().map(|r| {
        let mut entry = Map::new();
        entry.insert("dst".into(), json!(r.dst.to_string()));
        if let Some(gw) = r.gw {
            entry.insert("gw".into(), json!(gw.to_string()));
        }
        Value::Object(entry)
    });
    append(&mut out, "routes", routes);
    out.insert(
        "dns".into(),
        leased.dns.clone().unwrap_or_else(|| json!({})),
    );
    serde_json::to_vec(&Value::Object(out))
        .map_err(|e| Error::Internal(format!("encoding the IPAM result: {e}")))
}

/// CHECK of an IPAM-only attachment: each of its addresses must be among
/// the prevResult's `ips` (any prefix; the main plugin's interface is the
/// main plugin's to check).
pub fn check_ipam_prev_result(conf: &NetConf, ips: &[IpAddr]) -> Result<()> {
    let prev = conf.prev_result.as_ref().ok_or_else(|| {
        Error::InvalidConfig("CHECK needs prevResult, the result of the attachment's ADD".into())
    })?;
    for ip in ips {
        if !prev.ips.iter().any(|p| p.address.addr() == *ip) {
            return Err(Error::check(
                Mismatch::PrevResult,
                format!("prevResult does not list {ip}, which tether gave this attachment"),
            ));
        }
    }
    Ok(())
}

/// Appends to the array at `key`, creating it; omits it when both are empty,
/// as libcni's `omitempty` does.
fn append(out: &mut Map<String, Value>, key: &str, items: impl IntoIterator<Item = Value>) {
    let mut list = match out.remove(key) {
        Some(Value::Array(list)) => list,
        _ => Vec::new(),
    };
    list.extend(items);
    if !list.is_empty() {
        out.insert(key.into(), Value::Array(list));
    }
}

/// CHECK's prevResult test: the pod interface (name and sandbox) and each
/// of the attachment's IPs, as a host prefix, must be in
/// `conf.prev_result`; an IP that names its interface must name the pod
/// interface. MACs are not compared: the spec lets a later plugin (tuning)
/// change them. Failure is code 116; a missing prevResult is 7, though
/// [`parse_request`](super::parse_request) already refuses that for CHECK.
pub fn check_prev_result(conf: &NetConf, wired: &Wired) -> Result<()> {
    let prev = conf.prev_result.as_ref().ok_or_else(|| {
        Error::InvalidConfig("CHECK needs prevResult, the result of the attachment's ADD".into())
    })?;
    let pod_indices: BTreeSet<usize> = prev
        .interfaces
        .iter()
        .enumerate()
        .filter(|(_, i)| i.name == wired.pod_ifname && i.sandbox.as_deref() == Some(&wired.sandbox))
        .map(|(idx, _)| idx)
        .collect();
    if pod_indices.is_empty() {
        let detail = match prev.interfaces.iter().find(|i| i.name == wired.pod_ifname) {
            Some(other) => format!(
                "interface {} has sandbox {:?} in prevResult, the attachment has {:?}",
                wired.pod_ifname,
                other.sandbox.as_deref().unwrap_or(""),
                wired.sandbox
            ),
            None => format!(
                "interface {} in {} is not in prevResult",
                wired.pod_ifname, wired.sandbox
            ),
        };
        return Err(Error::check(Mismatch::PrevResult, detail));
    }
    for &ip in &wired.ips {
        let want = host_net(ip);
        let found = prev.ips.iter().find(|e| {
            e.address == want && e.interface.is_none_or(|idx| pod_indices.contains(&idx))
        });
        if found.is_none() {
            let detail = match prev.ips.iter().find(|e| e.address.addr() == ip) {
                Some(e) => format!(
                    "address {ip} is {} on interface {:?} in prevResult, expected {want} on {}",
                    e.address, e.interface, wired.pod_ifname
                ),
                None => format!("address {want} is not in prevResult"),
            };
            return Err(Error::check(Mismatch::PrevResult, detail));
        }
    }
    Ok(())
}

/// The spec's error object for the shim to print: `msg` is the short
/// message, `details` the full one, `code` decided by [`Error::code`].
pub fn error_to_proto(cni_version: &str, err: &Error) -> CniError {
    CniError {
        code: err.code(),
        msg: err.msg().to_string(),
        details: err.to_string(),
        cni_version: cni_version.to_string(),
    }
}

/// The cniVersion to echo in an error when parsing failed midway: stdin's
/// `cniVersion` if it is a string (even an unsupported one: the spec says
/// "the same value as provided by the configuration"), else 1.1.0. Input
/// beyond [`MAX_STDIN`](super::MAX_STDIN) is not parsed again.
pub fn error_version(stdin: &[u8]) -> String {
    if stdin.len() <= super::MAX_STDIN {
        if let Ok(Value::Object(obj)) = serde_json::from_slice::<Value>(stdin) {
            if let Some(Value::String(v)) = obj.get("cniVersion") {
                return v.clone();
            }
        }
    }
    CniVersion::LATEST.as_str().to_string()
}

/// What DEL, CHECK, STATUS and GC print on success: nothing.
pub fn empty_result() -> Vec<u8> {
    Vec::new()
}

/// Parses result bytes for tests and callers that inspect them: a JSON
/// object with a string `cniVersion`, else code 6.
pub fn parse_result(bytes: &[u8]) -> Result<Value> {
    let decode = |reason: String| Error::Decode {
        what: "CNI result",
        reason,
    };
    let value: Value = serde_json::from_slice(bytes).map_err(|e| decode(e.to_string()))?;
    match value.get("cniVersion") {
        Some(Value::String(_)) if value.is_object() => Ok(value),
        _ => Err(decode("not an object with a string cniVersion".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PrevResult;

    fn conf(version: CniVersion) -> NetConf {
        NetConf {
            cni_version: version,
            name: "tether".into(),
            plugin_type: "tether".into(),
            mtu: None,
            dns: None,
            prev_result: None,
            runtime_config: Default::default(),
            valid_attachments: None,
            vm_address_policy: Default::default(),
            kubevirt: Default::default(),
            pools: Vec::new(),
            ipam: None,
            unknown_keys: Vec::new(),
        }
    }

    fn wired(ips: &[&str]) -> Wired {
        Wired {
            host_ifname: "tth4f2a9c01e3b".into(),
            host_mac: "0a:58:a9:fe:01:01".into(),
            pod_ifname: "eth0".into(),
            pod_mac: "0a:58:0a:f4:01:07".into(),
            sandbox: "/run/netns/p1".into(),
            mtu: 1450,
            ips: ips.iter().map(|s| s.parse().unwrap()).collect(),
            tap: None,
        }
    }

    fn render(conf: &NetConf, w: &Wired) -> Value {
        parse_result(&render_add_result(conf, w).unwrap()).unwrap()
    }

    const DUAL: [&str; 2] = ["10.244.1.7", "fd00:10:244:1::7"];

    #[test]
    fn shape_per_version() {
        for v in CniVersion::ALL {
            let r = render(&conf(v), &wired(&DUAL));
            assert_eq!(r["cniVersion"], v.as_str());
            let ifs = r["interfaces"].as_array().unwrap();
            assert_eq!(ifs.len(), 2);
            assert_eq!(ifs[0]["name"], "tth4f2a9c01e3b");
            assert_eq!(ifs[0]["mac"], "0a:58:a9:fe:01:01");
            assert!(ifs[0].get("sandbox").is_none(), "host side has no sandbox");
            assert_eq!(ifs[1]["name"], "eth0");
            assert_eq!(ifs[1]["mac"], "0a:58:0a:f4:01:07");
            assert_eq!(ifs[1]["sandbox"], "/run/netns/p1");
            let want_mtu = v == CniVersion::V1_1_0;
            for i in ifs {
                assert_eq!(i.get("mtu").is_some(), want_mtu, "{v}: {i}");
                if want_mtu {
                    assert_eq!(i["mtu"], 1450);
                }
            }
            let ips = r["ips"].as_array().unwrap();
            assert_eq!(ips.len(), 2);
            assert_eq!(ips[0]["address"], "10.244.1.7/32");
            assert_eq!(ips[0]["gateway"], "169.254.1.1");
            assert_eq!(ips[0]["interface"], 1);
            assert_eq!(ips[1]["address"], "fd00:10:244:1::7/128");
            assert_eq!(ips[1]["gateway"], "fe80::1");
            assert_eq!(ips[1]["interface"], 1);
            if v < CniVersion::V1_0_0 {
                assert_eq!(ips[0]["version"], "4", "{v}");
                assert_eq!(ips[1]["version"], "6", "{v}");
            } else {
                assert!(ips.iter().all(|i| i.get("version").is_none()), "{v}");
            }
            assert_eq!(
                r["routes"],
                json!([{"dst": "0.0.0.0/0", "gw": "169.254.1.1"}, {"dst": "::/0", "gw": "fe80::1"}])
            );
            assert_eq!(r["dns"], json!({}));
            let keys: Vec<&str> = r.as_object().unwrap().keys().map(String::as_str).collect();
            let mut sorted = keys.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, ["cniVersion", "dns", "interfaces", "ips", "routes"]);
        }
    }

    #[test]
    fn v4_only_and_v6_only() {
        let r = render(&conf(CniVersion::V1_0_0), &wired(&["10.244.1.7"]));
        assert_eq!(r["ips"].as_array().unwrap().len(), 1);
        assert_eq!(
            r["routes"],
            json!([{"dst": "0.0.0.0/0", "gw": "169.254.1.1"}])
        );
        let r = render(&conf(CniVersion::V0_3_1), &wired(&["fd00::7"]));
        assert_eq!(
            r["ips"],
            json!([{"version": "6", "address": "fd00::7/128", "gateway": "fe80::1", "interface": 1}])
        );
        assert_eq!(r["routes"], json!([{"dst": "::/0", "gw": "fe80::1"}]));
    }

    #[test]
    fn zero_mtu_is_left_out_of_1_1() {
        let mut w = wired(&DUAL);
        w.mtu = 0;
        let r = render(&conf(CniVersion::V1_1_0), &w);
        assert!(r["interfaces"][1].get("mtu").is_none());
    }

    #[test]
    fn dns_from_config() {
        let mut c = conf(CniVersion::V1_1_0);
        c.dns = Some(json!({"nameservers": ["10.96.0.10"], "search": ["svc.cluster.local"]}));
        let r = render(&c, &wired(&DUAL));
        assert_eq!(r["dns"]["nameservers"], json!(["10.96.0.10"]));
    }

    fn prev(version: CniVersion) -> PrevResult {
        let mut v = json!({
            "cniVersion": version.as_str(),
            "interfaces": [{"name": "eth1", "mac": "52:54:00:00:00:01", "sandbox": "/run/netns/p1"}],
            "ips": [{"address": "192.168.5.9/24", "gateway": "192.168.5.1", "interface": 0}],
            "routes": [{"dst": "192.168.0.0/16", "gw": "192.168.5.1"}],
            "dns": {"nameservers": ["192.168.5.1"]},
            "vendorExtra": {"kept": true}
        });
        if version.ips_carry_version() {
            v["ips"][0]["version"] = json!("4");
        }
        PrevResult::parse(&v, version).unwrap()
    }

    #[test]
    fn chained_after_one_interface_shifts_indices() {
        for v in CniVersion::ALL {
            let mut c = conf(v);
            c.prev_result = Some(prev(v));
            let r = render(&c, &wired(&DUAL));
            assert_eq!(r["cniVersion"], v.as_str());
            let ifs = r["interfaces"].as_array().unwrap();
            assert_eq!(ifs.len(), 3);
            assert_eq!(ifs[0]["name"], "eth1");
            assert_eq!(ifs[1]["name"], "tth4f2a9c01e3b");
            assert_eq!(ifs[2]["name"], "eth0");
            let ips = r["ips"].as_array().unwrap();
            assert_eq!(ips.len(), 3);
            assert_eq!(ips[0]["address"], "192.168.5.9/24");
            assert_eq!(ips[0]["interface"], 0, "previous entries are untouched");
            assert_eq!(ips[1]["interface"], 2);
            assert_eq!(ips[2]["interface"], 2);
            let routes = r["routes"].as_array().unwrap();
            assert_eq!(routes.len(), 3);
            assert_eq!(routes[0]["dst"], "192.168.0.0/16");
            assert_eq!(
                r["dns"],
                json!({"nameservers": ["192.168.5.1"]}),
                "kept without our dns"
            );
            assert_eq!(r["vendorExtra"], json!({"kept": true}));
        }
    }

    #[test]
    fn chained_config_dns_replaces_previous() {
        let mut c = conf(CniVersion::V1_0_0);
        c.prev_result = Some(prev(CniVersion::V1_0_0));
        c.dns = Some(json!({"nameservers": ["10.96.0.10"]}));
        let r = render(&c, &wired(&DUAL));
        assert_eq!(r["dns"], json!({"nameservers": ["10.96.0.10"]}));
    }

    #[test]
    fn chained_after_empty_prev_result() {
        let mut c = conf(CniVersion::V1_1_0);
        c.prev_result =
            Some(PrevResult::parse(&json!({"cniVersion": "1.1.0"}), CniVersion::V1_1_0).unwrap());
        let r = render(&c, &wired(&["10.244.1.7"]));
        assert_eq!(r["ips"][0]["interface"], 1);
        assert_eq!(r["interfaces"].as_array().unwrap().len(), 2);
    }

    fn with_own_result(version: CniVersion, w: &Wired) -> NetConf {
        let bytes = render_add_result(&conf(version), w).unwrap();
        let v = parse_result(&bytes).unwrap();
        let mut c = conf(version);
        c.prev_result = Some(PrevResult::parse(&v, version).unwrap());
        c
    }

    #[test]
    fn check_accepts_its_own_result_in_every_version() {
        let w = wired(&DUAL);
        for v in CniVersion::ALL {
            check_prev_result(&with_own_result(v, &w), &w).unwrap();
        }
    }

    #[test]
    fn check_accepts_a_chained_result() {
        let w = wired(&DUAL);
        let mut c = conf(CniVersion::V1_1_0);
        c.prev_result = Some(prev(CniVersion::V1_1_0));
        let v = parse_result(&render_add_result(&c, &w).unwrap()).unwrap();
        c.prev_result = Some(PrevResult::parse(&v, CniVersion::V1_1_0).unwrap());
        check_prev_result(&c, &w).unwrap();
    }

    #[test]
    fn check_ignores_a_changed_mac() {
        let w = wired(&DUAL);
        let c = with_own_result(CniVersion::V1_0_0, &w);
        let mut w2 = w.clone();
        w2.pod_mac = "0a:58:00:00:00:99".into();
        check_prev_result(&c, &w2).unwrap();
    }

    fn assert_116(c: &NetConf, w: &Wired, needle: &str) {
        let err = check_prev_result(c, w).unwrap_err();
        assert_eq!(err.code(), 116, "{err}");
        assert!(err.to_string().contains(needle), "{err}");
    }

    #[test]
    fn check_mismatches_are_116() {
        let w = wired(&DUAL);
        let c = with_own_result(CniVersion::V1_1_0, &w);

        let mut other = w.clone();
        other.pod_ifname = "net1".into();
        assert_116(&c, &other, "net1");

        let mut other = w.clone();
        other.sandbox = "/run/netns/p2".into();
        assert_116(&c, &other, "sandbox");

        let mut other = w.clone();
        other.ips.push("10.244.1.8".parse().unwrap());
        assert_116(&c, &other, "10.244.1.8/32");

        // The same address with another prefix is a mismatch too.
        let mut v =
            parse_result(&render_add_result(&conf(CniVersion::V1_1_0), &w).unwrap()).unwrap();
        v["ips"][0]["address"] = json!("10.244.1.7/24");
        let mut c2 = conf(CniVersion::V1_1_0);
        c2.prev_result = Some(PrevResult::parse(&v, CniVersion::V1_1_0).unwrap());
        assert_116(&c2, &w, "10.244.1.7/24");

        // Our address bound to the host interface is a mismatch.
        v["ips"][0]["address"] = json!("10.244.1.7/32");
        v["ips"][0]["interface"] = json!(0);
        c2.prev_result = Some(PrevResult::parse(&v, CniVersion::V1_1_0).unwrap());
        assert_116(&c2, &w, "10.244.1.7");
    }

    #[test]
    fn check_without_prev_result_is_7() {
        let err = check_prev_result(&conf(CniVersion::V1_1_0), &wired(&DUAL)).unwrap_err();
        assert_eq!(err.code(), 7);
    }

    #[test]
    fn error_object() {
        let err = Error::UnsupportedField {
            key: "ipam".into(),
            value: "{}".into(),
        };
        let e = error_to_proto("0.4.0", &err);
        assert_eq!(e.code, 2);
        assert_eq!(e.msg, "unsupported field");
        assert_eq!(e.details, "unsupported field ipam={}");
        assert_eq!(e.cni_version, "0.4.0");
        let e = error_to_proto("1.1.0", &Error::check(Mismatch::PrevResult, "x"));
        assert_eq!(e.code, 116);
    }

    #[test]
    fn error_version_echoes_stdin() {
        assert_eq!(
            error_version(br#"{"cniVersion":"0.3.1","name":"x"}"#),
            "0.3.1"
        );
        assert_eq!(error_version(br#"{"cniVersion":"0.2.0"}"#), "0.2.0");
        assert_eq!(error_version(br#"{"cniVersion":1}"#), "1.1.0");
        assert_eq!(error_version(br#"{"name":"x"}"#), "1.1.0");
        assert_eq!(error_version(b"not json"), "1.1.0");
        assert_eq!(error_version(b""), "1.1.0");
        assert_eq!(error_version(&[0xff, 0xfe]), "1.1.0");
        assert_eq!(error_version(b"[\"1.0.0\"]"), "1.1.0");
    }

    #[test]
    fn empty_and_parse() {
        assert!(empty_result().is_empty());
        assert_eq!(parse_result(b"[]").unwrap_err().code(), 6);
        assert_eq!(parse_result(b"{}").unwrap_err().code(), 6);
        assert_eq!(parse_result(b"").unwrap_err().code(), 6);
        assert!(parse_result(br#"{"cniVersion":"1.0.0"}"#).is_ok());
    }
}
