//! A chunk's name: the first 16 bytes (128 bits) of its BLAKE3 hash. The cache, the stores and
//! both ends of the codec name chunks by it, and every chunk read back is checked against it.

/// A chunk fingerprint: the first 16 bytes (128 bits) of its BLAKE3 hash.
pub type Fingerprint = [u8; 16];

/// The hash state of the maps and sets keyed by fingerprints: foldhash, seeded at random per
/// map. A fingerprint is BLAKE3 of bytes a peer or a client chooses, so its low bits can be
/// ground to collide in an unkeyed table; keyed, they cannot be aimed. It costs a few
/// multiplies where SipHash-1-3 ran its rounds over the length and the 16 bytes, on every
/// lookup of the link's thread (the cache, the mirror's log, the turn's seen chunks).
pub type FpState = foldhash::fast::RandomState;
/// A map keyed by fingerprints (see [`FpState`]).
pub type FpMap<V> = std::collections::HashMap<Fingerprint, V, FpState>;
/// A set of fingerprints (see [`FpState`]).
pub type FpSet = std::collections::HashSet<Fingerprint, FpState>;

/// The fingerprint of `data`.
pub fn fingerprint(data: &[u8]) -> Fingerprint {
    let h = blake3::hash(data);
    let mut f = [0u8; 16];
    f.copy_from_slice(&h.as_bytes()[..16]);
    f
}

/// What a delta run record carries in place of its chunks' names: the fingerprint of their
/// fingerprints in order. The receiver computes each rebuilt chunk's (to cache it) and checks
/// them all at once: 16 bytes a run instead of 16 a chunk (on the changed `pgbench` copy's
/// 35,000 deltas, 0.55 MB of 3.7).
pub(crate) fn run_check<'a>(names: impl Iterator<Item = &'a Fingerprint>) -> Fingerprint {
    // Its own hash (BLAKE3's key derivation mode): the names of a run, re-sent by their check
    // after a miss, must never pass for a chunk of the same bytes.
    let mut h = blake3::Hasher::new_derive_key("wanopt 2026 run check");
    for f in names {
        h.update(f);
    }
    let mut c = [0u8; 16];
    c.copy_from_slice(&h.finalize().as_bytes()[..16]);
    c
}

/// Bytes of a run's check a short reference run (`TAG_REF_RUN_SHORT`) carries. Its names come
/// from the receiver's log, built from records both sides saw: the check only confirms that
/// the two logs agree, which 64 bits do for any run a link will carry (the chunks' bytes are
/// still checked against their own fingerprints). Half the check took 8 of a reference run's
/// 21 bytes: on kernel sources, where a run ends at every edited chunk and every frame, 20 KB
/// of a changed copy's 150.
pub(crate) const SHORT_CHECK: usize = 8;
/// What fills the rest of a short check's key (see [`short_key`]).
const SHORT_MARK: [u8; 8] = *b"refrun8\0";

/// The key a short check is asked for and answered by: its 8 bytes and a fixed mark.
pub(crate) fn short_key(check: &[u8]) -> Fingerprint {
    let mut k = [0u8; 16];
    let n = check.len().min(SHORT_CHECK);
    k[..n].copy_from_slice(&check[..n]);
    k[SHORT_CHECK..].copy_from_slice(&SHORT_MARK);
    k
}

/// True if `names` are the run that `key` checks: their whole run check, or a short check's
/// key (see [`short_key`]) that holds its first bytes.
pub(crate) fn check_matches<'a>(
    names: impl Iterator<Item = &'a Fingerprint>,
    key: &Fingerprint,
) -> bool {
    let c = run_check(names);
    c == *key || (key[SHORT_CHECK..] == SHORT_MARK && c[..SHORT_CHECK] == key[..SHORT_CHECK])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_maps_hash_with_a_key_of_their_own() {
        use std::hash::BuildHasher;
        // Fingerprints whose bytes agree but for one bit, as a peer grinding BLAKE3 could
        // choose: each map's own random seed places them apart, and no two maps alike.
        let f = fingerprint(b"redo");
        let mut g = f;
        g[15] ^= 1;
        let states: Vec<FpState> = (0..8).map(|_| FpState::default()).collect();
        let of = |s: &FpState, f: &Fingerprint| s.hash_one(f);
        for (i, a) in states.iter().enumerate() {
            assert_ne!(of(a, &f), of(a, &g));
            for b in &states[i + 1..] {
                assert_ne!(of(a, &f), of(b, &f), "two maps hash a fingerprint alike");
            }
        }
        let mut m: FpMap<u32> = FpMap::default();
        m.insert(f, 1);
        m.insert(g, 2);
        assert_eq!((m.get(&f), m.get(&g)), (Some(&1), Some(&2)));
    }

    #[test]
    fn a_fingerprint_is_the_head_of_the_blake3_hash() {
        let f = fingerprint(b"redo");
        assert_eq!(&f[..], &blake3::hash(b"redo").as_bytes()[..16]);
        assert_ne!(f, fingerprint(b"redo "));
        // A run's check is not the fingerprint of its names' bytes.
        let names = [f, fingerprint(b"undo")];
        assert_ne!(run_check(names.iter()), fingerprint(&names.concat()));
        assert_ne!(run_check(names.iter()), run_check(names.iter().rev()));
        // A short check's key matches its names, and only them.
        let key = short_key(&run_check(names.iter()));
        assert!(check_matches(names.iter(), &key));
        assert!(check_matches(names.iter(), &run_check(names.iter())));
        assert!(!check_matches(names.iter().rev(), &key));
        assert!(!check_matches(names[..1].iter(), &key));
    }
}
