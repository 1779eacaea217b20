//! docs/replication.md's recipes, run as written through a pair started from the shipped
//! `config/west.yaml` and `config/east.yaml`: a PostgreSQL standby cloned with `pg_basebackup -R`
//! streams and then replicates synchronously, and a MariaDB replica replicates from its primary,
//! each through the services the samples define (the standby side listens, the primary side
//! targets), with the rows compared at the end. The docs' code blocks are the commands: only host
//! names, addresses, ports and directories are replaced with the test's own, and a replacement
//! that finds nothing fails the test, so neither the docs nor the samples can drift from what
//! works.
//!
//! Needs root (the servers run as their own users), PostgreSQL's server binaries and MariaDB's.
//! Outside CI a missing piece skips with a reason; `WANOPT_REQUIRE_POSTGRES=1` and
//! `WANOPT_REQUIRE_MARIADB=1` (set by `.ci/run`) turn those skips into failures.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::pgserver::*;
use common::*;

/// The west gateway's address as the recipes write it, and what stands for it here.
const WEST_GW_ADDR: &str = "192.0.2.10";

fn root_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root_dir().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// Whether the test can run; `None` with a printed reason (or a panic under `require`).
fn can_run(require: &str, needs: &[&str]) -> bool {
    let missing: Vec<String> = needs
        .iter()
        .filter(|p| !Path::new(p).exists())
        .map(|p| p.to_string())
        .collect();
    let why = if unsafe { libc::geteuid() } != 0 {
        Some("not root (the database servers run as their own users)".to_string())
    } else if !missing.is_empty() {
        Some(format!("missing {}", missing.join(", ")))
    } else {
        None
    };
    match why {
        None => true,
        Some(w) if std::env::var(require).as_deref() == Ok("1") => panic!("{require}=1 but {w}"),
        Some(w) => {
            eprintln!("skipping: {w} (set {require}=1 to fail instead)");
            false
        }
    }
}

/// The fenced code blocks of the section under `### {heading}`: (info string, body).
fn blocks(doc: &str, heading: &str) -> Vec<(String, String)> {
    let start = doc
        .find(&format!("\n### {heading}\n"))
        .unwrap_or_else(|| panic!("docs/replication.md has no section {heading:?}"));
    let section = &doc[start + 1..];
    let section = &section[..section[4..].find("\n### ").map_or(section.len(), |e| e + 4)];
    let mut out = Vec::new();
    let mut lines = section.lines();
    while let Some(l) = lines.next() {
        if let Some(info) = l.strip_prefix("```") {
            let body: Vec<&str> = lines
                .by_ref()
                .take_while(|l| !l.starts_with("```"))
                .collect();
            out.push((info.to_string(), body.join("\n") + "\n"));
        }
    }
    out
}

/// The one block of `section` with info string `info` whose text contains `needle`.
fn block(doc: &str, section: &str, info: &str, needle: &str) -> String {
    let found: Vec<String> = blocks(doc, section)
        .into_iter()
        .filter(|(i, b)| i == info && b.contains(needle))
        .map(|(_, b)| b)
        .collect();
    assert_eq!(
        found.len(),
        1,
        "docs/replication.md, {section}: want one ```{info} block with {needle:?}, found {found:?}"
    );
    found.into_iter().next().unwrap_or_default()
}

/// `text` with each (from, to) replaced; every `from` must occur.
fn replaced(text: &str, subs: &[(&str, String)]) -> String {
    let mut t = text.to_string();
    for (from, to) in subs {
        assert!(t.contains(from), "{from:?} is not in:\n{t}");
        t = t.replace(from, to);
    }
    t
}

/// A shipped sample config made to run here: its certificates, a state directory, and every
/// listener on a loopback port of the kernel's choosing; `subs` sets the rest.
fn sample(site: &str, certs: &Certs, state: &Path, subs: &[(&str, String)]) -> String {
    let mut text = read(&format!("config/{site}.yaml"));
    let d = certs.path().display();
    text = replaced(
        &text,
        &[
            ("certs/ca.pem", format!("{d}/ca.pem")),
            (&format!("certs/{site}.pem"), format!("{d}/{site}.pem")),
            (&format!("certs/{site}.key"), format!("{d}/{site}.key")),
        ],
    );
    text = replaced(&text, subs);
    // Listeners: the samples' fixed ports could be taken on a test machine.
    let lines: Vec<String> = text
        .lines()
        .map(|l| match l.find("listen: ") {
            Some(i) if !l.trim_start().starts_with('#') => {
                let rest = &l[i + 8..];
                let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
                format!("{}listen: 127.0.0.1:0{}", &l[..i], &rest[end..])
            }
            _ => l.to_string(),
        })
        .collect();
    format!(
        "{}\nstate_dir: {}\n",
        lines.join("\n"),
        state.join(site).display()
    )
}

/// East, then west dialing it, both from the samples, with west's `target` line `from` pointed
/// at this test's server on `port`.
struct SamplePair {
    west: Daemon,
    east: Daemon,
    _certs: Certs,
    _state: tempfile::TempDir,
}

fn sample_pair(from: &str, port: u16) -> SamplePair {
    let certs = Certs::new(&["west", "east"]);
    let state = tempfile::tempdir().expect("state");
    let east = Daemon::start("east", &sample("east", &certs, state.path(), &[]));
    let link = east.bound("link");
    let subs = [
        ("connect: 127.0.0.1:7400", format!("connect: {link}")),
        (from, format!("target: 127.0.0.1:{port}")),
    ];
    let west = Daemon::start("west", &sample("west", &certs, state.path(), &subs));
    west.wait_log("link up", Duration::from_secs(15));
    SamplePair {
        west,
        east,
        _certs: certs,
        _state: state,
    }
}

/// The raw bytes a service moved through a daemon, both ways.
fn service_bytes(d: &Daemon, service: &str) -> u64 {
    let text = scrape(d.bound("admin"));
    value(&text, &series("wanopt_raw_bytes_total", service, "out"))
        + value(&text, &series("wanopt_raw_bytes_total", service, "in"))
}

// ---------------------------------------------------------------- PostgreSQL

const PG_ROWS: &str =
    "SELECT count(*) || ' ' || md5(string_agg(id || '=' || v, ',' ORDER BY id)) FROM recipe";

#[test]
fn postgres_standby_replicates_through_the_pair_as_the_docs_say() {
    let bin = server_bin();
    let needs = [bin.join("initdb"), bin.join("pg_basebackup")];
    let needs: Vec<&str> = needs.iter().filter_map(|p| p.to_str()).collect();
    if !can_run("WANOPT_REQUIRE_POSTGRES", &needs) {
        return;
    }
    let doc = read("docs/replication.md");
    let section = "PostgreSQL streaming replication";
    let role_sql = block(&doc, section, "sql", "CREATE ROLE");
    let hba = block(&doc, section, "", "replication");
    let clone = block(&doc, section, "sh", "pg_basebackup");
    let sync_sql = block(&doc, section, "sql", "synchronous_standby_names");

    let tmp = tempfile::tempdir().expect("tempdir");
    run("chmod", &["755", tmp.path().to_str().expect("utf8")]).expect("chmod");
    let sock = owned_dir(tmp.path(), "sock", "postgres");
    let work = owned_dir(tmp.path(), "pg", "postgres");
    let primary_dir = work.join("primary");
    let standby_dir = work.join("standby");
    run_as(
        "postgres",
        &bin,
        "initdb",
        &[
            "-D",
            primary_dir.to_str().expect("utf8"),
            "-U",
            "postgres",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
        ],
    )
    .expect("initdb");
    // Only the recipe's line lets a replication connection in: initdb's own go.
    let hba_path = primary_dir.join("pg_hba.conf");
    let kept: Vec<String> = std::fs::read_to_string(&hba_path)
        .expect("pg_hba.conf")
        .lines()
        .filter(|l| !(l.starts_with("host") && l.contains("replication")))
        .map(str::to_string)
        .collect();
    let recipe_hba = replaced(&hba, &[(WEST_GW_ADDR, "127.0.0.1".into())]);
    std::fs::write(&hba_path, kept.join("\n") + "\n" + &recipe_hba).expect("pg_hba.conf");
    let primary = PgServer::start(&bin, &primary_dir, &sock);
    primary.psql(&role_sql).expect("the recipe's role");
    primary.psql("SELECT pg_reload_conf()").expect("reload");

    // Kept whole: its certificates and state directories live as long as the daemons.
    let pair = sample_pair("target: 127.0.0.1:5432", primary.port);
    let (west, east) = (&pair.west, &pair.east);
    let gw = east.bound("pg");

    // The clone, through east's pg service, as the docs write it.
    let script = replaced(
        &clone,
        &[
            ("east-gw", gw.ip().to_string()),
            ("15432", gw.port().to_string()),
            (
                "/var/lib/postgresql/15/main",
                standby_dir.display().to_string(),
            ),
        ],
    );
    run_as("postgres", &bin, "bash", &["-euc", &script]).expect("the recipe's pg_basebackup");
    let auto = std::fs::read_to_string(standby_dir.join("postgresql.auto.conf"))
        .expect("postgresql.auto.conf");
    assert!(
        auto.contains(&format!("port={}", gw.port())),
        "-R did not point the standby at the gateway: {auto}"
    );
    let cloned = service_bytes(east, "pg");
    assert!(
        cloned > 1 << 20,
        "the clone did not cross the pair: {cloned} bytes"
    );

    let standby = PgServer::start(&bin, &standby_dir, &sock);
    wait_for("the standby streams", Duration::from_secs(30), || {
        let s = primary.psql("SELECT state FROM pg_stat_replication").ok()?;
        (s == "streaming").then_some(())
    });
    primary
        .psql(&sync_sql)
        .expect("the recipe's synchronous_standby_names");
    wait_for(
        "the standby is synchronous",
        Duration::from_secs(30),
        || {
            let s = primary
                .psql("SELECT sync_state FROM pg_stat_replication")
                .ok()?;
            (s == "sync").then_some(())
        },
    );
    // Commits now wait for the standby's flush through the pair.
    primary
        .psql(
            "CREATE TABLE recipe AS SELECT g AS id, md5(g::text) AS v FROM generate_series(1, 50000) g;\n\
             UPDATE recipe SET v = upper(v) WHERE id % 7 = 0;\n\
             DELETE FROM recipe WHERE id % 13 = 0;",
        )
        .expect("rows on the primary");
    let want = primary.psql(PG_ROWS).expect("primary rows");
    let got = wait_for("the standby has the rows", Duration::from_secs(30), || {
        let got = standby.psql(PG_ROWS).ok()?;
        (got == want).then_some(got)
    });
    assert_eq!(got, want);
    assert!(want.starts_with("46154 "), "{want}");
    // The walreceiver's traffic crossed the pair: west connected it to the primary.
    assert!(service_bytes(west, "pg") > cloned);
}

// ---------------------------------------------------------------- MariaDB

/// A MariaDB server of this test's own, stopped when dropped.
struct Maria {
    child: std::process::Child,
    sock: PathBuf,
    port: u16,
}

impl Maria {
    /// Initializes `dir` and starts a server on it with the options `cnf` (`key = value`
    /// lines, as in a server configuration's `[mariadbd]` section).
    fn start(dir: &Path, cnf: &str) -> Maria {
        let data = dir.join("data");
        run(
            "mariadb-install-db",
            &[
                "--no-defaults",
                "--user=mysql",
                &format!("--datadir={}", data.display()),
                "--auth-root-authentication-method=socket",
                "--skip-test-db",
            ],
        )
        .expect("mariadb-install-db");
        let port = free_port();
        let sock = dir.join("sock");
        let mut args = vec![
            "--no-defaults".to_string(),
            "--user=mysql".to_string(),
            format!("--datadir={}", data.display()),
            format!("--socket={}", sock.display()),
            format!("--port={port}"),
            "--bind-address=127.0.0.1".to_string(),
            "--skip-name-resolve".to_string(),
            format!("--log-error={}", dir.join("error.log").display()),
            format!("--pid-file={}", dir.join("pid").display()),
        ];
        for l in cnf
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
        {
            let (k, v) = l.split_once('=').unwrap_or((l, ""));
            args.push(format!("--{}={}", k.trim(), v.trim()));
        }
        let child = Command::new("mariadbd")
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("mariadbd");
        let m = Maria { child, sock, port };
        wait_for("mariadbd answers", Duration::from_secs(60), || {
            m.sql("SELECT 1").ok()
        });
        m
    }

    fn sql(&self, sql: &str) -> Result<String, String> {
        run(
            "mariadb",
            &[
                "--no-defaults",
                "-u",
                "root",
                "-S",
                self.sock.to_str().expect("utf8"),
                "-N",
                "-B",
                "-e",
                sql,
            ],
        )
        .map(|s| s.trim().to_string())
    }
}

impl Drop for Maria {
    fn drop(&mut self) {
        let _ = self.sql("SHUTDOWN");
        let end = Instant::now() + Duration::from_secs(20);
        while Instant::now() < end {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const MARIA_ROWS: &str =
    "SELECT CONCAT(COUNT(*), ' ', SUM(CRC32(CONCAT(id, '=', v)))) FROM recipe.t";

#[test]
fn mariadb_replica_replicates_through_the_pair_as_the_docs_say() {
    if !can_run(
        "WANOPT_REQUIRE_MARIADB",
        &["/usr/sbin/mariadbd", "/usr/bin/mariadb-install-db"],
    ) {
        return;
    }
    let doc = read("docs/replication.md");
    let section = "MariaDB and MySQL replication";
    let cnf = block(&doc, section, "ini", "server_id");
    let user_sql = block(&doc, section, "sql", "CREATE USER");
    let replica_sql = block(&doc, section, "sql", "CHANGE MASTER TO");

    let tmp = tempfile::tempdir().expect("tempdir");
    run("chmod", &["755", tmp.path().to_str().expect("utf8")]).expect("chmod");
    let primary = Maria::start(&owned_dir(tmp.path(), "primary", "mysql"), &cnf);
    // The replica: the recipe's other server id, no binary log.
    let replica = Maria::start(&owned_dir(tmp.path(), "replica", "mysql"), "server_id = 2");
    primary
        .sql(&replaced(&user_sql, &[(WEST_GW_ADDR, "127.0.0.1".into())]))
        .expect("the recipe's user");

    // Kept whole: its certificates and state directories live as long as the daemons.
    let pair = sample_pair("target: 127.0.0.1:3306", primary.port);
    let (west, east) = (&pair.west, &pair.east);
    let gw = east.bound("mariadb");
    replica
        .sql(&replaced(
            &replica_sql,
            &[
                ("'east-gw'", format!("'{}'", gw.ip())),
                ("13306", gw.port().to_string()),
            ],
        ))
        .expect("the recipe's CHANGE MASTER TO");

    primary
        .sql(
            "CREATE DATABASE recipe; USE recipe; \
             CREATE TABLE recipe.t (id INT PRIMARY KEY, v VARCHAR(64)) ENGINE=InnoDB; \
             INSERT INTO recipe.t SELECT seq, MD5(CONCAT(seq, UUID())) FROM seq_1_to_50000; \
             UPDATE recipe.t SET v = UPPER(v) WHERE id % 7 = 0; \
             DELETE FROM recipe.t WHERE id % 13 = 0",
        )
        .expect("rows on the primary");
    let want = primary.sql(MARIA_ROWS).expect("primary rows");
    let got = wait_for("the replica has the rows", Duration::from_secs(60), || {
        let got = replica.sql(MARIA_ROWS).ok()?;
        (got == want).then_some(got)
    });
    assert_eq!(got, want);
    assert!(want.starts_with("46154 "), "{want}");
    let status = replica
        .sql("SHOW GLOBAL STATUS LIKE 'Slave_running'")
        .expect("status");
    assert_eq!(status, "Slave_running\tON");
    // The binary log crossed the pair (the replica knows no other way to the primary): east's
    // listener and west's connection to the primary both carried it. UUID() makes the insert
    // go as row events, megabytes of them.
    let (e, w) = (
        service_bytes(east, "mariadb"),
        service_bytes(west, "mariadb"),
    );
    assert!(e > 1 << 20 && w > 1 << 20, "east {e}, west {w} bytes");
}
