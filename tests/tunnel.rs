//! End-to-end tests of the tunnel core: real `wanoptd` processes on loopback, real sockets.

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use common::*;
use rand::{Rng, SeedableRng};

const SEC: Duration = Duration::from_secs(1);

/// A pair with a hashing server behind each side: `bulk-e` from west to east, `back` from east
/// to west.
fn hash_pair() -> Pair {
    let east_srv = hash_server();
    let west_srv = hash_server();
    Pair::start(
        &format!(
            "  - name: bulk-e\n    target: {east_srv}\n  - name: back\n    listen: 127.0.0.1:0\n"
        ),
        &format!(
            "  - name: bulk-e\n    listen: 127.0.0.1:0\n    allow: [127.0.0.1/32]\n  - name: back\n    target: {west_srv}\n"
        ),
    )
}

/// 100 concurrent streams, half each way, sizes log-uniform from 1 byte to 64 MiB (one of 64 MiB),
/// each checked byte-exact by hash in both directions.
#[test]
fn hundred_streams_both_directions_are_exact() {
    let p = hash_pair();
    let west_in = p.west.bound("bulk-e");
    let east_in = p.east.bound("back");
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let max: f64 = 64.0 * 1024.0 * 1024.0;
    let mut jobs = Vec::new();
    let mut total = 0u64;
    for i in 0..100u64 {
        let size = if i < 2 {
            64 << 20
        } else {
            max.powf(rng.random::<f64>()) as u64
        };
        let down = if i % 3 == 0 { size / 2 } else { size };
        total += size + down;
        let addr = if i % 2 == 0 { west_in } else { east_in };
        jobs.push(std::thread::spawn(move || hash_client(addr, i, size, down)));
    }
    let start = Instant::now();
    let mut failures = Vec::new();
    for j in jobs {
        if let Err(e) = j.join().expect("client thread") {
            failures.push(e);
        }
    }
    eprintln!(
        "moved {} MiB through the tunnel in {:?}",
        total >> 20,
        start.elapsed()
    );
    assert!(
        failures.is_empty(),
        "{} streams failed: {failures:?}",
        failures.len()
    );
    assert_eq!(p.west.count("stream failed"), 0);
}

/// Each direction closes independently: the client half-closes and still receives, and the
/// server half-closes first and still receives.
#[test]
fn half_close_is_carried_each_way() {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let target = l.local_addr().expect("addr");
    let server = std::thread::spawn(move || {
        // First connection: the client half-closes first.
        let (mut s, _) = l.accept().expect("accept");
        let mut got = Vec::new();
        s.read_to_end(&mut got).expect("read to eof");
        assert_eq!(got, b"request");
        std::thread::sleep(Duration::from_millis(200));
        s.write_all(b"late answer")
            .expect("answer after the client's fin");
        s.shutdown(Shutdown::Write).expect("fin");
        // Second connection: the server half-closes first and keeps reading.
        let (mut s, _) = l.accept().expect("accept");
        s.write_all(b"banner").expect("banner");
        s.shutdown(Shutdown::Write).expect("fin");
        let mut got = Vec::new();
        s.read_to_end(&mut got).expect("read after own fin");
        assert_eq!(got, b"data sent after the server's fin");
    });
    let p = Pair::start(
        &format!("  - name: svc\n    target: {target}\n"),
        "  - name: svc\n    listen: 127.0.0.1:0\n",
    );
    let addr = p.west.bound("svc");

    let mut c = TcpStream::connect(addr).expect("connect");
    c.write_all(b"request").expect("write");
    c.shutdown(Shutdown::Write).expect("half-close");
    let mut got = Vec::new();
    c.read_to_end(&mut got).expect("read answer");
    assert_eq!(got, b"late answer");

    let mut c = TcpStream::connect(addr).expect("connect");
    let mut got = Vec::new();
    c.read_to_end(&mut got).expect("read banner to eof");
    assert_eq!(got, b"banner");
    c.write_all(b"data sent after the server's fin")
        .expect("write after server fin");
    c.shutdown(Shutdown::Write).expect("half-close");
    server.join().expect("server checks");
}

/// A target that refuses closes the client promptly, with an error (not a clean end).
#[test]
fn refused_target_resets_the_client_promptly() {
    let (_hold, closed) = refusing_port();
    let p = Pair::start_with_admin(
        &format!("  - name: dead\n    target: {closed}\n"),
        "  - name: dead\n    listen: 127.0.0.1:0\n",
    );
    let addr = p.west.bound("dead");
    let start = Instant::now();
    let mut c = TcpStream::connect(addr).expect("connect");
    c.set_read_timeout(Some(5 * SEC)).ok();
    let mut buf = [0u8; 16];
    let r = c.read(&mut buf);
    assert!(
        matches!(&r, Err(e) if is_reset(e)),
        "expected a reset, got {r:?}"
    );
    assert!(start.elapsed() < 2 * SEC, "took {:?}", start.elapsed());
    p.east.wait_log("target refused", 5 * SEC);
    // The client's side says so too, and counts it as what it is.
    let line = p.west.wait_log("target refused at the peer", 5 * SEC);
    assert!(
        line.contains("WARN") && line.contains(&closed.to_string()),
        "{line}"
    );
    let failed = |reason: &str| {
        format!("wanopt_streams_failed_total{{service=\"dead\",reason=\"{reason}\"}} ")
    };
    let text = scrape(p.west.bound("admin"));
    assert_eq!(value(&text, &failed("target_refused")), 1, "{text}");
    assert_eq!(value(&text, &failed("stream_error")), 0, "{text}");
}

/// A service the peer does not have is refused with a reason, counted and logged.
#[test]
fn unknown_service_is_refused() {
    let p = Pair::start(
        "  - name: known\n    target: 127.0.0.1:9\n",
        "  - name: ghost\n    listen: 127.0.0.1:0\n",
    );
    let addr = p.west.bound("ghost");
    let mut c = TcpStream::connect(addr).expect("connect");
    c.set_read_timeout(Some(5 * SEC)).ok();
    let r = c.read(&mut [0u8; 8]);
    assert!(
        matches!(&r, Err(e) if is_reset(e)),
        "expected a reset, got {r:?}"
    );
    p.east
        .wait_log("refused stream for unknown service", 5 * SEC);
    let line = p.west.wait_log("stream failed", 5 * SEC);
    assert!(line.contains("unknown_service"), "{line}");
}

/// A client outside the service's allow list never reaches the link.
#[test]
fn client_outside_allow_list_is_refused() {
    let srv = hash_server();
    let p = Pair::start(
        &format!("  - name: svc\n    target: {srv}\n"),
        "  - name: svc\n    listen: 127.0.0.1:0\n    allow: [10.0.0.0/8]\n",
    );
    let addr = p.west.bound("svc");
    let mut c = TcpStream::connect(addr).expect("connect");
    c.set_read_timeout(Some(5 * SEC)).ok();
    let r = c.read(&mut [0u8; 8]);
    assert!(
        matches!(&r, Err(e) if is_reset(e)) || matches!(r, Ok(0)),
        "got {r:?}"
    );
    p.west
        .wait_log("refused client outside the allow list", 5 * SEC);
    assert_eq!(p.east.count("stream connected"), 0);
}

/// East rejects west for `needle`, and again when west dials again: a link that came up in
/// between would have stopped the dialing, so after the second rejection neither side may have
/// seen one.
fn assert_rejected(east: &Daemon, west: &Daemon, needle: &str) {
    east.wait_log_n(needle, 2, 10 * SEC);
    assert_eq!(east.count("link up"), 0, "east accepted a bad peer");
    assert_eq!(west.count("link up"), 0, "west accepted a bad peer");
}

/// A peer whose certificate comes from another CA is rejected during the handshake (the impostor
/// is consistent in itself: its config trusts the CA that signed it, or it would not start).
#[test]
fn peer_from_another_ca_is_rejected() {
    let good = Certs::new(&["west", "east"]);
    let other = Certs::new(&["west"]);
    let east = Daemon::start("east", &east_yaml(&good, "  []"));
    let link = east.bound("link");
    let mut yaml = west_yaml(link, &good, "  []");
    yaml = yaml.replace(
        &good.path().display().to_string(),
        &other.path().display().to_string(),
    );
    let west = Daemon::start("west", &yaml);
    assert_rejected(&east, &west, "rejected link: TLS handshake failed");
}

/// A peer with a certificate from the right CA but another site's name is rejected by the
/// listener's own name check, and a listener with the wrong name is rejected by the connector.
#[test]
fn peer_with_wrong_site_name_is_rejected() {
    let certs = Certs::new(&["west", "east", "north"]);
    let east = Daemon::start("east", &east_yaml(&certs, "  []"));
    let link = east.bound("link");
    // Site north, with its own certificate, dials east in west's place.
    let yaml = west_yaml(link, &certs, "  []")
        .replace("site: west", "site: north")
        .replace("/west.pem", "/north.pem")
        .replace("/west.key", "/north.key");
    let west = Daemon::start("west", &yaml);
    assert_rejected(&east, &west, "rejected link: wrong peer");
    drop(west);

    // North listens where west expects east: west's TLS client refuses its certificate.
    let east2 = Daemon::start(
        "east2",
        &east_yaml(&certs, "  []")
            .replace("site: east", "site: north")
            .replace("/east.pem", "/north.pem")
            .replace("/east.key", "/north.key"),
    );
    let link2 = east2.bound("link");
    let west2 = Daemon::start("west2", &west_yaml(link2, &certs, "  []"));
    west2.wait_log("cannot reach the peer", 10 * SEC);
    assert_eq!(west2.count("link up"), 0);
}

/// Plaintext garbage on the link port is rejected, and the daemon goes on serving real peers.
#[test]
fn plaintext_garbage_on_the_link_port() {
    let certs = Certs::new(&["west", "east"]);
    let srv = hash_server();
    let east = Daemon::start(
        "east",
        &east_yaml(&certs, &format!("  - name: svc\n    target: {srv}\n")),
    );
    let link = east.bound("link");
    for junk in [
        &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..],
        &[0u8; 4096][..],
        &[0x16, 3, 3, 0xff, 0xff, 1][..],
    ] {
        let mut c = TcpStream::connect(link).expect("connect");
        c.set_read_timeout(Some(5 * SEC)).ok();
        let _ = c.write_all(junk);
        let mut buf = Vec::new();
        let _ = c.read_to_end(&mut buf);
    }
    east.wait_log_n("rejected link", 3, 10 * SEC);
    let west = Daemon::start(
        "west",
        &west_yaml(link, &certs, "  - name: svc\n    listen: 127.0.0.1:0\n"),
    );
    west.wait_log("link up", 10 * SEC);
    hash_client(west.bound("svc"), 1, 100_000, 100_000).expect("tunnel works after garbage");
}

/// Without resumption (`resume_window: 0s`), killing the link mid-transfer fails the affected
/// streams with an error (never a clean, truncated end); the link comes back and new streams
/// work.
#[test]
fn link_killed_mid_transfer() {
    // A server that sends a lot, slowly enough that the cut lands mid-stream.
    let target = server(|mut s| {
        let mut buf = [0u8; 1];
        if s.read_exact(&mut buf).is_err() {
            return;
        }
        let _ = send_pattern(
            &mut s,
            u64::from(buf[0]),
            if buf[0] == 1 { 1 << 40 } else { 1 << 20 },
        );
    });
    let RelayedPair {
        relay,
        west,
        east: _east,
        certs: _certs,
    } = RelayedPair::start(
        &format!("  - name: svc\n    target: {target}\n"),
        "  - name: svc\n    listen: 127.0.0.1:0\n",
        // Without resumption (tests/resume.rs has the streams that ride through).
        "  resume_window: 0s\n",
    );
    west.wait_log("link up", 10 * SEC);
    let addr = west.bound("svc");
    let mut c = TcpStream::connect(addr).expect("connect");
    c.set_read_timeout(Some(20 * SEC)).ok();
    c.write_all(&[1]).expect("start");
    let mut buf = vec![0u8; 1 << 16];
    let mut got = 0usize;
    while got < 8 << 20 {
        got += c.read(&mut buf).expect("streaming before the cut");
    }
    relay.cut();
    let r = read_all(&mut c);
    assert!(
        matches!(&r, Err(e) if is_reset(e)),
        "expected a reset after the cut, got {r:?}"
    );
    west.wait_log("link down", 10 * SEC);
    west.wait_log_n("link up", 2, 20 * SEC);
    let mut c = TcpStream::connect(addr).expect("connect");
    c.write_all(&[2]).expect("start");
    let (n, h) = read_all(&mut c).expect("new stream after the link came back");
    assert_eq!(n, 1 << 20);
    assert_eq!(h, pattern_hash(2, 1 << 20));
}

/// SIGTERM lets active streams finish within the grace period, then exits 0.
#[test]
fn sigterm_drains_streams_then_exits_cleanly() {
    let target = server(|mut s| {
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        let _ = s.write_all(&(got.len() as u64).to_le_bytes());
    });
    let Pair {
        certs: _certs,
        east,
        mut west,
    } = Pair::start(
        &format!("  - name: svc\n    target: {target}\n"),
        "  - name: svc\n    listen: 127.0.0.1:0\n",
    );
    let addr = west.bound("svc");
    let mut c = TcpStream::connect(addr).expect("connect");
    c.write_all(b"first half").expect("write");
    // The stream reached the target before the drain begins.
    east.wait_log("stream connected", 10 * SEC);
    west.signal(libc::SIGTERM);
    west.wait_log("shutting down", 10 * SEC);
    // The stream still works during the drain.
    c.write_all(b" second half").expect("write during drain");
    c.shutdown(Shutdown::Write).expect("fin");
    let mut n = [0u8; 8];
    c.read_exact(&mut n).expect("answer during drain");
    assert_eq!(u64::from_le_bytes(n), 22);
    let status = west.wait_exit();
    assert!(status.success(), "exit {status:?}");
    assert!(west.count("shutting down") == 1);
    // New clients are not accepted any more.
    assert!(TcpStream::connect(addr).is_err());
}

/// When a second authenticated link arrives, the newest wins and the older one is closed.
#[test]
fn newest_link_wins() {
    let certs = Certs::new(&["west", "east"]);
    let east = Daemon::start("east", &east_yaml(&certs, "  []"));
    let link = east.bound("link");
    let yaml = west_yaml(link, &certs, "  []");
    let w1 = Daemon::start("west1", &yaml);
    w1.wait_log("link up", 10 * SEC);
    let w2 = Daemon::start("west2", &yaml);
    w2.wait_log("link up", 10 * SEC);
    east.wait_log("closing the older link", 10 * SEC);
    w1.wait_log("a newer link replaced this one", 10 * SEC);
}

/// Latency-class streams get their own connection inside the link (the latency lane), so they
/// never wait behind bulk's loss recovery; without resumption, losing that connection fails the
/// link, which recovers.
#[test]
fn latency_lane_carries_latency_streams_and_its_loss_fails_the_link() {
    let srv = hash_server();
    let RelayedPair {
        east, relay, west, ..
    } = RelayedPair::start(
        &format!(
            "  - name: sync\n    target: {srv}\n    class: latency\n    redundancy: off\n  - name: bulk\n    target: {srv}\n"
        ),
        // One connection for the lane (tests/copies.rs has copies).
        "  - name: sync\n    listen: 127.0.0.1:0\n    class: latency\n    redundancy: off\n  - name: bulk\n    listen: 127.0.0.1:0\n",
        // Without resumption (tests/resume.rs has a lane lost with it).
        "  resume_window: 0s\n",
    );
    west.wait_log("latency lane attached", 10 * SEC);
    east.wait_log("latency lane attached", 10 * SEC);
    assert_eq!(
        relay.connections(),
        2,
        "main connection plus the latency lane"
    );
    let (sync, bulk) = (west.bound("sync"), west.bound("bulk"));
    let jobs: Vec<_> = (0..6u64)
        .map(|i| {
            let addr = if i % 2 == 0 { sync } else { bulk };
            std::thread::spawn(move || hash_client(addr, 100 + i, 3_000_000 * (i % 3 + 1), 500_000))
        })
        .collect();
    for j in jobs {
        j.join()
            .expect("client")
            .expect("byte-exact through both lanes");
    }
    // Cut only the lane: the link fails as a whole and comes back with a new lane.
    relay.cut_one(1);
    west.wait_log("link down", 10 * SEC);
    west.wait_log_n("latency lane attached", 2, 20 * SEC);
    hash_client(sync, 7, 100_000, 100_000).expect("latency stream after recovery");
}

/// With `latency_lane: false` the link is one connection.
#[test]
fn latency_lane_can_be_turned_off() {
    let srv = hash_server();
    let RelayedPair {
        relay,
        west,
        east: _east,
        certs: _certs,
    } = RelayedPair::start(
        &format!("  - name: sync\n    target: {srv}\n    class: latency\n"),
        "  - name: sync\n    listen: 127.0.0.1:0\n    class: latency\n",
        "  latency_lane: false\n",
    );
    hash_client(west.bound("sync"), 3, 1_000_000, 1_000_000)
        .expect("latency stream on the main connection");
    assert_eq!(relay.connections(), 1);
    assert_eq!(west.count("latency lane attached"), 0);
}

/// A link that stays idle from the moment it comes up keeps itself alive with pings (both sides
/// arm their timers when the peer's hello arrives) and carries the first stream long after the
/// idle timeout would have declared a silent peer dead. It needs a round trip longer than the
/// writer's first turn, so it runs across wansim (100 ms).
#[test]
fn an_idle_link_pings_and_stays_up() {
    if !wansim::available_or_skip("idle link across wansim") {
        return;
    }
    let wan = wansim::Wan::start(
        &format!("wi{}", std::process::id() % 100_000),
        wansim::preset("t3-100ms-clean").expect("preset"),
    )
    .expect("wansim");
    let east_ip = wansim::Site::East.addr();
    let l = wan
        .in_site(wansim::Site::East, move || {
            std::net::TcpListener::bind((east_ip, 9200))
        })
        .expect("east")
        .expect("bind");
    let srv = serve_on(l, hash_handler);
    let p = wan_pair(
        &wan,
        &format!("  - name: svc\n    target: {srv}\n"),
        "  - name: svc\n    listen: 127.0.0.1:0\n",
        |_, y| {
            link_lines(y, "  keepalive: 200ms\n")
                .replace("limits:\n", "limits:\n  idle_timeout: 1s\n")
        },
    );
    let (west, east) = (&p.west, &p.east);
    std::thread::sleep(Duration::from_secs(3));
    let addr = west.bound("svc");
    wan.in_site(wansim::Site::West, move || {
        hash_client(addr, 9, 100_000, 100_000)
    })
    .expect("west")
    .expect("the first stream, 3 s later");
    for d in [&west, &east] {
        assert_eq!(d.count("link down"), 0, "{}", d.log().join("\n"));
        assert_eq!(d.count("peer closed the link"), 0, "{}", d.log().join("\n"));
    }
}

/// `wanoptd certs --revoke west` writes the CA's revocation list; once east's config names it
/// (`tls.crl`) and east reloads, west's next connection is refused at the handshake, while the
/// link already up was authenticated before and is not torn down by the reload itself.
#[test]
fn a_revoked_peer_is_refused_at_its_next_handshake_after_reload() {
    let certs = Certs::new(&["west", "east"]);
    let east = Daemon::start("east", &east_yaml(&certs, "  []"));
    let relay = Relay::new(east.bound("link"));
    let west = Daemon::start("west", &west_yaml(relay.addr, &certs, "  []"));
    west.wait_log("link up", 10 * SEC);
    let dir = certs.path().to_str().expect("utf8").to_string();
    let out = std::process::Command::new(bin("wanoptd"))
        .args(["certs", "--out", &dir, "--revoke", "west"])
        .output()
        .expect("wanoptd certs --revoke");
    assert!(out.status.success(), "{out:?}");
    let crl = certs.path().join("crl.pem");
    assert!(crl.exists());
    let path = east.config_path().to_path_buf();
    let yaml = std::fs::read_to_string(&path).expect("east's config");
    let key_line = format!("  key: {dir}/east.key\n");
    assert!(yaml.contains(&key_line), "{yaml}");
    std::fs::write(
        &path,
        yaml.replace(&key_line, &format!("{key_line}  crl: {}\n", crl.display())),
    )
    .expect("write");
    east.signal(libc::SIGHUP);
    east.wait_log("SIGHUP: reloading", 5 * SEC);
    relay.cut();
    east.wait_log_n("rejected link: TLS handshake failed", 2, 20 * SEC);
    assert_eq!(west.count("link up"), 1, "{}", west.log().join("\n"));
    // A renewed west (a new certificate under the same CA) gets in again.
    let out = std::process::Command::new(bin("wanoptd"))
        .args(["certs", "--out", &dir, "--renew", "west"])
        .output()
        .expect("wanoptd certs --renew");
    assert!(out.status.success(), "{out:?}");
    west.signal(libc::SIGHUP);
    west.wait_log_n("link up", 2, 20 * SEC);
}

/// The daemons take no transparent huge pages: each turns them off for its process at start,
/// and after a copy each way no mapping of either carries the `hg` flag that their allocator's
/// `madvise(MADV_HUGEPAGE)` would set. With them, a fresh pair's first copies on a VM ran at half the
/// rate whenever new 2 MiB pages were zeroed on first touch (docs/tuning.md, "Huge pages").
#[test]
fn the_daemons_memory_is_not_marked_for_huge_pages() {
    let p = hash_pair();
    // Enough bytes each way for the allocator to take fresh memory from the kernel (its
    // regions are marked, if at all, when it maps them).
    hash_client(p.west.bound("bulk-e"), 1, 24 << 20, 24 << 20).expect("west to east");
    hash_client(p.east.bound("back"), 2, 24 << 20, 8 << 20).expect("east to west");
    for (side, d) in [("west", &p.west), ("east", &p.east)] {
        // Turned off for the process too (`PR_SET_THP_DISABLE`), for hosts set to `always`;
        // /proc says so where the kernel has the `THP_enabled` line.
        let status = std::fs::read_to_string(format!("/proc/{}/status", d.pid()))
            .unwrap_or_else(|e| panic!("{side}'s /proc status: {e}"));
        match status.lines().find_map(|l| l.strip_prefix("THP_enabled:")) {
            Some(v) => assert_eq!(v.trim(), "0", "{side}: huge pages on for the process"),
            None => eprintln!("{side}: this kernel's /proc status has no THP_enabled line"),
        }
        let smaps = std::fs::read_to_string(format!("/proc/{}/smaps", d.pid()))
            .unwrap_or_else(|e| panic!("{side}'s /proc smaps: {e}"));
        let mappings = smaps.lines().filter(|l| l.starts_with("VmFlags:")).count();
        assert!(mappings > 0, "{side}: no VmFlags lines in its smaps");
        let marked: Vec<&str> = smaps
            .lines()
            .filter(|l| l.starts_with("VmFlags:") && l.split_whitespace().any(|f| f == "hg"))
            .collect();
        assert!(
            marked.is_empty(),
            "{side}: {} of {mappings} mappings marked for huge pages",
            marked.len()
        );
    }
}
