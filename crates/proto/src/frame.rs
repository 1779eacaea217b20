//! Wire frames of the link protocol, typed by kind, with a check-then-parse read path.
//!
//! Every frame is a 10-byte header (kind, flags, stream id, payload length) and a payload whose length
//! is capped before anything is allocated. [`Frame::check`] answers `Incomplete` until a whole frame
//! is buffered; [`Frame::parse`] then decodes it without copying data payloads.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::error::FrameError;

/// Bytes in a frame header: kind (1), flags (1), stream id (4), payload length (4).
pub const HEADER_LEN: usize = 10;

/// The largest payload a decoder accepts at all, whatever the negotiated settings.
pub const MAX_PAYLOAD_HARD: u32 = 1 << 20;

/// Longest service name, site name or reason text carried in a frame.
pub const MAX_NAME_LEN: usize = 255;

/// Stream identifier. Zero means "the link itself" (link-level credit, control frames).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(pub u32);

impl StreamId {
    /// The link-level pseudo stream.
    pub const LINK: StreamId = StreamId(0);
}

impl std::fmt::Display for StreamId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Service class of a stream: decides how the scheduler orders its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Class {
    /// Small synchronous messages (Data Guard SYNC): always sent before bulk data.
    Latency,
    /// Throughput traffic (RMAN, pumps): shares what is left, round robin.
    Bulk,
}

impl Class {
    fn to_u8(self) -> u8 {
        match self {
            Class::Latency => 0,
            Class::Bulk => 1,
        }
    }
    fn from_u8(v: u8) -> Result<Self, FrameError> {
        match v {
            0 => Ok(Class::Latency),
            1 => Ok(Class::Bulk),
            _ => Err(FrameError::Malformed("unknown service class")),
        }
    }
}

impl std::fmt::Display for Class {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Class::Latency => "latency",
            Class::Bulk => "bulk",
        })
    }
}

impl std::str::FromStr for Class {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "latency" => Ok(Class::Latency),
            "bulk" => Ok(Class::Bulk),
            _ => Err(format!("{s:?} is not latency or bulk")),
        }
    }
}

/// Why a stream was reset; carried on the wire as a u16.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ResetCode {
    /// The service name is not configured on the accepting side.
    UnknownService,
    /// The accepting side could not connect to its target.
    TargetRefused,
    /// A local socket failed or was reset.
    SocketError,
    /// The peer broke flow control or sent a frame out of order on this stream.
    ProtocolViolation,
    /// The daemon is shutting down or the service was removed.
    Shutdown,
    /// Too many streams.
    Refused,
    /// Stream bytes could not be rebuilt (a chunk the peer no longer holds, or bad records).
    DataLost,
    /// The link's connection was lost and the stream could not be resumed on the next one.
    LinkLost,
    /// A code this version does not know.
    Other(u16),
}

impl ResetCode {
    fn to_u16(self) -> u16 {
        match self {
            ResetCode::UnknownService => 1,
            ResetCode::TargetRefused => 2,
            ResetCode::SocketError => 3,
            ResetCode::ProtocolViolation => 4,
            ResetCode::Shutdown => 5,
            ResetCode::Refused => 6,
            ResetCode::DataLost => 7,
            ResetCode::LinkLost => 8,
            ResetCode::Other(v) => v,
        }
    }
    fn from_u16(v: u16) -> Self {
        match v {
            1 => ResetCode::UnknownService,
            2 => ResetCode::TargetRefused,
            3 => ResetCode::SocketError,
            4 => ResetCode::ProtocolViolation,
            5 => ResetCode::Shutdown,
            6 => ResetCode::Refused,
            7 => ResetCode::DataLost,
            8 => ResetCode::LinkLost,
            v => ResetCode::Other(v),
        }
    }

    /// A short lowercase label, used in logs and metric labels.
    pub fn label(self) -> &'static str {
        match self {
            ResetCode::UnknownService => "unknown_service",
            ResetCode::TargetRefused => "target_refused",
            ResetCode::SocketError => "socket_error",
            ResetCode::ProtocolViolation => "protocol_violation",
            ResetCode::Shutdown => "shutdown",
            ResetCode::Refused => "refused",
            ResetCode::DataLost => "data_lost",
            ResetCode::LinkLost => "link_lost",
            ResetCode::Other(_) => "other",
        }
    }
}

/// Why a link is being closed; carried in `GoAway`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CloseCode {
    /// Orderly shutdown: no new streams, existing ones were drained.
    Normal,
    /// The peers speak incompatible protocol versions.
    VersionMismatch,
    /// The peer broke the protocol (bad frame, flow control violation).
    ProtocolError,
    /// The peer's site name is not the configured one.
    WrongPeer,
    /// A newer link replaced this one.
    Replaced,
    /// A code this version does not know.
    Other(u16),
}

impl CloseCode {
    fn to_u16(self) -> u16 {
        match self {
            CloseCode::Normal => 0,
            CloseCode::VersionMismatch => 1,
            CloseCode::ProtocolError => 2,
            CloseCode::WrongPeer => 3,
            CloseCode::Replaced => 4,
            CloseCode::Other(v) => v,
        }
    }
    fn from_u16(v: u16) -> Self {
        match v {
            0 => CloseCode::Normal,
            1 => CloseCode::VersionMismatch,
            2 => CloseCode::ProtocolError,
            3 => CloseCode::WrongPeer,
            4 => CloseCode::Replaced,
            v => CloseCode::Other(v),
        }
    }
}

/// The first frame each side sends after TLS: who it is and what it can do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// Highest protocol version the sender speaks.
    pub version: u16,
    /// Lowest protocol version the sender still speaks.
    pub min_version: u16,
    /// The sender's site name (must match its certificate and the receiver's configured peer).
    pub site: String,
    /// Capability bits; unknown bits are ignored.
    pub capabilities: u64,
    /// Settings as (id, value) pairs; unknown ids are ignored, so later versions can add some.
    pub settings: Vec<(u16, u64)>,
    /// Saved chunk-cache states the sender can resume, so a restart keeps its dedup.
    pub caches: Vec<CacheOffer>,
    /// Services whose bytes the sender wants in caches of their own (`dedup_scope: service`).
    /// Both directions of a service use its own cache if either side names it. Optional on
    /// the wire: a hello that ends after its offers names none.
    pub scoped: Vec<String>,
}

/// Saved states of one chunk cache that a side can resume: both sides resume the newest state
/// that the receiving side offers and the sending side also has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheOffer {
    /// True for the receiving side's cache (its decoder), false for the sending side's mirror.
    pub decoder: bool,
    /// The lane whose frames feed the cache.
    pub lane: u8,
    /// Empty for the link's shared cache, else the service name.
    pub scope: String,
    /// Digests of the saved states, newest first.
    pub digests: Vec<[u8; 16]>,
}

/// Most cache offers a hello may carry, and most saved states per offer.
pub const MAX_OFFERS: usize = 512;
pub const MAX_DIGESTS: usize = 8;
/// Most service names a hello's scoped list may carry.
pub const MAX_SCOPED: usize = 128;

/// Setting ids carried in [`Hello::settings`].
pub mod setting {
    /// Initial per-stream receive window the sender grants, in bytes.
    pub const STREAM_WINDOW: u16 = 1;
    /// Initial link-level receive window the sender grants, in bytes.
    pub const LINK_WINDOW: u16 = 2;
    /// Largest data payload the sender accepts in one frame.
    pub const MAX_FRAME: u16 = 3;
    /// Most concurrent streams the sender accepts from its peer.
    pub const MAX_STREAMS: u16 = 4;
    /// The listener's random link token (a latency lane must present it).
    pub const TOKEN: u16 = 5;
    /// On a second connection's hello: attach it as the latency lane of the link with this token.
    pub const ATTACH: u16 = 6;
    /// Bytes of the sender's shared chunk cache (its decoder's): the peer's encoder mirrors it.
    pub const CACHE_BYTES: u16 = 7;
    /// Bytes of each of the sender's service-scoped chunk caches.
    pub const SERVICE_CACHE_BYTES: u16 = 8;
    /// With `CAP_LONG_CONTEXT`: the largest long-context window the sender decodes (log2 bytes).
    pub const CONTEXT_WINDOW_LOG: u16 = 9;
    /// With `CAP_LONG_CONTEXT`: long contexts per link the sender's peer may use at once.
    pub const CONTEXT_STREAMS: u16 = 10;
    /// On a reconnecting side's hello (with `CAP_RESUME`): resume the link whose listener token
    /// this is, with its streams.
    pub const RESUME: u16 = 11;
    /// On the listener's answer: 1 if it resumes the link the peer named (it still has it).
    pub const RESUMED: u16 = 12;
    /// On a latency lane's hello: the lane's id (the connecting side's random pick). A copy of
    /// the lane names the id of the lane it copies.
    pub const COPY_OF: u16 = 13;
    /// On a copy's hello, and on the listener's answer to it: the offset in the sender's lane
    /// byte stream where this connection's bytes start.
    pub const COPY_AT: u16 = 14;
    /// With `CAP_LANE_COPIES`: the most connections the sender takes for its latency lane.
    pub const LANE_COPIES: u16 = 15;
}

impl Hello {
    /// The value of a setting, if present.
    pub fn setting(&self, id: u16) -> Option<u64> {
        self.settings
            .iter()
            .find(|(k, _)| *k == id)
            .map(|(_, v)| *v)
    }
}

/// Most settings a hello may carry.
pub const MAX_SETTINGS: usize = 64;

/// One frame of the link protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Version and capability exchange; the first frame each way.
    Hello(Hello),
    /// Open a stream to a named service of the peer's own configuration.
    Open {
        stream: StreamId,
        class: Class,
        service: String,
    },
    /// Stream bytes at `offset` (the stream position of the first byte); `fin` ends this direction.
    Data {
        stream: StreamId,
        offset: u64,
        fin: bool,
        data: Bytes,
    },
    /// Abort a stream in both directions.
    Reset {
        stream: StreamId,
        code: ResetCode,
        reason: String,
    },
    /// Credit: the receiver allows data up to absolute offset `max` (stream 0: link-wide byte count).
    /// Absolute limits double as acknowledgements of what was consumed.
    MaxData { stream: StreamId, max: u64 },
    /// Liveness and round-trip probe.
    Ping { payload: u64 },
    /// Answer to a ping, echoing its payload.
    Pong { payload: u64 },
    /// The sender closes the link: no new frames follow.
    GoAway { code: CloseCode, reason: String },
    /// Optimized stream bytes: `records` of the codec that rebuild `raw_len` bytes at `offset`,
    /// against the link's shared cache or (`scoped`) the stream's service's own.
    Coded {
        stream: StreamId,
        offset: u64,
        fin: bool,
        scoped: bool,
        raw_len: u32,
        records: Bytes,
    },
    /// A reference could not be resolved: the receiver asks for the chunk of `fingerprint` in the
    /// cache `scope` (empty: the link's shared cache; else a service's own).
    Need {
        stream: StreamId,
        scope: String,
        fingerprint: [u8; 16],
    },
    /// The answer to [`Frame::Need`]: the chunk's bytes, or none if the sender no longer has it.
    Chunk {
        stream: StreamId,
        scope: String,
        fingerprint: [u8; 16],
        data: Bytes,
    },
    /// The sender saved its mirror of the cache `scope` of this lane, whose state has `digest`;
    /// the receiver saves its cache too if its digest is the same.
    Checkpoint { scope: String, digest: [u8; 16] },
    /// Every byte of the stream up to `offset` and its end arrived (with `CAP_RESUME`): the
    /// sender may forget what it kept to send again.
    Finished { stream: StreamId, offset: u64 },
    /// After a resumed link's hellos: what the sender of this frame received before the old
    /// connection was lost, so the other side sends the rest. `last` ends the list.
    Resume(Box<Resume>),
}

/// One [`Frame::Resume`]: the link's receive state, then one entry per stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resume {
    /// Link-level bytes received, and the link-level limit granted.
    pub link_received: u64,
    pub link_max: u64,
    /// Highest stream id of the receiver's peer seen so far, per lane.
    pub seen: [u32; 2],
    pub entries: Vec<ResumeEntry>,
    /// The last frame of the list.
    pub last: bool,
    /// Only the latency lane was lost: the list covers its streams, and `link_received`
    /// counts the stream bytes received on that lane.
    pub lane: bool,
}

/// What the sender of a [`Frame::Resume`] holds of one stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResumeEntry {
    pub stream: StreamId,
    /// Bytes received (and rebuilt, for an optimized stream).
    pub received: u64,
    /// The stream's limit granted.
    pub max: u64,
    /// The stream's end arrived.
    pub fin: bool,
    /// The stream finished both ways and is gone.
    pub done: bool,
    /// The stream's frames travel on the latency lane.
    pub latency: bool,
}

/// Bytes of one [`ResumeEntry`] on the wire.
pub const RESUME_ENTRY_LEN: usize = 21;
/// Bytes of a [`Frame::Resume`] payload before its entries.
pub const RESUME_HEAD_LEN: usize = 8 + 8 + 4 + 4 + 2;

mod kind {
    pub const HELLO: u8 = 1;
    pub const OPEN: u8 = 2;
    pub const DATA: u8 = 3;
    pub const RESET: u8 = 4;
    pub const MAX_DATA: u8 = 5;
    pub const PING: u8 = 6;
    pub const PONG: u8 = 7;
    pub const GOAWAY: u8 = 8;
    pub const CODED: u8 = 9;
    pub const NEED: u8 = 10;
    pub const CHUNK: u8 = 11;
    pub const CHECKPOINT: u8 = 12;
    pub const FINISHED: u8 = 13;
    pub const RESUME: u8 = 14;
}

const FLAG_FIN: u8 = 1;
const FLAG_SCOPED: u8 = 2;
/// Resume entry flags.
const RESUME_FIN: u8 = 1;
const RESUME_DONE: u8 = 2;
const RESUME_LATENCY: u8 = 4;

impl Frame {
    /// Checks whether `buf` starts with a whole frame whose payload is at most `max_payload` bytes.
    /// Returns the frame's total length, `Incomplete` if more bytes are needed, or a fatal error.
    pub fn check(buf: &[u8], max_payload: u32) -> Result<usize, FrameError> {
        if buf.len() < HEADER_LEN {
            return Err(FrameError::Incomplete);
        }
        let kind = buf[0];
        if !(kind::HELLO..=kind::RESUME).contains(&kind) {
            return Err(FrameError::UnknownKind(kind));
        }
        let len = u32::from_be_bytes([buf[6], buf[7], buf[8], buf[9]]);
        let cap = max_payload.min(MAX_PAYLOAD_HARD);
        if len > cap {
            return Err(FrameError::TooLarge { len, max: cap });
        }
        let total = HEADER_LEN + len as usize;
        if buf.len() < total {
            return Err(FrameError::Incomplete);
        }
        Ok(total)
    }

    /// Parses one whole frame, as delimited by [`Frame::check`]. Data payloads share `frame`'s memory.
    pub fn parse(mut frame: Bytes) -> Result<Frame, FrameError> {
        if frame.len() < HEADER_LEN {
            return Err(FrameError::Malformed("short header"));
        }
        let kind = frame.get_u8();
        let flags = frame.get_u8();
        let stream = StreamId(frame.get_u32());
        let len = frame.get_u32() as usize;
        if frame.len() != len {
            return Err(FrameError::Malformed("length mismatch"));
        }
        let mut p = frame;
        let f = match kind {
            kind::HELLO => {
                let version = get_u16(&mut p)?;
                let min_version = get_u16(&mut p)?;
                let site = get_name(&mut p)?;
                let capabilities = get_u64(&mut p)?;
                let n = get_u16(&mut p)? as usize;
                if n > MAX_SETTINGS {
                    return Err(FrameError::Malformed("too many settings"));
                }
                let mut settings = Vec::with_capacity(n);
                for _ in 0..n {
                    settings.push((get_u16(&mut p)?, get_u64(&mut p)?));
                }
                let n = get_u16(&mut p)? as usize;
                if n > MAX_OFFERS {
                    return Err(FrameError::Malformed("too many cache offers"));
                }
                let mut caches = Vec::with_capacity(n);
                for _ in 0..n {
                    let decoder = get_u8(&mut p)? != 0;
                    let lane = get_u8(&mut p)?;
                    let scope = get_name(&mut p)?;
                    let k = get_u8(&mut p)? as usize;
                    if k > MAX_DIGESTS {
                        return Err(FrameError::Malformed("too many cache digests"));
                    }
                    let mut digests = Vec::with_capacity(k);
                    for _ in 0..k {
                        digests.push(get_fingerprint(&mut p)?);
                    }
                    caches.push(CacheOffer {
                        decoder,
                        lane,
                        scope,
                        digests,
                    });
                }
                let mut scoped = Vec::new();
                if p.has_remaining() {
                    let n = get_u16(&mut p)? as usize;
                    if n > MAX_SCOPED {
                        return Err(FrameError::Malformed("too many scoped services"));
                    }
                    scoped.reserve(n);
                    for _ in 0..n {
                        scoped.push(get_name(&mut p)?);
                    }
                }
                Frame::Hello(Hello {
                    version,
                    min_version,
                    site,
                    capabilities,
                    settings,
                    caches,
                    scoped,
                })
            }
            kind::OPEN => {
                nonzero(stream)?;
                let class = Class::from_u8(get_u8(&mut p)?)?;
                let service = get_name(&mut p)?;
                Frame::Open {
                    stream,
                    class,
                    service,
                }
            }
            kind::DATA => {
                nonzero(stream)?;
                let offset = get_u64(&mut p)?;
                let data = p.split_off(0);
                if offset.checked_add(data.len() as u64).is_none() {
                    return Err(FrameError::Malformed("offset overflow"));
                }
                Frame::Data {
                    stream,
                    offset,
                    fin: flags & FLAG_FIN != 0,
                    data,
                }
            }
            kind::RESET => {
                nonzero(stream)?;
                let code = ResetCode::from_u16(get_u16(&mut p)?);
                let reason = get_name(&mut p)?;
                Frame::Reset {
                    stream,
                    code,
                    reason,
                }
            }
            kind::MAX_DATA => Frame::MaxData {
                stream,
                max: get_u64(&mut p)?,
            },
            kind::PING => Frame::Ping {
                payload: get_u64(&mut p)?,
            },
            kind::PONG => Frame::Pong {
                payload: get_u64(&mut p)?,
            },
            kind::GOAWAY => {
                let code = CloseCode::from_u16(get_u16(&mut p)?);
                let reason = get_name(&mut p)?;
                Frame::GoAway { code, reason }
            }
            kind::CODED => {
                nonzero(stream)?;
                let offset = get_u64(&mut p)?;
                let raw_len = get_u32(&mut p)?;
                if offset.checked_add(u64::from(raw_len)).is_none() {
                    return Err(FrameError::Malformed("offset overflow"));
                }
                Frame::Coded {
                    stream,
                    offset,
                    fin: flags & FLAG_FIN != 0,
                    scoped: flags & FLAG_SCOPED != 0,
                    raw_len,
                    records: p.split_off(0),
                }
            }
            kind::NEED => {
                nonzero(stream)?;
                let fingerprint = get_fingerprint(&mut p)?;
                let scope = get_name(&mut p)?;
                Frame::Need {
                    stream,
                    scope,
                    fingerprint,
                }
            }
            kind::CHUNK => {
                nonzero(stream)?;
                let fingerprint = get_fingerprint(&mut p)?;
                let scope = get_name(&mut p)?;
                Frame::Chunk {
                    stream,
                    scope,
                    fingerprint,
                    data: p.split_off(0),
                }
            }
            kind::CHECKPOINT => {
                let digest = get_fingerprint(&mut p)?;
                let scope = get_name(&mut p)?;
                Frame::Checkpoint { scope, digest }
            }
            kind::FINISHED => {
                nonzero(stream)?;
                Frame::Finished {
                    stream,
                    offset: get_u64(&mut p)?,
                }
            }
            kind::RESUME => {
                let link_received = get_u64(&mut p)?;
                let link_max = get_u64(&mut p)?;
                let seen = [get_u32(&mut p)?, get_u32(&mut p)?];
                let n = get_u16(&mut p)? as usize;
                // Checked against what is there before anything is allocated.
                if p.remaining() != n * RESUME_ENTRY_LEN {
                    return Err(FrameError::Malformed("resume entries do not fit the frame"));
                }
                let mut entries = Vec::with_capacity(n);
                for _ in 0..n {
                    let stream = StreamId(get_u32(&mut p)?);
                    let received = get_u64(&mut p)?;
                    let max = get_u64(&mut p)?;
                    let f = get_u8(&mut p)?;
                    if stream == StreamId::LINK
                        || f & !(RESUME_FIN | RESUME_DONE | RESUME_LATENCY) != 0
                    {
                        return Err(FrameError::Malformed("bad resume entry"));
                    }
                    entries.push(ResumeEntry {
                        stream,
                        received,
                        max,
                        fin: f & RESUME_FIN != 0,
                        done: f & RESUME_DONE != 0,
                        latency: f & RESUME_LATENCY != 0,
                    });
                }
                Frame::Resume(Box::new(Resume {
                    link_received,
                    link_max,
                    seen,
                    entries,
                    last: flags & FLAG_FIN != 0,
                    lane: flags & FLAG_SCOPED != 0,
                }))
            }
            other => return Err(FrameError::UnknownKind(other)),
        };
        if p.has_remaining() {
            return Err(FrameError::Malformed("trailing bytes"));
        }
        Ok(f)
    }

    /// Encoded length of this frame, header included.
    pub fn encoded_len(&self) -> usize {
        HEADER_LEN
            + match self {
                Frame::Hello(h) => {
                    2 + 2
                        + 1
                        + name_len(&h.site)
                        + 8
                        + 2
                        + h.settings.len().min(MAX_SETTINGS) * 10
                        + 2
                        + h.caches
                            .iter()
                            .take(MAX_OFFERS)
                            .map(|c| {
                                3 + name_len(&c.scope) + 1 + 16 * c.digests.len().min(MAX_DIGESTS)
                            })
                            .sum::<usize>()
                        + if h.scoped.is_empty() {
                            0
                        } else {
                            2 + h
                                .scoped
                                .iter()
                                .take(MAX_SCOPED)
                                .map(|s| 1 + name_len(s))
                                .sum::<usize>()
                        }
                }
                Frame::Open { service, .. } => 1 + 1 + name_len(service),
                Frame::Data { data, .. } => 8 + data.len(),
                Frame::Reset { reason, .. } => 2 + 1 + name_len(reason),
                Frame::MaxData { .. } | Frame::Ping { .. } | Frame::Pong { .. } => 8,
                Frame::GoAway { reason, .. } => 2 + 1 + name_len(reason),
                Frame::Coded { records, .. } => 8 + 4 + records.len(),
                Frame::Need { scope, .. } => 16 + 1 + name_len(scope),
                Frame::Chunk { scope, data, .. } => 16 + 1 + name_len(scope) + data.len(),
                Frame::Checkpoint { scope, .. } => 16 + 1 + name_len(scope),
                Frame::Finished { .. } => 8,
                Frame::Resume(r) => {
                    RESUME_HEAD_LEN + r.entries.len().min(usize::from(u16::MAX)) * RESUME_ENTRY_LEN
                }
            }
    }

    /// Appends this frame to `out`. Names and reasons longer than [`MAX_NAME_LEN`] are truncated at a
    /// character boundary; everything else is encoded as is.
    pub fn encode(&self, out: &mut BytesMut) {
        out.reserve(self.encoded_len());
        let (kind, flags, stream) = match self {
            Frame::Hello(_) => (kind::HELLO, 0, StreamId::LINK),
            Frame::Open { stream, .. } => (kind::OPEN, 0, *stream),
            Frame::Data { stream, fin, .. } => {
                (kind::DATA, if *fin { FLAG_FIN } else { 0 }, *stream)
            }
            Frame::Reset { stream, .. } => (kind::RESET, 0, *stream),
            Frame::MaxData { stream, .. } => (kind::MAX_DATA, 0, *stream),
            Frame::Ping { .. } => (kind::PING, 0, StreamId::LINK),
            Frame::Pong { .. } => (kind::PONG, 0, StreamId::LINK),
            Frame::GoAway { .. } => (kind::GOAWAY, 0, StreamId::LINK),
            Frame::Coded {
                stream,
                fin,
                scoped,
                ..
            } => (kind::CODED, coded_flags(*fin, *scoped), *stream),
            Frame::Need { stream, .. } => (kind::NEED, 0, *stream),
            Frame::Chunk { stream, .. } => (kind::CHUNK, 0, *stream),
            Frame::Checkpoint { .. } => (kind::CHECKPOINT, 0, StreamId::LINK),
            Frame::Finished { stream, .. } => (kind::FINISHED, 0, *stream),
            Frame::Resume(r) => (kind::RESUME, coded_flags(r.last, r.lane), StreamId::LINK),
        };
        out.put_u8(kind);
        out.put_u8(flags);
        out.put_u32(stream.0);
        let len_at = out.len();
        out.put_u32(0);
        let start = out.len();
        match self {
            Frame::Hello(h) => {
                out.put_u16(h.version);
                out.put_u16(h.min_version);
                put_name(out, &h.site);
                out.put_u64(h.capabilities);
                let n = h.settings.len().min(MAX_SETTINGS);
                out.put_u16(n as u16);
                for (id, v) in &h.settings[..n] {
                    out.put_u16(*id);
                    out.put_u64(*v);
                }
                let n = h.caches.len().min(MAX_OFFERS);
                out.put_u16(n as u16);
                for c in &h.caches[..n] {
                    out.put_u8(u8::from(c.decoder));
                    out.put_u8(c.lane);
                    put_name(out, &c.scope);
                    let k = c.digests.len().min(MAX_DIGESTS);
                    out.put_u8(k as u8);
                    for d in &c.digests[..k] {
                        out.extend_from_slice(d);
                    }
                }
                if !h.scoped.is_empty() {
                    let n = h.scoped.len().min(MAX_SCOPED);
                    out.put_u16(n as u16);
                    for s in &h.scoped[..n] {
                        put_name(out, s);
                    }
                }
            }
            Frame::Open { class, service, .. } => {
                out.put_u8(class.to_u8());
                put_name(out, service);
            }
            Frame::Data { offset, data, .. } => {
                out.put_u64(*offset);
                out.extend_from_slice(data);
            }
            Frame::Reset { code, reason, .. } => {
                out.put_u16(code.to_u16());
                put_name(out, reason);
            }
            Frame::MaxData { max, .. } => out.put_u64(*max),
            Frame::Ping { payload } | Frame::Pong { payload } => out.put_u64(*payload),
            Frame::GoAway { code, reason } => {
                out.put_u16(code.to_u16());
                put_name(out, reason);
            }
            Frame::Coded {
                offset,
                raw_len,
                records,
                ..
            } => {
                out.put_u64(*offset);
                out.put_u32(*raw_len);
                out.extend_from_slice(records);
            }
            Frame::Need {
                scope, fingerprint, ..
            } => {
                out.extend_from_slice(fingerprint);
                put_name(out, scope);
            }
            Frame::Chunk {
                scope,
                fingerprint,
                data,
                ..
            } => {
                out.extend_from_slice(fingerprint);
                put_name(out, scope);
                out.extend_from_slice(data);
            }
            Frame::Checkpoint { scope, digest } => {
                out.extend_from_slice(digest);
                put_name(out, scope);
            }
            Frame::Finished { offset, .. } => out.put_u64(*offset),
            Frame::Resume(r) => {
                out.put_u64(r.link_received);
                out.put_u64(r.link_max);
                out.put_u32(r.seen[0]);
                out.put_u32(r.seen[1]);
                let n = r.entries.len().min(usize::from(u16::MAX));
                out.put_u16(n as u16);
                for e in &r.entries[..n] {
                    out.put_u32(e.stream.0);
                    out.put_u64(e.received);
                    out.put_u64(e.max);
                    out.put_u8(
                        if e.fin { RESUME_FIN } else { 0 }
                            | if e.done { RESUME_DONE } else { 0 }
                            | if e.latency { RESUME_LATENCY } else { 0 },
                    );
                }
            }
        }
        let len = (out.len() - start) as u32;
        out[len_at..len_at + 4].copy_from_slice(&len.to_be_bytes());
    }
}

/// Writes the header and offset of a data frame whose `len` payload bytes the caller appends next.
/// Lets the scheduler copy stream bytes straight into the output buffer.
pub fn encode_data_header(
    out: &mut BytesMut,
    stream: StreamId,
    offset: u64,
    fin: bool,
    len: usize,
) {
    out.put_u8(kind::DATA);
    out.put_u8(if fin { FLAG_FIN } else { 0 });
    out.put_u32(stream.0);
    out.put_u32((8 + len) as u32);
    out.put_u64(offset);
}

/// Overhead of a data frame on top of its payload.
pub const DATA_OVERHEAD: usize = HEADER_LEN + 8;

/// Overhead of a coded frame on top of its records.
pub const CODED_OVERHEAD: usize = HEADER_LEN + 12;

/// Writes the header of a coded frame with a zero payload length, returning where the length
/// sits; [`finish_coded`] fills it in once the records are appended.
pub fn begin_coded(out: &mut BytesMut, stream: StreamId, offset: u64) -> usize {
    out.put_u8(kind::CODED);
    out.put_u8(0);
    out.put_u32(stream.0);
    let at = out.len();
    out.put_u32(0);
    out.put_u64(offset);
    out.put_u32(0);
    at
}

fn coded_flags(fin: bool, scoped: bool) -> u8 {
    (if fin { FLAG_FIN } else { 0 }) | if scoped { FLAG_SCOPED } else { 0 }
}

/// Completes a coded frame begun at `at`: its flags, raw length and payload length.
pub fn finish_coded(out: &mut BytesMut, at: usize, fin: bool, scoped: bool, raw_len: u32) {
    let payload = (out.len() - at - 4) as u32;
    out[at - 5] = coded_flags(fin, scoped);
    out[at..at + 4].copy_from_slice(&payload.to_be_bytes());
    out[at + 12..at + 16].copy_from_slice(&raw_len.to_be_bytes());
}

fn nonzero(stream: StreamId) -> Result<(), FrameError> {
    if stream == StreamId::LINK {
        Err(FrameError::Malformed("stream id 0 on a stream frame"))
    } else {
        Ok(())
    }
}

fn get_u8(p: &mut Bytes) -> Result<u8, FrameError> {
    if p.remaining() < 1 {
        return Err(FrameError::Malformed("truncated field"));
    }
    Ok(p.get_u8())
}
fn get_u32(p: &mut Bytes) -> Result<u32, FrameError> {
    if p.remaining() < 4 {
        return Err(FrameError::Malformed("truncated field"));
    }
    Ok(p.get_u32())
}
fn get_fingerprint(p: &mut Bytes) -> Result<[u8; 16], FrameError> {
    if p.remaining() < 16 {
        return Err(FrameError::Malformed("truncated fingerprint"));
    }
    let mut f = [0u8; 16];
    p.copy_to_slice(&mut f);
    Ok(f)
}
fn get_u16(p: &mut Bytes) -> Result<u16, FrameError> {
    if p.remaining() < 2 {
        return Err(FrameError::Malformed("truncated field"));
    }
    Ok(p.get_u16())
}
fn get_u64(p: &mut Bytes) -> Result<u64, FrameError> {
    if p.remaining() < 8 {
        return Err(FrameError::Malformed("truncated field"));
    }
    Ok(p.get_u64())
}
fn get_name(p: &mut Bytes) -> Result<String, FrameError> {
    let n = get_u8(p)? as usize;
    if p.remaining() < n {
        return Err(FrameError::Malformed("truncated name"));
    }
    let raw = p.split_to(n);
    String::from_utf8(raw.to_vec()).map_err(|_| FrameError::Malformed("name is not utf-8"))
}
/// Encoded length of a name: at most [`MAX_NAME_LEN`] bytes, cut at a character boundary.
fn name_len(s: &str) -> usize {
    let mut end = s.len().min(MAX_NAME_LEN);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    end
}
fn put_name(out: &mut BytesMut, s: &str) {
    let end = name_len(s);
    out.put_u8(end as u8);
    out.extend_from_slice(&s.as_bytes()[..end]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_name() -> impl Strategy<Value = String> {
        proptest::string::string_regex("[a-z0-9_.-]{0,40}").expect("valid regex")
    }

    fn arb_frame() -> impl Strategy<Value = Frame> {
        let sid = (1u32..).prop_map(StreamId);
        prop_oneof![
            (
                any::<u16>(),
                any::<u16>(),
                arb_name(),
                any::<u64>(),
                proptest::collection::vec((any::<u16>(), any::<u64>()), 0..8),
                proptest::collection::vec(
                    (
                        any::<bool>(),
                        any::<u8>(),
                        arb_name(),
                        proptest::collection::vec(any::<[u8; 16]>(), 0..=MAX_DIGESTS)
                    ),
                    0..4
                ),
                proptest::collection::vec(arb_name(), 0..4)
            )
                .prop_map(
                    |(version, min_version, site, capabilities, settings, caches, scoped)| {
                        Frame::Hello(Hello {
                            version,
                            min_version,
                            site,
                            capabilities,
                            settings,
                            caches: caches
                                .into_iter()
                                .map(|(decoder, lane, scope, digests)| CacheOffer {
                                    decoder,
                                    lane,
                                    scope,
                                    digests,
                                })
                                .collect(),
                            scoped,
                        })
                    }
                ),
            (
                sid.clone(),
                prop_oneof![Just(Class::Latency), Just(Class::Bulk)],
                arb_name()
            )
                .prop_map(|(stream, class, service)| Frame::Open {
                    stream,
                    class,
                    service
                }),
            (
                sid.clone(),
                0u64..u64::MAX / 2,
                any::<bool>(),
                proptest::collection::vec(any::<u8>(), 0..2000)
            )
                .prop_map(|(stream, offset, fin, d)| Frame::Data {
                    stream,
                    offset,
                    fin,
                    data: Bytes::from(d)
                }),
            (sid.clone(), any::<u16>(), arb_name()).prop_map(|(stream, c, reason)| Frame::Reset {
                stream,
                code: ResetCode::from_u16(c),
                reason
            }),
            (any::<u32>(), any::<u64>()).prop_map(|(s, max)| Frame::MaxData {
                stream: StreamId(s),
                max
            }),
            any::<u64>().prop_map(|payload| Frame::Ping { payload }),
            any::<u64>().prop_map(|payload| Frame::Pong { payload }),
            (any::<u16>(), arb_name()).prop_map(|(c, reason)| Frame::GoAway {
                code: CloseCode::from_u16(c),
                reason
            }),
            (
                sid.clone(),
                0u64..u64::MAX / 2,
                any::<(bool, bool)>(),
                any::<u32>(),
                proptest::collection::vec(any::<u8>(), 0..2000)
            )
                .prop_map(|(stream, offset, (fin, scoped), raw_len, d)| Frame::Coded {
                    stream,
                    offset,
                    fin,
                    scoped,
                    raw_len,
                    records: Bytes::from(d)
                }),
            (sid.clone(), arb_name(), any::<[u8; 16]>()).prop_map(
                |(stream, scope, fingerprint)| Frame::Need {
                    stream,
                    scope,
                    fingerprint
                }
            ),
            (
                sid.clone(),
                arb_name(),
                any::<[u8; 16]>(),
                proptest::collection::vec(any::<u8>(), 0..2000)
            )
                .prop_map(|(stream, scope, fingerprint, d)| Frame::Chunk {
                    stream,
                    scope,
                    fingerprint,
                    data: Bytes::from(d)
                }),
            (arb_name(), any::<[u8; 16]>())
                .prop_map(|(scope, digest)| Frame::Checkpoint { scope, digest }),
            (sid.clone(), any::<u64>())
                .prop_map(|(stream, offset)| Frame::Finished { stream, offset }),
            (
                any::<(u64, u64, u32, u32, bool, bool)>(),
                proptest::collection::vec((1u32.., any::<(u64, u64, bool, bool, bool)>()), 0..40)
            )
                .prop_map(|((link_received, link_max, s0, s1, last, lane), es)| {
                    Frame::Resume(Box::new(Resume {
                        link_received,
                        link_max,
                        seen: [s0, s1],
                        entries: es
                            .into_iter()
                            .map(|(s, (received, max, fin, done, latency))| ResumeEntry {
                                stream: StreamId(s),
                                received,
                                max,
                                fin,
                                done,
                                latency,
                            })
                            .collect(),
                        last,
                        lane,
                    }))
                }),
        ]
    }

    proptest! {
        #[test]
        fn round_trip(frames in proptest::collection::vec(arb_frame(), 1..8)) {
            let mut buf = BytesMut::new();
            for f in &frames {
                let before = buf.len();
                f.encode(&mut buf);
                prop_assert_eq!(buf.len() - before, f.encoded_len());
            }
            let mut got = Vec::new();
            loop {
                match Frame::check(&buf, MAX_PAYLOAD_HARD) {
                    Ok(n) => got.push(Frame::parse(buf.split_to(n).freeze()).expect("parse")),
                    Err(FrameError::Incomplete) => break,
                    Err(e) => panic!("{e}"),
                }
            }
            prop_assert!(buf.is_empty());
            prop_assert_eq!(got, frames);
        }

        #[test]
        fn every_prefix_is_incomplete(f in arb_frame()) {
            let mut buf = BytesMut::new();
            f.encode(&mut buf);
            for cut in 0..buf.len() {
                prop_assert_eq!(Frame::check(&buf[..cut], MAX_PAYLOAD_HARD), Err(FrameError::Incomplete));
            }
        }

        #[test]
        fn garbage_never_panics(data in proptest::collection::vec(any::<u8>(), 0..256)) {
            if let Ok(n) = Frame::check(&data, 4096) {
                let _ = Frame::parse(Bytes::copy_from_slice(&data[..n]));
            }
        }
    }

    #[test]
    fn oversized_length_rejected_before_buffering() {
        let mut hdr = vec![kind::DATA, 0, 0, 0, 0, 1];
        hdr.extend_from_slice(&(64u32 * 1024 * 1024).to_be_bytes());
        assert_eq!(
            Frame::check(&hdr, 65536),
            Err(FrameError::TooLarge {
                len: 64 * 1024 * 1024,
                max: 65536
            })
        );
    }

    #[test]
    fn unknown_kind_and_tls_garbage_rejected() {
        assert_eq!(
            Frame::check(b"GET / HTTP/1.1\r\n", 65536),
            Err(FrameError::UnknownKind(b'G'))
        );
        assert_eq!(
            Frame::check(&[0u8; 10], 65536),
            Err(FrameError::UnknownKind(0))
        );
    }

    #[test]
    fn data_header_matches_encode() {
        let f = Frame::Data {
            stream: StreamId(7),
            offset: 99,
            fin: true,
            data: Bytes::from_static(b"hello"),
        };
        let mut a = BytesMut::new();
        f.encode(&mut a);
        let mut b = BytesMut::new();
        encode_data_header(&mut b, StreamId(7), 99, true, 5);
        b.extend_from_slice(b"hello");
        assert_eq!(a, b);
    }

    #[test]
    fn coded_header_matches_encode() {
        let f = Frame::Coded {
            stream: StreamId(9),
            offset: 1 << 40,
            fin: true,
            scoped: true,
            raw_len: 123_456,
            records: Bytes::from_static(b"records"),
        };
        let mut a = BytesMut::new();
        f.encode(&mut a);
        let mut b = BytesMut::new();
        let at = begin_coded(&mut b, StreamId(9), 1 << 40);
        b.extend_from_slice(b"records");
        finish_coded(&mut b, at, true, true, 123_456);
        assert_eq!(a, b);
    }

    #[test]
    fn long_names_truncate_on_char_boundary() {
        let name = "é".repeat(200);
        let f = Frame::GoAway {
            code: CloseCode::Normal,
            reason: name,
        };
        let mut buf = BytesMut::new();
        f.encode(&mut buf);
        let n = Frame::check(&buf, MAX_PAYLOAD_HARD).expect("whole");
        match Frame::parse(buf.split_to(n).freeze()).expect("parse") {
            Frame::GoAway { reason, .. } => assert_eq!(reason.len(), 254),
            other => panic!("{other:?}"),
        }
    }
}
