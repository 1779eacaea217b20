//! The daemon: binds the link, admin and service listeners (before anything is served, so a
//! port conflict stops it at start), then serves: a supervisor per peer, the link's accept or
//! connect loop, a task per service listener, reloads, and a graceful shutdown that drains the
//! streams and closes the link cleanly, or a handover to a new process that keeps them (see
//! `handover.rs`). The pieces live in `peer.rs`, `supervisor.rs`, `accept.rs`, `dial.rs`,
//! `driver/`, `services.rs` and `reload.rs`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tracing::{error, info, warn};
use wanopt_proto::{CloseCode, Link};

use crate::cachedir::CacheDir;
use crate::config::{Config, LinkRole, Service, ServiceKind};
use crate::counters::Counters;
use crate::driver::LinkMsg;
use crate::handover::{self, HandoverError, ListenerKind, StreamEntry};
use crate::peer::Peer;
use crate::reload::{self, Listener};
use crate::tls;
use crate::{accept, dial, services, sockopt, supervisor};

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
    #[error("state_dir: {0}")]
    StateDir(String),
    #[error("handover: {0}")]
    Handover(#[from] HandoverError),
}

/// How [`Daemon::serve_full`] ended.
#[derive(Debug)]
pub enum Served {
    /// Stopped: streams drained, the link closed.
    Stopped,
    /// Handed over to the new process with this pid (`None`: to systemd's file descriptor
    /// store, for the process a restart job starts): exit at once, closing nothing.
    HandedOver(Option<u32>),
    /// A handover failed after the streams were parked: they are lost; exit.
    Failed(String),
}

/// Turns transparent huge pages off for this process (`PR_SET_THP_DISABLE`), whatever the
/// host's setting, for the memory mapped so far and after. A new 2 MiB page is zeroed whole on
/// its first touch, on the thread that touches it; on a VM whose host backs such pages late,
/// a fresh pair's first copies ran at about half the rate now and then (docs/tuning.md, "Huge
/// pages"; the figures in benches/README.md, "threads").
/// True if the kernel took it (it has since Linux 3.15).
pub fn no_huge_pages() -> bool {
    // SAFETY: PR_SET_THP_DISABLE takes plain integers and touches no memory of this process's.
    unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1 as libc::c_ulong, 0, 0, 0) == 0 }
}

/// The new process of a handover: what the process before handed over and, after `SIGUSR2`,
/// the pipe to say it is ready on: from the process before (`handover.rs`), or from systemd's
/// file descriptor store after `systemctl restart` (`fdstore.rs`; no pipe, the process before
/// has exited). Call it first in `main`, while the process has one thread.
pub fn inherited() -> Option<Result<(handover::State, Option<std::fs::File>), HandoverError>> {
    match handover::inherited() {
        Some(r) => Some(r.map(|(s, ready)| (s, Some(ready)))),
        None => crate::fdstore::inherited().map(|r| r.map(|s| (s, None))),
    }
}

/// Where a handover goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandoverTo {
    /// A new process started from the binary now at our path (`SIGUSR2`).
    Successor,
    /// systemd's file descriptor store, for the process a restart job starts next (`SIGTERM`
    /// during `systemctl restart`; see `fdstore.rs`). Refused, the daemon stops as on
    /// `systemctl stop`.
    FdStore,
}

/// What a process before this one handed over, for [`Daemon::serve_full`] to take up.
struct Adopted {
    link: Option<Vec<u8>>,
    streams: Vec<StreamEntry>,
    parked_at_ms: Option<u64>,
    ready: Option<std::fs::File>,
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
    supervisor: mpsc::UnboundedReceiver<LinkMsg>,
    link_listener: Option<TcpListener>,
    admin_listener: Option<TcpListener>,
    service_listeners: Vec<(Service, TcpListener)>,
    shutdown_tx: watch::Sender<bool>,
    bound: Bound,
    /// A second descriptor of the link and admin listeners, for a handover (the tasks own the
    /// first).
    listener_fds: Vec<(ListenerKind, OwnedFd)>,
    adopted: Option<Adopted>,
}

/// Takes the listener a handover passed for `kind`, if it did.
fn inherited_listener(
    from: &mut HashMap<ListenerKind, RawFd>,
    kind: &ListenerKind,
) -> Option<Result<TcpListener, std::io::Error>> {
    let fd = from.remove(kind)?;
    Some(
        handover::take_listener(fd)
            .map_err(std::io::Error::other)
            .and_then(TcpListener::from_std),
    )
}

impl Daemon {
    /// Loads TLS material and binds every listener; logs each bound address.
    pub fn bind(cfg: Config, counters: Arc<Counters>) -> Result<Daemon, DaemonError> {
        Self::build(cfg, counters, None)
    }

    /// Like [`bind`](Self::bind), in a process started to take a daemon over: the listeners
    /// come from the process before (those the config no longer has are closed, new ones are
    /// bound), and [`serve_full`](Self::serve_full) takes up its link and streams, then writes
    /// to `ready`.
    pub fn adopt(
        cfg: Config,
        counters: Arc<Counters>,
        state: handover::State,
        ready: Option<std::fs::File>,
    ) -> Result<Daemon, DaemonError> {
        let mut inherited: HashMap<ListenerKind, RawFd> = state.listeners.into_iter().collect();
        let mut d = Self::build(cfg, counters, Some(&mut inherited))?;
        for (kind, fd) in inherited {
            // Configured no more: closed.
            info!(listener = ?kind, "closing a listener the new config does not have");
            drop(handover::take_listener(fd));
        }
        d.adopted = Some(Adopted {
            link: state.link,
            streams: state.streams,
            parked_at_ms: state.parked_at_ms,
            ready,
        });
        Ok(d)
    }

    fn build(
        cfg: Config,
        counters: Arc<Counters>,
        mut inherited: Option<&mut HashMap<ListenerKind, RawFd>>,
    ) -> Result<Daemon, DaemonError> {
        let mut take =
            |kind: &ListenerKind| inherited.as_mut().and_then(|m| inherited_listener(m, kind));
        let tls = tls::load(&cfg.tls)?;
        if let Some(t) = tls.cert_expiry {
            counters.certs.set("own", t);
        }
        if let Some(t) = tls.ca_expiry {
            counters.certs.set("ca", t);
        }
        let cfg = Arc::new(cfg);
        // Every service's series exist from the first scrape, those of target-only services too.
        for s in &cfg.services {
            counters.service(&s.name);
        }
        sockopt::check_buffer_sysctls(&cfg.link);
        for w in cfg.warnings() {
            warn!("config: {w}");
        }
        // The state directory is checked and the caches opened before any port is bound.
        let caches = match (&cfg.optimize.disk, cfg.optimize.enabled) {
            (Some(d), true) => {
                crate::secure::state_dir(&cfg.state_dir).map_err(DaemonError::StateDir)?;
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
        let mut bound = Bound::default();
        let mut datagram_socket = None;
        let link_listener = match &cfg.link.role {
            LinkRole::Listen(addr) => {
                let l = take(&ListenerKind::Link)
                    .unwrap_or_else(|| sockopt::link_listener(*addr, &cfg.link))
                    .map_err(|source| DaemonError::Bind {
                        what: "link".into(),
                        addr: *addr,
                        source,
                    })?;
                let local = l.local_addr().unwrap_or(*addr);
                info!(kind = "link", addr = %local, peer = %cfg.link.peer, "bound");
                bound.link = Some(local);
                if cfg.link.latency_lane
                    && cfg.link.lane_datagrams != crate::datagrams::Setting::Off
                {
                    datagram_socket = crate::datagrams::bind_listening(local);
                }
                Some(l)
            }
            LinkRole::Connect(_) => None,
        };
        let admin_listener = match cfg.admin.as_ref().map(|a| a.addr) {
            Some(addr) => {
                let l = take(&ListenerKind::Admin)
                    .unwrap_or_else(|| sockopt::local_listener(addr))
                    .map_err(|source| DaemonError::Bind {
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
            if let ServiceKind::Listen { addr, .. } = &s.kind {
                let l = take(&ListenerKind::Service(s.name.clone()))
                    .unwrap_or_else(|| sockopt::local_listener(*addr))
                    .map_err(|source| DaemonError::Bind {
                        what: format!("service {}", s.name),
                        addr: *addr,
                        source,
                    })?;
                let local = l.local_addr().unwrap_or(*addr);
                info!(kind = "service", service = %s.name, addr = %local, "bound");
                bound.services.push((s.name.clone(), local));
                service_listeners.push((s.clone(), l));
            }
        }
        // Second descriptors of the link and admin listeners, for a handover (close-on-exec
        // until then); the services' are in their `reload::Listener`.
        let dup = |l: &TcpListener| l.as_fd().try_clone_to_owned().ok();
        let mut listener_fds = Vec::new();
        listener_fds.extend(
            link_listener
                .as_ref()
                .and_then(dup)
                .map(|fd| (ListenerKind::Link, fd)),
        );
        listener_fds.extend(
            admin_listener
                .as_ref()
                .and_then(dup)
                .map(|fd| (ListenerKind::Admin, fd)),
        );
        let (shutdown_tx, shutdown) = watch::channel(false);
        let (supervisor_tx, supervisor_rx) = mpsc::unbounded_channel();
        let peer = Arc::new(Peer::new(
            cfg,
            tls,
            counters,
            caches,
            shutdown,
            supervisor_tx,
        ));
        if let Some(s) = datagram_socket {
            let _ = peer.datagram_socket.set(s);
        }
        Ok(Daemon {
            peer,
            supervisor: supervisor_rx,
            link_listener,
            admin_listener,
            service_listeners,
            shutdown_tx,
            bound,
            listener_fds,
            adopted: None,
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
        reloads: tokio::sync::mpsc::UnboundedReceiver<Config>,
    ) {
        let (_keep, handovers) = tokio::sync::mpsc::unbounded_channel::<HandoverTo>();
        self.serve_full(stop, reloads, handovers).await;
    }

    /// Like [`serve_with_reload`](Self::serve_with_reload); a message on `handovers` hands
    /// the daemon to a new process (see `handover.rs`): when that worked, the caller exits at
    /// once ([`Served::HandedOver`]).
    pub async fn serve_full(
        mut self,
        stop: impl std::future::Future<Output = ()>,
        mut reloads: tokio::sync::mpsc::UnboundedReceiver<Config>,
        mut handovers: tokio::sync::mpsc::UnboundedReceiver<HandoverTo>,
    ) -> Served {
        let peer = self.peer.clone();
        let adopted = self.adopted.take();
        let mut tasks = vec![crate::spawn(supervisor::run(peer.clone(), self.supervisor))];
        let mut listeners: HashMap<String, Listener> = HashMap::new();
        for (svc, l) in self.service_listeners {
            if let ServiceKind::Listen { addr, .. } = &svc.kind {
                listeners.insert(
                    svc.name.clone(),
                    Listener::start(&peer, &svc.name, *addr, l),
                );
            }
        }
        if let Some(l) = self.admin_listener {
            let allow = peer
                .cfg()
                .admin
                .as_ref()
                .map(|a| a.allow.clone())
                .unwrap_or_default();
            tasks.push(crate::spawn(crate::admin::serve(
                l,
                allow,
                peer.counters.clone(),
            )));
        }
        // The link a process before this one handed over: suspended, current while its
        // streams wait, resumed by the next connection (ours or the peer's).
        let mut ready = None;
        let adopted_link = match adopted {
            Some(a) => {
                let how = if a.ready.is_some() {
                    "signal"
                } else {
                    "restart"
                };
                ready = a.ready;
                take_up(&peer, a.link, a.streams, a.parked_at_ms, how).await
            }
            None => None,
        };
        if let Some(s) = peer.datagram_socket.get() {
            let (p, q) = (peer.clone(), peer.clone());
            let current = move || p.current.borrow().clone();
            // As the link listener's gate does: a source outside `link.allow` is not read.
            let admit = move |from: std::net::SocketAddr| {
                let allowed = crate::config::allowed(&q.cfg().link.allow, from.ip());
                if !allowed {
                    crate::counters::add(&q.counters.link.outside_allow, 1);
                }
                allowed
            };
            let receive = crate::driver::receive_datagrams(s.clone(), true, current, admit);
            crate::spawn(receive);
        }
        let mut link_task = Some(match self.link_listener {
            Some(l) => crate::spawn(accept::accept_links(peer.clone(), l)),
            None => crate::spawn(dial::connect_loop(peer.clone(), adopted_link)),
        });
        if let Some(r) = ready {
            info!("took the daemon over from the process before; resuming the link");
            handover::ready(r);
        }
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = &mut stop => break,
                Some(new) = reloads.recv() => reload::apply_reload(&peer, new, &mut listeners),
                Some(to) = handovers.recv() => {
                    match hand_over(to, &peer, &self.listener_fds, &mut listeners, &tasks, &mut link_task).await {
                        Ok(Some(to)) => return Served::HandedOver(to),
                        // systemd is stopping us: refused, the streams drain as on a stop.
                        Ok(None) if to == HandoverTo::FdStore => break,
                        Ok(None) => {}
                        Err(e) => return Served::Failed(e.to_string()),
                    }
                }
            }
        }
        for (_, l) in listeners.drain() {
            l.task.abort();
        }
        crate::notify::send("STOPPING=1\nSTATUS=draining streams");
        info!("shutting down: no new connections; draining streams");
        let _ = self.shutdown_tx.send(true);
        for t in &tasks[1..] {
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
        if let Some(t) = link_task {
            t.abort();
        }
        // The supervisor stays for the drain above: it clears the closed link.
        for t in tasks {
            t.abort();
        }
        if let Some(c) = &peer.caches {
            // The states saved as the link closed are what the next start resumes.
            c.flush(Duration::from_secs(30)).await;
        }
        for (name, c) in peer.counters.snapshot() {
            info!(service = %name, raw_out = c.raw_out, raw_in = c.raw_in, wire_out = c.wire_out, wire_in = c.wire_in,
                  opened = c.opened, refused = c.refused, "service totals");
        }
        info!("stopped");
        Served::Stopped
    }
}

/// The new process of a handover: takes up the link and streams the process before handed
/// over. Streams it parked move on from where they stopped; streams the peer opened whose
/// target the process before had not connected yet are connected now. Returns the link (for
/// the connecting side's dialer).
async fn take_up(
    peer: &Arc<Peer>,
    link: Option<Vec<u8>>,
    streams: Vec<StreamEntry>,
    parked_at_ms: Option<u64>,
    how: &'static str,
) -> Option<Arc<crate::driver::LinkHandle>> {
    // The time since the process before parked the streams (bounded: a clock step must not
    // make it absurd) counts toward the link's outage, so the resume window and the stall
    // include the restart.
    let since_parked = parked_at_ms
        .and_then(|t| {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .ok()?;
            now.checked_sub(Duration::from_millis(t))
        })
        .unwrap_or(Duration::ZERO)
        .min(Duration::from_secs(600));
    let mut parked: HashMap<wanopt_proto::StreamId, StreamEntry> =
        streams.into_iter().map(|s| (s.id, s)).collect();
    let h = match link {
        None => None,
        Some(b) => match peer.adopt_link(&b, since_parked).await {
            Ok(h) => Some(h),
            Err(e) => {
                warn!(error = %e, "cannot take the handed-over link up; its streams are lost");
                None
            }
        },
    };
    if let Some(h) = &h {
        peer.current.send_replace(Some(h.clone()));
        crate::driver::watch_adopted(h);
        h.adopt_streams();
        let states = h.with(|l| l.stream_states());
        let (mut resumed, mut connecting) = (0, 0);
        for st in states {
            match parked.remove(&st.id) {
                Some(entry) => match handover::take_stream(entry.fd) {
                    Ok(sock) => {
                        resumed += 1;
                        crate::spawn(services::resume_parked(
                            peer.clone(),
                            h.clone(),
                            entry,
                            sock,
                            st.service,
                        ));
                    }
                    Err(e) => {
                        warn!(stream = %st.id, error = %e, "a handed-over stream's socket is unusable; it is reset");
                        h.reset(
                            st.id,
                            wanopt_proto::ResetCode::SocketError,
                            "lost in a handover",
                        );
                    }
                },
                None if st.opened_by_peer => match peer.target(&st.service) {
                    Some((target, idle)) => {
                        connecting += 1;
                        let counters = peer.counters.service(&st.service);
                        let timeout = peer.cfg().limits.connect_timeout;
                        crate::spawn(services::serve_incoming(
                            peer.clone(),
                            h.clone(),
                            st.id,
                            st.service,
                            (target, timeout),
                            counters,
                            idle,
                        ));
                    }
                    None => {
                        h.reset(
                            st.id,
                            wanopt_proto::ResetCode::UnknownService,
                            "service removed",
                        );
                    }
                },
                None => {}
            }
        }
        peer.counters
            .handover
            .taken(how, (resumed + connecting) as u64);
        info!(
            link = h.id,
            streams = resumed,
            connecting,
            parked_ms = since_parked.as_millis() as u64,
            how,
            "took the link's streams over"
        );
    }
    // Sockets of streams the link no longer has: closed with a reset.
    for (_, e) in parked {
        if let Ok(s) = handover::take_stream(e.fd) {
            let _ = socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO));
        }
    }
    h
}

/// The old process of a handover: checks that the binary now at our path accepts the config,
/// stops accepting, parks every stream, hands the link over, and gives all of it to `to`: a new
/// process it starts (`SIGUSR2`), or systemd's file descriptor store (`systemctl restart`).
/// `Ok(None)`: refused before anything stopped (we serve on, or stop if systemd is stopping
/// us); `Ok(Some(pid))`: handed over; `Err`: it failed after the streams were parked.
async fn hand_over(
    to: HandoverTo,
    peer: &Arc<Peer>,
    listener_fds: &[(ListenerKind, OwnedFd)],
    listeners: &mut HashMap<String, Listener>,
    tasks: &[tokio::task::JoinHandle<()>],
    link_task: &mut Option<tokio::task::JoinHandle<()>>,
) -> Result<Option<Option<u32>>, HandoverError> {
    let then = if to == HandoverTo::FdStore {
        "draining instead"
    } else {
        "serving on"
    };
    let path = peer.cfg().path.clone();
    info!(config = %path.display(), "handover: checking the config with the binary at our path");
    let checked = tokio::task::spawn_blocking(move || {
        let exe = handover::own_path()?;
        std::process::Command::new(exe)
            .arg("check")
            .arg("-c")
            .arg(&path)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .output()
    })
    .await;
    match checked {
        Ok(Ok(o)) if o.status.success() => {}
        Ok(Ok(o)) => {
            let why = String::from_utf8_lossy(&o.stderr).trim().to_string();
            error!(error = %why, then, "handover refused: the new binary does not accept the config");
            peer.counters.handover.refused("binary");
            return Ok(None);
        }
        Ok(Err(e)) => {
            error!(error = %e, then, "handover refused: cannot run the new binary");
            peer.counters.handover.refused("binary");
            return Ok(None);
        }
        Err(e) => {
            error!(error = %e, then, "handover refused");
            peer.counters.handover.refused("binary");
            return Ok(None);
        }
    }
    let current = peer.current.borrow().clone();
    if let Some(h) = &current
        && h.with(|l| l.stream_count() > 0 && !l.can_resume())
    {
        error!(
            then,
            "handover refused: the link does not resume streams (the peer lacks it, or resume_window is 0)"
        );
        peer.counters.handover.refused("resume");
        return Ok(None);
    }
    let target = match to {
        HandoverTo::Successor => handover::Successor::prepare().map(Target::Successor),
        HandoverTo::FdStore => {
            let capacity = crate::fdstore::capacity().unwrap_or(0);
            // One descriptor per stream at most, the listeners and the state.
            let need = current.as_ref().map_or(0, |h| h.with(|l| l.stream_count()))
                + listener_fds.len()
                + listeners.len()
                + 1;
            if need > capacity {
                error!(
                    need,
                    capacity,
                    then,
                    "handover refused: more descriptors than the unit's FileDescriptorStoreMax"
                );
                peer.counters.handover.refused("descriptors");
                return Ok(None);
            }
            handover::memfd().map(|m| Target::Store(m, capacity))
        }
    };
    let target = match target {
        Ok(t) => t,
        Err(e) => {
            error!(error = %e, then, "handover refused");
            peer.counters.handover.refused("system");
            return Ok(None);
        }
    };
    // From here on the streams stop: no new clients, no new links.
    info!("handover: parking the streams");
    let mut service_fds = Vec::new();
    for (name, l) in listeners.drain() {
        l.task.abort();
        service_fds.extend(l.fd.map(|fd| (ListenerKind::Service(name), fd)));
    }
    for t in &tasks[1..] {
        t.abort();
    }
    if let Some(t) = link_task.take() {
        t.abort();
    }
    let parked_at_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .ok()
        .and_then(|d| u64::try_from(d.as_millis()).ok());
    let _ = peer.parking.send(true);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while peer.pumps.load(std::sync::atomic::Ordering::SeqCst) > 0 {
        if tokio::time::Instant::now() >= deadline {
            warn!(
                streams = peer.pumps.load(std::sync::atomic::Ordering::SeqCst),
                "handover: streams still moving after 10s are left behind"
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let link = match &current {
        Some(h) => Some(h.with(|l| l.hand_over(std::time::Instant::now()))?),
        None => None,
    };
    let parked: Vec<handover::Parked> = std::mem::take(
        &mut *peer
            .parked
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    let streams = parked
        .into_iter()
        .map(|p| StreamEntry {
            id: p.id,
            fd: handover::release(p.sock),
            pending_up: p.pending_up,
            pending_down: p.pending_down,
            up_done: p.up_done,
            down_done: p.down_done,
        })
        .collect::<Vec<_>>();
    let state = handover::State {
        link,
        listeners: listener_fds
            .iter()
            .chain(service_fds.iter())
            .map(|(k, fd)| (k.clone(), fd.as_raw_fd()))
            .collect(),
        streams,
        parked_at_ms,
    };
    if let Some(c) = &peer.caches {
        c.flush(Duration::from_secs(10)).await;
        c.unlock();
    }
    let n = state.streams.len();
    match target {
        Target::Successor(successor) => {
            info!(streams = n, "handover: starting the new process");
            let pid = tokio::task::spawn_blocking(move || {
                successor.start(&state, Duration::from_secs(30))
            })
            .await
            .map_err(|e| HandoverError::Refused(e.to_string()))??;
            crate::notify::send(&format!("MAINPID={pid}"));
            info!(pid, streams = n, "handed over to the new process");
            Ok(Some(Some(pid)))
        }
        Target::Store(mem, capacity) => {
            if crate::fdstore::needed(&state) > capacity {
                return Err(HandoverError::Refused(format!(
                    "{} descriptors, more than the store's {capacity}",
                    crate::fdstore::needed(&state)
                )));
            }
            info!(
                streams = n,
                "handover: storing the streams in systemd's file descriptor store"
            );
            tokio::task::spawn_blocking(move || crate::fdstore::store(&state, mem))
                .await
                .map_err(|e| HandoverError::Refused(e.to_string()))??;
            info!(
                streams = n,
                "handed over to systemd for the restarted process"
            );
            Ok(Some(None))
        }
    }
}

/// Where a handover's state and descriptors go once the streams are parked.
enum Target {
    Successor(handover::Successor),
    Store(std::fs::File, usize),
}
