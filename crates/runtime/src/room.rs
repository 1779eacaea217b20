//! Room for the latency lane under a bulk load. The main lane is paced at `link.max_rate`, a
//! little under the stated bandwidth; but whatever else crosses the WAN's bottleneck (the latency
//! lane's copies, other hosts) adds to it, and the bottleneck's queue then grows until the main
//! lane's congestion control backs off, which for BBR is at about a round trip of queue. Every
//! SYNC round trip waits in that queue. While the latency lane moves bytes, [`Room`] watches the
//! queue the main lane sees (its smoothed RTT over its least, from `TCP_INFO`) and steps the main
//! lane's pacing cap down while it is over `link.latency_queue`, and back up while it is under
//! half of it, as LEDBAT does for background traffic. Bulk never goes below half of
//! `link.max_rate`, and is paced at it again a few seconds after the latency lane went quiet.
//! Bulk that starts (or starts again after a pause) while the latency lane is busy starts from
//! that floor and climbs, rather than filling the queue for the round trips it takes the RTT
//! to show it. Pure: fed counts, RTTs and `now`.

use std::time::{Duration, Instant};

/// How often the runtime feeds [`Room::tick`].
pub const TICK: Duration = Duration::from_millis(50);
/// How long after the latency lane last moved [`MOVED`] bytes the main lane keeps making room.
pub const QUIET_AFTER: Duration = Duration::from_secs(3);
/// Bytes the latency lane must move for it to count as busy (a keepalive does not).
pub const MOVED: u64 = 1024;
/// The cap is cut to this share of itself when the queue is over the target, at most once per
/// smoothed RTT (the queue the cut drains shows in the RTT a round trip later).
const CUT: f64 = 0.85;
/// The cap grows by this share of `link.max_rate` per tick while the queue is under half the
/// target: from the floor back to the top in about 1.25 s.
const GROW: f64 = 0.02;
/// The least share of `link.max_rate` the cap goes down to.
const FLOOR: f64 = 0.5;
/// Bytes the main lane must send for bulk to count as sending (control frames do not).
pub const BULK_MOVED: u64 = 64 * 1024;
/// Bulk that sent less than [`BULK_MOVED`] for this long is paused: while the latency lane is
/// busy its cap waits at the floor for it.
pub const BULK_PAUSED_AFTER: Duration = Duration::from_millis(250);

/// The main lane's pacing cap while latency traffic needs room.
#[derive(Debug, Clone)]
pub struct Room {
    /// `link.max_rate` in bytes per second: the cap with no latency traffic.
    max: u64,
    /// The queue the main lane may add while the latency lane is busy.
    target: Duration,
    cap: u64,
    /// The latency lane's byte count when it last moved [`MOVED`] bytes, and when.
    lane: u64,
    lane_moved: Option<Instant>,
    last_cut: Option<Instant>,
    /// The main lane's bytes sent when it last moved [`BULK_MOVED`], and when (`None`: not
    /// told, taken as sending).
    main: u64,
    main_moved: Option<Instant>,
    /// Bulk was paused at the last tick.
    paused: bool,
    /// The cap was given to the socket once: a socket taken over from another process (a
    /// handover) may carry the cap that process left on it.
    applied: bool,
}

impl Room {
    /// Paced at `max` bytes per second until latency traffic needs room.
    pub fn new(max: u64, target: Duration) -> Self {
        Room {
            max,
            target,
            cap: max,
            lane: 0,
            lane_moved: None,
            last_cut: None,
            main: 0,
            main_moved: None,
            paused: false,
            applied: false,
        }
    }

    /// The cap now, bytes per second.
    pub fn cap(&self) -> u64 {
        self.cap
    }

    /// True while the cap is below `link.max_rate`.
    pub fn making_room(&self) -> bool {
        self.cap < self.max
    }

    /// True while the cap holds back bulk that is sending (what room costs bulk).
    pub fn yielding(&self) -> bool {
        self.making_room() && !self.paused
    }

    /// The main lane's bytes sent so far (a count that only grows while its connection stays),
    /// before each [`tick`](Self::tick).
    pub fn bulk(&mut self, now: Instant, sent: u64) {
        if self.main_moved.is_none()
            || sent >= self.main.saturating_add(BULK_MOVED)
            || sent < self.main
        {
            self.main = sent;
            self.main_moved = Some(now);
        }
    }

    /// One tick: the latency lane's bytes so far (both ways; a count that only grows), and the
    /// main lane's smoothed and least RTT. Returns the new cap when it changed.
    pub fn tick(
        &mut self,
        now: Instant,
        lane_bytes: u64,
        srtt: Duration,
        min_rtt: Duration,
    ) -> Option<u64> {
        if lane_bytes >= self.lane.saturating_add(MOVED) || lane_bytes < self.lane {
            self.lane = lane_bytes;
            self.lane_moved = Some(now);
        }
        let busy = self
            .lane_moved
            .is_some_and(|t| now.saturating_duration_since(t) < QUIET_AFTER);
        let floor = (self.max as f64 * FLOOR) as u64;
        let queue = srtt.saturating_sub(min_rtt);
        let paused = self
            .main_moved
            .is_some_and(|t| now.saturating_duration_since(t) >= BULK_PAUSED_AFTER);
        self.paused = paused;
        let cap = if !busy || min_rtt.is_zero() {
            self.max
        } else if paused {
            floor
        } else if queue > self.target {
            let due = self
                .last_cut
                .is_none_or(|t| now.saturating_duration_since(t) >= srtt);
            if due {
                self.last_cut = Some(now);
                ((self.cap as f64 * CUT) as u64).max(floor)
            } else {
                self.cap
            }
        } else if queue * 2 <= self.target {
            (self.cap + (self.max as f64 * GROW) as u64).min(self.max)
        } else {
            self.cap
        };
        let first = !std::mem::replace(&mut self.applied, true);
        (cap != self.cap || first).then(|| {
            self.cap = cap;
            cap
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: u64 = 5_000_000;
    const RTT: Duration = Duration::from_millis(100);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// With the latency lane quiet, bulk keeps the whole `link.max_rate` whatever the queue
    /// (given to the socket at the first tick, whatever an earlier process left on it).
    #[test]
    fn a_quiet_lane_leaves_bulk_its_rate() {
        let t0 = Instant::now();
        let mut r = Room::new(MAX, ms(5));
        assert_eq!(r.tick(t0, 0, RTT + ms(80), RTT), Some(MAX));
        for i in 1..100 {
            assert_eq!(r.tick(t0 + TICK * i, 0, RTT + ms(80), RTT), None);
        }
        assert_eq!(r.cap(), MAX);
        assert!(!r.making_room());
    }

    /// A queue over the target while the lane is busy cuts the cap, once per RTT, down to the
    /// floor and no further; under half the target it climbs back; a lane quiet for
    /// [`QUIET_AFTER`] gives bulk its rate back at once.
    #[test]
    fn a_queue_behind_latency_traffic_steps_bulk_down_and_back() {
        let t0 = Instant::now();
        let mut r = Room::new(MAX, ms(5));
        assert_eq!(r.tick(t0, 0, RTT, RTT), Some(MAX));
        let mut lane = 0;
        let mut cuts = Vec::new();
        let mut t = t0;
        for _ in 0..40 {
            lane += 8192;
            t += TICK;
            if let Some(c) = r.tick(t, lane, RTT + ms(30), RTT) {
                cuts.push((t, c));
            }
        }
        // Each cut 15% off the last, at least a smoothed RTT (130 ms) after it, to the floor.
        let caps: Vec<u64> = cuts.iter().map(|c| c.1).collect();
        assert_eq!(
            caps,
            [4_250_000, 3_612_500, 3_070_625, 2_610_031, 2_500_000]
        );
        assert!(cuts.windows(2).all(|w| w[1].0 - w[0].0 >= RTT + ms(30)));
        assert_eq!(r.cap(), MAX / 2, "the floor");
        assert!(r.making_room());
        // Between half the target and the target: held.
        t += TICK;
        lane += 2048;
        assert_eq!(r.tick(t, lane, RTT + ms(4), RTT), None);
        // Under half: back up by steps.
        let mut up = 0;
        while r.cap() < MAX {
            t += TICK;
            lane += 2048;
            r.tick(t, lane, RTT + ms(1), RTT).expect("a step up");
            up += 1;
        }
        assert_eq!(up, 25);
        // Down again, then the lane goes quiet (a keepalive's few bytes do not count): the
        // whole rate comes back after QUIET_AFTER.
        t += TICK;
        lane += 2048;
        r.tick(t, lane, RTT + ms(30), RTT).expect("a cut");
        assert!(r.making_room());
        let quiet = t;
        while t < quiet + QUIET_AFTER - TICK {
            t += TICK;
            lane += 5;
            assert_eq!(r.tick(t, lane, RTT + ms(4), RTT), None);
        }
        t = quiet + QUIET_AFTER;
        assert_eq!(r.tick(t, lane, RTT + ms(30), RTT), Some(MAX));
    }

    /// Bulk paused while the latency lane is busy waits at the floor, and starts from it: it
    /// climbs by steps while the queue stays short. With the lane quiet, a paused bulk keeps
    /// the whole rate.
    #[test]
    fn bulk_starting_beside_latency_traffic_starts_from_the_floor() {
        let t0 = Instant::now();
        let mut r = Room::new(MAX, ms(5));
        let (mut t, mut lane, sent) = (t0, 0, 1000);
        r.bulk(t, sent);
        assert_eq!(r.tick(t, lane, RTT, RTT), Some(MAX));
        // Quiet lane, paused bulk: the whole rate.
        for _ in 0..10 {
            t += TICK;
            r.bulk(t, sent);
            assert_eq!(r.tick(t, lane, RTT, RTT), None);
        }
        // The lane gets busy while bulk is paused: the floor.
        t += TICK;
        lane += 8192;
        r.bulk(t, sent + 100);
        assert_eq!(r.tick(t, lane, RTT, RTT), Some(MAX / 2));
        assert!(
            r.making_room() && !r.yielding(),
            "a paused bulk loses nothing"
        );
        // Bulk starts: from the floor up by steps of 2%, the queue short.
        let mut sent = sent;
        let mut steps = 0;
        while r.cap() < MAX {
            t += TICK;
            lane += 8192;
            sent += 300_000;
            r.bulk(t, sent);
            r.tick(t, lane, RTT + ms(1), RTT).expect("a step up");
            assert_eq!(r.yielding(), r.cap() < MAX);
            steps += 1;
        }
        assert_eq!(steps, 25);
        // Paused again for longer than BULK_PAUSED_AFTER: back at the floor.
        let paused = t;
        while t < paused + BULK_PAUSED_AFTER {
            t += TICK;
            lane += 8192;
            r.bulk(t, sent + 10);
            r.tick(t, lane, RTT + ms(1), RTT);
        }
        assert_eq!(r.cap(), MAX / 2);
    }

    /// No RTT measured yet (a least RTT of zero): nothing to judge, bulk keeps its rate.
    #[test]
    fn no_rtt_sample_changes_nothing() {
        let t0 = Instant::now();
        let mut r = Room::new(MAX, ms(5));
        assert_eq!(r.tick(t0, 100_000, ms(50), Duration::ZERO), Some(MAX));
        assert_eq!(r.tick(t0 + TICK, 200_000, ms(50), Duration::ZERO), None);
        assert_eq!(r.cap(), MAX);
    }
}
