//! A whole stream encoded in one go ([`Encoder`]): chunking, the mirror and the counts, for
//! tools, benches and tests that hold a stream's bytes rather than a link's queues.

use crate::cache::ChunkCache;
use crate::config::{CodecConfig, Pressure, chunks};
use crate::context::Slots;
use crate::delta::{self, SharedBases};
use crate::mirror::{Hint, Mirror, encode_tail};
use crate::prepare::{self, BATCH};
use crate::report::EncodeStats;

/// One direction of one stream, encoded as a whole: chunking state, a mirror and counts.
pub struct Encoder {
    cfg: CodecConfig,
    pub(crate) mirror: Mirror,
    hint: Hint,
    pending: Vec<u8>,
    stats: EncodeStats,
}

impl Encoder {
    pub fn new(cfg: CodecConfig) -> Self {
        let mut mirror = Mirror::new(cfg.cache_bytes, 64 << 20, cfg.zstd_level);
        mirror.set_long_context(cfg.long, Slots::default());
        mirror.set_bases(delta::shared(cfg.delta_bytes));
        Encoder {
            mirror,
            hint: Hint::default(),
            cfg,
            pending: Vec::new(),
            stats: EncodeStats::default(),
        }
    }

    pub fn stats(&self) -> &EncodeStats {
        &self.stats
    }

    /// Prepares chunks on `workers` (see [`Mirror::set_workers`]).
    pub fn set_workers(&mut self, workers: Option<std::sync::Arc<dyn prepare::Workers>>) {
        self.mirror.set_workers(workers);
    }

    /// See [`Mirror::set_zstd_level`].
    pub fn set_zstd_level(&mut self, level: i32) {
        self.mirror.set_zstd_level(level);
    }

    /// Replaces the store of delta bases `cfg.delta_bytes` made (one with a disk tier, say).
    pub fn set_bases(&mut self, bases: Option<SharedBases>) {
        self.mirror.set_bases(bases);
    }

    /// The mirror cache (for its size and evictions).
    pub fn cache(&self) -> &ChunkCache {
        self.mirror.cache()
    }

    /// Ends the stream: what waits is sent (into `out`) and the next bytes start a new stream
    /// on the same caches, with a context of its own, as a new connection would.
    pub fn end_stream(&mut self, pressure: Pressure, out: &mut Vec<u8>) {
        self.push(&[], true, pressure, out);
        self.hint = Hint::default();
    }

    /// Bytes held back waiting for a chunk boundary.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Takes stream bytes and appends records to `out`. Without `flush`, the bytes after the last
    /// chunk boundary wait for more data; with it (latency class, end of stream) nothing waits.
    pub fn push(&mut self, data: &[u8], flush: bool, pressure: Pressure, out: &mut Vec<u8>) {
        self.push_in_run(data, flush, pressure, out);
        // What was pushed goes out whole, as a frame does.
        let n = self.mirror.end_run(&mut self.hint, out);
        self.stats.add_run_end(n);
    }

    fn push_in_run(&mut self, data: &[u8], flush: bool, pressure: Pressure, out: &mut Vec<u8>) {
        let mut data = data;
        // Chunks are cut in the caller's bytes. Only a chunk that spans the waiting bytes and
        // the new ones is put together, from a copy of just enough of the new bytes to cut it.
        while !self.pending.is_empty() {
            let owned = self.pending.len();
            let take = self.cfg.max_chunk.saturating_sub(owned).min(data.len());
            let last = take == data.len();
            let mut joined = std::mem::take(&mut self.pending);
            joined.extend_from_slice(&data[..take]);
            if last {
                let consumed = self.encode(&joined, flush, pressure, out);
                joined.drain(..consumed);
                self.pending = joined;
                return;
            }
            // A whole chunk's worth: its first chunk is complete. Only that one is encoded here;
            // the ones after it are cut in place, not scanned twice.
            let consumed = self.encode_first(&joined, pressure, out);
            if consumed >= owned {
                // The waiting bytes went; go on in the caller's bytes where the chunk ended.
                data = &data[consumed - owned..];
            } else if consumed > 0 {
                joined.truncate(owned);
                joined.drain(..consumed);
                self.pending = joined;
            } else {
                // Not reached (a whole chunk's worth always holds a boundary), but never spin.
                joined.truncate(owned);
                joined.extend_from_slice(data);
                let consumed = self.encode(&joined, flush, pressure, out);
                joined.drain(..consumed);
                self.pending = joined;
                return;
            }
        }
        let consumed = self.encode(data, flush, pressure, out);
        self.pending.extend_from_slice(&data[consumed..]);
    }

    /// Encodes the first chunk of `src`, which holds at least one whole chunk; returns its length.
    fn encode_first(&mut self, src: &[u8], pressure: Pressure, out: &mut Vec<u8>) -> usize {
        let Some((_, len)) = chunks(src, &self.cfg).next() else {
            return 0;
        };
        let policy = self.cfg.policy();
        let r = self
            .mirror
            .encode_chunk(&src[..len], &policy, pressure, &mut self.hint, out, None);
        self.stats.add(&r);
        len
    }

    /// Encodes the whole chunks of `src` (and with `flush` the rest); returns the bytes used.
    /// With workers, up to [`BATCH`] chunks at a time are prepared together first.
    fn encode(&mut self, src: &[u8], flush: bool, pressure: Pressure, out: &mut Vec<u8>) -> usize {
        let policy = self.cfg.policy();
        let mut consumed = 0;
        let bounds: Vec<(usize, usize)> = chunks(src, &self.cfg).collect();
        let n = bounds.len();
        for start in (0..n).step_by(BATCH) {
            let end = (start + BATCH).min(n);
            // The last piece may wait for more bytes or go as a tail: never prepared.
            let ahead = if end == n { end - 1 } else { end };
            let prepared =
                self.mirror
                    .prepare(src, &bounds[start..ahead], &policy, pressure, &self.hint);
            for (i, &(off, len)) in bounds.iter().enumerate().take(end).skip(start) {
                let last = i + 1 == n;
                // The last piece ends at the buffer's end, not at a content boundary: it waits,
                // unless it is a full-size chunk or the caller flushes.
                if last && !flush && len < self.cfg.max_chunk {
                    break;
                }
                let chunk = &src[off..off + len];
                let (m, h) = (&mut self.mirror, &mut self.hint);
                let r = if last && len < self.cfg.min_chunk {
                    encode_tail(m, chunk, &policy, pressure, h, out)
                } else {
                    let prep = (prepared && i < ahead).then(|| i - start);
                    m.encode_chunk(chunk, &policy, pressure, h, out, prep)
                };
                self.stats.add(&r);
                consumed = off + len;
            }
            self.mirror.end_batch();
        }
        consumed
    }
}
