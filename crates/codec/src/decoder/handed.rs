//! Chunks a frame rebuilt that are handed on as they are, not copied into the frame's output.
//! A compressed literal is decompressed into a buffer of its own, the one the cache keeps, and
//! so is each chunk of a stream's context records; one decompressed ahead (see `ahead.rs`) has
//! left the core's cache by its frame's turn, and copying it into the output there took longer
//! than decompressing it had (crates/codec/PARALLEL.md, "What is left"). A caller that writes the
//! output out in pieces (the link hands a stream's bytes on as `Bytes`, and the daemon writes
//! them to the client with vectored writes) takes them as they are:
//! [`Decoder::decode_frame_handing`].

use bytes::Bytes;

use super::Decoder;
use crate::context::StreamContext;
use crate::format::CodecError;

/// The chunks of a frame handed on as they are, each with the length the frame's output had
/// when it came: the frame's bytes are the output's with each chunk put in at its offset, in
/// order ([`segments`](Self::segments)).
#[derive(Debug, Default)]
pub struct HandedOn {
    pieces: Vec<(usize, Bytes)>,
    bytes: usize,
}

impl HandedOn {
    /// The bytes of every chunk handed.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// True if no chunk was handed.
    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    /// Chunks handed.
    pub fn len(&self) -> usize {
        self.pieces.len()
    }

    fn push(&mut self, at: usize, chunk: Bytes) {
        self.bytes += chunk.len();
        self.pieces.push((at, chunk));
    }

    /// The frame's bytes in order, as pieces pushed to `into`: `out` (what was copied into the
    /// output) cut where each chunk handed goes, the chunks between; empty pieces left out. A
    /// chunk whose offset is past `out` (only a caller mixing up outputs would have one) goes
    /// at the end.
    pub fn segments(self, out: Bytes, into: &mut Vec<Bytes>) {
        let mut from = 0;
        for (at, chunk) in self.pieces {
            let at = at.clamp(from, out.len());
            if at > from {
                into.push(out.slice(from..at));
            }
            from = at;
            into.push(chunk);
        }
        if from < out.len() {
            into.push(out.slice(from..));
        }
    }

    /// The frame's bytes in one buffer: `out` with the chunks handed put in (see
    /// [`segments`](Self::segments)). For tests and benches that compare what was rebuilt.
    pub fn assemble(&self, out: &[u8]) -> Vec<u8> {
        let mut whole = Vec::with_capacity(out.len() + self.bytes);
        let mut from = 0;
        for (at, chunk) in &self.pieces {
            let at = (*at).clamp(from, out.len());
            whole.extend_from_slice(&out[from..at]);
            whole.extend_from_slice(chunk);
            from = at;
        }
        whole.extend_from_slice(&out[from..]);
        whole
    }
}

impl Decoder {
    /// Like [`decode_frame`](Self::decode_frame), with the chunks of compressed literals and
    /// of context records (decompressed ahead, see [`Feeding`](super::Feeding), or here) handed
    /// on as they are, to `handed`, instead of copied into `out`: the frame's bytes are `out`'s
    /// with them put in (see [`HandedOn`]). What the frame rebuilds is bounded by `announced` all
    /// the same, handed or copied.
    pub fn decode_frame_handing(
        &mut self,
        records: &[u8],
        out: &mut Vec<u8>,
        handed: &mut HandedOn,
        stream: &mut StreamContext,
        announced: usize,
    ) -> (usize, Option<CodecError>) {
        self.handing = Some(std::mem::take(handed));
        let r = self.decode_frame(records, out, stream, announced);
        *handed = self.handing.take().unwrap_or_default();
        r
    }

    /// Bytes handed so far while decoding with [`decode_frame_handing`]
    /// (Self::decode_frame_handing); 0 otherwise.
    pub(super) fn handed_bytes(&self) -> usize {
        self.handing.as_ref().map_or(0, HandedOn::bytes)
    }

    /// Hands `chunk` on at `at`, the output's length, if the decoder hands chunks on; false
    /// (and nothing done) if it does not.
    pub(super) fn hand(&mut self, at: usize, chunk: &Bytes) -> bool {
        match self.handing.as_mut() {
            Some(h) => {
                h.push(at, chunk.clone());
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pieces are the output cut around the chunks, in order, with nothing empty; the
    /// assembled bytes are the same; an offset past the output (a caller's mix-up) goes last.
    #[test]
    fn segments_put_each_chunk_at_its_offset() {
        let out = Bytes::from_static(b"abcdef");
        let mut h = HandedOn::default();
        h.push(0, Bytes::from_static(b"1"));
        h.push(2, Bytes::from_static(b"22"));
        h.push(2, Bytes::from_static(b"3"));
        h.push(6, Bytes::from_static(b"4"));
        h.push(99, Bytes::from_static(b"5"));
        assert_eq!((h.bytes(), h.len()), (6, 5));
        let whole = h.assemble(&out);
        let mut pieces = Vec::new();
        h.segments(out, &mut pieces);
        let pieces: Vec<&[u8]> = pieces.iter().map(|b| &b[..]).collect();
        assert_eq!(pieces, [&b"1"[..], b"ab", b"22", b"3", b"cdef", b"4", b"5"]);
        assert_eq!(whole, b"1ab223cdef45");
    }
}
