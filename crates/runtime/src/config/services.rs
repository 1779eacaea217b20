//! The `services` section: each service's name and side (a local listener with its allow list,
//! or a target the peer's streams are connected to), class, optimization policy, stream limits,
//! idle timeout and latency-lane redundancy; and allow lists, which the admin endpoint shares.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::Duration;

use ipnet::IpNet;
use serde::Deserialize;
use wanopt_proto::{Class, MAX_SHARE, Shaping, StreamPolicy};

use super::fields::{
    ConfigError, Ctx, Toggle, Word, defaults, in_range, parse_host_port, parse_sockaddr, valid_name,
};
use super::limits::Limits;
use super::link::LinkSettings;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawService {
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
    share: Option<u32>,
    min_rate: Option<String>,
    max_rate: Option<String>,
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
    /// Bulk services: how this service shares what this side sends on the link (rates in
    /// bytes per second of link bytes).
    pub shaping: Shaping,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ServiceKind {
    /// Local clients connect here; their streams go to the peer's service of the same name.
    Listen { addr: SocketAddr, allow: Vec<IpNet> },
    /// Streams from the peer for this service are connected to this `host:port`.
    Target { addr: String },
}

/// The networks allowed to reach a listener at `addr`: CIDRs or IPs, required (and not
/// empty) unless `addr` is loopback, so a listener open to the network is a stated choice.
pub(super) fn parse_allow(
    cx: &Ctx<'_>,
    field: &str,
    raw: Option<&[String]>,
    addr: SocketAddr,
) -> Result<Vec<IpNet>, ConfigError> {
    let allow = super::fields::parse_nets(cx, field, raw)?;
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

pub(super) fn parse_services(
    cx: &Ctx<'_>,
    raw: &[RawService],
    default: StreamPolicy,
    limits: &Limits,
    link: &LinkSettings,
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
        let svc = parse_service(cx, i, s, default, limits, link)?;
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
    link: &LinkSettings,
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
    let shaping = parse_shaping(cx, i, s, class, link)?;
    Ok(Service {
        name: s.name.clone(),
        class,
        kind,
        policy,
        max_streams,
        max_streams_per_client,
        idle_timeout,
        redundancy,
        shaping,
    })
}

/// A service's `share`, `min_rate` and `max_rate`: bulk services only (the latency class is
/// served before all of them), rates in bits per second or as a percentage of a stated
/// `link.bandwidth`, the guarantee not above the ceiling.
fn parse_shaping(
    cx: &Ctx<'_>,
    i: usize,
    s: &RawService,
    class: Class,
    link: &LinkSettings,
) -> Result<Shaping, ConfigError> {
    let field = |f: &str| format!("services[{i}].{f}");
    if class == Class::Latency {
        for (f, set) in [
            ("share", s.share.is_some()),
            ("min_rate", s.min_rate.is_some()),
            ("max_rate", s.max_rate.is_some()),
        ] {
            if set {
                return Err(cx.err(
                    field(f),
                    "applies to bulk services only (the latency class is always served first)",
                ));
            }
        }
    }
    let share = match s.share {
        None => 1,
        Some(n) => in_range(n, 1, MAX_SHARE).map_err(|m| cx.err(field("share"), m))?,
    };
    let rate = |f: &str, v: &Option<String>| -> Result<Option<u64>, ConfigError> {
        let Some(v) = v else {
            return Ok(None);
        };
        let bits = match v.trim().strip_suffix('%') {
            Some(pct) => {
                let pct: f64 = pct
                    .trim()
                    .parse()
                    .ok()
                    .filter(|p: &f64| *p > 0.0 && *p <= 100.0)
                    .ok_or_else(|| cx.err(field(f), format!("{v:?}: a percentage is 0-100%")))?;
                if !link.bandwidth_stated {
                    return Err(cx.err(
                        field(f),
                        "a percentage is of link.bandwidth, which is not set",
                    ));
                }
                (link.bandwidth_bps as f64 * pct / 100.0) as u64
            }
            None => wanopt_units::parse_rate(v).map_err(|m| cx.err(field(f), m))?,
        };
        in_range(bits, 64_000, 400_000_000_000).map_err(|m| cx.err(field(f), m))?;
        Ok(Some(bits / 8))
    };
    let min_rate = rate("min_rate", &s.min_rate)?;
    let max_rate = rate("max_rate", &s.max_rate)?;
    if let (Some(lo), Some(hi)) = (min_rate, max_rate)
        && lo > hi
    {
        return Err(cx.err(field("min_rate"), "must not be above max_rate"));
    }
    Ok(Shaping {
        share,
        min_rate,
        max_rate,
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    /// A listener reachable beyond the host must name its clients; on loopback it need not.
    #[test]
    fn allow_lists_are_required_off_loopback_and_checked() {
        let cx = Ctx {
            path: Path::new("w.yaml"),
        };
        let lo: SocketAddr = "127.0.0.1:1522".parse().expect("addr");
        let lan: SocketAddr = "10.0.0.5:1522".parse().expect("addr");
        assert_eq!(parse_allow(&cx, "f", None, lo).expect("loopback"), vec![]);
        assert!(
            parse_allow(&cx, "services[0].allow", None, lan)
                .is_err_and(|e| e.to_string().contains("services[0].allow"))
        );
        let nets = ["10.0.0.0/8".to_string(), "192.168.1.7".to_string()];
        let got = parse_allow(&cx, "f", Some(&nets), lan).expect("valid");
        assert_eq!(got.len(), 2);
        assert!(
            parse_allow(&cx, "f", Some(&["ten".to_string()]), lan)
                .is_err_and(|e| e.to_string().contains("f[0]"))
        );
    }
}
