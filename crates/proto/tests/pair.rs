//! Two `Link` state machines wired together in memory, with virtual time, one-way latency and a
//! bottleneck rate, in the manner of quinn-proto's `Pair`. Each test ends by asserting that nothing
//! leaked: no stream left open and no byte left buffered on either side.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use wanopt_proto::{CacheStorage, ChunkStore, SavedCache, SavedState, StateRequest};
use wanopt_proto::{
    Class, CloseCode, CodecCount, CodecSettings, Compression, Event, Frame, Hello, LANES, Link,
    LinkConfig, LinkError, Pressure, ReadOutcome, ResetCode, Role, Scope, Snapshot, StreamId,
    StreamPolicy,
};

/// One direction of the emulated wire.
struct Pipe {
    latency: Duration,
    /// Bytes per second; serialization delay is applied per transmitted batch.
    rate: u64,
    busy_until: Instant,
    in_flight: VecDeque<(Instant, Bytes)>,
}

impl Pipe {
    /// A kernel-like send buffer: the side may hand over more bytes only while less than this much
    /// is waiting to be serialized (as with `TCP_NOTSENT_LOWAT`).
    fn has_room(&self, now: Instant) -> bool {
        let backlog = self.busy_until.saturating_duration_since(now);
        backlog.as_nanos() * u128::from(self.rate) / 1_000_000_000 < MTU_BATCH as u128
    }

    fn send(&mut self, now: Instant, b: Bytes) {
        let start = self.busy_until.max(now);
        let ser = Duration::from_nanos(b.len() as u64 * 1_000_000_000 / self.rate);
        self.busy_until = start + ser;
        self.in_flight
            .push_back((self.busy_until + self.latency, b));
    }
}

/// What a simulated application does with a side's streams.
#[derive(Default)]
struct App {
    /// Bytes received per stream.
    received: HashMap<StreamId, Vec<u8>>,
    /// Streams whose end was read.
    fin: Vec<StreamId>,
    /// Bytes still to write per stream, and whether to finish afterwards.
    to_send: HashMap<StreamId, (Bytes, bool)>,
    opened: Vec<(StreamId, String)>,
    resets: Vec<(StreamId, ResetCode)>,
    refused: Vec<String>,
    closed: Option<Option<LinkError>>,
    up: bool,
    /// When false the application does not read (a slow reader).
    paused: bool,
    /// When each stream's first byte arrived (virtual time).
    first_byte: HashMap<StreamId, Instant>,
    /// Cache states the link asked to save.
    checkpoints: Vec<(Role, usize, Arc<str>, Arc<Snapshot>)>,
    /// Cache states the link asked to load, and when.
    loads: Option<(Instant, Vec<StateRequest>)>,
}

struct Side {
    link: Link,
    app: App,
    /// Partial frames received per lane.
    inbufs: [BytesMut; LANES],
    /// Where saved states are loaded from, as the runtime does on a blocking thread.
    storage: Option<Arc<TestStorage>>,
    /// How long a load takes (virtual time): frames arriving meanwhile wait in `inbufs`.
    load_delay: Duration,
    /// How long a slow store's reads take (virtual time), and when the waiting ones are done.
    store_delay: Duration,
    store_due: Option<Instant>,
}

impl Side {
    fn new(link: Link) -> Side {
        Side {
            link,
            app: App::default(),
            inbufs: Default::default(),
            storage: None,
            load_delay: Duration::ZERO,
            store_delay: Duration::ZERO,
            store_due: None,
        }
    }

    fn slow_reads(&self) -> Option<Arc<Mutex<SlowReads>>> {
        self.storage.as_ref()?.slow.lock().expect("lock").clone()
    }

    /// Finishes a slow store's waiting reads once they are due, and tells the link.
    fn answer_reads(&mut self, now: Instant) -> bool {
        let Some(reads) = self.slow_reads() else {
            return false;
        };
        let mut r = reads.lock().expect("lock");
        if r.waiting.is_empty() {
            return false;
        }
        let due = *self.store_due.get_or_insert(now + self.store_delay);
        if due > now {
            return false;
        }
        let w = std::mem::take(&mut r.waiting);
        r.done.extend(w);
        drop(r);
        self.store_due = None;
        self.link.store_ready();
        true
    }

    /// When the states being loaded are in, if any are.
    fn load_due(&self) -> Option<Instant> {
        self.app.loads.as_ref().map(|(t, _)| *t + self.load_delay)
    }

    /// Hands the link the states it asked for once they are due, and feeds it what waited.
    fn answer_loads(&mut self, now: Instant) -> bool {
        if self.load_due().is_none_or(|t| t > now) {
            return false;
        }
        let Some((_, reqs)) = self.app.loads.take() else {
            return false;
        };
        let states = reqs
            .into_iter()
            .map(|r| {
                let s = self.storage.as_ref().and_then(|st| st.load(&r.digest));
                (r, s)
            })
            .collect();
        self.link.states_loaded(states);
        for lane in 0..LANES {
            let buf = &mut self.inbufs[lane];
            if !buf.is_empty() {
                let _ = self.link.handle_lane_input(lane, buf, now);
            }
        }
        true
    }
}

struct Pair {
    now: Instant,
    west: Side,
    east: Side,
    /// One pipe per lane each way (lane 1 carries nothing until attached).
    w2e: [Pipe; LANES],
    e2w: [Pipe; LANES],
}

const MTU_BATCH: usize = 16 * 1024;

impl Pair {
    fn new(latency: Duration, rate: u64) -> Pair {
        Self::with(latency, rate, |_| {}, |_| {})
    }

    fn with(
        latency: Duration,
        rate: u64,
        fw: impl FnOnce(&mut LinkConfig),
        fe: impl FnOnce(&mut LinkConfig),
    ) -> Pair {
        let now = Instant::now();
        let mut cw = LinkConfig::new("west", "east", true);
        let mut ce = LinkConfig::new("east", "west", false);
        fw(&mut cw);
        fe(&mut ce);
        let mut west = Link::new(cw);
        let mut east = Link::new(ce);
        west.set_services(["w-svc"]);
        east.set_services(["e-svc", "e-lat"]);
        let pipe = || Pipe {
            latency,
            rate,
            busy_until: now,
            in_flight: VecDeque::new(),
        };
        Pair {
            now,
            west: Side::new(west),
            east: Side::new(east),
            w2e: [pipe(), pipe()],
            e2w: [pipe(), pipe()],
        }
    }

    /// Runs until both sides are quiet or `limit` of virtual time passes. Each side's timers run
    /// when due (keepalive pings, idle timeout, checkpoints), as the runtime's writer runs them.
    fn drive(&mut self, limit: Duration) {
        let end = self.now + limit;
        loop {
            let mut progress = false;
            for side in [&mut self.west, &mut self.east] {
                if side.link.poll_timeout().is_some_and(|t| t <= self.now) {
                    side.link.handle_timeout(self.now);
                    progress = true;
                }
                progress |= side.answer_loads(self.now);
                progress |= side.answer_reads(self.now);
            }
            progress |= step_side(&mut self.west, &mut self.w2e, self.now);
            progress |= step_side(&mut self.east, &mut self.e2w, self.now);
            // Deliver what is due.
            for lane in 0..LANES {
                progress |= deliver(&mut self.w2e[lane], &mut self.east, lane, self.now);
                progress |= deliver(&mut self.e2w[lane], &mut self.west, lane, self.now);
            }
            if progress {
                continue;
            }
            let mut next = self
                .w2e
                .iter()
                .chain(self.e2w.iter())
                .filter_map(|p| p.in_flight.front())
                .map(|(t, _)| *t)
                .chain(self.west.link.poll_timeout())
                .chain(self.east.link.poll_timeout())
                .chain(self.west.load_due())
                .chain(self.east.load_due())
                .chain(self.west.store_due)
                .chain(self.east.store_due)
                .min();
            for (side, pipes) in [(&self.west, &self.w2e), (&self.east, &self.e2w)] {
                for (lane, pipe) in pipes.iter().enumerate() {
                    if side.link.wants_transmit_lane(lane) && pipe.busy_until > self.now {
                        next = Some(next.map_or(pipe.busy_until, |t| t.min(pipe.busy_until)));
                    }
                }
            }
            match next {
                Some(t) if t <= end => self.now = t,
                _ => break,
            }
        }
    }

    fn assert_no_leaks(&self) {
        for (name, s) in [("west", &self.west), ("east", &self.east)] {
            assert_eq!(s.link.stream_count(), 0, "{name} leaked streams");
            assert_eq!(s.link.buffered_bytes(), 0, "{name} leaked buffered bytes");
        }
    }
}

fn deliver(pipe: &mut Pipe, to: &mut Side, lane: usize, now: Instant) -> bool {
    let mut any = false;
    while pipe.in_flight.front().is_some_and(|(t, _)| *t <= now) {
        let Some((_, b)) = pipe.in_flight.pop_front() else {
            break;
        };
        let buf = &mut to.inbufs[lane];
        buf.extend_from_slice(&b);
        let _ = to.link.handle_lane_input(lane, buf, now);
        any = true;
    }
    any
}

/// One round of the application and transmit logic for a side. Returns true if anything happened.
fn step_side(side: &mut Side, pipes: &mut [Pipe; LANES], now: Instant) -> bool {
    let mut progress = false;
    while let Some(ev) = side.link.poll_event() {
        progress = true;
        match ev {
            Event::Up { .. } => side.app.up = true,
            Event::Opened {
                stream, service, ..
            } => side.app.opened.push((stream, service.to_string())),
            Event::Refused { service, .. } => side.app.refused.push(service),
            Event::Reset { stream, code, .. } => side.app.resets.push((stream, code)),
            Event::Closed(e) => side.app.closed = Some(e),
            Event::Checkpoint {
                role,
                lane,
                scope,
                state,
            } => side.app.checkpoints.push((role, lane, scope, state)),
            Event::LoadStates(reqs) => side.app.loads = Some((now, reqs)),
            Event::Readable(_) | Event::Writable(_) | Event::Done(_) => {}
        }
    }
    // Write what is pending.
    let ids: Vec<StreamId> = side.app.to_send.keys().copied().collect();
    for id in ids {
        let Some((buf, fin)) = side.app.to_send.get_mut(&id) else {
            continue;
        };
        if !buf.is_empty() {
            match side.link.write(id, buf) {
                Ok(n) if n > 0 => {
                    let _ = buf.split_to(n);
                    progress = true;
                }
                Ok(_) => {}
                Err(_) => {
                    side.app.to_send.remove(&id);
                    continue;
                }
            }
        }
        if buf.is_empty() {
            if *fin {
                let _ = side.link.finish(id);
            } else {
                // The application paused: what it wrote must not wait for a chunk boundary.
                side.link.flush(id);
            }
            side.app.to_send.remove(&id);
            progress = true;
        }
    }
    // Read everything readable.
    if !side.app.paused {
        let ids: Vec<StreamId> = side
            .app
            .opened
            .iter()
            .map(|(id, _)| *id)
            .chain(side.app.received.keys().copied())
            .collect();
        for id in ids {
            loop {
                match side.link.read(id) {
                    Ok(ReadOutcome::Data(b)) => {
                        side.app.first_byte.entry(id).or_insert(now);
                        side.app
                            .received
                            .entry(id)
                            .or_default()
                            .extend_from_slice(&b);
                        progress = true;
                    }
                    Ok(ReadOutcome::Fin) => {
                        if !side.app.fin.contains(&id) {
                            side.app.fin.push(id);
                            progress = true;
                        }
                        break;
                    }
                    Ok(ReadOutcome::Blocked) | Err(_) => break,
                }
            }
        }
    }
    let mut out = BytesMut::new();
    for (lane, pipe) in pipes.iter_mut().enumerate() {
        while pipe.has_room(now) {
            let n = side.link.poll_transmit_lane(lane, &mut out, MTU_BATCH);
            if n == 0 {
                break;
            }
            pipe.send(now, out.split().freeze());
            progress = true;
        }
    }
    progress
}

fn pattern(seed: u64, len: usize) -> Bytes {
    wanopt_codec::testdata::noise(seed, len).into()
}

fn up_pair() -> Pair {
    let mut p = Pair::new(Duration::from_millis(50), 5_625_000);
    p.drive(Duration::from_secs(1));
    assert!(p.west.app.up && p.east.app.up, "hello exchange failed");
    p
}

/// A pair whose latency lane is attached, as the runtime does after the second connection's
/// hello presented the listener's token.
fn laned_pair() -> Pair {
    let mut p = Pair::with(
        Duration::from_millis(50),
        5_625_000,
        |c| c.token = 0,
        |c| c.token = 0x5eed_cafe,
    );
    p.drive(Duration::from_secs(1));
    let token = p.west.link.lane_offer().expect("east offers a lane");
    assert_eq!(token, 0x5eed_cafe);
    assert!(
        !p.east.link.attach_lane(token ^ 1),
        "a wrong token must not attach"
    );
    assert!(p.east.link.attach_lane(token));
    assert!(p.west.link.attach_lane(token));
    assert!(p.west.link.lane_offer().is_none());
    p
}

/// Opens a west→east stream, sends `data` with fin, and has east answer `reply` with fin.
fn open_and_send(p: &mut Pair, service: &str, class: Class, data: Bytes) -> StreamId {
    let id = p.west.link.open(service, class).expect("open");
    p.west.app.to_send.insert(id, (data, true));
    p.west.app.received.entry(id).or_default();
    id
}

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
    assert!(p.west.link.send_queued(id) <= 256 * 1024);
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
    })
    .encode(&mut buf);
    let err = link.handle_input(&buf, now).expect_err("mismatch");
    assert!(
        matches!(err, LinkError::VersionMismatch { theirs: 9, .. }),
        "{err}"
    );
    // The GoAway tells the other side why.
    let mut out = BytesMut::new();
    link.poll_transmit(&mut out, 4096);
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
}

#[test]
fn garbage_closes_the_link_without_panicking() {
    let mut link = Link::new(LinkConfig::new("east", "west", false));
    let err = link.handle_input(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", Instant::now());
    assert!(err.is_err());
    assert!(link.is_closed());
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
    assert_eq!(p.east.link.stream_count(), 0);
    assert_eq!(p.west.link.stream_count(), 0);
}

/// Opens streams of the given (up, down, latency?) sizes west→east, has east answer each, and
/// checks every byte both ways and that nothing leaked.
fn exchange_streams(mut p: Pair, sizes: &[(usize, usize, bool)]) -> Result<(), TestCaseError> {
    let mut expect = Vec::new();
    for (i, (up, down, lat)) in sizes.iter().enumerate() {
        let class = if *lat { Class::Latency } else { Class::Bulk };
        let id = open_and_send(
            &mut p,
            if *lat { "e-lat" } else { "e-svc" },
            class,
            pattern(i as u64, *up),
        );
        expect.push((id, *up, *down, i as u64));
    }
    p.drive(Duration::from_secs(5));
    for (id, _, down, seed) in &expect {
        p.east
            .app
            .to_send
            .insert(*id, (pattern(seed + 1000, *down), true));
    }
    p.drive(Duration::from_secs(60));
    for (id, up, down, seed) in &expect {
        let got_up = p.east.app.received.get(id).cloned().unwrap_or_default();
        prop_assert!(got_up == pattern(*seed, *up)[..]);
        prop_assert!(p.west.app.received[id] == pattern(seed + 1000, *down)[..]);
        prop_assert!(p.east.app.fin.contains(id) && p.west.app.fin.contains(id));
    }
    p.assert_no_leaks();
    Ok(())
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
}

// ---- The optimization codec on the link ----

fn codec(cache: u64) -> CodecSettings {
    CodecSettings {
        cache_bytes: cache,
        service_cache_bytes: cache / 2,
        ..CodecSettings::default()
    }
}

/// A pair whose both sides optimize, with the given shared cache size.
fn coded_pair(cache: u64, laned: bool) -> Pair {
    let mut p = Pair::with(
        Duration::from_millis(20),
        50_000_000,
        |c| {
            c.codec = Some(codec(cache));
            c.token = 0;
        },
        |c| {
            c.codec = Some(codec(cache));
            c.token = 7;
        },
    );
    p.drive(Duration::from_secs(1));
    assert!(p.west.app.up && p.east.app.up);
    if laned {
        assert!(p.east.link.attach_lane(7) && p.west.link.attach_lane(7));
    }
    p
}

/// West sends `data` to east on a link-bound coded pair whose sides have these long contexts
/// (`None`: a build without them); returns the wire bytes.
fn send_with_long(
    west: Option<wanopt_proto::LongContext>,
    east: Option<wanopt_proto::LongContext>,
    data: &Bytes,
) -> u64 {
    let mut p = Pair::with(
        Duration::from_millis(20),
        50_000_000,
        |c| {
            c.codec = Some(CodecSettings {
                long_context: west,
                ..codec(64 << 20)
            })
        },
        |c| {
            c.codec = Some(CodecSettings {
                long_context: east,
                ..codec(64 << 20)
            })
        },
    );
    p.drive(Duration::from_secs(1));
    assert!(p.west.app.up && p.east.app.up);
    p.west.link.set_pressure(Pressure::LinkBound);
    let wire = send_once(&mut p, "e-svc", Class::Bulk, data);
    p.assert_no_leaks();
    wire
}

#[test]
fn long_contexts_are_used_only_toward_a_peer_that_offers_them() {
    // Rows whose repeats lie further apart than a chunk: what a long context is for.
    let data: Bytes = (0..200_000u32)
        .flat_map(|i| {
            format!(
                "{:08} ORDER {:06} customer-{:05} item {:04} qty {:03} status {}\n",
                i,
                (i * 7919) % 1_000_000,
                (i * 31) % 40_000,
                (i * 17) % 5000,
                i % 97,
                ["NEW", "PAID", "SHIPPED", "CLOSED"][(i % 4) as usize]
            )
            .into_bytes()
        })
        .collect::<Vec<u8>>()
        .into();
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

/// Sends `first`, then `second` on a new stream, west to east with deltas on or off on each
/// side; returns the wire bytes of the second and west's delta chunks.
fn send_with_delta(west: bool, east: bool, first: &Bytes, second: &Bytes) -> (u64, u64) {
    let on = |on: bool| CodecSettings {
        delta_bytes: if on { 64 << 20 } else { 0 },
        ..codec(64 << 20)
    };
    let mut p = Pair::with(
        Duration::from_millis(20),
        50_000_000,
        |c| c.codec = Some(on(west)),
        |c| c.codec = Some(on(east)),
    );
    p.drive(Duration::from_secs(1));
    assert!(p.west.app.up && p.east.app.up);
    p.west.link.set_pressure(Pressure::LinkBound);
    send_once(&mut p, "e-svc", Class::Bulk, first);
    let wire = send_once(&mut p, "e-svc", Class::Bulk, second);
    let deltas = counts(&mut p.west.link).sent.delta_chunks;
    p.assert_no_leaks();
    (wire, deltas)
}

#[test]
fn deltas_are_used_only_when_both_sides_offer_them() {
    // Blocks of rows with random fields (compressing to about a third, as real rows do).
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut first = Vec::with_capacity(256 * 8192);
    for b in 0..256 {
        while first.len() < (b + 1) * 8192 - 80 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let row = format!("{b:04}|{:020}|{:x}|OPEN\n", x % 99_999_999_999, x >> 20);
            first.extend_from_slice(row.as_bytes());
        }
        first.resize((b + 1) * 8192, b' ');
    }
    let first = Bytes::from(first);
    // The same blocks after updates: a few bytes changed in each.
    let mut v = first.to_vec();
    for b in 0..256 {
        v[b * 8192 + 300 + (b * 37) % 6000] ^= 0x20;
        v[b * 8192 + 5000] = b'X';
    }
    let second = Bytes::from(v);
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
    let mut p = Pair::with(
        Duration::from_millis(20),
        50_000_000,
        |c| {
            c.codec = Some(CodecSettings {
                delta_bytes: store,
                ..codec(64 << 20)
            })
        },
        |c| c.codec = Some(codec(64 << 20)),
    );
    p.drive(Duration::from_secs(1));
    p.west.link.set_pressure(Pressure::LinkBound);
    let bases = |p: &Pair| {
        p.west
            .link
            .cache_stats()
            .into_iter()
            .find(|s| s.role == "bases")
            .expect("a store of bases")
    };
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
        let mut p = Pair::with(
            Duration::from_millis(20),
            50_000_000,
            move |c| {
                c.codec = Some(codec(64 << 20));
                c.delta_bases = store;
            },
            |c| c.codec = Some(codec(64 << 20)),
        );
        p.drive(Duration::from_secs(1));
        p.west.link.set_pressure(Pressure::LinkBound);
        p
    };
    let held = |p: &Pair| {
        p.west
            .link
            .cache_stats()
            .into_iter()
            .find(|s| s.role == "bases")
            .map(|s| s.bytes)
    };
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

fn counts(link: &mut Link) -> CodecCount {
    let mut total = CodecCount::default();
    for (_, c) in link.take_codec_counts() {
        total.sent.merge(&c.sent);
        total.needs += c.needs;
        total.resent += c.resent;
    }
    total
}

/// Sends `data` west→east on a new stream with fin, has east finish too, and returns the wire
/// bytes west sent for it.
fn send_once(p: &mut Pair, service: &str, class: Class, data: &Bytes) -> u64 {
    let before = p.west.link.link_wire().0;
    let id = open_and_send(p, service, class, data.clone());
    p.drive(Duration::from_secs(60));
    assert!(
        p.east
            .app
            .received
            .get(&id)
            .is_some_and(|r| r[..] == data[..]),
        "bytes differ"
    );
    assert!(p.east.app.fin.contains(&id));
    p.east.app.to_send.insert(id, (Bytes::new(), true));
    p.drive(Duration::from_secs(5));
    p.west.link.link_wire().0 - before
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
    let mut p = coded_pair(16 << 20, false);
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

#[test]
fn coded_frames_to_a_side_without_the_codec_close_the_link() {
    let mut p = up_pair();
    let id = p.west.link.open("e-svc", Class::Bulk).expect("open");
    p.drive(Duration::from_secs(1));
    let mut buf = BytesMut::new();
    Frame::Coded {
        stream: id,
        offset: 0,
        fin: false,
        scoped: false,
        raw_len: 3,
        records: Bytes::from_static(&[1, 0, 0, 0, 3, b'a', b'b', b'c']),
    }
    .encode(&mut buf);
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
    let mut buf = BytesMut::new();
    Frame::Coded {
        stream: id,
        offset: 0,
        fin: false,
        scoped: false,
        raw_len: 10,
        records: Bytes::from_static(&[1, 0, 0, 0, 3, b'a', b'b', b'c']),
    }
    .encode(&mut buf);
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

/// A side's storage as the daemon keeps it: disk stores (in memory here, damageable) and the
/// states saved at checkpoints, newest first.
#[derive(Debug, Default)]
struct TestStorage {
    stores: Mutex<HashMap<(usize, String), wanopt_codec::store::MemStore>>,
    saved: Mutex<Vec<SavedCache>>,
    states: Mutex<HashMap<[u8; 16], Arc<Snapshot>>>,
    /// With `Some`, reads are slow, as the daemon's store thread on a slow disk: see [`SlowStore`].
    slow: Mutex<Option<Arc<Mutex<SlowReads>>>>,
}

/// The reads a [`SlowStore`] was asked for and the ones it finished.
#[derive(Debug, Default)]
struct SlowReads {
    waiting: Vec<(u32, u64)>,
    done: Vec<(u32, u64)>,
    /// Reads answered `Pending` in all.
    pending: u64,
}

/// A disk tier whose reads are not ready at once: `try_read` answers `Pending` until the harness
/// finishes the reads (after the side's `store_delay` of virtual time) and calls
/// `Link::store_ready`, as the runtime does when its store thread has read them.
#[derive(Debug)]
struct SlowStore {
    inner: wanopt_codec::store::MemStore,
    reads: Arc<Mutex<SlowReads>>,
}

impl ChunkStore for SlowStore {
    fn append(&mut self, f: &[u8; 16], data: &[u8]) -> Option<wanopt_codec::store::Loc> {
        self.inner.append(f, data)
    }
    fn read(&mut self, loc: wanopt_codec::store::Loc, f: &[u8; 16]) -> Option<Vec<u8>> {
        self.inner.read(loc, f)
    }
    fn try_read(
        &mut self,
        loc: wanopt_codec::store::Loc,
        f: &[u8; 16],
    ) -> std::task::Poll<Option<Vec<u8>>> {
        let key = (loc.seg, loc.off);
        let mut r = self.reads.lock().expect("lock");
        if let Some(i) = r.done.iter().position(|k| *k == key) {
            r.done.swap_remove(i);
            return std::task::Poll::Ready(self.inner.read(loc, f));
        }
        if !r.waiting.contains(&key) {
            r.waiting.push(key);
            r.pending += 1;
        }
        std::task::Poll::Pending
    }
    fn remove_segment(&mut self, seg: u32) {
        self.inner.remove_segment(seg);
    }
    fn segments(&self) -> Vec<(u32, u64)> {
        self.inner.segments()
    }
    fn segment_limit(&self) -> u64 {
        self.inner.segment_limit()
    }
}

impl TestStorage {
    fn mem(&self, lane: usize, scope: &str) -> wanopt_codec::store::MemStore {
        self.stores
            .lock()
            .expect("lock")
            .entry((lane, scope.to_string()))
            .or_insert_with(|| wanopt_codec::store::MemStore::new(1 << 20))
            .clone()
    }

    /// Keeps what a side's link asked to save, as the runtime writes it to disk.
    fn keep(&self, app: &mut App) {
        let mut saved = self.saved.lock().expect("lock");
        for (role, lane, scope, snap) in app.checkpoints.drain(..) {
            let state = SavedState {
                digest: snap.digest(),
                capacity: snap.capacity,
            };
            self.states.lock().expect("lock").insert(state.digest, snap);
            match saved
                .iter_mut()
                .find(|c| c.role == role && c.lane == lane && c.scope == scope)
            {
                Some(c) => c.states.insert(0, state),
                None => saved.push(SavedCache {
                    role,
                    lane,
                    scope,
                    states: vec![state],
                }),
            }
        }
    }
}

impl TestStorage {
    fn saved(&self) -> Vec<SavedCache> {
        self.saved.lock().expect("lock").clone()
    }
    fn load(&self, digest: &[u8; 16]) -> Option<Snapshot> {
        self.states
            .lock()
            .expect("lock")
            .get(digest)
            .map(|s| (**s).clone())
    }
}

impl CacheStorage for TestStorage {
    fn store(&self, lane: usize, scope: &str) -> Option<Box<dyn ChunkStore>> {
        let inner = self.mem(lane, scope);
        Some(match self.slow.lock().expect("lock").clone() {
            Some(reads) => Box::new(SlowStore { inner, reads }),
            None => Box::new(inner),
        })
    }
}

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
    let mut p = stored_pair(&ws, &es);
    p.west.link.set_policies(scoped());
    let first = send_once(&mut p, "e-svc", Class::Bulk, &data);
    shut_down(p, &ws, &es);
    assert!(
        es.saved()
            .iter()
            .any(|c| c.role == Role::Decoder && &*c.scope == "e-svc"),
        "the service's own cache was saved"
    );
    let mut p = stored_pair(&ws, &es);
    p.west.link.set_policies(scoped());
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

#[test]
fn repeated_checkpoints_from_a_peer_cost_nothing_and_save_once() {
    let (ws, es) = (
        Arc::new(TestStorage::default()),
        Arc::new(TestStorage::default()),
    );
    let mut p = stored_pair(&ws, &es);
    send_once(&mut p, "e-svc", Class::Bulk, &pattern(13, 1 << 20));
    // West's periodic checkpoint (60 s by default), in virtual time with the link kept alive.
    p.drive(Duration::from_secs(66));
    let saved: Vec<_> = p
        .east
        .app
        .checkpoints
        .iter()
        .filter(|c| c.0 == Role::Decoder)
        .map(|c| c.3.digest())
        .collect();
    assert_eq!(saved.len(), 1, "the decoder saved its state once");
    // The same checkpoint again and again (a misbehaving peer): judged once, never saved again.
    let mut buf = BytesMut::new();
    Frame::Checkpoint {
        scope: String::new(),
        digest: saved[0],
    }
    .encode(&mut buf);
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
