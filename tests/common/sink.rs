//! Streams measured while they run: a sink that counts each stream's bytes as they arrive and
//! answers its hash at the end, and a sender that writes at a steady pace (or as fast as it
//! goes) until told to stop, then checks the sink's hash against what it sent.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Bytes received so far per stream, keyed by the id each stream starts with.
#[derive(Default)]
pub struct Sink {
    progress: Mutex<HashMap<u64, Arc<AtomicU64>>>,
}

impl Sink {
    /// The counter of stream `id` (created at zero if it has not started yet).
    pub fn counter(&self, id: u64) -> Arc<AtomicU64> {
        self.progress
            .lock()
            .expect("lock")
            .entry(id)
            .or_default()
            .clone()
    }

    /// Reads a stream: its id (8 bytes), then everything to its end, counted as it comes; then
    /// writes the blake3 hash of what followed the id.
    pub fn take(&self, mut s: TcpStream) {
        let mut id = [0u8; 8];
        if s.read_exact(&mut id).is_err() {
            return;
        }
        let count = self.counter(u64::from_le_bytes(id));
        let mut h = blake3::Hasher::new();
        let mut buf = vec![0u8; 256 * 1024];
        let mut off = 0u64;
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    h.update(&buf[..n]);
                    off += n as u64;
                    count.store(off, Ordering::Relaxed);
                }
                // A broken stream gets no hash: its sender sees the error.
                Err(_) => return,
            }
        }
        let _ = s.write_all(h.finalize().as_bytes());
    }
}

/// A sink listening in `wan`'s east site on `port`, each stream on a thread: the sink and its
/// address.
pub fn in_east(wan: &wansim::Wan, port: u16) -> (Arc<Sink>, SocketAddr) {
    let sink = Arc::new(Sink::default());
    let ip = wansim::Site::East.addr();
    let l = wan
        .in_site(wansim::Site::East, move || TcpListener::bind((ip, port)))
        .expect("east")
        .expect("bind");
    let s = sink.clone();
    (sink, super::serve_on(l, move |c| s.take(c)))
}

/// How a [`send`] writes.
pub struct Pace {
    /// Bytes per write.
    pub piece: usize,
    /// Time between writes; zero: as fast as the stream takes them.
    pub every: Duration,
}

/// Sends stream `id` to a [`Sink`]: `source(offset, buf)` fills each piece, paced as `pace`
/// says, until `stop`; `sent` follows the bytes written. Then ends the stream and checks the
/// sink's hash. Returns the bytes sent.
pub fn send(
    mut s: TcpStream,
    id: u64,
    mut source: impl FnMut(u64, &mut [u8]),
    pace: Pace,
    stop: &AtomicBool,
    sent: &AtomicU64,
) -> Result<u64, String> {
    s.write_all(&id.to_le_bytes()).map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; pace.piece];
    let mut h = blake3::Hasher::new();
    let mut off = 0u64;
    let start = Instant::now();
    let mut ticks = 0u32;
    while !stop.load(Ordering::Relaxed) {
        source(off, &mut buf);
        s.write_all(&buf).map_err(|e| format!("write: {e}"))?;
        h.update(&buf);
        off += buf.len() as u64;
        sent.store(off, Ordering::Relaxed);
        if !pace.every.is_zero() {
            ticks += 1;
            let due = start + pace.every * ticks;
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
        }
    }
    s.shutdown(Shutdown::Write).map_err(|e| e.to_string())?;
    let mut got = [0u8; 32];
    s.read_exact(&mut got)
        .map_err(|e| format!("stream {id}: no hash from the sink: {e}"))?;
    if got != *h.finalize().as_bytes() {
        return Err(format!("stream {id}: {off} bytes arrived changed"));
    }
    Ok(off)
}
