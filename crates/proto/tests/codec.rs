//! The codec on paired links (see `common`): compression, dedup, long contexts, deltas,
//! misses answered, and caches resumed from storage. Each test ends by asserting that nothing
//! leaked.

mod common;

use common::*;

fn codec(cache: u64) -> CodecSettings {
    CodecSettings {
        cache_bytes: cache,
        service_cache_bytes: cache / 2,
        ..CodecSettings::default()
    }
}

/// A pair whose both sides optimize, with the given shared cache size.
fn coded_pair(cache: u64, laned: bool) -> Pair {
    let mut p = coded_pair_starting(cache);
    p.drive(Duration::from_secs(1));
    assert!(p.west.app.up && p.east.app.up);
    if laned {
        assert!(p.east.link.attach_lane(7) && p.west.link.attach_lane(7));
    }
    p
}

/// [`coded_pair`] before the hellos are exchanged (policies set now shape the scopes).
fn coded_pair_starting(cache: u64) -> Pair {
    coded_pair_with(cache, |_| {})
}

/// [`coded_pair_starting`] with `more` set on both sides' configs.
fn coded_pair_with(cache: u64, more: impl Fn(&mut LinkConfig)) -> Pair {
    let side = |c: &mut LinkConfig, token| {
        c.codec = Some(codec(cache));
        c.token = token;
        more(c);
    };
    Pair::with(
        Duration::from_millis(20),
        50_000_000,
        |c| side(c, 0),
        |c| side(c, 7),
    )
}

/// A coded pair, up, whose west (set up by `west`) sends link-bound to an east with `east`.
fn link_bound_pair(west: impl FnOnce(&mut LinkConfig), east: CodecSettings) -> Pair {
    let mut p = Pair::with(Duration::from_millis(20), 50_000_000, west, move |c| {
        c.codec = Some(east)
    });
    p.drive(Duration::from_secs(1));
    assert!(p.west.app.up && p.east.app.up);
    p.west.link.set_pressure(Pressure::LinkBound);
    p
}

/// West's store of delta bases, as its cache stats report it.
fn bases_stat(p: &Pair) -> Option<wanopt_proto::CacheStat> {
    p.west
        .link
        .cache_stats()
        .into_iter()
        .find(|s| s.role == "bases")
}

/// West sends `data` to east on a link-bound coded pair, each side with its own codec
/// settings; returns the wire bytes.
fn send_between(west: CodecSettings, east: CodecSettings, data: &Bytes) -> u64 {
    let mut p = link_bound_pair(|c| c.codec = Some(west), east);
    let wire = send_once(&mut p, "e-svc", Class::Bulk, data);
    p.assert_no_leaks();
    wire
}

/// [`send_between`] with these long contexts on each side (`None`: a build without them).
fn send_with_long(
    west: Option<wanopt_proto::LongContext>,
    east: Option<wanopt_proto::LongContext>,
    data: &Bytes,
) -> u64 {
    let side = |long_context| CodecSettings {
        long_context,
        ..codec(64 << 20)
    };
    send_between(side(west), side(east), data)
}

/// `n` order rows: number, order, customer, item, quantity and status, each field after its
/// separator in `sep` (rows whose repeats lie further apart than a chunk).
fn order_rows(n: u32, sep: [&str; 5]) -> Bytes {
    (0..n)
        .flat_map(|i| {
            format!(
                "{:08}{}{:06}{}{:05}{}{:04}{}{:03}{}{}\n",
                i,
                sep[0],
                (i * 7919) % 1_000_000,
                sep[1],
                (i * 31) % 40_000,
                sep[2],
                (i * 17) % 5000,
                sep[3],
                i % 97,
                sep[4],
                ["NEW", "PAID", "SHIPPED", "CLOSED"][(i % 4) as usize]
            )
            .into_bytes()
        })
        .collect::<Vec<u8>>()
        .into()
}

#[test]
fn long_contexts_are_used_only_toward_a_peer_that_offers_them() {
    // Rows whose repeats lie further apart than a chunk: what a long context is for.
    let data = order_rows(
        200_000,
        [" ORDER ", " customer-", " item ", " qty ", " status "],
    );
    let long = Some(wanopt_proto::LongContext::default());
    let both = send_with_long(long, long, &data);
    let old_receiver = send_with_long(long, None, &data);
    let old_sender = send_with_long(None, long, &data);
    // Exact every way (send_once checks); a side without them gets chunks compressed alone.
    assert_eq!(old_receiver, old_sender, "the same encoding either way");
    assert!(
        both * 10 < old_receiver * 8,
        "long contexts: {both} wire bytes, chunks alone: {old_receiver} (of {})",
        data.len()
    );
}

/// [`send_between`] at level 9 with runs offered or not on each side (`false`: a build
/// without them).
fn send_with_runs(west: bool, east: bool, data: &Bytes) -> u64 {
    let side = |runs| CodecSettings {
        runs,
        zstd_level: 9,
        ..codec(64 << 20)
    };
    send_between(side(west), side(east), data)
}

#[test]
fn runs_of_literals_share_a_flush_only_toward_a_peer_that_decodes_them() {
    // Rows that compress well in a long context, in chunks that each end a record.
    let data = order_rows(150_000, ["|", "|customer-", "|", "|", "|"]);
    let both = send_with_runs(true, true, &data);
    let old_receiver = send_with_runs(true, false, &data);
    let old_sender = send_with_runs(false, true, &data);
    // Exact every way (send_once checks); with a side without them, a flush per chunk.
    assert_eq!(old_receiver, old_sender, "the same encoding either way");
    assert!(
        both < old_receiver,
        "runs: {both} wire bytes, a flush per chunk: {old_receiver} (of {})",
        data.len()
    );
}

/// Sends `first`, then `second` on a new stream, west to east with deltas on or off on each
/// side; returns the wire bytes of the second and west's delta chunks.
fn send_with_delta(west: bool, east: bool, first: &Bytes, second: &Bytes) -> (u64, u64) {
    let on = |on: bool| CodecSettings {
        delta_bytes: if on { 64 << 20 } else { 0 },
        ..codec(64 << 20)
    };
    let mut p = link_bound_pair(move |c| c.codec = Some(on(west)), on(east));
    send_once(&mut p, "e-svc", Class::Bulk, first);
    let wire = send_once(&mut p, "e-svc", Class::Bulk, second);
    let deltas = counts(&mut p.west.link).sent.delta_chunks;
    p.assert_no_leaks();
    (wire, deltas)
}

#[test]
fn deltas_are_used_only_when_both_sides_offer_them() {
    let (first, second) = changed_rows(256);
    let (both, deltas) = send_with_delta(true, true, &first, &second);
    let (old_receiver, none_a) = send_with_delta(true, false, &first, &second);
    let (old_sender, none_b) = send_with_delta(false, true, &first, &second);
    // Exact every way (send_once checks); a side without them gets literals as before.
    assert_eq!((none_a, none_b), (0, 0));
    assert_eq!(old_receiver, old_sender, "the same encoding either way");
    assert!(deltas >= 100, "{deltas} chunks as deltas");
    assert!(
        both * 5 < old_receiver,
        "deltas: {both} wire bytes, literals: {old_receiver} (of {})",
        second.len()
    );
}

#[test]
fn the_delta_store_stays_within_its_bytes_over_a_long_run() {
    let store = 1 << 20;
    let mut p = link_bound_pair(
        move |c| {
            c.codec = Some(CodecSettings {
                delta_bytes: store,
                ..codec(64 << 20)
            })
        },
        codec(64 << 20),
    );
    let bases = |p: &Pair| bases_stat(p).expect("a store of bases");
    // Versions of the same blocks, each a little changed: every copy has bases to find.
    let mut v = db_blocks(96, 5).to_vec();
    for round in 0..12 {
        for b in 0..96 {
            v[b * 8192 + 100 + round * 13] ^= 0x41;
        }
        send_once(&mut p, "e-svc", Class::Bulk, &Bytes::from(v.clone()));
        let s = bases(&p);
        assert!(s.bytes <= store, "round {round}: {} bytes held", s.bytes);
    }
    assert!(bases(&p).evictions > 0, "the store went round");
    assert!(counts(&mut p.west.link).sent.delta_chunks > 0);
    p.assert_no_leaks();
}

#[test]
fn a_store_of_bases_given_by_the_runtime_outlives_the_link() {
    let store = wanopt_codec::delta::shared(8 << 20);
    let link = |store: &Option<wanopt_codec::SharedBases>| {
        let store = store.clone();
        link_bound_pair(
            move |c| {
                c.codec = Some(codec(64 << 20));
                c.delta_bases = store;
            },
            codec(64 << 20),
        )
    };
    let held = |p: &Pair| bases_stat(p).map(|s| s.bytes);
    let mut first = link(&store);
    assert_eq!(held(&first), Some(0));
    send_once(&mut first, "e-svc", Class::Bulk, &db_blocks(64, 3));
    let kept = held(&first).expect("a store");
    assert!(kept > 0);
    first.assert_no_leaks();
    drop(first);
    // The next connection starts with what the first sent.
    let second = link(&store);
    assert_eq!(held(&second), Some(kept));
}

/// 8 KiB database-like blocks: compressible rows with varying keys.
fn db_blocks(n: usize, seed: u64) -> Bytes {
    let mut v = Vec::with_capacity(n * 8192);
    for b in 0..n as u64 {
        let start = v.len();
        v.extend_from_slice(&(b ^ seed).to_be_bytes());
        let mut r = 0;
        while v.len() - start < 7000 {
            r += 1;
            v.extend_from_slice(
                format!(
                    "ORD|{:08}|C{:05}|Q{:03}|OPEN|",
                    b * 100 + r,
                    (r * 7919 + seed) % 50_000,
                    r % 100
                )
                .as_bytes(),
            );
        }
        v.resize(start + 8192, 0);
    }
    v.into()
}

#[test]
fn coded_bulk_compresses_and_a_repeat_is_nearly_free() {
    let mut p = coded_pair(64 << 20, false);
    let data = db_blocks(512, 1);
    let first = send_once(&mut p, "e-svc", Class::Bulk, &data);
    let c = counts(&mut p.west.link);
    assert_eq!(c.sent.raw_bytes, data.len() as u64);
    assert!(
        first * 2 < data.len() as u64,
        "db-like data compressed to {first} of {}",
        data.len()
    );
    let second = send_once(&mut p, "e-svc", Class::Bulk, &data);
    assert!(second * 100 < first * 3, "repeat cost {second} vs {first}");
    let c = counts(&mut p.west.link);
    assert!(c.sent.hit_bytes * 100 > c.sent.raw_bytes * 97);
    assert_eq!(
        counts(&mut p.east.link).needs,
        0,
        "caches in step: no misses"
    );
    p.assert_no_leaks();
}

#[test]
fn incompressible_data_grows_by_at_most_a_thousandth() {
    let mut p = coded_pair(64 << 20, false);
    let data = pattern(77, 4 << 20);
    let wire = send_once(&mut p, "e-svc", Class::Bulk, &data);
    assert!(
        wire as f64 <= data.len() as f64 * 1.001,
        "{wire} wire bytes for {}",
        data.len()
    );
    p.assert_no_leaks();
}

/// Both sides as on a WAN link: zstd, in each stream's context.
fn link_bound(p: &mut Pair) {
    p.west.link.set_pressure(Pressure::LinkBound);
    p.east.link.set_pressure(Pressure::LinkBound);
}

#[test]
fn a_miss_is_asked_for_and_resent_never_misread() {
    for wan in [false, true] {
        a_miss_is_resent(wan);
    }
}

fn a_miss_is_resent(wan: bool) {
    let mut p = coded_pair(64 << 20, false);
    if wan {
        link_bound(&mut p);
    }
    let known = db_blocks(256, 2);
    send_once(&mut p, "e-svc", Class::Bulk, &known);
    // East's memory goes bad: every chunk it holds is damaged.
    assert!(p.east.link.corrupt_caches_for_test() > 0);
    let _ = counts(&mut p.east.link);
    // The damaged chunks (references that miss) between new ones (literals, in the stream's
    // context when link-bound): the stalled stream resumes in step with its context.
    let mut v = Vec::new();
    for i in 0..16 {
        v.extend_from_slice(&known[i * 64 * 1024..(i + 1) * 64 * 1024]);
        v.extend_from_slice(&db_blocks(4, 100 + i as u64));
    }
    send_once(&mut p, "e-svc", Class::Bulk, &Bytes::from(v));
    let east = counts(&mut p.east.link);
    let west = counts(&mut p.west.link);
    assert!(east.needs > 0, "the damaged chunks were asked for");
    assert_eq!(west.resent, east.needs, "and re-sent");
    p.assert_no_leaks();
}

/// Live writes flushed one by one (their tails compressed in the stream's zstd context) queue
/// behind references that miss: the stalled stream resumes in step with its context.
#[test]
fn flushed_writes_in_context_resume_after_a_miss() {
    let mut p = coded_pair(64 << 20, false);
    link_bound(&mut p);
    let known = db_blocks(256, 2);
    send_once(&mut p, "e-svc", Class::Bulk, &known);
    assert!(p.east.link.corrupt_caches_for_test() > 0);
    let _ = counts(&mut p.east.link);
    let id = p.west.link.open("e-svc", Class::Bulk).expect("open");
    p.west.app.received.entry(id).or_default();
    let mut want = Vec::new();
    for i in 0..16 {
        for piece in [
            known.slice(i * 64 * 1024..(i + 1) * 64 * 1024),
            db_blocks(1, 500 + i as u64).slice(..1500 + i * 37),
        ] {
            let mut at = 0;
            while at < piece.len() {
                at += p.west.link.write(id, &piece[at..]).expect("write");
                p.drive(Duration::from_millis(2));
            }
            assert!(p.west.link.flush(id));
            want.extend_from_slice(&piece);
        }
        p.drive(Duration::from_millis(5));
    }
    p.west.app.to_send.insert(id, (Bytes::new(), true));
    p.drive(Duration::from_secs(30));
    assert!(p.east.app.received[&id] == want[..], "bytes differ");
    assert!(
        counts(&mut p.east.link).needs > 0,
        "the damaged chunks were asked for"
    );
    p.east.app.to_send.insert(id, (Bytes::new(), true));
    p.drive(Duration::from_secs(5));
    p.assert_no_leaks();
}

#[test]
fn evictions_under_a_tiny_cache_stay_in_step() {
    let mut p = coded_pair(256 * 1024, false);
    let base = db_blocks(64, 3);
    for round in 0..4u64 {
        let mut v = base.to_vec();
        v.extend_from_slice(&pattern(round, 300_000));
        v.extend_from_slice(&base[..100_000]);
        send_once(&mut p, "e-svc", Class::Bulk, &Bytes::from(v));
    }
    assert_eq!(
        counts(&mut p.east.link).needs,
        0,
        "no misses: mirror and cache agree"
    );
    let stats = p.west.link.cache_stats();
    let mirror = stats.iter().find(|s| s.role == "mirror").expect("a mirror");
    assert!(mirror.evictions > 0 && mirror.bytes <= 256 * 1024);
    let dec = p.east.link.cache_stats();
    let dec = dec.iter().find(|s| s.role == "decoder").expect("a decoder");
    assert_eq!((dec.bytes, dec.evictions), (mirror.bytes, mirror.evictions));
    p.assert_no_leaks();
}

#[test]
fn latency_streams_never_wait_for_a_chunk_boundary() {
    for laned in [false, true] {
        let mut p = coded_pair(16 << 20, laned);
        let id = p.west.link.open("e-lat", Class::Latency).expect("open");
        p.west.app.received.entry(id).or_default();
        let mut want = Vec::new();
        for i in 0..20u64 {
            let msg = db_blocks(1, i).slice(..300 + i as usize * 97);
            want.extend_from_slice(&msg);
            // Written without fin or flush: it must arrive anyway.
            let _ = p.west.link.write(id, &msg).expect("write");
            p.drive(Duration::from_millis(100));
            assert!(p.east.app.received[&id] == want[..], "message {i} waited");
        }
        p.west.app.to_send.insert(id, (Bytes::new(), true));
        p.east.app.to_send.insert(id, (Bytes::new(), true));
        p.drive(Duration::from_secs(2));
        p.assert_no_leaks();
    }
}

#[test]
fn dedup_off_and_service_scope_keep_caches_apart() {
    let mut p = coded_pair_starting(16 << 20);
    p.west.link.set_policies([
        (
            "e-svc",
            StreamPolicy {
                compression: Compression::Lz4,
                dedup: false,
                scope: Scope::Link,
            },
        ),
        (
            "e-lat",
            StreamPolicy {
                compression: Compression::Zstd,
                dedup: true,
                scope: Scope::Service,
            },
        ),
    ]);
    p.drive(Duration::from_secs(1));
    let data = db_blocks(64, 4);
    send_once(&mut p, "e-svc", Class::Bulk, &data);
    let again = send_once(&mut p, "e-svc", Class::Bulk, &data);
    assert!(
        again > data.len() as u64 / 10,
        "dedup off: the repeat is sent again"
    );
    assert!(
        p.east.link.cache_stats().iter().all(|s| s.bytes == 0),
        "nothing cached"
    );
    send_once(&mut p, "e-lat", Class::Bulk, &data);
    let scoped = send_once(&mut p, "e-lat", Class::Bulk, &data);
    assert!(
        scoped * 20 < again,
        "a service's own cache dedups its repeats"
    );
    let stats = p.east.link.cache_stats();
    assert!(stats.iter().any(|s| &*s.scope == "e-lat" && s.bytes > 0));
    assert!(stats.iter().all(|s| !s.scope.is_empty() || s.bytes == 0));
    p.assert_no_leaks();
}

#[test]
fn scopes_are_agreed_in_the_hellos_and_hold_both_ways() {
    // Only east's policy gives e-svc a cache of its own: both directions use it.
    let mut p = coded_pair_starting(16 << 20);
    let own = StreamPolicy {
        scope: Scope::Service,
        ..StreamPolicy::default()
    };
    p.east.link.set_policies([("e-svc", own)]);
    p.drive(Duration::from_secs(1));
    let data = db_blocks(64, 6);
    let id = open_and_send(&mut p, "e-svc", Class::Bulk, data.clone());
    p.west.app.received.entry(id).or_default();
    p.drive(Duration::from_secs(30));
    p.east.app.to_send.insert(id, (data.clone(), true));
    p.drive(Duration::from_secs(30));
    assert!(p.east.app.received[&id] == data[..] && p.west.app.received[&id] == data[..]);
    for side in [&p.west, &p.east] {
        let stats = side.link.cache_stats();
        assert!(
            stats
                .iter()
                .any(|s| &*s.scope == "e-svc" && s.role == "decoder" && s.bytes > 0),
            "{stats:?}"
        );
        assert!(stats.iter().all(|s| !s.scope.is_empty() || s.bytes == 0));
    }
    // A scope change in the middle of a link waits for the next one.
    p.east
        .link
        .set_policies([("e-svc", StreamPolicy::default())]);
    let before = p.east.link.cache_stats();
    send_once(&mut p, "e-svc", Class::Bulk, &db_blocks(16, 7));
    assert!(
        p.east
            .link
            .cache_stats()
            .iter()
            .all(|s| !s.scope.is_empty() || s.bytes == 0),
        "still the service's own cache ({before:?})"
    );
    // Frames of another service that claim a cache of its own reset that stream only, and no
    // cache is made for it.
    let id = p.west.link.open("e-lat", Class::Bulk).expect("open");
    p.west.app.received.entry(id).or_default();
    p.drive(Duration::from_secs(1));
    let mut buf = BytesMut::new();
    Frame::Coded {
        stream: id,
        offset: 0,
        fin: false,
        scoped: true,
        raw_len: 3,
        records: Bytes::from_static(&[1, 0, 0, 0, 3, b'a', b'b', b'c']),
    }
    .encode(&mut buf);
    p.east
        .link
        .handle_input_buf(&mut buf, p.now)
        .expect("the link survives");
    p.drive(Duration::from_secs(1));
    assert!(
        p.east
            .app
            .resets
            .contains(&(id, ResetCode::ProtocolViolation))
    );
    assert!(
        p.east
            .link
            .cache_stats()
            .iter()
            .all(|s| &*s.scope != "e-lat")
    );
    assert!(p.east.link.is_open());
    p.west.app.received.retain(|k, _| *k != id);
    p.assert_no_leaks();
}

#[test]
fn a_side_without_the_codec_gets_plain_frames() {
    let mut p = Pair::with(
        Duration::from_millis(5),
        50_000_000,
        |c| c.codec = Some(codec(1 << 20)),
        |_| {},
    );
    p.drive(Duration::from_secs(1));
    let data = db_blocks(32, 5);
    let wire = send_once(&mut p, "e-svc", Class::Bulk, &data);
    assert!(wire > data.len() as u64);
    p.assert_no_leaks();
}

/// A `Coded` frame of stream `id` (link-scoped, not the last), encoded as the peer sends it.
fn coded_frame(id: StreamId, offset: u64, raw_len: u32, records: Bytes) -> BytesMut {
    let mut buf = BytesMut::new();
    Frame::Coded {
        stream: id,
        offset,
        fin: false,
        scoped: false,
        raw_len,
        records,
    }
    .encode(&mut buf);
    buf
}

#[test]
fn coded_frames_to_a_side_without_the_codec_close_the_link() {
    let mut p = up_pair();
    let id = p.west.link.open("e-svc", Class::Bulk).expect("open");
    p.drive(Duration::from_secs(1));
    let mut buf = coded_frame(
        id,
        0,
        3,
        Bytes::from_static(&[1, 0, 0, 0, 3, b'a', b'b', b'c']),
    );
    let r = p.east.link.handle_input_buf(&mut buf, p.now);
    assert!(matches!(r, Err(LinkError::Protocol(_))), "{r:?}");
}

#[test]
fn records_that_do_not_rebuild_reset_only_their_stream() {
    let mut p = coded_pair(1 << 20, false);
    let id = p.west.link.open("e-svc", Class::Bulk).expect("open");
    p.west.app.received.entry(id).or_default();
    p.drive(Duration::from_secs(1));
    // Announces 10 bytes but carries 3; then a reference to a chunk nobody sent.
    let mut buf = coded_frame(
        id,
        0,
        10,
        Bytes::from_static(&[1, 0, 0, 0, 3, b'a', b'b', b'c']),
    );
    p.east
        .link
        .handle_input_buf(&mut buf, p.now)
        .expect("the link survives");
    p.drive(Duration::from_secs(1));
    assert_eq!(p.west.app.resets, vec![(id, ResetCode::DataLost)]);
    assert!(p.east.app.resets.contains(&(id, ResetCode::DataLost)));
    assert!(
        p.east.app.received.get(&id).is_none_or(Vec::is_empty),
        "no byte handed over"
    );
    assert!(p.east.link.is_open());
    p.west.app.received.clear();
    p.assert_no_leaks();
}

/// A frame that announces one byte and holds a thousand references to a cached chunk: the
/// receiver refuses the first record that would rebuild more than the frame paid for, before it
/// copies a byte of the chunk; only that stream is reset.
#[test]
fn a_reference_bomb_resets_its_stream_before_anything_is_expanded() {
    let mut p = coded_pair(16 << 20, false);
    let data = db_blocks(64, 3);
    send_once(&mut p, "e-svc", Class::Bulk, &data);
    // A real reference record to a chunk east now holds: the first record of a repeat (one by
    // one, as toward a peer that keeps no stream logs).
    let mut enc = wanopt_codec::Encoder::new(wanopt_codec::CodecConfig {
        logs: false,
        ..wanopt_codec::CodecConfig::default()
    });
    let mut wire = Vec::new();
    enc.push(&data, true, wanopt_codec::Pressure::CpuBound, &mut wire);
    wire.clear();
    enc.push(&data, true, wanopt_codec::Pressure::CpuBound, &mut wire);
    assert_eq!(wire[0], 3, "a reference");
    let len = wire[17..]
        .iter()
        .position(|b| b & 0x80 == 0)
        .expect("varint")
        + 18;
    let one = &wire[..len];
    let bomb: Vec<u8> = one.iter().copied().cycle().take(len * 1000).collect();
    let _ = counts(&mut p.east.link);
    let id = p.west.link.open("e-svc", Class::Bulk).expect("open");
    p.west.app.received.entry(id).or_default();
    p.drive(Duration::from_secs(1));
    let mut buf = coded_frame(id, 0, 1, Bytes::from(bomb));
    p.east
        .link
        .handle_input_buf(&mut buf, p.now)
        .expect("the link survives");
    // Decoded as it arrived: what the decoder rebuilt for it.
    let hits: u64 = p
        .east
        .link
        .take_codec_counts()
        .iter()
        .map(|(_, c)| c.received.hit_chunks)
        .sum();
    p.drive(Duration::from_secs(1));
    assert_eq!(hits, 0, "no reference was expanded");
    assert!(p.east.app.resets.contains(&(id, ResetCode::DataLost)));
    assert!(p.east.app.received.get(&id).is_none_or(Vec::is_empty));
    assert!(p.east.link.is_open());
    p.west.app.received.clear();
    p.assert_no_leaks();
}

/// West's stream `id` stalled at east on a reference to a chunk nobody sent (east asked west
/// for it; the frames carrying the question are not delivered). East grants a 1 MiB link window.
fn stalled_at_east() -> (Pair, StreamId) {
    let mut p = Pair::with(
        Duration::from_millis(20),
        50_000_000,
        |c| c.codec = Some(codec(1 << 20)),
        |c| {
            c.codec = Some(codec(1 << 20));
            c.link_window = 1 << 20;
        },
    );
    p.drive(Duration::from_secs(1));
    let id = p.west.link.open("e-svc", Class::Bulk).expect("open");
    p.drive(Duration::from_secs(1));
    // A reference (tag 3) to 64 bytes under a fingerprint nobody has.
    let mut records = vec![3u8];
    records.extend([0x5a; 16]);
    records.push(64);
    let mut buf = coded_frame(id, 0, 64, Bytes::from(records));
    p.east
        .link
        .handle_input_buf(&mut buf, p.now)
        .expect("a miss is no error");
    (p, id)
}

/// A peer that never answers our `Need` and keeps sending frames (most announce no bytes, so
/// they cost no credit) cannot make us queue without bound: past the link window plus 8 MiB of
/// frames behind stalled streams, the link closes.
#[test]
fn frames_behind_a_stall_the_peer_never_resolves_are_bounded() {
    let (mut p, id) = stalled_at_east();
    let junk = Bytes::from(vec![1u8; 16 << 10]);
    let (mut offset, mut queued) = (64u64, 0usize);
    let err = loop {
        let raw_len = u32::from(queued % (1 << 20) == 0);
        let mut buf = coded_frame(id, offset, raw_len, junk.clone());
        match p.east.link.handle_input_buf(&mut buf, p.now) {
            Ok(()) => {
                offset += u64::from(raw_len);
                queued += junk.len();
                assert!(queued <= (1 << 20) + (8 << 20), "queued {queued} bytes");
            }
            Err(e) => break e,
        }
    };
    assert!(
        matches!(err, LinkError::Protocol(ref m) if m.contains("stalled")),
        "{err:?}"
    );
    assert!(queued > 8 << 20, "an honest backlog fits: {queued}");
}

/// A stall the peer never resolves resets its stream after the link's idle timeout (the peer
/// keeps the link itself alive), and the link goes on.
#[test]
fn a_stall_the_peer_never_resolves_times_out() {
    let (mut p, id) = stalled_at_east();
    let start = p.now;
    let mut reset = None;
    for s in 1..=40u64 {
        let now = start + Duration::from_secs(s);
        let mut buf = BytesMut::new();
        Frame::Ping { payload: s }.encode(&mut buf);
        p.east.link.handle_input_buf(&mut buf, now).expect("ping");
        p.east.link.handle_timeout(now);
        while let Some(ev) = p.east.link.poll_event() {
            if let Event::Reset { stream, code, .. } = ev
                && stream == id
            {
                reset.get_or_insert((s, code));
            }
        }
    }
    let (after, code) = reset.expect("the stalled stream was reset");
    assert_eq!(code, ResetCode::DataLost);
    assert!((30..=32).contains(&after), "after {after} s");
    assert_eq!(p.east.link.stalls_expired(), 1);
    assert!(p.east.link.is_open());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]
    /// Optimized streams of both classes, both ways, on one or two lanes, with repeats among
    /// them, arrive exact, and nothing leaks.
    #[test]
    fn coded_streams_are_exact(
        sizes in proptest::collection::vec((0usize..200_000, 0usize..50_000, any::<bool>()), 1..10),
        laned in any::<bool>(),
        cache in prop_oneof![Just(64u64 * 1024), Just(16u64 << 20)],
        wan in any::<bool>(),
    ) {
        // Half the streams repeat an earlier one's seed (exchange_streams seeds by index).
        let mut p = coded_pair(cache, laned);
        if wan {
            link_bound(&mut p);
        }
        exchange_streams(p, &sizes)?;
    }
}

// ---- Caches that survive a restart ----

/// A coded pair with disk tiers (16 MiB of files each, 64 KiB of memory) on both sides, up.
fn stored_pair(ws: &Arc<TestStorage>, es: &Arc<TestStorage>) -> Pair {
    let mut p = stored_pair_starting(ws, es, Duration::from_secs(60));
    p.drive(Duration::from_secs(1));
    assert!(p.west.app.up && p.east.app.up);
    p
}

/// [`stored_pair`] before the hellos are exchanged; east's disk is slow: its states take 300 ms
/// to load.
fn stored_pair_starting(
    ws: &Arc<TestStorage>,
    es: &Arc<TestStorage>,
    checkpoints: Duration,
) -> Pair {
    let settings = || CodecSettings {
        cache_bytes: 64 * 1024,
        disk_bytes: 16 << 20,
        service_disk_bytes: 16 << 20,
        ..codec(1 << 20)
    };
    let (w, e) = (ws.clone(), es.clone());
    let mut p = Pair::with(
        Duration::from_millis(20),
        50_000_000,
        |c| {
            c.codec = Some(settings());
            c.saved_states = w.saved();
            c.cache_storage = Some(w);
            c.checkpoint_interval = checkpoints;
        },
        |c| {
            c.codec = Some(settings());
            c.saved_states = e.saved();
            c.cache_storage = Some(e);
        },
    );
    p.west.storage = Some(ws.clone());
    p.east.storage = Some(es.clone());
    p.east.load_delay = Duration::from_millis(300);
    p
}

/// Closes the link as a daemon shutting down does, and keeps what both sides saved.
fn shut_down(mut p: Pair, ws: &TestStorage, es: &TestStorage) {
    p.west.link.close(CloseCode::Normal, "shutdown");
    p.drive(Duration::from_secs(1));
    ws.keep(&mut p.west.app);
    es.keep(&mut p.east.app);
}

#[test]
fn caches_resume_after_a_restart_and_damage_is_resent_never_misread() {
    let (ws, es) = (
        Arc::new(TestStorage::default()),
        Arc::new(TestStorage::default()),
    );
    let data = pattern(11, 4 << 20);

    let mut p = stored_pair(&ws, &es);
    let first = send_once(&mut p, "e-svc", Class::Bulk, &data);
    assert!(
        first > data.len() as u64,
        "incompressible data is sent in full"
    );
    shut_down(p, &ws, &es);
    let (wsaved, esaved) = (ws.saved(), es.saved());
    assert!(wsaved.iter().any(|c| c.role == Role::Mirror), "{wsaved:?}");
    let digest = |v: &[SavedCache], role| {
        v.iter()
            .find(|c| c.role == role && c.lane == 0 && c.scope.is_empty())
            .map(|c| c.states[0].digest)
    };
    assert_eq!(
        digest(&wsaved, Role::Mirror),
        digest(&esaved, Role::Decoder),
        "both sides saved the same state"
    );

    // Restarted: the same data costs a sliver of the first transfer, from the disk tier.
    let mut p = stored_pair(&ws, &es);
    let again = send_once(&mut p, "e-svc", Class::Bulk, &data);
    assert!(
        again * 50 < first,
        "repeat after restart: {again} of {first}"
    );
    assert_eq!(counts(&mut p.west.link).needs, 0);
    shut_down(p, &ws, &es);

    // Every chunk on the receiver's disk damaged: references miss, are asked for and re-sent.
    es.mem(0, "").corrupt_all();
    let mut p = stored_pair(&ws, &es);
    send_once(&mut p, "e-svc", Class::Bulk, &data);
    assert!(counts(&mut p.east.link).needs > 0, "misses were asked for");
    shut_down(p, &ws, &es);

    // A receiver that lost its saved states starts afresh: nothing is resumed, nothing misread.
    let es2 = Arc::new(TestStorage::default());
    let mut p = stored_pair(&ws, &es2);
    let fresh = send_once(&mut p, "e-svc", Class::Bulk, &data);
    assert!(fresh > data.len() as u64);
    assert_eq!(counts(&mut p.east.link).needs, 0);
    p.assert_no_leaks();
}

#[test]
fn frames_wait_in_the_buffer_while_resumed_states_load() {
    let (ws, es) = (
        Arc::new(TestStorage::default()),
        Arc::new(TestStorage::default()),
    );
    let data = pattern(14, 2 << 20);
    let mut p = stored_pair(&ws, &es);
    let first = send_once(&mut p, "e-svc", Class::Bulk, &data);
    shut_down(p, &ws, &es);

    // West is up (and sending) long before east's slow disk hands its states over.
    let mut p = stored_pair_starting(&ws, &es, Duration::from_secs(60));
    p.drive(Duration::from_millis(60));
    assert!(p.west.app.up, "west heard east's hello");
    let before = p.west.link.link_wire().0;
    let id = open_and_send(&mut p, "e-svc", Class::Bulk, data.clone());
    p.drive(Duration::from_millis(150));
    assert!(p.east.link.is_loading(), "east still loads its states");
    // (References to the resumed cache, mostly: the whole repeat is a few KiB.)
    assert!(
        p.east.inbufs[0].len() > 1024,
        "west's frames wait unread: {} bytes",
        p.east.inbufs[0].len()
    );
    assert!(p.east.app.received.is_empty());
    p.drive(Duration::from_secs(60));
    assert!(!p.east.link.is_loading());
    assert!(
        p.east
            .app
            .received
            .get(&id)
            .is_some_and(|r| r[..] == data[..])
    );
    let again = p.west.link.link_wire().0 - before;
    assert!(
        again * 50 < first,
        "resumed after the wait: {again} of {first}"
    );
    assert_eq!(counts(&mut p.east.link).needs, 0);
    p.east.app.to_send.insert(id, (Bytes::new(), true));
    p.drive(Duration::from_secs(5));
    p.assert_no_leaks();
}

#[test]
fn reads_from_a_slow_disk_stall_only_their_stream() {
    let (ws, es) = (
        Arc::new(TestStorage::default()),
        Arc::new(TestStorage::default()),
    );
    let data = pattern(15, 2 << 20);
    let mut p = stored_pair(&ws, &es);
    let first = send_once(&mut p, "e-svc", Class::Bulk, &data);
    shut_down(p, &ws, &es);

    // Restarted with a disk whose every read takes 20 ms: the repeat is read from it (64 KiB of
    // memory), while a latency-class message goes by.
    let reads = Arc::new(Mutex::new(SlowReads::default()));
    *es.slow.lock().expect("lock") = Some(reads.clone());
    let mut p = stored_pair(&ws, &es);
    p.east.store_delay = Duration::from_millis(20);
    let before = p.west.link.link_wire().0;
    let bulk = open_and_send(&mut p, "e-svc", Class::Bulk, data.clone());
    p.drive(Duration::from_millis(100));
    assert!(
        reads.lock().expect("lock").pending > 0,
        "the repeat waits for the disk"
    );
    let opened = p.now;
    let msg = pattern(16, 8192);
    let lat = open_and_send(&mut p, "e-lat", Class::Latency, msg.clone());
    p.drive(Duration::from_secs(120));
    let got = |id| p.east.app.received.get(&id).cloned().unwrap_or_default();
    assert_eq!(got(lat), msg.to_vec());
    assert!(got(bulk) == data.to_vec(), "bulk bytes differ");
    let lat_at = p.east.app.first_byte[&lat];
    assert!(
        lat_at - opened < Duration::from_millis(60),
        "the latency message took {:?} behind the disk",
        lat_at - opened
    );
    let r = reads.lock().expect("lock");
    // One read at a time (a stream stalls on its first pending reference): the bulk stream
    // took at least pending x 20 ms, the latency message one trip.
    assert!(r.pending > 50, "{} reads waited", r.pending);
    assert!(
        r.waiting.is_empty() && r.done.is_empty(),
        "every read was used"
    );
    drop(r);
    // Every reference was rebuilt from the disk tier: nothing asked of the peer.
    assert_eq!(counts(&mut p.east.link).needs, 0);
    let again = p.west.link.link_wire().0 - before;
    assert!(again * 50 < first, "{again} of {first}");
    for id in [bulk, lat] {
        p.east.app.to_send.insert(id, (Bytes::new(), true));
    }
    p.drive(Duration::from_secs(5));
    p.assert_no_leaks();
}

#[test]
fn a_checkpoint_that_overtakes_a_stalled_stream_is_judged_once_it_caught_up() {
    let (ws, es) = (
        Arc::new(TestStorage::default()),
        Arc::new(TestStorage::default()),
    );
    let data = pattern(17, 2 << 20);
    let mut p = stored_pair(&ws, &es);
    send_once(&mut p, "e-svc", Class::Bulk, &data);
    shut_down(p, &ws, &es);

    // Restarted with a slow disk and checkpoints every second: west sends the repeat's
    // references (and its last checkpoint) long before east has read them all from disk.
    let reads = Arc::new(Mutex::new(SlowReads::default()));
    *es.slow.lock().expect("lock") = Some(reads.clone());
    let mut p = stored_pair_starting(&ws, &es, Duration::from_secs(1));
    p.drive(Duration::from_secs(1));
    // 100 ms a read: east is still reading when west's first checkpoint comes (the link's
    // timers start with its first ping, 5 s in).
    p.east.store_delay = Duration::from_millis(100);
    // The repeat, then new bytes: literals behind the stalled references change the cache.
    let more: Bytes = [data.to_vec(), pattern(18, 1 << 20).to_vec()]
        .concat()
        .into();
    send_once(&mut p, "e-svc", Class::Bulk, &more);
    p.drive(Duration::from_secs(3));
    assert!(reads.lock().expect("lock").pending > 50);
    let newest = |app: &App, role| {
        app.checkpoints
            .iter()
            .rev()
            .find(|c| c.0 == role && c.1 == 0 && c.2.is_empty())
            .map(|c| c.3.digest())
    };
    let mirror = newest(&p.west.app, Role::Mirror).expect("west checkpointed");
    assert_eq!(
        newest(&p.east.app, Role::Decoder),
        Some(mirror),
        "east saved the state of west's last checkpoint"
    );
    p.assert_no_leaks();
}

#[test]
fn service_scoped_caches_resume_too() {
    let (ws, es) = (
        Arc::new(TestStorage::default()),
        Arc::new(TestStorage::default()),
    );
    let data = pattern(12, 2 << 20);
    let scoped = || {
        [(
            "e-svc",
            StreamPolicy {
                scope: Scope::Service,
                ..StreamPolicy::default()
            },
        )]
    };
    let mut p = stored_pair_starting(&ws, &es, Duration::from_secs(60));
    p.west.link.set_policies(scoped());
    p.drive(Duration::from_secs(1));
    let first = send_once(&mut p, "e-svc", Class::Bulk, &data);
    shut_down(p, &ws, &es);
    assert!(
        es.saved()
            .iter()
            .any(|c| c.role == Role::Decoder && &*c.scope == "e-svc"),
        "the service's own cache was saved"
    );
    let mut p = stored_pair_starting(&ws, &es, Duration::from_secs(60));
    p.west.link.set_policies(scoped());
    p.drive(Duration::from_secs(1));
    let again = send_once(&mut p, "e-svc", Class::Bulk, &data);
    assert!(again * 50 < first, "{again} of {first}");
    // The shared cache never saw the service's chunks.
    assert!(
        es.saved()
            .iter()
            .filter(|c| c.scope.is_empty() && c.role == Role::Decoder)
            .all(|c| c
                .states
                .iter()
                .all(|s| { es.load(&s.digest).is_some_and(|s| s.entries.is_empty()) })),
    );
    p.assert_no_leaks();
}

/// A pair with a disk tier on both sides after one stream of `seed`'s bytes.
fn stored_pair_after_one_stream(seed: u64) -> Pair {
    let (ws, es) = (
        Arc::new(TestStorage::default()),
        Arc::new(TestStorage::default()),
    );
    let mut p = stored_pair(&ws, &es);
    send_once(&mut p, "e-svc", Class::Bulk, &pattern(seed, 1 << 20));
    p
}

/// The digests of the states `app` saved in `role`, oldest first.
fn saved_states(app: &App, role: Role) -> Vec<[u8; 16]> {
    app.checkpoints
        .iter()
        .filter(|c| c.0 == role)
        .map(|c| c.3.digest())
        .collect()
}

/// A `Checkpoint` frame of the shared cache naming `digest`, as a peer sends it.
fn checkpoint_frame(digest: [u8; 16]) -> BytesMut {
    let mut buf = BytesMut::new();
    Frame::Checkpoint {
        scope: String::new(),
        digest,
    }
    .encode(&mut buf);
    buf
}

#[test]
fn repeated_checkpoints_from_a_peer_cost_nothing_and_save_once() {
    let mut p = stored_pair_after_one_stream(13);
    // West's periodic checkpoint (60 s by default), in virtual time with the link kept alive.
    p.drive(Duration::from_secs(66));
    let saved = saved_states(&p.east.app, Role::Decoder);
    assert_eq!(saved.len(), 1, "the decoder saved its state once");
    // The same checkpoint again and again (a misbehaving peer): judged once, never saved again.
    let buf = checkpoint_frame(saved[0]);
    let before = p.east.app.checkpoints.len();
    for _ in 0..100 {
        let mut b = buf.clone();
        p.east
            .link
            .handle_lane_input(0, &mut b, p.now)
            .expect("a checkpoint is a valid frame");
    }
    p.drive(Duration::from_millis(10));
    assert!(p.east.link.is_open());
    assert_eq!(p.east.app.checkpoints.len(), before);
    p.assert_no_leaks();
}

#[test]
fn a_checkpoint_that_cannot_match_does_not_hide_the_next_one_at_the_same_state() {
    let mut p = stored_pair_after_one_stream(14);
    // A checkpoint east judges after its decoder moved past it (one deferred behind a stalled
    // stream is judged once the stream caught up): a digest of a state east is no longer in.
    let mut buf = checkpoint_frame([7; 16]);
    p.east
        .link
        .handle_lane_input(0, &mut buf, p.now)
        .expect("a checkpoint is a valid frame");
    assert!(saved_states(&p.east.app, Role::Decoder).is_empty());
    // West's periodic checkpoint comes at the state east is in now, which nothing changed.
    p.drive(Duration::from_secs(66));
    let mirror = *saved_states(&p.west.app, Role::Mirror)
        .last()
        .expect("west checkpointed");
    assert_eq!(
        saved_states(&p.east.app, Role::Decoder),
        [mirror],
        "east saved west's checkpoint once"
    );
    p.assert_no_leaks();
}

/// Workers on both sides (chunks prepared ahead of the mirror, literals decompressed ahead of
/// the cache) change nothing: the same wire bytes for a first copy and a repeat, and after
/// east's memory goes bad the same misses asked for and answered, as on a pair without them.
#[test]
fn workers_change_nothing_on_the_wire() {
    let run = |workers: bool| {
        let mut p = coded_pair_with(64 << 20, |c| {
            if workers {
                c.workers = Some(Arc::new(wanopt_codec::prepare::Inline));
            }
        });
        p.drive(Duration::from_secs(1));
        assert!(p.west.app.up && p.east.app.up);
        let mut v = db_blocks(256, 3).to_vec();
        v.extend_from_slice(&pattern(5, 1 << 20));
        v.extend_from_slice(&db_blocks(256, 4));
        let data = Bytes::from(v);
        let first = send_once(&mut p, "e-svc", Class::Bulk, &data);
        let again = send_once(&mut p, "e-svc", Class::Bulk, &data);
        assert!(p.east.link.corrupt_caches_for_test() > 0);
        let mut v = data[..512 * 1024].to_vec();
        v.extend_from_slice(&db_blocks(64, 9));
        let damaged = send_once(&mut p, "e-svc", Class::Bulk, &Bytes::from(v));
        let needs = counts(&mut p.east.link).needs;
        assert!(needs > 0, "the damaged chunks were asked for");
        p.assert_no_leaks();
        (first, again, damaged, needs)
    };
    assert_eq!(run(true), run(false));
}

/// Two sides that read short coded frames send nothing else for an optimized stream, and what
/// they rebuild is exact; a short frame whose low offset bits disagree with what its stream
/// received closes the link (it never lands at the wrong place). A client writing in 16 KiB
/// pieces gets a frame for each 128 KiB gathered, not one for each write.
#[test]
fn optimized_streams_go_in_short_frames_checked_against_their_offset() {
    let mut p = coded_pair(1 << 20, false);
    let data = db_blocks(64, 11);
    let id = p.west.link.open("e-svc", Class::Bulk).expect("open");
    let quiet = p.west.link.open("e-svc", Class::Bulk).expect("open");
    let mut out = BytesMut::new();
    for piece in data.chunks(16 * 1024) {
        assert_eq!(p.west.link.write(id, piece), Ok(piece.len()));
        while p.west.link.poll_transmit(p.now, &mut out, 1 << 20) > 0 {}
    }
    p.west.link.finish(id).expect("finish");
    while p.west.link.poll_transmit(p.now, &mut out, 1 << 20) > 0 {}
    let mut wire = out.clone();
    let (mut short, mut whole, mut at) = (0, 0, 0u64);
    while let Ok(n) = Frame::check(&wire, 1 << 20) {
        match Frame::parse(wire.split_to(n).freeze()).expect("parse") {
            Frame::CodedShort {
                stream,
                at: a,
                raw_len,
                ..
            } => {
                assert_eq!((stream, a), (id, at as u16));
                at += u64::from(raw_len);
                short += 1;
            }
            Frame::Coded { .. } => whole += 1,
            _ => {}
        }
    }
    assert!(wire.is_empty());
    assert_eq!((whole, at), (0, data.len() as u64));
    assert!((2..=5).contains(&short), "{short} frames for 512 KiB");
    p.west.app.received.entry(id).or_default();
    p.east
        .link
        .handle_input_buf(&mut out, p.now)
        .expect("east reads them");
    p.drive(Duration::from_secs(5));
    assert!(p.east.app.received[&id] == data[..]);
    let mut bad = BytesMut::new();
    Frame::CodedShort {
        stream: quiet,
        at: 1,
        fin: false,
        scoped: false,
        raw_len: 3,
        records: Bytes::from_static(&[1, 0, 0, 0, 3, b'a', b'b', b'c']),
    }
    .encode(&mut bad);
    let r = p.east.link.handle_input_buf(&mut bad, p.now);
    assert!(
        matches!(&r, Err(LinkError::Protocol(m)) if m.contains("offset check 1, expected 0")),
        "{r:?}"
    );
}

/// Workers of several threads that run what they are handed on threads of their own, and count
/// the turns left to them to make.
#[derive(Debug, Default)]
struct Spawning(std::sync::atomic::AtomicUsize);

impl wanopt_codec::prepare::Workers for Spawning {
    fn run(&self, jobs: &mut [wanopt_codec::prepare::Job<'_>]) {
        jobs.iter_mut().for_each(wanopt_codec::prepare::Job::run);
    }

    fn threads(&self) -> usize {
        3
    }

    fn spawn(&self, job: Box<dyn FnOnce() + Send>) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        std::thread::spawn(job);
    }
}

/// Bulk streams on the LZ4 path (literals alone) sent to a side with workers: a stream's frame
/// has its literals decompressed on them while the stream's earlier frames wait for their
/// turn, one stream alone or three side by side. A first copy; then, with the receiver's
/// memory gone bad, the chunks it held sent again between new ones (references that miss,
/// stalling the stream while its later frames are fed), and a changed copy. Every stream
/// arrives exact, the caches are in step after the first copy, each miss is answered, and
/// literals were taken as fed.
#[test]
fn literals_fed_behind_a_streams_waiting_frames_rebuild_exactly() {
    for streams in [1usize, 3] {
        let firsts: Vec<Bytes> = parallel_parts(12_000).into_iter().take(streams).collect();
        let mut p = lz4_pair_to_workers();
        // East reads every 40 ms: what piled up meanwhile (several frames) in one input call.
        p.w2e[0].reads_every = Some(Duration::from_millis(40));
        send_copies(&mut p, &firsts);
        assert_caches_in_step(&p);
        let (behind, lits) = p.east.link.fed_ahead_for_test();
        assert!(behind > 4, "{streams} streams: {behind} frames fed behind");
        assert!(
            lits > 100,
            "{streams} streams: {lits} literals taken as fed"
        );
        sent_again_then_changed(&mut p, &firsts);
        let (later, _) = p.east.link.fed_ahead_for_test();
        assert!(
            later > behind,
            "{streams} streams: frames fed behind after the misses too"
        );
        p.assert_no_leaks();
    }
}

/// One bulk stream in its context (and then three side by side) sent with workers, each turn
/// planned while the one before waits for its context records, to a side with workers, which
/// reads what piled up every 40 ms: each frame is fed to the stream's context on them, behind
/// the frame before it, while the decoder's thread decodes those. A first copy; then, with the
/// receiver's memory gone bad, the chunks it held sent again between new ones (misses while
/// the next frame holds the context), and a changed copy. Every stream arrives exact, the
/// caches are in step after the first copy, each miss is answered, and turns were planned
/// behind and frames fed next after the misses too.
#[test]
fn one_streams_frames_fed_while_the_one_before_is_decoded_rebuild_exactly() {
    for streams in [1usize, 3] {
        let firsts: Vec<Bytes> = parallel_parts(12_000).into_iter().take(streams).collect();
        let mut p = pair_to_workers(Pressure::LinkBound);
        p.w2e[0].reads_every = Some(Duration::from_millis(40));
        send_copies(&mut p, &firsts);
        assert_caches_in_step(&p);
        let next = p.east.link.fed_next_for_test();
        assert!(next > 4, "{streams} streams: {next} frames fed next");
        planned_behind_alone(&mut p, streams);
        sent_again_then_changed(&mut p, &firsts);
        let later = p.east.link.fed_next_for_test();
        assert!(
            later > next,
            "{streams} streams: frames fed next after the misses too"
        );
        planned_behind_alone(&mut p, streams);
        p.assert_no_leaks();
    }
}

/// One stream alone has its turns planned while the one before waits for its context records
/// (at least a third of them: the link writes every frame before a call returns); several
/// take turns (each stream's context records made while the others' turns are planned).
fn planned_behind_alone(p: &mut Pair, streams: usize) {
    let sent = counts(&mut p.west.link).sent;
    let (behind, frames) = (sent.planned_behind, sent.frames);
    if streams == 1 {
        assert!(
            behind >= 2 && behind * 3 >= frames,
            "{behind} of {frames} turns planned behind"
        );
    }
}

/// With the receiver's memory gone bad, `firsts` (sent before) sent again between new bytes:
/// the damaged chunks miss, are asked for and re-sent; then a changed copy, which misses
/// nothing. Every stream arrives exact (see [`send_copies`]).
fn sent_again_then_changed(p: &mut Pair, firsts: &[Bytes]) {
    let streams = firsts.len();
    let _ = counts(&mut p.east.link);
    assert!(p.east.link.corrupt_caches_for_test() > 0);
    let again: Vec<Bytes> = firsts
        .iter()
        .enumerate()
        .map(|(k, d)| {
            let mut v = Vec::new();
            for (i, piece) in d.chunks(256 << 10).enumerate() {
                v.extend_from_slice(piece);
                v.extend_from_slice(&db_blocks(8, 1000 + (k * 100 + i) as u64));
            }
            Bytes::from(v)
        })
        .collect();
    send_copies(p, &again);
    let (east, west) = (counts(&mut p.east.link), counts(&mut p.west.link));
    assert!(
        east.needs > 0,
        "{streams} streams: the damaged chunks were asked for"
    );
    assert_eq!(west.resent, east.needs, "{streams} streams: and re-sent");
    let changed: Vec<Bytes> = again
        .iter()
        .enumerate()
        .map(|(k, d)| Bytes::from(wanopt_codec::testdata::edited(d, k)))
        .collect();
    send_copies(p, &changed);
    assert_eq!(counts(&mut p.east.link).needs, 0, "{streams} streams");
}

/// An input call that ends inside a frame leaves the frames fed ahead before it waiting (the
/// workers going on with them) for the rest of that frame, a millisecond at most: the timer
/// decodes them if nothing more comes, and what comes next decodes after them, exact.
#[test]
fn frames_fed_ahead_wait_for_a_frame_being_read_a_millisecond_at_most() {
    let mut p = lz4_pair_to_workers();
    // East reads nothing for now: what west sends piles up, and is handed over here.
    p.w2e[0].reads_every = Some(Duration::from_secs(3600));
    let data = parallel_parts(12_000).swap_remove(0);
    let id = open_and_send(&mut p, "e-svc", Class::Bulk, data.clone());
    p.drive(Duration::from_millis(400));
    let wire: Vec<u8> = p.w2e[0].in_flight.drain(..).flat_map(|(_, b)| b).collect();
    assert!(wire.len() > 256 << 10, "{} bytes sent", wire.len());
    p.w2e[0].reads_every = None;
    // All but the end of the last frame sent.
    let now = p.now;
    let east = &mut p.east;
    east.inbufs[0].extend_from_slice(&wire[..wire.len() - 1000]);
    east.link
        .handle_lane_input(0, &mut east.inbufs[0], now)
        .expect("input");
    assert!(!east.inbufs[0].is_empty(), "a frame cut short waits");
    assert!(
        east.link.fed_waiting_for_test() > 0,
        "frames fed ahead wait"
    );
    let due = east.link.poll_timeout().expect("a timer");
    assert!(
        due <= now + Duration::from_millis(1),
        "{:?} late",
        due - now
    );
    let got = |east: &mut Side| {
        step_side(east, &mut [], now);
        east.app.received.get(&id).map_or(0, Vec::len)
    };
    let before = got(east);
    // Nothing more comes: the timer decodes them.
    east.link.handle_timeout(now + Duration::from_millis(1));
    assert_eq!(east.link.fed_waiting_for_test(), 0);
    let after = got(east);
    assert!(after > before, "{before} then {after} bytes");
    // The rest of the frame, and everything after it.
    east.inbufs[0].extend_from_slice(&wire[wire.len() - 1000..]);
    east.link
        .handle_lane_input(0, &mut east.inbufs[0], now + Duration::from_millis(1))
        .expect("input");
    p.drive(Duration::from_secs(30));
    assert!(
        p.east
            .app
            .received
            .get(&id)
            .is_some_and(|r| r[..] == data[..])
    );
    assert!(p.east.app.fin.contains(&id));
    p.east.app.to_send.insert(id, (Bytes::new(), true));
    p.drive(Duration::from_secs(5));
    p.assert_no_leaks();
}

/// Each of `copy` sent west to east on a stream of its own, side by side: every one arrives
/// exact and whole; then the streams close.
fn send_copies(p: &mut Pair, copy: &[Bytes]) {
    let ids: Vec<_> = copy
        .iter()
        .map(|d| open_and_send(p, "e-svc", Class::Bulk, d.clone()))
        .collect();
    p.drive(Duration::from_secs(60));
    for (id, d) in ids.iter().zip(copy) {
        assert!(
            p.east.app.received.get(id).is_some_and(|r| r[..] == d[..]),
            "{} streams: bytes differ",
            copy.len()
        );
        assert!(p.east.app.fin.contains(id));
        p.east.app.to_send.insert(*id, (Bytes::new(), true));
    }
    p.drive(Duration::from_secs(5));
}

/// The same chunks in the same order on both sides: each of west's mirrors has the digest of
/// east's decoder of its lane and scope.
fn assert_caches_in_step(p: &Pair) {
    let west = p.west.link.cache_digests_for_test();
    let east = p.east.link.cache_digests_for_test();
    let mirrors: Vec<_> = west.iter().filter(|d| d.0 == "mirror").collect();
    assert!(!mirrors.is_empty());
    for (_, lane, scope, digest) in mirrors {
        let theirs = east
            .iter()
            .find(|d| d.0 == "decoder" && d.1 == *lane && d.2 == *scope);
        assert_eq!(
            theirs.map(|d| d.3),
            Some(*digest),
            "lane {lane} scope {scope:?}"
        );
    }
}

/// A coded pair, up, whose west sends on the LZ4 path (literals alone) to an east decoding
/// with workers.
fn lz4_pair_to_workers() -> Pair {
    pair_to_workers(Pressure::CpuBound)
}

/// A coded pair, up, whose west sends under `pressure` (on the LZ4 path when CPU-bound, in
/// stream contexts when link-bound) with workers to an east decoding with workers.
fn pair_to_workers(pressure: Pressure) -> Pair {
    let (w, e) = (Arc::new(Spawning::default()), Arc::new(Spawning::default()));
    let mut p = Pair::with(
        Duration::from_millis(20),
        50_000_000,
        move |c| {
            c.codec = Some(codec(64 << 20));
            c.workers = Some(w as Arc<dyn wanopt_codec::prepare::Workers>);
        },
        move |c| {
            c.codec = Some(codec(64 << 20));
            c.workers = Some(e as Arc<dyn wanopt_codec::prepare::Workers>);
        },
    );
    p.drive(Duration::from_secs(1));
    assert!(p.west.app.up && p.east.app.up);
    p.west.link.set_pressure(pressure);
    p
}

/// Four parts of a parallel copy: rows (from `rows` on, more in each part), then database
/// blocks.
fn parallel_parts(rows: u32) -> Vec<Bytes> {
    (0..4u32)
        .map(|k| {
            let mut v = order_rows(rows + k * 3_000, ["|", "|c-", "|", "|", "|"]).to_vec();
            v.extend_from_slice(&db_blocks(96, 20 + u64::from(k)));
            Bytes::from(v)
        })
        .collect()
}

/// Bulk streams in long stream contexts at a stated WAN, sent side by side by a side with
/// workers: their frames wait for their context records while the other streams' turns go on,
/// and leave in the order they were planned. Every stream arrives exact, no chunk is asked for
/// again, and the wire bytes are about those of a side without workers.
#[test]
fn frames_left_for_workers_leave_in_order_and_rebuild_exactly() {
    let parts = parallel_parts(40_000);
    let run = |workers: Option<Arc<Spawning>>| {
        let w = workers.clone();
        let mut p = link_bound_pair(
            move |c| {
                c.codec = Some(codec(64 << 20));
                c.workers = w
                    .clone()
                    .map(|w| w as Arc<dyn wanopt_codec::prepare::Workers>);
            },
            codec(64 << 20),
        );
        let before = p.west.link.link_wire().0;
        let ids: Vec<_> = parts
            .iter()
            .map(|d| open_and_send(&mut p, "e-svc", Class::Bulk, d.clone()))
            .collect();
        p.drive(Duration::from_secs(60));
        for (id, d) in ids.iter().zip(&parts) {
            assert!(
                p.east.app.received.get(id).is_some_and(|r| r[..] == d[..]),
                "bytes differ"
            );
        }
        let wire = p.west.link.link_wire().0 - before;
        assert_eq!(counts(&mut p.east.link).needs, 0, "caches in step");
        for id in ids {
            assert!(p.east.app.fin.contains(&id));
            p.east.app.to_send.insert(id, (Bytes::new(), true));
        }
        p.drive(Duration::from_secs(5));
        p.assert_no_leaks();
        wire
    };
    let spawning = Arc::new(Spawning::default());
    let pooled = run(Some(spawning.clone()));
    let left = spawning.0.load(std::sync::atomic::Ordering::Relaxed);
    assert!(left > 8, "{left} turns left to the workers");
    // The streams' turns interleave as the scheduler takes them (not the same from run to
    // run), so the wire bytes are compared within a margin.
    let alone = run(None);
    assert!(
        pooled * 10 < alone * 11 && alone * 10 < pooled * 11,
        "{pooled} wire bytes with workers, {alone} without"
    );
}

/// Bulk streams in long stream contexts sent side by side to a side with workers: each
/// stream's frame is fed to its context on them while the frames before it are decoded, and
/// decoded in its turn. A first copy, then a changed copy on new streams (references, deltas
/// and reference runs among the context records): every stream arrives exact, no chunk is
/// asked for again (the receiver's cache saw what the sender's mirror saw, in its order), and
/// the frames were fed ahead.
#[test]
fn frames_fed_ahead_on_the_receiver_decode_in_order_exactly() {
    const CACHE: u64 = 64 << 20;
    let firsts = parallel_parts(30_000);
    let changed: Vec<Bytes> = firsts
        .iter()
        .enumerate()
        .map(|(k, d)| Bytes::from(wanopt_codec::testdata::edited(d, k)))
        .collect();
    let receiving = Arc::new(Spawning::default());
    let sending = Arc::new(Spawning::default());
    let (w, e) = (sending.clone(), receiving.clone());
    let mut p = Pair::with(
        Duration::from_millis(20),
        50_000_000,
        move |c| {
            c.codec = Some(codec(CACHE));
            c.workers = Some(w as Arc<dyn wanopt_codec::prepare::Workers>);
        },
        move |c| {
            c.codec = Some(codec(CACHE));
            c.workers = Some(e as Arc<dyn wanopt_codec::prepare::Workers>);
        },
    );
    p.drive(Duration::from_secs(1));
    assert!(p.west.app.up && p.east.app.up);
    p.west.link.set_pressure(Pressure::LinkBound);
    for copy in [&firsts, &changed] {
        send_copies(&mut p, copy);
    }
    let c = counts(&mut p.west.link);
    assert!(c.sent.hit_chunks > 100 && c.sent.delta_chunks > 10, "{c:?}");
    assert_eq!(counts(&mut p.east.link).needs, 0, "caches in step");
    assert_caches_in_step(&p);
    let fed = receiving.0.load(std::sync::atomic::Ordering::Relaxed);
    assert!(fed > 8, "{fed} frames fed ahead");
    p.assert_no_leaks();
}
