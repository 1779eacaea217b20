//! `wanopt-replay compare`: one workload over two or more paths in one run, side by side: bytes,
//! time, throughput, speedup over the first path, latency percentiles, and for a tunnel path the
//! raw and wire bytes its daemon counted (the bandwidth gain), read from its metrics endpoint.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use crate::args::{Oratcp, parse_oratcptest};
use crate::chart::{Bars, Chart, Percentiles};
use crate::client::{self, ClientOpts, Limit, Mode, Payload};
use crate::trace::Event;
use crate::workload::{Generator, Workload};

/// One path to measure: `NAME=HOST:PORT[,cc=cubic][,metrics=http://HOST:PORT/metrics]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathSpec {
    pub name: String,
    pub addr: String,
    pub congestion: Option<String>,
    pub metrics: Option<String>,
}

pub fn parse_path(s: &str) -> Result<PathSpec, String> {
    let (name, rest) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not NAME=HOST:PORT[,cc=..][,metrics=URL]"))?;
    let mut parts = rest.split(',');
    let addr = parts.next().unwrap_or_default().to_string();
    if name.is_empty() || !addr.contains(':') {
        return Err(format!("{s:?}: give a name and a host:port"));
    }
    let mut p = PathSpec {
        name: name.to_string(),
        addr,
        congestion: None,
        metrics: None,
    };
    for opt in parts {
        match opt.split_once('=') {
            Some(("cc", v)) => p.congestion = Some(v.to_ascii_lowercase()),
            Some(("metrics", v)) => p.metrics = Some(v.to_string()),
            _ => return Err(format!("{opt:?}: path options are cc=NAME and metrics=URL")),
        }
    }
    Ok(p)
}

/// What runs over each path.
#[derive(Debug, Clone)]
pub enum Job {
    /// oratcptest client options, against a `wanopt-replay server` behind each path.
    Oratcp(Box<ClientOpts>),
    /// A generated workload streamed in 1 MiB messages (ASYNC), against a server.
    Gen(Workload, Arc<Vec<u8>>),
    /// A file's bytes (a real backup, WAL, binlog) streamed the same way.
    File(String, Arc<Vec<u8>>),
    /// A trace replayed against a `wanopt-replay sink` behind each path.
    Trace(Arc<Vec<Event>>),
}

/// Largest file a `file:` workload reads into memory.
const MAX_FILE: u64 = 16 << 30;

/// `oratcp:-mode=sync -length=8k -duration=10s`, `gen:redo:64m[:SEED]`, `file:PATH` or
/// `trace:FILE`.
pub fn parse_job(s: &str) -> Result<Job, String> {
    let (kind, rest) = s.split_once(':').ok_or_else(|| {
        format!("{s:?} is not oratcp:OPTIONS, gen:WORKLOAD:SIZE, file:PATH or trace:FILE")
    })?;
    match kind {
        "oratcp" => {
            let mut a = vec!["path".to_string(), "-port=1".to_string()];
            a.extend(rest.split_whitespace().map(String::from));
            match parse_oratcptest(&a)? {
                Oratcp::Client(c) if c.duration != Limit::Forever => Ok(Job::Oratcp(Box::new(c))),
                Oratcp::Client(_) => Err("an oratcp workload needs -duration".into()),
                _ => Err("oratcp: client options only".into()),
            }
        }
        "gen" => {
            let mut it = rest.split(':');
            let w = Workload::parse(it.next().unwrap_or_default())?;
            let size = crate::args::size(it.next().unwrap_or("64m"))?;
            let seed = it.next().map_or(Ok(1), |v| {
                v.parse().map_err(|_| format!("{v:?} is not a seed"))
            })?;
            let size = usize::try_from(size)
                .ok()
                .filter(|n| *n > 0 && *n <= 16 << 30)
                .ok_or("gen size must be 1 byte to 16g")?;
            Ok(Job::Gen(
                w,
                Arc::new(Generator::new(w, seed, 0.0).bytes(size)),
            ))
        }
        "file" => {
            let path = std::path::Path::new(rest);
            let len = std::fs::metadata(path)
                .map_err(|e| format!("cannot use the file {rest}: {e}"))?
                .len();
            if len == 0 || len > MAX_FILE {
                return Err(format!(
                    "the file {rest} must hold 1 byte to 16g ({len} bytes)"
                ));
            }
            let data = std::fs::read(path).map_err(|e| format!("cannot read {rest}: {e}"))?;
            let name = path
                .file_name()
                .map_or_else(|| rest.to_string(), |n| n.to_string_lossy().into_owned());
            Ok(Job::File(name, Arc::new(data)))
        }
        "trace" => crate::trace::load(std::path::Path::new(rest))
            .map(|e| Job::Trace(Arc::new(e)))
            .map_err(|e| format!("cannot use the trace {rest}: {e}")),
        _ => Err(format!(
            "{kind:?}: the workload is oratcp:, gen:, file: or trace:"
        )),
    }
}

impl Job {
    /// A short name for tables and charts.
    pub fn label(&self) -> String {
        match self {
            Job::Oratcp(c) => format!(
                "oratcp {} {} B",
                if c.mode == Mode::Sync {
                    "SYNC"
                } else {
                    "ASYNC"
                },
                c.length
            ),
            Job::Gen(w, d) => format!("{} {} MiB", format!("{w:?}").to_lowercase(), d.len() >> 20),
            Job::File(f, _) => f.clone(),
            Job::Trace(_) => "trace".into(),
        }
    }
}

/// One row of the table.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub path: String,
    pub bytes: u64,
    pub seconds: f64,
    pub mbytes_per_s: f64,
    pub speedup: f64,
    pub latency_ms: Option<client::LatencySummary>,
    /// Raw and wire bytes the path's daemon counted during the run (toward its peer).
    pub raw_bytes: Option<u64>,
    pub wire_bytes: Option<u64>,
    pub gain: Option<f64>,
}

/// Sums `wanopt_raw_bytes_total` and `wanopt_wire_bytes_total` with `direction="out"` (for one
/// service, or all) from a daemon's metrics endpoint.
pub fn scrape(url: &str, service: Option<&str>) -> Result<(u64, u64), String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("{url}: only http:// metrics URLs"))?;
    let (hostport, path) = rest.split_once('/').unwrap_or((rest, "metrics"));
    let mut s = TcpStream::connect(hostport).map_err(|e| format!("metrics {url}: {e}"))?;
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    write!(
        s,
        "GET /{path} HTTP/1.1\r\nHost: {hostport}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| format!("metrics {url}: {e}"))?;
    let mut body = String::new();
    s.take(64 << 20)
        .read_to_string(&mut body)
        .map_err(|e| format!("metrics {url}: {e}"))?;
    if !body.starts_with("HTTP/1.1 200") {
        return Err(format!(
            "metrics {url}: {}",
            body.lines().next().unwrap_or("no answer")
        ));
    }
    let sum = |metric: &str| -> u64 {
        body.lines()
            .filter(|l| l.starts_with(metric) && l.contains("direction=\"out\""))
            .filter(|l| service.is_none_or(|svc| l.contains(&format!("service=\"{svc}\""))))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .map(|v| v as u64)
            .sum()
    };
    Ok((
        sum("wanopt_raw_bytes_total{"),
        sum("wanopt_wire_bytes_total{"),
    ))
}

/// Runs the job over every path, in order, and returns the rows.
pub fn compare(paths: &[PathSpec], job: &Job, service: Option<&str>) -> Result<Vec<Row>, String> {
    let mut rows: Vec<Row> = Vec::new();
    let mut bar = crate::progress::Progress::steps("compare: paths done", paths.len() as u64);
    for p in paths {
        bar.add(0);
        let before = match &p.metrics {
            Some(u) => Some(scrape(u, service)?),
            None => None,
        };
        let (bytes, seconds, latency) = match job {
            Job::Oratcp(c) => {
                let mut c = (**c).clone();
                c.addr = p.addr.clone();
                c.congestion = p.congestion.clone();
                c.quiet = true;
                c.json = false;
                c.freq = None;
                c.output = None;
                let r = client::run(&c).map_err(|e| format!("{}: {e}", p.name))?;
                (r.bytes, r.seconds, r.latency_ms)
            }
            Job::Gen(_, data) | Job::File(_, data) => {
                let name = match job {
                    Job::File(f, _) => format!("file {f}"),
                    Job::Gen(w, _) => format!("gen {w:?}").to_lowercase(),
                    _ => String::new(),
                };
                let c = ClientOpts {
                    addr: p.addr.clone(),
                    mode: Mode::Async,
                    length: 1 << 20,
                    duration: Limit::Bytes(data.len() as u64),
                    interval: Duration::from_secs(3600),
                    payload: Payload::Bytes {
                        name,
                        data: data.clone(),
                    },
                    congestion: p.congestion.clone(),
                    quiet: true,
                    ..ClientOpts::default()
                };
                let r = client::run(&c).map_err(|e| format!("{}: {e}", p.name))?;
                (r.bytes, r.seconds, None)
            }
            Job::Trace(events) => {
                let r = crate::replay::replay(
                    &p.addr,
                    events,
                    crate::replay::Pace::Asap,
                    Duration::from_secs(60),
                )
                .map_err(|e| format!("{}: {e}", p.name))?;
                (r.bytes_to_server + r.bytes_to_client, r.seconds, None)
            }
        };
        // The daemon's counters trail its sockets briefly.
        let counted = match (&p.metrics, before) {
            (Some(u), Some((r0, w0))) => {
                std::thread::sleep(Duration::from_millis(300));
                let (r1, w1) = scrape(u, service)?;
                Some((r1.saturating_sub(r0), w1.saturating_sub(w0)))
            }
            _ => None,
        };
        let rate = crate::stats::mbytes_per_s(bytes, seconds);
        // Throughput against the first path: the time ratio for a fixed amount of bytes, and
        // still meaningful for a run of fixed duration.
        let base = rows.first().map_or(rate, |r| r.mbytes_per_s);
        rows.push(Row {
            path: p.name.clone(),
            bytes,
            seconds,
            mbytes_per_s: rate,
            speedup: if base > 0.0 { rate / base } else { 0.0 },
            latency_ms: latency,
            raw_bytes: counted.map(|c| c.0),
            wire_bytes: counted.map(|c| c.1),
            gain: counted.and_then(|(r, w)| (w > 0).then(|| r as f64 / w as f64)),
        });
        bar.add(1);
    }
    bar.finish();
    Ok(rows)
}

/// The columns of a comparison's table, and each one's width in [`table`].
pub const COLUMNS: [(&str, usize); 11] = [
    ("path", 16),
    ("bytes", 13),
    ("time s", 9),
    ("Mbytes/s", 10),
    ("speedup", 8),
    ("p50 ms", 9),
    ("p99 ms", 9),
    ("p99.9 ms", 9),
    ("raw bytes", 13),
    ("wire bytes", 13),
    ("gain", 7),
];

/// One row's cells, in the order of [`COLUMNS`].
pub fn cells(r: &Row) -> Vec<String> {
    let l = r.latency_ms.as_ref();
    let opt = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x:.3}"));
    vec![
        r.path.clone(),
        r.bytes.to_string(),
        format!("{:.3}", r.seconds),
        format!("{:.3}", r.mbytes_per_s),
        format!("{:.2}x", r.speedup),
        opt(l.map(|l| l.p50)),
        opt(l.map(|l| l.p99)),
        opt(l.map(|l| l.p999)),
        r.raw_bytes.map_or("-".into(), |v| v.to_string()),
        r.wire_bytes.map_or("-".into(), |v| v.to_string()),
        r.gain.map_or("-".into(), |g| format!("{g:.2}x")),
    ]
}

/// The side-by-side table.
pub fn table(rows: &[Row]) -> String {
    let line = |cells: Vec<String>| {
        let mut s = String::new();
        for (i, (c, (_, w))) in cells.iter().zip(COLUMNS).enumerate() {
            if i == 0 {
                s += &format!("{c:<w$}");
            } else {
                s += &format!(" {c:>w$}");
            }
        }
        s + "\n"
    };
    let mut s = line(COLUMNS.iter().map(|(h, _)| h.to_string()).collect());
    for r in rows {
        s += &line(cells(r));
    }
    s
}

/// The runs' charts: throughput per path and workload (a tunnel's wire gain in its name), and
/// the round trips' percentiles where a run measured latency.
pub fn charts(title: &str, runs: &[(String, Vec<Row>)]) -> Vec<Chart> {
    let mut names: Vec<String> = Vec::new();
    for r in runs.iter().flat_map(|(_, rows)| rows) {
        if !names.contains(&r.path) {
            names.push(r.path.clone());
        }
    }
    let series = names
        .iter()
        .map(|n| {
            let mine = || {
                runs.iter()
                    .flat_map(|(_, rows)| rows)
                    .filter(|r| &r.path == n)
            };
            let gains: Vec<f64> = mine().filter_map(|r| r.gain).collect();
            let shown = match gains.as_slice() {
                [] => n.clone(),
                [g] => format!("{n} (wire gain {g:.2}x)"),
                _ => format!("{n} (wire gain {:.2}x-{:.2}x)", min(&gains), max(&gains)),
            };
            let values = runs
                .iter()
                .map(|(_, rows)| rows.iter().find(|r| &r.path == n).map(|r| r.mbytes_per_s))
                .collect();
            (shown, values)
        })
        .collect();
    let mut out = vec![Chart::Bars(Bars {
        title: title.to_string(),
        unit: "Mbytes/s".into(),
        groups: runs.iter().map(|(w, _)| w.clone()).collect(),
        series,
        linear: false,
    })];
    for (w, rows) in runs {
        let series: Vec<(String, Vec<(f64, f64)>)> = rows
            .iter()
            .filter_map(|r| Some((r.path.clone(), r.latency_ms.as_ref()?.cdf.clone())))
            .filter(|(_, c)| !c.is_empty())
            .collect();
        if !series.is_empty() {
            out.push(Chart::Percentiles(Percentiles {
                title: format!("{w}: round trips"),
                series,
                rtt_ms: None,
            }));
        }
    }
    out
}

fn min(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::NEG_INFINITY, f64::max)
}

/// Writes the runs' charts as one SVG file.
pub fn write_svg(
    path: &std::path::Path,
    title: &str,
    runs: &[(String, Vec<Row>)],
) -> Result<(), String> {
    let svg = crate::chart::render(&charts(title, runs)).map_err(|e| e.to_string())?;
    std::fs::write(path, svg).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_jobs_parse() {
        let p = parse_path("tunnel=127.0.0.1:15555,metrics=http://127.0.0.1:9464/metrics")
            .expect("path");
        assert_eq!(p.addr, "127.0.0.1:15555");
        assert_eq!(p.metrics.as_deref(), Some("http://127.0.0.1:9464/metrics"));
        assert_eq!(
            parse_path("direct=db:5555,cc=CUBIC")
                .expect("cc")
                .congestion
                .as_deref(),
            Some("cubic")
        );
        for bad in ["nohost", "x=", "x=host", "x=h:1,speed=9"] {
            assert!(parse_path(bad).is_err(), "{bad}");
        }
        assert!(
            matches!(parse_job("gen:redo:1m"), Ok(Job::Gen(Workload::Redo, d)) if d.len() == 1 << 20)
        );
        assert!(matches!(
            parse_job("oratcp:-mode=sync -length=8k -duration=2s"),
            Ok(Job::Oratcp(_))
        ));
        assert!(parse_job("oratcp:-mode=sync").is_err(), "needs a duration");
        assert!(parse_job("gen:nope:1m").is_err());
        assert!(parse_job("trace:/does/not/exist").is_err());
        assert!(parse_job("ftp:x").is_err());
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("base.tar");
        std::fs::write(&f, b"real bytes").expect("write");
        assert!(matches!(
            parse_job(&format!("file:{}", f.display())),
            Ok(Job::File(n, d)) if n == "base.tar" && d[..] == b"real bytes"[..]
        ));
        let empty = dir.path().join("empty");
        std::fs::write(&empty, b"").expect("write");
        assert!(parse_job(&format!("file:{}", empty.display())).is_err());
        assert!(parse_job("file:/does/not/exist").is_err());
    }

    #[test]
    fn a_run_charts_every_path_and_names_the_tunnels_gain() {
        let row = |path: &str, mbs: f64, gain: Option<f64>, lat: bool| Row {
            path: path.into(),
            bytes: 1 << 20,
            seconds: 1.0,
            mbytes_per_s: mbs,
            speedup: 1.0,
            latency_ms: lat.then(|| {
                let mut h = crate::stats::Histogram::default();
                (100_000..101_000).for_each(|us| h.record(us));
                client::LatencySummary::of(&h).expect("summary")
            }),
            raw_bytes: gain.map(|_| 2 << 20),
            wire_bytes: gain.map(|_| 1 << 20),
            gain,
        };
        let runs = vec![
            (
                "redo 16 MiB".to_string(),
                vec![
                    row("direct", 0.3, None, false),
                    row("tunnel", 5.2, Some(2.0), false),
                ],
            ),
            (
                "oratcp SYNC 8192 B".to_string(),
                vec![
                    row("direct", 0.1, None, true),
                    row("tunnel", 0.1, Some(1.5), true),
                ],
            ),
        ];
        let charts = charts("t3", &runs);
        assert_eq!(
            charts.len(),
            2,
            "throughput, and the SYNC run's percentiles"
        );
        let Chart::Bars(b) = &charts[0] else {
            panic!("bars first")
        };
        assert_eq!(b.groups, ["redo 16 MiB", "oratcp SYNC 8192 B"]);
        assert_eq!(b.series[1].0, "tunnel (wire gain 1.50x-2.00x)");
        assert_eq!(b.series[1].1, [Some(5.2), Some(0.1)]);
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("run.svg");
        write_svg(&f, "t3", &runs).expect("svg");
        let svg = std::fs::read_to_string(&f).expect("read");
        assert!(svg.contains("tunnel (wire gain") && svg.contains("round trips"));
    }
}
