//! A chunk in its stream's context: zstd literals compressed against what the stream sent
//! before (flushed so the peer rebuilds each at once, or deferred into a run whose end flushes
//! them together), and the end of such a run.

use super::{Hint, Mirror, SMALL};
use crate::config::Codec;
use crate::context::{
    CONTEXT_WINDOW_LOG, MIRROR_CONTEXTS, RESTART_WINDOWS, SendContext, long_tables,
};
use crate::format::{DEFERRED, FRESH, LONG, RUN_MAX, pays};
use crate::maker::{self, Kind, Made, Make, Op, Open, What};

/// A context literal the mirror planned (see [`crate::maker`]): its tag flags, whether its
/// context keeps its bytes for a later record of the run, and what it is to the turn's end.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Planned {
    pub(crate) flags: u8,
    pub(crate) defer: bool,
    pub(crate) kind: Kind,
}

impl Mirror {
    /// Plans `len` bytes of a chunk in the stream's context: starts the context if there is
    /// none (a bulk stream's is a long one while the link has one to give) and returns the
    /// record's tag flags (whether it starts the context, a long one, a deferred chunk). The
    /// record itself is made by [`context_record`](Self::context_record). `None` if there is
    /// no context to be had (too many, or zstd could not make one).
    pub(crate) fn plan_in_context(
        &mut self,
        len: usize,
        hint: &mut Hint,
        bulk: bool,
        runs: bool,
    ) -> Option<Planned> {
        use zstd::zstd_safe::{CCtx, CParameter};
        // Another level than the context's: a new context, when the old one has paid for its
        // window and holds no run (see RESTART_WINDOWS).
        if let Some(ctx) = hint.context.as_ref()
            && ctx.level != self.zstd_level
            && ctx.run.1 == 0
            && ctx.pos >= ctx.window * RESTART_WINDOWS
        {
            hint.context = None;
        }
        if hint.context.is_none() {
            let long = self
                .long
                .as_ref()
                .filter(|_| bulk)
                .and_then(|(l, slots)| Some((l.window_log, slots.take(l.streams)?)));
            let mut cctx = CCtx::try_create()?;
            cctx.set_parameter(CParameter::CompressionLevel(self.zstd_level))
                .ok()?;
            let (permit, long) = match long {
                Some((window_log, permit)) => {
                    cctx.set_parameter(CParameter::WindowLog(window_log)).ok()?;
                    let (hash, chain) = long_tables(window_log, self.zstd_level);
                    cctx.set_parameter(CParameter::HashLog(hash)).ok()?;
                    cctx.set_parameter(CParameter::ChainLog(chain)).ok()?;
                    (permit, true)
                }
                None => {
                    let permit = self.contexts.take(MIRROR_CONTEXTS)?;
                    cctx.set_parameter(CParameter::WindowLog(CONTEXT_WINDOW_LOG))
                        .ok()?;
                    // Tables sized to the window: on WAL, larger ones found nothing more
                    // (measured at levels 3 to 9) and cost memory in every context.
                    cctx.set_parameter(CParameter::HashLog(CONTEXT_WINDOW_LOG))
                        .ok()?;
                    cctx.set_parameter(CParameter::ChainLog(CONTEXT_WINDOW_LOG - 1))
                        .ok()?;
                    (permit, false)
                }
            };
            self.serials += 1;
            let window = match &self.long {
                Some((l, _)) if long => l.window(),
                _ => 1 << CONTEXT_WINDOW_LOG,
            };
            hint.context = Some(SendContext {
                cctx: Some(cctx),
                fresh: true,
                long,
                level: self.zstd_level,
                serial: self.serials,
                pos: 0,
                window,
                run: (0, 0),
                _permit: permit,
            });
        }
        let ctx = hint.context.as_mut()?;
        // A long context may leave the chunk inside zstd (a run), up to RUN_MAX bytes.
        let defer = runs && ctx.long && ctx.run.0 + len <= RUN_MAX;
        ctx.pos += len as u64;
        let kind = if defer {
            ctx.run.0 += len;
            ctx.run.1 += 1;
            Kind::Deferred
        } else if ctx.run.1 > 0 {
            let (raw, n) = std::mem::take(&mut ctx.run);
            Kind::EndsRun {
                raw: raw + len,
                n: n + 1,
            }
        } else {
            Kind::Alone { learn: false }
        };
        let fresh = std::mem::replace(&mut ctx.fresh, false);
        let flags = match (fresh, ctx.long) {
            (true, true) => FRESH | LONG,
            (true, false) => FRESH,
            _ => 0,
        } | if defer { DEFERRED } else { 0 };
        Some(Planned { flags, defer, kind })
    }

    /// Makes a planned context record of `raw` (see [`crate::maker`]): while a worker makes
    /// the turn's context records, it is queued for it with its place in `out`; otherwise it
    /// is made and written now. Either way its cost is learned at the turn's end
    /// ([`settle`](Self::settle)), and it counts as planned until then.
    pub(crate) fn context_record(
        &mut self,
        hint: &mut Hint,
        make: Make,
        kind: Kind,
        raw: &[u8],
        out: &mut impl crate::format::Out,
    ) {
        hint.planned.0 += raw.len();
        hint.planned.1 += 1;
        if let Some(q) = self.lane.as_ref() {
            let start = hint
                .context
                .as_mut()
                .and_then(|c| c.cctx.take().map(|x| (c.serial, x)));
            let mut buf = self.spare.pop().unwrap_or_default();
            buf.extend_from_slice(raw);
            q.push(Op {
                at: out.written(),
                what: What::Record(make),
                kind,
                raw: buf,
                start,
            });
            return;
        }
        let cctx = hint.context.as_mut().and_then(|c| c.cctx.as_mut());
        let (o, ok) = maker::make(cctx, make, kind, raw, &mut self.run_scratch, out);
        if !ok {
            hint.context = None;
        }
        hint.outcomes.push(o);
    }

    /// Ends the stream's open runs: writes its delta run or its reference run, or ends its run
    /// of context literals (only one is ever open), and returns the bytes written, 0 if there
    /// was nothing to end (a context's run end counts as planned until the turn's end). Every
    /// record of a frame that is not in a run comes after this, and so does the frame's end.
    /// What it wrote is counted in [`take_late`](Self::take_late).
    pub fn end_run(&mut self, hint: &mut Hint, out: &mut impl crate::format::Out) -> usize {
        let n = self.flush_run(hint, out) + self.flush_refs(hint, out);
        self.end_context_run(hint, out);
        n
    }

    /// Ends the stream's open run of context literals, if it has one: plans its run end (the
    /// rest of its context's output).
    pub(crate) fn end_context_run(&mut self, hint: &mut Hint, out: &mut impl crate::format::Out) {
        let Some(ctx) = hint.context.as_mut().filter(|c| c.run.1 > 0) else {
            return;
        };
        let (raw, n) = std::mem::take(&mut ctx.run);
        self.context_record(hint, Make::RunEnd, Kind::RunEnd { raw, n }, &[], out);
    }

    /// The turn is over: learns from what its context records cost (in the order they were
    /// planned), counts their bytes ([`take_late`](Self::take_late)) and returns them. A
    /// literal flushed alone that did not pay counts against its stream's chunks paying (as
    /// the noise trial's failures do); runs teach what literals cost.
    pub(crate) fn settle(&mut self, hint: &mut Hint) -> usize {
        let (mut total, mut run_wire) = (0, 0);
        let mut outcomes = std::mem::take(&mut hint.outcomes);
        for o in outcomes.drain(..) {
            total += o.wire;
            match o.kind {
                Kind::Delta { n } => {
                    let l = &mut self.late;
                    l.delta_chunks += n as u64;
                    l.delta_bytes += o.raw as u64;
                    l.delta_wire += o.wire as u64;
                    l.wire_bytes += o.wire as u64;
                    continue;
                }
                Kind::FromRun => {
                    // A literal after all, although offered a base: its raw bytes were counted
                    // when it joined the run.
                    let l = &mut self.late;
                    l.miss_chunks += 1;
                    l.miss_bytes += o.raw as u64;
                    l.no_base_chunks += 1;
                    l.no_base_bytes += o.raw as u64;
                    let codec = if o.failed { Codec::None } else { Codec::Zstd };
                    l.codec_bytes[codec.index()] += o.raw as u64;
                    if let Some(c) = hint.context.as_mut() {
                        c.pos += o.raw as u64;
                    }
                }
                _ => {}
            }
            self.late.add_run_end(o.wire);
            if o.failed {
                run_wire = 0;
                continue;
            }
            match o.kind {
                Kind::Deferred => run_wire += o.payload,
                Kind::EndsRun { raw, n } | Kind::RunEnd { raw, n } => {
                    self.learn_run(raw, run_wire + o.payload, n);
                    run_wire = 0;
                }
                Kind::Delta { .. } => {}
                Kind::Alone { .. } | Kind::FromRun => {
                    let learn = matches!(o.kind, Kind::Alone { learn: true } | Kind::FromRun);
                    if pays(o.raw, o.payload) {
                        hint.compressible();
                    } else if o.raw >= SMALL {
                        hint.incompressible();
                    }
                    if learn {
                        let d = &mut self.delta;
                        d.lit_ratio += (o.wire as f64 / o.raw.max(1) as f64 - d.lit_ratio) / 16.0;
                    }
                }
            }
        }
        hint.outcomes = outcomes;
        hint.planned = (0, 0);
        hint.planned_bases = 0;
        total
    }

    /// The payload of `chunk` compressed alone in the stream's context (tests build records
    /// from it).
    #[cfg(test)]
    pub(crate) fn compress_in_context(
        &mut self,
        chunk: &[u8],
        hint: &mut Hint,
        bulk: bool,
    ) -> Option<Vec<u8>> {
        let p = self.plan_in_context(chunk.len(), hint, bulk, false)?;
        let make = Make::Literal {
            tag: crate::format::TAG_LIT_CONTEXT | p.flags,
            defer: false,
            cached: true,
        };
        let mut rec = Vec::new();
        self.context_record(hint, make, p.kind, chunk, &mut rec);
        let o = hint.outcomes.pop()?;
        (!o.failed).then(|| rec[rec.len() - o.payload..].to_vec())
    }

    /// Queues the stream's context records on `open`'s queue from now on, to be made later
    /// (see [`crate::maker`]), the stream's compressor with the first (if the stream has it:
    /// else the queue's maker has it already, from a turn planned before and not finished).
    /// The records written meanwhile leave room for them, and
    /// [`close_lane`](Self::close_lane) puts them in their places.
    pub(crate) fn open_lane(&mut self, open: Open, hint: &mut Hint) {
        hint.planned = (0, 0);
        hint.planned_bases = 0;
        self.lane = Some(open);
    }

    /// The turn's records are all planned: context records are made at once again.
    pub(crate) fn detach_lane(&mut self) {
        if let Some(open) = self.lane.take() {
            open.lane.planned();
        }
    }

    /// The queued records are made: writes `plan` (the records written since
    /// [`open_lane`](Self::open_lane)) to `out` with the made records (`made`) in their
    /// places. `context`: no later turn of the stream is open, and the stream takes its
    /// compressor back (a context that failed is dropped, and the next one starts afresh).
    pub(crate) fn close_lane(
        &mut self,
        hint: &mut Hint,
        made: &mut Made,
        context: Option<Option<(u64, zstd::zstd_safe::CCtx<'static>)>>,
        plan: &[u8],
        out: &mut impl crate::format::Out,
    ) {
        let (mut from, mut rec) = (0, 0);
        for (at, end, o) in made.made.drain(..) {
            out.put_slice(&plan[from..at]);
            out.put_slice(&made.recs[rec..end]);
            (from, rec) = (at, end);
            hint.outcomes.push(o);
        }
        out.put_slice(&plan[from..]);
        self.spare.append(&mut made.spare);
        let Some(cctx) = context else {
            return;
        };
        if let Some((serial, cctx)) = cctx
            && let Some(c) = hint.context.as_mut()
            && c.serial == serial
            && c.cctx.is_none()
        {
            c.cctx = Some(cctx);
        }
        if hint.context.as_ref().is_some_and(|c| c.cctx.is_none()) {
            hint.context = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first chunk in a stream's context starts it (and says so to the peer); the next goes
    /// on in it; a run of deferred chunks ends with a record of the rest of the context's output.
    #[test]
    fn a_context_starts_fresh_then_goes_on_and_a_run_ends() {
        use crate::format::{TAG_LIT_CONTEXT, TAG_RUN_END};
        let mut m = Mirror::new(1 << 20, 1 << 20, 3);
        m.set_long_context(
            Some(crate::context::LongContext::default()),
            Default::default(),
        );
        let mut hint = Hint::default();
        let mut out = Vec::new();
        let mut send = |m: &mut Mirror, hint: &mut Hint, i: u8, runs: bool| {
            let p = m
                .plan_in_context(4096, hint, true, runs)
                .expect("a context");
            let make = Make::Literal {
                tag: TAG_LIT_CONTEXT | p.flags,
                defer: p.defer,
                cached: true,
            };
            m.context_record(hint, make, p.kind, &[i; 4096], &mut out);
            p.flags
        };
        let first = send(&mut m, &mut hint, 1, false);
        assert_eq!(
            first & (FRESH | LONG),
            FRESH | LONG,
            "a bulk stream's is a long one"
        );
        assert_eq!(send(&mut m, &mut hint, 2, false) & FRESH, 0);
        assert_ne!(send(&mut m, &mut hint, 3, true) & DEFERRED, 0, "a run");
        assert!(hint.run_pending() > 0);
        let before = out.len();
        assert_eq!(
            m.end_run(&mut hint, &mut out),
            0,
            "counted at the turn's end"
        );
        assert_eq!(out.get(before).copied(), Some(TAG_RUN_END));
        assert!(hint.run_pending() > 0, "planned until the turn's end");
        assert_eq!(m.settle(&mut hint), out.len());
        assert_eq!(hint.run_pending(), 0);
        assert_eq!(m.take_late().wire_bytes, out.len() as u64);
    }
}
