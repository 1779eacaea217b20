//! wansim: a reproducible long, lossy WAN on one machine, for tests, benchmarks and users without an
//! emulator appliance.
//!
//! [`Wan::start`] makes two network namespaces (`PREFIX-west`, `PREFIX-east`), each with a TUN device
//! owned by this process, and forwards IP packets between them through a [`shaper::Shaper`] per
//! direction: rate, delay, jitter, random and bursty loss, reordering, duplication, a drop-tail
//! queue. One reader thread and one writer thread per direction do the forwarding; writers sleep with
//! `clock_nanosleep` and 1 ns timer slack, so packet timing is far finer than tokio's 1 ms timer.

pub mod shaper;
pub mod sys;

use std::collections::BinaryHeap;
use std::net::Ipv4Addr;
use std::os::fd::OwnedFd;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rand::SeedableRng;
use shaper::Shaper;
pub use shaper::{BurstClock, DirParams, DropCause, GilbertElliott, QueueLimit, Verdict};

/// A wansim failure.
#[derive(Debug, thiserror::Error)]
pub enum WansimError {
    #[error("wansim needs {}", .0.join(", and "))]
    Missing(Vec<String>),
    #[error("setup failed: {0}")]
    Setup(String),
    #[error("unknown preset {0:?} (known: {1})")]
    UnknownPreset(String, String),
}

/// One end of the emulated link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Site {
    West,
    East,
}

impl Site {
    pub fn name(self) -> &'static str {
        match self {
            Site::West => "west",
            Site::East => "east",
        }
    }
    /// The site's address on the emulated link.
    pub fn addr(self) -> Ipv4Addr {
        // 198.18.0.0/15 is reserved for benchmarking (RFC 2544); it only exists inside our namespaces.
        match self {
            Site::West => Ipv4Addr::new(198, 18, 0, 1),
            Site::East => Ipv4Addr::new(198, 18, 0, 2),
        }
    }
    pub fn parse(s: &str) -> Option<Site> {
        match s {
            "west" => Some(Site::West),
            "east" => Some(Site::East),
            _ => None,
        }
    }
}

/// Parameters of both directions.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LinkParams {
    /// West to east.
    pub w2e: DirParams,
    /// East to west.
    pub e2w: DirParams,
    /// Seed of the loss and jitter random numbers (reproducible runs).
    pub seed: u64,
}

impl LinkParams {
    /// The same impairments both ways.
    pub fn symmetric(d: DirParams) -> Self {
        LinkParams {
            w2e: d.clone(),
            e2w: d,
            seed: 1,
        }
    }

    /// What a daemon pair across this link should state as `link.bandwidth` and `link.rtt`:
    /// the slower direction's rate (`None` if neither is limited) and the round trip of the two
    /// one-way delays.
    pub fn stated(&self) -> (Option<u64>, Duration) {
        let rate = match (self.w2e.rate_bps, self.e2w.rate_bps) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        (rate, self.w2e.delay + self.e2w.delay)
    }
}

/// Named reference links. Presets are named by round-trip time; loss is split evenly per direction.
pub const PRESETS: &[(&str, &str)] = &[
    ("t3-100ms-clean", "45 Mbit/s, 100 ms RTT, no loss"),
    (
        "t3-100ms-0.5",
        "45 Mbit/s, 100 ms RTT, 0.5% loss (0.25% each way): the appliance brief's link",
    ),
    (
        "t3-100ms-1",
        "45 Mbit/s, 100 ms RTT, 1% loss (0.5% each way)",
    ),
    (
        "t3-100ms-burst",
        "45 Mbit/s, 100 ms RTT, 2% loss (1% each way) in bursts of 5 packets on average (Gilbert-Elliott)",
    ),
    (
        "t3-100ms-fade",
        "45 Mbit/s, 100 ms RTT, 2% loss (1% each way) in bursts of 5 packet times (1.3 ms) on average: t3-100ms-burst with bursts that last a time, not a number of packets",
    ),
    (
        "oc3-40ms-1",
        "135 Mbit/s, 40 ms RTT, 1% loss (0.5% each way)",
    ),
    ("metro-20ms", "1 Gbit/s, 20 ms RTT, no loss"),
    ("lan", "1 Gbit/s, 0.1 ms RTT, no loss"),
];

/// The parameters of a preset.
pub fn preset(name: &str) -> Result<LinkParams, WansimError> {
    // Loss: the total of both directions, and the mean run of packets lost together (bursty
    // presets) or none (independent loss).
    // Bursts counted in packets, or (`fade`) in full-size packets' time at the line rate.
    let fade = name == "t3-100ms-fade";
    let (rate, rtt_us, loss_total, burst): (u64, u64, f64, Option<f64>) = match name {
        "t3-100ms-clean" => (45_000_000, 100_000, 0.0, None),
        "t3-100ms-0.5" => (45_000_000, 100_000, 0.005, None),
        "t3-100ms-1" => (45_000_000, 100_000, 0.01, None),
        "t3-100ms-burst" | "t3-100ms-fade" => (45_000_000, 100_000, 0.02, Some(5.0)),
        "oc3-40ms-1" => (135_000_000, 40_000, 0.01, None),
        "metro-20ms" => (1_000_000_000, 20_000, 0.0, None),
        "lan" => (1_000_000_000, 100, 0.0, None),
        _ => {
            let known: Vec<&str> = PRESETS.iter().map(|p| p.0).collect();
            return Err(WansimError::UnknownPreset(
                name.to_string(),
                known.join(", "),
            ));
        }
    };
    let (loss, burst) = match burst {
        Some(b) => (
            0.0,
            GilbertElliott::bursts(loss_total / 2.0, b)
                .map(|g| if fade { g.timed(rate, 1500) } else { g }),
        ),
        None => (loss_total / 2.0, None),
    };
    Ok(LinkParams::symmetric(DirParams {
        rate_bps: Some(rate),
        delay: Duration::from_micros(rtt_us / 2),
        loss,
        burst,
        ..DirParams::default()
    }))
}

/// Live counters of one direction.
#[derive(Debug, Default)]
pub struct DirCounters {
    pub packets_in: AtomicU64,
    pub bytes_in: AtomicU64,
    pub packets_out: AtomicU64,
    pub bytes_out: AtomicU64,
    pub drop_loss: AtomicU64,
    pub drop_burst: AtomicU64,
    pub drop_queue: AtomicU64,
    pub drop_cut: AtomicU64,
    pub duplicated: AtomicU64,
    pub queue_bytes: AtomicU64,
    pub queue_max_bytes: AtomicU64,
    /// Lateness of deliveries against their scheduled time.
    pub late_sum_ns: AtomicU64,
    pub late_max_ns: AtomicU64,
    pub late_over_1ms: AtomicU64,
}

/// A copy of one direction's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DirSnapshot {
    pub packets_in: u64,
    pub bytes_in: u64,
    pub packets_out: u64,
    pub bytes_out: u64,
    pub drop_loss: u64,
    pub drop_burst: u64,
    pub drop_queue: u64,
    pub drop_cut: u64,
    pub duplicated: u64,
    pub queue_bytes: u64,
    pub queue_max_bytes: u64,
    pub late_mean_ns: u64,
    pub late_max_ns: u64,
    pub late_over_1ms: u64,
}

impl DirCounters {
    pub fn snapshot(&self) -> DirSnapshot {
        let out = self.packets_out.load(Relaxed);
        DirSnapshot {
            packets_in: self.packets_in.load(Relaxed),
            bytes_in: self.bytes_in.load(Relaxed),
            packets_out: out,
            bytes_out: self.bytes_out.load(Relaxed),
            drop_loss: self.drop_loss.load(Relaxed),
            drop_burst: self.drop_burst.load(Relaxed),
            drop_queue: self.drop_queue.load(Relaxed),
            drop_cut: self.drop_cut.load(Relaxed),
            duplicated: self.duplicated.load(Relaxed),
            queue_bytes: self.queue_bytes.load(Relaxed),
            queue_max_bytes: self.queue_max_bytes.load(Relaxed),
            late_mean_ns: self.late_sum_ns.load(Relaxed) / out.max(1),
            late_max_ns: self.late_max_ns.load(Relaxed),
            late_over_1ms: self.late_over_1ms.load(Relaxed),
        }
    }
}

impl std::fmt::Display for DirSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "in {} pkts/{} B, out {} pkts/{} B, drops loss {} burst {} queue {} cut {}, dup {}, queue {} B (max {} B), lateness mean {} µs max {} µs (>1 ms: {})",
            self.packets_in,
            self.bytes_in,
            self.packets_out,
            self.bytes_out,
            self.drop_loss,
            self.drop_burst,
            self.drop_queue,
            self.drop_cut,
            self.duplicated,
            self.queue_bytes,
            self.queue_max_bytes,
            self.late_mean_ns / 1000,
            self.late_max_ns / 1000,
            self.late_over_1ms
        )
    }
}

/// A packet waiting in the delay line, ordered by delivery time then arrival.
struct Pending {
    at: Instant,
    seq: u64,
    pkt: Vec<u8>,
}
impl PartialEq for Pending {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Pending {}
impl PartialOrd for Pending {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Pending {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        // Reversed: BinaryHeap is a max-heap, we want the earliest first.
        (o.at, o.seq).cmp(&(self.at, self.seq))
    }
}

#[derive(Default)]
struct DelayLine {
    heap: Mutex<BinaryHeap<Pending>>,
    ready: Condvar,
}

/// A running emulated link. Dropping it stops forwarding and removes the namespaces.
pub struct Wan {
    prefix: String,
    params: Arc<Mutex<LinkParams>>,
    counters: Arc<[DirCounters; 2]>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Wan {
    /// Creates the namespaces and devices and starts forwarding. Leftovers of an earlier instance
    /// with the same prefix are removed first.
    pub fn start(prefix: &str, params: LinkParams) -> Result<Wan, WansimError> {
        let missing = sys::missing_prerequisites();
        if !missing.is_empty() {
            return Err(WansimError::Missing(missing));
        }
        if prefix.is_empty()
            || prefix.len() > 40
            || !prefix
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        {
            return Err(WansimError::Setup(format!(
                "prefix {prefix:?} must be 1-40 letters, digits or dashes"
            )));
        }
        down(prefix);
        let mut wan = Wan {
            prefix: prefix.to_string(),
            params: Arc::new(Mutex::new(params)),
            counters: Arc::default(),
            stop: Arc::new(AtomicBool::new(false)),
            threads: Vec::new(),
        };
        let mut tuns = Vec::new();
        for site in [Site::West, Site::East] {
            let ns = wan.netns(site);
            sys::ip(&["netns", "add", &ns])?;
            sys::disable_ipv6(&ns)?;
            let tun = sys::create_tun()?;
            sys::ip(&["link", "set", &tun.name, "netns", &ns])?;
            sys::ip(&["-n", &ns, "link", "set", &tun.name, "name", "wan0"])?;
            let me = site.addr().to_string();
            let peer = match site {
                Site::West => Site::East,
                Site::East => Site::West,
            }
            .addr()
            .to_string();
            sys::ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{me}/32"),
                "peer",
                &format!("{peer}/32"),
                "dev",
                "wan0",
            ])?;
            // The device's own queue (500 packets by default) holds what a site sends while the
            // emulator's reader is not scheduled; 4096 rides out a ~250 ms stall at 16k packets/s,
            // so the emulated queue, not the host's scheduler, decides what is dropped.
            sys::ip(&[
                "-n",
                &ns,
                "link",
                "set",
                "wan0",
                "mtu",
                "1500",
                "txqueuelen",
                "4096",
                "up",
            ])?;
            sys::ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            tuns.push(tun.fd);
        }
        let east_fd = tuns
            .pop()
            .ok_or_else(|| WansimError::Setup("no east device".into()))?;
        let west_fd = tuns
            .pop()
            .ok_or_else(|| WansimError::Setup("no west device".into()))?;
        let west = Arc::new(west_fd);
        let east = Arc::new(east_fd);
        wan.spawn_direction(0, west.clone(), east.clone())?;
        wan.spawn_direction(1, east, west)?;
        Ok(wan)
    }

    fn spawn_direction(
        &mut self,
        dir: usize,
        from: Arc<OwnedFd>,
        to: Arc<OwnedFd>,
    ) -> Result<(), WansimError> {
        let line = Arc::new(DelayLine::default());
        let (params, counters, stop, l2) = (
            self.params.clone(),
            self.counters.clone(),
            self.stop.clone(),
            line.clone(),
        );
        let seed = self.params.lock().map(|p| p.seed).unwrap_or(1) ^ (dir as u64 * 0x9E37_79B9);
        let reader = std::thread::Builder::new()
            .name(format!("wansim-rx{dir}"))
            .spawn(move || forward_in(dir, &from, &params, &counters[dir], &stop, &l2, seed))
            .map_err(|e| WansimError::Setup(format!("thread: {e}")))?;
        let (counters, stop) = (self.counters.clone(), self.stop.clone());
        let writer = std::thread::Builder::new()
            .name(format!("wansim-tx{dir}"))
            .spawn(move || forward_out(&to, &counters[dir], &stop, &line))
            .map_err(|e| WansimError::Setup(format!("thread: {e}")))?;
        self.threads.push(reader);
        self.threads.push(writer);
        Ok(())
    }

    /// The network namespace of a site.
    pub fn netns(&self, site: Site) -> String {
        format!("{}-{}", self.prefix, site.name())
    }

    /// A command that runs `program` inside a site's namespace.
    pub fn command(&self, site: Site, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.netns(site), program]);
        c
    }

    /// Runs `f` on a thread inside a site's namespace; sockets it makes stay in that namespace.
    pub fn in_site<T: Send + 'static>(
        &self,
        site: Site,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> std::io::Result<T> {
        let ns = self.netns(site);
        std::thread::spawn(move || {
            sys::enter_netns(&ns)?;
            Ok(f())
        })
        .join()
        .map_err(|_| std::io::Error::other("thread in namespace panicked"))?
    }

    /// Changes the parameters while running (they apply to the next packet).
    pub fn update(&self, f: impl FnOnce(&mut LinkParams)) {
        if let Ok(mut p) = self.params.lock() {
            f(&mut p);
        }
    }

    /// Cuts the link both ways (`true`) or restores it.
    pub fn set_cut(&self, cut: bool) {
        self.update(|p| {
            p.w2e.cut = cut;
            p.e2w.cut = cut;
        });
    }

    /// Counters of (west→east, east→west).
    pub fn counters(&self) -> (DirSnapshot, DirSnapshot) {
        (self.counters[0].snapshot(), self.counters[1].snapshot())
    }

    /// Stops forwarding, removes the namespaces and returns the final counters.
    pub fn stop(mut self) -> (DirSnapshot, DirSnapshot) {
        self.shutdown();
        self.counters()
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        down(&self.prefix);
    }
}

impl Drop for Wan {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Removes the namespaces of an instance (running or crashed). Returns the names removed.
pub fn down(prefix: &str) -> Vec<String> {
    let mut removed = Vec::new();
    for site in [Site::West, Site::East] {
        let ns = format!("{prefix}-{}", site.name());
        if sys::list_netns().contains(&ns) && sys::ip(&["netns", "delete", &ns]).is_ok() {
            removed.push(ns);
        }
    }
    removed
}

fn forward_in(
    _dir: usize,
    from: &OwnedFd,
    params: &Mutex<LinkParams>,
    c: &DirCounters,
    stop: &AtomicBool,
    line: &DelayLine,
    seed: u64,
) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut shaper = Shaper::new(Instant::now());
    let mut buf = vec![0u8; 65536];
    let mut seq = 0u64;
    let dir_params = |p: &LinkParams| {
        if _dir == 0 {
            p.w2e.clone()
        } else {
            p.e2w.clone()
        }
    };
    let mut current = params.lock().map(|p| dir_params(&p)).unwrap_or_default();
    while !stop.load(Relaxed) {
        if !sys::poll_readable(from, 50) {
            continue;
        }
        let Some(n) = sys::read_packet(from, &mut buf) else {
            continue;
        };
        let now = Instant::now();
        if let Ok(p) = params.try_lock() {
            current = dir_params(&p);
        }
        c.packets_in.fetch_add(1, Relaxed);
        c.bytes_in.fetch_add(n as u64, Relaxed);
        let verdict = shaper.admit(now, n, &current, &mut rng);
        let q = shaper.backlog_bytes(now, &current);
        c.queue_bytes.store(q, Relaxed);
        c.queue_max_bytes.fetch_max(q, Relaxed);
        match verdict {
            Verdict::Drop(cause) => {
                let ctr = match cause {
                    DropCause::Loss => &c.drop_loss,
                    DropCause::Burst => &c.drop_burst,
                    DropCause::Queue => &c.drop_queue,
                    DropCause::Cut => &c.drop_cut,
                };
                ctr.fetch_add(1, Relaxed);
            }
            Verdict::Deliver { at, duplicate } => {
                let mut heap = line.heap.lock().unwrap_or_else(|e| e.into_inner());
                for _ in 0..if duplicate { 2 } else { 1 } {
                    seq += 1;
                    heap.push(Pending {
                        at,
                        seq,
                        pkt: buf[..n].to_vec(),
                    });
                }
                if duplicate {
                    c.duplicated.fetch_add(1, Relaxed);
                }
                drop(heap);
                line.ready.notify_one();
            }
        }
    }
}

fn forward_out(to: &OwnedFd, c: &DirCounters, stop: &AtomicBool, line: &DelayLine) {
    sys::precise_timers();
    loop {
        let next = {
            let mut heap = line.heap.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if stop.load(Relaxed) {
                    return;
                }
                let now = Instant::now();
                match heap.peek().map(|p| p.at) {
                    Some(at) if at <= now => break heap.pop(),
                    Some(at) => {
                        // Wake a little early, then sleep the rest precisely without the lock.
                        let wait = at - now;
                        if wait > Duration::from_micros(200) {
                            heap = line
                                .ready
                                .wait_timeout(heap, wait - Duration::from_micros(100))
                                .unwrap_or_else(|e| e.into_inner())
                                .0;
                        } else {
                            drop(heap);
                            sys::sleep_until(at);
                            heap = line.heap.lock().unwrap_or_else(|e| e.into_inner());
                        }
                    }
                    None => {
                        heap = line
                            .ready
                            .wait_timeout(heap, Duration::from_millis(50))
                            .unwrap_or_else(|e| e.into_inner())
                            .0;
                    }
                }
            }
        };
        let Some(p) = next else { continue };
        sys::write_packet(to, &p.pkt);
        let late = Instant::now().saturating_duration_since(p.at).as_nanos() as u64;
        c.late_sum_ns.fetch_add(late, Relaxed);
        c.late_max_ns.fetch_max(late, Relaxed);
        if late > 1_000_000 {
            c.late_over_1ms.fetch_add(1, Relaxed);
        }
        c.packets_out.fetch_add(1, Relaxed);
        c.bytes_out.fetch_add(p.pkt.len() as u64, Relaxed);
    }
}

/// What this host lacks to run wansim (root, TUN, `ip`), in words; empty when it can.
pub fn missing_prerequisites() -> Vec<String> {
    sys::missing_prerequisites()
}

/// For tests: true if wansim can run here. Otherwise prints why and returns false, unless
/// `WANOPT_REQUIRE_NETNS=1` is set (as in CI), where it panics so the test cannot skip silently.
pub fn available_or_skip(test: &str) -> bool {
    let missing = missing_prerequisites();
    if missing.is_empty() {
        return true;
    }
    let why = missing.join(", and ");
    if std::env::var("WANOPT_REQUIRE_NETNS").as_deref() == Ok("1") {
        panic!("{test}: WANOPT_REQUIRE_NETNS=1 but wansim cannot run here: needs {why}");
    }
    eprintln!("SKIPPED {test}: needs {why}");
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_states_its_own_bandwidth_and_rtt() {
        let stated = |n: &str| preset(n).map(|p| p.stated()).ok();
        assert_eq!(
            stated("t3-100ms-0.5"),
            Some((Some(45_000_000), Duration::from_millis(100)))
        );
        assert_eq!(
            stated("metro-20ms"),
            Some((Some(1_000_000_000), Duration::from_millis(20)))
        );
        for (name, _) in PRESETS {
            let (rate, rtt) = stated(name).expect("preset");
            assert!(rate.is_some() && !rtt.is_zero(), "{name}");
        }
        // The bursty T3: 1% each way, in runs of 5 packets on average.
        let b = preset("t3-100ms-burst").expect("preset");
        let ge = b.w2e.burst.expect("bursty");
        assert!(b.w2e.loss == 0.0 && b.e2w.burst == Some(ge));
        assert!((ge.mean_loss() - 0.01).abs() < 1e-9 && (ge.mean_burst() - 5.0).abs() < 1e-9);
        assert_eq!(ge.clock, BurstClock::Packet);
        // The fading T3: the same bursts, stepped by a 1500-byte packet's time at 45 Mbit/s.
        let f = preset("t3-100ms-fade")
            .expect("preset")
            .w2e
            .burst
            .expect("bursty");
        assert_eq!(f, ge.timed(45_000_000, 1500));
        let mut p = LinkParams::symmetric(DirParams::default());
        p.e2w.rate_bps = Some(10_000_000);
        assert_eq!(p.stated(), (Some(10_000_000), Duration::ZERO));
    }
}
