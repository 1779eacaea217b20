//! The receiving side of one direction: a [`Decoder`] rebuilds records into bytes against its
//! cache, checking every length against what the record and its frame announced before it
//! allocates, copies or decompresses. A context record is fed to its stream's context in
//! `in_context.rs`; a delta is rebuilt from its bases in `with_bases.rs`.

use crate::cache::{self, ChunkCache};
use crate::config::CodecConfig;
use crate::context::{LongContext, Run, Slots, StreamContext};
use crate::delta;
use crate::fingerprint::{Fingerprint, fingerprint};
use crate::format::{
    CodecError, MAX_RECORD, NO_CACHE, TAG_DELTA, TAG_DELTA_RUN, TAG_DELTA_RUN_BARE, TAG_LIT,
    TAG_LIT_CONTEXT, TAG_LIT_LZ4, TAG_LIT_ZSTD, TAG_LOG, TAG_RAW, TAG_REF, TAG_REF_RUN,
    TAG_REF_RUN_SHORT, TAG_RUN_END, get_len, get_varint,
};
use crate::prepare::{self, BATCH};
use in_context::Accept;

#[cfg(test)]
pub(crate) use ahead::record_len;
pub use ahead::{DecodeFrame, Feeding, Feeds, InOrder};

mod ahead;
mod in_context;
mod logged;
mod with_bases;

/// What a decoder rebuilt: chunks found in its cache (hits) and chunks that came as data.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeStats {
    pub hit_chunks: u64,
    pub hit_bytes: u64,
    pub lit_chunks: u64,
    pub lit_bytes: u64,
    pub delta_chunks: u64,
    pub delta_bytes: u64,
}

/// One direction's decoder with its cache.
pub struct Decoder {
    pub(crate) cache: ChunkCache,
    pub(crate) zstd: Option<zstd::bulk::Decompressor<'static>>,
    pub(crate) stats: DecodeStats,
    /// The stream contexts we accept (the link's count of them shared in its `Slots`), and
    /// whether we cache.
    pub(crate) accept: Accept,
    /// The context of [`Decoder::decode_record`]'s one stream.
    pub(crate) own: StreamContext,
    pub(crate) delta: delta::RecvScratch,
    /// Threads to decompress literals on ahead (see [`prepare`]); `None`: in turn.
    workers: Option<std::sync::Arc<dyn prepare::Workers>>,
    /// The slots a batch's jobs prepare in (see [`Decoder::decode_batch`]; kept for reuse).
    batch_slots: Vec<prepare::Prepared>,
    /// Bytes rebuilt that a worker copied into place (see [`Decoder::ahead_bytes`]).
    ahead_bytes: u64,
    /// Slots a run's chunks are fingerprinted in on the workers (kept for reuse).
    run_slots: Vec<prepare::Prepared>,
    /// The streams' logs, the names of reference runs the peer re-sent by their check (our
    /// log differed), and scratch for names.
    pub(crate) logs: crate::logs::Logs,
    pub(crate) resolved: std::collections::HashMap<Fingerprint, Vec<Fingerprint>>,
    pub(crate) names: Vec<Fingerprint>,
    /// The checks whose names we asked for, and whether the names must match the check (a
    /// reference run's do; a delta run's bases are checked by what they rebuild).
    asked: std::collections::HashMap<Fingerprint, bool>,
    /// Delta runs taken rebuilt ahead (see [`Decoder::runs_ahead`]).
    runs_ahead: u64,
    /// This decoder's number, which the frames it feeds carry (see [`Feeding`]).
    number: u64,
    /// Scratch for delta runs rebuilt ahead (see [`Feeding`]), shared with the feedings.
    scratch_ahead: std::sync::Arc<std::sync::Mutex<Vec<delta::RecvScratch>>>,
}

/// Literals a decoder prepares at once: the raw bytes they rebuild are allocated ahead, so at
/// most this many of them (and no more than their frame announced).
const PREPARE_BYTES: usize = 4 << 20;

/// One record [`scan`](Decoder::scan) found work for, the `n`th job of its batch: its offset
/// in the bytes scanned, tag, raw and payload lengths, the bytes its job works on, the work,
/// and where in the output what it rebuilds is to be placed (if anywhere).
struct Scanned {
    at: usize,
    tag: u8,
    raw: usize,
    clen: usize,
    source: Source,
    work: Option<prepare::Work>,
    place: Option<usize>,
}

/// What a job works on: a literal's payload (its place in the bytes scanned), or the chunk a
/// reference names, held in memory (a handle of its own, so the cache may change meanwhile).
enum Source {
    Payload(std::ops::Range<usize>),
    Held(bytes::Bytes),
    /// A run's chunks fed ahead, one after the other (handles of their own).
    Parts(Vec<bytes::Bytes>),
}

/// A batch being decoded while its jobs run (see [`Decoder::decode_batch`]).
struct Batch<'m, 'a> {
    meta: &'m [Scanned],
    ahead: &'m prepare::Ahead<'a>,
    /// The next record to look at.
    next: usize,
    /// The address of the output buffer the places were cut from.
    base: usize,
    /// Every job has run.
    settled: bool,
}

impl Batch<'_, '_> {
    /// Waits for every job (running those nobody has begun): after it, nothing writes into
    /// the output but the decoding thread, which may then grow it.
    fn settle(&mut self) {
        if !self.settled {
            self.ahead.finish_all();
            self.settled = true;
        }
    }

    /// What the job for the record at `at` with this tag and lengths made, taken once it has
    /// run, with where its bytes were placed in `out` (its offset, if they were and `out` is
    /// the buffer they were placed in). `None` if no job was made for that record; the batch is
    /// then settled, as it is when nothing was placed, since the caller writes `out` itself.
    fn take(
        &mut self,
        at: usize,
        tag: u8,
        raw: usize,
        clen: usize,
        out: &[u8],
    ) -> Option<(prepare::Prepared, Option<usize>)> {
        // Records are decoded in order: the next one is almost always the one looked for.
        let i = match self.meta.get(self.next) {
            Some(b) if b.at == at => Some(self.next),
            _ => self.meta.iter().position(|b| b.at == at),
        };
        let found = i.and_then(|i| {
            self.next = i + 1;
            let b = &self.meta[i];
            if b.tag != tag || b.raw != raw || b.clen != clen {
                return None;
            }
            let p = self.ahead.with(i, std::mem::take)?;
            let place = b
                .place
                .filter(|_| p.placed && out.as_ptr() as usize == self.base);
            Some((p, place))
        });
        if found.as_ref().is_none_or(|(_, place)| place.is_none()) {
            self.settle();
        }
        found
    }
}

impl Decoder {
    pub fn new(cfg: &CodecConfig) -> Self {
        let mut d = Self::with_capacity(cfg.cache_bytes, cfg.dedup);
        d.set_long_context(cfg.long, Slots::default());
        // Its encoder is this build's (`Encoder::new`): bases keep their place.
        d.cache.set_quiet_bases(true);
        d
    }

    /// A decoder whose cache holds `cache_bytes`; without `dedup` nothing is cached.
    pub fn with_capacity(cache_bytes: usize, dedup: bool) -> Self {
        Self::with_cache(ChunkCache::new(cache_bytes), dedup)
    }

    /// A decoder using `cache` (a two-tier one, or one restored from a snapshot).
    pub fn with_cache(cache: ChunkCache, dedup: bool) -> Self {
        Decoder {
            accept: Accept {
                dedup,
                ..Accept::default()
            },
            zstd: zstd::bulk::Decompressor::new().ok(),
            stats: DecodeStats::default(),
            own: StreamContext::default(),
            delta: delta::RecvScratch::default(),
            workers: None,
            batch_slots: Vec::new(),
            ahead_bytes: 0,
            run_slots: Vec::new(),
            logs: crate::logs::Logs::for_cache(cache.capacity()),
            resolved: std::collections::HashMap::new(),
            names: Vec::new(),
            asked: std::collections::HashMap::new(),
            runs_ahead: 0,
            number: ahead::decoder_number(),
            scratch_ahead: Default::default(),
            cache,
        }
    }

    /// The fingerprints of the chunks `bytes` holds one after the other, `lens` long, of those
    /// `wanted` (`None` for the others, and for any `bytes` does not hold): on the workers when
    /// there are two or more, since a run's chunks come out of one stream context in order and
    /// only their names can be found side by side.
    pub(crate) fn fingerprints_of(
        &mut self,
        bytes: &[u8],
        lens: impl Iterator<Item = (usize, bool)> + Clone,
        names: &mut Vec<Option<Fingerprint>>,
    ) {
        use prepare::{Job, Work};
        names.clear();
        let wanted = lens.clone().filter(|l| l.1).count();
        let Some(w) = self.workers.clone().filter(|_| wanted >= 2) else {
            let mut off = 0usize;
            for (len, want) in lens {
                let chunk = bytes.get(off..off.saturating_add(len));
                names.push(chunk.filter(|_| want).map(fingerprint));
                off = off.saturating_add(len);
            }
            return;
        };
        let n = lens.clone().count();
        let mut slots = std::mem::take(&mut self.run_slots);
        if slots.len() < n {
            slots.resize_with(n, Default::default);
        }
        {
            let mut jobs = Vec::with_capacity(wanted);
            let mut off = 0usize;
            for ((len, want), slot) in lens.zip(slots.iter_mut()) {
                slot.reset(len);
                let chunk = bytes.get(off..off.saturating_add(len));
                off = off.saturating_add(len);
                if let Some(chunk) = chunk.filter(|_| want) {
                    jobs.push(Job::new(chunk, Work::Fingerprint, slot));
                }
            }
            w.run(&mut jobs);
        }
        names.extend(slots[..n].iter().map(|s| s.fingerprint));
        self.run_slots = slots;
    }

    /// Decompresses literals on `workers` ahead, and has them copy what literals and held
    /// chunks rebuild straight into the output (see [`decode_batch`](Self::decode_batch)).
    pub fn set_workers(&mut self, workers: Option<std::sync::Arc<dyn prepare::Workers>>) {
        self.workers = workers;
    }

    /// Finds, among the whole records at the front of `buf` (up to [`BATCH`](BATCH) of them,
    /// rebuilding at most `room` bytes), the work the workers can do for them: literals alone
    /// decompressed and fingerprinted, and chunks held in memory for references copied (and
    /// checked against their names, if this cache checks what it holds). Each also gets its
    /// place in `out`'s spare room, reserved here: where its record will put what it rebuilds
    /// if every record before it rebuilds what it announces. The scan stops at the first record
    /// that is not a reference, a literal alone or a log's start; every record is still checked
    /// in full when it is decoded. Returns the bytes scanned, and the work (none for fewer than
    /// two records).
    fn scan(
        &mut self,
        buf: &[u8],
        room: usize,
        out: &mut Vec<u8>,
        stream: &StreamContext,
    ) -> (usize, Vec<Scanned>) {
        use prepare::Work;
        let room = room.min(PREPARE_BYTES);
        let start = out.len();
        // Literal bytes prepared, and where the next record's bytes go in `out`.
        let (mut at, mut raw, mut pos) = (0, 0, start);
        let mut found = Vec::new();
        // The stream's context records fed ahead, and its delta runs rebuilt ahead, the next
        // one first.
        let (mut fed, mut runs) = (stream.fed.iter(), stream.runs_fed.iter().peekable());
        // Held chunks are checked against their names on the workers, if this cache checks
        // what it holds.
        let check = self.cache.verifies_memory().then_some(Work::Fingerprint);
        while found.len() < BATCH {
            let Some(&first) = buf.get(at) else { break };
            let rec = &buf[at..];
            if first == TAG_REF {
                let Ok((len, h)) = get_len(rec, 17) else {
                    break;
                };
                // A chunk held in memory is copied into its place too (the record's lookup
                // then confirms it); any other reference is copied when it is decoded.
                let place = Some(pos).filter(|p| p - start + len <= room);
                let held = rec
                    .get(1..17)
                    .and_then(|f| <[u8; 16]>::try_from(f).ok())
                    .and_then(|f| self.cache.in_memory_handle(&f))
                    .filter(|c| c.len() == len);
                if let (Some(place), Some(chunk)) = (place, held) {
                    found.push(Scanned {
                        at,
                        tag: first,
                        raw: len,
                        clen: 0,
                        source: Source::Held(chunk),
                        work: check,
                        place: Some(place),
                    });
                }
                pos = pos.saturating_add(len);
                at += 17 + h;
                continue;
            }
            // A log's start rebuilds nothing: step over it. A reference run (whose length is
            // known only once its chunks are named) ends the batch: it copies its chunks on
            // the workers itself, and the records after it are prepared after it.
            if first == TAG_LOG {
                let Ok((_, h)) = get_varint(rec, 1) else {
                    break;
                };
                at += 1 + h;
                continue;
            }
            // A context record fed ahead: a run's chunks, if it ends one, copied into their
            // place on the workers (a record that does not rebuilds nothing here).
            if matches!(
                in_context::classify(first, false).0,
                TAG_LIT_CONTEXT | TAG_RUN_END
            ) {
                let Some(f) = fed.next().filter(|f| f.first == first && f.used > 0) else {
                    break;
                };
                match &f.result {
                    Ok(None) => {}
                    Ok(Some(pieces)) => {
                        let len = pieces.iter().map(|p| p.bytes.len()).sum::<usize>();
                        raw += len;
                        if raw > room {
                            break;
                        }
                        let Some(place) = Some(pos).filter(|p| p - start + len <= room) else {
                            break;
                        };
                        found.push(Scanned {
                            at,
                            tag: first,
                            raw: len,
                            clen: 0,
                            source: Source::Parts(pieces.iter().map(|p| p.bytes.clone()).collect()),
                            work: None,
                            place: Some(place),
                        });
                        pos = pos.saturating_add(len);
                    }
                    Err(_) => break,
                }
                at += f.used;
                continue;
            }
            // A delta run rebuilt ahead: its chunks copied into their place on the workers too
            // (its bases are still looked up when it is decoded).
            if matches!(first, TAG_DELTA_RUN | TAG_DELTA_RUN_BARE) {
                let Ok(head) = with_bases::run_head(rec, None) else {
                    break;
                };
                let lens = &head.lens[..head.n];
                let Some(r) = runs.next_if(|r| with_bases::fed_is(r, &head.check, lens)) else {
                    break;
                };
                raw += head.total;
                let place = Some(pos).filter(|p| p - start + head.total <= room);
                let (true, Some(place)) = (raw <= room, place) else {
                    break;
                };
                found.push(Scanned {
                    at,
                    tag: first,
                    raw: head.total,
                    clen: 0,
                    source: Source::Parts(r.pieces.iter().map(|p| p.bytes.clone()).collect()),
                    work: None,
                    place: Some(place),
                });
                pos = pos.saturating_add(head.total);
                at += head.payload.end;
                continue;
            }
            let tag = first & !NO_CACHE;
            if !matches!(tag, TAG_LIT | TAG_LIT_LZ4 | TAG_LIT_ZSTD) {
                break;
            }
            let hash = self.accept.dedup && first & NO_CACHE == 0;
            let Ok((raw_len, h1)) = get_len(rec, 1) else {
                break;
            };
            raw += raw_len;
            if raw > room {
                break;
            }
            let (clen, h2) = if tag == TAG_LIT {
                (raw_len, 0)
            } else {
                let Ok(l) = get_len(rec, 1 + h1) else { break };
                l
            };
            let payload_at = at + 1 + h1 + h2;
            let Some(end) = payload_at.checked_add(clen).filter(|e| *e <= buf.len()) else {
                break;
            };
            // Placed only within what the frame announced (bounded as `room` is).
            let place = Some(pos).filter(|p| p - start + raw_len <= room);
            pos = pos.saturating_add(raw_len);
            let work = match tag {
                TAG_LIT_LZ4 => Some(Work::Unlz4 { raw_len, hash }),
                TAG_LIT_ZSTD => Some(Work::Unzstd { raw_len, hash }),
                _ => hash.then_some(Work::Fingerprint),
            };
            if work.is_some() || place.is_some() {
                found.push(Scanned {
                    at,
                    tag: first,
                    raw: raw_len,
                    clen,
                    source: Source::Payload(payload_at..end),
                    work,
                    place,
                });
            }
            at = end;
        }
        if found.len() < 2 {
            return (at, Vec::new());
        }
        // Room for every byte placed, so that what the records before write does not move it.
        let placed_end = found
            .iter()
            .filter_map(|f| f.place.map(|p| p + f.raw))
            .max()
            .unwrap_or(start);
        out.reserve(placed_end - start);
        (at, found)
    }

    /// Decodes the records of `records` from `*used` up to `end` (what [`scan`](Self::scan)
    /// scanned from `*used`, finding `found`) while the workers do their work, as
    /// [`decode_frame`](Self::decode_frame) does; the decoding thread takes each record's work
    /// when it comes to it (doing it itself if no worker has begun it, or waiting for the one
    /// that has), and counts in what the job placed in `out`. A record whose work is not all
    /// the job's, or not placed where it is appended, first waits for every job (see
    /// [`Batch::settle`]): only then is `out` written or grown. What stopped it, if anything.
    #[allow(clippy::too_many_arguments)]
    fn decode_batch(
        &mut self,
        w: &dyn prepare::Workers,
        records: &[u8],
        used: &mut usize,
        end: usize,
        out: &mut Vec<u8>,
        stream: &mut StreamContext,
        (start, announced): (usize, usize),
        mut found: Vec<Scanned>,
    ) -> Option<CodecError> {
        use prepare::{Ahead, Job, Place};
        let from = *used;
        let scanned = &records[from..end];
        let mut slots = std::mem::take(&mut self.batch_slots);
        slots.resize_with(found.len().max(slots.len()), Default::default);
        // Only places in order, apart and within the room reserved.
        let (mut free_from, cap) = (out.len(), out.capacity());
        for f in &mut found {
            f.place = f
                .place
                .filter(|&p| p >= free_from && p.checked_add(f.raw).is_some_and(|e| e <= cap));
            free_from = f.place.map_or(free_from, |p| p + f.raw);
        }
        let base = out.as_mut_ptr();
        let mut jobs = Vec::with_capacity(found.len());
        for (f, slot) in found.iter().zip(slots.iter_mut()) {
            slot.reset(f.raw);
            let bytes: &[u8] = match &f.source {
                Source::Payload(r) => &scanned[r.clone()],
                Source::Held(b) => b,
                Source::Parts(_) => &[],
            };
            // SAFETY: `p..p + f.raw` is within `out`'s capacity, past its length when the batch
            // began and apart from every other job's place (checked above). Until this job has
            // run, the decoding thread neither writes nor reads those bytes nor moves the
            // buffer: it counts them in only after `Ahead::with` of this job (`put_rebuilt`),
            // and anything else that writes or grows `out` comes after `Batch::settle`, which
            // waits for every job. `out` outlives the jobs.
            let room = f
                .place
                .map(|p| unsafe { Place::raw(base.add(p).cast(), f.raw) });
            jobs.push(match (&f.source, room) {
                (Source::Parts(parts), Some(room)) => Job::parts(parts, slot, room),
                (_, room) => Job::placed(bytes, f.work, slot, room),
            });
        }
        let weight = found.iter().map(|f| f.raw as u64).sum();
        let ahead = Ahead::new(jobs, weight);
        let mut batch = Batch {
            meta: &found,
            ahead: &ahead,
            next: 0,
            base: base as usize,
            settled: false,
        };
        let mut stop = None;
        w.overlap(&ahead, &mut || {
            while *used < end {
                let room = announced.saturating_sub(out.len() - start);
                let rec = Some((*used - from, &mut batch));
                match self.decode_record_at(&records[*used..], out, stream, room, rec) {
                    Ok(k) => *used += k,
                    Err(e) => {
                        stop = Some(e);
                        break;
                    }
                }
            }
        });
        drop(ahead);
        self.batch_slots = slots;
        stop
    }

    /// Counts in the `n` bytes a job placed at `place` if they are next in `out`, in the buffer
    /// they were placed in; else waits for the batch's jobs (if any) and appends `bytes`, the
    /// record's, itself. True if they were placed.
    fn put_rebuilt(
        out: &mut Vec<u8>,
        place: Option<usize>,
        bytes: &[u8],
        batch: Option<&mut Batch<'_, '_>>,
    ) -> bool {
        let (len, n) = (out.len(), bytes.len());
        if place == Some(len) && out.capacity() - len >= n {
            // SAFETY: `Batch::take` gives a place only for this very buffer (its address is the
            // one the places were cut from, after reserving room for all of them), only once
            // the job is done, and only if the job wrote the record's `n` bytes there (`placed`:
            // it writes a place only when what it copies fills it exactly); the records before
            // this one rebuilt exactly what they announced (each is checked, and a batch holds
            // only records that append what they rebuild), so they filled the buffer up to this
            // place and did not write past it. Those `n` bytes are initialized, and they are the
            // record's: the caller checked its decompressed length, or found the referenced
            // chunk (the bytes copied ahead are the chunk held under the same fingerprint).
            unsafe { out.set_len(len + n) };
            return true;
        }
        if let Some(b) = batch {
            b.settle();
        }
        out.extend_from_slice(bytes);
        false
    }

    /// Counts in the `len` bytes of `pieces` a job placed at `place`, one after the other, if
    /// they are next in `out` (as [`put_rebuilt`](Self::put_rebuilt) does); else waits for the
    /// batch's jobs (if any) and appends them itself.
    fn put_pieces(
        &mut self,
        out: &mut Vec<u8>,
        pieces: &[crate::context::Piece],
        len: usize,
        place: Option<usize>,
        batch: Option<&mut Batch<'_, '_>>,
    ) {
        let n = out.len();
        if place == Some(n) && out.capacity() - n >= len {
            // SAFETY: as in `put_rebuilt`: `Batch::take` gives a place only in this very buffer
            // and once its job is done, which wrote exactly the pieces' `len` bytes there, one
            // after the other (`placed`); the records before this one filled the buffer up to it.
            unsafe { out.set_len(n + len) };
            self.ahead_bytes += len as u64;
        } else {
            if let Some(b) = batch {
                b.settle();
            }
            for p in pieces {
                out.extend_from_slice(&p.bytes);
            }
        }
        debug_assert!(
            out.ends_with(
                &pieces
                    .iter()
                    .flat_map(|p| p.bytes.to_vec())
                    .collect::<Vec<u8>>()
            )
        );
    }

    /// Counts this decoder's short stream contexts in `slots`, shared with the link's other
    /// decoders of the lane: [`DECODER_CONTEXTS`](crate::DECODER_CONTEXTS) (about 1 MiB each
    /// after a run) is then the link's bound, however many scopes it has.
    pub fn share_context_slots(&mut self, slots: Slots) {
        self.accept.contexts = slots;
    }

    /// Accepts long contexts of at most `long`'s window, and twice its streams at once (counted
    /// in `slots`, shared by the link's decoders): the sender gives a context back when its
    /// stream ends, which may be before we have read that stream's last record. `None` refuses
    /// them: a record asking for one is malformed.
    pub fn set_long_context(&mut self, long: Option<LongContext>, slots: Slots) {
        self.accept.long = long.map(|l| (l, slots));
    }

    /// Stream contexts in use.
    pub fn contexts(&self) -> usize {
        self.accept.contexts.in_use()
    }

    /// Counts of what was rebuilt so far.
    pub fn stats(&self) -> DecodeStats {
        self.stats
    }

    /// Delta runs a worker rebuilt ahead, while the frames before theirs were decoded, that
    /// their records took (each checked against the record's check there, its bases looked up
    /// in order here as any run's are).
    pub fn runs_ahead(&self) -> u64 {
        self.runs_ahead
    }

    /// Of the bytes rebuilt so far, those a worker copied into place (literals alone and chunks
    /// held, see [`set_workers`](Self::set_workers)), which the decoding thread only counted in.
    pub fn ahead_bytes(&self) -> u64 {
        self.ahead_bytes
    }

    pub fn cache(&self) -> &ChunkCache {
        &self.cache
    }

    /// Test hook: the cache, to damage it.
    #[doc(hidden)]
    pub fn cache_mut(&mut self) -> &mut ChunkCache {
        &mut self.cache
    }

    /// Adds a chunk the peer re-sent after a miss; false (and nothing added) unless it matches
    /// its fingerprint. Or, for a reference run we could not name from our log, keeps the
    /// names the peer re-sent if they match the run's check (see [`logs`](crate::logs)).
    pub fn insert_verified(&mut self, f: Fingerprint, data: &[u8]) -> bool {
        if data.len() > MAX_RECORD {
            return false;
        }
        if fingerprint(data) == f {
            self.cache.insert(f, data.to_vec());
            return true;
        }
        let k = data.len() / 16;
        if k == 0 || !data.len().is_multiple_of(16) || k > crate::logs::MAX_REF_RUN {
            return false;
        }
        // Only names we asked for.
        let Some(verify) = self.asked.remove(&f) else {
            return false;
        };
        let names: Vec<Fingerprint> = data
            .chunks_exact(16)
            .map(|c| {
                let mut n = [0u8; 16];
                n.copy_from_slice(c);
                n
            })
            .collect();
        if verify && !crate::fingerprint::check_matches(names.iter(), &f) {
            return false;
        }
        // A few runs at a time are ever waiting for their names.
        if self.resolved.len() >= 64 {
            self.resolved.clear();
        }
        self.resolved.insert(f, names);
        true
    }

    /// A miss of a run's `check`: the peer answers with the names we lack (which must match
    /// the check if `verify`).
    pub(crate) fn ask(&mut self, check: Fingerprint, verify: bool) -> CodecError {
        // A few runs at a time are ever waiting for their names.
        if self.asked.len() >= 64 {
            self.asked.clear();
        }
        self.asked.insert(check, verify);
        CodecError::Miss(check)
    }

    /// Logs a cached chunk of the stream whose log is `log` (none: the stream keeps none).
    pub(crate) fn log_chunk(&mut self, log: Option<u32>, f: Fingerprint) {
        if let Some(serial) = log {
            self.logs.append(serial, f);
        }
    }

    /// Decodes the first whole record of `buf` of a decoder used by one stream (its context is
    /// the decoder's own); see [`Decoder::decode_record_in`].
    pub fn decode_record(&mut self, buf: &[u8], out: &mut Vec<u8>) -> Result<usize, CodecError> {
        let mut own = std::mem::take(&mut self.own);
        let r = self.decode_record_in(buf, out, &mut own);
        self.own = own;
        r
    }

    /// Decodes the first whole record of `buf`, a record of the stream whose zstd context is
    /// `stream`, appending its bytes to `out`; returns how many input bytes it used. Lengths
    /// are checked before anything is allocated. On a miss nothing is used or appended.
    pub fn decode_record_in(
        &mut self,
        buf: &[u8],
        out: &mut Vec<u8>,
        stream: &mut StreamContext,
    ) -> Result<usize, CodecError> {
        self.decode_record_within(buf, out, stream, usize::MAX)
    }

    /// Like [`decode_record_in`](Self::decode_record_in), for a record that may rebuild at most
    /// `room` bytes (what its frame announced and the records before it did not use): one whose
    /// header says more is refused before a cached chunk is copied or anything decompressed,
    /// so a frame of references cannot make the receiver expand it beyond what it paid for.
    pub fn decode_record_within(
        &mut self,
        buf: &[u8],
        out: &mut Vec<u8>,
        stream: &mut StreamContext,
        room: usize,
    ) -> Result<usize, CodecError> {
        self.decode_record_at(buf, out, stream, room, None)
    }

    /// Like [`decode_record_within`](Self::decode_record_within); with `rec`, for the record at
    /// that offset of the bytes [`scan`](Self::scan) was given, using what its job in that
    /// batch made.
    fn decode_record_at(
        &mut self,
        buf: &[u8],
        out: &mut Vec<u8>,
        stream: &mut StreamContext,
        room: usize,
        rec: Option<(usize, &mut Batch<'_, '_>)>,
    ) -> Result<usize, CodecError> {
        let (rec_at, mut batch) = rec.unzip();
        let fits = |n: usize| {
            if n > room {
                Err(CodecError::Malformed(
                    "record rebuilds more than its frame announced",
                ))
            } else {
                Ok(())
            }
        };
        let Some(&first) = buf.first() else {
            return Err(CodecError::Incomplete);
        };
        let (tag, cache, _) = in_context::classify(first, self.accept.dedup);
        // Any record but those a batch prepares (or steps over) writes the output itself: not
        // while jobs may still write into it.
        if !matches!(
            tag,
            TAG_REF
                | TAG_LIT
                | TAG_LIT_LZ4
                | TAG_LIT_ZSTD
                | TAG_LOG
                | TAG_LIT_CONTEXT
                | TAG_RUN_END
                | TAG_DELTA_RUN
                | TAG_DELTA_RUN_BARE
        ) && let Some(b) = batch.as_deref_mut()
        {
            b.settle();
        }
        let mut prepared =
            |tag: u8, raw: usize, clen: usize, out: &[u8]| match (rec_at, batch.as_deref_mut()) {
                (Some(at), Some(b)) => b.take(at, tag, raw, clen, out),
                _ => None,
            };
        let need = |n: usize| {
            if buf.len() < n {
                Err(CodecError::Incomplete)
            } else {
                Ok(())
            }
        };
        // An open run (see `DEFERRED`) takes only context literals and its end.
        // Records fed ahead of this one leave the run as it is after them: the one to feed
        // next knows whether a run is open here.
        let open = match stream.fed.front() {
            Some(next) => next.open_before,
            None => !stream.run.is_empty(),
        };
        if open && tag != TAG_LIT_CONTEXT && tag != TAG_RUN_END {
            return Err(CodecError::Malformed("a run left unfinished"));
        }

        match tag {
            TAG_RAW => {
                let (len, h) = get_len(buf, 1)?;
                fits(len)?;
                let at = 1 + h;
                need(at + len)?;
                out.extend_from_slice(&buf[at..at + len]);
                Ok(at + len)
            }
            TAG_REF => {
                need(17)?;
                let mut f = [0u8; 16];
                f.copy_from_slice(&buf[1..17]);
                let (len, h) = get_len(buf, 17)?;
                fits(len)?;
                // Copied (and checked) ahead on a worker, if it was held in memory then.
                let (place, checked) = match prepared(first, len, 0, out) {
                    Some((p, place)) => (place, p.fingerprint == Some(f)),
                    None => (None, false),
                };
                let chunk = match self.cache.lookup_checked(&f, checked) {
                    cache::Lookup::Hit(c) => c,
                    cache::Lookup::Miss => return Err(CodecError::Miss(f)),
                    cache::Lookup::Pending => return Err(CodecError::Pending(f)),
                };
                if chunk.len() != len {
                    return Err(CodecError::Malformed(
                        "reference length differs from the chunk",
                    ));
                }
                // Copied ahead from this very chunk (held under its fingerprint), or here.
                let ahead = Self::put_rebuilt(out, place, chunk, batch.as_deref_mut());
                debug_assert!(out.ends_with(chunk));
                self.ahead_bytes += if ahead { len as u64 } else { 0 };
                self.stats.hit_chunks += 1;
                self.stats.hit_bytes += len as u64;
                self.log_chunk(stream.log, f);
                Ok(17 + h)
            }
            TAG_LIT => {
                let (len, h) = get_len(buf, 1)?;
                fits(len)?;
                let at = 1 + h;
                need(at + len)?;
                let chunk = &buf[at..at + len];
                let (f, place) = match prepared(first, len, len, out) {
                    Some((p, place)) => (p.fingerprint, place),
                    None => (None, None),
                };
                let ahead = Self::put_rebuilt(out, place, chunk, batch.as_deref_mut());
                debug_assert!(out.ends_with(chunk));
                self.ahead_bytes += if ahead { len as u64 } else { 0 };
                self.stats.lit_chunks += 1;
                self.stats.lit_bytes += len as u64;
                if cache {
                    let f = f.unwrap_or_else(|| fingerprint(chunk));
                    self.cache.insert(f, chunk.to_vec());
                    self.log_chunk(stream.log, f);
                }
                Ok(at + len)
            }
            TAG_LIT_CONTEXT | TAG_RUN_END => {
                // Fed ahead (on a worker), or here.
                match stream.fed.pop_front() {
                    Some(fed) if fed.first == first => {
                        if let Some(pieces) = fed.result? {
                            let len = pieces.iter().map(|p| p.bytes.len()).sum::<usize>();
                            // Copied into place ahead on a worker, if the batch made a job of it.
                            let place = prepared(first, len, 0, out).and_then(|p| p.1);
                            self.rebuild_pieces(pieces, out, stream, room, place, batch)?;
                        }
                        Ok(fed.used)
                    }
                    Some(_) => Err(CodecError::Malformed("records out of step")),
                    None => {
                        if let Some(b) = batch {
                            b.settle();
                        }
                        let (used, run) =
                            in_context::context_record(first, buf, stream, room, &self.accept)?;
                        if let Some(run) = run {
                            self.rebuild_run(run, out, stream);
                        }
                        Ok(used)
                    }
                }
            }
            TAG_LIT_LZ4 | TAG_LIT_ZSTD => {
                let (raw_len, h1) = get_len(buf, 1)?;
                fits(raw_len)?;
                let (clen, h2) = get_len(buf, 1 + h1)?;
                let at = 1 + h1 + h2;
                need(at + clen)?;
                let payload = &buf[at..at + clen];
                // Decompressed ahead on a worker (into exactly the announced size), or here.
                let (chunk, f, place) = match prepared(first, raw_len, clen, out) {
                    Some((p, place)) if p.decoded => (p.out, p.fingerprint, place),
                    _ => (self.decompress(tag, payload, raw_len)?, None, None),
                };
                if chunk.len() != raw_len {
                    return Err(CodecError::Decompress);
                }
                let ahead = Self::put_rebuilt(out, place, &chunk, batch);
                debug_assert!(out.ends_with(&chunk));
                self.ahead_bytes += if ahead { raw_len as u64 } else { 0 };
                self.stats.lit_chunks += 1;
                self.stats.lit_bytes += raw_len as u64;
                if cache {
                    let f = f.unwrap_or_else(|| fingerprint(&chunk));
                    self.cache.insert(f, chunk);
                    self.log_chunk(stream.log, f);
                }
                Ok(at + clen)
            }
            TAG_DELTA => {
                fits(get_len(buf, 1)?.0)?;
                self.decode_delta(buf, out, stream.log)
            }
            TAG_DELTA_RUN | TAG_DELTA_RUN_BARE => {
                // Its chunks rebuilt ahead and copied into place on a worker, if the batch made
                // a job of it.
                let place = match rec_at {
                    Some(_) => {
                        let total = with_bases::run_head(buf, None).map_or(0, |h| h.total);
                        prepared(first, total, 0, out).and_then(|p| p.1)
                    }
                    None => None,
                };
                self.decode_delta_run(buf, out, room, stream, (place, batch))
            }
            TAG_LOG => {
                let (serial, h) = get_varint(buf, 1)?;
                let serial = u32::try_from(serial)
                    .map_err(|_| CodecError::Malformed("log serial beyond 32 bits"))?;
                stream.log = Some(serial);
                Ok(1 + h)
            }
            TAG_REF_RUN | TAG_REF_RUN_SHORT => self.decode_ref_run(buf, out, stream.log, room),
            _ => Err(CodecError::Malformed("unknown record")),
        }
    }

    /// A run rebuilt whole out of its stream's context (see [`in_context::context_record`]):
    /// its chunks in order, named first (on the workers, if any), appended to `out` and cached.
    /// Its buffer is kept for the stream's next run.
    fn rebuild_run(&mut self, run: Run, out: &mut Vec<u8>, stream: &mut StreamContext) {
        let Run { bytes, chunks } = run;
        let mut names = Vec::with_capacity(chunks.len());
        self.fingerprints_of(&bytes, chunks.iter().copied(), &mut names);
        let mut off = 0;
        for ((len, cached), name) in chunks.into_iter().zip(names) {
            // The run's bytes are its chunks' (`context_record` fed exactly their sum).
            let chunk = &bytes[off..off + len];
            off += len;
            out.extend_from_slice(chunk);
            self.stats.lit_chunks += 1;
            self.stats.lit_bytes += len as u64;
            if cached {
                let f = name.unwrap_or_else(|| fingerprint(chunk));
                self.cache.insert(f, chunk.to_vec());
                self.log_chunk(stream.log, f);
            }
        }
        stream.run_bytes = bytes;
        stream.run_bytes.clear();
    }

    /// The chunks of a run fed ahead (see [`Feeding`]), appended to `out` and cached (named
    /// where they were fed), within `room`.
    fn rebuild_pieces(
        &mut self,
        pieces: Vec<crate::context::Piece>,
        out: &mut Vec<u8>,
        stream: &StreamContext,
        room: usize,
        place: Option<usize>,
        batch: Option<&mut Batch<'_, '_>>,
    ) -> Result<(), CodecError> {
        let len = pieces.iter().map(|p| p.bytes.len()).sum::<usize>();
        if len > room {
            return Err(CodecError::Malformed(
                "record rebuilds more than its frame announced",
            ));
        }
        self.put_pieces(out, &pieces, len, place, batch);
        for p in pieces {
            self.stats.lit_chunks += 1;
            self.stats.lit_bytes += p.bytes.len() as u64;
            if let Some(f) = p.name {
                self.cache.insert_bytes(f, p.bytes);
                self.log_chunk(stream.log, f);
            }
        }
        Ok(())
    }

    /// A literal alone's payload decompressed.
    fn decompress(
        &mut self,
        tag: u8,
        payload: &[u8],
        raw_len: usize,
    ) -> Result<Vec<u8>, CodecError> {
        // Decompression is bounded by the announced size: a bomb is an error.
        if tag == TAG_LIT_LZ4 {
            lz4_flex::block::decompress(payload, raw_len).map_err(|_| CodecError::Decompress)
        } else {
            self.zstd
                .as_mut()
                .ok_or(CodecError::Decompress)?
                .decompress(payload, raw_len)
                .map_err(|_| CodecError::Decompress)
        }
    }

    /// Decodes every whole record at the front of `buf`; returns the bytes used.
    /// With workers, literals are prepared [`BATCH`](BATCH) records at a time.
    pub fn decode(&mut self, buf: &[u8], out: &mut Vec<u8>) -> Result<usize, CodecError> {
        let mut own = std::mem::take(&mut self.own);
        let (used, stop) = self.decode_frame(buf, out, &mut own, usize::MAX);
        self.own = own;
        match stop {
            None | Some(CodecError::Incomplete) => Ok(used),
            Some(e) => Err(e),
        }
    }

    /// Decodes a link's coded frame: the records of one stream's turn, in `stream`'s context,
    /// appending what they rebuild to `out`, at most `announced` bytes (what the frame
    /// announced). With workers, literals alone are decompressed on them (and chunks held for
    /// references copied) a batch at a time, beside the records that use them
    /// ([`decode_batch`](Self::decode_batch)). Returns the record
    /// bytes used, and what stopped it before the end: a miss (the records before it are
    /// decoded), a truncated record, or damage.
    pub fn decode_frame(
        &mut self,
        records: &[u8],
        out: &mut Vec<u8>,
        stream: &mut StreamContext,
        announced: usize,
    ) -> (usize, Option<CodecError>) {
        let start = out.len();
        let mut used = 0;
        // Where the next batch is looked for (past what the last scan looked at).
        let mut next = 0;
        let stop = loop {
            if used == records.len() {
                break None;
            }
            let room = announced.saturating_sub(out.len() - start);
            if used >= next
                && let Some(w) = self.workers.clone()
            {
                let (scanned, found) = self.scan(&records[used..], room, out, stream);
                next = used + scanned.max(1);
                if !found.is_empty() {
                    let end = used + scanned;
                    let got = (start, announced);
                    let stop =
                        self.decode_batch(&*w, records, &mut used, end, out, stream, got, found);
                    if stop.is_some() {
                        break stop;
                    }
                    continue;
                }
            }
            match self.decode_record_at(&records[used..], out, stream, room, None) {
                Ok(k) => used += k,
                Err(e) => break Some(e),
            }
        };
        (used, stop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mirror::encode_raw;

    /// Raw records rebuild as they are and are never cached; a reference to a chunk the cache
    /// does not hold is a miss; an unknown tag is malformed.
    #[test]
    fn raw_records_rebuild_and_unknown_references_miss() {
        let mut dec = Decoder::new(&CodecConfig::default());
        let mut wire = Vec::new();
        encode_raw(b"redo", &mut wire);
        let mut out = Vec::new();
        assert_eq!(dec.decode(&wire, &mut out), Ok(wire.len()));
        assert_eq!(out, b"redo");
        let f = fingerprint(b"never sent");
        let mut r = vec![TAG_REF];
        r.extend_from_slice(&f);
        put(&mut r, 10);
        assert_eq!(dec.decode(&r, &mut Vec::new()), Err(CodecError::Miss(f)));
        assert!(matches!(
            dec.decode(&[0x3f, 0, 0], &mut Vec::new()),
            Err(CodecError::Malformed(_))
        ));
    }

    fn put(out: &mut Vec<u8>, n: usize) {
        crate::format::put_len(out, n);
    }
}
