//! The wire protocol between `wanopt-replay client` and `server` (our own: oratcptest
//! compatibility is of command line and output, not of its jar's protocol).
//!
//! The client opens with an 8-byte request (magic, version, flags); the server answers with an
//! 8-byte ready. Then each message is a 4-byte length and its payload; in SYNC mode the server
//! acknowledges each with the microseconds its disk write took. A length of `END` finishes: the
//! server answers with the payload bytes and messages it received, so both ends check the count.

use std::io::{self, Read, Write};

pub const REQUEST_MAGIC: [u8; 4] = *b"WOTT";
pub const READY_MAGIC: [u8; 4] = *b"WOTR";
pub const VERSION: u8 = 1;
/// The client waits for an acknowledgement of each message.
pub const FLAG_SYNC: u8 = 1;
/// The server writes each message to its file (and syncs it) before acknowledging.
pub const FLAG_WRITE: u8 = 2;
/// The length that ends a test.
pub const END: u32 = u32::MAX;
/// Largest message either side accepts, checked before anything is allocated.
pub const MAX_MESSAGE: u32 = 256 << 20;

/// A protocol failure.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    #[error("not a wanopt-replay peer (bad magic)")]
    Magic,
    #[error("peer speaks protocol version {0}, we speak {VERSION}")]
    Version(u8),
    #[error("message of {0} bytes exceeds the {MAX_MESSAGE}-byte limit")]
    TooLarge(u32),
    #[error("{}", io_text(.0))]
    Io(#[from] io::Error),
}

fn io_text(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => "no answer in time".into(),
        io::ErrorKind::UnexpectedEof => "it closed the connection".into(),
        _ => e.to_string(),
    }
}

pub fn write_request(w: &mut impl Write, flags: u8) -> io::Result<()> {
    let mut b = [0u8; 8];
    b[..4].copy_from_slice(&REQUEST_MAGIC);
    b[4] = VERSION;
    b[5] = flags;
    w.write_all(&b)
}

/// Reads a request; returns its flags.
pub fn read_request(r: &mut impl Read) -> Result<u8, ProtoError> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    if b[..4] != REQUEST_MAGIC {
        return Err(ProtoError::Magic);
    }
    if b[4] != VERSION {
        return Err(ProtoError::Version(b[4]));
    }
    Ok(b[5])
}

pub fn write_ready(w: &mut impl Write) -> io::Result<()> {
    let mut b = [0u8; 8];
    b[..4].copy_from_slice(&READY_MAGIC);
    b[4] = VERSION;
    w.write_all(&b)
}

pub fn read_ready(r: &mut impl Read) -> Result<(), ProtoError> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    if b[..4] != READY_MAGIC {
        return Err(ProtoError::Magic);
    }
    if b[4] != VERSION {
        return Err(ProtoError::Version(b[4]));
    }
    Ok(())
}

/// Reads a message length: `None` for the end of the test.
pub fn read_len(r: &mut impl Read) -> Result<Option<u32>, ProtoError> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    match u32::from_be_bytes(b) {
        END => Ok(None),
        n if n > MAX_MESSAGE => Err(ProtoError::TooLarge(n)),
        n => Ok(Some(n)),
    }
}

/// The server's final answer: payload bytes and messages received.
pub fn write_summary(w: &mut impl Write, bytes: u64, messages: u64) -> io::Result<()> {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&bytes.to_be_bytes());
    b[8..].copy_from_slice(&messages.to_be_bytes());
    w.write_all(&b)
}

pub fn read_summary(r: &mut impl Read) -> io::Result<(u64, u64)> {
    let mut b = [0u8; 16];
    r.read_exact(&mut b)?;
    let n = |s: &[u8]| u64::from_be_bytes(s.try_into().unwrap_or([0; 8]));
    Ok((n(&b[..8]), n(&b[8..])))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handshake_and_summary_round_trip() {
        let mut v = Vec::new();
        write_request(&mut v, FLAG_SYNC | FLAG_WRITE).expect("write");
        assert_eq!(read_request(&mut &v[..]).expect("read"), 3);
        let mut v = Vec::new();
        write_ready(&mut v).expect("write");
        read_ready(&mut &v[..]).expect("read");
        let mut v = Vec::new();
        write_summary(&mut v, 1 << 40, 7).expect("write");
        assert_eq!(read_summary(&mut &v[..]).expect("read"), (1 << 40, 7));
    }

    #[test]
    fn garbage_and_oversized_lengths_are_errors() {
        assert!(matches!(
            read_request(&mut &b"GET / HTTP/1.1"[..]),
            Err(ProtoError::Magic)
        ));
        assert!(matches!(
            read_request(&mut &b"WOTT\x09\0\0\0"[..]),
            Err(ProtoError::Version(9))
        ));
        assert!(matches!(
            read_request(&mut &b"WO"[..]),
            Err(ProtoError::Io(_))
        ));
        let big = (MAX_MESSAGE + 1).to_be_bytes();
        assert!(matches!(
            read_len(&mut &big[..]),
            Err(ProtoError::TooLarge(_))
        ));
        assert_eq!(read_len(&mut &END.to_be_bytes()[..]).expect("end"), None);
        assert_eq!(read_len(&mut &[0, 0, 0, 0][..]).expect("zero"), Some(0));
    }
}
