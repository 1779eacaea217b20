//! The daemon: binds the service listeners and the link, keeps one TLS link to the peer up, and
//! moves bytes between local sockets and the link's streams.
//!
//! One task drives each link (a reader and a writer around the sans-IO [`Link`], shared behind a
//! mutex); each stream is one task that pumps both directions of its local socket. Wakeups travel
//! through per-stream [`Notify`]s fed from the link's events. A [`Peer`] holds everything about one
//! peer, so a daemon can later serve several.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use rand::Rng;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use tracing::{debug, info, warn};
use wanopt_proto::{
    Class, CloseCode, Event, Frame, FrameError, LANES, LATENCY_LANE, Link, LinkConfig, LinkError,
    MAIN_LANE, ReadOutcome, ResetCode, StreamError, StreamId,
};

use crate::cachedir::CacheDir;
use crate::config::{Config, LinkRole, Service, ServiceKind};
use crate::counters::{Counters, ServiceCounters, add};
use crate::sockopt;
use crate::tls::{self, TlsMaterial};

/// Largest batch of frames handed to TLS at once; small, so latency frames never wait long.
const TRANSMIT_BATCH: usize = 64 * 1024;
/// Read size for local sockets and the link.
const READ_CHUNK: usize = 64 * 1024;

/// A link connection under TLS: reads are buffered, because rustls asks for at most 4 KiB at a
/// time, which would cost three `recv` calls per 8 KiB record instead of one.
type Wire = tokio::io::BufReader<TcpStream>;

fn wire(tcp: TcpStream) -> Wire {
    tokio::io::BufReader::with_capacity(READ_CHUNK, tcp)
}

/// A failure that stops the daemon.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("cannot bind {what} on {addr}: {source}")]
    Bind {
        what: String,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    #[error(transparent)]
    Cache(#[from] crate::cachedir::CacheDirError),
}

/// Wakeups and the reset reason of one stream.
#[derive(Debug, Default)]
struct StreamSignal {
    readable: Notify,
    writable: Notify,
    /// Reset, link closed, or finished: the stream is gone from the link.
    gone: Notify,
    reset: Mutex<Option<String>>,
}

impl StreamSignal {
    fn reason(&self) -> String {
        lock(&self.reset)
            .clone()
            .unwrap_or_else(|| "stream closed".to_string())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

struct Inner {
    link: Link,
    signals: HashMap<StreamId, Arc<StreamSignal>>,
    opened: Vec<(StreamId, Arc<str>, Class)>,
    up: bool,
}

/// One live link: the protocol state machine and the wakeups around it.
struct LinkHandle {
    inner: Mutex<Inner>,
    /// Wakes each lane's writer: there may be frames to send.
    tx: [Notify; LANES],
    /// The timer deadline the main lane's writer sleeps until (`None`: no timer armed).
    armed: Mutex<Option<Instant>>,
    /// The latency lane's task, ended with the link.
    lane_task: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Each lane's socket while it is open, for `TCP_INFO`; cleared before the socket is closed.
    fds: Mutex<[Option<std::os::fd::RawFd>; LANES]>,
    peer: Arc<Peer>,
    id: u64,
}

impl LinkHandle {
    /// Wakes every lane's writer.
    /// Wakes the writers of the lanes that have frames to send (or must notice the link closed);
    /// an idle lane's writer is left asleep, which saves a task switch on the latency path.
    fn kick(&self) {
        let wants = self.wants(&lock(&self.inner));
        self.wake(wants);
    }

    /// Which lanes' writers [`kick`](Self::kick) would wake, decided under the link's lock that
    /// the caller already holds (one lock round trip less on the latency path).
    fn wants(&self, g: &Inner) -> [bool; LANES] {
        let closed = g.link.is_closed();
        // The main lane's writer also runs the link's timers: wake it when they moved
        // earlier than what it sleeps until (the peer's hello arms them, for one).
        let timer = g.link.poll_timeout();
        let armed = *lock(&self.armed);
        let rearm = timer.is_some_and(|t| armed.is_none_or(|a| t < a));
        std::array::from_fn(|l| {
            closed || g.link.wants_transmit_lane(l) || (l == MAIN_LANE && rearm)
        })
    }

    /// Wakes the writers chosen by [`wants`](Self::wants), after the link's lock is released.
    fn wake(&self, wants: [bool; LANES]) {
        for (t, w) in self.tx.iter().zip(wants) {
            if w {
                t.notify_one();
            }
        }
    }

    fn with<R>(&self, f: impl FnOnce(&mut Link) -> R) -> R {
        let mut g = lock(&self.inner);
        let r = f(&mut g.link);
        self.dispatch(&mut g);
        r
    }

    /// Routes the link's events to the stream tasks and counters.
    fn dispatch(&self, g: &mut Inner) {
        while let Some(ev) = g.link.poll_event() {
            match ev {
                Event::Up { .. } => g.up = true,
                Event::Opened {
                    stream,
                    class,
                    service,
                } => {
                    g.signals.insert(stream, Arc::default());
                    g.opened.push((stream, service, class));
                }
                Event::Refused { stream, service } => {
                    add(&self.peer.counters.link.unknown_service, 1);
                    warn!(link = self.id, stream = %stream, service = %service, "refused stream for unknown service");
                }
                Event::Readable(id) => {
                    if let Some(s) = g.signals.get(&id) {
                        s.readable.notify_one();
                    }
                }
                Event::Writable(id) => {
                    if let Some(s) = g.signals.get(&id) {
                        s.writable.notify_one();
                    }
                }
                Event::Reset {
                    stream,
                    code,
                    reason,
                } => {
                    if let Some(s) = g.signals.get(&stream) {
                        *lock(&s.reset) = Some(format!("{}: {reason}", code.label()));
                        s.readable.notify_one();
                        s.writable.notify_one();
                        s.gone.notify_one();
                    }
                }
                Event::Done(id) => {
                    if let Some(s) = g.signals.get(&id) {
                        s.gone.notify_one();
                    }
                }
                Event::Closed(_) => {}
                Event::Checkpoint {
                    role,
                    lane,
                    scope,
                    state,
                } => {
                    if let Some(c) = &self.peer.caches {
                        c.save(role, lane, &scope, state);
                    }
                }
            }
        }
        for (svc, c) in g.link.take_wire_counts() {
            let sc = self.peer.counters.service(&svc);
            add(&sc.wire_out, c.out);
            add(&sc.wire_in, c.inbound);
        }
        for (svc, c) in g.link.take_codec_counts() {
            // Bytes of streams already closed are decoded (to keep the cache in step) under "".
            if !svc.is_empty() {
                self.peer.counters.codec.record(&svc, &c);
            }
        }
    }

    /// Registers a new outgoing stream.
    fn open(
        &self,
        service: &str,
        class: Class,
    ) -> Result<(StreamId, Arc<StreamSignal>), StreamError> {
        let mut g = lock(&self.inner);
        let id = g.link.open(service, class)?;
        let sig: Arc<StreamSignal> = Arc::default();
        g.signals.insert(id, sig.clone());
        drop(g);
        self.kick();
        Ok((id, sig))
    }

    fn forget(&self, id: StreamId) {
        lock(&self.inner).signals.remove(&id);
    }

    fn reset(&self, id: StreamId, code: ResetCode, reason: &str) {
        self.with(|l| l.reset(id, code, reason));
        self.kick();
    }
}

/// Everything about one peer: its config, counters, and the current link.
struct Peer {
    /// The config in force; a reload swaps it (services only) for new streams and clients.
    cfg: std::sync::RwLock<Arc<Config>>,
    /// Certificates and keys; a reload re-reads them for the next connections.
    tls: std::sync::RwLock<TlsMaterial>,
    counters: Arc<Counters>,
    current: watch::Sender<Option<Arc<LinkHandle>>>,
    shutdown: watch::Receiver<bool>,
    next_link_id: std::sync::atomic::AtomicU64,
    /// The chunk caches' disk tier and saved states, when configured.
    caches: Option<Arc<CacheDir>>,
}

impl Peer {
    fn cfg(&self) -> Arc<Config> {
        self.cfg.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
    fn tls(&self) -> TlsMaterial {
        self.tls.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// Addresses the daemon bound (useful when the config asked for port 0).
#[derive(Debug, Clone, Default)]
pub struct Bound {
    pub link: Option<SocketAddr>,
    pub admin: Option<SocketAddr>,
    pub services: Vec<(String, SocketAddr)>,
}

/// A daemon with its sockets bound, ready to [`serve`](Daemon::serve).
pub struct Daemon {
    peer: Arc<Peer>,
    link_listener: Option<TcpListener>,
    admin_listener: Option<TcpListener>,
    service_listeners: Vec<(Service, TcpListener)>,
    shutdown_tx: watch::Sender<bool>,
    bound: Bound,
}

impl Daemon {
    /// Loads TLS material and binds every listener; logs each bound address.
    pub fn bind(cfg: Config, counters: Arc<Counters>) -> Result<Daemon, DaemonError> {
        let tls = tls::load(&cfg.tls)?;
        if let Some(t) = tls.cert_expiry {
            counters.certs.set("own", t);
        }
        if let Some(t) = tls.ca_expiry {
            counters.certs.set("ca", t);
        }
        let cfg = Arc::new(cfg);
        sockopt::check_buffer_sysctls(&cfg.link);
        let mut bound = Bound::default();
        let link_listener = match &cfg.link.role {
            LinkRole::Listen(addr) => {
                let l = sockopt::link_listener(*addr, &cfg.link).map_err(|source| {
                    DaemonError::Bind {
                        what: "link".into(),
                        addr: *addr,
                        source,
                    }
                })?;
                let local = l.local_addr().unwrap_or(*addr);
                info!(kind = "link", addr = %local, peer = %cfg.link.peer, "bound");
                bound.link = Some(local);
                Some(l)
            }
            LinkRole::Connect(_) => None,
        };
        let admin_listener = match cfg.admin {
            Some(addr) => {
                let l = sockopt::local_listener(addr).map_err(|source| DaemonError::Bind {
                    what: "admin endpoint".into(),
                    addr,
                    source,
                })?;
                let local = l.local_addr().unwrap_or(addr);
                info!(kind = "admin", addr = %local, "bound");
                bound.admin = Some(local);
                Some(l)
            }
            None => None,
        };
        let mut service_listeners = Vec::new();
        for s in &cfg.services {
            if let ServiceKind::Listen { addr, allow } = &s.kind {
                let l = sockopt::local_listener(*addr).map_err(|source| DaemonError::Bind {
                    what: format!("service {}", s.name),
                    addr: *addr,
                    source,
                })?;
                let local = l.local_addr().unwrap_or(*addr);
                info!(kind = "service", service = %s.name, addr = %local, "bound");
                if !addr.ip().is_loopback() && allow.is_empty() {
                    warn!(service = %s.name, addr = %local, "service listens beyond loopback with no allow list: any host that reaches it can use the tunnel");
                }
                bound.services.push((s.name.clone(), local));
                service_listeners.push((s.clone(), l));
            }
        }
        let caches = match (&cfg.optimize.disk, cfg.optimize.enabled) {
            (Some(d), true) => {
                let c = CacheDir::open(
                    &cfg.state_dir,
                    &cfg.link.peer,
                    cfg.optimize.codec.clone(),
                    d.key,
                )?;
                info!(dir = %c.root().display(), bytes = cfg.optimize.codec.disk_bytes,
                      encrypted = d.key.is_some(), "chunk caches have a disk tier");
                Some(Arc::new(c))
            }
            _ => None,
        };
        let (shutdown_tx, shutdown) = watch::channel(false);
        let (current, _) = watch::channel(None);
        let peer = Arc::new(Peer {
            caches,
            cfg: std::sync::RwLock::new(cfg),
            tls: std::sync::RwLock::new(tls),
            counters,
            current,
            shutdown,
            next_link_id: 1.into(),
        });
        Ok(Daemon {
            peer,
            link_listener,
            admin_listener,
            service_listeners,
            shutdown_tx,
            bound,
        })
    }

    /// The config file this daemon was started from (reloads re-read it).
    pub fn config_path(&self) -> std::path::PathBuf {
        self.peer.cfg().path.clone()
    }

    /// The peer's site name.
    pub fn peer_name(&self) -> String {
        self.peer.cfg().link.peer.clone()
    }

    /// The addresses bound.
    pub fn bound(&self) -> &Bound {
        &self.bound
    }

    /// Serves until `stop` resolves, then shuts down gracefully: stop accepting, let streams drain
    /// for up to the configured grace period, close the link cleanly.
    pub async fn serve(self, stop: impl std::future::Future<Output = ()>) {
        let (_keep, reloads) = tokio::sync::mpsc::unbounded_channel();
        self.serve_with_reload(stop, reloads).await;
    }

    /// Like [`serve`](Self::serve); each config received on `reloads` is applied as a reload.
    pub async fn serve_with_reload(
        self,
        stop: impl std::future::Future<Output = ()>,
        mut reloads: tokio::sync::mpsc::UnboundedReceiver<Config>,
    ) {
        let peer = self.peer.clone();
        let mut tasks = Vec::new();
        let mut listeners: HashMap<String, Listener> = HashMap::new();
        for (svc, l) in self.service_listeners {
            let bound = l.local_addr().ok();
            let task = tokio::spawn(accept_clients(peer.clone(), svc.name.clone(), l));
            if let ServiceKind::Listen { addr, .. } = &svc.kind {
                listeners.insert(
                    svc.name.clone(),
                    Listener {
                        configured: *addr,
                        bound: bound.unwrap_or(*addr),
                        task,
                    },
                );
            }
        }
        if let Some(l) = self.admin_listener {
            tasks.push(tokio::spawn(crate::admin::serve(l, peer.counters.clone())));
        }
        let link_task = match self.link_listener {
            Some(l) => tokio::spawn(accept_links(peer.clone(), l)),
            None => tokio::spawn(connect_loop(peer.clone())),
        };
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = &mut stop => break,
                Some(new) = reloads.recv() => apply_reload(&peer, new, &mut listeners),
            }
        }
        for (_, l) in listeners.drain() {
            l.task.abort();
        }
        crate::notify::send("STOPPING=1\nSTATUS=draining streams");
        info!("shutting down: no new connections; draining streams");
        let _ = self.shutdown_tx.send(true);
        for t in tasks {
            t.abort();
        }
        let current = peer.current.borrow().clone();
        if let Some(h) = current {
            h.with(Link::drain);
            let deadline = tokio::time::Instant::now() + peer.cfg().limits.shutdown_grace;
            loop {
                let n = h.with(|l| l.stream_count());
                if n == 0 {
                    break;
                }
                if tokio::time::Instant::now() >= deadline {
                    warn!(streams = n, "grace period over; failing remaining streams");
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            h.with(|l| l.close(CloseCode::Normal, "peer is shutting down"));
            h.kick();
            // Give the writer a moment to send the GoAway.
            let mut rx = peer.current.subscribe();
            let _ =
                tokio::time::timeout(Duration::from_secs(2), rx.wait_for(|c| c.is_none())).await;
        }
        link_task.abort();
        if let Some(c) = &peer.caches {
            // The states saved as the link closed are what the next start resumes.
            c.flush(Duration::from_secs(30)).await;
        }
        for (name, c) in peer.counters.snapshot() {
            info!(service = %name, raw_out = c.raw_out, raw_in = c.raw_in, wire_out = c.wire_out, wire_in = c.wire_in,
                  opened = c.opened, refused = c.refused, "service totals");
        }
        info!("stopped");
    }
}

/// Applies a reloaded config: services are added, removed and changed in place; streams already
/// open are untouched and finish with the settings they started with. Link, TLS, admin, state and
/// limit changes need a restart, which is logged.
/// A running service listener: its configured and bound addresses, and its accept task.
struct Listener {
    configured: SocketAddr,
    bound: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

fn apply_reload(peer: &Arc<Peer>, new: Config, listeners: &mut HashMap<String, Listener>) {
    let old = peer.cfg();
    let mut needs_restart = Vec::new();
    if new.site != old.site {
        needs_restart.push("site");
    }
    if new.link != old.link {
        needs_restart.push("link");
    }
    // Certificates are re-read on every reload (renewed files keep their paths): the next link
    // connections use them; the current link goes on with the ones it authenticated with.
    let tls_changed = new.tls != old.tls;
    match tls::load(&new.tls) {
        Ok(m) => {
            if let Some(t) = m.cert_expiry {
                peer.counters.certs.set("own", t);
            }
            if let Some(t) = m.ca_expiry {
                peer.counters.certs.set("ca", t);
            }
            *peer.tls.write().unwrap_or_else(|p| p.into_inner()) = m;
            info!("reload: certificates re-read; new link connections use them");
        }
        Err(e) => {
            warn!(error = %e, "reload: cannot load the TLS files; keeping the current certificates")
        }
    }
    if new.admin != old.admin {
        needs_restart.push("admin");
    }
    if new.limits != old.limits {
        needs_restart.push("limits");
    }
    if new.state_dir != old.state_dir {
        needs_restart.push("state_dir");
    }
    // Cache sizes and chunking are agreed in the link hello; services' own policies apply at once.
    if new.optimize != old.optimize {
        needs_restart.push("optimize");
    }
    if !needs_restart.is_empty() {
        warn!(sections = %needs_restart.join(", "), "reload: these sections changed and need a restart (systemctl restart); applying the services only");
    }
    let mut merged = (*old).clone();
    merged.services = new.services.clone();
    if tls_changed {
        merged.tls = new.tls.clone();
    }
    let merged = Arc::new(merged);
    let listen_addr = |s: &Service| match &s.kind {
        ServiceKind::Listen { addr, .. } => Some(*addr),
        ServiceKind::Target { .. } => None,
    };
    // Stop listeners whose service is gone or moved; their open streams go on.
    let wanted: HashMap<&str, SocketAddr> = new
        .services
        .iter()
        .filter_map(|s| Some((s.name.as_str(), listen_addr(s)?)))
        .collect();
    let mut removed = Vec::new();
    listeners.retain(|name, l| {
        // Kept if the address is unchanged, or now names the port an earlier `:0` got.
        let keep = wanted
            .get(name.as_str())
            .is_some_and(|a| *a == l.configured || *a == l.bound);
        if !keep {
            l.task.abort();
            removed.push(name.clone());
        }
        keep
    });
    *peer.cfg.write().unwrap_or_else(|p| p.into_inner()) = merged.clone();
    let mut added = Vec::new();
    for (name, addr) in wanted {
        if listeners.contains_key(name) {
            continue;
        }
        match sockopt::local_listener(addr) {
            Ok(l) => {
                let local = l.local_addr().unwrap_or(addr);
                info!(kind = "service", service = %name, addr = %local, "bound");
                let task = tokio::spawn(accept_clients(peer.clone(), name.to_string(), l));
                listeners.insert(
                    name.to_string(),
                    Listener {
                        configured: addr,
                        bound: local,
                        task,
                    },
                );
                added.push(name.to_string());
            }
            Err(e) => {
                warn!(service = %name, addr = %addr, error = %e, "reload: cannot bind the service; it stays off")
            }
        }
    }
    // The peer may open streams to the new set of target services from now on.
    let targets: Vec<String> = merged
        .services
        .iter()
        .filter(|s| matches!(s.kind, ServiceKind::Target { .. }))
        .map(|s| s.name.clone())
        .collect();
    if let Some(h) = peer.current.borrow().clone() {
        h.with(|l| {
            l.set_services(&targets);
            l.set_policies(policies(&merged));
        });
    }
    let changed: Vec<&str> = new
        .services
        .iter()
        .filter(|s| old.services.iter().any(|o| o.name == s.name && o != *s))
        .map(|s| s.name.as_str())
        .collect();
    info!(
        started = %added.join(","),
        stopped = %removed.join(","),
        changed = %changed.join(","),
        services = merged.services.len(),
        "reloaded"
    );
    crate::notify::status("config reloaded");
}

/// Each service's optimization policy, for the link's outgoing streams.
fn policies(cfg: &Config) -> Vec<(String, wanopt_proto::StreamPolicy)> {
    cfg.services
        .iter()
        .map(|s| (s.name.clone(), s.policy))
        .collect()
}

fn link_config(cfg: &Config, caches: Option<&Arc<CacheDir>>) -> LinkConfig {
    let mut c = LinkConfig::new(
        &cfg.site,
        &cfg.link.peer,
        matches!(cfg.link.role, LinkRole::Connect(_)),
    );
    c.stream_window = cfg.limits.stream_window;
    c.link_window = cfg.limits.link_window;
    c.max_streams = cfg.limits.max_streams;
    c.send_buffer = cfg.limits.stream_buffer;
    c.keepalive = cfg.link.keepalive;
    c.idle_timeout = cfg.limits.idle_timeout;
    c.latency_lane = cfg.link.latency_lane;
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

/// Reads the first frame of a new connection (a hello) with a deadline; returns the buffer, which
/// still holds the frame, and the frame's length.
async fn read_first_frame<R: AsyncRead + Unpin>(
    rd: &mut R,
    deadline: Duration,
) -> Result<(BytesMut, Frame, usize), String> {
    let mut buf = BytesMut::with_capacity(4096);
    let end = tokio::time::Instant::now() + deadline;
    loop {
        match Frame::check(&buf, 4096) {
            Ok(n) => {
                let f = Frame::parse(bytes::Bytes::copy_from_slice(&buf[..n]))
                    .map_err(|e| e.to_string())?;
                return Ok((buf, f, n));
            }
            Err(FrameError::Incomplete) => {}
            Err(e) => return Err(e.to_string()),
        }
        match tokio::time::timeout_at(end, rd.read_buf(&mut buf)).await {
            Err(_) => return Err("no hello in time".into()),
            Ok(Ok(0)) => return Err("closed before its hello".into()),
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(format!("read: {e}")),
        }
    }
}

/// Accepts the peer's TLS connections (listening side); the newest authenticated link wins.
async fn accept_links(peer: Arc<Peer>, listener: TcpListener) {
    loop {
        let (tcp, addr) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                warn!(error = %e, "link accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let peer = peer.clone();
        let acceptor = tokio_rustls::TlsAcceptor::from(peer.tls().server);
        tokio::spawn(async move {
            let sock = socket2::SockRef::from(&tcp);
            // Congestion control stays the listener's (the lane's) until the hello shows the role.
            sockopt::tune_link_options(&sock, &peer.cfg().link);
            let hs = tokio::time::timeout(
                peer.cfg().limits.handshake_timeout,
                acceptor.accept(wire(tcp)),
            )
            .await;
            let tls = match hs {
                Ok(Ok(t)) => t,
                Ok(Err(e)) => {
                    add(&peer.counters.link.rejected, 1);
                    warn!(from = %addr, error = %e, "rejected link: TLS handshake failed");
                    return;
                }
                Err(_) => {
                    add(&peer.counters.link.rejected, 1);
                    warn!(from = %addr, "rejected link: TLS handshake timed out");
                    return;
                }
            };
            record_peer_expiry(&peer, tls.get_ref().1.peer_certificates());
            if let Err(e) =
                tls::check_peer_name(tls.get_ref().1.peer_certificates(), &peer.cfg().link.peer)
            {
                add(&peer.counters.link.rejected, 1);
                warn!(from = %addr, error = %e, "rejected link: wrong peer");
                return;
            }
            let mut tls = tls;
            let (mut buf, first, n) =
                match read_first_frame(&mut tls, peer.cfg().limits.handshake_timeout).await {
                    Ok(x) => x,
                    Err(e) => {
                        add(&peer.counters.link.rejected, 1);
                        warn!(from = %addr, error = %e, "rejected link: no valid hello");
                        return;
                    }
                };
            let attach = match &first {
                Frame::Hello(h) => h.setting(wanopt_proto::frame::setting::ATTACH),
                _ => None,
            };
            match attach {
                None => {
                    let sock = socket2::SockRef::from(tls.get_ref().0.get_ref());
                    sockopt::tune_main_lane(&sock, &peer.cfg().link);
                    sockopt::log_effective(&sock, &peer.cfg().link);
                    let fd = tls.get_ref().0.get_ref().as_raw_fd();
                    run_link(peer, tls, fd, addr, buf).await
                }
                Some(token) => {
                    let _ = buf.split_to(n);
                    sockopt::tune_lane_socket(
                        &socket2::SockRef::from(tls.get_ref().0.get_ref()),
                        &peer.cfg().link,
                    );
                    let fd = tls.get_ref().0.get_ref().as_raw_fd();
                    accept_lane(peer, tls, fd, addr, token, buf).await;
                }
            }
        });
    }
}

/// Attaches an incoming second connection as the latency lane of the link whose token it presents.
async fn accept_lane<S>(
    peer: Arc<Peer>,
    stream: S,
    fd: std::os::fd::RawFd,
    addr: SocketAddr,
    token: u64,
    buf: BytesMut,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    // The lane may arrive before this side has processed the main connection's hello.
    let mut rx = peer.current.subscribe();
    let attached = tokio::time::timeout(peer.cfg().limits.handshake_timeout, async {
        loop {
            let current = rx.borrow_and_update().clone();
            if let Some(h) = current
                && h.with(|l| l.attach_lane(token))
            {
                return Some(h);
            }
            if rx.changed().await.is_err() {
                return None;
            }
        }
    })
    .await;
    match attached {
        Ok(Some(h)) => {
            info!(link = h.id, from = %addr, "latency lane attached");
            peer.counters.link.lanes.set(2);
            let task = tokio::spawn(run_lane(h.clone(), stream, fd, addr, buf));
            *lock(&h.lane_task) = Some(task);
        }
        _ => {
            add(&peer.counters.link.rejected, 1);
            warn!(from = %addr, "rejected latency lane: no link with its token");
        }
    }
}

/// Opens the latency lane of a link (connecting side). Boxed: it is spawned from the link's own
/// reader, which it runs again for the lane.
fn open_lane(
    h: Arc<LinkHandle>,
    token: u64,
    target: String,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
    Box::pin(async move {
        let peer = h.peer.clone();
        let connector = tokio_rustls::TlsConnector::from(peer.tls().client);
        let Ok(name) = tls::server_name(&peer.cfg().link.peer) else {
            return;
        };
        let cc = peer.cfg().link.lane_congestion.clone();
        let (mut tls, addr) = match dial(&peer, &target, &connector, name, &cc).await {
            Ok(x) => x,
            Err(e) => {
                warn!(link = h.id, error = %e, "cannot open the latency lane; latency streams share the main connection");
                return;
            }
        };
        sockopt::tune_lane_socket(
            &socket2::SockRef::from(tls.get_ref().0.get_ref()),
            &peer.cfg().link,
        );
        let mut hello = BytesMut::new();
        h.with(|l| l.lane_hello(token)).encode(&mut hello);
        if let Err(e) = tls.write_all(&hello).await {
            warn!(link = h.id, error = %e, "cannot open the latency lane");
            return;
        }
        if !h.with(|l| l.attach_lane(token)) {
            return;
        }
        info!(link = h.id, addr = %addr, "latency lane attached");
        peer.counters.link.lanes.set(2);
        let fd = tls.get_ref().0.get_ref().as_raw_fd();
        run_lane(h, tls, fd, addr, BytesMut::new()).await;
    })
}

/// Moves the latency lane's bytes until it or the link ends. Losing the lane fails the link.
async fn run_lane<S>(
    h: Arc<LinkHandle>,
    stream: S,
    fd: std::os::fd::RawFd,
    addr: SocketAddr,
    buf: BytesMut,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (rd, wr) = tokio::io::split(stream);
    lock(&h.fds)[LATENCY_LANE] = Some(fd);
    let reader = read_link(h.clone(), rd, addr, LATENCY_LANE, buf);
    let writer = write_link(h.clone(), wr, LATENCY_LANE);
    tokio::pin!(reader, writer);
    let why = tokio::select! {
        r = &mut reader => r,
        w = &mut writer => w,
    };
    lock(&h.fds)[LATENCY_LANE] = None;
    if !h.with(|l| l.is_closed()) {
        h.with(|l| l.connection_lost(&format!("latency lane: {why}")));
        h.kick();
    }
}

fn record_peer_expiry(peer: &Peer, certs: Option<&[rustls::pki_types::CertificateDer<'_>]>) {
    if let Some(t) = certs
        .and_then(|c| c.first())
        .and_then(|c| tls::not_after(c))
    {
        peer.counters.certs.set("peer", t);
    }
}

/// Dials the peer (connecting side) and keeps a link up, with capped exponential backoff and jitter.
async fn connect_loop(peer: Arc<Peer>) {
    let LinkRole::Connect(target) = peer.cfg().link.role.clone() else {
        return;
    };
    let name = match tls::server_name(&peer.cfg().link.peer) {
        Ok(n) => n,
        Err(e) => {
            warn!(error = %e, "cannot dial the peer");
            return;
        }
    };
    let mut backoff = peer.cfg().link.reconnect_min;
    let mut shutdown = peer.shutdown.clone();
    loop {
        if *shutdown.borrow() {
            return;
        }
        let started = Instant::now();
        // Built per attempt, so certificates re-read by a reload are used from the next dial.
        let connector = tokio_rustls::TlsConnector::from(peer.tls().client);
        let cc = peer.cfg().link.congestion.clone();
        match dial(&peer, &target, &connector, name.clone(), &cc).await {
            Ok((tls, addr)) => {
                record_peer_expiry(&peer, tls.get_ref().1.peer_certificates());
                sockopt::log_effective(
                    &socket2::SockRef::from(tls.get_ref().0.get_ref()),
                    &peer.cfg().link,
                );
                sockopt::tune_main_lane(
                    &socket2::SockRef::from(tls.get_ref().0.get_ref()),
                    &peer.cfg().link,
                );
                let fd = tls.get_ref().0.get_ref().as_raw_fd();
                run_link(peer.clone(), tls, fd, addr, BytesMut::new()).await;
                if started.elapsed() > Duration::from_secs(5) {
                    backoff = peer.cfg().link.reconnect_min;
                }
            }
            Err(e) => {
                warn!(peer = %target, error = %e, retry_in_ms = backoff.as_millis() as u64, "cannot reach the peer")
            }
        }
        let jitter = rand::rng().random_range(0.5..1.5);
        let wait = backoff.mul_f64(jitter);
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
        backoff = (backoff * 2).min(peer.cfg().link.reconnect_max);
    }
}

async fn dial(
    peer: &Peer,
    target: &str,
    connector: &tokio_rustls::TlsConnector,
    name: rustls::pki_types::ServerName<'static>,
    cc: &str,
) -> Result<(tokio_rustls::client::TlsStream<Wire>, SocketAddr), String> {
    let limits = &peer.cfg().limits;
    let addr = tokio::net::lookup_host(target)
        .await
        .map_err(|e| format!("resolve {target}: {e}"))?
        .next()
        .ok_or_else(|| format!("resolve {target}: no address"))?;
    let tcp = tokio::time::timeout(
        limits.connect_timeout,
        sockopt::link_connect(addr, &peer.cfg().link, cc),
    )
    .await
    .map_err(|_| format!("connect {addr}: timed out"))?
    .map_err(|e| format!("connect {addr}: {e}"))?;
    let tls = tokio::time::timeout(limits.handshake_timeout, connector.connect(name, wire(tcp)))
        .await
        .map_err(|_| format!("TLS handshake with {addr}: timed out"))?
        .map_err(|e| format!("TLS handshake with {addr}: {e}"))?;
    Ok((tls, addr))
}

/// Runs one authenticated link until it ends.
async fn run_link<S>(
    peer: Arc<Peer>,
    stream: S,
    fd: std::os::fd::RawFd,
    addr: SocketAddr,
    initial: BytesMut,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let id = peer.next_link_id.fetch_add(1, Relaxed);
    let mut link = Link::new(link_config(&peer.cfg(), peer.caches.as_ref()));
    link.set_services(peer.cfg().services.iter().filter_map(|s| match s.kind {
        ServiceKind::Target { .. } => Some(s.name.as_str()),
        ServiceKind::Listen { .. } => None,
    }));
    link.set_policies(policies(&peer.cfg()));
    let h = Arc::new(LinkHandle {
        inner: Mutex::new(Inner {
            link,
            signals: HashMap::new(),
            opened: Vec::new(),
            up: false,
        }),
        tx: Default::default(),
        armed: Mutex::new(None),
        lane_task: Mutex::new(None),
        fds: Mutex::new([Some(fd), None]),
        peer: peer.clone(),
        id,
    });
    let (rd, wr) = tokio::io::split(stream);
    let reader = read_link(h.clone(), rd, addr, MAIN_LANE, initial);
    let writer = write_link(h.clone(), wr, MAIN_LANE);
    let sampler = tokio::spawn(sample_sockets(h.clone()));
    tokio::pin!(reader, writer);
    let why = tokio::select! {
        r = &mut reader => {
            // Let the writer flush what the reader queued (a GoAway after a protocol error).
            h.kick();
            let _ = tokio::time::timeout(Duration::from_secs(1), &mut writer).await;
            r
        }
        w = &mut writer => w,
    };
    // Forget the sockets before they close, so no TCP_INFO read can hit a reused descriptor.
    *lock(&h.fds) = [None, None];
    sampler.abort();
    if let Some(t) = lock(&h.lane_task).take() {
        t.abort();
    }
    let was_up = {
        let mut g = lock(&h.inner);
        g.link.connection_lost(&why);
        let g_close = g.link.close_error().cloned();
        let err = g_close.as_ref().map(ToString::to_string);
        h.dispatch(&mut g);
        // Wake every stream: their link is gone.
        for s in g.signals.values() {
            s.readable.notify_one();
            s.writable.notify_one();
            s.gone.notify_one();
        }
        let up = g.up;
        drop(g);
        let orderly = matches!(
            g_close,
            Some(LinkError::PeerClosed {
                code: CloseCode::Normal | CloseCode::Replaced,
                ..
            })
        ) || (g_close.is_none() && why == "closed");
        if up {
            add(&peer.counters.link.disconnects, 1);
            let reason = err.unwrap_or(why);
            if orderly {
                info!(link = id, peer = %peer.cfg().link.peer, reason = %reason, "link closed");
            } else {
                warn!(link = id, peer = %peer.cfg().link.peer, reason = %reason, "link down");
            }
        } else {
            warn!(link = id, from = %addr, reason = %err.unwrap_or(why), "link failed before it came up");
        }
        up
    };
    if was_up {
        peer.current.send_if_modified(|c| {
            if c.as_ref().is_some_and(|x| Arc::ptr_eq(x, &h)) {
                *c = None;
                peer.counters.link.up.set(0);
                peer.counters.link.lanes.set(0);
                crate::notify::status(&format!(
                    "link to {} down; reconnecting",
                    peer.cfg().link.peer
                ));
                true
            } else {
                false
            }
        });
    }
}

/// Samples `TCP_INFO` of the link's sockets into the metrics every two seconds.
async fn sample_sockets(h: Arc<LinkHandle>) {
    loop {
        {
            // The lock keeps a lane's descriptor from being cleared and closed during the read.
            let fds = lock(&h.fds);
            for (lane, name) in [(MAIN_LANE, "main"), (LATENCY_LANE, "latency")] {
                if let Some(t) = fds[lane].and_then(sockopt::tcp_info) {
                    h.peer.counters.sockets.record(name, &t);
                }
            }
        }
        let caches = lock(&h.inner).link.cache_stats();
        h.peer.counters.codec.record_caches(&caches);
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// Reads one lane of a link into its state machine. `buf` may already hold the first bytes.
async fn read_link<R: AsyncRead + Unpin>(
    h: Arc<LinkHandle>,
    mut rd: R,
    addr: SocketAddr,
    lane: usize,
    mut buf: BytesMut,
) -> String {
    let peer = h.peer.clone();
    let handshake_deadline = tokio::time::Instant::now() + peer.cfg().limits.handshake_timeout;
    // Only the main lane carries the hello; a lane exists only once the link is up.
    let mut announced = lane != MAIN_LANE;
    let mut pending = !buf.is_empty();
    loop {
        if pending {
            pending = false;
        } else {
            // Data payloads are split off this buffer without copying; make room for the next read.
            buf.reserve(READ_CHUNK);
            let read = if announced {
                rd.read_buf(&mut buf).await
            } else {
                match tokio::time::timeout_at(handshake_deadline, rd.read_buf(&mut buf)).await {
                    Ok(r) => r,
                    Err(_) => return "no hello from the peer in time".into(),
                }
            };
            let n = match read {
                Ok(0) => return "peer closed the connection".into(),
                Ok(n) => n,
                Err(e) => return format!("read: {e}"),
            };
            add(&peer.counters.link.wire_in, n as u64);
        }
        let (opened, up, closed, err, wants) = {
            let mut g = lock(&h.inner);
            let r = g.link.handle_lane_input(lane, &mut buf, Instant::now());
            h.dispatch(&mut g);
            (
                std::mem::take(&mut g.opened),
                g.up,
                g.link.is_closed(),
                r.err(),
                h.wants(&g),
            )
        };
        h.wake(wants);
        match err {
            Some(LinkError::PeerClosed {
                code: CloseCode::Normal,
                reason,
            }) => {
                info!(link = h.id, from = %addr, reason = %reason, "peer closed the link");
            }
            Some(e) => warn!(link = h.id, from = %addr, error = %e, "link error"),
            None => {}
        }
        if up && !announced && !closed {
            announced = true;
            add(&peer.counters.link.connects, 1);
            peer.counters.link.up.set(1);
            peer.counters.link.lanes.set(1);
            crate::notify::status(&format!("link up to {} ({addr})", peer.cfg().link.peer));
            info!(link = h.id, peer = %peer.cfg().link.peer, addr = %addr, "link up");
            if let Some(old) = peer.current.send_replace(Some(h.clone())) {
                info!(
                    link = old.id,
                    "closing the older link: a newer one replaced it"
                );
                old.with(|l| l.close(CloseCode::Replaced, "a newer link replaced this one"));
                old.kick();
            }
            if let (Some(token), LinkRole::Connect(target)) =
                (h.with(|l| l.lane_offer()), &peer.cfg().link.role)
            {
                let task = tokio::spawn(open_lane(h.clone(), token, target.clone()));
                *lock(&h.lane_task) = Some(task);
            }
        }
        for (id, service, class) in opened {
            tokio::spawn(serve_incoming(h.clone(), id, service, class));
        }
        if closed {
            return lock(&h.inner)
                .link
                .close_error()
                .map_or_else(|| "closed".to_string(), ToString::to_string);
        }
    }
}

/// Writes one lane's frames; the main lane also runs the link's timers (pings, idle timeout).
async fn write_link<W: AsyncWrite + Unpin>(h: Arc<LinkHandle>, mut wr: W, lane: usize) -> String {
    let mut buf = BytesMut::with_capacity(2 * TRANSMIT_BATCH);
    let mut timer = Box::pin(tokio::time::sleep(Duration::from_secs(3600)));
    let mut timer_at: Option<Instant> = None;
    let mut pressure = Pressure::new(&h.peer.cfg().link);
    if pressure.link_bound {
        h.with(|l| l.set_pressure(wanopt_proto::Pressure::LinkBound));
    }
    loop {
        let (closed, deadline) = {
            let mut g = lock(&h.inner);
            g.link.poll_transmit_lane(lane, &mut buf, TRANSMIT_BATCH);
            h.dispatch(&mut g);
            let deadline = if lane == MAIN_LANE {
                let d = g.link.poll_timeout();
                // Set under the link's lock, as `kick` reads it, so no re-arm is missed.
                *lock(&h.armed) = d;
                d
            } else {
                None
            };
            (g.link.is_closed(), deadline)
        };
        if !buf.is_empty() {
            add(&h.peer.counters.link.wire_out, buf.len() as u64);
            let started = Instant::now();
            if let Err(e) = wr.write_all(&buf).await {
                return format!("write: {e}");
            }
            buf.clear();
            if let Err(e) = wr.flush().await {
                return format!("write: {e}");
            }
            if lane == MAIN_LANE
                && let Some(p) = pressure.wrote(started)
            {
                debug!(link = h.id, pressure = ?p, "link pressure changed");
                h.with(|l| l.set_pressure(p));
            }
            continue;
        }
        if closed {
            let _ = wr.shutdown().await;
            return lock(&h.inner)
                .link
                .close_error()
                .map_or_else(|| "closed".to_string(), ToString::to_string);
        }
        // One timer for the writer's life, moved only when the deadline does: registering a new
        // one on every wait cost a timer-wheel insert and removal per frame.
        if let Some(d) = deadline
            && timer_at != Some(d)
        {
            timer.as_mut().reset(d.into());
            timer_at = Some(d);
        }
        tokio::select! {
            _ = h.tx[lane].notified() => {}
            _ = &mut timer, if deadline.is_some() => {
                timer_at = None;
                h.with(|l| l.handle_timeout(Instant::now()));
            }
        }
    }
}

/// Tells whether the link or the CPU limits throughput. A stated bandwidth well below what one
/// core compresses with zstd (a WAN) settles it: the link. Otherwise it is measured from the
/// share of time the main lane's writer waits for the socket: mostly waiting means the link is
/// the bottleneck (spend CPU on ratio), rarely waiting means the CPU is (prefer the cheap codec).
/// Hysteresis keeps it steady.
struct Pressure {
    window_start: Instant,
    waited: Duration,
    link_bound: bool,
    fixed: bool,
}

impl Pressure {
    const WINDOW: Duration = Duration::from_millis(250);
    /// Below this stated bandwidth, zstd at a few percent of a core always pays.
    const WAN_BPS: u64 = 400_000_000;

    fn new(link: &crate::config::LinkSettings) -> Self {
        let wan = link.bandwidth_stated && link.bandwidth_bps < Self::WAN_BPS;
        Pressure {
            window_start: Instant::now(),
            waited: Duration::ZERO,
            link_bound: wan,
            fixed: wan,
        }
    }

    /// Records a write that started at `started`; returns the new pressure when it changes.
    fn wrote(&mut self, started: Instant) -> Option<wanopt_proto::Pressure> {
        if self.fixed {
            return None;
        }
        let now = Instant::now();
        self.waited += now.saturating_duration_since(started);
        let span = now.saturating_duration_since(self.window_start);
        if span < Self::WINDOW {
            return None;
        }
        let share = self.waited.as_secs_f64() / span.as_secs_f64();
        self.window_start = now;
        self.waited = Duration::ZERO;
        let bound = if share > 0.5 {
            true
        } else if share < 0.2 {
            false
        } else {
            self.link_bound
        };
        if bound == self.link_bound {
            return None;
        }
        self.link_bound = bound;
        Some(if bound {
            wanopt_proto::Pressure::LinkBound
        } else {
            wanopt_proto::Pressure::CpuBound
        })
    }
}

/// Accepts local clients of a `listen` service and opens a stream for each.
/// Each client is judged by the service's settings in the config in force when it connects, so a
/// reload that changes the class or the allow list applies to new clients at once.
async fn accept_clients(peer: Arc<Peer>, name: String, listener: TcpListener) {
    let counters = peer.counters.service(&name);
    loop {
        let (sock, from) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                warn!(service = %name, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some(svc) = peer.cfg().services.iter().find(|s| s.name == name).cloned() else {
            sockopt::abort(&sock);
            return;
        };
        let ServiceKind::Listen { allow, .. } = &svc.kind else {
            sockopt::abort(&sock);
            return;
        };
        if !allow.is_empty() && !allow.iter().any(|n| n.contains(&from.ip())) {
            add(&counters.streams_refused, 1);
            warn!(service = %svc.name, from = %from, "refused client outside the allow list");
            sockopt::abort(&sock);
            continue;
        }
        sockopt::tune_local(&sock);
        let peer = peer.clone();
        let svc = svc.clone();
        let counters = counters.clone();
        tokio::spawn(async move {
            let mut rx = peer.current.subscribe();
            let h = match tokio::time::timeout(
                peer.cfg().limits.link_wait,
                rx.wait_for(Option::is_some),
            )
            .await
            {
                Ok(Ok(v)) => v.clone(),
                _ => None,
            };
            let Some(h) = h else {
                add(&counters.streams_refused, 1);
                warn!(service = %svc.name, from = %from, "refused client: no link to the peer");
                sockopt::abort(&sock);
                return;
            };
            match h.open(&svc.name, svc.class) {
                Ok((id, sig)) => {
                    add(&counters.streams_opened, 1);
                    debug!(link = h.id, service = %svc.name, stream = %id, from = %from, "stream opened");
                    pump(h, id, sig, sock, counters, &svc.name).await;
                }
                Err(e) => {
                    add(&counters.streams_refused, 1);
                    warn!(service = %svc.name, from = %from, error = %e, "refused client");
                    sockopt::abort(&sock);
                }
            }
        });
    }
}

/// Connects a stream the peer opened to this side's own target for that service.
async fn serve_incoming(h: Arc<LinkHandle>, id: StreamId, service: Arc<str>, _class: Class) {
    let peer = h.peer.clone();
    let counters = peer.counters.service(&service);
    let sig = lock(&h.inner).signals.get(&id).cloned();
    let Some(sig) = sig else { return };
    let target = peer.cfg().services.iter().find_map(|s| match &s.kind {
        ServiceKind::Target { addr } if *s.name == *service => Some(addr.clone()),
        _ => None,
    });
    let Some(target) = target else {
        h.reset(id, ResetCode::UnknownService, "service removed");
        h.forget(id);
        return;
    };
    let conn = tokio::time::timeout(
        peer.cfg().limits.connect_timeout,
        TcpStream::connect(&target),
    )
    .await;
    let sock = match conn {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            counters.failed("target_refused");
            let why = format!("connect {target}: {e}");
            warn!(link = h.id, service = %service, stream = %id, error = %why, "target refused");
            h.reset(id, ResetCode::TargetRefused, &why);
            h.forget(id);
            return;
        }
        Err(_) => {
            counters.failed("target_timeout");
            let why = format!("connect {target}: timed out");
            warn!(link = h.id, service = %service, stream = %id, error = %why, "target unreachable");
            h.reset(id, ResetCode::TargetRefused, &why);
            h.forget(id);
            return;
        }
    };
    sockopt::tune_local(&sock);
    add(&counters.streams_opened, 1);
    debug!(link = h.id, service = %service, stream = %id, target = %target, "stream connected");
    pump(h, id, sig, sock, counters, &service).await;
}

/// Moves bytes both ways between a local socket and a stream until both directions finish.
/// Any failure closes the socket with a reset, so the application sees an error, never a
/// silently truncated stream.
async fn pump(
    h: Arc<LinkHandle>,
    id: StreamId,
    sig: Arc<StreamSignal>,
    mut sock: TcpStream,
    c: Arc<ServiceCounters>,
    service: &str,
) {
    c.streams_active.inc();
    let result = {
        let (mut rd, mut wr) = sock.split();
        let up = async {
            let mut buf = BytesMut::new();
            loop {
                buf.reserve(READ_CHUNK);
                let n = tokio::select! {
                    r = rd.read_buf(&mut buf) => r.map_err(|e| format!("local read: {e}"))?,
                    _ = sig.gone.notified() => return Err(sig.reason()),
                };
                if n == 0 {
                    h.with(|l| l.finish(id)).map_err(|_| sig.reason())?;
                    h.kick();
                    return Ok::<(), String>(());
                }
                add(&c.raw_out, n as u64);
                // A read that did not fill the room offered drained the socket: the client paused,
                // so an optimized stream must not hold its last bytes back for a chunk boundary.
                let drained = buf.len() < buf.capacity();
                // Hand the bytes over without copying; the buffer's spare room is kept for reads.
                // The flush of a drained read goes with its last bytes: one lock, one wakeup.
                let mut chunk = buf.split().freeze();
                while !chunk.is_empty() {
                    let (k, wants) = {
                        let mut g = lock(&h.inner);
                        let k = g.link.write_bytes(id, &mut chunk);
                        if drained && chunk.is_empty() {
                            g.link.flush(id);
                        }
                        h.dispatch(&mut g);
                        (k.map_err(|_| sig.reason())?, h.wants(&g))
                    };
                    if k == 0 {
                        tokio::select! {
                            _ = sig.writable.notified() => {}
                            _ = sig.gone.notified() => return Err(sig.reason()),
                        }
                    } else {
                        h.wake(wants);
                    }
                }
            }
        };
        let down = async {
            loop {
                let r = {
                    let mut g = lock(&h.inner);
                    let r = g.link.read(id);
                    let credit = g.link.wants_transmit();
                    (r, credit)
                };
                match r {
                    (Ok(ReadOutcome::Data(b)), credit) => {
                        if credit {
                            h.kick();
                        }
                        wr.write_all(&b)
                            .await
                            .map_err(|e| format!("local write: {e}"))?;
                        add(&c.raw_in, b.len() as u64);
                    }
                    (Ok(ReadOutcome::Blocked), _) => sig.readable.notified().await,
                    (Ok(ReadOutcome::Fin), _) => {
                        wr.shutdown()
                            .await
                            .map_err(|e| format!("local shutdown: {e}"))?;
                        return Ok::<(), String>(());
                    }
                    (Err(_), _) => return Err(sig.reason()),
                }
            }
        };
        tokio::try_join!(up, down)
    };
    let result = match result {
        // Both ways finished: wait until the link has sent our end too, so a link that dies
        // before then still fails the client.
        Ok(_) => loop {
            if !h.with(|l| l.contains(id)) {
                break match lock(&sig.reset).clone() {
                    Some(r) => Err(r),
                    None => Ok(()),
                };
            }
            let _ = tokio::time::timeout(Duration::from_millis(200), sig.gone.notified()).await;
        },
        Err(e) => Err(e),
    };
    c.streams_active.dec();
    match result {
        Ok(()) => debug!(link = h.id, service, stream = %id, "stream closed"),
        Err(why) => {
            c.failed("stream_error");
            info!(link = h.id, service, stream = %id, reason = %why, "stream failed");
            sockopt::abort(&sock);
            h.reset(id, ResetCode::SocketError, &why);
        }
    }
    h.forget(id);
}
