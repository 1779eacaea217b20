//! A delta record on the receiving side: the chunk rebuilt from the bases it names, which the
//! cache must hold, and checked against its fingerprint.

use std::collections::VecDeque;

use super::Decoder;
use crate::cache::Lookup;
use crate::context::{Piece, RunFed, StreamContext};
use crate::delta::{MAX_BASES, RecvScratch, is_dict_magic};
use crate::logs::Logs;
use zstd::zstd_safe::DCtx;

use crate::fingerprint::{Fingerprint, fingerprint, run_check};
use crate::format::{
    CodecError, MAX_RUN_BASES, MAX_RUN_CHUNKS, RUN_DICT_DECODE, RUN_MAX_DECODE, TAG_DELTA_RUN_BARE,
    ZSTD_MAGIC, get_len, get_varint,
};

impl Decoder {
    /// Decodes a delta record: the chunk itself if the cache holds it (the peer re-sent it after
    /// a miss), else rebuilt from the named bases and checked against its fingerprint. A base we
    /// lack, or a result that does not match, is a miss of the chunk (the peer re-sends it),
    /// never wrong data.
    pub(crate) fn decode_delta(
        &mut self,
        buf: &[u8],
        out: &mut Vec<u8>,
        log: Option<u32>,
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
                self.log_chunk(log, target);
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
            match self.cache.lookup_base(&b) {
                Lookup::Hit(c) => d.dict.extend_from_slice(c),
                Lookup::Miss => return Err(CodecError::Miss(target)),
                Lookup::Pending => return Err(CodecError::Pending(b)),
            }
        }
        // Bases that differ from the sender's rebuild something else: ask for the chunk.
        let chunk = rebuild(d, payload, raw_len, false)?
            .filter(|c| fingerprint(c) == target)
            .ok_or(CodecError::Miss(target))?;
        out.extend_from_slice(&chunk);
        self.stats.delta_chunks += 1;
        self.stats.delta_bytes += raw_len as u64;
        self.cache.insert(target, chunk);
        self.log_chunk(log, target);
        Ok(used)
    }
}

impl Decoder {
    /// Decodes a delta run record: its chunks rebuilt from one zstd frame against the bases it
    /// names, checked all at once against the record's check (the fingerprint of their
    /// fingerprints), then added to the cache in order. Counts, lengths and the dictionary's
    /// bytes are checked against the limits before anything is allocated; the chunks may
    /// rebuild at most `room` bytes. A base we lack is a miss of that base (the peer re-sends
    /// it); chunks that do not match their check are an error, never wrong data. A run rebuilt
    /// ahead on a worker ([`RunFed`], from the same check) is taken instead of rebuilding it
    /// here; its bases are still looked up here, in order, as they would be otherwise.
    pub(super) fn decode_delta_run(
        &mut self,
        buf: &[u8],
        out: &mut Vec<u8>,
        room: usize,
        stream: &mut StreamContext,
        (place, settle): (Option<usize>, &mut dyn FnMut()),
    ) -> Result<usize, CodecError> {
        let RunHead {
            n,
            nb,
            mut names,
            placed,
            unresolved,
            lens,
            total,
            check,
            payload,
        } = run_head(buf, Some(&self.logs))?;
        if total > room {
            return Err(CodecError::Malformed(
                "record rebuilds more than its frame announced",
            ));
        }
        let used = payload.end;
        let payload = &buf[payload];
        // Places our log does not hold: the names the peer re-sent for the run, or ask.
        let mut re_sent = false;
        if placed && let Some(r) = self.resolved.get(&check).filter(|r| r.len() == nb) {
            names[..nb].copy_from_slice(r);
            re_sent = true;
        } else if unresolved {
            return Err(self.ask(check, false));
        }
        // Taken once every base is found: a miss leaves it for the record's next try.
        let fed_at = fed_position(&stream.runs_fed, &check, &lens[..n]);
        let fed = fed_at.and_then(|i| stream.runs_fed.get(i));
        let d = &mut self.delta;
        d.dict.clear();
        let mut dict = 0usize;
        for b in &names[..nb] {
            // A base the worker checked, still the very bytes the cache holds, needs no check.
            let checked = fed.as_ref().is_some_and(|f| {
                let held = self.cache.in_memory_bytes(b);
                f.checked
                    .iter()
                    .any(|(name, h)| name == b && held.is_some_and(|c| c.as_ptr() == h.as_ptr()))
            });
            match self.cache.lookup_base_checked(b, checked) {
                Lookup::Hit(c) if dict + c.len() <= RUN_DICT_DECODE => {
                    dict += c.len();
                    if fed.is_none() {
                        d.dict.extend_from_slice(c);
                    }
                }
                Lookup::Hit(_) => {
                    return Err(CodecError::Malformed(
                        "delta run bases larger than a receiver loads",
                    ));
                }
                Lookup::Miss => return Err(CodecError::Miss(*b)),
                Lookup::Pending => return Err(CodecError::Pending(*b)),
            }
        }
        if let Some(fed) = fed_at.and_then(|i| {
            stream.runs_fed.drain(..i);
            stream.runs_fed.pop_front()
        }) {
            // Rebuilt and checked against this record's check on the worker.
            if re_sent {
                self.resolved.remove(&check);
            }
            self.put_pieces(out, &fed.pieces, total, place, settle);
            for p in fed.pieces {
                if let Some(name) = p.name {
                    self.cache.insert_bytes(name, p.bytes);
                    self.log_chunk(stream.log, name);
                }
            }
            self.stats.delta_chunks += n as u64;
            self.stats.delta_bytes += total as u64;
            self.runs_ahead += 1;
            return Ok(used);
        }
        // Written here: not while a batch's jobs may still write into `out`.
        settle();
        let bare = buf[0] == TAG_DELTA_RUN_BARE;
        let rebuilt = rebuild(d, payload, total, bare)?.ok_or(CodecError::Decompress)?;
        // Every chunk checked before any is added or appended (named on the workers, if any).
        let mut found = Vec::with_capacity(n);
        self.fingerprints_of(&rebuilt, lens[..n].iter().map(|&l| (l, true)), &mut found);
        let mut chunks = [[0u8; 16]; MAX_RUN_CHUNKS];
        let mut off = 0;
        for ((name, len), f) in chunks.iter_mut().zip(&lens[..n]).zip(found) {
            *name = f.unwrap_or_else(|| fingerprint(&rebuilt[off..off + len]));
            off += len;
        }
        if run_check(chunks[..n].iter()) != check {
            // Bases placed by a log that differs from the sender's: ask for their names.
            if placed && !re_sent {
                return Err(self.ask(check, false));
            }
            return Err(CodecError::Malformed("delta run does not match its check"));
        }
        if re_sent {
            self.resolved.remove(&check);
        }
        let mut off = 0;
        for (name, &len) in chunks.iter().zip(&lens[..n]) {
            let chunk = &rebuilt[off..off + len];
            out.extend_from_slice(chunk);
            self.cache.insert(*name, chunk.to_vec());
            self.log_chunk(stream.log, *name);
            off += len;
        }
        self.stats.delta_chunks += n as u64;
        self.stats.delta_bytes += total as u64;
        Ok(used)
    }
}

/// A delta run record's header, read and bounded: its chunks' and bases' counts, the bases'
/// names (those placed in a log resolved by `logs`, where given and held there), the chunks'
/// lengths and their sum, the run's check, and where its frame is in the record (its end is the
/// record's).
pub(crate) struct RunHead {
    pub(crate) n: usize,
    pub(crate) nb: usize,
    pub(crate) names: [Fingerprint; MAX_RUN_BASES],
    /// Some base is named by its place in a log, and some such place was not resolved.
    pub(crate) placed: bool,
    pub(crate) unresolved: bool,
    pub(crate) lens: [usize; MAX_RUN_CHUNKS],
    pub(crate) total: usize,
    pub(crate) check: Fingerprint,
    pub(crate) payload: std::ops::Range<usize>,
}

/// Reads the header of the delta run record at the front of `buf` (see [`RunHead`]), checking
/// its counts and lengths against the limits.
pub(crate) fn run_head(buf: &[u8], logs: Option<&Logs>) -> Result<RunHead, CodecError> {
    let n = usize::from(*buf.get(1).ok_or(CodecError::Incomplete)?);
    let nb = usize::from(*buf.get(2).ok_or(CodecError::Incomplete)?);
    if n == 0 || n > MAX_RUN_CHUNKS || nb == 0 || nb > MAX_RUN_BASES {
        return Err(CodecError::Malformed(
            "delta run with no or too many chunks or bases",
        ));
    }
    let mut at = 3;
    // The bases, by name or by place in a log (see `put_base`).
    let mut names = [[0u8; 16]; MAX_RUN_BASES];
    let (mut prev, mut placed, mut unresolved) = (None::<(u32, u64)>, false, false);
    for name in &mut names[..nb] {
        let (v, h) = get_varint(buf, at)?;
        at += h;
        if v == 0 {
            name.copy_from_slice(buf.get(at..at + 16).ok_or(CodecError::Incomplete)?);
            at += 16;
            continue;
        }
        let place = if v % 2 == 1 {
            let (s, i) = prev.ok_or(CodecError::Malformed(
                "a base placed after no other placed base",
            ))?;
            let zz = (v - 1) / 2;
            let d = ((zz >> 1) as i64) ^ -((zz & 1) as i64);
            (s, i.wrapping_add(1).wrapping_add(d as u64))
        } else {
            let s = u32::try_from(v / 2 - 1)
                .map_err(|_| CodecError::Malformed("log serial beyond 32 bits"))?;
            let (i, h) = get_varint(buf, at)?;
            at += h;
            (s, i)
        };
        prev = Some(place);
        placed = true;
        match logs.and_then(|l| l.get(place.0, place.1)) {
            Some(f) => *name = *f,
            None => unresolved = true,
        }
    }
    let mut lens = [0usize; MAX_RUN_CHUNKS];
    let mut total = 0usize;
    for len in &mut lens[..n] {
        let (l, h) = get_len(buf, at)?;
        at += h;
        if l == 0 {
            return Err(CodecError::Malformed("empty chunk in a delta run"));
        }
        total += l;
        if total > RUN_MAX_DECODE {
            return Err(CodecError::Malformed(
                "delta run longer than a receiver accepts",
            ));
        }
        *len = l;
    }
    let mut check = [0u8; 16];
    check.copy_from_slice(buf.get(at..at + 16).ok_or(CodecError::Incomplete)?);
    at += 16;
    let (clen, h) = get_len(buf, at)?;
    at += h;
    let end = at.checked_add(clen).filter(|e| *e <= buf.len());
    let end = end.ok_or(CodecError::Incomplete)?;
    Ok(RunHead {
        n,
        nb,
        names,
        placed,
        unresolved,
        lens,
        total,
        check,
        payload: at..end,
    })
}

/// Where in `fed` the run rebuilt ahead for the record with this `check` and chunks' `lens`
/// is, if it is there (those before it were not needed after all: records are decoded in
/// order).
fn fed_position(fed: &VecDeque<RunFed>, check: &Fingerprint, lens: &[usize]) -> Option<usize> {
    fed.iter().position(|f| fed_is(f, check, lens))
}

/// True if `f` is the run rebuilt ahead for the record with this `check` and chunks' `lens`.
pub(crate) fn fed_is(f: &RunFed, check: &Fingerprint, lens: &[usize]) -> bool {
    f.check == *check
        && f.pieces.len() == lens.len()
        && f.pieces.iter().zip(lens).all(|(p, &l)| p.bytes.len() == l)
}

/// Rebuilds ahead, on a worker, the delta run record at the front of `rec` (at `at` in its
/// frame) from the bases the
/// decoder's thread found for it (`bases`, each with its name, in the record's order, the
/// bytes the cache held then): its chunks, named, if they match the record's check (and each
/// base its name, where the cache checks what it holds: `verify`). `None` for anything else:
/// the record is then rebuilt in order, which finds what is wrong with it.
pub(crate) fn rebuild_ahead(
    rec: &[u8],
    at: usize,
    bases: Vec<(Fingerprint, bytes::Bytes)>,
    verify: bool,
    d: &mut RecvScratch,
) -> Option<RunFed> {
    let head = run_head(rec, None).ok()?;
    if bases.len() != head.nb {
        return None;
    }
    d.dict.clear();
    for (name, b) in &bases {
        if d.dict.len() + b.len() > RUN_DICT_DECODE || (verify && fingerprint(b) != *name) {
            return None;
        }
        d.dict.extend_from_slice(b);
    }
    let bare = rec.first() == Some(&TAG_DELTA_RUN_BARE);
    let rebuilt = rebuild(d, rec.get(head.payload)?, head.total, bare).ok()??;
    let mut pieces = Vec::with_capacity(head.n);
    let mut off = 0;
    for &len in &head.lens[..head.n] {
        let chunk = rebuilt.get(off..off + len)?;
        off += len;
        pieces.push(Piece {
            bytes: bytes::Bytes::copy_from_slice(chunk),
            cached: true,
            name: Some(fingerprint(chunk)),
        });
    }
    if run_check(pieces.iter().filter_map(|p| p.name.as_ref())) != head.check {
        return None;
    }
    Some(RunFed {
        at,
        check: head.check,
        pieces,
        checked: if verify { bases } else { Vec::new() },
    })
}

/// Decompresses `payload` (a frame without its magic number if `bare`) against the bases
/// gathered in `d`'s dictionary into exactly `len` bytes (the announced size, itself bounded
/// before this); `None` if it does not decompress to that. Bases that would be read as a
/// trained zstd dictionary are malformed.
fn rebuild(
    d: &mut RecvScratch,
    payload: &[u8],
    len: usize,
    bare: bool,
) -> Result<Option<Vec<u8>>, CodecError> {
    if is_dict_magic(&d.dict) {
        return Err(CodecError::Malformed(
            "delta bases read as a zstd dictionary",
        ));
    }
    if d.dctx.is_none() {
        d.dctx = DCtx::try_create();
    }
    let RecvScratch { dict, dctx, frame } = d;
    let dctx = dctx.as_mut().ok_or(CodecError::Decompress)?;
    let payload = if bare {
        frame.clear();
        frame.extend_from_slice(&ZSTD_MAGIC);
        frame.extend_from_slice(payload);
        &frame[..]
    } else {
        payload
    };
    let mut out = Vec::with_capacity(len);
    let ok = dctx.decompress_using_dict(&mut out, payload, dict).is_ok();
    Ok((ok && out.len() == len).then_some(out))
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
            dec.decode_delta(&rec, &mut out, None),
            Err(CodecError::Miss(target))
        );
        assert!(out.is_empty());
        assert_eq!(
            dec.decode_delta(&rec[..rec.len() - 1], &mut out, None),
            Err(CodecError::Incomplete)
        );
        let mut none = rec.clone();
        none[2] = 0;
        assert!(matches!(
            dec.decode_delta(&none, &mut out, None),
            Err(CodecError::Malformed(_))
        ));
        none[2] = (MAX_BASES + 1) as u8;
        assert!(matches!(
            dec.decode_delta(&none, &mut out, None),
            Err(CodecError::Malformed(_))
        ));
    }
}
