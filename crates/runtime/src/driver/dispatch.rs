//! Frame dispatch's other half: routing the events a [`Link`](wanopt_proto::Link) raised to the
//! stream tasks' wakeups, the counters and the cache directory, under the link's lock.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{info, warn};
use wanopt_proto::{Event, Refusal, ResetCode};

use super::state::Inner;
use crate::cachedir::CacheDir;
use crate::counters::{Counters, add};
use crate::sync::LogBudget;

/// Refusals of the peer's opens are the peer's to cause: their log lines are rationed.
static PEER_REFUSALS: LogBudget = LogBudget::new(Duration::from_secs(10), 10);

/// A host starved of CPU stalls every link at once, over and over: rationed too.
static STALLS: LogBudget = LogBudget::new(Duration::from_secs(60), 5);

/// Routes every pending event of link `link` (its id, for logs): wakes the streams concerned,
/// counts, saves the cache states the link checkpoints, and leaves opens, the hello and state
/// loads in `g` for the link's reader to act on.
pub(super) fn dispatch(
    g: &mut Inner,
    link: u64,
    counters: &Counters,
    caches: Option<&Arc<CacheDir>>,
) {
    while let Some(ev) = g.link.poll_event() {
        match ev {
            Event::Up { .. } => g.up = true,
            Event::Opened {
                stream, service, ..
            } => {
                g.signals.insert(stream, Arc::default());
                g.opened.push((stream, service));
            }
            Event::Refused {
                stream,
                service,
                why: Refusal::UnknownService,
            } => {
                add(&counters.link.unknown_service, 1);
                if let Some(suppressed) = PEER_REFUSALS.take(Instant::now()) {
                    warn!(link, stream = %stream, service = %service, suppressed, "refused stream for unknown service");
                }
            }
            Event::Refused {
                stream,
                service,
                why,
            } => {
                let c = counters.service(&service);
                add(&c.streams_refused, 1);
                c.failed(why.label());
                if let Some(suppressed) = PEER_REFUSALS.take(Instant::now()) {
                    warn!(link, stream = %stream, service = %service, limit = why.label(), suppressed, "refused a stream the peer opened: at its limit");
                }
            }
            Event::Readable(id) => {
                if let Some(s) = g.signals.get(&id) {
                    s.readable.notify_one();
                }
            }
            Event::Writable(id) => {
                if let Some(s) = g.signals.get(&id) {
                    s.writable.notify_one();
                }
            }
            Event::Reset {
                stream,
                code,
                reason,
            } => {
                if code == ResetCode::LinkLost {
                    add(&counters.link.streams_lost, 1);
                }
                if let Some(s) = g.signals.get(&stream) {
                    s.set_reset(format!("{}: {reason}", code.label()));
                }
            }
            Event::Done(id) => {
                if let Some(s) = g.signals.get(&id) {
                    s.gone.notify_one();
                }
            }
            Event::Closed(_) => {}
            Event::Suspended { reason } => {
                add(&counters.link.outages, 1);
                info!(link, reason = %reason, "link suspended");
            }
            Event::Resumed(r) => {
                let l = &counters.link;
                add(&l.streams_resumed, r.streams as u64);
                add(&l.resent, r.resent);
                if r.replay {
                    add(&l.replays, 1);
                    add(&l.replayed, r.replayed);
                }
                l.outage_seconds.inc_by(r.outage.as_secs_f64());
                counters.handover.resumed(r.outage);
                let what = if r.lane {
                    "latency lane resumed: its streams go on"
                } else if r.replay {
                    "link resumed: its streams go on, the caches kept"
                } else {
                    "link resumed: its streams go on"
                };
                info!(
                    link,
                    streams = r.streams,
                    resent = r.resent,
                    replayed = r.replayed,
                    lost = r.lost,
                    outage_ms = r.outage.as_millis() as u64,
                    "{what}"
                );
            }
            Event::Stalled(gap) => {
                add(&counters.link.stalls, 1);
                if let Some(suppressed) = STALLS.take(Instant::now()) {
                    warn!(
                        link,
                        ms = gap.as_millis() as u64,
                        suppressed,
                        "this daemon was not run for a while (a busy host?)"
                    );
                }
            }
            Event::LoadStates(reqs) => g.load = reqs,
            Event::Checkpoint {
                role,
                lane,
                scope,
                state,
            } => {
                if let Some(c) = &caches {
                    let before = c.coalesced();
                    c.save(role, lane, &scope, state);
                    if c.coalesced() > before {
                        counters.codec.state_replaced();
                    }
                }
            }
        }
    }
    for (svc, c) in g.link.take_wire_counts() {
        let sc = counters.service(&svc);
        add(&sc.wire_out, c.out);
        add(&sc.wire_in, c.inbound);
        if !c.held.is_zero() {
            sc.held.inc_by(c.held.as_secs_f64());
        }
        if !c.below_min.is_zero() {
            sc.below_min.inc_by(c.below_min.as_secs_f64());
        }
    }
    for (svc, c) in g.link.take_codec_counts() {
        // Bytes of streams already closed are decoded (to keep the cache in step) under "".
        if !svc.is_empty() {
            counters.codec.record(&svc, &c);
        }
    }
}

#[cfg(test)]
mod tests {
    use wanopt_proto::{Class, ResetCode};

    use super::super::testing::{SERVICE, link, settle};
    use super::*;

    /// A stream the peer opened is left for the reader (with its wakeups in place), a reset
    /// reaches the stream's waiters with its reason, and an open of an unknown service is
    /// counted, not handed on.
    #[test]
    fn opens_resets_and_refusals_reach_whom_they_concern() {
        let counters = Counters::new();
        let mut west = link(true, &|_| {});
        let mut east = Inner::new(link(false, &|_| {}));
        settle(&mut west, &mut east.link);
        dispatch(&mut east, 1, &counters, None);
        assert!(east.up, "the hello was routed");

        let id = west.open(SERVICE, Class::Bulk).expect("open");
        west.write(id, b"x").expect("write");
        settle(&mut west, &mut east.link);
        dispatch(&mut east, 1, &counters, None);
        assert_eq!(east.opened, vec![(id, Arc::<str>::from(SERVICE))]);
        let sig = east.signals.get(&id).cloned().expect("its wakeups");
        assert_eq!(sig.reset_reason(), None);

        west.reset(id, ResetCode::SocketError, "client went away");
        settle(&mut west, &mut east.link);
        dispatch(&mut east, 1, &counters, None);
        let why = sig.reset_reason().expect("the reset reached the stream");
        assert!(why.contains("client went away"), "{why}");

        let before = counters.link.unknown_service.get();
        west.open("nobody", Class::Bulk).expect("open");
        settle(&mut west, &mut east.link);
        dispatch(&mut east, 1, &counters, None);
        assert_eq!(counters.link.unknown_service.get(), before + 1);
        assert_eq!(east.opened.len(), 1, "a refused open is not handed on");
    }
}
