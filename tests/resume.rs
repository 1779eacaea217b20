//! Streams through a lost link connection, end to end through the daemons: a bulk transfer and
//! a SYNC-style round-trip loop go on byte-exact when the link's connections are killed (a
//! relay cut, both lanes, the codec on and off); past `link.resume_window` they fail with an
//! error and new connections work once the link is back.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::*;

const SEC: Duration = Duration::from_secs(1);
const MIB: u64 = 1 << 20;

/// A bulk target: reads the client's bytes to EOF counting them in `progress`, answers their
/// hash and `reply` bytes of pattern `seed ^ 0xABCD` (the protocol of [`hash_client`]).
fn counting_server(progress: Arc<AtomicU64>) -> SocketAddr {
    server(move |mut s| {
        let mut hdr = [0u8; 16];
        if s.read_exact(&mut hdr).is_err() {
            return;
        }
        let seed = u64::from_le_bytes(hdr[..8].try_into().expect("8"));
        let reply = u64::from_le_bytes(hdr[8..].try_into().expect("8"));
        let mut h = blake3::Hasher::new();
        let mut buf = vec![0u8; 256 * 1024];
        loop {
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    h.update(&buf[..n]);
                    progress.fetch_add(n as u64, Ordering::Relaxed);
                }
                Err(_) => return,
            }
        }
        if s.write_all(h.finalize().as_bytes()).is_err() {
            return;
        }
        let _ = send_pattern(&mut s, seed ^ 0xABCD, reply);
        let _ = s.shutdown(std::net::Shutdown::Write);
    })
}

/// An echo target for the SYNC-style loop.
fn echo_server() -> SocketAddr {
    server(|mut s| {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if s.write_all(&buf[..n]).is_err() {
                        return;
                    }
                }
            }
        }
    })
}

/// Round trips of 8 KiB messages on one connection until `stop`, counted in `done`; each
/// answer is checked. Returns the rounds done and the slowest one.
fn sync_loop(
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
) -> Result<(u64, Duration), String> {
    let mut c = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    c.set_nodelay(true).ok();
    c.set_read_timeout(Some(60 * SEC)).ok();
    let (mut msg, mut back) = (vec![0u8; 8192], vec![0u8; 8192]);
    let (mut rounds, mut slowest) = (0u64, Duration::ZERO);
    while !stop.load(Ordering::Relaxed) {
        fill(rounds, 0, &mut msg);
        let t = Instant::now();
        c.write_all(&msg)
            .map_err(|e| format!("round {rounds}: write: {e}"))?;
        c.read_exact(&mut back)
            .map_err(|e| format!("round {rounds}: read: {e}"))?;
        slowest = slowest.max(t.elapsed());
        if back != msg {
            return Err(format!("round {rounds}: the answer differs"));
        }
        rounds += 1;
        done.store(rounds, Ordering::Relaxed);
    }
    Ok((rounds, slowest))
}

/// East (targets `bulk` and `sync`, admin on) and west (their listeners) with the link through
/// a relay; `extra` is top-level YAML for both, `link` lines for both `link:` sections.
fn relayed(bulk: SocketAddr, sync: SocketAddr, extra: &str, link: &str) -> RelayedPair {
    let certs = Certs::new(&["west", "east"]);
    let extra = format!("admin:\n  listen: 127.0.0.1:0\n{extra}");
    let east = Daemon::start(
        "east",
        &site_yaml(
            "east",
            "west",
            &format!("listen: 127.0.0.1:0\n{link}"),
            &certs,
            &format!(
                "  - name: bulk\n    target: {bulk}\n  - name: sync\n    target: {sync}\n    class: latency\n"
            ),
            &extra,
        ),
    );
    let relay = Relay::new(east.bound("link"));
    let west = Daemon::start(
        "west",
        &site_yaml(
            "west",
            "east",
            &format!("connect: {}\n{link}", relay.addr),
            &certs,
            "  - name: bulk\n    listen: 127.0.0.1:0\n  - name: sync\n    listen: 127.0.0.1:0\n    class: latency\n",
            &extra,
        ),
    );
    west.wait_log("latency lane attached", 10 * SEC);
    east.wait_log("latency lane attached", 10 * SEC);
    RelayedPair {
        certs,
        east,
        relay,
        west,
    }
}

fn wait_until(limit: Duration, what: &str, f: impl Fn() -> bool) {
    let end = Instant::now() + limit;
    while !f() {
        assert!(Instant::now() < end, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The bulk transfer and the SYNC loop, with the link's connections killed three times while
/// both run (twice both lanes, once the latency lane alone).
fn rides_through_kills(extra: &str) {
    let progress = Arc::new(AtomicU64::new(0));
    let p = relayed(counting_server(progress.clone()), echo_server(), extra, "");
    let (bulk, sync) = (p.west.bound("bulk"), p.west.bound("sync"));
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicU64::new(0));
    let looping = {
        let (stop, rounds) = (stop.clone(), rounds.clone());
        std::thread::spawn(move || sync_loop(sync, stop, rounds))
    };
    let up = 192 * MIB;
    let transfer = std::thread::spawn(move || hash_client(bulk, 11, up, 32 * MIB));
    for (i, at) in [24 * MIB, 72 * MIB, 120 * MIB].into_iter().enumerate() {
        // Both go on after each kill: the bulk transfer moves and the loop gets answers.
        let before = rounds.load(Ordering::Relaxed);
        wait_until(60 * SEC, "bulk progress", || {
            progress.load(Ordering::Relaxed) >= at
        });
        wait_until(60 * SEC, "round trips", || {
            rounds.load(Ordering::Relaxed) >= before + 2
        });
        if i == 1 {
            // Only the latency lane (the second connection through the relay so far).
            p.relay.cut_one(1);
        } else {
            p.relay.cut();
        }
        p.west
            .wait_log_n("resuming the link on a new connection", i + 1, 20 * SEC);
    }
    transfer
        .join()
        .expect("bulk client")
        .expect("the bulk transfer is byte-exact through three kills");
    stop.store(true, Ordering::Relaxed);
    let (rounds, slowest) = looping
        .join()
        .expect("sync client")
        .expect("every round trip answered exactly");
    println!("{rounds} round trips through three kills, the slowest {slowest:?}");
    let w = scrape(p.west.bound("admin"));
    let e = scrape(p.east.bound("admin"));
    assert!(value(&w, "wanopt_link_outages_total ") >= 3, "{w}");
    assert!(value(&w, "wanopt_link_streams_resumed_total ") >= 3, "{w}");
    assert_eq!(value(&w, "wanopt_link_streams_lost_total "), 0, "{w}");
    assert_eq!(value(&e, "wanopt_link_streams_lost_total "), 0, "{e}");
    assert!(p.east.count("the peer resumes the link") >= 3);
    for d in [&p.west, &p.east] {
        assert_eq!(d.count("stream failed"), 0, "{}", d.log().join("\n"));
    }
}

#[test]
fn streams_ride_through_killed_link_connections() {
    rides_through_kills("");
}

#[test]
fn streams_ride_through_killed_link_connections_without_the_codec() {
    rides_through_kills("optimize:\n  enabled: false\n");
}

/// Down longer than the window: the streams fail with an error (never a clean, short end),
/// and new streams work once the link is back.
#[test]
fn past_the_resume_window_streams_fail_and_new_ones_work() {
    let progress = Arc::new(AtomicU64::new(0));
    let p = relayed(
        counting_server(progress.clone()),
        echo_server(),
        "",
        "  resume_window: 1s\n",
    );
    let bulk = p.west.bound("bulk");
    let transfer = std::thread::spawn(move || hash_client(bulk, 12, 1 << 40, 0));
    wait_until(60 * SEC, "bulk progress", || {
        progress.load(Ordering::Relaxed) >= 8 * MIB
    });
    p.relay.refuse(true);
    p.relay.cut();
    let r = transfer.join().expect("bulk client");
    assert!(r.is_err(), "the stream must fail past the window: {r:?}");
    p.west
        .wait_log("link down: its streams are reset", 10 * SEC);
    p.relay.refuse(false);
    p.west.wait_log_n("link up", 2, 20 * SEC);
    hash_client(bulk, 13, 4 * MIB, MIB).expect("a new stream once the link is back");
    let w = scrape(p.west.bound("admin"));
    assert!(value(&w, "wanopt_link_streams_lost_total ") >= 1, "{w}");
}
