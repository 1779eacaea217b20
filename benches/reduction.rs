//! Data reduction on real database bytes, against the compressors a DBA would use instead. Builds
//! its data from a real PostgreSQL: a database of real text rows (every Debian changelog on the
//! host, a row per line), a base backup of it, an OLTP run (updates, inserts, deletes), the WAL
//! of that run, and a second base backup after it; and, if MariaDB is installed (Debian's
//! `mariadb-server`), the row-based binlog of the same kind of OLTP run on the same rows in a
//! private MariaDB instance. Each data set goes through wanopt's encoder
//! with the settings a daemon derives from a stated 45 Mbit/s link (in one process, on one core,
//! the cache kept from one data set to the next as a link keeps it), and through `gzip -6`,
//! `zstd -6` and `zstd -9` as one stream, `xz -6`, and for the second backup `zstd --long=29
//! --patch-from` the first. It prints wire/raw of each and wanopt's encoder CPU time, and what
//! dedup, deltas and compression each kept off the wire. Behind the encoder runs a virtual T3
//! (95% of 45 Mbit/s, as the daemon paces it) with the daemon's zstd level governor fed from
//! it, so the level moves as a daemon's would on this host; the table shows the levels, the
//! raw rate the pair would move over that T3, and how busy the link was (near 100%: the link,
//! not the encoder, set the pace).
//!
//! Run (as root, with a PostgreSQL server): `WANOPT_PG_PORT=5432 PGPASSWORD=... cargo bench
//! --bench reduction` (`.ci/run` shows how to set one up). Options: `--text-mib N` of row text
//! (default 48), `--seconds N` of OLTP (default 60), `--keep DIR` to keep the data sets,
//! `--from DIR` to measure data sets kept before (no server needed), `--xz` to run `xz -6` too
//! (about 1 MB/s here), `--cache-mib N` (default 2048: the cache of a daemon with a 2 GiB disk
//! tier, which holds a first backup until the second comes; the default 256 MiB of memory alone
//! would not), `--delta-mib N` (default 256, the daemon's: the sender's store of delta bases in
//! memory), `--delta-disk-mib N` (default 2048: sealed files behind it, as a daemon with a 2 GiB
//! disk tier keeps them; 0 for memory only),
//! `--zstd-level N` (a fixed level: no governor), `--gather-kib N` (what a stream gathers
//! before its turn instead of the link's; 0: a turn for each 64 KiB piece), `--wanopt-only` (skip the other
//! compressors, to compare settings quickly), `--binlog-tx N` transactions for the binlog
//! (default 40000), `--svg FILE` (the charts; default `benches/charts/reduction.svg`).
//!
//! `--pairs DIR` measures a corpus of first/changed pairs instead (`benches/corpus.sh DIR`
//! builds one from Debian's packages: an OLTP benchmark's backups, text rows, InnoDB files, a
//! growing query log, two kernel releases): each pair's first copy, then its changed copy, each
//! a stream of its own through one encoder whose caches carry over from pair to pair, against
//! `zstd -9` of each copy alone and `zstd --long=31 --patch-from` the first. It prints every
//! pair, the changed copy's cost against `--patch-from`, and the memory of the delta store and
//! its index after the run against their configured bounds.

#[path = "../tests/common/mod.rs"]
mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::pg::{self, port, psql, run};
use common::report;
use wanopt_codec::{CodecConfig, Decoder, Encoder, Pressure, SharedBases};
use wanopt_replay::chart::{Bars, Chart, render};
use wanopt_runtime::config::ZSTD_ADAPT_MAX;
use wanopt_runtime::pressure::Governor;

const DB: &str = "wanopt_reduction";

/// Real text rows: every Debian changelog on the host, in path order, a row per non-empty line
/// (package, line number, text), up to `limit` bytes, as `COPY` text.
fn rows(limit: usize) -> Vec<u8> {
    let mut files: Vec<PathBuf> = std::fs::read_dir("/usr/share/doc")
        .into_iter()
        .flatten()
        .flatten()
        .flat_map(|d| std::fs::read_dir(d.path()).into_iter().flatten().flatten())
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("changelog") && n.ends_with(".gz"))
        })
        .collect();
    files.sort();
    let mut out = Vec::with_capacity(limit + 4096);
    for f in files {
        let Ok(o) = Command::new("zcat").arg(&f).output() else {
            continue;
        };
        let pkg = f
            .parent()
            .and_then(Path::file_name)
            .and_then(|n| n.to_str())
            .unwrap_or("-")
            .to_string();
        let text = String::from_utf8_lossy(&o.stdout);
        for (i, line) in text.lines().enumerate() {
            let line: String = line
                .chars()
                .filter(|c| !c.is_control())
                .collect::<String>()
                .replace('\\', "\\\\");
            if line.trim().is_empty() {
                continue;
            }
            let _ = writeln!(out, "{pkg}\t{i}\t{line}");
            if out.len() >= limit {
                return out;
            }
        }
    }
    out
}

fn base_backup(pg: u16, dir: &Path) -> Result<PathBuf, String> {
    let _ = std::fs::remove_dir_all(dir);
    pg::base_backup(pg, dir, &["-Ft", "-X", "none"])?;
    Ok(dir.join("base.tar"))
}

/// The bytes of the WAL segments from the one holding `from` to the one holding `to`, read from
/// the server's directory (run as root, as CI does) before a checkpoint can recycle them.
fn wal_between(pg: u16, from: &str, to: &str) -> Result<Vec<u8>, String> {
    let data = PathBuf::from(psql(pg, "postgres", "SHOW data_directory")?);
    let name = |lsn: &str| psql(pg, "postgres", &format!("SELECT pg_walfile_name('{lsn}')"));
    let (a, b) = (name(from)?, name(to)?);
    let mut segs: Vec<String> = std::fs::read_dir(data.join("pg_wal"))
        .map_err(|e| e.to_string())?
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.len() == 24 && *n >= a && *n <= b)
        .collect();
    segs.sort();
    let mut out = Vec::new();
    for s in segs {
        out.extend(std::fs::read(data.join("pg_wal").join(s)).map_err(|e| e.to_string())?);
    }
    Ok(out)
}

/// The codec settings a daemon derives from a config stating a 45 Mbit/s, 100 ms link, with a
/// cache of `cache` bytes and a store of `delta` bytes for delta bases.
/// The codec a daemon stating 45 Mbit/s runs, the pressure it encodes under, and its coded
/// streams' turns (quantum, frame room).
fn daemon_codec(
    cache: usize,
    delta: usize,
    level: Option<i32>,
) -> (CodecConfig, Pressure, (usize, usize, usize)) {
    let yaml = "site: west\nlink:\n  connect: 127.0.0.1:7400\n  peer: east\n  bandwidth: 45mbit\n  rtt: 100ms\ntls:\n  ca: ca.pem\n  cert: c.pem\n  key: k.key\n";
    let cfg = wanopt_runtime::config::Config::parse(yaml, Path::new("/etc/wanopt/west.yaml"))
        .expect("config");
    let c = &cfg.optimize.codec;
    let codec = CodecConfig {
        cache_bytes: cache.max(c.cache_bytes as usize),
        zstd_level: level.unwrap_or(c.zstd_level),
        long: c.long_context,
        delta_bytes: delta,
        ..CodecConfig::default()
    }
    .with_avg_chunk(c.avg_chunk);
    let link = wanopt_runtime::link_config(&cfg, None);
    let (quantum, room) = wanopt_proto::coded_turn(link.max_frame as usize);
    // What a stream gathers before its turn, as the link's bulk streams do.
    let gather = wanopt_codec::send::gather(link.send_buffer, codec.max_chunk);
    // A stated WAN far below what a core compresses: the link is the bottleneck.
    (codec, Pressure::LinkBound, (quantum, room, gather))
}

/// A virtual T3 behind the encoder, with the daemon's zstd level governor fed from it: each
/// piece's encoding time is measured (the thread's CPU time), the link drains its wire bytes at
/// 95% of 45 Mbit/s (what `link.max_rate: auto` paces at), and the writer waits for the link when
/// it is ahead, as a daemon's writer waits for its socket.
struct VirtualT3 {
    /// Wire bytes per second.
    rate: f64,
    now: Duration,
    /// When the link has sent what it was given.
    free_at: Duration,
    /// Time the link spent sending.
    sending: Duration,
    t0: Instant,
    governor: Option<Governor>,
}

impl VirtualT3 {
    fn new(level: i32, governed: bool) -> Self {
        let t0 = Instant::now();
        VirtualT3 {
            rate: 45e6 / 8.0 * 0.95,
            now: Duration::ZERO,
            free_at: Duration::ZERO,
            sending: Duration::ZERO,
            t0,
            governor: governed.then(|| Governor::new(level, 1, ZSTD_ADAPT_MAX, t0)),
        }
    }

    /// A piece took `cpu` seconds to encode into `wire` bytes; returns a new level if the
    /// governor moved.
    fn piece(&mut self, cpu: f64, wire: usize) -> Option<i32> {
        let enc = Duration::from_secs_f64(cpu);
        let done = self.now + enc;
        let waited = self.free_at.saturating_sub(done);
        self.now = done + waited;
        let send = Duration::from_secs_f64(wire as f64 / self.rate);
        self.free_at = self.now + send;
        self.sending += send;
        self.governor
            .as_mut()?
            .record(enc, waited, self.t0 + self.now)
    }

    /// Virtual time until the link has sent everything.
    fn end(&self) -> Duration {
        self.now.max(self.free_at)
    }
}

fn thread_cpu() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid pointer to a timespec the call fills in.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 / 1e9
}

/// Wire bytes of a command's output on `file`, and its wall time.
fn tool(cmd: &str, args: &[&str], file: &Path) -> Option<(u64, f64)> {
    let t = Instant::now();
    let child = Command::new(cmd)
        .args(args)
        .arg(file)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let out = child.wait_with_output().ok()?;
    out.status
        .success()
        .then(|| (out.stdout.len() as u64, t.elapsed().as_secs_f64()))
}

/// What to measure, from the command line.
struct Opts {
    /// Run `xz -6` too.
    xz: bool,
    /// Run the other compressors at all (`--wanopt-only` skips them, for quick comparisons).
    others: bool,
    cache: usize,
    delta: usize,
    /// Files behind the delta store's memory.
    delta_disk: usize,
    /// A zstd level instead of the one the daemon's config derives.
    level: Option<i32>,
    /// Bytes a stream gathers before its turn instead of the link's (0: a turn for each piece
    /// written).
    gather: Option<usize>,
    /// Where the chart goes.
    svg: String,
}

fn main() {
    let args = common::args::Args::new();
    let opts = Opts {
        xz: args.flag("--xz"),
        others: !args.flag("--wanopt-only"),
        cache: args.get::<usize>("--cache-mib", 2048) << 20,
        delta: args.get::<usize>("--delta-mib", 256) << 20,
        delta_disk: args.get::<usize>("--delta-disk-mib", 2048) << 20,
        level: args
            .text("--zstd-level")
            .map(|l| l.parse().expect("--zstd-level N")),
        gather: args
            .text("--gather-kib")
            .map(|g| g.parse::<usize>().expect("--gather-kib N") << 10),
        svg: args.get("--svg", "benches/charts/reduction.svg".to_string()),
    };
    if let Some(d) = args.text("--pairs").map(PathBuf::from) {
        measure_pairs(&d, &opts);
        return;
    }
    match args.text("--from").map(PathBuf::from) {
        Some(d) => {
            let binlog = Some(d.join("run.binlog")).filter(|p| p.exists());
            measure(
                &d.join("base1/base.tar"),
                &d.join("run.wal"),
                &d.join("base2/base.tar"),
                binlog.as_deref(),
                &opts,
            );
        }
        None => {
            let Some(pg) = port() else {
                return;
            };
            let (base1, wal, base2, binlog, _tmp) = make_data(pg, &args);
            measure(&base1, &wal, &base2, binlog.as_deref(), &opts);
        }
    }
}

/// The data sets: the two backups, the WAL, the binlog if MariaDB made one, and the temporary
/// directory that holds them unless `--keep` named one.
type DataSets = (
    PathBuf,
    PathBuf,
    PathBuf,
    Option<PathBuf>,
    tempfile::TempDir,
);

/// Builds the data sets on the server at `pg` (and a private MariaDB, if installed).
fn make_data(pg: u16, args: &common::args::Args) -> DataSets {
    let text_mib: usize = args.get("--text-mib", 48);
    let seconds: u32 = args.get("--seconds", 60);
    let keep = args.text("--keep").map(PathBuf::from);
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = keep.unwrap_or_else(|| tmp.path().to_path_buf());
    std::fs::create_dir_all(&dir).expect("data dir");

    // The database: real text rows.
    let tsv = dir.join("rows.tsv");
    std::fs::write(&tsv, rows(text_mib << 20)).expect("rows");
    let _ = psql(pg, "postgres", &format!("DROP DATABASE IF EXISTS {DB}"));
    psql(pg, "postgres", &format!("CREATE DATABASE {DB}")).expect("create db");
    psql(pg, DB, "CREATE TABLE notes (id bigserial primary key, pkg text, line_no int, body text, qty int default 1, price numeric(12,2) default 9.99, updated timestamptz default now())").expect("table");
    psql(
        pg,
        DB,
        &format!("\\copy notes(pkg, line_no, body) FROM '{}'", tsv.display()),
    )
    .expect("copy");
    psql(pg, DB, "CREATE INDEX ON notes(pkg)").expect("index");
    let base1 = base_backup(pg, &dir.join("base1")).expect("first base backup");

    // OLTP: each transaction touches a few rows here and there, as an order system would.
    let rows_n: u64 = psql(pg, DB, "SELECT max(id) FROM notes")
        .expect("count")
        .parse()
        .unwrap_or(1);
    let script = dir.join("oltp.sql");
    std::fs::write(
        &script,
        format!(
            "\\set id random(1, {rows_n})\nBEGIN;\nUPDATE notes SET qty = qty + 1, price = price * 1.01, updated = now() WHERE id = :id;\nUPDATE notes SET body = body || ' (rev)' WHERE id = :id + 7;\nINSERT INTO notes(pkg, line_no, body) SELECT pkg, line_no + 100000, body FROM notes WHERE id = :id + 13;\nDELETE FROM notes WHERE id = :id + 29;\nCOMMIT;\n"
        ),
    )
    .expect("script");
    let lsn1 = psql(pg, "postgres", "SELECT pg_current_wal_lsn()").expect("lsn");
    let report = run(Command::new("pgbench")
        .args(["-h", "127.0.0.1", "-U", "postgres", "-n", "-c", "4"])
        .args(["-p", &pg.to_string(), "-T", &seconds.to_string(), "-f"])
        .arg(&script)
        .arg(DB))
    .expect("pgbench");
    let lsn2 = psql(pg, "postgres", "SELECT pg_current_wal_lsn()").expect("lsn");
    let wal = wal_between(pg, &lsn1, &lsn2).expect("wal");
    let wal_path = dir.join("run.wal");
    std::fs::write(&wal_path, &wal).expect("wal file");
    let base2 = base_backup(pg, &dir.join("base2")).expect("second base backup");
    let tps = report
        .lines()
        .find(|l| l.starts_with("tps"))
        .unwrap_or("")
        .to_string();
    report::note(format!(
        "PostgreSQL data: {text_mib} MiB of changelog text rows, {seconds} s of OLTP ({tps})."
    ));
    println!("data in {}", dir.display());
    let _ = psql(pg, "postgres", &format!("DROP DATABASE IF EXISTS {DB}"));
    let binlog = match mariadb_binlog(&dir, &tsv, args.get("--binlog-tx", 40_000)) {
        Ok(p) => Some(p),
        Err(e) => {
            report::note(format!("No MariaDB binlog data set: {e}."));
            None
        }
    };
    (base1, wal_path, base2, binlog, tmp)
}

/// A private MariaDB instance in `dir/mariadb` (no network, root's socket), stopped when
/// dropped.
struct Maria {
    dir: PathBuf,
    server: std::process::Child,
}

impl Maria {
    fn start(dir: &Path) -> Result<Maria, String> {
        let dir = dir.join("mariadb");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let data = dir.join("data");
        run(Command::new("mariadb-install-db")
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .args(["--user=root", "--auth-root-authentication-method=socket"])
            .arg("--skip-test-db"))?;
        // Row-based binlog with full row images, as replication to a standby or to GoldenGate
        // reads it; commits not flushed one by one, so the run takes seconds.
        let server = Command::new("mariadbd")
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .arg(format!("--socket={}", dir.join("sock").display()))
            .arg(format!("--log-bin={}", data.join("binlog").display()))
            .args(["--skip-networking", "--binlog-format=ROW", "--server-id=1"])
            .args(["--user=root", "--innodb-buffer-pool-size=512M"])
            .args(["--innodb-flush-log-at-trx-commit=2", "--sync-binlog=0"])
            .arg("--local-infile=1")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("mariadbd: {e}"))?;
        let m = Maria { dir, server };
        for _ in 0..150 {
            if m.sql("SELECT 1").is_ok() {
                return Ok(m);
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        Err("mariadbd did not answer in 30 s".into())
    }

    fn client(&self) -> Command {
        let mut c = Command::new("mariadb");
        c.arg(format!("--socket={}", self.dir.join("sock").display()))
            .args([
                "-uroot",
                "--batch",
                "--skip-column-names",
                "--local-infile=1",
            ]);
        c
    }

    fn sql(&self, sql: &str) -> Result<String, String> {
        run(self.client().args(["-e", sql])).map(|s| s.trim().to_string())
    }

    /// Feeds a script on the client's standard input.
    fn script(&self, sql: &[u8]) -> Result<(), String> {
        let mut child = self
            .client()
            .arg("wanopt")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("mariadb: {e}"))?;
        if let Some(mut w) = child.stdin.take() {
            w.write_all(sql).map_err(|e| format!("mariadb: {e}"))?;
        }
        let out = child.wait_with_output().map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
        }
    }

    /// The binlog files, oldest first.
    fn binlogs(&self) -> Result<Vec<String>, String> {
        Ok(self
            .sql("SHOW BINARY LOGS")?
            .lines()
            .filter_map(|l| l.split('\t').next().map(str::to_string))
            .collect())
    }
}

impl Drop for Maria {
    fn drop(&mut self) {
        let _ = self.sql("SHUTDOWN");
        let _ = self.server.wait();
        let _ = std::fs::remove_dir_all(self.dir.join("data"));
    }
}

/// The row binlog of `transactions` OLTP transactions (the PostgreSQL run's four statements,
/// at random rows) on the rows of `tsv` in a private MariaDB, into `dir/run.binlog`.
fn mariadb_binlog(dir: &Path, tsv: &Path, transactions: u32) -> Result<PathBuf, String> {
    let m = Maria::start(dir)?;
    m.sql("CREATE DATABASE wanopt")?;
    m.script(
        format!(
            "CREATE TABLE notes (id bigint auto_increment primary key, pkg text, line_no int, body text, qty int default 1, price decimal(12,2) default 9.99, updated timestamp default current_timestamp, key (pkg(32)));\nLOAD DATA LOCAL INFILE '{}' INTO TABLE notes (pkg, line_no, body);\n",
            tsv.display()
        )
        .as_bytes(),
    )?;
    let rows: u64 = m
        .sql("SELECT max(id) FROM wanopt.notes")?
        .parse()
        .map_err(|_| "no rows loaded".to_string())?;
    // The run's binlog starts in a file of its own.
    m.sql("FLUSH BINARY LOGS")?;
    let before = m.binlogs()?;
    let mut script = Vec::new();
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for _ in 0..transactions {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let id = 1 + x % rows;
        let _ = writeln!(
            script,
            "BEGIN; UPDATE notes SET qty = qty + 1, price = price * 1.01, updated = now() WHERE id = {id}; UPDATE notes SET body = CONCAT(body, ' (rev)') WHERE id = {}; INSERT INTO notes(pkg, line_no, body) SELECT pkg, line_no + 100000, body FROM notes WHERE id = {}; DELETE FROM notes WHERE id = {}; COMMIT;",
            id + 7,
            id + 13,
            id + 29
        );
    }
    let t = Instant::now();
    m.script(&script)?;
    let secs = t.elapsed().as_secs_f64();
    m.sql("FLUSH BINARY LOGS")?;
    let after = m.binlogs()?;
    let (first, next) = match (before.last(), after.last()) {
        (Some(a), Some(b)) => (a.clone(), b.clone()),
        _ => return Err("no binlog files".into()),
    };
    let data = m.dir.join("data");
    let mut out = Vec::new();
    for name in after.iter().filter(|n| **n >= first && **n < next) {
        out.extend(std::fs::read(data.join(name)).map_err(|e| format!("{name}: {e}"))?);
    }
    let path = dir.join("run.binlog");
    std::fs::write(&path, &out).map_err(|e| e.to_string())?;
    report::note(format!(
        "MariaDB: {rows} rows, {transactions} OLTP transactions in {secs:.0} s, {} MB of row binlog.",
        out.len() / 1_000_000
    ));
    Ok(path)
}

/// The encoder a daemon runs with `cfg`, and the store of delta bases behind it: with a disk
/// tier in `state` as a daemon with `disk.delta_bytes` and a key keeps it (its writes and reads
/// on a thread of their own).
/// The daemon's encoder: its codec, its coded streams' turns, and its delta store.
fn encoder(
    cfg: &CodecConfig,
    (quantum, room, gather): (usize, usize, usize),
    opts: &Opts,
    state: &Path,
) -> (Encoder, Option<SharedBases>) {
    let mut enc = Encoder::new(cfg.clone());
    enc.set_turn_limits(quantum, room);
    enc.set_gather(opts.gather.unwrap_or(gather));
    let dir = wanopt_runtime::cachedir::CacheDir::open(
        state,
        "east",
        Default::default(),
        Some([0x5a; 32]),
    )
    .expect("cache directory");
    let bases = if opts.delta_disk > 0 {
        let limit = opts.delta_disk as u64;
        let store = dir.bases_store(limit).expect("disk tier");
        // Chunks whose bases are being read wait for them, as the link's do.
        enc.set_store_wait(dir.store_wait());
        wanopt_codec::delta::shared_tiered(cfg.delta_bytes, limit, store)
    } else {
        wanopt_codec::delta::shared(cfg.delta_bytes)
    };
    enc.set_bases(bases.clone());
    (enc, bases)
}

/// The report's note of the encoder's settings; `scope` says how the caches are shared.
fn settings_note(cfg: &CodecConfig, opts: &Opts, gather: usize, scope: &str) {
    report::note(format!(
        "wanopt: the link's send path as a daemon stating 45 Mbit/s sets it (zstd {}, governed unless --zstd-level; long context {}), one {} MiB cache and a delta store of {} MiB in memory and {} MiB of sealed files, {scope}; wire bytes are the records and a short coded frame's header (10 bytes) for each turn, each copy written in 64 KiB pieces (a turn for each {} KiB gathered, as a link's bulk stream takes).",
        cfg.zstd_level,
        cfg.long
            .map_or("off".into(), |l| format!("{} MiB", l.window() >> 20)),
        cfg.cache_bytes >> 20,
        cfg.delta_bytes >> 20,
        opts.delta_disk >> 20,
        opts.gather.unwrap_or(gather) >> 10
    ));
}

/// One data set as a stream of its own through `enc`, written in 64 KiB pieces as a client
/// writes, behind the virtual T3 (whose governor may move the level): the records, the wire
/// bytes (the records and a coded frame's header for each turn, as a link sends them), the
/// encoder's CPU seconds, the virtual seconds the link took and the share of them it was busy.
fn stream(
    enc: &mut Encoder,
    t3: &mut VirtualT3,
    level: &mut i32,
    pressure: Pressure,
    data: &[u8],
) -> (Vec<u8>, usize, f64, f64, f64) {
    let turns = enc.turns();
    // The wire buffer's pages are touched before the clock runs: a daemon writes its frames
    // into buffers it reuses, and first-touch page faults were a tenth of the measured CPU.
    let mut wire = vec![0u8; data.len() / 2 + (1 << 20)];
    wire.clear();
    let (start, sent_before) = (t3.end(), t3.sending);
    t3.now = start;
    let mut cpu = 0.0;
    for piece in data.chunks(64 * 1024) {
        let (t, w) = (thread_cpu(), wire.len());
        enc.push(piece, false, pressure, &mut wire);
        let c = thread_cpu() - t;
        cpu += c;
        if let Some(l) = t3.piece(c, wire.len() - w) {
            enc.set_zstd_level(l);
            *level = l;
        }
    }
    // Each data set is a connection of its own.
    let (t, w) = (thread_cpu(), wire.len());
    enc.end_stream(pressure, &mut wire);
    let c = thread_cpu() - t;
    cpu += c;
    t3.piece(c, wire.len() - w);
    let took = (t3.end() - start).as_secs_f64();
    let busy = (t3.sending - sent_before).as_secs_f64() / took;
    let frames = usize::try_from(enc.turns() - turns).unwrap_or(usize::MAX);
    // A daemon pair of this version sends short coded frames; the stream ids of a link's first
    // hundred or so streams take one byte.
    let header = wanopt_proto::frame::short_coded_overhead(wanopt_proto::frame::StreamId(1));
    let framed = wire.len() + frames * header;
    (wire, framed, cpu, took, busy)
}

/// Prints where a copy's wire bytes went (`s` less `before`), for whoever tunes the index:
/// `framed` bytes in all, `records` of them records.
fn breakdown(
    what: &str,
    s: &wanopt_codec::EncodeStats,
    before: &wanopt_codec::EncodeStats,
    framed: usize,
    records: usize,
) {
    let d = |a: u64, b: u64| (a - b) as f64 / 1e6;
    eprintln!(
        "{what} ({:.3} MB): refs {:.1} MB ({} chunks) in {:.3} MB, deltas {:.1} MB ({} chunks) in {:.3} MB, literals {:.1} MB ({} chunks) in {:.3} MB ({:.1} MB offered a base), frame headers {:.3} MB",
        framed as f64 / 1e6,
        d(s.hit_bytes, before.hit_bytes),
        s.hit_chunks - before.hit_chunks,
        d(s.hit_wire, before.hit_wire),
        d(s.delta_bytes, before.delta_bytes),
        s.delta_chunks - before.delta_chunks,
        d(s.delta_wire, before.delta_wire),
        d(s.miss_bytes, before.miss_bytes),
        s.miss_chunks - before.miss_chunks,
        d(
            s.wire_bytes - s.hit_wire - s.delta_wire,
            before.wire_bytes - before.hit_wire - before.delta_wire
        ),
        d(s.no_base_bytes, before.no_base_bytes),
        (framed - records) as f64 / 1e6,
    );
}

/// Decodes `wire` and checks it rebuilds `data` exactly.
fn check(dec: &mut Decoder, wire: &[u8], data: &[u8], name: &str) {
    let mut out = Vec::with_capacity(data.len());
    dec.decode(wire, &mut out).expect("decodes");
    assert!(out == data, "{name}: rebuilt bytes differ");
}

/// The corpus in `dir` (a directory per pair, each with `first` and `changed`): see the
/// module's documentation.
fn measure_pairs(dir: &Path, opts: &Opts) {
    let mut pairs: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("corpus directory")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("first").is_file() && p.join("changed").is_file())
        .collect();
    pairs.sort();
    assert!(
        !pairs.is_empty(),
        "no pairs in {}: run benches/corpus.sh",
        dir.display()
    );
    let (cfg, pressure, turn) = daemon_codec(opts.cache, opts.delta, opts.level);
    settings_note(
        &cfg,
        opts,
        turn.2,
        "carried over from pair to pair; every stream decoded and checked",
    );
    let state = tempfile::tempdir().expect("tempdir");
    let (mut enc, bases) = encoder(&cfg, turn, opts, state.path());
    let mut dec = Decoder::new(&cfg);
    let mut t3 = VirtualT3::new(cfg.zstd_level, opts.level.is_none());
    let mut level = cfg.zstd_level;
    let title = "Every pair: wire/raw of the first copy, then of the changed copy after it";
    let header = [
        "pair",
        "first MB",
        "wanopt",
        "zstd -9",
        "cpu MB/s",
        "level",
        "changed MB",
        "wanopt",
        "zstd -9",
        "--patch-from",
        "wanopt / patch",
        "cpu MB/s",
        "level",
        "no base",
    ];
    let mut worst: f64 = 0.0;
    for p in &pairs {
        let name = p
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("?")
            .to_string();
        let (first_path, changed_path) = (p.join("first"), p.join("changed"));
        let first = std::fs::read(&first_path).expect("first");
        let first_level = level;
        let start = enc.stats().clone();
        let (w1, f1, cpu1, _, _) = stream(&mut enc, &mut t3, &mut level, pressure, &first);
        breakdown(&format!("{name} first"), enc.stats(), &start, f1, w1.len());
        let levels = |a: i32, b: i32| {
            if a == b {
                a.to_string()
            } else {
                format!("{a}→{b}")
            }
        };
        let first_levels = levels(first_level, level);
        check(&mut dec, &w1, &first, &name);
        let changed = std::fs::read(&changed_path).expect("changed");
        let level_before = level;
        let before = enc.stats().clone();
        let (w2, f2, cpu, _, _) = stream(&mut enc, &mut t3, &mut level, pressure, &changed);
        check(&mut dec, &w2, &changed, &name);
        let s = enc.stats();
        let ratio = |w: usize, n: usize| w as f64 / n as f64;
        let z9 = |f: &Path| {
            opts.others
                .then(|| tool("zstd", &["-9", "-q", "-c", "-T1"], f))
                .flatten()
                .map(|(w, _)| w)
        };
        let from = format!("--patch-from={}", first_path.display());
        let patch = opts
            .others
            .then(|| {
                tool(
                    "zstd",
                    &["-3", "--long=31", &from, "-q", "-c", "-T1"],
                    &changed_path,
                )
            })
            .flatten()
            .map(|(w, _)| w);
        let f = |v: Option<u64>, n: usize| {
            v.map_or("-".into(), |v| format!("{:.4}", v as f64 / n as f64))
        };
        let vs = patch.map(|pw| f2 as f64 / pw as f64);
        if let Some(v) = vs {
            worst = worst.max(v);
        }
        // Where the changed copy's wire bytes went, for whoever tunes the index.
        breakdown(&format!("{name} changed"), s, &before, f2, w2.len());
        report::row(
            title,
            &header,
            vec![
                name,
                format!("{:.1}", first.len() as f64 / 1e6),
                format!("{:.4}", ratio(f1, first.len())),
                f(z9(&first_path), first.len()),
                format!("{:.0}", first.len() as f64 / cpu1 / 1e6),
                first_levels,
                format!("{:.1}", changed.len() as f64 / 1e6),
                format!("{:.4}", ratio(f2, changed.len())),
                f(z9(&changed_path), changed.len()),
                f(patch, changed.len()),
                vs.map_or("-".into(), |v| format!("{v:.2}x")),
                format!("{:.0}", changed.len() as f64 / cpu / 1e6),
                levels(level_before, level),
                format!(
                    "{:.3}",
                    (s.no_base_bytes - before.no_base_bytes) as f64 / changed.len() as f64
                ),
            ],
        );
    }
    if worst > 0.0 {
        report::note(format!(
            "Worst changed copy against `zstd --long=31 --patch-from`: {worst:.2}x (target: at most 1.2x). \"no base\": share of the changed copy's bytes sent as literals although the delta index offered a base."
        ));
    }
    if let Some(b) = bases.as_ref().and_then(|b| b.lock().ok()) {
        let t = b.tier_stats();
        report::note(format!(
            "Delta store after the run: {} MB of bases in memory (bound {} MB), {} MB on disk (bound {} MB); the store and its index take at most {} MB of memory. Mirror cache: {} MB (bound {} MB).",
            t.mem_bytes / 1_000_000,
            cfg.delta_bytes / 1_000_000,
            t.disk_bytes / 1_000_000,
            opts.delta_disk / 1_000_000,
            b.footprint() / 1_000_000,
            enc.cache().size() / 1_000_000,
            cfg.cache_bytes / 1_000_000,
        ));
    }
    report::finish(
        "reduction-pairs",
        "reduction: every pair of the corpus, first and changed",
    );
}

fn measure(base1: &Path, wal_path: &Path, base2: &Path, binlog: Option<&Path>, opts: &Opts) {
    let (cfg, pressure, turn) = daemon_codec(opts.cache, opts.delta, opts.level);
    settings_note(&cfg, opts, turn.2, "across the data sets");
    let state = tempfile::tempdir().expect("tempdir");
    let (mut enc, _bases) = encoder(&cfg, turn, opts, state.path());
    let title = "Wire/raw per data set, in order through one encoder (the caches carry over)";
    let header = [
        "data",
        "MB",
        "wanopt",
        "cpu MB/s",
        "level",
        "T3 MB/s",
        "link",
        "gzip -6",
        "zstd -6",
        "zstd -9",
        "xz -6",
        "zstd --patch-from",
    ];
    let saved = "What each mechanism kept off the wire, as a share of the raw bytes";
    // The governor moves the level as a daemon's does (`optimize.zstd_adapt`), unless the
    // level is given.
    let mut t3 = VirtualT3::new(cfg.zstd_level, opts.level.is_none());
    let mut enc_level = cfg.zstd_level;
    let mut dec = Decoder::new(&cfg);
    // The charts' columns: wire/raw per tool, and what each of wanopt's mechanisms saved.
    let mut groups = Vec::new();
    let mut ratios: Vec<(String, Vec<Option<f64>>)> = [
        "wanopt",
        "gzip -6",
        "zstd -6",
        "zstd -9",
        "xz -6",
        "zstd --patch-from",
    ]
    .iter()
    .map(|t| (t.to_string(), Vec::new()))
    .collect();
    let mut mechanisms: Vec<(String, Vec<Option<f64>>)> = [
        "saved by dedup",
        "saved by delta",
        "saved by compression",
        "sent (wire / raw)",
    ]
    .iter()
    .map(|t| (t.to_string(), Vec::new()))
    .collect();
    let mut sets: Vec<(&str, &Path, Option<&Path>)> = vec![
        ("base backup", base1, None),
        ("WAL of the OLTP run", wal_path, None),
        ("base backup after OLTP", base2, Some(base1)),
        ("first base backup again", base1, None),
    ];
    if let Some(b) = binlog {
        sets.insert(2, ("MariaDB row binlog", b, None));
    }
    for (name, path, reference) in sets {
        let data = std::fs::read(path).expect("data set");
        let n = data.len() as f64;
        let before = enc.stats().clone();
        let level_before = enc_level;
        let (wire, framed, cpu, took, link_busy) =
            stream(&mut enc, &mut t3, &mut enc_level, pressure, &data);
        check(&mut dec, &wire, &data, name);
        let ratio = |t: Option<(u64, f64)>| t.map(|(w, _)| w as f64 / n);
        let other = |on: bool, cmd: &str, args: &[&str]| {
            if on && opts.others {
                ratio(tool(cmd, args, path))
            } else {
                None
            }
        };
        let from = reference.map(|r| format!("--patch-from={}", r.display()));
        let patch = from
            .as_deref()
            .and_then(|from| other(true, "zstd", &["--long=29", from, "-q", "-c", "-T1"]));
        let ours = framed as f64 / n;
        let row = [
            Some(ours),
            other(true, "gzip", &["-6", "-c"]),
            other(true, "zstd", &["-6", "-q", "-c", "-T1"]),
            other(true, "zstd", &["-9", "-q", "-c", "-T1"]),
            other(opts.xz, "xz", &["-6", "-c", "-T1"]),
            patch,
        ];
        let f = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.4}"));
        report::row(
            title,
            &header,
            vec![
                name.to_string(),
                format!("{:.1}", n / 1e6),
                format!("{ours:.4}"),
                format!("{:.0}", n / cpu / 1e6),
                if level_before == enc_level {
                    enc_level.to_string()
                } else {
                    format!("{level_before}→{enc_level}")
                },
                format!("{:.1}", n / took / 1e6),
                format!("{:.0}%", link_busy * 100.0),
                f(row[1]),
                f(row[2]),
                f(row[3]),
                f(row[4]),
                f(row[5]),
            ],
        );
        groups.push(name.to_string());
        for (col, v) in ratios.iter_mut().zip(row) {
            col.1.push(v);
        }
        // What each mechanism kept off the wire, as a share of the raw bytes.
        let s = enc.stats();
        let d = |a: u64, b: u64| a.saturating_sub(b) as f64 / n;
        let compression: f64 = (0..3)
            .map(|i| {
                d(
                    s.codec_bytes[i] - before.codec_bytes[i],
                    s.codec_wire[i] - before.codec_wire[i],
                )
            })
            .sum();
        let dedup = d(s.hit_bytes - before.hit_bytes, s.hit_wire - before.hit_wire);
        let delta = d(
            s.delta_bytes - before.delta_bytes,
            s.delta_wire - before.delta_wire,
        );
        report::row(
            saved,
            &["data", "dedup", "delta", "delta chunks", "compression"],
            vec![
                name.to_string(),
                format!("{dedup:.3}"),
                format!("{delta:.3}"),
                (s.delta_chunks - before.delta_chunks).to_string(),
                format!("{compression:.3}"),
            ],
        );
        for (col, v) in mechanisms.iter_mut().zip([dedup, delta, compression, ours]) {
            col.1.push(Some(v));
        }
    }
    let chart = |title: &str, unit: &str, series| {
        Chart::Bars(Bars {
            title: title.into(),
            unit: unit.into(),
            groups: groups.clone(),
            series,
            linear: true,
        })
    };
    let svg = render(&[
        chart(
            "wire / raw: wanopt and the compressors a DBA would use (lower is better)",
            "wire / raw",
            ratios,
        ),
        chart(
            "wanopt: where the raw bytes went, as a share of them",
            "share of the raw bytes",
            mechanisms,
        ),
    ])
    .expect("chart");
    let _ = std::fs::create_dir_all(Path::new(&opts.svg).parent().unwrap_or(Path::new(".")));
    std::fs::write(&opts.svg, svg).expect("write chart");
    report::note(format!("Chart: `{}`.", opts.svg));
    report::finish("reduction", "reduction: wire/raw of real database data");
}
