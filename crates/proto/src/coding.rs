//! Stream optimization on the link: chunking state per stream on the send side, decoding state
//! per stream on the receive side, and the caches they share, one per lane and scope.
//!
//! Chunks are encoded when the scheduler emits a frame and decoded when the frame arrives, so the
//! sender's mirror of each cache sees the same inserts and touches, in the same order, as the
//! receiver's cache. The latency lane has caches of its own, because frames of different lanes
//! have no fixed order relative to each other.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use bytes::{Buf, Bytes, BytesMut};
use wanopt_codec::{self as codec, CodecConfig, CodecError, Decoder, Hint, Mirror, Policy};

pub use wanopt_codec::cache::Fingerprint;
pub use wanopt_codec::{Compression, DecodeStats, EncodeStats, Pressure};

use crate::link::LATENCY_LANE;

/// Which cache a service's chunks go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The link's shared cache: most dedup, but services can learn about each other's data
    /// from compressed sizes.
    Link,
    /// A cache of the service's own.
    Service,
}

/// How a service's stream bytes are optimized on the way to the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamPolicy {
    pub compression: Compression,
    pub dedup: bool,
    pub scope: Scope,
}

impl Default for StreamPolicy {
    fn default() -> Self {
        StreamPolicy {
            compression: Compression::Adaptive,
            dedup: true,
            scope: Scope::Link,
        }
    }
}

/// Codec settings of a link side. Cache sizes are announced in the hello: the peer's encoder
/// mirrors caches of exactly these sizes (or less, if its own limit is lower).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodecSettings {
    /// Bytes of the shared cache of the main lane (the latency lane's is an eighth of it).
    pub cache_bytes: u64,
    /// Bytes of each service-scoped cache of the main lane.
    pub service_cache_bytes: u64,
    /// Average chunk size of what we send.
    pub avg_chunk: usize,
    /// zstd level when zstd is chosen.
    pub zstd_level: i32,
}

impl Default for CodecSettings {
    fn default() -> Self {
        CodecSettings {
            cache_bytes: 256 << 20,
            service_cache_bytes: 64 << 20,
            avg_chunk: 8 * 1024,
            zstd_level: 3,
        }
    }
}

/// The latency lane's caches are this fraction of the main lane's.
pub const LATENCY_SHARE: u64 = 8;

/// Most bytes of referenced chunks a mirror keeps to answer misses, whatever the peer's window.
const MAX_RESEND: u64 = 256 << 20;

/// Most bytes a bulk stream's chunker looks at in one scheduling turn.
pub(crate) const RAW_TURN: usize = 256 * 1024;

/// Codec counts of one service's streams, for the daemon's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CodecCount {
    /// What the encoder did with the bytes we sent.
    pub sent: EncodeStats,
    /// What our decoder rebuilt for the service's streams.
    pub received: DecodeStats,
    /// References we could not resolve and asked the peer for.
    pub needs: u64,
    /// Chunks we re-sent because the peer asked.
    pub resent: u64,
}

/// Size and evictions of one cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheStat {
    pub lane: usize,
    /// Empty for the shared cache, else the service name.
    pub scope: Arc<str>,
    /// `mirror` (the encoder's copy of the peer's cache) or `decoder`.
    pub role: &'static str,
    pub bytes: u64,
    pub chunks: u64,
    pub evictions: u64,
}

/// The send side of one optimized stream.
#[derive(Debug)]
pub(crate) struct SendCoder {
    pub policy: Policy,
    pub scoped: bool,
    hint: Hint,
    /// Bytes taken from the send queue but not sent yet (a chunk waiting for its boundary).
    stage: Vec<u8>,
    pos: usize,
    /// Stream offset up to which everything must go out without waiting for a boundary.
    pub flush_at: u64,
    /// Largest chunk: this many unsent bytes always hold a whole chunk.
    pub max_chunk: usize,
}

impl SendCoder {
    pub fn new(policy: &StreamPolicy, latency: bool) -> Self {
        SendCoder {
            policy: Policy {
                dedup: policy.dedup,
                compression: policy.compression,
                latency,
            },
            scoped: policy.scope == Scope::Service,
            hint: Hint::default(),
            stage: Vec::new(),
            pos: 0,
            flush_at: 0,
            max_chunk: usize::MAX,
        }
    }
}

/// Limits of one coded frame.
pub(crate) struct Limits {
    /// Raw bytes the stream and link credit allow.
    pub budget: usize,
    /// Record bytes after which the turn ends (fairness); at least one chunk is always sent.
    pub quantum: usize,
    /// Record bytes the frame can hold at most.
    pub room: usize,
}

/// Encodes the next chunks of a stream into `out` (after a coded frame header); returns the raw
/// bytes they cover, 0 if nothing may go yet. `sent` is the stream offset of the first unsent byte.
#[allow(clippy::too_many_arguments)]
pub(crate) fn emit(
    coder: &mut SendCoder,
    queue: &mut VecDeque<Bytes>,
    sent: u64,
    chunking: &CodecConfig,
    mirror: &mut Mirror,
    pressure: Pressure,
    lim: &Limits,
    out: &mut BytesMut,
    stats: &mut EncodeStats,
) -> usize {
    // Move queued bytes into the stage until it holds a turn's worth: chunk boundaries may span
    // the pieces the application wrote.
    while coder.stage.len() - coder.pos < lim.budget {
        let Some(front) = queue.front_mut() else {
            break;
        };
        let take = (lim.budget - (coder.stage.len() - coder.pos)).min(front.len());
        coder.stage.extend_from_slice(&front[..take]);
        front.advance(take);
        if front.is_empty() {
            queue.pop_front();
        }
    }
    let avail = &coder.stage[coder.pos..];
    // A flush point ends the last chunk whether or not the content has a boundary there.
    let flush = coder.flush_at.saturating_sub(sent) as usize;
    let (end, final_end) = if flush > 0 && flush <= avail.len() {
        (flush, true)
    } else {
        (avail.len(), false)
    };
    let mut raw = 0;
    let mut wire = 0;
    for (off, len) in codec::chunks(&avail[..end], chunking) {
        let last = off + len == end;
        if off + len > lim.budget
            || (last && !final_end && len < chunking.max_chunk)
            || (raw > 0 && wire >= lim.quantum)
            || wire + len + codec::RECORD_OVERHEAD > lim.room
        {
            break;
        }
        let chunk = &avail[off..off + len];
        let r = if last && len < chunking.min_chunk {
            codec::encode_raw(chunk, out)
        } else {
            mirror.encode_chunk(chunk, &coder.policy, pressure, &mut coder.hint, out)
        };
        stats.add(&r);
        raw += len;
        wire += r.wire;
    }
    coder.pos += raw;
    if coder.pos == coder.stage.len() {
        coder.stage.clear();
        coder.pos = 0;
    } else if coder.pos > coder.stage.len() / 2 {
        coder.stage.drain(..coder.pos);
        coder.pos = 0;
    }
    raw
}

/// A coded frame received but not fully decoded (its stream waits for a missing chunk).
#[derive(Debug)]
struct Pending {
    records: Bytes,
    remaining: u64,
    fin: bool,
    scoped: bool,
}

/// The receive side of one optimized stream: frames waiting to be decoded.
#[derive(Debug, Default)]
pub(crate) struct RecvCoded {
    frames: VecDeque<Pending>,
    /// The chunk this stream waits for, and whether it is in the service's own cache.
    pub stall: Option<(Fingerprint, bool)>,
}

impl RecvCoded {
    pub fn push(&mut self, records: Bytes, raw_len: u32, fin: bool, scoped: bool) {
        self.frames.push_back(Pending {
            records,
            remaining: u64::from(raw_len),
            fin,
            scoped,
        });
    }

    /// True when nothing waits to be decoded.
    pub fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    /// Record bytes waiting.
    pub fn buffered(&self) -> usize {
        self.frames.iter().map(|p| p.records.len()).sum()
    }
}

/// What decoding a stream's waiting frames gave.
#[derive(Debug, Default)]
pub(crate) struct Decoded {
    pub data: Vec<Bytes>,
    /// The stream's last frame was decoded.
    pub fin: bool,
    /// A chunk to ask the peer for: the stream stalls until it arrives.
    pub need: Option<(Fingerprint, bool)>,
}

/// The caches of one link: mirrors of the peer's (send side) and our own (receive side).
pub(crate) struct Contexts {
    own: CodecSettings,
    /// Chunking of what we send, fitted to the peer's frame size; `None` if the peer cannot decode.
    pub chunking: Option<CodecConfig>,
    peer_cache: u64,
    peer_service_cache: u64,
    resend: usize,
    mirrors: HashMap<(usize, Arc<str>), Mirror>,
    decoders: HashMap<(usize, Arc<str>), Decoder>,
    pub counts: HashMap<Arc<str>, CodecCount>,
}

impl std::fmt::Debug for Contexts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Contexts")
            .field("chunking", &self.chunking)
            .field("mirrors", &self.mirrors.len())
            .field("decoders", &self.decoders.len())
            .finish()
    }
}

fn lane_share(bytes: u64, lane: usize) -> usize {
    let b = if lane == LATENCY_LANE {
        bytes / LATENCY_SHARE
    } else {
        bytes
    };
    usize::try_from(b).unwrap_or(usize::MAX)
}

impl Contexts {
    pub fn new(own: CodecSettings) -> Self {
        Contexts {
            own,
            chunking: None,
            peer_cache: 0,
            peer_service_cache: 0,
            resend: 0,
            mirrors: HashMap::new(),
            decoders: HashMap::new(),
            counts: HashMap::new(),
        }
    }

    /// Takes the peer's announced cache sizes and frame limit. Our mirrors never exceed our own
    /// limits; a smaller mirror holds a subset of the peer's cache (LRU keeps the most recent
    /// chunks that fit), so it never claims a chunk the peer has evicted.
    /// Chunks sent as references are kept for a miss as long as they could still be in flight:
    /// the peer's link window, plus slack for a round trip.
    pub fn on_peer(
        &mut self,
        cache: u64,
        service_cache: u64,
        peer_max_frame: usize,
        peer_link_window: u64,
    ) {
        self.resend = usize::try_from(peer_link_window.min(MAX_RESEND)).unwrap_or(0) + (16 << 20);
        self.peer_cache = cache.min(self.own.cache_bytes);
        self.peer_service_cache = service_cache.min(self.own.service_cache_bytes);
        // A chunk and its record must fit in one frame of the peer's size.
        let room = peer_max_frame.saturating_sub(crate::frame::CODED_OVERHEAD + 64);
        let avg = self.own.avg_chunk.min(room / 4);
        self.chunking = (avg >= *codec::AVG_CHUNK_RANGE.start()).then(|| {
            CodecConfig {
                zstd_level: self.own.zstd_level,
                ..CodecConfig::default()
            }
            .with_avg_chunk(avg)
        });
    }

    pub fn mirror(&mut self, lane: usize, scope: &Arc<str>) -> &mut Mirror {
        let size = if scope.is_empty() {
            self.peer_cache
        } else {
            self.peer_service_cache
        };
        let (level, resend) = (self.own.zstd_level, self.resend);
        self.mirrors
            .entry((lane, scope.clone()))
            .or_insert_with(|| Mirror::new(lane_share(size, lane), resend, level))
    }

    pub fn decoder(&mut self, lane: usize, scope: &Arc<str>) -> &mut Decoder {
        let size = if scope.is_empty() {
            self.own.cache_bytes
        } else {
            self.own.service_cache_bytes
        };
        self.decoders
            .entry((lane, scope.clone()))
            .or_insert_with(|| Decoder::with_capacity(lane_share(size, lane), true))
    }

    /// The bytes of a chunk the peer asked for, if our mirror still holds it.
    pub fn resend(&self, lane: usize, scope: &str) -> impl Fn(&Fingerprint) -> Option<Bytes> + '_ {
        let m = self.mirrors.get(&(lane, Arc::from(scope)));
        move |f| m.and_then(|m| m.chunk(f)).cloned()
    }

    /// Decodes a stream's waiting frames until they run out or a reference misses.
    pub fn decode(
        &mut self,
        rc: &mut RecvCoded,
        lane: usize,
        service: &Arc<str>,
    ) -> Result<Decoded, String> {
        let mut got = Decoded::default();
        if rc.stall.is_some() {
            return Ok(got);
        }
        let link_scope: Arc<str> = Arc::from("");
        while let Some(p) = rc.frames.front_mut() {
            let scope = if p.scoped { service } else { &link_scope };
            let dec = self.decoder(lane, scope);
            let before = dec.stats();
            let mut out = Vec::new();
            let mut miss = None;
            while !p.records.is_empty() {
                match dec.decode_record(&p.records, &mut out) {
                    Ok(n) => p.records.advance(n),
                    Err(CodecError::Miss(f)) => {
                        miss = Some((f, p.scoped));
                        break;
                    }
                    Err(CodecError::Incomplete) => return Err("truncated record".into()),
                    Err(e) => return Err(e.to_string()),
                }
            }
            let after = dec.stats();
            let r = &mut self.counts.entry(service.clone()).or_default().received;
            r.hit_chunks += after.hit_chunks - before.hit_chunks;
            r.hit_bytes += after.hit_bytes - before.hit_bytes;
            r.lit_chunks += after.lit_chunks - before.lit_chunks;
            r.lit_bytes += after.lit_bytes - before.lit_bytes;
            let n = out.len() as u64;
            if n > p.remaining {
                return Err("records rebuild more bytes than announced".into());
            }
            p.remaining -= n;
            if !out.is_empty() {
                got.data.push(Bytes::from(out));
            }
            if let Some(m) = miss {
                rc.stall = Some(m);
                got.need = Some(m);
                return Ok(got);
            }
            if p.remaining != 0 {
                return Err("records rebuild fewer bytes than announced".into());
            }
            got.fin |= p.fin;
            rc.frames.pop_front();
        }
        Ok(got)
    }

    /// Sizes of every cache, for gauges.
    pub fn cache_stats(&self) -> Vec<CacheStat> {
        let stat =
            |(lane, scope): &(usize, Arc<str>), role, c: &codec::cache::ChunkCache| CacheStat {
                lane: *lane,
                scope: scope.clone(),
                role,
                bytes: c.size() as u64,
                chunks: c.len() as u64,
                evictions: c.evictions(),
            };
        self.mirrors
            .iter()
            .map(|(k, m)| stat(k, "mirror", m.cache()))
            .chain(
                self.decoders
                    .iter()
                    .map(|(k, d)| stat(k, "decoder", d.cache())),
            )
            .collect()
    }

    /// Test hook: damages a chunk in our decoder caches, as bad memory would.
    pub fn corrupt_decoders(&mut self) -> usize {
        let mut n = 0;
        for d in self.decoders.values_mut() {
            n += d.cache_mut().corrupt_all_for_test();
        }
        n
    }
}
