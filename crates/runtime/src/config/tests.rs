//! Config parsing: defaults, every error naming its field, and describe round trips.
use std::time::Duration;

use wanopt_proto::{Compression, Scope, StreamPolicy};

use super::*;

#[test]
fn optimize_defaults_and_per_service_overrides() {
    let c = parse("").expect("valid");
    assert!(c.optimize.enabled);
    assert_eq!(c.optimize.codec.cache_bytes, 256 << 20);
    assert_eq!(c.optimize.default, StreamPolicy::default());
    let c = parse(
        "optimize:\n  memory: 1GiB\n  chunk: 16KiB\n  compression: lz4\n  dedup_scope: service\nservices:\n  - name: dg\n    listen: 127.0.0.1:1522\n    class: latency\n    compression: none\n    dedup: off\n  - name: rman\n    target: db:1521\n    dedup: true\n",
    )
    .expect("valid");
    assert_eq!(c.optimize.codec.cache_bytes, 1 << 30);
    assert_eq!(c.optimize.codec.avg_chunk, 16 * 1024);
    assert_eq!(
        c.services[0].policy,
        StreamPolicy {
            compression: Compression::None,
            dedup: false,
            scope: Scope::Service
        }
    );
    assert_eq!(
        c.services[1].policy,
        StreamPolicy {
            compression: Compression::Lz4,
            dedup: true,
            scope: Scope::Service
        }
    );
    let d = c.describe();
    assert!(
        d.contains("dedup_scope: service") && d.contains("compression: none"),
        "{d}"
    );
    assert_eq!(field_err("optimize:\n  chunk: 100\n"), "optimize.chunk");
    assert_eq!(
        field_err("optimize:\n  compression: gzip\n"),
        "optimize.compression"
    );
    assert_eq!(
        field_err("optimize:\n  zstd_level: 40\n"),
        "optimize.zstd_level"
    );
    assert_eq!(field_err("optimize:\n  dedup: maybe\n"), "optimize.dedup");
    for bad in ["3MiB", "512KiB", "256MiB", "lots"] {
        assert_eq!(
            field_err(&format!("optimize:\n  context_window: {bad}\n")),
            "optimize.context_window",
            "{bad}"
        );
    }
    assert_eq!(
        field_err("optimize:\n  context_streams: 0\n"),
        "optimize.context_streams"
    );
    for bad in ["lots", "-1", "65GiB"] {
        assert_eq!(
            field_err(&format!("optimize:\n  delta_memory: {bad}\n")),
            "optimize.delta_memory"
        );
    }
    let delta = |extra: &str| parse(extra).expect("parses").optimize.codec.delta_bytes;
    assert_eq!(delta(""), wanopt_codec::delta::DEFAULT_STORE as u64);
    assert_eq!(delta("optimize:\n  delta_memory: off\n"), 0);
    assert_eq!(delta("optimize:\n  delta_memory: 1GiB\n"), 1 << 30);
    let long = |extra: &str| parse(extra).expect("parses").optimize.codec.long_context;
    assert_eq!(long(""), Some(wanopt_proto::LongContext::default()));
    assert_eq!(long("optimize:\n  context_window: off\n"), None);
    assert_eq!(
        long("optimize:\n  context_window: 64MiB\n  context_streams: 2\n"),
        Some(wanopt_proto::LongContext {
            window_log: 26,
            streams: 2
        })
    );
    let off = parse("optimize:\n  context_window: off\n").expect("parses");
    assert_eq!(
        Config::parse(&off.describe(), Path::new("/etc/wanopt/west.yaml"))
            .expect("describe parses"),
        off
    );
    assert_eq!(
        field_err("services:\n  - name: a\n    target: x:1\n    dedup_scope: global\n"),
        "services[0].dedup_scope"
    );
    assert!(parse("optimize:\n  bogus: 1\n").is_err());
}

const MIN: &str = "site: west\nlink:\n  connect: 127.0.0.1:7400\n  peer: east\ntls:\n  ca: certs/ca.pem\n  cert: certs/west.pem\n  key: certs/west.key\n";

fn parse(extra: &str) -> Result<Config, ConfigError> {
    Config::parse(&format!("{MIN}{extra}"), Path::new("/etc/wanopt/west.yaml"))
}

fn field_err(extra: &str) -> String {
    match parse(extra) {
        Err(ConfigError::Field { field, .. }) => field,
        other => panic!("expected a field error, got {other:?}"),
    }
}

#[test]
fn the_delta_bases_reach_as_far_back_as_the_disk_tier() {
    let delta_disk = |extra: &str| {
        parse(extra)
            .expect("parses")
            .optimize
            .disk
            .map(|d| d.delta_bytes)
    };
    assert_eq!(delta_disk(""), None);
    // By default as far as the shared cache's files, when they hold more than the memory.
    assert_eq!(
        delta_disk("optimize:\n  disk:\n    bytes: 8GiB\n"),
        Some(8 << 30)
    );
    assert_eq!(
        delta_disk("optimize:\n  memory: 32MiB\n  disk:\n    bytes: 64MiB\n"),
        Some(0)
    );
    assert_eq!(
        delta_disk("optimize:\n  disk:\n    bytes: 8GiB\n    delta_bytes: 0\n"),
        Some(0)
    );
    assert_eq!(
        delta_disk("optimize:\n  delta_memory: off\n  disk:\n    bytes: 8GiB\n"),
        Some(0)
    );
    // On its own: a disk tier for the bases alone.
    assert_eq!(
        delta_disk("optimize:\n  disk:\n    delta_bytes: 2GiB\n"),
        Some(2 << 30)
    );
    for bad in [
        "optimize:\n  disk:\n    delta_bytes: 1MiB\n",
        "optimize:\n  disk:\n    delta_bytes: 300MiB\n",
        "optimize:\n  disk:\n    delta_bytes: lots\n",
        "optimize:\n  delta_memory: off\n  disk:\n    delta_bytes: 2GiB\n",
    ] {
        assert_eq!(field_err(bad), "optimize.disk.delta_bytes", "{bad}");
    }
    let c = parse("optimize:\n  disk:\n    bytes: 8GiB\n").expect("valid");
    assert!(
        c.describe().contains("delta_bytes: 8589934592"),
        "{}",
        c.describe()
    );
}

#[test]
fn the_disk_tier_is_checked_and_its_key_read() {
    let c = parse("").expect("valid");
    assert!(c.optimize.disk.is_none() && c.optimize.codec.disk_bytes == 0);
    let c = parse("optimize:\n  disk:\n    bytes: 8GiB\n").expect("valid");
    assert_eq!(c.optimize.codec.disk_bytes, 8 << 30);
    assert_eq!(c.optimize.codec.service_disk_bytes, 1 << 30);
    assert_eq!(
        c.optimize.disk.as_ref().map(|d| d.checkpoint),
        Some(Duration::from_secs(60))
    );
    assert!(c.describe().contains("disk:"), "{}", c.describe());
    // The disk tier must hold what memory does.
    assert_eq!(
        field_err("optimize:\n  memory: 1GiB\n  disk:\n    bytes: 1GiB\n"),
        "optimize.disk.bytes"
    );
    assert_eq!(
        field_err("optimize:\n  disk:\n    bytes: 1MiB\n"),
        "optimize.disk.bytes"
    );
    assert_eq!(
        field_err("optimize:\n  disk:\n    bytes: 1GiB\n    checkpoint: 1ms\n"),
        "optimize.disk.checkpoint"
    );
    assert_eq!(
        field_err("optimize:\n  disk:\n    key_file: k\n"),
        "optimize.disk.key_file"
    );
    assert!(parse("optimize:\n  disk:\n    size: 1GiB\n").is_err());
    // Keys: 32 raw bytes or 64 hex digits; anything else, or a missing file, names the field.
    let dir = tempfile::tempdir().expect("tempdir");
    let raw = dir.path().join("raw.key");
    write_key(&raw, &[7u8; 32]);
    let hex = dir.path().join("hex.key");
    write_key(&hex, format!("{}\n", "07".repeat(32)).as_bytes());
    let short = dir.path().join("short.key");
    write_key(&short, b"secret");
    // A key others can read is refused, with the command that fixes it.
    let open = dir.path().join("open.key");
    std::fs::write(&open, [7u8; 32]).expect("write");
    std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o644))
        .expect("chmod");
    for (k, ok) in [
        (&raw, true),
        (&hex, true),
        (&short, false),
        (&open, false),
        (&dir.path().join("none"), false),
    ] {
        let y = format!(
            "optimize:\n  disk:\n    bytes: 1GiB\n    key_file: {}\n",
            k.display()
        );
        match parse(&y) {
            Ok(c) => {
                assert!(ok, "{k:?}");
                assert_eq!(c.optimize.disk.and_then(|d| d.key), Some([7u8; 32]));
            }
            Err(e) => {
                assert!(!ok, "{k:?}: {e}");
                assert_eq!(field_err(&y), "optimize.disk.key_file");
            }
        }
    }
}

#[test]
fn zstd_level_defaults_by_the_stated_bandwidth() {
    let level = |link: &str, extra: &str| {
        let y = MIN.replace("  peer: east\n", &format!("  peer: east\n{link}"));
        Config::parse(&format!("{y}{extra}"), Path::new("/etc/wanopt/west.yaml"))
            .expect("valid")
            .optimize
            .codec
            .zstd_level
    };
    assert_eq!(level("", ""), 3, "no bandwidth stated");
    assert_eq!(level("  bandwidth: 45mbit\n", ""), 6);
    assert_eq!(level("  bandwidth: 50mbit\n", ""), 6);
    assert_eq!(level("  bandwidth: 100mbit\n", ""), 3);
    let set = "optimize:\n  zstd_level: 2\n";
    assert_eq!(level("  bandwidth: 45mbit\n", set), 2);
}

#[test]
fn minimal_config_gets_defaults_and_resolved_paths() {
    let c = parse("").expect("valid");
    assert_eq!(c.link.congestion, "bbr");
    assert_eq!(c.link.bandwidth_bps, 45_000_000);
    assert_eq!(c.link.bdp_bytes(), 562_500);
    assert_eq!(c.tls.ca, PathBuf::from("/etc/wanopt/certs/ca.pem"));
    assert_eq!(c.link.send_buffer, BufferSize::Auto);
    assert_eq!(
        c.link.max_rate_bps, None,
        "no pacing unless the bandwidth is stated"
    );
    assert!(c.link.latency_lane);
    assert_eq!(c.link.lane_congestion, "cubic");
    assert!(c.describe().contains("congestion: bbr"));
}

#[test]
fn unknown_keys_are_errors_naming_the_key() {
    let e = parse("bogus: 1\n").expect_err("unknown key");
    assert!(e.to_string().contains("bogus"), "{e}");
    let e = Config::parse(
        &MIN.replace("peer: east", "peer: east\n  speed: 1"),
        Path::new("x.yaml"),
    )
    .expect_err("unknown");
    assert!(e.to_string().contains("speed"), "{e}");
}

/// Writes a key file private to its owner, as the daemon requires.
fn write_key(p: &Path, data: &[u8]) {
    std::fs::write(p, data).expect("write key");
    std::fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .expect("chmod key");
}

#[test]
fn bad_values_name_their_field() {
    assert_eq!(
        field_err("services:\n  - name: dg\n    listen: nowhere\n"),
        "services[0].listen"
    );
    assert_eq!(
        field_err("services:\n  - name: dg\n    target: db:0\n"),
        "services[0].target"
    );
    assert_eq!(
        field_err("services:\n  - name: DG\n    target: db:1521\n"),
        "services[0].name"
    );
    assert_eq!(
        field_err("services:\n  - name: dg\n    target: db:1521\n    class: fast\n"),
        "services[0].class"
    );
    assert_eq!(
        field_err("services:\n  - name: dg\n    listen: 127.0.0.1:1\n    allow: [banana]\n"),
        "services[0].allow[0]"
    );
    assert_eq!(
        field_err("services:\n  - name: dg\n    target: a:1\n  - name: dg\n    target: b:1\n"),
        "services[1].name"
    );
    assert_eq!(field_err("services:\n  - name: dg\n"), "services[0]");
    assert_eq!(
        field_err("limits:\n  stream_window: 1\n"),
        "limits.stream_window"
    );
    assert_eq!(
        field_err("limits:\n  max_handshakes: 0\n"),
        "limits.max_handshakes"
    );
    assert_eq!(
        field_err("limits:\n  max_handshakes: 10\n  handshakes_per_source: 11\n"),
        "limits.handshakes_per_source"
    );
    assert_eq!(
        field_err("limits:\n  max_streams: 8\n  latency_reserve: 8\n"),
        "limits.latency_reserve"
    );
    assert_eq!(
        field_err(
            "limits:\n  max_streams: 16\nservices:\n  - {name: a, target: 'b:1', max_streams: 16}\n"
        ),
        "services[0].max_streams"
    );
    assert_eq!(
        field_err("services:\n  - {name: a, target: 'b:1', max_streams_per_client: 2}\n"),
        "services[0].max_streams_per_client"
    );
    assert_eq!(
        field_err("services:\n  - {name: a, target: 'b:1', idle_timeout: 0s}\n"),
        "services[0].idle_timeout"
    );
    let c = parse(
        "limits:\n  max_streams: 16\nservices:\n  - {name: a, target: 'b:1', idle_timeout: 'off'}\n  - {name: d, listen: '127.0.0.1:1', class: latency}\n",
    )
    .expect("valid");
    assert_eq!(c.limits.latency_reserve, 1);
    assert_eq!(
        (c.services[0].max_streams, c.services[0].idle_timeout),
        (15, None)
    );
    assert_eq!(
        (
            c.services[1].max_streams,
            c.services[1].max_streams_per_client
        ),
        (16, 16)
    );
    assert_eq!(c.services[1].idle_timeout, Some(Duration::from_secs(3600)));
    // Redundancy: latency services only, auto by default; the link takes the most asked for.
    use crate::redundancy::Redundancy;
    assert_eq!(
        field_err("services:\n  - {name: a, target: 'b:1', redundancy: 2}\n"),
        "services[0].redundancy"
    );
    assert_eq!(
        field_err("services:\n  - {name: a, target: 'b:1', class: latency, redundancy: 6}\n"),
        "services[0].redundancy"
    );
    assert_eq!(c.services[1].redundancy, Redundancy::Auto);
    assert_eq!(c.redundancy(), Redundancy::Auto);
    let c = parse(
        "services:\n  - {name: a, target: 'b:1', class: latency, redundancy: off}\n  - {name: b, target: 'b:2', class: latency, redundancy: 'off'}\n",
    )
    .expect("valid");
    assert_eq!(c.redundancy(), Redundancy::Off);
    let c = parse(
        "services:\n  - {name: a, target: 'b:1', class: latency, redundancy: off}\n  - {name: b, target: 'b:2', class: latency, redundancy: 3}\n",
    )
    .expect("valid");
    assert_eq!(c.redundancy(), Redundancy::Copies(3));
    let c = parse("limits:\n  max_handshakes: 4\n").expect("valid");
    assert_eq!(
        (c.limits.max_handshakes, c.limits.handshakes_per_source),
        (4, 4)
    );
    assert_eq!(field_err("log:\n  level: loud\n"), "log.level");
    assert_eq!(field_err("admin:\n  listen: localhost\n"), "admin.listen");
    // A listener that the network reaches names who may use it.
    assert_eq!(field_err("admin:\n  listen: 0.0.0.0:9400\n"), "admin.allow");
    assert_eq!(
        field_err("admin:\n  listen: 10.1.1.1:9400\n  allow: []\n"),
        "admin.allow"
    );
    assert_eq!(
        field_err("services:\n  - name: dg\n    listen: '[::]:1522'\n"),
        "services[0].allow"
    );
    let c = parse("admin:\n  listen: 0.0.0.0:9400\n  allow: [10.0.0.0/8]\n").expect("valid");
    let allow = c.admin.expect("admin").allow;
    assert!(crate::config::allowed(
        &allow,
        "10.9.9.9".parse().expect("ip")
    ));
    assert!(crate::config::allowed(
        &allow,
        "::ffff:10.9.9.9".parse().expect("ip")
    ));
    assert!(!crate::config::allowed(
        &allow,
        "192.168.0.1".parse().expect("ip")
    ));
    let many: String = (0..=MAX_SERVICES)
        .map(|i| format!("  - name: s{i}\n    target: x:{}\n", i + 1))
        .collect();
    assert_eq!(field_err(&format!("services:\n{many}")), "services");
    let e = Config::parse(
        &MIN.replace(
            "connect: 127.0.0.1:7400",
            "connect: 127.0.0.1:7400\n  bandwidth: fast",
        ),
        Path::new("x"),
    )
    .expect_err("bad");
    assert!(
        matches!(e, ConfigError::Field { ref field, .. } if field == "link.bandwidth"),
        "{e}"
    );
    let e = Config::parse(
        &MIN.replace(
            "connect: 127.0.0.1:7400",
            "connect: 127.0.0.1:7400\n  listen: 0.0.0.0:1",
        ),
        Path::new("x"),
    )
    .expect_err("bad");
    assert!(
        matches!(e, ConfigError::Field { ref field, .. } if field == "link"),
        "{e}"
    );
}

#[test]
fn link_rate_and_lane_settings() {
    let with = |extra: &str| {
        Config::parse(
            &MIN.replace("peer: east", &format!("peer: east\n{extra}")),
            Path::new("x.yaml"),
        )
    };
    let c = with("  max_rate: off\n  latency_lane: false\n  lane_congestion: reno").expect("valid");
    assert_eq!(c.link.max_rate_bps, None);
    assert!(!c.link.latency_lane);
    assert_eq!(c.link.lane_congestion, "reno");
    assert_eq!(
        with("  max_rate: 30mbit").expect("valid").link.max_rate_bps,
        Some(30_000_000)
    );
    assert_eq!(
        with("  bandwidth: 45mbit")
            .expect("valid")
            .link
            .max_rate_bps,
        Some(42_750_000)
    );
    for (extra, field) in [
        ("  max_rate: warp", "link.max_rate"),
        ("  lane_congestion: \"b b r\"", "link.lane_congestion"),
    ] {
        match with(extra) {
            Err(ConfigError::Field { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{extra}: {other:?}"),
        }
    }
}

#[test]
fn services_both_ways() {
    let c = parse("services:\n  - name: dg\n    listen: 127.0.0.1:1522\n    allow: [10.0.0.0/8, 192.168.1.7]\n    class: latency\n  - name: rman\n    target: standby.example:1521\n").expect("valid");
    assert_eq!(c.services.len(), 2);
    assert_eq!(c.services[0].class, Class::Latency);
    match &c.services[0].kind {
        ServiceKind::Listen { allow, .. } => assert_eq!(allow.len(), 2),
        other => panic!("{other:?}"),
    }
}

/// `describe` writes what `parse` reads back to the same config.
fn assert_round_trip(c: &Config) {
    let text = c.describe();
    let back = Config::parse(&text, &c.path)
        .unwrap_or_else(|e| panic!("describe does not parse back: {e}\n{text}"));
    assert_eq!(&back, c, "{text}");
}

#[test]
fn every_shipped_config_describes_itself_exactly() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).expect("config dir").flatten() {
        let p = e.path();
        // prometheus-rules.yaml is Prometheus's (tests/metrics.rs loads it).
        let rules = p.file_name().is_some_and(|n| n == "prometheus-rules.yaml");
        if p.extension().is_some_and(|x| x == "yaml") && !rules {
            assert_round_trip(&Config::load(&p).expect("shipped config loads"));
            n += 1;
        }
    }
    assert!(n >= 2, "the west/east pair");
}

#[test]
fn configs_with_every_option_describe_themselves_exactly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let key = dir.path().join("cache key");
    write_key(&key, &[9u8; 32]);
    let every = format!(
        "site: west\nlink:\n  listen: '[::1]:7400'\n  peer: east\n  bandwidth: 1.5gbit\n  rtt: 250us\n  congestion: cubic\n  send_buffer: 16MiB\n  recv_buffer: 8MiB\n  notsent_lowat: 64k\n  keepalive: 1500ms\n  user_timeout: 2m\n  reconnect_min: 50ms\n  reconnect_max: 5m\n  latency_lane: false\n  lane_congestion: reno\n  max_rate: 900mbit\ntls: {{ca: /etc/wanopt/ca.pem, cert: c.pem, key: k.key}}\nservices:\n  - name: dg\n    listen: '[::1]:1522'\n    allow: [10.0.0.0/8, 192.168.1.7, '::1']\n    class: latency\n    compression: none\n    dedup: off\n  - name: rman\n    target: standby.example:1521\n    compression: zstd\n    dedup_scope: service\noptimize:\n  enabled: true\n  memory: 1GiB\n  service_memory: 128MiB\n  chunk: 16KiB\n  zstd_level: 9\n  zstd_adapt: off\n  context_window: 32MiB\n  context_streams: 4\n  delta_memory: 512MiB\n  compression: lz4\n  dedup: on\n  dedup_scope: link\n  disk:\n    bytes: 8GiB\n    service_bytes: 1GiB\n    key_file: '{}'\n    checkpoint: 90s\nadmin:\n  listen: 127.0.0.1:9400\nstate_dir: /var/lib/wanopt west\nlog:\n  level: debug\nlimits:\n  max_streams: 100\n  stream_window: 2MiB\n  link_window: 32MiB\n  stream_buffer: 1MiB\n  shutdown_grace: 0s\n  connect_timeout: 3s\n  link_wait: 0s\n  handshake_timeout: 2s\n  idle_timeout: 10s\n  threads: 4\n",
        key.display()
    );
    let path = Path::new("/etc/wanopt/west.yaml");
    let c = Config::parse(&every, path).expect("valid");
    assert!(
        c.optimize
            .disk
            .as_ref()
            .is_some_and(|d| d.key == Some([9u8; 32]))
    );
    assert_round_trip(&c);
    // Each default alone, and each section's variants.
    for extra in [
        "",
        "optimize:\n  enabled: false\n",
        "optimize:\n  disk:\n    bytes: 1GiB\n",
        "optimize:\n  memory: 0\n  dedup: off\n",
        "services:\n  - name: a\n    listen: 0.0.0.0:1\n    allow: [0.0.0.0/0]\n  - name: b\n    target: x:2\n    class: latency\n",
        "admin:\n  listen: 10.1.1.1:9400\n  allow: [10.2.0.0/16, 10.3.3.3]\n",
        "limits:\n  idle_timeout: 1h\n  shutdown_grace: 1500us\n",
    ] {
        assert_round_trip(&parse(extra).expect("valid"));
    }
    let listening = MIN.replace("connect: 127.0.0.1:7400", "listen: 127.0.0.1:7400");
    let y = listening.replace(
        "  peer: east\n",
        "  peer: east\n  allow: [192.0.2.10, '2001:db8::/64']\n",
    );
    assert_round_trip(&Config::parse(&y, path).expect("valid"));
    for link in [
        "  bandwidth: 10mbit\n",
        "  max_rate: off\n",
        "  bandwidth: 1gbit\n  max_rate: auto\n",
    ] {
        let y = MIN.replace("  peer: east\n", &format!("  peer: east\n{link}"));
        assert_round_trip(&Config::parse(&y, path).expect("valid"));
    }
}

#[test]
fn enums_read_and_write_the_same_words() {
    // (Compression's words are the codec's, tested there.)
    for c in [Class::Latency, Class::Bulk] {
        assert_eq!(c.to_string().parse::<Class>(), Ok(c));
    }
    for s in [Scope::Link, Scope::Service] {
        assert_eq!(s.to_string().parse::<Scope>(), Ok(s));
    }
    for b in [BufferSize::Auto, BufferSize::Bytes(65536)] {
        assert_eq!(b.to_string().parse::<BufferSize>(), Ok(b));
    }
    assert!("gzip".parse::<Compression>().is_err());
}

#[test]
fn garbage_is_an_error_not_a_panic() {
    for text in [
        "",
        "[",
        "site: [1,2",
        "\u{0}\u{1}",
        "site: 5\nlink: 3\n",
        &"a: ".repeat(10_000),
    ] {
        assert!(Config::parse(text, Path::new("x")).is_err());
    }
}

/// The dotted keys with values in `describe`'s output (`services[].name` for list items).
fn described_keys(text: &str) -> Vec<String> {
    let mut stack: Vec<(usize, String)> = Vec::new();
    let mut keys = Vec::new();
    for line in text.lines() {
        let code = line.split(" #").next().unwrap_or("").trim_end();
        if code.trim().is_empty() || code.trim_start().starts_with('#') {
            continue;
        }
        let mut indent = code.len() - code.trim_start().len();
        let mut rest = code.trim_start();
        if let Some(item) = rest.strip_prefix("- ") {
            // A list item: its keys are the list's, as `list[]`.
            indent += 2;
            rest = item;
            if let Some(top) = stack.last_mut()
                && !top.1.ends_with("[]")
            {
                top.1.push_str("[]");
            }
        }
        let Some((key, value)) = rest.split_once(':') else {
            continue;
        };
        stack.retain(|(i, _)| *i < indent);
        let path: Vec<&str> = stack.iter().map(|(_, k)| k.as_str()).chain([key]).collect();
        // Sections (a key with nothing after it) hold keys; only those with values count.
        if !value.trim().is_empty() {
            keys.push(path.join("."));
        }
        stack.push((indent, key.to_string()));
    }
    keys
}

/// docs/configuration.md names every key `wanoptd check` prints: a key is there in backticks,
/// or its last part is, in a table row that names its section (`services[].compression`,
/// `dedup`).
/// `link.allow` is for the listening side, and each entry is checked.
#[test]
fn link_allow_lists_networks_on_the_listening_side_only() {
    let path = Path::new("/etc/wanopt/west.yaml");
    let listening = MIN.replace("connect: 127.0.0.1:7400", "listen: 127.0.0.1:7400");
    let listen = listening.replace(
        "  peer: east\n",
        "  peer: east\n  allow: [192.0.2.10, 10.0.0.0/8]\n",
    );
    let c = Config::parse(&listen, path).expect("valid");
    assert_eq!(c.link.allow.len(), 2);
    let bad = listening.replace("  peer: east\n", "  peer: east\n  allow: [10.0.0.0/33]\n");
    let e = Config::parse(&bad, path).expect_err("bad net").to_string();
    assert!(e.contains("link.allow[0]"), "{e}");
    let dial = MIN.replace("  peer: east\n", "  peer: east\n  allow: [10.0.0.0/8]\n");
    let e = Config::parse(&dial, path)
        .expect_err("connect side")
        .to_string();
    assert!(
        e.contains("link.allow") && e.contains("link.listen only"),
        "{e}"
    );
}

#[test]
fn the_configuration_reference_names_every_key() {
    let doc = include_str!("../../../../docs/configuration.md");
    let c = parse(
        "admin:\n  listen: 127.0.0.1:9400\noptimize:\n  disk:\n    bytes: 4GiB\nservices:\n  - {name: dg, listen: '127.0.0.1:1522', class: latency, redundancy: 2}\n  - {name: rman, target: 'db:1521', idle_timeout: 'off'}\n",
    )
    .expect("valid");
    let keys = described_keys(&c.describe());
    assert!(keys.len() > 50, "{keys:?}");
    let rows: Vec<&str> = doc.lines().filter(|l| l.starts_with("| `")).collect();
    for key in keys.iter().filter(|k| k.contains('.')) {
        let (parent, leaf) = key.rsplit_once('.').expect("dotted");
        let named = doc.contains(&format!("`{key}`"))
            || rows.iter().any(|r| {
                let first = r.split(" | ").next().unwrap_or("");
                first.contains(&format!("`{parent}.")) && first.contains(&format!("`{leaf}`"))
            });
        assert!(named, "docs/configuration.md does not name `{key}`");
    }
}

/// Shares, guarantees and ceilings: bulk services only, rates in bits or a percentage of a
/// stated bandwidth, the guarantee not above the ceiling; `check` prints them back and warns
/// where the guarantees add up to more than the link.
#[test]
fn services_share_the_link_by_share_min_rate_and_max_rate() {
    let stated = |extra: &str| {
        let text = MIN.replace("  peer: east\n", "  peer: east\n  bandwidth: 45mbit\n") + extra;
        Config::parse(&text, std::path::Path::new("/etc/wanopt/west.yaml"))
    };
    let c = stated(
        "services:\n  - {name: redo, target: 'db:1521', share: 4, min_rate: 20%}\n  - {name: rman, listen: '127.0.0.1:1523', max_rate: 30mbit}\n  - {name: http, listen: '127.0.0.1:1524'}\n",
    )
    .expect("valid");
    let redo = c.services[0].shaping;
    assert_eq!(
        (redo.share, redo.min_rate, redo.max_rate),
        (4, Some(9_000_000 / 8), None)
    );
    assert_eq!(c.services[1].shaping.max_rate, Some(30_000_000 / 8));
    assert_eq!(c.services[2].shaping, wanopt_proto::Shaping::default());
    assert!(c.warnings().is_empty(), "{:?}", c.warnings());
    let d = c.describe();
    assert!(
        d.contains("share: 4  # 67% of a full link") && d.contains("min_rate: 9000000bit"),
        "{d}"
    );
    let again =
        Config::parse(&d, std::path::Path::new("/etc/wanopt/west.yaml")).expect("reads back");
    let shapes = |c: &Config| c.services.iter().map(|s| s.shaping).collect::<Vec<_>>();
    assert_eq!(shapes(&again), shapes(&c));
    // Guarantees above the link are allowed, and warned about.
    let over = stated(
        "services:\n  - {name: a, target: 'db:1', min_rate: 30mbit}\n  - {name: b, target: 'db:2', min_rate: 60%}\n",
    )
    .expect("valid");
    assert!(
        over.warnings()
            .iter()
            .any(|w| w.contains("min_rate add up to 57000000")),
        "{:?}",
        over.warnings()
    );
    let bad = |extra: &str| match stated(extra) {
        Err(ConfigError::Field { field, msg, .. }) => format!("{field}: {msg}"),
        other => panic!("expected a field error, got {other:?}"),
    };
    for (svc, field) in [
        ("{name: a, target: 'db:1', share: 0}", "services[0].share"),
        ("{name: a, target: 'db:1', share: 101}", "services[0].share"),
        (
            "{name: a, target: 'db:1', min_rate: 120%}",
            "services[0].min_rate",
        ),
        (
            "{name: a, target: 'db:1', max_rate: fast}",
            "services[0].max_rate",
        ),
        (
            "{name: a, target: 'db:1', max_rate: 1kbit}",
            "services[0].max_rate",
        ),
        (
            "{name: a, target: 'db:1', min_rate: 20mbit, max_rate: 10mbit}",
            "services[0].min_rate",
        ),
        (
            "{name: a, target: 'db:1', class: latency, share: 2}",
            "services[0].share",
        ),
        (
            "{name: a, target: 'db:1', class: latency, max_rate: 1mbit}",
            "services[0].max_rate",
        ),
    ] {
        let e = bad(&format!("services:\n  - {svc}\n"));
        assert!(e.starts_with(field), "{svc}: {e}");
    }
    // A percentage needs the bandwidth it is of.
    assert_eq!(
        field_err("services:\n  - {name: a, target: 'db:1', min_rate: 20%}\n"),
        "services[0].min_rate"
    );
}

/// The minimal config with `link.KEY: V` added, parsed.
fn with_link(key: &str, v: &str) -> Result<Config, ConfigError> {
    let text = MIN.replace("  peer: east\n", &format!("  peer: east\n  {key}: {v}\n"));
    Config::parse(&text, std::path::Path::new("/etc/wanopt/west.yaml"))
}

/// A duration of the `link` section, `off` spelled out: its value at 20ms and off, the field
/// named for each bad value, and the effective config printed back with it.
fn duration_or_off(key: &str, of: fn(&Config) -> Option<Duration>, bad: &[&str]) -> Config {
    let twenty = with_link(key, "20ms").expect("valid");
    assert_eq!(of(&twenty), Some(Duration::from_millis(20)));
    assert_eq!(of(&with_link(key, "off").expect("valid")), None);
    for b in bad {
        match with_link(key, b) {
            Err(ConfigError::Field { field, .. }) => assert_eq!(field, format!("link.{key}")),
            other => panic!("{b}: {other:?}"),
        }
    }
    twenty
}

/// The latency lane's least retransmission timeout: `auto` (10 ms on a WAN of 40 ms or more,
/// else the kernel's) unless set, 5-200 ms, `off` spelled out; only a stated one is warned
/// about on a kernel that cannot take it.
#[test]
fn the_lane_rto_min_is_auto_unless_set_and_bounded() {
    let ten = Some(Duration::from_millis(10));
    let default = parse("").expect("valid").link;
    assert_eq!(
        (default.lane_rto_min, default.lane_rto_min_auto),
        (ten, true)
    );
    let auto = with_link("lane_rto_min", "auto").expect("valid");
    assert_eq!(
        (auto.link.lane_rto_min, auto.link.lane_rto_min_auto),
        (ten, true)
    );
    assert!(auto.describe().contains("lane_rto_min: auto  # 10ms"));
    for (rtt, floor) in [("39ms", None), ("40ms", ten), ("600ms", ten)] {
        let c = with_link("rtt", rtt).expect("valid");
        assert_eq!(c.link.lane_rto_min, floor, "rtt {rtt}");
    }
    let off = with_link("lane_rto_min", "off").expect("valid");
    assert!(!off.link.lane_rto_min_auto);
    assert!(off.describe().contains("lane_rto_min: off"));
    let c = duration_or_off(
        "lane_rto_min",
        |c| c.link.lane_rto_min,
        &["1ms", "1s", "soon"],
    );
    assert!(!c.link.lane_rto_min_auto);
    let d = c.describe();
    assert!(d.contains("lane_rto_min: 20ms"), "{d}");
}

/// The queue bulk may add while latency services are busy: 5 ms unless set, 1-100 ms, `off`
/// spelled out; `check` says when it cannot act (no pacing cap).
#[test]
fn the_latency_queue_is_bounded_and_said_to_need_a_pacing_cap() {
    let default = parse("").expect("valid");
    assert_eq!(default.link.latency_queue, Some(Duration::from_millis(5)));
    let c = duration_or_off(
        "latency_queue",
        |c| c.link.latency_queue,
        &["0ms", "1s", "soon"],
    );
    let d = c.describe();
    let line = d
        .lines()
        .find(|l| l.contains("latency_queue: 20ms"))
        .unwrap_or_else(|| panic!("{d}"));
    let paced = default.link.max_rate_bps.is_some();
    assert_eq!(line.contains("no effect"), !paced, "{line}");
}

/// `limits.threads` left out: one thread on hosts of one or two cores (where the pool lost to
/// one thread, `cargo bench --bench threads`), the host's cores above that, at most 64.
#[test]
fn the_default_threads_never_add_a_pool_to_a_small_host() {
    assert_eq!(defaults::threads_for(1), 1);
    assert_eq!(defaults::threads_for(2), 1);
    assert_eq!(defaults::threads_for(3), 3);
    assert_eq!(defaults::threads_for(16), 16);
    assert_eq!(defaults::threads_for(200), 64);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert_eq!(defaults::threads(), defaults::threads_for(cores));
}

/// The latency lane's datagrams: `auto` unless set, `on` and `off` spelled out, anything else
/// an error naming the field; `auto` sends with four or more connections; the effective config
/// says which.
#[test]
fn lane_datagrams_are_auto_unless_set() {
    use crate::datagrams::Setting;
    assert_eq!(parse("").expect("valid").link.lane_datagrams, Setting::Auto);
    for (v, s) in [
        ("auto", Setting::Auto),
        ("on", Setting::On),
        ("off", Setting::Off),
    ] {
        let c = with_link("lane_datagrams", v).expect("valid");
        assert_eq!(c.link.lane_datagrams, s);
        assert!(c.describe().contains(&format!("lane_datagrams: {v}  #")));
    }
    match with_link("lane_datagrams", "sometimes") {
        Err(ConfigError::Field { field, .. }) => assert_eq!(field, "link.lane_datagrams"),
        other => panic!("{other:?}"),
    }
    let sends = |s: Setting| (1..=5).filter(|n| s.sends(*n)).collect::<Vec<_>>();
    assert_eq!(sends(Setting::Auto), [4, 5]);
    assert_eq!(sends(Setting::On), [1, 2, 3, 4, 5]);
    assert!(sends(Setting::Off).is_empty());
}
