//! Sharing the link between services, across wansim (default `t3-100ms-0.5`: 45 Mbit/s,
//! 100 ms RTT, 0.5% loss), through the daemon pair, each phase a fresh pair:
//!
//! 1. the backup alone: 8 streams of incompressible bytes (an 8-channel RMAN duplicate), as
//!    fast as they go: what the link carries;
//! 2. redo beside it: a service writing real WAL at a steady 2 MB/s (`share: 4`) next to the
//!    backup (`share: 1`): the redo stream's backlog (written, not yet at the target) and rate,
//!    the backup's rate, and the link's use against phase 1;
//! 3. equal shares: one stream of one service against the 8 of another, both as fast as they
//!    go: each service's part of the link;
//! 4. with `--old PATH` (a `wanoptd` built before services shared the link): phase 2 again with
//!    it (no `share`), for the per-stream round robin it had.
//!
//! Run (as root): `cargo build --release --workspace && cargo bench --bench sharing`. Options:
//! `-- --preset NAME --seconds N` (measured per phase after 5 s of warm-up; default 30),
//! `--wal DIR` (WAL segments to send as redo; default the local PostgreSQL 15 cluster's
//! `pg_wal`), `--old PATH`, `--write` (into benches/README.md).

#[path = "../tests/common/mod.rs"]
mod common;

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::sink::{Pace, Sink, in_east, send};
use common::{bin, fill, link_lines, report, scrape_on, series, value, wan_pair_of};
use wansim::{Site, Wan};

/// Redo's rate: 64 KiB every 32 ms.
const REDO_PIECE: usize = 64 << 10;
const REDO_EVERY: Duration = Duration::from_millis(32);
const REDO_RATE: f64 = REDO_PIECE as f64 / 0.032;
const WARMUP: Duration = Duration::from_secs(5);

/// Real WAL: the segments in `dir`, in name order, up to 1 GiB.
fn wal(dir: &Path) -> Vec<u8> {
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("--wal {}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect();
    names.sort();
    let mut out = Vec::new();
    for n in names {
        if let Ok(b) = std::fs::read(&n) {
            out.extend_from_slice(&b);
        }
        if out.len() >= 1 << 30 {
            break;
        }
    }
    assert!(
        out.len() >= 16 << 20,
        "--wal {}: {} bytes of WAL; give a directory of segments",
        dir.display(),
        out.len()
    );
    out
}

/// What one phase measured over its window.
#[derive(Default)]
struct Measured {
    /// Raw bytes per second at the target, per service.
    raw: Vec<(String, f64)>,
    /// Link bytes per second the sender's metrics counted, per service.
    wire: Vec<(String, f64)>,
    /// The redo stream's backlog: worst and 99th percentile, in bytes.
    lag: Option<(u64, u64)>,
}

impl Measured {
    fn wire_total(&self) -> f64 {
        self.wire.iter().map(|(_, r)| r).sum()
    }

    fn of(v: &[(String, f64)], svc: &str) -> f64 {
        v.iter().find(|(s, _)| s == svc).map_or(0.0, |(_, r)| *r)
    }
}

struct Bench {
    wan: Wan,
    srv: SocketAddr,
    sink: Arc<Sink>,
    wal: Arc<Vec<u8>>,
    /// The WAL already sent (each phase sends fresh WAL, as a primary would).
    wal_at: u64,
    next_id: u64,
    seconds: u64,
}

impl Bench {
    /// One phase: a fresh pair of `exe`, `services` (name, west's extra lines, streams; zero
    /// streams: the redo stream), measured for the bench's seconds after the warm-up.
    fn phase(&mut self, exe: &Path, services: &[(&str, &str, usize)]) -> Measured {
        let east: String = services
            .iter()
            .map(|(n, _, _)| format!("  - name: {n}\n    target: {}\n", self.srv))
            .collect();
        let west: String = services
            .iter()
            .map(|(n, extra, _)| format!("  - name: {n}\n    listen: 127.0.0.1:0\n{extra}"))
            .collect();
        let p = wan_pair_of(exe, &self.wan, &east, &west, |site, y| {
            let y = link_lines(y, "  bandwidth: 45mbit\n");
            if site == "west" {
                y + "admin:\n  listen: 127.0.0.1:0\n"
            } else {
                y
            }
        });
        let wan = &self.wan;
        let connect = |addr: SocketAddr| {
            wan.in_site(Site::West, move || TcpStream::connect(addr))
                .expect("west")
                .expect("connect")
        };
        let stop = Arc::new(AtomicBool::new(false));
        let mut senders = Vec::new();
        let mut counted: Vec<(String, Arc<AtomicU64>)> = Vec::new();
        let mut redo: Option<(Arc<AtomicU64>, Arc<AtomicU64>)> = None;
        for (name, _, streams) in services {
            let addr = p.west.bound(name);
            for _ in 0..(*streams).max(1) {
                self.next_id += 1;
                let id = self.next_id;
                let (c, stop, sent) = (connect(addr), stop.clone(), Arc::new(AtomicU64::new(0)));
                counted.push((name.to_string(), self.sink.counter(id)));
                let t = if *streams == 0 {
                    redo = Some((sent.clone(), self.sink.counter(id)));
                    let (wal, at) = (self.wal.clone(), self.wal_at);
                    let pace = Pace {
                        piece: REDO_PIECE,
                        every: REDO_EVERY,
                    };
                    let source = move |off: u64, b: &mut [u8]| {
                        let n = wal.len() as u64;
                        for (i, x) in b.iter_mut().enumerate() {
                            *x = wal[((at + off + i as u64) % n) as usize];
                        }
                    };
                    std::thread::spawn(move || send(c, id, source, pace, &stop, &sent))
                } else {
                    let pace = Pace {
                        piece: 256 << 10,
                        every: Duration::ZERO,
                    };
                    std::thread::spawn(move || {
                        send(c, id, |o, b| fill(id, o, b), pace, &stop, &sent)
                    })
                };
                senders.push(t);
            }
        }
        let scrape = || scrape_on(connect(p.west.bound("admin")));
        let received = |svc: &str| -> u64 {
            counted
                .iter()
                .filter(|(s, _)| s == svc)
                .map(|(_, c)| c.load(Ordering::Relaxed))
                .sum()
        };
        std::thread::sleep(WARMUP);
        let names: Vec<&str> = services.iter().map(|(n, _, _)| *n).collect();
        let raw0: Vec<u64> = names.iter().map(|n| received(n)).collect();
        let m0 = scrape();
        let start = Instant::now();
        let mut lags = Vec::new();
        while start.elapsed() < Duration::from_secs(self.seconds) {
            std::thread::sleep(Duration::from_millis(100));
            if let Some((sent, got)) = &redo {
                lags.push(
                    sent.load(Ordering::Relaxed)
                        .saturating_sub(got.load(Ordering::Relaxed)),
                );
            }
        }
        let secs = start.elapsed().as_secs_f64();
        let m1 = scrape();
        let raw1: Vec<u64> = names.iter().map(|n| received(n)).collect();
        stop.store(true, Ordering::Relaxed);
        for t in senders {
            t.join().expect("sender").expect("stream exact");
        }
        if let Some((sent, _)) = &redo {
            self.wal_at += sent.load(Ordering::Relaxed);
        }
        lags.sort_unstable();
        let wire = |m: &str, n: &str| value(m, &series("wanopt_wire_bytes_total", n, "out"));
        Measured {
            raw: names
                .iter()
                .zip(raw0.iter().zip(&raw1))
                .map(|(n, (a, b))| (n.to_string(), (b - a) as f64 / secs))
                .collect(),
            wire: names
                .iter()
                .map(|n| {
                    let w = wire(&m1, n).saturating_sub(wire(&m0, n));
                    (n.to_string(), w as f64 / secs)
                })
                .collect(),
            lag: (!lags.is_empty()).then(|| {
                let p99 = lags[((lags.len() - 1) as f64 * 0.99) as usize];
                (lags[lags.len() - 1], p99)
            }),
        }
    }
}

fn mb(x: f64) -> String {
    format!("{:.2}", x / 1e6)
}

fn main() {
    if !wansim::available_or_skip("sharing the link") {
        return;
    }
    let args = common::args::Args::new();
    let preset = args.get("--preset", "t3-100ms-0.5".to_string());
    let seconds: u64 = args.get("--seconds", 30);
    let wal_dir = args.get("--wal", "/var/lib/postgresql/15/main/pg_wal".to_string());
    let old = args.text("--old").map(PathBuf::from);
    let wal = Arc::new(wal(Path::new(&wal_dir)));
    let wan = Wan::start(
        &format!("bs{}", std::process::id() % 100_000),
        wansim::preset(&preset).expect("preset"),
    )
    .expect("wansim");
    let (sink, srv) = in_east(&wan, 9100);
    let mut b = Bench {
        wan,
        srv,
        sink,
        wal,
        wal_at: 0,
        next_id: 0,
        seconds,
    };
    report::note(format!(
        "`{preset}`, both daemons stating 45 Mbit/s; each phase a fresh pair, measured for \
         {seconds} s after {} s of warm-up. Redo: {} MB of real WAL from `{wal_dir}` written \
         at {:.1} MB/s (64 KiB every 32 ms). Backup: 8 streams of incompressible bytes as fast \
         as they go. Rates are MB/s; link rates are the sender's `wanopt_wire_bytes_total`.",
        WARMUP.as_secs(),
        b.wal.len() >> 20,
        REDO_RATE / 1e6
    ));
    let now = bin("wanoptd");
    let alone = b.phase(&now, &[("backup", "", 8)]);
    let table = "Redo beside an 8-stream backup";
    let header = [
        "case",
        "redo at target",
        "redo backlog worst (s)",
        "p99 (s)",
        "backup link",
        "link total",
        "vs backup alone",
    ];
    let row = |case: &str, m: &Measured| {
        let (worst, p99) = m.lag.unwrap_or((0, 0));
        report::row(
            table,
            &header,
            vec![
                case.into(),
                mb(Measured::of(&m.raw, "redo")),
                format!("{:.2}", worst as f64 / REDO_RATE),
                format!("{:.2}", p99 as f64 / REDO_RATE),
                mb(Measured::of(&m.wire, "backup")),
                mb(m.wire_total()),
                format!("{:.3}", m.wire_total() / alone.wire_total()),
            ],
        );
    };
    row("backup alone", &alone);
    let shared = b.phase(
        &now,
        &[
            ("redo", "    share: 4\n", 0),
            ("backup", "    share: 1\n", 8),
        ],
    );
    row("redo share 4, backup share 1", &shared);
    if let Some(old) = &old {
        let before = b.phase(old, &[("redo", "", 0), ("backup", "", 8)]);
        row("before: a turn per stream (--old)", &before);
    }
    let equal = b.phase(&now, &[("one", "", 1), ("eight", "", 8)]);
    let total = equal.wire_total();
    for (svc, streams) in [("one", 1), ("eight", 8)] {
        report::row(
            "Equal shares, both as fast as they go",
            &["service", "streams", "link", "part of the link"],
            vec![
                svc.into(),
                streams.to_string(),
                mb(Measured::of(&equal.wire, svc)),
                format!("{:.3}", Measured::of(&equal.wire, svc) / total),
            ],
        );
    }
    let (a, z) = b.wan.counters();
    report::note(format!("wansim west→east: {a}; east→west: {z}."));
    report::finish("sharing", "sharing: services on one link");
}
