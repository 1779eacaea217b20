//! A bulk stream's next turn prepared early: once a turn is planned, the chunks already cut for
//! the stream's next turn are handed to the workers' spare time ([`Workers::idle`]), to be
//! compressed (and their delta anchors found) while other streams' turns run, or while the
//! pool's threads would otherwise wait at a turn's edges. The next turn takes what was done
//! ([`take`]) and prepares the rest as before, so the records are the same whoever prepared
//! what: a chunk's preparation depends on its bytes alone, and is taken only if it is the very
//! work the turn would ask for.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, TryLockError};

use crate::prepare::{Idle, Job, Prepared, Work};

/// The work a chunk gets: its literal's compression (if any), and whether its delta anchors.
pub(super) type Asked = (Option<Work>, bool);

/// Chunks of one stream's next turn, handed to the workers' spare time ([`Idle`] work).
pub(super) struct Handed {
    asked: Asked,
    chunks: Vec<Mutex<Piece>>,
    /// The first chunk no thread has taken.
    next: AtomicUsize,
    /// Set when its owner takes it back ([`retire`](Self::retire)): nobody starts a chunk after.
    over: AtomicBool,
}

/// One chunk of a [`Handed`]: its stream offset, where its bytes are (in the stream's stage),
/// and what was prepared.
struct Piece {
    at: u64,
    ptr: *const u8,
    len: usize,
    slot: Prepared,
    done: bool,
}

// SAFETY: a piece's bytes are only read, by the one thread that holds its lock, and only while
// `over` is unset; its owner keeps them allocated and unchanged until `retire` has returned
// (`Handed::new`'s contract), and `retire` sets `over` and then takes every piece's lock, so no
// thread reads them after it. The rest is owned data behind the locks.
unsafe impl Send for Handed {}
// SAFETY: as above.
unsafe impl Sync for Handed {}

/// A chunk prepared early, for the stream offset `at`.
pub(super) struct Ready {
    at: u64,
    len: usize,
    asked: Asked,
    slot: Prepared,
}

impl Handed {
    /// Work for `chunks` (stream offset, bytes), each prepared as `asked`; `spare` gives the
    /// slots' buffers.
    ///
    /// # Safety
    /// Every chunk's bytes must stay allocated and unchanged until [`retire`](Self::retire) has
    /// returned.
    pub(super) unsafe fn new(
        chunks: impl Iterator<Item = (u64, *const u8, usize)>,
        asked: Asked,
        spare: &mut Vec<Prepared>,
    ) -> Self {
        let chunks = chunks
            .map(|(at, ptr, len)| {
                let mut slot = spare.pop().unwrap_or_default();
                slot.reset(len);
                Mutex::new(Piece {
                    at,
                    ptr,
                    len,
                    slot,
                    done: false,
                })
            })
            .collect();
        Handed {
            asked,
            chunks,
            next: AtomicUsize::new(0),
            over: AtomicBool::new(false),
        }
    }

    /// How many chunks it holds.
    pub(super) fn len(&self) -> usize {
        self.chunks.len()
    }

    /// Takes the work back: nothing is started after it, a chunk a thread is preparing is
    /// waited for (one chunk's work). The chunks done go to `ready` in order; every slot's
    /// buffer of the rest to `spare`.
    pub(super) fn retire(&self, ready: &mut VecDeque<Ready>, spare: &mut Vec<Prepared>) {
        self.over.store(true, Ordering::SeqCst);
        for m in &self.chunks {
            let mut p = crate::prepare::lock_soon(m);
            let slot = std::mem::take(&mut p.slot);
            if p.done {
                ready.push_back(Ready {
                    at: p.at,
                    len: p.len,
                    asked: self.asked,
                    slot,
                });
            } else {
                keep(spare, slot);
            }
        }
    }
}

impl Idle for Handed {
    fn work_one(&self) -> bool {
        if self.over.load(Ordering::Acquire) {
            return false;
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        let Some(m) = self.chunks.get(i) else {
            return false;
        };
        // Only its owner, retiring it, holds a piece no worker was given.
        let mut p = match m.try_lock() {
            Ok(p) => p,
            Err(TryLockError::WouldBlock | TryLockError::Poisoned(_)) => return false,
        };
        if self.over.load(Ordering::SeqCst) {
            return false;
        }
        let p = &mut *p;
        // SAFETY: `over` is unset and this thread holds the piece's lock, so its owner has not
        // returned from `retire`: the bytes are allocated and unchanged (`new`'s contract).
        let bytes = unsafe { std::slice::from_raw_parts(p.ptr, p.len) };
        let (lit, anchors) = self.asked;
        Job::of(bytes, lit, anchors, &mut p.slot).run();
        p.done = true;
        true
    }
}

/// A slot kept for its buffer, at most a batch's worth.
fn keep(spare: &mut Vec<Prepared>, slot: Prepared) {
    if spare.len() < crate::prepare::BATCH {
        spare.push(slot);
    }
}

/// Puts what was prepared early for the chunk at stream offset `at`, `len` bytes long, into
/// `slot` if it was prepared as `asked` (the turn's slot's buffer is kept for later work); true
/// if it was. Chunks before `at` were not taken: they go.
pub(super) fn take(
    early: &mut Early,
    at: u64,
    len: usize,
    asked: Asked,
    slot: &mut Prepared,
) -> bool {
    let (ready, spare) = (&mut early.ready, &mut early.spare);
    while let Some(r) = ready.front() {
        if r.at >= at {
            break;
        }
        if let Some(r) = ready.pop_front() {
            keep(spare, r.slot);
        }
    }
    match ready.front() {
        Some(r) if r.at == at && r.len == len && r.asked == asked => {}
        _ => return false,
    }
    let Some(mut r) = ready.pop_front() else {
        return false;
    };
    let fingerprint = slot.fingerprint;
    std::mem::swap(slot, &mut r.slot);
    slot.fingerprint = fingerprint;
    keep(spare, r.slot);
    true
}

/// Where the stream's early work stands: handed over, and done and not taken yet.
#[derive(Default)]
pub(super) struct Early {
    pub(super) work: Option<Arc<Handed>>,
    pub(super) ready: VecDeque<Ready>,
    pub(super) spare: Vec<Prepared>,
    /// The stream's last bulk turn, counted among its mirror's (see `Mirror::bulk_turn`).
    pub(super) last: Option<u64>,
}

impl std::fmt::Debug for Early {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Early")
            .field("work", &self.work.as_ref().map(|w| w.len()))
            .field("ready", &self.ready.len())
            .finish()
    }
}

impl Early {
    /// Takes the work handed over back (see [`Handed::retire`]).
    pub(super) fn retire(&mut self) {
        if let Some(w) = self.work.take() {
            w.retire(&mut self.ready, &mut self.spare);
        }
    }

    /// The stream offset past the last chunk done, if any is.
    pub(super) fn ready_end(&self) -> Option<u64> {
        self.ready.back().map(|r| r.at + r.len as u64)
    }
}
