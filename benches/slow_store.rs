//! Does a slow disk stall latency-class streams? On loopback, a pair whose receiving daemon
//! (east) has 16 MiB of memory cache and a disk tier is primed with a 64 MiB backup, restarted,
//! and then sent that backup again in a loop, so every reference misses memory and is read from
//! the disk tier. Meanwhile 8 KiB latency-class round trips are timed. Each case runs with the
//! store's test hook adding a delay to every disk read and write (`WANOPT_TEST_STORE_DELAY_MS`),
//! and once without bulk as the floor; the figure to compare is p99 with a slow store against p99
//! with a fast one, in the same run. "disk MiB" is what east's decoder rebuilt from references
//! meanwhile: with 16 MiB of memory and a 64 MiB cycle, it came from the disk tier.
//!
//! Run: `cargo build --release --workspace && cargo bench --bench slow_store`
//! Options: `-- --rounds N` (default 2000), `--delays 0,50` (milliseconds per disk operation).

#[path = "../tests/common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{Certs, Daemon, fill, report, send_pattern, server, site_yaml};

const RR: usize = 8 * 1024;
const BACKUP: u64 = 64 << 20;

/// Echoes 8 KiB messages.
fn echo(mut s: TcpStream) {
    let _ = s.set_nodelay(true);
    let mut buf = vec![0u8; RR];
    while s.read_exact(&mut buf).is_ok() && s.write_all(&buf).is_ok() {}
}

/// Swallows everything.
fn sink(mut s: TcpStream) {
    let mut buf = vec![0u8; 1 << 20];
    while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
}

struct Site {
    east: Daemon,
    west: Daemon,
}

fn start(
    certs: &Certs,
    dirs: &[tempfile::TempDir; 2],
    targets: (SocketAddr, SocketAddr),
    delay: u64,
) -> Site {
    let optimize = |d: &tempfile::TempDir| {
        format!(
            "admin:\n  listen: 127.0.0.1:0\nstate_dir: {}\noptimize:\n  memory: 16MiB\n  disk:\n    bytes: 512MiB\n    checkpoint: 1s\n",
            d.path().display()
        )
    };
    let delay = delay.to_string();
    let east = Daemon::start_env(
        None,
        "east",
        &site_yaml(
            "east",
            "west",
            "listen: 127.0.0.1:0",
            certs,
            &format!(
                "  - name: sync\n    target: {}\n    class: latency\n  - name: rman\n    target: {}\n",
                targets.0, targets.1
            ),
            &optimize(&dirs[0]),
        ),
        &[("WANOPT_TEST_STORE_DELAY_MS", &delay)],
    );
    let west = Daemon::start_env(
        None,
        "west",
        &site_yaml(
            "west",
            "east",
            &format!("connect: {}", east.bound("link")),
            certs,
            "  - name: sync\n    listen: 127.0.0.1:0\n    class: latency\n  - name: rman\n    listen: 127.0.0.1:0\n",
            &optimize(&dirs[1]),
        ),
        &[("WANOPT_TEST_STORE_DELAY_MS", &delay)],
    );
    east.wait_log("link up", Duration::from_secs(10));
    west.wait_log("link up", Duration::from_secs(10));
    Site { east, west }
}

fn stop(mut s: Site) {
    // West sends: stopping it first has both sides save where the caches stand.
    s.west.stop(libc::SIGTERM);
    s.east.stop(libc::SIGTERM);
}

fn kill(mut s: Site) {
    s.west.stop(libc::SIGKILL);
    s.east.stop(libc::SIGKILL);
}

/// Round trips on `rr` while, with `bulk`, the backup is sent again and again to `bulk`.
/// Returns the sorted round trips and the bulk bytes sent meanwhile.
fn measure(
    rr: SocketAddr,
    bulk: Option<SocketAddr>,
    rounds: usize,
    seed: u64,
) -> (Vec<Duration>, u64) {
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let writer = bulk.map(|b| {
        let (stop, sent) = (stop.clone(), sent.clone());
        std::thread::spawn(move || {
            let mut s = TcpStream::connect(b).expect("bulk");
            let mut buf = vec![0u8; 256 * 1024];
            while !stop.load(Ordering::Relaxed) {
                let mut off = 0;
                while off < BACKUP && !stop.load(Ordering::Relaxed) {
                    fill(1, off, &mut buf);
                    if s.write_all(&buf).is_err() {
                        return;
                    }
                    off += buf.len() as u64;
                    sent.fetch_add(buf.len() as u64, Ordering::Relaxed);
                }
            }
        })
    });
    if bulk.is_some() {
        // Let the bulk stream get going and its references reach the disk tier.
        std::thread::sleep(Duration::from_secs(2));
    }
    let mut s = TcpStream::connect(rr).expect("connect");
    s.set_nodelay(true).expect("nodelay");
    let mut buf = vec![0u8; RR];
    let mut v = Vec::with_capacity(rounds);
    for i in 0..rounds {
        // Each message is new, as redo is: nothing for the latency lane to deduplicate.
        fill(seed + i as u64, 0, &mut buf);
        let t = Instant::now();
        s.write_all(&buf).expect("request");
        s.read_exact(&mut buf).expect("response");
        v.push(t.elapsed());
        std::thread::sleep(Duration::from_millis(2));
    }
    let moved = sent.load(Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    drop(writer);
    v.sort();
    (v, moved)
}

fn ms(v: &[Duration], p: f64) -> f64 {
    v[((v.len() as f64 - 1.0) * p).round() as usize].as_secs_f64() * 1e3
}

fn main() {
    let args = common::args::Args::new();
    let rounds: usize = args.get("--rounds", 2000);
    let delays: Vec<u64> = args
        .get("--delays", "0,50".to_string())
        .split(',')
        .filter_map(|d| d.trim().parse().ok())
        .collect();
    let targets = (server(echo), server(sink));
    let certs = Certs::new(&["west", "east"]);

    report::note(format!(
        "Loopback, 8 KiB latency-class round trips ({rounds} per case) while a {} MiB backup repeats from east's disk tier.",
        BACKUP >> 20
    ));
    // Message seeds never repeat across cases.
    let mut seed = 0x5EED_0000;
    for delay in delays {
        let dirs = [
            tempfile::tempdir().expect("tempdir"),
            tempfile::tempdir().expect("tempdir"),
        ];
        // Primed with a fast disk, so the disk tier holds the whole backup.
        let site = start(&certs, &dirs, targets, 0);
        let mut s = TcpStream::connect(site.west.bound("rman")).expect("rman");
        send_pattern(&mut s, 1, BACKUP).expect("prime");
        drop(s);
        std::thread::sleep(Duration::from_secs(2));
        stop(site);

        // Restarted with the disk under test: the repeat can only hit from it.
        let site = start(&certs, &dirs, targets, delay);
        site.east
            .wait_log("resumed a saved cache state", Duration::from_secs(10));
        let (rr, bulk) = (site.west.bound("sync"), site.west.bound("rman"));
        for (name, b) in [
            (format!("store +{delay} ms, no bulk"), None),
            (
                format!("store +{delay} ms, bulk from the disk tier"),
                Some(bulk),
            ),
        ] {
            let hits = |d: &Daemon| {
                common::value(
                    &common::scrape(d.bound("admin")),
                    r#"wanopt_dedup_bytes_total{service="rman",direction="in",result="hit"}"#,
                )
            };
            let before = hits(&site.east);
            let (v, moved) = measure(rr, b, rounds, seed);
            seed += rounds as u64;
            let hit = hits(&site.east) - before;
            let q = |p| format!("{:.2}", ms(&v, p));
            report::row(
                "Round trips (ms), and what the bulk stream moved",
                &["case", "p50", "p99", "p99.9", "max", "bulk MiB", "disk MiB"],
                vec![
                    name,
                    q(0.5),
                    q(0.99),
                    q(0.999),
                    q(1.0),
                    (moved >> 20).to_string(),
                    (hit >> 20).to_string(),
                ],
            );
        }
        // What a slow disk still has queued would hold a clean shutdown for its 30 s limit.
        kill(site);
    }
    report::finish(
        "slow_store",
        "slow_store: latency-class streams beside a slow disk tier",
    );
}
