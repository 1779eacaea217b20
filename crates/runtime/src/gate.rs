//! Admission before authentication. The link port admits a bounded number of connections that
//! have not yet proved who they are, and a bounded number per source; a flood of them must not
//! keep the real peer out. Three rules see to that:
//!
//! - **Sources are networks, not addresses**: an IPv4 address, or an IPv6 /64 (one host's
//!   allocation), so a /64's millions of addresses are one source with one share.
//! - **Room kept for the peer**: the sources the peer last authenticated from (the last
//!   [`KNOWN_SOURCES`]) are admitted on their own, never counted against or evicted by strangers.
//!   A TCP connection from such a source needs that address, which a flood from elsewhere does
//!   not have; a ClientHello proves nothing (anyone can send one), so admission never looks at it.
//! - **A random stranger goes**: when strangers fill the gate, a newcomer evicts a random one, not
//!   the oldest, so the peer's connection from a new address survives `n` newcomers with chance
//!   `(1 - 1/max)^n` instead of being pushed out by the `max`-th.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use crate::sync::lock;

/// Sources remembered as the peer's (most recent first).
pub(crate) const KNOWN_SOURCES: usize = 4;

/// Why an admission pushed an older pending connection out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Eviction {
    /// Its source had as many pending connections as `limits.handshakes_per_source` allows.
    PerSource,
    /// The strangers' room had as many pending connections as `limits.max_handshakes` allows.
    Total,
}

/// A source: an IPv4 address, or the /64 of an IPv6 one (IPv4-mapped addresses are IPv4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Source {
    V4(u32),
    V6(u64),
}

impl Source {
    pub(crate) fn of(ip: IpAddr) -> Source {
        match ip.to_canonical() {
            IpAddr::V4(v4) => Source::V4(u32::from(v4)),
            IpAddr::V6(v6) => Source::V6((u128::from(v6) >> 64) as u64),
        }
    }
}

struct Pending {
    source: Source,
    known: bool,
    evicted: Arc<Notify>,
}

#[derive(Default)]
struct State {
    next: u64,
    pending: BTreeMap<u64, Pending>,
    per_source: HashMap<Source, u32>,
    strangers: usize,
    known: VecDeque<Source>,
}

impl State {
    fn remove(&mut self, seq: u64) -> Option<Arc<Notify>> {
        let p = self.pending.remove(&seq)?;
        if !p.known {
            self.strangers -= 1;
        }
        if let Some(c) = self.per_source.get_mut(&p.source) {
            *c -= 1;
            if *c == 0 {
                self.per_source.remove(&p.source);
            }
        }
        Some(p.evicted)
    }
}

/// The pending (unauthenticated) connections of one listener.
#[derive(Default)]
pub(crate) struct Gate {
    state: Mutex<State>,
}

/// One admitted connection; dropping it (authenticated or failed) frees its place.
pub(crate) struct Ticket {
    gate: Arc<Gate>,
    seq: u64,
    /// Notified when a newer connection took this one's place.
    pub evicted: Arc<Notify>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        lock(&self.gate.state).remove(self.seq);
    }
}

impl Gate {
    /// Admits a connection from `ip`. A source with `max_per_source` pending loses its oldest;
    /// a stranger finding `max_total` strangers pending evicts a random one of them. Returns
    /// the ticket and what was evicted, if anything.
    pub(crate) fn admit(
        self: &Arc<Self>,
        ip: IpAddr,
        max_total: u32,
        max_per_source: u32,
    ) -> (Ticket, Option<Eviction>) {
        let source = Source::of(ip);
        let mut s = lock(&self.state);
        let known = s.known.contains(&source);
        let mut why = None;
        let victim = if s.per_source.get(&source).copied().unwrap_or(0) >= max_per_source {
            why = Some(Eviction::PerSource);
            s.pending
                .iter()
                .find(|(_, p)| p.source == source)
                .map(|(k, _)| *k)
        } else if !known && s.strangers >= max_total as usize {
            why = Some(Eviction::Total);
            let pick = rand::random_range(0..s.strangers);
            s.pending
                .iter()
                .filter(|(_, p)| !p.known)
                .nth(pick)
                .map(|(k, _)| *k)
        } else {
            None
        };
        if let Some(n) = victim.and_then(|v| s.remove(v)) {
            // A stored permit: the victim sees it even if it is not waiting yet.
            n.notify_one();
        }
        let seq = s.next;
        s.next += 1;
        let evicted = Arc::new(Notify::new());
        s.pending.insert(
            seq,
            Pending {
                source,
                known,
                evicted: evicted.clone(),
            },
        );
        if !known {
            s.strangers += 1;
        }
        *s.per_source.entry(source).or_insert(0) += 1;
        let t = Ticket {
            gate: self.clone(),
            seq,
            evicted,
        };
        (t, why)
    }

    /// Remembers `ip` as a source the peer authenticated from: its next connections get the
    /// room kept for the peer. Call it only once the peer's certificate and name are checked.
    pub(crate) fn authenticated(&self, ip: IpAddr) {
        let source = Source::of(ip);
        let mut s = lock(&self.state);
        s.known.retain(|k| *k != source);
        s.known.push_front(source);
        s.known.truncate(KNOWN_SOURCES);
    }

    pub(crate) fn pending(&self) -> usize {
        lock(&self.state).pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    fn told(t: &Ticket) -> bool {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut fut = std::pin::pin!(t.evicted.notified());
        std::future::Future::poll(fut.as_mut(), &mut cx).is_ready()
    }

    #[test]
    fn a_full_gate_evicts_the_oldest_of_the_source_then_a_stranger() {
        let g = Arc::new(Gate::default());
        let (a1, w) = g.admit(ip(1), 3, 2);
        assert_eq!(w, None);
        let (a2, _) = g.admit(ip(1), 3, 2);
        // A third from the same source pushes out its oldest.
        let (a3, w) = g.admit(ip(1), 3, 2);
        assert_eq!(w, Some(Eviction::PerSource));
        assert!(told(&a1), "the source's oldest was told");
        drop(a1);
        assert_eq!(g.pending(), 2);
        let (b1, w) = g.admit(ip(2), 3, 2);
        assert_eq!(w, None);
        // Full: one of the three goes, whichever, and it is told.
        let (c1, w) = g.admit(ip(3), 3, 2);
        assert_eq!(w, Some(Eviction::Total));
        assert_eq!(g.pending(), 3);
        assert_eq!([&a2, &a3, &b1].iter().filter(|t| told(t)).count(), 1);
        drop((a2, a3, b1, c1));
        assert_eq!(g.pending(), 0);
        let s = lock(&g.state);
        assert!(
            s.per_source.is_empty() && s.strangers == 0,
            "nothing leaked"
        );
    }

    /// The victim is random: over many floods, the first stranger is not always the one to go.
    #[test]
    fn strangers_are_evicted_at_random() {
        let mut survived = 0;
        for _ in 0..200 {
            let g = Arc::new(Gate::default());
            let (first, _) = g.admit(ip(1), 8, 8);
            let others: Vec<_> = (2..=8).map(|i| g.admit(ip(i), 8, 8).0).collect();
            let (_newcomer, w) = g.admit(ip(9), 8, 8);
            assert_eq!(w, Some(Eviction::Total));
            survived += usize::from(!told(&first));
            drop(others);
        }
        // Each of the 8 goes with chance 1/8: the first survives about 175 of 200 times.
        assert!(
            (140..200).contains(&survived),
            "first survived {survived} of 200"
        );
    }

    /// A source the peer authenticated from keeps its room through any flood of strangers.
    #[test]
    fn the_peers_sources_are_never_evicted_by_strangers() {
        let g = Arc::new(Gate::default());
        let peer = ip(200);
        g.authenticated(peer);
        let (p, w) = g.admit(peer, 4, 2);
        assert_eq!(w, None);
        let flood: Vec<_> = (0..1000u32)
            .map(|i| {
                g.admit(
                    IpAddr::from([10, 1, (i / 250) as u8, (i % 250) as u8]),
                    4,
                    2,
                )
                .0
            })
            .collect();
        assert!(!told(&p), "the peer's connection was evicted by strangers");
        // Strangers are bounded by their room; the peer's is on top.
        assert_eq!(g.pending(), 5);
        drop(flood);
        // Only the last KNOWN_SOURCES are remembered.
        for i in 0..KNOWN_SOURCES as u8 {
            g.authenticated(ip(i));
        }
        let s = lock(&g.state);
        assert!(!s.known.contains(&Source::of(peer)));
        assert_eq!(s.known.len(), KNOWN_SOURCES);
    }

    /// An IPv6 /64 is one source, whatever its addresses; IPv4-mapped is IPv4.
    #[test]
    fn a_v6_64_is_one_source() {
        let a: IpAddr = "2001:db8:1:2::1".parse().expect("ip");
        let b: IpAddr = "2001:db8:1:2:ffff:1:2:3".parse().expect("ip");
        let c: IpAddr = "2001:db8:1:3::1".parse().expect("ip");
        assert_eq!(Source::of(a), Source::of(b));
        assert_ne!(Source::of(a), Source::of(c));
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().expect("ip");
        assert_eq!(Source::of(mapped), Source::of(ip(1)));
        assert_ne!(Source::of(ip(1)), Source::of(ip(2)));
        let g = Arc::new(Gate::default());
        let _t: Vec<_> = (0..3).map(|_| g.admit(a, 64, 2).0).collect();
        let (_t2, w) = g.admit(b, 64, 2);
        assert_eq!(w, Some(Eviction::PerSource), "the /64 shares one quota");
    }
}
