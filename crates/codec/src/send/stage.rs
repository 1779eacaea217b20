//! A bulk stream's bytes on their way to a turn: taken off the front of its queue, gathered in
//! its stage (sized once, [`reserve`]), and seen by the turn as one [`View`].

use std::collections::VecDeque;
use std::ops::Range;

use bytes::{Buf, Bytes};

use crate::config::CodecConfig;
use crate::prepare::{CutBytes, Filled};

/// Most bytes a bulk stream's chunker looks at in one turn.
pub const RAW_TURN: usize = 256 * 1024;

/// The most a bulk stream's stage holds with workers (see [`reserve`]).
pub(super) fn stage_most(chunking: &CodecConfig) -> usize {
    2 * (2 * RAW_TURN + chunking.max_chunk)
}

/// Sizes a bulk stream's `stage` (its bytes from `pos` not yet sent) once for the most it
/// holds, once the stream moves whole turns (its stage and `queue` hold a turn's bytes): a
/// turn's bytes and lookahead (at most two turns and a chunk) after what the turn before left of
/// its own, no more than that again (it is drained past half). Grown by doubling, each new
/// stream's stage was copied and faulted in again over its first turns, on the daemon's thread;
/// a stream that never has a turn's bytes waiting keeps a stage of its size.
pub(super) fn reserve(
    stage: &mut Vec<u8>,
    pos: usize,
    queue: &VecDeque<Bytes>,
    chunking: &CodecConfig,
) {
    let most = stage_most(chunking);
    let whole = || {
        let staged = stage.len() - pos;
        let mut waiting = queue.iter().scan(staged, |n, b| {
            *n += b.len();
            Some(*n)
        });
        staged >= RAW_TURN || waiting.any(|n| n >= RAW_TURN)
    };
    if stage.capacity() < most && whole() {
        stage.reserve_exact(most.saturating_sub(stage.len()));
    }
}

/// Takes up to `n` bytes off the front of the queue, a buffer's part at a time, each handed to
/// `f` (a slice of the queued buffer, not a copy); returns how many it took.
pub(super) fn take_front(queue: &mut VecDeque<Bytes>, n: usize, mut f: impl FnMut(Bytes)) -> usize {
    let mut took = 0;
    while took < n {
        let Some(front) = queue.front_mut() else {
            break;
        };
        let k = front.len().min(n - took);
        if k > 0 {
            f(front.split_to(k));
        }
        if front.is_empty() {
            queue.pop_front();
        }
        took += k;
    }
    took
}

/// Drops `n` sent bytes from the front of the queue.
pub(super) fn advance_front(queue: &mut VecDeque<Bytes>, mut n: usize) {
    while n > 0 {
        let Some(front) = queue.front_mut() else {
            return;
        };
        let k = n.min(front.len());
        front.advance(k);
        n -= k;
        if front.is_empty() {
            queue.pop_front();
        }
    }
}

/// The bytes a turn's chunks are cut and encoded from: chunks end by `end` (a flush point with `final_end`),
/// and start before `budget`. The last of them may still be on their way into the view, copied
/// on the workers ([`Fill`](crate::prepare::Fill)): [`get`](View::get) waits for them (or copies them) when asked.
pub(super) struct View<'a> {
    /// The bytes at hand.
    ready: &'a [u8],
    /// All of them, with those a fill still copies.
    filled: Option<Filled<'a>>,
    pub(super) end: usize,
    pub(super) final_end: bool,
    pub(super) budget: usize,
    /// The flush point it was made with (0: none).
    pub(super) flush: usize,
}

impl<'a> View<'a> {
    /// `view` with a flush point `flush` bytes in (0: none): a flush point ends the last chunk
    /// whether or not the content has a boundary there.
    pub(super) fn new(view: &'a [u8], flush: usize, budget: usize) -> Self {
        Self::with_fill(view, None, flush, budget)
    }

    /// As [`new`](Self::new), the bytes `ready` followed by what `filled` adds.
    pub(super) fn with_fill(
        ready: &'a [u8],
        filled: Option<Filled<'a>>,
        flush: usize,
        budget: usize,
    ) -> Self {
        let len = filled.map_or(ready.len(), |f| f.len());
        let (end, final_end) = if flush > 0 && flush <= len {
            (flush, true)
        } else {
            (len, false)
        };
        View {
            ready,
            filled,
            end,
            final_end,
            budget,
            flush,
        }
    }

    /// How many bytes it holds, those still to come too.
    pub(super) fn len(&self) -> usize {
        self.filled.map_or(self.ready.len(), |f| f.len())
    }

    /// The bytes in `r`, waiting for the fill if they are not all at hand.
    pub(super) fn get(&self, r: Range<usize>) -> &'a [u8] {
        match self.filled {
            Some(f) if r.end > self.ready.len() => &f.get()[r],
            _ => &self.ready[r],
        }
    }

    /// The bytes in `r` as a cutting job's: those still to come, taken when it runs.
    pub(super) fn cut_bytes(&self, r: Range<usize>) -> CutBytes<'a> {
        match self.filled {
            Some(f) if r.end > self.ready.len() => CutBytes::Filled(f.from(r)),
            _ => CutBytes::Ready(&self.ready[r]),
        }
    }
}
