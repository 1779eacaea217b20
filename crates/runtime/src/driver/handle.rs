//! The link handle: one live link's sans-IO [`Link`] behind a mutex, and every operation the
//! rest of the daemon performs on it (open, write, read, reset a stream; wake the lanes'
//! writers; hand a suspended link a new connection). Callers never hold the lock themselves:
//! each method takes it, routes the events the operation raised, and wakes whom they concern.

use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{Notify, mpsc};
use wanopt_proto::copies::MAX_COPIES;
use wanopt_proto::{
    Class, LANES, LATENCY_LANE, Link, MAIN_LANE, ReadOutcome, ResetCode, StreamError, StreamId,
};

use super::dispatch::dispatch;
use super::state::{Inner, StreamSignal};
use crate::cachedir::CacheDir;
use crate::counters::Counters;
use crate::sync::lock;

/// Largest batch of frames handed to TLS at once; small, so latency frames never wait long.
pub(crate) const TRANSMIT_BATCH: usize = 64 * 1024;

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
    /// Time between the copies of a latency-lane write (`link.copy_spacing`).
    pub copy_spacing: Duration,
    /// The main lane's pacing cap in bytes per second (`link.max_rate`) and the queue its bulk
    /// may add while the latency lane is busy (`link.latency_queue`): see [`crate::room`].
    pub room: Option<(u64, Duration)>,
    /// When the latency lane sends datagrams (`link.lane_datagrams`).
    pub datagrams: crate::datagrams::Setting,
}

/// Sockets sampled for `TCP_INFO`: the main lane's, then each latency-lane copy's.
pub(super) type Fds = [Option<RawFd>; 1 + MAX_COPIES];

/// Only the main lane's socket.
fn main_fd(fd: Option<RawFd>) -> Fds {
    let mut f = [None; 1 + MAX_COPIES];
    f[0] = fd;
    f
}

/// One live link: the protocol state machine and the wakeups around it.
pub(crate) struct LinkHandle {
    inner: Mutex<Inner>,
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
    /// Generations of latency-lane connections handed out (see
    /// [`Carrier`](super::carriers::Carrier)).
    generations: AtomicU64,
    /// Wakes a reader that stopped reading until the link lets it go on (see
    /// [`wait_until`](Self::wait_until)).
    progress: Notify,
    /// A reader waits on `progress`: dispatch then wakes it.
    paused: AtomicBool,
    /// Wakes a latency-lane reader: datagrams merged lane bytes the link has not taken yet.
    pub(super) lane_input: Notify,
    pub ctx: LinkCtx,
    pub id: u64,
    /// Which connection carries the link: a resumed link counts up, and the tasks of an older
    /// connection stop touching the link once they see it.
    conn: AtomicU64,
    /// Likewise for the latency lane's connection, which may be replaced alone.
    lane_conn: AtomicU64,
    /// A task watches the suspended link (one at a time: the link's end is told once).
    pub(super) watching: AtomicBool,
}

impl LinkHandle {
    /// A handle of `link`, whose main connection's socket is `fd` (for `TCP_INFO`; `None` where
    /// the connection is not a socket).
    pub fn new(link: Link, fd: Option<RawFd>, ctx: LinkCtx, id: u64) -> Self {
        LinkHandle {
            inner: Mutex::new(Inner::new(link)),
            tx: Default::default(),
            armed: Mutex::new(None),
            lane_tasks: Mutex::new(Vec::new()),
            fds: Mutex::new(main_fd(fd)),
            copy_tx: Default::default(),
            generations: 0.into(),
            progress: Notify::new(),
            paused: false.into(),
            lane_input: Notify::new(),
            ctx,
            id,
            conn: 0.into(),
            lane_conn: 0.into(),
            watching: false.into(),
        }
    }

    /// The link's state under its lock, for the driver's own tasks.
    pub(super) fn state(&self) -> MutexGuard<'_, Inner> {
        lock(&self.inner)
    }

    /// The latency-lane connection now carrying the lane.
    pub(super) fn lane_connection(&self) -> u64 {
        self.lane_conn.load(Ordering::Acquire)
    }

    /// A new latency lane takes over from the old one's connections.
    pub(super) fn new_lane_connection(&self) {
        self.lane_conn.fetch_add(1, Ordering::AcqRel);
    }

    /// The connection now carrying the link (see [`LinkHandle::reconnect`]).
    pub(super) fn connection(&self) -> u64 {
        self.conn.load(Ordering::Acquire)
    }

    /// True while connection `conn` (main, lane) still carries `lane` of the link.
    pub(super) fn current(&self, conn: (u64, u64), lane: usize) -> bool {
        self.connection() == conn.0 && (lane == MAIN_LANE || self.lane_connection() == conn.1)
    }

    /// The next generation of a latency-lane connection.
    pub(super) fn next_generation(&self) -> u64 {
        self.generations.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// Keeps a task of the latency lane, to end with the link.
    pub fn keep_task(&self, task: tokio::task::JoinHandle<()>) {
        let mut t = lock(&self.lane_tasks);
        t.retain(|t| !t.is_finished());
        t.push(task);
    }

    /// Ends the latency lane's tasks (the link's connection is gone).
    pub(super) fn abort_lane_tasks(&self) {
        for t in lock(&self.lane_tasks).drain(..) {
            t.abort();
        }
    }

    /// The sockets to sample, read under their lock so none is cleared and closed meanwhile:
    /// `f` runs with the lock held.
    pub(super) fn with_fds<R>(&self, f: impl FnOnce(&Fds) -> R) -> R {
        f(&lock(&self.fds))
    }

    /// Sets socket `i` (0: main; 1 + slot: a latency-lane copy); `None` before it closes, so no
    /// `TCP_INFO` read can hit a reused descriptor.
    pub(super) fn set_fd(&self, i: usize, fd: Option<RawFd>) {
        if let Some(f) = lock(&self.fds).get_mut(i) {
            *f = fd;
        }
    }

    /// Forgets socket `i` (see [`set_fd`](Self::set_fd)).
    pub(super) fn forget_fd(&self, i: usize) {
        self.set_fd(i, None);
    }

    /// The latest time the kernel received data from the peer on any of the link's sockets,
    /// as of `now` (`None`: no socket says).
    pub(super) fn peer_data_at(&self, now: Instant) -> Option<Instant> {
        self.with_fds(|fds| {
            fds.iter()
                .flatten()
                .filter_map(|&fd| crate::sockopt::last_data_received(fd))
                .min()
        })
        .and_then(|ago| now.checked_sub(ago))
    }

    /// The latency lane's sockets.
    pub(super) fn lane_fds(&self) -> [Option<RawFd>; MAX_COPIES] {
        let f = lock(&self.fds);
        std::array::from_fn(|i| f[1 + i])
    }

    /// The main lane's writer sleeps until `at` (set under the link's lock, as
    /// [`wants`](Self::wants) reads it, so no re-arm is missed).
    pub(super) fn arm(&self, at: Option<Instant>) {
        *lock(&self.armed) = at;
    }

    /// Hands a suspended link a new connection whose main socket is `fd` (on the listener, also
    /// a link whose peer came back before this side saw the old connection go): the old
    /// connection's tasks stop, and the link starts over with a new hello that resumes its
    /// streams. False if the link can no longer resume.
    /// `presented` is the token the peer's hello presented (listening side); `None` on the
    /// connecting side.
    pub fn reconnect(
        &self,
        fd: Option<RawFd>,
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
            self.conn.fetch_add(1, Ordering::AcqRel);
            *lock(&self.fds) = main_fd(fd);
            self.arm(None);
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

    /// Wakes the writers of the lanes that have frames to send (or must notice the link closed);
    /// an idle lane's writer is left asleep, which saves a task switch on the latency path.
    pub fn kick(&self) {
        let wants = self.wants(&lock(&self.inner));
        self.wake(wants);
    }

    /// Which lanes' writers [`kick`](Self::kick) would wake, decided under the link's lock that
    /// the caller already holds (one lock round trip less on the latency path).
    pub(super) fn wants(&self, g: &Inner) -> [bool; LANES] {
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
    pub(super) fn wake(&self, wants: [bool; LANES]) {
        for (t, w) in self.tx.iter().zip(wants) {
            if w {
                t.notify_one();
            }
        }
        if wants[LATENCY_LANE] {
            self.wake_copies();
        }
    }

    /// Waits until lane `lane`'s writer is woken.
    pub(super) async fn writable(&self, lane: usize) {
        self.tx[lane].notified().await;
    }

    /// Wakes every copy's writer.
    pub(super) fn wake_copies(&self) {
        for t in &self.copy_tx {
            t.notify_one();
        }
    }

    /// Waits until copy `slot`'s writer is woken.
    pub(super) async fn copy_writable(&self, slot: usize) {
        self.copy_tx[slot].notified().await;
    }

    /// Runs `f` on the link, then routes the events it raised.
    pub fn with<R>(&self, f: impl FnOnce(&mut Link) -> R) -> R {
        let mut g = lock(&self.inner);
        let r = f(&mut g.link);
        self.dispatch(&mut g);
        r
    }

    /// Routes the link's events to the stream tasks and counters (see
    /// [`dispatch`](super::dispatch::dispatch)), and wakes a reader waiting for the link to let
    /// it go on.
    pub(super) fn dispatch(&self, g: &mut Inner) {
        dispatch(g, self.id, &self.ctx.counters, self.ctx.caches.as_ref());
        if self.paused.load(Ordering::Acquire) {
            self.progress.notify_waiters();
        }
    }

    /// Waits until `done` holds of the link: looked at once now, then each time an operation on
    /// the link routed its events (the writer sent, states were loaded, the link closed).
    pub(super) async fn wait_until(&self, mut done: impl FnMut(&Link) -> bool) {
        self.paused.store(true, Ordering::Release);
        loop {
            let woken = self.progress.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            if done(&lock(&self.inner).link) {
                break;
            }
            woken.await;
        }
        self.paused.store(false, Ordering::Release);
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

    /// Queues what it can of `data` on stream `id` (taking it off the front); `flush` sends
    /// what an optimized stream holds back for a chunk boundary once all of `data` is taken.
    /// Returns how many bytes were taken: 0 when the stream has no room (wait for its
    /// `writable` signal).
    pub fn write(&self, id: StreamId, data: &mut Bytes, flush: bool) -> Result<usize, StreamError> {
        let (k, wants) = {
            let mut g = lock(&self.inner);
            let k = g.link.write_bytes(id, data);
            if flush && data.is_empty() {
                g.link.flush(id);
            }
            self.dispatch(&mut g);
            (k, self.wants(&g))
        };
        let k = k?;
        if k > 0 {
            self.wake(wants);
        }
        Ok(k)
    }

    /// Sends what stream `id` holds back for a chunk boundary (its client paused).
    pub fn flush(&self, id: StreamId) {
        let wants = {
            let mut g = lock(&self.inner);
            if !g.link.flush(id) {
                return;
            }
            self.dispatch(&mut g);
            self.wants(&g)
        };
        self.wake(wants);
    }

    /// Takes what stream `id` has received; reading may free credit for the peer, so the
    /// writers are woken when the link has something to send.
    pub fn read(&self, id: StreamId) -> Result<ReadOutcome, StreamError> {
        let (r, credit) = {
            let mut g = lock(&self.inner);
            let r = g.link.read(id);
            (r, g.link.wants_transmit())
        };
        if credit {
            self.kick();
        }
        r
    }

    /// Takes more of what stream `id` received, up to `pieces` and `bytes` (see
    /// [`Link::read_more`](wanopt_proto::Link::read_more)), as [`read`](Self::read) does.
    pub fn read_more(
        &self,
        id: StreamId,
        into: &mut std::collections::VecDeque<Bytes>,
        pieces: usize,
        bytes: usize,
    ) -> usize {
        let (n, credit) = {
            let mut g = lock(&self.inner);
            let n = g.link.read_more(id, into, pieces, bytes);
            (n, n > 0 && g.link.wants_transmit())
        };
        if credit {
            self.kick();
        }
        n
    }

    /// Ends our side of stream `id`: what was written goes, then the end.
    pub fn finish(&self, id: StreamId) -> Result<(), StreamError> {
        let r = self.with(|l| l.finish(id));
        self.kick();
        r
    }

    /// True while the link still holds stream `id` (our end not yet confirmed sent).
    pub fn contains(&self, id: StreamId) -> bool {
        self.with(|l| l.contains(id))
    }

    /// Registers the wakeups of every stream a link taken over from another process holds.
    pub fn adopt_streams(&self) {
        let mut g = lock(&self.inner);
        let ids: Vec<StreamId> = g.link.stream_states().iter().map(|s| s.id).collect();
        for id in ids {
            g.signals.entry(id).or_default();
        }
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

    pub(super) fn tell(&self, m: LinkMsg) {
        // The supervisor lives as long as the daemon serves; after that nobody listens.
        let _ = self.ctx.supervisor.send(m);
    }
}

/// Runs `link`'s timers due at `now`, telling it first when data last arrived from the peer
/// (`heard`, from [`LinkHandle::peer_data_at`]): on a busy host the reader may not have run
/// since, and the silence clock must not count bytes waiting in a socket as silence.
pub(super) fn run_timers(link: &mut Link, heard: Option<Instant>, now: Instant) {
    if let Some(at) = heard {
        link.peer_heard(at);
    }
    link.handle_timeout(now);
}

#[cfg(test)]
mod tests {
    use wanopt_proto::CloseCode;

    use super::super::testing::{SERVICE, SOON, settle_handles, side};
    use super::*;

    /// A stream opened, written, flushed and finished on one handle reads back byte for byte,
    /// then as finished, on the other: the operations the services use, without sockets.
    #[test]
    fn a_stream_written_on_one_handle_reads_back_on_the_other() {
        let (west, east) = (side(true, &|_| {}), side(false, &|_| {}));
        settle_handles(&west.h, &east.h);
        let (id, _sig) = west.h.open(SERVICE, Class::Bulk).expect("open");
        let mut data = Bytes::from_static(b"redo block 1");
        assert_eq!(west.h.write(id, &mut data, true).expect("write"), 12);
        assert!(data.is_empty());
        west.h.finish(id).expect("finish");
        settle_handles(&west.h, &east.h);
        assert!(
            east.h.signal(id).is_some(),
            "the peer's open has its wakeups"
        );
        let mut got = Vec::new();
        loop {
            match east.h.read(id).expect("read") {
                ReadOutcome::Data(b) => got.extend_from_slice(&b),
                ReadOutcome::Fin => break,
                ReadOutcome::Blocked => panic!("blocked with everything delivered"),
            }
        }
        assert_eq!(got, b"redo block 1");
        east.h.finish(id).expect("finish back");
        settle_handles(&west.h, &east.h);
        assert_eq!(west.h.read(id).expect("read the end"), ReadOutcome::Fin);
        settle_handles(&west.h, &east.h);
        assert!(
            !west.h.contains(id) && !east.h.contains(id),
            "gone on both sides"
        );
        west.h.forget(id);
        east.h.forget(id);
    }

    /// A reader waiting for the link to let it go on is woken by the next operation that routes
    /// the link's events (here, the close), not by polling.
    #[tokio::test]
    async fn a_waiting_reader_is_woken_by_the_operation_that_frees_it() {
        let west = side(true, &|_| {});
        let h = west.h.clone();
        let waiter = crate::spawn(async move { h.wait_until(Link::is_closed).await });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        west.h.with(|l| l.close(CloseCode::Normal, "done"));
        tokio::time::timeout(SOON, waiter)
            .await
            .expect("woken at once")
            .expect("the waiter ran");
    }

    /// Writes wake only the lanes that have frames to send: after a bulk write, the main
    /// lane's writer; an idle lane's writer sleeps on.
    #[test]
    fn only_lanes_with_frames_are_woken() {
        let (west, east) = (side(true, &|_| {}), side(false, &|_| {}));
        settle_handles(&west.h, &east.h);
        let (id, _) = west.h.open(SERVICE, Class::Bulk).expect("open");
        let mut data = Bytes::from_static(b"bulk");
        west.h.write(id, &mut data, true).expect("write");
        let wants = west.h.wants(&west.h.state());
        assert!(wants[MAIN_LANE], "the main lane has the stream's frames");
        assert!(!wants[LATENCY_LANE], "the latency lane has nothing");
    }
}
