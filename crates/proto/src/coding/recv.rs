//! The receive side of an optimized stream: the coded frames that arrived and are not decoded
//! yet, in order, with the stream's zstd context. A stream stalls here on a chunk it cannot
//! resolve and resumes at the record where it stopped.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use wanopt_codec::StreamContext;

use super::Fingerprint;

/// A coded frame received but not fully decoded (its stream waits for a missing chunk).
#[derive(Debug)]
pub(super) struct Pending {
    pub records: Bytes,
    /// What it was charged when it came (its records are consumed as they decode).
    charged: usize,
    pub remaining: u64,
    pub fin: bool,
    pub scoped: bool,
    /// Its place among every stream's coded frames in the order they arrived.
    pub seq: u64,
}

/// The receive side of one optimized stream: frames waiting to be decoded.
#[derive(Debug, Default)]
pub(crate) struct RecvCoded {
    pub(super) frames: VecDeque<Pending>,
    /// The stream's zstd context, fed its records in order (a stall resumes where it stopped).
    pub(super) context: StreamContext,
    /// The chunk this stream waits for, and whether it is in the service's own cache.
    pub stall: Option<(Fingerprint, bool)>,
    /// The stall waits for our disk tier's store to read the chunk (else for the peer's answer).
    pub on_store: bool,
    /// The stall waits for other streams' frames that arrived before this one's and are not
    /// decoded yet (they may hold the chunk: the peer sent it there first): nothing was asked.
    pub behind: bool,
    /// Stalls so far, and the one the link's stall timer watches with when it first saw it.
    pub stalls: u64,
    pub watched: Option<(u64, std::time::Instant)>,
    /// What the waiting frames cost in memory (records and [`FRAME_COST`] each), as charged
    /// against the link's backlog, kept as they come and go.
    cost: usize,
    /// The link's total of every stream's `cost`, kept in step (also when this is dropped), so
    /// admitting a frame costs the same whatever waits already.
    total: Option<Arc<AtomicUsize>>,
}

impl Drop for RecvCoded {
    fn drop(&mut self) {
        if let Some(t) = &self.total {
            t.fetch_sub(self.cost, Ordering::Relaxed);
        }
    }
}

/// What a queued frame costs beyond its records (its bookkeeping, and the buffer a small frame
/// may hold on to), so that a flood of empty frames is charged too.
pub(crate) const FRAME_COST: usize = 256;

impl RecvCoded {
    /// A receive side whose frames are counted in the link's `total`.
    pub fn counted(total: Arc<AtomicUsize>) -> RecvCoded {
        let mut rc = RecvCoded::default();
        rc.total = Some(total);
        rc
    }

    /// Queues a frame that arrived `seq`th (see [`Pending::seq`]).
    pub fn push(&mut self, records: Bytes, raw_len: u32, fin: bool, scoped: bool, seq: u64) {
        let cost = records.len() + FRAME_COST;
        self.cost += cost;
        if let Some(t) = &self.total {
            t.fetch_add(cost, Ordering::Relaxed);
        }
        self.frames.push_back(Pending {
            charged: cost,
            records,
            remaining: u64::from(raw_len),
            fin,
            scoped,
            seq,
        });
    }

    /// A frame of the stream fed ahead, in its turn (the frames before it decoded): the
    /// stream's context back, if the feeding held it, and what was fed (see
    /// [`Contexts::feed_ahead`](super::Contexts::feed_ahead)).
    pub fn fed(&mut self, fed: wanopt_codec::Feeding) {
        fed.finish(&mut self.context);
    }

    /// When the first frame still waiting arrived.
    pub fn front_seq(&self) -> Option<u64> {
        self.frames.front().map(|p| p.seq)
    }

    /// Frames waiting to be decoded.
    pub fn waiting(&self) -> usize {
        self.frames.len()
    }

    /// True when nothing waits to be decoded.
    pub fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    /// Raw bytes the waiting frames still have to rebuild.
    pub fn undecoded(&self) -> u64 {
        self.frames.iter().map(|p| p.remaining).sum()
    }

    /// Record bytes waiting.
    pub fn buffered(&self) -> usize {
        self.frames.iter().map(|p| p.records.len()).sum()
    }

    /// Drops the first waiting frame (decoded whole).
    pub(super) fn pop_front(&mut self) {
        if let Some(p) = self.frames.pop_front() {
            let cost = p.charged;
            self.cost -= cost;
            if let Some(t) = &self.total {
                t.fetch_sub(cost, Ordering::Relaxed);
            }
        }
    }
}

/// What decoding a stream's waiting frames gave.
#[derive(Debug, Default)]
pub(crate) struct Decoded {
    pub data: Vec<Bytes>,
    /// The stream's last frame was decoded.
    pub fin: bool,
    /// A chunk to ask the peer for: the stream stalls until it arrives.
    pub need: Option<(Fingerprint, bool)>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Buf;

    /// Frames are charged what they held when they came, consumed records or not, and the
    /// link's total follows every stream's part, also when a stream goes.
    #[test]
    fn the_backlog_follows_frames_in_and_out() {
        let total = Arc::new(AtomicUsize::new(0));
        let mut a = RecvCoded::counted(total.clone());
        let mut b = RecvCoded::counted(total.clone());
        a.push(Bytes::from(vec![1u8; 1000]), 10, false, false, 0);
        a.push(Bytes::new(), 0, false, false, 1);
        b.push(Bytes::from(vec![2u8; 300]), 3, true, false, 2);
        let all = 1000 + 300 + 3 * FRAME_COST;
        assert_eq!(total.load(Ordering::Relaxed), all);
        // The first frame's records decode (and are consumed) before it goes.
        if let Some(p) = a.frames.front_mut() {
            p.records.advance(1000);
        }
        a.pop_front();
        assert_eq!(total.load(Ordering::Relaxed), all - 1000 - FRAME_COST);
        drop(b);
        assert_eq!(total.load(Ordering::Relaxed), FRAME_COST);
        a.pop_front();
        a.pop_front();
        assert_eq!(total.load(Ordering::Relaxed), 0);
        assert_eq!(a.cost, 0);
    }
}
