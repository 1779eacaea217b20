//! The write path: [`Frame::encode`] appends a frame (names cut at a character boundary, lists
//! cut to their limits, so what is written always parses), and the headers the scheduler writes
//! in place around bytes it copies straight into the output buffer.

use bytes::{BufMut, BytesMut};

use super::buf::{name_len, put_name};
use super::hello::{MAX_DIGESTS, MAX_OFFERS, MAX_SCOPED, MAX_SETTINGS};
use super::layout::{
    CODED_OVERHEAD, FLAG_FIN, FLAG_SCOPED, Frame, HEADER_LEN, RESUME_DONE, RESUME_ENTRY_LEN,
    RESUME_FIN, RESUME_HEAD_LEN, RESUME_LATENCY, SHORT_FIN, SHORT_LEN_MASK, SHORT_RAW_MAX,
    SHORT_SCOPED, kind, short_coded_overhead,
};
use crate::codes::StreamId;

impl Frame {
    /// Encoded length of this frame, header included.
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN
            + match self {
                Frame::Hello(h) => {
                    2 + 2
                        + 1
                        + name_len(&h.site)
                        + 8
                        + 2
                        + h.settings.len().min(MAX_SETTINGS) * 10
                        + 2
                        + h.caches
                            .iter()
                            .take(MAX_OFFERS)
                            .map(|c| {
                                3 + name_len(&c.scope) + 1 + 16 * c.digests.len().min(MAX_DIGESTS)
                            })
                            .sum::<usize>()
                        + if h.scoped.is_empty() {
                            0
                        } else {
                            2 + h
                                .scoped
                                .iter()
                                .take(MAX_SCOPED)
                                .map(|s| 1 + name_len(s))
                                .sum::<usize>()
                        }
                }
                Frame::Open { service, .. } => 1 + 1 + name_len(service),
                Frame::Data { data, .. } => 8 + data.len(),
                Frame::Reset { reason, .. } => 2 + 1 + name_len(reason),
                Frame::MaxData { .. } | Frame::Ping { .. } | Frame::Pong { .. } => 8,
                Frame::GoAway { reason, .. } => 2 + 1 + name_len(reason),
                Frame::Coded { records, .. } => 8 + 4 + records.len(),
                // A header of its own.
                Frame::CodedShort {
                    stream, records, ..
                } => {
                    return short_coded_overhead(*stream)
                        + records.len().min(SHORT_LEN_MASK as usize);
                }
                Frame::Need { scope, .. } => 16 + 1 + name_len(scope),
                Frame::Chunk { scope, data, .. } => 16 + 1 + name_len(scope) + data.len(),
                Frame::Checkpoint { scope, .. } => 16 + 1 + name_len(scope),
                Frame::Finished { .. } | Frame::Received { .. } => 8,
                Frame::Resume(r) => {
                    RESUME_HEAD_LEN + r.entries.len().min(usize::from(u16::MAX)) * RESUME_ENTRY_LEN
                }
            }
    }

    /// Appends this frame to `out`. Names and reasons longer than [`MAX_NAME_LEN`] are truncated at a
    /// character boundary; everything else is encoded as is.
    pub fn encode(&self, out: &mut BytesMut) {
        out.reserve(self.encoded_len());
        let (kind, flags, stream) = match self {
            Frame::Hello(_) => (kind::HELLO, 0, StreamId::LINK),
            Frame::Open { stream, .. } => (kind::OPEN, 0, *stream),
            Frame::Data { stream, fin, .. } => {
                (kind::DATA, if *fin { FLAG_FIN } else { 0 }, *stream)
            }
            Frame::Reset { stream, .. } => (kind::RESET, 0, *stream),
            Frame::MaxData { stream, .. } => (kind::MAX_DATA, 0, *stream),
            Frame::Ping { .. } => (kind::PING, 0, StreamId::LINK),
            Frame::Pong { .. } => (kind::PONG, 0, StreamId::LINK),
            Frame::GoAway { .. } => (kind::GOAWAY, 0, StreamId::LINK),
            Frame::Coded {
                stream,
                fin,
                scoped,
                ..
            } => (kind::CODED, coded_flags(*fin, *scoped), *stream),
            Frame::CodedShort {
                stream,
                at,
                fin,
                scoped,
                raw_len,
                records,
            } => {
                // A header of its own; cut to what the fields hold, so what is written parses.
                let records = &records[..records.len().min(SHORT_LEN_MASK as usize)];
                put_short_header(out, *stream, (*fin, *scoped), records.len(), *raw_len, *at);
                out.extend_from_slice(records);
                return;
            }
            Frame::Need { stream, .. } => (kind::NEED, 0, *stream),
            Frame::Chunk { stream, .. } => (kind::CHUNK, 0, *stream),
            Frame::Checkpoint { .. } => (kind::CHECKPOINT, 0, StreamId::LINK),
            Frame::Finished { stream, .. } => (kind::FINISHED, 0, *stream),
            Frame::Resume(r) => (kind::RESUME, coded_flags(r.last, r.lane), StreamId::LINK),
            Frame::Received { .. } => (kind::RECEIVED, 0, StreamId::LINK),
        };
        out.put_u8(kind);
        out.put_u8(flags);
        out.put_u32(stream.0);
        let len_at = out.len();
        out.put_u32(0);
        let start = out.len();
        match self {
            Frame::Hello(h) => {
                out.put_u16(h.version);
                out.put_u16(h.min_version);
                put_name(out, &h.site);
                out.put_u64(h.capabilities);
                let n = h.settings.len().min(MAX_SETTINGS);
                out.put_u16(n as u16);
                for (id, v) in &h.settings[..n] {
                    out.put_u16(*id);
                    out.put_u64(*v);
                }
                let n = h.caches.len().min(MAX_OFFERS);
                out.put_u16(n as u16);
                for c in &h.caches[..n] {
                    out.put_u8(u8::from(c.decoder));
                    out.put_u8(c.lane);
                    put_name(out, &c.scope);
                    let k = c.digests.len().min(MAX_DIGESTS);
                    out.put_u8(k as u8);
                    for d in &c.digests[..k] {
                        out.extend_from_slice(d);
                    }
                }
                if !h.scoped.is_empty() {
                    let n = h.scoped.len().min(MAX_SCOPED);
                    out.put_u16(n as u16);
                    for s in &h.scoped[..n] {
                        put_name(out, s);
                    }
                }
            }
            Frame::Open { class, service, .. } => {
                out.put_u8(class.to_u8());
                put_name(out, service);
            }
            Frame::Data { offset, data, .. } => {
                out.put_u64(*offset);
                out.extend_from_slice(data);
            }
            Frame::Reset { code, reason, .. } => {
                out.put_u16(code.to_u16());
                put_name(out, reason);
            }
            Frame::MaxData { max, .. } => out.put_u64(*max),
            Frame::Ping { payload } | Frame::Pong { payload } => out.put_u64(*payload),
            Frame::GoAway { code, reason } => {
                out.put_u16(code.to_u16());
                put_name(out, reason);
            }
            Frame::Coded {
                offset,
                raw_len,
                records,
                ..
            } => {
                out.put_u64(*offset);
                out.put_u32(*raw_len);
                out.extend_from_slice(records);
            }
            // Written whole above.
            Frame::CodedShort { .. } => {}
            Frame::Need {
                scope, fingerprint, ..
            } => {
                out.extend_from_slice(fingerprint);
                put_name(out, scope);
            }
            Frame::Chunk {
                scope,
                fingerprint,
                data,
                ..
            } => {
                out.extend_from_slice(fingerprint);
                put_name(out, scope);
                out.extend_from_slice(data);
            }
            Frame::Checkpoint { scope, digest } => {
                out.extend_from_slice(digest);
                put_name(out, scope);
            }
            Frame::Finished { offset, .. } | Frame::Received { offset } => out.put_u64(*offset),
            Frame::Resume(r) => {
                out.put_u64(r.link_received);
                out.put_u64(r.link_max);
                out.put_u32(r.seen[0]);
                out.put_u32(r.seen[1]);
                let n = r.entries.len().min(usize::from(u16::MAX));
                out.put_u16(n as u16);
                for e in &r.entries[..n] {
                    out.put_u32(e.stream.0);
                    out.put_u64(e.received);
                    out.put_u64(e.max);
                    out.put_u8(
                        if e.fin { RESUME_FIN } else { 0 }
                            | if e.done { RESUME_DONE } else { 0 }
                            | if e.latency { RESUME_LATENCY } else { 0 },
                    );
                }
            }
        }
        let len = (out.len() - start) as u32;
        out[len_at..len_at + 4].copy_from_slice(&len.to_be_bytes());
    }
}

/// Writes the header and offset of a data frame whose `len` payload bytes the caller appends next.
/// Lets the scheduler copy stream bytes straight into the output buffer.
pub fn encode_data_header(
    out: &mut BytesMut,
    stream: StreamId,
    offset: u64,
    fin: bool,
    len: usize,
) {
    out.put_u8(kind::DATA);
    out.put_u8(if fin { FLAG_FIN } else { 0 });
    out.put_u32(stream.0);
    out.put_u32((8 + len) as u32);
    out.put_u64(offset);
}

/// Where a coded frame begun by [`begin_coded`] sits in the output, for [`finish_coded`].
#[derive(Debug, Clone, Copy)]
pub struct CodedStart {
    /// Where the frame starts, and where its records start.
    frame: usize,
    records: usize,
    stream: StreamId,
    offset: u64,
    short: bool,
}

/// Writes the header of a coded frame at `offset` of `stream` (a short one if `short`: the peer
/// reads them) with its lengths still zero; [`finish_coded`] fills them in once the records
/// are appended.
pub fn begin_coded(out: &mut BytesMut, stream: StreamId, offset: u64, short: bool) -> CodedStart {
    let frame = out.len();
    if short {
        put_short_header(out, stream, (false, false), 0, 0, 0);
    } else {
        out.put_u8(kind::CODED);
        out.put_u8(0);
        out.put_u32(stream.0);
        out.put_u32(0);
        out.put_u64(offset);
        out.put_u32(0);
    }
    CodedStart {
        frame,
        records: out.len(),
        stream,
        offset,
        short,
    }
}

fn coded_flags(fin: bool, scoped: bool) -> u8 {
    (if fin { FLAG_FIN } else { 0 }) | if scoped { FLAG_SCOPED } else { 0 }
}

/// A short coded frame's header: kind, stream id (varint), flags and record length (24 bits),
/// raw length (24 bits, cut to [`SHORT_RAW_MAX`]), the offset's low 16 bits.
fn put_short_header(
    out: &mut BytesMut,
    stream: StreamId,
    (fin, scoped): (bool, bool),
    len: usize,
    raw_len: u32,
    at: u16,
) {
    out.put_u8(kind::CODED_SHORT);
    let mut v = stream.0;
    while v >= 0x80 {
        out.put_u8((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.put_u8(v as u8);
    let flags = if fin { SHORT_FIN } else { 0 } | if scoped { SHORT_SCOPED } else { 0 };
    let len = (len as u32).min(SHORT_LEN_MASK) | flags;
    out.extend_from_slice(&len.to_be_bytes()[1..]);
    out.extend_from_slice(&raw_len.min(SHORT_RAW_MAX).to_be_bytes()[1..]);
    out.put_u16(at);
}

/// Completes a coded frame begun at `start`: its flags, raw length and payload length. A short
/// frame whose raw length does not fit its 24 bits becomes a whole one (its records move).
pub fn finish_coded(out: &mut BytesMut, start: CodedStart, fin: bool, scoped: bool, raw_len: u32) {
    let records = out.len() - start.records;
    if start.short && raw_len <= SHORT_RAW_MAX && records <= SHORT_LEN_MASK as usize {
        let mut head = BytesMut::with_capacity(start.records - start.frame);
        let at = start.offset as u16;
        put_short_header(&mut head, start.stream, (fin, scoped), records, raw_len, at);
        out[start.frame..start.records].copy_from_slice(&head);
        return;
    }
    let mut head = BytesMut::with_capacity(CODED_OVERHEAD);
    head.put_u8(kind::CODED);
    head.put_u8(coded_flags(fin, scoped));
    head.put_u32(start.stream.0);
    head.put_u32((records + 12) as u32);
    head.put_u64(start.offset);
    head.put_u32(raw_len);
    if start.records - start.frame != head.len() {
        // The short header was begun: the records move to make room for the whole one.
        let had = start.records - start.frame;
        out.resize(out.len() + head.len() - had, 0);
        out.copy_within(
            start.records..start.records + records,
            start.frame + head.len(),
        );
    }
    out[start.frame..start.frame + head.len()].copy_from_slice(&head);
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    #[test]
    fn data_header_matches_encode() {
        let f = Frame::Data {
            stream: StreamId(7),
            offset: 99,
            fin: true,
            data: Bytes::from_static(b"hello"),
        };
        let mut a = BytesMut::new();
        f.encode(&mut a);
        let mut b = BytesMut::new();
        encode_data_header(&mut b, StreamId(7), 99, true, 5);
        b.extend_from_slice(b"hello");
        assert_eq!(a, b);
    }

    /// A frame begun and finished in place is what `encode` writes of it, short or whole.
    #[test]
    fn coded_header_matches_encode() {
        let whole = Frame::Coded {
            stream: StreamId(9),
            offset: 1 << 40,
            fin: true,
            scoped: true,
            raw_len: 123_456,
            records: Bytes::from_static(b"records"),
        };
        let short = Frame::CodedShort {
            stream: StreamId(300),
            at: (1u64 << 40 | 0xbeef) as u16,
            fin: false,
            scoped: true,
            raw_len: 123_456,
            records: Bytes::from_static(b"records"),
        };
        for (f, id, offset, is_short, fin) in [
            (whole, 9, 1 << 40, false, true),
            (short, 300, 1 << 40 | 0xbeef, true, false),
        ] {
            let mut a = BytesMut::new();
            f.encode(&mut a);
            assert_eq!(a.len(), f.encoded_len());
            let mut b = BytesMut::from(&b"before"[..]);
            let at = begin_coded(&mut b, StreamId(id), offset, is_short);
            b.extend_from_slice(b"records");
            finish_coded(&mut b, at, fin, true, 123_456);
            assert_eq!(&b[6..], &a[..]);
            assert_eq!(Frame::parse(a.freeze()), Ok(f));
        }
    }

    /// A short frame begun for a turn whose raw length does not fit 24 bits is written whole,
    /// its records moved after the longer header.
    #[test]
    fn a_raw_length_beyond_24_bits_makes_a_whole_frame() {
        let mut b = BytesMut::from(&b"xy"[..]);
        let at = begin_coded(&mut b, StreamId(5), 77, true);
        b.extend_from_slice(b"some records");
        finish_coded(&mut b, at, true, false, SHORT_RAW_MAX + 1);
        let f = Frame::Coded {
            stream: StreamId(5),
            offset: 77,
            fin: true,
            scoped: false,
            raw_len: SHORT_RAW_MAX + 1,
            records: Bytes::from_static(b"some records"),
        };
        let mut want = BytesMut::from(&b"xy"[..]);
        f.encode(&mut want);
        assert_eq!(b, want);
    }
}
