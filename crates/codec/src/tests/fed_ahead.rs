//! Frames fed to their streams' contexts ahead of their turn, on workers, while the frames
//! before them are decoded: their context records and delta runs rebuilt there (or once the
//! frames before bring the runs' bases), and their literals alone (one stream's frames fed
//! behind each other) decode to the same bytes, cache and misses as in turn, also after misses
//! and damage.

use super::runs::{Threads, in_contexts, side_by_side};
use super::*;

/// Delta runs rebuilt ahead, on a worker, while the frames before theirs are decoded (from the
/// bases the cache held when their frame was fed, or once the frames before bring them): taken
/// by their records after the bases are looked up in order, so the cache sees the same lookups
/// and chunks as in turn, and the bytes are the same; they and the runs fed to the streams'
/// contexts are copied into place in the output on the workers too. A base damaged after its
/// run was rebuilt ahead is a miss there as in turn, and the frame goes on, once it is
/// answered, to exactly the stream's bytes.
#[test]
fn delta_runs_rebuilt_ahead_take_the_lookups_of_runs_rebuilt_in_turn() {
    use crate::testdata::{edited, rows};
    let firsts: Vec<Vec<u8>> = (0..4).map(|i| rows(50 + i, 120)).collect();
    let changed: Vec<Vec<u8>> = (0..4).map(|i| edited(&firsts[(i + 1) % 4], i)).collect();
    let (cfg, first, second) = in_contexts(&firsts, &changed);
    let all: Vec<_> = first.iter().chain(&second).cloned().collect();
    let want = |k: usize| [&firsts[k][..], &changed[k][..]].concat();
    let (in_turn, outs, _) = decode_streams(&cfg, &all, 1, 0);
    assert_eq!(in_turn.runs_ahead(), 0);
    assert!(in_turn.stats().delta_chunks > 200, "{:?}", in_turn.stats());
    for (threads, ahead) in [(2, 1), (2, 3), (3, 8)] {
        let (dec, outs_ahead, _) = decode_streams(&cfg, &all, threads, ahead);
        assert!(
            dec.runs_ahead() > 10,
            "{threads} {ahead}: {} runs ahead",
            dec.runs_ahead()
        );
        assert_eq!(dec.stats(), in_turn.stats());
        assert_eq!(dec.cache().digest(), in_turn.cache().digest());
        for k in 0..4 {
            assert!(outs_ahead[k] == want(k) && outs[k] == want(k), "stream {k}");
        }
    }

    // One copy whose streams are edits of each other, side by side: a run's bases are often in
    // another stream's frame still waiting to be decoded when its own frame is fed, and are
    // rebuilt once that frame is (`Decoder::rebuild_later`).
    let mut chain = vec![rows(70, 120)];
    for i in 1..4 {
        chain.push(edited(&chain[i - 1], i));
    }
    let mut s = crate::Streams::new(cfg.clone(), 4, 256 << 10);
    let frames = side_by_side(&mut s, &chain, Pressure::LinkBound);
    assert!(s.stats().delta_chunks > 100, "{:?}", s.stats());
    let (in_turn_chain, _, _) = decode_streams(&cfg, &frames, 1, 0);
    let (dec, outs, _) = decode_streams(&cfg, &frames, 2, 3);
    assert!(outs == chain);
    // Most of what the runs and the streams' contexts rebuilt was copied into place on the
    // workers (the decoder's thread only counts it in).
    let rebuilt = dec.stats().lit_bytes + dec.stats().delta_bytes;
    assert!(
        dec.ahead_bytes() * 2 > rebuilt,
        "{} of {rebuilt}",
        dec.ahead_bytes()
    );
    assert_eq!(dec.stats(), in_turn_chain.stats());
    assert_eq!(dec.cache().digest(), in_turn_chain.cache().digest());
    let runs = frames.iter().map(|f| count_delta_runs(&f.1)).sum::<usize>();
    assert!(
        dec.runs_ahead() as usize * 10 > runs * 8,
        "{} of {runs} runs rebuilt ahead",
        dec.runs_ahead()
    );

    // Every chunk damaged once the first frame with a run rebuilt ahead is fed: the same misses,
    // one by one, as when nothing is fed ahead.
    let workers: std::sync::Arc<dyn prepare::Workers> = std::sync::Arc::new(Threads::new(2));
    let damaged = |ahead: bool, at: Option<usize>| {
        let mut dec = Decoder::new(&cfg);
        dec.set_workers(Some(workers.clone()));
        let mut ctxs: Vec<crate::StreamContext> = (0..4).map(|_| Default::default()).collect();
        let mut outs = vec![Vec::new(); 4];
        let io = (&mut ctxs[..], &mut outs[..]);
        decode_fed_ahead(&mut dec, &first, 3, Some(workers.clone()), io, |_| None);
        let (mut when, mut misses) = (None, Vec::new());
        for (i, (k, records)) in second.iter().enumerate() {
            if ahead
                && let Some(f) = dec.feed_ahead(records.clone().into(), &mut ctxs[*k], usize::MAX)
            {
                prepare::Deferred::spawn(&f, &*workers);
                f.finish(&mut ctxs[*k]);
            }
            let now = match at {
                Some(at) => at == i,
                None => when.is_none() && !ctxs[*k].runs_fed.is_empty(),
            };
            if now {
                assert!(dec.cache_mut().corrupt_all_for_test() > 0);
                when = Some(i);
            }
            let mut at = 0;
            while at < records.len() {
                let (used, stop) =
                    dec.decode_frame(&records[at..], &mut outs[*k], &mut ctxs[*k], usize::MAX);
                at += used;
                match stop {
                    None => assert_eq!(at, records.len()),
                    Some(CodecError::Miss(f)) => {
                        misses.push(f);
                        let bytes = in_turn.cache().peek(&f).expect("a chunk to answer with");
                        assert!(dec.insert_verified(f, bytes));
                    }
                    Some(e) => panic!("stream {k}: {e}"),
                }
            }
        }
        for (k, out) in outs.iter().enumerate() {
            assert!(*out == want(k), "stream {k}");
        }
        (when, misses, dec.runs_ahead())
    };
    let (when, misses, ahead) = damaged(true, None);
    assert!(
        when.is_some() && ahead > 0,
        "damaged at {when:?}, {ahead} runs ahead"
    );
    let (_, in_turn_misses, none) = damaged(false, when);
    assert_eq!(none, 0);
    assert!(
        !misses.is_empty() && misses == in_turn_misses,
        "{} misses",
        misses.len()
    );
}

/// The delta run records among a frame's `records`.
fn count_delta_runs(records: &[u8]) -> usize {
    let (mut at, mut runs) = (0, 0);
    while let Some(&first) = records.get(at) {
        runs += usize::from(matches!(
            first,
            crate::format::TAG_DELTA_RUN | crate::format::TAG_DELTA_RUN_BARE
        ));
        match crate::decoder::record_len(first, &records[at..]) {
            Some(n) => at += n,
            None => break,
        }
    }
    runs
}

/// Four streams' `frames` decoded by a new decoder on `threads` threads, fed `ahead` (see
/// [`decode_fed_ahead`]): the decoder, each stream's bytes, and how many frames were fed ahead.
pub(super) fn decode_streams(
    cfg: &CodecConfig,
    frames: &[(usize, Vec<u8>)],
    threads: usize,
    ahead: usize,
) -> (Decoder, Vec<Vec<u8>>, usize) {
    let mut dec = Decoder::new(cfg);
    let workers: Option<std::sync::Arc<dyn prepare::Workers>> =
        (threads > 1).then(|| std::sync::Arc::new(Threads::new(threads)) as _);
    dec.set_workers(workers.clone());
    let mut outs = vec![Vec::new(); 4];
    let mut ctxs: Vec<crate::StreamContext> =
        (0..4).map(|_| crate::StreamContext::default()).collect();
    let io = (&mut ctxs[..], &mut outs[..]);
    let fed = decode_fed_ahead(&mut dec, frames, ahead, workers, io, |_| None);
    (dec, outs, fed)
}

/// Decodes each stream's turns (`frames`, in the order a link took them) as a link does: with
/// `ahead` of 1 or more, each frame is fed to its stream's context on `workers` (the caller
/// feeding later ones while a worker feeds the oldest), up to `ahead` of them, while the
/// frames before it are decoded in order ([`Feeds`](crate::Feeds)). A miss is answered with
/// the bytes `answer` gives, and the frame goes on where it stopped. Returns how many frames
/// were fed ahead.
fn decode_fed_ahead(
    dec: &mut Decoder,
    frames: &[(usize, Vec<u8>)],
    ahead: usize,
    workers: Option<std::sync::Arc<dyn prepare::Workers>>,
    (ctxs, outs): (&mut [crate::StreamContext], &mut [Vec<u8>]),
    answer: impl FnMut(&crate::fingerprint::Fingerprint) -> Option<Vec<u8>>,
) -> usize {
    decode_fed_ahead_most(dec, frames, ahead, workers, (ctxs, outs), answer).0
}

/// [`decode_fed_ahead`], also returning the most frames that waited fed ahead at once, the
/// frames fed while their stream's earlier frame was decoded, and the chunks handed on. The
/// even streams' frames are decoded as the link decodes them, the chunks of compressed
/// literals and context records handed on as they are ([`Decoder::decode_frame_handing`]; the
/// stream's bytes put together at the end); the odd streams' copied into the output.
fn decode_fed_ahead_most(
    dec: &mut Decoder,
    frames: &[(usize, Vec<u8>)],
    ahead: usize,
    workers: Option<std::sync::Arc<dyn prepare::Workers>>,
    (ctxs, outs): (&mut [crate::StreamContext], &mut [Vec<u8>]),
    mut answer: impl FnMut(&crate::fingerprint::Fingerprint) -> Option<Vec<u8>>,
) -> (usize, usize, usize, usize) {
    let wire = bytes::Bytes::from(frames.iter().flat_map(|f| f.1.clone()).collect::<Vec<u8>>());
    let mut handed: Vec<crate::HandedOn> = outs.iter().map(|_| Default::default()).collect();
    let mut decode = |dec: &mut Decoder, k: usize, r: std::ops::Range<usize>, ctx: &mut _| {
        let records = &wire[r];
        let mut at = 0;
        while at < records.len() {
            let (rest, out) = (&records[at..], &mut outs[k]);
            let (used, stop) = match k % 2 {
                0 => dec.decode_frame_handing(rest, out, &mut handed[k], ctx, usize::MAX),
                _ => dec.decode_frame(rest, out, ctx, usize::MAX),
            };
            at += used;
            match stop {
                None => assert_eq!(at, records.len()),
                Some(CodecError::Miss(f)) => {
                    let bytes = answer(&f).expect("a chunk to answer with");
                    assert!(dec.insert_verified(f, &bytes));
                }
                Some(e) => panic!("stream {k}: {e}"),
            }
        }
    };
    let mut order = crate::InOrder::new(ahead, workers);
    let (mut from, mut fed, mut most) = (0, 0, 0);
    for (k, records) in frames {
        let r = from..from + records.len();
        from = r.end;
        fed += usize::from(order.frame(dec, (&wire, *k, r), ctxs, &mut decode));
        most = most.max(order.waiting());
    }
    order.finish(dec, ctxs, &mut decode);
    let mut chunks = 0;
    for (out, h) in outs.iter_mut().zip(handed) {
        chunks += h.len();
        *out = h.assemble(out);
    }
    (fed, most, order.fed_next(), chunks)
}

/// Frames fed ahead of their turn, when a chunk they refer to is damaged in the cache: the
/// frame stops at the miss with its later context records already fed, and goes on from there
/// once the chunk is answered, to exactly the stream's bytes. A damaged context record fed
/// ahead fails its frame as it does fed in turn, never rebuilding a wrong byte. One stream's
/// frames are fed one after the other.
#[test]
fn frames_fed_ahead_resume_after_misses_and_fail_as_in_turn() {
    let (firsts, mut changed) = crate::testdata::parallel_copies(4, 4, 400);
    changed[3] = firsts[0].clone();
    let (cfg, first, second) = in_contexts(&firsts, &changed);
    let fresh = || -> Vec<crate::StreamContext> { (0..4).map(|_| Default::default()).collect() };
    // One decoder in turn, whose cache answers the other's misses.
    let mut whole = Decoder::new(&cfg);
    let (mut ctxs, mut outs) = (fresh(), vec![Vec::new(); 4]);
    let all: Vec<_> = first.iter().chain(&second).cloned().collect();
    decode_fed_ahead(&mut whole, &all, 0, None, (&mut ctxs, &mut outs), |_| None);

    let workers: std::sync::Arc<dyn prepare::Workers> = std::sync::Arc::new(Threads::new(2));
    let mut dec = Decoder::new(&cfg);
    dec.set_workers(Some(workers.clone()));
    let (mut ctxs, mut outs) = (fresh(), vec![Vec::new(); 4]);
    let io = (&mut ctxs[..], &mut outs[..]);
    decode_fed_ahead(&mut dec, &first, 3, Some(workers.clone()), io, |_| None);
    // Every fifth chunk of the first stream's first copy, which the last stream sends again.
    damage_every_fifth(&mut dec, &firsts[0], &cfg);
    let mut misses = 0;
    let io = (&mut ctxs[..], &mut outs[..]);
    let fed = decode_fed_ahead(&mut dec, &second, 3, Some(workers.clone()), io, |f| {
        misses += 1;
        whole.cache().peek(f).map(<[u8]>::to_vec)
    });
    assert!(misses > 10 && fed > 10, "{misses} misses, {fed} fed");
    for k in 0..4 {
        assert!(outs[k] == [&firsts[k][..], &changed[k][..]].concat(), "{k}");
    }

    // One stream: each frame fed once the one before it is decoded.
    let mut one = crate::Streams::new(cfg.clone(), 1, 256 << 10);
    let frames = side_by_side(&mut one, &firsts[..1], Pressure::LinkBound);
    let (mut c1, mut o1) = (vec![crate::StreamContext::default()], vec![Vec::new()]);
    let mut d1 = Decoder::new(&cfg);
    d1.set_workers(Some(workers.clone()));
    let io = (&mut c1[..], &mut o1[..]);
    let fed = decode_fed_ahead(&mut d1, &frames, 8, Some(workers.clone()), io, |_| None);
    assert!(fed * 10 > frames.len() * 9, "{fed} of {} fed", frames.len());
    assert!(o1[0] == firsts[0]);

    // A byte of a context record damaged (one that zstd, or the record's checks, find: a
    // literal byte changed is found by nobody, as in a literal alone, which is what TLS is
    // for): the same stop fed ahead as in turn, and what was rebuilt before it is the stream's.
    let (k, records) = &first[0];
    let in_turn = |bad: &[u8]| {
        let mut d = Decoder::new(&cfg);
        let mut out = Vec::new();
        let r = d.decode_frame(bad, &mut out, &mut Default::default(), usize::MAX);
        (r, out)
    };
    let (bad, in_turn) = (records.len() / 3..records.len())
        .step_by(101)
        .find_map(|at| {
            let mut bad = records.clone();
            bad[at] ^= 0x55;
            let r = in_turn(&bad);
            r.0.1.is_some().then_some((bad, r))
        })
        .expect("damage that is found");
    let mut d = Decoder::new(&cfg);
    let feeding = d
        .feed_ahead(bad.clone().into(), &mut Default::default(), usize::MAX)
        .expect("a frame of context records");
    prepare::Deferred::spawn(&feeding, &*workers);
    let mut ctx = Default::default();
    feeding.finish(&mut ctx);
    let mut out = Vec::new();
    let r = d.decode_frame(&bad, &mut out, &mut ctx, usize::MAX);
    assert_eq!((r, &out), (in_turn.0, &in_turn.1));
    assert!(firsts[*k].starts_with(&out));
}

/// Literals alone (LZ4) decompressed ahead with their frames on a worker, while the frames
/// before them are decoded: the same bytes, stats and cache as in turn, also when chunks the
/// frames refer to are damaged (each frame stops at its miss and goes on from there once it is
/// answered, its later literals still taken as fed). A literal fed from other bytes than the
/// record's (one payload byte changed after its frame was fed) is never taken: the record
/// decodes as it does in turn.
#[test]
fn literals_fed_ahead_land_exactly_and_only_for_their_own_bytes() {
    let (firsts, mut changed) = crate::testdata::parallel_copies(4, 4, 400);
    changed[3] = firsts[0].clone();
    let cfg = CodecConfig {
        context: false,
        ..CodecConfig::default()
    };
    let mut s = crate::Streams::new(cfg.clone(), 4, 256 << 10);
    let first = side_by_side(&mut s, &firsts, Pressure::CpuBound);
    let second = side_by_side(&mut s, &changed, Pressure::CpuBound);
    let fresh = || -> Vec<crate::StreamContext> { (0..4).map(|_| Default::default()).collect() };
    let all: Vec<_> = first.iter().chain(&second).cloned().collect();
    let mut whole = Decoder::new(&cfg);
    let (mut ctxs, mut outs) = (fresh(), vec![Vec::new(); 4]);
    decode_fed_ahead(&mut whole, &all, 0, None, (&mut ctxs, &mut outs), |_| None);
    assert!(whole.stats().lit_chunks > 100, "{:?}", whole.stats());

    // Every frame fed when it comes (after another stream's), before the frames before it are
    // decoded, and decoding batches on two threads.
    let workers: std::sync::Arc<dyn prepare::Workers> = std::sync::Arc::new(FedAtOnce);
    let mut dec = Decoder::new(&cfg);
    dec.set_workers(Some(std::sync::Arc::new(Threads::new(2))));
    let (mut ctxs, mut outs) = (fresh(), vec![Vec::new(); 4]);
    let io = (&mut ctxs[..], &mut outs[..]);
    decode_fed_ahead(&mut dec, &first, 3, Some(workers.clone()), io, |_| None);
    assert_eq!(dec.lits_ahead(), whole_first_lits(&first));
    assert_eq!(dec.stats(), {
        let mut d = Decoder::new(&cfg);
        let (mut c, mut o) = (fresh(), vec![Vec::new(); 4]);
        decode_fed_ahead(&mut d, &first, 0, None, (&mut c, &mut o), |_| None);
        d.stats()
    });
    // Every fifth chunk of the first stream's first copy, which the last stream sends again.
    damage_every_fifth(&mut dec, &firsts[0], &cfg);
    let io = (&mut ctxs[..], &mut outs[..]);
    let misses = decode_answered(&mut dec, &second, workers.clone(), io, &whole);
    assert!(misses > 10, "{misses} misses");
    // All but those of a stream's frames that follow one of its own (fed in their turn).
    let lits = whole_first_lits(&first) + whole_first_lits(&second);
    assert!(
        dec.lits_ahead() * 10 > lits * 9,
        "{} of {lits} literals taken as fed",
        dec.lits_ahead()
    );
    for k in 0..4 {
        assert!(outs[k] == [&firsts[k][..], &changed[k][..]].concat(), "{k}");
    }

    // One frame's literals fed (here, as the caller helps while a worker feeds another), then
    // the frame decoded: all of them taken, and the bytes are the frame's.
    let (k, records) = first
        .iter()
        .find(|(_, r)| lz4_payloads(r).len() > 4)
        .expect("a frame of LZ4 literals");
    let in_turn = |frame: &[u8]| {
        let mut d = Decoder::new(&cfg);
        let mut out = Vec::new();
        let r = d.decode_frame(frame, &mut out, &mut Default::default(), usize::MAX);
        (r, out)
    };
    let fed_then_decoded = |fed: &[u8], decoded: &[u8], hand: bool| {
        let mut d = Decoder::new(&cfg);
        // Decoding batches too, around the literals taken as fed.
        d.set_workers(Some(std::sync::Arc::new(Threads::new(2))));
        let feeding = d
            .feed_ahead(fed.to_vec().into(), &mut Default::default(), usize::MAX)
            .expect("a frame of literals");
        // Literals alone: fed without the stream's context, one a call as the caller helps,
        // until none is left.
        assert!(!feeding.holds_context());
        let mut helped = 0;
        while prepare::Deferred::help(&feeding) {
            helped += 1;
        }
        assert_eq!(helped, lz4_payloads(fed).len());
        let mut ctx = Default::default();
        feeding.finish(&mut ctx);
        let mut out = Vec::new();
        let mut handed = crate::HandedOn::default();
        let r = match hand {
            true => d.decode_frame_handing(decoded, &mut out, &mut handed, &mut ctx, usize::MAX),
            false => d.decode_frame(decoded, &mut out, &mut ctx, usize::MAX),
        };
        // Handed on as they are: each literal taken as fed (and those decompressed here).
        match hand {
            true => assert!(handed.len() as u64 >= d.lits_ahead()),
            false => assert!(handed.is_empty()),
        }
        (r, handed.assemble(&out), d.lits_ahead())
    };
    let lits = lz4_payloads(records);
    // Copied into the output, and handed on as they are (as the link takes them).
    for hand in [false, true] {
        let (r, out, taken) = fed_then_decoded(records, records, hand);
        assert_eq!((r, &out), (in_turn(records).0, &in_turn(records).1));
        assert!(firsts[*k].starts_with(&out));
        assert_eq!(taken, lits.len() as u64);
        // The frame changed after it was fed, in its second literal's payload (same lengths):
        // no literal is taken from the feeding from there on, and what decodes is what decodes
        // in turn (here a literal that no longer rebuilds its length, or other bytes).
        let mut other = records.clone();
        other[lits[1].start + lits[1].len() / 2] ^= 0x20;
        let (r, out, taken) = fed_then_decoded(records, &other, hand);
        assert_eq!((r, &out), (in_turn(&other).0, &in_turn(&other).1));
        assert_eq!(taken, 1, "only the literal before the change");
        // The frame damaged before it was fed, in its second literal's lengths (the payload no
        // longer rebuilds what its header says): its feeding takes the first literal alone,
        // and the frame decodes as it does in turn, to the same error.
        let mut bad = records.clone();
        let at = lits[1].start;
        bad[at..at + 8].copy_from_slice(&[0xF0; 8]);
        let (r, out, taken) = fed_then_decoded(&bad, &bad, hand);
        assert!(r.1.is_some(), "a damaged literal decodes to an error");
        assert_eq!((r, &out), (in_turn(&bad).0, &in_turn(&bad).1));
        assert_eq!(taken, 1, "only the literal before the damage");
    }
}

/// One stream on the LZ4 path: each frame's literals are fed without the stream's context,
/// while its earlier frames wait to be decoded (up to three at once), on workers that feed at
/// once and on two threads. The first copy takes every literal as fed, with the in-turn
/// decoder's stats and cache; a changed copy with every fifth chunk damaged misses, goes on
/// from each miss once it is answered, and lands exactly.
#[test]
fn one_streams_frames_fed_behind_its_waiting_ones_decode_exactly() {
    let (mut firsts, mut changed) = crate::testdata::parallel_copies(1, 4, 400);
    let (first_copy, changed_copy) = (firsts.remove(0), changed.remove(0));
    let cfg = CodecConfig {
        context: false,
        ..CodecConfig::default()
    };
    let mut s = crate::Streams::new(cfg.clone(), 1, 256 << 10);
    let first = side_by_side(
        &mut s,
        std::slice::from_ref(&first_copy),
        Pressure::CpuBound,
    );
    let again = [first_copy.clone(), changed_copy.clone()].concat();
    let second = side_by_side(&mut s, std::slice::from_ref(&again), Pressure::CpuBound);
    assert!(first.len() > 8, "{} frames", first.len());
    let mut whole = Decoder::new(&cfg);
    let (mut ctxs, mut outs) = (vec![Default::default()], vec![Vec::new()]);
    decode_fed_ahead(&mut whole, &first, 0, None, (&mut ctxs, &mut outs), |_| {
        None
    });
    let in_turn = (whole.stats(), whole.cache().digest());
    let (mut c, mut o) = (vec![Default::default()], vec![Vec::new()]);
    decode_fed_ahead(&mut whole, &second, 0, None, (&mut c, &mut o), |_| None);
    // Workers that feed each frame as it comes, and real threads (the decoder's thread takes
    // what they have not when the frame's turn comes): every literal is taken as fed.
    let pools: [std::sync::Arc<dyn prepare::Workers>; 2] = [
        std::sync::Arc::new(FedAtOnce),
        std::sync::Arc::new(Threads::new(2)),
    ];
    for workers in pools {
        let mut dec = Decoder::new(&cfg);
        dec.set_workers(Some(std::sync::Arc::new(Threads::new(2))));
        let (mut ctxs, mut outs) = (vec![Default::default()], vec![Vec::new()]);
        let io = (&mut ctxs[..], &mut outs[..]);
        let (fed, most, _, handed) =
            decode_fed_ahead_most(&mut dec, &first, 3, Some(workers.clone()), io, |_| None);
        // Every literal was handed on as it is (the one stream is an even one).
        assert_eq!(handed as u64, whole_first_lits(&first));
        assert_eq!(fed, first.len(), "every frame fed");
        assert!(
            most > 1,
            "frames of the stream waited behind each other: {most}"
        );
        assert!(outs[0] == first_copy);
        assert_eq!((dec.stats(), dec.cache().digest()), in_turn);
        assert_eq!(dec.lits_ahead(), whole_first_lits(&first));
        damage_every_fifth(&mut dec, &first_copy, &cfg);
        let io = (&mut ctxs[..], &mut outs[..]);
        let misses = decode_answered(&mut dec, &second, workers.clone(), io, &whole);
        assert!(misses > 10, "{misses} misses");
        assert!(outs[0] == [&first_copy[..], &again[..]].concat());
    }
}

/// `frames` decoded fed ahead (three at once, on `workers`), each miss answered from `whole`'s
/// cache; returns how many there were.
fn decode_answered(
    dec: &mut Decoder,
    frames: &[(usize, Vec<u8>)],
    workers: std::sync::Arc<dyn prepare::Workers>,
    io: (&mut [crate::StreamContext], &mut [Vec<u8>]),
    whole: &Decoder,
) -> usize {
    let mut misses = 0;
    decode_fed_ahead(dec, frames, 3, Some(workers), io, |f| {
        misses += 1;
        whole.cache().peek(f).map(<[u8]>::to_vec)
    });
    misses
}

/// Damages, in `dec`'s cache, every fifth of the chunks `data` is cut into.
fn damage_every_fifth(dec: &mut Decoder, data: &[u8], cfg: &CodecConfig) {
    for (at, len) in chunks(data, cfg).step_by(5) {
        let f = crate::fingerprint::fingerprint(&data[at..at + len]);
        dec.cache_mut().corrupt_for_test(&f);
    }
}

/// The LZ4 literals alone in `frames`.
fn whole_first_lits(frames: &[(usize, Vec<u8>)]) -> u64 {
    frames.iter().map(|f| lz4_payloads(&f.1).len() as u64).sum()
}

/// Workers that do the work handed to them at once, on the calling thread (a frame is fed as
/// it comes), and run batches in turn.
#[derive(Debug)]
struct FedAtOnce;

impl prepare::Workers for FedAtOnce {
    fn run(&self, jobs: &mut [prepare::Job<'_>]) {
        jobs.iter_mut().for_each(prepare::Job::run);
    }

    fn threads(&self) -> usize {
        2
    }
}

/// The payloads of the LZ4 literals alone among a frame's `records`.
fn lz4_payloads(records: &[u8]) -> Vec<std::ops::Range<usize>> {
    let (mut at, mut found) = (0, Vec::new());
    while let Some(&first) = records.get(at) {
        if first & !NO_CACHE == TAG_LIT_LZ4 {
            let (_, h1) = get_len(records, at + 1).expect("a length");
            let (c, h2) = get_len(records, at + 1 + h1).expect("a length");
            let from = at + 1 + h1 + h2;
            found.push(from..from + c);
        }
        match crate::decoder::record_len(first, &records[at..]) {
            Some(n) => at += n,
            None => break,
        }
    }
    found
}

/// One stream in its context: each frame is fed on a worker behind the one before it while the
/// decoder's thread decodes those ([`Decoder::feed_after`]), on workers that feed at once and on real
/// threads. The same bytes, stats and cache as in turn, with a changed copy and the first
/// again (references); then with every fifth chunk damaged, each miss answered while the next
/// frame holds the context: exact. A frame whose context records are not all fed (a damaged one) gives the
/// next frame nothing: that one is decoded in turn after it, and the damage fails the earlier
/// frame as it does in turn.
#[test]
fn one_streams_next_frame_is_fed_while_the_one_before_is_decoded() {
    let (firsts, changed) = crate::testdata::parallel_copies(1, 4, 400);
    let changed = vec![[&changed[0][..], &firsts[0][..]].concat()];
    let (cfg, first, second) = in_contexts(&firsts, &changed);
    let all: Vec<_> = first.iter().chain(&second).cloned().collect();
    assert!(first.len() > 8, "{} frames", first.len());
    let mut whole = Decoder::new(&cfg);
    let (mut ctxs, mut outs) = (vec![Default::default()], vec![Vec::new()]);
    decode_fed_ahead(&mut whole, &all, 0, None, (&mut ctxs, &mut outs), |_| None);
    let copies = [&firsts[0][..], &changed[0][..]].concat();
    assert!(outs[0] == copies);
    let in_turn = (whole.stats(), whole.cache().digest());
    assert!(in_turn.0.hit_chunks > 100, "{:?}", in_turn.0);
    let pools: [std::sync::Arc<dyn prepare::Workers>; 2] = [
        std::sync::Arc::new(FedAtOnce),
        std::sync::Arc::new(Threads::new(2)),
    ];
    for workers in pools {
        let mut dec = Decoder::new(&cfg);
        dec.set_workers(Some(workers.clone()));
        let (mut ctxs, mut outs) = (vec![Default::default()], vec![Vec::new()]);
        let io = (&mut ctxs[..], &mut outs[..]);
        let (fed, _, next, _) =
            decode_fed_ahead_most(&mut dec, &all, 8, Some(workers.clone()), io, |_| None);
        assert!(outs[0] == copies);
        assert_eq!((dec.stats(), dec.cache().digest()), in_turn);
        // Frames of references alone have nothing to feed.
        let (n, f) = (next, fed);
        assert!(
            n * 10 > f * 9 && f * 2 > all.len(),
            "{n} of {f} of {}",
            all.len()
        );

        let mut dec = Decoder::new(&cfg);
        dec.set_workers(Some(workers.clone()));
        let (mut ctxs, mut outs) = (vec![Default::default()], vec![Vec::new()]);
        let io = (&mut ctxs[..], &mut outs[..]);
        decode_fed_ahead(&mut dec, &first, 8, Some(workers.clone()), io, |_| None);
        damage_every_fifth(&mut dec, &firsts[0], &cfg);
        let mut misses = 0;
        let io = (&mut ctxs[..], &mut outs[..]);
        let (_, _, next, _) = decode_fed_ahead_most(&mut dec, &second, 8, Some(workers), io, |f| {
            misses += 1;
            whole.cache().peek(f).map(<[u8]>::to_vec)
        });
        assert!(misses > 10 && next > 10, "{misses} misses, {next} fed next");
        assert!(outs[0] == copies);
    }

    // The second frame's context records damaged past its first: fed behind the first, which
    // hands it the context, it stops where in turn it stops, and decodes to the same error
    // with the same bytes before it.
    let (a, b) = (&first[0].1, &first[1].1);
    let mut turn = Decoder::new(&cfg);
    let mut ctx = crate::StreamContext::default();
    let mut out = Vec::new();
    assert_eq!(
        turn.decode_frame(a, &mut out, &mut ctx, usize::MAX),
        (a.len(), None)
    );
    let bad_b = (b.len() / 3..b.len())
        .step_by(101)
        .map(|at| {
            let mut bad = b.clone();
            bad[at] ^= 0x55;
            bad
        })
        .find(|bad| {
            let mut d = Decoder::new(&cfg);
            let (mut c, mut o) = (Default::default(), Vec::new());
            d.decode_frame(a, &mut o, &mut c, usize::MAX);
            d.decode_frame(bad, &mut o, &mut c, usize::MAX).1.is_some()
        })
        .expect("damage that is found");
    let want = turn.decode_frame(&bad_b, &mut out, &mut ctx, usize::MAX);
    let mut dec = Decoder::new(&cfg);
    let mut ctx = crate::StreamContext::default();
    let fa = dec
        .feed_ahead(a.clone().into(), &mut ctx, usize::MAX)
        .expect("a frame of context records");
    let fb = dec
        .feed_after(&fa, bad_b.clone().into(), usize::MAX, false)
        .expect("the next frame fed");
    assert!(fb.follows());
    // Its walk takes the first frame's first.
    prepare::Deferred::spawn(&fb, &Threads::new(2));
    assert!(
        fa.finish(&mut ctx),
        "every context record of the first frame fed"
    );
    let mut got = Vec::new();
    assert_eq!(
        dec.decode_frame(a, &mut got, &mut ctx, usize::MAX),
        (a.len(), None)
    );
    assert!(
        !fb.finish(&mut ctx),
        "the damaged frame's records are not all fed"
    );
    assert_eq!(
        dec.decode_frame(&bad_b, &mut got, &mut ctx, usize::MAX),
        want
    );
    assert!(got == out, "the same bytes before the stop as in turn");
}
