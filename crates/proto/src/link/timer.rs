//! The link's timers in one table: each [`Timer`] has at most one deadline, and the earliest one is
//! what [`Link::poll_timeout`](super::Link::poll_timeout) reports.

use std::time::Instant;

/// The link's timers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Timer {
    /// The peer has been silent too long: the link fails.
    Idle,
    /// The next keepalive ping is due.
    Ping,
    /// Changed caches are checkpointed (with cache storage).
    Checkpoint,
    /// Streams stalled on a missing chunk are checked against the stall timeout.
    Stalls,
    /// A suspended link's resume window ends: its streams are lost.
    Resume,
    /// A resumable link heard nothing for a while: a ping asks for an answer.
    Probe,
    /// A resumable link heard nothing for too long: its connection is given up for a new one.
    Silence,
    /// The latency lane, lost alone, did not come back within the resume window.
    LaneResume,
    /// Frames fed ahead wait no longer for the rest of a frame being read (see
    /// `Link::handle_lane_input`).
    Fed,
}

impl Timer {
    const COUNT: usize = 9;

    fn index(self) -> usize {
        match self {
            Timer::Idle => 0,
            Timer::Ping => 1,
            Timer::Checkpoint => 2,
            Timer::Stalls => 3,
            Timer::Resume => 4,
            Timer::Probe => 5,
            Timer::Silence => 6,
            Timer::LaneResume => 7,
            Timer::Fed => 8,
        }
    }
}

/// One deadline per [`Timer`].
#[derive(Debug, Default, Clone)]
pub(super) struct TimerTable {
    at: [Option<Instant>; Timer::COUNT],
}

impl TimerTable {
    pub fn set(&mut self, t: Timer, at: Instant) {
        self.at[t.index()] = Some(at);
    }

    pub fn get(&self, t: Timer) -> Option<Instant> {
        self.at[t.index()]
    }

    /// The timer's deadline, armed at `at` first if it had none.
    pub fn get_or_set(&mut self, t: Timer, at: Instant) -> Instant {
        *self.at[t.index()].get_or_insert(at)
    }

    pub fn clear(&mut self, t: Timer) {
        self.at[t.index()] = None;
    }

    pub fn stop_all(&mut self) {
        self.at = Default::default();
    }

    /// True if the timer is armed and due at `now`.
    pub fn expired(&self, t: Timer, now: Instant) -> bool {
        self.get(t).is_some_and(|at| now >= at)
    }

    /// The earliest deadline of all.
    pub fn next(&self) -> Option<Instant> {
        self.at.iter().flatten().min().copied()
    }
}
