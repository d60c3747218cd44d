//! Named pools as an operator defines them: the `--pools` file, parsed and
//! checked field by field.
//!
//! ```json
//! {"pools": [{"name": "migration", "cidr": "10.200.0.0/24",
//!             "rangeStart": "10.200.0.10", "rangeEnd": "10.200.0.250",
//!             "exclude": ["10.200.0.100", "10.200.0.128/28"],
//!             "gateway": "10.200.0.1",
//!             "routes": [{"dst": "10.201.0.0/16"}],
//!             "dns": {"nameservers": ["10.200.0.53"]},
//!             "blockSize": 28}]}
//! ```

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;

use ipnet::IpNet;
use serde::Deserialize;
use serde_json::Value;

use tether_base::error::{Error, Result};
use tether_cni::config::is_cni_name;
use tether_ipam::{from_u128, max_len, to_u128, Family};

/// The default block of an IPv4 pool: 16 addresses per claim.
pub const DEFAULT_BLOCK_V4: u8 = 28;
/// The default block of an IPv6 pool: 256 addresses per claim.
pub const DEFAULT_BLOCK_V6: u8 = 120;

/// One route a pool gives with its addresses (IPAM-only results).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolRoute {
    /// `dst`.
    pub dst: IpNet,
    /// `gw`; absent means the pool's gateway, or none.
    pub gw: Option<IpAddr>,
}

/// A named pool.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolDef {
    /// `name`: what netconfs and annotations select it by.
    pub name: String,
    /// `cidr`: the subnet; IPAM-only results give addresses with its prefix.
    pub cidr: IpNet,
    /// `rangeStart`: the lowest address handed out (default: the first host).
    pub range_start: Option<IpAddr>,
    /// `rangeEnd`: the highest address handed out (default: the last host).
    pub range_end: Option<IpAddr>,
    /// `exclude`: addresses and subnets never handed out, requested ones
    /// included.
    pub exclude: Vec<IpNet>,
    /// `gateway`: given in IPAM-only results; never handed out.
    pub gateway: Option<IpAddr>,
    /// `routes`: given in IPAM-only results.
    pub routes: Vec<PoolRoute>,
    /// `dns`: given in IPAM-only results, as the CNI result's `dns`.
    pub dns: Option<Value>,
    /// `blockSize`: the prefix length of the blocks nodes claim.
    pub block_len: u8,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileJson {
    pools: Vec<PoolJson>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PoolJson {
    name: String,
    cidr: String,
    #[serde(default)]
    range_start: Option<String>,
    #[serde(default)]
    range_end: Option<String>,
    #[serde(default)]
    exclude: Vec<String>,
    #[serde(default)]
    gateway: Option<String>,
    #[serde(default)]
    routes: Vec<RouteJson>,
    #[serde(default)]
    dns: Option<Value>,
    #[serde(default)]
    block_size: Option<u8>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RouteJson {
    dst: String,
    #[serde(default)]
    gw: Option<String>,
}

impl PoolDef {
    /// The pool's family.
    pub fn family(&self) -> Family {
        Family::of(&self.cidr)
    }

    /// The intervals of the CIDR never handed out: the network address
    /// (and an IPv4 broadcast address), what lies outside the range, the
    /// gateway and every `exclude`.
    pub fn holes(&self) -> Vec<(IpAddr, IpAddr)> {
        let (net, bcast) = (self.cidr.network(), self.cidr.broadcast());
        let mut holes = vec![(net, net)];
        if matches!(self.cidr, IpNet::V4(_)) && self.cidr.prefix_len() <= 30 {
            holes.push((bcast, bcast));
        }
        if let Some(start) = self.range_start {
            if to_u128(start) > to_u128(net) {
                holes.push((net, from_u128(net, to_u128(start) - 1)));
            }
        }
        if let Some(end) = self.range_end {
            if to_u128(end) < to_u128(bcast) {
                holes.push((from_u128(net, to_u128(end) + 1), bcast));
            }
        }
        if let Some(gw) = self.gateway {
            holes.push((gw, gw));
        }
        for ex in &self.exclude {
            holes.push((ex.network(), ex.broadcast()));
        }
        holes
    }

    /// True when `ip` lies in the CIDR but may not be handed out.
    pub fn is_excluded(&self, ip: IpAddr) -> bool {
        let n = to_u128(ip);
        self.cidr.contains(&ip)
            && self
                .holes()
                .iter()
                .any(|&(a, b)| (to_u128(a)..=to_u128(b)).contains(&n))
    }

    /// Why `ip` is excluded, for the error a request for it gets.
    pub fn why_excluded(&self, ip: IpAddr) -> String {
        if self.gateway == Some(ip) {
            return format!("{ip} is the gateway of pool {}", self.name);
        }
        if let Some(ex) = self.exclude.iter().find(|e| e.contains(&ip)) {
            return format!("{ip} is excluded from pool {} by {ex}", self.name);
        }
        if self.range_start.is_some_and(|s| to_u128(ip) < to_u128(s))
            || self.range_end.is_some_and(|e| to_u128(ip) > to_u128(e))
        {
            return format!(
                "{ip} lies outside the range {}-{} of pool {}",
                self.range_start.unwrap_or(self.cidr.network()),
                self.range_end.unwrap_or(self.cidr.broadcast()),
                self.name
            );
        }
        format!(
            "{ip} is the network or broadcast address of pool {} ({})",
            self.name, self.cidr
        )
    }

    /// How many addresses the pool may ever hand out.
    pub fn size(&self) -> u128 {
        tether_ipam::Pool::block(self.cidr, &self.holes()).size()
    }
}

/// Parses and checks a pools file.
pub fn load(path: &Path) -> Result<Vec<PoolDef>> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::InvalidConfig(format!("reading the pools file {}: {e}", path.display()))
    })?;
    parse(&text).map_err(|e| match e {
        Error::InvalidConfig(m) => Error::InvalidConfig(format!("{}: {m}", path.display())),
        other => other,
    })
}

/// Parses and checks the text of a pools file.
pub fn parse(text: &str) -> Result<Vec<PoolDef>> {
    // serde reads a struct from an array too (its fields in order), so a
    // bare list of pools would be told "invalid type: map, expected a
    // sequence": say what the file must hold instead.
    if let Ok(top) = serde_json::from_str::<Value>(text) {
        if !top.is_object() {
            return Err(Error::InvalidConfig(format!(
                "pools file: expected an object {{\"pools\": [...]}}, found {}{}",
                tether_cni::config::json_type(&top),
                if top.is_array() {
                    "; put the list under \"pools\""
                } else {
                    ""
                }
            )));
        }
    }
    let file: FileJson =
        serde_json::from_str(text).map_err(|e| Error::InvalidConfig(format!("pools file: {e}")))?;
    let mut defs: Vec<PoolDef> = Vec::with_capacity(file.pools.len());
    let mut names = BTreeMap::new();
    for (i, p) in file.pools.into_iter().enumerate() {
        let def = parse_pool(p).map_err(|m| Error::InvalidConfig(format!("pool #{i}: {m}")))?;
        if names.insert(def.name.clone(), ()).is_some() {
            return Err(Error::InvalidConfig(format!(
                "pool name {:?} is defined twice",
                def.name
            )));
        }
        if let Some(other) = defs.iter().find(|o| overlaps(&o.cidr, &def.cidr)) {
            return Err(Error::InvalidConfig(format!(
                "pool {} ({}) overlaps pool {} ({}): an address must have one pool",
                def.name, def.cidr, other.name, other.cidr
            )));
        }
        defs.push(def);
    }
    Ok(defs)
}

/// Refuses a CIDR with host bits set (`10.0.0.5/24`), which is most often
/// an address typed where its network was meant: the pools file's `cidr`
/// and the daemon's `--pod-cidr` and `--cluster-cidr` share this check
/// and its message.
pub fn check_network(cidr: &IpNet) -> std::result::Result<(), String> {
    if cidr.trunc() == *cidr {
        return Ok(());
    }
    Err(format!(
        "{cidr} has host bits set; did you mean {}?",
        cidr.trunc()
    ))
}

/// True when two subnets share an address.
pub fn overlaps(a: &IpNet, b: &IpNet) -> bool {
    a.contains(&b.network()) || b.contains(&a.network())
}

fn addr(field: &str, s: &str) -> std::result::Result<IpAddr, String> {
    s.parse()
        .map_err(|_| format!("{field} {s:?} is not an IP address"))
}

fn parse_pool(p: PoolJson) -> std::result::Result<PoolDef, String> {
    if !is_cni_name(&p.name) || p.name.len() > 63 {
        return Err(format!(
            "name {:?} must match ^[a-zA-Z0-9][a-zA-Z0-9_.\\-]*$ and have at most 63 characters",
            p.name
        ));
    }
    let name = p.name;
    let at = |m: String| format!("{name}: {m}");
    let cidr: IpNet = p
        .cidr
        .parse()
        .map_err(|_| at(format!("cidr {:?} is not a CIDR", p.cidr)))?;
    check_network(&cidr).map_err(|m| at(format!("cidr {m}")))?;
    let inside = |field: &str, ip: IpAddr| -> std::result::Result<IpAddr, String> {
        if cidr.contains(&ip) {
            Ok(ip)
        } else {
            Err(at(format!("{field} {ip} lies outside {cidr}")))
        }
    };
    let range_start = match &p.range_start {
        Some(s) => Some(inside("rangeStart", addr("rangeStart", s).map_err(at)?)?),
        None => None,
    };
    let range_end = match &p.range_end {
        Some(s) => Some(inside("rangeEnd", addr("rangeEnd", s).map_err(at)?)?),
        None => None,
    };
    if let (Some(s), Some(e)) = (range_start, range_end) {
        if to_u128(s) > to_u128(e) {
            return Err(at(format!("rangeStart {s} is after rangeEnd {e}")));
        }
    }
    let mut exclude = Vec::with_capacity(p.exclude.len());
    for e in &p.exclude {
        let net: IpNet = match e.parse::<IpNet>() {
            Ok(n) => n.trunc(),
            Err(_) => IpNet::from(addr("exclude", e).map_err(at)?),
        };
        if !overlaps(&net, &cidr) {
            return Err(at(format!("exclude {e} lies outside {cidr}")));
        }
        exclude.push(net);
    }
    let gateway = match &p.gateway {
        Some(s) => Some(inside("gateway", addr("gateway", s).map_err(at)?)?),
        None => None,
    };
    let mut routes = Vec::with_capacity(p.routes.len());
    for r in &p.routes {
        let dst: IpNet = r
            .dst
            .parse()
            .map_err(|_| at(format!("route dst {:?} is not a CIDR", r.dst)))?;
        let gw = match &r.gw {
            Some(g) => Some(addr("route gw", g).map_err(at)?),
            None => None,
        };
        let v4 = matches!(cidr, IpNet::V4(_));
        if matches!(dst, IpNet::V4(_)) != v4 || gw.is_some_and(|g| g.is_ipv4() != v4) {
            return Err(at(format!("route to {dst} is not of the pool's family")));
        }
        routes.push(PoolRoute { dst, gw });
    }
    if let Some(dns) = &p.dns {
        if !dns.is_object() {
            return Err(at("dns must be an object".into()));
        }
    }
    let default_block = if matches!(cidr, IpNet::V4(_)) {
        DEFAULT_BLOCK_V4
    } else {
        DEFAULT_BLOCK_V6
    };
    let block_len = p
        .block_size
        .unwrap_or_else(|| default_block.max(cidr.prefix_len()));
    if block_len < cidr.prefix_len() || block_len > max_len(&cidr) {
        return Err(at(format!(
            "blockSize /{block_len} must lie between the pool's /{} and /{}",
            cidr.prefix_len(),
            max_len(&cidr)
        )));
    }
    let def = PoolDef {
        name: name.clone(),
        cidr,
        range_start,
        range_end,
        exclude,
        gateway,
        routes,
        dns: p.dns,
        block_len,
    };
    if def.size() == 0 {
        return Err(at("every address is excluded".into()));
    }
    Ok(def)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn parses_a_full_pool_and_computes_its_holes() {
        let defs = parse(
            r#"{"pools":[{"name":"migration","cidr":"10.200.0.0/24","rangeStart":"10.200.0.10",
                "rangeEnd":"10.200.0.250","exclude":["10.200.0.100","10.200.0.128/28"],
                "gateway":"10.200.0.1","routes":[{"dst":"10.201.0.0/16"}],
                "dns":{"nameservers":["10.200.0.53"]}}]}"#,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let d = &defs[0];
        assert_eq!(d.block_len, 28);
        // 10..=250 is 241 addresses, less one and sixteen excluded.
        assert_eq!(d.size(), 241 - 1 - 16);
        for (addr, excluded) in [
            ("10.200.0.0", true),
            ("10.200.0.1", true),
            ("10.200.0.9", true),
            ("10.200.0.10", false),
            ("10.200.0.100", true),
            ("10.200.0.101", false),
            ("10.200.0.130", true),
            ("10.200.0.250", false),
            ("10.200.0.251", true),
        ] {
            assert_eq!(d.is_excluded(ip(addr)), excluded, "{addr}");
        }
        assert!(d.why_excluded(ip("10.200.0.1")).contains("gateway"));
        assert!(d
            .why_excluded(ip("10.200.0.130"))
            .contains("10.200.0.128/28"));
        assert!(d
            .why_excluded(ip("10.200.0.5"))
            .contains("outside the range"));
    }

    #[test]
    fn refuses_bad_definitions_with_the_reason() {
        for (text, needle) in [
            (
                r#"{"pools":[{"name":"a","cidr":"10.0.0.1/24"}]}"#,
                "host bits",
            ),
            (
                r#"{"pools":[{"name":"a","cidr":"10.0.0.0/24","gateway":"10.0.1.1"}]}"#,
                "outside",
            ),
            (
                r#"{"pools":[{"name":"a","cidr":"10.0.0.0/24","rangeStart":"10.0.0.9","rangeEnd":"10.0.0.8"}]}"#,
                "after rangeEnd",
            ),
            (
                r#"{"pools":[{"name":"a","cidr":"10.0.0.0/24","exclude":["10.1.0.0/24"]}]}"#,
                "outside",
            ),
            (
                r#"{"pools":[{"name":"a","cidr":"10.0.0.0/24","blockSize":20}]}"#,
                "blockSize",
            ),
            (
                r#"{"pools":[{"name":"a","cidr":"10.0.0.0/24","colour":"red"}]}"#,
                "unknown field",
            ),
            (
                r#"{"pools":[{"name":"a b","cidr":"10.0.0.0/24"}]}"#,
                "must match",
            ),
            (
                r#"{"pools":[{"name":"a","cidr":"10.0.0.0/24"},{"name":"a","cidr":"10.1.0.0/24"}]}"#,
                "twice",
            ),
            (
                r#"{"pools":[{"name":"a","cidr":"10.0.0.0/16"},{"name":"b","cidr":"10.0.5.0/24"}]}"#,
                "overlaps",
            ),
            (
                r#"{"pools":[{"name":"a","cidr":"10.0.0.0/30","exclude":["10.0.0.0/30"]}]}"#,
                "every address",
            ),
            (
                r#"{"pools":[{"name":"a","cidr":"10.0.0.0/24","routes":[{"dst":"::/0"}]}]}"#,
                "family",
            ),
            (
                r#"[{"name":"a","cidr":"10.0.0.0/24"}]"#,
                r#"expected an object {"pools": [...]}, found an array; put the list under "pools""#,
            ),
            (r#""pools""#, "found a string"),
        ] {
            let e = parse(text).map(|_| ()).expect_err(text);
            assert_eq!(e.code(), 7, "{text}");
            assert!(e.to_string().contains(needle), "{text}: {e}");
        }
    }

    #[test]
    fn a_network_with_host_bits_is_refused_with_the_network_meant() {
        let net = |s: &str| s.parse::<IpNet>().expect("CIDR");
        assert_eq!(check_network(&net("10.0.0.0/24")), Ok(()));
        assert_eq!(check_network(&net("fd00::/64")), Ok(()));
        assert_eq!(
            check_network(&net("10.0.0.5/24")),
            Err("10.0.0.5/24 has host bits set; did you mean 10.0.0.0/24?".into())
        );
        let e = parse(r#"{"pools":[{"name":"a","cidr":"10.0.0.1/24"}]}"#).expect_err("host bits");
        assert!(
            e.to_string()
                .contains("a: cidr 10.0.0.1/24 has host bits set; did you mean 10.0.0.0/24?"),
            "{e}"
        );
    }

    #[test]
    fn ipv6_pools_keep_their_last_address_and_default_to_slash_120_blocks() {
        let defs = parse(r#"{"pools":[{"name":"v6","cidr":"fd10::/120"}]}"#)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(defs[0].block_len, 120);
        assert_eq!(defs[0].size(), 255);
        assert!(!defs[0].is_excluded(ip("fd10::ff")));
    }
}
