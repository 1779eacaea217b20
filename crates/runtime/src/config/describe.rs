//! `Config::describe`: the effective config printed back as YAML (`wanoptd check`), every
//! default filled in, in a form `Config::parse` reads back to the same config.

use super::fields::{dur, on_off, one_line, quoted};
use super::*;

impl Config {
    /// The effective config as YAML, every default filled in (`wanoptd check`). It parses back
    /// to the same config; what was left to a default that depends on something else (the
    /// bandwidth when not stated) is written as a comment.
    pub fn describe(&self) -> String {
        use std::fmt::Write;
        let mut o = String::new();
        let l = &self.link;
        let _ = writeln!(o, "# effective config of {}", one_line(&self.path));
        let _ = writeln!(o, "site: {}", self.site);
        let _ = writeln!(o, "link:");
        match &l.role {
            LinkRole::Listen(a) => {
                let _ = writeln!(o, "  listen: {}", quoted(a));
                if l.allow.is_empty() {
                    let _ = writeln!(o, "  # allow: any address (the gate bounds strangers)");
                } else {
                    let list: Vec<String> = l.allow.iter().map(quoted).collect();
                    let _ = writeln!(o, "  allow: [{}]", list.join(", "));
                }
            }
            LinkRole::Connect(c) => {
                let _ = writeln!(o, "  connect: {}", quoted(c));
            }
        }
        let _ = writeln!(o, "  peer: {}", l.peer);
        let bw = format!("bandwidth: {}bit  # bits per second", l.bandwidth_bps);
        if l.bandwidth_stated {
            let _ = writeln!(o, "  {bw}");
        } else {
            let _ = writeln!(o, "  # {bw}, assumed: not stated, so nothing is paced");
        }
        let _ = writeln!(
            o,
            "  rtt: {}  # bandwidth-delay product {} bytes",
            dur(l.rtt),
            l.bdp_bytes()
        );
        let _ = writeln!(o, "  congestion: {}", l.congestion);
        let _ = writeln!(o, "  send_buffer: {}", l.send_buffer);
        let _ = writeln!(o, "  recv_buffer: {}", l.recv_buffer);
        let _ = writeln!(o, "  notsent_lowat: {}", l.notsent_lowat);
        let _ = writeln!(o, "  keepalive: {}", dur(l.keepalive));
        let _ = writeln!(o, "  user_timeout: {}", dur(l.user_timeout));
        let _ = writeln!(o, "  reconnect_min: {}", dur(l.reconnect_min));
        let _ = writeln!(o, "  reconnect_max: {}", dur(l.reconnect_max));
        let _ = writeln!(o, "  resume_window: {}", dur(l.resume_window));
        let _ = writeln!(o, "  latency_lane: {}", l.latency_lane);
        let _ = writeln!(o, "  lane_congestion: {}", l.lane_congestion);
        let _ = writeln!(
            o,
            "  copy_spacing: {}  # between the copies of a latency-lane write",
            dur(l.copy_spacing)
        );
        let floor = l.lane_rto_min.map_or("the kernel's".to_string(), dur);
        let _ = match (l.lane_rto_min_auto, l.lane_rto_min) {
            (true, _) => writeln!(
                o,
                "  lane_rto_min: auto  # {floor}: least retransmission timeout of the latency lane's connections"
            ),
            (false, None) => writeln!(o, "  lane_rto_min: off  # the kernel's"),
            (false, Some(d)) => writeln!(
                o,
                "  lane_rto_min: {}  # least retransmission timeout of the latency lane's connections",
                dur(d)
            ),
        };
        match l.max_rate_bps {
            Some(r) => {
                let _ = writeln!(o, "  max_rate: {r}bit  # pacing cap of the link sockets");
            }
            None => {
                let _ = writeln!(o, "  max_rate: off");
            }
        }
        let _ = writeln!(
            o,
            "  lane_datagrams: {}  # {}",
            l.lane_datagrams.label(),
            match l.lane_datagrams {
                crate::datagrams::Setting::Auto =>
                    "latency-lane writes also go as UDP datagrams (the listener's port) while the lane has 4 or more copies (auto's five on a lossy, quiet lane)",
                crate::datagrams::Setting::On =>
                    "latency-lane writes also go as UDP datagrams (the listener's port) whenever the peer takes them",
                crate::datagrams::Setting::Off =>
                    "latency-lane writes go on their TCP connections only",
            }
        );
        let _ = writeln!(
            o,
            "  latency_queue: {}  # {}",
            l.latency_queue.map_or("off".to_string(), dur),
            match (l.latency_queue, l.max_rate_bps) {
                (Some(_), Some(_)) =>
                    "while latency services are busy, bulk paces down to keep the WAN's queue under it",
                (Some(_), None) =>
                    "no effect without a pacing cap (link.bandwidth or link.max_rate)",
                (None, _) => "bulk keeps its pacing whatever the latency services",
            }
        );
        let _ = writeln!(
            o,
            "tls:\n  ca: {}\n  cert: {}\n  key: {}",
            quoted(self.tls.ca.display()),
            quoted(self.tls.cert.display()),
            quoted(self.tls.key.display())
        );
        match &self.tls.crl {
            Some(c) => {
                let _ = writeln!(o, "  crl: {}", quoted(c.display()));
            }
            None => {
                let _ = writeln!(o, "  # crl: none (no certificate of the CA is revoked)");
            }
        }
        let _ = writeln!(
            o,
            "services:{}",
            if self.services.is_empty() { " []" } else { "" }
        );
        for s in &self.services {
            let _ = writeln!(o, "  - name: {}\n    class: {}", s.name, s.class);
            if s.class == wanopt_proto::Class::Latency {
                let _ = writeln!(
                    o,
                    "    redundancy: {}  # the link's latency lane: {}",
                    s.redundancy.label(),
                    crate::redundancy::explain(self.redundancy(), self.link.bandwidth_bps)
                );
            }
            if s.class == wanopt_proto::Class::Bulk {
                self.describe_shaping(&mut o, s);
            }
            let _ = writeln!(
                o,
                "    compression: {}\n    dedup: {}\n    dedup_scope: {}",
                s.policy.compression,
                on_off(s.policy.dedup),
                s.policy.scope
            );
            let idle = s.idle_timeout.map_or("off".to_string(), dur);
            let _ = writeln!(
                o,
                "    max_streams: {}\n    idle_timeout: {idle}",
                s.max_streams
            );
            match &s.kind {
                ServiceKind::Listen { addr, allow } => {
                    let _ = writeln!(o, "    listen: {}", quoted(addr));
                    let list: Vec<String> = allow.iter().map(quoted).collect();
                    let _ = writeln!(o, "    allow: [{}]", list.join(", "));
                    let _ = writeln!(
                        o,
                        "    max_streams_per_client: {}",
                        s.max_streams_per_client
                    );
                }
                ServiceKind::Target { addr } => {
                    let _ = writeln!(o, "    target: {}", quoted(addr));
                }
            }
        }
        let op = &self.optimize;
        let _ = writeln!(
            o,
            "optimize:\n  enabled: {}\n  memory: {}  # bytes of the shared cache, each way\n  service_memory: {}\n  chunk: {}\n  zstd_level: {}\n  zstd_adapt: {}{}\n  context_window: {}  # a bulk stream's zstd context\n  context_streams: {}  # bulk streams with one at once\n  delta_memory: {}  # what we sent, kept as delta bases\n  compression: {}\n  dedup: {}\n  dedup_scope: {}",
            op.enabled,
            op.codec.cache_bytes,
            op.codec.service_cache_bytes,
            op.codec.avg_chunk,
            op.codec.zstd_level,
            on_off(op.zstd_adapt),
            zstd_range(op).map_or(String::new(), |(lo, hi)| format!(
                "  # levels {lo}-{hi}: the highest at which one core encodes twice what the link drains"
            )),
            op.codec
                .long_context
                .map_or("off".to_string(), |l| l.window().to_string()),
            op.codec
                .long_context
                .map_or(wanopt_proto::LongContext::default().streams, |l| l.streams),
            match op.codec.delta_bytes {
                0 => "off".to_string(),
                n => n.to_string(),
            },
            op.default.compression,
            on_off(op.default.dedup),
            op.default.scope
        );
        if let Some(d) = &op.disk {
            let _ = writeln!(
                o,
                "  disk:  # under {}/cache/{}\n    bytes: {}\n    service_bytes: {}\n    delta_bytes: {}  # behind delta_memory\n    checkpoint: {}",
                one_line(&self.state_dir),
                self.link.peer,
                op.codec.disk_bytes,
                op.codec.service_disk_bytes,
                d.delta_bytes,
                dur(d.checkpoint),
            );
            match &d.key_file {
                Some(p) => {
                    let _ = writeln!(o, "    key_file: {}", quoted(p.display()));
                }
                None => {
                    let _ = writeln!(o, "    # no key_file: chunks are stored unencrypted");
                }
            }
        }
        if let Some(a) = &self.admin {
            let _ = writeln!(o, "admin:\n  listen: {}", quoted(a.addr));
            if !a.allow.is_empty() {
                let list: Vec<String> = a.allow.iter().map(quoted).collect();
                let _ = writeln!(o, "  allow: [{}]", list.join(", "));
            }
        }
        let _ = writeln!(o, "state_dir: {}", quoted(self.state_dir.display()));
        let _ = writeln!(o, "log:\n  level: {}", self.log_level);
        let m = &self.limits;
        let _ = writeln!(
            o,
            "limits:\n  threads: {}\n  max_streams: {}\n  stream_window: {}\n  link_window: {}\n  stream_buffer: {}",
            m.threads, m.max_streams, m.stream_window, m.link_window, m.stream_buffer
        );
        let _ = writeln!(
            o,
            "  shutdown_grace: {}\n  connect_timeout: {}\n  link_wait: {}\n  handshake_timeout: {}\n  idle_timeout: {}",
            dur(m.shutdown_grace),
            dur(m.connect_timeout),
            dur(m.link_wait),
            dur(m.handshake_timeout),
            dur(m.idle_timeout)
        );
        let _ = writeln!(
            o,
            "  latency_reserve: {}\n  max_handshakes: {}\n  handshakes_per_source: {}",
            m.latency_reserve, m.max_handshakes, m.handshakes_per_source
        );
        for w in self.warnings() {
            let _ = writeln!(o, "# warning: {w}");
        }
        o
    }

    /// A bulk service's share of a full link and its rates, as `share`, `min_rate` and
    /// `max_rate` lines (rates in bits per second, with what they are of the link).
    fn describe_shaping(&self, o: &mut String, s: &Service) {
        use std::fmt::Write;
        let total: u64 = self
            .services
            .iter()
            .filter(|s| s.class == wanopt_proto::Class::Bulk)
            .map(|s| u64::from(s.shaping.share))
            .sum();
        let bw = self.link.bandwidth_bps as f64;
        let part = f64::from(s.shaping.share) / total.max(1) as f64;
        let _ = writeln!(
            o,
            "    share: {}  # {:.0}% of a full link while every bulk service has data (about {:.1} Mbit/s of {:.1}{})",
            s.shaping.share,
            part * 100.0,
            part * bw / 1e6,
            bw / 1e6,
            if self.link.bandwidth_stated {
                ""
            } else {
                ", assumed"
            }
        );
        for (key, rate) in [
            ("min_rate", s.shaping.min_rate),
            ("max_rate", s.shaping.max_rate),
        ] {
            match rate {
                Some(r) => {
                    let _ = writeln!(
                        o,
                        "    {key}: {}bit  # {:.1}% of link.bandwidth",
                        r * 8,
                        (r * 8) as f64 * 100.0 / bw
                    );
                }
                None => {
                    let _ = writeln!(o, "    # {key}: none");
                }
            }
        }
    }

    /// What is valid but probably not what was meant: guarantees that add up to more than the
    /// link (`wanoptd check` prints these; the daemon logs them at start).
    pub fn warnings(&self) -> Vec<String> {
        let mut w = Vec::new();
        let guaranteed: u64 = self
            .services
            .iter()
            .filter_map(|s| s.shaping.min_rate)
            .map(|r| r * 8)
            .sum();
        if guaranteed > self.link.bandwidth_bps {
            w.push(format!(
                "the services' min_rate add up to {guaranteed} bit/s, more than link.bandwidth ({} bit/s{}): \
                 they cannot all hold at once (the service furthest behind its guarantee goes first)",
                self.link.bandwidth_bps,
                if self.link.bandwidth_stated {
                    ""
                } else {
                    ", assumed"
                }
            ));
        }
        for s in &self.services {
            if let Some(max) = s.shaping.max_rate
                && self.link.bandwidth_stated
                && max * 8 >= self.link.bandwidth_bps
            {
                w.push(format!(
                    "service {:?}: max_rate {} bit/s is not below link.bandwidth: it limits nothing",
                    s.name,
                    max * 8
                ));
            }
        }
        w
    }
}
