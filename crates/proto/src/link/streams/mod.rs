//! A link's streams: each one a [`Stream`] with a send and a receive half, the ids either side
//! has used, and the scheduler's ready queues (latency per lane; bulk per lane and service, shared
//! by the [`Shaper`]). A stream is in a ready queue at most once (`scheduled`).

mod recv;
mod send;
mod shaper;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

pub(crate) use recv::RecvHalf;
pub(crate) use send::{Kept, SendHalf};
pub(crate) use shaper::Shaper;
pub use shaper::{MAX_SHARE, Shaping};

use crate::frame::{Class, StreamId};
use crate::lane::LANES;

#[derive(Debug)]
pub(crate) struct Stream {
    pub class: Class,
    /// The lane all of this stream's frames travel on (fixed at open, so they stay in order).
    pub lane: usize,
    pub service: Arc<str>,
    pub send: SendHalf,
    pub recv: RecvHalf,
    /// True while the stream is in a ready queue.
    pub scheduled: bool,
}

impl Stream {
    /// True once both directions are finished (with resumption, once the peer confirmed our
    /// end).
    pub fn done(&self) -> bool {
        self.send.finished() && self.recv.read_done
    }
}

/// Which ready queue a stream waits in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Queue {
    Latency,
    Bulk,
}

/// The streams of one link and the ids in use.
#[derive(Debug)]
pub(crate) struct Streams {
    pub map: HashMap<StreamId, Stream>,
    /// True on the connecting side: its ids are odd, the listener's even.
    initiator: bool,
    next_local: u32,
    /// Highest stream id the peer has opened on each lane (ids below it that are absent are closed).
    peer_max_id: [u32; LANES],
    /// Streams the peer opened that are still open.
    pub peer_open: u32,
    /// Of those, the ones per service, and the ones counted as bulk.
    peer_services: HashMap<Arc<str>, u32>,
    peer_bulk: HashSet<StreamId>,
    ready_latency: [VecDeque<StreamId>; LANES],
    /// Bulk streams' turns, by service.
    pub shaper: Shaper,
}

impl Streams {
    pub fn new(initiator: bool) -> Self {
        Streams {
            map: HashMap::new(),
            initiator,
            next_local: if initiator { 1 } else { 2 },
            peer_max_id: [0; LANES],
            peer_open: 0,
            peer_services: HashMap::new(),
            peer_bulk: HashSet::new(),
            ready_latency: Default::default(),
            shaper: Shaper::default(),
        }
    }

    pub fn get(&self, id: &StreamId) -> Option<&Stream> {
        self.map.get(id)
    }

    pub fn get_mut(&mut self, id: &StreamId) -> Option<&mut Stream> {
        self.map.get_mut(id)
    }

    pub fn is_peer_id(&self, id: StreamId) -> bool {
        (id.0 % 2 == 1) != self.initiator
    }

    /// Streams we opened that are still open.
    pub fn ours(&self) -> usize {
        self.map.keys().filter(|id| !self.is_peer_id(**id)).count()
    }

    /// The id for a new local stream, if any is left.
    pub fn next_id(&mut self) -> Option<StreamId> {
        let id = StreamId(self.next_local);
        self.next_local = self.next_local.checked_add(2)?;
        Some(id)
    }

    /// Checks a peer's new id (ids rise on each lane; opens may arrive in any order across
    /// lanes) and records it.
    pub fn accept_peer_id(&mut self, id: StreamId, lane: usize) -> bool {
        if !self.is_peer_id(id) || id.0 <= self.peer_max_id[lane] || self.map.contains_key(&id) {
            return false;
        }
        self.peer_max_id[lane] = id.0;
        true
    }

    /// Highest stream id the peer has opened, per lane.
    pub fn peer_max_ids(&self) -> [u32; LANES] {
        self.peer_max_id
    }

    /// True for an id that was in use once and is closed now: late frames for it are ignored.
    pub fn was_open(&self, id: StreamId) -> bool {
        if self.is_peer_id(id) {
            self.peer_max_id.iter().any(|m| id.0 <= *m)
        } else {
            id.0 < self.next_local
        }
    }

    /// Counts a stream the peer opened on `service` (and as bulk) until it is removed.
    pub fn count_peer(&mut self, id: StreamId, service: &Arc<str>, bulk: bool) {
        self.peer_open += 1;
        *self.peer_services.entry(service.clone()).or_insert(0) += 1;
        if bulk {
            self.peer_bulk.insert(id);
        }
    }

    /// Streams the peer has open on `service`.
    pub fn peer_on(&self, service: &str) -> u32 {
        self.peer_services.get(service).copied().unwrap_or(0)
    }

    /// Bulk streams the peer has open.
    pub fn peer_bulk(&self) -> u32 {
        self.peer_bulk.len() as u32
    }

    /// Removes a stream, counting it off the peer's open streams if the peer opened it.
    pub fn remove(&mut self, id: StreamId) -> Option<Stream> {
        let s = self.map.remove(&id)?;
        if self.is_peer_id(id) {
            self.peer_open = self.peer_open.saturating_sub(1);
            self.peer_bulk.remove(&id);
            if let Some(n) = self.peer_services.get_mut(&s.service) {
                *n -= 1;
                if *n == 0 {
                    self.peer_services.remove(&s.service);
                }
            }
        }
        Some(s)
    }

    /// Puts a stream in its ready queue if it has something to send and is not queued yet.
    pub fn schedule(&mut self, id: StreamId) {
        if let Some(s) = self.map.get_mut(&id)
            && !s.scheduled
            && s.send.wants_send()
        {
            match s.class {
                Class::Latency => self.ready_latency[s.lane].push_back(id),
                Class::Bulk => self.shaper.push(s.lane, &s.service, id, false),
            }
            s.scheduled = true;
        }
    }

    /// The next stream whose turn it is on a lane: latency first, then bulk as the shaper
    /// chooses.
    pub fn next_ready(&mut self, lane: usize) -> Option<(Queue, StreamId)> {
        if let Some(id) = self.ready_latency[lane].pop_front() {
            return Some((Queue::Latency, id));
        }
        self.shaper.next(lane).map(|(_, id)| (Queue::Bulk, id))
    }

    /// Queues a stream again: at the back after its turn, or at the front to keep its turn.
    pub fn requeue(&mut self, q: Queue, lane: usize, id: StreamId, front: bool) {
        let Some(s) = self.map.get_mut(&id) else {
            return;
        };
        s.scheduled = true;
        match q {
            Queue::Latency if front => self.ready_latency[lane].push_front(id),
            Queue::Latency => self.ready_latency[lane].push_back(id),
            Queue::Bulk => self.shaper.push(lane, &s.service, id, front),
        }
    }

    /// True if a stream of this lane may take its turn now (a bulk service waiting for its
    /// ceiling may not).
    pub fn any_ready(&self, lane: usize) -> bool {
        !self.ready_latency[lane].is_empty() || self.shaper.any_sendable(lane)
    }

    /// Drops every stream and queued turn; returns the ids that were open.
    pub fn clear(&mut self) -> Vec<StreamId> {
        for l in 0..LANES {
            self.ready_latency[l].clear();
        }
        self.shaper.clear();
        self.peer_open = 0;
        self.peer_services.clear();
        self.peer_bulk.clear();
        self.map.drain().map(|(id, _)| id).collect()
    }

    /// Bytes held for streams: unsent plus received but not handed over.
    pub fn buffered(&self) -> usize {
        self.map
            .values()
            .map(|s| s.send.queued + s.recv.buffered())
            .sum()
    }
}
