//! The read path's second half: [`Frame::parse`] decodes one whole frame, as delimited by
//! [`Frame::check`], field by checked field; data payloads share the frame's memory, and every
//! count is capped before anything is allocated for it.

use bytes::{Buf, Bytes};

use super::buf::{Get, nonzero};
use super::hello::{CacheOffer, Hello, MAX_DIGESTS, MAX_OFFERS, MAX_SCOPED, MAX_SETTINGS};
use super::layout::{
    FLAG_FIN, FLAG_SCOPED, Frame, HEADER_LEN, RESUME_DONE, RESUME_ENTRY_LEN, RESUME_FIN,
    RESUME_LATENCY, Resume, ResumeEntry, SHORT_FIN, SHORT_LEN_MASK, SHORT_SCOPED, kind, varint,
};
use crate::codes::{Class, CloseCode, ResetCode, StreamId};
use crate::error::FrameError;

impl Frame {
    /// Parses one whole frame, as delimited by [`Frame::check`]. Data payloads share `frame`'s memory.
    pub fn parse(mut frame: Bytes) -> Result<Frame, FrameError> {
        if frame.first() == Some(&kind::CODED_SHORT) {
            return parse_short(frame);
        }
        if frame.len() < HEADER_LEN {
            return Err(FrameError::Malformed("short header"));
        }
        let kind = frame.get_u8();
        let flags = frame.get_u8();
        let stream = StreamId(frame.get_u32());
        let len = frame.get_u32() as usize;
        if frame.len() != len {
            return Err(FrameError::Malformed("length mismatch"));
        }
        let mut p = frame;
        let f = match kind {
            kind::HELLO => Frame::Hello(parse_hello(&mut p)?),
            kind::OPEN => {
                nonzero(stream)?;
                let class = class(p.u8()?)?;
                let service = p.name()?;
                Frame::Open {
                    stream,
                    class,
                    service,
                }
            }
            kind::DATA => {
                nonzero(stream)?;
                let offset = p.u64()?;
                let data = p.split_off(0);
                if offset.checked_add(data.len() as u64).is_none() {
                    return Err(FrameError::Malformed("offset overflow"));
                }
                Frame::Data {
                    stream,
                    offset,
                    fin: flags & FLAG_FIN != 0,
                    data,
                }
            }
            kind::RESET => {
                nonzero(stream)?;
                let code = ResetCode::from_u16(p.u16()?);
                let reason = p.name()?;
                Frame::Reset {
                    stream,
                    code,
                    reason,
                }
            }
            kind::MAX_DATA => Frame::MaxData {
                stream,
                max: p.u64()?,
            },
            kind::PING => Frame::Ping { payload: p.u64()? },
            kind::PONG => Frame::Pong { payload: p.u64()? },
            kind::GOAWAY => {
                let code = CloseCode::from_u16(p.u16()?);
                let reason = p.name()?;
                Frame::GoAway { code, reason }
            }
            kind::CODED => {
                nonzero(stream)?;
                let offset = p.u64()?;
                let raw_len = p.u32()?;
                if offset.checked_add(u64::from(raw_len)).is_none() {
                    return Err(FrameError::Malformed("offset overflow"));
                }
                Frame::Coded {
                    stream,
                    offset,
                    fin: flags & FLAG_FIN != 0,
                    scoped: flags & FLAG_SCOPED != 0,
                    raw_len,
                    records: p.split_off(0),
                }
            }
            kind::NEED => {
                nonzero(stream)?;
                let fingerprint = p.fingerprint()?;
                let scope = p.name()?;
                Frame::Need {
                    stream,
                    scope,
                    fingerprint,
                }
            }
            kind::CHUNK => {
                nonzero(stream)?;
                let fingerprint = p.fingerprint()?;
                let scope = p.name()?;
                Frame::Chunk {
                    stream,
                    scope,
                    fingerprint,
                    data: p.split_off(0),
                }
            }
            kind::CHECKPOINT => {
                let digest = p.fingerprint()?;
                let scope = p.name()?;
                Frame::Checkpoint { scope, digest }
            }
            kind::FINISHED => {
                nonzero(stream)?;
                Frame::Finished {
                    stream,
                    offset: p.u64()?,
                }
            }
            kind::RESUME => Frame::Resume(Box::new(parse_resume(&mut p, flags)?)),
            kind::RECEIVED => {
                if stream != StreamId::LINK {
                    return Err(FrameError::Malformed("received on a stream"));
                }
                Frame::Received { offset: p.u64()? }
            }
            other => return Err(FrameError::UnknownKind(other)),
        };
        if p.has_remaining() {
            return Err(FrameError::Malformed("trailing bytes"));
        }
        Ok(f)
    }
}

/// A short coded frame, as delimited by [`Frame::check`]: its header (see
/// [`Frame::CodedShort`]), then its records to the end.
fn parse_short(mut frame: Bytes) -> Result<Frame, FrameError> {
    frame.advance(1);
    let (id, v) = match varint(&frame) {
        Ok(x) => x,
        Err(FrameError::Incomplete) => return Err(FrameError::Malformed("short header")),
        Err(e) => return Err(e),
    };
    frame.advance(v);
    let stream = StreamId(id);
    nonzero(stream)?;
    let [a, b, c] = frame.array("short header")?;
    let len = u32::from_be_bytes([0, a, b, c]);
    if len & !(SHORT_LEN_MASK | SHORT_FIN | SHORT_SCOPED) != 0 {
        return Err(FrameError::Malformed("unknown short frame flag"));
    }
    let [d, e, f] = frame.array("short header")?;
    let at = frame.u16()?;
    if frame.len() != (len & SHORT_LEN_MASK) as usize {
        return Err(FrameError::Malformed("length mismatch"));
    }
    Ok(Frame::CodedShort {
        stream,
        at,
        fin: len & SHORT_FIN != 0,
        scoped: len & SHORT_SCOPED != 0,
        raw_len: u32::from_be_bytes([0, d, e, f]),
        records: frame,
    })
}

fn class(v: u8) -> Result<Class, FrameError> {
    match v {
        0 => Ok(Class::Latency),
        1 => Ok(Class::Bulk),
        _ => Err(FrameError::Malformed("unknown service class")),
    }
}

/// A hello's payload; the scoped list is optional on the wire (older hellos end after their
/// offers).
fn parse_hello(p: &mut Bytes) -> Result<Hello, FrameError> {
    let version = p.u16()?;
    let min_version = p.u16()?;
    let site = p.name()?;
    let capabilities = p.u64()?;
    let n = p.u16()? as usize;
    if n > MAX_SETTINGS {
        return Err(FrameError::Malformed("too many settings"));
    }
    let mut settings = Vec::with_capacity(n);
    for _ in 0..n {
        settings.push((p.u16()?, p.u64()?));
    }
    let n = p.u16()? as usize;
    if n > MAX_OFFERS {
        return Err(FrameError::Malformed("too many cache offers"));
    }
    let mut caches = Vec::with_capacity(n);
    for _ in 0..n {
        let decoder = p.u8()? != 0;
        let lane = p.u8()?;
        let scope = p.name()?;
        let k = p.u8()? as usize;
        if k > MAX_DIGESTS {
            return Err(FrameError::Malformed("too many cache digests"));
        }
        let mut digests = Vec::with_capacity(k);
        for _ in 0..k {
            digests.push(p.fingerprint()?);
        }
        caches.push(CacheOffer {
            decoder,
            lane,
            scope,
            digests,
        });
    }
    let mut scoped = Vec::new();
    if p.has_remaining() {
        let n = p.u16()? as usize;
        if n > MAX_SCOPED {
            return Err(FrameError::Malformed("too many scoped services"));
        }
        scoped.reserve(n);
        for _ in 0..n {
            scoped.push(p.name()?);
        }
    }
    Ok(Hello {
        version,
        min_version,
        site,
        capabilities,
        settings,
        caches,
        scoped,
    })
}

/// A resume list's payload: the link's receive state and one entry per stream, whose count is
/// checked against the bytes there before anything is allocated.
fn parse_resume(p: &mut Bytes, flags: u8) -> Result<Resume, FrameError> {
    let link_received = p.u64()?;
    let link_max = p.u64()?;
    let seen = [p.u32()?, p.u32()?];
    let n = p.u16()? as usize;
    // Checked against what is there before anything is allocated.
    if p.remaining() != n * RESUME_ENTRY_LEN {
        return Err(FrameError::Malformed("resume entries do not fit the frame"));
    }
    let mut entries = Vec::with_capacity(n);
    for _ in 0..n {
        let stream = StreamId(p.u32()?);
        let received = p.u64()?;
        let max = p.u64()?;
        let f = p.u8()?;
        if stream == StreamId::LINK || f & !(RESUME_FIN | RESUME_DONE | RESUME_LATENCY) != 0 {
            return Err(FrameError::Malformed("bad resume entry"));
        }
        entries.push(ResumeEntry {
            stream,
            received,
            max,
            fin: f & RESUME_FIN != 0,
            done: f & RESUME_DONE != 0,
            latency: f & RESUME_LATENCY != 0,
        });
    }
    Ok(Resume {
        link_received,
        link_max,
        seen,
        entries,
        last: flags & FLAG_FIN != 0,
        lane: flags & FLAG_SCOPED != 0,
    })
}

#[cfg(test)]
mod tests {
    use bytes::{BufMut, BytesMut};

    use super::*;

    /// A frame of `kind` on `stream` with `payload`, header written by hand.
    fn raw(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Bytes {
        let mut b = BytesMut::new();
        b.put_u8(kind);
        b.put_u8(flags);
        b.put_u32(stream);
        b.put_u32(payload.len() as u32);
        b.extend_from_slice(payload);
        b.freeze()
    }

    #[test]
    fn stream_frames_on_the_link_and_unknown_classes_are_malformed() {
        assert_eq!(
            Frame::parse(raw(kind::OPEN, 0, 0, &[1, 0])),
            Err(FrameError::Malformed("stream id 0 on a stream frame"))
        );
        assert_eq!(
            Frame::parse(raw(kind::OPEN, 0, 3, &[9, 0])),
            Err(FrameError::Malformed("unknown service class"))
        );
        assert_eq!(
            Frame::parse(raw(kind::PING, 0, 0, &[0; 9])),
            Err(FrameError::Malformed("trailing bytes"))
        );
    }

    /// A resume list announcing more entries than its bytes hold is refused before anything is
    /// allocated for them.
    #[test]
    fn a_resume_list_must_fit_its_frame() {
        let mut p = BytesMut::new();
        p.put_u64(0);
        p.put_u64(0);
        p.put_u32(0);
        p.put_u32(0);
        p.put_u16(u16::MAX);
        assert_eq!(
            Frame::parse(raw(kind::RESUME, 0, 0, &p)),
            Err(FrameError::Malformed("resume entries do not fit the frame"))
        );
        let f = Frame::parse(raw(kind::RESUME, FLAG_FIN, 0, &p[..p.len() - 2]));
        assert!(f.is_err(), "a truncated head");
    }
}
