//! Runs of deferred literals rebuild at their end exactly, hostile runs are errors, and
//! prepared chunks (on workers) encode and decode to the same records as chunks in turn.

use super::fed_ahead::decode_streams;
use super::*;
use crate::format::{TAG_LIT, TAG_REF, TAG_REF_RUN_SHORT};
use std::sync::atomic::Ordering::Relaxed;

#[test]
fn a_run_of_literals_rebuilds_at_its_end_exactly_and_caches_every_chunk() {
    // No deltas: what runs save is the flushes alone.
    let cfg = CodecConfig {
        zstd_level: 6,
        delta_bytes: 0,
        ..CodecConfig::default()
    };
    let (mut enc, mut dec) = pair(&cfg);
    // Rows of a table, as a binlog or a dump holds them: compressible, not trivially.
    let noise = crate::testdata::noise(3, 1 << 20);
    let data: Vec<u8> = (0..4000usize)
        .flat_map(|i| {
            let n = &noise[i * 8..i * 8 + 8];
            format!(
                "{i:08}|{:06}|customer-{:05}|{:02x}{:02x}{:02x}|{:03}|{}\n",
                (i * 7919) % 1_000_000,
                u16::from_le_bytes([n[0], n[1]]),
                n[2],
                n[3],
                n[4],
                n[5] % 97,
                ["NEW", "PAID", "SHIPPED", "CLOSED"][usize::from(n[6] % 4)]
            )
            .into_bytes()
        })
        .collect();
    let mut wire = Vec::new();
    enc.push(&data, true, Pressure::LinkBound, &mut wire);
    let tags = records(&mut dec, &wire);
    // Deferred literals rebuild nothing until the run ends, then all of it in order.
    let deferred = tags.iter().filter(|(t, _)| is_deferred(*t)).count();
    assert!(deferred >= 4, "{tags:?}");
    let mut held = 0;
    for (t, out) in &tags {
        if is_deferred(*t) {
            assert_eq!(*out, held, "a deferred record rebuilds nothing yet");
        }
        held = *out;
    }
    assert_eq!(
        tags.last().map(|t| t.0),
        Some(TAG_RUN_END),
        "the push ends its run"
    );
    assert_eq!(held, data.len());
    // Every chunk of the run went into the receiver's cache: the same bytes again are references.
    let mut again = Vec::new();
    enc.push(&data, true, Pressure::LinkBound, &mut again);
    let mut out = Vec::new();
    dec.decode(&again, &mut out).expect("decodes");
    assert!(out == data);
    assert!(again.len() < data.len() / 100, "{} bytes", again.len());
    // Without runs, the same bytes flush every chunk: more bytes.
    let (mut flat, _) = pair(&CodecConfig {
        runs: false,
        ..cfg.clone()
    });
    let mut each = Vec::new();
    flat.push(&data, true, Pressure::LinkBound, &mut each);
    assert!(
        wire.len() < each.len(),
        "{} against {}",
        wire.len(),
        each.len()
    );
    let flat_tags = records(&mut Decoder::new(&cfg), &each);
    assert!(
        !flat_tags
            .iter()
            .any(|(t, _)| is_deferred(*t) || *t == TAG_RUN_END)
    );
}

#[test]
fn hostile_runs_are_errors() {
    let cfg = CodecConfig::default();
    let (mut enc, _) = pair(&cfg);
    let mut wire = Vec::new();
    enc.push(&db_blocks(8, 5), true, Pressure::LinkBound, &mut wire);
    let wire = without_log(&wire);
    let first = Decoder::new(&cfg)
        .decode_record(wire, &mut Vec::new())
        .expect("first");
    assert!(is_deferred(wire[0]), "the first literal opens a run");
    // A run end with no run.
    let mut d = Decoder::new(&cfg);
    assert_eq!(
        d.decode_record(&[TAG_RUN_END, 0], &mut Vec::new()),
        Err(CodecError::Malformed("a run end without a run"))
    );
    // Anything but a context literal or the run's end inside a run.
    let mut d = Decoder::new(&cfg);
    let mut out = Vec::new();
    d.decode_record(wire, &mut out).expect("deferred");
    assert!(out.is_empty());
    assert_eq!(
        d.decode_record(&[TAG_RAW, 1, b'x'], &mut out),
        Err(CodecError::Malformed("a run left unfinished"))
    );
    // A run end that does not complete the run's bytes.
    let mut d = Decoder::new(&cfg);
    d.decode_record(wire, &mut out).expect("deferred");
    assert_eq!(
        d.decode_record(&[TAG_RUN_END, 0], &mut out),
        Err(CodecError::Decompress)
    );
    // A run announcing more than a receiver holds, before anything is decompressed.
    let mut d = Decoder::new(&cfg);
    d.decode_record(wire, &mut out).expect("deferred");
    let mut big = vec![TAG_LIT_CONTEXT | DEFERRED];
    put_len(&mut big, MAX_RECORD);
    put_len(&mut big, 0);
    assert_eq!(
        d.decode_record(&big, &mut out),
        Err(CodecError::Malformed("run longer than a receiver accepts"))
    );
    // A fresh context inside a run.
    let mut d = Decoder::new(&cfg);
    d.decode_record(wire, &mut out).expect("deferred");
    assert_eq!(
        d.decode_record(&wire[..first], &mut out),
        Err(CodecError::Malformed("a fresh context inside a run"))
    );
    assert!(out.is_empty(), "nothing rebuilt from a broken run");
}

/// Workers on threads of their own: the jobs split in `.0` parts, one thread each; `.1` counts
/// the jobs that cut chunks ahead, `.2` the turns that cut them in pieces.
#[derive(Debug, Default)]
pub(super) struct Threads(
    usize,
    std::sync::atomic::AtomicUsize,
    std::sync::atomic::AtomicUsize,
);

impl Threads {
    pub(super) fn new(n: usize) -> Self {
        Threads(n, Default::default(), Default::default())
    }
}

impl prepare::Workers for Threads {
    fn run(&self, jobs: &mut [prepare::Job<'_>]) {
        let per = jobs.len().div_ceil(self.0).max(1);
        std::thread::scope(|s| {
            for part in jobs.chunks_mut(per) {
                s.spawn(move || part.iter_mut().for_each(prepare::Job::run));
            }
        });
    }

    fn spawn(&self, job: Box<dyn FnOnce() + Send>) {
        std::thread::spawn(job);
    }

    fn threads(&self) -> usize {
        self.0
    }

    fn overlap(&self, ahead: &prepare::Ahead<'_>, caller: &mut dyn FnMut()) {
        self.1
            .fetch_add(ahead.cuts(), std::sync::atomic::Ordering::Relaxed);
        if ahead.cuts() > 1 {
            self.2.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        std::thread::scope(|s| {
            for _ in 1..self.0 {
                s.spawn(|| ahead.work());
            }
            caller();
            ahead.work();
        });
    }
}

/// Workers whose one helper is slower than the caller: after the first job, which it runs
/// before the caller starts, it sleeps before each job it takes. Counts the batches run beside
/// the caller and the jobs the helper ran.
#[derive(Debug, Default)]
struct Slow {
    calls: std::sync::atomic::AtomicUsize,
    helped: std::sync::atomic::AtomicUsize,
}

impl prepare::Workers for Slow {
    fn run(&self, jobs: &mut [prepare::Job<'_>]) {
        jobs.iter_mut().for_each(prepare::Job::run);
    }

    fn threads(&self) -> usize {
        2
    }

    fn overlap(&self, ahead: &prepare::Ahead<'_>, caller: &mut dyn FnMut()) {
        use std::sync::atomic::Ordering::Relaxed;
        self.calls.fetch_add(1, Relaxed);
        std::thread::scope(|s| {
            // The helper runs one job before the caller starts (however busy the host), then
            // takes one every 50 µs.
            let (started, start) = std::sync::mpsc::channel();
            s.spawn(move || {
                loop {
                    if !ahead.work_one() {
                        let _ = started.send(());
                        break;
                    }
                    self.helped.fetch_add(1, Relaxed);
                    let _ = started.send(());
                    std::thread::sleep(std::time::Duration::from_micros(50));
                }
            });
            let _ = start.recv();
            caller();
            ahead.work();
        });
    }
}

/// A changed copy's delta bases are looked up with anchors found on the workers: the records
/// are the very ones the encoder writes alone (the anchors depend on a chunk's bytes only), with
/// deltas in them, with and without delta runs and stream contexts.
#[test]
fn anchors_found_on_workers_give_the_same_deltas() {
    let first = crate::testdata::rows(11, 12_000);
    let changed = crate::testdata::edited(&first, 5);
    for (context, runs) in [(false, false), (true, true), (false, true)] {
        let cfg = CodecConfig {
            context,
            runs,
            ..CodecConfig::default()
        };
        let pieces = [65_536];
        let wire = |enc: &mut Encoder| {
            let mut w = encode_all(Pressure::LinkBound, enc, &first, &pieces, false);
            w.extend(encode_all(
                Pressure::LinkBound,
                enc,
                &changed,
                &pieces,
                false,
            ));
            w
        };
        let (mut alone, _) = pair(&cfg);
        let (mut pooled, mut dec) = pair(&cfg);
        pooled.set_workers(Some(std::sync::Arc::new(Threads::new(2))));
        let (a, b) = (wire(&mut alone), wire(&mut pooled));
        assert!(a == b, "{} and {} bytes", a.len(), b.len());
        assert_eq!(alone.stats(), pooled.stats());
        assert!(pooled.stats().delta_chunks > 10, "{:?}", pooled.stats());
        let mut out = Vec::new();
        dec.decode(&b, &mut out).expect("decodes");
        assert!(out[..first.len()] == first[..] && out[first.len()..] == changed[..]);
        // A decoder that names a run's chunks on the workers (a delta run's, a context run's)
        // rebuilds and caches the same.
        let mut pooled_dec = Decoder::new(&cfg);
        pooled_dec.set_workers(Some(std::sync::Arc::new(Threads::new(3))));
        let mut out2 = Vec::new();
        pooled_dec.decode(&b, &mut out2).expect("decodes");
        assert!(out2 == out);
        assert_eq!(pooled_dec.stats(), dec.stats());
        assert_eq!(
            pooled_dec.cache().snapshot().digest(),
            dec.cache().snapshot().digest()
        );
    }
}

/// A decoder with workers has them copy what records rebuild straight into its output
/// (literals alone after decompressing them, chunks held for references and reference runs,
/// checked against their names there): the bytes are the stream's exactly, the cache the same
/// as a decoder's in turn, on an output that starts with no room. A chunk damaged in the cache
/// is still a miss (its copy made ahead is never counted in), and after the miss is answered
/// the rest lands exactly. A frame cut off or damaged stops where it does in turn, with the
/// same bytes before it.
#[test]
fn copies_made_on_the_workers_land_exactly_or_not_at_all() {
    // With streams' logs, repeats go as reference runs; without, as references one by one.
    for logs in [true, false] {
        copies_made_on_the_workers_land_exactly(CodecConfig {
            logs,
            ..CodecConfig::default()
        });
    }
}

fn copies_made_on_the_workers_land_exactly(cfg: CodecConfig) {
    // LZ4 literals, stored ones (noise), repeats within the copy, then the whole again.
    let data = mix(&[
        (1, 600_000, 3),
        (0, 300_000, 4),
        (2, 400_000, 0),
        (1, 200_000, 5),
    ]);
    let mut enc = Encoder::new(cfg.clone());
    let first = encode_all(Pressure::CpuBound, &mut enc, &data, &[65_536], false);
    let second = encode_all(Pressure::CpuBound, &mut enc, &data, &[65_536], false);
    let seen: std::collections::HashSet<u8> =
        records(&mut Decoder::new(&cfg), &[&first[..], &second[..]].concat())
            .into_iter()
            .map(|(t, _)| t & !NO_CACHE)
            .collect();
    let repeats = if cfg.logs { TAG_REF_RUN_SHORT } else { TAG_REF };
    for t in [TAG_LIT, TAG_LIT_LZ4, repeats] {
        assert!(seen.contains(&t), "tag {t} in {seen:?}");
    }
    let workers = || -> Option<std::sync::Arc<dyn prepare::Workers>> {
        Some(std::sync::Arc::new(Threads::new(2)))
    };
    let mut in_turn = Decoder::new(&cfg);
    let mut want = Vec::new();
    in_turn.decode(&first, &mut want).expect("decodes");
    in_turn.decode(&second, &mut want).expect("decodes");
    assert!(want == [&data[..], &data[..]].concat());

    let mut dec = Decoder::new(&cfg);
    dec.set_workers(workers());
    let mut out = Vec::new();
    assert_eq!(dec.decode(&first, &mut out), Ok(first.len()));
    let ahead_first = dec.ahead_bytes();
    assert_eq!(dec.decode(&second, &mut out), Ok(second.len()));
    assert!(out == want);
    let s = dec.stats();
    let (len, second_ahead) = (data.len() as u64, dec.ahead_bytes() - ahead_first);
    assert!(
        ahead_first * 10 > len * 8 && second_ahead * 10 > len * 8,
        "{ahead_first} and {second_ahead} of {len} bytes copied ahead: {s:?}"
    );
    assert_eq!(s, in_turn.stats(), "the same chunks rebuilt the same way");
    assert_eq!(dec.cache().digest(), in_turn.cache().digest());

    // A worker slower than the decoding thread, taking the jobs from the last: the decoding
    // thread comes to jobs still running (and waits for them), runs those nobody began, and
    // counts each record in while later jobs still write their places; the same bytes.
    let slow = std::sync::Arc::new(Slow::default());
    let mut dec = Decoder::new(&cfg);
    dec.set_workers(Some(slow.clone()));
    let mut out = Vec::new();
    assert_eq!(dec.decode(&first, &mut out), Ok(first.len()));
    assert_eq!(dec.decode(&second, &mut out), Ok(second.len()));
    assert!(out == want);
    assert_eq!(dec.stats(), in_turn.stats());
    assert_eq!(dec.cache().digest(), in_turn.cache().digest());
    let (calls, helped) = (slow.calls.load(Relaxed), slow.helped.load(Relaxed));
    assert!(
        calls >= 2 && helped > 0,
        "{calls} batches, {helped} jobs helped"
    );

    // Every seventh chunk damaged in the cache before the second copy.
    let mut dec = Decoder::new(&cfg);
    dec.set_workers(workers());
    let mut out = Vec::new();
    dec.decode(&first, &mut out).expect("decodes");
    let mut damaged = 0;
    for (at, len) in chunks(&data, &cfg).step_by(7) {
        dec.cache_mut()
            .corrupt_for_test(&crate::fingerprint::fingerprint(&data[at..at + len]));
        damaged += 1;
    }
    let misses = answered(&enc, &mut dec, &second, &mut out, damaged + 10, |out| {
        assert!(
            want.starts_with(out),
            "only whole, checked chunks are counted in"
        );
    })
    .len();
    assert!(
        misses >= damaged / 2,
        "{misses} misses of {damaged} damaged"
    );
    assert!(out == want);

    // Cut off, or a byte of a compressed literal changed: the same stop and bytes as in turn.
    for cut in [first.len() / 3, first.len() / 2 + 7] {
        let mut bad = first.clone();
        bad.truncate(cut);
        let mut d = Decoder::new(&cfg);
        d.set_workers(workers());
        let (mut o1, mut o2) = (Vec::new(), Vec::new());
        let r1 = d.decode_frame(&bad, &mut o1, &mut Default::default(), usize::MAX);
        let r2 =
            Decoder::new(&cfg).decode_frame(&bad, &mut o2, &mut Default::default(), usize::MAX);
        assert_eq!(r1, r2);
        assert!(o1 == o2);
    }
    // The 40th LZ4 literal's wire offset and length.
    let (mut d, mut o, mut at, mut lz4) = (Decoder::new(&cfg), Vec::new(), 0, Vec::new());
    while at < first.len() {
        let n = d.decode_record(&first[at..], &mut o).expect("decodes");
        if first[at] == TAG_LIT_LZ4 {
            lz4.push((at, n));
        }
        at += n;
    }
    let (lz4_at, lz4_len) = lz4[40];
    let mut bad = first.clone();
    bad[lz4_at + lz4_len / 2] ^= 0x5a;
    let mut d = Decoder::new(&cfg);
    d.set_workers(workers());
    let (mut o1, mut o2) = (Vec::new(), Vec::new());
    let r1 = d.decode_frame(&bad, &mut o1, &mut Default::default(), usize::MAX);
    let r2 = Decoder::new(&cfg).decode_frame(&bad, &mut o2, &mut Default::default(), usize::MAX);
    assert_eq!(r1, r2);
    assert!(o1 == o2);
}

/// A changed copy's reference runs (a stream log names chunks of the first copy) join the
/// decoding batch with the literals between them, their chunks copied into place on the
/// workers and checked there: the batches no longer end at each run, and the bytes, stats and
/// cache are those of a decoder in turn, with a slow helper too. A chunk damaged in the cache
/// fails its check on the worker: the run is looked up in turn and misses, as in turn.
#[test]
fn reference_runs_join_the_batch_and_land_exactly() {
    let cfg = CodecConfig::default();
    assert!(cfg.logs);
    let data = mix(&[(1, 900_000, 6), (0, 200_000, 7), (1, 500_000, 8)]);
    // A few bytes changed every 48 KiB: runs of references with changed chunks between them.
    let mut changed = data.clone();
    for at in (1000..changed.len()).step_by(48 << 10) {
        changed[at] ^= 0x55;
    }
    let mut enc = Encoder::new(cfg.clone());
    let first = encode_all(Pressure::CpuBound, &mut enc, &data, &[65_536], false);
    let second = encode_all(Pressure::CpuBound, &mut enc, &changed, &[65_536], false);
    let mut in_turn = Decoder::new(&cfg);
    let mut want = Vec::new();
    in_turn.decode(&first, &mut want).expect("decodes");
    in_turn.decode(&second, &mut want).expect("decodes");
    let mut counter = Decoder::new(&cfg);
    counter.decode(&first, &mut Vec::new()).expect("decodes");
    let runs = records(&mut counter, &second)
        .iter()
        .filter(|(t, _)| *t == TAG_REF_RUN_SHORT)
        .count();
    assert!(want == [&data[..], &changed[..]].concat());
    assert!(runs >= 20, "{runs} reference runs");

    let slow = std::sync::Arc::new(Slow::default());
    let mut dec = Decoder::new(&cfg);
    dec.set_workers(Some(slow.clone()));
    let mut out = Vec::new();
    assert_eq!(dec.decode(&first, &mut out), Ok(first.len()));
    let (calls, ahead) = (slow.calls.load(Relaxed), dec.ahead_bytes());
    assert_eq!(dec.decode(&second, &mut out), Ok(second.len()));
    assert!(out == want);
    assert_eq!(dec.stats(), in_turn.stats());
    assert_eq!(dec.cache().digest(), in_turn.cache().digest());
    let (calls, ahead) = (slow.calls.load(Relaxed) - calls, dec.ahead_bytes() - ahead);
    assert!(
        calls * 4 <= runs,
        "{calls} batches for {runs} reference runs"
    );
    let len = changed.len() as u64;
    assert!(ahead * 10 >= len * 9, "{ahead} of {len} bytes placed ahead");

    // Every fifth chunk of the first copy damaged before the second: the same misses as in
    // turn, one by one, then the same bytes.
    let damage = |d: &mut Decoder| {
        for (at, len) in chunks(&data, &cfg).step_by(5) {
            d.cache_mut()
                .corrupt_for_test(&crate::fingerprint::fingerprint(&data[at..at + len]));
        }
    };
    let mut decoders = [Decoder::new(&cfg), Decoder::new(&cfg)];
    decoders[1].set_workers(Some(std::sync::Arc::new(Threads::new(2))));
    let mut got = Vec::new();
    for d in &mut decoders {
        let mut out = Vec::new();
        d.decode(&first, &mut out).expect("decodes");
        damage(d);
        let misses = answered(&enc, d, &second, &mut out, usize::MAX, |_| {});
        assert!(out == want);
        got.push(misses);
    }
    assert!(got[0].len() >= 10, "{} misses", got[0].len());
    assert_eq!(got[0], got[1], "the same misses, in the same order");
}

/// Decodes `wire` frame by frame into `out`, answering each miss with the chunk (or a run's
/// names) the sender's mirror kept, as the link does; `each` sees the output after every call,
/// and a miss never takes back what was counted in. Returns the misses in order, at most `most`.
fn answered(
    enc: &Encoder,
    d: &mut Decoder,
    wire: &[u8],
    out: &mut Vec<u8>,
    most: usize,
    mut each: impl FnMut(&[u8]),
) -> Vec<crate::fingerprint::Fingerprint> {
    let (mut at, mut misses) = (0, Vec::new());
    let mut ctx = StreamContext::default();
    while at < wire.len() {
        let before = out.len();
        let (used, stop) = d.decode_frame(&wire[at..], out, &mut ctx, usize::MAX);
        at += used;
        each(out);
        match stop {
            None => {}
            Some(CodecError::Miss(f)) => {
                misses.push(f);
                assert!(out.len() >= before);
                let answer = enc.mirror.chunk(&f).expect("the sender kept it");
                assert!(d.insert_verified(f, &answer));
            }
            Some(e) => panic!("decode: {e}"),
        }
        assert!(misses.len() <= most, "{} misses", misses.len());
    }
    misses
}

/// A link's frame room for a turn's records (a 256 KiB frame).
const ROOM: usize = 256 * 1024 - 4;

/// A bulk stream with more queued than a turn takes has its next turn's chunks cut and
/// fingerprinted on the workers while a turn encodes: the records are still the very ones the
/// encoder writes alone, turn for turn (a link's 64 KiB quantum, so turns end in the middle of
/// what was cut ahead), with and without flushes, repeats, deltas and contexts, and decode to
/// the stream: cut in one job on two threads, in pieces on three.
#[test]
fn chunks_cut_ahead_encode_to_the_same_records() {
    let first = [
        crate::testdata::rows(21, 120),
        crate::testdata::noise(4, 700_000),
        crate::testdata::words(5, 60),
    ]
    .concat();
    let changed = crate::testdata::edited(&first, 9);
    let data = [&first[..], &changed[..], &first[..]].concat();
    let configs = [
        (Compression::Lz4, true, false, Pressure::CpuBound),
        (Compression::Adaptive, true, true, Pressure::LinkBound),
        (Compression::Zstd, true, false, Pressure::LinkBound),
        (Compression::Adaptive, false, true, Pressure::LinkBound),
        (Compression::Lz4, false, false, Pressure::CpuBound),
    ];
    for (compression, dedup, context, pressure) in configs {
        for flush in [false, true] {
            let cfg = CodecConfig {
                compression,
                dedup,
                context,
                ..CodecConfig::default()
            };
            let wire = |enc: &mut Encoder| {
                enc.set_turn_limits(65_536, ROOM);
                encode_all(pressure, enc, &data, &[1 << 20, 300_000], flush)
            };
            let (mut alone, _) = pair(&cfg);
            let (mut pooled, mut dec) = pair(&cfg);
            // Two threads cut the next turn in one job, three in pieces.
            let threads = std::sync::Arc::new(Threads::new(if flush { 2 } else { 3 }));
            pooled.set_workers(Some(threads.clone()));
            let (a, b) = (wire(&mut alone), wire(&mut pooled));
            let what = format!("{compression:?} dedup {dedup} context {context} flush {flush}");
            assert!(a == b, "{what}: {} and {} bytes", a.len(), b.len());
            assert_eq!(alone.stats(), pooled.stats(), "{what}");
            let cuts = threads.1.load(std::sync::atomic::Ordering::Relaxed);
            assert!(cuts > 20, "{what}: {cuts} jobs cut chunks ahead");
            let in_pieces = threads.2.load(std::sync::atomic::Ordering::Relaxed);
            assert_eq!(
                in_pieces > 10,
                !flush,
                "{what}: {in_pieces} turns cut in pieces"
            );
            if dedup {
                assert!(
                    pooled.stats().hit_chunks > 100,
                    "{what}: {:?}",
                    pooled.stats()
                );
            }
            let mut out = Vec::new();
            dec.decode(&b, &mut out).expect("decodes");
            assert!(out == data, "{what}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// Chunks prepared on worker threads encode to the very records the encoder writes alone,
    /// whatever the codec, pressure, dedup and write sizes (repeats and noise included), and
    /// decode to the stream.
    #[test]
    fn prepared_chunks_encode_to_the_same_records(
        parts in proptest::collection::vec((0u8..3, 0usize..300_000, any::<u64>()), 1..6),
        pieces in proptest::collection::vec(1usize..1_200_000, 1..6),
        compression in prop::sample::select(vec![
            Compression::Adaptive, Compression::Lz4, Compression::Zstd, Compression::None,
        ]),
        cpu in any::<bool>(),
        dedup in any::<bool>(),
        context in any::<bool>(),
        threads in 1usize..4,
        quantum in prop::option::of(2_000usize..100_000),
        flush in any::<bool>(),
    ) {
        let data = mix(&parts);
        let cfg = CodecConfig { compression, dedup, context, ..CodecConfig::default() };
        let pressure = if cpu { Pressure::CpuBound } else { Pressure::LinkBound };
        let wire = |enc: &mut Encoder| {
            if let Some(q) = quantum {
                enc.set_turn_limits(q, ROOM);
            }
            encode_all(pressure, enc, &data, &pieces, flush)
        };
        let (mut alone, _) = pair(&cfg);
        let (mut pooled, mut dec) = pair(&cfg);
        pooled.set_workers(Some(std::sync::Arc::new(Threads::new(threads))));
        let a = wire(&mut alone);
        let b = wire(&mut pooled);
        prop_assert!(a == b, "{} and {} bytes", a.len(), b.len());
        prop_assert_eq!(alone.stats(), pooled.stats());
        let mut out = Vec::new();
        dec.decode(&b, &mut out).expect("decodes");
        prop_assert!(out == data);
        // A decoder that decompresses on the workers rebuilds the same, and caches the same.
        let mut pooled_dec = Decoder::new(&cfg);
        pooled_dec.set_workers(Some(std::sync::Arc::new(Threads::new(threads))));
        let mut out2 = Vec::new();
        pooled_dec.decode(&b, &mut out2).expect("decodes");
        prop_assert!(out2 == data);
        prop_assert_eq!(pooled_dec.stats(), dec.stats());
        prop_assert_eq!(pooled_dec.cache().snapshot().digest(), dec.cache().snapshot().digest());
    }

    /// Damaged records decode through a decoder with workers exactly as through one without:
    /// the same bytes, then the same error (or none), literals alone or in stream contexts.
    #[test]
    fn prepared_decoding_of_damaged_records_matches(
        len in 1usize..200_000,
        seed in any::<u64>(),
        hits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..8),
        cut in any::<prop::sample::Index>(),
        context in any::<bool>(),
    ) {
        let cfg = CodecConfig { context, ..CodecConfig::default() };
        let data = [db_blocks(len / 8192 + 1, seed), xorshift(seed, len / 3)].concat();
        let (mut enc, _) = pair(&cfg);
        let mut wire = Vec::new();
        enc.push(&data, true, Pressure::CpuBound, &mut wire);
        enc.push(&data[..len / 2], true, Pressure::CpuBound, &mut wire);
        for (at, x) in hits {
            let i = at.index(wire.len());
            wire[i] ^= x;
        }
        wire.truncate(cut.index(wire.len() + 1));
        let (mut plain, mut pooled) = (Decoder::new(&cfg), Decoder::new(&cfg));
        pooled.set_workers(Some(std::sync::Arc::new(Threads::new(2))));
        let (mut a, mut b) = (Vec::new(), Vec::new());
        let ra = plain.decode(&wire, &mut a);
        let rb = pooled.decode(&wire, &mut b);
        prop_assert_eq!(ra, rb);
        prop_assert!(a == b);
    }
}

/// What [`Streams`](crate::Streams) made of `parts` (one stream each, written 64 KiB at a time
/// to each in turn): each turn's stream and records.
pub(super) fn side_by_side(
    streams: &mut crate::Streams,
    parts: &[Vec<u8>],
    pressure: Pressure,
) -> Vec<(usize, Vec<u8>)> {
    let (mut out, mut turns) = (Vec::new(), Vec::new());
    let parts: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
    streams.send(&parts, 65_536, pressure, &mut out, &mut turns);
    let mut from = 0;
    turns
        .into_iter()
        .map(|(k, end)| {
            let records = out[from..end].to_vec();
            from = end;
            (k, records)
        })
        .collect()
}

/// Four streams' first copy (`firsts`) and then `changed` sent side by side in stream contexts
/// at a stated WAN, deltas on: the config and each copy's turns (see [`side_by_side`]).
pub(super) type Turns = Vec<(usize, Vec<u8>)>;
pub(super) fn in_contexts(firsts: &[Vec<u8>], changed: &[Vec<u8>]) -> (CodecConfig, Turns, Turns) {
    let cfg = CodecConfig {
        context: true,
        delta_bytes: 64 << 20,
        ..CodecConfig::default()
    };
    let mut s = crate::Streams::new(cfg.clone(), 4, 256 << 10);
    let first = side_by_side(&mut s, firsts, Pressure::LinkBound);
    let second = side_by_side(&mut s, changed, Pressure::LinkBound);
    (cfg, first, second)
}

/// A parallel copy's streams encoded against one mirror, turn by turn as a link takes them (a
/// first copy, then a changed one on the same streams): the same records on any number of
/// workers, with and without stream contexts; each turn decodes alone, in order, in its
/// stream's context, to exactly the stream's bytes; a chunk one stream sent is another's
/// reference (and, at a stated WAN, delta base).
#[test]
fn streams_side_by_side_encode_alike_and_decode_turn_by_turn() {
    let (firsts, mut changed) = crate::testdata::parallel_copies(4, 4, 400);
    // The last stream sends again what the first sent: references to another stream's chunks.
    changed[3] = firsts[0].clone();
    for (context, pressure) in [(false, Pressure::CpuBound), (true, Pressure::LinkBound)] {
        let cfg = CodecConfig {
            context,
            delta_bytes: 64 << 20,
            ..CodecConfig::default()
        };
        let encode = |threads: usize| {
            let mut s = crate::Streams::new(cfg.clone(), 4, 256 << 10);
            if threads > 1 {
                s.set_workers(Some(std::sync::Arc::new(Threads::new(threads))));
            }
            let mut turns = side_by_side(&mut s, &firsts, pressure);
            turns.extend(side_by_side(&mut s, &changed, pressure));
            (turns, s.stats().clone())
        };
        let (alone, stats) = encode(1);
        for threads in [2, 3] {
            let (pooled, pooled_stats) = encode(threads);
            assert!(alone == pooled, "context {context}, {threads} threads");
            assert_eq!(stats, pooled_stats);
        }
        assert!(stats.hit_chunks > 300, "{stats:?}");
        assert_eq!(stats.delta_chunks > 0, context, "{stats:?}");
        let used: std::collections::BTreeSet<usize> = alone.iter().map(|t| t.0).collect();
        assert_eq!(used.len(), 4);
        let mut digests = Vec::new();
        for (threads, ahead) in [(1, 0), (2, 0), (2, 1), (2, 3), (3, 8)] {
            let (dec, outs, fed) = decode_streams(&cfg, &alone, threads, ahead);
            assert_eq!(fed > 0, ahead > 0, "{fed} frames fed ahead");
            // Literals alone are decompressed ahead only in frames fed ahead (as many as the
            // workers get to first: `literals_fed_ahead_land_exactly_and_only_for_their_own_bytes`
            // holds what they take), and a first copy in a context has none.
            if context || ahead == 0 {
                assert_eq!(dec.lits_ahead(), 0, "{threads} threads, {ahead} ahead");
            }
            for k in 0..4 {
                assert!(
                    outs[k] == [&firsts[k][..], &changed[k][..]].concat(),
                    "stream {k}, {threads} threads, {ahead} ahead"
                );
            }
            digests.push((dec.cache().digest(), dec.stats()));
        }
        // The cache saw the same chunks in the same order, however the frames were fed.
        assert!(digests.windows(2).all(|w| w[0] == w[1]));
    }
}

/// One stream in its context, each turn planned while the one before waits for its context
/// records (`send::emit_pending`: a turn needs nothing of what the one before cost, only the
/// context, which the stream's queue keeps from one record to the next): a first copy, a
/// changed one (its delta runs made by the maker) and the first again give the same records
/// and counts on one, two and three threads, and decode exactly, fed ahead or not.
#[test]
fn one_streams_turns_planned_while_the_one_before_is_made_encode_alike_on_any_threads() {
    use crate::testdata::{edited, rows};
    let first = rows(7, 400);
    let copies = [first.clone(), edited(&first, 1), first];
    let cfg = CodecConfig {
        context: true,
        delta_bytes: 64 << 20,
        ..CodecConfig::default()
    };
    let encode = |threads: usize| {
        let mut s = crate::Streams::new(cfg.clone(), 1, 256 << 10);
        if threads > 1 {
            s.set_workers(Some(std::sync::Arc::new(Threads::new(threads))));
        }
        let mut turns = Vec::new();
        for copy in &copies {
            turns.extend(side_by_side(
                &mut s,
                std::slice::from_ref(copy),
                Pressure::LinkBound,
            ));
        }
        (turns, s.stats().clone())
    };
    let (alone, stats) = encode(1);
    assert!(
        stats.planned_behind * 10 > stats.frames * 8,
        "{} of {} turns planned behind the one before",
        stats.planned_behind,
        stats.frames
    );
    // The changed copy's runs, made by the maker, do not pay against a context that holds
    // their bases (their chunks go as literals in it); the first copy sent again is all
    // references.
    assert!(
        stats.no_base_chunks > 200 && stats.hit_chunks > 300,
        "{stats:?}"
    );
    for threads in [2, 3] {
        let (pooled, pooled_stats) = encode(threads);
        assert!(alone == pooled, "{threads} threads");
        assert_eq!(stats, pooled_stats);
    }
    let want: Vec<u8> = copies.concat();
    for (threads, ahead) in [(1, 0), (2, 3)] {
        let (_, outs, _) = decode_streams(&cfg, &alone, threads, ahead);
        assert!(outs[0] == want, "{threads} threads, {ahead} ahead");
    }
}

/// Delta runs in stream contexts are made by the streams' makers, on the workers while other
/// streams' turns are planned (`maker::RunJob`): a changed copy of four streams side by side,
/// whose runs mostly pay, and a rewritten one, whose runs mostly do not (their chunks then go
/// as literals in their streams' contexts), give the same records and counts on one, two and
/// three threads, and decode exactly, fed ahead or not.
#[test]
fn delta_runs_made_apart_pay_or_go_as_literals_alike_on_any_threads() {
    use crate::testdata::{BLOCK, edited, rows, words};
    let firsts: Vec<Vec<u8>> = (0..4).map(|i| rows(40 + i, 160)).collect();
    // Each stream changes the next one's copy, which its own context never saw.
    let next = |i: usize| &firsts[(i + 1) % 4];
    let changed: Vec<Vec<u8>> = (0..4).map(|i| edited(next(i), i)).collect();
    // Each block keeps its first eighth and its last; the rest is new text, which a delta
    // saves little of.
    let rewritten: Vec<Vec<u8>> = (0..4)
        .map(|i| {
            let f = next(i);
            let fresh = words(70 + i as u64, f.len() / BLOCK);
            let mut out = f.clone();
            for (b, n) in out.chunks_mut(BLOCK).zip(fresh.chunks(BLOCK)) {
                b[BLOCK / 8..BLOCK - 64].copy_from_slice(&n[BLOCK / 8..BLOCK - 64]);
            }
            out
        })
        .collect();
    let cfg = CodecConfig {
        context: true,
        delta_bytes: 64 << 20,
        ..CodecConfig::default()
    };
    let copies = [&firsts, &changed, &rewritten];
    let encode = |threads: usize| {
        let mut s = crate::Streams::new(cfg.clone(), 4, 256 << 10);
        if threads > 1 {
            s.set_workers(Some(std::sync::Arc::new(Threads::new(threads))));
        }
        let mut turns = Vec::new();
        let mut per = Vec::new();
        for copy in copies {
            let before = s.stats().clone();
            turns.extend(side_by_side(&mut s, copy, Pressure::LinkBound));
            let after = s.stats();
            per.push((
                after.delta_chunks - before.delta_chunks,
                after.no_base_chunks - before.no_base_chunks,
            ));
        }
        (turns, s.stats().clone(), per)
    };
    let (alone, stats, per) = encode(1);
    for threads in [2, 3] {
        let (pooled, pooled_stats, _) = encode(threads);
        assert!(alone == pooled, "{threads} threads");
        assert_eq!(stats, pooled_stats);
    }
    // The changed copy goes mostly as deltas; the rewritten one mostly as literals offered a
    // base.
    let blocks = 4 * 160;
    assert!(per[1].0 > blocks / 2 && per[1].1 < blocks / 10, "{per:?}");
    assert!(per[2].1 > blocks / 4, "{per:?}");
    for (threads, ahead) in [(1, 0), (2, 3)] {
        let (_, outs, _) = decode_streams(&cfg, &alone, threads, ahead);
        for k in 0..4 {
            let want: Vec<u8> = copies.iter().flat_map(|c| c[k].clone()).collect();
            assert!(outs[k] == want, "stream {k}, {threads} threads");
        }
    }
}
