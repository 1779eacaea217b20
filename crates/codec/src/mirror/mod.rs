//! The encoding side of one cache: a [`Mirror`] of the peer decoder's cache, which turns each
//! chunk into a record (a reference, a literal, a delta, or raw bytes), and each stream's
//! [`Hint`], its memory between chunks. The chunk in its stream's context is `in_context.rs`;
//! deltas against the store of what was sent are `with_bases.rs`.

use crate::format::Out;

use crate::cache::ChunkCache;
use crate::config::{Codec, Compression, Policy, Pressure};
use crate::context::{LongContext, SendContext, Slots};
use crate::delta::{self, SharedBases};
use crate::fingerprint::{Fingerprint, fingerprint};
use crate::format::{NO_CACHE, TAG_LIT_CONTEXT, TAG_RAW, TAG_REF, pays, put_len, skewed};
use crate::maker;
use crate::prepare;
use crate::report::{EncodeStats, Report, Sent};

mod in_context;
use in_context::Planned;
mod logged;
mod with_bases;
#[cfg(test)]
pub(crate) use with_bases::SEND_RUN_CHUNKS;

use logged::RefRun;
use with_bases::Run;

/// Per-stream memory of the encoder: the adaptive choice's (after incompressible chunks, skip the
/// trial for a growing number of chunks, so encrypted or compressed data costs almost nothing)
/// and the stream's zstd context, once it has one.
#[derive(Default)]
pub struct Hint {
    skip: u32,
    backoff: u32,
    context: Option<SendContext>,
    /// Chunks still to be treated as part of a live stream, counted down from [`LIVE_CHUNKS`]
    /// at each flushed tail.
    live: u32,
    /// The stream's last record was not a context literal (a reference, a delta, a literal
    /// alone): the next literal goes flushed, since a run of one costs a run end more than a
    /// flushed literal. Literals in a row start or extend a run.
    interrupted: bool,
    /// Chunks in a row that paid (see [`TRIAL_EVERY`]).
    paid: u32,
    /// The delta run being gathered (see [`with_bases`]), flushed before any other record.
    run: Option<Box<Run>>,
    /// The serial of the stream's log, once it has one (see [`logged`]).
    log: Option<u32>,
    /// The reference run being gathered, flushed before any other record.
    refs: Option<Box<RefRun>>,
    /// The chunk that waited for its bases to be read, and how many times (see
    /// [`MAX_WAITS`]).
    waited: Option<(Fingerprint, u32)>,
    /// The chunk being encoded may not wait: a record for it went out already (its stream's
    /// log started), which a turn that ends with no raw bytes would drop.
    no_wait: bool,
    /// The turn's context records so far (see [`crate::maker`]): their raw bytes and count,
    /// and what those made already cost; learned from at the turn's end.
    planned: (usize, usize),
    /// Bytes of bases the turn's delta runs left to be made hold (see `plan_run`).
    planned_bases: usize,
    outcomes: Vec<maker::Outcome>,
}

/// Turns a chunk may wait for its bases to be read from the disk tier before it goes with
/// whatever bases are at hand (a read lost or slow costs at most this many wake-ups; any read
/// the store finishes wakes the stream, the chunk's own may come after others queued). On a
/// changed 1.6 GB backup whose first copy was mostly on the disk tier, chunks that found their
/// bases still being read went as literals: 11.6 MB of them cost 1.34 MB of the changed copy's
/// 6.17 MB.
pub const MAX_WAITS: u32 = 8;

/// After this many chunks in a row of a stream paid, its chunks in context skip the LZ4 trial
/// that tells noise apart, except every this-many-th: the trial was 2.5% of a profile of the
/// reduction bench's row binlog (`perf record`), and data turning to noise is still caught
/// within this many chunks (each costs zstd's time, not wire: the context's own result judges
/// it).
pub const TRIAL_EVERY: u32 = 16;

/// After a flushed tail, this many chunks count as live: they are compressed in the stream's
/// context too. A stream that pauses this often is live redo, whose every piece gains from the
/// context (pgbench's WAL: 0.108 of the raw bytes with all pieces in context, 0.144 with tails
/// only); a steady bulk stream never pauses, and its chunks compress alone (a third faster).
pub const LIVE_CHUNKS: u32 = 32;

impl std::fmt::Debug for Hint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hint")
            .field("skip", &self.skip)
            .field("backoff", &self.backoff)
            .field("context", &self.context.is_some())
            .field("live", &self.live)
            .field("paid", &self.paid)
            .field("run", &self.run.as_ref().map_or(0, |r| r.chunks.len()))
            .field("waited", &self.waited.map(|w| w.1))
            .finish()
    }
}

impl Hint {
    /// True while the stream holds a context of its own (started, and not dropped since):
    /// without one, a turn makes a context record only if it starts one.
    pub(crate) fn has_context(&self) -> bool {
        self.context.is_some()
    }

    /// True if chunk `f`, whose bases are being read, may wait for them once more (counted).
    pub(crate) fn may_wait(&mut self, f: Fingerprint, policy: &Policy) -> bool {
        if !policy.wait_bases || self.no_wait {
            return false;
        }
        match &mut self.waited {
            Some((w, n)) if *w == f => {
                *n += 1;
                *n <= MAX_WAITS
            }
            w => {
                *w = Some((f, 1));
                true
            }
        }
    }

    /// Raw bytes of the stream's open run (of context literals, or of a delta run's chunks):
    /// their records are still to come, in this frame (at most about as many bytes; see
    /// [`run_reserve`]).
    pub fn run_pending(&self) -> usize {
        self.planned.0
            + self.planned.1 * maker::PLANNED_OVERHEAD
            + self.run.as_ref().map_or(0, |r| r.pending())
            + self.refs.as_ref().map_or(0, |r| r.pending())
    }

    fn incompressible(&mut self) {
        self.backoff = (self.backoff * 2).clamp(1, 64);
        self.skip = self.backoff;
        self.paid = 0;
    }
    fn compressible(&mut self) {
        self.backoff = 0;
        self.paid = self.paid.saturating_add(1);
    }
    /// Whether the stream's chunks paid long enough for this one to skip the noise trial.
    fn trusted(&self) -> bool {
        self.paid >= TRIAL_EVERY && !self.paid.is_multiple_of(TRIAL_EVERY)
    }
}

/// The encoding side of one cache: an index-only mirror of the peer decoder's cache (same
/// capacity, same inserts and touches in the same order), the bytes of recently referenced chunks
/// (to answer a miss), and reusable compression state.
pub struct Mirror {
    cache: ChunkCache,
    recent: Recent,
    zstd: Option<zstd::bulk::Compressor<'static>>,
    zstd_level: i32,
    contexts: Slots,
    /// Long contexts both sides agreed on, and the link's count of them in use.
    long: Option<(LongContext, Slots)>,
    /// The store of what we sent, for deltas against it; `None`: no deltas.
    bases: Option<SharedBases>,
    delta: delta::SendScratch,
    /// Stream contexts started so far (each one's serial).
    serials: u64,
    /// Compression output: the first `clen` bytes.
    scratch: Vec<u8>,
    clen: usize,
    /// The chunk being encoded goes as a context record, planned so (see [`crate::maker`]).
    context: Option<Planned>,
    /// Context records made on this thread are compressed here.
    run_scratch: Vec<u8>,
    /// While a worker makes the stream's context records: where they are queued for it.
    lane: Option<maker::Open>,
    /// The queued records' buffers, between turns.
    spare: Vec<Vec<u8>>,
    /// Threads to prepare a turn's chunks on (see [`prepare`]); `None`: each chunk in turn.
    workers: Option<std::sync::Arc<dyn prepare::Workers>>,
    /// The slots a turn's chunks are prepared in (see [`take_slots`](Mirror::take_slots)).
    batch: Vec<prepare::Prepared>,
    /// Bulk turns planned with workers, all streams': whether another stream's turn comes
    /// between two of a stream's (see [`bulk_turn`](Self::bulk_turn)).
    bulk_turns: u64,
    /// A delta run's buffers between runs (a stream holds them only while it gathers one).
    run_spare: Option<Box<Run>>,
    /// Counts of records written for chunks reported earlier (a delta run's, a run's end):
    /// see [`take_late`](Mirror::take_late).
    late: EncodeStats,
    /// The streams' logs as the peer keeps them, where each chunk was logged last, and the
    /// last serial given.
    logs: crate::logs::Logs,
    places: crate::fingerprint::FpMap<(u32, u64)>,
    log_serials: u32,
    names_scratch: Vec<Fingerprint>,
    /// A delta run's list of bases, put together.
    names_buf: Vec<u8>,
}

/// The bytes of the chunks sent as references most recently, bounded in bytes: the receiver asks
/// for one only if it could not resolve it, within about a round trip of receiving it.
struct Recent {
    capacity: usize,
    size: usize,
    seq: u64,
    map: crate::fingerprint::FpMap<(u64, bytes::Bytes)>,
    order: std::collections::VecDeque<(u64, Fingerprint)>,
}

impl Recent {
    fn put(&mut self, f: Fingerprint, data: &[u8]) {
        self.put_with(f, data.len(), || bytes::Bytes::copy_from_slice(data));
    }

    /// Keeps a chunk's bytes (made by `data` only if not held yet), dropping the oldest to fit.
    fn put_with(&mut self, f: Fingerprint, len: usize, data: impl FnOnce() -> bytes::Bytes) {
        if len > self.capacity {
            return;
        }
        self.seq += 1;
        match self.map.get_mut(&f) {
            Some(e) => e.0 = self.seq,
            None => {
                self.size += len;
                self.map.insert(f, (self.seq, data()));
            }
        }
        self.order.push_back((self.seq, f));
        while self.size > self.capacity || self.order.len() > 4 * self.map.len() + 64 {
            let Some((seq, victim)) = self.order.pop_front() else {
                break;
            };
            if self.map.get(&victim).is_some_and(|e| e.0 == seq)
                && let Some((_, d)) = self.map.remove(&victim)
            {
                self.size -= d.len();
            }
        }
    }
}

impl Mirror {
    /// What literals are believed to cost, wire bytes per raw byte (tests set it).
    #[cfg(test)]
    pub(crate) fn set_lit_ratio(&mut self, r: f64) {
        self.delta.lit_ratio = r;
    }
}

impl Mirror {
    /// A mirror of a peer cache of `cache_bytes`, keeping up to `resend_bytes` of recently
    /// referenced chunks, compressing with zstd at `zstd_level`.
    pub fn new(cache_bytes: usize, resend_bytes: usize, zstd_level: i32) -> Self {
        Mirror {
            cache: ChunkCache::new(cache_bytes),
            recent: Recent {
                capacity: resend_bytes,
                size: 0,
                seq: 0,
                map: Default::default(),
                order: std::collections::VecDeque::new(),
            },
            // One zstd context for the mirror's life: creating one per chunk cost more than compressing.
            zstd: zstd::bulk::Compressor::new(zstd_level).ok(),
            zstd_level,
            contexts: Slots::default(),
            long: None,
            bases: None,
            delta: delta::SendScratch::default(),
            serials: 0,
            scratch: Vec::new(),
            clen: 0,
            context: None,
            run_scratch: Vec::new(),
            lane: None,
            spare: Vec::new(),
            workers: None,
            batch: Vec::new(),
            bulk_turns: 0,
            run_spare: None,
            late: EncodeStats::default(),
            logs: crate::logs::Logs::for_cache(cache_bytes),
            places: Default::default(),
            log_serials: 0,
            names_scratch: Vec::new(),
            names_buf: Vec::new(),
        }
    }

    /// Counts of the records written since the last call for chunks whose reports came
    /// earlier: a delta run flushed (as one, or as literals if it did not pay) and the ends of
    /// context runs. Their raw bytes were counted with the chunks' reports.
    pub fn take_late(&mut self) -> EncodeStats {
        std::mem::take(&mut self.late)
    }

    /// Prepares chunks on `workers` before encoding them (see [`prepare`]); `None`: each chunk
    /// is fingerprinted and compressed as it is encoded.
    pub fn set_workers(&mut self, workers: Option<std::sync::Arc<dyn prepare::Workers>>) {
        self.workers = workers;
    }

    /// Whether chunks are prepared on workers.
    pub fn has_workers(&self) -> bool {
        self.workers.is_some()
    }

    /// How many turns of bulk streams may wait for their context records at once
    /// ([`send::emit_pending`](crate::send::emit_pending)): as many as there are threads to make
    /// them, at most [`PENDING`](crate::encoder::PENDING); none without workers.
    pub fn pending_turns(&self) -> usize {
        self.workers
            .as_ref()
            .map_or(0, |w| w.threads().min(crate::PENDING))
    }

    /// The workers chunks are prepared on, if any.
    pub(crate) fn workers(&self) -> Option<std::sync::Arc<dyn prepare::Workers>> {
        self.workers.clone()
    }

    /// What the workers do ahead for a chunk of this turn that will go as a literal or a delta
    /// (see [`prepare`]): its compression alone, if that is how its literal goes, and whether
    /// its delta anchors are wanted.
    pub(crate) fn ahead_work(
        &self,
        policy: &Policy,
        pressure: Pressure,
        hint: &Hint,
    ) -> (Option<prepare::Work>, bool) {
        (
            self.literal_work(policy, pressure, hint),
            self.delta_wanted(policy, pressure, hint),
        )
    }

    /// Whether the peer holds the chunk of fingerprint `f` (it will go as a reference).
    pub(crate) fn holds(&self, f: &Fingerprint) -> bool {
        self.cache.contains(f)
    }

    /// The slots a turn's chunks are prepared in, `n` of them, emptied (their buffers stay);
    /// given back with [`put_slots`](Self::put_slots).
    pub(crate) fn take_slots(&mut self, n: usize) -> Vec<prepare::Prepared> {
        let mut v = std::mem::take(&mut self.batch);
        if v.len() < n {
            v.resize_with(n, Default::default);
        }
        v
    }

    /// Counts a bulk stream's turn planned with workers; returns how many were before it.
    pub(crate) fn bulk_turn(&mut self) -> u64 {
        self.bulk_turns += 1;
        self.bulk_turns - 1
    }

    /// Gives back what [`take_slots`](Self::take_slots) took.
    pub(crate) fn put_slots(&mut self, slots: Vec<prepare::Prepared>) {
        self.batch = slots;
    }

    /// Whether this stream's literals go through its context when zstd compresses them.
    fn context_wanted(&self, policy: &Policy, hint: &Hint) -> bool {
        policy.context && (hint.live > 0 || (policy.bulk && self.long.is_some()))
    }

    /// The compression a literal alone of this stream would get, to do ahead; `None` where
    /// its literals go through the stream's context (or are not compressed).
    fn literal_work(
        &self,
        policy: &Policy,
        pressure: Pressure,
        hint: &Hint,
    ) -> Option<prepare::Work> {
        use prepare::Work;
        let in_context = self.context_wanted(policy, hint);
        match policy.compression {
            Compression::None => None,
            Compression::Lz4 => Some(Work::Lz4),
            Compression::Zstd => (!in_context).then_some(Work::Zstd {
                level: self.zstd_level,
                trial: false,
            }),
            Compression::Adaptive if policy.latency || pressure == Pressure::CpuBound => {
                Some(Work::Lz4)
            }
            Compression::Adaptive => (!in_context).then_some(Work::Zstd {
                level: self.zstd_level,
                trial: true,
            }),
        }
    }

    /// Lets bulk streams use long contexts as agreed with the peer, counted in `slots` (shared
    /// by the link's mirrors); `None` compresses their chunks alone.
    /// Counts this mirror's short stream contexts in `slots`, shared with the link's other
    /// mirrors of the lane: [`MIRROR_CONTEXTS`](crate::MIRROR_CONTEXTS) is then the link's
    /// bound, not each mirror's.
    pub fn share_context_slots(&mut self, slots: Slots) {
        self.contexts = slots;
    }

    pub fn set_long_context(&mut self, long: Option<LongContext>, slots: Slots) {
        self.long = long.map(|l| (l, slots));
    }

    /// Stream contexts in use.
    pub fn contexts(&self) -> usize {
        self.contexts.in_use()
    }

    /// Lets chunks go as deltas against what `bases` holds (the store may be shared by the
    /// link's mirrors: a base is used only while this mirror's peer cache holds it); `None`
    /// sends no deltas. Only when the peer decodes delta records.
    pub fn set_bases(&mut self, bases: Option<SharedBases>) {
        self.bases = bases;
    }

    /// The zstd level of what is compressed from now on, stream contexts included (zstd takes
    /// a new level between blocks of a frame; the receiver needs to know nothing).
    pub fn set_zstd_level(&mut self, level: i32) {
        if level != self.zstd_level {
            self.zstd_level = level;
            if let Some(z) = self.zstd.as_mut()
                && z.set_compression_level(level).is_err()
            {
                self.zstd = zstd::bulk::Compressor::new(level).ok();
            }
        }
    }

    /// The zstd level in use.
    pub fn zstd_level(&self) -> i32 {
        self.zstd_level
    }

    /// The mirrored cache (for its size and evictions).
    pub fn cache(&self) -> &ChunkCache {
        &self.cache
    }

    /// The mirrored cache, to restore a snapshot into.
    pub fn cache_mut(&mut self) -> &mut ChunkCache {
        &mut self.cache
    }

    /// Bytes held to answer misses.
    pub fn resend_bytes(&self) -> usize {
        self.recent.size
    }

    /// The bytes of a chunk the peer asked for, to answer its miss: one referenced or named
    /// recently, or else one the store of bases still holds in memory. The store answers what
    /// the recent ones forgot: a request that came long after the chunk went (a stream that
    /// waited behind a slow disk read while other streams went on), or a base the peer's disk
    /// tier lost, which a single delta named without keeping it among the recent.
    pub fn chunk(&self, f: &Fingerprint) -> Option<bytes::Bytes> {
        if let Some((_, d)) = self.recent.map.get(f) {
            return Some(d.clone());
        }
        let bases = self.bases.as_ref()?.lock().ok()?;
        bases.peek(f).map(bytes::Bytes::copy_from_slice)
    }

    /// Forgets the recently referenced chunks, as a request long after them finds them.
    #[cfg(test)]
    pub(crate) fn forget_recent(&mut self) {
        self.recent.map.clear();
        self.recent.order.clear();
        self.recent.size = 0;
    }

    /// Appends the record for one chunk to `out`. With `prepared`, what the workers prepared
    /// for `chunk` (see [`prepare`]) is used: the record is the same either way.
    pub(crate) fn encode_chunk(
        &mut self,
        chunk: &[u8],
        policy: &Policy,
        pressure: Pressure,
        hint: &mut Hint,
        out: &mut impl Out,
        prepared: Option<&mut prepare::Prepared>,
    ) -> Report {
        let p = prepared.filter(|p| p.len == chunk.len());
        // A live stream's chunks join its tails' context; a bulk stream's all go through its
        // long context when there is one to have.
        let live = self.context_wanted(policy, hint);
        let live_before = hint.live;
        hint.live = hint.live.saturating_sub(1);
        let started = self.start_log(policy, hint, out);
        hint.no_wait = started > 0;
        let r = self.encode_piece(chunk, live, policy, pressure, hint, out, p);
        if r.sent == Sent::Wait {
            // The chunk comes again.
            hint.live = live_before;
        }
        Report {
            run_end: r.run_end + started,
            ..r
        }
    }

    /// Appends the record for a chunk or a tail to `out`; a tail may use the stream's context.
    #[allow(clippy::too_many_arguments)]
    fn encode_piece(
        &mut self,
        chunk: &[u8],
        in_context: bool,
        policy: &Policy,
        pressure: Pressure,
        hint: &mut Hint,
        out: &mut impl Out,
        mut prep: Option<&mut prepare::Prepared>,
    ) -> Report {
        let f = if policy.dedup {
            let f = match prep.as_ref().and_then(|p| p.fingerprint) {
                Some(f) => f,
                None => fingerprint(chunk),
            };
            if self.cache.contains(&f) {
                // Only where deltas are wanted: a CPU-bound repeat (the LZ4 path) takes no lock.
                if self.delta_wanted(policy, pressure, hint) {
                    self.ref_base(f, chunk);
                }
                if policy.ref_runs
                    && let Some(r) = self.join_refs(f, chunk, policy.compact_runs, hint, out)
                {
                    return r;
                }
                // Earlier chunks' records first: the peer's cache sees them before this one.
                let run_end = self.end_run(hint, out);
                self.cache.touch(&f);
                self.recent.put(f, chunk);
                self.log_chunk(hint, f);
                hint.interrupted = true;
                out.put_u8(TAG_REF);
                out.put_slice(&f);
                let wire = 17 + put_len(out, chunk.len());
                return Report {
                    sent: Sent::Ref,
                    raw: chunk.len(),
                    wire,
                    run_end,
                    no_base: false,
                };
            }
            Some(f)
        } else {
            None
        };
        let delta = f.is_some() && self.delta_wanted(policy, pressure, hint);
        self.delta.offered = false;
        if let Some(p) = prep.as_deref_mut().filter(|p| delta && p.anchored) {
            // Found on the workers: the same keys `anchors` gives.
            std::mem::swap(&mut self.delta.keys, &mut p.anchors);
            p.anchored = false;
            self.delta.keys_ready = true;
        }
        if let Some(f) = f.filter(|_| delta) {
            let r = if policy.delta_runs {
                self.join_run(f, chunk, (policy, pressure), in_context, hint, out)
            } else {
                self.encode_delta(f, chunk, policy, hint, out)
            };
            self.delta.keys_ready = false;
            if let Some(r) = r {
                return r;
            }
        }
        // A delta run or a reference run gathered so far goes before this chunk.
        let flushed = self.flush_run(hint, out) + self.flush_refs(hint, out);
        let r = self.encode_literal(
            f,
            chunk,
            (policy, pressure),
            (in_context, delta),
            hint,
            out,
            prep,
        );
        Report {
            run_end: r.run_end + flushed,
            ..r
        }
    }

    /// Appends a literal record for `chunk` (fingerprint `f` if cached; `delta`: deltas were
    /// tried for it), compressed in the stream's context if `in_context`.
    #[allow(clippy::too_many_arguments)]
    fn encode_literal(
        &mut self,
        f: Option<Fingerprint>,
        chunk: &[u8],
        (policy, pressure): (&Policy, Pressure),
        (in_context, delta): (bool, bool),
        hint: &mut Hint,
        out: &mut impl Out,
        prep: Option<&mut prepare::Prepared>,
    ) -> Report {
        let codec = self.compress(chunk, policy, pressure, hint, in_context, prep);
        hint.interrupted = self.context.is_none();
        // Only a context literal goes inside a run (or ends it itself).
        let run_end = if self.context.is_none() {
            self.end_run(hint, out)
        } else {
            0
        };
        let wire = match (self.context, codec) {
            (Some(p), _) => {
                // Made now or on a worker; its bytes count at the turn's end.
                let make = maker::Make::Literal {
                    tag: TAG_LIT_CONTEXT | p.flags | if f.is_some() { 0 } else { NO_CACHE },
                    defer: p.defer,
                    cached: f.is_some(),
                };
                let kind = match p.kind {
                    maker::Kind::Alone { .. } => maker::Kind::Alone {
                        learn: delta && f.is_some(),
                    },
                    k => k,
                };
                self.context_record(hint, make, kind, chunk, out);
                0
            }
            (None, Some(codec)) => {
                let c = &self.scratch[..self.clen];
                out.put_u8(codec.tag(f.is_some()));
                let h = put_len(out, chunk.len()) + put_len(out, c.len());
                out.put_slice(c);
                1 + h + c.len()
            }
            (None, None) => {
                out.put_u8(Codec::None.tag(f.is_some()));
                let h = put_len(out, chunk.len());
                out.put_slice(chunk);
                1 + h + chunk.len()
            }
        };
        // What a literal costs: known now for one alone, at the turn's end for one in context.
        let learn = self.context.is_none().then_some(wire);
        if let Some(f) = f {
            self.cache.insert_len(f, chunk.len());
            self.log_chunk(hint, f);
            if delta && codec.is_some() {
                self.keep_base(f, chunk, learn, hint);
            }
        }
        Report {
            sent: Sent::Lit(codec.unwrap_or(Codec::None)),
            raw: chunk.len(),
            wire,
            run_end,
            no_base: delta && self.delta.offered,
        }
    }

    /// Compresses `chunk` into the scratch buffer if that pays (with zstd in the stream's context
    /// if `in_context`); returns the codec used.
    fn compress(
        &mut self,
        chunk: &[u8],
        policy: &Policy,
        pressure: Pressure,
        hint: &mut Hint,
        in_context: bool,
        prep: Option<&mut prepare::Prepared>,
    ) -> Option<Codec> {
        self.context = None;
        let codec = match policy.compression {
            Compression::None => return None,
            Compression::Lz4 => Codec::Lz4,
            Compression::Zstd => Codec::Zstd,
            Compression::Adaptive => {
                if hint.skip > 0 {
                    hint.skip -= 1;
                    return None;
                }
                if policy.latency || pressure == Pressure::CpuBound {
                    Codec::Lz4
                } else if in_context && (chunk.len() < SMALL || hint.trusted()) {
                    // A small piece alone says little: in context it compresses like its
                    // stream, and the context's own result judges it. So does a chunk of a
                    // stream whose chunks paid for a while.
                    Codec::Zstd
                } else {
                    // Before spending zstd's CPU, a 4 KiB trial tells noise apart: skewed bytes
                    // (entropy coding pays) or repeats LZ4 finds.
                    let sample = &chunk[..chunk.len().min(4096)];
                    let paid = match prep.as_ref().and_then(|p| p.trial) {
                        Some(paid) => paid,
                        None => {
                            skewed(sample) || (self.lz4(sample) && pays(sample.len(), self.clen))
                        }
                    };
                    if !paid {
                        hint.incompressible();
                        return None;
                    }
                    Codec::Zstd
                }
            }
        };
        if codec == Codec::Zstd
            && in_context
            && let Some(planned) = self.plan_in_context(
                chunk.len(),
                hint,
                policy.bulk,
                policy.runs && policy.bulk && !hint.interrupted,
            )
        {
            // The context takes the chunk: it goes as compressed, paying or not (the LZ4 trial
            // already told it from noise). What one alone cost is judged at the turn's end.
            self.context = Some(planned);
            if !matches!(planned.kind, maker::Kind::Alone { .. }) {
                hint.compressible();
            }
            return Some(codec);
        }
        // Compressed ahead on a worker (the same codec and level, so the same bytes): the
        // buffers trade places.
        let ready = match codec {
            Codec::Zstd => Some((codec, self.zstd_level)),
            _ => Some((codec, 0)),
        };
        let ok = match prep.filter(|p| p.compressed.is_some() && p.compressed == ready) {
            Some(p) => {
                std::mem::swap(&mut self.scratch, &mut p.out);
                self.clen = p.clen;
                p.compressed = None;
                true
            }
            None if codec == Codec::Lz4 => self.lz4(chunk),
            None => match self.zstd.as_mut() {
                Some(z) => {
                    self.scratch.clear();
                    self.scratch
                        .reserve(zstd::zstd_safe::compress_bound(chunk.len()));
                    let ok = z.compress_to_buffer(chunk, &mut self.scratch).is_ok();
                    self.clen = self.scratch.len();
                    ok
                }
                None => false,
            },
        };
        if ok && pays(chunk.len(), self.clen) {
            hint.compressible();
            Some(codec)
        } else {
            hint.incompressible();
            None
        }
    }

    fn lz4(&mut self, data: &[u8]) -> bool {
        // Grow only: zeroing the buffer for every chunk cost a tenth of the compression.
        let need = lz4_flex::block::get_maximum_output_size(data.len());
        if self.scratch.len() < need {
            self.scratch.resize(need, 0);
        }
        match lz4_flex::block::compress_into(data, &mut self.scratch[..need]) {
            Ok(n) => {
                self.clen = n;
                true
            }
            Err(_) => false,
        }
    }
}

/// Below this, a flushed tail goes as raw bytes: compressing it could not pay for its header.
pub const TAIL_RAW: usize = 128;
/// The same in a stream's context, where even short pieces find matches in what came before.
pub const TAIL_RAW_IN_CONTEXT: usize = 24;
/// Pieces shorter than this are judged by what their stream's context makes of them, and do
/// not count as evidence of noise.
const SMALL: usize = 1024;

/// Appends the record for a flushed tail: bytes that end where the writer paused, not at a
/// content boundary. It is never cached (a boundary-less piece would rarely repeat), but it is
/// compressed when that pays, so small latency-class writes shrink too.
pub fn encode_tail(
    mirror: &mut Mirror,
    tail: &[u8],
    policy: &Policy,
    pressure: Pressure,
    hint: &mut Hint,
    out: &mut impl Out,
) -> Report {
    let in_context = policy.context
        && !policy.latency
        && match policy.compression {
            Compression::Zstd => true,
            Compression::Adaptive => pressure == Pressure::LinkBound,
            _ => false,
        };
    let least = if in_context {
        TAIL_RAW_IN_CONTEXT
    } else {
        TAIL_RAW
    };
    if tail.len() < least || policy.compression == Compression::None {
        let run_end = mirror.end_run(hint, out);
        return Report {
            run_end,
            ..encode_raw(tail, out)
        };
    }
    let once = Policy {
        dedup: false,
        ..*policy
    };
    if in_context {
        hint.live = LIVE_CHUNKS;
    }
    mirror.encode_piece(tail, in_context, &once, pressure, hint, out, None)
}

/// Appends a raw record (bytes sent as they are, not cached) to `out`.
pub fn encode_raw(data: &[u8], out: &mut impl Out) -> Report {
    out.put_u8(TAG_RAW);
    let h = put_len(out, data.len());
    out.put_slice(data);
    Report {
        sent: Sent::Raw,
        raw: data.len(),
        wire: 1 + h + data.len(),
        run_end: 0,
        no_base: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CodecConfig;
    use crate::decoder::Decoder;

    /// A chunk goes as a literal the first time and as a reference the second; the receiver
    /// rebuilds both; a short flushed tail goes raw and is never cached.
    #[test]
    fn a_repeated_chunk_goes_as_a_reference() {
        let cfg = CodecConfig::default();
        let policy = cfg.policy();
        let chunk = crate::testdata::noise(1, 4096);
        let mut m = Mirror::new(cfg.cache_bytes, 1 << 20, 3);
        let mut hint = Hint::default();
        let mut wire = Vec::new();
        let mut sent = Vec::new();
        for _ in 0..2 {
            let pressure = Pressure::LinkBound;
            sent.push(m.encode_chunk(&chunk, &policy, pressure, &mut hint, &mut wire, None));
        }
        let (first, second) = (sent[0], sent[1]);
        assert!(matches!(first.sent, Sent::Lit(_)));
        assert_eq!(second.sent, Sent::Ref);
        assert!(second.wire < 32);
        let tail = encode_tail(
            &mut m,
            b"COMMIT;",
            &policy,
            Pressure::LinkBound,
            &mut hint,
            &mut wire,
        );
        assert_eq!(tail.sent, Sent::Raw);
        let mut out = Vec::new();
        assert_eq!(Decoder::new(&cfg).decode(&wire, &mut out), Ok(wire.len()));
        assert_eq!(out, [&chunk[..], &chunk[..], b"COMMIT;"].concat());
    }
}
