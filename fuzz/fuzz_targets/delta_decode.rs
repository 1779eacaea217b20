//! Fuzzes the decoding of delta records, delta runs and reference runs: against a cache holding real bases, arbitrary payloads
//! (zstd with the bases as dictionary), genuine delta records with bytes flipped, and arbitrary
//! records must never panic, allocate past the record limit or hand over bytes that do not match
//! the chunk's fingerprint.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use wanopt_codec::cache::fingerprint;
use wanopt_codec::{CodecConfig, CodecError, Decoder, Encoder, Pressure};

struct Primed {
    /// Records of the first data (literals), which fill a decoder's cache with bases.
    first: Vec<u8>,
    /// Records of the edited data: deltas against the first.
    second: Vec<u8>,
    /// The first data's chunks, by fingerprint.
    bases: Vec<[u8; 16]>,
}

fn cfg() -> CodecConfig {
    CodecConfig {
        cache_bytes: 4 << 20,
        ..CodecConfig::default()
    }
}

fn primed() -> &'static Primed {
    static P: OnceLock<Primed> = OnceLock::new();
    P.get_or_init(|| {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut data = Vec::new();
        while data.len() < 96 * 1024 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            data.extend_from_slice(
                format!("{}|row {}|{:x}|open\n", data.len(), x % 9973, x >> 40).as_bytes(),
            );
        }
        let mut edited = data.clone();
        for i in (500..edited.len()).step_by(3000) {
            edited[i] ^= 0x11;
        }
        let mut enc = Encoder::new(cfg());
        let (mut first, mut second) = (Vec::new(), Vec::new());
        enc.push(&data, false, Pressure::LinkBound, &mut first);
        enc.end_stream(Pressure::LinkBound, &mut first);
        enc.push(&edited, false, Pressure::LinkBound, &mut second);
        enc.end_stream(Pressure::LinkBound, &mut second);
        let bases = wanopt_codec::chunks(&data, &cfg())
            .map(|(o, l)| fingerprint(&data[o..o + l]))
            .collect();
        Primed {
            first,
            second,
            bases,
        }
    })
}

/// Decodes `records` record by record; every chunk handed over came whole.
fn check(dec: &mut Decoder, records: &[u8]) {
    let mut at = 0;
    let mut out = Vec::new();
    while at < records.len() {
        let before = out.len();
        match dec.decode_record(&records[at..], &mut out) {
            Ok(n) if n > 0 => at += n,
            Ok(_) => break,
            Err(CodecError::Miss(_) | CodecError::Pending(_)) => break,
            Err(_) => {
                assert_eq!(out.len(), before, "nothing handed over from a bad record");
                break;
            }
        }
        assert!(out.len() - before <= wanopt_codec::MAX_RECORD);
    }
}

fuzz_target!(|data: &[u8]| {
    let p = primed();
    let mut dec = Decoder::new(&cfg());
    let mut out = Vec::new();
    dec.decode(&p.first, &mut out)
        .expect("the primed records decode");
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    // A delta record built from real bases and a fuzzed payload and name.
    let n = 1 + usize::from(sel % 8);
    let mut rec = vec![7u8];
    let raw = 1 + usize::from(rest.first().copied().unwrap_or(0)) * 64;
    put_len(&mut rec, raw);
    rec.push(n as u8);
    for i in 0..n {
        let pick = rest.get(1 + i).copied().unwrap_or(0) as usize;
        rec.extend_from_slice(&p.bases[pick % p.bases.len()]);
    }
    let mut name = [0u8; 16];
    for (d, s) in name.iter_mut().zip(rest.iter().skip(9)) {
        *d = *s;
    }
    rec.extend_from_slice(&name);
    let payload = rest.get(25..).unwrap_or(&[]);
    put_len(&mut rec, payload.len());
    rec.extend_from_slice(payload);
    check(&mut dec, &rec);
    // A delta run record built the same way: real bases, fuzzed lengths, check and payload.
    let chunks = 1 + usize::from(sel >> 5);
    let mut run = vec![9u8, chunks as u8, n as u8];
    for i in 0..n {
        let pick = rest.get(1 + i).copied().unwrap_or(0) as usize;
        run.extend_from_slice(&p.bases[pick % p.bases.len()]);
    }
    for i in 0..chunks {
        put_len(&mut run, 1 + usize::from(rest.get(9 + i).copied().unwrap_or(0)) * 64);
    }
    run.extend_from_slice(&name);
    put_len(&mut run, payload.len());
    run.extend_from_slice(payload);
    check(&mut dec, &run);
    // A reference run at a fuzzed place of the primed stream's log, with a fuzzed check.
    let mut refs = vec![11u8];
    put_len(&mut refs, usize::from(sel & 3));
    put_len(&mut refs, usize::from(rest.get(2).copied().unwrap_or(0)));
    put_len(&mut refs, usize::from(sel >> 2));
    refs.extend_from_slice(&name);
    check(&mut dec, &refs);
    // Genuine deltas, delta runs and reference runs with the input's bytes flipped into them.
    let mut flipped = p.second.clone();
    for (i, b) in data.iter().enumerate() {
        let at = (i * 7919 + usize::from(sel) * 131) % flipped.len();
        flipped[at] ^= *b;
    }
    check(&mut dec, &flipped);
    // And the input as records.
    check(&mut dec, data);
});

fn put_len(out: &mut Vec<u8>, mut n: usize) {
    loop {
        if n < 0x80 {
            out.push(n as u8);
            return;
        }
        out.push((n as u8 & 0x7f) | 0x80);
        n >>= 7;
    }
}
