//! The write path: [`Frame::encode`] appends a frame (names cut at a character boundary, lists
//! cut to their limits, so what is written always parses), and the headers the scheduler writes
//! in place around bytes it copies straight into the output buffer.

use bytes::{BufMut, BytesMut};

use super::buf::{name_len, put_name};
use super::hello::{MAX_DIGESTS, MAX_OFFERS, MAX_SCOPED, MAX_SETTINGS};
use super::layout::{
    FLAG_FIN, FLAG_SCOPED, Frame, HEADER_LEN, RESUME_DONE, RESUME_ENTRY_LEN, RESUME_FIN,
    RESUME_HEAD_LEN, RESUME_LATENCY, kind,
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
                Frame::Need { scope, .. } => 16 + 1 + name_len(scope),
                Frame::Chunk { scope, data, .. } => 16 + 1 + name_len(scope) + data.len(),
                Frame::Checkpoint { scope, .. } => 16 + 1 + name_len(scope),
                Frame::Finished { .. } => 8,
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
            Frame::Need { stream, .. } => (kind::NEED, 0, *stream),
            Frame::Chunk { stream, .. } => (kind::CHUNK, 0, *stream),
            Frame::Checkpoint { .. } => (kind::CHECKPOINT, 0, StreamId::LINK),
            Frame::Finished { stream, .. } => (kind::FINISHED, 0, *stream),
            Frame::Resume(r) => (kind::RESUME, coded_flags(r.last, r.lane), StreamId::LINK),
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
            Frame::Finished { offset, .. } => out.put_u64(*offset),
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

/// Writes the header of a coded frame with a zero payload length, returning where the length
/// sits; [`finish_coded`] fills it in once the records are appended.
pub fn begin_coded(out: &mut BytesMut, stream: StreamId, offset: u64) -> usize {
    out.put_u8(kind::CODED);
    out.put_u8(0);
    out.put_u32(stream.0);
    let at = out.len();
    out.put_u32(0);
    out.put_u64(offset);
    out.put_u32(0);
    at
}

fn coded_flags(fin: bool, scoped: bool) -> u8 {
    (if fin { FLAG_FIN } else { 0 }) | if scoped { FLAG_SCOPED } else { 0 }
}

/// Completes a coded frame begun at `at`: its flags, raw length and payload length.
pub fn finish_coded(out: &mut BytesMut, at: usize, fin: bool, scoped: bool, raw_len: u32) {
    let payload = (out.len() - at - 4) as u32;
    out[at - 5] = coded_flags(fin, scoped);
    out[at..at + 4].copy_from_slice(&payload.to_be_bytes());
    out[at + 12..at + 16].copy_from_slice(&raw_len.to_be_bytes());
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

    #[test]
    fn coded_header_matches_encode() {
        let f = Frame::Coded {
            stream: StreamId(9),
            offset: 1 << 40,
            fin: true,
            scoped: true,
            raw_len: 123_456,
            records: Bytes::from_static(b"records"),
        };
        let mut a = BytesMut::new();
        f.encode(&mut a);
        let mut b = BytesMut::new();
        let at = begin_coded(&mut b, StreamId(9), 1 << 40);
        b.extend_from_slice(b"records");
        finish_coded(&mut b, at, true, true, 123_456);
        assert_eq!(a, b);
    }
}
