//! Fuzzes the optimization codec's decoder: arbitrary records must never panic or allocate past
//! the record limit, whatever the cache holds, and whatever zstd context the stream has; a
//! decoder that decompresses literals ahead on workers must rebuild exactly the same, with the
//! workers in turn on its thread or on a thread beside it (the daemon's pool: the jobs then
//! write into the output while the decoding thread counts earlier records in); and one whose
//! frame is fed ahead first (its context records fed, its delta runs rebuilt, both then copied
//! into place on the thread beside) must too; and so must one that feeds the records behind
//! the frame before them (`feed_after`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use wanopt_codec::prepare::{Ahead, Job, Workers};
use wanopt_codec::{CodecConfig, Decoder, Encoder, Pressure};

/// Workers on a thread beside the caller's, started for each call.
#[derive(Debug)]
struct Beside;

impl Workers for Beside {
    fn run(&self, jobs: &mut [Job<'_>]) {
        let (a, b) = jobs.split_at_mut(jobs.len() / 2);
        std::thread::scope(|s| {
            s.spawn(|| a.iter_mut().for_each(Job::run));
            b.iter_mut().for_each(Job::run);
        });
    }

    fn threads(&self) -> usize {
        2
    }

    fn overlap(&self, ahead: &Ahead<'_>, caller: &mut dyn FnMut()) {
        std::thread::scope(|s| {
            s.spawn(|| ahead.work());
            caller();
            ahead.work();
        });
    }
}

fuzz_target!(|data: &[u8]| {
    let cfg = CodecConfig {
        cache_bytes: 1 << 20,
        ..CodecConfig::default()
    };
    // Prime the decoder with a few real chunks so references can hit. With an odd first byte,
    // as a live stream on a slow link: flushed writes in a zstd context, which the fuzzed
    // records then continue.
    let mut enc = Encoder::new(cfg.clone());
    let mut dec = Decoder::new(&cfg);
    let mut wire = Vec::new();
    let live = data.first().is_some_and(|b| b & 1 == 1);
    let prime = &data[..data.len().min(64 * 1024)];
    if live {
        for w in prime.chunks(700) {
            enc.push(w, true, Pressure::LinkBound, &mut wire);
        }
    } else {
        enc.push(prime, true, Pressure::CpuBound, &mut wire);
    }
    let mut pooled = Decoder::new(&cfg);
    pooled.set_workers(Some(std::sync::Arc::new(wanopt_codec::prepare::Inline)));
    let mut beside = Decoder::new(&cfg);
    beside.set_workers(Some(std::sync::Arc::new(Beside)));
    let mut ahead = Decoder::new(&cfg);
    ahead.set_workers(Some(std::sync::Arc::new(Beside)));
    let mut ctx = wanopt_codec::StreamContext::default();
    let _ = ahead.decode_frame(&wire, &mut Vec::new(), &mut ctx, usize::MAX);
    // The priming frame fed ahead, then the raw input fed behind it.
    let mut chain = Decoder::new(&cfg);
    chain.set_workers(Some(std::sync::Arc::new(Beside)));
    let mut cctx = wanopt_codec::StreamContext::default();
    let first = chain.feed_ahead(bytes::Bytes::from(wire.clone()), &mut cctx, usize::MAX);
    // Its chunks named as they are fed, or when they are taken.
    let next = first.as_ref().and_then(|f| {
        let records = bytes::Bytes::copy_from_slice(data);
        chain.feed_after(f, records, usize::MAX, data.len() % 3 == 0)
    });
    if let Some(n) = &next {
        wanopt_codec::prepare::Deferred::spawn(n, &Beside);
    }
    if let Some(f) = first {
        f.finish(&mut cctx);
    }
    let _ = chain.decode_frame(&wire, &mut Vec::new(), &mut cctx, usize::MAX);
    if let Some(n) = next {
        n.finish(&mut cctx);
    }
    let mut out = Vec::new();
    let _ = dec.decode(&wire, &mut out);
    let _ = pooled.decode(&wire, &mut Vec::new());
    let _ = beside.decode(&wire, &mut Vec::new());
    // Then feed the raw input as records.
    let mut out = Vec::new();
    let r = dec.decode(data, &mut out);
    assert!(out.len() <= data.len().saturating_mul(300) + wanopt_codec::MAX_RECORD * 2);
    let mut again = Vec::new();
    assert_eq!(pooled.decode(data, &mut again), r);
    assert!(again == out);
    let mut again = Vec::new();
    assert_eq!(beside.decode(data, &mut again), r);
    assert!(again == out);
    if let Some(f) = ahead.feed_ahead(bytes::Bytes::copy_from_slice(data), &mut ctx, usize::MAX) {
        // Helped here (its literals alone taken as fed), or finished as it is.
        if data.len() % 2 == 0 {
            while wanopt_codec::prepare::Deferred::help(&f) {}
        }
        f.finish(&mut ctx);
    }
    // The input decoded as a frame: what `decode` gave, to the byte.
    for (d, c) in [(&mut ahead, &mut ctx), (&mut chain, &mut cctx)] {
        let mut again = Vec::new();
        let (used, stop) = d.decode_frame(data, &mut again, c, usize::MAX);
        let fed = match stop {
            None | Some(wanopt_codec::CodecError::Incomplete) => Ok(used),
            Some(e) => Err(e),
        };
        assert_eq!(fed, r);
        assert!(again == out);
    }
});
