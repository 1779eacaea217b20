//! Stream contexts: small writes compress in their stream's context, context records are
//! bounded and fail cleanly, streams beyond the mirror's contexts compress alone, long contexts
//! stay within what the receiver offered, and levels change within a stream.

use super::*;

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
        m.encode_chunk(
            &block,
            &policy,
            Pressure::LinkBound,
            &mut hint,
            &mut whole,
            None,
        );
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
        None,
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
    big.extend_from_slice(
        &m.compress_in_context(&vec![0u8; 8 << 20], &mut hint, false)
            .expect("compress"),
    );
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

    // Decoders sharing their slots (a link's scopes) share the bound: a peer cannot multiply
    // it by its number of service scopes.
    let shared = crate::Slots::default();
    let mut decoders: Vec<Decoder> = (0..4)
        .map(|_| {
            let mut d = Decoder::with_capacity(1 << 20, false);
            d.share_context_slots(shared.clone());
            d
        })
        .collect();
    let mut held = Vec::new();
    let mut refused = 0;
    for i in 0..2 * DECODER_CONTEXTS {
        let mut s = StreamContext::default();
        match decoders[i % 4].decode_record_in(&rec, &mut Vec::new(), &mut s) {
            Ok(_) => held.push(s),
            Err(CodecError::Malformed(_)) => refused += 1,
            Err(e) => panic!("{e:?}"),
        }
    }
    assert_eq!(held.len(), DECODER_CONTEXTS);
    assert_eq!(refused, DECODER_CONTEXTS);
    assert_eq!(shared.in_use(), DECODER_CONTEXTS);
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
    m.encode_chunk(data, &policy, Pressure::LinkBound, hint, &mut rec, None);
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
    let recs: Vec<_> = records(&mut dec, &wire)
        .into_iter()
        .filter(|r| r.0 != TAG_LOG)
        .collect();
    let fresh: Vec<usize> = recs
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
