//! The admin endpoint: a minimal HTTP/1.1 server for Prometheus scrapes (`GET /metrics`) and
//! health checks (`GET /healthz`), on the `admin.listen` address (loopback by default).
//!
//! Requests are hostile input like any other: only `admin.allow` may connect, at most 32 at a
//! time; the head is capped at 8 KiB and must arrive within five seconds; anything but those two
//! GETs gets a 404 or 405, and every connection is closed after one response.

use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tracing::{debug, warn};

use crate::counters::Counters;
use crate::gate::LogBudget;

const MAX_HEAD: usize = 8 * 1024;

/// Requests answered at once; a connection beyond them is closed unanswered.
const MAX_CONNECTIONS: usize = 32;

static OUTSIDERS: LogBudget = LogBudget::new(Duration::from_secs(10), 10);

/// Serves the admin endpoint until the task is dropped, to clients in `allow` (empty: any,
/// which the config permits only on loopback).
pub async fn serve(listener: TcpListener, allow: Vec<IpNet>, counters: Arc<Counters>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (sock, from) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                warn!(error = %e, "admin accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        if !crate::config::allowed(&allow, from.ip()) {
            counters.admin.refused("allow");
            if let Some(suppressed) = OUTSIDERS.take(std::time::Instant::now()) {
                warn!(from = %from, suppressed, "admin endpoint: refused a client outside admin.allow");
            }
            crate::sockopt::abort(&sock);
            continue;
        }
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            counters.admin.refused("busy");
            crate::sockopt::abort(&sock);
            continue;
        };
        let counters = counters.clone();
        tokio::spawn(async move {
            if let Err(e) =
                tokio::time::timeout(Duration::from_secs(5), answer(sock, &counters)).await
            {
                debug!(from = %from, error = %e, "admin request timed out");
            }
            drop(slot);
        });
    }
}

async fn answer(mut sock: TcpStream, counters: &Counters) {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        if head.len() >= MAX_HEAD {
            let _ = sock
                .write_all(&response(431, "text/plain", "request head too large\n"))
                .await;
            return;
        }
        match sock.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let line = head.split(|b| *b == b'\r').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split(' ');
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    let reply = match (method, path) {
        ("GET", "/metrics") => response(
            200,
            "text/plain; version=0.0.4; charset=utf-8",
            &counters.encode(),
        ),
        ("GET", "/healthz") => response(200, "text/plain", "ok\n"),
        ("GET", _) => response(404, "text/plain", "not found: try /metrics\n"),
        _ => response(405, "text/plain", "only GET\n"),
    };
    let _ = sock.write_all(&reply).await;
    let _ = sock.shutdown().await;
}

fn response(code: u16, ctype: &str, body: &str) -> Vec<u8> {
    let reason = match code {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        _ => "Request Header Fields Too Large",
    };
    format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Fetches `path` from an admin endpoint (used by `wanoptd stats`); returns the body of a 200.
pub async fn fetch(addr: std::net::SocketAddr, path: &str) -> Result<String, String> {
    let mut s = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(addr))
        .await
        .map_err(|_| format!("connect {addr}: timed out"))?
        .map_err(|e| format!("connect {addr}: {e}"))?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes())
        .await
        .map_err(|e| format!("write: {e}"))?;
    let mut body = Vec::new();
    tokio::time::timeout(
        Duration::from_secs(10),
        s.take(64 << 20).read_to_end(&mut body),
    )
    .await
    .map_err(|_| "read: timed out".to_string())?
    .map_err(|e| format!("read: {e}"))?;
    let text = String::from_utf8_lossy(&body);
    let (head, body) = text.split_once("\r\n\r\n").ok_or("not an HTTP response")?;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(head.lines().next().unwrap_or("bad response").to_string());
    }
    Ok(body.to_string())
}
