//! `wanopt-replay showcase`: one command (as root) that builds a reference WAN with wansim, runs
//! a wanoptd pair inside it stating the link's own bandwidth and RTT, and compares direct TCP
//! with CUBIC, direct TCP with BBR and the pair on each workload, with a chart. Everything it
//! creates (namespaces, daemons, certificates, configs) is removed when it ends.

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use wansim::{LinkParams, Site, Wan};

use crate::compare::{self, Job, PathSpec, Row};
use crate::server::{self, ServerOpts};

/// The test server's port in east; the pair's link port.
const SERVER_PORT: u16 = 5555;
const LINK_PORT: u16 = 7400;
/// West's service ports and admin endpoint, inside west's namespace.
const BULK_PORT: u16 = 15555;
const SYNC_PORT: u16 = 15556;
const ADMIN_PORT: u16 = 19464;

#[derive(Debug, Clone)]
pub struct ShowcaseOpts {
    pub preset: String,
    /// `compare` workloads, run one after another.
    pub workloads: Vec<String>,
    pub svg: Option<PathBuf>,
    /// The daemon binary.
    pub wanoptd: PathBuf,
}

/// The `link:` lines stating a wansim link's own bandwidth and RTT, and the same in words.
pub fn stated_link(params: &LinkParams) -> (String, String) {
    let (rate, rtt) = params.stated();
    let rtt = if rtt.subsec_micros() % 1000 == 0 {
        format!("{}ms", rtt.as_millis())
    } else {
        format!("{}us", rtt.as_micros())
    };
    match rate {
        Some(bps) => (
            format!("  bandwidth: {}kbit\n  rtt: {rtt}\n", bps / 1000),
            format!(
                "the pair states the link's own {} Mbit/s and {rtt}",
                bps / 1_000_000
            ),
        ),
        None => (
            format!("  rtt: {rtt}\n"),
            format!("the pair states the link's {rtt} and no bandwidth (the link has no limit)"),
        ),
    }
}

/// `wanoptd` beside this binary (as packages and `cargo build` place them), else from `PATH`.
pub fn default_wanoptd() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|e| Some(e.parent()?.join("wanoptd")))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("wanoptd"))
}

/// The daemons and their files; dropping it stops and removes them.
struct Stage {
    dir: PathBuf,
    daemons: Vec<(String, Child)>,
}

impl Drop for Stage {
    fn drop(&mut self) {
        for (_, c) in &mut self.daemons {
            if let Ok(pid) = i32::try_from(c.id()) {
                // SAFETY: kill has no memory preconditions; the pid is our own child's.
                unsafe { libc::kill(pid, libc::SIGTERM) };
            }
        }
        for (_, c) in &mut self.daemons {
            let end = Instant::now() + Duration::from_secs(12);
            while matches!(c.try_wait(), Ok(None)) && Instant::now() < end {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Stage {
    fn log(&self, site: &str) -> String {
        std::fs::read_to_string(self.dir.join(format!("{site}.log"))).unwrap_or_default()
    }

    fn last_lines(&self, site: &str) -> String {
        let log = self.log(site);
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    fn start(&mut self, wan: &Wan, site: Site, yaml: &str, wanoptd: &Path) -> Result<(), String> {
        let name = site.name();
        let cfg = self.dir.join(format!("{name}.yaml"));
        std::fs::write(&cfg, yaml).map_err(|e| format!("cannot write {}: {e}", cfg.display()))?;
        let log = std::fs::File::create(self.dir.join(format!("{name}.log")))
            .map_err(|e| format!("cannot create the {name} log: {e}"))?;
        let child = wan
            .command(site, &wanoptd.to_string_lossy())
            .arg("-c")
            .arg(&cfg)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", wanoptd.display()))?;
        self.daemons.push((name.to_string(), child));
        Ok(())
    }

    /// Waits for `line` in a site's log, failing early if a daemon exits.
    fn wait_for(&mut self, site: &str, line: &str, limit: Duration) -> Result<(), String> {
        let end = Instant::now() + limit;
        while Instant::now() < end {
            if BufReader::new(self.log(site).as_bytes())
                .lines()
                .map_while(Result::ok)
                .any(|l| l.contains(line))
            {
                return Ok(());
            }
            for (name, c) in &mut self.daemons {
                if let Ok(Some(status)) = c.try_wait() {
                    let name = name.clone();
                    return Err(format!(
                        "wanoptd ({name}) exited ({status}):\n{}",
                        self.last_lines(&name)
                    ));
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(format!(
            "no {line:?} from {site} within {limit:?}:\n{}",
            self.last_lines(site)
        ))
    }
}

fn site_yaml(site: Site, link: &str, dir: &Path, services: &str, extra: &str) -> String {
    let (me, peer) = match site {
        Site::West => ("west", "east"),
        Site::East => ("east", "west"),
    };
    let d = dir.display();
    format!(
        "site: {me}\nlink:\n{link}  peer: {peer}\ntls:\n  ca: {d}/certs/ca.pem\n  cert: {d}/certs/{me}.pem\n  \
         key: {d}/certs/{me}.key\nstate_dir: {d}/state/{me}\n{extra}services:\n{services}"
    )
}

/// Runs the showcase; returns the report (the tables and a summary) as text.
pub fn run(o: &ShowcaseOpts) -> Result<String, String> {
    let missing = wansim::missing_prerequisites();
    if !missing.is_empty() {
        return Err(format!(
            "the showcase builds a WAN with wansim and needs {}",
            missing.join(", and ")
        ));
    }
    let description = wansim::PRESETS
        .iter()
        .find(|p| p.0 == o.preset)
        .map_or("", |p| p.1);
    let params = wansim::preset(&o.preset).map_err(|e| e.to_string())?;
    let jobs: Vec<(String, Job)> = o
        .workloads
        .iter()
        .map(|w| {
            let j = compare::parse_job(w)?;
            if matches!(j, Job::Trace(_)) {
                return Err("the showcase runs oratcp:, gen: and file: workloads".to_string());
            }
            Ok((j.label(), j))
        })
        .collect::<Result<_, String>>()?;
    if jobs.is_empty() {
        return Err("give at least one --workload".into());
    }
    let (stated, stated_words) = stated_link(&params);
    let id = std::process::id() % 100_000;
    eprintln!("showcase: building the WAN {} ({description})", o.preset);
    // Declared before the stage, so the daemons stop before their namespaces go.
    let wan = Wan::start(&format!("wshow{id}"), params).map_err(|e| e.to_string())?;
    let dir = std::env::temp_dir().join(format!("wanopt-showcase-{id}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let mut stage = Stage {
        dir: dir.clone(),
        daemons: Vec::new(),
    };
    let certs = Command::new(&o.wanoptd)
        .args(["certs", "--out"])
        .arg(dir.join("certs"))
        .args(["west", "east"])
        .output()
        .map_err(|e| {
            format!(
                "cannot run {}: {e} (give --wanoptd PATH)",
                o.wanoptd.display()
            )
        })?;
    if !certs.status.success() {
        return Err(format!(
            "wanoptd certs: {}",
            String::from_utf8_lossy(&certs.stderr).trim()
        ));
    }
    let east_ip = IpAddr::V4(Site::East.addr());
    let opts = ServerOpts {
        bind: SocketAddr::new(east_ip, SERVER_PORT),
        file: dir.join("oratcp.tmp"),
        sockbuf: None,
    };
    let listener = {
        let o = opts.clone();
        wan.in_site(Site::East, move || server::bind(&o))
            .map_err(|e| format!("east: {e}"))?
            .map_err(|e| format!("test server: {e}"))?
    };
    std::thread::spawn(move || server::serve(listener, &opts));
    let target = SocketAddr::new(east_ip, SERVER_PORT);
    stage.start(
        &wan,
        Site::East,
        &site_yaml(
            Site::East,
            &format!("  listen: {east_ip}:{LINK_PORT}\n{stated}"),
            &dir,
            &format!(
                "  - name: bulk\n    target: {target}\n  - name: sync\n    target: {target}\n    class: latency\n"
            ),
            "",
        ),
        &o.wanoptd,
    )?;
    stage.wait_for("east", "bound", Duration::from_secs(20))?;
    stage.start(
        &wan,
        Site::West,
        &site_yaml(
            Site::West,
            &format!("  connect: {east_ip}:{LINK_PORT}\n{stated}"),
            &dir,
            &format!(
                "  - name: bulk\n    listen: 127.0.0.1:{BULK_PORT}\n  - name: sync\n    listen: 127.0.0.1:{SYNC_PORT}\n    class: latency\n"
            ),
            &format!("admin:\n  listen: 127.0.0.1:{ADMIN_PORT}\n"),
        ),
        &o.wanoptd,
    )?;
    stage.wait_for("west", "link up", Duration::from_secs(30))?;
    let mut report = format!("{} ({description}); {stated_words}\n", o.preset);
    eprintln!("showcase: the pair is up; {stated_words}");
    let mut runs: Vec<(String, Vec<Row>)> = Vec::new();
    for (label, job) in jobs {
        // SYNC round trips go through the latency service, everything else through bulk.
        let sync = matches!(&job, Job::Oratcp(c) if c.mode == crate::client::Mode::Sync);
        let port = if sync { SYNC_PORT } else { BULK_PORT };
        let service = if sync { "sync" } else { "bulk" };
        let path = |name: &str, addr: String, cc: Option<&str>, metrics: bool| PathSpec {
            name: name.into(),
            addr,
            congestion: cc.map(String::from),
            metrics: metrics.then(|| format!("http://127.0.0.1:{ADMIN_PORT}/metrics")),
        };
        let paths = vec![
            path("direct CUBIC", target.to_string(), Some("cubic"), false),
            path("direct BBR", target.to_string(), Some("bbr"), false),
            path("wanopt", format!("127.0.0.1:{port}"), None, true),
        ];
        eprintln!("showcase: {label}");
        let rows = wan
            .in_site(Site::West, move || {
                compare::compare(&paths, &job, Some(service))
            })
            .map_err(|e| format!("west: {e}"))??;
        report += &format!("\n{label}\n{}", compare::table(&rows));
        runs.push((label, rows));
    }
    report += "\n";
    for (label, rows) in &runs {
        if let [cubic, bbr, pair] = rows.as_slice() {
            report += &format!(
                "{label}: wanopt moved {:.1}x the bytes per second of direct CUBIC and {:.1}x of direct BBR",
                pair.speedup,
                pair.speedup / bbr.speedup.max(f64::MIN_POSITIVE)
            );
            if let (Some(c), Some(b), Some(p)) =
                (&cubic.latency_ms, &bbr.latency_ms, &pair.latency_ms)
            {
                report += &format!(
                    "; round trips p99 {:.1} ms (direct CUBIC {:.1}, BBR {:.1})",
                    p.p99, c.p99, b.p99
                );
            }
            if let Some(g) = pair.gain {
                report += &format!("; it sent {:.0}% of the bytes", 100.0 / g);
            }
            report += "\n";
        }
    }
    let (a, b) = wan.counters();
    report += &format!("wansim west->east: {a}\nwansim east->west: {b}\n");
    drop(stage);
    drop(wan);
    if let Some(f) = &o.svg {
        compare::write_svg(f, &format!("{}: throughput per path", o.preset), &runs)?;
        report += &format!("chart: {}\n", f.display());
    }
    Ok(report)
}
