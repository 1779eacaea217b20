//! The `limits` section: stream and link windows, timeouts, threads, and the caps that bound what
//! peers and clients can make the daemon hold (streams per service and per client, handshakes).

use std::time::Duration;

use serde::Deserialize;

use super::fields::{ConfigError, Ctx, defaults, in_range};
use super::link::LinkSettings;
use wanopt_units::parse_size;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLimits {
    max_streams: Option<u32>,
    stream_window: Option<String>,
    link_window: Option<String>,
    stream_buffer: Option<String>,
    shutdown_grace: Option<String>,
    connect_timeout: Option<String>,
    link_wait: Option<String>,
    handshake_timeout: Option<String>,
    idle_timeout: Option<String>,
    threads: Option<usize>,
    max_handshakes: Option<u32>,
    latency_reserve: Option<u32>,
    handshakes_per_source: Option<u32>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    pub max_streams: u32,
    pub stream_window: u32,
    pub link_window: u64,
    pub stream_buffer: usize,
    pub shutdown_grace: Duration,
    pub connect_timeout: Duration,
    pub link_wait: Duration,
    pub handshake_timeout: Duration,
    pub idle_timeout: Duration,
    /// Threads that prepare chunks (fingerprints, literals alone): the runtime's own and
    /// `threads - 1` workers (see `crate::workers`); 1 encodes on the runtime's thread alone.
    pub threads: usize,
    /// Of `max_streams`, the streams bulk services may not take: kept for latency services.
    pub latency_reserve: u32,
    /// Link connections that may be authenticating at once; the oldest goes when more arrive.
    pub max_handshakes: u32,
    /// The same, per source address.
    pub handshakes_per_source: u32,
}

pub(super) fn parse_limits(
    cx: &Ctx<'_>,
    rl: Option<&RawLimits>,
    link: &LinkSettings,
    optimized: bool,
) -> Result<Limits, ConfigError> {
    let empty = RawLimits::default();
    let r = rl.unwrap_or(&empty);
    let secs = Duration::from_secs;
    let ms = Duration::from_millis;
    let max_streams = match r.max_streams {
        None => defaults::MAX_STREAMS,
        Some(n) => in_range(n, 1, 1 << 20).map_err(|m| cx.err("limits.max_streams", m))?,
    };
    // Defaults: a stream may fill the pipe on its own; the link holds a few streams' worth.
    // With dedup a stream's raw bytes can outrun the link many times over (credit counts raw
    // bytes), so optimized links start at 16 MiB: 160 MB/s of raw bytes per stream at 100 ms.
    let floor = if optimized { 8 << 20 } else { 1 << 20 };
    let default_stream_window = link.bdp_bytes().clamp(floor, 64 << 20) * 2;
    let stream_window = cx.opt(
        "limits.stream_window",
        &r.stream_window,
        default_stream_window,
        |s| in_range(parse_size(s)?, 64 * 1024, 1 << 30),
    )? as u32;
    let link_window = cx.opt(
        "limits.link_window",
        &r.link_window,
        (u64::from(stream_window) * 4).max(64 << 20),
        |s| in_range(parse_size(s)?, 256 * 1024, 16 << 30),
    )?;
    let idle_timeout = cx.dur(
        "limits.idle_timeout",
        &r.idle_timeout,
        defaults::IDLE_TIMEOUT,
        secs(1),
        secs(3600),
    )?;
    if idle_timeout <= link.keepalive {
        return Err(cx.err("limits.idle_timeout", "must be longer than link.keepalive"));
    }
    let latency_reserve = match r.latency_reserve {
        None => max_streams / 16,
        Some(n) => {
            in_range(n, 0, max_streams - 1).map_err(|m| cx.err("limits.latency_reserve", m))?
        }
    };
    let max_handshakes = match r.max_handshakes {
        None => defaults::MAX_HANDSHAKES,
        Some(n) => in_range(n, 1, 65536).map_err(|m| cx.err("limits.max_handshakes", m))?,
    };
    let handshakes_per_source = match r.handshakes_per_source {
        None => defaults::HANDSHAKES_PER_SOURCE.min(max_handshakes),
        Some(n) => {
            in_range(n, 1, max_handshakes).map_err(|m| cx.err("limits.handshakes_per_source", m))?
        }
    };
    Ok(Limits {
        latency_reserve,
        max_handshakes,
        handshakes_per_source,
        threads: match r.threads {
            None => defaults::threads(),
            Some(n) => in_range(n, 1, 256).map_err(|m| cx.err("limits.threads", m))?,
        },
        max_streams,
        stream_window,
        link_window,
        stream_buffer: cx.opt(
            "limits.stream_buffer",
            &r.stream_buffer,
            defaults::STREAM_BUFFER,
            |s| in_range(parse_size(s)?, 16 * 1024, 64 << 20),
        )? as usize,
        shutdown_grace: cx.dur(
            "limits.shutdown_grace",
            &r.shutdown_grace,
            defaults::SHUTDOWN_GRACE,
            ms(0),
            secs(3600),
        )?,
        connect_timeout: cx.dur(
            "limits.connect_timeout",
            &r.connect_timeout,
            defaults::CONNECT_TIMEOUT,
            ms(10),
            secs(600),
        )?,
        link_wait: cx.dur(
            "limits.link_wait",
            &r.link_wait,
            defaults::LINK_WAIT,
            ms(0),
            secs(600),
        )?,
        handshake_timeout: cx.dur(
            "limits.handshake_timeout",
            &r.handshake_timeout,
            defaults::HANDSHAKE_TIMEOUT,
            ms(100),
            secs(600),
        )?,
        idle_timeout,
    })
}
