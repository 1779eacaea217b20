//! Frames decoded in the order they arrived as a link decodes them, fed ahead on the workers
//! (see `ahead.rs`): for benches and tests, which keep each stream's context in a slice; the
//! link keeps its streams' contexts with its streams and runs the same steps itself.

use std::sync::Arc;

use bytes::Bytes;

use super::Decoder;
use super::ahead::{Feeding, Feeds};
use crate::context::StreamContext;

/// What decodes one frame in its turn: the decoder, the frame's stream (an index), where its
/// records are in the wire, and the stream's context.
pub type DecodeFrame<'a> =
    dyn FnMut(&mut Decoder, usize, std::ops::Range<usize>, &mut StreamContext) + 'a;

/// Several streams' frames, which arrived one after the other in `wire`, decoded in that order
/// as a link decodes them: with `ahead` of 1 or more, each frame is fed to its stream's context
/// on the workers (up to `ahead` frames at once) while the frames before it are decoded. For
/// benches and tests; the link keeps its streams' contexts with its streams.
pub struct InOrder {
    feeds: Feeds<(usize, std::ops::Range<usize>)>,
    ahead: usize,
    workers: Option<Arc<dyn crate::prepare::Workers>>,
    fed_next: usize,
}

impl InOrder {
    pub fn new(ahead: usize, workers: Option<Arc<dyn crate::prepare::Workers>>) -> Self {
        InOrder {
            feeds: Feeds::default(),
            ahead,
            workers,
            fed_next: 0,
        }
    }

    /// Frames fed behind their stream's earlier frame fed ahead ([`Decoder::feed_after`]).
    pub fn fed_next(&self) -> usize {
        self.fed_next
    }

    /// Frames fed ahead waiting for their turn.
    pub fn waiting(&self) -> usize {
        self.feeds.len()
    }

    /// The frame of stream `k` at `range` of `wire` arrived: fed ahead, or (with the frames
    /// fed before it first) decoded by `decode` now.
    pub fn frame(
        &mut self,
        dec: &mut Decoder,
        (wire, k, range): (&Bytes, usize, std::ops::Range<usize>),
        contexts: &mut [StreamContext],
        decode: &mut DecodeFrame<'_>,
    ) -> bool {
        // A frame of literals alone is fed while the stream's earlier frames wait.
        let lits = (self.ahead > 0 && self.feeds.position(|f| f.0 == k).is_some())
            .then(|| dec.feed_literals(wire.slice(range.clone()), usize::MAX))
            .flatten();
        if let Some(f) = lits {
            return self.fed(dec, contexts, decode, (k, range), f);
        }
        // Else behind the stream's last frame fed ahead that holds its context (its frames
        // after that one, literals alone, need none of it), the workers naming its chunks
        // too only while other streams' frames wait.
        let name = self.feeds.iter().any(|f| f.0.0 != k);
        let after = (self.ahead > 0)
            .then(|| {
                let (_, earlier) = self
                    .feeds
                    .iter()
                    .rev()
                    .find(|f| f.0.0 == k && f.1.holds_context())?;
                dec.feed_after(earlier, wire.slice(range.clone()), usize::MAX, name)
            })
            .flatten();
        if let Some(f) = after {
            self.fed_next += 1;
            return self.fed(dec, contexts, decode, (k, range), f);
        }
        // Else the stream's earlier frames first, and every frame before them.
        while self.feeds.position(|f| f.0 == k).is_some() {
            self.decode_front(dec, contexts, decode);
        }
        let fed = (self.ahead > 0)
            .then(|| dec.feed_ahead(wire.slice(range.clone()), &mut contexts[k], usize::MAX))
            .flatten();
        let Some(f) = fed else {
            self.finish(dec, contexts, decode);
            decode(dec, k, range, &mut contexts[k]);
            return false;
        };
        self.fed(dec, contexts, decode, (k, range), f)
    }

    /// A frame fed ahead (`f`) waits for its turn, the oldest decoded if `ahead` wait.
    fn fed(
        &mut self,
        dec: &mut Decoder,
        contexts: &mut [StreamContext],
        decode: &mut DecodeFrame<'_>,
        (k, range): (usize, std::ops::Range<usize>),
        f: Feeding,
    ) -> bool {
        self.feeds
            .push(k as u64, (k, range), f, self.workers.as_deref());
        if self.feeds.len() >= self.ahead {
            self.decode_front(dec, contexts, decode);
        }
        true
    }

    /// Decodes every frame fed ahead, in order.
    pub fn finish(
        &mut self,
        dec: &mut Decoder,
        contexts: &mut [StreamContext],
        decode: &mut DecodeFrame<'_>,
    ) {
        while !self.feeds.is_empty() {
            self.decode_front(dec, contexts, decode);
        }
    }

    fn decode_front(
        &mut self,
        dec: &mut Decoder,
        contexts: &mut [StreamContext],
        decode: &mut DecodeFrame<'_>,
    ) {
        if let Some(((k, range), f)) = self.feeds.pop_front() {
            f.finish(&mut contexts[k]);
            decode(dec, k, range, &mut contexts[k]);
            self.rebuild_later(dec);
        }
    }

    /// What the frame just decoded brought may be the bases of later frames' delta runs.
    fn rebuild_later(&self, dec: &Decoder) {
        if let Some(w) = self.workers.as_deref() {
            for (_, later) in self.feeds.iter() {
                dec.rebuild_later(later, w);
            }
        }
    }
}
