//! Admission before authentication. The link port admits a
//! bounded number of connections that have not yet proved who they are, and a bounded number per
//! source address; when full, the oldest pending one is dropped for the newcomer, so a flood of idle
//! connections cannot hold the door shut against the real peer, which completes in a round trip.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use crate::sync::lock;

/// Why an admission pushed an older pending connection out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Eviction {
    /// Its source had as many pending connections as `limits.handshakes_per_source` allows.
    PerSource,
    /// The link port had as many pending connections as `limits.max_handshakes` allows.
    Total,
}

#[derive(Default)]
struct State {
    next: u64,
    pending: BTreeMap<u64, (IpAddr, Arc<Notify>)>,
    per_source: HashMap<IpAddr, u32>,
}

impl State {
    fn remove(&mut self, seq: u64) -> Option<Arc<Notify>> {
        let (ip, n) = self.pending.remove(&seq)?;
        if let Some(c) = self.per_source.get_mut(&ip) {
            *c -= 1;
            if *c == 0 {
                self.per_source.remove(&ip);
            }
        }
        Some(n)
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
    /// Admits a connection from `ip`, evicting the oldest pending one of the same source, or of
    /// all, when that is full. Returns the ticket and what was evicted, if anything.
    pub(crate) fn admit(
        self: &Arc<Self>,
        ip: IpAddr,
        max_total: u32,
        max_per_source: u32,
    ) -> (Ticket, Option<Eviction>) {
        let mut s = lock(&self.state);
        let mut why = None;
        let victim = if s.per_source.get(&ip).copied().unwrap_or(0) >= max_per_source {
            why = Some(Eviction::PerSource);
            s.pending
                .iter()
                .find(|(_, (src, _))| *src == ip)
                .map(|(k, _)| *k)
        } else if s.pending.len() >= max_total as usize {
            why = Some(Eviction::Total);
            s.pending.keys().next().copied()
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
        s.pending.insert(seq, (ip, evicted.clone()));
        *s.per_source.entry(ip).or_insert(0) += 1;
        let t = Ticket {
            gate: self.clone(),
            seq,
            evicted,
        };
        (t, why)
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

    #[test]
    fn a_full_gate_evicts_the_oldest_of_the_source_then_of_all() {
        let g = Arc::new(Gate::default());
        let (a1, w) = g.admit(ip(1), 3, 2);
        assert_eq!(w, None);
        let (_a2, _) = g.admit(ip(1), 3, 2);
        // A third from the same source pushes out its oldest.
        let (_a3, w) = g.admit(ip(1), 3, 2);
        assert_eq!(w, Some(Eviction::PerSource));
        assert_eq!(g.pending(), 2);
        let (_b1, w) = g.admit(ip(2), 3, 2);
        assert_eq!(w, None);
        // Full: the oldest of all (a2) goes, whatever its source.
        let (c1, w) = g.admit(ip(3), 3, 2);
        assert_eq!(w, Some(Eviction::Total));
        assert_eq!(g.pending(), 3);
        // The evicted ticket was told, even though nobody was waiting yet.
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let told = {
            let mut fut = std::pin::pin!(a1.evicted.notified());
            std::future::Future::poll(fut.as_mut(), &mut cx).is_ready()
        };
        assert!(told);
        drop(a1);
        drop(c1);
        assert_eq!(g.pending(), 2);
        drop((_a3, _b1, _a2));
        assert_eq!(g.pending(), 0);
        assert!(lock(&g.state).per_source.is_empty(), "nothing leaked");
    }
}
