//! The send path's tests: frames that rebuild exactly however the bytes are split, runs within
//! their frame's room, prepared turns writing the same frames, cut points that do not depend on
//! write sizes.

use super::*;
use crate::{self as codec, Decoder};
use bytes::BytesMut;
use proptest::prelude::*;

/// Noise with runs of one byte, so that chunks both compress and not (fingerprints of a
/// counter serve as the deterministic noise).
fn data(seed: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len + 64);
    for i in 0u64.. {
        if v.len() >= len {
            break;
        }
        let f = codec::cache::fingerprint(&[seed.to_le_bytes(), i.to_le_bytes()].concat());
        match f[0] % 4 {
            0 => v.extend_from_slice(&[f[1]; 37]),
            _ => v.extend_from_slice(&f),
        }
    }
    v.truncate(len);
    v
}

struct Stream {
    coder: super::Sender,
    queue: VecDeque<Bytes>,
    sent: u64,
    queued: u64,
    mirror: Mirror,
    cfg: CodecConfig,
    pressure: Pressure,
}

impl Stream {
    fn new() -> Stream {
        let cfg = CodecConfig::default();
        Stream {
            // As the link's coder starts: the peer has not said it decodes contexts or runs.
            coder: super::Sender::new(Policy {
                context: false,
                runs: false,
                ..Policy::default()
            }),
            queue: VecDeque::new(),
            sent: 0,
            queued: 0,
            mirror: Mirror::new(cfg.cache_bytes, 1 << 20, cfg.zstd_level),
            cfg,
            pressure: Pressure::CpuBound,
        }
    }

    /// A sender whose bulk literals go through a long context in runs, link-bound.
    fn with_runs() -> Stream {
        let mut s = Stream::new();
        s.coder.policy.context = true;
        s.coder.policy.runs = true;
        s.mirror
            .set_long_context(Some(codec::LongContext::default()), codec::Slots::default());
        s.pressure = Pressure::LinkBound;
        s
    }

    /// One turn; returns the records and the raw bytes they cover.
    fn emit(&mut self, budget: usize) -> (BytesMut, usize) {
        self.emit_within(budget, usize::MAX)
    }

    /// One turn whose records must fit in `room` bytes.
    fn emit_within(&mut self, budget: usize, room: usize) -> (BytesMut, usize) {
        let mut out = BytesMut::new();
        let lim = Limits {
            budget,
            quantum: usize::MAX,
            room,
        };
        let mut stats = EncodeStats::default();
        let n = emit(
            &mut self.coder,
            &mut self.queue,
            self.sent,
            &self.cfg,
            &mut self.mirror,
            self.pressure,
            &lim,
            &mut out,
            &mut stats,
        );
        self.sent += n as u64;
        assert!(self.sent <= self.queued, "sent more than was queued");
        (out, n)
    }
}

/// A stream whose turns make no context record is told apart from one whose turns may
/// ([`Sender::plans_whole`]), and its turns written in place ([`emit`]) are the records the
/// same turns left pending ([`emit_pending`]) write once finished, whichever way each goes.
#[test]
fn turns_written_in_place_are_the_ones_left_pending() {
    let src = data(7, 900_000);
    let (mut a, mut b) = (Stream::new(), Stream::new());
    for s in [&mut a, &mut b] {
        s.mirror.set_workers(Some(Arc::new(codec::prepare::Inline)));
        s.queue.push_back(Bytes::copy_from_slice(&src));
        s.queued = src.len() as u64;
        s.coder.flush_at = s.queued;
    }
    let lim = Limits {
        budget: RAW_TURN,
        quantum: usize::MAX,
        room: usize::MAX,
    };
    let mut stats = EncodeStats::default();
    let mut turns = 0;
    while b.sent < b.queued {
        assert!(b.coder.plans_whole(b.pressure));
        let (x, n) = a.emit(RAW_TURN);
        let mut y = BytesMut::new();
        let m = if turns % 2 == 0 {
            let p = emit_pending(
                &mut b.coder,
                &mut b.queue,
                b.sent,
                &b.cfg,
                &mut b.mirror,
                b.pressure,
                &lim,
                &mut stats,
            );
            assert!(!b.coder.plans_whole(b.pressure), "a turn of it waits");
            let raw = p.raw();
            p.finish(&mut b.coder, &mut b.mirror, &mut y, &mut stats);
            raw
        } else {
            emit(
                &mut b.coder,
                &mut b.queue,
                b.sent,
                &b.cfg,
                &mut b.mirror,
                b.pressure,
                &lim,
                &mut y,
                &mut stats,
            )
        };
        b.sent += m as u64;
        assert_eq!(n, m);
        assert!(x == y, "turn {turns}: {} and {} bytes", x.len(), y.len());
        turns += 1;
    }
    assert!(turns > 3, "{turns} turns");
    // In a long context, link-bound, a turn may make context records; cpu-bound, it makes
    // none until the stream holds a context, and then it may (a run to end).
    let mut c = Stream::with_runs();
    assert!(!c.coder.plans_whole(Pressure::LinkBound));
    assert!(c.coder.plans_whole(Pressure::CpuBound));
    c.queue.push_back(Bytes::copy_from_slice(&src[..300_000]));
    c.queued = 300_000;
    c.coder.flush_at = c.queued;
    let (_, n) = c.emit(RAW_TURN);
    assert!(n > 0);
    assert!(
        !c.coder.plans_whole(Pressure::CpuBound),
        "it holds a context"
    );
}

/// A bulk stream that writes as a client does (64 KiB writes, a turn whenever half a megabyte
/// waits) has its stage allocated at its first turn, once; a stream of a few writes keeps a
/// stage of its size.
#[test]
fn a_streaming_client_gets_its_stage_at_once_and_a_short_one_a_small_one() {
    let src = data(7, 4 << 20);
    for (len, whole) in [(src.len(), true), (40_000, false)] {
        let mut s = Stream::new();
        s.mirror
            .set_workers(Some(std::sync::Arc::new(codec::prepare::Inline)));
        let mut dec = Decoder::with_capacity(s.cfg.cache_bytes, true);
        let (mut got, mut stage) = (Vec::new(), None);
        for w in src[..len].chunks(64 << 10) {
            s.queue.push_back(Bytes::copy_from_slice(w));
            s.queued += w.len() as u64;
            if s.queued == len as u64 {
                s.coder.flush_at = s.queued;
            }
            while s.queued - s.sent >= (512 << 10).min(len as u64 - s.sent) {
                let (y, n) = s.emit(RAW_TURN);
                decode(&mut dec, &y, &mut got);
                let now = (s.coder.stage.as_ptr(), s.coder.stage.capacity());
                assert_eq!(
                    *stage.get_or_insert(now),
                    now,
                    "the stage was allocated again"
                );
                if n == 0 || s.sent == s.queued {
                    break;
                }
            }
        }
        assert!(got == src[..len], "the stream rebuilds");
        let cap = stage.map_or(0, |st| st.1);
        if whole {
            assert!(cap >= super::stage_most(&s.cfg), "a stage of {cap} bytes");
        } else {
            assert!(cap <= 64 << 10, "a stage of {cap} bytes for {len}");
        }
    }
}

/// Decodes every record of `buf`, appending to `out`; returns each record's raw length.
fn decode(dec: &mut Decoder, mut buf: &[u8], out: &mut Vec<u8>) -> Vec<usize> {
    let mut lens = Vec::new();
    while !buf.is_empty() {
        let before = out.len();
        let used = dec.decode_record(buf, out).expect("records decode");
        // A record that rebuilds nothing (a stream log's start) has no chunk.
        if out.len() > before {
            lens.push(out.len() - before);
        }
        buf = &buf[used..];
    }
    lens
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Whatever the application's write sizes, the turn budgets and the flush points, the
    /// records rebuild the stream exactly; every raw byte is sent once.
    #[test]
    fn emit_rebuilds_any_split_exactly(
        seed in any::<u64>(),
        len in 0usize..300_000,
        cuts in proptest::collection::vec((1usize..70_000, 1usize..300_000, any::<bool>()), 1..40),
    ) {
        let src = data(seed, len);
        let mut s = Stream::new();
        let mut dec = Decoder::with_capacity(s.cfg.cache_bytes, true);
        let mut got = Vec::new();
        let mut at = 0;
        for (piece, budget, flush) in cuts {
            let k = piece.min(src.len() - at);
            if k > 0 {
                s.queue.push_back(Bytes::copy_from_slice(&src[at..at + k]));
                s.queued += k as u64;
                at += k;
            }
            if flush {
                s.coder.flush_at = s.queued;
            }
            let (out, _) = s.emit(budget);
            decode(&mut dec, &out, &mut got);
            prop_assert_eq!(&got[..], &src[..got.len()]);
        }
        if at < src.len() {
            s.queue.push_back(Bytes::copy_from_slice(&src[at..]));
            s.queued = src.len() as u64;
        }
        s.coder.flush_at = s.queued;
        for _ in 0..1000 {
            if s.sent == s.queued {
                break;
            }
            let (out, _) = s.emit(RAW_TURN);
            decode(&mut dec, &out, &mut got);
        }
        prop_assert_eq!(got, src);
        prop_assert!(s.queue.iter().all(Bytes::is_empty));
        prop_assert_eq!(s.coder.stage.len(), 0);
    }

    /// Runs of literals (their output still to come when a reference or the frame's end
    /// closes them) never make a frame outgrow its room, and rebuild exactly.
    #[test]
    fn runs_stay_within_the_frame_room(
        seed in any::<u64>(),
        len in 1usize..400_000,
        room in 33_000usize..70_000,
        repeats in proptest::collection::vec((any::<prop::sample::Index>(), 1usize..40_000), 0..16),
    ) {
        // Bytes with earlier pieces repeated: references between runs.
        // The room holds at least a largest chunk, as the link's chunking sees to.
        // Seven bits a byte: literals that shrink a little, so a run's end is most of its
        // raw bytes.
        let text: Vec<u8> = data(seed, len).iter().map(|b| b & 0x7f).collect();
        // New text and repeats of what came before, in turns.
        let step = text.len() / (repeats.len() + 1) + 1;
        let mut src = Vec::new();
        for (i, part) in text.chunks(step).enumerate() {
            src.extend_from_slice(part);
            if let Some((at, n)) = repeats.get(i) {
                let from = at.index(src.len());
                let piece = src[from..(from + n).min(src.len())].to_vec();
                src.extend_from_slice(&piece);
            }
        }
        let mut s = Stream::with_runs();
        let mut dec = Decoder::with_capacity(s.cfg.cache_bytes, true);
        dec.set_long_context(Some(codec::LongContext::default()), codec::Slots::default());
        s.queue.push_back(Bytes::copy_from_slice(&src));
        s.queued = src.len() as u64;
        s.coder.flush_at = s.queued;
        let mut got = Vec::new();
        let mut stream = codec::StreamContext::default();
        for _ in 0..10_000 {
            if s.sent == s.queued {
                break;
            }
            let (out, _) = s.emit_within(RAW_TURN, room);
            prop_assert!(out.len() <= room, "{} bytes in a room of {room}", out.len());
            let mut buf = &out[..];
            while !buf.is_empty() {
                let used = dec.decode_record_in(buf, &mut got, &mut stream).expect("decodes");
                buf = &buf[used..];
            }
        }
        prop_assert!(got == src);
    }

    /// Chunks prepared on workers make the very frames the mirror writes alone, whatever the
    /// write sizes, budgets, rooms and flush points, with and without runs.
    #[test]
    fn prepared_turns_write_the_same_frames(
        seed in any::<u64>(),
        len in 0usize..400_000,
        cuts in proptest::collection::vec((1usize..90_000, 1usize..300_000, 33_000usize..200_000, any::<bool>()), 1..30),
        runs in any::<bool>(),
        repeat in any::<bool>(),
    ) {
        let mut src = data(seed, len);
        if repeat {
            let again = src[..len / 2].to_vec();
            src.extend_from_slice(&again);
        }
        let make = |workers: bool| {
            let mut s = if runs { Stream::with_runs() } else { Stream::new() };
            if workers {
                s.mirror.set_workers(Some(std::sync::Arc::new(codec::prepare::Inline)));
            }
            s
        };
        let (mut a, mut b) = (make(false), make(true));
        let mut dec = Decoder::with_capacity(a.cfg.cache_bytes, true);
        dec.set_long_context(Some(codec::LongContext::default()), codec::Slots::default());
        let mut stream = codec::StreamContext::default();
        let mut got = Vec::new();
        let mut at = 0;
        let steps = cuts.iter().copied().chain(std::iter::repeat_n((usize::MAX, RAW_TURN, 200_000, true), 2000));
        for (piece, budget, room, flush) in steps {
            let k = piece.min(src.len() - at);
            for s in [&mut a, &mut b] {
                if k > 0 {
                    s.queue.push_back(Bytes::copy_from_slice(&src[at..at + k]));
                    s.queued += k as u64;
                }
                if flush {
                    s.coder.flush_at = s.queued;
                }
            }
            at += k;
            let (x, n) = a.emit_within(budget, room);
            let (y, m) = b.emit_within(budget, room);
            prop_assert_eq!(n, m);
            prop_assert!(x == y, "frames of {} and {} bytes", x.len(), y.len());
            let mut buf = &y[..];
            while !buf.is_empty() {
                let used = dec.decode_record_in(buf, &mut got, &mut stream).expect("decodes");
                buf = &buf[used..];
            }
            if at == src.len() && b.sent == b.queued {
                break;
            }
        }
        prop_assert!(got == src);
    }

    /// A bulk stream's stage is allocated once, for the most a turn gathers, at the first turn
    /// that has a whole turn's bytes waiting: whatever the write sizes, budgets and rooms, no
    /// later turn grows it again (which copied it and faulted fresh pages in on the daemon's
    /// thread), and the records still rebuild the stream. Before that, it is no larger than
    /// what was waiting.
    #[test]
    fn a_bulk_streams_stage_is_allocated_once(
        seed in any::<u64>(),
        len in 1usize..1_500_000,
        steps in proptest::collection::vec((1usize..300_000, 1usize..=RAW_TURN, 33_000usize..300_000), 1..40),
    ) {
        let src = data(seed, len);
        let mut s = Stream::new();
        s.mirror.set_workers(Some(std::sync::Arc::new(codec::prepare::Inline)));
        let mut dec = Decoder::with_capacity(s.cfg.cache_bytes, true);
        let (mut got, mut at, mut stage) = (Vec::new(), 0, None);
        let tail = std::iter::repeat((usize::MAX, RAW_TURN, 200_000));
        for (piece, budget, room) in steps.into_iter().chain(tail).take(2000) {
            let k = piece.min(src.len() - at);
            if k > 0 {
                s.queue.push_back(Bytes::copy_from_slice(&src[at..at + k]));
                s.queued += k as u64;
                at += k;
            }
            if at == src.len() {
                s.coder.flush_at = s.queued;
            }
            let waiting = s.queued - s.sent;
            let (y, _) = s.emit_within(budget, room);
            let most = super::stage_most(&s.cfg);
            if waiting >= RAW_TURN as u64 || stage.is_some() {
                let now = (s.coder.stage.as_ptr(), s.coder.stage.capacity());
                prop_assert!(now.1 >= most, "{} bytes of stage", now.1);
                prop_assert_eq!(*stage.get_or_insert(now), now, "the stage was allocated again");
            } else {
                prop_assert!(s.coder.stage.capacity() < most);
            }
            decode(&mut dec, &y, &mut got);
            if at == src.len() && s.sent == s.queued {
                break;
            }
        }
        prop_assert!(got == src);
    }

    /// Without flush points, chunk boundaries are those of the whole stream cut at once, so
    /// a repeat deduplicates however differently its bytes were written.
    #[test]
    fn boundaries_do_not_depend_on_write_sizes(
        seed in any::<u64>(),
        len in 1usize..300_000,
        pieces in proptest::collection::vec(1usize..70_000, 1..40),
    ) {
        let src = data(seed, len);
        let mut s = Stream::new();
        let mut dec = Decoder::with_capacity(s.cfg.cache_bytes, true);
        let (mut got, mut lens) = (Vec::new(), Vec::new());
        let mut at = 0;
        for piece in pieces.iter().cycle() {
            if at == src.len() {
                break;
            }
            let k = (*piece).min(src.len() - at);
            s.queue.push_back(Bytes::copy_from_slice(&src[at..at + k]));
            s.queued += k as u64;
            at += k;
            let (out, _) = s.emit(RAW_TURN);
            lens.extend(decode(&mut dec, &out, &mut got));
        }
        s.coder.flush_at = s.queued;
        let (out, _) = s.emit(usize::MAX);
        lens.extend(decode(&mut dec, &out, &mut got));
        prop_assert_eq!(&got, &src);
        let whole: Vec<usize> = codec::chunks(&src, &s.cfg).map(|(_, l)| l).collect();
        prop_assert_eq!(lens, whole);
    }
}
