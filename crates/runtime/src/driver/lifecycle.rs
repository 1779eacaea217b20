//! A link connection's life: [`run_link`] runs the main lane's reader, writer, ticker and
//! sampler until the connection ends, then suspends the link (its streams wait for the next
//! connection) or tells the supervisor it is down; [`run_lane`] does the same for one
//! connection of the latency lane. While a link is suspended a watcher runs its timers until a
//! new connection takes it over or its resume window ends.

use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite};
use tracing::{info, warn};
use wanopt_proto::{CloseCode, LATENCY_LANE, Link, LinkError, MAIN_LANE};

use super::carriers::Carrier;
use super::handle::{LinkHandle, LinkMsg, run_timers};
use super::lane_copies::{CopyEnd, write_copy};
use super::reader::read_link;
use super::sampler::{keep_room, sample_sockets};
use super::writer::write_link;
use crate::counters::add;

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
    let sampler = crate::spawn(sample_sockets(h.clone()));
    let room = h
        .ctx
        .room
        .map(|(max, target)| crate::spawn(keep_room(h.clone(), max, target)));
    let store_waiter = h.ctx.caches.as_ref().map(|c| {
        // Chunks the disk tier read for waiting streams: decode them again.
        let (h, ready) = (h.clone(), c.ready());
        crate::spawn(async move {
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
    if let Some(t) = room {
        t.abort();
    }
    if let Some(t) = store_waiter {
        t.abort();
    }
    let mut g = h.state();
    if h.connection() != conn {
        // A newer connection took the link over: it is that one's now.
        return;
    }
    // Forget the sockets before they close, so no TCP_INFO read can hit a reused descriptor.
    h.forget_fd(0);
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
        if !h.watching.swap(true, Ordering::AcqRel) {
            crate::spawn(while_suspended(h.clone()));
        }
        return;
    }
    let close = g.link.close_error().cloned();
    h.dispatch(&mut g);
    // Wake every stream: their link is gone.
    g.wake_all();
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
        let heard = if timers { h.peer_data_at(now) } else { None };
        let (suspended, wants) = {
            let mut g = h.state();
            if timers && g.link.poll_timeout().is_some_and(|t| t <= now) {
                run_timers(&mut g.link, heard, now);
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

/// Watches a link that starts suspended (one a process before this one handed over): its
/// timers run until a new connection takes it over or the resume window ends.
pub(crate) fn watch_adopted(h: &Arc<LinkHandle>) {
    if !h.watching.swap(true, Ordering::AcqRel) {
        crate::spawn(while_suspended(h.clone()));
    }
}

/// Runs a suspended link's timers (no connection's writer does) until a new connection takes
/// it over, or the resume window ends: then its streams are reset and the supervisor told.
async fn while_suspended(h: Arc<LinkHandle>) {
    watch_suspended(&h).await;
    h.watching.store(false, Ordering::Release);
    // Suspended again just before the flag went down: keep watching.
    if h.with(|l| l.is_suspended()) && !h.watching.swap(true, Ordering::AcqRel) {
        Box::pin(while_suspended(h)).await;
    }
}

/// The loop of [`while_suspended`].
async fn watch_suspended(h: &Arc<LinkHandle>) {
    loop {
        let (next, suspended, closed) = {
            let g = h.state();
            (
                g.link.poll_timeout(),
                g.link.is_suspended(),
                g.link.is_closed(),
            )
        };
        if closed {
            let mut g = h.state();
            h.dispatch(&mut g);
            let streams = g.signals.len();
            add(&h.ctx.counters.link.streams_lost, streams as u64);
            g.wake_all();
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

/// Runs one connection of the latency lane until it ends: its reader (through the merge), its
/// writer (through the fanout) and its ticker. `first` is written before any lane byte (the
/// listener's answer to a copy). When it ends, the other copies carry on; when none can, the
/// lane is lost: it re-attaches (the supervisor dials it on the connecting side) and its
/// streams go on, or a link that cannot do that suspends.
pub(crate) async fn run_lane<S>(
    h: Arc<LinkHandle>,
    stream: S,
    fd: Option<RawFd>,
    addr: SocketAddr,
    buf: BytesMut,
    c: Carrier,
    first: Option<BytesMut>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (rd, wr) = tokio::io::split(stream);
    h.set_fd(1 + c.slot, fd);
    let reader = read_link(h.clone(), rd, addr, LATENCY_LANE, buf, c.conn, Some(c));
    let writer = write_copy(&h, wr, c, first);
    tokio::pin!(reader, writer);
    let why = tokio::select! {
        r = &mut reader => r,
        w = &mut writer => w,
        why = ticker(&h, c.conn, LATENCY_LANE, Some(c)) => why,
    };
    let (end, lane_only, closed) = {
        let mut g = h.state();
        let closed = g.link.is_closed();
        let end = h.copy_ended(&mut g, &c);
        let mut lane_only = false;
        if matches!(end, CopyEnd::LaneLost) {
            lane_only = !g.link.is_closed() && g.link.lane_lost(Instant::now());
            if !lane_only && !g.link.is_closed() {
                g.link
                    .suspend(&format!("latency lane: {why}"), Instant::now());
            }
            h.dispatch(&mut g);
        }
        (end, lane_only, closed)
    };
    h.kick();
    let counters = &h.ctx.counters.link;
    match end {
        CopyEnd::Stale => {}
        CopyEnd::Others(left) => {
            counters.copies.set(left as i64);
            if closed {
                // The link closed (a shutdown, a newer link): its connections end with it.
                info!(link = h.id, peer = %h.ctx.peer, copy = c.slot + 1, "a latency lane connection closed with the link");
            } else if why == "peer closed the connection" {
                // The peer's policy wants fewer connections.
                info!(link = h.id, peer = %h.ctx.peer, copy = c.slot + 1, left, "the peer closed a latency lane connection; the others carry the lane");
            } else {
                add(&counters.copies_lost, 1);
                warn!(link = h.id, peer = %h.ctx.peer, copy = c.slot + 1, left, reason = %why, "a latency lane connection was lost; the others carry the lane");
            }
        }
        CopyEnd::LaneLost => {
            counters.copies.set(0);
            if lane_only {
                warn!(link = h.id, peer = %h.ctx.peer, reason = %why, "latency lane lost; its streams wait for a new one");
                counters.lanes.set(1);
                add(&counters.outages, 1);
                h.tell(LinkMsg::LaneLost(h.clone()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use wanopt_proto::{Class, ReadOutcome};

    use super::super::testing::{SERVICE, SOON, side};
    use super::*;

    fn addr() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 7400))
    }

    /// Two handles run their main lanes over an in-memory connection: both come up, a stream
    /// one opens reaches the other (which the supervisor hears of) byte for byte, and when the
    /// connection goes, a link that cannot resume tells its supervisor it is down and resets
    /// its streams.
    #[tokio::test]
    async fn two_links_come_up_carry_a_stream_and_go_down_together() {
        let no_lane = |c: &mut wanopt_proto::LinkConfig| c.latency_lane = false;
        let (mut west, mut east) = (side(true, &no_lane), side(false, &no_lane));
        let (a, b) = tokio::io::duplex(1 << 16);
        let wt = crate::spawn(run_link(west.h.clone(), a, addr(), BytesMut::new()));
        let et = crate::spawn(run_link(east.h.clone(), b, addr(), BytesMut::new()));
        assert!(matches!(west.next().await, LinkMsg::Up(..)));
        assert!(matches!(east.next().await, LinkMsg::Up(..)));

        let (id, wsig) = west.h.open(SERVICE, Class::Bulk).expect("open");
        let mut data = Bytes::from(vec![7u8; 300_000]);
        while !data.is_empty() {
            if west.h.write(id, &mut data, true).expect("write") == 0 {
                tokio::time::timeout(SOON, wsig.writable.notified())
                    .await
                    .expect("credit in time");
            }
        }
        let LinkMsg::Opened { stream, .. } = east.next().await else {
            panic!("the peer's open reaches the supervisor");
        };
        assert_eq!(stream, id);
        let esig = east.h.signal(id).expect("its wakeups");
        let mut got = 0;
        while got < 300_000 {
            match east.h.read(id).expect("read") {
                ReadOutcome::Data(b) => {
                    assert!(b.iter().all(|x| *x == 7));
                    got += b.len();
                }
                ReadOutcome::Blocked => tokio::time::timeout(SOON, esig.readable.notified())
                    .await
                    .expect("bytes in time"),
                ReadOutcome::Fin => panic!("early end"),
            }
        }
        assert_eq!(got, 300_000);

        // The connection goes: neither side can resume (no window), so both are down.
        wt.abort();
        let _ = wt.await;
        tokio::time::timeout(SOON, et)
            .await
            .expect("ends")
            .expect("ran");
        assert!(matches!(east.next().await, LinkMsg::Down(_)));
        assert!(
            esig.reset_reason().is_some() || !east.h.contains(id),
            "the stream ended with the link"
        );
    }
}
