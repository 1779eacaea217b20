//! Byte and stream counters per service and direction and per link, kept as Prometheus metrics.
//!
//! `out` is from local clients toward the peer, `in` from the peer toward local sockets. Raw bytes
//! are what local sockets sent or received; wire bytes are that service's frame bytes on the link
//! (before TLS). Each component registers its own metrics (`register(&mut Registry) -> Self`);
//! [`Counters::encode`] renders them in the Prometheus text format for the admin endpoint.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

mod codec;

pub use codec::CodecMetrics;

/// Label values of `direction`: `out` is from local sockets toward the peer, `in` the reverse.
const OUT: &str = "out";
const IN: &str = "in";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ServiceDir {
    service: String,
    direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ServiceLabel {
    service: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ServiceReason {
    service: String,
    reason: String,
}

/// Handles to one service's counters (cheap clones of the registered metrics).
#[derive(Debug, Clone)]
pub struct ServiceCounters {
    pub raw_out: Counter,
    pub raw_in: Counter,
    pub wire_out: Counter,
    pub wire_in: Counter,
    pub streams_opened: Counter,
    pub streams_refused: Counter,
    pub streams_active: Gauge,
    /// Seconds it had data and waited for its `max_rate`.
    pub held: Seconds,
    /// Seconds it had data and sent below its `min_rate`.
    pub below_min: Seconds,
    failed: Family<ServiceReason, Counter>,
    name: String,
}

/// A counter of seconds.
pub type Seconds = Counter<f64, std::sync::atomic::AtomicU64>;

impl ServiceCounters {
    /// Counts a failed stream under a short reason label (`target_refused`, `stream_error`, ...).
    pub fn failed(&self, reason: &str) {
        self.failed
            .get_or_create(&ServiceReason {
                service: self.name.clone(),
                reason: reason.to_string(),
            })
            .inc();
    }
}

/// The reasons of `wanopt_streams_failed_total` (docs/metrics.md lists the same).
pub const FAILURE_REASONS: [&str; 8] = [
    "target_refused",
    "target_timeout",
    "stream_error",
    "idle_timeout",
    "service_full",
    "client_full",
    "bulk_full",
    "link_full",
];

/// The per-service metric families.
#[derive(Debug, Clone)]
pub struct ServiceMetrics {
    raw: Family<ServiceDir, Counter>,
    wire: Family<ServiceDir, Counter>,
    opened: Family<ServiceLabel, Counter>,
    refused: Family<ServiceLabel, Counter>,
    failed: Family<ServiceReason, Counter>,
    active: Family<ServiceLabel, Gauge>,
    held: Family<ServiceLabel, Seconds>,
    below_min: Family<ServiceLabel, Seconds>,
}

impl ServiceMetrics {
    pub fn register(r: &mut Registry) -> Self {
        let m = ServiceMetrics {
            raw: Family::default(),
            wire: Family::default(),
            opened: Family::default(),
            refused: Family::default(),
            failed: Family::default(),
            active: Family::default(),
            held: Family::default(),
            below_min: Family::default(),
        };
        r.register(
            "wanopt_raw_bytes",
            "Bytes to and from local sockets, per service and direction (out: toward the peer)",
            m.raw.clone(),
        );
        r.register(
            "wanopt_wire_bytes",
            "Frame bytes of the service on the link before TLS (optimized bytes), per direction",
            m.wire.clone(),
        );
        r.register(
            "wanopt_streams_opened",
            "Streams opened, per service",
            m.opened.clone(),
        );
        r.register(
            "wanopt_streams_refused",
            "Streams or clients refused (allow list, unknown service, no link), per service",
            m.refused.clone(),
        );
        r.register(
            "wanopt_streams_failed",
            "Streams that ended with an error, per service and reason",
            m.failed.clone(),
        );
        r.register(
            "wanopt_streams_active",
            "Streams open now, per service",
            m.active.clone(),
        );
        r.register(
            "wanopt_service_held_seconds",
            "Time a bulk service had bytes to send and waited for its max_rate",
            m.held.clone(),
        );
        r.register(
            "wanopt_service_below_min_seconds",
            "Time a bulk service had bytes to send and sent below its min_rate",
            m.below_min.clone(),
        );
        m
    }

    fn service(&self, name: &str) -> ServiceCounters {
        let dir = |f: &Family<ServiceDir, Counter>, d: &'static str| {
            f.get_or_create_owned(&ServiceDir {
                service: name.to_string(),
                direction: d,
            })
        };
        let label = ServiceLabel {
            service: name.to_string(),
        };
        // Every documented reason is there from the first scrape, at zero, so a rate or an
        // alert over it has a series before the first failure.
        for reason in FAILURE_REASONS {
            let _ = self.failed.get_or_create(&ServiceReason {
                service: name.to_string(),
                reason: reason.to_string(),
            });
        }
        ServiceCounters {
            raw_out: dir(&self.raw, OUT),
            raw_in: dir(&self.raw, IN),
            wire_out: dir(&self.wire, OUT),
            wire_in: dir(&self.wire, IN),
            streams_opened: self.opened.get_or_create_owned(&label),
            streams_refused: self.refused.get_or_create_owned(&label),
            streams_active: self.active.get_or_create_owned(&label),
            held: self.held.get_or_create_owned(&label),
            below_min: self.below_min.get_or_create_owned(&label),
            failed: self.failed.clone(),
            name: name.to_string(),
        }
    }
}

/// Counters of the link to the peer.
#[derive(Debug, Clone, Default)]
pub struct LinkCounters {
    pub connects: Counter,
    pub disconnects: Counter,
    pub rejected: Counter,
    pub wire_out: Counter,
    pub wire_in: Counter,
    pub unknown_service: Counter,
    pub input_paused: Counter,
    pub handshakes_evicted: Counter,
    pub outside_allow: Counter,
    pub handshakes_pending: Gauge,
    pub up: Gauge,
    pub lanes: Gauge,
    pub zstd_level: Gauge,
    pub outages: Counter,
    pub stalls: Counter,
    pub outage_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
    pub streams_resumed: Counter,
    pub resent: Counter,
    pub replays: Counter,
    pub replayed: Counter,
    pub replay_kept: Gauge,
    pub streams_lost: Counter,
    pub copies: Gauge,
    pub copies_wanted: Gauge,
    pub copy_duplicated: Counter,
    pub copy_late: Counter,
    pub copy_spacing_seconds: Seconds,
    pub copy_impaired: Counter,
    pub copies_lost: Counter,
    pub copy_won: Family<CopyLabel, Counter>,
    pub datagram_bytes: Counter,
    pub datagrams_received: Counter,
    pub datagrams_late: Counter,
    pub datagrams_refused: Counter,
    pub bulk_pacing: Gauge,
    pub bulk_yield_seconds: Seconds,
}

/// Which copy of the latency lane: `1` is the slot of the lane's first connection.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CopyLabel {
    copy: &'static str,
}

impl LinkCounters {
    /// Counts latency-lane bytes copy `slot` delivered before any other copy (slot 5: the
    /// lane's datagrams).
    pub fn copy_won(&self, slot: usize, n: u64) {
        const NAMES: [&str; 6] = ["1", "2", "3", "4", "5", "datagrams"];
        if let Some(copy) = NAMES.get(slot) {
            self.copy_won.get_or_create(&CopyLabel { copy }).inc_by(n);
        }
    }

    pub fn register(r: &mut Registry) -> Self {
        let m = LinkCounters::default();
        // The lane's first connection is always there; further copies appear when they win.
        let _ = m.copy_won.get_or_create(&CopyLabel { copy: "1" });
        r.register(
            "wanopt_link_connects",
            "Links that came up",
            m.connects.clone(),
        );
        r.register(
            "wanopt_link_disconnects",
            "Links that went down",
            m.disconnects.clone(),
        );
        r.register(
            "wanopt_link_rejected",
            "Link connections rejected (TLS, wrong peer, no hello)",
            m.rejected.clone(),
        );
        r.register(
            "wanopt_link_wire_sent_bytes",
            "All frame bytes sent on the link, control frames included, before TLS",
            m.wire_out.clone(),
        );
        r.register(
            "wanopt_link_wire_received_bytes",
            "All frame bytes received on the link, control frames included, after TLS",
            m.wire_in.clone(),
        );
        r.register(
            "wanopt_link_unknown_service",
            "Streams the peer opened for a service this side does not have",
            m.unknown_service.clone(),
        );
        r.register(
            "wanopt_link_input_paused",
            "Times the link stopped reading because the peer did not read the control frames it caused (pongs, resets, window updates)",
            m.input_paused.clone(),
        );
        r.register(
            "wanopt_link_handshakes_evicted",
            "Unauthenticated link connections dropped for a newer one (limits.max_handshakes, limits.handshakes_per_source)",
            m.handshakes_evicted.clone(),
        );
        r.register(
            "wanopt_link_outside_allow",
            "Link connections closed before any TLS byte, and latency-lane datagrams dropped unread, because their source is outside link.allow",
            m.outside_allow.clone(),
        );
        r.register(
            "wanopt_link_handshakes_pending",
            "Link connections still authenticating",
            m.handshakes_pending.clone(),
        );
        r.register(
            "wanopt_link_up",
            "1 while the link to the peer is up",
            m.up.clone(),
        );
        r.register(
            "wanopt_link_lanes",
            "Connections in the link (2 with the latency lane)",
            m.lanes.clone(),
        );
        r.register(
            "wanopt_link_zstd_level",
            "The zstd level the link compresses at now (moved by optimize.zstd_adapt)",
            m.zstd_level.clone(),
        );
        let (threads, in_use) = crate::workers::gauges();
        r.register(
            "wanopt_codec_threads",
            "Threads that encode and decode (limits.threads of the process's codec pool)",
            threads,
        );
        r.register(
            "wanopt_codec_pool_in_use",
            "1 while the codec pool's threads are used: its last probe found they make batches faster",
            in_use,
        );
        r.register(
            "wanopt_codec_context_turns",
            "Bulk streams' stream-context work the codec pool did while the daemon's thread went on with other streams': a turn compressed in its context (sending), a frame fed to its context (receiving)",
            crate::workers::context_turns(),
        );
        r.register(
            "wanopt_codec_pool_turned_down",
            "Times the codec pool's threads were found not to make batches faster and were left unused for a while (a host whose cores are busy)",
            crate::workers::turned_down(),
        );
        r.register(
            "wanopt_link_stalls",
            "Times the daemon found it had not run for over two ping intervals while the peer was quiet (a busy host): that time was not counted as the peer's silence",
            m.stalls.clone(),
        );
        r.register(
            "wanopt_link_outages",
            "Link connections lost while streams waited for the next one (link.resume_window)",
            m.outages.clone(),
        );
        r.register(
            "wanopt_link_outage_seconds",
            "Time from a lost link connection to its streams going on over the next, summed",
            m.outage_seconds.clone(),
        );
        r.register(
            "wanopt_link_streams_resumed",
            "Streams that went on over a new link connection",
            m.streams_resumed.clone(),
        );
        r.register(
            "wanopt_link_resent_bytes",
            "Stream bytes sent again after a lost link connection (they were in flight)",
            m.resent.clone(),
        );
        r.register(
            "wanopt_link_replays",
            "Lost link connections resumed by sending again what they had not delivered, the caches and stream contexts kept (both daemons of this build)",
            m.replays.clone(),
        );
        r.register(
            "wanopt_link_replay_kept_bytes",
            "Link bytes kept to send again after a lost connection: sent, and not yet read by the peer",
            m.replay_kept.clone(),
        );
        r.register(
            "wanopt_link_replayed_bytes",
            "Link bytes sent again as they were after a lost connection (a replay)",
            m.replayed.clone(),
        );
        r.register(
            "wanopt_link_streams_lost",
            "Streams reset because a lost link connection could not be resumed (past link.resume_window, or the peer restarted)",
            m.streams_lost.clone(),
        );
        r.register(
            "wanopt_link_latency_copies",
            "Connections carrying the latency lane now; with more than one, each carries a copy of its bytes and the first to arrive is used",
            m.copies.clone(),
        );
        r.register(
            "wanopt_link_latency_copies_wanted",
            "Copies of the latency lane its services' redundancy asks for now (auto: 1 while latency traffic would crowd out bulk)",
            m.copies_wanted.clone(),
        );
        r.register(
            "wanopt_link_copy_duplicated_bytes",
            "Latency-lane bytes sent again on another copy's connection: what redundancy costs",
            m.copy_duplicated.clone(),
        );
        r.register(
            "wanopt_link_copy_late_bytes",
            "Latency-lane bytes that arrived after another copy had brought them (discarded)",
            m.copy_late.clone(),
        );
        r.register(
            "wanopt_link_copy_spacing_seconds",
            "Time later copies of latency-lane writes waited for their spacing (link.copy_spacing) before they left: what spacing costs; the first copy of a write never waits",
            m.copy_spacing_seconds.clone(),
        );
        r.register(
            "wanopt_link_copy_impaired",
            "Latency-lane copies that were still recovering from a loss, or had earlier bytes unacknowledged, when a write was pushed: they wrote it after the readier copies",
            m.copy_impaired.clone(),
        );
        r.register(
            "wanopt_link_copy_won_bytes",
            "Latency-lane bytes each copy delivered first",
            m.copy_won.clone(),
        );
        for (name, help, c) in [
            (
                "wanopt_link_lane_datagram_bytes",
                "Bytes the latency lane's datagrams put on the wire, each send counted (link.lane_datagrams): what they cost",
                &m.datagram_bytes,
            ),
            (
                "wanopt_link_lane_datagrams_received",
                "Latency-lane datagrams from the peer that opened under the lane's keys",
                &m.datagrams_received,
            ),
            (
                "wanopt_link_lane_datagrams_late",
                "Latency-lane datagrams dropped as seen before: a later send of one that had arrived",
                &m.datagrams_late,
            ),
            (
                "wanopt_link_lane_datagrams_refused",
                "Datagrams on the lane's socket that did not open under the current lane's keys (forged, damaged, or of an older lane)",
                &m.datagrams_refused,
            ),
        ] {
            r.register(name, help, c.clone());
        }
        r.register(
            "wanopt_link_copies_lost",
            "Copy connections of the latency lane lost while another carried the lane",
            m.copies_lost.clone(),
        );
        r.register(
            "wanopt_link_bulk_pacing_bits_per_second",
            "The main lane's pacing cap now: link.max_rate, or less while it makes room for the latency lane (link.latency_queue); 0 when not paced",
            m.bulk_pacing.clone(),
        );
        r.register(
            "wanopt_link_bulk_yield_seconds",
            "Time the main lane was paced below link.max_rate to keep the WAN's queue short for the latency lane's traffic (link.latency_queue): what room for SYNC round trips cost bulk",
            m.bulk_yield_seconds.clone(),
        );
        m
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

/// The admin endpoint's refusals.
#[derive(Debug, Clone, Default)]
pub struct AdminMetrics {
    refused: Family<ReasonLabel, Counter>,
}

impl AdminMetrics {
    pub fn register(r: &mut Registry) -> Self {
        let m = AdminMetrics::default();
        for reason in ["allow", "busy"] {
            let _ = m.refused.get_or_create(&ReasonLabel { reason });
        }
        r.register(
            "wanopt_admin_refused",
            "Admin endpoint connections closed unanswered: from outside admin.allow (allow), or \
             beyond the 32 answered at once (busy)",
            m.refused.clone(),
        );
        m
    }

    /// Counts a connection refused for `reason` (`allow` or `busy`).
    pub fn refused(&self, reason: &'static str) {
        self.refused.get_or_create(&ReasonLabel { reason }).inc();
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LaneLabel {
    lane: &'static str,
}

/// `TCP_INFO` samples of the link's sockets, per lane (`main`, `latency`); they describe the
/// current connection and start over when the link reconnects.
#[derive(Debug, Clone, Default)]
pub struct SocketMetrics {
    rtt: Family<LaneLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
    cwnd: Family<LaneLabel, Gauge>,
    retrans: Family<LaneLabel, Gauge>,
    delivery: Family<LaneLabel, Gauge>,
    sent: Family<LaneLabel, Gauge>,
    received: Family<LaneLabel, Gauge>,
}

/// One `TCP_INFO` reading.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TcpSample {
    pub rtt_seconds: f64,
    /// The least RTT the connection saw (`tcpi_min_rtt`): its path with empty queues.
    pub min_rtt_seconds: f64,
    pub cwnd_segments: i64,
    pub retransmitted_segments: i64,
    pub delivery_rate: i64,
    pub bytes_sent: i64,
    pub bytes_received: i64,
    /// Data segments sent (retransmissions included): with `retransmitted_segments`, the loss
    /// the connection saw.
    pub data_segments_sent: i64,
    /// The kernel marked the delivery-rate sample as limited by the application (nothing more
    /// to send), so it says nothing about the link's capacity.
    pub app_limited: bool,
}

impl SocketMetrics {
    pub fn register(r: &mut Registry) -> Self {
        let m = SocketMetrics::default();
        r.register(
            "wanopt_link_rtt_seconds",
            "Smoothed round-trip time of the link socket (TCP_INFO)",
            m.rtt.clone(),
        );
        r.register(
            "wanopt_link_cwnd_segments",
            "Congestion window of the link socket, in segments",
            m.cwnd.clone(),
        );
        r.register(
            "wanopt_link_retransmitted_segments",
            "Segments the link socket retransmitted on the current connection",
            m.retrans.clone(),
        );
        r.register(
            "wanopt_link_delivery_rate_bytes_per_second",
            "Delivery rate the kernel measured on the link socket",
            m.delivery.clone(),
        );
        r.register(
            "wanopt_link_socket_sent_bytes",
            "Bytes the link socket sent on the current connection (TLS included)",
            m.sent.clone(),
        );
        r.register(
            "wanopt_link_socket_received_bytes",
            "Bytes the link socket received on the current connection (TLS included)",
            m.received.clone(),
        );
        m
    }

    /// Records a reading for `lane` (`main` or `latency`).
    pub fn record(&self, lane: &'static str, t: &TcpSample) {
        let l = LaneLabel { lane };
        self.rtt.get_or_create(&l).set(t.rtt_seconds);
        self.cwnd.get_or_create(&l).set(t.cwnd_segments);
        self.retrans.get_or_create(&l).set(t.retransmitted_segments);
        self.delivery.get_or_create(&l).set(t.delivery_rate);
        self.sent.get_or_create(&l).set(t.bytes_sent);
        self.received.get_or_create(&l).set(t.bytes_received);
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CertLabel {
    cert: &'static str,
}

/// Expiry times of the certificates in use: this site's (`own`), the CA's, and the peer's.
#[derive(Debug, Clone, Default)]
pub struct CertMetrics {
    expiry: Family<CertLabel, Gauge>,
}

impl CertMetrics {
    pub fn register(r: &mut Registry) -> Self {
        let m = CertMetrics::default();
        r.register(
            "wanopt_certificate_expiry_timestamp_seconds",
            "When a certificate in use expires (Unix time); cert is own, ca or peer",
            m.expiry.clone(),
        );
        m
    }

    /// Records the expiry of certificate `cert` (`own`, `ca` or `peer`).
    pub fn set(&self, cert: &'static str, unix_seconds: u64) {
        self.expiry
            .get_or_create(&CertLabel { cert })
            .set(i64::try_from(unix_seconds).unwrap_or(i64::MAX));
    }
}

/// All counters of a daemon, and the registry that exposes them.
#[derive(Debug)]
pub struct Counters {
    registry: Registry,
    services: ServiceMetrics,
    cache: Mutex<HashMap<String, Arc<ServiceCounters>>>,
    pub link: LinkCounters,
    pub sockets: SocketMetrics,
    pub certs: CertMetrics,
    pub codec: CodecMetrics,
    pub admin: AdminMetrics,
    pub handover: crate::handover::HandoverMetrics,
}

impl Default for Counters {
    fn default() -> Self {
        Self::new()
    }
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
    pub active: i64,
}

impl Counters {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let services = ServiceMetrics::register(&mut registry);
        let link = LinkCounters::register(&mut registry);
        let sockets = SocketMetrics::register(&mut registry);
        let certs = CertMetrics::register(&mut registry);
        let codec = CodecMetrics::register(&mut registry);
        let admin = AdminMetrics::register(&mut registry);
        let handover = crate::handover::HandoverMetrics::register(&mut registry);
        Counters {
            handover,
            codec,
            admin,
            registry,
            services,
            cache: Mutex::new(HashMap::new()),
            link,
            sockets,
            certs,
        }
    }

    /// The counters of a service, created on first use.
    pub fn service(&self, name: &str) -> Arc<ServiceCounters> {
        let mut m = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        // Looked up on every dispatch of the link's counts: no allocation when it exists.
        if let Some(c) = m.get(name) {
            return c.clone();
        }
        self.codec.service(name);
        m.entry(name.to_string())
            .or_insert_with(|| Arc::new(self.services.service(name)))
            .clone()
    }

    /// A sorted copy of every service's counters.
    pub fn snapshot(&self) -> Vec<(String, ServiceSnapshot)> {
        let m = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        let mut v: Vec<_> = m
            .iter()
            .map(|(k, c)| {
                (
                    k.clone(),
                    ServiceSnapshot {
                        raw_out: c.raw_out.get(),
                        raw_in: c.raw_in.get(),
                        wire_out: c.wire_out.get(),
                        wire_in: c.wire_in.get(),
                        opened: c.streams_opened.get(),
                        refused: c.streams_refused.get(),
                        active: c.streams_active.get(),
                    },
                )
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// Every metric in the Prometheus text exposition format.
    pub fn encode(&self) -> String {
        let mut s = String::new();
        if prometheus_client::encoding::text::encode(&mut s, &self.registry).is_err() {
            s.clear();
        }
        s
    }
}

/// Adds to a counter.
pub fn add(c: &Counter, n: u64) {
    c.inc_by(n);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_are_exposed_with_labels() {
        let c = Counters::new();
        let s = c.service("dg");
        add(&s.raw_out, 100);
        add(&s.wire_out, 40);
        s.failed("target_refused");
        c.link.up.set(1);
        let text = c.encode();
        assert!(
            text.contains("wanopt_raw_bytes_total{service=\"dg\",direction=\"out\"} 100"),
            "{text}"
        );
        assert!(
            text.contains("wanopt_wire_bytes_total{service=\"dg\",direction=\"out\"} 40"),
            "{text}"
        );
        assert!(
            text.contains(
                "wanopt_streams_failed_total{service=\"dg\",reason=\"target_refused\"} 1"
            ),
            "{text}"
        );
        assert!(text.contains("wanopt_link_up 1"), "{text}");
        assert!(text.contains("# HELP wanopt_raw_bytes"), "{text}");
        assert_eq!(c.snapshot()[0].1.raw_out, 100);
    }
}
