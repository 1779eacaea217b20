//! A lane's writer: takes the frames the link chooses for its lane and writes them, in
//! batches of at most [`TRANSMIT_BATCH`]. The main lane's writer also runs the link's timers
//! (pings, idle timeout), tells the link the pressure it sees on the socket, and moves the zstd
//! level with the governor.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tracing::debug;
use wanopt_proto::MAIN_LANE;

use super::handle::{LinkHandle, TRANSMIT_BATCH, run_timers};
use crate::counters::add;
use crate::pressure::{Governor, Pressure};

/// Writes one lane's frames; the main lane also runs the link's timers (pings, idle timeout).
pub(super) async fn write_link<W: AsyncWrite + Unpin>(
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
            let mut g = h.state();
            if !h.current(conn, lane) {
                return "a newer connection took the link over".into();
            }
            if g.link.is_suspended() {
                return "the link's other lane was lost".into();
            }
            let t = Instant::now();
            g.link.poll_transmit_lane(t, lane, &mut buf, TRANSMIT_BATCH);
            let encoding = t.elapsed();
            h.dispatch(&mut g);
            let deadline = if lane == MAIN_LANE {
                let d = g.link.poll_timeout();
                // Set under the link's lock, as `kick` reads it, so no re-arm is missed.
                h.arm(d);
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
            return h
                .state()
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
            _ = h.writable(lane) => {}
            _ = &mut timer, if deadline.is_some() => {
                timer_at = None;
                let now = Instant::now();
                let heard = h.peer_data_at(now);
                h.with(|l| run_timers(l, heard, now));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncReadExt;
    use wanopt_proto::{CloseCode, Frame};

    use super::super::testing::{SOON, side};
    use super::*;

    /// The main lane's writer sends the link's hello first, and when the link closes it sends
    /// what the close queued, shuts the connection down and ends with the close's reason.
    #[tokio::test]
    async fn the_writer_sends_the_hello_first_and_ends_with_the_link() {
        let west = side(true, &|_| {});
        let (a, mut b) = tokio::io::duplex(1 << 16);
        let writer = crate::spawn(write_link(
            west.h.clone(),
            a,
            MAIN_LANE,
            (west.h.connection(), 0),
        ));
        let mut buf = BytesMut::new();
        let n = loop {
            if let Ok(n) = Frame::check(&buf, 1 << 20) {
                break n;
            }
            let r = tokio::time::timeout(SOON, b.read_buf(&mut buf))
                .await
                .expect("bytes in time")
                .expect("read");
            assert!(r > 0, "closed before the hello");
        };
        let first = Frame::parse(buf.split_to(n).freeze()).expect("a frame");
        assert!(matches!(first, Frame::Hello(_)), "{first:?}");

        west.h.with(|l| l.close(CloseCode::Normal, "bye"));
        west.h.kick();
        let why = tokio::time::timeout(SOON, writer)
            .await
            .expect("ends")
            .expect("ran");
        let mut rest = Vec::new();
        b.read_to_end(&mut rest)
            .await
            .expect("read to the shutdown");
        assert!(!rest.is_empty(), "the close was sent before the shutdown");
        assert_eq!(why, "closed");
    }
}
