//! What an ADD asks for beyond an address of each family: the addresses
//! and MAC requested through CNI_ARGS (`IP=`, `MAC=`) or runtimeConfig
//! (`ips`, `mac`), and the KubeVirt VM a pod belongs to. Parsed here, once,
//! into typed values; the node only ever sees those.

use super::Invocation;
use serde_json::Value;
use std::net::IpAddr;
use tether_base::error::{Error, Result};
use tether_base::guest::{
    self, BindingKind, DhcpOptions, GuestNet, TapSpec, BINDING_ANNOTATION, MAX_QUEUES,
    QUEUES_ANNOTATION,
};
use tether_base::keys::ClaimRef;
use tether_base::keys::VmKey;
use tether_base::kubevirt::{DOMAIN_ANNOTATION, MIGRATION_JOB_ANNOTATION, TARGET_READY_ANNOTATION};
use tether_base::mac::Mac;
use tether_base::net::Family;

/// A VM pod as its ADD describes it.
#[derive(Debug, Clone)]
pub struct VmPod {
    /// (namespace, VM, interface).
    pub key: VmKey,
    /// The VM's name (`kubevirt.io/domain`: its VirtualMachineInstance's),
    /// whatever keys its addresses.
    pub domain: String,
    /// The pod is a migration's target (`kubevirt.io/migrationJobName`).
    pub target: bool,
    /// The target pod is marked ready
    /// (`kubevirt.io/migration-target-ready-timestamp`).
    pub ready: bool,
    /// How its guest is connected, for the `tap` and `managedTap`
    /// bindings; `None` for an ordinary veth.
    pub guest: Option<GuestNet>,
    /// The IPAMClaim its network-selection element references: the VM's
    /// addresses are then keyed by the claim ([`VmKey::claim`]).
    pub claim: Option<ClaimRef>,
}

/// The annotation of a pod's secondary networks (Multus): a JSON list of
/// network-selection elements.
pub const NETWORKS_ANNOTATION: &str = "k8s.v1.cni.cncf.io/networks";
/// The annotation of a pod's primary network element (Multus; KubeVirt's
/// ipam-extensions writes it for the primary network).
pub const DEFAULT_NETWORK_ANNOTATION: &str = "v1.multus-cni.io/default-network";

/// Reads the VM identity from the pod annotations of `runtimeConfig`.
/// `None` for a pod that is not a KubeVirt VM pod.
pub fn vm_pod(inv: &Invocation) -> Result<Option<VmPod>> {
    let ann = &inv.conf.runtime_config.pod_annotations;
    let Some(domain) = ann.get(DOMAIN_ANNOTATION).filter(|d| !d.is_empty()) else {
        return Ok(None);
    };
    let namespace = inv
        .args
        .pod_namespace
        .as_deref()
        .ok_or_else(|| Error::InvalidEnv {
            var: "CNI_ARGS",
            reason: format!(
                "the pod of KubeVirt VM {domain:?} ({DOMAIN_ANNOTATION}) has no K8S_POD_NAMESPACE, \
                 which keys the VM's address record"
            ),
        })?;
    let set = |name: &str| ann.get(name).is_some_and(|v| !v.is_empty());
    let claim = claim_reference(inv).map(|name| ClaimRef {
        namespace: namespace.to_owned(),
        name,
    });
    let key = match &claim {
        Some(c) => c.key()?,
        None => VmKey::new(namespace, domain, &inv.ifname)?,
    };
    let mut guest = guest_net(inv)?;
    if let Some(g) = guest.as_mut() {
        g.dhcp.hostname = Some(domain.to_owned());
    }
    Ok(Some(VmPod {
        key,
        domain: domain.to_owned(),
        target: set(MIGRATION_JOB_ANNOTATION),
        ready: set(TARGET_READY_ANNOTATION),
        guest,
        claim,
    }))
}

/// The `ipam-claim-reference` of this attachment's network-selection
/// element: for `eth0`, the primary network's element
/// ([`DEFAULT_NETWORK_ANNOTATION`]); otherwise the element of
/// [`NETWORKS_ANNOTATION`] that names this network (by the netconf's
/// `name`) and, if it names one, this interface. An annotation that is
/// not a JSON list (Multus also takes "net1,net2") references no claim.
pub fn claim_reference(inv: &Invocation) -> Option<String> {
    let ann = &inv.conf.runtime_config.pod_annotations;
    let elements = |key: &str| -> Vec<Value> {
        ann.get(key)
            .and_then(|v| serde_json::from_str::<Value>(v).ok())
            .map(|v| match v {
                Value::Array(list) => list,
                one @ Value::Object(_) => vec![one],
                _ => Vec::new(),
            })
            .unwrap_or_default()
    };
    let claim_of = |e: &Value| {
        e.get(tether_base::kubevirt::NSE_CLAIM_KEY)
            .and_then(Value::as_str)
            .filter(|c| !c.is_empty())
            .map(str::to_owned)
    };
    if inv.ifname == "eth0" {
        if let Some(c) = elements(DEFAULT_NETWORK_ANNOTATION)
            .first()
            .and_then(claim_of)
        {
            return Some(c);
        }
    }
    elements(NETWORKS_ANNOTATION)
        .iter()
        .filter(|e| {
            let name = e.get("name").and_then(Value::as_str).unwrap_or("");
            let name = name.rsplit('/').next().unwrap_or(name);
            name == inv.conf.name
                && e.get("interface")
                    .and_then(Value::as_str)
                    .is_none_or(|i| i == inv.ifname)
        })
        .find_map(claim_of)
}

/// The guest connection of a VM pod: the netconf's `kubevirt` settings,
/// overridden for this pod by its annotations.
fn guest_net(inv: &Invocation) -> Result<Option<GuestNet>> {
    let conf = &inv.conf.kubevirt;
    let ann = &inv.conf.runtime_config.pod_annotations;
    let binding = match ann.get(BINDING_ANNOTATION) {
        None => conf.binding,
        Some(v) => BindingKind::parse(v).ok_or_else(|| {
            Error::InvalidConfig(format!(
                "pod annotation {BINDING_ANNOTATION}={v:?} must be \"veth\", \"tap\" or \"managedTap\""
            ))
        })?,
    };
    let queues = match ann.get(QUEUES_ANNOTATION) {
        None => conf.tap_queues,
        Some(v) => v
            .parse::<u16>()
            .ok()
            .filter(|q| (1..=MAX_QUEUES).contains(q))
            .ok_or_else(|| {
                Error::InvalidConfig(format!(
                    "pod annotation {QUEUES_ANNOTATION}={v:?} must be a number from 1 to {MAX_QUEUES}"
                ))
            })?,
    };
    let tap = match binding {
        BindingKind::Veth => return Ok(None),
        BindingKind::ManagedTap => None,
        BindingKind::Tap => Some(TapSpec {
            name: guest::tap_name(&inv.ifname)?,
            queues,
            owner: conf.tap_owner,
            group: conf.tap_group,
        }),
    };
    Ok(Some(GuestNet {
        tap,
        dhcp: dhcp_options(inv.conf.dns.as_ref(), conf.lease_seconds)?,
    }))
}

/// The DHCP options of the netconf's `dns` object (already checked to hold
/// lists of strings): its nameservers must be addresses, since a guest is
/// given them as such.
fn dhcp_options(dns: Option<&Value>, lease_seconds: u32) -> Result<DhcpOptions> {
    let strings = |key: &str| -> Vec<String> {
        dns.and_then(|d| d.get(key))
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    };
    let dns_servers = strings("nameservers")
        .iter()
        .map(|s| {
            s.parse::<IpAddr>().map_err(|_| {
                Error::InvalidConfig(format!(
                    "dns.nameservers: {s:?} is not an IP address, which a VM's DHCP answer needs"
                ))
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let mut search = strings("search");
    if search.is_empty() {
        if let Some(domain) = dns.and_then(|d| d.get("domain")).and_then(Value::as_str) {
            search.push(domain.to_owned());
        }
    }
    Ok(DhcpOptions {
        lease_seconds,
        dns: dns_servers,
        search,
        hostname: None,
    })
}

/// Addresses and a MAC asked for by the runtime.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Requested {
    /// At most one per family.
    pub ips: Vec<IpAddr>,
    /// The pod interface MAC.
    pub mac: Option<Mac>,
}

/// The addresses and MAC of CNI_ARGS `IP=`/`MAC=` and `runtimeConfig`
/// `ips`/`mac`. Both sources may be given if they agree.
pub fn requested(inv: &Invocation) -> Result<Requested> {
    let from_args = inv.args.ip.clone();
    let rc = &inv.conf.runtime_config;
    let from_rc = rc.ips.clone();
    let ips = match (from_args.is_empty(), from_rc.is_empty()) {
        (true, _) => from_rc,
        (false, true) => from_args,
        (false, false) => {
            let (mut a, mut b) = (from_args.clone(), from_rc.clone());
            a.sort();
            b.sort();
            if a != b {
                return Err(Error::InvalidConfig(format!(
                    "CNI_ARGS IP={} and runtimeConfig.ips [{}] ask for different addresses",
                    join(&inv.args.ip),
                    join(&rc.ips)
                )));
            }
            from_rc
        }
    };
    for f in [Family::V4, Family::V6] {
        if ips.iter().filter(|ip| Family::of_ip(**ip) == f).count() > 1 {
            return Err(Error::InvalidConfig(format!(
                "more than one {} address requested: a pod gets one per family",
                f.name()
            )));
        }
    }
    let macs: Vec<Mac> = [
        inv.args.mac.as_ref().map(|m| m.for_pod("CNI_ARGS MAC")),
        rc.mac.as_ref().map(|m| m.for_pod("runtimeConfig.mac")),
    ]
    .into_iter()
    .flatten()
    .collect::<Result<_>>()?;
    if macs.len() == 2 && macs[0] != macs[1] {
        return Err(Error::InvalidConfig(
            "CNI_ARGS MAC and runtimeConfig.mac ask for different MACs".into(),
        ));
    }
    Ok(Requested {
        ips,
        mac: macs.first().copied(),
    })
}

fn join(ips: &[IpAddr]) -> String {
    ips.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// The pod annotation that selects its named pools (one name, or two
/// separated by a comma) on tether's own network. `<this>.<network>`
/// selects them on that network only, IPAM-only networks included.
pub const POOL_ANNOTATION: &str = "tether.dev/pool";

/// The named pools the attachment's addresses come from: the pod's
/// annotation for this network, else its annotation for tether's own
/// network (not for IPAM-only ones: one annotation must not move a pod's
/// secondary networks into its primary's pool), else the configuration's
/// `pool`. Empty: the node's pod CIDRs.
pub fn pools(inv: &Invocation) -> Result<Vec<String>> {
    let ann = &inv.conf.runtime_config.pod_annotations;
    let specific = format!("{POOL_ANNOTATION}.{}", inv.conf.name);
    let chosen = ann
        .get(&specific)
        .map(|v| (specific.as_str(), v))
        .or_else(|| {
            ann.get(POOL_ANNOTATION)
                .filter(|_| inv.conf.ipam.is_none())
                .map(|v| (POOL_ANNOTATION, v))
        });
    match chosen {
        None => Ok(inv.conf.pools.clone()),
        Some((key, v)) => {
            let names: Vec<Value> = v
                .split(',')
                .map(|n| Value::String(n.trim().to_owned()))
                .collect();
            super::config::parse_pools(&format!("pod annotation {key}"), &Value::Array(names))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse_request;
    use serde_json::json;
    use tether_proto::cni::v1::CniRequest;
    use tether_proto::cni::FORWARDED_VARIABLES;

    fn inv(args: &str, rc: serde_json::Value) -> Invocation {
        inv_of(
            args,
            json!({"cniVersion": "1.1.0", "name": "n", "type": "tether", "runtimeConfig": rc}),
        )
    }

    fn inv_of(args: &str, conf: serde_json::Value) -> Invocation {
        parse_request(&CniRequest {
            command: "ADD".into(),
            container_id: "c1".into(),
            netns: "/run/netns/p".into(),
            ifname: "eth0".into(),
            args: args.into(),
            path: "/opt/cni/bin".into(),
            stdin: conf.to_string().into_bytes(),
            present: FORWARDED_VARIABLES.iter().map(|s| s.to_string()).collect(),
            plugin_name: String::new(),
        })
        .expect("a valid request")
    }

    fn ips(list: &[&str]) -> Vec<IpAddr> {
        list.iter().map(|s| s.parse().unwrap()).collect()
    }

    #[test]
    fn requested_addresses_come_from_either_source_if_they_agree() {
        let r = requested(&inv("IP=10.1.0.5,fd00::5", json!({}))).unwrap();
        assert_eq!(r.ips, ips(&["10.1.0.5", "fd00::5"]));
        let r = requested(&inv("", json!({"ips": ["fd00::5/64", "10.1.0.5/24"]}))).unwrap();
        assert_eq!(r.ips, ips(&["fd00::5", "10.1.0.5"]));
        let r = requested(&inv("IP=10.1.0.5", json!({"ips": ["10.1.0.5/32"]}))).unwrap();
        assert_eq!(r.ips, ips(&["10.1.0.5"]));
        let err = requested(&inv("IP=10.1.0.5", json!({"ips": ["10.1.0.6"]}))).unwrap_err();
        assert_eq!(err.code(), 7);
        assert!(
            err.to_string()
                .contains("IP=10.1.0.5 and runtimeConfig.ips [10.1.0.6]"),
            "{err}"
        );
        let err = requested(&inv("IP=10.1.0.5,10.1.0.6", json!({}))).unwrap_err();
        assert!(
            err.to_string().contains("more than one IPv4 address"),
            "{err}"
        );
        assert_eq!(
            requested(&inv("", json!({}))).unwrap(),
            Requested::default()
        );
    }

    #[test]
    fn requested_macs_must_agree_and_suit_a_pod() {
        let r = requested(&inv(
            "MAC=0a:58:0a:01:00:05",
            json!({"mac": "0A:58:0A:01:00:05"}),
        ))
        .unwrap();
        assert_eq!(r.mac, Some("0a:58:0a:01:00:05".parse().unwrap()));
        let err = requested(&inv(
            "MAC=0a:58:0a:01:00:05",
            json!({"mac": "0a:58:0a:01:00:06"}),
        ))
        .unwrap_err();
        assert_eq!(err.code(), 7);
        let err = requested(&inv("MAC=01:00:5e:00:00:01", json!({}))).unwrap_err();
        assert!(err.to_string().contains("multicast"), "{err}");
    }

    #[test]
    fn a_claim_reference_keys_the_vm_by_its_claim() {
        let ann = |a: serde_json::Value| json!({"io.kubernetes.cri.pod-annotations": a});
        let nse = |list: serde_json::Value| list.to_string();
        let args = "K8S_POD_NAMESPACE=vms;K8S_POD_NAME=virt-launcher-vm1-a";
        // The primary network's element (eth0).
        let pod = vm_pod(&inv(
            args,
            ann(json!({
                DOMAIN_ANNOTATION: "vm1",
                DEFAULT_NETWORK_ANNOTATION: nse(json!([{"name": "n", "ipam-claim-reference": "vm1.default"}])),
            })),
        ))
        .unwrap()
        .unwrap();
        assert_eq!(pod.key, VmKey::claim("vms", "vm1.default").unwrap());
        assert_eq!(pod.key.claim_name(), Some("vm1.default"));
        assert_eq!(
            pod.claim,
            Some(ClaimRef {
                namespace: "vms".into(),
                name: "vm1.default".into()
            })
        );
        // Without one, the VM and interface key it, as before.
        let pod = vm_pod(&inv(args, ann(json!({DOMAIN_ANNOTATION: "vm1"}))))
            .unwrap()
            .unwrap();
        assert_eq!(pod.key, VmKey::new("vms", "vm1", "eth0").unwrap());
        assert_eq!(pod.claim, None);
    }

    #[test]
    fn secondary_network_elements_match_by_network_and_interface() {
        let call = |ifname: &str, networks: &str| {
            let mut i = inv_of(
                "",
                json!({"cniVersion": "1.1.0", "name": "blue", "type": "tether",
                       "runtimeConfig": {"io.kubernetes.cri.pod-annotations":
                           {NETWORKS_ANNOTATION: networks}}}),
            );
            i.ifname = ifname.into();
            claim_reference(&i)
        };
        let list = json!([
            {"name": "red", "ipam-claim-reference": "vm1.red"},
            {"name": "vms/blue", "interface": "pod1234", "ipam-claim-reference": "vm1.blue"},
        ])
        .to_string();
        assert_eq!(call("pod1234", &list).as_deref(), Some("vm1.blue"));
        assert_eq!(call("pod9999", &list), None, "another interface");
        // Multus's short form names networks and no claim.
        assert_eq!(call("net1", "blue,red"), None);
        assert_eq!(call("net1", "not json ["), None);
    }

    #[test]
    fn pools_come_from_the_annotation_for_this_network_first() {
        let ann = |a: serde_json::Value| json!({"io.kubernetes.cri.pod-annotations": a});
        let main = |rc: serde_json::Value| {
            inv_of(
                "",
                json!({"cniVersion": "1.1.0", "name": "n", "type": "tether", "pool": "conf",
                       "runtimeConfig": rc}),
            )
        };
        let ipam = |rc: serde_json::Value| {
            inv_of(
                "",
                json!({"cniVersion": "1.1.0", "name": "mig", "type": "macvlan",
                       "ipam": {"type": "tether", "pool": "conf"}, "runtimeConfig": rc}),
            )
        };
        assert_eq!(pools(&main(json!({}))).unwrap(), ["conf"]);
        assert_eq!(
            pools(&main(ann(json!({POOL_ANNOTATION: "a"})))).unwrap(),
            ["a"]
        );
        assert_eq!(
            pools(&main(ann(
                json!({POOL_ANNOTATION: "a", "tether.dev/pool.n": "b4, b6"})
            )))
            .unwrap(),
            ["b4", "b6"]
        );
        // The plain annotation is the primary network's only.
        assert_eq!(
            pools(&ipam(ann(json!({POOL_ANNOTATION: "a"})))).unwrap(),
            ["conf"]
        );
        assert_eq!(
            pools(&ipam(ann(json!({"tether.dev/pool.mig": "m"})))).unwrap(),
            ["m"]
        );
        let err = pools(&main(ann(json!({POOL_ANNOTATION: "bad name"})))).unwrap_err();
        assert_eq!(err.code(), 7);
        assert!(
            err.to_string().contains("pod annotation tether.dev/pool"),
            "{err}"
        );
    }
}
