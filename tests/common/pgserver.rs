//! Database servers of a test's own (PostgreSQL here; MariaDB in `tests/recipes.rs`), run as
//! their own users, optionally inside a network namespace (a wansim site), and the small
//! process helpers they need.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A directory the database servers' users can reach, owned by `user`.
pub fn owned_dir(parent: &Path, name: &str, user: &str) -> PathBuf {
    let d = parent.join(name);
    std::fs::create_dir_all(&d).expect("mkdir");
    run("chown", &[user, d.to_str().expect("utf8")]).expect("chown");
    d
}

pub fn run(cmd: &str, args: &[&str]) -> Result<String, String> {
    run_with(cmd, args, "")
}

/// `cmd args` with `input` on its standard input.
pub fn run_with(cmd: &str, args: &[&str], input: &str) -> Result<String, String> {
    use std::io::Write;
    let mut child = Command::new(cmd)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{cmd}: {e}"))?;
    let mut stdin = child.stdin.take().ok_or("no stdin")?;
    let input = input.to_string();
    let feeder = std::thread::spawn(move || {
        let _ = stdin.write_all(input.as_bytes());
    });
    let out = child
        .wait_with_output()
        .map_err(|e| format!("{cmd}: {e}"))?;
    let _ = feeder.join();
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{cmd} {args:?}: {}\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// `cmd args` as `user`, with `path` first in PATH.
pub fn run_as(user: &str, path: &Path, cmd: &str, args: &[&str]) -> Result<String, String> {
    run_as_with(user, path, cmd, args, "")
}

/// [`run_as`] with `input` on the command's standard input.
pub fn run_as_with(
    user: &str,
    path: &Path,
    cmd: &str,
    args: &[&str],
    input: &str,
) -> Result<String, String> {
    run_as_in(None, user, path, cmd, args, input)
}

/// [`run_as_with`] inside network namespace `netns`, if given.
pub fn run_as_in(
    netns: Option<&str>,
    user: &str,
    path: &Path,
    cmd: &str,
    args: &[&str],
    input: &str,
) -> Result<String, String> {
    let path_env = format!("PATH={}:/usr/sbin:/usr/bin:/sbin:/bin", path.display());
    let mut a = Vec::new();
    if let Some(ns) = netns {
        a.extend(["netns", "exec", ns, "runuser"]);
    }
    a.extend(["-u", user, "--", "env", path_env.as_str(), cmd]);
    a.extend_from_slice(args);
    run_with(if netns.is_some() { "ip" } else { "runuser" }, &a, input)
}

/// Polls `f` every 200 ms until it returns `Some`, or panics with `what` after `limit`.
pub fn wait_for<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let end = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < end, "timed out: {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// The newest installed PostgreSQL's server binaries.
pub fn server_bin() -> PathBuf {
    let versions = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| {
            d.filter_map(Result::ok)
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    let v = versions.into_iter().max().unwrap_or(0);
    PathBuf::from(format!("/usr/lib/postgresql/{v}/bin"))
}

/// A PostgreSQL server of this test's own, stopped when dropped.
pub struct PgServer {
    bin: PathBuf,
    data: PathBuf,
    pub sock: PathBuf,
    pub port: u16,
}

impl PgServer {
    pub fn start(bin: &Path, data: &Path, sock: &Path) -> PgServer {
        Self::start_in(None, bin, data, sock)
    }

    /// Like [`start`](Self::start), the server inside network namespace `netns` (its TCP port
    /// on that namespace's loopback; its Unix socket, in `sock`, reachable from anywhere).
    pub fn start_in(netns: Option<&str>, bin: &Path, data: &Path, sock: &Path) -> PgServer {
        let port = free_port();
        let opts = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1",
            sock.display()
        );
        let log = data.with_extension("log");
        let s = PgServer {
            bin: bin.to_path_buf(),
            data: data.to_path_buf(),
            sock: sock.to_path_buf(),
            port,
        };
        run_as_in(
            netns,
            "postgres",
            bin,
            "pg_ctl",
            &[
                "-D",
                data.to_str().expect("utf8"),
                "-o",
                &opts,
                "-l",
                log.to_str().expect("utf8"),
                "-w",
                "-t",
                "60",
                "start",
            ],
            "",
        )
        .unwrap_or_else(|e| {
            panic!(
                "start {}: {e}\n{}",
                data.display(),
                std::fs::read_to_string(&log).unwrap_or_default()
            )
        });
        s
    }

    /// `sql` through psql as `postgres` (each statement on its own, as a script), unaligned,
    /// tuples only; stops at the first error.
    pub fn psql(&self, sql: &str) -> Result<String, String> {
        let port = self.port.to_string();
        run_as_with(
            "postgres",
            &self.bin,
            "psql",
            &[
                "-X",
                "-q",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-h",
                self.sock.to_str().expect("utf8"),
                "-p",
                &port,
                "-U",
                "postgres",
                "-d",
                "postgres",
                "-f",
                "-",
            ],
            sql,
        )
        .map(|s| s.trim().to_string())
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let _ = run_as(
            "postgres",
            &self.bin,
            "pg_ctl",
            &[
                "-D",
                self.data.to_str().unwrap_or(""),
                "-m",
                "immediate",
                "-w",
                "stop",
            ],
        );
    }
}
