//! The link driver: one live link's sans-IO [`Link`] behind a mutex, with a reader and a writer
//! task per lane moving its bytes, the wakeups of each stream, and `TCP_INFO` sampling. Readers
//! only read: what needs a decision (a link came up, a peer opened a stream, the link ended) goes
//! to the peer's supervisor as a [`LinkMsg`]. The lock is never held across an `.await`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{Notify, mpsc};
use tracing::{debug, info, warn};
use wanopt_proto::{
    Class, CloseCode, Event, LANES, LATENCY_LANE, Link, LinkError, MAIN_LANE, Refusal, ResetCode,
    StateRequest, StreamError, StreamId,
};

mod copies;

pub(crate) use copies::{Carrier, keep_copies, run_lane};
use wanopt_proto::copies::MAX_COPIES;

use crate::cachedir::CacheDir;
use crate::counters::{Counters, add};
use crate::policy::RateCheck;
use crate::pressure::{Governor, Pressure};
use crate::sockopt;

/// Largest batch of frames handed to TLS at once; small, so latency frames never wait long.
const TRANSMIT_BATCH: usize = 64 * 1024;
/// Read size for local sockets and the link.
pub(crate) const READ_CHUNK: usize = 64 * 1024;

pub(crate) use crate::wire::Wire;

/// Refusals of the peer's opens are the peer's to cause: their log lines are rationed.
static PEER_REFUSALS: crate::gate::LogBudget =
    crate::gate::LogBudget::new(Duration::from_secs(10), 10);

/// A link connection before TLS: unbuffered until the peer is authenticated.
pub(crate) fn wire(tcp: TcpStream) -> Wire {
    Wire::new(tcp)
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What a link's tasks tell the peer's supervisor.
pub(crate) enum LinkMsg {
    /// The peer's hello was accepted on this link.
    Up(Arc<LinkHandle>, SocketAddr),
    /// The peer opened a stream to one of our services.
    Opened {
        link: Arc<LinkHandle>,
        stream: StreamId,
        service: Arc<str>,
    },
    /// The link's connection was lost and its streams wait for the next one.
    Suspended(Arc<LinkHandle>),
    /// Only the latency lane's connection was lost: its streams wait for a new lane.
    LaneLost(Arc<LinkHandle>),
    /// The link ended (after it was up).
    Down(Arc<LinkHandle>),
}

/// What a link needs from its peer, fixed when it starts.
pub(crate) struct LinkCtx {
    pub counters: Arc<Counters>,
    pub caches: Option<Arc<CacheDir>>,
    pub supervisor: mpsc::UnboundedSender<LinkMsg>,
    /// The peer's site name, for logs.
    pub peer: String,
    pub handshake_timeout: Duration,
    /// The stated link speed makes the link the bottleneck for good (see [`Pressure`]).
    pub link_bound: bool,
    /// `link.bandwidth`, if the config states it (checked against the socket: [`RateCheck`]).
    pub stated_bps: Option<u64>,
    /// The zstd level to start at, and the levels the governor may move it between (`None`:
    /// it stays).
    pub zstd: (i32, Option<(i32, i32)>),
}

/// Wakeups and the reset reason of one stream.
#[derive(Debug, Default)]
pub(crate) struct StreamSignal {
    pub readable: Notify,
    pub writable: Notify,
    /// Reset, link closed, or finished: the stream is gone from the link.
    pub gone: Notify,
    pub reset: Mutex<Option<String>>,
}

impl StreamSignal {
    pub fn reason(&self) -> String {
        lock(&self.reset)
            .clone()
            .unwrap_or_else(|| "stream closed".to_string())
    }
}

pub(crate) struct Inner {
    pub link: Link,
    pub signals: HashMap<StreamId, Arc<StreamSignal>>,
    opened: Vec<(StreamId, Arc<str>)>,
    up: bool,
    /// Saved cache states the link asked for, until the main lane's reader loads them.
    load: Vec<StateRequest>,
    /// The connections carrying the latency lane, each with a copy of its bytes.
    lane: copies::LaneCopies,
}

/// Sockets sampled for `TCP_INFO`: the main lane's, then each latency-lane copy's.
type Fds = [Option<std::os::fd::RawFd>; 1 + MAX_COPIES];

/// Only the main lane's socket.
fn main_fd(fd: Option<std::os::fd::RawFd>) -> Fds {
    let mut f = [None; 1 + MAX_COPIES];
    f[0] = fd;
    f
}

/// One live link: the protocol state machine and the wakeups around it.
pub(crate) struct LinkHandle {
    pub inner: Mutex<Inner>,
    /// Wakes each lane's writer: there may be frames to send.
    tx: [Notify; LANES],
    /// The timer deadline the main lane's writer sleeps until (`None`: no timer armed).
    armed: Mutex<Option<Instant>>,
    /// The latency lane's tasks (dials and connections), ended with the link.
    lane_tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// The main lane's socket and each latency-lane copy's while open, for `TCP_INFO`; cleared
    /// before the socket is closed.
    fds: Mutex<Fds>,
    /// Wakes each latency-lane copy's writer.
    copy_tx: [Notify; MAX_COPIES],
    /// Generations of latency-lane connections handed out (see [`Carrier`]).
    generations: std::sync::atomic::AtomicU64,
    pub ctx: LinkCtx,
    pub id: u64,
    /// Which connection carries the link: a resumed link counts up, and the tasks of an older
    /// connection stop touching the link once they see it.
    conn: std::sync::atomic::AtomicU64,
    /// Likewise for the latency lane's connection, which may be replaced alone.
    lane_conn: std::sync::atomic::AtomicU64,
    /// A [`while_suspended`] task runs (one at a time: the link's end is told once).
    watching: std::sync::atomic::AtomicBool,
}

impl LinkHandle {
    pub fn new(link: Link, fd: std::os::fd::RawFd, ctx: LinkCtx, id: u64) -> Self {
        LinkHandle {
            inner: Mutex::new(Inner {
                link,
                signals: HashMap::new(),
                opened: Vec::new(),
                up: false,
                load: Vec::new(),
                lane: copies::LaneCopies::new(),
            }),
            tx: Default::default(),
            armed: Mutex::new(None),
            lane_tasks: Mutex::new(Vec::new()),
            fds: Mutex::new(main_fd(Some(fd))),
            copy_tx: Default::default(),
            generations: 0.into(),
            ctx,
            id,
            conn: 0.into(),
            lane_conn: 0.into(),
            watching: false.into(),
        }
    }

    /// The latency-lane connection now carrying the lane.
    fn lane_connection(&self) -> u64 {
        self.lane_conn.load(std::sync::atomic::Ordering::Acquire)
    }

    /// True while connection `conn` (main, lane) still carries `lane` of the link.
    fn current(&self, conn: (u64, u64), lane: usize) -> bool {
        self.connection() == conn.0 && (lane == MAIN_LANE || self.lane_connection() == conn.1)
    }

    /// Keeps a task of the latency lane, to end with the link.
    pub fn keep_task(&self, task: tokio::task::JoinHandle<()>) {
        let mut t = lock(&self.lane_tasks);
        t.retain(|t| !t.is_finished());
        t.push(task);
    }

    /// Ends the latency lane's tasks (the link's connection is gone).
    fn abort_lane_tasks(&self) {
        for t in lock(&self.lane_tasks).drain(..) {
            t.abort();
        }
    }

    /// The connection now carrying the link (see [`LinkHandle::reconnect`]).
    fn connection(&self) -> u64 {
        self.conn.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Hands a suspended link a new connection whose main socket is `fd` (on the listener, also
    /// a link whose peer came back before this side saw the old connection go): the old
    /// connection's tasks stop, and the link starts over with a new hello that resumes its
    /// streams. False if the link can no longer resume.
    /// `presented` is the token the peer's hello presented (listening side); `None` on the
    /// connecting side.
    pub fn reconnect(
        &self,
        fd: std::os::fd::RawFd,
        saved: Vec<wanopt_proto::SavedCache>,
        presented: Option<u64>,
    ) -> bool {
        let mut g = lock(&self.inner);
        let now = Instant::now();
        let ok = (g.link.is_suspended() || g.link.suspend("the peer connected again", now))
            && match presented {
                None => g.link.reconnect(now, saved),
                Some(t) => g.link.accept_resume(now, t, rand::random(), saved),
            };
        if ok {
            self.conn.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            *lock(&self.fds) = main_fd(Some(fd));
            *lock(&self.armed) = None;
            self.abort_lane_tasks();
            g.up = false;
            // The old connection's writers wake, see they are stale and end, so no later
            // wakeup meant for the new writers goes to them.
            for t in &self.tx {
                t.notify_waiters();
            }
        }
        self.dispatch(&mut g);
        ok
    }

    /// Wakes every stream: the link is gone for good.
    fn wake_all(g: &Inner) {
        for s in g.signals.values() {
            s.readable.notify_one();
            s.writable.notify_one();
            s.gone.notify_one();
        }
    }

    /// Wakes the writers of the lanes that have frames to send (or must notice the link closed);
    /// an idle lane's writer is left asleep, which saves a task switch on the latency path.
    pub fn kick(&self) {
        let wants = self.wants(&lock(&self.inner));
        self.wake(wants);
    }

    /// Which lanes' writers [`kick`](Self::kick) would wake, decided under the link's lock that
    /// the caller already holds (one lock round trip less on the latency path).
    pub fn wants(&self, g: &Inner) -> [bool; LANES] {
        let closed = g.link.is_closed() || g.link.is_suspended();
        // The main lane's writer also runs the link's timers: wake it when they moved
        // earlier than what it sleeps until (the peer's hello arms them, for one).
        let timer = g.link.poll_timeout();
        let armed = *lock(&self.armed);
        let rearm = timer.is_some_and(|t| armed.is_none_or(|a| t < a));
        std::array::from_fn(|l| {
            closed || g.link.wants_transmit_lane(l) || (l == MAIN_LANE && rearm)
        })
    }

    /// Wakes the writers chosen by [`wants`](Self::wants), after the link's lock is released.
    pub fn wake(&self, wants: [bool; LANES]) {
        for (t, w) in self.tx.iter().zip(wants) {
            if w {
                t.notify_one();
            }
        }
        if wants[LATENCY_LANE] {
            self.wake_copies();
        }
    }

    pub fn with<R>(&self, f: impl FnOnce(&mut Link) -> R) -> R {
        let mut g = lock(&self.inner);
        let r = f(&mut g.link);
        self.dispatch(&mut g);
        r
    }

    /// Routes the link's events to the stream tasks and counters.
    pub fn dispatch(&self, g: &mut Inner) {
        let counters = &self.ctx.counters;
        while let Some(ev) = g.link.poll_event() {
            match ev {
                Event::Up { .. } => g.up = true,
                Event::Opened {
                    stream, service, ..
                } => {
                    g.signals.insert(stream, Arc::default());
                    g.opened.push((stream, service));
                }
                Event::Refused {
                    stream,
                    service,
                    why: Refusal::UnknownService,
                } => {
                    add(&counters.link.unknown_service, 1);
                    if let Some(suppressed) = PEER_REFUSALS.take(Instant::now()) {
                        warn!(link = self.id, stream = %stream, service = %service, suppressed, "refused stream for unknown service");
                    }
                }
                Event::Refused {
                    stream,
                    service,
                    why,
                } => {
                    let c = counters.service(&service);
                    add(&c.streams_refused, 1);
                    c.failed(why.label());
                    if let Some(suppressed) = PEER_REFUSALS.take(Instant::now()) {
                        warn!(link = self.id, stream = %stream, service = %service, limit = why.label(), suppressed, "refused a stream the peer opened: at its limit");
                    }
                }
                Event::Readable(id) => {
                    if let Some(s) = g.signals.get(&id) {
                        s.readable.notify_one();
                    }
                }
                Event::Writable(id) => {
                    if let Some(s) = g.signals.get(&id) {
                        s.writable.notify_one();
                    }
                }
                Event::Reset {
                    stream,
                    code,
                    reason,
                } => {
                    if code == ResetCode::LinkLost {
                        add(&counters.link.streams_lost, 1);
                    }
                    if let Some(s) = g.signals.get(&stream) {
                        *lock(&s.reset) = Some(format!("{}: {reason}", code.label()));
                        s.readable.notify_one();
                        s.writable.notify_one();
                        s.gone.notify_one();
                    }
                }
                Event::Done(id) => {
                    if let Some(s) = g.signals.get(&id) {
                        s.gone.notify_one();
                    }
                }
                Event::Closed(_) => {}
                Event::Suspended { reason } => {
                    add(&counters.link.outages, 1);
                    info!(link = self.id, reason = %reason, "link suspended");
                }
                Event::Resumed(r) => {
                    let l = &counters.link;
                    add(&l.streams_resumed, r.streams as u64);
                    add(&l.resent, r.resent);
                    l.outage_seconds.inc_by(r.outage.as_secs_f64());
                    info!(
                        link = self.id,
                        streams = r.streams,
                        resent = r.resent,
                        lost = r.lost,
                        outage_ms = r.outage.as_millis() as u64,
                        "link resumed: its streams go on"
                    );
                }
                Event::LoadStates(reqs) => g.load = reqs,
                Event::Checkpoint {
                    role,
                    lane,
                    scope,
                    state,
                } => {
                    if let Some(c) = &self.ctx.caches {
                        let before = c.coalesced();
                        c.save(role, lane, &scope, state);
                        if c.coalesced() > before {
                            counters.codec.state_replaced();
                        }
                    }
                }
            }
        }
        for (svc, c) in g.link.take_wire_counts() {
            let sc = counters.service(&svc);
            add(&sc.wire_out, c.out);
            add(&sc.wire_in, c.inbound);
        }
        for (svc, c) in g.link.take_codec_counts() {
            // Bytes of streams already closed are decoded (to keep the cache in step) under "".
            if !svc.is_empty() {
                counters.codec.record(&svc, &c);
            }
        }
    }

    /// Registers a new outgoing stream.
    pub fn open(
        &self,
        service: &str,
        class: Class,
    ) -> Result<(StreamId, Arc<StreamSignal>), StreamError> {
        let mut g = lock(&self.inner);
        let id = g.link.open(service, class)?;
        let sig: Arc<StreamSignal> = Arc::default();
        g.signals.insert(id, sig.clone());
        drop(g);
        self.kick();
        Ok((id, sig))
    }

    /// The wakeups of a stream the peer opened.
    pub fn signal(&self, id: StreamId) -> Option<Arc<StreamSignal>> {
        lock(&self.inner).signals.get(&id).cloned()
    }

    pub fn forget(&self, id: StreamId) {
        lock(&self.inner).signals.remove(&id);
    }

    pub fn reset(&self, id: StreamId, code: ResetCode, reason: &str) {
        self.with(|l| l.reset(id, code, reason));
        self.kick();
    }

    fn tell(&self, m: LinkMsg) {
        // The supervisor lives as long as the daemon serves; after that nobody listens.
        let _ = self.ctx.supervisor.send(m);
    }
}

/// Runs one authenticated link until it ends: the main lane's reader and writer, and the socket
/// sampler. The supervisor hears when it comes up and when it goes down.
pub(crate) async fn run_link<S>(h: Arc<LinkHandle>, stream: S, addr: SocketAddr, initial: BytesMut)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (rd, wr) = tokio::io::split(stream);
    let conn = h.connection();
    let reader = read_link(h.clone(), rd, addr, MAIN_LANE, initial, (conn, 0), None);
    let writer = write_link(h.clone(), wr, MAIN_LANE, (conn, 0));
    let sampler = tokio::spawn(sample_sockets(h.clone()));
    let store_waiter = h.ctx.caches.as_ref().map(|c| {
        // Chunks the disk tier read for waiting streams: decode them again.
        let (h, ready) = (h.clone(), c.ready());
        tokio::spawn(async move {
            loop {
                ready.notified().await;
                h.with(Link::store_ready);
                h.kick();
            }
        })
    });
    tokio::pin!(reader, writer);
    let why = tokio::select! {
        r = &mut reader => {
            // Let the writer flush what the reader queued (a GoAway after a protocol error).
            h.kick();
            let _ = tokio::time::timeout(Duration::from_secs(1), &mut writer).await;
            r
        }
        w = &mut writer => w,
        why = ticker(&h, (conn, 0), MAIN_LANE, None) => why,
    };
    sampler.abort();
    if let Some(t) = store_waiter {
        t.abort();
    }
    let mut g = lock(&h.inner);
    if h.connection() != conn {
        // A newer connection took the link over: it is that one's now.
        return;
    }
    // Forget the sockets before they close, so no TCP_INFO read can hit a reused descriptor.
    *lock(&h.fds) = main_fd(None);
    h.abort_lane_tasks();
    let was_up = g.up;
    if g.link.suspend(&why, Instant::now()) {
        h.dispatch(&mut g);
        let streams = g.signals.len();
        drop(g);
        let window = h.with(|l| l.resume_window());
        warn!(link = h.id, peer = %h.ctx.peer, reason = %why, streams, window_s = window.as_secs(), "link connection lost; its streams wait for the next one");
        if was_up {
            h.tell(LinkMsg::Suspended(h.clone()));
        }
        if !h.watching.swap(true, std::sync::atomic::Ordering::AcqRel) {
            tokio::spawn(while_suspended(h.clone()));
        }
        return;
    }
    let close = g.link.close_error().cloned();
    h.dispatch(&mut g);
    // Wake every stream: their link is gone.
    LinkHandle::wake_all(&g);
    let up = g.up || was_up;
    drop(g);
    let orderly = matches!(
        close,
        Some(LinkError::PeerClosed {
            code: CloseCode::Normal | CloseCode::Replaced,
            ..
        })
    ) || (close.is_none() && why == "closed");
    let reason = close.as_ref().map_or(why, ToString::to_string);
    let peer = &h.ctx.peer;
    if up {
        add(&h.ctx.counters.link.disconnects, 1);
        if orderly {
            info!(link = h.id, peer = %peer, reason = %reason, "link closed");
        } else {
            warn!(link = h.id, peer = %peer, reason = %reason, "link down");
        }
        h.tell(LinkMsg::Down(h.clone()));
    } else {
        warn!(link = h.id, from = %addr, reason = %reason, "link failed before it came up");
    }
}

/// How often a connection's ticker looks at the link.
const TICK: Duration = Duration::from_millis(250);

/// Ends when the connection `conn` no longer carries the link: the link suspended (it heard
/// nothing for too long, or another lane was lost) or a newer connection took over. Its reader
/// or writer may be stuck on a dead socket meanwhile, so they cannot be the ones to notice.
/// The main lane's ticker also runs the link's timers when due, which a writer
/// blocked on a full socket does not.
async fn ticker(h: &LinkHandle, conn: (u64, u64), lane: usize, copy: Option<Carrier>) -> String {
    let timers = lane == MAIN_LANE;
    loop {
        tokio::time::sleep(TICK).await;
        let now = Instant::now();
        let (suspended, wants) = {
            let mut g = lock(&h.inner);
            if timers && g.link.poll_timeout().is_some_and(|t| t <= now) {
                g.link.handle_timeout(now);
                h.dispatch(&mut g);
            }
            if copy.is_some_and(|c| !h.carries(&g, &c)) {
                return "a newer connection took the lane over".into();
            }
            (g.link.is_suspended(), h.wants(&g))
        };
        h.wake(wants);
        if !h.current(conn, lane) {
            return "a newer connection took the link over".into();
        }
        if suspended {
            return "the link gave the connection up".into();
        }
    }
}

/// Runs a suspended link's timers (no connection's writer does) until a new connection takes
/// it over, or the resume window ends: then its streams are reset and the supervisor told.
async fn while_suspended(h: Arc<LinkHandle>) {
    watch_suspended(&h).await;
    h.watching
        .store(false, std::sync::atomic::Ordering::Release);
    // Suspended again just before the flag went down: keep watching.
    if h.with(|l| l.is_suspended()) && !h.watching.swap(true, std::sync::atomic::Ordering::AcqRel) {
        Box::pin(while_suspended(h)).await;
    }
}

/// The loop of [`while_suspended`].
async fn watch_suspended(h: &Arc<LinkHandle>) {
    loop {
        let (next, suspended, closed) = {
            let g = lock(&h.inner);
            (
                g.link.poll_timeout(),
                g.link.is_suspended(),
                g.link.is_closed(),
            )
        };
        if closed {
            let mut g = lock(&h.inner);
            h.dispatch(&mut g);
            let streams = g.signals.len();
            add(&h.ctx.counters.link.streams_lost, streams as u64);
            LinkHandle::wake_all(&g);
            let reason = g
                .link
                .close_error()
                .map_or_else(|| "closed".to_string(), ToString::to_string);
            drop(g);
            add(&h.ctx.counters.link.disconnects, 1);
            warn!(link = h.id, peer = %h.ctx.peer, reason = %reason, streams, "link down: its streams are reset");
            h.tell(LinkMsg::Down(h.clone()));
            return;
        }
        if !suspended {
            return;
        }
        let now = Instant::now();
        let at = next.map_or(now + Duration::from_secs(1), |t| {
            t.min(now + Duration::from_secs(1))
        });
        tokio::time::sleep_until(at.into()).await;
        h.with(|l| l.handle_timeout(Instant::now()));
    }
}

/// Samples `TCP_INFO` of the link's sockets, its caches and its stall timeouts into the metrics
/// every two seconds.
async fn sample_sockets(h: Arc<LinkHandle>) {
    let mut stalls = 0;
    let mut rate = h.ctx.stated_bps.map(RateCheck::new);
    loop {
        {
            // The lock keeps a lane's descriptor from being cleared and closed during the read.
            let fds = lock(&h.fds);
            for (i, name) in ["main", "latency", "latency2", "latency3"]
                .iter()
                .enumerate()
            {
                if let Some(t) = fds.get(i).copied().flatten().and_then(sockopt::tcp_info) {
                    h.ctx.counters.sockets.record(name, &t);
                    if i == 0
                        && let Some(check) = rate.as_mut()
                        && let Some(bps) =
                            check.sample(t.delivery_rate.max(0) as u64, t.app_limited)
                    {
                        warn!(
                            peer = %h.ctx.peer,
                            stated_mbit = h.ctx.stated_bps.unwrap_or(0) / 1_000_000,
                            measured_mbit = bps / 1_000_000,
                            "the link delivers under half its stated bandwidth while sending all it can; correct link.bandwidth"
                        );
                    }
                }
            }
        }
        let (caches, expired) = {
            let g = lock(&h.inner);
            (g.link.cache_stats(), g.link.stalls_expired())
        };
        h.ctx.counters.codec.record_caches(&caches);
        h.ctx
            .counters
            .codec
            .stall_timeouts(expired.saturating_sub(stalls));
        stalls = expired;
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// Reads one lane of a link into its state machine. `buf` may already hold the first bytes.
async fn read_link<R: AsyncRead + Unpin>(
    h: Arc<LinkHandle>,
    mut rd: R,
    addr: SocketAddr,
    lane: usize,
    mut buf: BytesMut,
    conn: (u64, u64),
    copy: Option<Carrier>,
) -> String {
    let counters = h.ctx.counters.clone();
    let handshake_deadline = tokio::time::Instant::now() + h.ctx.handshake_timeout;
    // Only the main lane carries the hello; a lane exists only once the link is up.
    let mut announced = lane != MAIN_LANE;
    let mut pending = !buf.is_empty();
    loop {
        if pending {
            pending = false;
        } else {
            // Data payloads are split off this buffer without copying; make room for the next read.
            buf.reserve(READ_CHUNK);
            let read = if announced {
                rd.read_buf(&mut buf).await
            } else {
                match tokio::time::timeout_at(handshake_deadline, rd.read_buf(&mut buf)).await {
                    Ok(r) => r,
                    Err(_) => return "no hello from the peer in time".into(),
                }
            };
            let n = match read {
                Ok(0) => return "peer closed the connection".into(),
                Ok(n) => n,
                Err(e) => return format!("read: {e}"),
            };
            add(&counters.link.wire_in, n as u64);
        }
        let (opened, up, closed, err, wants, load, loading) = {
            let mut g = lock(&h.inner);
            if !h.current(conn, lane) {
                return "a newer connection took the link over".into();
            }
            if g.link.is_suspended() {
                return "the link's other lane was lost".into();
            }
            let r = match &copy {
                None => g.link.handle_lane_input(lane, &mut buf, Instant::now()),
                Some(c) => {
                    if !h.carries(&g, c) {
                        return "a newer connection took the lane over".into();
                    }
                    match copies::copy_input(&h, &mut g, c, &mut buf, Instant::now()) {
                        Ok(r) => r,
                        Err(e) => return format!("copy: {e}"),
                    }
                }
            };
            h.dispatch(&mut g);
            (
                std::mem::take(&mut g.opened),
                g.up,
                g.link.is_closed(),
                r.err(),
                h.wants(&g),
                std::mem::take(&mut g.load),
                g.link.is_loading(),
            )
        };
        h.wake(wants);
        match err {
            Some(LinkError::PeerClosed {
                code: CloseCode::Normal,
                reason,
            }) => {
                info!(link = h.id, from = %addr, reason = %reason, "peer closed the link");
            }
            Some(e) => warn!(link = h.id, from = %addr, error = %e, "link error"),
            None => {}
        }
        if up && !announced && !closed {
            announced = true;
            h.tell(LinkMsg::Up(h.clone(), addr));
        }
        for (stream, service) in opened {
            h.tell(LinkMsg::Opened {
                link: h.clone(),
                stream,
                service,
            });
        }
        if closed {
            return lock(&h.inner)
                .link
                .close_error()
                .map_or_else(|| "closed".to_string(), ToString::to_string);
        }
        if !load.is_empty() {
            // The link reads nothing more until the states it resumes are in: load them where
            // blocking is allowed, and read no more meanwhile (what came stays in `buf`).
            let states = load_states(h.ctx.caches.clone(), load).await;
            h.with(|l| l.states_loaded(states));
            h.kick();
            pending = true;
        } else if loading {
            // Another lane's reader is loading them: wait rather than buffer without bound.
            while h.with(|l| l.is_loading() && !l.is_closed()) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            pending = true;
        } else if h.with(|l| l.replies_backed_up()) {
            // The peer does not read what it makes us answer: read no more until the writer
            // has sent it (the peer's own writes then wait in TCP).
            counters.link.input_paused.inc();
            while h.with(|l| l.replies_backed_up() && !l.is_closed()) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            pending = true;
        }
    }
}

/// Loads the saved cache states a link resumes, on a blocking thread; one that cannot be read is
/// `None` (its cache starts empty).
async fn load_states(
    caches: Option<Arc<CacheDir>>,
    reqs: Vec<StateRequest>,
) -> Vec<(StateRequest, Option<wanopt_proto::Snapshot>)> {
    let fallback: Vec<_> = reqs.iter().map(|r| (r.clone(), None)).collect();
    let Some(dir) = caches else {
        return fallback;
    };
    tokio::task::spawn_blocking(move || {
        reqs.into_iter()
            .map(|r| {
                let s = dir.load(r.role, r.lane, &r.scope, &r.digest);
                (r, s)
            })
            .collect()
    })
    .await
    .unwrap_or(fallback)
}

/// Writes one lane's frames; the main lane also runs the link's timers (pings, idle timeout).
async fn write_link<W: AsyncWrite + Unpin>(
    h: Arc<LinkHandle>,
    mut wr: W,
    lane: usize,
    conn: (u64, u64),
) -> String {
    let mut buf = BytesMut::with_capacity(2 * TRANSMIT_BATCH);
    let mut timer = Box::pin(tokio::time::sleep(Duration::from_secs(3600)));
    let mut timer_at: Option<Instant> = None;
    let mut pressure = Pressure::new(h.ctx.link_bound, Instant::now());
    h.with(|l| l.set_pressure(pressure.current()));
    let (start, range) = h.ctx.zstd;
    let mut governor = range
        .filter(|_| lane == MAIN_LANE)
        .map(|(min, max)| Governor::new(start, min, max, Instant::now()));
    if lane == MAIN_LANE {
        h.ctx.counters.link.zstd_level.set(i64::from(start));
    }
    loop {
        let (closed, deadline, encoding) = {
            let mut g = lock(&h.inner);
            if !h.current(conn, lane) {
                return "a newer connection took the link over".into();
            }
            if g.link.is_suspended() {
                return "the link's other lane was lost".into();
            }
            let t = Instant::now();
            g.link.poll_transmit_lane(lane, &mut buf, TRANSMIT_BATCH);
            let encoding = t.elapsed();
            h.dispatch(&mut g);
            let deadline = if lane == MAIN_LANE {
                let d = g.link.poll_timeout();
                // Set under the link's lock, as `kick` reads it, so no re-arm is missed.
                *lock(&h.armed) = d;
                d
            } else {
                None
            };
            (g.link.is_closed(), deadline, encoding)
        };
        if !buf.is_empty() {
            add(&h.ctx.counters.link.wire_out, buf.len() as u64);
            let started = Instant::now();
            if let Err(e) = wr.write_all(&buf).await {
                return format!("write: {e}");
            }
            buf.clear();
            if let Err(e) = wr.flush().await {
                return format!("write: {e}");
            }
            let now = Instant::now();
            if lane == MAIN_LANE
                && let Some(p) = pressure.wrote(started, now)
            {
                debug!(link = h.id, pressure = ?p, "link pressure changed");
                h.with(|l| l.set_pressure(p));
            }
            if let Some(g) = governor.as_mut()
                && let Some(level) = g.record(encoding, now - started, now)
            {
                debug!(link = h.id, level, "zstd level changed");
                h.with(|l| l.set_zstd_level(level));
                h.ctx.counters.link.zstd_level.set(i64::from(level));
            }
            continue;
        }
        if closed {
            let _ = wr.shutdown().await;
            return lock(&h.inner)
                .link
                .close_error()
                .map_or_else(|| "closed".to_string(), ToString::to_string);
        }
        // One timer for the writer's life, moved only when the deadline does: registering a new
        // one on every wait cost a timer-wheel insert and removal per frame.
        if let Some(d) = deadline
            && timer_at != Some(d)
        {
            timer.as_mut().reset(d.into());
            timer_at = Some(d);
        }
        tokio::select! {
            _ = h.tx[lane].notified() => {}
            _ = &mut timer, if deadline.is_some() => {
                timer_at = None;
                h.with(|l| l.handle_timeout(Instant::now()));
            }
        }
    }
}
