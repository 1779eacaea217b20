//! The services: local clients of a `listen` service get a stream each, a stream the peer opened
//! is connected to our target for its service, and one task per stream pumps both directions
//! between the local socket and the link until both ends finish. Any failure resets the local
//! socket, so the application sees an error, never a silently truncated stream.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, info, warn};
use wanopt_proto::{ReadOutcome, ResetCode, StreamId};

use crate::config::ServiceKind;
use crate::counters::{ServiceCounters, add};
use crate::driver::{LinkHandle, StreamSignal};
use crate::handover::Parked;
use crate::listen::accept_loop;
use crate::peer::{Peer, Pumping};
use crate::sockopt;
use crate::sync::LogBudget;
use crate::wire::READ_CHUNK;

/// How long an optimized bulk stream waits, after a read that emptied its client's socket, for
/// the client to write more before what it holds goes out: a client that writes in pieces with
/// short pauses gets frames of a turn each, not one per write...
const GATHER_QUIET: Duration = Duration::from_millis(5);
/// ...and at most this long after the first byte that waits so. A client's first write after
/// this long without a flush (a request, a response, a commit) goes at once.
const GATHER_MAX: Duration = Duration::from_millis(20);

/// A pump's write to its client gathers up to this many pieces the link holds...
const GATHER_PIECES: usize = 64;
/// ...and no more once it holds this many bytes.
const GATHER_BYTES: usize = 1 << 20;

/// Anyone can connect to a service port: refusals of outsiders are rationed in the log.
static OUTSIDERS: LogBudget = LogBudget::new(Duration::from_secs(10), 10);
static OVER_LIMIT: LogBudget = LogBudget::new(Duration::from_secs(10), 10);

/// Accepts local clients of a `listen` service and opens a stream for each.
/// Each client is judged by the service's settings in the config in force when it connects, so a
/// reload that changes the class or the allow list applies to new clients at once.
pub(crate) async fn accept_clients(peer: Arc<Peer>, name: String, listener: TcpListener) {
    let counters = peer.counters.service(&name);
    accept_loop(&listener, &name.clone(), |sock, from| {
        let Some(svc) = peer.cfg().services.iter().find(|s| s.name == name).cloned() else {
            sockopt::abort(&sock);
            return false;
        };
        let ServiceKind::Listen { allow, .. } = &svc.kind else {
            sockopt::abort(&sock);
            return false;
        };
        if !crate::config::allowed(allow, from.ip()) {
            add(&counters.streams_refused, 1);
            if let Some(suppressed) = OUTSIDERS.take(std::time::Instant::now()) {
                warn!(service = %svc.name, from = %from, suppressed, "refused client outside the allow list");
            }
            sockopt::abort(&sock);
            return true;
        }
        let slot = match peer.slots.take(&svc, &peer.cfg().limits, from.ip()) {
            Ok(s) => s,
            Err(limit) => {
                add(&counters.streams_refused, 1);
                counters.failed(limit);
                if let Some(suppressed) = OVER_LIMIT.take(std::time::Instant::now()) {
                    warn!(service = %svc.name, from = %from, limit, suppressed, "refused client: at a stream limit");
                }
                sockopt::abort(&sock);
                return true;
            }
        };
        sockopt::tune_local(&sock);
        let peer = peer.clone();
        let counters = counters.clone();
        crate::spawn(async move {
            let _slot = slot;
            if peer.parking() {
                sockopt::abort(&sock);
                return;
            }
            let mut rx = peer.current.subscribe();
            let h = match tokio::time::timeout(
                peer.cfg().limits.link_wait,
                rx.wait_for(Option::is_some),
            )
            .await
            {
                Ok(Ok(v)) => v.clone(),
                _ => None,
            };
            let Some(h) = h else {
                add(&counters.streams_refused, 1);
                warn!(service = %svc.name, from = %from, "refused client: no link to the peer");
                sockopt::abort(&sock);
                return;
            };
            match h.open(&svc.name, svc.class) {
                Ok((id, sig)) => {
                    add(&counters.streams_opened, 1);
                    debug!(link = h.id, service = %svc.name, stream = %id, from = %from, "stream opened");
                    let at = Pumped {
                        counters,
                        service: &svc.name,
                        idle: svc.idle_timeout,
                        resume: Resume::default(),
                    };
                    pump(&peer, h, id, sig, sock, at).await;
                }
                Err(e) => {
                    add(&counters.streams_refused, 1);
                    warn!(service = %svc.name, from = %from, error = %e, "refused client");
                    sockopt::abort(&sock);
                }
            }
        });
        true
    })
    .await;
}

/// Connects a stream the peer opened to `target`, our address for its service. A handover
/// meanwhile leaves the stream unconnected: the new process connects it.
pub(crate) async fn serve_incoming(
    peer: Arc<Peer>,
    h: Arc<LinkHandle>,
    id: StreamId,
    service: Arc<str>,
    (target, connect_timeout): (String, Duration),
    counters: Arc<ServiceCounters>,
    idle: Option<Duration>,
) {
    let _live = Pumping::new(&peer);
    let Some(sig) = h.signal(id) else { return };
    let mut parking = peer.parking.subscribe();
    let conn = tokio::select! {
        c = tokio::time::timeout(connect_timeout, TcpStream::connect(&target)) => c,
        _ = parking.wait_for(|p| *p) => return,
    };
    let (label, why, msg) = match conn {
        Ok(Ok(sock)) => {
            sockopt::tune_local(&sock);
            add(&counters.streams_opened, 1);
            debug!(link = h.id, service = %service, stream = %id, target = %target, "stream connected");
            let at = Pumped {
                counters,
                service: &service,
                idle,
                resume: Resume::default(),
            };
            return pump(&peer, h, id, sig, sock, at).await;
        }
        Ok(Err(e)) => (
            "target_refused",
            format!("connect {target}: {e}"),
            "target refused",
        ),
        Err(_) => (
            "target_timeout",
            format!("connect {target}: timed out"),
            "target unreachable",
        ),
    };
    counters.failed(label);
    warn!(link = h.id, service = %service, stream = %id, error = %why, "{msg}");
    h.reset(id, ResetCode::TargetRefused, &why);
    h.forget(id);
}

/// Where a stream's pump starts: afresh, or where the process before left it (see
/// `crate::handover`).
#[derive(Debug, Default)]
pub(crate) struct Resume {
    pub pending_up: Bytes,
    pub pending_down: Bytes,
    pub up_done: bool,
    pub down_done: bool,
}

/// What a pump moves bytes for and counts them as.
pub(crate) struct Pumped<'a> {
    pub counters: Arc<ServiceCounters>,
    pub service: &'a str,
    pub idle: Option<Duration>,
    pub resume: Resume,
}

/// How one direction of a pump ended.
enum Half {
    Done,
    /// Stopped for a handover, with the bytes it held.
    Parked(Bytes),
}

/// Moves bytes both ways between a local socket and a stream until both directions finish, or
/// no byte moved either way for `idle`. Any failure closes the socket with a reset, so the
/// application sees an error, never a silently truncated stream. A handover parks it: it stops
/// reading, keeps what it read or was writing, and leaves the socket to the new process.
async fn pump(
    peer: &Peer,
    h: Arc<LinkHandle>,
    id: StreamId,
    sig: Arc<StreamSignal>,
    mut sock: TcpStream,
    at: Pumped<'_>,
) {
    let _live = Pumping::new(peer);
    let (c, service, idle) = (at.counters, at.service, at.idle);
    let Resume {
        pending_up,
        pending_down,
        up_done,
        down_done,
    } = at.resume;
    c.streams_active.inc();
    let start = tokio::time::Instant::now();
    // Milliseconds since `start` of the last byte moved either way.
    let last = std::sync::atomic::AtomicU64::new(0);
    let moved = || {
        let ms = start.elapsed().as_millis() as u64;
        last.store(ms, std::sync::atomic::Ordering::Relaxed);
    };
    let watchdog = async {
        let Some(idle) = idle else {
            return std::future::pending().await;
        };
        loop {
            let at = Duration::from_millis(last.load(std::sync::atomic::Ordering::Relaxed));
            let due = start + at + idle;
            if tokio::time::Instant::now() >= due {
                return format!("idle for {}s (idle_timeout)", idle.as_secs());
            }
            tokio::time::sleep_until(due).await;
        }
    };
    let result = {
        let (rd, mut wr) = sock.split();
        let up = async {
            if up_done {
                return Ok::<Half, String>(Half::Done);
            }
            let mut parking = peer.parking.subscribe();
            // Bytes the process before had read and not handed to the link yet go first.
            let mut chunk = pending_up;
            let mut buf = BytesMut::new();
            let gathers = h.with(|l| l.gathers(id));
            // With a client paused: when what the stream holds goes out, and when the first of
            // it came.
            let mut flush: Option<(tokio::time::Instant, tokio::time::Instant)> = None;
            // When the stream was last flushed.
            let mut flushed: Option<tokio::time::Instant> = None;
            loop {
                while !chunk.is_empty() {
                    let k = h.write(id, &mut chunk, true).map_err(|_| sig.reason())?;
                    if k == 0 {
                        tokio::select! {
                            _ = sig.writable.notified() => {}
                            _ = sig.gone.notified() => return Err(sig.reason()),
                            _ = parking.wait_for(|p| *p) => return Ok(Half::Parked(chunk)),
                        }
                    }
                }
                // An idle client holds no read buffer: wait until the socket is readable, then
                // take room for a read (thousands of idle streams cost little memory).
                let n = loop {
                    let sock: &TcpStream = rd.as_ref();
                    let due = flush.map(|(due, _)| due);
                    tokio::select! {
                        r = sock.readable() => r.map_err(|e| format!("local read: {e}"))?,
                        _ = sig.gone.notified() => return Err(sig.reason()),
                        _ = parking.wait_for(|p| *p) => {
                            // What waits goes with the stream's state to the new process.
                            if flush.is_some() {
                                h.flush(id);
                            }
                            return Ok(Half::Parked(Bytes::new()));
                        }
                        _ = tokio::time::sleep_until(due.unwrap_or_else(tokio::time::Instant::now)), if due.is_some() => {
                            h.flush(id);
                            flush = None;
                            flushed = Some(tokio::time::Instant::now());
                            continue;
                        }
                    }
                    if buf.capacity() - buf.len() < READ_CHUNK / 4 {
                        buf.reserve(READ_CHUNK);
                    }
                    match sock.try_read_buf(&mut buf) {
                        Ok(n) => break n,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) => return Err(format!("local read: {e}")),
                    }
                };
                if n == 0 {
                    h.finish(id).map_err(|_| sig.reason())?;
                    return Ok(Half::Done);
                }
                add(&c.raw_out, n as u64);
                moved();
                // A read that did not fill the room offered drained the socket: the client paused,
                // so an optimized stream must not hold its last bytes back for a chunk boundary.
                let drained = buf.len() < buf.capacity();
                // Hand the bytes over without copying; the buffer's spare room is kept for reads.
                // The flush of a drained read goes with its last bytes: one lock, one wakeup.
                chunk = buf.split().freeze();
                if drained {
                    // The client paused: keep no spare room while it is quiet.
                    buf = BytesMut::new();
                }
                // A bulk stream's flush waits a little for the client's next write, unless the
                // client was quiet for a while: then it goes at once.
                let now = tokio::time::Instant::now();
                let busy = flush.is_some()
                    || flushed.is_some_and(|t| now.saturating_duration_since(t) < GATHER_MAX);
                let now_flush = drained && !(gathers && busy);
                if now_flush {
                    flush = None;
                    flushed = Some(now);
                } else if drained {
                    let first = flush.map_or(now, |(_, first)| first);
                    flush = Some(((now + GATHER_QUIET).min(first + GATHER_MAX), first));
                }
                while !chunk.is_empty() {
                    let k = h
                        .write(id, &mut chunk, now_flush)
                        .map_err(|_| sig.reason())?;
                    if k == 0 {
                        tokio::select! {
                            _ = sig.writable.notified() => {}
                            _ = sig.gone.notified() => return Err(sig.reason()),
                            _ = parking.wait_for(|p| *p) => {
                                if flush.is_some() {
                                    h.flush(id);
                                }
                                return Ok(Half::Parked(chunk));
                            }
                        }
                    }
                }
            }
        };
        let down = async {
            if down_done {
                return Ok::<Half, String>(Half::Done);
            }
            let mut parking = peer.parking.subscribe();
            // Bytes the process before had taken from the link and not written yet go first.
            let mut pending = std::collections::VecDeque::new();
            if !pending_down.is_empty() {
                pending.push_back(pending_down);
            }
            loop {
                if pending.is_empty() {
                    if *parking.borrow() {
                        return Ok(Half::Parked(Bytes::new()));
                    }
                    match h.read(id) {
                        Ok(ReadOutcome::Data(b)) => pending.push_back(b),
                        Ok(ReadOutcome::Blocked) => {
                            tokio::select! {
                                _ = sig.readable.notified() => {}
                                _ = parking.wait_for(|p| *p) => return Ok(Half::Parked(Bytes::new())),
                            }
                            continue;
                        }
                        Ok(ReadOutcome::Fin) => {
                            wr.shutdown()
                                .await
                                .map_err(|e| format!("local shutdown: {e}"))?;
                            return Ok(Half::Done);
                        }
                        Err(_) => return Err(sig.reason()),
                    }
                }
                // What else the link holds, gathered for one vectored write: a frame's
                // literals decompressed ahead come as chunks of their own (about 8 KiB).
                let held: usize = pending.iter().map(Bytes::len).sum();
                let room = GATHER_PIECES.saturating_sub(pending.len());
                if room > 0 && held < GATHER_BYTES {
                    h.read_more(id, &mut pending, room, GATHER_BYTES - held);
                }
                // What is written is counted off exactly, so a handover knows what is left.
                tokio::select! {
                    r = async {
                        let slices: Vec<std::io::IoSlice<'_>> =
                            pending.iter().map(|b| std::io::IoSlice::new(b)).collect();
                        wr.write_vectored(&slices).await
                    } => {
                        let n = r.map_err(|e| format!("local write: {e}"))?;
                        if n == 0 {
                            return Err("local write: closed".into());
                        }
                        written(&mut pending, n);
                        add(&c.raw_in, n as u64);
                        moved();
                    }
                    _ = parking.wait_for(|p| *p) => return Ok(Half::Parked(joined(pending))),
                }
            }
        };
        tokio::select! {
            r = async { tokio::try_join!(up, down) } => r,
            why = watchdog => Err(why),
        }
    };
    let result = match result {
        // Both ways finished: wait until the link has sent our end too, so a link that dies
        // before then still fails the client.
        Ok((Half::Done, Half::Done)) => {
            let mut parking = peer.parking.subscribe();
            loop {
                if !h.contains(id) {
                    break match sig.reset_reason() {
                        Some(r) => Err(r),
                        None => Ok(None),
                    };
                }
                if *parking.borrow() {
                    break Ok(Some((Half::Done, Half::Done)));
                }
                tokio::select! {
                    _ = tokio::time::timeout(Duration::from_millis(200), sig.gone.notified()) => {}
                    _ = parking.wait_for(|p| *p) => {}
                }
            }
        }
        Ok(halves) => Ok(Some(halves)),
        Err(e) => Err(e),
    };
    c.streams_active.dec();
    match result {
        Ok(None) => debug!(link = h.id, service, stream = %id, "stream closed"),
        Ok(Some((up, down))) => {
            let (up_done, pending_up) = match up {
                Half::Done => (true, Bytes::new()),
                Half::Parked(b) => (false, b),
            };
            let (down_done, pending_down) = match down {
                Half::Done => (true, Bytes::new()),
                Half::Parked(b) => (false, b),
            };
            match sock.into_std() {
                Ok(sock) => {
                    debug!(link = h.id, service, stream = %id, "stream parked for the new process");
                    peer.parked
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push(Parked {
                            id,
                            sock,
                            pending_up,
                            pending_down,
                            up_done,
                            down_done,
                        });
                }
                Err(e) => {
                    warn!(link = h.id, service, stream = %id, error = %e, "cannot park a stream; it is reset");
                    h.reset(id, ResetCode::SocketError, "lost in a handover");
                }
            }
            return;
        }
        Err(why) => {
            let label = failure_label(&why);
            c.failed(label);
            if label.starts_with("target_") {
                // The peer could not connect the target: the far side logged it too, but the
                // operator watching this side (where the client is) must see it here.
                warn!(link = h.id, service, stream = %id, reason = %why, "target refused at the peer");
            } else {
                info!(link = h.id, service, stream = %id, reason = %why, "stream failed");
            }
            sockopt::abort(&sock);
            h.reset(id, ResetCode::SocketError, &why);
        }
    }
    h.forget(id);
}

/// The new process of a handover: moves a parked stream's bytes on from where the process
/// before left them.
pub(crate) async fn resume_parked(
    peer: Arc<Peer>,
    h: Arc<LinkHandle>,
    entry: crate::handover::StreamEntry,
    sock: std::net::TcpStream,
    service: Arc<str>,
) {
    let Some(sig) = h.signal(entry.id) else {
        return;
    };
    let sock = match TcpStream::from_std(sock) {
        Ok(s) => s,
        Err(e) => {
            warn!(stream = %entry.id, error = %e, "cannot take a handed-over stream's socket; it is reset");
            h.reset(entry.id, ResetCode::SocketError, "lost in a handover");
            h.forget(entry.id);
            return;
        }
    };
    let cfg = peer.cfg();
    let idle = cfg
        .services
        .iter()
        .find(|s| *s.name == *service)
        .and_then(|s| s.idle_timeout);
    let at = Pumped {
        counters: peer.counters.service(&service),
        service: &service,
        idle,
        resume: Resume {
            pending_up: entry.pending_up,
            pending_down: entry.pending_down,
            up_done: entry.up_done,
            down_done: entry.down_done,
        },
    };
    pump(&peer, h, entry.id, sig, sock, at).await;
}

/// `pending` after a write that took its first `n` bytes.
fn written(pending: &mut std::collections::VecDeque<Bytes>, mut n: usize) {
    while n > 0
        && let Some(b) = pending.front_mut()
    {
        let k = n.min(b.len());
        b.advance(k);
        n -= k;
        if b.is_empty() {
            pending.pop_front();
        }
    }
}

/// The pieces not written yet, as one (what a handover hands the next process).
fn joined(mut pending: std::collections::VecDeque<Bytes>) -> Bytes {
    if pending.len() <= 1 {
        return pending.pop_front().unwrap_or_default();
    }
    let mut all = BytesMut::with_capacity(pending.iter().map(Bytes::len).sum());
    for b in pending {
        all.extend_from_slice(&b);
    }
    all.freeze()
}

/// The `wanopt_streams_failed_total` reason of a stream that ended with `why`: a target the peer
/// could not connect (its reset says `target_refused: connect ADDR: ...`), a stream idle too
/// long, or any other error.
fn failure_label(why: &str) -> &'static str {
    if why.ends_with("(idle_timeout)") {
        "idle_timeout"
    } else if let Some(rest) = why.strip_prefix("target_refused: ") {
        if rest.ends_with("timed out") {
            "target_timeout"
        } else {
            "target_refused"
        }
    } else {
        "stream_error"
    }
}
