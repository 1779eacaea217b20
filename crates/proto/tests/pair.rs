//! Link state machines paired in memory (see `common`): handshakes, streams, flow control,
//! lanes and failures. Each test ends by asserting that nothing leaked.

mod common;

use common::*;
use wanopt_proto::ServiceLimit;

#[test]
fn hello_exchange_brings_both_sides_up() {
    let p = up_pair();
    assert!(p.west.link.is_open() && p.east.link.is_open());
    p.assert_no_leaks();
}

#[test]
fn bidirectional_transfer_with_half_close_is_exact() {
    let mut p = up_pair();
    let up = pattern(1, 3_000_000);
    let id = open_and_send(&mut p, "e-svc", Class::Bulk, up.clone());
    p.drive(Duration::from_secs(30));
    assert_eq!(p.east.app.opened, vec![(id, "e-svc".to_string())]);
    assert_eq!(p.east.app.received.get(&id).map(Vec::len), Some(up.len()));
    assert!(p.east.app.received[&id] == up[..], "bytes differ");
    assert!(p.east.app.fin.contains(&id));
    // West has finished sending but east can still answer: a half-closed stream.
    assert_eq!(p.west.link.stream_count(), 1);
    let down = pattern(2, 1_000_000);
    p.east.app.to_send.insert(id, (down.clone(), true));
    p.drive(Duration::from_secs(30));
    assert!(p.west.app.received[&id] == down[..]);
    assert!(p.west.app.fin.contains(&id));
    p.assert_no_leaks();
}

#[test]
fn latency_class_overtakes_a_bulk_backlog() {
    let mut p = up_pair();
    // A bulk stream with far more data than the pipe moves in a second.
    let bulk = open_and_send(&mut p, "e-svc", Class::Bulk, pattern(3, 8_000_000));
    p.drive(Duration::from_millis(300));
    let sent_at = p.now;
    let lat = open_and_send(
        &mut p,
        "e-lat",
        Class::Latency,
        Bytes::from_static(b"commit"),
    );
    p.drive(Duration::from_millis(200));
    let arrived = p
        .east
        .app
        .first_byte
        .get(&lat)
        .copied()
        .expect("latency message arrived");
    let delay = arrived - sent_at;
    // One-way latency is 50 ms; the message may wait only behind what was already handed to the
    // "kernel" (at most about 64 KiB here, 12 ms at this rate), never behind the 8 MB backlog (1.4 s).
    assert!(
        delay < Duration::from_millis(65),
        "latency message waited {delay:?}"
    );
    assert!(p.east.app.received.get(&bulk).map_or(0, Vec::len) < 8_000_000);
    p.drive(Duration::from_secs(60));
    assert_eq!(p.east.app.received[&bulk].len(), 8_000_000);
    p.east.app.to_send.insert(bulk, (Bytes::new(), true));
    p.east.app.to_send.insert(lat, (Bytes::new(), true));
    p.drive(Duration::from_secs(5));
    p.assert_no_leaks();
}

#[test]
fn unknown_service_is_refused_and_counted() {
    let mut p = up_pair();
    let id = open_and_send(&mut p, "nope", Class::Bulk, Bytes::from_static(b"x"));
    p.drive(Duration::from_secs(1));
    assert_eq!(p.east.app.refused, vec!["nope".to_string()]);
    assert_eq!(p.west.app.resets, vec![(id, ResetCode::UnknownService)]);
    p.west.app.received.clear();
    p.assert_no_leaks();
}

/// A service at its own stream limit refuses more, bulk streams leave the latency reserve
/// alone (by the class in our config, whatever the peer claims), and closing frees the slots.
#[test]
fn service_limits_and_the_latency_reserve_hold() {
    let mut p = Pair::with(
        Duration::from_millis(10),
        100_000_000,
        |_| {},
        |c| {
            c.max_streams = 6;
            c.latency_reserve = 2;
        },
    );
    p.east.link.set_service_limits([
        (
            "e-svc",
            ServiceLimit {
                max_streams: 3,
                class: Some(Class::Bulk),
            },
        ),
        ("e-bulk", ServiceLimit::default()),
        (
            "e-lat",
            ServiceLimit {
                max_streams: 10,
                class: Some(Class::Latency),
            },
        ),
    ]);
    p.drive(Duration::from_secs(1));
    let open = |p: &mut Pair, svc: &str, class: Class| {
        let id = p.west.link.open(svc, class).expect("open");
        p.west
            .app
            .to_send
            .insert(id, (Bytes::from_static(b"x"), false));
        p.drive(Duration::from_millis(100));
        id
    };
    // e-svc takes 3, the 4th is refused although the link has room.
    let svc: Vec<_> = (0..4).map(|_| open(&mut p, "e-svc", Class::Bulk)).collect();
    assert_eq!(p.west.app.resets, vec![(svc[3], ResetCode::Refused)]);
    // One more bulk stream fits (4 = 6 - 2); the next is refused, even claiming latency.
    open(&mut p, "e-bulk", Class::Bulk);
    let over = open(&mut p, "e-svc", Class::Latency);
    let over2 = open(&mut p, "e-bulk", Class::Bulk);
    assert_eq!(p.west.app.resets.len(), 3, "{:?}", p.west.app.resets);
    assert!(p.west.app.resets.contains(&(over2, ResetCode::Refused)));
    assert!(p.west.app.resets.contains(&(over, ResetCode::Refused)));
    // The reserve serves latency streams.
    let lat: Vec<_> = (0..2)
        .map(|_| open(&mut p, "e-lat", Class::Latency))
        .collect();
    assert_eq!(
        p.west.app.resets.len(),
        3,
        "latency streams use the reserve"
    );
    // Closing one e-svc stream frees its slot for a new one.
    p.west.link.reset(svc[0], ResetCode::SocketError, "done");
    p.drive(Duration::from_millis(100));
    let again = open(&mut p, "e-svc", Class::Bulk);
    assert!(!p.west.app.resets.iter().any(|(id, _)| *id == again));
    assert_eq!(p.east.app.opened.len(), 7, "{:?}", p.east.app.opened);
    // Closing the link ends every stream, and nothing is left behind.
    p.west.link.close(CloseCode::Normal, "done");
    p.drive(Duration::from_secs(1));
    p.assert_no_leaks();
    let _ = lat;
}

#[test]
fn slow_reader_bounds_buffering_on_both_sides() {
    let mut p = Pair::with(
        Duration::from_millis(10),
        100_000_000,
        |_| {},
        |c| c.stream_window = 1 << 20,
    );
    p.drive(Duration::from_secs(1));
    p.east.app.paused = true;
    let id = open_and_send(&mut p, "e-svc", Class::Bulk, pattern(4, 20_000_000));
    p.drive(Duration::from_secs(5));
    // East buffers at most its stream window; west at most its send buffer.
    assert!(
        p.east.link.buffered_bytes() <= 1 << 20,
        "{}",
        p.east.link.buffered_bytes()
    );
    let cap = LinkConfig::new("x", "y", true).send_buffer;
    assert!(
        p.west.link.send_queued(id) <= cap,
        "{}",
        p.west.link.send_queued(id)
    );
    let pending = p.west.app.to_send.get(&id).map_or(0, |(b, _)| b.len());
    assert!(pending > 10_000_000, "sender was not held back");
    p.east.app.paused = false;
    p.drive(Duration::from_secs(60));
    assert!(p.east.app.received[&id] == pattern(4, 20_000_000)[..]);
    p.east.app.to_send.insert(id, (Bytes::new(), true));
    p.drive(Duration::from_secs(1));
    p.assert_no_leaks();
}

#[test]
fn reset_reaches_the_peer_and_frees_credit() {
    let mut p = up_pair();
    let id = open_and_send(&mut p, "e-svc", Class::Bulk, pattern(5, 500_000));
    p.drive(Duration::from_millis(120));
    p.east
        .link
        .reset(id, ResetCode::TargetRefused, "connection refused");
    p.drive(Duration::from_secs(5));
    assert_eq!(p.west.app.resets, vec![(id, ResetCode::TargetRefused)]);
    p.west.app.to_send.clear();
    p.assert_no_leaks();
    // The link still works afterwards.
    let id2 = open_and_send(&mut p, "e-svc", Class::Bulk, pattern(6, 100_000));
    p.drive(Duration::from_secs(5));
    assert_eq!(p.east.app.received[&id2].len(), 100_000);
}

#[test]
fn version_mismatch_is_a_clear_error_on_both_sides() {
    let now = Instant::now();
    let mut link = Link::new(LinkConfig::new("east", "west", false));
    let mut buf = BytesMut::new();
    Frame::Hello(Hello {
        version: 9,
        min_version: 7,
        site: "west".into(),
        capabilities: 0,
        settings: vec![],
        caches: vec![],
        scoped: vec![],
    })
    .encode(&mut buf);
    let err = link.handle_input(&buf, now).expect_err("mismatch");
    assert!(
        matches!(err, LinkError::VersionMismatch { theirs: 9, .. }),
        "{err}"
    );
    // The GoAway tells the other side why.
    let mut out = BytesMut::new();
    link.poll_transmit(now, &mut out, 4096);
    let mut frames = Vec::new();
    while let Ok(n) = Frame::check(&out, 1 << 20) {
        frames.push(Frame::parse(out.split_to(n).freeze()).expect("parse"));
    }
    assert!(matches!(
        frames.last(),
        Some(Frame::GoAway {
            code: CloseCode::VersionMismatch,
            ..
        })
    ));
    // And the peer reading that GoAway reports it.
    let mut peer = Link::new(LinkConfig::new("west", "east", true));
    let mut again = BytesMut::new();
    for f in &frames {
        f.encode(&mut again);
    }
    let err = peer.handle_input(&again, now).expect_err("peer closed");
    assert!(matches!(
        err,
        LinkError::PeerClosed {
            code: CloseCode::VersionMismatch,
            ..
        }
    ));
    for l in [&link, &peer] {
        assert_eq!((l.stream_count(), l.buffered_bytes()), (0, 0));
    }
}

#[test]
fn wrong_site_name_is_rejected() {
    let mut p = Pair::with(
        Duration::from_millis(1),
        1_000_000_000,
        |c| c.site = "mallory".into(),
        |_| {},
    );
    p.drive(Duration::from_secs(1));
    assert!(matches!(
        p.east.app.closed,
        Some(Some(LinkError::WrongPeer { .. }))
    ));
    assert!(p.east.link.is_closed() && p.west.link.is_closed());
    p.assert_no_leaks();
}

#[test]
fn garbage_closes_the_link_without_panicking() {
    let mut link = Link::new(LinkConfig::new("east", "west", false));
    let err = link.handle_input(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", Instant::now());
    assert!(err.is_err());
    assert!(link.is_closed());
    assert_eq!((link.stream_count(), link.buffered_bytes()), (0, 0));
}

#[test]
fn silent_peer_times_out_and_pings_measure_rtt() {
    let mut p = up_pair();
    // Run for a while: the pair's timers send pings, which give an RTT of about 100 ms.
    p.drive(Duration::from_secs(15));
    let rtt = p.west.link.rtt().expect("rtt measured");
    assert!(
        rtt >= Duration::from_millis(100) && rtt < Duration::from_millis(110),
        "{rtt:?}"
    );
    // Now east goes silent.
    let t = p.now + Duration::from_secs(31);
    p.west.link.handle_timeout(t);
    assert!(matches!(
        p.west.link.close_error(),
        Some(LinkError::Timeout)
    ));
    p.assert_no_leaks();
}

#[test]
fn link_close_fails_every_stream() {
    let mut p = up_pair();
    let a = open_and_send(&mut p, "e-svc", Class::Bulk, pattern(7, 2_000_000));
    let b = open_and_send(&mut p, "e-lat", Class::Latency, pattern(8, 10));
    p.drive(Duration::from_millis(200));
    p.west
        .link
        .close(CloseCode::Replaced, "a newer link replaced this one");
    p.drive(Duration::from_secs(1));
    let mut ids: Vec<StreamId> = p.west.app.resets.iter().map(|(id, _)| *id).collect();
    ids.sort();
    assert_eq!(ids, vec![a, b]);
    assert!(matches!(
        p.east.app.closed,
        Some(Some(LinkError::PeerClosed {
            code: CloseCode::Replaced,
            ..
        }))
    ));
    p.assert_no_leaks();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// Many interleaved streams of random sizes both ways arrive exact, and nothing leaks.
    #[test]
    fn interleaved_streams_are_exact(sizes in proptest::collection::vec((0usize..300_000, 0usize..50_000, any::<bool>()), 1..12)) {
        exchange_streams(up_pair(), &sizes)?;
    }

    /// With the lane attached, streams of both classes interleave both ways and arrive exact.
    #[test]
    fn laned_streams_are_exact(sizes in proptest::collection::vec((0usize..200_000, 0usize..50_000, any::<bool>()), 1..10)) {
        exchange_streams(laned_pair(), &sizes)?;
    }
}

#[test]
fn latency_lane_is_unaffected_by_a_stalled_main_lane() {
    let mut p = laned_pair();
    let bulk = open_and_send(&mut p, "e-svc", Class::Bulk, pattern(9, 4_000_000));
    p.drive(Duration::from_millis(300));
    // The main lane stalls for two seconds both ways (think: bulk's loss recovery).
    p.w2e[0].latency = Duration::from_secs(2);
    p.e2w[0].latency = Duration::from_secs(2);
    let sent_at = p.now;
    let lat = open_and_send(
        &mut p,
        "e-lat",
        Class::Latency,
        Bytes::from_static(b"redo block"),
    );
    p.drive(Duration::from_millis(150));
    let arrived = p
        .east
        .app
        .first_byte
        .get(&lat)
        .copied()
        .expect("latency message crossed the lane");
    assert!(
        arrived - sent_at < Duration::from_millis(60),
        "{:?}",
        arrived - sent_at
    );
    // The answer comes back on the lane too.
    p.east
        .app
        .to_send
        .insert(lat, (Bytes::from_static(b"ack"), true));
    p.drive(Duration::from_millis(150));
    assert_eq!(
        p.west.app.received.get(&lat).map(Vec::as_slice),
        Some(&b"ack"[..])
    );
    // Refusals of lane streams travel on the lane.
    let ghost = open_and_send(&mut p, "nope", Class::Latency, Bytes::from_static(b"x"));
    p.drive(Duration::from_millis(150));
    assert!(
        p.west
            .app
            .resets
            .contains(&(ghost, ResetCode::UnknownService))
    );
    // Once the main lane recovers everything completes exactly and nothing leaks.
    p.w2e[0].latency = Duration::from_millis(50);
    p.e2w[0].latency = Duration::from_millis(50);
    p.drive(Duration::from_secs(30));
    assert!(p.east.app.received[&bulk] == pattern(9, 4_000_000)[..]);
    assert!(p.east.app.fin.contains(&lat));
    p.east.app.to_send.insert(bulk, (Bytes::new(), true));
    p.drive(Duration::from_secs(5));
    p.west.app.received.remove(&ghost);
    p.assert_no_leaks();
}

#[test]
fn lane_input_before_attach_is_a_protocol_error() {
    let mut p = up_pair();
    let mut junk = BytesMut::from(&b"anything"[..]);
    assert!(p.east.link.handle_lane_input(1, &mut junk, p.now).is_err());
    assert!(p.east.link.is_closed());
    p.assert_no_leaks();
}

// ---- The optimization codec on the link ----

/// A peer that pings without reading the pongs: past `MAX_QUEUED_CONTROL` queued replies the
/// link takes no more input (the rest waits in the read buffer, so TCP pushes back on the
/// peer), and takes it again once the replies are out.
#[test]
fn a_ping_flood_that_reads_nothing_stops_our_reading() {
    let mut p = up_pair();
    let flood = wanopt_proto::MAX_QUEUED_CONTROL + 5000;
    let mut buf = BytesMut::new();
    for i in 0..flood as u64 {
        Frame::Ping { payload: i }.encode(&mut buf);
    }
    let frame = buf.len() / flood;
    p.east
        .link
        .handle_input_buf(&mut buf, p.now)
        .expect("pings");
    assert!(p.east.link.replies_backed_up());
    // Whole frames wait unread: the replies queued stop at the bound.
    let waiting = buf.len() / frame;
    assert!(waiting >= 4000, "{waiting} pings wait");
    p.east
        .link
        .handle_input_buf(&mut buf, p.now)
        .expect("still paused");
    assert_eq!(
        buf.len() / frame,
        waiting,
        "nothing more is taken while paused"
    );
    // Once the pongs are out, the rest is read.
    p.drive(Duration::from_secs(2));
    assert!(!p.east.link.replies_backed_up());
    p.east
        .link
        .handle_input_buf(&mut buf, p.now)
        .expect("the rest");
    assert!(buf.is_empty());
    assert!(p.east.link.is_open() && p.west.link.is_open());
    p.assert_no_leaks();
}
