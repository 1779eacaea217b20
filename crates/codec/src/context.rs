//! Stream contexts: a stream's zstd literals compressed against what the stream sent before.
//! Short ones (128 KiB) serve live redo's flushed pieces; long ones (see [`LongContext`]) a bulk
//! stream's every chunk. Both ends count them ([`Slots`]), so a peer cannot make us allocate
//! without bound.

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
///
/// Two cheaper ways to reach back 16 MiB were measured at level 1 through the link's send path
/// (`cargo bench --bench reduction -- --pairs DIR --wanopt-only --zstd-level 1`, one pair a
/// run) and not taken. Smaller tables (2^17) ran the fast levels 1.3-1.7 times as fast but moved
/// the ratio both ways: the changed InnoDB files 0.0812 to 0.0869 of their bytes (`--patch-from`
/// 0.0799), PostgreSQL text rows' first copy 0.1382 to 0.1462 (`zstd -9` 0.1455), a source tree
/// 0.2295 to 0.2331, the InnoDB first copy 0.3620 to 0.3547; 2^18 lay between. zstd's
/// long-distance matcher with the level's own tables was faster again and worse on repetitive
/// data (a pgbench base backup 0.0411 to 0.0450 at every table size, the source tree 0.2459).
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
    pub(crate) fn take(&self, max: usize) -> Option<Permit> {
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
    /// Its compressor; `None` while a turn's records in it wait to be made (on a worker).
    pub(crate) cctx: Option<zstd::zstd_safe::CCtx<'static>>,
    /// No record of it was sent yet: the next one tells the peer to start afresh.
    pub(crate) fresh: bool,
    /// A long-window context (see [`LongContext`]).
    pub(crate) long: bool,
    /// The zstd level it compresses at, for its whole life (zstd takes a new one with a new frame only).
    pub(crate) level: i32,
    /// Which of the mirror's contexts it is, the bytes it took so far, and how far back its
    /// matches reach: a chunk it took lately needs no delta (see [`Mirror::encode_delta`]).
    pub(crate) serial: u64,
    pub(crate) pos: u64,
    pub(crate) window: u64,
    /// The open run: raw bytes deferred since the last flush, and how many chunks.
    pub(crate) run: (usize, usize),
    pub(crate) _permit: Permit,
}

/// The receiving end of one stream's zstd context: none until the peer starts one.
#[derive(Default)]
pub struct StreamContext {
    pub(crate) dctx: Option<(zstd::zstd_safe::DCtx<'static>, Permit)>,
    /// An open run: its chunks' lengths and whether each is cached, and the bytes rebuilt so far.
    pub(crate) run: Vec<(usize, bool)>,
    pub(crate) run_bytes: Vec<u8>,
    /// The serial of the stream's log, once its sender started one (see `crate::logs`).
    pub(crate) log: Option<u32>,
    /// Its next context records, fed ahead (on a worker) of the records around them: each is
    /// taken by the record it was fed for, in order.
    pub(crate) fed: std::collections::VecDeque<Fed>,
    /// Its next delta runs rebuilt ahead (on a worker), each taken by the record with its check.
    pub(crate) runs_fed: std::collections::VecDeque<RunFed>,
    /// Its next literals alone (LZ4 or zstd), decompressed ahead with their frame (on a
    /// worker): each taken, in order, by the record whose very payload it was made from.
    pub(crate) lits_fed: std::collections::VecDeque<LitFed>,
}

/// A literal alone decompressed ahead (on a worker) with its frame: the record's first byte
/// and payload, and the chunk it rebuilds (named if it is cached).
#[derive(Debug)]
pub(crate) struct LitFed {
    pub(crate) first: u8,
    pub(crate) payload: bytes::Bytes,
    pub(crate) piece: Piece,
}

impl LitFed {
    /// True if it was made from the literal whose first byte is `first` and whose payload is
    /// `payload`, rebuilding `raw_len` bytes: the very bytes (the same memory, or equal).
    pub(crate) fn is_for(&self, first: u8, raw_len: usize, payload: &[u8]) -> bool {
        self.first == first
            && self.piece.bytes.len() == raw_len
            && self.payload.len() == payload.len()
            && (std::ptr::eq(self.payload.as_ptr(), payload.as_ptr()) || self.payload == payload)
    }
}

/// A delta run rebuilt ahead (on a worker) from the bases the cache held when its frame was
/// fed (or since): its chunks, each named, which match the record's `check`; and, where the cache checks
/// what it holds, the bases checked against their names then.
#[derive(Debug)]
pub(crate) struct RunFed {
    /// Where its record is in its frame.
    pub(crate) at: usize,
    pub(crate) check: crate::fingerprint::Fingerprint,
    pub(crate) pieces: Vec<Piece>,
    pub(crate) checked: Vec<(crate::fingerprint::Fingerprint, bytes::Bytes)>,
}

/// A run (or a lone chunk) rebuilt whole out of its stream's context: its bytes, and its
/// chunks' lengths and whether each is cached.
#[derive(Debug, Default)]
pub(crate) struct Run {
    pub(crate) bytes: Vec<u8>,
    pub(crate) chunks: Vec<(usize, bool)>,
}

/// A chunk of a run fed ahead (on a worker): its bytes, whether it is cached, and its name if it
/// is (none for a chunk whose naming was left to the thread that takes it).
#[derive(Debug)]
pub(crate) struct Piece {
    pub(crate) bytes: bytes::Bytes,
    pub(crate) cached: bool,
    pub(crate) name: Option<crate::fingerprint::Fingerprint>,
}

/// A context record fed ahead: its first byte and length, whether its stream had a run open
/// before it, and what feeding it gave (a run's chunks once it is whole, or what was wrong with
/// it).
#[derive(Debug)]
pub(crate) struct Fed {
    pub(crate) first: u8,
    pub(crate) used: usize,
    pub(crate) open_before: bool,
    pub(crate) result: Result<Option<Vec<Piece>>, crate::format::CodecError>,
}

impl std::fmt::Debug for StreamContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamContext")
            .field("open", &self.dctx.is_some())
            .finish()
    }
}
