//! Streams through a lost connection. With `CAP_RESUME` on both sides a lost connection
//! suspends the link instead of closing it: streams stay, each send half keeps what the peer has
//! not confirmed, and on the next connection each side lists what it received (`Resume`) so the
//! other sends the rest exactly once. The codec starts over from a state both sides share (the
//! hellos' saved states, or empty caches), since frames lost in flight left the old ones apart.
//! The latency lane lost alone is re-attached the same way, for its streams and caches only.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use super::hello;
use super::streams::Kept;
use super::timer::Timer;
use super::{Event, Link, State};
use crate::coding::SavedCache;
use crate::error::LinkError;
use crate::frame::{
    Frame, RESUME_ENTRY_LEN, RESUME_HEAD_LEN, ResetCode, Resume, ResumeEntry, StreamId, setting,
};
use crate::lane::{CAP_RESUME, LANES, LATENCY_LANE, MAIN_LANE};

/// Streams that finished cleanly, remembered for the resume list: the peer may not have heard
/// that they did when the connection went.
pub(super) const DONE_KEPT: usize = 4096;

/// Silence from the peer after which a resumable link gives its connection up for a new one
/// (at least; four round trips if that is longer). A path that drops everything leaves TCP
/// retrying with backoff for many seconds after the path is back; a new connection, dialed
/// every half second meanwhile, gets through at once.
pub(super) const SILENCE_MIN: Duration = Duration::from_secs(2);

/// A gap this many times the ping interval between two looks at the silence means this side
/// did not run meanwhile (a host whose cores the applications took, a stopped process): the
/// peer had no ping to answer then, so that time does not count as its silence. On two busy
/// cores, a sender not run for seconds gave up live connections ("nothing heard from the
/// peer for 2436-4170 ms") and lost the caches' history with them.
pub(super) const SELF_STALL: u32 = 2;

/// A link whose connection was lost, until its streams are resumed or given up.
#[derive(Debug)]
pub(super) struct Outage {
    pub since: Instant,
    /// The link was draining when the connection went.
    pub draining: bool,
}

/// A resumption under way on a new connection.
#[derive(Debug, Default)]
pub(super) struct Resuming {
    /// The old link's token: the initiator presents it, the listener expects it back.
    token: u64,
    /// The streams that lived on the old connection (only they are reconciled).
    old: HashSet<StreamId>,
    /// The peer's resume list so far, and its link-level figures.
    peer: Vec<ResumeEntry>,
    head: Option<(u64, u64, [u32; 2])>,
    /// The highest numbers of the peer's streams we had seen (per lane), as our list told it
    /// (their low 32 bits): a stream of its above them is opened again by the peer.
    seen: [u64; 2],
    /// When the latency lane was lost (a lane-only resumption).
    since: Option<Instant>,
}

/// What one resumption did, for the runtime's metrics and logs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResumeStats {
    /// Streams that went on.
    pub streams: usize,
    /// Stream bytes sent again (they were in flight when the connection went).
    pub resent: u64,
    /// Streams reset because the peer no longer had them.
    pub lost: usize,
    /// The main lane's bytes the old connection did not deliver were sent again as they were
    /// (see `replay`): the caches, stream contexts and streams went on untouched. False when the
    /// resume lists settled the streams with a fresh codec (or for the latency lane alone).
    pub replay: bool,
    /// With `replay`, the bytes sent again.
    pub replayed: u64,
    /// The latency lane's alone (lost alone, or after a replay of the main lane).
    pub lane: bool,
    /// From the lost connection to the settled streams.
    pub outage: std::time::Duration,
}

impl Link {
    /// True if losing the connection now would suspend the link rather than close it: both
    /// sides resume streams, the resume window is not zero and the link is up (or resuming).
    pub fn can_resume(&self) -> bool {
        self.resumable
            && !self.cfg.resume_window.is_zero()
            && (matches!(self.state, State::Open | State::Draining)
                || (self.outage.is_some() && self.state != State::Closed))
    }

    /// How long streams wait for a new connection after a lost one.
    pub fn resume_window(&self) -> std::time::Duration {
        self.cfg.resume_window
    }

    /// On the listener: true if a new connection whose hello presents `token` (its `RESUME`
    /// setting) resumes this link: the token is one this link handed out since its streams last
    /// settled (a connection lost during a resumption leaves the peer with either), and the
    /// link is suspended or can be (the peer may have seen the old connection go before we
    /// did).
    pub fn resumes(&self, token: u64) -> bool {
        !self.cfg.initiator
            && self.resume_tokens.contains(&token)
            && (self.is_suspended() || self.can_resume())
    }

    /// True while the link waits for a new connection (after [`suspend`](Self::suspend)).
    pub fn is_suspended(&self) -> bool {
        self.state == State::Suspended
    }

    /// Records that the connection (either lane) was lost. A link that can resume keeps its
    /// streams for `resume_window` and waits for [`reconnect`](Self::reconnect); any other is
    /// closed as [`connection_lost`](Self::connection_lost) does. Returns true if suspended.
    pub fn suspend(&mut self, reason: &str, now: Instant) -> bool {
        if self.state == State::Suspended {
            return true;
        }
        if !self.can_resume() {
            self.connection_lost(reason);
            return false;
        }
        self.replay_set_aside();
        if self.outage.is_none() {
            self.outage = Some(Outage {
                since: now,
                draining: self.state == State::Draining,
            });
            self.timers.set(Timer::Resume, now + self.cfg.resume_window);
        }
        let resume_at = self.timers.get(Timer::Resume);
        self.timers.stop_all();
        if let Some(at) = resume_at {
            self.timers.set(Timer::Resume, at);
        }
        self.state = State::Suspended;
        self.resuming = None;
        // A full resumption settles the latency lane's streams too.
        self.lane_resuming = None;
        self.timers.clear(Timer::LaneResume);
        for c in &mut self.ctrl {
            c.clear();
        }
        self.inbuf.clear();
        self.lane_attached = false;
        self.loading = false;
        self.deferred_checkpoints.clear();
        self.keepalive = Default::default();
        self.events.push_back(Event::Suspended {
            reason: reason.to_string(),
        });
        true
    }

    /// The connecting side, after [`suspend`](Self::suspend): starts over on a new connection
    /// whose hello presents the old link's token ([`resume_token`](Self::resume_token)).
    /// `saved` lists the cache states saved so far (see [`LinkConfig::saved_states`]).
    ///
    /// [`LinkConfig::saved_states`]: super::LinkConfig::saved_states
    pub fn reconnect(&mut self, now: Instant, saved: Vec<SavedCache>) -> bool {
        if !self.cfg.initiator {
            return false;
        }
        let presented = self.peer.token;
        self.restart(now, setting::RESUME, presented, saved)
    }

    /// What the connecting side presents to resume the link: the listener's token from the
    /// last hello it read.
    pub fn resume_token(&self) -> u64 {
        self.peer.token
    }

    /// The listener, after [`suspend`](Self::suspend) (or [`resumes`](Self::resumes) said so):
    /// starts over on the new connection whose hello presented `presented`, answering with it,
    /// and hands out `token` as the link's next one.
    pub fn accept_resume(
        &mut self,
        now: Instant,
        presented: u64,
        token: u64,
        saved: Vec<SavedCache>,
    ) -> bool {
        if self.cfg.initiator || !self.resume_tokens.contains(&presented) {
            return false;
        }
        if self.state == State::Suspended {
            self.cfg.token = token;
            if self.resume_tokens.len() >= 4 {
                self.resume_tokens.remove(0);
            }
            self.resume_tokens.push(token);
        }
        self.restart(now, setting::RESUMED, presented, saved)
    }

    /// A new hello (with the resumption setting `id` = `old`) on a new connection.
    fn restart(&mut self, now: Instant, id: u16, old: u64, saved: Vec<SavedCache>) -> bool {
        if self.state != State::Suspended {
            return false;
        }
        self.cfg.saved_states = saved;
        let renewed = self.coding.renew(
            self.cfg.codec.clone(),
            self.cfg.cache_storage.clone(),
            self.cfg.saved_states.clone(),
        );
        let replay = self.replay_restart(renewed);
        let mut h = hello::ours(&self.cfg, self.coding.offers(), self.coding.own_scoped());
        h.settings.push((id, old));
        h.settings.extend(replay);
        // What was queued while the link was down goes in the resume list instead (credit,
        // ends) or is sent again after it (resets of streams the peer still lists).
        for c in &mut self.ctrl {
            c.clear();
        }
        self.ctrl[MAIN_LANE].push_back(Frame::Hello(h));
        self.state = State::Handshake;
        // The token to present again, should this connection be lost before the peer's hello.
        self.peer = hello::PeerParams {
            max_frame: 16 * 1024,
            token: self.peer.token,
            ..Default::default()
        };
        self.link_credit = crate::flow::SendCredit::new(0);
        self.resuming = Some(Box::new(Resuming {
            token: old,
            old: self.streams.map.keys().copied().collect(),
            ..Default::default()
        }));
        self.timers.set(Timer::Idle, now + self.cfg.idle_timeout);
        true
    }

    /// The peer's hello on a resumed connection: if it resumes the same link, both sides send
    /// again what the other did not read (see `replay`) or, if either cannot, our resume list
    /// goes out; if not (it restarted, or gave the link up), every stream is lost.
    pub(super) fn on_resumed_hello(
        &mut self,
        h: &crate::frame::Hello,
        now: Instant,
    ) -> Result<(), LinkError> {
        let Some(r) = self.resuming.as_ref() else {
            return Ok(());
        };
        let id = if self.cfg.initiator {
            setting::RESUMED
        } else {
            setting::RESUME
        };
        let same = h.capabilities & CAP_RESUME != 0 && h.setting(id) == Some(r.token);
        if !same {
            self.resuming = None;
            self.replay = Default::default();
            self.end_outage();
            self.lose_streams("the peer no longer has the link's streams (it restarted?)");
            return Ok(());
        }
        if self.try_replay(h, now)? {
            return Ok(());
        }
        self.drop_undecoded(None);
        self.list_streams(None);
        Ok(())
    }

    /// Queues our resume list: what we received of each stream (`lane`: of that lane's only,
    /// sent on it). Coded frames not rebuilt yet are dropped (their bytes come again, through
    /// the new codec state). The per-lane counts of stream bytes start over here, as the
    /// peer's do when it settles.
    fn list_streams(&mut self, lane: Option<usize>) {
        let mut entries = Vec::with_capacity(self.streams.map.len() + self.done_ids.len());
        for (id, s) in self.streams.map.iter_mut() {
            if lane.is_some_and(|l| l != s.lane) {
                continue;
            }
            entries.push(ResumeEntry {
                stream: *id,
                received: s.recv.window.received(),
                max: s.recv.window.advertised(),
                fin: s.recv.fin_received,
                done: false,
                latency: s.lane == LATENCY_LANE,
            });
        }
        entries.extend(self.done_ids.iter().map(|id| ResumeEntry {
            stream: *id,
            received: 0,
            max: 0,
            fin: true,
            done: true,
            latency: false,
        }));
        let (received, max) = match lane {
            Some(l) => (self.lane_received[l], 0),
            None => {
                self.lane_received = [0; LANES];
                (self.link_window.received(), self.link_window.advertised())
            }
        };
        let seen = self.streams.peer_max_ids();
        let rs = if lane.is_some() {
            self.lane_resuming.as_mut()
        } else {
            self.resuming.as_mut()
        };
        if let Some(r) = rs {
            r.seen = seen;
        }
        let per =
            ((self.peer.max_frame + 8).saturating_sub(RESUME_HEAD_LEN) / RESUME_ENTRY_LEN).max(1);
        let mut chunks: Vec<Vec<ResumeEntry>> = entries.chunks(per).map(<[_]>::to_vec).collect();
        if chunks.is_empty() {
            chunks.push(Vec::new());
        }
        let n = chunks.len();
        for (i, entries) in chunks.into_iter().enumerate() {
            self.ctrl[lane.unwrap_or(MAIN_LANE)].push_back(Frame::Resume(Box::new(Resume {
                link_received: received,
                link_max: max,
                seen: seen.map(|n| n as u32),
                entries,
                last: i + 1 == n,
                lane: lane.is_some(),
            })));
        }
    }

    /// Drops what a stream's receive side had not rebuilt (the peer sends it again), for every
    /// stream or one lane's.
    pub(super) fn drop_undecoded(&mut self, lane: Option<usize>) {
        for s in self.streams.map.values_mut() {
            if lane.is_some_and(|l| l != s.lane) {
                continue;
            }
            let dropped = s.recv.drop_undecoded();
            self.link_window.unreceive(dropped);
            self.lane_received[s.lane] = self.lane_received[s.lane].saturating_sub(dropped);
        }
    }

    /// Only the latency lane's connection was lost (the main one goes on): its streams wait
    /// for a new lane, each side then lists what it received of them on it, and they go on
    /// from there; the lane's caches start empty. Returns false if the link cannot do that
    /// (it does not resume, is not up, or is resuming already): the caller then suspends it.
    pub fn lane_lost(&mut self, now: Instant) -> bool {
        if !self.resumable
            || !matches!(self.state, State::Open | State::Draining)
            || !self.lane_attached
            || self.resuming.is_some()
        {
            return false;
        }
        self.lane_gone(now);
        true
    }

    /// The latency lane's connection is gone (alone, or with a main connection that resumed
    /// by a replay): its streams wait for a new lane and the lists on it; its caches start
    /// empty on both sides.
    pub(super) fn lane_gone(&mut self, now: Instant) {
        // Lost again before the lists settled it: what each side received is listed anew.
        let since = self.lane_resuming.as_ref().and_then(|r| r.since);
        self.lane_attached = false;
        self.ctrl[LATENCY_LANE].clear();
        self.drop_undecoded(Some(LATENCY_LANE));
        self.coding.reset_lane(LATENCY_LANE);
        let old = self
            .streams
            .map
            .iter()
            .filter(|(_, s)| s.lane == LATENCY_LANE)
            .map(|(id, _)| *id)
            .collect();
        self.lane_resuming = Some(Box::new(Resuming {
            old,
            since: Some(since.unwrap_or(now)),
            ..Default::default()
        }));
        if since.is_none() {
            self.timers
                .set(Timer::LaneResume, now + self.cfg.resume_window);
        }
    }

    /// The latency lane is attached again after [`lane_lost`](Self::lane_lost): our list of
    /// its streams goes first on it.
    pub(super) fn on_lane_attached(&mut self) {
        if self.lane_resuming.is_some() {
            self.list_streams(Some(LATENCY_LANE));
        }
    }

    /// The latency lane did not come back within the resume window: its streams are lost.
    pub(super) fn lane_expired(&mut self, now: Instant) {
        if !self.timers.expired(Timer::LaneResume, now) {
            return;
        }
        self.timers.clear(Timer::LaneResume);
        if let Some(rs) = self.lane_resuming.take() {
            for id in rs.old {
                if self.streams.get(&id).is_some() {
                    self.fail_stream(
                        id,
                        ResetCode::LinkLost,
                        "the latency lane did not come back within the resume window".into(),
                    );
                }
            }
        }
    }

    /// A part of the peer's resume list (of every stream, or of the latency lane's); the last
    /// part settles them.
    pub(super) fn on_resume(
        &mut self,
        r: Resume,
        now: Instant,
        lane: usize,
    ) -> Result<(), LinkError> {
        // The peer can know of the streams it opened (at most our max_streams), those we opened
        // (we know them all), and ones both have closed lately: not of the max_streams it claims.
        let limit = self.cfg.max_streams as usize + self.streams.map.len() + DONE_KEPT;
        let rs = if r.lane {
            self.lane_resuming
                .as_mut()
                .filter(|_| lane == LATENCY_LANE && self.resuming.is_none())
        } else {
            self.resuming
                .as_mut()
                .filter(|_| lane == MAIN_LANE && self.state != State::Handshake)
        };
        let Some(rs) = rs else {
            return Err(LinkError::Protocol(
                "resume list on a link not resuming".into(),
            ));
        };
        if rs.peer.len() + r.entries.len() > limit {
            return Err(LinkError::Protocol("resume list too long".into()));
        }
        rs.peer.extend(r.entries);
        rs.head = Some((r.link_received, r.link_max, r.seen));
        if r.last {
            if r.lane {
                self.settle_lane(now)?;
            } else {
                self.settle(now)?;
            }
        }
        Ok(())
    }

    /// The peer's list of the latency lane's streams is in: what was lost in flight on the old
    /// lane goes back to link credit, and its streams go on.
    fn settle_lane(&mut self, now: Instant) -> Result<(), LinkError> {
        let Some(rs) = self.lane_resuming.take() else {
            return Ok(());
        };
        self.timers.clear(Timer::LaneResume);
        let Some((received, _, seen)) = rs.head else {
            return Err(LinkError::Protocol("resume list without its head".into()));
        };
        let sent = self.lane_sent[LATENCY_LANE];
        let Some(lost) = sent.checked_sub(received) else {
            return Err(LinkError::Protocol(format!(
                "the peer received {received} bytes on the latency lane, more than we sent ({sent})"
            )));
        };
        self.lane_sent[LATENCY_LANE] = received;
        let c = &mut self.link_credit;
        let max = c.max();
        c.resync(c.sent().saturating_sub(lost), max);
        let mut stats = ResumeStats {
            outage: now.saturating_duration_since(rs.since.unwrap_or(now)),
            lane: true,
            ..Default::default()
        };
        self.settle_streams(&rs, seen, &mut stats)?;
        self.events.push_back(Event::Resumed(stats));
        Ok(())
    }

    /// Sends each stream on from where the peer's list says it is; resets those the peer no
    /// longer has.
    fn settle(&mut self, now: Instant) -> Result<(), LinkError> {
        let Some(rs) = self.resuming.take() else {
            return Ok(());
        };
        let since = self.outage.as_ref().map_or(now, |o| o.since);
        self.end_outage();
        // The peer answered our hello: it holds our newest token, the only one that works now.
        self.resume_tokens = vec![self.cfg.token];
        let Some((received, max, seen)) = rs.head else {
            return Err(LinkError::Protocol("resume list without its head".into()));
        };
        let mut stats = ResumeStats {
            outage: now.saturating_duration_since(since),
            ..Default::default()
        };
        self.link_credit.resync(received, max);
        self.lane_sent = [0; LANES];
        self.settle_streams(&rs, seen, &mut stats)?;
        self.events.push_back(Event::Resumed(stats));
        Ok(())
    }

    /// Sends each of `rs.old` on from where the peer's list says it is, reopens those whose
    /// open was lost, resets those the peer no longer has, and tells the peer which of the
    /// streams it listed we no longer have.
    fn settle_streams(
        &mut self,
        rs: &Resuming,
        seen: [u32; 2],
        stats: &mut ResumeStats,
    ) -> Result<(), LinkError> {
        let peer: HashMap<StreamId, ResumeEntry> = rs.peer.iter().map(|e| (e.stream, *e)).collect();
        for e in rs.peer.iter().filter(|e| !rs.old.contains(&e.stream)) {
            // A stream we no longer have: its end (or its reset) did not reach the peer. A
            // stream the peer opened whose open never reached us is opened again by the peer.
            let lane = usize::from(e.latency);
            let never_seen = self.streams.is_peer_id(e.stream)
                && super::streams::unwrap_id(e.stream, rs.seen[lane]) > rs.seen[lane];
            if !e.done && !never_seen && !self.streams.map.contains_key(&e.stream) {
                self.ctrl[MAIN_LANE].push_back(Frame::Reset {
                    stream: e.stream,
                    code: ResetCode::LinkLost,
                    reason: "the stream ended while the link was down".into(),
                });
            }
        }
        // In the order they were opened: opens sent again must rise on each lane.
        let mut old: Vec<StreamId> = rs.old.iter().copied().collect();
        old.sort_unstable_by_key(|id| self.streams.get(id).map_or(0, |s| s.number));
        for id in old {
            let Some(s) = self.streams.get(&id) else {
                continue;
            };
            let (service, class, lane) = (s.service.clone(), s.class, s.lane);
            let coder = self.coding.coder_for(&service, class, self.cfg.send_buffer);
            let sent = s.send.credit.sent();
            match peer.get(&id) {
                Some(e) if e.done => {
                    let Some(s) = self.streams.get_mut(&id) else {
                        continue;
                    };
                    if !s.send.fin_sent {
                        return Err(LinkError::Protocol(format!(
                            "stream {id}: the peer says it finished, but our end was not sent"
                        )));
                    }
                    s.send.fin_acked = true;
                    self.maybe_remove(id);
                }
                Some(e) => {
                    let Some(s) = self.streams.get_mut(&id) else {
                        continue;
                    };
                    if !s.send.rewind(e.received, e.max, e.fin, coder) {
                        return Err(LinkError::Protocol(format!(
                            "stream {id}: cannot send again from offset {} (sent {sent})",
                            e.received
                        )));
                    }
                    stats.resent += sent - e.received;
                    stats.streams += 1;
                    self.maybe_remove(id);
                }
                None if !self.streams.is_peer_id(id)
                    && !self.streams.peer_saw(s, seen)
                    && s.send.kept.as_ref().is_some_and(|k| k.from == 0) =>
                {
                    // Its open was lost in flight: open it again and send everything.
                    let window = self.peer.stream_window;
                    let Some(s) = self.streams.get_mut(&id) else {
                        continue;
                    };
                    if let Some(k) = s.send.kept.as_mut() {
                        k.peer_window = window;
                    }
                    s.send.rewind(0, window, false, coder);
                    stats.resent += sent;
                    stats.streams += 1;
                    self.ctrl[lane].push_back(Frame::Open {
                        stream: id,
                        class,
                        service: service.to_string(),
                    });
                }
                None => {
                    stats.lost += 1;
                    self.fail_stream(
                        id,
                        ResetCode::LinkLost,
                        "the peer no longer has the stream after the link was lost".into(),
                    );
                }
            }
        }
        // Streams that waited for delta bases go again too.
        self.resume_senders();
        let ids: Vec<StreamId> = self.streams.map.keys().copied().collect();
        for id in ids {
            self.streams.schedule(id);
        }
        Ok(())
    }

    /// The outage is over (resumed, or given up): the resume window no longer runs.
    pub(super) fn end_outage(&mut self) {
        self.outage = None;
        self.timers.clear(Timer::Resume);
    }

    /// Every stream goes, with `reason`; the link itself goes on.
    fn lose_streams(&mut self, reason: &str) {
        let ids: Vec<StreamId> = self.streams.map.keys().copied().collect();
        for id in ids {
            if self.remove_stream(id).is_some() {
                self.events.push_back(Event::Reset {
                    stream: id,
                    code: ResetCode::LinkLost,
                    reason: reason.to_string(),
                });
            }
        }
    }

    /// The resume window ran out while the link was down: it closes, and its streams with it.
    pub(super) fn resume_expired(&mut self, now: Instant) -> bool {
        if !self.timers.expired(Timer::Resume, now) {
            return false;
        }
        let e = LinkError::Transport(format!(
            "down for longer than the resume window ({:?})",
            self.cfg.resume_window
        ));
        self.fail(e);
        true
    }

    /// The peer has every byte of a stream we sent, and its end.
    pub(super) fn on_finished(&mut self, id: StreamId, offset: u64) -> Result<(), LinkError> {
        if !self.resumable {
            return Err(LinkError::Protocol("finished without resumption".into()));
        }
        let known = self.streams.was_open(id);
        match self.streams.get_mut(&id) {
            Some(s) => {
                if !s.send.on_finished(offset) {
                    return Err(LinkError::Protocol(format!(
                        "stream {id}: finished at {offset}, which is not where we ended"
                    )));
                }
                self.maybe_remove(id);
            }
            None if !known => {
                return Err(LinkError::Protocol(format!(
                    "finished for unknown stream {id}"
                )));
            }
            None => {}
        }
        Ok(())
    }

    /// Tells the peer once that a stream's end arrived (everything before it rebuilt), so it
    /// can forget what it kept.
    pub(super) fn note_end(&mut self, id: StreamId) {
        if !self.resumable {
            return;
        }
        if let Some(s) = self.streams.get_mut(&id)
            && !s.recv.finished_sent
            && s.recv.fin_ready()
        {
            s.recv.finished_sent = true;
            self.ctrl[s.lane].push_back(Frame::Finished {
                stream: id,
                offset: s.recv.window.received(),
            });
        }
    }

    /// How long a resumable link waits, hearing nothing, before it pings (the first figure)
    /// and before it gives the connection up (the second).
    fn silence_limits(&self) -> (Duration, Duration) {
        let stall = self
            .keepalive
            .rtt
            .map_or(SILENCE_MIN, |rtt| (rtt * 4).max(SILENCE_MIN));
        (stall / 4, stall)
    }

    /// Input from the peer: the silence clocks start over.
    pub(super) fn heard_from_peer(&mut self, now: Instant) {
        self.heard = Some(now);
        if self.resumable {
            let (probe, stall) = self.silence_limits();
            self.timers.set(Timer::Probe, now + probe);
            self.timers.set(Timer::Silence, now + stall);
        }
    }

    /// Input from the peer that arrived at `at` but was not read yet (the runtime asks its
    /// sockets when they last received data): the peer was heard then, however late this side
    /// gets to read it.
    pub fn peer_heard(&mut self, at: Instant) {
        if self.heard.is_some_and(|h| h < at) {
            self.heard_from_peer(at);
        }
    }

    /// A resumable link that heard nothing for a while pings; one that heard nothing for too
    /// long suspends (the runtime drops the connection and dials a new one). Returns true if
    /// it suspended. Time this side did not run (see [`SELF_STALL`]) is not counted: the
    /// silence clock then starts over at one ping interval, and a ping goes out.
    pub(super) fn check_silence(&mut self, now: Instant) -> bool {
        if !self.resumable || !matches!(self.state, State::Open | State::Draining) {
            return false;
        }
        let (probe, stall) = self.silence_limits();
        let last = self.silence_checked.replace(now);
        if let (Some(last), Some(heard)) = (last, self.heard)
            && now.saturating_duration_since(last) > probe * SELF_STALL
            && let Some(from) = now.checked_sub(probe)
            && heard < from
        {
            self.heard = Some(from);
            self.keepalive.sent = None;
            self.events
                .push_back(Event::Stalled(now.saturating_duration_since(last)));
        }
        let heard = *self.heard.get_or_insert(now);
        let quiet = now.saturating_duration_since(heard);
        if quiet >= stall {
            self.suspend(
                &format!("nothing heard from the peer for {} ms", quiet.as_millis()),
                now,
            );
            return true;
        }
        if self.timers.get(Timer::Probe).is_none_or(|t| now >= t) {
            if quiet >= probe && self.keepalive.sent.is_none() {
                let k = &mut self.keepalive;
                k.seq += 1;
                self.ctrl[MAIN_LANE].push_back(Frame::Ping { payload: k.seq });
                k.sent = Some((k.seq, now));
            }
            self.timers.set(Timer::Probe, now + probe);
        }
        self.timers.set(Timer::Silence, heard + stall);
        false
    }

    /// What a new stream keeps for resumption, if the link resumes.
    pub(super) fn kept_for_new_stream(&self) -> Option<Kept> {
        self.resumable.then(|| Kept {
            peer_window: self.peer.stream_window,
            ..Default::default()
        })
    }

    /// Remembers a stream that finished cleanly, for the next resume list.
    pub(super) fn remember_done(&mut self, id: StreamId) {
        if self.resumable {
            if self.done_ids.len() >= DONE_KEPT {
                self.done_ids.pop_front();
            }
            self.done_ids.push_back(id);
        }
    }
}
