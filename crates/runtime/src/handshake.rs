//! What both sides of link establishment share once TLS is up: reading a connection's first
//! frame (its hello) within a deadline, and recording the peer certificate's expiry.

use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt};
use wanopt_proto::{Frame, FrameError};

use crate::peer::Peer;
use crate::tls;

/// Reads the first frame of a new connection (a hello, after TLS authenticated the peer) with a
/// deadline; returns the buffer, which still holds the frame, and the frame's length.
pub(crate) async fn read_first_frame<R: AsyncRead + Unpin>(
    rd: &mut R,
    deadline: Duration,
) -> Result<(BytesMut, Frame, usize), String> {
    let mut buf = BytesMut::with_capacity(4096);
    let end = tokio::time::Instant::now() + deadline;
    loop {
        // The link's own limit: a hello that offers many saved caches is larger than a
        // read's worth, and a smaller limit here would refuse every reconnect of such a peer.
        match Frame::check(&buf, wanopt_proto::HELLO_MAX) {
            Ok(n) => {
                let f = Frame::parse(bytes::Bytes::copy_from_slice(&buf[..n]))
                    .map_err(|e| e.to_string())?;
                return Ok((buf, f, n));
            }
            Err(FrameError::Incomplete) => {}
            Err(e) => return Err(e.to_string()),
        }
        match tokio::time::timeout_at(end, rd.read_buf(&mut buf)).await {
            Err(_) => return Err("no hello in time".into()),
            Ok(Ok(0)) => return Err("closed before its hello".into()),
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(format!("read: {e}")),
        }
    }
}

/// Records when the peer's certificate expires (the alert rule warns ahead of it).
pub(crate) fn record_peer_expiry(
    peer: &Peer,
    certs: Option<&[rustls::pki_types::CertificateDer<'_>]>,
) {
    if let Some(t) = certs
        .and_then(|c| c.first())
        .and_then(|c| tls::not_after(c))
    {
        peer.counters.certs.set("peer", t);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// A first frame larger than a read's worth (a hello offering many saved caches) is read
    /// whole, up to the link's own hello limit; beyond it the connection is refused.
    #[tokio::test]
    async fn the_first_frame_may_be_as_large_as_the_link_accepts_a_hello() {
        for (len, ok) in [
            (20_000usize, true),
            (wanopt_proto::HELLO_MAX as usize + 1, false),
        ] {
            let mut frame = BytesMut::new();
            Frame::Data {
                stream: wanopt_proto::frame::StreamId(1),
                offset: 0,
                fin: false,
                data: bytes::Bytes::from(vec![7u8; len]),
            }
            .encode(&mut frame);
            let (mut a, mut b) = tokio::io::duplex(1 << 20);
            let writer = crate::spawn(async move {
                let _ = a.write_all(&frame).await;
                a
            });
            let r = read_first_frame(&mut b, Duration::from_secs(5)).await;
            assert_eq!(r.is_ok(), ok, "{len}: {:?}", r.err());
            drop(b);
            let _ = writer.await;
        }
    }
}
