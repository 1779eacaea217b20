//! Deltas: a chunk sent as zstd against similar chunks both caches hold, found through the
//! store of what was sent ([`Bases`](crate::delta::Bases)), when that costs less than a literal.

use bytes::{BufMut, Bytes};

use super::{Hint, Mirror};
use crate::config::{Compression, Policy, Pressure};
use zstd::zstd_safe::CCtx;

use crate::delta::{ACCEPT, MIN_VOTES, SEND_BASES, anchors, compress_delta, delta_level, len_len};
use crate::fingerprint::Fingerprint;
use crate::format::{TAG_DELTA, put_len};
use crate::report::{Report, Sent};

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
        hint: &mut Hint,
        out: &mut impl BufMut,
    ) -> Option<Report> {
        let shared = self.bases.clone()?;
        let d = &mut self.delta;
        anchors(chunk, &mut d.keys);
        let mut bases = shared.lock().ok()?;
        let cache = &self.cache;
        bases.find(
            &d.keys,
            (SEND_BASES, MIN_VOTES),
            |b| cache.contains(b),
            &mut d.found,
        );
        let best = d.found.last()?;
        d.offered = true;
        // The stream's own context still reaches the best base: a literal in it costs less
        // (it sees the base and everything around it, and names nothing).
        if let Some(c) = hint.context.as_ref()
            && bases.in_context(best, (c.serial, c.pos, c.window))
        {
            return None;
        }
        // Whatever comes of this one, the chunks after the best base are likely next.
        bases.prefetch(best);
        if !bases.dictionary(&mut d.found, &mut d.dict) {
            return None;
        }
        if d.cctx.is_none() {
            d.cctx = CCtx::try_create();
        }
        let cctx = d.cctx.as_mut()?;
        self.scratch.clear();
        self.scratch
            .reserve(zstd::zstd_safe::compress_bound(chunk.len()));
        // The chunk right behind its bases in one buffer (one allocation, reused).
        let bases_len = d.dict.len();
        d.dict.extend_from_slice(chunk);
        let (dict, src) = d.dict.split_at(bases_len);
        compress_delta(
            cctx,
            &mut self.scratch,
            src,
            dict,
            delta_level(self.zstd_level),
        )
        .ok()?;
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
            self.cache.touch(b);
        }
        out.put_slice(&f);
        put_len(out, clen);
        out.put_slice(&self.scratch[..clen]);
        self.cache.insert_len(f, chunk.len());
        // A miss of a base is answered with the chunk itself.
        self.recent
            .put_with(f, chunk.len(), || Bytes::copy_from_slice(chunk));
        bases.insert(f, chunk, &d.keys);
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
