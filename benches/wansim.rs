//! wansim benchmark: (1) a 135 Mbit/s, 100 ms RTT link filled by one TCP stream, reporting goodput
//! and the per-packet timing error; (2) the highest rate wansim forwards with no rate, delay or loss
//! set, and the CPU its forwarding threads take.
//!
//! Run (as root): `cargo bench --bench wansim` (`-- --seconds N` per measurement, default 8).

#[path = "../tests/common/args.rs"]
mod args;
#[path = "../tests/common/report.rs"]
mod report;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use wansim::{DirParams, LinkParams, Site, Wan};

/// CPU seconds used so far by this process's threads whose name starts with `prefix`.
fn thread_cpu(prefix: &str) -> f64 {
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let mut total = 0.0;
    for t in std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
    {
        let p = t.path();
        let comm = std::fs::read_to_string(p.join("comm")).unwrap_or_default();
        if !comm.starts_with(prefix) {
            continue;
        }
        let stat = std::fs::read_to_string(p.join("stat")).unwrap_or_default();
        let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
        let f: Vec<f64> = rest
            .split_whitespace()
            .filter_map(|v| v.parse().ok())
            .collect();
        // After the state field (not numeric), utime and stime are the 11th and 12th numbers.
        if f.len() > 12 {
            total += (f[10] + f[11]) / hz;
        }
    }
    total
}

/// One TCP stream west→east for `secs`; returns goodput in bits per second.
fn tcp_goodput(wan: &Wan, port: u16, secs: u64) -> f64 {
    let l = wan
        .in_site(Site::East, move || {
            TcpListener::bind((Site::East.addr(), port))
        })
        .expect("east")
        .expect("listen");
    let server = std::thread::spawn(move || {
        let (mut s, _) = l.accept().expect("accept");
        let mut buf = vec![0u8; 1 << 20];
        let mut n = 0u64;
        let mut started = None;
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(k) => {
                    started.get_or_insert_with(Instant::now);
                    n += k as u64;
                }
            }
        }
        (n, started.map(|t| t.elapsed()))
    });
    let mut c = wan
        .in_site(Site::West, move || {
            TcpStream::connect((Site::East.addr(), port))
        })
        .expect("west")
        .expect("connect");
    let buf = vec![0x42u8; 1 << 20];
    let end = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < end {
        if c.write_all(&buf).is_err() {
            break;
        }
    }
    let _ = c.shutdown(std::net::Shutdown::Write);
    let (n, d) = server.join().expect("server");
    n as f64 * 8.0 / d.map_or(1.0, |d| d.as_secs_f64())
}

fn main() {
    if !wansim::available_or_skip("wansim bench") {
        return;
    }
    let secs: u64 = args::Args::new().get("--seconds", 8);
    report::note(format!("Each measurement runs {secs} s."));

    let oc3 = LinkParams::symmetric(DirParams {
        rate_bps: Some(135_000_000),
        delay: Duration::from_millis(50),
        ..DirParams::default()
    });
    let wan = Wan::start(&format!("wb{}", std::process::id() % 100_000), oc3).expect("start");
    let g = tcp_goodput(&wan, 5201, secs);
    let (a, b) = wan.stop();
    let t = "A 135 Mbit/s, 100 ms RTT link filled by one TCP stream";
    let h = [
        "direction",
        "goodput (Mbit/s)",
        "of the line rate",
        "timing error mean (µs)",
        "max (µs)",
        "packets over 1 ms late",
    ];
    for (dir, d, goodput) in [("west→east", &a, Some(g)), ("east→west", &b, None)] {
        report::row(
            t,
            &h,
            vec![
                dir.into(),
                goodput.map_or("(acks)".into(), |g| format!("{:.1}", g / 1e6)),
                goodput.map_or("".into(), |g| format!("{:.1}%", g / 135e6 * 100.0)),
                (d.late_mean_ns / 1000).to_string(),
                (d.late_max_ns / 1000).to_string(),
                format!("{} of {}", d.late_over_1ms, d.packets_out),
            ],
        );
    }

    let wan = Wan::start(
        &format!("wc{}", std::process::id() % 100_000),
        LinkParams::symmetric(DirParams::default()),
    )
    .expect("start");
    let cpu0 = thread_cpu("wansim-");
    let t0 = Instant::now();
    let g = tcp_goodput(&wan, 5202, secs);
    let cpu = (thread_cpu("wansim-") - cpu0) / t0.elapsed().as_secs_f64();
    let (a, _) = wan.stop();
    report::row(
        "Unlimited (no rate, delay or loss), one TCP stream",
        &[
            "goodput (Mbit/s)",
            "kpackets/s forwarded west→east",
            "forwarding threads' CPU (% of a core)",
        ],
        vec![
            format!("{:.0}", g / 1e6),
            format!(
                "{:.0}",
                a.packets_out as f64 / t0.elapsed().as_secs_f64() / 1e3
            ),
            format!("{:.0}", cpu * 100.0),
        ],
    );
    report::finish("wansim", "wansim: timing and forwarding");
}
