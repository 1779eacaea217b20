//! Fuzzes the optimization codec's decoder: arbitrary records must never panic or allocate past
//! the record limit, whatever the cache holds.
#![no_main]

use libfuzzer_sys::fuzz_target;
use wanopt_codec::{CodecConfig, Decoder, Encoder, Pressure};

fuzz_target!(|data: &[u8]| {
    let cfg = CodecConfig {
        cache_bytes: 1 << 20,
        ..CodecConfig::default()
    };
    // Prime the decoder with a few real chunks so references can hit.
    let mut enc = Encoder::new(cfg.clone());
    let mut dec = Decoder::new(&cfg);
    let mut wire = Vec::new();
    enc.push(
        &data[..data.len().min(64 * 1024)],
        true,
        Pressure::CpuBound,
        &mut wire,
    );
    let mut out = Vec::new();
    let _ = dec.decode(&wire, &mut out);
    // Then feed the raw input as records.
    let mut out = Vec::new();
    let _ = dec.decode(data, &mut out);
    assert!(out.len() <= data.len().saturating_mul(300) + wanopt_codec::MAX_RECORD * 2);
});
