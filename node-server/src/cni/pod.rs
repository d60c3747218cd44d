//! What an ADD asks for beyond an address of each family: the addresses
//! and MAC requested through CNI_ARGS (`IP=`, `MAC=`) or runtimeConfig
//! (`ips`, `mac`), and the KubeVirt VM a pod belongs to. Parsed here, once,
//! into typed values; the node only ever sees those.

use super::Invocation;
use crate::error::{Error, Result};
use crate::ipam::Family;
use crate::mac::Mac;
use crate::vm::{VmKey, DOMAIN_ANNOTATION, MIGRATION_JOB_ANNOTATION, TARGET_READY_ANNOTATION};
use ipnet::IpNet;
use std::net::IpAddr;

/// A VM pod as its ADD describes it.
#[derive(Debug, Clone)]
pub struct VmPod {
    /// (namespace, VM, interface).
    pub key: VmKey,
    /// The pod is a migration's target (`kubevirt.io/migrationJobName`).
    pub target: bool,
    /// The target pod is marked ready
    /// (`kubevirt.io/migration-target-ready-timestamp`).
    pub ready: bool,
}

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
    Ok(Some(VmPod {
        key: VmKey::new(namespace, domain, &inv.ifname)?,
        target: set(MIGRATION_JOB_ANNOTATION),
        ready: set(TARGET_READY_ANNOTATION),
    }))
}

/// Addresses and a MAC asked for by the runtime.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Requested {
    /// At most one per family.
    pub ips: Vec<IpAddr>,
    /// The pod interface MAC.
    pub mac: Option<Mac>,
}

/// Parses "10.1.2.3" or "10.1.2.3/24" (the prefix is the pod's business:
/// tether routes /32 and /128).
fn parse_ip(s: &str, what: &str) -> Result<IpAddr> {
    let s = s.trim();
    s.parse::<IpAddr>()
        .or_else(|_| s.parse::<IpNet>().map(|n| n.addr()))
        .map_err(|_| Error::InvalidConfig(format!("{what}: {s:?} is not an IP address")))
}

/// The addresses and MAC of CNI_ARGS `IP=`/`MAC=` and `runtimeConfig`
/// `ips`/`mac`. Both sources may be given if they agree.
pub fn requested(inv: &Invocation) -> Result<Requested> {
    let mut from_args = Vec::new();
    if let Some(list) = &inv.args.ip {
        for part in list.split(',').filter(|p| !p.is_empty()) {
            from_args.push(parse_ip(part, "CNI_ARGS IP")?);
        }
    }
    let rc = &inv.conf.runtime_config;
    let mut from_rc = Vec::new();
    for s in &rc.ips {
        from_rc.push(parse_ip(s, "runtimeConfig.ips")?);
    }
    let ips = match (from_args.is_empty(), from_rc.is_empty()) {
        (true, _) => from_rc,
        (false, true) => from_args,
        (false, false) => {
            let (mut a, mut b) = (from_args.clone(), from_rc.clone());
            a.sort();
            b.sort();
            if a != b {
                return Err(Error::InvalidConfig(format!(
                    "CNI_ARGS IP={} and runtimeConfig.ips {:?} ask for different addresses",
                    inv.args.ip.as_deref().unwrap_or_default(),
                    rc.ips
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_with_or_without_a_prefix() {
        assert_eq!(
            parse_ip("10.1.2.3", "x").unwrap(),
            "10.1.2.3".parse::<IpAddr>().unwrap()
        );
        assert_eq!(
            parse_ip("10.1.2.3/24", "x").unwrap(),
            "10.1.2.3".parse::<IpAddr>().unwrap()
        );
        assert_eq!(
            parse_ip("fd00::7/64", "x").unwrap(),
            "fd00::7".parse::<IpAddr>().unwrap()
        );
        assert!(parse_ip("10.1.2", "x").is_err());
    }
}
