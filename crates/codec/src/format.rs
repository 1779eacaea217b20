//! What a record is on the wire: its tags and the flags on them, the limits a decoder checks
//! before it allocates, lengths as short varints, and what can be wrong with a record.

use bytes::BufMut;

use crate::fingerprint::Fingerprint;

/// Where records are written: a buffer that tells how much it holds, so that a record whose
/// bytes are made elsewhere (a stream context's, on a worker) can be given its place among
/// the others.
pub trait Out: BufMut {
    /// Bytes written so far.
    fn written(&self) -> usize;
}

impl Out for Vec<u8> {
    fn written(&self) -> usize {
        self.len()
    }
}

impl Out for bytes::BytesMut {
    fn written(&self) -> usize {
        self.len()
    }
}

/// Largest chunk or raw record a decoder accepts, checked before anything is allocated.
pub const MAX_RECORD: usize = 1 << 20;
/// Largest overhead of one record over the chunk bytes it carries.
pub const RECORD_OVERHEAD: usize = 7;
pub(crate) const TAG_RAW: u8 = 1;
pub(crate) const TAG_LIT: u8 = 2;
pub(crate) const TAG_REF: u8 = 3;
pub(crate) const TAG_LIT_LZ4: u8 = 4;
pub(crate) const TAG_LIT_ZSTD: u8 = 5;
/// A zstd literal compressed in its stream's context.
pub(crate) const TAG_LIT_CONTEXT: u8 = 6;
/// A chunk as a zstd delta against chunks both caches hold (see [`delta`]).
pub(crate) const TAG_DELTA: u8 = 7;
/// Flag on a literal's tag: the receiver must not cache it (the sender's stream has dedup off,
/// so its mirror will not either).
pub(crate) const NO_CACHE: u8 = 0x40;
/// Flag on a context literal's tag: the sender started a new context with it.
pub(crate) const FRESH: u8 = 0x20;
/// Flag on a fresh context literal's tag: the context has a long window (see [`LongContext`]).
pub(crate) const LONG: u8 = 0x10;
/// Flag on a context literal's tag: the payload need not rebuild the chunk yet. The context was
/// not flushed after it, so its bytes come with a later record of the same run: the next context
/// literal without the flag, or a [`TAG_RUN_END`]. A run is the consecutive records of one
/// frame, and the receiver rebuilds (and caches) its chunks in order when it ends.
pub(crate) const DEFERRED: u8 = 0x08;
/// The end of a run of deferred context literals: the rest of the context's output.
pub(crate) const TAG_RUN_END: u8 = 8;
/// Consecutive chunks sent as one zstd frame against the union of their bases (see
/// `delta`): one dictionary load and one frame for up to [`MAX_RUN_CHUNKS`]
/// chunks, each base named once.
pub(crate) const TAG_DELTA_RUN: u8 = 9;
/// Most chunks one delta run record carries (a receiver's limit; the sender's is the same).
pub const MAX_RUN_CHUNKS: usize = 32;
/// Most bases one delta run record names.
pub const MAX_RUN_BASES: usize = 64;
/// Most bytes of bases a sender puts in one delta run's dictionary.
pub const RUN_DICT: usize = 1 << 20;
/// Most bytes of bases a receiver loads for one delta run: more is malformed.
pub const RUN_DICT_DECODE: usize = 4 << 20;
/// The stream's cached chunks are logged, from here, under the serial that follows (a varint;
/// see [`logs`](crate::logs)).
pub(crate) const TAG_LOG: u8 = 10;
/// Chunks the peer holds, named by their place in a stream log: serial, index and count
/// (varints), and a 16-byte check (the fingerprint of their fingerprints).
pub(crate) const TAG_REF_RUN: u8 = 11;
/// A reference run with the first [`SHORT_CHECK`](crate::fingerprint::SHORT_CHECK) bytes of
/// its check: serial, index and count (varints) and 8 bytes.
pub(crate) const TAG_REF_RUN_SHORT: u8 = 12;
/// A delta run whose zstd frame leaves out its first four bytes, zstd's magic number
/// ([`ZSTD_MAGIC`]): the receiver puts them back. 4 bytes a run, most of what an isolated
/// edit's frame adds to it.
pub(crate) const TAG_DELTA_RUN_BARE: u8 = 13;
/// The magic number that starts every zstd frame.
pub(crate) const ZSTD_MAGIC: [u8; 4] = [0x28, 0xB5, 0x2F, 0xFD];
/// Most raw bytes a run defers before a record flushes it (the sender's limit).
pub const RUN_MAX: usize = 256 * 1024;
/// Most raw bytes a receiver lets a run defer: more is malformed.
pub const RUN_MAX_DECODE: usize = 1 << 20;

/// Record bytes to keep free for `raw` bytes that may come out of a run's context at once:
/// zstd's bound for them (raw plus 1/256, and a block header per 128 KiB) and a record header.
pub fn run_reserve(raw: usize) -> usize {
    raw + raw / 128 + 64
}

/// Compression pays when it saves its header and at least 3% of the chunk.
pub(crate) fn pays(raw: usize, compressed: usize) -> bool {
    compressed + 4 + raw / 32 < raw
}

/// Order-0 entropy (bits per byte) below which a sample is worth zstd even when LZ4 finds no
/// repeats in it: zstd's Huffman literals alone come close to it. Random digits, hex and
/// base64 (3.5, 4 and 6 bits) pass; compressed or encrypted bytes, whose 4 KiB samples measure
/// about 7.95, do not.
const SKEWED_BITS: f64 = 7.5;

/// Whether `sample`'s bytes are skewed enough for entropy coding to pay (see [`SKEWED_BITS`]).
/// InnoDB pages of sysbench rows (random digit strings, no repeats for LZ4 to find) failed the
/// LZ4 trial alone: 84 of 144 MB of a changed copy's literals went uncompressed.
pub(crate) fn skewed(sample: &[u8]) -> bool {
    if sample.is_empty() {
        return false;
    }
    let mut counts = [0u32; 256];
    for &b in sample {
        counts[usize::from(b)] += 1;
    }
    let n = sample.len() as f64;
    let bits: f64 = counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = f64::from(c) / n;
            -p * p.log2()
        })
        .sum();
    bits < SKEWED_BITS
}

/// Writes a length as a little-endian base-128 varint (at most 3 bytes for lengths up to
/// [`MAX_RECORD`]); returns its size. Records of 8 KiB chunks thus carry 3 bytes of header.
pub(crate) fn put_len(out: &mut impl BufMut, n: usize) -> usize {
    put_varint(out, n as u64)
}

/// Reads a varint length at `at`: (length, bytes used). More than 3 bytes is malformed, more
/// than [`MAX_RECORD`] too large, both before anything is allocated.
pub(crate) fn get_len(buf: &[u8], at: usize) -> Result<(usize, usize), CodecError> {
    let mut n = 0usize;
    for i in 0..3 {
        let b = *buf.get(at + i).ok_or(CodecError::Incomplete)?;
        n |= usize::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            if n > MAX_RECORD {
                return Err(CodecError::TooLarge(n));
            }
            return Ok((n, i + 1));
        }
    }
    Err(CodecError::Malformed("length longer than 3 bytes"))
}

/// Writes a number as a little-endian base-128 varint (at most 10 bytes); returns its size.
pub(crate) fn put_varint(out: &mut impl BufMut, mut n: u64) -> usize {
    let mut k = 0;
    loop {
        k += 1;
        if n < 0x80 {
            out.put_u8(n as u8);
            return k;
        }
        out.put_u8((n as u8 & 0x7f) | 0x80);
        n >>= 7;
    }
}

/// Reads a varint number at `at`: (number, bytes used). More than 10 bytes, or more than 64
/// bits, is malformed.
pub(crate) fn get_varint(buf: &[u8], at: usize) -> Result<(u64, usize), CodecError> {
    let mut n = 0u64;
    for i in 0..10 {
        let b = *buf.get(at + i).ok_or(CodecError::Incomplete)?;
        let part = u64::from(b & 0x7f);
        if i == 9 && part > 1 {
            return Err(CodecError::Malformed("varint beyond 64 bits"));
        }
        n |= part << (7 * i);
        if b & 0x80 == 0 {
            return Ok((n, i + 1));
        }
    }
    Err(CodecError::Malformed("varint longer than 10 bytes"))
}

/// A decoding failure. `Incomplete` is normal: wait for more bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    #[error("incomplete record")]
    Incomplete,
    #[error("malformed record: {0}")]
    Malformed(&'static str),
    #[error("record of {0} bytes exceeds the limit")]
    TooLarge(usize),
    #[error("chunk not in the cache (or damaged there)")]
    Miss(Fingerprint),
    /// The chunk is cached on disk and the store is reading it: decode the record again once
    /// the store has it.
    #[error("chunk being read from disk")]
    Pending(Fingerprint),
    #[error("decompression failed")]
    Decompress,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_round_trip_in_three_bytes_and_are_checked_before_use() {
        for n in [0, 1, 0x7f, 0x80, 8192, 0x3fff, 0x4000, MAX_RECORD] {
            let mut b = Vec::new();
            let k = put_len(&mut b, n);
            assert!(k <= 3 && k == b.len());
            assert_eq!(get_len(&b, 0), Ok((n, k)));
            assert_eq!(get_len(&b[..k - 1], 0), Err(CodecError::Incomplete));
        }
        let mut b = Vec::new();
        put_len(&mut b, MAX_RECORD + 1);
        assert_eq!(get_len(&b, 0), Err(CodecError::TooLarge(MAX_RECORD + 1)));
        assert_eq!(
            get_len(&[0x80, 0x80, 0x80, 1], 0),
            Err(CodecError::Malformed("length longer than 3 bytes"))
        );
        assert!(run_reserve(1 << 17) > 1 << 17);
        for n in [0, 1, 0x7f, 0x80, u64::from(u32::MAX), u64::MAX] {
            let mut b = Vec::new();
            let k = put_varint(&mut b, n);
            assert_eq!(get_varint(&b, 0), Ok((n, k)));
            assert_eq!(get_varint(&b[..k - 1], 0), Err(CodecError::Incomplete));
        }
        assert!(matches!(
            get_varint(&[0xff; 10], 0),
            Err(CodecError::Malformed(_))
        ));
        assert!(matches!(
            get_varint(
                &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02],
                0
            ),
            Err(CodecError::Malformed(_))
        ));
        assert!(pays(8192, 4000) && !pays(8192, 8000));
    }

    /// Digits, hex and text are skewed; noise and an empty sample are not.
    #[test]
    fn skewed_tells_entropy_coding_from_noise() {
        let noise = crate::testdata::noise(3, 4096);
        assert!(!skewed(&noise) && !skewed(&[]));
        let digits: Vec<u8> = noise.iter().map(|b| b'0' + b % 10).collect();
        let hex: Vec<u8> = noise
            .iter()
            .map(|b| b"0123456789abcdef"[usize::from(b % 16)])
            .collect();
        assert!(skewed(&digits) && skewed(&hex));
        assert!(skewed(b"the quick brown fox jumps over the lazy dog"));
    }
}
