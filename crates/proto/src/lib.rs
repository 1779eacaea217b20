//! Sans-IO protocol core of wanopt: the frames two daemons exchange over their TLS link, the
//! versioned hello, stream multiplexing with credit flow control, and the scheduler that orders
//! latency-class data before bulk data.
//!
//! Nothing in this crate touches sockets, threads or clocks: it consumes bytes and `now` values and
//! emits bytes and events, so it is tested deterministically (see `tests/pair.rs`) and fuzzed.

pub mod codes;
pub mod coding;
pub mod copies;
pub mod datagram;
pub mod error;
pub mod flow;
pub mod frame;
pub mod lane;
pub mod link;

pub use coding::{
    CacheStat, CacheStorage, ChunkStore, CodecCount, CodecSettings, Compression, LongContext,
    Pressure, Role, SavedCache, SavedState, Scope, StateRequest, StreamPolicy, TierStats,
};
pub use error::{FrameError, LinkError, StreamError};
pub use frame::{
    CacheOffer, Class, CloseCode, Frame, Hello, ResetCode, Resume, ResumeEntry, StreamId,
};
pub use lane::{LANES, LATENCY_LANE, MAIN_LANE};
pub use link::{
    Event, HANDOVER_VERSION, HELLO_MAX, HandoverError, Link, LinkConfig, MAX_QUEUED_CONTROL,
    MAX_SHARE, MIN_VERSION, ReadOutcome, Refusal, ResumeStats, ServiceLimit, Shaping, StreamState,
    VERSION, WireCount, coded_turn,
};
pub use wanopt_codec::cache::Snapshot;
