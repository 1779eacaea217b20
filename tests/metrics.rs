//! The admin endpoint during real transfers: raw counters equal the bytes the clients moved, wire
//! counters agree across the link, `wanoptd stats` renders them, and junk requests are harmless.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use common::*;

#[test]
fn counters_match_the_bytes_moved() {
    let srv = hash_server();
    let p = Pair::start_with_admin(
        &format!("  - name: svc\n    target: {srv}\n"),
        "  - name: svc\n    listen: 127.0.0.1:0\n",
    );
    let (wa, ea) = (p.west.bound("admin"), p.east.bound("admin"));
    // The body is OpenMetrics text, served as such.
    let first = scrape(wa);
    let head = first
        .split("\r\n\r\n")
        .next()
        .unwrap_or("")
        .to_ascii_lowercase();
    assert!(
        head.contains("content-type: application/openmetrics-text; version=1.0.0"),
        "{head}"
    );
    assert!(first.trim_end().ends_with("# EOF"), "{first}");
    let addr = p.west.bound("svc");
    let (up, down) = (3_000_000u64, 1_234_567u64);
    for i in 0..3 {
        hash_client(addr, i, up, down).expect("transfer");
    }
    // Client bytes: a 16-byte header plus `up`; server bytes: a 32-byte hash plus `down`.
    let (raw_up, raw_down) = (3 * (16 + up), 3 * (32 + down));
    let (w, e) = eventually(wa, ea, |w, e| {
        value(w, &series("wanopt_raw_bytes_total", "svc", "in")) == raw_down
            && value(e, &series("wanopt_raw_bytes_total", "svc", "out")) == raw_down
            && value(w, &series("wanopt_wire_bytes_total", "svc", "out"))
                == value(e, &series("wanopt_wire_bytes_total", "svc", "in"))
            && value(e, &series("wanopt_wire_bytes_total", "svc", "out"))
                == value(w, &series("wanopt_wire_bytes_total", "svc", "in"))
    });
    assert_eq!(
        value(&w, &series("wanopt_raw_bytes_total", "svc", "out")),
        raw_up,
        "{w}"
    );
    assert_eq!(
        value(&e, &series("wanopt_raw_bytes_total", "svc", "in")),
        raw_up,
        "{e}"
    );
    assert_eq!(
        value(&w, &series("wanopt_raw_bytes_total", "svc", "in")),
        raw_down,
        "{w}"
    );
    assert_eq!(
        value(&e, &series("wanopt_raw_bytes_total", "svc", "out")),
        raw_down,
        "{e}"
    );
    // What west put on the wire for the service is what east took off it, both ways.
    let wire_out = value(&w, &series("wanopt_wire_bytes_total", "svc", "out"));
    assert_eq!(
        wire_out,
        value(&e, &series("wanopt_wire_bytes_total", "svc", "in"))
    );
    assert_eq!(
        value(&w, &series("wanopt_wire_bytes_total", "svc", "in")),
        value(&e, &series("wanopt_wire_bytes_total", "svc", "out"))
    );
    // Random bytes neither compress nor repeat: the wire carries them plus frame and record
    // headers (less than a thousandth), never less.
    assert!(
        wire_out > raw_up && wire_out < raw_up + raw_up / 1000 + 1000,
        "{wire_out} vs {raw_up}"
    );
    // The link's totals include every service's frames plus control frames.
    assert!(value(&w, "wanopt_link_wire_sent_bytes_total ") >= wire_out);
    assert_eq!(
        value(&w, "wanopt_streams_opened_total{service=\"svc\"} "),
        3
    );
    assert_eq!(value(&w, "wanopt_link_up "), 1);
    assert_eq!(value(&w, "wanopt_link_lanes "), 2);
    // The governor's zstd level, within its range (from 3 without a stated bandwidth).
    let level = value(&w, "wanopt_link_zstd_level ");
    assert!((1..=9).contains(&level), "zstd level {level}");
    // The codec's threads: the host's cores by default (1 on one or two).
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let want = if cores <= 2 { 1 } else { cores.min(64) };
    assert_eq!(value(&w, "wanopt_codec_threads "), want as u64, "{w}");
    // The test certificates (minted by `Certs::new`, see tls.rs) expire SITE_DAYS from when
    // they were minted, the CA CA_DAYS: within a few minutes of now plus those.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let site = u64::from(wanopt_runtime::tls::SITE_DAYS) * 86_400;
    let ca = u64::from(wanopt_runtime::tls::CA_DAYS) * 86_400;
    for (cert, life) in [("own", site), ("peer", site), ("ca", ca)] {
        let series = format!("wanopt_certificate_expiry_timestamp_seconds{{cert=\"{cert}\"}} ");
        let t = value(&w, &series);
        assert!(t.abs_diff(now + life) < 600, "{cert}: {t}: {w}");
    }

    // TCP_INFO of the link's sockets, per lane, is sampled every two seconds.
    let (w, _) = eventually(wa, ea, |w, _| {
        value(w, "wanopt_link_socket_sent_bytes{lane=\"main\"} ") > wire_out
    });
    assert!(
        value(&w, "wanopt_link_cwnd_segments{lane=\"main\"} ") > 0,
        "{w}"
    );
    assert!(
        w.contains("wanopt_link_rtt_seconds{lane=\"latency\"}"),
        "{w}"
    );

    // `wanoptd stats` renders the same figures.
    let out = Command::new(bin("wanoptd"))
        .args(["stats", "--admin", &wa.to_string()])
        .output()
        .expect("stats");
    assert!(out.status.success(), "{out:?}");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("svc") && table.contains("raw out") && table.contains("x "),
        "{table}"
    );

    // A reader that goes away (`wanoptd stats --watch | head`) ends the command quietly.
    let mut watch = Command::new(bin("wanoptd"))
        .args([
            "stats",
            "--watch",
            "--interval",
            "1",
            "--admin",
            &wa.to_string(),
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("stats --watch");
    let mut first = [0u8; 64];
    watch
        .stdout
        .as_mut()
        .expect("stdout")
        .read_exact(&mut first)
        .expect("a table");
    drop(watch.stdout.take());
    let out = watch
        .wait_with_output()
        .expect("ends once its reader is gone");
    assert!(out.status.success(), "{out:?}");
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("panicked"),
        "{out:?}"
    );

    // Junk on the admin port is answered or dropped, and the endpoint keeps working.
    for junk in [
        &b"POST /metrics HTTP/1.1\r\n\r\n"[..],
        &b"GET /nope HTTP/1.1\r\n\r\n"[..],
        &[b'A'; 20_000][..],
    ] {
        let mut s = TcpStream::connect(wa).expect("connect");
        let _ = s.write_all(junk);
        let mut r = String::new();
        let _ = s.read_to_string(&mut r);
        assert!(!r.starts_with("HTTP/1.1 200"), "{r}");
    }
    scrape(wa);
}

/// The shipped Grafana dashboard is valid JSON and queries only metrics the daemon exports.
#[test]
fn grafana_dashboard_uses_only_real_metrics() {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/grafana-dashboard.json");
    let dash: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("dashboard"))
            .expect("valid JSON");
    let mut exprs = Vec::new();
    fn walk(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    match (k.as_str(), v) {
                        ("expr", serde_json::Value::String(s)) => out.push(s.clone()),
                        _ => walk(v, out),
                    }
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    walk(&dash, &mut exprs);
    assert!(exprs.len() >= 10, "{exprs:?}");
    let srv = hash_server();
    let (_hold, closed) = refusing_port();
    let p = Pair::start_with_admin(
        &format!("  - name: svc\n    target: {srv}\n  - name: dead\n    target: {closed}\n"),
        "  - name: svc\n    listen: 127.0.0.1:0\n  - name: dead\n    listen: 127.0.0.1:0\n",
    );
    hash_client(p.west.bound("svc"), 1, 10_000, 10_000).expect("transfer");
    // A refused target, so the failure families have samples too (empty families are not printed).
    let mut c = TcpStream::connect(p.west.bound("dead")).expect("connect");
    let _ = c.read(&mut [0u8; 1]);
    p.east.wait_log("target refused", Duration::from_secs(5));
    let text = scrape(p.east.bound("admin"));
    for e in &exprs {
        for token in e
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|t| t.starts_with("wanopt_"))
        {
            let family = token.strip_suffix("_total").unwrap_or(token);
            assert!(
                text.contains(&format!("# TYPE {family} ")),
                "dashboard queries {token}, which the daemon does not export"
            );
        }
    }
}

/// The shipped alerting rules query only metrics the daemon registers, `promtool` accepts them
/// and its unit tests of the expiry alerts pass (CI installs it from Debian's `prometheus` package and sets `WANOPT_REQUIRE_PROMTOOL=1`;
/// elsewhere a missing promtool skips that half with a message).
#[test]
fn alerting_rules_use_only_real_metrics_and_pass_promtool() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let rules = root.join("config/prometheus-rules.yaml");
    let text = std::fs::read_to_string(&rules).expect("rules");
    // Every file of the runtime's metrics module.
    let registered: String = std::fs::read_dir(root.join("crates/runtime/src/counters"))
        .expect("counters")
        .map(|e| std::fs::read_to_string(e.expect("entry").path()).expect("counters file"))
        .collect();
    let mut n = 0;
    for token in text
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|t| t.starts_with("wanopt_"))
    {
        let family = token.strip_suffix("_total").unwrap_or(token);
        assert!(
            registered.contains(&format!("\"{family}\"")),
            "the rules query {token}, which the daemon does not register"
        );
        n += 1;
    }
    assert!(n >= 10, "{n} metrics in the rules");
    match std::process::Command::new("promtool")
        .args(["check", "rules"])
        .arg(&rules)
        .output()
    {
        Ok(out) => {
            assert!(out.status.success(), "promtool: {out:?}");
            // And they fire when they should: the certificate expiry alerts, with input series.
            let t = std::process::Command::new("promtool")
                .args(["test", "rules"])
                .arg(root.join("tests/data/prometheus-rules.test.yaml"))
                .output()
                .expect("promtool test rules");
            assert!(t.status.success(), "promtool test rules: {t:?}");
        }
        Err(e) => {
            assert!(
                std::env::var("WANOPT_REQUIRE_PROMTOOL").as_deref() != Ok("1"),
                "WANOPT_REQUIRE_PROMTOOL=1 but promtool cannot run: {e}"
            );
            eprintln!("SKIPPED promtool check rules: {e} (apt-get install prometheus)");
        }
    }
}
