//! `wanopt-replay` end to end: oratcptest command lines as pasted, SYNC and ASYNC runs on loopback
//! with exact byte counts (checked by the server), JSON output, a wrong port, a run through the
//! tunnel, and deterministic generators.

mod common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

/// A running `wanopt-replay` server, killed on drop.
struct Server {
    child: Child,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a server the way oratcptest's users do, on an ephemeral loopback port.
fn server() -> Server {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut child = Command::new(bin("wanopt-replay"))
        .args(["-server", "127.0.0.1", "-port=0"])
        .arg(format!("-file={}", dir.path().join("oratcp.tmp").display()))
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn server");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("banner");
    let addr = line
        .trim()
        .trim_end_matches('.')
        .rsplit(' ')
        .next()
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no address in {line:?}"));
    Server {
        child,
        addr,
        _dir: dir,
    }
}

fn client(args: &[String]) -> (bool, String, String) {
    let out = Command::new(bin("wanopt-replay"))
        .args(args)
        .output()
        .expect("run client");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn line(addr: SocketAddr, rest: &str) -> Vec<String> {
    let mut v = vec![addr.ip().to_string(), format!("-port={}", addr.port())];
    v.extend(rest.split_whitespace().map(String::from));
    v
}

#[test]
fn sync_run_with_disk_writes_reports_like_oratcptest() {
    let s = server();
    let (ok, out, err) = client(&line(
        s.addr,
        "-mode=SYNC -length=8k -duration=4m -interval=1s -write",
    ));
    assert!(ok, "{out}\n{err}");
    for want in [
        "[Requesting a test]",
        "Message payload        = 8 kbytes",
        "Transport mode         = SYNC",
        "Disk write             = YES",
        "The server is ready.",
        "Test finished.",
        "Avg. throughput =",
        "Avg. latency =",
        "(disk-write",
        "Latency p50 / p99 / p99.9 / max =",
        "Bytes sent = 4194304 in 512 messages (server confirmed)",
    ] {
        assert!(out.contains(want), "missing {want:?} in\n{out}");
    }
}

#[test]
fn repeated_tests_with_freq_write_every_report_to_the_output_file() {
    let s = server();
    let dir = tempfile::tempdir().expect("tempdir");
    let out_file = dir.path().join("report.txt");
    let mut args = line(
        s.addr,
        "-mode=sync -length=4k -duration=300ms -interval=100ms -freq=1s/2s",
    );
    args.push(format!("-output={}", out_file.display()));
    let (ok, out, err) = client(&args);
    assert!(ok, "{out}\n{err}");
    let report = std::fs::read_to_string(&out_file).expect("output file");
    assert_eq!(report.matches("Test finished.").count(), 2, "{report}");
    assert_eq!(report.matches("[Requesting a test]").count(), 2);
    assert_eq!(
        out.matches("Test finished.").count(),
        2,
        "stdout has them too"
    );
}

#[test]
fn async_runs_over_several_connections_count_every_byte() {
    let s = server();
    let mut args = line(
        s.addr,
        "-mode=async -num_conn=3 -length=64k -random_length -duration=10m -interval=1s -payload=zero",
    );
    args.push("-json".into());
    let (ok, out, err) = client(&args);
    assert!(ok, "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("one JSON report");
    assert_eq!(v["bytes"], 10 << 20, "{v}");
    assert_eq!(v["mode"], "ASYNC");
    assert_eq!(v["connections"], 3);
    assert_eq!(v["verified"], true);
    assert!(v["messages"].as_u64().expect("messages") > 160, "{v}");
    assert!(v["latency_ms"].is_null(), "no latency in ASYNC mode");

    // The subcommand spelling of a SYNC round-trip test, timed.
    let (ok, out, err) = client(&[
        "client".into(),
        s.addr.ip().to_string(),
        "--port".into(),
        s.addr.port().to_string(),
        "--rtt".into(),
        "--duration".into(),
        "1s".into(),
        "--interval".into(),
        "500ms".into(),
        "--json".into(),
    ]);
    assert!(ok, "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["bytes"], 0);
    assert!(v["messages"].as_u64().expect("n") > 10, "{v}");
    assert!(v["latency_ms"]["p99"].as_f64().expect("p99") > 0.0, "{v}");
    assert!(v["seconds"].as_f64().expect("s") >= 1.0);
}

#[test]
fn wrong_port_and_bad_options_are_clear_errors() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let free = l.local_addr().expect("addr");
    drop(l);
    let (ok, _, err) = client(&line(free, "-duration=1s"));
    assert!(!ok);
    assert!(
        err.contains("cannot connect to 127.0.0.1:") && err.contains("refused"),
        "{err}"
    );
    let out = Command::new(bin("wanopt-replay"))
        .args(["somehost", "-port=1", "-mode=fast"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&out.stderr).contains("SYNC or ASYNC"));
    // A server that is not a wanopt-replay server.
    let (ok, _, err) = client(&line(hash_server(), "-duration=1s"));
    assert!(!ok);
    assert!(err.contains("not a wanopt-replay server"), "{err}");
}

#[test]
fn runs_through_the_tunnel_to_a_server_behind_it() {
    let s = server();
    let p = Pair::start(
        &format!("  - name: dg\n    target: {}\n    class: latency\n", s.addr),
        "  - name: dg\n    listen: 127.0.0.1:0\n    class: latency\n",
    );
    let addr = p.west.bound("dg");
    let mut args = line(
        addr,
        "-mode=sync -length=8020 -duration=2m -interval=1s -write",
    );
    args.push("-json".into());
    let (ok, out, err) = client(&args);
    assert!(ok, "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["bytes"], 2 << 20);
    assert_eq!(v["verified"], true);
    assert!(v["disk_write_ms"]["mean"].as_f64().is_some(), "{v}");
    std::thread::sleep(Duration::from_millis(100));
}

#[test]
fn generators_are_deterministic_for_a_seed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gen_file = |w: &str, seed: &str, extra: &[&str], name: &str| {
        let path = dir.path().join(name);
        let st = Command::new(bin("wanopt-replay"))
            .args(["gen", w, "--size", "3m", "--seed", seed, "-o"])
            .arg(&path)
            .args(extra)
            .status()
            .expect("gen");
        assert!(st.success());
        std::fs::read(&path).expect("read")
    };
    for w in ["redo", "rman", "trail"] {
        let a = gen_file(w, "5", &[], &format!("{w}-a"));
        let b = gen_file(w, "5", &[], &format!("{w}-b"));
        let c = gen_file(w, "6", &[], &format!("{w}-c"));
        assert_eq!(a.len(), 3 << 20);
        assert!(a == b, "{w}: same seed, different bytes");
        assert!(a != c, "{w}: the seed is ignored");
    }
    let v1 = gen_file("rman", "5", &[], "v1");
    let v2 = gen_file("rman", "5", &["--changed", "0.1"], "v2");
    let changed = v1
        .chunks(8192)
        .zip(v2.chunks(8192))
        .filter(|(a, b)| a != b)
        .count();
    assert!(
        (20..=60).contains(&changed),
        "{changed} of 384 blocks changed"
    );
    let out = Command::new(bin("wanopt-replay"))
        .args(["gen", "redo", "--help"])
        .output()
        .expect("help");
    assert!(String::from_utf8_lossy(&out.stdout).contains("LGWR"));
}

/// Starts a `wanopt-replay` subcommand that prints its listening address on its first line.
fn spawn_listening(args: &[&str], marker: &str) -> (Child, SocketAddr) {
    let mut child = Command::new(bin("wanopt-replay"))
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut first = String::new();
    out.read_line(&mut first).expect("first line");
    // Keep draining stdout so the child never blocks on a full pipe.
    std::thread::spawn(move || for _ in out.lines() {});
    let addr = first
        .split(marker)
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no address after {marker:?} in {first:?}"));
    (child, addr)
}

#[test]
fn a_recorded_psql_session_replays_byte_for_byte_through_the_tunnel() {
    let Some(pg) = common::pg::port() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = dir.path().join("psql.trace");
    let trace_s = trace.to_str().expect("utf-8 path");
    // Record a real request/response session: psql through the recording proxy.
    let (mut rec, addr) = spawn_listening(
        &[
            "record",
            "--listen",
            "127.0.0.1:0",
            "--target",
            &format!("127.0.0.1:{pg}"),
            "--trace",
            trace_s,
            "--connections",
            "1",
        ],
        "recording on ",
    );
    let out = Command::new("psql")
        .arg(format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=disable",
            addr.port()
        ))
        .args([
            "-Atc",
            "create temp table t as select g, md5(g::text) as h from generate_series(1, 20000) g; \
             select count(*), sum(length(h)) from t; select h from t order by g limit 3000;",
        ])
        .output()
        .expect("psql");
    assert!(
        out.status.success(),
        "psql: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("\n20000|640000\n"), "{text}");
    assert!(rec.wait().expect("record exits").success());
    let recorded = std::fs::metadata(&trace).expect("trace").len();
    assert!(
        recorded > 100_000,
        "the trace holds the session: {recorded} bytes"
    );

    // Replay it through a tunnel to a sink playing the server, then directly.
    let (mut sink, sink_addr) = spawn_listening(
        &[
            "sink",
            "--listen",
            "127.0.0.1:0",
            "--trace",
            trace_s,
            "--once",
        ],
        "listening on ",
    );
    let p = Pair::start(
        &format!("  - name: pg\n    target: {sink_addr}\n"),
        "  - name: pg\n    listen: 127.0.0.1:0\n",
    );
    let (ok, out, err) = client(&[
        "replay".into(),
        p.west.bound("pg").to_string(),
        "--trace".into(),
        trace_s.into(),
        "--json".into(),
    ]);
    assert!(ok, "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["connections"], 1);
    assert!(v["bytes_to_client"].as_u64().expect("n") > 100_000, "{v}");
    assert_eq!(v["verified"], true);
    assert!(sink.wait().expect("sink exits").success());

    // A damaged or truncated trace is refused with a message, never replayed.
    let bytes = std::fs::read(&trace).expect("read");
    for (name, damaged) in [
        ("flipped", {
            let mut d = bytes.clone();
            d[bytes.len() / 2] ^= 0x40;
            d
        }),
        ("truncated", bytes[..bytes.len() - 40].to_vec()),
    ] {
        let bad = dir.path().join(name);
        std::fs::write(&bad, damaged).expect("write");
        let (ok, _, err) = client(&[
            "replay".into(),
            sink_addr.to_string(),
            "--trace".into(),
            bad.to_str().expect("path").into(),
        ]);
        assert!(!ok);
        assert!(
            err.contains("cannot use the trace")
                && (err.contains("damaged") || err.contains("truncated")),
            "{name}: {err}"
        );
    }
}

#[test]
fn compare_puts_direct_and_tunnel_side_by_side_with_the_tunnels_gain() {
    let s = server();
    let p = Pair::start_with_admin(
        &format!("  - name: dg\n    target: {}\n", s.addr),
        "  - name: dg\n    listen: 127.0.0.1:0\n",
    );
    let direct = format!("direct-cubic={},cc=cubic", s.addr);
    let tunnel = format!(
        "tunnel={},metrics=http://{}/metrics",
        p.west.bound("dg"),
        p.west.bound("admin")
    );
    let run = |workload: &str, json: bool, extra: &[&str]| {
        let mut a: Vec<String> = [
            "compare",
            "--path",
            &direct,
            "--path",
            &tunnel,
            "--workload",
            workload,
        ]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect();
        if json {
            a.push("--json".into());
        }
        let (ok, out, err) = client(&a);
        assert!(ok, "{out}\n{err}");
        out
    };
    let out = run("gen:redo:16m", true, &[]);
    let rows: serde_json::Value = serde_json::from_str(&out).expect("json rows");
    assert_eq!(rows[0]["path"], "direct-cubic");
    assert_eq!(rows[0]["bytes"], 16 << 20);
    assert_eq!(rows[1]["bytes"], 16 << 20);
    assert!(rows[0]["gain"].is_null(), "no metrics for the direct path");
    // The tunnel's daemon saw the raw bytes (plus the test protocol's framing) and sent fewer.
    let raw = rows[1]["raw_bytes"].as_u64().expect("raw");
    assert!((16 << 20..(16 << 20) + 100_000).contains(&raw), "{rows}");
    let gain = rows[1]["gain"].as_f64().expect("gain");
    assert!(gain > 1.5, "redo should shrink through the tunnel: {rows}");

    // A real file: the workspace's own sources and docs, as one text of a few MiB.
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("sources.txt");
    let mut text = Vec::new();
    for f in [
        "README.md",
        "ARCHITECTURE.md",
        "benches/README.md",
        "Cargo.lock",
    ] {
        text.extend(
            std::fs::read(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(f)).expect("read"),
        );
    }
    let text = text.repeat((4 << 20) / text.len() + 1);
    std::fs::write(&file, &text).expect("write");
    let rows: serde_json::Value =
        serde_json::from_str(&run(&format!("file:{}", file.display()), true, &[]))
            .expect("json rows");
    assert_eq!(rows[0]["bytes"], text.len());
    assert_eq!(rows[1]["bytes"], text.len());
    assert!(rows[1]["gain"].as_f64().expect("gain") > 1.5, "{rows}");

    let chart = dir.path().join("sync.svg");
    let table = run(
        "oratcp:-mode=sync -length=8k -duration=1s -interval=1s",
        false,
        &["--svg", &chart.display().to_string()],
    );
    // The chart of the run: both paths' throughput, and their round trips' percentiles.
    let svg = std::fs::read_to_string(&chart).expect("the --svg chart");
    assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(80)]);
    for text in ["direct-cubic", "tunnel (wire gain", "round trips", "99.9%"] {
        assert!(svg.contains(text), "the chart lacks {text:?}");
    }
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 3, "{table}");
    assert!(
        lines[0].contains("speedup") && lines[0].contains("p99 ms") && lines[0].contains("gain")
    );
    assert!(
        lines[1].starts_with("direct-cubic") && lines[1].contains("1.00x"),
        "{table}"
    );
    assert!(lines[2].starts_with("tunnel"), "{table}");
}

/// The one-command comparison: the WAN, the pair inside it stating the link, three paths per
/// workload, the chart, and nothing left behind. On the `lan` preset so it is quick; the
/// reference WAN is the same code with another preset.
#[test]
fn showcase_compares_direct_cubic_bbr_and_the_pair_on_a_wan_and_cleans_up() {
    if !wansim::available_or_skip("showcase") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let chart = dir.path().join("showcase.svg");
    let child = Command::new(bin("wanopt-replay"))
        .args([
            "showcase",
            "--preset",
            "lan",
            "--workload",
            "gen:redo:4m",
            "--workload",
            "oratcp:-mode=sync -length=8k -duration=1s -interval=1s",
            "--svg",
        ])
        .arg(&chart)
        .arg("--wanoptd")
        .arg(bin("wanoptd"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("showcase");
    let pid = child.id();
    let out = child.wait_with_output().expect("showcase output");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("the pair states the link's own 1000 Mbit/s and 100us"),
        "{stdout}"
    );
    for w in ["redo 4 MiB", "oratcp SYNC 8192 B"] {
        let table: Vec<&str> = stdout
            .split(&format!("\n{w}\n"))
            .nth(1)
            .unwrap_or_else(|| panic!("no {w} table: {stdout}"))
            .lines()
            .take(4)
            .collect();
        assert!(table[1].starts_with("direct CUBIC"), "{stdout}");
        assert!(table[2].starts_with("direct BBR"), "{stdout}");
        assert!(table[3].starts_with("wanopt"), "{stdout}");
        // The pair's own counters: the raw bytes it carried and a wire gain.
        assert!(table[3].trim_end().ends_with('x'), "{stdout}");
        assert!(
            stdout.contains(&format!("{w}: wanopt moved")),
            "no summary for {w}: {stdout}"
        );
    }
    assert!(stdout.contains("round trips p99"), "{stdout}");
    let svg = std::fs::read_to_string(&chart).expect("chart");
    for text in [
        "direct CUBIC",
        "direct BBR",
        "wanopt (wire gain",
        "redo 4 MiB",
        "round trips",
    ] {
        assert!(svg.contains(text), "the chart lacks {text:?}");
    }
    // Namespaces and the scratch folder are gone.
    let prefix = format!("wshow{}", pid % 100_000);
    let ns = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip");
    assert!(
        !String::from_utf8_lossy(&ns.stdout).contains(&prefix),
        "namespaces left behind"
    );
    assert!(
        !std::env::temp_dir()
            .join(format!("wanopt-showcase-{}", pid % 100_000))
            .exists()
    );
}
