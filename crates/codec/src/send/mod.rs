//! The send side of one stream: its [`Sender`], which cuts FastCDC chunks in place in the
//! application's queued buffers and encodes them against the mirror of the peer's cache into
//! records. The link runs it for every optimized stream (a turn's limits from its scheduler and
//! frame room); [`Encoder`](crate::Encoder) runs it for a stream held whole (tools, benches,
//! tests). Boundaries depend on the content alone, never on how the application split its writes.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;

use crate::config::{CodecConfig, Policy, Pressure, chunks};
use crate::fingerprint::Fingerprint;
use crate::format::{Out, RECORD_OVERHEAD, run_reserve};
use crate::maker::{Lane, Made, Open, Queue};
use crate::mirror::{Hint, Mirror, encode_tail};
use crate::prepare::{Ahead, BATCH, Fill, Filled, Found, Job, Prepared, Work};
use crate::report::{EncodeStats, Sent};

mod early;
mod stage;
pub use stage::RAW_TURN;
#[cfg(test)]
use stage::stage_most;
use stage::{View, advance_front, take_front};

/// Chunks the join of the next turn's pieces cuts itself, at most, where a piece's chain has
/// not met the true one (see [`crate::cuts::join`]): past them, the rest is cut in a later turn.
const RESYNC: usize = 4;

/// Pieces the next turn's chunks are cut in with `threads` threads. One job on two: there the
/// caller's turn and the one cutting job already keep both threads busy (measured on this
/// 2-core VM, LZ4 path, three runs each way of three files, with 128 KiB pieces: each file's
/// mean 1.39-1.80x of one thread in pieces, 1.51-1.69x in one job, single runs 1.32-2.03x and
/// 1.41-1.79x, a wash); from three on, a turn can be no shorter than its longest job, and the
/// cutting was a third of the LZ4 path's time (see docs/scaling.md).
fn cut_pieces(threads: usize) -> usize {
    if threads >= 3 { threads.min(8) } else { 1 }
}

/// Unflushed bytes a bulk stream gathers before it takes a turn, for a stream whose sender
/// holds at most `send_buffer` unsent bytes: a turn's raw budget, at most half the buffer (so
/// its writer keeps room to write while the turn runs), at least a chunk. A turn is a frame:
/// a changed copy that is nearly all references cost more in frame headers than in records
/// when each 64 KiB the client wrote was a turn of its own.
pub fn gather(send_buffer: usize, max_chunk: usize) -> usize {
    RAW_TURN.min(send_buffer / 2).max(max_chunk)
}

/// The send side of one stream's encoding.
#[derive(Debug)]
pub struct Sender {
    pub policy: Policy,
    hint: Hint,
    /// Bytes taken from the send queue but not sent yet (a chunk waiting for its boundary).
    stage: Vec<u8>,
    pos: usize,
    /// Stream offset up to which everything must go out without waiting for a boundary.
    pub flush_at: u64,
    /// Record bytes per raw byte of the stream's recent turns: how many chunks a frame's room
    /// will hold, so that no more are prepared on workers than go in the turn.
    ratio: f64,
    /// The last turn ended before a chunk whose bases the disk tier is reading (see
    /// [`Policy::wait_bases`]).
    waiting: bool,
    /// Chunks cut ahead of the turn that sends them (a bulk stream with workers).
    cut: CutAhead,
    /// What makes the stream's context records for turns left pending ([`emit_pending`]),
    /// once one was; the turns left pending and not finished; spare buffers of a pending
    /// turn's records.
    queue: Option<Arc<Queue>>,
    open: usize,
    spare: Vec<(Vec<u8>, Made)>,
}

/// A bulk stream's chunks cut, and fingerprinted, ahead of the turn that sends them: on the
/// workers, while the turn before encoded (see [`crate::prepare::Ahead`]). Boundaries depend on
/// the bytes since the last one alone, so they are the chunks a turn would cut itself.
#[derive(Debug, Default)]
struct CutAhead {
    /// Stream offset of the first.
    at: u64,
    /// Each one's length and (where chunks are deduplicated) fingerprint.
    chunks: VecDeque<(usize, Option<Fingerprint>)>,
    /// The cutting job's output (kept for its buffer).
    found: Vec<Found>,
    /// With several threads, each piece's cutting job's output (see [`crate::cuts::join`]).
    pieces: Vec<Vec<Found>>,
    /// The next turn's chunks prepared in the workers' spare time (see [`early`]).
    early: early::Early,
}

impl CutAhead {
    /// The bytes the chunks cover.
    fn bytes(&self) -> usize {
        self.chunks.iter().map(|c| c.0).sum()
    }
}

impl Sender {
    pub fn new(policy: Policy) -> Self {
        Sender {
            policy,
            hint: Hint::default(),
            stage: Vec::new(),
            pos: 0,
            flush_at: 0,
            ratio: 1.0,
            waiting: false,
            cut: CutAhead::default(),
            queue: None,
            open: 0,
            spare: Vec::new(),
        }
    }

    /// True if this stream's next turn makes no context record under `pressure`: no turn of
    /// it waits for its records, it holds no context, and its literals never go through one
    /// (no compression or LZ4, zstd outside contexts, or adaptive compression choosing LZ4).
    /// Such a turn's records are all written as it is planned, so leaving it pending
    /// ([`emit_pending`]) would only copy them once more when it is finished: with nothing
    /// else waiting, [`emit`] writes them in place, the same records (as the link does with
    /// one thread; the codec bench read the same either way, see crates/codec/PARALLEL.md).
    pub fn plans_whole(&self, pressure: Pressure) -> bool {
        use crate::config::Compression;
        let p = &self.policy;
        self.open == 0
            && !self.hint.has_context()
            && match p.compression {
                Compression::None | Compression::Lz4 => true,
                Compression::Zstd => !p.context,
                Compression::Adaptive => !p.context || p.latency || pressure == Pressure::CpuBound,
            }
    }

    /// True if the last turn ended before a chunk whose bases are being read from the disk
    /// tier: the next turn should come once the store has read them (the chunk waits a few
    /// turns at most, then goes with what is at hand).
    pub fn waiting(&self) -> bool {
        self.waiting
    }

    /// The store has read something: the next turn may come (see [`waiting`](Self::waiting)).
    pub fn resume(&mut self) {
        self.waiting = false;
    }

    /// Bytes taken from the queue and held for their chunk's boundary.
    pub fn staged(&self) -> usize {
        self.stage.len() - self.pos
    }
}

impl Drop for Sender {
    /// Takes back the work handed to the workers' spare time before the stage it reads goes.
    fn drop(&mut self) {
        self.cut.early.retire();
    }
}

/// Limits of one turn (one coded frame on the link).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Raw bytes the stream and link credit allow.
    pub budget: usize,
    /// Record bytes after which the turn ends (fairness); at least one chunk is always sent.
    pub quantum: usize,
    /// Record bytes the frame can hold at most.
    pub room: usize,
}

/// Encodes the next chunks of a stream into `out`; returns the raw bytes they cover, 0 if
/// nothing may go yet. `sent` is the stream offset of the first unsent byte.
///
/// Chunks are cut in place in the queued buffers the application wrote. Only a chunk that spans
/// two of them is put together in the stage: the previous buffer's unfinished tail (the carry),
/// plus a copy of just enough of the next buffer to find the boundary. Boundaries still depend
/// only on the content since the previous boundary, however the bytes were split into writes.
///
/// With workers (a bulk stream), the turn's bytes are put together in the stage instead, so
/// that one view holds a batch of chunks to prepare at once: the application's writes arrive in
/// buffers of 64 KiB or less, six chunks each, too few to pay for waking the pool. The bytes
/// only the next turn's cutting needs are copied into the stage by the job that cuts them
/// ([`Fill`]), beside the turn; in the steady state of a stream that is all of them.
#[allow(clippy::too_many_arguments)]
pub fn emit<B: Out>(
    coder: &mut Sender,
    queue: &mut VecDeque<Bytes>,
    sent: u64,
    chunking: &CodecConfig,
    mirror: &mut Mirror,
    pressure: Pressure,
    lim: &Limits,
    out: &mut B,
    stats: &mut EncodeStats,
) -> usize {
    let turn = plan_turn(
        coder, queue, sent, chunking, mirror, pressure, lim, out, stats,
    );
    end_turn(coder, mirror, &turn, stats);
    coder.waiting = turn.wait;
    turn.raw
}

/// Plans the next turn as [`emit`] does, its stream's context records to be made after it (on
/// a worker, while the caller goes on with other streams' turns, or with the stream's next):
/// what it wrote waits in the returned [`Pending`] until [`Pending::finish`] writes it with
/// the made records in their places. The records are the ones `emit` writes for the same turn
/// once the stream's context costs are learned at the same points: a turn learns what its
/// records cost when it is finished, and the stream's turn after next is planned after that
/// (one turn of the stream may be planned while the one before waits for its records; the
/// records of a turn need nothing of what the one before cost).
#[allow(clippy::too_many_arguments)]
pub fn emit_pending(
    coder: &mut Sender,
    queue: &mut VecDeque<Bytes>,
    sent: u64,
    chunking: &CodecConfig,
    mirror: &mut Mirror,
    pressure: Pressure,
    lim: &Limits,
    stats: &mut EncodeStats,
) -> Pending {
    // With a thread to spare, the stream's context records are made as they are planned.
    let q = Arc::clone(coder.queue.get_or_insert_with(|| {
        Arc::new(match mirror.workers().filter(|w| w.threads() > 1) {
            Some(w) => Queue::streaming(w),
            None => Queue::new(),
        })
    }));
    // A new stream's buffer is sized once for a turn's records (grown by doubling, its first
    // turns copied it and faulted fresh pages in, on the daemon's thread).
    let (mut plan, made) = coder.spare.pop().unwrap_or_else(|| {
        let records = lim.room.min(lim.quantum).min(RAW_TURN + RAW_TURN / 8);
        (Vec::with_capacity(records), Default::default())
    });
    plan.clear();
    let lane = Arc::new(Lane::new(made));
    mirror.open_lane(
        Open {
            queue: Arc::clone(&q),
            lane: Arc::clone(&lane),
        },
        &mut coder.hint,
    );
    stats.planned_behind += u64::from(coder.open > 0);
    coder.open += 1;
    let turn = plan_turn(
        coder, queue, sent, chunking, mirror, pressure, lim, &mut plan, stats,
    );
    // Known now: the link's scheduler asks before the turn is finished.
    coder.waiting = turn.wait;
    mirror.detach_lane();
    Pending {
        plan,
        queue: q,
        lane,
        turn,
    }
}

/// A turn planned by [`emit_pending`] whose stream's context records are still to be made.
pub struct Pending {
    /// The turn's other records, the made ones' places in them.
    plan: Vec<u8>,
    queue: Arc<Queue>,
    lane: Arc<Lane>,
    turn: Turn,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending")
            .field("raw", &self.turn.raw)
            .field("plan", &self.plan.len())
            .finish()
    }
}

impl Pending {
    /// The raw bytes the turn sent.
    pub fn raw(&self) -> usize {
        self.turn.raw
    }

    /// True if the turn wrote nothing (it sent no bytes).
    pub fn is_empty(&self) -> bool {
        self.plan.is_empty() && !self.lane.any()
    }

    /// Writes the turn's records to `out`, the made ones (made here if no worker has, else
    /// once the worker is done) in their places, and learns what the turn's context records
    /// cost. Returns the raw bytes it sent. Turns are finished in the order they were planned,
    /// a stream's turn before its turn after next is planned.
    pub fn finish<B: Out>(
        self,
        coder: &mut Sender,
        mirror: &mut Mirror,
        out: &mut B,
        stats: &mut EncodeStats,
    ) -> usize {
        Queue::wait(&self.queue, &self.lane);
        let mut made = self.lane.take();
        coder.open = coder.open.saturating_sub(1);
        // The stream's last turn open: its context comes back to it.
        let context = (coder.open == 0).then(|| self.queue.take_context());
        mirror.close_lane(&mut coder.hint, &mut made, context, &self.plan, out);
        end_turn(coder, mirror, &self.turn, stats);
        if coder.spare.len() < 2 {
            coder.spare.push((self.plan, made));
        }
        self.turn.raw
    }

    /// Finishes a turn whose stream is gone, as [`finish`](Self::finish) does: its records
    /// still go (the mirror counts on the peer's cache seeing them), and what they cost is
    /// learned by nobody.
    pub fn finish_orphan<B: Out>(
        self,
        mirror: &mut Mirror,
        out: &mut B,
        stats: &mut EncodeStats,
    ) -> usize {
        let mut gone = Sender::new(Policy::default());
        self.finish(&mut gone, mirror, out, stats)
    }
}

impl crate::prepare::Deferred for Pending {
    /// Has `workers` make the turn's context records, if it has any.
    fn spawn(&self, workers: &dyn crate::prepare::Workers) {
        if !self.queue.is_streaming() {
            Queue::kick(&self.queue, workers);
        }
    }

    /// True while a worker makes the turn's context records.
    fn busy(&self) -> bool {
        self.queue.busy(&self.lane)
    }

    /// Makes the turn's context records here (and any left of the stream's turn before) if no
    /// worker makes records now.
    fn help(&self) -> bool {
        self.queue.make_through(&self.lane)
    }
}

/// Where the turn to finish before a stream's next is planned waits among `pending`, if it
/// does: the turn before the stream's last (`mine` picks the stream's turns out). Its last may
/// wait while the next is planned (see [`emit_pending`]).
pub fn before_last<K, J: crate::prepare::Deferred>(
    pending: &crate::prepare::InTurn<K, J>,
    mine: impl Fn(&K) -> bool,
) -> Option<usize> {
    let (mut before, mut last) = (None, None);
    for (i, (k, _)) in pending.iter().enumerate() {
        if mine(k) {
            before = last.replace(i);
        }
    }
    before
}

/// Turns planned with [`emit_pending`] and not finished yet, oldest first, each with what its
/// owner finishes it with (`K`: a stream, a frame's header), finished in the order they were
/// planned ([`Pending::finish`]).
pub type PendingTurns<K> = crate::prepare::InTurn<K, Pending>;

/// The end of a turn whose records are all written: what its context records cost is learned,
/// and counted, and the stream's recent ratio of record to raw bytes with them.
fn end_turn(coder: &mut Sender, mirror: &mut Mirror, turn: &Turn, stats: &mut EncodeStats) {
    let made = mirror.settle(&mut coder.hint);
    stats.merge(&mirror.take_late());
    if turn.raw > 0 {
        let r = (turn.wire + made) as f64 / turn.raw as f64;
        coder.ratio = ((coder.ratio + r) / 2.0).clamp(0.001, 1.1);
    }
}

/// The turn itself (see [`emit`]): its records written to `out`, its stream context's made
/// now or queued on the mirror's lane.
#[allow(clippy::too_many_arguments)]
fn plan_turn<B: Out>(
    coder: &mut Sender,
    queue: &mut VecDeque<Bytes>,
    sent: u64,
    chunking: &CodecConfig,
    mirror: &mut Mirror,
    pressure: Pressure,
    lim: &Limits,
    out: &mut B,
    stats: &mut EncodeStats,
) -> Turn {
    let mut turn = Turn::default();
    coder.waiting = false;
    // Before the stage changes: what was prepared early for this turn, and nothing in progress.
    coder.cut.early.retire();
    let gather = mirror.has_workers() && !coder.policy.latency;
    // Whether other streams' turns came since this stream's last: then its next turn is
    // likely to come after others too, and what is handed over for it gets done meanwhile
    // (alone, its next turn comes at once, and would only wait for a chunk a thread started).
    let between = gather.then(|| {
        let n = mirror.bulk_turn();
        coder.cut.early.last.replace(n).is_some_and(|l| n > l + 1)
    });
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
            ratio: coder.ratio,
        };
        if gather {
            // The budget's worth of bytes (and a chunk more, to find the last boundary) in one
            // view, and up to a turn's more for the workers to cut ahead while this turn
            // encodes; the stage holds at most that.
            let now = budget.saturating_add(chunking.max_chunk);
            let want = now.saturating_add(budget.min(RAW_TURN));
            stage::reserve(&mut coder.stage, coder.pos, queue, chunking);
            // The turn's own bytes are copied here (a turn's lookahead from the one before
            // has them already, but at a stream's start or after a pause)...
            let lack = now.saturating_sub(coder.stage.len() - coder.pos);
            take_front(queue, lack, |b| coder.stage.extend_from_slice(&b));
            // ...and the ones only the next turn's cutting needs are copied on the workers,
            // by the job that cuts them, while this turn encodes (see `Fill`).
            let mut later = Vec::new();
            let more = want.saturating_sub(coder.stage.len() - coder.pos);
            coder
                .stage
                .reserve(take_front(queue, more, |b| later.push(b)));
            let (held, start) = (coder.stage.len(), coder.pos);
            let ptr = coder.stage.as_mut_ptr();
            // SAFETY: `reserve` made room past the stage's length for the bytes `later` holds,
            // and nothing touches the stage (its buffer, length or bytes) until the fill is
            // complete and counted in below: the view reads only what the stage holds, and
            // what the fill copies once it is complete.
            let fill = unsafe { Fill::new(ptr.add(held), later) };
            // SAFETY: the stage's bytes from `start` to its length are initialized, and stay
            // unchanged until the view is dropped (see above).
            let ready =
                unsafe { std::slice::from_raw_parts(ptr.add(start).cast_const(), held - start) };
            // SAFETY: the bytes from `start` are the stage's, then the fill's (see above).
            let filled = (fill.len() > 0).then(|| unsafe {
                Filled::new(
                    &fill,
                    ptr.add(start).cast_const(),
                    held - start + fill.len(),
                )
            });
            let at = View::with_fill(ready, filled, flush, budget);
            if at.len() == 0 {
                break;
            }
            let base = sent + cx.turn.raw as u64;
            let (used, stop) =
                cx.cut_ahead(&at, base, &mut coder.cut, &coder.policy, &mut coder.hint);
            fill.complete();
            // SAFETY: the fill is complete: the `fill.len()` bytes past the stage's length (the
            // room reserved above) are written.
            unsafe { coder.stage.set_len(held + fill.len()) };
            drop(fill);
            coder.pos += used;
            if coder.pos == coder.stage.len() {
                coder.stage.clear();
                coder.pos = 0;
            } else if coder.pos > coder.stage.len() / 2 {
                coder.stage.drain(..coder.pos);
                coder.pos = 0;
            }
            // A piece that waits for its boundary goes on only if more bytes are queued.
            if used == 0 || stop == Stop::Limit || (stop == Stop::Tail && queue.is_empty()) {
                break;
            }
        } else if coder.stage.len() > coder.pos {
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
    // A frame's records are whole: a run of its literals ends in it.
    turn.wire += mirror.end_run(&mut coder.hint, out);
    if between == Some(true) {
        hand_over(coder, mirror, pressure, sent + turn.raw as u64);
    }
    turn
}

/// Hands the chunks cut for the stream's next turn, from stream offset `next`, to the workers'
/// spare time (see [`early`]): those likely to go as literals or deltas (the peer does not
/// hold them now), a turn's worth at most, not prepared yet.
fn hand_over(coder: &mut Sender, mirror: &Mirror, pressure: Pressure, next: u64) {
    let Some(w) = mirror.workers() else {
        return;
    };
    let cut = &mut coder.cut;
    if cut.at != next || cut.chunks.is_empty() {
        return;
    }
    let asked = mirror.ahead_work(&coder.policy, pressure, &coder.hint);
    if asked == (None, false) {
        return;
    }
    let staged = &coder.stage[coder.pos..];
    let done = cut.early.ready_end().unwrap_or(0);
    let mut seen = crate::fingerprint::FpSet::default();
    let mut picked = Vec::new();
    let mut off = 0;
    for &(len, f) in &cut.chunks {
        if off + len > staged.len() || off >= RAW_TURN || picked.len() == BATCH {
            break;
        }
        let at = next + off as u64;
        if goes(mirror, &coder.policy, f, &mut seen) && at >= done {
            picked.push((at, staged[off..].as_ptr(), len));
        }
        off += len;
    }
    if picked.is_empty() {
        return;
    }
    // SAFETY: the chunks' bytes are the stage's, from `pos` on, within its length; nothing
    // changes or frees the stage until the work is retired: first thing in the stream's next
    // turn (`plan_turn`), or when the sender is dropped.
    let work = unsafe { early::Handed::new(picked.into_iter(), asked, &mut cut.early.spare) };
    let work = Arc::new(work);
    w.idle(Arc::clone(&work) as Arc<dyn crate::prepare::Idle>);
    cut.early.work = Some(work);
}

/// Whether the chunk of fingerprint `f` will go as a literal or a delta, so that preparing it
/// pays: the peer does not hold it, nor was it `seen` earlier in the turn.
fn goes(
    mirror: &Mirror,
    policy: &Policy,
    f: Option<Fingerprint>,
    seen: &mut crate::fingerprint::FpSet,
) -> bool {
    match f {
        Some(f) => !mirror.holds(&f) && seen.insert(f),
        None => !policy.dedup,
    }
}

/// Raw and record bytes of one turn so far.
#[derive(Debug, Default)]
struct Turn {
    raw: usize,
    wire: usize,
    /// It ended before a chunk that waits for its bases.
    wait: bool,
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

/// Where the caller finds what was prepared for one of the turn's chunks.
enum Place<'a> {
    /// In the `n`th job of the turn's [`Ahead`].
    Job(usize),
    /// In this slot (its fingerprint; what was prepared early, if it was).
    Here(&'a mut Prepared),
}

/// What encoding one contiguous run of bytes needs.
struct Cut<'a, B> {
    chunking: &'a CodecConfig,
    mirror: &'a mut Mirror,
    pressure: Pressure,
    lim: &'a Limits,
    out: &'a mut B,
    stats: &'a mut EncodeStats,
    turn: &'a mut Turn,
    /// The stream's recent record bytes per raw byte (see [`Sender`]).
    ratio: f64,
}

impl<B: Out> Cut<'_, B> {
    /// Encodes the chunks of `view` (with `first`, only its first), which starts at a chunk
    /// boundary; returns the bytes used. Each chunk is prepared as it is encoded.
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
        let at = View::new(view, flush, budget);
        for (off, len) in chunks(at.get(0..at.end), self.chunking) {
            if let Some(stop) = self.one(&at, (off, len), policy, hint, None) {
                return stop;
            }
            if first {
                return (off + len, Stop::End);
            }
        }
        // Every chunk up to `end` went.
        (at.end, Stop::End)
    }

    /// Encodes the chunks of `at` (a bulk stream's gathered bytes, from stream offset `base`,
    /// which starts at a chunk boundary) with workers; returns the bytes used. The turn's chunks
    /// come from `cut` (cut ahead in the turn before), or are cut now; while the caller encodes
    /// them in order, the workers compress the ones that go as literals or deltas and find
    /// their anchors (see [`crate::prepare`]), and cut and fingerprint the chunks after them
    /// for the next turn. Without workers, as [`cut`](Self::cut).
    fn cut_ahead(
        &mut self,
        at: &View<'_>,
        base: u64,
        cut: &mut CutAhead,
        policy: &Policy,
        hint: &mut Hint,
    ) -> (usize, Stop) {
        let Some(w) = self.mirror.workers() else {
            return self.cut(
                at.get(0..at.len()),
                at.flush,
                at.budget,
                false,
                policy,
                hint,
            );
        };
        let chunking: &CodecConfig = self.chunking;
        // Chunks cut for other bytes (a stream sent again from elsewhere) are of no use.
        if cut.at != base || cut.bytes() > at.end {
            cut.chunks.clear();
            cut.at = base;
        }
        let mut found = std::mem::take(&mut cut.found);
        let mut pieces = std::mem::take(&mut cut.pieces);
        // With helpers, the next turn's chunks are cut in pieces that threads share.
        let threads_split = cut_pieces(w.threads());
        pieces.resize_with(threads_split, Vec::new);
        let mut used = 0;
        let stop = loop {
            if used >= at.end {
                break (used, Stop::End);
            }
            if cut.chunks.is_empty() {
                // Nothing cut ahead: cut now, fingerprints on the workers.
                Job::cut(at.get(used..at.end), chunking, BATCH, false, &mut found).run();
                let Some(&(_, len, _)) = found.first() else {
                    // Only the last piece, which may grow: it goes (or waits) alone.
                    let len = chunks(at.get(used..at.end), chunking)
                        .next()
                        .map_or(at.end - used, |c| c.1);
                    if let Some(stop) = self.one(at, (used, len), policy, hint, None) {
                        break stop;
                    }
                    used += len;
                    cut.at = base + used as u64;
                    continue;
                };
                debug_assert!(len > 0);
                let fps = self.fingerprints(&*w, at.get(used..at.len()), &found, policy);
                cut.chunks
                    .extend(found.iter().zip(fps).map(|(&(_, l, _), f)| (l, f)));
            }
            // The turn's chunks: as many as the frame's room and the quantum will likely take
            // (one that does not go stays cut for the next turn).
            let fits = self.lim.room.min(self.lim.quantum);
            let mut wire = self.turn.wire;
            let (mut n, mut end) = (0, used);
            for &(len, _) in &cut.chunks {
                n += 1;
                wire += (len as f64 * self.ratio) as usize + RECORD_OVERHEAD;
                end += len;
                if n == BATCH || end > at.budget || wire >= fits {
                    break;
                }
            }
            // Past every chunk cut so far: the next ones, cut on the workers.
            let from = used + cut.bytes();
            let more = from < at.end && cut.chunks.len() - n < BATCH;
            // In pieces, about a batch's bytes, none smaller than is worth its lookback. Those
            // still to come into the view are copied by the jobs, ahead of their cutting.
            let next = at.cut_bytes(from.min(at.end)..at.end);
            let region =
                (at.end - from.min(at.end)).min(BATCH * (chunking.min_chunk + chunking.avg_chunk));
            let split = threads_split.min(region / crate::cuts::min_piece(chunking));
            let ranges = if more && split > 1 {
                crate::cuts::pieces(region, region.div_ceil(split))
            } else {
                Vec::new()
            };
            let mut slots = self.mirror.take_slots(n);
            let (mut places, jobs) = {
                let (lit, anchors) = self.mirror.ahead_work(policy, self.pressure, hint);
                let mut seen =
                    crate::fingerprint::FpSet::with_capacity_and_hasher(n, Default::default());
                let mut jobs = Vec::with_capacity(n + 1);
                let mut places = Vec::with_capacity(n);
                let mut off = used;
                let done_early = &mut cut.early;
                for (slot, &(len, f)) in slots.iter_mut().zip(&cut.chunks).take(n) {
                    slot.reset(len);
                    slot.fingerprint = f;
                    let chunk = at.get(off..off + len);
                    let stream_at = base + off as u64;
                    off += len;
                    let asked = (lit, anchors);
                    if asked == (None, false) || !goes(self.mirror, policy, f, &mut seen) {
                        places.push(Place::Here(slot));
                    } else if early::take(done_early, stream_at, len, asked, slot) {
                        // Prepared early, in a thread's spare time.
                        places.push(Place::Here(slot));
                    } else {
                        places.push(Place::Job(jobs.len()));
                        jobs.push(Job::of(chunk, lit, anchors, slot));
                    }
                }
                // Last: the first a worker takes (see `Ahead`).
                if !ranges.is_empty() {
                    let lookback = crate::cuts::lookback(chunking);
                    for (r, f) in ranges.iter().cloned().zip(pieces.iter_mut()) {
                        let begin = r
                            .start
                            .saturating_sub(if r.start == 0 { 0 } else { lookback });
                        jobs.push(Job::cut_piece(next, begin, r, chunking, policy.dedup, f));
                    }
                } else if more {
                    jobs.push(Job::cut(next, chunking, BATCH, policy.dedup, &mut found));
                }
                (places, jobs)
            };
            let ahead = Ahead::new(jobs, (end - used) as u64);
            let (mut went, mut stopped) = (0, None);
            let mut caller = || {
                (went, stopped) =
                    self.batch(&ahead, &mut places, &cut.chunks, at, used, policy, hint);
            };
            if ahead.is_empty() {
                caller();
            } else {
                w.overlap(&ahead, &mut caller);
            }
            drop(ahead);
            self.mirror.put_slots(slots);
            for (len, _) in cut.chunks.drain(..went) {
                used += len;
            }
            cut.at = base + used as u64;
            if !ranges.is_empty() {
                // The pieces' chains joined into the true one, a chunk or so cut here where
                // one begun inside a piece had not met it. Only the pieces cut: past the last,
                // the join would cut on itself.
                found.clear();
                let next = next.get();
                let cut_now = &mut pieces[..ranges.len().min(threads_split)];
                crate::cuts::join(next, chunking, cut_now, RESYNC, &mut found, |o, l| {
                    policy
                        .dedup
                        .then(|| crate::fingerprint::fingerprint(&next[o..o + l]))
                });
                pieces.iter_mut().for_each(Vec::clear);
            }
            if more {
                cut.chunks.extend(found.iter().map(|&(_, l, f)| (l, f)));
            }
            if let Some(stop) = stopped {
                break stop;
            }
        };
        cut.found = found;
        cut.pieces = pieces;
        stop
    }

    /// Encodes a batch's chunks in order from `used` (each at its place: prepared by its job
    /// in `ahead`, or here), until one stops the turn; returns how many went, and the stop.
    #[allow(clippy::too_many_arguments)]
    fn batch(
        &mut self,
        ahead: &Ahead<'_>,
        places: &mut Vec<Place<'_>>,
        chunks: &VecDeque<(usize, Option<Fingerprint>)>,
        at: &View<'_>,
        used: usize,
        policy: &Policy,
        hint: &mut Hint,
    ) -> (usize, Option<(usize, Stop)>) {
        let (mut off, mut went) = (used, 0);
        for (place, &(len, _)) in places.drain(..).zip(chunks) {
            let r = match place {
                // Every chunk is encoded: with what its job made, or (no such job) preparing
                // nothing.
                Place::Job(j) => {
                    match ahead.with(j, |p| self.one(at, (off, len), policy, hint, Some(p))) {
                        Some(r) => r,
                        None => self.one(at, (off, len), policy, hint, None),
                    }
                }
                Place::Here(p) => self.one(at, (off, len), policy, hint, Some(p)),
            };
            if let Some(stop) = r {
                return (went, Some(stop));
            }
            off += len;
            went += 1;
        }
        (went, None)
    }

    /// The fingerprints of the chunks `found` in `bytes`, taken on the workers where chunks are
    /// deduplicated (none where they are not).
    fn fingerprints(
        &mut self,
        w: &dyn crate::prepare::Workers,
        bytes: &[u8],
        found: &[Found],
        policy: &Policy,
    ) -> Vec<Option<Fingerprint>> {
        if !policy.dedup {
            return vec![None; found.len()];
        }
        let mut slots = self.mirror.take_slots(found.len());
        let mut jobs: Vec<Job<'_>> = found
            .iter()
            .zip(slots.iter_mut())
            .map(|(&(o, l, _), s)| {
                s.reset(l);
                Job::new(&bytes[o..o + l], Work::Fingerprint, s)
            })
            .collect();
        w.run(&mut jobs);
        drop(jobs);
        let fps = slots
            .iter()
            .take(found.len())
            .map(|s| s.fingerprint)
            .collect();
        self.mirror.put_slots(slots);
        fps
    }

    /// Encodes the chunk at `(off, len)` of `at.view` (with what the workers prepared for it);
    /// `Some` when the turn stops before it, with the bytes used before it.
    fn one(
        &mut self,
        at: &View<'_>,
        (off, len): (usize, usize),
        policy: &Policy,
        hint: &mut Hint,
        prep: Option<&mut Prepared>,
    ) -> Option<(usize, Stop)> {
        let t = &mut *self.turn;
        // A run's literals have most of their bytes still to come (in this frame): keep
        // room for them, and let this chunk join the run only if the room holds it too.
        let pending = hint.run_pending();
        let with_run = t.wire + run_reserve(pending + len) + RECORD_OVERHEAD;
        let alone = if pending > 0 {
            with_run
        } else {
            t.wire + len + RECORD_OVERHEAD
        };
        // The run's records are to come: the quantum counts what they are expected to cost
        // (at the stream's recent ratio), the room what they could cost at most.
        let expected = (pending as f64 * self.ratio) as usize;
        if off + len > at.budget
            || (t.raw > 0 && t.wire + expected >= self.lim.quantum)
            || alone > self.lim.room
        {
            return Some((off, Stop::Limit));
        }
        let policy = &Policy {
            runs: policy.runs && with_run <= self.lim.room,
            ..*policy
        };
        let last = off + len == at.end;
        if last && !at.final_end && len < self.chunking.max_chunk {
            return Some((off, Stop::Tail));
        }
        let chunk = at.get(off..off + len);
        let (m, out) = (&mut *self.mirror, &mut *self.out);
        let r = if last && len < self.chunking.min_chunk {
            encode_tail(m, chunk, policy, self.pressure, hint, out)
        } else {
            m.encode_chunk(chunk, policy, self.pressure, hint, out, prep)
        };
        self.stats.add(&r);
        self.stats.merge(&m.take_late());
        t.wire += r.wire + r.run_end;
        if r.sent == Sent::Wait {
            t.wait = true;
            return Some((off, Stop::Limit));
        }
        t.raw += len;
        None
    }
}

#[cfg(test)]
mod tests;
