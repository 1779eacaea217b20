//! A latency lane carried by copies (see `common::Copies`): independent loss on each copy's
//! connection, copies cut and attached again mid-stream. Every stream must end byte-exact both
//! ways, the merged lane equal to what was sent (each offset delivered once), nothing leaked.
//! Also what copies buy: a message one copy delays arrives on time on the other, and copies
//! spaced in time get through a burst of loss that takes copies sent back to back. With the
//! lane's datagrams beside the copies (`common::DatagramPath`), pieces arriving before, after
//! or instead of the copies' bytes change nothing of that.

mod common;

use common::*;

const TOKEN: u64 = 0x5eed_cafe;
const LATENCY: Duration = Duration::from_millis(20);
const RATE: u64 = 5_000_000;

fn attach_lane(p: &mut Pair) {
    let token = p.west.link.lane_offer().expect("east offers a lane");
    assert!(p.east.link.attach_lane(token) && p.west.link.attach_lane(token));
}

/// The copies of a newly attached lane: one connection per loss rate, both ways.
fn copies(p: &Pair, loss: &[f64], seed: u64) -> Box<Copies> {
    let mut c = Copies::default();
    for (slot, l) in loss.iter().enumerate() {
        let s = seed.wrapping_add(slot as u64 * 0x9e37_79b9);
        c.w2e
            .attach(slot, CopyPipe::new(p.now, LATENCY, RATE, *l, s));
        c.e2w
            .attach(slot, CopyPipe::new(p.now, LATENCY, RATE, *l, s ^ 0xfeed));
    }
    Box::new(c)
}

/// An up pair (resumable, so a lane lost with every copy resumes) whose latency lane is
/// carried by one copy per entry of `loss`.
fn pair(codec: bool, loss: &[f64], seed: u64) -> Pair {
    let mut p = Pair::with(
        LATENCY,
        RATE,
        |c| {
            resumable(c, codec);
            c.token = 0;
        },
        |c| {
            resumable(c, codec);
            c.token = TOKEN;
        },
    );
    p.drive(Duration::from_secs(1));
    assert!(p.west.app.up && p.east.app.up, "hello exchange failed");
    attach_lane(&mut p);
    p.copies = Some(copies(&p, loss, seed));
    p
}

/// Text-like bytes that compress and repeat, so the codec's caches are in play.
fn data(seed: u64, len: usize) -> Bytes {
    let noise = wanopt_codec::testdata::noise(seed, len / 4 + 16);
    let mut v: Vec<u8> = noise
        .iter()
        .flat_map(|n| match n % 4 {
            0 => &b"redo "[..],
            1 => b"scn=",
            2 => b"commit\n",
            _ => std::slice::from_ref(n),
        })
        .copied()
        .take(len)
        .collect();
    v.resize(len, b'.');
    let half = len / 2;
    v.copy_within(..half, len - half);
    v.into()
}

/// The lane's copies in each direction delivered exactly what was sent, each byte once.
fn check_wires(c: &Copies, whole: bool) -> Result<(), TestCaseError> {
    for (name, w) in [("west to east", &c.w2e), ("east to west", &c.e2w)] {
        prop_assert!(w.errors.is_empty(), "{name}: {:?}", w.errors);
        prop_assert!(
            w.produced.starts_with(&w.merged),
            "{name}: merged bytes differ from the sent ones"
        );
        if whole {
            prop_assert_eq!(w.merged.len(), w.produced.len(), "{}: bytes missing", name);
        }
    }
    Ok(())
}

/// Loses copy `slot` (its connection carries both ways). If no copy left brings what follows
/// the delivered bytes, the lane is lost: both links are told and a new lane with fresh copies
/// is attached, as the runtime does. Returns true if the lane was lost.
fn cut_copy(
    p: &mut Pair,
    slot: usize,
    loss: &[f64],
    seed: u64,
    bursty: &Bursty,
) -> Result<bool, TestCaseError> {
    let c = p.copies.as_mut().expect("copies");
    c.w2e.cut(slot);
    c.e2w.cut(slot);
    if c.w2e.merge.complete() && c.e2w.merge.complete() {
        return Ok(false);
    }
    check_wires(c, false)?;
    for side in [&mut p.west, &mut p.east] {
        side.inbufs[1].clear();
        prop_assert!(side.link.lane_lost(p.now));
    }
    attach_lane(p);
    p.copies = Some(copies(p, loss, seed ^ 0x55));
    bursty.apply(p);
    Ok(true)
}

/// Loss in bursts on the path every copy shares, and the spacing of copies in time.
#[derive(Clone, Default)]
struct Bursty {
    spacing: Duration,
    /// Windows in which every batch sent is lost, from the pair's start.
    windows: Vec<(Instant, Instant)>,
    /// The lane also sends datagrams, each lost with this probability beside the bursts.
    datagrams: Option<f64>,
}

impl Bursty {
    /// Bursts of `(start, length)` milliseconds after `t0`, copies `spacing_ms` apart.
    fn new(t0: Instant, spacing_ms: u64, bursts: &[(u64, u64)]) -> Bursty {
        let ms = Duration::from_millis;
        Bursty {
            spacing: ms(spacing_ms),
            windows: bursts
                .iter()
                .map(|(at, len)| (t0 + ms(*at), t0 + ms(at + len)))
                .collect(),
            datagrams: None,
        }
    }

    /// The same, with the lane's datagrams, each lost with probability `loss` too.
    fn with_datagrams(mut self, loss: Option<f64>) -> Bursty {
        self.datagrams = loss;
        self
    }

    fn apply(&self, p: &mut Pair) {
        let c = p.copies.as_mut().expect("copies");
        for (i, w) in [&mut c.w2e, &mut c.e2w].into_iter().enumerate() {
            w.spacing = self.spacing;
            w.bursts = self.windows.clone();
            w.datagrams = self
                .datagrams
                .map(|l| DatagramPath::new(LATENCY, l, self.spacing, 0xd06 + i as u64));
        }
    }
}

struct Plan {
    id: StreamId,
    up: usize,
    down: usize,
    seed: u64,
}

fn run(
    codec: bool,
    loss: &[f64],
    sizes: &[(usize, usize)],
    cuts: &[(u64, usize, u64)],
    seed: u64,
    bursts: (u64, &[(u64, u64)]),
    datagrams: Option<f64>,
) -> Result<Pair, TestCaseError> {
    let mut p = pair(codec, loss, seed);
    let bursty = Bursty::new(p.now, bursts.0, bursts.1).with_datagrams(datagrams);
    bursty.apply(&mut p);
    let mut plans = Vec::new();
    for (i, (up, down)) in sizes.iter().enumerate() {
        let id = p.west.link.open("e-lat", Class::Latency).expect("open");
        let s = i as u64 * 7 + 1;
        p.west.app.to_send.insert(id, (data(s, *up), true));
        p.west.app.received.entry(id).or_default();
        plans.push(Plan {
            id,
            up: *up,
            down: *down,
            seed: s,
        });
    }
    let mut answered = false;
    let answer = |p: &mut Pair, plans: &[Plan]| {
        for s in plans {
            p.east
                .app
                .to_send
                .insert(s.id, (data(s.seed + 1000, s.down), true));
        }
    };
    let mut lost = 0;
    for (at, slot, down) in cuts {
        p.drive(Duration::from_millis(*at));
        if !answered && p.east.app.opened.len() == plans.len() {
            answer(&mut p, &plans);
            answered = true;
        }
        let slot = slot % loss.len();
        let attached = p
            .copies
            .as_ref()
            .expect("copies")
            .w2e
            .merge
            .is_attached(slot);
        if !attached || p.copies.as_ref().expect("copies").w2e.fanout.copies() < 2 {
            // The last copy's loss is the lane's (see the resume tests).
            continue;
        }
        if cut_copy(&mut p, slot, loss, seed, &bursty)? {
            lost += 1;
            continue;
        }
        p.drive(Duration::from_millis(*down));
        // The copy comes back on a new connection, from where each side is now.
        let c = p.copies.as_mut().expect("copies");
        if !c.w2e.merge.is_attached(slot) {
            let pipe = |s| CopyPipe::new(p.now, LATENCY, RATE, loss[slot], s);
            c.w2e.attach(slot, pipe(seed ^ 1));
            c.e2w.attach(slot, pipe(seed ^ 2));
        }
    }
    p.drive(Duration::from_secs(5));
    if !answered {
        prop_assert_eq!(p.east.app.opened.len(), plans.len());
        answer(&mut p, &plans);
    }
    p.drive(Duration::from_secs(60));
    for s in &plans {
        let up = p.east.app.received.get(&s.id).cloned().unwrap_or_default();
        let down = p.west.app.received.get(&s.id).cloned().unwrap_or_default();
        prop_assert!(up == data(s.seed, s.up)[..], "stream {} up differs", s.id);
        prop_assert!(
            down == data(s.seed + 1000, s.down)[..],
            "stream {} down differs",
            s.id
        );
        prop_assert!(p.east.app.fin.contains(&s.id) && p.west.app.fin.contains(&s.id));
    }
    prop_assert!(p.west.app.resets.is_empty(), "{:?}", p.west.app.resets);
    prop_assert!(p.east.app.resets.is_empty(), "{:?}", p.east.app.resets);
    check_wires(p.copies.as_ref().expect("copies"), true)?;
    prop_assert_eq!(p.west.app.resumed.len(), lost);
    p.assert_no_leaks();
    Ok(p)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn latency_streams_are_exact_through_lossy_copies(
        sizes in proptest::collection::vec((0usize..200_000, 0usize..60_000), 1..6),
        loss in proptest::collection::vec(0.0f64..0.3, 2..=3),
        cuts in proptest::collection::vec((0u64..1500, 0usize..3, 0u64..400), 0..4),
        codec in any::<bool>(),
        seed in any::<u64>(),
    ) {
        run(codec, &loss, &sizes, &cuts, seed, (0, &[]), None)?;
    }

    /// The same through bursts of loss that every copy's path shares, with the copies spaced
    /// in time or back to back, and datagrams beside them or not: their pieces arrive ahead of
    /// the copies, behind them, or not at all, and each byte is still delivered once.
    #[test]
    fn latency_streams_are_exact_through_bursts_and_spaced_copies(
        sizes in proptest::collection::vec((0usize..200_000, 0usize..60_000), 1..5),
        loss in proptest::collection::vec(0.0f64..0.1, 2..=3),
        cuts in proptest::collection::vec((0u64..1500, 0usize..3, 0u64..400), 0..3),
        bursts in proptest::collection::vec((0u64..3000, 1u64..20), 0..40),
        spacing in 0u64..10,
        datagrams in proptest::option::of(0.0f64..0.5),
        codec in any::<bool>(),
        seed in any::<u64>(),
    ) {
        run(codec, &loss, &sizes, &cuts, seed, (spacing, &bursts), datagrams)?;
    }
}

#[test]
fn every_copy_losing_batches_still_delivers_each_byte_once() {
    run(
        true,
        &[0.5, 0.5, 0.5],
        &[(300_000, 100_000), (8192, 8192), (0, 50_000)],
        &[(200, 0, 100), (400, 1, 0), (900, 2, 300)],
        7,
        (0, &[]),
        None,
    )
    .expect("exact");
}

/// Bursts that take every copy of the writes they meet (copies back to back) while the
/// datagrams' later sends get through: the datagrams deliver bytes first, and every stream
/// is still exact both ways, each byte once, through a copy cut and attached again.
#[test]
fn datagrams_deliver_what_bursts_take_from_every_copy() {
    let bursts: Vec<(u64, u64)> = (0..60).map(|i| (1000 + i * 40, 2)).collect();
    let p = run(
        true,
        &[0.0, 0.0],
        &[(150_000, 40_000), (8192, 8192), (30_000, 0)],
        &[(1500, 1, 100)],
        11,
        (0, &bursts),
        Some(0.0),
    )
    .expect("exact");
    let c = p.copies.as_ref().expect("copies");
    for (name, w) in [("west to east", &c.w2e), ("east to west", &c.e2w)] {
        assert!(
            w.merge.won_by_pieces() > 0,
            "{name}: no byte came first by datagram"
        );
        assert_eq!(w.merged.len(), w.produced.len(), "{name}");
    }
}

/// Virtual time for `len` bytes written on a new latency stream to reach east.
fn one_way(p: &mut Pair, len: usize) -> Duration {
    let start = p.now;
    let id = p.west.link.open("e-lat", Class::Latency).expect("open");
    p.west.app.to_send.insert(id, (data(3, len), false));
    while p.east.app.received.get(&id).map_or(0, Vec::len) < len {
        assert!(p.now - start < Duration::from_secs(5), "never arrived");
        p.drive(Duration::from_millis(1));
        p.now += Duration::from_millis(1);
    }
    let took = p.now - start;
    p.west.link.reset(id, ResetCode::Shutdown, "done");
    p.drive(Duration::from_millis(200));
    took
}

#[test]
fn a_message_one_copy_delays_arrives_on_time_on_the_other() {
    // Copy 0 loses every batch (each arrives four one-way latencies late).
    let mut single = pair(false, &[1.0], 1);
    let mut twin = pair(false, &[1.0, 0.0], 1);
    let slow = one_way(&mut single, 8192);
    let fast = one_way(&mut twin, 8192);
    assert!(slow >= LATENCY * 5, "{slow:?}");
    assert!(fast <= LATENCY + Duration::from_millis(6), "{fast:?}");
    let w = &twin.copies.as_ref().expect("copies").w2e;
    assert!(w.merge.won()[1] > 0 && w.merge.discarded() > 0);
    assert!(w.fanout.duplicated() > 0);
}

#[test]
fn losing_the_only_copy_that_holds_a_gap_resumes_the_lane() {
    // Copy 1 comes back mid-transfer, starting where its sender is; copy 0, which alone carries
    // what was in flight before that, is lost at once: the lane is lost, and it resumes.
    let p = run(
        true,
        &[0.0, 0.0],
        &[(400_000, 50_000)],
        &[(100, 1, 0), (0, 0, 0)],
        3,
        (0, &[]),
        None,
    )
    .expect("exact");
    assert_eq!(p.west.app.resumed.len(), 1);
}

#[test]
fn the_hellos_agree_on_how_many_connections_carry_the_lane() {
    for (w, e, want) in [
        (1, 1, 1),
        (2, 1, 1),
        (1, 3, 1),
        (2, 3, 2),
        (3, 3, 3),
        (3, 2, 2),
    ] {
        let mut p = Pair::with(
            LATENCY,
            RATE,
            |c| c.lane_copies = w,
            |c| {
                c.lane_copies = e;
                c.token = TOKEN;
            },
        );
        p.drive(Duration::from_secs(1));
        assert_eq!(p.west.link.lane_copies(), want, "west {w}, east {e}");
        assert_eq!(p.east.link.lane_copies(), want, "west {w}, east {e}");
        assert_eq!(p.west.link.lane_token(), Some(TOKEN));
        assert!(p.east.link.lane_token_valid(TOKEN) && !p.east.link.lane_token_valid(TOKEN ^ 1));
    }
}

/// A burst of loss that every copy's path shares (3 ms from the first byte) takes both copies of
/// a message sent back to back: it arrives only after the loss is repaired. Spaced 5 ms apart,
/// the second copy leaves after the burst and brings the message a round of spacing late.
#[test]
fn a_burst_takes_back_to_back_copies_but_not_spaced_ones() {
    let mut took = Vec::new();
    for spacing in [0, 5] {
        let mut p = pair(false, &[0.0, 0.0], 1);
        Bursty::new(p.now, spacing, &[(0, 3)]).apply(&mut p);
        took.push(one_way(&mut p, 8192));
        check_wires(p.copies.as_ref().expect("copies"), false).expect("exact");
    }
    assert!(took[0] >= LATENCY * 5, "back to back: {:?}", took[0]);
    assert!(
        took[1] <= LATENCY + Duration::from_millis(5 + 4),
        "spaced: {:?}",
        took[1]
    );
}
