//! Delta encoding against similar chunks. A chunk that misses the cache is often a small edit of
//! one the peer holds (a page of a second backup after an OLTP run changes a few bytes in 8 KiB),
//! so the sender keeps the bytes of what it sent in a bounded store, [`Bases`], indexed by sampled
//! anchors; a new chunk's anchors vote for the stored chunks they occur in, and up to
//! [`MAX_BASES`] winners the peer still holds become one zstd dictionary for it.
//!
//! Why this index (measured on a real second `pg_basebackup` after OLTP, `cargo bench --bench
//! codec -- --similar`): one base found by super-features (Shilane et al.) recovered 0.067 of the
//! raw bytes; up to eight bases by anchor votes 0.029, below `zstd --patch-from`'s 0.030, because
//! a page's rows move between pages and one base rarely holds all of them.

use std::sync::{Arc, Mutex};

use zstd::zstd_safe::DCtx;

use crate::cache::{ChunkCache, Lookup, TierStats};
use crate::fingerprint::Fingerprint;
use crate::store::ChunkStore;

/// Bytes of sent chunks a link keeps as bases unless configured otherwise.
pub const DEFAULT_STORE: usize = 256 << 20;
/// A delta is sent only if it is smaller than this share of what a literal of the chunk is
/// expected to cost (the mirror's recent literals' ratio): a weak base would cost the stream
/// context the chunk's bytes for little gain.
pub(crate) const ACCEPT: f64 = 0.8;

/// A store of bases shared by a link's mirrors.
pub type SharedBases = Arc<Mutex<Bases>>;

/// A store of `bytes`, or none for 0.
pub fn shared(bytes: usize) -> Option<SharedBases> {
    (bytes > 0).then(|| Arc::new(Mutex::new(Bases::new(bytes))))
}

/// A store of `mem` bytes of memory in front of `disk` bytes of files in `store` (see
/// [`Bases::tiered`]), or none for no memory.
pub fn shared_tiered(mem: usize, disk: u64, store: Box<dyn ChunkStore>) -> Option<SharedBases> {
    (mem > 0).then(|| Arc::new(Mutex::new(Bases::tiered(mem, disk, store))))
}

/// Most bases one delta record names.
pub const MAX_BASES: usize = 8;
/// Most bases our encoder names. Measured on a real second backup after OLTP, where rows move
/// between pages (`cargo bench --bench reduction`, 153 MB database): eight gave 0.123 of the
/// raw bytes, four 0.130 (`zstd --patch-from`: 0.108), and the WAL between the backups 0.153
/// against 0.167. (On a backup whose bulk had not changed, four did as well as eight.)
pub(crate) const SEND_BASES: usize = 8;
/// A base that shares a single anchor with a chunk is not worth its place in the dictionary.
/// Skipping chunks whose best base has one (a quarter of the candidates in a first backup) cost
/// 0.002 of the ratio and saved a fifth of the delta work. Leaving such bases out of the other
/// chunks' dictionaries too halved the dictionary bytes loaded (1195 to 706 MB for 252 MB of
/// WAL; loading them was 30% of the encoder's CPU): the encoder ran 20-40% faster for 0.003-0.004
/// more of the raw bytes (WAL 0.168 to 0.171, second backup 0.142 to 0.146; `cargo bench
/// --bench reduction -- --from DIR --wanopt-only`).
pub(crate) const MIN_VOTES: u32 = 2;
/// Anchors sit where the rolling hash's low seven bits are zero, or its top seven: about one
/// position in 64. The low bits depend on the last seven bytes only, so they put anchors at the
/// same place in rows that share a short pattern (a column's start), which finds similar rows
/// in a first copy; the top bits depend on the 64 bytes before, so they fall on content that
/// short patterns miss. Either alone cost 8% (the first copy of PostgreSQL text rows 0.1277
/// with the top bits against 0.1187 with both) or 7% (its changed copy 0.0845 with the low bits
/// against 0.0795).
pub(crate) const ANCHOR_LOW: u64 = 0x7F;
pub(crate) const ANCHOR_SHIFT: u32 = 57;
/// An anchor's key hashes this many bytes after it.
pub(crate) const ANCHOR_LEN: usize = 32;
/// Most anchors taken from one chunk (an 8 KiB chunk has about 64), bounding the work.
pub(crate) const MAX_ANCHORS: usize = 128;
/// Index slots per byte of store: one for every four anchors of a full store (a collision keeps
/// the newer chunk). A slot per anchor found no more (0.121 against 0.123 on the second backup)
/// for four times the memory.
const BYTES_PER_SLOT: usize = 512;
/// Chunk ids remembered per byte of store: chunks average 8 KiB, so the ring outlives the store
/// (smaller ones may be forgotten sooner, which costs only a base).
const BYTES_PER_ID: usize = 2048;
/// Chunks sent after a base on disk that are read ahead for the chunks to come. In a changed
/// logical dump (MariaDB's, 301 MB after a minute of sysbench OLTP, its first copy mostly on
/// the disk tier), the edited chunks lie tens of unchanged ones apart, so a shallow read-ahead
/// fetches chunks that go as references and misses the next base: the changed copy cost 5.28
/// MB reading 8 ahead, 4.33 MB 32, 3.25 MB 64, 3.40 MB 128, and 2.91 MB with every base in
/// memory (`zstd --patch-from`: 2.95 MB).
const PREFETCH: u32 = 64;
/// zstd's dictionary magic: a prefix starting with it would be read as a trained dictionary.
const DICT_MAGIC: [u8; 4] = [0x37, 0xA4, 0x30, 0xEC];

pub(crate) const GEAR: [u64; 256] = gear();

const fn gear() -> [u64; 256] {
    let mut g = [0u64; 256];
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let mut i = 0;
    while i < 256 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        g[i] = x;
        i += 1;
    }
    g
}

pub(crate) fn key(window: &[u8]) -> u64 {
    let mut k = 0x9E37_79B9_7F4A_7C15u64;
    for w in window.chunks_exact(8) {
        let mut b = [0u8; 8];
        b.copy_from_slice(w);
        k = (k ^ u64::from_le_bytes(b)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        k ^= k >> 31;
    }
    // Never zero: zero marks an empty index slot.
    k | 1 << 63
}

/// A run of a byte this long is padding (see [`anchors`]).
pub(crate) const PAD: usize = 8;
/// Raw bytes an anchor's key may span: a run longer than this (a zeroed page's tail) ends the
/// key's window.
pub(crate) const KEY_SPAN: usize = 512;
/// An anchor whose window holds fewer bytes than this, runs counted once, is filler and no
/// anchor.
pub(crate) const KEY_MIN: usize = 16;

/// The key of the anchor at the start of `data`: a hash of its next [`ANCHOR_LEN`] bytes with
/// each run of a byte counted once, within [`KEY_SPAN`] bytes; `None` if fewer than
/// [`KEY_MIN`] are found there. Rows padded with blanks (a `CHAR(n)` column, a fixed-width
/// record) or zeros (a page's free space) have most of their anchors in the padding, where 32
/// raw bytes are the same in every row and every chunk: such keys all voted for whichever
/// chunk last had them. Counting runs once takes the key past the padding to the next row's
/// own bytes. On a `pg_dump` of a pgbench database (rows of a key, two numbers and 84
/// blanks), a changed dump found a base for 3% of its bytes before and 97% after (0.0236 of
/// its bytes on the wire before, 0.0117 after; `zstd --patch-from`: 0.0094).
pub(crate) fn collapsed_key(data: &[u8]) -> Option<u64> {
    let data = &data[..data.len().min(KEY_SPAN)];
    // One byte more than a key holds: each byte is written, and kept by moving on only if it
    // differs from the one before (no branch to mispredict on text, where pairs are common).
    let mut w = [0u8; ANCHOR_LEN + 1];
    let mut n = 0;
    let mut last = u16::MAX;
    let mut at = 0;
    while at < data.len() {
        let b = data[at];
        w[n] = b;
        let new = u16::from(b) != last;
        n += usize::from(new);
        last = u16::from(b);
        if n == ANCHOR_LEN {
            break;
        }
        // Inside a run (padding, a zeroed page): eight bytes at a time, then one more (which
        // may end the run: the keys stay as they were first defined).
        if !new {
            while data
                .get(at..at + 8)
                .is_some_and(|e| <[u8; 8]>::try_from(e).is_ok_and(|e| e == [b; 8]))
            {
                at += 8;
            }
        }
        at += 1;
    }
    // The byte written last where a key shorter than the window ends was not kept.
    w[n] = 0;
    (n >= KEY_MIN).then(|| key(&w[..ANCHOR_LEN]) ^ n as u64)
}

/// The anchor keys of `data` (at most [`MAX_ANCHORS`], each once), into `out`.
///
/// A chunk with more candidates than that keeps those of the smallest rank, 32 bits of the
/// hash that the anchor test did not look at (a bottom-k sketch): which ones survive depends
/// on the content only, so an edited chunk and its original keep the same anchors from the
/// bytes they share, wherever those sit in either. Taking the first ones instead indexed only
/// the first half of a 32 KiB chunk, so a changed chunk that started in its second half found
/// no base. A candidate whose hash repeats one of the last few (filler, a repeated pattern)
/// is taken once, a candidate inside a run of one byte not at all, and the end of a run of
/// [`PAD`] or more is one, ranked by the bytes after it (see [`collapsed_key`] for why).
pub(crate) fn anchors(data: &[u8], out: &mut Vec<u64>) {
    out.clear();
    let end = data.len().saturating_sub(ANCHOR_LEN);
    // Two passes, each tight where one loop tested every byte for both (about a tenth of a
    // first copy's encoding time went here): the candidates of the rolling hash, then the ends
    // of padding. The order they are found in does not matter, what follows keeps the smallest.
    let mut h = 0u64;
    let mut recent = [u64::MAX; 4];
    for (i, &b) in data[..end].iter().enumerate() {
        h = (h << 1).wrapping_add(GEAR[usize::from(b)]);
        if h >> ANCHOR_SHIFT != 0 && h & ANCHOR_LOW != 0 {
            continue;
        }
        let rank = if h >> ANCHOR_SHIFT == 0 {
            h >> (ANCHOR_SHIFT - 32)
        } else {
            h >> 32
        };
        if !recent.contains(&h) {
            recent.rotate_right(1);
            recent[0] = h;
            // Inside a run, only its last byte: the run's bytes all have the same key.
            if data[i + 1] != b {
                out.push(rank << 32 | (i as u64 + 1));
            }
        }
    }
    pad_ends(data, end, out);
    if out.len() > MAX_ANCHORS {
        out.select_nth_unstable(MAX_ANCHORS);
        out.truncate(MAX_ANCHORS);
    }
    out.retain_mut(|v| {
        let at = (*v & 0xFFFF_FFFF) as usize;
        collapsed_key(&data[at..]).map(|k| *v = k).is_some()
    });
    out.sort_unstable();
    out.dedup();
}

/// The end of each run of one byte of [`PAD`] or more in `data[..end]` (the first byte after
/// it, if that is before `end`) as an anchor of its own, ranked by the 16 bytes there: what
/// follows padding is a record's own bytes. A run that long holds two positions four apart
/// that are multiples of four, so only those are compared until two are equal.
fn pad_ends(data: &[u8], end: usize, out: &mut Vec<u64>) {
    const _: () = assert!(PAD >= 8);
    debug_assert!(end + 16 <= data.len() || end == 0);
    let mut m = 0;
    while m + 4 < end {
        let b = data[m];
        if data[m + 4] != b {
            m += 4;
            continue;
        }
        let mut s = m;
        while s > 0 && data[s - 1] == b {
            s -= 1;
        }
        let mut e = m + 1;
        while e < end && data[e] == b {
            e += 1;
        }
        if e < end && e - s >= PAD {
            out.push(key(&data[e..e + 16]) >> 32 << 32 | e as u64);
        }
        m = e.next_multiple_of(4);
    }
}

/// What the store knows of a chunk besides its bytes.
struct Meta {
    id: u32,
    len: u32,
    /// The stream context that took it, and that context's position after it.
    origin: Option<(u64, u64)>,
}

/// The sender's store of chunks it sent, bounded in bytes, with an anchor index of fixed size:
/// each slot holds the newest chunk seen with that anchor, and a slot whose chunk has left the
/// store reads as empty. The bytes are in memory, or in memory in front of a disk tier (a
/// [`ChunkCache`] of our own, least recently used go first). The store holds bytes only;
/// whether the peer still holds a chunk is the mirror's to say.
pub struct Bases {
    bytes: ChunkCache,
    /// Memory the bytes may take.
    mem_limit: usize,
    meta: crate::fingerprint::FpMap<Meta>,
    /// Chunk id -> fingerprint, a ring: an id whose slot was reused is gone.
    ids: Vec<u32>,
    names: Vec<Fingerprint>,
    next_id: u32,
    /// Anchor key's high half | chunk id.
    table: Vec<u64>,
    /// Scratch for votes.
    votes: Vec<u32>,
}

impl std::fmt::Debug for Bases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bases")
            .field("capacity", &self.bytes.capacity())
            .field("size", &self.bytes.size())
            .field("chunks", &self.bytes.len())
            .finish()
    }
}

impl Bases {
    /// A store of up to `capacity` bytes of chunks in memory; its index takes about a
    /// fortieth of that again (8 bytes per 512 bytes of store, 20 per 2 KiB).
    pub fn new(capacity: usize) -> Self {
        Self::with_bytes(
            ChunkCache::new(capacity)
                .trust_memory()
                .lazy_recency()
                .quiet_bases(),
            capacity,
        )
    }

    /// A store of `mem_limit` bytes of memory in front of a disk tier of `disk_limit` bytes of
    /// files in `store` (which seals them at rest if it was given a key). The index is sized
    /// for everything the disk holds.
    pub fn tiered(mem_limit: usize, disk_limit: u64, store: Box<dyn ChunkStore>) -> Self {
        Self::with_bytes(
            ChunkCache::tiered(mem_limit, disk_limit, store)
                .trust_memory()
                .lazy_recency()
                .quiet_bases(),
            mem_limit,
        )
    }

    fn with_bytes(bytes: ChunkCache, mem_limit: usize) -> Self {
        let capacity = bytes.capacity();
        let slots = (capacity / BYTES_PER_SLOT).next_power_of_two().max(1024);
        let ids = (capacity / BYTES_PER_ID).next_power_of_two().max(1024);
        Bases {
            bytes,
            mem_limit: mem_limit.min(capacity),
            meta: Default::default(),
            // Zeroed vectors: the allocator hands out untouched pages, so an idle link's store
            // costs nothing until it fills.
            ids: vec![0; ids],
            names: vec![[0; 16]; ids],
            next_id: 1,
            table: vec![0; slots],
            votes: Vec::with_capacity(MAX_ANCHORS),
        }
    }

    /// Bytes of chunks held.
    pub fn size(&self) -> usize {
        self.bytes.size()
    }

    /// Chunks held.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Chunks evicted to stay within the store's bytes.
    pub fn evictions(&self) -> u64 {
        self.bytes.evictions()
    }

    /// Sizes and counts of the store's tiers.
    pub fn tier_stats(&self) -> TierStats {
        self.bytes.tier_stats()
    }

    /// Bytes of memory the store and its index may take at most.
    pub fn footprint(&self) -> usize {
        self.mem_limit + self.table.len() * 8 + self.ids.len() * 20
    }

    /// Marks a held chunk as used; false if it is not held.
    pub fn touch(&mut self, f: &Fingerprint) -> bool {
        if !self.bytes.contains(f) {
            return false;
        }
        self.bytes.touch(f);
        true
    }

    /// Keeps a chunk, indexed under its anchor `keys` (from [`anchors`]), evicting the least
    /// recently used to fit. One already held is only touched.
    pub fn insert(&mut self, f: Fingerprint, data: &[u8], keys: &[u64]) {
        self.insert_from(f, data, keys, None);
    }

    /// Like [`insert`](Self::insert), for a chunk a stream context took, ending at `origin`'s
    /// position of context `origin`'s serial.
    pub(crate) fn insert_from(
        &mut self,
        f: Fingerprint,
        data: &[u8],
        keys: &[u64],
        origin: Option<(u64, u64)>,
    ) {
        if self.touch(&f) || data.len() > self.bytes.capacity() {
            return;
        }
        self.bytes.insert(f, data.to_vec());
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1).max(1);
        let ring = self.ids.len() - 1;
        self.ids[id as usize & ring] = id;
        self.names[id as usize & ring] = f;
        let mask = self.table.len() - 1;
        for k in keys {
            // The newest chunk with an anchor wins its slot: a later version is the likelier base.
            self.table[*k as usize & mask] = (k & !0xFFFF_FFFF) | u64::from(id);
        }
        self.meta.insert(
            f,
            Meta {
                id,
                len: data.len() as u32,
                origin,
            },
        );
        // What the bytes evicted leaves the side table now and then (amortised).
        if self.meta.len() > 2 * self.bytes.len() + 1024 {
            let bytes = &self.bytes;
            self.meta.retain(|f, _| bytes.contains(f));
        }
    }

    /// Bytes of a held chunk, if it is held.
    pub(crate) fn held_len(&self, f: &Fingerprint) -> Option<usize> {
        self.meta
            .get(f)
            .filter(|_| self.bytes.contains(f))
            .map(|m| m.len as usize)
    }

    /// The bytes of a chunk held in memory, checked against its fingerprint (the disk tier is
    /// not read: this answers the peer at once, or not at all).
    pub(crate) fn peek(&self, f: &Fingerprint) -> Option<&[u8]> {
        self.bytes.peek(f)
    }

    /// True if a held chunk is still within the reach of the stream context `ctx` (serial,
    /// position now, window): compressed in it, it costs less than any delta.
    pub(crate) fn in_context(&self, f: &Fingerprint, ctx: (u64, u64, u64)) -> bool {
        self.meta.get(f).is_some_and(|m| {
            m.origin.is_some_and(|(serial, end)| {
                let start = end.saturating_sub(u64::from(m.len));
                serial == ctx.0 && ctx.1.saturating_sub(start) < ctx.2
            })
        })
    }

    /// The held chunk of id `id`, if it is still the one with that id.
    fn named(&self, id: u32) -> Option<Fingerprint> {
        let ring = self.ids.len() - 1;
        let (sid, f) = (self.ids[id as usize & ring], self.names[id as usize & ring]);
        (sid == id && self.meta.get(&f).is_some_and(|m| m.id == id) && self.bytes.contains(&f))
            .then_some(f)
    }

    /// The held chunks that share the most anchors with a chunk of anchor `keys`, up to
    /// `most` of those `usable` accepts, into `out` with the best last (nearest to the data in
    /// the dictionary, so cheapest to reference). Ties go to the newer chunk. Only chunks that
    /// share at least `min_votes` anchors.
    pub fn find(
        &mut self,
        keys: &[u64],
        (most, min_votes): (usize, u32),
        usable: impl Fn(&Fingerprint) -> bool,
        out: &mut Vec<Fingerprint>,
    ) {
        out.clear();
        let mask = self.table.len() - 1;
        self.votes.clear();
        for k in keys.iter().take(MAX_ANCHORS) {
            let e = self.table[*k as usize & mask];
            if e != 0 && e >> 32 == k >> 32 {
                self.votes.push(e as u32);
            }
        }
        if self.votes.is_empty() {
            return;
        }
        self.votes.sort_unstable();
        // Runs of equal ids, as (count, id), best first.
        let mut ranked: Vec<(u32, u32)> = Vec::with_capacity(self.votes.len());
        for &id in &self.votes {
            match ranked.last_mut() {
                Some((n, last)) if *last == id => *n += 1,
                _ => ranked.push((1, id)),
            }
        }
        ranked.sort_unstable_by(|a, b| b.cmp(a));
        for (votes, id) in ranked {
            let Some(f) = self.named(id).filter(|f| usable(f) && !out.contains(f)) else {
                continue;
            };
            // Ranked best first: the rest have fewer votes still.
            if votes < min_votes {
                break;
            }
            out.push(f);
            if out.len() >= most.min(MAX_BASES) {
                break;
            }
        }
        out.reverse();
    }

    /// The dictionary of `bases` (their bytes in order, each touched), into `out`. Bases whose
    /// bytes are not at hand (left the store, or still being read from disk) leave the list;
    /// false if none is left or the result would be read as a trained zstd dictionary.
    pub fn dictionary(&mut self, bases: &mut Vec<Fingerprint>, out: &mut Vec<u8>) -> bool {
        out.clear();
        let bytes = &mut self.bytes;
        bases.retain(|f| match bytes.lookup_base(f) {
            Lookup::Hit(d) => {
                out.extend_from_slice(d);
                true
            }
            Lookup::Miss | Lookup::Pending => false,
        });
        !bases.is_empty() && !is_dict_magic(out)
    }

    /// Keeps in `bases` those whose bytes are at hand now; a read from disk is started for
    /// the others (their bytes come with a later lookup). Returns how many of those left
    /// because they are being read (not because they are gone).
    pub(crate) fn at_hand(&mut self, bases: &mut Vec<Fingerprint>) -> usize {
        let bytes = &mut self.bytes;
        let mut reading = 0;
        bases.retain(|f| match bytes.lookup_base(f) {
            Lookup::Hit(_) => true,
            Lookup::Pending => {
                reading += 1;
                false
            }
            Lookup::Miss => false,
        });
        reading
    }

    /// Asks the disk tier for those of `bases` not in memory (their bytes come with a later
    /// lookup): before [`prefetch`](Self::prefetch), so that a chunk's own bases are read
    /// first.
    pub(crate) fn request(&mut self, bases: &[Fingerprint]) {
        for f in bases {
            if !self.bytes.in_memory(f) {
                let _ = self.bytes.lookup_base(f);
            }
        }
    }

    /// Asks the disk tier for the chunks sent after `base` (up to [`PREFETCH`] of them) that
    /// are not in memory: a stream like the one `base` came from will want them next, and they
    /// are at hand when it does (stream-informed prefetch, after Shilane et al.).
    pub fn prefetch(&mut self, base: &Fingerprint) {
        let Some(id) = self.meta.get(base).map(|m| m.id) else {
            return;
        };
        for next in 1..=PREFETCH {
            if let Some(f) = self.named(id.wrapping_add(next))
                && !self.bytes.in_memory(&f)
            {
                // Starts the read; the answer comes with a later lookup.
                let _ = self.bytes.lookup_base(&f);
            }
        }
    }

    /// The bytes of a held chunk, if they are in memory (a test's view).
    #[cfg(test)]
    fn get(&mut self, f: &Fingerprint) -> Option<Vec<u8>> {
        match self.bytes.lookup(f) {
            Lookup::Hit(d) => Some(d.to_vec()),
            _ => None,
        }
    }
}

/// The zstd level a delta is compressed at, for a stream at `level`. A delta's dictionary is
/// about seven times its chunk (6.6 bases on WAL), so loading the dictionary, not matching the
/// chunk, is most of its cost. Level 3's double-fast matcher fills two tables for it; level 2's
/// fast one (what zstd picks for inputs under 256 KiB) fills one: measured on the real WAL and
/// second backup (`cargo bench --bench reduction -- --zstd-level 3`), the dictionary fills went
/// from 13% of the run's CPU to 8% for 0.004-0.006 more of the raw bytes (WAL 0.157 against
/// 0.153). From level 4 up the lazy matchers earn their fill: at level 6 the second backup
/// costs 0.116 with level-6 deltas against 0.131 with level-3 ones.
pub(crate) fn delta_level(level: i32) -> i32 {
    if level <= 3 { level.min(2) } else { level }
}

/// Compresses `src` at `level` against `bases` (raw bytes the peer holds) into `out`, with a
/// window that holds the bases and the chunk and tables of up to `2^table_log` entries, instead
/// of the parameters zstd derives from the level and sizes. The frame is one any zstd decoder
/// reads with the same bytes as its raw-content dictionary.
///
/// The bases are referenced as the frame's prefix, not loaded as a dictionary: zstd then indexes
/// them once, as the window's own history (a loaded dictionary is indexed into a table of its
/// own and copied or attached), and its long-distance matcher sees them ([`DELTA_MATCHER`]). The
/// prefix has to outlive the context that references it, so each frame has a context of its
/// own: on the corpus's `pgbench` and `pgdump` pairs at level 1 (`cargo bench --bench reduction
/// -- --pairs DIR --zstd-level 1`) the changed copies cost 3.910 and 3.584 MB against 3.939 and
/// 3.621 MB with a reused context and a loaded dictionary, at the same speed (51 against 48 and
/// 31 against 33 MB/s; the machine's noise is wider). `src` is copied in right behind the bases
/// for the call (the buffer is given back as it came): zstd matches within one buffer faster
/// than across two.
///
/// Earlier, on `pgbench` (a loaded dictionary, reused context): at level 3 (level-2 deltas) the
/// changed copy cost 0.0295 of its bytes against 0.0348 with zstd's own parameters
/// (`compress_using_dict`), at level 6 0.0194 either way.
pub(crate) fn compress_delta(
    out: &mut Vec<u8>,
    bases: &mut Vec<u8>,
    src: &[u8],
    (level, table_log): (i32, u32),
) -> Option<usize> {
    let bases_len = bases.len();
    bases.extend_from_slice(src);
    let (prefix, src) = bases.split_at(bases_len);
    let n = compress_behind(out, prefix, src, (level, table_log));
    bases.truncate(bases_len);
    n
}

fn compress_behind(
    out: &mut Vec<u8>,
    bases: &[u8],
    src: &[u8],
    (level, table_log): (i32, u32),
) -> Option<usize> {
    use zstd::zstd_safe::{CCtx, CParameter};
    let total = (bases.len() + src.len()).max(1 << 10);
    // The window holds the bases and the chunks; the tables, at most 2^table_log entries.
    let window = (usize::BITS - (total - 1).leading_zeros()).clamp(10, 24);
    let table = window.min(table_log);
    let mut cctx = CCtx::try_create()?;
    cctx.set_parameter(CParameter::CompressionLevel(level))
        .ok()?;
    cctx.set_parameter(CParameter::WindowLog(window)).ok()?;
    cctx.set_parameter(CParameter::HashLog(table)).ok()?;
    cctx.set_parameter(CParameter::ChainLog(table)).ok()?;
    DELTA_MATCHER.apply(&mut cctx)?;
    cctx.ref_prefix(bases).ok()?;
    cctx.compress2(out, src).ok()
}

/// How a delta's frame looks for matches beyond what its level does: a deeper search of zstd's
/// match finder (`search_log`), and its long-distance matcher with matches of at least
/// `ldm_min` bytes. See [`DELTA_MATCHER`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Matcher {
    pub(crate) search_log: Option<u32>,
    pub(crate) ldm_min: Option<u32>,
}

impl Matcher {
    fn apply(&self, cctx: &mut zstd::zstd_safe::CCtx<'_>) -> Option<()> {
        use zstd::zstd_safe::CParameter;
        if let Some(s) = self.search_log {
            cctx.set_parameter(CParameter::SearchLog(s)).ok()?;
        }
        if let Some(m) = self.ldm_min {
            cctx.set_parameter(CParameter::EnableLongDistanceMatching(true))
                .ok()?;
            cctx.set_parameter(CParameter::LdmMinMatch(m)).ok()?;
        }
        Some(())
    }
}

/// The matcher of every delta frame: zstd's search 2^6 deep (the most its row match finder
/// takes; the lazy levels' own depth is 2^3-2^4) and long-distance matches of 128 bytes or more.
///
/// Padded rows (a dump's blank-filled columns, fixed-width records) fill zstd's hash chains with
/// positions of blanks, so the level's own search gives up before it reaches the chunk's base
/// when other bases that look alike lie nearer: on `a_delta_frame_is_plain_zstd_against_its_bases`
/// the frame then costs more than the chunk without any bases. The long-distance matcher finds
/// the base's rows whatever fills the chains; the deeper search finds the short matches between
/// edits. Measured on the corpus with every base in memory, so that no read from disk decides
/// which bases are at hand (`cargo bench --bench reduction -- --pairs DIR --wanopt-only
/// --zstd-level 1 --delta-mib 4096 --delta-disk-mib 0`), changed copies in MB against
/// `zstd --long=31 --patch-from`:
///
/// | matcher | innodb | kernel | pgbench | pgdump |
/// | --- | --- | --- | --- | --- |
/// | the level's own | 49.63 | 0.125 | 3.885 | 3.573 (1.24x) |
/// | search 2^6 | 49.66 | 0.118 | 3.871 | 3.182 (1.11x) |
/// | long matches (128) | 49.78 | 0.125 | 4.072 | 2.909 |
/// | long matches (64, zstd's default) | - | 0.125 | 4.259 | 3.121 |
/// | both | - | - | 4.069 | 2.900 (1.01x) |
/// | `--patch-from` | 49.20 | 0.108 | 3.897 | 2.875 |
///
/// Long matches cost the `pgbench` pages 5% (they take a long match elsewhere where the level's
/// own matcher would repeat the last offset) and the encoder a tenth of its speed on changed
/// copies (42 against 48 MB/s on `pgbench`, 28 against 34 on `pgdump`); they are kept because
/// without them a run whose bases look alike can cost more than no bases at all.
pub(crate) const DELTA_MATCHER: Matcher = Matcher {
    search_log: Some(6),
    ldm_min: Some(128),
};

/// Tables of a single chunk's delta: at most 2^15 entries (see [`compress_delta`]).
pub(crate) const DELTA_TABLE_LOG: u32 = 15;
/// Tables of a delta run's frame: it indexes up to `RUN_DICT` (1 MiB) of bases and `RUN_MAX`
/// (256 KiB) of chunks. Measured on the changed `pgbench` copy's deltas at level 6 (a scratch
/// prototype over the bench's chunks and bases): with 2^15 entries runs of 32 cost 44% more
/// than runs of 16; with 2^18, 0.4% less; 2^17 and 2^18 gave the same for runs of 16 (4.78
/// and 4.77 MB).
pub(crate) const RUN_TABLE_LOG: u32 = 17;
/// The zstd level of a delta run, for a stream at `level`: never below 6, where zstd's lazy
/// matcher starts. An edited page matched greedily breaks its long matches at every edit: on
/// the changed `pgbench` copy's 19,310 deltas, runs of up to 16 at level 5 cost 6.75 MB, at
/// level 6 4.77 MB, and one run's dictionary load and frame per 16 chunks make level 6 cost
/// about what level 1 did one chunk at a time (8.7 MB).
pub(crate) fn run_level(level: i32) -> i32 {
    level.max(6)
}

/// A mirror's reusable delta state.
pub(crate) struct SendScratch {
    pub(crate) keys: Vec<u64>,
    pub(crate) found: Vec<Fingerprint>,
    pub(crate) dict: Vec<u8>,
    /// Wire bytes per raw byte of recent literals.
    pub(crate) lit_ratio: f64,
    /// The last chunk tried had a base offered by the index (see `Report::no_base`).
    pub(crate) offered: bool,
    /// `keys` hold the next chunk's anchors already (found on the workers, see
    /// `crate::prepare`).
    pub(crate) keys_ready: bool,
}

impl Default for SendScratch {
    fn default() -> Self {
        SendScratch {
            keys: Vec::with_capacity(MAX_ANCHORS),
            found: Vec::with_capacity(MAX_BASES),
            dict: Vec::new(),
            lit_ratio: 0.5,
            offered: false,
            keys_ready: false,
        }
    }
}

/// A decoder's reusable delta state.
#[derive(Default)]
pub(crate) struct RecvScratch {
    pub(crate) dict: Vec<u8>,
    pub(crate) dctx: Option<DCtx<'static>>,
    /// A bare frame with its magic number put back.
    pub(crate) frame: Vec<u8>,
}

/// Bytes of a varint length.
pub(crate) fn len_len(n: usize) -> usize {
    match n {
        0..0x80 => 1,
        0x80..0x4000 => 2,
        _ => 3,
    }
}

/// True if the dictionary made of these bytes would be read as a trained zstd dictionary
/// rather than as content (the receiver refuses such a record, the sender never makes one).
pub(crate) fn is_dict_magic(dict: &[u8]) -> bool {
    dict.starts_with(&DICT_MAGIC)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::fingerprint;
    use crate::testdata::noise;

    fn put(b: &mut Bases, data: &[u8]) -> Fingerprint {
        let f = fingerprint(data);
        let mut keys = Vec::new();
        anchors(data, &mut keys);
        b.insert(f, data, &keys);
        f
    }

    #[test]
    fn an_edited_chunk_finds_its_original_and_noise_finds_nothing() {
        let mut b = Bases::new(1 << 20);
        let old = noise(1, 8192);
        let other = noise(2, 8192);
        let fo = put(&mut b, &old);
        put(&mut b, &other);
        let mut edited = old.clone();
        edited[4000..4010].copy_from_slice(b"0123456789");
        let (mut keys, mut out) = (Vec::new(), Vec::new());
        anchors(&edited, &mut keys);
        assert!(keys.len() > 4, "an 8 KiB chunk has anchors: {}", keys.len());
        b.find(&keys, (MAX_BASES, 1), |_| true, &mut out);
        assert_eq!(out, vec![fo]);
        // What the peer no longer holds is not offered.
        b.find(&keys, (MAX_BASES, 1), |f| *f != fo, &mut out);
        assert!(out.is_empty());
        anchors(&noise(3, 8192), &mut keys);
        b.find(&keys, (MAX_BASES, 1), |_| true, &mut out);
        assert!(out.is_empty());
    }

    /// A large chunk is indexed across all of it: an edited piece of its second half finds it.
    /// Filler gives a key once, not once per position.
    #[test]
    fn anchors_cover_a_whole_chunk_and_filler_once() {
        let mut b = Bases::new(1 << 20);
        let old = noise(4, 32 * 1024);
        let fo = put(&mut b, &old);
        let mut piece = old[20 * 1024..].to_vec();
        piece[100..110].copy_from_slice(b"0123456789");
        let (mut keys, mut out) = (Vec::new(), Vec::new());
        anchors(&piece, &mut keys);
        assert_eq!(keys.len(), MAX_ANCHORS);
        b.find(&keys, (MAX_BASES, MIN_VOTES), |_| true, &mut out);
        assert_eq!(
            out,
            vec![fo],
            "the second half of a 32 KiB chunk is indexed"
        );
        let mut padded = vec![b' '; 6000];
        padded.extend_from_slice(&noise(5, 2048));
        anchors(&padded, &mut keys);
        let mut unique = keys.clone();
        unique.dedup();
        assert_eq!(unique, keys);
        assert!(keys.len() < 64, "{} keys: filler counted once", keys.len());
    }

    /// Rows of a key, two numbers and 84 blanks (a `pg_dump` of pgbench's accounts), `rows` of
    /// them from key `from`, with every 30th row's balance changed.
    fn padded_rows(from: u64, rows: u64, changed: bool) -> Vec<u8> {
        let mut out = Vec::new();
        for aid in from..from + rows {
            let balance = if changed && aid % 30 == 7 {
                aid % 9973
            } else {
                0
            };
            out.extend_from_slice(format!("{aid}\t{}\t{balance}\t", aid / 100_000 + 1).as_bytes());
            out.extend_from_slice(&[b' '; 84]);
            out.push(b'\n');
        }
        out
    }

    /// Padding has no key of its own: a changed chunk of blank-padded rows finds the chunk it
    /// came from, not whichever chunk of such rows came last, and a chunk of nothing but
    /// padding has no anchors.
    #[test]
    fn padded_rows_find_their_own_original() {
        let mut b = Bases::new(16 << 20);
        let old = padded_rows(500_000, 200, false);
        let fo = put(&mut b, &old);
        for i in 0..50 {
            put(&mut b, &padded_rows(600_000 + i * 200, 200, false));
        }
        let (mut keys, mut out) = (Vec::new(), Vec::new());
        let edited = padded_rows(500_000, 200, true);
        anchors(&edited, &mut keys);
        assert!(keys.len() >= 16, "{} keys", keys.len());
        b.find(&keys, (MAX_BASES, MIN_VOTES), |_| true, &mut out);
        assert_eq!(out.last(), Some(&fo), "{} bases offered", out.len());
        anchors(&[b' '; 20_000], &mut keys);
        assert!(keys.is_empty(), "{} keys in blanks", keys.len());
        let mut zeros = vec![0u8; 8192];
        zeros[100..132].copy_from_slice(&noise(6, 32));
        anchors(&zeros, &mut keys);
        assert!(keys.len() <= 2, "{} keys in a zeroed page", keys.len());
    }

    /// A delta's frame is plain zstd: it rebuilds the chunk with the bases as its raw-content
    /// dictionary, also where the chunk's own base lies furthest back behind lookalikes, and it
    /// costs a fraction of the chunk compressed without them.
    #[test]
    fn a_delta_frame_is_plain_zstd_against_its_bases() {
        let mut bases = padded_rows(500_000, 2000, false);
        for i in 0..8 {
            bases.extend_from_slice(&padded_rows(600_000 + i * 2000, 2000, false));
        }
        let chunk = padded_rows(500_000, 2000, true);
        let cost = |mut bases: Vec<u8>| {
            let mut out = Vec::with_capacity(zstd::zstd_safe::compress_bound(chunk.len()));
            let n = compress_delta(&mut out, &mut bases, &chunk, (6, RUN_TABLE_LOG))
                .expect("compressed");
            let mut back = Vec::with_capacity(chunk.len());
            let mut dctx = DCtx::try_create().expect("a zstd context");
            dctx.decompress_using_dict(&mut back, &out, &bases)
                .expect("plain zstd");
            assert!(back == chunk, "rebuilt bytes differ");
            n
        };
        let (with, without) = (cost(bases), cost(Vec::new()));
        assert!(
            with * 3 <= without,
            "{with} bytes with bases, {without} without"
        );
    }

    #[test]
    fn the_store_stays_within_its_bytes_and_forgets_what_it_evicted() {
        let mut b = Bases::new(64 * 1024);
        let first = noise(10, 8192);
        let f0 = put(&mut b, &first);
        for i in 0..40 {
            put(&mut b, &noise(100 + i, 8192));
            assert!(b.size() <= 64 * 1024);
        }
        assert!(b.get(&f0).is_none());
        let (mut keys, mut out) = (Vec::new(), Vec::new());
        anchors(&first, &mut keys);
        b.find(&keys, (MAX_BASES, 1), |_| true, &mut out);
        assert!(out.is_empty(), "an evicted chunk is never a base");
        // A base in use leaves in its turn (the chunk its delta rebuilt supersedes it); a chunk
        // sent again as a reference stays.
        let (used, referenced) = (noise(500, 8192), noise(501, 8192));
        let (fu, fr) = (put(&mut b, &used), put(&mut b, &referenced));
        let mut uses = 0;
        for i in 0..40 {
            let mut d = Vec::new();
            uses += usize::from(b.dictionary(&mut vec![fu], &mut d));
            assert!(b.touch(&fr));
            put(&mut b, &noise(1000 + i, 8192));
        }
        assert!(uses > 0 && uses < 40, "used {uses} times, then gone");
        assert!(b.get(&fu).is_none());
        assert!(b.get(&fr).is_some());
    }

    #[test]
    fn ids_wrap_without_naming_a_wrong_chunk() {
        let mut b = Bases::new(16 * 1024);
        b.next_id = u32::MAX - 2;
        let mut all = Vec::new();
        for i in 0..8 {
            let d = noise(200 + i, 4096);
            all.push((put(&mut b, &d), d));
        }
        let (mut keys, mut out) = (Vec::new(), Vec::new());
        for (f, d) in &all {
            anchors(d, &mut keys);
            b.find(&keys, (MAX_BASES, 1), |_| true, &mut out);
            assert!(out.iter().all(|x| x == f), "only the chunk itself");
            assert_eq!(out.is_empty(), b.get(f).is_none());
        }
    }
}
