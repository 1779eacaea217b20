//! A reference run on the receiving side: the chunks named by their place in a stream log,
//! checked against the run's check, or by the names the peer re-sent for it.

use bytes::Bytes;

use super::Decoder;
use crate::cache::Lookup;
use crate::fingerprint::{Fingerprint, SHORT_CHECK, check_matches, short_key};
use crate::format::{CodecError, TAG_REF_RUN_SHORT, get_varint};
use crate::logs::MAX_REF_RUN;

/// A reference run's header: the log it names (serial, the first chunk's index, how many),
/// its check (or a short check's key: both are what the names are asked for by), and the
/// record's length.
pub(super) struct RefRunHead {
    serial: u32,
    index: u64,
    count: usize,
    check: Fingerprint,
    pub(super) used: usize,
}

/// A reference run decoded within a decoding batch: the place its job copied its chunks into
/// and the chunks it copied, if it did; and how to wait for the batch's jobs that write into
/// `out`, before its chunks are copied here otherwise (never on the workers in a call of its
/// own: they are the batch's).
pub(crate) struct InBatch<'s> {
    pub(crate) placed: Option<(usize, Vec<Bytes>)>,
    pub(crate) settle: &'s mut dyn FnMut(),
}

/// Reads a reference run's header, its counts bounded.
pub(super) fn ref_run_head(buf: &[u8]) -> Result<RefRunHead, CodecError> {
    let (serial, h1) = get_varint(buf, 1)?;
    let (index, h2) = get_varint(buf, 1 + h1)?;
    let (count, h3) = get_varint(buf, 1 + h1 + h2)?;
    let at = 1 + h1 + h2 + h3;
    let serial =
        u32::try_from(serial).map_err(|_| CodecError::Malformed("log serial beyond 32 bits"))?;
    let count = usize::try_from(count)
        .ok()
        .filter(|c| (1..=MAX_REF_RUN).contains(c))
        .ok_or(CodecError::Malformed(
            "reference run of no or too many chunks",
        ))?;
    let (check, used) = if buf.first() == Some(&TAG_REF_RUN_SHORT) {
        let c = buf
            .get(at..at + SHORT_CHECK)
            .ok_or(CodecError::Incomplete)?;
        (short_key(c), at + SHORT_CHECK)
    } else {
        let mut c = [0u8; 16];
        c.copy_from_slice(buf.get(at..at + 16).ok_or(CodecError::Incomplete)?);
        (c, at + 16)
    };
    Ok(RefRunHead {
        serial,
        index,
        count,
        check,
        used,
    })
}

impl Decoder {
    /// The chunks a reference run names, into `names`: from the place in our log it names, if
    /// they match its check, or from the names the peer re-sent for it. False for neither.
    pub(super) fn ref_run_names(&self, head: &RefRunHead, names: &mut Vec<Fingerprint>) -> bool {
        if self.logs.names(head.serial, head.index, head.count, names)
            && check_matches(names.iter(), &head.check)
        {
            return true;
        }
        match self.resolved.get(&head.check) {
            Some(r) => {
                names.clear();
                names.extend_from_slice(r);
                true
            }
            None => false,
        }
    }

    /// What a reference run rebuilds, if its chunks can be named and are all held now: where a
    /// decoding batch places the records after it (it is checked in full when decoded).
    pub(super) fn ref_run_len(
        &self,
        head: &RefRunHead,
        names: &mut Vec<Fingerprint>,
    ) -> Option<usize> {
        if !self.ref_run_names(head, names) {
            return None;
        }
        names
            .iter()
            .try_fold(0usize, |t, f| t.checked_add(self.cache.held_len(f)?))
    }

    /// Decodes a reference run of the stream whose log is `log`: the chunks at the place it
    /// names (or the names the peer re-sent for its check), all held and within `room` bytes,
    /// appended in order and logged. A place our log does not hold, or whose names do not match
    /// the check, is a miss of the check (the peer answers with the names); a chunk we lack is
    /// a miss of it. On any error nothing is appended. Its chunks are copied on the workers
    /// (if any), or within a decoding batch as [`InBatch`] says.
    pub(crate) fn decode_ref_run(
        &mut self,
        buf: &[u8],
        out: &mut Vec<u8>,
        log: Option<u32>,
        room: usize,
        in_batch: Option<InBatch<'_>>,
    ) -> Result<usize, CodecError> {
        let head = ref_run_head(buf)?;
        let mut names = std::mem::take(&mut self.names);
        if !self.ref_run_names(&head, &mut names) {
            self.names = names;
            return Err(self.ask(head.check, true));
        }
        let r = self.append_held(&names, out, room, in_batch);
        if r.is_ok() {
            self.resolved.remove(&head.check);
            for f in &names {
                self.log_chunk(log, *f);
            }
        }
        self.names = names;
        r.map(|()| head.used)
    }

    /// Appends the held chunks `names` to `out`, at most `room` bytes; on a miss or a chunk
    /// that fails its check, nothing. Within a batch (see [`InBatch`]): counted in where its
    /// job copied them, if it did and they are still the cache's very bytes; else copied here,
    /// once the batch's jobs that write into `out` are done.
    fn append_held(
        &mut self,
        names: &[Fingerprint],
        out: &mut Vec<u8>,
        room: usize,
        mut in_batch: Option<InBatch<'_>>,
    ) -> Result<(), CodecError> {
        let mut total = 0usize;
        for f in names {
            match self.cache.held_len(f) {
                Some(len) => total += len,
                None => return Err(CodecError::Miss(*f)),
            }
        }
        if total > room {
            return Err(CodecError::Malformed(
                "record rebuilds more than its frame announced",
            ));
        }
        let before = out.len();
        // The chunks its job copied into place (and checked), if that place is where `out`
        // ends and they are all of them; else they are copied here, after the batch's jobs
        // that write into `out`.
        let mut ahead = None;
        if let Some(b) = &mut in_batch {
            ahead = b.placed.take().and_then(|(place, parts)| {
                let whole = place == before
                    && parts.len() == names.len()
                    && parts.iter().map(Bytes::len).sum::<usize>() == total
                    && out.capacity() - before >= total;
                whole.then_some(parts)
            });
            if ahead.is_none() {
                (b.settle)();
            }
        }
        // Copied (and checked) on the workers, or here.
        let checked = in_batch.is_none() && self.copy_held_ahead(names, out, total);
        // Of the chunks its job copied, the bytes confirmed so far.
        let mut counted = 0usize;
        for (i, f) in names.iter().enumerate() {
            if let Some(parts) = &ahead {
                let same = self.cache.in_memory_bytes(f).is_some_and(|c| {
                    parts
                        .get(i)
                        .is_some_and(|p| c.as_ptr() == p.as_ptr() && c.len() == p.len())
                });
                if !same {
                    // Not the bytes its job copied (the cache changed since): this chunk and
                    // the rest are copied here, once the jobs that write into `out` are done.
                    if let Some(b) = &mut in_batch {
                        (b.settle)();
                    }
                    // SAFETY: the job wrote all the run's chunks into `out` from `before` on
                    // (`placed`: `total` bytes, the parts one after the other), `out` has room
                    // for them and has not been written since; the first `counted` bytes are
                    // the chunks before this one, each the cache's very bytes (the same
                    // buffer), checked against its name on the worker if the cache checks.
                    unsafe { out.set_len(before + counted) };
                    ahead = None;
                }
            }
            let err = match self.cache.lookup_checked(f, checked || ahead.is_some()) {
                Lookup::Hit(c) => {
                    if ahead.is_some() {
                        counted += c.len();
                    } else if !checked {
                        out.extend_from_slice(c);
                    }
                    continue;
                }
                Lookup::Miss => CodecError::Miss(*f),
                Lookup::Pending => CodecError::Pending(*f),
            };
            out.truncate(before);
            return Err(err);
        }
        if checked || ahead.is_some() {
            // SAFETY: `copy_held_ahead` returned true, or the batch's job placed the run
            // (above): the chunks fill `out`'s spare room from `before` on with exactly `total`
            // bytes, each the cache's (checked on the workers if it checks what it holds), and
            // nothing has written to `out` since.
            unsafe { out.set_len(before + total) };
            self.ahead_bytes += total as u64;
        }
        debug_assert_eq!(out.len(), before + total);
        self.stats.hit_chunks += names.len() as u64;
        self.stats.hit_bytes += total as u64;
        Ok(())
    }

    /// With workers and a run of [`RUN_AHEAD`] bytes or more, all held in memory: copies the
    /// chunks `names` (`total` bytes) into `out`'s spare room in order on the workers, each
    /// checked against its name if the cache checks what it holds. True if every chunk was
    /// copied and matched: the bytes are then in place, and `out`'s length is the caller's to
    /// set once the chunks are looked up in turn. False (nothing in place) otherwise.
    fn copy_held_ahead(&mut self, names: &[Fingerprint], out: &mut Vec<u8>, total: usize) -> bool {
        use crate::prepare::{Job, Work};
        let Some(w) = self
            .workers
            .clone()
            .filter(|_| total >= RUN_AHEAD && names.len() >= 2)
        else {
            return false;
        };
        let verify = self.cache.verifies_memory();
        let mut slots = std::mem::take(&mut self.run_slots);
        if slots.len() < names.len() {
            slots.resize_with(names.len(), Default::default);
        }
        out.reserve(total);
        let all = {
            let cache = &self.cache;
            let mut spare = &mut out.spare_capacity_mut()[..total];
            let mut jobs = Vec::with_capacity(names.len());
            for (f, slot) in names.iter().zip(slots.iter_mut()) {
                let Some(chunk) = cache.in_memory_bytes(f) else {
                    break;
                };
                if chunk.len() > spare.len() {
                    break;
                }
                slot.reset(chunk.len());
                let (mine, rest) = std::mem::take(&mut spare).split_at_mut(chunk.len());
                spare = rest;
                jobs.push(Job::placed(
                    chunk,
                    verify.then_some(Work::Fingerprint),
                    slot,
                    Some(mine.into()),
                ));
            }
            if jobs.len() == names.len() && spare.is_empty() {
                w.run(&mut jobs);
                true
            } else {
                false
            }
        };
        let ok = all
            && names
                .iter()
                .zip(&slots)
                .all(|(f, s)| s.placed && (!verify || s.fingerprint == Some(*f)));
        self.run_slots = slots;
        ok
    }
}

/// A reference run's bytes copied on the workers from this size on: below it, the call costs
/// more than the copies.
const RUN_AHEAD: usize = 16 << 10;
