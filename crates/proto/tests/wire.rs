//! The wire format, pinned: one frame of every kind (and the coded-frame and data-frame headers
//! the scheduler writes in place) encodes to the bytes recorded here, and those bytes parse back
//! to the same frame. A change to the frame code that moves a byte fails here, so a daemon of
//! this build still speaks to one of an earlier build.

use bytes::{Bytes, BytesMut};
use wanopt_proto::frame::{
    CacheOffer, Class, CloseCode, Frame, Hello, ResetCode, Resume, ResumeEntry, StreamId,
    begin_coded, encode_data_header, finish_coded,
};

fn frames() -> Vec<Frame> {
    let s = StreamId(7);
    vec![
        Frame::Hello(Hello {
            version: 3,
            min_version: 1,
            site: "west".into(),
            capabilities: 0x1f,
            settings: vec![(1, 4 << 20), (5, 0xdead_beef)],
            caches: vec![CacheOffer {
                decoder: true,
                lane: 1,
                scope: "dg".into(),
                digests: vec![[0xab; 16]],
            }],
            scoped: vec!["rman".into()],
        }),
        Frame::Open {
            stream: s,
            class: Class::Latency,
            service: "dg".into(),
        },
        Frame::Data {
            stream: s,
            offset: 1 << 33,
            fin: true,
            data: Bytes::from_static(b"redo"),
        },
        Frame::Reset {
            stream: s,
            code: ResetCode::TargetRefused,
            reason: "no".into(),
        },
        Frame::MaxData { stream: s, max: 9 },
        Frame::Ping { payload: 42 },
        Frame::Pong { payload: 43 },
        Frame::GoAway {
            code: CloseCode::Replaced,
            reason: "newer".into(),
        },
        Frame::Coded {
            stream: s,
            offset: 5,
            fin: false,
            scoped: true,
            raw_len: 100,
            records: Bytes::from_static(&[1, 2, 3]),
        },
        Frame::Need {
            stream: s,
            scope: "".into(),
            fingerprint: [1; 16],
        },
        Frame::Chunk {
            stream: s,
            scope: "gg".into(),
            fingerprint: [2; 16],
            data: Bytes::from_static(b"chunk"),
        },
        Frame::Checkpoint {
            scope: "x".into(),
            digest: [3; 16],
        },
        Frame::Finished {
            stream: s,
            offset: 77,
        },
        Frame::Resume(Box::new(Resume {
            link_received: 10,
            link_max: 20,
            seen: [3, 4],
            entries: vec![ResumeEntry {
                stream: s,
                received: 1,
                max: 2,
                fin: true,
                done: false,
                latency: true,
            }],
            last: true,
            lane: false,
        })),
        Frame::CodedShort {
            stream: StreamId(300),
            at: 5,
            fin: true,
            scoped: false,
            raw_len: 100,
            records: Bytes::from_static(&[1, 2, 3]),
        },
        Frame::Received { offset: 1 << 40 },
    ]
}

/// The bytes each of [`frames`] encodes to, as recorded from the build before the frame code
/// was split (7e4cb03); the last kind came after it.
const RECORDED: [&str; 16] = [
    "01000000000000000046000300010477657374000000000000001f000200010000000000400000000500000000deadbeef0001010102646701abababababababababababababababab000104726d616e",
    "0200000000070000000400026467",
    "0301000000070000000c00000002000000007265646f",
    "040000000007000000050002026e6f",
    "050000000007000000080000000000000009",
    "06000000000000000008000000000000002a",
    "07000000000000000008000000000000002b",
    "080000000000000000080004056e65776572",
    "0902000000070000000f000000000000000500000064010203",
    "0a0000000007000000110101010101010101010101010101010100",
    "0b000000000700000018020202020202020202020202020202020267676368756e6b",
    "0c000000000000000012030303030303030303030303030303030178",
    "0d000000000700000008000000000000004d",
    "0e01000000000000002f000000000000000a000000000000001400000003000000040001000000070000000000000001000000000000000205",
    "0fac028000030000640005010203",
    "100000000000000000080000010000000000",
];

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn every_frame_kind_encodes_to_the_recorded_bytes_and_back() {
    for (f, want) in frames().into_iter().zip(RECORDED) {
        let mut out = BytesMut::new();
        f.encode(&mut out);
        assert_eq!(hex(&out), want, "{f:?}");
        assert_eq!(out.len(), f.encoded_len());
        let n = Frame::check(&out, 1 << 20).expect("whole");
        assert_eq!(n, out.len());
        assert_eq!(Frame::parse(out.freeze()).expect("parses"), f);
    }
}

#[test]
fn headers_written_in_place_match_the_recorded_frames() {
    let mut out = BytesMut::new();
    encode_data_header(&mut out, StreamId(7), 1 << 33, true, 4);
    out.extend_from_slice(b"redo");
    assert_eq!(hex(&out), RECORDED[2]);
    let mut out = BytesMut::new();
    let at = begin_coded(&mut out, StreamId(7), 5, false);
    out.extend_from_slice(&[1, 2, 3]);
    finish_coded(&mut out, at, false, true, 100);
    assert_eq!(hex(&out), RECORDED[8]);
    let mut out = BytesMut::new();
    let at = begin_coded(&mut out, StreamId(300), 1 << 32 | 5, true);
    out.extend_from_slice(&[1, 2, 3]);
    finish_coded(&mut out, at, true, false, 100);
    assert_eq!(hex(&out), RECORDED[14]);
}
