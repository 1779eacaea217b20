//! The `wanoptd` command line: config validation and exit codes, `check`, `certs`, and the shipped
//! configs in `config/`.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

fn wanoptd(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(bin("wanoptd"))
        .args(args)
        .output()
        .expect("run wanoptd");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A loopback port nobody listens on now (to check later that nothing was bound to it).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

#[test]
fn every_shipped_config_loads() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).expect("config dir") {
        let p = e.expect("entry").path();
        // prometheus-rules.yaml is Prometheus's (tests/metrics.rs loads it).
        let rules = p.file_name().is_some_and(|n| n == "prometheus-rules.yaml");
        if p.extension().is_some_and(|x| x == "yaml") && !rules {
            wanopt_runtime::Config::load(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            n += 1;
        }
    }
    assert!(n >= 2, "expected the west/east pair in config/");
}

/// What the benches state for each wansim preset is a valid `link:` section, with the
/// preset's own figures.
#[test]
fn every_preset_states_a_link_the_daemon_accepts() {
    let certs = Certs::new(&["west", "east"]);
    for (name, _) in wansim::PRESETS {
        let params = wansim::preset(name).expect("preset");
        let (lines, _) = wanopt_replay::showcase::stated_link(&params);
        let yaml = link_lines(
            west_yaml("127.0.0.1:7400".parse().expect("addr"), &certs, "  []"),
            &lines,
        );
        let cfg = wanopt_runtime::Config::parse(&yaml, std::path::Path::new("west.yaml"))
            .unwrap_or_else(|e| panic!("{name}: {e}\n{yaml}"));
        let (rate, rtt) = params.stated();
        assert_eq!(Some(cfg.link.bandwidth_bps), rate, "{name}");
        assert_eq!(cfg.link.rtt, rtt, "{name}");
    }
}

#[test]
fn bad_config_exits_64_naming_the_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cases = [
        (
            "site: west\nlink: {connect: 'x:1', peer: east, bandwidth: fast}\ntls: {ca: a, cert: b, key: c}\n",
            "link.bandwidth",
        ),
        (
            "site: west\nlink: {connect: 'x:1', peer: east}\ntls: {ca: a, cert: b, key: c}\ncolour: blue\n",
            "colour",
        ),
        (
            "site: west\nlink: {connect: 'x:1', peer: east}\ntls: {ca: a, cert: b, key: c}\nservices:\n  - {name: dg, listen: 'nowhere'}\n",
            "services[0].listen",
        ),
        ("{{{{", "config"),
    ];
    for (i, (yaml, field)) in cases.iter().enumerate() {
        let p = dir.path().join(format!("bad{i}.yaml"));
        std::fs::write(&p, yaml).expect("write");
        for sub in [&[][..], &["check"][..]] {
            let mut args: Vec<&str> = sub.to_vec();
            args.extend(["-c", p.to_str().expect("utf8")]);
            let (code, _, err) = wanoptd(&args);
            assert_eq!(code, 64, "{args:?}: {err}");
            assert!(
                err.contains(field),
                "{args:?}: {err:?} does not name {field}"
            );
        }
    }
    let (code, _, err) = wanoptd(&["-c", "/nonexistent/wanopt.yaml"]);
    assert_eq!(code, 64, "{err}");
}

#[test]
fn missing_tls_files_exit_64_before_binding() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    let p = dir.path().join("west.yaml");
    std::fs::write(
        &p,
        format!("site: west\nlink: {{listen: '127.0.0.1:{port}', peer: east}}\ntls: {{ca: certs/ca.pem, cert: certs/west.pem, key: certs/west.key}}\n"),
    )
    .expect("write");
    let (code, _, err) = wanoptd(&["-c", p.to_str().expect("utf8")]);
    assert_eq!(code, 64, "{err}");
    assert!(
        err.contains("ca.pem") && err.contains("wanoptd certs"),
        "{err}"
    );
    // Nothing was bound: the port is still free.
    std::net::TcpListener::bind(("127.0.0.1", port)).expect("port still free");
}

/// A TLS key others can read and a state directory others can write are refused with exit 64,
/// naming the file and the fix, before any port is bound.
/// What the daemon refuses at start, `wanoptd check` refuses too, each with exit 64 and nothing
/// bound: a key open to others, a state directory others may write, a certificate issued to
/// another site, one from another CA, a key that is not the certificate's.
#[test]
fn check_and_start_refuse_the_same_files_before_binding() {
    use std::os::unix::fs::PermissionsExt;
    let certs = Certs::new(&["west", "east"]);
    let other = Certs::new(&["west"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).expect("mkdir");
    let p = dir.path().join("west.yaml");
    let write = |ca: &std::path::Path, cert: &std::path::Path, key: &std::path::Path| {
        std::fs::write(
            &p,
            format!(
                "site: west\nlink: {{listen: '127.0.0.1:{port}', peer: east}}\n\
                 tls: {{ca: {}, cert: {}, key: {}}}\nstate_dir: {}\noptimize:\n  disk:\n    bytes: 512MiB\n",
                ca.display(),
                cert.display(),
                key.display(),
                state.display()
            ),
        )
        .expect("write")
    };
    let d = certs.path();
    let own = || write(&d.join("ca.pem"), &d.join("west.pem"), &d.join("west.key"));
    let path = p.to_str().expect("utf8");
    let refused = |what: &str, needles: &[&str]| {
        for args in [vec!["-c", path], vec!["check", "-c", path]] {
            let (code, _, err) = wanoptd(&args);
            assert_eq!(code, 64, "{what}, {args:?}: {err}");
            for n in needles {
                assert!(err.contains(n), "{what}, {args:?}: {err}");
            }
        }
    };
    let chmod = |f: &std::path::Path, m: u32| {
        std::fs::set_permissions(f, std::fs::Permissions::from_mode(m)).expect("chmod")
    };
    own();
    let (code, out, err) = wanoptd(&["check", "-c", path]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("site: west"), "{out}");
    assert!(
        err.contains("not checked: the peer's certificate"),
        "check says what it could not check: {err}"
    );
    let key = d.join("west.key");
    chmod(&key, 0o644);
    refused("an exposed key", &["west.key", "chmod 600"]);
    chmod(&key, 0o600);
    chmod(&state, 0o777);
    refused("a world-writable state_dir", &["state_dir", "chmod 700"]);
    chmod(&state, 0o700);
    write(&d.join("ca.pem"), &d.join("east.pem"), &d.join("east.key"));
    refused(
        "east's certificate",
        &["east.pem", "not issued to this site \"west\""],
    );
    let o = other.path();
    write(&d.join("ca.pem"), &o.join("west.pem"), &o.join("west.key"));
    refused(
        "another CA's certificate",
        &["not signed by the configured CA"],
    );
    write(&d.join("ca.pem"), &d.join("west.pem"), &d.join("east.key"));
    refused("another certificate's key", &["east.key", "does not fit"]);
    std::net::TcpListener::bind(("127.0.0.1", port)).expect("port still free");
}

#[test]
fn certs_then_check_prints_the_effective_config() {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = dir.path().join("certs");
    let (code, out, err) = wanoptd(&[
        "certs",
        "--out",
        certs.to_str().expect("utf8"),
        "west",
        "east",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("west.key"), "{out}");
    use std::os::unix::fs::PermissionsExt;
    for k in ["ca.key", "west.key", "east.key"] {
        let mode = std::fs::metadata(certs.join(k))
            .expect("key")
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600, "{k}");
    }
    let p = dir.path().join("west.yaml");
    std::fs::write(&p, "site: west\nlink: {connect: '127.0.0.1:7400', peer: east, congestion: cubic}\ntls: {ca: certs/ca.pem, cert: certs/west.pem, key: certs/west.key}\n").expect("write");
    let (code, out, err) = wanoptd(&["check", "-c", p.to_str().expect("utf8")]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("congestion: cubic") && out.contains("stream_window:"),
        "{out}"
    );
    let (code, _, err) = wanoptd(&["certs", "--out", certs.to_str().expect("utf8"), "Bad_Name"]);
    assert_ne!(code, 0);
    assert!(err.contains("Bad_Name"), "{err}");
}

/// `wanoptd demo` runs both sites' configs in one process (a runtime thread each, with
/// `limits.threads: 2`), creating their certificates: the link comes up and a stream crosses
/// it exactly. Ctrl-C stops both; each site's latency lane copies close with its link and are
/// not reported lost.
#[test]
fn demo_runs_both_sites_in_one_process() {
    let dir = tempfile::tempdir().expect("tempdir");
    let srv = hash_server();
    let (link, svc, sync) = (free_port(), free_port(), free_port());
    for (site, peer, l, s, y) in [
        (
            "east",
            "west",
            format!("listen: 127.0.0.1:{link}"),
            format!("target: {srv}"),
            format!("target: {srv}"),
        ),
        (
            "west",
            "east",
            format!("connect: 127.0.0.1:{link}"),
            format!("listen: 127.0.0.1:{svc}"),
            format!("listen: 127.0.0.1:{sync}"),
        ),
    ] {
        let yaml = format!(
            "site: {site}\nlink:\n  {l}\n  peer: {peer}\n  congestion: cubic\ntls: {{ca: certs/ca.pem, cert: certs/{site}.pem, key: certs/{site}.key}}\nservices:\n  - name: svc\n    {s}\n  - name: sync\n    {y}\n    class: latency\n    redundancy: 2\nlimits:\n  threads: 2\n"
        );
        std::fs::write(dir.path().join(format!("{site}.yaml")), yaml).expect("config");
    }
    let mut child = Command::new(bin("wanoptd"))
        .args(["demo", "--dir"])
        .arg(dir.path())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn demo");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    // Both sites' links up, and a second connection carrying the latency lane.
    let (mut ups, mut copies) = (0, 0);
    let end = Instant::now() + Duration::from_secs(20);
    let mut log = Vec::new();
    while ups < 2 || copies < 2 {
        let left = end.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) => {
                ups += usize::from(l.contains("link up"));
                copies += usize::from(l.contains("latency lane copy attached"));
                log.push(l);
            }
            Err(_) => {
                let _ = child.kill();
                panic!("no link up from both sites: {}", log.join("\n"));
            }
        }
    }
    // Each site's lines name it: the two sites' events and totals can be told apart.
    for site in ["east", "west"] {
        assert!(
            log.iter()
                .any(|l| l.contains("link up") && l.contains(&format!("site{{site={site}}}"))),
            "no link up line naming {site}: {}",
            log.join("\n")
        );
    }
    let r = hash_client(
        format!("127.0.0.1:{svc}").parse().expect("addr"),
        5,
        4 << 20,
        1 << 20,
    );
    hash_client(
        format!("127.0.0.1:{sync}").parse().expect("addr"),
        6,
        8192,
        8192,
    )
    .expect("a latency-class stream through the demo pair");
    // SAFETY: kill with the child's pid and a valid signal number.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGINT);
    }
    let status = child.wait().expect("the demo exits");
    // Every line it wrote, up to the end of its stderr.
    let _ = reader.join();
    log.extend(rx.try_iter());
    r.expect("a stream through the demo pair");
    assert!(status.success(), "{status:?}: {}", log.join("\n"));
    // Each site's own copies of the latency lane close with its link: not "lost". (What one
    // site sees of the other's connections closing before that one's GoAway arrives, on
    // another connection, is still a warning: the two stop at once here.)
    let warned: Vec<&String> = log
        .iter()
        .filter(|l| l.contains(" WARN ") && l.contains("reason=closed"))
        .collect();
    assert!(warned.is_empty(), "an orderly stop warned: {warned:?}");
    assert!(dir.path().join("certs/ca.pem").exists());
}
