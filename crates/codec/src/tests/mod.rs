//! Codec properties: exact round trips on random, structured and repeated data; dedup ratios on
//! repeated and slightly changed backups; caches in step under eviction; misses instead of wrong
//! data after a restart or damage; bounded decoding of hostile records.

use proptest::prelude::*;

use super::*;
use crate::format::{
    DEFERRED, FRESH, LONG, NO_CACHE, TAG_DELTA, TAG_DELTA_RUN, TAG_LIT_CONTEXT, TAG_LIT_LZ4,
    TAG_LIT_ZSTD, TAG_LOG, TAG_RAW, TAG_RUN_END, get_len, put_len,
};

mod anchors;
mod deltas;
mod early;
mod fed_ahead;
mod ref_runs;
mod runs;
mod stream_contexts;

pub(crate) use crate::testdata::noise as xorshift;

/// 8 KiB database-like blocks: a header with the block number, then repetitive rows with a few
/// varying fields, then free space.
fn db_blocks(n: usize, seed: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(n * 8192);
    for b in 0..n {
        let mut block = Vec::with_capacity(8192);
        block.extend_from_slice(&(b as u64).to_be_bytes());
        block.extend_from_slice(&seed.to_be_bytes());
        let mut r = 0u64;
        while block.len() < 6000 {
            r += 1;
            let row = format!(
                "ORDER|{:08}|CUST{:05}|ITEM{:04}|QTY{:03}|OPEN|",
                b as u64 * 100 + r,
                (r * 7919) % 50000,
                (r * 31) % 9999,
                r % 100
            );
            block.extend_from_slice(row.as_bytes());
        }
        block.resize(8192, 0);
        v.extend_from_slice(&block);
    }
    v
}

/// Encodes `data` in pieces of the given sizes (flushing at the end) and decodes it.
fn round_trip(
    pressure: Pressure,
    enc: &mut Encoder,
    dec: &mut Decoder,
    data: &[u8],
    pieces: &[usize],
    flush_each: bool,
) -> (Vec<u8>, usize) {
    let wire = encode_all(pressure, enc, data, pieces, flush_each);
    let mut out = Vec::new();
    let used = dec.decode(&wire, &mut out).expect("decodes");
    assert_eq!(used, wire.len(), "every record is whole after a flush");
    (out, wire.len())
}

/// The records of `data` pushed in pieces of the given sizes, in turn (flushing at the end).
fn encode_all(
    pressure: Pressure,
    enc: &mut Encoder,
    data: &[u8],
    pieces: &[usize],
    flush_each: bool,
) -> Vec<u8> {
    let mut wire = Vec::new();
    let mut off = 0;
    let mut i = 0;
    while off < data.len() {
        let n = pieces
            .get(i % pieces.len().max(1))
            .copied()
            .unwrap_or(data.len())
            .max(1)
            .min(data.len() - off);
        enc.push(&data[off..off + n], flush_each, pressure, &mut wire);
        off += n;
        i += 1;
    }
    enc.push(&[], true, pressure, &mut wire);
    wire
}

/// Noise, database blocks and repeats of what came before, as `(kind, len, seed)` parts say.
fn mix(parts: &[(u8, usize, u64)]) -> Vec<u8> {
    let mut data = Vec::new();
    for (kind, len, seed) in parts {
        match kind {
            0 => data.extend(xorshift(*seed, *len)),
            1 => data.extend(db_blocks(len / 8192 + 1, *seed)),
            _ => {
                let d = data.clone();
                data.extend(d.iter().take(*len));
            }
        }
    }
    data
}

/// Decodes `wire` in full in the stream context `s`, answering each miss (of a chunk, or of a
/// run's names) with what the encoder kept, as the link does with `Need` and `Chunk`; returns
/// the bytes and how many misses there were.
fn answer_all(
    enc: &Encoder,
    dec: &mut Decoder,
    s: &mut StreamContext,
    wire: &[u8],
) -> (Vec<u8>, usize) {
    let (mut out, mut at, mut misses) = (Vec::new(), 0, 0);
    while at < wire.len() {
        match dec.decode_record_in(&wire[at..], &mut out, s) {
            Ok(n) => at += n,
            Err(CodecError::Miss(f)) => {
                misses += 1;
                let data = enc.mirror.chunk(&f).expect("the sender kept it");
                assert!(dec.insert_verified(f, &data));
            }
            Err(e) => panic!("decode: {e}"),
        }
    }
    (out, misses)
}

/// `data` as a stream of its own.
fn send(enc: &mut Encoder, data: &[u8]) -> Vec<u8> {
    let mut wire = Vec::new();
    enc.push(data, false, Pressure::LinkBound, &mut wire);
    enc.end_stream(Pressure::LinkBound, &mut wire);
    wire
}

/// A stream's records after the start of its log (a `TAG_LOG` record and its serial), which
/// no other record depends on.
fn without_log(wire: &[u8]) -> &[u8] {
    match wire.first() {
        Some(&TAG_LOG) => {
            let (_, h) = crate::format::get_varint(wire, 1).expect("a serial");
            &wire[1 + h..]
        }
        _ => wire,
    }
}

fn pair(cfg: &CodecConfig) -> (Encoder, Decoder) {
    (Encoder::new(cfg.clone()), Decoder::new(cfg))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    #[test]
    fn round_trips_any_mix(
        parts in proptest::collection::vec((0u8..3, 0usize..100_000, any::<u64>()), 1..6),
        pieces in proptest::collection::vec(1usize..70_000, 1..5),
        flush_each in any::<bool>(),
        comp in prop_oneof![Just(Compression::None), Just(Compression::Lz4), Just(Compression::Zstd), Just(Compression::Adaptive)],
        dedup in any::<bool>(),
        link_bound in any::<bool>(),
    ) {
        let data = mix(&parts);
        let cfg = CodecConfig { compression: comp, cache_bytes: 1 << 20, dedup, ..CodecConfig::default() };
        let enc_ = Encoder::new(cfg.clone());
        // The decoder caches unless a record says not to: with dedup off, nothing may enter it.
        let mut dec_ = Decoder::with_capacity(cfg.cache_bytes, true);
        dec_.set_long_context(cfg.long, Slots::default());
        let (mut enc, mut dec) = (enc_, dec_);
        let pressure = if link_bound { Pressure::LinkBound } else { Pressure::CpuBound };
        let (out, _) = round_trip(pressure, &mut enc, &mut dec, &data, &pieces, flush_each);
        prop_assert!(out == data);
        prop_assert_eq!(enc.cache().size(), dec.cache().size());
        prop_assert_eq!(enc.pending(), 0);
    }

    /// Chunk boundaries depend on the content only: the records of a stream written in any
    /// pieces (without flushes) are the chunks of the whole stream cut at once.
    #[test]
    fn boundaries_do_not_depend_on_write_sizes(
        seed in any::<u64>(),
        len in 1usize..300_000,
        pieces in proptest::collection::vec(1usize..70_000, 1..6),
    ) {
        let data: Vec<u8> = db_blocks(len / 8192 + 1, seed)
            .iter()
            .zip(xorshift(seed, len))
            .map(|(a, b)| if b < 200 { *a } else { b })
            .collect();
        let cfg = CodecConfig::default();
        let (mut enc, mut dec) = pair(&cfg);
        let mut wire = Vec::new();
        let mut off = 0;
        for n in pieces.iter().cycle() {
            if off == data.len() {
                break;
            }
            let n = (*n).min(data.len() - off);
            enc.push(&data[off..off + n], false, Pressure::CpuBound, &mut wire);
            off += n;
        }
        enc.push(&[], true, Pressure::CpuBound, &mut wire);
        let (mut out, mut lens, mut at) = (Vec::new(), Vec::new(), 0);
        while at < wire.len() {
            let before = out.len();
            at += dec.decode_record(&wire[at..], &mut out).expect("decodes");
            // A record that rebuilds nothing (a stream log's start) has no chunk.
            if out.len() > before {
                lens.push(out.len() - before);
            }
        }
        prop_assert!(out == data);
        let whole: Vec<usize> = chunks(&data, &cfg).map(|(_, l)| l).collect();
        prop_assert_eq!(lens, whole);
    }

    #[test]
    fn garbage_never_panics_or_overallocates(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        let mut dec = Decoder::new(&CodecConfig::default());
        let mut out = Vec::new();
        let _ = dec.decode(&data, &mut out);
        prop_assert!(out.len() <= data.len() * 300 + MAX_RECORD);
    }
}

#[test]
fn second_transfer_of_a_backup_is_nearly_free_and_a_changed_one_cheap() {
    let cfg = CodecConfig {
        compression: Compression::None,
        ..CodecConfig::default()
    };
    let (mut enc, mut dec) = pair(&cfg);
    // Every transfer through the same pair, in 1 MiB writes, on the LZ4 path.
    let mut send = |data: &[u8]| {
        round_trip(
            Pressure::CpuBound,
            &mut enc,
            &mut dec,
            data,
            &[1 << 20],
            false,
        )
    };
    let backup = xorshift(1, 16 << 20);
    let (_, first) = send(&backup);
    let (out, second) = send(&backup);
    assert!(out == backup);
    assert!(
        second * 100 <= first * 3,
        "second transfer {second} vs first {first}"
    );
    // Change 10% of the 8 KiB blocks.
    let mut changed = backup.clone();
    for b in (0..changed.len() / 8192).filter(|b| b % 10 == 3) {
        changed[b * 8192 + 100] ^= 0x5a;
    }
    let (out, third) = send(&changed);
    assert!(out == changed);
    eprintln!("wire bytes: first {first}, repeat {second}, 10% changed {third}");
    assert!(
        third * 100 <= first * 25,
        "changed transfer {third} vs first {first}"
    );
}

#[test]
fn database_blocks_compress_and_noise_does_not_grow() {
    let cfg = CodecConfig::default();
    let (mut enc, mut dec) = pair(&cfg);
    let blocks = db_blocks(1024, 5);
    let (out, wire) = round_trip(
        Pressure::CpuBound,
        &mut enc,
        &mut dec,
        &blocks,
        &[64 * 1024],
        false,
    );
    assert!(out == blocks);
    assert!(
        wire * 3 <= blocks.len(),
        "db-like data: {wire} wire bytes for {} raw",
        blocks.len()
    );
    let noise = xorshift(9, 8 << 20);
    let (mut enc, mut dec) = pair(&cfg);
    let (out, wire) = round_trip(
        Pressure::CpuBound,
        &mut enc,
        &mut dec,
        &noise,
        &[64 * 1024],
        false,
    );
    assert!(out == noise);
    assert!(
        wire as f64 <= noise.len() as f64 * 1.001,
        "incompressible grew to {wire}"
    );
}

/// Rows of random digit groups (sysbench's `c` column: nothing for LZ4 to repeat, four bits of
/// entropy a byte) pass the noise trial and go through zstd, link-bound; they went raw when the
/// trial asked LZ4 alone. Noise after them still goes raw.
#[test]
fn skewed_rows_without_repeats_are_compressed_and_noise_is_not() {
    let cfg = CodecConfig::default();
    let (mut enc, mut dec) = pair(&cfg);
    let digits: Vec<u8> = xorshift(21, 4 << 20)
        .iter()
        .enumerate()
        .map(|(i, b)| if i % 12 == 11 { b'-' } else { b'0' + b % 10 })
        .collect();
    let noise = xorshift(22, 1 << 20);
    let data = [digits.clone(), noise.clone()].concat();
    let (out, wire) = round_trip(
        Pressure::LinkBound,
        &mut enc,
        &mut dec,
        &data,
        &[64 * 1024],
        false,
    );
    assert!(out == data);
    let s = enc.stats();
    let zstd = Codec::Zstd.index();
    assert!(
        s.codec_bytes[zstd] >= digits.len() as u64 * 9 / 10,
        "{} of {} digit bytes through zstd",
        s.codec_bytes[zstd],
        digits.len()
    );
    assert!(
        (wire as f64) < digits.len() as f64 * 0.5 + noise.len() as f64 * 1.01,
        "{wire} wire bytes"
    );
    assert!(s.codec_bytes[0] >= noise.len() as u64 / 2, "noise goes raw");
}

/// A bulk stream whose chunks paid for a while skips the LZ4 trial, but noise after them is
/// still caught: it grows by under 0.1% and soon skips compression altogether.
#[test]
fn noise_after_compressible_chunks_in_a_long_context_does_not_grow() {
    let cfg = CodecConfig {
        long: Some(LongContext::default()),
        zstd_level: 3,
        ..CodecConfig::default()
    };
    let (mut enc, mut dec) = pair(&cfg);
    let blocks = db_blocks(512, 6);
    let noise = xorshift(10, 8 << 20);
    let mut wire = Vec::new();
    for piece in blocks.chunks(64 * 1024) {
        enc.push(piece, false, Pressure::LinkBound, &mut wire);
    }
    let before = (wire.len(), enc.stats().clone());
    for piece in noise.chunks(64 * 1024) {
        enc.push(piece, false, Pressure::LinkBound, &mut wire);
    }
    enc.push(&[], true, Pressure::LinkBound, &mut wire);
    let grown = wire.len() - before.0;
    assert!(
        grown as f64 <= noise.len() as f64 * 1.001,
        "noise grew to {grown} from {}",
        noise.len()
    );
    let s = enc.stats();
    let stored = s.codec_bytes[Codec::None.index()] - before.1.codec_bytes[Codec::None.index()];
    assert!(
        stored as usize * 10 >= noise.len() * 9,
        "most of the noise goes uncompressed: {stored} of {}",
        noise.len()
    );
    let mut out = Vec::new();
    assert_eq!(dec.decode(&wire, &mut out), Ok(wire.len()));
    assert!(out.len() == blocks.len() + noise.len());
    assert!(out[..blocks.len()] == blocks[..] && out[blocks.len()..] == noise[..]);
}

#[test]
fn tiny_cache_evicts_in_step() {
    let cfg = CodecConfig {
        cache_bytes: 200 * 1024,
        compression: Compression::Lz4,
        ..CodecConfig::default()
    };
    let (mut enc, mut dec) = pair(&cfg);
    let base = db_blocks(64, 2);
    for round in 0..6 {
        let mut data = base.clone();
        data.extend(xorshift(round, 300 * 1024));
        data.extend(&base[..100_000]);
        let (out, _) = round_trip(
            Pressure::CpuBound,
            &mut enc,
            &mut dec,
            &data,
            &[50_000],
            false,
        );
        assert!(out == data);
        assert_eq!(enc.cache().size(), dec.cache().size());
        assert_eq!(enc.cache().evictions(), dec.cache().evictions());
    }
    assert!(enc.cache().evictions() > 0);
}

#[test]
fn restarted_or_damaged_receiver_misses_instead_of_misreading() {
    let cfg = CodecConfig::default();
    let (mut enc, mut dec) = pair(&cfg);
    let data = xorshift(3, 1 << 20);
    round_trip(
        Pressure::CpuBound,
        &mut enc,
        &mut dec,
        &data,
        &[1 << 20],
        false,
    );
    // The receiver restarts with an empty cache: the sender's references cannot be resolved.
    let mut fresh = Decoder::new(&cfg);
    let mut wire = Vec::new();
    enc.push(&data, true, Pressure::CpuBound, &mut wire);
    let mut out = Vec::new();
    assert!(matches!(
        fresh.decode(&wire, &mut out),
        Err(CodecError::Miss(_))
    ));
    // A damaged entry is a miss too, never wrong bytes.
    let mut wire = Vec::new();
    enc.push(&data, true, Pressure::CpuBound, &mut wire);
    let (_, len) = chunks(&data, &cfg).next().expect("a chunk");
    let first_ref = crate::fingerprint::fingerprint(&data[..len]);
    dec.cache_mut().corrupt_for_test(&first_ref);
    let mut out = Vec::new();
    // The references go as a run named by its place in the stream's log, which this decoder
    // did not keep up with (it never read the records above): it asks for the run's names.
    let r = loop {
        match dec.decode_record(&wire, &mut out) {
            Err(CodecError::Miss(check)) if check != first_ref => {
                let names = enc.mirror.chunk(&check).expect("the run's names");
                assert!(dec.insert_verified(check, &names));
            }
            r => break r,
        }
    };
    assert_eq!(r, Err(CodecError::Miss(first_ref)));
    assert!(out.is_empty());
}

#[test]
fn hostile_records_are_errors_not_allocations() {
    let mut dec = Decoder::new(&CodecConfig::default());
    let mut out = Vec::new();
    // A raw record claiming 2 MiB, and one whose length never ends.
    assert_eq!(
        dec.decode_record(&[TAG_RAW, 0xff, 0xff, 0x7f], &mut out),
        Err(CodecError::TooLarge((1 << 21) - 1))
    );
    assert!(matches!(
        dec.decode_record(&[TAG_RAW, 0xff, 0xff, 0xff, 0xff], &mut out),
        Err(CodecError::Malformed(_))
    ));
    // A zstd bomb: 8 MiB of zeros claimed to be 1 KiB.
    let bomb = zstd::bulk::compress(&vec![0u8; 8 << 20], 3).expect("compress");
    let mut rec = vec![TAG_LIT_ZSTD];
    put_len(&mut rec, 1024);
    put_len(&mut rec, bomb.len());
    rec.extend_from_slice(&bomb);
    assert_eq!(
        dec.decode_record(&rec, &mut out),
        Err(CodecError::Decompress)
    );
    // The same for LZ4.
    let bomb = lz4_flex::block::compress(&vec![0u8; 1 << 20]);
    let mut rec = vec![TAG_LIT_LZ4];
    put_len(&mut rec, 1024);
    put_len(&mut rec, bomb.len());
    rec.extend_from_slice(&bomb);
    assert_eq!(
        dec.decode_record(&rec, &mut out),
        Err(CodecError::Decompress)
    );
    assert!(out.is_empty());
    // Every prefix of a valid record is Incomplete.
    let (mut enc, _) = pair(&CodecConfig::default());
    let mut wire = Vec::new();
    enc.push(&db_blocks(4, 1), true, Pressure::LinkBound, &mut wire);
    let first = Decoder::new(&CodecConfig::default())
        .decode_record(&wire, &mut Vec::new())
        .expect("a whole record");
    for cut in 0..first {
        let mut d = Decoder::new(&CodecConfig::default());
        let r = d.decode_record(&wire[..cut], &mut Vec::new());
        assert_eq!(r, Err(CodecError::Incomplete), "cut at {cut}");
    }
}

#[test]
fn latency_flushes_never_hold_bytes_back() {
    let cfg = CodecConfig::default();
    let (mut enc, mut dec) = pair(&cfg);
    for i in 0..100u64 {
        let msg = xorshift(i, 300 + i as usize * 17);
        let mut wire = Vec::new();
        enc.push(&msg, true, Pressure::CpuBound, &mut wire);
        assert_eq!(enc.pending(), 0);
        let mut out = Vec::new();
        dec.decode(&wire, &mut out).expect("decode");
        assert!(out == msg);
    }
}

#[test]
fn flushed_tails_are_compressed_when_it_pays_and_never_cached() {
    let cfg = CodecConfig::default();
    let mut enc = Encoder::new(cfg.clone());
    let mut dec = Decoder::new(&cfg);
    // A 3 KiB redo-like write (shorter than a chunk), flushed as a latency stream does.
    let write: Vec<u8> = b"UPDATE ORDERS SET STATUS='SHIPPED' WHERE ID=42;"
        .iter()
        .cycle()
        .take(3000)
        .copied()
        .collect();
    for round in 0..2 {
        let mut wire = Vec::new();
        enc.push(&write, true, Pressure::CpuBound, &mut wire);
        assert!(
            wire.len() < write.len() / 4,
            "round {round}: {} of {}",
            wire.len(),
            write.len()
        );
        let mut out = Vec::new();
        assert_eq!(dec.decode(&wire, &mut out), Ok(wire.len()));
        assert_eq!(out, write);
    }
    assert!(
        enc.cache().is_empty() && dec.cache().is_empty(),
        "tails are not cached"
    );
    // A tiny tail goes raw.
    let mut wire = Vec::new();
    enc.push(b"COMMIT;", true, Pressure::CpuBound, &mut wire);
    assert_eq!(wire.len(), 1 + 1 + 7);
}

/// A deferred context literal's tag (a run's end shares the flag's bit, not the kind).
fn is_deferred(tag: u8) -> bool {
    tag & DEFERRED != 0 && tag & 0x07 == TAG_LIT_CONTEXT
}

/// Walks `wire` record by record: each record's tag, and the bytes decoded after it.
fn records(dec: &mut Decoder, wire: &[u8]) -> Vec<(u8, usize)> {
    let (mut out, mut at, mut tags) = (Vec::new(), 0, Vec::new());
    while at < wire.len() {
        let n = dec.decode_record(&wire[at..], &mut out).expect("decodes");
        tags.push((wire[at], out.len()));
        at += n;
    }
    tags
}
