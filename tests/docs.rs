//! The operator docs cannot drift from the code: every metric family the daemon serves is in
//! docs/metrics.md, and every warning or error line it can log is in docs/troubleshooting.md.
//! (docs/configuration.md is held to `wanoptd check`'s output by a config unit test.)

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;

fn read(rel: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)).expect(rel)
}

/// The last string literal of every `warn!`/`error!` call in the runtime and the daemon: the
/// message an operator sees.
fn logged_messages() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = rust_files(&[
        root.join("crates/runtime/src"),
        root.join("crates/wanoptd/src"),
    ]);
    let mut out = Vec::new();
    for f in files {
        let src = std::fs::read_to_string(&f).expect("source");
        let b = src.as_bytes();
        for mac in ["warn!(", "error!("] {
            let mut from = 0;
            while let Some(at) = src[from..].find(mac) {
                let start = from + at + mac.len();
                from = start;
                // Up to the matching parenthesis, skipping string literals.
                let (mut depth, mut i, mut last) = (1, start, None);
                while depth > 0 && i < b.len() {
                    match b[i] {
                        b'(' => depth += 1,
                        b')' => depth -= 1,
                        b'"' => {
                            let s = i + 1;
                            i += 1;
                            while i < b.len() && b[i] != b'"' {
                                if b[i] == b'\\' {
                                    i += 1;
                                }
                                i += 1;
                            }
                            last = Some(src[s..i].to_string());
                        }
                        _ => {}
                    }
                    i += 1;
                }
                if let Some(m) = last {
                    // A literal continued over lines (`\` at a line's end) reads as one line.
                    let joined = m
                        .split("\\\n")
                        .map(str::trim_start)
                        .collect::<Vec<_>>()
                        .join("");
                    out.push((joined, f.display().to_string()));
                }
            }
        }
    }
    out
}

#[test]
fn every_warning_and_error_line_is_in_troubleshooting() {
    let doc = read("docs/troubleshooting.md");
    let msgs = logged_messages();
    assert!(msgs.len() > 40, "{msgs:?}");
    for (m, file) in msgs {
        // A message built at run time is documented by its fixed part.
        let fixed = m
            .split('{')
            .next()
            .unwrap_or("")
            .trim_end_matches([':', ' ']);
        if fixed.is_empty() {
            continue;
        }
        assert!(
            doc.contains(&format!("`{fixed}")),
            "docs/troubleshooting.md lacks the line {m:?} ({file})"
        );
    }
}

#[test]
fn every_metric_family_is_in_the_metrics_reference() {
    let doc = read("docs/metrics.md");
    let srv = hash_server();
    let echo = server(|mut s| {
        let _ = std::io::copy(&mut s.try_clone().expect("clone"), &mut s);
    });
    let p = Pair::start_with_admin(
        &format!(
            "  - name: svc\n    target: {srv}\n  - name: dg\n    target: {echo}\n    class: latency\n    redundancy: 2\n"
        ),
        "  - name: svc\n    listen: 127.0.0.1:0\n  - name: dg\n    listen: 127.0.0.1:0\n    class: latency\n    redundancy: 2\n",
    );
    p.west
        .wait_log("latency lane copy attached", Duration::from_secs(10));
    hash_client(p.west.bound("svc"), 1, 100_000, 10_000).expect("transfer");
    // A round trip on the latency service, so its copies' families have samples.
    let mut c = std::net::TcpStream::connect(p.west.bound("dg")).expect("connect dg");
    std::io::Write::write_all(&mut c, &[7u8; 4096]).expect("write");
    std::io::Read::read_exact(&mut c, &mut [0u8; 4096]).expect("echo");
    let text = scrape(p.west.bound("admin"));
    let families: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# HELP "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(families.len() > 30, "{text}");
    for f in families {
        assert!(
            doc.contains(&format!("`{f}`"))
                || doc.contains(&format!("`{f}_total`"))
                || doc.contains(&format!("`{f}_total,"))
                || doc.contains(&format!("`{f},")),
            "docs/metrics.md lacks {f}"
        );
    }
}

/// Every family the reference lists has a sample on the first scrape of a fresh pair, before any
/// stream: a rate or an alert over it has a series before its first event. Families of things
/// that exist only once used (a disk tier, a codec's bytes, the link socket's samples) are the
/// ones the page says appear later.
#[test]
fn every_listed_family_has_a_sample_from_the_first_scrape() {
    let doc = read("docs/metrics.md");
    let p = Pair::start_with_admin(
        "  - name: svc\n    target: 127.0.0.1:9\n",
        "  - name: svc\n    listen: 127.0.0.1:0\n",
    );
    p.west.wait_log("link up", Duration::from_secs(10));
    let scrapes = [scrape(p.west.bound("admin")), scrape(p.east.bound("admin"))];
    // Created with what they count: a cache, a codec's first bytes, a sample of the link socket.
    let later = [
        "wanopt_dedup_",
        "wanopt_delta_no_base_",
        "wanopt_delta_base_waits",
        "wanopt_saved_bytes",
        "wanopt_codec_bytes",
        "wanopt_codec_wire_bytes",
        "wanopt_cache_",
        "wanopt_link_rtt_seconds",
        "wanopt_link_cwnd_segments",
        "wanopt_link_retransmitted_segments",
        "wanopt_link_delivery_rate",
        "wanopt_link_socket_",
    ];
    let listed: Vec<&str> = doc
        .lines()
        .filter(|l| l.starts_with("| `wanopt_"))
        .flat_map(|l| {
            l.split('|')
                .nth(1)
                .unwrap_or("")
                .split(',')
                .map(|f| f.trim().trim_matches('`'))
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(listed.len() > 40, "{listed:?}");
    for family in listed {
        if later.iter().any(|l| family.starts_with(l)) && family != "wanopt_dedup_resends_total" {
            continue;
        }
        let has_sample = |text: &String| {
            text.lines().any(|l| {
                l.strip_prefix(family)
                    .is_some_and(|r| r.starts_with('{') || r.starts_with(' '))
            })
        };
        assert!(
            scrapes.iter().all(has_sample),
            "{family} has no sample on a first scrape:\n{}",
            scrapes[0]
        );
    }
}
