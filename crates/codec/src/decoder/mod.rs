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
    CodecError, MAX_RECORD, TAG_DELTA, TAG_DELTA_RUN, TAG_DELTA_RUN_BARE, TAG_LIT, TAG_LIT_CONTEXT,
    TAG_LIT_LZ4, TAG_LIT_ZSTD, TAG_LOG, TAG_RAW, TAG_REF, TAG_REF_RUN, TAG_REF_RUN_SHORT,
    TAG_RUN_END, get_len, get_varint,
};
use crate::prepare;
use batch::Batch;
use in_context::Accept;

#[cfg(test)]
pub(crate) use ahead::record_len;
pub use ahead::{Feeding, Feeds};
pub use handed::HandedOn;
pub use in_order::{DecodeFrame, InOrder};

mod ahead;
mod batch;
mod handed;
mod in_context;
mod in_order;
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
    pub(crate) resolved: crate::fingerprint::FpMap<Vec<Fingerprint>>,
    pub(crate) names: Vec<Fingerprint>,
    /// The checks whose names we asked for, and whether the names must match the check (a
    /// reference run's do; a delta run's bases are checked by what they rebuild).
    asked: crate::fingerprint::FpMap<bool>,
    /// Delta runs taken rebuilt ahead (see [`Decoder::runs_ahead`]).
    runs_ahead: u64,
    /// Literals alone taken decompressed ahead (see [`Decoder::lits_ahead`]).
    lits_ahead: u64,
    /// This decoder's number, which the frames it feeds carry (see [`Feeding`]).
    number: u64,
    /// Scratch for delta runs rebuilt ahead (see [`Feeding`]), shared with the feedings.
    scratch_ahead: std::sync::Arc<std::sync::Mutex<Vec<delta::RecvScratch>>>,
    /// The chunks handed on so far, while [`Decoder::decode_frame_handing`] decodes.
    handing: Option<HandedOn>,
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
            resolved: Default::default(),
            names: Vec::new(),
            asked: Default::default(),
            runs_ahead: 0,
            lits_ahead: 0,
            number: ahead::decoder_number(),
            scratch_ahead: Default::default(),
            handing: None,
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

    /// How many literals alone were taken decompressed ahead, with their frames fed on the
    /// workers (see [`feed_ahead`](Self::feed_ahead)).
    pub fn lits_ahead(&self) -> u64 {
        self.lits_ahead
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
                | TAG_REF_RUN
                | TAG_REF_RUN_SHORT
        ) && let Some(b) = batch.as_deref_mut()
        {
            b.settle();
        }
        let mut prepared = |tag: u8, raw: usize, clen: usize, out: &[u8], handed: bool| match (
            rec_at,
            batch.as_deref_mut(),
        ) {
            // A record handed on writes nothing into `out`: the other jobs go on.
            (Some(at), Some(b)) if handed => b.take_handed(at, tag, raw, clen),
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
                let (place, checked) = match prepared(first, len, 0, out, false) {
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
                let (f, place) = match prepared(first, len, len, out, false) {
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
                            // Handed on as they are (the scan made no job of them), or copied
                            // into place ahead on a worker, if the batch made a job of it.
                            let place = match self.handing {
                                Some(_) => None,
                                None => prepared(first, len, 0, out, false).and_then(|p| p.1),
                            };
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
                // Decompressed ahead with its frame (on a worker), if it was fed: taken if it
                // was made from this very payload, else every literal fed is let go.
                let fed = match stream.lits_fed.front() {
                    Some(l) if l.is_for(first, raw_len, payload) => stream.lits_fed.pop_front(),
                    Some(_) => {
                        stream.lits_fed.clear();
                        None
                    }
                    None => None,
                };
                let handing = self.handing.is_some();
                let (chunk, f, place) = match fed {
                    // Handed on as it is (the scan made no job of it), or copied into place
                    // on a worker, if the batch made a job of it.
                    Some(l) => {
                        self.lits_ahead += 1;
                        let place = match handing {
                            true => None,
                            false => prepared(first, raw_len, 0, out, false).and_then(|p| p.1),
                        };
                        (l.piece.bytes, l.piece.name, place)
                    }
                    // Decompressed ahead on a worker (into exactly the announced size), or here.
                    // Handed on, it waits for no other job (its scan gave it no place).
                    None => match prepared(first, raw_len, clen, out, handing) {
                        Some((p, place)) if p.decoded => (p.out.into(), p.fingerprint, place),
                        _ => (self.decompress(tag, payload, raw_len)?.into(), None, None),
                    },
                };
                if chunk.len() != raw_len {
                    return Err(CodecError::Decompress);
                }
                // Handed on as it is (a buffer of its own, the one the cache keeps), if the
                // caller takes chunks so: nothing written into `out`, so the batch's jobs go
                // on beside it (and a batch's scan kept it no place there).
                if !self.hand(out.len(), &chunk) {
                    let ahead = Self::put_rebuilt(out, place, &chunk, batch);
                    debug_assert!(out.ends_with(&chunk));
                    self.ahead_bytes += if ahead { raw_len as u64 } else { 0 };
                }
                self.stats.lit_chunks += 1;
                self.stats.lit_bytes += raw_len as u64;
                if cache {
                    let f = f.unwrap_or_else(|| fingerprint(&chunk));
                    self.cache.insert_bytes(f, chunk);
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
                        prepared(first, total, 0, out, false).and_then(|p| p.1)
                    }
                    None => None,
                };
                let mut settle = || {
                    if let Some(b) = batch.as_deref_mut() {
                        b.settle();
                    }
                };
                self.decode_delta_run(buf, out, room, stream, (place, &mut settle))
            }
            TAG_LOG => {
                let (serial, h) = get_varint(buf, 1)?;
                let serial = u32::try_from(serial)
                    .map_err(|_| CodecError::Malformed("log serial beyond 32 bits"))?;
                stream.log = Some(serial);
                Ok(1 + h)
            }
            TAG_REF_RUN | TAG_REF_RUN_SHORT => match batch {
                // Within a batch (the scan made it a job): counted in where its job copied its
                // chunks, else copied here once the jobs that write into `out` are done.
                Some(b) => {
                    let placed = rec_at.and_then(|at| b.placed_run(at, first, out));
                    let mut settle = || b.settle();
                    let in_batch = logged::InBatch {
                        placed,
                        settle: &mut settle,
                    };
                    self.decode_ref_run(buf, out, stream.log, room, Some(in_batch))
                }
                None => self.decode_ref_run(buf, out, stream.log, room, None),
            },
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
            self.stats.lit_chunks += 1;
            self.stats.lit_bytes += len as u64;
            // Handed on in a buffer of its own (the one the cache keeps), if the caller takes
            // chunks so; else copied into `out`.
            let own =
                (cached || self.handing.is_some()).then(|| bytes::Bytes::copy_from_slice(chunk));
            match &own {
                Some(b) if self.hand(out.len(), b) => {}
                _ => out.extend_from_slice(chunk),
            }
            if let (true, Some(b)) = (cached, own) {
                let f = name.unwrap_or_else(|| fingerprint(&b));
                self.cache.insert_bytes(f, b);
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
        mut batch: Option<&mut Batch<'_, '_>>,
    ) -> Result<(), CodecError> {
        let len = pieces.iter().map(|p| p.bytes.len()).sum::<usize>();
        if len > room {
            return Err(CodecError::Malformed(
                "record rebuilds more than its frame announced",
            ));
        }
        // Handed on as they are, if the decoder hands chunks on: nothing written into `out`,
        // so the batch's jobs go on beside them.
        if self.handing.is_some() {
            for p in &pieces {
                self.hand(out.len(), &p.bytes);
            }
        } else {
            let mut settle = || {
                if let Some(b) = batch.as_deref_mut() {
                    b.settle();
                }
            };
            self.put_pieces(out, &pieces, len, place, &mut settle);
        }
        for p in pieces {
            self.stats.lit_chunks += 1;
            self.stats.lit_bytes += p.bytes.len() as u64;
            // Named here if the feeding left it (see `Decoder::feed_after`).
            if let Some(f) = p.name.or_else(|| p.cached.then(|| fingerprint(&p.bytes))) {
                self.cache.insert_bytes(f, p.bytes);
                self.log_chunk(stream.log, f);
            }
        }
        Ok(())
    }

    /// Counts in the `len` bytes of `pieces` a job placed at `place`, one after the other, if
    /// they are next in `out` (as [`put_rebuilt`](Self::put_rebuilt) does); else `settle`s
    /// (waits for the batch's jobs, if any) and appends them itself.
    fn put_pieces(
        &mut self,
        out: &mut Vec<u8>,
        pieces: &[crate::context::Piece],
        len: usize,
        place: Option<usize>,
        settle: &mut dyn FnMut(),
    ) {
        let n = out.len();
        if place == Some(n) && out.capacity() - n >= len {
            // SAFETY: as in `put_rebuilt`: `Batch::take` gives a place only in this very buffer
            // and once its job is done, which wrote exactly the pieces' `len` bytes there, one
            // after the other (`placed`); the records before this one filled the buffer up to it.
            unsafe { out.set_len(n + len) };
            self.ahead_bytes += len as u64;
        } else {
            settle();
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

    /// What is left of a frame that `announced` bytes, once it rebuilt what `out` holds past
    /// `start.0` and the chunks handed on past `start.1`.
    fn room(&self, out: &[u8], start: (usize, usize), announced: usize) -> usize {
        let copied = out.len().saturating_sub(start.0);
        let handed = self.handed_bytes().saturating_sub(start.1);
        announced.saturating_sub(copied.saturating_add(handed))
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
        // What the frame rebuilt so far: copied into `out` past `start`, and handed on.
        let start = (out.len(), self.handed_bytes());
        let mut used = 0;
        // Where the next batch is looked for (past what the last scan looked at).
        let mut next = 0;
        let stop = loop {
            if used == records.len() {
                break None;
            }
            let room = self.room(out, start, announced);
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
