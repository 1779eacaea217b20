//! The bookkeeping of the connections carrying a link's latency lane: which slot each holds and
//! in which generation ([`Carrier`]), and the lane's [`Fanout`] and [`Merge`] of their copies.
//! Pure data; the tasks that move the copies' bytes are in `lane_copies.rs`.

use bytes::BytesMut;
use wanopt_proto::copies::{COPY_LAG_LIMIT, Fanout, MAX_COPIES, Merge};

/// One connection's place among the lane's copies: the link and lane connections it belongs to,
/// its slot and the generation that slot had when it was attached.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Carrier {
    pub conn: (u64, u64),
    pub slot: usize,
    pub generation: u64,
}

/// The copies of the current latency lane.
#[derive(Debug)]
pub(crate) struct LaneCopies {
    /// The lane's id (`setting::COPY_OF`): a copy must name it. `None`: a peer that names none
    /// takes no copies.
    pub id: Option<u64>,
    pub fanout: Fanout,
    pub merge: Merge,
    /// Merged bytes the link has not taken yet (a partial frame, or input while it loads).
    pub input: BytesMut,
    /// Each slot's connection generation (0: no connection).
    pub generations: [u64; MAX_COPIES],
    /// Where each slot's outgoing bytes start (the newest copy starts furthest on).
    pub starts: [u64; MAX_COPIES],
    /// Lane bytes sent and received since the link started, for the redundancy policy.
    pub sent: u64,
    pub received: u64,
    /// The lane's datagrams, when both ends take them.
    pub datagrams: Option<crate::datagrams::LaneDatagrams>,
}

impl LaneCopies {
    pub fn new() -> Self {
        LaneCopies {
            id: None,
            fanout: Fanout::new(COPY_LAG_LIMIT),
            merge: Merge::new(COPY_LAG_LIMIT),
            input: BytesMut::new(),
            generations: [0; MAX_COPIES],
            starts: [0; MAX_COPIES],
            sent: 0,
            received: 0,
            datagrams: None,
        }
    }

    /// Connections carrying the lane now.
    pub fn count(&self) -> usize {
        self.generations.iter().filter(|g| **g != 0).count()
    }

    pub fn carries(&self, c: &Carrier) -> bool {
        self.generations.get(c.slot) == Some(&c.generation)
    }

    /// Forgets slot `slot`'s connection at both ends of the lane.
    pub fn release(&mut self, slot: usize) {
        self.generations[slot] = 0;
        self.fanout.detach(slot);
        self.merge.detach(slot);
    }

    /// A new lane (all copies of the old one are stale): its first connection in slot 0.
    pub fn restart(&mut self, id: Option<u64>, generation: u64) {
        let (sent, received) = (self.sent, self.received);
        *self = LaneCopies::new();
        self.id = id;
        self.sent = sent;
        self.received = received;
        let _ = self.fanout.attach_at(0);
        let _ = self.merge.attach(0, 0);
        self.generations[0] = generation;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A restarted lane holds its first connection in slot 0 and keeps the byte counts; a
    /// released slot no longer carries, and a carrier of an older generation never does.
    #[test]
    fn slots_carry_only_their_current_generation() {
        let mut l = LaneCopies::new();
        l.sent = 10;
        l.received = 20;
        l.restart(Some(9), 4);
        assert_eq!((l.id, l.count(), l.sent, l.received), (Some(9), 1, 10, 20));
        let c = |slot, generation| Carrier {
            conn: (0, 0),
            slot,
            generation,
        };
        assert!(l.carries(&c(0, 4)));
        assert!(!l.carries(&c(0, 3)), "an older generation");
        assert!(!l.carries(&c(1, 4)), "an empty slot");
        assert!(!l.carries(&c(MAX_COPIES + 1, 4)), "no such slot");
        l.release(0);
        assert_eq!(l.count(), 0);
        assert!(!l.carries(&c(0, 4)));
    }
}
