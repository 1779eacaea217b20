//! The link's sampler: every two seconds, `TCP_INFO` of the link's sockets, its caches and its
//! stall timeouts go into the metrics, and the main socket's delivery rate is held against the
//! stated bandwidth ([`RateCheck`]). Beside it, [`keep_room`] paces the main lane down while
//! the latency lane needs room at the WAN's bottleneck.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use super::handle::LinkHandle;
use crate::policy::RateCheck;
use crate::room::{self, Room};
use crate::sockopt;

/// How often the sockets are sampled.
const PERIOD: Duration = Duration::from_secs(2);

/// The sockets' names in the metrics (`lane` label): the main lane's, then each copy's.
const NAMES: [&str; 6] = [
    "main", "latency", "latency2", "latency3", "latency4", "latency5",
];

/// What one sampler remembers between samples.
pub(super) struct Sampler {
    stalls: u64,
    rate: Option<RateCheck>,
}

impl Sampler {
    pub(super) fn new(h: &LinkHandle) -> Self {
        Sampler {
            stalls: 0,
            rate: h.ctx.stated_bps.map(RateCheck::new),
        }
    }

    /// Takes one sample of the link's sockets and caches into its counters.
    pub(super) fn sample(&mut self, h: &LinkHandle) {
        // The lock keeps a lane's descriptor from being cleared and closed during the read.
        h.with_fds(|fds| {
            for (i, name) in NAMES.iter().enumerate() {
                let Some(t) = fds.get(i).copied().flatten().and_then(sockopt::tcp_info) else {
                    continue;
                };
                h.ctx.counters.sockets.record(name, &t);
                if i == 0
                    && let Some(check) = self.rate.as_mut()
                    && let Some(bps) = check.sample(t.delivery_rate.max(0) as u64, t.app_limited)
                {
                    warn!(
                        peer = %h.ctx.peer,
                        stated_mbit = h.ctx.stated_bps.unwrap_or(0) / 1_000_000,
                        measured_mbit = bps / 1_000_000,
                        "the link delivers under half its stated bandwidth while sending all it can; correct link.bandwidth"
                    );
                }
            }
        });
        let (caches, expired, kept) = {
            let g = h.state();
            (
                g.link.cache_stats(),
                g.link.stalls_expired(),
                g.link.replay_kept(),
            )
        };
        h.ctx
            .counters
            .link
            .replay_kept
            .set(i64::try_from(kept).unwrap_or(i64::MAX));
        h.ctx.counters.codec.record_caches(&caches);
        h.ctx
            .counters
            .codec
            .stall_timeouts(expired.saturating_sub(self.stalls));
        self.stalls = expired;
    }
}

/// Makes room for the latency lane's traffic under a bulk load (see [`crate::room`]): every
/// [`room::TICK`], the main lane's RTTs and the latency lane's bytes decide its pacing cap, `max`
/// bytes per second at most. Runs until aborted.
pub(super) async fn keep_room(h: Arc<LinkHandle>, max: u64, target: Duration) {
    let mut room = Room::new(max, target);
    let counters = &h.ctx.counters.link;
    counters.bulk_pacing.set(bits(max));
    let (mut lane, mut last) = (0, Instant::now());
    loop {
        tokio::time::sleep(room::TICK).await;
        let now = Instant::now();
        if room.yielding() {
            counters
                .bulk_yield_seconds
                .inc_by(now.saturating_duration_since(last).as_secs_f64());
        }
        last = now;
        if let Some((_, _, sent, received)) = h.lane_state() {
            lane = sent.saturating_add(received);
        }
        // The lock keeps the main socket from being closed between the read and the write.
        h.with_fds(|fds| {
            let Some(fd) = fds[0] else {
                return;
            };
            let Some(t) = sockopt::tcp_info(fd) else {
                return;
            };
            let rtt = |s: f64| Duration::from_secs_f64(s.max(0.0));
            room.bulk(now, t.bytes_sent.max(0) as u64);
            let Some(cap) = room.tick(now, lane, rtt(t.rtt_seconds), rtt(t.min_rtt_seconds)) else {
                return;
            };
            match sockopt::set_pacing(fd, cap) {
                Ok(()) => {
                    counters.bulk_pacing.set(bits(cap));
                }
                Err(e) => debug!(error = %e, "cannot change the main lane's pacing"),
            }
        });
    }
}

/// Bytes per second as bits per second, for a gauge.
fn bits(bytes_per_sec: u64) -> i64 {
    i64::try_from(bytes_per_sec.saturating_mul(8)).unwrap_or(i64::MAX)
}

/// Samples the link every [`PERIOD`] until aborted.
pub(super) async fn sample_sockets(h: Arc<LinkHandle>) {
    let mut s = Sampler::new(&h);
    loop {
        s.sample(&h);
        tokio::time::sleep(PERIOD).await;
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::super::testing::side;
    use super::*;

    /// A sample reads `TCP_INFO` of the main socket into the link's socket metrics, labelled
    /// by lane; a socket forgotten before it closes is no longer read.
    #[tokio::test]
    async fn a_sample_records_the_main_sockets_tcp_info() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let c = tokio::net::TcpStream::connect(l.local_addr().expect("addr"))
            .await
            .expect("connect");
        let west = side(true, &|_| {});
        west.h.set_fd(0, Some(c.as_raw_fd()));
        let mut s = Sampler::new(&west.h);
        s.sample(&west.h);
        let text = west.h.ctx.counters.encode();
        assert!(
            text.contains("wanopt_link_cwnd_segments{lane=\"main\"}"),
            "{text}"
        );
        assert!(!text.contains("lane=\"latency\""), "no lane socket was set");
        west.h.forget_fd(0);
        assert!(west.h.with_fds(|f| f.iter().all(Option::is_none)));
    }
}
