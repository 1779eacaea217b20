//! Shared harness of the end-to-end tests: certificates, config files, real `wanoptd` processes
//! with their logs, deterministic payloads, test servers and a killable TCP relay.

#![allow(dead_code)]

pub mod args;
pub mod pg;
pub mod pgserver;
pub mod report;
pub mod sink;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Path of a workspace binary, built by `cargo build --workspace` before the tests run.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test exe path");
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} is missing: run `cargo build --workspace` before `cargo test` (README: Testing)",
        p.display()
    );
    p
}

/// Every `.rs` file below the folders `dirs`, sorted.
pub fn rust_files(dirs: &[PathBuf]) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut todo = dirs.to_vec();
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).expect("dir").flatten() {
            let p = e.path();
            if p.is_dir() {
                todo.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    files.sort();
    files
}

/// A temporary folder with site certificates under one CA.
pub struct Certs {
    pub dir: tempfile::TempDir,
}

impl Certs {
    pub fn new(sites: &[&str]) -> Certs {
        let dir = tempfile::tempdir().expect("tempdir");
        let names: Vec<String> = sites.iter().map(|s| s.to_string()).collect();
        wanopt_runtime::tls::create_site_certs(dir.path(), &names, &Default::default())
            .expect("certs");
        Certs { dir }
    }
    pub fn path(&self) -> &Path {
        self.dir.path()
    }
    /// The `tls:` section for `site`, using `cert_site`'s key pair (normally the same name).
    pub fn tls_yaml(&self, cert_site: &str) -> String {
        let d = self.path().display();
        format!("tls:\n  ca: {d}/ca.pem\n  cert: {d}/{cert_site}.pem\n  key: {d}/{cert_site}.key\n")
    }
}

/// A running `wanoptd` with its captured log.
pub struct Daemon {
    pub name: String,
    child: Option<Child>,
    log: Arc<Mutex<Vec<String>>>,
    cfg_path: PathBuf,
    _cfg_dir: tempfile::TempDir,
}

impl Daemon {
    /// Writes `yaml` to a config file and starts `wanoptd -c` on it.
    pub fn start(name: &str, yaml: &str) -> Daemon {
        Self::start_in(None, name, yaml)
    }

    /// Like [`start`](Self::start), inside network namespace `netns` when given.
    pub fn start_in(netns: Option<&str>, name: &str, yaml: &str) -> Daemon {
        Self::start_env(netns, name, yaml, &[])
    }

    /// Like [`start_in`](Self::start_in), with extra environment variables.
    pub fn start_env(netns: Option<&str>, name: &str, yaml: &str, env: &[(&str, &str)]) -> Daemon {
        Self::start_bin(&bin("wanoptd"), netns, name, yaml, env)
    }

    /// Like [`start_env`](Self::start_env), running the `wanoptd` binary at `exe` (another
    /// build's, for interoperation).
    pub fn start_bin(
        exe: &Path,
        netns: Option<&str>,
        name: &str,
        yaml: &str,
        env: &[(&str, &str)],
    ) -> Daemon {
        let cfg_dir = tempfile::tempdir().expect("tempdir");
        let path = cfg_dir.path().join(format!("{name}.yaml"));
        std::fs::write(&path, yaml).expect("write config");
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(exe);
                c
            }
            None => Command::new(exe),
        };
        let mut child = cmd
            .arg("-c")
            .arg(&path)
            .env("RUST_LOG", "info,wanopt_runtime=debug")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn wanoptd");
        let log = Arc::new(Mutex::new(Vec::new()));
        let stderr = child.stderr.take().expect("stderr");
        let l2 = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                l2.lock().expect("log").push(line);
            }
        });
        Daemon {
            name: name.to_string(),
            child: Some(child),
            log,
            cfg_path: path,
            _cfg_dir: cfg_dir,
        }
    }

    /// The config file the daemon runs with (rewrite it, then [`signal`](Self::signal) SIGHUP).
    pub fn config_path(&self) -> &Path {
        &self.cfg_path
    }

    /// Sends a signal without waiting.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill with a valid pid and signal number.
        unsafe {
            libc::kill(self.pid() as i32, sig);
        }
    }

    /// Process id of the running daemon.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    pub fn log(&self) -> Vec<String> {
        self.log.lock().expect("log").clone()
    }

    pub fn count(&self, needle: &str) -> usize {
        self.log().iter().filter(|l| l.contains(needle)).count()
    }

    /// Waits until `n` log lines contain `needle`; panics with the log after `timeout`.
    pub fn wait_log_n(&self, needle: &str, n: usize, timeout: Duration) -> String {
        let end = Instant::now() + timeout;
        loop {
            let lines: Vec<String> = self
                .log()
                .into_iter()
                .filter(|l| l.contains(needle))
                .collect();
            if lines.len() >= n {
                return lines[n - 1].clone();
            }
            if Instant::now() > end {
                panic!(
                    "{}: no {n}x {needle:?} within {timeout:?}; log:\n{}",
                    self.name,
                    self.log().join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn wait_log(&self, needle: &str, timeout: Duration) -> String {
        self.wait_log_n(needle, 1, timeout)
    }

    /// The address a listener was bound to (`kind` is `link` or a service name).
    pub fn bound(&self, what: &str) -> SocketAddr {
        let needle = if what == "link" || what == "admin" {
            format!("bound kind=\"{what}\"")
        } else {
            format!("service={what} addr=")
        };
        let line = self.wait_log(&needle, Duration::from_secs(10));
        let addr = line
            .split_whitespace()
            .find_map(|t| t.strip_prefix("addr="))
            .expect("addr field");
        addr.trim_matches('"').parse().expect("socket address")
    }

    /// Sends a signal and waits for the exit status.
    pub fn stop(&mut self, signal: i32) -> std::process::ExitStatus {
        self.signal(signal);
        self.wait_exit()
    }

    /// Waits (at most 30 s) for the daemon to exit, after a signal sent with
    /// [`signal`](Self::signal).
    pub fn wait_exit(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("running");
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(st) = child.try_wait().expect("wait") {
                return st;
            }
            if Instant::now() > end {
                let _ = child.kill();
                panic!(
                    "{} did not exit; log:\n{}",
                    self.name,
                    self.log().join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            eprintln!("---- log of {} ----\n{}", self.name, self.log().join("\n"));
        }
    }
}

/// An earlier build's daemon for interoperation tests (`WANOPT_INTEROP_WANOPTD`; `.ci/run`
/// builds one and sets `WANOPT_REQUIRE_INTEROP=1`, so there a test fails rather than skips
/// without it), or `None` with the reason printed.
pub fn earlier_wanoptd() -> Option<PathBuf> {
    match std::env::var_os("WANOPT_INTEROP_WANOPTD") {
        Some(p) => {
            let p = PathBuf::from(p);
            assert!(
                p.exists(),
                "WANOPT_INTEROP_WANOPTD={} does not exist",
                p.display()
            );
            Some(p)
        }
        None if std::env::var_os("WANOPT_REQUIRE_INTEROP").is_some() => {
            panic!("WANOPT_REQUIRE_INTEROP is set but WANOPT_INTEROP_WANOPTD is not")
        }
        None => {
            eprintln!(
                "skipped: set WANOPT_INTEROP_WANOPTD to an earlier build's wanoptd (.ci/run builds one)"
            );
            None
        }
    }
}

/// Config text of one site. `link` is `listen: ADDR` or `connect: ADDR`; `services` is YAML list
/// items, already indented by two spaces.
pub fn site_yaml(
    site: &str,
    peer: &str,
    link: &str,
    certs: &Certs,
    services: &str,
    extra: &str,
) -> String {
    format!(
        "site: {site}\nlink:\n  {link}\n  peer: {peer}\n  reconnect_min: 50ms\n  reconnect_max: 500ms\n  congestion: {cc}\n{tls}services:\n{services}\nlimits:\n  shutdown_grace: 5s\n{extra}",
        tls = certs.tls_yaml(site),
        cc = std::env::var("WANOPT_TEST_CONGESTION").unwrap_or_else(|_| "bbr".into()),
    )
}

/// An east (listening) and west (connecting) daemon pair with the link up.
pub struct Pair {
    pub certs: Certs,
    pub east: Daemon,
    pub west: Daemon,
}

/// A pair whose link runs through a [`Relay`], so tests can cut it without killing a daemon.
pub struct RelayedPair {
    pub certs: Certs,
    pub east: Daemon,
    pub relay: Relay,
    pub west: Daemon,
}

impl RelayedPair {
    /// Starts east, a relay to its link port, and west connecting through the relay.
    /// `west_link` is extra YAML lines for west's `link:` section (indented by two spaces).
    pub fn start(east_services: &str, west_services: &str, west_link: &str) -> RelayedPair {
        let certs = Certs::new(&["west", "east"]);
        let east = Daemon::start("east", &east_yaml(&certs, east_services));
        let relay = Relay::new(east.bound("link"));
        let yaml = west_yaml(relay.addr, &certs, west_services)
            .replace("  peer: east\n", &format!("  peer: east\n{west_link}"));
        let west = Daemon::start("west", &yaml);
        west.wait_log("link up", Duration::from_secs(10));
        RelayedPair {
            certs,
            east,
            relay,
            west,
        }
    }
}

impl Pair {
    /// Starts east with `east_services`, then west with `west_services` connecting to it.
    pub fn start(east_services: &str, west_services: &str) -> Pair {
        Self::start_extra(east_services, west_services, "")
    }

    /// Like [`start`](Self::start), with an admin endpoint on each daemon.
    pub fn start_with_admin(east_services: &str, west_services: &str) -> Pair {
        Self::start_extra(
            east_services,
            west_services,
            "admin:\n  listen: 127.0.0.1:0\n",
        )
    }

    /// Like [`start`](Self::start), with `extra` top-level YAML in both configs.
    pub fn start_extra(east_services: &str, west_services: &str, extra: &str) -> Pair {
        Self::start_link(east_services, west_services, extra, "")
    }

    /// Like [`start_extra`](Self::start_extra), with `link` lines (such as
    /// `"\n  bandwidth: 45mbit"`) added to both `link:` sections.
    pub fn start_link(east_services: &str, west_services: &str, extra: &str, link: &str) -> Pair {
        let certs = Certs::new(&["west", "east"]);
        let east = Daemon::start(
            "east",
            &site_yaml(
                "east",
                "west",
                &format!("listen: 127.0.0.1:0{link}"),
                &certs,
                east_services,
                extra,
            ),
        );
        let addr = east.bound("link");
        let west = Daemon::start(
            "west",
            &site_yaml(
                "west",
                "east",
                &format!("connect: {addr}{link}"),
                &certs,
                west_services,
                extra,
            ),
        );
        east.wait_log("link up", Duration::from_secs(10));
        west.wait_log("link up", Duration::from_secs(10));
        Pair { certs, east, west }
    }
}

/// Deterministic pseudo-random bytes: block `i` of stream `seed`.
pub fn fill(seed: u64, offset: u64, buf: &mut [u8]) {
    // xorshift keyed by the 8-byte word index, so any offset is reproducible.
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let mut x = seed ^ (offset / 8 + i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^= x >> 33;
        x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^= x >> 33;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

/// Writes `len` deterministic bytes of `seed`, returning their blake3 hash.
pub fn send_pattern(w: &mut impl Write, seed: u64, len: u64) -> std::io::Result<blake3::Hash> {
    let mut h = blake3::Hasher::new();
    let mut buf = vec![0u8; 256 * 1024];
    let mut off = 0u64;
    while off < len {
        let n = (len - off).min(buf.len() as u64) as usize;
        fill(seed, off, &mut buf[..n]);
        w.write_all(&buf[..n])?;
        h.update(&buf[..n]);
        off += n as u64;
    }
    Ok(h.finalize())
}

/// The hash `send_pattern` would produce, without sending.
pub fn pattern_hash(seed: u64, len: u64) -> blake3::Hash {
    send_pattern(&mut std::io::sink(), seed, len).expect("sink")
}

/// Reads to EOF, returning (bytes, hash).
pub fn read_all(r: &mut impl Read) -> std::io::Result<(u64, blake3::Hash)> {
    let mut h = blake3::Hasher::new();
    let mut buf = vec![0u8; 256 * 1024];
    let mut total = 0u64;
    loop {
        let n = r.read(&mut buf)?;
        if n == 0 {
            return Ok((total, h.finalize()));
        }
        h.update(&buf[..n]);
        total += n as u64;
    }
}

/// A loopback TCP server running `handle` on its own thread for each connection.
pub fn server(handle: impl Fn(TcpStream) + Send + Sync + 'static) -> SocketAddr {
    serve_on(TcpListener::bind("127.0.0.1:0").expect("bind"), handle)
}

/// Like [`server`] on a given listener (one bound inside a namespace, for instance).
pub fn serve_on(l: TcpListener, handle: impl Fn(TcpStream) + Send + Sync + 'static) -> SocketAddr {
    let addr = l.local_addr().expect("addr");
    let handle = Arc::new(handle);
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            let h = handle.clone();
            std::thread::spawn(move || h(s));
        }
    });
    addr
}

/// The config of an east site listening for the link on an ephemeral loopback port.
pub fn east_yaml(certs: &Certs, services: &str) -> String {
    site_yaml("east", "west", "listen: 127.0.0.1:0", certs, services, "")
}

/// The config of a west site dialing the link at `link`.
pub fn west_yaml(link: SocketAddr, certs: &Certs, services: &str) -> String {
    site_yaml(
        "west",
        "east",
        &format!("connect: {link}"),
        certs,
        services,
        "",
    )
}

/// A test server: for each connection, reads an 16-byte header (seed, reply length), then the
/// client's bytes to EOF, then writes a 32-byte hash of what it got followed by the reply pattern
/// and closes. Exercises both directions and the client's half-close.
pub fn hash_server() -> SocketAddr {
    server(hash_handler)
}

/// One connection of [`hash_server`].
pub fn hash_handler(mut s: TcpStream) {
    {
        let mut hdr = [0u8; 16];
        if s.read_exact(&mut hdr).is_err() {
            return;
        }
        let seed = u64::from_le_bytes(hdr[..8].try_into().expect("8"));
        let reply = u64::from_le_bytes(hdr[8..].try_into().expect("8"));
        let Ok((_, got)) = read_all(&mut s) else {
            return;
        };
        if s.write_all(got.as_bytes()).is_err() {
            return;
        }
        let _ = send_pattern(&mut s, seed ^ 0xABCD, reply);
        let _ = s.shutdown(Shutdown::Write);
    }
}

/// The client side of [`hash_server`]: sends `up` bytes, half-closes, checks the server's hash of
/// them and the `down` reply bytes. Returns an error on any mismatch or socket error.
pub fn hash_client(addr: SocketAddr, seed: u64, up: u64, down: u64) -> Result<(), String> {
    let s = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    hash_client_on(s, seed, up, down)
}

/// [`hash_client`] on a connection already made (from inside a namespace, for instance).
pub fn hash_client_on(mut s: TcpStream, seed: u64, up: u64, down: u64) -> Result<(), String> {
    s.set_read_timeout(Some(Duration::from_secs(120))).ok();
    let mut hdr = [0u8; 16];
    hdr[..8].copy_from_slice(&seed.to_le_bytes());
    hdr[8..].copy_from_slice(&down.to_le_bytes());
    s.write_all(&hdr).map_err(|e| format!("write: {e}"))?;
    let sent = send_pattern(&mut s, seed, up).map_err(|e| format!("write: {e}"))?;
    s.shutdown(Shutdown::Write)
        .map_err(|e| format!("shutdown: {e}"))?;
    let mut got = [0u8; 32];
    s.read_exact(&mut got)
        .map_err(|e| format!("read hash: {e}"))?;
    if got != *sent.as_bytes() {
        return Err(format!("stream {seed}: server hashed different bytes"));
    }
    let (n, h) = read_all(&mut s).map_err(|e| format!("read reply: {e}"))?;
    if n != down || h != pattern_hash(seed ^ 0xABCD, down) {
        return Err(format!(
            "stream {seed}: reply of {n} bytes differs (expected {down})"
        ));
    }
    Ok(())
}

/// A client of the hash server that sends `len` bytes at about `rate` bytes a second, so the
/// stream is mid-flight through restarts or handovers, then checks the server's hash of them and its
/// reply of `reply` bytes.
pub fn paced_client(
    addr: SocketAddr,
    seed: u64,
    len: u64,
    rate: u64,
    reply: u64,
) -> Result<(), String> {
    let s = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    paced_client_on(s, seed, len, rate, reply)
}

/// [`paced_client`] on a connection already made (from inside a namespace, for instance).
pub fn paced_client_on(
    mut s: TcpStream,
    seed: u64,
    len: u64,
    rate: u64,
    reply: u64,
) -> Result<(), String> {
    s.set_read_timeout(Some(Duration::from_secs(120))).ok();
    let mut hdr = [0u8; 16];
    hdr[..8].copy_from_slice(&seed.to_le_bytes());
    hdr[8..].copy_from_slice(&reply.to_le_bytes());
    s.write_all(&hdr).map_err(|e| format!("write: {e}"))?;
    let mut h = blake3::Hasher::new();
    let piece = 32 * 1024;
    let mut buf = vec![0u8; piece];
    let start = Instant::now();
    let mut off = 0u64;
    while off < len {
        let n = (len - off).min(piece as u64) as usize;
        fill(seed, off, &mut buf[..n]);
        s.write_all(&buf[..n])
            .map_err(|e| format!("stream {seed}: write at {off}: {e}"))?;
        h.update(&buf[..n]);
        off += n as u64;
        let due = start + Duration::from_secs_f64(off as f64 / rate as f64);
        if let Some(w) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(w);
        }
    }
    s.shutdown(Shutdown::Write)
        .map_err(|e| format!("shutdown: {e}"))?;
    let mut got = [0u8; 32];
    s.read_exact(&mut got)
        .map_err(|e| format!("stream {seed}: read hash: {e}"))?;
    if got != *h.finalize().as_bytes() {
        return Err(format!("stream {seed}: the server hashed different bytes"));
    }
    let (n, hash) = read_all(&mut s).map_err(|e| format!("stream {seed}: read reply: {e}"))?;
    if n != reply || hash != pattern_hash(seed ^ 0xABCD, reply) {
        return Err(format!(
            "stream {seed}: the reply of {n} bytes differs (expected {reply})"
        ));
    }
    Ok(())
}

/// Sends `len` bytes from `produce` to the hash server behind `addr` and checks its hash of them.
pub fn send_checked(
    addr: SocketAddr,
    len: u64,
    produce: impl FnMut(u64, &mut [u8]),
) -> Result<(), String> {
    let s = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    send_checked_on(s, len, produce)
}

/// Like [`send_checked`] on a connection already made.
pub fn send_checked_on(
    mut s: TcpStream,
    len: u64,
    mut produce: impl FnMut(u64, &mut [u8]),
) -> Result<(), String> {
    s.set_read_timeout(Some(Duration::from_secs(300))).ok();
    s.write_all(&[0u8; 16]).map_err(|e| format!("write: {e}"))?;
    let mut h = blake3::Hasher::new();
    let mut buf = vec![0u8; 512 * 1024];
    let mut off = 0u64;
    while off < len {
        let n = (len - off).min(buf.len() as u64) as usize;
        produce(off, &mut buf[..n]);
        s.write_all(&buf[..n]).map_err(|e| format!("write: {e}"))?;
        h.update(&buf[..n]);
        off += n as u64;
    }
    s.shutdown(Shutdown::Write)
        .map_err(|e| format!("shutdown: {e}"))?;
    let mut got = [0u8; 32];
    s.read_exact(&mut got)
        .map_err(|e| format!("read hash: {e}"))?;
    if got != *h.finalize().as_bytes() {
        return Err("the server hashed different bytes".into());
    }
    Ok(())
}

/// A TCP relay whose connections can be cut, to kill the link without killing a daemon, and
/// which can refuse new ones for a while (the peer unreachable).
pub struct Relay {
    pub addr: SocketAddr,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    refuse: Arc<std::sync::atomic::AtomicBool>,
}

impl Relay {
    pub fn new(upstream: SocketAddr) -> Relay {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        let conns: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let refuse: Arc<std::sync::atomic::AtomicBool> = Arc::default();
        let (c2, r2) = (conns.clone(), refuse.clone());
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(a) = s else { continue };
                if r2.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = a.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(b) = TcpStream::connect(upstream) else {
                    continue;
                };
                for s in [&a, &b] {
                    if let Ok(c) = s.try_clone() {
                        c2.lock().expect("conns").push(c);
                    }
                }
                for (mut from, mut to) in [
                    (a.try_clone(), b.try_clone()),
                    (b.try_clone(), a.try_clone()),
                ]
                .into_iter()
                .filter_map(|(x, y)| Some((x.ok()?, y.ok()?)))
                {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(Shutdown::Write);
                    });
                }
            }
        });
        Relay {
            addr,
            conns,
            refuse,
        }
    }

    /// While `on`, new connections are closed as soon as they are accepted.
    pub fn refuse(&self, on: bool) {
        self.refuse.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Number of connections relayed so far.
    pub fn connections(&self) -> usize {
        self.conns.lock().expect("conns").len() / 2
    }

    /// Cuts only the `i`th connection (0-based, in accept order).
    pub fn cut_one(&self, i: usize) {
        let c = self.conns.lock().expect("conns");
        for s in c.iter().skip(2 * i).take(2) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Cuts only the connection whose upstream side the far daemon saw coming `from` (the
    /// `from=` of its log line); false if the relay holds no such connection.
    pub fn cut_from(&self, from: SocketAddr) -> bool {
        let c = self.conns.lock().expect("conns");
        let Some(i) = c
            .iter()
            .skip(1)
            .step_by(2)
            .position(|up| up.local_addr().ok() == Some(from))
        else {
            return false;
        };
        for s in c.iter().skip(2 * i).take(2) {
            let _ = s.shutdown(Shutdown::Both);
        }
        true
    }

    /// Cuts every connection through the relay (both daemons see the link die).
    pub fn cut(&self) {
        for c in self.conns.lock().expect("conns").drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

/// CPU seconds (user + system) a process has used so far, from `/proc/PID/stat`.
pub fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0)
        + f.get(12).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    ticks / if hz > 0.0 { hz } else { 100.0 }
}

/// True if a connection through the tunnel was closed with an error rather than a clean end.
pub fn is_reset(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::BrokenPipe
            | std::io::ErrorKind::ConnectionAborted
    )
}

/// One scrape of a daemon's `/metrics`.
pub fn scrape(addr: SocketAddr) -> String {
    scrape_on(TcpStream::connect(addr).expect("connect admin"))
}

/// A scrape over a connection already made (from inside a namespace, for instance).
pub fn scrape_on(mut s: TcpStream) -> String {
    // The endpoint keeps connections alive; this reader wants the end of the answer as EOF.
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .expect("request");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("response");
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    out
}

/// The value of a series (name with labels and a trailing space) in a scrape; 0 if absent.
pub fn value(text: &str, series: &str) -> u64 {
    value_f64(text, series) as u64
}

/// [`value`] unrounded (seconds, ratios).
pub fn value_f64(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .and_then(|v| v.trim().parse::<f64>().ok())
        })
        .unwrap_or(0.0)
}

/// A per-service, per-direction series name, ready for [`value`].
pub fn series(metric: &str, service: &str, dir: &str) -> String {
    format!("{metric}{{service=\"{service}\",direction=\"{dir}\"}} ")
}

/// Waits until `f` holds on fresh scrapes of both daemons (counters trail the sockets slightly).
pub fn eventually(
    west: SocketAddr,
    east: SocketAddr,
    f: impl Fn(&str, &str) -> bool,
) -> (String, String) {
    let end = Instant::now() + Duration::from_secs(6);
    loop {
        let (w, e) = (scrape(west), scrape(east));
        if f(&w, &e) || Instant::now() > end {
            return (w, e);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// An east/west pair across a wansim WAN, each daemon in its site's namespace; east listens on
/// its site address, port 7400. `tune(site, yaml)` edits each config before it starts.
pub struct WanPair {
    pub certs: Certs,
    pub east: Daemon,
    pub west: Daemon,
}

pub fn wan_pair(
    wan: &wansim::Wan,
    east_services: &str,
    west_services: &str,
    tune: impl Fn(&str, String) -> String,
) -> WanPair {
    wan_pair_of(&bin("wanoptd"), wan, east_services, west_services, tune)
}

/// Like [`wan_pair`], both daemons running the `wanoptd` at `exe` (another build's, to compare).
pub fn wan_pair_of(
    exe: &Path,
    wan: &wansim::Wan,
    east_services: &str,
    west_services: &str,
    tune: impl Fn(&str, String) -> String,
) -> WanPair {
    let certs = Certs::new(&["west", "east"]);
    let east_ip = wansim::Site::East.addr();
    let east = Daemon::start_bin(
        exe,
        Some(&wan.netns(wansim::Site::East)),
        "east",
        &tune(
            "east",
            site_yaml(
                "east",
                "west",
                &format!("listen: {east_ip}:7400"),
                &certs,
                east_services,
                "",
            ),
        ),
        &[],
    );
    east.bound("link");
    let west = Daemon::start_bin(
        exe,
        Some(&wan.netns(wansim::Site::West)),
        "west",
        &tune(
            "west",
            site_yaml(
                "west",
                "east",
                &format!("connect: {east_ip}:7400"),
                &certs,
                west_services,
                "",
            ),
        ),
        &[],
    );
    west.wait_log("link up", Duration::from_secs(20));
    WanPair { certs, east, west }
}

/// Adds lines (indented by two spaces) to a config's `link:` section.
pub fn link_lines(yaml: String, lines: &str) -> String {
    yaml.replacen("link:\n", &format!("link:\n{lines}"), 1)
}

/// A loopback port that refuses connections and stays that way while the returned socket lives:
/// the socket holds the port (bound, never listening), so no other test can take it over.
pub fn refusing_port() -> (socket2::Socket, SocketAddr) {
    let s =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    s.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .expect("bind");
    let addr = s
        .local_addr()
        .expect("addr")
        .as_socket()
        .expect("inet address");
    (s, addr)
}

/// In wansim's east site at `addr`: port 9000 echoes 8 KiB messages, port 9001 swallows
/// everything (the SYNC and bulk targets of the latency benches).
pub fn east_servers(wan: &wansim::Wan, addr: std::net::IpAddr) {
    const RR: usize = 8 * 1024;
    for (port, echo) in [(9000u16, true), (9001, false)] {
        let l = wan
            .in_site(wansim::Site::East, move || TcpListener::bind((addr, port)))
            .expect("east")
            .expect("bind");
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { continue };
                let _ = s.set_nodelay(true);
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; if echo { RR } else { 1 << 20 }];
                    if echo {
                        while s.read_exact(&mut buf).is_ok() && s.write_all(&buf).is_ok() {}
                    } else {
                        while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
                    }
                });
            }
        });
    }
}

/// Connects from wansim's west site with congestion control `cc` (a direct WAN path: a stock
/// host runs CUBIC); a connection to a daemon's loopback port keeps the default, which does not
/// matter there.
pub fn connect_in(wan: &wansim::Wan, addr: SocketAddr, cc: &'static str) -> TcpStream {
    let s = wan
        .in_site(wansim::Site::West, move || {
            let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
            if !addr.ip().is_loopback() {
                sock.set_tcp_congestion(cc.as_bytes())?;
            }
            sock.connect(&addr.into())?;
            Ok::<TcpStream, std::io::Error>(sock.into())
        })
        .expect("west")
        .expect("connect");
    s.set_nodelay(true).expect("nodelay");
    s
}
