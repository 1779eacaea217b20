//! The identifiers and codes frames carry: stream ids, service classes, and why a stream was
//! reset or a link closed. Codes this version does not know are kept as numbers, not refused.

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
    pub(crate) fn to_u8(self) -> u8 {
        match self {
            Class::Latency => 0,
            Class::Bulk => 1,
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
    pub(crate) fn to_u16(self) -> u16 {
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
    pub(crate) fn from_u16(v: u16) -> Self {
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
    pub(crate) fn to_u16(self) -> u16 {
        match self {
            CloseCode::Normal => 0,
            CloseCode::VersionMismatch => 1,
            CloseCode::ProtocolError => 2,
            CloseCode::WrongPeer => 3,
            CloseCode::Replaced => 4,
            CloseCode::Other(v) => v,
        }
    }
    pub(crate) fn from_u16(v: u16) -> Self {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every code survives the wire, a code this version does not know is kept as its number,
    /// and classes read back from their names.
    #[test]
    fn codes_round_trip_and_unknown_ones_are_kept() {
        for v in 0..=20u16 {
            assert_eq!(ResetCode::from_u16(v).to_u16(), v);
            assert_eq!(CloseCode::from_u16(v).to_u16(), v);
        }
        assert_eq!(ResetCode::from_u16(999), ResetCode::Other(999));
        assert_eq!(ResetCode::LinkLost.label(), "link_lost");
        assert_eq!(CloseCode::from_u16(4), CloseCode::Replaced);
        for c in [Class::Latency, Class::Bulk] {
            assert_eq!(c.to_string().parse::<Class>(), Ok(c));
        }
        assert!("sync".parse::<Class>().is_err());
        assert_eq!(StreamId(5).to_string(), "5");
    }
}
