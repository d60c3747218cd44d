//! How tether's keys map onto Kubernetes objects and back: pure, no I/O.
//!
//! Each key class (the segment after `<prefix>/v1/`) is a kind of tether's
//! CRDs in the API group [`GROUP`], cluster-scoped, except `alive/`, which
//! is a `coordination.k8s.io` Lease. The object's name is the key's last
//! part written as a DNS subdomain, one to one, so that "create if absent"
//! is the API's create (409 when the name exists); the value is the
//! object's `spec`, the record's JSON field for field, so that one serde
//! type serves etcd and the Kubernetes API alike.
//!
//! | Key | Kind | Name |
//! |---|---|---|
//! | `nodes/<node>` | `TetherNode` | the node's name (a DNS subdomain, as Kubernetes' are) |
//! | `nodeids/<id>` | `TetherNodeID` | the ID in decimal; spec `{node}` |
//! | `alive/<node>` | `Lease` (namespaced) | `tether-<node>` |
//! | `blocks/v4/<net>-<len>` | `AddressBlock` | `10.244.0.0-26`; IPv6 `fd00-10-244-0-0-0-0-0-122` |
//! | `poolblocks/…` | `PoolBlock` | as `AddressBlock` |
//! | `vms/<ns>/<vm>/<interface>` | `VMAddress` | `<ns>.<vm>.<interface>`, a claim's `<ns>.<claim>`; else `x-<hash>` |
//! | `vmaddrs/<ip>`, `vmmacs/<mac>` | `VMAddressOwner` | `ip-10.244.1.5`, `ip-fd00-…`, `mac-0a-58-0a-f4-01-05` |
//!
//! A VM key's parts need not be DNS labels (an interface may hold capital
//! letters, a claim's key holds ':'); such a key's object is named by a
//! SHA-256 of the key and found back through its `spec.key`. Every name is
//! checked to map back to the key it came from, so two keys never share
//! an object.

use serde_json::{json, Value};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// tether's API group.
pub const GROUP: &str = "tether.dev";
/// The version of its kinds.
pub const VERSION: &str = "v1alpha1";
/// The prefix of a node's Lease name.
pub const LEASE_PREFIX: &str = "tether-";
/// The labels every node Lease of tether's carries, as a selector.
pub const LEASE_SELECTOR: &str =
    "app.kubernetes.io/managed-by=tetherd,app.kubernetes.io/component=node-lease";
/// The interface part of the VM key an IPAMClaim holds.
const CLAIM_INTERFACE: &str = ":ipamclaim";

/// A class of keys: the segment after the root.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Class {
    /// `nodes/`: node records.
    Nodes,
    /// `nodeids/`: node IDs.
    NodeIds,
    /// `alive/`: node liveness, a Lease each.
    Alive,
    /// `blocks/`: blocks of the cluster CIDRs.
    Blocks,
    /// `poolblocks/`: blocks of named pools.
    PoolBlocks,
    /// `vms/`: VM address records.
    Vms,
    /// `vmaddrs/`: which VM holds an address.
    VmAddrs,
    /// `vmmacs/`: which VM holds a MAC.
    VmMacs,
}

/// A kind of tether's CRDs: its name and plural.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kind {
    /// The kind, e.g. "AddressBlock".
    pub kind: &'static str,
    /// Its plural, the resource, e.g. "addressblocks".
    pub plural: &'static str,
}

/// Every kind of tether's CRDs.
pub const KINDS: [Kind; 6] = [
    Kind {
        kind: "TetherNode",
        plural: "tethernodes",
    },
    Kind {
        kind: "TetherNodeID",
        plural: "tethernodeids",
    },
    Kind {
        kind: "AddressBlock",
        plural: "addressblocks",
    },
    Kind {
        kind: "PoolBlock",
        plural: "poolblocks",
    },
    Kind {
        kind: "VMAddress",
        plural: "vmaddresses",
    },
    Kind {
        kind: "VMAddressOwner",
        plural: "vmaddressowners",
    },
];

impl Class {
    /// Every class.
    pub const ALL: [Class; 8] = [
        Class::Nodes,
        Class::NodeIds,
        Class::Alive,
        Class::Blocks,
        Class::PoolBlocks,
        Class::Vms,
        Class::VmAddrs,
        Class::VmMacs,
    ];

    /// The key segment, e.g. "blocks".
    pub fn segment(self) -> &'static str {
        match self {
            Class::Nodes => "nodes",
            Class::NodeIds => "nodeids",
            Class::Alive => "alive",
            Class::Blocks => "blocks",
            Class::PoolBlocks => "poolblocks",
            Class::Vms => "vms",
            Class::VmAddrs => "vmaddrs",
            Class::VmMacs => "vmmacs",
        }
    }

    /// The kind of tether's holding the class; `None` for `alive/`, whose
    /// objects are Leases.
    pub fn kind(self) -> Option<Kind> {
        Some(match self {
            Class::Nodes => KINDS[0],
            Class::NodeIds => KINDS[1],
            Class::Alive => return None,
            Class::Blocks => KINDS[2],
            Class::PoolBlocks => KINDS[3],
            Class::Vms => KINDS[4],
            Class::VmAddrs | Class::VmMacs => KINDS[5],
        })
    }

    /// The object name of the key whose part after `<segment>/` is
    /// `suffix`, or why there is none.
    pub fn name_of(self, suffix: &str) -> Result<String, String> {
        let name = match self {
            Class::Nodes => node_name(suffix)?.to_owned(),
            Class::Alive => format!("{LEASE_PREFIX}{}", node_name(suffix)?),
            Class::NodeIds => suffix.to_owned(),
            Class::Blocks | Class::PoolBlocks => {
                let (family, cidr) = suffix
                    .split_once('/')
                    .ok_or_else(|| format!("{suffix:?} is not <family>/<net>-<len>"))?;
                let (net, len) = cidr
                    .rsplit_once('-')
                    .ok_or_else(|| format!("{cidr:?} is not <net>-<len>"))?;
                let ip: IpAddr = net
                    .parse()
                    .map_err(|_| format!("{net:?} is not an address"))?;
                let tag = if ip.is_ipv4() { "v4" } else { "v6" };
                if family != tag {
                    return Err(format!("{ip} is not of family {family}"));
                }
                format!("{}-{len}", ip_name(ip))
            }
            Class::Vms => vm_name(suffix)?,
            Class::VmAddrs => {
                let ip: IpAddr = suffix
                    .parse()
                    .map_err(|_| format!("{suffix:?} is not an address"))?;
                format!("ip-{}", ip_name(ip))
            }
            Class::VmMacs => format!("mac-{}", suffix.replace(':', "-")),
        };
        // One key, one object: the name must map back to this very key.
        if self != Class::Vms && self.suffix_of_name(&name).as_deref() != Some(suffix) {
            return Err(format!("{suffix:?} is not in its canonical form"));
        }
        if !is_subdomain(&name) {
            return Err(format!("{name:?} is not a DNS subdomain"));
        }
        Ok(name)
    }

    /// The key part after `<segment>/` of an object named `name` with
    /// `spec`; `None` when it names no key of this class (or, for a VM
    /// record, when its name is not its key's).
    pub fn suffix_of(self, name: &str, spec: &Value) -> Option<String> {
        if self != Class::Vms {
            return self.suffix_of_name(name);
        }
        let key = &spec["key"];
        let suffix = format!(
            "{}/{}/{}",
            key["namespace"].as_str()?,
            key["vm"].as_str()?,
            key["interface"].as_str()?
        );
        (vm_name(&suffix).ok()? == name).then_some(suffix)
    }

    fn suffix_of_name(self, name: &str) -> Option<String> {
        match self {
            Class::Nodes => Some(name.to_owned()),
            Class::Alive => name.strip_prefix(LEASE_PREFIX).map(str::to_owned),
            Class::NodeIds => {
                let id: u32 = name.parse().ok()?;
                (id.to_string() == name).then(|| name.to_owned())
            }
            Class::Blocks | Class::PoolBlocks => {
                let (net, len) = name.rsplit_once('-')?;
                let len: u8 = len.parse().ok()?;
                let ip = ip_of_name(net)?;
                let tag = if ip.is_ipv4() { "v4" } else { "v6" };
                Some(format!("{tag}/{ip}-{len}"))
            }
            Class::Vms => None,
            Class::VmAddrs => Some(ip_of_name(name.strip_prefix("ip-")?)?.to_string()),
            Class::VmMacs => {
                let mac = name.strip_prefix("mac-")?.replace('-', ":");
                let ok = mac.len() == 17
                    && mac.split(':').all(|o| {
                        o.len() == 2 && o.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
                    });
                ok.then_some(mac)
            }
        }
    }

    /// Whether an object of the class's kind named `name` belongs to the
    /// class (addresses and MACs share a kind).
    pub fn owns(self, name: &str) -> bool {
        match self {
            Class::VmAddrs => name.starts_with("ip-"),
            Class::VmMacs => name.starts_with("mac-"),
            _ => true,
        }
    }

    /// The object's spec for a stored value.
    pub fn spec_of(self, value: &[u8]) -> Result<Value, String> {
        match self {
            Class::NodeIds => {
                let node = std::str::from_utf8(value).map_err(|e| e.to_string())?;
                Ok(json!({ "node": node }))
            }
            _ => {
                let spec: Value =
                    serde_json::from_slice(value).map_err(|e| format!("not JSON: {e}"))?;
                if !spec.is_object() {
                    return Err("not a JSON object".into());
                }
                Ok(spec)
            }
        }
    }

    /// The stored value of an object's spec; `None` when it has none that
    /// the class can read.
    pub fn value_of(self, spec: &Value) -> Option<Vec<u8>> {
        match self {
            Class::NodeIds => Some(spec["node"].as_str()?.as_bytes().to_vec()),
            _ => spec
                .is_object()
                .then(|| serde_json::to_vec(spec).ok())
                .flatten(),
        }
    }
}

/// A node's name, checked: it names objects, so it must be a DNS subdomain
/// (a Kubernetes node's name is one), short enough for its Lease's name.
fn node_name(name: &str) -> Result<&str, String> {
    if !is_subdomain(name) || name.len() + LEASE_PREFIX.len() > 253 {
        return Err(format!(
            "node name {name:?} is not a DNS subdomain of at most {} characters, as --store kubernetes needs",
            253 - LEASE_PREFIX.len()
        ));
    }
    Ok(name)
}

/// An address as part of a name: IPv4 dotted, IPv6 as its eight groups
/// (hex, no leading zeros) joined by '-'.
fn ip_name(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => v6
            .segments()
            .iter()
            .map(|g| format!("{g:x}"))
            .collect::<Vec<_>>()
            .join("-"),
    }
}

fn ip_of_name(name: &str) -> Option<IpAddr> {
    if name.contains('.') {
        let ip: Ipv4Addr = name.parse().ok()?;
        return (ip.to_string() == name).then_some(IpAddr::V4(ip));
    }
    let groups: Vec<u16> = name
        .split('-')
        .map(|g| u16::from_str_radix(g, 16).ok())
        .collect::<Option<Vec<_>>>()?;
    let groups: [u16; 8] = groups.try_into().ok()?;
    let ip = IpAddr::V6(Ipv6Addr::from(groups));
    (ip_name(ip) == name).then_some(ip)
}

/// A VM record's name: `<ns>.<vm>.<interface>` (a claim's key:
/// `<ns>.<claim>`) when each part is a DNS label, else `x-` and the first
/// 20 bytes of the key's SHA-256 in hex.
fn vm_name(suffix: &str) -> Result<String, String> {
    let parts: Vec<&str> = suffix.split('/').collect();
    let [ns, vm, iface] = parts[..] else {
        return Err(format!("{suffix:?} is not <namespace>/<vm>/<interface>"));
    };
    let readable = if iface == CLAIM_INTERFACE {
        format!("{ns}.{vm}")
    } else {
        format!("{ns}.{vm}.{iface}")
    };
    let labels = [ns, vm]
        .into_iter()
        .chain((iface != CLAIM_INTERFACE).then_some(iface))
        .all(is_label);
    if labels && readable.len() <= 253 {
        return Ok(readable);
    }
    let digest = ring::digest::digest(&ring::digest::SHA256, suffix.as_bytes());
    let hex: String = digest.as_ref()[..20]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    Ok(format!("x-{hex}"))
}

/// A DNS-1123 label: 1 to 63 of `[a-z0-9-]`, alphanumeric at both ends.
fn is_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// A DNS-1123 subdomain: labels joined by '.', at most 253 characters.
pub fn is_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_label)
}

/// The key space under one root ("/tether/v1/").
#[derive(Debug, Clone)]
pub struct Keyspace {
    root: String,
}

impl Keyspace {
    /// The key space under `root`, which ends in '/'.
    pub fn new(root: &str) -> Keyspace {
        Keyspace {
            root: root.to_owned(),
        }
    }

    /// The class of `key` and its part after `<segment>/`.
    pub fn split<'a>(&self, key: &'a str) -> Option<(Class, &'a str)> {
        let rest = key.strip_prefix(&self.root)?;
        let (segment, suffix) = rest.split_once('/')?;
        let class = Class::ALL.into_iter().find(|c| c.segment() == segment)?;
        Some((class, suffix))
    }

    /// The key of `class` whose part after `<segment>/` is `suffix`.
    pub fn key(&self, class: Class, suffix: &str) -> String {
        format!("{}{}/{suffix}", self.root, class.segment())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(class: Class, suffix: &str) -> String {
        class
            .name_of(suffix)
            .unwrap_or_else(|e| panic!("{suffix}: {e}"))
    }

    #[test]
    fn every_key_class_names_its_object_and_reads_the_key_back() {
        let cases = [
            (Class::Nodes, "node-1.example.com", "node-1.example.com"),
            (Class::Alive, "node-1", "tether-node-1"),
            (Class::NodeIds, "17", "17"),
            (Class::Blocks, "v4/10.244.0.64-26", "10.244.0.64-26"),
            (
                Class::Blocks,
                "v6/fd00:10:244::40-122",
                "fd00-10-244-0-0-0-0-40-122",
            ),
            (
                Class::PoolBlocks,
                "v4/192.168.100.16-28",
                "192.168.100.16-28",
            ),
            (Class::VmAddrs, "10.244.1.5", "ip-10.244.1.5"),
            (Class::VmAddrs, "fd00::5", "ip-fd00-0-0-0-0-0-0-5"),
            (Class::VmMacs, "0a:58:0a:f4:01:05", "mac-0a-58-0a-f4-01-05"),
        ];
        for (class, suffix, want) in cases {
            assert_eq!(name(class, suffix), want, "{class:?}");
            assert_eq!(
                class.suffix_of(want, &Value::Null).as_deref(),
                Some(suffix),
                "{class:?}"
            );
            assert!(is_subdomain(want), "{want}");
        }
    }

    #[test]
    fn vm_records_are_named_readably_when_they_can_be_and_by_hash_otherwise() {
        let spec = |ns: &str, vm: &str, iface: &str| json!({"key": {"namespace": ns, "vm": vm, "interface": iface}});
        assert_eq!(name(Class::Vms, "default/vm-a/eth0"), "default.vm-a.eth0");
        assert_eq!(
            name(Class::Vms, "default/claim-a/:ipamclaim"),
            "default.claim-a"
        );
        // A capital letter, a dot, a namespace too long for a label.
        let long = format!("default/{}/eth0", "v".repeat(64));
        let hashed = ["default/vm-a/Net1", "default/vm.a/eth0", long.as_str()];
        let mut names = std::collections::BTreeSet::new();
        for suffix in hashed {
            let n = name(Class::Vms, suffix);
            assert!(n.starts_with("x-") && n.len() == 42, "{n}");
            names.insert(n);
        }
        assert_eq!(names.len(), 3, "distinct keys, distinct names");
        // An interface named like the claims' marker and the claim's key
        // never share an object: three parts against two.
        assert_eq!(
            name(Class::Vms, "default/claim-a/ipamclaim"),
            "default.claim-a.ipamclaim"
        );
        // The key comes back from the spec, and only under its own name.
        assert_eq!(
            Class::Vms
                .suffix_of("default.vm-a.eth0", &spec("default", "vm-a", "eth0"))
                .as_deref(),
            Some("default/vm-a/eth0")
        );
        assert_eq!(
            Class::Vms.suffix_of("default.vm-b.eth0", &spec("default", "vm-a", "eth0")),
            None,
            "a record under another VM's name is not read as either"
        );
        assert_eq!(Class::Vms.suffix_of("x", &json!({"key": 5})), None);
    }

    #[test]
    fn keys_that_cannot_name_one_object_are_refused() {
        for (class, suffix) in [
            (Class::Nodes, "Node_1"),
            (Class::Nodes, &"a".repeat(250)),
            (Class::NodeIds, "017"),
            (Class::NodeIds, "x"),
            (Class::Blocks, "v4/10.244.0.64"),
            (Class::Blocks, "v6/10.244.0.64-26"),
            (Class::Blocks, "v6/FD00::-64"),
            (Class::VmAddrs, "fd00::0:5"),
            (Class::VmMacs, "0A:58:0a:f4:01:05"),
            (Class::Vms, "ns/vm"),
        ] {
            assert!(class.name_of(suffix).is_err(), "{class:?} {suffix}");
        }
        // Names that no key maps to are not read as one.
        assert_eq!(Class::Blocks.suffix_of("10.244.0.64", &Value::Null), None);
        assert_eq!(Class::NodeIds.suffix_of("007", &Value::Null), None);
        assert_eq!(Class::VmMacs.suffix_of("mac-zz", &Value::Null), None);
        assert_eq!(Class::Alive.suffix_of("kube-scheduler", &Value::Null), None);
    }

    #[test]
    fn values_are_specs_and_back() {
        let block = br#"{"cidr":"10.244.0.0/26","node":"a","node_id":1,"claimed_unix_ms":5}"#;
        let spec = Class::Blocks
            .spec_of(block)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(spec["node"], "a");
        let back = Class::Blocks.value_of(&spec).unwrap_or_default();
        assert_eq!(
            serde_json::from_slice::<Value>(&back).ok(),
            serde_json::from_slice::<Value>(block).ok()
        );
        let id = Class::NodeIds
            .spec_of(b"node-1")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(id, json!({"node": "node-1"}));
        assert_eq!(
            Class::NodeIds.value_of(&id).as_deref(),
            Some(&b"node-1"[..])
        );
        assert!(Class::Nodes.spec_of(b"not json").is_err());
        assert!(Class::Nodes.spec_of(b"[1]").is_err());
        assert_eq!(Class::NodeIds.value_of(&json!({"node": 5})), None);
        assert_eq!(Class::Nodes.value_of(&json!("x")), None);
    }

    #[test]
    fn a_key_splits_into_its_class_and_part() {
        let ks = Keyspace::new("/tether/v1/");
        assert_eq!(
            ks.split("/tether/v1/blocks/v4/10.244.0.0-26"),
            Some((Class::Blocks, "v4/10.244.0.0-26"))
        );
        assert_eq!(ks.split("/tether/v1/vms/"), Some((Class::Vms, "")));
        assert_eq!(ks.split("/tether/v1/"), None);
        assert_eq!(ks.split("/tether/v1/other/x"), None);
        assert_eq!(ks.key(Class::Nodes, "a"), "/tether/v1/nodes/a");
    }
}
