//! Admin calls on VM records: reserving addresses before a VM's first
//! pod, and releasing a VM's addresses.

use super::placement::join;
use super::records::{CreateRefused, Origin, VmAttachment, VmRecord};
use super::{NodeSide, Vms};
use std::net::IpAddr;
use tether_base::error::{Error, Result};
use tether_base::keys::VmKey;
use tether_base::mac::Mac;
use tether_base::time::UnixMillis;
use tether_ipam::Family;

impl Vms {
    /// Admin: reserves addresses (and a MAC) for a VM before its first pod,
    /// e.g. for a VM imported from another platform that must keep them.
    pub async fn reserve<N: NodeSide>(
        &self,
        side: &N,
        key: VmKey,
        ips: Vec<IpAddr>,
        mac: Option<String>,
    ) -> Result<VmRecord> {
        if ips.is_empty() {
            return Err(Error::InvalidConfig(
                "a reservation needs at least one address".into(),
            ));
        }
        for f in [Family::V4, Family::V6] {
            if ips.iter().filter(|ip| Family::of_ip(**ip) == f).count() > 1 {
                return Err(Error::InvalidConfig(format!(
                    "more than one {} address: a VM interface gets one per family",
                    f.name()
                )));
            }
        }
        let mac = match mac.as_deref().filter(|m| !m.is_empty()) {
            Some(m) => Mac::parse_pod(m, "mac")?,
            None => tether_kernel::pod_mac(&ips),
        };
        if let Some((rec, _)) = self.records.read(&key).await? {
            let (mut want, mut have) = (ips.clone(), rec.ips.clone());
            want.sort();
            have.sort();
            if want == have && rec.mac == mac {
                return Ok(rec);
            }
            return Err(Error::VmState(format!(
                "VM {key} already holds {} ({}); release it first",
                join(&rec.ips),
                rec.mac
            )));
        }
        side.check_mac_free(mac, Some(&key))?;
        side.take_requested(&ips).await?;
        let rec = VmRecord {
            key: key.clone(),
            ips: ips.clone(),
            mac,
            origin: Origin::Reserved,
            active: None,
            alternate: None,
            generation: 1,
            created_unix_ms: UnixMillis::now(),
            last_cutover: None,
        };
        match self.records.create(&rec).await {
            Ok(Ok(rev)) => {
                self.mark_held(side, &ips, rev);
                tracing::info!(vm = %key, ?ips, mac = %rec.mac, "reserved a VM address");
                Ok(rec)
            }
            Ok(Err(CreateRefused::Exists)) => {
                self.free_ips(side, &ips);
                Err(Error::VmState(format!(
                    "VM {key} got a record meanwhile; look at it and try again"
                )))
            }
            Ok(Err(CreateRefused::Taken { what, holder })) => {
                self.free_ips(side, &ips);
                Err(Error::AddressInUse(format!(
                    "{what} is held by VM {holder}"
                )))
            }
            Err(e) => {
                self.free_ips(side, &ips);
                Err(e)
            }
        }
    }

    /// Admin: frees a VM's addresses. Refused while the record names pods,
    /// unless `force`.
    pub async fn release(&self, key: &VmKey, force: bool) -> Result<VmRecord> {
        let (rec, rev) = self
            .records
            .read(key)
            .await?
            .ok_or_else(|| Error::UnknownVm(key.to_string()))?;
        let pods: Vec<String> = rec.attachments().map(VmAttachment::describe).collect();
        if !pods.is_empty() && !force {
            return Err(Error::VmState(format!(
                "VM {key} still has {}; delete its pods first, or force",
                pods.join(" and ")
            )));
        }
        match self.records.delete(&rec, rev).await? {
            Some(_) => {
                tracing::info!(vm = %key, ips = ?rec.ips, force, "released a VM's address");
                Ok(rec)
            }
            None => Err(Error::TryAgain(format!(
                "the record of VM {key} changed meanwhile; look at it and try again"
            ))),
        }
    }
}
