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

/// A bulk target on loopback (see [`counting_handler`]).
fn counting_server(progress: Arc<AtomicU64>) -> SocketAddr {
    server(move |s| counting_handler(s, &progress))
}

/// An echo target on loopback for the SYNC-style loop.
fn echo_server() -> SocketAddr {
    server(echo_handler)
}

/// Round trips of 8 KiB messages on one connection until `stop`, counted in `done`; each
/// answer is checked. Returns the rounds done and the slowest one.
fn sync_loop(
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
) -> Result<(u64, Duration), String> {
    let c = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    sync_loop_on(c, stop, done, Arc::default())
}

/// [`sync_loop`] on a connection already made; `slowest` holds the slowest round (in
/// microseconds) since the caller last reset it.
fn sync_loop_on(
    mut c: TcpStream,
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
    slowest_us: Arc<AtomicU64>,
) -> Result<(u64, Duration), String> {
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
        slowest_us.fetch_max(t.elapsed().as_micros() as u64, Ordering::Relaxed);
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
    relayed_each(bulk, sync, |_| extra.to_string(), link)
}

/// [`relayed`] with each side's top-level YAML from `extra(site)`.
fn relayed_each(
    bulk: SocketAddr,
    sync: SocketAddr,
    extra: impl Fn(&str) -> String,
    link: &str,
) -> RelayedPair {
    let certs = Certs::new(&["west", "east"]);
    let side = |site: &str| format!("admin:\n  listen: 127.0.0.1:0\n{}", extra(site));
    let east = Daemon::start(
        "east",
        &site_yaml(
            "east",
            "west",
            &format!("listen: 127.0.0.1:0\n{link}"),
            &certs,
            &format!(
                "  - name: bulk\n    target: {bulk}\n  - name: sync\n    target: {sync}\n    class: latency\n    redundancy: off\n"
            ),
            &side("east"),
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
            // One connection for the lane, so the relay's second connection is the lane's.
            "  - name: bulk\n    listen: 127.0.0.1:0\n  - name: sync\n    listen: 127.0.0.1:0\n    class: latency\n    redundancy: off\n",
            &side("west"),
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

/// What each side logs when its link goes on on a new main connection.
const RESUMED: &str = "link resumed: its streams go on";

/// How many times west and east resumed the link on a new main connection.
fn resumptions(p: &RelayedPair) -> (usize, usize) {
    (p.west.count(RESUMED), p.east.count(RESUMED))
}

/// Whether `d` logged a latency lane attached after it last resumed the link.
fn lane_after_resumption(d: &Daemon) -> bool {
    let log = d.log();
    let last = log.iter().rposition(|l| l.contains(RESUMED));
    last.is_some_and(|i| log[i..].iter().any(|l| l.contains("latency lane attached")))
}

/// The address east saw the current latency lane come from (the relay's upstream side).
fn east_lane(p: &RelayedPair) -> SocketAddr {
    let line = p
        .east
        .log()
        .into_iter()
        .rfind(|l| l.contains("latency lane attached"))
        .expect("a lane attached");
    line.split_whitespace()
        .find_map(|t| t.strip_prefix("from="))
        .and_then(|a| a.parse().ok())
        .expect("from= in the lane's line")
}

/// The bulk transfer and the SYNC loop, with the link's connections killed three times while
/// both run: twice both lanes (the link resumes on new connections), once the latency lane
/// alone (a new lane is attached and its streams resume; the main connection goes on).
fn rides_through_kills(extra: impl Fn(&str) -> String) {
    let progress = Arc::new(AtomicU64::new(0));
    let p = relayed_each(counting_server(progress.clone()), echo_server(), extra, "");
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
            // Only the latency lane, found by the port east saw it come from: it alone is
            // attached again, the main connection goes on.
            let lost = p
                .west
                .count("latency lane lost; its streams wait for a new one");
            let (attached, resumed) = (p.west.count("latency lane attached"), resumptions(&p));
            let lane = east_lane(&p);
            assert!(p.relay.cut_from(lane), "no relayed connection from {lane}");
            p.west.wait_log_n(
                "latency lane lost; its streams wait for a new one",
                lost + 1,
                20 * SEC,
            );
            p.west
                .wait_log_n("latency lane attached", attached + 1, 20 * SEC);
            assert_eq!(resumptions(&p), resumed, "the main connection went on");
        } else {
            // Both lanes: each side resumes the link on a new connection, then a lane is
            // attached after it (a lane lost first may be attached again before the main
            // connection's end is seen; that one does not count).
            let resumed = resumptions(&p);
            p.relay.cut();
            p.west.wait_log_n(RESUMED, resumed.0 + 1, 20 * SEC);
            p.east.wait_log_n(RESUMED, resumed.1 + 1, 20 * SEC);
            for d in [&p.west, &p.east] {
                wait_until(20 * SEC, "a lane attached after the link resumed", || {
                    lane_after_resumption(d)
                });
            }
        }
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
    // Both daemons of this build: the link resumed by sending again what was in flight, its
    // caches and contexts kept.
    for m in [&w, &e] {
        assert!(value(m, "wanopt_link_replays_total ") >= 2, "{m}");
    }
    println!(
        "replayed: west {} bytes, east {} bytes",
        value(&w, "wanopt_link_replayed_bytes_total "),
        value(&e, "wanopt_link_replayed_bytes_total ")
    );
    // Which connection's end each side sees first decides whether a whole cut starts as a
    // lane loss; the main connection's end always follows.
    assert!(p.east.count("the peer resumes the link") >= 1);
    assert!(p.west.count("resuming the link on a new connection") >= 1);
    assert!(
        p.west
            .count("latency lane lost; its streams wait for a new one")
            >= 1
    );
    for d in [&p.west, &p.east] {
        assert_eq!(d.count("stream failed"), 0, "{}", d.log().join("\n"));
    }
}

#[test]
fn streams_ride_through_killed_link_connections() {
    rides_through_kills(|_| String::new());
}

/// With a disk tier and checkpoints every second: each new connection resumes the caches from
/// the newest state both sides saved, and nothing is lost.
#[test]
fn streams_ride_through_killed_link_connections_with_a_disk_tier() {
    let dirs = [
        tempfile::tempdir().expect("dir"),
        tempfile::tempdir().expect("dir"),
    ];
    let paths: Vec<String> = dirs
        .iter()
        .map(|d| d.path().display().to_string())
        .collect();
    rides_through_kills(move |site| {
        let dir = if site == "west" { &paths[0] } else { &paths[1] };
        format!(
            "state_dir: {dir}\noptimize:\n  memory: 32MiB\n  disk:\n    bytes: 512MiB\n    checkpoint: 1s\n"
        )
    });
}

#[test]
fn streams_ride_through_killed_link_connections_without_the_codec() {
    rides_through_kills(|_| "optimize:\n  enabled: false\n".to_string());
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

/// A pair across wansim (`t3-100ms-0.5`) with a counting bulk target and an echo target in the
/// east namespace; `extra` is top-level YAML and `link` lines of the `link:` section, both
/// sides.
struct WanRun {
    wan: wansim::Wan,
    pair: WanPair,
    progress: Arc<AtomicU64>,
}

fn wan_run(tag: &str, extra: &str, link: &str) -> Option<WanRun> {
    if !wansim::available_or_skip("resumption across wansim") {
        return None;
    }
    let wan = wansim::Wan::start(
        &format!("{tag}{}", std::process::id() % 100_000),
        wansim::preset("t3-100ms-0.5").expect("preset"),
    )
    .expect("wansim");
    let east_ip = wansim::Site::East.addr();
    let progress = Arc::new(AtomicU64::new(0));
    let (lb, le) = wan
        .in_site(wansim::Site::East, move || {
            (
                std::net::TcpListener::bind((east_ip, 9300)),
                std::net::TcpListener::bind((east_ip, 9301)),
            )
        })
        .expect("east");
    let p2 = progress.clone();
    let bulk = serve_on(lb.expect("bind bulk"), move |s| counting_handler(s, &p2));
    let sync = serve_on(le.expect("bind echo"), echo_handler);
    let extra = extra.to_string();
    let link = format!("  bandwidth: 45mbit\n  rtt: 100ms\n{link}");
    let pair = wan_pair(
        &wan,
        &format!(
            "  - name: bulk\n    target: {bulk}\n  - name: sync\n    target: {sync}\n    class: latency\n"
        ),
        "  - name: bulk\n    listen: 127.0.0.1:0\n  - name: sync\n    listen: 127.0.0.1:0\n    class: latency\n",
        move |_, y| {
            let y = format!("{y}admin:\n  listen: 127.0.0.1:0\n{extra}");
            link_lines(y, &link)
        },
    );
    pair.west.wait_log("latency lane attached", 20 * SEC);
    Some(WanRun {
        wan,
        pair,
        progress,
    })
}

impl WanRun {
    fn connect(&self, service: &str) -> TcpStream {
        let addr = self.pair.west.bound(service);
        self.wan
            .in_site(wansim::Site::West, move || TcpStream::connect(addr))
            .expect("west")
            .expect("connect")
    }

    fn metrics(&self, who: &Daemon) -> String {
        let addr = who.bound("admin");
        let site = if who.name == "west" {
            wansim::Site::West
        } else {
            wansim::Site::East
        };
        scrape_on(
            self.wan
                .in_site(site, move || TcpStream::connect(addr))
                .expect("ns")
                .expect("connect admin"),
        )
    }

    /// Kills the link's TCP connections in west's namespace, as a middlebox's RST would.
    fn kill_link_connections(&self) {
        let east = wansim::Site::East.addr();
        let out = self
            .wan
            .command(wansim::Site::West, "ss")
            .args(["-K", "dst", &east.to_string(), "dport", "=", ":7400"])
            .output()
            .expect("ss");
        assert!(out.status.success(), "ss -K: {out:?}");
    }
}

/// A bulk target: reads the client's bytes to EOF counting them in `progress`, answers their
/// hash and `reply` bytes of pattern `seed ^ 0xABCD` (the protocol of [`hash_client`]).
fn counting_handler(mut s: TcpStream, progress: &AtomicU64) {
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
}

/// Echoes every byte back until the client closes.
fn echo_handler(mut s: TcpStream) {
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
}

/// What one outage cost, as the clients saw it.
struct Outage {
    /// From the path's return to the bulk target's next bytes (`None` for a kill).
    moving_again: Option<Duration>,
    /// The slowest SYNC round trip during the outage.
    slowest_round: Duration,
}

/// Runs a bulk transfer and a SYNC loop across `r`, applies each outage in turn once the bulk
/// transfer moved some more, and checks both end byte-exact.
fn outages(r: &WanRun, seed: u64, events: &[Option<Duration>]) -> Vec<Outage> {
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicU64::new(0));
    let slowest = Arc::new(AtomicU64::new(0));
    let looping = {
        let (c, stop, rounds, slowest) = (
            r.connect("sync"),
            stop.clone(),
            rounds.clone(),
            slowest.clone(),
        );
        std::thread::spawn(move || sync_loop_on(c, stop, rounds, slowest))
    };
    let up = 24 * MIB * events.len() as u64;
    let transfer = {
        let c = r.connect("bulk");
        std::thread::spawn(move || hash_client_on(c, seed, up, MIB))
    };
    let start = r.progress.load(Ordering::Relaxed);
    let mut out = Vec::new();
    for (i, ev) in events.iter().enumerate() {
        let at = start + 4 * MIB + 24 * MIB * i as u64;
        wait_until(120 * SEC, "bulk progress", || {
            r.progress.load(Ordering::Relaxed) >= at
        });
        let before = rounds.load(Ordering::Relaxed);
        wait_until(60 * SEC, "round trips", || {
            rounds.load(Ordering::Relaxed) >= before + 2
        });
        slowest.store(0, Ordering::Relaxed);
        let moving_again = match ev {
            Some(cut) => {
                r.wan.set_cut(true);
                std::thread::sleep(*cut);
                let p0 = r.progress.load(Ordering::Relaxed);
                r.wan.set_cut(false);
                let back = Instant::now();
                wait_until(60 * SEC, "bulk moving after the cut", || {
                    r.progress.load(Ordering::Relaxed) > p0
                });
                Some(back.elapsed())
            }
            None => {
                r.kill_link_connections();
                None
            }
        };
        let before = rounds.load(Ordering::Relaxed);
        wait_until(60 * SEC, "round trips after the outage", || {
            rounds.load(Ordering::Relaxed) >= before + 5
        });
        out.push(Outage {
            moving_again,
            slowest_round: Duration::from_micros(slowest.load(Ordering::Relaxed)),
        });
    }
    transfer
        .join()
        .expect("bulk client")
        .expect("the bulk transfer is byte-exact through every outage");
    stop.store(true, Ordering::Relaxed);
    looping
        .join()
        .expect("sync client")
        .expect("every round trip answered exactly");
    out
}

fn report(what: &str, o: &[Outage], names: &[&str]) {
    for (o, n) in o.iter().zip(names) {
        println!(
            "{what}, {n}: bulk moving again {} after the path came back; slowest SYNC round trip {:?}",
            o.moving_again.map_or("-".to_string(), |d| format!("{d:?}")),
            o.slowest_round
        );
    }
}

/// Across an emulated T3 with loss: a 3 s cut, a killed link connection (`ss -K`) and a 20 s
/// cut, with the codec on and both lanes in use; nothing is lost or reset.
#[test]
fn wan_cuts_and_a_killed_connection_lose_nothing() {
    let Some(r) = wan_run("wr", "", "") else {
        return;
    };
    let names = ["3 s cut", "ss -K", "20 s cut"];
    let o = outages(&r, 21, &[Some(3 * SEC), None, Some(20 * SEC)]);
    report("codec on", &o, &names);
    let w = r.metrics(&r.pair.west);
    assert!(value(&w, "wanopt_link_streams_resumed_total ") >= 2, "{w}");
    assert_eq!(value(&w, "wanopt_link_streams_lost_total "), 0, "{w}");
    for d in [&r.pair.west, &r.pair.east] {
        assert_eq!(d.count("stream failed"), 0, "{}", d.log().join("\n"));
    }
}

/// The same without the codec (a 3 s cut and a killed connection).
#[test]
fn wan_cuts_and_a_killed_connection_lose_nothing_without_the_codec() {
    let Some(r) = wan_run("wp", "optimize:\n  enabled: false\n", "") else {
        return;
    };
    let o = outages(&r, 22, &[Some(3 * SEC), None]);
    report("codec off", &o, &["3 s cut", "ss -K"]);
    for d in [&r.pair.west, &r.pair.east] {
        assert_eq!(d.count("stream failed"), 0, "{}", d.log().join("\n"));
    }
}

/// Down past `link.resume_window`: the streams fail with an error, and new ones work once the
/// path is back.
#[test]
fn wan_down_past_the_window_fails_cleanly() {
    let Some(r) = wan_run("wx", "", "  resume_window: 3s\n") else {
        return;
    };
    let transfer = {
        let c = r.connect("bulk");
        std::thread::spawn(move || hash_client_on(c, 23, 1 << 40, 0))
    };
    wait_until(60 * SEC, "bulk progress", || {
        r.progress.load(Ordering::Relaxed) >= 4 * MIB
    });
    r.wan.set_cut(true);
    r.pair
        .west
        .wait_log("link down: its streams are reset", 20 * SEC);
    r.wan.set_cut(false);
    let got = transfer.join().expect("bulk client");
    assert!(
        got.is_err(),
        "the stream must fail past the window: {got:?}"
    );
    r.pair.west.wait_log_n("link up", 2, 30 * SEC);
    hash_client_on(r.connect("bulk"), 24, 2 * MIB, MIB).expect("a new stream afterwards");
    let w = r.metrics(&r.pair.west);
    assert!(value(&w, "wanopt_link_streams_lost_total ") >= 1, "{w}");
}

/// The peer stops for 3 s (SIGSTOP) mid-transfer: its kernel keeps the connection up, ours
/// hears nothing, gives the connection up after 2 s and dials a new one, which the peer takes
/// when it runs again, whichever of the two connections it looks at first. Nothing is lost.
#[test]
fn a_peer_stopped_for_three_seconds_loses_nothing() {
    let progress = Arc::new(AtomicU64::new(0));
    let bulk_srv = counting_server(progress.clone());
    let p = Pair::start(
        &format!("  - name: bulk\n    target: {bulk_srv}\n"),
        "  - name: bulk\n    listen: 127.0.0.1:0\n",
    );
    let bulk = p.west.bound("bulk");
    let transfer = std::thread::spawn(move || hash_client(bulk, 31, 256 * MIB, 8 * MIB));
    wait_until(60 * SEC, "bulk progress", || {
        progress.load(Ordering::Relaxed) >= 16 * MIB
    });
    p.east.signal(libc::SIGSTOP);
    std::thread::sleep(3 * SEC);
    p.east.signal(libc::SIGCONT);
    transfer
        .join()
        .expect("bulk client")
        .expect("byte-exact through the stop");
    p.west.wait_log("nothing heard from the peer", 10 * SEC);
    p.west
        .wait_log("resuming the link on a new connection", 10 * SEC);
    for d in [&p.west, &p.east] {
        assert_eq!(d.count("stream failed"), 0, "{}", d.log().join("\n"));
    }
}
