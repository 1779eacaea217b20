//! The codec's worker threads: one pool per daemon that the links' mirrors prepare chunks on
//! (fingerprints, literals alone, delta anchors, the next turn's cut points; see
//! `wanopt_codec::prepare`) before or while encoding them in link order. The calling thread
//! works through the batch beside the pool's, so `limits.threads: N` is N threads encoding.

use std::collections::VecDeque;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;

use wanopt_codec::prepare::{Ahead, Idle, Job, Workers};

/// Jobs taken at a time: small enough to even out chunks that cost more (literals) and less
/// (references) across threads.
const PART: usize = 2;

/// A pool of `threads - 1` threads, plus the caller's. Whether the pool's threads make calls
/// faster is measured, not assumed, and without running the caller alone: each call with the
/// pool counts its wall time, and apart the CPU time the caller and the pool's threads spent on
/// it (their threads' CPU clocks), which is what the call would have cost the caller alone. The
/// pool is used while the one stays under the other by a margin ([`GAIN`]); on a host whose
/// cores are all busy, waking a pool thread waits for the scheduler and the caller waits for
/// jobs a preempted thread holds, and the wall time shows it: on the 2-core test VM, with both
/// daemons and the applications on it, the pool cost a loopback pair a sixth of its rate
/// (benches/README.md at 0a2ddc0). Two calls twice as slow as alone turn it off at once
/// ([`SLOWER`], [`STALLS`]); a judgement leaves its worst call out. While it is not used,
/// after [`HOLD_FIRST`] calls the next [`PROBE`] use it again to see, and after twice as many
/// each time it is turned down again, up to [`HOLD`]:
/// a judgement a moment's stall of an idle host turned (a VM's, a thread's first wakeup)
/// costs a few dozen calls, not hundreds. Calls with the pool come back to back, so nothing is
/// lost
/// to probing where the pool pays: the probe of the pool's first version ran a sixteenth of
/// the calls on the caller alone, a tenth of a first copy's time on two idle cores.
#[derive(Debug)]
pub struct Pool {
    pool: rayon::ThreadPool,
    threads: usize,
    /// Judges batches of jobs ([`Workers::run`]) and, apart, the jobs run ahead of an encoding
    /// caller ([`Workers::overlap`]): the two cost differently per job.
    judge: Mutex<Judge>,
    ahead: Mutex<Judge>,
    /// Counts the calls that woke the pool's threads, and the jobs handed to them
    /// ([`Workers::spawn`]): a thread lingers after a call (see
    /// [`LINGER`]) until the next comes.
    calls: Arc<AtomicU64>,
    /// Jobs handed to the pool to run on their own ([`Workers::spawn`]: a stream context's
    /// records) and not done yet: the threads they hold are no helpers to a call, which would
    /// otherwise wait for them to start.
    making: Arc<AtomicU64>,
    /// Work for later calls that threads take in their spare time ([`Workers::idle`]).
    idle: Arc<IdleWork>,
}

/// Work handed to the pool for its threads' spare time ([`Workers::idle`]): a bulk stream's
/// next turn's chunks, prepared while other streams' turns run. The newest is done first: its
/// chunks were just cut and fingerprinted, most likely on the pool's thread, and are still in
/// that core's cache, while the oldest's turn comes next and is prepared in it if not before.
/// Four streams on two threads (`codec --threads 2 --streams 4`, three interleaved runs of
/// five rounds) encoded at 1.75-1.87x of one thread newest first, against 1.53-1.77x oldest
/// first (LZ4), and 1.78-1.86x against 1.67-1.78x (zstd alone). At most [`IDLE_MOST`] pieces
/// of work wait; past that the oldest is let go (its owner does it).
#[derive(Default)]
struct IdleWork(Mutex<VecDeque<Arc<dyn Idle>>>);

/// Pieces of work for the threads' spare time that wait at most (a stream hands over one at a
/// time, so this many bulk streams' next turns).
const IDLE_MOST: usize = 64;

impl std::fmt::Debug for IdleWork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdleWork").finish_non_exhaustive()
    }
}

impl IdleWork {
    fn push(&self, work: Arc<dyn Idle>) {
        let mut q = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if q.len() >= IDLE_MOST {
            q.pop_front();
        }
        q.push_back(work);
    }

    /// Does one piece of the newest work with any left; false if none has.
    fn one(&self) -> bool {
        loop {
            let Some(w) = self
                .0
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .back()
                .cloned()
            else {
                return false;
            };
            if w.work_one() {
                return true;
            }
            // Nothing left in it: it goes (unless another thread saw so first).
            let mut q = self.0.lock().unwrap_or_else(|p| p.into_inner());
            if q.back().is_some_and(|f| Arc::ptr_eq(f, &w)) {
                q.pop_back();
            }
        }
    }
}

/// Calls a judgement of the pool takes.
const PROBE: u32 = 16;
/// Calls without the pool before the next probe, after the pool was turned down once, and
/// at most (after it was turned down again and again: a busy host).
const HOLD_FIRST: u32 = 16;
const HOLD: u32 = 256;
/// The pool is used while a call's wall time with it is at most this share of the CPU time it
/// took (what the caller alone would have spent).
const GAIN: f64 = 0.85;
/// The same for jobs run ahead of an encoding caller ([`Workers::overlap`]): no batch ends
/// with the caller waiting for the pool there, and a stream context's turns gain 16-18% with
/// the pool on two idle cores (`codec --threads 2`), which [`GAIN`] would turn down.
const GAIN_AHEAD: f64 = 0.94;

/// How much slower than alone (wall time against CPU time) a call with the pool may run before
/// it counts as stalled: [`STALLS`] such calls turn the pool off without waiting for the rest
/// of its calls.
const SLOWER: u32 = 2;
/// Stalled calls that end a judgement at once. One is not enough: a thread preempted once by
/// the kernel's own work (a VM's, a memory reclaimer's) stalls a call for a scheduler's slice
/// on an idle host too, and on the 2-core test VM one such call turned the pool off a few times
/// in every first copy (`codec --threads 2`). On a busy host nearly every call stalls.
const STALLS: u32 = 2;

/// How long a pool thread stays awake after its part of a call, for the next call to find it
/// so: a stream's turns come back to back while its client is ahead, a few dozen microseconds
/// apart, and waking a thread that had gone to sleep took 27 µs a turn on the 2-core test VM
/// (a tenth of a turn on the LZ4 path; `codec --threads 2`).
const LINGER: Duration = Duration::from_micros(200);

/// Where the pool's judge stands.
#[derive(Debug, Default)]
struct Judge {
    /// Calls left in the current stage.
    left: u32,
    /// Whether calls use the pool now.
    helped: bool,
    /// The current judgement's calls: wall time with the pool, and the CPU time spent on them,
    /// less the one call that came out worst (see [`Judge::done`]).
    wall: Duration,
    cpu: Duration,
    /// That call's wall and CPU time, and the calls that stalled ([`SLOWER`]).
    worst: Option<(Duration, Duration)>,
    stalls: u32,
    /// The share of the CPU time under which the pool is used.
    gain: f64,
    /// Calls without the pool after the next judgement that turns it down.
    hold: u32,
}

impl Judge {
    /// A judge that starts with a probe.
    fn new(gain: f64) -> Self {
        Judge {
            left: PROBE,
            helped: true,
            gain,
            hold: HOLD_FIRST,
            ..Judge::default()
        }
    }

    /// Counts a call: with the pool (`helped`), its wall time and the CPU time the caller and
    /// the pool's threads spent on it. Returns whether the calls after it use the pool, when
    /// that was judged again. A judgement leaves out its worst call (the most wall time over
    /// what the gain allows): one stall of an idle host does not turn the pool off, while a
    /// busy host's stalls are in every call.
    fn done(&mut self, helped: Option<(Duration, Duration)>) -> Option<bool> {
        if let Some(call) = helped {
            if call.0 > call.1 * SLOWER {
                self.stalls += 1;
            }
            // The call counts, or the worst so far does and this one takes its place.
            let over = |(w, c): (Duration, Duration)| w.as_secs_f64() - c.as_secs_f64() * self.gain;
            let (wall, cpu) = match self.worst {
                Some(worst) if over(worst) >= over(call) => call,
                worst => {
                    self.worst = Some(call);
                    worst.unwrap_or_default()
                }
            };
            self.wall += wall;
            self.cpu += cpu;
            // Calls twice as slow as alone, again and again: a pool thread waited for a core,
            // and the caller for it, a scheduler's slice at a time (milliseconds, where a
            // call's work takes tens of microseconds). Judged now: a probe's worth of such
            // calls would cost a short copy more than the copy.
            if self.stalls >= STALLS {
                self.left = 1;
            }
        }
        self.left = self.left.saturating_sub(1);
        if self.left > 0 {
            return None;
        }
        if self.helped {
            // Judged again every probe's worth of calls while the pool is used.
            self.helped = self.wall.as_secs_f64() <= self.cpu.as_secs_f64() * self.gain;
            self.left = if self.helped {
                self.hold = HOLD_FIRST;
                PROBE
            } else {
                let hold = self.hold;
                self.hold = (hold * 2).min(HOLD);
                hold
            };
        } else {
            // A probe: the next calls use the pool, and are judged.
            self.helped = true;
            self.left = PROBE;
        }
        self.wall = Duration::ZERO;
        self.cpu = Duration::ZERO;
        self.worst = None;
        self.stalls = 0;
        if !self.helped {
            TURNED_DOWN.inc();
        }
        Some(self.helped)
    }
}

/// The CPU time the calling thread has run (0 if the clock cannot be read).
fn thread_cpu() -> Duration {
    cpu_clock(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// The CPU time every thread of this process has run, in all (0 if the clock cannot be read):
/// what the codec bench weighs a pool's wall time against.
pub fn process_cpu() -> Duration {
    cpu_clock(libc::CLOCK_PROCESS_CPUTIME_ID)
}

/// The time of the CPU-time clock `clock`.
fn cpu_clock(clock: libc::clockid_t) -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the call's duration.
    let r = unsafe { libc::clock_gettime(clock, &raw mut ts) };
    if r != 0 {
        return Duration::ZERO;
    }
    Duration::new(
        u64::try_from(ts.tv_sec).unwrap_or(0),
        u32::try_from(ts.tv_nsec).unwrap_or(0),
    )
}

/// CPU time the pool's threads spent on a call, summed across them.
#[derive(Debug, Default)]
struct Spent(AtomicU64);

impl Spent {
    /// Runs `f`, counting the calling thread's CPU time.
    fn count(&self, f: impl FnOnce()) {
        let t = thread_cpu();
        f();
        let d = thread_cpu().saturating_sub(t);
        self.0.fetch_add(
            u64::try_from(d.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    fn total(&self) -> Duration {
        Duration::from_nanos(self.0.load(Ordering::Relaxed))
    }
}

impl Pool {
    /// A pool for `threads` encoding threads; `None` for one (the caller alone) or if the
    /// threads could not be started (then each chunk is prepared as it is encoded).
    pub fn start(threads: usize) -> Option<Arc<dyn Workers>> {
        if threads < 2 {
            return None;
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads - 1)
            .thread_name(|i| format!("wanopt-codec-{i}"))
            .build();
        match pool {
            Ok(pool) => Some(Arc::new(Pool {
                pool,
                threads,
                judge: Mutex::new(Judge::new(GAIN)),
                ahead: Mutex::new(Judge::new(GAIN_AHEAD)),
                calls: Arc::default(),
                making: Arc::default(),
                idle: Arc::default(),
            })),
            Err(e) => {
                tracing::warn!(error = %e, "codec worker threads could not start; encoding on one");
                None
            }
        }
    }

    /// Runs `caller` on the calling thread while `helpers` of the pool's threads run `helper`;
    /// returns the CPU time both spent (less the caller's waits for a job, see
    /// `wanopt_codec::prepare::spun`), then keeps the helpers awake for [`LINGER`] or until the
    /// next call. Whichever side is done first takes work for later calls ([`Workers::idle`])
    /// while the other finishes, a piece at a time; that work is not counted in the call's CPU
    /// time.
    fn helped(
        &self,
        helpers: usize,
        helper: &(dyn Fn() + Sync),
        caller: &mut dyn FnMut(),
    ) -> Duration {
        let call = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
        let spent = Spent::default();
        let busy = AtomicUsize::new(helpers);
        let t = thread_cpu();
        let spun = wanopt_codec::prepare::spun();
        let mut spare = Duration::ZERO;
        self.pool.in_place_scope(|s| {
            for _ in 0..helpers {
                s.spawn(|_| {
                    spent.count(helper);
                    busy.fetch_sub(1, Ordering::Release);
                    // Done with its part: it lingers at once (the caller does not wait for
                    // it), taking work for later calls while the caller finishes.
                    let calls = Arc::clone(&self.calls);
                    let idle = Arc::clone(&self.idle);
                    self.pool.spawn(move || linger(&calls, call, &idle));
                });
            }
            caller();
            if busy.load(Ordering::Acquire) > 0 {
                let t = thread_cpu();
                while busy.load(Ordering::Acquire) > 0 && self.idle.one() {}
                spare = thread_cpu().saturating_sub(t);
            }
        });
        // Time the caller spun for a job a pool thread held is no work the caller alone would
        // have done (see `wanopt_codec::prepare::spun`).
        let spun = wanopt_codec::prepare::spun().saturating_sub(spun);
        thread_cpu()
            .saturating_sub(t)
            .saturating_sub(spare)
            .saturating_sub(spun)
            + spent.total()
    }
}

/// Keeps a pool thread awake for [`LINGER`], or until a call or job after the `call`th comes;
/// meanwhile, and for as long as there is some, it does work for later calls (`idle`).
fn linger(calls: &AtomicU64, call: u64, idle: &IdleWork) {
    let t = Instant::now();
    while calls.load(Ordering::Relaxed) == call {
        if idle.one() {
            continue;
        }
        if t.elapsed() >= LINGER {
            break;
        }
        for _ in 0..64 {
            std::hint::spin_loop();
        }
    }
}

/// `limits.threads` of the process's pool, and 1 while the pool makes calls faster (see
/// [`Pool`]); the daemons register them with their metrics.
static THREADS: LazyLock<Gauge> = LazyLock::new(Gauge::default);
static IN_USE: LazyLock<Gauge> = LazyLock::new(Gauge::default);

/// The gauges of the process's pool: its threads, and whether it is in use.
pub fn gauges() -> (Gauge, Gauge) {
    (THREADS.clone(), IN_USE.clone())
}

/// Stream-context work the process's pool was handed to do on its own ([`Workers::spawn`]:
/// a turn's context records made, a frame fed to its stream's context; several bulk streams'
/// contexts at once).
static CONTEXT_TURNS: LazyLock<Counter> = LazyLock::new(Counter::default);

/// The count of turns and frames handed to the pool for their streams' contexts.
pub fn context_turns() -> Counter {
    CONTEXT_TURNS.clone()
}

/// Judgements that turned the process's pool down (see [`Pool`]): its calls cost at least what
/// the caller alone would have spent.
static TURNED_DOWN: LazyLock<Counter> = LazyLock::new(Counter::default);

/// The count of judgements that turned the pool down.
pub fn turned_down() -> Counter {
    TURNED_DOWN.clone()
}

/// The process's pool, started by the first daemon that asks, with its `threads`; the daemons
/// of one process (`wanoptd demo`, several configs) share it rather than start one each.
pub fn shared(threads: usize) -> Option<Arc<dyn Workers>> {
    static POOL: std::sync::OnceLock<Option<Arc<dyn Workers>>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        THREADS.set(i64::try_from(threads).unwrap_or(i64::MAX));
        Pool::start(threads)
    })
    .clone()
}

/// Runs a call on the pool or alone, as `judge` says, and counts it.
fn judged(judge: &Mutex<Judge>, helped: impl FnOnce(bool) -> Option<(Duration, Duration)>) {
    let lock = || judge.lock().unwrap_or_else(|p| p.into_inner());
    let use_pool = lock().helped;
    let took = helped(use_pool);
    if let Some(helped) = lock().done(took) {
        IN_USE.set(i64::from(helped));
    }
}

impl Pool {
    /// The pool's threads not held by jobs of their own (see [`Pool::making`]).
    fn free(&self) -> usize {
        let making = usize::try_from(self.making.load(Ordering::Relaxed)).unwrap_or(usize::MAX);
        (self.threads - 1).saturating_sub(making)
    }
}

impl Workers for Pool {
    fn run(&self, jobs: &mut [Job<'_>]) {
        // No more helpers than parts: a helper with nothing to take only costs a wakeup.
        let helpers = self.free().min(jobs.len().div_ceil(PART).saturating_sub(1));
        judged(&self.judge, |use_pool| {
            if !use_pool || helpers == 0 {
                jobs.iter_mut().for_each(Job::run);
                return None;
            }
            let t = Instant::now();
            let parts = Mutex::new(jobs.chunks_mut(PART));
            let work = || {
                loop {
                    // A part is taken under the lock and run outside it.
                    let part = match parts.lock() {
                        Ok(mut p) => p.next(),
                        Err(_) => None,
                    };
                    let Some(part) = part else { break };
                    part.iter_mut().for_each(Job::run);
                }
            };
            let cpu = self.helped(helpers, &work, &mut || work());
            Some((t.elapsed(), cpu))
        });
    }

    fn threads(&self) -> usize {
        self.threads
    }

    fn spawn(&self, job: Box<dyn FnOnce() + Send>) {
        // A thread lingering after the last call (see `helped`) stops spinning and takes it:
        // a frame fed ahead or a turn's context records waited behind the spin otherwise.
        let call = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
        let making = Arc::clone(&self.making);
        making.fetch_add(1, Ordering::Relaxed);
        CONTEXT_TURNS.inc();
        let calls = Arc::clone(&self.calls);
        let idle = Arc::clone(&self.idle);
        self.pool.spawn(move || {
            job();
            making.fetch_sub(1, Ordering::Relaxed);
            // Then it lingers as after a call: one stream's next frame is handed over as soon
            // as the decoder's thread has taken this one, while it decodes the one before.
            linger(&calls, call, &idle);
        });
    }

    fn idle(&self, work: Arc<dyn Idle>) {
        self.idle.push(work);
    }

    fn overlap(&self, ahead: &Ahead<'_>, caller: &mut dyn FnMut()) {
        let helpers = self.free().min(ahead.len());
        judged(&self.ahead, |use_pool| {
            if !use_pool || helpers == 0 {
                caller();
                ahead.work();
                return None;
            }
            let t = Instant::now();
            let cpu = self.helped(helpers, &|| ahead.work(), &mut || {
                caller();
                ahead.work();
            });
            Some((t.elapsed(), cpu))
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wanopt_codec::{CodecConfig, Decoder, Encoder, Pressure};

    /// Runs a judge of `gain` through calls with the pool that take `wall` against `cpu` of
    /// CPU time; returns whether the calls after them use the pool, and for how many.
    fn judge(gain: f64, wall: u64, cpu: u64) -> (bool, u32) {
        let mut j = Judge::new(gain);
        let us = Duration::from_micros;
        for _ in 0..PROBE - 1 {
            assert!(j.helped);
            assert_eq!(j.done(Some((us(wall), us(cpu)))), None);
        }
        let used = j.done(Some((us(wall), us(cpu)))).expect("judged");
        (used, j.left)
    }

    #[test]
    fn the_pool_is_used_only_where_it_makes_calls_faster() {
        // Idle cores: a call with the pool takes half the CPU time both threads spent on it.
        assert_eq!(judge(GAIN, 55, 100), (true, PROBE));
        // Busy cores: the caller waits for jobs a preempted thread holds, or wakes a thread
        // that waits for a core: the wall time is what the caller alone would have spent.
        assert_eq!(judge(GAIN, 95, 100), (false, HOLD_FIRST));
        // Far slower than alone, call after call: judged after two, not a probe's worth.
        let us = Duration::from_micros;
        let mut j = Judge::new(GAIN);
        assert_eq!(
            j.done(Some((us(4000), us(100)))),
            None,
            "one call is not enough"
        );
        assert_eq!(j.done(Some((us(3000), us(100)))), Some(false));
        assert_eq!(j.left, HOLD_FIRST);
        // One stall among calls that pay (a thread preempted once on an idle host): left out,
        // the pool stays; its first call or its last, the same.
        for stall in [0, PROBE - 1] {
            let mut j = Judge::new(GAIN);
            let mut verdicts = Vec::new();
            for i in 0..PROBE {
                let call = if i == stall {
                    (us(4000), us(100))
                } else {
                    (us(55), us(100))
                };
                verdicts.extend(j.done(Some(call)));
            }
            assert_eq!(verdicts, [true], "a stall at call {stall}");
            assert_eq!(j.left, PROBE);
        }
        // Two stalls apart in a probe of calls that pay: judged at the second, against the
        // pool (the other stall still counts).
        let mut j = Judge::new(GAIN);
        let calls = [(us(4000), us(100)), (us(55), us(100)), (us(55), us(100))];
        let mut seen = calls.iter().map(|&c| j.done(Some(c))).collect::<Vec<_>>();
        seen.push(j.done(Some((us(2500), us(100)))));
        assert_eq!(seen, [None, None, None, Some(false)]);
        // Slower, but not twice: the probe's calls all count.
        let mut j = Judge::new(GAIN);
        assert_eq!(j.done(Some((us(150), us(100)))), None);
        assert_eq!(j.done(Some((us(150), us(100)))), None);
        assert_eq!(judge(GAIN, 140, 100), (false, HOLD_FIRST));
        // Jobs run ahead of the encoding caller: a smaller gain is taken, none is not.
        assert_eq!(judge(GAIN_AHEAD, 88, 100), (true, PROBE));
        assert_eq!(judge(GAIN_AHEAD, 97, 100), (false, HOLD_FIRST));
        // Turned off, the pool is not used for `HOLD_FIRST` calls; then a probe uses it again,
        // and it stays in use if it pays by then (the host's other work ended).
        let mut j = Judge::new(GAIN);
        let mut verdicts = Vec::new();
        for i in 0..PROBE + HOLD_FIRST + PROBE {
            let call = j.helped.then(|| {
                if i < PROBE {
                    (us(120), us(100))
                } else {
                    (us(50), us(100))
                }
            });
            if let Some(v) = j.done(call) {
                verdicts.push((i, v));
            }
        }
        assert_eq!(
            verdicts,
            [
                (PROBE - 1, false),
                (PROBE + HOLD_FIRST - 1, true),
                (PROBE + HOLD_FIRST + PROBE - 1, true)
            ]
        );
        // A host that stays busy: each probe turns the pool down again, for twice as long as
        // the last time up to `HOLD`; once a probe pays, the next hold is short again.
        let mut j = Judge::new(GAIN);
        let mut holds = Vec::new();
        for _ in 0..PROBE * 7 + HOLD * 6 {
            let call = j.helped.then_some((us(120), us(100)));
            if j.done(call) == Some(false) {
                holds.push(j.left);
            }
            if holds.len() == 7 {
                break;
            }
        }
        let h = HOLD_FIRST;
        assert_eq!(holds, [h, 2 * h, 4 * h, 8 * h, HOLD, HOLD, HOLD]);
        for _ in 1..HOLD {
            assert_eq!(j.done(None), None);
        }
        assert_eq!(j.done(None), Some(true), "a probe after the longest hold");
        for _ in 0..PROBE - 1 {
            assert_eq!(j.done(Some((us(50), us(100)))), None);
        }
        assert_eq!(j.done(Some((us(50), us(100)))), Some(true));
        for _ in 0..PROBE {
            j.done(Some((us(120), us(100))));
        }
        assert_eq!((j.helped, j.left), (false, HOLD_FIRST));
    }

    /// Four bulk streams in long stream contexts, side by side: with the pool, each turn's
    /// context records are made on its threads while the next streams' turns are planned,
    /// and the records are the ones one thread writes, byte for byte. They decode to the
    /// streams' bytes, and to the same cache, with each turn fed to its stream's context on
    /// the pool while the turns before it are decoded.
    #[test]
    fn a_pool_makes_several_streams_contexts_as_one_thread_does() {
        let (parts, _) = wanopt_codec::testdata::parallel_copies(4, 2, 300);
        let cfg = CodecConfig::default();
        let encode = |workers: Option<Arc<dyn Workers>>| {
            let mut s = wanopt_codec::Streams::new(cfg.clone(), parts.len(), 256 << 10);
            s.set_workers(workers);
            let refs: Vec<&[u8]> = parts.iter().map(|p| &p[..]).collect();
            let (mut wire, mut turns) = (Vec::new(), Vec::new());
            s.send(&refs, 64 << 10, Pressure::LinkBound, &mut wire, &mut turns);
            (wire, turns)
        };
        let (alone, turns) = encode(None);
        let pooled = encode(Pool::start(3));
        assert!(
            pooled.0 == alone,
            "{} against {} bytes",
            pooled.0.len(),
            alone.len()
        );
        assert_eq!(pooled.1, turns);
        // Decoded in turn, and with each frame fed to its stream's context on the pool (up to
        // three at once) while the ones before it are decoded: the same bytes, the same cache.
        let wire = bytes::Bytes::from(alone);
        let decode = |workers: Option<Arc<dyn Workers>>| {
            let mut dec = Decoder::new(&cfg);
            let mut outs = vec![Vec::new(); parts.len()];
            let mut ctxs: Vec<wanopt_codec::StreamContext> =
                parts.iter().map(|_| Default::default()).collect();
            let ahead = if workers.is_some() { 3 } else { 0 };
            let mut order = wanopt_codec::InOrder::new(ahead, workers);
            let mut in_turn =
                |dec: &mut Decoder, k: usize, r: std::ops::Range<usize>, ctx: &mut _| {
                    let len = r.len();
                    let (used, stop) = dec.decode_frame(&wire[r], &mut outs[k], ctx, usize::MAX);
                    assert_eq!((used, stop), (len, None));
                };
            let (mut from, mut fed) = (0, 0);
            for &(k, end) in &turns {
                let frame = (&wire, k, from..end);
                fed += usize::from(order.frame(&mut dec, frame, &mut ctxs, &mut in_turn));
                from = end;
            }
            order.finish(&mut dec, &mut ctxs, &mut in_turn);
            for (o, p) in outs.iter().zip(&parts) {
                assert!(o == p);
            }
            (fed > 0, dec.cache().digest())
        };
        let (fed, digest) = decode(None);
        assert!(!fed);
        assert_eq!(decode(Pool::start(3)), (true, digest));
    }

    /// Four bulk streams' literals alone (LZ4, and zstd outside a context), a first copy then a
    /// changed one: the pool's threads prepare each stream's next turn in their spare time
    /// (`Workers::idle`) as much as they get to, and the records are one thread's, byte for
    /// byte, and decode to the streams' bytes.
    #[test]
    fn a_pool_preparing_turns_in_its_spare_time_encodes_what_one_thread_does() {
        use wanopt_codec::testdata;
        let copies = testdata::parallel_copies(4, 2, 300);
        let cfg = CodecConfig {
            context: false,
            ..CodecConfig::default()
        };
        for pressure in [Pressure::CpuBound, Pressure::LinkBound] {
            let encode = |workers: Option<Arc<dyn Workers>>| {
                let mut s = wanopt_codec::Streams::new(cfg.clone(), 4, 256 << 10);
                s.set_workers(workers);
                testdata::send_parallel_copies(&mut s, &copies, pressure)
            };
            let alone = encode(None);
            for threads in [2, 3] {
                let pooled = encode(Pool::start(threads));
                assert!(
                    pooled == alone,
                    "{pressure:?}, {threads} threads: {} against {} bytes",
                    pooled.0.len(),
                    alone.0.len()
                );
            }
            let outs = testdata::decode_turns(&cfg, &alone.0, &alone.1, 4);
            assert!(outs == Some(testdata::parallel_streams(&copies)));
        }
    }

    /// A stream encoded with the pool's help (chunks prepared in batches, and run ahead of the
    /// encoder) is the stream encoded alone, byte for byte.
    #[test]
    fn a_pool_encodes_what_one_thread_does() {
        let data: Vec<u8> = (0..3_000_000u32)
            .flat_map(|i| format!("row {} value {}\n", i % 9973, i / 7).into_bytes())
            .take(4 << 20)
            .collect();
        let cfg = CodecConfig {
            context: false,
            ..CodecConfig::default()
        };
        let encode = |workers: Option<Arc<dyn Workers>>| {
            let mut e = Encoder::new(cfg.clone());
            e.set_workers(workers);
            let mut wire = Vec::new();
            // Pieces of four turns: the next turn's chunks are cut while one encodes.
            for piece in data.chunks(1 << 20) {
                e.push(piece, false, Pressure::CpuBound, &mut wire);
            }
            e.push(&[], true, Pressure::CpuBound, &mut wire);
            wire
        };
        let alone = encode(None);
        assert!(Pool::start(1).is_none());
        // The pool is in use from the first call (its judge starts with a probe of it).
        let pooled = encode(Pool::start(3));
        assert!(
            alone == pooled,
            "{} against {} bytes",
            pooled.len(),
            alone.len()
        );
        let mut out = Vec::new();
        Decoder::new(&cfg)
            .decode(&pooled, &mut out)
            .expect("decodes");
        assert!(out == data);
    }
}
