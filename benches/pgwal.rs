//! Real redo: a PostgreSQL primary's WAL, streamed by `pg_receivewal` through the wanopt pair as
//! a standby would pull it, under two workloads: pgbench's TPC-B-like one (rows of blank filler)
//! and an order entry after Swingbench's new order process, the load of F5's Data Guard test.
//! Reports the tunnel's wire bytes over raw bytes from its counters, with the replication
//! connection in clear inside the tunnel and, for contrast, with its own TLS
//! (`sslmode=require`), which leaves nothing to compress. The daemons state a 45 Mbit/s link, so the encoder works as it would on the F5
//! brief's T3 (loopback carries the bytes). Every complete segment received is checked against
//! the server's own file.
//!
//! Then a standby catching up across a wansim WAN (default `t3-100ms-0.5`, the F5 brief's link),
//! like the brief's "Streams catch-up": pgbench writes for a while with no standby connected (a
//! replication slot keeps the WAL), then `pg_receivewal` in the west site fetches the backlog
//! directly (the server's sending socket set to CUBIC, then BBR) or through the wanopt pair, and
//! the time until it holds the last segment is measured.
//!
//! Needs a PostgreSQL server, as `.ci/run` starts one: `WANOPT_PG_PORT=5432 PGPASSWORD=...`,
//! run as root (the server's WAL files are read for the check; wansim needs namespaces).
//! Run: `cargo build --release --workspace && cargo bench --bench pgwal`
//! Options: `-- --scale N` (default 10: pgbench's scale, or 10,000 customers each for orders),
//! `--seconds N` (each ratio run's load, default 30), `--clients N` (default 4),
//! `--workload orders|tpcb` (the catch-up's, default orders), `--backlog-seconds N` (load that
//! builds the catch-up backlog, default 5), `--limit N` (seconds a catch-up may take, default
//! 240), `--preset NAME`, `--only ratio|wan`.

#[path = "../tests/common/mod.rs"]
mod common;

use std::io::Write;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::args::Args;
use common::pg::{self, Backlog, WalLoad, Workload};
use common::{Pair, link_lines, report, wan_pair};
use wansim::{Site, Wan};

fn main() {
    let Some(port) = pg::port() else { return };
    let args = Args::new();
    let (scale, seconds, clients) = (
        args.get("--scale", 10),
        args.get("--seconds", 30),
        args.get("--clients", 4),
    );
    let only = args.choice("--only", &["all", "ratio", "wan"], "all");
    let workload = args.get("--workload", Workload::Orders);
    if only != "wan" {
        ratio(port, scale, seconds, clients);
    }
    if only != "ratio" {
        let load = Backlog {
            workload,
            scale,
            clients,
            seconds: args.get("--backlog-seconds", 5),
            limit: Duration::from_secs(args.get("--limit", 240)),
        };
        let preset = args.get("--preset", "t3-100ms-0.5".to_string());
        catch_up_across_wan(port, &load, &preset);
    }
    report::finish("pgwal", "pgwal: PostgreSQL WAL through the pair");
}

/// WAL's wire/raw through the pair, in clear and with PostgreSQL's own TLS.
fn ratio(port: u16, scale: u32, seconds: u32, clients: u32) {
    let t = format!(
        "PostgreSQL WAL through the tunnel: scale {scale}, {clients} clients, {seconds} s each; stated link 45 Mbit/s"
    );
    let h = [
        "replication connection",
        "tps",
        "raw MB",
        "wire MB",
        "wire/raw",
        "segments",
    ];
    for (title, workload, ssl) in [
        ("tpcb, in clear inside the tunnel", Workload::Tpcb, false),
        (
            "orders, in clear inside the tunnel",
            Workload::Orders,
            false,
        ),
        ("orders, with its own TLS", Workload::Orders, true),
    ] {
        let pair = Pair::start_link(
            &format!("  - name: pg\n    target: 127.0.0.1:{port}\n"),
            "  - name: pg\n    listen: 127.0.0.1:0\n",
            "admin:\n  listen: 127.0.0.1:0\n",
            "\n  bandwidth: 45mbit\n  rtt: 100ms",
        );
        let load = WalLoad {
            workload,
            scale,
            clients,
            seconds,
            ssl,
            db: "wanopt_bench_wal",
        };
        match pg::stream_wal(&pair, port, &load) {
            Ok(r) => report::row(
                &t,
                &h,
                vec![
                    title.into(),
                    format!("{:.0}", r.tps),
                    format!("{:.1}", r.raw as f64 / 1e6),
                    format!("{:.1}", r.wire as f64 / 1e6),
                    format!("{:.4}", r.wire as f64 / r.raw.max(1) as f64),
                    r.segments.to_string(),
                ],
            ),
            Err(e) => report::note(format!("{title}: failed: {e}")),
        }
    }
}

/// The backlog's catch-up time across the WAN: direct (CUBIC, BBR) and through the pair.
fn catch_up_across_wan(port: u16, load: &Backlog, preset: &str) {
    if !wansim::available_or_skip("PostgreSQL catch-up across wansim") {
        return;
    }
    let params = wansim::preset(preset).expect("preset");
    let (stated, stated_words) = wanopt_replay::showcase::stated_link(&params);
    let wan = Wan::start(&format!("pg{}", std::process::id() % 100_000), params).expect("wansim");
    // The server is on this host's loopback; a relay in the east site stands in for it there.
    // Its sockets face the WAN on the direct paths, so it sets their congestion control.
    let east_ip = std::net::IpAddr::V4(Site::East.addr());
    let l = wan
        .in_site(Site::East, move || TcpListener::bind((east_ip, 0)))
        .expect("east")
        .expect("bind the relay");
    let relay = l.local_addr().expect("relay address");
    let congestion: Arc<Mutex<Option<&'static str>>> = Arc::new(Mutex::new(None));
    let cc = congestion.clone();
    std::thread::spawn(move || {
        for s in l.incoming().map_while(Result::ok) {
            let cc = *cc.lock().expect("congestion");
            if let Some(name) = cc {
                socket2::SockRef::from(&s)
                    .set_tcp_congestion(name.as_bytes())
                    .expect("set congestion control");
            }
            let _ = s.set_nodelay(true);
            if let Ok(up) = TcpStream::connect(("127.0.0.1", port)) {
                let _ = up.set_nodelay(true);
                pipe(s, up);
            }
        }
    });
    let db = "wanopt_bench_catchup";
    pg::prepare(port, db, load.workload, load.scale).expect("prepare the database");
    let pair = wan_pair(
        &wan,
        &format!("  - name: pg\n    target: {relay}\n"),
        "  - name: pg\n    listen: 127.0.0.1:0\n",
        |_, y| link_lines(y, &stated),
    );
    let tunnel = pair.west.bound("pg");
    let t = format!(
        "`{preset}` ({stated_words}): a standby fetching {} s of {} WAL ({} clients) it missed; limit {} s",
        load.seconds,
        load.workload.name(),
        load.clients,
        load.limit.as_secs()
    );
    let h = [
        "path",
        "backlog MB",
        "catch-up s",
        "MB/s",
        "speedup",
        "segments",
    ];
    let mut base = None;
    for (i, (name, addr, cc)) in [
        ("direct cubic", relay, Some("cubic")),
        ("direct bbr", relay, Some("bbr")),
        ("wanopt", tunnel, None),
    ]
    .into_iter()
    .enumerate()
    {
        *congestion.lock().expect("congestion") = cc;
        let conninfo = format!(
            "host={} port={} user=postgres sslmode=disable",
            addr.ip(),
            addr.port()
        );
        let r = pg::catch_up(
            port,
            db,
            load,
            wan.command(Site::West, "pg_receivewal"),
            &conninfo,
            &format!("wanopt_bench_{i}"),
        );
        match r {
            Ok(r) => {
                let mb = r.backlog as f64 / 1e6;
                let secs = r.seconds.unwrap_or(load.limit.as_secs_f64());
                // Cut off by the limit: the rate of what had arrived by then.
                let rate = r.received as f64 / 1e6 / secs;
                let base_rate = *base.get_or_insert(rate);
                report::row(
                    &t,
                    &h,
                    vec![
                        name.into(),
                        format!("{mb:.1}"),
                        r.seconds
                            .map_or_else(|| format!("> {secs:.0}"), |s| format!("{s:.1}")),
                        format!("{rate:.2}"),
                        if base_rate > 0.0 {
                            format!("{:.1}x", rate / base_rate)
                        } else {
                            "-".into()
                        },
                        r.segments.to_string(),
                    ],
                );
            }
            Err(e) => report::note(format!("{name}: failed: {e}")),
        }
        let _ = std::io::stdout().flush();
    }
    let _ = pg::psql(port, "postgres", &format!("DROP DATABASE IF EXISTS {db}"));
    let (a, b) = wan.counters();
    report::note(format!("wansim west→east: {a}; east→west: {b}."));
}

/// Copies both ways between two sockets until each side ends.
fn pipe(a: TcpStream, b: TcpStream) {
    for (mut from, mut to) in [
        (a.try_clone().expect("clone"), b.try_clone().expect("clone")),
        (b, a),
    ] {
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut from, &mut to);
            let _ = to.shutdown(Shutdown::Write);
        });
    }
}
