//! The codec's frames on the link: `Coded` frames charged to credit and queued on their stream's
//! receive half, decoded in arrival order; `Need` answered, `Chunk` resuming the streams stalled on
//! it, `Checkpoint` judged against our decoder. The codec decisions are [`Coding`]'s; this file
//! only ties them to streams, control queues and events.
//!
//! [`Coding`]: crate::coding::Coding

use std::sync::Arc;

use bytes::Bytes;

use super::{Event, Link};
use crate::coding::{Decoded, FRAME_COST, Fingerprint, Role};
use crate::error::LinkError;
use crate::frame::{Frame, ResetCode, StreamId};

/// Bytes of frames behind stalled streams allowed beyond twice the link window.
const STALL_BACKLOG_SLACK: usize = 8 << 20;

impl Link {
    /// Optimized stream bytes: charged to credit by their raw length, then decoded in arrival
    /// order so our cache sees what the peer's mirror saw.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn on_coded(
        &mut self,
        id: StreamId,
        offset: u64,
        fin: bool,
        scoped: bool,
        raw_len: u32,
        records: Bytes,
        wire: usize,
        lane: usize,
    ) -> Result<(), LinkError> {
        self.coding.accept_coded()?;
        let records = super::input::unpinned(records);
        // Fed while the stream's earlier frames fed ahead wait (see `feed_behind`); else
        // those are decoded first, with the frames before them.
        let behind = self.feed_behind(id, scoped, &records, raw_len);
        if behind.is_none() {
            self.decode_fed_through(id);
        }
        let open = self.admit((id, lane), offset, u64::from(raw_len), wire, |s| {
            (lane != s.lane).then(|| "data on the wrong lane".to_string())
        })?;
        let (Some(s), true) = (self.streams.get_mut(&id), open) else {
            // A stream we already closed: still decode what uses the shared cache, so it stays
            // in step with the peer's mirror.
            if !scoped {
                self.decode_fed();
                self.coding.decode_orphan(lane, records, raw_len, fin);
            }
            return Ok(());
        };
        // A scope the hellos did not agree would make a cache nobody configured (or mix a
        // service's bytes into the shared cache): the stream goes, the caches stay as they were.
        if let Err(why) = self.coding.check_scope(&s.service, scoped) {
            self.fail_stream(id, ResetCode::ProtocolViolation, why);
            return Ok(());
        }
        // Behind a stall, frames wait: what they may hold is bounded for the whole link (the
        // total is kept as frames come and go, so this check costs the same however many wait).
        if s.recv.coded.as_ref().is_some_and(|rc| rc.stall.is_some()) {
            let backlog = self
                .coded_backlog
                .load(std::sync::atomic::Ordering::Relaxed);
            let limit = self.stall_backlog_limit();
            if backlog + records.len() + FRAME_COST > limit {
                return Err(LinkError::Protocol(format!(
                    "more than {limit} bytes of frames behind stalled streams"
                )));
            }
        }
        let total = self.coded_backlog.clone();
        let seq = self.coding.arrival();
        let Some(s) = self.streams.get_mut(&id) else {
            return Ok(());
        };
        s.recv
            .coded
            .get_or_insert_with(|| Box::new(crate::coding::RecvCoded::counted(total)))
            .push(records, raw_len, fin, scoped, seq);
        if fin {
            s.recv.fin_received = true;
        }
        if let Some((f, lits)) = behind {
            match lits {
                true => self.fed_behind += 1,
                false => self.fed_next += 1,
            }
            self.fed_ahead(id, f, lane);
            return Ok(());
        }
        if self.feed_ahead(id, lane) {
            return Ok(());
        }
        // In the order the frames came: those fed ahead first.
        self.decode_fed();
        self.decode_stream(id);
        Ok(())
    }

    /// With workers (two threads or more), the frame that just arrived on a stream with nothing
    /// else waiting is fed to its stream's context on them while the frames before it are
    /// decoded, up to [`PENDING`] frames at once: several streams' contexts decompress at once.
    /// It is decoded in its turn, at the latest before the input call returns or anything but
    /// a stream's frame is read. True if it was.
    ///
    /// [`PENDING`]: wanopt_codec::PENDING
    fn feed_ahead(&mut self, id: StreamId, lane: usize) -> bool {
        if self.coding.fed_frames(lane).0 == 0 {
            return false;
        }
        let Some(s) = self.streams.get_mut(&id) else {
            return false;
        };
        let (Some(rc), Some(c)) = (s.recv.coded.as_mut(), self.coding.contexts()) else {
            return false;
        };
        let Some(f) = c.feed_ahead(rc, s.lane, &s.service) else {
            return false;
        };
        self.fed_ahead(id, f, lane);
        true
    }

    /// A frame of `id`'s fed ahead (`f`) waits for its turn; the oldest is decoded if as many
    /// as may wait do.
    fn fed_ahead(&mut self, id: StreamId, f: wanopt_codec::Feeding, lane: usize) {
        let (cap, workers) = self.coding.fed_frames(lane);
        self.feeds.push(u64::from(id.0), id, f, workers.as_deref());
        if self.feeds.len() >= cap {
            self.decode_fed_front();
        }
    }

    /// A frame just arrived on `id` (its `records`, announcing `raw_len` bytes) fed while the
    /// stream's earlier frames fed ahead wait, if every frame the stream has waiting is fed
    /// ahead (none stalled): a frame of literals alone without the stream's context (see
    /// [`Decoder::feed_literals`](wanopt_codec::Decoder::feed_literals); true with it), else
    /// one behind the stream's last frame fed ahead that holds its context, taking the context
    /// on from it once its context records are all fed (see
    /// [`Decoder::feed_after`](wanopt_codec::Decoder::feed_after)): one stream's frames are
    /// fed one after the other on the workers while the decoder's thread decodes those before
    /// them, the workers naming the chunks too only while other streams' frames wait. The
    /// frame then waits for its turn behind them, and only the frames before it are decoded
    /// when theirs come ([`decode_one`](Self::decode_one)).
    fn feed_behind(
        &mut self,
        id: StreamId,
        scoped: bool,
        records: &Bytes,
        raw_len: u32,
    ) -> Option<(wanopt_codec::Feeding, bool)> {
        let waiting = self.feeds.iter().filter(|f| f.0 == id).count();
        let s = self.streams.get(&id)?;
        let rc = s.recv.coded.as_ref()?;
        if waiting == 0 || rc.stall.is_some() || rc.waiting() != waiting {
            return None;
        }
        // No decoder is made for a scope the hellos did not agree (the frame fails its stream).
        if self.coding.fed_frames(s.lane).0 == 0
            || self.coding.check_scope(&s.service, scoped).is_err()
        {
            return None;
        }
        let scope = if scoped {
            s.service.clone()
        } else {
            Arc::from("")
        };
        let announced = usize::try_from(raw_len).unwrap_or(usize::MAX);
        let dec = self.coding.contexts()?.decoder(s.lane, &scope);
        if let Some(f) = dec.feed_literals(records.clone(), announced) {
            return Some((f, true));
        }
        let (_, earlier) = self
            .feeds
            .iter()
            .rev()
            .find(|f| f.0 == id && f.1.holds_context())?;
        let name = self.feeds.iter().any(|f| f.0 != id);
        let f = dec.feed_after(earlier, records.clone(), announced, name)?;
        Some((f, false))
    }

    /// Decodes the oldest frame fed ahead (its stream given its context back first).
    fn decode_fed_front(&mut self) {
        let Some((id, fed)) = self.feeds.pop_front() else {
            return;
        };
        match self
            .streams
            .get_mut(&id)
            .and_then(|s| s.recv.coded.as_mut())
        {
            Some(rc) => rc.fed(fed),
            // A stream gone meanwhile: what was fed goes with it.
            None => {
                fed.finish(&mut Default::default());
            }
        }
        self.decode_stream(id);
        self.rebuild_later();
    }

    /// What the frames just decoded brought may be the bases of later frames' delta runs.
    fn rebuild_later(&mut self) {
        if !self.feeds.is_empty()
            && let Some(c) = self.coding.contexts()
        {
            c.rebuild_later(self.feeds.iter().map(|f| &f.1));
        }
    }

    /// Decodes every frame fed ahead, in the order they came.
    pub(super) fn decode_fed(&mut self) {
        while !self.feeds.is_empty() {
            self.decode_fed_front();
        }
        self.timers.clear(super::timer::Timer::Fed);
    }

    /// Decodes the frames fed ahead up to `id`'s last, if it has any waiting.
    fn decode_fed_through(&mut self, id: StreamId) {
        while self.feeds.position(|k| *k == id).is_some() {
            self.decode_fed_front();
        }
    }

    /// Decodes the frames fed ahead up to `id`'s first, if it has one waiting.
    fn decode_fed_through_first(&mut self, id: StreamId) {
        while let Some(at) = self.feeds.position(|k| *k == id) {
            self.decode_fed_front();
            if at == 0 {
                break;
            }
        }
    }

    /// Decodes what a stream has waiting (see [`decode_one`](Self::decode_one)), then the
    /// streams that waited for its frames.
    fn decode_stream(&mut self, id: StreamId) {
        self.decode_one(id);
        self.wake_behind();
    }

    /// Decodes what a stream has waiting. A miss stalls the stream: it waits for other streams'
    /// frames that arrived before its own and are not decoded yet (the chunk may be in them),
    /// else asks the peer for the chunk. Records that do not rebuild reset it. Never hands over
    /// a wrong byte.
    fn decode_one(&mut self, id: StreamId) {
        // A frame of it fed ahead holds its context: decoded in its turn, with those before it.
        if self
            .feeds
            .iter()
            .find(|f| f.0 == id)
            .is_some_and(|f| f.1.holds_context() && !f.1.follows())
        {
            self.decode_fed_through_first(id);
            return;
        }
        // Its frames whose literals alone are fed ahead wait for their turns.
        let keep = self.feeds.iter().filter(|f| f.0 == id).count();
        let Some(s) = self.streams.get_mut(&id) else {
            return;
        };
        let before = s.recv.readable();
        let Some(rc) = s.recv.coded.as_mut() else {
            return;
        };
        let decoded = self.coding.contexts().map_or_else(
            || Ok(Decoded::default()),
            |c| c.decode(rc, s.lane, &s.service, keep),
        );
        let (lane, seq) = (s.lane, rc.front_seq());
        match decoded {
            Ok(got) => {
                s.recv.queue.extend(got.data);
                if !before && s.recv.readable() {
                    self.events.push_back(Event::Readable(id));
                }
                if let Some(need) = got.need {
                    self.miss(id, lane, seq, need);
                }
            }
            Err(why) => self.fail_stream(
                id,
                ResetCode::DataLost,
                format!("cannot rebuild stream data: {why}"),
            ),
        }
        self.note_end(id);
        self.retry_checkpoints();
    }

    /// A stream of `lane` stalled on a chunk it lacks in its frame that arrived `seq`th. The
    /// peer may have sent the chunk on another stream before, in a frame that waits undecoded
    /// behind that stream's own stall (a read of our disk tier, say): then this stream waits
    /// for those frames, as the peer's mirror saw them first. Else the peer is asked.
    fn miss(&mut self, id: StreamId, lane: usize, seq: Option<u64>, need: (Fingerprint, bool)) {
        let earlier = seq.is_some_and(|seq| self.frames_before(id, lane, seq));
        let Some(s) = self.streams.get_mut(&id) else {
            return;
        };
        let Some(rc) = s.recv.coded.as_mut() else {
            return;
        };
        rc.behind = earlier;
        if earlier {
            return;
        }
        self.coding.count_need(&s.service);
        let (fingerprint, scoped) = need;
        self.ctrl[lane].push_back(Frame::Need {
            stream: id,
            scope: if scoped {
                s.service.to_string()
            } else {
                String::new()
            },
            fingerprint,
        });
    }

    /// True if a stream of `lane` other than `id` has a frame undecoded that arrived before the
    /// `seq`th.
    fn frames_before(&self, id: StreamId, lane: usize, seq: u64) -> bool {
        self.streams.map.iter().any(|(other, s)| {
            *other != id
                && s.lane == lane
                && s.recv
                    .coded
                    .as_ref()
                    .and_then(|rc| rc.front_seq())
                    .is_some_and(|f| f < seq)
        })
    }

    /// Decodes again the streams that waited for other streams' earlier frames, once none of
    /// those remain (decoded, or their streams gone): each finds its chunk now or asks for it.
    /// A stream decoded here only ever waits again for frames still undecoded, so the passes end.
    pub(super) fn wake_behind(&mut self) {
        for _ in 0..=self.streams.map.len() {
            let ready: Vec<StreamId> = self
                .streams
                .map
                .iter()
                .filter_map(|(id, s)| {
                    let rc = s.recv.coded.as_ref().filter(|rc| rc.behind)?;
                    let seq = rc.front_seq()?;
                    (!self.frames_before(*id, s.lane, seq)).then_some(*id)
                })
                .collect();
            if ready.is_empty() {
                return;
            }
            for id in ready {
                if let Some(rc) = self
                    .streams
                    .get_mut(&id)
                    .and_then(|s| s.recv.coded.as_mut())
                {
                    rc.stall = None;
                    rc.behind = false;
                }
                self.decode_one(id);
            }
        }
    }

    /// The most bytes of frames the link keeps behind stalled streams: the link window we grant
    /// (frames behind a stall are not consumed, so their credit does not come back: an honest
    /// peer has at most that many raw bytes there, in records no larger than their raw bytes),
    /// plus room for the frames' own overhead.
    pub(super) fn stall_backlog_limit(&self) -> usize {
        usize::try_from(self.cfg.link_window)
            .unwrap_or(usize::MAX)
            .saturating_add(STALL_BACKLOG_SLACK)
    }

    /// Streams stalled on the same chunk for the link's idle timeout are reset: a peer that
    /// never answers our request (or a disk that never reads) cannot hold a stream, and what
    /// queued behind it, for ever. Called about once a second.
    pub(super) fn sweep_stalls(&mut self, now: std::time::Instant) {
        // Streams that waited for frames of a stream the peer reset since.
        self.wake_behind();
        let timeout = self.cfg.idle_timeout;
        let mut expired = Vec::new();
        for (id, s) in self.streams.map.iter_mut() {
            let Some(rc) = s.recv.coded.as_mut() else {
                continue;
            };
            if rc.stall.is_none() {
                rc.watched = None;
                continue;
            }
            match rc.watched {
                Some((n, since)) if n == rc.stalls => {
                    if now.saturating_duration_since(since) >= timeout {
                        expired.push(*id);
                    }
                }
                _ => rc.watched = Some((rc.stalls, now)),
            }
        }
        for id in expired {
            self.stalls_expired += 1;
            self.fail_stream(
                id,
                ResetCode::DataLost,
                format!("a missing chunk did not arrive within {timeout:?}"),
            );
        }
    }

    /// Our disk tier's store read chunks that streams were waiting for: those streams decode
    /// again (one still waiting stalls again; nothing is asked of the peer), and those whose
    /// next chunk waited for its bases take their turn again.
    pub fn store_ready(&mut self) {
        self.resume_senders();
        let waiting: Vec<StreamId> = self
            .streams
            .map
            .iter_mut()
            .filter_map(|(id, s)| {
                let rc = s.recv.coded.as_mut()?;
                if rc.stall.is_none() || !rc.on_store {
                    return None;
                }
                rc.stall = None;
                rc.on_store = false;
                Some(*id)
            })
            .collect();
        for id in waiting {
            self.decode_one(id);
        }
        self.wake_behind();
    }

    /// Schedules the streams whose next chunk waits for delta bases being read (see
    /// [`Sender::waiting`](wanopt_codec::Sender::waiting)): a chunk waits a few turns at most,
    /// so one that comes back too soon goes with the bases at hand.
    pub(super) fn resume_senders(&mut self) {
        let waiting: Vec<StreamId> = self
            .streams
            .map
            .iter_mut()
            .filter_map(|(id, s)| {
                let c = s.send.coder.as_mut().filter(|c| c.sender.waiting())?;
                c.sender.resume();
                Some(*id)
            })
            .collect();
        for id in waiting {
            self.streams.schedule(id);
        }
    }

    pub(super) fn on_need(
        &mut self,
        stream: StreamId,
        lane: usize,
        scope: String,
        fingerprint: Fingerprint,
    ) -> Result<(), LinkError> {
        let service = self.streams.get(&stream).map(|s| s.service.clone());
        let answer = self
            .coding
            .answer(stream, lane, scope, fingerprint, service.as_ref())?;
        self.ctrl[lane].push_back(answer);
        Ok(())
    }

    /// A chunk the peer re-sent after we asked: checked against its fingerprint, cached, and the
    /// streams waiting for it resume. An empty answer means the peer lost it: they fail.
    pub(super) fn on_chunk(
        &mut self,
        lane: usize,
        scope: &str,
        fingerprint: Fingerprint,
        data: &[u8],
    ) -> Result<(), LinkError> {
        let scope: Arc<str> = Arc::from(scope);
        let ok = self.coding.chunk_arrived(lane, &scope, fingerprint, data)?;
        let waiting: Vec<StreamId> = self
            .streams
            .map
            .iter_mut()
            .filter(|(_, s)| s.lane == lane)
            .filter_map(|(id, s)| {
                let rc = s.recv.coded.as_mut()?;
                let (f, scoped) = rc.stall?;
                let same = f == fingerprint
                    && if scoped {
                        *s.service == *scope
                    } else {
                        scope.is_empty()
                    };
                if same {
                    rc.stall = None;
                    rc.on_store = false;
                    rc.behind = false;
                }
                same.then_some(*id)
            })
            .collect();
        for id in waiting {
            if ok {
                self.decode_one(id);
            } else {
                self.fail_stream(
                    id,
                    ResetCode::DataLost,
                    "a chunk was lost on both sides".into(),
                );
            }
        }
        self.wake_behind();
        Ok(())
    }

    /// The peer's checkpoint: its mirror's state at this point of the lane. A stream of the lane
    /// stalled on a miss or a disk read has frames from before the checkpoint still to decode,
    /// so the checkpoint is judged once they are (the newest one per cache waits). Judged now,
    /// it could not match, and after a transfer's last checkpoint no other would come.
    pub(super) fn on_checkpoint(
        &mut self,
        lane: usize,
        scope: String,
        digest: &Fingerprint,
    ) -> Result<(), LinkError> {
        if self.lane_behind(lane) && self.coding.has_decoder(lane, &scope)? {
            self.deferred_checkpoints
                .retain(|(l, s, _)| !(*l == lane && *s == scope));
            self.deferred_checkpoints.push((lane, scope, *digest));
            return Ok(());
        }
        self.judge_checkpoint(lane, scope, digest)
    }

    /// True while a stream of `lane` waits for a chunk with frames undecoded.
    fn lane_behind(&self, lane: usize) -> bool {
        self.streams
            .map
            .values()
            .any(|s| s.lane == lane && s.recv.coded.as_ref().is_some_and(|rc| rc.stall.is_some()))
    }

    /// Judges the deferred checkpoints of lanes no longer behind.
    fn retry_checkpoints(&mut self) {
        if self.deferred_checkpoints.is_empty() {
            return;
        }
        let (ready, wait): (Vec<_>, Vec<_>) = std::mem::take(&mut self.deferred_checkpoints)
            .into_iter()
            .partition(|(lane, _, _)| !self.lane_behind(*lane));
        self.deferred_checkpoints = wait;
        for (lane, scope, digest) in ready {
            // Only a link without a codec fails here, and it never defers.
            let _ = self.judge_checkpoint(lane, scope, &digest);
        }
    }

    fn judge_checkpoint(
        &mut self,
        lane: usize,
        scope: String,
        digest: &Fingerprint,
    ) -> Result<(), LinkError> {
        if let Some(state) = self.coding.checkpoint_decoder(lane, &scope, digest)? {
            self.events.push_back(Event::Checkpoint {
                role: Role::Decoder,
                lane,
                scope: Arc::from(scope.as_str()),
                state,
            });
        }
        Ok(())
    }
}
