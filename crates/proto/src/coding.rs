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
use wanopt_codec::cache::{ChunkCache, Snapshot};
use wanopt_codec::{
    self as codec, CodecConfig, CodecError, Decoder, Hint, Mirror, Policy, StreamContext,
};

pub use wanopt_codec::cache::{Fingerprint, TierStats};
pub use wanopt_codec::store::ChunkStore;
pub use wanopt_codec::{Compression, DecodeStats, EncodeStats, Pressure};

use crate::frame::{self, CacheOffer};
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
    /// With a disk tier (see [`CacheStorage`]): bytes its files may take for the shared cache and
    /// for each service-scoped one (0: memory only). The cache then holds
    /// [`disk_capacity`](wanopt_codec::cache::disk_capacity) of it, and memory keeps the most
    /// recently used part.
    pub disk_bytes: u64,
    pub service_disk_bytes: u64,
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
            disk_bytes: 0,
            service_disk_bytes: 0,
            avg_chunk: 8 * 1024,
            zstd_level: 3,
        }
    }
}

impl CodecSettings {
    /// Memory and disk limits of our cache for a lane and scope (`""`: the shared cache).
    fn limits(&self, lane: usize, shared: bool) -> (u64, u64) {
        let (mem, disk) = if shared {
            (self.cache_bytes, self.disk_bytes)
        } else {
            (self.service_cache_bytes, self.service_disk_bytes)
        };
        (lane_share(mem, lane), lane_share(disk, lane))
    }

    /// Bytes our cache of a lane and scope holds: the disk tier's capacity if it has one.
    pub fn capacity(&self, lane: usize, shared: bool) -> u64 {
        match self.limits(lane, shared) {
            (mem, 0) => mem,
            (_, disk) => codec::cache::disk_capacity(disk),
        }
    }
}

/// The latency lane's caches are this fraction of the main lane's.
pub const LATENCY_SHARE: u64 = 8;

/// Which side of a cache a saved state belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Our encoder's mirror of the peer's cache.
    Mirror,
    /// Our decoder's cache.
    Decoder,
}

impl Role {
    /// A short lowercase label, for file names and metrics.
    pub fn label(self) -> &'static str {
        match self {
            Role::Mirror => "mirror",
            Role::Decoder => "decoder",
        }
    }
}

/// A saved state of a cache, as listed (the state itself is loaded only if it is resumed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SavedState {
    /// [`Snapshot::digest`] of the state.
    pub digest: Fingerprint,
    /// The capacity of the cache it was taken from.
    pub capacity: u64,
}

/// Saved states of one of our caches, newest first.
#[derive(Debug, Clone)]
pub struct SavedCache {
    pub role: Role,
    pub lane: usize,
    pub scope: Arc<str>,
    pub states: Vec<SavedState>,
}

/// Where the daemon keeps a link's caches beyond memory: disk tiers for our decoders, and the
/// states saved at checkpoints (written by the runtime on [`Event::Checkpoint`](crate::Event)).
pub trait CacheStorage: Send + Sync + std::fmt::Debug {
    /// States saved for this peer (listed, not loaded).
    fn saved(&self) -> Vec<SavedCache>;
    /// Loads a saved state; `None` if it is gone or damaged (its digest is checked here too).
    fn load(&self, role: Role, lane: usize, scope: &str, digest: &Fingerprint) -> Option<Snapshot>;
    /// The disk store of our decoder cache of a lane and scope, if it has a disk tier.
    fn store(&self, lane: usize, scope: &str) -> Option<Box<dyn ChunkStore>>;
}

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
    /// Where a decoder's bytes are: memory and disk.
    pub tiers: TierStats,
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
                // Only once the peer says it decodes them.
                context: false,
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
///
/// Chunks are cut in place in the queued buffers the application wrote. Only a chunk that spans
/// two of them is put together in the stage: the previous buffer's unfinished tail (the carry),
/// plus a copy of just enough of the next buffer to find the boundary. Boundaries still depend
/// only on the content since the previous boundary, however the bytes were split into writes.
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
    let mut turn = Turn::default();
    loop {
        let budget = lim.budget.saturating_sub(turn.raw);
        if budget == 0 {
            break;
        }
        // Bytes from here that must go out without waiting for a boundary (0: no flush point).
        let flush = coder
            .flush_at
            .saturating_sub(sent + turn.raw as u64)
            .try_into()
            .unwrap_or(usize::MAX);
        let mut cx = Cut {
            chunking,
            mirror: &mut *mirror,
            pressure,
            lim,
            out: &mut *out,
            stats: &mut *stats,
            turn: &mut turn,
        };
        if coder.stage.len() > coder.pos {
            // The carry: fill the stage up to a whole chunk's worth. Buffers that fit join the
            // carry; of the one that does not, only a copy of what is needed (it stays queued).
            let mut peek = 0;
            while coder.stage.len() - coder.pos < chunking.max_chunk {
                let Some(front) = queue.front() else {
                    break;
                };
                let need = chunking.max_chunk - (coder.stage.len() - coder.pos);
                if front.len() <= need {
                    coder.stage.extend_from_slice(front);
                    queue.pop_front();
                } else {
                    coder.stage.extend_from_slice(&front[..need]);
                    peek = need;
                    break;
                }
            }
            let owned = coder.stage.len() - coder.pos - peek;
            // Only the spanning chunk: the ones after it are cut in place, not scanned twice.
            let (used, stop) = cx.cut(
                &coder.stage[coder.pos..],
                flush,
                budget,
                true,
                &coder.policy,
                &mut coder.hint,
            );
            if used >= owned {
                // The carry is sent: what follows is still in the queue's front buffer.
                coder.stage.clear();
                coder.pos = 0;
                if used > owned {
                    advance_front(queue, used - owned);
                }
            } else {
                coder.pos += used;
                coder.stage.truncate(coder.stage.len() - peek);
                if coder.pos > coder.stage.len() / 2 {
                    coder.stage.drain(..coder.pos);
                    coder.pos = 0;
                }
            }
            if used == 0 || stop == Stop::Limit {
                break;
            }
        } else {
            let Some(front) = queue.front() else {
                break;
            };
            if front.is_empty() {
                queue.pop_front();
                continue;
            }
            let front = front.clone();
            let (used, stop) = cx.cut(&front, flush, budget, false, &coder.policy, &mut coder.hint);
            advance_front(queue, used);
            match stop {
                Stop::Limit => break,
                Stop::End => {}
                Stop::Tail => {
                    if queue.len() < 2 {
                        // No later buffer to finish the chunk with yet: it waits where it is.
                        break;
                    }
                    if let Some(rest) = queue.pop_front() {
                        coder.stage.extend_from_slice(&rest);
                    }
                }
            }
        }
    }
    if coder.pos == coder.stage.len() {
        coder.stage.clear();
        coder.pos = 0;
    }
    turn.raw
}

/// Drops `n` sent bytes from the front of the queue.
fn advance_front(queue: &mut VecDeque<Bytes>, mut n: usize) {
    while n > 0 {
        let Some(front) = queue.front_mut() else {
            return;
        };
        let k = n.min(front.len());
        front.advance(k);
        n -= k;
        if front.is_empty() {
            queue.pop_front();
        }
    }
}

/// Raw and record bytes of one turn so far.
#[derive(Default)]
struct Turn {
    raw: usize,
    wire: usize,
}

/// Why [`Cut::cut`] stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// Every chunk up to the end of the bytes (or the flush point) went.
    End,
    /// The last piece has no boundary yet: it waits for more bytes.
    Tail,
    /// The turn is over: budget, fairness quantum or frame room.
    Limit,
}

/// What encoding one contiguous run of bytes needs.
struct Cut<'a> {
    chunking: &'a CodecConfig,
    mirror: &'a mut Mirror,
    pressure: Pressure,
    lim: &'a Limits,
    out: &'a mut BytesMut,
    stats: &'a mut EncodeStats,
    turn: &'a mut Turn,
}

impl Cut<'_> {
    /// Encodes the chunks of `view` (with `first`, only its first), which starts at a chunk
    /// boundary; returns the bytes used.
    #[allow(clippy::too_many_arguments)]
    fn cut(
        &mut self,
        view: &[u8],
        flush: usize,
        budget: usize,
        first: bool,
        policy: &Policy,
        hint: &mut Hint,
    ) -> (usize, Stop) {
        // A flush point ends the last chunk whether or not the content has a boundary there.
        let (end, final_end) = if flush > 0 && flush <= view.len() {
            (flush, true)
        } else {
            (view.len(), false)
        };
        let mut used = 0;
        for (off, len) in codec::chunks(&view[..end], self.chunking) {
            let t = &mut *self.turn;
            if off + len > budget
                || (t.raw > 0 && t.wire >= self.lim.quantum)
                || t.wire + len + codec::RECORD_OVERHEAD > self.lim.room
            {
                return (used, Stop::Limit);
            }
            let last = off + len == end;
            if last && !final_end && len < self.chunking.max_chunk {
                return (used, Stop::Tail);
            }
            let chunk = &view[off..off + len];
            let r = if last && len < self.chunking.min_chunk {
                codec::encode_tail(self.mirror, chunk, policy, self.pressure, hint, self.out)
            } else {
                self.mirror
                    .encode_chunk(chunk, policy, self.pressure, hint, self.out)
            };
            self.stats.add(&r);
            t.raw += len;
            t.wire += r.wire;
            used = off + len;
            if first {
                break;
            }
        }
        (used, Stop::End)
    }
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
    /// The stream's zstd context, fed its records in order (a stall resumes where it stopped).
    context: StreamContext,
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
    mirrors: HashMap<Key, Mirror>,
    decoders: HashMap<Key, Decoder>,
    pub counts: HashMap<Arc<str>, CodecCount>,
    storage: Option<Arc<dyn CacheStorage>>,
    /// States we saved, offered in our hello.
    saved: HashMap<(Role, Key), Vec<SavedState>>,
    /// States both sides agreed to resume, loaded when the cache is first used.
    resume: HashMap<(Role, Key), Fingerprint>,
    /// Each mirror's clock at its last checkpoint: it changed since if it differs.
    checkpointed: HashMap<Key, u64>,
    /// Each decoder's clock when a peer's checkpoint was last judged against it.
    judged: HashMap<Key, u64>,
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

fn lane_share(bytes: u64, lane: usize) -> u64 {
    if lane == LATENCY_LANE {
        bytes / LATENCY_SHARE
    } else {
        bytes
    }
}

/// Loads an agreed state; a state that cannot be loaded leaves the cache empty (which costs
/// dedup, never correctness: see [`Contexts::mirror`] and [`Contexts::decoder`]).
fn load(
    storage: Option<&dyn CacheStorage>,
    role: Role,
    lane: usize,
    scope: &str,
    digest: &Fingerprint,
) -> Option<Snapshot> {
    storage?
        .load(role, lane, scope, digest)
        .filter(|s| s.digest() == *digest)
}

fn to_usize(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

type Key = (usize, Arc<str>);

impl Contexts {
    pub fn new(own: CodecSettings, storage: Option<Arc<dyn CacheStorage>>) -> Self {
        let mut saved = HashMap::new();
        for c in storage.iter().flat_map(|s| s.saved()) {
            // Only states of our cache as configured now can be resumed by our decoders.
            // (and a decoder without a disk tier has no bytes to resume).
            let cap = own.capacity(c.lane, c.scope.is_empty());
            let disk = own.limits(c.lane, c.scope.is_empty()).1 > 0;
            let states: Vec<_> = c
                .states
                .into_iter()
                .filter(|s| c.role == Role::Mirror || (disk && s.capacity == cap))
                .take(frame::MAX_DIGESTS)
                .collect();
            if !states.is_empty() && c.lane < crate::LANES {
                saved.insert((c.role, (c.lane, c.scope)), states);
            }
        }
        Contexts {
            own,
            chunking: None,
            peer_cache: 0,
            peer_service_cache: 0,
            resend: 0,
            mirrors: HashMap::new(),
            decoders: HashMap::new(),
            counts: HashMap::new(),
            storage,
            saved,
            resume: HashMap::new(),
            checkpointed: HashMap::new(),
            judged: HashMap::new(),
        }
    }

    /// Our saved states, for the hello.
    pub fn offers(&self) -> Vec<CacheOffer> {
        let mut v: Vec<CacheOffer> = self
            .saved
            .iter()
            .map(|((role, (lane, scope)), states)| CacheOffer {
                decoder: *role == Role::Decoder,
                lane: *lane as u8,
                scope: scope.to_string(),
                digests: states.iter().map(|s| s.digest).collect(),
            })
            .collect();
        v.sort_by(|a, b| (a.decoder, a.lane, &a.scope).cmp(&(b.decoder, b.lane, &b.scope)));
        v.truncate(frame::MAX_OFFERS);
        v
    }

    /// Chooses the states to resume from the peer's offers: for each cache, the newest state the
    /// receiving side offers that the sending side has too. Both sides choose alike.
    fn choose(&mut self, peer: &[CacheOffer]) {
        for o in peer {
            let key: Key = (usize::from(o.lane), Arc::from(o.scope.as_str()));
            // Their decoder and our mirror, or their mirror and our decoder.
            let (role, ours) = if o.decoder {
                (Role::Mirror, self.saved.get(&(Role::Mirror, key.clone())))
            } else {
                (Role::Decoder, self.saved.get(&(Role::Decoder, key.clone())))
            };
            let Some(ours) = ours else {
                continue;
            };
            let pick = if o.decoder {
                o.digests
                    .iter()
                    .find(|d| ours.iter().any(|s| s.digest == **d))
                    .copied()
            } else {
                ours.iter()
                    .find(|s| o.digests.contains(&s.digest))
                    .map(|s| s.digest)
            };
            if let Some(d) = pick {
                self.resume.insert((role, key), d);
            }
        }
        self.saved.clear();
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
        offers: &[CacheOffer],
    ) {
        self.resend = usize::try_from(peer_link_window.min(MAX_RESEND)).unwrap_or(0) + (16 << 20);
        // A mirror costs about 64 bytes of memory per chunk: never more than our own cache.
        self.peer_cache = cache.min(self.own.capacity(crate::MAIN_LANE, true));
        self.peer_service_cache = service_cache.min(self.own.capacity(crate::MAIN_LANE, false));
        self.choose(offers);
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
        let key = (lane, scope.clone());
        let resume = self.resume.remove(&(Role::Mirror, key.clone()));
        let storage = self.storage.clone();
        self.mirrors.entry(key).or_insert_with(|| {
            let mut m = Mirror::new(to_usize(lane_share(size, lane)), resend, level);
            if let Some(s) =
                resume.and_then(|d| load(storage.as_deref(), Role::Mirror, lane, scope, &d))
            {
                // A state of another size cannot be resumed: start empty (the peer's cache then
                // holds more than we assume, which only costs dedup).
                let _ = m.cache_mut().restore(&s);
            }
            m
        })
    }

    pub fn decoder(&mut self, lane: usize, scope: &Arc<str>) -> &mut Decoder {
        let key = (lane, scope.clone());
        let resume = self.resume.remove(&(Role::Decoder, key.clone()));
        let (mem, disk) = self.own.limits(lane, scope.is_empty());
        let storage = self.storage.clone();
        self.decoders.entry(key).or_insert_with(|| {
            let store = (disk > 0)
                .then(|| storage.as_ref().and_then(|s| s.store(lane, scope)))
                .flatten();
            let mut cache = match store {
                Some(st) => ChunkCache::tiered(to_usize(mem), disk, st),
                None => ChunkCache::new(to_usize(mem)),
            };
            if let Some(s) =
                resume.and_then(|d| load(storage.as_deref(), Role::Decoder, lane, scope, &d))
            {
                // Chunks whose bytes are gone become misses, which the peer answers.
                let _ = cache.restore(&s);
            }
            Decoder::with_cache(cache, true)
        })
    }

    /// Our decoder of a lane and scope, if it was ever used.
    pub fn existing_decoder(&mut self, lane: usize, scope: &Arc<str>) -> Option<&mut Decoder> {
        self.decoders.get_mut(&(lane, scope.clone()))
    }

    /// The mirrors changed since their last checkpoint, as (lane, scope).
    pub fn dirty_mirrors(&self) -> Vec<Key> {
        self.mirrors
            .iter()
            .filter(|(k, m)| self.checkpointed.get(*k).copied().unwrap_or(0) != m.cache().clock())
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Takes a checkpoint of a mirror: its state now, which the frame emitted at this point of
    /// the lane tells the peer to save too.
    pub fn checkpoint_mirror(&mut self, lane: usize, scope: &str) -> Option<Arc<Snapshot>> {
        let key: Key = (lane, Arc::from(scope));
        let m = self.mirrors.get(&key)?;
        self.checkpointed.insert(key, m.cache().clock());
        Some(Arc::new(m.cache().snapshot()))
    }

    /// Our decoder's state, if it is the one the peer's checkpoint names.
    pub fn checkpoint_decoder(
        &mut self,
        lane: usize,
        scope: &str,
        digest: &Fingerprint,
    ) -> Option<Arc<Snapshot>> {
        let key: Key = (lane, Arc::from(scope));
        let d = self.decoders.get_mut(&key)?;
        // A cache in memory only has nothing to resume after a restart.
        if !d.cache().has_disk() {
            return None;
        }
        // A peer repeating checkpoints without sending anything in between costs nothing: the
        // state did not change, it was judged (and saved, if it matched) already.
        let clock = d.cache().clock();
        if self.judged.get(&key).is_some_and(|c| *c == clock) {
            return None;
        }
        self.judged.insert(key, clock);
        d.cache_mut().flush();
        let s = d.cache().snapshot();
        (s.digest() == *digest).then(|| Arc::new(s))
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
                match dec.decode_record_in(&p.records, &mut out, &mut rc.context) {
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
            if p.fin {
                // Nothing follows the stream's last frame: its context can go now.
                got.fin = true;
                rc.context = StreamContext::default();
            }
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
                tiers: c.tier_stats(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Noise with runs of one byte, so that chunks both compress and not (fingerprints of a
    /// counter serve as the deterministic noise).
    fn data(seed: u64, len: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(len + 64);
        for i in 0u64.. {
            if v.len() >= len {
                break;
            }
            let f = codec::cache::fingerprint(&[seed.to_le_bytes(), i.to_le_bytes()].concat());
            match f[0] % 4 {
                0 => v.extend_from_slice(&[f[1]; 37]),
                _ => v.extend_from_slice(&f),
            }
        }
        v.truncate(len);
        v
    }

    struct Sender {
        coder: SendCoder,
        queue: VecDeque<Bytes>,
        sent: u64,
        queued: u64,
        mirror: Mirror,
        cfg: CodecConfig,
    }

    impl Sender {
        fn new() -> Sender {
            let cfg = CodecConfig::default();
            Sender {
                coder: SendCoder::new(&StreamPolicy::default(), false),
                queue: VecDeque::new(),
                sent: 0,
                queued: 0,
                mirror: Mirror::new(cfg.cache_bytes, 1 << 20, cfg.zstd_level),
                cfg,
            }
        }

        /// One turn; returns the records and the raw bytes they cover.
        fn emit(&mut self, budget: usize) -> (BytesMut, usize) {
            let mut out = BytesMut::new();
            let lim = Limits {
                budget,
                quantum: usize::MAX,
                room: usize::MAX,
            };
            let mut stats = EncodeStats::default();
            let n = emit(
                &mut self.coder,
                &mut self.queue,
                self.sent,
                &self.cfg,
                &mut self.mirror,
                Pressure::CpuBound,
                &lim,
                &mut out,
                &mut stats,
            );
            self.sent += n as u64;
            assert!(self.sent <= self.queued, "sent more than was queued");
            (out, n)
        }
    }

    /// Decodes every record of `buf`, appending to `out`; returns each record's raw length.
    fn decode(dec: &mut Decoder, mut buf: &[u8], out: &mut Vec<u8>) -> Vec<usize> {
        let mut lens = Vec::new();
        while !buf.is_empty() {
            let before = out.len();
            let used = dec.decode_record(buf, out).expect("records decode");
            lens.push(out.len() - before);
            buf = &buf[used..];
        }
        lens
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Whatever the application's write sizes, the turn budgets and the flush points, the
        /// records rebuild the stream exactly; every raw byte is sent once.
        #[test]
        fn emit_rebuilds_any_split_exactly(
            seed in any::<u64>(),
            len in 0usize..300_000,
            cuts in proptest::collection::vec((1usize..70_000, 1usize..300_000, any::<bool>()), 1..40),
        ) {
            let src = data(seed, len);
            let mut s = Sender::new();
            let mut dec = Decoder::with_capacity(s.cfg.cache_bytes, true);
            let mut got = Vec::new();
            let mut at = 0;
            for (piece, budget, flush) in cuts {
                let k = piece.min(src.len() - at);
                if k > 0 {
                    s.queue.push_back(Bytes::copy_from_slice(&src[at..at + k]));
                    s.queued += k as u64;
                    at += k;
                }
                if flush {
                    s.coder.flush_at = s.queued;
                }
                let (out, _) = s.emit(budget);
                decode(&mut dec, &out, &mut got);
                prop_assert_eq!(&got[..], &src[..got.len()]);
            }
            if at < src.len() {
                s.queue.push_back(Bytes::copy_from_slice(&src[at..]));
                s.queued = src.len() as u64;
            }
            s.coder.flush_at = s.queued;
            for _ in 0..1000 {
                if s.sent == s.queued {
                    break;
                }
                let (out, _) = s.emit(RAW_TURN);
                decode(&mut dec, &out, &mut got);
            }
            prop_assert_eq!(got, src);
            prop_assert!(s.queue.iter().all(Bytes::is_empty));
            prop_assert_eq!(s.coder.stage.len(), 0);
        }

        /// Without flush points, chunk boundaries are those of the whole stream cut at once, so
        /// a repeat deduplicates however differently its bytes were written.
        #[test]
        fn boundaries_do_not_depend_on_write_sizes(
            seed in any::<u64>(),
            len in 1usize..300_000,
            pieces in proptest::collection::vec(1usize..70_000, 1..40),
        ) {
            let src = data(seed, len);
            let mut s = Sender::new();
            let mut dec = Decoder::with_capacity(s.cfg.cache_bytes, true);
            let (mut got, mut lens) = (Vec::new(), Vec::new());
            let mut at = 0;
            for piece in pieces.iter().cycle() {
                if at == src.len() {
                    break;
                }
                let k = (*piece).min(src.len() - at);
                s.queue.push_back(Bytes::copy_from_slice(&src[at..at + k]));
                s.queued += k as u64;
                at += k;
                let (out, _) = s.emit(RAW_TURN);
                lens.extend(decode(&mut dec, &out, &mut got));
            }
            s.coder.flush_at = s.queued;
            let (out, _) = s.emit(usize::MAX);
            lens.extend(decode(&mut dec, &out, &mut got));
            prop_assert_eq!(&got, &src);
            let whole: Vec<usize> = codec::chunks(&src, &s.cfg).map(|(_, l)| l).collect();
            prop_assert_eq!(lens, whole);
        }
    }
}
