//! Properties of the whole frame codec: any frames encode and parse back as they were, every
//! prefix of a frame is incomplete, and no bytes at all make it panic.

use bytes::{Bytes, BytesMut};
use proptest::prelude::*;

use super::*;
use crate::error::FrameError;

fn arb_name() -> impl Strategy<Value = String> {
    proptest::string::string_regex("[a-z0-9_.-]{0,40}").expect("valid regex")
}

fn arb_frame() -> impl Strategy<Value = Frame> {
    let sid = (1u32..).prop_map(StreamId);
    prop_oneof![
        (
            any::<u16>(),
            any::<u16>(),
            arb_name(),
            any::<u64>(),
            proptest::collection::vec((any::<u16>(), any::<u64>()), 0..8),
            proptest::collection::vec(
                (
                    any::<bool>(),
                    any::<u8>(),
                    arb_name(),
                    proptest::collection::vec(any::<[u8; 16]>(), 0..=MAX_DIGESTS)
                ),
                0..4
            ),
            proptest::collection::vec(arb_name(), 0..4)
        )
            .prop_map(
                |(version, min_version, site, capabilities, settings, caches, scoped)| {
                    Frame::Hello(Hello {
                        version,
                        min_version,
                        site,
                        capabilities,
                        settings,
                        caches: caches
                            .into_iter()
                            .map(|(decoder, lane, scope, digests)| CacheOffer {
                                decoder,
                                lane,
                                scope,
                                digests,
                            })
                            .collect(),
                        scoped,
                    })
                }
            ),
        (
            sid.clone(),
            prop_oneof![Just(Class::Latency), Just(Class::Bulk)],
            arb_name()
        )
            .prop_map(|(stream, class, service)| Frame::Open {
                stream,
                class,
                service
            }),
        (
            sid.clone(),
            0u64..u64::MAX / 2,
            any::<bool>(),
            proptest::collection::vec(any::<u8>(), 0..2000)
        )
            .prop_map(|(stream, offset, fin, d)| Frame::Data {
                stream,
                offset,
                fin,
                data: Bytes::from(d)
            }),
        (sid.clone(), any::<u16>(), arb_name()).prop_map(|(stream, c, reason)| Frame::Reset {
            stream,
            code: ResetCode::from_u16(c),
            reason
        }),
        (any::<u32>(), any::<u64>()).prop_map(|(s, max)| Frame::MaxData {
            stream: StreamId(s),
            max
        }),
        any::<u64>().prop_map(|payload| Frame::Ping { payload }),
        any::<u64>().prop_map(|payload| Frame::Pong { payload }),
        (any::<u16>(), arb_name()).prop_map(|(c, reason)| Frame::GoAway {
            code: CloseCode::from_u16(c),
            reason
        }),
        (
            sid.clone(),
            0u64..u64::MAX / 2,
            any::<(bool, bool)>(),
            any::<u32>(),
            proptest::collection::vec(any::<u8>(), 0..2000)
        )
            .prop_map(|(stream, offset, (fin, scoped), raw_len, d)| Frame::Coded {
                stream,
                offset,
                fin,
                scoped,
                raw_len,
                records: Bytes::from(d)
            }),
        (
            prop_oneof![sid.clone(), (1u32..300).prop_map(StreamId)],
            any::<u16>(),
            any::<(bool, bool)>(),
            0..=SHORT_RAW_MAX,
            proptest::collection::vec(any::<u8>(), 0..2000)
        )
            .prop_map(
                |(stream, at, (fin, scoped), raw_len, d)| Frame::CodedShort {
                    stream,
                    at,
                    fin,
                    scoped,
                    raw_len,
                    records: Bytes::from(d)
                }
            ),
        (sid.clone(), arb_name(), any::<[u8; 16]>()).prop_map(|(stream, scope, fingerprint)| {
            Frame::Need {
                stream,
                scope,
                fingerprint,
            }
        }),
        (
            sid.clone(),
            arb_name(),
            any::<[u8; 16]>(),
            proptest::collection::vec(any::<u8>(), 0..2000)
        )
            .prop_map(|(stream, scope, fingerprint, d)| Frame::Chunk {
                stream,
                scope,
                fingerprint,
                data: Bytes::from(d)
            }),
        (arb_name(), any::<[u8; 16]>())
            .prop_map(|(scope, digest)| Frame::Checkpoint { scope, digest }),
        (sid.clone(), any::<u64>()).prop_map(|(stream, offset)| Frame::Finished { stream, offset }),
        any::<u64>().prop_map(|offset| Frame::Received { offset }),
        (
            any::<(u64, u64, u32, u32, bool, bool)>(),
            proptest::collection::vec((1u32.., any::<(u64, u64, bool, bool, bool)>()), 0..40)
        )
            .prop_map(|((link_received, link_max, s0, s1, last, lane), es)| {
                Frame::Resume(Box::new(Resume {
                    link_received,
                    link_max,
                    seen: [s0, s1],
                    entries: es
                        .into_iter()
                        .map(|(s, (received, max, fin, done, latency))| ResumeEntry {
                            stream: StreamId(s),
                            received,
                            max,
                            fin,
                            done,
                            latency,
                        })
                        .collect(),
                    last,
                    lane,
                }))
            }),
    ]
}

proptest! {
    #[test]
    fn round_trip(frames in proptest::collection::vec(arb_frame(), 1..8)) {
        let mut buf = BytesMut::new();
        for f in &frames {
            let before = buf.len();
            f.encode(&mut buf);
            prop_assert_eq!(buf.len() - before, f.encoded_len());
        }
        let mut got = Vec::new();
        loop {
            match Frame::check(&buf, MAX_PAYLOAD_HARD) {
                Ok(n) => got.push(Frame::parse(buf.split_to(n).freeze()).expect("parse")),
                Err(FrameError::Incomplete) => break,
                Err(e) => panic!("{e}"),
            }
        }
        prop_assert!(buf.is_empty());
        prop_assert_eq!(got, frames);
    }

    #[test]
    fn every_prefix_is_incomplete(f in arb_frame()) {
        let mut buf = BytesMut::new();
        f.encode(&mut buf);
        for cut in 0..buf.len() {
            prop_assert_eq!(Frame::check(&buf[..cut], MAX_PAYLOAD_HARD), Err(FrameError::Incomplete));
        }
    }

    #[test]
    fn garbage_never_panics(data in proptest::collection::vec(any::<u8>(), 0..256)) {
        if let Ok(n) = Frame::check(&data, 4096) {
            let _ = Frame::parse(Bytes::copy_from_slice(&data[..n]));
        }
    }
}

/// A short coded frame's header is checked field by field: its stream id's varint in its one
/// shortest form and nonzero, its length capped before its records are buffered, no unknown
/// flag; its raw length is cut to 24 bits when written.
#[test]
fn short_coded_headers_are_checked() {
    use super::layout::kind::CODED_SHORT;
    let frame = |id: &[u8], len: [u8; 3], rest: &[u8]| {
        let mut b = vec![CODED_SHORT];
        b.extend_from_slice(id);
        b.extend_from_slice(&len);
        b.extend_from_slice(&[0, 0, 9, 0, 1]);
        b.extend_from_slice(rest);
        b
    };
    let ok = frame(&[0x85, 0x01], [0, 0, 2], b"ab");
    assert_eq!(Frame::check(&ok, 4096), Ok(ok.len()));
    assert_eq!(
        Frame::parse(Bytes::from(ok)),
        Ok(Frame::CodedShort {
            stream: StreamId(133),
            at: 1,
            fin: false,
            scoped: false,
            raw_len: 9,
            records: Bytes::from_static(b"ab"),
        })
    );
    let malformed = |b: Vec<u8>, why| {
        let n = Frame::check(&b, 4096).map_err(|e| (e, why))?;
        Frame::parse(Bytes::copy_from_slice(&b[..n])).map_err(|e| (e, why))
    };
    for (b, why) in [
        (
            frame(&[0x85, 0x00], [0, 0, 0], b""),
            "varint not in its shortest form",
        ),
        (frame(&[0], [0, 0, 0], b""), "stream id 0 on a stream frame"),
        (
            frame(&[0xff, 0xff, 0xff, 0xff, 0x1f], [0, 0, 0], b""),
            "stream id above 32 bits",
        ),
        (
            frame(&[0x81, 0, 0], [0, 0, 0], b""),
            "varint not in its shortest form",
        ),
        (frame(&[1], [0x20, 0, 0], b""), "unknown short frame flag"),
    ] {
        assert_eq!(malformed(b, why), Err((FrameError::Malformed(why), why)));
    }
    let mut long = vec![CODED_SHORT];
    long.extend_from_slice(&[0x80; 5]);
    assert_eq!(
        Frame::check(&long, 4096),
        Err(FrameError::Malformed("varint longer than 5 bytes"))
    );
    // Too large, refused on the length alone.
    assert_eq!(
        Frame::check(&[CODED_SHORT, 1, 0x10, 0, 1], 4096),
        Err(FrameError::TooLarge {
            len: 0x10_0001,
            max: 4096
        })
    );
    let mut big = BytesMut::new();
    Frame::CodedShort {
        stream: StreamId(1),
        at: 0,
        fin: false,
        scoped: false,
        raw_len: u32::MAX,
        records: Bytes::new(),
    }
    .encode(&mut big);
    match Frame::parse(big.freeze()) {
        Ok(Frame::CodedShort { raw_len, .. }) => assert_eq!(raw_len, SHORT_RAW_MAX),
        other => panic!("{other:?}"),
    }
}

#[test]
fn long_names_truncate_on_char_boundary() {
    let name = "é".repeat(200);
    let f = Frame::GoAway {
        code: CloseCode::Normal,
        reason: name,
    };
    let mut buf = BytesMut::new();
    f.encode(&mut buf);
    let n = Frame::check(&buf, MAX_PAYLOAD_HARD).expect("whole");
    match Frame::parse(buf.split_to(n).freeze()).expect("parse") {
        Frame::GoAway { reason, .. } => assert_eq!(reason.len(), 254),
        other => panic!("{other:?}"),
    }
}
