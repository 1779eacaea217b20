//! The connections carrying a link's latency lane: each carries a copy of the lane's bytes
//! ([`Fanout`] on the way out, [`Merge`] on the way in), so a segment one connection lost costs
//! nothing while another brings it. Losing a copy leaves the others carrying the lane; losing the
//! last (or one that alone held what the others skip) loses the lane, which resumes as before.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tracing::{info, warn};
use wanopt_proto::LATENCY_LANE;
use wanopt_proto::copies::{COPY_LAG_LIMIT, Fanout, MAX_COPIES, Merge};

use super::{Inner, LinkHandle, LinkMsg, TRANSMIT_BATCH, lock, read_link, ticker};
use crate::counters::add;

/// One connection's place among the lane's copies: the link and lane connections it belongs to,
/// its slot and the generation that slot had when it was attached.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Carrier {
    pub conn: (u64, u64),
    pub slot: usize,
    pub generation: u64,
}

/// The copies of the current latency lane.
#[derive(Debug)]
pub(crate) struct LaneCopies {
    /// The lane's id (`setting::COPY_OF`): a copy must name it. `None`: a peer that names none
    /// takes no copies.
    pub id: Option<u64>,
    pub fanout: Fanout,
    pub merge: Merge,
    /// Merged bytes the link has not taken yet (a partial frame, or input while it loads).
    pub input: BytesMut,
    /// Each slot's connection generation (0: no connection).
    generations: [u64; MAX_COPIES],
    /// Where each slot's outgoing bytes start (the newest copy starts furthest on).
    starts: [u64; MAX_COPIES],
    /// Lane bytes sent and received since the link started, for the redundancy policy.
    pub sent: u64,
    pub received: u64,
}

impl LaneCopies {
    pub fn new() -> Self {
        LaneCopies {
            id: None,
            fanout: Fanout::new(COPY_LAG_LIMIT),
            merge: Merge::new(COPY_LAG_LIMIT),
            input: BytesMut::new(),
            generations: [0; MAX_COPIES],
            starts: [0; MAX_COPIES],
            sent: 0,
            received: 0,
        }
    }

    /// Connections carrying the lane now.
    pub fn count(&self) -> usize {
        self.generations.iter().filter(|g| **g != 0).count()
    }

    fn carries(&self, c: &Carrier) -> bool {
        self.generations.get(c.slot) == Some(&c.generation)
    }

    /// Forgets slot `slot`'s connection at both ends of the lane.
    fn release(&mut self, slot: usize) {
        self.generations[slot] = 0;
        self.fanout.detach(slot);
        self.merge.detach(slot);
    }

    /// A new lane (all copies of the old one are stale): its first connection in slot 0.
    fn restart(&mut self, id: Option<u64>, generation: u64) {
        let (sent, received) = (self.sent, self.received);
        *self = LaneCopies::new();
        self.id = id;
        self.sent = sent;
        self.received = received;
        let _ = self.fanout.attach_at(0);
        let _ = self.merge.attach(0, 0);
        self.generations[0] = generation;
    }
}

/// How a copy's end leaves the lane.
enum CopyEnd {
    /// A newer connection or lane took over: nothing to do.
    Stale,
    /// The other copies carry the lane on; this many.
    Others(usize),
    /// No copy left brings what follows the delivered bytes: the lane is lost.
    LaneLost,
}

impl LinkHandle {
    fn next_generation(&self) -> u64 {
        self.generations.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// True while `c` still carries the lane.
    pub(super) fn carries(&self, g: &Inner, c: &Carrier) -> bool {
        self.current(c.conn, LATENCY_LANE) && g.lane.carries(c)
    }

    /// Attaches a new latency lane whose first connection presented `token` (see
    /// [`Link::attach_lane`](wanopt_proto::Link::attach_lane)) and named the lane `id`; the
    /// connection's place, or `None` if refused.
    pub fn attach_lane(&self, token: u64, id: Option<u64>) -> Option<Carrier> {
        let mut g = lock(&self.inner);
        if !g.link.attach_lane(token) {
            return None;
        }
        self.lane_conn.fetch_add(1, Ordering::AcqRel);
        let generation = self.next_generation();
        g.lane.restart(id, generation);
        self.ctx.counters.link.copies.set(1);
        // The old lane's writers, if any, wake and see they are stale.
        self.wake_copies();
        self.dispatch(&mut g);
        Some(Carrier {
            conn: (self.connection(), self.lane_connection()),
            slot: 0,
            generation,
        })
    }

    /// Wakes every copy's writer.
    pub(super) fn wake_copies(&self) {
        for t in &self.copy_tx {
            t.notify_one();
        }
    }

    /// The connecting side: a place for one more copy of the lane, if the lane has room for it.
    /// Returns it with the lane's id and where our bytes on it start; the copy carries what the
    /// lane sends from now on, and its incoming bytes wait for [`copy_answered`].
    ///
    /// [`copy_answered`]: Self::copy_answered
    pub fn add_copy(&self) -> Option<(Carrier, u64, u64)> {
        let mut g = lock(&self.inner);
        let id = g.lane.id?;
        if !g.link.lane_attached() || g.lane.count() >= g.link.lane_copies() {
            return None;
        }
        let (slot, start) = g.lane.fanout.attach()?;
        let generation = self.next_generation();
        g.lane.generations[slot] = generation;
        g.lane.starts[slot] = start;
        Some((
            Carrier {
                conn: (self.connection(), self.lane_connection()),
                slot,
                generation,
            },
            id,
            start,
        ))
    }

    /// The peer answered our copy: its bytes on it start at `at` of its lane.
    pub fn copy_answered(&self, c: &Carrier, at: u64) -> Result<(), String> {
        let mut g = lock(&self.inner);
        if !self.carries(&g, c) {
            return Err("the lane changed meanwhile".into());
        }
        let r = g.lane.merge.attach(c.slot, at).map_err(|e| e.to_string());
        if r.is_err() {
            g.lane.release(c.slot);
        } else {
            self.ctx.counters.link.copies.set(g.lane.count() as i64);
        }
        r
    }

    /// The listening side: a connection presenting `token` wants to carry a copy of lane `id`,
    /// its bytes starting at `at`. Returns its place and where our bytes on it start (sent back
    /// in [`Link::copy_answer`](wanopt_proto::Link::copy_answer)), or why not.
    pub fn accept_copy(&self, token: u64, id: u64, at: u64) -> Result<(Carrier, u64), String> {
        let mut g = lock(&self.inner);
        if !g.link.lane_attached() || !g.link.lane_token_valid(token) || g.lane.id != Some(id) {
            return Err("no latency lane with its id".into());
        }
        let allowed = g.link.lane_copies();
        if g.lane.count() >= allowed {
            return Err(format!("the lane has its {allowed} connections"));
        }
        let Some(slot) = g.lane.generations.iter().position(|x| *x == 0) else {
            return Err("no free slot".into());
        };
        g.lane.merge.attach(slot, at).map_err(|e| e.to_string())?;
        let Some((_, start)) = g.lane.fanout.attach_at(slot) else {
            g.lane.merge.detach(slot);
            return Err("no free slot".into());
        };
        let generation = self.next_generation();
        g.lane.generations[slot] = generation;
        g.lane.starts[slot] = start;
        self.ctx.counters.link.copies.set(g.lane.count() as i64);
        Ok((
            Carrier {
                conn: (self.connection(), self.lane_connection()),
                slot,
                generation,
            },
            start,
        ))
    }

    /// Gives up a copy that did not come up (its dial failed after it had a place).
    pub fn drop_copy(&self, c: &Carrier) {
        let mut g = lock(&self.inner);
        if self.carries(&g, c) {
            g.lane.release(c.slot);
        }
    }

    /// Drops the newest copies until `keep` connections carry the lane (the redundancy policy
    /// wants fewer). The newest started furthest on, so the older ones carry everything it
    /// did: dropping it never leaves the peer a gap.
    pub fn drop_copies(&self, keep: usize) -> usize {
        let mut g = lock(&self.inner);
        let mut dropped = 0;
        while g.lane.count() > keep.max(1) {
            let Some(slot) = (0..MAX_COPIES)
                .filter(|s| g.lane.generations[*s] != 0)
                .max_by_key(|s| g.lane.starts[*s])
            else {
                break;
            };
            g.lane.release(slot);
            lock(&self.fds)[1 + slot] = None;
            dropped += 1;
        }
        self.ctx.counters.link.copies.set(g.lane.count() as i64);
        drop(g);
        self.wake_copies();
        dropped
    }

    /// What the redundancy policy looks at: (connections now, connections the lane may have,
    /// lane bytes sent, received), or `None` while no lane is attached.
    pub fn lane_state(&self) -> Option<(usize, usize, u64, u64)> {
        let g = lock(&self.inner);
        (g.link.lane_attached() && !g.link.is_suspended() && !g.link.is_closed()).then(|| {
            (
                g.lane.count(),
                if g.lane.id.is_some() {
                    g.link.lane_copies()
                } else {
                    1
                },
                g.lane.sent,
                g.lane.received,
            )
        })
    }

    /// Data segments the lane's connections retransmitted and sent in all (`TCP_INFO`), for the
    /// redundancy policy's view of the lane's loss.
    pub fn lane_segments(&self) -> (u64, u64) {
        let fds = lock(&self.fds);
        fds[1..]
            .iter()
            .flatten()
            .filter_map(|fd| crate::sockopt::tcp_info(*fd))
            .fold((0, 0), |(r, s), t| {
                (
                    r + t.retransmitted_segments.max(0) as u64,
                    s + t.data_segments_sent.max(0) as u64,
                )
            })
    }

    /// A copy's connection ended.
    fn copy_ended(&self, g: &mut Inner, c: &Carrier) -> CopyEnd {
        if !self.carries(g, c) {
            return CopyEnd::Stale;
        }
        g.lane.release(c.slot);
        lock(&self.fds)[1 + c.slot] = None;
        let left = g.lane.count();
        if left > 0 && g.lane.merge.complete() {
            return CopyEnd::Others(left);
        }
        for slot in 0..MAX_COPIES {
            if g.lane.generations[slot] != 0 {
                g.lane.release(slot);
                lock(&self.fds)[1 + slot] = None;
            }
        }
        CopyEnd::LaneLost
    }
}

/// Runs one connection of the latency lane until it ends: its reader (through the merge), its
/// writer (through the fanout) and its ticker. `first` is written before any lane byte (the
/// listener's answer to a copy). When it ends, the other copies carry on; when none can, the
/// lane is lost: it re-attaches (the supervisor dials it on the connecting side) and its
/// streams go on, or a link that cannot do that suspends.
pub(crate) async fn run_lane<S>(
    h: std::sync::Arc<LinkHandle>,
    stream: S,
    fd: std::os::fd::RawFd,
    addr: SocketAddr,
    buf: BytesMut,
    c: Carrier,
    first: Option<BytesMut>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (rd, wr) = tokio::io::split(stream);
    lock(&h.fds)[1 + c.slot] = Some(fd);
    let reader = read_link(h.clone(), rd, addr, LATENCY_LANE, buf, c.conn, Some(c));
    let writer = write_copy(&h, wr, c, first);
    tokio::pin!(reader, writer);
    let why = tokio::select! {
        r = &mut reader => r,
        w = &mut writer => w,
        why = ticker(&h, c.conn, LATENCY_LANE, Some(c)) => why,
    };
    let (end, lane_only) = {
        let mut g = lock(&h.inner);
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
        (end, lane_only)
    };
    h.kick();
    let counters = &h.ctx.counters.link;
    match end {
        CopyEnd::Stale => {}
        CopyEnd::Others(left) => {
            counters.copies.set(left as i64);
            if why == "peer closed the connection" {
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

/// Writes copy `c`'s bytes: what the fanout holds for it, taking the link's next lane bytes
/// when it has written all it had (and waking the other copies, which write them too).
async fn write_copy<W: AsyncWrite + Unpin>(
    h: &LinkHandle,
    mut wr: W,
    c: Carrier,
    first: Option<BytesMut>,
) -> String {
    if let Some(f) = first
        && let Err(e) = wr.write_all(&f).await
    {
        return format!("write: {e}");
    }
    let counters = &h.ctx.counters.link;
    let mut buf = BytesMut::with_capacity(2 * TRANSMIT_BATCH);
    loop {
        let (next, closed, dropped): (Option<Bytes>, bool, bool) = {
            let mut g = lock(&h.inner);
            if !h.carries(&g, &c) {
                (None, false, true)
            } else {
                if g.link.is_suspended() {
                    return "the link's other lane was lost".into();
                }
                if g.lane.fanout.next(c.slot).is_none() {
                    g.link
                        .poll_transmit_lane(LATENCY_LANE, &mut buf, TRANSMIT_BATCH);
                    h.dispatch(&mut g);
                    if !buf.is_empty() {
                        let n = buf.len() as u64;
                        g.lane.sent += n;
                        add(&counters.wire_out, n);
                        for slot in g.lane.fanout.push(buf.split().freeze()) {
                            g.lane.release(slot);
                            lock(&h.fds)[1 + slot] = None;
                            counters.copies.set(g.lane.count() as i64);
                            add(&counters.copies_lost, 1);
                            warn!(
                                link = h.id,
                                copy = slot + 1,
                                "a latency lane connection fell too far behind the others; dropped"
                            );
                        }
                        // The other copies write these bytes too.
                        h.wake_copies();
                    }
                }
                (g.lane.fanout.next(c.slot), g.link.is_closed(), false)
            }
        };
        if dropped {
            // Given up (the policy wants fewer, or a newer lane took over): a clean close, so
            // the peer sees the end and not an error.
            let _ = wr.shutdown().await;
            return "a newer connection took the lane over".into();
        }
        if next.is_none() && closed {
            let _ = wr.shutdown().await;
            return "closed".into();
        }
        let Some(chunk) = next else {
            h.copy_tx[c.slot].notified().await;
            continue;
        };
        let chunk = chunk.slice(..chunk.len().min(TRANSMIT_BATCH));
        if let Err(e) = wr.write_all(&chunk).await {
            return format!("write: {e}");
        }
        if let Err(e) = wr.flush().await {
            return format!("write: {e}");
        }
        let mut g = lock(&h.inner);
        if !h.carries(&g, &c) {
            return "a newer connection took the lane over".into();
        }
        let before = g.lane.fanout.duplicated();
        g.lane.fanout.wrote(c.slot, chunk.len());
        add(
            &counters.copy_duplicated,
            g.lane.fanout.duplicated() - before,
        );
    }
}

/// Hands the bytes copy `c` read to the merge, and what is new to the link. Returns the link's
/// verdict, or why the copy must end.
pub(super) fn copy_input(
    h: &LinkHandle,
    g: &mut Inner,
    c: &Carrier,
    buf: &mut BytesMut,
    now: Instant,
) -> Result<Result<(), wanopt_proto::LinkError>, String> {
    let Inner { link, lane, .. } = g;
    let (won, late) = (lane.merge.won()[c.slot], lane.merge.discarded());
    let new = lane
        .merge
        .input(c.slot, buf, &mut lane.input)
        .map_err(|e| e.to_string())?;
    buf.clear();
    lane.received += new as u64;
    let counters = &h.ctx.counters.link;
    let won = lane.merge.won()[c.slot] - won;
    if won > 0 {
        counters.copy_won(c.slot, won);
    }
    add(&counters.copy_late, lane.merge.discarded() - late);
    Ok(link.handle_lane_input(LATENCY_LANE, &mut lane.input, now))
}

/// The connecting side keeps as many copies as the redundancy policy wants: it dials one more
/// when the lane has fewer (one at a time) and drops the newest when it has more. Ends with
/// the link.
pub(crate) async fn keep_copies(
    peer: std::sync::Arc<crate::peer::Peer>,
    h: std::sync::Arc<LinkHandle>,
) {
    use crate::redundancy::CopyPolicy;
    let cfg = peer.cfg();
    let mut policy = CopyPolicy::new(cfg.redundancy(), cfg.link.bandwidth_bps);
    let mut wanted_before = 0;
    let dialing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    loop {
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        let current = peer
            .current
            .borrow()
            .as_ref()
            .is_some_and(|c| std::sync::Arc::ptr_eq(c, &h));
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
            let task = tokio::spawn(async move {
                crate::establish::open_copy(&peer, &link, &dialing).await;
            });
            h.keep_task(task);
        }
    }
}
