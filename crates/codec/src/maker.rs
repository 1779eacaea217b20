//! A stream context's records made apart from the mirror's decisions. The mirror decides, in
//! link order, what each chunk of a turn becomes; a chunk that goes as a literal in its
//! stream's context only needs its context after that, in the stream's order. So the mirror
//! plans such a record (its tag, whether it defers) and a [`Maker`] compresses it: at once on
//! the calling thread, or, for a bulk stream's turn left pending (`emit_pending` in the send
//! path), from a [`Queue`] on a worker, while the caller plans other streams' turns. The turn's records are then put together in order. Either way the bytes are the same: the same
//! compressor sees the same input with the same directives, and nothing the mirror decides
//! within a turn depends on what a context record cost (that is learned at the turn's end,
//! from each record's [`Outcome`]). A delta run in the stream's context goes the same way
//! ([`RunJob`]): its frame, and whether it pays or its chunks go as context literals, are the
//! maker's.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use bytes::BufMut;
use zstd::zstd_safe::{CCtx, InBuffer, OutBuffer, zstd_sys::ZSTD_EndDirective};

use crate::config::Codec;
use crate::format::{TAG_RUN_END, put_len};
use crate::prepare::Workers;

/// Record bytes a planned context record is counted as at most beyond its raw bytes' share of
/// [`run_reserve`](crate::format::run_reserve): its tag and two lengths, a zstd block header,
/// and a fresh context's frame header.
pub(crate) const PLANNED_OVERHEAD: usize = 32;

/// What one planned record is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Make {
    /// A context literal with this tag (flags included); `defer`: the context keeps its bytes
    /// for a later record of the run. `cached`: the peer caches the chunk (for the raw record
    /// it becomes if its context fails).
    Literal { tag: u8, defer: bool, cached: bool },
    /// The end of a run: the rest of the context's output.
    RunEnd,
}

/// What an [`Op`] makes: one planned record, or a delta run ([`RunJob`]: one record if it
/// pays, else its chunks as context literals).
pub(crate) enum What {
    Record(Make),
    Run(Box<RunJob>),
}

/// What a planned record is to the turn's end, which learns from what it cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A literal the context keeps for a later record of its run.
    Deferred,
    /// A literal that ends a run of `n` chunks and `raw` bytes (itself included).
    EndsRun { raw: usize, n: usize },
    /// A literal flushed alone; `learn`: it teaches what literals cost (deltas were tried for it).
    Alone { learn: bool },
    /// A run's end, after `n` chunks and `raw` bytes.
    RunEnd { raw: usize, n: usize },
    /// A delta run's record, of `n` chunks.
    Delta { n: usize },
    /// A chunk of a delta run that did not pay, as a literal in its stream's context (which
    /// also teaches what literals cost).
    FromRun,
}

/// What one context record cost: its raw bytes, its context's output and the record's bytes.
/// `failed`: the context failed; the record went as raw bytes (or not at all, a run's end).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Outcome {
    pub(crate) raw: usize,
    pub(crate) payload: usize,
    pub(crate) wire: usize,
    pub(crate) kind: Kind,
    pub(crate) failed: bool,
}

/// One planned record.
pub(crate) struct Op {
    /// Where it goes: the bytes of the turn's other records before it.
    pub(crate) at: usize,
    pub(crate) what: What,
    pub(crate) kind: Kind,
    /// The chunk (empty for a run's end; a delta run's chunks).
    pub(crate) raw: Vec<u8>,
    /// A context started for it (with its serial): the one before it is done with.
    pub(crate) start: Option<(u64, CCtx<'static>)>,
}

/// A delta run the mirror planned in order (its bases, names and what its chunks do to both
/// caches are decided then), left for a [`Maker`] to compress: its frame against its bases,
/// written as one record if that costs less than `limit`, else its chunks each flushed alone
/// in the stream's context, as the literals they would have been. Either way what the mirror
/// learns from it waits for the turn's end, so the records do not depend on where it was made.
pub(crate) struct RunJob {
    /// The record between its tag and its frame's length: the counts, the bases' names, the
    /// chunks' lengths and the run's check.
    pub(crate) head: Vec<u8>,
    /// The bases' bytes, in the order the record names them.
    pub(crate) dict: Vec<u8>,
    /// The chunks' lengths (their bytes are the op's `raw`).
    pub(crate) lens: Vec<usize>,
    /// The frame's zstd level and table size.
    pub(crate) level: (i32, u32),
    /// The frame goes without zstd's magic number (`TAG_DELTA_RUN_BARE`).
    pub(crate) compact: bool,
    /// Record bytes the run must cost less than to go as one.
    pub(crate) limit: f64,
}

/// Compresses the run of `raw` against `job.dict` and appends its record to `out` if it costs
/// less than `job.limit`: the record's bytes, or `None` (nothing written) if it does not pay.
pub(crate) fn run_record(
    job: &mut RunJob,
    raw: &[u8],
    scratch: &mut Vec<u8>,
    out: &mut impl BufMut,
) -> Option<usize> {
    use crate::delta::{compress_delta, len_len};
    use crate::format::{TAG_DELTA_RUN, TAG_DELTA_RUN_BARE, ZSTD_MAGIC};
    scratch.clear();
    scratch.reserve(zstd::zstd_safe::compress_bound(raw.len()));
    compress_delta(scratch, &mut job.dict, raw, job.level)?;
    // Without zstd's magic number where the peer puts it back.
    let bare = job.compact && scratch.starts_with(&ZSTD_MAGIC);
    let skip = if bare { ZSTD_MAGIC.len() } else { 0 };
    let clen = scratch.len() - skip;
    let wire = 1 + job.head.len() + len_len(clen) + clen;
    if wire as f64 >= job.limit {
        return None;
    }
    out.put_u8(if bare {
        TAG_DELTA_RUN_BARE
    } else {
        TAG_DELTA_RUN
    });
    out.put_slice(&job.head);
    put_len(out, clen);
    out.put_slice(&scratch[skip..skip + clen]);
    Some(wire)
}

/// Makes a delta run ([`RunJob`]) of `raw` and appends its records to `out`: what each cost,
/// with the bytes it took, and false if the stream's context failed making its literals.
pub(crate) fn make_run(
    mut cctx: Option<&mut CCtx<'static>>,
    job: &mut RunJob,
    raw: &[u8],
    scratch: &mut Vec<u8>,
    out: &mut impl BufMut,
) -> (Vec<(Outcome, usize)>, bool) {
    if let Some(wire) = run_record(job, raw, scratch, out) {
        let o = Outcome {
            raw: raw.len(),
            payload: wire,
            wire,
            kind: Kind::Delta { n: job.lens.len() },
            failed: false,
        };
        return (vec![(o, wire)], true);
    }
    let lit = Make::Literal {
        tag: crate::format::TAG_LIT_CONTEXT,
        defer: false,
        cached: true,
    };
    let (mut made, mut ok, mut at) = (Vec::with_capacity(job.lens.len()), true, 0);
    for &len in &job.lens {
        let Some(chunk) = raw.get(at..at + len) else {
            break;
        };
        at += len;
        let (o, good) = make(
            cctx.as_deref_mut().filter(|_| ok),
            lit,
            Kind::FromRun,
            chunk,
            scratch,
            out,
        );
        ok &= good;
        made.push((o, o.wire));
    }
    (made, ok)
}

/// A stream's planned context records, in order, across its turns, for whoever makes them: a
/// worker, or the caller that finishes a turn. Each record goes to its turn's [`Lane`]. A
/// queue with workers ([`streaming`](Queue::streaming)) has one make them as they come, while
/// the rest of the turn is planned, and on through the stream's next turn when that one is
/// planned before this one is finished: the records of one turn need nothing of what the turn
/// before cost, only the stream's context, which the queue's [`Maker`] keeps from one record
/// to the next.
pub(crate) struct Queue {
    ops: Mutex<VecDeque<(Arc<Lane>, Op)>>,
    /// A worker makes the records queued, or is about to.
    busy: AtomicBool,
    maker: Mutex<Maker>,
    /// The workers that make the records as they come.
    workers: Option<Arc<dyn Workers>>,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("streaming", &self.workers.is_some())
            .finish()
    }
}

/// One turn's context records: where they go as they are made, and how many are still to be.
#[derive(Default)]
pub(crate) struct Lane {
    made: Mutex<Made>,
    /// Told each time a record is made.
    told: Condvar,
    /// Records queued for the turn.
    pushed: AtomicUsize,
    /// The turn is still being planned: more records may come.
    planning: AtomicBool,
}

/// One turn's context records as they are made, one after the other, each one's place, end
/// in `recs` and outcome; the chunks' buffers, for the mirror to plan the next ones in.
#[derive(Default)]
pub(crate) struct Made {
    pub(crate) recs: Vec<u8>,
    pub(crate) made: Vec<(usize, usize, Outcome)>,
    pub(crate) spare: Vec<Vec<u8>>,
    done: usize,
}

impl std::fmt::Debug for Made {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Made")
            .field("made", &self.made.len())
            .finish()
    }
}

impl Lane {
    /// A turn's lane, its records' buffers those of an earlier turn (emptied).
    pub(crate) fn new(mut made: Made) -> Self {
        made.recs.clear();
        made.made.clear();
        made.done = 0;
        Lane {
            made: Mutex::new(made),
            planning: AtomicBool::new(true),
            ..Lane::default()
        }
    }

    /// True if a record was ever queued for the turn.
    pub(crate) fn any(&self) -> bool {
        self.pushed.load(Ordering::Acquire) > 0
    }

    /// The turn is planned: no more records come.
    pub(crate) fn planned(&self) {
        self.planning.store(false, Ordering::Release);
    }

    fn whole(&self, made: &Made) -> bool {
        !self.planning.load(Ordering::Acquire) && made.done == self.pushed.load(Ordering::Acquire)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Made> {
        self.made.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The turn's records, once all are made (see [`Queue::wait`]).
    pub(crate) fn take(&self) -> Made {
        std::mem::take(&mut *self.lock())
    }
}

/// A turn's lane on its stream's queue: what the mirror queues the turn's records with.
#[derive(Clone)]
pub(crate) struct Open {
    pub(crate) queue: Arc<Queue>,
    pub(crate) lane: Arc<Lane>,
}

impl Open {
    /// Queues a planned record of the turn.
    pub(crate) fn push(&self, op: Op) {
        self.lane.pushed.fetch_add(1, Ordering::AcqRel);
        Queue::push(&self.queue, Arc::clone(&self.lane), op);
    }
}

impl Queue {
    /// A queue whose records are made when their turn is finished (or by workers it is handed
    /// to: see [`kick`](Self::kick)).
    pub(crate) fn new() -> Self {
        Queue {
            ops: Mutex::default(),
            busy: AtomicBool::new(false),
            maker: Mutex::default(),
            workers: None,
        }
    }

    /// A queue whose records `workers` make as they come: the stream's context records are
    /// made beside the planning of its turns' other records (which does not wait for what
    /// they cost: that is learned at each turn's end). The same records, made in the same
    /// order, as when they are all made after their turn is planned.
    pub(crate) fn streaming(workers: Arc<dyn Workers>) -> Self {
        Queue {
            workers: Some(workers),
            ..Queue::new()
        }
    }

    /// True if it has workers make its records as they come.
    pub(crate) fn is_streaming(&self) -> bool {
        self.workers.is_some()
    }

    fn push(queue: &Arc<Queue>, lane: Arc<Lane>, op: Op) {
        queue
            .ops
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back((lane, op));
        if let Some(w) = queue.workers.as_ref() {
            Queue::kick(queue, w.as_ref());
        }
    }

    /// Has `workers` make the records queued, unless a worker already does.
    pub(crate) fn kick(queue: &Arc<Queue>, workers: &dyn Workers) {
        if queue.is_empty() || queue.busy.swap(true, Ordering::SeqCst) {
            return;
        }
        let q = Arc::clone(queue);
        workers.spawn(Box::new(move || {
            loop {
                while let Ok(mut m) = q.maker.try_lock() {
                    let Some((lane, op)) = q.next(None) else {
                        break;
                    };
                    m.make(&lane, op);
                }
                q.busy.store(false, Ordering::SeqCst);
                // A record queued after the last one taken and before `busy` was cleared found
                // a worker busy: it is taken here. The maker held elsewhere: by a turn's
                // finish making its own records, which hands the rest on when it is done.
                if q.is_empty()
                    || q.maker.try_lock().is_err()
                    || q.busy.swap(true, Ordering::SeqCst)
                {
                    return;
                }
            }
        }));
    }

    /// True if no record waits to be made.
    pub(crate) fn is_empty(&self) -> bool {
        self.ops
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_empty()
    }

    /// The next record to make; with `of`, only if it is that turn's.
    fn next(&self, of: Option<&Arc<Lane>>) -> Option<(Arc<Lane>, Op)> {
        let mut ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        match (ops.front(), of) {
            (Some((l, _)), Some(of)) if !Arc::ptr_eq(l, of) => None,
            _ => ops.pop_front(),
        }
    }

    /// True while `lane`'s records are not all made and someone makes one.
    pub(crate) fn busy(&self, lane: &Lane) -> bool {
        !lane.whole(&lane.lock()) && self.maker.try_lock().is_err()
    }

    /// Makes the records queued next here, up to the last of `lane`'s, if no worker makes
    /// records now (any before them are an earlier turn's, made for it in order); returns
    /// whether it made any.
    pub(crate) fn make_through(&self, lane: &Arc<Lane>) -> bool {
        let Ok(mut m) = self.maker.try_lock() else {
            return false;
        };
        let mut any = false;
        while !lane.whole(&lane.lock()) {
            let Some((l, op)) = self.next(None) else {
                break;
            };
            m.make(&l, op);
            any = true;
        }
        any
    }

    /// Waits until every record of `lane` (a turn planned) is made, making them here while no
    /// worker does. Then hands the records of later turns queued meanwhile to the workers, if
    /// it has them.
    pub(crate) fn wait(queue: &Arc<Queue>, lane: &Arc<Lane>) {
        loop {
            if queue.make_through(lane) {
                continue;
            }
            let made = lane.lock();
            if lane.whole(&made) {
                break;
            }
            // A worker makes one of them; it tells the lane when it has (the timeout covers a
            // worker that stopped for the maker this thread held a moment ago).
            let (made, _) = lane
                .told
                .wait_timeout(made, std::time::Duration::from_micros(200))
                .unwrap_or_else(|p| p.into_inner());
            if lane.whole(&made) {
                break;
            }
        }
        if let Some(w) = queue.workers.as_ref() {
            Queue::kick(queue, w.as_ref());
        }
    }

    /// The stream's compressor, once no turn's records are left to make: a context goes back
    /// to the stream ([`None`] if it failed).
    pub(crate) fn take_context(&self) -> Option<(u64, CCtx<'static>)> {
        self.maker
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .cctx
            .take()
    }
}

/// Makes a stream context's planned records in order: its compressor.
#[derive(Default)]
pub(crate) struct Maker {
    /// The context's compressor and serial; `None` once it failed (or before one started).
    pub(crate) cctx: Option<(u64, CCtx<'static>)>,
    scratch: Vec<u8>,
}

impl std::fmt::Debug for Maker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Maker")
            .field("cctx", &self.cctx.as_ref().map(|c| c.0))
            .finish()
    }
}

impl Maker {
    /// Makes one planned record into its turn's lane.
    fn make(&mut self, lane: &Lane, mut op: Op) {
        if let Some(start) = op.start.take() {
            self.cctx = Some(start);
        }
        let mut guard = lane.lock();
        let out = &mut *guard;
        let cctx = self.cctx.as_mut().map(|c| &mut c.1);
        match &mut op.what {
            What::Run(job) => {
                let (made, ok) = make_run(cctx, job, &op.raw, &mut self.scratch, &mut out.recs);
                if !ok {
                    self.cctx = None;
                }
                let mut end = out.recs.len() - made.iter().map(|m| m.1).sum::<usize>();
                for (o, n) in made {
                    end += n;
                    out.made.push((op.at, end, o));
                }
            }
            What::Record(record) => {
                let (outcome, ok) = make(
                    cctx,
                    *record,
                    op.kind,
                    &op.raw,
                    &mut self.scratch,
                    &mut out.recs,
                );
                if !ok {
                    self.cctx = None;
                }
                out.made.push((op.at, out.recs.len(), outcome));
                op.raw.clear();
                out.spare.push(op.raw);
            }
        }
        out.done += 1;
        drop(guard);
        lane.told.notify_all();
    }
}

/// Makes one planned record of `raw` in `cctx` and appends it to `out`; returns what it cost,
/// and false if the context failed (or there was none): then a literal goes as raw bytes (its
/// run, if one was open, is left unfinished, which fails the stream at the receiver) and a
/// run's end writes nothing.
pub(crate) fn make(
    cctx: Option<&mut CCtx<'static>>,
    what: Make,
    kind: Kind,
    raw: &[u8],
    scratch: &mut Vec<u8>,
    out: &mut impl BufMut,
) -> (Outcome, bool) {
    let directive = match what {
        Make::Literal { defer: true, .. } => ZSTD_EndDirective::ZSTD_e_continue,
        _ => ZSTD_EndDirective::ZSTD_e_flush,
    };
    let compressed = cctx.and_then(|cctx| {
        scratch.clear();
        // Room for everything the context holds, flushed: nothing is left inside zstd after
        // one call (a run holds at most RUN_MAX bytes before a record flushes it).
        scratch.reserve(zstd::zstd_safe::compress_bound(raw.len() + crate::RUN_MAX) + 64);
        let mut input = InBuffer::around(raw);
        let mut output = OutBuffer::around(scratch);
        let r = cctx.compress_stream2(&mut output, &mut input, directive);
        let flushed = r == Ok(0) || (directive == ZSTD_EndDirective::ZSTD_e_continue && r.is_ok());
        (flushed && input.pos() == raw.len()).then(|| output.pos())
    });
    let outcome = |payload, wire, failed| Outcome {
        raw: raw.len(),
        payload,
        wire,
        kind,
        failed,
    };
    match (what, compressed) {
        (Make::Literal { tag, .. }, Some(clen)) => {
            out.put_u8(tag);
            let h = put_len(out, raw.len()) + put_len(out, clen);
            out.put_slice(&scratch[..clen]);
            (outcome(clen, 1 + h + clen, false), true)
        }
        (Make::RunEnd, Some(clen)) => {
            out.put_u8(TAG_RUN_END);
            let h = put_len(out, clen);
            out.put_slice(&scratch[..clen]);
            (outcome(clen, 1 + h + clen, false), true)
        }
        (Make::Literal { cached, .. }, None) => {
            out.put_u8(Codec::None.tag(cached));
            let h = put_len(out, raw.len());
            out.put_slice(raw);
            (outcome(raw.len(), 1 + h + raw.len(), true), false)
        }
        (Make::RunEnd, None) => (outcome(0, 0, true), false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Decoder;
    use crate::format::{DEFERRED, FRESH, TAG_LIT_CONTEXT};

    fn compressor() -> CCtx<'static> {
        let mut c = CCtx::create();
        c.set_parameter(zstd::zstd_safe::CParameter::CompressionLevel(3))
            .expect("a level");
        c
    }

    /// Records queued for a worker come out of it as they come out of the calling thread:
    /// byte for byte, in order, each at the place it was planned for.
    #[test]
    fn a_worker_makes_the_records_made_on_the_calling_thread() {
        let chunks: Vec<Vec<u8>> = (0..24usize)
            .map(|i| format!("row {i} ").repeat(500 + i * 37).into_bytes())
            .collect();
        let plan = |i: usize| {
            let defer = i % 4 != 3;
            let tag =
                TAG_LIT_CONTEXT | if i == 0 { FRESH } else { 0 } | if defer { DEFERRED } else { 0 };
            Make::Literal {
                tag,
                defer,
                cached: true,
            }
        };
        let mut here = compressor();
        let (mut scratch, mut inline) = (Vec::new(), Vec::new());
        for (i, c) in chunks.iter().enumerate() {
            make(
                Some(&mut here),
                plan(i),
                Kind::Deferred,
                c,
                &mut scratch,
                &mut inline,
            );
        }
        make(
            Some(&mut here),
            Make::RunEnd,
            Kind::RunEnd { raw: 0, n: 0 },
            &[],
            &mut scratch,
            &mut inline,
        );
        let ops = || {
            let mut ops: Vec<Op> = chunks
                .iter()
                .enumerate()
                .map(|(i, c)| Op {
                    at: i * 10,
                    what: What::Record(plan(i)),
                    kind: Kind::Deferred,
                    raw: c.to_vec(),
                    start: (i == 0).then(|| (1, compressor())),
                })
                .collect();
            ops.push(Op {
                at: 240,
                what: What::Record(Make::RunEnd),
                kind: Kind::RunEnd { raw: 0, n: 0 },
                raw: Vec::new(),
                start: None,
            });
            ops
        };
        // Three turns' lanes: the records of each, made, one after the other.
        let turns = [0..8, 8..16, 16..25];
        let check = |lanes: &[Arc<Lane>]| {
            let (mut recs, mut places, mut spare) = (Vec::new(), Vec::new(), 0);
            for (lane, turn) in lanes.iter().zip(&turns) {
                let made = lane.take();
                assert_eq!(made.made.len(), turn.len());
                recs.extend_from_slice(&made.recs);
                places.extend(made.made.iter().map(|m| m.0));
                assert!(made.made.iter().all(|m| !m.2.failed));
                spare += made.spare.len();
            }
            assert!(
                recs == inline,
                "{} against {} bytes",
                recs.len(),
                inline.len()
            );
            assert_eq!(places, (0..=24).map(|i| i * 10).collect::<Vec<_>>());
            assert_eq!(spare, 25, "the chunks' buffers come back");
        };
        let lanes = || -> Vec<Arc<Lane>> {
            turns
                .iter()
                .map(|_| Arc::new(Lane::new(Made::default())))
                .collect()
        };

        // Queued, then made by each turn's finish (here, on another thread).
        let queue = Arc::new(Queue::new());
        let mine = lanes();
        let mut all = ops().into_iter().enumerate();
        for (lane, turn) in mine.iter().zip(&turns) {
            let open = Open {
                queue: Arc::clone(&queue),
                lane: Arc::clone(lane),
            };
            for (_, op) in all.by_ref().take(turn.len()) {
                open.push(op);
            }
            lane.planned();
        }
        std::thread::scope(|s| {
            s.spawn(|| mine.iter().for_each(|l| Queue::wait(&queue, l)));
        });
        assert!(queue.is_empty());
        check(&mine);

        // Made by workers as they are queued (a streaming queue, a few at a time as the
        // planning pauses), each turn finished while the next is planned (its records made
        // by the worker, or by the finish when none is at it): the same records.
        let queue = Arc::new(Queue::streaming(Arc::new(Spawned)));
        let mine = lanes();
        let mut all = ops().into_iter().enumerate();
        for (t, (lane, turn)) in mine.iter().zip(&turns).enumerate() {
            let open = Open {
                queue: Arc::clone(&queue),
                lane: Arc::clone(lane),
            };
            for (i, op) in all.by_ref().take(turn.len()) {
                open.push(op);
                if i % 5 == 4 {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                // Halfway through this turn, the turn before is finished.
                if t > 0 && i == turn.start + turn.len() / 2 {
                    Queue::wait(&queue, &mine[t - 1]);
                }
            }
            lane.planned();
        }
        if let Some(last) = mine.last() {
            Queue::wait(&queue, last);
        }
        assert!(mine.iter().all(|l| l.any()) && queue.is_empty());
        check(&mine);
        assert!(queue.take_context().is_some(), "the context comes back");
    }

    /// Workers that run each job handed over on a thread of its own.
    #[derive(Debug)]
    struct Spawned;

    impl Workers for Spawned {
        fn run(&self, jobs: &mut [crate::prepare::Job<'_>]) {
            jobs.iter_mut().for_each(crate::prepare::Job::run);
        }

        fn threads(&self) -> usize {
            2
        }

        fn spawn(&self, job: Box<dyn FnOnce() + Send>) {
            std::thread::spawn(job);
        }
    }

    /// A context that fails (or is gone) sends its chunk as raw bytes, which rebuild it
    /// alone; a run's end has nothing to send.
    #[test]
    fn a_failed_context_sends_the_chunk_raw() {
        let chunk = b"a chunk whose context is gone".repeat(40);
        let lit = Make::Literal {
            tag: TAG_LIT_CONTEXT,
            defer: false,
            cached: true,
        };
        let (mut scratch, mut out) = (Vec::new(), Vec::new());
        let (o, ok) = make(
            None,
            lit,
            Kind::Alone { learn: true },
            &chunk,
            &mut scratch,
            &mut out,
        );
        assert!(!ok && o.failed);
        assert_eq!(o.wire, out.len());
        let mut dec = Decoder::with_capacity(1 << 20, true);
        let mut got = Vec::new();
        assert_eq!(dec.decode_record(&out, &mut got), Ok(out.len()));
        assert_eq!(got, chunk);
        let before = out.len();
        let (o, ok) = make(
            None,
            Make::RunEnd,
            Kind::RunEnd { raw: 1, n: 1 },
            &[],
            &mut scratch,
            &mut out,
        );
        assert!(!ok && o.failed && o.wire == 0);
        assert_eq!(out.len(), before);
    }
}
