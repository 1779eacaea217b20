//! The `wansim` command line: up (with a preset), exec in a site, counters on SIGUSR1, clean exit
//! on SIGTERM, and down after a crash. Needs root, TUN and `ip` (CI fails instead of skipping).

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::bin;

#[test]
fn up_exec_counters_and_clean_exit() {
    if !wansim::available_or_skip("wansim cli") {
        return;
    }
    let prefix = format!("wcli{}", std::process::id() % 100_000);
    let mut up = Command::new(bin("wansim"))
        .args([
            "--prefix",
            &prefix,
            "up",
            "--preset",
            "t3-100ms-clean",
            "--loss",
            "0.1%",
            "--burst-loss",
            "1%,5",
            "--burst-clock",
            "line",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("wansim up");
    let (tx, rx) = mpsc::channel();
    let stdout = up.stdout.take().expect("stdout");
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let first = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("wansim up line");
    assert!(
        first.contains("198.18.0.1") && first.contains(&format!("{prefix}-west")),
        "{first}"
    );
    let params = rx
        .recv_timeout(Duration::from_secs(2))
        .expect("params line");
    assert!(
        params.contains("45000 kbit/s")
            && params.contains("50ms")
            && params.contains("0.100%")
            && params.contains("burst loss 1.000% in runs of 5.0 steps of 266.666µs"),
        "{params}"
    );

    let out = Command::new(bin("wansim"))
        .args([
            "--prefix", &prefix, "exec", "west", "--", "ip", "-o", "-4", "addr", "show", "dev",
            "wan0",
        ])
        .output()
        .expect("exec");
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("198.18.0.1 peer 198.18.0.2"));

    unsafe { libc::kill(up.id() as i32, libc::SIGUSR1) };
    let mut saw_counters = false;
    while let Ok(l) = rx.recv_timeout(Duration::from_secs(2)) {
        if l.starts_with("west->east:") && l.contains("drops loss") {
            saw_counters = true;
            break;
        }
    }
    assert!(saw_counters, "no counters after SIGUSR1");

    unsafe { libc::kill(up.id() as i32, libc::SIGTERM) };
    let st = up.wait().expect("wait");
    assert!(st.success(), "{st:?}");
    // The reader thread ends at EOF, which closes the channel.
    let rest: Vec<String> = rx.iter().collect();
    assert!(
        rest.iter().any(|l| l.starts_with("final west->east")),
        "{rest:?}"
    );
    assert!(
        wansim::sys::list_netns()
            .iter()
            .all(|n| !n.starts_with(&prefix))
    );

    // A killed instance leaves its namespaces; `down` removes them.
    let mut up = Command::new(bin("wansim"))
        .args(["--prefix", &prefix, "up"])
        .stdout(Stdio::null())
        .spawn()
        .expect("up");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while wansim::sys::list_netns()
        .iter()
        .filter(|n| n.starts_with(&prefix))
        .count()
        < 2
    {
        assert!(
            std::time::Instant::now() < deadline,
            "namespaces never appeared"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    up.kill().expect("kill");
    up.wait().expect("wait");
    let out = Command::new(bin("wansim"))
        .args(["--prefix", &prefix, "down"])
        .output()
        .expect("down");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("removed 2"),
        "{out:?}"
    );

    let bad = Command::new(bin("wansim"))
        .args(["--prefix", &prefix, "up", "--rate", "fast"])
        .output()
        .expect("bad");
    assert_eq!(bad.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--rate"));
}
