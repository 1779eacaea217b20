//! Command lines: oratcptest's own (`-server -port=5555`, `HOST -port=5555 -mode=sync
//! -length=8k -duration=10s`), pasted as is, and the value syntax shared with the subcommands.
//!
//! As in Oracle's notes, sizes take `k`, `m`, `g` as powers of 1024 and values are
//! case-insensitive. `-duration` is a time (`10s`, `5min`, `1h`) or a byte count (`1g`; `m` means
//! Mbytes there); a bare `-delay` is milliseconds, other bare times are seconds.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::client::{ClientOpts, Limit, Mode, Payload};
use crate::server::ServerOpts;

/// What an oratcptest command line asks for.
#[derive(Debug, Clone)]
pub enum Oratcp {
    Server(ServerOpts),
    Client(ClientOpts),
    Help,
}

/// A size with powers of 1024: `8k`, `8020`, `1m`, `2g`, `16kb`, `64MiB`.
pub fn size(s: &str) -> Result<u64, String> {
    let l = s.trim().to_ascii_lowercase();
    let l = l
        .strip_suffix("bytes")
        .or_else(|| l.strip_suffix("byte"))
        .unwrap_or(&l);
    // `64MiB`, as in the daemon's config, means the same as `64m`.
    let l = l
        .strip_suffix("ib")
        .filter(|r| r.ends_with(['k', 'm', 'g', 't']))
        .unwrap_or(l);
    let l = l.strip_suffix('b').filter(|r| !r.is_empty()).unwrap_or(l);
    let (num, mult) = match l.chars().last() {
        Some('k') => (&l[..l.len() - 1], 1u64 << 10),
        Some('m') => (&l[..l.len() - 1], 1 << 20),
        Some('g') => (&l[..l.len() - 1], 1 << 30),
        Some('t') => (&l[..l.len() - 1], 1 << 40),
        _ => (l, 1),
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a size (8020, 8k, 1m, 64MiB, 2g)"))?;
    let b = v * mult as f64;
    if !b.is_finite() || b < 0.0 || b > u64::MAX as f64 {
        return Err(format!("{s:?} is out of range"));
    }
    Ok(b.round() as u64)
}

/// A time: `250ms`, `10s`, `5min`, `2m` (minutes), `1h`, `1d`; a bare number is in `bare` units.
pub fn time(s: &str, bare: Duration) -> Result<Duration, String> {
    let l = s.trim().to_ascii_lowercase();
    let end = l
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(l.len());
    let (num, unit) = l.split_at(end);
    let v: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a time (250ms, 10s, 5min, 1h)"))?;
    let unit_secs = match unit.trim() {
        "" => bare.as_secs_f64(),
        "us" => 1e-6,
        "ms" => 1e-3,
        "s" | "sec" | "secs" | "seconds" => 1.0,
        "m" | "min" | "mins" | "minutes" => 60.0,
        "h" | "hr" | "hours" => 3600.0,
        "d" | "days" => 86400.0,
        u => return Err(format!("{s:?}: unknown time unit {u:?}")),
    };
    Duration::try_from_secs_f64(v * unit_secs).map_err(|_| format!("{s:?} is out of range"))
}

/// `-duration`: a time, or bytes when the unit is a size (`k`, `m`, `g`, `t`, `b`).
pub fn limit(s: &str) -> Result<Limit, String> {
    let l = s.trim().to_ascii_lowercase();
    let unit: String = l
        .chars()
        .skip_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    match unit.as_str() {
        "k" | "m" | "g" | "t" | "b" | "kb" | "mb" | "gb" | "tb" | "bytes" => {
            Ok(Limit::Bytes(size(&l)?))
        }
        _ => Ok(Limit::Time(time(&l, Duration::from_secs(1))?)),
    }
}

/// `-freq=1h/24h`: repeat every first for the second.
pub fn freq(s: &str) -> Result<(Duration, Duration), String> {
    let (a, b) = s
        .split_once('/')
        .ok_or_else(|| format!("{s:?} is not EVERY/FOR, for example 1h/24h"))?;
    let sec = Duration::from_secs(1);
    let (e, t) = (time(a, sec)?, time(b, sec)?);
    if e.is_zero() || t < e {
        return Err(format!(
            "{s:?}: the period must be positive and not above the total"
        ));
    }
    Ok((e, t))
}

pub fn mode(s: &str) -> Result<Mode, String> {
    match s.to_ascii_lowercase().as_str() {
        "sync" => Ok(Mode::Sync),
        "async" => Ok(Mode::Async),
        _ => Err(format!("{s:?} is not SYNC or ASYNC")),
    }
}

pub fn payload(s: &str) -> Payload {
    match s.to_ascii_lowercase().as_str() {
        "random" => Payload::Random,
        "zero" => Payload::Zero,
        _ => Payload::File(PathBuf::from(s)),
    }
}

/// True if `args` (without the program name) look like an oratcptest command line.
pub fn is_oratcptest(args: &[String]) -> bool {
    args.iter().any(|a| {
        let a = a.to_ascii_lowercase();
        a == "-server" || a.starts_with("-port=") || a == "-help"
    })
}

/// Parses an oratcptest command line (without the program name).
pub fn parse_oratcptest<'a>(args: &'a [String]) -> Result<Oratcp, String> {
    let mut server = false;
    let mut host: Option<String> = None;
    let mut port: Option<u16> = None;
    let mut c = ClientOpts::default();
    let mut file = PathBuf::from("oratcp.tmp");
    let mut sockbuf = None;
    let mut rtt = false;
    let mut length_set = false;
    for a in args {
        let (key, val) = match a.split_once('=') {
            Some((k, v)) => (k.to_ascii_lowercase(), Some(v)),
            None => (a.to_ascii_lowercase(), None),
        };
        let need = |v: Option<&'a str>| -> Result<&'a str, String> {
            v.ok_or_else(|| format!("{key} needs a value: {key}=..."))
        };
        match key.as_str() {
            "-server" => server = true,
            "-help" | "-h" | "--help" => return Ok(Oratcp::Help),
            "-port" => {
                port = Some(
                    need(val)?
                        .parse()
                        .map_err(|_| format!("-port={}: not a port number", val.unwrap_or("")))?,
                )
            }
            "-write" => c.write = true,
            "-rtt" => rtt = true,
            "-random_length" => c.random_length = true,
            "-random_delay" => c.random_delay = true,
            "-json" => c.json = true,
            "-mode" => c.mode = mode(need(val)?)?,
            "-num_conn" => {
                c.num_conn = need(val)?
                    .parse()
                    .ok()
                    .filter(|n| (1..=1024).contains(n))
                    .ok_or("-num_conn must be 1 to 1024")?
            }
            "-sockbuf" => sockbuf = Some(size(need(val)?)? as usize).filter(|n| *n > 0),
            "-length" => {
                let n = size(need(val)?)?;
                c.length = u32::try_from(n)
                    .ok()
                    .filter(|n| *n <= crate::proto::MAX_MESSAGE)
                    .ok_or("-length must be at most 256m")?;
                length_set = true;
            }
            "-delay" => c.delay = time(need(val)?, Duration::from_millis(1))?,
            "-payload" => c.payload = payload(need(val)?),
            "-interval" => c.interval = time(need(val)?, Duration::from_secs(1))?,
            "-duration" => c.duration = limit(need(val)?)?,
            "-freq" => c.freq = Some(freq(need(val)?)?),
            "-timeout" => {
                c.timeout = Some(time(need(val)?, Duration::from_secs(1))?).filter(|d| !d.is_zero())
            }
            "-output" => c.output = Some(PathBuf::from(need(val)?)),
            "-file" => file = PathBuf::from(need(val)?),
            "-seed" => c.seed = need(val)?.parse().map_err(|_| "-seed must be a number")?,
            k if k.starts_with('-') => return Err(format!("unknown option {a:?} (see -help)")),
            _ => {
                if host.replace(a.clone()).is_some() {
                    return Err(format!("unexpected argument {a:?}: one host only"));
                }
            }
        }
    }
    let port = port.ok_or("-port=N must be given")?;
    if c.interval.is_zero() {
        return Err("-interval must be positive".into());
    }
    if server {
        let ip = match host.as_deref() {
            None => "0.0.0.0".parse().map_err(|_| "bad address")?,
            Some(h) => resolve_ip(h)?,
        };
        return Ok(Oratcp::Server(ServerOpts {
            bind: SocketAddr::new(ip, port),
            file,
            sockbuf,
        }));
    }
    let host = host.ok_or("the server host must be given: HOST -port=N")?;
    if rtt {
        // Round-trip mode: SYNC with empty messages.
        c.mode = Mode::Sync;
        if !length_set {
            c.length = 0;
        }
    }
    if c.length == 0 && matches!(c.duration, Limit::Bytes(_)) {
        return Err("a byte -duration needs a non-zero -length".into());
    }
    c.sockbuf = sockbuf;
    c.addr = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    Ok(Oratcp::Client(c))
}

fn resolve_ip(h: &str) -> Result<std::net::IpAddr, String> {
    use std::net::ToSocketAddrs;
    (h, 0)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {h}: {e}"))?
        .next()
        .map(|a| a.ip())
        .ok_or_else(|| format!("cannot resolve {h}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn values_as_oracle_writes_them() {
        assert_eq!(size("8k"), Ok(8192));
        assert_eq!(size("8K"), Ok(8192));
        assert_eq!(size("8020"), Ok(8020));
        assert_eq!(size("1m"), Ok(1 << 20));
        assert_eq!(size("2G"), Ok(2 << 30));
        assert_eq!(size("64MiB"), Ok(64 << 20));
        assert_eq!(size("16kib"), Ok(16 << 10));
        assert!(size("5ib").is_err());
        assert_eq!(size("16kb"), Ok(16384));
        assert!(size("lots").is_err());
        assert_eq!(
            time("10s", Duration::from_secs(1)),
            Ok(Duration::from_secs(10))
        );
        assert_eq!(
            time("5", Duration::from_millis(1)),
            Ok(Duration::from_millis(5))
        );
        assert_eq!(
            time("2m", Duration::from_secs(1)),
            Ok(Duration::from_secs(120))
        );
        assert_eq!(limit("100S"), Ok(Limit::Time(Duration::from_secs(100))));
        assert_eq!(limit("1g"), Ok(Limit::Bytes(1 << 30)));
        assert_eq!(limit("500m"), Ok(Limit::Bytes(500 << 20)));
        assert_eq!(limit("5min"), Ok(Limit::Time(Duration::from_secs(300))));
        assert_eq!(
            freq("1h/24h"),
            Ok((Duration::from_secs(3600), Duration::from_secs(86400)))
        );
        assert!(freq("24h/1h").is_err());
    }

    #[test]
    fn pasted_oratcptest_lines() {
        let Ok(Oratcp::Server(s)) = parse_oratcptest(&args("-server -port=5555")) else {
            panic!("server");
        };
        assert_eq!(s.bind.port(), 5555);
        assert_eq!(s.file, PathBuf::from("oratcp.tmp"));
        let Ok(Oratcp::Server(s)) = parse_oratcptest(&args(
            "-server 127.0.0.1 -port=1521 -file=/u01/oraredo/oratcp.tmp -sockbuf=2097152",
        )) else {
            panic!("server");
        };
        assert_eq!(s.bind.to_string(), "127.0.0.1:1521");
        assert_eq!(s.sockbuf, Some(2_097_152));
        let Ok(Oratcp::Client(c)) = parse_oratcptest(&args(
            "slcc32adm07 -port=5555 -write -mode=SYNC -length=8020 -duration=10s -interval=2s",
        )) else {
            panic!("client");
        };
        assert_eq!(c.addr, "slcc32adm07:5555");
        assert!(c.write);
        assert_eq!(c.mode, Mode::Sync);
        assert_eq!(c.length, 8020);
        assert_eq!(c.duration, Limit::Time(Duration::from_secs(10)));
        assert_eq!(c.interval, Duration::from_secs(2));
        let Ok(Oratcp::Client(c)) = parse_oratcptest(&args(
            "host -port=5555 -mode=async -num_conn=4 -payload=ZERO -delay=5 -random_delay -random_length -duration=1g -timeout=30s",
        )) else {
            panic!("client");
        };
        assert_eq!(c.mode, Mode::Async);
        assert_eq!(c.num_conn, 4);
        assert_eq!(c.payload, Payload::Zero);
        assert_eq!(c.delay, Duration::from_millis(5));
        assert!(c.random_delay && c.random_length);
        assert_eq!(c.duration, Limit::Bytes(1 << 30));
        assert_eq!(c.timeout, Some(Duration::from_secs(30)));
        let Ok(Oratcp::Client(c)) = parse_oratcptest(&args("h -port=1 -rtt")) else {
            panic!("rtt");
        };
        assert_eq!((c.mode, c.length), (Mode::Sync, 0));
        for bad in [
            "host",
            "host -port=x",
            "-port=1",
            "host -port=1 -mode=fast",
            "host -port=1 -bogus=1",
            "host -port=1 -length=1t",
            "a b -port=1",
            "host -port=1 -rtt -duration=1m",
        ] {
            assert!(parse_oratcptest(&args(bad)).is_err(), "{bad}");
        }
        assert!(is_oratcptest(&args("-server -port=5555")));
        assert!(!is_oratcptest(&args("client host --port 5555")));
    }
}
