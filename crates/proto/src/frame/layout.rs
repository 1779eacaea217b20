//! The frame and its layout on the wire: a 10-byte header (kind, flags, stream id, payload
//! length) and a payload whose length [`Frame::check`] caps before anything is buffered or
//! allocated. What each kind's payload holds is in `parse.rs` and `encode.rs`.

use bytes::Bytes;

use super::hello::Hello;
use crate::codes::{Class, CloseCode, ResetCode, StreamId};
use crate::error::FrameError;

/// Bytes in a frame header: kind (1), flags (1), stream id (4), payload length (4).
pub const HEADER_LEN: usize = 10;

/// The largest payload a decoder accepts at all, whatever the negotiated settings.
pub const MAX_PAYLOAD_HARD: u32 = 1 << 20;

/// Longest service name, site name or reason text carried in a frame.
pub const MAX_NAME_LEN: usize = 255;

/// Overhead of a data frame on top of its payload.
pub const DATA_OVERHEAD: usize = HEADER_LEN + 8;

/// Overhead of a coded frame on top of its records.
pub const CODED_OVERHEAD: usize = HEADER_LEN + 12;

/// Overhead of a short coded frame ([`Frame::CodedShort`]) on top of its records, besides its
/// stream id's varint (1 byte below 128, 2 below 16,384, at most 5): kind (1), flags and
/// record length (3), raw length (3), offset check (2).
pub const SHORT_CODED_FIXED: usize = 9;

/// Largest raw length a short coded frame carries (24 bits); a turn never comes near it.
pub const SHORT_RAW_MAX: u32 = (1 << 24) - 1;

/// Largest record length the 21 bits of a short coded frame hold (above [`MAX_PAYLOAD_HARD`]).
pub(super) const SHORT_LEN_MASK: u32 = (1 << 21) - 1;
/// A short coded frame's flags, in the top bits of its 24-bit record length.
pub(super) const SHORT_FIN: u32 = 1 << 23;
pub(super) const SHORT_SCOPED: u32 = 1 << 22;

/// Bytes of a short coded frame's header on `stream`.
pub fn short_coded_overhead(stream: StreamId) -> usize {
    SHORT_CODED_FIXED + varint_len(stream.0)
}

/// Bytes of `v` as a LEB128 varint.
pub(super) fn varint_len(v: u32) -> usize {
    match v {
        0..0x80 => 1,
        0x80..0x4000 => 2,
        0x4000..0x20_0000 => 3,
        0x20_0000..0x1000_0000 => 4,
        _ => 5,
    }
}

/// One frame of the link protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Version and capability exchange; the first frame each way.
    Hello(Hello),
    /// Open a stream to a named service of the peer's own configuration.
    Open {
        stream: StreamId,
        class: Class,
        service: String,
    },
    /// Stream bytes at `offset` (the stream position of the first byte); `fin` ends this direction.
    Data {
        stream: StreamId,
        offset: u64,
        fin: bool,
        data: Bytes,
    },
    /// Abort a stream in both directions.
    Reset {
        stream: StreamId,
        code: ResetCode,
        reason: String,
    },
    /// Credit: the receiver allows data up to absolute offset `max` (stream 0: link-wide byte count).
    /// Absolute limits double as acknowledgements of what was consumed.
    MaxData { stream: StreamId, max: u64 },
    /// Liveness and round-trip probe.
    Ping { payload: u64 },
    /// Answer to a ping, echoing its payload.
    Pong { payload: u64 },
    /// The sender closes the link: no new frames follow.
    GoAway { code: CloseCode, reason: String },
    /// Optimized stream bytes: `records` of the codec that rebuild `raw_len` bytes at `offset`,
    /// against the link's shared cache or (`scoped`) the stream's service's own.
    Coded {
        stream: StreamId,
        offset: u64,
        fin: bool,
        scoped: bool,
        raw_len: u32,
        records: Bytes,
    },
    /// A [`Frame::Coded`] with a short header (with `CAP_SHORT_CODED`): the stream id as a
    /// varint, the raw length in 24 bits, and instead of the offset its low 16 bits, `at`. A
    /// stream's coded frames arrive in order, so the receiver knows the offset (what it received
    /// of the stream so far) and checks it against `at`.
    CodedShort {
        stream: StreamId,
        at: u16,
        fin: bool,
        scoped: bool,
        raw_len: u32,
        records: Bytes,
    },
    /// A reference could not be resolved: the receiver asks for the chunk of `fingerprint` in the
    /// cache `scope` (empty: the link's shared cache; else a service's own).
    Need {
        stream: StreamId,
        scope: String,
        fingerprint: [u8; 16],
    },
    /// The answer to [`Frame::Need`]: the chunk's bytes, or none if the sender no longer has it.
    Chunk {
        stream: StreamId,
        scope: String,
        fingerprint: [u8; 16],
        data: Bytes,
    },
    /// The sender saved its mirror of the cache `scope` of this lane, whose state has `digest`;
    /// the receiver saves its cache too if its digest is the same.
    Checkpoint { scope: String, digest: [u8; 16] },
    /// Every byte of the stream up to `offset` and its end arrived (with `CAP_RESUME`): the
    /// sender may forget what it kept to send again.
    Finished { stream: StreamId, offset: u64 },
    /// After a resumed link's hellos: what the sender of this frame received before the old
    /// connection was lost, so the other side sends the rest. `last` ends the list.
    Resume(Box<Resume>),
    /// Main-lane bytes of the peer's that the sender of this frame has read, past the hellos
    /// (with `CAP_REPLAY`): the peer may forget what it kept of them to send again after a lost
    /// connection (see the link's `replay` module).
    Received { offset: u64 },
}

/// One [`Frame::Resume`]: the link's receive state, then one entry per stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resume {
    /// Link-level bytes received, and the link-level limit granted.
    pub link_received: u64,
    pub link_max: u64,
    /// Highest stream id of the receiver's peer seen so far, per lane.
    pub seen: [u32; 2],
    pub entries: Vec<ResumeEntry>,
    /// The last frame of the list.
    pub last: bool,
    /// Only the latency lane was lost: the list covers its streams, and `link_received`
    /// counts the stream bytes received on that lane.
    pub lane: bool,
}

/// What the sender of a [`Frame::Resume`] holds of one stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResumeEntry {
    pub stream: StreamId,
    /// Bytes received (and rebuilt, for an optimized stream).
    pub received: u64,
    /// The stream's limit granted.
    pub max: u64,
    /// The stream's end arrived.
    pub fin: bool,
    /// The stream finished both ways and is gone.
    pub done: bool,
    /// The stream's frames travel on the latency lane.
    pub latency: bool,
}

/// Bytes of one [`ResumeEntry`] on the wire.
pub const RESUME_ENTRY_LEN: usize = 21;
/// Bytes of a [`Frame::Resume`] payload before its entries.
pub const RESUME_HEAD_LEN: usize = 8 + 8 + 4 + 4 + 2;

pub(super) mod kind {
    pub const HELLO: u8 = 1;
    pub const OPEN: u8 = 2;
    pub const DATA: u8 = 3;
    pub const RESET: u8 = 4;
    pub const MAX_DATA: u8 = 5;
    pub const PING: u8 = 6;
    pub const PONG: u8 = 7;
    pub const GOAWAY: u8 = 8;
    pub const CODED: u8 = 9;
    pub const NEED: u8 = 10;
    pub const CHUNK: u8 = 11;
    pub const CHECKPOINT: u8 = 12;
    pub const FINISHED: u8 = 13;
    pub const RESUME: u8 = 14;
    pub const CODED_SHORT: u8 = 15;
    pub const RECEIVED: u8 = 16;
}

pub(super) const FLAG_FIN: u8 = 1;
pub(super) const FLAG_SCOPED: u8 = 2;
/// Resume entry flags.
pub(super) const RESUME_FIN: u8 = 1;
pub(super) const RESUME_DONE: u8 = 2;
pub(super) const RESUME_LATENCY: u8 = 4;

impl Frame {
    /// Checks whether `buf` starts with a whole frame whose payload is at most `max_payload` bytes.
    /// Returns the frame's total length, `Incomplete` if more bytes are needed, or a fatal error.
    pub fn check(buf: &[u8], max_payload: u32) -> Result<usize, FrameError> {
        let Some(&kind) = buf.first() else {
            return Err(FrameError::Incomplete);
        };
        let cap = max_payload.min(MAX_PAYLOAD_HARD);
        let (header, len) = if kind == kind::CODED_SHORT {
            let (_, v) = varint(&buf[1..])?;
            let header = SHORT_CODED_FIXED + v;
            let Some(f) = buf.get(1 + v..1 + v + 3) else {
                return Err(FrameError::Incomplete);
            };
            (
                header,
                u32::from_be_bytes([0, f[0], f[1], f[2]]) & SHORT_LEN_MASK,
            )
        } else {
            if buf.len() < HEADER_LEN {
                return Err(FrameError::Incomplete);
            }
            if !(kind::HELLO..=kind::RECEIVED).contains(&kind) || kind == kind::CODED_SHORT {
                return Err(FrameError::UnknownKind(kind));
            }
            (
                HEADER_LEN,
                u32::from_be_bytes([buf[6], buf[7], buf[8], buf[9]]),
            )
        };
        if len > cap {
            return Err(FrameError::TooLarge { len, max: cap });
        }
        let total = header + len as usize;
        if buf.len() < total {
            return Err(FrameError::Incomplete);
        }
        Ok(total)
    }
}

/// A LEB128 varint of at most 5 bytes (a stream id) at the start of `buf`: its value and length.
/// `Incomplete` while it may go on; longer than 5 bytes, above `u32::MAX` or not in its
/// shortest form is malformed (so each id has one encoding).
pub(super) fn varint(buf: &[u8]) -> Result<(u32, usize), FrameError> {
    let mut v: u64 = 0;
    for (i, &b) in buf.iter().enumerate().take(5) {
        v |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            if i > 0 && b == 0 {
                return Err(FrameError::Malformed("varint not in its shortest form"));
            }
            return u32::try_from(v)
                .map(|v| (v, i + 1))
                .map_err(|_| FrameError::Malformed("stream id above 32 bits"));
        }
    }
    if buf.len() >= 5 {
        return Err(FrameError::Malformed("varint longer than 5 bytes"));
    }
    Err(FrameError::Incomplete)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oversized_length_rejected_before_buffering() {
        let mut hdr = vec![kind::DATA, 0, 0, 0, 0, 1];
        hdr.extend_from_slice(&(64u32 * 1024 * 1024).to_be_bytes());
        assert_eq!(
            Frame::check(&hdr, 65536),
            Err(FrameError::TooLarge {
                len: 64 * 1024 * 1024,
                max: 65536
            })
        );
    }

    #[test]
    fn unknown_kind_and_tls_garbage_rejected() {
        assert_eq!(
            Frame::check(b"GET / HTTP/1.1\r\n", 65536),
            Err(FrameError::UnknownKind(b'G'))
        );
        assert_eq!(
            Frame::check(&[0u8; 10], 65536),
            Err(FrameError::UnknownKind(0))
        );
    }
}
