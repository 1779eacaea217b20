//! Link establishment: accepting the peer's TLS connections (listening side) or dialing it with
//! backoff (connecting side), checking who it is, and telling a new link's main connection from a
//! latency lane that attaches to the link whose token it presents. Also the accept loop that the
//! link and service listeners share.

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use rand::Rng;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tracing::{info, warn};
use wanopt_proto::{Frame, FrameError};

use crate::config::LinkRole;
use crate::counters::add;
use crate::driver::{self, LinkHandle, Wire, wire};
use crate::gate::{Gate, LogBudget, Ticket};
use crate::peer::Peer;
use crate::sockopt;
use crate::tls;

/// Accepts connections until `on` returns false; a failed accept (out of descriptors, say) is
/// logged and retried after a pause instead of spinning.
pub(crate) async fn accept_loop(
    listener: &TcpListener,
    what: &str,
    mut on: impl FnMut(TcpStream, SocketAddr) -> bool,
) {
    loop {
        match listener.accept().await {
            Ok((sock, from)) => {
                if !on(sock, from) {
                    return;
                }
            }
            Err(e) => {
                warn!(listener = what, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Accepts the peer's TLS connections (listening side), admitting a bounded number of them at a
/// time until they have authenticated.
pub(crate) async fn accept_links(peer: Arc<Peer>, listener: TcpListener) {
    let gate = Arc::new(Gate::default());
    accept_loop(&listener, "link", |tcp, addr| {
        let limits = &peer.cfg().limits;
        let (ticket, evicted) =
            gate.admit(addr.ip(), limits.max_handshakes, limits.handshakes_per_source);
        if let Some(why) = evicted {
            add(&peer.counters.link.handshakes_evicted, 1);
            if let Some(suppressed) = EVICTIONS.take(Instant::now()) {
                warn!(from = %addr, reason = ?why, suppressed, "too many link connections authenticating; dropped the oldest");
            }
        }
        peer.counters.link.handshakes_pending.set(gate.pending() as i64);
        let (peer, gate) = (peer.clone(), gate.clone());
        tokio::spawn(async move {
            accept_link(&peer, tcp, addr, ticket).await;
            peer.counters.link.handshakes_pending.set(gate.pending() as i64);
        });
        true
    })
    .await;
}

/// Failures before authentication are anyone's to cause: their log lines are rationed.
static REJECTIONS: LogBudget = LogBudget::new(Duration::from_secs(10), 10);
static EVICTIONS: LogBudget = LogBudget::new(Duration::from_secs(10), 1);

fn reject(peer: &Peer, addr: SocketAddr, why: &str, error: &dyn std::fmt::Display) {
    add(&peer.counters.link.rejected, 1);
    if let Some(suppressed) = REJECTIONS.take(Instant::now()) {
        warn!(from = %addr, error = %error, suppressed, "rejected link: {why}");
    }
}

/// Authenticates one incoming connection and runs it as a link or attaches it as a lane.
async fn accept_link(peer: &Arc<Peer>, tcp: TcpStream, addr: SocketAddr, ticket: Ticket) {
    let cfg = peer.cfg();
    let pre_auth = async {
        let acceptor = tokio_rustls::TlsAcceptor::from(peer.tls().server);
        // Congestion control stays the listener's (the lane's) until the hello shows the role.
        sockopt::tune_link_options(&socket2::SockRef::from(&tcp), &cfg.link);
        let hs =
            tokio::time::timeout(cfg.limits.handshake_timeout, acceptor.accept(wire(tcp))).await;
        let mut tls = match hs {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => return Err(("TLS handshake failed", e.to_string())),
            Err(_) => return Err(("TLS handshake timed out", "timeout".into())),
        };
        record_peer_expiry(peer, tls.get_ref().1.peer_certificates());
        if let Err(e) = tls::check_peer_name(tls.get_ref().1.peer_certificates(), &cfg.link.peer) {
            return Err(("wrong peer", e.to_string()));
        }
        // Authenticated: reads may now be buffered.
        tls.get_mut().0.buffer(driver::READ_CHUNK);
        match read_first_frame(&mut tls, cfg.limits.handshake_timeout).await {
            Ok((buf, first, n)) => Ok((tls, buf, first, n)),
            Err(e) => Err(("no valid hello", e)),
        }
    };
    let (tls, mut buf, first, n) = tokio::select! {
        r = pre_auth => match r {
            Ok(x) => x,
            Err((why, e)) => return reject(peer, addr, why, &e),
        },
        _ = ticket.evicted.notified() => {
            return reject(peer, addr, "evicted while authenticating", &"a newer connection took its place");
        }
    };
    drop(ticket);
    let setting = |id| match &first {
        Frame::Hello(h) => h.setting(id),
        _ => None,
    };
    use wanopt_proto::frame::setting::{ATTACH, COPY_AT, COPY_OF};
    let attach = setting(ATTACH);
    let (lane_id, copy_at) = (setting(COPY_OF), setting(COPY_AT));
    let sock = socket2::SockRef::from(tls.get_ref().0.get_ref());
    let fd = tls.get_ref().0.get_ref().as_raw_fd();
    match attach {
        None => {
            sockopt::tune_main_lane(&sock, &cfg.link);
            sockopt::log_effective(&sock, &cfg.link);
            let resume = match &first {
                Frame::Hello(h) => h.setting(wanopt_proto::frame::setting::RESUME),
                _ => None,
            };
            let h = match resumed_link(peer, resume, fd).await {
                Some(h) => {
                    info!(link = h.id, from = %addr, "the peer resumes the link");
                    h
                }
                // Not ours to resume (a forged or spent token, or a link given up): a new
                // link, whose hello tells the peer its old streams are gone.
                None => peer.new_link(fd).await,
            };
            // The hello stays in the buffer: the link reads it first.
            driver::run_link(h, tls, addr, buf).await
        }
        Some(token) => {
            let _ = buf.split_to(n);
            sockopt::tune_lane_socket(&sock, &cfg.link);
            match (lane_id, copy_at) {
                (Some(id), Some(at)) => accept_copy(peer, tls, fd, addr, (token, id, at), buf),
                _ => accept_lane(peer.clone(), tls, fd, addr, (token, lane_id), buf).await,
            }
        }
    }
}

/// The current link, if a connection presenting `token` resumes it; it is then handed the
/// connection's socket `fd` (see [`LinkHandle::reconnect`]).
async fn resumed_link(
    peer: &Arc<Peer>,
    token: Option<u64>,
    fd: std::os::fd::RawFd,
) -> Option<Arc<LinkHandle>> {
    let token = token?;
    let h = peer.current.borrow().clone()?;
    if !h.with(|l| l.resumes(token)) {
        return None;
    }
    let saved = peer.saved_states().await;
    h.reconnect(fd, saved, Some(token)).then_some(h)
}

/// Reads the first frame of a new connection (a hello, after TLS authenticated the peer) with a
/// deadline; returns the buffer, which still holds the frame, and the frame's length.
async fn read_first_frame<R: AsyncRead + Unpin>(
    rd: &mut R,
    deadline: Duration,
) -> Result<(BytesMut, Frame, usize), String> {
    let mut buf = BytesMut::with_capacity(4096);
    let end = tokio::time::Instant::now() + deadline;
    loop {
        // The link's own limit: a hello that offers many saved caches is larger than a
        // read's worth, and a smaller limit here would refuse every reconnect of such a peer.
        match Frame::check(&buf, wanopt_proto::HELLO_MAX) {
            Ok(n) => {
                let f = Frame::parse(bytes::Bytes::copy_from_slice(&buf[..n]))
                    .map_err(|e| e.to_string())?;
                return Ok((buf, f, n));
            }
            Err(FrameError::Incomplete) => {}
            Err(e) => return Err(e.to_string()),
        }
        match tokio::time::timeout_at(end, rd.read_buf(&mut buf)).await {
            Err(_) => return Err("no hello in time".into()),
            Ok(Ok(0)) => return Err("closed before its hello".into()),
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(format!("read: {e}")),
        }
    }
}

/// Attaches an incoming connection as one more copy of the current link's latency lane: it
/// presents the link's token and the lane's id, and where its bytes start (`at`). Our answer,
/// where ours start, goes first on it.
fn accept_copy<S>(
    peer: &Arc<Peer>,
    stream: S,
    fd: std::os::fd::RawFd,
    addr: SocketAddr,
    (token, id, at): (u64, u64, u64),
    buf: BytesMut,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let current = peer.current.borrow().clone();
    let accepted = current
        .ok_or_else(|| "no link".to_string())
        .and_then(|h| Ok((h.accept_copy(token, id, at)?, h)));
    match accepted {
        Ok(((carrier, ours), h)) => {
            let mut answer = BytesMut::new();
            h.with(|l| l.copy_answer(ours)).encode(&mut answer);
            info!(link = h.id, from = %addr, copy = carrier.slot + 1, "latency lane copy attached");
            let task = tokio::spawn(driver::run_lane(
                h.clone(),
                stream,
                fd,
                addr,
                buf,
                carrier,
                Some(answer),
            ));
            h.keep_task(task);
        }
        Err(why) => {
            add(&peer.counters.link.rejected, 1);
            warn!(from = %addr, reason = %why, "rejected a latency lane copy");
        }
    }
}

/// Attaches an incoming second connection as the latency lane of the link whose token it
/// presents; `id` is the lane's, which its copies will name.
async fn accept_lane<S>(
    peer: Arc<Peer>,
    stream: S,
    fd: std::os::fd::RawFd,
    addr: SocketAddr,
    (token, id): (u64, Option<u64>),
    buf: BytesMut,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    // The lane may arrive before this side has processed the main connection's hello.
    let mut rx = peer.current.subscribe();
    let attached = tokio::time::timeout(peer.cfg().limits.handshake_timeout, async {
        loop {
            let current = rx.borrow_and_update().clone();
            if let Some(h) = current
                && let Some(conn) = h.attach_lane(token, id)
            {
                return Some((h, conn));
            }
            if rx.changed().await.is_err() {
                return None;
            }
        }
    })
    .await;
    match attached {
        Ok(Some((h, conn))) => {
            info!(link = h.id, from = %addr, "latency lane attached");
            peer.counters.link.lanes.set(2);
            let task = tokio::spawn(driver::run_lane(
                h.clone(),
                stream,
                fd,
                addr,
                buf,
                conn,
                None,
            ));
            h.keep_task(task);
        }
        _ => {
            add(&peer.counters.link.rejected, 1);
            warn!(from = %addr, "rejected latency lane: no link with its token");
        }
    }
}

/// Opens the latency lane of a link (connecting side), once the supervisor saw it come up or
/// its lane was lost alone; a failed dial is tried again (every 250 ms, backing off to 2 s)
/// while the link is up and wants the lane.
pub(crate) async fn open_lane(peer: Arc<Peer>, h: Arc<LinkHandle>, token: u64, target: String) {
    let mut wait = SUSPENDED_RETRY;
    loop {
        match try_open_lane(&peer, &h, token, &target).await {
            Ok(()) => return,
            Err(e) => {
                let wanted = h.with(|l| l.lane_offer() == Some(token));
                if !wanted || peer.stopping() {
                    return;
                }
                warn!(link = h.id, error = %e, retry_in_ms = wait.as_millis() as u64, "cannot open the latency lane; trying again");
            }
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_secs(2));
    }
}

/// Dials a connection of the latency lane (the lane itself or a copy of it): TLS to the peer,
/// the lane's congestion control and socket options.
async fn dial_lane(
    peer: &Arc<Peer>,
    target: &str,
) -> Result<(tokio_rustls::client::TlsStream<Wire>, SocketAddr), String> {
    let cfg = peer.cfg();
    let connector = tokio_rustls::TlsConnector::from(peer.tls().client);
    let name = tls::server_name(&cfg.link.peer).map_err(|e| e.to_string())?;
    let how = (
        cfg.link.lane_congestion.as_str(),
        cfg.limits.connect_timeout,
    );
    let (tls, addr) = dial(peer, target, &connector, name, how).await?;
    sockopt::tune_lane_socket(
        &socket2::SockRef::from(tls.get_ref().0.get_ref()),
        &cfg.link,
    );
    Ok((tls, addr))
}

/// One attempt of [`open_lane`]; runs the lane until it ends once attached.
async fn try_open_lane(
    peer: &Arc<Peer>,
    h: &Arc<LinkHandle>,
    token: u64,
    target: &str,
) -> Result<(), String> {
    let (mut tls, addr) = dial_lane(peer, target).await?;
    let id: u64 = rand::random();
    let mut hello = BytesMut::new();
    h.with(|l| l.lane_hello(token, id, None)).encode(&mut hello);
    tls.write_all(&hello)
        .await
        .map_err(|e| format!("write: {e}"))?;
    let Some(conn) = h.attach_lane(token, Some(id)) else {
        // The link went (or has its lane) meanwhile.
        return Ok(());
    };
    info!(link = h.id, addr = %addr, "latency lane attached");
    peer.counters.link.lanes.set(2);
    let fd = tls.get_ref().0.get_ref().as_raw_fd();
    driver::run_lane(h.clone(), tls, fd, addr, BytesMut::new(), conn, None).await;
    Ok(())
}

/// Dials one more copy of the link's latency lane (connecting side) and runs it until it ends;
/// `dialing` is cleared once it carries the lane or failed, so the next may be dialed.
pub(crate) async fn open_copy(
    peer: &Arc<Peer>,
    h: &Arc<driver::LinkHandle>,
    dialing: &std::sync::atomic::AtomicBool,
) {
    let done = || dialing.store(false, std::sync::atomic::Ordering::Release);
    match dial_copy(peer, h).await {
        Ok(Some((tls, addr, carrier, rest))) => {
            info!(link = h.id, addr = %addr, copy = carrier.slot + 1, "latency lane copy attached");
            done();
            let fd = tls.get_ref().0.get_ref().as_raw_fd();
            driver::run_lane(h.clone(), tls, fd, addr, rest, carrier, None).await;
        }
        Ok(None) => done(),
        Err(e) => {
            warn!(link = h.id, error = %e, "cannot open a latency lane copy");
            // The keeper tries again a second later; a peer refusing copies is not hammered.
            tokio::time::sleep(Duration::from_secs(2)).await;
            done();
        }
    }
}

type CopyConn = (
    tokio_rustls::client::TlsStream<Wire>,
    SocketAddr,
    driver::Carrier,
    BytesMut,
);

/// Connects a copy: its hello names the lane and where our bytes start, the peer's answer
/// where its bytes start. `None` if the lane has no room for it any more.
async fn dial_copy(
    peer: &Arc<Peer>,
    h: &Arc<driver::LinkHandle>,
) -> Result<Option<CopyConn>, String> {
    let cfg = peer.cfg();
    let (Some(token), LinkRole::Connect(target)) = (h.with(|l| l.lane_token()), &cfg.link.role)
    else {
        return Ok(None);
    };
    let (mut tls, addr) = dial_lane(peer, target).await?;
    let Some((carrier, id, start)) = h.add_copy() else {
        return Ok(None);
    };
    let mut hello = BytesMut::new();
    h.with(|l| l.lane_hello(token, id, Some(start)))
        .encode(&mut hello);
    let answered = async {
        tls.write_all(&hello)
            .await
            .map_err(|e| format!("write: {e}"))?;
        let (mut buf, first, n) = read_first_frame(&mut tls, cfg.limits.handshake_timeout).await?;
        let at = match &first {
            Frame::Hello(a) => a.setting(wanopt_proto::frame::setting::COPY_AT),
            _ => None,
        }
        .ok_or("the peer did not take the copy")?;
        let _ = buf.split_to(n);
        h.copy_answered(&carrier, at)?;
        Ok::<BytesMut, String>(buf)
    };
    match answered.await {
        Ok(rest) => Ok(Some((tls, addr, carrier, rest))),
        Err(e) => {
            h.drop_copy(&carrier);
            Err(e)
        }
    }
}

fn record_peer_expiry(peer: &Peer, certs: Option<&[rustls::pki_types::CertificateDer<'_>]>) {
    if let Some(t) = certs
        .and_then(|c| c.first())
        .and_then(|c| tls::not_after(c))
    {
        peer.counters.certs.set("peer", t);
    }
}

/// The longest wait between dials while a suspended link's streams wait. A connect then gets
/// four stated round trips (at least half a second): a SYN lost while the path is down is not
/// retried by the kernel for a second, then two, so a fresh dial gets through sooner.
const SUSPENDED_RETRY: Duration = Duration::from_millis(250);
const SUSPENDED_CONNECT_MIN: Duration = Duration::from_millis(500);

/// Dials the peer (connecting side) and keeps a link up, with capped exponential backoff and jitter.
pub(crate) async fn connect_loop(peer: Arc<Peer>) {
    let LinkRole::Connect(target) = peer.cfg().link.role.clone() else {
        return;
    };
    let name = match tls::server_name(&peer.cfg().link.peer) {
        Ok(n) => n,
        Err(e) => {
            warn!(error = %e, "cannot dial the peer");
            return;
        }
    };
    let mut backoff = peer.cfg().link.reconnect_min;
    let mut shutdown = peer.shutdown.clone();
    // A link whose connection was lost, while its streams wait for the next one.
    let mut suspended: Option<Arc<LinkHandle>> = None;
    loop {
        if peer.stopping() {
            return;
        }
        let started = Instant::now();
        // Built per attempt, so certificates re-read by a reload are used from the next dial.
        let connector = tokio_rustls::TlsConnector::from(peer.tls().client);
        let cfg = peer.cfg();
        let connect_timeout = if suspended.is_some() {
            (cfg.link.rtt * 4)
                .max(SUSPENDED_CONNECT_MIN)
                .min(cfg.limits.connect_timeout)
        } else {
            cfg.limits.connect_timeout
        };
        match dial(
            &peer,
            &target,
            &connector,
            name.clone(),
            (&cfg.link.congestion, connect_timeout),
        )
        .await
        {
            Ok((tls, addr)) => {
                record_peer_expiry(&peer, tls.get_ref().1.peer_certificates());
                let sock = socket2::SockRef::from(tls.get_ref().0.get_ref());
                sockopt::log_effective(&sock, &cfg.link);
                sockopt::tune_main_lane(&sock, &cfg.link);
                let fd = tls.get_ref().0.get_ref().as_raw_fd();
                let h = match suspended.take() {
                    Some(h) if h.reconnect(fd, peer.saved_states().await, None) => {
                        info!(link = h.id, addr = %addr, "resuming the link on a new connection");
                        h
                    }
                    _ => peer.new_link(fd).await,
                };
                driver::run_link(h.clone(), tls, addr, BytesMut::new()).await;
                if started.elapsed() > Duration::from_secs(5) {
                    backoff = cfg.link.reconnect_min;
                }
                if h.with(|l| l.is_suspended()) {
                    suspended = Some(h);
                    if started.elapsed() > Duration::from_secs(1) {
                        // Its streams wait: dial again at once.
                        continue;
                    }
                }
            }
            Err(e) => {
                warn!(peer = %target, error = %e, retry_in_ms = backoff.as_millis() as u64, "cannot reach the peer")
            }
        }
        // A link given up (past its window, or replaced) no longer waits.
        suspended = suspended.filter(|h| h.with(|l| l.is_suspended()));
        let jitter = rand::rng().random_range(0.5..1.5);
        // While streams wait for the link, try often: the window is short.
        let wait = if suspended.is_some() {
            backoff.mul_f64(jitter).min(SUSPENDED_RETRY)
        } else {
            backoff.mul_f64(jitter)
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
        backoff = (backoff * 2).min(peer.cfg().link.reconnect_max);
    }
}

async fn dial(
    peer: &Peer,
    target: &str,
    connector: &tokio_rustls::TlsConnector,
    name: rustls::pki_types::ServerName<'static>,
    (cc, connect_timeout): (&str, Duration),
) -> Result<(tokio_rustls::client::TlsStream<Wire>, SocketAddr), String> {
    let cfg = peer.cfg();
    let limits = &cfg.limits;
    let addr = tokio::net::lookup_host(target)
        .await
        .map_err(|e| format!("resolve {target}: {e}"))?
        .next()
        .ok_or_else(|| format!("resolve {target}: no address"))?;
    let tcp = tokio::time::timeout(connect_timeout, sockopt::link_connect(addr, &cfg.link, cc))
        .await
        .map_err(|_| format!("connect {addr}: timed out"))?
        .map_err(|e| format!("connect {addr}: {e}"))?;
    let tls = tokio::time::timeout(limits.handshake_timeout, connector.connect(name, wire(tcp)))
        .await
        .map_err(|_| format!("TLS handshake with {addr}: timed out"))?
        .map_err(|e| format!("TLS handshake with {addr}: {e}"))?;
    let mut tls = tls;
    tls.get_mut().0.buffer(driver::READ_CHUNK);
    Ok((tls, addr))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// A first frame larger than a read's worth (a hello offering many saved caches) is read
    /// whole, up to the link's own hello limit; beyond it the connection is refused.
    #[tokio::test]
    async fn the_first_frame_may_be_as_large_as_the_link_accepts_a_hello() {
        for (len, ok) in [
            (20_000usize, true),
            (wanopt_proto::HELLO_MAX as usize + 1, false),
        ] {
            let mut frame = BytesMut::new();
            Frame::Data {
                stream: wanopt_proto::frame::StreamId(1),
                offset: 0,
                fin: false,
                data: bytes::Bytes::from(vec![7u8; len]),
            }
            .encode(&mut frame);
            let (mut a, mut b) = tokio::io::duplex(1 << 20);
            let writer = tokio::spawn(async move {
                let _ = a.write_all(&frame).await;
                a
            });
            let r = read_first_frame(&mut b, Duration::from_secs(5)).await;
            assert_eq!(r.is_ok(), ok, "{len}: {:?}", r.err());
            drop(b);
            let _ = writer.await;
        }
    }
}
