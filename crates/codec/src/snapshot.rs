//! A cache's index as both sides save and resume it: its capacity and its chunks in recency
//! order (fingerprint, length, and the decoder's disk location), the digest that tells a mirror
//! and the cache it mirrors are the same, and the checked byte format of the saved file.

use crate::fingerprint::Fingerprint;
use crate::store::Loc;

/// One chunk of a [`Snapshot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapEntry {
    pub fingerprint: Fingerprint,
    pub len: u32,
    pub loc: Option<Loc>,
}

/// A cache's index: its capacity and its chunks, least recently used first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub capacity: u64,
    pub entries: Vec<SnapEntry>,
}

/// A snapshot that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    #[error("malformed cache index: {0}")]
    Malformed(&'static str),
    #[error("cache index does not match this cache")]
    Mismatch,
}

const SNAP_MAGIC: [u8; 8] = *b"WOINDEX1";
const SNAP_ENTRY: usize = 16 + 4 + 1 + 4 + 8 + 4;

impl Snapshot {
    /// What identifies the cache's state on both sides: a hash of the capacity and of every
    /// chunk's fingerprint and length in recency order. Disk locations are the decoder's own and
    /// are left out, so a mirror and the cache it mirrors have the same digest.
    pub fn digest(&self) -> Fingerprint {
        let mut h = blake3::Hasher::new();
        h.update(b"wanopt cache index");
        h.update(&self.capacity.to_be_bytes());
        for e in &self.entries {
            h.update(&e.fingerprint);
            h.update(&e.len.to_be_bytes());
        }
        let mut f = [0u8; 16];
        f.copy_from_slice(&h.finalize().as_bytes()[..16]);
        f
    }

    /// The snapshot as bytes: a header, fixed-size entries and a checksum of everything.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + 8 + 8 + self.entries.len() * SNAP_ENTRY + 32);
        out.extend_from_slice(&SNAP_MAGIC);
        out.extend_from_slice(&self.capacity.to_be_bytes());
        out.extend_from_slice(&(self.entries.len() as u64).to_be_bytes());
        for e in &self.entries {
            out.extend_from_slice(&e.fingerprint);
            out.extend_from_slice(&e.len.to_be_bytes());
            let l = e.loc.unwrap_or(Loc {
                seg: 0,
                off: 0,
                len: 0,
            });
            out.push(u8::from(e.loc.is_some()));
            out.extend_from_slice(&l.seg.to_be_bytes());
            out.extend_from_slice(&l.off.to_be_bytes());
            out.extend_from_slice(&l.len.to_be_bytes());
        }
        let sum = blake3::hash(&out);
        out.extend_from_slice(sum.as_bytes());
        out
    }

    /// Parses [`encode`](Self::encode)'s bytes. Anything damaged, truncated or inconsistent is an
    /// error; the entry count is checked against the length before anything is allocated.
    pub fn decode(buf: &[u8]) -> Result<Snapshot, SnapshotError> {
        const HEAD: usize = 8 + 8 + 8;
        if buf.len() < HEAD + 32 || buf[..8] != SNAP_MAGIC {
            return Err(SnapshotError::Malformed("not a cache index"));
        }
        let (body, sum) = buf.split_at(buf.len() - 32);
        if blake3::hash(body).as_bytes()[..] != sum[..] {
            return Err(SnapshotError::Malformed("checksum mismatch"));
        }
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&body[at..at + 8]);
            u64::from_be_bytes(b)
        };
        let u32_at = |at: usize| {
            let mut b = [0u8; 4];
            b.copy_from_slice(&body[at..at + 4]);
            u32::from_be_bytes(b)
        };
        let capacity = u64_at(8);
        let n = u64_at(16);
        if Some(body.len() - HEAD)
            != usize::try_from(n)
                .ok()
                .and_then(|n| n.checked_mul(SNAP_ENTRY))
        {
            return Err(SnapshotError::Malformed(
                "entry count does not match the length",
            ));
        }
        let mut entries = Vec::with_capacity(n as usize);
        let mut seen =
            crate::fingerprint::FpSet::with_capacity_and_hasher(n as usize, Default::default());
        let mut total = 0u64;
        for i in 0..n as usize {
            let at = HEAD + i * SNAP_ENTRY;
            let mut fingerprint = [0u8; 16];
            fingerprint.copy_from_slice(&body[at..at + 16]);
            let len = u32_at(at + 16);
            total += u64::from(len);
            let loc = match body[at + 20] {
                0 if body[at + 21..at + SNAP_ENTRY].iter().all(|b| *b == 0) => None,
                0 => return Err(SnapshotError::Malformed("location without its flag")),
                1 => Some(Loc {
                    seg: u32_at(at + 21),
                    off: u64_at(at + 25),
                    len: u32_at(at + 33),
                }),
                _ => return Err(SnapshotError::Malformed("bad location flag")),
            };
            if len as usize > crate::format::MAX_RECORD {
                return Err(SnapshotError::Malformed("chunk too large"));
            }
            if !seen.insert(fingerprint) {
                return Err(SnapshotError::Malformed("a chunk listed twice"));
            }
            entries.push(SnapEntry {
                fingerprint,
                len,
                loc,
            });
        }
        if total > capacity {
            return Err(SnapshotError::Malformed("entries exceed the capacity"));
        }
        Ok(Snapshot { capacity, entries })
    }
}
