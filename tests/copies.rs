//! Copies of the latency lane through the daemons: SYNC round trips byte-exact over a lossy WAN
//! with each write on two connections, one connection killed mid-run without a stall, the
//! `auto` policy dropping the copy while latency traffic crowds the link and taking it back,
//! a peer that takes no copies, and copies spaced in time across a WAN that loses packets in
//! bursts, beside a bulk load.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::*;

const SEC: Duration = Duration::from_secs(1);
const MIB: u64 = 1 << 20;

fn wait_until(limit: Duration, what: &str, f: impl Fn() -> bool) {
    let end = Instant::now() + limit;
    while !f() {
        assert!(Instant::now() < end, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Echoes every byte back until the client closes.
fn echo_handler(mut s: TcpStream) {
    let mut buf = vec![0u8; 64 * 1024];
    while let Ok(n) = s.read(&mut buf) {
        if n == 0 || s.write_all(&buf[..n]).is_err() {
            return;
        }
    }
}

/// 8 KiB round trips until `stop`, `pause` apart, each answer checked; returns each round
/// trip's time.
fn sync_loop(
    mut c: TcpStream,
    stop: Arc<AtomicBool>,
    rounds: Arc<AtomicU64>,
    pause: Duration,
) -> Result<Vec<Duration>, String> {
    c.set_nodelay(true).ok();
    c.set_read_timeout(Some(60 * SEC)).ok();
    let (mut msg, mut back) = (vec![0u8; 8192], vec![0u8; 8192]);
    let mut times = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let n = times.len() as u64;
        fill(n + 77, 0, &mut msg);
        let t = Instant::now();
        c.write_all(&msg)
            .map_err(|e| format!("round {n}: write: {e}"))?;
        c.read_exact(&mut back)
            .map_err(|e| format!("round {n}: read: {e}"))?;
        times.push(t.elapsed());
        if back != msg {
            return Err(format!("round {n}: the answer differs"));
        }
        rounds.store(n + 1, Ordering::Relaxed);
        std::thread::sleep(pause);
    }
    Ok(times)
}

fn percentile(times: &mut [Duration], p: f64) -> Duration {
    times.sort();
    let i = ((times.len() as f64 * p).ceil() as usize).clamp(1, times.len().max(1)) - 1;
    times.get(i).copied().unwrap_or_default()
}

/// Local ports of west's latency-lane connections (the ones on CUBIC; the main lane runs BBR),
/// from `ss` in west's namespace.
fn lane_ports(wan: &wansim::Wan) -> Vec<u16> {
    let east = wansim::Site::East.addr();
    let out = wan
        .command(wansim::Site::West, "ss")
        .args(["-tni", "dst", &east.to_string(), "dport", "=", ":7400"])
        .output()
        .expect("ss");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let lines: Vec<&str> = text.lines().collect();
    let mut ports = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        if !l.starts_with("ESTAB") {
            continue;
        }
        let local = l.split_whitespace().nth(3).unwrap_or("");
        let info = lines.get(i + 1).copied().unwrap_or("");
        if info.contains("cubic")
            && let Some(p) = local.rsplit(':').next().and_then(|p| p.parse().ok())
        {
            ports.push(p);
        }
    }
    ports
}

/// A pair across wansim `t3-100ms-1` (stating its link, admin on) with one latency service
/// `sync` whose target in east echoes; `extra` is added to the service on both sides. Also
/// starts the SYNC loop from west once a copy is attached: returns the WAN, the pair, the
/// loop's stop flag and round counter, and the loop's thread.
struct LossyRun {
    wan: wansim::Wan,
    pair: WanPair,
    stop: Arc<AtomicBool>,
    rounds: Arc<AtomicU64>,
    looping: std::thread::JoinHandle<Result<Vec<Duration>, String>>,
}

/// wansim's `preset` (its namespaces named after `tag` and this process) with the SYNC loop's
/// echo server on east's port 9301: the WAN, its parameters and the server's address.
fn echo_wan(preset: &str, tag: &str) -> (wansim::Wan, wansim::LinkParams, std::net::SocketAddr) {
    let params = wansim::preset(preset).expect("preset");
    let wan = wansim::Wan::start(
        &format!("{tag}{}", std::process::id() % 100_000),
        params.clone(),
    )
    .expect("wansim");
    let east_ip = wansim::Site::East.addr();
    let l = wan
        .in_site(wansim::Site::East, move || {
            std::net::TcpListener::bind((east_ip, 9301))
        })
        .expect("east")
        .expect("bind");
    let sync = serve_on(l, echo_handler);
    (wan, params, sync)
}

fn lossy_run(tag: &str, extra: &str) -> LossyRun {
    let (wan, params, sync) = echo_wan("t3-100ms-1", tag);
    let (link, _) = wanopt_replay::showcase::stated_link(&params);
    let pair = wan_pair(
        &wan,
        &format!("  - name: sync\n    target: {sync}\n    class: latency\n{extra}"),
        &format!("  - name: sync\n    listen: 127.0.0.1:0\n    class: latency\n{extra}"),
        move |_, y| link_lines(format!("{y}admin:\n  listen: 127.0.0.1:0\n"), &link),
    );
    pair.west.wait_log("latency lane copy attached", 20 * SEC);
    let addr = pair.west.bound("sync");
    let c = wan
        .in_site(wansim::Site::West, move || TcpStream::connect(addr))
        .expect("west")
        .expect("connect");
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicU64::new(0));
    let looping = {
        let (stop, rounds) = (stop.clone(), rounds.clone());
        std::thread::spawn(move || sync_loop(c, stop, rounds, Duration::ZERO))
    };
    LossyRun {
        wan,
        pair,
        stop,
        rounds,
        looping,
    }
}

/// Over an emulated T3 with 1% loss, SYNC round trips through a latency service with
/// `redundancy: 2` are byte-exact; one of its two connections is killed mid-run and the other
/// carries the lane with no stall (no lane loss), then a new copy is attached.
#[test]
fn sync_round_trips_ride_two_copies_over_a_lossy_wan() {
    if !wansim::available_or_skip("latency lane copies across wansim") {
        return;
    }
    let LossyRun {
        wan,
        pair,
        stop,
        rounds,
        looping,
    } = lossy_run("cp", "    redundancy: 2\n");
    let east_ip = wansim::Site::East.addr();
    pair.east.wait_log("latency lane copy attached", 20 * SEC);
    wait_until(60 * SEC, "round trips", || {
        rounds.load(Ordering::Relaxed) >= 40
    });
    let ports = lane_ports(&wan);
    assert_eq!(ports.len(), 2, "two lane connections: {ports:?}");
    let killed = wan
        .command(wansim::Site::West, "ss")
        .args([
            "-K",
            "dst",
            &east_ip.to_string(),
            "dport",
            "=",
            ":7400",
            "sport",
            "=",
            &format!(":{}", ports[0]),
        ])
        .output()
        .expect("ss -K");
    assert!(killed.status.success(), "{killed:?}");
    pair.west.wait_log(
        "a latency lane connection was lost; the others carry the lane",
        10 * SEC,
    );
    let before = rounds.load(Ordering::Relaxed);
    wait_until(60 * SEC, "round trips after the kill", || {
        rounds.load(Ordering::Relaxed) >= before + 40
    });
    pair.west
        .wait_log_n("latency lane copy attached", 2, 20 * SEC);
    stop.store(true, Ordering::Relaxed);
    let mut times = looping
        .join()
        .expect("sync client")
        .expect("every round trip answered exactly");
    let (p50, p99, max) = (
        percentile(&mut times, 0.5),
        percentile(&mut times, 0.99),
        times.last().copied().unwrap_or_default(),
    );
    println!(
        "{} round trips through two copies on t3-100ms-1: p50 {p50:?}, p99 {p99:?}, max {max:?}",
        times.len()
    );
    for d in [&pair.west, &pair.east] {
        assert_eq!(d.count("latency lane lost"), 0, "{}", d.log().join("\n"));
        assert_eq!(d.count("stream failed"), 0, "{}", d.log().join("\n"));
    }
    let admin = pair.west.bound("admin");
    let w = scrape_on(
        wan.in_site(wansim::Site::West, move || TcpStream::connect(admin))
            .expect("ns")
            .expect("admin"),
    );
    assert!(
        value(&w, "wanopt_link_copy_duplicated_bytes_total ") > 0,
        "{w}"
    );
    assert!(value(&w, "wanopt_link_copy_late_bytes_total ") > 0, "{w}");
    assert!(value(&w, "wanopt_link_copies_lost_total ") >= 1, "{w}");
    let won: u64 = ["1", "2", "3"]
        .iter()
        .map(|c| {
            value(
                &w,
                &format!("wanopt_link_copy_won_bytes_total{{copy=\"{c}\"}} "),
            )
        })
        .sum();
    assert!(won > 0, "{w}");
}

/// `auto` keeps a second connection while latency traffic is light, drops it while a latency
/// stream takes most of the stated link beside a bulk transfer, and takes it back once the
/// latency traffic is light again; both transfers stay byte-exact.
#[test]
fn auto_drops_the_copy_while_latency_traffic_crowds_the_link() {
    let sync = server(echo_handler);
    let bulk = hash_server();
    let sink = server(hash_handler);
    let p = Pair::start_link(
        &format!(
            "  - name: sync\n    target: {sync}\n    class: latency\n  - name: heavy\n    target: {sink}\n    class: latency\n  - name: bulk\n    target: {bulk}\n"
        ),
        "  - name: sync\n    listen: 127.0.0.1:0\n    class: latency\n  - name: heavy\n    listen: 127.0.0.1:0\n    class: latency\n  - name: bulk\n    listen: 127.0.0.1:0\n",
        "admin:\n  listen: 127.0.0.1:0\n",
        "\n  bandwidth: 16mbit\n  rtt: 10ms",
    );
    let admin = p.west.bound("admin");
    let copies = || value(&scrape(admin), "wanopt_link_latency_copies ");
    wait_until(
        20 * SEC,
        "two copies while latency traffic is light",
        || copies() == 2,
    );
    let bulk_addr = p.west.bound("bulk");
    let transfer = std::thread::spawn(move || hash_client(bulk_addr, 5, 40 * MIB, 0));
    // A latency stream that takes what the link gives it (latency goes before bulk).
    let heavy = p.west.bound("heavy");
    let crowding = std::thread::spawn(move || hash_client(heavy, 6, 12 * MIB, 0));
    // (On loopback the burst may also leave one copy too far behind: it is dropped at once.)
    let wanted = || value(&scrape(admin), "wanopt_link_latency_copies_wanted ");
    wait_until(
        30 * SEC,
        "one connection while latency traffic crowds the link",
        || wanted() == 1 && copies() == 1,
    );
    p.west.wait_log("the redundancy policy changed", 5 * SEC);
    crowding
        .join()
        .expect("latency client")
        .expect("the latency transfer is byte-exact");
    // Light again (the round trips below): after the window and the hold-off, two again.
    let sync_addr = p.west.bound("sync");
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicU64::new(0));
    let looping = {
        let (stop, rounds) = (stop.clone(), rounds.clone());
        let c = TcpStream::connect(sync_addr).expect("connect sync");
        // 8 KiB each way every 100 ms: 4% of the stated 2 MB/s, light.
        std::thread::spawn(move || sync_loop(c, stop, rounds, Duration::from_millis(100)))
    };
    wait_until(40 * SEC, "two copies again", || copies() == 2);
    stop.store(true, Ordering::Relaxed);
    looping
        .join()
        .expect("sync client")
        .expect("every round trip answered exactly");
    transfer
        .join()
        .expect("bulk client")
        .expect("the bulk transfer is byte-exact");
    assert!(p.west.count("latency lane copy attached") >= 2);
    assert_eq!(p.west.count("latency lane lost"), 0);
}

/// A peer whose latency services say `redundancy: off` takes no copies: the lane stays one
/// connection and works.
#[test]
fn a_peer_that_takes_no_copies_gets_one_connection() {
    let sync = server(echo_handler);
    let p = Pair::start_extra(
        &format!("  - name: sync\n    target: {sync}\n    class: latency\n    redundancy: off\n"),
        "  - name: sync\n    listen: 127.0.0.1:0\n    class: latency\n    redundancy: 2\n",
        "admin:\n  listen: 127.0.0.1:0\n",
    );
    p.west.wait_log("latency lane attached", 10 * SEC);
    let c = TcpStream::connect(p.west.bound("sync")).expect("connect");
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicU64::new(0));
    let looping = {
        let (stop, rounds) = (stop.clone(), rounds.clone());
        std::thread::spawn(move || sync_loop(c, stop, rounds, Duration::ZERO))
    };
    // The keeper has looked once it publishes what it wants: one connection, since the peer
    // takes no more (what the peer takes is fixed for the link, so no later look wants more).
    let (w, _) = eventually(p.west.bound("admin"), p.east.bound("admin"), |w, _| {
        value(w, "wanopt_link_latency_copies_wanted ") == 1
    });
    assert_eq!(value(&w, "wanopt_link_latency_copies_wanted "), 1, "{w}");
    stop.store(true, Ordering::Relaxed);
    let times = looping.join().expect("client").expect("exact");
    assert!(!times.is_empty());
    let w = scrape(p.west.bound("admin"));
    assert_eq!(value(&w, "wanopt_link_latency_copies "), 1, "{w}");
    assert_eq!(value(&w, "wanopt_link_latency_copies_wanted "), 1, "{w}");
    assert_eq!(p.west.count("latency lane copy attached"), 0);
    assert_eq!(p.east.count("rejected a latency lane copy"), 0);
}

/// `auto` on a lossy WAN (t3-100ms-1): once the lane's connections have retransmitted over
/// 0.2% of their segments, more connections carry the lane: five, as its SYNC loop's traffic
/// stays under 2% of the link, and with five `link.lane_datagrams: auto` sends the writes as
/// datagrams too, both ways; every round trip stays exact.
#[test]
fn auto_takes_five_copies_on_a_lossy_wan_with_little_traffic() {
    if !wansim::available_or_skip("latency lane copies across a lossy wansim link") {
        return;
    }
    let LossyRun {
        wan,
        pair,
        stop,
        rounds,
        looping,
    } = lossy_run("ca", "");
    let admin = pair.west.bound("admin");
    let copies = || {
        let w = scrape_on(
            wan.in_site(wansim::Site::West, move || TcpStream::connect(admin))
                .expect("ns")
                .expect("admin"),
        );
        value(&w, "wanopt_link_latency_copies ")
    };
    wait_until(90 * SEC, "five connections on a lossy lane", || {
        copies() == 5
    });
    pair.west.wait_log("the redundancy policy changed", 5 * SEC);
    let before = rounds.load(Ordering::Relaxed);
    wait_until(60 * SEC, "round trips on five copies", || {
        rounds.load(Ordering::Relaxed) >= before + 20
    });
    stop.store(true, Ordering::Relaxed);
    looping
        .join()
        .expect("sync client")
        .expect("every round trip answered exactly");
    for (d, site) in [
        (&pair.west, wansim::Site::West),
        (&pair.east, wansim::Site::East),
    ] {
        let admin = d.bound("admin");
        let m = scrape_on(
            wan.in_site(site, move || TcpStream::connect(admin))
                .expect("ns")
                .expect("admin"),
        );
        let sent = value(&m, "wanopt_link_lane_datagram_bytes_total ");
        let taken = value(&m, "wanopt_link_lane_datagrams_received_total ");
        assert!(sent > 0 && taken > 0, "{site:?}: {m}");
        assert_eq!(
            value(&m, "wanopt_link_lane_datagrams_refused_total "),
            0,
            "{m}"
        );
    }
}

/// A pair across wansim's bursty T3 (`t3-100ms-burst`: 1% loss each way, in runs of 5
/// packets) stating its link (with `link` more link lines), admin on: a latency service `sync`
/// (with `lat` more lines) whose target in east echoes, and a bulk service `bulk` into a sink
/// in east, which a client in west fills as fast as the link takes it once the lane's first
/// copy is attached.
struct BurstyLoad {
    wan: wansim::Wan,
    pair: WanPair,
    started: std::time::Instant,
    stop_bulk: Arc<AtomicBool>,
    filler: Option<std::thread::JoinHandle<Result<u64, String>>>,
    _sink: Arc<common::sink::Sink>,
}

impl BurstyLoad {
    fn start(tag: &str, lat: &str, link: &str, seed: u64) -> BurstyLoad {
        use common::sink::{Pace, in_east, send};
        let (wan, params, sync) = echo_wan("t3-100ms-burst", tag);
        let (sink, bulk) = in_east(&wan, 9302);
        let (stated, _) = wanopt_replay::showcase::stated_link(&params);
        let lat = format!("    class: latency\n{lat}");
        let link = format!("{stated}{link}");
        let pair = wan_pair(
            &wan,
            &format!(
                "  - name: sync\n    target: {sync}\n{lat}  - name: bulk\n    target: {bulk}\n"
            ),
            &format!(
                "  - name: sync\n    listen: 127.0.0.1:0\n{lat}  - name: bulk\n    listen: 127.0.0.1:0\n"
            ),
            move |_, y| link_lines(format!("{y}admin:\n  listen: 127.0.0.1:0\n"), &link),
        );
        pair.west.wait_log("latency lane copy attached", 20 * SEC);
        let mut load = BurstyLoad {
            wan,
            pair,
            started: std::time::Instant::now(),
            stop_bulk: Arc::new(AtomicBool::new(false)),
            filler: None,
            _sink: sink,
        };
        let c = load.connect(wansim::Site::West, load.pair.west.bound("bulk"));
        let stop = load.stop_bulk.clone();
        let pace = Pace {
            piece: 256 << 10,
            every: Duration::ZERO,
        };
        load.filler = Some(std::thread::spawn(move || {
            send(
                c,
                seed,
                |o, b| fill(seed, o, b),
                pace,
                &stop,
                &AtomicU64::new(0),
            )
        }));
        load
    }

    fn connect(&self, site: wansim::Site, addr: std::net::SocketAddr) -> TcpStream {
        self.wan
            .in_site(site, move || TcpStream::connect(addr))
            .expect("site")
            .expect("connect")
    }

    /// A daemon's metrics, scraped from inside its site.
    fn scrape(&self, d: &Daemon, site: wansim::Site) -> String {
        scrape_on(self.connect(site, d.bound("admin")))
    }

    /// SYNC round trips from west, 20 ms apart, until `n` were answered; their times (each
    /// answer exact).
    fn rounds(&self, n: u64) -> Vec<Duration> {
        let (stop, rounds) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU64::new(0)),
        );
        let looping = {
            let c = self.connect(wansim::Site::West, self.pair.west.bound("sync"));
            let (stop, rounds) = (stop.clone(), rounds.clone());
            std::thread::spawn(move || sync_loop(c, stop, rounds, Duration::from_millis(20)))
        };
        wait_until(90 * SEC, "round trips", || {
            rounds.load(Ordering::Relaxed) >= n
        });
        stop.store(true, Ordering::Relaxed);
        looping
            .join()
            .expect("sync client")
            .expect("every round trip answered exactly")
    }

    /// Stops the bulk client; the bytes it sent, every one arrived exactly.
    fn stop_bulk(&mut self) -> u64 {
        self.stop_bulk.store(true, Ordering::Relaxed);
        self.filler
            .take()
            .expect("a bulk client")
            .join()
            .expect("bulk client")
            .expect("the bulk copy arrived exactly")
    }
}

/// Across wansim's bursty T3, SYNC round trips whose two copies leave 5 ms apart, beside a
/// bulk copy that fills the link: every round trip and every bulk byte arrives exactly, and the
/// later copy brings bytes first at times (the bursts took the earlier one). West's bulk paces
/// down to make room for the round trips while they run, and is paced at `link.max_rate` again
/// once they stopped.
#[test]
fn spaced_copies_ride_a_bursty_wan_beside_a_bulk_load() {
    if !wansim::available_or_skip("spaced copies across a bursty wansim") {
        return;
    }
    let mut load = BurstyLoad::start("sb", "    redundancy: 2\n", "  copy_spacing: 5ms\n", 7);
    std::thread::sleep(3 * SEC);
    let mut times = load.rounds(300);
    // While the round trips ran, west's bulk made room for them (`link.latency_queue`); once
    // the lane is quiet, bulk is paced at `link.max_rate` again (95% of 45 Mbit/s).
    let west = wansim::Site::West;
    let pacing = || {
        value(
            &load.scrape(&load.pair.west, west),
            "wanopt_link_bulk_pacing_bits_per_second ",
        )
    };
    wait_until(10 * SEC, "bulk paced at link.max_rate again", || {
        pacing() == 42_750_000
    });
    let sent = load.stop_bulk();
    let (p50, p99) = (percentile(&mut times, 0.5), percentile(&mut times, 0.99));
    println!(
        "{} round trips, copies 5 ms apart on t3-100ms-burst beside {sent} bulk bytes: p50 {p50:?}, p99 {p99:?}, max {:?}",
        times.len(),
        times.last().copied().unwrap_or_default()
    );
    for d in [&load.pair.west, &load.pair.east] {
        assert_eq!(d.count("stream failed"), 0, "{}", d.log().join("\n"));
    }
    let w = load.scrape(&load.pair.west, west);
    let won = |c: &str| {
        value(
            &w,
            &format!("wanopt_link_copy_won_bytes_total{{copy=\"{c}\"}} "),
        )
    };
    assert!(won("1") > 0 && won("2") > 0, "{w}");
    // What spacing cost: the later copy waited (one writer, so never longer than the run).
    let waited = value_f64(&w, "wanopt_link_copy_spacing_seconds_total ");
    println!(
        "the later copy waited {waited:.3} s in all for its spacing, over {} round trips",
        times.len()
    );
    let ran = load.started.elapsed().as_secs_f64();
    assert!(waited > 0.0 && waited <= ran, "{waited} s");
    // Copies whose connection was recovering from a burst (or had bytes unacknowledged) when
    // a write came were seen, and wrote it after the readier one.
    let impaired = value(&w, "wanopt_link_copy_impaired_total ");
    println!("{impaired} copies were not ready when a write came");
    assert!(impaired > 0, "{w}");
    let yielded = value_f64(&w, "wanopt_link_bulk_yield_seconds_total ");
    println!("bulk was paced below link.max_rate for {yielded:.1} s");
    assert!(yielded > 0.0 && yielded <= ran, "{yielded} s");
    assert!(sent > 8 * MIB, "the bulk copy moved {sent} bytes");
}

/// Across wansim's bursty T3 beside a bulk copy that fills the link, a latency service with
/// `redundancy: 4` sends its writes as datagrams too (`link.lane_datagrams: auto`): every round
/// trip and every bulk byte arrives exactly, both sides take the other's datagrams and deliver
/// bytes from them before any TCP copy, and nothing on the sockets is refused.
#[test]
fn lane_datagrams_ride_a_bursty_wan_beside_a_bulk_load() {
    if !wansim::available_or_skip("latency lane datagrams across a bursty wansim") {
        return;
    }
    let mut load = BurstyLoad::start("dg", "    redundancy: 4\n", "", 9);
    let mut times = load.rounds(200);
    let sent = load.stop_bulk();
    println!(
        "{} round trips with datagrams on t3-100ms-burst beside {sent} bulk bytes: p50 {:?}, p99 {:?}",
        times.len(),
        percentile(&mut times, 0.5),
        percentile(&mut times, 0.99)
    );
    assert!(sent > 4 * MIB, "the bulk copy moved {sent} bytes");
    for (d, site) in [
        (&load.pair.west, wansim::Site::West),
        (&load.pair.east, wansim::Site::East),
    ] {
        assert_eq!(d.count("stream failed"), 0, "{}", d.log().join("\n"));
        let m = load.scrape(d, site);
        let received = value(&m, "wanopt_link_lane_datagrams_received_total ");
        let won = value(&m, "wanopt_link_copy_won_bytes_total{copy=\"datagrams\"} ");
        let cost = value(&m, "wanopt_link_lane_datagram_bytes_total ");
        println!(
            "{site:?}: {received} datagrams taken, {won} bytes first by datagram, {cost} bytes sent as datagrams"
        );
        assert!(received > 0 && won > 0 && cost > 0, "{m}");
        assert_eq!(
            value(&m, "wanopt_link_lane_datagrams_refused_total "),
            0,
            "{m}"
        );
    }
}
