//! Handing a link to another process (a restart or an upgrade) without losing a stream: the
//! old process suspends the link, as if its connection were lost, and writes what resuming it
//! needs ([`Link::hand_over`]); the new one reads that into a suspended link
//! ([`Link::take_over`]) and resumes it on a new connection as after any lost one. The peer
//! sees a short outage. The codec's state is not handed over: a resumption starts it over
//! from the states both sides saved, as it does after a lost connection.
//!
//! What goes over: the link's tokens and stream ids, its receive window, every stream's state
//! (its ids, service, class and lane, what it sent and keeps until the peer confirms it, what
//! it received and the application has not read yet, its ends), and the recently finished
//! streams. It is versioned ([`HANDOVER_VERSION`]); a state this build cannot read is refused
//! whole, so the streams end with an error, never with wrong bytes. Read as hostile input: every
//! count and length is checked against what is left before anything is allocated.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut, Bytes};

use super::streams::{Kept, RecvHalf, SendHalf, Stream};
use super::{Link, LinkConfig, State};
use crate::flow::{RecvWindow, SendCredit};
use crate::frame::MAX_NAME_LEN;
use crate::frame::{Class, StreamId};
use crate::lane::LANES;

/// The version of the handover format this build writes and reads.
pub const HANDOVER_VERSION: u16 = 1;
const MAGIC: [u8; 4] = *b"WOHO";
/// Tokens the listener keeps at most (see `Link::resume_tokens`).
const MAX_TOKENS: usize = 16;
/// Streams a handed-over link may hold at most.
const MAX_STREAMS: usize = 1 << 20;
/// The largest offset, count or window a handover may hold (2^62 bytes, far beyond any
/// stream's life): what is read back can then be added to without overflowing.
const MAX_OFFSET: u64 = 1 << 62;
/// The largest receive window a handover may hold.
const MAX_WINDOW: u64 = 1 << 40;

/// A handover that cannot be written or read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandoverError {
    #[error("the link cannot be resumed (the peer does not resume streams, or it is closed)")]
    NotResumable,
    #[error("handover format {0} is not one this build reads ({HANDOVER_VERSION})")]
    Version(u16),
    #[error("the handed-over link is to {found}, the config's to {expected}")]
    OtherLink { expected: String, found: String },
    #[error("malformed handover: {0}")]
    Malformed(&'static str),
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.put_u64(b.len() as u64);
    out.put_slice(b);
}

fn put_name(out: &mut Vec<u8>, s: &str) {
    let s = &s.as_bytes()[..s.len().min(MAX_NAME_LEN)];
    out.put_u16(s.len() as u16);
    out.put_slice(s);
}

fn put_window(out: &mut Vec<u8>, w: &RecvWindow) {
    let (window, advertised, received, consumed) = w.parts();
    for v in [window, advertised, received, consumed] {
        out.put_u64(v);
    }
}

/// A checked reader: every read first checks that the bytes are there.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn need(&self, n: usize) -> Result<(), HandoverError> {
        if self.0.remaining() < n {
            return Err(HandoverError::Malformed("truncated"));
        }
        Ok(())
    }
    fn u8(&mut self) -> Result<u8, HandoverError> {
        self.need(1)?;
        Ok(self.0.get_u8())
    }
    fn flag(&mut self) -> Result<bool, HandoverError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(HandoverError::Malformed("a flag that is neither 0 nor 1")),
        }
    }
    fn u16(&mut self) -> Result<u16, HandoverError> {
        self.need(2)?;
        Ok(self.0.get_u16())
    }
    fn u32(&mut self) -> Result<u32, HandoverError> {
        self.need(4)?;
        Ok(self.0.get_u32())
    }
    fn u64(&mut self) -> Result<u64, HandoverError> {
        self.need(8)?;
        Ok(self.0.get_u64())
    }
    /// An offset, count or id number, at most [`MAX_OFFSET`].
    fn offset(&mut self) -> Result<u64, HandoverError> {
        let v = self.u64()?;
        if v > MAX_OFFSET {
            return Err(HandoverError::Malformed("an offset past its bound"));
        }
        Ok(v)
    }
    /// A count of items of at least `each` bytes, at most `max`.
    fn count(&mut self, max: usize, each: usize) -> Result<usize, HandoverError> {
        let n = self.u32()? as usize;
        if n > max || n.saturating_mul(each) > self.0.remaining() {
            return Err(HandoverError::Malformed("a count past its bound"));
        }
        Ok(n)
    }
    fn bytes(&mut self) -> Result<Bytes, HandoverError> {
        let n = self.u64()?;
        let n = usize::try_from(n).map_err(|_| HandoverError::Malformed("a length too large"))?;
        self.need(n)?;
        let b = Bytes::copy_from_slice(&self.0[..n]);
        self.0.advance(n);
        Ok(b)
    }
    fn name(&mut self) -> Result<String, HandoverError> {
        let n = usize::from(self.u16()?);
        if n > MAX_NAME_LEN {
            return Err(HandoverError::Malformed("a name too long"));
        }
        self.need(n)?;
        let s = std::str::from_utf8(&self.0[..n])
            .map_err(|_| HandoverError::Malformed("a name that is not UTF-8"))?
            .to_string();
        self.0.advance(n);
        Ok(s)
    }
    fn window(&mut self) -> Result<RecvWindow, HandoverError> {
        let (window, advertised, received, consumed) =
            (self.u64()?, self.offset()?, self.offset()?, self.offset()?);
        if window > MAX_WINDOW {
            return Err(HandoverError::Malformed("a receive window past its bound"));
        }
        RecvWindow::from_parts(window, advertised, received, consumed)
            .ok_or(HandoverError::Malformed("a receive window out of order"))
    }
    fn class(&mut self) -> Result<Class, HandoverError> {
        match self.u8()? {
            0 => Ok(Class::Latency),
            1 => Ok(Class::Bulk),
            _ => Err(HandoverError::Malformed("an unknown class")),
        }
    }
}

impl Link {
    /// Suspends the link (as if its connection were lost) and writes what another process
    /// needs to resume it: see the module's note. The link stays suspended here; drop it once
    /// the other process has the state. Fails if the link cannot be resumed (the peer does
    /// not resume streams, or the link is closed): then a handover would lose every stream.
    pub fn hand_over(&mut self, now: Instant) -> Result<Vec<u8>, HandoverError> {
        if !self.can_resume() || !self.suspend("handed over to another process", now) {
            return Err(HandoverError::NotResumable);
        }
        // Coded frames not rebuilt yet are codec state: their bytes come again.
        self.drop_undecoded(None);
        // The new process resumes through the lists with a fresh codec; so does this one if
        // it goes on after all: what it counted as read is no longer all here.
        self.replay = Default::default();
        let mut out = Vec::new();
        out.put_slice(&MAGIC);
        out.put_u16(HANDOVER_VERSION);
        out.put_u8(u8::from(self.cfg.initiator));
        put_name(&mut out, &self.cfg.site);
        put_name(&mut out, &self.cfg.peer);
        out.put_u64(self.peer.token);
        out.put_u64(self.cfg.token);
        out.put_u32(self.resume_tokens.len() as u32);
        for t in &self.resume_tokens {
            out.put_u64(*t);
        }
        let (since, draining) = self.outage.as_ref().map_or((Duration::ZERO, false), |o| {
            (now.saturating_duration_since(o.since), o.draining)
        });
        out.put_u64(since.as_millis() as u64);
        out.put_u8(u8::from(draining));
        put_window(&mut out, &self.link_window);
        let ids = self.streams.ids();
        out.put_u64(ids.0);
        for v in ids.1.iter().chain(ids.2.iter()) {
            out.put_u64(*v);
        }
        for v in self.lane_sent.iter().chain(self.lane_received.iter()) {
            out.put_u64(*v);
        }
        out.put_u32(self.done_ids.len() as u32);
        for id in &self.done_ids {
            out.put_u32(id.0);
        }
        let mut ids: Vec<StreamId> = self.streams.map.keys().copied().collect();
        ids.sort_unstable_by_key(|id| self.streams.get(id).map_or(0, |s| s.number));
        out.put_u32(ids.len() as u32);
        for id in ids {
            let Some(s) = self.streams.get(&id) else {
                continue;
            };
            out.put_u32(id.0);
            out.put_u64(s.number);
            out.put_u8(s.class.to_u8());
            out.put_u8(s.lane as u8);
            put_name(&mut out, &s.service);
            // Send: the credit, the ends, and every byte kept (sent or not).
            out.put_u64(s.send.credit.sent());
            out.put_u64(s.send.credit.max());
            out.put_u8(u8::from(s.send.fin_requested));
            out.put_u8(u8::from(s.send.fin_sent));
            out.put_u8(u8::from(s.send.fin_acked));
            // A resumable link keeps every stream's bytes from what the peer confirmed on.
            let Some(k) = s.send.kept.as_ref() else {
                return Err(HandoverError::NotResumable);
            };
            out.put_u64(k.from);
            out.put_u64(k.peer_window);
            let kept: Vec<u8> = k.bufs.iter().flat_map(|b| b.iter().copied()).collect();
            put_bytes(&mut out, &kept);
            // Receive: the window, the ends, and what the application has not read.
            put_window(&mut out, &s.recv.window);
            out.put_u8(u8::from(s.recv.fin_received));
            out.put_u8(u8::from(s.recv.read_done));
            out.put_u8(u8::from(s.recv.finished_sent));
            let unread: Vec<u8> = s
                .recv
                .queue
                .iter()
                .flat_map(|b| b.iter().copied())
                .collect();
            put_bytes(&mut out, &unread);
        }
        Ok(out)
    }

    /// A suspended link from what [`hand_over`](Self::hand_over) wrote in another process,
    /// under this process's `cfg` (its site, peer and side must be the same). Resume it as
    /// after a lost connection: [`reconnect`](Self::reconnect) on the connecting side,
    /// [`accept_resume`](Self::accept_resume) on the listener. Streams are resumed only while
    /// the resume window that began when the old process suspended the link lasts.
    pub fn take_over(cfg: LinkConfig, state: &[u8], now: Instant) -> Result<Link, HandoverError> {
        let mut r = Reader(state);
        r.need(6)?;
        if r.0[..4] != MAGIC {
            return Err(HandoverError::Malformed("not a link handover"));
        }
        r.0.advance(4);
        let version = r.u16()?;
        if version != HANDOVER_VERSION {
            return Err(HandoverError::Version(version));
        }
        let initiator = r.flag()?;
        let (site, peer) = (r.name()?, r.name()?);
        if initiator != cfg.initiator || site != cfg.site || peer != cfg.peer {
            return Err(HandoverError::OtherLink {
                expected: format!("{} from {}", cfg.peer, cfg.site),
                found: format!("{peer} from {site}"),
            });
        }
        let (peer_token, token) = (r.u64()?, r.u64()?);
        let n = r.count(MAX_TOKENS, 8)?;
        let mut tokens = Vec::with_capacity(n);
        for _ in 0..n {
            tokens.push(r.u64()?);
        }
        let since = Duration::from_millis(r.u64()?);
        let draining = r.flag()?;
        let link_window = r.window()?;
        let next_local = r.offset()?;
        let mut peer_max = [0u64; LANES];
        let mut own_lane_max = [0u64; LANES];
        for v in peer_max.iter_mut().chain(own_lane_max.iter_mut()) {
            *v = r.offset()?;
        }
        let mut lane_sent = [0u64; LANES];
        let mut lane_received = [0u64; LANES];
        for v in lane_sent.iter_mut().chain(lane_received.iter_mut()) {
            *v = r.offset()?;
        }
        let n = r.count(super::resume::DONE_KEPT, 4)?;
        let mut done = VecDeque::with_capacity(n);
        for _ in 0..n {
            done.push_back(StreamId(r.u32()?));
        }
        let mut link = Link::new(LinkConfig { token, ..cfg });
        if !link.streams.restore_ids(next_local, peer_max, own_lane_max) {
            return Err(HandoverError::Malformed("stream ids of the wrong side"));
        }
        let n = r.count(MAX_STREAMS, 64)?;
        for _ in 0..n {
            let id = StreamId(r.u32()?);
            let number = r.offset()?;
            let class = r.class()?;
            let lane = usize::from(r.u8()?);
            if lane >= LANES || id == StreamId::LINK || u64::from(id.0) != number % (1 << 32) {
                return Err(HandoverError::Malformed("a stream's id or lane"));
            }
            let service: Arc<str> = Arc::from(r.name()?);
            let (sent, max) = (r.offset()?, r.offset()?);
            let (fin_requested, fin_sent, fin_acked) = (r.flag()?, r.flag()?, r.flag()?);
            let (from, peer_window) = (r.offset()?, r.offset()?);
            let kept = r.bytes()?;
            let end = from.checked_add(kept.len() as u64);
            if sent > max || from > sent || end.is_none_or(|e| e < sent) {
                return Err(HandoverError::Malformed("a stream's send offsets"));
            }
            let window = r.window()?;
            let (fin_received, read_done, finished_sent) = (r.flag()?, r.flag()?, r.flag()?);
            let unread = r.bytes()?;
            if unread.len() as u64 != window.buffered() {
                return Err(HandoverError::Malformed("a stream's unread bytes"));
            }
            if link.streams.map.contains_key(&id) {
                return Err(HandoverError::Malformed("a stream listed twice"));
            }
            let mut credit = SendCredit::new(max);
            credit.consume(sent);
            let unsent = kept.slice((sent - from) as usize..);
            let send = SendHalf {
                queued: unsent.len(),
                queue: if unsent.is_empty() {
                    VecDeque::new()
                } else {
                    VecDeque::from([unsent])
                },
                credit,
                fin_requested,
                fin_sent,
                write_blocked: false,
                coder: None,
                kept: Some(Kept {
                    len: kept.len(),
                    bufs: if kept.is_empty() {
                        VecDeque::new()
                    } else {
                        VecDeque::from([kept])
                    },
                    from,
                    peer_window,
                }),
                fin_acked,
            };
            let recv = RecvHalf {
                queue: if unread.is_empty() {
                    VecDeque::new()
                } else {
                    VecDeque::from([unread])
                },
                window,
                fin_received,
                read_done,
                coded: None,
                finished_sent,
            };
            if link.streams.is_peer_id(id) {
                link.streams.count_peer(id, &service, class == Class::Bulk);
            }
            link.streams.map.insert(
                id,
                Stream {
                    class,
                    lane,
                    service,
                    number,
                    send,
                    recv,
                    scheduled: false,
                },
            );
        }
        if r.0.has_remaining() {
            return Err(HandoverError::Malformed("bytes after the last stream"));
        }
        link.resumable = true;
        link.state = State::Suspended;
        link.peer.token = peer_token;
        if !tokens.is_empty() {
            link.resume_tokens = tokens;
        }
        link.link_window = link_window;
        link.lane_sent = lane_sent;
        link.lane_received = lane_received;
        link.done_ids = done;
        for c in &mut link.ctrl {
            c.clear();
        }
        let since = now.checked_sub(since).unwrap_or(now);
        link.timers.stop_all();
        link.outage = Some(super::resume::Outage { since, draining });
        link.timers
            .set(super::timer::Timer::Resume, since + link.cfg.resume_window);
        link.events.push_back(super::Event::Suspended {
            reason: "taken over from another process".into(),
        });
        Ok(link)
    }
}

/// A stream of a link, as a process that took the link over needs to know it: who opened it,
/// for which service, and which of its directions the application (the process before) ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamState {
    pub id: StreamId,
    pub service: Arc<str>,
    pub class: Class,
    pub opened_by_peer: bool,
    /// The application ended what it sends.
    pub write_finished: bool,
    /// The application read the peer's end.
    pub read_finished: bool,
}

impl Link {
    /// Every stream of the link, in the order they were opened.
    pub fn stream_states(&self) -> Vec<StreamState> {
        let mut v: Vec<(u64, StreamState)> = self
            .streams
            .map
            .iter()
            .map(|(id, s)| {
                (
                    s.number,
                    StreamState {
                        id: *id,
                        service: s.service.clone(),
                        class: s.class,
                        opened_by_peer: self.streams.is_peer_id(*id),
                        write_finished: s.send.fin_requested,
                        read_finished: s.recv.read_done,
                    },
                )
            })
            .collect();
        v.sort_unstable_by_key(|(n, _)| *n);
        v.into_iter().map(|(_, s)| s).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Windows and offsets past their bounds are refused as they are read, so nothing that
    /// later adds to them can overflow (the fuzz target found a window of 2^63 did).
    #[test]
    fn windows_and_offsets_past_their_bounds_are_refused() {
        let window = |w: u64, a: u64, r: u64, c: u64| {
            let mut b = Vec::new();
            for v in [w, a, r, c] {
                b.put_u64(v);
            }
            Reader(&b).window()
        };
        assert!(window(1 << 20, 1 << 20, 5, 0).is_ok());
        assert!(window(u64::MAX, 10, 5, 0).is_err());
        assert!(window(MAX_WINDOW + 1, 10, 5, 0).is_err());
        assert!(window(1 << 20, u64::MAX, 5, 0).is_err());
        assert!(
            window(1 << 20, 10, 11, 0).is_err(),
            "received past advertised"
        );
        assert!(window(1 << 20, 10, 5, 6).is_err(), "consumed past received");
        let mut b = Vec::new();
        b.put_u64(MAX_OFFSET + 1);
        assert!(Reader(&b).offset().is_err());
    }
}
