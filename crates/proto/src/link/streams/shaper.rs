//! How bulk services share the link: deficit round robin over services (each service's weight is
//! its `share`), a guaranteed rate served first while a service is behind it (`min_rate`), and a
//! ceiling (`max_rate`), both token buckets in wire bytes fed by `now`. Within a service its
//! ready streams take turns round robin. The unit of fairness is the service, so a service that
//! opens more streams does not take more of the link.
//!
//! Why deficit round robin and not a hierarchical token bucket for the shares: the link's rate
//! changes (a full link drains what the WAN and the congestion control give it, not what
//! `link.bandwidth` states), and round robin by weight divides whatever drains with no rate to
//! configure; only the two rates a user states are buckets. The scheduler picks a service per
//! frame (up to 32 services), so its cost is a few comparisons per 64 KiB.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::frame::StreamId;
use crate::lane::LANES;

/// How one service shares this side's sending direction of the link with the other bulk
/// services. Rates are in bytes per second of frame bytes on the link (after optimization: what
/// the WAN carries).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shaping {
    /// Weight among the bulk services with data (at least 1).
    pub share: u32,
    /// Served before any share while the service has data and has sent less than this.
    pub min_rate: Option<u64>,
    /// Never sends faster than this, even on an idle link.
    pub max_rate: Option<u64>,
}

impl Default for Shaping {
    fn default() -> Self {
        Shaping {
            share: 1,
            min_rate: None,
            max_rate: None,
        }
    }
}

/// Most share a service may have: a round of the largest share is then at most 6.4 MB.
pub const MAX_SHARE: u32 = 100;
/// Bytes a service's deficit grows by per round and share unit: a whole coded frame.
const QUANTUM: i64 = 64 * 1024;
/// How far ahead of its rate a bucket may run: a burst of this much of the rate, and never less
/// than two frames (so a slow rate still sends whole frames).
const BURST: Duration = Duration::from_millis(100);
const MIN_BURST: f64 = 2.0 * 65_536.0;

/// What a service's sending looked like, for its metrics (drained with the wire counts).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ShapeCount {
    /// Time it had data but waited for its `max_rate`.
    pub held: Duration,
    /// Time it had data and sent below its `min_rate`.
    pub below_min: Duration,
}

/// A token bucket in bytes.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    rate: f64,
    cap: f64,
    tokens: f64,
}

impl Bucket {
    fn new(rate: u64) -> Self {
        let rate = rate.max(1) as f64;
        let cap = (rate * BURST.as_secs_f64()).max(MIN_BURST);
        Bucket {
            rate,
            cap,
            tokens: cap,
        }
    }

    /// Adds `dt` of tokens; returns the time of `dt` spent with the bucket full (tokens lost to
    /// the cap) and the time spent below zero.
    fn refill(&mut self, dt: Duration) -> (Duration, Duration) {
        let secs = dt.as_secs_f64();
        let before = self.tokens;
        let after = before + self.rate * secs;
        let overflow = (after - self.cap).max(0.0);
        let negative = if before < 0.0 {
            (-before / self.rate).min(secs)
        } else {
            0.0
        };
        self.tokens = after.min(self.cap);
        (
            Duration::from_secs_f64(overflow / self.rate),
            Duration::from_secs_f64(negative),
        )
    }

    fn charge(&mut self, n: u64) {
        self.tokens = (self.tokens - n as f64).max(-self.cap);
    }

    /// How long until the bucket holds a token again.
    fn until_positive(&self) -> Duration {
        if self.tokens > 0.0 {
            return Duration::ZERO;
        }
        Duration::from_secs_f64((1.0 - self.tokens) / self.rate)
    }
}

/// One service's place in the scheduler: its settings and buckets (link-wide), and per lane its
/// ready streams and deficit.
#[derive(Debug)]
struct Service {
    share: u32,
    min: Option<Bucket>,
    max: Option<Bucket>,
    count: ShapeCount,
    ready: [VecDeque<StreamId>; LANES],
    deficit: [i64; LANES],
    /// True while the service is in the lane's round (it may have run out of streams since).
    in_round: [bool; LANES],
}

impl Service {
    fn new(s: Shaping) -> Self {
        Service {
            share: s.share.clamp(1, MAX_SHARE),
            min: s.min_rate.map(Bucket::new),
            max: s.max_rate.map(Bucket::new),
            count: ShapeCount::default(),
            ready: Default::default(),
            deficit: [0; LANES],
            in_round: [false; LANES],
        }
    }

    fn set(&mut self, s: Shaping) {
        self.share = s.share.clamp(1, MAX_SHARE);
        let keep = |b: &mut Option<Bucket>, rate: Option<u64>| match (b.as_mut(), rate) {
            (Some(b), Some(r)) => {
                // Tokens carry over: a reload does not hand out a fresh burst.
                let n = Bucket::new(r);
                b.rate = n.rate;
                b.cap = n.cap;
                b.tokens = b.tokens.min(b.cap);
            }
            (_, r) => *b = r.map(Bucket::new),
        };
        keep(&mut self.min, s.min_rate);
        keep(&mut self.max, s.max_rate);
    }

    fn has_data(&self) -> bool {
        self.ready.iter().any(|q| !q.is_empty())
    }

    /// Waiting for its ceiling.
    fn held(&self) -> bool {
        self.max.is_some_and(|b| b.tokens <= 0.0)
    }

    /// Behind its guarantee: how far, as a share of the bucket (0 when not).
    fn behind(&self) -> f64 {
        self.min.map_or(0.0, |b| (b.tokens / b.cap).max(0.0))
    }
}

/// The bulk ready queues of every lane, by service.
#[derive(Debug, Default)]
pub(crate) struct Shaper {
    settings: HashMap<Arc<str>, Shaping>,
    services: HashMap<Arc<str>, Service>,
    /// Each lane's round: the services whose turn comes, front first.
    round: [VecDeque<Arc<str>>; LANES],
    /// Streams waiting per lane, over all services.
    queued: [usize; LANES],
    /// When the buckets were last filled.
    now: Option<Instant>,
    /// True while the lane's turn went to a service behind its guarantee: its bytes do not count
    /// against its share (else a guarantee above the share would starve it later).
    priority_turn: [bool; LANES],
}

impl Shaper {
    /// Sets every service's shaping (a service not named gets the default); streams and their
    /// turns stay where they are.
    pub fn set(&mut self, settings: HashMap<Arc<str>, Shaping>) {
        for (name, s) in &mut self.services {
            s.set(settings.get(name).copied().unwrap_or_default());
        }
        self.settings = settings;
    }

    fn service(&mut self, name: &Arc<str>) -> &mut Service {
        let settings = &self.settings;
        self.services
            .entry(name.clone())
            .or_insert_with(|| Service::new(settings.get(name).copied().unwrap_or_default()))
    }

    /// Queues a stream of `service` on `lane`: at the back, or at the front to keep its turn.
    pub fn push(&mut self, lane: usize, service: &Arc<str>, id: StreamId, front: bool) {
        let s = self.service(service);
        if front {
            s.ready[lane].push_front(id);
        } else {
            s.ready[lane].push_back(id);
        }
        let join = !s.in_round[lane];
        s.in_round[lane] = true;
        if join {
            // A service that comes back starts with no deficit: what it did not send while it
            // had nothing to send is not owed to it.
            s.deficit[lane] = 0;
            if front {
                self.round[lane].push_front(service.clone());
            } else {
                self.round[lane].push_back(service.clone());
            }
        }
        self.queued[lane] += 1;
    }

    /// True if a stream of `lane` may be sent now (at the last time seen): some service with
    /// data is not waiting for its ceiling.
    pub fn any_sendable(&self, lane: usize) -> bool {
        self.queued[lane] > 0
            && self.round[lane].iter().any(|n| {
                self.services
                    .get(n)
                    .is_some_and(|s| !s.ready[lane].is_empty() && !s.held())
            })
    }

    /// Fills the buckets up to `now`, counting the time services with data spent held or below
    /// their guarantee.
    pub fn advance(&mut self, now: Instant) {
        let Some(last) = self.now.replace(now) else {
            return;
        };
        let dt = now.saturating_duration_since(last);
        if dt.is_zero() {
            return;
        }
        for s in self.services.values_mut() {
            let data = s.has_data();
            if let Some(b) = s.min.as_mut() {
                let (full, _) = b.refill(dt);
                if data {
                    s.count.below_min += full;
                }
            }
            if let Some(b) = s.max.as_mut() {
                let (_, negative) = b.refill(dt);
                if data {
                    s.count.held += negative;
                }
            }
        }
    }

    /// When a service with data that waits for its ceiling may send again.
    pub fn wake(&self) -> Option<Instant> {
        let now = self.now?;
        self.services
            .values()
            .filter(|s| s.held() && s.has_data())
            .filter_map(|s| s.max.map(|b| now + b.until_positive()))
            .min()
    }

    /// The next stream whose turn it is on `lane`, and its service: a service behind its
    /// guarantee first (the furthest behind), else deficit round robin by share; services
    /// waiting for their ceiling are passed over.
    pub fn next(&mut self, lane: usize) -> Option<(Arc<str>, StreamId)> {
        if self.queued[lane] == 0 {
            return None;
        }
        let round = &mut self.round[lane];
        let services = &mut self.services;
        // Services that ran out of streams leave the round (and forget their deficit).
        round.retain(|n| {
            let s = services.get_mut(n);
            match s {
                Some(s) if !s.ready[lane].is_empty() => true,
                Some(s) => {
                    s.in_round[lane] = false;
                    s.deficit[lane] = 0;
                    false
                }
                None => false,
            }
        });
        let behind = round
            .iter()
            .filter_map(|n| services.get(n).map(|s| (n, s)))
            .filter(|(_, s)| !s.held() && s.behind() > 0.0)
            .max_by(|a, b| a.1.behind().total_cmp(&b.1.behind()))
            .map(|(n, _)| n.clone());
        self.priority_turn[lane] = behind.is_some();
        let name = match behind {
            Some(n) => n,
            None => {
                let mut passed = 0;
                loop {
                    let n = round.front()?.clone();
                    let s = services.get_mut(&n)?;
                    if s.held() {
                        passed += 1;
                        if passed >= round.len() {
                            return None;
                        }
                        round.rotate_left(1);
                        continue;
                    }
                    passed = 0;
                    if s.deficit[lane] > 0 {
                        break n;
                    }
                    s.deficit[lane] += QUANTUM * i64::from(s.share);
                    round.rotate_left(1);
                }
            }
        };
        let id = services.get_mut(&name)?.ready[lane].pop_front()?;
        self.queued[lane] -= 1;
        Some((name, id))
    }

    /// Charges a service for `n` frame bytes it just sent on `lane`.
    pub fn charge(&mut self, lane: usize, service: &Arc<str>, n: u64) {
        if n == 0 {
            return;
        }
        let priority = std::mem::take(&mut self.priority_turn[lane]);
        let s = self.service(service);
        if !priority {
            s.deficit[lane] = s.deficit[lane].saturating_sub(i64::try_from(n).unwrap_or(i64::MAX));
        }
        if let Some(b) = s.min.as_mut() {
            b.charge(n);
        }
        if let Some(b) = s.max.as_mut() {
            b.charge(n);
        }
    }

    /// Takes the services' counts since the last call.
    pub fn take_counts(&mut self) -> Vec<(Arc<str>, ShapeCount)> {
        self.services
            .iter_mut()
            .filter(|(_, s)| s.count != ShapeCount::default())
            .map(|(n, s)| (n.clone(), std::mem::take(&mut s.count)))
            .collect()
    }

    /// Forgets every queued turn (the link's streams are gone); settings and buckets stay.
    pub fn clear(&mut self) {
        for s in self.services.values_mut() {
            for l in 0..LANES {
                s.ready[l].clear();
                s.in_round[l] = false;
                s.deficit[l] = 0;
            }
        }
        self.round = Default::default();
        self.queued = [0; LANES];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> Arc<str> {
        Arc::from(s)
    }

    /// Serves `frames` turns of `size` bytes on lane 0 with every stream always ready again, a
    /// turn every `every`; returns the bytes each service sent.
    fn serve(
        sh: &mut Shaper,
        frames: usize,
        size: u64,
        every: Duration,
        mut t: Instant,
    ) -> HashMap<Arc<str>, u64> {
        let mut sent = HashMap::new();
        for _ in 0..frames {
            t += every;
            sh.advance(t);
            if let Some((svc, id)) = sh.next(0) {
                sh.charge(0, &svc, size);
                *sent.entry(svc.clone()).or_insert(0) += size;
                sh.push(0, &svc, id, false);
            }
        }
        sent
    }

    fn with_streams(sh: &mut Shaper, svc: &str, first: u32, n: u32) {
        for i in 0..n {
            sh.push(0, &name(svc), StreamId(first + 2 * i), false);
        }
    }

    #[test]
    fn shares_divide_the_link_whatever_the_stream_counts() {
        let mut sh = Shaper::default();
        sh.set(HashMap::from([(
            name("redo"),
            Shaping {
                share: 3,
                ..Shaping::default()
            },
        )]));
        with_streams(&mut sh, "redo", 1, 1);
        with_streams(&mut sh, "backup", 3, 16);
        let sent = serve(
            &mut sh,
            4000,
            65_536,
            Duration::from_millis(1),
            Instant::now(),
        );
        let ratio = sent[&name("redo")] as f64 / sent[&name("backup")] as f64;
        assert!((ratio - 3.0).abs() < 0.05 * 3.0, "3:1 shares gave {ratio}");
    }

    #[test]
    fn a_ceiling_holds_and_wakes_the_link_when_it_may_send_again() {
        let mut sh = Shaper::default();
        sh.set(HashMap::from([(
            name("capped"),
            Shaping {
                max_rate: Some(1_000_000),
                ..Shaping::default()
            },
        )]));
        with_streams(&mut sh, "capped", 1, 4);
        let t0 = Instant::now();
        sh.advance(t0);
        // 10 s of frames offered every millisecond: 1 MB/s lets about one in 65 through.
        let sent = serve(&mut sh, 10_000, 65_536, Duration::from_millis(1), t0);
        let rate = sent[&name("capped")] as f64 / 10.0;
        assert!(rate < 1_020_000.0 && rate > 950_000.0, "rate {rate}");
        let counts = sh.take_counts();
        assert!(counts[0].1.held > Duration::from_secs(8), "{counts:?}");
        assert!(!sh.any_sendable(0) || sh.wake().is_none());
        if let Some(w) = sh.wake() {
            sh.advance(w);
            assert!(sh.any_sendable(0));
        }
    }
}
