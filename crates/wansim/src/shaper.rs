//! The impairment model of one direction of the emulated link, as pure code.
//!
//! [`Shaper::admit`] decides, for a packet arriving at `now`, whether it is dropped (and why) or
//! when it leaves the far end: after waiting its turn in a drop-tail queue, serialization at the
//! bottleneck rate, the one-way delay and jitter. Loss is random (Bernoulli) or bursty
//! (Gilbert-Elliott with netem's `gemodel p r 1-h 1-k` meanings). Time and randomness come in as
//! arguments, so the model is unit-tested deterministically.

use std::time::{Duration, Instant};

use rand::Rng;

/// Gilbert-Elliott burst loss, with the parameter meanings of netem's `gemodel`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GilbertElliott {
    /// Probability of moving from the good to the bad state, per step (see `clock`).
    pub p: f64,
    /// Probability of moving from the bad to the good state, per step.
    pub r: f64,
    /// Loss probability in the bad state (netem's `1-h`; 1.0 drops every packet there).
    pub bad_loss: f64,
    /// Loss probability in the good state (netem's `1-k`; usually 0).
    pub good_loss: f64,
    /// What a step of the model is.
    pub clock: BurstClock,
}

/// What moves a Gilbert-Elliott model from one state to the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BurstClock {
    /// Every packet (netem's `gemodel`): a burst lasts a number of packets however far apart
    /// they come, so on a quiet link it takes the next few packets even seconds later,
    /// retransmissions included.
    Packet,
    /// Every this much time on the line (a packet's time at the line rate, for bursts counted
    /// in packets of a full line): a burst lasts a time, as a fade or a queue overflowing
    /// does. A packet is judged by the state when the line starts sending it, and a packet
    /// lost this way still takes its time on the line.
    Time(Duration),
}

impl GilbertElliott {
    /// Loss in bursts: `mean_loss` of the packets over the long run, lost in runs of
    /// `mean_burst` packets on average (every packet in the bad state is lost, none in the good
    /// one). `None` unless `0 < mean_loss < 1` and `mean_burst >= 1`.
    pub fn bursts(mean_loss: f64, mean_burst: f64) -> Option<GilbertElliott> {
        if !(mean_loss > 0.0 && mean_loss < 1.0 && mean_burst >= 1.0 && mean_burst.is_finite()) {
            return None;
        }
        // A bad state lasts 1/r packets; it is entered p/(p+r) of the time.
        let r = 1.0 / mean_burst;
        let p = mean_loss * r / (1.0 - mean_loss);
        (p <= 1.0).then_some(GilbertElliott {
            p,
            r,
            bad_loss: 1.0,
            good_loss: 0.0,
            clock: BurstClock::Packet,
        })
    }

    /// The same model stepped by time on a line of `rate_bps`: a step is the time a
    /// `packet`-byte packet takes at that rate, so on a full line of such packets it loses as
    /// the per-packet model does, and on a quiet one a burst is over in its time.
    pub fn timed(self, rate_bps: u64, packet: u64) -> GilbertElliott {
        let nanos = (packet * 8).saturating_mul(1_000_000_000) / rate_bps.max(1);
        GilbertElliott {
            clock: BurstClock::Time(Duration::from_nanos(nanos.max(1))),
            ..self
        }
    }

    /// Whether the model is in its bad state `steps` steps after a state of `bad`, drawn.
    fn advance(&self, bad: bool, steps: u64, rng: &mut impl Rng) -> bool {
        match steps {
            0 => bad,
            1 => {
                if bad {
                    rng.random::<f64>() >= self.r
                } else {
                    rng.random::<f64>() < self.p
                }
            }
            _ => {
                // The two-state chain after n steps: the bad share plus what is left of the
                // start, (1 - p - r)^n.
                let total = self.p + self.r;
                if total <= 0.0 {
                    return bad;
                }
                let share = self.p / total;
                let left = i32::try_from(steps).map_or(0.0, |n| (1.0 - total).powi(n));
                let p_bad = if bad {
                    share + (1.0 - share) * left
                } else {
                    share * (1.0 - left)
                };
                rng.random::<f64>() < p_bad
            }
        }
    }

    /// The mean run of packets lost together (with every packet of the bad state lost).
    pub fn mean_burst(&self) -> f64 {
        if self.r > 0.0 {
            1.0 / self.r
        } else {
            f64::INFINITY
        }
    }

    /// The long-run loss rate of this model.
    pub fn mean_loss(&self) -> f64 {
        let bad_share = if self.p + self.r > 0.0 {
            self.p / (self.p + self.r)
        } else {
            0.0
        };
        bad_share * self.bad_loss + (1.0 - bad_share) * self.good_loss
    }
}

/// Limit of the bottleneck queue.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum QueueLimit {
    /// At most this many bytes waiting for the line.
    Bytes(u64),
    /// At most this much waiting, in time at line rate.
    Time(Duration),
}

/// Impairments of one direction.
#[derive(Debug, Clone, PartialEq)]
pub struct DirParams {
    /// Bottleneck rate in bits per second; `None` forwards at once.
    pub rate_bps: Option<u64>,
    /// One-way propagation delay.
    pub delay: Duration,
    /// Uniform random extra delay in `[0, jitter)`; packets keep their order unless `reorder` > 0.
    pub jitter: Duration,
    /// Random loss probability per packet.
    pub loss: f64,
    /// Bursty loss; applied in addition to `loss`.
    pub burst: Option<GilbertElliott>,
    /// Probability that a packet skips the delay line's order (is delivered early).
    pub reorder: f64,
    /// Probability that a packet is delivered twice.
    pub duplicate: f64,
    pub queue: QueueLimit,
    /// When true the direction passes nothing (a cut link).
    pub cut: bool,
}

impl Default for DirParams {
    fn default() -> Self {
        DirParams {
            rate_bps: None,
            delay: Duration::ZERO,
            jitter: Duration::ZERO,
            loss: 0.0,
            burst: None,
            reorder: 0.0,
            duplicate: 0.0,
            queue: QueueLimit::Time(Duration::from_millis(100)),
            cut: false,
        }
    }
}

impl DirParams {
    /// The queue limit in bytes at this direction's rate.
    pub fn queue_bytes(&self) -> u64 {
        match (self.queue, self.rate_bps) {
            (QueueLimit::Bytes(b), _) => b,
            (QueueLimit::Time(t), Some(r)) => ((r as f64 / 8.0) * t.as_secs_f64()) as u64,
            (QueueLimit::Time(_), None) => u64::MAX,
        }
        .max(3000)
    }
}

/// Why a packet was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropCause {
    Loss,
    Burst,
    Queue,
    Cut,
}

/// What happens to one packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Drop(DropCause),
    /// Deliver at this time (twice if `duplicate`).
    Deliver {
        at: Instant,
        duplicate: bool,
    },
}

/// State of one direction.
#[derive(Debug)]
pub struct Shaper {
    /// When the line finishes serializing the last admitted packet.
    line_free: Instant,
    /// Delivery time of the last in-order packet (jitter never reorders).
    last_delivery: Instant,
    ge_bad: bool,
    /// Where a time-stepped burst model last stepped.
    ge_at: Instant,
}

impl Shaper {
    pub fn new(now: Instant) -> Self {
        Shaper {
            line_free: now,
            last_delivery: now,
            ge_bad: false,
            ge_at: now,
        }
    }

    /// Bytes waiting for the line at `now`.
    pub fn backlog_bytes(&self, now: Instant, p: &DirParams) -> u64 {
        match p.rate_bps {
            Some(r) => {
                let wait = self.line_free.saturating_duration_since(now);
                (wait.as_secs_f64() * r as f64 / 8.0) as u64
            }
            None => 0,
        }
    }

    /// Decides the fate of a packet of `len` bytes arriving at `now`.
    pub fn admit(
        &mut self,
        now: Instant,
        len: usize,
        p: &DirParams,
        rng: &mut impl Rng,
    ) -> Verdict {
        if p.cut {
            return Verdict::Drop(DropCause::Cut);
        }
        let timed = p.burst.and_then(|ge| match ge.clock {
            BurstClock::Time(step) => Some((ge, step)),
            BurstClock::Packet => None,
        });
        if let Some(ge) = p.burst.filter(|_| timed.is_none()) {
            // Transition first, then lose according to the state (netem's order).
            self.ge_bad = ge.advance(self.ge_bad, 1, rng);
            if self.lost_in_burst(&ge, rng) {
                return Verdict::Drop(DropCause::Burst);
            }
        }
        if p.loss > 0.0 && rng.random::<f64>() < p.loss {
            return Verdict::Drop(DropCause::Loss);
        }
        let start = self.line_free.max(now);
        let leave_line = match p.rate_bps {
            Some(r) if r > 0 => {
                if self.backlog_bytes(now, p) + len as u64 > p.queue_bytes() {
                    return Verdict::Drop(DropCause::Queue);
                }
                let ser = Duration::from_nanos((len as u64 * 8).saturating_mul(1_000_000_000) / r);
                self.line_free = start + ser;
                self.line_free
            }
            _ => now,
        };
        if let Some((ge, step)) = timed {
            // The steps since the last one, up to when the line starts on this packet.
            let steps = start.saturating_duration_since(self.ge_at).as_nanos() / step.as_nanos();
            let steps = u64::try_from(steps).unwrap_or(u64::MAX);
            self.ge_bad = ge.advance(self.ge_bad, steps, rng);
            self.ge_at += step.saturating_mul(u32::try_from(steps).unwrap_or(u32::MAX));
            if self.ge_at + step < start {
                // Beyond what one multiplication reaches (hours idle): start the count here.
                self.ge_at = start;
            }
            if self.lost_in_burst(&ge, rng) {
                return Verdict::Drop(DropCause::Burst);
            }
        }
        let jitter = if p.jitter.is_zero() {
            Duration::ZERO
        } else {
            p.jitter.mul_f64(rng.random::<f64>())
        };
        let mut at = leave_line + p.delay + jitter;
        if p.reorder > 0.0 && rng.random::<f64>() < p.reorder {
            // Delivered without the propagation delay's ordering: it may overtake earlier packets.
            at = leave_line + p.delay / 2;
        } else {
            at = at.max(self.last_delivery);
            self.last_delivery = at;
        }
        let duplicate = p.duplicate > 0.0 && rng.random::<f64>() < p.duplicate;
        Verdict::Deliver { at, duplicate }
    }

    /// Whether a packet is lost in the burst model's present state.
    fn lost_in_burst(&self, ge: &GilbertElliott, rng: &mut impl Rng) -> bool {
        let l = if self.ge_bad {
            ge.bad_loss
        } else {
            ge.good_loss
        };
        l > 0.0 && rng.random::<f64>() < l
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn rng() -> rand::rngs::StdRng {
        rand::rngs::StdRng::seed_from_u64(42)
    }

    #[test]
    fn serialization_and_delay() {
        let t0 = Instant::now();
        let mut s = Shaper::new(t0);
        let p = DirParams {
            rate_bps: Some(12_000_000),
            delay: Duration::from_millis(50),
            ..DirParams::default()
        };
        // 1500 bytes at 12 Mbit/s take 1 ms on the line.
        let mut r = rng();
        let a = s.admit(t0, 1500, &p, &mut r);
        let b = s.admit(t0, 1500, &p, &mut r);
        assert_eq!(
            a,
            Verdict::Deliver {
                at: t0 + Duration::from_millis(51),
                duplicate: false
            }
        );
        assert_eq!(
            b,
            Verdict::Deliver {
                at: t0 + Duration::from_millis(52),
                duplicate: false
            }
        );
    }

    #[test]
    fn drop_tail_queue() {
        let t0 = Instant::now();
        let mut s = Shaper::new(t0);
        let p = DirParams {
            rate_bps: Some(8_000_000),
            queue: QueueLimit::Bytes(15_000),
            ..DirParams::default()
        };
        let mut r = rng();
        let verdicts: Vec<_> = (0..20).map(|_| s.admit(t0, 1500, &p, &mut r)).collect();
        let dropped = verdicts
            .iter()
            .filter(|v| **v == Verdict::Drop(DropCause::Queue))
            .count();
        assert_eq!(dropped, 10);
    }

    #[test]
    fn random_loss_rate() {
        let t0 = Instant::now();
        let mut s = Shaper::new(t0);
        let p = DirParams {
            loss: 0.01,
            ..DirParams::default()
        };
        let mut r = rng();
        let n = 200_000;
        let lost = (0..n)
            .filter(|_| matches!(s.admit(t0, 100, &p, &mut r), Verdict::Drop(DropCause::Loss)))
            .count();
        let sigma = (n as f64 * 0.01 * 0.99).sqrt();
        assert!(
            (lost as f64 - n as f64 * 0.01).abs() < 4.0 * sigma,
            "{lost}"
        );
    }

    /// `n` packets through `s` at one instant: the share lost, and the mean run of packets
    /// lost together.
    fn losses(s: &mut Shaper, p: &DirParams, n: usize) -> (f64, f64) {
        let t0 = Instant::now();
        let mut r = rng();
        let lost: Vec<bool> = (0..n)
            .map(|_| matches!(s.admit(t0, 100, p, &mut r), Verdict::Drop(_)))
            .collect();
        rate_and_mean_run(&lost)
    }

    /// The share of packets lost and the mean run of consecutive losses.
    fn rate_and_mean_run(lost: &[bool]) -> (f64, f64) {
        let rate = lost.iter().filter(|l| **l).count() as f64 / lost.len() as f64;
        let runs: Vec<usize> = lost
            .split(|l| !*l)
            .map(<[bool]>::len)
            .filter(|n| *n > 0)
            .collect();
        (rate, runs.iter().sum::<usize>() as f64 / runs.len() as f64)
    }

    #[test]
    fn gilbert_elliott_bursts() {
        let t0 = Instant::now();
        let mut s = Shaper::new(t0);
        let ge = GilbertElliott {
            p: 0.01,
            r: 0.25,
            bad_loss: 1.0,
            good_loss: 0.0,
            clock: BurstClock::Packet,
        };
        let p = DirParams {
            burst: Some(ge),
            ..DirParams::default()
        };
        let (rate, mean) = losses(&mut s, &p, 400_000);
        assert!(
            (rate - ge.mean_loss()).abs() < 0.004,
            "loss {rate} vs {}",
            ge.mean_loss()
        );
        assert!((mean - 4.0).abs() < 0.3, "mean burst {mean}");
    }

    /// Bursts given as a mean loss and a mean run length come out as asked.
    #[test]
    fn bursts_from_mean_loss_and_run_length() {
        let ge = GilbertElliott::bursts(0.01, 5.0).expect("valid");
        assert!((ge.mean_loss() - 0.01).abs() < 1e-12 && (ge.mean_burst() - 5.0).abs() < 1e-12);
        let t0 = Instant::now();
        let mut s = Shaper::new(t0);
        let p = DirParams {
            burst: Some(ge),
            ..DirParams::default()
        };
        let (rate, mean) = losses(&mut s, &p, 1_000_000);
        assert!((rate - 0.01).abs() < 0.002, "loss {rate}");
        assert!((mean - 5.0).abs() < 0.4, "mean burst {mean}");
        for (loss, burst) in [(0.0, 5.0), (1.0, 5.0), (0.01, 0.5), (0.01, f64::NAN)] {
            assert!(
                GilbertElliott::bursts(loss, burst).is_none(),
                "{loss} {burst}"
            );
        }
    }

    /// Packets of 1500 bytes offered at `every` on a 45 Mbit/s line: the share lost and the
    /// mean run of consecutive losses.
    fn losses_spaced(ge: GilbertElliott, every: Duration, n: u32) -> (f64, f64) {
        let t0 = Instant::now();
        let mut s = Shaper::new(t0);
        let p = DirParams {
            rate_bps: Some(45_000_000),
            burst: Some(ge),
            queue: QueueLimit::Bytes(u64::MAX / 2),
            ..DirParams::default()
        };
        let mut r = rng();
        let lost: Vec<bool> = (0..n)
            .map(|i| {
                let now = t0 + every * i;
                matches!(s.admit(now, 1500, &p, &mut r), Verdict::Drop(_))
            })
            .collect();
        rate_and_mean_run(&lost)
    }

    /// Bursts stepped by the line's time lose as per-packet ones do on a full line, and last a
    /// time on a quiet one: packets 10 ms apart are lost one by one, at the same mean loss,
    /// where per-packet bursts take five of them in a row.
    #[test]
    fn bursts_in_time_last_a_time() {
        let ge = GilbertElliott::bursts(0.01, 5.0).expect("valid");
        let timed = ge.timed(45_000_000, 1500);
        assert_eq!(timed.clock, BurstClock::Time(Duration::from_nanos(266_666)));
        // Offered faster than the line sends: a full line, lost packets included.
        let (rate, mean) = losses_spaced(timed, Duration::from_micros(200), 400_000);
        assert!((rate - 0.01).abs() < 0.002, "full line: loss {rate}");
        assert!((mean - 5.0).abs() < 0.5, "full line: mean burst {mean}");
        let (rate, mean) = losses_spaced(timed, Duration::from_millis(10), 200_000);
        assert!((rate - 0.01).abs() < 0.002, "quiet line: loss {rate}");
        assert!(mean < 1.1, "quiet line: mean burst {mean}");
        let (rate, mean) = losses_spaced(ge, Duration::from_millis(10), 200_000);
        assert!((rate - 0.01).abs() < 0.002, "per packet: loss {rate}");
        assert!((mean - 5.0).abs() < 0.6, "per packet: mean burst {mean}");
    }

    #[test]
    fn jitter_keeps_order_unless_reordering() {
        let t0 = Instant::now();
        let mut s = Shaper::new(t0);
        let p = DirParams {
            delay: Duration::from_millis(10),
            jitter: Duration::from_millis(5),
            ..DirParams::default()
        };
        let mut r = rng();
        let mut last = t0;
        for i in 0..1000 {
            let now = t0 + Duration::from_micros(i * 100);
            let Verdict::Deliver { at, .. } = s.admit(now, 100, &p, &mut r) else {
                panic!()
            };
            assert!(at >= last);
            last = at;
        }
    }

    #[test]
    fn cut_passes_nothing() {
        let t0 = Instant::now();
        let mut s = Shaper::new(t0);
        let p = DirParams {
            cut: true,
            ..DirParams::default()
        };
        assert_eq!(
            s.admit(t0, 100, &p, &mut rng()),
            Verdict::Drop(DropCause::Cut)
        );
    }
}
