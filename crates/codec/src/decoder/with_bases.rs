//! A delta record on the receiving side: the chunk rebuilt from the bases it names, which the
//! cache must hold, and checked against its fingerprint.

use super::Decoder;
use crate::cache::Lookup;
use crate::delta::{MAX_BASES, is_dict_magic};
use zstd::zstd_safe::DCtx;

use crate::fingerprint::fingerprint;
use crate::format::{CodecError, get_len};

impl Decoder {
    /// Decodes a delta record: the chunk itself if the cache holds it (the peer re-sent it after
    /// a miss), else rebuilt from the named bases and checked against its fingerprint. A base we
    /// lack, or a result that does not match, is a miss of the chunk (the peer re-sends it),
    /// never wrong data.
    pub(crate) fn decode_delta(
        &mut self,
        buf: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<usize, CodecError> {
        let (raw_len, h) = get_len(buf, 1)?;
        let mut at = 1 + h;
        let n = usize::from(*buf.get(at).ok_or(CodecError::Incomplete)?);
        if n == 0 || n > MAX_BASES {
            return Err(CodecError::Malformed("delta with no or too many bases"));
        }
        at += 1;
        let names = buf.get(at..at + 16 * n).ok_or(CodecError::Incomplete)?;
        let mut target = [0u8; 16];
        target.copy_from_slice(
            buf.get(at + 16 * n..at + 16 * (n + 1))
                .ok_or(CodecError::Incomplete)?,
        );
        at += 16 * (n + 1);
        let (clen, h) = get_len(buf, at)?;
        at += h;
        let payload = buf.get(at..at + clen).ok_or(CodecError::Incomplete)?;
        let used = at + clen;
        match self.cache.lookup(&target) {
            Lookup::Hit(c) if c.len() == raw_len => {
                out.extend_from_slice(c);
                self.stats.delta_chunks += 1;
                self.stats.delta_bytes += raw_len as u64;
                return Ok(used);
            }
            Lookup::Hit(_) => {
                return Err(CodecError::Malformed("delta length differs from the chunk"));
            }
            Lookup::Pending => return Err(CodecError::Pending(target)),
            Lookup::Miss => {}
        }
        let d = &mut self.delta;
        d.dict.clear();
        for name in names.chunks_exact(16) {
            let mut b = [0u8; 16];
            b.copy_from_slice(name);
            match self.cache.lookup(&b) {
                Lookup::Hit(c) => d.dict.extend_from_slice(c),
                Lookup::Miss => return Err(CodecError::Miss(target)),
                Lookup::Pending => return Err(CodecError::Pending(b)),
            }
        }
        if is_dict_magic(&d.dict) {
            return Err(CodecError::Malformed(
                "delta bases read as a zstd dictionary",
            ));
        }
        if d.dctx.is_none() {
            d.dctx = DCtx::try_create();
        }
        let dctx = d.dctx.as_mut().ok_or(CodecError::Decompress)?;
        // Bounded by the announced size, itself bounded by MAX_RECORD.
        let mut chunk = Vec::with_capacity(raw_len);
        let ok = dctx
            .decompress_using_dict(&mut chunk, payload, &d.dict)
            .is_ok();
        // Bases that differ from the sender's rebuild something else: ask for the chunk.
        if !ok || chunk.len() != raw_len || fingerprint(&chunk) != target {
            return Err(CodecError::Miss(target));
        }
        out.extend_from_slice(&chunk);
        self.stats.delta_chunks += 1;
        self.stats.delta_bytes += raw_len as u64;
        self.cache.insert(target, chunk);
        Ok(used)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CodecConfig;
    use crate::format::{TAG_DELTA, put_len};

    /// A delta record naming bases the cache does not hold is a miss of its chunk, never bytes;
    /// one naming no bases, or more than allowed, is malformed; a cut one is incomplete.
    #[test]
    fn a_delta_against_missing_bases_is_a_miss() {
        let mut dec = Decoder::new(&CodecConfig::default());
        let target = fingerprint(b"the chunk");
        let mut rec = vec![TAG_DELTA];
        put_len(&mut rec, 9);
        rec.push(1);
        rec.extend_from_slice(&fingerprint(b"a base never sent"));
        rec.extend_from_slice(&target);
        put_len(&mut rec, 3);
        rec.extend_from_slice(&[1, 2, 3]);
        let mut out = Vec::new();
        assert_eq!(
            dec.decode_delta(&rec, &mut out),
            Err(CodecError::Miss(target))
        );
        assert!(out.is_empty());
        assert_eq!(
            dec.decode_delta(&rec[..rec.len() - 1], &mut out),
            Err(CodecError::Incomplete)
        );
        let mut none = rec.clone();
        none[2] = 0;
        assert!(matches!(
            dec.decode_delta(&none, &mut out),
            Err(CodecError::Malformed(_))
        ));
        none[2] = (MAX_BASES + 1) as u8;
        assert!(matches!(
            dec.decode_delta(&none, &mut out),
            Err(CodecError::Malformed(_))
        ));
    }
}
