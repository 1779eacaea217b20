//! Frames from the peer: check-then-parse from a lane's bytes, then one handler per frame kind.
//! Any violation fails the whole link (a GoAway says why); a stream's own trouble resets only it.

use std::time::Instant;

use bytes::{Bytes, BytesMut};

use super::hello::{HELLO_MAX, PeerParams};
use super::timer::Timer;
use super::{Event, Link, Refusal, State};
use crate::coding::PeerCodec;
use crate::error::{FrameError, LinkError};
use crate::flow::SendCredit;
use crate::frame::{Class, Frame, Hello, ResetCode, StreamId};
use crate::lane::{CAP_RESUME, LANES, LATENCY_LANE, MAIN_LANE};

/// How long frames fed ahead may wait past an input call for the rest of a frame being read
/// (see [`Link::handle_lane_input`]): what they rebuilt reaches its streams this late at most.
const FED_WAIT: std::time::Duration = std::time::Duration::from_millis(1);

impl Link {
    /// Consumes bytes read from the peer. On error the link is closed (a GoAway is queued and
    /// [`Event::Closed`] emitted) and the error returned.
    pub fn handle_input(&mut self, data: &[u8], now: Instant) -> Result<(), LinkError> {
        let mut buf = std::mem::take(&mut self.inbuf);
        buf.extend_from_slice(data);
        let r = self.handle_input_buf(&mut buf, now);
        self.inbuf = buf;
        r
    }

    /// Consumes whole frames from the front of `buf` (the caller's read buffer of the main lane, so
    /// data payloads are not copied), leaving a partial frame in it for the next call.
    pub fn handle_input_buf(&mut self, buf: &mut BytesMut, now: Instant) -> Result<(), LinkError> {
        self.handle_lane_input(MAIN_LANE, buf, now)
    }

    /// Like [`handle_input_buf`](Self::handle_input_buf) for the bytes of one lane.
    pub fn handle_lane_input(
        &mut self,
        lane: usize,
        buf: &mut BytesMut,
        now: Instant,
    ) -> Result<(), LinkError> {
        let r = self.lane_input(lane, buf, now);
        // Frames fed ahead of their turn are all decoded before the call returns, unless it
        // ends inside a frame of the main lane (the rest of it still being read): then they
        // wait for it (the workers going on with them meanwhile), [`FED_WAIT`] at most.
        if r.is_ok() && lane == MAIN_LANE && !buf.is_empty() && !self.feeds.is_empty() {
            self.timers.get_or_set(Timer::Fed, now + FED_WAIT);
        } else {
            self.decode_fed();
        }
        r
    }

    fn lane_input(
        &mut self,
        lane: usize,
        buf: &mut BytesMut,
        now: Instant,
    ) -> Result<(), LinkError> {
        if lane >= LANES || (lane == LATENCY_LANE && !self.lane_attached) {
            return Err(self.fail(LinkError::Protocol(
                "input on a lane that is not attached".into(),
            )));
        }
        if matches!(self.state, State::Closed | State::Suspended) {
            // Bytes of a connection already given up.
            buf.clear();
            return Ok(());
        }
        self.timers.set(Timer::Idle, now + self.cfg.idle_timeout);
        self.heard_from_peer(now);
        loop {
            if self.loading {
                // Frames past the hello may use a resumed cache: they wait in `buf`.
                return Ok(());
            }
            if self.replies_backed_up() {
                // A peer that sends what needs answers but does not read them: read no more
                // until they are out (see `replies_backed_up`).
                return Ok(());
            }
            let max = if self.state == State::Handshake {
                // Before the hello, only a hello-sized frame is acceptable (its cache offers
                // included).
                HELLO_MAX
            } else {
                self.cfg.max_frame + 8
            };
            let n = match Frame::check(buf, max) {
                Ok(n) => n,
                Err(FrameError::Incomplete) => return Ok(()),
                Err(e) => return Err(self.fail(LinkError::Frame(e))),
            };
            let bytes = buf.split_to(n).freeze();
            let f = match Frame::parse(bytes) {
                Ok(f) => f,
                Err(e) => return Err(self.fail(LinkError::Frame(e))),
            };
            self.link_wire_in += n as u64;
            if !matches!(f, Frame::Coded { .. } | Frame::CodedShort { .. }) {
                // Anything else may depend on what the frames before it rebuilt.
                self.decode_fed();
            }
            let hello = matches!(f, Frame::Hello(_));
            if let Err(e) = self.on_frame(f, n, now, lane) {
                return Err(self.fail(e));
            }
            if lane == MAIN_LANE && !hello {
                self.replay_read(n);
            }
            if self.state == State::Closed {
                buf.clear();
                return Ok(());
            }
        }
    }

    fn on_frame(
        &mut self,
        f: Frame,
        wire: usize,
        now: Instant,
        lane: usize,
    ) -> Result<(), LinkError> {
        if self.state == State::Handshake {
            return match f {
                Frame::Hello(h) => self.on_hello(h, now),
                Frame::GoAway { code, reason } => Err(LinkError::PeerClosed { code, reason }),
                _ => Err(LinkError::Protocol("first frame is not a hello".into())),
            };
        }
        match f {
            Frame::Hello(_) => Err(LinkError::Protocol("second hello".into())),
            Frame::Open {
                stream,
                class,
                service,
            } => self.on_open(stream, class, service, wire, lane),
            Frame::Data {
                stream,
                offset,
                fin,
                data,
            } => self.on_data(stream, offset, fin, data, wire, lane),
            Frame::Reset {
                stream,
                code,
                reason,
            } => self.on_reset(stream, code, reason),
            Frame::MaxData { stream, max } => self.on_max_data(stream, max),
            Frame::Ping { payload } => {
                self.ctrl[MAIN_LANE].push_back(Frame::Pong { payload });
                Ok(())
            }
            Frame::Pong { payload } => {
                let k = &mut self.keepalive;
                if let Some((seq, at)) = k.sent
                    && seq == payload
                {
                    k.rtt = Some(now.saturating_duration_since(at));
                    k.sent = None;
                }
                Ok(())
            }
            Frame::GoAway { code, reason } => Err(LinkError::PeerClosed { code, reason }),
            Frame::Coded {
                stream,
                offset,
                fin,
                scoped,
                raw_len,
                records,
            } => self.on_coded(stream, offset, fin, scoped, raw_len, records, wire, lane),
            Frame::CodedShort {
                stream,
                at,
                fin,
                scoped,
                raw_len,
                records,
            } => {
                // A stream's frames arrive in order: its offset is what we received of it, and
                // the frame's low 16 bits of it must agree (a stream already gone needs none).
                let (offset, known) = match self.streams.get(&stream) {
                    Some(s) => (s.recv.window.received(), true),
                    None => (0, false),
                };
                if known && offset as u16 != at {
                    return Err(LinkError::Protocol(format!(
                        "stream {stream}: offset check {at}, expected {}",
                        offset as u16
                    )));
                }
                self.on_coded(stream, offset, fin, scoped, raw_len, records, wire, lane)
            }
            Frame::Need {
                stream,
                scope,
                fingerprint,
            } => self.on_need(stream, lane, scope, fingerprint),
            Frame::Chunk {
                scope,
                fingerprint,
                data,
                ..
            } => self.on_chunk(lane, &scope, fingerprint, &data),
            Frame::Checkpoint { scope, digest } => self.on_checkpoint(lane, scope, &digest),
            Frame::Finished { stream, offset } => self.on_finished(stream, offset),
            Frame::Received { offset } => self.on_received(offset, lane),
            Frame::Resume(r) => self.on_resume(*r, now, lane),
        }
    }

    fn on_hello(&mut self, h: Hello, now: Instant) -> Result<(), LinkError> {
        let mut p = PeerParams::from_hello(&h, &self.cfg.peer)?;
        // What the peer grants is what we may leave unacknowledged and so keep for resends: no
        // more than we grant it, whatever it says (2^62 would keep every byte ever sent).
        p.stream_window = p.stream_window.min(u64::from(self.cfg.stream_window));
        p.link_window = p.link_window.min(self.cfg.link_window);
        self.link_credit = SendCredit::new(p.link_window);
        self.coding.on_peer(
            &PeerCodec {
                caps: p.caps,
                cache: p.cache_bytes,
                service_cache: p.service_cache_bytes,
                max_frame: p.max_frame,
                link_window: p.link_window,
                long: p.long_context,
            },
            &h.caches,
            &h.scoped,
        );
        let version = p.version;
        self.resumable = p.has(CAP_RESUME) && !self.cfg.resume_window.is_zero();
        // The silence clocks of a resumable link start with its hello.
        self.heard_from_peer(now);
        self.peer = p;
        self.state = if self.outage.as_ref().is_some_and(|o| o.draining) {
            State::Draining
        } else {
            State::Open
        };
        self.on_resumed_hello(&h, now)?;
        self.timers.set(Timer::Ping, now + self.cfg.keepalive);
        self.events.push_back(Event::Up { peer: h, version });
        let load = self.coding.take_state_requests();
        if !load.is_empty() {
            self.loading = true;
            self.events.push_back(Event::LoadStates(load));
        }
        Ok(())
    }

    fn on_open(
        &mut self,
        id: StreamId,
        class: Class,
        service: String,
        wire: usize,
        lane: usize,
    ) -> Result<(), LinkError> {
        let Some(number) = self.streams.accept_peer_id(id, lane) else {
            return Err(LinkError::Protocol(format!("bad stream id {id} in open")));
        };
        let mut refuse = |code, reason: String| {
            self.ctrl[lane].push_back(Frame::Reset {
                stream: id,
                code,
                reason,
            });
        };
        if self.state != State::Open {
            refuse(ResetCode::Shutdown, "shutting down".into());
            return Ok(());
        }
        let Some((name, limit)) = self
            .services
            .get_key_value(service.as_str())
            .map(|(k, v)| (k.clone(), *v))
        else {
            refuse(
                ResetCode::UnknownService,
                format!("no service named {service:?}"),
            );
            self.events.push_back(Event::Refused {
                stream: id,
                service,
                why: Refusal::UnknownService,
            });
            return Ok(());
        };
        let bulk = limit.class.unwrap_or(class) == Class::Bulk;
        let full = if self.streams.peer_open >= self.cfg.max_streams {
            Some((Refusal::LinkFull, "too many streams".to_string()))
        } else if self.streams.peer_on(&name) >= limit.max_streams {
            Some((
                Refusal::ServiceFull,
                format!(
                    "service {name:?} has its limit of {} streams",
                    limit.max_streams
                ),
            ))
        } else if bulk
            && self.streams.peer_bulk()
                >= self
                    .cfg
                    .max_streams
                    .saturating_sub(self.cfg.latency_reserve)
        {
            Some((
                Refusal::BulkFull,
                "too many bulk streams (the rest is kept for latency services)".to_string(),
            ))
        } else {
            None
        };
        if let Some((why, reason)) = full {
            refuse(ResetCode::Refused, reason);
            self.events.push_back(Event::Refused {
                stream: id,
                service,
                why,
            });
            return Ok(());
        }
        self.streams.count_peer(id, &name, bulk);
        self.wire.entry(name.clone()).or_default().inbound += wire as u64;
        self.insert_stream((id, number), class, lane, name.clone());
        self.events.push_back(Event::Opened {
            stream: id,
            class,
            service: name,
        });
        Ok(())
    }

    fn on_reset(&mut self, id: StreamId, code: ResetCode, reason: String) -> Result<(), LinkError> {
        if self.remove_stream(id).is_some() {
            self.events.push_back(Event::Reset {
                stream: id,
                code,
                reason,
            });
        } else if !self.streams.was_open(id) {
            return Err(LinkError::Protocol(format!("reset of unknown stream {id}")));
        }
        Ok(())
    }

    fn on_max_data(&mut self, id: StreamId, max: u64) -> Result<(), LinkError> {
        if id == StreamId::LINK {
            self.link_credit.raise(max);
        } else if let Some(s) = self.streams.get_mut(&id) {
            s.send.on_max_data(max);
            if s.send.credit.raise(max) {
                self.streams.schedule(id);
            }
        } else if !self.streams.was_open(id) {
            return Err(LinkError::Protocol(format!(
                "credit for unknown stream {id}"
            )));
        }
        Ok(())
    }

    /// Charges `n` stream bytes at `offset` to the link and stream windows and checks their order
    /// (and `check`, for what only one frame kind requires). Returns false for a stream already
    /// closed: its bytes are dropped and their link credit given back.
    pub(super) fn admit(
        &mut self,
        (id, lane): (StreamId, usize),
        offset: u64,
        n: u64,
        wire: usize,
        check: impl FnOnce(&super::Stream) -> Option<String>,
    ) -> Result<bool, LinkError> {
        self.link_window.on_receive(n).map_err(|e| {
            LinkError::Protocol(format!(
                "peer exceeded link credit ({} > {})",
                e.received, e.limit
            ))
        })?;
        self.lane_received[lane] += n;
        let Some(s) = self.streams.get_mut(&id) else {
            if !self.streams.was_open(id) {
                return Err(LinkError::Protocol(format!("data for unknown stream {id}")));
            }
            if let Some(max) = self.link_window.on_consume(n) {
                self.ctrl[MAIN_LANE].push_back(Frame::MaxData {
                    stream: StreamId::LINK,
                    max,
                });
            }
            return Ok(false);
        };
        self.wire.entry(s.service.clone()).or_default().inbound += wire as u64;
        let violation = if s.recv.fin_received {
            Some("data after fin".to_string())
        } else if offset != s.recv.window.received() {
            Some(format!(
                "offset {offset}, expected {}",
                s.recv.window.received()
            ))
        } else if let Some(why) = check(s) {
            Some(why)
        } else if let Err(e) = s.recv.window.on_receive(n) {
            Some(format!(
                "stream credit exceeded ({} > {})",
                e.received, e.limit
            ))
        } else {
            None
        };
        match violation {
            Some(why) => Err(LinkError::Protocol(format!("stream {id}: {why}"))),
            None => Ok(true),
        }
    }

    fn on_data(
        &mut self,
        id: StreamId,
        offset: u64,
        fin: bool,
        data: Bytes,
        wire: usize,
        lane: usize,
    ) -> Result<(), LinkError> {
        let n = data.len() as u64;
        let data = unpinned(data);
        let open = self.admit((id, lane), offset, n, wire, |s| {
            s.recv
                .coded_waiting()
                .then(|| "plain data while coded data waits".to_string())
        })?;
        let (Some(s), true) = (self.streams.get_mut(&id), open) else {
            return Ok(());
        };
        let was_empty = s.recv.queue.is_empty() && !s.recv.fin_received;
        if !data.is_empty() {
            s.recv.queue.push_back(data);
        }
        if fin {
            s.recv.fin_received = true;
        }
        if was_empty && (n > 0 || fin) {
            self.events.push_back(Event::Readable(id));
        }
        if fin {
            self.note_end(id);
        }
        Ok(())
    }
}

/// Payloads this small are copied out of the read buffer they arrived in: a slice would keep the
/// whole buffer (64 KiB) alive for as long as its stream holds it, so a peer sending one byte per
/// read behind a slow target could make each byte of credit cost a buffer. Larger payloads keep
/// at most 8 buffer bytes per byte held, and are not copied.
pub(super) const COPY_BELOW: usize = 8 * 1024;

/// `data` in an allocation of its own if it is small (see [`COPY_BELOW`]).
pub(super) fn unpinned(data: bytes::Bytes) -> bytes::Bytes {
    if data.len() < COPY_BELOW {
        bytes::Bytes::copy_from_slice(&data)
    } else {
        data
    }
}
