//! The chunk cache, bounded in bytes, with a deterministic least-recently-used policy, in one or
//! two tiers: memory alone, or memory in front of a disk [`ChunkStore`].
//!
//! Each direction of a link has one cache per side: the sender's encoder keeps a mirror of the
//! receiver's decoder cache. Both apply the same inserts and touches in the same (frame) order, and
//! eviction depends only on that order and the capacity, so the two stay identical by construction.
//! The mirror keeps only fingerprints and lengths ([`ChunkCache::insert_len`]); the decoder keeps
//! the bytes: with a disk tier, every chunk is written through to disk and memory holds the most
//! recently used ones. Where the bytes live is the decoder's business and does not change what the
//! cache holds. Every chunk read back, from memory or disk, is checked against its fingerprint; a
//! damaged or lost entry is dropped and reported as a miss. A [`Snapshot`] of the index (order,
//! lengths, disk locations) with its digest lets both sides resume the same cache after a restart.

use std::collections::BTreeMap;
use std::task::Poll;

use bytes::Bytes;

use crate::store::{ChunkStore, Loc};

/// Chunks are named by their fingerprint (see [`crate::fingerprint`]).
pub use crate::fingerprint::{Fingerprint, fingerprint};
pub use crate::snapshot::{SnapEntry, Snapshot, SnapshotError};

#[derive(Debug)]
struct Entry {
    /// The chunk's bytes when held in memory (never in a mirror).
    mem: Option<Bytes>,
    /// Where the chunk is on disk, with a disk tier.
    loc: Option<Loc>,
    len: usize,
    stamp: u64,
    /// The key of its bytes in the memory order (`stamp`, unless a use moved only that order).
    mem_stamp: u64,
}

/// What a [`ChunkCache::lookup`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Lookup<'a> {
    /// The chunk, verified.
    Hit(&'a [u8]),
    /// Not held (or damaged, and dropped).
    Miss,
    /// Held, with its bytes on disk: the store is fetching them.
    Pending,
}

/// One disk segment's bookkeeping.
#[derive(Debug, Default)]
struct Seg {
    /// Bytes the segment's file holds.
    total: u64,
    /// Bytes of its records that entries still point to.
    live: u64,
    /// Chunks written to it (some since evicted or moved: checked against the entry).
    members: Vec<Fingerprint>,
}

struct DiskTier {
    store: Box<dyn ChunkStore>,
    /// Most bytes the store's files may hold.
    limit: u64,
    files: u64,
    segs: BTreeMap<u32, Seg>,
    /// Chunks copied forward out of a segment being reclaimed.
    moved: u64,
    /// Chunks that could not be read back (damaged, lost) and were dropped.
    lost: u64,
    /// Segments reclaimed.
    reclaimed: u64,
}

/// Sizes and counts of one cache's tiers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierStats {
    /// True if the cache has a disk tier.
    pub disk: bool,
    /// Chunk bytes held in memory, and how many chunks.
    pub mem_bytes: u64,
    pub mem_chunks: u64,
    /// Chunks whose bytes left memory for the disk tier only.
    pub mem_evictions: u64,
    /// Bytes of the disk tier's files (live and not yet reclaimed).
    pub disk_bytes: u64,
    /// Chunks in the index that live on disk.
    pub disk_chunks: u64,
    /// Disk segments reclaimed, chunks moved while reclaiming, chunks dropped unreadable.
    pub disk_reclaimed: u64,
    pub disk_moved: u64,
    pub disk_lost: u64,
}

/// A byte-bounded LRU map from fingerprint to chunk.
pub struct ChunkCache {
    capacity: usize,
    size: usize,
    clock: u64,
    entries: crate::fingerprint::FpMap<Entry>,
    /// Recency order: stamp -> fingerprint (oldest first).
    order: BTreeMap<u64, Fingerprint>,
    evictions: u64,
    mem_limit: usize,
    mem_size: usize,
    /// Recency order of the entries whose bytes are in memory.
    mem_order: BTreeMap<u64, Fingerprint>,
    mem_evictions: u64,
    disk: Option<DiskTier>,
    /// Entries whose bytes are on disk (kept, not counted: the index may hold millions).
    on_disk: u64,
    /// Bytes in memory are checked against their fingerprint on every read (see
    /// [`trust_memory`](ChunkCache::trust_memory)).
    verify_mem: bool,
    /// A use of an entry among the newest eighth leaves the order as it is (see
    /// [`lazy_recency`](ChunkCache::lazy_recency)).
    lazy: bool,
    /// A use as a delta's base moves the chunk in memory's order only (see
    /// [`set_quiet_bases`](ChunkCache::set_quiet_bases)).
    quiet_bases: bool,
}

impl std::fmt::Debug for ChunkCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkCache")
            .field("capacity", &self.capacity)
            .field("size", &self.size)
            .field("chunks", &self.entries.len())
            .field("disk", &self.disk.is_some())
            .finish()
    }
}

/// The share of a disk tier's byte limit that holds live chunks; the rest is room to reclaim
/// segments without ever exceeding the limit.
pub fn disk_capacity(limit: u64) -> u64 {
    limit / 4 * 3
}

/// The size of a disk tier's segments for a byte limit: small enough that reclaiming one frees a
/// useful share, large enough that files stay few.
pub fn segment_size(limit: u64) -> u64 {
    (limit / 32).clamp(1 << 20, 64 << 20)
}

impl ChunkCache {
    /// A memory-only cache holding at most `capacity` bytes of chunk data.
    pub fn new(capacity: usize) -> Self {
        ChunkCache {
            capacity,
            size: 0,
            clock: 0,
            entries: Default::default(),
            order: BTreeMap::new(),
            evictions: 0,
            mem_limit: capacity,
            mem_size: 0,
            mem_order: BTreeMap::new(),
            mem_evictions: 0,
            disk: None,
            on_disk: 0,
            verify_mem: true,
            lazy: false,
            quiet_bases: false,
        }
    }

    /// Bytes held in memory are handed out without checking them again (bytes read from disk
    /// still are): for a store of our own bytes, where a wrong one costs the peer a miss that
    /// its own check catches, and hashing every read would cost more than the use.
    pub fn trust_memory(mut self) -> Self {
        self.verify_mem = false;
        self
    }

    /// A use of an entry among the most recently used eighth does not move it: the order is
    /// then nearly, not exactly, least recently used, and a delta's eight bases cost no
    /// reordering of the two recency maps each. Only for a cache of our own: a mirror's must
    /// apply exactly what the peer's applies.
    pub fn lazy_recency(mut self) -> Self {
        self.lazy = true;
        self
    }

    /// With `quiet`, a use as a delta's base ([`touch_base`](Self::touch_base),
    /// [`lookup_base`](Self::lookup_base)) keeps the chunk's bytes in memory but not the chunk
    /// in the cache: it leaves in its turn as if unused, since the new version the delta
    /// rebuilt (inserted after it) supersedes it. With plain LRU, the changed copy of a data
    /// set that nearly filled the cache floods it: each chunk it adds evicts the least recently
    /// used, which is the first copy's next chunk, the base or reference it needs next. A
    /// mirror and its peer's cache must agree on it (`CAP_QUIET_BASES`).
    pub fn set_quiet_bases(&mut self, quiet: bool) {
        self.quiet_bases = quiet;
    }

    /// Whether uses as a base keep a chunk's place (see [`set_quiet_bases`](Self::set_quiet_bases)).
    pub fn has_quiet_bases(&self) -> bool {
        self.quiet_bases
    }

    /// [`set_quiet_bases`](Self::set_quiet_bases) for a new cache.
    pub fn quiet_bases(mut self) -> Self {
        self.quiet_bases = true;
        self
    }

    /// A two-tier cache: chunks are written through to `store`, whose files stay within
    /// `disk_limit` bytes; the index holds [`disk_capacity`] of that, and memory keeps the bytes
    /// of the most recently used chunks up to `mem_limit`.
    pub fn tiered(mem_limit: usize, disk_limit: u64, store: Box<dyn ChunkStore>) -> Self {
        let capacity = usize::try_from(disk_capacity(disk_limit)).unwrap_or(usize::MAX);
        let mut c = ChunkCache::new(capacity);
        c.mem_limit = mem_limit.min(capacity);
        let mut segs = BTreeMap::new();
        let mut files = 0;
        for (n, bytes) in store.segments() {
            files += bytes;
            segs.insert(
                n,
                Seg {
                    total: bytes,
                    ..Seg::default()
                },
            );
        }
        c.disk = Some(DiskTier {
            store,
            limit: disk_limit,
            files,
            segs,
            moved: 0,
            lost: 0,
            reclaimed: 0,
        });
        c
    }

    /// Bytes the cache holds at most.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes of chunk data held.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Chunks held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// A counter of inserts and uses: it changes whenever the cache's state does.
    pub fn clock(&self) -> u64 {
        self.clock
    }

    /// Chunks evicted so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// True if the cache has a disk tier.
    pub fn has_disk(&self) -> bool {
        self.disk.is_some()
    }

    /// Sizes and counts per tier.
    pub fn tier_stats(&self) -> TierStats {
        let mut t = TierStats {
            mem_bytes: self.mem_size as u64,
            mem_chunks: self.mem_order.len() as u64,
            mem_evictions: self.mem_evictions,
            ..TierStats::default()
        };
        if let Some(d) = &self.disk {
            t.disk = true;
            t.disk_bytes = d.files;
            t.disk_chunks = self.on_disk;
            debug_assert_eq!(
                self.on_disk,
                self.entries.values().filter(|e| e.loc.is_some()).count() as u64
            );
            t.disk_reclaimed = d.reclaimed;
            t.disk_moved = d.moved;
            t.disk_lost = d.lost;
        }
        t
    }

    /// True if the chunk is held (does not count as a use).
    pub fn contains(&self, f: &Fingerprint) -> bool {
        self.entries.contains_key(f)
    }

    /// Bytes of a held chunk (its bytes unread), if it is held.
    pub fn held_len(&self, f: &Fingerprint) -> Option<usize> {
        self.entries.get(f).map(|e| e.len)
    }

    /// True if the chunk is held with its bytes in memory.
    pub fn in_memory(&self, f: &Fingerprint) -> bool {
        self.entries.get(f).is_some_and(|e| e.mem.is_some())
    }

    fn bump(&mut self, f: &Fingerprint) {
        if self.lazy
            && let Some(e) = self.entries.get(f)
            && e.stamp.saturating_add(self.entries.len() as u64 / 8) >= self.clock
        {
            return;
        }
        self.clock += 1;
        if let Some(e) = self.entries.get_mut(f) {
            self.order.remove(&e.stamp);
            if e.mem.is_some() {
                self.mem_order.remove(&e.mem_stamp);
                self.mem_order.insert(self.clock, *f);
            }
            e.stamp = self.clock;
            e.mem_stamp = self.clock;
            self.order.insert(self.clock, *f);
        }
    }

    /// Moves a chunk to the newest end of memory's order only.
    fn bump_mem(&mut self, f: &Fingerprint) {
        self.clock += 1;
        if let Some(e) = self.entries.get_mut(f)
            && e.mem.is_some()
        {
            self.mem_order.remove(&e.mem_stamp);
            self.mem_order.insert(self.clock, *f);
            e.mem_stamp = self.clock;
        }
    }

    /// Marks a chunk as used (both sides do this for every reference, in frame order).
    pub fn touch(&mut self, f: &Fingerprint) {
        self.bump(f);
    }

    /// Marks a chunk as used as a delta's base (see [`set_quiet_bases`](Self::set_quiet_bases)).
    pub fn touch_base(&mut self, f: &Fingerprint) {
        if self.quiet_bases {
            self.bump_mem(f);
        } else {
            self.bump(f);
        }
    }

    /// Returns a held chunk after checking it against its fingerprint, reading it from disk if
    /// it is not in memory; a damaged or unreadable one is removed and `None` returned (a miss,
    /// never wrong data). Counts as a use. A store still fetching the bytes reads as a miss
    /// here; [`lookup`](Self::lookup) tells the two apart.
    pub fn get(&mut self, f: &Fingerprint) -> Option<&[u8]> {
        match self.lookup(f) {
            Lookup::Hit(d) => Some(d),
            Lookup::Miss | Lookup::Pending => None,
        }
    }

    /// Like [`get`](Self::get), but a chunk whose bytes the store is still fetching is
    /// [`Lookup::Pending`]: it stays in the cache, and the caller asks again once the store has
    /// it (nothing blocks on the disk here).
    pub fn lookup(&mut self, f: &Fingerprint) -> Lookup<'_> {
        self.lookup_as(f, false, false)
    }

    /// [`lookup`](Self::lookup) of a chunk whose bytes in memory the caller has just checked
    /// against `f` (on a worker, from [`in_memory_bytes`](Self::in_memory_bytes)), if
    /// `checked`: they are not hashed again.
    pub(crate) fn lookup_checked(&mut self, f: &Fingerprint, checked: bool) -> Lookup<'_> {
        self.lookup_as(f, false, checked)
    }

    /// Whether chunks held in memory are checked against their fingerprints when used (see
    /// [`trust_memory`](Self::trust_memory)).
    pub(crate) fn verifies_memory(&self) -> bool {
        self.verify_mem
    }

    /// [`lookup`](Self::lookup) of a delta's base (see
    /// [`set_quiet_bases`](Self::set_quiet_bases)).
    pub fn lookup_base(&mut self, f: &Fingerprint) -> Lookup<'_> {
        self.lookup_as(f, self.quiet_bases, false)
    }

    /// [`lookup_base`](Self::lookup_base) of a base whose bytes were `checked` against its
    /// name already (the very bytes held now).
    pub(crate) fn lookup_base_checked(&mut self, f: &Fingerprint, checked: bool) -> Lookup<'_> {
        self.lookup_as(f, self.quiet_bases, checked)
    }

    fn lookup_as(&mut self, f: &Fingerprint, quiet: bool, checked: bool) -> Lookup<'_> {
        let Some(e) = self.entries.get(f) else {
            return Lookup::Miss;
        };
        let verify = self.verify_mem;
        let read = match (&e.mem, e.loc, self.disk.as_mut()) {
            (Some(d), _, _) => Ok(!verify || checked || fingerprint(d) == *f),
            (None, Some(loc), Some(disk)) => match disk.store.try_read(loc, f) {
                Poll::Pending => return Lookup::Pending,
                Poll::Ready(Some(data)) if data.len() == e.len => Err(data),
                Poll::Ready(_) => {
                    disk.lost += 1;
                    Ok(false)
                }
            },
            _ => Ok(false),
        };
        let ok = match read {
            Ok(ok) => ok,
            Err(data) => {
                self.promote(f, data);
                true
            }
        };
        if !ok {
            self.remove(f);
            return Lookup::Miss;
        }
        if quiet {
            self.bump_mem(f);
        } else {
            self.bump(f);
        }
        self.shrink_mem(Some(f));
        match self.entries.get(f).and_then(|e| e.mem.as_deref()) {
            Some(d) => Lookup::Hit(d),
            None => Lookup::Miss,
        }
    }

    fn promote(&mut self, f: &Fingerprint, data: Vec<u8>) {
        if let Some(e) = self.entries.get_mut(f)
            && e.mem.is_none()
        {
            self.mem_size += data.len();
            self.mem_order.insert(e.mem_stamp, *f);
            e.mem = Some(Bytes::from(data));
        }
    }

    /// Returns a chunk held in memory after checking it against its fingerprint, without counting
    /// as a use.
    pub fn peek(&self, f: &Fingerprint) -> Option<&[u8]> {
        let d = self.entries.get(f)?.mem.as_deref()?;
        (fingerprint(d) == *f).then_some(d)
    }

    /// A chunk's bytes if held in memory, unchecked and without counting as a use: what a
    /// decoder copies ahead for a reference that [`lookup`](Self::lookup) then confirms.
    pub(crate) fn in_memory_bytes(&self, f: &Fingerprint) -> Option<&[u8]> {
        self.entries.get(f)?.mem.as_deref()
    }

    /// Like [`in_memory_bytes`](Self::in_memory_bytes), as a handle of its own: a copy made
    /// from it may run while the cache goes on changing (and drops the chunk).
    pub(crate) fn in_memory_handle(&self, f: &Fingerprint) -> Option<Bytes> {
        self.entries.get(f)?.mem.clone()
    }

    /// Inserts a chunk (or refreshes it), evicting the least recently used chunks to fit.
    /// Chunks larger than the whole cache are not kept.
    pub fn insert(&mut self, f: Fingerprint, data: Vec<u8>) {
        let len = data.len();
        self.put(f, Some(Bytes::from(data)), len);
    }

    /// [`insert`](Self::insert) of a chunk already held as `Bytes` (a buffer of its own).
    pub(crate) fn insert_bytes(&mut self, f: Fingerprint, data: Bytes) {
        let len = data.len();
        self.put(f, Some(data), len);
    }

    /// Like [`insert`](Self::insert) for an index-only cache: the chunk's length, not its bytes.
    pub fn insert_len(&mut self, f: Fingerprint, len: usize) {
        self.put(f, None, len);
    }

    fn put(&mut self, f: Fingerprint, data: Option<Bytes>, len: usize) {
        if self.entries.contains_key(&f) {
            self.bump(&f);
            return;
        }
        if len > self.capacity {
            return;
        }
        while self.size + len > self.capacity {
            let Some((&stamp, &victim)) = self.order.first_key_value() else {
                break;
            };
            self.order.remove(&stamp);
            self.remove(&victim);
            self.evictions += 1;
        }
        self.clock += 1;
        let loc = match (&data, self.disk.as_mut()) {
            (Some(d), Some(disk)) => disk.append(&f, d),
            _ => None,
        };
        self.on_disk += u64::from(loc.is_some());
        let mem = if self.mem_limit > 0 { data } else { None };
        if mem.is_some() {
            self.mem_size += len;
            self.mem_order.insert(self.clock, f);
        }
        self.size += len;
        self.order.insert(self.clock, f);
        self.entries.insert(
            f,
            Entry {
                mem,
                loc,
                len,
                stamp: self.clock,
                mem_stamp: self.clock,
            },
        );
        self.shrink_mem(Some(&f));
        self.reclaim();
        debug_assert!(self.size <= self.capacity);
        debug_assert!(self.mem_size <= self.mem_limit.max(len));
    }

    /// Keeps memory within its limit: the least recently used chunks keep only their disk copy
    /// (or, without one, leave the cache). `keep` is never dropped.
    fn shrink_mem(&mut self, keep: Option<&Fingerprint>) {
        while self.mem_size > self.mem_limit {
            let Some((&stamp, &victim)) = self.mem_order.first_key_value() else {
                break;
            };
            if Some(&victim) == keep {
                break;
            }
            self.mem_order.remove(&stamp);
            let Some(e) = self.entries.get_mut(&victim) else {
                continue;
            };
            if let Some(d) = e.mem.take() {
                self.mem_size -= d.len();
            }
            self.mem_evictions += 1;
            if e.loc.is_none() {
                self.remove(&victim);
                self.evictions += 1;
            }
        }
    }

    /// Reclaims disk segments while the files would exceed their limit: the segment with the
    /// least live data goes, its live chunks copied forward first.
    fn reclaim(&mut self) {
        for _ in 0..4 {
            let Some(disk) = self.disk.as_mut() else {
                return;
            };
            if disk.files + disk.store.segment_limit() <= disk.limit {
                return;
            }
            let newest = disk.segs.keys().next_back().copied();
            let Some(victim) = disk
                .segs
                .iter()
                .filter(|(n, _)| Some(**n) != newest)
                .min_by_key(|(_, s)| s.live)
                .map(|(n, _)| *n)
            else {
                return;
            };
            let Some(seg) = disk.segs.remove(&victim) else {
                return;
            };
            disk.files = disk.files.saturating_sub(seg.total);
            let mut lost = Vec::new();
            for f in seg.members {
                let Some(e) = self.entries.get_mut(&f) else {
                    continue;
                };
                if e.loc.is_none_or(|l| l.seg != victim) {
                    continue;
                }
                // Bytes in memory are written again; others are copied by the store itself
                // (a store with a thread of its own does it there, in order).
                e.loc = match (&e.mem, e.loc) {
                    (Some(d), _) => disk.append(&f, d),
                    (None, Some(l)) => disk.copy(l, &f),
                    (None, None) => None,
                };
                self.on_disk -= u64::from(e.loc.is_none());
                disk.moved += 1;
                if e.loc.is_none() && e.mem.is_none() {
                    lost.push(f);
                }
            }
            disk.store.remove_segment(victim);
            disk.reclaimed += 1;
            disk.lost += lost.len() as u64;
            for f in lost {
                self.remove(&f);
            }
        }
    }

    fn remove(&mut self, f: &Fingerprint) {
        if let Some(e) = self.entries.remove(f) {
            self.order.remove(&e.stamp);
            self.size -= e.len;
            if let Some(d) = e.mem {
                self.mem_order.remove(&e.mem_stamp);
                self.mem_size -= d.len();
            }
            self.on_disk -= u64::from(e.loc.is_some());
            if let (Some(loc), Some(disk)) = (e.loc, self.disk.as_mut())
                && let Some(s) = disk.segs.get_mut(&loc.seg)
            {
                s.live = s.live.saturating_sub(loc.stored());
            }
        }
    }

    /// Hands the disk tier's buffered chunks to the operating system, so a state saved next only
    /// names chunks that are in files.
    pub fn flush(&mut self) {
        if let Some(d) = self.disk.as_mut() {
            d.store.flush();
        }
    }

    /// The index as it stands: chunks oldest first, with their disk locations.
    pub fn snapshot(&self) -> Snapshot {
        let entries = self
            .order
            .values()
            .filter_map(|f| {
                let e = self.entries.get(f)?;
                Some(SnapEntry {
                    fingerprint: *f,
                    len: e.len as u32,
                    loc: e.loc,
                })
            })
            .collect();
        Snapshot {
            capacity: self.capacity as u64,
            entries,
        }
    }

    /// The digest of the index (see [`Snapshot::digest`]).
    pub fn digest(&self) -> Fingerprint {
        self.snapshot().digest()
    }

    /// Loads a snapshot into an empty cache of the same capacity: the same chunks in the same
    /// order, so it behaves as the cache it was taken from. Entries whose bytes are not on this
    /// cache's disk tier are left out (the peer's references to them become misses).
    pub fn restore(&mut self, snap: &Snapshot) -> Result<(), SnapshotError> {
        if snap.capacity != self.capacity as u64 || !self.entries.is_empty() {
            return Err(SnapshotError::Mismatch);
        }
        let total: u64 = snap.entries.iter().map(|e| u64::from(e.len)).sum();
        if total > snap.capacity {
            return Err(SnapshotError::Malformed("entries exceed the capacity"));
        }
        for s in &snap.entries {
            let len = s.len as usize;
            let loc = match (&mut self.disk, s.loc) {
                (Some(disk), Some(loc)) => match disk.segs.get_mut(&loc.seg) {
                    Some(seg)
                        if loc
                            .off
                            .checked_add(loc.stored())
                            .is_some_and(|end| end <= seg.total) =>
                    {
                        seg.live += loc.stored();
                        seg.members.push(s.fingerprint);
                        Some(loc)
                    }
                    _ => None,
                },
                _ => None,
            };
            if self.disk.is_some() && loc.is_none() {
                continue;
            }
            if self.entries.contains_key(&s.fingerprint) {
                return Err(SnapshotError::Malformed("a chunk listed twice"));
            }
            self.clock += 1;
            self.size += len;
            self.on_disk += u64::from(loc.is_some());
            self.order.insert(self.clock, s.fingerprint);
            self.entries.insert(
                s.fingerprint,
                Entry {
                    mem: None,
                    loc,
                    len,
                    stamp: self.clock,
                    mem_stamp: self.clock,
                },
            );
        }
        Ok(())
    }

    /// Test hook: damages every chunk held in memory; returns how many.
    #[doc(hidden)]
    pub fn corrupt_all_for_test(&mut self) -> usize {
        for e in self.entries.values_mut() {
            damage(&mut e.mem);
        }
        self.entries.len()
    }

    /// Test hook: damages a chunk held in memory, as a bad disk or memory would.
    #[doc(hidden)]
    pub fn corrupt_for_test(&mut self, f: &Fingerprint) {
        if let Some(e) = self.entries.get_mut(f) {
            damage(&mut e.mem);
        }
    }
}

/// Flips the first byte of a chunk held in memory (a test hook's damage).
fn damage(mem: &mut Option<Bytes>) {
    if let Some(d) = mem.as_mut()
        && !d.is_empty()
    {
        let mut v = d.to_vec();
        v[0] ^= 0xff;
        *d = Bytes::from(v);
    }
}

impl DiskTier {
    fn append(&mut self, f: &Fingerprint, data: &[u8]) -> Option<Loc> {
        let loc = self.store.append(f, data)?;
        self.placed(f, loc);
        Some(loc)
    }

    fn copy(&mut self, from: Loc, f: &Fingerprint) -> Option<Loc> {
        let loc = self.store.copy(from, f)?;
        self.placed(f, loc);
        Some(loc)
    }

    fn placed(&mut self, f: &Fingerprint, loc: Loc) {
        let seg = self.segs.entry(loc.seg).or_default();
        seg.total += loc.stored();
        seg.live += loc.stored();
        seg.members.push(*f);
        self.files += loc.stored();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemStore;

    #[test]
    fn lru_evicts_oldest_and_stays_bounded() {
        let mut c = ChunkCache::new(300);
        let chunks: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i; 100]).collect();
        for ch in &chunks[..3] {
            c.insert(fingerprint(ch), ch.clone());
        }
        c.touch(&fingerprint(&chunks[0]));
        c.insert(fingerprint(&chunks[3]), chunks[3].clone());
        assert!(
            c.contains(&fingerprint(&chunks[0])),
            "recently used survives"
        );
        assert!(!c.contains(&fingerprint(&chunks[1])), "oldest is evicted");
        assert_eq!(c.size(), 300);
        assert_eq!(c.evictions(), 1);
        c.insert([9; 16], vec![0; 1000]);
        assert_eq!(c.size(), 300, "a chunk larger than the cache is not kept");
    }

    #[test]
    fn lazy_recency_moves_only_what_is_not_among_the_newest() {
        // 16 chunks of 100 bytes: the newest eighth is the last two.
        let chunks: Vec<Vec<u8>> = (0..17u8).map(|i| vec![i; 100]).collect();
        let f = |i: usize| fingerprint(&chunks[i]);
        for lazy in [false, true] {
            let mut c = ChunkCache::new(1600);
            if lazy {
                c = c.lazy_recency();
            }
            for (i, ch) in chunks[..16].iter().enumerate() {
                c.insert(f(i), ch.clone());
            }
            // A use of the newest does not move it; one of the oldest does.
            let clock = c.clock;
            c.touch(&f(15));
            assert_eq!(c.clock == clock, lazy);
            c.touch(&f(0));
            c.insert(f(16), chunks[16].clone());
            assert!(c.contains(&f(0)), "the oldest was used: it stays");
            assert!(!c.contains(&f(1)), "the next oldest goes");
            assert_eq!(c.size(), 1600);
        }
    }

    #[test]
    fn damaged_entries_are_misses() {
        let mut c = ChunkCache::new(1000);
        let d = b"replicated redo".to_vec();
        let f = fingerprint(&d);
        c.insert(f, d.clone());
        assert_eq!(c.get(&f), Some(&d[..]));
        c.corrupt_for_test(&f);
        assert_eq!(c.get(&f), None);
        assert!(!c.contains(&f));
        assert_eq!(c.size(), 0);
    }

    fn chunk(i: u32) -> Vec<u8> {
        crate::tests::xorshift(u64::from(i), 2000)
    }

    #[test]
    fn the_disk_tier_holds_what_memory_cannot_within_its_limit() {
        let store = MemStore::new(1 << 20);
        let limit = 8 << 20;
        let mut c = ChunkCache::tiered(100_000, limit, Box::new(store.clone()));
        let mut mirror = ChunkCache::new(c.capacity());
        for round in 0..3 {
            for i in 0..4000 {
                // A working set that fits the disk tier, and a stream of one-off chunks.
                let id = if i % 2 == 0 {
                    i % 1000
                } else {
                    100_000 * (round + 1) + i
                };
                let d = chunk(id);
                let f = fingerprint(&d);
                if mirror.contains(&f) {
                    mirror.touch(&f);
                    assert_eq!(c.get(&f), Some(&d[..]), "round {round} chunk {id}");
                } else {
                    mirror.insert_len(f, d.len());
                    c.insert(f, d);
                }
                assert!(c.tier_stats().mem_bytes <= 100_000);
                assert!(store.bytes() <= limit, "files within the limit");
            }
        }
        let t = c.tier_stats();
        assert!(t.disk_reclaimed > 0 && t.disk_moved > 0, "{t:?}");
        assert_eq!(t.disk_lost, 0);
        assert_eq!(c.digest(), mirror.digest(), "the mirror stays in step");
        assert_eq!(c.evictions(), mirror.evictions());
    }

    #[test]
    fn lost_or_damaged_disk_chunks_are_misses() {
        let store = MemStore::new(1 << 20);
        let mut c = ChunkCache::tiered(0, 16 << 20, Box::new(store.clone()));
        let chunks: Vec<Vec<u8>> = (0..100).map(chunk).collect();
        for d in &chunks {
            c.insert(fingerprint(d), d.clone());
        }
        assert_eq!(c.tier_stats().mem_bytes, 0);
        store.corrupt(7);
        for (i, d) in chunks.iter().enumerate() {
            let got = c.get(&fingerprint(d)).map(<[u8]>::to_vec);
            if i == 7 {
                assert_eq!(got, None);
            } else {
                assert_eq!(got.as_deref(), Some(&d[..]));
            }
        }
        assert_eq!(c.tier_stats().disk_lost, 1);
        assert!(!c.contains(&fingerprint(&chunks[7])));
    }

    #[test]
    fn a_snapshot_restores_the_same_cache_and_rejects_damage() {
        let store = MemStore::new(1 << 20);
        let mut c = ChunkCache::tiered(50_000, 4 << 20, Box::new(store.clone()));
        let mut mirror = ChunkCache::new(c.capacity());
        for i in 0..2000 {
            let d = chunk(i % 700);
            let f = fingerprint(&d);
            if mirror.contains(&f) {
                mirror.touch(&f);
                assert!(c.get(&f).is_some());
            } else {
                mirror.insert_len(f, d.len());
                c.insert(f, d);
            }
        }
        let snap = c.snapshot();
        let bytes = snap.encode();
        assert_eq!(Snapshot::decode(&bytes), Ok(snap.clone()));
        assert_eq!(snap.digest(), mirror.snapshot().digest());

        // Both sides restored: the same digest, and they go on in step.
        let mut c2 = ChunkCache::tiered(50_000, 4 << 20, Box::new(store.clone()));
        c2.restore(&snap).expect("restore");
        let mut m2 = ChunkCache::new(mirror.capacity());
        m2.restore(&Snapshot::decode(&mirror.snapshot().encode()).expect("decode"))
            .expect("restore");
        assert_eq!(c2.digest(), m2.digest());
        for i in 0..300 {
            let d = chunk(i);
            let f = fingerprint(&d);
            if m2.contains(&f) {
                m2.touch(&f);
                assert_eq!(c2.get(&f), Some(&d[..]));
            } else {
                m2.insert_len(f, d.len());
                c2.insert(f, d);
            }
        }
        assert_eq!(c2.digest(), m2.digest());

        // Another capacity is a mismatch; every truncation and flipped bit is an error.
        assert_eq!(
            ChunkCache::new(1000).restore(&snap),
            Err(SnapshotError::Mismatch)
        );
        let small = Snapshot {
            capacity: 100,
            entries: snap.entries[..3].to_vec(),
        }
        .encode();
        for cut in 0..small.len() {
            assert!(Snapshot::decode(&small[..cut]).is_err());
        }
        for at in 0..small.len() {
            let mut bad = small.clone();
            bad[at] ^= 1;
            assert!(Snapshot::decode(&bad).is_err(), "flip at {at}");
        }
    }

    proptest::proptest! {
        #[test]
        fn snapshots_round_trip(
            raw in proptest::collection::vec(
                (proptest::prelude::any::<[u8; 16]>(), 0u32..=1 << 20, proptest::option::of((proptest::prelude::any::<u32>(), proptest::prelude::any::<u64>(), proptest::prelude::any::<u32>()))),
                0..50,
            ),
            extra in 0u64..1 << 40,
        ) {
            let mut seen = std::collections::HashSet::new();
            let entries: Vec<SnapEntry> = raw
                .into_iter()
                .filter(|(f, _, _)| seen.insert(*f))
                .map(|(fingerprint, len, loc)| SnapEntry {
                    fingerprint,
                    len,
                    loc: loc.map(|(seg, off, len)| Loc { seg, off, len }),
                })
                .collect();
            let capacity = entries.iter().map(|e| u64::from(e.len)).sum::<u64>() + extra;
            let snap = Snapshot { capacity, entries };
            proptest::prop_assert_eq!(Snapshot::decode(&snap.encode()), Ok(snap));
        }
    }
}
