//! What every section's parser shares: the error that names a field, the parsing context (the
//! file, for relative paths and messages), value parsers and checks, the defaults, and the
//! formatting `describe` writes values back with.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use ipnet::IpNet;
use serde::Deserialize;
use wanopt_units::parse_duration;

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

/// A word, a number or a YAML boolean (`off` may reach serde as `false`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum Word {
    Bool(bool),
    Num(u64),
    Text(String),
}

impl Word {
    pub(super) fn text(&self) -> String {
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
pub(super) enum Toggle {
    Bool(bool),
    Word(String),
}

/// True if a client at `ip` may use a listener with this allow list (empty: any, which the
/// config permits only on loopback). IPv4 clients of an IPv6 socket match IPv4 networks.
/// A list of CIDRs or single IPs (`10.0.0.0/8`, `192.0.2.7`), each checked, named by its place.
pub(super) fn parse_nets(
    cx: &Ctx<'_>,
    field: &str,
    raw: Option<&[String]>,
) -> Result<Vec<IpNet>, ConfigError> {
    let mut nets = Vec::new();
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
        nets.push(net);
    }
    Ok(nets)
}

pub fn allowed(allow: &[IpNet], ip: IpAddr) -> bool {
    let ip = ip.to_canonical();
    allow.is_empty() || allow.iter().any(|n| n.contains(&ip))
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

/// The value a field takes when the config leaves it out (the zstd level, derived from the
/// stated bandwidth, is [`default_zstd_level`](super::default_zstd_level); the `limits` windows
/// are derived in `limits.rs`).
pub mod defaults {
    use std::time::Duration;

    pub const BANDWIDTH_BPS: u64 = 45_000_000;
    pub const RTT: Duration = Duration::from_millis(100);
    pub const CONGESTION: &str = "bbr";
    pub const LANE_CONGESTION: &str = "cubic";
    /// A latency-lane write's copies leave 5 ms apart: longer than a burst of a few packets at
    /// T3 rates (measured in benches/README.md, "sync_tail across bursty loss").
    pub const COPY_SPACING: Duration = Duration::from_millis(5);
    /// The latency lane's least retransmission timeout by default (`auto`): 10 ms on a WAN of
    /// 40 ms or more, so a SYNC write lost on every copy goes again 10 ms after the RTT instead
    /// of 200 ms (measured in benches/README.md, "sync_tail across bursty loss"). Below 40 ms the
    /// kernel's 200 ms stays: a receiver may delay its ACK by up to about 40 ms, and a floor
    /// under that would send writes again that were not lost.
    pub fn lane_rto_min(rtt: Duration) -> Option<Duration> {
        (rtt >= Duration::from_millis(40)).then_some(Duration::from_millis(10))
    }
    /// While latency services are busy, bulk adds at most about this much queue at the WAN's
    /// bottleneck (measured in benches/README.md, "sync_tail across bursty loss").
    pub const LATENCY_QUEUE: Duration = Duration::from_millis(5);
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
    /// Twice a coded turn's 256 KiB, so a bulk stream gathers a whole turn before it goes
    /// (`codec::send::gather`): with 128 KiB turns (a 256 KiB buffer) a changed ext4 image cost
    /// 0.208 MB, 1.32x `zstd --patch-from`, with 256 KiB 0.172 (1.09x); every corpus pair's
    /// changed copy was smaller or the same (the kernel tree 1.10x to 1.00x).
    pub const STREAM_BUFFER: u64 = 512 * 1024;
    pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
    pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
    pub const LINK_WAIT: Duration = Duration::from_secs(10);
    pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
    pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
    pub const MAX_HANDSHAKES: u32 = 64;
    pub const STREAMS_PER_CLIENT: u32 = 256;
    pub const STREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(3600);
    pub const HANDSHAKES_PER_SOURCE: u32 = 8;
    /// Threads that encode: the host's cores (at most 64), but one on a host of one or two
    /// cores. There the pool's second thread shares a core with the peer, the applications
    /// and the kernel's network work, and it lost more often than not: first copies of a real
    /// base backup through a loopback pair ran at 0.84x (48 MB) and 0.75x (337 MB) of
    /// `threads: 1` with two threads, medians of five (`cargo bench --bench threads`).
    pub fn threads() -> usize {
        threads_for(std::thread::available_parallelism().map_or(1, |n| n.get()))
    }

    /// [`threads`] on a host of `cores` cores.
    pub fn threads_for(cores: usize) -> usize {
        if cores <= 2 { 1 } else { cores.min(64) }
    }
    pub const STATE_DIR: &str = "/var/lib/wanoptd";
    pub const LOG_LEVEL: &str = "info";
}

/// Parsing context: the file, for relative paths and error messages.
pub(super) struct Ctx<'a> {
    pub path: &'a Path,
}

impl Ctx<'_> {
    pub(super) fn err(&self, field: impl Into<String>, msg: impl Into<String>) -> ConfigError {
        ConfigError::Field {
            path: self.path.to_path_buf(),
            field: field.into(),
            msg: msg.into(),
        }
    }
    pub(super) fn opt<T>(
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
    pub(super) fn dur(
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
    pub(super) fn toggle(
        &self,
        field: &str,
        v: &Option<Toggle>,
        default: bool,
    ) -> Result<bool, ConfigError> {
        match v {
            None => Ok(default),
            Some(t) => parse_toggle(t).map_err(|m| self.err(field, m)),
        }
    }
    pub(super) fn resolve(&self, p: &str) -> PathBuf {
        let p = Path::new(p);
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            self.path.parent().unwrap_or_else(|| Path::new(".")).join(p)
        }
    }
}

pub(super) fn parse_sockaddr(s: &str) -> Result<SocketAddr, String> {
    s.parse()
        .map_err(|_| format!("{s:?} is not an IP:port address (for IPv6: [::1]:7400)"))
}

pub(super) fn parse_toggle(t: &Toggle) -> Result<bool, String> {
    match t {
        Toggle::Bool(b) => Ok(*b),
        Toggle::Word(w) if w == "on" => Ok(true),
        Toggle::Word(w) if w == "off" => Ok(false),
        Toggle::Word(w) => Err(format!("{w:?} is not on or off")),
    }
}

/// A YAML double-quoted string (addresses such as `[::1]:7400` would otherwise read as lists).
pub(super) fn quoted(v: impl std::fmt::Display) -> String {
    let v = v.to_string();
    format!("\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\""))
}

/// A path for a comment line.
pub(super) fn one_line(p: &Path) -> String {
    p.display().to_string().replace(['\n', '\r'], " ")
}

/// A duration in the largest unit that states it exactly (the config's units go down to µs).
pub(super) fn dur(d: Duration) -> String {
    if d.subsec_nanos().is_multiple_of(1_000_000) {
        format!("{}ms", d.as_millis())
    } else {
        format!("{}us", d.as_micros())
    }
}

pub(super) fn on_off(b: bool) -> &'static str {
    if b { "on" } else { "off" }
}

pub(super) fn parse_host_port(s: &str) -> Result<String, String> {
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

pub(super) fn in_range<T: PartialOrd + std::fmt::Display + Copy>(
    v: T,
    lo: T,
    hi: T,
) -> Result<T, String> {
    if v < lo || v > hi {
        Err(format!("{v} is out of range ({lo} to {hi})"))
    } else {
        Ok(v)
    }
}

pub(super) fn congestion_name(s: &str) -> Result<String, String> {
    if s.is_empty() || s.len() > 15 || !s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
        Err(format!(
            "{s:?} is not a congestion control name (bbr, cubic, reno)"
        ))
    } else {
        Ok(s.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_value_checks_name_what_is_wrong() {
        assert_eq!(in_range(5, 1, 10), Ok(5));
        assert!(in_range(11, 1, 10).is_err_and(|m| m.contains("out of range")));
        assert_eq!(parse_host_port("db:1521").as_deref(), Ok("db:1521"));
        assert!(parse_host_port("db:0").is_err() && parse_host_port(":1521").is_err());
        assert!(congestion_name("bbr").is_ok() && congestion_name("bbr; rm").is_err());
        assert!(valid_name("west-1") && !valid_name("West") && !valid_name("-a"));
        assert_eq!(quoted("[::1]:7400"), "\"[::1]:7400\"");
        assert_eq!(dur(Duration::from_millis(1500)), "1500ms");
        assert_eq!(dur(Duration::from_micros(1500)), "1500us");
        let cx = Ctx {
            path: Path::new("/etc/wanopt/west.yaml"),
        };
        assert_eq!(cx.resolve("ca.pem"), PathBuf::from("/etc/wanopt/ca.pem"));
        assert_eq!(cx.resolve("/x/ca.pem"), PathBuf::from("/x/ca.pem"));
        assert!(
            cx.toggle("a.b", &Some(Toggle::Word("maybe".into())), true)
                .is_err_and(|e| e.to_string().contains("a.b"))
        );
        let lan: IpNet = "10.0.0.0/8".parse().expect("net");
        assert!(allowed(&[lan], "10.1.2.3".parse().expect("ip")));
        assert!(
            allowed(&[lan], "::ffff:10.1.2.3".parse().expect("ip")),
            "v4 on a v6 socket"
        );
        assert!(!allowed(&[lan], "192.168.0.1".parse().expect("ip")));
    }
}
