//! The wanopt runtime: moves bytes between local TCP sockets and the sans-IO protocol core over one
//! mutually authenticated TLS 1.3 link, on tokio.
//!
//! [`config`] parses and validates the YAML config, [`tls`] builds the rustls configs and mints
//! certificates, [`sockopt`] tunes sockets, [`daemon`] runs the link and the services,
//! [`counters`] keeps raw and wire byte counts per service as Prometheus metrics, and [`admin`]
//! serves them over HTTP. [`cachedir`] keeps the chunk caches' disk tiers and saved states.

mod accept;
pub mod admin;
pub mod async_store;
pub mod atrest;
pub mod cachedir;
pub mod config;
pub mod counters;
pub mod daemon;
pub mod datagrams;
mod dial;
pub mod disk;
mod driver;
pub mod fdstore;
mod gate;
pub mod handover;
mod handshake;
mod listen;
pub mod notify;
mod peer;
pub mod policy;
pub mod pressure;
pub mod redundancy;
mod reload;
pub mod room;
pub mod secure;
mod services;
mod slots;
pub mod sockopt;
pub mod stats;
mod supervisor;
mod sync;
pub mod tls;
mod wire;
pub mod workers;

pub use config::{Config, ConfigError};
pub use daemon::{Bound, Daemon, DaemonError, HandoverTo, Served};
pub use peer::link_config;
pub use wanopt_units as units;

/// Spawns a task that keeps the caller's tracing span, so a process running several sites
/// (`wanoptd demo`, several configs) names the site in every line its tasks log.
pub(crate) fn spawn<F>(f: F) -> tokio::task::JoinHandle<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    use tracing::Instrument;
    tokio::spawn(f.in_current_span())
}
