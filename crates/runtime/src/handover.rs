//! Handing a running daemon to a new process (a restart or an upgrade, nginx's `SIGUSR2`
//! convention) without dropping a stream: the old process stops accepting, parks every stream
//! (it stops reading from clients and targets, keeping what it had read or was writing),
//! suspends the link as if its connection were lost and writes its state
//! ([`wanopt_proto::Link::hand_over`]), then starts the binary now at its own path with the same
//! arguments. The new process inherits the listening sockets and every client and target
//! socket, reads the state from a memfd, rebuilds the streams, and resumes the link on a new
//! connection, so the peer sees a short link loss. The caches come along through the disk
//! tier's saved states, as after any lost connection.
//!
//! The state this module writes ([`State`]) is versioned and read back as hostile input: every
//! count and length is checked before anything is allocated, every descriptor must be a socket
//! of the kind it is said to be. A state that cannot be read ends those streams with an error,
//! as a restart does, never with wrong bytes.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes};
use wanopt_proto::StreamId;

/// The environment variable that tells a new process it takes a daemon over: the state's
/// memfd and the pipe it says it is ready on, as `STATE_FD,READY_FD`.
pub const ENV: &str = "WANOPT_HANDOVER";
/// The version of [`State`]'s format: 2 adds the time the streams were parked (a state
/// without it is written as version 1, which is read too).
pub const VERSION: u16 = 2;
const MAGIC: [u8; 4] = *b"WODH";
/// Listeners and streams a state may name at most.
const MAX_LISTENERS: usize = 4096;
const MAX_STREAMS: usize = 1 << 20;
/// The largest state read back (the link's kept bytes dominate).
pub const MAX_STATE: u64 = 64 << 30;

/// A handover that failed.
#[derive(Debug, thiserror::Error)]
pub enum HandoverError {
    #[error("malformed handover state: {0}")]
    Malformed(&'static str),
    #[error("handover state version {0} is not 1 or {VERSION}")]
    Version(u16),
    #[error("descriptor {0} is not {1}")]
    Descriptor(RawFd, &'static str),
    #[error("the link: {0}")]
    Link(#[from] wanopt_proto::HandoverError),
    #[error("{0}: {1}")]
    Io(&'static str, std::io::Error),
    #[error("{0}")]
    Refused(String),
}

/// Which listener a descriptor is.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ListenerKind {
    Link,
    Admin,
    Service(String),
}

/// A stream the old process stopped moving bytes for.
#[derive(Debug)]
pub struct Parked {
    pub id: StreamId,
    pub sock: std::net::TcpStream,
    /// Read from the local socket, not yet taken by the link.
    pub pending_up: Bytes,
    /// Taken from the link, not yet written to the local socket.
    pub pending_down: Bytes,
    /// The local socket's end was read and the stream finished.
    pub up_done: bool,
    /// The peer's end was read and the local socket shut for writing.
    pub down_done: bool,
}

/// A parked stream as the state names it: its socket is the descriptor `fd`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamEntry {
    pub id: StreamId,
    pub fd: RawFd,
    pub pending_up: Bytes,
    pub pending_down: Bytes,
    pub up_done: bool,
    pub down_done: bool,
}

/// What the old process hands the new one besides the descriptors themselves.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct State {
    /// [`wanopt_proto::Link::hand_over`]'s bytes, if there was a link.
    pub link: Option<Vec<u8>>,
    pub listeners: Vec<(ListenerKind, RawFd)>,
    pub streams: Vec<StreamEntry>,
    /// When the process before parked the streams (milliseconds since the Unix epoch): the
    /// stall a handover causes counts from here.
    pub parked_at_ms: Option<u64>,
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.put_u64(b.len() as u64);
    out.put_slice(b);
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn need(&self, n: usize) -> Result<(), HandoverError> {
        if self.0.remaining() < n {
            return Err(HandoverError::Malformed("truncated"));
        }
        Ok(())
    }
    fn u8(&mut self) -> Result<u8, HandoverError> {
        self.need(1)?;
        Ok(self.0.get_u8())
    }
    fn flag(&mut self) -> Result<bool, HandoverError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(HandoverError::Malformed("a flag that is neither 0 nor 1")),
        }
    }
    fn u32(&mut self) -> Result<u32, HandoverError> {
        self.need(4)?;
        Ok(self.0.get_u32())
    }
    fn fd(&mut self) -> Result<RawFd, HandoverError> {
        let fd = self.u32()?;
        RawFd::try_from(fd).map_err(|_| HandoverError::Malformed("a descriptor out of range"))
    }
    fn count(&mut self, max: usize, each: usize) -> Result<usize, HandoverError> {
        let n = self.u32()? as usize;
        if n > max || n.saturating_mul(each) > self.0.remaining() {
            return Err(HandoverError::Malformed("a count past its bound"));
        }
        Ok(n)
    }
    fn bytes(&mut self) -> Result<Bytes, HandoverError> {
        self.need(8)?;
        let n = usize::try_from(self.0.get_u64())
            .map_err(|_| HandoverError::Malformed("a length too large"))?;
        self.need(n)?;
        let b = Bytes::copy_from_slice(&self.0[..n]);
        self.0.advance(n);
        Ok(b)
    }
}

impl State {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.put_slice(&MAGIC);
        out.put_u16(if self.parked_at_ms.is_some() {
            VERSION
        } else {
            1
        });
        match &self.link {
            Some(l) => {
                out.put_u8(1);
                put_bytes(&mut out, l);
            }
            None => out.put_u8(0),
        }
        out.put_u32(self.listeners.len() as u32);
        for (kind, fd) in &self.listeners {
            match kind {
                ListenerKind::Link => out.put_u8(0),
                ListenerKind::Admin => out.put_u8(1),
                ListenerKind::Service(name) => {
                    out.put_u8(2);
                    put_bytes(&mut out, name.as_bytes());
                }
            }
            out.put_u32(*fd as u32);
        }
        out.put_u32(self.streams.len() as u32);
        for s in &self.streams {
            out.put_u32(s.id.0);
            out.put_u32(s.fd as u32);
            put_bytes(&mut out, &s.pending_up);
            put_bytes(&mut out, &s.pending_down);
            out.put_u8(u8::from(s.up_done));
            out.put_u8(u8::from(s.down_done));
        }
        if let Some(t) = self.parked_at_ms {
            out.put_u64(t);
        }
        out
    }

    pub fn decode(b: &[u8]) -> Result<State, HandoverError> {
        let mut r = Reader(b);
        r.need(6)?;
        if r.0[..4] != MAGIC {
            return Err(HandoverError::Malformed("not a daemon handover"));
        }
        r.0.advance(4);
        let version = r.0.get_u16();
        if version != 1 && version != VERSION {
            return Err(HandoverError::Version(version));
        }
        let link = if r.flag()? {
            Some(r.bytes()?.to_vec())
        } else {
            None
        };
        let n = r.count(MAX_LISTENERS, 5)?;
        let mut listeners = Vec::with_capacity(n);
        for _ in 0..n {
            let kind = match r.u8()? {
                0 => ListenerKind::Link,
                1 => ListenerKind::Admin,
                2 => {
                    let name = r.bytes()?;
                    if name.len() > 255 {
                        return Err(HandoverError::Malformed("a service name too long"));
                    }
                    ListenerKind::Service(
                        String::from_utf8(name.to_vec())
                            .map_err(|_| HandoverError::Malformed("a service name"))?,
                    )
                }
                _ => return Err(HandoverError::Malformed("an unknown listener")),
            };
            listeners.push((kind, r.fd()?));
        }
        let n = r.count(MAX_STREAMS, 26)?;
        let mut streams = Vec::with_capacity(n);
        for _ in 0..n {
            streams.push(StreamEntry {
                id: StreamId(r.u32()?),
                fd: r.fd()?,
                pending_up: r.bytes()?,
                pending_down: r.bytes()?,
                up_done: r.flag()?,
                down_done: r.flag()?,
            });
        }
        let parked_at_ms = if version >= 2 {
            r.need(8)?;
            Some(r.0.get_u64())
        } else {
            None
        };
        if r.0.has_remaining() {
            return Err(HandoverError::Malformed("bytes after the last stream"));
        }
        let mut fds: Vec<RawFd> = listeners
            .iter()
            .map(|(_, fd)| *fd)
            .chain(streams.iter().map(|s| s.fd))
            .collect();
        fds.sort_unstable();
        if fds.windows(2).any(|w| w[0] == w[1]) || fds.first().is_some_and(|f| *f < 3) {
            return Err(HandoverError::Malformed(
                "a descriptor named twice, or stdio",
            ));
        }
        Ok(State {
            link,
            listeners,
            streams,
            parked_at_ms,
        })
    }
}

/// Lets `fd` pass to a process this one starts (clears close-on-exec).
pub fn inherit(fd: RawFd) -> Result<(), HandoverError> {
    // SAFETY: fcntl on a descriptor we own changes only its flags.
    let r = unsafe { libc::fcntl(fd, libc::F_SETFD, 0) };
    if r < 0 {
        return Err(HandoverError::Io("fcntl", std::io::Error::last_os_error()));
    }
    Ok(())
}

/// The socket type of `fd` and whether it listens, if it is a socket.
fn socket_kind(fd: RawFd) -> Option<(libc::c_int, bool)> {
    let get = |opt: libc::c_int| {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `v`, which is that large.
        let r = unsafe {
            libc::getsockopt(fd, libc::SOL_SOCKET, opt, (&raw mut v).cast(), &raw mut len)
        };
        (r == 0).then_some(v)
    };
    Some((get(libc::SO_TYPE)?, get(libc::SO_ACCEPTCONN)? != 0))
}

/// Takes the inherited descriptor `fd` as a listening TCP socket.
pub fn take_listener(fd: RawFd) -> Result<std::net::TcpListener, HandoverError> {
    match socket_kind(fd) {
        Some((libc::SOCK_STREAM, true)) => {
            // SAFETY: the descriptor was handed to this process to own, and is a listening
            // stream socket (checked above); nothing else here holds it.
            let l = unsafe { std::net::TcpListener::from_raw_fd(fd) };
            l.set_nonblocking(true)
                .map_err(|e| HandoverError::Io("listener", e))?;
            close_on_exec(fd);
            Ok(l)
        }
        _ => Err(HandoverError::Descriptor(fd, "a listening TCP socket")),
    }
}

/// Takes the inherited descriptor `fd` as a connected TCP socket.
pub fn take_stream(fd: RawFd) -> Result<std::net::TcpStream, HandoverError> {
    match socket_kind(fd) {
        Some((libc::SOCK_STREAM, false)) => {
            // SAFETY: as in `take_listener`, for a stream socket that does not listen.
            let s = unsafe { std::net::TcpStream::from_raw_fd(fd) };
            s.set_nonblocking(true)
                .map_err(|e| HandoverError::Io("stream", e))?;
            close_on_exec(fd);
            Ok(s)
        }
        _ => Err(HandoverError::Descriptor(fd, "a connected TCP socket")),
    }
}

fn close_on_exec(fd: RawFd) {
    // SAFETY: as in `inherit`.
    unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
}

/// The binary now at this process's path: after an upgrade replaced the file, Linux names the
/// running one `PATH (deleted)`, and the new one is at `PATH`.
pub fn own_path() -> std::io::Result<std::path::PathBuf> {
    let p = std::env::current_exe()?;
    Ok(
        match p.to_str().and_then(|s| s.strip_suffix(" (deleted)")) {
            Some(s) => std::path::PathBuf::from(s),
            None => p,
        },
    )
}

/// A new memfd for a state (close-on-exec).
pub fn memfd() -> Result<std::fs::File, HandoverError> {
    // SAFETY: memfd_create with a valid C string; the result is a new descriptor or -1.
    let memfd = unsafe { libc::memfd_create(c"wanopt-handover".as_ptr(), libc::MFD_CLOEXEC) };
    if memfd < 0 {
        return Err(HandoverError::Io(
            "memfd_create",
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: memfd was just created and is owned here.
    Ok(std::fs::File::from(unsafe { OwnedFd::from_raw_fd(memfd) }))
}

/// What the old process starts the new one with: the memfd the state goes in and the pipe the
/// new process says it is ready on. Made before anything stops, so a system that refuses them
/// (a seccomp filter, no descriptors left) refuses the handover while the streams still move.
#[derive(Debug)]
pub struct Successor {
    mem: std::fs::File,
    ready_rd: OwnedFd,
    ready_wr: OwnedFd,
}

impl Successor {
    pub fn prepare() -> Result<Successor, HandoverError> {
        let mem = memfd()?;
        let mut fds = [0 as RawFd; 2];
        // SAFETY: pipe2 writes two descriptors into the array.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(HandoverError::Io("pipe", std::io::Error::last_os_error()));
        }
        // SAFETY: both descriptors were just created and are owned here.
        let (ready_rd, ready_wr) =
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        Ok(Successor {
            mem,
            ready_rd,
            ready_wr,
        })
    }

    /// Writes `state` to the memfd, starts the binary now at our path with this process's
    /// arguments (the descriptors the state names, the memfd and the pipe inherited), and
    /// waits up to `limit` for the new process to say it took over. Returns its pid.
    pub fn start(self, state: &State, limit: Duration) -> Result<u32, HandoverError> {
        let Successor {
            mut mem,
            ready_rd,
            ready_wr,
        } = self;
        mem.write_all(&state.encode())
            .map_err(|e| HandoverError::Io("state", e))?;
        for fd in state
            .listeners
            .iter()
            .map(|(_, fd)| *fd)
            .chain(state.streams.iter().map(|s| s.fd))
            .chain([mem.as_raw_fd(), ready_wr.as_raw_fd()])
        {
            inherit(fd)?;
        }
        let exe = own_path().map_err(|e| HandoverError::Io("current_exe", e))?;
        let child = std::process::Command::new(&exe)
            .args(std::env::args_os().skip(1))
            .env(ENV, format!("{},{}", mem.as_raw_fd(), ready_wr.as_raw_fd()))
            .spawn()
            .map_err(|e| HandoverError::Io("start the new process", e))?;
        drop(ready_wr);
        let pid = child.id();
        // The new process writes one byte once it holds everything, or exits (then the pipe
        // ends without one).
        let mut ready = std::fs::File::from(ready_rd);
        let mut pfd = libc::pollfd {
            fd: ready.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = libc::c_int::try_from(limit.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: poll on one valid pollfd.
        let n = unsafe { libc::poll(&raw mut pfd, 1, ms) };
        let mut b = [0u8; 1];
        if n == 1 && ready.read(&mut b).ok() == Some(1) {
            drop(child);
            return Ok(pid);
        }
        Err(HandoverError::Refused(format!(
            "the new process (pid {pid}) did not take over within {}s",
            limit.as_secs()
        )))
    }
}

/// The new process after `SIGUSR2`: the state the process before handed to it (see [`ENV`])
/// and the pipe to say it is ready on, if it was started to take a daemon over. The variable
/// is removed, so processes it starts do not see it. (`daemon::inherited` also asks
/// `fdstore.rs`, for a process systemd started after `systemctl restart`.)
pub fn inherited() -> Option<Result<(State, std::fs::File), HandoverError>> {
    let v = std::env::var(ENV).ok()?;
    // SAFETY: called at start, before any thread reads the environment.
    unsafe { std::env::remove_var(ENV) };
    Some(read_inherited(&v))
}

fn read_inherited(v: &str) -> Result<(State, std::fs::File), HandoverError> {
    let (state, ready) = v
        .split_once(',')
        .and_then(|(a, b)| Some((a.parse::<RawFd>().ok()?, b.parse::<RawFd>().ok()?)))
        .ok_or(HandoverError::Malformed("the environment variable"))?;
    if state < 3 || ready < 3 || state == ready {
        return Err(HandoverError::Malformed("the environment variable"));
    }
    // SAFETY: the old process handed these two descriptors to this one to own.
    let (mem, ready) = unsafe {
        (
            std::fs::File::from_raw_fd(state),
            std::fs::File::from_raw_fd(ready),
        )
    };
    close_on_exec(mem.as_raw_fd());
    close_on_exec(ready.as_raw_fd());
    Ok((read_state(mem)?, ready))
}

/// Reads and decodes the state in `mem` (a memfd), at most [`MAX_STATE`] bytes.
pub fn read_state(mut mem: std::fs::File) -> Result<State, HandoverError> {
    let len = mem
        .metadata()
        .map_err(|e| HandoverError::Io("state", e))?
        .len();
    if len > MAX_STATE {
        return Err(HandoverError::Malformed("a state too large"));
    }
    let mut b = Vec::new();
    std::io::Seek::rewind(&mut mem).map_err(|e| HandoverError::Io("state", e))?;
    (&mut mem)
        .take(MAX_STATE)
        .read_to_end(&mut b)
        .map_err(|e| HandoverError::Io("state", e))?;
    State::decode(&b)
}

/// The new process tells the old one it holds everything: the old one exits.
pub fn ready(mut pipe: std::fs::File) {
    let _ = pipe.write_all(&[1]);
}

/// Gives up a descriptor without closing it (it goes to the new process).
pub fn release(fd: impl IntoRawFd) -> RawFd {
    fd.into_raw_fd()
}

// ---------------------------------------------------------------- metrics

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HowLabel {
    how: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusalLabel {
    reason: &'static str,
}

/// Handovers to a new process (`SIGUSR2`, or `systemctl restart` through systemd's file
/// descriptor store): those this process took over, what they carried, the stall, and those
/// this process refused.
#[derive(Debug, Default)]
pub struct HandoverMetrics {
    taken: Family<HowLabel, Counter>,
    streams: Counter,
    stall_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
    refused: Family<RefusalLabel, Counter>,
    /// The link taken over has not resumed yet: its first resumption ends the stall.
    stalled: std::sync::atomic::AtomicBool,
}

impl HandoverMetrics {
    /// Why a handover is refused (the daemon serves on, or drains if systemd is stopping it).
    pub const REFUSALS: [&'static str; 4] = ["binary", "resume", "descriptors", "system"];

    pub fn register(r: &mut Registry) -> Self {
        let m = HandoverMetrics::default();
        for how in ["signal", "restart"] {
            let _ = m.taken.get_or_create(&HowLabel { how });
        }
        for reason in Self::REFUSALS {
            let _ = m.refused.get_or_create(&RefusalLabel { reason });
        }
        r.register(
            "wanopt_handovers_taken",
            "Daemons this process took over: from SIGUSR2 (signal) or from systemd's file \
             descriptor store after systemctl restart (restart)",
            m.taken.clone(),
        );
        r.register(
            "wanopt_handover_streams",
            "Streams a handover carried over to this process",
            m.streams.clone(),
        );
        r.register(
            "wanopt_handover_stall_seconds",
            "Time from the process before parking the streams to the streams going on in this \
             one",
            m.stall_seconds.clone(),
        );
        r.register(
            "wanopt_handovers_refused",
            "Handovers refused before a stream stopped: the binary at our path refuses the \
             config or cannot run (binary), the link cannot resume streams (resume), more \
             descriptors than the unit's FileDescriptorStoreMax (descriptors), or the system \
             refused a memfd or pipe (system)",
            m.refused.clone(),
        );
        m
    }

    /// This process took a daemon over (`how`: `signal` or `restart`) with `streams` streams.
    pub fn taken(&self, how: &'static str, streams: u64) {
        self.taken.get_or_create(&HowLabel { how }).inc();
        self.streams.inc_by(streams);
        self.stalled
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The link resumed after `outage` (counted from the parking when it was taken over).
    pub fn resumed(&self, outage: std::time::Duration) {
        if self
            .stalled
            .swap(false, std::sync::atomic::Ordering::Relaxed)
        {
            self.stall_seconds.inc_by(outage.as_secs_f64());
        }
    }

    /// A handover refused for `reason` (one of [`Self::REFUSALS`]).
    pub fn refused(&self, reason: &'static str) {
        self.refused.get_or_create(&RefusalLabel { reason }).inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_round_trip_and_damage_is_refused() {
        let s = State {
            link: Some(b"link state".to_vec()),
            listeners: vec![
                (ListenerKind::Link, 7),
                (ListenerKind::Admin, 8),
                (ListenerKind::Service("redo".into()), 9),
            ],
            streams: vec![StreamEntry {
                id: StreamId(5),
                fd: 12,
                pending_up: Bytes::from_static(b"up"),
                pending_down: Bytes::from_static(b"down"),
                up_done: true,
                down_done: false,
            }],
            parked_at_ms: Some(1_790_000_000_000),
        };
        let b = s.encode();
        // Without the parking time: version 1, as an earlier build writes it.
        let v1 = State {
            parked_at_ms: None,
            ..s.clone()
        };
        assert_eq!(State::decode(&v1.encode()).expect("v1"), v1);
        assert_eq!(v1.encode()[5], 1);
        assert_eq!(State::decode(&b).expect("decode"), s);
        for n in 0..b.len() {
            assert!(State::decode(&b[..n]).is_err(), "cut at {n}");
        }
        let mut twice = s.clone();
        twice.streams[0].fd = 8;
        assert!(
            State::decode(&twice.encode()).is_err(),
            "a descriptor twice"
        );
        let mut stdio = s.clone();
        stdio.streams[0].fd = 1;
        assert!(State::decode(&stdio.encode()).is_err(), "stdio");
        let mut newer = b.clone();
        newer[5] = 9;
        assert!(matches!(
            State::decode(&newer),
            Err(HandoverError::Version(_))
        ));
        // A huge count or length, in place of a real one, allocates nothing.
        let mut huge = b.clone();
        huge[7..15].copy_from_slice(&u64::MAX.to_be_bytes());
        assert!(State::decode(&huge).is_err());
    }

    fn kinds() -> impl proptest::strategy::Strategy<Value = ListenerKind> {
        use proptest::prelude::*;
        prop_oneof![
            Just(ListenerKind::Link),
            Just(ListenerKind::Admin),
            "[a-z][a-z0-9-]{0,20}".prop_map(ListenerKind::Service),
        ]
    }

    proptest::proptest! {
        /// Any state round-trips whole; any bytes, and any state cut or with a byte changed,
        /// decode to an error or to a state that encodes back to the same bytes, never a panic.
        #[test]
        fn states_round_trip_and_garbage_never_panics(
            link in proptest::option::of(proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64)),
            listeners in proptest::collection::vec(kinds(), 0..4),
            streams in proptest::collection::vec(
                (proptest::prelude::any::<u32>(),
                 proptest::collection::vec(proptest::prelude::any::<u8>(), 0..32),
                 proptest::collection::vec(proptest::prelude::any::<u8>(), 0..32),
                 proptest::prelude::any::<(bool, bool)>()),
                0..6),
            parked_at_ms in proptest::option::of(proptest::prelude::any::<u64>()),
            garbage in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256),
            at in proptest::prelude::any::<usize>(),
            flip in 1u8..=255,
        ) {
            let mut fd = 10;
            let mut next = || { fd += 1; fd };
            let s = State {
                link,
                listeners: listeners.into_iter().map(|k| (k, next())).collect(),
                streams: streams
                    .into_iter()
                    .map(|(id, up, down, (u, d))| StreamEntry {
                        id: StreamId(id),
                        fd: next(),
                        pending_up: Bytes::from(up),
                        pending_down: Bytes::from(down),
                        up_done: u,
                        down_done: d,
                    })
                    .collect(),
                parked_at_ms,
            };
            let b = s.encode();
            proptest::prop_assert_eq!(State::decode(&b).expect("decode"), s);
            let mut bad = b.clone();
            let i = at % bad.len();
            bad[i] ^= flip;
            for input in [&garbage[..], &b[..at % (b.len() + 1)], &bad[..]] {
                if let Ok(st) = State::decode(input) {
                    proptest::prop_assert_eq!(st.encode(), input.to_vec());
                }
            }
        }
    }

    #[test]
    fn descriptors_are_taken_only_as_the_sockets_they_are_said_to_be() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let c = std::net::TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let file = std::fs::File::open("/dev/null").expect("null");
        assert!(matches!(
            take_stream(l.as_raw_fd()),
            Err(HandoverError::Descriptor(..))
        ));
        assert!(matches!(
            take_listener(c.as_raw_fd()),
            Err(HandoverError::Descriptor(..))
        ));
        assert!(take_listener(file.as_raw_fd()).is_err());
        assert!(take_stream(file.as_raw_fd()).is_err());
        let lfd = release(l);
        let taken = take_listener(lfd).expect("a listener");
        assert!(taken.local_addr().is_ok());
        let cfd = release(c);
        let s = take_stream(cfd).expect("a stream");
        assert!(s.peer_addr().is_ok());
    }
}
