//! Encode pipeline throughput of the optimization codec on one core: chunking, fingerprints,
//! cache lookups and compression, on database-like (compressible) and random (incompressible)
//! data, and on `wanopt-replay gen`'s redo, rman and trail workloads.
//!
//! The last lines measure the receiver's cache tiers: decoding into memory only, and into 32 MiB
//! of memory in front of a disk tier (plain and encrypted), for new chunks (written through) and
//! for a repeat (references read back from the disk tier), as ratios to memory only.
//!
//! Run: `cargo bench --bench codec` (`-- --mib N` of data per case, default 256;
//! `--zstd-level N`, default the codec's; `--no-context` compresses every zstd piece alone). A `--wal FILE` (PostgreSQL WAL segments, `cat`
//! together) adds real redo, sent as live redo arrives: 2 KiB writes, each flushed. Each
//! `--file FILE` (a backup, WAL, a binlog) adds the file sent as bulk at a stated WAN (zstd
//! chosen), with and without long stream contexts, beside the `zstd`, `gzip` and `xz` commands'
//! output of the same bytes as one stream, at zstd levels 3, 6 and 9. `--similar OLD --to NEW` (two
//! backups) measures what delta encoding against similar chunks would recover: NEW's chunks
//! found in OLD (references), those with a similar chunk in OLD by super-features (each
//! compressed with that chunk as zstd's prefix), and the rest (compressed alone), at 8, 4 and
//! 2 KiB average chunks. `--threads N` measures the encoder and decoder with their chunks
//! prepared on 1 to N threads (`limits.threads`), on the LZ4 path, on zstd alone and on zstd in
//! a stream context (each `--file` too), `--rounds R` rounds (3) of every thread count in turn,
//! as medians and ratios to one thread in the same run, of the rates and of the CPU time the
//! process spent (all its threads: the work of two busy threads that costs no more than one's
//! reads 1.00), and the threads busy on average (CPU over wall time: a rate short of 2x with
//! two busy is the same work costing more, not threads waiting), and the times the pool's
//! judge turned the pool down over the rounds (its calls did not pay; each holds it off for a
//! while: see `wanopt_runtime::workers::Pool`); `--streams S` sends each
//! first copy as S parts side by side through one mirror, a turn at a time, as a link takes a
//! parallel copy's streams; `--path TEXT` only the paths whose name holds TEXT (`lz4`, `alone`,
//! `context`).
//! `--serial` (with each `--file`, `--streams`, `--path`, `--serial-threads N`, default 16)
//! splits a first copy's time on one thread into the jobs the pool takes and the rest (issue
//! 36's serial share; the streams' context work is the pool's), per path, and the time the
//! jobs' way costs against no workers at all; and the span, what no number of threads can cut,
//! with the encoder told it has one thread and N. `--cache-mib N` gives those three a chunk
//! cache of N MiB (default the codec's): smaller than a copy, the copy runs as a gateway's
//! steady state does, each chunk cached in place of one evicted.
//! `--side-by-side` (with each `--file`, `--rounds`, `--streams`, `--path`) runs two first
//! copies at once on one thread each, against one alone: the most two threads give on this
//! machine, beside what the pool's two threads give in the same rounds.

#[path = "../tests/common/args.rs"]
mod args;
#[path = "../tests/common/report.rs"]
mod report;

use std::time::Instant;

use wanopt_codec::cache::ChunkCache;
use wanopt_codec::{CodecConfig, Compression, Decoder, Encoder, LongContext, Pressure};
use wanopt_replay::workload::{Generator, Workload};
use wanopt_runtime::disk::DiskStore;

use wanopt_codec::testdata::noise as xorshift;

/// The daemon's allocator (see crates/wanoptd), so the codec's allocations cost here what they
/// cost there: a new first copy reuses the freed pages of the one before.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// 8 KiB blocks of order-entry-like rows with varying keys and quantities.
fn db_like(len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len + 8192);
    let mut r = 0u64;
    while v.len() < len {
        let start = v.len();
        v.extend_from_slice(&((v.len() / 8192) as u64).to_be_bytes());
        while v.len() - start < 7000 {
            r += 1;
            let row = format!(
                "ORD|{:010}|C{:06}|I{:05}|Q{:03}|{:08}|OPEN|",
                r,
                (r * 7919) % 999_983,
                (r * 31) % 99_991,
                r % 997,
                (r * 2_654_435_761) % 100_000_000
            );
            v.extend_from_slice(row.as_bytes());
        }
        v.resize(start + 8192, 0);
    }
    v.truncate(len);
    v
}

/// The zstd level of every case, and whether zstd pieces share their stream's context.
static LEVEL: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
static CONTEXT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
/// The chunk cache's size for `--threads`, `--serial` and `--side-by-side` (`--cache-mib`).
static CACHE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

/// A rate in MB/s, for the tables: `bytes` in `secs`.
fn mbs(bytes: usize, secs: f64) -> String {
    format!("{:.0}", bytes as f64 / secs / 1e6)
}

fn run(name: &str, data: &[u8], compression: Compression, pressure: Pressure) {
    run_writes(name, data, compression, pressure, 64 * 1024, false);
}

/// Encodes `data` in writes of `write` bytes (each flushed with `flush`), then decodes it.
fn run_writes(
    name: &str,
    data: &[u8],
    compression: Compression,
    pressure: Pressure,
    write: usize,
    flush: bool,
) {
    let cfg = CodecConfig {
        compression,
        zstd_level: *LEVEL.get_or_init(|| CodecConfig::default().zstd_level),
        context: *CONTEXT.get_or_init(|| true),
        ..CodecConfig::default()
    };
    let mut enc = Encoder::new(cfg.clone());
    // Touch the output buffers first: in a VM, first-touch page faults cost more than the codec.
    let mut wire = vec![1u8; data.len() + data.len() / 100 + 4096];
    wire.clear();
    let t = Instant::now();
    for piece in data.chunks(write) {
        enc.push(piece, flush, pressure, &mut wire);
    }
    enc.push(&[], true, pressure, &mut wire);
    let secs = t.elapsed().as_secs_f64();
    let mut dec = Decoder::new(&cfg);
    let mut out = vec![1u8; data.len() + 4096];
    out.clear();
    let t = Instant::now();
    dec.decode(&wire, &mut out).expect("decode");
    let dsecs = t.elapsed().as_secs_f64();
    assert!(out == data, "round trip");
    report::row(
        "First copies on one core",
        &["case", "encode MB/s", "decode MB/s", "wire/raw"],
        vec![
            name.into(),
            mbs(data.len(), secs),
            mbs(data.len(), dsecs),
            format!("{:.3}", wire.len() as f64 / data.len() as f64),
        ],
    );
}

/// Encoder and decoder throughput with chunks prepared on 1 to `most` threads (the daemon's
/// pool), on the LZ4 path (CPU-bound), on zstd alone (link-bound, no stream contexts) and on
/// what a stated WAN runs (a stream context, delta bases found with anchors the pool finds),
/// wall time; the decoder decodes what the encoder made with as many threads, after the encoder
/// is dropped (a decoder that runs while an encoder's caches are held pays page faults the
/// encoder's memory causes; while mimalloc asked for huge pages, before 97907d4, a first decode
/// after an encode also ran at a third of a later one's rate on the test VM whatever the
/// threads). `rounds` rounds, each of every thread count in
/// turn; medians, and "vs 1" the median of each round's ratio to one thread, since the VM's
/// rate drifts by a fifth between runs.
fn threads(name: &str, data: &[u8], most: usize, rounds: usize, streams: usize) {
    for (path, compression, pressure, context) in paths() {
        let cfg = path_config(compression, context);
        // Per thread count: encode and decode MB/s, and CPU seconds, of each round.
        let mut rates = vec![(Vec::new(), Vec::new()); most];
        let mut cpus = vec![(Vec::new(), Vec::new()); most];
        let mb = data.len() as f64 / 1e6;
        let mut wires: Vec<Vec<u8>> = Vec::new();
        let mut wire_len = 0;
        // Per thread count: the times the pool's judge turned it down, over the rounds.
        let mut downs = vec![0u64; most];
        for _ in 0..rounds.max(1) {
            for n in 1..=most {
                let before = wanopt_runtime::workers::turned_down().get();
                let copy = first_copy(&cfg, data, n, streams, pressure);
                downs[n - 1] += wanopt_runtime::workers::turned_down().get() - before;
                rates[n - 1].0.push(copy.encode);
                rates[n - 1].1.push(copy.decode);
                cpus[n - 1].0.push(copy.cpu[0]);
                cpus[n - 1].1.push(copy.cpu[1]);
                wire_len = copy.wire.len();
                if let Some(w) = wires.get(n - 1) {
                    assert!(*w == copy.wire, "the same records in every round");
                } else {
                    wires.push(copy.wire);
                }
            }
        }
        assert!(
            wires.windows(2).all(|w| w[0] == w[1]),
            "the same records on any number of threads"
        );
        // The median of each round's ratio of `k + 1` threads to one: of the rates, or (`cpu`)
        // of the CPU time the same copy took.
        let vs_one = |k: usize, dec: bool, cpu: bool| {
            let of = if cpu { &cpus } else { &rates };
            let pick = |r: &(Vec<f64>, Vec<f64>)| if dec { r.1.clone() } else { r.0.clone() };
            let (one, this) = (pick(&of[0]), pick(&of[k]));
            median(one.iter().zip(&this).map(|(a, b)| b / a).collect())
        };
        // The threads busy on average in each round of `k + 1` threads: CPU time over wall time
        // (CPU seconds times MB/s over the megabytes).
        let busy = |k: usize, dec: bool| {
            let (r, c) = (&rates[k], &cpus[k]);
            let (r, c) = if dec { (&r.1, &c.1) } else { (&r.0, &c.0) };
            median(r.iter().zip(c).map(|(rate, cpu)| cpu * rate / mb).collect())
        };
        for n in 1..=most {
            let (enc, dec) = &rates[n - 1];
            report::row(
                "Encoding and decoding on the pool (wall time)",
                &[
                    "data",
                    "streams",
                    "path",
                    "threads",
                    "encode MB/s",
                    "vs 1",
                    "decode MB/s",
                    "vs 1",
                    "CPU vs 1: encode",
                    "decode",
                    "threads busy: encode",
                    "decode",
                    "turned down",
                    "wire/raw",
                ],
                vec![
                    name.into(),
                    streams.to_string(),
                    path.to_string(),
                    n.to_string(),
                    format!("{:.0}", median(enc.clone())),
                    format!("{:.2}x", vs_one(n - 1, false, false)),
                    format!("{:.0}", median(dec.clone())),
                    format!("{:.2}x", vs_one(n - 1, true, false)),
                    format!("{:.2}", vs_one(n - 1, false, true)),
                    format!("{:.2}", vs_one(n - 1, true, true)),
                    format!("{:.2}", busy(n - 1, false)),
                    format!("{:.2}", busy(n - 1, true)),
                    downs[n - 1].to_string(),
                    format!("{:.3}", wire_len as f64 / data.len() as f64),
                ],
            );
        }
    }
}

/// A first copy of `data` encoded, then decoded, with chunks prepared on `threads` threads (the
/// daemon's pool), as `streams` streams (one, or the copy split in as many parts sent side by
/// side through one mirror: an RMAN duplicate's channels) whose clients write faster than the
/// link encodes (64 KiB writes, a turn whenever a stream's send buffer is full, so the next
/// turn's chunks can be cut while one encodes), a turn at a time as a link takes them, each
/// turn decoded as the link decodes a frame, in its stream's context. Returns encode and decode
/// MB/s, the CPU time each took, and the records, after checking every byte.
fn first_copy(
    cfg: &CodecConfig,
    data: &[u8],
    threads: usize,
    streams: usize,
    pressure: Pressure,
) -> Measured {
    let sent = encode_copy(cfg, data, pool_of(threads), streams, pressure, None);
    let took = decode_copy(cfg, data, pool_of(threads), streams, &sent, None);
    let mb = |t: &Took| data.len() as f64 / t.secs() / 1e6;
    Measured {
        encode: mb(&sent.took),
        decode: mb(&took),
        cpu: [sent.took.cpu, took.cpu],
        wire: sent.wire,
    }
}

/// What [`first_copy`] measured: encode and decode MB/s, the CPU time (seconds, every thread of
/// the process) each took, and the records.
struct Measured {
    encode: f64,
    decode: f64,
    cpu: [f64; 2],
    wire: Vec<u8>,
}

/// When a copy's encoding or decoding began and ended, and the CPU time the process spent
/// meanwhile (all its threads: the caller's and the pool's).
#[derive(Clone, Copy)]
struct Took {
    from: Instant,
    to: Instant,
    cpu: f64,
}

impl Took {
    /// Starts the clocks.
    fn start() -> (Instant, std::time::Duration) {
        (Instant::now(), wanopt_runtime::workers::process_cpu())
    }

    /// Stops the clocks started at `(from, cpu)`.
    fn since((from, cpu): (Instant, std::time::Duration)) -> Self {
        Took {
            from,
            to: Instant::now(),
            cpu: (wanopt_runtime::workers::process_cpu().saturating_sub(cpu)).as_secs_f64(),
        }
    }

    /// The wall time, in seconds.
    fn secs(&self) -> f64 {
        span((self.from, self.to))
    }
}

/// Seconds from the first instant to the second.
fn span(t: (Instant, Instant)) -> f64 {
    (t.1 - t.0).as_secs_f64()
}

/// A first copy's records, with the turns that made them (stream, end in `wire`) and when its
/// encoding began and ended.
struct Sent {
    wire: Vec<u8>,
    turns: Vec<(usize, usize)>,
    took: Took,
}

/// `data` cut in `streams` parts, as [`first_copy`] sends it.
fn parts(data: &[u8], streams: usize) -> Vec<&[u8]> {
    data.chunks(data.len().div_ceil(streams.max(1)).max(1))
        .collect()
}

/// The workers a copy runs with: the daemon's pool, or the serial split's [`Timed`].
type Workers = Option<std::sync::Arc<dyn wanopt_codec::prepare::Workers>>;

/// The daemon's pool of `threads` threads (none for one).
fn pool_of(threads: usize) -> Workers {
    wanopt_runtime::workers::Pool::start(threads)
}

/// [`first_copy`]'s encoding; the clock starts once `gate` (if any) opens.
fn encode_copy(
    cfg: &CodecConfig,
    data: &[u8],
    workers: Workers,
    streams: usize,
    pressure: Pressure,
    gate: Option<&std::sync::Barrier>,
) -> Sent {
    let mut wire = vec![1u8; data.len() + data.len() / 100 + 4096];
    wire.clear();
    let parts = parts(data, streams);
    let mut enc = wanopt_codec::Streams::new(cfg.clone(), parts.len(), SEND_BUFFER);
    enc.set_workers(workers);
    let mut turns = Vec::new();
    let owned: Vec<bytes::Bytes> = parts
        .iter()
        .map(|p| bytes::Bytes::copy_from_slice(p))
        .collect();
    if let Some(g) = gate {
        g.wait();
    }
    let t = Took::start();
    enc.send_bytes(&owned, 64 << 10, pressure, &mut wire, &mut turns);
    let took = Took::since(t);
    Sent { wire, turns, took }
}

/// [`first_copy`]'s decoding of what [`encode_copy`] sent, every byte checked; when it began
/// and ended, and the CPU time it took (the clocks start once `gate`, if any, opens).
fn decode_copy(
    cfg: &CodecConfig,
    data: &[u8],
    workers: Workers,
    streams: usize,
    sent: &Sent,
    gate: Option<&std::sync::Barrier>,
) -> Took {
    let parts = parts(data, streams);
    let mut dec = Decoder::new(cfg);
    dec.set_workers(workers.clone());
    // As the link does: with two threads or more, each stream's frame is fed to its context on
    // the pool while earlier frames are decoded, up to `PENDING` frames ahead.
    let ahead = if workers.as_ref().is_some_and(|w| w.threads() > 1) {
        wanopt_codec::PENDING
    } else {
        0
    };
    // One buffer, as the link's: a frame is fed ahead from the very bytes it is decoded from
    // (which lets a literal decompressed ahead be matched to its record by address).
    let wire = bytes::Bytes::copy_from_slice(&sent.wire);
    // Touched first, as `out` is: first-touch page faults are this harness's, not the codec's.
    let mut outs: Vec<Vec<u8>> = parts
        .iter()
        .map(|p| {
            let mut o = vec![1u8; p.len() + 4096];
            o.clear();
            o
        })
        .collect();
    let mut ctxs: Vec<wanopt_codec::StreamContext> =
        parts.iter().map(|_| Default::default()).collect();
    // As the link does: literals decompressed ahead are handed on as they are.
    let mut handed: Vec<wanopt_codec::HandedOn> =
        parts.iter().map(|_| Default::default()).collect();
    if let Some(g) = gate {
        g.wait();
    }
    let t = Took::start();
    let mut order = wanopt_codec::InOrder::new(ahead, workers);
    let mut decode = |dec: &mut Decoder, k: usize, r: std::ops::Range<usize>, ctx: &mut _| {
        let records = &wire[r];
        let (out, handed) = (&mut outs[k], &mut handed[k]);
        let (used, stop) = dec.decode_frame_handing(records, out, handed, ctx, usize::MAX);
        assert!(used == records.len() && stop.is_none(), "decode: {stop:?}");
    };
    let mut from = 0;
    for &(k, end) in &sent.turns {
        order.frame(&mut dec, (&wire, k, from..end), &mut ctxs, &mut decode);
        from = end;
    }
    order.finish(&mut dec, &mut ctxs, &mut decode);
    let took = Took::since(t);
    for ((o, h), p) in outs.iter().zip(&handed).zip(&parts) {
        assert!(h.assemble(o) == *p, "round trip");
    }
    took
}

/// What this machine's two cores give at most, beside what the pool gives: two first copies of
/// `data` on one thread each, side by side in two threads of this process (both encodings
/// begin together, then both decodings), against one alone and against one copy on the pool's
/// two threads, in the same rounds. Two copies side by side share nothing but the machine
/// (memory, caches, the allocator), so their ratio to one is the most any way of spreading one
/// copy over two threads can reach here.
fn side_by_side(name: &str, data: &[u8], rounds: usize, streams: usize) {
    for (path, compression, pressure, context) in paths() {
        let cfg = path_config(compression, context);
        // Per round: encode and decode ratios of two side by side, and of the pool's two
        // threads, to one copy alone.
        let mut two: [Vec<f64>; 2] = Default::default();
        let mut pool: [Vec<f64>; 2] = Default::default();
        for _ in 0..rounds.max(1) {
            let sent = encode_copy(&cfg, data, None, streams, pressure, None);
            let alone = [
                sent.took.secs(),
                decode_copy(&cfg, data, None, streams, &sent, None).secs(),
            ];
            drop(sent);
            let pooled = encode_copy(&cfg, data, pool_of(2), streams, pressure, None);
            let pooled = [
                pooled.took.secs(),
                decode_copy(&cfg, data, pool_of(2), streams, &pooled, None).secs(),
            ];
            let gate = std::sync::Barrier::new(2);
            let both: Vec<[Took; 2]> = std::thread::scope(|s| {
                let run = || {
                    let sent = encode_copy(&cfg, data, None, streams, pressure, Some(&gate));
                    let took = decode_copy(&cfg, data, None, streams, &sent, Some(&gate));
                    [sent.took, took]
                };
                let h = [s.spawn(run), s.spawn(run)];
                h.map(|h| h.join().expect("a copy side by side"))
                    .into_iter()
                    .collect()
            });
            for side in 0..2 {
                // Both copies' bytes over the time from the first start to the last end.
                let from = both.iter().map(|b| b[side].from).min().expect("two");
                let to = both.iter().map(|b| b[side].to).max().expect("two");
                two[side].push(2.0 * alone[side] / span((from, to)));
                pool[side].push(alone[side] / pooled[side]);
            }
        }
        let [two, pool] = [two, pool].map(|v| v.map(median));
        report::row(
            "Two copies side by side on two threads against one alone, and the pool's two threads",
            &[
                "data",
                "streams",
                "path",
                "encode: side by side",
                "pool",
                "pool / side by side",
                "decode: side by side",
                "pool",
                "pool / side by side",
            ],
            vec![
                name.into(),
                streams.to_string(),
                path.to_string(),
                format!("{:.2}x", two[0]),
                format!("{:.2}x", pool[0]),
                format!("{:.2}", pool[0] / two[0]),
                format!("{:.2}x", two[1]),
                format!("{:.2}x", pool[1]),
                format!("{:.2}", pool[1] / two[1]),
            ],
        );
    }
}

/// The paths to measure: those whose name holds `--path TEXT` (every one without).
fn paths() -> Vec<(&'static str, Compression, Pressure, bool)> {
    let only = args::Args::new().text("--path").unwrap_or_default();
    PATHS.into_iter().filter(|p| p.0.contains(&only)).collect()
}

/// The encoder's paths `--threads` and `--serial` measure: name, compression, pressure, stream
/// contexts (with deltas).
const PATHS: [(&str, Compression, Pressure, bool); 3] = [
    (
        "lz4 (cpu-bound)",
        Compression::Adaptive,
        Pressure::CpuBound,
        false,
    ),
    (
        "zstd alone (link-bound)",
        Compression::Adaptive,
        Pressure::LinkBound,
        false,
    ),
    (
        "zstd in context, deltas (a stated WAN)",
        Compression::Adaptive,
        Pressure::LinkBound,
        true,
    ),
];

/// The codec's settings on one of [`PATHS`].
fn path_config(compression: Compression, context: bool) -> CodecConfig {
    CodecConfig {
        compression,
        zstd_level: *LEVEL.get_or_init(|| CodecConfig::default().zstd_level),
        context,
        cache_bytes: *CACHE.get_or_init(|| CodecConfig::default().cache_bytes),
        delta_bytes: if context {
            CodecConfig::default().delta_bytes
        } else {
            0
        },
        ..CodecConfig::default()
    }
}

/// Workers that run every job on the calling thread and time them: the time a first copy
/// spends in what the pool can take (jobs) and in what stays on the daemon's thread (the rest);
/// and its span, what no number of threads can cut: per turn, the longer of the caller's own
/// part and the longest job. They tell the encoder they have `threads` threads, which decides
/// how finely it splits a turn's work (the next turn's cuts, in pieces from two on).
#[derive(Debug, Default)]
struct Timed {
    jobs: std::sync::Mutex<std::time::Duration>,
    span: std::sync::Mutex<std::time::Duration>,
    /// All the time spent in the calls above, the caller's part of `overlap` included.
    inside: std::sync::Mutex<std::time::Duration>,
    /// Of the jobs, the streams' context work that outlives a turn ([`Workers::spawn`]: a
    /// turn's context records, a frame fed to its stream's context), which runs beside the
    /// caller's later turns, each stream's in its order.
    ///
    /// [`Workers::spawn`]: wanopt_codec::prepare::Workers::spawn
    spawned: std::sync::Mutex<std::time::Duration>,
    threads: usize,
}

impl Timed {
    fn new(threads: usize) -> Self {
        Timed {
            threads,
            ..Timed::default()
        }
    }

    fn add(&self, d: std::time::Duration) {
        *self.jobs.lock().unwrap_or_else(|p| p.into_inner()) += d;
    }

    fn add_span(&self, d: std::time::Duration, inside: std::time::Duration) {
        *self.span.lock().unwrap_or_else(|p| p.into_inner()) += d;
        *self.inside.lock().unwrap_or_else(|p| p.into_inner()) += inside;
    }

    fn secs(m: &std::sync::Mutex<std::time::Duration>) -> f64 {
        m.lock().map(|d| d.as_secs_f64()).unwrap_or(0.0)
    }
}

impl wanopt_codec::prepare::Workers for Timed {
    fn run(&self, jobs: &mut [wanopt_codec::prepare::Job<'_>]) {
        let (mut longest, mut all) = (std::time::Duration::ZERO, std::time::Duration::ZERO);
        for j in jobs.iter_mut() {
            let t = Instant::now();
            j.run();
            let d = t.elapsed();
            self.add(d);
            longest = longest.max(d);
            all += d;
        }
        self.add_span(longest, all);
    }

    fn spawn(&self, job: Box<dyn FnOnce() + Send>) {
        // A stream's context work, in its order beside the caller's: see `serial`.
        let t = Instant::now();
        job();
        let d = t.elapsed();
        self.add(d);
        *self.spawned.lock().unwrap_or_else(|p| p.into_inner()) += d;
        *self.inside.lock().unwrap_or_else(|p| p.into_inner()) += d;
    }

    fn threads(&self) -> usize {
        self.threads.max(1)
    }

    fn overlap(&self, ahead: &wanopt_codec::prepare::Ahead<'_>, caller: &mut dyn FnMut()) {
        // Every job first, each timed; the caller then finds each one's result ready.
        let (mut longest, mut all) = (std::time::Duration::ZERO, std::time::Duration::ZERO);
        loop {
            let t = Instant::now();
            if !ahead.work_one() {
                break;
            }
            let d = t.elapsed();
            self.add(d);
            longest = longest.max(d);
            all += d;
        }
        // Work the caller spawned meanwhile (a stream's context records, made as its turn is
        // planned) ran here inline, as a pool thread would run it beside the caller: it is
        // the jobs' and the streams' (`spawn`), not the caller's chain.
        let spawned = || *self.spawned.lock().unwrap_or_else(|p| p.into_inner());
        let (t, before) = (Instant::now(), spawned());
        caller();
        let own = t.elapsed().saturating_sub(spawned().saturating_sub(before));
        self.add_span(longest.max(own), all + own);
    }
}

/// The one-core stage split of issue 36: a first copy of `data` as `streams` streams, encoded
/// and decoded on one thread as [`first_copy`] does, `rounds` times per path, the jobs the pool
/// would take timed apart from the rest (the mirror, records, copies: what stays on the daemon's
/// thread), with the encoder told it has `threads` threads (how finely it splits a turn; with
/// two or more, the streams' context records are made, and their frames fed, as jobs). The
/// serial share `s` is the rest's part of the time; by Amdahl's law N cores give at most `1 /
/// (s + (1 - s) / N)`. The span's share `p` bounds them too, at most `1 / p` however many
/// cores: the longer of the caller's chain (per turn, the longer of the rest and the longest
/// job, see [`Timed`]) and one stream's context work (a stream's share of it: the streams take
/// turns alike), which runs beside the caller's later turns but in its stream's order.
fn serial(name: &str, data: &[u8], rounds: usize, threads: usize, streams: usize) {
    for (path, compression, pressure, context) in paths() {
        let cfg = path_config(compression, context);
        // Per round, encode's and decode's: serial share, span share, and their time with the
        // jobs timed against their time with no workers at all (what one thread runs).
        let mut per: [[Vec<f64>; 3]; 2] = Default::default();
        for _ in 0..rounds.max(1) {
            let mut took = [[0.0; 2]; 2];
            let mut share = [[0.0; 2]; 2];
            for timed in [false, true] {
                let t_jobs = std::sync::Arc::new(Timed::new(threads));
                let workers: Workers = timed
                    .then(|| t_jobs.clone() as std::sync::Arc<dyn wanopt_codec::prepare::Workers>);
                // Jobs, span, time inside the workers' calls and spawned work so far.
                let sums = || {
                    [&t_jobs.jobs, &t_jobs.span, &t_jobs.inside, &t_jobs.spawned].map(Timed::secs)
                };
                let shares = |all: f64, before: [f64; 4]| {
                    let [j, sp, ins, sw] = sums();
                    let (j, sp, ins, sw) = (
                        j - before[0],
                        sp - before[1],
                        ins - before[2],
                        sw - before[3],
                    );
                    // What ran outside the workers' calls is all on the caller's chain. Work
                    // spawned in a stream context runs in its stream's order; outside one (a
                    // frame's literals alone, fed ahead) it needs nothing of the frames before.
                    let chain = sp + (all - ins).max(0.0);
                    let ordered = if context {
                        sw / streams.max(1) as f64
                    } else {
                        0.0
                    };
                    [1.0 - j / all, chain.max(ordered) / all]
                };
                let sent = encode_copy(&cfg, data, workers.clone(), streams, pressure, None);
                let all = sent.took.secs();
                took[usize::from(timed)][0] = all;
                share[0] = shares(all, [0.0; 4]);
                let before = sums();
                let all = decode_copy(&cfg, data, workers, streams, &sent, None).secs();
                took[usize::from(timed)][1] = all;
                share[1] = shares(all, before);
            }
            for side in 0..2 {
                per[side][0].push(share[side][0]);
                per[side][1].push(share[side][1]);
                per[side][2].push(took[1][side] / took[0][side]);
            }
        }
        let amdahl = |s: f64, n: f64| 1.0 / (s + (1.0 - s) / n);
        let mut row = vec![
            name.into(),
            streams.to_string(),
            path.to_string(),
            threads.to_string(),
        ];
        for [s, p, x] in per.map(|v| v.map(median)) {
            // At most on N cores: Amdahl's bound and the span's, whichever is lower, for the
            // time the jobs' way costs against none.
            let most = |n: f64| amdahl(s, n).min(1.0 / p.max(f64::MIN_POSITIVE)).min(n) / x;
            row.extend([
                format!("{s:.3}"),
                format!("{p:.3}"),
                format!("{x:.2}"),
                format!("{:.2}x / {:.1}x", most(2.0), most(16.0)),
            ]);
        }
        report::row(
            "Serial share on one core (jobs the pool takes, timed apart)",
            &[
                "data",
                "streams",
                "path",
                "threads told",
                "encode serial",
                "span",
                "time vs no pool",
                "2 / 16 cores at most",
                "decode serial",
                "span",
                "time vs no pool",
                "2 / 16 cores at most",
            ],
            row,
        );
    }
}

/// A link's stream's send buffer (`limits.stream_buffer`'s default).
const SEND_BUFFER: usize = 512 << 10;

/// The middle value (the mean of the two middle ones for an even count).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// A real file as a bulk stream at a stated WAN (zstd chosen), with and without long contexts,
/// against the stream compressors' output of the same bytes.
fn file_vs_stream_compressors(path: &str) {
    let data = std::fs::read(path).unwrap_or_else(|e| panic!("--file {path}: {e}"));
    let n = data.len() as f64;
    let title = format!("{path} ({:.1} MB) against the stream compressors", n / 1e6);
    let header = ["compressor", "wire/raw", "encode MB/s"];
    let tool = |cmd: &str, args: &[&str]| -> Option<(usize, f64)> {
        let t = Instant::now();
        let out = std::process::Command::new(cmd)
            .args(args)
            .arg(path)
            .output()
            .ok()
            .filter(|o| o.status.success())?;
        Some((out.stdout.len(), t.elapsed().as_secs_f64()))
    };
    for level in [3, 6, 9] {
        for long in [None, Some(LongContext::default())] {
            let cfg = CodecConfig {
                compression: Compression::Adaptive,
                zstd_level: level,
                long,
                ..CodecConfig::default()
            };
            let mut enc = Encoder::new(cfg.clone());
            let mut wire = Vec::with_capacity(data.len() / 2);
            let t = Instant::now();
            for piece in data.chunks(64 * 1024) {
                enc.push(piece, false, Pressure::LinkBound, &mut wire);
            }
            enc.push(&[], true, Pressure::LinkBound, &mut wire);
            let secs = t.elapsed().as_secs_f64();
            let mut out = Vec::with_capacity(data.len());
            Decoder::new(&cfg).decode(&wire, &mut out).expect("decode");
            assert!(out == data, "round trip");
            report::row(
                &title,
                &header,
                vec![
                    format!(
                        "wanopt zstd {level}, {}",
                        if long.is_some() {
                            "long contexts"
                        } else {
                            "chunks alone"
                        }
                    ),
                    format!("{:.3}", wire.len() as f64 / n),
                    format!("{:.0}", n / secs / 1e6),
                ],
            );
        }
        let l = format!("-{level}");
        if let Some((len, secs)) = tool("zstd", &[&l, "-q", "-c", "-T1"]) {
            report::row(
                &title,
                &header,
                vec![
                    format!("zstd -{level} (one stream)"),
                    format!("{:.3}", len as f64 / n),
                    format!("{:.0}", n / secs / 1e6),
                ],
            );
        }
    }
    for (cmd, args) in [("gzip", ["-6", "-c"]), ("xz", ["-6", "-c"])] {
        if let Some((len, secs)) = tool(cmd, &args) {
            report::row(
                &title,
                &header,
                vec![
                    format!("{cmd} -6"),
                    format!("{:.3}", len as f64 / n),
                    format!("{:.0}", n / secs / 1e6),
                ],
            );
        }
    }
}

/// Super-features of a chunk, after Shilane et al. (FAST 2012): twelve features, each the
/// maximum of a different linear transform of a rolling gear hash over a sample of the chunk's
/// positions, hashed in three groups of four. Chunks sharing one are likely similar; an edit
/// moves only the features near it.
fn super_features(chunk: &[u8], gear: &[u64; 256]) -> [u64; 3] {
    const A: [u64; 12] = [
        0x9E37_79B9_7F4A_7C15,
        0xC2B2_AE3D_27D4_EB4F,
        0x1656_67B1_9E37_79F9,
        0x85EB_CA77_C2B2_AE63,
        0x27D4_EB2F_1656_67C5,
        0x94D0_49BB_1331_11EB,
        0xBF58_476D_1CE4_E5B9,
        0xFF51_AFD7_ED55_8CCD,
        0xC4CE_B9FE_1A85_EC53,
        0x2545_F491_4F6C_DD1D,
        0x5851_F42D_4C95_7F2D,
        0x1405_7B7E_F767_814F,
    ];
    let mut f = [0u64; 12];
    let mut h = 0u64;
    for &b in chunk {
        h = (h << 1).wrapping_add(gear[b as usize]);
        // One position in 16: features of a chunk cost a sixteenth of a full pass.
        if h & 0xF == 0 {
            for (fi, a) in f.iter_mut().zip(A) {
                *fi = (*fi).max(h.wrapping_mul(a).rotate_left(29));
            }
        }
    }
    let group = |g: &[u64]| {
        g.iter().fold(0xcbf2_9ce4_8422_2325u64, |acc, v| {
            (acc ^ v).wrapping_mul(0x100_0000_01b3)
        })
    };
    [group(&f[0..4]), group(&f[4..8]), group(&f[8..12])]
}

/// What delta encoding against similar chunks of `old` would make of `new`, per chunk size.
fn similar(old_path: &str, new_path: &str) {
    use std::collections::{HashMap, HashSet};
    use zstd::zstd_safe::{CCtx, CParameter};
    let old = std::fs::read(old_path).unwrap_or_else(|e| panic!("{old_path}: {e}"));
    let new = std::fs::read(new_path).unwrap_or_else(|e| panic!("{new_path}: {e}"));
    let mut gear = [0u64; 256];
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    for g in gear.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *g = x;
    }
    println!(
        "{new_path} against {old_path}: {:.1} MB, zstd 6, one frame per chunk",
        new.len() as f64 / 1e6
    );
    for avg in [8192usize, 4096, 2048] {
        let cfg = CodecConfig::default().with_avg_chunk(avg);
        let mut have = HashSet::new();
        let mut index: HashMap<(usize, u64), (usize, usize)> = HashMap::new();
        for (off, len) in wanopt_codec::chunks(&old, &cfg) {
            let c = &old[off..off + len];
            have.insert(wanopt_codec::cache::fingerprint(c));
            for (j, sf) in super_features(c, &gear).into_iter().enumerate() {
                index.entry((j, sf)).or_insert((off, len));
            }
        }
        let mut cctx = CCtx::create();
        cctx.set_parameter(CParameter::CompressionLevel(6))
            .expect("level");
        let mut buf = Vec::with_capacity(1 << 20);
        let (mut refs, mut sims, mut rest) = (0u64, 0u64, 0u64);
        let (mut wire_sim, mut wire_rest, mut alone_sim) = (0u64, 0u64, 0u64);
        let t = Instant::now();
        for (off, len) in wanopt_codec::chunks(&new, &cfg) {
            let c = &new[off..off + len];
            if have.contains(&wanopt_codec::cache::fingerprint(c)) {
                refs += 1;
                continue;
            }
            buf.clear();
            buf.reserve(len + 1024);
            cctx.compress2(&mut buf, c).expect("zstd");
            let alone = buf.len().min(len) as u64;
            let base = super_features(c, &gear)
                .into_iter()
                .enumerate()
                .find_map(|(j, sf)| index.get(&(j, sf)).copied());
            match base {
                Some((boff, blen)) => {
                    buf.clear();
                    cctx.ref_prefix(&old[boff..boff + blen]).expect("prefix");
                    cctx.compress2(&mut buf, c).expect("zstd");
                    sims += 1;
                    // A delta record names its base and the new chunk: 32 bytes more.
                    wire_sim += (buf.len() as u64 + 32).min(alone);
                    alone_sim += alone;
                }
                None => {
                    rest += 1;
                    wire_rest += alone;
                }
            }
        }
        // Bases from anywhere in history: the old chunks that share sampled 32-byte anchors
        // with the new one, up to eight, as one prefix.
        let multi = if avg == 8192 {
            let (wire, n) = multi_base(&old, &new, &cfg, &have, &gear, &mut cctx);
            format!(
                ", {:.4} with up to 8 bases by anchors ({n} chunks)",
                (refs * 17 + wire) as f64 / new.len() as f64
            )
        } else {
            String::new()
        };
        let refs_wire = refs * 17;
        let total = refs_wire + wire_sim + wire_rest;
        println!(
            "  {:>2} KiB chunks: {refs} found, {sims} similar (delta {:.0} KB, alone {:.0} KB), {rest} neither ({:.0} KB); wire/raw {:.4} with deltas, {:.4} without ({:.1} s)",
            avg >> 10,
            wire_sim as f64 / 1e3,
            alone_sim as f64 / 1e3,
            wire_rest as f64 / 1e3,
            total as f64 / new.len() as f64,
            (refs_wire + alone_sim + wire_rest) as f64 / new.len() as f64,
            t.elapsed().as_secs_f64()
        );
        if !multi.is_empty() {
            println!("    {}", multi.trim_start_matches(", "));
        }
    }
}

/// Anchors of `data`: positions where the gear hash's low 9 bits are zero (one in 512), keyed
/// by the hash of the 32 bytes that follow.
fn anchors(data: &[u8], gear: &[u64; 256]) -> Vec<(usize, u64)> {
    let mut h = 0u64;
    let mut v = Vec::new();
    for (i, &b) in data.iter().enumerate() {
        h = (h << 1).wrapping_add(gear[b as usize]);
        if h & 0x1FF == 0 && i + 33 <= data.len() {
            let k = data[i + 1..i + 33]
                .iter()
                .fold(0xcbf2_9ce4_8422_2325u64, |a, x| {
                    (a ^ u64::from(*x)).wrapping_mul(0x100_0000_01b3)
                });
            v.push((i, k));
        }
    }
    v
}

/// Wire bytes of `new`'s chunks not in `have`, each compressed with the old chunks that share
/// the most anchors with it (up to eight) as prefix; and how many chunks found any.
fn multi_base(
    old: &[u8],
    new: &[u8],
    cfg: &CodecConfig,
    have: &std::collections::HashSet<[u8; 16]>,
    gear: &[u64; 256],
    cctx: &mut zstd::zstd_safe::CCtx<'_>,
) -> (u64, u64) {
    use std::collections::HashMap;
    let bounds: Vec<(usize, usize)> = wanopt_codec::chunks(old, cfg).collect();
    let mut index: HashMap<u64, u32> = HashMap::new();
    let mut ci = 0usize;
    for (pos, k) in anchors(old, gear) {
        while ci + 1 < bounds.len() && bounds[ci].0 + bounds[ci].1 <= pos {
            ci += 1;
        }
        index.entry(k).or_insert(ci as u32);
    }
    let (mut wire, mut found) = (0u64, 0u64);
    let mut buf = Vec::with_capacity(1 << 20);
    let mut prefix = Vec::with_capacity(64 * 1024);
    for (off, len) in wanopt_codec::chunks(new, cfg) {
        let c = &new[off..off + len];
        if have.contains(&wanopt_codec::cache::fingerprint(c)) {
            continue;
        }
        let mut votes: HashMap<u32, u32> = HashMap::new();
        for (_, k) in anchors(c, gear) {
            if let Some(i) = index.get(&k) {
                *votes.entry(*i).or_default() += 1;
            }
        }
        let mut bases: Vec<(u32, u32)> = votes.into_iter().map(|(i, n)| (n, i)).collect();
        bases.sort_unstable_by(|a, b| b.cmp(a));
        buf.clear();
        buf.reserve(len + 1024);
        if bases.is_empty() {
            cctx.compress2(&mut buf, c).expect("zstd");
            wire += buf.len().min(len) as u64;
            continue;
        }
        found += 1;
        prefix.clear();
        // The best base last: nearest to the data, cheapest to reference.
        for (_, i) in bases.iter().take(8).rev() {
            let (bo, bl) = bounds[*i as usize];
            prefix.extend_from_slice(&old[bo..bo + bl]);
        }
        // A context of the prefix's own lifetime (a fresh one per chunk: a bench, not the codec).
        let mut local = zstd::zstd_safe::CCtx::create();
        local
            .set_parameter(zstd::zstd_safe::CParameter::CompressionLevel(6))
            .expect("level");
        local.ref_prefix(&prefix).expect("prefix");
        local.compress2(&mut buf, c).expect("zstd");
        drop(local);
        // The record names its bases and the new chunk: 16 bytes each.
        wire += (buf.len() as u64 + 16 * (1 + bases.len().min(8) as u64)).min(len as u64);
    }
    (wire, found)
}

/// The stages on their own: chunking alone, and chunking plus fingerprints, for the share each
/// takes of the pipeline.
fn stages(name: &str, data: &[u8]) {
    let cfg = CodecConfig::default();
    let t = Instant::now();
    let n = wanopt_codec::chunks(data, &cfg).count();
    let chunking = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let mut x = 0u8;
    for (off, len) in wanopt_codec::chunks(data, &cfg) {
        x ^= wanopt_codec::cache::fingerprint(&data[off..off + len])[0];
    }
    let hashing = t.elapsed().as_secs_f64();
    // The same cuts found in pieces (wanopt_codec::cuts, as a turn's are with three threads
    // or more): the pieces' chains on one thread, and on two.
    let (piece, lookback) = (256 << 10, wanopt_codec::cuts::lookback(&cfg));
    let in_pieces = |two: bool| {
        wanopt_codec::cuts::chains_in_pieces(data, &cfg, piece, lookback, usize::MAX, |jobs| {
            if !two {
                return jobs.iter_mut().for_each(|j| j());
            }
            let half = jobs.len().div_ceil(2);
            let (a, b) = jobs.split_at_mut(half);
            std::thread::scope(|sc| {
                sc.spawn(|| b.iter_mut().for_each(|j| j()));
                a.iter_mut().for_each(|j| j());
            });
        })
    };
    let t = Instant::now();
    let (one, here) = in_pieces(false);
    let pieces1 = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let (two, _) = in_pieces(true);
    let pieces2 = t.elapsed().as_secs_f64();
    let closed: Vec<(usize, usize)> = wanopt_codec::chunks(data, &cfg)
        .filter(|&(o, l)| o + l < data.len())
        .collect();
    assert!(one == closed, "the pieces' cuts");
    assert!(one == two, "the pieces' cuts on two threads");
    report::row(
        "Stages on one core",
        &[
            "data",
            "chunking MB/s",
            "chunking + BLAKE3 MB/s",
            "chunks",
            "cuts in 256 KiB pieces, 1 thread MB/s",
            "2 threads MB/s",
            "cut by the join",
        ],
        vec![
            name.into(),
            mbs(data.len(), chunking),
            mbs(data.len(), hashing),
            format!("{n} ({x})"),
            mbs(data.len(), pieces1),
            mbs(data.len(), pieces2),
            here.to_string(),
        ],
    );
}

/// For a CPU profile of each stage (issue 36): the first copy of `data` encoded and decoded on
/// one thread at a time, on the LZ4 path and on the zstd path, each phase in a thread named
/// after it (`enc-lz4`, `dec-lz4`, `enc-zstd`, `dec-zstd`) and repeated for about `seconds`, so
/// `perf record` of this process splits by phase (`perf report --sort comm,symbol`).
fn profile(data: &[u8], seconds: f64) {
    for (path, compression, pressure) in [
        ("lz4", Compression::Adaptive, Pressure::CpuBound),
        ("zstd", Compression::Adaptive, Pressure::LinkBound),
    ] {
        let cfg = CodecConfig {
            compression,
            ..CodecConfig::default()
        };
        let data = data.to_vec();
        let c = cfg.clone();
        let wire = std::thread::Builder::new()
            .name(format!("enc-{path}"))
            .spawn(move || {
                let t = Instant::now();
                let mut rounds = 0;
                // The output is reused: page faults on fresh output would be this harness's
                // cost, not the codec's (a daemon writes to sockets piece by piece).
                let mut wire = Vec::with_capacity(data.len() + data.len() / 100 + 4096);
                loop {
                    let mut enc = Encoder::new(c.clone());
                    wire.clear();
                    for piece in data.chunks(64 * 1024) {
                        enc.push(piece, false, pressure, &mut wire);
                    }
                    enc.push(&[], true, pressure, &mut wire);
                    rounds += 1;
                    if t.elapsed().as_secs_f64() >= seconds {
                        let mbs = (data.len() * rounds) as f64 / t.elapsed().as_secs_f64() / 1e6;
                        println!("enc-{path}: {rounds} rounds, {mbs:.0} MB/s");
                        return (wire, data.len());
                    }
                }
            })
            .expect("thread")
            .join()
            .expect("encode");
        std::thread::Builder::new()
            .name(format!("dec-{path}"))
            .spawn(move || {
                let (wire, len) = wire;
                let t = Instant::now();
                let mut rounds = 0;
                let mut out = Vec::with_capacity(len + 4096);
                loop {
                    let mut dec = Decoder::new(&cfg);
                    out.clear();
                    dec.decode(&wire, &mut out).expect("decode");
                    assert_eq!(out.len(), len);
                    rounds += 1;
                    if t.elapsed().as_secs_f64() >= seconds {
                        let mbs = (len * rounds) as f64 / t.elapsed().as_secs_f64() / 1e6;
                        println!("dec-{path}: {rounds} rounds, {mbs:.0} MB/s");
                        return;
                    }
                }
            })
            .expect("thread")
            .join()
            .expect("decode");
    }
}

/// Decode throughput of new chunks and of their repeat, per cache tier setup.
fn tiers(data: &[u8]) {
    let cfg = CodecConfig {
        compression: Compression::None,
        cache_bytes: 2 * data.len() + (64 << 20),
        ..CodecConfig::default()
    };
    let mut enc = Encoder::new(cfg.clone());
    let (mut first, mut repeat) = (Vec::new(), Vec::new());
    enc.push(data, true, Pressure::CpuBound, &mut first);
    enc.push(data, true, Pressure::CpuBound, &mut repeat);
    let dir = tempfile::tempdir().expect("tempdir");
    let limit = cfg.cache_bytes as u64 / 3 * 4;
    let seg = wanopt_codec::cache::segment_size(limit);
    let mut base = (0.0, 0.0);
    for (name, key) in [
        ("memory only", None),
        ("disk tier", Some(None)),
        ("disk tier, encrypted", Some(Some([9u8; 32]))),
    ] {
        let cache = match key {
            None => ChunkCache::new(cfg.cache_bytes),
            Some(k) => {
                let d = dir.path().join(name.replace([' ', ','], "-"));
                let store = DiskStore::open(&d, k, seg).expect("store");
                ChunkCache::tiered(32 << 20, limit, Box::new(store))
            }
        };
        let mut dec = Decoder::with_cache(cache, true);
        let mut speeds = [0.0; 2];
        for (i, wire) in [&first, &repeat].into_iter().enumerate() {
            let mut out = vec![1u8; data.len() + 4096];
            out.clear();
            let t = Instant::now();
            dec.decode(wire, &mut out).expect("decode");
            speeds[i] = data.len() as f64 / t.elapsed().as_secs_f64() / 1e6;
            assert!(out == data, "round trip");
        }
        if key.is_none() {
            base = (speeds[0], speeds[1]);
        }
        report::row(
            "Decoding incompressible data into each cache setup",
            &["cache", "new MB/s", "vs memory", "repeat MB/s", "vs memory"],
            vec![
                name.into(),
                format!("{:.0}", speeds[0]),
                format!("{:.2}x", speeds[0] / base.0),
                format!("{:.0}", speeds[1]),
                format!("{:.2}x", speeds[1] / base.1),
            ],
        );
    }
}

/// The database-like blocks, then each `--file`.
fn data_sets(args: &args::Args, db: &[u8]) -> Vec<(String, Vec<u8>)> {
    let mut sets = vec![("db-like".to_string(), db.to_vec())];
    for path in args.all("--file") {
        let data = std::fs::read(&path).unwrap_or_else(|e| panic!("--file {path}: {e}"));
        sets.push((path.clone(), data));
    }
    sets
}

fn main() {
    // As the daemon runs (docs/tuning.md, "Huge pages").
    wanopt_runtime::daemon::no_huge_pages();
    let args = args::Args::new();
    let mib: usize = args.get("--mib", 256);
    let level = *LEVEL.get_or_init(|| args.get("--zstd-level", CodecConfig::default().zstd_level));
    let context = *CONTEXT.get_or_init(|| !args.flag("--no-context"));
    let default_cache = CodecConfig::default().cache_bytes;
    let cache = *CACHE.get_or_init(|| args.get("--cache-mib", default_cache >> 20) << 20);
    let db = db_like(mib << 20);
    let noise = xorshift(7, mib << 20);
    report::note(format!(
        "One core, {mib} MiB per case, 64 KiB writes, first transfer (empty cache), zstd level {level}{}{}.",
        if context { "" } else { ", no stream contexts" },
        if cache == default_cache {
            String::new()
        } else {
            format!(", a {} MiB cache (`--cache-mib`)", cache >> 20)
        }
    ));
    if let Some(n) = args.text("--threads") {
        let n: usize = n.parse().expect("--threads N");
        let sets = data_sets(&args, &db);
        let rounds = args.get("--rounds", 3usize);
        let streams = args.get("--streams", 1usize);
        report::note(format!(
            "{rounds} rounds of every thread count in turn, medians (`--rounds`); each first copy \
             as {streams} stream(s) side by side (`--streams`)."
        ));
        for (name, data) in &sets {
            threads(name, data, n, rounds, streams);
        }
        report::finish("codec-threads", "codec --threads: the pool on this machine");
        return;
    }
    if args.flag("--side-by-side") {
        let sets = data_sets(&args, &db);
        let rounds = args.get("--rounds", 3usize);
        let streams = args.get("--streams", 1usize);
        for (name, data) in &sets {
            side_by_side(name, data, rounds, streams);
        }
        report::finish(
            "codec-side-by-side",
            "codec --side-by-side: two copies at once, the most two threads give here",
        );
        return;
    }
    if args.flag("--serial") {
        let sets = data_sets(&args, &db);
        let rounds = args.get("--rounds", 3usize);
        let told = args.get("--serial-threads", 16usize);
        let streams = args.get("--streams", 1usize);
        for (name, data) in &sets {
            for threads in [1, told] {
                serial(name, data, rounds, threads, streams);
            }
        }
        report::finish(
            "codec-serial",
            "codec --serial: the serial share on one core",
        );
        return;
    }
    if let Some(path) = args.text("--stages") {
        let data = std::fs::read(&path).unwrap_or_else(|e| panic!("--stages {path}: {e}"));
        stages(&path, &data);
        return;
    }
    if let Some(path) = args.text("--profile") {
        let data = std::fs::read(&path).unwrap_or_else(|e| panic!("--profile {path}: {e}"));
        profile(&data, args.get("--seconds", 4.0));
        return;
    }
    if let Some(path) = args.text("--wal") {
        let wal = std::fs::read(&path).unwrap_or_else(|e| panic!("--wal {path}: {e}"));
        run_writes(
            "PostgreSQL WAL, live 2 KiB writes",
            &wal,
            Compression::Adaptive,
            Pressure::LinkBound,
            2048,
            true,
        );
        // What per-write LZ-class compression (an appliance's LZO) leaves of the same bytes.
        run_writes(
            "the same, lz4 write by write",
            &wal,
            Compression::Lz4,
            Pressure::LinkBound,
            2048,
            true,
        );
    }
    if let Some(old) = args.text("--similar") {
        let Some(new) = args.text("--to") else {
            panic!("--similar OLD needs --to NEW");
        };
        similar(&old, &new);
    }
    for path in args.all("--file") {
        file_vs_stream_compressors(&path);
        let data = std::fs::read(&path).unwrap_or_else(|e| panic!("--file {path}: {e}"));
        stages(&path, &data);
    }
    stages("db-like stages", &db);
    stages("incompressible stages", &noise);
    run(
        "db-like, adaptive (cpu-bound: lz4)",
        &db,
        Compression::Adaptive,
        Pressure::CpuBound,
    );
    run(
        "db-like, adaptive (link-bound: zstd)",
        &db,
        Compression::Adaptive,
        Pressure::LinkBound,
    );
    // The workloads of `wanopt-replay gen`, as the link sees them when it is the bottleneck.
    let redo = Generator::new(Workload::Redo, 1, 0.0).bytes(mib.min(128) << 20);
    run_writes(
        "gen redo, live 2 KiB writes (link-bound)",
        &redo,
        Compression::Adaptive,
        Pressure::LinkBound,
        2048,
        true,
    );
    for (name, w) in [
        ("gen redo, adaptive (link-bound)", Workload::Redo),
        ("gen rman, adaptive (link-bound)", Workload::Rman),
        ("gen trail, adaptive (link-bound)", Workload::Trail),
    ] {
        let d = Generator::new(w, 1, 0.0).bytes(mib.min(128) << 20);
        run(name, &d, Compression::Adaptive, Pressure::LinkBound);
    }
    run(
        "incompressible, adaptive",
        &noise,
        Compression::Adaptive,
        Pressure::CpuBound,
    );
    run(
        "incompressible, no compression",
        &noise,
        Compression::None,
        Pressure::CpuBound,
    );
    tiers(&noise);
    report::finish("codec", "codec: encoding and decoding on one core");
}
