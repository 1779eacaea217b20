//! A link's streams: each one a [`Stream`] with a send and a receive half, the ids either side
//! has used, and the scheduler's ready queues (latency per lane; bulk per lane and service, shared
//! by the [`Shaper`]). A stream is in a ready queue at most once (`scheduled`).
//!
//! Ids are 32 bits on the wire, and a resumed link lives as long as its peers do, so ids wrap:
//! each side counts its opens in 64 bits (a stream's `number`) and sends the low 32 bits. A new
//! id skips 0 (the link) and any id still in use by a long-lived stream. An id on the wire is
//! read as the number nearest to the highest one seen on its lane (opens are never more than
//! 2^31 apart in flight), and once a side's ids have wrapped, every id of its parity was in use
//! once, so a frame for one that is gone is a late frame, never an error.

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
    /// Which open of its opener this is (see the module's note on ids).
    pub number: u64,
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
    /// The number of our next open (its id is the low 32 bits).
    next_local: u64,
    /// The highest number the peer has opened on each lane (ids below it that are absent are
    /// closed).
    peer_max_id: [u64; LANES],
    /// The highest number we opened on each lane.
    own_lane_max: [u64; LANES],
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
            own_lane_max: [0; LANES],
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

    /// The id and number of a new local stream, if any is left: ids wrap, skipping 0 and ids
    /// still in use (`None` only if every id of ours is).
    pub fn next_id(&mut self) -> Option<(StreamId, u64)> {
        for _ in 0..=self.map.len() + 1 {
            let n = self.next_local;
            self.next_local = n.checked_add(2)?;
            let id = StreamId(n as u32);
            if id != StreamId::LINK && !self.map.contains_key(&id) {
                return Some((id, n));
            }
        }
        None
    }

    /// Checks a peer's new id (ids rise on each lane; opens may arrive in any order across
    /// lanes) and records it; returns its number.
    pub fn accept_peer_id(&mut self, id: StreamId, lane: usize) -> Option<u64> {
        let n = unwrap_id(id, self.peer_max_id[lane]);
        if !self.is_peer_id(id)
            || id == StreamId::LINK
            || n <= self.peer_max_id[lane]
            || self.map.contains_key(&id)
        {
            return None;
        }
        self.peer_max_id[lane] = n;
        Some(n)
    }

    /// The highest numbers the peer has opened, per lane (their low 32 bits are the ids).
    pub fn peer_max_ids(&self) -> [u64; LANES] {
        self.peer_max_id
    }

    /// Our next number, the peer's highest per lane and ours per lane (for a handover).
    pub fn ids(&self) -> (u64, [u64; LANES], [u64; LANES]) {
        (self.next_local, self.peer_max_id, self.own_lane_max)
    }

    /// Takes the ids [`ids`](Self::ids) gave; false if they are not this side's.
    pub fn restore_ids(
        &mut self,
        next_local: u64,
        peer_max: [u64; LANES],
        own_lane_max: [u64; LANES],
    ) -> bool {
        if next_local % 2 != self.next_local % 2 || own_lane_max.iter().any(|m| *m >= next_local) {
            return false;
        }
        self.next_local = next_local;
        self.peer_max_id = peer_max;
        self.own_lane_max = own_lane_max;
        true
    }

    /// Moves our ids on as if `opens` streams had been opened and closed.
    pub fn skip(&mut self, opens: u64) {
        self.next_local = self.next_local.saturating_add(opens.saturating_mul(2));
    }

    /// Records the lane of a stream we opened.
    pub fn opened(&mut self, lane: usize, number: u64) {
        self.own_lane_max[lane] = self.own_lane_max[lane].max(number);
    }

    /// Whether the peer had seen the open of our stream `s`, by the highest id of ours it had
    /// seen on the stream's lane (from its resume list): that id is one of our recent opens on
    /// that lane, read as the number nearest to our newest there.
    pub fn peer_saw(&self, s: &Stream, seen: [u32; LANES]) -> bool {
        let lane = s.lane.min(LANES - 1);
        // 0 is no stream's id: the peer saw none of ours there.
        seen[lane] != 0 && s.number <= unwrap_id(StreamId(seen[lane]), self.own_lane_max[lane])
    }

    /// True for an id that was in use once and is closed now: late frames for it are ignored.
    pub fn was_open(&self, id: StreamId) -> bool {
        if id == StreamId::LINK {
            return false;
        }
        if self.is_peer_id(id) {
            // Once the peer's ids wrapped, every one of them was in use once.
            self.peer_max_id.iter().any(|m| u64::from(id.0) <= *m)
        } else {
            u64::from(id.0) < self.next_local
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

    /// Puts a stream in its ready queue if it has something to send and is not queued yet. A
    /// stream whose next chunk waits for delta bases being read is not: new bytes, credit or a
    /// flush would only bring the chunk round again before its bases (`Link::store_ready`
    /// resumes it).
    pub fn schedule(&mut self, id: StreamId) {
        if let Some(s) = self.map.get_mut(&id)
            && !s.scheduled
            && s.send.wants_send()
            && !s.send.coder.as_ref().is_some_and(|c| c.sender.waiting())
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

/// The number nearest to `near` whose low 32 bits are `id` (ids wrap around 32 bits).
pub(crate) fn unwrap_id(id: StreamId, near: u64) -> u64 {
    const SPAN: u64 = 1 << 32;
    let n = (near & !(SPAN - 1)) | u64::from(id.0);
    let below = n.checked_sub(SPAN);
    let above = n.checked_add(SPAN);
    [below, Some(n), above]
        .into_iter()
        .flatten()
        .min_by_key(|c| c.abs_diff(near))
        .unwrap_or(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(lane: usize, number: u64) -> Stream {
        Stream {
            class: Class::Bulk,
            lane,
            service: Arc::from("s"),
            number,
            send: SendHalf::new(1 << 16, None),
            recv: RecvHalf::new(1 << 16),
            scheduled: false,
        }
    }

    #[test]
    fn ids_read_as_the_number_nearest_the_newest() {
        let span = 1u64 << 32;
        assert_eq!(unwrap_id(StreamId(7), 0), 7);
        assert_eq!(unwrap_id(StreamId(u32::MAX), 0), u64::from(u32::MAX));
        assert_eq!(unwrap_id(StreamId(3), span - 5), span + 3);
        assert_eq!(unwrap_id(StreamId(u32::MAX - 1), span + 3), span - 2);
        assert_eq!(unwrap_id(StreamId(9), 5 * span + 1), 5 * span + 9);
        assert_eq!(
            unwrap_id(StreamId(0), u64::MAX),
            u64::MAX - u64::from(u32::MAX)
        );
    }

    /// Past 2^31 opens on one side, ids wrap: 0 and ids still in use are skipped, the peer
    /// accepts the wrapped ids as new, and every id that was in use once is known as closed.
    #[test]
    fn ids_wrap_skipping_the_link_and_streams_still_open() {
        for initiator in [true, false] {
            let mut ours = Streams::new(initiator);
            let mut theirs = Streams::new(!initiator);
            // A long-lived stream opened first: its id is still in use when the ids come round.
            let (first, n) = ours.next_id().expect("id");
            ours.map.insert(first, stream(0, n));
            assert_eq!(theirs.accept_peer_id(first, 0), Some(n));
            theirs.map.insert(first, stream(0, n));
            // As if 2^31 - 4 opens came and went since.
            ours.next_local = (1u64 << 32) - 6 + ours.next_local % 2;
            let mut seen = Vec::new();
            for _ in 0..8 {
                let (id, n) = ours.next_id().expect("id");
                assert_ne!(id, StreamId::LINK);
                assert_ne!(id, first, "in use");
                assert_eq!(u64::from(id.0), n % (1 << 32));
                assert_eq!(theirs.accept_peer_id(id, 0), Some(n), "{id}");
                // The same id again (a replayed open) is refused.
                assert_eq!(theirs.accept_peer_id(id, 0), None);
                seen.push(id);
            }
            assert!(seen.iter().any(|id| id.0 < 10), "wrapped: {seen:?}");
            // Every id of ours was in use once: a late frame for any is not an error.
            for id in [
                StreamId(5),
                StreamId(6),
                StreamId(u32::MAX),
                StreamId(u32::MAX - 1),
            ] {
                if !ours.is_peer_id(id) {
                    assert!(ours.was_open(id), "{id}");
                    assert!(theirs.was_open(id), "{id}");
                }
            }
            assert!(!ours.was_open(StreamId::LINK));
        }
        // Before the wrap, ids not yet used are unknown.
        let s = Streams::new(true);
        assert!(!s.was_open(StreamId(1)));
        assert!(!s.was_open(StreamId(0x8000_0001)));
    }

    /// Whether the peer saw our open is judged by the newest number on the stream's lane, so a
    /// lane that opened nothing for a long time is not misread.
    #[test]
    fn the_peer_saw_an_open_by_its_lanes_newest_number() {
        let mut s = Streams::new(true);
        let span = 1u64 << 32;
        s.opened(1, 41);
        s.opened(0, 3 * span + 101);
        assert!(s.peer_saw(&stream(1, 41), [0, 41]));
        assert!(!s.peer_saw(&stream(1, 41), [0, 39]));
        assert!(s.peer_saw(&stream(0, 3 * span + 99), [101, 41]));
        assert!(!s.peer_saw(&stream(0, 3 * span + 101), [99, 41]));
        // The newest of a lane just past a wrap, the peer's seen just before it.
        s.opened(0, 4 * span + 1);
        assert!(!s.peer_saw(&stream(0, 4 * span + 1), [u32::MAX, 41]));
        assert!(s.peer_saw(&stream(0, 4 * span - 1), [u32::MAX, 41]));
    }
}
