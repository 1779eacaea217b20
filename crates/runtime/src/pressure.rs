//! Whether the link or the CPU limits throughput, which tells the encoder whether to spend CPU
//! on ratio. A stated WAN settles it (see [`policy::link_bound`](crate::policy::link_bound));
//! otherwise the share of time the main lane's writer waits for its socket decides: mostly
//! waiting means the link is the bottleneck, rarely waiting means the CPU is. Hysteresis keeps
//! it steady.

use std::time::{Duration, Instant};

use wanopt_proto::Pressure as Bound;

#[derive(Debug, Clone)]
pub(crate) struct Pressure {
    window_start: Instant,
    waited: Duration,
    link_bound: bool,
    fixed: bool,
}

impl Pressure {
    const WINDOW: Duration = Duration::from_millis(250);
    /// Above this share of time waiting, the link is the bottleneck; below `LOW`, the CPU.
    const HIGH: f64 = 0.5;
    const LOW: f64 = 0.2;

    /// Fixed at link-bound when `link_bound`; else measured from `now` on, starting CPU-bound.
    pub fn new(link_bound: bool, now: Instant) -> Self {
        Pressure {
            window_start: now,
            waited: Duration::ZERO,
            link_bound,
            fixed: link_bound,
        }
    }

    pub fn current(&self) -> Bound {
        if self.link_bound {
            Bound::LinkBound
        } else {
            Bound::CpuBound
        }
    }

    /// Records a write that started at `started` and returned at `now`; returns the new pressure
    /// when it changes.
    pub fn wrote(&mut self, started: Instant, now: Instant) -> Option<Bound> {
        if self.fixed {
            return None;
        }
        self.waited += now.saturating_duration_since(started);
        let span = now.saturating_duration_since(self.window_start);
        if span < Self::WINDOW {
            return None;
        }
        let share = self.waited.as_secs_f64() / span.as_secs_f64();
        self.window_start = now;
        self.waited = Duration::ZERO;
        let bound = if share > Self::HIGH {
            true
        } else if share < Self::LOW {
            false
        } else {
            self.link_bound
        };
        if bound == self.link_bound {
            return None;
        }
        self.link_bound = bound;
        Some(self.current())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes that each wait `wait` out of every `every`, for a second.
    fn run(p: &mut Pressure, t: &mut Instant, wait: u64, every: u64) -> Vec<Bound> {
        let mut changes = Vec::new();
        for _ in 0..(1000 / every) {
            let started = *t + Duration::from_millis(every - wait);
            *t += Duration::from_millis(every);
            changes.extend(p.wrote(started, *t));
        }
        changes
    }

    #[test]
    fn a_writer_that_mostly_waits_is_link_bound_with_hysteresis() {
        let mut t = Instant::now();
        let mut p = Pressure::new(false, t);
        assert_eq!(p.current(), Bound::CpuBound);
        assert_eq!(run(&mut p, &mut t, 8, 10), vec![Bound::LinkBound]);
        // In between the two thresholds nothing changes.
        assert!(run(&mut p, &mut t, 3, 10).is_empty());
        assert_eq!(run(&mut p, &mut t, 1, 10), vec![Bound::CpuBound]);
        assert!(run(&mut p, &mut t, 3, 10).is_empty());
    }

    #[test]
    fn a_stated_wan_is_link_bound_for_good() {
        let mut t = Instant::now();
        let mut p = Pressure::new(true, t);
        assert_eq!(p.current(), Bound::LinkBound);
        assert!(run(&mut p, &mut t, 0, 10).is_empty());
        assert_eq!(p.current(), Bound::LinkBound);
    }
}
