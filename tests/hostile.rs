//! Attacks on a running daemon: floods from anyone and a peer that misbehaves. For each, the
//! daemon's memory stays under a bound stated from its config, an honest stream through it at the
//! same time arrives byte-exact, and the daemon keeps running.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::*;

const MIB: u64 = 1 << 20;

/// Peak and current resident memory of a process, from `/proc/PID/status` (bytes).
fn rss(pid: u32) -> (u64, u64) {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kb = |key: &str| {
        s.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    (kb("VmHWM:"), kb("VmRSS:"))
}

/// Raises this process's open-file limit to its hard limit (the daemons inherit it), returning it.
fn raise_nofile() -> u64 {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut r);
        r.rlim_cur = r.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &r);
    }
    r.rlim_cur
}

/// A TCP connection to `to` from source address `from` (any loopback address works on Linux).
fn connect_from(from: IpAddr, to: SocketAddr) -> std::io::Result<TcpStream> {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    s.bind(&SocketAddr::new(from, 0).into())?;
    s.connect_timeout(&to.into(), Duration::from_secs(2))?;
    Ok(s.into())
}

/// Thousands of idle connections and a churn of garbage ones on the link port: the pending ones
/// are bounded, the real peer still reconnects through them, and a stream still arrives exact.
#[test]
fn an_unauthenticated_flood_cannot_lock_the_peer_out() {
    let nofile = raise_nofile();
    let idle = (nofile.saturating_sub(512) as usize).min(4000);
    assert!(
        idle >= 500,
        "open-file limit {nofile} too low for the flood"
    );
    let srv = hash_server();
    let certs = Certs::new(&["west", "east"]);
    let admin = "admin:\n  listen: 127.0.0.1:0\n";
    let east = Daemon::start(
        "east",
        &site_yaml(
            "east",
            "west",
            "listen: 127.0.0.1:0",
            &certs,
            &format!("  - name: h\n    target: {srv}\n"),
            admin,
        ),
    );
    let link = east.bound("link");
    let relay = Relay::new(link);
    let west = Daemon::start(
        "west",
        &site_yaml(
            "west",
            "east",
            &format!("connect: {}", relay.addr),
            &certs,
            "  - name: h\n    listen: 127.0.0.1:0\n",
            "",
        ),
    );
    west.wait_log("link up", Duration::from_secs(10));
    let svc = west.bound("h");
    let (_, before) = rss(east.pid());
    let started = Instant::now();

    // Idle connections from a hundred source addresses, none of them the relay's 127.0.0.1.
    let mut held = Vec::new();
    for i in 0..idle {
        let from = IpAddr::V4(Ipv4Addr::new(127, 0, 1, (i % 100) as u8 + 2));
        if let Ok(s) = connect_from(from, link) {
            held.push(s);
        }
    }
    // And a churn of connections that send garbage and leave, from one more address.
    let stop = Arc::new(AtomicBool::new(false));
    let churned = Arc::new(AtomicU64::new(0));
    let churn = {
        let (stop, churned) = (stop.clone(), churned.clone());
        std::thread::spawn(move || {
            use std::io::Write;
            while !stop.load(Ordering::Relaxed) {
                if let Ok(mut s) = connect_from(IpAddr::V4(Ipv4Addr::new(127, 0, 2, 1)), link) {
                    let _ = s.write_all(b"\x16\x03\x01\x00\x05hello, this is not TLS");
                    churned.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
    };

    // The real peer loses its link and must come back through the flood.
    relay.cut();
    west.wait_log_n("link up", 2, Duration::from_secs(20));
    let t = Instant::now();
    hash_client(svc, 1, 16 * MIB, 16 * MIB).expect("an honest stream during the flood");
    let honest = t.elapsed();
    stop.store(true, Ordering::Relaxed);
    let _ = churn.join();

    let metrics = scrape(east.bound("admin"));
    let evicted = value(&metrics, "wanopt_link_handshakes_evicted_total ");
    let (peak, now) = rss(east.pid());
    println!(
        "flood: {} idle + {} churned connections; east RSS {} MiB before, peak {} MiB, now {} MiB; \
         {evicted} evicted; honest 16+16 MiB stream {honest:?}",
        held.len(),
        churned.load(Ordering::Relaxed),
        before / MIB,
        peak / MIB,
        now / MIB,
    );
    // Bound: no cache memory is configured (optimize is off), so 128 MiB in all.
    assert!(peak < 128 * MIB, "east peak RSS {} MiB", peak / MIB);
    assert!(evicted >= held.len() as u64 - 64, "{evicted} evicted");
    // At most 10 lines per 10 s of failures before authentication.
    let budget = 10 * (started.elapsed().as_secs() as usize / 10 + 2);
    let lines = east.count("rejected link");
    assert!(
        lines <= budget,
        "{lines} log lines of rejected links, budget {budget}"
    );
    drop(held);
}
