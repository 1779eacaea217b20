//! Human units in configs and command lines: sizes (`512MiB`, `64k`), rates (`45mbit`, `45 Mbit/s`, `5.625MB/s`),
//! durations (`100ms`, `30s`, `2m`) and probabilities (`0.25%`). Parsing is strict: a value that
//! does not parse is an error, never a default.

use std::time::Duration;

/// Splits `"45mbit"` into `(45.0, "mbit")`.
fn split(s: &str) -> Option<(f64, String)> {
    let s = s.trim();
    let end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(end);
    if num.is_empty() {
        return None;
    }
    let v: f64 = num.parse().ok()?;
    if !v.is_finite() || v < 0.0 {
        return None;
    }
    Some((v, unit.trim().to_ascii_lowercase()))
}

fn checked(v: f64) -> Option<u64> {
    if v.is_finite() && v >= 0.0 && v <= u64::MAX as f64 {
        Some(v.round() as u64)
    } else {
        None
    }
}

/// Parses a byte size. `k`/`m`/`g` and `KiB`/`MiB`/`GiB` are powers of 1024; `KB`/`MB`/`GB` are
/// powers of 1000; a bare number is bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let (v, unit) =
        split(s).ok_or_else(|| format!("{s:?} is not a size (try 512MiB, 64k or 4096)"))?;
    let mult: f64 = match unit.as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        _ => {
            return Err(format!(
                "{s:?}: unknown size unit {unit:?} (use KiB, MiB, GiB, k, m, g)"
            ));
        }
    };
    checked(v * mult).ok_or_else(|| format!("{s:?} is out of range"))
}

/// Parses a rate in bits per second. Bits: `45mbit`, `45 Mbit/s`, `45mbps`, `1gbit`, `64000bps`;
/// bytes (times 8): `5.625MB/s`, `5.625MBps`, `100 Mbyte/s`. The prefix (`k`, `m`, `g`) is
/// read in either case, as networking tools write it; the `b` is not: a lowercase `b` is a bit
/// and a capital `B` a byte, so `mbps` and `MBps` are not the same rate. `mb/s`, which
/// people write for either, is refused as ambiguous.
pub fn parse_rate(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let end = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(end);
    let v: f64 = num
        .parse()
        .ok()
        .filter(|v: &f64| v.is_finite() && *v >= 0.0)
        .ok_or_else(|| format!("{s:?} is not a rate (try 45mbit)"))?;
    let unit = unit.trim();
    let bits_per_unit = rate_unit(unit).map_err(|why| format!("{s:?}: {why}"))?;
    checked(v * bits_per_unit).ok_or_else(|| format!("{s:?} is out of range"))
}

/// Bits per second in one `unit` of a rate (see [`parse_rate`]).
fn rate_unit(unit: &str) -> Result<f64, String> {
    let unknown =
        || format!("unknown rate unit {unit:?} (use kbit, mbit, gbit, or MB/s for bytes)");
    let (scale, rest) = match unit.chars().next() {
        Some('k' | 'K') if unit.len() > 1 => (1e3, &unit[1..]),
        Some('m' | 'M') if unit.len() > 1 => (1e6, &unit[1..]),
        Some('g' | 'G') if unit.len() > 1 => (1e9, &unit[1..]),
        _ => (1.0, unit),
    };
    // `/s` or `ps` says "per second"; `bit` alone is one already.
    let (base, per) = match rest.strip_suffix("/s") {
        Some(b) => (b, "/s"),
        None => match rest.strip_suffix("ps") {
            Some(b) => (b, "ps"),
            None => (rest, ""),
        },
    };
    let bits = match base {
        b if b.eq_ignore_ascii_case("bit") || b.eq_ignore_ascii_case("bits") => 1.0,
        b if (b.eq_ignore_ascii_case("byte") || b.eq_ignore_ascii_case("bytes"))
            && !per.is_empty() =>
        {
            8.0
        }
        "b" if per == "ps" => 1.0,
        "B" if !per.is_empty() => 8.0,
        "b" if per == "/s" => {
            return Err(format!(
                "{unit:?} is ambiguous (bits or bytes?): write {0}bit/s or {0}B/s",
                &unit[..unit.len() - rest.len()]
            ));
        }
        _ => return Err(unknown()),
    };
    Ok(scale * bits)
}

/// Parses a duration: `250us`, `100ms`, `30s`, `2m`, `1h`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let (v, unit) =
        split(s).ok_or_else(|| format!("{s:?} is not a duration (try 100ms or 30s)"))?;
    let secs = match unit.as_str() {
        "us" | "µs" => v / 1e6,
        "ms" => v / 1e3,
        "s" => v,
        "m" | "min" => v * 60.0,
        "h" => v * 3600.0,
        _ => {
            return Err(format!(
                "{s:?}: unknown duration unit {unit:?} (use ms, s, m, h)"
            ));
        }
    };
    Duration::try_from_secs_f64(secs).map_err(|_| format!("{s:?} is out of range"))
}

/// Parses a probability: `0.25%` or a fraction `0.0025`; must be within 0 and 1.
pub fn parse_probability(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let v: f64 = match t.strip_suffix('%') {
        Some(p) => p.trim().parse::<f64>().map(|v| v / 100.0),
        None => t.parse::<f64>(),
    }
    .map_err(|_| format!("{s:?} is not a probability (try 0.25% or 0.0025)"))?;
    if !(0.0..=1.0).contains(&v) {
        return Err(format!("{s:?} must be between 0% and 100%"));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("64k"), Ok(65536));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("1.5 GiB"), Ok(3 << 29));
        assert_eq!(parse_size("2MB"), Ok(2_000_000));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("5 parsecs").is_err());
        assert!(parse_size("-1k").is_err());
        assert!(parse_size("99999999999999999999999g").is_err());
    }

    #[test]
    fn rates() {
        assert_eq!(parse_rate("45mbit"), Ok(45_000_000));
        assert_eq!(parse_rate("1.5gbit"), Ok(1_500_000_000));
        assert_eq!(parse_rate("100MB/s"), Ok(800_000_000));
        assert!(parse_rate("45").is_err());
        // Bits, however the docs' prose and networking tools write them.
        for t in [
            "45 Mbit/s",
            "45mbit/s",
            "45Mbps",
            "45 mbps",
            "45 Mbits/s",
            "45000 kbit",
            "0.045Gbit",
        ] {
            assert_eq!(parse_rate(t), Ok(45_000_000), "{t}");
        }
        assert_eq!(parse_rate("64000bps"), Ok(64_000));
        assert_eq!(parse_rate("64000 bit/s"), Ok(64_000));
        // Bytes: a capital B, or the word.
        for t in ["5.625MB/s", "5.625 MBps", "5.625 Mbyte/s", "5.625 mbytes/s"] {
            assert_eq!(parse_rate(t), Ok(45_000_000), "{t}");
        }
        assert_eq!(parse_rate("1000 B/s"), Ok(8000));
        // A lowercase b over a slash is either: refused, naming both readings.
        let e = parse_rate("45 mb/s").expect_err("ambiguous");
        assert!(e.contains("mbit/s") && e.contains("mB/s"), "{e}");
        for t in ["45MB", "45 bytes", "45 furlongs", "45 m", "mbit", "-1mbit"] {
            assert!(parse_rate(t).is_err(), "{t}");
        }
    }

    #[test]
    fn probabilities() {
        assert_eq!(parse_probability("0.25%"), Ok(0.0025));
        assert_eq!(parse_probability("0.5"), Ok(0.5));
        assert!(parse_probability("150%").is_err());
        assert!(parse_probability("lots").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("100ms"), Ok(Duration::from_millis(100)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("1e400s").is_err());
    }
}
