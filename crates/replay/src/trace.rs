//! The trace file: every recorded connection's bytes in both directions, with their timing.
//!
//! Layout: an 16-byte header (`WOTRACE1`, version, flags), then events, then a trailer (an end
//! tag, the event count and the BLAKE3 hash of everything before it). Event: tag (open, data,
//! shutdown), connection id, microseconds since the previous event, and for data the direction
//! and the bytes; integers are LEB128 varints. A reader checks every length and id against limits
//! before allocating, and [`verify`] checks the trailer, so a truncated or damaged trace is
//! rejected with a message before anything is replayed.

use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::Path;

const MAGIC: &[u8; 8] = b"WOTRACE1";
const VERSION: u8 = 1;
const TAG_OPEN: u8 = 1;
const TAG_DATA: u8 = 2;
const TAG_SHUT: u8 = 3;
const TAG_END: u8 = 0xFF;
/// Largest data event accepted.
pub const MAX_EVENT: u64 = 16 << 20;
/// Most connections in one trace.
pub const MAX_CONNS: u64 = 1 << 20;

/// Which way bytes went: from the client to the server, or back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dir {
    ToServer,
    ToClient,
}

impl Dir {
    pub fn index(self) -> usize {
        match self {
            Dir::ToServer => 0,
            Dir::ToClient => 1,
        }
    }
}

/// One recorded event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A client connected.
    Open { conn: u32, at_us: u64 },
    /// Bytes one side sent.
    Data {
        conn: u32,
        at_us: u64,
        dir: Dir,
        bytes: Vec<u8>,
    },
    /// One side finished sending (half-close).
    Shutdown { conn: u32, at_us: u64, dir: Dir },
}

impl Event {
    pub fn conn(&self) -> u32 {
        match self {
            Event::Open { conn, .. } | Event::Data { conn, .. } | Event::Shutdown { conn, .. } => {
                *conn
            }
        }
    }
    pub fn at_us(&self) -> u64 {
        match self {
            Event::Open { at_us, .. }
            | Event::Data { at_us, .. }
            | Event::Shutdown { at_us, .. } => *at_us,
        }
    }
}

/// A trace that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("not a wanopt-replay trace (bad magic)")]
    Magic,
    #[error("trace version {0} is not supported (this build reads {VERSION})")]
    Version(u8),
    #[error("the trace is truncated (no trailer): was the recording interrupted?")]
    Truncated,
    #[error("the trace is damaged: {0}")]
    Corrupt(String),
    #[error("{0}")]
    Io(#[from] io::Error),
}

fn put_varint(w: &mut Vec<u8>, mut v: u64) {
    loop {
        if v < 0x80 {
            w.push(v as u8);
            return;
        }
        w.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
}

/// Writes a trace; events must come in time order.
pub struct Writer<W: Write> {
    out: BufWriter<W>,
    hash: blake3::Hasher,
    last_us: u64,
    events: u64,
    buf: Vec<u8>,
}

impl<W: Write> Writer<W> {
    pub fn new(w: W) -> io::Result<Self> {
        let mut t = Writer {
            out: BufWriter::with_capacity(1 << 20, w),
            hash: blake3::Hasher::new(),
            last_us: 0,
            events: 0,
            buf: Vec::new(),
        };
        let mut h = MAGIC.to_vec();
        h.extend_from_slice(&[VERSION, 0, 0, 0, 0, 0, 0, 0]);
        t.put(&h)?;
        Ok(t)
    }

    fn put(&mut self, b: &[u8]) -> io::Result<()> {
        self.hash.update(b);
        self.out.write_all(b)
    }

    pub fn event(&mut self, e: &Event) -> io::Result<()> {
        let mut b = std::mem::take(&mut self.buf);
        b.clear();
        let at = e.at_us().max(self.last_us);
        let delta = at - self.last_us;
        self.last_us = at;
        match e {
            Event::Open { conn, .. } => {
                b.push(TAG_OPEN);
                put_varint(&mut b, u64::from(*conn));
                put_varint(&mut b, delta);
            }
            Event::Data {
                conn, dir, bytes, ..
            } => {
                b.push(TAG_DATA);
                put_varint(&mut b, u64::from(*conn));
                put_varint(&mut b, delta);
                b.push(dir.index() as u8);
                put_varint(&mut b, bytes.len() as u64);
            }
            Event::Shutdown { conn, dir, .. } => {
                b.push(TAG_SHUT);
                put_varint(&mut b, u64::from(*conn));
                put_varint(&mut b, delta);
                b.push(dir.index() as u8);
            }
        }
        self.put(&b)?;
        if let Event::Data { bytes, .. } = e {
            self.put(bytes)?;
        }
        self.buf = b;
        self.events += 1;
        Ok(())
    }

    /// Writes the trailer and flushes; a trace without it is rejected as truncated.
    pub fn finish(mut self) -> io::Result<W> {
        let mut b = vec![TAG_END];
        b.extend_from_slice(&self.events.to_be_bytes());
        self.put(&b)?;
        let h = self.hash.finalize();
        self.out.write_all(h.as_bytes())?;
        self.out.flush()?;
        self.out.into_inner().map_err(|e| e.into_error())
    }
}

/// Reads events back, checking every field; the trailer's hash is checked when it is reached.
pub struct Reader<R: Read> {
    inp: BufReader<R>,
    hash: blake3::Hasher,
    at_us: u64,
    events: u64,
    done: bool,
}

impl<R: Read> Reader<R> {
    pub fn new(r: R) -> Result<Self, TraceError> {
        let mut t = Reader {
            inp: BufReader::with_capacity(1 << 20, r),
            hash: blake3::Hasher::new(),
            at_us: 0,
            events: 0,
            done: false,
        };
        let mut h = [0u8; 16];
        t.exact(&mut h)?;
        if &h[..8] != MAGIC {
            return Err(TraceError::Magic);
        }
        if h[8] != VERSION {
            return Err(TraceError::Version(h[8]));
        }
        Ok(t)
    }

    fn exact(&mut self, b: &mut [u8]) -> Result<(), TraceError> {
        self.inp.read_exact(b).map_err(|e| match e.kind() {
            io::ErrorKind::UnexpectedEof => TraceError::Truncated,
            _ => TraceError::Io(e),
        })?;
        self.hash.update(b);
        Ok(())
    }

    fn varint(&mut self, what: &str, max: u64) -> Result<u64, TraceError> {
        let mut v = 0u64;
        for i in 0..10 {
            let mut b = [0u8; 1];
            self.exact(&mut b)?;
            v |= u64::from(b[0] & 0x7f) << (7 * i);
            if b[0] & 0x80 == 0 {
                if v > max {
                    return Err(TraceError::Corrupt(format!("{what} {v} exceeds {max}")));
                }
                return Ok(v);
            }
        }
        Err(TraceError::Corrupt(format!("{what} is not a valid number")))
    }

    fn dir(&mut self) -> Result<Dir, TraceError> {
        let mut b = [0u8; 1];
        self.exact(&mut b)?;
        match b[0] {
            0 => Ok(Dir::ToServer),
            1 => Ok(Dir::ToClient),
            d => Err(TraceError::Corrupt(format!("direction {d}"))),
        }
    }

    /// The next event, or `None` after a trailer that checks out.
    pub fn next_event(&mut self) -> Result<Option<Event>, TraceError> {
        if self.done {
            return Ok(None);
        }
        let mut tag = [0u8; 1];
        self.exact(&mut tag)?;
        if tag[0] == TAG_END {
            let mut n = [0u8; 8];
            self.exact(&mut n)?;
            let want = self.hash.finalize();
            let mut got = [0u8; 32];
            self.inp
                .read_exact(&mut got)
                .map_err(|_| TraceError::Truncated)?;
            if u64::from_be_bytes(n) != self.events || got != *want.as_bytes() {
                return Err(TraceError::Corrupt("the checksum does not match".into()));
            }
            self.done = true;
            return Ok(None);
        }
        let conn = self.varint("connection id", MAX_CONNS)? as u32;
        let delta = self.varint("time step", 1 << 50)?;
        self.at_us = self.at_us.saturating_add(delta);
        let at_us = self.at_us;
        self.events += 1;
        Ok(Some(match tag[0] {
            TAG_OPEN => Event::Open { conn, at_us },
            TAG_DATA => {
                let dir = self.dir()?;
                let len = self.varint("event length", MAX_EVENT)? as usize;
                let mut bytes = vec![0u8; len];
                self.exact(&mut bytes)?;
                Event::Data {
                    conn,
                    at_us,
                    dir,
                    bytes,
                }
            }
            TAG_SHUT => Event::Shutdown {
                conn,
                at_us,
                dir: self.dir()?,
            },
            t => return Err(TraceError::Corrupt(format!("unknown event tag {t}"))),
        }))
    }
}

/// Reads a whole trace into memory after checking it (a truncated or damaged one is an error).
pub fn load(path: &Path) -> Result<Vec<Event>, TraceError> {
    let f = std::fs::File::open(path)?;
    let mut r = Reader::new(f)?;
    let mut v = Vec::new();
    while let Some(e) = r.next_event()? {
        v.push(e);
    }
    Ok(v)
}

/// A short identity of a trace's content, so a replayer and its sink agree on the trace.
pub fn identity(events: &[Event]) -> u64 {
    let mut h = blake3::Hasher::new();
    for e in events {
        h.update(&e.conn().to_le_bytes());
        if let Event::Data { dir, bytes, .. } = e {
            h.update(&[dir.index() as u8]);
            h.update(bytes);
        }
    }
    let b = h.finalize();
    u64::from_le_bytes(b.as_bytes()[..8].try_into().unwrap_or([0; 8]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_events() -> impl Strategy<Value = Vec<Event>> {
        proptest::collection::vec(
            (
                0u32..5,
                0u64..10_000,
                0u8..3,
                any::<bool>(),
                proptest::collection::vec(any::<u8>(), 0..300),
            ),
            0..40,
        )
        .prop_map(|v| {
            let mut at = 0;
            v.into_iter()
                .map(|(conn, step, kind, d, bytes)| {
                    at += step;
                    let dir = if d { Dir::ToServer } else { Dir::ToClient };
                    match kind {
                        0 => Event::Open { conn, at_us: at },
                        1 => Event::Data {
                            conn,
                            at_us: at,
                            dir,
                            bytes,
                        },
                        _ => Event::Shutdown {
                            conn,
                            at_us: at,
                            dir,
                        },
                    }
                })
                .collect()
        })
    }

    fn write(events: &[Event]) -> Vec<u8> {
        let mut w = Writer::new(Vec::new()).expect("writer");
        for e in events {
            w.event(e).expect("event");
        }
        w.finish().expect("finish")
    }

    fn read(b: &[u8]) -> Result<Vec<Event>, TraceError> {
        let mut r = Reader::new(b)?;
        let mut v = Vec::new();
        while let Some(e) = r.next_event()? {
            v.push(e);
        }
        Ok(v)
    }

    proptest! {
        #[test]
        fn round_trip(events in arb_events()) {
            let b = write(&events);
            prop_assert_eq!(read(&b).expect("read"), events);
        }

        #[test]
        fn every_truncation_and_flip_is_rejected(events in arb_events(), cut in any::<prop::sample::Index>(), bit in 0u8..8) {
            let b = write(&events);
            let n = cut.index(b.len());
            prop_assert!(read(&b[..n]).is_err(), "truncated at {n} of {}", b.len());
            let mut d = b.clone();
            d[n] ^= 1 << bit;
            prop_assert!(read(&d).is_err(), "flip at {n}");
        }
    }

    #[test]
    fn hostile_lengths_fail_before_allocating() {
        let mut b = MAGIC.to_vec();
        b.extend_from_slice(&[VERSION, 0, 0, 0, 0, 0, 0, 0]);
        b.extend_from_slice(&[TAG_DATA, 0, 0, 0]);
        b.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]);
        assert!(matches!(read(&b), Err(TraceError::Corrupt(_))));
        assert!(matches!(read(b"GIF89a..........."), Err(TraceError::Magic)));
        assert!(matches!(read(b"WOTR"), Err(TraceError::Truncated)));
    }
}
