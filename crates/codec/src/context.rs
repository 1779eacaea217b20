//! Stream contexts: a stream's zstd literals compressed against what the stream sent before.
//! Short ones (128 KiB) serve live redo's flushed pieces; long ones (see [`LongContext`]) a bulk
//! stream's every chunk. Both ends count them ([`Slots`]), so a peer cannot make us allocate
//! without bound.

use super::{
    CodecError, DEFERRED, Decoder, FRESH, Hint, LONG, Mirror, RUN_MAX, RUN_MAX_DECODE, TAG_RUN_END,
    put_len,
};

/// zstd window of a stream context. On PostgreSQL WAL a 128 KiB window compressed as well as
/// 4 MiB (0.301 against 0.306 of the raw bytes, zstd -3): redo repeats itself within a few
/// records.
pub const CONTEXT_WINDOW_LOG: u32 = 17;
/// Stream contexts one mirror keeps at once (about 1 MiB each at level 3); further streams
/// compress each chunk on its own.
pub const MIRROR_CONTEXTS: usize = 32;
/// Stream contexts one decoder accepts at once (about 260 KiB each): a peer asking for more is
/// refused, so a hostile one cannot make it allocate without bound. Above [`MIRROR_CONTEXTS`],
/// with room for streams whose last records are still to be decoded.
pub const DECODER_CONTEXTS: usize = 128;

/// Long-window stream contexts: a bulk stream's literals all go through one, so a backup
/// compresses as one zstd stream would (its matches reach back `2^window_log` bytes), where
/// chunks compressed alone lose 10-35% against a plain stream compressor. Each costs about its
/// window on the receiving side, and the window plus its tables (see [`long_tables`]) on the
/// sending side, so both their size and their number are bounded, and the receiver announces
/// both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LongContext {
    /// The window: `2^window_log` bytes.
    pub window_log: u32,
    /// Streams with a long context at once (per link).
    pub streams: usize,
}

impl LongContext {
    /// Windows accepted: 1 MiB to 128 MiB.
    pub const WINDOW_LOG_RANGE: std::ops::RangeInclusive<u32> = 20..=27;
    /// Long contexts per link accepted at most.
    pub const MAX_STREAMS: usize = 256;

    /// The window in bytes.
    pub fn window(&self) -> u64 {
        1 << self.window_log
    }

    /// What both sides can do: the smaller window and the fewer streams.
    pub fn agree(&self, peer: &LongContext) -> LongContext {
        LongContext {
            window_log: self.window_log.min(peer.window_log),
            streams: self.streams.min(peer.streams),
        }
    }
}

impl Default for LongContext {
    /// 16 MiB windows (zstd -9's own is 4 MiB) for up to 8 streams at once. On a real row
    /// binlog at level 6 (`zstd -6 --single-thread --zstd=wlog=..,hlog=21`) 16 MiB gave 0.2105
    /// of the raw bytes against 0.2122 with 8 MiB at the same speed (`zstd -9`: 0.2125); a
    /// base backup 0.1217 against 0.1224.
    fn default() -> Self {
        LongContext {
            window_log: 24,
            streams: 8,
        }
    }
}

/// The hash and chain table logs of a long context of window `2^window_log` at `level`. zstd's
/// own tables are sized for windows of 0.5-2 MiB and forget most of a long one. The fast levels
/// (1-4) get one entry per 16 bytes of window in each table, up to 2^19 (2 MiB each): on a real
/// base backup (`zstd -3 --single-thread --zstd=wlog=23,hlog=19,clog=19`) 0.140 of the raw
/// bytes against 0.163 with level 3's own tables, at about twice `zstd -9`'s speed; with a 16
/// MiB window, 2^20 entries made level 4 a fifth slower in the reduction bench for 1-2% fewer
/// bytes, and the fast levels are the ones the governor picks when time is short. The lazy levels (5 and up, zstd's
/// row match finder, which has no chain table) need a denser hash table to pay for their
/// search: at level 6 with one entry per 16 bytes the same backup costs 0.147, more than level
/// 3; with one per 4 bytes 0.122 (row binlog: 0.212 against 0.220, `zstd -9` 0.213), at about
/// 1.3 times the time. Their hash table stops at 2^21 entries (8 MiB; for a 16 MiB window one
/// per 2 bytes cost a tenth more time for 0.2077 against 0.2105 on the binlog). With these the
/// levels stay in order of ratio and cost, which the level governor relies on.
pub(crate) fn long_tables(window_log: u32, level: i32) -> (u32, u32) {
    let sparse = window_log.saturating_sub(4).clamp(CONTEXT_WINDOW_LOG, 19);
    if level >= 5 {
        (
            window_log.saturating_sub(2).clamp(CONTEXT_WINDOW_LOG, 21),
            sparse,
        )
    } else {
        (sparse, sparse)
    }
}

/// zstd applies a new level only to a new frame, so a context whose level the governor moved
/// starts over, once it has taken this many windows: a restart forgets the window, which on a
/// real base backup cost 2.9% when it came every 4 windows and 0.5% every 8.
pub(crate) const RESTART_WINDOWS: u64 = 4;

/// A count of contexts in use, shared by the permits taken from it (clones share the count).
#[derive(Debug, Default, Clone)]
pub struct Slots(std::sync::Arc<std::sync::atomic::AtomicUsize>);

/// One context's place in a [`Slots`]; given back when dropped.
#[derive(Debug)]
pub(crate) struct Permit(std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl Slots {
    fn take(&self, max: usize) -> Option<Permit> {
        use std::sync::atomic::Ordering::Relaxed;
        self.0
            .fetch_update(Relaxed, Relaxed, |n| (n < max).then_some(n + 1))
            .ok()
            .map(|_| Permit(self.0.clone()))
    }

    /// Contexts in use.
    pub fn in_use(&self) -> usize {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A stream's zstd compression context.
pub(crate) struct SendContext {
    cctx: zstd::zstd_safe::CCtx<'static>,
    /// No record of it was sent yet: the next one tells the peer to start afresh.
    fresh: bool,
    /// A long-window context (see [`LongContext`]).
    long: bool,
    /// The zstd level it compresses at, for its whole life (zstd takes a new one with a new frame only).
    level: i32,
    /// Which of the mirror's contexts it is, the bytes it took so far, and how far back its
    /// matches reach: a chunk it took lately needs no delta (see [`Mirror::encode_delta`]).
    pub(crate) serial: u64,
    pub(crate) pos: u64,
    pub(crate) window: u64,
    /// The open run: raw bytes deferred since the last flush, their records' payload bytes,
    /// and how many chunks.
    run: (usize, usize, usize),
    _permit: Permit,
}

impl SendContext {
    /// Raw bytes of the open run.
    pub(crate) fn run_pending(&self) -> usize {
        self.run.0
    }
}

/// The receiving end of one stream's zstd context: none until the peer starts one.
#[derive(Default)]
pub struct StreamContext {
    pub(crate) dctx: Option<(zstd::zstd_safe::DCtx<'static>, Permit)>,
    /// An open run: its chunks' lengths and whether each is cached, and the bytes rebuilt so far.
    pub(crate) run: Vec<(usize, bool)>,
    pub(crate) run_bytes: Vec<u8>,
}

impl std::fmt::Debug for StreamContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamContext")
            .field("open", &self.dctx.is_some())
            .finish()
    }
}

impl Mirror {
    /// Compresses `chunk` in the stream's context into the scratch buffer, flushed so that the
    /// peer can rebuild it from this record; returns the record's tag flags (whether it starts
    /// the context, and a long one). A bulk stream's context is a long one while the link has
    /// one to give. `None` if there is no context to be had (too many, or zstd failed), and
    /// then the context is gone: the next one starts afresh.
    pub(crate) fn compress_in_context(
        &mut self,
        chunk: &[u8],
        hint: &mut Hint,
        bulk: bool,
        runs: bool,
    ) -> Option<u8> {
        use zstd::zstd_safe::{CCtx, CParameter, InBuffer, OutBuffer, zstd_sys::ZSTD_EndDirective};
        // Another level than the context's: a new context, when the old one has paid for its
        // window and holds no run (see RESTART_WINDOWS).
        if let Some(ctx) = hint.context.as_ref()
            && ctx.level != self.zstd_level
            && ctx.run.2 == 0
            && ctx.pos >= ctx.window * RESTART_WINDOWS
        {
            hint.context = None;
        }
        if hint.context.is_none() {
            let long = self
                .long
                .as_ref()
                .filter(|_| bulk)
                .and_then(|(l, slots)| Some((l.window_log, slots.take(l.streams)?)));
            let mut cctx = CCtx::try_create()?;
            cctx.set_parameter(CParameter::CompressionLevel(self.zstd_level))
                .ok()?;
            let (permit, long) = match long {
                Some((window_log, permit)) => {
                    cctx.set_parameter(CParameter::WindowLog(window_log)).ok()?;
                    let (hash, chain) = long_tables(window_log, self.zstd_level);
                    cctx.set_parameter(CParameter::HashLog(hash)).ok()?;
                    cctx.set_parameter(CParameter::ChainLog(chain)).ok()?;
                    (permit, true)
                }
                None => {
                    let permit = self.contexts.take(MIRROR_CONTEXTS)?;
                    cctx.set_parameter(CParameter::WindowLog(CONTEXT_WINDOW_LOG))
                        .ok()?;
                    // Tables sized to the window: on WAL, larger ones found nothing more
                    // (measured at levels 3 to 9) and cost memory in every context.
                    cctx.set_parameter(CParameter::HashLog(CONTEXT_WINDOW_LOG))
                        .ok()?;
                    cctx.set_parameter(CParameter::ChainLog(CONTEXT_WINDOW_LOG - 1))
                        .ok()?;
                    (permit, false)
                }
            };
            self.serials += 1;
            let window = match &self.long {
                Some((l, _)) if long => l.window(),
                _ => 1 << CONTEXT_WINDOW_LOG,
            };
            hint.context = Some(SendContext {
                cctx,
                fresh: true,
                long,
                level: self.zstd_level,
                serial: self.serials,
                pos: 0,
                window,
                run: (0, 0, 0),
                _permit: permit,
            });
        }
        let ctx = hint.context.as_mut()?;
        // A long context may leave the chunk inside zstd (a run), up to RUN_MAX bytes.
        let defer = runs && ctx.long && ctx.run.0 + chunk.len() <= RUN_MAX;
        self.scratch.clear();
        // Room for everything the run holds, flushed: nothing is left inside zstd after one call.
        self.scratch
            .reserve(zstd::zstd_safe::compress_bound(ctx.run.0 + chunk.len()) + 64);
        let mut input = InBuffer::around(chunk);
        let mut output = OutBuffer::around(&mut self.scratch);
        let end = if defer {
            ZSTD_EndDirective::ZSTD_e_continue
        } else {
            ZSTD_EndDirective::ZSTD_e_flush
        };
        let r = ctx.cctx.compress_stream2(&mut output, &mut input, end);
        if r.is_err() || (!defer && r != Ok(0)) || input.pos() != chunk.len() {
            hint.context = None;
            return None;
        }
        self.clen = output.pos();
        ctx.pos += chunk.len() as u64;
        self.run_done = None;
        if defer {
            ctx.run.0 += chunk.len();
            ctx.run.1 += self.clen;
            ctx.run.2 += 1;
        } else if ctx.run.2 > 0 {
            let (raw, wire, n) = std::mem::take(&mut ctx.run);
            self.run_done = Some((raw + chunk.len(), wire + self.clen, n + 1));
        }
        let fresh = std::mem::replace(&mut ctx.fresh, false);
        Some(
            match (fresh, ctx.long) {
                (true, true) => FRESH | LONG,
                (true, false) => FRESH,
                _ => 0,
            } | if defer { DEFERRED } else { 0 },
        )
    }

    /// Ends the stream's open run, if it has one: appends a run end (the rest of its context's
    /// output) to `out` and returns its bytes, 0 if there was nothing to end. Every record of a
    /// frame that is not a context literal comes after this, and so does the frame's end.
    pub fn end_run(&mut self, hint: &mut Hint, out: &mut impl bytes::BufMut) -> usize {
        use zstd::zstd_safe::{InBuffer, OutBuffer, zstd_sys::ZSTD_EndDirective};
        let Some(ctx) = hint.context.as_mut().filter(|c| c.run.2 > 0) else {
            return 0;
        };
        let (raw, wire, n) = std::mem::take(&mut ctx.run);
        self.run_scratch.clear();
        self.run_scratch
            .reserve(zstd::zstd_safe::compress_bound(raw) + 64);
        let mut input = InBuffer::around(&[]);
        let mut output = OutBuffer::around(&mut self.run_scratch);
        let r = ctx
            .cctx
            .compress_stream2(&mut output, &mut input, ZSTD_EndDirective::ZSTD_e_flush);
        let clen = output.pos();
        if r != Ok(0) {
            // The run's chunks cannot be completed: drop the context. The peer's decoder finds
            // the run unfinished at the next record or the frame's end and fails the stream.
            hint.context = None;
            return 0;
        }
        out.put_u8(TAG_RUN_END);
        let h = put_len(out, clen);
        out.put_slice(&self.run_scratch[..clen]);
        self.learn_run(raw, wire + clen, n);
        1 + h + clen
    }
}

impl Decoder {
    /// Feeds a context record's `payload` to `stream`'s context (a new one when `fresh` is
    /// `Some`, a long one if it says so), appending what it rebuilds to the stream's run bytes,
    /// which may grow to `limit` bytes and no further. With `complete` the payload must bring
    /// them to exactly `limit`, and nothing beyond may be left in the context, or the next
    /// record would start with this one's bytes. A window larger than the context's is refused
    /// by zstd before it allocates; `limit` is checked against [`RUN_MAX_DECODE`] by the caller.
    pub(crate) fn feed_context(
        &mut self,
        payload: &[u8],
        limit: usize,
        complete: bool,
        fresh: Option<bool>,
        stream: &mut StreamContext,
    ) -> Result<(), CodecError> {
        use zstd::zstd_safe::{DCtx, DParameter, InBuffer, OutBuffer};
        debug_assert!(limit <= RUN_MAX_DECODE.max(crate::MAX_RECORD));
        if let Some(long) = fresh {
            stream.dctx = None;
            let (permit, window_log) = if long {
                let (l, slots) = self
                    .long
                    .as_ref()
                    .ok_or(CodecError::Malformed("a long context was not offered"))?;
                let permit = slots
                    .take(l.streams * 2)
                    .ok_or(CodecError::Malformed("too many long compression contexts"))?;
                (permit, l.window_log)
            } else {
                let permit = self
                    .contexts
                    .take(DECODER_CONTEXTS)
                    .ok_or(CodecError::Malformed("too many compression contexts"))?;
                (permit, CONTEXT_WINDOW_LOG)
            };
            let mut dctx = DCtx::try_create().ok_or(CodecError::Decompress)?;
            dctx.set_parameter(DParameter::WindowLogMax(window_log))
                .map_err(|_| CodecError::Decompress)?;
            stream.dctx = Some((dctx, permit));
        }
        let Some((dctx, _)) = stream.dctx.as_mut() else {
            return Err(CodecError::Malformed("context record without a context"));
        };
        let start = stream.run_bytes.len();
        if start > limit {
            return Err(CodecError::Malformed("run longer than announced"));
        }
        stream.run_bytes.resize(limit, 0);
        let mut input = InBuffer::around(payload);
        let mut output = OutBuffer::around_pos(&mut stream.run_bytes[..], start);
        let result = loop {
            // Checked before zstd is called: a deferred record may carry nothing, and zstd
            // counts calls without input against the stream.
            if input.pos() == payload.len() && (!complete || output.pos() == limit) {
                if !complete {
                    break Ok(());
                }
                // Anything more would spill into the next record.
                let mut probe = [0u8; 1];
                let mut more = OutBuffer::around(&mut probe[..]);
                let mut none = InBuffer::around(&[]);
                break match dctx.decompress_stream(&mut more, &mut none) {
                    Ok(_) if more.pos() == 0 => Ok(()),
                    _ => Err(CodecError::Decompress),
                };
            }
            let before = (input.pos(), output.pos());
            if dctx.decompress_stream(&mut output, &mut input).is_err() {
                break Err(CodecError::Decompress);
            }
            if (input.pos(), output.pos()) == before {
                break Err(CodecError::Decompress);
            }
        };
        let got = output.pos();
        stream.run_bytes.truncate(got);
        if result.is_err() {
            // The context is out of step now: later records of it fail too, until a fresh one.
            stream.dctx = None;
            stream.run.clear();
            stream.run_bytes.clear();
        }
        result
    }
}
