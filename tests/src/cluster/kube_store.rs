//! The Kubernetes store's objects read as the etcd keys they stand for,
//! so that the suites check one layout on both stores.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv6Addr};

use ipnet::IpNet;
use serde_json::Value;

use crate::kube::{KubeApi, TETHER_SA};

/// The selector of tether's node Leases.
const LEASES: &str = "app.kubernetes.io/managed-by=tetherd,app.kubernetes.io/component=node-lease";

/// Every tether object of `api`, keyed as etcd keys the record.
pub fn records(api: &KubeApi) -> BTreeMap<String, String> {
    let kinds = "tethernodes,tethernodeids,addressblocks,poolblocks,vmaddresses,vmaddressowners";
    let list: Value = serde_json::from_str(&api.kubectl_ok(&["get", kinds, "-o", "json"]))
        .expect("kubectl printed JSON");
    let mut keys = BTreeMap::new();
    for item in list["items"].as_array().into_iter().flatten() {
        let name = item["metadata"]["name"].as_str().unwrap_or_default();
        let spec = &item["spec"];
        let json = spec.to_string();
        let (key, value) = match item["kind"].as_str().unwrap_or_default() {
            "TetherNode" => (format!("nodes/{name}"), json),
            "TetherNodeID" => (
                format!("nodeids/{name}"),
                spec["node"].as_str().unwrap_or_default().to_owned(),
            ),
            "AddressBlock" => (format!("blocks/{}", block(spec)), json),
            "PoolBlock" => (format!("poolblocks/{}", block(spec)), json),
            "VMAddress" => {
                let k = &spec["key"];
                let part = |f: &str| k[f].as_str().unwrap_or_default().to_owned();
                (
                    format!(
                        "vms/{}/{}/{}",
                        part("namespace"),
                        part("vm"),
                        part("interface")
                    ),
                    json,
                )
            }
            "VMAddressOwner" => match (name.strip_prefix("ip-"), name.strip_prefix("mac-")) {
                (Some(ip), _) => (format!("vmaddrs/{}", ip_of_name(ip)), json),
                (_, Some(mac)) => (format!("vmmacs/{}", mac.replace('-', ":")), json),
                _ => panic!("a VMAddressOwner named {name}"),
            },
            other => panic!("unexpected kind {other}"),
        };
        keys.insert(format!("/tether/v1/{key}"), value);
    }
    let leases: Value = serde_json::from_str(&api.kubectl_ok(&[
        "-n",
        TETHER_SA.0,
        "get",
        "leases",
        "-l",
        LEASES,
        "-o",
        "json",
    ]))
    .expect("kubectl printed JSON");
    for lease in leases["items"].as_array().into_iter().flatten() {
        let holder = lease["spec"]["holderIdentity"].as_str().unwrap_or_default();
        let renewed = lease["spec"]["renewTime"].as_str().unwrap_or_default();
        keys.insert(format!("/tether/v1/alive/{holder}"), renewed.to_owned());
    }
    keys
}

/// `v4/<net>-<len>` of a block's spec.
fn block(spec: &Value) -> String {
    let cidr: IpNet = spec["cidr"]
        .as_str()
        .unwrap_or_default()
        .parse()
        .unwrap_or_else(|e| panic!("a block's cidr: {e}: {spec}"));
    let family = if cidr.addr().is_ipv4() { "v4" } else { "v6" };
    format!("{family}/{}-{}", cidr.network(), cidr.prefix_len())
}

/// An address from its part of a name: IPv4 dotted, IPv6 groups joined by
/// '-'.
fn ip_of_name(name: &str) -> IpAddr {
    if name.contains('.') {
        return name.parse().unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    let groups: Vec<u16> = name
        .split('-')
        .map(|g| u16::from_str_radix(g, 16).unwrap_or_else(|e| panic!("{name}: {e}")))
        .collect();
    let groups: [u16; 8] = groups
        .try_into()
        .unwrap_or_else(|_| panic!("{name}: not eight groups"));
    IpAddr::V6(Ipv6Addr::from(groups))
}
