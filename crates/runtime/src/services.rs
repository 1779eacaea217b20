//! The services: local clients of a `listen` service get a stream each, a stream the peer opened
//! is connected to our target for its service, and one task per stream pumps both directions
//! between the local socket and the link until both ends finish. Any failure resets the local
//! socket, so the application sees an error, never a silently truncated stream.

use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, info, warn};
use wanopt_proto::{ReadOutcome, ResetCode, StreamId};

use crate::config::ServiceKind;
use crate::counters::{ServiceCounters, add};
use crate::driver::{LinkHandle, StreamSignal};
use crate::listen::accept_loop;
use crate::peer::Peer;
use crate::sockopt;
use crate::sync::LogBudget;
use crate::wire::READ_CHUNK;

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
                    pump(h, id, sig, sock, counters, &svc.name, svc.idle_timeout).await;
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

/// Connects a stream the peer opened to `target`, our address for its service.
pub(crate) async fn serve_incoming(
    h: Arc<LinkHandle>,
    id: StreamId,
    service: Arc<str>,
    (target, connect_timeout): (String, Duration),
    counters: Arc<ServiceCounters>,
    idle: Option<Duration>,
) {
    let Some(sig) = h.signal(id) else { return };
    let conn = tokio::time::timeout(connect_timeout, TcpStream::connect(&target)).await;
    let (label, why, msg) = match conn {
        Ok(Ok(sock)) => {
            sockopt::tune_local(&sock);
            add(&counters.streams_opened, 1);
            debug!(link = h.id, service = %service, stream = %id, target = %target, "stream connected");
            return pump(h, id, sig, sock, counters, &service, idle).await;
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

/// Moves bytes both ways between a local socket and a stream until both directions finish, or
/// no byte moved either way for `idle`. Any failure closes the socket with a reset, so the
/// application sees an error, never a silently truncated stream.
async fn pump(
    h: Arc<LinkHandle>,
    id: StreamId,
    sig: Arc<StreamSignal>,
    mut sock: TcpStream,
    c: Arc<ServiceCounters>,
    service: &str,
    idle: Option<Duration>,
) {
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
            let mut buf = BytesMut::new();
            loop {
                // An idle client holds no read buffer: wait until the socket is readable, then
                // take room for a read (thousands of idle streams cost little memory).
                let n = loop {
                    let sock: &TcpStream = rd.as_ref();
                    tokio::select! {
                        r = sock.readable() => r.map_err(|e| format!("local read: {e}"))?,
                        _ = sig.gone.notified() => return Err(sig.reason()),
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
                    return Ok::<(), String>(());
                }
                add(&c.raw_out, n as u64);
                moved();
                // A read that did not fill the room offered drained the socket: the client paused,
                // so an optimized stream must not hold its last bytes back for a chunk boundary.
                let drained = buf.len() < buf.capacity();
                // Hand the bytes over without copying; the buffer's spare room is kept for reads.
                // The flush of a drained read goes with its last bytes: one lock, one wakeup.
                let mut chunk = buf.split().freeze();
                if drained {
                    // The client paused: keep no spare room while it is quiet.
                    buf = BytesMut::new();
                }
                while !chunk.is_empty() {
                    let k = h.write(id, &mut chunk, drained).map_err(|_| sig.reason())?;
                    if k == 0 {
                        tokio::select! {
                            _ = sig.writable.notified() => {}
                            _ = sig.gone.notified() => return Err(sig.reason()),
                        }
                    }
                }
            }
        };
        let down = async {
            loop {
                match h.read(id) {
                    Ok(ReadOutcome::Data(b)) => {
                        wr.write_all(&b)
                            .await
                            .map_err(|e| format!("local write: {e}"))?;
                        add(&c.raw_in, b.len() as u64);
                        moved();
                    }
                    Ok(ReadOutcome::Blocked) => sig.readable.notified().await,
                    Ok(ReadOutcome::Fin) => {
                        wr.shutdown()
                            .await
                            .map_err(|e| format!("local shutdown: {e}"))?;
                        return Ok::<(), String>(());
                    }
                    Err(_) => return Err(sig.reason()),
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
        Ok(_) => loop {
            if !h.contains(id) {
                break match sig.reset_reason() {
                    Some(r) => Err(r),
                    None => Ok(()),
                };
            }
            let _ = tokio::time::timeout(Duration::from_millis(200), sig.gone.notified()).await;
        },
        Err(e) => Err(e),
    };
    c.streams_active.dec();
    match result {
        Ok(()) => debug!(link = h.id, service, stream = %id, "stream closed"),
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
