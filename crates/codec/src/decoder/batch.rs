//! A decoding batch: the records at the front of a frame whose work the workers can do while
//! the decoder's thread decodes them in order (literals decompressed, chunks held or rebuilt
//! ahead copied into their place in the output), and how their bytes are counted in.

use super::Decoder;
use super::{in_context, with_bases};
use crate::context::StreamContext;
use crate::fingerprint::Fingerprint;
use crate::format::{
    CodecError, NO_CACHE, TAG_DELTA_RUN, TAG_DELTA_RUN_BARE, TAG_LIT, TAG_LIT_CONTEXT, TAG_LIT_LZ4,
    TAG_LIT_ZSTD, TAG_LOG, TAG_REF, TAG_REF_RUN, TAG_REF_RUN_SHORT, TAG_RUN_END, get_len,
    get_varint,
};
use crate::prepare::{self, BATCH};

/// Literals a decoder prepares at once: the raw bytes they rebuild are allocated ahead, so at
/// most this many of them (and no more than their frame announced).
const PREPARE_BYTES: usize = 4 << 20;

/// One record [`scan`](Decoder::scan) found work for, the `n`th job of its batch: its offset
/// in the bytes scanned, tag, raw and payload lengths, the bytes its job works on, the work,
/// and where in the output what it rebuilds is to be placed (if anywhere).
pub(super) struct Scanned {
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
    /// A run's chunks, one after the other (handles of their own): fed ahead, or held for a
    /// reference run, with their names to check them against if the cache checks what it
    /// holds.
    Parts(Vec<bytes::Bytes>, Vec<Fingerprint>),
}

/// A batch being decoded while its jobs run (see [`Decoder::decode_batch`]).
pub(super) struct Batch<'m, 'a> {
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
    pub(super) fn settle(&mut self) {
        if !self.settled {
            self.ahead.finish_all();
            self.settled = true;
        }
    }

    /// What the job for the record at `at` made, as [`take`](Self::take) takes it, for a
    /// record handed on (it writes nothing into the output, so the other jobs go on): no place.
    pub(super) fn take_handed(
        &mut self,
        at: usize,
        tag: u8,
        raw: usize,
        clen: usize,
    ) -> Option<(prepare::Prepared, Option<usize>)> {
        let i = self.index_of(at)?;
        self.next = i + 1;
        let b = &self.meta[i];
        if b.tag != tag || b.raw != raw || b.clen != clen {
            return None;
        }
        Some((self.ahead.with(i, std::mem::take)?, None))
    }

    /// Where the job for the reference run at `at` (whose first byte is `tag`) copied its
    /// chunks, taken once it has run, and the chunks it copied: if the scan made one, it placed
    /// them, and `out` is the buffer they were placed in (as [`take`](Self::take) says).
    pub(super) fn placed_run(
        &mut self,
        at: usize,
        tag: u8,
        out: &[u8],
    ) -> Option<(usize, Vec<bytes::Bytes>)> {
        let b = self.index_of(at).map(|i| &self.meta[i])?;
        let (Source::Parts(parts, _), true) = (&b.source, b.tag == tag) else {
            return None;
        };
        let (parts, raw) = (parts.clone(), b.raw);
        let (_, place) = self.take(at, tag, raw, 0, out)?;
        Some((place?, parts))
    }

    /// Which of the batch's records is the one at `at`, if any.
    fn index_of(&self, at: usize) -> Option<usize> {
        // Records are decoded in order: the next one is almost always the one looked for.
        match self.meta.get(self.next) {
            Some(b) if b.at == at => Some(self.next),
            _ => self.meta.iter().position(|b| b.at == at),
        }
    }

    /// What the job for the record at `at` with this tag and lengths made, taken once it has
    /// run, with where its bytes were placed in `out` (its offset, if they were and `out` is
    /// the buffer they were placed in). `None` if no job was made for that record; the batch is
    /// then settled, as it is when nothing was placed, since the caller writes `out` itself.
    pub(super) fn take(
        &mut self,
        at: usize,
        tag: u8,
        raw: usize,
        clen: usize,
        out: &[u8],
    ) -> Option<(prepare::Prepared, Option<usize>)> {
        let found = self.index_of(at).and_then(|i| {
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
    /// Finds, among the whole records at the front of `buf` (up to [`BATCH`](BATCH) of them,
    /// rebuilding at most `room` bytes), the work the workers can do for them: literals alone
    /// decompressed and fingerprinted, and chunks held in memory for references copied (and
    /// checked against their names, if this cache checks what it holds). Each also gets its
    /// place in `out`'s spare room, reserved here: where its record will put what it rebuilds
    /// if every record before it rebuilds what it announces. Reference runs whose chunks can be
    /// named now and are all held in memory are copied into their place too. The scan stops at
    /// the first record that is not a reference, such a reference run, a literal alone, a
    /// log's start or one rebuilt ahead; every record is still checked in full when it is
    /// decoded. Returns the bytes scanned, and the work (none for fewer than two records).
    pub(super) fn scan(
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
        // A reference run's names.
        let mut names = Vec::new();
        let mut found = Vec::new();
        // The stream's context records fed ahead, and its delta runs rebuilt ahead, the next
        // one first.
        let (mut fed, mut runs) = (stream.fed.iter(), stream.runs_fed.iter().peekable());
        // Its literals alone decompressed ahead, the next one first, while they match the
        // records (the record lets them all go at the first that does not).
        let mut lits = Some(stream.lits_fed.iter().peekable());
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
                let held = place
                    .and_then(|_| rec.get(1..17))
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
            // A log's start rebuilds nothing: step over it.
            if first == TAG_LOG {
                let Ok((_, h)) = get_varint(rec, 1) else {
                    break;
                };
                at += 1 + h;
                continue;
            }
            // A reference run whose chunks can be named now (from our log, or the names the
            // peer re-sent), all held in memory: copied into its place on the workers, each
            // chunk checked against its name there if the cache checks what it holds (the
            // record names and looks them up again when it is decoded). Any other ends the
            // batch: it copies its chunks on the workers itself, and the records after it are
            // prepared after it.
            if matches!(first, TAG_REF_RUN | TAG_REF_RUN_SHORT) {
                let Ok(head) = super::logged::ref_run_head(rec) else {
                    break;
                };
                let Some(n) = self
                    .ref_run_len(&head, &mut names)
                    .filter(|n| pos - start + n <= room)
                else {
                    break;
                };
                let held: Option<Vec<_>> = names
                    .iter()
                    .map(|f| self.cache.in_memory_handle(f))
                    .collect();
                let Some(parts) = held else {
                    break;
                };
                let names = if check.is_some() {
                    names.clone()
                } else {
                    Vec::new()
                };
                found.push(Scanned {
                    at,
                    tag: first,
                    raw: n,
                    clen: 0,
                    source: Source::Parts(parts, names),
                    work: None,
                    place: Some(pos),
                });
                pos += n;
                at += head.used;
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
                    // Handed on as they are, if the decoder hands chunks on: nothing of them
                    // goes into `out`.
                    Ok(Some(_)) if self.handing.is_some() => {}
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
                            source: Source::Parts(
                                pieces.iter().map(|p| p.bytes.clone()).collect(),
                                Vec::new(),
                            ),
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
                    source: Source::Parts(
                        r.pieces.iter().map(|p| p.bytes.clone()).collect(),
                        Vec::new(),
                    ),
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
            // A compressed literal is handed on as it is, if the decoder hands chunks on:
            // nothing of it goes into `out`, and it has no place there.
            let handed = tag != TAG_LIT && self.handing.is_some();
            // Placed only within what the frame announced (bounded as `room` is).
            let place = Some(pos).filter(|p| !handed && p - start + raw_len <= room);
            // Decompressed ahead with its frame: handed on, or its chunk copied into its place
            // on the workers.
            if tag != TAG_LIT
                && let Some(l) = lits.as_mut().and_then(|l| l.peek().copied())
            {
                if l.is_for(first, raw_len, &buf[payload_at..end]) {
                    lits.as_mut().and_then(Iterator::next);
                    if handed {
                        at = end;
                        continue;
                    }
                    pos = pos.saturating_add(raw_len);
                    if let Some(place) = place {
                        found.push(Scanned {
                            at,
                            tag: first,
                            raw: raw_len,
                            clen: 0,
                            source: Source::Parts(vec![l.piece.bytes.clone()], Vec::new()),
                            work: None,
                            place: Some(place),
                        });
                    }
                    at = end;
                    continue;
                }
                lits = None;
            }
            if !handed {
                pos = pos.saturating_add(raw_len);
            }
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
    pub(super) fn decode_batch(
        &mut self,
        w: &dyn prepare::Workers,
        records: &[u8],
        used: &mut usize,
        end: usize,
        out: &mut Vec<u8>,
        stream: &mut StreamContext,
        (start, announced): ((usize, usize), usize),
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
            if matches!(
                f.work,
                Some(prepare::Work::Unlz4 { .. } | prepare::Work::Unzstd { .. })
            ) {
                slot.buffer(f.raw);
            }
            let bytes: &[u8] = match &f.source {
                Source::Payload(r) => &scanned[r.clone()],
                Source::Held(b) => b,
                Source::Parts(..) => &[],
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
                (Source::Parts(parts, names), Some(room)) => Job::parts(parts, names, slot, room),
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
                let room = self.room(out, start, announced);
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
    pub(super) fn put_rebuilt(
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
}
