//! The daemon's YAML config: serde structs that reject unknown keys, parsed into validated types.
//!
//! Parse, don't validate: [`Config::load`] either returns a [`Config`] whose every value is usable
//! (addresses parsed, units converted, names checked, paths resolved against the config file's
//! folder) or a [`ConfigError`] naming the field. The daemon exits 64 on such an error.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use ipnet::IpNet;
use serde::Deserialize;
use wanopt_proto::{Class, CodecSettings, Compression, LongContext, Scope, StreamPolicy};

use crate::units::{parse_duration, parse_rate, parse_size};

/// A config that cannot be used; the message names the field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config {path}: {msg}")]
    Syntax { path: PathBuf, msg: String },
    #[error("config {path}: {field}: {msg}")]
    Field {
        path: PathBuf,
        field: String,
        msg: String,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    site: String,
    link: RawLink,
    tls: RawTls,
    #[serde(default)]
    services: Vec<RawService>,
    #[serde(default)]
    optimize: Option<RawOptimize>,
    #[serde(default)]
    admin: Option<RawAdmin>,
    #[serde(default)]
    state_dir: Option<String>,
    #[serde(default)]
    log: Option<RawLog>,
    #[serde(default)]
    limits: Option<RawLimits>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLink {
    listen: Option<String>,
    connect: Option<String>,
    peer: String,
    bandwidth: Option<String>,
    rtt: Option<String>,
    congestion: Option<String>,
    send_buffer: Option<String>,
    recv_buffer: Option<String>,
    notsent_lowat: Option<String>,
    keepalive: Option<String>,
    user_timeout: Option<String>,
    reconnect_min: Option<String>,
    reconnect_max: Option<String>,
    resume_window: Option<String>,
    latency_lane: Option<bool>,
    lane_congestion: Option<String>,
    max_rate: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTls {
    ca: String,
    cert: String,
    key: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawService {
    name: String,
    listen: Option<String>,
    allow: Option<Vec<String>>,
    target: Option<String>,
    class: Option<String>,
    compression: Option<String>,
    dedup: Option<Toggle>,
    dedup_scope: Option<String>,
    max_streams: Option<u32>,
    max_streams_per_client: Option<u32>,
    idle_timeout: Option<String>,
    redundancy: Option<Word>,
}

/// A word, a number or a YAML boolean (`off` may reach serde as `false`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Word {
    Bool(bool),
    Num(u64),
    Text(String),
}

impl Word {
    fn text(&self) -> String {
        match self {
            Word::Bool(true) => "on".into(),
            Word::Bool(false) => "off".into(),
            Word::Num(n) => n.to_string(),
            Word::Text(s) => s.clone(),
        }
    }
}

/// `on`/`off` or a YAML boolean.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Toggle {
    Bool(bool),
    Word(String),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawOptimize {
    enabled: Option<bool>,
    memory: Option<String>,
    service_memory: Option<String>,
    chunk: Option<String>,
    compression: Option<String>,
    zstd_level: Option<i32>,
    context_window: Option<String>,
    context_streams: Option<usize>,
    delta_memory: Option<String>,
    zstd_adapt: Option<Toggle>,
    dedup: Option<Toggle>,
    dedup_scope: Option<String>,
    disk: Option<RawDisk>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDisk {
    bytes: Option<String>,
    service_bytes: Option<String>,
    delta_bytes: Option<String>,
    key_file: Option<String>,
    checkpoint: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAdmin {
    listen: String,
    allow: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLog {
    level: Option<String>,
}

/// A validated config.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// The file it was loaded from.
    pub path: PathBuf,
    /// This site's name (also its certificate's name).
    pub site: String,
    pub link: LinkSettings,
    pub tls: TlsPaths,
    pub services: Vec<Service>,
    pub optimize: Optimize,
    /// The admin endpoint (Prometheus metrics and `wanoptd stats`).
    pub admin: Option<Admin>,
    pub state_dir: PathBuf,
    /// Log level filter (`RUST_LOG` overrides it).
    pub log_level: String,
    pub limits: Limits,
}

/// The admin endpoint's address and the networks that may reach it (empty: loopback only).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admin {
    pub addr: SocketAddr,
    pub allow: Vec<IpNet>,
}

/// True if a client at `ip` may use a listener with this allow list (empty: any, which the
/// config permits only on loopback). IPv4 clients of an IPv6 socket match IPv4 networks.
pub fn allowed(allow: &[IpNet], ip: IpAddr) -> bool {
    let ip = ip.to_canonical();
    allow.is_empty() || allow.iter().any(|n| n.contains(&ip))
}

/// Which side of the link this daemon is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkRole {
    /// Accept the peer's link on this address.
    Listen(SocketAddr),
    /// Dial the peer at this `host:port`.
    Connect(String),
}

/// A buffer size: kernel autotuning, or an explicit size (which disables autotuning).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BufferSize {
    Auto,
    Bytes(usize),
}

#[derive(Debug, Clone, PartialEq)]
pub struct LinkSettings {
    pub role: LinkRole,
    /// The peer's site name: its certificate must carry it.
    pub peer: String,
    /// Bottleneck bandwidth in bits per second (sizes buffers and windows).
    pub bandwidth_bps: u64,
    /// True when the config states the bandwidth (else it is an assumed default).
    pub bandwidth_stated: bool,
    pub rtt: Duration,
    pub congestion: String,
    pub send_buffer: BufferSize,
    pub recv_buffer: BufferSize,
    pub notsent_lowat: u32,
    pub keepalive: Duration,
    pub user_timeout: Duration,
    pub reconnect_min: Duration,
    pub reconnect_max: Duration,
    /// How long streams wait for a new connection after the link's was lost (zero: they are
    /// reset at once, as before resumption).
    pub resume_window: Duration,
    /// A second connection inside the link for latency-class streams.
    pub latency_lane: bool,
    /// Congestion control of the latency lane: a window-based one, so small messages go out at
    /// once instead of being paced at an app-limited flow's low bandwidth estimate (as BBR does).
    pub lane_congestion: String,
    /// Pacing cap of each link socket in bits per second (`SO_MAX_PACING_RATE`); `None` = off.
    pub max_rate_bps: Option<u64>,
}

impl LinkSettings {
    /// Bandwidth-delay product in bytes.
    pub fn bdp_bytes(&self) -> u64 {
        let bits = self.bandwidth_bps as f64 * self.rtt.as_secs_f64();
        (bits / 8.0) as u64
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsPaths {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Service {
    pub name: String,
    pub class: Class,
    pub kind: ServiceKind,
    /// How this service's bytes are optimized on the way to the peer (this side's choice).
    pub policy: StreamPolicy,
    /// Streams of this service open at once (its clients', or the peer's for a target).
    pub max_streams: u32,
    /// Streams one client address may hold open (listen services).
    pub max_streams_per_client: u32,
    /// A stream with no bytes either way for this long is reset; `None`: never.
    pub idle_timeout: Option<Duration>,
    /// Latency services: how many connections carry the latency lane, each with a copy.
    pub redundancy: crate::redundancy::Redundancy,
}

/// The optimization codec's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Optimize {
    /// Off: the link neither offers nor accepts optimized frames; bytes travel as they are.
    pub enabled: bool,
    /// Cache sizes and chunking, announced to the peer in the hello.
    pub codec: CodecSettings,
    /// The policy of services that set none of their own.
    pub default: StreamPolicy,
    /// The caches' disk tier: `None` keeps them in memory only.
    pub disk: Option<DiskTier>,
    /// Move the zstd level with what the link drains (see [`crate::policy::zstd_range`]),
    /// starting at `codec.zstd_level`.
    pub zstd_adapt: bool,
}

/// The disk tier of the chunk caches, under `state_dir/cache/<peer>`.
#[derive(Clone, PartialEq)]
pub struct DiskTier {
    /// How often changed caches are saved (and at shutdown).
    pub checkpoint: Duration,
    /// AES-256-GCM key for chunks at rest, read from `key_file`.
    pub key: Option<[u8; 32]>,
    pub key_file: Option<PathBuf>,
    /// Files behind the sender's store of delta bases (`optimize.delta_memory` in front):
    /// 0 keeps the store in memory only.
    pub delta_bytes: u64,
}

impl std::fmt::Debug for DiskTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskTier")
            .field("checkpoint", &self.checkpoint)
            .field("key_file", &self.key_file)
            .field("delta_bytes", &self.delta_bytes)
            .finish()
    }
}

/// Reads a cache key: 32 bytes, raw or as 64 hexadecimal digits.
fn read_key(path: &Path) -> Result<[u8; 32], String> {
    crate::secure::private_key_file(path)?;
    let raw = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if raw.len() > 4096 {
        return Err(format!("{} is not a 32-byte key", path.display()));
    }
    let text = std::str::from_utf8(&raw).map(str::trim).unwrap_or("");
    let mut key = [0u8; 32];
    if text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit()) {
        for (i, k) in key.iter_mut().enumerate() {
            *k = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).map_err(|e| e.to_string())?;
        }
    } else if raw.len() == 32 {
        key.copy_from_slice(&raw);
    } else {
        return Err(format!(
            "{} must hold 32 bytes, raw or as 64 hex digits (head -c 32 /dev/urandom > FILE)",
            path.display()
        ));
    }
    Ok(key)
}

#[derive(Debug, Clone, PartialEq)]
pub enum ServiceKind {
    /// Local clients connect here; their streams go to the peer's service of the same name.
    Listen { addr: SocketAddr, allow: Vec<IpNet> },
    /// Streams from the peer for this service are connected to this `host:port`.
    Target { addr: String },
}

/// Names: 1 to 63 lowercase letters, digits or dashes, not starting or ending with a dash
/// (a DNS label, so a site name can be a certificate name).
pub fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// The value a field takes when the config leaves it out (bandwidth-derived ones are in
/// [`policy`](crate::policy) and the `limits` windows in [`parse_limits`]).
pub mod defaults {
    use std::time::Duration;

    pub const BANDWIDTH_BPS: u64 = 45_000_000;
    pub const RTT: Duration = Duration::from_millis(100);
    pub const CONGESTION: &str = "bbr";
    pub const LANE_CONGESTION: &str = "cubic";
    pub const NOTSENT_LOWAT: u32 = 128 * 1024;
    pub const KEEPALIVE: Duration = Duration::from_secs(5);
    pub const USER_TIMEOUT: Duration = Duration::from_secs(30);
    pub const RECONNECT_MIN: Duration = Duration::from_millis(200);
    pub const RECONNECT_MAX: Duration = Duration::from_secs(10);
    pub const RESUME_WINDOW: Duration = Duration::from_secs(30);
    pub const MEMORY: u64 = 256 << 20;
    pub const SERVICE_MEMORY: u64 = 64 << 20;
    pub const CHUNK: u64 = 8 * 1024;
    pub const CHECKPOINT: Duration = Duration::from_secs(60);
    pub const MAX_STREAMS: u32 = 4096;
    pub const STREAM_BUFFER: u64 = 256 * 1024;
    pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
    pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
    pub const LINK_WAIT: Duration = Duration::from_secs(10);
    pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
    pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
    pub const MAX_HANDSHAKES: u32 = 64;
    pub const STREAMS_PER_CLIENT: u32 = 256;
    pub const STREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(3600);
    pub const HANDSHAKES_PER_SOURCE: u32 = 8;
    /// Threads that encode: the host's cores (at most 64).
    pub fn threads() -> usize {
        std::thread::available_parallelism().map_or(1, |n| n.get().min(64))
    }
    pub const STATE_DIR: &str = "/var/lib/wanoptd";
    pub const LOG_LEVEL: &str = "info";
}

/// Log levels `log.level` accepts.
const LOG_LEVELS: [&str; 5] = ["error", "warn", "info", "debug", "trace"];

/// Parsing context: the file, for relative paths and error messages.
struct Ctx<'a> {
    path: &'a Path,
}

impl Ctx<'_> {
    fn err(&self, field: impl Into<String>, msg: impl Into<String>) -> ConfigError {
        ConfigError::Field {
            path: self.path.to_path_buf(),
            field: field.into(),
            msg: msg.into(),
        }
    }
    fn opt<T>(
        &self,
        field: &str,
        v: &Option<String>,
        default: T,
        f: impl Fn(&str) -> Result<T, String>,
    ) -> Result<T, ConfigError> {
        match v {
            None => Ok(default),
            Some(s) => f(s).map_err(|m| self.err(field, m)),
        }
    }
    /// A duration within `lo..=hi`.
    fn dur(
        &self,
        field: &str,
        v: &Option<String>,
        default: Duration,
        lo: Duration,
        hi: Duration,
    ) -> Result<Duration, ConfigError> {
        self.opt(field, v, default, |s| {
            let x = parse_duration(s)?;
            if x < lo || x > hi {
                return Err(format!("must be between {lo:?} and {hi:?}"));
            }
            Ok(x)
        })
    }
    fn toggle(&self, field: &str, v: &Option<Toggle>, default: bool) -> Result<bool, ConfigError> {
        match v {
            None => Ok(default),
            Some(t) => parse_toggle(t).map_err(|m| self.err(field, m)),
        }
    }
    fn resolve(&self, p: &str) -> PathBuf {
        let p = Path::new(p);
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            self.path.parent().unwrap_or_else(|| Path::new(".")).join(p)
        }
    }
}

fn parse_sockaddr(s: &str) -> Result<SocketAddr, String> {
    s.parse()
        .map_err(|_| format!("{s:?} is not an IP:port address (for IPv6: [::1]:7400)"))
}

impl std::str::FromStr for BufferSize {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.eq_ignore_ascii_case("auto") {
            return Ok(BufferSize::Auto);
        }
        let n = parse_size(s)?;
        if !(4096..=(1u64 << 31)).contains(&n) {
            return Err(format!("{s:?}: must be auto or between 4KiB and 2GiB"));
        }
        Ok(BufferSize::Bytes(n as usize))
    }
}

impl std::fmt::Display for BufferSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BufferSize::Auto => f.write_str("auto"),
            BufferSize::Bytes(n) => write!(f, "{n}"),
        }
    }
}

fn parse_toggle(t: &Toggle) -> Result<bool, String> {
    match t {
        Toggle::Bool(b) => Ok(*b),
        Toggle::Word(w) if w == "on" => Ok(true),
        Toggle::Word(w) if w == "off" => Ok(false),
        Toggle::Word(w) => Err(format!("{w:?} is not on or off")),
    }
}

/// A YAML double-quoted string (addresses such as `[::1]:7400` would otherwise read as lists).
fn quoted(v: impl std::fmt::Display) -> String {
    let v = v.to_string();
    format!("\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\""))
}

/// A path for a comment line.
fn one_line(p: &Path) -> String {
    p.display().to_string().replace(['\n', '\r'], " ")
}

/// A duration in the largest unit that states it exactly (the config's units go down to µs).
fn dur(d: Duration) -> String {
    if d.subsec_nanos().is_multiple_of(1_000_000) {
        format!("{}ms", d.as_millis())
    } else {
        format!("{}us", d.as_micros())
    }
}

fn on_off(b: bool) -> &'static str {
    if b { "on" } else { "off" }
}

fn parse_host_port(s: &str) -> Result<String, String> {
    let (host, port) = s
        .rsplit_once(':')
        .ok_or_else(|| format!("{s:?} is not host:port"))?;
    if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) {
        return Err(format!(
            "{s:?} is not host:port with a port from 1 to 65535"
        ));
    }
    Ok(s.to_string())
}

fn in_range<T: PartialOrd + std::fmt::Display + Copy>(v: T, lo: T, hi: T) -> Result<T, String> {
    if v < lo || v > hi {
        Err(format!("{v} is out of range ({lo} to {hi})"))
    } else {
        Ok(v)
    }
}

fn congestion_name(s: &str) -> Result<String, String> {
    if s.is_empty() || s.len() > 15 || !s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
        Err(format!(
            "{s:?} is not a congestion control name (bbr, cubic, reno)"
        ))
    } else {
        Ok(s.to_string())
    }
}

fn parse_link(cx: &Ctx<'_>, l: &RawLink, site: &str) -> Result<LinkSettings, ConfigError> {
    let role = match (&l.listen, &l.connect) {
        (Some(a), None) => {
            LinkRole::Listen(parse_sockaddr(a).map_err(|m| cx.err("link.listen", m))?)
        }
        (None, Some(c)) => {
            LinkRole::Connect(parse_host_port(c).map_err(|m| cx.err("link.connect", m))?)
        }
        _ => return Err(cx.err("link", "set exactly one of listen or connect")),
    };
    if !valid_name(&l.peer) {
        return Err(cx.err(
            "link.peer",
            format!("{:?} must be a lowercase DNS label", l.peer),
        ));
    }
    if l.peer == site {
        return Err(cx.err("link.peer", "the peer must be another site than this one"));
    }
    let bandwidth_bps = cx.opt(
        "link.bandwidth",
        &l.bandwidth,
        defaults::BANDWIDTH_BPS,
        |s| in_range(parse_rate(s)?, 64_000, 400_000_000_000),
    )?;
    let rtt = cx.opt("link.rtt", &l.rtt, defaults::RTT, |s| {
        let d = parse_duration(s)?;
        if d > Duration::from_secs(10) {
            return Err("must be at most 10s".into());
        }
        Ok(d)
    })?;
    let secs = Duration::from_secs;
    let ms = Duration::from_millis;
    let reconnect_min = cx.dur(
        "link.reconnect_min",
        &l.reconnect_min,
        defaults::RECONNECT_MIN,
        ms(10),
        secs(60),
    )?;
    let reconnect_max = cx.dur(
        "link.reconnect_max",
        &l.reconnect_max,
        defaults::RECONNECT_MAX,
        ms(10),
        secs(600),
    )?;
    if reconnect_max < reconnect_min {
        return Err(cx.err("link.reconnect_max", "must not be below link.reconnect_min"));
    }
    Ok(LinkSettings {
        role,
        peer: l.peer.clone(),
        bandwidth_bps,
        bandwidth_stated: l.bandwidth.is_some(),
        rtt,
        congestion: cx.opt(
            "link.congestion",
            &l.congestion,
            defaults::CONGESTION.to_string(),
            congestion_name,
        )?,
        send_buffer: cx.opt(
            "link.send_buffer",
            &l.send_buffer,
            BufferSize::Auto,
            str::parse,
        )?,
        recv_buffer: cx.opt(
            "link.recv_buffer",
            &l.recv_buffer,
            BufferSize::Auto,
            str::parse,
        )?,
        notsent_lowat: cx.opt(
            "link.notsent_lowat",
            &l.notsent_lowat,
            defaults::NOTSENT_LOWAT,
            |s| Ok(in_range(parse_size(s)?, 4096, 64 << 20)? as u32),
        )?,
        keepalive: cx.dur(
            "link.keepalive",
            &l.keepalive,
            defaults::KEEPALIVE,
            ms(100),
            secs(3600),
        )?,
        user_timeout: cx.dur(
            "link.user_timeout",
            &l.user_timeout,
            defaults::USER_TIMEOUT,
            secs(1),
            secs(3600),
        )?,
        reconnect_min,
        reconnect_max,
        resume_window: cx.dur(
            "link.resume_window",
            &l.resume_window,
            defaults::RESUME_WINDOW,
            Duration::ZERO,
            secs(3600),
        )?,
        latency_lane: l.latency_lane.unwrap_or(true),
        lane_congestion: cx.opt(
            "link.lane_congestion",
            &l.lane_congestion,
            defaults::LANE_CONGESTION.to_string(),
            congestion_name,
        )?,
        max_rate_bps: match l.max_rate.as_deref() {
            // Pace only when the operator stated the WAN rate: a default must not cap anyone.
            None | Some("auto") => l.bandwidth.as_ref().map(|_| bandwidth_bps / 100 * 95),
            Some("off") => None,
            Some(r) => Some(
                parse_rate(r)
                    .and_then(|v| in_range(v, 64_000, 400_000_000_000))
                    .map_err(|m| cx.err("link.max_rate", format!("{m} (or auto, off)")))?,
            ),
        },
    })
}

fn parse_tls(cx: &Ctx<'_>, t: &RawTls) -> TlsPaths {
    TlsPaths {
        ca: cx.resolve(&t.ca),
        cert: cx.resolve(&t.cert),
        key: cx.resolve(&t.key),
    }
}

fn parse_optimize(
    cx: &Ctx<'_>,
    ro: Option<&RawOptimize>,
    link: &LinkSettings,
) -> Result<Optimize, ConfigError> {
    let empty = RawOptimize::default();
    let o = ro.unwrap_or(&empty);
    let memory = cx.opt("optimize.memory", &o.memory, defaults::MEMORY, |s| {
        in_range(parse_size(s)?, 0, 64 << 30)
    })?;
    let service_memory = cx.opt(
        "optimize.service_memory",
        &o.service_memory,
        defaults::SERVICE_MEMORY,
        |s| in_range(parse_size(s)?, 0, 64 << 30),
    )?;
    let avg_chunk = cx.opt("optimize.chunk", &o.chunk, defaults::CHUNK, |s| {
        let n = parse_size(s)?;
        let r = wanopt_codec::AVG_CHUNK_RANGE;
        in_range(n, *r.start() as u64, *r.end() as u64)
    })? as usize;
    let zstd_level = match o.zstd_level {
        None => crate::policy::default_zstd_level(link),
        Some(l) => in_range(l, 1, 19).map_err(|m| cx.err("optimize.zstd_level", m))?,
    };
    let long_context = parse_long_context(cx, o)?;
    // The sender's store of delta bases (see wanopt_codec::delta), or off.
    let delta_bytes = cx.opt(
        "optimize.delta_memory",
        &o.delta_memory,
        wanopt_codec::delta::DEFAULT_STORE as u64,
        |s| match s {
            "off" => Ok(0),
            _ => in_range(parse_size(s)?, 0, 64 << 30),
        },
    )?;
    let default = StreamPolicy {
        compression: cx.opt(
            "optimize.compression",
            &o.compression,
            Compression::Adaptive,
            str::parse,
        )?,
        dedup: cx.toggle("optimize.dedup", &o.dedup, true)?,
        scope: cx.opt(
            "optimize.dedup_scope",
            &o.dedup_scope,
            Scope::Link,
            str::parse,
        )?,
    };
    let (disk_bytes, service_disk_bytes, disk) =
        parse_disk(cx, o.disk.as_ref(), memory, service_memory, delta_bytes)?;
    Ok(Optimize {
        enabled: o.enabled.unwrap_or(true),
        codec: CodecSettings {
            cache_bytes: memory,
            service_cache_bytes: service_memory,
            disk_bytes,
            service_disk_bytes,
            avg_chunk,
            zstd_level,
            long_context,
            delta_bytes,
            // Always offered; a peer without them gets a flush per chunk.
            runs: true,
        },
        default,
        disk,
        zstd_adapt: cx.toggle("optimize.zstd_adapt", &o.zstd_adapt, true)?,
    })
}

/// `optimize.context_window` and `optimize.context_streams`: the long zstd contexts of bulk
/// streams (a window of a power of two from 1 MiB to 128 MiB, or `off`) and how many a link
/// keeps at once. Each costs about its window at the receiver (which accepts twice the count
/// while streams end and begin) and its window plus the level's tables at the sender.
fn parse_long_context(cx: &Ctx<'_>, o: &RawOptimize) -> Result<Option<LongContext>, ConfigError> {
    let d = LongContext::default();
    let window = cx.opt(
        "optimize.context_window",
        &o.context_window,
        Some(d.window()),
        |s| {
            if s == "off" {
                return Ok(None);
            }
            let n = parse_size(s)?;
            let r = LongContext::WINDOW_LOG_RANGE;
            if !n.is_power_of_two() || n < 1 << r.start() || n > 1 << r.end() {
                return Err(format!(
                    "must be a power of two from {}MiB to {}MiB (or off)",
                    1u64 << (r.start() - 20),
                    1u64 << (r.end() - 20)
                ));
            }
            Ok(Some(n))
        },
    )?;
    let streams = match o.context_streams {
        None => d.streams,
        Some(n) => in_range(n, 1, LongContext::MAX_STREAMS)
            .map_err(|m| cx.err("optimize.context_streams", m))?,
    };
    Ok(window.map(|w| LongContext {
        window_log: w.trailing_zeros(),
        streams,
    }))
}

/// `optimize.disk`: the byte limits of the shared and per-service disk tiers and of the one
/// behind the store of delta bases (`delta_memory` bytes of memory, 0 when deltas are off), and
/// the tier's settings when any is on.
fn parse_disk(
    cx: &Ctx<'_>,
    rd: Option<&RawDisk>,
    memory: u64,
    service_memory: u64,
    delta_memory: u64,
) -> Result<(u64, u64, Option<DiskTier>), ConfigError> {
    let empty = RawDisk::default();
    let d = rd.unwrap_or(&empty);
    let disk_size = |s: &str| {
        let n = parse_size(s)?;
        if n != 0 && n < 16 << 20 {
            return Err("must be 0 (no disk tier) or at least 16MiB".to_string());
        }
        in_range(n, 0, 1 << 46)
    };
    let disk_bytes = cx.opt("optimize.disk.bytes", &d.bytes, 0, disk_size)?;
    let service_disk_bytes = cx.opt(
        "optimize.disk.service_bytes",
        &d.service_bytes,
        if disk_bytes > 0 {
            (disk_bytes / 8).max(2 * service_memory).max(16 << 20)
        } else {
            0
        },
        disk_size,
    )?;
    // The peer holds no more than its own cache does, so by default the bases reach as far back
    // as a cache like ours (when that is more than their memory).
    let delta_default = if wanopt_codec::cache::disk_capacity(disk_bytes) > delta_memory {
        disk_bytes
    } else {
        0
    };
    let delta_disk_bytes = match (&d.delta_bytes, delta_memory) {
        (Some(s), 0) if s != "0" => {
            return Err(cx.err(
                "optimize.disk.delta_bytes",
                "is set but deltas are off (optimize.delta_memory: off)",
            ));
        }
        (_, 0) => 0,
        _ => cx.opt(
            "optimize.disk.delta_bytes",
            &d.delta_bytes,
            delta_default,
            disk_size,
        )?,
    };
    // The disk tier holds everything memory does, and three quarters of its files are chunks.
    for (field, disk, mem, mem_field) in [
        ("optimize.disk.bytes", disk_bytes, memory, "optimize.memory"),
        (
            "optimize.disk.service_bytes",
            service_disk_bytes,
            service_memory,
            "optimize.service_memory",
        ),
        (
            "optimize.disk.delta_bytes",
            delta_disk_bytes,
            delta_memory,
            "optimize.delta_memory",
        ),
    ] {
        let cap = wanopt_codec::cache::disk_capacity(disk);
        if disk != 0 && cap < mem {
            return Err(cx.err(
                field,
                format!(
                    "{disk} bytes of files hold {cap} bytes of chunks, less than \
                     {mem_field} ({mem}): make it at least 4/3 of that"
                ),
            ));
        }
    }
    if disk_bytes == 0 && service_disk_bytes == 0 && delta_disk_bytes == 0 {
        if let Some(k) = &d.key_file {
            return Err(cx.err(
                "optimize.disk.key_file",
                format!("{k:?} is set but the disk tier is off (optimize.disk.bytes: 0)"),
            ));
        }
        return Ok((0, 0, None));
    }
    let key_file = d.key_file.as_deref().map(|p| cx.resolve(p));
    let key = match &key_file {
        Some(p) => Some(read_key(p).map_err(|m| cx.err("optimize.disk.key_file", m))?),
        None => None,
    };
    let checkpoint = cx.dur(
        "optimize.disk.checkpoint",
        &d.checkpoint,
        defaults::CHECKPOINT,
        Duration::from_millis(100),
        Duration::from_secs(86_400),
    )?;
    Ok((
        disk_bytes,
        service_disk_bytes,
        Some(DiskTier {
            checkpoint,
            key,
            key_file,
            delta_bytes: delta_disk_bytes,
        }),
    ))
}

/// The networks allowed to reach a listener at `addr`: CIDRs or IPs, required (and not
/// empty) unless `addr` is loopback, so a listener open to the network is a stated choice.
fn parse_allow(
    cx: &Ctx<'_>,
    field: &str,
    raw: Option<&[String]>,
    addr: SocketAddr,
) -> Result<Vec<IpNet>, ConfigError> {
    let mut allow = Vec::new();
    for (j, c) in raw.into_iter().flatten().enumerate() {
        let net = c
            .parse::<IpNet>()
            .or_else(|_| c.parse::<IpAddr>().map(IpNet::from))
            .map_err(|_| {
                cx.err(
                    format!("{field}[{j}]"),
                    format!("{c:?} is not a CIDR (10.0.0.0/8) or IP"),
                )
            })?;
        allow.push(net);
    }
    if allow.is_empty() && !addr.ip().is_loopback() {
        return Err(cx.err(
            field,
            format!(
                "required: {addr} is reachable beyond this host; list the client networks \
                 (0.0.0.0/0 and ::/0 allow any host)"
            ),
        ));
    }
    Ok(allow)
}

/// Most services one daemon serves.
pub const MAX_SERVICES: usize = wanopt_proto::frame::MAX_SCOPED;

fn parse_services(
    cx: &Ctx<'_>,
    raw: &[RawService],
    default: StreamPolicy,
    limits: &Limits,
) -> Result<Vec<Service>, ConfigError> {
    if raw.len() > MAX_SERVICES {
        return Err(cx.err(
            "services",
            format!(
                "{} services; at most {MAX_SERVICES} (the link's hello names each scope)",
                raw.len()
            ),
        ));
    }
    let mut services = Vec::new();
    let mut names = HashSet::new();
    for (i, s) in raw.iter().enumerate() {
        let svc = parse_service(cx, i, s, default, limits)?;
        if !names.insert(svc.name.clone()) {
            return Err(cx.err(
                format!("services[{i}].name"),
                format!("service {:?} is defined twice", s.name),
            ));
        }
        services.push(svc);
    }
    Ok(services)
}

fn parse_service(
    cx: &Ctx<'_>,
    i: usize,
    s: &RawService,
    default: StreamPolicy,
    limits: &Limits,
) -> Result<Service, ConfigError> {
    let field = |f: &str| format!("services[{i}].{f}");
    if !valid_name(&s.name) {
        return Err(cx.err(
            field("name"),
            format!("{:?} must be a lowercase DNS label", s.name),
        ));
    }
    let class = cx.opt(&field("class"), &s.class, Class::Bulk, str::parse)?;
    let kind = match (&s.listen, &s.target) {
        (Some(a), None) => {
            let addr = parse_sockaddr(a).map_err(|m| cx.err(field("listen"), m))?;
            let allow = parse_allow(cx, &field("allow"), s.allow.as_deref(), addr)?;
            ServiceKind::Listen { addr, allow }
        }
        (None, Some(t)) => {
            if s.allow.is_some() {
                return Err(cx.err(field("allow"), "allow applies to listen services only"));
            }
            ServiceKind::Target {
                addr: parse_host_port(t).map_err(|m| cx.err(field("target"), m))?,
            }
        }
        _ => {
            return Err(cx.err(
                format!("services[{i}]"),
                "set exactly one of listen or target",
            ));
        }
    };
    let policy = StreamPolicy {
        compression: cx.opt(
            &field("compression"),
            &s.compression,
            default.compression,
            str::parse,
        )?,
        dedup: cx.toggle(&field("dedup"), &s.dedup, default.dedup)?,
        scope: cx.opt(
            &field("dedup_scope"),
            &s.dedup_scope,
            default.scope,
            str::parse,
        )?,
    };
    // Bulk services leave the latency reserve alone; a client gets a share, not the service.
    let most = match class {
        Class::Bulk => limits.max_streams - limits.latency_reserve,
        Class::Latency => limits.max_streams,
    };
    let max_streams = match s.max_streams {
        None => most,
        Some(n) => in_range(n, 1, most).map_err(|m| cx.err(field("max_streams"), m))?,
    };
    let max_streams_per_client = match (s.max_streams_per_client, &kind) {
        (None, _) => defaults::STREAMS_PER_CLIENT.min(max_streams),
        (Some(_), ServiceKind::Target { .. }) => {
            return Err(cx.err(
                field("max_streams_per_client"),
                "applies to listen services only",
            ));
        }
        (Some(n), _) => {
            in_range(n, 1, max_streams).map_err(|m| cx.err(field("max_streams_per_client"), m))?
        }
    };
    let idle_timeout = match s.idle_timeout.as_deref() {
        Some("off") => None,
        v => Some(cx.dur(
            &field("idle_timeout"),
            &v.map(str::to_string),
            defaults::STREAM_IDLE_TIMEOUT,
            Duration::from_secs(1),
            Duration::from_secs(7 * 86_400),
        )?),
    };
    let redundancy = match (&s.redundancy, class) {
        (None, _) => crate::redundancy::Redundancy::default(),
        (Some(_), Class::Bulk) => {
            return Err(cx.err(
                field("redundancy"),
                "applies to latency-class services only (bulk streams are never copied)",
            ));
        }
        (Some(w), Class::Latency) => crate::redundancy::Redundancy::parse(&w.text())
            .map_err(|m| cx.err(field("redundancy"), m))?,
    };
    Ok(Service {
        name: s.name.clone(),
        class,
        kind,
        policy,
        max_streams,
        max_streams_per_client,
        idle_timeout,
        redundancy,
    })
}

fn parse_state_dir(cx: &Ctx<'_>, v: Option<&str>) -> PathBuf {
    v.map(|p| cx.resolve(p))
        // systemd's StateDirectory= (wanoptd/%i in the template unit) when the config is silent.
        .or_else(|| {
            let dirs = std::env::var("STATE_DIRECTORY").ok()?;
            dirs.split(':')
                .next()
                .filter(|d| !d.is_empty())
                .map(PathBuf::from)
        })
        .unwrap_or_else(|| PathBuf::from(defaults::STATE_DIR))
}

fn parse_log(cx: &Ctx<'_>, l: Option<&RawLog>) -> Result<String, ConfigError> {
    match l.and_then(|l| l.level.clone()) {
        None => Ok(defaults::LOG_LEVEL.to_string()),
        Some(l) if LOG_LEVELS.contains(&l.as_str()) => Ok(l),
        Some(l) => Err(cx.err(
            "log.level",
            format!("{l:?} is not error, warn, info, debug or trace"),
        )),
    }
}

impl Config {
    /// How many connections the latency lane may take: the most its latency services ask for
    /// (see [`crate::redundancy`]).
    pub fn redundancy(&self) -> crate::redundancy::Redundancy {
        crate::redundancy::Redundancy::of_link(
            self.services
                .iter()
                .filter(|s| s.class == Class::Latency)
                .map(|s| s.redundancy),
        )
    }

    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Validates config text; relative paths resolve against `path`'s folder.
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let raw: RawConfig = yaml_serde::from_str(text).map_err(|e| ConfigError::Syntax {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        let cx = Ctx { path };
        if !valid_name(&raw.site) {
            return Err(cx.err(
                "site",
                format!("{:?} must be a lowercase DNS label (a-z, 0-9, -)", raw.site),
            ));
        }
        let link = parse_link(&cx, &raw.link, &raw.site)?;
        let optimize = parse_optimize(&cx, raw.optimize.as_ref(), &link)?;
        let limits = parse_limits(&cx, raw.limits.as_ref(), &link, optimize.enabled)?;
        let services = parse_services(&cx, &raw.services, optimize.default, &limits)?;
        let admin = match &raw.admin {
            None => None,
            Some(a) => {
                let addr = parse_sockaddr(&a.listen).map_err(|m| cx.err("admin.listen", m))?;
                let allow = parse_allow(&cx, "admin.allow", a.allow.as_deref(), addr)?;
                Some(Admin { addr, allow })
            }
        };
        Ok(Config {
            path: path.to_path_buf(),
            tls: parse_tls(&cx, &raw.tls),
            state_dir: parse_state_dir(&cx, raw.state_dir.as_deref()),
            log_level: parse_log(&cx, raw.log.as_ref())?,
            site: raw.site,
            link,
            services,
            optimize,
            admin,
            limits,
        })
    }
}

mod describe;
mod limits;
pub use limits::Limits;
use limits::{RawLimits, parse_limits};
#[cfg(test)]
mod tests;
