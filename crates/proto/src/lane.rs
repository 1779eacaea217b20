//! Lanes and hello capability bits: constants the link, the codec wiring and the runtime all use,
//! kept apart so none of them has to import another for them.
//!
//! A lane is one TCP connection inside a link. Lane 0 carries the hello, control and bulk frames;
//! lane 1, when attached, carries latency-class streams, so they never wait behind bulk's loss
//! recovery or its unsent bytes in the kernel.

/// Lanes of a link.
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
/// Hello capability bit: the sender decodes long-window stream contexts (bulk streams), of the
/// window and number its `CONTEXT_WINDOW_LOG` and `CONTEXT_STREAMS` settings give.
pub const CAP_LONG_CONTEXT: u64 = 8;
/// Hello capability bit: the sender decodes delta records (chunks sent as zstd deltas against
/// chunks its cache holds) and sends them too.
pub const CAP_DELTA: u64 = 16;
/// Hello capability bit: the sender keeps its streams through a lost connection and resumes
/// them on the next one (it sends `Finished` and `Resume` frames and keeps what it sent until
/// the peer has it).
pub const CAP_RESUME: u64 = 32;
/// Hello capability bit: the sender takes extra copies of its latency lane on more connections
/// (up to its `LANE_COPIES` setting; see [`crate::copies`]).
pub const CAP_LANE_COPIES: u64 = 64;
/// Hello capability bit: the sender decodes runs of context literals that share one flush
/// (deferred literals and run ends; see `wanopt_codec::RUN_MAX`).
pub const CAP_RUNS: u64 = 128;
/// Hello capability bit: the sender decodes delta runs (consecutive chunks sent as one zstd
/// frame against the union of their bases; see `wanopt_codec::MAX_RUN_CHUNKS`).
pub const CAP_DELTA_RUNS: u64 = 256;
/// Hello capability bit: the sender keeps stream logs and decodes references named by their
/// place in one (see `wanopt_codec::MAX_REF_RUN`).
pub const CAP_REF_RUNS: u64 = 512;
/// Hello capability bit: the sender decodes compact runs: reference runs that carry 8 bytes of
/// their check, and delta runs whose zstd frame leaves out zstd's magic number (see
/// `wanopt_codec::MAX_REF_RUN`).
pub const CAP_COMPACT_RUNS: u64 = 1024;
/// Hello capability bit (with `CAP_DELTA`): the sender's caches keep a chunk used as a delta's
/// base in its place in their least-recently-used order, as both sides must (see
/// `wanopt_codec::cache::ChunkCache::set_quiet_bases`); references still move a chunk to the
/// newest end.
pub const CAP_QUIET_BASES: u64 = 2048;
/// Hello capability bit (with `CAP_CODEC`): the sender reads short coded frames (kind 15: a
/// varint stream id and the offset's low 16 bits instead of the whole offset, 9 to 13 bytes of
/// header where a `Coded` frame's are 22).
pub const CAP_SHORT_CODED: u64 = 4096;
/// Hello capability bit (with `CAP_LANE_COPIES`): the sender takes pieces of its latency lane
/// as sealed UDP datagrams beside the lane's connections (see [`crate::datagram`]).
pub const CAP_LANE_DATAGRAMS: u64 = 8192;
/// Hello capability bit (with `CAP_RESUME`): the sender keeps the main lane's bytes until the
/// peer says it read them (`Received`), and resumes a link by sending again what the lost
/// connection did not deliver, so both codecs go on with their caches and contexts.
pub const CAP_REPLAY: u64 = 16384;
