//! The appliance comparison: `wanopt-replay compare` across a wansim WAN (default `t3-100ms-0.5`:
//! 45 Mbit/s, 100 ms RTT, 0.5% loss, the F5 brief's setting), direct with CUBIC (a stock host),
//! direct with BBR, and through the wanopt pair. Workloads come from `wanopt-replay gen`: redo
//! (Data Guard ASYNC-like streaming), an RMAN backup sent twice (the second is a repeated
//! duplicate), and 8 KiB SYNC round trips.
//!
//! Run (as root): `cargo build --release --workspace && cargo bench --bench compare`
//! Options: `-- --preset NAME --mib N` (default 16 MiB per streaming workload), `--only WORD`
//! (the workloads with a word in their title that starts with WORD, such as `sync`),
//! `--sync-seconds N` (default 20).

#[path = "../tests/common/mod.rs"]
mod common;

use std::net::{SocketAddr, TcpListener};

use common::{link_lines, wan_pair};
use wanopt_replay::compare::{self, Job, PathSpec};
use wanopt_replay::server::{self, ServerOpts};
use wansim::{Site, Wan};

fn main() {
    if !wansim::available_or_skip("compare across wansim") {
        return;
    }
    let args = common::args::Args::new();
    let preset = args.get("--preset", "t3-100ms-0.5".to_string());
    let mib: usize = args.get("--mib", 16);
    let only = args.text("--only").map(|w| w.to_lowercase());
    // About ten round trips a second at 100 ms: p99 of a 20 s run is its second-worst sample.
    let sync_secs: u32 = args.get("--sync-seconds", 20);
    let wan = Wan::start(
        &format!("wc{}", std::process::id() % 100_000),
        wansim::preset(&preset).expect("preset"),
    )
    .expect("wansim");
    let east_ip = std::net::IpAddr::V4(Site::East.addr());
    // The test server, in east.
    let opts = ServerOpts {
        bind: SocketAddr::new(east_ip, 5555),
        file: std::env::temp_dir().join("wanopt-bench-oratcp.tmp"),
        sockbuf: None,
    };
    let l: TcpListener = {
        let o = opts.clone();
        wan.in_site(Site::East, move || server::bind(&o))
            .expect("east")
            .expect("bind")
    };
    std::thread::spawn(move || server::serve(l, &opts));

    let p = wan_pair(
        &wan,
        &format!(
            "  - name: bench\n    target: {east_ip}:5555\n  - name: sync\n    target: {east_ip}:5555\n    class: latency\n"
        ),
        "  - name: bench\n    listen: 127.0.0.1:0\n  - name: sync\n    listen: 127.0.0.1:0\n    class: latency\n",
        |site, y| match site {
            "west" => link_lines(
                format!("{y}admin:\n  listen: 127.0.0.1:0\noptimize:\n  memory: 1GiB\n"),
                "  bandwidth: 45mbit\n  rtt: 100ms\n",
            ),
            _ => format!("{y}optimize:\n  memory: 1GiB\n"),
        },
    );
    let west = &p.west;
    let (tunnel, admin) = (west.bound("bench"), west.bound("admin"));
    let sync = west.bound("sync");
    let direct = SocketAddr::new(east_ip, 5555);
    let paths = vec![
        PathSpec {
            name: "direct-cubic".into(),
            addr: direct.to_string(),
            congestion: Some("cubic".into()),
            metrics: None,
        },
        PathSpec {
            name: "direct-bbr".into(),
            addr: direct.to_string(),
            congestion: Some("bbr".into()),
            metrics: None,
        },
        PathSpec {
            name: "wanopt".into(),
            addr: tunnel.to_string(),
            congestion: None,
            metrics: Some(format!("http://{admin}/metrics")),
        },
    ];
    println!("{preset}: direct (CUBIC, BBR) against the wanopt pair; one run, same workloads\n");
    let workloads = [
        (
            "redo (gen redo, streamed like ASYNC transport)",
            format!("gen:redo:{mib}m"),
            "bench",
        ),
        (
            "RMAN backup, first copy (gen rman)",
            format!("gen:rman:{}m", mib * 2),
            "bench",
        ),
        (
            "RMAN backup, the same again (a repeated duplicate)",
            format!("gen:rman:{}m", mib * 2),
            "bench",
        ),
        (
            "SYNC 8 KiB round trips (a latency-class service)",
            format!("oratcp:-mode=sync -length=8k -duration={sync_secs}s"),
            "sync",
        ),
    ];
    for (title, spec, service) in workloads {
        if only.as_ref().is_some_and(|w| {
            // Whole words from their start: `sync` must not pick the ASYNC-like redo.
            !title
                .to_lowercase()
                .split(|c: char| !c.is_alphanumeric())
                .any(|word| word.starts_with(w.as_str()))
        }) {
            continue;
        }
        if service == "sync" {
            // Which connection carries latency-class streams decides their delay: give the
            // latency lane a moment to come up, and say whether it did.
            let lanes = wan
                .in_site(Site::West, move || {
                    let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
                    loop {
                        let n = common::value(&common::scrape(admin), "wanopt_link_lanes ");
                        if n >= 2 || std::time::Instant::now() > end {
                            return n;
                        }
                        std::thread::sleep(std::time::Duration::from_millis(100));
                    }
                })
                .expect("west");
            println!("link connections in use: {lanes} (2: the latency lane is up)");
        }
        let job: Job = compare::parse_job(&spec).expect("workload");
        let mut p = paths.clone();
        if service == "sync" {
            p[2].addr = sync.to_string();
        }
        let rows = wan
            .in_site(Site::West, move || {
                compare::compare(&p, &job, Some(service))
            })
            .expect("west")
            .expect("compare");
        println!("{title}\n{}", compare::table(&rows));
    }
    let (a, b) = wan.counters();
    println!("wansim west->east: {a}\nwansim east->west: {b}");
}
