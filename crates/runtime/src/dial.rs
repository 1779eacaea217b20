//! The connecting side of link establishment: dialing the peer with backoff and keeping a link
//! up (resuming a suspended one on each new connection), and the latency lane's connections: the
//! lane itself, and as many copies of it as the redundancy policy wants. The driver runs a
//! connection once it is dialed; dialing is this module's alone.

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use rand::Rng;
use tokio::io::AsyncWriteExt;
use tracing::{info, warn};
use wanopt_proto::Frame;

use crate::config::LinkRole;
use crate::driver::{self, LinkHandle};
use crate::handshake::{read_first_frame, record_peer_expiry};
use crate::peer::Peer;
use crate::redundancy::CopyPolicy;
use crate::sockopt;
use crate::tls;
use crate::wire::{READ_CHUNK, Wire};

/// The longest wait between dials while a suspended link's streams wait. A connect then gets
/// four stated round trips (at least half a second): a SYN lost while the path is down is not
/// retried by the kernel for a second, then two, so a fresh dial gets through sooner.
const SUSPENDED_RETRY: Duration = Duration::from_millis(250);
const SUSPENDED_CONNECT_MIN: Duration = Duration::from_millis(500);

/// Dials the peer (connecting side) and keeps a link up, with capped exponential backoff and jitter.
pub(crate) async fn connect_loop(peer: Arc<Peer>, adopted: Option<Arc<LinkHandle>>) {
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
    let mut suspended: Option<Arc<LinkHandle>> = adopted;
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
                let fd = Some(tls.get_ref().0.get_ref().as_raw_fd());
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
    let tls = tokio::time::timeout(
        limits.handshake_timeout,
        connector.connect(name, Wire::new(tcp)),
    )
    .await
    .map_err(|_| format!("TLS handshake with {addr}: timed out"))?
    .map_err(|e| format!("TLS handshake with {addr}: {e}"))?;
    let mut tls = tls;
    tls.get_mut().0.buffer(READ_CHUNK);
    Ok((tls, addr))
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
    // The lane's datagrams: keyed from this connection, on a socket of their own toward the
    // address it dialed.
    let datagrams = (peer.cfg().link.lane_datagrams != crate::datagrams::Setting::Off)
        .then(|| crate::datagrams::export(tls.get_ref().1, id))
        .flatten()
        .zip(crate::datagrams::bind_connecting(addr))
        .map(|(keys, socket)| {
            crate::datagrams::LaneDatagrams::new(&keys, id, true, socket, Some(addr))
        });
    let socket = datagrams.as_ref().map(|d| d.socket());
    let Some(conn) = h.attach_lane(token, Some(id), datagrams) else {
        // The link went (or has its lane) meanwhile.
        return Ok(());
    };
    if let Some(s) = socket.filter(|s| h.lane_uses(s)) {
        let link = h.clone();
        let current = move || Some(link.clone());
        // The socket is connected to nothing: only what opens under the lane's keys is taken.
        let task = crate::spawn(driver::receive_datagrams(s, false, current, |_| true));
        h.keep_task(task);
        h.datagram_hello();
    }
    info!(link = h.id, addr = %addr, "latency lane attached");
    peer.counters.link.lanes.set(2);
    let fd = Some(tls.get_ref().0.get_ref().as_raw_fd());
    driver::run_lane(h.clone(), tls, fd, addr, BytesMut::new(), conn, None).await;
    Ok(())
}

/// Dials one more copy of the link's latency lane (connecting side) and runs it until it ends;
/// `dialing` is cleared once it carries the lane or failed, so the next may be dialed.
pub(crate) async fn open_copy(peer: &Arc<Peer>, h: &Arc<LinkHandle>, dialing: &AtomicBool) {
    let done = || dialing.store(false, Ordering::Release);
    match dial_copy(peer, h).await {
        Ok(Some((tls, addr, carrier, rest))) => {
            info!(link = h.id, addr = %addr, copy = carrier.slot + 1, "latency lane copy attached");
            done();
            let fd = Some(tls.get_ref().0.get_ref().as_raw_fd());
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
async fn dial_copy(peer: &Arc<Peer>, h: &Arc<LinkHandle>) -> Result<Option<CopyConn>, String> {
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

/// The connecting side keeps as many copies as the redundancy policy wants: it dials one more
/// when the lane has fewer (one at a time) and drops the newest when it has more. Ends with
/// the link.
pub(crate) async fn keep_copies(peer: Arc<Peer>, h: Arc<LinkHandle>) {
    let cfg = peer.cfg();
    let mut policy = CopyPolicy::new(cfg.redundancy(), cfg.link.bandwidth_bps);
    let mut wanted_before = 0;
    let dialing = Arc::new(AtomicBool::new(false));
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let current = peer
            .current
            .borrow()
            .as_ref()
            .is_some_and(|c| Arc::ptr_eq(c, &h));
        if !current || h.with(|l| l.is_closed()) || peer.stopping() {
            return;
        }
        let cfg = peer.cfg();
        policy.set(cfg.redundancy(), cfg.link.bandwidth_bps);
        let Some((have, most, sent, received)) = h.lane_state() else {
            continue;
        };
        let now = Instant::now();
        let (retransmitted, segments) = h.lane_segments();
        policy.segments(now, retransmitted, segments);
        let wanted = policy.wanted(now, sent, received).min(most);
        h.datagram_hello();
        h.ctx.counters.link.copies_wanted.set(wanted as i64);
        if wanted != wanted_before && wanted_before != 0 {
            let loss = policy
                .loss()
                .map_or("-".to_string(), |l| format!("{:.2}", l * 100.0));
            info!(
                link = h.id,
                copies = wanted,
                share_pct = format!("{:.1}", policy.share() * 100.0),
                loss_pct = %loss,
                "latency lane copies: the redundancy policy changed"
            );
        }
        wanted_before = wanted;
        if have > wanted {
            h.drop_copies(wanted);
        } else if have < wanted && !dialing.swap(true, Ordering::AcqRel) {
            let (peer, link, dialing) = (peer.clone(), h.clone(), dialing.clone());
            let task = crate::spawn(async move {
                open_copy(&peer, &link, &dialing).await;
            });
            h.keep_task(task);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::LinkMsg;
    use crate::peer::testing::{certs, peer};

    /// The connecting side dials the listening side, both authenticate, and the link comes up
    /// on both; the listener's link offers a latency lane, which the dialer then attaches.
    #[tokio::test]
    async fn a_dialed_link_comes_up_on_both_sides_and_its_lane_attaches() {
        let dir = tempfile::tempdir().expect("tempdir");
        certs(dir.path(), &["west", "east"]);
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        let mut east = peer(dir.path(), "east", "{listen: '127.0.0.1:0', peer: west}");
        let mut west = peer(
            dir.path(),
            "west",
            &format!("{{connect: '{addr}', peer: east}}"),
        );
        let accepting = crate::spawn(crate::accept::accept_links(east.peer.clone(), l));
        let dialing = crate::spawn(connect_loop(west.peer.clone(), None));
        let soon = Duration::from_secs(10);
        let up = |m: Option<LinkMsg>| match m {
            Some(LinkMsg::Up(h, _)) => h,
            _ => panic!("the link came up first"),
        };
        let wh = up(tokio::time::timeout(soon, west.rx.recv())
            .await
            .expect("west up"));
        let eh = up(tokio::time::timeout(soon, east.rx.recv())
            .await
            .expect("east up"));
        assert!(!wh.with(|l| l.is_closed()) && !eh.with(|l| l.is_closed()));

        let token = wh.with(|l| l.lane_offer()).expect("a lane is offered");
        west.peer.current.send_replace(Some(wh.clone()));
        east.peer.current.send_replace(Some(eh.clone()));
        let lane = crate::spawn(open_lane(
            west.peer.clone(),
            wh.clone(),
            token,
            addr.to_string(),
        ));
        tokio::time::timeout(soon, async {
            while !(wh.with(|l| l.lane_attached()) && eh.with(|l| l.lane_attached())) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the lane attached on both sides");
        for t in [accepting, dialing, lane] {
            t.abort();
        }
    }
}
