//! What a lost link connection costs the data after it. A copy that repeats earlier data is
//! cheap only while the caches hold what went before; a resumption that restarts them sends it
//! whole again. A pair on loopback, its link through a relay that cuts it as a failing path
//! would (both daemons see the connection die), west stating a T3 (45 Mbit/s: the codec a WAN
//! link takes, zstd in each stream's context), sends a first copy of real data (a tar of the
//! host's shared libraries, or `--file`), the link cut half way through it; then a changed copy
//! of it (a 2 KiB block rewritten in every 256 KiB, as a database changes blocks in place
//! between two backups) on a new connection. The wire bytes of each copy are west's
//! `wanopt_link_wire_sent_bytes_total`; every copy is checked byte for byte at its target.
//!
//! Cases, each a fresh pair: no cut; a cut; and with `--old PATH` (a `wanoptd` built before
//! resumptions kept the caches, such as e4705b6) a cut with that build as both daemons.
//!
//! Run: `cargo build --release --workspace && cargo bench --bench outage -- [--mib 48]
//! [--file PATH] [--old PATH] [--write]`

#[path = "../tests/common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::sink::Sink;
use common::{Certs, Daemon, Relay, bin, east_yaml, report, scrape, server, site_yaml, value};

const MB: f64 = 1e6;

/// The first `mib` MiB of `file`, or of a tar of the host's shared libraries.
fn first_copy(file: Option<&str>, mib: usize) -> Vec<u8> {
    let want = mib << 20;
    let mut out = Vec::with_capacity(want);
    let mut child = match file {
        Some(f) => Command::new("head")
            .args(["-c", &want.to_string(), f])
            .stdout(Stdio::piped())
            .spawn()
            .expect("head"),
        None => Command::new("tar")
            .args(["-c", "-C", "/usr/lib/x86_64-linux-gnu", "."])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("tar"),
    };
    let mut r = child.stdout.take().expect("stdout").take(want as u64);
    r.read_to_end(&mut out).expect("read the data");
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        out.len() > (1 << 20),
        "too little data: {} bytes",
        out.len()
    );
    out
}

/// The first copy with a 2 KiB block rewritten in every 256 KiB, at a place of its own, with
/// bytes from elsewhere in the copy.
fn changed_copy(first: &[u8]) -> Vec<u8> {
    const EVERY: usize = 256 << 10;
    const BLOCK: usize = 2 << 10;
    let mut v = first.to_vec();
    let n = first.len();
    for (i, at) in (0..n.saturating_sub(EVERY)).step_by(EVERY).enumerate() {
        let k = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let off = at + (k >> 40) as usize % (EVERY - BLOCK);
        let from = (k >> 20) as usize % (n - BLOCK);
        v.copy_within(from..from + BLOCK, off);
    }
    v
}

/// Sends `bytes` as stream `id` to the sink behind `addr`; checks the sink's hash of them.
fn copy(addr: SocketAddr, id: u64, bytes: &[u8]) -> Result<(), String> {
    let mut s = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    s.write_all(&id.to_le_bytes())
        .and_then(|()| s.write_all(bytes))
        .and_then(|()| s.shutdown(Shutdown::Write))
        .map_err(|e| format!("copy {id}: {e}"))?;
    let mut got = [0u8; 32];
    s.read_exact(&mut got)
        .map_err(|e| format!("copy {id}: no hash: {e}"))?;
    if got != *blake3::hash(bytes).as_bytes() {
        return Err(format!("copy {id} arrived changed"));
    }
    Ok(())
}

/// What one case measured.
struct Case {
    first: u64,
    changed: u64,
    resent: u64,
    replayed: u64,
    outage: Option<Duration>,
}

/// A fresh pair of `exe`; the first copy (cut half way if `cut`), then the changed copy.
fn run(exe: &Path, cut: bool, first: &[u8], changed: &[u8]) -> Case {
    let sink = Arc::new(Sink::default());
    let target = {
        let sink = sink.clone();
        server(move |s| sink.take(s))
    };
    let certs = Certs::new(&["west", "east"]);
    let admin = "admin:\n  listen: 127.0.0.1:0\n";
    let services = format!("  - name: bulk\n    target: {target}\n");
    let east_cfg = east_yaml(&certs, &services) + admin;
    let east = Daemon::start_bin(exe, None, "east", &east_cfg, &[]);
    let relay = Relay::new(east.bound("link"));
    let west = Daemon::start_bin(
        exe,
        None,
        "west",
        &site_yaml(
            "west",
            "east",
            &format!("connect: {}\n  bandwidth: 45mbit", relay.addr),
            &certs,
            "  - name: bulk\n    listen: 127.0.0.1:0\n",
            admin,
        ),
        &[],
    );
    west.wait_log("link up", Duration::from_secs(10));
    let (bulk, metrics) = (west.bound("bulk"), west.bound("admin"));
    let wire = || value(&scrape(metrics), "wanopt_link_wire_sent_bytes_total ");
    let w0 = wire();
    let sending = {
        let first = first.to_vec();
        std::thread::spawn(move || copy(bulk, 1, &first))
    };
    let mut outage = None;
    if cut {
        let arrived = sink.counter(1);
        let half = first.len() as u64 / 2;
        let end = Instant::now() + Duration::from_secs(300);
        while arrived.load(Ordering::Relaxed) < half {
            assert!(Instant::now() < end, "the first copy stalled");
            std::thread::sleep(Duration::from_millis(5));
        }
        let t = Instant::now();
        relay.cut();
        west.wait_log("link resumed", Duration::from_secs(60));
        outage = Some(t.elapsed());
    }
    sending.join().expect("first copy").expect("first copy");
    let w1 = wire();
    copy(bulk, 2, changed).expect("changed copy");
    let w2 = wire();
    let m = scrape(metrics);
    for d in [&west, &east] {
        assert_eq!(d.count("stream failed"), 0, "{}", d.log().join("\n"));
    }
    Case {
        first: w1 - w0,
        changed: w2 - w1,
        resent: value(&m, "wanopt_link_resent_bytes_total "),
        replayed: value(&m, "wanopt_link_replayed_bytes_total "),
        outage,
    }
}

fn main() {
    let args = common::args::Args::new();
    let mib: usize = args.get("--mib", 48);
    let file = args.text("--file");
    let old = args.text("--old").map(PathBuf::from);
    let first = first_copy(file.as_deref(), mib);
    let changed = changed_copy(&first);
    let what = file
        .as_deref()
        .unwrap_or("a tar of /usr/lib/x86_64-linux-gnu");
    report::note(format!(
        "A first copy of {:.1} MB ({what}), then a changed copy of it (2 KiB rewritten in \
         every 256 KiB), through a fresh pair on loopback for each case, west stating 45 Mbit/s; \
         the link's connections cut through a relay half way through the first copy. Wire MB \
         are west's; `zstd -9` of the changed copy alone is {:.2} MB.",
        first.len() as f64 / MB,
        zstd_alone(&changed) as f64 / MB
    ));
    let now = bin("wanoptd");
    let mut cases = vec![
        ("this build, no cut", now.clone(), false),
        ("this build, cut", now, true),
    ];
    if let Some(old) = old {
        cases.push(("--old, cut", old, true));
    }
    let table = "What a cut costs the copies";
    let header = [
        "case",
        "first copy wire MB",
        "changed copy wire MB",
        "changed wire/raw",
        "sent again after the cut",
        "resumed after ms",
    ];
    for (name, exe, cut) in cases {
        let c = run(&exe, cut, &first, &changed);
        let again = if !cut {
            "-".to_string()
        } else if c.replayed > 0 {
            format!("{:.2} MB replayed (caches kept)", c.replayed as f64 / MB)
        } else {
            format!(
                "{:.2} MB of streams (caches restarted)",
                c.resent as f64 / MB
            )
        };
        report::row(
            table,
            &header,
            vec![
                name.into(),
                format!("{:.2}", c.first as f64 / MB),
                format!("{:.2}", c.changed as f64 / MB),
                format!("{:.3}", c.changed as f64 / changed.len() as f64),
                again,
                c.outage
                    .map_or("-".into(), |d| format!("{:.0}", d.as_secs_f64() * 1e3)),
            ],
        );
    }
    report::finish(
        "outage",
        "outage: what a lost connection costs the copies after it",
    );
}

/// `zstd -9` of `bytes` alone, in bytes (0 if zstd is not installed).
fn zstd_alone(bytes: &[u8]) -> usize {
    let Ok(mut child) = Command::new("zstd")
        .args(["-9", "-c", "-T0"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
    else {
        return 0;
    };
    let mut stdin = child.stdin.take().expect("stdin");
    let input = bytes.to_vec();
    let feeder = std::thread::spawn(move || stdin.write_all(&input));
    let mut out = Vec::new();
    let _ = child.stdout.take().expect("stdout").read_to_end(&mut out);
    let _ = feeder.join();
    let _ = child.wait();
    out.len()
}
