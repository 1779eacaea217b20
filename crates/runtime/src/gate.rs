//! Admission before authentication, and logs that a flood cannot multiply. The link port admits a
//! bounded number of connections that have not yet proved who they are, and a bounded number per
//! source address; when full, the oldest pending one is dropped for the newcomer, so a flood of idle
//! connections cannot hold the door shut against the real peer, which completes in a round trip.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::driver::lock;

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

/// Lets a kind of log line through at most `burst` times per `period` and counts the rest, so a
/// flood of failures costs a few lines, each saying how many were left out before it.
pub(crate) struct LogBudget {
    period: Duration,
    burst: u32,
    state: Mutex<(Option<Instant>, u32, u64)>,
}

impl LogBudget {
    pub(crate) const fn new(period: Duration, burst: u32) -> LogBudget {
        LogBudget {
            period,
            burst,
            state: Mutex::new((None, 0, 0)),
        }
    }

    /// `Some(n)` when a line may be written now (`n` lines were suppressed since the last one).
    pub(crate) fn take(&self, now: Instant) -> Option<u64> {
        let mut g = lock(&self.state);
        let (start, used, suppressed) = &mut *g;
        if start.is_none_or(|s| now.duration_since(s) >= self.period) {
            *start = Some(now);
            *used = 0;
        }
        if *used < self.burst {
            *used += 1;
            Some(std::mem::take(suppressed))
        } else {
            *suppressed += 1;
            None
        }
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

    #[test]
    fn a_log_budget_lets_a_burst_through_then_counts() {
        let b = LogBudget::new(Duration::from_secs(10), 2);
        let t0 = Instant::now();
        assert_eq!(b.take(t0), Some(0));
        assert_eq!(b.take(t0), Some(0));
        assert_eq!(b.take(t0), None);
        assert_eq!(b.take(t0 + Duration::from_secs(1)), None);
        assert_eq!(b.take(t0 + Duration::from_secs(11)), Some(2));
    }
}
