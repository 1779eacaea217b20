//! The `optimize` section: cache sizes and chunking (announced to the peer in the hello), the
//! compression and its zstd level (by default chosen from the stated bandwidth), the long zstd
//! contexts, delta bases, the default stream policy, and the caches' disk tier.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use wanopt_proto::{CodecSettings, Compression, LongContext, Scope, StreamPolicy};
use wanopt_units::parse_size;

use super::fields::{ConfigError, Ctx, Toggle, defaults, in_range};
use super::link::LinkSettings;

/// Stated link bandwidth up to which `optimize.zstd_level` defaults to 6 instead of 3.
///
/// A stated link of up to 50 Mbit/s (a T3) leaves a core time for level 6: 41 to 78 MB/s here on
/// redo, WAL, backups and trails (`cargo bench --bench codec`), 2 to 5 times what a full T3
/// needs, for 2 to 6% fewer bytes than level 3 (live WAL: 0.320 against 0.339); faster links
/// keep level 3, about twice as fast.
pub const ZSTD_6_UP_TO_BPS: u64 = 50_000_000;

/// The zstd level of a config that sets none.
pub fn default_zstd_level(link: &LinkSettings) -> i32 {
    if link.bandwidth_stated && link.bandwidth_bps <= ZSTD_6_UP_TO_BPS {
        6
    } else {
        3
    }
}

/// The highest level `optimize.zstd_adapt` climbs to unless `optimize.zstd_level` starts higher:
/// above it zstd's tables grow past the long contexts' windows (memory in every context) for
/// little more ratio on database bytes (`cargo bench --bench codec -- --file`: base backup 0.137
/// at 9 against 0.137 at zstd -12; WAL 0.240 against 0.241).
pub const ZSTD_ADAPT_MAX: i32 = 9;

/// The levels the governor moves between, if the config lets it: from 1 to
/// [`ZSTD_ADAPT_MAX`] (or the configured level, if higher).
pub fn zstd_range(o: &Optimize) -> Option<(i32, i32)> {
    (o.enabled && o.zstd_adapt).then(|| (1, ZSTD_ADAPT_MAX.max(o.codec.zstd_level)))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOptimize {
    enabled: Option<bool>,
    memory: Option<String>,
    service_memory: Option<String>,
    chunk: Option<String>,
    compression: Option<String>,
    zstd_level: Option<i32>,
    context_window: Option<String>,
    context_streams: Option<usize>,
    delta_memory: Option<String>,
    zstd_adapt: Option<Toggle>,
    dedup: Option<Toggle>,
    dedup_scope: Option<String>,
    disk: Option<RawDisk>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDisk {
    bytes: Option<String>,
    service_bytes: Option<String>,
    delta_bytes: Option<String>,
    key_file: Option<String>,
    checkpoint: Option<String>,
}

/// The optimization codec's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Optimize {
    /// Off: the link neither offers nor accepts optimized frames; bytes travel as they are.
    pub enabled: bool,
    /// Cache sizes and chunking, announced to the peer in the hello.
    pub codec: CodecSettings,
    /// The policy of services that set none of their own.
    pub default: StreamPolicy,
    /// The caches' disk tier: `None` keeps them in memory only.
    pub disk: Option<DiskTier>,
    /// Move the zstd level with what the link drains (see [`zstd_range`]),
    /// starting at `codec.zstd_level`.
    pub zstd_adapt: bool,
}

/// The disk tier of the chunk caches, under `state_dir/cache/<peer>`.
#[derive(Clone, PartialEq)]
pub struct DiskTier {
    /// How often changed caches are saved (and at shutdown).
    pub checkpoint: Duration,
    /// AES-256-GCM key for chunks at rest, read from `key_file`.
    pub key: Option<[u8; 32]>,
    pub key_file: Option<PathBuf>,
    /// Files behind the sender's store of delta bases (`optimize.delta_memory` in front):
    /// 0 keeps the store in memory only.
    pub delta_bytes: u64,
}

impl std::fmt::Debug for DiskTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskTier")
            .field("checkpoint", &self.checkpoint)
            .field("key_file", &self.key_file)
            .field("delta_bytes", &self.delta_bytes)
            .finish()
    }
}

/// Reads a cache key: 32 bytes, raw or as 64 hexadecimal digits.
fn read_key(path: &Path) -> Result<[u8; 32], String> {
    crate::secure::private_key_file(path)?;
    let raw = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if raw.len() > 4096 {
        return Err(format!("{} is not a 32-byte key", path.display()));
    }
    let text = std::str::from_utf8(&raw).map(str::trim).unwrap_or("");
    let mut key = [0u8; 32];
    if text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit()) {
        for (i, k) in key.iter_mut().enumerate() {
            *k = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).map_err(|e| e.to_string())?;
        }
    } else if raw.len() == 32 {
        key.copy_from_slice(&raw);
    } else {
        return Err(format!(
            "{} must hold 32 bytes, raw or as 64 hex digits (head -c 32 /dev/urandom > FILE)",
            path.display()
        ));
    }
    Ok(key)
}

pub(super) fn parse_optimize(
    cx: &Ctx<'_>,
    ro: Option<&RawOptimize>,
    link: &LinkSettings,
) -> Result<Optimize, ConfigError> {
    let empty = RawOptimize::default();
    let o = ro.unwrap_or(&empty);
    let memory = cx.opt("optimize.memory", &o.memory, defaults::MEMORY, |s| {
        in_range(parse_size(s)?, 0, 64 << 30)
    })?;
    let service_memory = cx.opt(
        "optimize.service_memory",
        &o.service_memory,
        defaults::SERVICE_MEMORY,
        |s| in_range(parse_size(s)?, 0, 64 << 30),
    )?;
    let avg_chunk = cx.opt("optimize.chunk", &o.chunk, defaults::CHUNK, |s| {
        let n = parse_size(s)?;
        let r = wanopt_codec::AVG_CHUNK_RANGE;
        in_range(n, *r.start() as u64, *r.end() as u64)
    })? as usize;
    let zstd_level = match o.zstd_level {
        None => default_zstd_level(link),
        Some(l) => in_range(l, 1, 19).map_err(|m| cx.err("optimize.zstd_level", m))?,
    };
    let long_context = parse_long_context(cx, o)?;
    // The sender's store of delta bases (see wanopt_codec::delta), or off.
    let delta_bytes = cx.opt(
        "optimize.delta_memory",
        &o.delta_memory,
        wanopt_codec::delta::DEFAULT_STORE as u64,
        |s| match s {
            "off" => Ok(0),
            _ => in_range(parse_size(s)?, 0, 64 << 30),
        },
    )?;
    let default = StreamPolicy {
        compression: cx.opt(
            "optimize.compression",
            &o.compression,
            Compression::Adaptive,
            str::parse,
        )?,
        dedup: cx.toggle("optimize.dedup", &o.dedup, true)?,
        scope: cx.opt(
            "optimize.dedup_scope",
            &o.dedup_scope,
            Scope::Link,
            str::parse,
        )?,
    };
    let (disk_bytes, service_disk_bytes, disk) =
        parse_disk(cx, o.disk.as_ref(), memory, service_memory, delta_bytes)?;
    Ok(Optimize {
        enabled: o.enabled.unwrap_or(true),
        codec: CodecSettings {
            cache_bytes: memory,
            service_cache_bytes: service_memory,
            disk_bytes,
            service_disk_bytes,
            avg_chunk,
            zstd_level,
            long_context,
            delta_bytes,
            // Always offered; a peer without them gets a flush per chunk.
            runs: true,
        },
        default,
        disk,
        zstd_adapt: cx.toggle("optimize.zstd_adapt", &o.zstd_adapt, true)?,
    })
}

/// `optimize.context_window` and `optimize.context_streams`: the long zstd contexts of bulk
/// streams (a window of a power of two from 1 MiB to 128 MiB, or `off`) and how many a link
/// keeps at once. Each costs about its window at the receiver (which accepts twice the count
/// while streams end and begin) and its window plus the level's tables at the sender.
fn parse_long_context(cx: &Ctx<'_>, o: &RawOptimize) -> Result<Option<LongContext>, ConfigError> {
    let d = LongContext::default();
    let window = cx.opt(
        "optimize.context_window",
        &o.context_window,
        Some(d.window()),
        |s| {
            if s == "off" {
                return Ok(None);
            }
            let n = parse_size(s)?;
            let r = LongContext::WINDOW_LOG_RANGE;
            if !n.is_power_of_two() || n < 1 << r.start() || n > 1 << r.end() {
                return Err(format!(
                    "must be a power of two from {}MiB to {}MiB (or off)",
                    1u64 << (r.start() - 20),
                    1u64 << (r.end() - 20)
                ));
            }
            Ok(Some(n))
        },
    )?;
    let streams = match o.context_streams {
        None => d.streams,
        Some(n) => in_range(n, 1, LongContext::MAX_STREAMS)
            .map_err(|m| cx.err("optimize.context_streams", m))?,
    };
    Ok(window.map(|w| LongContext {
        window_log: w.trailing_zeros(),
        streams,
    }))
}

/// `optimize.disk`: the byte limits of the shared and per-service disk tiers and of the one
/// behind the store of delta bases (`delta_memory` bytes of memory, 0 when deltas are off), and
/// the tier's settings when any is on.
fn parse_disk(
    cx: &Ctx<'_>,
    rd: Option<&RawDisk>,
    memory: u64,
    service_memory: u64,
    delta_memory: u64,
) -> Result<(u64, u64, Option<DiskTier>), ConfigError> {
    let empty = RawDisk::default();
    let d = rd.unwrap_or(&empty);
    let disk_size = |s: &str| {
        let n = parse_size(s)?;
        if n != 0 && n < 16 << 20 {
            return Err("must be 0 (no disk tier) or at least 16MiB".to_string());
        }
        in_range(n, 0, 1 << 46)
    };
    let disk_bytes = cx.opt("optimize.disk.bytes", &d.bytes, 0, disk_size)?;
    let service_disk_bytes = cx.opt(
        "optimize.disk.service_bytes",
        &d.service_bytes,
        if disk_bytes > 0 {
            (disk_bytes / 8).max(2 * service_memory).max(16 << 20)
        } else {
            0
        },
        disk_size,
    )?;
    // The peer holds no more than its own cache does, so by default the bases reach as far back
    // as a cache like ours (when that is more than their memory).
    let delta_default = if wanopt_codec::cache::disk_capacity(disk_bytes) > delta_memory {
        disk_bytes
    } else {
        0
    };
    let delta_disk_bytes = match (&d.delta_bytes, delta_memory) {
        (Some(s), 0) if s != "0" => {
            return Err(cx.err(
                "optimize.disk.delta_bytes",
                "is set but deltas are off (optimize.delta_memory: off)",
            ));
        }
        (_, 0) => 0,
        _ => cx.opt(
            "optimize.disk.delta_bytes",
            &d.delta_bytes,
            delta_default,
            disk_size,
        )?,
    };
    // The disk tier holds everything memory does, and three quarters of its files are chunks.
    for (field, disk, mem, mem_field) in [
        ("optimize.disk.bytes", disk_bytes, memory, "optimize.memory"),
        (
            "optimize.disk.service_bytes",
            service_disk_bytes,
            service_memory,
            "optimize.service_memory",
        ),
        (
            "optimize.disk.delta_bytes",
            delta_disk_bytes,
            delta_memory,
            "optimize.delta_memory",
        ),
    ] {
        let cap = wanopt_codec::cache::disk_capacity(disk);
        if disk != 0 && cap < mem {
            return Err(cx.err(
                field,
                format!(
                    "{disk} bytes of files hold {cap} bytes of chunks, less than \
                     {mem_field} ({mem}): make it at least 4/3 of that"
                ),
            ));
        }
    }
    if disk_bytes == 0 && service_disk_bytes == 0 && delta_disk_bytes == 0 {
        if let Some(k) = &d.key_file {
            return Err(cx.err(
                "optimize.disk.key_file",
                format!("{k:?} is set but the disk tier is off (optimize.disk.bytes: 0)"),
            ));
        }
        return Ok((0, 0, None));
    }
    let key_file = d.key_file.as_deref().map(|p| cx.resolve(p));
    let key = match &key_file {
        Some(p) => Some(read_key(p).map_err(|m| cx.err("optimize.disk.key_file", m))?),
        None => None,
    };
    let checkpoint = cx.dur(
        "optimize.disk.checkpoint",
        &d.checkpoint,
        defaults::CHECKPOINT,
        Duration::from_millis(100),
        Duration::from_secs(86_400),
    )?;
    Ok((
        disk_bytes,
        service_disk_bytes,
        Some(DiskTier {
            checkpoint,
            key,
            key_file,
            delta_bytes: delta_disk_bytes,
        }),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn cfg(extra: &str) -> Config {
        let y = format!(
            "site: west\nlink: {{connect: 'e:1', peer: east{extra}}}\ntls: {{ca: a, cert: b, key: c}}\n"
        );
        Config::parse(&y, Path::new("w.yaml")).expect("valid")
    }

    /// zstd -6 where a stated WAN leaves a core the time for it, -3 otherwise; the governor
    /// moves between 1 and at least [`ZSTD_ADAPT_MAX`].
    #[test]
    fn the_zstd_level_follows_the_stated_bandwidth() {
        assert_eq!(cfg(", bandwidth: 45mbit").optimize.codec.zstd_level, 6);
        assert_eq!(cfg(", bandwidth: 1gbit").optimize.codec.zstd_level, 3);
        assert_eq!(cfg("").optimize.codec.zstd_level, 3, "an assumed bandwidth");
        let c = cfg(", bandwidth: 45mbit");
        assert_eq!(default_zstd_level(&c.link), 6);
        assert_eq!(
            zstd_range(&c.optimize),
            c.optimize.zstd_adapt.then_some((1, ZSTD_ADAPT_MAX))
        );
        let mut off = c.optimize.clone();
        off.enabled = false;
        assert_eq!(zstd_range(&off), None);
    }
}
