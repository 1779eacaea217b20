//! The send side of an optimized stream on the link: its [`SendCoder`], the codec's
//! [`Sender`](wanopt_codec::Sender) with what the link adds (the cache scope, the chunk size
//! that makes a stream ready to send).

use wanopt_codec::{Policy, Sender};

use super::{Scope, StreamPolicy};

/// The send side of one optimized stream.
#[derive(Debug)]
pub(crate) struct SendCoder {
    pub sender: Sender,
    pub scoped: bool,
    /// Largest chunk: this many unsent bytes always hold a whole chunk.
    pub max_chunk: usize,
    /// Unflushed bytes that make the stream ready ([`wanopt_codec::send::gather`]).
    pub gather: usize,
}

impl SendCoder {
    pub fn new(policy: &StreamPolicy, latency: bool) -> Self {
        SendCoder {
            sender: Sender::new(Policy {
                dedup: policy.dedup,
                compression: policy.compression,
                latency,
                // Only once the peer says it decodes them.
                context: false,
                // Long contexts only where the mirror has them (the peer offered them).
                bulk: !latency,
                // Only once the peer says it decodes runs.
                runs: false,
                // Only once the peer says it decodes delta runs.
                delta_runs: false,
                // Only once the peer says it keeps stream logs.
                ref_runs: false,
                // Only once the peer says it reads compact runs.
                compact_runs: false,
                // The link schedules the stream again once its store has read the bases
                // (`Link::store_ready`).
                wait_bases: true,
            }),
            scoped: policy.scope == Scope::Service,
            max_chunk: usize::MAX,
            gather: usize::MAX,
        }
    }
}
