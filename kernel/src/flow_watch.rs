//! Following a few addresses' flows without walking the flow table each
//! time.
//!
//! A read of the flow table ([`Handover::flows_of_each`]) walks the
//! kernel's whole conntrack hash table, which every network namespace
//! shares: 6.5 ms of system time for 262,144 buckets and no flow on the
//! bench machine, more on a busy node. A node that sends its leaving VMs'
//! flows every half second paid that for as long as they left, so a
//! migration's cost grew with its length. A [`FlowWatch`] reads the table
//! once, then follows conntrack's events (flows made, changed, ended) for
//! the addresses it is asked about, and reads the table again only for an
//! address it has not read yet, or after the feed lost events (its socket
//! overran). Its cost is per flow changed, not per round.
//!
//! What an event holds: the flow's two directions, its timeout and mark
//! always; TCP's state only when the state changed. A change without the
//! state keeps the state known. The timeout is the one the flow had at its
//! last event: a flow's packets refresh it without an event, so a flow
//! that carries traffic reads as having its whole timeout left, which is
//! what the target should give it.
//!
//! What the feed does not tell: the changes and the end of a flow made
//! before it opened. Conntrack gives a flow its event record when it makes
//! it, and with `nf_conntrack_events` at 2 (the default of recent kernels)
//! only while some socket listens. Such a flow stays as it was read until
//! the table is read again: its user asks for that where it needs the
//! table exactly as it is ([`FlowWatch::read_again`]; the sender does at a
//! cutover).

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;

use crate::error::Result;
use crate::handover::{
    all_flows_at, touches, Flow, FlowChange, FlowChanges, FlowEnds, FlowFeed, Handover,
};

/// The flows of the addresses asked about, kept current by a feed (see
/// the module doc).
pub struct FlowWatch {
    feed: Box<dyn FlowFeed>,
    /// Every flow of the addresses read, by protocol and first direction
    /// (conntrack's key).
    flows: HashMap<(u8, FlowEnds), Flow>,
    /// The addresses whose flows were read since the feed last lost
    /// changes.
    read: BTreeSet<IpAddr>,
    /// How many times the table was read.
    reads: u64,
}

impl FlowWatch {
    /// A watch on `kernel`'s flow table, its feed opened now (in the
    /// caller's network namespace); an error if the kernel has none.
    pub fn open(kernel: &dyn Handover) -> Result<FlowWatch> {
        Ok(FlowWatch {
            feed: kernel.watch_flows()?,
            flows: HashMap::new(),
            read: BTreeSet::new(),
            reads: 0,
        })
    }

    /// [`Handover::flows_of_each`] for `ips`, from the changes the feed
    /// kept since the last call; the table is read (once, for every one of
    /// `ips`) only when one of them was not asked about last time, or the
    /// feed lost changes. The flows of addresses no longer asked about are
    /// forgotten.
    pub async fn flows_of_each(
        &mut self,
        kernel: &dyn Handover,
        ips: &[IpAddr],
    ) -> Result<Vec<Vec<Flow>>> {
        let asked: BTreeSet<IpAddr> = ips.iter().copied().collect();
        // Tracked before the changes are taken and the table read: a
        // change made from here on is kept, and applied over the read.
        self.feed.track(&asked);
        let FlowChanges { changes, lost } = self.feed.take();
        if lost {
            self.read.clear();
        }
        self.read.retain(|ip| asked.contains(ip));
        self.flows.retain(|_, f| touches(f, &asked));
        for change in changes {
            let f = change.flow();
            if !touches(f, &asked) {
                continue;
            }
            let key = (f.proto, f.orig);
            match change {
                FlowChange::Made(mut f) => {
                    if f.tcp_state.is_none() {
                        f.tcp_state = self.flows.get(&key).and_then(|was| was.tcp_state);
                    }
                    self.flows.insert(key, f);
                }
                FlowChange::Gone(_) => {
                    self.flows.remove(&key);
                }
            }
        }
        if !asked.is_subset(&self.read) {
            let each = kernel.flows_of_each(ips).await?;
            self.reads += 1;
            self.flows = each
                .into_iter()
                .flatten()
                .map(|f| ((f.proto, f.orig), f))
                .collect();
            self.read = asked;
        }
        let all: Vec<Flow> = self.flows.values().cloned().collect();
        Ok(ips.iter().map(|ip| all_flows_at(&all, *ip)).collect())
    }

    /// Makes the next [`FlowWatch::flows_of_each`] read the table, for
    /// the flows exactly as they are now (see the module doc).
    pub fn read_again(&mut self) {
        self.read.clear();
    }

    /// How many times the watch read the flow table.
    pub fn reads(&self) -> u64 {
        self.reads
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::FakeHandover;
    use crate::handover::{TCP, TCP_ESTABLISHED, UDP};

    fn flow(proto: u8, src: &str, dst: &str) -> Flow {
        let orig = FlowEnds {
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
        };
        Flow {
            proto,
            orig,
            reply: orig.inverse(),
            mark: 0,
            timeout_secs: 120,
            tcp_state: (proto == TCP).then_some(TCP_ESTABLISHED),
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn sorted(mut v: Vec<Flow>) -> Vec<Flow> {
        v.sort_by_key(|f| (f.proto, f.orig.src, f.orig.dst));
        v
    }

    #[tokio::test]
    async fn the_table_is_read_once_and_then_followed_by_its_changes() {
        let k = FakeHandover::default();
        let a = flow(TCP, "10.0.0.5:4000", "10.9.0.1:80");
        let other = flow(UDP, "10.0.0.77:53", "10.9.0.1:53");
        k.with(|st| st.flows = vec![a.clone(), other.clone()]);
        let mut w = FlowWatch::open(&k).expect("watch");
        let vm = [ip("10.0.0.5")];
        assert_eq!(
            w.flows_of_each(&k, &vm).await.unwrap(),
            vec![vec![a.clone()]]
        );
        assert_eq!(w.reads(), 1);

        // A flow made, one changed, then one ended: followed, not read.
        let b = flow(UDP, "10.9.0.2:5000", "10.0.0.5:6000");
        let mut a2 = a.clone();
        a2.mark = 0x70000;
        k.with(|st| st.flows = vec![a2.clone(), b.clone(), other.clone()]);
        let got = w.flows_of_each(&k, &vm).await.unwrap();
        assert_eq!(sorted(got[0].clone()), sorted(vec![a2.clone(), b.clone()]));
        k.with(|st| st.flows.retain(|f| f.orig != b.orig));
        assert_eq!(
            w.flows_of_each(&k, &vm).await.unwrap(),
            vec![vec![a2.clone()]]
        );
        assert_eq!(w.reads(), 1);
        assert_eq!(k.state().calls.get("read_flows"), Some(&1));

        // A new address is read (once, for all), an address no longer
        // asked about is forgotten.
        let c = flow(TCP, "10.0.0.6:4000", "10.9.0.1:80");
        k.with(|st| st.flows.push(c.clone()));
        let got = w
            .flows_of_each(&k, &[ip("10.0.0.5"), ip("10.0.0.6")])
            .await
            .unwrap();
        assert_eq!(got, vec![vec![a2.clone()], vec![c.clone()]]);
        assert_eq!(w.reads(), 2);
        let got = w.flows_of_each(&k, &[ip("10.0.0.6")]).await.unwrap();
        assert_eq!((got, w.reads()), (vec![vec![c.clone()]], 2));
        assert_eq!(w.flows.len(), 1);
    }

    #[tokio::test]
    async fn a_feed_that_lost_changes_has_the_table_read_again() {
        let k = FakeHandover::default();
        let a = flow(TCP, "10.0.0.5:4000", "10.9.0.1:80");
        k.with(|st| st.flows = vec![a.clone()]);
        let mut w = FlowWatch::open(&k).expect("watch");
        let vm = [ip("10.0.0.5")];
        w.flows_of_each(&k, &vm).await.unwrap();
        // The kernel drops a change (an overrun): the next call reads.
        let b = flow(TCP, "10.0.0.5:4001", "10.9.0.1:80");
        k.with(|st| {
            st.flows.push(b.clone());
            st.feed_lost = true;
        });
        let got = w.flows_of_each(&k, &vm).await.unwrap();
        assert_eq!(sorted(got[0].clone()), sorted(vec![a, b]));
        assert_eq!(w.reads(), 2);
        w.flows_of_each(&k, &vm).await.unwrap();
        assert_eq!(w.reads(), 2);
    }

    #[tokio::test]
    async fn a_change_without_the_tcp_state_keeps_the_state_known() {
        let k = FakeHandover::default();
        let mut a = flow(TCP, "10.0.0.5:4000", "10.9.0.1:80");
        k.with(|st| st.flows = vec![a.clone()]);
        let mut w = FlowWatch::open(&k).expect("watch");
        let vm = [ip("10.0.0.5")];
        w.flows_of_each(&k, &vm).await.unwrap();
        // As the kernel's event of a mark changed: no protocol info.
        a.mark = 0x70000;
        a.tcp_state = None;
        k.with(|st| st.flows = vec![a.clone()]);
        let got = w.flows_of_each(&k, &vm).await.unwrap();
        assert_eq!(got[0][0].tcp_state, Some(TCP_ESTABLISHED));
        assert_eq!(got[0][0].mark, 0x70000);
    }

    #[tokio::test]
    async fn a_mirror_of_the_vms_own_flow_is_left_out_as_a_read_leaves_it() {
        let k = FakeHandover::default();
        let own = flow(UDP, "10.0.0.5:4000", "10.9.0.1:80");
        k.with(|st| st.flows = vec![own.clone()]);
        let mut w = FlowWatch::open(&k).expect("watch");
        let vm = [ip("10.0.0.5")];
        w.flows_of_each(&k, &vm).await.unwrap();
        let mut mirror = flow(UDP, "10.9.0.1:80", "10.0.0.5:4000");
        mirror.reply.dst.set_port(4001);
        k.with(|st| st.flows.push(mirror));
        assert_eq!(w.flows_of_each(&k, &vm).await.unwrap(), vec![vec![own]]);
    }
}
