//! A frame's context records fed ahead. A bulk stream's literals come out of its own zstd
//! context, one record after the other, and nothing in that needs the cache: so while the
//! decoder's thread rebuilds one stream's frame (references, the cache's inserts, in the order
//! the frames arrived), a worker feeds the next streams' frames to their contexts, and the
//! decoder's thread takes what they rebuilt (and the chunks' names) when it reaches them.
//! Several streams' contexts decompress at once; the records and what they rebuild are the
//! same as when they are fed in turn. A frame's literals alone are jobs any thread takes, and
//! a frame of literals alone needs nothing of its stream's context: it is fed even while the
//! stream's earlier frames wait, so one stream's frames decompress side by side too.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;

use super::Decoder;
use super::in_context::{Accept, classify, context_record};
use super::with_bases::{rebuild_ahead, run_head};
use crate::context::{Fed, LitFed, Piece, Run, RunFed, StreamContext};
use crate::delta::RecvScratch;
use crate::fingerprint::Fingerprint;
use crate::fingerprint::SHORT_CHECK;
use crate::fingerprint::fingerprint;
use crate::format::{
    TAG_DELTA, TAG_DELTA_RUN, TAG_DELTA_RUN_BARE, TAG_LIT, TAG_LIT_CONTEXT, TAG_LIT_LZ4,
    TAG_LIT_ZSTD, TAG_LOG, TAG_RAW, TAG_REF, TAG_REF_RUN, TAG_REF_RUN_SHORT, TAG_RUN_END, get_len,
    get_varint,
};
use crate::prepare::lock_soon;

/// A frame's records whose stream's context records are being fed ahead, with the stream's
/// context (out of its owner's hands until [`finish`](Feeding::finish)); and its delta runs
/// rebuilt ahead, those whose bases the cache held when it was fed by the feeding itself, the
/// others once the frames before it bring their bases ([`Decoder::rebuild_later`]).
pub struct Feeding {
    /// Its walk, with the stream's context; none for a frame whose literals alone are fed (see
    /// [`Decoder::feed_literals`]).
    feed: Option<Arc<Mutex<Feed>>>,
    /// Its literals alone, each decompressed by whoever takes it (a frame without context
    /// records; see [`LitJobs`]).
    lits: Option<Arc<LitJobs>>,
    /// True once it was handed to the workers (else its literals are left to the batches).
    spawned: AtomicBool,
    /// Fed behind its stream's earlier frame (see [`Decoder::feed_after`]).
    chained: bool,
    /// True once a later frame's feeding was made behind it: once its context records are all
    /// fed, the context is that feeding's, even if it is finished first.
    followed: Arc<AtomicBool>,
    records: Bytes,
    /// The decoder that fed it (see [`Decoder::rebuild_later`]).
    decoder: u64,
    later: Mutex<Later>,
}

/// A feeding's delta runs whose bases were not at hand when it was fed: their offsets in the
/// frame, the bytes of bases held for those rebuilt since, and their jobs.
struct Later {
    runs: Vec<usize>,
    held: usize,
    jobs: Vec<Arc<Mutex<LateRun>>>,
    verify: bool,
    scratch: Arc<Mutex<Vec<RecvScratch>>>,
}

/// A delta run rebuilt after its frame was fed: its record (the frame from it on) and bases,
/// and what rebuilding it made, once it has run.
struct LateRun {
    at: usize,
    rec: Bytes,
    bases: Vec<(Fingerprint, Bytes)>,
    verify: bool,
    scratch: Arc<Mutex<Vec<RecvScratch>>>,
    made: Option<Option<RunFed>>,
}

impl LateRun {
    fn run(&mut self) {
        if self.made.is_none() {
            let bases = std::mem::take(&mut self.bases);
            let made = with_scratch(&self.scratch, |d| {
                rebuild_ahead(&self.rec, self.at, bases, self.verify, d)
            });
            self.made = Some(made);
        }
    }
}

/// Runs `f` with scratch from `kept` (new if none is), kept again after (if few are).
fn with_scratch<T>(kept: &Mutex<Vec<RecvScratch>>, f: impl FnOnce(&mut RecvScratch) -> T) -> T {
    let mut d = kept
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .pop()
        .unwrap_or_default();
    let made = f(&mut d);
    d.dict.clear();
    d.dict.shrink_to(crate::format::RUN_DICT);
    let mut kept = kept.lock().unwrap_or_else(|p| p.into_inner());
    if kept.len() < SCRATCH_KEPT {
        kept.push(d);
    }
    made
}

/// Decoders made so far: each one's number, which its feedings carry.
static DECODERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A new decoder's number (see [`Feeding`]).
pub(super) fn decoder_number() -> u64 {
    DECODERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

struct Feed {
    records: Bytes,
    announced: usize,
    stream: StreamContext,
    /// True while it holds its stream's context (in `stream`).
    holds: bool,
    /// See [`Feeding::followed`].
    followed: Arc<AtomicBool>,
    /// The stream's earlier frame's feed, to take the context from (see
    /// [`Decoder::feed_after`]) before its walk.
    after: Option<Arc<Mutex<Feed>>>,
    accept: Accept,
    done: bool,
    /// True once its walk reached the frame's end: every context record fed.
    whole: bool,
    /// Whether it names the cached chunks of the runs it rebuilds (else the decoder's thread
    /// does, when it takes them).
    name: bool,
    /// Its literals alone are [`LitJobs`], not decompressed in the walk.
    lit_jobs: bool,
    /// Its delta runs to rebuild, in order, whether each base is checked against its name
    /// first, and the decoder's scratch for them.
    runs: VecDeque<RunBases>,
    verify: bool,
    scratch: Arc<Mutex<Vec<RecvScratch>>>,
}

impl std::fmt::Debug for Feeding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Feeding").finish_non_exhaustive()
    }
}

fn lock(m: &Mutex<Feed>) -> MutexGuard<'_, Feed> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Decoder {
    /// Starts feeding the context records of a frame's `records` (the whole frame, which
    /// announced `announced` raw bytes) to `stream`'s context ahead of decoding it, if it holds
    /// any: the context is the feeding's until [`Feeding::finish`] gives it back, which must
    /// come before the frame is decoded ([`decode_frame`](Self::decode_frame) takes what was
    /// fed, record by record). A frame with literals alone and neither context records nor
    /// delta runs is fed as [`feed_literals`](Self::feed_literals) feeds it, `stream` left as it
    /// is ([`Feeding::holds_context`] says which). `None` (and `stream` left as it is) for a
    /// frame with nothing to feed before anything the feeding cannot step over, or a stream
    /// whose records fed before are not all taken yet.
    pub fn feed_ahead(
        &self,
        records: Bytes,
        stream: &mut StreamContext,
        announced: usize,
    ) -> Option<Feeding> {
        if !stream.fed.is_empty() || !stream.lits_fed.is_empty() {
            return None;
        }
        let (runs, later, held) = self.runs_to_rebuild(&records);
        let lits = match stream.run.is_empty() {
            true => self.literal_jobs(&records, announced),
            false => None,
        };
        if runs.is_empty() && later.is_empty() && lits.is_some() {
            return lits.map(|l| self.literals_only(records, l));
        }
        if runs.is_empty() && later.is_empty() && lits.is_none() && !worth_feeding(&records) {
            return None;
        }
        // Runs rebuilt ahead of an earlier frame and not taken: its records were not decoded
        // that far after all (they are rebuilt in order if they come).
        stream.runs_fed.clear();
        let from = (std::mem::take(stream), None);
        Some(self.feeding(records, announced, from, lits, (runs, later, held), true))
    }

    /// Starts feeding a frame's context records as [`feed_ahead`](Self::feed_ahead) does,
    /// right behind the stream's last frame fed ahead that holds its context (`earlier`, which
    /// is not finished yet): the context passes from that feeding to this one once it has fed
    /// every context record of its frame, on whichever thread walks this frame (which walks
    /// the earlier one first if nobody has). If it has not (damage, or a record it cannot step
    /// over), this frame is fed nothing and decoded in turn. So one stream's frames are fed one
    /// after the other on the workers, as many as wait, while the decoder's thread decodes
    /// those before them. Without `name`, the feeding leaves naming the chunks it rebuilds to
    /// the decoder's thread (for a thread with no other streams' frames to decode meanwhile:
    /// the context's decompression, which only one thread can do, is then all the worker
    /// does). `None` if `earlier` holds no context, or the frame has nothing to feed.
    pub fn feed_after(
        &self,
        earlier: &Feeding,
        records: Bytes,
        announced: usize,
        name: bool,
    ) -> Option<Feeding> {
        let prev = earlier.feed.clone()?;
        let (runs, later, held) = self.runs_to_rebuild(&records);
        if runs.is_empty() && later.is_empty() && !worth_feeding(&records) {
            return None;
        }
        earlier.followed.store(true, Ordering::Relaxed);
        let from = (StreamContext::default(), Some(prev));
        Some(self.feeding(records, announced, from, None, (runs, later, held), name))
    }

    /// A feeding of `records` with its stream's context (`from`: the stream's own, or the
    /// earlier frame's feed to take it from), its literal jobs, its delta runs to rebuild
    /// ahead and later.
    fn feeding(
        &self,
        records: Bytes,
        announced: usize,
        (stream, after): (StreamContext, Option<Arc<Mutex<Feed>>>),
        lits: Option<LitJobs>,
        (runs, later, held): (VecDeque<RunBases>, Vec<usize>, usize),
        name: bool,
    ) -> Feeding {
        let verify = self.cache.verifies_memory();
        let chained = after.is_some();
        let followed = Arc::new(AtomicBool::new(false));
        let feed = Feed {
            records: records.clone(),
            announced,
            stream,
            holds: !chained,
            followed: Arc::clone(&followed),
            after,
            accept: self.accept.clone(),
            done: false,
            whole: false,
            name,
            lit_jobs: lits.is_some(),
            runs,
            verify,
            scratch: Arc::clone(&self.scratch_ahead),
        };
        Feeding {
            feed: Some(Arc::new(Mutex::new(feed))),
            lits: lits.map(Arc::new),
            spawned: AtomicBool::new(false),
            chained,
            followed,
            records,
            decoder: self.number,
            later: Mutex::new(Later {
                runs: later,
                held,
                jobs: Vec::new(),
                verify,
                scratch: Arc::clone(&self.scratch_ahead),
            }),
        }
    }

    /// Starts decompressing (and naming) the literals alone of a frame's `records` (the whole
    /// frame, which announced `announced` raw bytes) ahead of decoding it, without its stream's
    /// context: while the stream's earlier frames wait to be decoded (fed ahead themselves, or
    /// not). [`Feeding::finish`] hands them to the stream, after the earlier frames' and
    /// before the frame is decoded; each is taken only by the record whose very payload it was
    /// made from. `None` for a frame with context records (fed in order, with the literals
    /// between them) or without literals alone.
    pub fn feed_literals(&self, records: Bytes, announced: usize) -> Option<Feeding> {
        let lits = self.literal_jobs(&records, announced)?;
        Some(self.literals_only(records, lits))
    }

    fn literals_only(&self, records: Bytes, lits: LitJobs) -> Feeding {
        Feeding {
            feed: None,
            lits: Some(Arc::new(lits)),
            spawned: AtomicBool::new(false),
            chained: false,
            followed: Arc::default(),
            records,
            decoder: self.number,
            later: Mutex::new(Later {
                runs: Vec::new(),
                held: 0,
                jobs: Vec::new(),
                verify: false,
                scratch: Arc::clone(&self.scratch_ahead),
            }),
        }
    }

    /// Has `workers` rebuild the delta runs of a frame this decoder fed (`feeding`) whose bases
    /// were not at hand when it was fed and are now (the frames decoded since brought them),
    /// while the frames before it are decoded. Call it after each frame decoded while later
    /// ones are fed; a feeding another decoder fed is left as it is.
    pub fn rebuild_later(&self, feeding: &Feeding, workers: &dyn crate::prepare::Workers) {
        if feeding.decoder != self.number {
            return;
        }
        let mut later = feeding.later.lock().unwrap_or_else(|p| p.into_inner());
        let Later {
            runs,
            held,
            jobs,
            verify,
            scratch,
        } = &mut *later;
        runs.retain(|&at| {
            let Some(rec) = feeding.records.get(at..) else {
                return false;
            };
            let Some(bases) = self.run_bases(rec) else {
                return true;
            };
            *held += bases.iter().map(|b| b.1.len()).sum::<usize>();
            if *held > HELD_AHEAD {
                return false;
            }
            let job = Arc::new(Mutex::new(LateRun {
                at,
                rec: feeding.records.slice(at..),
                bases,
                verify: *verify,
                scratch: Arc::clone(scratch),
                made: None,
            }));
            let run = Arc::clone(&job);
            workers.spawn(Box::new(move || {
                if let Ok(mut r) = run.try_lock() {
                    r.run();
                }
            }));
            jobs.push(job);
            false
        });
    }

    /// The bases of the delta run record at the front of `rec`, if every one is named (by
    /// name, or by a place our log holds) and held in memory: each with its name, in the
    /// record's order. `None` also for a record whose head does not read.
    fn run_bases(&self, rec: &[u8]) -> Option<Vec<(Fingerprint, Bytes)>> {
        let head = run_head(rec, Some(&self.logs)).ok()?;
        if head.unresolved {
            return None;
        }
        head.names[..head.nb]
            .iter()
            .map(|f| Some((*f, self.cache.in_memory_handle(f)?)))
            .collect()
    }

    /// The delta runs among `records` (up to the first record [`Feed::run`] cannot step over,
    /// [`RUNS_AHEAD`] at most): those whose bases the cache holds in memory now (by name or by a
    /// place our log holds), each with its offset in `records` and its bases, in the record's
    /// order; the offsets of the others, to rebuild once their bases come
    /// ([`rebuild_later`](Self::rebuild_later)); and the bytes of bases held.
    fn runs_to_rebuild(&self, records: &[u8]) -> (VecDeque<RunBases>, Vec<usize>, usize) {
        let (mut runs, mut later) = (VecDeque::new(), Vec::new());
        let (mut at, mut held) = (0, 0usize);
        while let Some(&first) = records.get(at)
            && runs.len() + later.len() < RUNS_AHEAD
            && held <= HELD_AHEAD
        {
            let rec = &records[at..];
            let tag = classify(first, false).0;
            if matches!(tag, TAG_DELTA_RUN | TAG_DELTA_RUN_BARE) {
                match self.run_bases(rec) {
                    Some(bases) => {
                        held += bases.iter().map(|b| b.1.len()).sum::<usize>();
                        runs.push_back((at, bases));
                    }
                    None => later.push(at),
                }
            }
            match step(tag, rec) {
                Some((len, _)) => at += len,
                None => break,
            }
        }
        (runs, later, held)
    }

    /// The literals alone among `records` (which announced `announced` raw bytes), up to the
    /// first record [`Feed::run`] cannot step over or that rebuilds more than is left of the
    /// frame ([`LITS_AHEAD`] at most), as jobs that any thread may run; `None` for a frame with
    /// context records (fed in order, with the literals between them) or without literals.
    fn literal_jobs(&self, records: &Bytes, announced: usize) -> Option<LitJobs> {
        let (mut at, mut room, mut jobs) = (0usize, announced, Vec::new());
        while let Some(&first) = records.get(at)
            && jobs.len() < LITS_AHEAD
        {
            let tag = classify(first, false).0;
            if matches!(tag, TAG_LIT_CONTEXT | TAG_RUN_END) {
                return None;
            }
            let Some((len, rebuilt)) = step(tag, &records[at..]) else {
                break;
            };
            let Some(left) = room.checked_sub(rebuilt) else {
                break;
            };
            room = left;
            if matches!(tag, TAG_LIT_LZ4 | TAG_LIT_ZSTD) {
                let Some(clen) = literal_payload(&records[at..]) else {
                    break;
                };
                jobs.push(Mutex::new(LitJob {
                    first,
                    zstd: tag == TAG_LIT_ZSTD,
                    raw: rebuilt,
                    cached: classify(first, self.accept.dedup).1,
                    payload: records.slice(at + len - clen..at + len),
                    made: Made::Todo,
                }));
            }
            at += len;
        }
        (!jobs.is_empty()).then(|| LitJobs {
            left: AtomicUsize::new(jobs.len()),
            jobs,
        })
    }
}

/// A frame's literals alone, decompressed and named ahead of its turn by whoever takes each:
/// the workers from the last back, the decoder's thread from the first on when the frame's
/// turn comes (taking each in order, or waiting for the worker running it), so that the two
/// work apart until they meet and neither waits for the other's whole frame.
struct LitJobs {
    jobs: Vec<Mutex<LitJob>>,
    /// Jobs no worker has taken yet: the first `left`.
    left: AtomicUsize,
}

struct LitJob {
    first: u8,
    zstd: bool,
    /// The bytes it rebuilds, as its header says.
    raw: usize,
    /// Whether its chunk is cached (and so named).
    cached: bool,
    payload: Bytes,
    made: Made,
}

enum Made {
    Todo,
    /// Its chunk, or `None` if the payload did not rebuild exactly its bytes.
    Done(Option<Piece>),
    /// Handed to the stream.
    Taken,
}

impl LitJob {
    fn run(&mut self) {
        if matches!(self.made, Made::Todo) {
            // Allocated here, by the thread that runs it, not by the decoder's thread when it
            // handed the frame over: a first copy's chunks are fresh memory, and their page
            // faults were the largest part of what the decoder's thread kept to itself
            // (crates/codec/PARALLEL.md, "What is left").
            let mut bytes = Vec::new();
            let ok = crate::prepare::unpack(self.zstd, &self.payload, self.raw, &mut bytes);
            self.made = Made::Done(ok.then(|| Piece {
                cached: self.cached,
                name: self.cached.then(|| fingerprint(&bytes)),
                bytes: Bytes::from(bytes),
            }));
        }
    }
}

impl LitJobs {
    /// Runs the jobs nobody has taken, from the last back (a worker).
    fn work(&self) {
        while self.work_one() {}
    }

    /// Takes the last job nobody has taken and runs it; false when none was left.
    fn work_one(&self) -> bool {
        let Ok(n) = self
            .left
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
        else {
            return false;
        };
        // Held elsewhere: by the decoder's thread, which runs it if nobody has.
        if let Some(Ok(mut j)) = self.jobs.get(n - 1).map(Mutex::try_lock) {
            j.run();
        }
        true
    }

    /// True once a job was taken from the back (by a worker, or by the decoder's thread
    /// helping while a worker feeds an earlier frame).
    fn started(&self) -> bool {
        self.left.load(Ordering::Relaxed) < self.jobs.len()
    }

    /// Every job's chunk, in order, to `into`: each run here if no worker has taken it, else
    /// once the worker running it is done; up to the first that did not rebuild (the decoder
    /// decompresses that literal, and every one after it, itself).
    fn take_all(&self, into: &mut VecDeque<LitFed>) {
        for m in &self.jobs {
            let mut j = lock_soon(m);
            j.run();
            match std::mem::replace(&mut j.made, Made::Taken) {
                Made::Done(Some(piece)) => into.push_back(LitFed {
                    first: j.first,
                    payload: j.payload.clone(),
                    piece,
                }),
                _ => break,
            }
        }
        self.left.store(0, Ordering::Relaxed);
    }

    /// Lets the jobs go: no worker takes any from now on.
    fn cancel(&self) {
        self.left.store(0, Ordering::Relaxed);
    }
}

/// Delta runs a frame's feeding rebuilds ahead, at most: their bases are held (not copied)
/// until then, and what they rebuild is within the frame's announced bytes.
const RUNS_AHEAD: usize = 64;

/// Bytes of bases a frame's feeding holds for its runs, at most (the cache's own chunks, kept
/// from being freed if they are evicted before the feeding is done).
const HELD_AHEAD: usize = 4 * crate::format::RUN_DICT_DECODE;

/// Literals alone a frame's feeding decompresses ahead, at most (a frame of 512 KiB holds about
/// 64 chunks; the rest of a frame of tiny literals is left to the batches).
const LITS_AHEAD: usize = 1024;

/// Scratch for delta runs rebuilt ahead kept for the next feedings, at most.
const SCRATCH_KEPT: usize = 4;

/// A delta run to rebuild ahead: its record's offset in the frame, and its bases (names and
/// the bytes the cache held when the frame was fed).
type RunBases = (usize, Vec<(Fingerprint, Bytes)>);

impl crate::prepare::Deferred for Feeding {
    /// Has `workers` feed the frame.
    fn spawn(&self, workers: &dyn crate::prepare::Workers) {
        let feed = self.feed.clone();
        let lits = self.lits.clone();
        self.spawned.store(true, Ordering::Relaxed);
        workers.spawn(Box::new(move || {
            if let Some(Ok(mut f)) = feed.as_deref().map(Mutex::try_lock) {
                f.run(true);
            }
            if let Some(l) = lits {
                l.work();
            }
        }));
    }

    /// True while a worker feeds the frame's context records (or walks it).
    fn busy(&self) -> bool {
        self.feed.as_deref().is_some_and(|f| f.try_lock().is_err())
    }

    /// Feeds the frame here if no worker has started on it (while a worker feeds an earlier
    /// one); once it is fed, decompresses one of its literals alone that nobody has taken.
    fn help(&self) -> bool {
        match self.feed.as_deref().map(Mutex::try_lock) {
            // Not a frame behind one a worker is feeding: that would wait for it.
            Some(Ok(mut f)) if !f.done && f.after_free() => {
                f.run(true);
                true
            }
            _ => self.lits.as_ref().is_some_and(|l| l.work_one()),
        }
    }

    /// A frame's literals alone, fed without its stream's context, go to the workers even
    /// right after the same stream's frame: they need nothing of it; so does a frame fed while
    /// its stream's earlier one is decoded.
    fn alone(&self) -> bool {
        self.feed.is_none() || self.chained
    }
}

impl Feeding {
    /// True if it holds its stream's context (from [`Decoder::feed_ahead`] until
    /// [`finish`](Self::finish)).
    pub fn holds_context(&self) -> bool {
        self.feed.is_some()
    }

    /// True if it was fed behind its stream's earlier frame ([`Decoder::feed_after`]): it
    /// holds the context only if the frames before it need nothing of it, and those are
    /// decoded without waiting for it.
    pub fn follows(&self) -> bool {
        self.chained
    }

    /// Hands the frame's feeding to its stream (`stream`, whose earlier frames are decoded):
    /// the stream's context back, if the feeding holds it (a later frame's feeding may have
    /// taken it on, see [`Decoder::feed_after`]), its frame fed (here, if no worker did; else
    /// once the worker is done), what it fed behind what the stream's earlier frames were fed;
    /// its literals alone fed, after those of the stream's earlier frames still waiting. True
    /// if the frame needs nothing more of the context: every context record of it fed, or no
    /// context held.
    pub fn finish(self, stream: &mut StreamContext) -> bool {
        let mut whole = true;
        // The earlier frames' runs fed (chained, not all taken yet) stay before this one's.
        let runs_before = stream.runs_fed.len();
        if let Some(feed) = &self.feed {
            let mut f = lock_soon(feed);
            // Fed here now, it is decoded next: its literals are left to the decoding batches,
            // which the workers help with.
            f.run(false);
            whole = f.whole;
            // The context, unless a later frame's feeding took it or will: this frame needs
            // nothing more of it then, and that feeding is finished after this one.
            let keep = whole && f.followed.load(Ordering::Relaxed);
            let mut fed = std::mem::take(&mut f.stream);
            if keep {
                f.stream.dctx = fed.dctx.take();
                f.stream.run = std::mem::take(&mut fed.run);
                f.stream.run_bytes = std::mem::take(&mut fed.run_bytes);
            } else if std::mem::replace(&mut f.holds, false) {
                stream.dctx = fed.dctx;
                stream.run = fed.run;
                stream.run_bytes = fed.run_bytes;
            }
            stream.log = fed.log.or(stream.log);
            stream.fed.extend(fed.fed);
            stream.runs_fed.extend(fed.runs_fed);
            stream.lits_fed.extend(fed.lits_fed);
        }
        // Its literals alone: taken in order (here, those nobody has) if it was handed to the
        // workers or helped with, else left to the decoding batches too.
        if let Some(l) = &self.lits {
            match self.spawned.load(Ordering::Relaxed) || l.started() {
                true => l.take_all(&mut stream.lits_fed),
                false => l.cancel(),
            }
        }
        // Its runs rebuilt since it was fed (here, if no worker has begun one), in order.
        let later = self.later.into_inner().unwrap_or_else(|p| p.into_inner());
        if !later.jobs.is_empty() {
            for job in later.jobs {
                let mut r = lock_soon(&job);
                r.run();
                // Left made (with nothing), so that a worker coming to it later skips it.
                if let Some(Some(run)) = r.made.replace(None) {
                    stream.runs_fed.push_back(run);
                }
            }
            stream.runs_fed.make_contiguous()[runs_before..].sort_by_key(|r| r.at);
        }
        whole
    }
}

impl Feed {
    /// True unless it is behind an earlier frame's feed that a thread holds.
    fn after_free(&self) -> bool {
        self.after.as_deref().is_none_or(|p| p.try_lock().is_ok())
    }

    /// Walks the frame's records: each context record is fed (a run, once whole, named too),
    /// with `literals` each literal alone decompressed (and named, if it is cached), the others
    /// stepped over by their headers, counting what they rebuild against what the frame
    /// announced. It stops at the first record it cannot step over that way (damage, or any
    /// other record inside an open run): the decoder's thread feeds the context records from
    /// there, and decompresses the literals.
    fn run(&mut self, literals: bool) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        // Behind an earlier frame: its context, once that frame's context records are all
        // fed (its walk here first if nobody has walked it). Later frames only ever lock
        // earlier ones while they hold their own, so two threads never wait for each other.
        if let Some(prev) = self.after.take() {
            let mut p = lock(&prev);
            p.run(literals);
            if p.whole && std::mem::replace(&mut p.holds, false) {
                self.stream.dctx = p.stream.dctx.take();
                self.stream.run = std::mem::take(&mut p.stream.run);
                self.stream.run_bytes = std::mem::take(&mut p.stream.run_bytes);
                self.holds = true;
            }
        }
        if !self.holds {
            return;
        }
        let (buf, stream) = (&self.records[..], &mut self.stream);
        let (mut at, mut room) = (0usize, self.announced);
        while let Some(&first) = buf.get(at) {
            let rec = &buf[at..];
            let (tag, _, _) = classify(first, false);
            if matches!(tag, TAG_LIT_CONTEXT | TAG_RUN_END) {
                let open_before = !stream.run.is_empty();
                let result = context_record(first, rec, stream, room, &self.accept);
                let (used, ok) = match &result {
                    Ok((used, run)) => {
                        let made = run.as_ref().map_or(0, |r| r.bytes.len());
                        room -= made.min(room);
                        (*used, true)
                    }
                    Err(_) => (0, false),
                };
                let name = self.name;
                let result = result.map(|(_, run)| run.map(|r| pieces(r, stream, name)));
                stream.fed.push_back(Fed {
                    first,
                    used,
                    open_before,
                    result,
                });
                if !ok {
                    return;
                }
                at += used;
                continue;
            }
            if !stream.run.is_empty() {
                return;
            }
            let Some((len, rebuilt)) = step(tag, rec) else {
                return;
            };
            let Some(left) = room.checked_sub(rebuilt) else {
                return;
            };
            room = left;
            if literals && !self.lit_jobs && matches!(tag, TAG_LIT_LZ4 | TAG_LIT_ZSTD) {
                let Some(clen) = literal_payload(rec) else {
                    return;
                };
                let payload = self.records.slice(at + len - clen..at + len);
                let mut bytes = Vec::new();
                if !crate::prepare::unpack(tag == TAG_LIT_ZSTD, &payload, rebuilt, &mut bytes) {
                    return;
                }
                let cached = classify(first, self.accept.dedup).1;
                stream.lits_fed.push_back(LitFed {
                    first,
                    payload,
                    piece: Piece {
                        cached,
                        name: cached.then(|| fingerprint(&bytes)),
                        bytes: Bytes::from(bytes),
                    },
                });
            }
            if self.runs.front().is_some_and(|r| r.0 == at)
                && let Some((_, bases)) = self.runs.pop_front()
            {
                let verify = self.verify;
                let made =
                    with_scratch(&self.scratch, |d| rebuild_ahead(rec, at, bases, verify, d));
                stream.runs_fed.extend(made);
            }
            at += len;
        }
        self.whole = true;
    }
}

/// True if a context record or a literal alone comes before the first record that
/// [`Feed::run`] cannot step over.
fn worth_feeding(records: &[u8]) -> bool {
    let mut at = 0;
    while let Some(&first) = records.get(at) {
        let tag = classify(first, false).0;
        if matches!(tag, TAG_LIT_CONTEXT | TAG_LIT_LZ4 | TAG_LIT_ZSTD) {
            return true;
        }
        match step(tag, &records[at..]) {
            Some((len, _)) => at += len,
            None => return false,
        }
    }
    false
}

/// A run's chunks, each in a buffer of its own (the one the cache keeps) and named if it is
/// cached; the run's buffer goes back to `stream` for its next run.
fn pieces(run: Run, stream: &mut StreamContext, name: bool) -> Vec<Piece> {
    let Run { mut bytes, chunks } = run;
    let mut off = 0usize;
    let pieces = chunks
        .iter()
        .map(|&(len, cached)| {
            // The run's bytes are its chunks' (`context_record` fed exactly their sum).
            let chunk = bytes.get(off..off.saturating_add(len)).unwrap_or_default();
            off = off.saturating_add(len);
            Piece {
                bytes: Bytes::copy_from_slice(chunk),
                cached,
                name: (cached && name).then(|| fingerprint(chunk)),
            }
        })
        .collect();
    bytes.clear();
    stream.run_bytes = bytes;
    pieces
}

/// The length of the record at the front of `rec`, whose first byte is `first`, from its
/// header alone (see [`step`]).
#[cfg(test)]
pub(crate) fn record_len(first: u8, rec: &[u8]) -> Option<usize> {
    step(classify(first, false).0, rec).map(|s| s.0)
}

/// The length of a record with tag `tag` (its flags off) at the front of `rec`, and the bytes
/// it rebuilds, from its header alone; `None` for a record whose header does not say, or
/// that is not whole.
fn step(tag: u8, rec: &[u8]) -> Option<(usize, usize)> {
    let (len, rebuilt) = match tag {
        TAG_LIT_CONTEXT => {
            let (n, h1) = get_len(rec, 1).ok()?;
            let (c, h2) = get_len(rec, 1 + h1).ok()?;
            (1 + h1 + h2 + c, n)
        }
        TAG_RUN_END => {
            let (c, h) = get_len(rec, 1).ok()?;
            (1 + h + c, 0)
        }
        TAG_RAW | TAG_LIT => {
            let (n, h) = get_len(rec, 1).ok()?;
            (1 + h + n, n)
        }
        TAG_REF => {
            let (n, h) = get_len(rec, 17).ok()?;
            (17 + h, n)
        }
        TAG_LIT_LZ4 | TAG_LIT_ZSTD => {
            let (n, h1) = get_len(rec, 1).ok()?;
            let (c, h2) = get_len(rec, 1 + h1).ok()?;
            (1 + h1 + h2 + c, n)
        }
        TAG_LOG => (1 + get_varint(rec, 1).ok()?.1, 0),
        TAG_DELTA => {
            let (n, h) = get_len(rec, 1).ok()?;
            let bases = usize::from(*rec.get(1 + h)?);
            let at = 2 + h + 16 * (bases + 1);
            let (c, h2) = get_len(rec, at).ok()?;
            (at + h2 + c, n)
        }
        TAG_DELTA_RUN | TAG_DELTA_RUN_BARE => delta_run(rec)?,
        // What a reference run rebuilds is in the cache: counted as nothing here (the
        // decoder's thread checks each run fed against what is left of the frame).
        TAG_REF_RUN | TAG_REF_RUN_SHORT => {
            let mut at = 1;
            for _ in 0..3 {
                at += get_varint(rec, at).ok()?.1;
            }
            let check = if tag == TAG_REF_RUN { 16 } else { SHORT_CHECK };
            (at + check, 0)
        }
        _ => return None,
    };
    (len <= rec.len()).then_some((len, rebuilt))
}

/// The length of the payload of the literal alone at the front of `rec` (which [`step`] read
/// whole): what follows its two lengths.
fn literal_payload(rec: &[u8]) -> Option<usize> {
    let (_, h1) = get_len(rec, 1).ok()?;
    let (c, _) = get_len(rec, 1 + h1).ok()?;
    Some(c)
}

/// A delta run's length and the bytes it rebuilds, from its header (see
/// `Decoder::decode_delta_run`, which checks its counts).
fn delta_run(rec: &[u8]) -> Option<(usize, usize)> {
    let n = usize::from(*rec.get(1)?);
    let bases = usize::from(*rec.get(2)?);
    let mut at = 3;
    for _ in 0..bases {
        let (v, h) = get_varint(rec, at).ok()?;
        at += h;
        if v == 0 {
            at += 16;
        } else if v % 2 == 0 {
            at += get_varint(rec, at).ok()?.1;
        }
    }
    let mut rebuilt = 0usize;
    for _ in 0..n {
        let (l, h) = get_len(rec, at).ok()?;
        at += h;
        rebuilt = rebuilt.checked_add(l)?;
    }
    at += 16;
    let (c, h) = get_len(rec, at).ok()?;
    Some((at + h + c, rebuilt))
}

/// Frames whose context records are being fed ahead, oldest first, each with its owner's key
/// (a stream), finished ([`Feeding::finish`]) in the order they arrived, for the frames to be
/// decoded in that order.
pub type Feeds<K> = crate::prepare::InTurn<K, Feeding>;

#[cfg(test)]
mod tests {
    use super::*;

    /// A literal fed ahead is decompressed and named by whichever thread runs its job, into a
    /// buffer of its own (the chunk the cache keeps); a payload that does not rebuild its bytes
    /// makes no chunk. LZ4 and zstd alone.
    #[test]
    fn a_literal_fed_ahead_rebuilds_and_names_its_chunk_on_the_thread_that_runs_it() {
        let raw = crate::testdata::rows(3, 2);
        let job = |zstd: bool, payload: Vec<u8>| {
            Mutex::new(LitJob {
                first: if zstd { TAG_LIT_ZSTD } else { TAG_LIT_LZ4 },
                zstd,
                raw: raw.len(),
                cached: true,
                payload: Bytes::from(payload),
                made: Made::Todo,
            })
        };
        let zstd = |b: &[u8]| zstd::bulk::compress(b, 3).unwrap_or_default();
        let jobs = [
            (job(false, lz4_flex::block::compress(&raw)), true),
            (job(false, lz4_flex::block::compress(&raw[1..])), false),
            (job(true, zstd(&raw)), true),
            (job(true, zstd(&raw[1..])), false),
        ];
        std::thread::scope(|s| {
            s.spawn(|| {
                for (j, _) in &jobs {
                    j.lock().map(|mut j| j.run()).ok();
                }
            });
        });
        for (j, good) in jobs {
            let made = j.into_inner().map(|j| j.made).ok();
            match made {
                Some(Made::Done(Some(piece))) if good => {
                    assert!(piece.bytes[..] == raw[..]);
                    assert_eq!(piece.name, Some(fingerprint(&raw)));
                }
                Some(Made::Done(None)) if !good => {}
                _ => panic!("a good payload rebuilt nothing, or a bad one rebuilt a chunk"),
            }
        }
    }
}
