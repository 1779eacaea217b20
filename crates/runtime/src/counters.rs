//! Byte and stream counters kept from day one, per service and direction and per link.
//!
//! `out` is from local clients toward the peer, `in` from the peer toward local sockets. Raw bytes
//! are what local sockets sent or received; wire bytes are that service's frame bytes on the link
//! (before TLS). The operations issue exposes them to Prometheus; until then they are logged.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

/// Counters of one service.
#[derive(Debug, Default)]
pub struct ServiceCounters {
    pub raw_out: AtomicU64,
    pub raw_in: AtomicU64,
    pub wire_out: AtomicU64,
    pub wire_in: AtomicU64,
    pub streams_opened: AtomicU64,
    pub streams_refused: AtomicU64,
    pub streams_failed: AtomicU64,
    pub streams_active: AtomicU64,
}

/// Counters of the link to one peer.
#[derive(Debug, Default)]
pub struct LinkCounters {
    pub connects: AtomicU64,
    pub disconnects: AtomicU64,
    pub rejected: AtomicU64,
    pub wire_out: AtomicU64,
    pub wire_in: AtomicU64,
    pub unknown_service: AtomicU64,
}

/// All counters of a daemon.
#[derive(Debug, Default)]
pub struct Counters {
    services: Mutex<HashMap<String, Arc<ServiceCounters>>>,
    pub link: LinkCounters,
}

/// A point-in-time copy of one service's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceSnapshot {
    pub raw_out: u64,
    pub raw_in: u64,
    pub wire_out: u64,
    pub wire_in: u64,
    pub opened: u64,
    pub refused: u64,
    pub failed: u64,
    pub active: u64,
}

impl Counters {
    /// The counters of a service, created on first use.
    pub fn service(&self, name: &str) -> Arc<ServiceCounters> {
        let mut m = self.services.lock().unwrap_or_else(|p| p.into_inner());
        m.entry(name.to_string()).or_default().clone()
    }

    /// A sorted copy of every service's counters.
    pub fn snapshot(&self) -> Vec<(String, ServiceSnapshot)> {
        let m = self.services.lock().unwrap_or_else(|p| p.into_inner());
        let mut v: Vec<_> = m
            .iter()
            .map(|(k, c)| {
                (
                    k.clone(),
                    ServiceSnapshot {
                        raw_out: c.raw_out.load(Relaxed),
                        raw_in: c.raw_in.load(Relaxed),
                        wire_out: c.wire_out.load(Relaxed),
                        wire_in: c.wire_in.load(Relaxed),
                        opened: c.streams_opened.load(Relaxed),
                        refused: c.streams_refused.load(Relaxed),
                        failed: c.streams_failed.load(Relaxed),
                        active: c.streams_active.load(Relaxed),
                    },
                )
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }
}

/// Adds to a counter.
pub fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Relaxed);
}

/// Subtracts one from a gauge-like counter without wrapping below zero.
pub fn dec(c: &AtomicU64) {
    let _ = c.fetch_update(Relaxed, Relaxed, |v| Some(v.saturating_sub(1)));
}
