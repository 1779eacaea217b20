//! The test server (`wanopt-replay server`, oratcptest's `-server`): accepts clients, reads their
//! messages, optionally writes each to a file and syncs it (a standby redo log write), and
//! acknowledges SYNC messages with the time the write took.

use std::fs::{File, OpenOptions};
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
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

/// Serves clients until the process ends; each connection runs on its own thread.
pub fn serve(listener: TcpListener, opts: &ServerOpts) {
    let file: Arc<Mutex<Option<File>>> = Arc::new(Mutex::new(None));
    for conn in listener.incoming() {
        let Ok(s) = conn else { continue };
        let opts = opts.clone();
        let file = file.clone();
        std::thread::spawn(move || {
            let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
            if let Err(e) = handle(s, &opts, &file) {
                eprintln!("wanopt-replay server: client {peer}: {e}");
            }
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
        if buf.len() < len {
            buf.resize(len, 0);
        }
        rd.read_exact(&mut buf[..len])?;
        bytes += len as u64;
        messages += 1;
        let mut disk_us = 0u32;
        if write {
            let t = Instant::now();
            write_synced(file, &opts.file, &buf[..len])?;
            disk_us = u32::try_from(t.elapsed().as_micros()).unwrap_or(u32::MAX);
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

/// Appends a message to the shared file and syncs it, as a standby writes its redo log.
fn write_synced(
    file: &Mutex<Option<File>>,
    path: &std::path::Path,
    data: &[u8],
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
    f.write_all(data)?;
    f.sync_data()
}
