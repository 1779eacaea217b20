//! TCP tuning of the link socket and the local sockets, with warnings that name the sysctl to fix.
//!
//! The link socket gets the configured congestion control (falling back to the kernel default with a
//! warning), `TCP_NODELAY`, keepalive, `TCP_USER_TIMEOUT`, `TCP_NOTSENT_LOWAT`, and either kernel
//! buffer autotuning (default) or explicit buffer sizes, whose effective values are read back.

use std::net::SocketAddr;

use socket2::{Domain, SockRef, Socket, TcpKeepalive, Type};
use tracing::{debug, info, warn};

use crate::config::{BufferSize, LinkSettings};

fn read_sysctl(name: &str) -> Option<String> {
    let path = format!("/proc/sys/{}", name.replace('.', "/"));
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

/// The maximum (third) value of a `tcp_rmem`/`tcp_wmem` triple.
fn triple_max(v: &str) -> Option<u64> {
    v.split_whitespace().nth(2)?.parse().ok()
}

/// Warns once at start when the kernel's buffer maxima cannot hold 3x the bandwidth-delay product.
pub fn check_buffer_sysctls(link: &LinkSettings) {
    let want = link.bdp_bytes().saturating_mul(3);
    for (name, buf) in [
        ("net.ipv4.tcp_rmem", link.recv_buffer),
        ("net.ipv4.tcp_wmem", link.send_buffer),
    ] {
        if buf != BufferSize::Auto {
            continue;
        }
        if let Some(max) = read_sysctl(name).as_deref().and_then(triple_max)
            && max < want
        {
            warn!(
                sysctl = name,
                max,
                want,
                "kernel buffer maximum is below 3x the bandwidth-delay product; raise it \
                     (see systemd/99-wanopt.conf) or the link cannot fill the pipe"
            );
        }
    }
}

/// Applies the link options and congestion control `cc` to a socket before it connects or
/// listens.
///
/// The congestion control a connection is established with matters beyond its own use: BBR turns
/// on the kernel's internal pacing when the connection comes up, and switching to another
/// algorithm later does not turn it off. A latency lane born BBR and switched to CUBIC would pace
/// each 8 KiB message at CUBIC's window-limited rate (about 1 Mbit/s at 100 ms after a loss:
/// measured +20-30 ms per SYNC round trip). So lanes are dialled, and the listener listens, with
/// the lane's congestion control; an accepted connection switches to the main lane's only once
/// its hello shows it is the main lane (switching to BBR turns pacing on, as BBR wants).
pub fn tune_link_socket(sock: &SockRef<'_>, link: &LinkSettings, cc: &str) {
    set_congestion(sock, cc);
    tune_link_options(sock, link);
}

/// The link options other than congestion control (accepted sockets keep the listener's until
/// their role is known).
pub fn tune_link_options(sock: &SockRef<'_>, link: &LinkSettings) {
    if let Err(e) = sock.set_tcp_nodelay(true) {
        warn!(error = %e, "cannot set TCP_NODELAY on the link socket");
    }
    let ka = TcpKeepalive::new()
        .with_time(link.keepalive)
        .with_interval(link.keepalive)
        .with_retries(3);
    if let Err(e) = sock
        .set_keepalive(true)
        .and_then(|()| sock.set_tcp_keepalive(&ka))
    {
        warn!(error = %e, "cannot set keepalive on the link socket");
    }
    if let Err(e) = sock.set_tcp_user_timeout(Some(link.user_timeout)) {
        warn!(error = %e, "cannot set TCP_USER_TIMEOUT on the link socket");
    }
    if let Err(e) = sock.set_tcp_notsent_lowat(link.notsent_lowat) {
        warn!(error = %e, "cannot set TCP_NOTSENT_LOWAT on the link socket");
    }
    if let BufferSize::Bytes(n) = link.send_buffer
        && let Err(e) = sock.set_send_buffer_size(n)
    {
        warn!(error = %e, "cannot set SO_SNDBUF");
    }
    if let BufferSize::Bytes(n) = link.recv_buffer
        && let Err(e) = sock.set_recv_buffer_size(n)
    {
        warn!(error = %e, "cannot set SO_RCVBUF");
    }
}

/// Once a connection is known to be the main lane: its congestion control (`link.congestion`),
/// and a cap on its sending rate (`link.max_rate`). Never on the listener or the latency lane:
/// asking for a pacing cap turns on the kernel's own pacing for the socket for good, and a
/// window-limited latency lane would then spread each small message over tens of milliseconds
/// (measured: +31 ms per 8 KiB round trip at 100 ms).
pub fn tune_main_lane(sock: &SockRef<'_>, link: &LinkSettings) {
    set_congestion(sock, &link.congestion);
    if let Some(bps) = link.max_rate_bps {
        set_max_pacing_rate(sock, bps / 8);
    }
}

/// Sets the latency lane's congestion control (a no-op when it was born with it, as it should be:
/// see [`tune_link_socket`]) and its least retransmission timeout (`link.lane_rto_min`).
pub fn tune_lane_socket(sock: &SockRef<'_>, link: &LinkSettings) {
    set_congestion(sock, &link.lane_congestion);
    if let Some(min) = link.lane_rto_min {
        set_rto_min(sock, min, !link.lane_rto_min_auto);
    }
}

/// `TCP_RTO_MIN_US` (Linux 6.15 and later; older headers lack it).
const TCP_RTO_MIN_US: libc::c_int = 45;

/// Lowers the socket's least retransmission timeout from the kernel's 200 ms: a message whose
/// last packet is lost (every copy of it) is sent again after srtt plus the larger of this and
/// the RTT's variation, instead of srtt plus 200 ms. An older kernel keeps its default, said once
/// when the operator `stated` the floor (the `auto` one is a debug line there).
fn set_rto_min(sock: &SockRef<'_>, min: std::time::Duration, stated: bool) {
    use std::os::fd::AsRawFd;
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let v = libc::c_int::try_from(min.as_micros()).unwrap_or(libc::c_int::MAX);
    // SAFETY: a valid socket and an int option value of the right size.
    let r = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::IPPROTO_TCP,
            TCP_RTO_MIN_US,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r != 0 && !stated {
        debug!(error = %std::io::Error::last_os_error(), "the kernel keeps its least retransmission timeout for the latency lane (TCP_RTO_MIN_US needs Linux 6.15)");
    } else if r != 0 && !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        warn!(error = %std::io::Error::last_os_error(), "cannot lower the latency lane's retransmission timeout (TCP_RTO_MIN_US needs Linux 6.15); it keeps the kernel's 200 ms");
    }
}

/// Logs the effective settings of a connected link socket (the kernel caps explicit buffers at
/// `net.core.wmem_max`/`rmem_max` and doubles them for bookkeeping).
pub fn log_effective(sock: &SockRef<'_>, link: &LinkSettings) {
    let cc = sock
        .tcp_congestion()
        .map(|v| {
            String::from_utf8_lossy(&v)
                .trim_end_matches('\0')
                .to_string()
        })
        .unwrap_or_else(|e| format!("unknown ({e})"));
    let snd = sock.send_buffer_size().unwrap_or(0);
    let rcv = sock.recv_buffer_size().unwrap_or(0);
    info!(congestion = %cc, sndbuf = snd, rcvbuf = rcv, autotune = (link.send_buffer == BufferSize::Auto), "link socket tuned");
    for (want, got, sysctl) in [
        (link.send_buffer, snd, "net.core.wmem_max"),
        (link.recv_buffer, rcv, "net.core.rmem_max"),
    ] {
        if let BufferSize::Bytes(n) = want
            && got < n
        {
            warn!(
                requested = n,
                effective = got,
                sysctl,
                "buffer capped by the kernel; raise the sysctl"
            );
        }
    }
}

/// Caps the socket's sending rate (bytes per second) with `SO_MAX_PACING_RATE`, so the daemon's
/// own bulk traffic never builds a standing queue at the WAN bottleneck, where latency-class
/// packets would wait behind it.
fn set_max_pacing_rate(sock: &SockRef<'_>, bytes_per_sec: u64) {
    use std::os::fd::AsRawFd;
    if let Err(e) = set_pacing(sock.as_raw_fd(), bytes_per_sec) {
        warn!(error = %e, "cannot set SO_MAX_PACING_RATE; the link is not paced");
    }
}

/// Sets `SO_MAX_PACING_RATE` (bytes per second) of a connected socket.
pub fn set_pacing(fd: std::os::fd::RawFd, bytes_per_sec: u64) -> std::io::Result<()> {
    let v: u64 = bytes_per_sec;
    // SAFETY: a valid socket and a u64 option value of the right size.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_MAX_PACING_RATE,
            (&v as *const u64).cast(),
            std::mem::size_of::<u64>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn set_congestion(sock: &SockRef<'_>, name: &str) {
    if let Err(e) = sock.set_tcp_congestion(name.as_bytes()) {
        let allowed = read_sysctl("net.ipv4.tcp_allowed_congestion_control").unwrap_or_default();
        let available =
            read_sysctl("net.ipv4.tcp_available_congestion_control").unwrap_or_default();
        let fix = if available.split_whitespace().any(|a| a == name) {
            format!("sysctl -w net.ipv4.tcp_allowed_congestion_control=\"{allowed} {name}\"")
        } else {
            format!("modprobe tcp_{name} and add it to net.ipv4.tcp_allowed_congestion_control")
        };
        warn!(
            congestion = name,
            error = %e,
            allowed = %allowed,
            fix = %fix,
            "kernel refused the congestion control; using the kernel default"
        );
    }
}

/// `TCP_INFO` of a connected socket, as the kernel fills it.
fn raw_tcp_info(fd: std::os::fd::RawFd) -> Option<libc::tcp_info> {
    // SAFETY: tcp_info is plain data; getsockopt writes at most `len` bytes into it.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: a valid pointer and length for the option value.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    (r == 0).then_some(info)
}

/// How ready a latency-lane copy's connection is to deliver `bytes` written now (see
/// `Fanout::set_ranks`): 0 nothing outstanding, 1 earlier bytes not acknowledged yet (a tail
/// that may be lost, unknown to the sender so far), 2 in loss recovery (a hole the peer holds
/// what follows behind, until it is sent again), backing off a retransmission timeout, or with
/// no room in its congestion window for these bytes and what waits unsent before them (after a
/// timeout the window starts again at one segment: an 8 KiB write then takes two or three round
/// trips). `None`: the socket cannot say.
pub fn copy_rank(fd: std::os::fd::RawFd, bytes: usize) -> Option<u8> {
    raw_tcp_info(fd).map(|info| rank_of(&info, bytes))
}

fn rank_of(info: &libc::tcp_info, bytes: usize) -> u8 {
    // TCP_CA_Open 0, Disorder 1 (duplicate acknowledgements), CWR 2, Recovery 3, Loss 4.
    let recovering =
        matches!(info.tcpi_ca_state, 1 | 3 | 4) || info.tcpi_lost > 0 || info.tcpi_retrans > 0;
    let room = u64::from(info.tcpi_snd_cwnd.saturating_sub(info.tcpi_unacked))
        * u64::from(info.tcpi_snd_mss.max(1));
    let need = bytes as u64 + u64::from(info.tcpi_notsent_bytes);
    if recovering || info.tcpi_backoff > 0 || room < need {
        2
    } else {
        u8::from(info.tcpi_unacked > 0)
    }
}

/// How long ago the kernel last received data (not a bare acknowledgement) on a connected
/// socket, whether or not anyone read it since. `None`: the socket cannot say.
pub fn last_data_received(fd: std::os::fd::RawFd) -> Option<std::time::Duration> {
    raw_tcp_info(fd).map(|i| std::time::Duration::from_millis(u64::from(i.tcpi_last_data_recv)))
}

/// A copy connection's state in a few words, for the log line that says every copy of a write
/// was impaired.
pub fn copy_state(fd: std::os::fd::RawFd) -> String {
    raw_tcp_info(fd).map_or_else(
        || "?".to_string(),
        |i| {
            format!(
                "state {} cwnd {} unacked {} lost {} retrans {} backoff {} rto {}ms notsent {}",
                i.tcpi_ca_state,
                i.tcpi_snd_cwnd,
                i.tcpi_unacked,
                i.tcpi_lost,
                i.tcpi_retrans,
                i.tcpi_backoff,
                i.tcpi_rto / 1000,
                i.tcpi_notsent_bytes
            )
        },
    )
}

/// Reads `TCP_INFO` of a connected socket.
pub fn tcp_info(fd: std::os::fd::RawFd) -> Option<crate::counters::TcpSample> {
    let info = raw_tcp_info(fd)?;
    // The byte after the window scales holds `tcpi_delivery_rate_app_limited` in its lowest
    // bit (a C bitfield libc leaves as padding, before the 4-byte aligned `tcpi_rto`).
    // SAFETY: the struct is at least 8 bytes, zeroed and then written by the kernel.
    let flags = unsafe { *(&info as *const libc::tcp_info).cast::<u8>().add(7) };
    Some(crate::counters::TcpSample {
        rtt_seconds: f64::from(info.tcpi_rtt) / 1e6,
        min_rtt_seconds: f64::from(info.tcpi_min_rtt) / 1e6,
        cwnd_segments: i64::from(info.tcpi_snd_cwnd),
        retransmitted_segments: i64::from(info.tcpi_total_retrans),
        delivery_rate: info.tcpi_delivery_rate.min(i64::MAX as u64) as i64,
        bytes_sent: info.tcpi_bytes_sent.min(i64::MAX as u64) as i64,
        bytes_received: info.tcpi_bytes_received.min(i64::MAX as u64) as i64,
        data_segments_sent: i64::from(info.tcpi_data_segs_out),
        app_limited: flags & 1 != 0,
    })
}

/// Sets `TCP_NODELAY` on a local (client or target) socket.
pub fn tune_local(stream: &tokio::net::TcpStream) {
    let _ = stream.set_nodelay(true);
}

/// Closes a socket with a reset (`SO_LINGER` 0) so the peer sees an error, not a clean end.
pub fn abort(stream: &tokio::net::TcpStream) {
    let _ = SockRef::from(stream).set_linger(Some(std::time::Duration::ZERO));
}

/// A tuned TCP listener socket for the link.
pub fn link_listener(
    addr: SocketAddr,
    link: &LinkSettings,
) -> std::io::Result<tokio::net::TcpListener> {
    let sock = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    sock.set_reuse_address(true)?;
    tune_link_socket(&SockRef::from(&sock), link, &link.lane_congestion);
    sock.bind(&addr.into())?;
    sock.listen(128)?;
    sock.set_nonblocking(true)?;
    tokio::net::TcpListener::from_std(sock.into())
}

/// Dials the peer with a tuned socket.
pub async fn link_connect(
    addr: SocketAddr,
    link: &LinkSettings,
    cc: &str,
) -> std::io::Result<tokio::net::TcpStream> {
    let raw = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    raw.set_nonblocking(true)?;
    let sock = tokio::net::TcpSocket::from_std_stream(raw.into());
    tune_link_socket(&SockRef::from(&sock), link, cc);
    sock.connect(addr).await
}

/// A plain listener for a local service (address reuse so restarts rebind at once).
pub fn local_listener(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let sock = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    sock.set_reuse_address(true)?;
    sock.bind(&addr.into())?;
    sock.listen(1024)?;
    sock.set_nonblocking(true)?;
    tokio::net::TcpListener::from_std(sock.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn congestion(fd: &impl std::os::fd::AsFd) -> String {
        let v = SockRef::from(fd).tcp_congestion().unwrap_or_default();
        String::from_utf8_lossy(&v)
            .trim_end_matches('\0')
            .to_string()
    }

    /// Lanes are born with the lane's congestion control (so BBR never turns on pacing for
    /// them); an accepted connection keeps the listener's until it is known to be the main lane.
    #[tokio::test]
    async fn lanes_are_born_with_their_congestion_control() {
        let available =
            read_sysctl("net.ipv4.tcp_available_congestion_control").unwrap_or_default();
        if !(available.contains("bbr") && available.contains("cubic")) {
            eprintln!("skipping: the kernel lacks bbr or cubic ({available})");
            return;
        }
        let cfg = crate::config::Config::parse(
            "site: west\nlink:\n  listen: 127.0.0.1:0\n  peer: east\n  congestion: bbr\n  lane_congestion: cubic\ntls:\n  ca: c\n  cert: c\n  key: k\n",
            std::path::Path::new("/tmp/x.yaml"),
        )
        .expect("config");
        let l = link_listener("127.0.0.1:0".parse().expect("addr"), &cfg.link).expect("listen");
        assert_eq!(congestion(&l), "cubic");
        let addr = l.local_addr().expect("addr");
        let (lane, main) = tokio::join!(link_connect(addr, &cfg.link, "cubic"), l.accept());
        let (lane, (accepted, _)) = (lane.expect("connect"), main.expect("accept"));
        assert_eq!(congestion(&lane), "cubic");
        assert_eq!(
            congestion(&accepted),
            "cubic",
            "inherited from the listener"
        );
        tune_main_lane(&SockRef::from(&accepted), &cfg.link);
        assert_eq!(congestion(&accepted), "bbr");
        let main = link_connect(addr, &cfg.link, &cfg.link.congestion)
            .await
            .expect("connect");
        assert_eq!(congestion(&main), "bbr");
    }

    /// A copy's rank: ready, earlier bytes unacknowledged, or unable to deliver this write within
    /// a round trip (recovering, backing off, or no room in its window for it).
    #[test]
    fn a_copy_without_room_for_the_write_ranks_last() {
        // SAFETY: tcp_info is plain data; all zeroes is a valid value.
        let mut i: libc::tcp_info = unsafe { std::mem::zeroed() };
        i.tcpi_snd_cwnd = 10;
        i.tcpi_snd_mss = 1448;
        assert_eq!(rank_of(&i, 8192), 0);
        i.tcpi_unacked = 2;
        assert_eq!(rank_of(&i, 8192), 1);
        // After a timeout: a window of one segment, and the write needs six.
        i.tcpi_snd_cwnd = 3;
        assert_eq!(rank_of(&i, 8192), 2);
        assert_eq!(rank_of(&i, 1000), 1);
        i.tcpi_notsent_bytes = 4000;
        assert_eq!(rank_of(&i, 1000), 2);
        i.tcpi_notsent_bytes = 0;
        i.tcpi_backoff = 1;
        assert_eq!(rank_of(&i, 1000), 2);
        i.tcpi_backoff = 0;
        i.tcpi_ca_state = 4;
        assert_eq!(rank_of(&i, 1000), 2);
    }

    /// The kernel tells when data last arrived on a socket, read or not: what the link's
    /// silence clock asks when its reader has not run.
    #[test]
    fn a_socket_tells_when_data_last_arrived_unread() {
        use std::io::Write;
        use std::os::fd::AsRawFd;
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let mut a = std::net::TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (b, _) = l.accept().expect("accept");
        a.write_all(b"ping").expect("write");
        std::thread::sleep(std::time::Duration::from_millis(300));
        let ago = last_data_received(b.as_raw_fd()).expect("tcp_info");
        assert!(
            ago >= std::time::Duration::from_millis(250) && ago < std::time::Duration::from_secs(5),
            "{ago:?}"
        );
        a.write_all(b"pong").expect("write");
        std::thread::sleep(std::time::Duration::from_millis(20));
        let ago = last_data_received(b.as_raw_fd()).expect("tcp_info");
        assert!(ago < std::time::Duration::from_millis(250), "{ago:?}");
    }

    /// The lane's least retransmission timeout reaches the socket (the kernel rounds it to its
    /// clock's ticks).
    #[test]
    fn the_lane_rto_min_reaches_the_socket() {
        use std::os::fd::AsRawFd;
        let s = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let sock = SockRef::from(&s);
        set_rto_min(&sock, std::time::Duration::from_millis(20), true);
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: a valid socket and an int of the size passed.
        let r = unsafe {
            libc::getsockopt(
                s.as_raw_fd(),
                libc::IPPROTO_TCP,
                TCP_RTO_MIN_US,
                (&mut v as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            assert!(
                std::env::var("WANOPT_REQUIRE_NETNS").as_deref() != Ok("1"),
                "TCP_RTO_MIN_US unsupported here: {e}"
            );
            eprintln!("skipping: the kernel lacks TCP_RTO_MIN_US ({e})");
            return;
        }
        assert!((20_000..25_000).contains(&v), "{v} us");
    }

    #[test]
    fn triple_parsing() {
        assert_eq!(triple_max("4096\t131072\t6291456"), Some(6_291_456));
        assert_eq!(triple_max("garbage"), None);
    }
}
