//! The test server (`wanopt-replay server`, oratcptest's `-server`): accepts clients, reads their
//! messages, optionally writes each to a file and syncs it (a standby redo log write), and
//! acknowledges SYNC messages with the time the write took.

use std::fs::{File, OpenOptions};
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::proto::{self, FLAG_SYNC, FLAG_WRITE, ProtoError};

/// The write file is wrapped around at this size, so a long test does not fill the disk.
const FILE_WRAP: u64 = 1 << 30;

#[derive(Debug, Clone)]
pub struct ServerOpts {
    pub bind: SocketAddr,
    /// File for the disk-write test (`-file`, default `oratcp.tmp`).
    pub file: PathBuf,
    /// `SO_RCVBUF` of accepted sockets (`-sockbuf`); `None` keeps the system default.
    pub sockbuf: Option<usize>,
}

/// Binds the server's listener (so a caller learns the port before serving).
pub fn bind(opts: &ServerOpts) -> std::io::Result<TcpListener> {
    let sock = socket2::Socket::new(
        socket2::Domain::for_address(opts.bind),
        socket2::Type::STREAM,
        None,
    )?;
    sock.set_reuse_address(true)?;
    if let Some(n) = opts.sockbuf {
        // Set on the listener so accepted sockets inherit it (and the window scale fits it).
        sock.set_recv_buffer_size(n)?;
    }
    sock.bind(&opts.bind.into())?;
    sock.listen(128)?;
    Ok(sock.into())
}

/// Clients served at once (a thread each); more are closed at once.
pub const MAX_CLIENTS: usize = 256;
/// A message is read (and written to the file) in pieces of at most this size, whatever length
/// the client announces.
const PIECE: usize = 1 << 20;

/// Serves clients until the process ends; each connection runs on its own thread, at most
/// [`MAX_CLIENTS`] at once.
pub fn serve(listener: TcpListener, opts: &ServerOpts) {
    let file: Arc<Mutex<Option<File>>> = Arc::new(Mutex::new(None));
    let clients = Arc::new(AtomicUsize::new(0));
    let mut refused = 0u64;
    for conn in listener.incoming() {
        let Ok(s) = conn else { continue };
        if clients.fetch_add(1, Ordering::AcqRel) >= MAX_CLIENTS {
            clients.fetch_sub(1, Ordering::AcqRel);
            refused += 1;
            if refused.is_power_of_two() {
                eprintln!(
                    "wanopt-replay server: {refused} clients refused: {MAX_CLIENTS} are served at once"
                );
            }
            continue;
        }
        let (opts, file, clients) = (opts.clone(), file.clone(), clients.clone());
        std::thread::spawn(move || {
            let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
            if let Err(e) = handle(s, &opts, &file) {
                eprintln!("wanopt-replay server: client {peer}: {e}");
            }
            clients.fetch_sub(1, Ordering::AcqRel);
        });
    }
}

fn handle(s: TcpStream, opts: &ServerOpts, file: &Mutex<Option<File>>) -> Result<(), ProtoError> {
    let _ = s.set_nodelay(true);
    let mut rd = BufReader::with_capacity(256 * 1024, s.try_clone()?);
    let mut wr = BufWriter::new(s);
    let flags = proto::read_request(&mut rd)?;
    proto::write_ready(&mut wr)?;
    wr.flush()?;
    let (sync, write) = (flags & FLAG_SYNC != 0, flags & FLAG_WRITE != 0);
    let mut buf = Vec::new();
    let (mut bytes, mut messages) = (0u64, 0u64);
    while let Some(len) = proto::read_len(&mut rd)? {
        let len = len as usize;
        bytes += len as u64;
        messages += 1;
        let mut disk_us = 0u32;
        if write {
            let t = Instant::now();
            write_synced(file, &opts.file, &mut rd, len, &mut buf)?;
            disk_us = u32::try_from(t.elapsed().as_micros()).unwrap_or(u32::MAX);
        } else {
            let got = std::io::copy(&mut (&mut rd).take(len as u64), &mut std::io::sink())?;
            if got < len as u64 {
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
            }
        }
        if sync {
            wr.write_all(&disk_us.to_be_bytes())?;
            wr.flush()?;
        }
    }
    proto::write_summary(&mut wr, bytes, messages)?;
    wr.flush()?;
    Ok(())
}

/// Appends a message of `len` bytes read from `rd` to the shared file, in pieces through `buf`,
/// and syncs it, as a standby writes its redo log.
fn write_synced(
    file: &Mutex<Option<File>>,
    path: &std::path::Path,
    rd: &mut impl Read,
    len: usize,
    buf: &mut Vec<u8>,
) -> std::io::Result<()> {
    let mut g = file.lock().unwrap_or_else(|p| p.into_inner());
    if g.is_none() {
        *g = Some(
            OpenOptions::new()
                .create(true)
                .write(true)
                .truncate(true)
                .open(path)?,
        );
    }
    let Some(f) = g.as_mut() else {
        return Ok(());
    };
    if f.metadata()?.len() > FILE_WRAP {
        f.set_len(0)?;
        std::io::Seek::rewind(f)?;
    }
    let mut left = len;
    while left > 0 {
        let n = left.min(PIECE);
        buf.resize(n, 0);
        rd.read_exact(&mut buf[..n])?;
        f.write_all(&buf[..n])?;
        left -= n;
    }
    f.sync_data()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Beyond MAX_CLIENTS at once, clients are closed at once.
    #[test]
    fn clients_are_bounded() {
        let dir = tempfile::tempdir().expect("tempdir");
        let opts = ServerOpts {
            bind: "127.0.0.1:0".parse().expect("addr"),
            file: dir.path().join("f"),
            sockbuf: None,
        };
        let l = bind(&opts).expect("bind");
        let addr = l.local_addr().expect("addr");
        std::thread::spawn(move || serve(l, &opts));
        let held: Vec<TcpStream> = (0..MAX_CLIENTS)
            .map(|_| TcpStream::connect(addr).expect("connect"))
            .collect();
        // The accept loop runs in order: once the last held one is served, the next is refused.
        std::thread::sleep(std::time::Duration::from_millis(300));
        let mut extra = TcpStream::connect(addr).expect("connect");
        extra
            .set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .expect("timeout");
        let mut b = [0u8; 1];
        let r = extra.read(&mut b);
        let closed = match &r {
            Ok(0) => true,
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
            Ok(_) => false,
        };
        assert!(closed, "not refused: {r:?}");
        drop(held);
    }
}
