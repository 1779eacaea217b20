//! Everything about one peer: the config and TLS material in force (a reload swaps them), its
//! counters, its caches' directory, and the current link, which the peer's supervisor publishes
//! for the service tasks to open streams on.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, RwLock};

use tokio::sync::{mpsc, watch};
use wanopt_proto::{Link, LinkConfig, ServiceLimit};

use crate::cachedir::CacheDir;
use crate::config::{Config, LinkRole, ServiceKind};
use crate::counters::Counters;
use crate::driver::{LinkCtx, LinkHandle, LinkMsg};
use crate::policy;
use crate::tls::TlsMaterial;

pub(crate) struct Peer {
    /// The config in force; a reload swaps it (services only) for new streams and clients.
    cfg: RwLock<Arc<Config>>,
    /// Certificates and keys; a reload re-reads them for the next connections.
    tls: RwLock<TlsMaterial>,
    pub counters: Arc<Counters>,
    /// The link streams are opened on; only the supervisor changes it.
    pub current: watch::Sender<Option<Arc<LinkHandle>>>,
    pub shutdown: watch::Receiver<bool>,
    next_link_id: AtomicU64,
    /// The chunk caches' disk tier and saved states, when configured.
    pub caches: Option<Arc<CacheDir>>,
    /// What we sent, kept as delta bases across links, with the size it was made for.
    bases: std::sync::Mutex<Option<((u64, u64), wanopt_codec::SharedBases)>>,
    /// Where each link reports to the supervisor.
    supervisor: mpsc::UnboundedSender<LinkMsg>,
    /// Stream slots of our local clients (per service, per client, bulk).
    pub slots: Arc<crate::slots::Slots>,
    /// The threads links prepare chunks on (`limits.threads`; fixed until a restart).
    workers: Option<Arc<dyn wanopt_codec::prepare::Workers>>,
    /// Set when the daemon hands over to a new process: every stream parks (see
    /// `services::pump`) and targets being connected are left to the new process.
    pub parking: watch::Sender<bool>,
    /// Streams moving bytes or connecting their target now: a handover waits until none is.
    pub pumps: Arc<std::sync::atomic::AtomicUsize>,
    /// The streams parked for the new process.
    pub parked: std::sync::Mutex<Vec<crate::handover::Parked>>,
    /// The listening side's socket for the latency lane's datagrams (see [`crate::datagrams`]).
    pub datagram_socket: std::sync::OnceLock<Arc<tokio::net::UdpSocket>>,
}

/// One of [`Peer::pumps`], counted off when dropped.
pub(crate) struct Pumping(Arc<std::sync::atomic::AtomicUsize>);

impl Pumping {
    pub fn new(peer: &Peer) -> Self {
        peer.pumps.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Pumping(peer.pumps.clone())
    }
}

impl Drop for Pumping {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Peer {
    pub fn new(
        cfg: Arc<Config>,
        tls: TlsMaterial,
        counters: Arc<Counters>,
        caches: Option<Arc<CacheDir>>,
        shutdown: watch::Receiver<bool>,
        supervisor: mpsc::UnboundedSender<LinkMsg>,
    ) -> Self {
        let workers = crate::workers::shared(cfg.limits.threads);
        Peer {
            workers,
            cfg: RwLock::new(cfg),
            tls: RwLock::new(tls),
            counters,
            current: watch::channel(None).0,
            shutdown,
            next_link_id: 1.into(),
            caches,
            supervisor,
            bases: std::sync::Mutex::new(None),
            slots: Arc::default(),
            parking: watch::channel(false).0,
            pumps: Arc::default(),
            parked: std::sync::Mutex::default(),
            datagram_socket: std::sync::OnceLock::new(),
        }
    }

    /// True once the daemon began handing over to a new process.
    pub fn parking(&self) -> bool {
        *self.parking.borrow()
    }

    /// The link a process before this one handed over (see [`wanopt_proto::Link::take_over`]),
    /// suspended, under the config in force: resume it as after a lost connection. Its outage
    /// counts from `since_parked` ago (when the process before stopped the streams).
    pub async fn adopt_link(
        &self,
        state: &[u8],
        since_parked: std::time::Duration,
    ) -> Result<Arc<LinkHandle>, wanopt_proto::HandoverError> {
        let cfg = self.cfg();
        let mut lc = link_config(&cfg, self.caches.as_ref());
        lc.delta_bases = self.bases(&cfg);
        lc.workers = self.workers.clone();
        let now = std::time::Instant::now();
        let mut link = Link::take_over(lc, state, now.checked_sub(since_parked).unwrap_or(now))?;
        link.set_service_limits(targets(&cfg));
        link.set_policies(policies(&cfg));
        link.set_shaping(shaping(&cfg));
        let ctx = self.link_ctx(&cfg);
        let id = self.next_link_id.fetch_add(1, Relaxed);
        Ok(Arc::new(LinkHandle::new(link, None, ctx, id)))
    }

    fn link_ctx(&self, cfg: &Config) -> LinkCtx {
        LinkCtx {
            counters: self.counters.clone(),
            caches: self.caches.clone(),
            supervisor: self.supervisor.clone(),
            peer: cfg.link.peer.clone(),
            handshake_timeout: cfg.limits.handshake_timeout,
            link_bound: policy::link_bound(&cfg.link),
            stated_bps: cfg.link.bandwidth_stated.then_some(cfg.link.bandwidth_bps),
            zstd: (
                cfg.optimize.codec.zstd_level,
                crate::config::zstd_range(&cfg.optimize),
            ),
            copy_spacing: cfg.link.copy_spacing,
            datagrams: cfg.link.lane_datagrams,
            room: cfg
                .link
                .max_rate_bps
                .zip(cfg.link.latency_queue)
                .filter(|_| cfg.link.latency_lane)
                .map(|(bps, q)| (bps / 8, q)),
        }
    }

    /// The store of delta bases for a link: the one earlier links used, unless its configured
    /// sizes changed (a reload) or deltas are off. With a disk tier configured, it is memory in
    /// front of files in the cache directory.
    fn bases(&self, cfg: &Config) -> Option<wanopt_codec::SharedBases> {
        let mem = cfg.optimize.codec.delta_bytes;
        let disk = cfg.optimize.disk.as_ref().map_or(0, |d| d.delta_bytes);
        let sizes = (mem, disk);
        let mut held = self.bases.lock().unwrap_or_else(|p| p.into_inner());
        if !cfg.optimize.enabled || mem == 0 {
            *held = None;
            return None;
        }
        match held.as_ref() {
            Some((n, b)) if *n == sizes => Some(b.clone()),
            _ => {
                let mem = usize::try_from(mem).unwrap_or(usize::MAX);
                // The old store (and its files) goes once the links using it are done.
                *held = None;
                let store = self
                    .caches
                    .as_ref()
                    .filter(|_| disk > 0)
                    .and_then(|c| c.bases_store(disk));
                let b = match store {
                    Some(st) => wanopt_codec::delta::shared_tiered(mem, disk, st),
                    None => wanopt_codec::delta::shared(mem),
                }?;
                *held = Some((sizes, b.clone()));
                Some(b)
            }
        }
    }

    pub fn cfg(&self) -> Arc<Config> {
        self.cfg.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn set_cfg(&self, cfg: Arc<Config>) {
        *self.cfg.write().unwrap_or_else(|p| p.into_inner()) = cfg;
    }

    pub fn tls(&self) -> TlsMaterial {
        self.tls.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn set_tls(&self, m: TlsMaterial) {
        *self.tls.write().unwrap_or_else(|p| p.into_inner()) = m;
    }

    /// The target address and idle timeout of one of our `target` services, in the config in
    /// force.
    pub fn target(&self, service: &str) -> Option<(String, Option<std::time::Duration>)> {
        self.cfg().services.iter().find_map(|s| match &s.kind {
            ServiceKind::Target { addr } if s.name == service => {
                Some((addr.clone(), s.idle_timeout))
            }
            _ => None,
        })
    }

    /// A new link on a connection whose main socket is `fd`, set up from the config in force.
    /// The saved cache states it offers are listed on a blocking thread.
    pub async fn new_link(&self, fd: Option<std::os::fd::RawFd>) -> Arc<LinkHandle> {
        let cfg = self.cfg();
        let mut lc = link_config(&cfg, self.caches.as_ref());
        lc.delta_bases = self.bases(&cfg);
        lc.workers = self.workers.clone();
        if lc.cache_storage.is_some() {
            lc.saved_states = self.saved_states().await;
        }
        let mut link = Link::new(lc);
        link.set_service_limits(targets(&cfg));
        link.set_policies(policies(&cfg));
        link.set_shaping(shaping(&cfg));
        let ctx = self.link_ctx(&cfg);
        let id = self.next_link_id.fetch_add(1, Relaxed);
        Arc::new(LinkHandle::new(link, fd, ctx, id))
    }

    /// The cache states saved for this peer, listed on a blocking thread (none without a disk
    /// tier).
    pub async fn saved_states(&self) -> Vec<wanopt_proto::SavedCache> {
        let cfg = self.cfg();
        let Some(dir) = self.caches.clone().filter(|_| cfg.optimize.disk.is_some()) else {
            return Vec::new();
        };
        let services = cfg.services.iter().map(|s| s.name.clone()).collect();
        tokio::task::spawn_blocking(move || dir.saved(&services))
            .await
            .unwrap_or_default()
    }

    /// What a reload applies to the current link: the services the peer may open, and each
    /// service's optimization policy and shaping (streams keep going).
    pub fn apply_services(&self, cfg: &Config) {
        if let Some(h) = self.current.borrow().clone() {
            h.with(|l| {
                l.set_service_limits(targets(cfg));
                l.set_policies(policies(cfg));
                l.set_shaping(shaping(cfg));
            });
        }
    }

    /// True once shutdown began.
    pub fn stopping(&self) -> bool {
        *self.shutdown.borrow()
    }
}

/// The services the peer may open streams to: our `target` ones, each with its limit.
fn targets(cfg: &Config) -> Vec<(String, ServiceLimit)> {
    cfg.services
        .iter()
        .filter(|s| matches!(s.kind, ServiceKind::Target { .. }))
        .map(|s| {
            let limit = ServiceLimit {
                max_streams: s.max_streams,
                class: Some(s.class),
            };
            (s.name.clone(), limit)
        })
        .collect()
}

/// Each service's optimization policy, for the link's outgoing streams.
fn policies(cfg: &Config) -> Vec<(String, wanopt_proto::StreamPolicy)> {
    cfg.services
        .iter()
        .map(|s| (s.name.clone(), s.policy))
        .collect()
}

/// How each bulk service shares what this side sends.
fn shaping(cfg: &Config) -> Vec<(String, wanopt_proto::Shaping)> {
    cfg.services
        .iter()
        .filter(|s| s.class == wanopt_proto::Class::Bulk)
        .map(|s| (s.name.clone(), s.shaping))
        .collect()
}

/// The link's settings a daemon of `cfg` runs with (benches encode with its frame size).
pub fn link_config(cfg: &Config, caches: Option<&Arc<CacheDir>>) -> LinkConfig {
    let mut c = LinkConfig::new(
        &cfg.site,
        &cfg.link.peer,
        matches!(cfg.link.role, LinkRole::Connect(_)),
    );
    c.stream_window = cfg.limits.stream_window;
    c.link_window = cfg.limits.link_window;
    c.max_streams = cfg.limits.max_streams;
    c.latency_reserve = cfg.limits.latency_reserve;
    c.send_buffer = cfg.limits.stream_buffer;
    c.keepalive = cfg.link.keepalive;
    c.idle_timeout = cfg.limits.idle_timeout;
    c.latency_lane = cfg.link.latency_lane;
    c.resume_window = cfg.link.resume_window;
    c.lane_copies = cfg.redundancy().most();
    c.lane_datagrams = cfg.link.lane_datagrams != crate::datagrams::Setting::Off;
    c.token = rand::random();
    if cfg.optimize.enabled {
        c.codec = Some(cfg.optimize.codec.clone());
        if let (Some(d), Some(dir)) = (&cfg.optimize.disk, caches) {
            c.cache_storage = Some(dir.clone());
            c.checkpoint_interval = d.checkpoint;
        }
        // Frames must hold the largest chunk (four times the average) and its record.
        c.max_frame = c
            .max_frame
            .max(u32::try_from(cfg.optimize.codec.avg_chunk * 4 + 4096).unwrap_or(u32::MAX));
    }
    c
}

/// Test support: a peer of a site, with certificates minted in a folder of its own, and what its
/// links tell its supervisor.
#[cfg(test)]
pub(crate) mod testing {
    use std::path::Path;
    use std::sync::Arc;

    use tokio::sync::{mpsc, watch};

    use super::Peer;
    use crate::config::Config;
    use crate::counters::Counters;
    use crate::driver::LinkMsg;

    pub(crate) struct TestPeer {
        pub peer: Arc<Peer>,
        pub rx: mpsc::UnboundedReceiver<LinkMsg>,
        _stop: watch::Sender<bool>,
    }

    /// Mints a CA and certificates for `sites` in `dir` (reusing its CA if there is one).
    pub(crate) fn certs(dir: &Path, sites: &[&str]) {
        let sites: Vec<String> = sites.iter().map(|s| s.to_string()).collect();
        crate::tls::create_site_certs(dir, &sites, &Default::default()).expect("certificates");
    }

    /// A peer of `site` whose certificates are in `dir`, with `link` as its config's link
    /// section (a YAML flow mapping) and optimization off.
    pub(crate) fn peer(dir: &Path, site: &str, link: &str) -> TestPeer {
        let yaml = format!(
            "site: {site}\nlink: {link}\ntls: {{ca: ca.pem, cert: {site}.pem, key: {site}.key}}\nstate_dir: state-{site}\noptimize: {{enabled: false}}\n"
        );
        let cfg = Config::parse(&yaml, &dir.join(format!("{site}.yaml"))).expect("config");
        let tls = crate::tls::load(&cfg.tls).expect("tls");
        let (stop, shutdown) = watch::channel(false);
        let (tx, rx) = mpsc::unbounded_channel();
        let counters = Arc::new(Counters::new());
        TestPeer {
            peer: Arc::new(Peer::new(Arc::new(cfg), tls, counters, None, shutdown, tx)),
            rx,
            _stop: stop,
        }
    }
}
