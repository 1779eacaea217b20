//! The link state machine: hello exchange, stream multiplexing, flow control and scheduling.
//!
//! A [`Link`] consumes the bytes read from the peer ([`Link::handle_input`]) and produces the bytes to
//! send ([`Link::poll_transmit`]); the application side writes and reads stream bytes and learns what
//! changed from [`Link::poll_event`]. Time comes in as `now` arguments; nothing here does I/O.
//! Frames in are handled in `input.rs`, frames out are scheduled in `transmit.rs`, the codec's frames
//! are wired to the streams in `coded.rs`, and each stream's halves live in `streams/`.

mod coded;
mod handover;
mod hello;
mod input;
mod lanes;
mod reading;
mod replay;
mod resume;
mod streams;
mod timer;
mod transmit;
pub use handover::{HANDOVER_VERSION, HandoverError, StreamState};
pub use transmit::coded_turn;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};

use crate::coding::{
    CacheStat, CacheStorage, CodecCount, CodecSettings, Coding, Pressure, Role, SavedCache,
    StateRequest, StreamPolicy,
};
use crate::error::{LinkError, StreamError};
use crate::flow::{RecvWindow, SendCredit};
use crate::frame::{Class, CloseCode, Frame, Hello, ResetCode, StreamId};
use crate::lane::{LANES, LATENCY_LANE, MAIN_LANE};
use wanopt_codec::cache::Snapshot;

use hello::PeerParams;
pub use hello::{HELLO_MAX, MIN_VERSION, VERSION};
pub use resume::ResumeStats;
pub use streams::{MAX_SHARE, Shaping};
use streams::{RecvHalf, SendHalf, Stream, Streams};
use timer::{Timer, TimerTable};

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
    /// Largest data payload we accept in one frame. A coded frame's records may reach it (a
    /// run of deltas, whose chunks could go as literals), but a turn ends after 64 KiB of
    /// records (see [`coded_turn`]).
    pub max_frame: u32,
    /// Most concurrent streams we accept from the peer.
    pub max_streams: u32,
    /// Of `max_streams`, how many bulk-class streams may not take: kept for latency services.
    pub latency_reserve: u32,
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
    /// Most connections that may carry the latency lane at once, each with a copy of its bytes
    /// (see [`crate::copies`]); 1 takes no copies.
    pub lane_copies: usize,
    /// Take pieces of the latency lane as UDP datagrams too (see [`crate::datagram`]); used
    /// only when both ends say so.
    pub lane_datagrams: bool,
    /// The optimization codec: `None` sends and accepts stream bytes as they are.
    pub codec: Option<CodecSettings>,
    /// Disk tiers and saved cache states; `None` keeps caches in memory for the link's life.
    pub cache_storage: Option<Arc<dyn CacheStorage>>,
    /// How often a changed cache is checkpointed (with `cache_storage`).
    pub checkpoint_interval: Duration,
    /// The cache states saved for this peer, as the runtime listed them (offered in our hello;
    /// used only with `cache_storage`).
    pub saved_states: Vec<SavedCache>,
    /// The store of what we sent, kept as delta bases, shared by the peer's successive links
    /// so a reconnect does not start it empty (the runtime keeps one per peer); `None`: the
    /// link makes one of `codec.delta_bytes`.
    pub delta_bases: Option<wanopt_codec::SharedBases>,
    /// Threads the mirrors prepare chunks on ahead of encoding them (see
    /// `wanopt_codec::prepare`); `None`: each chunk is prepared as it is encoded.
    pub workers: Option<Arc<dyn wanopt_codec::prepare::Workers>>,
    /// How long streams wait for a new connection after the link's was lost (zero: a lost
    /// connection resets every stream, and the hello does not offer resumption).
    pub resume_window: Duration,
    /// With a resume window: keep the main lane's bytes until the peer read them, and resume
    /// by sending again what a lost connection did not deliver, the codecs untouched
    /// (`CAP_REPLAY`, see `replay.rs`). Off, a link resumes as a build before it did, through
    /// the resume lists and a fresh codec (tests take that way as an older peer would).
    pub replay: bool,
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
            max_frame: 256 * 1024,
            max_streams: 4096,
            latency_reserve: 0,
            send_buffer: 512 * 1024,
            keepalive: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(30),
            latency_lane: true,
            token: 0,
            lane_copies: 1,
            lane_datagrams: false,
            codec: None,
            cache_storage: None,
            checkpoint_interval: Duration::from_secs(60),
            saved_states: Vec::new(),
            delta_bases: None,
            workers: None,
            resume_window: Duration::ZERO,
            replay: true,
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
    /// The peer asked for a service we do not have, or one at its stream limit; it was refused.
    Refused {
        stream: StreamId,
        service: String,
        why: Refusal,
    },
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
    /// Load these saved cache states (both sides agreed to resume them) and hand them over with
    /// [`Link::states_loaded`]. Until then the link reads no frame past the hello and sends no
    /// stream's bytes, so no cache is used before its state is in.
    LoadStates(Vec<StateRequest>),
    /// Save this state of a cache: both sides reached it at the same point of a lane, so after
    /// a restart they can resume it (see [`CacheStorage`]). A decoder's state names chunks on its
    /// disk tier, which must be flushed before the state is written.
    Checkpoint {
        role: Role,
        lane: usize,
        scope: Arc<str>,
        state: Arc<Snapshot>,
    },
    /// The connection was lost and the link waits for a new one (see [`Link::suspend`]); its
    /// streams stay.
    Suspended { reason: String },
    /// The streams went on over a new connection.
    Resumed(ResumeStats),
    /// This side was not run for this long while the peer was quiet (a host whose cores were
    /// busy, a stopped process): not counted as the peer's silence (see
    /// [`Link::peer_heard`]).
    Stalled(std::time::Duration),
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
    /// The connection was lost; streams wait for [`Link::reconnect`] within the resume window.
    Suspended,
}

/// Wire bytes (frame bytes before TLS) attributed to a service, each way, and how its shaping
/// (see [`Shaping`]) held it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WireCount {
    /// Frame bytes sent to the peer.
    pub out: u64,
    /// Frame bytes received from the peer.
    pub inbound: u64,
    /// Time it had bytes to send and waited for its `max_rate`.
    pub held: Duration,
    /// Time it had bytes to send and sent below its `min_rate`.
    pub below_min: Duration,
}

/// Keepalive pings and the round-trip time they measure.
#[derive(Debug, Default)]
struct Keepalive {
    seq: u64,
    /// The ping being timed: its payload and when it was queued.
    sent: Option<(u64, Instant)>,
    rtt: Option<Duration>,
}

/// Why a stream the peer opened was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// We have no such service.
    UnknownService,
    /// The service has as many streams from the peer as its limit allows.
    ServiceFull,
    /// Bulk streams from the peer reached `max_streams - latency_reserve`: the rest is kept for
    /// latency-class services.
    BulkFull,
    /// The peer has `max_streams` streams open.
    LinkFull,
}

impl Refusal {
    /// A short label for metrics.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::UnknownService => "unknown_service",
            Refusal::ServiceFull => "service_full",
            Refusal::BulkFull => "bulk_full",
            Refusal::LinkFull => "link_full",
        }
    }
}

/// What the peer may open on one of our services.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServiceLimit {
    /// Streams the peer may have open on it at once.
    pub max_streams: u32,
    /// Its class in our config (counted against the latency reserve by this, not by what the
    /// peer claims); `None` takes the class the peer announces.
    pub class: Option<Class>,
}

impl Default for ServiceLimit {
    fn default() -> Self {
        ServiceLimit {
            max_streams: u32::MAX,
            class: None,
        }
    }
}

/// One link to one peer, without I/O.
#[derive(Debug)]
pub struct Link {
    cfg: LinkConfig,
    state: State,
    /// Coded frames planned in this `poll_transmit` whose context records are being made
    /// (written before it returns; see `Coding::emit_frame`).
    pending: wanopt_codec::send::PendingTurns<crate::coding::PendingFrame>,
    /// Streams' frames fed to their contexts ahead of their turn on the workers, in the order
    /// they arrived (see `coded.rs`): every one is decoded before an input call returns, or,
    /// if the call ends inside a frame, once the rest comes (the `Fed` timer at the latest).
    feeds: wanopt_codec::Feeds<StreamId>,
    /// Frames whose literals alone were fed while their stream's earlier frames waited.
    fed_behind: u64,
    /// Frames fed behind their stream's earlier frame fed ahead (a test hook).
    fed_next: u64,
    services: HashMap<Arc<str>, ServiceLimit>,
    streams: Streams,
    /// What the peer's hello said (defaults until it arrives).
    peer: PeerParams,
    link_credit: SendCredit,
    link_window: RecvWindow,
    /// Control frames waiting, per lane; they go before any stream's data.
    ctrl: [VecDeque<Frame>; LANES],
    events: VecDeque<Event>,
    inbuf: BytesMut,
    /// True once the latency lane is attached (both sides).
    lane_attached: bool,
    wire: HashMap<Arc<str>, WireCount>,
    link_wire_out: u64,
    link_wire_in: u64,
    timers: TimerTable,
    keepalive: Keepalive,
    close_error: Option<LinkError>,
    /// The codec's caches and policies (inert without codec settings).
    coding: Coding,
    /// Waiting for the runtime to load the states to resume ([`Event::LoadStates`]).
    loading: bool,
    /// The peer's checkpoints that wait for a stalled stream of their lane (lane, scope,
    /// digest): at most one per cache we have.
    deferred_checkpoints: Vec<(usize, String, wanopt_codec::cache::Fingerprint)>,
    /// What the coded frames waiting on every stream cost (each stream's receive side keeps
    /// its part in step): checked against the stall backlog limit in one step.
    coded_backlog: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// Streams reset because a chunk they waited for did not come in time.
    stalls_expired: u64,
    /// Both sides resume streams after a lost connection (`CAP_RESUME` and a resume window).
    resumable: bool,
    /// Since the connection was lost, until the streams are resumed or given up.
    outage: Option<resume::Outage>,
    /// On a new connection, until the peer's resume list settled every stream: no stream
    /// sends meanwhile.
    resuming: Option<Box<resume::Resuming>>,
    /// Streams that finished cleanly lately (see [`resume::DONE_KEPT`]).
    done_ids: VecDeque<StreamId>,
    /// When the peer was last heard from (input on any lane).
    heard: Option<Instant>,
    /// When the silence was last looked at (see [`resume::SELF_STALL`]).
    silence_checked: Option<Instant>,
    /// The listener's tokens that resume the link (see [`Link::resumes`]).
    resume_tokens: Vec<u64>,
    /// Stream bytes sent and received per lane since the last resumption (a lane lost alone
    /// gives what it lost in flight back to link credit from these).
    lane_sent: [u64; LANES],
    lane_received: [u64; LANES],
    /// The latency lane was lost alone: its streams wait for the peer's list on the new lane.
    lane_resuming: Option<Box<resume::Resuming>>,
    /// The main lane's bytes kept and counted to resume by sending them again (see `replay`).
    replay: replay::Replay,
}

/// How often stalled streams are checked against the stall timeout (the link's idle timeout).
const STALL_SWEEP: Duration = Duration::from_secs(1);
/// Control frames queued (both lanes) beyond which input waits: pongs, resets and window
/// updates a peer causes but does not read cannot pile up.
pub const MAX_QUEUED_CONTROL: usize = 16 * 1024;

impl Link {
    /// A new link; its hello is queued as the first frame to transmit.
    pub fn new(cfg: LinkConfig) -> Self {
        let mut coding = Coding::new(
            cfg.codec.clone(),
            cfg.cache_storage.clone(),
            cfg.saved_states.clone(),
        );
        coding.set_bases(cfg.delta_bases.clone());
        coding.set_workers(cfg.workers.clone());
        let hello = hello::ours(&cfg, coding.offers(), Vec::new());
        Link {
            pending: Default::default(),
            feeds: Default::default(),
            fed_behind: 0,
            fed_next: 0,
            state: State::Handshake,
            services: HashMap::new(),
            streams: Streams::new(cfg.initiator),
            peer: PeerParams {
                max_frame: 16 * 1024,
                ..PeerParams::default()
            },
            link_credit: SendCredit::new(0),
            link_window: RecvWindow::new(cfg.link_window),
            ctrl: [VecDeque::from([Frame::Hello(hello)]), VecDeque::new()],
            events: VecDeque::new(),
            inbuf: BytesMut::new(),
            stalls_expired: 0,
            lane_attached: false,
            wire: HashMap::new(),
            link_wire_out: 0,
            link_wire_in: 0,
            timers: TimerTable::default(),
            keepalive: Keepalive::default(),
            close_error: None,
            coding,
            loading: false,
            deferred_checkpoints: Vec::new(),
            coded_backlog: Default::default(),
            resumable: false,
            outage: None,
            resuming: None,
            done_ids: VecDeque::new(),
            heard: None,
            silence_checked: None,
            resume_tokens: vec![cfg.token],
            lane_sent: [0; LANES],
            lane_received: [0; LANES],
            lane_resuming: None,
            replay: Default::default(),
            cfg,
        }
    }

    /// Sets how each service's streams are optimized on the way out (replaces the previous
    /// table). A service not in the table uses the default policy; one with neither compression
    /// nor dedup is sent as it is. Scopes are agreed in the hellos: a scope set after ours went
    /// out takes effect on the next link.
    pub fn set_policies<I: IntoIterator<Item = (S, StreamPolicy)>, S: AsRef<str>>(
        &mut self,
        policies: I,
    ) {
        self.coding.set_policies(
            policies
                .into_iter()
                .map(|(s, p)| (Arc::from(s.as_ref()), p))
                .collect(),
        );
        // Scopes are agreed in the hellos: our hello, while not yet sent, names ours.
        let scoped = self.coding.own_scoped();
        if let Some(Frame::Hello(h)) = self.ctrl[MAIN_LANE].front_mut() {
            h.scoped = scoped;
        }
    }

    /// Tells the encoder what limits throughput now (the runtime watches its socket writes).
    pub fn set_pressure(&mut self, p: Pressure) {
        self.coding.set_pressure(p);
    }

    /// Sets the zstd level of what is compressed from now on (the runtime's governor moves it
    /// so that compression keeps ahead of the link). The peer needs to know nothing.
    pub fn set_zstd_level(&mut self, level: i32) {
        self.coding.set_zstd_level(level);
    }

    /// Drains the per-service codec counts accumulated since the last call.
    pub fn take_codec_counts(&mut self) -> Vec<(Arc<str>, CodecCount)> {
        self.coding.take_counts()
    }

    /// True while so many control frames wait to be sent ([`MAX_QUEUED_CONTROL`]) that input
    /// is not taken: the runtime stops reading until the writer has sent them, and what arrived
    /// waits in its buffer.
    pub fn replies_backed_up(&self) -> bool {
        self.ctrl.iter().map(VecDeque::len).sum::<usize>() >= MAX_QUEUED_CONTROL
    }

    /// Streams reset so far because a chunk they waited for did not arrive within the link's
    /// idle timeout.
    pub fn stalls_expired(&self) -> u64 {
        self.stalls_expired
    }

    /// Size and evictions of every chunk cache of the link.
    pub fn cache_stats(&self) -> Vec<CacheStat> {
        self.coding.cache_stats()
    }

    /// Test hook: the digests of the link's caches by role ("mirror", "decoder"), lane and
    /// scope. A side's mirror digest equals the peer's decoder's of the same lane and scope
    /// while they are in step (the same chunks, in the same order).
    #[doc(hidden)]
    pub fn cache_digests_for_test(&self) -> Vec<(&'static str, usize, Arc<str>, [u8; 16])> {
        self.coding.cache_digests()
    }

    /// Test hook: frames whose literals alone were fed while their stream's earlier frames
    /// waited, and literals our decoders took as fed ahead.
    #[doc(hidden)]
    pub fn fed_ahead_for_test(&self) -> (u64, u64) {
        (self.fed_behind, self.coding.lits_ahead())
    }

    /// Test hook: frames fed behind their stream's earlier frame fed ahead (taking its
    /// context on from it).
    #[doc(hidden)]
    pub fn fed_next_for_test(&self) -> u64 {
        self.fed_next
    }

    /// Test hook: frames fed ahead waiting for their turn.
    #[doc(hidden)]
    pub fn fed_waiting_for_test(&self) -> usize {
        self.feeds.len()
    }

    /// Test hook: damages every chunk our decoders hold; returns how many.
    #[doc(hidden)]
    pub fn corrupt_caches_for_test(&mut self) -> usize {
        self.coding.corrupt_decoders()
    }

    /// Sets the service names the peer may open streams to (replaces the previous set), with no
    /// limit of their own.
    pub fn set_services<I: IntoIterator<Item = S>, S: AsRef<str>>(&mut self, names: I) {
        self.set_service_limits(names.into_iter().map(|n| (n, ServiceLimit::default())));
    }

    /// Sets the services the peer may open streams to, each with its limit (replaces the
    /// previous set; streams already open stay).
    pub fn set_service_limits<I, S>(&mut self, services: I)
    where
        I: IntoIterator<Item = (S, ServiceLimit)>,
        S: AsRef<str>,
    {
        self.services = services
            .into_iter()
            .map(|(n, l)| (Arc::from(n.as_ref()), l))
            .collect();
    }

    /// True once the peer's hello was accepted and until the link closes or drains.
    pub fn is_open(&self) -> bool {
        self.state == State::Open
    }

    /// True while the link waits for the states of [`Event::LoadStates`]: it reads no frame
    /// past the hello (they stay in the caller's buffer) and sends no stream's bytes.
    pub fn is_loading(&self) -> bool {
        self.loading
    }

    /// The states asked for by [`Event::LoadStates`], as loaded (`None`: missing or damaged, so
    /// that cache starts empty). The link goes on: the caller feeds it the bytes it kept, with
    /// [`handle_lane_input`](Self::handle_lane_input) on each lane's buffer.
    pub fn states_loaded(&mut self, states: Vec<(StateRequest, Option<Snapshot>)>) {
        self.coding.states_loaded(states);
        self.loading = false;
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
        self.streams.map.len()
    }

    /// Bytes held for streams: unsent plus received but unread. Zero when nothing leaked.
    pub fn buffered_bytes(&self) -> usize {
        self.streams.buffered()
    }

    /// What the coded frames waiting to be decoded on every stream are charged (the stall
    /// backlog's measure): zero once nothing waits.
    pub fn coded_backlog(&self) -> usize {
        self.coded_backlog
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Bytes kept to send again should the connection be lost (resumable links only): written
    /// and not yet confirmed by the peer, sent or not (buffers shared with the send queues).
    pub fn kept_bytes(&self) -> usize {
        self.streams
            .map
            .values()
            .filter_map(|s| s.send.kept.as_ref())
            .map(|k| k.len)
            .sum()
    }

    /// Bytes still queued to send on one stream.
    pub fn send_queued(&self, id: StreamId) -> usize {
        self.streams.get(&id).map_or(0, |s| s.send.queued)
    }

    /// Latest measured round-trip time of the link's pings.
    pub fn rtt(&self) -> Option<Duration> {
        self.keepalive.rtt
    }

    /// Frame bytes sent and received on the whole link.
    pub fn link_wire(&self) -> (u64, u64) {
        (self.link_wire_out, self.link_wire_in)
    }

    /// Drains the per-service wire byte counts (and shaping times) accumulated since the last
    /// call.
    pub fn take_wire_counts(&mut self) -> Vec<(Arc<str>, WireCount)> {
        for (svc, c) in self.streams.shaper.take_counts() {
            let w = self.wire.entry(svc).or_default();
            w.held += c.held;
            w.below_min += c.below_min;
        }
        self.wire
            .drain()
            .filter(|(_, c)| *c != WireCount::default())
            .collect()
    }

    /// Sets how bulk services share what this side sends (a service not named: share 1, no
    /// rates). Streams keep their place; the new settings apply from the next turn.
    pub fn set_shaping<I: IntoIterator<Item = (S, Shaping)>, S: AsRef<str>>(&mut self, shaping: I) {
        self.streams.shaper.set(
            shaping
                .into_iter()
                .map(|(s, p)| (Arc::from(s.as_ref()), p))
                .collect(),
        );
    }

    /// Next event for the application, if any.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Moves this side's stream ids on as if `opens` streams had been opened and closed
    /// since: what a link that resumes for weeks reaches (ids wrap after 2^31 opens), for tests.
    #[doc(hidden)]
    pub fn skip_stream_ids(&mut self, opens: u64) {
        self.streams.skip(opens);
    }

    /// Opens a stream to the peer's service `service`.
    pub fn open(&mut self, service: &str, class: Class) -> Result<StreamId, StreamError> {
        if self.state != State::Open {
            return Err(StreamError::LinkClosed);
        }
        if self.streams.ours() as u64 >= u64::from(self.peer.max_streams) {
            return Err(StreamError::TooMany);
        }
        let (id, number) = self.streams.next_id().ok_or(StreamError::TooMany)?;
        let service: Arc<str> = Arc::from(service);
        let lane = if class == Class::Latency && self.lane_attached {
            LATENCY_LANE
        } else {
            MAIN_LANE
        };
        self.streams.opened(lane, number);
        self.insert_stream((id, number), class, lane, service.clone());
        self.ctrl[lane].push_back(Frame::Open {
            stream: id,
            class,
            service: service.to_string(),
        });
        Ok(id)
    }

    fn insert_stream(
        &mut self,
        (id, number): (StreamId, u64),
        class: Class,
        lane: usize,
        service: Arc<str>,
    ) {
        let coder = self.coding.coder_for(&service, class, self.cfg.send_buffer);
        let s = Stream {
            class,
            lane,
            service,
            number,
            send: SendHalf {
                kept: self.kept_for_new_stream(),
                ..SendHalf::new(self.peer.stream_window, coder)
            },
            recv: RecvHalf::new(u64::from(self.cfg.stream_window)),
            scheduled: false,
        };
        self.streams.map.insert(id, s);
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
        self.stream_mut(id)?.send.room(id, cap, want)
    }

    fn enqueue(&mut self, id: StreamId, chunk: Bytes) {
        if let Some(s) = self.streams.get_mut(&id) {
            s.send.push(chunk, s.class == Class::Latency);
        }
        self.streams.schedule(id);
    }

    /// Sends everything written so far without waiting for a chunk boundary (the runtime calls
    /// this when the application paused). Only optimized bulk streams ever wait; returns true if
    /// this one had bytes waiting (there may be frames to send now).
    pub fn flush(&mut self, id: StreamId) -> bool {
        let moved = self
            .streams
            .get_mut(&id)
            .is_some_and(|s| s.send.flush_all());
        if moved {
            self.streams.schedule(id);
        }
        moved
    }

    /// True if stream `id` is an optimized bulk stream: its bytes gather into frames of a turn
    /// each (see [`wanopt_codec::send::gather`]), so the runtime may wait a little for more
    /// before it flushes a paused client's last bytes.
    pub fn gathers(&self, id: StreamId) -> bool {
        self.streams
            .get(&id)
            .is_some_and(|s| s.class == Class::Bulk && s.send.coder.is_some())
    }

    /// Ends the stream's send side once queued bytes are sent (a TCP half-close).
    pub fn finish(&mut self, id: StreamId) -> Result<(), StreamError> {
        if self.stream_mut(id)?.send.finish() {
            self.streams.schedule(id);
        }
        Ok(())
    }

    /// Aborts a stream both ways and tells the peer why. Unknown streams are ignored.
    pub fn reset(&mut self, id: StreamId, code: ResetCode, reason: &str) {
        if let Some(s) = self.remove_stream(id)
            && self.state != State::Closed
        {
            self.ctrl[s.lane].push_back(Frame::Reset {
                stream: id,
                code,
                reason: reason.to_string(),
            });
        }
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
        self.streams.map.contains_key(&id)
    }

    /// When [`handle_timeout`](Self::handle_timeout) wants to be called next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.state == State::Closed {
            return None;
        }
        // A bulk service waiting for its ceiling sends again when its bucket refills.
        let shaped = self
            .streams_may_send_on(MAIN_LANE)
            .then(|| self.streams.shaper.wake())
            .flatten();
        self.timers.next().into_iter().chain(shaped).min()
    }

    /// Runs the timers due at `now`: the idle timeout fails the link, a keepalive ping is sent,
    /// changed caches are checkpointed.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.state == State::Closed || self.resume_expired(now) {
            return;
        }
        // Frames fed ahead that waited for the rest of a frame being read: decoded now.
        if self.timers.expired(Timer::Fed, now) {
            self.decode_fed();
        }
        self.streams.shaper.advance(now);
        if self.state == State::Suspended {
            return;
        }
        self.lane_expired(now);
        // A link that has heard nothing yet starts its idle clock at the first call.
        self.timers
            .get_or_set(Timer::Idle, now + self.cfg.idle_timeout);
        if self.timers.expired(Timer::Idle, now) {
            self.fail(LinkError::Timeout);
            return;
        }
        if self.check_silence(now) {
            return;
        }
        self.timers.get_or_set(Timer::Ping, now);
        if self.timers.expired(Timer::Ping, now) {
            let k = &mut self.keepalive;
            k.seq += 1;
            self.ctrl[MAIN_LANE].push_back(Frame::Ping { payload: k.seq });
            if k.sent.is_none() {
                k.sent = Some((k.seq, now));
            }
            self.tell_received();
            self.timers.set(Timer::Ping, now + self.cfg.keepalive);
        }
        self.timers.get_or_set(Timer::Stalls, now + STALL_SWEEP);
        if self.timers.expired(Timer::Stalls, now) {
            self.sweep_stalls(now);
            // A wake-up from the store that went to another link's waiter: not lost for long.
            self.resume_senders();
            self.timers.set(Timer::Stalls, now + STALL_SWEEP);
        }
        if self.cfg.cache_storage.is_some() && self.state != State::Handshake {
            let every = self.cfg.checkpoint_interval;
            self.timers.get_or_set(Timer::Checkpoint, now + every);
            if self.timers.expired(Timer::Checkpoint, now) {
                self.checkpoint();
                self.timers.set(Timer::Checkpoint, now + every);
            }
        }
    }

    /// Queues a checkpoint of every cache that changed since its last one, on its lane.
    fn checkpoint(&mut self) {
        for (lane, scope) in self.coding.dirty_mirrors() {
            if lane == MAIN_LANE || self.lane_attached {
                self.ctrl[lane].push_back(Frame::Checkpoint {
                    scope: scope.to_string(),
                    digest: [0; 16],
                });
            }
        }
    }

    fn stream_mut(&mut self, id: StreamId) -> Result<&mut Stream, StreamError> {
        if self.state == State::Closed {
            return Err(StreamError::LinkClosed);
        }
        self.streams.get_mut(&id).ok_or(StreamError::Unknown(id))
    }

    /// Removes a stream that finished both ways.
    fn maybe_remove(&mut self, id: StreamId) {
        if self.streams.get(&id).is_some_and(Stream::done) && self.remove_stream(id).is_some() {
            self.remember_done(id);
            self.events.push_back(Event::Done(id));
        }
    }

    /// Removes a stream and returns the link credit its unread bytes held.
    fn remove_stream(&mut self, id: StreamId) -> Option<Stream> {
        let s = self.streams.remove(id)?;
        let unread = s.recv.window.buffered();
        if unread > 0
            && let Some(max) = self.link_window.on_consume(unread)
        {
            self.ctrl[MAIN_LANE].push_back(Frame::MaxData {
                stream: StreamId::LINK,
                max,
            });
        }
        Some(s)
    }

    /// Resets a stream whose data cannot be delivered, telling both the peer and the application.
    fn fail_stream(&mut self, id: StreamId, code: ResetCode, reason: String) {
        self.reset(id, code, &reason);
        self.events.push_back(Event::Reset {
            stream: id,
            code,
            reason,
        });
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
        self.timers.stop_all();
        // Nothing is sent again on a closed link (the codec set aside for it goes too).
        self.replay = Default::default();
        for id in self.streams.clear() {
            self.events.push_back(Event::Reset {
                stream: id,
                code: ResetCode::Shutdown,
                reason: "link closed".to_string(),
            });
        }
        self.close_error = err.clone();
        self.events.push_back(Event::Closed(err));
    }
}
