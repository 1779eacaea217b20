//! A resumed link that keeps its codec (`CAP_REPLAY`): each side keeps the main lane's bytes it
//! sent, past the hellos, until the peer says it read them (`Received`), and counts the bytes
//! of the peer's it read. A new connection's hellos carry both counts; when each side still
//! keeps what the other did not read, each sends that again, byte for byte, right after its
//! hello, and the link goes on as if the connection had never been lost: every frame arrives
//! once and in order, so the caches, stream contexts and streams on both sides stay as they
//! were. Otherwise (an older peer, a handed-over process, more lost than was kept, a
//! resumption cut before it settled) both take the resume lists and a fresh codec
//! (`resume.rs`); the two sides always decide alike, since each hello tells what its side can
//! do. The latency lane is not kept: it goes through the lane's own resumption, as when it is
//! lost alone.

use std::collections::VecDeque;
use std::time::Instant;

use bytes::{Buf, Bytes};

use super::resume::ResumeStats;
use super::{Event, Link, State};
use crate::coding::Coding;
use crate::error::LinkError;
use crate::flow::SendCredit;
use crate::frame::{Frame, Hello, setting};
use crate::lane::{CAP_LATENCY_LANE, CAP_REPLAY, MAIN_LANE};

/// Main-lane bytes read after which a `Received` frame goes on its own; otherwise it goes
/// with the next control frames (credit, answers, pings), in the same write.
const RECEIVED_EVERY: u64 = 4 << 20;
/// Most main-lane bytes kept to send again, at least and at most, whatever the link window:
/// past it the oldest go, and a connection lost with more in flight than is kept resumes
/// through the resume lists instead.
const KEPT_MIN: u64 = 16 << 20;
const KEPT_MAX: u64 = 256 << 20;

/// The main lane's byte counts and what is kept to send again.
#[derive(Debug, Default)]
pub(super) struct Replay {
    /// Main-lane bytes sent past the hellos since the counts last started over.
    sent: u64,
    /// Of them, the ones kept (from `kept_from` to `sent`).
    kept_from: u64,
    kept: VecDeque<Bytes>,
    /// Main-lane bytes of the peer's read past its hello, and the count last told it.
    received: u64,
    told: u64,
    /// Set aside when the connection was lost, for a replay: the state the counts describe.
    aside: Option<Box<Aside>>,
    /// Bytes to send again on the new connection, right after our hello.
    again: VecDeque<Bytes>,
    /// Our hello is out on the current connection.
    hello_out: bool,
}

/// What a lost connection leaves for a replay: the frames that waited to be sent, the peer's
/// checkpoints that waited for a stalled stream, and (once a new connection started over
/// with a fresh one, for the resume lists) the link credit and the codec.
#[derive(Debug, Default)]
struct Aside {
    ctrl: VecDeque<Frame>,
    checkpoints: Vec<(usize, String, wanopt_codec::cache::Fingerprint)>,
    credit: Option<SendCredit>,
    coding: Option<Coding>,
}

impl Replay {
    /// Keeps `bytes`, just sent, dropping the oldest past `cap`.
    fn record(&mut self, bytes: &[u8], cap: u64) {
        if bytes.is_empty() {
            return;
        }
        self.sent += bytes.len() as u64;
        self.kept.push_back(Bytes::copy_from_slice(bytes));
        while self.sent - self.kept_from > cap {
            let Some(b) = self.kept.pop_front() else {
                break;
            };
            self.kept_from += b.len() as u64;
        }
    }

    /// Forgets what the peer read (up to `offset`).
    fn trim(&mut self, offset: u64) {
        while let Some(front) = self.kept.front_mut() {
            let end = self.kept_from + front.len() as u64;
            if end <= offset {
                self.kept_from = end;
                self.kept.pop_front();
            } else {
                if offset > self.kept_from {
                    // Below `end`, so within the buffer.
                    front.advance((offset - self.kept_from) as usize);
                    self.kept_from = offset;
                }
                break;
            }
        }
    }

    /// The kept bytes from `offset` (at least `kept_from`) on.
    fn from(&self, offset: u64) -> VecDeque<Bytes> {
        let mut at = self.kept_from;
        let mut out = VecDeque::new();
        for b in &self.kept {
            let end = at + b.len() as u64;
            if end > offset {
                let skip = offset.saturating_sub(at) as usize;
                out.push_back(b.slice(skip..));
            }
            at = end;
        }
        out
    }

    /// The kept bytes.
    fn kept_bytes(&self) -> u64 {
        self.sent - self.kept_from
    }
}

impl Link {
    /// Main-lane bytes kept to send again after a lost connection (the peer has not said it
    /// read them).
    pub fn replay_kept(&self) -> u64 {
        self.replay.kept_bytes()
    }

    /// True if our hello offers replays (`LinkConfig::replay`, with a resume window).
    pub fn replays_offered(&self) -> bool {
        self.cfg.replay && !self.cfg.resume_window.is_zero()
    }

    /// True if this link keeps and counts its main lane for a replay: both sides resume and
    /// replay.
    fn replays(&self) -> bool {
        self.cfg.replay && self.resumable && self.peer.has(CAP_REPLAY)
    }

    /// Main-lane bytes kept at most for a replay.
    fn replay_cap(&self) -> u64 {
        self.cfg
            .link_window
            .saturating_mul(2)
            .clamp(KEPT_MIN, KEPT_MAX)
    }

    /// Main-lane bytes just written to `out`'s tail from `from` (past any hello and what was
    /// sent again), kept for a replay.
    pub(super) fn replay_sent(&mut self, bytes: &[u8]) {
        if self.replays() && self.state != State::Closed {
            let cap = self.replay_cap();
            self.replay.record(bytes, cap);
        }
    }

    /// A main-lane frame of `n` bytes (not a hello) was read; the peer hears how far we read
    /// every [`RECEIVED_EVERY`] bytes.
    pub(super) fn replay_read(&mut self, n: usize) {
        self.replay.received += n as u64;
        if self.replays() && self.replay.received - self.replay.told >= RECEIVED_EVERY {
            self.tell_received();
        }
    }

    /// Tells the peer how far we read its main lane, if it has not heard it yet (with other
    /// control frames, and with a ping, so a quiet link's peer does not keep its last bytes
    /// for long).
    pub(super) fn tell_received(&mut self) {
        if self.replays() && self.replay.received > self.replay.told {
            self.replay.told = self.replay.received;
            self.ctrl[MAIN_LANE].push_back(Frame::Received {
                offset: self.replay.received,
            });
        }
    }

    /// The peer read our main lane up to `offset`: what it read is no longer kept.
    pub(super) fn on_received(&mut self, offset: u64, lane: usize) -> Result<(), LinkError> {
        if lane != MAIN_LANE || !self.replays() {
            return Err(LinkError::Protocol("received without replay".into()));
        }
        if offset > self.replay.sent {
            return Err(LinkError::Protocol(format!(
                "the peer read {offset} bytes of the main lane, more than we sent ({})",
                self.replay.sent
            )));
        }
        self.replay.trim(offset);
        Ok(())
    }

    /// The connection is lost (`suspend`): what a replay needs is set aside before the queues
    /// are cleared, if the counts describe the link's state (it was up and settled, not
    /// loading caches). A connection lost again before the peer's hello came keeps what the
    /// first loss set aside, with the frames queued since.
    pub(super) fn replay_set_aside(&mut self) {
        let queued = std::mem::take(&mut self.ctrl[MAIN_LANE]);
        if let Some(a) = self.replay.aside.as_mut() {
            a.ctrl
                .extend(queued.into_iter().filter(|f| !matches!(f, Frame::Hello(_))));
            return;
        }
        let settled = matches!(self.state, State::Open | State::Draining)
            && !self.loading
            && self.resuming.is_none();
        if settled && self.replays() {
            self.replay.aside = Some(Box::new(Aside {
                ctrl: queued
                    .into_iter()
                    .filter(|f| !matches!(f, Frame::Hello(_)))
                    .collect(),
                checkpoints: std::mem::take(&mut self.deferred_checkpoints),
                ..Aside::default()
            }));
        }
    }

    /// A new connection starts over (`restart`) with `renewed`, a fresh codec for the resume
    /// lists: the one it replaces, and the link credit, are set aside the first time, for a
    /// replay. Returns the settings our hello adds (none if we cannot replay).
    pub(super) fn replay_restart(&mut self, renewed: Coding) -> Vec<(u16, u64)> {
        let old = std::mem::replace(&mut self.coding, renewed);
        self.replay.hello_out = false;
        self.replay.again.clear();
        let queued = std::mem::take(&mut self.ctrl[MAIN_LANE]);
        let Some(a) = self.replay.aside.as_mut() else {
            return Vec::new();
        };
        // Queued while the link was down: after what waited before.
        a.ctrl
            .extend(queued.into_iter().filter(|f| !matches!(f, Frame::Hello(_))));
        if a.coding.is_none() {
            a.coding = Some(old);
            a.credit = Some(self.link_credit.clone());
        }
        vec![
            (setting::REPLAY_RECEIVED, self.replay.received),
            (setting::REPLAY_KEPT, self.replay.kept_from),
        ]
    }

    /// True while a new connection waits for the peer's hello with something set aside for a
    /// replay: only our hello goes meanwhile, so that what is sent again comes first.
    pub(super) fn replay_undecided(&self) -> bool {
        self.replay.aside.is_some() && self.state == State::Handshake
    }

    /// Our hello went out on the main lane.
    pub(super) fn replay_hello_out(&mut self) {
        self.replay.hello_out = true;
    }

    /// What is sent again, once our hello is out (taken).
    pub(super) fn replay_again(&mut self) -> Option<VecDeque<Bytes>> {
        (self.replay.hello_out && !self.replay.again.is_empty())
            .then(|| std::mem::take(&mut self.replay.again))
    }

    /// True while bytes wait to be sent again.
    pub(super) fn replay_waits(&self) -> bool {
        !self.replay.again.is_empty()
    }

    /// The peer's hello on a resumed connection of the same link: true if both sides replay
    /// (and the link went on), false if the resume lists settle the streams. A peer that says
    /// it read more than we sent fails the link.
    pub(super) fn try_replay(&mut self, h: &Hello, now: Instant) -> Result<bool, LinkError> {
        let aside = self.replay.aside.take();
        let theirs = match (
            h.capabilities & CAP_REPLAY != 0,
            h.setting(setting::REPLAY_RECEIVED),
            h.setting(setting::REPLAY_KEPT),
        ) {
            (true, Some(r), Some(k)) => Some((r, k)),
            _ => None,
        };
        if let (Some(a), Some((read, kept))) = (aside, theirs) {
            if read > self.replay.sent {
                return Err(LinkError::Protocol(format!(
                    "the peer read {read} bytes of the main lane, more than we sent ({})",
                    self.replay.sent
                )));
            }
            if read >= self.replay.kept_from && kept <= self.replay.received {
                self.replay_from(*a, read, now);
                return Ok(true);
            }
        }
        // The counts start over with this connection, on both sides.
        self.replay = Replay::default();
        Ok(false)
    }

    /// Goes on from the peer's `read`: the codec, link credit and queued frames set aside come
    /// back, what the peer did not read goes again after our hello, and the latency lane is
    /// taken as lost alone.
    fn replay_from(&mut self, a: Aside, read: u64, now: Instant) {
        if let Some(c) = a.coding {
            self.coding = c;
        }
        if let Some(c) = a.credit {
            self.link_credit = c;
        }
        let mut queued = std::mem::take(&mut self.ctrl[MAIN_LANE]);
        let hello = match queued.front() {
            Some(Frame::Hello(_)) => queued.pop_front(),
            _ => None,
        };
        let mut ctrl: VecDeque<Frame> = hello.into_iter().collect();
        ctrl.extend(a.ctrl);
        ctrl.extend(queued);
        self.ctrl[MAIN_LANE] = ctrl;
        self.deferred_checkpoints = a.checkpoints;
        self.replay.again = self.replay.from(read);
        let since = self.outage.as_ref().map_or(now, |o| o.since);
        self.resuming = None;
        self.end_outage();
        // The peer answered our hello: it holds our newest token, the only one that works now.
        self.resume_tokens = vec![self.cfg.token];
        if self.cfg.latency_lane && self.peer.has(CAP_LATENCY_LANE) {
            self.lane_gone(now);
        }
        // Stalled streams wait for answers the peer sends again: their stall clocks start over.
        for s in self.streams.map.values_mut() {
            if let Some(rc) = s.recv.coded.as_mut() {
                rc.watched = None;
            }
        }
        self.resume_senders();
        let ids: Vec<_> = self.streams.map.keys().copied().collect();
        // The latency lane's are counted when its own resumption settles them.
        let streams = self
            .streams
            .map
            .values()
            .filter(|s| s.lane == MAIN_LANE)
            .count();
        for id in ids {
            self.streams.schedule(id);
        }
        self.events.push_back(Event::Resumed(ResumeStats {
            streams,
            replay: true,
            replayed: self.replay.sent - read,
            outage: now.saturating_duration_since(since),
            ..ResumeStats::default()
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_bytes_are_trimmed_to_what_the_peer_read_and_capped() {
        let mut r = Replay::default();
        r.record(b"abcd", 100);
        r.record(b"efgh", 100);
        assert_eq!(r.kept_bytes(), 8);
        let all: Vec<u8> = r.from(2).iter().flat_map(|b| b.to_vec()).collect();
        assert_eq!(all, b"cdefgh");
        r.trim(5);
        assert_eq!((r.kept_from, r.kept_bytes()), (5, 3));
        let all: Vec<u8> = r.from(5).iter().flat_map(|b| b.to_vec()).collect();
        assert_eq!(all, b"fgh");
        r.trim(8);
        assert_eq!(r.kept_bytes(), 0);
        assert!(r.from(8).is_empty());
        // Past the cap the oldest buffers go.
        r.record(&[1; 60], 100);
        r.record(&[2; 60], 100);
        assert_eq!((r.sent, r.kept_from, r.kept_bytes()), (128, 68, 60));
    }
}
