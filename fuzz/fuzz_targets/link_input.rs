//! Fuzzes the link state machine: after a valid hello, arbitrary peer bytes (split at arbitrary
//! points) must never panic, and the link either stays consistent or closes with an error.
#![no_main]

use std::time::{Duration, Instant};

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use wanopt_proto::{Frame, Hello, Link, LinkConfig, ReadOutcome};

fuzz_target!(|data: &[u8]| {
    let now = Instant::now();
    let mut link = Link::new(LinkConfig::new("east", "west", false));
    link.set_services(["a", "b"]);
    let mut hello = BytesMut::new();
    Frame::Hello(Hello {
        version: 1,
        min_version: 1,
        site: "west".into(),
        capabilities: 0,
        settings: vec![(1, 65536), (2, 1 << 20), (3, 16384), (4, 8)],
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
                let _ = link.write(stream, b"reply");
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
