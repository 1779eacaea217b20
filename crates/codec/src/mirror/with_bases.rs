//! Deltas: a chunk sent as zstd against similar chunks both caches hold, found through the
//! store of what was sent ([`Bases`](crate::delta::Bases)), when that costs less than a literal.

use bytes::Bytes;

use crate::context::RESTART_WINDOWS;
use crate::format::Out;
use crate::maker::{Kind, Op, RunJob, What, make_run, run_record};

use super::{Hint, Mirror};
use crate::config::{Compression, Policy, Pressure};

use crate::delta::{
    ACCEPT, Bases, DELTA_TABLE_LOG, MAX_BASES, MIN_VOTES, RUN_TABLE_LOG, SEND_BASES, anchors,
    compress_delta, delta_level, len_len, run_level,
};
use crate::fingerprint::{Fingerprint, run_check};
use crate::format::{
    MAX_RUN_BASES, MAX_RUN_CHUNKS, RUN_DICT, RUN_MAX, TAG_DELTA, put_len, put_varint,
};
use crate::report::{Report, Sent};

/// Chunks after which the sender ends a delta run (a receiver takes up to `MAX_RUN_CHUNKS`).
/// Measured on the corpus at a fixed level 1 (`--pairs --zstd-level 1`), with turns of 128 KiB
/// gathered: runs of up to 8 chunks against 16, the first mariadb-dump copy after the InnoDB
/// pair 0.1287 against 0.1542 of its bytes (0.1286 before turns gathered, when 64 KiB turns
/// ended runs sooner); every other copy within 0.0004 (pgbench's changed copy 0.0110 against 0.0109).
pub(crate) const SEND_RUN_CHUNKS: usize = 8;
/// Bytes of bases a turn's delta runs left to be made may hold (four runs' worth of the most a
/// run names, [`RUN_DICT`]); past it, a run is written at once.
pub(crate) const PLANNED_BASES: usize = 4 * RUN_DICT;
const _: () = assert!(SEND_RUN_CHUNKS <= MAX_RUN_CHUNKS);

impl Mirror {
    /// Deltas are tried for a cacheable chunk of a stream that is neither latency-class nor
    /// CPU-bound nor noise, when zstd may be used and there is a store.
    pub(crate) fn delta_wanted(&self, policy: &Policy, pressure: Pressure, hint: &Hint) -> bool {
        self.bases.is_some()
            && policy.dedup
            && !policy.latency
            && pressure == Pressure::LinkBound
            && hint.skip == 0
            && matches!(
                policy.compression,
                Compression::Zstd | Compression::Adaptive
            )
    }

    /// Appends a delta record for `chunk` if similar chunks the peer holds make one that pays;
    /// the chunk then joins the cache and the store. `None`: nothing was written (the anchors are
    /// kept for [`keep_base`](Self::keep_base)).
    pub(crate) fn encode_delta(
        &mut self,
        f: Fingerprint,
        chunk: &[u8],
        policy: &Policy,
        hint: &mut Hint,
        out: &mut impl Out,
    ) -> Option<Report> {
        let best = self.find_bases(chunk, hint)?;
        let shared = self.bases.clone()?;
        let mut bases = shared.lock().ok()?;
        let d = &mut self.delta;
        if take_bases(&mut bases, &mut d.found, &best, (f, policy), hint) {
            return Some(Report::wait());
        }
        if !bases.dictionary(&mut d.found, &mut d.dict) {
            return None;
        }
        self.scratch.clear();
        self.scratch
            .reserve(zstd::zstd_safe::compress_bound(chunk.len()));
        compress_delta(
            &mut self.scratch,
            &mut d.dict,
            chunk,
            (delta_level(self.zstd_level), DELTA_TABLE_LOG),
        )?;
        let clen = self.scratch.len();
        let n = d.found.len();
        let wire = 1 + len_len(chunk.len()) + 1 + 16 * (n + 1) + len_len(clen) + clen;
        if wire as f64 >= chunk.len() as f64 * d.lit_ratio * ACCEPT {
            return None;
        }
        let run_end = self.end_run(hint, out);
        hint.interrupted = true;
        let d = &mut self.delta;
        out.put_u8(TAG_DELTA);
        put_len(out, chunk.len());
        out.put_u8(n as u8);
        // The peer looks the bases up in this order: the mirror touches them in it.
        for b in &d.found {
            out.put_slice(b);
            self.cache.touch_base(b);
        }
        out.put_slice(&f);
        put_len(out, clen);
        out.put_slice(&self.scratch[..clen]);
        self.cache.insert_len(f, chunk.len());
        // A miss of a base is answered with the chunk itself.
        self.recent
            .put_with(f, chunk.len(), || Bytes::copy_from_slice(chunk));
        bases.insert(f, chunk, &d.keys);
        drop(bases);
        self.log_chunk(hint, f);
        Some(Report {
            sent: Sent::Delta,
            raw: chunk.len(),
            wire,
            run_end,
            no_base: false,
        })
    }

    /// Keeps a chunk just sent as a literal of `wire` bytes as a future base (its anchors are
    /// the ones [`encode_delta`](Self::encode_delta) computed), and learns what literals cost.
    pub(crate) fn keep_base(
        &mut self,
        f: Fingerprint,
        chunk: &[u8],
        wire: Option<usize>,
        hint: &Hint,
    ) {
        let d = &mut self.delta;
        if let Some(wire) = wire {
            d.lit_ratio += (wire as f64 / chunk.len().max(1) as f64 - d.lit_ratio) / 16.0;
        }
        // Where the stream context that took it (if one did) has it.
        let origin = self
            .context
            .and(hint.context.as_ref())
            .map(|c| (c.serial, c.pos));
        if let Some(mut bases) = self.bases.as_ref().and_then(|b| b.lock().ok()) {
            bases.insert_from(f, chunk, &d.keys, origin);
        }
    }

    /// Learns what literals cost from a run of `n` of them: `raw` bytes sent as `wire`, as `n`
    /// literals flushed alone would teach it.
    pub(crate) fn learn_run(&mut self, raw: usize, wire: usize, n: usize) {
        let d = &mut self.delta;
        let weight = (n as f64 / 16.0).min(1.0);
        d.lit_ratio += (wire as f64 / raw.max(1) as f64 - d.lit_ratio) * weight;
    }

    /// A chunk sent as a reference stays a base; one the store lacks (a cache resumed after a
    /// restart) joins it.
    pub(crate) fn ref_base(&mut self, f: Fingerprint, chunk: &[u8]) {
        let Some(mut bases) = self.bases.as_ref().and_then(|b| b.lock().ok()) else {
            return;
        };
        if !bases.touch(&f) {
            anchors(chunk, &mut self.delta.keys);
            bases.insert(f, chunk, &self.delta.keys);
        }
    }
}

/// Writes one base of a delta run's list: by its `place` in a log if it has one (relative to
/// the `prev` base placed, when in the same log), else by its fingerprint. Returns the place
/// the next base is relative to. A varint `v`: 0, the fingerprint follows; odd, the same log as
/// the previous placed base, at its index + 1 + zigzag((v - 1) / 2); even, log v / 2 - 1, its
/// index (a varint) follows.
pub(crate) fn put_base(
    out: &mut Vec<u8>,
    name: &Fingerprint,
    place: Option<(u32, u64)>,
    prev: Option<(u32, u64)>,
) -> Option<(u32, u64)> {
    match (place, prev) {
        (None, _) => {
            out.push(0);
            out.extend_from_slice(name);
            prev
        }
        (Some((s, i)), Some((ps, pi))) if s == ps => {
            let d = i.wrapping_sub(pi.wrapping_add(1)) as i64;
            let zz = ((d << 1) ^ (d >> 63)) as u64;
            put_varint(out, 1 + 2 * zz);
            place
        }
        (Some((s, i)), _) => {
            put_varint(out, 2 + 2 * u64::from(s));
            put_varint(out, i);
            place
        }
    }
}

/// Chunks gathered for one delta run record (`TAG_DELTA_RUN`), in the stream's order: their
/// bytes one after another; each one's fingerprint, length, the end of its anchor keys in
/// `keys` and whether its literal would go in the stream's context; the union of their bases
/// in dictionary order, and the bases' bytes. Its chunks enter neither cache until the run is
/// flushed, so none is another's base, and the peer's cache sees the same order.
///
/// A run the sender gathers ends after [`SEND_RUN_CHUNKS`] chunks.
#[derive(Default)]
pub(crate) struct Run {
    pub(crate) bytes: Vec<u8>,
    pub(crate) chunks: Vec<(Fingerprint, usize, usize, bool)>,
    keys: Vec<u64>,
    bases: Vec<Fingerprint>,
    base_bytes: usize,
    /// The stream's policy and pressure when the run started.
    how: Option<(Policy, Pressure)>,
}

impl Run {
    /// Raw bytes gathered and a bound on what their records take over them.
    pub(crate) fn pending(&self) -> usize {
        self.bytes.len() + 32 * self.chunks.len()
    }

    fn clear(&mut self) {
        self.bytes.clear();
        self.chunks.clear();
        self.keys.clear();
        self.bases.clear();
        self.base_bytes = 0;
        self.how = None;
    }
}

/// Keeps in `found` (chunk `f`'s bases) those at hand, after asking the disk tier for the
/// others and then for the chunks sent after `best`: a stream like the one the best came from
/// will want those next. The bases are read first, and taken last (in memory the chunks read
/// ahead would push them out). True if the chunk should wait for bases being read (see
/// [`Hint::may_wait`]).
fn take_bases(
    bases: &mut Bases,
    found: &mut Vec<Fingerprint>,
    best: &Fingerprint,
    (f, policy): (Fingerprint, &Policy),
    hint: &mut Hint,
) -> bool {
    bases.request(found);
    bases.prefetch(best);
    bases.at_hand(found) > 0 && hint.may_wait(f, policy)
}

impl Mirror {
    /// Finds bases for `chunk`: its anchors into the delta scratch's keys, the bases the index
    /// offers that the peer holds into its found list (best last); returns the best (the
    /// caller reads ahead after it). `None`: no base, or the stream's own context still
    /// reaches the best (a literal in it costs less: it sees the base and everything around
    /// it, and names nothing).
    fn find_bases(&mut self, chunk: &[u8], hint: &Hint) -> Option<Fingerprint> {
        let shared = self.bases.clone()?;
        let d = &mut self.delta;
        if !std::mem::take(&mut d.keys_ready) {
            anchors(chunk, &mut d.keys);
        }
        let mut bases = shared.lock().ok()?;
        let cache = &self.cache;
        bases.find(
            &d.keys,
            (SEND_BASES, MIN_VOTES),
            |b| cache.contains(b),
            &mut d.found,
        );
        let best = *d.found.last()?;
        d.offered = true;
        if let Some(c) = hint.context.as_ref()
            && bases.in_context(&best, (c.serial, c.pos, c.window))
        {
            return None;
        }
        Some(best)
    }

    /// Adds `chunk` to the stream's delta run if similar chunks the peer holds are at hand as
    /// bases (flushing the run first if it is full); `None`: it has no base and goes as a
    /// literal. The chunk's record comes with the run's (see [`flush_run`](Self::flush_run)).
    pub(crate) fn join_run(
        &mut self,
        f: Fingerprint,
        chunk: &[u8],
        (policy, pressure): (&Policy, Pressure),
        in_context: bool,
        hint: &mut Hint,
        out: &mut impl Out,
    ) -> Option<Report> {
        let best = self.find_bases(chunk, hint)?;
        let shared = self.bases.clone()?;
        let lens = {
            let mut bases = shared.lock().ok()?;
            let d = &mut self.delta;
            if take_bases(&mut bases, &mut d.found, &best, (f, policy), hint) {
                return Some(Report::wait());
            }
            if d.found.is_empty() {
                return None;
            }
            let mut lens = [0usize; MAX_BASES];
            for (l, b) in lens.iter_mut().zip(&d.found) {
                *l = bases.held_len(b).unwrap_or(0);
            }
            lens
        };
        let found = &self.delta.found;
        // Bases of this chunk the run does not name yet, and their bytes.
        let new = |run: &Run| {
            found
                .iter()
                .zip(lens)
                .filter(|(b, _)| !run.bases.contains(b))
                .fold((0, 0), |(n, bytes), (_, l)| (n + 1, bytes + l))
        };
        // A full run goes first; this chunk starts the next.
        let full = hint.run.as_deref().is_some_and(|r| {
            let (n, bytes) = new(r);
            !r.chunks.is_empty()
                && (r.chunks.len() >= SEND_RUN_CHUNKS
                    || r.bytes.len() + chunk.len() > RUN_MAX
                    || r.bases.len() + n > MAX_RUN_BASES
                    || r.base_bytes + bytes > RUN_DICT)
        });
        let mut run_end = if full { self.flush_run(hint, out) } else { 0 };
        if hint.run.as_deref().is_none_or(|r| r.chunks.is_empty()) {
            // References and context literals before the run go before it.
            run_end += self.flush_refs(hint, out);
            self.end_context_run(hint, out);
        }
        let spare = &mut self.run_spare;
        let run = hint
            .run
            .get_or_insert_with(|| spare.take().unwrap_or_default());
        let d = &self.delta;
        if run.chunks.is_empty() {
            run.how = Some((*policy, pressure));
        }
        for (b, l) in d.found.iter().zip(lens) {
            if !run.bases.contains(b) {
                run.bases.push(*b);
                run.base_bytes += l;
            }
        }
        run.bytes.extend_from_slice(chunk);
        run.keys.extend_from_slice(&d.keys);
        run.chunks
            .push((f, chunk.len(), run.keys.len(), in_context));
        hint.interrupted = true;
        Some(Report {
            sent: Sent::InRun,
            raw: chunk.len(),
            wire: 0,
            run_end,
            no_base: false,
        })
    }

    /// Writes the stream's delta run, if it has one: one record if it pays against what
    /// literals of its chunks are expected to cost, else each chunk as a literal. Returns the
    /// bytes written; their counts go to [`take_late`](Self::take_late).
    pub(crate) fn flush_run(&mut self, hint: &mut Hint, out: &mut impl Out) -> usize {
        let Some(mut run) = hint.run.take() else {
            return 0;
        };
        let planned =
            run.how.is_some() && !run.chunks.is_empty() && self.plan_run(&mut run, hint, out);
        let n = match run.how {
            _ if planned => 0,
            Some(how) if !run.chunks.is_empty() => {
                let n = self.write_run(&mut run, hint, out);
                if n > 0 {
                    n
                } else {
                    self.run_as_literals(&run, how, hint, out)
                }
            }
            _ => 0,
        };
        hint.interrupted = true;
        run.clear();
        self.run_spare = Some(run);
        n
    }

    /// Plans the run as a [`RunJob`] (see [`crate::maker`]), where that gives what writing it
    /// now would: every chunk's literal would go in the stream's context, which is going and
    /// holds no run of its own, and the peer's cache keeps a base's place whether the run pays
    /// or not (quiet bases). Decided now, in order: the bases (named, touched, at hand to
    /// answer a miss), and each chunk joining both caches and the log, as a delta run's
    /// chunks do (a literal's too: it joins the store of bases whatever it cost). Left to the
    /// maker: the frame, and whether it pays or the chunks go as context literals; what it
    /// cost is learned at the turn's end ([`settle`](Self::settle)), and counts as planned
    /// until then. A turn's runs left to be made hold at most [`PLANNED_BASES`] of bases, so
    /// that turns waiting for their records hold at most that each. False: nothing was done
    /// (the run is written now).
    fn plan_run(&mut self, run: &mut Run, hint: &mut Hint, out: &mut impl Out) -> bool {
        let level = self.zstd_level;
        let ready = self.cache.has_quiet_bases()
            && hint.planned_bases + run.base_bytes <= PLANNED_BASES
            && run.chunks.iter().all(|c| c.3)
            && hint.context.as_ref().is_some_and(|c| {
                !c.fresh
                    && c.run.1 == 0
                    && (c.level == level || c.pos < c.window * RESTART_WINDOWS)
                    && (self.lane.is_some() || c.cctx.is_some())
            });
        let Some(shared) = self.bases.clone().filter(|_| ready) else {
            return false;
        };
        let Ok(mut bases) = shared.lock() else {
            return false;
        };
        let cache = &self.cache;
        run.bases.retain(|b| cache.contains(b));
        // Its own buffers, which go with the job (kept, up to a megabyte each, they would
        // swell every spare buffer of the stream's context records).
        let mut dict = Vec::new();
        if !bases.dictionary(&mut run.bases, &mut dict) {
            return false;
        }
        let (n, raw) = (run.chunks.len(), run.bytes.len());
        hint.planned_bases += run.base_bytes;
        let mut head = Vec::new();
        let named = self.run_head(run, &mut head);
        self.run_sent(run, &mut bases, &dict, named, hint);
        drop(bases);
        let mut job = Box::new(RunJob {
            head,
            dict,
            lens: run.chunks.iter().map(|c| c.1).collect(),
            level: (run_level(level), RUN_TABLE_LOG),
            compact: run.how.is_some_and(|(p, _)| p.compact_runs),
            limit: raw as f64 * self.delta.lit_ratio * ACCEPT,
        });
        // Counted as what its literals would be at most (a record that pays is smaller).
        hint.planned.0 += raw;
        hint.planned.1 += n;
        let bytes = std::mem::replace(&mut run.bytes, Vec::with_capacity(raw));
        if let Some(q) = self.lane.as_ref() {
            let start = hint
                .context
                .as_mut()
                .and_then(|c| c.cctx.take().map(|x| (c.serial, x)));
            q.push(Op {
                at: out.written(),
                what: What::Run(job),
                kind: Kind::Delta { n },
                raw: bytes,
                start,
            });
            return true;
        }
        let cctx = hint.context.as_mut().and_then(|c| c.cctx.as_mut());
        let (made, ok) = make_run(cctx, &mut job, &bytes, &mut self.run_scratch, out);
        if !ok {
            hint.context = None;
        }
        hint.outcomes.extend(made.into_iter().map(|m| m.0));
        true
    }

    /// The run as one record, if it pays; 0 (nothing written) if not.
    fn write_run(&mut self, run: &mut Run, hint: &Hint, out: &mut impl Out) -> usize {
        let Some(shared) = self.bases.clone() else {
            return 0;
        };
        let Ok(mut bases) = shared.lock() else {
            return 0;
        };
        let cache = &self.cache;
        run.bases.retain(|b| cache.contains(b));
        if !bases.dictionary(&mut run.bases, &mut self.delta.dict) {
            return 0;
        }
        let mut head = std::mem::take(&mut self.names_buf);
        head.clear();
        let named = self.run_head(run, &mut head);
        let mut job = RunJob {
            head,
            dict: std::mem::take(&mut self.delta.dict),
            lens: Vec::new(),
            level: (run_level(self.zstd_level), RUN_TABLE_LOG),
            compact: run.how.is_some_and(|(p, _)| p.compact_runs),
            limit: run.bytes.len() as f64 * self.delta.lit_ratio * ACCEPT,
        };
        let wire = run_record(&mut job, &run.bytes, &mut self.scratch, out);
        (self.names_buf, self.delta.dict) = (job.head, job.dict);
        let Some(wire) = wire else {
            return 0;
        };
        let dict = std::mem::take(&mut self.delta.dict);
        self.run_sent(run, &mut bases, &dict, named, hint);
        self.delta.dict = dict;
        let l = &mut self.late;
        l.delta_chunks += run.chunks.len() as u64;
        l.delta_bytes += run.bytes.len() as u64;
        l.delta_wire += wire as u64;
        l.wire_bytes += wire as u64;
        wire
    }

    /// A delta run's record between its tag and its frame's length, appended to `head`: the
    /// counts, the bases by their place in a log where the peer's log holds them (else by
    /// name), the chunks' lengths and the run's check. Returns the check if a base went by
    /// place.
    fn run_head(&self, run: &Run, head: &mut Vec<u8>) -> Option<Fingerprint> {
        head.push(run.chunks.len() as u8);
        head.push(run.bases.len() as u8);
        let mut prev: Option<(u32, u64)> = None;
        for b in &run.bases {
            let place = self
                .places
                .get(b)
                .copied()
                .filter(|&(s, i)| self.logs.get(s, i) == Some(b));
            prev = put_base(head, b, place, prev);
        }
        for (_, len, _, _) in &run.chunks {
            put_len(head, *len);
        }
        let check = run_check(run.chunks.iter().map(|c| &c.0));
        head.extend_from_slice(&check);
        prev.map(|_| check)
    }

    /// What a delta run's record does to the mirror, as the peer does it: the bases looked up
    /// in order (their bytes, `dict`, kept to answer a miss of one; with `named`, the run's
    /// check, by which a peer whose log differs asks for their names), then the chunks added
    /// to the cache, the log and the store of bases. A base the peer lacks is a miss of the
    /// base: the chunks are named by none but the check.
    fn run_sent(
        &mut self,
        run: &Run,
        bases: &mut Bases,
        dict: &[u8],
        named: Option<Fingerprint>,
        hint: &Hint,
    ) {
        if let Some(check) = named {
            let names = &run.bases;
            self.recent.put_with(check, 16 * names.len(), || {
                Bytes::from(names.iter().flatten().copied().collect::<Vec<u8>>())
            });
        }
        let mut at = 0;
        for b in &run.bases {
            self.cache.touch_base(b);
            let len = bases.held_len(b).unwrap_or(0).min(dict.len() - at);
            let data = &dict[at..at + len];
            self.recent
                .put_with(*b, len, || Bytes::copy_from_slice(data));
            at += len;
        }
        let (mut at, mut k) = (0, 0);
        for &(f, len, keys_end, _) in &run.chunks {
            let chunk = &run.bytes[at..at + len];
            self.cache.insert_len(f, len);
            self.log_chunk(hint, f);
            // A miss of a base is answered with the chunks themselves.
            self.recent
                .put_with(f, len, || Bytes::copy_from_slice(chunk));
            bases.insert(f, chunk, &run.keys[k..keys_end]);
            (at, k) = (at + len, keys_end);
        }
    }

    /// The run's chunks as literals, each flushed alone (in the stream's context where its
    /// literal would have gone there).
    fn run_as_literals(
        &mut self,
        run: &Run,
        (policy, pressure): (Policy, Pressure),
        hint: &mut Hint,
        out: &mut impl Out,
    ) -> usize {
        let policy = Policy {
            runs: false,
            ..policy
        };
        // The chunk whose literal ended the run keeps its own anchors and offer: it is indexed
        // under them after this. (Indexed under the last run chunk's anchors instead, it took
        // that chunk's index slots: an edited version of that chunk then found it as its only
        // base, and on kernel sources 38 of 719 delta runs cost 110 KB where `--patch-from` of
        // the same bytes took 2 KB.)
        let own = (std::mem::take(&mut self.delta.keys), self.delta.offered);
        let (mut at, mut k, mut n) = (0, 0, 0);
        for &(f, len, keys_end, in_context) in &run.chunks {
            let chunk = &run.bytes[at..at + len];
            // What keeps it as a base: its anchors.
            self.delta.keys.clear();
            self.delta.keys.extend_from_slice(&run.keys[k..keys_end]);
            self.delta.offered = true;
            let r = self.encode_literal(
                Some(f),
                chunk,
                (&policy, pressure),
                (in_context, true),
                hint,
                out,
                None,
            );
            n += r.wire + r.run_end;
            // Its raw bytes were counted with its report.
            self.late.add(&r);
            self.late.raw_bytes -= r.raw as u64;
            (at, k) = (at + len, keys_end);
        }
        (self.delta.keys, self.delta.offered) = own;
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CodecConfig;
    use crate::delta::shared;

    /// Deltas are tried only with a store of bases, for cacheable bulk chunks of a link-bound
    /// stream that may use zstd.
    #[test]
    fn deltas_are_tried_only_where_they_can_pay() {
        let policy = CodecConfig::default().policy();
        let hint = Hint::default();
        let mut m = Mirror::new(1 << 20, 1 << 20, 3);
        assert!(
            !m.delta_wanted(&policy, Pressure::LinkBound, &hint),
            "no store"
        );
        m.set_bases(shared(1 << 20));
        assert!(m.delta_wanted(&policy, Pressure::LinkBound, &hint));
        assert!(!m.delta_wanted(&policy, Pressure::CpuBound, &hint));
        let latency = Policy {
            latency: true,
            ..policy
        };
        assert!(!m.delta_wanted(&latency, Pressure::LinkBound, &hint));
        let lz4 = Policy {
            compression: Compression::Lz4,
            ..policy
        };
        assert!(!m.delta_wanted(&lz4, Pressure::LinkBound, &hint));
    }
}
