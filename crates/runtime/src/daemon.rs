//! The daemon: binds the link, admin and service listeners (before anything is served, so a
//! port conflict stops it at start), then serves: a supervisor per peer, the link's accept or
//! connect loop, a task per service listener, reloads, and a graceful shutdown that drains the
//! streams and closes the link cleanly. The pieces live in `peer.rs`, `supervisor.rs`,
//! `accept.rs`, `dial.rs`, `driver/`, `services.rs` and `reload.rs`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tracing::{info, warn};
use wanopt_proto::{CloseCode, Link};

use crate::cachedir::CacheDir;
use crate::config::{Config, LinkRole, Service, ServiceKind};
use crate::counters::Counters;
use crate::driver::LinkMsg;
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
        let admin_listener = match cfg.admin.as_ref().map(|a| a.addr) {
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
            if let ServiceKind::Listen { addr, .. } = &s.kind {
                let l = sockopt::local_listener(*addr).map_err(|source| DaemonError::Bind {
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
        Ok(Daemon {
            peer,
            supervisor: supervisor_rx,
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
        let mut tasks = vec![crate::spawn(supervisor::run(peer.clone(), self.supervisor))];
        let mut listeners: HashMap<String, Listener> = HashMap::new();
        for (svc, l) in self.service_listeners {
            let bound = l.local_addr().ok();
            let task = crate::spawn(services::accept_clients(peer.clone(), svc.name.clone(), l));
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
        let link_task = match self.link_listener {
            Some(l) => crate::spawn(accept::accept_links(peer.clone(), l)),
            None => crate::spawn(dial::connect_loop(peer.clone())),
        };
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = &mut stop => break,
                Some(new) = reloads.recv() => reload::apply_reload(&peer, new, &mut listeners),
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
        link_task.abort();
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
    }
}
