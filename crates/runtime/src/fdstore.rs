//! `systemctl restart` without dropping a stream: systemd's file descriptor store
//! (<https://systemd.io/FILE_DESCRIPTOR_STORE/>), spoken without libsystemd.
//!
//! On `SIGTERM` the daemon asks systemd whether a restart job is queued for its unit
//! ([`restart_queued`]). If one is, it parks every stream as for a `SIGUSR2` handover (see
//! `handover.rs`), writes the state into a memfd, and uploads the memfd and every listening,
//! client and target socket to the store (`FDSTORE=1`, one `FDNAME=` per descriptor, `FDPOLL=0`
//! so that a socket whose peer hung up is kept for the new process to close), waits until
//! systemd has them (`BARRIER=1`), and exits. systemd keeps the store across a restart job and
//! passes it to the new process as it passes socket-activated descriptors (`LISTEN_FDS`,
//! `LISTEN_FDNAMES`); the new process ([`inherited`]) reads the state, takes the sockets and
//! removes every descriptor from the store (`FDSTOREREMOVE=1`), so the store's copies do not
//! keep a closed stream's socket open. On `systemctl stop` no restart job is queued: the daemon
//! drains, as it always did, and systemd closes an empty store.
//!
//! Everything here is read as hostile input: the environment's counts are bounded, names are
//! checked, and a descriptor the state does not name is closed.

use std::collections::HashMap;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::time::Duration;

use crate::handover::{self, HandoverError, State};

/// The name the state's memfd is stored under.
const STATE_NAME: &str = "wanopt-state";
/// The prefix of a socket's name: `wanopt-fd-N`, N the descriptor's number in the process
/// that stored it (the number its state names).
const FD_PREFIX: &str = "wanopt-fd-";
/// Descriptors read from `LISTEN_FDS` at most.
const MAX_LISTEN_FDS: usize = 1 << 17;

/// How many descriptors systemd will keep for this unit: `$FDSTORE` (set by systemd 254 and
/// later to `FileDescriptorStoreMax=`; the shipped units set it too, for earlier versions).
/// `None` when the daemon does not run under systemd with a store.
pub fn capacity() -> Option<usize> {
    std::env::var_os("NOTIFY_SOCKET")?;
    let n: usize = std::env::var("FDSTORE").ok()?.trim().parse().ok()?;
    (n > 0).then_some(n)
}

/// The unit this process runs in, from its cgroup (`/proc/self/cgroup`): the last component of
/// the path that names a `.service`.
fn own_unit() -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    unit_of_cgroup(&text)
}

fn unit_of_cgroup(text: &str) -> Option<String> {
    // The unified hierarchy (`0::PATH`) first, then systemd's own (`N:name=systemd:PATH`).
    let line = text
        .lines()
        .find(|l| l.starts_with("0::"))
        .or_else(|| text.lines().find(|l| l.contains(":name=systemd:")))?;
    let path = line.splitn(3, ':').nth(2)?;
    path.rsplit('/')
        .find(|c| c.ends_with(".service"))
        .filter(|c| c.len() <= 256 && !c.contains(char::is_whitespace))
        .map(str::to_string)
}

/// Whether the job systemd has queued for this process's unit is a restart
/// (`systemctl restart`, `try-restart`, `reload-or-restart` of a running unit), asked with
/// `systemctl list-jobs` (over D-Bus when the daemon is not root). `Err` says why it could not
/// tell; the caller then stops as for `systemctl stop`.
pub fn restart_queued() -> Result<bool, String> {
    let unit = own_unit().ok_or("this process is not in a systemd service's cgroup")?;
    // Under a unit that signals its whole cgroup on stop (an older unit file's default
    // `KillMode=control-group`), systemd's pass over the cgroup can catch the first
    // `systemctl` just started: asked again once that pass is over.
    match list_jobs(&unit) {
        Err(Asked::Signalled(_)) => list_jobs(&unit),
        other => other,
    }
    .map_err(|e| e.to_string())
}

/// Why `systemctl list-jobs` gave no answer.
#[derive(Debug)]
enum Asked {
    Signalled(i32),
    Failed(String),
}

impl std::fmt::Display for Asked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Asked::Signalled(sig) => write!(f, "systemctl list-jobs was killed by signal {sig}"),
            Asked::Failed(why) => f.write_str(why),
        }
    }
}

/// One `systemctl list-jobs` for `unit`: whether a restart job is queued for it.
fn list_jobs(unit: &str) -> Result<bool, Asked> {
    use std::os::unix::process::ExitStatusExt;
    let mut child = std::process::Command::new("systemctl")
        .args(["list-jobs", "--no-legend", "--no-pager", "--plain", unit])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| Asked::Failed(format!("cannot run systemctl: {e}")))?;
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Asked::Failed(
                    "systemctl list-jobs did not answer within 5s".into(),
                ));
            }
            Err(e) => return Err(Asked::Failed(format!("systemctl: {e}"))),
        }
    }
    let out = child
        .wait_with_output()
        .map_err(|e| Asked::Failed(format!("systemctl: {e}")))?;
    if let Some(sig) = out.status.signal() {
        return Err(Asked::Signalled(sig));
    }
    if !out.status.success() {
        return Err(Asked::Failed(format!(
            "systemctl list-jobs failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(restart_in_jobs(&String::from_utf8_lossy(&out.stdout), unit))
}

/// `systemctl list-jobs` lists `ID UNIT TYPE STATE` per job.
fn restart_in_jobs(jobs: &str, unit: &str) -> bool {
    jobs.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.len() >= 3 && f[1] == unit && f[2] == "restart"
    })
}

/// Sends one notification carrying `fds` (none: a plain message) and waits for nothing.
fn send_with_fds(msg: &str, fds: &[RawFd]) -> std::io::Result<()> {
    let addr = crate::notify::socket_addr().ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::NotFound, "NOTIFY_SOCKET is not set")
    })?;
    let sock = UnixDatagram::unbound()?;
    sock.connect_addr(&addr)?;
    let mut iov = libc::iovec {
        iov_base: msg.as_ptr().cast_mut().cast(),
        iov_len: msg.len(),
    };
    let data_len = std::mem::size_of_val(fds);
    let data_len32 = u32::try_from(data_len)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "too many fds"))?;
    // SAFETY: CMSG_SPACE is arithmetic on its argument.
    let space = unsafe { libc::CMSG_SPACE(data_len32) } as usize;
    // u64 words keep the control buffer aligned for cmsghdr.
    let mut control = vec![0u64; space.div_ceil(8)];
    // SAFETY: an all-zero msghdr is a valid empty message.
    let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
    mh.msg_iov = &raw mut iov;
    mh.msg_iovlen = 1;
    if !fds.is_empty() {
        mh.msg_control = control.as_mut_ptr().cast();
        mh.msg_controllen = space;
        // SAFETY: the control buffer is `space` bytes, room for one header and `fds`; the
        // header pointer is the buffer's start, and the data written is `data_len` bytes.
        unsafe {
            let cm = libc::CMSG_FIRSTHDR(&raw const mh);
            (*cm).cmsg_level = libc::SOL_SOCKET;
            (*cm).cmsg_type = libc::SCM_RIGHTS;
            (*cm).cmsg_len = libc::CMSG_LEN(data_len32) as usize;
            std::ptr::copy_nonoverlapping(fds.as_ptr().cast::<u8>(), libc::CMSG_DATA(cm), data_len);
        }
    }
    // SAFETY: `mh` points at live buffers for the call's duration.
    let r = unsafe { libc::sendmsg(sock.as_raw_fd(), &raw const mh, libc::MSG_NOSIGNAL) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Waits until systemd has processed every notification sent before (`BARRIER=1`: it closes
/// the pipe's end it was given).
fn barrier(limit: Duration) -> std::io::Result<()> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: pipe2 writes two descriptors into the array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both were just created and are owned here.
    let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    send_with_fds("BARRIER=1", &[wr.as_raw_fd()])?;
    drop(wr);
    let mut pfd = libc::pollfd {
        fd: rd.as_raw_fd(),
        events: 0,
        revents: 0,
    };
    let ms = libc::c_int::try_from(limit.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: poll on one valid pollfd.
    let n = unsafe { libc::poll(&raw mut pfd, 1, ms) };
    if n == 1 && pfd.revents & libc::POLLHUP != 0 {
        Ok(())
    } else {
        Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "systemd did not confirm the stored descriptors",
        ))
    }
}

/// The descriptors a state names, each once.
fn named_fds(state: &State) -> Vec<RawFd> {
    state
        .listeners
        .iter()
        .map(|(_, fd)| *fd)
        .chain(state.streams.iter().map(|s| s.fd))
        .collect()
}

/// How many descriptors storing `state` takes (its sockets and the memfd).
pub fn needed(state: &State) -> usize {
    named_fds(state).len() + 1
}

/// Uploads `state` (in `mem`, a memfd) and every descriptor it names to the store, and waits
/// until systemd holds them. After this the process exits; systemd starts the new one with
/// them.
pub fn store(state: &State, mut mem: std::fs::File) -> Result<(), HandoverError> {
    mem.write_all(&state.encode())
        .map_err(|e| HandoverError::Io("state", e))?;
    let io = |what| move |e| HandoverError::Io(what, e);
    for fd in named_fds(state) {
        send_with_fds(
            &format!("FDSTORE=1\nFDPOLL=0\nFDNAME={FD_PREFIX}{fd}"),
            &[fd],
        )
        .map_err(io("store a descriptor"))?;
    }
    // The state goes last: a new process that finds it finds every socket it names.
    send_with_fds(
        &format!("FDSTORE=1\nFDPOLL=0\nFDNAME={STATE_NAME}"),
        &[mem.as_raw_fd()],
    )
    .map_err(io("store the state"))?;
    barrier(Duration::from_secs(10)).map_err(io("the store's barrier"))
}

/// Drops one name's descriptors from the store, so systemd's copies no longer hold them.
fn remove_stored(name: &str) {
    let _ = send_with_fds(&format!("FDSTOREREMOVE=1\nFDNAME={name}"), &[]);
}

/// The descriptors systemd passed (`LISTEN_PID` is this process), with their names, taken
/// close-on-exec. The variables are removed, so processes this one starts do not see them.
fn listen_fds() -> Option<Vec<(String, OwnedFd)>> {
    let pid: u32 = std::env::var("LISTEN_PID").ok()?.parse().ok()?;
    if pid != std::process::id() {
        return None;
    }
    let n: usize = std::env::var("LISTEN_FDS").ok()?.parse().ok()?;
    let names = std::env::var("LISTEN_FDNAMES").unwrap_or_default();
    for v in [
        "LISTEN_PID",
        "LISTEN_FDS",
        "LISTEN_FDNAMES",
        "LISTEN_PIDFDID",
    ] {
        // SAFETY: called at start, before any thread reads the environment.
        unsafe { std::env::remove_var(v) };
    }
    let n = n.min(MAX_LISTEN_FDS);
    let mut names = names.split(':');
    let mut out = Vec::with_capacity(n.min(4096));
    for i in 0..n {
        let Ok(fd) = RawFd::try_from(3 + i) else {
            break;
        };
        // SAFETY: fcntl(F_GETFD) only asks whether `fd` is open.
        if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
            continue;
        }
        // SAFETY: systemd passed descriptors 3..3+LISTEN_FDS to this process to own, and
        // nothing in it has taken them yet (this runs first in main).
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: as in handover's close_on_exec.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
        out.push((names.next().unwrap_or("unknown").to_string(), owned));
    }
    Some(out)
}

/// The new process after a `systemctl restart`: the state the process before stored, with its
/// descriptors renumbered to the ones this process got, if systemd passed one. Every
/// descriptor is removed from the store whether or not the state could be read; sockets the
/// state does not name are closed. A stream whose socket is missing is named by descriptor -1
/// (the link resets it); a listener whose socket is missing is bound anew.
pub fn inherited() -> Option<Result<State, HandoverError>> {
    let fds = listen_fds()?;
    if !fds.iter().any(|(name, _)| name == STATE_NAME) {
        // Not ours (socket activation is not used): left as they are.
        return None;
    }
    let mut names: Vec<String> = fds.iter().map(|(n, _)| n.clone()).collect();
    names.sort_unstable();
    names.dedup();
    let result = adopt_fds(fds);
    for n in &names {
        remove_stored(n);
    }
    Some(result)
}

fn adopt_fds(fds: Vec<(String, OwnedFd)>) -> Result<State, HandoverError> {
    let mut mem = None;
    let mut by_old: HashMap<RawFd, OwnedFd> = HashMap::new();
    for (name, fd) in fds {
        if name == STATE_NAME {
            mem = Some(std::fs::File::from(fd));
        } else if let Some(old) = name
            .strip_prefix(FD_PREFIX)
            .and_then(|n| n.parse::<RawFd>().ok())
        {
            by_old.insert(old, fd);
        }
        // Anything else: closed as `fd` drops.
    }
    let mem = mem.ok_or(HandoverError::Malformed("no state in the store"))?;
    let mut state = handover::read_state(mem)?;
    let mut taken = |old: RawFd| by_old.remove(&old).map(handover::release);
    state.listeners = std::mem::take(&mut state.listeners)
        .into_iter()
        .filter_map(|(kind, old)| taken(old).map(|fd| (kind, fd)))
        .collect();
    for s in &mut state.streams {
        s.fd = taken(s.fd).unwrap_or(-1);
    }
    // Stored sockets the state does not name close as `by_old` drops.
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_unit_comes_from_either_hierarchy() {
        assert_eq!(
            unit_of_cgroup("0::/system.slice/wanoptd.service\n").as_deref(),
            Some("wanoptd.service")
        );
        assert_eq!(
            unit_of_cgroup(
                "12:pids:/system.slice/x.service\n1:name=systemd:/system.slice/system-wanoptd.slice/wanoptd@west.service\n0::/\n"
            )
            .as_deref(),
            None,
            "the unified line wins, and / names no service"
        );
        assert_eq!(
            unit_of_cgroup(
                "1:name=systemd:/system.slice/system-wanoptd.slice/wanoptd@west.service\n"
            )
            .as_deref(),
            Some("wanoptd@west.service")
        );
        assert_eq!(unit_of_cgroup("0::/user.slice/session-3.scope\n"), None);
        assert_eq!(unit_of_cgroup("garbage"), None);
    }

    #[test]
    fn only_a_restart_of_this_unit_counts() {
        let jobs = "812 wanoptd@west.service restart running\n813 other.service restart waiting\n";
        assert!(restart_in_jobs(jobs, "wanoptd@west.service"));
        assert!(!restart_in_jobs(jobs, "wanoptd@east.service"));
        assert!(!restart_in_jobs(
            "812 wanoptd@west.service stop running\n",
            "wanoptd@west.service"
        ));
        assert!(!restart_in_jobs("", "wanoptd@west.service"));
    }

    /// A stand-in for systemd's notify socket: stores what it is sent, and hands it back as
    /// `LISTEN_FDS` would; the state comes back with its descriptors renumbered.
    #[test]
    fn stored_descriptors_come_back_renumbered() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let c = std::net::TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let state = State {
            link: Some(b"link".to_vec()),
            listeners: vec![(handover::ListenerKind::Link, l.as_raw_fd())],
            streams: vec![
                handover::StreamEntry {
                    id: wanopt_proto::StreamId(3),
                    fd: c.as_raw_fd(),
                    pending_up: bytes::Bytes::from_static(b"up"),
                    pending_down: bytes::Bytes::new(),
                    up_done: false,
                    down_done: true,
                },
                handover::StreamEntry {
                    id: wanopt_proto::StreamId(5),
                    fd: 9999,
                    pending_up: bytes::Bytes::new(),
                    pending_down: bytes::Bytes::new(),
                    up_done: false,
                    down_done: false,
                },
            ],
            parked_at_ms: Some(5),
        };
        let mem = handover::memfd().expect("memfd");
        let mut copy = mem.try_clone().expect("clone");
        copy.write_all(&state.encode()).expect("write");
        let dup = |fd: RawFd| {
            // SAFETY: dup of a live descriptor gives a new owned one.
            unsafe { OwnedFd::from_raw_fd(libc::dup(fd)) }
        };
        let fds = vec![
            ("wanopt-fd-77777".to_string(), dup(c.as_raw_fd())),
            (format!("{FD_PREFIX}{}", c.as_raw_fd()), dup(c.as_raw_fd())),
            (STATE_NAME.to_string(), OwnedFd::from(mem)),
            (format!("{FD_PREFIX}{}", l.as_raw_fd()), dup(l.as_raw_fd())),
        ];
        let got = adopt_fds(fds).expect("adopt");
        assert_eq!(got.link, state.link);
        assert_eq!(got.listeners.len(), 1);
        assert_ne!(got.listeners[0].1, l.as_raw_fd());
        let taken = handover::take_listener(got.listeners[0].1).expect("a listener");
        assert_eq!(taken.local_addr().ok(), l.local_addr().ok());
        assert_eq!(got.streams[0].pending_up, state.streams[0].pending_up);
        let s = handover::take_stream(got.streams[0].fd).expect("a stream");
        assert_eq!(s.peer_addr().ok(), c.peer_addr().ok());
        assert_eq!(got.streams[1].fd, -1, "missing: named -1");
        assert!(handover::take_stream(-1).is_err());
        // No state: refused.
        assert!(adopt_fds(vec![("wanopt-fd-3".into(), dup(c.as_raw_fd()))]).is_err());
    }
}
