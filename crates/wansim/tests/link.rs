//! wansim measured with real UDP and TCP traffic between its two namespaces. These need root,
//! `/dev/net/tun` and `ip`; elsewhere they skip with a printed reason, and with
//! `WANOPT_REQUIRE_NETNS=1` (CI) they fail instead of skipping.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use wansim::{DirParams, GilbertElliott, LinkParams, Site, Wan};

fn prefix(test: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "wt{}-{}{}",
        std::process::id() % 100_000,
        test,
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn start(test: &str, d: DirParams) -> Option<Wan> {
    if !wansim::available_or_skip(test) {
        return None;
    }
    Some(Wan::start(&prefix(test), LinkParams::symmetric(d)).expect("wansim starts"))
}

const EAST_PORT: u16 = 9000;

/// A UDP socket in east, bound to the link address.
fn east_udp(wan: &Wan) -> UdpSocket {
    let s = wan
        .in_site(Site::East, || {
            UdpSocket::bind((Site::East.addr(), EAST_PORT))
        })
        .expect("enter east")
        .expect("bind in east");
    // A deep receive buffer, so a receiver thread that is briefly descheduled loses nothing.
    let _ = socket2::SockRef::from(&s).set_recv_buffer_size(8 << 20);
    s
}

fn west_udp(wan: &Wan) -> UdpSocket {
    wan.in_site(Site::West, || UdpSocket::bind((Site::West.addr(), 0)))
        .expect("enter west")
        .expect("bind in west")
}

/// `recv`, again after a signal interrupts it (a signal to the test process is not the end of
/// the traffic); a timeout still ends it.
fn recv(s: &UdpSocket, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        match s.recv(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            r => return r,
        }
    }
}

fn east_addr() -> SocketAddr {
    SocketAddr::from((Site::East.addr(), EAST_PORT))
}

/// Sends `n` numbered datagrams west→east, `gap` apart, and returns the numbers received.
fn udp_train(wan: &Wan, n: u32, size: usize, gap: Duration) -> Vec<u32> {
    let rx = east_udp(wan);
    rx.set_read_timeout(Some(Duration::from_millis(500))).ok();
    let tx = west_udp(wan);
    let recv = std::thread::spawn(move || {
        let mut got = Vec::new();
        let mut buf = vec![0u8; 2048];
        while let Ok(k) = recv(&rx, &mut buf) {
            if k >= 4 {
                got.push(u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]));
            }
        }
        got
    });
    let mut pkt = vec![0u8; size];
    let start = Instant::now();
    for i in 0..n {
        pkt[..4].copy_from_slice(&i.to_le_bytes());
        tx.send_to(&pkt, east_addr()).expect("send");
        let due = start + gap * (i + 1);
        while Instant::now() < due {
            std::thread::sleep(due - Instant::now());
        }
    }
    recv.join().expect("receiver")
}

/// Every packet waits its configured delay, never less, and no more than a scheduling hiccup
/// more. How close to the setting it lands is a benchmark figure (`benches/wansim.rs`: the
/// per-packet timing error), since a busy machine moves it.
#[test]
fn round_trips_take_the_configured_delay_never_less() {
    let Some(wan) = start(
        "rtt",
        DirParams {
            rate_bps: Some(100_000_000),
            delay: Duration::from_millis(20),
            ..DirParams::default()
        },
    ) else {
        return;
    };
    let echo = east_udp(&wan);
    std::thread::spawn(move || {
        let mut buf = [0u8; 1500];
        loop {
            match echo.recv_from(&mut buf) {
                Ok((n, from)) => {
                    let _ = echo.send_to(&buf[..n], from);
                }
                // A signal to the test process is not the end of the echo.
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
    });
    let c = west_udp(&wan);
    c.set_read_timeout(Some(Duration::from_secs(2))).ok();
    let mut rtts = Vec::new();
    for i in 0u32..100 {
        let t = Instant::now();
        c.send_to(&i.to_le_bytes(), east_addr()).expect("send");
        let mut buf = [0u8; 16];
        let n = recv(&c, &mut buf).expect("echo");
        assert_eq!(&buf[..n], &i.to_le_bytes());
        rtts.push(t.elapsed());
        std::thread::sleep(Duration::from_millis(5));
    }
    rtts.sort();
    let median = rtts[rtts.len() / 2];
    eprintln!(
        "rtt median {median:?}, min {:?}, max {:?}",
        rtts[0],
        rtts[rtts.len() - 1]
    );
    assert!(
        rtts[0] >= Duration::from_millis(40),
        "a round trip of {:?} beat the 40 ms the link is set to",
        rtts[0]
    );
    assert!(
        median < Duration::from_millis(90),
        "median RTT {median:?}: the delay is applied more than once"
    );
    // Per-packet timing error is a benchmark figure (benches/wansim.rs); here it is only reported.
    let (a, b) = wan.stop();
    eprintln!("west->east: {a}\neast->west: {b}");
}

/// Offered more than the line rate, the link delivers no faster than the rate, queues and then
/// drops the rest. How close to the rate it delivers is a benchmark figure
/// (`benches/wansim.rs`: goodput against the line rate), since a busy machine moves it.
#[test]
fn the_rate_caps_what_crosses_and_the_queue_drops_the_excess() {
    let rate = 20_000_000u64;
    let Some(wan) = start(
        "rate",
        DirParams {
            rate_bps: Some(rate),
            delay: Duration::from_millis(5),
            ..DirParams::default()
        },
    ) else {
        return;
    };
    let rx = east_udp(&wan);
    rx.set_read_timeout(Some(Duration::from_millis(500))).ok();
    let recv = std::thread::spawn(move || {
        let mut buf = vec![0u8; 2048];
        let (mut first, mut last, mut bytes, mut count) = (None, Instant::now(), 0u64, 0u64);
        while let Ok(k) = recv(&rx, &mut buf) {
            let now = Instant::now();
            if first.is_none() {
                first = Some(now);
            } else {
                // IP (20) and UDP (8) headers travel on the line too.
                bytes += k as u64 + 28;
                count += 1;
            }
            last = now;
        }
        (bytes, count, first.map(|f| last - f))
    });
    let tx = west_udp(&wan);
    // Offer about 1.5x the line rate for 2 seconds, in 1200-byte datagrams.
    let pkt = vec![0u8; 1200];
    let gap = Duration::from_nanos(1228 * 8 * 1_000_000_000 / (rate * 3 / 2));
    let start = Instant::now();
    let mut i = 0u32;
    while start.elapsed() < Duration::from_secs(2) {
        let _ = tx.send_to(&pkt, east_addr());
        i += 1;
        let due = start + gap * i;
        while Instant::now() < due {
            std::hint::spin_loop();
        }
    }
    let (bytes, count, span) = recv.join().expect("receiver");
    let span = span.expect("packets arrived");
    let measured = bytes as f64 * 8.0 / span.as_secs_f64();
    eprintln!(
        "offered {i} packets, received {count}, measured {:.2} Mbit/s",
        measured / 1e6
    );
    assert!(
        measured <= rate as f64 * 1.05,
        "{measured} bit/s crossed a {rate} bit/s line"
    );
    assert!(
        measured >= rate as f64 / 2.0,
        "{measured} bit/s: the line runs far below its {rate} bit/s"
    );
    let (a, _) = wan.stop();
    assert!(a.drop_queue > 0, "the queue never filled: {a}");
}

#[test]
fn random_loss_is_within_statistical_bounds() {
    let p = 0.02;
    let Some(wan) = start(
        "loss",
        DirParams {
            loss: p,
            ..DirParams::default()
        },
    ) else {
        return;
    };
    let n = 10_000u32;
    let got = udp_train(&wan, n, 200, Duration::from_micros(60));
    let (a, _) = wan.stop();
    // The emulated loss is what wansim dropped; every other packet it took in must have arrived.
    let seen = a.packets_in as f64;
    let lost = a.drop_loss as f64;
    let sigma = (seen * p * (1.0 - p)).sqrt();
    eprintln!(
        "wansim dropped {lost} of {seen} (expected {:.0} ± {sigma:.1}), received {}",
        seen * p,
        got.len()
    );
    assert!(
        seen >= f64::from(n) * 0.99,
        "the emulator saw only {seen} of {n} packets"
    );
    assert!((lost - seen * p).abs() < 4.0 * sigma, "lost {lost}");
    assert_eq!(
        got.len() as u64 + a.drop_loss,
        a.packets_in,
        "packets vanished after the emulator: {a}"
    );
}

#[test]
fn burst_loss_is_shaped_as_configured() {
    let ge = GilbertElliott {
        p: 0.01,
        r: 0.25,
        bad_loss: 1.0,
        good_loss: 0.0,
        clock: wansim::BurstClock::Packet,
    };
    let Some(wan) = start(
        "burst",
        DirParams {
            burst: Some(ge),
            ..DirParams::default()
        },
    ) else {
        return;
    };
    let n = 20_000u32;
    let got = udp_train(&wan, n, 200, Duration::from_micros(50));
    let mut seen = vec![false; n as usize];
    for i in got {
        seen[i as usize] = true;
    }
    let lost = seen.iter().filter(|s| !**s).count();
    let runs: Vec<usize> = seen
        .split(|s| *s)
        .map(<[bool]>::len)
        .filter(|l| *l > 0)
        .collect();
    let mean_run = lost as f64 / runs.len().max(1) as f64;
    let rate = lost as f64 / f64::from(n);
    eprintln!(
        "loss {:.2}% (model {:.2}%), {} bursts, mean length {mean_run:.2} (model 4)",
        rate * 100.0,
        ge.mean_loss() * 100.0,
        runs.len()
    );
    // Expected loss 3.85%; bursts make it vary more than Bernoulli loss, so the bound is wide.
    assert!((rate - ge.mean_loss()).abs() < 0.015, "loss rate {rate}");
    assert!(
        (2.8..5.5).contains(&mean_run),
        "mean burst length {mean_run}"
    );
}

#[test]
fn cut_link_passes_nothing_then_recovers() {
    let Some(wan) = start(
        "cut",
        DirParams {
            delay: Duration::from_millis(1),
            ..DirParams::default()
        },
    ) else {
        return;
    };
    wan.set_cut(true);
    let got = udp_train(&wan, 500, 100, Duration::from_micros(200));
    assert!(got.is_empty(), "{} packets crossed a cut link", got.len());
    assert_eq!(wan.counters().0.drop_cut, 500);
    wan.set_cut(false);
    let got = udp_train(&wan, 500, 100, Duration::from_micros(200));
    assert_eq!(got.len(), 500);
}

#[test]
fn tcp_crosses_the_link_and_cleanup_leaves_nothing() {
    let Some(wan) = start(
        "tcp",
        DirParams {
            rate_bps: Some(50_000_000),
            delay: Duration::from_millis(10),
            ..DirParams::default()
        },
    ) else {
        return;
    };
    let listener = wan
        .in_site(Site::East, || TcpListener::bind((Site::East.addr(), 5001)))
        .expect("east")
        .expect("listen");
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let mut v = Vec::new();
        s.read_to_end(&mut v).expect("read");
        s.write_all(&(v.len() as u64).to_le_bytes())
            .expect("answer");
    });
    let mut c = wan
        .in_site(Site::West, || TcpStream::connect((Site::East.addr(), 5001)))
        .expect("west")
        .expect("connect across the link");
    c.write_all(&vec![7u8; 2_000_000]).expect("send");
    c.shutdown(std::net::Shutdown::Write).expect("fin");
    let mut n = [0u8; 8];
    c.read_exact(&mut n).expect("answer");
    assert_eq!(u64::from_le_bytes(n), 2_000_000);
    server.join().expect("server");
    let ns = (wan.netns(Site::West), wan.netns(Site::East));
    // The command helper runs programs inside a site.
    let out = wan
        .command(Site::West, "ip")
        .args(["-o", "addr", "show", "dev", "wan0"])
        .output()
        .expect("ip in west");
    assert!(String::from_utf8_lossy(&out.stdout).contains("198.18.0.1"));
    wan.stop();
    let left = wansim::sys::list_netns();
    assert!(
        !left.contains(&ns.0) && !left.contains(&ns.1),
        "namespaces left behind: {left:?}"
    );
    let links = std::process::Command::new("ip")
        .args(["-o", "link"])
        .output()
        .expect("ip link");
    let links = String::from_utf8_lossy(&links.stdout);
    assert!(!links.contains("wan0"), "device left behind: {links}");
}

#[test]
fn down_cleans_up_after_a_crashed_instance() {
    if !wansim::available_or_skip("down") {
        return;
    }
    let p = prefix("crash");
    // A crashed instance leaves its namespaces (its devices died with the process).
    for site in ["west", "east"] {
        wansim::sys::ip(&["netns", "add", &format!("{p}-{site}")]).expect("netns add");
    }
    // The next start with the same prefix removes them and works.
    let wan =
        Wan::start(&p, LinkParams::symmetric(DirParams::default())).expect("start over leftovers");
    drop(wan);
    assert!(wansim::sys::list_netns().iter().all(|n| !n.starts_with(&p)));
    for site in ["west", "east"] {
        wansim::sys::ip(&["netns", "add", &format!("{p}-{site}")]).expect("netns add");
    }
    assert_eq!(wansim::down(&p).len(), 2);
}
