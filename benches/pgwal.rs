//! Real redo: a PostgreSQL primary's WAL under `pgbench` (TPC-B-like), streamed by
//! `pg_receivewal` through the wanopt pair as a standby would pull it. Reports the tunnel's wire
//! bytes over raw bytes from its counters, with the replication connection in clear inside the
//! tunnel and, for contrast, with its own TLS (`sslmode=require`), which leaves nothing to
//! compress. The daemons state a 45 Mbit/s link, so the encoder works as it would on the F5
//! brief's T3 (loopback carries the bytes). Every complete segment received is checked against
//! the server's own file.
//!
//! Needs a PostgreSQL server, as `.ci/run` starts one: `WANOPT_PG_PORT=5432 PGPASSWORD=...`,
//! run as root (the server's WAL files are read for the check).
//! Run: `cargo build --release --workspace && cargo bench --bench pgwal`
//! Options: `-- --scale N` (pgbench scale, default 10), `--seconds N` (default 30),
//! `--clients N` (default 4).

#[path = "../tests/common/mod.rs"]
mod common;

use common::Pair;
use common::pg::{self, WalLoad};

fn main() {
    let Some(port) = pg::port() else { return };
    let args: Vec<String> = std::env::args().collect();
    let get = |k: &str, d: u32| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let (scale, seconds, clients) = (
        get("--scale", 10),
        get("--seconds", 30),
        get("--clients", 4),
    );
    println!(
        "PostgreSQL WAL through the tunnel: pgbench scale {scale}, {clients} clients, {seconds} s; stated link 45 Mbit/s"
    );
    println!(
        "{:<34} {:>8} {:>9} {:>9} {:>9} {:>9}",
        "replication connection", "tps", "raw MB", "wire MB", "wire/raw", "segments"
    );
    for (title, ssl) in [
        ("in clear inside the tunnel", false),
        ("with its own TLS (sslmode=require)", true),
    ] {
        let pair = Pair::start_link(
            &format!("  - name: pg\n    target: 127.0.0.1:{port}\n"),
            "  - name: pg\n    listen: 127.0.0.1:0\n",
            "admin:\n  listen: 127.0.0.1:0\n",
            "\n  bandwidth: 45mbit\n  rtt: 100ms",
        );
        let load = WalLoad {
            scale,
            clients,
            seconds,
            ssl,
            db: "wanopt_bench_wal",
        };
        match pg::stream_wal(&pair, port, &load) {
            Ok(r) => println!(
                "{:<34} {:>8.0} {:>9.1} {:>9.1} {:>9.4} {:>9}",
                title,
                r.tps,
                r.raw as f64 / 1e6,
                r.wire as f64 / 1e6,
                r.wire as f64 / r.raw.max(1) as f64,
                r.segments
            ),
            Err(e) => println!("{title:<34} failed: {e}"),
        }
    }
}
