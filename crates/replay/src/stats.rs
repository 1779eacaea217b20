//! Latency histograms and throughput figures for the client's interval lines and summary.
//!
//! The histogram is log-linear (64 sub-buckets per power of two of microseconds), so it is fixed in
//! size however long a test runs, and percentiles are within about 1.6% of the true value.

/// Sub-buckets per power of two.
const SUB: usize = 64;
/// Powers of two covered: up to 2^40 microseconds (about 12 days).
const POWERS: usize = 40;
const BUCKETS: usize = SUB + (POWERS - 6) * (SUB / 2);

/// A fixed-size latency histogram in microseconds.
#[derive(Debug, Clone)]
pub struct Histogram {
    counts: Vec<u64>,
    n: u64,
    sum_us: u128,
    max_us: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: vec![0; BUCKETS],
            n: 0,
            sum_us: 0,
            max_us: 0,
        }
    }
}

fn index(us: u64) -> usize {
    if us < SUB as u64 {
        return us as usize;
    }
    // us is in [2^p, 2^(p+1)), p >= 6: 32 sub-buckets of width 2^(p-5).
    let p = 63 - us.leading_zeros() as usize;
    let i = SUB + (p - 6) * (SUB / 2) + ((us >> (p - 5)) as usize - SUB / 2);
    i.min(BUCKETS - 1)
}

/// The smallest value that maps to bucket `i` (the inverse of `index`).
fn lower(i: usize) -> u64 {
    if i < SUB {
        return i as u64;
    }
    let (g, s) = ((i - SUB) / (SUB / 2), (i - SUB) % (SUB / 2));
    ((SUB / 2 + s) as u64) << (g + 1)
}

impl Histogram {
    pub fn record(&mut self, us: u64) {
        self.counts[index(us)] += 1;
        self.n += 1;
        self.sum_us += u128::from(us);
        self.max_us = self.max_us.max(us);
    }

    pub fn merge(&mut self, o: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&o.counts) {
            *a += b;
        }
        self.n += o.n;
        self.sum_us += o.sum_us;
        self.max_us = self.max_us.max(o.max_us);
    }

    pub fn count(&self) -> u64 {
        self.n
    }

    /// Mean in milliseconds, if anything was recorded.
    pub fn mean_ms(&self) -> Option<f64> {
        (self.n > 0).then(|| self.sum_us as f64 / self.n as f64 / 1000.0)
    }

    /// The `q` quantile (0..=1) in milliseconds: the lower bound of the bucket holding it.
    pub fn quantile_ms(&self, q: f64) -> Option<f64> {
        if self.n == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.n as f64).ceil() as u64).clamp(1, self.n);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Some(lower(i).min(self.max_us) as f64 / 1000.0);
            }
        }
        Some(self.max_us as f64 / 1000.0)
    }

    pub fn max_ms(&self) -> f64 {
        self.max_us as f64 / 1000.0
    }

    /// The distribution as (milliseconds, fraction at or below) per occupied bucket, each at
    /// the bucket's lower bound as [`Histogram::quantile_ms`] reports it, the last at the maximum.
    pub fn cdf_ms(&self) -> Vec<(f64, f64)> {
        let mut seen = 0u64;
        let mut out = Vec::new();
        for (i, c) in self.counts.iter().enumerate().filter(|(_, c)| **c > 0) {
            seen += c;
            out.push((
                lower(i).min(self.max_us) as f64 / 1000.0,
                seen as f64 / self.n as f64,
            ));
        }
        // Everything is at or below the largest sample.
        if let Some(last) = out.last_mut() {
            last.0 = last.0.max(self.max_ms());
        }
        out
    }
}

/// One Mbyte as oratcptest counts it: 1024 x 1024 bytes.
pub const MBYTE: f64 = 1024.0 * 1024.0;

/// Throughput in Mbytes per second.
pub fn mbytes_per_s(bytes: u64, secs: f64) -> f64 {
    if secs <= 0.0 {
        0.0
    } else {
        bytes as f64 / MBYTE / secs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn buckets_are_monotone_and_tight(us in 0u64..1_000_000_000_000) {
            let i = index(us);
            prop_assert!(lower(i) <= us, "{} > {us}", lower(i));
            if i + 1 < BUCKETS {
                prop_assert!(lower(i + 1) > us);
            }
            // Within 1/32 of the value above the linear range.
            prop_assert!((us - lower(i)) as f64 <= us as f64 / 31.0 + 1.0);
        }
    }

    #[test]
    fn percentiles_of_a_known_spread() {
        let mut h = Histogram::default();
        for us in 1..=10_000u64 {
            h.record(us);
        }
        let p50 = h.quantile_ms(0.5).expect("p50");
        let p99 = h.quantile_ms(0.99).expect("p99");
        assert!((p50 - 5.0).abs() < 0.1, "{p50}");
        assert!((p99 - 9.9).abs() < 0.2, "{p99}");
        assert_eq!(h.max_ms(), 10.0);
        assert!((h.mean_ms().expect("mean") - 5.0005).abs() < 1e-6);
        assert_eq!(Histogram::default().quantile_ms(0.5), None);
        let cdf = h.cdf_ms();
        assert_eq!(cdf.last().copied(), Some((10.0, 1.0)));
        assert!(cdf.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 < w[1].1));
        let at = |ms: f64| {
            cdf.iter()
                .rev()
                .find(|(x, _)| *x <= ms)
                .map_or(0.0, |p| p.1)
        };
        assert!((at(5.0) - 0.5).abs() < 0.02, "{}", at(5.0));
        assert!(Histogram::default().cdf_ms().is_empty());
    }
}
