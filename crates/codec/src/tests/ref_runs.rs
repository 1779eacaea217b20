//! References named by their place in a stream log: a second copy of what was sent goes as a
//! few reference runs and rebuilds exactly; a receiver whose logs differ (restarted, or it
//! never read some records) asks for the names and still rebuilds exactly; hostile reference
//! runs are errors.

use proptest::prelude::*;

use super::*;
use crate::fingerprint::{SHORT_CHECK, short_key};
use crate::format::{TAG_REF_RUN, TAG_REF_RUN_SHORT, put_varint};
use crate::logs::MAX_REF_RUN;

/// Files of a source tree: text lines, some repeated across files.
fn tree(files: usize, seed: u64) -> Vec<u8> {
    let noise = crate::testdata::noise(seed, files * 64);
    let mut v = Vec::new();
    for f in 0..files {
        let n = &noise[f * 64..f * 64 + 64];
        for l in 0..200 {
            v.extend_from_slice(
                format!(
                    "/* file {f} line {l} */ int v{}_{} = {};\n",
                    n[l % 64],
                    l,
                    n[(l * 7) % 64]
                )
                .as_bytes(),
            );
        }
    }
    v
}

/// A stream context in the same log as `s`.
fn like(s: &crate::StreamContext) -> crate::StreamContext {
    crate::StreamContext {
        log: s.log,
        ..Default::default()
    }
}

/// The same tree again, one file in ten edited: the unchanged files' chunks go as reference
/// runs named by their place in the first copy's log, a small part of what references one by
/// one cost, and both rebuild exactly.
#[test]
fn a_second_copy_goes_as_reference_runs() {
    let first = tree(400, 1);
    let mut second = first.clone();
    for at in (0..second.len()).step_by(first.len() / 40) {
        second[at] = b'#';
    }
    let mut refs_wire = [0u64; 2];
    for (runs, w) in [false, true].into_iter().zip(&mut refs_wire) {
        let cfg = CodecConfig {
            runs,
            ..CodecConfig::default()
        };
        let (mut enc, mut dec) = (Encoder::new(cfg.clone()), Decoder::new(&cfg));
        let w1 = send(&mut enc, &first);
        let mut s = crate::StreamContext::default();
        assert_eq!(answer_all(&enc, &mut dec, &mut s, &w1).0, first);
        let before = enc.stats().clone();
        let w2 = send(&mut enc, &second);
        let mut s = crate::StreamContext::default();
        assert_eq!(answer_all(&enc, &mut dec, &mut s, &w2), (second.clone(), 0));
        let st = enc.stats();
        assert!(st.hit_chunks - before.hit_chunks > 50, "{st:?}");
        assert_eq!(dec.stats().hit_chunks, st.hit_chunks);
        *w = st.hit_wire - before.hit_wire;
    }
    assert!(
        refs_wire[1] * 4 < refs_wire[0],
        "reference runs {} bytes against {} one by one",
        refs_wire[1],
        refs_wire[0]
    );
}

/// A disk image: files with stretches of zero blocks between them, the same zero chunk many
/// times over. A second copy with a few files edited names its zero chunks where the first
/// copy's log has them in a row: a reference run or two a turn, not one a zero chunk (as
/// when a chunk's only place was its last), and it rebuilds exactly.
#[test]
fn repeated_chunks_go_in_the_runs_around_them() {
    let (files, zeros) = (20, 1 << 20);
    let mut first = Vec::new();
    for f in 0..files {
        first.extend_from_slice(&tree(6, 100 + f as u64));
        first.resize(first.len() + zeros, 0);
    }
    let mut second = first.clone();
    let edits = 4;
    for e in 0..edits {
        second[e * first.len() / edits + 1000] ^= 0x20;
    }
    let cfg = CodecConfig::default();
    let (mut enc, mut dec) = (Encoder::new(cfg.clone()), Decoder::new(&cfg));
    let w1 = send(&mut enc, &first);
    let mut s = crate::StreamContext::default();
    assert_eq!(answer_all(&enc, &mut dec, &mut s, &w1).0, first);
    let (before, turns) = (enc.stats().clone(), enc.turns());
    let w2 = send(&mut enc, &second);
    let mut s = crate::StreamContext::default();
    assert_eq!(answer_all(&enc, &mut dec, &mut s, &w2), (second.clone(), 0));
    let st = enc.stats();
    let zero_chunks = files * zeros / cfg.max_chunk;
    assert!(
        st.hit_chunks - before.hit_chunks > zero_chunks as u64,
        "{st:?}"
    );
    // A reference run costs at most 16 bytes; at most two a turn, and two an edit (a zero
    // chunk a run: 8,273 bytes).
    let bound = 16 * (2 * (enc.turns() - turns) + 2 * edits as u64);
    let refs = st.hit_wire - before.hit_wire;
    assert!(
        refs <= bound,
        "{refs} bytes of references for {zero_chunks} zero chunks in {} turns",
        enc.turns() - turns
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]
    /// A receiver that missed some of the sender's streams (it restarted, or they failed on
    /// its side), or lost chunks, gets the names or the chunks it asks for: the bytes still
    /// arrive exactly, and references still go as runs.
    #[test]
    fn reference_runs_round_trip_when_the_logs_differ(
        seed in any::<u64>(),
        skipped in proptest::collection::vec(any::<bool>(), 4),
        lost in proptest::collection::vec(any::<prop::sample::Index>(), 0..20),
    ) {
        let cfg = CodecConfig::default();
        let (mut enc, mut dec) = (Encoder::new(cfg.clone()), Decoder::new(&cfg));
        let data = tree(120, seed);
        let mut misses = 0;
        for (i, skip) in skipped.iter().enumerate() {
            // Each stream sends the tree with one part changed.
            let mut copy = data.clone();
            let at = (seed as usize + i * 7919) % copy.len();
            copy[at] ^= 0x20;
            let wire = send(&mut enc, &copy);
            if *skip && i > 0 {
                // This receiver never reads that stream: its logs and cache lack it.
                continue;
            }
            let names: Vec<_> = chunks(&data, &cfg)
                .map(|(o, l)| crate::fingerprint::fingerprint(&data[o..o + l]))
                .collect();
            for l in &lost {
                dec.cache_mut().corrupt_for_test(&names[l.index(names.len())]);
            }
            let mut s = crate::StreamContext::default();
            let (out, m) = answer_all(&enc, &mut dec, &mut s, &wire);
            prop_assert!(out == copy);
            misses += m;
        }
        prop_assert!(misses == 0 || skipped.iter().skip(1).any(|s| *s) || !lost.is_empty());
    }
}

/// Both forms of a reference run, with a whole check and with a short one (what an older
/// peer reads, and what a newer one is sent).
#[test]
fn hostile_reference_runs_are_errors() {
    hostile_reference_runs(false);
    hostile_reference_runs(true);
}

fn hostile_reference_runs(short: bool) {
    let cfg = CodecConfig::default();
    let (mut enc, mut dec) = (Encoder::new(cfg.clone()), Decoder::new(&cfg));
    enc.stream.sender.policy.compact_runs = short;
    let data = tree(100, 3);
    let w1 = send(&mut enc, &data);
    let mut s = crate::StreamContext::default();
    answer_all(&enc, &mut dec, &mut s, &w1);
    // Each stream starts with the configuration's policy.
    enc.stream.sender.policy.compact_runs = short;
    let w2 = send(&mut enc, &data);
    let mut s = crate::StreamContext::default();
    let log_len = w2.len() - without_log(&w2).len();
    dec.decode_record_in(&w2, &mut Vec::new(), &mut s)
        .expect("the log's start");
    let wire = &w2[log_len..];
    let (tag, len) = if short {
        (TAG_REF_RUN_SHORT, SHORT_CHECK)
    } else {
        (TAG_REF_RUN, 16)
    };
    assert_eq!(wire[0], tag, "the copy goes as reference runs");
    let (_, a) = crate::format::get_varint(wire, 1).expect("serial");
    let (_, b) = crate::format::get_varint(wire, 1 + a).expect("index");
    let (count, c) = crate::format::get_varint(wire, 1 + a + b).expect("count");
    let whole = 1 + a + b + c + len;
    let key = |rec: &[u8]| {
        let c = &rec[whole - len..whole];
        if short {
            short_key(c)
        } else {
            let mut k = [0u8; 16];
            k.copy_from_slice(c);
            k
        }
    };
    let mut out = Vec::new();
    // Every truncation is incomplete, never a panic or partial bytes.
    for cut in 0..whole {
        let mut t = like(&s);
        assert_eq!(
            dec.decode_record_in(&wire[..cut], &mut out, &mut t),
            Err(CodecError::Incomplete)
        );
        assert!(out.is_empty());
    }
    // No chunks, too many, a serial beyond 32 bits: malformed.
    for (serial, n) in [(1u64, 0u64), (1, MAX_REF_RUN as u64 + 1), (1 << 32, 2)] {
        let mut bad = vec![tag];
        put_varint(&mut bad, serial);
        put_varint(&mut bad, 0);
        put_varint(&mut bad, n);
        bad.extend_from_slice(&vec![0; len]);
        assert!(matches!(
            dec.decode_record_in(&bad, &mut out, &mut like(&s)),
            Err(CodecError::Malformed(_))
        ));
    }
    // A place nobody logged, or a wrong check: a miss of the check, until the names come.
    let mut bad = wire[..whole].to_vec();
    bad[whole - 1] ^= 1;
    let check = key(&bad);
    assert_eq!(
        dec.decode_record_in(&bad, &mut out, &mut like(&s)),
        Err(CodecError::Miss(check))
    );
    // Names that do not match their check are refused.
    let names = enc.mirror.chunk(&key(wire));
    let names = names.expect("the run's names").to_vec();
    assert_eq!(names.len() as u64, 16 * count);
    assert!(!dec.insert_verified(check, &names));
    // A short check is asked for by its key: the sender's names for it are accepted, and the
    // run then decodes from them.
    if short {
        let mut t = like(&s);
        let mut moved = wire[..whole].to_vec();
        // The same check at a place our log does not hold.
        moved[1 + a] ^= 1;
        let k = key(&moved);
        assert_eq!(
            dec.decode_record_in(&moved, &mut out, &mut t),
            Err(CodecError::Miss(k))
        );
        assert!(dec.insert_verified(k, &names));
        assert_eq!(dec.decode_record_in(&moved, &mut out, &mut t), Ok(whole));
        out.clear();
    }
    // More than the frame announced, before anything is copied.
    assert!(matches!(
        dec.decode_record_within(&wire[..whole], &mut out, &mut like(&s), 1),
        Err(CodecError::Malformed(_))
    ));
    assert!(out.is_empty());
    // The genuine record decodes.
    assert_eq!(
        dec.decode_record_in(&wire[..whole], &mut out, &mut s),
        Ok(whole)
    );
    assert!(!out.is_empty());
}
