//! An active/standby gateway with keepalived's floating address, as docs/scaling.md describes:
//! two gateway namespaces on one LAN bridge share a VRRP address, each runs the listening
//! daemon, and the peer dials the floating address. Failing the active gateway moves the
//! address; a stream in flight ends in an error, never in wrong bytes, and new streams cross
//! the standby with a cold cache. Needs root, namespaces and keepalived (Debian's package).

mod common;

use common::*;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The LAN's addresses: the bridge (the peer site and the target live there), the two
/// gateways and the floating address.
const LAN: &str = "10.77.0.1";
const GW: [&str; 2] = ["10.77.0.2", "10.77.0.3"];
const VIP: &str = "10.77.0.100";

/// The namespaces and keepalived processes of one test, removed when dropped.
struct Lan {
    lan: String,
    gw: [String; 2],
    keepalived: Vec<Child>,
    dir: tempfile::TempDir,
}

impl Drop for Lan {
    fn drop(&mut self) {
        for k in &mut self.keepalived {
            let _ = k.kill();
            let _ = k.wait();
        }
        if std::thread::panicking() {
            for i in 0..2 {
                let log = std::fs::read_to_string(self.dir.path().join(format!("ka{i}.log")));
                eprintln!("---- keepalived {i} ----\n{}", log.unwrap_or_default());
            }
        }
        for ns in self.gw.iter().chain([&self.lan]) {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

fn ip(args: &[&str]) {
    let ok = Command::new("ip")
        .args(args)
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "ip {}", args.join(" "));
}

/// Runs `f` on a thread inside namespace `ns`.
fn in_ns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let ns = ns.to_string();
    std::thread::spawn(move || {
        wansim::sys::enter_netns(&ns).expect("enter namespace");
        f()
    })
    .join()
    .expect("thread in namespace")
}

/// Whether `ns` holds the floating address.
fn holds_vip(ns: &str) -> bool {
    Command::new("ip")
        .args(["-n", ns, "-4", "-o", "addr", "show", "dev", "eth0"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains(&format!("{VIP}/")))
}

fn wait_for(what: &str, timeout: Duration, f: impl Fn() -> bool) {
    let end = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

impl Lan {
    /// The bridge in its namespace, the two gateways on it, keepalived in each (the first
    /// with the higher priority), until the first holds the floating address.
    fn start() -> Lan {
        let tag = std::process::id() % 100_000;
        let lan = format!("fol{tag}");
        let gw = [format!("foa{tag}"), format!("fob{tag}")];
        let mut l = Lan {
            lan: lan.clone(),
            gw: gw.clone(),
            keepalived: Vec::new(),
            dir: tempfile::tempdir().expect("tempdir"),
        };
        ip(&["netns", "add", &lan]);
        ip(&["-n", &lan, "link", "set", "lo", "up"]);
        ip(&["-n", &lan, "link", "add", "br0", "type", "bridge"]);
        ip(&[
            "-n",
            &lan,
            "addr",
            "add",
            &format!("{LAN}/24"),
            "dev",
            "br0",
        ]);
        ip(&["-n", &lan, "link", "set", "br0", "up"]);
        for (i, ns) in gw.iter().enumerate() {
            let port = format!("v{i}");
            ip(&["netns", "add", ns]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
            ip(&[
                "-n", &lan, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns",
                ns,
            ]);
            ip(&["-n", &lan, "link", "set", &port, "master", "br0", "up"]);
            ip(&[
                "-n",
                ns,
                "addr",
                "add",
                &format!("{}/24", GW[i]),
                "dev",
                "eth0",
            ]);
            ip(&["-n", ns, "link", "set", "eth0", "up"]);
            let conf = l.dir.path().join(format!("ka{i}.conf"));
            std::fs::write(
                &conf,
                format!(
                    "global_defs {{\n  router_id gw{i}\n}}\nvrrp_instance wanopt {{\n  state BACKUP\n  interface eth0\n  virtual_router_id 77\n  priority {}\n  advert_int 1\n  virtual_ipaddress {{\n    {VIP}/24 dev eth0\n  }}\n}}\n",
                    150 - 50 * i
                ),
            )
            .expect("keepalived config");
            let file = |name: String| l.dir.path().join(name);
            let log = std::fs::File::create(file(format!("ka{i}.log"))).expect("log");
            let child = Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    ns,
                    "keepalived",
                    "--dont-fork",
                    "--log-console",
                ])
                .args(["--vrrp", "--log-detail", "-f"])
                .arg(&conf)
                .arg("-p")
                .arg(file(format!("ka{i}.pid")))
                .arg("-r")
                .arg(file(format!("ka{i}.vrrp.pid")))
                .stdout(Stdio::from(log.try_clone().expect("log")))
                .stderr(Stdio::from(log))
                .spawn()
                .expect("keepalived");
            l.keepalived.push(child);
        }
        wait_for(
            "the first gateway to hold the floating address",
            Duration::from_secs(20),
            || holds_vip(&gw[0]),
        );
        assert!(
            !holds_vip(&gw[1]),
            "both gateways hold the floating address"
        );
        l
    }
}

/// Wire bytes west sent for `svc`, read from its admin port inside the LAN namespace.
fn wire_out(lan: &str, admin: SocketAddr) -> u64 {
    let m = in_ns(lan, move || {
        scrape_on(TcpStream::connect(admin).expect("admin"))
    });
    value(&m, &series("wanopt_wire_bytes_total", "svc", "out"))
}

#[test]
fn a_standby_gateway_takes_the_floating_address_and_carries_new_streams() {
    if !wansim::available_or_skip("an active/standby gateway pair with keepalived") {
        return;
    }
    let have = Command::new("keepalived")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok();
    if !have {
        let why = "keepalived is not installed (apt-get install keepalived)";
        assert!(
            std::env::var("WANOPT_REQUIRE_NETNS").as_deref() != Ok("1"),
            "{why}"
        );
        eprintln!("skipping the active/standby gateway test: {why}");
        return;
    }
    let lan = Lan::start();
    // The target behind the gateways, on the LAN.
    let target = in_ns(&lan.lan, || {
        TcpListener::bind((LAN, 9100)).expect("bind target")
    });
    serve_on(target, hash_handler);
    let certs = Certs::new(&["west", "east"]);
    // Both gateways run the listening side with the same config; only the one holding the
    // floating address is reached.
    let gateway = |i: usize| {
        Daemon::start_in(
            Some(&lan.gw[i]),
            &format!("east{i}"),
            &site_yaml(
                "east",
                "west",
                "listen: 0.0.0.0:7400",
                &certs,
                &format!("  - name: svc\n    target: {LAN}:9100\n"),
                "",
            ),
        )
    };
    let (a, b) = (gateway(0), gateway(1));
    let west = Daemon::start_in(
        Some(&lan.lan),
        "west",
        &site_yaml(
            "west",
            "east",
            &format!("connect: {VIP}:7400"),
            &certs,
            "  - name: svc\n    listen: 127.0.0.1:0\n",
            "admin:\n  listen: 127.0.0.1:0\n",
        ),
    );
    west.wait_log("link up", Duration::from_secs(20));
    a.wait_log("link up", Duration::from_secs(10));
    let (svc, admin) = (west.bound("svc"), west.bound("admin"));
    let connect = |lan: &str| in_ns(lan, move || TcpStream::connect(svc).expect("svc"));
    let len = 16u64 << 20;

    // Through the active gateway: a first copy, then a repeat that costs references.
    hash_client_on(connect(&lan.lan), 1, len, 0).expect("first copy through the active gateway");
    let first = wire_out(&lan.lan, admin);
    hash_client_on(connect(&lan.lan), 1, len, 0).expect("repeat through the active gateway");
    let repeat = wire_out(&lan.lan, admin) - first;
    assert!(repeat * 20 < first, "a repeat cost {repeat} of {first}");
    assert!(!b.log().iter().any(|l| l.contains("link up")));

    // A stream in flight when the active gateway drops off the LAN.
    let s = connect(&lan.lan);
    let inflight = std::thread::spawn(move || hash_client_on(s, 2, 64 << 30, 0));
    std::thread::sleep(Duration::from_millis(500));
    ip(&["-n", &lan.gw[0], "link", "set", "eth0", "down"]);
    let failed_at = Instant::now();
    wait_for(
        "the standby to take the floating address",
        Duration::from_secs(20),
        || holds_vip(&lan.gw[1]),
    );
    b.wait_log("link up", Duration::from_secs(30));
    west.wait_log_n("link up", 2, Duration::from_secs(30));
    let took = failed_at.elapsed();
    let r = inflight.join().expect("in-flight client");
    assert!(
        r.is_err(),
        "a stream in flight across the failover must end in an error"
    );

    // Through the standby: exact, and a first copy's cost (its cache is its own, cold).
    let before = wire_out(&lan.lan, admin);
    hash_client_on(connect(&lan.lan), 1, len, 0).expect("the same data through the standby");
    let after_failover = wire_out(&lan.lan, admin) - before;
    assert!(
        after_failover * 10 > first * 9,
        "through the standby: {after_failover} wire bytes against a first copy's {first}"
    );
    eprintln!(
        "failover: link up through the standby {:.1} s after the active gateway dropped; first copy {first} wire bytes, repeat {repeat}, the same data after the failover {after_failover}",
        took.as_secs_f64()
    );
}
