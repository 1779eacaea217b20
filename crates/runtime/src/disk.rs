//! Storage for the cache's disk tier: chunks appended to segment files in one directory (mode
//! 0700, files 0600), optionally encrypted at rest with AES-256-GCM: then each segment's records
//! are sealed under a key of their own and their headers hold a keyed tag of the fingerprint,
//! not the fingerprint (see [`crate::atrest`]). Every chunk read back is checked against its
//! fingerprint: a damaged, truncated, missing or wrongly keyed record reads as `None` (a miss),
//! never as data.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use ring::aead::{Aad, LessSafeKey, NONCE_LEN, Nonce};

use crate::atrest::{AtRest, SALT_LEN, TAG_LEN};
use crate::secure::no_follow;
use wanopt_codec::MAX_RECORD;
use wanopt_codec::cache::{Fingerprint, fingerprint};
pub use wanopt_codec::store::Loc;
use wanopt_codec::store::{ChunkStore, RECORD_HEADER};

/// A record in clear.
const MAGIC: [u8; 4] = *b"WOC1";
/// A sealed record, whose header holds the fingerprint's keyed tag.
const SEALED_MAGIC: [u8; 4] = *b"WOC2";
/// Record header: magic, fingerprint (or its tag), stored length.
const HEADER: usize = RECORD_HEADER as usize;
/// The file beside an encrypted store's segments that holds the salt of their keys.
pub const SALT_FILE: &str = "segments.salt";

/// A disk store that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("cache directory {0}: {1}")]
    Dir(PathBuf, std::io::Error),
    #[error("cache segment {0}: {1}")]
    Segment(PathBuf, std::io::Error),
    #[error("chunk of {0} bytes exceeds the limit")]
    TooLarge(usize),
    #[error("encryption failed")]
    Crypto,
}

/// The keys of an encrypted store: the cache key's, and the salt of its segments' keys.
struct Sealing {
    rest: AtRest,
    salt: [u8; SALT_LEN],
    /// The key of the segment being written.
    writing: Option<(u32, LessSafeKey)>,
}

impl Sealing {
    fn key(&mut self, seg: u32) -> &LessSafeKey {
        if self.writing.as_ref().is_none_or(|(n, _)| *n != seg) {
            self.writing = Some((seg, self.rest.segment_key(&self.salt, seg)));
        }
        match &self.writing {
            Some((_, k)) => k,
            None => unreachable!("set above"),
        }
    }
}

/// Append-only segment files of chunks.
pub struct DiskStore {
    dir: PathBuf,
    sealing: Option<Sealing>,
    seg_bytes: u64,
    /// The segment being appended to: number, file, length.
    current: Option<(u32, File, u64)>,
    next_seg: u32,
    /// Open segments for reading, with their keys when encrypted.
    readers: std::collections::HashMap<u32, (File, Option<LessSafeKey>)>,
    /// Records appended to the current segment but not yet written.
    buf: Vec<u8>,
}

/// Bytes of records gathered before they are written: one write per this many, not per chunk.
pub const WRITE_BUFFER: usize = 1 << 20;

impl std::fmt::Debug for DiskStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskStore")
            .field("dir", &self.dir)
            .field("encrypted", &self.sealing.is_some())
            .finish()
    }
}

fn seg_name(n: u32) -> String {
    format!("seg-{n:08}.dat")
}

impl DiskStore {
    /// Opens (creating) the store in `dir`; new segments roll over at `seg_bytes`. With `key`,
    /// chunks are encrypted at rest. Segment numbers continue after the highest one present.
    /// An encrypted store takes a new salt when it has no segments (so a segment number used
    /// again gets a new key) or its salt is gone (then its segments read as misses).
    pub fn open(dir: &Path, key: Option<[u8; 32]>, seg_bytes: u64) -> Result<Self, DiskError> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| DiskError::Dir(dir.to_path_buf(), e))?;
        let mut next = 0u32;
        for e in std::fs::read_dir(dir).map_err(|e| DiskError::Dir(dir.to_path_buf(), e))? {
            let name = e
                .map_err(|e| DiskError::Dir(dir.to_path_buf(), e))?
                .file_name();
            if let Some(n) = name.to_str().and_then(seg_number) {
                next = next.max(n.saturating_add(1));
            }
        }
        let sealing = match key {
            Some(k) => {
                let rest = AtRest::new(k);
                let salt = salt(dir, &rest, next > 0)?;
                Some(Sealing {
                    rest,
                    salt,
                    writing: None,
                })
            }
            None => None,
        };
        Ok(DiskStore {
            dir: dir.to_path_buf(),
            sealing,
            seg_bytes: seg_bytes.max(1 << 20),
            current: None,
            next_seg: next,
            readers: std::collections::HashMap::new(),
            buf: Vec::with_capacity(WRITE_BUFFER + MAX_RECORD),
        })
    }

    fn path(&self, seg: u32) -> PathBuf {
        self.dir.join(seg_name(seg))
    }

    /// Appends a chunk; returns where it went. Records gather in a buffer that is written when it
    /// holds [`WRITE_BUFFER`] bytes, when the segment rolls over, on [`flush`](Self::flush), and
    /// before a read that needs them.
    pub fn append(&mut self, f: &Fingerprint, data: &[u8]) -> Result<Loc, DiskError> {
        if data.len() > MAX_RECORD {
            return Err(DiskError::TooLarge(data.len()));
        }
        let body_len = self.body_len(data);
        let full = self
            .current
            .as_ref()
            .is_none_or(|(_, _, len)| *len + (HEADER + body_len) as u64 > self.seg_bytes);
        if full {
            self.open_segment(self.next_seg)?;
        }
        let Some((seg, _, len)) = self.current.as_ref() else {
            return Err(DiskError::Crypto);
        };
        let (seg, off) = (*seg, *len);
        self.write_record(f, data, body_len)?;
        Ok(Loc {
            seg,
            off,
            len: body_len as u32,
        })
    }

    /// Makes `seg` the segment appended to (after writing out the current one's buffer),
    /// creating its file (0600) or continuing at its end.
    fn open_segment(&mut self, seg: u32) -> Result<(), DiskError> {
        self.flush()?;
        let p = self.path(seg);
        let file = no_follow()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&p)
            .map_err(|e| DiskError::Segment(p.clone(), e))?;
        let len = file
            .metadata()
            .map_err(|e| DiskError::Segment(p.clone(), e))?
            .len();
        self.next_seg = self.next_seg.max(seg.saturating_add(1));
        self.current = Some((seg, file, len));
        Ok(())
    }

    fn body_len(&self, data: &[u8]) -> usize {
        data.len()
            + if self.sealing.is_some() {
                NONCE_LEN + TAG_LEN
            } else {
                0
            }
    }

    /// Writes a chunk where a planner chose to put it (see `async_store::Layout`): the segment is
    /// opened if it is not the current one, and the record must go where that segment ends.
    pub fn write_at(&mut self, loc: Loc, f: &Fingerprint, data: &[u8]) -> Result<(), DiskError> {
        if data.len() > MAX_RECORD {
            return Err(DiskError::TooLarge(data.len()));
        }
        let body_len = self.body_len(data);
        if self.current.as_ref().map(|c| c.0) != Some(loc.seg) {
            self.open_segment(loc.seg)?;
        }
        let end = self.current.as_ref().map_or(0, |c| c.2);
        if end != loc.off || body_len != loc.len as usize {
            return Err(DiskError::Segment(
                self.path(loc.seg),
                std::io::Error::other("record out of place"),
            ));
        }
        self.write_record(f, data, body_len)
    }

    /// Appends a record to the current segment's write buffer.
    fn write_record(
        &mut self,
        f: &Fingerprint,
        data: &[u8],
        body_len: usize,
    ) -> Result<(), DiskError> {
        let at = self.buf.len();
        let seg = self.current.as_ref().map_or(0, |c| c.0);
        match &mut self.sealing {
            None => {
                self.buf.extend_from_slice(&MAGIC);
                self.buf.extend_from_slice(f);
                self.buf.extend_from_slice(&(body_len as u32).to_be_bytes());
                self.buf.extend_from_slice(data);
            }
            Some(sealing) => {
                self.buf.extend_from_slice(&SEALED_MAGIC);
                self.buf.extend_from_slice(&sealing.rest.tag(f));
                self.buf.extend_from_slice(&(body_len as u32).to_be_bytes());
                let sealed = sealing.rest.random::<NONCE_LEN>().ok().and_then(|nonce| {
                    self.buf.extend_from_slice(&nonce);
                    let from = self.buf.len();
                    self.buf.extend_from_slice(data);
                    sealing
                        .key(seg)
                        .seal_in_place_separate_tag(
                            Nonce::assume_unique_for_key(nonce),
                            Aad::from(aad(f, data.len())),
                            &mut self.buf[from..],
                        )
                        .ok()
                });
                let Some(tag) = sealed else {
                    self.buf.truncate(at);
                    return Err(DiskError::Crypto);
                };
                self.buf.extend_from_slice(tag.as_ref());
            }
        }
        if let Some((_, _, len)) = self.current.as_mut() {
            *len += (HEADER + body_len) as u64;
        }
        if self.buf.len() >= WRITE_BUFFER {
            self.flush()?;
        }
        Ok(())
    }

    /// Writes the buffered records to their segment file (to the page cache; see [`sync`](Self::sync)).
    pub fn flush(&mut self) -> Result<(), DiskError> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let Some((seg, file, _)) = self.current.as_mut() else {
            self.buf.clear();
            return Ok(());
        };
        let r = file.write_all(&self.buf);
        self.buf.clear();
        r.map_err(|e| DiskError::Segment(self.dir.join(seg_name(*seg)), e))
    }

    /// Reads a chunk back, or `None` if it is missing, damaged or not the chunk of `f`.
    pub fn read(&mut self, loc: Loc, f: &Fingerprint) -> Option<Vec<u8>> {
        if self.current.as_ref().is_some_and(|(n, _, _)| *n == loc.seg) && !self.buf.is_empty() {
            self.flush().ok()?;
        }
        if !self.readers.contains_key(&loc.seg) {
            // A handful of open segments at a time is plenty: reads cluster in recent ones.
            if self.readers.len() >= 16 {
                self.readers.clear();
            }
            let file = no_follow().read(true).open(self.path(loc.seg)).ok()?;
            let key = self
                .sealing
                .as_ref()
                .map(|s| s.rest.segment_key(&s.salt, loc.seg));
            self.readers.insert(loc.seg, (file, key));
        }
        let (file, key) = self.readers.get(&loc.seg)?;
        self.read_in(file, key.as_ref(), loc, f)
    }

    fn read_in(
        &self,
        file: &File,
        key: Option<&LessSafeKey>,
        loc: Loc,
        f: &Fingerprint,
    ) -> Option<Vec<u8>> {
        let max = MAX_RECORD
            + if self.sealing.is_some() {
                NONCE_LEN + TAG_LEN
            } else {
                0
            };
        if loc.len as usize > max {
            return None;
        }
        let mut hdr = [0u8; HEADER];
        file.read_exact_at(&mut hdr, loc.off).ok()?;
        let stored = u32::from_be_bytes([hdr[20], hdr[21], hdr[22], hdr[23]]);
        let (magic, named) = match &self.sealing {
            None => (MAGIC, *f),
            Some(s) => (SEALED_MAGIC, s.rest.tag(f)),
        };
        if hdr[..4] != magic || hdr[4..20] != named[..] || stored != loc.len {
            return None;
        }
        let mut body = vec![0u8; loc.len as usize];
        file.read_exact_at(&mut body, loc.off + HEADER as u64)
            .ok()?;
        let data = match key {
            None if self.sealing.is_none() => body,
            None => return None,
            Some(k) => {
                if body.len() < NONCE_LEN + TAG_LEN {
                    return None;
                }
                let mut nonce = [0u8; NONCE_LEN];
                nonce.copy_from_slice(&body[..NONCE_LEN]);
                let mut ct = body[NONCE_LEN..].to_vec();
                let n = ct.len() - TAG_LEN;
                k.open_in_place(
                    Nonce::assume_unique_for_key(nonce),
                    Aad::from(aad(f, n)),
                    &mut ct,
                )
                .ok()?;
                ct.truncate(n);
                ct
            }
        };
        (fingerprint(&data) == *f).then_some(data)
    }

    /// Flushes every segment to stable storage, so an index written afterwards only names chunks
    /// that survive a crash.
    pub fn sync(&mut self) -> Result<(), DiskError> {
        self.flush()?;
        for (n, _) in ChunkStore::segments(self) {
            let p = self.path(n);
            if let Ok(f) = no_follow().read(true).open(&p) {
                f.sync_all().map_err(|e| DiskError::Segment(p, e))?;
            }
        }
        Ok(())
    }

    /// Deletes a segment (all its chunks read as misses from then on).
    pub fn remove_segment(&mut self, seg: u32) {
        if self.current.as_ref().is_some_and(|(n, _, _)| *n == seg) {
            self.current = None;
        }
        self.readers.remove(&seg);
        let _ = std::fs::remove_file(self.path(seg));
    }
}

impl Drop for DiskStore {
    fn drop(&mut self) {
        let _ = self.flush();
    }
}

impl ChunkStore for DiskStore {
    fn append(&mut self, f: &Fingerprint, data: &[u8]) -> Option<Loc> {
        DiskStore::append(self, f, data).ok()
    }

    fn read(&mut self, loc: Loc, f: &Fingerprint) -> Option<Vec<u8>> {
        DiskStore::read(self, loc, f)
    }

    fn flush(&mut self) {
        let _ = DiskStore::flush(self);
    }

    fn remove_segment(&mut self, seg: u32) {
        DiskStore::remove_segment(self, seg);
    }

    fn segments(&self) -> Vec<(u32, u64)> {
        segments_in(&self.dir)
    }

    fn segment_limit(&self) -> u64 {
        self.seg_bytes
    }
}

/// The segment files in `dir` and their sizes, by number.
pub fn segments_in(dir: &Path) -> Vec<(u32, u64)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<(u32, u64)> = entries
        .flatten()
        .filter_map(|e| {
            let n = seg_number(e.file_name().to_str()?)?;
            Some((n, e.metadata().ok()?.len()))
        })
        .collect();
    v.sort_unstable();
    v
}

fn seg_number(name: &str) -> Option<u32> {
    name.strip_prefix("seg-")?
        .strip_suffix(".dat")?
        .parse::<u32>()
        .ok()
}

/// The salt of an encrypted store's segment keys: the one in [`SALT_FILE`] while segments
/// written under it remain (`kept`), else a new one, written (0600, synced) before any segment
/// uses it.
fn salt(dir: &Path, rest: &AtRest, kept: bool) -> Result<[u8; SALT_LEN], DiskError> {
    let p = dir.join(SALT_FILE);
    if kept {
        let mut salt = [0u8; SALT_LEN];
        let read = no_follow().read(true).open(&p).and_then(|f| {
            let n = f.metadata()?.len();
            if n != SALT_LEN as u64 {
                return Err(std::io::Error::other("not a salt"));
            }
            f.read_exact_at(&mut salt, 0)
        });
        match read {
            Ok(()) => return Ok(salt),
            Err(e) => tracing::warn!(
                file = %p.display(),
                error = %e,
                "the salt of the cache's segment keys is unreadable; the chunks stored under it read as misses"
            ),
        }
    }
    let salt: [u8; SALT_LEN] = rest.random().map_err(|_| DiskError::Crypto)?;
    let tmp = dir.join(format!(".{SALT_FILE}.tmp"));
    let write = || -> std::io::Result<()> {
        let _ = std::fs::remove_file(&tmp);
        let mut f = no_follow()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&salt)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &p)?;
        no_follow().read(true).open(dir)?.sync_all()
    };
    write().map_err(|e| DiskError::Segment(p.clone(), e))?;
    Ok(salt)
}

fn aad(f: &Fingerprint, len: usize) -> [u8; 20] {
    let mut a = [0u8; 20];
    a[..16].copy_from_slice(f);
    a[16..].copy_from_slice(&(len as u32).to_be_bytes());
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn chunk(i: u8, len: usize) -> Vec<u8> {
        (0..len).map(|j| (j as u8).wrapping_mul(31) ^ i).collect()
    }

    #[test]
    fn chunks_round_trip_plain_and_encrypted_in_private_files() {
        for key in [None, Some([7u8; 32])] {
            let dir = tempfile::tempdir().expect("tempdir");
            let mut s = DiskStore::open(&dir.path().join("cache"), key, 1 << 20).expect("open");
            let mut locs = Vec::new();
            for i in 0..300u16 {
                let d = chunk(i as u8, 4000 + i as usize);
                let f = fingerprint(&d);
                locs.push((s.append(&f, &d).expect("append"), f, d));
            }
            for (loc, f, d) in &locs {
                assert_eq!(s.read(*loc, f).as_deref(), Some(&d[..]));
            }
            assert!(locs.iter().any(|(l, _, _)| l.seg > 0), "segments roll over");
            let meta = std::fs::metadata(dir.path().join("cache").join(seg_name(0))).expect("seg");
            assert_eq!(meta.permissions().mode() & 0o777, 0o600);
            let dmeta = std::fs::metadata(dir.path().join("cache")).expect("dir");
            assert_eq!(dmeta.permissions().mode() & 0o777, 0o700);
            // The bytes on disk are not the chunk's when encrypted.
            let raw = std::fs::read(dir.path().join("cache").join(seg_name(0))).expect("raw");
            let first = &locs[0].2;
            let found = raw.windows(64).any(|w| w == &first[..64]);
            assert_eq!(found, key.is_none());
            // Nor are the fingerprints (a keyed tag stands in their place).
            let named = locs
                .iter()
                .filter(|(_, f, _)| raw.windows(16).any(|w| w == &f[..]))
                .count();
            let in_seg0 = locs.iter().filter(|(l, _, _)| l.seg == 0).count();
            assert_eq!(named, if key.is_some() { 0 } else { in_seg0 });
            // A reopened store appends after the existing segments.
            drop(s);
            let mut s = DiskStore::open(&dir.path().join("cache"), key, 1 << 20).expect("reopen");
            let d = chunk(9, 100);
            let loc = s.append(&fingerprint(&d), &d).expect("append");
            assert!(loc.seg > locs.last().map_or(0, |l| l.0.seg));
            assert_eq!(
                s.read(locs[5].0, &locs[5].1).as_deref(),
                Some(&locs[5].2[..])
            );
        }
    }

    /// An encrypted store's segment keys take a salt of their own: kept while its segments
    /// last, new for a store that has none (so a segment number used again gets a new key).
    /// Without the salt, its segments read as misses, never as data.
    #[test]
    fn segment_keys_are_salted_per_store() {
        let dir = tempfile::tempdir().expect("tempdir");
        let key = Some([6u8; 32]);
        let salt_of = || std::fs::read(dir.path().join(SALT_FILE)).expect("salt");
        let mut s = DiskStore::open(dir.path(), key, 1 << 20).expect("open");
        let first = salt_of();
        assert_eq!(first.len(), SALT_LEN);
        let mode = std::fs::metadata(dir.path().join(SALT_FILE))
            .expect("salt")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let d = chunk(3, 5000);
        let f = fingerprint(&d);
        let loc = s.append(&f, &d).expect("append");
        drop(s);
        let mut s = DiskStore::open(dir.path(), key, 1 << 20).expect("reopen");
        assert_eq!(salt_of(), first, "kept while its segments are");
        assert_eq!(s.read(loc, &f).as_deref(), Some(&d[..]));
        drop(s);
        std::fs::remove_file(dir.path().join(SALT_FILE)).expect("rm");
        let mut s = DiskStore::open(dir.path(), key, 1 << 20).expect("reopen");
        assert_eq!(s.read(loc, &f), None, "no salt, no chunk");
        assert_ne!(salt_of(), first);
        s.remove_segment(loc.seg);
        drop(s);
        let emptied = salt_of();
        let _s = DiskStore::open(dir.path(), key, 1 << 20).expect("reopen");
        assert_ne!(
            salt_of(),
            emptied,
            "a store without segments starts a new salt"
        );
    }

    #[test]
    fn damage_of_any_kind_reads_as_a_miss() {
        let dir = tempfile::tempdir().expect("tempdir");
        let key = Some([3u8; 32]);
        let mut s = DiskStore::open(dir.path(), key, 1 << 20).expect("open");
        let d = chunk(1, 8192);
        let f = fingerprint(&d);
        let loc = s.append(&f, &d).expect("append");
        let d2 = chunk(2, 8192);
        let f2 = fingerprint(&d2);
        let loc2 = s.append(&f2, &d2).expect("append");
        // The wrong fingerprint, a wrong length, a wrong key.
        assert_eq!(s.read(loc, &f2), None);
        assert_eq!(
            s.read(
                Loc {
                    len: loc.len + 1,
                    ..loc
                },
                &f
            ),
            None
        );
        assert_eq!(
            s.read(
                Loc {
                    len: u32::MAX,
                    ..loc
                },
                &f
            ),
            None,
            "no huge allocation"
        );
        s.flush().expect("flush");
        let mut other = DiskStore::open(dir.path(), Some([4u8; 32]), 1 << 20).expect("open");
        assert_eq!(other.read(loc, &f), None);
        let mut plain = DiskStore::open(dir.path(), None, 1 << 20).expect("open");
        assert_eq!(plain.read(loc, &f), None);
        // A flipped bit anywhere in the record.
        let p = dir.path().join(seg_name(loc.seg));
        let good = std::fs::read(&p).expect("read");
        for at in [0, 10, 30, 100, 5000, (loc.len as usize + HEADER) - 1] {
            let mut bad = good.clone();
            bad[at] ^= 0x10;
            std::fs::write(&p, &bad).expect("write");
            assert_eq!(s.read(loc, &f), None, "flip at {at}");
            assert_eq!(
                s.read(loc2, &f2).as_deref(),
                Some(&d2[..]),
                "others unharmed"
            );
        }
        // Truncated, then missing.
        std::fs::write(&p, &good[..good.len() - 10]).expect("write");
        assert_eq!(s.read(loc2, &f2), None);
        s.remove_segment(loc.seg);
        assert_eq!(s.read(loc, &f), None);
    }

    #[test]
    fn a_tiered_cache_on_disk_survives_a_restart_and_reads_damage_as_misses() {
        use wanopt_codec::cache::ChunkCache;
        let dir = tempfile::tempdir().expect("tempdir");
        let open = || {
            let s = DiskStore::open(dir.path(), Some([5u8; 32]), 1 << 20).expect("open");
            Box::new(s)
        };
        let chunks: Vec<Vec<u8>> = (0..400u16)
            .map(|i| chunk(i as u8 ^ (i >> 8) as u8, 3000 + i as usize))
            .collect();
        let mut c = ChunkCache::tiered(64 * 1024, 32 << 20, open());
        for d in &chunks {
            c.insert(fingerprint(d), d.clone());
        }
        let snap = c.snapshot();
        drop(c);
        // Damage one record on disk, then restart.
        let loc = snap.entries[10].loc.expect("on disk");
        let p = dir.path().join(seg_name(loc.seg));
        let mut raw = std::fs::read(&p).expect("read");
        raw[(loc.off + loc.stored()) as usize - 1] ^= 1;
        std::fs::write(&p, raw).expect("write");
        let mut c = ChunkCache::tiered(64 * 1024, 32 << 20, open());
        c.restore(&snap).expect("restore");
        assert_eq!(c.digest(), snap.digest());
        for (i, d) in chunks.iter().enumerate() {
            let f = fingerprint(d);
            let got = c.get(&f).map(<[u8]>::to_vec);
            assert_eq!(got.is_some(), i != 10, "chunk {i}");
            if let Some(g) = got {
                assert_eq!(g, *d);
            }
        }
    }
}
