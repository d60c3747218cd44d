//! Node-local address pools.
//!
//! The allocator is in memory and is rebuilt from the store at startup; the
//! store's commit is what makes an allocation durable. Allocation is next-fit
//! from a cursor, so a released address is not handed out again until the
//! pool wraps: stale ARP entries and conntrack state of a deleted pod are
//! unlikely to meet its successor.

use ipnet::IpNet;
use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use tether_base::error::{Error, Result};

/// One pod CIDR.
#[derive(Debug)]
pub struct Pool {
    cidr: IpNet,
    first: u128,
    last: u128,
    used: BTreeSet<u128>,
    /// The last address handed out.
    cursor: u128,
    /// Addresses never handed out (a named pool's exclusions, its gateway,
    /// what lies outside its range): sorted, disjoint, inclusive intervals
    /// inside `first..=last`. Held addresses in them (recorded before the
    /// exclusion was added) stay held.
    holes: Vec<(u128, u128)>,
}

/// An address as a number.
pub fn to_u128(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

/// The address numbered `n`, of the family of `like`.
pub fn from_u128(like: IpAddr, n: u128) -> IpAddr {
    match like {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::from(n as u32)),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::from(n)),
    }
}

/// 32 or 128.
pub fn max_len(net: &IpNet) -> u8 {
    match net {
        IpNet::V4(_) => 32,
        IpNet::V6(_) => 128,
    }
}

/// Block number `index` of prefix length `len` inside `cidr`.
pub fn nth_block(cidr: &IpNet, len: u8, index: u128) -> Result<IpNet> {
    let shift = u32::from(max_len(cidr) - len);
    let base = to_u128(cidr.network()) + (index << shift);
    IpNet::new(from_u128(cidr.network(), base), len).map_err(|e| Error::Internal(e.to_string()))
}

impl Pool {
    /// A pool over `cidr`. The network address is never handed out, nor the
    /// broadcast address of an IPv4 pool; /31, /32, /127 and /128 are refused
    /// as too small to be a pod CIDR.
    pub fn new(cidr: IpNet) -> Result<Self> {
        let cidr = cidr.trunc();
        let (net, bcast) = (to_u128(cidr.network()), to_u128(cidr.broadcast()));
        let (first, last) = match cidr {
            IpNet::V4(n) if n.prefix_len() <= 30 => (net + 1, bcast - 1),
            IpNet::V6(n) if n.prefix_len() <= 126 => (net + 1, bcast),
            _ => {
                return Err(Error::InvalidConfig(format!(
                    "pod CIDR {cidr} is too small"
                )))
            }
        };
        Ok(Pool {
            cidr,
            first,
            last,
            used: BTreeSet::new(),
            cursor: last,
            holes: Vec::new(),
        })
    }

    /// A block of a named pool: every address of `block` may be handed
    /// out (the pool's own network and broadcast addresses are among the
    /// `holes` its owner passes), except those in `holes`.
    pub fn block(block: IpNet, holes: &[(IpAddr, IpAddr)]) -> Self {
        let cidr = block.trunc();
        let (first, last) = (to_u128(cidr.network()), to_u128(cidr.broadcast()));
        let mut pool = Pool {
            cidr,
            first,
            last,
            used: BTreeSet::new(),
            cursor: last,
            holes: Vec::new(),
        };
        pool.set_holes(holes);
        pool
    }

    /// Replaces the excluded intervals. Addresses in use stay in use.
    pub fn set_holes(&mut self, holes: &[(IpAddr, IpAddr)]) {
        let mut v: Vec<(u128, u128)> = holes
            .iter()
            .map(|&(a, b)| (to_u128(a).max(self.first), to_u128(b).min(self.last)))
            .filter(|(a, b)| a <= b)
            .collect();
        v.sort_unstable();
        let mut merged: Vec<(u128, u128)> = Vec::with_capacity(v.len());
        for (a, b) in v {
            match merged.last_mut() {
                Some(last) if a <= last.1.saturating_add(1) => last.1 = last.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        self.holes = merged;
    }

    /// The excluded interval holding `n`, if any.
    fn hole_of(&self, n: u128) -> Option<(u128, u128)> {
        let i = self.holes.partition_point(|&(_, hi)| hi < n);
        self.holes.get(i).copied().filter(|&(lo, _)| lo <= n)
    }

    /// True when `ip` lies in the pool but must not be handed out.
    pub fn is_excluded(&self, ip: IpAddr) -> bool {
        self.contains(ip) && self.hole_of(to_u128(ip)).is_some()
    }

    /// Addresses in use that are excluded now (the exclusion came after
    /// them): reported, never taken away.
    pub fn excluded_in_use(&self) -> Vec<IpAddr> {
        self.used
            .iter()
            .filter(|&&n| self.hole_of(n).is_some())
            .map(|&n| self.addr(n))
            .collect()
    }

    /// Addresses that may ever be handed out: the pool minus its holes.
    pub fn size(&self) -> u128 {
        let holes: u128 = self.holes.iter().map(|(a, b)| b - a + 1).sum();
        (self.last - self.first + 1) - holes
    }

    /// The addresses in use, in order.
    pub fn used_addresses(&self) -> Vec<IpAddr> {
        self.used.iter().map(|&n| self.addr(n)).collect()
    }

    /// The CIDR.
    pub fn cidr(&self) -> IpNet {
        self.cidr
    }

    fn addr(&self, n: u128) -> IpAddr {
        from_u128(self.cidr.network(), n)
    }

    /// True when `ip` is an address this pool may hand out.
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.cidr.contains(&ip) && (self.first..=self.last).contains(&to_u128(ip))
    }

    /// Addresses in use.
    pub fn used(&self) -> u128 {
        self.used.len() as u128
    }

    /// Addresses still free: the size less the addresses in use outside
    /// the holes.
    pub fn free(&self) -> u128 {
        let excluded_used = self
            .used
            .iter()
            .filter(|&&n| self.hole_of(n).is_some())
            .count() as u128;
        self.size() - (self.used() - excluded_used)
    }

    /// Marks an address in use; false if it was already.
    fn claim(&mut self, ip: IpAddr) -> bool {
        self.used.insert(to_u128(ip))
    }

    /// The next free address after the cursor, wrapping once.
    fn next_free(&self) -> Option<u128> {
        let start = if self.cursor >= self.last {
            self.first
        } else {
            self.cursor + 1
        };
        self.free_in(start, self.last)
            .or_else(|| self.free_in(self.first, start.saturating_sub(1)))
    }

    /// The lowest address in [from, to] neither used nor excluded.
    fn free_in(&self, mut from: u128, to: u128) -> Option<u128> {
        loop {
            let candidate = Self::first_gap(&self.used, from, to)?;
            match self.hole_of(candidate) {
                None => return Some(candidate),
                Some((_, hi)) if hi < to => from = hi + 1,
                Some(_) => return None,
            }
        }
    }

    /// The lowest address in [from, to] not in `used`.
    fn first_gap(used: &BTreeSet<u128>, from: u128, to: u128) -> Option<u128> {
        if from > to {
            return None;
        }
        let mut candidate = from;
        for &u in used.range(from..=to) {
            if u != candidate {
                break;
            }
            if candidate == to {
                return None;
            }
            candidate += 1;
        }
        Some(candidate)
    }
}

/// What [`Pools::take`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Take {
    /// The address was free and is now in use.
    Taken,
    /// It was in use already.
    InUse,
    /// No pool holds it (or it is a pool's network or broadcast address).
    NotInPool,
    /// A pool holds it, but it is excluded from allocation.
    Excluded,
}

pub use tether_base::net::Family;

/// Why an allocation found no address: the families whose every pool is
/// full. In cluster mode the caller claims a new block for each and tries
/// again; with fixed pod CIDRs it is final.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shortage {
    /// Families with no free address.
    pub families: Vec<Family>,
    /// For the operator: which pools are full.
    pub detail: String,
}

impl From<Shortage> for Error {
    fn from(s: Shortage) -> Error {
        Error::PoolExhausted(s.detail)
    }
}

/// The node's pools. Every ADD gets one address of each family the node
/// serves. With fixed pod CIDRs there is one pool per family; in cluster
/// mode each claimed block is a pool, and a family may have several.
#[derive(Debug)]
pub struct Pools {
    families: Vec<Family>,
    pools: Vec<Pool>,
}

impl Pools {
    /// Fixed pools over the given CIDRs; at least one, at most one per family.
    pub fn new(cidrs: &[IpNet]) -> Result<Self> {
        if cidrs.is_empty() {
            return Err(Error::InvalidConfig("no pod CIDR configured".into()));
        }
        let v4 = cidrs.iter().filter(|c| matches!(c, IpNet::V4(_))).count();
        if v4 > 1 || cidrs.len() - v4 > 1 {
            return Err(Error::InvalidConfig(
                "at most one IPv4 and one IPv6 pod CIDR".into(),
            ));
        }
        let pools: Vec<Pool> = cidrs.iter().map(|c| Pool::new(*c)).collect::<Result<_>>()?;
        let families = pools.iter().map(|p| Family::of(&p.cidr)).collect();
        Ok(Pools { families, pools })
    }

    /// No pools yet, serving `families`: blocks are added as they are
    /// claimed (cluster mode).
    pub fn for_blocks(families: &[Family]) -> Self {
        Pools {
            families: families.to_vec(),
            pools: Vec::new(),
        }
    }

    /// Adds a claimed block. Adding a block already present is a no-op.
    pub fn add_block(&mut self, cidr: IpNet) -> Result<()> {
        if self.pools.iter().any(|p| p.cidr == cidr.trunc()) {
            return Ok(());
        }
        self.add_pool(Pool::new(cidr)?)
    }

    /// Adds a named pool's block (see [`Pool::block`]). Adding a block
    /// already present is a no-op.
    pub fn add_pool(&mut self, pool: Pool) -> Result<()> {
        let cidr = pool.cidr;
        if self.pools.iter().any(|p| p.cidr == cidr) {
            return Ok(());
        }
        if let Some(p) = self
            .pools
            .iter()
            .find(|p| p.cidr.contains(&cidr.network()) || cidr.contains(&p.cidr.network()))
        {
            return Err(Error::Internal(format!(
                "block {cidr} overlaps the pool {}",
                p.cidr
            )));
        }
        self.pools.push(pool);
        Ok(())
    }

    /// Replaces the excluded intervals of every pool.
    pub fn set_holes(&mut self, holes: &[(IpAddr, IpAddr)]) {
        for p in &mut self.pools {
            p.set_holes(holes);
        }
    }

    /// The pools, in the order they were configured or claimed.
    pub fn pools(&self) -> &[Pool] {
        &self.pools
    }

    /// The families every ADD gets an address of.
    pub fn families(&self) -> &[Family] {
        &self.families
    }

    /// Records addresses found in the store at startup. Returns the addresses
    /// that were already claimed or lie outside every pool, which the caller
    /// must report (or, in cluster mode, claim the blocks of): they are a
    /// sign of a changed --pod-cidr, a lost block or corruption.
    pub fn restore(&mut self, ips: &[IpAddr]) -> Vec<IpAddr> {
        let mut bad = Vec::new();
        for &ip in ips {
            match self.pools.iter_mut().find(|p| p.contains(ip)) {
                Some(p) if !p.used.contains(&to_u128(ip)) => {
                    p.claim(ip);
                }
                _ => bad.push(ip),
            }
        }
        // Continue after the highest address in use, as if allocation had
        // just handed it out; an empty pool starts at its first address.
        for p in &mut self.pools {
            p.cursor = p.used.last().copied().unwrap_or(p.last);
        }
        bad
    }

    /// Allocates one address of every family, or nothing at all. Within a
    /// family the first pool with room is used, so a node fills its blocks
    /// in the order it claimed them.
    pub fn allocate(&mut self) -> std::result::Result<Vec<IpAddr>, Shortage> {
        let families = self.families.clone();
        self.allocate_families(&families)
    }

    /// [`Pools::allocate`] for some of the families only (the others were
    /// requested by address).
    pub fn allocate_families(
        &mut self,
        families: &[Family],
    ) -> std::result::Result<Vec<IpAddr>, Shortage> {
        let mut picked = Vec::with_capacity(families.len());
        let mut short = Vec::new();
        for &family in families {
            let found = self
                .pools
                .iter()
                .enumerate()
                .filter(|(_, p)| Family::of(&p.cidr) == family)
                .find_map(|(i, p)| p.next_free().map(|n| (i, n)));
            match found {
                Some(hit) => picked.push(hit),
                None => short.push(family),
            }
        }
        if !short.is_empty() {
            return Err(self.shortage().unwrap_or(Shortage {
                families: short,
                detail: String::new(),
            }));
        }
        let mut out = Vec::with_capacity(picked.len());
        for (i, n) in picked {
            let p = &mut self.pools[i];
            p.used.insert(n);
            p.cursor = n;
            out.push(p.addr(n));
        }
        Ok(out)
    }

    fn describe_full(&self, family: Family) -> String {
        let full: Vec<String> = self
            .pools
            .iter()
            .filter(|p| Family::of(&p.cidr) == family)
            .map(|p| format!("{} ({} in use)", p.cidr, p.used()))
            .collect();
        if full.is_empty() {
            format!("no {} block held", family.name())
        } else {
            format!("no free address left in {}", full.join(", "))
        }
    }

    /// Marks one requested address in use.
    pub fn take(&mut self, ip: IpAddr) -> Take {
        match self.pools.iter_mut().find(|p| p.contains(ip)) {
            None => Take::NotInPool,
            Some(p) if p.is_excluded(ip) => Take::Excluded,
            Some(p) => {
                if p.claim(ip) {
                    Take::Taken
                } else {
                    Take::InUse
                }
            }
        }
    }

    /// True when `ip` lies in a pool (whether used or not).
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.pools.iter().any(|p| p.contains(ip))
    }

    /// True when `ip` lies in a pool and is in use.
    pub fn is_used(&self, ip: IpAddr) -> bool {
        self.pools
            .iter()
            .any(|p| p.contains(ip) && p.used.contains(&to_u128(ip)))
    }

    /// Returns addresses to their pools. Unknown addresses are ignored.
    pub fn release(&mut self, ips: &[IpAddr]) {
        for &ip in ips {
            if let Some(p) = self.pools.iter_mut().find(|p| p.contains(ip)) {
                p.used.remove(&to_u128(ip));
            }
        }
    }

    /// Families with no free address in any of their pools.
    pub fn full_families(&self) -> Vec<Family> {
        self.families
            .iter()
            .copied()
            .filter(|&f| {
                !self
                    .pools
                    .iter()
                    .any(|p| Family::of(&p.cidr) == f && p.free() > 0)
            })
            .collect()
    }

    /// What the next allocation would lack, if anything.
    pub fn shortage(&self) -> Option<Shortage> {
        let families = self.full_families();
        if families.is_empty() {
            return None;
        }
        let detail = families
            .iter()
            .map(|&f| self.describe_full(f))
            .collect::<Vec<_>>()
            .join("; ");
        Some(Shortage { families, detail })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pools(c: &[&str]) -> Pools {
        Pools::new(&c.iter().map(|s| s.parse().unwrap()).collect::<Vec<_>>()).unwrap()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn allocates_one_per_family_skipping_network_and_broadcast() {
        let mut p = pools(&["10.1.0.0/30", "fd00::/126"]);
        assert_eq!(p.allocate().unwrap(), vec![ip("10.1.0.1"), ip("fd00::1")]);
        assert_eq!(p.allocate().unwrap(), vec![ip("10.1.0.2"), ip("fd00::2")]);
        let e = Error::from(p.allocate().unwrap_err());
        assert_eq!(e.code(), 100);
        assert!(e.to_string().contains("10.1.0.0/30"), "{e}");
        // All or nothing: the IPv6 pool was not charged for the failure.
        assert_eq!(p.pools()[1].used(), 2);
    }

    #[test]
    fn next_fit_does_not_reuse_a_released_address_at_once() {
        let mut p = pools(&["10.1.0.0/29"]);
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        p.release(&a);
        assert_eq!(p.allocate().unwrap(), vec![ip("10.1.0.3")]);
        assert_ne!(b, a);
        // After the end it wraps around to the freed address.
        for _ in 0..3 {
            p.allocate().unwrap();
        }
        assert_eq!(p.allocate().unwrap(), a);
        assert_eq!(Error::from(p.allocate().unwrap_err()).code(), 100);
    }

    #[test]
    fn restore_rebuilds_usage_and_reports_strays() {
        let mut p = pools(&["10.1.0.0/24"]);
        let bad = p.restore(&[ip("10.1.0.7"), ip("10.1.0.7"), ip("192.168.0.1")]);
        assert_eq!(bad, vec![ip("10.1.0.7"), ip("192.168.0.1")]);
        assert_eq!(p.pools()[0].used(), 1);
        assert_eq!(p.allocate().unwrap(), vec![ip("10.1.0.8")]);
        assert_eq!(p.pools()[0].free(), 254 - 2);
    }

    #[test]
    fn rejects_bad_pool_sets() {
        let parse = |v: &[&str]| v.iter().map(|s| s.parse().unwrap()).collect::<Vec<IpNet>>();
        assert_eq!(Pools::new(&[]).unwrap_err().code(), 7);
        assert!(Pools::new(&parse(&["10.0.0.0/24", "10.1.0.0/24"])).is_err());
        assert!(Pools::new(&parse(&["10.0.0.0/31"])).is_err());
        assert!(Pools::new(&parse(&["fd00::/128"])).is_err());
    }

    #[test]
    fn blocks_fill_in_claim_order_and_report_short_families() {
        let mut p = Pools::for_blocks(&[Family::V4, Family::V6]);
        let short = p.allocate().unwrap_err();
        assert_eq!(short.families, vec![Family::V4, Family::V6]);
        assert!(
            short.detail.contains("no IPv4 block held"),
            "{}",
            short.detail
        );
        p.add_block("10.2.0.0/30".parse().unwrap()).unwrap();
        p.add_block("fd00::/120".parse().unwrap()).unwrap();
        assert_eq!(p.allocate().unwrap(), vec![ip("10.2.0.1"), ip("fd00::1")]);
        assert_eq!(p.allocate().unwrap(), vec![ip("10.2.0.2"), ip("fd00::2")]);
        // IPv4 is full, IPv6 is not: only IPv4 is short, and nothing moved.
        let short = p.allocate().unwrap_err();
        assert_eq!(short.families, vec![Family::V4]);
        assert!(
            short.detail.contains("10.2.0.0/30 (2 in use)"),
            "{}",
            short.detail
        );
        assert_eq!(p.full_families(), vec![Family::V4]);
        p.add_block("10.2.0.4/30".parse().unwrap()).unwrap();
        assert_eq!(p.allocate().unwrap(), vec![ip("10.2.0.5"), ip("fd00::3")]);
        // The same block twice is a no-op; an overlapping one is a bug.
        p.add_block("10.2.0.4/30".parse().unwrap()).unwrap();
        assert_eq!(p.pools().len(), 3);
        assert!(p.add_block("10.2.0.0/29".parse().unwrap()).is_err());
        // Restore finds the holder block of each address.
        let mut q = Pools::for_blocks(&[Family::V4]);
        q.add_block("10.2.0.0/30".parse().unwrap()).unwrap();
        assert_eq!(
            q.restore(&[ip("10.2.0.2"), ip("10.2.0.6")]),
            vec![ip("10.2.0.6")]
        );
    }

    #[test]
    fn huge_ipv6_pool_counts_without_overflow() {
        let mut p = pools(&["fd00::/64"]);
        p.allocate().unwrap();
        assert_eq!(p.pools()[0].free(), (1u128 << 64) - 2);
        assert!(p.full_families().is_empty());
    }
}
