//! Where a two-tier cache keeps chunk bytes beyond memory: the [`ChunkStore`] trait, so the cache
//! itself stays free of I/O. The daemon's store (segment files, written and read on a thread of
//! their own) is the runtime's; tests use [`MemStore`], which they can damage at will. A store appends chunks to numbered segments,
//! reads them back verified, and deletes whole segments.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Poll;

use crate::fingerprint::{Fingerprint, fingerprint};

/// Bytes a store spends on each record besides the stored body.
pub const RECORD_HEADER: u64 = 24;

/// Where a chunk was stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Loc {
    pub seg: u32,
    pub off: u64,
    /// Bytes stored after the record header (nonce and tag included when encrypted).
    pub len: u32,
}

impl Loc {
    /// Bytes the record takes in its segment.
    pub fn stored(&self) -> u64 {
        RECORD_HEADER + u64::from(self.len)
    }
}

/// Segmented chunk storage. Reads are verified: a damaged, missing or foreign record is `None`.
pub trait ChunkStore: Send {
    /// Appends a chunk to the newest segment (starting a new one when it is full); `None` if it
    /// could not be stored.
    fn append(&mut self, f: &Fingerprint, data: &[u8]) -> Option<Loc>;
    /// Reads a chunk back, checked against its fingerprint.
    fn read(&mut self, loc: Loc, f: &Fingerprint) -> Option<Vec<u8>>;
    /// Reads without blocking: `Ready(Some)` is the verified chunk, `Ready(None)` a lost or
    /// damaged one, `Pending` means the store is fetching it (ask again once it says it has
    /// it). The default is the blocking [`read`](Self::read), for stores in memory.
    fn try_read(&mut self, loc: Loc, f: &Fingerprint) -> Poll<Option<Vec<u8>>> {
        Poll::Ready(self.read(loc, f))
    }
    /// Copies a stored chunk to the newest segment (reclaiming an old one); the default reads
    /// it and appends it. `None` if it could not be read or stored.
    fn copy(&mut self, loc: Loc, f: &Fingerprint) -> Option<Loc> {
        let data = self.read(loc, f)?;
        self.append(f, &data)
    }
    /// Deletes a segment.
    fn remove_segment(&mut self, seg: u32);
    /// Hands buffered records to the operating system (before a saved state names them).
    fn flush(&mut self) {}
    /// The segments present and their sizes in bytes.
    fn segments(&self) -> Vec<(u32, u64)>;
    /// The size at which a segment is full.
    fn segment_limit(&self) -> u64;
}

/// A store shared between the links that use it one after another (a reconnect).
impl<T: ChunkStore> ChunkStore for Arc<Mutex<T>> {
    fn append(&mut self, f: &Fingerprint, data: &[u8]) -> Option<Loc> {
        self.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .append(f, data)
    }
    fn read(&mut self, loc: Loc, f: &Fingerprint) -> Option<Vec<u8>> {
        self.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .read(loc, f)
    }
    fn try_read(&mut self, loc: Loc, f: &Fingerprint) -> Poll<Option<Vec<u8>>> {
        self.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .try_read(loc, f)
    }
    fn copy(&mut self, loc: Loc, f: &Fingerprint) -> Option<Loc> {
        self.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .copy(loc, f)
    }
    fn remove_segment(&mut self, seg: u32) {
        self.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove_segment(seg);
    }
    fn flush(&mut self) {
        self.lock().unwrap_or_else(PoisonError::into_inner).flush();
    }
    fn segments(&self) -> Vec<(u32, u64)> {
        self.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .segments()
    }
    fn segment_limit(&self) -> u64 {
        self.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .segment_limit()
    }
}

#[derive(Debug, Default)]
struct MemInner {
    /// Segment -> records (fingerprint, bytes) by their offset in the segment.
    segs: BTreeMap<u32, BTreeMap<u64, (Fingerprint, Vec<u8>)>>,
    sizes: BTreeMap<u32, u64>,
    next: u32,
}

/// A store in memory, for tests: cloning it gives another handle to the same chunks, as a
/// restarted daemon finds its files again.
#[derive(Debug, Clone)]
pub struct MemStore {
    inner: Arc<Mutex<MemInner>>,
    seg_limit: u64,
}

impl MemStore {
    pub fn new(seg_limit: u64) -> Self {
        MemStore {
            inner: Arc::default(),
            seg_limit,
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut MemInner) -> R) -> R {
        f(&mut self.inner.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Bytes held in all segments.
    pub fn bytes(&self) -> u64 {
        self.with(|m| m.sizes.values().sum())
    }

    /// Damages the `n`th record ever stored (counting across segments, oldest first).
    pub fn corrupt(&self, n: usize) {
        self.with(|m| {
            if let Some((_, d)) = m.segs.values_mut().flat_map(|s| s.values_mut()).nth(n)
                && let Some(b) = d.first_mut()
            {
                *b ^= 0x5a;
            }
        });
    }

    /// Damages every record.
    pub fn corrupt_all(&self) {
        self.with(|m| {
            for (_, d) in m.segs.values_mut().flat_map(|s| s.values_mut()) {
                if let Some(b) = d.first_mut() {
                    *b ^= 0x5a;
                }
            }
        });
    }
}

impl ChunkStore for MemStore {
    fn append(&mut self, f: &Fingerprint, data: &[u8]) -> Option<Loc> {
        let limit = self.seg_limit;
        self.with(|m| {
            let stored = RECORD_HEADER + data.len() as u64;
            let cur = m.segs.keys().next_back().copied().filter(|n| {
                m.sizes.get(n).is_some_and(|s| s + stored <= limit) && *n + 1 == m.next
            });
            let seg = match cur {
                Some(n) => n,
                None => {
                    let n = m.next;
                    m.next += 1;
                    m.segs.insert(n, BTreeMap::new());
                    n
                }
            };
            let size = m.sizes.entry(seg).or_default();
            let off = *size;
            *size += stored;
            m.segs.get_mut(&seg)?.insert(off, (*f, data.to_vec()));
            Some(Loc {
                seg,
                off,
                len: data.len() as u32,
            })
        })
    }

    fn read(&mut self, loc: Loc, f: &Fingerprint) -> Option<Vec<u8>> {
        self.with(|m| {
            let (rf, d) = m.segs.get(&loc.seg)?.get(&loc.off)?;
            (rf == f && d.len() == loc.len as usize && fingerprint(d) == *f).then(|| d.clone())
        })
    }

    fn remove_segment(&mut self, seg: u32) {
        self.with(|m| {
            m.segs.remove(&seg);
            m.sizes.remove(&seg);
        });
    }

    fn segments(&self) -> Vec<(u32, u64)> {
        self.with(|m| m.sizes.iter().map(|(n, s)| (*n, *s)).collect())
    }

    fn segment_limit(&self) -> u64 {
        self.seg_limit
    }
}
