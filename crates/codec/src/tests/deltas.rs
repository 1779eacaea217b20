//! Deltas end to end: changed backups go as deltas and rebuild exactly, with bases lost at
//! random, from the disk tier, or not used where they must not be; hostile delta records are
//! errors.

use proptest::prelude::*;

use super::*;
use crate::delta::{shared, shared_tiered};
use crate::fingerprint::{Fingerprint, fingerprint};
use crate::format::{MAX_RUN_BASES, MAX_RUN_CHUNKS, TAG_DELTA_RUN_BARE};
use crate::store::ChunkStore;

/// 8 KiB pages of text rows, and the same pages after an OLTP run: in each, a few fields
/// updated in place and, in some, a row moved in from the next page.
fn pages(n: usize, seed: u64) -> (Vec<u8>, Vec<u8>) {
    let mut x = seed | 1;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut first = Vec::with_capacity(n * 8192);
    for p in 0..n {
        let mut page = format!("PAGE{p:08}|").into_bytes();
        let mut r = 0;
        while page.len() < 8000 {
            r += 1;
            let row = format!(
                "{}|customer {} of {}|{} items|status {}|note {}\n",
                p * 100 + r,
                rnd() % 90_000,
                ["Lisbon", "Oslo", "Quito", "Perth", "Accra"][rnd() as usize % 5],
                rnd() % 40,
                ["open", "shipped", "closed"][rnd() as usize % 3],
                rnd() % 1_000_000_007
            );
            page.extend_from_slice(row.as_bytes());
        }
        page.resize(8192, b' ');
        first.extend_from_slice(&page);
    }
    let mut second = first.clone();
    for p in 0..n {
        for _ in 0..3 {
            let at = p * 8192 + 64 + rnd() as usize % 8000;
            second[at] = b'0' + (rnd() % 10) as u8;
        }
        if p % 4 == 0 && p + 1 < n {
            let (a, b) = (p * 8192 + 2000, (p + 1) * 8192 + 3000);
            let row = first[b..b + 90].to_vec();
            second[a..a + 90].copy_from_slice(&row);
        }
    }
    (first, second)
}

/// A logical dump of rows padded with blanks (`pg_dump` of pgbench's accounts: a key, two
/// numbers, 84 blanks), and the same dump after an OLTP run: a row in 25 has a new balance and
/// moved to the end of its group of 60 (the dump follows the table's pages, and an updated row
/// lands in its page's free space).
fn padded_dump(rows: u64, seed: u64) -> (Vec<u8>, Vec<u8>) {
    let row = |aid: u64, balance: i64| {
        let mut r = format!("{aid}\t{}\t{balance}\t", aid / 100_000 + 1).into_bytes();
        r.extend_from_slice(&[b' '; 84]);
        r.push(b'\n');
        r
    };
    let (mut first, mut second) = (Vec::new(), Vec::new());
    let mut x = seed | 1;
    for group in (1..=rows).step_by(60) {
        let mut moved = Vec::new();
        for aid in group..(group + 60).min(rows + 1) {
            first.extend_from_slice(&row(aid, 0));
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if x.is_multiple_of(25) {
                moved.extend_from_slice(&row(aid, (x >> 20) as i64 % 5000 - 2500));
            } else {
                second.extend_from_slice(&row(aid, 0));
            }
        }
        second.extend_from_slice(&moved);
    }
    (first, second)
}

/// An encoder and a decoder that `first` went through, as its own stream.
fn primed(cfg: &CodecConfig, first: &[u8]) -> (Encoder, Decoder) {
    let (mut enc, mut dec) = (Encoder::new(cfg.clone()), Decoder::new(cfg));
    let w1 = send(&mut enc, first);
    decode_answering(&enc, &mut dec, &w1);
    (enc, dec)
}

/// Decodes `wire` in full in the decoder's own stream context (see [`answer_all`]).
fn decode_answering(enc: &Encoder, dec: &mut Decoder, wire: &[u8]) -> (Vec<u8>, usize) {
    let mut own = std::mem::take(&mut dec.own);
    let r = answer_all(enc, dec, &mut own, wire);
    dec.own = own;
    r
}

#[test]
fn a_changed_backup_goes_as_deltas_and_rebuilds_exactly() {
    let cfg = CodecConfig::default();
    let (mut enc, mut dec) = (Encoder::new(cfg.clone()), Decoder::new(&cfg));
    let (first, second) = pages(512, 7);
    let w1 = send(&mut enc, &first);
    assert_eq!(decode_answering(&enc, &mut dec, &w1), (first.clone(), 0));
    let early = enc.stats().delta_chunks;
    let w2 = send(&mut enc, &second);
    assert_eq!(decode_answering(&enc, &mut dec, &w2), (second.clone(), 0));
    let s = enc.stats();
    let chunks = chunks(&second, &cfg).count() as u64;
    eprintln!(
        "first {} B, changed {} B; {} of {chunks} chunks as deltas ({} -> {} B)",
        w1.len(),
        w2.len(),
        s.delta_chunks,
        s.delta_bytes,
        s.delta_wire
    );
    assert!(
        (s.delta_chunks - early) * 10 >= chunks * 8,
        "most chunks are deltas"
    );
    assert!(w2.len() * 4 <= w1.len(), "{} vs {}", w2.len(), w1.len());
    assert_eq!(dec.stats().delta_chunks, s.delta_chunks);
    // The same bytes without a store: literals only.
    let w = without_deltas(&cfg, &first, &second);
    assert!(
        w2.len() * 3 <= w.len(),
        "deltas {} vs none {}",
        w2.len(),
        w.len()
    );
}

/// Every base a changed copy's deltas name is lost on the receiving side (its copies of the
/// first copy's chunks damaged, as a bad disk tier reads back), and the sender's recent chunks
/// have forgotten them, as a request that comes long after the delta finds: the store of bases
/// still holds them, so each miss is answered from it and the copy rebuilds exactly. Without
/// the store's answer the sender had nothing to send and the stream was lost.
#[test]
fn bases_the_peer_lost_after_the_recent_chunks_forgot_them_are_answered_from_the_store() {
    let cfg = CodecConfig::default();
    let (first, second) = pages(256, 5);
    let (mut enc, mut dec) = primed(&cfg, &first);
    let before = enc.stats().delta_chunks;
    let w2 = send(&mut enc, &second);
    assert!(
        enc.stats().delta_chunks - before > 100,
        "the copy goes as deltas"
    );
    assert!(dec.cache_mut().corrupt_all_for_test() > 0);
    enc.mirror.forget_recent();
    let (out, misses) = decode_answering(&enc, &mut dec, &w2);
    assert!(out == second, "rebuilt exactly");
    assert!(misses > 100, "the lost bases were asked for: {misses}");
}

/// A changed copy that would overflow the caches its first copy nearly filled: with bases that
/// keep their place (`quiet_bases`, what `Encoder::new` and `Decoder::new` agree on), each
/// chunk added evicts a base already used, and the copy goes as deltas to the end; with bases
/// moved to the newest end, as before, each evicts the first copy's next chunk, the base the
/// copy needs next, and from there on it goes as literals. Both rebuild exactly.
#[test]
fn a_changed_copy_that_overflows_the_caches_keeps_its_bases() {
    let cfg = CodecConfig {
        cache_bytes: 5 << 20,
        delta_bytes: 5 << 20,
        ..CodecConfig::default()
    };
    let (first, second) = pages(512, 11);
    let mut wire = Vec::new();
    for quiet in [true, false] {
        let (mut enc, mut dec) = (Encoder::new(cfg.clone()), Decoder::new(&cfg));
        enc.cache_mut().set_quiet_bases(quiet);
        dec.cache_mut().set_quiet_bases(quiet);
        let w1 = send(&mut enc, &first);
        assert_eq!(decode_answering(&enc, &mut dec, &w1), (first.clone(), 0));
        let before = enc.stats().delta_bytes;
        let w2 = send(&mut enc, &second);
        assert_eq!(decode_answering(&enc, &mut dec, &w2), (second.clone(), 0));
        let deltas = enc.stats().delta_bytes - before;
        eprintln!(
            "quiet {quiet}: changed copy {} B, {deltas} of {} B as deltas",
            w2.len(),
            second.len()
        );
        if quiet {
            assert!(
                deltas * 10 >= second.len() as u64 * 9,
                "{deltas} of {} B as deltas",
                second.len()
            );
        }
        wire.push(w2.len());
    }
    assert!(
        wire[0] * 3 <= wire[1],
        "quiet bases {} B, bases moved {} B",
        wire[0],
        wire[1]
    );
}

/// The records of `second` after `first` through an encoder of `cfg` without a store of
/// bases (checked to send no delta).
fn without_deltas(cfg: &CodecConfig, first: &[u8], second: &[u8]) -> Vec<u8> {
    let plain = CodecConfig {
        delta_bytes: 0,
        ..cfg.clone()
    };
    let mut enc = Encoder::new(plain);
    send(&mut enc, first);
    let w = send(&mut enc, second);
    assert_eq!(enc.stats().delta_chunks, 0);
    w
}

/// Rows padded with blanks find their bases (their anchors are keyed past the padding): a
/// changed dump goes mostly as deltas, at a fraction of what it costs without them.
#[test]
fn a_changed_dump_of_padded_rows_goes_as_deltas() {
    let cfg = CodecConfig::default();
    let (first, second) = padded_dump(40_000, 3);
    let (mut enc, mut dec) = primed(&cfg, &first);
    let before = enc.stats().clone();
    let w2 = send(&mut enc, &second);
    assert_eq!(decode_answering(&enc, &mut dec, &w2), (second.clone(), 0));
    let s = enc.stats();
    assert!(
        (s.delta_bytes - before.delta_bytes) * 10 >= second.len() as u64 * 8,
        "{} of {} bytes as deltas",
        s.delta_bytes - before.delta_bytes,
        second.len()
    );
    let w = without_deltas(&cfg, &first, &second);
    assert!(
        w2.len() * 3 <= w.len() * 2,
        "deltas {} vs none {}",
        w2.len(),
        w.len()
    );
}

/// Within one stream whose long context still holds the first pages, the changed ones go as
/// literals in that context, not as deltas: the index offered their bases and none was used,
/// which the counts show (what an operator reads as `wanopt_delta_no_base_bytes`).
#[test]
fn bases_the_index_offers_and_the_encoder_declines_are_counted() {
    let cfg = CodecConfig::default();
    let (mut enc, mut dec) = (Encoder::new(cfg.clone()), Decoder::new(&cfg));
    let (first, second) = pages(256, 11);
    let mut wire = Vec::new();
    enc.push(&first, false, Pressure::LinkBound, &mut wire);
    let before = enc.stats().clone();
    enc.push(&second, false, Pressure::LinkBound, &mut wire);
    enc.end_stream(Pressure::LinkBound, &mut wire);
    let both = [first.clone(), second.clone()].concat();
    assert_eq!(decode_answering(&enc, &mut dec, &wire), (both, 0));
    let s = enc.stats();
    let changed = s.miss_chunks - before.miss_chunks;
    assert!(changed > 100, "the changed pages are new chunks: {changed}");
    assert_eq!(s.delta_chunks, before.delta_chunks, "no deltas in context");
    let offered = s.no_base_chunks - before.no_base_chunks;
    assert!(
        offered * 10 >= changed * 8,
        "{offered} of {changed} literals had a base offered"
    );
    assert!(s.no_base_bytes - before.no_base_bytes >= offered * cfg.min_chunk as u64);
    // A new stream is out of that context's reach: the same pages changed again go as deltas,
    // and the index's offers are taken.
    let mut third = second.clone();
    for p in (0..256).step_by(3) {
        third[p * 8192 + 100] ^= 1;
    }
    let before = enc.stats().clone();
    let w = send(&mut enc, &third);
    assert_eq!(decode_answering(&enc, &mut dec, &w).0, third);
    let s = enc.stats();
    assert!(s.delta_chunks - before.delta_chunks > 50);
    assert!(
        (s.no_base_chunks - before.no_base_chunks) * 4 < s.delta_chunks - before.delta_chunks,
        "few offers declined out of context"
    );
}

/// A disk store whose every record is at hand only the second time it is asked for, as a
/// store that reads on a thread of its own answers: `Pending` first.
struct Reading(
    crate::store::MemStore,
    std::collections::HashSet<(u32, u64)>,
);

impl ChunkStore for Reading {
    fn append(&mut self, f: &Fingerprint, data: &[u8]) -> Option<crate::store::Loc> {
        self.0.append(f, data)
    }
    fn read(&mut self, loc: crate::store::Loc, f: &Fingerprint) -> Option<Vec<u8>> {
        self.0.read(loc, f)
    }
    fn try_read(
        &mut self,
        loc: crate::store::Loc,
        f: &Fingerprint,
    ) -> std::task::Poll<Option<Vec<u8>>> {
        if self.1.insert((loc.seg, loc.off)) {
            return std::task::Poll::Pending;
        }
        std::task::Poll::Ready(self.0.read(loc, f))
    }
    fn remove_segment(&mut self, seg: u32) {
        self.0.remove_segment(seg);
    }
    fn segments(&self) -> Vec<(u32, u64)> {
        self.0.segments()
    }
    fn segment_limit(&self) -> u64 {
        self.0.segment_limit()
    }
}

/// Sends `first` then `second` through an encoder whose store of bases is `bases`; returns
/// the second's wire bytes and the share of its chunks that went as deltas, after checking
/// that both rebuild exactly.
fn changed_backup_with(bases: Option<SharedBases>, first: &[u8], second: &[u8]) -> (usize, f64) {
    changed_backup_waiting(bases, None, first, second)
}

/// [`changed_backup_with`] where chunks whose bases are being read wait for them, calling
/// `wait` (see [`Encoder::set_store_wait`]).
fn changed_backup_waiting(
    bases: Option<SharedBases>,
    wait: Option<crate::StoreWait>,
    first: &[u8],
    second: &[u8],
) -> (usize, f64) {
    let cfg = CodecConfig::default();
    let (mut enc, mut dec) = (Encoder::new(cfg.clone()), Decoder::new(&cfg));
    enc.mirror.set_bases(bases);
    enc.set_store_wait(wait);
    let w1 = send(&mut enc, first);
    assert_eq!(decode_answering(&enc, &mut dec, &w1).0, first);
    let early = enc.stats().delta_chunks;
    let w2 = send(&mut enc, second);
    assert_eq!(decode_answering(&enc, &mut dec, &w2).0, second);
    let n = chunks(second, &cfg).count() as f64;
    (w2.len(), (enc.stats().delta_chunks - early) as f64 / n)
}

#[test]
fn bases_memory_forgot_are_found_on_the_disk_tier_and_read_ahead() {
    let (first, second) = pages(512, 11);
    let mem = 256 << 10;
    let disk = || Box::new(crate::store::MemStore::new(1 << 20));
    // Memory alone: the first backup (4 MiB) has left a 256 KiB store by the time the second
    // comes.
    let (alone, share) = changed_backup_with(shared(mem), &first, &second);
    assert!(share < 0.2, "memory only: {share}");
    // With a disk tier behind the same memory, its pages are bases again.
    let tiered = shared_tiered(mem, 16 << 20, disk()).expect("store");
    let (w, share) = changed_backup_with(Some(tiered.clone()), &first, &second);
    assert!(share > 0.8, "tiered: {share}");
    assert!(w * 3 <= alone, "tiered {w} vs memory only {alone}");
    let t = tiered.lock().expect("lock").tier_stats();
    assert!(t.disk && t.disk_chunks > 500, "{t:?}");
    assert!(t.mem_bytes <= mem as u64, "{t:?}");
    // A disk that answers only once it has read: the sender never waits, and reading ahead
    // of the bases it used has the next chunks' bases at hand when they come.
    let reading = Box::new(Reading(
        crate::store::MemStore::new(1 << 20),
        Default::default(),
    ));
    let slow = shared_tiered(mem, 16 << 20, reading).expect("store");
    let (w_slow, share) = changed_backup_with(Some(slow), &first, &second);
    assert!(share > 0.7, "read ahead: {share}");
    assert!(
        w_slow * 2 <= alone,
        "read ahead {w_slow} vs memory only {alone}"
    );
    // Chunks that wait for their bases (the store has them the next time it is asked) all go
    // as deltas, and the waiter was called. (Each wait ends a run of deltas, and runs of at
    // most 8 chunks name their bases more often: on these pages that costs about what the
    // literals it saves do.)
    let reading = Box::new(Reading(
        crate::store::MemStore::new(1 << 20),
        Default::default(),
    ));
    let slow = shared_tiered(mem, 16 << 20, reading).expect("store");
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let counted = calls.clone();
    let wait: crate::StoreWait = Box::new(move || {
        counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    });
    let (w_wait, share) = changed_backup_waiting(Some(slow), Some(wait), &first, &second);
    assert!(share > 0.95, "waiting: {share}");
    assert!(
        w_wait * 2 <= alone && w_wait * 10 < w_slow * 11,
        "waiting {w_wait} vs read ahead {w_slow}, memory only {alone}"
    );
    assert!(calls.load(std::sync::atomic::Ordering::Relaxed) > 0);
}

#[test]
fn no_deltas_when_cpu_bound_or_for_latency_or_uncompressed_streams() {
    let (first, second) = pages(64, 9);
    for (pressure, compression, latency) in [
        (Pressure::CpuBound, Compression::Adaptive, false),
        (Pressure::LinkBound, Compression::Lz4, false),
        (Pressure::LinkBound, Compression::None, false),
        (Pressure::LinkBound, Compression::Adaptive, true),
    ] {
        let mut m = Mirror::new(64 << 20, 1 << 20, 3);
        m.set_bases(shared(16 << 20));
        let policy = Policy {
            compression,
            latency,
            ..Policy::default()
        };
        let mut hint = Hint::default();
        let mut wire = Vec::new();
        for data in [&first, &second] {
            for (o, l) in chunks(data, &CodecConfig::default()) {
                let r = m.encode_chunk(
                    &data[o..o + l],
                    &policy,
                    pressure,
                    &mut hint,
                    &mut wire,
                    None,
                );
                assert_ne!(
                    r.sent,
                    Sent::Delta,
                    "{pressure:?} {compression:?} {latency}"
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]
    /// Bases the receiver lost (evicted, damaged) turn deltas into misses that the sender's
    /// copy answers: the bytes still arrive exactly.
    #[test]
    fn deltas_round_trip_with_bases_lost_at_random(
        seed in any::<u64>(),
        lost in proptest::collection::vec(any::<prop::sample::Index>(), 0..40),
        runs in any::<bool>(),
        padded in any::<bool>(),
    ) {
        // With runs, deltas go as delta runs; without, one record each (an older peer's).
        let cfg = CodecConfig { runs, ..CodecConfig::default() };
        let (mut enc, mut dec) = (Encoder::new(cfg.clone()), Decoder::new(&cfg));
        let (first, second) = if padded { padded_dump(8_000, seed) } else { pages(96, seed) };
        let w1 = send(&mut enc, &first);
        prop_assert_eq!(decode_answering(&enc, &mut dec, &w1).0, first.clone());
        let names: Vec<Fingerprint> = chunks(&first, &cfg)
            .map(|(o, l)| fingerprint(&first[o..o + l]))
            .collect();
        for i in &lost {
            dec.cache_mut().corrupt_for_test(&names[i.index(names.len())]);
        }
        let w2 = send(&mut enc, &second);
        let (out, misses) = decode_answering(&enc, &mut dec, &w2);
        prop_assert!(out == second);
        prop_assert!(misses == 0 || !lost.is_empty());
        prop_assert!(lost.is_empty() || enc.stats().delta_chunks > 0);
    }
}

#[test]
fn hostile_delta_records_are_errors() {
    // One delta record per chunk, as for a peer that does not decode delta runs.
    let cfg = CodecConfig {
        runs: false,
        ..CodecConfig::default()
    };
    let (first, second) = pages(16, 3);
    let (mut enc, mut dec) = primed(&cfg, &first);
    let wire = send(&mut enc, &second);
    assert_eq!(wire[0], TAG_DELTA, "the first chunk goes as a delta");
    let mut out = Vec::new();
    let (raw, h) = get_len(&wire, 1).expect("length");
    let n_at = 1 + h;
    let n = usize::from(wire[n_at]);
    let t = n_at + 1 + 16 * n;
    let (clen, h) = get_len(&wire, t + 16).expect("length");
    let whole = t + 16 + h + clen;
    // Every truncation is incomplete, never a panic or a partial chunk.
    for cut in 0..whole {
        out.clear();
        assert_eq!(
            dec.decode_record(&wire[..cut], &mut out),
            Err(CodecError::Incomplete)
        );
        assert!(out.is_empty());
    }
    for n in [0u8, MAX_BASES as u8 + 1, 255] {
        let mut bad = wire[..whole].to_vec();
        bad[n_at] = n;
        assert!(matches!(
            dec.decode_record(&bad, &mut out),
            Err(CodecError::Malformed(_))
        ));
    }
    // A wrong name for the chunk: what the bases rebuild does not match it, a miss.
    let mut bad = wire[..whole].to_vec();
    bad[t] ^= 1;
    let mut name = [0u8; 16];
    name.copy_from_slice(&bad[t..t + 16]);
    assert_eq!(
        dec.decode_record(&bad, &mut out),
        Err(CodecError::Miss(name))
    );
    // A damaged payload is a miss too.
    let mut bad = wire[..whole].to_vec();
    bad[whole - 3] ^= 0x55;
    assert!(matches!(
        dec.decode_record(&bad, &mut out),
        Err(CodecError::Miss(_))
    ));
    // An announced size beyond the limit is refused before anything is allocated.
    let mut big = vec![TAG_DELTA];
    put_len(&mut big, MAX_RECORD + 1);
    assert_eq!(
        dec.decode_record(&big, &mut out),
        Err(CodecError::TooLarge(MAX_RECORD + 1))
    );
    // The genuine record still decodes.
    out.clear();
    assert_eq!(dec.decode_record(&wire, &mut out), Ok(whole));
    assert_eq!(out.len(), raw);
}

/// A changed backup's deltas cost less as runs than one record each (one dictionary and one
/// frame per run, every base named once), and rebuild the same bytes.
#[test]
fn delta_runs_cost_less_than_deltas_one_by_one() {
    let (first, second) = pages(96, 11);
    let mut wire = [0usize; 2];
    for (runs, w) in [false, true].into_iter().zip(&mut wire) {
        let cfg = CodecConfig {
            runs,
            ..CodecConfig::default()
        };
        let (mut enc, mut dec) = primed(&cfg, &first);
        let w2 = send(&mut enc, &second);
        assert_eq!(decode_answering(&enc, &mut dec, &w2), (second.clone(), 0));
        assert!(enc.stats().delta_chunks > 60, "{:?}", enc.stats());
        assert_eq!(
            matches!(without_log(&w2)[0], TAG_DELTA_RUN | TAG_DELTA_RUN_BARE),
            runs,
            "the first chunk's record"
        );
        *w = w2.len();
    }
    assert!(
        wire[1] * 10 < wire[0] * 9,
        "runs {} against one by one {}",
        wire[1],
        wire[0]
    );
}

/// A delta run that costs more than literals of its chunks are expected to (here: literals
/// believed almost free) goes as literals, counted as offered a base, and the bytes still
/// arrive exactly; the runs after it, once literals taught their real cost, go as runs.
#[test]
fn a_delta_run_that_does_not_pay_goes_as_literals() {
    let cfg = CodecConfig::default();
    let (first, second) = pages(96, 5);
    let (mut enc, mut dec) = primed(&cfg, &first);
    let before = enc.stats().clone();
    enc.mirror.set_lit_ratio(0.001);
    let w2 = send(&mut enc, &second);
    assert_eq!(decode_answering(&enc, &mut dec, &w2), (second.clone(), 0));
    let s = enc.stats();
    assert!(
        s.no_base_chunks >= before.no_base_chunks + crate::mirror::SEND_RUN_CHUNKS as u64,
        "{s:?}"
    );
    assert!(s.delta_chunks > before.delta_chunks, "{s:?}");
    assert_eq!(s.raw_bytes - before.raw_bytes, second.len() as u64);
    assert_eq!(s.wire_bytes - before.wire_bytes, w2.len() as u64);
}

/// Every chunk the store keeps is indexed under its own anchors, also the literal whose
/// arrival flushed a delta run that did not pay (the run's chunks, sent as literals first,
/// once left their anchors in its place, and its edited version then found the wrong base).
#[test]
fn each_kept_chunk_is_found_by_its_own_anchors() {
    let cfg = CodecConfig::default();
    let (first, second) = pages(96, 9);
    let bases = shared(64 << 20);
    let (mut enc, mut dec) = (Encoder::new(cfg.clone()), Decoder::new(&cfg));
    enc.set_bases(bases.clone());
    let w1 = send(&mut enc, &first);
    decode_answering(&enc, &mut dec, &w1);
    // Literals believed almost free: runs do not pay and go as literals.
    enc.mirror.set_lit_ratio(0.001);
    // New pages among changed ones: literals with no base end the runs.
    let mut mixed = Vec::new();
    let fresh = pages(48, 77).0;
    for (i, page) in second.chunks(8192).enumerate() {
        mixed.extend_from_slice(page);
        if i % 2 == 1 {
            let k = i / 2 % 48;
            mixed.extend_from_slice(&fresh[k * 8192..(k + 1) * 8192]);
        }
    }
    let before = enc.stats().clone();
    let w = send(&mut enc, &mixed);
    assert_eq!(decode_answering(&enc, &mut dec, &w), (mixed.clone(), 0));
    assert!(
        enc.stats().no_base_chunks > before.no_base_chunks,
        "runs went as literals"
    );
    let shared = bases.expect("a store");
    let mut store = shared.lock().expect("store lock");
    let (mut keys, mut found, mut lost) = (Vec::new(), Vec::new(), Vec::new());
    let mut kept = 0;
    for (off, len) in crate::chunks(&mixed, &cfg) {
        let chunk = &mixed[off..off + len];
        let f = fingerprint(chunk);
        if store.held_len(&f).is_none() {
            continue;
        }
        kept += 1;
        crate::delta::anchors(chunk, &mut keys);
        store.find(&keys, (MAX_BASES, 1), |_| true, &mut found);
        if !found.contains(&f) {
            lost.push(off);
        }
    }
    assert!(kept > 100, "{kept} chunks kept");
    assert!(
        lost.is_empty(),
        "{} of {kept} kept chunks not found by their own anchors",
        lost.len()
    );
}

/// Both forms of a delta run: a whole zstd frame (what an older peer reads) and a bare one.
#[test]
fn hostile_delta_run_records_are_errors() {
    hostile_delta_runs(false);
    hostile_delta_runs(true);
}

fn hostile_delta_runs(bare: bool) {
    // Bases named by their fingerprints (no stream logs to name them by place).
    let cfg = CodecConfig {
        logs: false,
        ..CodecConfig::default()
    };
    let (first, second) = pages(16, 3);
    let (mut enc, mut dec) = primed(&cfg, &first);
    enc.stream.sender.policy.compact_runs = bare;
    let wire = send(&mut enc, &second);
    let wire = without_log(&wire);
    assert_eq!(
        wire[0],
        if bare {
            TAG_DELTA_RUN_BARE
        } else {
            TAG_DELTA_RUN
        },
        "the changed pages go as a delta run"
    );
    let (n, nb) = (usize::from(wire[1]), usize::from(wire[2]));
    assert!(n > 1 && nb >= 1, "{n} chunks, {nb} bases");
    // Each base: a zero (by name) and its fingerprint.
    let mut at = 3 + 17 * nb;
    let mut raw = 0;
    for _ in 0..n {
        let (len, h) = get_len(wire, at).expect("length");
        raw += len;
        at += h;
    }
    let check_at = at;
    let (clen, h) = get_len(wire, at + 16).expect("length");
    let whole = at + 16 + h + clen;
    let mut out = Vec::new();
    // Every truncation is incomplete, never a panic or a partial chunk.
    for cut in 0..whole {
        out.clear();
        assert_eq!(
            dec.decode_record(&wire[..cut], &mut out),
            Err(CodecError::Incomplete)
        );
        assert!(out.is_empty());
    }
    // No chunks, no bases, or more than a receiver takes: malformed.
    for (i, v) in [
        (1, 0u8),
        (1, MAX_RUN_CHUNKS as u8 + 1),
        (2, 0),
        (2, MAX_RUN_BASES as u8 + 1),
    ] {
        let mut bad = wire[..whole].to_vec();
        bad[i] = v;
        assert!(matches!(
            dec.decode_record(&bad, &mut out),
            Err(CodecError::Malformed(_))
        ));
    }
    // Lengths that add up to more than a run may rebuild, or than its frame announced.
    let mut long = vec![TAG_DELTA_RUN, 2, 1];
    long.extend_from_slice(&[0; 16]);
    for _ in 0..2 {
        put_len(&mut long, MAX_RECORD);
    }
    assert!(matches!(
        dec.decode_record(&long, &mut out),
        Err(CodecError::Malformed(_))
    ));
    let mut s = crate::StreamContext::default();
    assert!(matches!(
        dec.decode_record_within(&wire[..whole], &mut out, &mut s, raw - 1),
        Err(CodecError::Malformed(_))
    ));
    // A wrong check: what the bases rebuild is not what the sender said, an error.
    let mut bad = wire[..whole].to_vec();
    bad[check_at] ^= 1;
    assert!(matches!(
        dec.decode_record(&bad, &mut out),
        Err(CodecError::Malformed(_))
    ));
    // A base nobody holds is a miss of that base; a damaged payload does not decompress.
    let mut bad = wire[..whole].to_vec();
    bad[4] ^= 1;
    let mut base = [0u8; 16];
    base.copy_from_slice(&bad[4..20]);
    assert_eq!(
        dec.decode_record(&bad, &mut out),
        Err(CodecError::Miss(base))
    );
    let mut bad = wire[..whole].to_vec();
    bad[whole - 3] ^= 0x55;
    assert!(matches!(
        dec.decode_record(&bad, &mut out),
        Err(CodecError::Decompress | CodecError::Malformed(_))
    ));
    assert!(out.is_empty(), "nothing rebuilt from a bad record");
    // The genuine record still decodes.
    assert_eq!(dec.decode_record(wire, &mut out), Ok(whole));
    assert_eq!(out.len(), raw);
}

/// Bases named by their place in the first copy's log rebuild the changed copy; a receiver
/// whose logs differ (here: it lost them) asks for their names by the run's check, and still
/// rebuilds it exactly. Names nobody asked for are refused.
#[test]
fn bases_named_by_place_are_asked_for_by_name_when_the_logs_differ() {
    let cfg = CodecConfig::default();
    let (first, second) = pages(64, 9);
    let mut wire = [0usize; 2];
    for (lose, w) in [false, true].into_iter().zip(&mut wire) {
        let (mut enc, mut dec) = primed(&cfg, &first);
        if lose {
            dec.logs = crate::logs::Logs::for_cache(cfg.cache_bytes);
        }
        let w2 = send(&mut enc, &second);
        let (out, misses) = decode_answering(&enc, &mut dec, &w2);
        assert!(out == second);
        assert_eq!(misses > 0, lose);
        assert!(enc.stats().delta_chunks > 40, "{:?}", enc.stats());
        *w = w2.len();
    }
    // By name, the same bases cost more.
    let named = CodecConfig {
        logs: false,
        ..cfg.clone()
    };
    let mut enc = Encoder::new(named);
    send(&mut enc, &first);
    let by_name = send(&mut enc, &second).len();
    assert!(
        wire[0] < by_name,
        "by place {} against by name {by_name}",
        wire[0]
    );
    let mut dec = Decoder::new(&cfg);
    assert!(
        !dec.insert_verified([7; 16], &[0u8; 32]),
        "names nobody asked for"
    );
}

/// A chunk that waits for its bases (`Sent::Wait`) has written nothing: the link drops a turn
/// that sent no raw bytes with everything it wrote, so a record written before the wait (the
/// start of the stream's log, with the first chunk) would be lost to the peer while the
/// mirror counted it. Every stream here starts with a chunk whose bases are on a disk tier that
/// answers `Pending` first.
#[test]
fn a_chunk_that_waits_for_its_bases_has_written_nothing() {
    let (first, second) = pages(256, 13);
    let cfg = CodecConfig::default();
    let reading = Box::new(Reading(
        crate::store::MemStore::new(1 << 20),
        Default::default(),
    ));
    let mut m = Mirror::new(64 << 20, 1 << 20, 3);
    m.set_bases(shared_tiered(64 << 10, 16 << 20, reading));
    let policy = Policy {
        wait_bases: true,
        ..Policy::default()
    };
    let mut wire = Vec::new();
    let mut hint = Hint::default();
    for (o, l) in chunks(&first, &cfg) {
        m.encode_chunk(
            &first[o..o + l],
            &policy,
            Pressure::LinkBound,
            &mut hint,
            &mut wire,
            None,
        );
    }
    // The changed copy as streams of 16 chunks each (a log starts with each first chunk), the
    // last first: the bases read ahead after one stream's never reach the next one's first.
    let all: Vec<(usize, usize)> = chunks(&second, &cfg).collect();
    let (mut waits, mut deltas) = (0, 0);
    for (g, group) in all.chunks(16).enumerate().rev() {
        m.end_run(&mut hint, &mut wire);
        hint = Hint::default();
        for (j, &(o, l)) in group.iter().enumerate() {
            let i = g * 16 + j;
            loop {
                let before = wire.len();
                let r = m.encode_chunk(
                    &second[o..o + l],
                    &policy,
                    Pressure::LinkBound,
                    &mut hint,
                    &mut wire,
                    None,
                );
                if r.sent != Sent::Wait {
                    deltas += usize::from(matches!(r.sent, Sent::Delta | Sent::InRun));
                    break;
                }
                assert_eq!(wire.len(), before, "chunk {i} wrote before it waited");
                assert_eq!(r.run_end, 0);
                waits += 1;
            }
        }
    }
    assert!(waits > 0, "{waits} waits");
    assert!(deltas > 150, "{deltas} deltas");
}
