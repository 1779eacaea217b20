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

/// The zstd level, moved so that compression keeps ahead of the link with room to spare (as
/// zstd's `--adapt` does): over each second, the share of time the main lane's writer spent
/// encoding (the `poll_transmit` calls) and waiting for its socket. Encoding more than half the
/// time, the encoder would soon be the bottleneck: one level down. Encoding less than
/// [`LOW`](Self::LOW) while the writer waits for the link (it is full): one level up. A quiet
/// link moves nothing. So the level settles where one core encodes at least twice what the
/// link drains. A level it had to leave because the encoder fell behind is not climbed back
/// to for [`HOLD`](Self::HOLD), so a step too dear does not make the level (and with it the
/// streams' contexts, see `codec::context::RESTART_WINDOWS`) swing every second.
#[derive(Debug, Clone)]
pub struct Governor {
    level: i32,
    min: i32,
    max: i32,
    window_start: Instant,
    encoding: Duration,
    waited: Duration,
    /// The level last left downwards, and when.
    left: Option<(i32, Instant)>,
    /// The smoothed share of time spent encoding (none before the first window).
    busy: Option<f64>,
}

impl Governor {
    const WINDOW: Duration = Duration::from_secs(1);
    /// Encoding more than this share of the time: level down.
    const HIGH: f64 = 0.5;
    /// Encoding less than this share while the link is full: level up. With a level costing
    /// 1.3-1.5 times the one below, a step up from here lands at 0.45-0.5.
    const LOW: f64 = 0.35;
    /// How long a level left downwards stays out of reach.
    const HOLD: Duration = Duration::from_secs(10);
    /// Waiting for the socket more than this share of the time: the link is full.
    const FULL: f64 = 0.3;

    /// Starts at `level`, moving between `min` and `max`.
    pub fn new(level: i32, min: i32, max: i32, now: Instant) -> Self {
        Governor {
            level: level.clamp(min, max),
            min,
            max,
            window_start: now,
            encoding: Duration::ZERO,
            waited: Duration::ZERO,
            left: None,
            busy: None,
        }
    }

    /// The level in force.
    pub fn level(&self) -> i32 {
        self.level
    }

    /// Records time spent encoding and waiting for the socket; returns the new level when it
    /// changes.
    pub fn record(&mut self, encoding: Duration, waited: Duration, now: Instant) -> Option<i32> {
        self.encoding += encoding;
        self.waited += waited;
        let span = now.saturating_duration_since(self.window_start);
        if span < Self::WINDOW {
            return None;
        }
        // Smoothed over about two windows: one dear second (a stretch of deltas) is not a
        // trend.
        let now_busy = self.encoding.as_secs_f64() / span.as_secs_f64();
        let busy = match self.busy {
            Some(b) => (b + now_busy) / 2.0,
            None => now_busy,
        };
        self.busy = Some(busy);
        let full = self.waited.as_secs_f64() / span.as_secs_f64();
        self.window_start = now;
        self.encoding = Duration::ZERO;
        self.waited = Duration::ZERO;
        let held = self.left.is_some_and(|(level, at)| {
            level == self.level + 1 && now.saturating_duration_since(at) < Self::HOLD
        });
        let next = if busy > Self::HIGH {
            self.level - 1
        } else if busy < Self::LOW && full > Self::FULL && !held {
            self.level + 1
        } else {
            self.level
        }
        .clamp(self.min, self.max);
        if next < self.level {
            self.left = Some((self.level, now));
        }
        if next != self.level {
            // The new level's cost is still to be seen.
            self.busy = None;
        }
        (next != self.level).then(|| {
            self.level = next;
            next
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A second of a link whose encoder costs `cost(level)` of the time needed to fill it; returns
    /// the levels the governor chose, one per second.
    fn settle(cost: impl Fn(i32) -> f64, start: i32) -> Vec<i32> {
        let mut t = Instant::now();
        let mut g = Governor::new(start, 1, 9, t);
        let mut levels = Vec::new();
        for _ in 0..20 {
            // Ten writes a second: the writer encodes, then waits for the socket the rest.
            for _ in 0..10 {
                let busy = cost(g.level()).min(1.0);
                let enc = Duration::from_secs_f64(0.1 * busy);
                let wait = Duration::from_secs_f64(0.1 * (1.0 - busy));
                t += enc + wait;
                g.record(enc, wait, t);
            }
            levels.push(g.level());
        }
        levels
    }

    #[test]
    fn the_level_settles_where_the_encoder_has_room_to_spare() {
        // Each level costs 30% more time than the one below; level 5 takes 40% of the time.
        let cost = |l: i32| 0.4 * 1.3f64.powi(l - 5);
        for start in [1, 5, 9] {
            let levels = settle(cost, start);
            let last = *levels.last().expect("levels");
            assert!(cost(last) <= Governor::HIGH, "from {start}: {levels:?}");
            assert!(
                cost(last + 1) > Governor::LOW || last == 9,
                "from {start}: {levels:?}"
            );
            // Settled: the last few seconds do not move.
            assert!(
                levels[15..].iter().all(|l| *l == last),
                "from {start}: {levels:?}"
            );
        }
        // A cheap encoder climbs to the top; one that cannot keep up drops to the bottom.
        assert_eq!(*settle(|_| 0.05, 3).last().expect("l"), 9);
        assert_eq!(*settle(|_| 0.95, 6).last().expect("l"), 1);
    }

    #[test]
    fn a_level_too_dear_is_not_retried_at_once() {
        // Level 5 leaves room for level 6 by the thresholds, but level 6 is too dear.
        let cost = |l: i32| if l <= 5 { 0.3 } else { 0.6 };
        let levels = settle(cost, 5);
        // One try, then none for the hold (ten seconds); one more try in the next ten.
        assert_eq!(
            levels[..10].iter().filter(|l| **l == 6).count(),
            1,
            "{levels:?}"
        );
        assert!(levels[2..10].iter().all(|l| *l == 5), "{levels:?}");
        assert!(
            levels.iter().filter(|l| **l == 6).count() <= 2,
            "{levels:?}"
        );
    }

    #[test]
    fn a_quiet_link_moves_nothing() {
        let mut t = Instant::now();
        let mut g = Governor::new(6, 1, 9, t);
        for _ in 0..100 {
            t += Duration::from_millis(100);
            assert_eq!(g.record(Duration::ZERO, Duration::ZERO, t), None);
        }
        assert_eq!(g.level(), 6);
    }

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
