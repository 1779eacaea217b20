//! Restart without dropping a stream: `SIGUSR2` hands a running daemon to the binary at its
//! path (a new process that inherits the listeners and every client and target socket and
//! resumes the link), on either side and on both in turn, while streams move both ways. Every
//! stream must end byte-exact, and no client or target may see its connection drop.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;

const SEC: Duration = Duration::from_secs(1);

/// The processes a handover started: stopped (SIGTERM, then SIGKILL) when the test ends.
struct Successors(Vec<i32>);

impl Drop for Successors {
    fn drop(&mut self) {
        for pid in &self.0 {
            // SAFETY: kill with a pid this test learnt from the daemon's log.
            unsafe { libc::kill(*pid, libc::SIGTERM) };
        }
        std::thread::sleep(Duration::from_millis(500));
        for pid in &self.0 {
            // SAFETY: as above.
            unsafe { libc::kill(*pid, libc::SIGKILL) };
        }
    }
}

/// Sends `sig` to `pid`.
fn kill(pid: i32, sig: i32) {
    // SAFETY: kill with a pid this test learnt and a valid signal.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill {pid}");
}

/// The pid of the `n`th process a daemon handed over to, from its log.
fn successor(d: &Daemon, n: usize) -> i32 {
    let line = d.wait_log_n("handed over to the new process", n, 40 * SEC);
    line.split_whitespace()
        .find_map(|t| t.strip_prefix("pid="))
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no pid in {line:?}"))
}

/// West, then east, then west's new process again: each hands over while four streams move
/// (two optimized, one plain, one latency-class), and every stream ends exact. A stream opened
/// after the handovers works too.
#[test]
fn streams_ride_through_handovers_on_either_side_and_both_in_turn() {
    handovers(&bin("wanoptd"), true);
}

/// With east running an earlier build (which knows nothing of handovers, only of resuming a
/// link), west hands over twice: the earlier peer sees two short link losses, and every
/// stream ends exact.
#[test]
fn streams_ride_through_handovers_with_an_earlier_peer() {
    let Some(old) = earlier_wanoptd() else { return };
    handovers(&old, false);
}

/// A pair with east running `east_exe`: west hands over, then east (if `east_hands_over`),
/// then west's new process again, to a binary replaced in place.
fn handovers(east_exe: &std::path::Path, east_hands_over: bool) {
    let srv = hash_server();
    let state = (
        tempfile::tempdir().expect("tempdir"),
        tempfile::tempdir().expect("tempdir"),
    );
    let optimize = |dir: &std::path::Path| {
        format!(
            "state_dir: {}\noptimize:\n  memory: 64MiB\n  disk:\n    bytes: 256MiB\n    checkpoint: 1s\n",
            dir.display()
        )
    };
    let certs = Certs::new(&["west", "east"]);
    let east = Daemon::start_bin(
        east_exe,
        None,
        "east",
        &site_yaml(
            "east",
            "west",
            "listen: 127.0.0.1:0",
            &certs,
            &format!(
                "  - name: h\n    target: {srv}\n  - name: plain\n    target: {srv}\n  - name: sync\n    target: {srv}\n    class: latency\n"
            ),
            &optimize(state.0.path()),
        ),
        &[],
    );
    let link = east.bound("link");
    // West runs a copy of the binary, so the test can upgrade it in place (a new file renamed
    // over the old one, as a package manager does) before its second handover.
    let bin_dir = tempfile::tempdir().expect("tempdir");
    let exe = bin_dir.path().join("wanoptd");
    std::fs::copy(bin("wanoptd"), &exe).expect("copy wanoptd");
    let west = Daemon::start_bin(
        &exe,
        None,
        "west",
        &site_yaml(
            "west",
            "east",
            &format!("connect: {link}"),
            &certs,
            "  - name: h\n    listen: 127.0.0.1:0\n  - name: plain\n    listen: 127.0.0.1:0\n    compression: none\n    dedup: false\n  - name: sync\n    listen: 127.0.0.1:0\n    class: latency\n",
            &optimize(state.1.path()),
        ),
        &[],
    );
    east.wait_log("link up", 10 * SEC);
    west.wait_log("link up", 10 * SEC);
    let (h, plain, sync) = (west.bound("h"), west.bound("plain"), west.bound("sync"));
    let mut successors = Successors(Vec::new());
    // About 12 s of sending each, through three handovers.
    let clients: Vec<_> = [
        (h, 1u64, 48u64 << 20, 4u64 << 20, 8u64 << 20),
        (h, 2, 24 << 20, 2 << 20, 1 << 20),
        (plain, 3, 24 << 20, 2 << 20, 4 << 20),
        (sync, 4, 2 << 20, 170 << 10, 64 << 10),
    ]
    .into_iter()
    .map(|(addr, seed, len, rate, reply)| {
        std::thread::spawn(move || paced_client(addr, seed, len, rate, reply))
    })
    .collect();
    std::thread::sleep(2 * SEC);

    // West (the connecting side) hands over.
    let west_old = west.pid();
    kill(west_old as i32, libc::SIGUSR2);
    let w1 = successor(&west, 1);
    successors.0.push(w1);
    assert_ne!(w1, west_old as i32);
    west.wait_log_n("link up", 2, 20 * SEC);
    std::thread::sleep(2 * SEC);

    // East (the listener) hands over.
    let mut e1 = None;
    if east_hands_over {
        kill(east.pid() as i32, libc::SIGUSR2);
        let pid = successor(&east, 1);
        successors.0.push(pid);
        e1 = Some(pid);
        east.wait_log("took the daemon over", 20 * SEC);
    }
    std::thread::sleep(2 * SEC);

    // West's new process hands over in turn, to an upgraded binary: the file it runs from was
    // replaced meanwhile.
    let fresh = bin_dir.path().join("wanoptd.new");
    std::fs::copy(bin("wanoptd"), &fresh).expect("copy wanoptd");
    std::fs::rename(&fresh, &exe).expect("replace wanoptd");
    kill(w1, libc::SIGUSR2);
    let w2 = successor(&west, 2);
    successors.0.push(w2);

    let mut failed = Vec::new();
    for c in clients {
        if let Err(e) = c.join().expect("client thread") {
            failed.push(e);
        }
    }
    assert!(
        failed.is_empty(),
        "{failed:?}\n--- west ---\n{}\n--- east ---\n{}",
        west.log().join("\n"),
        east.log().join("\n")
    );
    // A new stream after it all.
    hash_client(h, 9, 4 << 20, 1 << 20).expect("a stream after the handovers");
    for d in [&west, &east] {
        assert_eq!(d.count("stream failed"), 0, "{}", d.log().join("\n"));
    }
    assert_eq!(west.count("took the link's streams over"), 2);
    assert_eq!(
        east.count("took the link's streams over"),
        usize::from(east_hands_over)
    );
    println!(
        "west handed over twice (pids {west_old} -> {w1} -> {w2}), east {e1:?}; 4 streams exact"
    );
}

/// A handover the new binary would refuse (here: the config file was broken meanwhile) stops
/// nothing: the daemon says why and serves on, its streams untouched.
#[test]
fn a_handover_the_new_binary_refuses_stops_nothing() {
    let srv = hash_server();
    let mut p = Pair::start(
        &format!("  - name: h\n    target: {srv}\n"),
        "  - name: h\n    listen: 127.0.0.1:0\n",
    );
    let h = p.west.bound("h");
    let client = std::thread::spawn(move || paced_client(h, 5, 8 << 20, 4 << 20, 1 << 20));
    std::thread::sleep(SEC);
    let good = std::fs::read_to_string(p.west.config_path()).expect("config");
    std::fs::write(p.west.config_path(), "site: [not a name\n").expect("break the config");
    p.west.signal(libc::SIGUSR2);
    let line = p.west.wait_log(
        "handover refused: the new binary does not accept the config",
        20 * SEC,
    );
    assert!(line.contains("serving on"), "{line}");
    std::fs::write(p.west.config_path(), good).expect("restore the config");
    client
        .join()
        .expect("client thread")
        .expect("the stream went on exact");
    assert!(p.west.is_running(), "the daemon serves on");
    assert_eq!(p.west.count("handover: parking the streams"), 0);
    hash_client(h, 6, 1 << 20, 1 << 20).expect("a new stream after the refusal");
}

/// The end-to-end test with a real client: a PostgreSQL standby streams WAL from its
/// primary through the pair across wansim `t3-100ms-0.5` while `pgbench` writes at a steady
/// rate, and meanwhile west hands over three times (the last time to a binary replaced in place
/// under it, as an upgrade does) and east once. The walreceiver never notices: the standby's
/// walreceiver and the primary's walsender are the same processes from start to end, and
/// primary and standby hold the same rows at the end.
#[test]
fn a_postgres_standby_never_notices_handovers_across_a_wan() {
    use common::pgserver::*;
    if !wansim::available_or_skip("a PostgreSQL standby through handovers across wansim") {
        return;
    }
    let pg = server_bin();
    let missing: Vec<String> = ["initdb", "pg_basebackup", "pgbench", "pg_ctl"]
        .iter()
        .map(|p| pg.join(p))
        .filter(|p| !p.exists())
        .map(|p| p.display().to_string())
        .collect();
    if !missing.is_empty() {
        assert!(
            std::env::var("WANOPT_REQUIRE_POSTGRES").as_deref() != Ok("1"),
            "WANOPT_REQUIRE_POSTGRES=1 but {missing:?} are missing"
        );
        eprintln!("skipping: missing {missing:?}");
        return;
    }
    let wan = wansim::Wan::start(
        &format!("pgho{}", std::process::id() % 100_000),
        wansim::preset("t3-100ms-0.5").expect("preset"),
    )
    .expect("wansim");
    let (east_ns, west_ns) = (wan.netns(wansim::Site::East), wan.netns(wansim::Site::West));

    let tmp = tempfile::tempdir().expect("tempdir");
    run("chmod", &["755", tmp.path().to_str().expect("utf8")]).expect("chmod");
    let sock = owned_dir(tmp.path(), "sock", "postgres");
    let work = owned_dir(tmp.path(), "pg", "postgres");
    let (primary_dir, standby_dir) = (work.join("primary"), work.join("standby"));
    let dir = |p: &std::path::Path| p.to_str().expect("utf8").to_string();
    run_as(
        "postgres",
        &pg,
        "initdb",
        &["-D", &dir(&primary_dir), "-U", "postgres", "--auth=trust"],
    )
    .expect("initdb");
    std::fs::write(
        primary_dir.join("postgresql.auto.conf"),
        "wal_keep_size = '1GB'\n",
    )
    .expect("primary settings");
    let primary = PgServer::start_in(Some(&east_ns), &pg, &primary_dir, &sock);
    let sock_s = dir(&sock);
    let primary_port = primary.port.to_string();
    let on_primary = |cmd: &str, args: &[&str]| {
        let mut a = vec![
            "-h",
            sock_s.as_str(),
            "-p",
            primary_port.as_str(),
            "-U",
            "postgres",
        ];
        a.extend_from_slice(args);
        run_as("postgres", &pg, cmd, &a)
    };
    on_primary("pgbench", &["-i", "-q", "-s", "10", "postgres"]).expect("pgbench -i");
    on_primary(
        "pg_basebackup",
        &["-D", &dir(&standby_dir), "-R", "-X", "stream", "-c", "fast"],
    )
    .expect("the standby's clone");

    // Both daemons run a copy of the binary, so the test can replace it under them.
    let bin_dir = tempfile::tempdir().expect("tempdir");
    let exe = bin_dir.path().join("wanoptd");
    std::fs::copy(bin("wanoptd"), &exe).expect("copy wanoptd");
    let pair = wan_pair_of(
        &exe,
        &wan,
        &format!("  - name: pg\n    target: 127.0.0.1:{}\n", primary.port),
        "  - name: pg\n    listen: 127.0.0.1:0\n",
        |_, y| link_lines(y, "  bandwidth: 45mbit\n  rtt: 100ms\n"),
    );
    let gw = pair.west.bound("pg");
    // The standby replicates from west's gateway port (in its own site's namespace).
    let mut auto = std::fs::read_to_string(standby_dir.join("postgresql.auto.conf"))
        .expect("postgresql.auto.conf");
    auto.push_str(&format!(
        "primary_conninfo = 'host={} port={} user=postgres application_name=standby'\n",
        gw.ip(),
        gw.port()
    ));
    std::fs::write(standby_dir.join("postgresql.auto.conf"), auto).expect("standby settings");
    let standby = PgServer::start_in(Some(&west_ns), &pg, &standby_dir, &sock);
    let streaming = |s: &str| s.split('|').next() == Some("streaming");
    let first = wait_for("the standby streams", 60 * SEC, || {
        let s = primary
            .psql("SELECT state, pid, backend_start FROM pg_stat_replication")
            .ok()?;
        streaming(&s).then_some(s)
    });
    let receiver = standby
        .psql("SELECT pid FROM pg_stat_wal_receiver")
        .expect("walreceiver");

    // A steady load: 300 transactions a second for 45 s, four clients.
    let load = {
        let (pg, sock_s, port) = (pg.clone(), sock_s.clone(), primary_port.clone());
        std::thread::spawn(move || {
            run_as(
                "postgres",
                &pg,
                "pgbench",
                &[
                    "-h", &sock_s, "-p", &port, "-U", "postgres", "-n", "-c", "4", "-j", "2", "-R",
                    "300", "-T", "45", "postgres",
                ],
            )
        })
    };
    let mut successors = Successors(Vec::new());
    let (west, east) = (&pair.west, &pair.east);
    std::thread::sleep(6 * SEC);
    kill(west.pid() as i32, libc::SIGUSR2);
    let w1 = successor(west, 1);
    successors.0.push(w1);
    west.wait_log_n("link resumed", 1, 30 * SEC);
    std::thread::sleep(6 * SEC);
    kill(east.pid() as i32, libc::SIGUSR2);
    let e1 = successor(east, 1);
    successors.0.push(e1);
    east.wait_log("took the link's streams over", 30 * SEC);
    std::thread::sleep(6 * SEC);
    kill(w1, libc::SIGUSR2);
    let w2 = successor(west, 2);
    successors.0.push(w2);
    std::thread::sleep(6 * SEC);
    // An upgrade: a new file renamed over the one the daemons run from.
    let fresh = bin_dir.path().join("wanoptd.new");
    std::fs::copy(bin("wanoptd"), &fresh).expect("copy wanoptd");
    std::fs::rename(&fresh, &exe).expect("replace wanoptd");
    kill(w2, libc::SIGUSR2);
    let w3 = successor(west, 3);
    successors.0.push(w3);

    let out = load
        .join()
        .expect("pgbench thread")
        .expect("pgbench ran to its end");
    assert!(
        out.contains("number of failed transactions: 0") || !out.contains("failed"),
        "{out}"
    );
    let lsn = primary
        .psql("SELECT pg_current_wal_lsn()")
        .expect("primary lsn");
    wait_for("the standby caught up", 120 * SEC, || {
        let ok = standby
            .psql(&format!("SELECT pg_last_wal_replay_lsn() >= '{lsn}'"))
            .ok()?;
        (ok == "t").then_some(())
    });
    let rows = "SELECT (SELECT count(*) || ' ' || sum(abalance) || ' ' || md5(string_agg(abalance::text, ',' ORDER BY aid)) FROM pgbench_accounts) || ' ' || \
                (SELECT count(*) || ' ' || coalesce(sum(delta), 0) FROM pgbench_history) || ' ' || \
                (SELECT sum(bbalance) FROM pgbench_branches) || ' ' || (SELECT sum(tbalance) FROM pgbench_tellers)";
    let want = primary.psql(rows).expect("primary rows");
    let got = standby.psql(rows).expect("standby rows");
    assert_eq!(got, want, "the standby's rows differ from the primary's");
    let history: u64 = want
        .split_whitespace()
        .nth(3)
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(history > 5_000, "pgbench wrote too little: {want}");
    // The same walsender (pid and start) and walreceiver as before the handovers.
    let last = primary
        .psql("SELECT state, pid, backend_start FROM pg_stat_replication")
        .expect("pg_stat_replication");
    assert_eq!(last, first, "the standby reconnected");
    assert_eq!(
        standby
            .psql("SELECT pid FROM pg_stat_wal_receiver")
            .expect("walreceiver"),
        receiver,
        "the walreceiver restarted"
    );
    for d in [west, east] {
        assert_eq!(d.count("stream failed"), 0, "{}", d.log().join("\n"));
        for l in d
            .log()
            .iter()
            .filter(|l| l.contains("took the link's streams over") || l.contains("link resumed"))
        {
            println!("{}: {l}", d.name);
        }
    }
    println!(
        "{history} pgbench transactions; west handed over 3 times ({} -> {w1} -> {w2} -> {w3}, the last to a replaced binary), east once (-> {e1}); the standby never reconnected",
        west.pid()
    );
}

/// 8 KiB round trips on `s` (to an echo server) until `stop`, each checked; the slowest.
fn sync_loop_on(
    mut s: TcpStream,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Result<(u64, Duration), String> {
    s.set_read_timeout(Some(Duration::from_secs(60))).ok();
    let mut out = vec![0u8; 8192];
    let mut back = vec![0u8; 8192];
    let (mut n, mut worst) = (0u64, Duration::ZERO);
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        fill(77, n * 8192, &mut out);
        let t = Instant::now();
        s.write_all(&out)
            .map_err(|e| format!("round trip {n}: write: {e}"))?;
        s.read_exact(&mut back)
            .map_err(|e| format!("round trip {n}: read: {e}"))?;
        if back != out {
            return Err(format!("round trip {n}: the echo differs"));
        }
        worst = worst.max(t.elapsed());
        n += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok((n, worst))
}

/// Across wansim `t3-100ms-0.5`, a bulk stream and a SYNC round-trip loop stay exact through
/// a handover during a link outage (west, then east, each while the WAN is cut: the new
/// process takes up a link already suspended) and through handovers of both sides at once
/// (east hands over while west's new process is resuming the link).
#[test]
fn streams_ride_through_handovers_during_outages_and_while_the_peer_resumes() {
    if !wansim::available_or_skip("handovers during link outages across wansim") {
        return;
    }
    let wan = wansim::Wan::start(
        &format!("hoout{}", std::process::id() % 100_000),
        wansim::preset("t3-100ms-0.5").expect("preset"),
    )
    .expect("wansim");
    let east_ip = wansim::Site::East.addr();
    east_servers(&wan, east_ip.into());
    let l = wan
        .in_site(wansim::Site::East, move || {
            std::net::TcpListener::bind((east_ip, 9002))
        })
        .expect("east")
        .expect("bind");
    let srv = serve_on(l, hash_handler);
    let pair = wan_pair(
        &wan,
        &format!(
            "  - name: bulk\n    target: {srv}\n  - name: sync\n    target: {east_ip}:9000\n    class: latency\n"
        ),
        "  - name: bulk\n    listen: 127.0.0.1:0\n  - name: sync\n    listen: 127.0.0.1:0\n    class: latency\n",
        |_, y| link_lines(y, "  bandwidth: 45mbit\n  rtt: 100ms\n"),
    );
    let (west, east) = (&pair.west, &pair.east);
    let bulk = connect_in(&wan, west.bound("bulk"), "cubic");
    let sync = connect_in(&wan, west.bound("sync"), "cubic");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let bulk = std::thread::spawn(move || paced_client_on(bulk, 11, 24 << 20, 1 << 20, 2 << 20));
    let sync = {
        let stop = stop.clone();
        std::thread::spawn(move || sync_loop_on(sync, stop))
    };
    let mut successors = Successors(Vec::new());
    std::thread::sleep(3 * SEC);

    // West hands over while the WAN is down: its new process takes up a suspended link.
    wan.set_cut(true);
    std::thread::sleep(SEC);
    kill(west.pid() as i32, libc::SIGUSR2);
    let w1 = successor(west, 1);
    successors.0.push(w1);
    std::thread::sleep(2 * SEC);
    wan.set_cut(false);
    west.wait_log_n("took the link's streams over", 1, 30 * SEC);
    std::thread::sleep(3 * SEC);

    // Both at once: east hands over while west's new process is resuming the link.
    kill(w1, libc::SIGUSR2);
    std::thread::sleep(Duration::from_millis(150));
    kill(east.pid() as i32, libc::SIGUSR2);
    let w2 = successor(west, 2);
    let e1 = successor(east, 1);
    successors.0.extend([w2, e1]);
    std::thread::sleep(4 * SEC);

    // East hands over while the WAN is down.
    wan.set_cut(true);
    std::thread::sleep(SEC);
    kill(e1, libc::SIGUSR2);
    let e2 = successor(east, 2);
    successors.0.push(e2);
    std::thread::sleep(2 * SEC);
    wan.set_cut(false);

    let b = bulk.join().expect("bulk thread");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let s = sync.join().expect("sync thread");
    let logs = || {
        format!(
            "--- west\n{}\n--- east\n{}",
            west.log().join("\n"),
            east.log().join("\n")
        )
    };
    assert!(b.is_ok(), "bulk: {b:?}\n{}", logs());
    let (rounds, worst) = s.unwrap_or_else(|e| panic!("sync: {e}\n{}", logs()));
    assert!(rounds > 50, "{rounds} round trips");
    for d in [west, east] {
        assert_eq!(d.count("stream failed"), 0, "{}", logs());
    }
    assert_eq!(west.count("took the link's streams over"), 2, "{}", logs());
    assert_eq!(east.count("took the link's streams over"), 2, "{}", logs());
    println!(
        "bulk exact, {rounds} SYNC round trips exact (slowest {:.0} ms, across two 3 s outages); west {w1} -> {w2}, east {e1} -> {e2}",
        worst.as_secs_f64() * 1000.0
    );
}
