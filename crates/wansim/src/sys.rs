//! The Linux plumbing: prerequisites, network namespaces (through `ip`), TUN devices, entering a
//! namespace from a thread, precise sleeping.
//!
//! Every namespace wansim makes is named `PREFIX-SITE`, so a crashed instance's leftovers are found
//! and removed by the next `up` or by `down`. TUN devices are not persistent: they vanish with the
//! process that holds their file descriptors.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::process::Command;

use crate::WansimError;

/// Lists what this machine lacks for wansim, or nothing.
pub fn missing_prerequisites() -> Vec<String> {
    let mut missing = Vec::new();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        missing.push(
            "root (network namespaces and TUN devices need CAP_NET_ADMIN; run as root)".to_string(),
        );
    }
    if !Path::new("/dev/net/tun").exists() {
        missing.push("/dev/net/tun (load the tun module: modprobe tun)".to_string());
    }
    if Command::new("ip").arg("-V").output().is_err() {
        missing.push("the `ip` command (Debian package iproute2)".to_string());
    }
    missing
}

/// Runs `ip ARGS`, failing with its stderr.
pub fn ip(args: &[&str]) -> Result<(), WansimError> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| WansimError::Setup(format!("ip {}: {e}", args.join(" "))))?;
    if !out.status.success() {
        return Err(WansimError::Setup(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Names of existing network namespaces.
pub fn list_netns() -> Vec<String> {
    std::fs::read_dir("/run/netns")
        .map(|d| {
            d.filter_map(Result::ok)
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// A TUN device (no packet-information header, so each read is one IP packet).
pub struct Tun {
    pub fd: OwnedFd,
    pub name: String,
}

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const IFF_TUN: libc::c_short = 0x0001;
const IFF_NO_PI: libc::c_short = 0x1000;

#[repr(C)]
struct IfReq {
    name: [u8; 16],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// Creates a TUN device in the current namespace; the kernel picks a free `tunN` name.
pub fn create_tun() -> Result<Tun, WansimError> {
    let path = CString::new("/dev/net/tun").map_err(|e| WansimError::Setup(e.to_string()))?;
    // SAFETY: a valid NUL-terminated path; the result is checked.
    let raw = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if raw < 0 {
        return Err(WansimError::Setup(format!(
            "open /dev/net/tun: {}",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: raw is a freshly opened descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let mut req = IfReq {
        name: [0; 16],
        flags: IFF_TUN | IFF_NO_PI,
        _pad: [0; 22],
    };
    // SAFETY: TUNSETIFF reads and writes an ifreq, which IfReq lays out.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), TUNSETIFF, &mut req as *mut IfReq) };
    if r < 0 {
        return Err(WansimError::Setup(format!(
            "TUNSETIFF: {}",
            std::io::Error::last_os_error()
        )));
    }
    let end = req.name.iter().position(|b| *b == 0).unwrap_or(16);
    let name = String::from_utf8_lossy(&req.name[..end]).into_owned();
    Ok(Tun { fd, name })
}

/// Moves the calling thread into the named network namespace (sockets it creates then live there).
pub fn enter_netns(name: &str) -> std::io::Result<()> {
    let f = std::fs::File::open(format!("/run/netns/{name}"))?;
    // SAFETY: a valid namespace descriptor; setns affects only the calling thread's network ns.
    let r = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Turns IPv6 off in a namespace: the emulated link is IPv4, and router solicitations would only
/// add stray packets to the counters.
pub fn disable_ipv6(ns: &str) -> Result<(), WansimError> {
    let ns = ns.to_string();
    std::thread::spawn(move || -> std::io::Result<()> {
        enter_netns(&ns)?;
        for k in ["all", "default"] {
            std::fs::write(format!("/proc/sys/net/ipv6/conf/{k}/disable_ipv6"), "1")?;
        }
        Ok(())
    })
    .join()
    .map_err(|_| WansimError::Setup("ipv6 thread panicked".into()))?
    .map_err(|e| WansimError::Setup(format!("disable IPv6 in {}: {e}", "namespace")))
}

/// Lets this thread's timed waits end within about a microsecond of their deadline.
pub fn precise_timers() {
    // SAFETY: PR_SET_TIMERSLACK takes a plain integer (nanoseconds).
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong);
    }
}

/// Sleeps until the monotonic clock reaches `deadline` (`clock_nanosleep` with an absolute time).
pub fn sleep_until(deadline: std::time::Instant) {
    let now = std::time::Instant::now();
    if deadline <= now {
        return;
    }
    let d = deadline - now;
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid timespec to write to.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    let total = ts.tv_nsec as u128 + d.subsec_nanos() as u128;
    ts.tv_sec += d.as_secs() as libc::time_t + (total / 1_000_000_000) as libc::time_t;
    ts.tv_nsec = (total % 1_000_000_000) as libc::c_long;
    // SAFETY: absolute monotonic sleep on a valid timespec; EINTR just ends the sleep early.
    unsafe {
        libc::clock_nanosleep(
            libc::CLOCK_MONOTONIC,
            libc::TIMER_ABSTIME,
            &ts,
            std::ptr::null_mut(),
        );
    }
}

/// Waits up to `timeout_ms` for `fd` to be readable.
pub fn poll_readable(fd: &OwnedFd, timeout_ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let r = unsafe { libc::poll(&mut p, 1, timeout_ms) };
    r > 0 && p.revents & libc::POLLIN != 0
}

/// Reads one packet; `None` on error.
pub fn read_packet(fd: &OwnedFd, buf: &mut [u8]) -> Option<usize> {
    // SAFETY: buf is valid for writes of its length.
    let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    (n > 0).then_some(n as usize)
}

/// Writes one packet; errors (a device going down) are ignored like a lossy wire would.
pub fn write_packet(fd: &OwnedFd, pkt: &[u8]) {
    // SAFETY: pkt is valid for reads of its length.
    unsafe {
        libc::write(fd.as_raw_fd(), pkt.as_ptr().cast(), pkt.len());
    }
}
