//! What the stated link bandwidth decides at run time: whether the encoder may take the link as
//! its bottleneck from the start instead of measuring it, and whether the link delivers what is
//! stated ([`RateCheck`]). What it decides in the config itself (the zstd level a config gets
//! when it sets none) is in [`config`](crate::config).

use crate::config::LinkSettings;

/// Below this stated bandwidth the link is always the bottleneck: zstd at a few percent of a
/// core always pays, so the encoder does not measure.
pub const WAN_BPS: u64 = 400_000_000;

/// True when the stated bandwidth makes the link the bottleneck for good.
pub fn link_bound(link: &LinkSettings) -> bool {
    link.bandwidth_stated && link.bandwidth_bps < WAN_BPS
}

/// Samples in a row (two seconds apart) that make a stated bandwidth suspect: 30 s.
pub const RATE_SAMPLES: u32 = 15;

/// Whether the link delivers what `link.bandwidth` states, from the main socket's `TCP_INFO`
/// every two seconds. Sending all it could (the kernel's delivery-rate sample not limited by
/// the application) for [`RATE_SAMPLES`] samples in a row at under half the stated figure, the
/// link is slower than stated, and what the figure decides (the zstd level, the pacing cap,
/// copies of the latency lane) assumes a link that is not there. The other way round cannot be
/// seen from here: paced at 95% of a figure too low, the socket looks exactly like one paced
/// below a link stated right (a full pipe, no queue on the path).
#[derive(Debug, Clone)]
pub struct RateCheck {
    stated_bps: u64,
    below: u32,
    said: bool,
}

impl RateCheck {
    /// A check of a stated bandwidth of `stated_bps` bits per second.
    pub fn new(stated_bps: u64) -> Self {
        RateCheck {
            stated_bps,
            below: 0,
            said: false,
        }
    }

    /// Takes one sample: the delivery rate in bytes per second and whether the kernel marked it
    /// limited by the application. Returns the measured rate in bits per second once, when the
    /// link has delivered under half the stated figure for [`RATE_SAMPLES`] samples in a row.
    pub fn sample(&mut self, delivery_bytes_per_sec: u64, app_limited: bool) -> Option<u64> {
        let bps = delivery_bytes_per_sec.saturating_mul(8);
        let below = !app_limited && bps > 0 && bps.saturating_mul(2) < self.stated_bps;
        self.below = if below { self.below + 1 } else { 0 };
        if self.said || self.below < RATE_SAMPLES {
            return None;
        }
        self.said = true;
        Some(bps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_slower_than_stated_is_told_once_after_thirty_seconds() {
        let t3 = 45_000_000 / 8;
        let mut c = RateCheck::new(1_000_000_000);
        // Application-limited samples say nothing, however low.
        for _ in 0..100 {
            assert_eq!(c.sample(1000, true), None);
        }
        // A gap in a run of low samples starts it over.
        for _ in 0..RATE_SAMPLES - 1 {
            assert_eq!(c.sample(t3, false), None);
        }
        assert_eq!(c.sample(600_000_000 / 8, false), None);
        for _ in 0..RATE_SAMPLES - 1 {
            assert_eq!(c.sample(t3, false), None);
        }
        assert_eq!(c.sample(t3, false), Some(45_000_000));
        for _ in 0..100 {
            assert_eq!(c.sample(t3, false), None, "once");
        }
        // A link that delivers what is stated (or half of it) is never told.
        let mut right = RateCheck::new(45_000_000);
        for _ in 0..100 {
            assert_eq!(right.sample(t3 * 95 / 100, false), None);
            assert_eq!(right.sample(t3 / 2, false), None);
        }
    }
}
