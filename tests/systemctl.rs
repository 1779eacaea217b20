//! `systemctl restart` keeps every stream; `systemctl stop` drains them. The shipped unit
//! (`systemd/wanoptd@.service`, sandbox and all) runs both daemons under a real systemd, booted as
//! PID 1 of a container of its own: new mount, PID, cgroup, UTS and IPC namespaces over an
//! overlay of the host's root (nothing the container writes reaches the host's files), with
//! `/proc/sys` and `/sys` read-only. The network is the host's, and only loopback is used. A
//! drop-in changes only what the container needs: the binary's path, the log file, and no
//! default dependencies (the container boots nothing but the daemons and a D-Bus).
//!
//! Needs root and systemd; skips with a reason elsewhere, fails where `WANOPT_REQUIRE_NETNS=1`.

mod common;

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const SEC: Duration = Duration::from_secs(1);
const SYSTEMD: &str = "/lib/systemd/systemd";

/// Why this test cannot run here, if it cannot.
fn missing() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("root".into());
    }
    for p in [
        SYSTEMD,
        "/usr/bin/dbus-daemon",
        "/usr/bin/unshare",
        "/usr/bin/nsenter",
    ] {
        if !Path::new(p).exists() {
            return Some(p.into());
        }
    }
    None
}

fn skip_or_fail(test: &str) -> bool {
    let Some(why) = missing() else { return false };
    if std::env::var("WANOPT_REQUIRE_NETNS").as_deref() == Ok("1") {
        panic!("{test}: WANOPT_REQUIRE_NETNS=1 but this test needs {why}");
    }
    eprintln!("{test}: skipped: needs {why}");
    true
}

/// The script that becomes the container's PID 1: it builds the container's root and execs
/// systemd in it. Arguments: the mount base, the folder of the binary, the config folder,
/// the units folder.
const BOOT: &str = r#"set -eu
B=$1 BIN=$2 ETC=$3 UNITS=$4
mount -t tmpfs -o mode=0755 wanopt-ctr "$B"
mkdir -p "$B/up" "$B/work" "$B/root"
mount -t overlay overlay -o "lowerdir=/,upperdir=$B/up,workdir=$B/work" "$B/root"
R=$B/root
mount -t proc proc "$R/proc"
mount --bind "$R/proc/sys" "$R/proc/sys"
mount -o remount,bind,ro "$R/proc/sys"
mount -t sysfs -o ro sysfs "$R/sys"
mount -t tmpfs -o mode=0755 cgroup "$R/sys/fs/cgroup"
mkdir "$R/sys/fs/cgroup/systemd" "$R/sys/fs/cgroup/unified"
mount -t cgroup -o none,name=systemd cgroup "$R/sys/fs/cgroup/systemd"
mount -t cgroup2 cgroup2 "$R/sys/fs/cgroup/unified"
mount --rbind /dev "$R/dev"
mount -t tmpfs -o mode=0755 run "$R/run"
mount -t tmpfs -o mode=1777 tmp "$R/tmp"
mkdir -p "$R/opt/wanopt-test" "$R/etc/wanopt" "$R/run/systemd/system"
mount --bind "$BIN" "$R/opt/wanopt-test"
mount -o remount,bind,ro "$R/opt/wanopt-test"
mount --bind "$ETC" "$R/etc/wanopt"
cp -a "$UNITS/." "$R/run/systemd/system/"
grep -q '^wanopt:' "$R/etc/group" || echo 'wanopt:x:987:' >> "$R/etc/group"
grep -q '^wanopt:' "$R/etc/passwd" || echo 'wanopt:x:987:987:wanopt:/nonexistent:/usr/sbin/nologin' >> "$R/etc/passwd"
chown -R 987:987 "$ETC"
cd "$R"
mkdir -p .old
pivot_root . .old
umount -l /.old
exec env -i container=wanopt-test PATH=/usr/sbin:/usr/bin:/sbin:/bin /lib/systemd/systemd --unit=wanopt-test.target
"#;

/// A systemd container; killed, with everything in it, when dropped.
struct Container {
    unshare: Child,
    pid1: i32,
    cgroups: Vec<PathBuf>,
    _dirs: tempfile::TempDir,
}

impl Container {
    /// Boots systemd with the shipped `wanoptd@.service`, the test drop-in, a D-Bus, and the
    /// configs in `etc`.
    fn boot(etc: &Path) -> Container {
        let dirs = tempfile::tempdir().expect("tempdir");
        let units = dirs.path().join("units");
        std::fs::create_dir_all(units.join("wanoptd@.service.d")).expect("units");
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        std::fs::copy(
            root.join("systemd/wanoptd@.service"),
            units.join("wanoptd@.service"),
        )
        .expect("the shipped unit");
        let write = |name: &str, text: &str| {
            std::fs::write(units.join(name), text).expect("unit");
        };
        write(
            "wanoptd@.service.d/test.conf",
            "[Unit]\nDefaultDependencies=no\n[Service]\nExecStart=\nExecStart=/opt/wanopt-test/wanoptd -c /etc/wanopt/%i.yaml\nStandardOutput=append:/run/wanopt-%i.log\nStandardError=inherit\n",
        );
        write(
            "wanopt-test.target",
            "[Unit]\nDefaultDependencies=no\nWants=dbus.service\n",
        );
        write(
            "dbus.socket",
            "[Unit]\nDefaultDependencies=no\n[Socket]\nListenStream=/run/dbus/system_bus_socket\n",
        );
        write(
            "dbus.service",
            "[Unit]\nDefaultDependencies=no\nRequires=dbus.socket\nAfter=dbus.socket\n[Service]\nExecStart=/usr/bin/dbus-daemon --system --address=systemd: --nofork --nopidfile --systemd-activation --syslog-only\n",
        );
        // The units want network-online.target, which would boot the host's whole sysinit.
        std::os::unix::fs::symlink("/dev/null", units.join("network-online.target")).expect("mask");
        let base = dirs.path().join("mnt");
        std::fs::create_dir_all(&base).expect("mnt");
        let boot = dirs.path().join("boot.sh");
        std::fs::write(&boot, BOOT).expect("boot script");
        // The container's cgroups: a folder of the host's in each hierarchy systemd uses,
        // which its cgroup namespace shows as the root.
        let tag = format!("wanopt-test-{}", std::process::id());
        let cgroups: Vec<PathBuf> = ["systemd", "unified"]
            .iter()
            .map(|h| Path::new("/sys/fs/cgroup").join(h).join(&tag))
            .collect();
        for c in &cgroups {
            std::fs::create_dir_all(c).expect("cgroup");
        }
        let bin_dir = bin("wanoptd")
            .parent()
            .expect("the binary's folder")
            .to_path_buf();
        let procs: Vec<String> = cgroups
            .iter()
            .map(|c| c.join("cgroup.procs").display().to_string())
            .collect();
        // The shell moves itself into the cgroups, then starts the namespaces.
        let unshare = Command::new("bash")
            .arg("-c")
            .arg(format!(
                "echo $$ > {} && echo $$ > {} && exec unshare --kill-child --cgroup --pid --fork --mount --propagation private --uts --ipc bash {} {} {} {} {}",
                procs[0],
                procs[1],
                boot.display(),
                base.display(),
                bin_dir.display(),
                etc.display(),
                units.display(),
            ))
            .stdout(Stdio::inherit())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("unshare");
        let start = Instant::now();
        let pid1 = loop {
            let children =
                std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", unshare.id()))
                    .unwrap_or_default();
            if let Some(p) = children
                .split_whitespace()
                .next()
                .and_then(|p| p.parse().ok())
            {
                break p;
            }
            assert!(start.elapsed() < 10 * SEC, "the container did not start");
            std::thread::sleep(Duration::from_millis(20));
        };
        let c = Container {
            unshare,
            pid1,
            cgroups,
            _dirs: dirs,
        };
        let up = c.wait(30 * SEC, || {
            c.run(&[
                "systemctl",
                "is-active",
                "wanopt-test.target",
                "dbus.service",
            ])
            .is_ok()
        });
        assert!(up, "systemd did not come up in the container");
        c
    }

    /// Runs a command inside the container; its output, or why it failed.
    fn run(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new("nsenter")
            .args(["-t", &self.pid1.to_string(), "-m", "-p", "--"])
            .args(args)
            .output()
            .map_err(|e| format!("nsenter: {e}"))?;
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        if out.status.success() {
            Ok(text)
        } else {
            Err(format!(
                "{args:?}: {}{text}",
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    fn systemctl(&self, args: &[&str]) -> String {
        let mut all = vec!["systemctl"];
        all.extend_from_slice(args);
        self.run(&all)
            .unwrap_or_else(|e| panic!("{e}\n{}", self.logs()))
    }

    fn main_pid(&self, unit: &str) -> u32 {
        self.systemctl(&["show", "-P", "MainPID", unit])
            .trim()
            .parse()
            .expect("MainPID")
    }

    fn log(&self, site: &str) -> String {
        self.run(&["cat", &format!("/run/wanopt-{site}.log")])
            .unwrap_or_default()
    }

    fn logs(&self) -> String {
        format!(
            "--- west\n{}\n--- east\n{}",
            self.log("west"),
            self.log("east")
        )
    }

    fn wait(&self, limit: Duration, mut f: impl FnMut() -> bool) -> bool {
        let start = Instant::now();
        while start.elapsed() < limit {
            if f() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }

    /// Waits for `needle` to appear `n` times in a site's log.
    fn wait_log(&self, site: &str, needle: &str, n: usize) {
        let ok = self.wait(60 * SEC, || self.log(site).matches(needle).count() >= n);
        assert!(ok, "{site}: no {n}x {needle:?}\n{}", self.logs());
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        // Killing PID 1 of the namespace kills every process in it.
        // SAFETY: kill with the pid this container's unshare started.
        unsafe { libc::kill(self.pid1, libc::SIGKILL) };
        let _ = self.unshare.kill();
        let _ = self.unshare.wait();
        std::thread::sleep(Duration::from_millis(200));
        for c in &self.cgroups {
            remove_cgroup(c);
        }
    }
}

/// Removes a cgroup folder and the ones systemd made below it, deepest first.
fn remove_cgroup(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroup(&e.path());
            }
        }
    }
    let _ = std::fs::remove_dir(dir);
}

fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
}

/// Under the shipped unit: `systemctl restart` of west, then of east, a `SIGUSR2` to east (the
/// packages' upgrade path), and a restart of west again, while streams move both ways; every
/// stream ends byte-exact, each restart was a handover through the store and each took-over
/// process counts it (a new main process, the unit active throughout, the streams taken up). Then `systemctl stop` drains: no
/// handover, the daemon stops, and a later start begins with an empty store.
#[test]
fn systemctl_restart_keeps_streams_and_stop_drains() {
    if skip_or_fail("systemctl_restart_keeps_streams_and_stop_drains") {
        return;
    }
    let srv = hash_server();
    let link = free_port();
    let svc = free_port();
    let admin = [free_port(), free_port()];
    let certs = Certs::new(&["west", "east"]);
    let etc = tempfile::tempdir().expect("etc");
    for f in ["ca.pem", "west.pem", "west.key", "east.pem", "east.key"] {
        std::fs::copy(certs.path().join(f), etc.path().join(f)).expect("cert");
    }
    let tls = |site: &str| {
        format!(
            "tls:\n  ca: /etc/wanopt/ca.pem\n  cert: /etc/wanopt/{site}.pem\n  key: /etc/wanopt/{site}.key\n"
        )
    };
    let common = |i: usize| {
        format!(
            "limits:\n  shutdown_grace: 5s\nadmin:\n  listen: {}\n",
            admin[i]
        )
    };
    std::fs::write(
        etc.path().join("east.yaml"),
        format!(
            "site: east\nlink:\n  listen: {link}\n  peer: west\n{}services:\n  - name: h\n    target: {srv}\n  - name: sync\n    target: {srv}\n    class: latency\nstate_dir: /var/lib/wanoptd/east\n{}",
            tls("east"),
            common(1)
        ),
    )
    .expect("east.yaml");
    std::fs::write(
        etc.path().join("west.yaml"),
        format!(
            "site: west\nlink:\n  connect: {link}\n  peer: east\n  reconnect_min: 50ms\n  reconnect_max: 500ms\n{}services:\n  - name: h\n    listen: {svc}\n  - name: sync\n    listen: 127.0.0.1:0\n    class: latency\nstate_dir: /var/lib/wanoptd/west\n{}",
            tls("west"),
            common(0)
        ),
    )
    .expect("west.yaml");
    let c = Container::boot(etc.path());
    c.systemctl(&["start", "wanoptd@east", "wanoptd@west"]);
    let linked = c.wait(30 * SEC, || hash_client(svc, 1, 1000, 1000).is_ok());
    assert!(linked, "no stream through the pair\n{}", c.logs());

    let clients: Vec<_> = (0..3u64)
        .map(|i| std::thread::spawn(move || paced_client(svc, 100 + i, 16 << 20, 1 << 20, 3 << 20)))
        .collect();
    let mut pids = vec![c.main_pid("wanoptd@west")];
    let mut restarts = [0usize; 2];
    for (site, how) in [
        ("west", "restart"),
        ("east", "restart"),
        ("east", "SIGUSR2"),
        ("west", "restart"),
    ] {
        std::thread::sleep(3 * SEC);
        let unit = format!("wanoptd@{site}");
        let i = usize::from(site == "east");
        let before = c.main_pid(&unit);
        if how == "restart" {
            restarts[i] += 1;
            c.systemctl(&["restart", &unit]);
            c.wait_log(
                site,
                "handed over to systemd for the restarted process",
                restarts[i],
            );
        } else {
            // The packages' upgrade path: the unit's main process moves to the new binary
            // (MAINPID=) and the unit stays active throughout.
            c.systemctl(&["kill", "--kill-who=main", "-s", "SIGUSR2", &unit]);
            c.wait_log(site, "handed over to the new process", 1);
        }
        let after = c.main_pid(&unit);
        assert_ne!(before, after, "{unit}: the same main process after a {how}");
        assert_eq!(c.systemctl(&["is-active", &unit]).trim(), "active");
        if site == "west" {
            pids.push(after);
        }
        // The new process counts the handover, the streams it carried and, once the link
        // resumed, the stall.
        let at = admin[i];
        let stalled = c.wait(30 * SEC, || {
            value_f64(&scrape(at), "wanopt_handover_stall_seconds_total ") > 0.0
        });
        let m = scrape(at);
        assert!(stalled, "{site}: no stall counted\n{m}");
        let label = if how == "restart" {
            "restart"
        } else {
            "signal"
        };
        assert_eq!(
            value(
                &m,
                &format!("wanopt_handovers_taken_total{{how=\"{label}\"}} ")
            ),
            1,
            "{m}"
        );
        assert!(
            value(&m, "wanopt_handover_streams_total ") >= 3,
            "{site}: {m}"
        );
        eprintln!(
            "{unit}: a {how} stalled the streams {:.3} s",
            value_f64(&m, "wanopt_handover_stall_seconds_total ")
        );
    }
    for (i, t) in clients.into_iter().enumerate() {
        let r = t.join().expect("client thread");
        assert!(r.is_ok(), "stream {i}: {r:?}\n{}", c.logs());
    }
    // A stream opened after the restarts works.
    let r = hash_client(svc, 7, 1 << 20, 1 << 20);
    assert!(r.is_ok(), "{r:?}\n{}", c.logs());

    // Stop drains: no third handover on west, the daemon says it drained and stopped.
    c.systemctl(&["stop", "wanoptd@west"]);
    let log = c.log("west");
    assert_eq!(
        log.matches("handed over to systemd for the restarted process")
            .count(),
        2,
        "stop must not hand over\n{log}"
    );
    assert!(
        log.contains("draining streams") && log.contains("stopped"),
        "{log}"
    );
    // Started again, west starts afresh (nothing in the store) and serves.
    c.systemctl(&["start", "wanoptd@west"]);
    let served = c.wait(30 * SEC, || hash_client(svc, 8, 1000, 1000).is_ok());
    assert!(
        served,
        "west did not serve after stop and start\n{}",
        c.logs()
    );
    assert_eq!(
        c.log("west")
            .matches("took the link's streams over")
            .count(),
        2,
        "a start after a stop takes nothing over"
    );
    eprintln!("west's main processes: {pids:?}");
}
