//! The sans-IO optimization codec: content-defined chunking (FastCDC), 128-bit BLAKE3
//! fingerprints, a symmetric chunk cache, and adaptive compression (none, LZ4, zstd).
//!
//! A [`Mirror`] encodes one chunk at a time against its copy of the peer decoder's cache, producing
//! records: `Ref` (a chunk the peer holds), `Lit` (a new chunk, maybe compressed, that both caches
//! then hold) and `Raw` (bytes sent as they are, such as a latency flush's short tail). The link
//! cuts each stream into chunks with [`chunks`] and encodes them when it emits a frame, so the
//! mirror sees chunks in frame order. A [`Decoder`] rebuilds the bytes; a reference it cannot
//! resolve or verify is a [`CodecError::Miss`], never wrong data. [`Encoder`] strings the pieces
//! together for one stream (tests, benches). Nothing here does I/O.
//!
//! A stream's flushed tails (the bytes where its writer paused, shorter than a chunk) share a
//! zstd context when zstd is chosen: each goes out flushed on its own, but its matches reach back
//! into the stream's earlier tails (a 128 KiB window). Live redo comes in writes of a few hundred
//! bytes to a few KiB, which alone compress poorly; in context they compress like the whole
//! stream. Whole chunks are compressed alone: there a context bought nothing and cost a third of
//! the speed. Both ends keep the context per stream ([`Hint`] and [`StreamContext`]) and feed it
//! the same records in the stream's order, so it needs no agreement beyond that.

pub mod cache;
mod config;
mod context;
pub mod cuts;
mod decoder;
pub mod delta;
mod encoder;
mod fingerprint;
mod format;
mod logs;
mod maker;
mod mirror;
pub mod prepare;
mod report;
pub mod send;
mod snapshot;
pub mod store;
pub mod testdata;

pub use config::{AVG_CHUNK_RANGE, Codec, CodecConfig, Compression, Policy, Pressure, chunks};
pub use context::{
    CONTEXT_WINDOW_LOG, DECODER_CONTEXTS, LongContext, MIRROR_CONTEXTS, Slots, StreamContext,
};
pub use decoder::{DecodeFrame, DecodeStats, Decoder, Feeding, Feeds, HandedOn, InOrder};
pub use delta::{Bases, MAX_BASES, SharedBases};
pub use encoder::{Encoder, PENDING, StoreWait, Streams};
pub use format::{CodecError, MAX_RECORD, RECORD_OVERHEAD, RUN_MAX, RUN_MAX_DECODE, run_reserve};
pub use mirror::{
    Hint, LIVE_CHUNKS, Mirror, TAIL_RAW, TAIL_RAW_IN_CONTEXT, TRIAL_EVERY, encode_raw, encode_tail,
};
pub use prepare::BATCH;
pub use report::{EncodeStats, Report, Sent};
pub use send::Sender;

#[cfg(test)]
mod tests;
