//! How bulk services share a full link (see `link/streams/shaper.rs`), in the pair harness with
//! virtual time: shares divide the link whatever the stream counts, a guarantee holds against
//! many competing streams, a ceiling caps an idle link, a service that stops gives its share
//! away at once, and no stream starves. Every byte arrives exactly and nothing leaks.

mod common;

use common::*;
use wanopt_proto::Shaping;

/// The pipe's rate: a T3's 45 Mbit/s in bytes per second.
const RATE: f64 = 5_625_000.0;

struct Run {
    p: Pair,
    /// Every stream: its service, and the bytes it sends.
    streams: Vec<(StreamId, &'static str, Bytes)>,
}

impl Run {
    /// An up pair whose west side shapes its services as `shaping` says.
    fn new(shaping: &[(&str, Shaping)]) -> Run {
        let mut p = up_pair();
        p.east.link.set_services(["redo", "backup", "copy"]);
        p.west
            .link
            .set_shaping(shaping.iter().map(|(n, s)| (*n, *s)));
        Run {
            p,
            streams: Vec::new(),
        }
    }

    /// Opens `n` bulk streams of `service`, each sending `len` bytes and its end.
    fn open(&mut self, service: &'static str, n: usize, len: usize) {
        for _ in 0..n {
            let seed = self.streams.len() as u64 + 100;
            let data = pattern(seed, len);
            let id = open_and_send(&mut self.p, service, Class::Bulk, data.clone());
            self.streams.push((id, service, data));
        }
    }

    /// Bytes east has received from each of `service`'s streams.
    fn per_stream(&self, service: &str) -> Vec<usize> {
        self.streams
            .iter()
            .filter(|(_, s, _)| *s == service)
            .map(|(id, _, _)| self.p.east.app.received.get(id).map_or(0, Vec::len))
            .collect()
    }

    fn received(&self, service: &str) -> f64 {
        self.per_stream(service).iter().sum::<usize>() as f64
    }

    /// Each service's rate (bytes per second) over the next `secs` of virtual time.
    fn rates(&mut self, secs: u64, services: &[&str]) -> Vec<f64> {
        let before: Vec<f64> = services.iter().map(|s| self.received(s)).collect();
        self.p.drive(Duration::from_secs(secs));
        services
            .iter()
            .zip(before)
            .map(|(s, b)| (self.received(s) - b) / secs as f64)
            .collect()
    }

    /// Runs every stream to its end, checks each one's bytes, closes them and checks that
    /// nothing leaked.
    fn finish(mut self) {
        self.p.drive(Duration::from_secs(120));
        for (id, service, data) in &self.streams {
            let got = self
                .p
                .east
                .app
                .received
                .get(id)
                .map_or(&[][..], Vec::as_slice);
            assert!(got == &data[..], "{service} stream {id:?} differs");
            assert!(
                self.p.east.app.fin.contains(id),
                "{service} {id:?} unfinished"
            );
            self.p.east.app.to_send.insert(*id, (Bytes::new(), true));
        }
        self.p.drive(Duration::from_secs(5));
        self.p.assert_no_leaks();
    }
}

fn share(n: u32) -> Shaping {
    Shaping {
        share: n,
        ..Shaping::default()
    }
}

/// Services with shares 3:1 get 3:1 of a full link, one stream against sixteen, and the link
/// stays full.
#[test]
fn shares_divide_a_full_link_whatever_the_stream_counts() {
    let mut r = Run::new(&[("redo", share(3)), ("backup", share(1))]);
    r.open("redo", 1, 24 << 20);
    r.open("backup", 16, 2 << 20);
    r.p.drive(Duration::from_secs(1));
    let v = r.rates(3, &["redo", "backup"]);
    let ratio = v[0] / v[1];
    assert!(
        (ratio - 3.0).abs() <= 0.15,
        "3:1 shares gave {ratio:.3} ({v:?})"
    );
    assert!(v[0] + v[1] > 0.95 * RATE, "the link was not full: {v:?}");
    // Inside a service its streams take turns: none starves.
    let per = r.per_stream("backup");
    let mean = per.iter().sum::<usize>() as f64 / per.len() as f64;
    assert!(
        per.iter().all(|&n| n as f64 > 0.8 * mean),
        "a backup stream fell behind: {per:?}"
    );
    r.finish();
}

/// Equal shares (the default for services the config does not name): each service gets half,
/// however many streams it opens.
#[test]
fn the_service_not_the_stream_is_the_unit_of_fairness() {
    let mut r = Run::new(&[]);
    r.open("redo", 1, 12 << 20);
    r.open("backup", 8, 3 << 20);
    r.p.drive(Duration::from_secs(1));
    let v = r.rates(3, &["redo", "backup"]);
    for x in &v {
        assert!((x / RATE - 0.5).abs() <= 0.025, "equal shares gave {v:?}");
    }
    r.finish();
}

/// A guarantee holds against sixteen streams of a service with ten times its share.
#[test]
fn min_rate_holds_against_many_competing_streams() {
    let guarantee = 2_000_000;
    let mut r = Run::new(&[
        (
            "redo",
            Shaping {
                min_rate: Some(guarantee),
                ..share(1)
            },
        ),
        ("backup", share(10)),
    ]);
    r.open("redo", 1, 16 << 20);
    r.open("backup", 16, 3 << 20);
    r.p.drive(Duration::from_secs(1));
    let v = r.rates(4, &["redo", "backup"]);
    assert!(
        v[0] >= 0.95 * guarantee as f64,
        "redo got {} of its {guarantee} B/s guarantee",
        v[0]
    );
    assert!(v[0] + v[1] > 0.95 * RATE, "the link was not full: {v:?}");
    let counts = r.p.west.link.take_wire_counts();
    assert!(counts.iter().all(|(_, c)| c.held.is_zero()), "{counts:?}");
    r.finish();
}

/// A ceiling caps a service alone on an idle link, and the time it waited is counted.
#[test]
fn max_rate_caps_an_idle_link() {
    let ceiling = 1_000_000;
    let mut r = Run::new(&[(
        "copy",
        Shaping {
            max_rate: Some(ceiling),
            ..share(1)
        },
    )]);
    r.open("copy", 4, 2 << 20);
    r.p.drive(Duration::from_secs(1));
    let v = r.rates(5, &["copy"]);
    assert!(
        (v[0] / ceiling as f64 - 1.0).abs() <= 0.05,
        "capped at {ceiling} B/s, sent {} B/s",
        v[0]
    );
    let counts = r.p.west.link.take_wire_counts();
    let copy = counts
        .iter()
        .find(|(s, _)| &**s == "copy")
        .map(|(_, c)| *c)
        .expect("copy's counts");
    assert!(
        copy.held > Duration::from_secs(4),
        "held {:?} of 6 s",
        copy.held
    );
    r.finish();
}

/// A service that stops sending gives its share away at once: the other takes the whole link
/// in the next second.
#[test]
fn a_service_that_stops_gives_its_share_away_at_once() {
    let mut r = Run::new(&[("redo", share(4)), ("backup", share(1))]);
    r.open("redo", 1, 4 << 20);
    r.open("backup", 4, 6 << 20);
    // Redo's 4 MiB take about a second at four fifths of the link.
    r.p.drive(Duration::from_millis(1500));
    assert_eq!(r.received("redo") as usize, 4 << 20, "redo not done");
    let v = r.rates(2, &["backup"]);
    assert!(v[0] > 0.95 * RATE, "backup alone got {} of {RATE}", v[0]);
    r.finish();
}

/// New shares apply from the next turn, and the streams go on untouched (a reload).
#[test]
fn new_shares_apply_to_running_streams() {
    let mut r = Run::new(&[]);
    r.open("redo", 1, 32 << 20);
    r.open("backup", 4, 4 << 20);
    r.p.drive(Duration::from_secs(1));
    let v = r.rates(2, &["redo", "backup"]);
    assert!((v[0] / v[1] - 1.0).abs() <= 0.05, "equal shares gave {v:?}");
    r.p.west
        .link
        .set_shaping([("redo", share(4)), ("backup", share(1))]);
    r.p.drive(Duration::from_millis(200));
    let v = r.rates(2, &["redo", "backup"]);
    assert!(
        (v[0] / v[1] - 4.0).abs() <= 0.2,
        "4:1 after the change gave {v:?}"
    );
    assert!(r.p.east.app.resets.is_empty() && r.p.west.app.resets.is_empty());
    r.finish();
}
