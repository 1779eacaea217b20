//! The optimization codec's metrics: dedup hits and misses, bytes per compression, what deltas
//! and re-sent chunks cost, and the caches' sizes per tier, lane and scope.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::{IN, OUT, ServiceDir, ServiceLabel};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DedupLabel {
    service: String,
    direction: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodecLabel {
    service: String,
    codec: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SavedLabel {
    service: String,
    mechanism: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CacheLabel {
    tier: &'static str,
    lane: &'static str,
    scope: String,
    role: &'static str,
}

/// The optimization codec: dedup hits and misses, bytes per codec, re-sent chunks and caches.
/// Bytes after dedup are raw bytes minus hit bytes.
#[derive(Debug, Clone, Default)]
pub struct CodecMetrics {
    dedup_bytes: Family<DedupLabel, Counter>,
    dedup_chunks: Family<DedupLabel, Counter>,
    codec_bytes: Family<CodecLabel, Counter>,
    codec_wire: Family<CodecLabel, Counter>,
    saved: Family<SavedLabel, Counter>,
    no_base_bytes: Family<ServiceLabel, Counter>,
    no_base_chunks: Family<ServiceLabel, Counter>,
    base_waits: Family<ServiceLabel, Counter>,
    frames: Family<ServiceLabel, Counter>,
    frames_behind: Family<ServiceLabel, Counter>,
    resends: Family<ServiceDir, Counter>,
    cache_bytes: Family<CacheLabel, Gauge>,
    cache_chunks: Family<CacheLabel, Gauge>,
    cache_evictions: Family<CacheLabel, Gauge>,
    cache_unreadable: Family<CacheLabel, Gauge>,
    stall_timeouts: Counter,
    states_replaced: Counter,
}

impl CodecMetrics {
    /// Creates the per-service series that only events would otherwise create, at zero.
    pub(super) fn service(&self, name: &str) {
        for f in [&self.frames, &self.frames_behind] {
            let _ = f.get_or_create(&ServiceLabel {
                service: name.to_string(),
            });
        }
        for direction in [OUT, IN] {
            let _ = self.resends.get_or_create(&ServiceDir {
                service: name.to_string(),
                direction,
            });
        }
    }

    pub fn register(r: &mut Registry) -> Self {
        let m = CodecMetrics::default();
        r.register(
            "wanopt_dedup_bytes",
            "Raw bytes of chunks found in the cache (result=hit, sent as a reference), sent as a delta against similar cached chunks (delta) or sent as data (miss), per service and direction",
            m.dedup_bytes.clone(),
        );
        r.register(
            "wanopt_dedup_chunks",
            "Chunks found in the cache (hit) or sent as data (miss), per service and direction",
            m.dedup_chunks.clone(),
        );
        r.register(
            "wanopt_codec_bytes",
            "Raw bytes sent to the peer with each compression (none, lz4, zstd), per service",
            m.codec_bytes.clone(),
        );
        r.register(
            "wanopt_codec_wire_bytes",
            "Record bytes those literals took on the wire, per service and compression: wanopt_codec_bytes minus this is what the compression saved",
            m.codec_wire.clone(),
        );
        r.register(
            "wanopt_saved_bytes",
            "Bytes our encoder kept off the wire, per service and mechanism: dedup (chunks sent as \
             references), delta (chunks sent as deltas against similar ones the peer holds), \
             compression (literals)",
            m.saved.clone(),
        );
        r.register(
            "wanopt_delta_no_base_bytes",
            "Raw bytes of chunks sent as data although the delta index offered a similar chunk the \
             peer holds, per service: the base did not pay, the stream's own context reached it, or \
             its bytes were still on disk (a share of wanopt_dedup_bytes{result=\"miss\"})",
            m.no_base_bytes.clone(),
        );
        r.register(
            "wanopt_delta_no_base_chunks",
            "Chunks counted in wanopt_delta_no_base_bytes, per service",
            m.no_base_chunks.clone(),
        );
        r.register(
            "wanopt_delta_base_waits",
            "Times a stream paused before a chunk until the delta bases the index offered for it              were read from our disk tier, per service: many per second mean the disk tier's              reads pace the stream",
            m.base_waits.clone(),
        );
        r.register(
            "wanopt_coded_frames",
            "Frames our encoder sent, per service: each has a header of its own (about 10 bytes; \
             22 to a peer of a version before short frames), so wanopt_wire_bytes over this is \
             the mean frame",
            m.frames.clone(),
        );
        r.register(
            "wanopt_coded_frames_behind",
            "Frames our encoder planned while the same stream's frame before still waited for its \
             context records, per service: with limits.threads of 2 or more, one bulk stream's \
             context compressing on a pool thread beside the planning of its next frame",
            m.frames_behind.clone(),
        );
        r.register(
            "wanopt_stall_timeouts",
            "Streams reset because a chunk they waited for (asked of the peer, or read from our disk tier) did not come within the link's idle timeout",
            m.stall_timeouts.clone(),
        );
        r.register(
            "wanopt_cache_states_replaced",
            "Cache states the peer's checkpoints asked us to save that a newer one replaced before \
             they were written (at most one write waits per cache)",
            m.states_replaced.clone(),
        );
        r.register(
            "wanopt_dedup_resends",
            "Chunks re-sent after the receiver missed them (out: we re-sent, in: we asked)",
            m.resends.clone(),
        );
        r.register(
            "wanopt_cache_bytes",
            "Bytes held in a chunk cache of the current link (role: mirror of the peer's, decoder, or bases: what we sent, kept for deltas)",
            m.cache_bytes.clone(),
        );
        r.register(
            "wanopt_cache_chunks",
            "Chunks held in a chunk cache of the current link",
            m.cache_chunks.clone(),
        );
        r.register(
            "wanopt_cache_evictions",
            "Chunks a cache of the current link evicted to stay within its size (tier memory of a \
             cache with a disk tier: chunks whose bytes moved to disk only)",
            m.cache_evictions.clone(),
        );
        r.register(
            "wanopt_cache_unreadable",
            "Chunks of a disk tier that read back damaged or missing, treated as misses",
            m.cache_unreadable.clone(),
        );
        m
    }

    /// Adds one service's codec counts from the link.
    pub fn record(&self, service: &str, c: &wanopt_proto::CodecCount) {
        let d = |direction, result| DedupLabel {
            service: service.to_string(),
            direction,
            result,
        };
        let s = &c.sent;
        let r = &c.received;
        for (dir, result, bytes, chunks) in [
            (OUT, "hit", s.hit_bytes, s.hit_chunks),
            (OUT, "miss", s.miss_bytes, s.miss_chunks),
            (OUT, "delta", s.delta_bytes, s.delta_chunks),
            (IN, "hit", r.hit_bytes, r.hit_chunks),
            (IN, "miss", r.lit_bytes, r.lit_chunks),
            (IN, "delta", r.delta_bytes, r.delta_chunks),
        ] {
            if bytes > 0 || chunks > 0 {
                self.dedup_bytes
                    .get_or_create(&d(dir, result))
                    .inc_by(bytes);
                self.dedup_chunks
                    .get_or_create(&d(dir, result))
                    .inc_by(chunks);
            }
        }
        for ((codec, n), w) in ["none", "lz4", "zstd"]
            .into_iter()
            .zip(s.codec_bytes)
            .zip(s.codec_wire)
        {
            if n > 0 {
                let label = CodecLabel {
                    service: service.to_string(),
                    codec,
                };
                self.codec_bytes.get_or_create(&label).inc_by(n);
                self.codec_wire.get_or_create(&label).inc_by(w);
            }
        }
        let compression = s
            .codec_bytes
            .iter()
            .zip(s.codec_wire)
            .map(|(b, w)| b.saturating_sub(w))
            .sum();
        for (mechanism, n) in [
            ("dedup", s.hit_bytes.saturating_sub(s.hit_wire)),
            ("delta", s.delta_bytes.saturating_sub(s.delta_wire)),
            ("compression", compression),
        ] {
            // A service that sent anything shows all three, zeros too: which one pays is the point.
            if s.raw_bytes > 0 {
                self.saved
                    .get_or_create(&SavedLabel {
                        service: service.to_string(),
                        mechanism,
                    })
                    .inc_by(n);
            }
        }
        if s.raw_bytes > 0 {
            // Zeros too: a service whose deltas never miss shows that it never did.
            let label = ServiceLabel {
                service: service.to_string(),
            };
            self.no_base_bytes
                .get_or_create(&label)
                .inc_by(s.no_base_bytes);
            self.no_base_chunks
                .get_or_create(&label)
                .inc_by(s.no_base_chunks);
            self.base_waits.get_or_create(&label).inc_by(s.base_waits);
            self.frames.get_or_create(&label).inc_by(s.frames);
            self.frames_behind
                .get_or_create(&label)
                .inc_by(s.planned_behind);
        }
        for (direction, n) in [(OUT, c.resent), (IN, c.needs)] {
            if n > 0 {
                self.resends
                    .get_or_create(&ServiceDir {
                        service: service.to_string(),
                        direction,
                    })
                    .inc_by(n);
            }
        }
    }

    /// Counts streams whose stall timed out (`n` more since the last call).
    pub fn stall_timeouts(&self, n: u64) {
        if n > 0 {
            self.stall_timeouts.inc_by(n);
        }
    }

    /// Counts a cache state replaced before it was written.
    pub fn state_replaced(&self) {
        self.states_replaced.inc();
    }

    /// Sets the cache gauges from the current link.
    pub fn record_caches(&self, stats: &[wanopt_proto::CacheStat]) {
        for st in stats {
            let mut l = CacheLabel {
                tier: "memory",
                lane: if st.lane == wanopt_proto::LATENCY_LANE {
                    "latency"
                } else {
                    "main"
                },
                scope: if st.scope.is_empty() {
                    "link".to_string()
                } else {
                    st.scope.to_string()
                },
                role: st.role,
            };
            let g = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
            let t = &st.tiers;
            if t.disk {
                self.cache_bytes.get_or_create(&l).set(g(t.mem_bytes));
                self.cache_chunks.get_or_create(&l).set(g(t.mem_chunks));
                self.cache_evictions
                    .get_or_create(&l)
                    .set(g(t.mem_evictions));
                l.tier = "disk";
                self.cache_bytes.get_or_create(&l).set(g(t.disk_bytes));
                self.cache_chunks.get_or_create(&l).set(g(t.disk_chunks));
                self.cache_unreadable.get_or_create(&l).set(g(t.disk_lost));
            } else {
                self.cache_bytes.get_or_create(&l).set(g(st.bytes));
                self.cache_chunks.get_or_create(&l).set(g(st.chunks));
            }
            self.cache_evictions.get_or_create(&l).set(g(st.evictions));
        }
    }
}
