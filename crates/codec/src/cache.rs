//! The chunk cache, bounded in bytes, with a deterministic least-recently-used policy.
//!
//! Each direction of a link has one cache per side: the sender's encoder keeps a mirror of the
//! receiver's decoder cache. Both apply the same inserts and touches in the same (frame) order, and
//! eviction depends only on that order, so the two stay identical by construction. The mirror keeps
//! only fingerprints and lengths ([`ChunkCache::insert_len`]); the decoder keeps the bytes. Every
//! chunk read back is checked against its fingerprint; a damaged entry is dropped and reported as a
//! miss.

use std::collections::{BTreeMap, HashMap};

/// A chunk fingerprint: the first 16 bytes (128 bits) of its BLAKE3 hash.
pub type Fingerprint = [u8; 16];

/// The fingerprint of `data`.
pub fn fingerprint(data: &[u8]) -> Fingerprint {
    let h = blake3::hash(data);
    let mut f = [0u8; 16];
    f.copy_from_slice(&h.as_bytes()[..16]);
    f
}

#[derive(Debug)]
struct Entry {
    /// The chunk's bytes; `None` in an index-only cache (a mirror).
    data: Option<Vec<u8>>,
    len: usize,
    stamp: u64,
}

/// A byte-bounded LRU map from fingerprint to chunk.
#[derive(Debug)]
pub struct ChunkCache {
    capacity: usize,
    size: usize,
    clock: u64,
    entries: HashMap<Fingerprint, Entry>,
    /// Recency order: stamp -> fingerprint (oldest first).
    order: BTreeMap<u64, Fingerprint>,
    evictions: u64,
}

impl ChunkCache {
    /// A cache holding at most `capacity` bytes of chunk data.
    pub fn new(capacity: usize) -> Self {
        ChunkCache {
            capacity,
            size: 0,
            clock: 0,
            entries: HashMap::new(),
            order: BTreeMap::new(),
            evictions: 0,
        }
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

    /// Chunks evicted so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// True if the chunk is held (does not count as a use).
    pub fn contains(&self, f: &Fingerprint) -> bool {
        self.entries.contains_key(f)
    }

    fn bump(&mut self, f: &Fingerprint) {
        self.clock += 1;
        if let Some(e) = self.entries.get_mut(f) {
            self.order.remove(&e.stamp);
            e.stamp = self.clock;
            self.order.insert(self.clock, *f);
        }
    }

    /// Marks a chunk as used (both sides do this for every reference, in frame order).
    pub fn touch(&mut self, f: &Fingerprint) {
        self.bump(f);
    }

    /// Returns a held chunk after checking it against its fingerprint; a damaged one is removed
    /// and `None` returned (a miss, never wrong data). Counts as a use.
    pub fn get(&mut self, f: &Fingerprint) -> Option<&[u8]> {
        let ok = self
            .entries
            .get(f)
            .map(|e| e.data.as_deref().is_some_and(|d| fingerprint(d) == *f))?;
        if !ok {
            self.remove(f);
            return None;
        }
        self.bump(f);
        self.entries.get(f).and_then(|e| e.data.as_deref())
    }

    /// Returns a held chunk after checking it against its fingerprint, without counting as a use.
    pub fn peek(&self, f: &Fingerprint) -> Option<&[u8]> {
        let d = self.entries.get(f)?.data.as_deref()?;
        (fingerprint(d) == *f).then_some(d)
    }

    /// Inserts a chunk (or refreshes it), evicting the least recently used chunks to fit.
    /// Chunks larger than the whole cache are not kept.
    pub fn insert(&mut self, f: Fingerprint, data: Vec<u8>) {
        let len = data.len();
        self.put(f, Some(data), len);
    }

    /// Like [`insert`](Self::insert) for an index-only cache: the chunk's length, not its bytes.
    pub fn insert_len(&mut self, f: Fingerprint, len: usize) {
        self.put(f, None, len);
    }

    fn put(&mut self, f: Fingerprint, data: Option<Vec<u8>>, len: usize) {
        if self.entries.contains_key(&f) {
            self.bump(&f);
            return;
        }
        if len > self.capacity {
            return;
        }
        while self.size + len > self.capacity {
            let Some((_, victim)) = self.order.pop_first() else {
                break;
            };
            if let Some(e) = self.entries.remove(&victim) {
                self.size -= e.len;
                self.evictions += 1;
            }
        }
        self.clock += 1;
        self.size += len;
        self.order.insert(self.clock, f);
        self.entries.insert(
            f,
            Entry {
                data,
                len,
                stamp: self.clock,
            },
        );
        debug_assert!(self.size <= self.capacity);
    }

    fn remove(&mut self, f: &Fingerprint) {
        if let Some(e) = self.entries.remove(f) {
            self.order.remove(&e.stamp);
            self.size -= e.len;
        }
    }

    /// Test hook: damages every held chunk in place; returns how many.
    #[doc(hidden)]
    pub fn corrupt_all_for_test(&mut self) -> usize {
        for e in self.entries.values_mut() {
            if let Some(b) = e.data.as_mut().and_then(|d| d.first_mut()) {
                *b ^= 0xff;
            }
        }
        self.entries.len()
    }

    /// Test hook: damages a held chunk in place, as a bad disk or memory would.
    #[doc(hidden)]
    pub fn corrupt_for_test(&mut self, f: &Fingerprint) {
        if let Some(e) = self.entries.get_mut(f)
            && let Some(b) = e.data.as_mut().and_then(|d| d.first_mut())
        {
            *b ^= 0xff;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
