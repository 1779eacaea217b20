//! A real PostgreSQL primary's WAL streamed through the tunnel: `pg_receivewal` at west pulls the
//! WAL of the server behind east's `pg` service while `pgbench` writes to the server directly.
//! Every complete segment received is compared byte for byte with the server's own file, and the
//! east daemon's counters give the raw and wire bytes of the stream. Two workloads write the WAL:
//! pgbench's built-in TPC-B-like one, and an order entry after the Swingbench "new order process"
//! F5 ran in its Data Guard test (`tests/data/pg_*.sql`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{Pair, scrape, series, value};

/// The PostgreSQL server to use: `.ci/run` starts one with `pg_ctlcluster` and sets
/// `WANOPT_PG_PORT` and `PGPASSWORD`; elsewhere the caller skips with the printed reason.
pub fn port() -> Option<u16> {
    match std::env::var("WANOPT_PG_PORT")
        .ok()
        .and_then(|p| p.parse().ok())
    {
        Some(p) => Some(p),
        None if std::env::var("WANOPT_REQUIRE_POSTGRES").as_deref() == Ok("1") => {
            panic!("WANOPT_REQUIRE_POSTGRES=1 but WANOPT_PG_PORT is not set")
        }
        None => {
            eprintln!(
                "skipping: no PostgreSQL (set WANOPT_PG_PORT and PGPASSWORD, as .ci/run does)"
            );
            None
        }
    }
}

/// Runs one SQL statement as `postgres` on `db`, directly (not through the tunnel).
pub fn psql(pg: u16, db: &str, sql: &str) -> Result<String, String> {
    let out = Command::new("psql")
        .args(["-X", "-q", "-At", "-h", "127.0.0.1", "-U", "postgres"])
        .args(["-p", &pg.to_string(), "-d", db, "-c", sql])
        .output()
        .map_err(|e| format!("psql: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "psql {sql:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// What writes the WAL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    /// pgbench's built-in TPC-B-like transactions on its own tables (`scale` x 100,000 accounts,
    /// whose rows are mostly blank filler).
    Tpcb,
    /// Order entry (`scale` x 10,000 customers): an order, one to five items and their stock
    /// per transaction, as Swingbench's new order process does.
    Orders,
}

impl std::str::FromStr for Workload {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "tpcb" => Ok(Self::Tpcb),
            "orders" => Ok(Self::Orders),
            _ => Err(format!("unknown workload {s:?} (tpcb or orders)")),
        }
    }
}

impl Workload {
    pub fn name(self) -> &'static str {
        match self {
            Self::Tpcb => "tpcb",
            Self::Orders => "orders",
        }
    }

    fn customers(scale: u32) -> String {
        (u64::from(scale.max(1)) * 10_000).to_string()
    }
}

fn data_file(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

/// What one streaming run measured.
#[derive(Debug)]
pub struct WalRun {
    /// Raw WAL-stream bytes east read from the server, and what it put on the link for them.
    pub raw: u64,
    pub wire: u64,
    /// Complete segments received and found identical to the server's.
    pub segments: usize,
    /// pgbench's transactions per second.
    pub tps: f64,
}

/// Settings of one run.
pub struct WalLoad {
    pub workload: Workload,
    /// The workload's scale (see [`Workload`]) and its run.
    pub scale: u32,
    pub clients: u32,
    pub seconds: u32,
    /// Whether the replication connection itself uses TLS (`sslmode=require`) inside the tunnel.
    pub ssl: bool,
    /// Database that pgbench (re)creates.
    pub db: &'static str,
}

struct Receiver(Child);

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Streams WAL from the server at `pg` through `pair` (east must have a `pg` service whose target
/// is the server, west a `pg` service listening; both an admin endpoint) while pgbench runs.
pub fn stream_wal(pair: &Pair, pg: u16, load: &WalLoad) -> Result<WalRun, String> {
    let db = load.db;
    prepare(pg, db, load.workload, load.scale)?;
    let data = PathBuf::from(psql(pg, "postgres", "SHOW data_directory")?);
    // A checkpoint now keeps the next timed one (which may recycle segments) beyond the run; the
    // switch starts a fresh segment, where pg_receivewal begins.
    psql(pg, "postgres", "CHECKPOINT")?;
    psql(pg, "postgres", "SELECT pg_switch_wal()")?;

    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let west: SocketAddr = pair.west.bound("pg");
    let east_admin = pair.east.bound("admin");
    let before = counters(east_admin);
    let conninfo = format!(
        "host={} port={} user=postgres sslmode={}",
        west.ip(),
        west.port(),
        if load.ssl { "require" } else { "disable" }
    );
    let _receiver = Receiver(
        Command::new("pg_receivewal")
            .args(["-n", "--no-sync", "-d", &conninfo, "-D"])
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("pg_receivewal: {e}"))?,
    );
    // Wait until the replication connection is through the tunnel.
    wait_for(Duration::from_secs(20), || {
        counters(east_admin).0 > before.0 || has_files(dir.path())
    })?;

    let out = write_load(
        pg,
        db,
        load.workload,
        load.scale,
        load.clients,
        load.seconds,
    )?;
    let tps = out
        .lines()
        .find_map(|l| l.strip_prefix("tps = "))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);

    // The stream has caught up once east's counters stop moving. Read them before the switch
    // below, whose zero-filled segment end would flatter the ratio.
    let mut last = counters(east_admin);
    let mut still = Instant::now();
    let end = Instant::now() + Duration::from_secs(60);
    while still.elapsed() < Duration::from_secs(2) {
        if Instant::now() > end {
            return Err("the WAL stream did not settle".into());
        }
        std::thread::sleep(Duration::from_millis(200));
        let now = counters(east_admin);
        if now != last {
            last = now;
            still = Instant::now();
        }
    }
    let (raw, wire) = (
        last.0.saturating_sub(before.0),
        last.1.saturating_sub(before.1),
    );

    // Complete the segment in progress, so every byte pgbench caused is in a whole segment.
    let final_seg = psql(pg, "postgres", "SELECT pg_walfile_name(pg_switch_wal())")?;
    wait_for(Duration::from_secs(30), || {
        dir.path().join(&final_seg).exists()
    })?;
    let mut segments = 0;
    for entry in std::fs::read_dir(dir.path()).map_err(|e| e.to_string())? {
        let path = entry.map_err(|e| e.to_string())?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();
        if name.ends_with(".partial") {
            continue;
        }
        let ours = std::fs::read(&path).map_err(|e| format!("{name}: {e}"))?;
        let theirs = std::fs::read(data.join("pg_wal").join(&name))
            .map_err(|e| format!("the server's {name}: {e}"))?;
        if ours != theirs {
            return Err(format!("segment {name} differs from the server's"));
        }
        segments += 1;
    }
    let _ = psql(pg, "postgres", &format!("DROP DATABASE IF EXISTS {db}"));
    Ok(WalRun {
        raw,
        wire,
        segments,
        tps,
    })
}

/// East's raw and wire bytes sent for the `pg` service.
fn counters(admin: SocketAddr) -> (u64, u64) {
    let text = scrape(admin);
    (
        value(&text, &series("wanopt_raw_bytes_total", "pg", "out")),
        value(&text, &series("wanopt_wire_bytes_total", "pg", "out")),
    )
}

fn has_files(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|mut d| d.next().is_some())
}

fn wait_for(limit: Duration, mut f: impl FnMut() -> bool) -> Result<(), String> {
    let end = Instant::now() + limit;
    while !f() {
        if Instant::now() > end {
            return Err(format!("timed out after {limit:?}"));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// Runs a command to completion; its stdout, or its stderr as the error.
/// Runs a command to its end; its output, or its error output as the error.
pub fn run(cmd: &mut Command) -> Result<String, String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{cmd:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A PostgreSQL program that Debian keeps out of `PATH` (in `/usr/lib/postgresql/N/bin`), of
/// the newest version installed.
pub fn pg_bin(name: &str) -> Result<PathBuf, String> {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .map_err(|e| format!("/usr/lib/postgresql: {e}"))?
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse().ok()?;
            let p = e.path().join("bin").join(name);
            p.exists().then_some((v, p))
        })
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|(_, p)| p)
        .ok_or_else(|| format!("no {name} under /usr/lib/postgresql"))
}

/// Takes a base backup of the server reached at `port` into `dir` with pg_basebackup's
/// `format` options (`-Ft -X none`: one tar, no WAL), after a fast checkpoint.
pub fn base_backup(port: u16, dir: &Path, format: &[&str]) -> Result<(), String> {
    // In clear inside the tunnel (the link is TLS): PostgreSQL's own TLS would leave nothing
    // to optimize.
    run(Command::new("pg_basebackup")
        .env("PGSSLMODE", "disable")
        .args(["-c", "fast", "-h", "127.0.0.1", "-U", "postgres"])
        .args(format)
        .args(["-p", &port.to_string(), "-D"])
        .arg(dir))?;
    Ok(())
}

/// A base backup of the server reached at `port` (the tunnel's listening end) into `dir`, as
/// plain files with the WAL it needs, every file checked against the backup's manifest with
/// `pg_verifybackup`.
pub fn verified_base_backup(port: u16, dir: &Path) -> Result<(), String> {
    base_backup(port, dir, &["-Fp", "-X", "fetch"])?;
    run(Command::new(pg_bin("pg_verifybackup")?).arg(dir))?;
    Ok(())
}

/// Runs `workload` on `db` for `seconds` with two clients, directly.
pub fn oltp(
    pg: u16,
    db: &str,
    workload: Workload,
    scale: u32,
    seconds: u32,
) -> Result<String, String> {
    write_load(pg, db, workload, scale, 2, seconds)
}

/// Creates (again) database `db` with the workload's tables at `scale`.
pub fn prepare(pg: u16, db: &str, workload: Workload, scale: u32) -> Result<(), String> {
    psql(pg, "postgres", &format!("DROP DATABASE IF EXISTS {db}"))?;
    psql(pg, "postgres", &format!("CREATE DATABASE {db}"))?;
    match workload {
        Workload::Tpcb => run(Command::new("pgbench")
            .args(["-i", "-q", "-h", "127.0.0.1", "-U", "postgres"])
            .args(["-p", &pg.to_string(), "-s", &scale.to_string(), db]))?,
        Workload::Orders => run(Command::new("psql")
            .args(["-X", "-q", "-h", "127.0.0.1", "-U", "postgres"])
            .args(["-p", &pg.to_string(), "-d", db, "-v", "ON_ERROR_STOP=1"])
            .args(["-v", &format!("customers={}", Workload::customers(scale))])
            .arg("-f")
            .arg(data_file("pg_orders_schema.sql")))?,
    };
    Ok(())
}

/// Runs the workload on `db` (made by [`prepare`]) for `seconds`, directly; pgbench's report.
fn write_load(
    pg: u16,
    db: &str,
    workload: Workload,
    scale: u32,
    clients: u32,
    seconds: u32,
) -> Result<String, String> {
    let mut cmd = Command::new("pgbench");
    cmd.args([
        "-n",
        "-h",
        "127.0.0.1",
        "-U",
        "postgres",
        "-p",
        &pg.to_string(),
    ])
    .args(["-c", &clients.to_string(), "-j", &clients.to_string()])
    .args(["-T", &seconds.to_string()]);
    if workload == Workload::Orders {
        cmd.args(["-D", &format!("customers={}", Workload::customers(scale))])
            .arg("-f")
            .arg(data_file("pg_new_order.sql"));
    }
    run(cmd.arg(db))
}

/// A standby catching up: how much WAL it had to fetch and how long that took.
#[derive(Debug)]
pub struct CatchUp {
    pub backlog: u64,
    /// Seconds from the receiver's start until it held the last backlog segment; `None` when
    /// it did not within the limit.
    pub seconds: Option<f64>,
    /// Complete segments received by the end.
    pub segments: usize,
    /// Backlog bytes the receiver had written by the end (as it last reported to the server).
    pub received: u64,
}

/// The load that builds a backlog, and how long the catch-up may take.
#[derive(Debug, Clone, Copy)]
pub struct Backlog {
    /// The workload on the database [`prepare`] made, at the scale it was made with.
    pub workload: Workload,
    pub scale: u32,
    pub clients: u32,
    pub seconds: u32,
    pub limit: Duration,
}

/// A physical replication slot, dropped with this guard.
struct Slot<'a> {
    pg: u16,
    name: &'a str,
}

impl Slot<'_> {
    /// Drops the slot if it exists, ending the walsender that may still hold it: a slot left
    /// behind would keep the server's WAL forever.
    fn remove(pg: u16, name: &str) -> Result<(), String> {
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            let r = psql(
                pg,
                "postgres",
                &format!(
                    "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
                     WHERE slot_name = '{name}' AND active_pid IS NOT NULL; \
                     SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
                     WHERE slot_name = '{name}'"
                ),
            );
            match r {
                Ok(_) => return Ok(()),
                Err(e) if Instant::now() > end => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        if let Err(e) = Self::remove(self.pg, self.name) {
            eprintln!("could not drop replication slot {}: {e}", self.name);
        }
    }
}

/// The catch-up of a standby that was away: `pgbench` loads `db` while nothing receives (a
/// replication slot keeps the WAL), then `receiver` (a `pg_receivewal` command, perhaps run
/// inside a namespace) streams from the slot with `conninfo`, and the time until it has the whole
/// backlog is measured, up to the load's `limit`. `name` names the slot.
pub fn catch_up(
    pg: u16,
    db: &str,
    load: &Backlog,
    mut receiver: Command,
    conninfo: &str,
    name: &str,
) -> Result<CatchUp, String> {
    let Backlog {
        workload,
        scale,
        clients,
        seconds: load_seconds,
        limit,
    } = *load;
    // A slot of this name left by an interrupted run would start the stream too early.
    Slot::remove(pg, name)?;
    psql(pg, "postgres", "CHECKPOINT")?;
    psql(
        pg,
        "postgres",
        &format!("SELECT pg_create_physical_replication_slot('{name}', true)"),
    )?;
    let _slot = Slot { pg, name };
    write_load(pg, db, workload, scale, clients, load_seconds)?;
    // End the backlog on a segment boundary: the receiver has it all once that segment's file
    // is complete.
    let last = psql(pg, "postgres", "SELECT pg_walfile_name(pg_switch_wal())")?;
    let start = psql(
        pg,
        "postgres",
        &format!("SELECT restart_lsn FROM pg_replication_slots WHERE slot_name = '{name}'"),
    )?;
    let backlog: u64 = psql(
        pg,
        "postgres",
        &format!("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '{start}')::bigint"),
    )?
    .parse()
    .map_err(|e| format!("backlog: {e}"))?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let conninfo = format!("{conninfo} application_name={name}");
    let started = Instant::now();
    let _receiver = Receiver(
        receiver
            .args([
                "-n",
                "--no-sync",
                "-s",
                "1",
                "--slot",
                name,
                "-d",
                &conninfo,
                "-D",
            ])
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("pg_receivewal: {e}"))?,
    );
    let done = dir.path().join(&last);
    let mut seconds = None;
    while started.elapsed() < limit {
        if done.exists() {
            seconds = Some(started.elapsed().as_secs_f64());
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let received = if seconds.is_some() {
        backlog
    } else {
        psql(
            pg,
            "postgres",
            &format!(
                "SELECT coalesce(pg_wal_lsn_diff(write_lsn, '{start}'), 0)::bigint \
                 FROM pg_stat_replication WHERE application_name = '{name}'"
            ),
        )?
        .parse()
        .unwrap_or(0)
    };
    let segments = std::fs::read_dir(dir.path())
        .map_err(|e| e.to_string())?
        .filter_map(Result::ok)
        .filter(|e| !e.file_name().to_string_lossy().ends_with(".partial"))
        .count();
    Ok(CatchUp {
        backlog,
        seconds,
        segments,
        received,
    })
}
