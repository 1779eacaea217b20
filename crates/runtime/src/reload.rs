//! Reload (SIGHUP): a new config's services are applied in place, listeners started and
//! stopped, certificates re-read for the next connections; what needs a restart is named in the
//! log. Streams already open finish with the settings they started with. A config whose TLS
//! files do not load is refused whole.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use tracing::{info, warn};

use crate::config::{Config, Service, ServiceKind};
use crate::peer::Peer;
use crate::{services, sockopt, tls};

/// A running service listener: its configured and bound addresses, its accept task, and a
/// second descriptor of its socket for a handover (closed with it when a reload removes it).
pub(crate) struct Listener {
    pub configured: SocketAddr,
    pub bound: SocketAddr,
    pub task: tokio::task::JoinHandle<()>,
    pub fd: Option<std::os::fd::OwnedFd>,
}

impl Listener {
    /// Starts accepting clients of service `name` on `l`, bound as `configured`.
    pub fn start(
        peer: &Arc<Peer>,
        name: &str,
        configured: SocketAddr,
        l: tokio::net::TcpListener,
    ) -> Self {
        use std::os::fd::AsFd;
        let bound = l.local_addr().unwrap_or(configured);
        let fd = l.as_fd().try_clone_to_owned().ok();
        let task = crate::spawn(services::accept_clients(peer.clone(), name.to_string(), l));
        Listener {
            configured,
            bound,
            task,
            fd,
        }
    }
}

/// Applies a reloaded config: services are added, removed and changed in place; streams already
/// open are untouched and finish with the settings they started with. Link, TLS, admin, state and
/// limit changes need a restart, which is logged.
pub(crate) fn apply_reload(
    peer: &Arc<Peer>,
    new: Config,
    listeners: &mut HashMap<String, Listener>,
) {
    let old = peer.cfg();
    let mut needs_restart = Vec::new();
    if new.site != old.site {
        needs_restart.push("site");
    }
    if new.link != old.link {
        needs_restart.push("link");
    }
    // Certificates are re-read on every reload (renewed files keep their paths): the next link
    // connections use them; the current link goes on with the ones it authenticated with. A
    // reload is all or nothing: TLS files that do not load refuse the whole of it.
    let tls_changed = new.tls != old.tls;
    match tls::load(&new.tls) {
        Ok(m) => {
            if let Some(t) = m.cert_expiry {
                peer.counters.certs.set("own", t);
            }
            if let Some(t) = m.ca_expiry {
                peer.counters.certs.set("ca", t);
            }
            peer.set_tls(m);
            info!("reload: certificates re-read; new link connections use them");
        }
        Err(e) => {
            warn!(error = %e, "reload refused: cannot load the TLS files; the old config stays in force");
            return;
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
    peer.set_cfg(merged.clone());
    let mut added = Vec::new();
    for (name, addr) in wanted {
        if listeners.contains_key(name) {
            continue;
        }
        match sockopt::local_listener(addr) {
            Ok(l) => {
                let local = l.local_addr().unwrap_or(addr);
                info!(kind = "service", service = %name, addr = %local, "bound");
                listeners.insert(name.to_string(), Listener::start(peer, name, addr, l));
                added.push(name.to_string());
            }
            Err(e) => {
                warn!(service = %name, addr = %addr, error = %e, "reload: cannot bind the service; it stays off")
            }
        }
    }
    // The peer may open streams to the new set of target services from now on.
    peer.apply_services(&merged);
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
