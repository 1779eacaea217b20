//! A sender's delta bases on a slow disk tier (see `common::SlowStore`): a chunk whose bases
//! are still being read waits for them, and the link gives its stream the next turn once the
//! store has read (`Link::store_ready`), instead of sending the chunk as a literal. Each test
//! ends by asserting that nothing leaked.

mod common;

use common::*;
use wanopt_codec::store::MemStore;

/// Sends `first` then `second` from a west whose store of bases keeps 256 KiB in memory in
/// front of a disk tier whose reads take `delay` of virtual time; returns west's counts for
/// the second and the reads that waited.
fn changed_copy_over_a_slow_tier(
    first: &Bytes,
    second: &Bytes,
    delay: Duration,
) -> (CodecCount, u64) {
    let reads = Arc::new(Mutex::new(SlowReads::default()));
    let storage = Arc::new(TestStorage::default());
    *storage.slow.lock().expect("lock") = Some(reads.clone());
    let tier = Box::new(SlowStore {
        inner: MemStore::new(1 << 20),
        reads: reads.clone(),
    });
    let bases = wanopt_codec::delta::shared_tiered(256 << 10, 64 << 20, tier);
    let settings = || CodecSettings {
        cache_bytes: 64 << 20,
        service_cache_bytes: 32 << 20,
        delta_bytes: 64 << 20,
        ..CodecSettings::default()
    };
    let mut p = Pair::with(
        Duration::from_millis(20),
        50_000_000,
        |c| {
            c.codec = Some(settings());
            c.delta_bases = bases;
        },
        |c| c.codec = Some(settings()),
    );
    // The harness finishes the tier's reads after `delay` and tells west's link.
    p.west.storage = Some(storage);
    p.west.store_delay = delay;
    p.drive(Duration::from_secs(1));
    assert!(p.west.app.up && p.east.app.up);
    p.west.link.set_pressure(Pressure::LinkBound);
    send_once(&mut p, "e-svc", Class::Bulk, first);
    counts(&mut p.west.link);
    // Exact (send_once checks every byte) however long the chunks waited.
    send_once(&mut p, "e-svc", Class::Bulk, second);
    let c = counts(&mut p.west.link);
    p.assert_no_leaks();
    let waited = reads.lock().expect("lock").pending;
    (c, waited)
}

/// Without the wait (every chunk going with the bases at hand) all 752 changed blocks went as
/// literals here, 3.09 MB on the wire; with it, 743 went as deltas and the copy cost 95 KB.
#[test]
fn chunks_wait_for_the_bases_a_slow_disk_tier_is_reading() {
    // 8 MiB: the first copy has left the 256 KiB of memory by the time the second comes.
    let (first, second) = changed_rows(1024);
    for delay in [Duration::from_millis(2), Duration::from_millis(30)] {
        let (c, waited) = changed_copy_over_a_slow_tier(&first, &second, delay);
        let s = &c.sent;
        assert!(waited > 100, "{delay:?}: {waited} reads waited");
        // The pauses are counted (what `wanopt_delta_base_waits_total` shows), and a waiting
        // stream comes round again when the store has read, not with every new byte the
        // application writes (that took 2,026 waits for 742 deltas here; now 1.3-1.5 a delta).
        assert!(s.base_waits > 0, "{delay:?}: {s:?}");
        assert!(
            s.base_waits < 2 * s.delta_chunks,
            "{delay:?}: {} waits for {} deltas",
            s.base_waits,
            s.delta_chunks
        );
        // Every changed block has its earlier version as a base, read from the disk tier.
        assert!(
            s.delta_bytes * 100 >= second.len() as u64 * 90,
            "{delay:?}: {} of {} bytes as deltas",
            s.delta_bytes,
            second.len()
        );
        assert!(
            s.no_base_bytes * 20 <= second.len() as u64,
            "{delay:?}: {} bytes went as literals with a base offered",
            s.no_base_bytes
        );
        assert!(
            s.wire_bytes * 20 < second.len() as u64,
            "{delay:?}: {} wire bytes for {}",
            s.wire_bytes,
            second.len()
        );
    }
}
