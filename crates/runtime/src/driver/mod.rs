//! The link driver: one live link's sans-IO [`Link`](wanopt_proto::Link) behind a mutex (the
//! [`LinkHandle`]), with a reader and a writer task per lane moving its bytes, the wakeups of
//! each stream, and `TCP_INFO` sampling. Readers only read: what needs a decision (a link came
//! up, a peer opened a stream, the link ended) goes to the peer's supervisor as a [`LinkMsg`].
//! The lock is never held across an `.await`.
//!
//! Floors, from the ground: `carriers` (the latency lane's bookkeeping), `state` (what the lock
//! guards), `dispatch` (routing the link's events), `handle` (every operation on a link), then
//! `lane_copies` (copies of the latency lane), `lane_datagrams` (its datagrams), `reader`, `writer` and `sampler`, and `lifecycle`, which
//! runs a connection with them.

mod carriers;
mod dispatch;
mod handle;
mod lane_copies;
mod lane_datagrams;
mod lifecycle;
mod reader;
mod sampler;
mod state;
mod writer;

pub(crate) use carriers::Carrier;
pub(crate) use handle::{LinkCtx, LinkHandle, LinkMsg};
pub(crate) use lane_datagrams::receive as receive_datagrams;
pub(crate) use lifecycle::{run_lane, run_link, watch_adopted};
pub(crate) use state::StreamSignal;

#[cfg(test)]
mod testing;
