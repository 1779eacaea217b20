//! Errors of the protocol core, one enum per layer: frame decoding, and the link state machine.
//!
//! Messages are short and lowercase; the runtime adds context (peer, stream) when it logs them.

use crate::codes::{CloseCode, StreamId};

/// A frame could not be decoded. `Incomplete` is not a failure: wait for more bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// More bytes are needed before the frame can be checked.
    #[error("incomplete frame")]
    Incomplete,
    /// The header announces a payload above the limit.
    #[error("frame payload of {len} bytes exceeds the limit of {max}")]
    TooLarge { len: u32, max: u32 },
    /// The frame kind is not one this version knows.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// A field is truncated or out of range.
    #[error("malformed frame: {0}")]
    Malformed(&'static str),
}

/// A link-level failure: the link is closed with the given code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    /// The peer sent bytes that are not a valid frame.
    #[error("bad frame from peer: {0}")]
    Frame(#[from] FrameError),
    /// The peer broke the protocol.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// The peer speaks no version we speak.
    #[error(
        "protocol version mismatch: we speak {ours_min}..={ours}, peer speaks {theirs_min}..={theirs}"
    )]
    VersionMismatch {
        ours: u16,
        ours_min: u16,
        theirs: u16,
        theirs_min: u16,
    },
    /// The peer announced another site name than the one configured.
    #[error("peer says it is site {got:?}, expected {expected:?}")]
    WrongPeer { expected: String, got: String },
    /// The peer closed the link.
    #[error("peer closed the link ({code:?}): {reason}")]
    PeerClosed { code: CloseCode, reason: String },
    /// Nothing was heard from the peer for too long.
    #[error("peer silent for too long")]
    Timeout,
    /// The connection under the link failed (reported by the runtime).
    #[error("connection lost: {0}")]
    Transport(String),
}

impl LinkError {
    /// The code sent to the peer in the `GoAway` that reports this error.
    pub fn close_code(&self) -> CloseCode {
        match self {
            LinkError::VersionMismatch { .. } => CloseCode::VersionMismatch,
            LinkError::WrongPeer { .. } => CloseCode::WrongPeer,
            LinkError::PeerClosed { code, .. } => *code,
            LinkError::Timeout | LinkError::Transport(_) => CloseCode::Normal,
            LinkError::Frame(_) | LinkError::Protocol(_) => CloseCode::ProtocolError,
        }
    }
}

/// A stream operation failed; the link itself is fine.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    /// No such stream (never opened, or already closed or reset).
    #[error("stream {0} is not open")]
    Unknown(StreamId),
    /// The stream's send side was already finished.
    #[error("stream {0} already finished sending")]
    Finished(StreamId),
    /// The link is not up or is closing.
    #[error("link is not open")]
    LinkClosed,
    /// The peer's stream limit is reached.
    #[error("too many streams")]
    TooMany,
}
