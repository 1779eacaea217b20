//! The chunk caches' home on disk, under `state_dir/cache/<peer>`: one directory per cache and
//! side (`decoder-<lane>-<scope>` holds our decoder's segment files and saved states,
//! `mirror-<lane>-<scope>` the saved states of our mirror of the peer's cache). It implements the
//! protocol core's [`CacheStorage`], and writes the states the link asks to save, flushing a
//! decoder's segments before its state names them, so a crash never leaves a state that points at
//! unwritten chunks. Everything read back is verified: a damaged state is skipped with a warning.
//! With a cache key, saved states are sealed whole (see [`crate::atrest`]): they list the
//! fingerprints of every chunk the cache holds.

use std::collections::{HashMap, HashSet};
use std::fs::{DirBuilder, File};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tracing::{info, warn};
use wanopt_codec::cache::segment_size;
use wanopt_proto::coding::Fingerprint;
use wanopt_proto::{
    CacheStorage, ChunkStore, CodecSettings, Role, SavedCache, SavedState, Snapshot,
};

use crate::async_store::AsyncStore;
use crate::config::valid_name;
use crate::secure::no_follow;

/// Saved states kept per cache: the newest few, so a side that missed the last one can still
/// agree on an earlier one with its peer. A mirror's states are small and saved at once, while
/// the decoder's wait for its segments to reach the disk, so the mirror side keeps more.
const KEEP_DECODER_STATES: usize = 3;
/// Longest a blocking [`CacheDir::store_wait`] waits for a read (a read takes well under a
/// millisecond from the page cache, tens from a busy disk).
const STORE_WAIT: Duration = Duration::from_millis(50);
const KEEP_MIRROR_STATES: usize = wanopt_proto::frame::MAX_DIGESTS;

/// The cache directory of a service no longer configured goes after this long untouched (a
/// service renamed or removed for good; one back within it resumes its cache).
pub const STALE_AFTER: Duration = Duration::from_secs(7 * 24 * 3600);

fn keep(role: Role) -> usize {
    match role {
        Role::Decoder => KEEP_DECODER_STATES,
        Role::Mirror => KEEP_MIRROR_STATES,
    }
}
/// Directories of delta bases' disk tiers start with this (see [`CacheDir::bases_store`]).
const BASES_DIR: &str = "bases";

/// A store whose files are of use only while it lives: its directory goes with it, removed on
/// the store's own thread after everything queued before.
struct ScratchStore {
    store: AsyncStore,
    dir: PathBuf,
}

impl Drop for ScratchStore {
    fn drop(&mut self) {
        let dir = std::mem::take(&mut self.dir);
        self.store.run_after(Box::new(move || {
            let _ = std::fs::remove_dir_all(dir);
        }));
    }
}

impl ChunkStore for ScratchStore {
    fn append(&mut self, f: &Fingerprint, data: &[u8]) -> Option<wanopt_codec::store::Loc> {
        self.store.append(f, data)
    }
    fn read(&mut self, loc: wanopt_codec::store::Loc, f: &Fingerprint) -> Option<Vec<u8>> {
        self.store.read(loc, f)
    }
    fn try_read(
        &mut self,
        loc: wanopt_codec::store::Loc,
        f: &Fingerprint,
    ) -> std::task::Poll<Option<Vec<u8>>> {
        self.store.try_read(loc, f)
    }
    fn copy(
        &mut self,
        loc: wanopt_codec::store::Loc,
        f: &Fingerprint,
    ) -> Option<wanopt_codec::store::Loc> {
        self.store.copy(loc, f)
    }
    fn remove_segment(&mut self, seg: u32) {
        self.store.remove_segment(seg);
    }
    fn flush(&mut self) {
        self.store.flush();
    }
    fn segments(&self) -> Vec<(u32, u64)> {
        self.store.segments()
    }
    fn segment_limit(&self) -> u64 {
        self.store.segment_limit()
    }
}

/// Largest state file read back (about 28 million chunks).
const MAX_STATE_FILE: u64 = 1 << 30;

/// The least time between two writes of one cache's state.
pub const MIN_STATE_INTERVAL: Duration = Duration::from_secs(1);

/// One peer's cache directory.
pub struct CacheDir {
    root: PathBuf,
    key: Option<[u8; 32]>,
    /// What seals the saved states, with a key.
    rest: Option<crate::atrest::AtRest>,
    codec: CodecSettings,
    /// Decoder stores, shared by the links to this peer one after another.
    stores: Mutex<HashMap<PathBuf, Arc<Mutex<AsyncStore>>>>,
    /// The segment files each decoder directory held at start, listed before anything is served.
    segments: HashMap<PathBuf, Vec<(u32, u64)>>,
    /// Notified when a store read a chunk a link waits for.
    ready: Arc<tokio::sync::Notify>,
    seq: AtomicU64,
    /// Stores of delta bases started so far (each has a directory of its own).
    bases: AtomicU64,
    pending: AtomicUsize,
    idle: tokio::sync::Notify,
    /// The newest state waiting to be written per cache directory, with its number.
    queued: Mutex<HashMap<PathBuf, (u64, Arc<Snapshot>)>>,
    coalesced: AtomicU64,
    /// When each cache directory's state was last written, and how many were written: a peer
    /// whose checkpoints come faster than [`MIN_STATE_INTERVAL`] gets one write per interval.
    written: Mutex<HashMap<PathBuf, std::time::Instant>>,
    writes: AtomicU64,
    /// Held (`flock`) while the directory is in use: two daemons must never share one.
    _lock: File,
}

impl std::fmt::Debug for CacheDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheDir")
            .field("root", &self.root)
            .field("encrypted", &self.key.is_some())
            .finish()
    }
}

/// A cache directory that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("cache directory {path}: {source}")]
pub struct CacheDirError {
    path: PathBuf,
    source: std::io::Error,
}

/// Takes the directory's lock file, or fails if another process holds it.
fn lock_dir(root: &Path) -> Result<File, CacheDirError> {
    use std::os::fd::AsRawFd;
    let path = root.join(".lock");
    let err = |source| CacheDirError {
        path: path.clone(),
        source,
    };
    let f = no_follow()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&path)
        .map_err(err)?;
    // SAFETY: flock on a descriptor we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(err(std::io::Error::other(
            "in use by another wanoptd (two daemons must not share a state_dir for the same peer)",
        )));
    }
    Ok(f)
}

fn dir_name(role: Role, lane: usize, scope: &str) -> Option<String> {
    let scope = if scope.is_empty() {
        "link".to_string()
    } else if valid_name(scope) {
        format!("svc-{scope}")
    } else {
        return None;
    };
    Some(format!("{}-{lane}-{scope}", role.label()))
}

fn parse_dir_name(name: &str) -> Option<(Role, usize, String)> {
    let (role, rest) = if let Some(r) = name.strip_prefix("decoder-") {
        (Role::Decoder, r)
    } else {
        (Role::Mirror, name.strip_prefix("mirror-")?)
    };
    let (lane, scope) = rest.split_once('-')?;
    let lane: usize = lane.parse().ok()?;
    let scope = match scope {
        "link" => String::new(),
        s => s
            .strip_prefix("svc-")
            .filter(|s| valid_name(s))?
            .to_string(),
    };
    (lane < wanopt_proto::LANES).then_some((role, lane, scope))
}

/// A saved state's file name: `state-<sequence>-<capacity>-<digest>.idx`, so states can be listed
/// and offered without reading them.
fn state_name(seq: u64, st: &SavedState) -> String {
    let hex: String = st.digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("state-{seq:016}-{}-{hex}.idx", st.capacity)
}

fn parse_state_name(name: &str) -> Option<(u64, SavedState)> {
    let mut parts = name
        .strip_prefix("state-")?
        .strip_suffix(".idx")?
        .split('-');
    let seq = parts.next()?.parse().ok()?;
    let capacity = parts.next()?.parse().ok()?;
    let hex = parts.next()?;
    if hex.len() != 32 || parts.next().is_some() {
        return None;
    }
    let mut digest = [0u8; 16];
    for (i, d) in digest.iter_mut().enumerate() {
        *d = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some((seq, SavedState { digest, capacity }))
}

fn private_dir(p: &Path) -> Result<(), CacheDirError> {
    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(p)
        .map_err(|source| CacheDirError {
            path: p.to_path_buf(),
            source,
        })
}

/// The saved states in a directory, newest first, as (sequence, state, path).
fn states_in(dir: &Path) -> Vec<(u64, SavedState, PathBuf)> {
    let mut v: Vec<(u64, SavedState, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let (seq, st) = parse_state_name(e.file_name().to_str()?)?;
            Some((seq, st, e.path()))
        })
        .collect();
    v.sort_unstable_by_key(|s| std::cmp::Reverse(s.0));
    v
}

impl CacheDir {
    /// Opens (creating, mode 0700) the cache directory of one peer.
    pub fn open(
        state_dir: &Path,
        peer: &str,
        codec: CodecSettings,
        key: Option<[u8; 32]>,
    ) -> Result<CacheDir, CacheDirError> {
        let root = state_dir.join("cache").join(peer);
        private_dir(&root)?;
        let lock = lock_dir(&root)?;
        // A state half-written when an earlier run stopped is of no use: its rename never came.
        for d in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            for e in std::fs::read_dir(d.path()).into_iter().flatten().flatten() {
                if e.file_name()
                    .to_str()
                    .is_some_and(|n| n.starts_with(".state-") && n.ends_with(".tmp"))
                {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        // A store of delta bases lives as long as the daemon (its index is in memory only):
        // what an earlier run left is of no use.
        for e in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            if e.file_name()
                .to_str()
                .is_some_and(|n| n.starts_with(BASES_DIR))
            {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        let mut seq = 0;
        let mut segments = HashMap::new();
        for e in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            if let Some((s, _, _)) = states_in(&e.path()).first() {
                seq = seq.max(*s);
            }
            if e.file_name()
                .to_str()
                .and_then(parse_dir_name)
                .is_some_and(|(r, _, _)| r == Role::Decoder)
            {
                segments.insert(e.path(), crate::disk::segments_in(&e.path()));
            }
        }
        Ok(CacheDir {
            root,
            key,
            rest: key.map(crate::atrest::AtRest::new),
            codec,
            stores: Mutex::default(),
            segments,
            ready: Arc::new(tokio::sync::Notify::new()),
            seq: AtomicU64::new(seq),
            bases: AtomicU64::new(0),
            pending: AtomicUsize::new(0),
            idle: tokio::sync::Notify::new(),
            queued: Mutex::default(),
            coalesced: AtomicU64::new(0),
            written: Mutex::new(HashMap::new()),
            writes: AtomicU64::new(0),
            _lock: lock,
        })
    }

    /// Lets another process take the directory (a handover: this one writes nothing more).
    pub fn unlock(&self) {
        use std::os::fd::AsRawFd;
        // SAFETY: flock on a descriptor we own.
        unsafe { libc::flock(self._lock.as_raw_fd(), libc::LOCK_UN) };
    }

    /// The directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Notified when a store has read a chunk that a link waits for.
    pub fn ready(&self) -> Arc<tokio::sync::Notify> {
        self.ready.clone()
    }

    /// What an [`Encoder`](wanopt_codec::Encoder) run outside a link (a bench, a tool) calls
    /// to wait, as a link's sender does, for the bases its disk tier is reading: it blocks until
    /// this directory's stores have read something, or [`STORE_WAIT`] has passed. `None` if
    /// the timer it needs cannot be had.
    pub fn store_wait(&self) -> Option<wanopt_codec::StoreWait> {
        let ready = self.ready.clone();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .ok()?;
        Some(Box::new(move || {
            rt.block_on(async {
                let _ = tokio::time::timeout(STORE_WAIT, ready.notified()).await;
            });
        }))
    }

    /// A disk tier of `limit` bytes for a store of delta bases, in a directory of its own
    /// (`bases.<n>`, sealed with the cache key if there is one) that is removed with the store.
    /// `None` if it cannot be started (the store then stays in memory).
    pub fn bases_store(&self, limit: u64) -> Option<Box<dyn ChunkStore>> {
        let dir = self
            .root
            .join(format!("{BASES_DIR}.{}", self.bases.fetch_add(1, SeqCst)));
        match AsyncStore::open(
            dir.clone(),
            self.key,
            segment_size(limit),
            &[],
            self.ready.clone(),
        ) {
            Ok(store) => Some(Box::new(ScratchStore { store, dir })),
            Err(e) => {
                warn!(error = %e, "cannot start the delta bases' disk tier; they stay in memory");
                None
            }
        }
    }

    fn decoder_store(&self, dir: &Path, limit: u64) -> Option<Arc<Mutex<AsyncStore>>> {
        let mut stores = self.stores.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(s) = stores.get(dir) {
            return Some(s.clone());
        }
        let existing = self.segments.get(dir).map_or(&[][..], Vec::as_slice);
        match AsyncStore::open(
            dir.to_path_buf(),
            self.key,
            segment_size(limit),
            existing,
            self.ready.clone(),
        ) {
            Ok(s) => {
                let s = Arc::new(Mutex::new(s));
                stores.insert(dir.to_path_buf(), s.clone());
                Some(s)
            }
            Err(e) => {
                warn!(error = %e, "cannot start the cache's disk tier; this cache stays in memory");
                None
            }
        }
    }

    /// Writes a saved state in the background; [`flush`](Self::flush) waits for it. At most
    /// one write per cache waits at a time: a newer state replaces the one waiting, so however
    /// often the peer's checkpoints match, the writes queued stay one per cache.
    pub fn save(self: &Arc<Self>, role: Role, lane: usize, scope: &str, state: Arc<Snapshot>) {
        let Some(name) = dir_name(role, lane, scope) else {
            return;
        };
        let dir = self.root.join(name);
        let seq = self.seq.fetch_add(1, SeqCst) + 1;
        let waiting = self
            .queued
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(dir.clone(), (seq, state))
            .is_some();
        if waiting {
            self.coalesced.fetch_add(1, SeqCst);
            return;
        }
        self.pending.fetch_add(1, SeqCst);
        // Each write snapshots, flushes and syncs the cache's files: at most one per interval,
        // the newest state when its turn comes (later ones replace it while it waits).
        let wait = self
            .written
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&dir)
            .and_then(|t| {
                (*t + MIN_STATE_INTERVAL).checked_duration_since(std::time::Instant::now())
            });
        match (wait, tokio::runtime::Handle::try_current()) {
            (Some(wait), Ok(h)) => {
                let me = self.clone();
                h.spawn(async move {
                    tokio::time::sleep(wait).await;
                    me.schedule(role, dir, seq);
                });
            }
            _ => self.schedule(role, dir, seq),
        }
    }

    /// States written so far (each a snapshot, flush and sync of one cache's files).
    pub fn writes(&self) -> u64 {
        self.writes.load(SeqCst)
    }

    /// Queues the write of the state waiting for `dir`, expected to be the one numbered `seq`.
    /// A decoder's state goes after the chunks it names, on its store's thread: one replaced
    /// while waiting is queued again, behind what was appended before it.
    fn schedule(self: &Arc<Self>, role: Role, dir: PathBuf, seq: u64) {
        let me = self.clone();
        let store = (role == Role::Decoder)
            .then(|| {
                self.stores
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get(&dir)
                    .cloned()
            })
            .flatten();
        let ordered = store.is_some();
        let job = move || {
            let mut queued = me.queued.lock().unwrap_or_else(PoisonError::into_inner);
            let Some((newest, state)) = queued.get(&dir).cloned() else {
                return;
            };
            if ordered && newest != seq {
                drop(queued);
                me.schedule(role, dir, newest);
                return;
            }
            queued.remove(&dir);
            drop(queued);
            me.written
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(dir.clone(), std::time::Instant::now());
            me.writes.fetch_add(1, SeqCst);
            if let Err(e) = me.write_state(role, &dir, newest, &state) {
                warn!(dir = %dir.display(), error = %e, "cannot save the cache state");
            }
            if me.pending.fetch_sub(1, SeqCst) == 1 {
                me.idle.notify_waiters();
            }
        };
        match (store, tokio::runtime::Handle::try_current()) {
            (Some(s), _) => s
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .run_after(Box::new(job)),
            (None, Ok(h)) => {
                h.spawn_blocking(job);
            }
            (None, Err(_)) => job(),
        }
    }

    /// Cache states replaced by a newer one before they were written.
    pub fn coalesced(&self) -> u64 {
        self.coalesced.load(SeqCst)
    }

    fn write_state(
        &self,
        role: Role,
        dir: &Path,
        seq: u64,
        state: &Snapshot,
    ) -> std::io::Result<()> {
        private_dir(dir).map_err(|e| e.source)?;
        if role == Role::Decoder {
            // The chunks the state names must be on disk before the state is.
            for e in std::fs::read_dir(dir)?.flatten() {
                if e.file_name().to_str().is_some_and(|n| n.ends_with(".dat")) {
                    no_follow().read(true).open(e.path())?.sync_all()?;
                }
            }
        }
        let st = SavedState {
            digest: state.digest(),
            capacity: state.capacity,
        };
        let tmp = dir.join(format!(".state-{seq:016}.tmp"));
        let mut f = no_follow()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        let bytes = match &self.rest {
            None => state.encode(),
            Some(r) => r
                .seal_file(&state.encode())
                .map_err(std::io::Error::other)?,
        };
        f.write_all(&bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, dir.join(state_name(seq, &st)))?;
        no_follow().read(true).open(dir)?.sync_all()?;
        for (_, _, old) in states_in(dir).into_iter().skip(keep(role)) {
            let _ = std::fs::remove_file(old);
        }
        Ok(())
    }

    /// Waits until every state asked for so far is written, at most `limit`.
    pub async fn flush(&self, limit: Duration) {
        let wait = async {
            loop {
                let idle = self.idle.notified();
                if self.pending.load(SeqCst) == 0 {
                    return;
                }
                idle.await;
            }
        };
        if tokio::time::timeout(limit, wait).await.is_err() {
            warn!("cache states still being written at shutdown");
        }
    }
}

impl CacheDir {
    /// States saved for this peer, newest first per cache (listed, not loaded), of the shared
    /// caches and of the `services` configured now. The caches of services no longer
    /// configured are not offered, and go once untouched for [`STALE_AFTER`]. Reads the
    /// directory: call it where blocking is allowed.
    pub fn saved(&self, services: &HashSet<String>) -> Vec<SavedCache> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(&self.root)
            .into_iter()
            .flatten()
            .flatten()
        {
            let Some((role, lane, scope)) = e.file_name().to_str().and_then(parse_dir_name) else {
                continue;
            };
            if !scope.is_empty() && !services.contains(&scope) {
                self.age_out(&e.path());
                continue;
            }
            let states: Vec<SavedState> = states_in(&e.path())
                .into_iter()
                .take(keep(role))
                .map(|(_, st, _)| st)
                .collect();
            if !states.is_empty() {
                out.push(SavedCache {
                    role,
                    lane,
                    scope: scope.into(),
                    states,
                });
            }
        }
        if !out.is_empty() {
            info!(dir = %self.root.display(), caches = out.len(), "found saved cache states");
        }
        out
    }

    /// Removes the cache directory of a service no longer configured once nothing was written
    /// to it for [`STALE_AFTER`] (and this daemon has no store open on it).
    fn age_out(&self, dir: &Path) {
        let age = std::fs::symlink_metadata(dir)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok());
        let open = self
            .stores
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains_key(dir);
        if open || age.is_none_or(|a| a < STALE_AFTER) {
            return;
        }
        match std::fs::remove_dir_all(dir) {
            Ok(()) => {
                info!(dir = %dir.display(), "removed the cache of a service no longer configured")
            }
            Err(e) => warn!(dir = %dir.display(), error = %e, "cannot remove a stale cache"),
        }
    }

    /// Loads a saved state; `None` if it is gone or damaged (its digest is checked). Reads a
    /// file of up to [`MAX_STATE_FILE`] bytes: call it where blocking is allowed.
    pub fn load(
        &self,
        role: Role,
        lane: usize,
        scope: &str,
        digest: &Fingerprint,
    ) -> Option<Snapshot> {
        let dir = self.root.join(dir_name(role, lane, scope)?);
        let (_, _, p) = states_in(&dir)
            .into_iter()
            .find(|(_, st, _)| st.digest == *digest)?;
        let read = no_follow().read(true).open(&p).and_then(|f| {
            if f.metadata()?.len() > MAX_STATE_FILE {
                return Err(std::io::Error::other("too large"));
            }
            // The size was checked, but the file may grow after: read no more than the limit.
            let mut b = Vec::new();
            std::io::Read::read_to_end(&mut std::io::Read::take(f, MAX_STATE_FILE + 1), &mut b)?;
            if b.len() as u64 > MAX_STATE_FILE {
                return Err(std::io::Error::other("too large"));
            }
            Ok(b)
        });
        let read = read.and_then(|b| match &self.rest {
            Some(r) => r.open_file(b).map_err(std::io::Error::other),
            None if crate::atrest::is_sealed(&b) => Err(std::io::Error::other(
                "sealed under a cache key, and no key_file is set",
            )),
            None => Ok(b),
        });
        let snap = match read.map(|b| Snapshot::decode(&b)) {
            Ok(Ok(s)) if s.digest() == *digest => s,
            Ok(Ok(_)) => {
                warn!(file = %p.display(), "a cache state does not match its name; starting this cache empty");
                return None;
            }
            Ok(Err(e)) => {
                warn!(file = %p.display(), error = %e, "a damaged cache state; starting this cache empty");
                return None;
            }
            Err(e) => {
                warn!(file = %p.display(), error = %e, "cannot read a cache state; starting this cache empty");
                return None;
            }
        };
        info!(cache = %dir.display(), chunks = snap.entries.len(), "resumed a saved cache state");
        Some(snap)
    }
}

impl CacheStorage for CacheDir {
    fn store(&self, lane: usize, scope: &str) -> Option<Box<dyn ChunkStore>> {
        let limit = if scope.is_empty() {
            self.codec.disk_bytes
        } else {
            self.codec.service_disk_bytes
        };
        if limit == 0 {
            return None;
        }
        let limit = if lane == wanopt_proto::LATENCY_LANE {
            limit / wanopt_proto::coding::LATENCY_SHARE
        } else {
            limit
        };
        let dir = self.root.join(dir_name(Role::Decoder, lane, scope)?);
        let s = self.decoder_store(&dir, limit)?;
        Some(Box::new(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_is_used_by_one_daemon_at_a_time() {
        let dir = tempfile::tempdir().expect("tempdir");
        let codec = CodecSettings::default();
        let a = CacheDir::open(dir.path(), "east", codec.clone(), None).expect("first");
        let e = CacheDir::open(dir.path(), "east", codec.clone(), None).expect_err("second");
        assert!(e.to_string().contains("in use"), "{e}");
        assert!(CacheDir::open(dir.path(), "west", codec.clone(), None).is_ok());
        drop(a);
        assert!(CacheDir::open(dir.path(), "east", codec, None).is_ok());
    }

    #[test]
    fn a_store_of_bases_keeps_sealed_files_of_its_own_and_takes_them_with_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let codec = CodecSettings::default();
        let cd = CacheDir::open(dir.path(), "east", codec.clone(), Some([9; 32])).expect("open");
        let mut store = cd.bases_store(64 << 20).expect("store");
        let data = b"a page of rows, kept as a base for deltas".repeat(200);
        let f = wanopt_codec::cache::fingerprint(&data);
        let loc = store.append(&f, &data).expect("appended");
        store.flush();
        let own = cd.root().join("bases.0");
        // Written on the store's thread: read back through it, verified.
        let start = std::time::Instant::now();
        let back = loop {
            match store.try_read(loc, &f) {
                std::task::Poll::Ready(d) => break d,
                std::task::Poll::Pending => {
                    assert!(start.elapsed() < Duration::from_secs(10), "no read");
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        };
        assert_eq!(back.as_deref(), Some(&data[..]));
        // Sealed at rest: the rows are nowhere in the files.
        let files = || -> Vec<u8> {
            std::fs::read_dir(&own)
                .into_iter()
                .flatten()
                .flatten()
                .flat_map(|e| std::fs::read(e.path()).unwrap_or_default())
                .collect()
        };
        let start = std::time::Instant::now();
        while files().len() <= data.len() {
            assert!(start.elapsed() < Duration::from_secs(10), "not written");
            std::thread::sleep(Duration::from_millis(5));
        }
        let files = files();
        assert!(!files.windows(14).any(|w| w == b"a page of rows"));
        // A second store has a directory of its own; dropping one removes its files.
        let other = cd.bases_store(64 << 20).expect("store");
        drop(store);
        let start = std::time::Instant::now();
        while own.exists() {
            assert!(start.elapsed() < Duration::from_secs(10), "files left");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(cd.root().join("bases.1").exists());
        // What a daemon that died left behind goes at the next start.
        std::mem::forget(other);
        drop(cd);
        let _cd = CacheDir::open(dir.path(), "east", codec, None).expect("reopen");
        assert!(!dir.path().join("cache/east/bases.1").exists());
    }

    #[test]
    fn names_round_trip_and_hostile_scopes_get_no_directory() {
        for (role, lane, scope) in [
            (Role::Decoder, 0, ""),
            (Role::Mirror, 1, "redo"),
            (Role::Decoder, 1, "rman-2"),
        ] {
            let n = dir_name(role, lane, scope).expect("name");
            assert_eq!(parse_dir_name(&n), Some((role, lane, scope.to_string())));
        }
        for bad in ["../etc", "a/b", "UP", ".", "-x"] {
            assert_eq!(dir_name(Role::Decoder, 0, bad), None, "{bad}");
        }
        assert_eq!(parse_dir_name("decoder-9-link"), None);
        let st = SavedState {
            digest: [0xa5; 16],
            capacity: 3 << 30,
        };
        assert_eq!(parse_state_name(&state_name(42, &st)), Some((42, st)));
        for bad in [
            "state-1-2-00.idx",
            "state-x-2-a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5.idx",
            "state-1.idx",
        ] {
            assert_eq!(parse_state_name(bad), None, "{bad}");
        }
        assert_eq!(parse_dir_name("mirror-0-svc-../x"), None);
    }

    #[test]
    fn caches_of_services_gone_are_not_offered_and_age_out() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cd = Arc::new(
            CacheDir::open(dir.path(), "east", CodecSettings::default(), None).expect("open"),
        );
        let snap = Arc::new(wanopt_codec::cache::ChunkCache::new(1 << 20).snapshot());
        for scope in ["", "redo", "gone"] {
            cd.save(Role::Mirror, 0, scope, snap.clone());
        }
        let live: HashSet<String> = ["redo".to_string()].into();
        let scopes = |cd: &CacheDir| {
            let mut v: Vec<String> = cd
                .saved(&live)
                .iter()
                .map(|c| c.scope.to_string())
                .collect();
            v.sort();
            v
        };
        assert_eq!(scopes(&cd), ["", "redo"]);
        let gone = cd.root().join("mirror-0-svc-gone");
        assert!(
            gone.exists(),
            "kept while recent: the service may come back"
        );
        let old = std::time::SystemTime::now() - STALE_AFTER - Duration::from_secs(60);
        std::fs::File::open(&gone)
            .and_then(|f| f.set_modified(old))
            .expect("set mtime");
        assert_eq!(scopes(&cd), ["", "redo"]);
        assert!(!gone.exists(), "aged out");
        assert!(cd.root().join("mirror-0-svc-redo").exists());
    }

    /// With a cache key a saved state shows no fingerprint of the chunks it lists, loads back
    /// under that key only, and a state in clear is not taken for a sealed one.
    #[test]
    fn states_saved_under_a_key_are_sealed_and_need_it_to_load() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cache = wanopt_codec::cache::ChunkCache::new(1 << 20);
        let fps: Vec<Fingerprint> = (0..50u32)
            .map(|i| {
                let d = format!("chunk {i} ").repeat(40).into_bytes();
                let f = wanopt_codec::cache::fingerprint(&d);
                cache.insert(f, d);
                f
            })
            .collect();
        let snap = Arc::new(cache.snapshot());
        let digest = snap.digest();
        let files = |cd: &CacheDir| -> Vec<u8> {
            std::fs::read_dir(cd.root().join("mirror-0-link"))
                .into_iter()
                .flatten()
                .flatten()
                .flat_map(|e| std::fs::read(e.path()).unwrap_or_default())
                .collect()
        };
        let shows = |bytes: &[u8]| {
            fps.iter()
                .filter(|f| bytes.windows(16).any(|w| w == &f[..]))
                .count()
        };
        for key in [None, Some([7u8; 32])] {
            let sub = tempfile::tempdir_in(dir.path()).expect("tempdir");
            let open = |key| {
                CacheDir::open(sub.path(), "east", CodecSettings::default(), key).expect("open")
            };
            let cd = Arc::new(open(key));
            cd.save(Role::Mirror, 0, "", snap.clone());
            let bytes = files(&cd);
            assert!(!bytes.is_empty(), "written at once outside a runtime");
            // The check can fail: in clear, every fingerprint is there.
            assert_eq!(shows(&bytes), if key.is_some() { 0 } else { fps.len() });
            let back = cd.load(Role::Mirror, 0, "", &digest).expect("loads back");
            assert_eq!(back.digest(), digest);
            drop(cd);
            // Another key, or none, or a key where the state is in clear: started empty.
            let other = match key {
                Some(_) => vec![None, Some([8u8; 32])],
                None => vec![Some([7u8; 32])],
            };
            for k in other {
                assert!(
                    open(k).load(Role::Mirror, 0, "", &digest).is_none(),
                    "{k:?}"
                );
            }
        }
    }

    /// A state half-written by an earlier run (its rename never came) is removed at open.
    #[test]
    fn half_written_states_are_removed_at_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cd = CacheDir::open(dir.path(), "east", CodecSettings::default(), None).expect("open");
        let sub = cd.root().join("mirror-0-link");
        std::fs::create_dir_all(&sub).expect("mkdir");
        let tmp = sub.join(".state-0000000000000007.tmp");
        std::fs::write(&tmp, b"half").expect("write");
        let kept = sub.join("other");
        std::fs::write(&kept, b"x").expect("write");
        drop(cd);
        let _cd = CacheDir::open(dir.path(), "east", CodecSettings::default(), None).expect("open");
        assert!(!tmp.exists(), "the half-written state stayed");
        assert!(kept.exists());
    }

    /// A peer asking for checkpoints as fast as it can gets one write per cache per interval,
    /// the newest state each time.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn states_are_written_at_most_once_per_interval_per_cache() {
        let dir = tempfile::tempdir().expect("tempdir");
        let codec = CodecSettings {
            disk_bytes: 16 << 20,
            ..CodecSettings::default()
        };
        let cd = Arc::new(CacheDir::open(dir.path(), "east", codec, None).expect("open"));
        let start = std::time::Instant::now();
        let mut last = None;
        for i in 1..=250usize {
            let s = Arc::new(wanopt_codec::cache::ChunkCache::new(i << 12).snapshot());
            cd.save(Role::Mirror, 0, "", s.clone());
            last = Some(s);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        cd.flush(Duration::from_secs(30)).await;
        let spent = start.elapsed();
        // About 2.5 s of checkpoints every 10 ms: a handful of writes, not 250.
        assert!(
            cd.writes() <= spent.as_secs() + 2,
            "{} writes in {spent:?}",
            cd.writes()
        );
        let states = states_in(&cd.root().join("mirror-0-link"));
        assert_eq!(
            states[0].1.digest,
            last.expect("saved").digest(),
            "the newest state is written"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn states_asked_for_faster_than_written_wait_one_per_cache() {
        let dir = tempfile::tempdir().expect("tempdir");
        let codec = CodecSettings {
            disk_bytes: 16 << 20,
            ..CodecSettings::default()
        };
        let cd = Arc::new(CacheDir::open(dir.path(), "east", codec, None).expect("open"));
        let _store = CacheStorage::store(&*cd, 0, "").expect("a disk tier");
        let snaps: Vec<Arc<Snapshot>> = (1..=2000)
            .map(|i| Arc::new(wanopt_codec::cache::ChunkCache::new(i << 12).snapshot()))
            .collect();
        for s in &snaps {
            cd.save(Role::Decoder, 0, "", s.clone());
        }
        cd.flush(Duration::from_secs(30)).await;
        assert!(cd.coalesced() > 1000, "{} replaced", cd.coalesced());
        let states = states_in(&cd.root().join("decoder-0-link"));
        assert!(states.len() <= KEEP_DECODER_STATES);
        let last = snaps.last().expect("last");
        assert_eq!(
            states[0].1.digest,
            last.digest(),
            "the newest state is written"
        );
    }
}
