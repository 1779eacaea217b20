//! The tail of SYNC round trips on a lossy WAN: 8 KiB request/response round trips (20 ms
//! apart, as a Data Guard SYNC commit stream) on several paths at once, for the same time,
//! across one wansim link: direct TCP with CUBIC, direct TCP with BBR, the wanopt pair with
//! `--copies` copies of its latency lane sent back to back, a second pair with one
//! (`redundancy: off`), and one more pair per entry of `--spaced-copies` whose copies leave
//! `--spacing` ms apart. Then the same while a bulk stream through the first pair fills the
//! link. Reports p50, p99, p99.9 and the worst, in ms and as multiples of the RTT, the round
//! trips slower than 1.2 and 1.5 RTT, and the bulk stream's rate. On stderr, each round trip
//! over 1.2 RTT of a pair with copies, with what wansim did meanwhile (losses, its queue, late
//! packets), how late a probe thread woke (a busy CPU), and the other pairs' worst round trips
//! then: what tells a burst, a busy host and a copy's own connection apart.
//!
//! Run (as root): `cargo build --release --workspace && cargo bench --bench sync_tail --
//! --preset t3-100ms-1 --seconds 600`. Options: `--preset NAME` (default `t3-100ms-0.5`),
//! `--seconds N` per phase (default 60), `--copies N` for the first pair (default 2),
//! `--spaced-copies N,M,..` (default: `--copies`; `N@MS` spaces that pair's copies MS apart,
//! `N@MS/RTO` sets its `link.lane_rto_min` too, in ms or `off`; a `:off` or `:on` suffix its
//! `link.lane_datagrams`),
//! `--spacing MS` between the spaced pairs' copies (default 5; 0 leaves them out), `--rto-min
//! MS` their `link.lane_rto_min` (or `off`; default the daemon's `auto`), `--latency-queue V` every pair's
//! `link.latency_queue` (default 5ms; `off`), `--phases idle,loaded` (default both), `--svg
//! FILE` (the percentile curves; default
//! `benches/charts/sync-tail-PRESET.svg`).

#[path = "../tests/common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{connect_in, east_servers, link_lines, report, wan_pair};
use wanopt_replay::chart::{Chart, Percentiles, cdf_of_sorted, render};
use wansim::{Site, Wan};

const RR: usize = 8 * 1024;

/// Round trips on `s` for `secs`, 20 ms apart; each answer is checked. Each is returned with
/// when it started, counted from `from`, in the order they ran.
fn round_trips(mut s: TcpStream, from: Instant, secs: u64) -> Vec<(Duration, Duration)> {
    let end = Instant::now() + Duration::from_secs(secs);
    let mut msg = vec![0u8; RR];
    let mut back = vec![0u8; RR];
    let mut v = Vec::new();
    let mut n = 0u64;
    while Instant::now() < end {
        common::fill(n, 0, &mut msg);
        let t = Instant::now();
        s.write_all(&msg).expect("request");
        s.read_exact(&mut back).expect("response");
        v.push((t - from, t.elapsed()));
        assert!(back == msg, "round trip {n}: the answer differs");
        n += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    v
}

/// One look at the WAN: when, both directions' counters, and how much later than asked this
/// thread woke for it (a probe of how long a thread waits for a core).
type Sample = (Duration, [wansim::DirSnapshot; 2], Duration);

/// wansim's counters, both directions, every 2 ms while `stop` is false.
fn sample_wan(wan: &Wan, from: Instant, stop: &AtomicBool) -> Vec<Sample> {
    let mut v = Vec::new();
    let tick = Duration::from_millis(2);
    let mut last = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        let (a, b) = wan.counters();
        let now = Instant::now();
        v.push((now - from, [a, b], (now - last).saturating_sub(tick)));
        last = now;
        std::thread::sleep(tick);
    }
    v
}

/// What wansim did between `a` and `b`, per direction: packets dropped at random or in a burst,
/// dropped by a full queue, and the deepest queue sampled.
fn wan_between(s: &[Sample], a: Duration, b: Duration) -> String {
    let inside: Vec<_> = s.iter().filter(|(t, ..)| *t >= a && *t <= b).collect();
    let (Some(first), Some(last)) = (inside.first(), inside.last()) else {
        return "no samples".into();
    };
    let dir = |i: usize, name: &str| {
        let (f, l) = (&first.1[i], &last.1[i]);
        format!(
            "{name}: lost {} in bursts {} queue {} (deepest {} KB), {} packets over 1 ms late",
            l.drop_loss - f.drop_loss,
            l.drop_burst - f.drop_burst,
            l.drop_queue - f.drop_queue,
            inside
                .iter()
                .map(|(_, d, _)| d[i].queue_bytes)
                .max()
                .unwrap_or(0)
                / 1000,
            l.late_over_1ms - f.late_over_1ms
        )
    };
    let waited = inside.iter().map(|s| s.2).max().unwrap_or_default();
    format!(
        "{}; {}; a probe thread woke up to {:.1} ms late",
        dir(0, "west→east"),
        dir(1, "east→west"),
        waited.as_secs_f64() * 1e3
    )
}

fn ms(v: &[Duration], p: f64) -> f64 {
    v[((v.len() as f64 - 1.0) * p).round() as usize].as_secs_f64() * 1e3
}

/// Round trips slower than `limit_ms`.
fn over(v: &[Duration], limit_ms: f64) -> usize {
    v.iter()
        .filter(|d| d.as_secs_f64() * 1e3 > limit_ms)
        .count()
}

fn main() {
    if !wansim::available_or_skip("sync tail") {
        return;
    }
    let args = common::args::Args::new();
    let preset = args.get("--preset", "t3-100ms-0.5".to_string());
    let secs: u64 = args.get("--seconds", 60);
    let copies: String = args.get("--copies", "2".to_string());
    let spacing: u64 = args.get("--spacing", 5);
    let spaced_copies: Vec<String> = args
        .get("--spaced-copies", copies.clone())
        .split(',')
        .map(str::to_string)
        .collect();
    let phases: String = args.get("--phases", "idle,loaded".to_string());
    let latency_queue: String = args.get("--latency-queue", "5ms".to_string());
    let rto_min: Option<String> = args.text("--rto-min").map(|v| rto_setting(&v));
    let params = wansim::preset(&preset).expect("preset");
    let rtt_ms = params.stated().1.as_secs_f64() * 1e3;
    let (stated, stated_words) = wanopt_replay::showcase::stated_link(&params);
    let wan = Wan::start(&format!("st{}", std::process::id() % 100_000), params).expect("wansim");
    let east_ip = std::net::IpAddr::V4(Site::East.addr());
    east_servers(&wan, east_ip);
    // Pairs side by side: east on 7400 (copies back to back), 7401 (one connection) and 7402
    // (copies `--spacing` ms apart).
    let start = |port: u16,
                 redundancy: &str,
                 spacing: u64,
                 rto_min: Option<String>,
                 datagrams: Option<String>| {
        let latency_queue = latency_queue.clone();
        let lat = format!("    class: latency\n    redundancy: {redundancy}\n");
        let stated = stated.clone();
        wan_pair(
            &wan,
            &format!(
                "  - name: lat\n    target: {east_ip}:9000\n{lat}  - name: bulk\n    target: {east_ip}:9001\n"
            ),
            &format!(
                "  - name: lat\n    listen: 127.0.0.1:0\n{lat}  - name: bulk\n    listen: 127.0.0.1:0\n"
            ),
            move |_, y| {
                link_lines(
                    format!(
                        "{}admin:\n  listen: 127.0.0.1:0\n",
                        y.replace(":7400", &format!(":{port}"))
                    ),
                    &format!(
                        "{stated}  copy_spacing: {spacing}ms\n{}{}  latency_queue: {latency_queue}\n",
                        rto_min
                            .as_ref()
                            .map_or(String::new(), |m| format!("  lane_rto_min: {m}\n")),
                        datagrams
                            .as_ref()
                            .map_or(String::new(), |d| format!("  lane_datagrams: {d}\n"))
                    ),
                )
            },
        )
    };
    let with_copies = start(7400, &copies, 0, rto_min.clone(), None);
    let single = start(7401, "off", 0, rto_min.clone(), None);
    // One pair per entry of `--spaced-copies`: N copies `--spacing` ms apart, or `N@MS`.
    // `N@MS/RTO` also sets that pair's `link.lane_rto_min` (else `--rto-min`).
    type Spaced = (String, u64, Option<String>, Option<String>, common::WanPair);
    let spaced: Vec<Spaced> = if spacing > 0 {
        spaced_copies
            .iter()
            .enumerate()
            .map(|(i, entry)| {
                let (entry, datagrams) = match entry.split_once(':') {
                    Some((e, d)) => (e, Some(d.to_string())),
                    None => (entry.as_str(), None),
                };
                let (entry, rto) = match entry.split_once('/') {
                    Some((e, r)) => (e, Some(rto_setting(r))),
                    None => (entry, rto_min.clone()),
                };
                let (n, ms) = match entry.split_once('@') {
                    Some((n, ms)) => (n.to_string(), ms.parse().expect("--spaced-copies N@MS")),
                    None => (entry.to_string(), spacing),
                };
                let pair = start(7402 + i as u16, &n, ms, rto.clone(), datagrams.clone());
                (n, ms, rto, datagrams, pair)
            })
            .collect()
    } else {
        Vec::new()
    };
    for p in std::iter::once(&with_copies).chain(spaced.iter().map(|(.., p)| p)) {
        p.west
            .wait_log("latency lane copy attached", Duration::from_secs(30));
    }
    let mut paths: Vec<(String, SocketAddr, &'static str)> = vec![
        (
            "direct CUBIC".into(),
            SocketAddr::new(east_ip, 9000),
            "cubic",
        ),
        ("direct BBR".into(), SocketAddr::new(east_ip, 9000), "bbr"),
        (
            format!("wanopt, redundancy {copies}"),
            with_copies.west.bound("lat"),
            "cubic",
        ),
        (
            "wanopt, redundancy off".into(),
            single.west.bound("lat"),
            "cubic",
        ),
    ];
    for (n, spacing, rto, datagrams, p) in &spaced {
        paths.push((
            format!(
                "wanopt, redundancy {n}, copies {spacing} ms apart{}{}",
                rto.as_ref()
                    .map_or(String::new(), |m| format!(", lane RTO min {m}")),
                datagrams
                    .as_ref()
                    .map_or(String::new(), |d| format!(", datagrams {d}"))
            ),
            p.west.bound("lat"),
            "cubic",
        ));
    }
    // Each path's pair, for its daemons' log lines about impaired copies.
    let pair_of: Vec<Option<&common::WanPair>> = [None, None, Some(&with_copies), Some(&single)]
        .into_iter()
        .chain(spaced.iter().map(|(.., p)| Some(p)))
        .collect();
    report::note(format!(
        "`{preset}`: 8 KiB round trips 20 ms apart, {secs} s per phase, all paths at once; {stated_words}."
    ));
    let mut charts = Vec::new();
    for bulk in [false, true] {
        if !phases.contains(if bulk { "loaded" } else { "idle" }) {
            continue;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let written = Arc::new(AtomicU64::new(0));
        let writer = bulk.then(|| {
            let mut s = connect_in(&wan, with_copies.west.bound("bulk"), "cubic");
            let (stop, written) = (stop.clone(), written.clone());
            std::thread::spawn(move || {
                // Bytes that neither compress nor repeat: they fill the link as they are.
                let mut buf = vec![0u8; 1 << 16];
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    common::fill(0xb01c, n, &mut buf);
                    if s.write_all(&buf).is_err() {
                        break;
                    }
                    n += buf.len() as u64;
                    written.store(n, Ordering::Relaxed);
                }
            })
        });
        if bulk {
            // Let the bulk stream fill the pipe and the queues first.
            std::thread::sleep(Duration::from_secs(5));
        }
        let (bulk_from, t_from) = (written.load(Ordering::Relaxed), Instant::now());
        let wall_from = second_of_day(std::time::SystemTime::now());
        let sampling = AtomicBool::new(false);
        let (timed, samples) = std::thread::scope(|sc| {
            let sampler = sc.spawn(|| sample_wan(&wan, t_from, &sampling));
            let runs: Vec<_> = paths
                .iter()
                .map(|(_, addr, cc)| {
                    let s = connect_in(&wan, *addr, cc);
                    sc.spawn(move || round_trips(s, t_from, secs))
                })
                .collect();
            let timed: Vec<Vec<(Duration, Duration)>> = runs
                .into_iter()
                .map(|r| r.join().expect("round trips"))
                .collect();
            sampling.store(true, Ordering::Relaxed);
            (timed, sampler.join().expect("sampler"))
        });
        // The slow round trips of the pairs with copies, and what the WAN and the other
        // paths did meanwhile (stderr: for finding out why, not for the report).
        for (i, ((name, ..), v)) in paths.iter().zip(&timed).enumerate() {
            if !name.contains("copies") {
                continue;
            }
            for &(at, took) in v
                .iter()
                .filter(|(_, d)| d.as_secs_f64() * 1e3 > 1.2 * rtt_ms)
            {
                let others: Vec<String> = paths
                    .iter()
                    .zip(&timed)
                    .enumerate()
                    .filter(|(j, ((n, ..), _))| *j != i && n.starts_with("wanopt"))
                    .map(|(_, ((n, ..), w))| {
                        let worst = w
                            .iter()
                            .filter(|(s, d)| *s < at + took && *s + *d > at)
                            .map(|(_, d)| d.as_secs_f64() * 1e3)
                            .fold(0.0, f64::max);
                        format!("{n} {worst:.0}")
                    })
                    .collect();
                eprintln!(
                    "slow: {name} at {:.3} s took {:.1} ms; wansim from 50 ms before: {}; worst overlapping elsewhere (ms): {}",
                    at.as_secs_f64(),
                    took.as_secs_f64() * 1e3,
                    wan_between(
                        &samples,
                        at.saturating_sub(Duration::from_millis(50)),
                        at + took
                    ),
                    others.join(", ")
                );
                // What the pair's daemons said of their copies meanwhile (debug lines: every
                // copy of a write impaired, with each connection's TCP state).
                let (from, to) = (
                    wall_from + at.as_secs_f64() - 0.05,
                    wall_from + (at + took).as_secs_f64(),
                );
                for d in pair_of[i].into_iter().flat_map(|p| [&p.west, &p.east]) {
                    for line in d.log() {
                        if line.contains("every copy of a latency lane write is impaired")
                            && log_second(&line).is_some_and(|t| (from..=to).contains(&t))
                        {
                            eprintln!("  {}: {line}", d.name);
                        }
                    }
                }
            }
        }
        let results: Vec<Vec<Duration>> = timed
            .into_iter()
            .map(|v| {
                let mut d: Vec<Duration> = v.into_iter().map(|(_, d)| d).collect();
                d.sort();
                d
            })
            .collect();
        if bulk {
            let bytes = written.load(Ordering::Relaxed) - bulk_from;
            report::note(format!(
                "The bulk stream took {:.1} Mbit/s of the link while the round trips ran.",
                bytes as f64 * 8.0 / t_from.elapsed().as_secs_f64() / 1e6
            ));
        }
        stop.store(true, Ordering::Relaxed);
        drop(writer);
        let title = if bulk {
            "While a bulk stream through the pair fills the link (ms)"
        } else {
            "Idle link (ms)"
        };
        let header = [
            "path",
            "rounds",
            "p50",
            "p99",
            "p99.9",
            "max",
            "p99/RTT",
            "p99.9/RTT",
            "over 1.2 RTT",
            "over 1.5 RTT",
        ];
        charts.push(Chart::Percentiles(Percentiles {
            title: format!(
                "{preset}, {}: 8 KiB round trips",
                if bulk {
                    "bulk stream through the pair"
                } else {
                    "idle link"
                }
            ),
            series: paths
                .iter()
                .zip(&results)
                .map(|((name, ..), v)| {
                    let ms: Vec<f64> = v.iter().map(|d| d.as_secs_f64() * 1e3).collect();
                    (name.clone(), cdf_of_sorted(&ms))
                })
                .collect(),
            rtt_ms: Some(rtt_ms),
        }));
        for ((name, ..), v) in paths.iter().zip(&results) {
            let q = |p| format!("{:.1}", ms(v, p));
            report::row(
                title,
                &header,
                vec![
                    name.clone(),
                    v.len().to_string(),
                    q(0.5),
                    q(0.99),
                    q(0.999),
                    q(1.0),
                    format!("{:.2}", ms(v, 0.99) / rtt_ms),
                    format!("{:.2}", ms(v, 0.999) / rtt_ms),
                    over(v, 1.2 * rtt_ms).to_string(),
                    over(v, 1.5 * rtt_ms).to_string(),
                ],
            );
        }
    }
    let (a, b) = wan.counters();
    report::note(format!("wansim west→east: {a}; east→west: {b}."));
    let svg = args.get("--svg", format!("benches/charts/sync-tail-{preset}.svg"));
    let _ = std::fs::create_dir_all(
        std::path::Path::new(&svg)
            .parent()
            .unwrap_or(std::path::Path::new(".")),
    );
    std::fs::write(&svg, render(&charts).expect("chart")).expect("write chart");
    report::note(format!("Chart: `{svg}`."));
    // What each pair's copies cost, from its daemons' metrics: the lane's bytes each side took
    // (by whichever copy or datagram brought them first) against what its peer sent again.
    for ((name, ..), pair) in paths.iter().zip(&pair_of) {
        let Some(p) = pair else { continue };
        let scrape = |d: &common::Daemon, site: Site| {
            let admin = d.bound("admin");
            let s = wan
                .in_site(site, move || TcpStream::connect(admin))
                .expect("site")
                .expect("admin");
            common::scrape_on(s)
        };
        let (w, e) = (scrape(&p.west, Site::West), scrape(&p.east, Site::East));
        let took = |m: &str| {
            let won = |c: &str| {
                common::value(
                    m,
                    &format!("wanopt_link_copy_won_bytes_total{{copy=\"{c}\"}} "),
                )
            };
            let by: Vec<u64> = ["1", "2", "3", "4", "5", "datagrams"]
                .iter()
                .map(|c| won(c))
                .collect();
            (by.iter().sum::<u64>(), by)
        };
        let again = |m: &str| {
            (
                common::value(m, "wanopt_link_copy_duplicated_bytes_total "),
                common::value(m, "wanopt_link_lane_datagram_bytes_total "),
            )
        };
        for (from, to, sent, took) in [
            ("west", "east", again(&w), took(&e)),
            ("east", "west", again(&e), took(&w)),
        ] {
            let (total, by) = took;
            let x = |b: u64| b as f64 / total.max(1) as f64;
            report::note(format!(
                "{name}, {from} to {to}: {total} lane bytes; sent again on copies {:.2}x, as datagrams {:.2}x; first by copy 1-5 {:?}, by datagram {}.",
                x(sent.0),
                x(sent.1),
                &by[..5],
                by[5]
            ));
        }
    }
    for d in [&with_copies.west, &with_copies.east] {
        let lost = d.count("a latency lane connection was lost");
        if lost > 0 {
            report::note(format!(
                "{}: {lost} copy connections lost and replaced.",
                d.name
            ));
        }
    }
    report::finish("sync_tail", "sync_tail: SYNC round trips on a lossy WAN");
}

/// A `link.lane_rto_min` value from the command line: `off`, or milliseconds.
fn rto_setting(v: &str) -> String {
    if v == "off" {
        return v.to_string();
    }
    let ms: u64 = v.parse().expect("a lane RTO floor in ms, or off");
    format!("{ms}ms")
}

/// Seconds since midnight UTC of `t`.
fn second_of_day(t: std::time::SystemTime) -> f64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() % 86_400.0)
}

/// Seconds since midnight UTC of a daemon log line's timestamp (`2026-11-27T19:46:09.123456Z`).
fn log_second(line: &str) -> Option<f64> {
    let clock = line.split_whitespace().next()?.split_once('T')?.1;
    let mut parts = clock.trim_end_matches('Z').split(':');
    let h: f64 = parts.next()?.parse().ok()?;
    let m: f64 = parts.next()?.parse().ok()?;
    let s: f64 = parts.next()?.parse().ok()?;
    Some(h * 3600.0 + m * 60.0 + s)
}
