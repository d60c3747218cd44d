//! tether's own objects, read the way the suites compare them: its host
//! veths (`tth` and 12 hex digits) and routes (protocol 201) in a node
//! netns, and what a dual-stack ADD hands back ([`AddResult`]).

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::Value;

use crate::{check, tether_bin, wait_until, CniOutput, Daemon, Netns};

/// The route protocol tether marks its node routes with.
pub const ROUTE_PROTOCOL: u8 = 201;

/// How long the daemon's background veth deletion (after DEL or GC replied)
/// may take: it is done well within this.
pub const LINK_SETTLE: Duration = Duration::from_secs(5);

/// True for a host veth name tether makes: `tth` and 12 hex digits.
pub fn is_tether_link(name: &str) -> bool {
    name.len() == 15 && name.starts_with("tth") && name[3..].chars().all(|c| c.is_ascii_hexdigit())
}

impl Netns {
    /// tether's host veths here (names passing [`is_tether_link`]).
    pub fn tether_links(&self) -> BTreeSet<String> {
        self.link_names()
            .into_iter()
            .filter(|n| is_tether_link(n))
            .collect()
    }

    /// tether's routes here ([`ROUTE_PROTOCOL`]), both families, as sorted
    /// (destination, device) pairs.
    pub fn tether_routes(&self) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = self
            .routes_with_protocol(ROUTE_PROTOCOL)
            .iter()
            .map(|r| {
                let field = |k: &str| r[k].as_str().unwrap_or_default().to_owned();
                (field("dst"), field("dev"))
            })
            .collect();
        out.sort();
        out
    }
}

/// Waits up to [`LINK_SETTLE`] until tether's host veths in `node` are
/// exactly those of `pods` (the others' background deletion done); panics
/// naming both sets if they are not by then.
pub fn assert_tether_links_settle<'a>(node: &Netns, pods: impl IntoIterator<Item = &'a AddResult>) {
    let want: BTreeSet<String> = pods.into_iter().map(|a| a.host.clone()).collect();
    let settled = wait_until(LINK_SETTLE, || node.tether_links() == want);
    assert!(
        settled,
        "tth links did not settle within {LINK_SETTLE:?}: have {:?}, want {want:?}",
        node.tether_links()
    );
}

/// What one successful dual-stack ADD handed back.
#[derive(Clone, Debug)]
pub struct AddResult {
    /// The IPv4 address, without its `/32`.
    pub v4: String,
    /// The IPv6 address, without its `/128`.
    pub v6: String,
    /// The node-side veth, `interfaces[0]` of the result.
    pub host: String,
    /// The whole result.
    pub result: Value,
}

impl AddResult {
    /// Parses the result of `out`; panics unless the call succeeded with
    /// exactly one `/32` and one `/128` address and a host interface.
    pub fn from_output(out: &CniOutput) -> AddResult {
        let result = out.result().clone();
        let ips: Vec<&str> = result["ips"]
            .as_array()
            .unwrap_or_else(|| panic!("ADD result without ips: {result}"))
            .iter()
            .filter_map(|ip| ip["address"].as_str())
            .collect();
        let pick = |suffix: &str| -> String {
            let found: Vec<&str> = ips.iter().filter_map(|a| a.strip_suffix(suffix)).collect();
            assert_eq!(found.len(), 1, "one {suffix} address expected in {result}");
            found[0].to_owned()
        };
        let host = result["interfaces"][0]["name"]
            .as_str()
            .unwrap_or_else(|| panic!("ADD result without a host interface: {result}"))
            .to_owned();
        AddResult {
            v4: pick("/32"),
            v6: pick("/128"),
            host,
            result,
        }
    }

    /// The addresses with their prefix lengths, `v4/32` then `v6/128`: as
    /// the admin API lists them and as the pod's eth0 holds them.
    pub fn prefixed_ips(&self) -> Vec<String> {
        vec![format!("{}/32", self.v4), format!("{}/128", self.v6)]
    }

    /// CHECK of `id` in `pod` with a 1.0.0 netconf of `daemon` for
    /// `network` and this result as prevResult.
    pub fn check(&self, daemon: &Daemon, network: &str, id: &str, pod: &Netns) -> CniOutput {
        let mut conf = daemon.netconf("1.0.0", network);
        conf["prevResult"] = self.result.clone();
        check(&tether_bin(), &conf, id, pod)
    }

    /// [`AddResult::check`], panicking unless it passes.
    pub fn assert_check_passes(&self, daemon: &Daemon, network: &str, id: &str, pod: &Netns) {
        let out = self.check(daemon, network, id, pod);
        assert!(out.success(), "CHECK of {id} failed: {out}");
    }
}

/// Panics unless `pod`'s eth0 holds both addresses of `added`.
pub fn assert_pod_holds(pod: &Netns, added: &AddResult) {
    let addrs = pod.addrs_of("eth0");
    for want in added.prefixed_ips() {
        assert!(
            addrs.contains(&want),
            "netns {} lacks {want} on eth0; it has {addrs:?}",
            pod.name()
        );
    }
}

/// The routes a node must carry for `pods`, in [`Netns::tether_routes`]
/// form: one per address, to the pod's veth.
pub fn expected_routes<'a>(pods: impl IntoIterator<Item = &'a AddResult>) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = pods
        .into_iter()
        .flat_map(|a| {
            [
                (a.v4.clone(), a.host.clone()),
                (a.v6.clone(), a.host.clone()),
            ]
        })
        .collect();
    out.sort();
    out
}

/// Waits up to `limit` until none of `netnses` has a link `ifname` (a
/// pod's eth0 goes with the node side of its veth); true if so.
pub fn wait_link_gone<'a, I>(netnses: I, ifname: &str, limit: Duration) -> bool
where
    I: IntoIterator<Item = &'a Netns> + Clone,
{
    wait_until(limit, || {
        netnses.clone().into_iter().all(|ns| !ns.has_link(ifname))
    })
}
