//! The appliance comparison: `wanopt-replay compare` across a wansim WAN (default `t3-100ms-0.5`:
//! 45 Mbit/s, 100 ms RTT, 0.5% loss, the F5 brief's setting), direct with CUBIC (a stock host),
//! direct with BBR, and through the wanopt pair. Workloads come from `wanopt-replay gen`: redo
//! (Data Guard ASYNC-like streaming), an RMAN backup sent twice (the second is a repeated
//! duplicate), and 8 KiB SYNC round trips.
//!
//! With `--file PATH` (repeatable), the first `--mib` MiB of each file (a real backup, WAL or
//! binlog) is a first-copy workload too. With OpenSSH's server installed (`openssh-server`), an
//! `ssh -C -L` tunnel across the same WAN is a path of its own: what a DBA would use instead.
//!
//! Run (as root): `cargo build --release --workspace && cargo bench --bench compare`
//! Options: `-- --preset NAME --mib N` (default 16 MiB per streaming workload), `--only WORD`
//! (the workloads with a word in their title that starts with WORD, such as `sync`),
//! `--sync-seconds N` (default 20), `--file PATH`, `--svg FILE` (the chart; default
//! `benches/charts/compare-PRESET.svg`).

#[path = "../tests/common/mod.rs"]
mod common;

use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{link_lines, report, wan_pair};
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
    let params = wansim::preset(&preset).expect("preset");
    // The pair states the preset's own figures: a cap at 95% of a wrong bandwidth would
    // throttle every stream.
    let (stated, stated_words) = wanopt_replay::showcase::stated_link(&params);
    let wan = Wan::start(&format!("wc{}", std::process::id() % 100_000), params).expect("wansim");
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
                &stated,
            ),
            _ => format!("{y}optimize:\n  memory: 1GiB\n"),
        },
    );
    let west = &p.west;
    let keys = tempfile::tempdir().expect("tempdir");
    let ssh = ssh_tunnel(&wan, east_ip, keys.path());
    let (tunnel, admin) = (west.bound("bench"), west.bound("admin"));
    let sync = west.bound("sync");
    let direct = SocketAddr::new(east_ip, 5555);
    let mut paths = vec![
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
    match &ssh {
        Some((addr, _)) => paths.push(PathSpec {
            name: "ssh-c".into(),
            addr: addr.to_string(),
            congestion: None,
            metrics: None,
        }),
        None => {
            report::note("No `ssh -C` path: OpenSSH's server (openssh-server) is not installed.")
        }
    }
    report::note(format!(
        "`{preset}`: direct (CUBIC, BBR) against the wanopt pair{} ({stated_words}); one run, same workloads.",
        if ssh.is_some() {
            " and an `ssh -C` tunnel (the namespace's default congestion control)"
        } else {
            ""
        }
    ));
    // (title, short name for the chart, workload, service)
    let mut workloads = vec![
        (
            "redo (gen redo, streamed like ASYNC transport)".to_string(),
            "redo".to_string(),
            format!("gen:redo:{mib}m"),
            "bench",
        ),
        (
            "RMAN backup, first copy (gen rman)".to_string(),
            "RMAN first copy".to_string(),
            format!("gen:rman:{}m", mib * 2),
            "bench",
        ),
        (
            "RMAN backup, the same again (a repeated duplicate)".to_string(),
            "RMAN repeat".to_string(),
            format!("gen:rman:{}m", mib * 2),
            "bench",
        ),
        (
            "SYNC 8 KiB round trips (a latency-class service)".to_string(),
            "SYNC 8 KiB".to_string(),
            format!("oratcp:-mode=sync -length=8k -duration={sync_secs}s"),
            "sync",
        ),
    ];
    // Real files, first copies: the first `mib` MiB of each.
    for (i, f) in args.all("--file").iter().enumerate() {
        let data = std::fs::read(f).unwrap_or_else(|e| panic!("--file {f}: {e}"));
        let slice = &data[..data.len().min(mib << 20)];
        let path = keys.path().join(format!("file{i}"));
        std::fs::write(&path, slice).expect("slice");
        let short = Path::new(f)
            .file_name()
            .map_or_else(|| f.clone(), |n| n.to_string_lossy().into_owned());
        workloads.push((
            format!("{f}: first {} MiB, a first copy", slice.len() >> 20),
            short,
            format!("file:{}", path.display()),
            "bench",
        ));
    }
    let mut runs = Vec::new();
    for (title, short, spec, service) in workloads {
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
            report::note(format!(
                "Link connections in use: {lanes} (2: the latency lane is up)."
            ));
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
        let header: Vec<&str> = compare::COLUMNS.iter().map(|(h, _)| *h).collect();
        for r in &rows {
            report::row(&title, &header, compare::cells(r));
        }
        runs.push((short, rows));
    }
    if let Some((_, mut children)) = ssh {
        for c in children.iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
    let (a, b) = wan.counters();
    report::note(format!("wansim west→east: {a}; east→west: {b}."));
    if !runs.is_empty() {
        let svg = args.get("--svg", format!("benches/charts/compare-{preset}.svg"));
        let _ = std::fs::create_dir_all(Path::new(&svg).parent().unwrap_or(Path::new(".")));
        let title = format!("{preset}: throughput per path ({stated_words})");
        compare::write_svg(Path::new(&svg), &title, &runs).expect("chart");
        report::note(format!("Chart: `{svg}`."));
    }
    report::finish("compare", "compare: the reference comparison across wansim");
}

/// An `ssh -C -L` tunnel from west to the test server in east: sshd in east with keys made for
/// the run, ssh in west forwarding a local port. `None` if OpenSSH's server is missing.
fn ssh_tunnel(wan: &Wan, east: IpAddr, dir: &Path) -> Option<(SocketAddr, Vec<Child>)> {
    let sshd = Path::new("/usr/sbin/sshd");
    if !sshd.exists() {
        return None;
    }
    let run = |args: &[&str]| {
        let ok = Command::new("ssh-keygen")
            .args(args)
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "ssh-keygen {args:?}");
    };
    let (host, id) = (dir.join("host"), dir.join("id"));
    run(&[
        "-q",
        "-t",
        "ed25519",
        "-N",
        "",
        "-f",
        &host.to_string_lossy(),
    ]);
    run(&["-q", "-t", "ed25519", "-N", "", "-f", &id.to_string_lossy()]);
    std::fs::copy(dir.join("id.pub"), dir.join("authorized_keys")).expect("keys");
    let conf = dir.join("sshd_config");
    std::fs::write(
        &conf,
        format!(
            "ListenAddress {east}:2222\nHostKey {}\nAuthorizedKeysFile {}\nPidFile {}\n\
             StrictModes no\nUsePAM no\nPasswordAuthentication no\nPermitRootLogin yes\n\
             AllowTcpForwarding yes\nCompression yes\n",
            host.display(),
            dir.join("authorized_keys").display(),
            dir.join("sshd.pid").display()
        ),
    )
    .expect("sshd_config");
    // sshd's privilege separation directory.
    let _ = std::fs::create_dir_all("/run/sshd");
    let conf_s = conf.to_string_lossy().into_owned();
    let server = wan
        .in_site(Site::East, move || {
            Command::new("/usr/sbin/sshd")
                .args(["-D", "-e", "-f", &conf_s])
                .stderr(Stdio::null())
                .spawn()
        })
        .expect("east")
        .expect("sshd");
    let local: SocketAddr = "127.0.0.1:15622".parse().expect("addr");
    let id_s = id.to_string_lossy().into_owned();
    let client = wan
        .in_site(Site::West, move || {
            // Give sshd a moment to listen.
            std::thread::sleep(Duration::from_millis(500));
            Command::new("ssh")
                .args([
                    "-C",
                    "-N",
                    "-o",
                    "StrictHostKeyChecking=no",
                    "-o",
                    "UserKnownHostsFile=/dev/null",
                    "-o",
                    "BatchMode=yes",
                    "-i",
                    &id_s,
                    "-p",
                    "2222",
                    "-L",
                    &format!("{local}:{east}:5555"),
                    &format!("root@{east}"),
                ])
                .stderr(Stdio::null())
                .spawn()
        })
        .expect("west")
        .expect("ssh");
    let up = wan
        .in_site(Site::West, move || {
            let end = Instant::now() + Duration::from_secs(15);
            while Instant::now() < end {
                if TcpStream::connect(local).is_ok() {
                    return true;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            false
        })
        .expect("west");
    assert!(up, "the ssh -C tunnel did not come up");
    Some((local, vec![client, server]))
}
