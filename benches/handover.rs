//! What a restart of either daemon costs the streams (issue 38): across wansim (default
//! `t3-100ms-0.5`), one bulk stream fills the link and 8 KiB SYNC-style round trips run every
//! 20 ms through a latency-class service, while each side in turn hands over to a new process
//! (`SIGUSR2`, the path the packages take; `systemctl restart` adds systemd's store round trip,
//! about 0.1 s on loopback in `tests/systemctl.rs`). For comparison, the link's connections are
//! also killed once (`ss -K`, a lost connection the link resumes from). Each case runs with the
//! caches' disk tier off and on.
//!
//! Per event: the bulk stream's longest gap between arrivals at its target, the slowest round
//! trip, the stall the new process counted (`wanopt_handover_stall_seconds_total`), and the
//! bytes both sides sent again on resuming (`wanopt_link_resent_bytes_total`).
//!
//! Run (as root): `cargo build --release --workspace && cargo bench --bench handover`
//! Options: `-- --preset NAME --settle SECONDS` (default 8 s between events).

#[path = "../tests/common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Daemon, connect_in, east_servers, link_lines, report, value, value_f64};
use wansim::{Site, Wan};

const RR: usize = 8 * 1024;

/// Arrival times at the bulk target and round trips (start, duration), as they happen.
#[derive(Default)]
struct Trace {
    arrivals: Mutex<Vec<Instant>>,
    rounds: Mutex<Vec<(Instant, Duration)>>,
}

impl Trace {
    /// The longest gap between arrivals, and the slowest round trip, in `[from, to]`.
    fn worst(&self, from: Instant, to: Instant) -> (Duration, Duration) {
        let a = self.arrivals.lock().expect("arrivals");
        let mut gap = Duration::ZERO;
        let mut last: Option<Instant> = None;
        for t in a.iter().filter(|t| **t >= from && **t <= to) {
            if let Some(l) = last {
                gap = gap.max(t.duration_since(l));
            }
            last = Some(*t);
        }
        let r = self.rounds.lock().expect("rounds");
        let rtt = r
            .iter()
            .filter(|(t, _)| *t >= from && *t <= to)
            .map(|(_, d)| *d)
            .max()
            .unwrap_or_default();
        (gap, rtt)
    }
}

/// The pid of the process a daemon handed over to the `n`th time, from its log.
fn successor(d: &Daemon, n: usize) -> i32 {
    let line = d.wait_log_n("handed over to the new process", n, Duration::from_secs(60));
    line.split_whitespace()
        .find_map(|t| t.strip_prefix("pid="))
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no pid in {line:?}"))
}

/// A scrape of the admin endpoint at `addr` in `site`'s namespace.
fn scrape_in(wan: &Wan, site: Site, addr: SocketAddr) -> String {
    let s = wan
        .in_site(site, move || std::net::TcpStream::connect(addr))
        .expect("site")
        .expect("connect admin");
    common::scrape_on(s)
}

/// The bytes both sides sent again on resuming, so far.
fn resent(wan: &Wan, admin: [SocketAddr; 2]) -> u64 {
    [Site::West, Site::East]
        .into_iter()
        .zip(admin)
        .map(|(site, a)| value(&scrape_in(wan, site, a), "wanopt_link_resent_bytes_total "))
        .sum()
}

/// One run with the disk tier `disk`: a pair, the loads, and the events; a table row each.
fn run(wan: &Wan, disk: bool, settle: Duration, rtt: Duration) {
    let east_ip = std::net::IpAddr::V4(Site::East.addr());
    // Each run its own bulk target port (the one before still listens).
    let bulk_port = 9003 + u16::from(disk);
    let trace = Arc::new(Trace::default());
    // The bulk target: reads and notes when bytes arrive.
    let l = wan
        .in_site(Site::East, move || {
            std::net::TcpListener::bind((east_ip, bulk_port))
        })
        .expect("east")
        .expect("bind");
    {
        let trace = trace.clone();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { continue };
                let trace = trace.clone();
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 1 << 16];
                    while matches!(s.read(&mut buf), Ok(n) if n > 0) {
                        trace
                            .arrivals
                            .lock()
                            .expect("arrivals")
                            .push(Instant::now());
                    }
                });
            }
        });
    }
    let state = (
        tempfile::tempdir().expect("tempdir"),
        tempfile::tempdir().expect("tempdir"),
    );
    let pair = common::wan_pair(
        wan,
        &format!(
            "  - name: sync\n    target: {east_ip}:9000\n    class: latency\n  - name: bulk\n    target: {east_ip}:{bulk_port}\n"
        ),
        "  - name: sync\n    listen: 127.0.0.1:0\n    class: latency\n  - name: bulk\n    listen: 127.0.0.1:0\n",
        |site, y| {
            let dir = if site == "west" { &state.1 } else { &state.0 };
            let disk_lines = if disk {
                format!(
                    "state_dir: {}\noptimize:\n  disk:\n    bytes: 512MiB\n    checkpoint: 2s\n",
                    dir.path().display()
                )
            } else {
                format!("state_dir: {}\n", dir.path().display())
            };
            let y = format!("{y}admin:\n  listen: 127.0.0.1:0\n{disk_lines}");
            link_lines(y, "  bandwidth: 45mbit\n  rtt: 100ms\n")
        },
    );
    let (west, east) = (&pair.west, &pair.east);
    let admin = [west.bound("admin"), east.bound("admin")];
    let stop = Arc::new(AtomicBool::new(false));
    // Bulk: new incompressible bytes (the codec chunks, fingerprints and caches them, and the
    // disk tier stores them), enough to keep the T3 full.
    let mut bulk = connect_in(wan, west.bound("bulk"), "cubic");
    let writer = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 1 << 16];
            let mut off = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let seed = if off % (8 << 20) < (4 << 20) {
                    off
                } else {
                    off / 2
                };
                common::fill(seed / (1 << 16), 0, &mut buf);
                if bulk.write_all(&buf).is_err() {
                    break;
                }
                off += buf.len() as u64;
            }
        })
    };
    let mut sync = connect_in(wan, west.bound("sync"), "cubic");
    let looper = {
        let (stop, trace) = (stop.clone(), trace.clone());
        std::thread::spawn(move || {
            let mut out = vec![0u8; RR];
            let mut back = vec![0u8; RR];
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                common::fill(9, n * RR as u64, &mut out);
                let t = Instant::now();
                if sync.write_all(&out).is_err() || sync.read_exact(&mut back).is_err() {
                    return Err(format!("round trip {n} failed"));
                }
                if back != out {
                    return Err(format!("round trip {n}: the echo differs"));
                }
                trace.rounds.lock().expect("rounds").push((t, t.elapsed()));
                n += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(n)
        })
    };
    std::thread::sleep(settle);
    let mut pids = [west.pid() as i32, east.pid() as i32];
    let mut successors = Vec::new();
    let tier = if disk { "on" } else { "off" };
    // A quiet window first, for the baseline.
    let quiet_from = Instant::now();
    std::thread::sleep(settle);
    let (gap0, rtt0) = trace.worst(quiet_from, Instant::now());
    let header = [
        "disk tier",
        "event",
        "bulk longest gap s",
        "slowest round trip ms",
        "/ RTT",
        "stall counted s",
        "resent bytes",
    ];
    let table = "What each event cost the streams";
    report::row(
        table,
        &header,
        vec![
            tier.into(),
            "none (a quiet window)".into(),
            format!("{:.2}", gap0.as_secs_f64()),
            format!("{:.0}", rtt0.as_secs_f64() * 1e3),
            format!("{:.1}", rtt0.as_secs_f64() / rtt.as_secs_f64()),
            "-".into(),
            "-".into(),
        ],
    );
    for (i, event) in [
        "west hands over",
        "east hands over",
        "link connections killed",
    ]
    .into_iter()
    .enumerate()
    {
        let before = resent(wan, admin);
        let from = Instant::now();
        let stall_at;
        if i < 2 {
            let d = if i == 0 { west } else { east };
            // SAFETY: kill with a pid this bench started or read from the daemon's log.
            unsafe { libc::kill(pids[i], libc::SIGUSR2) };
            let pid = successor(d, 1);
            successors.push(pid);
            pids[i] = pid;
            stall_at = Some(admin[i]);
        } else {
            let out = wan
                .command(Site::West, "ss")
                .args([
                    "-K",
                    "dst",
                    &Site::East.addr().to_string(),
                    "dport",
                    "=",
                    ":7400",
                ])
                .output()
                .expect("ss");
            assert!(out.status.success(), "ss -K: {out:?}");
            stall_at = None;
        }
        std::thread::sleep(settle);
        let (gap, worst) = trace.worst(from, Instant::now());
        let site = if i == 0 { Site::West } else { Site::East };
        let stall = stall_at.map_or("-".to_string(), |a| {
            format!(
                "{:.2}",
                value_f64(
                    &scrape_in(wan, site, a),
                    "wanopt_handover_stall_seconds_total "
                )
            )
        });
        report::row(
            table,
            &header,
            vec![
                tier.into(),
                event.into(),
                format!("{:.2}", gap.as_secs_f64()),
                format!("{:.0}", worst.as_secs_f64() * 1e3),
                format!("{:.1}", worst.as_secs_f64() / rtt.as_secs_f64()),
                stall,
                resent(wan, admin).saturating_sub(before).to_string(),
            ],
        );
    }
    stop.store(true, Ordering::Relaxed);
    let _ = writer.join();
    let rounds = looper.join().expect("round trips");
    assert!(rounds.is_ok(), "{rounds:?}");
    for d in [west, east] {
        assert_eq!(d.count("stream failed"), 0, "{}", d.log().join("\n"));
    }
    // The processes handed over to are not this bench's children: stop them before the next
    // run takes their ports.
    for sig in [libc::SIGTERM, libc::SIGKILL] {
        for pid in &successors {
            // SAFETY: pids of processes this run's daemons handed over to.
            unsafe { libc::kill(*pid, sig) };
        }
        std::thread::sleep(Duration::from_secs(2));
    }
}

fn main() {
    if !wansim::available_or_skip("handover costs") {
        return;
    }
    let args = common::args::Args::new();
    let preset = args.get("--preset", "t3-100ms-0.5".to_string());
    let settle = Duration::from_secs(args.get("--settle", 8u64));
    let params = wansim::preset(&preset).expect("preset");
    let (_, rtt) = params.stated();
    let wan = Wan::start(&format!("hb{}", std::process::id() % 100_000), params).expect("wansim");
    east_servers(&wan, std::net::IpAddr::V4(Site::East.addr()));
    report::note(format!(
        "`{preset}` (RTT {} ms): a bulk stream fills the link and 8 KiB round trips run every 20 ms through a latency-class service; each event is followed by {} s; the slowest round trip and the bulk stream's longest gap are taken over that time. Handovers are `SIGUSR2`.",
        rtt.as_millis(),
        settle.as_secs()
    ));
    for disk in [false, true] {
        run(&wan, disk, settle, rtt);
    }
    let (a, b) = wan.counters();
    report::note(format!("wansim west→east: {a}; east→west: {b}."));
    report::finish("handover", "handover: what a restart costs the streams");
}
