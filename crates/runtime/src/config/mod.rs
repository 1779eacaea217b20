//! The daemon's YAML config: serde structs that reject unknown keys, parsed into validated types.
//!
//! Parse, don't validate: [`Config::load`] either returns a [`Config`] whose every value is usable
//! (addresses parsed, units converted, names checked, paths resolved against the config file's
//! folder) or a [`ConfigError`] naming the field. The daemon exits 64 on such an error. One
//! function per section, each in a file of its own: `link.rs` (and `tls`), `optimize.rs`,
//! `limits.rs`, `services.rs`; what they share is in `fields.rs`; `describe.rs` prints a config
//! back.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use ipnet::IpNet;
use serde::Deserialize;
use wanopt_proto::Class;

mod describe;
mod fields;
mod limits;
mod link;
mod optimize;
mod services;
#[cfg(test)]
mod tests;

pub use fields::{ConfigError, allowed, defaults, valid_name};
use fields::{Ctx, parse_sockaddr};
pub use limits::Limits;
use limits::{RawLimits, parse_limits};
pub use link::{BufferSize, LinkRole, LinkSettings, TlsPaths};
use link::{RawLink, RawTls, parse_link, parse_tls};
pub use optimize::{
    DiskTier, Optimize, ZSTD_6_UP_TO_BPS, ZSTD_ADAPT_MAX, default_zstd_level, zstd_range,
};
use optimize::{RawOptimize, parse_optimize};
pub use services::{MAX_SERVICES, Service, ServiceKind};
use services::{RawService, parse_allow, parse_services};

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

/// Log levels `log.level` accepts.
const LOG_LEVELS: [&str; 5] = ["error", "warn", "info", "debug", "trace"];

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
        let services = parse_services(&cx, &raw.services, optimize.default, &limits, &link)?;
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
            tls: parse_tls(&cx, &raw.tls, &raw.site),
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
