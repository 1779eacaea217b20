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
        for f in names {
            let err = match self.cache.lookup(f) {
                Lookup::Hit(c) => {
                    out.extend_from_slice(c);
                    continue;
                }
                Lookup::Miss => CodecError::Miss(*f),
                Lookup::Pending => CodecError::Pending(*f),
            };
            out.truncate(before);
            return Err(err);
        }
        self.stats.hit_chunks += names.len() as u64;
        self.stats.hit_bytes += total as u64;
        Ok(())
    }
}
