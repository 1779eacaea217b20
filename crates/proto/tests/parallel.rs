//! Streams of one copy sent side by side through a shared cache and delta store, as a backup
//! tool's parallel channels do: a chunk one stream sends may be another stream's reference or
//! base a moment later, while the receiver has the first stream stalled on a disk read. Each
//! test ends by asserting that nothing leaked.

mod common;

use common::*;

/// A pair whose east keeps 256 KiB of its cache in memory in front of a disk tier whose reads
/// take `delay` of virtual time, so its streams stall on reads of earlier copies' chunks.
fn slow_receiver(delay: Duration) -> Pair {
    slow_receiver_with(delay, 256 << 20)
}

/// [`slow_receiver`] with a disk tier of `disk` bytes.
fn slow_receiver_with(delay: Duration, disk: u64) -> Pair {
    let storage = Arc::new(TestStorage::default());
    *storage.slow.lock().expect("lock") = Some(Arc::new(Mutex::new(SlowReads::default())));
    let settings = || CodecSettings {
        cache_bytes: 256 << 10,
        disk_bytes: disk,
        service_cache_bytes: 256 << 10,
        service_disk_bytes: 64 << 20,
        delta_bytes: 64 << 20,
        ..CodecSettings::default()
    };
    let west = Arc::new(TestStorage::default());
    let (w, e) = (west.clone(), storage.clone());
    let mut p = Pair::with(
        Duration::from_millis(20),
        50_000_000,
        |c| {
            c.codec = Some(settings());
            c.cache_storage = Some(w);
        },
        |c| {
            c.codec = Some(settings());
            c.cache_storage = Some(e);
        },
    );
    p.west.storage = Some(west);
    p.east.storage = Some(storage);
    p.east.store_delay = delay;
    p.drive(Duration::from_secs(1));
    assert!(p.west.app.up && p.east.app.up);
    p.west.link.set_pressure(Pressure::LinkBound);
    p
}

/// Sends each of `parts` west→east on a stream of its own, all at once, and checks every byte.
fn send_side_by_side(p: &mut Pair, parts: &[Vec<u8>]) -> Vec<StreamId> {
    let ids = send_all(p, parts);
    for (i, (id, d)) in ids.iter().zip(parts).enumerate() {
        assert!(
            !p.east.app.resets.iter().any(|(r, _)| r == id)
                && !p.west.app.resets.iter().any(|(r, _)| r == id),
            "stream {i} was reset: {:?} {:?}",
            p.east.app.resets,
            p.west.app.resets
        );
        let got = p.east.app.received.get(id).map_or(0, Vec::len);
        assert!(
            p.east.app.received.get(id).is_some_and(|r| r[..] == d[..]),
            "stream {i}: {got} of {} bytes, or they differ",
            d.len()
        );
        assert!(p.east.app.fin.contains(id));
        p.east.app.to_send.insert(*id, (Bytes::new(), true));
    }
    p.drive(Duration::from_secs(5));
    ids
}

/// Opens a stream west→east for each of `parts`, all at once, and drives the pair until quiet.
fn send_all(p: &mut Pair, parts: &[Vec<u8>]) -> Vec<StreamId> {
    let ids = parts
        .iter()
        .map(|d| open_and_send(p, "e-svc", Class::Bulk, Bytes::from(d.clone())))
        .collect();
    p.drive(Duration::from_secs(120));
    ids
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]
    /// Copies in any number of streams side by side, over disk tiers of any speed and size,
    /// damaged or not between the copies (then references and bases miss, and are asked for):
    /// every stream arrives exact or is reset as lost, never with a wrong byte, and nothing
    /// leaks.
    #[test]
    fn parallel_copies_are_exact_or_reset(
        streams in 2usize..5,
        changed in 1usize..5,
        blocks in 32usize..256,
        delay_ms in 0u64..60,
        disk in prop_oneof![Just(2u64 << 20), Just(256u64 << 20)],
        damage in any::<bool>(),
    ) {
        let mut p = slow_receiver_with(Duration::from_millis(delay_ms), disk);
        let (first, second) =
            wanopt_codec::testdata::parallel_copies(streams, changed.min(streams), blocks);
        for (i, parts) in [&first, &second].into_iter().enumerate() {
            if i == 1 && damage && let Some(st) = p.east.storage.as_ref() {
                st.mem(0, "").corrupt_all();
            }
            let ids = send_all(&mut p, parts);
            for (id, d) in ids.iter().zip(parts.iter()) {
                let reset = p.east.app.resets.iter().any(|(r, _)| r == id)
                    || p.west.app.resets.iter().any(|(r, _)| r == id);
                let got = p.east.app.received.get(id).cloned().unwrap_or_default();
                if reset {
                    // What did arrive is the stream's beginning, exactly.
                    prop_assert!(d.starts_with(&got));
                } else {
                    prop_assert!(got == *d, "{} of {} bytes", got.len(), d.len());
                    prop_assert!(p.east.app.fin.contains(id));
                    p.east.app.to_send.insert(*id, (Bytes::new(), true));
                }
            }
            p.drive(Duration::from_secs(5));
        }
        p.assert_no_leaks();
    }
}

/// A changed copy in three streams side by side, after its first copy in four: each stream's
/// old blocks are deltas against bases east reads from its disk (stalling that stream), and
/// its new blocks are near copies of another stream's new blocks sent a moment before, so
/// they are deltas (and references) against chunks in frames east has not decoded yet.
/// Every stream arrives exact, and no chunk has to be asked for.
#[test]
fn a_changed_copy_in_parallel_streams_arrives_exact() {
    for delay in [Duration::from_millis(5), Duration::from_millis(40)] {
        let mut p = slow_receiver(delay);
        let (first, changed) = wanopt_codec::testdata::parallel_copies(4, 3, 768);
        send_side_by_side(&mut p, &first);
        counts(&mut p.west.link);
        send_side_by_side(&mut p, &changed);
        let c = counts(&mut p.west.link);
        let total: usize = changed.iter().map(Vec::len).sum();
        // The copy still pays: most of it went as deltas against what east holds.
        assert!(
            c.sent.wire_bytes * 5 < total as u64,
            "{delay:?}: {} wire bytes for {total}: {:?}",
            c.sent.wire_bytes,
            c.sent
        );
        // No chunk was missed: each stream waited for the frames ahead of its own, not for
        // the peer (236 chunks were asked for and re-sent here when streams asked at once).
        let e = counts(&mut p.east.link);
        assert_eq!((e.needs, c.resent), (0, 0), "{delay:?}: chunks asked for");
        p.assert_no_leaks();
    }
}

/// The receiver's disk tier reads every chunk of the first copy back damaged, so the changed
/// copy's references and bases miss and are asked for while other streams go on: the sender
/// answers every one (from the chunks it keeps to answer, or its store of bases), and every
/// stream arrives exact. (The property test above allows a reset; this case must not need one.)
#[test]
fn a_changed_copy_after_the_receiver_lost_its_disk_arrives_exact() {
    let mut p = slow_receiver(Duration::from_millis(5));
    let (first, changed) = wanopt_codec::testdata::parallel_copies(4, 3, 256);
    send_side_by_side(&mut p, &first);
    counts(&mut p.west.link);
    counts(&mut p.east.link);
    p.east
        .storage
        .as_ref()
        .expect("east's disk tier")
        .mem(0, "")
        .corrupt_all();
    send_side_by_side(&mut p, &changed);
    let (e, w) = (counts(&mut p.east.link), counts(&mut p.west.link));
    assert!(e.needs > 0, "the damaged chunks were asked for");
    assert_eq!(w.resent, e.needs, "and every one was answered");
    p.assert_no_leaks();
}
