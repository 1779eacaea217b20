//! Wire frames of the link protocol, typed by kind, with a check-then-parse read path.
//!
//! Every frame is a 10-byte header (kind, flags, stream id, payload length) and a payload whose
//! length is capped before anything is allocated; a short coded frame's header is shorter. [`Frame::check`] answers `Incomplete` until a
//! whole frame is buffered; [`Frame::parse`] then decodes it without copying data payloads.
//!
//! The ids and codes frames carry are in [`codes`](crate::codes). Floors, from the ground:
//! `hello` (the first frame's contents), `layout` (the frame, its header and kinds, `check`),
//! `buf` (checked field reads and name writes), then `parse` and `encode`.

mod buf;
mod encode;
mod hello;
mod layout;
mod parse;
#[cfg(test)]
mod tests;

pub use crate::codes::{Class, CloseCode, ResetCode, StreamId};
pub use encode::{CodedStart, begin_coded, encode_data_header, finish_coded};
pub use hello::{CacheOffer, Hello, MAX_DIGESTS, MAX_OFFERS, MAX_SCOPED, MAX_SETTINGS, setting};
pub use layout::{
    CODED_OVERHEAD, DATA_OVERHEAD, Frame, HEADER_LEN, MAX_NAME_LEN, MAX_PAYLOAD_HARD,
    RESUME_ENTRY_LEN, RESUME_HEAD_LEN, Resume, ResumeEntry, SHORT_CODED_FIXED, SHORT_RAW_MAX,
    short_coded_overhead,
};
