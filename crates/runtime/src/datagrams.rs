//! The latency lane's datagrams on the wire (see [`wanopt_proto::datagram`]): each write's
//! pieces also go as sealed UDP datagrams beside the lane's TCP copies, three times (at once,
//! then half a copy spacing and one and a half spacings later, between the TCP copies; 5 ms
//! where the copies leave back to back), and a piece that arrives first is delivered without
//! waiting for a TCP copy that lost a segment.
//!
//! The listening side takes them on one socket on the link listener's address and port; the
//! connecting side binds a socket of its own for each lane, sends to the address its lane
//! connection dialed, and says where it is with an empty datagram every second. Keys come from
//! the lane's TLS session, so only the peer that made the lane can send into it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::UdpSocket;
use tracing::warn;
use wanopt_proto::datagram::{self, DatagramError, EXPORT_LABEL, EXPORT_LEN, Opener, Sealer};

/// The three sends of a write's datagrams, in spacings after the first: at once, then between
/// the first and second TCP copies, then between the second and third.
const SENDS: [f64; 3] = [0.0, 0.5, 1.5];
/// A connecting side that sent nothing for this long sends an empty datagram (the listening
/// side learns where to send from it).
pub const HELLO_EVERY: Duration = Duration::from_secs(1);

/// `link.lane_datagrams`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Setting {
    /// While the lane has four or more connections: `redundancy: auto` on a lossy lane quiet
    /// enough for five ([`crate::redundancy::AUTO_FIVE_SHARE`]), where the eight sends of each
    /// write come to about a sixth of the link at most; or `redundancy` 4 or 5.
    #[default]
    Auto,
    /// Whenever the peer takes them.
    On,
    /// Never; not offered to the peer.
    Off,
}

impl Setting {
    pub fn parse(v: &str) -> Result<Self, String> {
        match v {
            "auto" => Ok(Setting::Auto),
            "on" => Ok(Setting::On),
            "off" => Ok(Setting::Off),
            _ => Err(format!("{v:?} is not auto, on or off")),
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Setting::Auto => "auto",
            Setting::On => "on",
            Setting::Off => "off",
        }
    }

    /// Whether a lane carried by `copies` connections sends datagrams.
    pub fn sends(self, copies: usize) -> bool {
        match self {
            Setting::Auto => copies >= 4,
            Setting::On => true,
            Setting::Off => false,
        }
    }
}

/// One lane's datagram state: its keys, the socket, and where the peer takes them.
#[derive(Debug)]
pub(crate) struct LaneDatagrams {
    sealer: Sealer,
    opener: Opener,
    socket: Arc<UdpSocket>,
    /// Where the peer's datagrams go: the dialed address (connecting side), or the source of
    /// the newest datagram that opened (listening side); `None` until one did.
    to: Option<SocketAddr>,
    last_sent: Option<Instant>,
}

impl LaneDatagrams {
    /// The datagrams of lane `id`, keyed from `exported` (see [`export`]).
    pub fn new(
        exported: &[u8; EXPORT_LEN],
        id: u64,
        connecting: bool,
        socket: Arc<UdpSocket>,
        to: Option<SocketAddr>,
    ) -> Self {
        let (send, receive) = datagram::keys(exported, connecting);
        LaneDatagrams {
            sealer: Sealer::new(&send, id),
            opener: Opener::new(&receive, id),
            socket,
            to,
            last_sent: None,
        }
    }

    /// The lane's id.
    pub fn lane(&self) -> u64 {
        self.opener.lane()
    }

    /// The socket the lane's datagrams use.
    pub fn socket(&self) -> Arc<UdpSocket> {
        self.socket.clone()
    }

    /// True if `socket` is this lane's.
    pub fn uses(&self, socket: &Arc<UdpSocket>) -> bool {
        Arc::ptr_eq(&self.socket, socket)
    }

    /// Seals `bytes` at `offset` of the lane and sends them at their times; returns the bytes
    /// the first send put on the wire (each later send puts as many).
    pub fn send(&mut self, offset: u64, bytes: &[u8], spacing: Duration) -> u64 {
        let Some(to) = self.to else {
            return 0;
        };
        let sealed = self.sealer.seal(offset, bytes);
        let wire: u64 = sealed.iter().map(|d| d.len() as u64).sum();
        send_all(&self.socket, &sealed, to);
        self.last_sent = Some(Instant::now());
        if !spacing.is_zero() && !bytes.is_empty() {
            let socket = self.socket.clone();
            let start = tokio::time::Instant::now();
            crate::spawn(async move {
                for later in &SENDS[1..] {
                    tokio::time::sleep_until(start + spacing.mul_f64(*later)).await;
                    send_all(&socket, &sealed, to);
                }
            });
        }
        wire * if spacing.is_zero() {
            1
        } else {
            SENDS.len() as u64
        }
    }

    /// Opens a datagram of this lane: its piece's offset and bytes. On the listening side
    /// (`learn`) the newest datagram yet that opened tells where to send from now on.
    pub fn open<'a>(
        &mut self,
        datagram: &'a mut [u8],
        from: SocketAddr,
        learn: bool,
    ) -> Result<(u64, &'a [u8]), DatagramError> {
        let (offset, piece, newest) = self.opener.open(datagram)?;
        if learn && newest {
            self.to = Some(from);
        }
        Ok((offset, piece))
    }

    /// True when nothing was sent for [`HELLO_EVERY`].
    pub fn quiet(&self, now: Instant) -> bool {
        self.last_sent
            .is_none_or(|t| now.saturating_duration_since(t) >= HELLO_EVERY)
    }
}

/// Sends each datagram now, straight to the socket (not through tokio's readiness, which
/// would refuse a socket it has not yet seen writable); a full socket buffer drops one, and
/// the TCP copies bring its bytes.
fn send_all(socket: &UdpSocket, datagrams: &[Vec<u8>], to: SocketAddr) {
    let sock = socket2::SockRef::from(socket);
    let to = socket2::SockAddr::from(to);
    for d in datagrams {
        let _ = sock.send_to(d, &to);
    }
}

/// The key material of a lane named `id`, exported from its first connection's TLS session.
pub fn export<D>(conn: &rustls::ConnectionCommon<D>, id: u64) -> Option<[u8; EXPORT_LEN]> {
    conn.export_keying_material([0u8; EXPORT_LEN], EXPORT_LABEL, Some(&id.to_be_bytes()))
        .ok()
}

/// The listening side's socket: UDP on the link listener's address (`SO_REUSEPORT`, so a
/// process taking the daemon over binds it beside this one). `None`, warned, if it cannot be
/// bound: the lane then goes without datagrams.
pub fn bind_listening(addr: SocketAddr) -> Option<Arc<UdpSocket>> {
    let bind = || -> std::io::Result<UdpSocket> {
        let s = socket2::Socket::new(
            socket2::Domain::for_address(addr),
            socket2::Type::DGRAM,
            None,
        )?;
        s.set_reuse_address(true)?;
        s.set_reuse_port(true)?;
        s.bind(&addr.into())?;
        s.set_nonblocking(true)?;
        UdpSocket::from_std(s.into())
    };
    match bind() {
        Ok(s) => Some(Arc::new(s)),
        Err(e) => {
            warn!(addr = %addr, error = %e, "cannot bind the latency lane's datagram socket; the lane goes without datagrams");
            None
        }
    }
}

/// The connecting side's socket for one lane, toward `to` (the address its lane dialed).
pub fn bind_connecting(to: SocketAddr) -> Option<Arc<UdpSocket>> {
    let any: SocketAddr = if to.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let bind = || -> std::io::Result<UdpSocket> {
        let s = std::net::UdpSocket::bind(any)?;
        s.set_nonblocking(true)?;
        UdpSocket::from_std(s)
    };
    match bind() {
        Ok(s) => Some(Arc::new(s)),
        Err(e) => {
            warn!(addr = %to, error = %e, "cannot bind the latency lane's datagram socket; the lane goes without datagrams");
            None
        }
    }
}
