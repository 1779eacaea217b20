//! A lane's reader: reads the lane's connection into the link (through the merge of the
//! latency lane's copies where it has them), tells the supervisor what needs a decision (the
//! link came up, the peer opened a stream), loads the saved cache states a resumed link asks
//! for, and stops reading while the link says so (states loading, replies backed up) until the
//! link wakes it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt};
use tracing::{info, warn};
use wanopt_proto::{CloseCode, LinkError, MAIN_LANE, StateRequest};

use super::carriers::Carrier;
use super::handle::{LinkHandle, LinkMsg};
use super::lane_copies::copy_input;
use crate::cachedir::CacheDir;
use crate::counters::add;
use crate::wire::READ_CHUNK;

/// Reads one lane of a link into its state machine. `buf` may already hold the first bytes.
pub(super) async fn read_link<R: AsyncRead + Unpin>(
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
            let read = if copy.is_some() {
                // A latency-lane copy also wakes for bytes the lane's datagrams merged
                // (`read_buf` is cancel safe: nothing is read when the other branch wins).
                tokio::select! {
                    r = rd.read_buf(&mut buf) => Some(r),
                    () = h.lane_input.notified() => None,
                }
            } else if announced {
                Some(rd.read_buf(&mut buf).await)
            } else {
                match tokio::time::timeout_at(handshake_deadline, rd.read_buf(&mut buf)).await {
                    Ok(r) => Some(r),
                    Err(_) => return "no hello from the peer in time".into(),
                }
            };
            match read {
                None => {}
                Some(Ok(0)) => return "peer closed the connection".into(),
                Some(Ok(n)) => {
                    add(&counters.link.wire_in, n as u64);
                    if copy.is_none() && announced {
                        let more = read_ready(&mut rd, &mut buf).await;
                        add(&counters.link.wire_in, more);
                    }
                }
                Some(Err(e)) => return format!("read: {e}"),
            }
        }
        let (opened, up, closed, err, wants, load, loading) = {
            let mut g = h.state();
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
                    match copy_input(&h, &mut g, c, &mut buf, Instant::now()) {
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
            return h
                .state()
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
            h.wait_until(|l| !l.is_loading() || l.is_closed()).await;
            pending = true;
        } else if h.with(|l| l.replies_backed_up()) {
            // The peer does not read what it makes us answer: read no more until the writer
            // has sent it (the peer's own writes then wait in TCP).
            counters.link.input_paused.inc();
            h.wait_until(|l| !l.replies_backed_up() || l.is_closed())
                .await;
            pending = true;
        }
    }
}

/// Most bytes [`read_ready`] gathers for one pass of the link.
const READ_BATCH: usize = 512 * 1024;

/// The bytes that already arrived behind a read, read without waiting, up to [`READ_BATCH`]
/// in `buf`; returns how many. TLS hands them over a record (16 KiB) at a time, so a link
/// behind on its input would otherwise take one frame per pass, where it decodes several
/// streams' frames side by side (the link's frames fed ahead) only within one pass. An end or
/// an error is left to the next read, which sees it again.
async fn read_ready<R: AsyncRead + Unpin>(rd: &mut R, buf: &mut BytesMut) -> u64 {
    let mut got = 0;
    while buf.len() < READ_BATCH {
        buf.reserve(READ_CHUNK);
        let read = tokio::select! {
            biased;
            r = rd.read_buf(buf) => r,
            () = std::future::ready(()) => break,
        };
        match read {
            Ok(n) if n > 0 => got += n as u64,
            _ => break,
        }
    }
    got
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

#[cfg(test)]
mod tests {
    use tokio::io::AsyncWriteExt;

    use super::super::testing::{SOON, link, side};
    use super::*;

    /// What already arrived behind a read is read in the same pass, up to about `READ_BATCH`,
    /// and nothing more is waited for.
    #[tokio::test]
    async fn bytes_already_here_are_read_in_one_pass_without_waiting() {
        let (mut a, mut b) = tokio::io::duplex(4 << 20);
        let mut buf = BytesMut::new();
        assert_eq!(
            read_ready(&mut b, &mut buf).await,
            0,
            "nothing here: no wait"
        );
        a.write_all(&vec![7u8; 300 << 10]).await.expect("write");
        let first = b.read_buf(&mut buf).await.expect("read");
        let more = read_ready(&mut b, &mut buf).await;
        assert_eq!((first as u64 + more, buf.len()), (300 << 10, 300 << 10));
        a.write_all(&vec![7u8; 2 << 20]).await.expect("write");
        buf.clear();
        read_ready(&mut b, &mut buf).await;
        assert!((READ_BATCH..READ_BATCH + 2 * READ_CHUNK).contains(&buf.len()));
        drop(a);
        buf.clear();
        let rest = tokio::time::timeout(SOON, read_ready(&mut b, &mut buf)).await;
        assert!(
            rest.is_ok_and(|n| n > 0),
            "the rest, then the end left for the next read"
        );
    }

    /// The reader hands the peer's hello to the link and tells the supervisor the link is up;
    /// when the peer closes the connection it ends, saying so.
    #[tokio::test]
    async fn the_reader_announces_the_link_then_ends_with_the_connection() {
        let mut east = side(false, &|_| {});
        let mut west = link(true, &|_| {});
        let mut hello = BytesMut::new();
        west.poll_transmit(std::time::Instant::now(), &mut hello, 1 << 20);
        assert!(!hello.is_empty(), "the link starts with its hello");
        let (mut a, b) = tokio::io::duplex(1 << 16);
        let addr = SocketAddr::from(([127, 0, 0, 1], 1));
        let reader = crate::spawn(read_link(
            east.h.clone(),
            b,
            addr,
            MAIN_LANE,
            BytesMut::new(),
            (east.h.connection(), 0),
            None,
        ));
        a.write_all(&hello).await.expect("write");
        assert!(matches!(east.next().await, LinkMsg::Up(_, x) if x == addr));
        drop(a);
        let why = tokio::time::timeout(SOON, reader)
            .await
            .expect("ends")
            .expect("ran");
        assert_eq!(why, "peer closed the connection");
    }

    /// Bytes that are not a link's frames end the reader with the link's error.
    #[tokio::test]
    async fn garbage_ends_the_reader_with_the_links_error() {
        let east = side(false, &|_| {});
        let (mut a, b) = tokio::io::duplex(1 << 16);
        let reader = crate::spawn(read_link(
            east.h.clone(),
            b,
            SocketAddr::from(([127, 0, 0, 1], 1)),
            MAIN_LANE,
            BytesMut::new(),
            (east.h.connection(), 0),
            None,
        ));
        a.write_all(&[0xff; 64]).await.expect("write");
        let why = tokio::time::timeout(SOON, reader)
            .await
            .expect("ends")
            .expect("ran");
        assert!(east.h.with(|l| l.is_closed()), "{why}");
        assert_ne!(why, "peer closed the connection");
    }
}
