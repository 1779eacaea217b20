//! `wanopt-replay replay` and `sink`: play a trace's client side against a sink that plays its
//! server side, through any path (a tunnel's local port, or direct).
//!
//! Causality is kept per connection: a side sends its next bytes only once the other side's bytes
//! that preceded them in the recording have arrived, so a request/response session replays as a
//! session, whatever the path's latency. With `--pace recorded` sends also wait for their
//! recorded time. Each side checks every byte it receives against the trace.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::trace::{Dir, Event};

/// How sends are timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pace {
    /// As soon as causality allows.
    Asap,
    /// Not before their recorded time (relative to the connection's start).
    Recorded,
}

impl Pace {
    pub fn parse(s: &str) -> Result<Pace, String> {
        match s.to_ascii_lowercase().as_str() {
            "asap" | "fast" => Ok(Pace::Asap),
            "recorded" => Ok(Pace::Recorded),
            _ => Err(format!("{s:?} is not asap or recorded")),
        }
    }
}

const PREAMBLE_MAGIC: [u8; 4] = *b"WORP";

/// One step of one side of a connection.
#[derive(Debug, Clone)]
enum Step {
    Send {
        /// Range in the side's own outgoing bytes.
        from: usize,
        to: usize,
        /// Bytes of the other side that must have arrived first.
        after: u64,
        at_us: u64,
    },
    Shut {
        after: u64,
        at_us: u64,
    },
}

/// One connection of a trace, ready to play from either side.
#[derive(Debug, Clone)]
pub struct Script {
    pub conn: u32,
    open_us: u64,
    /// Bytes each way, in order: [to server, to client].
    bytes: [Vec<u8>; 2],
    steps: [Vec<Step>; 2],
}

/// Splits a trace into per-connection scripts.
pub fn scripts(events: &[Event]) -> Vec<Script> {
    let mut map: std::collections::BTreeMap<u32, Script> = Default::default();
    for e in events {
        let s = map.entry(e.conn()).or_insert_with(|| Script {
            conn: e.conn(),
            open_us: e.at_us(),
            bytes: Default::default(),
            steps: Default::default(),
        });
        match e {
            Event::Open { .. } => {}
            Event::Data {
                dir, bytes, at_us, ..
            } => {
                let d = dir.index();
                let after = s.bytes[1 - d].len() as u64;
                let from = s.bytes[d].len();
                s.bytes[d].extend_from_slice(bytes);
                s.steps[d].push(Step::Send {
                    from,
                    to: s.bytes[d].len(),
                    after,
                    at_us: *at_us,
                });
            }
            Event::Shutdown { dir, at_us, .. } => {
                let d = dir.index();
                let after = s.bytes[1 - d].len() as u64;
                s.steps[d].push(Step::Shut {
                    after,
                    at_us: *at_us,
                });
            }
        }
    }
    map.into_values().collect()
}

/// What one side of one connection did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Played {
    pub sent: u64,
    pub received: u64,
}

#[derive(Default)]
struct Progress {
    got: u64,
    error: Option<String>,
    eof: bool,
}

/// Plays one side (`me`) of a connection on `sock`, verifying what the other side sends.
pub fn play(
    sock: TcpStream,
    s: &Script,
    me: Dir,
    pace: Pace,
    start: Instant,
    timeout: Duration,
) -> Result<Played, String> {
    let (mine, theirs) = (me.index(), 1 - me.index());
    let expect = Arc::new(s.bytes[theirs].clone());
    let state = Arc::new((Mutex::new(Progress::default()), Condvar::new()));
    let mut rd = sock.try_clone().map_err(|e| e.to_string())?;
    let _ = rd.set_read_timeout(Some(timeout));
    let reader = {
        let (expect, state) = (expect.clone(), state.clone());
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            let result = loop {
                match rd.read(&mut buf) {
                    Ok(0) => break Ok(true),
                    Ok(n) => {
                        let (lock, cv) = &*state;
                        let mut g = lock.lock().unwrap_or_else(|p| p.into_inner());
                        let at = g.got as usize;
                        let want = expect.get(at..at + n);
                        if want != Some(&buf[..n]) {
                            break Err(if at + n > expect.len() {
                                format!(
                                    "the peer sent more than the {} bytes recorded",
                                    expect.len()
                                )
                            } else {
                                format!("the peer's bytes differ from the recording near byte {at}")
                            });
                        }
                        g.got += n as u64;
                        cv.notify_all();
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => break Err(format!("receive: {e}")),
                }
            };
            let (lock, cv) = &*state;
            let mut g = lock.lock().unwrap_or_else(|p| p.into_inner());
            match result {
                Ok(_) => g.eof = true,
                Err(e) => g.error = Some(e),
            }
            cv.notify_all();
        })
    };
    // Waits until `n` bytes of the other side have arrived (or it failed).
    let wait_for = |n: u64| -> Result<(), String> {
        let (lock, cv) = &*state;
        let mut g = lock.lock().unwrap_or_else(|p| p.into_inner());
        let deadline = Instant::now() + timeout;
        while g.got < n {
            if let Some(e) = &g.error {
                return Err(e.clone());
            }
            if g.eof {
                return Err(format!(
                    "the peer closed after {} of the {n} bytes recorded before our next send",
                    g.got
                ));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "timed out waiting for byte {} of the peer's data",
                    g.got
                ));
            }
            g = cv
                .wait_timeout(g, left)
                .map(|r| r.0)
                .unwrap_or_else(|p| p.into_inner().0);
        }
        Ok(())
    };
    let mut wr = sock;
    let mut sent = 0u64;
    let pace_to = |at_us: u64| {
        if pace == Pace::Recorded {
            let due = start + Duration::from_micros(at_us.saturating_sub(s.open_us));
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
        }
    };
    let mut outcome = Ok(());
    for step in &s.steps[mine] {
        let r = match step {
            Step::Send {
                from,
                to,
                after,
                at_us,
            } => wait_for(*after).and_then(|()| {
                pace_to(*at_us);
                sent += (to - from) as u64;
                wr.write_all(&s.bytes[mine][*from..*to])
                    .map_err(|e| format!("send: {e}"))
            }),
            Step::Shut { after, at_us } => wait_for(*after).map(|()| {
                pace_to(*at_us);
                let _ = wr.shutdown(Shutdown::Write);
            }),
        };
        if r.is_err() {
            outcome = r;
            break;
        }
    }
    // Everything the other side recorded must arrive.
    if outcome.is_ok() {
        outcome = wait_for(expect.len() as u64);
    }
    if outcome.is_err() {
        let _ = wr.shutdown(Shutdown::Both);
    } else if !s.steps[mine]
        .iter()
        .any(|st| matches!(st, Step::Shut { .. }))
    {
        // The recording ended without our half-close: end the connection now.
        let _ = wr.shutdown(Shutdown::Write);
    }
    let _ = reader.join();
    outcome?;
    let g = state.0.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(e) = &g.error {
        return Err(e.clone());
    }
    Ok(Played {
        sent,
        received: g.got,
    })
}

/// The result of a replay.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ReplaySummary {
    pub connections: usize,
    pub bytes_to_server: u64,
    pub bytes_to_client: u64,
    pub seconds: f64,
    pub recorded_seconds: f64,
    pub verified: bool,
}

/// Plays every connection's client side against the sink at `addr`.
pub fn replay(
    addr: &str,
    events: &[Event],
    pace: Pace,
    timeout: Duration,
) -> Result<ReplaySummary, String> {
    let id = crate::trace::identity(events);
    let target = addr
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {addr}: {e}"))?
        .next()
        .ok_or_else(|| format!("cannot resolve {addr}"))?;
    let all = scripts(events);
    let first_us = all.first().map_or(0, |s| s.open_us);
    let recorded_us = events
        .last()
        .map_or(0, Event::at_us)
        .saturating_sub(first_us);
    let start = Instant::now();
    let threads: Vec<_> = all
        .into_iter()
        .map(|s| {
            std::thread::spawn(move || -> Result<Played, String> {
                if pace == Pace::Recorded {
                    let due = start + Duration::from_micros(s.open_us - first_us);
                    std::thread::sleep(due.saturating_duration_since(Instant::now()));
                }
                let mut sock = TcpStream::connect_timeout(&target, timeout).map_err(|e| {
                    format!("connection {}: cannot connect to {target}: {e}", s.conn)
                })?;
                let _ = sock.set_nodelay(true);
                let mut pre = PREAMBLE_MAGIC.to_vec();
                pre.extend_from_slice(&s.conn.to_be_bytes());
                pre.extend_from_slice(&id.to_be_bytes());
                sock.write_all(&pre)
                    .map_err(|e| format!("connection {}: {e}", s.conn))?;
                play(sock, &s, Dir::ToServer, pace, Instant::now(), timeout)
                    .map_err(|e| format!("connection {}: {e}", s.conn))
            })
        })
        .collect();
    let mut sum = ReplaySummary {
        recorded_seconds: recorded_us as f64 / 1e6,
        verified: true,
        ..Default::default()
    };
    let mut first_err = None;
    let mut bar =
        crate::progress::Progress::steps("replay: connections done", threads.len() as u64);
    for t in threads {
        let r = t.join();
        bar.add(1);
        match r {
            Ok(Ok(p)) => {
                sum.connections += 1;
                sum.bytes_to_server += p.sent;
                sum.bytes_to_client += p.received;
            }
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(_) => {
                first_err.get_or_insert("a replay thread panicked".to_string());
            }
        }
    }
    bar.finish();
    sum.seconds = start.elapsed().as_secs_f64();
    match first_err {
        Some(e) => Err(e),
        None => Ok(sum),
    }
}

/// Serves the server side of a trace's connections: each client names its connection in a
/// preamble; a client of another trace is refused. With `once`, returns after every connection
/// of the trace was served (the first error ends it).
pub fn sink(
    listener: TcpListener,
    events: &[Event],
    pace: Pace,
    timeout: Duration,
    once: bool,
) -> Result<usize, String> {
    let id = crate::trace::identity(events);
    let all: Arc<Vec<Script>> = Arc::new(scripts(events));
    let mut served = 0;
    let mut handles = Vec::new();
    let total = all.len();
    for conn in listener.incoming() {
        let Ok(mut sock) = conn else { continue };
        let all = all.clone();
        let h = std::thread::spawn(move || -> Result<(), String> {
            let _ = sock.set_nodelay(true);
            let _ = sock.set_read_timeout(Some(timeout));
            let mut pre = [0u8; 16];
            sock.read_exact(&mut pre)
                .map_err(|e| format!("no replay preamble: {e}"))?;
            let conn = u32::from_be_bytes([pre[4], pre[5], pre[6], pre[7]]);
            let their = u64::from_be_bytes(pre[8..16].try_into().unwrap_or([0; 8]));
            if pre[..4] != PREAMBLE_MAGIC {
                return Err("a client that is not wanopt-replay connected".into());
            }
            if their != id {
                return Err("the replayer plays a different trace than this sink".into());
            }
            let s = all
                .iter()
                .find(|s| s.conn == conn)
                .ok_or_else(|| format!("connection {conn} is not in the trace"))?;
            play(sock, s, Dir::ToClient, pace, Instant::now(), timeout)
                .map(|_| ())
                .map_err(|e| format!("connection {conn}: {e}"))
        });
        if once {
            handles.push(h);
            served += 1;
            if served == total {
                break;
            }
        }
    }
    for h in handles {
        h.join()
            .map_err(|_| "a sink thread panicked".to_string())??;
    }
    Ok(served)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scripts_carry_what_each_side_waits_for() {
        let ev = vec![
            Event::Open { conn: 0, at_us: 0 },
            Event::Data {
                conn: 0,
                at_us: 1,
                dir: Dir::ToServer,
                bytes: b"query".to_vec(),
            },
            Event::Data {
                conn: 0,
                at_us: 5,
                dir: Dir::ToClient,
                bytes: b"rows".to_vec(),
            },
            Event::Data {
                conn: 0,
                at_us: 6,
                dir: Dir::ToClient,
                bytes: b"done".to_vec(),
            },
            Event::Shutdown {
                conn: 0,
                at_us: 7,
                dir: Dir::ToServer,
            },
            Event::Shutdown {
                conn: 0,
                at_us: 8,
                dir: Dir::ToClient,
            },
        ];
        let s = scripts(&ev);
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].bytes[0], b"query");
        assert_eq!(s[0].bytes[1], b"rowsdone");
        // The server's answer waits for the whole query; the client's close for the answer.
        assert!(matches!(s[0].steps[1][0], Step::Send { after: 5, .. }));
        assert!(matches!(s[0].steps[0][1], Step::Shut { after: 8, .. }));
    }

    #[test]
    fn a_session_replays_over_loopback_and_a_wrong_byte_is_caught() {
        let ev = vec![
            Event::Open { conn: 0, at_us: 0 },
            Event::Data {
                conn: 0,
                at_us: 1,
                dir: Dir::ToServer,
                bytes: vec![1; 100_000],
            },
            Event::Data {
                conn: 0,
                at_us: 2,
                dir: Dir::ToClient,
                bytes: vec![2; 7],
            },
            Event::Data {
                conn: 0,
                at_us: 3,
                dir: Dir::ToServer,
                bytes: vec![3; 10],
            },
            Event::Shutdown {
                conn: 0,
                at_us: 4,
                dir: Dir::ToServer,
            },
            Event::Data {
                conn: 0,
                at_us: 5,
                dir: Dir::ToClient,
                bytes: vec![4; 300_000],
            },
            Event::Shutdown {
                conn: 0,
                at_us: 6,
                dir: Dir::ToClient,
            },
            Event::Open { conn: 1, at_us: 7 },
            Event::Data {
                conn: 1,
                at_us: 8,
                dir: Dir::ToServer,
                bytes: b"x".to_vec(),
            },
        ];
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr").to_string();
        let sink_ev = ev.clone();
        let t = std::thread::spawn(move || {
            sink(l, &sink_ev, Pace::Asap, Duration::from_secs(10), true)
        });
        let r = replay(&addr, &ev, Pace::Asap, Duration::from_secs(10)).expect("replay");
        assert_eq!(
            (r.connections, r.bytes_to_server, r.bytes_to_client),
            (2, 100_011, 300_007)
        );
        assert_eq!(t.join().expect("join"), Ok(2));

        // A path that changes a byte is caught.
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr").to_string();
        let bad = std::thread::spawn(move || {
            let (mut s, _) = l.accept().expect("accept");
            let mut b = vec![0u8; 16 + 100_000];
            s.read_exact(&mut b).expect("read");
            s.write_all(&[2, 2, 2, 9, 2, 2, 2]).expect("write");
            std::thread::sleep(Duration::from_millis(200));
        });
        let one: Vec<Event> = ev[..3].to_vec();
        let e = replay(&addr, &one, Pace::Asap, Duration::from_secs(5)).expect_err("caught");
        assert!(e.contains("differ"), "{e}");
        let _ = bad.join();

        // A sink of another trace refuses the replayer.
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr").to_string();
        let mut other = ev.clone();
        other[2] = Event::Data {
            conn: 0,
            at_us: 2,
            dir: Dir::ToClient,
            bytes: vec![9; 7],
        };
        let t =
            std::thread::spawn(move || sink(l, &other, Pace::Asap, Duration::from_secs(5), true));
        assert!(replay(&addr, &ev, Pace::Asap, Duration::from_secs(5)).is_err());
        assert!(t.join().expect("join").is_err());
    }
}
