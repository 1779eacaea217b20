//! systemd integration: readiness and status through a fake `NOTIFY_SOCKET`, and the shipped units
//! pass `systemd-analyze verify`.

mod common;

use std::os::unix::net::UnixDatagram;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

fn next_message(sock: &UnixDatagram, want: &str) -> String {
    let end = Instant::now() + Duration::from_secs(15);
    let mut buf = [0u8; 4096];
    loop {
        assert!(Instant::now() < end, "no notification containing {want:?}");
        if let Ok(n) = sock.recv(&mut buf) {
            let m = String::from_utf8_lossy(&buf[..n]).into_owned();
            if m.contains(want) {
                return m;
            }
        }
    }
}

#[test]
fn readiness_and_status_reach_the_notify_socket() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&path).expect("bind notify socket");
    sock.set_read_timeout(Some(Duration::from_millis(200))).ok();
    let env = [("NOTIFY_SOCKET", path.to_str().expect("utf8"))];
    let certs = Certs::new(&["west", "east"]);
    let mut east = Daemon::start_env(
        None,
        "east",
        &site_yaml("east", "west", "listen: 127.0.0.1:0", &certs, "  []", ""),
        &env,
    );
    let ready = next_message(&sock, "READY=1");
    assert!(
        ready.contains("STATUS=waiting for the link to west"),
        "{ready}"
    );
    assert!(
        ready.contains(&format!("MAINPID={}", east.pid())),
        "{ready}"
    );
    // Ready means bound: the link port accepts connections already.
    let link = east.bound("link");
    std::net::TcpStream::connect(link).expect("link port is listening at readiness");
    let west = Daemon::start("west", &west_yaml(link, &certs, "  []"));
    west.wait_log("link up", Duration::from_secs(10));
    next_message(&sock, "STATUS=link up to west");
    drop(west);
    // With resumption (the default), streams would wait for west to come back.
    next_message(
        &sock,
        "STATUS=link to west lost; its streams wait up to 30s",
    );
    let st = east.stop(libc::SIGTERM);
    assert!(st.success());
    next_message(&sock, "STOPPING=1");
}

#[test]
fn shipped_units_pass_systemd_analyze_verify() {
    let have = Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_ok();
    if !have {
        assert!(
            std::env::var("WANOPT_REQUIRE_NETNS").as_deref() != Ok("1"),
            "systemd-analyze is missing in CI (apt-get install systemd)"
        );
        eprintln!("SKIPPED: systemd-analyze is not installed");
        return;
    }
    let units = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("systemd");
    let dir = tempfile::tempdir().expect("tempdir");
    // The unit's ExecStart binary must exist at its path: point it at the one just built.
    let exe = bin("wanoptd");
    for name in ["wanoptd.service", "wanoptd@.service"] {
        let text = std::fs::read_to_string(units.join(name)).expect("unit");
        assert!(text.contains("/usr/bin/wanoptd"), "{name}");
        let text = text.replace("/usr/bin/wanoptd", exe.to_str().expect("utf8"));
        std::fs::write(dir.path().join(name), text).expect("write");
    }
    for unit in ["wanoptd.service", "wanoptd@west.service"] {
        let out = Command::new("systemd-analyze")
            .arg("verify")
            .arg(dir.path().join(unit))
            .output()
            .expect("systemd-analyze");
        let err = String::from_utf8_lossy(&out.stderr);
        let ours: Vec<&str> = err.lines().filter(|l| l.contains("wanoptd")).collect();
        assert!(out.status.success() && ours.is_empty(), "{unit}: {err}");
    }
}
