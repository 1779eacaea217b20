//! systemd integration without libsystemd: readiness, status and watchdog messages sent as
//! datagrams to `$NOTIFY_SOCKET` (a path, or an abstract name starting with `@`).
//!
//! Every function does nothing when the daemon is not started by systemd with `Type=notify`.

use std::os::unix::net::UnixDatagram;
use std::time::Duration;

pub(crate) fn socket_addr() -> Option<std::os::unix::net::SocketAddr> {
    let path = std::env::var_os("NOTIFY_SOCKET")?;
    let bytes = path.as_encoded_bytes();
    if let Some(name) = bytes.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(name).ok()
    } else {
        std::os::unix::net::SocketAddr::from_pathname(std::path::Path::new(&path)).ok()
    }
}

/// Sends one notification (`READY=1`, `STATUS=...`, `WATCHDOG=1`, `STOPPING=1`); errors are
/// ignored, as systemd's own `sd_notify` callers do.
pub fn send(msg: &str) {
    let Some(addr) = socket_addr() else { return };
    if let Ok(sock) = UnixDatagram::unbound() {
        let _ = sock.send_to_addr(msg.as_bytes(), &addr);
    }
}

/// Tells systemd the daemon is ready (listeners bound, config valid), with a status line.
pub fn ready(status: &str) {
    send(&format!(
        "READY=1\nSTATUS={status}\nMAINPID={}",
        std::process::id()
    ));
}

/// Updates the status line `systemctl status` shows.
pub fn status(status: &str) {
    send(&format!("STATUS={status}"));
}

/// The interval at which to ping the watchdog (half of `WatchdogSec`), if systemd asked for it.
pub fn watchdog_interval() -> Option<Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    if let Ok(pid) = std::env::var("WATCHDOG_PID")
        && pid.parse::<u32>().ok() != Some(std::process::id())
    {
        return None;
    }
    (usec > 0).then(|| Duration::from_micros(usec / 2))
}
