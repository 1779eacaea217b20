//! A reference run on the receiving side: the chunks named by their place in a stream log,
//! checked against the run's check, or by the names the peer re-sent for it.

use super::Decoder;
use crate::cache::Lookup;
use crate::fingerprint::{SHORT_CHECK, check_matches, short_key};
use crate::format::{CodecError, TAG_REF_RUN_SHORT, get_varint};
use crate::logs::MAX_REF_RUN;

impl Decoder {
    /// Decodes a reference run of the stream whose log is `log`: the chunks at the place it
    /// names (or the names the peer re-sent for its check), all held and within `room` bytes,
    /// appended in order and logged. A place our log does not hold, or whose names do not match
    /// the check, is a miss of the check (the peer answers with the names); a chunk we lack is
    /// a miss of it. On any error nothing is appended.
    pub(crate) fn decode_ref_run(
        &mut self,
        buf: &[u8],
        out: &mut Vec<u8>,
        log: Option<u32>,
        room: usize,
    ) -> Result<usize, CodecError> {
        let (serial, h1) = get_varint(buf, 1)?;
        let (index, h2) = get_varint(buf, 1 + h1)?;
        let (count, h3) = get_varint(buf, 1 + h1 + h2)?;
        let at = 1 + h1 + h2 + h3;
        let serial = u32::try_from(serial)
            .map_err(|_| CodecError::Malformed("log serial beyond 32 bits"))?;
        let count = usize::try_from(count)
            .ok()
            .filter(|c| (1..=MAX_REF_RUN).contains(c))
            .ok_or(CodecError::Malformed(
                "reference run of no or too many chunks",
            ))?;
        // The check, or a short check's key (both are what the names are asked for by).
        let (check, used) = if buf[0] == TAG_REF_RUN_SHORT {
            let c = buf
                .get(at..at + SHORT_CHECK)
                .ok_or(CodecError::Incomplete)?;
            (short_key(c), at + SHORT_CHECK)
        } else {
            let mut c = [0u8; 16];
            c.copy_from_slice(buf.get(at..at + 16).ok_or(CodecError::Incomplete)?);
            (c, at + 16)
        };
        let mut names = std::mem::take(&mut self.names);
        let from_log = self.logs.names(serial, index, count, &mut names)
            && check_matches(names.iter(), &check);
        if !from_log {
            match self.resolved.get(&check) {
                Some(r) => {
                    names.clear();
                    names.extend_from_slice(r);
                }
                None => {
                    self.names = names;
                    return Err(self.ask(check, true));
                }
            }
        }
        let r = self.append_held(&names, out, room);
        if r.is_ok() {
            self.resolved.remove(&check);
            for f in &names {
                self.log_chunk(log, *f);
            }
        }
        self.names = names;
        r.map(|()| used)
    }

    /// Appends the held chunks `names` to `out`, at most `room` bytes; on a miss or a chunk
    /// that fails its check, nothing.
    fn append_held(
        &mut self,
        names: &[crate::fingerprint::Fingerprint],
        out: &mut Vec<u8>,
        room: usize,
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
        // Copied (and checked) on the workers, or here.
        let checked = self.copy_held_ahead(names, out, total);
        for f in names {
            let err = match self.cache.lookup_checked(f, checked) {
                Lookup::Hit(c) => {
                    if !checked {
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
        if checked {
            // SAFETY: `copy_held_ahead` returned true: the jobs filled `out`'s spare room from
            // `before` on with exactly `total` bytes (the chunks' places tile it, and each job
            // wrote its whole place), and nothing has written to `out` since.
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
    fn copy_held_ahead(
        &mut self,
        names: &[crate::fingerprint::Fingerprint],
        out: &mut Vec<u8>,
        total: usize,
    ) -> bool {
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
