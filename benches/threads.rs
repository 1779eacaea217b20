//! Does the default `limits.threads` ever lose to `threads: 1` (issue 36)? A fresh pair on
//! loopback stating a 1 Gbit/s link (both daemons, the client and the target on this host's
//! cores, as a new user first tries it) takes a first copy of each file given, once with the
//! default and once with `threads: 1`, alternating (each round swaps which goes first),
//! `--rounds` times; the best and the median rate of each, and their ratio, per file.
//!
//! Run: `cargo build --release --workspace && cargo bench --bench threads -- --file A --file B`
//! (real data: a `pg_basebackup -Ft` tar, and its first 48 MB, for instance). Options:
//! `--rounds N` (default 5), `--threads N` for the other side of the comparison (default 1),
//! `--streams N` to send each file cut in N parts on N connections at once (an RMAN
//! duplicate's channels; default 1), `--bandwidth B` for the stated link (default `1gbit`; a
//! slower one takes the stream-context path, as a WAN does).

#[path = "../tests/common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::path::PathBuf;
use std::time::Instant;

use common::{Pair, report};

/// MB/s of one first copy of `data` through a fresh pair whose `limits` get `threads`, stating
/// `bandwidth`, cut in `streams` parts sent on as many connections at once.
fn first_copy(data: &[u8], threads: Option<usize>, streams: usize, bandwidth: &str) -> f64 {
    let sink = common::server(|mut s| {
        let mut buf = vec![0u8; 1 << 20];
        let mut n = 0u64;
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(k) => n += k as u64,
            }
        }
        let _ = s.write_all(&n.to_le_bytes());
    });
    let extra = threads.map_or(String::new(), |t| format!("  threads: {t}\n"));
    let pair = Pair::start_link(
        &format!("  - name: b\n    target: {sink}\n"),
        "  - name: b\n    listen: 127.0.0.1:0\n",
        &extra,
        &format!("\n  bandwidth: {bandwidth}\n  rtt: 1ms"),
    );
    let addr = pair.west.bound("b");
    let parts: Vec<&[u8]> = data
        .chunks(data.len().div_ceil(streams.max(1)).max(1))
        .collect();
    let t = Instant::now();
    std::thread::scope(|sc| {
        for part in &parts {
            sc.spawn(move || {
                let mut s = TcpStream::connect(addr).expect("connect");
                for piece in part.chunks(1 << 20) {
                    s.write_all(piece).expect("write");
                }
                s.shutdown(Shutdown::Write).expect("shutdown");
                let mut got = [0u8; 8];
                s.read_exact(&mut got).expect("the sink's count");
                assert_eq!(
                    u64::from_le_bytes(got),
                    part.len() as u64,
                    "the sink got less"
                );
            });
        }
    });
    let secs = t.elapsed().as_secs_f64();
    data.len() as f64 / secs / 1e6
}

fn stats(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() - 1], v[v.len() / 2])
}

fn main() {
    let args = common::args::Args::new();
    let rounds: usize = args.get("--rounds", 5);
    let other: usize = args.get("--threads", 1);
    let streams: usize = args.get("--streams", 1);
    let bandwidth = args.text("--bandwidth").unwrap_or_else(|| "1gbit".into());
    let files: Vec<PathBuf> = args.all("--file").into_iter().map(PathBuf::from).collect();
    if files.is_empty() {
        eprintln!("threads: give the data with --file F (one or more)");
        return;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    report::note(format!(
        "A fresh loopback pair stating {bandwidth} per first copy, sent as {streams} stream(s) at once; {rounds} rounds, the default (this host: {cores} cores) and `threads: {other}` alternating; MB/s of the client's bytes."
    ));
    for f in files {
        let data = std::fs::read(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        let (mut def, mut one) = (Vec::new(), Vec::new());
        // Each round swaps which goes first, so that whatever the copy before leaves behind
        // (memory given back, the scheduler's placement of four busy processes on the cores)
        // falls on both sides alike.
        for round in 0..rounds {
            let each = |threads: Option<usize>| first_copy(&data, threads, streams, &bandwidth);
            if round % 2 == 0 {
                def.push(each(None));
                one.push(each(Some(other)));
            } else {
                one.push(each(Some(other)));
                def.push(each(None));
            }
        }
        let (db, dm) = stats(def);
        let (ob, om) = stats(one);
        report::row(
            "First copies through the daemons",
            &[
                "file",
                "MB",
                "default best",
                "median",
                &format!("threads: {other} best"),
                "median",
                "default / other, best",
                "median",
            ],
            vec![
                f.file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                format!("{:.1}", data.len() as f64 / 1e6),
                format!("{db:.0}"),
                format!("{dm:.0}"),
                format!("{ob:.0}"),
                format!("{om:.0}"),
                format!("{:.2}", db / ob),
                format!("{:.2}", dm / om),
            ],
        );
    }
    report::finish("threads", "threads: the default against one thread");
}
