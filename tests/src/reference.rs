//! Netconfs for Debian's reference plugins, the yardstick tether is
//! compared with. They create their host-side objects in the netns they
//! run in, so call them from a node netns ([`crate::Netns::run`]).

use std::net::IpAddr;
use std::path::Path;

use serde_json::{json, Value};

/// A `ptp` netconf with `host-local` IPAM on `subnet`, keeping its leases
/// under `data_dir` (never the machine's `/var/lib/cni`). No masquerade.
pub fn ptp_netconf(name: &str, subnet: &str, data_dir: &Path) -> Value {
    json!({
        "cniVersion": "1.0.0",
        "name": name,
        "type": "ptp",
        "ipMasq": false,
        "ipam": host_local(subnet, data_dir),
    })
}

/// A `bridge` netconf on bridge `bridge` (name it with the run prefix),
/// gateway on the bridge, `host-local` IPAM on `subnet` with leases under
/// `data_dir`. No masquerade.
pub fn bridge_netconf(name: &str, bridge: &str, subnet: &str, data_dir: &Path) -> Value {
    json!({
        "cniVersion": "1.0.0",
        "name": name,
        "type": "bridge",
        "bridge": bridge,
        "isGateway": true,
        "ipMasq": false,
        "ipam": host_local(subnet, data_dir),
    })
}

fn host_local(subnet: &str, data_dir: &Path) -> Value {
    json!({
        "type": "host-local",
        "subnet": subnet,
        "dataDir": data_dir.display().to_string(),
    })
}

/// The addresses `host-local` holds for network `name` in `data_dir`: one
/// file per lease, named by the address (its lock and last-reserved files
/// are not leases).
pub fn host_local_leases(data_dir: &Path, name: &str) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(data_dir.join(name)) else {
        return Vec::new();
    };
    let mut leases: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|f| f.parse::<IpAddr>().is_ok())
        .collect();
    leases.sort();
    leases
}
