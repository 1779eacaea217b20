//! The latency lane's datagrams: pieces of the lane's byte stream sent as UDP datagrams beside
//! its TCP copies, sealed with keys both ends export from the lane's TLS session, and merged
//! into the lane by their offset ([`Merge::piece`](crate::copies::Merge::piece)).
//!
//! A TCP copy that lost one segment holds everything behind it until the retransmission comes,
//! so a burst of loss that takes one packet of every copy of a write holds the write a round
//! trip or more. A datagram holds nothing: each piece counts on its own, and a piece one burst
//! took is brought by the same piece sent again a little later, or by any copy. Datagrams are
//! never retransmitted; the TCP copies still bring every byte.
//!
//! Wire format: kind `0x57` (1 byte), the lane's id (u64), a counter (u64, the nonce, never
//! reused under a key), then sealed (ChaCha20-Poly1305, the first 17 bytes as associated data):
//! the piece's offset in the lane (u64) and its bytes, then the 16-byte tag. The same sealed
//! datagram sent twice is a duplicate the receiver's replay window drops.

use ring::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};

/// The first byte of every datagram.
pub const KIND: u8 = 0x57;
/// Bytes before the sealed part: kind, lane id, counter.
pub const HEADER: usize = 17;
/// Bytes a datagram adds to its piece: header, offset, tag.
pub const OVERHEAD: usize = HEADER + 8 + 16;
/// Largest datagram sent or accepted: fits a 1500-byte path with IPv6 and UDP headers.
pub const DATAGRAM_MAX: usize = 1400;
/// Largest piece of the lane one datagram carries.
pub const PIECE_MAX: usize = DATAGRAM_MAX - OVERHEAD;
/// The label both ends export their keys under (RFC 5705 / RFC 8446 section 7.5).
pub const EXPORT_LABEL: &[u8] = b"EXPORTER-wanopt-lane-datagrams";
/// Bytes exported: one 32-byte key per direction.
pub const EXPORT_LEN: usize = 64;
/// Counters behind the highest seen that are still taken once (the replay window).
const WINDOW: u64 = 64;

/// Why a datagram was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DatagramError {
    /// Too short, too long, or not our kind.
    #[error("not a lane datagram")]
    Malformed,
    /// Names a lane that is not the current one.
    #[error("datagram of another lane")]
    OtherLane,
    /// Did not open under the lane's key: forged, damaged, or of an older session.
    #[error("datagram failed authentication")]
    Forged,
    /// Its counter was taken before (a copy sent again, or a replay) or is too old to tell.
    #[error("datagram seen before")]
    Duplicate,
}

/// The lane id a datagram names, read before anything is checked (to find the lane's keys).
pub fn lane_of(datagram: &[u8]) -> Option<u64> {
    if datagram.len() < OVERHEAD || datagram.len() > DATAGRAM_MAX || datagram[0] != KIND {
        return None;
    }
    let mut id = [0u8; 8];
    id.copy_from_slice(&datagram[1..9]);
    Some(u64::from_be_bytes(id))
}

/// The two keys of a lane, from the bytes both ends export from its first connection's TLS
/// session: the first half seals what the connecting side sends, the second what it receives.
pub fn keys(exported: &[u8; EXPORT_LEN], connecting: bool) -> ([u8; 32], [u8; 32]) {
    let mut a = [0u8; 32];
    let mut b = [0u8; 32];
    a.copy_from_slice(&exported[..32]);
    b.copy_from_slice(&exported[32..]);
    if connecting { (a, b) } else { (b, a) }
}

fn aead_key(bytes: &[u8; 32]) -> LessSafeKey {
    // invariant: a 32-byte key is what ChaCha20-Poly1305 takes.
    LessSafeKey::new(UnboundKey::new(&CHACHA20_POLY1305, bytes).expect("32-byte key"))
}

fn nonce(counter: u64) -> Nonce {
    let mut n = [0u8; NONCE_LEN];
    n[NONCE_LEN - 8..].copy_from_slice(&counter.to_be_bytes());
    Nonce::assume_unique_for_key(n)
}

/// Seals pieces of one lane in one direction.
pub struct Sealer {
    key: LessSafeKey,
    lane: u64,
    next: u64,
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sealer")
            .field("lane", &self.lane)
            .field("next", &self.next)
            .finish_non_exhaustive()
    }
}

impl Sealer {
    pub fn new(key: &[u8; 32], lane: u64) -> Self {
        Sealer {
            key: aead_key(key),
            lane,
            next: 1,
        }
    }

    /// Seals `bytes` at `offset` of the lane into datagrams of at most [`DATAGRAM_MAX`] bytes,
    /// each with a new counter; an empty `bytes` gives one empty datagram (it tells the peer
    /// where to send).
    pub fn seal(&mut self, offset: u64, bytes: &[u8]) -> Vec<Vec<u8>> {
        let mut out = Vec::with_capacity(bytes.len().div_ceil(PIECE_MAX).max(1));
        let mut at = 0;
        loop {
            let piece = &bytes[at..bytes.len().min(at + PIECE_MAX)];
            out.push(self.seal_one(offset + at as u64, piece));
            at += piece.len();
            if at >= bytes.len() {
                return out;
            }
        }
    }

    fn seal_one(&mut self, offset: u64, piece: &[u8]) -> Vec<u8> {
        let counter = self.next;
        self.next += 1;
        let mut d = Vec::with_capacity(OVERHEAD + piece.len());
        d.push(KIND);
        d.extend_from_slice(&self.lane.to_be_bytes());
        d.extend_from_slice(&counter.to_be_bytes());
        d.extend_from_slice(&offset.to_be_bytes());
        d.extend_from_slice(piece);
        let (head, body) = d.split_at_mut(HEADER);
        // invariant: sealing fails only past ChaCha20's 256 GiB per nonce; a piece is < 1400 B.
        let tag = self
            .key
            .seal_in_place_separate_tag(nonce(counter), Aad::from(&head[..]), body)
            .expect("a piece is far below the cipher's limit");
        d.extend_from_slice(tag.as_ref());
        d
    }
}

/// Opens the datagrams of one lane in one direction, each counter once.
pub struct Opener {
    key: LessSafeKey,
    lane: u64,
    /// Highest counter taken, and which of the [`WINDOW`] before it were taken (bit i:
    /// `highest - 1 - i`).
    highest: u64,
    seen: u64,
}

impl std::fmt::Debug for Opener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opener")
            .field("lane", &self.lane)
            .field("highest", &self.highest)
            .finish_non_exhaustive()
    }
}

impl Opener {
    pub fn new(key: &[u8; 32], lane: u64) -> Self {
        Opener {
            key: aead_key(key),
            lane,
            highest: 0,
            seen: 0,
        }
    }

    /// The lane this opener takes datagrams of.
    pub fn lane(&self) -> u64 {
        self.lane
    }

    /// Checks and opens `datagram` in place: its piece's offset in the lane and bytes. A
    /// datagram is authenticated before its counter is marked taken, so a forged one changes
    /// nothing. Returns whether it was the newest yet (the peer's address may be taken from it).
    pub fn open<'a>(
        &mut self,
        datagram: &'a mut [u8],
    ) -> Result<(u64, &'a [u8], bool), DatagramError> {
        let lane = lane_of(datagram).ok_or(DatagramError::Malformed)?;
        if lane != self.lane {
            return Err(DatagramError::OtherLane);
        }
        let mut c = [0u8; 8];
        c.copy_from_slice(&datagram[9..HEADER]);
        let counter = u64::from_be_bytes(c);
        if counter == 0 || self.taken(counter) {
            return Err(DatagramError::Duplicate);
        }
        let (head, body) = datagram.split_at_mut(HEADER);
        let plain = self
            .key
            .open_in_place(nonce(counter), Aad::from(&head[..]), body)
            .map_err(|_| DatagramError::Forged)?;
        // invariant: `lane_of` checked the length covers the offset and the tag.
        let (off, piece) = plain.split_at(8);
        let mut o = [0u8; 8];
        o.copy_from_slice(off);
        let newest = self.take(counter);
        Ok((u64::from_be_bytes(o), piece, newest))
    }

    fn taken(&self, counter: u64) -> bool {
        if counter > self.highest {
            return false;
        }
        if counter == self.highest {
            return true;
        }
        let back = self.highest - 1 - counter;
        back >= WINDOW || self.seen & (1 << back) != 0
    }

    /// Marks `counter` taken; true if it is the newest yet.
    fn take(&mut self, counter: u64) -> bool {
        if counter > self.highest {
            let shift = counter - self.highest;
            self.seen = if shift > WINDOW {
                0
            } else {
                // The old highest becomes bit `shift - 1`.
                let moved = if shift == WINDOW {
                    0
                } else {
                    self.seen << shift
                };
                if self.highest > 0 {
                    moved | (1 << (shift - 1))
                } else {
                    moved
                }
            };
            self.highest = counter;
            true
        } else {
            self.seen |= 1 << (self.highest - 1 - counter);
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn pair(lane: u64) -> (Sealer, Opener) {
        let k = [7u8; 32];
        (Sealer::new(&k, lane), Opener::new(&k, lane))
    }

    /// Pieces come back at their offsets, split at [`PIECE_MAX`], each datagram at most
    /// [`DATAGRAM_MAX`] bytes; the same datagram twice is taken once.
    #[test]
    fn pieces_open_at_their_offsets_once() {
        let (mut s, mut o) = pair(9);
        let bytes: Vec<u8> = (0..5000u32).map(|i| i as u8).collect();
        let ds = s.seal(100, &bytes);
        assert_eq!(ds.len(), 5000usize.div_ceil(PIECE_MAX));
        let mut back = Vec::new();
        for d in &ds {
            assert!(d.len() <= DATAGRAM_MAX);
            assert_eq!(lane_of(d), Some(9));
            let mut d1 = d.clone();
            let (off, piece, newest) = o.open(&mut d1).expect("opens");
            assert!(newest);
            assert_eq!(off, 100 + back.len() as u64);
            back.extend_from_slice(piece);
            let mut again = d.clone();
            assert_eq!(o.open(&mut again), Err(DatagramError::Duplicate));
        }
        assert_eq!(back, bytes);
        let empty = s.seal(7, &[]);
        assert_eq!(empty.len(), 1);
        let mut e = empty[0].clone();
        assert!(matches!(o.open(&mut e), Ok((7, p, true)) if p.is_empty()));
    }

    /// A flipped bit anywhere, another lane, another key, or garbage is refused, and a refused
    /// datagram does not spend its counter.
    #[test]
    fn damage_and_strangers_are_refused() {
        let (mut s, mut o) = pair(3);
        let d = s.seal(0, b"sync write").remove(0);
        for i in 0..d.len() {
            let mut bad = d.clone();
            bad[i] ^= 1;
            assert!(o.open(&mut bad).is_err(), "bit flipped in byte {i}");
        }
        let mut other = Sealer::new(&[7u8; 32], 4).seal(0, b"x").remove(0);
        assert_eq!(o.open(&mut other), Err(DatagramError::OtherLane));
        let mut forged = Sealer::new(&[8u8; 32], 3).seal(0, b"x").remove(0);
        assert_eq!(o.open(&mut forged), Err(DatagramError::Forged));
        for len in [0, 1, OVERHEAD - 1, DATAGRAM_MAX + 1] {
            let mut g = vec![KIND; len];
            assert_eq!(o.open(&mut g), Err(DatagramError::Malformed), "{len} bytes");
        }
        let mut good = d.clone();
        assert!(o.open(&mut good).is_ok(), "the counter was not spent");
    }

    /// The two ends' keys cross: what one seals the other opens.
    #[test]
    fn exported_keys_cross() {
        let exported: [u8; EXPORT_LEN] = std::array::from_fn(|i| i as u8);
        let (c_send, c_recv) = keys(&exported, true);
        let (l_send, l_recv) = keys(&exported, false);
        assert_eq!((c_send, c_recv), (l_recv, l_send));
        assert_ne!(c_send, c_recv);
    }

    proptest! {
        /// Counters in any order are each taken exactly once while within the window, and
        /// never taken again; one further back than the window is refused.
        #[test]
        fn every_counter_is_taken_at_most_once(order in proptest::collection::vec(1u64..300, 1..400)) {
            let (mut s, mut o) = pair(1);
            let sealed: Vec<Vec<u8>> = (1..300).map(|_| s.seal(0, b"p").remove(0)).collect();
            let mut taken = std::collections::HashSet::new();
            let mut highest = 0;
            for c in order {
                let mut d = sealed[(c - 1) as usize].clone();
                let r = o.open(&mut d);
                let fresh = !taken.contains(&c) && c + WINDOW >= highest;
                prop_assert_eq!(r.is_ok(), fresh, "counter {} highest {}", c, highest);
                if r.is_ok() {
                    taken.insert(c);
                    highest = highest.max(c);
                }
            }
        }
    }
}
