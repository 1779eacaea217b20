//! The scheduler: what goes out on a lane, in order. Control frames first, then latency-class
//! streams, then bulk streams as the shaper chooses (services by share, guarantee and ceiling;
//! see `streams/shaper.rs`), each stream's turn 32 KiB (a whole frame for an optimized stream),
//! within its stream's and the link's credit.

use std::sync::Arc;
use std::time::Instant;

use bytes::BytesMut;

use super::streams::Queue;
use super::{Event, Link, State};
use crate::coding::{CodedTurn, Emitted, Role};
use crate::frame::{self, Frame, StreamId};
use crate::lane::{LANES, MAIN_LANE};

/// Bytes a bulk stream may send in one scheduling turn before the next stream gets its turn.
const BULK_QUANTUM: usize = 32 * 1024;

/// Record bytes after which a coded stream's turn ends, so the next stream gets its turn (about
/// 12 ms of a T3).
const CODED_QUANTUM: usize = 64 * 1024;

/// A coded stream's turn for a peer that takes frames of up to `peer_max_frame` bytes: the
/// record bytes after which it ends (its quantum) and the frame's room for them. A turn is a
/// whole frame, and a run of deltas or literals ends with it. The room is what the frame may
/// hold at most, a run's chunks as literals included, so a room of 64 KiB ended a run of
/// deltas after seven chunks, and every 64 KiB of a changed backup cost a frame header: a
/// 1.6 GB pgbench backup's changed copy went in 26,000 frames, whose 22-byte headers were a
/// tenth of its wire bytes. (Benches encode with the same limits.)
pub fn coded_turn(peer_max_frame: usize) -> (usize, usize) {
    (
        peer_max_frame.min(CODED_QUANTUM),
        peer_max_frame.saturating_sub(4),
    )
}

/// How a stream's turn ended.
enum Turn {
    /// It sent a frame, or had nothing to send: go on with the next stream.
    Next,
    /// It needs more link credit than is left: nothing else goes on this lane now.
    Stop,
}

impl Link {
    /// Appends frames to `out` until it holds at least `limit` bytes or nothing is left to send
    /// at `now`. Control frames go first, then latency-class streams, then bulk streams by
    /// service. Returns the number of bytes appended.
    pub fn poll_transmit(&mut self, now: Instant, out: &mut BytesMut, limit: usize) -> usize {
        self.poll_transmit_lane(now, crate::lane::MAIN_LANE, out, limit)
    }

    /// Like [`poll_transmit`](Self::poll_transmit) for one lane: its control frames, then its
    /// streams' data (latency first, then bulk).
    pub fn poll_transmit_lane(
        &mut self,
        now: Instant,
        lane: usize,
        out: &mut BytesMut,
        limit: usize,
    ) -> usize {
        if !self.lane_usable(lane) {
            return 0;
        }
        self.streams.shaper.advance(now);
        let start = out.len();
        if lane == MAIN_LANE && !self.ctrl[lane].is_empty() {
            // How far we read goes with the control frames already going.
            self.tell_received();
        }
        let from = self.transmit_control(lane, out);
        if self.streams_may_send_on(lane) {
            while out.len() < limit && self.link_credit.available() > 0 {
                let Some((queue, id)) = self.streams.next_ready(lane) else {
                    break;
                };
                if let Turn::Stop = self.transmit_stream(lane, queue, id, out) {
                    break;
                }
            }
        }
        // Nothing leaves a call waiting: the frames still being made are written now.
        self.finish_pending(out);
        if lane == MAIN_LANE {
            self.replay_sent(&out[from..]);
        }
        let n = out.len() - start;
        self.link_wire_out += n as u64;
        n
    }

    /// The main lane, or the latency lane while attached: frames for a lane not attached (yet,
    /// or again after a lost connection) wait; a suspended link has no connection at all.
    fn lane_usable(&self, lane: usize) -> bool {
        self.state != State::Suspended
            && (lane == crate::lane::MAIN_LANE || (lane < LANES && self.lane_attached))
    }

    /// True while streams may send on `lane`: the link is up, its caches are loaded and, after
    /// a lost connection (or a lost latency lane), the peer's resume list has settled them.
    pub(super) fn streams_may_send_on(&self, lane: usize) -> bool {
        matches!(self.state, State::Open | State::Draining)
            && !self.loading
            && self.resuming.is_none()
            && (lane == crate::lane::MAIN_LANE || self.lane_resuming.is_none())
    }

    /// True if some lane would produce bytes now.
    pub fn wants_transmit(&self) -> bool {
        (0..LANES).any(|l| self.wants_transmit_lane(l))
    }

    /// True if [`poll_transmit_lane`](Self::poll_transmit_lane) would produce bytes now.
    pub fn wants_transmit_lane(&self, lane: usize) -> bool {
        self.lane_usable(lane)
            && (!self.ctrl[lane].is_empty()
                || (lane == MAIN_LANE && self.replay_waits())
                || (self.streams_may_send_on(lane)
                    && self.link_credit.available() > 0
                    && self.streams.any_ready(lane)))
    }

    /// Encodes the lane's queued control frames. A `Checkpoint` takes the mirror's state as it
    /// leaves: that is what the peer's cache will be when it reads the frame. On the main lane,
    /// what a replay sends again goes right after our hello, and nothing but the hello goes
    /// until the peer's hello decided whether it replays. Returns where the lane's bytes past
    /// any hello, and what was sent again, start in `out` (what a replay keeps).
    fn transmit_control(&mut self, lane: usize, out: &mut BytesMut) -> usize {
        let mut from = out.len();
        loop {
            if lane == MAIN_LANE
                && let Some(again) = self.replay_again()
            {
                for b in again {
                    out.extend_from_slice(&b);
                }
                from = out.len();
            }
            let Some(mut f) = self.ctrl[lane].pop_front() else {
                break;
            };
            let hello = matches!(f, Frame::Hello(_));
            if lane == MAIN_LANE && !hello && self.replay_undecided() {
                self.ctrl[lane].push_front(f);
                break;
            }
            if let Frame::Checkpoint { scope, digest } = &mut f {
                let Some(state) = self.coding.checkpoint_mirror(lane, scope) else {
                    continue;
                };
                *digest = state.digest();
                self.events.push_back(Event::Checkpoint {
                    role: Role::Mirror,
                    lane,
                    scope: Arc::from(scope.as_str()),
                    state,
                });
            }
            let before = out.len();
            f.encode(out);
            // A service's wire bytes are its streams' Open, Data, Coded and Chunk frames, counted
            // alike each way.
            if let Frame::Open { stream, .. } | Frame::Chunk { stream, .. } = &f
                && let Some(s) = self.streams.get(stream)
            {
                self.wire.entry(s.service.clone()).or_default().out += (out.len() - before) as u64;
            }
            if matches!(f, Frame::Chunk { .. }) {
                self.coding.answered();
            }
            if hello && lane == MAIN_LANE {
                self.replay_hello_out();
                from = out.len();
            }
        }
        from
    }

    /// One stream's turn: a `Data` or `Coded` frame, as credit and the quantum allow.
    fn transmit_stream(
        &mut self,
        lane: usize,
        queue: Queue,
        id: StreamId,
        out: &mut BytesMut,
    ) -> Turn {
        let link_avail = self.link_credit.available();
        let peer_max_frame = self.peer.max_frame;
        let (cap, workers) = self.coding.pending_frames(lane);
        // A bulk stream's coded frame may wait for its context records while other streams'
        // turns go on, and its own next (see `Coding::emit_frame`), but never its stream's
        // last, and never past a frame that may not wait: frames leave in the order they were
        // planned. One that makes no context record, with none waiting before it, is written
        // in place.
        let pend = match self.streams.get(&id) {
            Some(s) => {
                cap > 0
                    && queue == Queue::Bulk
                    && !s.send.fin_requested
                    && s.send
                        .coder
                        .as_deref()
                        .is_some_and(|c| !self.pending.is_empty() || !self.coding.plans_whole(c))
            }
            None => false,
        };
        if !pend {
            self.finish_pending(out);
        } else if let Some(at) = wanopt_codec::send::before_last(&self.pending, |f| f.id == id) {
            self.finish_pending_through(at, out);
        }
        let Some(s) = self.streams.get_mut(&id) else {
            return Turn::Next;
        };
        s.scheduled = false;
        if !s.send.wants_send() {
            return Turn::Next;
        }
        let quantum = if queue == Queue::Latency || s.send.coder.is_some() {
            coded_turn(peer_max_frame).0
        } else {
            BULK_QUANTUM.min(peer_max_frame)
        };
        let before = out.len();
        let sent = s.send.credit.sent();
        let need = s.send.min_credit();
        let (n, fin) = if let Some(coder) = s.send.coder.as_mut() {
            if link_avail < need {
                // Wait for link credit to cover the next chunk, keeping the stream's turn.
                self.streams.requeue(queue, lane, id, true);
                return Turn::Stop;
            }
            let turn = CodedTurn {
                id,
                lane,
                service: &s.service,
                sent,
                queued: s.send.queued,
                fin_requested: s.send.fin_requested,
                budget: s.send.credit.available().min(link_avail) as usize,
                quantum,
                room: coded_turn(peer_max_frame).1,
            };
            match self
                .coding
                .emit_frame(turn, coder, &mut s.send.queue, out, pend)
            {
                Some(Emitted {
                    raw,
                    pending: Some((f, p)),
                    ..
                }) => {
                    self.pending
                        .push(u64::from(f.id.0), f, p, workers.as_deref());
                    (raw, false)
                }
                Some(e) => (e.raw, e.fin),
                None => return Turn::Next,
            }
        } else {
            let n = (s.send.queued as u64)
                .min(s.send.credit.available())
                .min(link_avail)
                .min(quantum as u64) as usize;
            let fin = s.send.fin_requested && n == s.send.queued;
            frame::encode_data_header(out, id, sent, fin, n);
            s.send.take_into(n, out);
            (n, fin)
        };
        if s.send.on_sent(n, fin, self.cfg.send_buffer) {
            self.events.push_back(Event::Writable(id));
        }
        let wire = (out.len() - before) as u64;
        let service = s.service.clone();
        // A stream whose next chunk waits for its bases comes again when the store has read
        // them (`store_ready`), not at once.
        let waiting = s.send.coder.as_ref().is_some_and(|c| c.sender.waiting());
        let again = s.send.wants_send() && !waiting;
        self.wire.entry(service.clone()).or_default().out += wire;
        if queue == Queue::Bulk {
            self.streams.shaper.charge(lane, &service, wire);
        }
        self.link_credit.consume(n as u64);
        self.lane_sent[lane] += n as u64;
        if again {
            self.streams.requeue(queue, lane, id, false);
        }
        if fin {
            self.maybe_remove(id);
        }
        // Fewer than `cap` wait on: the oldest are finished, the last left to their records.
        let (n, cap) = (self.pending.len(), cap.max(1));
        if n >= cap {
            self.finish_pending_through(n - cap, out);
        }
        Turn::Next
    }

    /// Writes the frames still waiting for their context records to `out`, in the order they
    /// were planned, each counted to its service as it is written.
    fn finish_pending(&mut self, out: &mut BytesMut) {
        self.finish_pending_through(usize::MAX, out);
    }

    /// [`finish_pending`](Self::finish_pending) of the frames up to the `last`th.
    fn finish_pending_through(&mut self, last: usize, out: &mut BytesMut) {
        if self.pending.is_empty() {
            return;
        }
        let mut pending = std::mem::take(&mut self.pending);
        pending.finish_through(last, |f, p| {
            let coder = self
                .streams
                .get_mut(&f.id)
                .and_then(|s| s.send.coder.as_deref_mut());
            let wire = self.coding.finish_frame(&f, p, coder, out) as u64;
            self.wire.entry(f.service.clone()).or_default().out += wire;
            self.streams.shaper.charge(f.lane, &f.service, wire);
        });
        self.pending = pending;
    }
}
