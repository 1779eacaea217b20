//! Codec properties: exact round trips on random, structured and repeated data; dedup ratios on
//! repeated and slightly changed backups; caches in step under eviction; misses instead of wrong
//! data after a restart or damage; bounded decoding of hostile records.

use proptest::prelude::*;

use super::*;

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
            lens.push(out.len() - before);
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
    let backup = xorshift(1, 16 << 20);
    let (_, first) = round_trip(
        Pressure::CpuBound,
        &mut enc,
        &mut dec,
        &backup,
        &[1 << 20],
        false,
    );
    let (out, second) = round_trip(
        Pressure::CpuBound,
        &mut enc,
        &mut dec,
        &backup,
        &[1 << 20],
        false,
    );
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
    let (out, third) = round_trip(
        Pressure::CpuBound,
        &mut enc,
        &mut dec,
        &changed,
        &[1 << 20],
        false,
    );
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
    let first_ref: [u8; 16] = wire[1..17].try_into().expect("a reference");
    dec.cache_mut().corrupt_for_test(&first_ref);
    let mut out = Vec::new();
    assert_eq!(
        dec.decode(&wire, &mut out),
        Err(CodecError::Miss(first_ref))
    );
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

/// Redo-like writes of a few hundred bytes: each a record header with a counter, an address and
/// a timestamp, then a row with a few varying fields.
fn redo_writes(n: usize) -> Vec<Vec<u8>> {
    (0..n as u64)
        .map(|i| {
            let mut w = Vec::new();
            for r in 0..(2 + i % 4) {
                let seq = i * 8 + r;
                w.extend_from_slice(&(0x5c00_0000 + seq * 97).to_le_bytes());
                w.extend_from_slice(&((seq * 7919) % 65_536).to_le_bytes());
                w.extend_from_slice(&(1_700_000_000_000 + seq * 311).to_le_bytes());
                let row = format!(
                    "INSERT|ORDERS|{seq:010}|CUST{:06}|{}|WH{:02}|TOTAL {:>8.2}|STATUS OPEN|",
                    (seq * 2_654_435_761) % 100_000,
                    ["online", "direct"][(seq % 2) as usize],
                    seq % 20,
                    (seq * 7 % 100_000) as f64 / 3.0
                );
                w.extend_from_slice(row.as_bytes());
            }
            w
        })
        .collect()
}

/// Sends each write flushed (as live redo arrives), link-bound; returns the wire bytes, after
/// checking the round trip.
fn flushed_writes(writes: &[Vec<u8>], context: bool) -> usize {
    let cfg = CodecConfig {
        context,
        ..CodecConfig::default()
    };
    let (mut enc, mut dec) = pair(&cfg);
    let mut wire = 0;
    for w in writes {
        let mut rec = Vec::new();
        enc.push(w, true, Pressure::LinkBound, &mut rec);
        let mut out = Vec::new();
        assert_eq!(dec.decode(&rec, &mut out), Ok(rec.len()));
        assert!(&out == w, "a write came back different");
        wire += rec.len();
    }
    wire
}

#[test]
fn small_writes_compress_in_their_streams_context() {
    let writes = redo_writes(2000);
    let raw: usize = writes.iter().map(Vec::len).sum();
    let alone = flushed_writes(&writes, false);
    let in_context = flushed_writes(&writes, true);
    eprintln!("{raw} raw bytes: {alone} alone, {in_context} in context");
    assert!(
        in_context * 2 < alone,
        "context {in_context} vs alone {alone}"
    );
}

/// A 2 KiB flushed write of database-like bytes.
fn write_of(seed: u64) -> Vec<u8> {
    db_blocks(1, seed)[..2048].to_vec()
}

/// A context record of the tail `data` as a fresh mirror's first record would be.
fn context_record(data: &[u8]) -> (Vec<u8>, Mirror, Hint) {
    let mut m = Mirror::new(1 << 20, 1 << 20, 3);
    let mut hint = Hint::default();
    let policy = Policy {
        compression: Compression::Zstd,
        ..Policy::default()
    };
    let mut rec = Vec::new();
    encode_tail(
        &mut m,
        data,
        &policy,
        Pressure::LinkBound,
        &mut hint,
        &mut rec,
    );
    assert_eq!(rec[0], TAG_LIT_CONTEXT | FRESH | NO_CACHE);
    (rec, m, hint)
}

#[test]
fn context_records_are_bounded_and_fail_cleanly() {
    let data = write_of(3);
    let (rec, mut m, mut hint) = context_record(&data);
    let mut dec = Decoder::with_capacity(1 << 20, true);
    let mut out = Vec::new();

    // A record that continues a context the decoder never saw start.
    let mut next = Vec::new();
    let policy = Policy {
        compression: Compression::Zstd,
        dedup: false,
        ..Policy::default()
    };
    encode_tail(
        &mut m,
        &write_of(4),
        &policy,
        Pressure::LinkBound,
        &mut hint,
        &mut next,
    );
    assert_eq!(next[0], TAG_LIT_CONTEXT | NO_CACHE);
    assert!(matches!(
        dec.decode_record(&next, &mut out),
        Err(CodecError::Malformed(_))
    ));
    // In order, both decode; the decoder's context then holds one slot.
    assert_eq!(dec.decode_record(&rec, &mut out), Ok(rec.len()));
    assert_eq!(dec.decode_record(&next, &mut out), Ok(next.len()));
    assert_eq!(out.len(), 2 * 2048);
    assert_eq!(dec.contexts(), 1);
    // Whole chunks after flushed tails join the context (the stream is live), until
    // LIVE_CHUNKS of them came without a tail; a steady stream's go alone.
    for i in 0..=LIVE_CHUNKS {
        let mut whole = Vec::new();
        let block = db_blocks(1, 5 + u64::from(i));
        m.encode_chunk(&block, &policy, Pressure::LinkBound, &mut hint, &mut whole);
        let want = if i < LIVE_CHUNKS {
            TAG_LIT_CONTEXT
        } else {
            TAG_LIT_ZSTD
        };
        assert_eq!(whole[0], want | NO_CACHE, "chunk {i}");
        assert_eq!(dec.decode_record(&whole, &mut out), Ok(whole.len()));
        assert!(out[out.len() - 8192..] == block[..]);
    }
    let mut whole = Vec::new();
    m.encode_chunk(
        &db_blocks(1, 5),
        &policy,
        Pressure::LinkBound,
        &mut Hint::default(),
        &mut whole,
    );
    assert_eq!(whole[0], TAG_LIT_ZSTD | NO_CACHE);

    // A record announcing fewer bytes than its payload holds, or more: an error, and the
    // context is dropped, so nothing of it can reach the next record.
    for claim in [2047, 2049] {
        let (rec, _, _) = context_record(&data);
        let mut bad = vec![rec[0]];
        let (_, h1) = get_len(&rec, 1).expect("len");
        put_len(&mut bad, claim);
        bad.extend_from_slice(&rec[1 + h1..]);
        let mut s = StreamContext::default();
        assert_eq!(
            dec.decode_record_in(&bad, &mut Vec::new(), &mut s),
            Err(CodecError::Decompress),
            "claim {claim}"
        );
        assert!(s.dctx.is_none());
    }
    // A bomb: 8 MiB of zeros claimed to be 1 KiB.
    let mut m = Mirror::new(1 << 20, 1 << 20, 3);
    let mut hint = Hint::default();
    let mut big = Vec::new();
    m.compress_in_context(&vec![0u8; 8 << 20], &mut hint, false, false)
        .expect("compress");
    big.extend_from_slice(&m.scratch[..m.clen]);
    let mut rec = vec![TAG_LIT_CONTEXT | FRESH];
    put_len(&mut rec, 1024);
    put_len(&mut rec, big.len());
    rec.extend_from_slice(&big);
    assert_eq!(
        dec.decode_record_in(&rec, &mut Vec::new(), &mut StreamContext::default()),
        Err(CodecError::Decompress)
    );

    // At most DECODER_CONTEXTS at once; a closed stream gives its slot back.
    let mut dec = Decoder::with_capacity(1 << 20, false);
    let (rec, _, _) = context_record(&data);
    let mut streams: Vec<StreamContext> = Vec::new();
    for _ in 0..DECODER_CONTEXTS {
        let mut s = StreamContext::default();
        assert_eq!(
            dec.decode_record_in(&rec, &mut Vec::new(), &mut s),
            Ok(rec.len())
        );
        streams.push(s);
    }
    let mut s = StreamContext::default();
    assert!(matches!(
        dec.decode_record_in(&rec, &mut Vec::new(), &mut s),
        Err(CodecError::Malformed(_))
    ));
    streams.pop();
    assert_eq!(
        dec.decode_record_in(&rec, &mut Vec::new(), &mut s),
        Ok(rec.len())
    );
    assert_eq!(dec.contexts(), DECODER_CONTEXTS);
    drop(streams);
    drop(s);
    assert_eq!(dec.contexts(), 0);
}

#[test]
fn streams_beyond_the_mirrors_contexts_compress_alone() {
    let mut m = Mirror::new(1 << 20, 1 << 20, 3);
    let policy = Policy {
        compression: Compression::Zstd,
        dedup: false,
        ..Policy::default()
    };
    let mut dec = Decoder::with_capacity(1 << 20, false);
    let mut hints: Vec<(Hint, StreamContext)> = Vec::new();
    for i in 0..MIRROR_CONTEXTS + 3 {
        let mut h = Hint::default();
        let mut s = StreamContext::default();
        let data = write_of(i as u64);
        let mut rec = Vec::new();
        encode_tail(
            &mut m,
            &data,
            &policy,
            Pressure::LinkBound,
            &mut h,
            &mut rec,
        );
        let expect = if i < MIRROR_CONTEXTS {
            TAG_LIT_CONTEXT | FRESH
        } else {
            TAG_LIT_ZSTD
        };
        assert_eq!(rec[0] & !NO_CACHE, expect, "stream {i}");
        let mut out = Vec::new();
        assert_eq!(dec.decode_record_in(&rec, &mut out, &mut s), Ok(rec.len()));
        assert!(out == data);
        hints.push((h, s));
    }
    assert_eq!(m.contexts(), MIRROR_CONTEXTS);
    hints.clear();
    assert_eq!(m.contexts(), 0);
}

/// A bulk stream's first chunk through a mirror with long contexts: its record (flushed, not
/// part of a run).
fn long_record(m: &mut Mirror, data: &[u8], hint: &mut Hint) -> Vec<u8> {
    let policy = Policy {
        compression: Compression::Zstd,
        dedup: false,
        runs: false,
        ..Policy::default()
    };
    let mut rec = Vec::new();
    m.encode_chunk(data, &policy, Pressure::LinkBound, hint, &mut rec);
    rec
}

#[test]
fn long_contexts_are_bounded_by_what_the_receiver_offered() {
    let long = LongContext {
        window_log: 20,
        streams: 2,
    };
    let data = db_blocks(2, 5);
    // The sender opens at most the agreed number; further bulk streams get a short context.
    let mut m = Mirror::new(1 << 20, 1 << 20, 3);
    m.set_long_context(Some(long), Slots::default());
    let mut hints: Vec<Hint> = (0..3).map(|_| Hint::default()).collect();
    let recs: Vec<Vec<u8>> = hints
        .iter_mut()
        .map(|h| long_record(&mut m, &data, h))
        .collect();
    assert_eq!(recs[0][0] & !NO_CACHE, TAG_LIT_CONTEXT | FRESH | LONG);
    assert_eq!(recs[1][0] & !NO_CACHE, TAG_LIT_CONTEXT | FRESH | LONG);
    assert_eq!(
        recs[2][0] & !NO_CACHE,
        TAG_LIT_CONTEXT | FRESH,
        "a third: short window"
    );

    // A receiver that never offered long contexts refuses them.
    let mut plain = Decoder::with_capacity(1 << 20, false);
    assert_eq!(
        plain.decode_record_in(&recs[0], &mut Vec::new(), &mut StreamContext::default()),
        Err(CodecError::Malformed("a long context was not offered"))
    );
    // One that did accepts twice the number (streams that end and begin overlap), no more.
    let mut dec = Decoder::with_capacity(1 << 20, false);
    dec.set_long_context(Some(long), Slots::default());
    let mut open: Vec<StreamContext> = Vec::new();
    for i in 0..4 {
        let mut s = StreamContext::default();
        let mut out = Vec::new();
        assert_eq!(
            dec.decode_record_in(&recs[i % 2], &mut out, &mut s),
            Ok(recs[i % 2].len())
        );
        assert!(out == data);
        open.push(s);
    }
    assert_eq!(
        dec.decode_record_in(&recs[0], &mut Vec::new(), &mut StreamContext::default()),
        Err(CodecError::Malformed("too many long compression contexts"))
    );
    open.pop();
    let mut s = StreamContext::default();
    assert!(
        dec.decode_record_in(&recs[0], &mut Vec::new(), &mut s)
            .is_ok()
    );

    // A window larger than offered is refused before zstd allocates it.
    let mut big = Mirror::new(1 << 20, 1 << 20, 3);
    big.set_long_context(
        Some(LongContext {
            window_log: 24,
            streams: 1,
        }),
        Slots::default(),
    );
    let rec = long_record(&mut big, &xorshift(3, 8192).repeat(4), &mut Hint::default());
    assert_eq!(rec[0] & !NO_CACHE, TAG_LIT_CONTEXT | FRESH | LONG);
    let mut small = Decoder::with_capacity(1 << 20, false);
    small.set_long_context(Some(long), Slots::default());
    assert_eq!(
        small.decode_record_in(&rec, &mut Vec::new(), &mut StreamContext::default()),
        Err(CodecError::Decompress)
    );
}

#[test]
fn a_bulk_stream_in_a_long_context_beats_its_chunks_alone() {
    // Rows repeating at distances beyond one chunk.
    let data: Vec<u8> = (0..100_000u32)
        .flat_map(|i| {
            format!(
                "{i:08} ORDER {:06} customer-{:05} item {:04} qty {:03}\n",
                (i * 7919) % 1_000_000,
                (i * 31) % 40_000,
                (i * 17) % 5000,
                i % 97
            )
            .into_bytes()
        })
        .collect();
    let wire = |long| {
        let cfg = CodecConfig {
            long,
            zstd_level: 3,
            ..CodecConfig::default()
        };
        let (mut enc, mut dec) = pair(&cfg);
        let (out, wire) = round_trip(
            Pressure::LinkBound,
            &mut enc,
            &mut dec,
            &data,
            &[64 * 1024],
            false,
        );
        assert!(out == data);
        wire
    };
    let (long, alone) = (wire(Some(LongContext::default())), wire(None));
    assert!(
        long * 10 < alone * 8,
        "long {long}, alone {alone} of {}",
        data.len()
    );
}

#[test]
fn the_level_may_change_within_a_stream() {
    let data = db_blocks(512, 9);
    let cfg = CodecConfig {
        compression: Compression::Zstd,
        ..CodecConfig::default()
    };
    let (mut enc, mut dec) = pair(&cfg);
    let mut wire = Vec::new();
    for (i, piece) in data.chunks(64 * 1024).enumerate() {
        // Up and down between blocks of the same long context, as the governor moves it.
        enc.set_zstd_level([1, 9, 3, 12, 6][i % 5]);
        enc.push(piece, false, Pressure::LinkBound, &mut wire);
    }
    enc.push(&[], true, Pressure::LinkBound, &mut wire);
    let mut out = Vec::new();
    assert_eq!(dec.decode(&wire, &mut out), Ok(wire.len()));
    assert!(out == data);
}

/// zstd takes a new level with a new frame only: a long context the governor moved starts over
/// once it has taken `RESTART_WINDOWS` windows (not before, and not inside a run), and the
/// stream still rebuilds exactly.
#[test]
fn a_new_level_starts_a_new_context_after_some_windows() {
    let window_log = 20;
    let cfg = CodecConfig {
        compression: Compression::Zstd,
        long: Some(LongContext {
            window_log,
            streams: 1,
        }),
        zstd_level: 1,
        ..CodecConfig::default()
    };
    let data = db_blocks(1536, 4);
    let (mut enc, mut dec) = pair(&cfg);
    let mut wire = Vec::new();
    let mut changed_at = None;
    for piece in data.chunks(64 * 1024) {
        enc.push(piece, false, Pressure::LinkBound, &mut wire);
        if changed_at.is_none() && enc.stats().raw_bytes >= 1 << window_log {
            enc.set_zstd_level(6);
            changed_at = Some(enc.stats().raw_bytes);
        }
    }
    enc.push(&[], true, Pressure::LinkBound, &mut wire);
    let fresh: Vec<usize> = records(&mut dec, &wire)
        .windows(2)
        .filter(|w| w[1].0 & 0x07 == TAG_LIT_CONTEXT && w[1].0 & FRESH != 0)
        .map(|w| w[0].1)
        .collect();
    let restart = crate::context::RESTART_WINDOWS << window_log;
    assert_eq!(fresh.len(), 1, "one restart: {fresh:?}");
    assert!(
        (fresh[0] as u64) >= restart && (fresh[0] as u64) < restart + (256 << 10),
        "the level changed at {changed_at:?}, the context started over at {}",
        fresh[0]
    );
    let mut out = Vec::new();
    assert_eq!(Decoder::new(&cfg).decode(&wire, &mut out), Ok(wire.len()));
    assert!(out == data);
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
    let first = Decoder::new(&cfg)
        .decode_record(&wire, &mut Vec::new())
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
    d.decode_record(&wire, &mut out).expect("deferred");
    assert!(out.is_empty());
    assert_eq!(
        d.decode_record(&[TAG_RAW, 1, b'x'], &mut out),
        Err(CodecError::Malformed("a run left unfinished"))
    );
    // A run end that does not complete the run's bytes.
    let mut d = Decoder::new(&cfg);
    d.decode_record(&wire, &mut out).expect("deferred");
    assert_eq!(
        d.decode_record(&[TAG_RUN_END, 0], &mut out),
        Err(CodecError::Decompress)
    );
    // A run announcing more than a receiver holds, before anything is decompressed.
    let mut d = Decoder::new(&cfg);
    d.decode_record(&wire, &mut out).expect("deferred");
    let mut big = vec![TAG_LIT_CONTEXT | DEFERRED];
    put_len(&mut big, MAX_RECORD);
    put_len(&mut big, 0);
    assert_eq!(
        d.decode_record(&big, &mut out),
        Err(CodecError::Malformed("run longer than a receiver accepts"))
    );
    // A fresh context inside a run.
    let mut d = Decoder::new(&cfg);
    d.decode_record(&wire, &mut out).expect("deferred");
    assert_eq!(
        d.decode_record(&wire[..first], &mut out),
        Err(CodecError::Malformed("a fresh context inside a run"))
    );
    assert!(out.is_empty(), "nothing rebuilt from a broken run");
}

/// Workers on threads of their own: the jobs split in `.0` parts, one thread each.
#[derive(Debug)]
struct Threads(usize);

impl prepare::Workers for Threads {
    fn run(&self, jobs: &mut [prepare::Job<'_>]) {
        let per = jobs.len().div_ceil(self.0).max(1);
        std::thread::scope(|s| {
            for part in jobs.chunks_mut(per) {
                s.spawn(move || part.iter_mut().for_each(prepare::Job::run));
            }
        });
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// Chunks prepared on worker threads encode to the very records the encoder writes alone,
    /// whatever the codec, pressure, dedup and write sizes (repeats and noise included), and
    /// decode to the stream.
    #[test]
    fn prepared_chunks_encode_to_the_same_records(
        parts in proptest::collection::vec((0u8..3, 0usize..120_000, any::<u64>()), 1..6),
        pieces in proptest::collection::vec(1usize..200_000, 1..6),
        compression in prop::sample::select(vec![
            Compression::Adaptive, Compression::Lz4, Compression::Zstd, Compression::None,
        ]),
        cpu in any::<bool>(),
        dedup in any::<bool>(),
        context in any::<bool>(),
        threads in 1usize..4,
    ) {
        let data = mix(&parts);
        let cfg = CodecConfig { compression, dedup, context, ..CodecConfig::default() };
        let pressure = if cpu { Pressure::CpuBound } else { Pressure::LinkBound };
        let wire = |enc: &mut Encoder| encode_all(pressure, enc, &data, &pieces, false);
        let (mut alone, _) = pair(&cfg);
        let (mut pooled, mut dec) = pair(&cfg);
        pooled.set_workers(Some(std::sync::Arc::new(Threads(threads))));
        let a = wire(&mut alone);
        let b = wire(&mut pooled);
        prop_assert!(a == b, "{} and {} bytes", a.len(), b.len());
        prop_assert_eq!(alone.stats(), pooled.stats());
        let mut out = Vec::new();
        dec.decode(&b, &mut out).expect("decodes");
        prop_assert!(out == data);
        // A decoder that decompresses on the workers rebuilds the same, and caches the same.
        let mut pooled_dec = Decoder::new(&cfg);
        pooled_dec.set_workers(Some(std::sync::Arc::new(Threads(threads))));
        let mut out2 = Vec::new();
        pooled_dec.decode(&b, &mut out2).expect("decodes");
        prop_assert!(out2 == data);
        prop_assert_eq!(pooled_dec.stats(), dec.stats());
        prop_assert_eq!(pooled_dec.cache().snapshot().digest(), dec.cache().snapshot().digest());
    }

    /// Damaged records decode through a decoder with workers exactly as through one without:
    /// the same bytes, then the same error (or none).
    #[test]
    fn prepared_decoding_of_damaged_records_matches(
        len in 1usize..200_000,
        seed in any::<u64>(),
        hits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let cfg = CodecConfig { context: false, ..CodecConfig::default() };
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
        pooled.set_workers(Some(std::sync::Arc::new(Threads(2))));
        let (mut a, mut b) = (Vec::new(), Vec::new());
        let ra = plain.decode(&wire, &mut a);
        let rb = pooled.decode(&wire, &mut b);
        prop_assert_eq!(ra, rb);
        prop_assert!(a == b);
    }
}
