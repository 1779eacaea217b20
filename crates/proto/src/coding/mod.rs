//! Stream optimization on the link: chunking state per stream on the send side, decoding state
//! per stream on the receive side, and the caches they share, one per lane and scope.
//!
//! Chunks are encoded when the scheduler emits a frame and decoded when the frame arrives, so the
//! sender's mirror of each cache sees the same inserts and touches, in the same order, as the
//! receiver's cache. The latency lane has caches of its own, because frames of different lanes
//! have no fixed order relative to each other.

mod contexts;
mod recv;
mod send;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use wanopt_codec as codec;
use wanopt_codec::cache::Snapshot;
use wanopt_codec::send::{Limits, Pending, RAW_TURN, emit, emit_pending};

pub use wanopt_codec::cache::{Fingerprint, TierStats};
pub use wanopt_codec::store::ChunkStore;
pub use wanopt_codec::{Compression, DecodeStats, EncodeStats, LongContext, Pressure};

use self::contexts::Contexts;
pub(crate) use self::recv::{Decoded, FRAME_COST, RecvCoded};
pub(crate) use self::send::SendCoder;
use crate::error::LinkError;
use crate::frame::{self, CacheOffer, Class, Frame, StreamId};
use crate::lane::{
    CAP_COMPACT_RUNS, CAP_CONTEXT, CAP_DELTA_RUNS, CAP_REF_RUNS, CAP_RUNS, CAP_SHORT_CODED,
    LATENCY_LANE,
};

/// Which cache a service's chunks go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The link's shared cache: most dedup, but services can learn about each other's data
    /// from compressed sizes.
    Link,
    /// A cache of the service's own.
    Service,
}

impl std::fmt::Display for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Scope::Link => "link",
            Scope::Service => "service",
        })
    }
}

impl std::str::FromStr for Scope {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "link" => Ok(Scope::Link),
            "service" => Ok(Scope::Service),
            _ => Err(format!("{s:?} is not link or service")),
        }
    }
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
    /// Long-window contexts for bulk streams, each way (offered to the peer, used as agreed);
    /// `None`: a bulk stream's chunks compress alone.
    pub long_context: Option<LongContext>,
    /// Bytes of what we sent kept as bases for deltas; 0 turns deltas off both ways (we do not
    /// offer to decode them either, as with long contexts).
    pub delta_bytes: u64,
    /// Runs of a bulk stream's literals share one flush, both ways (off: neither sent nor
    /// offered, as a build without them behaves).
    pub runs: bool,
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
            long_context: Some(LongContext::default()),
            delta_bytes: codec::delta::DEFAULT_STORE as u64,
            runs: true,
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

pub(crate) fn lane_share(bytes: u64, lane: usize) -> u64 {
    if lane == LATENCY_LANE {
        bytes / LATENCY_SHARE
    } else {
        bytes
    }
}

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

/// A saved state both sides agreed to resume, for the runtime to load (see
/// [`Event::LoadStates`](crate::Event)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateRequest {
    pub role: Role,
    pub lane: usize,
    pub scope: Arc<str>,
    pub digest: Fingerprint,
}

/// Where the daemon keeps a link's caches beyond memory: the disk tiers of our decoders. Saved
/// states are listed and loaded by the runtime itself, off the link's path: it lists them into
/// [`LinkConfig::saved_states`](crate::LinkConfig) and answers [`Event::LoadStates`](crate::Event);
/// it writes them on [`Event::Checkpoint`](crate::Event).
pub trait CacheStorage: Send + Sync + std::fmt::Debug {
    /// The disk store of our decoder cache of a lane and scope, if it has a disk tier.
    fn store(&self, lane: usize, scope: &str) -> Option<Box<dyn ChunkStore>>;
}

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
    /// `mirror` (the encoder's copy of the peer's cache), `decoder`, or `bases` (what we sent,
    /// kept as delta bases).
    pub role: &'static str,
    pub bytes: u64,
    pub chunks: u64,
    pub evictions: u64,
    /// Where a decoder's (or the store of bases') bytes are: memory and disk.
    pub tiers: TierStats,
}

/// What the peer's hello says about its codec.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PeerCodec {
    /// Its capability bits.
    pub caps: u64,
    /// Bytes of its shared and service-scoped caches (which our mirrors follow).
    pub cache: u64,
    pub service_cache: u64,
    /// Its largest frame payload and its link window.
    pub max_frame: usize,
    pub link_window: u64,
    /// The long contexts it decodes.
    pub long: Option<LongContext>,
}

/// Most chunk answers (re-sent chunks) queued for the peer at once.
const MAX_ANSWERS: usize = 1024;

/// The codec as the link sees it: the caches of both directions, each service's policy, what
/// limits throughput now, and the chunk answers queued. The link hands it a stream's queued bytes
/// and the codec frames that arrive; it hands back frames to queue and bytes to deliver. Without
/// codec settings it does nothing, and a codec frame from the peer is a protocol error.
#[derive(Debug)]
pub(crate) struct Coding {
    ctx: Option<Contexts>,
    policies: HashMap<Arc<str>, StreamPolicy>,
    /// Services whose bytes go through caches of their own, both ways: those either side's
    /// hello named. Fixed for the link's life (a reload's scope changes wait for the next link).
    scoped: HashSet<Arc<str>>,
    pressure: Pressure,
    answers: usize,
    /// The peer decodes context records.
    peer_context: bool,
    /// The peer decodes runs of context literals.
    peer_runs: bool,
    /// The peer decodes delta runs.
    peer_delta_runs: bool,
    /// The peer keeps stream logs.
    peer_ref_runs: bool,
    /// The peer decodes compact runs (short reference checks, bare delta frames).
    peer_compact_runs: bool,
    /// The peer reads short coded frames.
    peer_short_frames: bool,
    /// Coded frames received so far (each one's place in arrival order).
    arrivals: u64,
}

/// A stream's turn at sending coded bytes.
pub(crate) struct CodedTurn<'a> {
    pub id: StreamId,
    pub lane: usize,
    pub service: &'a Arc<str>,
    /// Stream offset of the first unsent byte.
    pub sent: u64,
    /// Bytes queued, and whether the stream ends after them.
    pub queued: usize,
    pub fin_requested: bool,
    /// Raw bytes the stream and link credit allow.
    pub budget: usize,
    /// Record bytes after which the turn ends (fairness); at least one chunk always goes.
    pub quantum: usize,
    /// Record bytes a frame holds at most.
    pub room: usize,
}

/// What one coded turn sent: raw bytes covered, and whether the frame ends the stream.
#[derive(Debug)]
pub(crate) struct Emitted {
    pub raw: usize,
    pub fin: bool,
    /// A frame whose context records are still being made: nothing of it is in `out` yet
    /// (see [`Coding::finish_frame`]).
    pub pending: Option<(PendingFrame, Pending)>,
}

/// What a coded frame left waiting for its stream's context records needs to be written:
/// its header's fields and where its mirror is.
#[derive(Debug)]
pub(crate) struct PendingFrame {
    pub id: StreamId,
    pub lane: usize,
    pub service: Arc<str>,
    scope: Arc<str>,
    sent: u64,
    scoped: bool,
    raw: usize,
}

fn no_codec(what: &str) -> LinkError {
    LinkError::Protocol(format!("{what} without a codec"))
}

impl Coding {
    pub fn new(
        settings: Option<CodecSettings>,
        storage: Option<Arc<dyn CacheStorage>>,
        saved: Vec<SavedCache>,
    ) -> Self {
        Coding {
            ctx: settings.map(|c| Contexts::new(c, storage, saved)),
            policies: HashMap::new(),
            scoped: HashSet::new(),
            pressure: Pressure::CpuBound,
            answers: 0,
            peer_context: false,
            peer_runs: false,
            peer_delta_runs: false,
            peer_ref_runs: false,
            peer_compact_runs: false,
            peer_short_frames: false,
            arrivals: 0,
        }
    }

    /// A fresh codec state for the next connection of the same link (after a lost one): the
    /// same policies, pressure and zstd level, caches as `saved` lets both sides resume them.
    pub fn renew(
        &self,
        settings: Option<CodecSettings>,
        storage: Option<Arc<dyn CacheStorage>>,
        saved: Vec<SavedCache>,
    ) -> Coding {
        let mut c = Coding::new(settings, storage, saved);
        c.policies = self.policies.clone();
        c.pressure = self.pressure;
        // Frames queued before the connection was lost keep their places before the new ones.
        c.arrivals = self.arrivals;
        if let (Some(new), Some(old)) = (c.ctx.as_mut(), self.ctx.as_ref()) {
            new.set_zstd_level(old.zstd_level());
            new.given_bases = old.given_bases.clone();
            new.workers = old.workers.clone();
        }
        c
    }

    /// Drops the caches (and stream contexts) of one lane on both sides of the codec: that
    /// lane's connection was lost with frames in flight, so both sides start it empty.
    pub fn reset_lane(&mut self, lane: usize) {
        if let Some(ctx) = self.ctx.as_mut() {
            ctx.reset_lane(lane);
        }
    }

    /// Our saved states, for the hello.
    pub fn offers(&self) -> Vec<CacheOffer> {
        self.ctx.as_ref().map(Contexts::offers).unwrap_or_default()
    }

    pub fn set_policies(&mut self, policies: HashMap<Arc<str>, StreamPolicy>) {
        self.policies = policies;
    }

    /// The services our policies give caches of their own, for the hello (sorted, at most
    /// [`frame::MAX_SCOPED`]).
    pub fn own_scoped(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .policies
            .iter()
            .filter(|(_, p)| p.scope == Scope::Service)
            .map(|(s, _)| s.to_string())
            .collect();
        v.sort_unstable();
        v.truncate(frame::MAX_SCOPED);
        v
    }

    /// Checks a coded frame's scope against the agreement: a service's frames use its own
    /// cache exactly when the hellos named it.
    pub fn check_scope(&self, service: &str, scoped: bool) -> Result<(), String> {
        match (scoped, self.scoped.contains(service)) {
            (true, false) => Err(format!(
                "service-scoped frames for {service}, whose scope the hellos did not agree"
            )),
            (false, true) => Err(format!(
                "shared-cache frames for {service}, which the hellos agreed has its own cache"
            )),
            _ => Ok(()),
        }
    }

    /// Uses `bases` as the store of delta bases (see [`LinkConfig`](crate::LinkConfig)).
    pub fn set_bases(&mut self, bases: Option<codec::SharedBases>) {
        if let Some(ctx) = self.ctx.as_mut() {
            ctx.given_bases = bases;
        }
    }

    /// Prepares chunks on `workers` (see [`LinkConfig`](crate::LinkConfig)).
    pub fn set_workers(&mut self, workers: Option<Arc<dyn codec::prepare::Workers>>) {
        if let Some(ctx) = self.ctx.as_mut() {
            ctx.workers = workers;
        }
    }

    pub fn set_pressure(&mut self, p: Pressure) {
        self.pressure = p;
    }

    pub fn set_zstd_level(&mut self, level: i32) {
        if let Some(ctx) = self.ctx.as_mut() {
            ctx.set_zstd_level(level);
        }
    }

    /// Takes what the peer's hello says about its codec, and the saved states it offers.
    pub fn on_peer(&mut self, peer: &PeerCodec, offers: &[CacheOffer], scoped: &[String]) {
        self.peer_context = peer.caps & CAP_CONTEXT != 0;
        self.peer_runs = peer.caps & CAP_RUNS != 0;
        self.peer_delta_runs = peer.caps & CAP_DELTA_RUNS != 0;
        self.peer_ref_runs = peer.caps & CAP_REF_RUNS != 0;
        self.peer_compact_runs = peer.caps & CAP_COMPACT_RUNS != 0;
        self.peer_short_frames = peer.caps & CAP_SHORT_CODED != 0;
        self.scoped = self
            .own_scoped()
            .iter()
            .chain(scoped)
            .map(|s| Arc::from(s.as_str()))
            .collect();
        if peer.caps & crate::lane::CAP_CODEC != 0
            && let Some(ctx) = self.ctx.as_mut()
        {
            ctx.on_peer(peer, offers);
        }
    }

    /// The saved states chosen for resumption, for the runtime to load (taken once).
    pub fn take_state_requests(&mut self) -> Vec<StateRequest> {
        self.ctx
            .as_mut()
            .map(Contexts::take_requests)
            .unwrap_or_default()
    }

    /// The states the runtime loaded; `None` for one it could not (that cache starts empty).
    pub fn states_loaded(&mut self, states: Vec<(StateRequest, Option<Snapshot>)>) {
        if let Some(ctx) = self.ctx.as_mut() {
            ctx.states_loaded(states);
        }
    }

    /// The encoder state for a new stream, if its service's bytes are to be optimized; its
    /// sender holds at most `send_buffer` unsent bytes.
    pub fn coder_for(
        &self,
        service: &str,
        class: Class,
        send_buffer: usize,
    ) -> Option<Box<SendCoder>> {
        let chunking = self.ctx.as_ref()?.chunking.as_ref()?;
        let p = self.policies.get(service).copied().unwrap_or_default();
        if p.compression == Compression::None && !p.dedup {
            return None;
        }
        let mut c = SendCoder::new(&p, class == Class::Latency);
        c.scoped = self.scoped.contains(service);
        c.max_chunk = chunking.max_chunk;
        c.gather = wanopt_codec::send::gather(send_buffer, chunking.max_chunk);
        c.sender.policy.context = self.peer_context;
        // Runs only where we send them and the peer decodes them.
        c.sender.policy.runs = self.peer_context && self.peer_runs && chunking.runs;
        c.sender.policy.delta_runs = self.peer_delta_runs && chunking.runs;
        c.sender.policy.ref_runs = self.peer_ref_runs && chunking.runs;
        c.sender.policy.compact_runs = c.sender.policy.ref_runs && self.peer_compact_runs;
        Some(Box::new(c))
    }

    /// How many coded frames of `lane`'s bulk streams may wait for their context records at
    /// once (0: none may), and the workers that make them.
    pub(crate) fn pending_frames(
        &self,
        lane: usize,
    ) -> (usize, Option<Arc<dyn codec::prepare::Workers>>) {
        let workers = self
            .ctx
            .as_ref()
            .and_then(|c| c.workers.clone())
            .filter(|_| lane == crate::lane::MAIN_LANE);
        let n = workers
            .as_ref()
            .map_or(0, |w| w.threads().min(codec::PENDING));
        (if n > 1 { n } else { 0 }, workers)
    }

    /// True if `coder`'s next frame makes no context record under the link's pressure, so
    /// leaving it pending would only copy its records once more when it is finished (see
    /// [`Sender::plans_whole`](wanopt_codec::send::Sender::plans_whole)).
    pub(crate) fn plans_whole(&self, coder: &SendCoder) -> bool {
        coder.sender.plans_whole(self.pressure)
    }

    /// How many frames of `lane` may be fed to their streams' contexts ahead of their turn at
    /// once (0: none may), and the workers that feed them. More than the threads: the caller
    /// feeds later frames while a worker feeds the oldest, and the decoding caller needs
    /// frames fed while it decodes (on two threads, four streams' context decode went from
    /// 1.24-1.51x of one thread with two frames ahead to 1.98-3.00x with eight).
    pub(crate) fn fed_frames(
        &self,
        lane: usize,
    ) -> (usize, Option<Arc<dyn codec::prepare::Workers>>) {
        let (n, workers) = self.pending_frames(lane);
        (if n > 0 { codec::PENDING } else { 0 }, workers)
    }

    /// Writes a frame left waiting for its context records (see [`emit_frame`](Self::emit_frame))
    /// to `out`: its header, and its records once they are made. `coder` is its stream's (none
    /// if the stream is gone: its records still go, the peer's cache counts on them). Returns
    /// the frame's bytes.
    pub(crate) fn finish_frame(
        &mut self,
        f: &PendingFrame,
        p: Pending,
        coder: Option<&mut SendCoder>,
        out: &mut BytesMut,
    ) -> usize {
        let start = out.len();
        let at = frame::begin_coded(out, f.id, f.sent, self.peer_short_frames);
        let mut stats = EncodeStats::default();
        match self.ctx.as_mut() {
            Some(ctx) => {
                let mirror = ctx.mirror(f.lane, &f.scope);
                match coder {
                    Some(c) => p.finish(&mut c.sender, mirror, out, &mut stats),
                    None => p.finish_orphan(mirror, out, &mut stats),
                };
                ctx.count_sent(&f.service, &stats);
            }
            // A pending frame was planned by a mirror: the codec is there.
            None => return 0,
        }
        frame::finish_coded(out, at, false, f.scoped, f.raw as u32);
        out.len() - start
    }

    /// Encodes a stream's next chunks as one coded frame into `out`. `None`, with `out`
    /// untouched, when nothing may go yet: the stream waits for a boundary, a flush or credit.
    /// With `pend`, a frame with context records may be left for workers to make them
    /// ([`Emitted::pending`]): it is to be finished ([`finish_frame`](Self::finish_frame))
    /// before any frame after it is written, and before the stream's turn after next.
    pub fn emit_frame(
        &mut self,
        t: CodedTurn<'_>,
        coder: &mut SendCoder,
        queue: &mut VecDeque<Bytes>,
        out: &mut BytesMut,
        pend: bool,
    ) -> Option<Emitted> {
        let ctx = self.ctx.as_mut()?;
        let chunking = ctx.chunking.clone()?;
        let scope: Arc<str> = if coder.scoped {
            t.service.clone()
        } else {
            Arc::from("")
        };
        let lim = Limits {
            budget: t.budget.min(RAW_TURN),
            quantum: t.quantum,
            room: t.room,
        };
        let mut stats = EncodeStats::default();
        let mirror = ctx.mirror(t.lane, &scope);
        if pend {
            let p = emit_pending(
                &mut coder.sender,
                queue,
                t.sent,
                &chunking,
                mirror,
                self.pressure,
                &lim,
                &mut stats,
            );
            let raw = p.raw();
            let p = if raw == 0 {
                // Nothing to write (see below); the stream's context comes back to it.
                let before = out.len();
                p.finish(&mut coder.sender, mirror, out, &mut stats);
                out.truncate(before);
                None
            } else {
                Some(p)
            };
            stats.frames = u64::from(raw > 0);
            ctx.count_sent(t.service, &stats);
            let p = p?;
            // Written when its records are made (never the stream's last: `pend` is not
            // given for a stream that ends).
            let f = PendingFrame {
                id: t.id,
                lane: t.lane,
                service: t.service.clone(),
                scope,
                sent: t.sent,
                scoped: coder.scoped,
                raw,
            };
            return Some(Emitted {
                raw,
                fin: false,
                pending: Some((f, p)),
            });
        }
        let before = out.len();
        let at = frame::begin_coded(out, t.id, t.sent, self.peer_short_frames);
        let raw = emit(
            &mut coder.sender,
            queue,
            t.sent,
            &chunking,
            mirror,
            self.pressure,
            &lim,
            out,
            &mut stats,
        );
        let fin = t.fin_requested && raw == t.queued;
        let sent = raw > 0 || fin;
        stats.frames = u64::from(sent);
        ctx.count_sent(t.service, &stats);
        if !sent {
            // Nothing was written but the frame's header (a turn that sends nothing writes no
            // record; a chunk waiting for its bases counts the wait).
            out.truncate(before);
            return None;
        }
        frame::finish_coded(out, at, fin, coder.scoped, raw as u32);
        Some(Emitted {
            raw,
            fin,
            pending: None,
        })
    }

    /// Checks that a coded frame may be received at all.
    pub fn accept_coded(&self) -> Result<(), LinkError> {
        if self.ctx.is_none() {
            return Err(no_codec("coded frame"));
        }
        Ok(())
    }

    /// The place of a coded frame just received among all that arrived (see
    /// [`RecvCoded::front_seq`]).
    pub(crate) fn arrival(&mut self) -> u64 {
        self.arrivals += 1;
        self.arrivals
    }

    /// A chunk a stream of `service` asks the peer for, counted.
    pub(crate) fn count_need(&mut self, service: &Arc<str>) {
        if let Some(ctx) = self.ctx.as_mut() {
            ctx.counts.entry(service.clone()).or_default().needs += 1;
        }
    }

    /// The caches and decoders, when the link has the codec: what decodes a stream's waiting
    /// frames ([`Contexts::decode`]).
    pub(crate) fn contexts(&mut self) -> Option<&mut Contexts> {
        self.ctx.as_mut()
    }

    /// Decodes a frame of a stream we already closed: what it puts in the shared cache keeps our
    /// cache in step with the peer's mirror (a scoped frame touches only its service's cache,
    /// which nothing else reads, so it is dropped).
    pub fn decode_orphan(&mut self, lane: usize, records: Bytes, raw_len: u32, fin: bool) {
        if let Some(ctx) = self.ctx.as_mut() {
            let mut rc = RecvCoded::default();
            rc.push(records, raw_len, fin, false, 0);
            let _ = ctx.decode(&mut rc, lane, &Arc::from(""), 0);
        }
    }

    /// Our answer to the peer's `Need`: the chunk's bytes if our mirror still holds them, none if
    /// not. `service` is the asking stream's, for the counts.
    pub fn answer(
        &mut self,
        stream: StreamId,
        lane: usize,
        scope: String,
        fingerprint: Fingerprint,
        service: Option<&Arc<str>>,
    ) -> Result<Frame, LinkError> {
        let Some(ctx) = self.ctx.as_mut() else {
            return Err(no_codec("chunk request"));
        };
        if self.answers >= MAX_ANSWERS {
            return Err(LinkError::Protocol("too many chunk requests".into()));
        }
        let data = ctx.resend(lane, &scope)(&fingerprint).unwrap_or_default();
        if let Some(svc) = service
            && !data.is_empty()
        {
            ctx.counts.entry(svc.clone()).or_default().resent += 1;
        }
        self.answers += 1;
        Ok(Frame::Chunk {
            stream,
            scope,
            fingerprint,
            data,
        })
    }

    /// A chunk answer went out.
    pub fn answered(&mut self) {
        self.answers = self.answers.saturating_sub(1);
    }

    /// A chunk the peer re-sent after we asked, checked against its fingerprint and cached.
    /// `Ok(false)`: an empty answer, the peer lost the chunk too.
    pub fn chunk_arrived(
        &mut self,
        lane: usize,
        scope: &Arc<str>,
        fingerprint: Fingerprint,
        data: &[u8],
    ) -> Result<bool, LinkError> {
        let Some(ctx) = self.ctx.as_mut() else {
            return Err(no_codec("chunk"));
        };
        if data.is_empty() {
            return Ok(false);
        }
        // Only a cache we asked from: a peer's scope names never create caches (or directories).
        let ok = ctx
            .existing_decoder(lane, scope)
            .is_some_and(|d| d.insert_verified(fingerprint, data));
        if !ok {
            return Err(LinkError::Protocol(
                "re-sent chunk does not match its fingerprint".into(),
            ));
        }
        Ok(true)
    }

    /// The mirrors changed since their last checkpoint, as (lane, scope).
    pub fn dirty_mirrors(&self) -> Vec<(usize, Arc<str>)> {
        self.ctx
            .as_ref()
            .map(Contexts::dirty_mirrors)
            .unwrap_or_default()
    }

    /// A mirror's state as a `Checkpoint` frame leaves: what the peer's cache will be when it
    /// reads the frame.
    pub fn checkpoint_mirror(&mut self, lane: usize, scope: &str) -> Option<Arc<Snapshot>> {
        self.ctx.as_mut()?.checkpoint_mirror(lane, scope)
    }

    /// True if we have a decoder for this lane and scope (it was ever used).
    pub fn has_decoder(&self, lane: usize, scope: &str) -> Result<bool, LinkError> {
        let Some(ctx) = self.ctx.as_ref() else {
            return Err(no_codec("checkpoint"));
        };
        Ok(ctx.has_decoder(lane, scope))
    }

    /// The peer's checkpoint: our decoder's state, if it is the one the digest names (a stream
    /// stalled on a miss, for one, leaves it behind).
    pub fn checkpoint_decoder(
        &mut self,
        lane: usize,
        scope: &str,
        digest: &Fingerprint,
    ) -> Result<Option<Arc<Snapshot>>, LinkError> {
        let Some(ctx) = self.ctx.as_mut() else {
            return Err(no_codec("checkpoint"));
        };
        Ok(ctx.checkpoint_decoder(lane, scope, digest))
    }

    /// Drains the per-service counts accumulated since the last call.
    pub fn take_counts(&mut self) -> Vec<(Arc<str>, CodecCount)> {
        self.ctx
            .as_mut()
            .map(|c| c.counts.drain().collect())
            .unwrap_or_default()
    }

    pub fn cache_stats(&self) -> Vec<CacheStat> {
        self.ctx
            .as_ref()
            .map(Contexts::cache_stats)
            .unwrap_or_default()
    }

    pub fn corrupt_decoders(&mut self) -> usize {
        self.ctx.as_mut().map_or(0, Contexts::corrupt_decoders)
    }

    pub fn cache_digests(&self) -> Vec<(&'static str, usize, Arc<str>, Fingerprint)> {
        self.ctx
            .as_ref()
            .map(Contexts::cache_digests)
            .unwrap_or_default()
    }

    /// Literals our decoders took as fed ahead (see [`codec::Decoder::lits_ahead`]).
    pub fn lits_ahead(&self) -> u64 {
        self.ctx.as_ref().map_or(0, Contexts::lits_ahead)
    }
}
