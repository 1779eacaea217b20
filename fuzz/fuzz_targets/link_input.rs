//! Fuzzes the link state machine: after a valid hello, arbitrary peer bytes (split at arbitrary
//! points) must never panic, and the link either stays consistent or closes with an error.
//! Resumption is on: halfway through, the connection may be lost and resumed (a valid resuming
//! hello), so the peer's resume lists and `Finished` frames are reachable too.
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
    cfg.resume_window = Duration::from_secs(30);
    cfg.token = 5;
    let mut link = Link::new(cfg);
    link.set_services(["a", "b"]);
    let hello = |resume: Option<u64>| {
        let mut settings = vec![
            (1, 65536),
            (2, 1 << 20),
            (3, 65536),
            (4, 8),
            (7, 1 << 20),
            (8, 1 << 19),
        ];
        settings.extend(resume.map(|t| (11, t)));
        let mut b = BytesMut::new();
        Frame::Hello(Hello {
            version: 1,
            min_version: 1,
            site: "west".into(),
            capabilities: 2 | 32,
            settings,
            caches: vec![],
            scoped: vec!["b".into()],
        })
        .encode(&mut b);
        b
    };
    let _ = link.handle_input(&hello(None), now);
    let (split, rest) = match data.split_first() {
        Some((s, r)) => (*s as usize + 1, r),
        None => return,
    };
    let cut = (split % 2 == 0).then_some(rest.len() / split / 2);
    let mut out = BytesMut::new();
    for (i, chunk) in rest.chunks(split).enumerate() {
        let t = now + Duration::from_millis(i as u64);
        if cut == Some(i) && link.suspend("fuzz", t) && link.accept_resume(t, 5, 6, Vec::new()) {
            let _ = link.handle_input(&hello(Some(5)), t);
        }
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
        link.poll_transmit(t, &mut out, 1 << 16);
    }
});
