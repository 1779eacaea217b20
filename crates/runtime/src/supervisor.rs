//! The per-peer supervisor: the one place that decides about links. It hears from the link
//! tasks ([`LinkMsg`]) and publishes the current link: the newest link that came up wins and the
//! older one is closed as replaced (a resumed link coming up again stays); the connecting side
//! then opens the latency lane. A suspended link stays current while its streams wait. A stream the
//! peer opened is connected to our target for its service, looked up once, here.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::sync::mpsc;
use tracing::info;
use wanopt_proto::{CloseCode, ResetCode};

use crate::config::LinkRole;
use crate::counters::add;
use crate::driver::{LinkHandle, LinkMsg};
use crate::peer::Peer;
use crate::{dial, services};

/// Runs until every link task and the daemon dropped their senders.
pub(crate) async fn run(peer: Arc<Peer>, mut rx: mpsc::UnboundedReceiver<LinkMsg>) {
    while let Some(m) = rx.recv().await {
        match m {
            LinkMsg::Up(h, addr) => up(&peer, h, addr),
            LinkMsg::Opened {
                link,
                stream,
                service,
            } => match peer.target(&service) {
                Some((target, idle)) => {
                    let counters = peer.counters.service(&service);
                    let timeout = peer.cfg().limits.connect_timeout;
                    crate::spawn(services::serve_incoming(
                        peer.clone(),
                        link,
                        stream,
                        service,
                        (target, timeout),
                        counters,
                        idle,
                    ));
                }
                None => {
                    // The service was removed by a reload after the link accepted the open.
                    link.reset(stream, ResetCode::UnknownService, "service removed");
                    link.forget(stream);
                }
            },
            LinkMsg::Suspended(h) => suspended(&peer, &h),
            LinkMsg::LaneLost(h) => open_lane(&peer, &h),
            LinkMsg::Down(h) => down(&peer, &h),
        }
    }
}

fn up(peer: &Arc<Peer>, h: Arc<LinkHandle>, addr: SocketAddr) {
    let cfg = peer.cfg();
    add(&peer.counters.link.connects, 1);
    peer.counters.link.up.set(1);
    peer.counters.link.lanes.set(1);
    crate::notify::status(&format!("link up to {} ({addr})", cfg.link.peer));
    info!(link = h.id, peer = %cfg.link.peer, addr = %addr, "link up");
    if let Some(old) = peer.current.send_replace(Some(h.clone()))
        && !Arc::ptr_eq(&old, &h)
    {
        info!(
            link = old.id,
            "closing the older link: a newer one replaced it"
        );
        old.with(|l| l.close(CloseCode::Replaced, "a newer link replaced this one"));
        old.kick();
    }
    open_lane(peer, &h);
    if matches!(cfg.link.role, LinkRole::Connect(_)) {
        // Ended with the connection (as the lane's tasks are); a resumed link comes up again.
        let task = crate::spawn(dial::keep_copies(peer.clone(), h.clone()));
        h.keep_task(task);
    }
}

/// The connecting side opens the link's latency lane, if the link wants one.
fn open_lane(peer: &Arc<Peer>, h: &Arc<LinkHandle>) {
    let cfg = peer.cfg();
    if let (Some(token), LinkRole::Connect(target)) = (h.with(|l| l.lane_offer()), &cfg.link.role) {
        let task = crate::spawn(dial::open_lane(
            peer.clone(),
            h.clone(),
            token,
            target.clone(),
        ));
        h.keep_task(task);
    }
}

/// The link's connection was lost; it stays the current link while its streams wait.
fn suspended(peer: &Peer, h: &Arc<LinkHandle>) {
    if peer
        .current
        .borrow()
        .as_ref()
        .is_some_and(|c| Arc::ptr_eq(c, h))
    {
        peer.counters.link.up.set(0);
        peer.counters.link.lanes.set(0);
        crate::notify::status(&format!(
            "link to {} lost; its streams wait up to {}s for it to come back",
            peer.cfg().link.peer,
            h.with(|l| l.resume_window()).as_secs()
        ));
    }
}

fn down(peer: &Peer, h: &Arc<LinkHandle>) {
    peer.current.send_if_modified(|c| {
        if c.as_ref().is_some_and(|x| Arc::ptr_eq(x, h)) {
            *c = None;
            peer.counters.link.up.set(0);
            peer.counters.link.lanes.set(0);
            crate::notify::status(&format!(
                "link to {} down; reconnecting",
                peer.cfg().link.peer
            ));
            true
        } else {
            false
        }
    });
}
