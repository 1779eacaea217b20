//! Human units in configs and command lines: sizes (`512MiB`, `64k`), rates (`45mbit`, `1gbit`),
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

/// Parses a rate into bits per second: `45mbit`, `1.5gbit`, `800kbit`, `10mbps` (bits),
/// `100MB/s` (bytes).
pub fn parse_rate(s: &str) -> Result<u64, String> {
    let (v, unit) = split(s).ok_or_else(|| format!("{s:?} is not a rate (try 45mbit)"))?;
    let mult: f64 = match unit.as_str() {
        "bit" | "bps" => 1.0,
        "kbit" | "kbps" => 1e3,
        "mbit" | "mbps" => 1e6,
        "gbit" | "gbps" => 1e9,
        "kb/s" => 8e3,
        "mb/s" => 8e6,
        "gb/s" => 8e9,
        _ => {
            return Err(format!(
                "{s:?}: unknown rate unit {unit:?} (use kbit, mbit, gbit)"
            ));
        }
    };
    checked(v * mult).ok_or_else(|| format!("{s:?} is out of range"))
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
