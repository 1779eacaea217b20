//! The runtime's ground floor: helpers every module may use, importing nothing of the crate.
//! [`lock`] takes a mutex whatever a panicking holder left behind, and [`LogBudget`] rations the
//! log lines that anyone outside (a flood of connections, a misbehaving peer) can cause.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Locks `m`; a holder that panicked left data that is still consistent for our uses (counters,
/// maps of wakeups), so its poison is ignored rather than spread.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
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
