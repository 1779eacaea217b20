//! `wanopt-replay record`: a transparent proxy between real clients and their server that writes
//! each connection's bytes, both ways, with their timing, to a trace. Bytes are recorded before
//! they are forwarded, so the trace keeps the causal order: an answer is always recorded after the
//! request it answers.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::trace::{Dir, Event, Writer};

#[derive(Debug, Clone)]
pub struct RecordOpts {
    pub listen: SocketAddr,
    /// The real server, `host:port`.
    pub target: String,
    pub trace: PathBuf,
    /// Stop after this many connections have finished.
    pub connections: Option<usize>,
    /// Stop after this long.
    pub duration: Option<Duration>,
}

/// What a recording holds.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RecordSummary {
    pub connections: usize,
    pub bytes_to_server: u64,
    pub bytes_to_client: u64,
    pub seconds: f64,
}

/// A failure of the recorder itself (a connection's failure is logged, not fatal).
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("cannot listen on {0}: {1}")]
    Listen(SocketAddr, std::io::Error),
    #[error("cannot write the trace {0}: {1}")]
    Trace(PathBuf, std::io::Error),
}

type SharedWriter = Arc<Mutex<Option<Writer<std::fs::File>>>>;

struct Recorder {
    writer: SharedWriter,
    start: Instant,
    failed: AtomicBool,
    bytes: [std::sync::atomic::AtomicU64; 2],
}

impl Recorder {
    fn event(&self, e: impl FnOnce(u64) -> Event) {
        let mut g = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(w) = g.as_mut() {
            // The time is taken under the lock, so events are written in time order.
            let ev = e(self.start.elapsed().as_micros() as u64);
            if w.event(&ev).is_err() {
                self.failed.store(true, SeqCst);
            }
        }
    }
}

pub fn bind(opts: &RecordOpts) -> Result<TcpListener, RecordError> {
    TcpListener::bind(opts.listen).map_err(|e| RecordError::Listen(opts.listen, e))
}

/// Records until `stop` is set, the connection count or the duration is reached; then lets open
/// connections finish (up to 5 s) and writes the trailer.
pub fn record(
    listener: TcpListener,
    opts: &RecordOpts,
    stop: &AtomicBool,
) -> Result<RecordSummary, RecordError> {
    let file = std::fs::File::create(&opts.trace)
        .map_err(|e| RecordError::Trace(opts.trace.clone(), e))?;
    let w = Writer::new(file).map_err(|e| RecordError::Trace(opts.trace.clone(), e))?;
    let rec = Arc::new(Recorder {
        writer: Arc::new(Mutex::new(Some(w))),
        start: Instant::now(),
        failed: AtomicBool::new(false),
        bytes: Default::default(),
    });
    let _ = listener.set_nonblocking(true);
    let next_id = AtomicU32::new(0);
    let finished = Arc::new(AtomicUsize::new(0));
    let active: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
    let mut threads = Vec::new();
    loop {
        let done = stop.load(SeqCst)
            || opts.connections.is_some_and(|n| finished.load(SeqCst) >= n)
            || opts.duration.is_some_and(|d| rec.start.elapsed() >= d);
        if done {
            break;
        }
        let (client, from) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(_) => continue,
        };
        let _ = client.set_nonblocking(false);
        let server = match connect(&opts.target) {
            Ok(s) => s,
            Err(e) => {
                eprintln!(
                    "wanopt-replay record: client {from}: cannot reach {}: {e}",
                    opts.target
                );
                continue;
            }
        };
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        let conn = next_id.fetch_add(1, SeqCst);
        rec.event(|at_us| Event::Open { conn, at_us });
        if let (Ok(a), Ok(b)) = (client.try_clone(), server.try_clone()) {
            let mut g = active.lock().unwrap_or_else(|p| p.into_inner());
            g.push(a);
            g.push(b);
        }
        let pair = [
            (client.try_clone(), server.try_clone(), Dir::ToServer),
            (server.try_clone(), client.try_clone(), Dir::ToClient),
        ];
        let mut halves = Vec::new();
        for (from_s, to_s, dir) in pair {
            let (Ok(from_s), Ok(to_s)) = (from_s, to_s) else {
                continue;
            };
            let rec = rec.clone();
            halves.push(std::thread::spawn(move || {
                pump(&rec, conn, dir, from_s, to_s)
            }));
        }
        let finished = finished.clone();
        threads.push(std::thread::spawn(move || {
            for h in halves {
                let _ = h.join();
            }
            drop((client, server));
            finished.fetch_add(1, SeqCst);
        }));
    }
    // Let open connections finish, then cut what is left.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !threads.iter().all(|t| t.is_finished()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    for s in active.lock().unwrap_or_else(|p| p.into_inner()).iter() {
        let _ = s.shutdown(Shutdown::Both);
    }
    for t in threads {
        let _ = t.join();
    }
    let w = rec.writer.lock().unwrap_or_else(|p| p.into_inner()).take();
    if let Some(w) = w {
        w.finish()
            .map_err(|e| RecordError::Trace(opts.trace.clone(), e))?;
    }
    if rec.failed.load(SeqCst) {
        return Err(RecordError::Trace(
            opts.trace.clone(),
            std::io::Error::other("a write failed; the trace is incomplete"),
        ));
    }
    Ok(RecordSummary {
        connections: next_id.load(SeqCst) as usize,
        bytes_to_server: rec.bytes[0].load(SeqCst),
        bytes_to_client: rec.bytes[1].load(SeqCst),
        seconds: rec.start.elapsed().as_secs_f64(),
    })
}

fn connect(target: &str) -> std::io::Result<TcpStream> {
    let mut last = None;
    for a in target.to_socket_addrs()? {
        match TcpStream::connect_timeout(&a, Duration::from_secs(10)) {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("no address")))
}

/// Copies one direction, recording each read before forwarding it; an end is recorded and
/// passed on as a half-close, an error closes both sockets.
fn pump(rec: &Recorder, conn: u32, dir: Dir, mut from: TcpStream, mut to: TcpStream) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) => {
                rec.event(|at_us| Event::Shutdown { conn, at_us, dir });
                let _ = to.shutdown(Shutdown::Write);
                return;
            }
            Ok(n) => {
                rec.bytes[dir.index()].fetch_add(n as u64, SeqCst);
                let bytes = buf[..n].to_vec();
                rec.event(|at_us| Event::Data {
                    conn,
                    at_us,
                    dir,
                    bytes,
                });
                if to.write_all(&buf[..n]).is_err() {
                    let _ = from.shutdown(Shutdown::Both);
                    return;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => {
                let _ = to.shutdown(Shutdown::Both);
                return;
            }
        }
    }
}
