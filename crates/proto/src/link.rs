//! The link state machine: hello exchange, stream multiplexing, flow control and scheduling.
//!
//! A [`Link`] consumes the bytes read from the peer ([`Link::handle_input`]) and produces the bytes to
//! send ([`Link::poll_transmit`]); the application side writes and reads stream bytes and learns what
//! changed from [`Link::poll_event`]. Time comes in as `now` arguments; nothing here does I/O.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};

use crate::coding::{
    self, CacheStat, CacheStorage, CodecCount, CodecSettings, Contexts, Pressure, RecvCoded, Role,
    SendCoder, StreamPolicy,
};
use crate::error::{FrameError, LinkError, StreamError};
use crate::flow::{RecvWindow, SendCredit};
use crate::frame::{self, Class, CloseCode, Frame, Hello, ResetCode, StreamId, setting};
use wanopt_codec::cache::Snapshot;

/// Highest protocol version this build speaks.
pub const VERSION: u16 = 1;
/// Lowest protocol version this build speaks.
pub const MIN_VERSION: u16 = 1;

/// Lanes of a link: TCP connections inside one link. Lane 0 carries the hello, control and bulk
/// frames; lane 1, when attached, carries latency-class streams, so they never wait behind bulk's
/// loss recovery or its unsent bytes in the kernel.
pub const LANES: usize = 2;
/// The main lane.
pub const MAIN_LANE: usize = 0;
/// The latency lane.
pub const LATENCY_LANE: usize = 1;
/// Hello capability bit: the sender accepts a latency lane.
pub const CAP_LATENCY_LANE: u64 = 1;
/// Hello capability bit: the sender decodes optimized (`Coded`) frames.
pub const CAP_CODEC: u64 = 2;
/// Hello capability bit: the sender decodes zstd literals compressed in their stream's context.
pub const CAP_CONTEXT: u64 = 4;

/// Largest hello accepted: room for the most cache offers with the longest names.
const HELLO_MAX: u32 = 256 * 1024;

/// Most chunk answers (re-sent chunks) queued for the peer at once.
const MAX_ANSWERS: usize = 1024;

/// Bytes a bulk stream may send in one scheduling turn before the next stream gets its turn.
const BULK_QUANTUM: usize = 32 * 1024;

/// Settings of one link, from the daemon's config.
#[derive(Debug, Clone)]
pub struct LinkConfig {
    /// Our site name, sent in the hello.
    pub site: String,
    /// The site name the peer must announce.
    pub peer: String,
    /// True on the side that connected: it numbers its streams odd, the listener even.
    pub initiator: bool,
    /// Receive window we grant each stream, in bytes.
    pub stream_window: u32,
    /// Receive window we grant the whole link, in bytes.
    pub link_window: u64,
    /// Largest data payload we accept in one frame.
    pub max_frame: u32,
    /// Most concurrent streams we accept from the peer.
    pub max_streams: u32,
    /// Bytes of a stream we buffer before its writer is told to wait.
    pub send_buffer: usize,
    /// Interval between pings when the link is quiet.
    pub keepalive: Duration,
    /// The link is declared dead after hearing nothing from the peer for this long.
    pub idle_timeout: Duration,
    /// Offer (listener) or use (connector) a second connection for latency-class streams.
    pub latency_lane: bool,
    /// Random token the listener hands out in its hello; a latency lane must present it.
    pub token: u64,
    /// The optimization codec: `None` sends and accepts stream bytes as they are.
    pub codec: Option<CodecSettings>,
    /// Disk tiers and saved cache states; `None` keeps caches in memory for the link's life.
    pub cache_storage: Option<Arc<dyn CacheStorage>>,
    /// How often a changed cache is checkpointed (with `cache_storage`).
    pub checkpoint_interval: Duration,
}

impl LinkConfig {
    /// Defaults suited to tests and small deployments; the daemon derives its own from config.
    pub fn new(site: &str, peer: &str, initiator: bool) -> Self {
        LinkConfig {
            site: site.to_string(),
            peer: peer.to_string(),
            initiator,
            stream_window: 4 << 20,
            link_window: 64 << 20,
            max_frame: 64 * 1024,
            max_streams: 4096,
            send_buffer: 256 * 1024,
            keepalive: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(30),
            latency_lane: true,
            token: 0,
            codec: None,
            cache_storage: None,
            checkpoint_interval: Duration::from_secs(60),
        }
    }
}

/// What the application learns from the link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The peer's hello arrived and matched: streams may be opened.
    Up { peer: Hello, version: u16 },
    /// The peer opened a stream to one of our services.
    Opened {
        stream: StreamId,
        class: Class,
        service: Arc<str>,
    },
    /// The peer asked for a service we do not have; it was refused.
    Refused { stream: StreamId, service: String },
    /// A stream has bytes (or its end) to read.
    Readable(StreamId),
    /// A stream that was full can take more bytes.
    Writable(StreamId),
    /// The peer reset a stream, or the link reset it for a protocol violation.
    Reset {
        stream: StreamId,
        code: ResetCode,
        reason: String,
    },
    /// A stream finished both ways and every byte was handed over; it is gone.
    Done(StreamId),
    /// The link is closed; every stream is gone.
    Closed(Option<LinkError>),
    /// Save this state of a cache: both sides reached it at the same point of a lane, so after
    /// a restart they can resume it (see [`CacheStorage`]). A decoder's state names chunks on its
    /// disk tier, which must be flushed before the state is written.
    Checkpoint {
        role: Role,
        lane: usize,
        scope: Arc<str>,
        state: Arc<Snapshot>,
    },
}

/// The result of reading a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadOutcome {
    /// The next bytes of the stream.
    Data(Bytes),
    /// Nothing to read yet; an [`Event::Readable`] follows when there is.
    Blocked,
    /// The peer finished sending and every byte was read.
    Fin,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Handshake,
    Open,
    /// We refuse new streams from the peer and open none; existing ones go on.
    Draining,
    /// A GoAway is queued or sent; nothing more is accepted.
    Closed,
}

#[derive(Debug)]
struct Stream {
    class: Class,
    /// The lane all of this stream's frames travel on (fixed at open, so they stay in order).
    lane: usize,
    service: Arc<str>,
    // Send side.
    send_queue: VecDeque<Bytes>,
    send_queued: usize,
    credit: SendCredit,
    fin_requested: bool,
    fin_sent: bool,
    write_blocked: bool,
    scheduled: bool,
    // Receive side.
    recv_queue: VecDeque<Bytes>,
    window: RecvWindow,
    fin_received: bool,
    read_done: bool,
    // Optimization, when the stream's service uses it.
    coder: Option<Box<SendCoder>>,
    coded_in: Option<Box<RecvCoded>>,
}

impl Stream {
    fn new(
        class: Class,
        lane: usize,
        service: Arc<str>,
        send_credit: u64,
        recv_window: u64,
    ) -> Self {
        Stream {
            class,
            lane,
            service,
            send_queue: VecDeque::new(),
            send_queued: 0,
            credit: SendCredit::new(send_credit),
            fin_requested: false,
            fin_sent: false,
            write_blocked: false,
            scheduled: false,
            recv_queue: VecDeque::new(),
            window: RecvWindow::new(recv_window),
            fin_received: false,
            read_done: false,
            coder: None,
            coded_in: None,
        }
    }

    /// True if the scheduler has something to send for this stream, ignoring link credit.
    /// An optimized stream's bytes wait for a chunk boundary (a whole chunk) or a flush, and
    /// for credit to cover its next chunk.
    fn wants_send(&self) -> bool {
        let fin_only = self.fin_requested && !self.fin_sent && self.send_queued == 0;
        match &self.coder {
            None => (self.send_queued > 0 && self.credit.available() > 0) || fin_only,
            Some(c) => {
                let ready = self.send_queued >= c.max_chunk || c.flush_at > self.credit.sent();
                (self.send_queued > 0 && ready && self.credit.available() >= self.min_credit())
                    || fin_only
            }
        }
    }

    /// Credit the next frame needs: any byte for a plain stream, its next chunk for a coded one.
    fn min_credit(&self) -> u64 {
        match &self.coder {
            None => 1,
            Some(c) => self.send_queued.min(c.max_chunk) as u64,
        }
    }

    /// True when the peer's end of the stream may be read: fin arrived and everything before it
    /// was rebuilt.
    fn fin_ready(&self) -> bool {
        self.fin_received && self.coded_in.as_ref().is_none_or(|c| c.is_empty())
    }

    fn readable(&self) -> bool {
        !self.recv_queue.is_empty() || self.fin_ready()
    }
}

/// Wire bytes (frame bytes before TLS) attributed to a service, each way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WireCount {
    /// Frame bytes sent to the peer.
    pub out: u64,
    /// Frame bytes received from the peer.
    pub inbound: u64,
}

/// One link to one peer, without I/O.
#[derive(Debug)]
pub struct Link {
    cfg: LinkConfig,
    state: State,
    services: HashSet<Arc<str>>,
    streams: HashMap<StreamId, Stream>,
    next_local: u32,
    /// Highest stream id the peer has opened on each lane (ids below it that are absent are closed).
    peer_max_id: [u32; LANES],
    peer_streams: u32,
    peer_max_streams: u32,
    peer_stream_window: u64,
    peer_max_frame: usize,
    link_credit: SendCredit,
    link_window: RecvWindow,
    ctrl: [VecDeque<Frame>; LANES],
    ready_latency: [VecDeque<StreamId>; LANES],
    ready_bulk: [VecDeque<StreamId>; LANES],
    events: VecDeque<Event>,
    inbuf: BytesMut,
    /// True once the latency lane is attached (both sides).
    lane_attached: bool,
    /// The peer's hello capabilities and token.
    peer_caps: u64,
    peer_token: u64,
    wire: HashMap<Arc<str>, WireCount>,
    link_wire_out: u64,
    link_wire_in: u64,
    last_heard: Option<Instant>,
    next_ping: Option<Instant>,
    ping_seq: u64,
    ping_sent: Option<(u64, Instant)>,
    rtt: Option<Duration>,
    close_error: Option<LinkError>,
    /// Codec caches, when the codec is configured.
    codecs: Option<Contexts>,
    policies: HashMap<Arc<str>, StreamPolicy>,
    pressure: Pressure,
    /// Chunk answers queued for the peer.
    answers: usize,
    next_checkpoint: Option<Instant>,
}

impl Link {
    /// A new link; its hello is queued as the first frame to transmit.
    pub fn new(cfg: LinkConfig) -> Self {
        let codecs = cfg
            .codec
            .clone()
            .map(|c| Contexts::new(c, cfg.cache_storage.clone()));
        let hello = Hello {
            caches: codecs.as_ref().map(Contexts::offers).unwrap_or_default(),
            version: VERSION,
            min_version: MIN_VERSION,
            site: cfg.site.clone(),
            capabilities: (if cfg.latency_lane {
                CAP_LATENCY_LANE
            } else {
                0
            }) | if cfg.codec.is_some() {
                CAP_CODEC | CAP_CONTEXT
            } else {
                0
            },
            settings: vec![
                (setting::STREAM_WINDOW, u64::from(cfg.stream_window)),
                (setting::LINK_WINDOW, cfg.link_window),
                (setting::MAX_FRAME, u64::from(cfg.max_frame)),
                (setting::MAX_STREAMS, u64::from(cfg.max_streams)),
                (setting::TOKEN, cfg.token),
                (
                    setting::CACHE_BYTES,
                    cfg.codec
                        .as_ref()
                        .map_or(0, |c| c.capacity(MAIN_LANE, true)),
                ),
                (
                    setting::SERVICE_CACHE_BYTES,
                    cfg.codec
                        .as_ref()
                        .map_or(0, |c| c.capacity(MAIN_LANE, false)),
                ),
            ],
        };
        let link_window = RecvWindow::new(cfg.link_window);
        Link {
            next_local: if cfg.initiator { 1 } else { 2 },
            state: State::Handshake,
            services: HashSet::new(),
            streams: HashMap::new(),
            peer_max_id: [0; LANES],
            peer_streams: 0,
            peer_max_streams: 0,
            peer_stream_window: 0,
            peer_max_frame: 16 * 1024,
            link_credit: SendCredit::new(0),
            link_window,
            ctrl: [VecDeque::from([Frame::Hello(hello)]), VecDeque::new()],
            ready_latency: Default::default(),
            ready_bulk: Default::default(),
            events: VecDeque::new(),
            inbuf: BytesMut::new(),
            lane_attached: false,
            peer_caps: 0,
            peer_token: 0,
            wire: HashMap::new(),
            link_wire_out: 0,
            link_wire_in: 0,
            last_heard: None,
            next_ping: None,
            ping_seq: 0,
            ping_sent: None,
            rtt: None,
            close_error: None,
            codecs,
            policies: HashMap::new(),
            pressure: Pressure::CpuBound,
            answers: 0,
            next_checkpoint: None,
            cfg,
        }
    }

    /// Sets how each service's streams are optimized on the way out (replaces the previous
    /// table). A service not in the table uses the default policy; one with neither compression
    /// nor dedup is sent as it is.
    pub fn set_policies<I: IntoIterator<Item = (S, StreamPolicy)>, S: AsRef<str>>(
        &mut self,
        policies: I,
    ) {
        self.policies = policies
            .into_iter()
            .map(|(s, p)| (Arc::from(s.as_ref()), p))
            .collect();
    }

    /// Tells the encoder what limits throughput now (the runtime watches its socket writes).
    pub fn set_pressure(&mut self, p: Pressure) {
        self.pressure = p;
    }

    /// The send side's codec state for a new stream, if its bytes are to be optimized.
    fn coder_for(&self, service: &str, class: Class) -> Option<Box<SendCoder>> {
        let ctx = self.codecs.as_ref()?;
        let chunking = ctx.chunking.as_ref()?;
        let p = self.policies.get(service).copied().unwrap_or_default();
        if p.compression == coding::Compression::None && !p.dedup {
            return None;
        }
        let mut c = SendCoder::new(&p, class == Class::Latency);
        c.max_chunk = chunking.max_chunk;
        c.policy.context = self.peer_caps & CAP_CONTEXT != 0;
        Some(Box::new(c))
    }

    /// Drains the per-service codec counts accumulated since the last call.
    pub fn take_codec_counts(&mut self) -> Vec<(Arc<str>, CodecCount)> {
        self.codecs
            .as_mut()
            .map(|c| c.counts.drain().collect())
            .unwrap_or_default()
    }

    /// Size and evictions of every chunk cache of the link.
    pub fn cache_stats(&self) -> Vec<CacheStat> {
        self.codecs
            .as_ref()
            .map(Contexts::cache_stats)
            .unwrap_or_default()
    }

    /// Test hook: damages every chunk our decoders hold; returns how many.
    #[doc(hidden)]
    pub fn corrupt_caches_for_test(&mut self) -> usize {
        self.codecs.as_mut().map_or(0, Contexts::corrupt_decoders)
    }

    /// Sets the service names the peer may open streams to (replaces the previous set).
    pub fn set_services<I: IntoIterator<Item = S>, S: AsRef<str>>(&mut self, names: I) {
        self.services = names.into_iter().map(|s| Arc::from(s.as_ref())).collect();
    }

    /// True once the peer's hello was accepted and until the link closes or drains.
    pub fn is_open(&self) -> bool {
        self.state == State::Open
    }

    /// True once the link is closed (after an error, a GoAway either way).
    pub fn is_closed(&self) -> bool {
        self.state == State::Closed
    }

    /// The error that closed the link, if it closed with one.
    pub fn close_error(&self) -> Option<&LinkError> {
        self.close_error.as_ref()
    }

    /// Number of streams still open in either direction.
    pub fn stream_count(&self) -> usize {
        self.streams.len()
    }

    /// Bytes held for streams: unsent plus received but unread. Zero when nothing leaked.
    pub fn buffered_bytes(&self) -> usize {
        self.streams
            .values()
            .map(|s| {
                s.send_queued
                    + s.recv_queue.iter().map(Bytes::len).sum::<usize>()
                    + s.coded_in.as_ref().map_or(0, |c| c.buffered())
            })
            .sum()
    }

    /// Bytes still queued to send on one stream.
    pub fn send_queued(&self, id: StreamId) -> usize {
        self.streams.get(&id).map_or(0, |s| s.send_queued)
    }

    /// Latest measured round-trip time of the link's pings.
    pub fn rtt(&self) -> Option<Duration> {
        self.rtt
    }

    /// Frame bytes sent and received on the whole link.
    pub fn link_wire(&self) -> (u64, u64) {
        (self.link_wire_out, self.link_wire_in)
    }

    /// Drains the per-service wire byte counts accumulated since the last call.
    pub fn take_wire_counts(&mut self) -> Vec<(Arc<str>, WireCount)> {
        self.wire
            .drain()
            .filter(|(_, c)| c.out != 0 || c.inbound != 0)
            .collect()
    }

    /// Next event for the application, if any.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Opens a stream to the peer's service `service`.
    pub fn open(&mut self, service: &str, class: Class) -> Result<StreamId, StreamError> {
        if self.state != State::Open {
            return Err(StreamError::LinkClosed);
        }
        let ours = self
            .streams
            .keys()
            .filter(|id| (id.0 % 2 == 1) == self.cfg.initiator)
            .count();
        if ours as u64 >= u64::from(self.peer_max_streams) {
            return Err(StreamError::TooMany);
        }
        let id = StreamId(self.next_local);
        self.next_local = self.next_local.checked_add(2).ok_or(StreamError::TooMany)?;
        let service: Arc<str> = Arc::from(service);
        let lane = if class == Class::Latency && self.lane_attached {
            LATENCY_LANE
        } else {
            MAIN_LANE
        };
        let mut s = Stream::new(
            class,
            lane,
            service.clone(),
            self.peer_stream_window,
            u64::from(self.cfg.stream_window),
        );
        s.coder = self.coder_for(&service, class);
        self.streams.insert(id, s);
        self.ctrl[lane].push_back(Frame::Open {
            stream: id,
            class,
            service: service.to_string(),
        });
        Ok(id)
    }

    /// Queues bytes on a stream; returns how many were taken (0 when its send buffer is full, and an
    /// [`Event::Writable`] follows when there is room).
    pub fn write(&mut self, id: StreamId, data: &[u8]) -> Result<usize, StreamError> {
        let n = self.room(id, data.len())?;
        if n > 0 {
            self.enqueue(id, Bytes::copy_from_slice(&data[..n]));
        }
        Ok(n)
    }

    /// Like [`write`](Self::write) but takes ownership of the bytes, avoiding a copy: takes the
    /// first `n` bytes (returned) and leaves the rest in `data`.
    pub fn write_bytes(&mut self, id: StreamId, data: &mut Bytes) -> Result<usize, StreamError> {
        let n = self.room(id, data.len())?;
        if n > 0 {
            let chunk = data.split_to(n);
            self.enqueue(id, chunk);
        }
        Ok(n)
    }

    /// How many of `want` bytes the stream's send buffer takes now; marks it blocked if none.
    fn room(&mut self, id: StreamId, want: usize) -> Result<usize, StreamError> {
        let cap = self.cfg.send_buffer;
        let s = self.stream_mut(id)?;
        if s.fin_requested {
            return Err(StreamError::Finished(id));
        }
        let n = cap.saturating_sub(s.send_queued).min(want);
        if n == 0 {
            s.write_blocked = want > 0;
        }
        Ok(n)
    }

    fn enqueue(&mut self, id: StreamId, chunk: Bytes) {
        if let Some(s) = self.streams.get_mut(&id) {
            s.send_queued += chunk.len();
            s.send_queue.push_back(chunk);
            // A latency stream never waits for a chunk boundary: what was written goes out.
            if s.class == Class::Latency
                && let Some(c) = s.coder.as_mut()
            {
                c.flush_at = s.credit.sent() + s.send_queued as u64;
            }
        }
        self.schedule(id);
    }

    /// Sends everything written so far without waiting for a chunk boundary (the runtime calls
    /// this when the application paused). Only optimized bulk streams ever wait; returns true if
    /// this one had bytes waiting (there may be frames to send now).
    pub fn flush(&mut self, id: StreamId) -> bool {
        if let Some(s) = self.streams.get_mut(&id)
            && let Some(c) = s.coder.as_mut()
        {
            let end = s.credit.sent() + s.send_queued as u64;
            if c.flush_at < end {
                c.flush_at = end;
                self.schedule(id);
                return true;
            }
        }
        false
    }

    /// Ends the stream's send side once queued bytes are sent (a TCP half-close).
    pub fn finish(&mut self, id: StreamId) -> Result<(), StreamError> {
        let s = self.stream_mut(id)?;
        if s.fin_requested {
            return Ok(());
        }
        s.fin_requested = true;
        if let Some(c) = s.coder.as_mut() {
            c.flush_at = s.credit.sent() + s.send_queued as u64;
        }
        self.schedule(id);
        Ok(())
    }

    /// Aborts a stream both ways and tells the peer why. Unknown streams are ignored.
    pub fn reset(&mut self, id: StreamId, code: ResetCode, reason: &str) {
        if let Some(s) = self.streams.remove(&id) {
            self.release_stream(id, &s);
            if self.state != State::Closed {
                self.ctrl[s.lane].push_back(Frame::Reset {
                    stream: id,
                    code,
                    reason: reason.to_string(),
                });
            }
        }
    }

    /// Takes the next received bytes of a stream, returning credit to the peer.
    pub fn read(&mut self, id: StreamId) -> Result<ReadOutcome, StreamError> {
        let s = self.streams.get_mut(&id).ok_or(StreamError::Unknown(id))?;
        if let Some(b) = s.recv_queue.pop_front() {
            let n = b.len() as u64;
            if let Some(max) = s.window.on_consume(n)
                && !s.fin_received
            {
                self.ctrl[s.lane].push_back(Frame::MaxData { stream: id, max });
            }
            if let Some(max) = self.link_window.on_consume(n) {
                self.ctrl[MAIN_LANE].push_back(Frame::MaxData {
                    stream: StreamId::LINK,
                    max,
                });
            }
            return Ok(ReadOutcome::Data(b));
        }
        if s.fin_ready() {
            s.read_done = true;
            self.maybe_remove(id);
            return Ok(ReadOutcome::Fin);
        }
        if self.state == State::Closed {
            return Err(StreamError::LinkClosed);
        }
        Ok(ReadOutcome::Blocked)
    }

    /// Stops accepting new streams either way; existing streams go on (graceful shutdown).
    pub fn drain(&mut self) {
        if self.state == State::Open || self.state == State::Handshake {
            self.state = State::Draining;
        }
    }

    /// Closes the link: a GoAway is queued and every stream is dropped.
    pub fn close(&mut self, code: CloseCode, reason: &str) {
        if self.state == State::Closed {
            return;
        }
        if self.cfg.cache_storage.is_some() && self.state != State::Handshake {
            // Both sides save where they are, so a restart resumes the caches from here.
            self.checkpoint();
        }
        self.ctrl[MAIN_LANE].push_back(Frame::GoAway {
            code,
            reason: reason.to_string(),
        });
        self.shut(None);
    }

    /// Records that the connection carrying the link failed: every stream is reset.
    pub fn connection_lost(&mut self, reason: &str) {
        if self.state != State::Closed {
            self.shut(Some(LinkError::Transport(reason.to_string())));
            for c in &mut self.ctrl {
                c.clear();
            }
        }
    }

    /// True while the stream exists (not yet finished both ways, reset or closed with the link).
    pub fn contains(&self, id: StreamId) -> bool {
        self.streams.contains_key(&id)
    }

    /// When [`handle_timeout`](Self::handle_timeout) wants to be called next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.state == State::Closed {
            return None;
        }
        let idle = self.last_heard.map(|t| t + self.cfg.idle_timeout);
        [idle, self.next_ping, self.next_checkpoint]
            .into_iter()
            .flatten()
            .min()
    }

    /// Queues a checkpoint of every cache that changed since its last one, on its lane.
    fn checkpoint(&mut self) {
        let Some(ctx) = self.codecs.as_ref() else {
            return;
        };
        for (lane, scope) in ctx.dirty_mirrors() {
            if lane == MAIN_LANE || self.lane_attached {
                self.ctrl[lane].push_back(Frame::Checkpoint {
                    scope: scope.to_string(),
                    digest: [0; 16],
                });
            }
        }
    }

    /// Sends keepalive pings and declares the link dead when the peer has been silent too long.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.state == State::Closed {
            return;
        }
        let last = *self.last_heard.get_or_insert(now);
        if now.saturating_duration_since(last) >= self.cfg.idle_timeout {
            self.fail(LinkError::Timeout);
            return;
        }
        let due = *self.next_ping.get_or_insert(now);
        if now >= due {
            self.ping_seq += 1;
            self.ctrl[MAIN_LANE].push_back(Frame::Ping {
                payload: self.ping_seq,
            });
            if self.ping_sent.is_none() {
                self.ping_sent = Some((self.ping_seq, now));
            }
            self.next_ping = Some(now + self.cfg.keepalive);
        }
        if self.cfg.cache_storage.is_some() && self.state != State::Handshake {
            let due = *self
                .next_checkpoint
                .get_or_insert(now + self.cfg.checkpoint_interval);
            if now >= due {
                self.checkpoint();
                self.next_checkpoint = Some(now + self.cfg.checkpoint_interval);
            }
        }
    }

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
        if lane >= LANES || (lane == LATENCY_LANE && !self.lane_attached) {
            return Err(self.fail(LinkError::Protocol(
                "input on a lane that is not attached".into(),
            )));
        }
        if self.state == State::Closed {
            buf.clear();
            return Ok(());
        }
        self.last_heard = Some(now);
        loop {
            let max = if self.state == State::Handshake {
                // Before the hello, only a hello-sized frame is acceptable (its cache offers
                // included).
                HELLO_MAX
            } else {
                self.cfg.max_frame + 8
            };
            let n = match frame::Frame::check(buf, max) {
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
            if let Err(e) = self.on_frame(f, n, now, lane) {
                return Err(self.fail(e));
            }
            if self.state == State::Closed {
                buf.clear();
                return Ok(());
            }
        }
    }

    /// Appends frames to `out` until it holds at least `limit` bytes or nothing is left to send.
    /// Control frames go first, then latency-class streams, then bulk streams round robin.
    /// Returns the number of bytes appended.
    pub fn poll_transmit(&mut self, out: &mut BytesMut, limit: usize) -> usize {
        self.poll_transmit_lane(MAIN_LANE, out, limit)
    }

    /// Like [`poll_transmit`](Self::poll_transmit) for one lane: its control frames, then its
    /// streams' data (latency first, then bulk).
    pub fn poll_transmit_lane(&mut self, lane: usize, out: &mut BytesMut, limit: usize) -> usize {
        let start = out.len();
        if lane >= LANES {
            return 0;
        }
        while let Some(mut f) = self.ctrl[lane].pop_front() {
            if let Frame::Checkpoint { scope, digest } = &mut f {
                // The mirror's state at this point of the lane is what the peer's cache will be
                // when it reads this frame.
                let Some(state) = self
                    .codecs
                    .as_mut()
                    .and_then(|c| c.checkpoint_mirror(lane, scope))
                else {
                    continue;
                };
                *digest = state.digest();
                self.events.push_back(Event::Checkpoint {
                    role: Role::Mirror,
                    lane,
                    scope: Arc::from(scope.as_str()),
                    state,
                });
            }
            let before = out.len();
            f.encode(out);
            // A service's wire bytes are its streams' Open, Data, Coded and Chunk frames, counted
            // alike each way.
            if let Frame::Open { stream, .. } | Frame::Chunk { stream, .. } = &f
                && let Some(s) = self.streams.get(stream)
            {
                self.wire.entry(s.service.clone()).or_default().out += (out.len() - before) as u64;
            }
            if matches!(f, Frame::Chunk { .. }) {
                self.answers = self.answers.saturating_sub(1);
            }
        }
        if self.state == State::Handshake || self.state == State::Closed {
            let n = out.len() - start;
            self.link_wire_out += n as u64;
            return n;
        }
        while out.len() < limit && self.link_credit.available() > 0 {
            let (queue_is_latency, id) = match self.ready_latency[lane].pop_front() {
                Some(id) => (true, id),
                None => match self.ready_bulk[lane].pop_front() {
                    Some(id) => (false, id),
                    None => break,
                },
            };
            // Optimized frames carry records, which cost CPU to make: a coded bulk stream's turn is
            // a whole frame, which also keeps framing overhead under a thousandth.
            let quantum =
                if queue_is_latency || self.streams.get(&id).is_some_and(|s| s.coder.is_some()) {
                    self.peer_max_frame
                } else {
                    BULK_QUANTUM.min(self.peer_max_frame)
                };
            let link_avail = self.link_credit.available();
            let Some(s) = self.streams.get_mut(&id) else {
                continue;
            };
            s.scheduled = false;
            if !s.wants_send() {
                continue;
            }
            let before = out.len();
            let (n, fin) = if let Some(coder) = s.coder.as_mut() {
                let need = s.send_queued.min(coder.max_chunk) as u64;
                if link_avail < need {
                    // Wait for link credit to cover the next chunk, keeping the stream's turn.
                    s.scheduled = true;
                    if queue_is_latency {
                        self.ready_latency[lane].push_front(id);
                    } else {
                        self.ready_bulk[lane].push_front(id);
                    }
                    break;
                }
                let Some(ctx) = self.codecs.as_mut() else {
                    continue;
                };
                let Some(chunking) = ctx.chunking.clone() else {
                    continue;
                };
                let scope: Arc<str> = if coder.scoped {
                    s.service.clone()
                } else {
                    Arc::from("")
                };
                let sent = s.credit.sent();
                let at = frame::begin_coded(out, id, sent);
                let lim = coding::Limits {
                    budget: (s.credit.available().min(link_avail) as usize).min(coding::RAW_TURN),
                    quantum,
                    room: self.peer_max_frame.saturating_sub(4),
                };
                let mut stats = coding::EncodeStats::default();
                let n = coding::emit(
                    coder,
                    &mut s.send_queue,
                    sent,
                    &chunking,
                    ctx.mirror(lane, &scope),
                    self.pressure,
                    &lim,
                    out,
                    &mut stats,
                );
                let fin = s.fin_requested && n == s.send_queued;
                if n == 0 && !fin {
                    // Nothing may go yet: the stream waits for a boundary, a flush or credit.
                    out.truncate(before);
                    continue;
                }
                frame::finish_coded(out, at, fin, coder.scoped, n as u32);
                ctx.counts
                    .entry(s.service.clone())
                    .or_default()
                    .sent
                    .merge(&stats);
                (n, fin)
            } else {
                let n = (s.send_queued as u64)
                    .min(s.credit.available())
                    .min(link_avail)
                    .min(quantum as u64) as usize;
                let fin = s.fin_requested && n == s.send_queued;
                frame::encode_data_header(out, id, s.credit.sent(), fin, n);
                let mut left = n;
                while left > 0 {
                    let Some(front) = s.send_queue.front_mut() else {
                        break;
                    };
                    let take = left.min(front.len());
                    out.extend_from_slice(&front[..take]);
                    front.advance(take);
                    if front.is_empty() {
                        s.send_queue.pop_front();
                    }
                    left -= take;
                }
                (n, fin)
            };
            s.send_queued -= n;
            s.credit.consume(n as u64);
            if fin {
                s.fin_sent = true;
            }
            let wire = (out.len() - before) as u64;
            self.wire.entry(s.service.clone()).or_default().out += wire;
            if s.write_blocked && s.send_queued < self.cfg.send_buffer {
                s.write_blocked = false;
                self.events.push_back(Event::Writable(id));
            }
            let again = s.wants_send();
            self.link_credit.consume(n as u64);
            if again {
                s.scheduled = true;
                if queue_is_latency {
                    self.ready_latency[lane].push_back(id);
                } else {
                    self.ready_bulk[lane].push_back(id);
                }
            }
            if fin {
                self.maybe_remove(id);
            }
        }
        let n = out.len() - start;
        self.link_wire_out += n as u64;
        n
    }

    /// True if some lane would produce bytes now.
    pub fn wants_transmit(&self) -> bool {
        (0..LANES).any(|l| self.wants_transmit_lane(l))
    }

    /// True if [`poll_transmit_lane`](Self::poll_transmit_lane) would produce bytes now.
    pub fn wants_transmit_lane(&self, lane: usize) -> bool {
        lane < LANES
            && (!self.ctrl[lane].is_empty()
                || (matches!(self.state, State::Open | State::Draining)
                    && self.link_credit.available() > 0
                    && (!self.ready_latency[lane].is_empty() || !self.ready_bulk[lane].is_empty())))
    }

    /// The connecting side: after the peer's hello, whether to open a latency lane, and the token
    /// to present on it.
    pub fn lane_offer(&self) -> Option<u64> {
        (self.cfg.initiator
            && self.cfg.latency_lane
            && self.state == State::Open
            && !self.lane_attached
            && self.peer_caps & CAP_LATENCY_LANE != 0)
            .then_some(self.peer_token)
    }

    /// The first frame to send on a new latency-lane connection (connecting side).
    pub fn lane_hello(&self, token: u64) -> Frame {
        Frame::Hello(Hello {
            version: VERSION,
            min_version: MIN_VERSION,
            site: self.cfg.site.clone(),
            capabilities: CAP_LATENCY_LANE,
            settings: vec![(setting::ATTACH, token)],
            caches: Vec::new(),
        })
    }

    /// Attaches the latency lane. The connecting side calls this once its lane connection is up;
    /// the listening side once a connection presented `token` (checked here against its own).
    /// Latency-class streams opened from now on use the lane.
    pub fn attach_lane(&mut self, token: u64) -> bool {
        let ok = self.state == State::Open
            && !self.lane_attached
            && self.cfg.latency_lane
            && if self.cfg.initiator {
                token == self.peer_token
            } else {
                token == self.cfg.token && self.peer_caps & CAP_LATENCY_LANE != 0
            };
        if ok {
            self.lane_attached = true;
        }
        ok
    }

    /// True while the latency lane is attached.
    pub fn lane_attached(&self) -> bool {
        self.lane_attached
    }

    fn stream_mut(&mut self, id: StreamId) -> Result<&mut Stream, StreamError> {
        if self.state == State::Closed {
            return Err(StreamError::LinkClosed);
        }
        self.streams.get_mut(&id).ok_or(StreamError::Unknown(id))
    }

    fn schedule(&mut self, id: StreamId) {
        if let Some(s) = self.streams.get_mut(&id)
            && !s.scheduled
            && s.wants_send()
        {
            s.scheduled = true;
            match s.class {
                Class::Latency => self.ready_latency[s.lane].push_back(id),
                Class::Bulk => self.ready_bulk[s.lane].push_back(id),
            }
        }
    }

    fn maybe_remove(&mut self, id: StreamId) {
        let done = self
            .streams
            .get(&id)
            .is_some_and(|s| s.fin_sent && s.read_done);
        if done && let Some(s) = self.streams.remove(&id) {
            self.release_stream(id, &s);
            self.events.push_back(Event::Done(id));
        }
    }

    /// Returns link credit held by a removed stream's unread bytes.
    fn release_stream(&mut self, id: StreamId, s: &Stream) {
        if (id.0 % 2 == 1) != self.cfg.initiator {
            self.peer_streams = self.peer_streams.saturating_sub(1);
        }
        let unread = s.window.buffered();
        if unread > 0
            && let Some(max) = self.link_window.on_consume(unread)
        {
            self.ctrl[MAIN_LANE].push_back(Frame::MaxData {
                stream: StreamId::LINK,
                max,
            });
        }
    }

    fn fail(&mut self, e: LinkError) -> LinkError {
        if self.state != State::Closed {
            if !matches!(e, LinkError::PeerClosed { .. }) {
                self.ctrl[MAIN_LANE].push_back(Frame::GoAway {
                    code: e.close_code(),
                    reason: e.to_string(),
                });
            }
            self.shut(Some(e.clone()));
        }
        e
    }

    fn shut(&mut self, err: Option<LinkError>) {
        self.state = State::Closed;
        for (id, _) in self.streams.drain() {
            self.events.push_back(Event::Reset {
                stream: id,
                code: ResetCode::Shutdown,
                reason: "link closed".to_string(),
            });
        }
        for l in 0..LANES {
            self.ready_bulk[l].clear();
            self.ready_latency[l].clear();
        }
        self.close_error = err.clone();
        self.events.push_back(Event::Closed(err));
    }

    fn is_peer_id(&self, id: StreamId) -> bool {
        (id.0 % 2 == 1) != self.cfg.initiator
    }

    /// True for an id that was in use once and is closed now: late frames for it are ignored.
    fn was_open(&self, id: StreamId) -> bool {
        if self.is_peer_id(id) {
            self.peer_max_id.iter().any(|m| id.0 <= *m)
        } else {
            id.0 < self.next_local
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
            } => self.on_data(stream, offset, fin, data, wire),
            Frame::Reset {
                stream,
                code,
                reason,
            } => {
                if let Some(s) = self.streams.remove(&stream) {
                    self.release_stream(stream, &s);
                    self.events.push_back(Event::Reset {
                        stream,
                        code,
                        reason,
                    });
                } else if !self.was_open(stream) {
                    return Err(LinkError::Protocol(format!(
                        "reset of unknown stream {stream}"
                    )));
                }
                Ok(())
            }
            Frame::MaxData { stream, max } => {
                if stream == StreamId::LINK {
                    self.link_credit.raise(max);
                } else if let Some(s) = self.streams.get_mut(&stream) {
                    if s.credit.raise(max) {
                        self.schedule(stream);
                    }
                } else if !self.was_open(stream) {
                    return Err(LinkError::Protocol(format!(
                        "credit for unknown stream {stream}"
                    )));
                }
                Ok(())
            }
            Frame::Ping { payload } => {
                self.ctrl[MAIN_LANE].push_back(Frame::Pong { payload });
                Ok(())
            }
            Frame::Pong { payload } => {
                if let Some((seq, at)) = self.ping_sent
                    && seq == payload
                {
                    self.rtt = Some(now.saturating_duration_since(at));
                    self.ping_sent = None;
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
            Frame::Need {
                stream,
                scope,
                fingerprint,
            } => {
                let Some(ctx) = self.codecs.as_ref() else {
                    return Err(LinkError::Protocol("chunk request without a codec".into()));
                };
                if self.answers >= MAX_ANSWERS {
                    return Err(LinkError::Protocol("too many chunk requests".into()));
                }
                let data = ctx.resend(lane, &scope)(&fingerprint).unwrap_or_default();
                if let Some(s) = self.streams.get(&stream)
                    && !data.is_empty()
                    && let Some(ctx) = self.codecs.as_mut()
                {
                    ctx.counts.entry(s.service.clone()).or_default().resent += 1;
                }
                self.answers += 1;
                self.ctrl[lane].push_back(Frame::Chunk {
                    stream,
                    scope,
                    fingerprint,
                    data,
                });
                Ok(())
            }
            Frame::Chunk {
                scope,
                fingerprint,
                data,
                ..
            } => self.on_chunk(lane, &scope, fingerprint, &data),
            Frame::Checkpoint { scope, digest } => {
                let Some(ctx) = self.codecs.as_mut() else {
                    return Err(LinkError::Protocol("checkpoint without a codec".into()));
                };
                // Saved only if our cache is exactly what the peer's mirror was (a stream
                // stalled on a miss, for one, leaves it behind).
                if let Some(state) = ctx.checkpoint_decoder(lane, &scope, &digest) {
                    self.events.push_back(Event::Checkpoint {
                        role: Role::Decoder,
                        lane,
                        scope: Arc::from(scope.as_str()),
                        state,
                    });
                }
                Ok(())
            }
        }
    }

    /// Optimized stream bytes: charged to credit by their raw length, then decoded in arrival
    /// order so our cache sees what the peer's mirror saw.
    #[allow(clippy::too_many_arguments)]
    fn on_coded(
        &mut self,
        id: StreamId,
        offset: u64,
        fin: bool,
        scoped: bool,
        raw_len: u32,
        records: Bytes,
        wire: usize,
        lane: usize,
    ) -> Result<(), LinkError> {
        if self.codecs.is_none() {
            return Err(LinkError::Protocol("coded frame without a codec".into()));
        }
        let n = u64::from(raw_len);
        let open = self.admit(id, offset, n, wire, |s| {
            (lane != s.lane).then(|| "data on the wrong lane".to_string())
        })?;
        let (Some(s), true) = (self.streams.get_mut(&id), open) else {
            // A stream we already closed: still decode what uses the shared cache, so it stays
            // in step with the peer's mirror.
            if !scoped && let Some(ctx) = self.codecs.as_mut() {
                let mut rc = RecvCoded::default();
                rc.push(records, raw_len, fin, false);
                let _ = ctx.decode(&mut rc, lane, &Arc::from(""));
            }
            return Ok(());
        };
        s.coded_in
            .get_or_insert_with(Box::default)
            .push(records, raw_len, fin, scoped);
        if fin {
            s.fin_received = true;
        }
        self.decode_stream(id);
        Ok(())
    }

    /// Decodes what a stream has waiting. A miss asks the peer for the chunk and stalls the
    /// stream; records that do not rebuild reset it. Never hands over a wrong byte.
    fn decode_stream(&mut self, id: StreamId) {
        let Some(s) = self.streams.get_mut(&id) else {
            return;
        };
        let before = !s.recv_queue.is_empty() || s.fin_ready();
        let (Some(rc), Some(ctx)) = (s.coded_in.as_mut(), self.codecs.as_mut()) else {
            return;
        };
        match ctx.decode(rc, s.lane, &s.service) {
            Ok(got) => {
                s.recv_queue.extend(got.data);
                if let Some((fingerprint, scoped)) = got.need {
                    ctx.counts.entry(s.service.clone()).or_default().needs += 1;
                    self.ctrl[s.lane].push_back(Frame::Need {
                        stream: id,
                        scope: if scoped {
                            s.service.to_string()
                        } else {
                            String::new()
                        },
                        fingerprint,
                    });
                }
                if !before && s.readable() {
                    self.events.push_back(Event::Readable(id));
                }
            }
            Err(why) => {
                let reason = format!("cannot rebuild stream data: {why}");
                self.reset(id, ResetCode::DataLost, &reason);
                self.events.push_back(Event::Reset {
                    stream: id,
                    code: ResetCode::DataLost,
                    reason,
                });
            }
        }
    }

    /// A chunk the peer re-sent after we asked: checked against its fingerprint, cached, and the
    /// streams waiting for it resume. An empty answer means the peer lost it: they fail.
    fn on_chunk(
        &mut self,
        lane: usize,
        scope: &str,
        fingerprint: coding::Fingerprint,
        data: &[u8],
    ) -> Result<(), LinkError> {
        let Some(ctx) = self.codecs.as_mut() else {
            return Err(LinkError::Protocol("chunk without a codec".into()));
        };
        let scope: Arc<str> = Arc::from(scope);
        // Only a cache we asked from: a peer's scope names never create caches (or directories).
        let ok = !data.is_empty()
            && ctx
                .existing_decoder(lane, &scope)
                .is_some_and(|d| d.insert_verified(fingerprint, data));
        if !data.is_empty() && !ok {
            return Err(LinkError::Protocol(
                "re-sent chunk does not match its fingerprint".into(),
            ));
        }
        let waiting: Vec<StreamId> = self
            .streams
            .iter_mut()
            .filter(|(_, s)| s.lane == lane)
            .filter_map(|(id, s)| {
                let rc = s.coded_in.as_mut()?;
                let (f, scoped) = rc.stall?;
                let same = f == fingerprint
                    && if scoped {
                        *s.service == *scope
                    } else {
                        scope.is_empty()
                    };
                if same {
                    rc.stall = None;
                }
                same.then_some(*id)
            })
            .collect();
        for id in waiting {
            if ok {
                self.decode_stream(id);
            } else {
                let reason = "a chunk was lost on both sides".to_string();
                self.reset(id, ResetCode::DataLost, &reason);
                self.events.push_back(Event::Reset {
                    stream: id,
                    code: ResetCode::DataLost,
                    reason,
                });
            }
        }
        Ok(())
    }

    fn on_hello(&mut self, h: Hello, now: Instant) -> Result<(), LinkError> {
        if h.version < MIN_VERSION || h.min_version > VERSION || h.min_version > h.version {
            return Err(LinkError::VersionMismatch {
                ours: VERSION,
                ours_min: MIN_VERSION,
                theirs: h.version,
                theirs_min: h.min_version,
            });
        }
        if h.site != self.cfg.peer {
            return Err(LinkError::WrongPeer {
                expected: self.cfg.peer.clone(),
                got: h.site.clone(),
            });
        }
        let get = |id: u16, default: u64| {
            h.settings
                .iter()
                .find(|(k, _)| *k == id)
                .map_or(default, |(_, v)| *v)
        };
        self.peer_stream_window = get(setting::STREAM_WINDOW, 256 * 1024);
        self.link_credit = SendCredit::new(get(setting::LINK_WINDOW, 1 << 20));
        self.peer_max_frame = get(setting::MAX_FRAME, 16 * 1024)
            .clamp(1024, u64::from(frame::MAX_PAYLOAD_HARD) - 8)
            as usize;
        self.peer_max_streams = get(setting::MAX_STREAMS, 100).min(u64::from(u32::MAX)) as u32;
        self.peer_token = get(setting::TOKEN, 0);
        self.peer_caps = h.capabilities;
        if h.capabilities & CAP_CODEC != 0
            && let Some(ctx) = self.codecs.as_mut()
        {
            ctx.on_peer(
                get(setting::CACHE_BYTES, 0),
                get(setting::SERVICE_CACHE_BYTES, 0),
                self.peer_max_frame,
                get(setting::LINK_WINDOW, 1 << 20),
                &h.caches,
            );
        }
        let version = h.version.min(VERSION);
        self.state = State::Open;
        self.next_ping = Some(now + self.cfg.keepalive);
        self.events.push_back(Event::Up { peer: h, version });
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
        // Ids rise on each lane; across lanes, opens may arrive in any order.
        if !self.is_peer_id(id) || id.0 <= self.peer_max_id[lane] || self.streams.contains_key(&id)
        {
            return Err(LinkError::Protocol(format!("bad stream id {id} in open")));
        }
        self.peer_max_id[lane] = id.0;
        let refuse = |link: &mut Link, code, reason: String| {
            link.ctrl[lane].push_back(Frame::Reset {
                stream: id,
                code,
                reason,
            });
        };
        if self.state != State::Open {
            refuse(self, ResetCode::Shutdown, "shutting down".into());
            return Ok(());
        }
        let Some(name) = self.services.get(service.as_str()).cloned() else {
            refuse(
                self,
                ResetCode::UnknownService,
                format!("no service named {service:?}"),
            );
            self.events.push_back(Event::Refused {
                stream: id,
                service,
            });
            return Ok(());
        };
        if self.peer_streams >= self.cfg.max_streams {
            refuse(self, ResetCode::Refused, "too many streams".into());
            return Ok(());
        }
        self.peer_streams += 1;
        self.wire.entry(name.clone()).or_default().inbound += wire as u64;
        let mut s = Stream::new(
            class,
            lane,
            name.clone(),
            self.peer_stream_window,
            u64::from(self.cfg.stream_window),
        );
        s.coder = self.coder_for(&name, class);
        self.streams.insert(id, s);
        self.events.push_back(Event::Opened {
            stream: id,
            class,
            service: name,
        });
        Ok(())
    }

    /// Charges `n` stream bytes at `offset` to the link and stream windows and checks their order
    /// (and `check`, for what only one frame kind requires). Returns false for a stream already
    /// closed: its bytes are dropped and their link credit given back.
    fn admit(
        &mut self,
        id: StreamId,
        offset: u64,
        n: u64,
        wire: usize,
        check: impl FnOnce(&Stream) -> Option<String>,
    ) -> Result<bool, LinkError> {
        self.link_window.on_receive(n).map_err(|e| {
            LinkError::Protocol(format!(
                "peer exceeded link credit ({} > {})",
                e.received, e.limit
            ))
        })?;
        let Some(s) = self.streams.get_mut(&id) else {
            if !self.was_open(id) {
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
        let violation = if s.fin_received {
            Some("data after fin".to_string())
        } else if offset != s.window.received() {
            Some(format!("offset {offset}, expected {}", s.window.received()))
        } else if let Some(why) = check(s) {
            Some(why)
        } else if let Err(e) = s.window.on_receive(n) {
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
    ) -> Result<(), LinkError> {
        let n = data.len() as u64;
        let open = self.admit(id, offset, n, wire, |s| {
            s.coded_in
                .as_ref()
                .is_some_and(|c| !c.is_empty())
                .then(|| "plain data while coded data waits".to_string())
        })?;
        let (Some(s), true) = (self.streams.get_mut(&id), open) else {
            return Ok(());
        };
        let was_empty = s.recv_queue.is_empty() && !s.fin_received;
        if !data.is_empty() {
            s.recv_queue.push_back(data);
        }
        if fin {
            s.fin_received = true;
        }
        if was_empty && (n > 0 || fin) {
            self.events.push_back(Event::Readable(id));
        }
        Ok(())
    }
}
