//! `wansim`: the command line of the WAN emulator.
//!
//! `wansim up` builds the link and forwards until SIGINT/SIGTERM (counters on SIGUSR1 and at exit);
//! `wansim exec SITE -- CMD` runs a command in a site; `wansim down` removes an instance's
//! namespaces, also after a crash; `wansim presets` lists the reference links.

use std::process::ExitCode;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use wanopt_units::{parse_duration, parse_probability, parse_rate, parse_size};
use wansim::{BurstClock, DirParams, GilbertElliott, LinkParams, QueueLimit, Site, Wan};

#[derive(Parser)]
#[command(
    name = "wansim",
    version,
    about = "A reproducible long, lossy WAN between two network namespaces"
)]
struct Cli {
    /// Instance prefix: namespaces are PREFIX-west and PREFIX-east.
    #[arg(long, global = true, default_value = "wansim")]
    prefix: String,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Create the sites and forward packets until interrupted.
    Up(Box<UpArgs>),
    /// Run a command inside a site's namespace (west or east).
    Exec {
        site: String,
        #[arg(last = true, required = true)]
        cmd: Vec<String>,
    },
    /// Remove an instance's namespaces (after a crash too).
    Down,
    /// List the presets.
    Presets,
}

/// Every impairment applies to each direction alike; loss values are per direction.
#[derive(Args)]
struct UpArgs {
    /// Start from a preset (see `wansim presets`); the options below override it.
    #[arg(long)]
    preset: Option<String>,
    /// Bottleneck rate, e.g. 45mbit.
    #[arg(long)]
    rate: Option<String>,
    /// Round-trip time; each direction gets half.
    #[arg(long, conflicts_with = "delay")]
    rtt: Option<String>,
    /// One-way delay per direction.
    #[arg(long)]
    delay: Option<String>,
    /// Random extra delay per packet, uniform in [0, JITTER); order is kept unless --reorder.
    #[arg(long)]
    jitter: Option<String>,
    /// Random loss per direction, e.g. 0.25%.
    #[arg(long)]
    loss: Option<String>,
    /// Bursty loss, netem gemodel meanings: P[,R[,1-H[,1-K]]], e.g. 1%,25%.
    #[arg(long, conflicts_with = "burst_loss")]
    ge: Option<String>,
    /// Bursty loss per direction as its mean and the mean run of packets lost together:
    /// LOSS,PACKETS, e.g. 1%,5 (Gilbert-Elliott).
    #[arg(long)]
    burst_loss: Option<String>,
    /// What steps the burst model: `packet` (netem's way: a burst takes the next packets
    /// however late they come) or `line` (a full-size packet's time at the rate: a burst lasts
    /// a time).
    #[arg(long, value_parser = ["packet", "line"])]
    burst_clock: Option<String>,
    /// Probability that a packet skips ahead of others.
    #[arg(long)]
    reorder: Option<String>,
    /// Probability that a packet is delivered twice.
    #[arg(long)]
    duplicate: Option<String>,
    /// Drop-tail queue limit: bytes (256KiB) or time at line rate (100ms).
    #[arg(long)]
    queue: Option<String>,
    /// Seed of the random numbers.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

fn build(a: &UpArgs) -> Result<LinkParams, String> {
    let mut lp = match &a.preset {
        Some(p) => wansim::preset(p).map_err(|e| e.to_string())?,
        None => LinkParams::symmetric(DirParams::default()),
    };
    let mut d = lp.w2e.clone();
    let field = |name: &str, e: String| format!("--{name}: {e}");
    if let Some(r) = &a.rate {
        d.rate_bps = Some(parse_rate(r).map_err(|e| field("rate", e))?);
    }
    if let Some(r) = &a.rtt {
        d.delay = parse_duration(r).map_err(|e| field("rtt", e))? / 2;
    }
    if let Some(r) = &a.delay {
        d.delay = parse_duration(r).map_err(|e| field("delay", e))?;
    }
    if let Some(r) = &a.jitter {
        d.jitter = parse_duration(r).map_err(|e| field("jitter", e))?;
    }
    if let Some(r) = &a.loss {
        d.loss = parse_probability(r).map_err(|e| field("loss", e))?;
    }
    if let Some(r) = &a.reorder {
        d.reorder = parse_probability(r).map_err(|e| field("reorder", e))?;
    }
    if let Some(r) = &a.duplicate {
        d.duplicate = parse_probability(r).map_err(|e| field("duplicate", e))?;
    }
    if let Some(q) = &a.queue {
        d.queue = match parse_duration(q) {
            Ok(t) => QueueLimit::Time(t),
            Err(_) => QueueLimit::Bytes(parse_size(q).map_err(|e| field("queue", e))?),
        };
    }
    if let Some(b) = &a.burst_loss {
        let (loss, len) = b
            .split_once(',')
            .ok_or("--burst-loss: give LOSS,PACKETS, e.g. 1%,5")?;
        let loss = parse_probability(loss).map_err(|e| field("burst-loss", e))?;
        let len: f64 = len
            .trim()
            .parse()
            .map_err(|_| format!("--burst-loss: {len:?} is not a number of packets"))?;
        d.burst = Some(GilbertElliott::bursts(loss, len).ok_or_else(|| {
            "--burst-loss: the loss must be above 0 and below 100%, the run at least 1 packet"
                .to_string()
        })?);
    }
    if let Some(g) = &a.ge {
        let v: Vec<f64> = g
            .split(',')
            .map(parse_probability)
            .collect::<Result<_, _>>()
            .map_err(|e| field("ge", e))?;
        if v.is_empty() || v.len() > 4 {
            return Err("--ge: give P[,R[,1-H[,1-K]]]".into());
        }
        // netem defaults: r = 1 - p, 1-h = 1, 1-k = 0.
        d.burst = Some(GilbertElliott {
            p: v[0],
            r: v.get(1).copied().unwrap_or(1.0 - v[0]),
            bad_loss: v.get(2).copied().unwrap_or(1.0),
            good_loss: v.get(3).copied().unwrap_or(0.0),
            clock: BurstClock::Packet,
        });
    }
    if let Some(c) = &a.burst_clock {
        let ge = d
            .burst
            .as_mut()
            .ok_or("--burst-clock: give --burst-loss, --ge or a bursty preset too")?;
        ge.clock = BurstClock::Packet;
        if c == "line" {
            let rate = d
                .rate_bps
                .ok_or("--burst-clock line: give --rate (or a preset with one)")?;
            *ge = ge.timed(rate, 1500);
        }
    }
    lp.w2e = d.clone();
    lp.e2w = d;
    lp.seed = a.seed;
    Ok(lp)
}

static SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    SIGNAL.store(sig, Ordering::Relaxed);
}

fn describe(d: &DirParams) -> String {
    let rate = d
        .rate_bps
        .map_or("unlimited".to_string(), |r| format!("{} kbit/s", r / 1000));
    let burst = d.burst.map_or("none".to_string(), |g| {
        format!(
            "{:.3}% in runs of {:.1} {} (p {:.5}, r {:.4}, 1-h {}, 1-k {})",
            g.mean_loss() * 100.0,
            g.mean_burst(),
            match g.clock {
                BurstClock::Packet => "packets".to_string(),
                BurstClock::Time(t) => format!("steps of {t:?}"),
            },
            g.p,
            g.r,
            g.bad_loss,
            g.good_loss
        )
    });
    format!(
        "rate {rate}, delay {:?}, jitter {:?}, loss {:.3}%, burst loss {burst}, queue {} B",
        d.delay,
        d.jitter,
        d.loss * 100.0,
        d.queue_bytes()
    )
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Presets => {
            for (name, what) in wansim::PRESETS {
                println!("{name:<16} {what}");
            }
            ExitCode::SUCCESS
        }
        Cmd::Down => {
            let removed = wansim::down(&cli.prefix);
            println!(
                "removed {} namespace(s): {}",
                removed.len(),
                removed.join(" ")
            );
            ExitCode::SUCCESS
        }
        Cmd::Exec { site, cmd } => {
            let Some(site) = Site::parse(&site) else {
                eprintln!("wansim exec: site must be west or east");
                return ExitCode::from(64);
            };
            let ns = format!("{}-{}", cli.prefix, site.name());
            let status = std::process::Command::new("ip")
                .args(["netns", "exec", &ns])
                .args(&cmd)
                .status();
            match status {
                Ok(s) => ExitCode::from(s.code().unwrap_or(1).clamp(0, 255) as u8),
                Err(e) => {
                    eprintln!("wansim exec: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Cmd::Up(args) => {
            let params = match build(&args) {
                Ok(p) => p,
                Err(e) => {
                    eprintln!("wansim: {e}");
                    return ExitCode::from(64);
                }
            };
            for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGUSR1] {
                // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
                unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
            }
            let wan = match Wan::start(&cli.prefix, params.clone()) {
                Ok(w) => w,
                Err(e) => {
                    eprintln!("wansim: {e}");
                    return ExitCode::FAILURE;
                }
            };
            println!(
                "wansim up: west {} in netns {}, east {} in netns {}",
                Site::West.addr(),
                wan.netns(Site::West),
                Site::East.addr(),
                wan.netns(Site::East)
            );
            println!("  west->east: {}", describe(&params.w2e));
            println!("  east->west: {}", describe(&params.e2w));
            println!(
                "  run commands with: wansim --prefix {} exec west -- CMD; counters: kill -USR1 {}",
                cli.prefix,
                std::process::id()
            );
            loop {
                std::thread::sleep(Duration::from_millis(100));
                match SIGNAL.swap(0, Ordering::Relaxed) {
                    0 => {}
                    s if s == libc::SIGUSR1 => {
                        let (a, b) = wan.counters();
                        println!("west->east: {a}\neast->west: {b}");
                    }
                    _ => break,
                }
            }
            let (a, b) = wan.stop();
            println!("final west->east: {a}\nfinal east->west: {b}");
            ExitCode::SUCCESS
        }
    }
}
