//! Does a latency-class stream suffer from bulk's loss recovery when both share the one link
//! connection? Measures 8 KiB request/response round trips across a wansim link (default
//! `t3-100ms-1`: 45 Mbit/s, 100 ms RTT, 1% loss), idle and while one bulk stream saturates it:
//! through the wanopt pair (latency class beside a bulk stream on the same link), and directly over
//! the WAN on separate TCP connections (what a second link connection would give).
//!
//! Run (as root): `cargo build --release --workspace && cargo bench --bench latency_under_load`
//! Options: `-- --preset NAME --rounds N` (default 100 round trips per case). Environment:
//! `WANOPT_BENCH_LANE=off` runs without the latency lane; `WANOPT_BENCH_LANE_CC=bbr` sets the
//! lane's congestion control (default cubic, like the daemon's default).

#[path = "../tests/common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{connect_in, east_servers, link_lines, report, wan_pair};
use wansim::{Site, Wan};

const RR: usize = 8 * 1024;

/// Round trips on `rr`, optionally while a bulk writer saturates `bulk`.
fn measure(wan: &Wan, rr: SocketAddr, bulk: Option<SocketAddr>, rounds: usize) -> Vec<Duration> {
    let stop = Arc::new(AtomicBool::new(false));
    let writer = bulk.map(|b| {
        let mut s = connect_in(wan, b, "cubic");
        let stop = stop.clone();
        std::thread::spawn(move || {
            let buf = vec![1u8; 1 << 16];
            while !stop.load(Ordering::Relaxed) && s.write_all(&buf).is_ok() {}
        })
    });
    if bulk.is_some() {
        // Let the bulk stream fill the pipe and the queues first.
        std::thread::sleep(Duration::from_secs(3));
    }
    let mut s = connect_in(wan, rr, "cubic");
    let mut buf = vec![7u8; RR];
    let mut v = Vec::new();
    for _ in 0..rounds {
        let t = Instant::now();
        s.write_all(&buf).expect("request");
        s.read_exact(&mut buf).expect("response");
        v.push(t.elapsed());
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    drop(writer);
    v.sort();
    v
}

fn ms(v: &[Duration], p: f64) -> f64 {
    v[((v.len() as f64 - 1.0) * p).round() as usize].as_secs_f64() * 1e3
}

fn main() {
    if !wansim::available_or_skip("latency under load") {
        return;
    }
    let args = common::args::Args::new();
    let preset = args.get("--preset", "t3-100ms-1".to_string());
    let rounds: usize = args.get("--rounds", 100);
    let params = wansim::preset(&preset).expect("preset");
    let (stated, stated_words) = wanopt_replay::showcase::stated_link(&params);
    let wan = Wan::start(&format!("wl{}", std::process::id() % 100_000), params).expect("wansim");
    let east_ip = std::net::IpAddr::V4(Site::East.addr());
    east_servers(&wan, east_ip);

    let lanes = format!(
        "{stated}  latency_lane: {}\n  lane_congestion: {}\n",
        std::env::var("WANOPT_BENCH_LANE").map_or(true, |v| v != "off"),
        std::env::var("WANOPT_BENCH_LANE_CC").unwrap_or_else(|_| "cubic".into())
    );
    let p = wan_pair(
        &wan,
        &format!(
            "  - name: lat\n    target: {east_ip}:9000\n    class: latency\n  - name: bulk\n    target: {east_ip}:9001\n"
        ),
        "  - name: lat\n    listen: 127.0.0.1:0\n    class: latency\n  - name: bulk\n    listen: 127.0.0.1:0\n",
        |site, y| {
            if site == "west" {
                link_lines(y, &lanes)
            } else {
                y
            }
        },
    );
    let west = &p.west;
    let (t_lat, t_bulk) = (west.bound("lat"), west.bound("bulk"));
    let (d_lat, d_bulk) = (
        SocketAddr::new(east_ip, 9000),
        SocketAddr::new(east_ip, 9001),
    );

    report::note(format!(
        "`{preset}`: 8 KiB round trips, {rounds} per case; {stated_words}."
    ));
    for (name, rr, bulk) in [
        ("direct (cubic), idle", d_lat, None),
        (
            "direct (cubic), bulk on a separate TCP connection",
            d_lat,
            Some(d_bulk),
        ),
        ("wanopt latency class, idle", t_lat, None),
        (
            "wanopt latency class, bulk stream on the same link",
            t_lat,
            Some(t_bulk),
        ),
    ] {
        let v = measure(&wan, rr, bulk, rounds);
        let q = |p| format!("{:.1}", ms(&v, p));
        report::row(
            "Round trips (ms)",
            &["case", "p50", "p90", "p99"],
            vec![name.into(), q(0.5), q(0.9), q(0.99)],
        );
    }
    let (a, b) = wan.counters();
    report::note(format!("wansim west→east: {a}; east→west: {b}."));
    report::finish(
        "latency_under_load",
        "latency_under_load: round trips beside a bulk stream",
    );
}
