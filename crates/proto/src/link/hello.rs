//! The hello each side sends first, and what we take from the peer's: the version both speak,
//! its windows and limits, its capabilities and its latency-lane token. Cache sizes and offers
//! are the codec's (see [`crate::coding`]).

use crate::coding::LongContext;
use crate::error::LinkError;
use crate::frame::{self, CacheOffer, Hello, setting};
use crate::lane::{
    CAP_CODEC, CAP_COMPACT_RUNS, CAP_CONTEXT, CAP_DELTA, CAP_DELTA_RUNS, CAP_LANE_COPIES,
    CAP_LATENCY_LANE, CAP_LONG_CONTEXT, CAP_QUIET_BASES, CAP_REF_RUNS, CAP_REPLAY, CAP_RESUME,
    CAP_RUNS, CAP_SHORT_CODED, MAIN_LANE,
};

use super::LinkConfig;

/// Highest protocol version this build speaks.
pub const VERSION: u16 = 1;
/// Lowest protocol version this build speaks.
pub const MIN_VERSION: u16 = 1;

/// Largest hello accepted: room for the most cache offers with the longest names.
pub const HELLO_MAX: u32 = 256 * 1024;

/// Our hello, with the saved cache states we offer.
pub(super) fn ours(cfg: &LinkConfig, caches: Vec<CacheOffer>, scoped: Vec<String>) -> Hello {
    let mut capabilities = 0;
    if cfg.latency_lane {
        capabilities |= CAP_LATENCY_LANE;
    }
    if cfg.codec.is_some() {
        capabilities |= CAP_CODEC | CAP_CONTEXT | CAP_SHORT_CODED;
    }
    if cfg.codec.as_ref().is_some_and(|c| c.runs) {
        capabilities |= CAP_RUNS | CAP_DELTA_RUNS | CAP_REF_RUNS | CAP_COMPACT_RUNS;
    }
    if !cfg.resume_window.is_zero() {
        capabilities |= CAP_RESUME;
        if cfg.replay {
            capabilities |= CAP_REPLAY;
        }
    }
    if cfg.latency_lane && cfg.lane_copies > 1 {
        capabilities |= CAP_LANE_COPIES;
        if cfg.lane_datagrams {
            capabilities |= crate::lane::CAP_LANE_DATAGRAMS;
        }
    }
    // Deltas off on one side are off both ways, as long contexts are.
    if cfg.codec.as_ref().is_some_and(|c| c.delta_bytes > 0) {
        capabilities |= CAP_DELTA | CAP_QUIET_BASES;
    }
    let long = cfg.codec.as_ref().and_then(|c| c.long_context);
    if long.is_some() {
        capabilities |= CAP_LONG_CONTEXT;
    }
    let cache = |shared| {
        cfg.codec
            .as_ref()
            .map_or(0, |c| c.capacity(MAIN_LANE, shared))
    };
    let mut settings = vec![
        (setting::STREAM_WINDOW, u64::from(cfg.stream_window)),
        (setting::LINK_WINDOW, cfg.link_window),
        (setting::MAX_FRAME, u64::from(cfg.max_frame)),
        (setting::MAX_STREAMS, u64::from(cfg.max_streams)),
        (setting::TOKEN, cfg.token),
        (setting::CACHE_BYTES, cache(true)),
        (setting::SERVICE_CACHE_BYTES, cache(false)),
    ];
    if capabilities & CAP_LANE_COPIES != 0 {
        settings.push((setting::LANE_COPIES, cfg.lane_copies as u64));
    }
    if let Some(l) = long {
        settings.push((setting::CONTEXT_WINDOW_LOG, u64::from(l.window_log)));
        settings.push((setting::CONTEXT_STREAMS, l.streams as u64));
    }
    Hello {
        caches,
        scoped,
        version: VERSION,
        min_version: MIN_VERSION,
        site: cfg.site.clone(),
        capabilities,
        settings,
    }
}

/// The first frame of a latency-lane connection (connecting side): it presents the token and
/// names the lane; a copy of the lane says where its bytes start.
pub(super) fn lane(site: &str, token: u64, lane_id: u64, copy_at: Option<u64>) -> Hello {
    let mut settings = vec![(setting::ATTACH, token), (setting::COPY_OF, lane_id)];
    if let Some(at) = copy_at {
        settings.push((setting::COPY_AT, at));
    }
    Hello {
        version: VERSION,
        min_version: MIN_VERSION,
        site: site.to_string(),
        capabilities: CAP_LATENCY_LANE,
        settings,
        caches: Vec::new(),
        scoped: Vec::new(),
    }
}

/// The listener's answer on a copy's connection: where its bytes on it start.
pub(super) fn copy_answer(site: &str, at: u64) -> Hello {
    Hello {
        version: VERSION,
        min_version: MIN_VERSION,
        site: site.to_string(),
        capabilities: CAP_LANE_COPIES,
        settings: vec![(setting::COPY_AT, at)],
        caches: Vec::new(),
        scoped: Vec::new(),
    }
}

/// What the peer's hello says, with defaults for settings it left out.
#[derive(Debug, Clone, Default)]
pub(super) struct PeerParams {
    pub version: u16,
    pub stream_window: u64,
    pub link_window: u64,
    pub max_frame: usize,
    pub max_streams: u32,
    pub token: u64,
    pub caps: u64,
    pub cache_bytes: u64,
    pub service_cache_bytes: u64,
    /// With `CAP_LANE_COPIES`: the most connections the peer takes for its latency lane.
    pub lane_copies: usize,
    /// The long contexts the peer decodes, if any (window and number clamped to ours' bounds).
    pub long_context: Option<LongContext>,
}

impl PeerParams {
    /// Checks the peer's hello (a version both speak, the site we expect) and reads its settings.
    pub fn from_hello(h: &Hello, expected_site: &str) -> Result<Self, LinkError> {
        if h.version < MIN_VERSION || h.min_version > VERSION || h.min_version > h.version {
            return Err(LinkError::VersionMismatch {
                ours: VERSION,
                ours_min: MIN_VERSION,
                theirs: h.version,
                theirs_min: h.min_version,
            });
        }
        if h.site != expected_site {
            return Err(LinkError::WrongPeer {
                expected: expected_site.to_string(),
                got: h.site.clone(),
            });
        }
        let get = |id: u16, default: u64| h.setting(id).unwrap_or(default);
        Ok(PeerParams {
            version: h.version.min(VERSION),
            stream_window: get(setting::STREAM_WINDOW, 256 * 1024),
            link_window: get(setting::LINK_WINDOW, 1 << 20),
            max_frame: get(setting::MAX_FRAME, 16 * 1024)
                .clamp(1024, u64::from(frame::MAX_PAYLOAD_HARD) - 8)
                as usize,
            max_streams: get(setting::MAX_STREAMS, 100).min(u64::from(u32::MAX)) as u32,
            token: get(setting::TOKEN, 0),
            caps: h.capabilities,
            cache_bytes: get(setting::CACHE_BYTES, 0),
            service_cache_bytes: get(setting::SERVICE_CACHE_BYTES, 0),
            lane_copies: get(setting::LANE_COPIES, 1).clamp(1, crate::copies::MAX_COPIES as u64)
                as usize,
            long_context: (h.capabilities & CAP_LONG_CONTEXT != 0).then(|| {
                let range = LongContext::WINDOW_LOG_RANGE;
                LongContext {
                    window_log: get(setting::CONTEXT_WINDOW_LOG, u64::from(*range.start()))
                        .clamp(u64::from(*range.start()), u64::from(*range.end()))
                        as u32,
                    streams: get(setting::CONTEXT_STREAMS, 1).min(LongContext::MAX_STREAMS as u64)
                        as usize,
                }
            }),
        })
    }

    pub fn has(&self, cap: u64) -> bool {
        self.caps & cap != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bases keep their place in the caches' order only where deltas go both ways: the bit
    /// comes with `CAP_DELTA`, and a peer without it (an older build) leaves the order as it
    /// was (the pair's mirror and decoder then agree on that).
    #[test]
    fn quiet_bases_come_with_deltas() {
        let mut cfg = crate::LinkConfig::new("west", "east", true);
        cfg.codec = Some(crate::CodecSettings::default());
        let caps = ours(&cfg, Vec::new(), Vec::new()).capabilities;
        assert_ne!(caps & CAP_DELTA, 0);
        assert_ne!(caps & CAP_QUIET_BASES, 0);
        if let Some(c) = cfg.codec.as_mut() {
            c.delta_bytes = 0;
        }
        let caps = ours(&cfg, Vec::new(), Vec::new()).capabilities;
        assert_eq!(caps & (CAP_DELTA | CAP_QUIET_BASES), 0);
    }

    #[test]
    fn the_largest_hello_fits_what_a_listener_reads() {
        let name = "n".repeat(frame::MAX_NAME_LEN);
        let h = Hello {
            version: VERSION,
            min_version: MIN_VERSION,
            site: name.clone(),
            capabilities: u64::MAX,
            settings: vec![(1, u64::MAX); frame::MAX_SETTINGS],
            caches: vec![
                CacheOffer {
                    decoder: true,
                    lane: 0,
                    scope: name.clone(),
                    digests: vec![[7; 16]; frame::MAX_DIGESTS],
                };
                frame::MAX_OFFERS
            ],
            scoped: vec![name; frame::MAX_SCOPED],
        };
        let len = frame::Frame::Hello(h).encoded_len();
        assert!(len <= frame::HEADER_LEN + HELLO_MAX as usize, "{len}");
    }
}
