//! The `wanopt-replay` binary: subcommands, or an oratcptest command line pasted as is.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use wanopt_replay::args::{self, Oratcp};
use wanopt_replay::client::{self, ClientOpts, Limit};
use wanopt_replay::compare;
use wanopt_replay::progress::Progress;
use wanopt_replay::record::{self, RecordOpts};
use wanopt_replay::replay;
use wanopt_replay::server::{self, ServerOpts};
use wanopt_replay::trace;
use wanopt_replay::workload::{self, Workload};

#[derive(Parser)]
#[command(
    name = "wanopt-replay",
    version,
    about = "Benchmark a WAN path: oratcptest-compatible client and server, and synthetic database workloads",
    after_help = "oratcptest command lines work as pasted:\n  wanopt-replay -server -port=5555\n  wanopt-replay HOST -port=5555 -mode=sync -length=8k -duration=10s -interval=2s\nSizes: k/m/g are powers of 1024. Times: 250ms, 10s, 5min, 1h."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

/// How `replay` and `sink` play a trace: which one, at what pace, and how long to wait.
#[derive(clap::Args, Debug)]
struct Play {
    /// The trace `record` wrote.
    #[arg(long)]
    trace: PathBuf,
    /// asap: as fast as causality allows; recorded: also keep the recorded timing.
    #[arg(long, default_value = "asap", value_parser = replay::Pace::parse)]
    pace: replay::Pace,
    /// Longest wait for the peer's bytes.
    #[arg(long, default_value = "30s", value_parser = |s: &str| args::time(s, std::time::Duration::from_secs(1)))]
    timeout: std::time::Duration,
}

#[derive(Subcommand)]
enum Cmd {
    /// Receive test messages (oratcptest -server).
    Server {
        /// Port to listen on.
        #[arg(long)]
        port: u16,
        /// Address to listen on.
        #[arg(long, default_value = "0.0.0.0")]
        bind: std::net::IpAddr,
        /// File written (and synced) per message when a client asks for -write.
        #[arg(long, default_value = "oratcp.tmp")]
        file: PathBuf,
        /// Socket receive buffer size (k/m/g); system default when absent.
        #[arg(long, value_parser = args::size)]
        sockbuf: Option<u64>,
    },
    /// Send test messages to a server (oratcptest client mode).
    Client {
        /// The server host (or a tunnel's local address).
        host: String,
        #[arg(long)]
        port: u16,
        /// sync: wait for each acknowledgement; async: do not.
        #[arg(long, default_value = "sync", value_parser = args::mode)]
        mode: client::Mode,
        /// Message payload length (k/m/g); 1m by default, 0 with --rtt.
        #[arg(long, value_parser = args::size)]
        length: Option<u64>,
        /// Payload lengths uniformly between 512 bytes and --length.
        #[arg(long)]
        random_length: bool,
        /// Delay between messages (a bare number is milliseconds).
        #[arg(long, default_value = "0")]
        delay: String,
        /// Delays uniformly between zero and --delay.
        #[arg(long)]
        random_delay: bool,
        /// Number of TCP connections.
        #[arg(long, default_value_t = 1)]
        num_conn: usize,
        /// random, zero, or a file whose contents are sent.
        #[arg(long, default_value = "random")]
        payload: String,
        /// Test length: a time (10s, 5min) or bytes (1g); forever when absent.
        #[arg(long, value_parser = args::limit)]
        duration: Option<Limit>,
        /// Statistics interval.
        #[arg(long, default_value = "10s")]
        interval: String,
        /// Round-trip mode: SYNC with empty messages.
        #[arg(long)]
        rtt: bool,
        /// The server writes and syncs each message before acknowledging.
        #[arg(long)]
        write: bool,
        /// Socket send buffer size (k/m/g).
        #[arg(long, value_parser = args::size)]
        sockbuf: Option<u64>,
        /// Network timeout.
        #[arg(long)]
        timeout: Option<String>,
        /// Repeat every EVERY for TOTAL, as EVERY/TOTAL (1h/24h).
        #[arg(long, value_parser = args::freq)]
        freq: Option<(std::time::Duration, std::time::Duration)>,
        /// Also write the report to this file.
        #[arg(long)]
        output: Option<PathBuf>,
        /// Print one JSON summary instead of text.
        #[arg(long)]
        json: bool,
        /// Seed of random payloads, lengths and delays.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Record real traffic: a transparent proxy from --listen to --target writing a trace.
    Record {
        /// Address clients connect to (point the real client here).
        #[arg(long)]
        listen: SocketAddr,
        /// The real server, host:port.
        #[arg(long)]
        target: String,
        /// Trace file to write.
        #[arg(long)]
        trace: PathBuf,
        /// Stop after this many connections have finished (default: until Ctrl-C).
        #[arg(long)]
        connections: Option<usize>,
        /// Stop after this long.
        #[arg(long, value_parser = |s: &str| args::time(s, std::time::Duration::from_secs(1)))]
        duration: Option<std::time::Duration>,
    },
    /// Play a trace's client side to a sink through a path (a tunnel's local port, or direct).
    Replay {
        /// host:port of the path (the sink, directly or through the tunnel).
        addr: String,
        #[command(flatten)]
        play: Play,
        /// Print a JSON summary.
        #[arg(long)]
        json: bool,
    },
    /// Play a trace's server side for `replay` clients.
    Sink {
        /// Address to listen on.
        #[arg(long)]
        listen: SocketAddr,
        #[command(flatten)]
        play: Play,
        /// Exit once every connection of the trace was served.
        #[arg(long)]
        once: bool,
    },
    /// Run one workload over two or more paths and print them side by side.
    Compare {
        /// NAME=HOST:PORT[,cc=cubic|bbr][,metrics=http://HOST:PORT/metrics], in table order
        /// (speedups are against the first).
        #[arg(long = "path", required = true, value_parser = compare::parse_path)]
        paths: Vec<compare::PathSpec>,
        /// oratcp:"-mode=sync -length=8k -duration=10s", gen:redo:64m[:SEED] or file:PATH (a
        /// real backup, WAL or binlog; all against a `wanopt-replay server` behind each path) or
        /// trace:FILE (against a `sink`).
        #[arg(long)]
        workload: String,
        /// Count only this service in the tunnel's metrics (default: all services).
        #[arg(long)]
        service: Option<String>,
        /// Print JSON rows instead of the table.
        #[arg(long)]
        json: bool,
        /// Also draw the run as an SVG chart: throughput per path, and round-trip
        /// percentiles when the workload measures latency.
        #[arg(long, value_name = "FILE")]
        svg: Option<PathBuf>,
    },
    /// As root: build a reference WAN with wansim, run a wanoptd pair inside it, and compare
    /// direct TCP (CUBIC and BBR) with the pair on each workload, with a chart.
    Showcase {
        /// The WAN (see `wansim presets`).
        #[arg(long, default_value = "t3-100ms-0.5")]
        preset: String,
        /// Workloads as for compare (oratcp:, gen:, file:), one after another.
        #[arg(
            long = "workload",
            default_values_t = ["gen:redo:16m".to_string(), "oratcp:-mode=sync -length=8k -duration=20s -interval=20s".to_string()]
        )]
        workloads: Vec<String>,
        /// Draw the runs as an SVG chart.
        #[arg(long, value_name = "FILE")]
        svg: Option<PathBuf>,
        /// The daemon binary (default: wanoptd beside this one, else from PATH).
        #[arg(long)]
        wanoptd: Option<PathBuf>,
    },
    /// Write a deterministic synthetic workload (its model: `wanopt-replay gen --help`).
    #[command(long_about = workload::MODEL)]
    Gen {
        /// redo, rman or trail.
        #[arg(value_parser = workload::Workload::parse)]
        workload: Workload,
        /// Bytes to write (k/m/g).
        #[arg(long, default_value = "64m", value_parser = args::size)]
        size: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// rman only: the fraction of blocks changed since version 1 (0.1 = 10%).
        #[arg(long, default_value_t = 0.0)]
        changed: f64,
        /// Output file (stdout when absent).
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    let r = if args::is_oratcptest(&raw) {
        match args::parse_oratcptest(&raw) {
            Ok(Oratcp::Help) => {
                let _ = <Cli as clap::CommandFactory>::command().print_long_help();
                Ok(())
            }
            Ok(Oratcp::Server(s)) => run_server(&s),
            Ok(Oratcp::Client(c)) => run_client(&c),
            Err(e) => {
                eprintln!("wanopt-replay: {e}");
                return ExitCode::from(64);
            }
        }
    } else {
        let cli = Cli::parse();
        run(cli.cmd)
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("wanopt-replay: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// A flag set by SIGINT or SIGTERM, so a recording ends with a complete trace.
fn stop_on_signal() -> &'static std::sync::atomic::AtomicBool {
    static STOP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    extern "C" fn on_signal(_: libc::c_int) {
        STOP.store(true, std::sync::atomic::Ordering::SeqCst);
    }
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    &STOP
}

fn run_server(s: &ServerOpts) -> Result<()> {
    let l = server::bind(s).with_context(|| format!("cannot listen on {}", s.bind))?;
    println!(
        "OraTcpTest-compatible server started on {}.",
        l.local_addr()?
    );
    server::serve(l, s);
    Ok(())
}

fn run_client(c: &ClientOpts) -> Result<()> {
    client::run(c)?;
    Ok(())
}

fn run(cmd: Cmd) -> Result<()> {
    match cmd {
        Cmd::Server {
            port,
            bind,
            file,
            sockbuf,
        } => run_server(&ServerOpts {
            bind: SocketAddr::new(bind, port),
            file,
            sockbuf: sockbuf.map(|n| n as usize).filter(|n| *n > 0),
        }),
        Cmd::Client {
            host,
            port,
            mode,
            length,
            random_length,
            delay,
            random_delay,
            num_conn,
            payload,
            duration,
            interval,
            rtt,
            write,
            sockbuf,
            timeout,
            freq,
            output,
            json,
            seed,
        } => {
            // Build the equivalent oratcptest line so both syntaxes share one set of checks.
            let mut a = vec![host, format!("-port={port}")];
            if let Some(l) = length {
                a.push(format!("-length={l}"));
            }
            a.push(format!("-delay={delay}"));
            a.push(format!("-num_conn={num_conn}"));
            a.push(format!("-payload={payload}"));
            a.push(format!("-interval={interval}"));
            a.push(format!("-seed={seed}"));
            if random_length {
                a.push("-random_length".into());
            }
            if random_delay {
                a.push("-random_delay".into());
            }
            if rtt {
                a.push("-rtt".into());
            }
            if write {
                a.push("-write".into());
            }
            if json {
                a.push("-json".into());
            }
            if let Some(s) = sockbuf {
                a.push(format!("-sockbuf={s}"));
            }
            if let Some(t) = timeout {
                a.push(format!("-timeout={t}"));
            }
            if let Some(o) = &output {
                a.push(format!("-output={}", o.display()));
            }
            let mut c = match args::parse_oratcptest(&a) {
                Ok(Oratcp::Client(c)) => c,
                Ok(_) => anyhow::bail!("not a client command line"),
                Err(e) => anyhow::bail!(e),
            };
            c.mode = if rtt { client::Mode::Sync } else { mode };
            c.duration = duration.unwrap_or(Limit::Forever);
            c.freq = freq;
            if c.length == 0 && matches!(c.duration, Limit::Bytes(_)) {
                anyhow::bail!("a byte --duration needs a non-zero --length");
            }
            run_client(&c)
        }
        Cmd::Record {
            listen,
            target,
            trace,
            connections,
            duration,
        } => {
            let opts = RecordOpts {
                listen,
                target,
                trace,
                connections,
                duration,
            };
            let l = record::bind(&opts)?;
            println!(
                "recording on {} -> {} into {} (Ctrl-C ends the recording)",
                l.local_addr()?,
                opts.target,
                opts.trace.display()
            );
            let stop = stop_on_signal();
            let sum = record::record(l, &opts, stop)?;
            println!(
                "recorded {} connections: {} bytes to the server, {} to the client, {:.3} s",
                sum.connections, sum.bytes_to_server, sum.bytes_to_client, sum.seconds
            );
            Ok(())
        }
        Cmd::Replay {
            addr,
            play:
                Play {
                    trace: path,
                    pace,
                    timeout,
                },
            json,
        } => {
            let events = trace::load(&path)
                .with_context(|| format!("cannot use the trace {}", path.display()))?;
            let sum = replay::replay(&addr, &events, pace, timeout).map_err(anyhow::Error::msg)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&sum)?);
            } else {
                println!(
                    "replayed {} connections through {addr}: {} bytes to the server, {} to the client, every byte verified\n{:.3} s (recorded: {:.3} s)",
                    sum.connections,
                    sum.bytes_to_server,
                    sum.bytes_to_client,
                    sum.seconds,
                    sum.recorded_seconds
                );
            }
            Ok(())
        }
        Cmd::Sink {
            listen,
            play:
                Play {
                    trace: path,
                    pace,
                    timeout,
                },
            once,
        } => {
            let events = trace::load(&path)
                .with_context(|| format!("cannot use the trace {}", path.display()))?;
            let l = std::net::TcpListener::bind(listen)
                .with_context(|| format!("cannot listen on {listen}"))?;
            println!(
                "sink for {} listening on {}",
                path.display(),
                l.local_addr()?
            );
            let n = replay::sink(l, &events, pace, timeout, once).map_err(anyhow::Error::msg)?;
            println!("served {n} connections");
            Ok(())
        }
        Cmd::Compare {
            paths,
            workload,
            service,
            json,
            svg,
        } => {
            if paths.len() < 2 {
                anyhow::bail!("compare needs at least two --path");
            }
            let job = compare::parse_job(&workload).map_err(anyhow::Error::msg)?;
            let rows =
                compare::compare(&paths, &job, service.as_deref()).map_err(anyhow::Error::msg)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                print!("{}", compare::table(&rows));
            }
            if let Some(f) = svg {
                let title = format!("{}: throughput per path", job.label());
                compare::write_svg(&f, &title, &[(job.label(), rows)])
                    .map_err(anyhow::Error::msg)?;
                eprintln!("wanopt-replay: chart written to {}", f.display());
            }
            Ok(())
        }
        Cmd::Showcase {
            preset,
            workloads,
            svg,
            wanoptd,
        } => {
            let opts = wanopt_replay::showcase::ShowcaseOpts {
                preset,
                workloads,
                svg,
                wanoptd: wanoptd.unwrap_or_else(wanopt_replay::showcase::default_wanoptd),
            };
            print!(
                "{}",
                wanopt_replay::showcase::run(&opts).map_err(anyhow::Error::msg)?
            );
            Ok(())
        }
        Cmd::Gen {
            workload,
            size,
            seed,
            changed,
            output,
        } => {
            if !(0.0..=1.0).contains(&changed) {
                anyhow::bail!("--changed must be between 0 and 1");
            }
            let g = workload::Generator::new(workload, seed, changed);
            let mut bar = Progress::new("gen", size);
            match output {
                Some(p) => {
                    let f = std::fs::File::create(&p)
                        .with_context(|| format!("cannot create {}", p.display()))?;
                    let mut w = std::io::BufWriter::new(f);
                    g.write_with(&mut w, size, |n| bar.add(n))?;
                    std::io::Write::flush(&mut w)?;
                }
                None => g.write_with(&mut std::io::stdout().lock(), size, |n| bar.add(n))?,
            }
            bar.finish();
            Ok(())
        }
    }
}
