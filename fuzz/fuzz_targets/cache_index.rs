//! Fuzzes the saved cache index (read back from disk at start): arbitrary bytes must parse to an
//! error or to a snapshot that re-encodes to the same bytes, and restoring one into a cache with
//! a (damaged, in-memory) disk tier must never panic or return wrong bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use wanopt_codec::cache::{ChunkCache, Snapshot, fingerprint};
use wanopt_codec::store::{ChunkStore, MemStore};

fuzz_target!(|data: &[u8]| {
    // The input as it is, and with a valid checksum appended so the parser behind it is reached.
    let mut sealed = data.to_vec();
    sealed.extend_from_slice(blake3::hash(data).as_bytes());
    for input in [data, &sealed[..]] {
        if let Ok(snap) = Snapshot::decode(input) {
            assert_eq!(snap.encode(), input);
            check(&snap);
        }
    }
});

fn check(snap: &Snapshot) {
    let mut store = MemStore::new(1 << 20);
    for i in 0..8u8 {
        let d = vec![i; 100 + usize::from(i)];
        let _ = store.append(&fingerprint(&d), &d);
    }
    // As a mirror: the same index, the same digest.
    let mut m = ChunkCache::new(usize::try_from(snap.capacity).unwrap_or(usize::MAX));
    if m.restore(snap).is_ok() {
        assert_eq!(m.digest(), snap.digest());
    }
    // As a decoder with a disk tier of the same capacity (three quarters of its limit).
    let limit = (snap.capacity / 3).saturating_mul(4);
    let mut c = ChunkCache::tiered(1 << 16, limit, Box::new(store));
    if c.restore(snap).is_ok() {
        for e in &snap.entries {
            if let Some(got) = c.get(&e.fingerprint) {
                assert_eq!(fingerprint(got), e.fingerprint);
            }
        }
    }
}
