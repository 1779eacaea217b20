//! The test client (`wanopt-replay client`, oratcptest's client mode): sends messages over one or
//! more connections in SYNC (wait for each acknowledgement, as Data Guard SYNC) or ASYNC mode,
//! prints oratcptest's interval lines and averages plus latency percentiles, and checks that the
//! server received exactly the bytes sent.

use std::io::{BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::proto::{self, FLAG_SYNC, FLAG_WRITE};
use crate::stats::{Histogram, mbytes_per_s};
use crate::workload::Rng;

/// How long the client waits for a server's ready when no -timeout is given.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Sync,
    Async,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Payload {
    Random,
    Zero,
    File(PathBuf),
    /// Bytes in memory (a generated workload), sent in order and repeated if the test is longer.
    Bytes {
        name: String,
        data: Arc<Vec<u8>>,
    },
}

/// How long a test runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    Time(Duration),
    Bytes(u64),
    /// Until interrupted.
    Forever,
}

#[derive(Debug, Clone)]
pub struct ClientOpts {
    /// `host:port` of the server (or of a tunnel's local port).
    pub addr: String,
    pub mode: Mode,
    /// Message payload length (`-length`, default 1 Mbyte).
    pub length: u32,
    /// Lengths uniformly between 512 bytes and `length` (`-random_length`).
    pub random_length: bool,
    pub delay: Duration,
    /// Delays uniformly between zero and `delay` (`-random_delay`).
    pub random_delay: bool,
    pub num_conn: usize,
    pub payload: Payload,
    pub duration: Limit,
    pub interval: Duration,
    /// The server writes and syncs each message before acknowledging (`-write`).
    pub write: bool,
    /// `SO_SNDBUF` (`-sockbuf`); `None` keeps the system default.
    pub sockbuf: Option<usize>,
    /// Connect, read and write timeout (`-timeout`); `None` waits forever (but connects for 10 s).
    pub timeout: Option<Duration>,
    /// Repeat the test every `.0` for `.1` (`-freq=1h/24h`).
    pub freq: Option<(Duration, Duration)>,
    /// Also write the report to this file (`-output`).
    pub output: Option<PathBuf>,
    /// Print one JSON summary instead of text.
    pub json: bool,
    /// Print nothing (a caller reports; `compare`).
    pub quiet: bool,
    /// Congestion control of the client's sockets (`cubic`, `bbr`); the system default if unset.
    pub congestion: Option<String>,
    /// Seed of random payloads, lengths and delays.
    pub seed: u64,
}

impl Default for ClientOpts {
    fn default() -> Self {
        ClientOpts {
            addr: String::new(),
            mode: Mode::Sync,
            length: 1 << 20,
            random_length: false,
            delay: Duration::ZERO,
            random_delay: false,
            num_conn: 1,
            payload: Payload::Random,
            duration: Limit::Forever,
            interval: Duration::from_secs(10),
            write: false,
            sockbuf: None,
            timeout: None,
            freq: None,
            output: None,
            json: false,
            quiet: false,
            congestion: None,
            seed: 1,
        }
    }
}

/// A client failure, with a message for the user.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot resolve {0}: {1}")]
    Resolve(String, String),
    #[error("cannot connect to {0}: {1} (is `wanopt-replay server` listening there?)")]
    Connect(String, std::io::Error),
    #[error("{0} is not a wanopt-replay server: {1}")]
    Handshake(String, proto::ProtoError),
    #[error("connection {0}: {1}")]
    Transfer(usize, String),
    #[error("cannot read payload file {0}: {1}")]
    PayloadFile(PathBuf, std::io::Error),
    #[error("{0}")]
    Output(std::io::Error),
}

/// One interval line.
#[derive(Debug, Clone, Serialize)]
pub struct IntervalLine {
    pub at: String,
    pub mbytes_per_s: f64,
    pub latency_ms: Option<f64>,
    pub disk_write_ms: Option<f64>,
}

/// Latency summary in milliseconds.
#[derive(Debug, Clone, Serialize)]
pub struct LatencySummary {
    pub mean: f64,
    pub p50: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
    /// The whole distribution, for charts: (ms, fraction at or below).
    #[serde(skip)]
    pub cdf: Vec<(f64, f64)>,
}

impl LatencySummary {
    pub fn of(h: &Histogram) -> Option<Self> {
        Some(LatencySummary {
            mean: h.mean_ms()?,
            p50: h.quantile_ms(0.5)?,
            p99: h.quantile_ms(0.99)?,
            p999: h.quantile_ms(0.999)?,
            max: h.max_ms(),
            cdf: h.cdf_ms(),
        })
    }
}

/// What a test measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub mode: &'static str,
    pub connections: usize,
    pub message_length: u32,
    pub bytes: u64,
    pub messages: u64,
    pub seconds: f64,
    pub mbytes_per_s: f64,
    pub latency_ms: Option<LatencySummary>,
    pub disk_write_ms: Option<LatencySummary>,
    pub socket_send_buffer: usize,
    pub intervals: Vec<IntervalLine>,
    /// True when every connection's server confirmed the exact bytes and messages sent.
    pub verified: bool,
}

#[derive(Default)]
struct Shared {
    lat: Histogram,
    disk: Histogram,
    total_lat: Histogram,
    total_disk: Histogram,
}

/// Local wall-clock time as `HH:MM:SS`, as oratcptest prints it.
pub fn clock() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as libc::time_t;
    // SAFETY: localtime_r writes only into the `tm` we pass; a zeroed tm is a valid value.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are valid for the duration of the call.
    let ok = unsafe { !libc::localtime_r(&t, &mut tm).is_null() };
    if !ok {
        return "--:--:--".into();
    }
    format!("{:02}:{:02}:{:02}", tm.tm_hour, tm.tm_min, tm.tm_sec)
}

fn human_size(n: u64) -> String {
    if n == 1 << 20 {
        "1 Mbyte".into()
    } else if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{} Mbytes", n >> 20)
    } else if n >= 1024 && n.is_multiple_of(1024) {
        format!("{} kbytes", n >> 10)
    } else {
        format!("{n} bytes")
    }
}

fn human_time(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{} seconds", s as u64)
    } else {
        format!("{s:.3} seconds")
    }
}

/// The "[Requesting a test]" block.
fn header(o: &ClientOpts) -> String {
    let yes_no = |b: bool| if b { "YES" } else { "NO" };
    let delay = if o.delay.is_zero() {
        "NO".to_string()
    } else {
        format!(
            "{} ms{}",
            o.delay.as_millis(),
            if o.random_delay { " (random)" } else { "" }
        )
    };
    let duration = match o.duration {
        Limit::Time(d) => human_time(d),
        Limit::Bytes(b) => human_size(b),
        Limit::Forever => "until interrupted".into(),
    };
    format!(
        "[Requesting a test]\n\
         \tMessage payload        = {}{}\n\
         \tPayload content type   = {}\n\
         \tDelay between messages = {delay}\n\
         \tNumber of connections  = {}\n\
         \tSocket send buffer     = {}\n\
         \tTransport mode         = {}\n\
         \tDisk write             = {}\n\
         \tStatistics interval    = {}\n\
         \tTest duration          = {duration}\n\
         \tTest frequency         = {}\n\
         \tNetwork Timeout        = {}\n\
         \t(1 Mbyte = 1024x1024 bytes)\n",
        human_size(u64::from(o.length)),
        if o.random_length {
            " (random length)"
        } else {
            ""
        },
        match &o.payload {
            Payload::Random => "RANDOM".to_string(),
            Payload::Zero => "ZERO".to_string(),
            Payload::File(p) => p.display().to_string(),
            Payload::Bytes { name, .. } => name.clone(),
        },
        o.num_conn,
        o.sockbuf
            .map_or("(system default)".to_string(), |n| format!("{n} bytes")),
        match o.mode {
            Mode::Sync => "SYNC",
            Mode::Async => "ASYNC",
        },
        yes_no(o.write),
        human_time(o.interval),
        o.freq.map_or("NO".to_string(), |(e, t)| format!(
            "every {} for {}",
            human_time(e),
            human_time(t)
        )),
        o.timeout.map_or("NO".to_string(), human_time),
    )
}

/// Writes text to stdout (unless JSON was asked for) and to the output file.
struct Out {
    json: bool,
    file: Option<std::fs::File>,
}

impl Out {
    fn line(&mut self, s: &str) -> Result<(), ClientError> {
        if !self.json {
            let mut o = std::io::stdout().lock();
            let _ = writeln!(o, "{s}");
            let _ = o.flush();
        }
        if let Some(f) = self.file.as_mut() {
            writeln!(f, "{s}").map_err(ClientError::Output)?;
        }
        Ok(())
    }
}

/// Runs the test (repeatedly with `freq`) and returns the last report.
pub fn run(opts: &ClientOpts) -> Result<Report, ClientError> {
    let file = match &opts.output {
        Some(p) => Some(std::fs::File::create(p).map_err(ClientError::Output)?),
        None => None,
    };
    let mut out = Out {
        json: opts.json || opts.quiet,
        file,
    };
    let Some((every, total)) = opts.freq else {
        let r = run_once(opts, &mut out)?;
        if opts.json && !opts.quiet {
            println!("{}", serde_json::to_string_pretty(&r).unwrap_or_default());
        }
        return Ok(r);
    };
    let start = Instant::now();
    let mut last;
    loop {
        let round = Instant::now();
        last = run_once(opts, &mut out)?;
        if opts.json && !opts.quiet {
            println!("{}", serde_json::to_string(&last).unwrap_or_default());
        }
        let next = round + every;
        if next.duration_since(start) >= total {
            return Ok(last);
        }
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
    }
}

fn connect(opts: &ClientOpts) -> Result<TcpStream, ClientError> {
    let addrs: Vec<_> = opts
        .addr
        .to_socket_addrs()
        .map_err(|e| ClientError::Resolve(opts.addr.clone(), e.to_string()))?
        .collect();
    let timeout = opts.timeout.unwrap_or(Duration::from_secs(10));
    let mut last = None;
    for a in addrs {
        let sock =
            socket2::Socket::new(socket2::Domain::for_address(a), socket2::Type::STREAM, None)
                .map_err(|e| ClientError::Connect(opts.addr.clone(), e))?;
        if let Some(n) = opts.sockbuf {
            let _ = sock.set_send_buffer_size(n);
        }
        if let Some(cc) = &opts.congestion {
            sock.set_tcp_congestion(cc.as_bytes()).map_err(|e| {
                ClientError::Connect(
                    opts.addr.clone(),
                    std::io::Error::new(e.kind(), format!("congestion control {cc}: {e}")),
                )
            })?;
        }
        match sock.connect_timeout(&a.into(), timeout) {
            Ok(()) => {
                let s: TcpStream = sock.into();
                let _ = s.set_nodelay(true);
                let _ = s.set_read_timeout(opts.timeout);
                let _ = s.set_write_timeout(opts.timeout);
                return Ok(s);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(ClientError::Connect(
        opts.addr.clone(),
        last.unwrap_or_else(|| std::io::Error::other("no address")),
    ))
}

fn run_once(opts: &ClientOpts, out: &mut Out) -> Result<Report, ClientError> {
    let file_payload = match &opts.payload {
        Payload::File(p) => {
            let d = std::fs::read(p).map_err(|e| ClientError::PayloadFile(p.clone(), e))?;
            if d.is_empty() {
                return Err(ClientError::PayloadFile(
                    p.clone(),
                    std::io::Error::other("the file is empty"),
                ));
            }
            Some(Arc::new(d))
        }
        Payload::Bytes { data, .. } if !data.is_empty() => Some(data.clone()),
        _ => None,
    };
    out.line(&header(opts))?;
    let mut socks = Vec::new();
    let flags = (if opts.mode == Mode::Sync {
        FLAG_SYNC
    } else {
        0
    }) | if opts.write { FLAG_WRITE } else { 0 };
    for _ in 0..opts.num_conn.max(1) {
        let mut s = connect(opts)?;
        // Something that is not our server may never answer: bound the wait for its ready.
        let _ = s.set_read_timeout(Some(opts.timeout.unwrap_or(HANDSHAKE_TIMEOUT)));
        proto::write_request(&mut s, flags)
            .map_err(|e| ClientError::Handshake(opts.addr.clone(), e.into()))?;
        proto::read_ready(&mut s).map_err(|e| ClientError::Handshake(opts.addr.clone(), e))?;
        let _ = s.set_read_timeout(opts.timeout);
        socks.push(s);
    }
    let sndbuf = socket2::SockRef::from(&socks[0])
        .send_buffer_size()
        .unwrap_or(0);
    out.line(&format!("({}) The server is ready.", clock()))?;
    let sync = opts.mode == Mode::Sync;
    out.line(if sync {
        "                    Throughput                 Latency"
    } else {
        "                    Throughput"
    })?;

    let start = Instant::now();
    let deadline = match opts.duration {
        Limit::Time(d) => Some(start + d),
        _ => None,
    };
    let budget = Arc::new(AtomicU64::new(match opts.duration {
        Limit::Bytes(b) => b,
        _ => u64::MAX,
    }));
    let bytes = Arc::new(AtomicU64::new(0));
    let messages = Arc::new(AtomicU64::new(0));
    let shared = Arc::new(Mutex::new(Shared::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    for (i, s) in socks.into_iter().enumerate() {
        let o = opts.clone();
        let (budget, bytes, messages, shared, stop, file_payload) = (
            budget.clone(),
            bytes.clone(),
            messages.clone(),
            shared.clone(),
            stop.clone(),
            file_payload.clone(),
        );
        threads.push(std::thread::spawn(move || {
            let r = sender(
                s,
                &o,
                i,
                deadline,
                &budget,
                &bytes,
                &messages,
                &shared,
                &stop,
                file_payload.as_deref(),
            );
            if r.is_err() {
                stop.store(true, Relaxed);
            }
            r
        }));
    }
    let mut intervals = Vec::new();
    let mut last_bytes = 0;
    let mut last_at = start;
    let mut next = start + opts.interval;
    while !threads.iter().all(|t| t.is_finished()) {
        std::thread::sleep(
            Duration::from_millis(10).min(next.saturating_duration_since(Instant::now())),
        );
        if Instant::now() < next {
            continue;
        }
        let now = Instant::now();
        let b = bytes.load(Relaxed);
        let (lat, disk) = {
            let mut g = shared.lock().unwrap_or_else(|p| p.into_inner());
            let l = (g.lat.mean_ms(), g.disk.mean_ms());
            g.lat = Histogram::default();
            g.disk = Histogram::default();
            l
        };
        let line = IntervalLine {
            at: clock(),
            mbytes_per_s: mbytes_per_s(b - last_bytes, (now - last_at).as_secs_f64()),
            latency_ms: lat,
            disk_write_ms: if opts.write { disk } else { None },
        };
        out.line(&interval_text(&line))?;
        intervals.push(line);
        last_bytes = b;
        last_at = now;
        next += opts.interval;
    }
    let mut verified = true;
    let mut first_err = None;
    for t in threads {
        match t.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                verified = false;
                first_err.get_or_insert(e);
            }
            Err(_) => verified = false,
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    let secs = start.elapsed().as_secs_f64();
    let g = shared.lock().unwrap_or_else(|p| p.into_inner());
    let report = Report {
        mode: if sync { "SYNC" } else { "ASYNC" },
        connections: opts.num_conn.max(1),
        message_length: opts.length,
        bytes: bytes.load(Relaxed),
        messages: messages.load(Relaxed),
        seconds: secs,
        mbytes_per_s: mbytes_per_s(bytes.load(Relaxed), secs),
        latency_ms: LatencySummary::of(&g.total_lat),
        disk_write_ms: if opts.write {
            LatencySummary::of(&g.total_disk)
        } else {
            None
        },
        socket_send_buffer: sndbuf,
        intervals,
        verified,
    };
    out.line(&format!("({}) Test finished.", clock()))?;
    out.line(&summary_text(&report))?;
    Ok(report)
}

fn interval_text(l: &IntervalLine) -> String {
    let mut s = format!("({}) {:>14.3} Mbytes/s", l.at, l.mbytes_per_s);
    if let Some(ms) = l.latency_ms {
        s += &format!(" {:>18.3} ms", ms);
    }
    if let Some(d) = l.disk_write_ms {
        s += &format!("   (disk-write {d:.3} ms)");
    }
    s
}

fn summary_text(r: &Report) -> String {
    let mut s = format!(
        "               Socket send buffer = {} bytes\n                  Avg. throughput = {:.3} Mbytes/s",
        r.socket_send_buffer, r.mbytes_per_s
    );
    if let Some(l) = &r.latency_ms {
        s += &format!("\n                     Avg. latency = {:.3} ms", l.mean);
        if let Some(d) = &r.disk_write_ms {
            s += &format!(" (disk-write {:.3} ms)", d.mean);
        }
        s += &format!(
            "\n  Latency p50 / p99 / p99.9 / max = {:.3} / {:.3} / {:.3} / {:.3} ms",
            l.p50, l.p99, l.p999, l.max
        );
    }
    s += &format!(
        "\n                       Bytes sent = {} in {} messages (server confirmed)",
        r.bytes, r.messages
    );
    s
}

#[allow(clippy::too_many_arguments)]
fn sender(
    s: TcpStream,
    o: &ClientOpts,
    conn: usize,
    deadline: Option<Instant>,
    budget: &AtomicU64,
    bytes: &AtomicU64,
    messages: &AtomicU64,
    shared: &Mutex<Shared>,
    stop: &AtomicBool,
    file_payload: Option<&Vec<u8>>,
) -> Result<(), ClientError> {
    let err = |e: std::io::Error| ClientError::Transfer(conn, e.to_string());
    let mut rd = BufReader::new(s.try_clone().map_err(err)?);
    let mut wr = s;
    // Fast deterministic bytes for RANDOM payloads: every message differs, as real redo does.
    let mut rng = Rng::new(o.seed.wrapping_add(conn as u64));
    let mut buf = vec![0u8; 4 + o.length as usize];
    let (mut my_bytes, mut my_msgs) = (0u64, 0u64);
    let mut file_off = 0usize;
    loop {
        if stop.load(Relaxed) || deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        let mut len = if o.random_length && o.length > 512 {
            512 + rng.below(u64::from(o.length) - 511) as u32
        } else {
            o.length
        };
        // Take the message's bytes from the shared budget (a byte-limited test).
        let take = budget
            .fetch_update(Relaxed, Relaxed, |b| {
                b.checked_sub(u64::from(len).min(b)).filter(|_| b > 0)
            })
            .map(|b| u64::from(len).min(b));
        match take {
            Ok(n) => len = n as u32,
            Err(_) => break,
        }
        let payload = &mut buf[4..4 + len as usize];
        match (&o.payload, file_payload) {
            (Payload::Random, _) => rng.fill(payload),
            (Payload::Zero, _) => payload.fill(0),
            (Payload::File(_) | Payload::Bytes { .. }, Some(f)) => {
                let mut at = 0;
                while at < payload.len() {
                    let n = (payload.len() - at).min(f.len() - file_off);
                    payload[at..at + n].copy_from_slice(&f[file_off..file_off + n]);
                    at += n;
                    file_off = (file_off + n) % f.len();
                }
            }
            (Payload::File(_) | Payload::Bytes { .. }, None) => payload.fill(0),
        }
        buf[..4].copy_from_slice(&len.to_be_bytes());
        let t = Instant::now();
        wr.write_all(&buf[..4 + len as usize]).map_err(err)?;
        if o.mode == Mode::Sync {
            let mut ack = [0u8; 4];
            rd.read_exact(&mut ack).map_err(err)?;
            let us = t.elapsed().as_micros() as u64;
            let disk = u64::from(u32::from_be_bytes(ack));
            let mut g = shared.lock().unwrap_or_else(|p| p.into_inner());
            g.lat.record(us);
            g.total_lat.record(us);
            if o.write {
                g.disk.record(disk);
                g.total_disk.record(disk);
            }
        }
        my_bytes += u64::from(len);
        my_msgs += 1;
        bytes.fetch_add(u64::from(len), Relaxed);
        messages.fetch_add(1, Relaxed);
        if !o.delay.is_zero() {
            let d = if o.random_delay {
                Duration::from_micros(rng.below(o.delay.as_micros() as u64 + 1))
            } else {
                o.delay
            };
            std::thread::sleep(d);
        }
    }
    wr.write_all(&proto::END.to_be_bytes()).map_err(err)?;
    let (got_bytes, got_msgs) = proto::read_summary(&mut rd).map_err(err)?;
    if (got_bytes, got_msgs) != (my_bytes, my_msgs) {
        return Err(ClientError::Transfer(
            conn,
            format!(
                "the server received {got_bytes} bytes in {got_msgs} messages, we sent {my_bytes} in {my_msgs}"
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_print_as_oratcptest_does() {
        assert_eq!(human_size(1 << 20), "1 Mbyte");
        assert_eq!(human_size(8192), "8 kbytes");
        assert_eq!(human_size(8020), "8020 bytes");
        assert_eq!(human_size(16 << 20), "16 Mbytes");
        let h = header(&ClientOpts {
            length: 8192,
            write: true,
            duration: Limit::Time(Duration::from_secs(100)),
            interval: Duration::from_secs(20),
            ..ClientOpts::default()
        });
        assert!(h.contains("Message payload        = 8 kbytes"), "{h}");
        assert!(h.contains("Transport mode         = SYNC"), "{h}");
        assert!(h.contains("Disk write             = YES"), "{h}");
        assert!(h.contains("Test duration          = 100 seconds"), "{h}");
    }
}
