//! The part of encoding a chunk that does not need the mirror's order: its fingerprint, its
//! compression when it goes alone (LZ4, or zstd outside a stream context), and the anchors the
//! store of delta bases is searched with. A mirror given
//! [`Workers`] prepares a turn's chunks together, possibly on several threads, then encodes them
//! in link order with the results: the records are byte for byte the ones it would have written
//! preparing nothing. A decoder likewise decompresses and fingerprints a frame's literals alone
//! ahead, and inserts them into its cache in order; its workers also copy what those literals
//! and the chunks its references name rebuild straight into its output ([`Place`]), so that the
//! decoding thread only counts them in, record by record, while later jobs still run.

use std::cell::RefCell;
use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};

use crate::config::{Codec, CodecConfig};
use crate::fingerprint::{Fingerprint, fingerprint};

/// Chunks prepared together (see this module): 64 of 8 KiB, half a megabyte, keep two to
/// sixteen workers busy between the mirror's turns.
pub const BATCH: usize = 64;

/// How long a thread that needs what another holds (a job a worker runs, a frame it feeds)
/// spins before it sleeps on the lock: the holder is most often about done (a chunk's job takes
/// tens of microseconds), and a thread put to sleep on a lock took tens of microseconds to wake
/// on the 2-core test VM, at every turn or frame that met a worker's job in the middle.
const SPIN_WAIT: std::time::Duration = std::time::Duration::from_micros(200);

/// How long of that it spins without giving its core up; after it, between looks, it yields
/// (`sched_yield`): on an idle host that returns at once, on a busy one the core goes to a
/// thread that can run, perhaps the holder itself.
const SPIN_ALONE: std::time::Duration = std::time::Duration::from_micros(20);

thread_local! {
    /// The time this thread has spun in [`lock_soon`], in all.
    static SPUN: std::cell::Cell<std::time::Duration> = const { std::cell::Cell::new(std::time::Duration::ZERO) };
}

/// The time the calling thread has spun waiting for a lock ([`lock_soon`]) since it started,
/// its waits' wall time before it slept on the lock. The pool's judge takes it out of the CPU
/// time a call cost: spinning is CPU time that the calling thread alone would not have spent,
/// and counted in it would make a pool whose threads wait for a busy host's cores look as if
/// it saved time. (Where the thread yielded its core to others meanwhile, it counts more than
/// the thread spent: the judge errs against the pool.)
pub fn spun() -> std::time::Duration {
    SPUN.with(std::cell::Cell::get)
}

/// `m` locked (poisoned or not), waiting up to [`SPIN_WAIT`] for its holder first (counted in
/// [`spun`]): spinning at first, then yielding its core between looks.
pub(crate) fn lock_soon<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    let mut since: Option<std::time::Instant> = None;
    let guard = loop {
        match m.try_lock() {
            Ok(g) => break g,
            Err(TryLockError::Poisoned(p)) => break p.into_inner(),
            Err(TryLockError::WouldBlock) => {
                let waited = since.get_or_insert_with(std::time::Instant::now).elapsed();
                if waited < SPIN_ALONE {
                    for _ in 0..64 {
                        std::hint::spin_loop();
                    }
                } else if waited < SPIN_WAIT {
                    std::thread::yield_now();
                } else {
                    break m.lock().unwrap_or_else(|p| p.into_inner());
                }
            }
        }
    };
    // A wait that ended asleep on the lock counts its spinning and yielding alone.
    if let Some(t) = since {
        SPUN.with(|s| s.set(s.get() + t.elapsed().min(SPIN_WAIT)));
    }
    guard
}

/// Runs jobs, several at once where it can; returns when every one is done. The runtime gives
/// one backed by a pool of threads; [`Inline`] runs them in turn on the calling thread.
pub trait Workers: Send + Sync + std::fmt::Debug {
    /// Runs every job (see [`Job::run`]).
    fn run(&self, jobs: &mut [Job<'_>]);

    /// Runs `caller` on the calling thread while workers run `ahead`'s jobs (see [`Ahead`]);
    /// returns when `caller` has returned and every job has run. Alone: `caller`, then the jobs
    /// it did not take.
    fn overlap(&self, ahead: &Ahead<'_>, caller: &mut dyn FnMut()) {
        caller();
        ahead.work();
    }

    /// Threads that run jobs, the caller's included.
    fn threads(&self) -> usize {
        1
    }

    /// Runs `job` on a worker when one is free, while the caller goes on; alone: at once.
    fn spawn(&self, job: Box<dyn FnOnce() + Send>) {
        job();
    }

    /// Hands over work for a later call ([`Idle`]) that threads with nothing else to do take a
    /// piece at a time: a pool thread done with its part of a call while the caller finishes
    /// its own, the caller waiting for a pool thread's job, a thread lingering between calls.
    /// Alone (or with no such time): nobody does it, and its owner does it in turn.
    fn idle(&self, _work: std::sync::Arc<dyn Idle>) {}
}

/// Work for a later call, done ahead in threads' spare time (see [`Workers::idle`]) if at all:
/// its owner takes what was done when its turn comes, and does the rest itself.
pub trait Idle: Send + Sync {
    /// Does one piece of the work no thread has taken (a chunk's worth: a thread taking it
    /// holds up whatever comes next for that long); false if none was left.
    fn work_one(&self) -> bool;
}

/// Work left to the workers that its owner finishes in turn (a stream's context records made,
/// a frame fed to its stream's context): one job, which does nothing if the owner got to it
/// first.
pub trait Deferred {
    /// Has `workers` do the work.
    fn spawn(&self, workers: &dyn Workers);
    /// True while a worker does it.
    fn busy(&self) -> bool;
    /// Does a piece of the work that no worker has started here; returns whether it did any
    /// (called again, it does the next piece).
    fn help(&self) -> bool;
    /// True if it is worth handing to the workers even right after its owner's earlier work
    /// (see [`InTurn::push`]): it needs nothing of that work.
    fn alone(&self) -> bool {
        false
    }
}

/// Deferred work, oldest first, each with its owner's key (a stream, a frame's header),
/// finished in the order it was handed over; while a worker does the oldest, the caller does
/// later ones rather than wait, so several streams' work runs at once however many workers
/// there are.
#[derive(Debug)]
pub struct InTurn<K, J> {
    jobs: std::collections::VecDeque<(K, J)>,
    /// The owner (a stream) of the work handed over last.
    last: Option<u64>,
}

impl<K, J> Default for InTurn<K, J> {
    fn default() -> Self {
        InTurn {
            jobs: std::collections::VecDeque::new(),
            last: None,
        }
    }
}

impl<K, J: Deferred> InTurn<K, J> {
    /// Adds work just handed over for `owner` (a stream), done on `workers` if the work handed
    /// over before it was another owner's, else by whoever finishes it. An owner's work waits
    /// for its earlier work (a stream's context goes in its order), which its caller finishes
    /// before handing over the next: with one stream alone, nothing would run beside a worker
    /// doing it, and handing it over would only cost a wake-up and its bytes crossing cores
    /// (one stream's context decode on two threads ran at 0.85-0.97x of one thread fed ahead).
    pub fn push(&mut self, owner: u64, k: K, j: J, workers: Option<&dyn Workers>) {
        let after_another = self.last.replace(owner) != Some(owner);
        if let Some(w) = workers.filter(|_| after_another || j.alone()) {
            j.spawn(w);
        }
        self.jobs.push_back((k, j));
    }

    pub fn len(&self) -> usize {
        self.jobs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    /// The work waiting, oldest first, with its owners' keys.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = &(K, J)> {
        self.jobs.iter()
    }

    /// Where the first work `is` picks out waits, if any does.
    pub fn position(&self, is: impl Fn(&K) -> bool) -> Option<usize> {
        self.jobs.iter().position(|(k, _)| is(k))
    }

    /// The oldest work, to be finished: later ones are done here, a piece at a time (the last
    /// first), while a worker does it.
    pub fn pop_front(&mut self) -> Option<(K, J)> {
        'help: while self.jobs.front().is_some_and(|(_, j)| j.busy()) {
            for (_, later) in self.jobs.iter().skip(1).rev() {
                if later.help() {
                    continue 'help;
                }
            }
            break;
        }
        self.jobs.pop_front()
    }

    /// Hands the work up to the `last`th (all of it with `usize::MAX`) to `each`, oldest first,
    /// to be finished.
    pub fn finish_through(&mut self, last: usize, mut each: impl FnMut(K, J)) {
        let n = last.saturating_add(1).min(self.jobs.len());
        for _ in 0..n {
            if let Some((k, j)) = self.pop_front() {
                each(k, j);
            }
        }
    }
}

/// Runs jobs one after the other on the calling thread.
#[derive(Debug, Default, Clone, Copy)]
pub struct Inline;

impl Workers for Inline {
    fn run(&self, jobs: &mut [Job<'_>]) {
        jobs.iter_mut().for_each(Job::run);
    }
}

/// Jobs that workers run ahead of the caller while it encodes (see [`Workers::overlap`]): the
/// caller takes each job's result in order as it comes to the chunk ([`Ahead::with`]), running
/// the job itself when no worker has started it, or waiting for the worker that has. Workers
/// take the jobs from the last back, so that they and the caller work apart until they meet
/// (from the first on, a worker would take the very job the caller wants next, and the two
/// would take turns). Each job runs once, by whoever takes it first.
pub struct Ahead<'a> {
    jobs: Vec<Mutex<Held<'a>>>,
    /// Jobs not yet taken by a worker: the first `left`.
    left: AtomicUsize,
    /// Of them, jobs that cut chunks ahead.
    cuts: usize,
    /// The bytes the caller encodes meanwhile (what a probe weighs the time by).
    weight: u64,
}

struct Held<'a> {
    job: Job<'a>,
    done: bool,
}

impl Held<'_> {
    fn finish(&mut self) {
        if !self.done {
            self.job.run();
            self.done = true;
        }
    }
}

impl<'a> Ahead<'a> {
    /// Jobs to run while the caller encodes `weight` bytes.
    pub(crate) fn new(jobs: Vec<Job<'a>>, weight: u64) -> Self {
        let cuts = jobs
            .iter()
            .filter(|j| matches!(j.task, Task::Cut { .. }))
            .count();
        let jobs_len = jobs.len();
        Ahead {
            cuts,
            weight,
            jobs: jobs
                .into_iter()
                .map(|job| Mutex::new(Held { job, done: false }))
                .collect(),
            left: AtomicUsize::new(jobs_len),
        }
    }

    /// How many jobs there are.
    pub fn len(&self) -> usize {
        self.jobs.len()
    }

    /// True with no jobs.
    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    /// The bytes the caller encodes while the jobs run.
    pub fn weight(&self) -> u64 {
        self.weight
    }

    /// How many of the jobs cut the chunks of a later turn.
    pub fn cuts(&self) -> usize {
        self.cuts
    }

    /// Runs the jobs nobody has taken, from the last back, until none is left (a worker calls
    /// this; so does the caller once it is done, to help finish).
    pub fn work(&self) {
        while self.work_one() {}
    }

    /// Takes the last job nobody has taken and runs it (unless the caller holds it, which runs
    /// it itself); false when none was left.
    pub fn work_one(&self) -> bool {
        let Ok(n) = self
            .left
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
        else {
            return false;
        };
        let Some(m) = self.jobs.get(n - 1) else {
            return false;
        };
        // Held elsewhere: by the caller, which runs the job if nobody has.
        let held = match m.try_lock() {
            Ok(h) => Some(h),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        };
        if let Some(mut h) = held {
            h.finish();
        }
        true
    }

    /// Every job run: here, those nobody has started; then each one a worker runs is waited
    /// for. After it, no job touches anything it was given.
    pub(crate) fn finish_all(&self) {
        for m in &self.jobs {
            lock_soon(m).finish();
        }
    }

    /// Job `i` run (here, if nobody has started it; else once the worker running it is done),
    /// then `f` on what it prepared. `None` for no such job.
    pub(crate) fn with<R>(&self, i: usize, f: impl FnOnce(&mut Prepared) -> R) -> Option<R> {
        let mut h = lock_soon(self.jobs.get(i)?);
        h.finish();
        match &mut h.job.task {
            Task::Chunk { slot, .. } | Task::Parts { slot, .. } => Some(f(slot)),
            Task::Cut { .. } => None,
        }
    }
}

/// The bytes a cutting job cuts: at hand, or partly still to come from a [`Fill`] (taken
/// when the job runs, once the fill is complete).
#[derive(Clone, Copy)]
pub(crate) enum CutBytes<'a> {
    Ready(&'a [u8]),
    Filled(Filled<'a>),
}

impl<'a> From<&'a [u8]> for CutBytes<'a> {
    fn from(b: &'a [u8]) -> Self {
        CutBytes::Ready(b)
    }
}

impl<'a> CutBytes<'a> {
    fn len(&self) -> usize {
        match self {
            CutBytes::Ready(b) => b.len(),
            CutBytes::Filled(f) => f.len,
        }
    }

    /// The bytes (a fill they end in completed first).
    pub(crate) fn get(&self) -> &'a [u8] {
        match self {
            CutBytes::Ready(b) => b,
            CutBytes::Filled(f) => f.get(),
        }
    }
}

/// Bytes that a turn takes from its stream's queue into the free room after its stage's
/// bytes, copied on the workers while the turn encodes what is already staged (a bulk
/// stream's sender): the cutting job that needs them copies them first, and whoever needs
/// them next finishes the copy (or waits for the part another thread copies).
pub(crate) struct Fill {
    dst: *mut u8,
    /// Each part's offset from `dst`, and its bytes.
    parts: Vec<(usize, bytes::Bytes)>,
    len: usize,
    /// Parts taken by a thread to copy, and parts copied.
    taken: AtomicUsize,
    copied: AtomicUsize,
}

// SAFETY: a part is copied by the one thread that takes it (`taken`), into bytes nobody else
// reads or writes until every part is copied (`Fill::new`'s contract); the bytes copied from
// are shared, immutable buffers.
unsafe impl Send for Fill {}
// SAFETY: as above: `complete` is the only access, and it is safe from any number of threads.
unsafe impl Sync for Fill {}

/// Bytes one thread copies of a [`Fill`] at a time.
const FILL_PART: usize = 64 << 10;

impl Fill {
    /// Copies `sources`, in order, to `dst` on.
    ///
    /// # Safety
    /// The bytes from `dst` on, as many as `sources` hold, must stay allocated and writable,
    /// and nobody may read or write them (nor move or free the buffer they are in) but through
    /// this fill, until [`complete`](Self::complete) has returned.
    pub(crate) unsafe fn new(dst: *mut u8, sources: Vec<bytes::Bytes>) -> Self {
        let mut parts = Vec::with_capacity(sources.len());
        let mut len = 0;
        for mut s in sources {
            while !s.is_empty() {
                let part = s.split_to(s.len().min(FILL_PART));
                let n = part.len();
                parts.push((len, part));
                len += n;
            }
        }
        Fill {
            dst,
            parts,
            len,
            taken: AtomicUsize::new(0),
            copied: AtomicUsize::new(0),
        }
    }

    /// The bytes it copies.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Copies the parts no thread has taken, then waits for those others copy: after it, every
    /// byte is in place.
    pub(crate) fn complete(&self) {
        let n = self.parts.len();
        while self.copied.load(Ordering::Acquire) < n {
            let i = self.taken.fetch_add(1, Ordering::Relaxed);
            let Some((off, src)) = self.parts.get(i) else {
                // Every part is taken: the rest are being copied (a few microseconds each).
                let mut spins = 0u32;
                while self.copied.load(Ordering::Acquire) < n {
                    spins += 1;
                    if spins < 1 << 12 {
                        std::hint::spin_loop();
                    } else {
                        std::thread::yield_now();
                    }
                }
                return;
            };
            // SAFETY: `off + src.len() <= len`, within what `new`'s caller handed over, and this
            // part's bytes are this thread's alone to write (it took the part).
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.dst.add(*off), src.len()) };
            self.copied.fetch_add(1, Ordering::Release);
        }
    }
}

/// A cutting job's bytes that end in a [`Fill`]'s: `len` bytes from `ptr`, those before the
/// fill's at hand, the rest the fill's.
#[derive(Clone, Copy)]
pub(crate) struct Filled<'a> {
    fill: &'a Fill,
    ptr: *const u8,
    len: usize,
}

// SAFETY: the bytes are only read, and only once `fill` is complete (see `Filled::get`).
unsafe impl Send for Filled<'_> {}

impl<'a> Filled<'a> {
    /// # Safety
    /// The `len` bytes from `ptr` must stay allocated and unchanged while the view is used;
    /// those before the fill's destination initialized, the rest (up to its end) the fill's.
    pub(crate) unsafe fn new(fill: &'a Fill, ptr: *const u8, len: usize) -> Self {
        Filled { fill, ptr, len }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The bytes in `r` of these, as a view of their own.
    pub(crate) fn from(&self, r: Range<usize>) -> Self {
        assert!(
            r.start <= r.end && r.end <= self.len,
            "a view within the bytes"
        );
        Filled {
            fill: self.fill,
            // SAFETY: `r.start <= len`: within (or just past) the bytes `new` was given.
            ptr: unsafe { self.ptr.add(r.start) },
            len: r.len(),
        }
    }

    /// The bytes, the fill completed first.
    pub(crate) fn get(&self) -> &'a [u8] {
        self.fill.complete();
        // SAFETY: `new`'s contract; the fill is complete, so every one of them is written, and
        // nobody writes them any more.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// What a job computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Work {
    Fingerprint,
    Lz4,
    /// zstd at `level`, after (with `trial`) the adaptive choice's trial on the first 4 KiB
    /// (skewed bytes, or LZ4 shrinks them); a failed trial compresses nothing.
    Zstd {
        level: i32,
        trial: bool,
    },
    /// Decompress a literal's payload into exactly `raw_len` bytes (zstd or LZ4), then
    /// fingerprint them with `hash`.
    Unzstd {
        raw_len: usize,
        hash: bool,
    },
    Unlz4 {
        raw_len: usize,
        hash: bool,
    },
}

/// One job: a chunk's preparation, or cutting the chunks ahead; made by the mirror or the send
/// path, run by [`Workers`].
pub struct Job<'a> {
    task: Task<'a>,
}

enum Task<'a> {
    Chunk {
        chunk: &'a [u8],
        /// `None`: the anchors alone.
        work: Option<Work>,
        /// The chunk's delta anchors too (see [`crate::delta`]).
        anchors: bool,
        slot: &'a mut Prepared,
        /// A decoder's job: where in its output the bytes the record rebuilds go (see
        /// [`Job::placed`]).
        place: Option<Place<'a>>,
    },
    /// A decoder's job: `parts`, one after the other, written into `place` if they fill it
    /// exactly (then `slot.placed`): a run's chunks, rebuilt ahead, copied into the output.
    Parts {
        parts: &'a [bytes::Bytes],
        /// Each part's name to check it against first, if any (a reference run's chunks).
        names: &'a [Fingerprint],
        slot: &'a mut Prepared,
        place: Place<'a>,
    },
    /// The chunks of `bytes` that start in `piece` and end before its end, `most` of them,
    /// cut from `begin` on (see [`crate::cuts::chain_in_piece`]: a boundary, or a guess), each
    /// with its fingerprint if `fingerprints`; offsets from the start of `bytes`.
    Cut {
        bytes: CutBytes<'a>,
        begin: usize,
        piece: Range<usize>,
        cfg: &'a CodecConfig,
        most: usize,
        fingerprints: bool,
        found: &'a mut Vec<Found>,
    },
}

/// A chunk cut ahead: its offset, length and (where chunks are deduplicated) fingerprint.
pub(crate) type Found = (usize, usize, Option<Fingerprint>);

/// What was prepared for one chunk.
#[derive(Debug, Default)]
pub(crate) struct Prepared {
    /// The chunk's length: a slot is used only for a chunk of its length.
    pub len: usize,
    pub fingerprint: Option<Fingerprint>,
    /// The adaptive choice's trial: whether the first 4 KiB are skewed or LZ4 shrank them enough
    /// to pay.
    pub trial: Option<bool>,
    /// The chunk compressed (the first `clen` bytes of `out`), with the codec and zstd level.
    pub compressed: Option<(Codec, i32)>,
    pub out: Vec<u8>,
    pub clen: usize,
    /// A decoder's job: the payload decompressed into `out`, exactly as long as announced.
    pub decoded: bool,
    /// A decoder's job: the bytes the record rebuilds were also written where it was told
    /// (see [`Job::placed`]).
    pub placed: bool,
    /// The chunk's delta anchors, when `anchored`.
    pub anchors: Vec<u64>,
    pub anchored: bool,
}

impl Prepared {
    /// Gives the slot a buffer for a chunk of `len` bytes to be decompressed into (the one the
    /// cache keeps), allocated here: on the decoding thread, which also frees the chunks the
    /// cache lets go. A buffer a worker allocated came from the worker's heap and went back to
    /// it from another thread; that memory was not found again for the next chunks, and the
    /// worker paid the kernel's page faults for fresh memory instead: a fifth of its samples
    /// decoding a first copy on the LZ4 path (`codec --threads 2`, perf), where one thread
    /// alone reused its own.
    pub(crate) fn buffer(&mut self, len: usize) {
        if self.out.capacity() != len {
            self.out = Vec::with_capacity(len);
        }
    }

    /// Empties the slot for a chunk of `len` bytes (its buffer stays).
    pub(crate) fn reset(&mut self, len: usize) {
        self.len = len;
        self.fingerprint = None;
        self.trial = None;
        self.compressed = None;
        self.clen = 0;
        self.decoded = false;
        self.placed = false;
        self.anchored = false;
    }
}

impl<'a> Job<'a> {
    pub(crate) fn new(chunk: &'a [u8], work: Work, slot: &'a mut Prepared) -> Self {
        Job::of(chunk, Some(work), false, slot)
    }

    /// A job of `work` (if any) that also finds the chunk's delta anchors if `anchors`.
    pub(crate) fn of(
        chunk: &'a [u8],
        work: Option<Work>,
        anchors: bool,
        slot: &'a mut Prepared,
    ) -> Self {
        Job {
            task: Task::Chunk {
                chunk,
                work,
                anchors,
                slot,
                place: None,
            },
        }
    }

    /// A decoder's job of `work` (a literal's payload decompressed, or fingerprinted) that
    /// also writes the bytes the record rebuilds into `place`, the part of the decoder's output
    /// they will take, if they fill it exactly (then `slot.placed`): the copy into the output
    /// is made on the worker, next to the decompression, not on the caller's thread.
    pub(crate) fn placed(
        chunk: &'a [u8],
        work: Option<Work>,
        slot: &'a mut Prepared,
        place: Option<Place<'a>>,
    ) -> Self {
        Job {
            task: Task::Chunk {
                chunk,
                work,
                anchors: false,
                slot,
                place,
            },
        }
    }

    /// A decoder's job that writes `parts`, one after the other, into `place`, each checked
    /// against its name first if `names` are given (see [`Task::Parts`]).
    pub(crate) fn parts(
        parts: &'a [bytes::Bytes],
        names: &'a [Fingerprint],
        slot: &'a mut Prepared,
        place: Place<'a>,
    ) -> Self {
        Job {
            task: Task::Parts {
                parts,
                names,
                slot,
                place,
            },
        }
    }

    /// A job that cuts up to `most` chunks of `bytes` into `found` (cleared first), with their
    /// fingerprints if `fingerprints`: only the chunks that end before `bytes` does (the last
    /// piece may grow when more bytes come).
    pub(crate) fn cut(
        bytes: impl Into<CutBytes<'a>>,
        cfg: &'a CodecConfig,
        most: usize,
        fingerprints: bool,
        found: &'a mut Vec<Found>,
    ) -> Self {
        let bytes = bytes.into();
        let len = bytes.len();
        let mut job = Job::cut_piece(bytes, 0, 0..len, cfg, fingerprints, found);
        if let Task::Cut { most: m, .. } = &mut job.task {
            *m = most;
        }
        job
    }

    /// A job that cuts the chunks of `bytes` that start in `piece`, cut from `begin` on, into
    /// `found`, with their fingerprints if `fingerprints` (one piece's chain, see
    /// [`crate::cuts::join`]).
    pub(crate) fn cut_piece(
        bytes: impl Into<CutBytes<'a>>,
        begin: usize,
        piece: Range<usize>,
        cfg: &'a CodecConfig,
        fingerprints: bool,
        found: &'a mut Vec<Found>,
    ) -> Self {
        Job {
            task: Task::Cut {
                bytes: bytes.into(),
                begin,
                piece,
                cfg,
                most: usize::MAX,
                fingerprints,
                found,
            },
        }
    }

    /// Does the job's work (a worker thread calls this).
    pub fn run(&mut self) {
        match &mut self.task {
            Task::Chunk {
                chunk,
                work,
                anchors,
                slot,
                place,
            } => {
                prepare_chunk(chunk, *work, *anchors, slot);
                if let Some(place) = place.as_mut() {
                    place_rebuilt(chunk, *work, slot, place);
                }
            }
            Task::Parts {
                parts,
                names,
                slot,
                place,
            } => {
                // Checked first: a part that fails its name is never placed.
                let named = names.is_empty()
                    || (names.len() == parts.len()
                        && parts
                            .iter()
                            .zip(names.iter())
                            .all(|(p, f)| fingerprint(p) == *f));
                slot.placed = named && place.write_parts(parts);
            }
            Task::Cut {
                bytes,
                begin,
                piece,
                cfg,
                most,
                fingerprints,
                found,
            } => {
                found.clear();
                let bytes: &[u8] = bytes.get();
                crate::cuts::chain_in_piece(bytes, *begin, piece.clone(), cfg, |off, len| {
                    if found.len() >= *most {
                        return false;
                    }
                    let f = fingerprints.then(|| fingerprint(&bytes[off..off + len]));
                    found.push((off, len, f));
                    true
                });
            }
        }
    }
}

/// One chunk's preparation (see [`Job::of`]).
fn prepare_chunk(chunk: &[u8], work: Option<Work>, anchors: bool, s: &mut Prepared) {
    if anchors {
        crate::delta::anchors(chunk, &mut s.anchors);
        s.anchored = true;
    }
    let Some(work) = work else {
        return;
    };
    match work {
        Work::Fingerprint => s.fingerprint = Some(fingerprint(chunk)),
        Work::Lz4 => {
            if let Some(n) = lz4_into(chunk, &mut s.out) {
                s.clen = n;
                s.compressed = Some((Codec::Lz4, 0));
            }
        }
        Work::Zstd { level, trial } => {
            if trial {
                let sample = &chunk[..chunk.len().min(4096)];
                let ok = crate::format::skewed(sample)
                    || lz4_into(sample, &mut s.out)
                        .is_some_and(|n| crate::format::pays(sample.len(), n));
                s.trial = Some(ok);
                if !ok {
                    return;
                }
            }
            if zstd_into(chunk, level, &mut s.out) {
                s.clen = s.out.len();
                s.compressed = Some((Codec::Zstd, level));
            }
        }
        Work::Unzstd { raw_len, hash } | Work::Unlz4 { raw_len, hash } => {
            let zstd = matches!(work, Work::Unzstd { .. });
            // A buffer of exactly the chunk's size: it becomes the cached chunk. The decoder's
            // thread gives one (see `Prepared::buffer`), so that the chunks' memory is taken
            // and given back on the thread that frees it when the cache lets a chunk go.
            s.decoded = unpack(zstd, chunk, raw_len, &mut s.out);
            if s.decoded && hash {
                s.fingerprint = Some(fingerprint(&s.out));
            }
        }
    }
}

/// A decoder's job, after its work: the bytes the record rebuilds (what was decompressed, or
/// a stored literal's payload) copied into `place` if they fill it exactly.
fn place_rebuilt(chunk: &[u8], work: Option<Work>, s: &mut Prepared, place: &mut Place<'_>) {
    let rebuilt: &[u8] = match work {
        Some(Work::Unlz4 { .. } | Work::Unzstd { .. }) if s.decoded => &s.out,
        Some(Work::Unlz4 { .. } | Work::Unzstd { .. } | Work::Lz4 | Work::Zstd { .. }) => return,
        Some(Work::Fingerprint) | None => chunk,
    };
    s.placed = place.write(rebuilt);
}

/// Where a decoder's job writes what a record rebuilds: a part of the decoder's output past
/// its length, which nobody else reads or writes until the job is done.
pub(crate) struct Place<'a> {
    ptr: *mut MaybeUninit<u8>,
    len: usize,
    _room: std::marker::PhantomData<&'a mut [MaybeUninit<u8>]>,
}

// SAFETY: a place is written only by the job that holds it, on whichever thread runs that job,
// and by nobody else until the job is done (`Place::raw`'s contract; a borrowed slice's own).
unsafe impl Send for Place<'_> {}

impl<'a> From<&'a mut [MaybeUninit<u8>]> for Place<'a> {
    fn from(room: &'a mut [MaybeUninit<u8>]) -> Self {
        Place {
            ptr: room.as_mut_ptr(),
            len: room.len(),
            _room: std::marker::PhantomData,
        }
    }
}

impl Place<'_> {
    /// The `len` bytes from `ptr`, as a place for one job.
    ///
    /// # Safety
    /// The bytes must stay allocated and writable, and nobody else may read or write them (nor
    /// move or free the buffer they are in), until the job holding the place has run: until
    /// [`Ahead::with`] of that job, or [`Ahead::finish_all`], returns.
    pub(crate) unsafe fn raw(ptr: *mut MaybeUninit<u8>, len: usize) -> Self {
        Place {
            ptr,
            len,
            _room: std::marker::PhantomData,
        }
    }

    /// Copies `parts` into the place, one after the other, if together they fill it exactly;
    /// true if they did.
    fn write_parts(&mut self, parts: &[bytes::Bytes]) -> bool {
        if parts.iter().map(|p| p.len()).sum::<usize>() != self.len {
            return false;
        }
        let mut at = 0;
        for p in parts {
            // SAFETY: as in `write`: the place's `len` bytes are this job's alone, and the parts
            // together are exactly that long, so each lands within it, after the one before.
            unsafe {
                std::ptr::copy_nonoverlapping(p.as_ptr(), self.ptr.cast::<u8>().add(at), p.len())
            };
            at += p.len();
        }
        true
    }

    /// Copies `bytes` into the place if they fill it exactly; true if they did.
    fn write(&mut self, bytes: &[u8]) -> bool {
        if bytes.len() != self.len {
            return false;
        }
        // SAFETY: the place's `len` bytes are this job's alone to write (see `Place::raw`, or
        // the borrowed slice it was made from), and `bytes` is exactly that long; a job's own
        // buffers never overlap its place.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.cast::<u8>(), self.len) };
        true
    }
}

thread_local! {
    /// A worker's zstd decompression context.
    static UNZSTD: RefCell<Option<zstd::bulk::Decompressor<'static>>> = const { RefCell::new(None) };
}

/// A literal alone's `payload` decompressed (zstd's, or LZ4's) into `out`, a buffer of exactly
/// `raw_len` bytes (the one given if it is that size: it becomes the cached chunk); false if it
/// does not rebuild exactly `raw_len` bytes.
pub(crate) fn unpack(zstd: bool, payload: &[u8], raw_len: usize, out: &mut Vec<u8>) -> bool {
    if out.capacity() != raw_len {
        *out = Vec::with_capacity(raw_len);
    }
    out.clear();
    if zstd {
        unzstd_into(payload, raw_len, out)
    } else {
        out.resize(raw_len, 0);
        lz4_flex::block::decompress_into(payload, out).is_ok_and(|n| n == raw_len)
    }
}

/// zstd of `payload` decompressed into `out`: true if it made exactly `raw_len` bytes (it may
/// not make more: the buffer holds no more).
fn unzstd_into(payload: &[u8], raw_len: usize, out: &mut Vec<u8>) -> bool {
    UNZSTD.with_borrow_mut(|z| {
        if z.is_none() {
            *z = zstd::bulk::Decompressor::new().ok();
        }
        let Some(d) = z.as_mut() else {
            return false;
        };
        out.clear();
        out.reserve_exact(raw_len);
        d.decompress_to_buffer(payload, out)
            .is_ok_and(|n| n == raw_len)
    })
}

/// LZ4 of `data` into `out` (grown, never shrunk or zeroed again); the compressed length.
pub(crate) fn lz4_into(data: &[u8], out: &mut Vec<u8>) -> Option<usize> {
    let need = lz4_flex::block::get_maximum_output_size(data.len());
    if out.len() < need {
        out.resize(need, 0);
    }
    lz4_flex::block::compress_into(data, &mut out[..need]).ok()
}

thread_local! {
    /// A worker's zstd context and its level: creating one per chunk costs more than compressing.
    static ZSTD: RefCell<Option<(i32, zstd::bulk::Compressor<'static>)>> = const { RefCell::new(None) };
}

/// zstd of `data` at `level` into `out` (cleared first), as a mirror's own context does it.
fn zstd_into(data: &[u8], level: i32, out: &mut Vec<u8>) -> bool {
    ZSTD.with_borrow_mut(|z| {
        if z.as_ref().is_none_or(|(l, _)| *l != level) {
            *z = zstd::bulk::Compressor::new(level).ok().map(|c| (level, c));
        }
        let Some((_, c)) = z.as_mut() else {
            return false;
        };
        out.clear();
        out.reserve(zstd::zstd_safe::compress_bound(data.len()));
        c.compress_to_buffer(data, out).is_ok()
    })
}

#[cfg(test)]
mod tests;
