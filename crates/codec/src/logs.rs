//! Stream logs: both ends list, for each stream, the fingerprints of the cached chunks its
//! records carried, in order, under a serial the sender gives the stream (a `TAG_LOG` record at
//! its start). A run of references to chunks that came in the same order before (a second
//! copy of a source tree, of a datafile that did not change) is then named by its place in a
//! log, (serial, index, count), and a check, instead of 16 bytes a chunk: the changed kernel
//! tree's 16,000 references cost 0.3 MB one by one.
//!
//! Both ends append in their stream's record order and drop the oldest entries past the same
//! bound, so they agree on every place the sender names unless they saw different records (a
//! stream that failed at the receiver) or evicted at different moments (a stream stalled on a
//! miss while others went on). Then the check does not match or the place is gone, and the
//! receiver asks for the names by the check (a miss the resend store answers): never a wrong
//! chunk.

use std::collections::{BTreeMap, VecDeque};

use crate::fingerprint::Fingerprint;

/// Most chunks one reference run names (a receiver's limit; the sender's is the same).
pub const MAX_REF_RUN: usize = 256;

/// Log entries per byte of cache: one for every 4 KiB, so the logs reach back about as far as
/// a cache of 8 KiB chunks, at 16 bytes an entry (4 MiB for a 1 GiB cache).
const BYTES_PER_ENTRY: usize = 4096;

/// The logs of one cache's streams, bounded in entries.
#[derive(Debug)]
pub(crate) struct Logs {
    logs: BTreeMap<u32, Log>,
    total: usize,
    limit: usize,
}

#[derive(Debug, Default)]
struct Log {
    /// Index of the first entry still held.
    start: u64,
    names: VecDeque<Fingerprint>,
}

impl Logs {
    /// Logs for a cache of `cache_bytes`.
    pub(crate) fn for_cache(cache_bytes: usize) -> Self {
        Self::new((cache_bytes / BYTES_PER_ENTRY).max(1024))
    }

    /// Logs of at most `limit` entries in all.
    pub(crate) fn new(limit: usize) -> Self {
        Logs {
            logs: BTreeMap::new(),
            total: 0,
            limit: limit.max(1),
        }
    }

    /// Entries held in all.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.total
    }

    /// The most entries held.
    pub(crate) fn limit(&self) -> usize {
        self.limit
    }

    /// Appends `f` to log `serial`; returns its index there. The oldest entries (of the
    /// lowest serials) go first past the bound; a log left empty is forgotten.
    pub(crate) fn append(&mut self, serial: u32, f: Fingerprint) -> u64 {
        let log = self.logs.entry(serial).or_default();
        let at = log.start + log.names.len() as u64;
        log.names.push_back(f);
        self.total += 1;
        while self.total > self.limit {
            let Some(mut oldest) = self.logs.first_entry() else {
                break;
            };
            let log = oldest.get_mut();
            if log.names.pop_front().is_some() {
                log.start += 1;
                self.total -= 1;
            }
            if log.names.is_empty() && *oldest.key() != serial {
                oldest.remove();
            }
        }
        at
    }

    /// The entry at `index` of log `serial`, if it is held.
    pub(crate) fn get(&self, serial: u32, index: u64) -> Option<&Fingerprint> {
        let log = self.logs.get(&serial)?;
        let i = usize::try_from(index.checked_sub(log.start)?).ok()?;
        log.names.get(i)
    }

    /// The `count` entries from `index` of log `serial` into `out`; false (and `out` cut
    /// short) unless all are held.
    pub(crate) fn names(
        &self,
        serial: u32,
        index: u64,
        count: usize,
        out: &mut Vec<Fingerprint>,
    ) -> bool {
        out.clear();
        let Some(log) = self.logs.get(&serial) else {
            return false;
        };
        let Some(i) = index
            .checked_sub(log.start)
            .and_then(|i| usize::try_from(i).ok())
        else {
            return false;
        };
        if i.checked_add(count).is_none_or(|end| end > log.names.len()) {
            return false;
        }
        out.extend(log.names.range(i..i + count));
        true
    }

    /// The index the next entry of log `serial` will have.
    pub(crate) fn next_index(&self, serial: u32) -> u64 {
        self.logs
            .get(&serial)
            .map_or(0, |l| l.start + l.names.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(i: u32) -> Fingerprint {
        crate::fingerprint::fingerprint(&i.to_le_bytes())
    }

    /// Entries keep their index as older ones go; the oldest serial's go first, and past the
    /// bound nothing is held twice or lost out of order.
    #[test]
    fn logs_keep_places_and_drop_the_oldest_first() {
        let mut l = Logs::new(8);
        for i in 0..5 {
            assert_eq!(l.append(1, f(i)), u64::from(i));
        }
        for i in 0..5 {
            assert_eq!(l.append(2, f(100 + i)), u64::from(i));
        }
        assert_eq!(l.len(), 8);
        // Log 1 lost its first two entries; the rest keep their places.
        assert_eq!(l.get(1, 1), None);
        assert_eq!(l.get(1, 2), Some(&f(2)));
        let mut out = Vec::new();
        assert!(l.names(2, 1, 4, &mut out));
        assert_eq!(out, (101..105).map(f).collect::<Vec<_>>());
        assert!(!l.names(1, 1, 2, &mut out), "an entry dropped");
        assert!(!l.names(2, 3, 3, &mut out), "past the end");
        assert!(!l.names(9, 0, 1, &mut out), "no such log");
        assert!(!l.names(2, u64::MAX, 2, &mut out));
        // Log 1 empties and is forgotten; log 2 goes on where it was.
        for i in 5..10 {
            l.append(2, f(100 + i));
        }
        assert_eq!(l.next_index(1), 0);
        assert_eq!(l.next_index(2), 10);
        assert_eq!(l.get(2, 9), Some(&f(109)));
        assert_eq!(l.len(), 8);
        // A log that is the only one left drops its own oldest.
        l.append(2, f(110));
        assert_eq!(l.get(2, 2), None);
        assert_eq!(l.get(2, 3), Some(&f(103)));
    }
}
