//! Bulk streams' next turns prepared in the workers' spare time (`send/early.rs`): the records
//! are the ones one thread writes whatever was done early, what was done is used, and nothing
//! handed over is touched once its stream took it back or went.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use crate::prepare::{self, Idle};
use crate::{CodecConfig, Pressure, Streams, testdata};

/// How much of the work handed over for spare time [`Spare`] does before each call.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Time {
    /// None: it is kept, to be tried once the streams are gone.
    Never,
    /// All of it.
    All,
    /// One piece of each, a call (the rest is its owner's when its turn comes).
    Piece,
}

/// Two threads' workers on one: a call's jobs run on the caller, and the work handed over for
/// spare time is done before the next call (as a pool thread lingering between calls does),
/// as much of it as `time` says. Counts the chunk jobs run within calls and the pieces done
/// in spare time.
struct Spare {
    time: Time,
    handed: Mutex<Vec<Arc<dyn Idle>>>,
    in_calls: AtomicUsize,
    early: AtomicUsize,
}

impl std::fmt::Debug for Spare {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spare").field("time", &self.time).finish()
    }
}

impl Spare {
    fn new(time: Time) -> Arc<Self> {
        Arc::new(Spare {
            time,
            handed: Mutex::default(),
            in_calls: AtomicUsize::new(0),
            early: AtomicUsize::new(0),
        })
    }

    fn spare_time(&self) {
        let handed = self.handed.lock().map(|h| h.clone()).unwrap_or_default();
        for w in handed {
            match self.time {
                Time::Never => {}
                Time::All => {
                    while w.work_one() {
                        self.early.fetch_add(1, Relaxed);
                    }
                }
                Time::Piece => {
                    if w.work_one() {
                        self.early.fetch_add(1, Relaxed);
                    }
                }
            }
        }
    }
}

impl prepare::Workers for Spare {
    fn run(&self, jobs: &mut [prepare::Job<'_>]) {
        self.spare_time();
        jobs.iter_mut().for_each(prepare::Job::run);
    }

    fn threads(&self) -> usize {
        2
    }

    fn overlap(&self, ahead: &prepare::Ahead<'_>, caller: &mut dyn FnMut()) {
        self.spare_time();
        self.in_calls.fetch_add(ahead.len() - ahead.cuts(), Relaxed);
        caller();
        ahead.work();
    }

    fn idle(&self, work: Arc<dyn Idle>) {
        if let Ok(mut h) = self.handed.lock() {
            h.push(work);
        }
    }
}

/// Four streams' first copies, then two of them changed (references, deltas and literals
/// mixed): the records and turns with `workers`, checked to decode to the streams' bytes.
fn copies(
    cfg: &CodecConfig,
    pressure: Pressure,
    workers: Option<Arc<dyn prepare::Workers>>,
) -> (Vec<u8>, Vec<(usize, usize)>) {
    let copies = testdata::parallel_copies(4, 2, 160);
    let mut s = Streams::new(cfg.clone(), 4, 256 << 10);
    s.set_workers(workers);
    let (wire, turns) = testdata::send_parallel_copies(&mut s, &copies, pressure);
    let outs = testdata::decode_turns(cfg, &wire, &turns, 4);
    assert!(outs == Some(testdata::parallel_streams(&copies)));
    (wire, turns)
}

#[test]
fn chunks_prepared_in_spare_time_give_one_threads_records() {
    let cases = [
        (false, Pressure::CpuBound),
        (false, Pressure::LinkBound),
        (true, Pressure::LinkBound),
    ];
    for (context, pressure) in cases {
        let cfg = CodecConfig {
            context,
            ..CodecConfig::default()
        };
        let alone = copies(&cfg, pressure, None);
        let mut in_calls = Vec::new();
        for time in [Time::Never, Time::Piece, Time::All] {
            let w = Spare::new(time);
            let got = copies(&cfg, pressure, Some(Arc::clone(&w) as _));
            assert!(
                got == alone,
                "{context} {pressure:?} {time:?}: {} against {} bytes",
                got.0.len(),
                alone.0.len()
            );
            let early = w.early.load(Relaxed);
            in_calls.push(w.in_calls.load(Relaxed));
            if time == Time::Never {
                assert_eq!(early, 0);
                // The streams are gone: what they handed over is over, none of it is done.
                let handed = w.handed.lock().map(|h| h.clone()).unwrap_or_default();
                assert!(
                    !handed.is_empty(),
                    "{context} {pressure:?}: nothing handed over"
                );
                assert!(handed.iter().all(|h| !h.work_one()));
            } else {
                assert!(
                    early > 20,
                    "{context} {pressure:?} {time:?}: {early} done early"
                );
            }
        }
        // What was done early is not done again in a call.
        let (never, piece, all) = (in_calls[0], in_calls[1], in_calls[2]);
        assert!(
            all < piece && piece < never,
            "{context} {pressure:?}: chunk jobs in calls {in_calls:?}"
        );
    }
}
