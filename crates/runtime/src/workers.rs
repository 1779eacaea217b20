//! The codec's worker threads: one pool per daemon that the links' mirrors prepare chunks on
//! (fingerprints, literals alone, delta anchors, the next turn's cut points; see
//! `wanopt_codec::prepare`) before or while encoding them in link order. The calling thread
//! works through the batch beside the pool's, so `limits.threads: N` is N threads encoding.

use std::sync::LazyLock;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::metrics::gauge::Gauge;

use wanopt_codec::prepare::{Ahead, Job, Workers};

/// Jobs taken at a time: small enough to even out chunks that cost more (literals) and less
/// (references) across threads.
const PART: usize = 2;

/// A pool of `threads - 1` threads, plus the caller's. Whether the pool's threads make batches
/// faster is measured, not assumed: every so often [`PROBE`] batches run on the caller alone
/// and as many with the pool, in turn, and the next [`HOLD`] batches run the faster way. On a host whose
/// cores are all busy, waking a pool thread waits for the scheduler and moves work between
/// cores that are full anyway: on the 2-core test VM, with both daemons and the applications
/// on it, the pool cost a loopback pair a sixth of its rate (benches/README.md at 0a2ddc0).
#[derive(Debug)]
pub struct Pool {
    pool: rayon::ThreadPool,
    threads: usize,
    /// Judges batches of jobs ([`Workers::run`]) and, apart, the jobs run ahead of an encoding
    /// caller ([`Workers::overlap`]): the two cost differently per job.
    judge: Mutex<Judge>,
    ahead: Mutex<Judge>,
}

/// Batches of each kind a probe runs (alone and with the pool, in turn).
const PROBE: u32 = 16;
/// Batches run the way the last probe chose, before the next probe.
const HOLD: u32 = 256;
/// The pool is used when it makes a job at least this much faster than the caller alone.
const GAIN: f64 = 0.85;
/// The same for jobs run ahead of an encoding caller ([`Workers::overlap`]): no batch ends
/// with the caller waiting for the pool there, and a stream context's turns gain 16-18% with
/// the pool on two idle cores (`codec --threads 2`), which [`GAIN`] would turn down.
const GAIN_AHEAD: f64 = 0.94;

/// Where the pool's probe stands.
#[derive(Debug, Default)]
struct Judge {
    /// Batches left in the current stage: probing, or holding.
    left: u32,
    stage: Stage,
    /// Time and work (jobs, or bytes) of the probe's batches alone and with the pool.
    alone: (Duration, u64),
    helped: (Duration, u64),
    /// The share of the time alone under which the pool is used.
    gain: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Batches alone and with the pool in turn, so that a drift in the host's speed (another
    /// process, the VM's neighbours) weighs on both alike; `helped`: the next one's.
    Probe {
        helped: bool,
    },
    Hold {
        helped: bool,
    },
}

impl Default for Stage {
    fn default() -> Self {
        Stage::Probe { helped: false }
    }
}

impl Judge {
    /// Whether the next batch uses the pool.
    fn helped(&self) -> bool {
        match self.stage {
            Stage::Probe { helped } | Stage::Hold { helped } => helped,
        }
    }

    /// Counts a batch of `work` (jobs, or bytes) that took `took`, and moves on; after a
    /// probe, whether the batches until the next one use the pool.
    fn done(&mut self, work: u64, took: Duration) -> Option<bool> {
        if let Stage::Probe { helped } = self.stage {
            let s = if helped {
                &mut self.helped
            } else {
                &mut self.alone
            };
            s.0 += took;
            s.1 += work;
            self.stage = Stage::Probe { helped: !helped };
        }
        self.left = self.left.saturating_sub(1);
        if self.left > 0 {
            return None;
        }
        (self.stage, self.left) = match self.stage {
            Stage::Probe { .. } => {
                let per = |(t, n): (Duration, u64)| t.as_secs_f64() / n.max(1) as f64;
                let helped = per(self.helped) < per(self.alone) * self.gain;
                self.alone = Default::default();
                self.helped = Default::default();
                (Stage::Hold { helped }, HOLD)
            }
            Stage::Hold { .. } => (Stage::Probe { helped: false }, 2 * PROBE),
        };
        match self.stage {
            Stage::Hold { helped } => Some(helped),
            Stage::Probe { .. } => None,
        }
    }
}

impl Pool {
    /// A pool for `threads` encoding threads; `None` for one (the caller alone) or if the
    /// threads could not be started (then each chunk is prepared as it is encoded).
    pub fn start(threads: usize) -> Option<Arc<dyn Workers>> {
        Self::starting(threads, Stage::default(), 2 * PROBE).map(|p| p as Arc<dyn Workers>)
    }

    /// A pool whose judge starts at `stage` for `left` batches.
    fn starting(threads: usize, stage: Stage, left: u32) -> Option<Arc<Pool>> {
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
                judge: Mutex::new(Judge {
                    left,
                    stage,
                    gain: GAIN,
                    ..Judge::default()
                }),
                ahead: Mutex::new(Judge {
                    left,
                    stage,
                    gain: GAIN_AHEAD,
                    ..Judge::default()
                }),
            })),
            Err(e) => {
                tracing::warn!(error = %e, "codec worker threads could not start; encoding on one");
                None
            }
        }
    }

    /// Runs the jobs on the caller and `helpers` of the pool's threads.
    fn run_on(&self, jobs: &mut [Job<'_>], helpers: usize) {
        if helpers == 0 {
            jobs.iter_mut().for_each(Job::run);
            return;
        }
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
        self.pool.in_place_scope(|s| {
            for _ in 0..helpers {
                s.spawn(|_| work());
            }
            work();
        });
    }
}

/// `limits.threads` of the process's pool, and 1 while the last probe found the pool makes
/// batches faster (see [`Pool`]); the daemons register them with their metrics.
static THREADS: LazyLock<Gauge> = LazyLock::new(Gauge::default);
static IN_USE: LazyLock<Gauge> = LazyLock::new(Gauge::default);

/// The gauges of the process's pool: its threads, and whether it is in use.
pub fn gauges() -> (Gauge, Gauge) {
    (THREADS.clone(), IN_USE.clone())
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

impl Workers for Pool {
    fn run(&self, jobs: &mut [Job<'_>]) {
        let lock = || self.judge.lock().unwrap_or_else(|p| p.into_inner());
        let helped = lock().helped();
        // No more helpers than parts: a helper with nothing to take only costs a wakeup.
        let helpers = if helped {
            self.threads
                .min(jobs.len().div_ceil(PART))
                .saturating_sub(1)
        } else {
            0
        };
        let t = Instant::now();
        self.run_on(jobs, helpers);
        if let Some(helped) = lock().done(jobs.len() as u64, t.elapsed()) {
            IN_USE.set(i64::from(helped));
        }
    }

    fn overlap(&self, ahead: &Ahead<'_>, caller: &mut dyn FnMut()) {
        let lock = || self.ahead.lock().unwrap_or_else(|p| p.into_inner());
        let helpers = if lock().helped() {
            (self.threads - 1).min(ahead.len())
        } else {
            0
        };
        let t = Instant::now();
        if helpers == 0 {
            caller();
            ahead.work();
        } else {
            self.pool.in_place_scope(|s| {
                for _ in 0..helpers {
                    s.spawn(|_| ahead.work());
                }
                caller();
                ahead.work();
            });
        }
        // Per byte encoded: a turn's jobs are few where most of it goes as references.
        if let Some(helped) = lock().done(ahead.weight(), t.elapsed()) {
            IN_USE.set(i64::from(helped));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wanopt_codec::{CodecConfig, Decoder, Encoder, Pressure};

    /// Runs a judge through a probe where a batch takes `alone` alone and `helped` with the
    /// pool; returns whether the batches after it use the pool, and for how many.
    fn probe(alone: u64, helped: u64) -> (bool, u32) {
        probe_at(GAIN, alone, helped)
    }

    /// [`probe`] with a judge of `gain`.
    fn probe_at(gain: f64, alone: u64, helped: u64) -> (bool, u32) {
        let mut j = Judge {
            left: 2 * PROBE,
            gain,
            ..Judge::default()
        };
        for _ in 0..2 * PROBE {
            let t = if j.helped() { helped } else { alone };
            j.done(10, Duration::from_micros(t));
        }
        let mut held = 0;
        let used = j.helped();
        while !matches!(j.stage, Stage::Probe { .. }) {
            assert_eq!(j.helped(), used);
            j.done(10, Duration::from_micros(1));
            held += 1;
        }
        (used, held)
    }

    #[test]
    fn the_pool_is_used_only_where_it_makes_batches_faster() {
        // Idle cores: the pool halves a batch's time.
        assert_eq!(probe(100, 55), (true, HOLD));
        // Busy cores: waking the pool's threads costs what they save, or more.
        assert_eq!(probe(100, 95), (false, HOLD));
        assert_eq!(probe(100, 140), (false, HOLD));
        // Jobs run ahead of the encoding caller: a smaller gain is taken, none is not.
        assert_eq!(probe_at(GAIN_AHEAD, 100, 88), (true, HOLD));
        assert_eq!(probe_at(GAIN_AHEAD, 100, 97), (false, HOLD));
        // The host slows down while the probe runs (another process starts): batches alone and
        // with the pool in turn bear the drift alike, and the pool's gain still shows.
        let mut j = Judge {
            left: 2 * PROBE,
            gain: GAIN,
            ..Judge::default()
        };
        for i in 0..u64::from(2 * PROBE) {
            let t = 100 + 20 * i;
            j.done(
                10,
                Duration::from_micros(if j.helped() { t * 7 / 10 } else { t }),
            );
        }
        assert_eq!(j.stage, Stage::Hold { helped: true });
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
        // The pool in use from the first batch (a probe would start with the caller alone).
        let pool = Pool::starting(3, Stage::Hold { helped: true }, u32::MAX).expect("pool");
        let pooled = encode(Some(pool));
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
