//! The latency lane's datagrams in the link (see [`crate::datagrams`]): receiving them on a
//! socket and merging their pieces into the lane, sending a write's, and the connecting side's
//! hello that tells the listening side where to send.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::UdpSocket;
use tracing::debug;
use wanopt_proto::datagram::{DATAGRAM_MAX, DatagramError};

use super::handle::LinkHandle;
use super::state::Inner;
use crate::counters::add;
use crate::datagrams::HELLO_EVERY;

/// Merged lane bytes the link has not taken yet past which datagrams are dropped: only the TCP
/// copies are held back by a reader that stopped reading.
const INPUT_LIMIT: usize = 4 << 20;

/// Receives datagrams on `socket`, each from a source `admit` takes handed to the link `current`
/// gives (see [`LinkHandle::take_datagram`]). On the listening side `current` is the peer's
/// current link and the task runs with the daemon; a connecting side's task ends once its lane
/// no longer uses the socket.
pub(crate) async fn receive(
    socket: Arc<UdpSocket>,
    listening: bool,
    current: impl Fn() -> Option<Arc<LinkHandle>> + Send + 'static,
    admit: impl Fn(SocketAddr) -> bool + Send + 'static,
) {
    let mut buf = vec![0u8; DATAGRAM_MAX + 1];
    loop {
        let got = tokio::time::timeout(HELLO_EVERY, socket.recv_from(&mut buf)).await;
        let h = current();
        if !listening && !h.as_ref().is_some_and(|h| h.lane_uses(&socket)) {
            return;
        }
        let (n, from) = match got {
            Err(_) => continue,
            Ok(Err(e)) => {
                debug!(error = %e, "latency lane datagram socket");
                continue;
            }
            Ok(Ok(x)) => x,
        };
        if let Some(h) = h.filter(|_| admit(from)) {
            h.take_datagram(&mut buf[..n], from, listening, &socket);
        }
    }
}

impl LinkHandle {
    /// True while the latency lane sends and takes datagrams on `socket`.
    pub(crate) fn lane_uses(&self, socket: &Arc<UdpSocket>) -> bool {
        self.state()
            .lane
            .datagrams
            .as_ref()
            .is_some_and(|d| d.uses(socket))
    }

    /// Hands a datagram to the lane: opened under its keys, its piece merged, and a lane reader
    /// woken to hand what is new to the link. One that does not open is counted and dropped.
    fn take_datagram(
        &self,
        datagram: &mut [u8],
        from: SocketAddr,
        learn: bool,
        socket: &Arc<UdpSocket>,
    ) {
        let counters = &self.ctx.counters.link;
        let new = {
            let mut g = self.state();
            let lane = &mut g.lane;
            match lane.datagrams.as_mut().filter(|d| d.uses(socket)) {
                None => None,
                Some(d) => match d.open(datagram, from, learn) {
                    Err(DatagramError::Duplicate) => {
                        add(&counters.datagrams_late, 1);
                        Some(0)
                    }
                    Err(_) => None,
                    Ok((offset, piece)) => {
                        add(&counters.datagrams_received, 1);
                        if lane.input.len() > INPUT_LIMIT {
                            Some(0)
                        } else {
                            let won = lane.merge.won_by_pieces();
                            let n = lane.merge.piece(offset, piece, &mut lane.input);
                            let won = lane.merge.won_by_pieces() - won;
                            if won > 0 {
                                counters.copy_won(wanopt_proto::copies::MAX_COPIES, won);
                            }
                            Some(n)
                        }
                    }
                },
            }
        };
        match new {
            None => add(&counters.datagrams_refused, 1),
            Some(n) if n > 0 => self.lane_input.notify_one(),
            Some(_) => {}
        }
    }

    /// Sends lane bytes just pushed at `offset` as datagrams too, if the lane sends them now.
    pub(super) fn send_datagrams(&self, g: &mut Inner, offset: u64, bytes: &[u8]) {
        let count = g.lane.count();
        let Some(d) = g.lane.datagrams.as_mut() else {
            return;
        };
        if !self.ctx.datagrams.sends(count) {
            return;
        }
        let wire = d.send(offset, bytes, self.datagram_spacing());
        add(&self.ctx.counters.link.datagram_bytes, wire);
    }

    /// The time a write's datagram sends are spaced by: the copies' spacing, or where copies
    /// leave back to back the default one (a datagram waits behind nothing, so spacing them
    /// delays no write).
    fn datagram_spacing(&self) -> Duration {
        if self.ctx.copy_spacing.is_zero() {
            crate::config::defaults::COPY_SPACING
        } else {
            self.ctx.copy_spacing
        }
    }

    /// The connecting side: an empty datagram if the lane sent none for a while, so the
    /// listening side knows where to send (called every second by the copies' keeper).
    pub(crate) fn datagram_hello(&self) {
        let mut g = self.state();
        let count = g.lane.count();
        let end = g.lane.fanout.end();
        if let Some(d) = g.lane.datagrams.as_mut()
            && self.ctx.datagrams.sends(count)
            && d.quiet(Instant::now())
        {
            let wire = d.send(end, &[], Duration::ZERO);
            add(&self.ctx.counters.link.datagram_bytes, wire);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio::net::UdpSocket;

    use super::super::testing::{SOON, settle_handles, side};
    use super::*;
    use crate::datagrams::LaneDatagrams;

    async fn until(f: impl Fn() -> bool) {
        tokio::time::timeout(SOON, async {
            while !f() {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("in time");
    }

    /// On loopback: what the connecting side's lane sends as datagrams lands in the listening
    /// side's lane input, which learns from it where to send its own back; a datagram sealed
    /// under other keys is refused and changes nothing.
    #[tokio::test]
    async fn datagrams_reach_the_peers_lane_and_strangers_do_not() {
        let cfg = |c: &mut wanopt_proto::LinkConfig| {
            c.lane_copies = 3;
            c.lane_datagrams = true;
        };
        let (west, east) = (side(true, &cfg), side(false, &cfg));
        settle_handles(&west.h, &east.h);
        let token = west.h.with(|l| l.lane_offer()).expect("a lane offered");
        let keys = [3u8; 64];
        let bind = || async { Arc::new(UdpSocket::bind("127.0.0.1:0").await.expect("bind")) };
        let (ws, es) = (bind().await, bind().await);
        let to = es.local_addr().expect("addr");
        let wd = LaneDatagrams::new(&keys, 7, true, ws.clone(), Some(to));
        let ed = LaneDatagrams::new(&keys, 7, false, es.clone(), None);
        assert!(west.h.attach_lane(token, Some(7), Some(wd)).is_some());
        assert!(east.h.attach_lane(token, Some(7), Some(ed)).is_some());
        assert!(west.h.lane_uses(&ws) && east.h.lane_uses(&es));
        for (s, h, listening) in [(&es, &east.h, true), (&ws, &west.h, false)] {
            let h = h.clone();
            crate::spawn(receive(
                s.clone(),
                listening,
                move || Some(h.clone()),
                |_| true,
            ));
        }

        let sent = b"a latency lane write".repeat(200);
        west.h.send_datagrams(&mut west.h.state(), 0, &sent);
        until(|| east.h.state().lane.input.len() == sent.len()).await;
        assert_eq!(&east.h.state().lane.input[..], &sent[..]);
        assert_eq!(east.h.state().lane.merge.won_by_pieces(), sent.len() as u64);
        let received = east.h.ctx.counters.link.datagrams_received.get();
        assert_eq!(
            received,
            sent.len().div_ceil(wanopt_proto::datagram::PIECE_MAX) as u64
        );

        // East learned where west is and answers the same way.
        east.h.send_datagrams(&mut east.h.state(), 0, b"ack");
        until(|| west.h.state().lane.input.len() == 3).await;

        let stranger = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
        let mut forged = wanopt_proto::datagram::Sealer::new(&[4u8; 32], 7);
        // Counters the lane has not seen yet (an old one is dropped as seen before it is opened).
        let _ = forged.seal(0, &[0; 8 * wanopt_proto::datagram::PIECE_MAX]);
        for d in forged.seal(sent.len() as u64, b"injected") {
            stranger.send_to(&d, to).await.expect("send");
        }
        until(|| east.h.ctx.counters.link.datagrams_refused.get() == 1).await;
        assert_eq!(east.h.state().lane.input.len(), sent.len());
    }
}
