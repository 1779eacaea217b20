//! Fuzzes the handover a restarted daemon reads from the process before it (`Link::take_over`):
//! arbitrary bytes must be refused or give a suspended link that resumes on a new connection,
//! transmits, and hands itself over again into a state that is read back the same way. The
//! input is tried as it is and behind a valid head (magic, version, this link's names), so the
//! parser past the head is reached.
#![no_main]

use std::time::{Duration, Instant};

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use wanopt_proto::{HANDOVER_VERSION, Link, LinkConfig};

fn cfg() -> LinkConfig {
    let mut c = LinkConfig::new("west", "east", true);
    c.resume_window = Duration::from_secs(30);
    c
}

fuzz_target!(|data: &[u8]| {
    let now = Instant::now();
    let mut head = b"WOHO".to_vec();
    head.extend_from_slice(&HANDOVER_VERSION.to_be_bytes());
    head.push(1);
    for name in ["west", "east"] {
        head.extend_from_slice(&(name.len() as u16).to_be_bytes());
        head.extend_from_slice(name.as_bytes());
    }
    head.extend_from_slice(data);
    for input in [data, &head[..]] {
        let Ok(mut link) = Link::take_over(cfg(), input, now) else {
            continue;
        };
        let again = link.hand_over(now).expect("a taken-over link hands over again");
        let mut link = Link::take_over(cfg(), &again, now).expect("and is read back");
        while link.poll_event().is_some() {}
        assert!(link.reconnect(now, Vec::new()));
        let mut out = BytesMut::new();
        link.poll_transmit(now, &mut out, 1 << 20);
        assert!(!out.is_empty(), "the resuming hello goes out");
        link.handle_timeout(now + Duration::from_secs(60));
    }
});
