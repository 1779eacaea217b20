//! Fuzzes the link state machine: after a valid hello, arbitrary peer bytes (split at arbitrary
//! points) must never panic, and the link either stays consistent or closes with an error.
#![no_main]

use std::time::{Duration, Instant};

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use wanopt_proto::{CodecSettings, Frame, Hello, Link, LinkConfig, ReadOutcome};

fuzz_target!(|data: &[u8]| {
    let now = Instant::now();
    let mut cfg = LinkConfig::new("east", "west", false);
    // With the codec on, coded frames, chunk requests and answers are reachable too.
    cfg.codec = Some(CodecSettings {
        cache_bytes: 1 << 20,
        service_cache_bytes: 1 << 19,
        ..CodecSettings::default()
    });
    let mut link = Link::new(cfg);
    link.set_services(["a", "b"]);
    let mut hello = BytesMut::new();
    Frame::Hello(Hello {
        version: 1,
        min_version: 1,
        site: "west".into(),
        capabilities: 2,
        settings: vec![
            (1, 65536),
            (2, 1 << 20),
            (3, 65536),
            (4, 8),
            (7, 1 << 20),
            (8, 1 << 19),
        ],
        caches: vec![],
        scoped: vec!["b".into()],
    })
    .encode(&mut hello);
    let _ = link.handle_input(&hello, now);
    let (split, rest) = match data.split_first() {
        Some((s, r)) => (*s as usize + 1, r),
        None => return,
    };
    let mut out = BytesMut::new();
    for (i, chunk) in rest.chunks(split).enumerate() {
        let t = now + Duration::from_millis(i as u64);
        let _ = link.handle_input(chunk, t);
        while let Some(ev) = link.poll_event() {
            if let wanopt_proto::Event::Opened { stream, .. } = ev {
                let _ = link.write(stream, &[7u8; 9000]);
                let _ = link.finish(stream);
            }
        }
        for id in 1..16u32 {
            while let Ok(ReadOutcome::Data(_)) = link.read(wanopt_proto::StreamId(id)) {}
        }
        link.handle_timeout(t);
        out.clear();
        link.poll_transmit(&mut out, 1 << 16);
    }
});
