//! The TCP socket under a link's TLS. Reads are buffered once the peer is authenticated, because
//! rustls asks for at most 4 KiB at a time, which would cost three `recv` calls per 8 KiB record
//! instead of one; before that the socket holds no buffer, so unauthenticated connections cost
//! little memory.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// Read size for local sockets and the link.
pub(crate) const READ_CHUNK: usize = 64 * 1024;

/// A TCP stream with a read buffer that is allocated only when [`Wire::buffer`] asks for one.
pub(crate) struct Wire {
    tcp: TcpStream,
    buf: Vec<u8>,
    pos: usize,
    filled: usize,
}

impl Wire {
    pub(crate) fn new(tcp: TcpStream) -> Wire {
        Wire {
            tcp,
            buf: Vec::new(),
            pos: 0,
            filled: 0,
        }
    }

    /// Buffers reads from now on, `cap` bytes at a time (an authenticated link).
    pub(crate) fn buffer(&mut self, cap: usize) {
        if self.buf.len() < cap {
            self.buf.resize(cap, 0);
        }
    }

    pub(crate) fn get_ref(&self) -> &TcpStream {
        &self.tcp
    }
}

impl AsyncRead for Wire {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        if me.pos == me.filled {
            // Nothing buffered: a large read (or no buffer) goes straight to the caller.
            if out.remaining() >= me.buf.len() {
                return Pin::new(&mut me.tcp).poll_read(cx, out);
            }
            let mut rb = ReadBuf::new(&mut me.buf);
            ready!(Pin::new(&mut me.tcp).poll_read(cx, &mut rb))?;
            me.filled = rb.filled().len();
            me.pos = 0;
        }
        let n = (me.filled - me.pos).min(out.remaining());
        out.put_slice(&me.buf[me.pos..me.pos + n]);
        me.pos += n;
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Wire {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write(cx, b)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Bytes come out in order whatever the mix of small and large reads, buffered or not.
    #[tokio::test]
    async fn reads_are_exact_buffered_or_not() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("socket");
        let addr = l.local_addr().expect("addr");
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let sent = data.clone();
        let writer = crate::spawn(async move {
            let mut s = TcpStream::connect(addr).await.expect("socket");
            s.write_all(&sent).await.expect("socket");
        });
        let (tcp, _) = l.accept().await.expect("socket");
        let mut w = Wire::new(tcp);
        let mut got = Vec::new();
        let mut small = [0u8; 1000];
        let n = w.read(&mut small).await.expect("socket");
        got.extend_from_slice(&small[..n]);
        w.buffer(64 * 1024);
        let mut sizes = [1usize, 4096, 100_000, 17].into_iter().cycle();
        loop {
            let mut b = vec![0u8; sizes.next().unwrap_or(1)];
            let n = w.read(&mut b).await.expect("socket");
            if n == 0 {
                break;
            }
            got.extend_from_slice(&b[..n]);
        }
        writer.await.expect("socket");
        assert_eq!(got, data);
    }
}
