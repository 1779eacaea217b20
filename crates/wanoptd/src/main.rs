//! `wanoptd`: the wanopt daemon, one per gateway site.
//!
//! A thin binary over `wanopt-runtime`: it parses the command line, loads and validates the config
//! (exit 64 on any config or TLS-file problem, before a port is bound), sets up logging and signals,
//! and runs the daemon. `check` validates a config, `certs` mints site certificates, and `demo`
//! runs the shipped west/east pair in one process.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::{Parser, Subcommand};
use wanopt_runtime::config::{LinkRole, ServiceKind};
use wanopt_runtime::counters::Counters;
use wanopt_runtime::{Config, Daemon, DaemonError, HandoverTo, Served, tls};

/// Exit code for a bad config or missing TLS files (EX_USAGE).
const EXIT_CONFIG: u8 = 64;

#[derive(Parser)]
#[command(
    name = "wanoptd",
    version,
    about = "WAN optimization tunnel daemon (one per site)"
)]
struct Cli {
    /// Config file to run with.
    #[arg(short, long, global = true)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the daemon (the default when no subcommand is given).
    Run,
    /// Validate a config and print the effective settings, defaults filled in.
    Check,
    /// Create a site CA (or reuse the one in DIR) and a key and certificate per site; renew
    /// them under the CA there, or revoke them (crl.pem, for `tls.crl`).
    Certs {
        /// Folder for ca.pem, ca.key, SITE.pem and SITE.key.
        #[arg(long)]
        out: PathBuf,
        /// Days the site certificates are valid, from now.
        #[arg(long, default_value_t = tls::SITE_DAYS)]
        days: u32,
        /// New keys and certificates under the CA already in DIR (never a new CA).
        #[arg(long, conflicts_with = "revoke")]
        renew: bool,
        /// Revoke the sites' current certificates: add them to DIR/crl.pem.
        #[arg(long)]
        revoke: bool,
        /// Site names, e.g. `west east`.
        #[arg(required = true)]
        sites: Vec<String>,
    },
    /// Show a running daemon's raw and optimized bytes per service, from its admin endpoint.
    Stats {
        /// Admin endpoint address (default: `admin.listen` of the config given with -c).
        #[arg(long)]
        admin: Option<std::net::SocketAddr>,
        /// Refresh every few seconds, like top.
        #[arg(long)]
        watch: bool,
        /// Seconds between refreshes with --watch.
        #[arg(long, default_value_t = 2)]
        interval: u64,
    },
    /// Run the shipped west and east configs together on loopback (creating their certificates
    /// if absent): a working pair with no other setup.
    Demo {
        /// Folder holding west.yaml and east.yaml.
        #[arg(long, default_value = "config")]
        dir: PathBuf,
    },
}

fn main() -> ExitCode {
    // Started to take a daemon over (by it, on SIGUSR2, or by systemd from its file descriptor
    // store after `systemctl restart`): what it handed over. Read before anything else, while
    // this process has one thread.
    let inherited = wanopt_runtime::daemon::inherited();
    let cli = Cli::parse();
    match cli.cmd.unwrap_or(Cmd::Run) {
        Cmd::Run => {
            // Before the daemon's memory grows (docs/tuning.md, "Huge pages").
            let no_huge_pages = wanopt_runtime::daemon::no_huge_pages();
            let Some(path) = cli.config else {
                eprintln!("wanoptd: no config given; use `wanoptd -c FILE` (see config/west.yaml)");
                return ExitCode::from(EXIT_CONFIG);
            };
            let cfg = match load(&path) {
                Ok(c) => c,
                Err(code) => return code,
            };
            init_logging(&cfg.log_level);
            if !no_huge_pages {
                tracing::warn!(
                    "transparent huge pages stay on: the kernel refused PR_SET_THP_DISABLE"
                );
            }
            let inherited = match inherited {
                Some(Ok(h)) => Some(h),
                Some(Err(e)) => {
                    eprintln!("wanoptd: cannot take the daemon over: {e}");
                    return ExitCode::FAILURE;
                }
                None => None,
            };
            run_daemons(vec![cfg], inherited)
        }
        Cmd::Check => {
            let Some(path) = cli.config else {
                eprintln!("wanoptd check: give the config with -c FILE");
                return ExitCode::from(EXIT_CONFIG);
            };
            match load(&path) {
                Ok(cfg) => check(&cfg),
                Err(code) => code,
            }
        }
        Cmd::Certs {
            out, revoke, sites, ..
        } if revoke => match tls::revoke_site_certs(&out, &sites) {
            Ok(crl) => {
                println!(
                    "revoked {}; wrote {}: set tls.crl to it on every site, then \
                     `systemctl reload` (and `wanoptd certs --renew` the revoked sites)",
                    sites.join(", "),
                    crl.display()
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("wanoptd certs: {e}");
                ExitCode::FAILURE
            }
        },
        Cmd::Certs {
            out,
            days,
            renew,
            sites,
            ..
        } => match tls::create_site_certs(&out, &sites, &tls::Minting { days, renew }) {
            Ok(files) => {
                for f in files {
                    println!("wrote {}", f.display());
                }
                println!("site certificates valid for {days} days from now");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("wanoptd certs: {e}");
                ExitCode::FAILURE
            }
        },
        Cmd::Demo { dir } => demo(&dir),
        Cmd::Stats {
            admin,
            watch,
            interval,
        } => {
            let addr = match (admin, &cli.config) {
                (Some(a), _) => a,
                (None, Some(path)) => match load(path) {
                    Ok(cfg) => match cfg.admin {
                        Some(a) => a.addr,
                        None => {
                            eprintln!(
                                "wanoptd stats: {} has no admin.listen; give --admin ADDR",
                                path.display()
                            );
                            return ExitCode::from(EXIT_CONFIG);
                        }
                    },
                    Err(code) => return code,
                },
                (None, None) => {
                    eprintln!("wanoptd stats: give --admin ADDR or -c FILE");
                    return ExitCode::from(EXIT_CONFIG);
                }
            };
            stats(addr, watch, interval.max(1))
        }
    }
}

/// `wanoptd check`: refuses what `wanoptd` would refuse at start (the config, the TLS files and
/// whether the certificate fits `site` and the CA, the state directory), prints the effective
/// config, and says what only a running pair can show.
fn check(cfg: &Config) -> ExitCode {
    if let Err(e) = tls::load(&cfg.tls) {
        eprintln!("wanoptd: {e}");
        return ExitCode::from(EXIT_CONFIG);
    }
    let mut notes = Vec::new();
    if cfg.optimize.enabled && cfg.optimize.disk.is_some() {
        use wanopt_runtime::secure::{Found, state_dir_as_found};
        match state_dir_as_found(&cfg.state_dir) {
            Err(e) => {
                eprintln!("wanoptd: state_dir: {e}");
                return ExitCode::from(EXIT_CONFIG);
            }
            Ok(Found::Missing) => notes.push(format!(
                "state_dir {} does not exist yet; wanoptd creates it (mode 0700)",
                cfg.state_dir.display()
            )),
            Ok(Found::OwnerUnknown) => notes.push(format!(
                "state_dir {}: checked as root, so its owner was not compared with the daemon's user",
                cfg.state_dir.display()
            )),
            Ok(Found::Checked) => {}
        }
    }
    print!("{}", cfg.describe());
    notes.extend(cfg.warnings().into_iter().map(|w| format!("warning: {w}")));
    notes.push(format!(
        "not checked: the peer's certificate (site {:?}; it is checked when the link comes up), \
         and whether the ports are free (checked when they are bound)",
        cfg.link.peer
    ));
    for n in notes {
        eprintln!("wanoptd check: {n}");
    }
    ExitCode::SUCCESS
}

fn stats(addr: std::net::SocketAddr, watch: bool, interval: u64) -> ExitCode {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("wanoptd stats: {e}");
            return ExitCode::FAILURE;
        }
    };
    loop {
        match rt.block_on(wanopt_runtime::admin::fetch(addr, "/metrics")) {
            Ok(text) => {
                use std::io::Write;
                let clear = if watch { "\x1b[2J\x1b[H" } else { "" };
                let table = wanopt_runtime::stats::render(&text);
                let mut out = std::io::stdout().lock();
                // A reader that went away (`wanoptd stats --watch | head`) ends the command
                // quietly, as any filter's does.
                if write!(out, "{clear}{table}")
                    .and_then(|()| out.flush())
                    .is_err()
                {
                    return ExitCode::SUCCESS;
                }
            }
            Err(e) => {
                eprintln!("wanoptd stats: {addr}: {e}");
                if !watch {
                    return ExitCode::FAILURE;
                }
            }
        }
        if !watch {
            return ExitCode::SUCCESS;
        }
        std::thread::sleep(std::time::Duration::from_secs(interval));
    }
}

fn load(path: &Path) -> Result<Config, ExitCode> {
    Config::load(path).map_err(|e| {
        eprintln!("wanoptd: {e}");
        ExitCode::from(EXIT_CONFIG)
    })
}

fn init_logging(level: &str) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

fn demo(dir: &Path) -> ExitCode {
    let certs = dir.join("certs");
    let missing = ["ca.pem", "west.pem", "west.key", "east.pem", "east.key"]
        .iter()
        .any(|f| !certs.join(f).exists());
    if missing {
        match tls::create_site_certs(&certs, &["west".into(), "east".into()], &Default::default()) {
            Ok(files) => eprintln!(
                "wanoptd demo: created {} certificate files in {}",
                files.len(),
                certs.display()
            ),
            Err(e) => {
                eprintln!("wanoptd demo: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    let mut cfgs = Vec::new();
    for site in ["east", "west"] {
        match load(&dir.join(format!("{site}.yaml"))) {
            Ok(mut c) => {
                // The shipped configs leave state_dir to systemd; the demo keeps its state
                // beside them.
                if c.state_dir == std::path::Path::new(wanopt_runtime::config::defaults::STATE_DIR)
                {
                    c.state_dir = dir.join("state").join(site);
                }
                // The shipped configs listen on the gateway's LAN (0.0.0.0 with an allow list);
                // the demo keeps every listener on loopback.
                let loopback = |a: &mut std::net::SocketAddr| {
                    if !a.ip().is_loopback() {
                        a.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
                    }
                };
                if let LinkRole::Listen(a) = &mut c.link.role {
                    loopback(a);
                }
                for s in &mut c.services {
                    if let ServiceKind::Listen { addr, .. } = &mut s.kind {
                        loopback(addr);
                    }
                }
                if let Some(a) = &mut c.admin {
                    loopback(&mut a.addr);
                }
                cfgs.push(c)
            }
            Err(code) => return code,
        }
    }
    eprintln!(
        "wanoptd demo: every listener is on loopback (127.0.0.1), whatever address the configs give"
    );
    if let Some(bps) = cfgs.iter().filter_map(|c| c.link.max_rate_bps).min() {
        // On loopback the configs' stated WAN is the only limit: say so, or a comparison
        // with direct loopback TCP looks like the tunnel is slow.
        eprintln!(
            "wanoptd demo: bulk services are paced at {:.1} Mbit/s, 95% of the configs' \
             link.bandwidth, as on the WAN they describe, so through the tunnel they run no \
             faster on loopback. Latency-class services (dg) are not paced: on loopback they show \
             no WAN round trip. To see the WAN, compare on an emulated one with \
             `sudo wanopt-replay showcase`",
            bps as f64 / 1e6
        );
    }
    init_logging(&cfgs[0].log_level);
    run_daemons(cfgs, None)
}

/// Binds every daemon (exit 64 for TLS file and state directory problems, 1 for bind failures), then serves until
/// SIGTERM or SIGINT.
fn run_daemons(
    cfgs: Vec<Config>,
    mut inherited: Option<(wanopt_runtime::handover::State, Option<std::fs::File>)>,
) -> ExitCode {
    // A link's bytes move on one runtime thread (for one link a second measured slower:
    // cross-thread wakeups), its encoding work also on the codec's pool of `limits.threads`
    // (see `wanopt_runtime::workers`). Several daemons in one process (several configs) get a
    // runtime thread each, up to `limits.threads`, so their links run side by side.
    // Disk I/O runs on at most 32 blocking threads (the units' TasksMax= counts on it).
    let threads = cfgs.iter().map(|c| c.limits.threads).max().unwrap_or(1);
    let built = if threads.min(cfgs.len()) <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .max_blocking_threads(32)
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.min(cfgs.len()))
            .max_blocking_threads(32)
            .enable_all()
            .build()
    };
    let rt = match built {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("wanoptd: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(async {
        // Several sites in one process (`wanoptd demo`): each site's lines name it.
        let several = cfgs.len() > 1;
        let span_of = |site: &str| {
            if several {
                tracing::info_span!("site", site = %site)
            } else {
                tracing::Span::none()
            }
        };
        let mut daemons = Vec::new();
        for cfg in cfgs {
            let span = span_of(&cfg.site);
            let counters = Arc::new(Counters::default());
            let made = span.in_scope(|| match inherited.take() {
                Some((state, ready)) => Daemon::adopt(cfg, counters, state, ready),
                None => Daemon::bind(cfg, counters),
            });
            match made {
                Ok(d) => daemons.push((d, span)),
                Err(e @ (DaemonError::Tls(_) | DaemonError::StateDir(_))) => {
                    eprintln!("wanoptd: {e}");
                    return ExitCode::from(EXIT_CONFIG);
                }
                Err(e) => {
                    eprintln!("wanoptd: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
        // Signals are watched before readiness, so an early SIGHUP reloads instead of killing us.
        let mut signals = match Signals::new() {
            Ok(s) => s,
            Err(e) => {
                eprintln!("wanoptd: {e:#}");
                return ExitCode::FAILURE;
            }
        };
        // Every listener is bound and the config is valid: tell systemd (Type=notify).
        let peers: Vec<String> = daemons.iter().map(|(d, _)| d.peer_name()).collect();
        wanopt_runtime::notify::ready(&format!("waiting for the link to {}", peers.join(", ")));
        if let Some(every) = wanopt_runtime::notify::watchdog_interval() {
            tokio::spawn(async move {
                loop {
                    wanopt_runtime::notify::send("WATCHDOG=1");
                    tokio::time::sleep(every).await;
                }
            });
        }
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let mut handles = Vec::new();
        let mut reloaders = Vec::new();
        let mut handover_txs = Vec::new();
        let (served_tx, mut served) = tokio::sync::mpsc::unbounded_channel();
        for (d, span) in daemons {
            let mut rx = stop_rx.clone();
            let (tx, reloads) = tokio::sync::mpsc::unbounded_channel();
            let (htx, handovers) = tokio::sync::mpsc::unbounded_channel();
            reloaders.push((d.config_path(), tx));
            handover_txs.push(htx);
            let stop = async move {
                let _ = rx.wait_for(|s| *s).await;
            };
            let served_tx = served_tx.clone();
            handles.push(tokio::spawn(tracing::Instrument::instrument(
                async move {
                    let s = d.serve_full(stop, reloads, handovers).await;
                    let _ = served_tx.send(s);
                },
                span,
            )));
        }
        loop {
            let signal = tokio::select! {
                s = signals.next() => s,
                Some(s) = served.recv() => match s {
                    // Handed over: exit at once, closing nothing (the new process has it all).
                    Served::HandedOver(pid) => {
                        match pid {
                            Some(pid) => tracing::info!(pid, "exiting: the new process serves now"),
                            None => tracing::info!("exiting: systemd starts the new process with the streams"),
                        }
                        std::process::exit(0);
                    }
                    Served::Failed(e) => {
                        tracing::error!(error = %e, "handover failed after the streams were parked; exiting (they are lost, as with a restart)");
                        std::process::exit(1);
                    }
                    // Stopped although no signal said so: systemd is stopping us and the
                    // handover to its store was refused (the daemon drained).
                    Served::Stopped => break,
                },
            };
            match signal {
                Signal::Handover if handover_txs.len() == 1 => {
                    tracing::info!("SIGUSR2: handing over to the binary at our path");
                    for tx in &handover_txs {
                        let _ = tx.send(HandoverTo::Successor);
                    }
                }
                // `systemctl restart` sends SIGTERM as `stop` does; a restart job queued for
                // the unit tells them apart. Only a restart hands over (through systemd's file
                // descriptor store); a stop, or a daemon that cannot tell, drains.
                Signal::Term if handover_txs.len() == 1 && wanopt_runtime::fdstore::capacity().is_some() => {
                    match tokio::task::spawn_blocking(wanopt_runtime::fdstore::restart_queued).await {
                        Ok(Ok(true)) => {
                            tracing::info!("SIGTERM during a restart: handing over through systemd's file descriptor store");
                            for tx in &handover_txs {
                                let _ = tx.send(HandoverTo::FdStore);
                            }
                        }
                        Ok(Ok(false)) => break,
                        Ok(Err(why)) => {
                            tracing::warn!(error = %why, "SIGTERM: cannot tell a restart from a stop; stopping (streams drain)");
                            break;
                        }
                        Err(_) => break,
                    }
                }
                Signal::Term => break,
                Signal::Handover => {
                    tracing::warn!("SIGUSR2: a handover needs one daemon per process (wanoptd demo runs several); ignored");
                }
                Signal::Stop => break,
                Signal::Reload => {
                    for (path, tx) in &reloaders {
                        // An invalid new config is refused and the old one stays in force.
                                                let loaded = Config::load(path).map_err(|e| e.to_string()).and_then(|cfg| {
                            tls::load(&cfg.tls).map(|_| cfg).map_err(|e| e.to_string())
                        });
                        match loaded {
                            Ok(cfg) => {
                                tracing::info!(config = %path.display(), "SIGHUP: reloading");
                                let _ = tx.send(cfg);
                            }
                            Err(e) => tracing::error!(error = %e, "reload refused; the running config stays in force"),
                        }
                    }
                }
            }
        }
        let _ = stop_tx.send(true);
        for h in handles {
            let _ = h.await;
        }
        ExitCode::SUCCESS
    })
}

enum Signal {
    Stop,
    Term,
    Reload,
    Handover,
}

/// SIGTERM and SIGINT stop the daemon gracefully (SIGTERM during `systemctl restart` hands it
/// over through systemd's file descriptor store); SIGHUP reloads the config; SIGUSR2 hands it
/// over to the binary now at its path, keeping every stream.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
    usr2: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> anyhow::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Signals {
            term: signal(SignalKind::terminate()).context("cannot watch SIGTERM")?,
            int: signal(SignalKind::interrupt()).context("cannot watch SIGINT")?,
            hup: signal(SignalKind::hangup()).context("cannot watch SIGHUP")?,
            usr2: signal(SignalKind::user_defined2()).context("cannot watch SIGUSR2")?,
        })
    }

    async fn next(&mut self) -> Signal {
        tokio::select! {
            _ = self.term.recv() => { tracing::info!("SIGTERM received"); Signal::Term }
            _ = self.int.recv() => { tracing::info!("SIGINT received"); Signal::Stop }
            _ = self.hup.recv() => Signal::Reload,
            _ = self.usr2.recv() => Signal::Handover,
        }
    }
}

/// mimalloc keeps freed buffers for reuse instead of returning pages to the kernel on every
/// burst, which removed most page-fault time from the data path in profiles.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
