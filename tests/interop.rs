//! A pair of daemons of this build and of an earlier one carries streams exactly, both ways
//! round (the earlier one listening, then dialing): the wire format and the hello are what
//! an operator upgrading one gateway at a time relies on. Bulk streams go optimized (a
//! compressible one, an incompressible one, and the same again, which goes as references) and
//! a latency-class service answers small requests.
//!
//! The earlier build is the `wanoptd` at `WANOPT_INTEROP_WANOPTD`; `.ci/run` builds it from the
//! commit it names and sets `WANOPT_REQUIRE_INTEROP=1`, so there the test fails rather than
//! skips without it.

mod common;

use std::time::Duration;

use common::*;

/// Rows of text as a database page holds them: compressible, and cut into chunks that repeat.
fn rows(n: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for i in 0..n {
        out.extend_from_slice(
            format!(
                "{i:08},customer {:05},order {:07},status SHIPPED,amount {:>9}.{:02}\n",
                i % 997,
                i * 7,
                i % 10007,
                i % 100
            )
            .as_bytes(),
        );
    }
    out
}

fn run(east_exe: &std::path::Path, west_exe: &std::path::Path, label: &str) {
    let certs = Certs::new(&["west", "east"]);
    let target = hash_server();
    let east = Daemon::start_bin(
        east_exe,
        None,
        "east",
        &east_yaml(
            &certs,
            &format!(
                "  - name: bulk\n    target: {target}\n  - name: sync\n    target: {target}\n    class: latency\n"
            ),
        ),
        &[],
    );
    let west = Daemon::start_bin(
        west_exe,
        None,
        "west",
        &west_yaml(
            east.bound("link"),
            &certs,
            "  - name: bulk\n    listen: 127.0.0.1:0\n  - name: sync\n    listen: 127.0.0.1:0\n    class: latency\n",
        ),
        &[],
    );
    east.wait_log("link up", Duration::from_secs(20));
    west.wait_log("link up", Duration::from_secs(20));
    let (bulk, sync) = (west.bound("bulk"), west.bound("sync"));
    let text = rows(200_000);
    let mut noise = vec![0u8; 8 << 20];
    fill(7, 0, &mut noise);
    for (what, body) in [
        ("rows", &text),
        ("noise", &noise),
        ("rows again", &text),
        ("noise again", &noise),
    ] {
        send_checked(bulk, body.len() as u64, |off, buf| {
            let at = off as usize;
            buf.copy_from_slice(&body[at..at + buf.len()]);
        })
        .unwrap_or_else(|e| panic!("{label}, {what}: {e}"));
    }
    for i in 0..50u64 {
        hash_client(sync, i, 8192, 512).unwrap_or_else(|e| panic!("{label}, sync {i}: {e}"));
    }
    // Several at once, both classes.
    let workers: Vec<_> = (0..6u64)
        .map(|i| {
            let addr = if i % 2 == 0 { bulk } else { sync };
            std::thread::spawn(move || hash_client(addr, 100 + i, 1 << 20, 1 << 16))
        })
        .collect();
    for w in workers {
        w.join()
            .expect("client")
            .unwrap_or_else(|e| panic!("{label}, concurrent: {e}"));
    }
}

#[test]
fn this_build_and_an_earlier_one_carry_streams_both_ways_round() {
    let Some(old) = earlier_wanoptd() else { return };
    let new = bin("wanoptd");
    run(&old, &new, "the earlier build listening");
    run(&new, &old, "the earlier build dialing");
}
