//! The codec's settings: how literals are compressed ([`Codec`], [`Compression`]), the
//! per-stream [`Policy`], what limits the sender ([`Pressure`]), and the sizes both sides agree
//! on ([`CodecConfig`]), with [`chunks`], the content-defined cutting they choose.

use crate::context::LongContext;
use crate::delta;
use crate::format::{NO_CACHE, TAG_LIT, TAG_LIT_LZ4, TAG_LIT_ZSTD};

/// Smallest and largest average chunk size accepted in a [`CodecConfig`].
pub const AVG_CHUNK_RANGE: std::ops::RangeInclusive<usize> = 1024..=64 * 1024;

/// Compression of a literal chunk, as carried on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    None,
    Lz4,
    Zstd,
}

impl Codec {
    /// Index into per-codec counters: none 0, lz4 1, zstd 2.
    pub fn index(self) -> usize {
        match self {
            Codec::None => 0,
            Codec::Lz4 => 1,
            Codec::Zstd => 2,
        }
    }

    /// A short lowercase label, used in metric labels.
    pub fn label(self) -> &'static str {
        ["none", "lz4", "zstd"][self.index()]
    }

    pub(crate) fn tag(self, cache: bool) -> u8 {
        let t = match self {
            Codec::None => TAG_LIT,
            Codec::Lz4 => TAG_LIT_LZ4,
            Codec::Zstd => TAG_LIT_ZSTD,
        };
        if cache { t } else { t | NO_CACHE }
    }
}

/// The compression setting of a service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Lz4,
    Zstd,
    /// Choose per chunk from a cheap compressibility estimate, the link pressure and the class.
    Adaptive,
}

impl Compression {
    /// The config word for it.
    pub fn name(self) -> &'static str {
        match self {
            Compression::None => "none",
            Compression::Lz4 => "lz4",
            Compression::Zstd => "zstd",
            Compression::Adaptive => "adaptive",
        }
    }
}

impl std::fmt::Display for Compression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Compression {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        [
            Compression::None,
            Compression::Lz4,
            Compression::Zstd,
            Compression::Adaptive,
        ]
        .into_iter()
        .find(|c| c.name() == s)
        .ok_or_else(|| format!("{s:?} is not none, lz4, zstd or adaptive"))
    }
}

/// What currently limits throughput, as the runtime sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pressure {
    /// The link is the bottleneck: spend CPU on ratio (zstd).
    LinkBound,
    /// The CPU is the bottleneck: prefer the cheapest codec that pays (LZ4).
    CpuBound,
}

/// How one stream's chunks are encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// Look chunks up in (and add them to) the cache.
    pub dedup: bool,
    pub compression: Compression,
    /// A latency-class stream: never the expensive codec.
    pub latency: bool,
    /// zstd literals may use the stream's context (the peer decodes context records).
    pub context: bool,
    /// A bulk stream: with `context`, every zstd literal goes through the stream's long context
    /// when the mirror has one to give (see [`LongContext`]).
    pub bulk: bool,
    /// With a long context, consecutive literals may share one flush (the peer decodes runs:
    /// see [`DEFERRED`]): flushing every chunk cost a row binlog 4% of its bytes at level 9.
    pub runs: bool,
    /// Deltas go as runs (the peer decodes `TAG_DELTA_RUN`): consecutive chunks with bases in
    /// one zstd frame against the union of their bases.
    pub delta_runs: bool,
    /// Streams keep logs and references go as runs named by their place in a log (the peer
    /// decodes `TAG_LOG` and `TAG_REF_RUN`; see [`logs`](crate::logs)).
    pub ref_runs: bool,
    /// Reference runs carry 8 bytes of their check and delta runs' zstd frames go without
    /// zstd's magic number (the peer decodes `TAG_REF_RUN_SHORT` and `TAG_DELTA_RUN_BARE`;
    /// see [`SHORT_CHECK`](crate::fingerprint::SHORT_CHECK)).
    pub compact_runs: bool,
    /// A chunk whose bases are still being read from the disk tier waits for them (the turn
    /// ends before it: the sender says it is `waiting`) instead of going as a literal:
    /// whoever runs the sender comes back once the store has read them.
    pub wait_bases: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            dedup: true,
            compression: Compression::Adaptive,
            latency: false,
            context: true,
            bulk: true,
            runs: true,
            delta_runs: true,
            ref_runs: true,
            compact_runs: true,
            wait_bases: false,
        }
    }
}

/// Chunking and cache settings of one direction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodecConfig {
    pub min_chunk: usize,
    pub avg_chunk: usize,
    pub max_chunk: usize,
    pub cache_bytes: usize,
    pub dedup: bool,
    pub compression: Compression,
    pub zstd_level: i32,
    /// zstd literals use the stream's context (see the module doc).
    pub context: bool,
    /// Long-window contexts for bulk streams; `None` compresses their chunks alone.
    pub long: Option<LongContext>,
    /// Bytes of sent chunks kept as bases for deltas (see [`delta`]); 0: no deltas.
    pub delta_bytes: usize,
    /// Bulk streams' literals may share a flush (see [`Policy::runs`]).
    pub runs: bool,
    /// With `runs`, streams keep logs and references go as runs (see [`Policy::ref_runs`]).
    pub logs: bool,
}

impl CodecConfig {
    /// Chunk bounds for an average size: half and four times it.
    /// The average is clamped to [`AVG_CHUNK_RANGE`] and made even.
    pub fn with_avg_chunk(mut self, avg: usize) -> Self {
        let avg = avg.clamp(*AVG_CHUNK_RANGE.start(), *AVG_CHUNK_RANGE.end()) & !1;
        self.min_chunk = avg / 2;
        self.avg_chunk = avg;
        self.max_chunk = avg * 4;
        self
    }

    pub(crate) fn policy(&self) -> Policy {
        Policy {
            dedup: self.dedup,
            compression: self.compression,
            latency: false,
            context: self.context,
            bulk: true,
            runs: self.runs,
            delta_runs: self.runs,
            ref_runs: self.runs && self.logs,
            compact_runs: self.runs && self.logs,
            wait_bases: false,
        }
    }
}

impl Default for CodecConfig {
    fn default() -> Self {
        CodecConfig {
            // Measured (tests.rs): with 8 KiB average chunks a backup with 10% of its 8 KiB blocks
            // changed costs about a sixth of the first transfer; 16 KiB cost about 30%. A minimum
            // of half the average lets FastCDC skip hashing half of each chunk (measured: chunking
            // 2.6 -> 3.1 GB/s) for 3% more bytes on that changed backup.
            min_chunk: 4 * 1024,
            avg_chunk: 8 * 1024,
            max_chunk: 32 * 1024,
            cache_bytes: 256 << 20,
            dedup: true,
            compression: Compression::Adaptive,
            zstd_level: 3,
            context: true,
            long: Some(LongContext::default()),
            delta_bytes: delta::DEFAULT_STORE,
            runs: true,
            logs: true,
        }
    }
}

/// The content-defined chunks of `data` as (offset, length), computed lazily. The last one ends
/// at the end of `data`, boundary or not: the caller decides whether it may be sent yet.
pub fn chunks<'a>(
    data: &'a [u8],
    cfg: &CodecConfig,
) -> impl Iterator<Item = (usize, usize)> + use<'a> {
    fastcdc::v2020::FastCDC::new(data, cfg.min_chunk, cfg.avg_chunk, cfg.max_chunk)
        .map(|c| (c.offset, c.length))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_read_back_and_chunks_cover_the_bytes() {
        for c in [
            Compression::None,
            Compression::Lz4,
            Compression::Zstd,
            Compression::Adaptive,
        ] {
            assert_eq!(c.to_string().parse::<Compression>(), Ok(c));
        }
        assert!("gzip".parse::<Compression>().is_err());
        assert_eq!(Codec::Zstd.label(), "zstd");
        assert_eq!(Codec::Lz4.tag(false) & NO_CACHE, NO_CACHE);
        let cfg = CodecConfig::default();
        assert!(AVG_CHUNK_RANGE.contains(&cfg.avg_chunk));
        let data = crate::testdata::noise(5, 1 << 20);
        let mut at = 0;
        for (o, l) in chunks(&data, &cfg) {
            assert_eq!(o, at, "no gap, no overlap");
            assert!(l <= cfg.max_chunk);
            at += l;
        }
        assert_eq!(at, data.len());
    }
}
