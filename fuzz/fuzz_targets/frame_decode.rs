//! Fuzzes the frame decoder: check-then-parse on arbitrary bytes must never panic, and every frame
//! it accepts must re-encode to the same bytes.
#![no_main]

use bytes::{Bytes, BytesMut};
use libfuzzer_sys::fuzz_target;
use wanopt_proto::{Frame, FrameError};

fuzz_target!(|data: &[u8]| {
    let mut buf = data;
    loop {
        match Frame::check(buf, 1 << 20) {
            Ok(n) => {
                if let Ok(f) = Frame::parse(Bytes::copy_from_slice(&buf[..n])) {
                    let mut out = BytesMut::new();
                    f.encode(&mut out);
                    assert_eq!(out.len(), f.encoded_len());
                    let again = Frame::parse(out.freeze()).expect("re-encoded frame parses");
                    assert_eq!(again, f);
                }
                buf = &buf[n..];
            }
            Err(FrameError::Incomplete) => break,
            Err(_) => break,
        }
    }
});
