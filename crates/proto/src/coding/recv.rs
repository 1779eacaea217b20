//! The receive side of an optimized stream: the coded frames that arrived and are not decoded
//! yet, in order, with the stream's zstd context. A stream stalls here on a chunk it cannot
//! resolve and resumes at the record where it stopped.

use std::collections::VecDeque;

use bytes::Bytes;
use wanopt_codec::StreamContext;

use super::Fingerprint;

/// A coded frame received but not fully decoded (its stream waits for a missing chunk).
#[derive(Debug)]
pub(super) struct Pending {
    pub records: Bytes,
    pub remaining: u64,
    pub fin: bool,
    pub scoped: bool,
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
    /// Stalls so far, and the one the link's stall timer watches with when it first saw it.
    pub stalls: u64,
    pub watched: Option<(u64, std::time::Instant)>,
}

/// What a queued frame costs beyond its records (its bookkeeping, and the buffer a small frame
/// may hold on to), so that a flood of empty frames is charged too.
pub(crate) const FRAME_COST: usize = 256;

impl RecvCoded {
    pub fn push(&mut self, records: Bytes, raw_len: u32, fin: bool, scoped: bool) {
        self.frames.push_back(Pending {
            records,
            remaining: u64::from(raw_len),
            fin,
            scoped,
        });
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

    /// What the waiting frames cost in memory, as charged against the link's backlog.
    pub fn cost(&self) -> usize {
        self.frames
            .iter()
            .map(|p| p.records.len() + FRAME_COST)
            .sum()
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
