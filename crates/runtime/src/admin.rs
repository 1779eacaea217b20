//! The admin endpoint: Prometheus scrapes (`GET /metrics`) and health checks (`GET /healthz`)
//! over HTTP/1.1 with keep-alive (hyper's server), on the `admin.listen` address (loopback by
//! default).
//!
//! Requests are hostile input like any other: only `admin.allow` may connect (checked before a
//! byte is read), at most 32 connections at a time; a request head is capped at 8 KiB and must
//! arrive within five seconds, and a connection lives at most two minutes. Anything but those
//! two GETs gets a 404 or 405.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{CONNECTION, CONTENT_TYPE, HOST};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use ipnet::IpNet;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tracing::{debug, warn};

use crate::counters::Counters;
use crate::sync::LogBudget;

/// The largest request head (hyper's smallest buffer limit).
const MAX_HEAD: usize = 8 * 1024;
/// A request head must arrive within this, including the wait for the next one on a kept-alive
/// connection.
const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// A connection is asked to close after this, so a slow reader cannot hold a slot for ever.
const MAX_LIFETIME: Duration = Duration::from_secs(120);
/// Connections served at once; one beyond them is closed unanswered.
const MAX_CONNECTIONS: usize = 32;
/// The largest answer `fetch` reads.
const MAX_FETCH: usize = 64 << 20;

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
        crate::spawn(async move {
            if let Err(e) = connection(sock, counters).await {
                debug!(from = %from, error = %e, "admin connection ended");
            }
            drop(slot);
        });
    }
}

async fn connection(sock: TcpStream, counters: Arc<Counters>) -> Result<(), hyper::Error> {
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let counters = counters.clone();
        async move { Ok::<_, Infallible>(answer(&req, &counters)) }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT)
        .max_buf_size(MAX_HEAD)
        .serve_connection(TokioIo::new(sock), service);
    tokio::pin!(conn);
    tokio::select! {
        r = conn.as_mut() => r,
        () = tokio::time::sleep(MAX_LIFETIME) => {
            // Finish the answer under way, then close.
            conn.as_mut().graceful_shutdown();
            match tokio::time::timeout(HEAD_TIMEOUT, conn).await {
                Ok(r) => r,
                Err(_) => Ok(()),
            }
        }
    }
}

fn answer(req: &Request<Incoming>, counters: &Counters) -> Response<Full<Bytes>> {
    let (code, ctype, body) = match (req.method(), req.uri().path()) {
        // The body is OpenMetrics text (`# EOF`, `_total` samples of `counter` families), and
        // says so: Prometheus parses it as such.
        (&Method::GET, "/metrics") => (
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            counters.encode(),
        ),
        (&Method::GET, "/healthz") => (StatusCode::OK, "text/plain", "ok\n".into()),
        (&Method::GET, _) => (
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found: try /metrics\n".into(),
        ),
        _ => (
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "only GET\n".into(),
        ),
    };
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = code;
    r.headers_mut()
        .insert(CONTENT_TYPE, hyper::header::HeaderValue::from_static(ctype));
    r
}

/// Fetches `path` from an admin endpoint (used by `wanoptd stats`); returns the body of a 200.
pub async fn fetch(addr: std::net::SocketAddr, path: &str) -> Result<String, String> {
    let work = async {
        let s = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s))
            .await
            .map_err(|e| format!("{addr}: {e}"))?;
        crate::spawn(conn);
        let req = Request::get(path)
            .header(HOST, addr.to_string())
            .header(CONNECTION, "close")
            .body(http_body_util::Empty::<Bytes>::new())
            .map_err(|e| format!("request: {e}"))?;
        let res = send
            .send_request(req)
            .await
            .map_err(|e| format!("{addr}: {e}"))?;
        let status = res.status();
        let body = Limited::new(res.into_body(), MAX_FETCH)
            .collect()
            .await
            .map_err(|e| format!("read: {e}"))?
            .to_bytes();
        if status != StatusCode::OK {
            return Err(format!("{addr}{path}: {status}"));
        }
        Ok(String::from_utf8_lossy(&body).into_owned())
    };
    tokio::time::timeout(Duration::from_secs(10), work)
        .await
        .map_err(|_| format!("{addr}: timed out"))?
}
