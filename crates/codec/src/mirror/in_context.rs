//! A chunk in its stream's context: zstd literals compressed against what the stream sent
//! before (flushed so the peer rebuilds each at once, or deferred into a run whose end flushes
//! them together), and the end of such a run.

use super::{Hint, Mirror};
use crate::context::{
    CONTEXT_WINDOW_LOG, MIRROR_CONTEXTS, RESTART_WINDOWS, SendContext, long_tables,
};
use crate::format::{DEFERRED, FRESH, LONG, RUN_MAX, TAG_RUN_END, put_len};

impl Mirror {
    /// Compresses `chunk` in the stream's context into the scratch buffer, flushed so that the
    /// peer can rebuild it from this record; returns the record's tag flags (whether it starts
    /// the context, and a long one). A bulk stream's context is a long one while the link has
    /// one to give. `None` if there is no context to be had (too many, or zstd failed), and
    /// then the context is gone: the next one starts afresh.
    pub(crate) fn compress_in_context(
        &mut self,
        chunk: &[u8],
        hint: &mut Hint,
        bulk: bool,
        runs: bool,
    ) -> Option<u8> {
        use zstd::zstd_safe::{CCtx, CParameter, InBuffer, OutBuffer, zstd_sys::ZSTD_EndDirective};
        // Another level than the context's: a new context, when the old one has paid for its
        // window and holds no run (see RESTART_WINDOWS).
        if let Some(ctx) = hint.context.as_ref()
            && ctx.level != self.zstd_level
            && ctx.run.2 == 0
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
                cctx,
                fresh: true,
                long,
                level: self.zstd_level,
                serial: self.serials,
                pos: 0,
                window,
                run: (0, 0, 0),
                _permit: permit,
            });
        }
        let ctx = hint.context.as_mut()?;
        // A long context may leave the chunk inside zstd (a run), up to RUN_MAX bytes.
        let defer = runs && ctx.long && ctx.run.0 + chunk.len() <= RUN_MAX;
        self.scratch.clear();
        // Room for everything the run holds, flushed: nothing is left inside zstd after one call.
        self.scratch
            .reserve(zstd::zstd_safe::compress_bound(ctx.run.0 + chunk.len()) + 64);
        let mut input = InBuffer::around(chunk);
        let mut output = OutBuffer::around(&mut self.scratch);
        let end = if defer {
            ZSTD_EndDirective::ZSTD_e_continue
        } else {
            ZSTD_EndDirective::ZSTD_e_flush
        };
        let r = ctx.cctx.compress_stream2(&mut output, &mut input, end);
        if r.is_err() || (!defer && r != Ok(0)) || input.pos() != chunk.len() {
            hint.context = None;
            return None;
        }
        self.clen = output.pos();
        ctx.pos += chunk.len() as u64;
        self.run_done = None;
        if defer {
            ctx.run.0 += chunk.len();
            ctx.run.1 += self.clen;
            ctx.run.2 += 1;
        } else if ctx.run.2 > 0 {
            let (raw, wire, n) = std::mem::take(&mut ctx.run);
            self.run_done = Some((raw + chunk.len(), wire + self.clen, n + 1));
        }
        let fresh = std::mem::replace(&mut ctx.fresh, false);
        Some(
            match (fresh, ctx.long) {
                (true, true) => FRESH | LONG,
                (true, false) => FRESH,
                _ => 0,
            } | if defer { DEFERRED } else { 0 },
        )
    }

    /// Ends the stream's open runs: writes its delta run or its reference run, or ends its run
    /// of context literals (only one is ever open), and returns the bytes written, 0 if there was nothing
    /// to end. Every record of a frame that is not in a run comes after this, and so does the
    /// frame's end. What it wrote is counted in [`take_late`](Self::take_late).
    pub fn end_run(&mut self, hint: &mut Hint, out: &mut impl bytes::BufMut) -> usize {
        let n = self.flush_run(hint, out) + self.flush_refs(hint, out);
        n + self.end_context_run(hint, out)
    }

    /// Ends the stream's open run of context literals, if it has one: appends a run end (the
    /// rest of its context's output) to `out` and returns its bytes, 0 if there was nothing to
    /// end.
    pub(crate) fn end_context_run(
        &mut self,
        hint: &mut Hint,
        out: &mut impl bytes::BufMut,
    ) -> usize {
        use zstd::zstd_safe::{InBuffer, OutBuffer, zstd_sys::ZSTD_EndDirective};
        let Some(ctx) = hint.context.as_mut().filter(|c| c.run.2 > 0) else {
            return 0;
        };
        let (raw, wire, n) = std::mem::take(&mut ctx.run);
        self.run_scratch.clear();
        self.run_scratch
            .reserve(zstd::zstd_safe::compress_bound(raw) + 64);
        let mut input = InBuffer::around(&[]);
        let mut output = OutBuffer::around(&mut self.run_scratch);
        let r = ctx
            .cctx
            .compress_stream2(&mut output, &mut input, ZSTD_EndDirective::ZSTD_e_flush);
        let clen = output.pos();
        if r != Ok(0) {
            // The run's chunks cannot be completed: drop the context. The peer's decoder finds
            // the run unfinished at the next record or the frame's end and fails the stream.
            hint.context = None;
            return 0;
        }
        out.put_u8(TAG_RUN_END);
        let h = put_len(out, clen);
        out.put_slice(&self.run_scratch[..clen]);
        self.learn_run(raw, wire + clen, n);
        self.late.add_run_end(1 + h + clen);
        1 + h + clen
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first chunk in a stream's context starts it (and says so to the peer); the next goes
    /// on in it; a run of deferred chunks ends with a record of the rest of the context's output.
    #[test]
    fn a_context_starts_fresh_then_goes_on_and_a_run_ends() {
        let mut m = Mirror::new(1 << 20, 1 << 20, 3);
        m.set_long_context(
            Some(crate::context::LongContext::default()),
            Default::default(),
        );
        let mut hint = Hint::default();
        let page = |i: u8| vec![i; 4096];
        let first = m
            .compress_in_context(&page(1), &mut hint, true, false)
            .expect("a context");
        assert_eq!(
            first & (FRESH | LONG),
            FRESH | LONG,
            "a bulk stream's is a long one"
        );
        let next = m
            .compress_in_context(&page(2), &mut hint, true, false)
            .expect("the same");
        assert_eq!(next & FRESH, 0);
        let deferred = m
            .compress_in_context(&page(3), &mut hint, true, true)
            .expect("a run");
        assert_ne!(deferred & DEFERRED, 0);
        assert!(hint.run_pending() > 0);
        let mut out = Vec::new();
        assert!(m.end_run(&mut hint, &mut out) > 0);
        assert_eq!(out.first().copied(), Some(TAG_RUN_END));
        assert_eq!(hint.run_pending(), 0);
    }
}
