//! What the stated link bandwidth decides, in one place: the zstd level a config gets when it
//! sets none, and whether the encoder may take the link as its bottleneck from the start
//! instead of measuring it.

use crate::config::LinkSettings;

/// Stated link bandwidth up to which `optimize.zstd_level` defaults to 6 instead of 3.
///
/// A stated link of up to 50 Mbit/s (a T3) leaves a core time for level 6: 41 to 78 MB/s here on
/// redo, WAL, backups and trails (`cargo bench --bench codec`), 2 to 5 times what a full T3
/// needs, for 2 to 6% fewer bytes than level 3 (live WAL: 0.320 against 0.339); faster links
/// keep level 3, about twice as fast.
pub const ZSTD_6_UP_TO_BPS: u64 = 50_000_000;

/// Below this stated bandwidth the link is always the bottleneck: zstd at a few percent of a
/// core always pays, so the encoder does not measure.
pub const WAN_BPS: u64 = 400_000_000;

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
pub fn zstd_range(o: &crate::config::Optimize) -> Option<(i32, i32)> {
    (o.enabled && o.zstd_adapt).then(|| (1, ZSTD_ADAPT_MAX.max(o.codec.zstd_level)))
}

/// True when the stated bandwidth makes the link the bottleneck for good.
pub fn link_bound(link: &LinkSettings) -> bool {
    link.bandwidth_stated && link.bandwidth_bps < WAN_BPS
}
