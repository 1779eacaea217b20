//! Redundant copies of a lane: the same bytes written on up to [`MAX_COPIES`] connections at
//! once and merged on arrival by their offset in the lane's byte stream, so a segment lost on
//! one connection costs nothing while another brings it. [`Fanout`] keeps what the slowest copy
//! has not written yet; [`Merge`] hands on each byte once, from whichever copy brings it first.
//!
//! Every copy carries the whole byte stream from its start offset, in order, so the merged
//! stream is the sent one exactly: the link above sees one lane and never a duplicate frame.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};

/// Most bytes of datagram pieces held ahead of the delivered stream (see [`Merge::piece`]).
pub const PIECES_LIMIT: usize = 1 << 20;

/// Most connections that carry one lane.
pub const MAX_COPIES: usize = 5;

/// Bytes a copy may fall behind the most advanced one (sender), or run ahead of what was
/// delivered (receiver), before it is given up: one stalled connection cannot hold memory.
pub const COPY_LAG_LIMIT: usize = 8 << 20;

/// What a copy did wrong; the copy is given up, the lane goes on on the others.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CopyError {
    /// Input for a slot that carries no copy.
    #[error("copy {0} is not attached")]
    NotAttached(usize),
    /// The copy's bytes start further ahead of the delivered stream than may be held.
    #[error("copy {slot} is {ahead} bytes ahead of the lane")]
    TooFarAhead { slot: usize, ahead: u64 },
}

/// The sending side of a lane's copies.
#[derive(Debug)]
pub struct Fanout {
    /// Bytes from `base` on that some copy has not written yet, each with when it was pushed.
    held: VecDeque<(Bytes, Instant)>,
    base: u64,
    /// Bytes produced for the lane so far.
    end: u64,
    /// Each attached copy's offset: the bytes before it are written.
    copies: [Option<u64>; MAX_COPIES],
    lag_limit: usize,
    /// Bytes written on a copy while another had written them already.
    duplicated: u64,
    /// How ready each copy's connection was to deliver when the newest bytes were pushed (see
    /// [`set_ranks`](Self::set_ranks)): 0 the readiest.
    ranks: [u8; MAX_COPIES],
}

impl Fanout {
    /// No copies yet; a copy falling `lag_limit` bytes behind the others is given up.
    pub fn new(lag_limit: usize) -> Self {
        Fanout {
            held: VecDeque::new(),
            base: 0,
            end: 0,
            copies: [None; MAX_COPIES],
            lag_limit,
            duplicated: 0,
            ranks: [0; MAX_COPIES],
        }
    }

    /// How ready each copy's connection is to deliver bytes written now, 0 the readiest: one
    /// still recovering from a loss, or with earlier bytes not yet acknowledged, holds what is
    /// written behind them at the peer. With spaced copies, a copy writes after every readier
    /// one that has still to write the same bytes (see [`not_before`](Self::not_before)).
    pub fn set_ranks(&mut self, ranks: [u8; MAX_COPIES]) {
        self.ranks = ranks;
    }

    /// Bytes produced for the lane so far (the next byte's offset).
    pub fn end(&self) -> u64 {
        self.end
    }

    /// Attaches a copy in a free slot; it carries the bytes produced from now on. Returns the
    /// slot and the offset its bytes start at (the peer's [`Merge`] needs it), or `None` when
    /// every slot is taken.
    pub fn attach(&mut self) -> Option<(usize, u64)> {
        let slot = self.copies.iter().position(Option::is_none)?;
        self.attach_at(slot)
    }

    /// Like [`attach`](Self::attach) in a given slot, if free.
    pub fn attach_at(&mut self, slot: usize) -> Option<(usize, u64)> {
        let free = self.copies.get(slot).is_some_and(Option::is_none);
        if !free {
            return None;
        }
        if self.copies.iter().all(Option::is_none) {
            // Nobody needs what was held for copies now gone.
            self.held.clear();
            self.base = self.end;
        }
        self.copies[slot] = Some(self.end);
        Some((slot, self.end))
    }

    /// Gives a copy up (its connection is gone); what only it still needed is dropped.
    pub fn detach(&mut self, slot: usize) {
        if let Some(c) = self.copies.get_mut(slot) {
            *c = None;
        }
        self.trim();
    }

    /// Slots carrying a copy.
    pub fn attached(&self) -> impl Iterator<Item = usize> + '_ {
        (0..MAX_COPIES).filter(|&s| self.copies[s].is_some())
    }

    /// Number of copies.
    pub fn copies(&self) -> usize {
        self.attached().count()
    }

    /// Appends the lane's next bytes for every copy, produced at `now`. Returns the slots given
    /// up because they fell more than the lag limit behind the most advanced copy (never the
    /// most advanced).
    pub fn push(&mut self, bytes: Bytes, now: Instant) -> Vec<usize> {
        if bytes.is_empty() {
            return Vec::new();
        }
        self.end += bytes.len() as u64;
        if self.copies.iter().all(Option::is_none) {
            self.base = self.end;
            return Vec::new();
        }
        self.held.push_back((bytes, now));
        let lead = self
            .copies
            .iter()
            .flatten()
            .copied()
            .max()
            .unwrap_or(self.end);
        let limit = self.lag_limit as u64;
        let mut dropped = Vec::new();
        for slot in 0..MAX_COPIES {
            if let Some(at) = self.copies[slot]
                && at < lead
                && self.end - at > limit
            {
                self.copies[slot] = None;
                dropped.push(slot);
            }
        }
        if !dropped.is_empty() {
            self.trim();
        }
        dropped
    }

    /// The next bytes copy `slot` has to write (a cheap slice of what is held), if any.
    pub fn next(&self, slot: usize) -> Option<Bytes> {
        let at = (*self.copies.get(slot)?)?;
        if at >= self.end {
            return None;
        }
        let mut off = self.base;
        for (b, _) in &self.held {
            let len = b.len() as u64;
            if at < off + len {
                return Some(b.slice((at - off) as usize..));
            }
            off += len;
        }
        None
    }

    /// When copy `slot` may write its next bytes, with copies spaced `spacing` apart: the first
    /// copy to write bytes writes them at once, the second `spacing` after they were pushed,
    /// the third twice that, so a burst of loss that takes one copy's packets misses the
    /// others'. A copy counts as ahead of this one if it wrote some of these bytes already, or
    /// stands where this one does and is readier (its rank is lower): the readiest copies go
    /// first. (One still writing earlier bytes holds nobody up.) `None`: now (or nothing to
    /// write).
    pub fn not_before(&self, slot: usize, spacing: Duration) -> Option<Instant> {
        if spacing.is_zero() {
            return None;
        }
        let at = (*self.copies.get(slot)?)?;
        let rank = self.ranks[slot];
        let ahead = self
            .copies
            .iter()
            .zip(self.ranks)
            .filter(|&(c, r)| c.is_some_and(|c| c > at || (c == at && r < rank)))
            .count();
        if ahead == 0 {
            return None;
        }
        let mut off = self.base;
        for (b, pushed) in &self.held {
            let len = b.len() as u64;
            if at < off + len {
                return Some(*pushed + spacing * ahead as u32);
            }
            off += len;
        }
        None
    }

    /// Copy `slot` wrote `n` more bytes.
    pub fn wrote(&mut self, slot: usize, n: usize) {
        let lead = self.copies.iter().flatten().copied().max();
        let Some(Some(at)) = self.copies.get_mut(slot) else {
            return;
        };
        let before = *at;
        *at = (*at + n as u64).min(self.end);
        // What another copy had written already is the copies' cost.
        if let Some(lead) = lead {
            self.duplicated += lead.min(*at).saturating_sub(before);
        }
        self.trim();
    }

    /// How far copy `slot` is behind what was produced.
    pub fn behind(&self, slot: usize) -> Option<u64> {
        Some(self.end - (*self.copies.get(slot)?)?)
    }

    /// Bytes held for copies that have not written them (in whole pushes).
    pub fn held_bytes(&self) -> u64 {
        self.end - self.base
    }

    /// Bytes written on a copy after another copy had written them (what redundancy costs).
    pub fn duplicated(&self) -> u64 {
        self.duplicated
    }

    /// Drops what every copy has written.
    fn trim(&mut self) {
        let low = self
            .copies
            .iter()
            .flatten()
            .copied()
            .min()
            .unwrap_or(self.end);
        while let Some((front, _)) = self.held.front() {
            let len = front.len() as u64;
            if self.base + len > low {
                break;
            }
            self.base += len;
            self.held.pop_front();
        }
    }
}

/// One copy's place in the incoming stream.
#[derive(Debug, Default)]
struct Incoming {
    /// Offset of the next byte this copy brings (the first of `held`, if any).
    pos: u64,
    /// Bytes this copy brought ahead of what was delivered (after a gap only the others fill).
    held: BytesMut,
}

/// The receiving side of a lane's copies.
#[derive(Debug)]
pub struct Merge {
    /// Bytes of the lane handed on so far.
    delivered: u64,
    copies: [Option<Incoming>; MAX_COPIES],
    hold_limit: usize,
    /// Bytes each slot delivered first.
    won: [u64; MAX_COPIES],
    /// Bytes that arrived after another copy had brought them.
    discarded: u64,
    /// Pieces datagrams brought ahead of the delivered stream, by offset (see [`piece`]).
    ///
    /// [`piece`]: Self::piece
    pieces: BTreeMap<u64, Bytes>,
    pieces_bytes: usize,
    /// Bytes datagrams delivered first.
    won_pieces: u64,
}

impl Merge {
    /// No copies yet; a copy may run `hold_limit` bytes ahead of the delivered stream.
    pub fn new(hold_limit: usize) -> Self {
        Merge {
            delivered: 0,
            copies: Default::default(),
            hold_limit,
            won: [0; MAX_COPIES],
            discarded: 0,
            pieces: BTreeMap::new(),
            pieces_bytes: 0,
            won_pieces: 0,
        }
    }

    /// Bytes of the lane delivered so far.
    pub fn delivered(&self) -> u64 {
        self.delivered
    }

    /// Attaches a copy whose bytes start at `start` of the lane (what the peer's
    /// [`Fanout::attach`] said). A start further ahead than may be held is refused.
    pub fn attach(&mut self, slot: usize, start: u64) -> Result<(), CopyError> {
        if slot >= MAX_COPIES {
            return Err(CopyError::NotAttached(slot));
        }
        let ahead = start.saturating_sub(self.delivered);
        if ahead > self.hold_limit as u64 {
            return Err(CopyError::TooFarAhead { slot, ahead });
        }
        self.copies[slot] = Some(Incoming {
            pos: start,
            held: BytesMut::new(),
        });
        Ok(())
    }

    /// Gives a copy up.
    pub fn detach(&mut self, slot: usize) {
        if let Some(c) = self.copies.get_mut(slot) {
            *c = None;
        }
    }

    /// True while `slot` carries a copy.
    pub fn is_attached(&self, slot: usize) -> bool {
        self.copies.get(slot).is_some_and(Option::is_some)
    }

    /// Bytes each slot delivered first, so far.
    pub fn won(&self) -> [u64; MAX_COPIES] {
        self.won
    }

    /// Bytes that came after another copy had brought them.
    pub fn discarded(&self) -> u64 {
        self.discarded
    }

    /// Bytes datagrams delivered first, so far.
    pub fn won_by_pieces(&self) -> u64 {
        self.won_pieces
    }

    /// Takes a piece of the lane a datagram brought, at `offset`, and appends to `out` the bytes
    /// it and what waited for it deliver, in the lane's order; returns how many. A piece ahead
    /// of the delivered stream waits for the gap to fill, within [`PIECES_LIMIT`] bytes held and
    /// the merge's hold limit; one beyond either is dropped (the copies bring its bytes).
    /// Datagrams never count toward [`complete`](Self::complete): they may all be lost.
    pub fn piece(&mut self, offset: u64, data: &[u8], out: &mut BytesMut) -> usize {
        let before = out.len();
        let end = offset.saturating_add(data.len() as u64);
        if data.is_empty() || end <= self.delivered {
            self.discarded += data.len() as u64;
            return 0;
        }
        if offset <= self.delivered {
            let skip = (self.delivered - offset) as usize;
            self.discarded += skip as u64;
            out.extend_from_slice(&data[skip..]);
            self.won_pieces += end - self.delivered;
            self.delivered = end;
        } else if end - self.delivered <= self.hold_limit as u64
            && self.pieces_bytes + data.len() <= PIECES_LIMIT
        {
            let longer = self
                .pieces
                .get(&offset)
                .is_none_or(|p| p.len() < data.len());
            if longer {
                let old = self.pieces.insert(offset, Bytes::copy_from_slice(data));
                self.pieces_bytes += data.len() - old.map_or(0, |p| p.len());
            }
        }
        self.settle(out);
        out.len() - before
    }

    /// True while some copy brings the bytes that follow the delivered ones. False once every
    /// copy left starts past a gap only a copy now gone could have filled: the lane is lost.
    pub fn complete(&self) -> bool {
        self.copies
            .iter()
            .flatten()
            .any(|c| c.pos <= self.delivered)
    }

    /// Bytes held for copies ahead of the delivered stream.
    pub fn held_bytes(&self) -> usize {
        self.copies
            .iter()
            .flatten()
            .map(|c| c.held.len())
            .sum::<usize>()
            + self.pieces_bytes
    }

    /// Takes the next bytes copy `slot` read and appends to `out` those not delivered before,
    /// in the lane's order; returns how many. Bytes ahead of the delivered stream wait for the
    /// other copies to fill the gap.
    pub fn input(
        &mut self,
        slot: usize,
        data: &[u8],
        out: &mut BytesMut,
    ) -> Result<usize, CopyError> {
        let delivered = self.delivered;
        let Some(c) = self.copies.get_mut(slot).and_then(Option::as_mut) else {
            return Err(CopyError::NotAttached(slot));
        };
        let before = out.len();
        if c.held.is_empty() && c.pos <= delivered {
            // In step (the usual case): deliver what is new straight from `data`.
            let end = c.pos + data.len() as u64;
            let skip = (delivered - c.pos).min(data.len() as u64) as usize;
            self.discarded += skip as u64;
            out.extend_from_slice(&data[skip..]);
            c.pos = end;
            if end > delivered {
                self.delivered = end;
                self.won[slot] += end - delivered;
            }
        } else {
            c.held.extend_from_slice(data);
            let ahead = c.pos + c.held.len() as u64 - delivered;
            if ahead > self.hold_limit as u64 {
                return Err(CopyError::TooFarAhead { slot, ahead });
            }
        }
        self.settle(out);
        Ok(out.len() - before)
    }

    /// Delivers what held copies and pieces can now give, until none moves.
    fn settle(&mut self, out: &mut BytesMut) {
        loop {
            let mut moved = false;
            while let Some(entry) = self.pieces.first_entry() {
                if *entry.key() > self.delivered {
                    break;
                }
                let (offset, p) = entry.remove_entry();
                self.pieces_bytes -= p.len();
                let end = offset + p.len() as u64;
                let skip = (self.delivered - offset).min(p.len() as u64) as usize;
                self.discarded += skip as u64;
                if end > self.delivered {
                    out.extend_from_slice(&p[skip..]);
                    self.won_pieces += end - self.delivered;
                    self.delivered = end;
                    moved = true;
                }
            }
            for slot in 0..MAX_COPIES {
                let Some(c) = self.copies[slot].as_mut() else {
                    continue;
                };
                if c.held.is_empty() || c.pos > self.delivered {
                    continue;
                }
                let len = c.held.len() as u64;
                let end = c.pos + len;
                let skip = (self.delivered - c.pos).min(len) as usize;
                self.discarded += skip as u64;
                out.extend_from_slice(&c.held[skip..]);
                c.held.clear();
                c.pos = end;
                if end > self.delivered {
                    self.won[slot] += end - self.delivered;
                    self.delivered = end;
                    moved = true;
                }
            }
            if !moved {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator for the property test below.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n.max(1)
        }
    }

    proptest::proptest! {
        /// TCP copies (each bringing the whole stream in its own chunks, some cut short) and
        /// sealed datagrams (each sent twice, lost in Gilbert-Elliott bursts, reordered) merge
        /// into the sent stream exactly: each byte once and in order at every step, and all of
        /// it once one copy is complete.
        #[test]
        fn copies_and_datagrams_under_burst_loss_deliver_exactly_once(
            seed in 1u64..u64::MAX, len in 1usize..40_000, copies in 1usize..=3, cut in proptest::bool::ANY,
        ) {
            let mut r = Rng(seed);
            let stream: Vec<u8> = (0..len).map(|_| r.next() as u8).collect();
            let key = [5u8; 32];
            let (mut sealer, mut opener) =
                (crate::datagram::Sealer::new(&key, 1), crate::datagram::Opener::new(&key, 1));
            // Datagrams: writes of up to 9 KB, each piece sent twice, a lossy burst chain.
            let mut flying = Vec::new();
            let (mut at, mut bad) = (0, false);
            while at < len {
                let w = (1 + r.below(9000) as usize).min(len - at);
                for d in sealer.seal(at as u64, &stream[at..at + w]) {
                    for _ in 0..2 {
                        bad = if bad { r.below(5) != 0 } else { r.below(50) == 0 };
                        if !bad {
                            flying.push(d.clone());
                        }
                    }
                }
                at += w;
            }
            // Reordered within a few datagrams.
            for i in 0..flying.len() {
                let j = (i + r.below(4) as usize).min(flying.len() - 1);
                flying.swap(i, j);
            }
            let mut m = Merge::new(COPY_LAG_LIMIT);
            let mut pos = vec![0usize; copies];
            // A cut copy ends early; copy 0 always completes unless `cut` cuts every copy.
            let ends: Vec<usize> = (0..copies)
                .map(|c| if cut && (c > 0 || copies == 1) { r.below(len as u64) as usize } else { len })
                .collect();
            for c in 0..copies {
                m.attach(c, 0).expect("attach");
            }
            let mut out = BytesMut::new();
            let mut next_dgram = 0;
            loop {
                let live: Vec<usize> = (0..copies).filter(|c| pos[*c] < ends[*c]).collect();
                if live.is_empty() && next_dgram == flying.len() {
                    break;
                }
                if next_dgram < flying.len() && (live.is_empty() || r.below(3) == 0) {
                    let mut d = flying[next_dgram].clone();
                    next_dgram += 1;
                    if let Ok((offset, piece, _)) = opener.open(&mut d) {
                        m.piece(offset, piece, &mut out);
                    }
                } else {
                    let c = live[r.below(live.len() as u64) as usize];
                    let n = (1 + r.below(3000) as usize).min(ends[c] - pos[c]);
                    m.input(c, &stream[pos[c]..pos[c] + n], &mut out).expect("input");
                    pos[c] += n;
                    if pos[c] == ends[c] && ends[c] < len {
                        m.detach(c);
                    }
                }
                proptest::prop_assert_eq!(m.delivered() as usize, out.len());
                proptest::prop_assert_eq!(&out[..], &stream[..out.len()]);
            }
            if !cut || copies > 1 {
                proptest::prop_assert_eq!(out.len(), len, "a complete copy brings everything");
                proptest::prop_assert_eq!(m.held_bytes(), 0, "nothing waits once all is in");
            }
            proptest::prop_assert!(m.won_by_pieces() <= len as u64);
        }
    }

    fn merged(m: &mut Merge, slot: usize, data: &[u8]) -> Vec<u8> {
        let mut out = BytesMut::new();
        m.input(slot, data, &mut out).expect("input");
        out.to_vec()
    }

    #[test]
    fn the_first_copy_of_each_byte_is_delivered_once() {
        let mut m = Merge::new(1 << 20);
        m.attach(0, 0).expect("ok");
        m.attach(1, 0).expect("ok");
        assert_eq!(merged(&mut m, 0, b"hello"), b"hello");
        assert_eq!(merged(&mut m, 1, b"hel"), b"");
        assert_eq!(merged(&mut m, 1, b"lo wor"), b" wor");
        assert_eq!(merged(&mut m, 0, b" world"), b"ld");
        assert_eq!(m.delivered(), 11);
        assert_eq!(m.won(), [7, 4, 0, 0, 0]);
        assert_eq!(m.discarded(), 3 + 2 + 4);
    }

    #[test]
    fn a_copy_that_starts_ahead_waits_for_the_gap() {
        let mut m = Merge::new(1 << 20);
        m.attach(0, 0).expect("ok");
        assert_eq!(merged(&mut m, 0, b"abc"), b"abc");
        // A new copy joins at 6: bytes 3..6 are still on their way on the first.
        m.attach(1, 6).expect("ok");
        assert_eq!(merged(&mut m, 1, b"ghi"), b"");
        assert_eq!(m.held_bytes(), 3);
        assert_eq!(merged(&mut m, 0, b"def"), b"defghi");
        assert_eq!(merged(&mut m, 0, b"ghij"), b"j");
        assert_eq!(m.held_bytes(), 0);
    }

    #[test]
    fn a_copy_too_far_ahead_is_refused() {
        let mut m = Merge::new(4);
        m.attach(0, 0).expect("ok");
        assert!(m.attach(1, 5).is_err());
        m.attach(1, 2).expect("ok");
        assert!(matches!(
            m.input(1, b"xyz", &mut BytesMut::new()),
            Err(CopyError::TooFarAhead { slot: 1, .. })
        ));
        assert!(matches!(
            m.input(2, b"x", &mut BytesMut::new()),
            Err(CopyError::NotAttached(2))
        ));
    }

    #[test]
    fn a_lagging_copy_is_given_up_not_the_leader() {
        let mut f = Fanout::new(12);
        assert_eq!(f.attach(), Some((0, 0)));
        assert_eq!(f.attach(), Some((1, 0)));
        assert!(
            f.push(Bytes::from_static(b"01234567"), Instant::now())
                .is_empty()
        );
        let b = f.next(0).expect("ok");
        f.wrote(0, b.len());
        assert!(
            f.push(Bytes::from_static(b"89ab"), Instant::now())
                .is_empty()
        );
        f.wrote(0, 4);
        // Copy 1 wrote nothing: 12 bytes behind the leader's 12.
        assert_eq!(f.push(Bytes::from_static(b"c"), Instant::now()), vec![1]);
        assert_eq!(f.copies(), 1);
        // Only copy 0 is left, with nothing held for anyone else.
        f.wrote(0, 1);
        assert_eq!(f.held_bytes(), 0);
        assert_eq!(f.next(0), None);
    }

    #[test]
    fn fanout_keeps_bytes_until_every_copy_wrote_them() {
        let mut f = Fanout::new(1 << 20);
        f.attach().expect("ok");
        f.push(Bytes::from_static(b"abc"), Instant::now());
        f.wrote(0, 3);
        assert_eq!(f.held_bytes(), 0);
        assert_eq!(f.attach(), Some((1, 3)));
        f.push(Bytes::from_static(b"def"), Instant::now());
        assert_eq!(f.next(0).as_deref(), Some(&b"def"[..]));
        f.wrote(0, 2);
        assert_eq!(f.next(0).as_deref(), Some(&b"f"[..]));
        assert_eq!(f.next(1).as_deref(), Some(&b"def"[..]));
        f.wrote(1, 3);
        assert_eq!(f.duplicated(), 2);
        // Held in whole pushes: "def" until copy 0 wrote its last byte.
        assert_eq!(f.held_bytes(), 3);
        f.wrote(0, 1);
        assert_eq!(f.held_bytes(), 0);
        f.detach(1);
        f.detach(0);
        assert_eq!(f.copies(), 0);
        assert!(
            f.push(Bytes::from_static(b"gone"), Instant::now())
                .is_empty()
        );
        assert_eq!(f.held_bytes(), 0);
        assert_eq!(f.end(), 10);
    }

    /// A fanout with three copies attached.
    fn three_copies() -> Fanout {
        let mut f = Fanout::new(1 << 20);
        for _ in 0..3 {
            f.attach().expect("slot");
        }
        f
    }

    /// Spaced copies: the first to write bytes writes them at once, each later one a spacing
    /// after the one before, counted from when the bytes were pushed; old bytes wait for nobody.
    #[test]
    fn copies_are_spaced_in_time() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut f = three_copies();
        f.push(Bytes::from_static(b"abcd"), t0);
        assert_eq!(f.not_before(1, ms(3)), None, "nobody wrote them yet");
        f.wrote(1, 4);
        assert_eq!(f.not_before(1, ms(3)), None, "copy 1 has nothing left");
        assert_eq!(f.not_before(0, ms(3)), Some(t0 + ms(3)));
        assert_eq!(f.not_before(0, Duration::ZERO), None);
        f.wrote(0, 4);
        assert_eq!(f.not_before(2, ms(3)), Some(t0 + ms(6)));
        f.push(Bytes::from_static(b"ef"), t0 + ms(10));
        // Copy 2 is still on the first push: it is due from that push's time.
        assert_eq!(f.not_before(2, ms(3)), Some(t0 + ms(6)));
        f.wrote(2, 4);
        assert_eq!(f.not_before(2, ms(3)), None, "now first on the second push");
    }

    /// A copy whose connection is less ready (still recovering from a loss, say) waits for the
    /// readier ones that have the same bytes to write, however soon it comes; among copies
    /// equally ready, the first to come writes first.
    #[test]
    fn the_readiest_copies_go_first() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut f = three_copies();
        f.set_ranks([2, 0, 1, 0, 0]);
        f.push(Bytes::from_static(b"abcd"), t0);
        assert_eq!(f.not_before(1, ms(5)), None, "the readiest writes at once");
        assert_eq!(f.not_before(2, ms(5)), Some(t0 + ms(5)), "one readier copy");
        assert_eq!(
            f.not_before(0, ms(5)),
            Some(t0 + ms(10)),
            "two readier copies"
        );
        f.wrote(1, 4);
        assert_eq!(f.not_before(2, ms(5)), Some(t0 + ms(5)));
        f.wrote(2, 4);
        assert_eq!(f.not_before(0, ms(5)), Some(t0 + ms(10)));
        f.wrote(0, 4);
        // Equally ready: the first to come writes first, the other one spacing later.
        f.set_ranks([0; MAX_COPIES]);
        f.push(Bytes::from_static(b"ef"), t0 + ms(20));
        assert_eq!(f.not_before(2, ms(5)), None);
        assert_eq!(f.not_before(0, ms(5)), None);
        f.wrote(2, 2);
        assert_eq!(f.not_before(0, ms(5)), Some(t0 + ms(25)));
        f.wrote(0, 2);
        // A readier copy still writing earlier bytes (copy 1) holds nobody up.
        f.set_ranks([1, 0, 1, 0, 0]);
        f.push(Bytes::from_static(b"gh"), t0 + ms(30));
        assert_eq!(f.not_before(0, ms(5)), None);
        assert_eq!(f.not_before(2, ms(5)), None);
        // Without spacing nobody waits.
        f.set_ranks([3, 0, 0, 0, 0]);
        assert_eq!(f.not_before(0, Duration::ZERO), None);
    }
}
