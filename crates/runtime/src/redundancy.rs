//! How many connections carry the latency lane, each with a copy of its bytes (see
//! [`wanopt_proto::copies`]): the services' `redundancy` setting, and the `auto` policy that
//! drops to one connection while latency traffic would crowd out bulk. Pure: fed byte counts
//! and `now`.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use wanopt_proto::copies::MAX_COPIES;

/// A latency service's `redundancy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Redundancy {
    /// One connection.
    Off,
    /// Two connections while the latency lane's traffic is a small share of the link
    /// ([`AUTO_OFF_SHARE`]), one otherwise; three while its connections see more loss than
    /// [`AUTO_THREE_LOSS`], five while they do and the lane is quiet enough
    /// ([`AUTO_FIVE_SHARE`]).
    #[default]
    Auto,
    /// Always this many connections (2 to 5).
    Copies(usize),
}

impl Redundancy {
    /// Parses `auto`, `off`, or 2 to 5.
    pub fn parse(v: &str) -> Result<Self, String> {
        match v {
            "auto" => Ok(Redundancy::Auto),
            "off" | "1" => Ok(Redundancy::Off),
            "2" => Ok(Redundancy::Copies(2)),
            "3" => Ok(Redundancy::Copies(3)),
            "4" => Ok(Redundancy::Copies(4)),
            "5" => Ok(Redundancy::Copies(5)),
            _ => Err(format!("{v:?} is not auto, off, 2, 3, 4 or 5")),
        }
    }

    /// The most connections this setting ever asks for (what the hello offers the peer).
    pub fn most(self) -> usize {
        match self {
            Redundancy::Off => 1,
            Redundancy::Auto => MAX_COPIES,
            Redundancy::Copies(n) => n.clamp(1, MAX_COPIES),
        }
    }

    /// The link's setting from its latency services': the most any of them asks for (`auto`
    /// when there are none, so the peer's latency services decide).
    pub fn of_link(latency_services: impl IntoIterator<Item = Redundancy>) -> Redundancy {
        latency_services
            .into_iter()
            .reduce(|a, b| match (a, b) {
                (Redundancy::Copies(x), Redundancy::Copies(y)) => Redundancy::Copies(x.max(y)),
                (c @ Redundancy::Copies(_), _) | (_, c @ Redundancy::Copies(_)) => c,
                (Redundancy::Auto, _) | (_, Redundancy::Auto) => Redundancy::Auto,
                _ => Redundancy::Off,
            })
            .unwrap_or_default()
    }

    /// The word the config and `wanoptd check` use.
    pub fn label(self) -> String {
        match self {
            Redundancy::Off => "off".into(),
            Redundancy::Auto => "auto".into(),
            Redundancy::Copies(n) => n.to_string(),
        }
    }
}

/// What the link's setting does, in words for `wanoptd check`.
pub fn explain(link: Redundancy, bandwidth_bps: u64) -> String {
    match link {
        Redundancy::Off => "one connection".into(),
        Redundancy::Copies(n) => format!("{n} connections, each with a copy of every write"),
        Redundancy::Auto => format!(
            "2 connections while its traffic stays under {:.1} Mbit/s ({}% of link.bandwidth), else 1; 3 while they see over {}% loss, 5 if then its traffic stays under {:.1} Mbit/s",
            bandwidth_bps as f64 * AUTO_OFF_SHARE / 1e6,
            (AUTO_OFF_SHARE * 100.0) as u32,
            AUTO_THREE_LOSS * 100.0,
            bandwidth_bps as f64 * AUTO_FIVE_SHARE / 1e6,
        ),
    }
}

/// Above this share of the stated bandwidth (either way, over [`AUTO_WINDOW`]) `auto` keeps one
/// connection: the second copy would take a tenth of the link from bulk.
pub const AUTO_OFF_SHARE: f64 = 0.10;
/// `auto` takes its second connection again once the share stayed below this for
/// [`AUTO_BACK_AFTER`].
pub const AUTO_ON_SHARE: f64 = 0.05;
/// Above this share of the lane's segments retransmitted (over [`AUTO_LOSS_WINDOW`]) `auto` keeps
/// three connections: each connection stalls in its own loss recovery for a round trip or more,
/// so with two a message is late whenever one copy is lost while the other recovers (on a 1%
/// link, the 99th percentile of SYNC round trips at 2 RTT); with three, both others must be.
pub const AUTO_THREE_LOSS: f64 = 0.002;
/// A lossy lane whose traffic stays under this share of the stated bandwidth gets five
/// connections from `auto`: five copies of it take no more than [`AUTO_OFF_SHARE`] of the link.
/// Across a T3 that loses 1% each way in bursts, beside a full bulk load, three spaced copies
/// left a p99.9 of 1.86 RTT and five 1.29 (`cargo bench --bench sync_tail -- --preset
/// t3-100ms-fade --spaced-copies 3,5`): a write is late only while every copy's connection is
/// in its own loss recovery.
pub const AUTO_FIVE_SHARE: f64 = AUTO_OFF_SHARE / 5.0;
/// A lane with five goes back to three once its share passed this (and to five again under
/// [`AUTO_FIVE_SHARE`]), so a share near the bound does not dial and drop copies every second.
pub const AUTO_FIVE_OFF_SHARE: f64 = AUTO_FIVE_SHARE * 1.5;
/// `auto` goes back to two once the loss stayed below this over the window.
pub const AUTO_TWO_LOSS: f64 = 0.0008;
/// Fewest segments sent over [`AUTO_LOSS_WINDOW`] for the loss to count.
pub const AUTO_LOSS_SEGMENTS: u64 = 500;
/// The window the lane's loss is measured over (longer than the rate's: a SYNC lane sends a
/// few hundred segments a second at most).
pub const AUTO_LOSS_WINDOW: Duration = Duration::from_secs(30);

/// The window the latency lane's rate is measured over.
pub const AUTO_WINDOW: Duration = Duration::from_secs(5);
/// How long the share must stay low before `auto` copies again.
pub const AUTO_BACK_AFTER: Duration = Duration::from_secs(10);

/// The `auto` decision, fed the latency lane's byte counts each second or so.
#[derive(Debug)]
pub struct CopyPolicy {
    setting: Redundancy,
    /// Stated bandwidth, bytes per second each way.
    bandwidth: f64,
    /// (when, bytes sent, bytes received) on the latency lane, oldest first.
    samples: VecDeque<(Instant, u64, u64)>,
    /// (when, segments retransmitted, data segments sent) on the lane's connections.
    losses: VecDeque<(Instant, u64, u64)>,
    /// `auto` copies now.
    on: bool,
    /// `auto` keeps three (the lane is lossy).
    lossy: bool,
    /// A lossy lane quiet enough for five.
    five: bool,
    /// Since when the share has been below [`AUTO_ON_SHARE`] while off.
    low_since: Option<Instant>,
}

impl CopyPolicy {
    pub fn new(setting: Redundancy, bandwidth_bps: u64) -> Self {
        CopyPolicy {
            setting,
            bandwidth: (bandwidth_bps as f64 / 8.0).max(1.0),
            samples: VecDeque::new(),
            losses: VecDeque::new(),
            on: true,
            lossy: false,
            five: false,
            low_since: None,
        }
    }

    /// Follows a reloaded setting.
    pub fn set(&mut self, setting: Redundancy, bandwidth_bps: u64) {
        self.setting = setting;
        self.bandwidth = (bandwidth_bps as f64 / 8.0).max(1.0);
    }

    /// The latency lane's share of the link over the window, the busier direction's.
    pub fn share(&self) -> f64 {
        let (Some(first), Some(last)) = (self.samples.front(), self.samples.back()) else {
            return 0.0;
        };
        let secs = last.0.saturating_duration_since(first.0).as_secs_f64();
        if secs < 0.5 {
            return 0.0;
        }
        let bytes = (last.1 - first.1).max(last.2 - first.2) as f64;
        bytes / secs / self.bandwidth
    }

    /// The share of the lane's segments retransmitted over the window, if enough were sent.
    pub fn loss(&self) -> Option<f64> {
        let (first, last) = (self.losses.front()?, self.losses.back()?);
        let segments = last.2 - first.2;
        (segments >= AUTO_LOSS_SEGMENTS).then(|| (last.1 - first.1) as f64 / segments as f64)
    }

    /// Records the lane connections' retransmitted and sent data segments (summed; counts that
    /// only grow while the connections stay).
    pub fn segments(&mut self, now: Instant, retransmitted: u64, sent: u64) {
        record(
            &mut self.losses,
            (now, retransmitted, sent),
            AUTO_LOSS_WINDOW,
        );
        match self.loss() {
            Some(l) if l >= AUTO_THREE_LOSS => self.lossy = true,
            Some(l) if l < AUTO_TWO_LOSS => self.lossy = false,
            _ => {}
        }
    }

    /// How many connections to keep, given the latency lane's bytes sent and received so far
    /// (counts that only grow). `auto` switches with hysteresis: off above
    /// [`AUTO_OFF_SHARE`], on again after [`AUTO_BACK_AFTER`] below [`AUTO_ON_SHARE`]; on, it
    /// keeps three while [`segments`](Self::segments) saw over [`AUTO_THREE_LOSS`] loss.
    pub fn wanted(&mut self, now: Instant, sent: u64, received: u64) -> usize {
        record(&mut self.samples, (now, sent, received), AUTO_WINDOW);
        match self.setting {
            Redundancy::Off => 1,
            Redundancy::Copies(n) => n.clamp(1, MAX_COPIES),
            Redundancy::Auto => {
                let share = self.share();
                if self.on && share > AUTO_OFF_SHARE {
                    self.on = false;
                    self.low_since = None;
                } else if !self.on {
                    if share < AUTO_ON_SHARE {
                        let since = *self.low_since.get_or_insert(now);
                        if now.saturating_duration_since(since) >= AUTO_BACK_AFTER {
                            self.on = true;
                        }
                    } else {
                        self.low_since = None;
                    }
                }
                if share < AUTO_FIVE_SHARE {
                    self.five = true;
                } else if share > AUTO_FIVE_OFF_SHARE {
                    self.five = false;
                }
                match (self.on, self.lossy, self.five) {
                    (false, ..) => 1,
                    (true, false, _) => 2,
                    (true, true, false) => 3,
                    (true, true, true) => MAX_COPIES,
                }
            }
        }
    }
}

/// Appends a sample of two counts that only grow to a window of samples, oldest first, and
/// drops those older than `window`. Counts that went back (new connections, a new lane) start
/// the window over.
fn record(samples: &mut VecDeque<(Instant, u64, u64)>, s: (Instant, u64, u64), window: Duration) {
    if samples.back().is_some_and(|l| s.1 < l.1 || s.2 < l.2) {
        samples.clear();
    }
    samples.push_back(s);
    while samples
        .front()
        .is_some_and(|(t, ..)| s.0.saturating_duration_since(*t) > window)
    {
        samples.pop_front();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_parse_and_combine() {
        assert_eq!(Redundancy::parse("auto"), Ok(Redundancy::Auto));
        assert_eq!(Redundancy::parse("off"), Ok(Redundancy::Off));
        assert_eq!(Redundancy::parse("3"), Ok(Redundancy::Copies(3)));
        assert_eq!(Redundancy::parse("5"), Ok(Redundancy::Copies(5)));
        assert!(Redundancy::parse("6").is_err());
        use Redundancy::*;
        assert_eq!(Redundancy::of_link([]), Auto);
        assert_eq!(Redundancy::of_link([Off, Off]), Off);
        assert_eq!(Redundancy::of_link([Off, Auto]), Auto);
        assert_eq!(Redundancy::of_link([Auto, Copies(2), Off]), Copies(2));
        assert_eq!(Redundancy::of_link([Copies(3), Copies(2)]), Copies(3));
        assert_eq!((Off.most(), Auto.most(), Copies(3).most()), (1, 5, 3));
    }

    /// Feeds `secs` seconds of a steady rate (bytes per second, sent) and returns the last
    /// decision.
    fn run(p: &mut CopyPolicy, t: &mut Instant, sent: &mut u64, rate: u64, secs: u64) -> usize {
        let mut w = 0;
        for _ in 0..secs {
            *t += Duration::from_secs(1);
            *sent += rate;
            w = p.wanted(*t, *sent, 0);
        }
        w
    }

    #[test]
    fn auto_drops_the_copy_while_latency_traffic_would_crowd_out_bulk() {
        // 45 Mbit/s stated: 5.6 MB/s; a tenth is 562 kB/s.
        let mut p = CopyPolicy::new(Redundancy::Auto, 45_000_000);
        let (mut t, mut sent) = (Instant::now(), 0);
        assert_eq!(p.wanted(t, 0, 0), 2);
        // SYNC redo at 2 Mbit/s: copies stay.
        assert_eq!(run(&mut p, &mut t, &mut sent, 250_000, 10), 2);
        // A redo burst at 8 Mbit/s: off within the window.
        assert_eq!(run(&mut p, &mut t, &mut sent, 1_000_000, 3), 1);
        // Back to 2 Mbit/s: above 5%... stays off; at 1 Mbit/s it comes back after 10 s below.
        assert_eq!(run(&mut p, &mut t, &mut sent, 400_000, 20), 1);
        assert_eq!(run(&mut p, &mut t, &mut sent, 125_000, 8), 1);
        assert_eq!(run(&mut p, &mut t, &mut sent, 125_000, 10), 2);
        // A lossy lane (0.6% of segments retransmitted): three connections at 1.6 Mbit/s
        // (3.6% of the link), five at 80 kbit/s; two again once the loss stays low.
        let mut segs = (0u64, 0u64);
        let mut lossy =
            |p: &mut CopyPolicy, t: &mut Instant, sent: &mut u64, per_mille: u64, rate: u64| {
                for _ in 0..31 {
                    *t += Duration::from_secs(1);
                    segs = (segs.0 + per_mille, segs.1 + 1000);
                    p.segments(*t, segs.0, segs.1);
                    *sent += rate;
                    p.wanted(*t, *sent, 0);
                }
                p.wanted(*t, *sent, 0)
            };
        assert_eq!(lossy(&mut p, &mut t, &mut sent, 6, 200_000), 3);
        assert!(p.loss().is_some_and(|l| (l - 0.006).abs() < 1e-9));
        assert_eq!(lossy(&mut p, &mut t, &mut sent, 6, 10_000), 5);
        // 2.4% of the link: between the two bounds, five stay; over 3%, three.
        assert_eq!(
            lossy(&mut p, &mut t, &mut sent, 6, 135_000),
            5,
            "hysteresis"
        );
        assert_eq!(lossy(&mut p, &mut t, &mut sent, 6, 200_000), 3);
        assert_eq!(
            lossy(&mut p, &mut t, &mut sent, 1, 200_000),
            3,
            "hysteresis"
        );
        assert_eq!(lossy(&mut p, &mut t, &mut sent, 0, 200_000), 2);
        // Fixed settings do not look at the traffic.
        let mut fixed = CopyPolicy::new(Redundancy::Copies(3), 45_000_000);
        assert_eq!(run(&mut fixed, &mut t, &mut sent, 5_000_000, 10), 3);
        let mut off = CopyPolicy::new(Redundancy::Off, 45_000_000);
        assert_eq!(run(&mut off, &mut t, &mut sent, 0, 3), 1);
    }
}
