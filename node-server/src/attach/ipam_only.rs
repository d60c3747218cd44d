//! Named pools in an ADD, and IPAM-only attachments: tether run as another
//! plugin's `ipam` (macvlan, bridge, ipvlan...). Such an attachment is an
//! address record only: the store holds it like any attachment, so DEL,
//! GC, a restart and a reboot treat it as they treat a pod, and nothing of
//! it is in the kernel for tether to wire, route, check or remove.

use super::{blocking, key_of, Node};
use ipnet::IpNet;
use std::net::IpAddr;
use std::path::Path;
use tether_base::error::{Error, Result};
use tether_base::sync::lock;
use tether_base::time::UnixNanos;
use tether_cni::config::ResultRoute;
use tether_cni::Invocation;
use tether_ipam::Family;
use tether_store::store::Attachment;

impl Node {
    /// The addresses of an attachment that selects named pools: per pool,
    /// the requested address of its family, or one from the pool. All or
    /// nothing.
    pub(crate) async fn named_addresses(
        &self,
        pools: &[String],
        requested: &[IpAddr],
    ) -> Result<Vec<IpAddr>> {
        let mut defs = Vec::with_capacity(pools.len());
        for name in pools {
            let def = self
                .named
                .def(name)
                .ok_or_else(|| self.named.unknown(name))?;
            if defs
                .iter()
                .any(|d: &crate::pools::PoolDef| d.family() == def.family())
            {
                return Err(Error::InvalidConfig(format!(
                    "pools {} are both {}: select one pool per family",
                    pools.join(" and "),
                    def.family().name()
                )));
            }
            defs.push(def);
        }
        if let Some(ip) = requested
            .iter()
            .find(|ip| !defs.iter().any(|d| d.family() == Family::of_ip(**ip)))
        {
            return Err(Error::AddressNotInPool(format!(
                "{ip} was requested, but no selected pool ({}) is of its family",
                pools.join(", ")
            )));
        }
        let mut got: Vec<IpAddr> = Vec::with_capacity(defs.len());
        for def in &defs {
            let one = match requested
                .iter()
                .find(|ip| Family::of_ip(**ip) == def.family())
            {
                Some(&ip) => self.named.take(&def.name, ip).await.map(|()| ip),
                None => self.named.allocate(&def.name).await,
            };
            match one {
                Ok(ip) => got.push(ip),
                Err(e) => {
                    self.named.release(&got);
                    return Err(e);
                }
            }
        }
        Ok(got)
    }

    /// ADD of tether as another plugin's IPAM.
    pub(crate) async fn add_ipam_only(&self, inv: &Invocation) -> Result<Vec<u8>> {
        let started = UnixNanos::now();
        let key = key_of(inv);
        let netns = inv.netns.clone().ok_or_else(|| Error::InvalidEnv {
            var: "CNI_NETNS",
            reason: "required for ADD".into(),
        })?;
        let pools = tether_cni::pools(inv)?;
        if pools.is_empty() {
            return Err(Error::InvalidConfig(format!(
                "tether as IPAM needs ipam.pool, or the pod annotation {}.{}, naming a pool of the daemon's --pools",
                tether_cni::POOL_ANNOTATION,
                inv.conf.name
            )));
        }
        let requested = tether_cni::requested(inv)?;
        let _sweep = self.sweep.read().await;
        let _key = self.lock_key(&key).await;
        let existing = lock(&self.attachments).get(&key).cloned();
        if let Some(a) = existing {
            if Path::new(&a.netns) != netns {
                return Err(Error::AttachmentConflict(format!(
                    "{} already has addresses for {}, not {}",
                    a.key,
                    a.netns,
                    netns.display()
                )));
            }
            return self.ipam_result(inv, &a);
        }
        let ips = self.named_addresses(&pools, &requested.ips).await?;
        let attachment = Attachment {
            key: key.clone(),
            netns: netns.display().to_string(),
            mac: tether_kernel::pod_mac(&ips),
            ips: ips.clone(),
            host_ifname: String::new(),
            mtu: 0,
            created_unix_nanos: started,
            pod_namespace: inv.args.pod_namespace.clone(),
            pod_name: inv.args.pod_name.clone(),
            pod_uid: inv.args.pod_uid.clone(),
            vm: None,
            guest: None,
            pools,
            ipam_only: true,
        };
        let result = match self.ipam_result(inv, &attachment) {
            Ok(r) => r,
            Err(e) => {
                self.named.release(&ips);
                return Err(e);
            }
        };
        let store = self.store.clone();
        let record = attachment.clone();
        if let Err(e) = blocking(move || store.insert(&record)).await {
            self.named.release(&ips);
            return Err(e);
        }
        lock(&self.attachments).insert(key, attachment);
        Ok(result)
    }

    /// The IPAM result of an attachment: each address with its pool's
    /// prefix and gateway, the pools' routes and the `ipam` section's,
    /// and DNS.
    fn ipam_result(&self, inv: &Invocation, a: &Attachment) -> Result<Vec<u8>> {
        let mut leased = tether_cni::Leased {
            ips: Vec::with_capacity(a.ips.len()),
            routes: Vec::new(),
            dns: None,
        };
        for &ip in &a.ips {
            let def = self.named.pool_of(ip).and_then(|n| self.named.def(&n));
            match def {
                Some(d) => {
                    let net = IpNet::new(ip, d.cidr.prefix_len())
                        .map_err(|e| Error::Internal(e.to_string()))?;
                    leased.ips.push((net, d.gateway));
                    leased.routes.extend(d.routes.iter().map(|r| ResultRoute {
                        dst: r.dst,
                        gw: r.gw.or(d.gateway),
                    }));
                    if leased.dns.is_none() {
                        leased.dns = d.dns.clone();
                    }
                }
                // Its pool left the file: the address alone.
                None => leased.ips.push((IpNet::from(ip), None)),
            }
        }
        if let Some(conf) = &inv.conf.ipam {
            leased.routes.extend(conf.routes.iter().cloned());
            if conf.dns.is_some() {
                leased.dns = conf.dns.clone();
            }
        }
        tether_cni::render_ipam_result(&inv.conf, &leased)
    }
}
