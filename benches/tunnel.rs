//! Tunnel core benchmark, all paths in one run on loopback: one bulk stream's throughput and an
//! 8 KiB request/response round trip, through direct TCP (CUBIC set explicitly, and BBR), two
//! chained plain relays (the floor of any two-proxy path), a stunnel pair (TLS only, Debian's
//! `stunnel4`) and a wanoptd pair (optimization off). Prints a table and the ratios the
//! tunnel-core issue names. The sink and each plain relay are processes of their own (this binary
//! run again), like the daemons and stunnel; the last column is the relaying processes' CPU time
//! per round trip, a steadier figure than the latency on a noisy machine.
//!
//! Run: `cargo build --release --workspace && cargo bench --bench tunnel`
//! Options (after `--`): `--bytes N` per bulk run (default 2 GiB), `--rounds N` round trips
//! (default 20000, in 10 slices interleaved across the paths), `--repeat N` interleaved repetitions (default 3; the median is reported),
//! `--only PATH` to measure one path beside `direct cubic` (for profiling), `--optimize` to run the
//! pair with dedup and compression on. The tunnel's link uses
//! BBR like the shipped configs; `WANOPT_TEST_CONGESTION=cubic` sets another congestion control.
//!
//! On a VM whose idle vCPUs halt at once (`haltpoll.guest_halt_poll_ns=0`), waking a process on
//! the other vCPU dominates every path's round trip. `taskset -c 0 cargo bench --bench tunnel`
//! runs everything on one vCPU, which takes those wakeups out and leaves each path's own cost.

#[path = "../tests/common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Certs, Pair, report};

const RR_SIZE: usize = 8 * 1024;

/// A helper process: this bench's binary run again as `--child sink` or `--child relay TARGET`.
/// Every endpoint of a real path is its own process (the database server, each proxy), and a
/// switch between processes costs more than one between threads of one process, so the sink and
/// the plain relays run apart from the measuring client, like the daemons and stunnel.
struct Child2 {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Child2 {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_child(args: &[String]) -> Child2 {
    let exe = std::env::current_exe().expect("own path");
    let mut child = Command::new(exe)
        .arg("--child")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn helper process");
    let mut line = String::new();
    let out = child.stdout.take().expect("helper stdout");
    std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut line)
        .expect("helper address");
    let addr = line.trim().parse().expect("helper printed its address");
    Child2 { child, addr }
}

/// Runs as a helper process: serves until the parent closes our stdin (or kills us).
fn child_main(args: &[String]) {
    let addr = match args.first().map(String::as_str) {
        Some("sink") => sink(),
        Some("relay") => plain_relay(args[1].parse().expect("relay target")),
        _ => panic!("unknown helper {args:?}"),
    };
    println!("{addr}");
    let _ = std::io::stdout().flush();
    let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
    std::process::exit(0);
}

/// The sink: first byte selects the mode. `B`: read to EOF, answer the byte count.
/// `R`: echo fixed 8 KiB messages until EOF.
fn sink() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            let _ = s.set_nodelay(true);
            std::thread::spawn(move || {
                let mut mode = [0u8; 1];
                if s.read_exact(&mut mode).is_err() {
                    return;
                }
                if mode[0] == b'B' {
                    let mut buf = vec![0u8; 1 << 20];
                    let mut n = 0u64;
                    loop {
                        match s.read(&mut buf) {
                            Ok(0) => break,
                            Ok(k) => n += k as u64,
                            Err(_) => return,
                        }
                    }
                    let _ = s.write_all(&n.to_le_bytes());
                } else {
                    let mut buf = vec![0u8; RR_SIZE];
                    while s.read_exact(&mut buf).is_ok() {
                        if s.write_all(&buf).is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    addr
}

/// The floor of any relaying proxy: a plain TCP relay with a blocking thread per direction (no
/// event loop, no framing, no encryption). Two chained, each its own process, make the tunnel's
/// topology (client, west, east, target), so their added round-trip time is what two extra
/// loopback hops cost here.
fn plain_relay(target: SocketAddr) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(c) = c else { continue };
            let Ok(t) = TcpStream::connect(target) else {
                continue;
            };
            let _ = c.set_nodelay(true);
            let _ = t.set_nodelay(true);
            let (Ok(c2), Ok(t2)) = (c.try_clone(), t.try_clone()) else {
                continue;
            };
            for (mut from, mut to) in [(c, t), (t2, c2)] {
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        match from.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => {
                                if to.write_all(&buf[..n]).is_err() {
                                    break;
                                }
                            }
                        }
                    }
                    let _ = to.shutdown(std::net::Shutdown::Write);
                });
            }
        }
    });
    addr
}

fn connect(addr: SocketAddr, congestion: Option<&str>) -> TcpStream {
    let sock =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    if let Some(cc) = congestion {
        sock.set_tcp_congestion(cc.as_bytes())
            .expect("set congestion control");
    }
    sock.connect(&addr.into()).expect("connect");
    let s: TcpStream = sock.into();
    s.set_nodelay(true).expect("nodelay");
    s
}

/// Bytes per second of one bulk stream of `bytes`.
fn bulk(addr: SocketAddr, cc: Option<&str>, bytes: u64) -> f64 {
    let mut s = connect(addr, cc);
    let buf = vec![0x5Au8; 1 << 20];
    let start = Instant::now();
    s.write_all(b"B").expect("mode");
    let mut left = bytes;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        s.write_all(&buf[..n]).expect("write");
        left -= n as u64;
    }
    s.shutdown(std::net::Shutdown::Write).expect("fin");
    let mut count = [0u8; 8];
    s.read_exact(&mut count).expect("count");
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(
        u64::from_le_bytes(count),
        bytes,
        "sink counted a different number of bytes"
    );
    bytes as f64 / secs
}

/// Round-trip times of 8 KiB request/response pairs, sorted.
fn round_trips(addr: SocketAddr, cc: Option<&str>, rounds: usize) -> Vec<Duration> {
    let mut s = connect(addr, cc);
    s.write_all(b"R").expect("mode");
    let mut req = vec![7u8; RR_SIZE];
    let mut rsp = vec![0u8; RR_SIZE];
    let mut v = Vec::with_capacity(rounds);
    for i in 0..rounds + 100 {
        req[0] = i as u8;
        let t = Instant::now();
        s.write_all(&req).expect("request");
        s.read_exact(&mut rsp).expect("response");
        if i >= 100 {
            v.push(t.elapsed());
        }
        assert_eq!(rsp[0], i as u8);
    }
    v.sort();
    v
}

fn pct(v: &[Duration], p: f64) -> Duration {
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

struct Stunnel {
    children: Vec<Child>,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Drop for Stunnel {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// A stunnel client/server pair in front of `target`, one process per side like the daemons.
fn stunnel(certs: &Certs, target: SocketAddr) -> Option<Stunnel> {
    let exe = ["/usr/bin/stunnel4", "/usr/bin/stunnel"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())?;
    let dir = tempfile::tempdir().expect("tempdir");
    let (ps, pc) = (free_port(), free_port());
    let d = certs.path().display();
    let common =
        "foreground = yes\npid =\ndebug = 3\nsocket = l:TCP_NODELAY=1\nsocket = r:TCP_NODELAY=1\n";
    let server = format!(
        "{common}[srv]\naccept = 127.0.0.1:{ps}\nconnect = {target}\ncert = {d}/east.pem\nkey = {d}/east.key\n"
    );
    let client =
        format!("{common}[cli]\nclient = yes\naccept = 127.0.0.1:{pc}\nconnect = 127.0.0.1:{ps}\n");
    let mut children = Vec::new();
    for (name, conf) in [("server", server), ("client", client)] {
        let p = dir.path().join(format!("{name}.conf"));
        std::fs::write(&p, conf).expect("write stunnel config");
        children.push(
            Command::new(exe)
                .arg(&p)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn stunnel"),
        );
    }
    let addr: SocketAddr = format!("127.0.0.1:{pc}").parse().expect("addr");
    let end = Instant::now() + Duration::from_secs(10);
    for port in [ps, pc] {
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < end, "stunnel did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    Some(Stunnel {
        children,
        addr,
        _dir: dir,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--child") {
        return child_main(&args[i + 1..]);
    }
    let opts = common::args::Args::new();
    let bytes = opts.size("--bytes", 2 << 30);
    let rounds: usize = opts.get("--rounds", 20000);
    let repeat: usize = opts.get("--repeat", 3);
    let sink_proc = spawn_child(&["sink".into()]);
    let target = sink_proc.addr;
    // The comparison is the tunnel alone: optimization off (`--optimize` turns it on).
    let optimize = opts.flag("--optimize");
    let pair = Pair::start_extra(
        &format!(
            "  - name: bench\n    target: {target}\n  - name: sync\n    target: {target}\n    class: latency\n"
        ),
        "  - name: bench\n    listen: 127.0.0.1:0\n  - name: sync\n    listen: 127.0.0.1:0\n    class: latency\n",
        &format!("optimize:\n  enabled: {optimize}\n"),
    );
    let tunnel = pair.west.bound("bench");
    let st = stunnel(&pair.certs, target);
    if st.is_none() {
        eprintln!("stunnel4 is not installed (apt-get install stunnel4): its column is left out");
    }
    // (name, address, congestion control of the client socket, processes doing the relaying,
    // whether a bulk stream runs too)
    let relay_east = spawn_child(&["relay".into(), target.to_string()]);
    let relay_west = spawn_child(&["relay".into(), relay_east.addr.to_string()]);
    let relays = relay_west.addr;
    let daemons = vec![pair.west.pid(), pair.east.pid()];
    type Path<'a> = (&'a str, SocketAddr, Option<&'a str>, Vec<u32>, bool);
    let mut paths: Vec<Path> = vec![
        ("direct cubic", target, Some("cubic"), vec![], true),
        ("direct bbr", target, Some("bbr"), vec![], true),
        (
            "2 plain relays",
            relays,
            None,
            vec![relay_west.child.id(), relay_east.child.id()],
            true,
        ),
        ("wanopt", tunnel, None, daemons.clone(), true),
        // The same round trips through a latency-class service, which rides the latency lane.
        ("wanopt sync", pair.west.bound("sync"), None, daemons, false),
    ];
    if let Some(s) = &st {
        paths.insert(
            2,
            (
                "stunnel",
                s.addr,
                None,
                s.children.iter().map(Child::id).collect(),
                true,
            ),
        );
    }
    // `--only NAME` keeps one path (for profiling); ratios need `direct cubic` and the others.
    if let Some(only) = opts.text("--only") {
        paths.retain(|p| p.0 == only || p.0 == "direct cubic");
    }
    report::note(format!(
        "Loopback, one bulk stream of {} MiB x{repeat} (median), {rounds} round trips of 8 KiB, optimization {}.",
        bytes >> 20,
        if optimize { "on" } else { "off" }
    ));
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); paths.len()];
    let mut cpu = vec![0.0f64; paths.len()];
    for _ in 0..repeat {
        for (i, (_, addr, cc, pids, _)) in paths.iter().enumerate().filter(|p| p.1.4) {
            let before: f64 = pids.iter().map(|p| common::cpu_seconds(*p)).sum();
            rates[i].push(bulk(*addr, *cc, bytes));
            cpu[i] += pids.iter().map(|p| common::cpu_seconds(*p)).sum::<f64>() - before;
        }
    }
    // Round trips in interleaved slices, so a noisy moment of the machine hits every path alike.
    let slices = 10;
    let mut rtts: Vec<Vec<Duration>> = vec![Vec::new(); paths.len()];
    let mut rr_cpu = vec![0.0f64; paths.len()];
    for _ in 0..slices {
        for (i, (_, a, cc, pids, _)) in paths.iter().enumerate() {
            let before: f64 = pids.iter().map(|p| common::cpu_seconds(*p)).sum();
            rtts[i].extend(round_trips(*a, *cc, rounds / slices));
            rr_cpu[i] += pids.iter().map(|p| common::cpu_seconds(*p)).sum::<f64>() - before;
        }
    }
    for r in &mut rtts {
        r.sort();
    }
    let title = "Throughput, relay CPU and 8 KiB round trips per path";
    let header = [
        "path",
        "MB/s",
        "relay CPU s/GB",
        "rtt p50 µs",
        "rtt p99 µs",
        "p99.9 µs",
        "CPU µs/rtt",
    ];
    let gb = (bytes * repeat as u64) as f64 / 1e9;
    let mut med = Vec::new();
    for (i, (name, _, _, pids, has_bulk)) in paths.iter().enumerate() {
        let m = if *has_bulk {
            median(rates[i].clone())
        } else {
            f64::NAN
        };
        med.push(m);
        let r = &rtts[i];
        let (cpu_gb, cpu_rtt) = if pids.is_empty() {
            ("-".to_string(), "-".to_string())
        } else {
            (
                if *has_bulk {
                    format!("{:.2}", cpu[i] / gb)
                } else {
                    "-".to_string()
                },
                format!("{:.1}", rr_cpu[i] * 1e6 / r.len() as f64),
            )
        };
        let mbs = if *has_bulk {
            format!("{:.0}", m / 1e6)
        } else {
            "-".to_string()
        };
        let us = |q| format!("{:.1}", pct(r, q).as_secs_f64() * 1e6);
        report::row(
            title,
            &header,
            vec![
                name.to_string(),
                mbs,
                cpu_gb,
                us(0.5),
                us(0.99),
                us(0.999),
                cpu_rtt,
            ],
        );
    }
    let Some(w) = paths.iter().position(|p| p.0 == "wanopt") else {
        report::finish("tunnel", "tunnel: throughput and round trips on loopback");
        return;
    };
    let direct_p50 = pct(&rtts[0], 0.5).as_secs_f64() * 1e6;
    let wan_p50 = pct(&rtts[w], 0.5).as_secs_f64() * 1e6;
    let t = "Ratios";
    let h = ["figure", "value", "target"];
    let ratio = |what: &str, v: String, target: &str| {
        report::row(t, &h, vec![what.into(), v, target.into()]);
    };
    ratio(
        "wanopt / direct cubic throughput",
        format!("{:.2}", med[w] / med[0]),
        "",
    );
    if let Some(s) = paths.iter().position(|p| p.0 == "stunnel") {
        ratio(
            "wanopt / stunnel throughput",
            format!("{:.2}", med[w] / med[s]),
            ">= 1.00",
        );
        ratio(
            "wanopt / stunnel CPU per byte",
            format!("{:.2}", cpu[w] / cpu[s]),
            "lower is better",
        );
    }
    ratio(
        "8 KiB round trip added over direct, median (µs)",
        format!("{:.1}", wan_p50 - direct_p50),
        "<= 100",
    );
    if let Some(r) = paths.iter().position(|p| p.0 == "2 plain relays") {
        let relay_p50 = pct(&rtts[r], 0.5).as_secs_f64() * 1e6;
        ratio(
            "of which two plain relays add (µs)",
            format!("{:.1}", relay_p50 - direct_p50),
            "the floor of any two-proxy path",
        );
        ratio(
            "wanopt beyond two plain relays (µs)",
            format!("{:.1}", wan_p50 - relay_p50),
            "",
        );
    }
    if let Some(y) = paths.iter().position(|p| p.0 == "wanopt sync") {
        ratio(
            "added through a latency-class service (its own lane), median (µs)",
            format!("{:.1}", pct(&rtts[y], 0.5).as_secs_f64() * 1e6 - direct_p50),
            "",
        );
    }
    report::finish("tunnel", "tunnel: throughput and round trips on loopback");
}
