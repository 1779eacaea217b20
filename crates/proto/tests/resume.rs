//! Streams through lost connections (see `common`): the connection is cut at random points,
//! with whatever was in flight lost on every lane, and resumed on a new one; every stream must
//! end byte-exact both ways, each byte once, with nothing leaked. Also what is not resumed: a
//! peer that restarted, a window that ran out, a peer without the capability.

mod common;

use common::*;
use wanopt_proto::HandoverError;

const TOKEN: u64 = 0x5eed_cafe;

/// A pair that resumes streams, up, with its latency lane attached when `laned`.
fn resumable_pair(codec: bool, laned: bool) -> Pair {
    resumable_pair_replaying(codec, laned, true)
}

/// [`resumable_pair`], west an older build that resumes through the lists alone unless
/// `replay`.
fn resumable_pair_replaying(codec: bool, laned: bool, replay: bool) -> Pair {
    let mut p = resumable_pair_with(codec, |c| c.replay = replay, |_| {});
    if laned {
        attach(&mut p);
    }
    p
}

/// [`resumable_pair`] without a lane, each side's config then changed by `west` and `east`.
fn resumable_pair_with(
    codec: bool,
    west: impl Fn(&mut LinkConfig),
    east: impl Fn(&mut LinkConfig),
) -> Pair {
    let mut p = Pair::with(
        Duration::from_millis(20),
        5_000_000,
        |c| {
            resumable(c, codec);
            c.token = 0;
            west(c);
        },
        |c| {
            resumable(c, codec);
            c.token = TOKEN;
            east(c);
        },
    );
    p.drive(Duration::from_secs(1));
    assert!(p.west.app.up && p.east.app.up, "hello exchange failed");
    p
}

fn attach(p: &mut Pair) {
    let token = p.west.link.lane_offer().expect("east offers a lane");
    assert!(p.east.link.attach_lane(token) && p.west.link.attach_lane(token));
}

/// Loses the connection: what is in flight on every lane is gone, and both sides learn it.
fn cut(p: &mut Pair) {
    for pipe in p.w2e.iter_mut().chain(p.e2w.iter_mut()) {
        pipe.in_flight.clear();
        pipe.busy_until = p.now;
    }
    for side in [&mut p.west, &mut p.east] {
        for b in &mut side.inbufs {
            b.clear();
        }
    }
    assert!(p.west.link.suspend("cut", p.now));
    assert!(p.east.link.suspend("cut", p.now));
}

/// A new connection: the listener (found by the old token) hands out `token`.
fn reconnect(p: &mut Pair, token: u64, laned: bool) {
    let presented = p.west.link.resume_token();
    assert!(p.east.link.resumes(presented));
    assert!(p.west.link.reconnect(p.now, Vec::new()));
    assert!(
        p.east
            .link
            .accept_resume(p.now, presented, token, Vec::new())
    );
    p.drive(Duration::from_millis(200));
    if laned {
        attach(p);
    }
}

/// Text-like bytes that compress and repeat (so the codec's dedup and contexts are in play).
fn data(seed: u64, len: usize) -> Bytes {
    let words = [
        "redo ",
        "block ",
        "commit ",
        "scn=",
        "archivelog ",
        "thread 1 ",
        "sequence ",
        "\n",
    ];
    let mut v = Vec::with_capacity(len + 16);
    let noise = wanopt_codec::testdata::noise(seed, len / 8 + 8);
    let mut i = 0;
    while v.len() < len {
        let n = noise[i % noise.len()];
        v.extend_from_slice(words[usize::from(n) % words.len()].as_bytes());
        if n.is_multiple_of(5) {
            v.extend_from_slice(&noise[i % noise.len()..(i % noise.len() + 4).min(noise.len())]);
        }
        i += 1;
    }
    v.truncate(len);
    // The second half repeats the first: references, once the first half is in the caches.
    let half = len / 2;
    v.copy_within(..half, len - half);
    v.into()
}

struct Plan {
    id: StreamId,
    up: usize,
    down: usize,
    seed: u64,
}

fn check_exact(p: &Pair, plans: &[Plan]) -> Result<(), TestCaseError> {
    for s in plans {
        let got_up = p.east.app.received.get(&s.id).cloned().unwrap_or_default();
        let got_down = p.west.app.received.get(&s.id).cloned().unwrap_or_default();
        prop_assert_eq!(got_up.len(), s.up, "stream {} up", s.id);
        prop_assert!(
            got_up == data(s.seed, s.up)[..],
            "stream {} up differs",
            s.id
        );
        prop_assert_eq!(got_down.len(), s.down, "stream {} down", s.id);
        prop_assert!(
            got_down == data(s.seed + 1000, s.down)[..],
            "stream {} down differs",
            s.id
        );
        prop_assert!(p.east.app.fin.contains(&s.id) && p.west.app.fin.contains(&s.id));
    }
    prop_assert!(p.west.app.resets.is_empty(), "{:?}", p.west.app.resets);
    prop_assert!(p.east.app.resets.is_empty(), "{:?}", p.east.app.resets);
    Ok(())
}

/// Streams both ways, the connection cut at each of `cuts` (virtual ms after the start, each
/// down for its own time), then every byte checked.
fn run(
    codec: bool,
    laned: bool,
    sizes: &[(usize, usize, bool)],
    cuts: &[(u64, u64)],
) -> Result<Pair, TestCaseError> {
    let kinds: Vec<Cut> = cuts.iter().map(|_| Cut::Link).collect();
    run_cuts(codec, laned, sizes, cuts, &kinds, false, true)
}

/// What a cut loses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cut {
    /// Every lane.
    Link,
    /// The latency lane alone, both sides told.
    Lane,
    /// The latency lane alone; only west is told (east learns when west attaches a new one).
    LaneWestOnly,
    /// West hands its link over to a new process (`Link::hand_over`, `Link::take_over`); east
    /// sees its connection lost.
    HandWest,
    /// The same the other way round.
    HandEast,
}

impl Cut {
    /// Whether every lane is lost (and the link resumed whole).
    fn whole(self) -> bool {
        matches!(self, Cut::Link | Cut::HandWest | Cut::HandEast)
    }
}

/// Hands one side's link to a "new process": the link it writes is read back under a fresh
/// config and replaces it; the other side sees the connection lost.
fn hand_over(p: &mut Pair, west: bool, codec: bool) {
    for pipe in p.w2e.iter_mut().chain(p.e2w.iter_mut()) {
        pipe.in_flight.clear();
        pipe.busy_until = p.now;
    }
    for side in [&mut p.west, &mut p.east] {
        for b in &mut side.inbufs {
            b.clear();
        }
    }
    let (side, other, (site, peer), services) = if west {
        (&mut p.west, &mut p.east, ("west", "east"), &["w-svc"][..])
    } else {
        (
            &mut p.east,
            &mut p.west,
            ("east", "west"),
            &["e-svc", "e-lat"][..],
        )
    };
    let state = side.link.hand_over(p.now).expect("handed over");
    let mut cfg = LinkConfig::new(site, peer, west);
    resumable(&mut cfg, codec);
    cfg.replay = side.link.replays_offered();
    let mut link = Link::take_over(cfg, &state, p.now).expect("taken over");
    link.set_services(services.iter().copied());
    side.link = link;
    assert!(other.link.suspend("cut", p.now));
}

/// Loses the latency lane alone: what is in flight on it is gone.
fn cut_lane(p: &mut Pair, east_told: bool) {
    use wanopt_proto::LATENCY_LANE;
    p.w2e[LATENCY_LANE].in_flight.clear();
    p.e2w[LATENCY_LANE].in_flight.clear();
    p.west.inbufs[LATENCY_LANE].clear();
    p.east.inbufs[LATENCY_LANE].clear();
    assert!(p.west.link.lane_lost(p.now));
    if east_told {
        assert!(p.east.link.lane_lost(p.now));
    }
}

fn run_cuts(
    codec: bool,
    laned: bool,
    sizes: &[(usize, usize, bool)],
    cuts: &[(u64, u64)],
    kinds: &[Cut],
    wrap: bool,
    replay: bool,
) -> Result<Pair, TestCaseError> {
    let mut p = resumable_pair_replaying(codec, laned, replay);
    let mut plans = Vec::new();
    for (i, (up, down, lat)) in sizes.iter().enumerate() {
        if wrap && i == 1 {
            // West's next ids are the last two below 2^32, then they wrap past the first
            // stream's (still in use): as after 2^31 opens on a link resumed for weeks.
            let first = plans.first().map_or(1, |p: &Plan| u64::from(p.id.0));
            p.west
                .link
                .skip_stream_ids(((1u64 << 32) - 3 - (first + 2)) / 2);
        }
        let class = if *lat { Class::Latency } else { Class::Bulk };
        let service = if *lat { "e-lat" } else { "e-svc" };
        let id = p.west.link.open(service, class).expect("open");
        let seed = i as u64 * 7 + 1;
        p.west.app.to_send.insert(id, (data(seed, *up), true));
        p.west.app.received.entry(id).or_default();
        plans.push(Plan {
            id,
            up: *up,
            down: *down,
            seed,
        });
    }
    let mut answered = false;
    let answer = |p: &mut Pair, plans: &[Plan]| {
        for s in plans {
            if p.east.app.opened.iter().any(|(id, _)| *id == s.id) {
                p.east
                    .app
                    .to_send
                    .insert(s.id, (data(s.seed + 1000, s.down), true));
            }
        }
    };
    let mut token = TOKEN;
    for ((at, down), kind) in cuts.iter().zip(kinds) {
        p.drive(Duration::from_millis(*at));
        if !answered && p.east.app.opened.len() == plans.len() {
            answer(&mut p, &plans);
            answered = true;
        }
        if !kind.whole() {
            cut_lane(&mut p, *kind == Cut::Lane);
            // The main lane goes on meanwhile; what a side not told writes on the lost lane
            // goes nowhere (10 ms steps, under the pipes' 20 ms).
            let end = p.now + Duration::from_millis(*down);
            loop {
                prop_assert!(p.w2e[1].in_flight.is_empty(), "a lost lane carried bytes");
                p.e2w[1].in_flight.clear();
                if p.now >= end {
                    break;
                }
                let step = end.min(p.now + Duration::from_millis(10));
                p.drive(step - p.now);
                p.now = p.now.max(step);
            }
            p.e2w[1].in_flight.clear();
            attach(&mut p);
            continue;
        }
        match kind {
            Cut::HandWest => hand_over(&mut p, true, codec),
            Cut::HandEast => hand_over(&mut p, false, codec),
            _ => cut(&mut p),
        }
        // Time passes while the link is down; the applications go on reading and writing (what
        // the links would send goes nowhere).
        let end = p.now + Duration::from_millis(*down);
        while p.now < end {
            p.now = end.min(p.now + Duration::from_millis(50));
            step_side(&mut p.west, &mut p.w2e, p.now);
            step_side(&mut p.east, &mut p.e2w, p.now);
            for pipe in p.w2e.iter_mut().chain(p.e2w.iter_mut()) {
                prop_assert!(pipe.in_flight.is_empty(), "a suspended link sent bytes");
            }
        }
        token += 1;
        reconnect(&mut p, token, laned);
    }
    p.drive(Duration::from_secs(5));
    if !answered {
        prop_assert_eq!(p.east.app.opened.len(), plans.len());
        answer(&mut p, &plans);
    }
    p.drive(Duration::from_secs(60));
    check_exact(&p, &plans)?;
    let whole = kinds.iter().filter(|k| k.whole()).count();
    prop_assert_eq!(p.west.app.suspended as usize, whole);
    // A lane resumption that a whole cut overtook is settled by the whole resumption; a whole
    // one that replays has the lane's settle on its own.
    for side in [&p.west, &p.east] {
        let n = side.app.resumed.iter().filter(|r| !r.lane).count();
        let lanes = side.app.resumed.len() - n;
        prop_assert!(
            n == whole && lanes <= cuts.len(),
            "{n} resumptions and {lanes} of the lane for {kinds:?}"
        );
    }
    // Both sides take the same way each time: a replay (the codecs go on) unless a side was
    // handed over to a new process, whose codec started over.
    let ways = |side: &Side| -> Vec<bool> {
        side.app
            .resumed
            .iter()
            .filter(|r| !r.lane)
            .map(|r| r.replay)
            .collect()
    };
    prop_assert_eq!(ways(&p.west), ways(&p.east));
    for (k, replayed) in kinds.iter().filter(|k| k.whole()).zip(ways(&p.west)) {
        let hand = matches!(k, Cut::HandWest | Cut::HandEast);
        prop_assert_eq!(replayed, replay && !hand, "{:?}", kinds);
    }
    p.assert_no_leaks();
    Ok(p)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn streams_survive_lost_connections(
        sizes in proptest::collection::vec((0usize..400_000, 0usize..100_000, any::<bool>()), 1..8),
        cuts in proptest::collection::vec((0u64..300, 0u64..3000), 1..4),
        codec in any::<bool>(),
        laned in any::<bool>(),
        wrap in any::<bool>(),
        replay in any::<bool>(),
    ) {
        run_cuts(codec, laned, &sizes, &cuts, &vec![Cut::Link; cuts.len()], wrap, replay)?;
    }

    #[test]
    fn streams_survive_lost_latency_lanes(
        sizes in proptest::collection::vec((0usize..300_000, 0usize..100_000, any::<bool>()), 1..8),
        cuts in proptest::collection::vec((0u64..300, 0u64..2000, 0u8..3), 1..4),
        codec in any::<bool>(),
        replay in any::<bool>(),
    ) {
        let kinds: Vec<Cut> = cuts
            .iter()
            .map(|c| [Cut::Link, Cut::Lane, Cut::LaneWestOnly][usize::from(c.2)])
            .collect();
        let cuts: Vec<(u64, u64)> = cuts.iter().map(|c| (c.0, c.1)).collect();
        run_cuts(codec, true, &sizes, &cuts, &kinds, false, replay)?;
    }

    /// Either side handed over to a new process (a restart or an upgrade) at any point, in
    /// turn or twice, among lost connections: every stream ends byte-exact both ways, each
    /// byte once, nothing leaked.
    #[test]
    fn streams_survive_handovers_to_new_processes(
        sizes in proptest::collection::vec((0usize..400_000, 0usize..100_000, any::<bool>()), 1..8),
        cuts in proptest::collection::vec((0u64..300, 0u64..2000, 0u8..3), 1..4),
        codec in any::<bool>(),
        laned in any::<bool>(),
        wrap in any::<bool>(),
        replay in any::<bool>(),
    ) {
        let kinds: Vec<Cut> = cuts
            .iter()
            .map(|c| [Cut::HandWest, Cut::HandEast, Cut::Link][usize::from(c.2)])
            .collect();
        let cuts: Vec<(u64, u64)> = cuts.iter().map(|c| (c.0, c.1)).collect();
        run_cuts(codec, laned, &sizes, &cuts, &kinds, wrap, replay)?;
    }
}

/// A handover written by this build is refused whole where it is not this link's, not this
/// format, or damaged anywhere: the new process then starts as after a restart (the streams
/// end), never with a link that would send wrong bytes.
#[test]
fn a_handover_is_refused_whole_when_it_is_not_this_links_or_is_damaged() {
    let mut p = resumable_pair(true, false);
    let id = p.west.link.open("e-svc", Class::Bulk).expect("open");
    p.west.app.to_send.insert(id, (data(1, 300_000), false));
    p.drive(Duration::from_millis(60));
    let state = p.west.link.hand_over(p.now).expect("handed over");
    let cfg = |site: &str, peer: &str, initiator: bool| {
        let mut c = LinkConfig::new(site, peer, initiator);
        resumable(&mut c, true);
        c
    };
    assert!(Link::take_over(cfg("west", "east", true), &state, p.now).is_ok());
    for (c, what) in [
        (cfg("west", "south", true), "another peer"),
        (cfg("north", "east", true), "another site"),
        (cfg("west", "east", false), "the other side"),
    ] {
        assert!(
            matches!(
                Link::take_over(c, &state, p.now),
                Err(HandoverError::OtherLink { .. })
            ),
            "{what}"
        );
    }
    let mut newer = state.clone();
    newer[5] += 1;
    assert!(matches!(
        Link::take_over(cfg("west", "east", true), &newer, p.now),
        Err(HandoverError::Version(_))
    ));
    // Cut anywhere, or a byte changed in the counts and offsets: refused, never a panic or a
    // huge allocation (the kept bytes themselves are the peer's to check).
    for n in 0..state.len().min(400) {
        assert!(Link::take_over(cfg("west", "east", true), &state[..n], p.now).is_err());
    }
    let mut refused = 0;
    for at in 0..state.len().min(400) {
        for bit in [0x01u8, 0x80] {
            let mut bad = state.clone();
            bad[at] ^= bit;
            refused +=
                usize::from(Link::take_over(cfg("west", "east", true), &bad, p.now).is_err());
        }
    }
    assert!(refused > 200, "{refused} of the damaged states refused");
    // A link that cannot resume cannot be handed over.
    let mut plain = Pair::new(Duration::from_millis(20), 5_000_000);
    plain.drive(Duration::from_secs(1));
    assert_eq!(
        plain.west.link.hand_over(plain.now).err(),
        Some(HandoverError::NotResumable)
    );
}

/// Ids of a link resumed for weeks wrap after 2^31 opens: opens go on past the wrap, skipping
/// the ids still in use, through cuts that lose opens in flight on either side of it.
#[test]
fn stream_ids_wrap_on_a_resumed_link() {
    let sizes = [
        (50_000, 5_000, false),
        (30_000, 3_000, false),
        (3_000, 3_000, true),
        (40_000, 1_000, false),
        (20_000, 2_000, true),
        (10_000, 0, false),
    ];
    for (laned, replay) in [(false, true), (true, true), (false, false), (true, false)] {
        for cuts in [&[][..], &[(1, 100)], &[(30, 200), (10, 50)]] {
            let p = run_cuts(
                true,
                laned,
                &sizes,
                cuts,
                &vec![Cut::Link; cuts.len()],
                true,
                replay,
            )
            .unwrap_or_else(|e| panic!("laned {laned}, replay {replay}, cuts {cuts:?}: {e}"));
            let ids: Vec<u32> = p.west.app.received.keys().map(|id| id.0).collect();
            assert!(ids.contains(&u32::MAX), "{ids:?}");
            assert!(ids.contains(&3), "wrapped past stream 1: {ids:?}");
        }
    }
}

#[test]
fn a_cut_before_the_first_open_arrives_opens_it_again() {
    // The open and the first bytes are lost in flight: the peer's list does not name the
    // stream, so it is opened again and sent from its first byte.
    // West an older build: the resumption goes through the lists.
    let sizes = [(100_000, 5_000, false), (3_000, 3_000, true)];
    let p = run_cuts(true, true, &sizes, &[(1, 100)], &[Cut::Link], false, false).expect("exact");
    let r = p.west.app.resumed[0];
    assert_eq!((r.streams, r.lost, r.replay), (2, 0, false), "{r:?}");
    assert!(r.resent > 0, "{r:?}");
    // Down for 100 ms, then the new hellos and lists take a round trip of 20 ms each way.
    assert!(r.outage >= Duration::from_millis(140), "{r:?}");
    // Replayed, the open goes again as it went, with the bytes after it.
    let p = run(true, true, &sizes, &[(1, 100)]).expect("exact");
    let r = p.west.app.resumed[0];
    assert_eq!(
        (r.streams, r.lost, r.resent, r.replay),
        (1, 0, 0, true),
        "{r:?}"
    );
    assert!(r.replayed > 0, "{r:?}");
}

#[test]
fn a_cut_mid_transfer_resends_at_most_what_was_in_flight() {
    // 5 MB/s and 20 ms each way: at most the windows' worth is in flight.
    let window = LinkConfig::new("x", "y", false).stream_window as u64;
    for codec in [false, true] {
        let sizes = [(4_000_000, 1_000_000, false)];
        // West an older build: the resumption goes through the lists.
        let lists = run_cuts(
            codec,
            false,
            &sizes,
            &[(80, 500)],
            &[Cut::Link],
            false,
            false,
        );
        let p = lists.expect("exact");
        let r = p.west.app.resumed[0];
        assert_eq!(r.streams, 1);
        assert!(r.resent > 0, "{r:?}");
        assert!(r.resent <= window, "{r:?}");
        // Replayed, what went again is what the peer had not read: at most a window and the
        // frames' own bytes.
        let p = run(codec, false, &sizes, &[(80, 500)]).expect("exact");
        let r = p.west.app.resumed[0];
        assert_eq!((r.streams, r.resent, r.replay), (1, 0, true), "{r:?}");
        assert!(r.replayed > 0, "{r:?}");
        assert!(r.replayed <= window + window / 16, "{r:?}");
    }
}

#[test]
fn a_cut_just_after_the_last_byte_is_confirmed_loses_nothing() {
    for at in [30, 45, 60, 90, 120] {
        run(false, false, &[(20_000, 0, false)], &[(at, 10)]).expect("exact");
    }
}

#[test]
fn a_restarted_peer_loses_the_streams_with_a_clear_reset() {
    let mut p = resumable_pair(false, false);
    let id = p.west.link.open("e-svc", Class::Bulk).expect("open");
    p.west.app.to_send.insert(id, (data(1, 200_000), false));
    p.drive(Duration::from_millis(30));
    cut(&mut p);
    // East restarted: a new link, not the suspended one, answers west's hello.
    let mut ce = LinkConfig::new("east", "west", false);
    resumable(&mut ce, false);
    ce.token = 99;
    p.east = Side::new(Link::new(ce));
    p.east.link.set_services(["e-svc"]);
    assert!(p.west.link.reconnect(p.now, Vec::new()));
    p.drive(Duration::from_secs(1));
    assert!(p.west.link.is_open(), "the link itself goes on");
    assert_eq!(p.west.app.resets, vec![(id, ResetCode::LinkLost)]);
    assert!(!p.west.link.contains(id));
    // New streams work on it.
    let id2 = open_and_send(&mut p, "e-svc", Class::Bulk, pattern(5, 10_000));
    p.drive(Duration::from_secs(2));
    assert_eq!(p.east.app.received.get(&id2).map(Vec::len), Some(10_000));
}

#[test]
fn past_the_resume_window_the_link_closes_and_every_stream_resets() {
    let mut p = resumable_pair(true, false);
    let id = p.west.link.open("e-svc", Class::Bulk).expect("open");
    p.west.app.to_send.insert(id, (data(1, 200_000), false));
    p.drive(Duration::from_millis(30));
    cut(&mut p);
    p.drive(Duration::from_secs(31));
    assert!(p.west.link.is_closed() && p.east.link.is_closed());
    assert!(p.west.app.resets.contains(&(id, ResetCode::Shutdown)));
    assert!(
        matches!(&p.west.app.closed, Some(Some(LinkError::Transport(r))) if r.contains("resume window")),
        "{:?}",
        p.west.app.closed
    );
    assert!(!p.west.link.reconnect(p.now, Vec::new()));
    p.assert_no_leaks();
}

#[test]
fn a_peer_without_resumption_gets_todays_behaviour() {
    let mut p = Pair::with(
        Duration::from_millis(20),
        20_000_000,
        |c| resumable(c, false),
        |_| {},
    );
    p.drive(Duration::from_secs(1));
    let id = open_and_send(&mut p, "e-svc", Class::Bulk, pattern(1, 50_000));
    p.drive(Duration::from_millis(25));
    assert!(!p.west.link.can_resume());
    assert!(!p.west.link.suspend("cut", p.now));
    assert!(p.west.link.is_closed());
    p.drive(Duration::from_millis(1));
    assert!(p.west.app.resets.contains(&(id, ResetCode::Shutdown)));
}

#[test]
fn a_restarted_connecting_side_resumes_nothing() {
    let mut p = resumable_pair(false, false);
    let id = p.west.link.open("e-svc", Class::Bulk).expect("open");
    p.west.app.to_send.insert(id, (data(1, 100_000), false));
    p.drive(Duration::from_millis(30));
    cut(&mut p);
    // West restarted: its new link presents no token, so east (had its runtime handed it the
    // connection) gives the old streams up rather than take a list that is not theirs.
    assert!(
        p.east
            .link
            .accept_resume(p.now, TOKEN, TOKEN + 1, Vec::new())
    );
    let mut forged = LinkConfig::new("west", "east", true);
    resumable(&mut forged, false);
    let mut w = Link::new(forged);
    w.set_services(["w-svc"]);
    p.west = Side::new(w);
    p.drive(Duration::from_secs(1));
    assert!(p.east.app.resets.contains(&(id, ResetCode::LinkLost)));
    assert!(!p.east.link.contains(id));
}

#[test]
fn kept_bytes_stay_within_the_windows_and_go_once_confirmed() {
    let mut p = resumable_pair(false, false);
    let id = p.west.link.open("e-svc", Class::Bulk).expect("open");
    p.west.app.to_send.insert(id, (data(3, 8 << 20), true));
    p.west.app.received.entry(id).or_default();
    let window = LinkConfig::new("x", "y", false).stream_window as usize;
    let buffer = LinkConfig::new("x", "y", true).send_buffer;
    let mut most = 0;
    for _ in 0..400 {
        p.drive(Duration::from_millis(10));
        most = most.max(p.west.link.kept_bytes());
    }
    assert!(most > 0, "nothing was kept");
    assert!(most <= window + buffer, "{most} > {window} + {buffer}");
    p.east.app.to_send.insert(id, (Bytes::new(), true));
    p.drive(Duration::from_secs(30));
    assert_eq!(p.east.app.received[&id].len(), 8 << 20);
    assert_eq!(p.west.link.kept_bytes(), 0);
    p.assert_no_leaks();
}

#[test]
fn a_silent_path_is_given_up_for_a_new_connection() {
    // The path drops everything, and no side is told: each gives its connection up once it
    // heard nothing for two seconds (pinging meanwhile), and a new one resumes the streams.
    let mut p = resumable_pair(true, true);
    let id = open_and_send(&mut p, "e-svc", Class::Bulk, data(4, 2_000_000));
    p.drive(Duration::from_millis(100));
    let start = p.now;
    while !(p.west.link.is_suspended() && p.east.link.is_suspended()) {
        assert!(p.now < start + Duration::from_secs(3), "nobody noticed");
        let step = p.now + Duration::from_millis(10);
        p.drive(Duration::from_millis(10));
        p.now = p.now.max(step);
        for pipe in p.w2e.iter_mut().chain(p.e2w.iter_mut()) {
            pipe.in_flight.clear();
        }
    }
    let silent = p.now - start;
    assert!(silent >= Duration::from_secs(2), "{silent:?}");
    reconnect(&mut p, TOKEN + 1, true);
    p.east.app.to_send.insert(id, (Bytes::new(), true));
    p.drive(Duration::from_secs(30));
    assert_eq!(p.east.app.received[&id], data(4, 2_000_000)[..]);
    assert!(p.west.app.fin.contains(&id) && p.east.app.fin.contains(&id));
    // The link's resumption, and the latency lane's of its own after it.
    assert_eq!(p.west.app.resumed.iter().filter(|r| !r.lane).count(), 1);
    p.assert_no_leaks();
}

/// Drives `p` for `limit` on a path that drops everything, in steps of 10 ms; returns when
/// west suspended (or `limit` passed), as the time since the start.
fn drop_everything_until_west_suspends(p: &mut Pair, limit: Duration) -> Duration {
    let start = p.now;
    while !p.west.link.is_suspended() && p.now < start + limit {
        let step = p.now + Duration::from_millis(10);
        p.drive(Duration::from_millis(10));
        p.now = p.now.max(step);
        for pipe in p.w2e.iter_mut().chain(p.e2w.iter_mut()) {
            pipe.in_flight.clear();
        }
    }
    p.now - start
}

#[test]
fn a_side_that_did_not_run_does_not_blame_the_peer() {
    // Neither side runs for 3 s (a host whose cores the applications took): each pings when it
    // runs again and stays up, rather than counting its own absence as the peer's silence.
    let mut p = resumable_pair(true, false);
    let id = open_and_send(&mut p, "e-svc", Class::Bulk, data(5, 500_000));
    p.drive(Duration::from_millis(200));
    p.now += Duration::from_secs(3);
    p.west.link.handle_timeout(p.now);
    p.east.link.handle_timeout(p.now);
    assert!(!p.west.link.is_suspended() && !p.east.link.is_suspended());
    p.east.app.to_send.insert(id, (Bytes::new(), true));
    p.drive(Duration::from_secs(10));
    assert_eq!(p.east.app.received[&id], data(5, 500_000)[..]);
    assert_eq!(p.west.app.suspended + p.east.app.suspended, 0);
    // Each side tells it once (the runtime logs and counts it).
    assert_eq!((p.west.app.stalled, p.east.app.stalled), (1, 1));
    // A path that then drops everything is still given up: 2 s after the peer was last heard,
    // or one ping interval less after a side's own absence.
    let mut p = resumable_pair(false, false);
    p.drive(Duration::from_millis(200));
    p.now += Duration::from_secs(3);
    let silent = drop_everything_until_west_suspends(&mut p, Duration::from_secs(3));
    assert!(p.west.link.is_suspended(), "nobody noticed");
    assert!(
        silent >= Duration::from_millis(1400) && silent <= Duration::from_millis(1600),
        "{silent:?}"
    );
}

#[test]
fn data_waiting_unread_counts_as_heard() {
    // The runtime's sockets say data came 1.5 s into a silence (a reader that had not run):
    // the silence clock starts over there.
    let mut p = resumable_pair(false, false);
    p.drive(Duration::from_millis(200));
    let start = p.now;
    let first = drop_everything_until_west_suspends(&mut p, Duration::from_millis(1500));
    assert!(!p.west.link.is_suspended());
    p.west.link.peer_heard(start + first);
    // Earlier data says nothing new.
    p.west.link.peer_heard(start);
    let more = drop_everything_until_west_suspends(&mut p, Duration::from_secs(3));
    assert!(p.west.link.is_suspended(), "nobody noticed");
    assert!(
        more >= Duration::from_millis(1990) && more <= Duration::from_millis(2100),
        "{more:?}"
    );
    assert_eq!(p.west.app.stalled, 0, "west ran all along");
}

#[test]
fn a_quiet_link_pings_and_stays_up() {
    let mut p = resumable_pair(false, false);
    p.drive(Duration::from_secs(20));
    assert!(p.west.link.is_open() && p.east.link.is_open());
    assert_eq!(p.west.app.suspended + p.east.app.suspended, 0);
}

#[test]
fn a_connection_lost_during_the_resumption_resumes_on_the_next() {
    // East answered west's resuming hello (and handed out a new token), but its answer was
    // lost with the connection: west presents the token it knows, which east still takes.
    let mut p = resumable_pair(true, false);
    let id = open_and_send(&mut p, "e-svc", Class::Bulk, data(6, 1_000_000));
    p.drive(Duration::from_millis(60));
    cut(&mut p);
    let presented = p.west.link.resume_token();
    assert!(p.west.link.reconnect(p.now, Vec::new()));
    p.drive(Duration::from_millis(15));
    assert!(
        p.east
            .link
            .accept_resume(p.now, presented, TOKEN + 1, Vec::new())
    );
    p.drive(Duration::from_millis(10));
    cut(&mut p);
    assert_eq!(
        p.west.link.resume_token(),
        presented,
        "west never saw the new token"
    );
    assert!(p.east.link.resumes(presented) && p.east.link.resumes(TOKEN + 1));
    assert!(!p.east.link.resumes(TOKEN + 2), "a token never handed out");
    reconnect(&mut p, TOKEN + 2, false);
    p.east.app.to_send.insert(id, (Bytes::new(), true));
    p.drive(Duration::from_secs(30));
    assert_eq!(p.east.app.received[&id], data(6, 1_000_000)[..]);
    assert!(p.west.app.resets.is_empty() && p.east.app.resets.is_empty());
    // Settled: only the newest token works now; the ones before are spent.
    cut(&mut p);
    assert!(!p.east.link.resumes(presented) && !p.east.link.resumes(TOKEN + 1));
    assert!(p.east.link.resumes(TOKEN + 2));
}

/// Cuts the connection and starts a new one by hand (west reconnects, east accepts it); returns
/// west's hello on it, which east has not read.
fn new_connection_hello(p: &mut Pair) -> Bytes {
    cut(p);
    let presented = p.west.link.resume_token();
    assert!(p.west.link.reconnect(p.now, Vec::new()));
    assert!(
        p.east
            .link
            .accept_resume(p.now, presented, TOKEN + 1, Vec::new())
    );
    let mut out = BytesMut::new();
    p.west.link.poll_transmit(p.now, &mut out, 1 << 20);
    let n = Frame::check(&out, 1 << 20).expect("a whole first frame");
    out.split_to(n).freeze()
}

/// A peer that claims `max_streams` of 2^32 cannot grow our copy of its resume list past what
/// it can know (the streams it may open, ours, and the recently closed): non-final lists beyond
/// that end the link, before our memory or the settling's resets grow with them.
#[test]
fn a_peer_cannot_grow_the_resume_list_past_what_it_can_know() {
    use wanopt_proto::frame::{Resume, ResumeEntry};
    let mut p = resumable_pair_with(
        false,
        |c| {
            c.max_streams = u32::MAX;
            c.replay = false;
        },
        |_| {},
    );
    // West's hello on the new connection, alone: what follows is the hostile list.
    let hello = new_connection_hello(&mut p);
    p.east.link.handle_input(&hello, p.now).expect("the hello");
    let max_streams = LinkConfig::new("east", "west", false).max_streams as usize;
    let bound = max_streams + 4096;
    let mut sent = 0usize;
    let mut next_id = 1u32;
    let refused = loop {
        let entries: Vec<ResumeEntry> = (0..1000)
            .map(|_| {
                next_id += 2;
                ResumeEntry {
                    stream: StreamId(next_id),
                    received: 0,
                    max: 0,
                    fin: false,
                    done: false,
                    latency: false,
                }
            })
            .collect();
        let mut buf = BytesMut::new();
        Frame::Resume(Box::new(Resume {
            link_received: 0,
            link_max: 0,
            seen: [0, 0],
            entries,
            last: false,
            lane: false,
        }))
        .encode(&mut buf);
        match p.east.link.handle_input(&buf, p.now) {
            Ok(()) => sent += 1000,
            Err(e) => break e,
        }
        assert!(sent <= bound, "{sent} entries taken, bound {bound}");
    };
    assert!(
        matches!(&refused, LinkError::Protocol(m) if m.contains("resume list too long")),
        "{refused:?}"
    );
    assert!(sent + 1000 > bound, "refused early: {sent} of {bound}");
}

/// A peer that grants a window far beyond ours (u32::MAX per stream) does not make us keep more
/// than our own window's worth of a stream for resends.
#[test]
fn a_huge_window_from_the_peer_keeps_no_more_than_ours() {
    let mut p = resumable_pair_with(
        false,
        |_| {},
        |c| {
            c.stream_window = u32::MAX;
            c.link_window = u64::MAX >> 2;
        },
    );
    // East receives and never hands over: only the windows bound what west keeps.
    let id = p.west.link.open("e-svc", Class::Bulk).expect("open");
    p.west.app.to_send.insert(id, (data(3, 24 << 20), false));
    p.east.app.paused = true;
    let window = LinkConfig::new("x", "y", true).stream_window as usize;
    let buffer = LinkConfig::new("x", "y", true).send_buffer;
    let mut most = 0;
    for _ in 0..300 {
        p.drive(Duration::from_millis(10));
        most = most.max(p.west.link.kept_bytes());
    }
    assert!(most > 0, "nothing was kept");
    assert!(most <= window + buffer, "{most} > {window} + {buffer}");
}

/// A link resumed by a replay keeps its caches and stream contexts: a copy cut in the middle
/// arrives exact (its frames in flight sent again as they were), and the same copy sent after
/// the cut is references. Through the resume lists (west an older build, no saved states) the
/// caches start over: what went before the cut goes whole again.
#[test]
fn a_replayed_resumption_keeps_the_caches() {
    let copy: Bytes = wanopt_codec::testdata::noise(9, 1_500_000).into();
    let mut wire = Vec::new();
    for replay in [true, false] {
        let mut p = resumable_pair_replaying(true, false, replay);
        let first = open_and_send(&mut p, "e-svc", Class::Bulk, copy.clone());
        // 5 MB/s: the cut comes with a part of the copy still to send and some in flight.
        p.drive(Duration::from_millis(150));
        assert!(p.east.app.received[&first].len() < copy.len());
        cut(&mut p);
        reconnect(&mut p, TOKEN + 1, false);
        p.drive(Duration::from_secs(5));
        assert_eq!(p.east.app.received[&first], copy[..], "replay {replay}");
        let r = p.west.app.resumed[0];
        assert_eq!(r.replay, replay, "{r:?}");
        assert_eq!(p.east.app.resumed[0].replay, replay);
        if replay {
            assert!(r.replayed > 0 && r.resent == 0, "{r:?}");
        }
        let before = p.west.link.link_wire().0;
        let second = open_and_send(&mut p, "e-svc", Class::Bulk, copy.clone());
        p.drive(Duration::from_secs(5));
        assert_eq!(p.east.app.received[&second], copy[..], "replay {replay}");
        wire.push(p.west.link.link_wire().0 - before);
        for id in [first, second] {
            p.east.app.to_send.insert(id, (Bytes::new(), true));
        }
        p.drive(Duration::from_secs(10));
        p.assert_no_leaks();
    }
    // References only, against the part of the copy sent before the cut (what came after it
    // is in the new caches too) sent whole again.
    assert!(wire[0] * 20 < wire[1], "{wire:?}");
    assert!(wire[1] > 400_000, "{wire:?}");
}

/// A peer that says it read more of our main lane than we sent (in a `Received` frame, or in
/// its hello when it resumes) fails the link with a protocol error: nothing is sent again from
/// an offset we never reached.
#[test]
fn a_peer_that_claims_to_have_read_more_than_we_sent_fails_the_link() {
    let mut p = resumable_pair(false, false);
    let mut buf = BytesMut::new();
    Frame::Received { offset: 1 << 40 }.encode(&mut buf);
    let e = p.east.link.handle_input(&buf, p.now).expect_err("refused");
    assert!(
        matches!(&e, LinkError::Protocol(m) if m.contains("more than we sent")),
        "{e:?}"
    );

    // In the hello of a resumed connection.
    let mut p = resumable_pair(false, false);
    let hello = new_connection_hello(&mut p);
    let Ok(Frame::Hello(mut h)) = Frame::parse(hello) else {
        panic!("west's first frame is its hello");
    };
    for (id, v) in &mut h.settings {
        if *id == wanopt_proto::frame::setting::REPLAY_RECEIVED {
            *v = 1 << 40;
        }
    }
    let mut buf = BytesMut::new();
    Frame::Hello(h).encode(&mut buf);
    let e = p.east.link.handle_input(&buf, p.now).expect_err("refused");
    assert!(
        matches!(&e, LinkError::Protocol(m) if m.contains("more than we sent")),
        "{e:?}"
    );
}
