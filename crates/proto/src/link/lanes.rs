//! The latency lane's part of [`Link`]: offering and attaching it, the hellos of its
//! connections and copies, and what both ends take (copies, datagrams).

use super::{Link, State, hello};
use crate::frame::Frame;
use crate::lane::CAP_LATENCY_LANE;

impl Link {
    /// The connecting side: after the peer's hello, whether to open a latency lane, and the token
    /// to present on it.
    pub fn lane_offer(&self) -> Option<u64> {
        (self.cfg.initiator
            && self.cfg.latency_lane
            && self.state == State::Open
            && !self.lane_attached
            && self.peer.has(CAP_LATENCY_LANE))
        .then_some(self.peer.token)
    }

    /// The first frame to send on a new latency-lane connection (connecting side): it presents
    /// `token` and names the lane `lane_id`; a copy of that lane also says where its bytes
    /// start (`copy_at`).
    pub fn lane_hello(&self, token: u64, lane_id: u64, copy_at: Option<u64>) -> Frame {
        Frame::Hello(hello::lane(&self.cfg.site, token, lane_id, copy_at))
    }

    /// The listener's first frame on a copy's connection: where its bytes on it start.
    pub fn copy_answer(&self, at: u64) -> Frame {
        Frame::Hello(hello::copy_answer(&self.cfg.site, at))
    }

    /// True if `token` is the one a latency lane (or a copy of it) of this link must present.
    pub fn lane_token_valid(&self, token: u64) -> bool {
        self.cfg.latency_lane
            && if self.cfg.initiator {
                token == self.peer.token
            } else {
                token == self.cfg.token && self.peer.has(CAP_LATENCY_LANE)
            }
    }

    /// The token a latency-lane connection (or a copy of the lane) presents (connecting side,
    /// once the peer's hello offered a lane).
    pub fn lane_token(&self) -> Option<u64> {
        (self.cfg.initiator && self.cfg.latency_lane && self.peer.has(CAP_LATENCY_LANE))
            .then_some(self.peer.token)
    }

    /// How many connections may carry the latency lane: the fewer of ours and the peer's.
    pub fn lane_copies(&self) -> usize {
        let theirs = if self.peer.has(crate::lane::CAP_LANE_COPIES) {
            self.peer.lane_copies
        } else {
            1
        };
        self.cfg
            .lane_copies
            .min(theirs)
            .clamp(1, crate::copies::MAX_COPIES)
    }

    /// True when both ends take pieces of the latency lane as datagrams (with copies: the
    /// lane's id names its datagrams).
    pub fn lane_datagrams(&self) -> bool {
        self.cfg.lane_datagrams
            && self.lane_copies() > 1
            && self.peer.has(crate::lane::CAP_LANE_DATAGRAMS)
    }

    /// Attaches the latency lane. The connecting side calls this once its lane connection is up;
    /// the listening side once a connection presented `token` (checked here against its own).
    /// Latency-class streams opened from now on use the lane.
    pub fn attach_lane(&mut self, token: u64) -> bool {
        let valid = self.state == State::Open
            && self.cfg.latency_lane
            && if self.cfg.initiator {
                token == self.peer.token
            } else {
                token == self.cfg.token && self.peer.has(CAP_LATENCY_LANE)
            };
        if valid && self.lane_attached && !self.cfg.initiator {
            // The peer opens a new lane while ours looks up: it saw the old one go.
            let heard = self.heard;
            if !heard.is_some_and(|since| self.lane_lost(since)) {
                return false;
            }
        }
        let ok = self.state == State::Open
            && !self.lane_attached
            && self.cfg.latency_lane
            && if self.cfg.initiator {
                token == self.peer.token
            } else {
                token == self.cfg.token && self.peer.has(CAP_LATENCY_LANE)
            };
        if ok {
            self.lane_attached = true;
            self.on_lane_attached();
        }
        ok
    }

    /// True while the latency lane is attached.
    pub fn lane_attached(&self) -> bool {
        self.lane_attached
    }
}
