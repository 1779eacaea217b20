//! The `link` and `tls` sections: which side this daemon is, the peer, the WAN's bandwidth and
//! round trip, the TCP tuning of the link's sockets, reconnects and resumption; the TLS files.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use wanopt_units::{parse_duration, parse_rate, parse_size};

use super::fields::{
    ConfigError, Ctx, congestion_name, defaults, in_range, parse_host_port, parse_sockaddr,
    valid_name,
};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLink {
    listen: Option<String>,
    allow: Option<Vec<String>>,
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
    copy_spacing: Option<String>,
    lane_rto_min: Option<String>,
    lane_datagrams: Option<String>,
    max_rate: Option<String>,
    latency_queue: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTls {
    ca: String,
    cert: String,
    key: String,
    crl: Option<String>,
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
    /// Networks the peer's link connections may come from (listening side; empty: any). A
    /// connection from elsewhere is closed before a byte of TLS.
    pub allow: Vec<ipnet::IpNet>,
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
    /// Time between the copies of a latency-lane write (`services[].redundancy`): the second
    /// copy leaves this long after the first, the third twice that, so a burst of loss that
    /// takes one copy's packets misses the others'. Zero: back to back.
    pub copy_spacing: Duration,
    /// The latency lane connections' least retransmission timeout; `None`: the kernel's.
    pub lane_rto_min: Option<Duration>,
    /// True when `link.lane_rto_min` is `auto` (the default): a kernel that cannot take the
    /// floor keeps its own silently, where a stated one is warned about.
    pub lane_rto_min_auto: bool,
    /// When pieces of the latency lane's writes also go as UDP datagrams (see
    /// [`crate::datagrams`]).
    pub lane_datagrams: crate::datagrams::Setting,
    /// Pacing cap of each link socket in bits per second (`SO_MAX_PACING_RATE`); `None` = off.
    pub max_rate_bps: Option<u64>,
    /// While the latency lane moves bytes, the most queue the main lane's bulk may add at the
    /// WAN's bottleneck before its pacing steps down (see [`crate::room`]); `None`: off.
    pub latency_queue: Option<Duration>,
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
    /// Revoked certificates (PEM CRLs of the site CA, `wanoptd certs --revoke`), read at start
    /// and on reload: a peer presenting one of them is refused.
    pub crl: Option<PathBuf>,
    /// The name `cert` must be issued to: the config's `site`.
    pub site: String,
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

pub(super) fn parse_link(
    cx: &Ctx<'_>,
    l: &RawLink,
    site: &str,
) -> Result<LinkSettings, ConfigError> {
    let role = match (&l.listen, &l.connect) {
        (Some(a), None) => {
            LinkRole::Listen(parse_sockaddr(a).map_err(|m| cx.err("link.listen", m))?)
        }
        (None, Some(c)) => {
            LinkRole::Connect(parse_host_port(c).map_err(|m| cx.err("link.connect", m))?)
        }
        _ => return Err(cx.err("link", "set exactly one of listen or connect")),
    };
    let allow = super::fields::parse_nets(cx, "link.allow", l.allow.as_deref())?;
    if !allow.is_empty() && l.listen.is_none() {
        return Err(cx.err(
            "link.allow",
            "applies to link.listen only (the side the peer connects to)",
        ));
    }
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
        allow,
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
        copy_spacing: cx.dur(
            "link.copy_spacing",
            &l.copy_spacing,
            defaults::COPY_SPACING,
            Duration::ZERO,
            ms(50),
        )?,
        lane_rto_min: match l.lane_rto_min.as_deref() {
            None | Some("auto") => defaults::lane_rto_min(rtt),
            Some("off") => None,
            v => Some(cx.dur(
                "link.lane_rto_min",
                &v.map(str::to_string),
                Duration::from_millis(200),
                ms(5),
                ms(200),
            )?),
        },
        lane_rto_min_auto: matches!(l.lane_rto_min.as_deref(), None | Some("auto")),
        lane_datagrams: match l.lane_datagrams.as_deref() {
            None => crate::datagrams::Setting::default(),
            Some(v) => {
                crate::datagrams::Setting::parse(v).map_err(|m| cx.err("link.lane_datagrams", m))?
            }
        },
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
        latency_queue: match l.latency_queue.as_deref() {
            Some("off") => None,
            v => Some(cx.dur(
                "link.latency_queue",
                &v.map(str::to_string),
                defaults::LATENCY_QUEUE,
                ms(1),
                ms(100),
            )?),
        },
    })
}

pub(super) fn parse_tls(cx: &Ctx<'_>, t: &RawTls, site: &str) -> TlsPaths {
    TlsPaths {
        ca: cx.resolve(&t.ca),
        cert: cx.resolve(&t.cert),
        key: cx.resolve(&t.key),
        crl: t.crl.as_deref().map(|c| cx.resolve(c)),
        site: site.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn raw(yaml: &str) -> RawLink {
        yaml_serde::from_str(yaml).expect("yaml")
    }

    #[test]
    fn the_link_section_names_the_field_it_refuses() {
        let cx = Ctx {
            path: Path::new("west.yaml"),
        };
        let ok = parse_link(
            &cx,
            &raw("{connect: 'east:7400', peer: east, bandwidth: 45mbit}"),
            "west",
        )
        .expect("valid");
        assert_eq!(ok.role, LinkRole::Connect("east:7400".into()));
        assert!(ok.bandwidth_stated);
        assert_eq!(
            ok.max_rate_bps,
            Some(45_000_000 / 100 * 95),
            "paced at 95% when stated"
        );
        for (yaml, field) in [
            ("{listen: '0.0.0.0:1', connect: 'e:1', peer: east}", "link:"),
            ("{connect: 'e:1', peer: west}", "link.peer"),
            ("{connect: 'e:1', peer: east, rtt: 11s}", "link.rtt"),
            (
                "{connect: 'e:1', peer: east, reconnect_min: 5s, reconnect_max: 1s}",
                "link.reconnect_max",
            ),
            (
                "{connect: 'e:1', peer: east, send_buffer: 1KiB}",
                "link.send_buffer",
            ),
        ] {
            let e = parse_link(&cx, &raw(yaml), "west")
                .expect_err(yaml)
                .to_string();
            assert!(e.contains(field), "{yaml}: {e}");
        }
    }

    #[test]
    fn buffer_sizes_read_back_as_they_print() {
        for s in ["auto", "4096", "1048576"] {
            let b: BufferSize = s.parse().expect("valid");
            assert_eq!(b.to_string(), s);
        }
        assert!("4095".parse::<BufferSize>().is_err());
    }
}
