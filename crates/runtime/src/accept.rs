//! The listening side of link establishment: accepting the peer's TLS connections through the
//! [`Gate`], checking who it is, and telling a new link's main connection (or one that resumes
//! the current link) from a latency lane, or a copy of it, that attaches to the link whose token
//! it presents.

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tracing::{info, warn};
use wanopt_proto::Frame;

use crate::counters::add;
use crate::driver::{self, LinkHandle};
use crate::gate::{Gate, Ticket};
use crate::handshake::{read_first_frame, record_peer_expiry};
use crate::listen::accept_loop;
use crate::peer::Peer;
use crate::sockopt;
use crate::sync::LogBudget;
use crate::tls;
use crate::wire::{READ_CHUNK, Wire};

/// Accepts the peer's TLS connections (listening side), admitting a bounded number of them at a
/// time until they have authenticated.
pub(crate) async fn accept_links(peer: Arc<Peer>, listener: TcpListener) {
    let gate = Arc::new(Gate::default());
    accept_loop(&listener, "link", |tcp, addr| {
        let cfg = peer.cfg();
        if !crate::config::allowed(&cfg.link.allow, addr.ip()) {
            // Outside link.allow: closed before a byte of TLS, counted, logged sparingly.
            add(&peer.counters.link.outside_allow, 1);
            if let Some(suppressed) = OUTSIDERS.take(Instant::now()) {
                warn!(from = %addr, suppressed, "refused link connection outside link.allow");
            }
            sockopt::abort(&tcp);
            return true;
        }
        let limits = &cfg.limits;
        let (ticket, evicted) =
            gate.admit(addr.ip(), limits.max_handshakes, limits.handshakes_per_source);
        if let Some(why) = evicted {
            add(&peer.counters.link.handshakes_evicted, 1);
            if let Some(suppressed) = EVICTIONS.take(Instant::now()) {
                warn!(from = %addr, reason = ?why, suppressed, "too many link connections authenticating; dropped one");
            }
        }
        peer.counters.link.handshakes_pending.set(gate.pending() as i64);
        let (peer, gate) = (peer.clone(), gate.clone());
        crate::spawn(async move {
            accept_link(&peer, &gate, tcp, addr, ticket).await;
            peer.counters.link.handshakes_pending.set(gate.pending() as i64);
        });
        true
    })
    .await;
}

/// Failures before authentication are anyone's to cause: their log lines are rationed.
static REJECTIONS: LogBudget = LogBudget::new(Duration::from_secs(10), 10);
static EVICTIONS: LogBudget = LogBudget::new(Duration::from_secs(10), 1);
static OUTSIDERS: LogBudget = LogBudget::new(Duration::from_secs(10), 1);

fn reject(peer: &Peer, addr: SocketAddr, why: &str, error: &dyn std::fmt::Display) {
    add(&peer.counters.link.rejected, 1);
    if let Some(suppressed) = REJECTIONS.take(Instant::now()) {
        warn!(from = %addr, error = %error, suppressed, "rejected link: {why}");
    }
}

/// Authenticates one incoming connection and runs it as a link or attaches it as a lane.
async fn accept_link(
    peer: &Arc<Peer>,
    gate: &Gate,
    tcp: TcpStream,
    addr: SocketAddr,
    ticket: Ticket,
) {
    let cfg = peer.cfg();
    let pre_auth = async {
        let acceptor = tokio_rustls::TlsAcceptor::from(peer.tls().server);
        // Congestion control stays the listener's (the lane's) until the hello shows the role.
        sockopt::tune_link_options(&socket2::SockRef::from(&tcp), &cfg.link);
        let hs = tokio::time::timeout(
            cfg.limits.handshake_timeout,
            acceptor.accept(Wire::new(tcp)),
        )
        .await;
        let mut tls = match hs {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => return Err(("TLS handshake failed", e.to_string())),
            Err(_) => return Err(("TLS handshake timed out", "timeout".into())),
        };
        if let Err(e) = tls::check_peer_name(tls.get_ref().1.peer_certificates(), &cfg.link.peer) {
            return Err(("wrong peer", e.to_string()));
        }
        // Only the peer's own certificate sets the expiry it is alerted on.
        record_peer_expiry(peer, tls.get_ref().1.peer_certificates());
        // Authenticated: reads may now be buffered.
        tls.get_mut().0.buffer(READ_CHUNK);
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
    // The peer proved itself from this source: its next connections from there get kept room.
    gate.authenticated(addr.ip());
    let setting = |id| match &first {
        Frame::Hello(h) => h.setting(id),
        _ => None,
    };
    use wanopt_proto::frame::setting::{ATTACH, COPY_AT, COPY_OF};
    let attach = setting(ATTACH);
    let (lane_id, copy_at) = (setting(COPY_OF), setting(COPY_AT));
    let sock = socket2::SockRef::from(tls.get_ref().0.get_ref());
    let fd = Some(tls.get_ref().0.get_ref().as_raw_fd());
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
                _ => {
                    // The lane's datagram keys, from its first connection's TLS session.
                    let keys = lane_id.and_then(|id| crate::datagrams::export(tls.get_ref().1, id));
                    let lane = (token, lane_id, keys);
                    accept_lane(peer.clone(), tls, fd, addr, lane, buf).await
                }
            }
        }
    }
}

/// The current link, if a connection presenting `token` resumes it; it is then handed the
/// connection's socket `fd` (see [`LinkHandle::reconnect`]).
async fn resumed_link(
    peer: &Arc<Peer>,
    token: Option<u64>,
    fd: Option<std::os::fd::RawFd>,
) -> Option<Arc<LinkHandle>> {
    let token = token?;
    let h = peer.current.borrow().clone()?;
    if !h.with(|l| l.resumes(token)) {
        return None;
    }
    let saved = peer.saved_states().await;
    h.reconnect(fd, saved, Some(token)).then_some(h)
}

/// Runs an accepted connection of the latency lane (`first` goes out before any lane byte) as a
/// task that ends with the link.
fn start_lane<S>(
    h: &Arc<LinkHandle>,
    stream: S,
    fd: Option<std::os::fd::RawFd>,
    addr: SocketAddr,
    buf: BytesMut,
    carrier: driver::Carrier,
    first: Option<BytesMut>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let task = crate::spawn(driver::run_lane(
        h.clone(),
        stream,
        fd,
        addr,
        buf,
        carrier,
        first,
    ));
    h.keep_task(task);
}

/// Attaches an incoming connection as one more copy of the current link's latency lane: it
/// presents the link's token and the lane's id, and where its bytes start (`at`). Our answer,
/// where ours start, goes first on it.
fn accept_copy<S>(
    peer: &Arc<Peer>,
    stream: S,
    fd: Option<std::os::fd::RawFd>,
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
            start_lane(&h, stream, fd, addr, buf, carrier, Some(answer));
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
    fd: Option<std::os::fd::RawFd>,
    addr: SocketAddr,
    (token, id, keys): (
        u64,
        Option<u64>,
        Option<[u8; wanopt_proto::datagram::EXPORT_LEN]>,
    ),
    buf: BytesMut,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    // The lane may arrive before this side has processed the main connection's hello.
    let mut rx = peer.current.subscribe();
    let attached = tokio::time::timeout(peer.cfg().limits.handshake_timeout, async {
        loop {
            let current = rx.borrow_and_update().clone();
            let datagrams = keys
                .zip(id)
                .zip(peer.datagram_socket.get())
                .map(|((k, id), s)| {
                    crate::datagrams::LaneDatagrams::new(&k, id, false, s.clone(), None)
                });
            if let Some(h) = current
                && let Some(conn) = h.attach_lane(token, id, datagrams)
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
            start_lane(&h, stream, fd, addr, buf, conn, None);
        }
        _ => {
            add(&peer.counters.link.rejected, 1);
            warn!(from = %addr, "rejected latency lane: no link with its token");
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncWriteExt;

    use super::*;
    use crate::peer::testing::{certs, peer};

    /// Waits until `f` holds, for at most ten seconds.
    async fn until(mut f: impl FnMut() -> bool) {
        tokio::time::timeout(Duration::from_secs(10), async {
            while !f() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("in time");
    }

    /// Garbage instead of TLS, and a certificate of the right CA but another site's name, are
    /// both rejected and counted; nothing of them reaches the supervisor.
    #[tokio::test]
    async fn strangers_and_other_sites_are_rejected() {
        let dir = tempfile::tempdir().expect("tempdir");
        certs(dir.path(), &["west", "east", "north"]);
        let mut east = peer(dir.path(), "east", "{listen: '127.0.0.1:0', peer: west}");
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = l.local_addr().expect("addr");
        let task = crate::spawn(accept_links(east.peer.clone(), l));
        let rejected = || east.peer.counters.link.rejected.get();

        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"GET / HTTP/1.1\r\n\r\n").await.expect("write");
        until(|| rejected() == 1).await;

        let north = peer(dir.path(), "north", "{connect: 'x:1', peer: east}");
        let connector = tokio_rustls::TlsConnector::from(north.peer.tls().client);
        let tcp = TcpStream::connect(addr).await.expect("connect");
        let name = tls::server_name("east").expect("name");
        // The handshake may complete on our side before the listener checks the name.
        let _ = connector.connect(name, tcp).await;
        until(|| rejected() == 2).await;
        assert!(east.rx.try_recv().is_err(), "no link came up");
        task.abort();
    }
}
