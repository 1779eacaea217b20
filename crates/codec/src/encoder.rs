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
    pub(crate) stream: Stream,
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

/// One stream's send side in an [`Encoder`] or [`Streams`]: its sender, and what was pushed
/// and not sent yet (a chunk waiting for its boundary).
pub(crate) struct Stream {
    pub(crate) sender: Sender,
    queue: VecDeque<Bytes>,
    queued: u64,
    sent: u64,
}

impl Stream {
    fn new(cfg: &CodecConfig) -> Self {
        Stream {
            sender: Sender::new(cfg.policy()),
            queue: VecDeque::new(),
            queued: 0,
            sent: 0,
        }
    }

    /// Queues `data` (as it is: a link's stream queues the buffers its application wrote);
    /// with `flush`, everything queued goes without waiting for a boundary.
    fn push(&mut self, data: Bytes, flush: bool) {
        if !data.is_empty() {
            self.queued += data.len() as u64;
            self.queue.push_back(data);
        }
        if flush {
            self.sender.flush_at = self.queued;
        }
    }

    /// Whether a turn may come, as the link's scheduler sees it: a flush is due, or `gather`
    /// bytes wait.
    fn ready(&self, gather: usize) -> bool {
        self.sent < self.queued
            && (self.sender.flush_at > self.sent || self.queued - self.sent >= gather as u64)
    }

    /// One turn (a link's frame) into `out`: the raw bytes it sent.
    fn turn(
        &mut self,
        cfg: &CodecConfig,
        mirror: &mut Mirror,
        pressure: Pressure,
        lim: &Limits,
        out: &mut Vec<u8>,
        stats: &mut EncodeStats,
    ) -> usize {
        let before = out.len();
        let n = send::emit(
            &mut self.sender,
            &mut self.queue,
            self.sent,
            cfg,
            mirror,
            pressure,
            lim,
            out,
            stats,
        );
        self.sent += n as u64;
        stats.frames += u64::from(n > 0 || out.len() > before);
        n
    }
}

/// A mirror as a link's encoder sets one up for `cfg` (its decoder is this build's).
fn mirror_for(cfg: &CodecConfig) -> Mirror {
    let mut mirror = Mirror::new(cfg.cache_bytes, 64 << 20, cfg.zstd_level);
    mirror.set_long_context(cfg.long, Slots::default());
    mirror.set_bases(delta::shared(cfg.delta_bytes));
    // Its decoder is this build's (`Decoder::new`): bases keep their place.
    mirror.cache_mut().set_quiet_bases(true);
    mirror
}

impl Encoder {
    pub fn new(cfg: CodecConfig) -> Self {
        Encoder {
            mirror: mirror_for(&cfg),
            stream: Stream::new(&cfg),
            cfg,
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
        self.stream.sender.policy.wait_bases = wait.is_some();
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
        self.stream = Stream::new(&self.cfg);
        self.stream.sender.policy.wait_bases = self.store_wait.is_some();
    }

    /// Bytes held back waiting for a chunk boundary.
    pub fn pending(&self) -> usize {
        (self.stream.queued - self.stream.sent) as usize
    }

    /// Takes stream bytes and appends records to `out`. Without `flush`, the bytes after the last
    /// chunk boundary wait for more data; with it (latency class, end of stream) nothing waits.
    pub fn push(&mut self, data: &[u8], flush: bool, pressure: Pressure, out: &mut Vec<u8>) {
        self.push_bytes(Bytes::copy_from_slice(data), flush, pressure, out);
    }

    /// [`push`](Self::push) of bytes already in a buffer of their own, queued without a copy as
    /// a link queues what its application wrote.
    pub fn push_bytes(&mut self, data: Bytes, flush: bool, pressure: Pressure, out: &mut Vec<u8>) {
        self.stream.push(data, flush);
        let lim = Limits {
            budget: RAW_TURN,
            quantum: self.turn.0,
            room: self.turn.1,
        };
        // Turn after turn, as the link's scheduler runs them, until nothing more may go.
        while self.stream.ready(self.gather) {
            let n = self.stream.turn(
                &self.cfg,
                &mut self.mirror,
                pressure,
                &lim,
                out,
                &mut self.stats,
            );
            if self.stream.sender.waiting() {
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

/// Several streams of one direction encoded against one mirror, a turn (a link's frame) at a
/// time, taken in turn as a link's scheduler takes the bulk streams of a parallel copy (an RMAN
/// duplicate's channels): each stream has its own sender and context, and a chunk one stream
/// sent is a reference in another's. Each turn's records decode alone, in order, with
/// [`Decoder::decode_frame`](crate::Decoder::decode_frame) and the stream's context.
///
/// A turn's context records are made on the workers (see [`send::emit_pending`]) while the
/// next turns are planned, so several streams' contexts compress at once, and one stream's
/// context compresses while its next turn is planned; turns are finished (their records
/// written) in the order they were planned, a stream's before its turn after next is planned,
/// and at most [`PENDING`] wait at once.
pub struct Streams {
    cfg: CodecConfig,
    mirror: Mirror,
    streams: Vec<Stream>,
    stats: EncodeStats,
    gather: usize,
    /// The stream whose turn comes next, if it may go.
    next: usize,
    /// Turns planned and not finished, with their streams.
    pending: send::PendingTurns<usize>,
}

/// Turns that may wait for their context records at once: one per long context a link gives
/// by default ([`LongContext`](crate::LongContext)).
pub const PENDING: usize = 8;

impl Streams {
    /// `n` streams (at least one), as a link's bulk streams that gather `gather` bytes a turn
    /// ([`send::gather`]).
    pub fn new(cfg: CodecConfig, n: usize, gather: usize) -> Self {
        Streams {
            mirror: mirror_for(&cfg),
            streams: (0..n.max(1)).map(|_| Stream::new(&cfg)).collect(),
            cfg,
            stats: EncodeStats::default(),
            gather,
            next: 0,
            pending: send::PendingTurns::default(),
        }
    }

    /// Prepares chunks on `workers` (see [`Mirror::set_workers`]).
    pub fn set_workers(&mut self, workers: Option<std::sync::Arc<dyn prepare::Workers>>) {
        self.mirror.set_workers(workers);
    }

    pub fn stats(&self) -> &EncodeStats {
        &self.stats
    }

    /// Queues `data` on stream `k` (none past the last); with `flush`, all the stream's bytes
    /// go without waiting for a boundary.
    pub fn push(&mut self, k: usize, data: &[u8], flush: bool) {
        self.push_bytes(k, Bytes::copy_from_slice(data), flush);
    }

    /// [`push`](Self::push) of bytes already in a buffer of their own, queued without a copy.
    pub fn push_bytes(&mut self, k: usize, data: Bytes, flush: bool) {
        if let Some(s) = self.streams.get_mut(k) {
            s.push(data, flush);
        }
    }

    /// Sends `parts`, one per stream, as parallel channels' clients write them: `write` bytes
    /// to each stream in turn (its turns taken as they become ready), then a flush of every
    /// stream. Appends each turn's records to `out` and, to `turns`, its stream and where its
    /// records end in `out`.
    pub fn send(
        &mut self,
        parts: &[&[u8]],
        write: usize,
        pressure: Pressure,
        out: &mut Vec<u8>,
        turns: &mut Vec<(usize, usize)>,
    ) {
        let parts: Vec<Bytes> = parts.iter().map(|p| Bytes::copy_from_slice(p)).collect();
        self.send_bytes(&parts, write, pressure, out, turns);
    }

    /// [`send`](Self::send) of parts already in buffers of their own: each write is a slice of
    /// its part, queued without a copy as a link queues what its application wrote.
    pub fn send_bytes(
        &mut self,
        parts: &[Bytes],
        write: usize,
        pressure: Pressure,
        out: &mut Vec<u8>,
        turns: &mut Vec<(usize, usize)>,
    ) {
        let mut take = |s: &mut Self, out: &mut Vec<u8>| while s.turn(pressure, out, turns) {};
        let write = write.max(1);
        let longest = parts.iter().map(|p| p.len()).max().unwrap_or(0);
        for at in (0..longest).step_by(write) {
            for (k, p) in parts.iter().enumerate() {
                if at < p.len() {
                    self.push_bytes(k, p.slice(at..p.len().min(at + write)), false);
                    take(self, out);
                }
            }
        }
        for k in 0..parts.len() {
            self.push_bytes(k, Bytes::new(), true);
        }
        take(self, out);
        self.finish(out, turns);
    }

    /// The next stream's turn that sends something; false when no stream may send. Turns
    /// finished meanwhile have their records appended to `out`, and their streams and where
    /// their records end in `out` to `turns`.
    pub fn turn(
        &mut self,
        pressure: Pressure,
        out: &mut Vec<u8>,
        turns: &mut Vec<(usize, usize)>,
    ) -> bool {
        let lim = Limits {
            budget: RAW_TURN,
            quantum: usize::MAX,
            room: usize::MAX,
        };
        let n = self.streams.len();
        for i in 0..n {
            let k = (self.next + i) % n;
            if !self.streams[k].ready(self.gather) {
                continue;
            }
            // The stream's turn before its last first (and every turn planned before it): its
            // last may wait for its records while this one is planned.
            if let Some(at) = send::before_last(&self.pending, |&p| p == k) {
                self.finish_through(at, out, turns);
            }
            let s = &mut self.streams[k];
            // As the link does: a turn that makes no context record, with nothing waiting
            // before it, is written in place.
            if self.pending.is_empty() && s.sender.plans_whole(pressure) {
                let before = out.len();
                let raw = send::emit(
                    &mut s.sender,
                    &mut s.queue,
                    s.sent,
                    &self.cfg,
                    &mut self.mirror,
                    pressure,
                    &lim,
                    out,
                    &mut self.stats,
                );
                s.sent += raw as u64;
                if out.len() > before {
                    turns.push((k, out.len()));
                    self.stats.frames += 1;
                    self.next = (k + 1) % n;
                    return true;
                }
                continue;
            }
            let p = send::emit_pending(
                &mut s.sender,
                &mut s.queue,
                s.sent,
                &self.cfg,
                &mut self.mirror,
                pressure,
                &lim,
                &mut self.stats,
            );
            s.sent += p.raw() as u64;
            let went = !p.is_empty();
            if went {
                self.pending
                    .push(k as u64, k, p, self.mirror.workers().as_deref());
                if self.pending.len() > PENDING {
                    self.finish_through(0, out, turns);
                }
            } else {
                // Nothing to write; the stream's context comes back to it.
                p.finish(&mut s.sender, &mut self.mirror, out, &mut self.stats);
            }
            if went {
                self.stats.frames += 1;
                self.next = (k + 1) % n;
                return true;
            }
        }
        false
    }

    /// Finishes every turn still waiting for its context records (see [`turn`](Self::turn)).
    pub fn finish(&mut self, out: &mut Vec<u8>, turns: &mut Vec<(usize, usize)>) {
        self.finish_through(usize::MAX, out, turns);
    }

    /// Finishes the waiting turns up to the `last`th, in order.
    fn finish_through(&mut self, last: usize, out: &mut Vec<u8>, turns: &mut Vec<(usize, usize)>) {
        let (streams, mirror, stats) = (&mut self.streams, &mut self.mirror, &mut self.stats);
        self.pending.finish_through(last, |k, p| {
            match streams.get_mut(k) {
                Some(s) => p.finish(&mut s.sender, mirror, out, stats),
                None => p.finish_orphan(mirror, out, stats),
            };
            turns.push((k, out.len()));
        });
    }
}
