//! The two-peer harness of the link tests: two `Link` state machines wired together in memory,
//! with virtual time, one-way latency and a bottleneck rate, in the manner of quinn-proto's
//! `Pair`, and cache storage in memory. Each test ends by asserting that nothing leaked.
#![allow(dead_code, unused_imports)]

pub use std::collections::{HashMap, VecDeque};
pub use std::sync::{Arc, Mutex};
pub use std::time::{Duration, Instant};

pub use bytes::{Bytes, BytesMut};
pub use proptest::prelude::*;
pub use proptest::test_runner::TestCaseError;
pub use wanopt_proto::{CacheStorage, ChunkStore, SavedCache, SavedState, StateRequest};
pub use wanopt_proto::{
    Class, CloseCode, CodecCount, CodecSettings, Compression, Event, Frame, Hello, LANES, Link,
    LinkConfig, LinkError, Pressure, ReadOutcome, ResetCode, Role, Scope, Snapshot, StreamId,
    StreamPolicy,
};

/// Makes a side resume its streams after a lost connection (30 s window), with the codec's
/// caches when `codec`.
pub fn resumable(c: &mut LinkConfig, codec: bool) {
    c.resume_window = Duration::from_secs(30);
    if codec {
        c.codec = Some(CodecSettings {
            cache_bytes: 64 << 20,
            service_cache_bytes: 32 << 20,
            ..CodecSettings::default()
        });
    }
}

/// One direction of the emulated wire.
pub struct Pipe {
    pub latency: Duration,
    /// Bytes per second; serialization delay is applied per transmitted batch.
    pub rate: u64,
    pub busy_until: Instant,
    pub in_flight: VecDeque<(Instant, Bytes)>,
    /// With `Some(d)`, the receiver reads only every so often (busy for `d` after the first
    /// bytes it finds): what arrives meanwhile is handed over at once, as a receiver behind
    /// its link reads what piled up.
    pub reads_every: Option<Duration>,
    /// The receiver's next read (see `reads_every`).
    pub read_at: Instant,
}

impl Pipe {
    /// A kernel-like send buffer: the side may hand over more bytes only while less than this much
    /// is waiting to be serialized (as with `TCP_NOTSENT_LOWAT`).
    pub fn has_room(&self, now: Instant) -> bool {
        let backlog = self.busy_until.saturating_duration_since(now);
        backlog.as_nanos() * u128::from(self.rate) / 1_000_000_000 < MTU_BATCH as u128
    }

    pub fn send(&mut self, now: Instant, b: Bytes) {
        let start = self.busy_until.max(now);
        let ser = Duration::from_nanos(b.len() as u64 * 1_000_000_000 / self.rate);
        self.busy_until = start + ser;
        let mut due = self.busy_until + self.latency;
        if let Some(d) = self.reads_every {
            if due > self.read_at {
                self.read_at = due + d;
            }
            due = self.read_at;
        }
        self.in_flight.push_back((due, b));
    }
}

/// What a simulated application does with a side's streams.
#[derive(Default)]
pub struct App {
    /// Bytes received per stream.
    pub received: HashMap<StreamId, Vec<u8>>,
    /// Streams whose end was read.
    pub fin: Vec<StreamId>,
    /// Bytes still to write per stream, and whether to finish afterwards.
    pub to_send: HashMap<StreamId, (Bytes, bool)>,
    pub opened: Vec<(StreamId, String)>,
    pub resets: Vec<(StreamId, ResetCode)>,
    pub refused: Vec<String>,
    pub closed: Option<Option<LinkError>>,
    pub up: bool,
    /// When false the application does not read (a slow reader).
    pub paused: bool,
    /// When each stream's first byte arrived (virtual time).
    pub first_byte: HashMap<StreamId, Instant>,
    /// Cache states the link asked to save.
    pub checkpoints: Vec<(Role, usize, Arc<str>, Arc<Snapshot>)>,
    /// Cache states the link asked to load, and when.
    pub loads: Option<(Instant, Vec<StateRequest>)>,
    /// Connections lost with the link suspended, and what each resumption did.
    pub suspended: u32,
    /// Times this side saw it had not run for a while (see `Event::Stalled`).
    pub stalled: u32,
    pub resumed: Vec<wanopt_proto::ResumeStats>,
}

pub struct Side {
    pub link: Link,
    pub app: App,
    /// Partial frames received per lane.
    pub inbufs: [BytesMut; LANES],
    /// Where saved states are loaded from, as the runtime does on a blocking thread.
    pub storage: Option<Arc<TestStorage>>,
    /// How long a load takes (virtual time): frames arriving meanwhile wait in `inbufs`.
    pub load_delay: Duration,
    /// How long a slow store's reads take (virtual time), and when the waiting ones are done.
    pub store_delay: Duration,
    pub store_due: Option<Instant>,
}

impl Side {
    pub fn new(link: Link) -> Side {
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

    pub fn slow_reads(&self) -> Option<Arc<Mutex<SlowReads>>> {
        self.storage.as_ref()?.slow.lock().expect("lock").clone()
    }

    /// Finishes a slow store's waiting reads once they are due, and tells the link.
    pub fn answer_reads(&mut self, now: Instant) -> bool {
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
    pub fn load_due(&self) -> Option<Instant> {
        self.app.loads.as_ref().map(|(t, _)| *t + self.load_delay)
    }

    /// Hands the link the states it asked for once they are due, and feeds it what waited.
    pub fn answer_loads(&mut self, now: Instant) -> bool {
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

pub struct Pair {
    pub now: Instant,
    pub west: Side,
    pub east: Side,
    /// One pipe per lane each way (lane 1 carries nothing until attached).
    pub w2e: [Pipe; LANES],
    pub e2w: [Pipe; LANES],
    /// With `Some`, the latency lane is carried by copies (see [`Copies`]), not by its pipes.
    pub copies: Option<Box<Copies>>,
}

pub const MTU_BATCH: usize = 16 * 1024;

impl Pair {
    pub fn new(latency: Duration, rate: u64) -> Pair {
        Self::with(latency, rate, |_| {}, |_| {})
    }

    pub fn with(
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
            reads_every: None,
            read_at: now,
        };
        Pair {
            now,
            west: Side::new(west),
            east: Side::new(east),
            w2e: [pipe(), pipe()],
            e2w: [pipe(), pipe()],
            copies: None,
        }
    }

    /// Runs until both sides are quiet or `limit` of virtual time passes. Each side's timers run
    /// when due (keepalive pings, idle timeout, checkpoints), as the runtime's writer runs them.
    pub fn drive(&mut self, limit: Duration) {
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
            // With copies, the latency lane's bytes go through them, not through its pipes.
            let lanes = if self.copies.is_some() { 1 } else { LANES };
            progress |= step_side(&mut self.west, &mut self.w2e[..lanes], self.now);
            progress |= step_side(&mut self.east, &mut self.e2w[..lanes], self.now);
            // Deliver what is due.
            for lane in 0..lanes {
                progress |= deliver(&mut self.w2e[lane], &mut self.east, lane, self.now);
                progress |= deliver(&mut self.e2w[lane], &mut self.west, lane, self.now);
            }
            if let Some(c) = self.copies.as_mut() {
                progress |= c.w2e.step(&mut self.west, &mut self.east, self.now);
                progress |= c.e2w.step(&mut self.east, &mut self.west, self.now);
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
            if let Some(c) = self.copies.as_ref() {
                for (wire, side) in [(&c.w2e, &self.west), (&c.e2w, &self.east)] {
                    next = [next, wire.next_time(side, self.now)]
                        .into_iter()
                        .flatten()
                        .min();
                }
            }
            for (side, pipes) in [(&self.west, &self.w2e), (&self.east, &self.e2w)] {
                for (lane, pipe) in pipes.iter().enumerate().take(lanes) {
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

    pub fn assert_no_leaks(&self) {
        for (name, s) in [("west", &self.west), ("east", &self.east)] {
            assert_eq!(s.link.stream_count(), 0, "{name} leaked streams");
            assert_eq!(s.link.buffered_bytes(), 0, "{name} leaked buffered bytes");
            assert_eq!(s.link.coded_backlog(), 0, "{name} leaked coded backlog");
            // What is kept to send again after a lost connection goes once the peer read it
            // (it says so with its pings at the latest).
            assert!(
                s.link.replay_kept() <= 4096,
                "{name} keeps {} bytes to send again",
                s.link.replay_kept()
            );
        }
    }
}

/// Hands `to` what arrived on `pipe` by `now`: all of it in one input call, up to what the
/// daemon's reader reads at once (512 KiB), as a reader finding it all ready would.
pub fn deliver(pipe: &mut Pipe, to: &mut Side, lane: usize, now: Instant) -> bool {
    const READ_BATCH: usize = 512 << 10;
    let mut any = false;
    while pipe.in_flight.front().is_some_and(|(t, _)| *t <= now) {
        let buf = &mut to.inbufs[lane];
        while buf.len() < READ_BATCH
            && pipe.in_flight.front().is_some_and(|(t, _)| *t <= now)
            && let Some((_, b)) = pipe.in_flight.pop_front()
        {
            buf.extend_from_slice(&b);
        }
        let _ = to.link.handle_lane_input(lane, buf, now);
        any = true;
    }
    any
}

/// One round of the application and transmit logic for a side. Returns true if anything happened.
pub fn step_side(side: &mut Side, pipes: &mut [Pipe], now: Instant) -> bool {
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
            Event::Suspended { .. } => side.app.suspended += 1,
            Event::Resumed(r) => side.app.resumed.push(r),
            Event::Stalled(_) => side.app.stalled += 1,
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
            // Every other take gathers several pieces at once, as the daemon's writer does
            // (never the end, which `read` gives once every byte is taken).
            let mut gather = false;
            loop {
                gather = !gather;
                let mut more = std::collections::VecDeque::new();
                if gather && side.link.read_more(id, &mut more, 8, 64 << 10) > 0 {
                    side.app.first_byte.entry(id).or_insert(now);
                    let got = side.app.received.entry(id).or_default();
                    for b in more {
                        got.extend_from_slice(&b);
                    }
                    progress = true;
                    continue;
                }
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
            let n = side.link.poll_transmit_lane(now, lane, &mut out, MTU_BATCH);
            if n == 0 {
                break;
            }
            pipe.send(now, out.split().freeze());
            progress = true;
        }
    }
    progress
}

pub fn pattern(seed: u64, len: usize) -> Bytes {
    wanopt_codec::testdata::noise(seed, len).into()
}

pub fn up_pair() -> Pair {
    let mut p = Pair::new(Duration::from_millis(50), 5_625_000);
    p.drive(Duration::from_secs(1));
    assert!(p.west.app.up && p.east.app.up, "hello exchange failed");
    p
}

/// A pair whose latency lane is attached, as the runtime does after the second connection's
/// hello presented the listener's token.
pub fn laned_pair() -> Pair {
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

/// 8 KiB blocks of rows with random fields (compressing to about a third, as real rows do),
/// then the same blocks with a few bytes changed in each.
pub fn changed_rows(n: usize) -> (Bytes, Bytes) {
    let first = wanopt_codec::testdata::rows(1, n);
    let second = wanopt_codec::testdata::edited(&first, 0);
    (first.into(), second.into())
}

/// A link's codec counts summed over its services (taken: the next call counts anew).
pub fn counts(link: &mut Link) -> CodecCount {
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
pub fn send_once(p: &mut Pair, service: &str, class: Class, data: &Bytes) -> u64 {
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

/// Opens a west→east stream, sends `data` with fin, and has east answer `reply` with fin.
pub fn open_and_send(p: &mut Pair, service: &str, class: Class, data: Bytes) -> StreamId {
    let id = p.west.link.open(service, class).expect("open");
    p.west.app.to_send.insert(id, (data, true));
    p.west.app.received.entry(id).or_default();
    id
}

/// A side's storage as the daemon keeps it: disk stores (in memory here, damageable) and the
/// states saved at checkpoints, newest first.
#[derive(Debug, Default)]
pub struct TestStorage {
    pub stores: Mutex<HashMap<(usize, String), wanopt_codec::store::MemStore>>,
    pub saved: Mutex<Vec<SavedCache>>,
    pub states: Mutex<HashMap<[u8; 16], Arc<Snapshot>>>,
    /// With `Some`, reads are slow, as the daemon's store thread on a slow disk: see [`SlowStore`].
    pub slow: Mutex<Option<Arc<Mutex<SlowReads>>>>,
}

/// The reads a [`SlowStore`] was asked for and the ones it finished.
#[derive(Debug, Default)]
pub struct SlowReads {
    pub waiting: Vec<(u32, u64)>,
    pub done: Vec<(u32, u64)>,
    /// Reads answered `Pending` in all.
    pub pending: u64,
}

/// A disk tier whose reads are not ready at once: `try_read` answers `Pending` until the harness
/// finishes the reads (after the side's `store_delay` of virtual time) and calls
/// `Link::store_ready`, as the runtime does when its store thread has read them.
#[derive(Debug)]
pub struct SlowStore {
    pub inner: wanopt_codec::store::MemStore,
    pub reads: Arc<Mutex<SlowReads>>,
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
    pub fn mem(&self, lane: usize, scope: &str) -> wanopt_codec::store::MemStore {
        self.stores
            .lock()
            .expect("lock")
            .entry((lane, scope.to_string()))
            .or_insert_with(|| wanopt_codec::store::MemStore::new(1 << 20))
            .clone()
    }

    /// Keeps what a side's link asked to save, as the runtime writes it to disk.
    pub fn keep(&self, app: &mut App) {
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
    pub fn saved(&self) -> Vec<SavedCache> {
        self.saved.lock().expect("lock").clone()
    }
    pub fn load(&self, digest: &[u8; 16]) -> Option<Snapshot> {
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

/// Opens streams of the given (up, down, latency?) sizes west→east, has east answer each, and
/// checks every byte both ways and that nothing leaked.
pub fn exchange_streams(mut p: Pair, sizes: &[(usize, usize, bool)]) -> Result<(), TestCaseError> {
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

/// One direction of a latency lane carried by copies (`wanopt_proto::copies`): the sender's
/// fanout, a connection per copy with its own loss, and the receiver's merge. The link's lane
/// bytes are taken only when a copy has written all it had, as the runtime's writers do.
pub struct CopyWire {
    pub fanout: wanopt_proto::copies::Fanout,
    pub merge: wanopt_proto::copies::Merge,
    pub pipes: [Option<CopyPipe>; wanopt_proto::copies::MAX_COPIES],
    /// Every byte the link produced for the lane, and every byte merged for the peer.
    pub produced: Vec<u8>,
    pub merged: Vec<u8>,
    /// Merge errors seen (a copy too far ahead).
    pub errors: Vec<String>,
    /// Time between the copies of a write (see `Fanout::not_before`).
    pub spacing: Duration,
    /// Bursts of loss on the path all copies share: a batch any copy sends inside one is lost
    /// (it arrives its pipe's stall late), as a queue overflowing or a fade loses a run of
    /// packets whatever connection they belong to.
    pub bursts: Vec<(Instant, Instant)>,
    /// The lane's datagrams, if it sends them.
    pub datagrams: Option<DatagramPath>,
}

/// The lane's datagrams (`wanopt_proto::datagram`): each write cut into pieces of at most
/// `PIECE_MAX` bytes at their lane offsets, each sent at the times of `sends` after the write
/// on the path the copies share (a piece sent inside a burst is lost) with a loss of its own,
/// never sent again; a piece that arrives goes to the merge, whatever the copies brought.
pub struct DatagramPath {
    pub latency: Duration,
    pub loss: f64,
    pub sends: Vec<Duration>,
    rng: u64,
    /// (arrival, lane offset, piece)
    in_flight: Vec<(Instant, u64, Bytes)>,
}

impl DatagramPath {
    /// Sent as the runtime sends them: at once, then half a `spacing` and one and a half later
    /// (5 ms for copies back to back).
    pub fn new(latency: Duration, loss: f64, spacing: Duration, seed: u64) -> DatagramPath {
        let spacing = if spacing.is_zero() {
            Duration::from_millis(5)
        } else {
            spacing
        };
        DatagramPath {
            latency,
            loss,
            sends: vec![Duration::ZERO, spacing / 2, spacing * 3 / 2],
            rng: seed | 1,
            in_flight: Vec::new(),
        }
    }

    fn coin(&mut self) -> f64 {
        // xorshift64*
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        (self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Sends the lane bytes `bytes` produced at `offset`, from `now`; a send inside one of
    /// `bursts` is lost.
    fn send(&mut self, now: Instant, offset: u64, bytes: &Bytes, bursts: &[(Instant, Instant)]) {
        use wanopt_proto::datagram::PIECE_MAX;
        let mut at = 0;
        while at < bytes.len() {
            let piece = bytes.slice(at..bytes.len().min(at + PIECE_MAX));
            for k in 0..self.sends.len() {
                let t = now + self.sends[k];
                let burst = bursts.iter().any(|(a, b)| *a <= t && t < *b);
                let lost = burst || (self.loss > 0.0 && self.coin() < self.loss);
                if !lost {
                    let arrival = t + self.latency;
                    self.in_flight
                        .push((arrival, offset + at as u64, piece.clone()));
                }
            }
            at += piece.len();
        }
    }

    /// The pieces arrived by `now`, in the order they arrive.
    fn arrived(&mut self, now: Instant) -> Vec<(u64, Bytes)> {
        let mut due: Vec<(Instant, u64, Bytes)> = Vec::new();
        self.in_flight.retain(|d| {
            if d.0 <= now {
                due.push(d.clone());
                false
            } else {
                true
            }
        });
        due.sort_by_key(|d| d.0);
        due.into_iter().map(|(_, o, b)| (o, b)).collect()
    }
}

/// One copy's connection: in order, like TCP, and a batch lost with probability `loss`
/// arrives `stall` late, holding up what follows it on this copy only.
pub struct CopyPipe {
    pub pipe: Pipe,
    pub loss: f64,
    pub stall: Duration,
    pub rng: u64,
    /// No batch arrives before the one sent ahead of it.
    pub floor: Instant,
}

impl CopyPipe {
    pub fn new(now: Instant, latency: Duration, rate: u64, loss: f64, seed: u64) -> CopyPipe {
        CopyPipe {
            pipe: Pipe {
                latency,
                rate,
                busy_until: now,
                in_flight: VecDeque::new(),
                reads_every: None,
                read_at: now,
            },
            loss,
            stall: latency * 4,
            rng: seed | 1,
            floor: now,
        }
    }

    fn coin(&mut self) -> f64 {
        // xorshift64*
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        (self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }

    fn send(&mut self, now: Instant, b: Bytes, burst: bool) {
        self.pipe.send(now, b);
        let lost = burst || (self.loss > 0.0 && self.coin() < self.loss);
        if let Some(last) = self.pipe.in_flight.back_mut() {
            if lost {
                last.0 += self.stall;
            }
            last.0 = last.0.max(self.floor);
            self.floor = last.0;
        }
    }
}

impl CopyWire {
    pub fn new() -> CopyWire {
        use wanopt_proto::copies::{COPY_LAG_LIMIT, Fanout, Merge};
        CopyWire {
            fanout: Fanout::new(COPY_LAG_LIMIT),
            merge: Merge::new(COPY_LAG_LIMIT),
            pipes: Default::default(),
            produced: Vec::new(),
            merged: Vec::new(),
            errors: Vec::new(),
            spacing: Duration::ZERO,
            bursts: Vec::new(),
            datagrams: None,
        }
    }

    fn in_burst(&self, now: Instant) -> bool {
        self.bursts.iter().any(|(a, b)| *a <= now && now < *b)
    }

    /// Attaches a copy in `slot` at both ends, carried by `pipe`.
    pub fn attach(&mut self, slot: usize, pipe: CopyPipe) {
        let (_, start) = self.fanout.attach_at(slot).expect("free slot");
        self.merge.attach(slot, start).expect("merge attach");
        self.pipes[slot] = Some(pipe);
    }

    /// Loses copy `slot`: its connection and what it had in flight are gone.
    pub fn cut(&mut self, slot: usize) {
        self.fanout.detach(slot);
        self.merge.detach(slot);
        self.pipes[slot] = None;
    }

    /// Sends from the fanout on each copy with room, taking the link's lane bytes when a copy
    /// has written all it had; delivers what arrived through the merge.
    pub fn step(&mut self, from: &mut Side, to: &mut Side, now: Instant) -> bool {
        use wanopt_proto::LATENCY_LANE;
        let mut progress = false;
        for slot in 0..self.pipes.len() {
            while let Some(p) = self.pipes[slot].as_mut() {
                if !p.pipe.has_room(now) {
                    break;
                }
                if self
                    .fanout
                    .not_before(slot, self.spacing)
                    .is_some_and(|t| t > now)
                {
                    break;
                }
                let chunk = match self.fanout.next(slot) {
                    Some(c) => c,
                    None => {
                        let mut out = BytesMut::new();
                        if from
                            .link
                            .poll_transmit_lane(now, LATENCY_LANE, &mut out, MTU_BATCH)
                            == 0
                        {
                            break;
                        }
                        self.produced.extend_from_slice(&out);
                        let out = out.freeze();
                        if let Some(d) = self.datagrams.as_mut() {
                            d.send(now, self.fanout.end(), &out, &self.bursts);
                        }
                        for gone in self.fanout.push(out, now) {
                            self.merge.detach(gone);
                            self.pipes[gone] = None;
                        }
                        continue;
                    }
                };
                let n = chunk.len().min(MTU_BATCH);
                let burst = self.in_burst(now);
                let Some(p) = self.pipes[slot].as_mut() else {
                    break;
                };
                p.send(now, chunk.slice(..n), burst);
                self.fanout.wrote(slot, n);
                progress = true;
            }
        }
        for slot in 0..self.pipes.len() {
            let Some(p) = self.pipes[slot].as_mut() else {
                continue;
            };
            while p.pipe.in_flight.front().is_some_and(|(t, _)| *t <= now) {
                let Some((_, b)) = p.pipe.in_flight.pop_front() else {
                    break;
                };
                let mut out = BytesMut::new();
                if let Err(e) = self.merge.input(slot, &b, &mut out) {
                    self.errors.push(e.to_string());
                    continue;
                }
                deliver_merged(&mut self.merged, &out, to, now);
                progress = true;
            }
        }
        let arrived = match self.datagrams.as_mut() {
            Some(d) => d.arrived(now),
            None => Vec::new(),
        };
        for (offset, piece) in arrived {
            let mut out = BytesMut::new();
            if self.merge.piece(offset, &piece, &mut out) == 0 {
                continue;
            }
            deliver_merged(&mut self.merged, &out, to, now);
            progress = true;
        }
        progress
    }

    /// When something next happens on this direction's copies.
    pub fn next_time(&self, from: &Side, now: Instant) -> Option<Instant> {
        use wanopt_proto::LATENCY_LANE;
        let wants = from.link.wants_transmit_lane(LATENCY_LANE);
        let datagram = self
            .datagrams
            .as_ref()
            .and_then(|d| d.in_flight.iter().map(|x| x.0).min());
        self.pipes
            .iter()
            .enumerate()
            .filter_map(|(slot, p)| Some((slot, p.as_ref()?)))
            .flat_map(|(slot, p)| {
                let arrival = p.pipe.in_flight.front().map(|(t, _)| *t);
                let pending = wants || self.fanout.next(slot).is_some();
                let room = (pending && p.pipe.busy_until > now).then_some(p.pipe.busy_until);
                let spaced = self
                    .fanout
                    .next(slot)
                    .and_then(|_| self.fanout.not_before(slot, self.spacing))
                    .filter(|t| *t > now);
                [arrival, room, spaced]
            })
            .flatten()
            .chain(datagram)
            .min()
    }
}

/// Bytes the merge delivered, kept in `merged` and handed to the receiving link's lane.
fn deliver_merged(merged: &mut Vec<u8>, out: &[u8], to: &mut Side, now: Instant) {
    use wanopt_proto::LATENCY_LANE;
    merged.extend_from_slice(out);
    let buf = &mut to.inbufs[LATENCY_LANE];
    buf.extend_from_slice(out);
    let _ = to.link.handle_lane_input(LATENCY_LANE, buf, now);
}

impl Default for CopyWire {
    fn default() -> Self {
        Self::new()
    }
}

/// Both directions of a latency lane carried by copies.
#[derive(Default)]
pub struct Copies {
    pub w2e: CopyWire,
    pub e2w: CopyWire,
}
