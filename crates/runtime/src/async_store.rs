//! The disk tier's store as the link sees it: an [`AsyncStore`] that never blocks. It decides
//! where each chunk goes (the same placement the segment files follow), queues the writes,
//! copies and reads for a thread of its own that does the file I/O in order, and answers reads
//! of chunks not yet written from memory. A read that needs the disk is `Pending`: the thread
//! fetches it and wakes the link, which decodes the waiting stream again. The queue is bounded;
//! a chunk that does not fit is kept in memory only (a later reference to it may miss, which the
//! peer answers), never waited for under the link's lock.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::Poll;
use std::time::Duration;

use tokio::sync::Notify;
use tracing::warn;
use wanopt_codec::cache::Fingerprint;
use wanopt_codec::store::{ChunkStore, Loc, RECORD_HEADER};

use crate::disk::DiskStore;

/// Bytes of chunk writes queued for the thread at most.
const MAX_QUEUED_BYTES: usize = 64 << 20;
/// Reads waiting for the thread or for the link to take them, at most.
const MAX_READS: usize = 4096;
/// Finished reads nobody took yet, kept at most: beyond this many the oldest are forgotten (a
/// later lookup reads the chunk again). Prefetched bases that were never asked for again used
/// to stay for good, and once they filled `MAX_READS` every new read was answered as lost, so
/// the delta store dropped its bases one by one: in the reduction bench's corpus, run in order
/// through one encoder (`-- --pairs DIR`), 2,202 reads were answered lost during the query-log
/// pair, whose changed copy cost 0.0735 of its bytes; with this bound none were, and 0.0681.
const MAX_DONE: usize = 1024;
/// Bytes AES-GCM adds to a stored chunk (nonce and tag).
const SEALED: u32 = 12 + 16;

/// Where records go: segments fill up to a size, then the next number starts, as [`DiskStore`]
/// does. Pure bookkeeping, so the link learns a chunk's place without waiting for the disk.
#[derive(Debug, Clone)]
struct Layout {
    seg_bytes: u64,
    /// The segment being filled and its length.
    current: Option<(u32, u64)>,
    next_seg: u32,
    sizes: BTreeMap<u32, u64>,
}

impl Layout {
    fn new(seg_bytes: u64, existing: &[(u32, u64)]) -> Self {
        Layout {
            seg_bytes: seg_bytes.max(1 << 20),
            current: None,
            next_seg: existing
                .iter()
                .map(|(n, _)| n.saturating_add(1))
                .max()
                .unwrap_or(0),
            sizes: existing.iter().copied().collect(),
        }
    }

    fn place(&mut self, body: u32) -> Loc {
        let stored = RECORD_HEADER + u64::from(body);
        let (seg, off) = match self.current {
            Some((seg, len)) if len + stored <= self.seg_bytes => (seg, len),
            _ => {
                let seg = self.next_seg;
                self.next_seg = seg.saturating_add(1);
                (seg, 0)
            }
        };
        self.current = Some((seg, off + stored));
        *self.sizes.entry(seg).or_default() += stored;
        Loc {
            seg,
            off,
            len: body,
        }
    }

    fn remove(&mut self, seg: u32) {
        if self.current.is_some_and(|(n, _)| n == seg) {
            self.current = None;
        }
        self.sizes.remove(&seg);
    }
}

type Key = (u32, u64);

enum Job {
    Write {
        loc: Loc,
        f: Fingerprint,
        data: Arc<Vec<u8>>,
    },
    Copy {
        from: Loc,
        to: Loc,
        f: Fingerprint,
    },
    Read {
        loc: Loc,
        f: Fingerprint,
    },
    Remove(u32),
    Flush,
    /// Runs on the thread after every job queued before it (a saved state after its chunks).
    Run(Box<dyn FnOnce() + Send>),
}

#[derive(Default)]
struct State {
    jobs: VecDeque<Job>,
    /// Reads the thread runs before the jobs: a read waits for no write (a chunk not written
    /// yet is answered from `unwritten`), and a sender that finds its base still on disk sends
    /// the chunk without it. Behind 64 MiB of queued writes, prefetched bases of a changed
    /// dump came too late for a fifth of its deltas.
    reads: VecDeque<Job>,
    /// Where queued copies write: a read of one of these waits in `jobs` behind its copy.
    copying: HashMap<Key, usize>,
    queued_bytes: usize,
    /// Chunks placed but not written yet: reads are answered from here.
    unwritten: HashMap<Key, (Fingerprint, Arc<Vec<u8>>)>,
    /// Reads queued or done and not yet taken.
    reading: HashSet<Key>,
    done: HashMap<Key, Option<Vec<u8>>>,
    /// Keys of `done` in the order they finished (some taken since), to forget the oldest.
    done_order: VecDeque<Key>,
    /// The front is gone: finish the queue and stop.
    closed: bool,
    /// Chunks dropped because the queue was full.
    dropped: u64,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl State {
    /// Keeps a finished read for its taker, forgetting the oldest untaken ones beyond
    /// [`MAX_DONE`].
    fn finish_read(&mut self, key: Key, data: Option<Vec<u8>>) {
        self.done.insert(key, data);
        self.done_order.push_back(key);
        while self.done.len() > MAX_DONE {
            let Some(old) = self.done_order.pop_front() else {
                break;
            };
            if self.done.remove(&old).is_some() {
                self.reading.remove(&old);
            }
        }
        // Keys taken since they finished: drop them once they outnumber the kept ones.
        if self.done_order.len() > 2 * MAX_DONE {
            let done = &self.done;
            self.done_order.retain(|k| done.contains_key(k));
        }
    }
}

/// A test hook: each read and write of the thread takes this long more (a slow disk). Set by
/// `WANOPT_TEST_STORE_DELAY_MS`, read once when a store opens.
fn test_delay() -> Option<Duration> {
    let ms: u64 = std::env::var("WANOPT_TEST_STORE_DELAY_MS")
        .ok()?
        .parse()
        .ok()?;
    (ms > 0).then(|| Duration::from_millis(ms))
}

/// A non-blocking [`ChunkStore`] over a directory of segment files.
pub struct AsyncStore {
    shared: Arc<Shared>,
    layout: Layout,
    sealed: bool,
}

impl std::fmt::Debug for AsyncStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncStore")
            .field("segments", &self.layout.sizes.len())
            .finish()
    }
}

impl AsyncStore {
    /// A store of `dir` whose segments are `existing` (listed beforehand, so nothing here waits
    /// for the disk); its thread opens the files. `ready` is notified when a read is done.
    pub fn open(
        dir: PathBuf,
        key: Option<[u8; 32]>,
        seg_bytes: u64,
        existing: &[(u32, u64)],
        ready: Arc<Notify>,
    ) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            state: Mutex::default(),
            wake: Condvar::new(),
        });
        let worker = shared.clone();
        let delay = test_delay();
        std::thread::Builder::new()
            .name("wanopt-store".into())
            .spawn(move || {
                let disk = match DiskStore::open(&dir, key, seg_bytes) {
                    Ok(d) => Some(d),
                    Err(e) => {
                        warn!(error = %e, "cannot open the cache's disk tier; its chunks read as misses");
                        None
                    }
                };
                work(&worker, disk, &ready, delay);
            })?;
        Ok(AsyncStore {
            shared,
            layout: Layout::new(seg_bytes, existing),
            sealed: key.is_some(),
        })
    }

    fn body(&self, len: usize) -> u32 {
        len as u32 + if self.sealed { SEALED } else { 0 }
    }

    /// Queues `job` to run on the store's thread after everything queued before it.
    pub fn run_after(&self, job: Box<dyn FnOnce() + Send>) {
        let mut st = self.shared.lock();
        st.jobs.push_back(Job::Run(job));
        drop(st);
        self.shared.wake.notify_one();
    }

    fn push(&self, st: &mut State, job: Job) {
        st.jobs.push_back(job);
        self.shared.wake.notify_one();
    }
}

impl Drop for AsyncStore {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.wake.notify_one();
    }
}

impl ChunkStore for AsyncStore {
    fn append(&mut self, f: &Fingerprint, data: &[u8]) -> Option<Loc> {
        if data.len() > wanopt_codec::MAX_RECORD {
            return None;
        }
        let mut st = self.shared.lock();
        if st.queued_bytes + data.len() > MAX_QUEUED_BYTES {
            st.dropped += 1;
            if st.dropped.is_power_of_two() {
                warn!(
                    dropped = st.dropped,
                    "the disk tier cannot keep up: chunks stay in memory only"
                );
            }
            return None;
        }
        let loc = self.layout.place(self.body(data.len()));
        let data = Arc::new(data.to_vec());
        st.queued_bytes += data.len();
        st.unwritten.insert((loc.seg, loc.off), (*f, data.clone()));
        self.push(&mut st, Job::Write { loc, f: *f, data });
        Some(loc)
    }

    fn read(&mut self, loc: Loc, f: &Fingerprint) -> Option<Vec<u8>> {
        // Only the blocking default methods would call this; answer what needs no disk.
        match self.try_read(loc, f) {
            Poll::Ready(d) => d,
            Poll::Pending => None,
        }
    }

    fn try_read(&mut self, loc: Loc, f: &Fingerprint) -> Poll<Option<Vec<u8>>> {
        let key = (loc.seg, loc.off);
        let mut st = self.shared.lock();
        if let Some((uf, d)) = st.unwritten.get(&key) {
            return Poll::Ready((uf == f).then(|| d.to_vec()));
        }
        if let Some(d) = st.done.remove(&key) {
            st.reading.remove(&key);
            return Poll::Ready(d);
        }
        if !st.reading.contains(&key) {
            if st.reading.len() >= MAX_READS {
                return Poll::Ready(None);
            }
            st.reading.insert(key);
            if st.copying.contains_key(&key) {
                self.push(&mut st, Job::Read { loc, f: *f });
            } else {
                st.reads.push_back(Job::Read { loc, f: *f });
                self.shared.wake.notify_one();
            }
        }
        Poll::Pending
    }

    fn copy(&mut self, from: Loc, f: &Fingerprint) -> Option<Loc> {
        let to = self.layout.place(from.len);
        let mut st = self.shared.lock();
        *st.copying.entry((to.seg, to.off)).or_default() += 1;
        self.push(&mut st, Job::Copy { from, to, f: *f });
        Some(to)
    }

    fn remove_segment(&mut self, seg: u32) {
        self.layout.remove(seg);
        let mut st = self.shared.lock();
        st.unwritten.retain(|(s, _), _| *s != seg);
        self.push(&mut st, Job::Remove(seg));
    }

    fn flush(&mut self) {
        let mut st = self.shared.lock();
        self.push(&mut st, Job::Flush);
    }

    fn segments(&self) -> Vec<(u32, u64)> {
        self.layout.sizes.iter().map(|(n, s)| (*n, *s)).collect()
    }

    fn segment_limit(&self) -> u64 {
        self.layout.seg_bytes
    }
}

/// The store's thread: runs the jobs in order until the front is dropped and the queue is empty.
fn work(shared: &Shared, mut disk: Option<DiskStore>, ready: &Notify, delay: Option<Duration>) {
    let slow = || {
        if let Some(d) = delay {
            std::thread::sleep(d);
        }
    };
    loop {
        let job = {
            let mut st = shared.lock();
            loop {
                if let Some(j) = st.reads.pop_front().or_else(|| st.jobs.pop_front()) {
                    break j;
                }
                if st.closed {
                    if let Some(d) = disk.as_mut() {
                        let _ = d.flush();
                    }
                    return;
                }
                st = shared.wake.wait(st).unwrap_or_else(|p| p.into_inner());
            }
        };
        match job {
            Job::Write { loc, f, data } => {
                slow();
                if let Some(d) = disk.as_mut()
                    && let Err(e) = d.write_at(loc, &f, &data)
                {
                    warn!(error = %e, "cannot write a chunk to the disk tier; it will read as a miss");
                }
                let mut st = shared.lock();
                st.queued_bytes = st.queued_bytes.saturating_sub(data.len());
                if st
                    .unwritten
                    .get(&(loc.seg, loc.off))
                    .is_some_and(|(uf, _)| *uf == f)
                {
                    st.unwritten.remove(&(loc.seg, loc.off));
                }
            }
            Job::Copy { from, to, f } => {
                slow();
                let pending = shared.lock().unwritten.get(&(from.seg, from.off)).cloned();
                let data = match pending {
                    Some((uf, d)) if uf == f => Some(d.to_vec()),
                    _ => disk.as_mut().and_then(|d| d.read(from, &f)),
                };
                if let (Some(d), Some(data)) = (disk.as_mut(), data) {
                    let _ = d.write_at(to, &f, &data);
                }
                let mut st = shared.lock();
                let key = (to.seg, to.off);
                if let Some(n) = st.copying.get_mut(&key) {
                    *n -= 1;
                    if *n == 0 {
                        st.copying.remove(&key);
                    }
                }
            }
            Job::Read { loc, f } => {
                slow();
                let data = disk.as_mut().and_then(|d| d.read(loc, &f));
                shared.lock().finish_read((loc.seg, loc.off), data);
                ready.notify_one();
            }
            Job::Remove(seg) => {
                if let Some(d) = disk.as_mut() {
                    d.remove_segment(seg);
                }
            }
            Job::Flush => {
                if let Some(d) = disk.as_mut() {
                    let _ = d.flush();
                }
            }
            Job::Run(f) => {
                if let Some(d) = disk.as_mut() {
                    let _ = d.flush();
                }
                f();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wanopt_codec::cache::{ChunkCache, Lookup, fingerprint};

    fn chunk(i: u32) -> Vec<u8> {
        (0..3000u32)
            .map(|j| (i.wrapping_mul(31) ^ j) as u8)
            .collect()
    }

    /// Waits until the store's thread answered every read asked for.
    fn settle(c: &mut ChunkCache, fs: &[Fingerprint]) -> usize {
        let mut hits = 0;
        for f in fs {
            let mut tries = 0;
            loop {
                match c.lookup(f) {
                    Lookup::Hit(_) => {
                        hits += 1;
                        break;
                    }
                    Lookup::Miss => break,
                    Lookup::Pending => {
                        tries += 1;
                        assert!(tries < 2000, "a read never finished");
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
            }
        }
        hits
    }

    #[test]
    fn placement_matches_the_segment_files_and_reads_come_back_verified() {
        for key in [None, Some([3u8; 32])] {
            let dir = tempfile::tempdir().expect("tempdir");
            let ready = Arc::new(Notify::new());
            let store = AsyncStore::open(dir.path().to_path_buf(), key, 1 << 20, &[], ready)
                .expect("store");
            // Memory holds a tenth of what the disk tier does: most lookups go to disk.
            let mut c = ChunkCache::tiered(30_000, 8 << 20, Box::new(store));
            let fs: Vec<Fingerprint> = (0..1500)
                .map(|i| {
                    let d = chunk(i);
                    let f = fingerprint(&d);
                    c.insert(f, d);
                    f
                })
                .collect();
            // Everything still held reads back, from memory, the write queue or the files
            // (segments were reclaimed along the way: their chunks were copied forward).
            let held: Vec<Fingerprint> = fs.iter().copied().filter(|f| c.contains(f)).collect();
            assert!(held.len() > 1000, "{}", held.len());
            assert_eq!(settle(&mut c, &held), held.len());
        }
    }

    /// Reads asked for and never taken (prefetches nobody needed after all) are forgotten
    /// oldest first: a store that served more of them than it keeps reads still reads what is
    /// asked of it later, instead of answering it as lost (which dropped the chunk from its
    /// cache).
    #[test]
    fn untaken_reads_are_forgotten_and_later_reads_still_succeed() {
        let (_dir, mut store) = plain_store();
        let n = (MAX_READS + MAX_DONE) as u32;
        let put: Vec<(Loc, Fingerprint)> = (0..n + 1)
            .map(|i| {
                let d = chunk(i);
                let f = fingerprint(&d);
                (store.append(&f, &d).expect("placed"), f)
            })
            .collect();
        // Written to the files, so every read goes to the thread.
        let wait = |store: &AsyncStore| {
            for _ in 0..2000 {
                let st = store.shared.lock();
                if st.jobs.is_empty() && st.reads.is_empty() && st.unwritten.is_empty() {
                    return;
                }
                drop(st);
                std::thread::sleep(Duration::from_millis(5));
            }
            panic!("the thread did not catch up");
        };
        wait(&store);
        // Ask for all but the last once, never coming back for the answers.
        for (loc, f) in &put[..n as usize] {
            assert_eq!(store.try_read(*loc, f), Poll::Pending);
            if store.shared.lock().reads.len() > 256 {
                wait(&store);
            }
        }
        wait(&store);
        assert!(store.shared.lock().done.len() <= MAX_DONE);
        // The last one is read, not lost.
        let (loc, f) = put[n as usize];
        let mut got = store.try_read(loc, &f);
        for _ in 0..2000 {
            if got.is_ready() {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
            got = store.try_read(loc, &f);
        }
        assert_eq!(got, Poll::Ready(Some(chunk(n))));
    }

    /// A store without a key in a directory of its own (kept while the store is used).
    fn plain_store() -> (tempfile::TempDir, AsyncStore) {
        let dir = tempfile::tempdir().expect("tempdir");
        let ready = Arc::new(Notify::new());
        let store =
            AsyncStore::open(dir.path().to_path_buf(), None, 64 << 20, &[], ready).expect("store");
        (dir, store)
    }

    /// Holds the store's thread in a job until the returned sender is dropped.
    fn hold(store: &AsyncStore) -> std::sync::mpsc::Sender<()> {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        store.run_after(Box::new(move || {
            let _ = rx.recv();
        }));
        tx
    }

    /// Asks for `loc` until the thread answers; `None` if it did not within ten seconds.
    fn answer(store: &mut AsyncStore, loc: Loc, f: &Fingerprint) -> Option<Option<Vec<u8>>> {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Poll::Ready(d) = store.try_read(loc, f) {
                return Some(d);
            }
            if std::time::Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// A read goes before the writes queued ahead of it (a sender that finds its base on disk
    /// needs it before the next chunks are encoded), except the read of a place a queued copy
    /// writes, which waits for that copy.
    #[test]
    fn reads_overtake_queued_writes_but_not_the_copy_they_read() {
        let (_dir, mut store) = plain_store();
        let d = chunk(0);
        let f = fingerprint(&d);
        let loc = store.append(&f, &d).expect("placed");
        // Written once the thread ran a job queued after the write.
        let (tx, rx) = std::sync::mpsc::channel();
        store.run_after(Box::new(move || {
            let _ = tx.send(());
        }));
        rx.recv_timeout(Duration::from_secs(10)).expect("written");
        assert_eq!(answer(&mut store, loc, &f), Some(Some(d.clone())));

        let first = hold(&store);
        for i in 1..200 {
            let c = chunk(i);
            store.append(&fingerprint(&c), &c).expect("placed");
        }
        let to = store.copy(loc, &f).expect("copied");
        let last = hold(&store);
        assert!(
            store.try_read(loc, &f).is_pending(),
            "on disk: the thread reads it"
        );
        assert!(
            store.try_read(to, &f).is_pending(),
            "the copy is not written yet"
        );
        drop(first);
        assert_eq!(
            answer(&mut store, loc, &f),
            Some(Some(d.clone())),
            "answered while a job queued after the writes still holds the thread"
        );
        assert!(
            store.try_read(to, &f).is_pending(),
            "the copy's place is read after the copy"
        );
        drop(last);
        assert_eq!(answer(&mut store, to, &f), Some(Some(d)));
    }

    #[test]
    fn the_layout_rolls_segments_like_the_disk_store() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut disk = DiskStore::open(dir.path(), None, 1 << 20).expect("disk");
        let mut layout = Layout::new(1 << 20, &[]);
        for i in 0..1000u32 {
            let d = chunk(i);
            let planned = layout.place(d.len() as u32);
            let got = disk.append(&fingerprint(&d), &d).expect("append");
            assert_eq!(planned, got);
        }
    }
}
