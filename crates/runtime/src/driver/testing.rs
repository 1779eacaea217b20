//! Test support for the driver's parts: link handles as the two daemons would have them (west
//! dials, east listens), each with its supervisor's channel, and an in-memory wire that moves
//! what one link sends to the other without sockets.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::sync::mpsc;
use wanopt_proto::{LANES, Link, LinkConfig};

use super::handle::{LinkCtx, LinkHandle, LinkMsg};
use crate::counters::Counters;

/// How long a test waits for what must happen at once.
pub(super) const SOON: Duration = Duration::from_secs(10);

/// The service both test sides serve.
pub(super) const SERVICE: &str = "svc";

/// One side: its handle and what it tells its supervisor.
pub(super) struct Side {
    pub h: Arc<LinkHandle>,
    pub rx: mpsc::UnboundedReceiver<LinkMsg>,
}

impl Side {
    /// The next message to the supervisor, waiting at most [`SOON`].
    pub async fn next(&mut self) -> LinkMsg {
        tokio::time::timeout(SOON, self.rx.recv())
            .await
            .expect("a message to the supervisor in time")
            .expect("the link's sender is alive")
    }
}

/// The link config of a test side: [`SERVICE`] served, `tweak` applied last.
pub(super) fn config(west: bool, tweak: &dyn Fn(&mut LinkConfig)) -> LinkConfig {
    let (site, peer) = if west {
        ("west", "east")
    } else {
        ("east", "west")
    };
    let mut c = LinkConfig::new(site, peer, west);
    c.token = if west { 11 } else { 22 };
    tweak(&mut c);
    c
}

/// A link of a test side, serving [`SERVICE`].
pub(super) fn link(west: bool, tweak: &dyn Fn(&mut LinkConfig)) -> Link {
    let mut l = Link::new(config(west, tweak));
    l.set_services([SERVICE]);
    l
}

/// A handle of a test side on no socket.
pub(super) fn side(west: bool, tweak: &dyn Fn(&mut LinkConfig)) -> Side {
    let (tx, rx) = mpsc::unbounded_channel();
    let ctx = LinkCtx {
        counters: Arc::new(Counters::new()),
        caches: None,
        supervisor: tx,
        peer: if west { "east" } else { "west" }.into(),
        handshake_timeout: SOON,
        link_bound: false,
        stated_bps: None,
        zstd: (3, None),
        copy_spacing: Duration::ZERO,
        room: None,
        datagrams: crate::datagrams::Setting::On,
    };
    Side {
        h: Arc::new(LinkHandle::new(link(west, tweak), None, ctx, 1)),
        rx,
    }
}

/// Moves what `from` has to send, every lane, into `to`; returns the bytes moved.
pub(super) fn carry(from: &mut Link, to: &mut Link) -> usize {
    let mut moved = 0;
    for lane in 0..LANES {
        let mut buf = BytesMut::new();
        from.poll_transmit_lane(std::time::Instant::now(), lane, &mut buf, 1 << 20);
        moved += buf.len();
        if !buf.is_empty() {
            to.handle_lane_input(lane, &mut buf, Instant::now())
                .expect("the peer accepts what the link sent");
        }
    }
    moved
}

/// Carries both ways until neither link has anything to send.
pub(super) fn settle(a: &mut Link, b: &mut Link) {
    for _ in 0..100 {
        if carry(a, b) + carry(b, a) == 0 {
            return;
        }
    }
    panic!("the links never went quiet");
}

/// Carries both ways between two handles' links until quiet, routing each side's events.
pub(super) fn settle_handles(a: &LinkHandle, b: &LinkHandle) {
    for _ in 0..100 {
        let moved = {
            let (mut ga, mut gb) = (a.state(), b.state());
            let n = carry(&mut ga.link, &mut gb.link) + carry(&mut gb.link, &mut ga.link);
            a.dispatch(&mut ga);
            b.dispatch(&mut gb);
            n
        };
        if moved == 0 {
            return;
        }
    }
    panic!("the links never went quiet");
}
