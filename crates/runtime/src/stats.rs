//! `wanoptd stats`: turns a daemon's Prometheus text into a per-service table of raw and optimized
//! (wire) bytes each way and the bandwidth gain (raw / wire).
//!
//! The parser reads only the `wanopt_*` samples it needs and ignores everything else, so a newer
//! daemon with more metrics still renders.

use std::collections::BTreeMap;
use std::fmt::Write;

/// Per-service figures taken from the metrics text.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ServiceRow {
    pub raw_out: f64,
    pub wire_out: f64,
    pub raw_in: f64,
    pub wire_in: f64,
    pub active: f64,
    pub opened: f64,
    pub failed: f64,
    /// Bytes kept off the wire going out, by dedup, delta and compression.
    pub saved: [f64; 3],
}

const MECHANISMS: [&str; 3] = ["dedup", "delta", "compression"];

/// One parsed sample: metric name, label pairs, value.
type Sample<'a> = (&'a str, Vec<(&'a str, &'a str)>, f64);

/// Parses one sample line: `name{k="v",...} value`.
fn sample(line: &str) -> Option<Sample<'_>> {
    let (head, value) = line.rsplit_once(' ')?;
    let value: f64 = value.parse().ok()?;
    let (name, labels) = match head.split_once('{') {
        Some((n, rest)) => (n, rest.strip_suffix('}')?),
        None => (head, ""),
    };
    let labels = labels
        .split(',')
        .filter(|l| !l.is_empty())
        .filter_map(|l| {
            let (k, v) = l.split_once('=')?;
            Some((k, v.trim_matches('"')))
        })
        .collect();
    Some((name, labels, value))
}

/// Per-service rows from Prometheus text.
pub fn parse(text: &str) -> BTreeMap<String, ServiceRow> {
    let mut rows: BTreeMap<String, ServiceRow> = BTreeMap::new();
    for line in text.lines().filter(|l| l.starts_with("wanopt_")) {
        let Some((name, labels, v)) = sample(line) else {
            continue;
        };
        let get = |k: &str| labels.iter().find(|(a, _)| *a == k).map(|(_, b)| *b);
        let Some(svc) = get("service") else { continue };
        let row = rows.entry(svc.to_string()).or_default();
        let out = get("direction") == Some("out");
        match name {
            "wanopt_raw_bytes_total" if out => row.raw_out = v,
            "wanopt_raw_bytes_total" => row.raw_in = v,
            "wanopt_wire_bytes_total" if out => row.wire_out = v,
            "wanopt_wire_bytes_total" => row.wire_in = v,
            "wanopt_streams_active" => row.active = v,
            "wanopt_streams_opened_total" => row.opened = v,
            "wanopt_streams_failed_total" => row.failed += v,
            "wanopt_saved_bytes_total" => {
                if let Some(i) = MECHANISMS.iter().position(|m| get("mechanism") == Some(*m)) {
                    row.saved[i] = v;
                }
            }
            _ => {}
        }
    }
    rows
}

fn human(b: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < units.len() {
        v /= 1024.0;
        i += 1;
    }
    format!("{v:.1} {}", units[i])
}

fn gain(raw: f64, wire: f64) -> String {
    if wire > 0.0 {
        format!("{:.2}x", raw / wire)
    } else {
        "-".into()
    }
}

/// The value of an unlabelled metric, if the text has it.
fn plain(text: &str, metric: &str) -> Option<f64> {
    text.lines()
        .filter_map(sample)
        .find(|(n, labels, _)| *n == metric && labels.is_empty())
        .map(|(_, _, v)| v)
}

/// The latency lane's copies, if any connection carries it: how many, what the policy wants,
/// what they cost and how much arrived second.
fn lane_line(text: &str) -> Option<String> {
    let copies = plain(text, "wanopt_link_latency_copies").filter(|c| *c > 0.0)?;
    let wanted = plain(text, "wanopt_link_latency_copies_wanted").unwrap_or(0.0);
    let twice = plain(text, "wanopt_link_copy_duplicated_bytes_total").unwrap_or(0.0);
    let late = plain(text, "wanopt_link_copy_late_bytes_total").unwrap_or(0.0);
    let wants = if wanted > 0.0 {
        format!(" (the policy wants {wanted})")
    } else {
        String::new()
    };
    Some(format!(
        "\nlatency lane: {copies} connection(s){wants}; {} sent again on a copy, {} arrived after another copy",
        human(twice),
        human(late)
    ))
}

/// The table `wanoptd stats` prints.
pub fn render(text: &str) -> String {
    let rows = parse(text);
    let lane = lane_line(text);
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:<16} {:>11} {:>11} {:>7}   {:>11} {:>11} {:>7}   {:>7} {:>8} {:>7}",
        "service",
        "raw out",
        "wire out",
        "gain",
        "raw in",
        "wire in",
        "gain",
        "active",
        "opened",
        "failed"
    );
    for (name, r) in &rows {
        let _ = writeln!(
            o,
            "{:<16} {:>11} {:>11} {:>7}   {:>11} {:>11} {:>7}   {:>7} {:>8} {:>7}",
            name,
            human(r.raw_out),
            human(r.wire_out),
            gain(r.raw_out, r.wire_out),
            human(r.raw_in),
            human(r.wire_in),
            gain(r.raw_in, r.wire_in),
            r.active,
            r.opened,
            r.failed
        );
    }
    if rows.is_empty() {
        let _ = writeln!(o, "(no service has carried traffic yet)");
        if let Some(l) = lane {
            let _ = writeln!(o, "{l}");
        }
        return o;
    }
    // What kept the outgoing bytes off the wire: each mechanism's share of the raw bytes.
    let _ = writeln!(
        o,
        "\n{:<16} {:>18} {:>18} {:>18}",
        "saved out by", "dedup", "delta", "compression"
    );
    for (name, r) in &rows {
        let cell = |v: f64| match r.raw_out {
            raw if raw > 0.0 => format!("{} {:>5.1}%", human(v), 100.0 * v / raw),
            _ => human(v),
        };
        let _ = writeln!(
            o,
            "{:<16} {:>18} {:>18} {:>18}",
            name,
            cell(r.saved[0]),
            cell(r.saved[1]),
            cell(r.saved[2])
        );
    }
    if let Some(l) = lane {
        let _ = writeln!(o, "{l}");
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_renders() {
        let text = "# HELP x\nwanopt_raw_bytes_total{service=\"dg\",direction=\"out\"} 3000\nwanopt_saved_bytes_total{service=\"dg\",mechanism=\"delta\"} 1500\nwanopt_wire_bytes_total{service=\"dg\",direction=\"out\"} 1000\nwanopt_streams_failed_total{service=\"dg\",reason=\"a\"} 1\nwanopt_streams_failed_total{service=\"dg\",reason=\"b\"} 2\nwanopt_link_up 1\ngarbage {{{\n";
        let rows = parse(text);
        assert_eq!(rows["dg"].raw_out, 3000.0);
        assert_eq!(rows["dg"].failed, 3.0);
        let out = render(text);
        assert!(out.contains("3.00x"), "{out}");
        assert_eq!(rows["dg"].saved, [0.0, 1500.0, 0.0]);
        assert!(out.contains(" 50.0%"), "{out}");
        assert!(render("").contains("no service"));
        assert!(!out.contains("latency lane"), "{out}");
        let lane = "wanopt_link_latency_copies 2\nwanopt_link_latency_copies_wanted 2\nwanopt_link_copy_duplicated_bytes_total 2097152\nwanopt_link_copy_late_bytes_total 1048576\n";
        let out = render(&format!("{text}{lane}"));
        assert!(
            out.contains("latency lane: 2 connection(s) (the policy wants 2); 2.0 MiB sent again"),
            "{out}"
        );
    }
}
