//! The connections carrying a link's latency lane: each carries a copy of the lane's bytes
//! ([`Fanout`](wanopt_proto::copies::Fanout) on the way out,
//! [`Merge`](wanopt_proto::copies::Merge) on the way in), so a segment one connection lost costs
//! nothing while another brings it. Losing a copy leaves the others carrying the lane; losing
//! the last (or one that alone held what the others skip) loses the lane, which resumes as
//! before. Here: taking a place among the copies, writing a copy, merging what copies read.

use std::time::Instant;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tracing::{debug, warn};
use wanopt_proto::LATENCY_LANE;
use wanopt_proto::copies::MAX_COPIES;

use super::carriers::Carrier;
use super::handle::{LinkHandle, TRANSMIT_BATCH};
use super::state::Inner;
use crate::counters::add;

/// How a copy's end leaves the lane.
pub(super) enum CopyEnd {
    /// A newer connection or lane took over: nothing to do.
    Stale,
    /// The other copies carry the lane on; this many.
    Others(usize),
    /// No copy left brings what follows the delivered bytes: the lane is lost.
    LaneLost,
}

impl LinkHandle {
    /// True while `c` still carries the lane.
    pub(super) fn carries(&self, g: &Inner, c: &Carrier) -> bool {
        self.current(c.conn, LATENCY_LANE) && g.lane.carries(c)
    }

    /// Attaches a new latency lane whose first connection presented `token` (see
    /// [`Link::attach_lane`](wanopt_proto::Link::attach_lane)) and named the lane `id`; the
    /// connection's place, or `None` if refused. `datagrams`: the lane's, keyed from its first
    /// connection, used if both ends take them.
    pub fn attach_lane(
        &self,
        token: u64,
        id: Option<u64>,
        datagrams: Option<crate::datagrams::LaneDatagrams>,
    ) -> Option<Carrier> {
        let mut g = self.state();
        if !g.link.attach_lane(token) {
            return None;
        }
        self.new_lane_connection();
        let generation = self.next_generation();
        g.lane.restart(id, generation);
        if g.link.lane_datagrams() && self.ctx.datagrams != crate::datagrams::Setting::Off {
            g.lane.datagrams = datagrams.filter(|d| Some(d.lane()) == id);
        }
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

    /// The connecting side: a place for one more copy of the lane, if the lane has room for it.
    /// Returns it with the lane's id and where our bytes on it start; the copy carries what the
    /// lane sends from now on, and its incoming bytes wait for [`copy_answered`].
    ///
    /// [`copy_answered`]: Self::copy_answered
    pub fn add_copy(&self) -> Option<(Carrier, u64, u64)> {
        let mut g = self.state();
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
        let mut g = self.state();
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
        let mut g = self.state();
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
        let mut g = self.state();
        if self.carries(&g, c) {
            g.lane.release(c.slot);
        }
    }

    /// Drops the newest copies until `keep` connections carry the lane (the redundancy policy
    /// wants fewer). The newest started furthest on, so the older ones carry everything it
    /// did: dropping it never leaves the peer a gap.
    pub fn drop_copies(&self, keep: usize) -> usize {
        let mut g = self.state();
        let mut dropped = 0;
        while g.lane.count() > keep.max(1) {
            let Some(slot) = (0..MAX_COPIES)
                .filter(|s| g.lane.generations[*s] != 0)
                .max_by_key(|s| g.lane.starts[*s])
            else {
                break;
            };
            g.lane.release(slot);
            self.forget_fd(1 + slot);
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
        let g = self.state();
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
        self.lane_fds()
            .into_iter()
            .flatten()
            .filter_map(crate::sockopt::tcp_info)
            .fold((0, 0), |(r, s), t| {
                (
                    r + t.retransmitted_segments.max(0) as u64,
                    s + t.data_segments_sent.max(0) as u64,
                )
            })
    }

    /// A copy's connection ended.
    pub(super) fn copy_ended(&self, g: &mut Inner, c: &Carrier) -> CopyEnd {
        if !self.carries(g, c) {
            return CopyEnd::Stale;
        }
        g.lane.release(c.slot);
        self.forget_fd(1 + c.slot);
        let left = g.lane.count();
        if left > 0 && g.lane.merge.complete() {
            return CopyEnd::Others(left);
        }
        for slot in 0..MAX_COPIES {
            if g.lane.generations[slot] != 0 {
                g.lane.release(slot);
                self.forget_fd(1 + slot);
            }
        }
        CopyEnd::LaneLost
    }
}

/// How ready each copy's connection is to deliver bytes written now (`sockopt::copy_rank`), read
/// under the sockets' lock so none is closed meanwhile (the link's lock may be held: it is
/// always taken before the sockets').
fn copy_ranks(h: &LinkHandle, bytes: usize) -> [u8; MAX_COPIES] {
    h.with_fds(|fds| {
        let copies = || {
            (0..MAX_COPIES).filter_map(|slot| Some((slot, fds.get(1 + slot).copied().flatten()?)))
        };
        let mut ranks = [0; MAX_COPIES];
        for (slot, fd) in copies() {
            ranks[slot] = crate::sockopt::copy_rank(fd, bytes).unwrap_or(0);
        }
        if tracing::enabled!(tracing::Level::DEBUG)
            && copies().count() > 1
            && copies().all(|(slot, _)| ranks[slot] > 0)
        {
            let states: Vec<String> = copies()
                .map(|(slot, fd)| format!("{}: {}", slot + 1, crate::sockopt::copy_state(fd)))
                .collect();
            debug!(link = h.id, bytes, copies = %states.join("; "), "every copy of a latency lane write is impaired");
        }
        ranks
    })
}

/// Writes copy `c`'s bytes: what the fanout holds for it, taking the link's next lane bytes
/// when it has written all it had (and waking the other copies, which write them too).
pub(super) async fn write_copy<W: AsyncWrite + Unpin>(
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
        let (next, due, closed, dropped): (Option<Bytes>, Option<Instant>, bool, bool) = {
            let mut g = h.state();
            if !h.carries(&g, &c) {
                (None, None, false, true)
            } else {
                if g.link.is_suspended() {
                    return "the link's other lane was lost".into();
                }
                if g.lane.fanout.next(c.slot).is_none() {
                    g.link.poll_transmit_lane(
                        Instant::now(),
                        LATENCY_LANE,
                        &mut buf,
                        TRANSMIT_BATCH,
                    );
                    h.dispatch(&mut g);
                    if !buf.is_empty() {
                        let n = buf.len() as u64;
                        g.lane.sent += n;
                        add(&counters.wire_out, n);
                        // The readiest connections write these bytes first (`Fanout::set_ranks`).
                        if !h.ctx.copy_spacing.is_zero() {
                            let ranks = copy_ranks(h, buf.len());
                            add(
                                &counters.copy_impaired,
                                ranks.iter().filter(|&&r| r > 0).count() as u64,
                            );
                            g.lane.fanout.set_ranks(ranks);
                        }
                        let end = g.lane.fanout.end();
                        h.send_datagrams(&mut g, end, &buf);
                        for slot in g.lane.fanout.push(buf.split().freeze(), Instant::now()) {
                            g.lane.release(slot);
                            h.forget_fd(1 + slot);
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
                (
                    g.lane.fanout.next(c.slot),
                    g.lane.fanout.not_before(c.slot, h.ctx.copy_spacing),
                    g.link.is_closed(),
                    false,
                )
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
            h.copy_writable(c.slot).await;
            continue;
        };
        // Another copy wrote these bytes: this one leaves its spacing later (see
        // `Fanout::not_before`), and looks again then (it may have been given up meanwhile).
        if let Some(t) = due.filter(|t| *t > Instant::now()) {
            let from = Instant::now();
            tokio::time::sleep_until(t.into()).await;
            counters
                .copy_spacing_seconds
                .inc_by(from.elapsed().as_secs_f64());
            continue;
        }
        let chunk = chunk.slice(..chunk.len().min(TRANSMIT_BATCH));
        if let Err(e) = wr.write_all(&chunk).await {
            return format!("write: {e}");
        }
        if let Err(e) = wr.flush().await {
            return format!("write: {e}");
        }
        let mut g = h.state();
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

#[cfg(test)]
mod tests {
    use super::super::testing::{settle_handles, side};

    /// The dialing side attaches the lane in slot 0 and takes places for copies up to what
    /// both sides allow; the listening side accepts a copy that names the lane and refuses one
    /// that does not; dropping copies drops the newest first.
    #[test]
    fn copies_take_places_up_to_the_limit_and_the_newest_goes_first() {
        let two = |c: &mut wanopt_proto::LinkConfig| c.lane_copies = 2;
        let (west, east) = (side(true, &two), side(false, &two));
        settle_handles(&west.h, &east.h);
        let token = west
            .h
            .with(|l| l.lane_offer())
            .expect("the dialing side offers a lane");

        let first = west.h.attach_lane(token, Some(5), None).expect("attached");
        assert_eq!(first.slot, 0);
        let (second, id, _) = west.h.add_copy().expect("room for a second connection");
        assert_eq!((second.slot, id), (1, 5));
        assert!(west.h.add_copy().is_none(), "two connections at most");
        assert_eq!(west.h.lane_state().map(|s| (s.0, s.1)), Some((2, 2)));
        assert_eq!(west.h.drop_copies(1), 1);
        {
            let g = west.h.state();
            assert!(west.h.carries(&g, &first), "the oldest stays");
            assert!(!west.h.carries(&g, &second), "the newest went");
        }

        let lane = east
            .h
            .attach_lane(token, Some(5), None)
            .expect("the lane attaches");
        assert_eq!(lane.slot, 0);
        assert!(
            east.h.accept_copy(token, 6, 0).is_err(),
            "another lane's copy"
        );
        assert!(
            east.h.accept_copy(token ^ 1, 5, 0).is_err(),
            "a wrong token"
        );
        let (copy, _) = east.h.accept_copy(token, 5, 0).expect("a copy of the lane");
        assert_eq!(copy.slot, 1);
        assert!(east.h.accept_copy(token, 5, 0).is_err(), "full");
    }
}
