//! Reading and writing a payload's fields: every read checks that the field is there before it
//! takes it (a truncated payload is `Malformed`, never a panic), and names are written cut to
//! [`MAX_NAME_LEN`] bytes at a character boundary.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::layout::MAX_NAME_LEN;
use crate::codes::StreamId;
use crate::error::FrameError;

/// Checked reads of a payload's fields, big-endian.
pub(super) trait Get {
    /// The next `N` bytes, or `Malformed(what)` when fewer are left.
    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], FrameError>;
    /// A name: a length byte, then that many bytes of UTF-8.
    fn name(&mut self) -> Result<String, FrameError>;

    fn u8(&mut self) -> Result<u8, FrameError> {
        Ok(self.array::<1>("truncated field")?[0])
    }
    fn u16(&mut self) -> Result<u16, FrameError> {
        Ok(u16::from_be_bytes(self.array("truncated field")?))
    }
    fn u32(&mut self) -> Result<u32, FrameError> {
        Ok(u32::from_be_bytes(self.array("truncated field")?))
    }
    fn u64(&mut self) -> Result<u64, FrameError> {
        Ok(u64::from_be_bytes(self.array("truncated field")?))
    }
    fn fingerprint(&mut self) -> Result<[u8; 16], FrameError> {
        self.array("truncated fingerprint")
    }
}

impl Get for Bytes {
    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], FrameError> {
        if self.remaining() < N {
            return Err(FrameError::Malformed(what));
        }
        let mut a = [0u8; N];
        self.copy_to_slice(&mut a);
        Ok(a)
    }

    fn name(&mut self) -> Result<String, FrameError> {
        let n = usize::from(self.u8()?);
        if self.remaining() < n {
            return Err(FrameError::Malformed("truncated name"));
        }
        let raw = self.split_to(n);
        String::from_utf8(raw.to_vec()).map_err(|_| FrameError::Malformed("name is not utf-8"))
    }
}

/// Encoded length of a name: at most [`MAX_NAME_LEN`] bytes, cut at a character boundary.
pub(super) fn name_len(s: &str) -> usize {
    let mut end = s.len().min(MAX_NAME_LEN);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    end
}

/// Writes a name as [`Get::name`] reads it, cut to [`name_len`].
pub(super) fn put_name(out: &mut BytesMut, s: &str) {
    let end = name_len(s);
    out.put_u8(end as u8);
    out.extend_from_slice(&s.as_bytes()[..end]);
}

/// A stream frame must name a stream, not the link.
pub(super) fn nonzero(stream: StreamId) -> Result<(), FrameError> {
    if stream == StreamId::LINK {
        Err(FrameError::Malformed("stream id 0 on a stream frame"))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_read_big_endian_and_a_short_one_is_malformed() {
        let mut b = Bytes::from_static(&[1, 0, 2, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 4, 9]);
        assert_eq!(b.u8(), Ok(1));
        assert_eq!(b.u16(), Ok(2));
        assert_eq!(b.u32(), Ok(3));
        assert_eq!(b.u64(), Ok(4));
        assert_eq!(b.u16(), Err(FrameError::Malformed("truncated field")));
        assert_eq!(b.remaining(), 1, "a failed read takes nothing");
        assert_eq!(
            b.fingerprint(),
            Err(FrameError::Malformed("truncated fingerprint"))
        );
    }

    #[test]
    fn names_round_trip_cut_at_a_character_boundary() {
        let mut out = BytesMut::new();
        put_name(&mut out, "dg");
        put_name(&mut out, &"é".repeat(200));
        let mut b = out.freeze();
        assert_eq!(b.name().as_deref(), Ok("dg"));
        assert_eq!(b.name().map(|n| n.len()), Ok(254));
        assert!(b.is_empty());
        assert_eq!(
            Bytes::from_static(&[3, b'a']).name(),
            Err(FrameError::Malformed("truncated name"))
        );
        assert_eq!(
            Bytes::from_static(&[1, 0xff]).name(),
            Err(FrameError::Malformed("name is not utf-8"))
        );
        assert!(nonzero(StreamId::LINK).is_err() && nonzero(StreamId(1)).is_ok());
    }
}
