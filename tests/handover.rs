//! Restart without dropping a stream: `SIGUSR2` hands a running daemon to the binary at its
//! path (a new process that inherits the listeners and every client and target socket and
//! resumes the link), on either side and on both in turn, while streams move both ways. Every
//! stream must end byte-exact, and no client or target may see its connection drop.

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
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

/// A client of the hash server that sends `len` bytes at about `rate` bytes a second, so the
/// stream is mid-flight through the handovers, then checks the server's hash of them and its
/// reply of `reply` bytes.
fn paced_client(
    addr: SocketAddr,
    seed: u64,
    len: u64,
    rate: u64,
    reply: u64,
) -> Result<(), String> {
    let mut s = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(120))).ok();
    let mut hdr = [0u8; 16];
    hdr[..8].copy_from_slice(&seed.to_le_bytes());
    hdr[8..].copy_from_slice(&reply.to_le_bytes());
    s.write_all(&hdr).map_err(|e| format!("write: {e}"))?;
    let mut h = blake3::Hasher::new();
    let piece = 32 * 1024;
    let mut buf = vec![0u8; piece];
    let start = Instant::now();
    let mut off = 0u64;
    while off < len {
        let n = (len - off).min(piece as u64) as usize;
        fill(seed, off, &mut buf[..n]);
        s.write_all(&buf[..n])
            .map_err(|e| format!("stream {seed}: write at {off}: {e}"))?;
        h.update(&buf[..n]);
        off += n as u64;
        let due = start + Duration::from_secs_f64(off as f64 / rate as f64);
        if let Some(w) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(w);
        }
    }
    s.shutdown(Shutdown::Write)
        .map_err(|e| format!("shutdown: {e}"))?;
    let mut got = [0u8; 32];
    s.read_exact(&mut got)
        .map_err(|e| format!("stream {seed}: read hash: {e}"))?;
    if got != *h.finalize().as_bytes() {
        return Err(format!("stream {seed}: the server hashed different bytes"));
    }
    let (n, hash) = read_all(&mut s).map_err(|e| format!("stream {seed}: read reply: {e}"))?;
    if n != reply || hash != pattern_hash(seed ^ 0xABCD, reply) {
        return Err(format!(
            "stream {seed}: the reply of {n} bytes differs (expected {reply})"
        ));
    }
    Ok(())
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
