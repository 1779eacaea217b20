//! A whole stream encoded in one go ([`Encoder`]), for tools, benches and tests that hold a
//! stream's bytes rather than a link's queues. It runs the link's own send path
//! ([`send::emit`](crate::send::emit)) turn after turn, with a turn's raw budget as the link's
//! ([`RAW_TURN`]), and a turn's quantum and frame room as a link's when they are set
//! ([`Encoder::set_turn_limits`]; unbounded otherwise): the records are the ones a link writes
//! for the same bytes, except where another stream's turn ends a run sooner.

use std::collections::VecDeque;

use bytes::Bytes;

use crate::cache::ChunkCache;
use crate::config::{CodecConfig, Pressure};
use crate::context::Slots;
use crate::delta::{self, SharedBases};
use crate::mirror::Mirror;
use crate::prepare;
use crate::report::EncodeStats;
use crate::send::{self, Limits, RAW_TURN, Sender};

/// One direction of one stream, encoded as a whole: the stream's sender, a mirror and counts.
pub struct Encoder {
    cfg: CodecConfig,
    pub(crate) mirror: Mirror,
    pub(crate) sender: Sender,
    /// What was pushed and not sent yet (a chunk waiting for its boundary).
    queue: VecDeque<Bytes>,
    queued: u64,
    sent: u64,
    stats: EncodeStats,
    /// A turn's quantum and frame room (see [`set_turn_limits`](Self::set_turn_limits)).
    turn: (usize, usize),
    /// Blocks until the store of bases has read something (see
    /// [`set_store_wait`](Self::set_store_wait)).
    store_wait: Option<StoreWait>,
    /// Unflushed bytes that make a turn (see [`set_gather`](Self::set_gather)).
    gather: usize,
}

/// Blocks until the disk tier of the store of bases has finished a read, or a while has passed.
pub type StoreWait = Box<dyn FnMut() + Send>;

impl Encoder {
    pub fn new(cfg: CodecConfig) -> Self {
        let mut mirror = Mirror::new(cfg.cache_bytes, 64 << 20, cfg.zstd_level);
        mirror.set_long_context(cfg.long, Slots::default());
        mirror.set_bases(delta::shared(cfg.delta_bytes));
        // Its decoder is this build's (`Decoder::new`): bases keep their place.
        mirror.cache_mut().set_quiet_bases(true);
        Encoder {
            mirror,
            sender: Sender::new(cfg.policy()),
            cfg,
            queue: VecDeque::new(),
            queued: 0,
            sent: 0,
            stats: EncodeStats::default(),
            turn: (usize::MAX, usize::MAX),
            store_wait: None,
            gather: 0,
        }
    }

    /// Chunks whose bases the disk tier is reading wait for them, as a link's do: the encoder
    /// calls `wait` (which blocks until the store has read something, or a while has passed)
    /// and goes on. Without it (the default) such chunks go with the bases at hand.
    pub fn set_store_wait(&mut self, wait: Option<StoreWait>) {
        self.sender.policy.wait_bases = wait.is_some();
        self.store_wait = wait;
    }

    /// Ends each turn as a link's does: after `quantum` record bytes, and within a frame of
    /// `room` (unbounded unless set). Runs of literals and of deltas end with their frame.
    pub fn set_turn_limits(&mut self, quantum: usize, room: usize) {
        self.turn = (quantum, room);
    }

    /// Takes a turn only once `bytes` wait unflushed, as a link's bulk stream does
    /// ([`send::gather`]); by default every push takes its turns.
    pub fn set_gather(&mut self, bytes: usize) {
        self.gather = bytes;
    }

    pub fn stats(&self) -> &EncodeStats {
        &self.stats
    }

    /// Turns that wrote records so far: the frames a link would have sent them in (each with
    /// a header of its own, which the records here do not include).
    pub fn turns(&self) -> u64 {
        self.stats.frames
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

    /// The mirror cache, to set how it keeps bases
    /// ([`ChunkCache::set_quiet_bases`], as the peer's decoder does).
    pub fn cache_mut(&mut self) -> &mut ChunkCache {
        self.mirror.cache_mut()
    }

    /// Ends the stream: what waits is sent (into `out`) and the next bytes start a new stream
    /// on the same caches, with a context of its own, as a new connection would.
    pub fn end_stream(&mut self, pressure: Pressure, out: &mut Vec<u8>) {
        self.push(&[], true, pressure, out);
        self.sender = Sender::new(crate::config::Policy {
            wait_bases: self.store_wait.is_some(),
            ..self.cfg.policy()
        });
        self.queued = 0;
        self.sent = 0;
    }

    /// Bytes held back waiting for a chunk boundary.
    pub fn pending(&self) -> usize {
        (self.queued - self.sent) as usize
    }

    /// Takes stream bytes and appends records to `out`. Without `flush`, the bytes after the last
    /// chunk boundary wait for more data; with it (latency class, end of stream) nothing waits.
    pub fn push(&mut self, data: &[u8], flush: bool, pressure: Pressure, out: &mut Vec<u8>) {
        if !data.is_empty() {
            self.queue.push_back(Bytes::copy_from_slice(data));
            self.queued += data.len() as u64;
        }
        if flush {
            self.sender.flush_at = self.queued;
        }
        let lim = Limits {
            budget: RAW_TURN,
            quantum: self.turn.0,
            room: self.turn.1,
        };
        // Turn after turn, as the link's scheduler runs them, until nothing more may go (a
        // stream is ready with a flush due or enough bytes gathered).
        while self.sent < self.queued
            && (self.sender.flush_at > self.sent || self.queued - self.sent >= self.gather as u64)
        {
            let before = out.len();
            let n = send::emit(
                &mut self.sender,
                &mut self.queue,
                self.sent,
                &self.cfg,
                &mut self.mirror,
                pressure,
                &lim,
                out,
                &mut self.stats,
            );
            self.sent += n as u64;
            self.stats.frames += u64::from(n > 0 || out.len() > before);
            if self.sender.waiting() {
                if let Some(wait) = self.store_wait.as_mut() {
                    wait();
                }
                continue;
            }
            if n == 0 {
                break;
            }
        }
    }
}
